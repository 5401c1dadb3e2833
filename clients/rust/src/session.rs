//! A session: the control connection, the shared segment and the client's
//! ends of its rings. This is the batch API: [`Session::submit`] many,
//! [`Session::flush`] once, [`Session::poll`] completions, and
//! [`Session::wait`] when nothing is ready. Single-threaded (`&mut self`);
//! for futures see [`crate::AsyncSession`].

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use slab::Slab;
use stator_ring::control::{self, CONTROL_VERSION, Request as CtlRequest, Response, frame_len};
use stator_ring::cqe::cqe_flags;
use stator_ring::sqe::{CANCEL_SNAPSHOT, CHUNK_SLOT_LEN, iter_mode, sqe_flags};
use stator_ring::{BufRef, ClientRing, Cqe, Doorbell, Opcode, Sqe, Status};
use stator_shm::Segment;
use stator_shm::arena::{ArenaAllocator, ArenaBuf};
use stator_shm::fdpass::recv_fds;

use crate::Error;

type Ring<'a> = ClientRing<'a>;

self_cell::self_cell!(
    struct Mem {
        owner: Segment,
        #[covariant]
        dependent: Ring,
    }
);

/// How to open a session (Flink's view of a subtask).
#[derive(Clone, Debug)]
pub struct OpenOptions {
    pub job: String,
    pub operator: String,
    pub subtask: u32,
    pub parallelism: u32,
    pub max_parallelism: u32,
    /// Queue sizes and arena bytes; 0 takes the daemon's defaults.
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub arena_bytes: u64,
    /// Result buffer for a read whose caller gives no size.
    pub read_capacity: u32,
    /// How long a waiting call spins before it sleeps.
    pub spin: Duration,
    /// 4 MiB chunk slots for portable snapshots (0: the daemon's default).
    pub chunk_slots: u32,
    /// The session's key groups (inclusive) when the engine assigns them
    /// itself; `None`: Flink's range of `subtask` of `parallelism`.
    pub key_groups: Option<(u16, u16)>,
}

impl OpenOptions {
    /// Subtask 0 of 1 of `job`/`operator`, max parallelism 128.
    pub fn new(job: &str, operator: &str) -> OpenOptions {
        OpenOptions {
            job: job.into(),
            operator: operator.into(),
            subtask: 0,
            parallelism: 1,
            max_parallelism: 128,
            sq_entries: 0,
            cq_entries: 0,
            arena_bytes: 0,
            read_capacity: 1024,
            spin: Duration::from_micros(50),
            chunk_slots: 0,
            key_groups: None,
        }
    }
}

/// A state's kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Value,
    List,
    Map,
}

/// What map iteration returns per entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IterMode {
    Keys,
    Values,
    Entries,
}

/// What the engine says about a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notify {
    Complete,
    Abort,
    Subsume,
}

/// What a restore did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    /// Checkpoints whose state was used.
    pub checkpoints: u32,
    /// Segment references added (no byte is copied).
    pub layers: u32,
}

/// One request. Byte slices are copied into shared memory at submit.
#[derive(Clone, Copy, Debug)]
pub struct Request<'a> {
    pub op: Opcode,
    pub state: u32,
    pub key_group: u16,
    pub key: &'a [u8],
    pub namespace: &'a [u8],
    pub user_key: &'a [u8],
    pub value: &'a [u8],
    /// Result buffer size for reads (0: the session's `read_capacity`).
    pub capacity: u32,
    pub arg: u64,
    /// Second argument (the kind of a checkpoint notification).
    pub arg2: u32,
    pub flags: u8,
}

impl<'a> Request<'a> {
    /// A request of `op` on `(state, key_group, key)` with the empty
    /// namespace; set the other fields as the op needs.
    pub fn new(op: Opcode, state: u32, key_group: u16, key: &'a [u8]) -> Request<'a> {
        Request {
            op,
            state,
            key_group,
            key,
            namespace: b"",
            user_key: b"",
            value: b"",
            capacity: 0,
            arg: 0,
            arg2: 0,
            flags: 0,
        }
    }

    /// A checkpoint barrier with id `checkpoint_id`: it takes effect after
    /// every request submitted before it, and completes with the
    /// checkpoint's handle (bytes to keep in the engine's own checkpoint
    /// metadata; give them to [`Session::restore`]).
    pub fn checkpoint(checkpoint_id: u64) -> Request<'a> {
        Request {
            arg: checkpoint_id,
            capacity: 256,
            ..Request::new(Opcode::Checkpoint, 0, 0, b"")
        }
    }

    /// Tells the daemon that checkpoint `checkpoint_id` of this operator
    /// completed, was aborted, or was subsumed: what stays on disk follows
    /// (completed ones are kept up to the daemon's retention count).
    pub fn checkpoint_notify(checkpoint_id: u64, kind: Notify) -> Request<'a> {
        use stator_ring::sqe::notify_kind;
        Request {
            arg: checkpoint_id,
            arg2: match kind {
                Notify::Complete => notify_kind::COMPLETE,
                Notify::Abort => notify_kind::ABORT,
                Notify::Subsume => notify_kind::SUBSUME,
            },
            ..Request::new(Opcode::CheckpointNotify, 0, 0, b"")
        }
    }

    /// Starts a portable export of this session's state (its operator's
    /// states in its key groups) as snapshot `snapshot_id`: a barrier like
    /// a checkpoint, completing once the snapshot is fixed. Then hand chunk
    /// slots to it with [`Request::chunk_release`].
    pub fn snapshot_export(snapshot_id: u64) -> Request<'a> {
        Request {
            arg: snapshot_id,
            ..Request::new(Opcode::SnapshotExport, 0, 0, b"")
        }
    }

    /// Like [`Request::snapshot_export`], but of what retained checkpoints
    /// of this session's operator hold of its key groups: `handles` are
    /// their handles back to back (24 bytes each). The live state is left
    /// as it is.
    pub fn snapshot_export_checkpoints(snapshot_id: u64, handles: &'a [u8]) -> Request<'a> {
        Request {
            arg: snapshot_id,
            value: handles,
            flags: sqe_flags::FROM_CHECKPOINTS,
            ..Request::new(Opcode::SnapshotExport, 0, 0, b"")
        }
    }

    /// Hands chunk slot `slot` to export `snapshot_id`: it completes when
    /// the slot holds the next chunk (`len` bytes, `last` on the last one;
    /// `NotFound` once the export has ended).
    pub fn chunk_release(snapshot_id: u64, slot: u32) -> Request<'a> {
        Request {
            arg: snapshot_id,
            arg2: slot,
            ..Request::new(Opcode::ChunkRelease, 0, 0, b"")
        }
    }

    /// Abandons export `snapshot_id`; slots handed to it come back with
    /// `NotFound`.
    pub fn export_cancel(snapshot_id: u64) -> Request<'a> {
        Request::chunk_release(snapshot_id, CANCEL_SNAPSHOT)
    }

    /// Imports the chunk the client wrote into slot `slot` (see
    /// [`Session::write_chunk`]) as part of import `import_id`; chunks in
    /// order. The last chunk completes once the snapshot is installed
    /// (`last`, `aux` = records); a bad chunk fails with `BadSnapshot` and
    /// nothing of the import is installed.
    pub fn snapshot_import(import_id: u64, slot: u32) -> Request<'a> {
        Request {
            arg: import_id,
            arg2: slot,
            ..Request::new(Opcode::SnapshotImport, 0, 0, b"")
        }
    }

    /// Abandons import `import_id`: nothing of it is installed, and its
    /// chunks waiting for the disk come back.
    pub fn import_cancel(import_id: u64) -> Request<'a> {
        Request::snapshot_import(import_id, CANCEL_SNAPSHOT)
    }

    /// Map iteration of one page (`after`: resume after that user key).
    pub fn map_iter(
        state: u32,
        key_group: u16,
        key: &'a [u8],
        mode: IterMode,
        after: Option<&'a [u8]>,
    ) -> Request<'a> {
        let mut r = Request::new(Opcode::MapIter, state, key_group, key);
        r.arg = match mode {
            IterMode::Keys => iter_mode::KEYS,
            IterMode::Values => iter_mode::VALUES,
            IterMode::Entries => iter_mode::ENTRIES,
        };
        if let Some(a) = after {
            r.user_key = a;
            r.flags |= sqe_flags::ITER_RESUME;
        }
        r
    }
}

/// A request whose byte ranges (arena offsets) the caller wrote itself,
/// inside a reservation it holds (see [`Session::submit_raw`]).
#[derive(Clone, Copy, Debug)]
pub struct RawRequest {
    pub op: Opcode,
    pub flags: u8,
    pub state: u32,
    pub key_group: u16,
    pub key: BufRef,
    pub namespace: BufRef,
    pub user_key: BufRef,
    /// The input value, or the range a read's result is written into.
    pub value: BufRef,
    pub arg: u64,
    pub arg2: u32,
}

/// Writes a value straight into the session's shared arena (see
/// [`Session::submit_with`]). Implements [`std::io::Write`]; writing past
/// the reserved length is an error.
pub struct ValueWriter<'a> {
    arena: &'a stator_shm::ShmView<'a>,
    off: usize,
    cap: usize,
    pos: usize,
}

impl ValueWriter<'_> {
    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

impl std::io::Write for ValueWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() > self.cap - self.pos {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WriteZero,
                format!("value longer than the {} bytes reserved", self.cap),
            ));
        }
        self.arena
            .write_from(self.off + self.pos, buf)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        self.pos += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A completed request, borrowing its result until the callback returns.
#[derive(Debug)]
pub struct Completion<'a> {
    /// The caller's token from `submit`.
    pub token: u64,
    /// `Ok`, `NotFound` or an error status.
    pub status: Result<Status, i32>,
    /// The result bytes (reads that found something).
    pub value: Option<&'a [u8]>,
    /// `MapContains` 1/0, page entry count, no-op echo.
    pub aux: u64,
    /// Map iteration: more entries follow.
    pub more: bool,
    /// With `ResultTooLarge`: the size the result needs.
    pub needed: u32,
    /// Snapshot chunks: the chunk slot this request held (the client's
    /// again now), the chunk's length, and whether it was the last chunk
    /// (export) or the import is installed.
    pub slot: Option<u32>,
    pub len: u32,
    pub last: bool,
}

impl Completion<'_> {
    /// `Ok(())` for `Ok` and `NotFound`, else the error.
    pub fn check(&self) -> Result<(), Error> {
        match self.status {
            Ok(Status::Ok) | Ok(Status::NotFound) => Ok(()),
            Ok(Status::ResultTooLarge) => Err(Error::ResultTooLarge {
                needed: self.needed,
            }),
            Ok(s) => Err(Error::Status(s)),
            Err(code) => Err(Error::Protocol(format!("unknown status {code}"))),
        }
    }
}

struct InFlight {
    token: u64,
    input: Option<ArenaBuf>,
    output: Option<ArenaBuf>,
    /// A reserved value buffer the request took over.
    value: Option<ArenaBuf>,
    /// The chunk slot the request holds.
    slot: Option<u32>,
}

/// An open session.
pub struct Session {
    sock: UnixStream,
    mem: Mem,
    alloc: ArenaAllocator,
    to_daemon: Doorbell,
    to_client: Doorbell,
    inflight: Slab<InFlight>,
    id: u64,
    key_groups: (u16, u16),
    read_capacity: u32,
    spin: Duration,
    dead: Option<String>,
    frame: Vec<u8>,
    scratch: Vec<u8>,
    /// Chunk slots handed to the daemon (a `ChunkRelease` or
    /// `SnapshotImport` not completed yet): the client must not touch them.
    held: Vec<bool>,
    /// Value buffers reserved by the caller and not submitted yet.
    reserved: Slab<ArenaBuf>,
    /// Result buffers of the last `poll_in_place`, read by the caller in
    /// place: freed at the next poll.
    deferred: Vec<ArenaBuf>,
}

/// A value buffer reserved in the session's shared arena: the caller
/// writes the value straight into it ([`Session::reservation_ptr`]) and
/// submits it with [`Session::submit_reserved`] (or gives it back with
/// [`Session::release_reserved`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Names the buffer in later calls.
    pub id: u32,
    /// Bytes the caller may write.
    pub cap: u32,
}

/// Where a submitted request's value comes from.
enum ValueSrc<F> {
    /// `Request::value`, copied in.
    Slice,
    /// Written by the caller's closure, at most this many bytes.
    Writer(u32, F),
    /// A reservation the caller filled, with the bytes it wrote.
    Reserved(u32, u32),
}

fn io_err(e: impl std::fmt::Display) -> Error {
    Error::Protocol(e.to_string())
}

fn read_response(sock: &mut UnixStream, buf: &mut Vec<u8>) -> Result<Response, Error> {
    let mut pre = [0u8; 4];
    sock.read_exact(&mut pre).map_err(Error::gone)?;
    let n = frame_len(pre).map_err(io_err)?;
    buf.resize(n, 0);
    sock.read_exact(buf).map_err(Error::gone)?;
    Response::decode(buf).map_err(io_err)
}

/// A connection to the daemon's control socket.
fn connect(socket: &Path) -> Result<UnixStream, Error> {
    UnixStream::connect(socket).map_err(|e| Error::Connect {
        path: socket.display().to_string(),
        err: e,
    })
}

/// A request the daemon would refuse to decode, refused before it is sent.
fn refused_here(e: control::DecodeError) -> Error {
    Error::InvalidArgument(e.to_string())
}

fn refused(r: Response) -> Error {
    match r {
        Response::Error {
            status, message, ..
        } => Error::Refused { status, message },
        other => Error::Protocol(format!("unexpected control response {other:?}")),
    }
}

/// Tells the daemon at `socket` that the engine no longer references the
/// checkpoints `handles` of `job`'s `operator` (it discarded them: a
/// cancelled job's, subsumed or aborted ones), completed or not; returns
/// how many it held and deleted. Needs no session and claims no job (an
/// engine's coordinator sends it, under the uid that owns the job); a
/// handle of another daemon, or of a checkpoint already gone, deletes
/// nothing. One that does not decode refuses the whole release.
pub fn release_checkpoints(
    socket: impl AsRef<Path>,
    job: &str,
    operator: &str,
    handles: &[&[u8]],
) -> Result<u32, Error> {
    let socket = socket.as_ref();
    let mut frame = Vec::new();
    CtlRequest::Release {
        job: job.to_string(),
        operator: operator.to_string(),
        handles: handles.iter().map(|h| h.to_vec()).collect(),
    }
    .encode(&mut frame)
    .map_err(refused_here)?;
    let mut sock = connect(socket)?;
    sock.write_all(&frame).map_err(Error::gone)?;
    let mut buf = Vec::new();
    match read_response(&mut sock, &mut buf)? {
        Response::Released { released } => Ok(released),
        other => Err(refused(other)),
    }
}

impl Session {
    /// Connects to the daemon's control socket and opens a session.
    pub fn open(socket: impl AsRef<Path>, o: &OpenOptions) -> Result<Session, Error> {
        let socket = socket.as_ref();
        let mut sock = connect(socket)?;
        let mut frame = Vec::new();
        CtlRequest::Open {
            version: CONTROL_VERSION,
            job: o.job.clone(),
            operator: o.operator.clone(),
            subtask: o.subtask,
            parallelism: o.parallelism,
            max_parallelism: o.max_parallelism,
            sq_entries: o.sq_entries,
            cq_entries: o.cq_entries,
            arena_bytes: o.arena_bytes,
            chunk_slots: o.chunk_slots,
            key_groups: o.key_groups,
        }
        .encode(&mut frame)
        .map_err(refused_here)?;
        sock.write_all(&frame).map_err(Error::gone)?;
        // The response carries the fds; it is small and arrives whole.
        let mut buf = vec![0u8; control::MAX_FRAME + 4];
        let (n, fds) = recv_fds(&sock, &mut buf).map_err(io_err)?;
        if n < 4 {
            return Err(Error::gone("the daemon closed the control socket"));
        }
        let len = frame_len(buf[..4].try_into().expect("4 bytes")).map_err(io_err)?;
        let mut got = n;
        while got < len + 4 {
            let m = sock.read(&mut buf[got..len + 4]).map_err(Error::gone)?;
            if m == 0 {
                return Err(Error::gone("the daemon closed the control socket"));
            }
            got += m;
        }
        let (id, key_groups) = match Response::decode(&buf[4..len + 4]).map_err(io_err)? {
            Response::Opened {
                session,
                key_group_lo,
                key_group_hi,
                ..
            } => (session, (key_group_lo, key_group_hi)),
            other => return Err(refused(other)),
        };
        let fds: [OwnedFd; 3] = fds.try_into().map_err(|fds: Vec<OwnedFd>| {
            Error::Protocol(format!("expected 3 fds with Opened, got {}", fds.len()))
        })?;
        Session::attach(sock, fds, id, key_groups, o)
    }

    /// A session whose `Open` was answered on `sock` already: `fds` are
    /// what the `Opened` response carried (the segment, the doorbell to the
    /// daemon, the doorbell to the client, in that order), `id` and
    /// `key_groups` its session id and key groups. [`Session::open`] ends
    /// here; a process that runs the daemon's shard itself (a simulator
    /// driving it deterministically) hands its clients sessions so.
    pub fn attach(
        sock: UnixStream,
        [memfd, to_daemon, to_client]: [OwnedFd; 3],
        id: u64,
        key_groups: (u16, u16),
        o: &OpenOptions,
    ) -> Result<Session, Error> {
        let to_client = Doorbell::from_fd(to_client);
        let to_daemon = Doorbell::from_fd(to_daemon);
        let seg = Segment::attach(memfd).map_err(io_err)?;
        let mem = Mem::try_new(seg, |s| ClientRing::attach(s.view())).map_err(io_err)?;
        let arena_len = mem.borrow_dependent().layout().arena.len;
        let chunk_slots = (mem.borrow_dependent().layout().chunk_len / CHUNK_SLOT_LEN) as u32;
        Ok(Session {
            sock,
            mem,
            alloc: ArenaAllocator::new(arena_len),
            to_daemon,
            to_client,
            inflight: Slab::new(),
            id,
            key_groups,
            read_capacity: o.read_capacity.max(64),
            spin: o.spin,
            dead: None,
            frame: Vec::new(),
            scratch: Vec::new(),
            held: vec![false; chunk_slots as usize],
            reserved: Slab::new(),
            deferred: Vec::new(),
        })
    }

    /// The daemon's id of this session.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// This session's inclusive key-group range.
    pub fn key_groups(&self) -> (u16, u16) {
        self.key_groups
    }

    /// Requests submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// Completions ready to poll now.
    pub fn ready(&mut self) -> Result<usize, Error> {
        self.alive()?;
        if self.mem.borrow_dependent().daemon_broken() {
            return Err(self.unasked());
        }
        match self.mem.with_dependent_mut(|_, ring| ring.cq.available()) {
            Ok(n) => Ok(n as usize),
            Err(e) => Err(self.kill(format!("the completion queue is inconsistent: {e}"))),
        }
    }

    /// Registers (or finds) a state; returns its id in this session.
    pub fn register(&mut self, name: &str, kind: Kind) -> Result<u32, Error> {
        self.alive()?;
        let kind = match kind {
            Kind::Value => control::kind::VALUE,
            Kind::List => control::kind::LIST,
            Kind::Map => control::kind::MAP,
        };
        CtlRequest::Register {
            kind,
            name: name.into(),
        }
        .encode(&mut self.frame)
        .map_err(refused_here)?;
        self.sock.write_all(&self.frame).map_err(Error::gone)?;
        let mut buf = Vec::new();
        match read_response(&mut self.sock, &mut buf)? {
            Response::Registered { state } => Ok(state),
            other => Err(refused(other)),
        }
    }

    /// Replaces this session's state (its operator's states in its
    /// key-group range) by what the checkpoints `handles` hold of that
    /// range: the handles of the previous run's subtasks whose ranges
    /// overlap this one (several after a rescale). Segments are
    /// referenced, not copied. Call it before submitting requests. A handle
    /// of another job or operator, or one that was altered or is no longer
    /// retained, is refused and nothing changes.
    pub fn restore(&mut self, handles: &[&[u8]]) -> Result<Restored, Error> {
        self.alive()?;
        CtlRequest::Restore {
            handles: handles.iter().map(|h| h.to_vec()).collect(),
        }
        .encode(&mut self.frame)
        .map_err(refused_here)?;
        self.sock.write_all(&self.frame).map_err(Error::gone)?;
        let mut buf = Vec::new();
        match read_response(&mut self.sock, &mut buf)? {
            Response::Restored {
                checkpoints,
                layers,
            } => Ok(Restored {
                checkpoints,
                layers,
            }),
            other => Err(refused(other)),
        }
    }

    /// Chunk slots of this session's chunk region (4 MiB each).
    pub fn chunk_slots(&self) -> u32 {
        self.held.len() as u32
    }

    fn slot_off(&self, slot: u32, len: usize) -> Result<usize, Error> {
        if self.held.get(slot as usize) != Some(&false) || len > CHUNK_SLOT_LEN {
            return Err(Error::Protocol(format!(
                "chunk slot {slot} is not this client's, or {len} bytes exceed a slot"
            )));
        }
        Ok(self.mem.borrow_dependent().layout().chunk_off + slot as usize * CHUNK_SLOT_LEN)
    }

    /// The first `len` bytes of chunk slot `slot`, read in place (a chunk
    /// an export completion announced; hand it on, then release the slot
    /// again). Refused for a slot handed to the daemon.
    pub fn chunk(&self, slot: u32, len: usize) -> Result<&[u8], Error> {
        let off = self.slot_off(slot, len)?;
        // SAFETY: the daemon writes a slot only while it holds it (from a
        // `ChunkRelease` or `SnapshotImport` to its completion); `held`
        // tracks that and refuses such slots, and the slice borrows `self`,
        // so no submit can hand the slot over while it lives.
        unsafe { self.mem.borrow_owner().view().slice(off, len) }.map_err(io_err)
    }

    /// Where chunk slot `slot` (4 MiB) lies in this process, for reading an
    /// exported chunk or writing a chunk to import in place. Refused for a
    /// slot handed to the daemon. The pointer stays valid while the session
    /// lives; the slot's bytes are the caller's until it submits a request
    /// that hands the slot over.
    pub fn chunk_slot_ptr(&self, slot: u32) -> Result<std::ptr::NonNull<u8>, Error> {
        let off = self.slot_off(slot, CHUNK_SLOT_LEN)?;
        self.mem
            .borrow_owner()
            .view()
            .raw_range(off, CHUNK_SLOT_LEN)
            .map_err(io_err)
    }

    /// Copies a chunk into slot `slot` (for [`Request::snapshot_import`]).
    pub fn write_chunk(&mut self, slot: u32, chunk: &[u8]) -> Result<(), Error> {
        let off = self.slot_off(slot, chunk.len())?;
        self.mem
            .borrow_owner()
            .view()
            .write_from(off, chunk)
            .map_err(io_err)
    }

    /// Exports this session's state as snapshot `snapshot_id`, handing each
    /// chunk to `sink` in order while it sits in shared memory (every slot
    /// is kept busy: the daemon fills the next while `sink` runs). Needs no
    /// other request in flight. Returns the chunks' count.
    pub fn export_snapshot(
        &mut self,
        snapshot_id: u64,
        sink: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u32, Error> {
        self.export_with(Request::snapshot_export(snapshot_id), sink)
    }

    /// Exports what the retained checkpoints `handles` of this session's
    /// operator hold of its key groups, as snapshot `snapshot_id`, the way
    /// [`Session::export_snapshot`] does; the live state is left as it is.
    pub fn export_checkpoints(
        &mut self,
        snapshot_id: u64,
        handles: &[&[u8]],
        sink: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u32, Error> {
        let joined = handles.concat();
        self.export_with(
            Request::snapshot_export_checkpoints(snapshot_id, &joined),
            sink,
        )
    }

    fn export_with(
        &mut self,
        start: Request<'_>,
        mut sink: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<u32, Error> {
        if self.in_flight() > 0 || self.chunk_slots() == 0 {
            return Err(Error::Protocol(
                "export_snapshot needs an idle session with chunk slots".into(),
            ));
        }
        let snapshot_id = start.arg;
        const START: u64 = u64::MAX;
        self.submit(&start, START)?;
        self.flush()?;
        self.wait_one(START)?;
        for slot in 0..self.chunk_slots() {
            self.submit(&Request::chunk_release(snapshot_id, slot), slot as u64)?;
        }
        self.flush()?;
        // Chunks are handed on in index order (`aux`), whatever order
        // their completions are read in.
        let mut next = 0u32;
        let mut done = false;
        let mut failed: Option<Error> = None;
        let mut ready: Vec<(u32, u32, u32, bool)> = Vec::new();
        while self.in_flight() > 0 {
            self.wait(None)?;
            self.poll(|c| {
                if let Err(e) = c.check() {
                    failed.get_or_insert(e);
                }
                if c.status == Ok(Status::Ok) {
                    ready.push((c.aux as u32, c.slot.unwrap_or(0), c.len, c.last));
                }
            })?;
            while let Some(i) = ready.iter().position(|r| r.0 == next) {
                let (_, slot, len, last) = ready.swap_remove(i);
                if failed.is_none()
                    && let Err(e) = sink(self.chunk(slot, len as usize)?)
                {
                    failed = Some(Error::Protocol(format!("the chunk sink failed: {e}")));
                    self.submit(&Request::export_cancel(snapshot_id), u64::MAX - 1)?;
                }
                next += 1;
                done |= last;
                if !done && failed.is_none() {
                    self.submit(&Request::chunk_release(snapshot_id, slot), slot as u64)?;
                }
            }
            self.flush()?;
        }
        match failed {
            Some(e) => Err(e),
            None if done => Ok(next),
            None => Err(Error::Protocol(
                "the export ended without its last chunk".into(),
            )),
        }
    }

    /// Imports a snapshot from `chunks` (in order), as import `import_id`,
    /// keeping every slot busy. Needs no other request in flight. Returns
    /// the records installed.
    pub fn import_snapshot<C: AsRef<[u8]>>(
        &mut self,
        import_id: u64,
        chunks: impl IntoIterator<Item = C>,
    ) -> Result<u64, Error> {
        let mut chunks = chunks.into_iter();
        self.import_snapshot_with(import_id, |s, slot| match chunks.next() {
            Some(c) => s.write_chunk(slot, c.as_ref()).map(|()| true),
            None => Ok(false),
        })
    }

    /// Imports a snapshot as import `import_id`, keeping every slot busy:
    /// `fill(session, slot)` puts the next chunk into chunk slot `slot`
    /// (with [`Session::write_chunk`], or in place through
    /// [`Session::chunk_slot_ptr`]) and returns `true`, or returns `false`
    /// when there are no more chunks. An error from `fill` cancels the
    /// import and is returned. Needs no other request in flight. Returns
    /// the records installed.
    pub fn import_snapshot_with(
        &mut self,
        import_id: u64,
        mut fill: impl FnMut(&mut Session, u32) -> Result<bool, Error>,
    ) -> Result<u64, Error> {
        if self.in_flight() > 0 || self.chunk_slots() == 0 {
            return Err(Error::Protocol(
                "import_snapshot needs an idle session with chunk slots".into(),
            ));
        }
        let mut records = None;
        let mut failed: Option<Error> = None;
        let mut ended = false;
        let mut free: Vec<u32> = (0..self.chunk_slots()).rev().collect();
        loop {
            while failed.is_none()
                && !ended
                && let Some(slot) = free.last().copied()
            {
                match fill(self, slot) {
                    Ok(true) => {}
                    Ok(false) => {
                        ended = true;
                        break;
                    }
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
                self.submit(&Request::snapshot_import(import_id, slot), slot as u64)?;
                free.pop();
            }
            self.flush()?;
            if self.in_flight() == 0 {
                break;
            }
            self.wait(None)?;
            self.poll(|c| {
                if let Err(e) = c.check() {
                    failed.get_or_insert(e);
                }
                if c.last {
                    records = Some(c.aux);
                }
                free.extend(c.slot);
            })?;
        }
        if records.is_none() {
            // Not installed: make sure the daemon lets go of it (a refused
            // chunk ended it already; chunks that ran out did not). The
            // first error is the one reported.
            const CANCEL: u64 = u64::MAX - 2;
            let cancelled = self
                .submit(&Request::import_cancel(import_id), CANCEL)
                .and_then(|()| self.flush())
                .and_then(|()| self.wait_one(CANCEL));
            if let (None, Err(e)) = (&failed, cancelled) {
                failed = Some(e);
            }
        }
        match (failed, records) {
            (Some(e), _) => Err(e),
            (None, Some(n)) => Ok(n),
            (None, None) => Err(Error::Protocol(
                "the chunks ended before the snapshot's last one".into(),
            )),
        }
    }

    /// Waits for the completion of `token` (the only request in flight).
    fn wait_one(&mut self, token: u64) -> Result<(), Error> {
        let mut r = None;
        while r.is_none() {
            self.wait(None)?;
            self.poll(|c| {
                if c.token == token {
                    r = Some(c.check());
                }
            })?;
        }
        r.expect("set above")
    }

    fn alive(&self) -> Result<(), Error> {
        match &self.dead {
            Some(m) => Err(Error::DaemonGone(m.clone())),
            None => Ok(()),
        }
    }

    /// Queues one request (visible to the daemon at the next
    /// [`Session::flush`]). `Err(Full)` when the submission queue or the
    /// arena has no room: poll completions, then retry.
    pub fn submit(&mut self, r: &Request<'_>, token: u64) -> Result<(), Error> {
        self.submit_inner(
            r,
            token,
            ValueSrc::<fn(&mut ValueWriter<'_>) -> std::io::Result<()>>::Slice,
        )
    }

    /// Queues a write whose value the caller serializes straight into
    /// shared memory (no staging copy): `fill` gets a writer of at most
    /// `max_len` bytes; what it wrote is the value. `r.value` is ignored.
    /// An error from `fill` (say, more than `max_len` bytes) cancels the
    /// request and is returned.
    pub fn submit_with(
        &mut self,
        r: &Request<'_>,
        token: u64,
        max_len: u32,
        fill: impl FnOnce(&mut ValueWriter<'_>) -> std::io::Result<()>,
    ) -> Result<(), Error> {
        if !r.op.fields().value_in {
            return Err(Error::Protocol(format!("{:?} takes no value", r.op)));
        }
        self.submit_inner(r, token, ValueSrc::Writer(max_len, fill))
    }

    /// Reserves a value buffer of `cap` bytes in shared memory, for a value
    /// the caller writes in place (through [`Session::reservation_ptr`])
    /// and then submits with [`Session::submit_reserved`]. `Err(Full)` when
    /// the arena has no room: poll completions, then retry.
    pub fn reserve_value(&mut self, cap: u32) -> Result<Reservation, Error> {
        self.alive()?;
        if !self.alloc.could_ever_fit(&[cap]) {
            return Err(Error::TooLarge);
        }
        let b = self.alloc.alloc(cap.max(1)).ok_or(Error::Full)?;
        let id = self.reserved.insert(b);
        Ok(Reservation {
            id: id as u32,
            cap: b.cap,
        })
    }

    /// Where reservation `id` lies in this process (valid until it is
    /// submitted, released or the session is dropped); `None` for an id
    /// not reserved. Writing through the pointer is the caller's business:
    /// nothing else touches the buffer until it is submitted.
    pub fn reservation_ptr(&self, id: u32) -> Option<std::ptr::NonNull<u8>> {
        let b = self.reserved.get(id as usize)?;
        self.mem
            .borrow_dependent()
            .arena()
            .raw_range(b.off as usize, b.cap as usize)
            .ok()
    }

    /// Queues a write whose value is the first `len` bytes of reservation
    /// `id`, with no copy. The request owns the buffer from here on. On an
    /// error (say `Full`) the reservation stays the caller's.
    pub fn submit_reserved(
        &mut self,
        r: &Request<'_>,
        token: u64,
        id: u32,
        len: u32,
    ) -> Result<(), Error> {
        if !r.op.fields().value_in {
            return Err(Error::Protocol(format!("{:?} takes no value", r.op)));
        }
        match self.reserved.get(id as usize) {
            None => return Err(Error::Protocol(format!("no value buffer {id} is reserved"))),
            Some(b) if len > b.cap => {
                return Err(Error::Protocol(format!(
                    "{len} bytes exceed the {} reserved",
                    b.cap
                )));
            }
            Some(_) => {}
        }
        self.submit_inner(
            r,
            token,
            ValueSrc::<fn(&mut ValueWriter<'_>) -> std::io::Result<()>>::Reserved(id, len),
        )
    }

    /// The capacity of reservation `id` (`None`: not reserved).
    pub fn reservation_cap(&self, id: u32) -> Option<u32> {
        self.reserved.get(id as usize).map(|b| b.cap)
    }

    /// Where the whole arena lies in this process, and its length: for a
    /// binding that keeps a view of it (a Java direct buffer) and writes
    /// requests into a reservation of its own, reading results in place.
    /// Valid while the session lives; who may write which bytes when is
    /// `ring/PROTOCOL.md` §8's rule.
    pub fn arena_range(&self) -> (std::ptr::NonNull<u8>, usize) {
        let arena = self.mem.borrow_dependent().arena();
        let len = self.mem.borrow_dependent().layout().arena.len;
        (
            arena
                .raw_range(0, len)
                .expect("the arena lies inside its own view"),
            len,
        )
    }

    /// Where reservation `id` starts in the arena (`None`: not reserved):
    /// the offset [`RawRequest`] ranges are relative to the arena by.
    pub fn reservation_off(&self, id: u32) -> Option<u32> {
        self.reserved.get(id as usize).map(|b| b.off)
    }

    /// Queues a request whose bytes the caller already placed in its
    /// reservation `region` (keys, values, and for a read the range the
    /// daemon writes the result into), with no copy: an engine binding
    /// that serializes straight into shared memory and keeps a region of
    /// it as its own ring of request bytes. Every range must lie inside
    /// the reservation, which stays the caller's: the client frees
    /// nothing at the completion, whose result the caller reads in place
    /// at the range it named. Only keyed requests and `Nop` go this way
    /// (checkpoints and snapshots have their own calls). `Err(Full)` when
    /// the submission queue is full.
    pub fn submit_raw(&mut self, r: &RawRequest, region: u32, token: u64) -> Result<(), Error> {
        self.alive()?;
        if !(r.op.fields().keyed || r.op == Opcode::Nop) {
            return Err(Error::Protocol(format!(
                "{:?} cannot be submitted as a raw request",
                r.op
            )));
        }
        let Some(b) = self.reserved.get(region as usize) else {
            return Err(Error::Protocol(format!("no region {region} is reserved")));
        };
        let (lo, hi) = (u64::from(b.off), u64::from(b.off) + u64::from(b.cap));
        for (what, br) in [
            ("key", r.key),
            ("namespace", r.namespace),
            ("user key", r.user_key),
            ("value", r.value),
        ] {
            let end = u64::from(br.off) + u64::from(br.len);
            if !br.is_none() && (u64::from(br.off) < lo || end > hi) {
                return Err(Error::Protocol(format!(
                    "the {what} range {}+{} lies outside region {region} ({lo}..{hi})",
                    br.off, br.len
                )));
            }
        }
        let sqe = Sqe {
            user_data: self.inflight.vacant_key() as u64,
            opcode: r.op as u8,
            flags: r.flags,
            key_group: r.key_group,
            state_id: r.state,
            key: r.key,
            namespace: r.namespace,
            user_key: r.user_key,
            value: r.value,
            arg: r.arg,
            arg2: r.arg2,
            ..Sqe::default()
        };
        match self.mem.with_dependent_mut(|_, ring| ring.sq.push(&sqe)) {
            Ok(true) => {}
            Ok(false) => return Err(Error::Full),
            Err(e) => return Err(self.kill(format!("the submission queue is inconsistent: {e}"))),
        }
        self.inflight.insert(InFlight {
            token,
            input: None,
            output: None,
            value: None,
            slot: None,
        });
        Ok(())
    }

    /// Gives reservation `id` back unused.
    pub fn release_reserved(&mut self, id: u32) -> Result<(), Error> {
        let b = self
            .reserved
            .try_remove(id as usize)
            .ok_or_else(|| Error::Protocol(format!("no value buffer {id} is reserved")))?;
        self.alloc.free(b);
        Ok(())
    }

    fn submit_inner(
        &mut self,
        r: &Request<'_>,
        token: u64,
        src: ValueSrc<impl FnOnce(&mut ValueWriter<'_>) -> std::io::Result<()>>,
    ) -> Result<(), Error> {
        self.alive()?;
        let slot = match r.op {
            Opcode::SnapshotImport if r.arg2 != CANCEL_SNAPSHOT => Some(r.arg2),
            Opcode::ChunkRelease if r.arg2 != CANCEL_SNAPSHOT => Some(r.arg2),
            _ => None,
        };
        if let Some(sl) = slot
            && self.held.get(sl as usize) != Some(&false)
        {
            return Err(Error::Protocol(format!(
                "chunk slot {sl} is not this client's (out of range, or handed to the daemon)"
            )));
        }
        let fields = r.op.fields();
        let value_in = r.op.value_in(r.flags);
        let value_len = match &src {
            ValueSrc::Writer(n, _) => *n as usize,
            ValueSrc::Slice if value_in => r.value.len(),
            ValueSrc::Slice | ValueSrc::Reserved(..) => 0,
        };
        let in_len = r.key.len() + r.namespace.len() + r.user_key.len() + value_len;
        // What can never fit is not `Full` (which asks the caller to retry).
        let out_len = match (fields.output, r.capacity) {
            (false, _) => 0,
            (true, 0) => self.read_capacity as usize,
            (true, c) => c as usize,
        };
        if in_len > u32::MAX as usize
            || out_len > u32::MAX as usize
            || !self.alloc.could_ever_fit(&[in_len as u32, out_len as u32])
        {
            return Err(Error::TooLarge);
        }
        let value = match src {
            ValueSrc::Reserved(id, _) => Some(id),
            _ => None,
        };
        let ring = self.mem.borrow_dependent();
        let arena = ring.arena();
        let input = if in_len > 0 {
            Some(self.alloc.alloc(in_len as u32).ok_or(Error::Full)?)
        } else {
            None
        };
        let output = if fields.output {
            match self.alloc.alloc(out_len as u32) {
                Some(b) => Some(b),
                None => {
                    if let Some(b) = input {
                        self.alloc.free(b);
                    }
                    return Err(Error::Full);
                }
            }
        } else {
            None
        };
        let mut sqe = Sqe {
            opcode: r.op as u8,
            flags: r.flags,
            key_group: r.key_group,
            state_id: r.state,
            arg: r.arg,
            arg2: r.arg2,
            ..Sqe::default()
        };
        if let ValueSrc::Reserved(id, len) = src
            && len > 0
        {
            sqe.value = BufRef::new(self.reserved[id as usize].off, len);
        }
        if let Some(b) = input {
            let mut at = b.off;
            let mut put = |bytes: &[u8]| -> BufRef {
                if bytes.is_empty() {
                    return BufRef::NONE;
                }
                arena
                    .write_from(at as usize, bytes)
                    .expect("the allocator gives buffers inside the arena");
                let br = BufRef::new(at, bytes.len() as u32);
                at += bytes.len() as u32;
                br
            };
            sqe.key = put(r.key);
            sqe.namespace = put(r.namespace);
            sqe.user_key = put(r.user_key);
            match src {
                ValueSrc::Writer(max, fill) => {
                    let mut w = ValueWriter {
                        arena: &arena,
                        off: at as usize,
                        cap: max as usize,
                        pos: 0,
                    };
                    if let Err(e) = fill(&mut w) {
                        for b in [input, output].into_iter().flatten() {
                            self.alloc.free(b);
                        }
                        return Err(Error::Protocol(format!("the value writer failed: {e}")));
                    }
                    if w.pos > 0 {
                        sqe.value = BufRef::new(at, w.pos as u32);
                    }
                }
                ValueSrc::Slice if value_in => sqe.value = put(r.value),
                ValueSrc::Slice | ValueSrc::Reserved(..) => {}
            }
        }
        if let Some(b) = output {
            sqe.value = BufRef::new(b.off, b.cap);
        }
        sqe.user_data = self.inflight.vacant_key() as u64;
        let pushed = match self.mem.with_dependent_mut(|_, ring| ring.sq.push(&sqe)) {
            Ok(p) => p,
            Err(e) => return Err(self.kill(format!("the submission queue is inconsistent: {e}"))),
        };
        if !pushed {
            for b in [input, output].into_iter().flatten() {
                self.alloc.free(b);
            }
            return Err(Error::Full);
        }
        if let Some(sl) = slot {
            self.held[sl as usize] = true;
        }
        let value = value.map(|id| self.reserved.remove(id as usize));
        self.inflight.insert(InFlight {
            token,
            input,
            output,
            value,
            slot,
        });
        Ok(())
    }

    /// Makes submitted requests visible to the daemon (one tail store), and
    /// wakes it if it sleeps.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.alive()?;
        if self.mem.with_dependent_mut(|_, ring| ring.sq.publish()) {
            self.to_daemon.ring();
        }
        Ok(())
    }

    fn kill(&mut self, why: String) -> Error {
        self.dead.get_or_insert(why.clone());
        Error::DaemonGone(why)
    }

    /// Delivers every completion ready now to `f`; returns how many.
    pub fn poll(&mut self, mut f: impl FnMut(Completion<'_>)) -> Result<usize, Error> {
        self.poll_inner(usize::MAX, false, |c, _| f(c))
    }

    /// Like [`Session::poll`], for a caller that reads results in place
    /// (the C ABI), and at most `max` of them: a completion's `value` is
    /// `None`, and its result, when
    /// there is one, lies at the pointer `f` gets (`len` bytes, in the
    /// shared arena). Those buffers stay the caller's to read until the
    /// next poll of any kind, which frees them; nothing else writes them
    /// meanwhile (the daemon writes a result buffer only while its request
    /// is in flight).
    pub fn poll_in_place(
        &mut self,
        max: usize,
        f: impl FnMut(Completion<'_>, Option<std::ptr::NonNull<u8>>),
    ) -> Result<usize, Error> {
        self.poll_inner(max, true, f)
    }

    fn poll_inner(
        &mut self,
        max: usize,
        in_place: bool,
        mut f: impl FnMut(Completion<'_>, Option<std::ptr::NonNull<u8>>),
    ) -> Result<usize, Error> {
        self.alive()?;
        for b in self.deferred.drain(..) {
            self.alloc.free(b);
        }
        let mut n = 0;
        while n < max {
            let c: Option<Cqe> = match self.mem.with_dependent_mut(|_, ring| ring.cq.pop()) {
                Ok(c) => c,
                Err(e) => {
                    return Err(self.kill(format!("the completion queue is inconsistent: {e}")));
                }
            };
            let Some(c) = c else { break };
            let Some(inf) = self.inflight.try_remove(c.user_data as usize) else {
                return Err(self.kill(format!("completion for unknown request {}", c.user_data)));
            };
            let status = Status::from_i32(c.status).ok_or(c.status);
            let arena = self.mem.borrow_dependent().arena();
            let (mut value, mut at) = (None, None);
            if let (Ok(Status::Ok), Some(b)) = (status, inf.output)
                && c.len <= b.cap
            {
                // The allocator hands out buffers inside the arena and
                // `len <= cap`: neither call below can fail (an early return
                // here would lose a dequeued completion).
                if in_place {
                    at = Some(
                        arena
                            .raw_range(b.off as usize, b.cap as usize)
                            .expect("the allocator gives buffers inside the arena"),
                    );
                    // The caller reads it after the whole batch: start the
                    // cross-core misses now, so they overlap across it.
                    for line in (0..(c.len as usize).min(256)).step_by(64) {
                        arena.prefetch(b.off as usize + line, false);
                    }
                } else {
                    // Copied out: the daemon wrote it before publishing the
                    // completion; the copy keeps shared memory out of `&[u8]`.
                    self.scratch.resize(c.len as usize, 0);
                    arena
                        .read_into(b.off as usize, &mut self.scratch)
                        .expect("the allocator gives buffers inside the arena");
                    value = Some(&self.scratch[..]);
                }
            }
            f(
                Completion {
                    token: inf.token,
                    status,
                    value,
                    aux: c.aux,
                    more: c.flags & cqe_flags::MORE != 0,
                    needed: if status == Ok(Status::ResultTooLarge) {
                        c.len
                    } else {
                        0
                    },
                    slot: inf.slot,
                    len: c.len,
                    last: c.flags & cqe_flags::LAST != 0,
                },
                at,
            );
            if let Some(sl) = inf.slot {
                self.held[sl as usize] = false;
            }
            for b in [inf.input, inf.value].into_iter().flatten() {
                self.alloc.free(b);
            }
            if let Some(b) = inf.output {
                if at.is_some() {
                    self.deferred.push(b);
                } else {
                    self.alloc.free(b);
                }
            }
            n += 1;
        }
        if n > 0 && self.mem.with_dependent_mut(|_, ring| ring.cq.release()) {
            self.to_daemon.ring();
        }
        Ok(n)
    }

    /// Waits until a completion is ready (or `timeout`): spins briefly,
    /// then sleeps on the doorbell and the control socket together, so a
    /// daemon that dies wakes it with [`Error::DaemonGone`].
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<(), Error> {
        self.alive()?;
        let start = Instant::now();
        let deadline = timeout.map(|t| start + t);
        loop {
            if self.ready()? > 0 {
                return Ok(());
            }
            if start.elapsed() < self.spin {
                std::hint::spin_loop();
                continue;
            }
            match self
                .mem
                .with_dependent_mut(|_, ring| ring.cq.prepare_sleep())
            {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(self.kill(format!("the completion queue is inconsistent: {e}")));
                }
            }
            let ms = match deadline {
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        self.mem.with_dependent(|_, ring| ring.cq.end_sleep());
                        return Ok(());
                    }
                    left.as_millis().clamp(1, 1000) as u16
                }
                None => 1000,
            };
            self.sleep(ms)?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(());
            }
        }
    }

    /// Sleeps on the doorbell and the control socket for up to `ms`.
    fn sleep(&mut self, ms: u16) -> Result<(), Error> {
        let (bell, sock) = poll_two(self.to_client.fd(), self.sock.as_fd(), ms)?;
        self.after_sleep(bell, sock)
    }

    /// Announces that the client is about to sleep for completions.
    /// `Ok(true)`: some are there already (do not sleep).
    pub(crate) fn prepare_sleep(&mut self) -> Result<bool, Error> {
        self.mem
            .with_dependent_mut(|_, ring| ring.cq.prepare_sleep())
            .map_err(|e| self.kill(format!("the completion queue is inconsistent: {e}")))
    }

    /// Ends a sleep: clears the flag, drains the doorbell, and notices a
    /// closed control socket.
    pub(crate) fn after_sleep(&mut self, bell: bool, sock: bool) -> Result<(), Error> {
        self.mem.with_dependent(|_, ring| ring.cq.end_sleep());
        if bell {
            self.to_client.drain();
        }
        if sock {
            // The daemon speaks unasked only to say why it ends the
            // session (then closes): readable means that, or closed.
            let mut b = [0u8; 1];
            let r = nix::sys::socket::recv(
                self.sock.as_raw_fd(),
                &mut b,
                nix::sys::socket::MsgFlags::MSG_DONTWAIT | nix::sys::socket::MsgFlags::MSG_PEEK,
            )
            .map_err(std::io::Error::from);
            match r {
                Ok(0) => {
                    return Err(
                        self.kill("the daemon closed the session (it stopped or died)".into())
                    );
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(self.kill(format!("the control socket failed: {e}"))),
                Ok(_) => return Err(self.unasked()),
            }
        }
        Ok(())
    }

    /// What the daemon said unasked, then closed the connection: why it
    /// ended the session (a broken queue, CONTROL.md `QUEUE_BROKEN`).
    fn unasked(&mut self) -> Error {
        let _ = self.sock.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = Vec::new();
        let why = match read_response(&mut self.sock, &mut buf) {
            Ok(Response::Error { message, .. }) => {
                format!("the daemon closed the session: {message}")
            }
            Ok(other) => format!("the daemon closed the session after an unexpected {other:?}"),
            Err(e) => format!("the daemon marked the session broken and closed it ({e})"),
        };
        self.kill(why)
    }

    /// For the caller's own event loop: the fds whose readability means
    /// "call [`Session::disarm`], then poll": the client's doorbell, and
    /// the control socket (readable when the daemon closes it). Watch both
    /// (level-triggered), after [`Session::arm`].
    pub fn event_fds(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        [self.to_client.fd(), self.sock.as_fd()]
    }

    /// Asks the daemon to ring the doorbell at the next completion (call it
    /// before sleeping on [`Session::event_fds`]). `Ok(true)`: completions
    /// are ready already; do not sleep.
    pub fn arm(&mut self) -> Result<bool, Error> {
        self.alive()?;
        self.prepare_sleep()
    }

    /// Ends a sleep begun with [`Session::arm`] (whether or not an fd
    /// woke it): clears the request, drains the doorbell, and notices a
    /// daemon that closed the session ([`Error::DaemonGone`]).
    pub fn disarm(&mut self) -> Result<(), Error> {
        self.alive()?;
        self.after_sleep(true, true)
    }

    /// Whether chunk slot `slot` is handed to the daemon now (`None`: no
    /// such slot).
    pub fn slot_held(&self, slot: u32) -> Option<bool> {
        self.held.get(slot as usize).copied()
    }

    /// Duplicates of the fds a sleeper polls: the client's doorbell and the
    /// control socket (for a waiter that must not hold the session).
    pub(crate) fn wait_fds(&self) -> std::io::Result<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)> {
        Ok((
            self.to_client.fd().try_clone_to_owned()?,
            self.sock.as_fd().try_clone_to_owned()?,
        ))
    }

    /// Marks the session dead with `why` (every later call fails).
    pub(crate) fn fail(&mut self, why: String) -> Error {
        self.kill(why)
    }

    /// Whether the daemon marked the session closing.
    pub fn daemon_closing(&self) -> bool {
        self.mem.borrow_dependent().daemon_closing()
    }

    /// Closes the session (the daemon drops it and its state stays).
    pub fn close(mut self) -> Result<(), Error> {
        self.alive()?;
        CtlRequest::Close
            .encode(&mut self.frame)
            .map_err(refused_here)?;
        self.sock.write_all(&self.frame).map_err(Error::gone)?;
        let mut buf = Vec::new();
        match read_response(&mut self.sock, &mut buf)? {
            Response::Closed => Ok(()),
            other => Err(refused(other)),
        }
    }
}

/// Polls two fds for readability (or hang-up) for up to `ms`.
pub(crate) fn poll_two(
    a: std::os::fd::BorrowedFd<'_>,
    b: std::os::fd::BorrowedFd<'_>,
    ms: u16,
) -> Result<(bool, bool), Error> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut fds = [
        PollFd::new(a, PollFlags::POLLIN),
        PollFd::new(b, PollFlags::POLLIN),
    ];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(io_err(e)),
    }
    let r = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
    Ok((r(&fds[0]), r(&fds[1])))
}
