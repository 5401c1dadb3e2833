//! A shard: one thread, one io_uring, one store, the sessions pinned to it.
//!
//! The loop drains each session's submission queue in batches (copying
//! every descriptor and every byte it names out of shared memory once,
//! then validating), runs the batch against the store with
//! `submit_batch` (which prefetches across the batch), writes results into
//! the client's buffers, and publishes completions with one tail store per
//! session per pass. Reads that need the disk complete later, through the
//! store's poll. When idle it spins for `spin`, then sleeps in the store's
//! io_uring wait, which also covers every session's doorbell and the
//! shard's own control doorbell.
//!
//! A session may have at most as many requests in the daemon as its
//! completion queue has free slots (and `max_in_flight`): a slot is
//! reserved when a descriptor is taken, so a completion always has room
//! and daemon memory never grows with a client that does not reap.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use slab::Slab;
use stator_ring::cqe::cqe_flags;
use stator_ring::queue::QueueError;
use stator_ring::session::TakeBufError;
use stator_ring::sqe::{CANCEL_SNAPSHOT, SegRange, iter_mode, sqe_flags};
use stator_ring::{Cqe, DaemonRing, Doorbell, Opcode, RingLayout, RingParams, Sqe, Status};
use stator_shm::Segment;
use stator_shm::ShmView;
use stator_store::io::UringIo;
use stator_store::snapshot::{CHUNK_LEN, ChunkSlot, HEADER_LEN, StateDesc};
use stator_store::{
    CheckpointSpec, ExportSpec, Fill, ImportSpec, ImportStep, IterMode, KeyRef, Notify, Op, Output,
    RestoreSpec, Restored, StateKind, Store, StoreError, Submitted,
};

use crate::control::{Registry, RegistryView};
use crate::metrics::{OpMetrics, Report, SessionReport, ShardReport, Tally};

type Ring<'a> = DaemonRing<'a>;

self_cell::self_cell!(
    /// A session's mapped segment and the daemon's end of its rings.
    struct Mem {
        owner: Segment,
        #[covariant]
        dependent: Ring,
    }
);

/// What the control side asks of a shard.
pub enum ShardMsg {
    Open {
        session: u64,
        /// Job and operator.
        owner: (String, String),
        /// Subtask, parallelism and max parallelism (for the status socket).
        subtask: (u32, u32, u32),
        params: RingParams,
        key_groups: (u16, u16),
        max_in_flight: u32,
        reply: Sender<Result<SessionFds, String>>,
    },
    /// Adds a state to a session; the reply is its session-local id.
    AddState {
        session: u64,
        kind: StateKind,
        store_id: u32,
        max_states: u32,
        reply: Sender<Result<u32, String>>,
    },
    /// Replaces a session's state by what checkpoints hold of its range.
    Restore {
        session: u64,
        /// Every state id of the session's operator.
        states: Vec<u32>,
        handles: Vec<Vec<u8>>,
        reply: Sender<Result<Restored, StoreError>>,
    },
    Close {
        session: u64,
        reply: Sender<()>,
    },
    Shutdown,
}

/// The fds a client needs: segment, doorbell to the daemon, doorbell to
/// the client (duplicates; the shard keeps its own).
pub struct SessionFds {
    pub memfd: OwnedFd,
    pub to_daemon: OwnedFd,
    pub to_client: OwnedFd,
}

/// The control side's handle on a shard thread.
pub struct ShardHandle {
    pub tx: Sender<ShardMsg>,
    pub bell: Arc<Doorbell>,
    pub live: Arc<Live>,
}

/// What a shard publishes about itself while it runs, for the watchdog,
/// the status line and the status socket: written by the shard thread only.
#[derive(Debug, Default)]
pub struct Live {
    /// Loop iterations: it moves at least once a second while the shard
    /// lives (an idle shard wakes each second), and stops when the shard
    /// is stuck.
    pub beat: AtomicU64,
    /// Per-operation counters and latencies ([`OpMetrics::total`]: the
    /// requests taken so far).
    pub ops: OpMetrics,
    /// Sessions, store and checkpoints, rebuilt every [`REPORT_EVERY`].
    pub report: Report,
    /// Sessions that broke the queue protocol, with why, for the control
    /// connections to tell their clients (`connections.rs`).
    pub broken: BrokenSessions,
}

/// Sessions a shard gave up on, waiting to be told.
#[derive(Debug, Default)]
pub struct BrokenSessions {
    any: std::sync::atomic::AtomicBool,
    list: Mutex<Vec<(u64, String)>>,
}

impl BrokenSessions {
    fn push(&self, session: u64, why: String) {
        self.list
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((session, why));
        self.any.store(true, Ordering::Release);
    }

    /// Those pushed since the last take (cheap when none).
    pub fn take(&self) -> Vec<(u64, String)> {
        if !self.any.swap(false, Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.list.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// How often a shard rebuilds its [`Live::report`].
pub const REPORT_EVERY: Duration = Duration::from_millis(250);

impl ShardHandle {
    /// Sends `m` and wakes the shard.
    pub fn send(&self, m: ShardMsg) -> bool {
        let ok = self.tx.send(m).is_ok();
        self.bell.ring();
        ok
    }
}

/// Counters a shard keeps (for logs now, the status socket later).
#[derive(Default, Debug, Clone, Copy)]
pub struct ShardStats {
    pub requests: u64,
    pub errors: u64,
    pub sleeps: u64,
    pub sessions_opened: u64,
    pub sessions_closed: u64,
}

impl Session {
    /// The client broke the queue protocol: nothing more is taken from or
    /// pushed to its queues. Its `STATE` word says so at once (and its
    /// doorbell wakes it); its control connection then gets `why` and is
    /// closed, which drops the session.
    fn break_off(&mut self, shard: usize, live: &Live, why: String) {
        if self.broken {
            return;
        }
        self.broken = true;
        tracing::warn!(shard, session = self.id, error = %why, "session broke the queue protocol; it is closed");
        self.mem.borrow_dependent().mark_broken();
        self.to_client.ring();
        live.broken.push(self.id, why);
    }
}

struct Session {
    id: u64,
    /// `job \0 operator`: whose checkpoints these are.
    owner: Vec<u8>,
    job: String,
    operator: String,
    /// Subtask, parallelism, max parallelism.
    subtask: (u32, u32, u32),
    /// Queue sizes.
    entries: (u32, u32),
    /// Descriptors taken so far.
    requests: u64,
    opened_unix: u64,
    mem: Mem,
    to_daemon: Doorbell,
    to_client: Doorbell,
    key_groups: (u16, u16),
    /// Session-local state id -> (kind, store-wide state id).
    states: Vec<(StateKind, u32)>,
    /// Descriptors taken whose completion is not pushed yet.
    in_flight: u32,
    max_in_flight: u32,
    /// A doorbell poll is armed in the ring.
    armed: bool,
    /// Completions pushed since the last publish.
    dirty: bool,
    /// Waiting for completion-queue room while descriptors wait.
    cq_blocked: bool,
    /// Its next descriptor waits for the store, and why: what it queued
    /// is not work until then.
    store_wait: Option<StoreWait>,
    /// The client broke the queue protocol; nothing more is taken.
    broken: bool,
    /// 4 MiB slots of the chunk region.
    chunk_slots: u32,
    export: Option<ExportState>,
    import: Option<ImportState>,
}

/// A session's portable export (PROTOCOL.md §5.1): slots the client
/// released to it are filled in order, one chunk each.
struct ExportState {
    snapshot: u64,
    /// The store's export; `None` once it ended (later releases of this
    /// snapshot complete with `NotFound`).
    id: Option<usize>,
    /// Released slots waiting for a chunk: (slot, user_data).
    queue: VecDeque<(u32, u64)>,
    next_chunk: u32,
}

/// A session's import in progress: the client's import id, the store's,
/// and chunks consumed whose completion waits for the disk to catch up
/// (their user_data): a client cannot queue writes faster than the disk
/// takes them.
struct ImportState {
    import: u64,
    id: usize,
    held: VecDeque<u64>,
}

/// States new to the operator one import may register.
const IMPORT_NEW_STATES: usize = 256;

/// Bytes of import writes in flight past which chunk completions wait.
const IMPORT_BACKLOG: usize = 16 << 20;

/// Completes an import's held chunks (`status`) and forgets it.
fn end_import(
    ring: &mut Ring<'_>,
    imp: &mut Option<ImportState>,
    in_flight: &mut u32,
    status: Status,
) -> Result<(), QueueError> {
    if let Some(i) = imp.take() {
        for user_data in i.held {
            *in_flight -= 1;
            push(ring, &Cqe::status(user_data, status))?;
        }
    }
    Ok(())
}

const _: () = assert!(CHUNK_LEN == stator_ring::sqe::CHUNK_SLOT_LEN);

/// A chunk slot in shared memory: written, never read back (the client may
/// be scribbling on it; the CRC is computed from the store's bytes).
struct ShmChunk<'a, 'b> {
    view: &'b ShmView<'a>,
    off: usize,
}

impl ChunkSlot for ShmChunk<'_, '_> {
    fn slot_len(&self) -> usize {
        CHUNK_LEN
    }
    fn write_at(&mut self, off: usize, bytes: &[u8]) {
        // In bounds: the region holds whole slots (checked at open).
        let _ = self.view.write_from(self.off + off, bytes);
    }
}

/// Where a result goes.
#[derive(Clone, Copy, Debug)]
enum Out {
    None,
    Range(SegRange),
    Buf { id: u32, off: usize, len: usize },
}

/// A request waiting for the store.
struct Pending {
    /// The pass that took it (for its latency).
    t0: Instant,
    session: u64,
    user_data: u64,
    op: Opcode,
    out: Out,
    /// The request's `arg` (a checkpoint's id, for its log line).
    arg: u64,
}

/// A validated request of the current batch; byte ranges index `scratch`.
struct Item {
    user_data: u64,
    op: Opcode,
    action: Action,
    flags: u8,
    key_group: u16,
    kind: StateKind,
    state: u32,
    key: Range<usize>,
    ns: Range<usize>,
    uk: Range<usize>,
    val: Range<usize>,
    arg: u64,
    out: Out,
}

const BELL_TOKEN: u64 = 0;
/// The remote tier's eventfd (session ids start at 1 and never reach it).
const REMOTE_TOKEN: u64 = u64::MAX;
/// How many requests ahead the shard starts loading client memory.
const PREFETCH_AHEAD: usize = 8;
/// Bytes of keys and values one batch copies out before it runs: bounds
/// the shard's scratch memory whatever sizes clients name.
const BATCH_BYTES: usize = 8 << 20;

pub struct Shard {
    id: usize,
    store: Store<UringIo>,
    /// Taken only to register the new state names an import brings.
    registry: Arc<Mutex<Registry>>,
    /// What checkpoints and snapshots read, without the registry's lock.
    view: RegistryView,
    sessions: Slab<Session>,
    by_id: HashMap<u64, usize>,
    pending: Slab<Pending>,
    rx: Receiver<ShardMsg>,
    bell: Arc<Doorbell>,
    bell_armed: bool,
    /// The store's remote tier eventfd (a duplicate), and whether the ring
    /// watches it.
    remote_bell: Option<std::os::fd::OwnedFd>,
    remote_armed: bool,
    spin: Duration,
    batch: u32,
    scratch: Vec<u8>,
    items: Vec<Item>,
    tokens: Vec<u64>,
    sqes: Vec<Sqe>,
    ready: Vec<u64>,
    /// A chunk being imported, copied out of shared memory.
    chunk: Vec<u8>,
    stopping: bool,
    pub stats: ShardStats,
    /// Published for the watchdog and the status line.
    live: Arc<Live>,
    /// A session opened or closed, or a checkpoint completed: the report
    /// is rebuilt at the next pass, not at the next period.
    report_now: bool,
}

fn status_of(e: &StoreError) -> Status {
    match e {
        StoreError::Io { .. } => Status::Io,
        StoreError::NoSpace { .. } => Status::NoSpace,
        StoreError::Corrupt { .. } => Status::Corrupt,
        StoreError::TooLarge { .. } => Status::TooLarge,
        // A full disk stops the flushes: say so, not just "busy".
        StoreError::OverBudget { cause, .. } => match **cause {
            StoreError::NoSpace { .. } => Status::NoSpace,
            _ => Status::Busy,
        },
        StoreError::Invalid(_) => Status::BadArgument,
        StoreError::Dir { .. } => Status::Internal,
        StoreError::Restore(_) => Status::BadArgument,
        StoreError::Limit(_) => Status::Busy,
        StoreError::Snapshot(_) => Status::BadSnapshot,
        StoreError::Remote(_) => Status::Remote,
    }
}

/// Why a session's next descriptor waits for its store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoreWait {
    /// A checkpoint, until compaction merges the layers it would name
    /// (`Store::checkpoint_should_wait`).
    Compaction,
    /// An export or import, until others end and leave the memory budget
    /// room for its buffers (`Store::export_should_wait`).
    Memory,
}

impl StoreWait {
    fn why(self) -> &'static str {
        match self {
            StoreWait::Compaction => {
                "a checkpoint waits for compaction to merge the layers it would name"
            }
            StoreWait::Memory => {
                "an export or import waits for others to end: the memory budget has no room for its buffers"
            }
        }
    }
}

/// What a keyed request asks of the store: decided once from its opcode
/// ([`Action::of`], exhaustive), so that no opcode falls through to
/// another's operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Get,
    Put,
    Delete,
    ListAppend,
    ListGet,
    ListReplace,
    MapGet,
    MapPut,
    MapRemove,
    MapContains,
    MapIter,
    Clear,
}

impl Action {
    /// The action of a keyed opcode; `None` for the others (answered
    /// without the store, or checkpoint and snapshot requests).
    fn of(op: Opcode) -> Option<Action> {
        Some(match op {
            Opcode::Get => Action::Get,
            Opcode::Put => Action::Put,
            Opcode::Delete => Action::Delete,
            Opcode::ListAppend => Action::ListAppend,
            Opcode::ListGet => Action::ListGet,
            Opcode::ListReplace => Action::ListReplace,
            Opcode::MapGet => Action::MapGet,
            Opcode::MapPut => Action::MapPut,
            Opcode::MapRemove => Action::MapRemove,
            Opcode::MapContains => Action::MapContains,
            Opcode::MapIter => Action::MapIter,
            Opcode::Clear => Action::Clear,
            Opcode::Nop
            | Opcode::Checkpoint
            | Opcode::CheckpointNotify
            | Opcode::SnapshotExport
            | Opcode::SnapshotImport
            | Opcode::ChunkRelease => return None,
        })
    }

    /// The kind of state it applies to; `None`: any (a clear).
    fn kind(self) -> Option<StateKind> {
        match self {
            Action::Get | Action::Put | Action::Delete => Some(StateKind::Value),
            Action::ListAppend | Action::ListGet | Action::ListReplace => Some(StateKind::List),
            Action::MapGet
            | Action::MapPut
            | Action::MapRemove
            | Action::MapContains
            | Action::MapIter => Some(StateKind::Map),
            Action::Clear => None,
        }
    }
}

/// Pushes one completion into a queue whose room was reserved.
fn push(ring: &mut Ring<'_>, c: &Cqe) -> Result<(), QueueError> {
    match ring.cq.push(c)? {
        true => Ok(()),
        // Room is reserved per taken descriptor; a full queue here means
        // the client moved its head backwards, which push reports itself.
        false => Err(QueueError::BadHead {
            previous: 0,
            head: 0,
            tail: ring.cq.position(),
        }),
    }
}

/// Copies `parts` into the request's result buffer; the completion.
/// A completion with `status` that names the provided buffer `out` holds,
/// if any: every buffer taken is named by its request's completion,
/// whatever the status (PROTOCOL.md §7).
fn answer(user_data: u64, status: Status, out: Out) -> Cqe {
    let mut c = Cqe::status(user_data, status);
    if let Out::Buf { id, .. } = out {
        c.flags |= cqe_flags::BUFFER;
        c.buf_id = id;
    }
    c
}

fn write_result(ring: &Ring<'_>, user_data: u64, out: Out, parts: &[&[u8]]) -> Cqe {
    let need: usize = parts.iter().map(|p| p.len()).sum();
    let mut c = answer(user_data, Status::Ok, out);
    let (off, cap) = match out {
        Out::Range(r) => (r.off, r.len),
        Out::Buf { off, len, .. } => (off, len),
        Out::None => (0, 0),
    };
    if need > cap {
        c.status = Status::ResultTooLarge as i32;
        c.len = need.min(u32::MAX as usize) as u32;
        return c;
    }
    let mut at = off;
    for p in parts {
        if ring.view().write_from(at, p).is_err() {
            c.status = Status::BadRange as i32;
            return c;
        }
        at += p.len();
    }
    c.len = need as u32;
    c
}

/// The completion of a request whose store result is `res`.
fn completion(ring: &Ring<'_>, p: &Pending, res: Result<Output<'_>, StoreError>) -> Cqe {
    let (user_data, out) = (p.user_data, p.out);
    match res {
        Err(StoreError::TooLarge { len, .. }) if p.op == Opcode::MapIter => {
            // Not one entry fits the page: say what buffer would hold it
            // (the page keeps a quarter, at most 64 KiB + 4, for the cursor).
            let mut c = answer(user_data, Status::ResultTooLarge, out);
            c.len = page_buffer_for(len).min(u32::MAX as usize) as u32;
            c
        }
        Err(e) => answer(user_data, status_of(&e), out),
        Ok(Output::Done) => answer(user_data, Status::Ok, out),
        Ok(Output::Contains(b)) => {
            let mut c = answer(user_data, Status::Ok, out);
            c.aux = b as u64;
            c
        }
        Ok(Output::Value(None)) => answer(user_data, Status::NotFound, out),
        Ok(Output::Imported(i)) => {
            let mut c = answer(user_data, Status::Ok, out);
            c.aux = i.records;
            c.flags |= cqe_flags::LAST;
            c
        }
        Ok(Output::Value(Some(v))) => write_result(ring, user_data, out, &[v]),
        Ok(Output::Page {
            data,
            entries,
            last_key,
            more,
        }) => {
            // `data | last user key | u32 its length` (PROTOCOL.md §6).
            let klen = (last_key.len() as u32).to_le_bytes();
            let mut c = write_result(ring, user_data, out, &[data, last_key, &klen]);
            c.aux = entries as u64;
            if more {
                c.flags |= cqe_flags::MORE;
            }
            c
        }
    }
}

impl Shard {
    pub fn new(
        id: usize,
        store: Store<UringIo>,
        rx: Receiver<ShardMsg>,
        bell: Arc<Doorbell>,
        (spin, batch): (Duration, u32),
        registry: Arc<Mutex<Registry>>,
    ) -> Shard {
        let remote_bell = store.remote_fd().and_then(|f| f.try_clone_to_owned().ok());
        let view = registry.lock().unwrap_or_else(|p| p.into_inner()).view();
        Shard {
            id,
            store,
            registry,
            view,
            sessions: Slab::new(),
            by_id: HashMap::new(),
            pending: Slab::new(),
            rx,
            bell,
            bell_armed: false,
            remote_bell,
            remote_armed: false,
            spin,
            batch,
            scratch: Vec::new(),
            items: Vec::new(),
            tokens: Vec::new(),
            sqes: Vec::new(),
            ready: Vec::new(),
            chunk: Vec::new(),
            stopping: false,
            stats: ShardStats::default(),
            live: Arc::default(),
            report_now: false,
        }
    }

    /// Publishes liveness and counters into `live` while it runs.
    pub fn with_live(mut self, live: Arc<Live>) -> Shard {
        self.live = live;
        self
    }

    /// Runs until `Shutdown`: then answers what is in flight, flushes the
    /// store so that state written so far survives a restart, and returns.
    pub fn run(mut self) -> ShardStats {
        let mut idle_since: Option<Instant> = None;
        let mut beat = 0u64;
        let mut reported = Instant::now();
        self.report();
        loop {
            beat += 1;
            self.live.beat.store(beat, Ordering::Relaxed);
            if self.report_now {
                self.maybe_report(Instant::now(), &mut reported);
            }
            self.control();
            if self.stopping {
                self.finish();
                return self.stats;
            }
            let mut progress = false;
            for slot in 0..self.sessions.capacity() {
                if self.sessions.contains(slot) {
                    progress |= self.service(slot);
                }
            }
            progress |= self.reap();
            progress |= self.drive_snapshots();
            self.publish();
            if progress {
                idle_since = None;
                self.yield_to_flush();
                // A busy loop reads the clock for its report only now and
                // then (a pass is a few microseconds at depth 1).
                if beat.is_multiple_of(64) {
                    self.maybe_report(Instant::now(), &mut reported);
                }
                continue;
            }
            let now = Instant::now();
            self.maybe_report(now, &mut reported);
            if now.duration_since(*idle_since.get_or_insert(now)) < self.spin {
                std::hint::spin_loop();
                continue;
            }
            self.sleep();
            idle_since = None;
        }
    }

    /// While a flush falls behind and its sort runs on a helper thread,
    /// sleeps after a busy pass, longer as writes run out of room: on a
    /// host whose cores the shard and its clients fill, the helper would
    /// otherwise run only in their gaps, and writes would stop at once
    /// when the room is gone (for as long as a whole flush) instead of
    /// slowing down smoothly before.
    fn yield_to_flush(&mut self) {
        const MAX_YIELD: Duration = Duration::from_millis(1);
        let headroom = self.store.write_headroom();
        if headroom < 1.0 && self.store.flush_sorting() {
            std::thread::sleep(MAX_YIELD.mul_f64(1.0 - headroom));
        }
    }

    fn control(&mut self) {
        loop {
            let m = match self.rx.try_recv() {
                Ok(m) => m,
                Err(crossbeam_channel::TryRecvError::Empty) => return,
                // The daemon is gone without a word: stop as on Shutdown.
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    self.stopping = true;
                    return;
                }
            };
            match m {
                ShardMsg::Open {
                    session,
                    owner,
                    subtask,
                    params,
                    key_groups,
                    max_in_flight,
                    reply,
                } => {
                    let r = self.open(session, owner, subtask, params, (key_groups, max_in_flight));
                    let _ = reply.send(r);
                }
                ShardMsg::AddState {
                    session,
                    kind,
                    store_id,
                    max_states,
                    reply,
                } => {
                    let r = match self.by_id.get(&session) {
                        None => Err("no such session".to_string()),
                        Some(&slot) => {
                            let s = &mut self.sessions[slot];
                            match s.states.iter().position(|&(_, id)| id == store_id) {
                                Some(i) => Ok(i as u32),
                                None if s.states.len() as u32 >= max_states => Err(format!(
                                    "the session already has {max_states} states (session.max_states)"
                                )),
                                None => {
                                    s.states.push((kind, store_id));
                                    Ok(s.states.len() as u32 - 1)
                                }
                            }
                        }
                    };
                    let _ = reply.send(r);
                }
                ShardMsg::Restore {
                    session,
                    states,
                    handles,
                    reply,
                } => {
                    let r = match self.by_id.get(&session) {
                        None => Err(StoreError::Invalid("no such session")),
                        Some(&slot) => {
                            let s = &self.sessions[slot];
                            let hs: Vec<&[u8]> = handles.iter().map(|h| h.as_slice()).collect();
                            let spec = RestoreSpec {
                                owner: &s.owner,
                                lo: s.key_groups.0,
                                hi: s.key_groups.1,
                                states: &states,
                            };
                            self.store.restore(spec, &hs)
                        }
                    };
                    let _ = reply.send(r);
                }
                ShardMsg::Close { session, reply } => {
                    self.close(session);
                    let _ = reply.send(());
                }
                ShardMsg::Shutdown => self.stopping = true,
            }
        }
    }

    fn open(
        &mut self,
        id: u64,
        (job, operator): (String, String),
        subtask: (u32, u32, u32),
        params: RingParams,
        (key_groups, max_in_flight): ((u16, u16), u32),
    ) -> Result<SessionFds, String> {
        let layout = RingLayout::new(params).map_err(|e| e.to_string())?;
        let seg =
            Segment::create(c"stator-session", layout.total_len).map_err(|e| e.to_string())?;
        let mem = Mem::try_new(seg, |seg| DaemonRing::create(seg.view(), params))
            .map_err(|e| e.to_string())?;
        let to_daemon = Doorbell::new().map_err(|e| e.to_string())?;
        let to_client = Doorbell::new().map_err(|e| e.to_string())?;
        let dup =
            |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().map_err(|e| e.to_string());
        let fds = SessionFds {
            memfd: dup(mem.borrow_owner().fd())?,
            to_daemon: dup(to_daemon.fd())?,
            to_client: dup(to_client.fd())?,
        };
        let mut owner = Vec::with_capacity(job.len() + operator.len() + 1);
        owner.extend_from_slice(job.as_bytes());
        owner.push(0);
        owner.extend_from_slice(operator.as_bytes());
        let slot = self.sessions.insert(Session {
            id,
            owner,
            job,
            operator,
            subtask,
            entries: (params.sq_entries, params.cq_entries),
            requests: 0,
            opened_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            mem,
            to_daemon,
            to_client,
            key_groups,
            states: Vec::new(),
            in_flight: 0,
            max_in_flight: max_in_flight.min(params.cq_entries),
            armed: false,
            dirty: false,
            cq_blocked: false,
            store_wait: None,
            broken: false,
            chunk_slots: (layout.chunk_len / CHUNK_LEN) as u32,
            export: None,
            import: None,
        });
        self.by_id.insert(id, slot);
        self.stats.sessions_opened += 1;
        self.report_now = true;
        tracing::debug!(shard = self.id, session = id, "session opened");
        Ok(fds)
    }

    /// Drops a session: its memory is unmapped here (the client may keep
    /// its own mapping); requests still at the store are answered to no one.
    fn close(&mut self, id: u64) {
        let Some(slot) = self.by_id.remove(&id) else {
            return;
        };
        let s = self.sessions.remove(slot);
        if let Some(id) = s.export.and_then(|e| e.id) {
            self.store.export_cancel(id);
        }
        if let Some(i) = s.import {
            self.store.import_cancel(i.id);
        }
        s.mem.borrow_dependent().mark_closing();
        if s.armed {
            // Fire the armed poll so the ring lets go of the eventfd; its
            // token then names no session and is ignored.
            s.to_daemon.ring();
        }
        self.stats.sessions_closed += 1;
        self.report_now = true;
        tracing::debug!(shard = self.id, session = id, "session closed");
    }

    /// Takes up to one batch of descriptors from session `slot` and runs
    /// them. True if anything was taken.
    fn service(&mut self, slot: usize) -> bool {
        let Shard {
            store,
            registry,
            view,
            sessions,
            pending,
            scratch,
            items,
            tokens,
            sqes,
            stats,
            batch,
            chunk,
            live,
            ..
        } = self;
        let s = &mut sessions[slot];
        if s.broken {
            return false;
        }
        // While a flush is behind, requests are taken in proportion to
        // the room writes have left, and none when there is none (the
        // client's queue fills; reads already taken finish).
        let headroom = store.write_headroom();
        // Bytes of writes this pass may take (see Store::write_room): a
        // burst of large puts waits in its queue instead of piling into
        // memtables past the budget.
        let mut write_room = store.write_room();
        if headroom <= 0.0 {
            return false;
        }
        let sid = s.id;
        let (owner, job, operator) = (&s.owner, &s.job, &s.operator);
        let (kg_lo, kg_hi) = s.key_groups;
        let states = &s.states;
        let in_flight = &mut s.in_flight;
        let max_in_flight = s.max_in_flight;
        let cq_blocked = &mut s.cq_blocked;
        let store_wait = &mut s.store_wait;
        let to_client = &s.to_client;
        let chunk_slots = s.chunk_slots;
        let requests = &mut s.requests;
        let (export, import) = (&mut s.export, &mut s.import);
        let r = s
            .mem
            .with_dependent_mut(|_, ring| -> Result<bool, QueueError> {
                // Runs the batch copied so far (the same borrows each time).
                macro_rules! run_batch {
                    ($t0:ident, $tally:ident) => {
                        run_batch(
                            store,
                            ring,
                            pending,
                            (sid, $t0),
                            in_flight,
                            stats,
                            (&live.ops, &mut $tally),
                            (items, tokens, scratch),
                        )?
                    };
                }
                let avail = ring.sq.available()?;
                if avail == 0 {
                    return Ok(false);
                }
                let room = ring.cq.free_now()?.saturating_sub(*in_flight);
                let room = room.min(max_in_flight.saturating_sub(*in_flight));
                let admit = ((*batch as f64 * headroom).ceil() as u32).max(1);
                let n = avail.min(room).min(admit);
                *cq_blocked = n == 0;
                if n == 0 {
                    return Ok(false);
                }
                let t0 = Instant::now();
                let mut tally = Tally::default();
                *requests += n as u64;
                scratch.clear();
                items.clear();
                sqes.clear();
                for _ in 0..n {
                    let Some(sqe) = ring.sq.pop()? else { break };
                    sqes.push(sqe);
                }
                // Keys were written by the client and sit in its cache: a
                // rolling window of loads ahead overlaps those misses.
                let base = ring.arena().base;
                for q in sqes.iter().take(PREFETCH_AHEAD) {
                    ring.view().prefetch(base + q.key.off as usize, false);
                }
                let mut writes_taken = false;
                for (i, sqe) in sqes.iter().enumerate() {
                    if let Some(q) = sqes.get(i + PREFETCH_AHEAD) {
                        ring.view().prefetch(base + q.key.off as usize, false);
                    }
                    if let Some(op) = Opcode::from_u8(sqe.opcode)
                        && op.fields().value_in
                    {
                        // (Lengths as the client says: an invalid one is
                        // refused by `take`, this only counts.)
                        let len = [sqe.key, sqe.namespace, sqe.user_key, sqe.value]
                            .iter()
                            .map(|b| b.len as usize)
                            .sum::<usize>();
                        if writes_taken && len > write_room {
                            // This write and the rest stay queued until a
                            // flush makes room.
                            let rest = (sqes.len() - i) as u32;
                            ring.sq.unpop(rest);
                            *requests -= u64::from(rest);
                            break;
                        }
                        writes_taken = true;
                        write_room = write_room.saturating_sub(len);
                    }
                    let op = Opcode::from_u8(sqe.opcode);
                    let starts_export = export.as_ref().is_none_or(|e| e.id.is_none());
                    let wait = match op {
                        Some(Opcode::Checkpoint) if store.checkpoint_should_wait() => {
                            Some(StoreWait::Compaction)
                        }
                        Some(Opcode::SnapshotExport)
                            if starts_export && store.export_should_wait() =>
                        {
                            Some(StoreWait::Memory)
                        }
                        Some(Opcode::SnapshotImport)
                            if import.is_none() && store.import_should_wait() =>
                        {
                            Some(StoreWait::Memory)
                        }
                        _ => None,
                    };
                    if let Some(w) = wait {
                        // It and the rest stay queued until compaction
                        // shrinks the layers a checkpoint would name, or
                        // other exports and imports end.
                        if *store_wait != Some(w) {
                            tracing::info!(
                                session = sid,
                                layers = store.stats().segments,
                                "{}",
                                w.why()
                            );
                        }
                        *store_wait = Some(w);
                        let rest = (sqes.len() - i) as u32;
                        ring.sq.unpop(rest);
                        *requests -= u64::from(rest);
                        if i == 0 {
                            return Ok(false);
                        }
                        break;
                    }
                    *store_wait = None;
                    stats.requests += 1;
                    live.ops.request(sqe.opcode);
                    if matches!(
                        op,
                        Some(
                            Opcode::Checkpoint
                                | Opcode::CheckpointNotify
                                | Opcode::SnapshotExport
                                | Opcode::SnapshotImport
                                | Opcode::ChunkRelease
                        )
                    ) {
                        // A barrier: every earlier request takes effect
                        // (or fixes its snapshot) first.
                        run_batch!(t0, tally);
                        let who = (&owner[..], &job[..], &operator[..], (kg_lo, kg_hi));
                        let c = if matches!(op, Some(Opcode::Checkpoint | Opcode::CheckpointNotify))
                        {
                            checkpoint_op(store, ring, sqe, who, view, pending, sid, in_flight)
                        } else {
                            let ctx = SnapshotCtx {
                                registry,
                                view,
                                pending,
                                sid,
                                in_flight,
                                chunk_slots,
                                export,
                                import,
                                chunk,
                            };
                            snapshot_op(store, ring, sqe, who, ctx)?
                        };
                        if let Some(c) = c {
                            if c.status < 0 {
                                live.ops.error(sqe.opcode);
                            }
                            tally.add(op.expect("matched above"));
                            push(ring, &c)?;
                        }
                        continue;
                    }
                    match take(ring, sqe, states, (kg_lo, kg_hi), scratch) {
                        Ok(Some(item)) => {
                            items.push(item);
                            if scratch.len() >= BATCH_BYTES {
                                // Large values: run what is copied so far,
                                // so one batch never holds more than this.
                                run_batch!(t0, tally);
                            }
                        }
                        Ok(None) => {
                            // Answered at once (no-op, not supported here).
                            let c = immediate(sqe);
                            if let Some(op) = op {
                                tally.add(op);
                            }
                            push(ring, &c)?;
                        }
                        Err((st, out)) => {
                            stats.errors += 1;
                            live.ops.error(sqe.opcode);
                            if let Some(op) = op {
                                tally.add(op);
                            }
                            push(ring, &answer(sqe.user_data, st, out))?;
                        }
                    }
                }
                if ring.sq.release() {
                    // The client waits for room in its submission queue.
                    to_client.ring();
                }
                run_batch!(t0, tally);
                tally.record(&live.ops, t0.elapsed().as_nanos() as u64);
                if scratch.capacity() > 2 * BATCH_BYTES {
                    scratch.clear();
                    scratch.shrink_to(BATCH_BYTES);
                }
                // Published per batch, not per pass: the client refills
                // its queue while the next batch runs.
                if ring.cq.publish() {
                    to_client.ring();
                }
                Ok(true)
            });
        match r {
            Ok(progress) => progress,
            Err(e) => {
                s.break_off(self.id, &self.live, e.to_string());
                false
            }
        }
    }

    /// Delivers store completions. True if any.
    fn reap(&mut self) -> bool {
        let Shard {
            id,
            store,
            sessions,
            by_id,
            pending,
            live,
            ..
        } = self;
        let mut orphans: Vec<Vec<u8>> = Vec::new();
        let mut checkpoints = false;
        let shard = *id;
        let now = Instant::now();
        let n = store.poll(|tok, res| {
            let p = pending.remove(tok as usize);
            live.ops
                .latency(p.op, now.saturating_duration_since(p.t0).as_nanos() as u64, 1);
            checkpoints |= p.op == Opcode::Checkpoint;
            // One log line per checkpoint and per installed import (never
            // one per request).
            match (p.op, &res) {
                (Opcode::Checkpoint, Ok(_)) => {
                    tracing::info!(shard, session = p.session, checkpoint = p.arg, "checkpoint taken")
                }
                (Opcode::Checkpoint, Err(e)) => {
                    tracing::warn!(shard, session = p.session, checkpoint = p.arg, error = %e, "checkpoint failed")
                }
                (Opcode::SnapshotImport, Ok(Output::Imported(i))) => {
                    tracing::info!(shard, session = p.session, import = p.arg, records = i.records, "snapshot imported")
                }
                _ => {}
            }
            let Some(&slot) = by_id.get(&p.session) else {
                // A checkpoint whose session closed before it completed:
                // no one holds its handle, so it can never be completed.
                if p.op == Opcode::Checkpoint
                    && let Ok(Output::Value(Some(h))) = res
                {
                    orphans.push(h.to_vec());
                }
                return;
            };
            let s = &mut sessions[slot];
            s.in_flight -= 1;
            s.dirty = true;
            let r = s.mem.with_dependent_mut(|_, ring| {
                let c = completion(ring, &p, res);
                if c.status < 0 {
                    live.ops.error(p.op as u8);
                }
                push(ring, &c)
            });
            if let Err(e) = r {
                s.break_off(shard, live, e.to_string());
            }
        });
        for h in orphans {
            self.store.discard_checkpoint(&h);
        }
        self.report_now |= checkpoints;
        n > 0
    }

    /// Fills the slots clients released to their exports, a bounded step
    /// each, and gives back import chunks held while the disk caught up.
    /// True if a step made progress without waiting.
    fn drive_snapshots(&mut self) -> bool {
        let mut progress = false;
        let Shard {
            id: shard,
            store,
            sessions,
            live,
            ..
        } = self;
        let shard = *shard;
        for (_, s) in sessions.iter_mut() {
            if s.broken {
                continue;
            }
            let in_flight = &mut s.in_flight;
            let (export, import) = (&mut s.export, &mut s.import);
            let r = s.mem.with_dependent_mut(|_, ring| -> Result<bool, QueueError> {
                let mut pushed = false;
                if let Some(i) = import.as_mut()
                    && !i.held.is_empty()
                    && store.import_backlog(i.id) <= IMPORT_BACKLOG
                {
                    for user_data in i.held.drain(..) {
                        *in_flight -= 1;
                        push(ring, &Cqe::status(user_data, Status::Ok))?;
                    }
                    pushed = true;
                }
                let Some(e) = export.as_mut() else {
                    return Ok(pushed);
                };
                let (Some(id), Some(&(slot, user_data))) = (e.id, e.queue.front()) else {
                    return Ok(pushed);
                };
                let off = ring.layout().chunk_off + slot as usize * CHUNK_LEN;
                let mut target = ShmChunk {
                    view: ring.view(),
                    off,
                };
                let mut c = Cqe::status(user_data, Status::Ok);
                match store.export_fill(id, &mut target) {
                    Ok(Fill::Wait) => return Ok(pushed),
                    Ok(Fill::Again) => {
                        progress = true;
                        return Ok(pushed);
                    }
                    Ok(Fill::Chunk { len, last }) => {
                        progress = true;
                        c.len = len as u32;
                        c.aux = e.next_chunk as u64;
                        e.next_chunk += 1;
                        if last {
                            c.flags |= cqe_flags::LAST;
                            e.id = None;
                        }
                    }
                    Err(err) => {
                        live.ops.error(Opcode::ChunkRelease as u8);
                        tracing::warn!(snapshot = e.snapshot, error = %err, "snapshot export failed");
                        c.status = status_of(&err) as i32;
                        e.id = None;
                    }
                }
                e.queue.pop_front();
                *in_flight -= 1;
                push(ring, &c)?;
                if e.id.is_none() {
                    // The export is over: the other released slots go back.
                    end_export(ring, e, in_flight)?;
                }
                Ok(true)
            });
            match r {
                Ok(pushed) => s.dirty |= pushed,
                Err(e) => s.break_off(shard, live, e.to_string()),
            }
        }
        progress
    }

    /// Rebuilds the report if asked to, or if it is [`REPORT_EVERY`] old.
    fn maybe_report(&mut self, now: Instant, reported: &mut Instant) {
        let age = now.duration_since(*reported);
        // Asked for (a session came or went, a checkpoint completed): soon,
        // but at most every 20 ms, so a burst of them costs one rebuild.
        if (self.report_now && age >= Duration::from_millis(20)) || age >= REPORT_EVERY {
            *reported = now;
            self.report_now = false;
            self.report();
        }
    }

    /// Rebuilds the published report: sessions, store, checkpoints.
    fn report(&mut self) {
        let shard = self.id;
        // Dropped jobs' states reach compaction within a report's period.
        self.store
            .set_dropped_states(self.view.get().dropped().clone());
        let sessions = self
            .sessions
            .iter_mut()
            .map(|(_, s)| {
                let (sq_depth, cq_free) = s.mem.with_dependent_mut(|_, ring| {
                    (
                        ring.sq.available().unwrap_or(0),
                        ring.cq.free_now().unwrap_or(0),
                    )
                });
                SessionReport {
                    id: s.id,
                    shard,
                    job: s.job.clone(),
                    operator: s.operator.clone(),
                    subtask: s.subtask.0,
                    parallelism: s.subtask.1,
                    max_parallelism: s.subtask.2,
                    key_group_lo: s.key_groups.0,
                    key_group_hi: s.key_groups.1,
                    states: s.states.len(),
                    in_flight: s.in_flight,
                    sq_depth,
                    cq_depth: s.entries.1.saturating_sub(cq_free),
                    sq_entries: s.entries.0,
                    cq_entries: s.entries.1,
                    requests: s.requests,
                    broken: s.broken,
                    opened_unix: s.opened_unix,
                    export_in_progress: s.export.as_ref().is_some_and(|e| e.id.is_some()),
                    import_in_progress: s.import.is_some(),
                }
            })
            .collect();
        let r = ShardReport {
            at: Instant::now(),
            sessions,
            memory: self.store.memory(),
            store: self.store.stats(),
            checkpoints: self.store.checkpoints(),
            remote: self.store.remote_stats().map(|(_, r)| r),
        };
        self.live.report.set(r);
    }

    /// Publishes the completions of every session that has new ones, and
    /// rings the client's doorbell if it sleeps.
    fn publish(&mut self) {
        for (_, s) in self.sessions.iter_mut() {
            if !s.dirty {
                continue;
            }
            s.dirty = false;
            if s.mem.with_dependent_mut(|_, ring| ring.cq.publish()) {
                s.to_client.ring();
            }
        }
    }

    /// Sleeps until a doorbell, a store completion or a timeout.
    fn sleep(&mut self) {
        self.stats.sleeps += 1;
        let mut work = !self.rx.is_empty();
        // Requests queued while writes are stalled are not work: the
        // shard waits for its store (a flush step or its sort) instead.
        let stalled = self.store.write_headroom() <= 0.0;
        // A wait that is over is work: the store changed in this pass
        // (compaction merged layers, an export or import ended) after the
        // waiting session was looked at.
        let still = |w: StoreWait, store: &Store<UringIo>| match w {
            StoreWait::Compaction => store.checkpoint_should_wait(),
            StoreWait::Memory => store.export_should_wait() && store.import_should_wait(),
        };
        for (_, s) in self.sessions.iter_mut() {
            if s.broken {
                continue;
            }
            let blocked = s.cq_blocked;
            let waits = s.store_wait.is_some_and(|w| still(w, &self.store));
            let in_flight = s.in_flight;
            let r = s
                .mem
                .with_dependent_mut(|_, ring| -> Result<bool, QueueError> {
                    let sq_work = ring.sq.prepare_sleep()?;
                    if !blocked {
                        return Ok(sq_work);
                    }
                    // Descriptors wait for completion room: ask to be woken
                    // when the client frees slots, then look again (it may
                    // have freed them before it could see the flag).
                    ring.cq.prepare_wait()?;
                    Ok(sq_work && ring.cq.free_now()? > in_flight)
                });
            match r {
                Ok(w) => work |= w && !stalled && !waits,
                Err(e) => s.break_off(self.id, &self.live, e.to_string()),
            }
        }
        if !work {
            let io = self.store.io_mut();
            // The control doorbell first: it must never wait behind
            // session polls for room in the ring.
            if !self.bell_armed {
                io.poll_readable(self.bell.fd(), BELL_TOKEN);
                self.bell_armed = true;
            }
            // Remote outcomes (reads, uploads) wake the shard as disk
            // completions do.
            if let Some(fd) = self.remote_bell.as_ref().filter(|_| !self.remote_armed) {
                io.poll_readable(std::os::fd::AsFd::as_fd(fd), REMOTE_TOKEN);
                self.remote_armed = true;
            }
            for (_, s) in self.sessions.iter_mut() {
                if !s.armed && !s.broken {
                    io.poll_readable(s.to_daemon.fd(), s.id);
                    s.armed = true;
                }
            }
            let t = if self.store.busy() || self.store.pending() > 0 {
                Duration::from_millis(1)
            } else if self.report_now {
                // A report is due within 20 ms.
                Duration::from_millis(20)
            } else {
                Duration::from_secs(1)
            };
            // Background work with CPU steps ready (a flush sorting and
            // writing, a checkpoint's manifest to start) runs now, not one
            // step per timeout.
            if self.rx.is_empty() && !self.store.background_runnable() {
                let _ = self.store.wait(Some(t));
            }
        }
        for (_, s) in self.sessions.iter_mut() {
            s.mem.with_dependent_mut(|_, ring| {
                ring.sq.end_sleep();
                ring.cq.end_wait();
            });
        }
        self.ready.clear();
        self.store.io_mut().take_ready(&mut self.ready);
        for &t in &self.ready {
            if t == BELL_TOKEN {
                self.bell.drain();
                self.bell_armed = false;
            } else if t == REMOTE_TOKEN {
                // The store's poll takes the outcomes (and reads the bell).
                self.remote_armed = false;
            } else if let Some(&slot) = self.by_id.get(&t) {
                let s = &mut self.sessions[slot];
                s.to_daemon.drain();
                s.armed = false;
            }
        }
    }

    /// Shutdown: one last pass over every queue, every read finished and
    /// answered, completions published, then the memtable flushed.
    fn finish(&mut self) {
        for (_, s) in self.sessions.iter() {
            s.mem.borrow_dependent().mark_closing();
        }
        // Answer everything already submitted: take and run batches, and
        // deliver reads from disk, until every queue is empty (or a client
        // that does not reap has left no completion room) or 10 s passed.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut progress = false;
            for slot in 0..self.sessions.capacity() {
                if self.sessions.contains(slot) {
                    progress |= self.service(slot);
                }
            }
            progress |= self.reap();
            progress |= self.drive_snapshots();
            self.publish();
            if Instant::now() >= deadline || (!progress && self.store.pending() == 0) {
                break;
            }
            if !progress {
                let _ = self.store.wait(Some(Duration::from_millis(5)));
            }
        }
        for (_, s) in self.sessions.iter_mut() {
            // Exports and imports still open end here: their slots go back.
            let (export, import, in_flight) = (&mut s.export, &mut s.import, &mut s.in_flight);
            let _ = s
                .mem
                .with_dependent_mut(|_, ring| -> Result<(), QueueError> {
                    if let Some(e) = export.as_mut() {
                        end_export(ring, e, in_flight)?;
                    }
                    end_import(ring, import, in_flight, Status::ShuttingDown)?;
                    ring.cq.publish();
                    Ok(())
                });
            // Clients sleeping for completions see `closing` now.
            s.to_client.ring();
        }
        // A stop flushes the memtables and finishes what was promised
        // (checkpoints, deletes, uploads); a compaction backlog waits for
        // the next start rather than holding the stop past systemd's
        // TimeoutStopSec.
        self.store.stop_compacting();
        self.store.flush();
        self.store.settle();
        tracing::info!(
            shard = self.id,
            stats = ?self.stats,
            layers = self.store.stats().segments,
            "shard stopped"
        );
    }
}

/// Runs the validated requests of a batch (bytes in `scratch`) through the
/// store and pushes the completions of those answered at once; the others
/// complete through [`Shard::reap`]. Leaves the batch empty.
#[allow(clippy::too_many_arguments)]
fn run_batch(
    store: &mut Store<UringIo>,
    ring: &mut Ring<'_>,
    pending: &mut Slab<Pending>,
    (sid, t0): (u64, Instant),
    in_flight: &mut u32,
    stats: &mut ShardStats,
    (ops_m, tally): (&OpMetrics, &mut Tally),
    (items, tokens, scratch): (&mut Vec<Item>, &mut Vec<u64>, &mut Vec<u8>),
) -> Result<(), QueueError> {
    if items.is_empty() {
        return Ok(());
    }
    tokens.clear();
    for it in items.iter() {
        tokens.push(pending.insert(Pending {
            t0,
            session: sid,
            user_data: it.user_data,
            op: it.op,
            out: it.out,
            arg: 0,
        }) as u64);
    }
    let sc = &scratch[..];
    let ops: Vec<Op<'_>> = items.iter().map(|it| op_of(it, sc)).collect();
    let mut err: Result<(), QueueError> = Ok(());
    store.submit_batch(tokens, &ops, |i, res| {
        // The result buffer a few requests ahead: write intent.
        if let Some(Out::Range(r)) = items.get(i + PREFETCH_AHEAD).map(|it| it.out) {
            ring.view().prefetch(r.off, true);
            ring.view().prefetch(r.off + 64, true);
        }
        let tok = tokens[i] as usize;
        let (p, res) = match res {
            Ok(Submitted::Pending) => {
                *in_flight += 1;
                return;
            }
            Ok(Submitted::Ready(o)) => (pending.remove(tok), Ok(o)),
            Err(e) => {
                stats.errors += 1;
                (pending.remove(tok), Err(e))
            }
        };
        tally.add(p.op);
        let c = completion(ring, &p, res);
        if c.status < 0 {
            ops_m.error(p.op as u8);
        }
        if err.is_ok() {
            err = push(ring, &c);
        }
    });
    drop(ops);
    items.clear();
    scratch.clear();
    err
}

/// The completion of a request answered without the store.
fn immediate(sqe: &Sqe) -> Cqe {
    match Opcode::from_u8(sqe.opcode) {
        Some(Opcode::Nop) => {
            let mut c = Cqe::status(sqe.user_data, Status::Ok);
            c.aux = sqe.arg;
            c
        }
        _ => Cqe::status(sqe.user_data, Status::Unsupported),
    }
}

type Refusal = (Status, Out);

/// Validates a descriptor (already copied out of shared memory) and copies
/// the bytes it names into `scratch`. `Ok(None)`: answered without the
/// store. `Err`: refused with that status (naming the provided buffer it
/// consumed, if any).
fn take(
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    states: &[(StateKind, u32)],
    key_groups: (u16, u16),
    scratch: &mut Vec<u8>,
) -> Result<Option<Item>, Refusal> {
    let v = sqe
        .validate(ring.arena())
        .map_err(|e| (Status::from(e), Out::None))?;
    match Action::of(v.op) {
        Some(action) => take_keyed(ring, &v, states, key_groups, scratch, action),
        // Not keyed: answered without the store.
        None => Ok(None),
    }
}

fn take_keyed(
    ring: &mut Ring<'_>,
    v: &stator_ring::ValidSqe,
    states: &[(StateKind, u32)],
    (kg_lo, kg_hi): (u16, u16),
    scratch: &mut Vec<u8>,
    action: Action,
) -> Result<Option<Item>, Refusal> {
    let &(kind, state) = states
        .get(v.state_id as usize)
        .ok_or((Status::BadState, Out::None))?;
    if action.kind().is_some_and(|w| w != kind) {
        return Err((Status::BadState, Out::None));
    }
    if v.key_group < kg_lo || v.key_group > kg_hi {
        return Err((Status::BadKeyGroup, Out::None));
    }
    if action == Action::MapIter
        && !matches!(
            v.arg,
            iter_mode::KEYS | iter_mode::VALUES | iter_mode::ENTRIES
        )
    {
        return Err((Status::BadArgument, Out::None));
    }
    let fields = v.op.fields();
    let out = take_out(ring, v)?;
    let refuse = |st: Status| (st, out);
    // Sizes are checked before anything is copied: a range may span the
    // whole arena, and only the store's limits are worth copying.
    let part = stator_store::keys::MAX_PART_LEN;
    if v.key.len > part
        || v.namespace.len > part
        || v.user_key.len > part
        || (fields.value_in && v.value.len > stator_store::MAX_VALUE_LEN)
    {
        return Err(refuse(Status::TooLarge));
    }
    let mut copy = |r: SegRange| -> Result<Range<usize>, Refusal> {
        let start = scratch.len();
        scratch.resize(start + r.len, 0);
        ring.view()
            .read_into(r.off, &mut scratch[start..])
            .map_err(|_| refuse(Status::BadRange))?;
        Ok(start..start + r.len)
    };
    let key = copy(v.key)?;
    let ns = copy(v.namespace)?;
    let uk = copy(v.user_key)?;
    let val = if fields.value_in {
        copy(v.value)?
    } else {
        0..0
    };
    Ok(Some(Item {
        user_data: v.user_data,
        op: v.op,
        action,
        flags: v.flags,
        key_group: v.key_group,
        kind,
        state,
        key,
        ns,
        uk,
        val,
        arg: v.arg,
        out,
    }))
}

/// Where a request's result goes: nowhere, the range it names, or a
/// provided buffer taken now (a bad one is named in the refusal: the
/// client learns the id is its own again).
fn take_out(ring: &mut Ring<'_>, v: &stator_ring::ValidSqe) -> Result<Out, Refusal> {
    if !v.op.fields().output {
        return Ok(Out::None);
    }
    if !v.buffer_select() {
        return Ok(Out::Range(v.value));
    }
    match ring.take_buffer() {
        Ok(Some(b)) => Ok(Out::Buf {
            id: b.buf_id,
            off: b.seg_off,
            len: b.len,
        }),
        Ok(None) | Err(TakeBufError::NoRing) => Err((Status::NoBuffer, Out::None)),
        Err(TakeBufError::Bad(b)) => Err((
            Status::BadBuffer,
            Out::Buf {
                id: b.buf_id,
                off: 0,
                len: 0,
            },
        )),
        Err(TakeBufError::Queue(_)) => Err((Status::BadBuffer, Out::None)),
    }
}

/// Whose checkpoints a session takes: `(owner, job, operator, key groups)`.
type Owner<'a> = (&'a [u8], &'a str, &'a str, (u16, u16));

/// A checkpoint barrier or notification (every earlier request of the
/// session has been run). `None`: the checkpoint completes later, through
/// the store's poll.
#[allow(clippy::too_many_arguments)]
fn checkpoint_op(
    store: &mut Store<UringIo>,
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    (owner, job, operator, (lo, hi)): Owner<'_>,
    view: &RegistryView,
    pending: &mut Slab<Pending>,
    sid: u64,
    in_flight: &mut u32,
) -> Option<Cqe> {
    let v = match sqe.validate(ring.arena()) {
        Ok(v) => v,
        Err(e) => return Some(Cqe::status(sqe.user_data, Status::from(e))),
    };
    if v.op == Opcode::CheckpointNotify {
        use stator_ring::sqe::notify_kind;
        let kind = match v.arg2 {
            notify_kind::COMPLETE => Notify::Complete,
            notify_kind::ABORT => Notify::Abort,
            notify_kind::SUBSUME => Notify::Subsume,
            _ => return Some(Cqe::status(v.user_data, Status::BadArgument)),
        };
        // Answered once a completion is durable (its marker, written in
        // the store's background); at once otherwise.
        let tok = pending.insert(Pending {
            t0: Instant::now(),
            session: sid,
            user_data: v.user_data,
            op: v.op,
            out: Out::None,
            arg: v.arg,
        });
        store.checkpoint_notify_acked(owner, v.arg, kind, tok as u64);
        *in_flight += 1;
        return None;
    }
    let out = match take_out(ring, &v) {
        Ok(o) => o,
        Err((st, out)) => return Some(answer(v.user_data, st, out)),
    };
    let (states, meta) = view.get().operator_states(job, operator);
    let tok = pending.insert(Pending {
        t0: Instant::now(),
        session: sid,
        user_data: v.user_data,
        op: v.op,
        out,
        arg: v.arg,
    });
    let spec = CheckpointSpec {
        owner: owner.to_vec(),
        checkpoint_id: v.arg,
        lo,
        hi,
        states,
        meta,
    };
    match store.checkpoint(tok as u64, spec) {
        Ok(()) => {
            *in_flight += 1;
            None
        }
        Err(e) => {
            let p = pending.remove(tok);
            Some(completion(ring, &p, Err(e)))
        }
    }
}

/// What a snapshot request may touch of its shard and session.
struct SnapshotCtx<'s> {
    registry: &'s Mutex<Registry>,
    view: &'s RegistryView,
    pending: &'s mut Slab<Pending>,
    sid: u64,
    in_flight: &'s mut u32,
    chunk_slots: u32,
    export: &'s mut Option<ExportState>,
    import: &'s mut Option<ImportState>,
    chunk: &'s mut Vec<u8>,
}

/// Completes the slots still released to an ended export with `NotFound`.
fn end_export(
    ring: &mut Ring<'_>,
    e: &mut ExportState,
    in_flight: &mut u32,
) -> Result<(), QueueError> {
    while let Some((_, user_data)) = e.queue.pop_front() {
        *in_flight -= 1;
        push(ring, &Cqe::status(user_data, Status::NotFound))?;
    }
    Ok(())
}

/// `SnapshotExport`, `ChunkRelease` and `SnapshotImport` (every earlier
/// request of the session has been run). `None`: completes later.
fn snapshot_op(
    store: &mut Store<UringIo>,
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    (owner, job, operator, (lo, hi)): Owner<'_>,
    cx: SnapshotCtx<'_>,
) -> Result<Option<Cqe>, QueueError> {
    let v = match sqe.validate(ring.arena()) {
        Ok(v) => v,
        Err(e) => return Ok(Some(Cqe::status(sqe.user_data, Status::from(e)))),
    };
    let done = |st: Status| Ok(Some(Cqe::status(v.user_data, st)));
    let lock = || cx.registry.lock().unwrap_or_else(|p| p.into_inner());
    match v.op {
        Opcode::SnapshotExport => {
            if cx.export.as_ref().is_some_and(|e| e.id.is_some()) {
                return done(Status::Busy);
            }
            let states = cx.view.get().operator_descs(job, operator);
            let spec = ExportSpec {
                owner: owner.to_vec(),
                snapshot_id: v.arg,
                lo,
                hi,
                states,
            };
            let started = if v.flags & sqe_flags::FROM_CHECKPOINTS != 0 {
                // Handles back to back, copied out of shared memory first.
                const HANDLE: usize = stator_store::manifest::HANDLE_LEN;
                if v.value.len == 0
                    || !v.value.len.is_multiple_of(HANDLE)
                    || v.value.len > 4096 * HANDLE
                {
                    return done(Status::BadArgument);
                }
                let mut hs = vec![0u8; v.value.len];
                if ring.view().read_into(v.value.off, &mut hs).is_err() {
                    return done(Status::BadRange);
                }
                let handles: Vec<&[u8]> = hs.chunks(HANDLE).collect();
                store.export_checkpoints(spec, &handles)
            } else {
                store.export(spec)
            };
            match started {
                Ok(id) => {
                    *cx.export = Some(ExportState {
                        snapshot: v.arg,
                        id: Some(id),
                        queue: VecDeque::new(),
                        next_chunk: 0,
                    });
                    done(Status::Ok)
                }
                Err(e) => done(status_of(&e)),
            }
        }
        Opcode::ChunkRelease => {
            let Some(e) = cx.export.as_mut().filter(|e| e.snapshot == v.arg) else {
                return done(Status::BadArgument);
            };
            if v.arg2 == CANCEL_SNAPSHOT {
                if let Some(id) = e.id.take() {
                    store.export_cancel(id);
                }
                end_export(ring, e, cx.in_flight)?;
                return done(Status::Ok);
            }
            if v.arg2 >= cx.chunk_slots || e.queue.iter().any(|q| q.0 == v.arg2) {
                return done(Status::BadArgument);
            }
            if e.id.is_none() {
                return done(Status::NotFound);
            }
            e.queue.push_back((v.arg2, v.user_data));
            *cx.in_flight += 1;
            Ok(None)
        }
        _ => {
            // SnapshotImport: the chunk in slot `arg2`, of import `arg`.
            if v.arg2 == CANCEL_SNAPSHOT {
                if let Some(i) = cx.import.as_ref().filter(|i| i.import == v.arg) {
                    store.import_cancel(i.id);
                    end_import(ring, cx.import, cx.in_flight, Status::Ok)?;
                }
                return done(Status::Ok);
            }
            if v.arg2 >= cx.chunk_slots {
                return done(Status::BadArgument);
            }
            if cx.import.as_ref().is_some_and(|i| i.import != v.arg) {
                return done(Status::Busy);
            }
            let off = ring.layout().chunk_off + v.arg2 as usize * CHUNK_LEN;
            let mut h = [0u8; HEADER_LEN];
            let _ = ring.view().read_into(off, &mut h);
            let len = HEADER_LEN + u32::from_le_bytes(h[20..24].try_into().expect("4")) as usize;
            let len = len.min(CHUNK_LEN);
            // A private copy: the checks and the records see bytes the
            // client can no longer change.
            cx.chunk.resize(len, 0);
            let _ = ring.view().read_into(off, &mut cx.chunk[..]);
            let id = match cx.import.as_ref() {
                Some(i) => i.id,
                None => {
                    let (states, _) = cx.view.get().operator_states(job, operator);
                    let spec = ImportSpec {
                        owner: owner.to_vec(),
                        lo,
                        hi,
                        states,
                    };
                    match store.import_begin(spec) {
                        Ok(id) => {
                            *cx.import = Some(ImportState {
                                import: v.arg,
                                id,
                                held: VecDeque::new(),
                            });
                            id
                        }
                        Err(e) => return done(status_of(&e)),
                    }
                }
            };
            let tok = cx.pending.insert(Pending {
                t0: Instant::now(),
                session: cx.sid,
                user_data: v.user_data,
                op: v.op,
                out: Out::None,
                arg: v.arg,
            });
            // The states the snapshot names become (or are) states of this
            // operator, by name and kind, registered together.
            let mut resolve = |table: &[StateDesc]| -> Result<Vec<u32>, String> {
                let mut named = Vec::with_capacity(table.len());
                for d in table {
                    let name = std::str::from_utf8(&d.name)
                        .map_err(|_| "a state name that is not UTF-8".to_string())?;
                    named.push((name, wire_kind(d.kind)));
                }
                let current = cx.view.get();
                let new = named
                    .iter()
                    .filter(|(n, _)| !current.is_registered(job, operator, n))
                    .count();
                if new > IMPORT_NEW_STATES {
                    // Registrations outlive a refused import: a snapshot
                    // cannot fill the daemon's registry with names.
                    return Err(format!(
                        "the snapshot names {new} states this operator does not have (at most {IMPORT_NEW_STATES})"
                    ));
                }
                if new == 0 {
                    // Nothing to register: no lock, no file write.
                    return named
                        .iter()
                        .map(|&(n, k)| current.id_of(job, operator, n, k))
                        .collect();
                }
                lock()
                    .register_all(job, operator, &named)
                    .map_err(|(_, m)| m)
            };
            match store.import_chunk(id, &cx.chunk[..], tok as u64, &mut resolve) {
                Ok(ImportStep::Consumed) => {
                    cx.pending.remove(tok);
                    let imp = cx.import.as_mut().expect("set above");
                    if imp.held.is_empty() && store.import_backlog(id) <= IMPORT_BACKLOG {
                        return done(Status::Ok);
                    }
                    // The disk is behind: the slot comes back later.
                    imp.held.push_back(v.user_data);
                    *cx.in_flight += 1;
                    Ok(None)
                }
                Ok(ImportStep::Finishing) => {
                    *cx.in_flight += 1;
                    end_import(ring, cx.import, cx.in_flight, Status::Ok)?;
                    Ok(None)
                }
                Err(e) => {
                    cx.pending.remove(tok);
                    tracing::warn!(import = v.arg, error = %e, "snapshot import refused");
                    let st = status_of(&e);
                    end_import(ring, cx.import, cx.in_flight, st)?;
                    done(st)
                }
            }
        }
    }
}

/// A state kind as the control protocol numbers it.
fn wire_kind(k: StateKind) -> u8 {
    match k {
        StateKind::Value => stator_ring::control::kind::VALUE,
        StateKind::List => stator_ring::control::kind::LIST,
        StateKind::Map => stator_ring::control::kind::MAP,
    }
}

/// Room a map page of a `cap`-byte buffer gives its entries: the rest is
/// kept for the resume cursor after them (a user key is at most 64 KiB):
/// a quarter of the buffer, at least 4 bytes, at most 64 KiB + 4.
fn page_entries_bytes(cap: usize) -> usize {
    cap.saturating_sub((cap / 4).clamp(4, (64 << 10) + 4))
}

/// The smallest buffer whose page holds `entry` bytes of entries (the
/// inverse of [`page_entries_bytes`]).
fn page_buffer_for(entry: usize) -> usize {
    let cap = (entry * 4).div_ceil(3) + 4;
    if cap / 4 <= (64 << 10) + 4 {
        cap
    } else {
        entry + (64 << 10) + 4
    }
}

/// The store operation of a validated request.
fn op_of<'a>(it: &Item, sc: &'a [u8]) -> Op<'a> {
    let k = KeyRef {
        key_group: it.key_group,
        state: it.state,
        key: &sc[it.key.clone()],
        namespace: &sc[it.ns.clone()],
    };
    let uk = &sc[it.uk.clone()];
    let val = &sc[it.val.clone()];
    match it.action {
        Action::Get => Op::Get(k),
        Action::Put => Op::Put(k, val),
        Action::Delete => Op::Delete(k),
        Action::ListAppend if it.flags & sqe_flags::ELEMENTS != 0 => Op::ListAppendAll(k, val),
        Action::ListAppend => Op::ListAppend(k, val),
        Action::ListGet => Op::ListGet(k),
        Action::ListReplace => Op::ListReplace(k, val),
        Action::MapGet => Op::MapGet(k, uk),
        Action::MapPut => Op::MapPut(k, uk, val),
        Action::MapRemove => Op::MapRemove(k, uk),
        Action::MapContains => Op::MapContains(k, uk),
        Action::MapIter => {
            let cap = match it.out {
                Out::Range(r) => r.len,
                Out::Buf { len, .. } => len,
                Out::None => 0,
            };
            Op::MapIter {
                map: k,
                mode: match it.arg {
                    iter_mode::KEYS => IterMode::Keys,
                    iter_mode::VALUES => IterMode::Values,
                    _ => IterMode::Entries,
                },
                after: (it.flags & sqe_flags::ITER_RESUME != 0).then_some(uk),
                max_bytes: page_entries_bytes(cap),
            }
        }
        Action::Clear => Op::Clear(k, it.kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 25: every keyed opcode, and only those, reaches the store,
    /// each as its own operation on its own kind of state (an opcode once
    /// fell through a wildcard arm to `Clear`).
    #[test]
    fn each_keyed_opcode_has_its_own_action() {
        let mut seen = Vec::new();
        for &op in Opcode::ALL {
            let a = Action::of(op);
            assert_eq!(a.is_some(), op.fields().keyed, "{op:?}");
            if let Some(a) = a {
                assert!(!seen.contains(&a), "{op:?} shares {a:?}");
                seen.push(a);
                assert_eq!(format!("{a:?}"), format!("{op:?}"));
                assert_eq!(a.kind().is_none(), op == Opcode::Clear, "{op:?}");
            }
        }
    }

    #[test]
    fn a_page_buffer_for_an_entry_holds_it() {
        for e in [1usize, 3, 100, 3000, 49151, 49152, 196_000, 1 << 20] {
            let cap = page_buffer_for(e);
            assert!(page_entries_bytes(cap) >= e, "entry {e}, cap {cap}");
            assert!(
                cap <= e + e / 3 + (64 << 10) + 8,
                "entry {e}: {cap} is needlessly large"
            );
        }
    }
}
