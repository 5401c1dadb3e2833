//! One Java session: a `stator_client::Session` with the region of its
//! arena the Java side writes requests into, the command and completion
//! buffers it exchanges records through, and the bookkeeping of the calls
//! that wait (checkpoints, notifications, snapshot streams).

use std::collections::HashMap;
use std::time::Duration;

use stator_client::{Completion, Notify, OpenOptions, Request, Session, Status};

use crate::error::{ERR_ARGUMENT, ERR_PROTOCOL, Fail};
use crate::ffi::JavaBuf;
use crate::wire::{self, COMMAND_LEN, COMPLETION_LEN, Reader};

/// Tokens of the requests this crate makes itself; a checkpoint's token
/// is its id (Flink's ids are below 2^63).
const TOKEN_NOP: u64 = 1 << 63;
const TOKEN_NOTIFY: u64 = TOKEN_NOP + 1;
pub(crate) const TOKEN_EXPORT: u64 = TOKEN_NOP + 2;
pub(crate) const TOKEN_CANCEL: u64 = TOKEN_NOP + 3;
/// A chunk slot handed to an export: this base plus the slot.
pub(crate) const TOKEN_SLOT: u64 = TOKEN_NOP + (1 << 32);

/// Checkpoint outcomes kept for an asynchronous part to collect, at most
/// (as many as statord lets a subtask have pending).
const KEPT_OUTCOMES: usize = 64;

/// No key groups given: the daemon computes Flink's range of the subtask.
const NO_KEY_GROUP: u32 = u32::MAX;

/// What one of this crate's own requests came back with.
#[derive(Clone, Debug)]
pub(crate) struct Done {
    pub status: Result<(), Fail>,
    /// `NotFound`: for a slot handed to an export, the export is over.
    pub not_found: bool,
    pub value: Vec<u8>,
    pub len: u32,
    pub aux: u64,
    pub last: bool,
}

impl Done {
    fn of(c: &Completion<'_>) -> Done {
        Done {
            status: match c.status {
                Ok(Status::Ok) | Ok(Status::NotFound) => Ok(()),
                _ => Err(c.check().map_err(Fail::from).expect_err("an error status")),
            },
            not_found: c.status == Ok(Status::NotFound),
            value: c.value.map(<[u8]>::to_vec).unwrap_or_default(),
            len: c.len,
            aux: c.aux,
            last: c.last,
        }
    }
}

pub struct JniSession {
    pub(crate) s: Session,
    /// The reservation the Java side writes request bytes into: id, arena
    /// offset, bytes.
    region: Option<(u32, u32, u32)>,
    commands: Option<JavaBuf>,
    completions: Option<JavaBuf>,
    /// Completions of this crate's own requests not asked for yet.
    pub(crate) done: HashMap<u64, Done>,
    pub(crate) export: Option<crate::export::Export>,
}

impl JniSession {
    /// Opens a session from an argument block: `socket`, `job`,
    /// `operator` (strings), then `u32 subtask, parallelism,
    /// max_parallelism, key_group_first, key_group_last` (both
    /// `0xFFFFFFFF`: the daemon's range of the subtask), `u32 sq_entries,
    /// cq_entries`, `u64 arena_bytes`, `u32 chunk_slots`, `u64 spin_ns`.
    pub fn open(args: &[u8]) -> Result<JniSession, Fail> {
        let mut r = Reader(args);
        let socket = r.str()?.to_string();
        let mut o = OpenOptions::new(r.str()?, r.str()?);
        o.subtask = r.u32()?;
        o.parallelism = r.u32()?;
        o.max_parallelism = r.u32()?;
        let (first, last) = (r.u32()?, r.u32()?);
        o.key_groups = match (first, last) {
            (NO_KEY_GROUP, NO_KEY_GROUP) => None,
            (f, l) => match (u16::try_from(f), u16::try_from(l)) {
                (Ok(f), Ok(l)) => Some((f, l)),
                _ => return Err(Fail::arg(format!("key groups {f}..={l} are out of range"))),
            },
        };
        o.sq_entries = r.u32()?;
        o.cq_entries = r.u32()?;
        o.arena_bytes = r.u64()?;
        o.chunk_slots = r.u32()?;
        o.spin = Duration::from_nanos(r.u64()?);
        let s = Session::open(&socket, &o).map_err(|e| {
            let mut f = Fail::from(e);
            f.message = format!("{} (socket {socket})", f.message);
            f
        })?;
        Ok(JniSession {
            s,
            region: None,
            commands: None,
            completions: None,
            done: HashMap::new(),
            export: None,
        })
    }

    /// Registers a state: `u8 kind` (1 value, 2 list, 3 map), `name`.
    pub fn register(&mut self, args: &[u8]) -> Result<u32, Fail> {
        let mut r = Reader(args);
        let kind = match r.u8()? {
            1 => stator_client::Kind::Value,
            2 => stator_client::Kind::List,
            3 => stator_client::Kind::Map,
            k => return Err(Fail::arg(format!("unknown state kind {k}"))),
        };
        Ok(self.s.register(r.str()?, kind)?)
    }

    /// Restores from checkpoint handles: `u32 count`, then each handle as
    /// a byte string. Returns the segment references added.
    pub fn restore(&mut self, args: &[u8]) -> Result<u32, Fail> {
        let handles = read_handles(args)?;
        let refs: Vec<&[u8]> = handles.iter().map(Vec::as_slice).collect();
        Ok(self.s.restore(&refs)?.layers)
    }

    /// Reserves `bytes` of the arena for the Java side's request bytes;
    /// returns the region's arena offset.
    pub fn region(&mut self, bytes: u32) -> Result<u32, Fail> {
        if self.region.is_some() {
            return Err(Fail::new(
                ERR_PROTOCOL,
                "the session has its region already",
            ));
        }
        let r = self.s.reserve_value(bytes)?;
        let off = self.s.reservation_off(r.id).expect("reserved just now");
        self.region = Some((r.id, off, r.cap));
        Ok(off)
    }

    /// Binds the Java side's command and completion buffers.
    pub fn bind(&mut self, commands: JavaBuf, completions: JavaBuf) -> Result<(), Fail> {
        if commands.len() < COMMAND_LEN || completions.len() < COMPLETION_LEN {
            return Err(Fail::arg(
                "the command or completion buffer holds no record",
            ));
        }
        self.commands = Some(commands);
        self.completions = Some(completions);
        Ok(())
    }

    /// The hot path: submits the first `count` commands, publishes them,
    /// then (with `wait`, and requests in flight) waits until a completion
    /// is ready, and writes every ready completion into the completion
    /// buffer (as many as it holds). Returns how many it wrote.
    pub fn call(&mut self, count: u32, wait: bool) -> Result<u32, Fail> {
        let (Some(cmds), Some(cpls), Some((region, _, _))) =
            (self.commands, self.completions, self.region)
        else {
            return Err(Fail::new(ERR_PROTOCOL, "call before region and bind"));
        };
        if count as usize > cmds.len() / COMMAND_LEN {
            return Err(Fail::arg(format!(
                "{count} commands overrun the command buffer"
            )));
        }
        let mut c = [0u8; COMMAND_LEN];
        for i in 0..count as usize {
            cmds.read(i * COMMAND_LEN, &mut c)?;
            let (req, token) =
                wire::command(&c).map_err(|m| Fail::arg(format!("command {i}: {m}")))?;
            if let Err(e) = self.s.submit_raw(&req, region, token) {
                // Those before it are queued: publish them, so nothing the
                // caller counts as submitted is left unpublished.
                let _ = self.s.flush();
                let mut f = Fail::from(e);
                f.message = format!("command {i} of {count}: {}", f.message);
                return Err(f);
            }
        }
        self.s.flush()?;
        if wait && self.s.in_flight() > 0 && self.s.ready()? == 0 {
            self.s.wait(None)?;
        }
        let max = cpls.len() / COMPLETION_LEN;
        let mut n = 0usize;
        let mut failed = None;
        self.s.poll_in_place(max, |c, _| {
            let flags =
                if c.more { wire::FLAG_MORE } else { 0 } | if c.last { wire::FLAG_LAST } else { 0 };
            let status = match c.status {
                Ok(s) => s as i32,
                Err(code) => code,
            };
            let rec = wire::completion(c.token, status, flags, c.len, c.aux);
            if let Err(e) = cpls.write(n * COMPLETION_LEN, &rec) {
                failed.get_or_insert(e);
            }
            n += 1;
        })?;
        match failed {
            Some(e) => Err(Fail::arg(e)),
            None => Ok(n as u32),
        }
    }

    /// Asks statord to ring the doorbell at the next completion, for a
    /// sleeper (`sleeper.rs`); `true`: completions are ready already.
    pub fn arm(&mut self) -> Result<bool, Fail> {
        Ok(self.s.arm()?)
    }

    /// Ends a sleeper's sleep: clears the request, drains the doorbell, and
    /// fails if statord closed the session.
    pub fn disarm(&mut self) -> Result<(), Fail> {
        Ok(self.s.disarm()?)
    }

    /// Delivers ready completions of this crate's own requests into
    /// `done`, waiting first if none is ready.
    pub(crate) fn pump(&mut self) -> Result<(), Fail> {
        if self.s.in_flight() == 0 {
            return Err(Fail::new(ERR_PROTOCOL, "waiting with nothing in flight"));
        }
        self.s.wait(None)?;
        let done = &mut self.done;
        self.s.poll(|c| {
            done.insert(c.token, Done::of(&c));
        })?;
        Ok(())
    }

    /// Waits for the completion of `token`.
    pub(crate) fn wait_done(&mut self, token: u64) -> Result<Done, Fail> {
        loop {
            if let Some(d) = self.done.remove(&token) {
                return Ok(d);
            }
            self.pump()?;
        }
    }

    /// A checkpoint's synchronous part: submits the barrier with id `id`
    /// and returns once statord has taken it (a no-op behind it has
    /// completed), so requests of other sessions on these key groups
    /// submitted from now on are not in it.
    pub fn checkpoint(&mut self, id: u64) -> Result<(), Fail> {
        if id >= TOKEN_NOP || self.done.contains_key(&id) {
            return Err(Fail::arg(format!("checkpoint id {id} is not usable")));
        }
        self.s.submit(&Request::checkpoint(id), id)?;
        self.s.submit(
            &Request::new(stator_client::Opcode::Nop, 0, 0, b""),
            TOKEN_NOP,
        )?;
        self.s.flush()?;
        self.wait_done(TOKEN_NOP)?.status
    }

    /// Waits up to `timeout` for checkpoint `id` to be durable; returns
    /// its handle, or `None` if it is not yet. (A short wait lets other
    /// threads use the session between waits: the engine's notifications
    /// and the next checkpoint's barrier.)
    pub fn checkpoint_wait(&mut self, id: u64, timeout: Duration) -> Result<Option<Vec<u8>>, Fail> {
        if !self.done.contains_key(&id) && self.s.in_flight() > 0 {
            self.s.wait(Some(timeout))?;
            let done = &mut self.done;
            self.s.poll(|c| {
                done.insert(c.token, Done::of(&c));
            })?;
        }
        match self.done.remove(&id) {
            Some(d) => {
                d.status?;
                Ok(Some(d.value))
            }
            None if self.s.in_flight() == 0 => Err(Fail::new(
                ERR_PROTOCOL,
                format!("checkpoint {id} is not in progress on this session"),
            )),
            None => Ok(None),
        }
    }

    /// Tells statord checkpoint `id` completed (1), was aborted (2) or
    /// subsumed (3).
    pub fn notify(&mut self, id: u64, kind: u32) -> Result<(), Fail> {
        let kind = match kind {
            1 => Notify::Complete,
            2 => Notify::Abort,
            3 => Notify::Subsume,
            k => return Err(Fail::arg(format!("unknown notification kind {k}"))),
        };
        self.s
            .submit(&Request::checkpoint_notify(id, kind), TOKEN_NOTIFY)?;
        self.s.flush()?;
        let status = self.wait_done(TOKEN_NOTIFY)?.status;
        self.forget_unclaimed_checkpoints();
        status
    }

    /// Bounds the outcomes of checkpoints nobody collected (an asynchronous
    /// part the engine cancelled): the oldest past [`KEPT_OUTCOMES`] go.
    /// Not every one up to a notification's id: the engine may notify a
    /// later id (a savepoint's) while an earlier checkpoint's asynchronous
    /// part still waits, and dropping its outcome failed that checkpoint
    /// ("not in progress") and, with no tolerated failures, the job.
    fn forget_unclaimed_checkpoints(&mut self) {
        let mut ids: Vec<u64> = self
            .done
            .keys()
            .copied()
            .filter(|t| *t < TOKEN_NOP)
            .collect();
        if ids.len() > KEPT_OUTCOMES {
            ids.sort_unstable();
            for t in &ids[..ids.len() - KEPT_OUTCOMES] {
                self.done.remove(t);
            }
        }
    }

    /// Empties the session's state (every state of its operator in its key
    /// groups) by importing an empty portable snapshot as `import_id`: what
    /// a task starting without a checkpoint must see, whatever an earlier
    /// attempt wrote. Needs an idle session.
    pub fn reset(&mut self, import_id: u64) -> Result<(), Fail> {
        self.s
            .import_snapshot(import_id, [empty_snapshot(import_id)])
            .map(|_| ())
            .map_err(Fail::from)
    }

    pub fn close(self) -> Result<(), Fail> {
        Ok(self.s.close()?)
    }

    pub fn arena(&self) -> (std::ptr::NonNull<u8>, usize) {
        self.s.arena_range()
    }
}

/// Releases checkpoints with no session (`stator_client::release_checkpoints`)
/// from an argument block: `socket`, `job`, `operator` (strings), then the
/// handles as [`read_handles`] reads them. How many statord deleted.
pub fn release(args: &[u8]) -> Result<u32, Fail> {
    let mut r = Reader(args);
    let socket = r.str()?;
    let (job, operator) = (r.str()?, r.str()?);
    let handles = read_handles(r.0)?;
    let refs: Vec<&[u8]> = handles.iter().map(Vec::as_slice).collect();
    stator_client::release_checkpoints(socket, job, operator, &refs).map_err(|e| {
        let mut f = Fail::from(e);
        f.message = format!("{} (socket {socket})", f.message);
        f
    })
}

/// Reads `u32 count` byte strings.
pub(crate) fn read_handles(args: &[u8]) -> Result<Vec<Vec<u8>>, Fail> {
    let mut r = Reader(args);
    let n = r.u32()?;
    if n as usize > stator_ring::control::MAX_HANDLES {
        return Err(Fail::new(
            ERR_ARGUMENT,
            format!(
                "{n} handles exceed the {} one restore takes",
                stator_ring::control::MAX_HANDLES
            ),
        ));
    }
    (0..n).map(|_| Ok(r.bytes()?.to_vec())).collect()
}

/// A portable snapshot of no state at all, as its one chunk
/// (`store/FORMAT.md` §13): the header, then a state table of no states.
fn empty_snapshot(id: u64) -> Vec<u8> {
    // The state table: 0xFE, 0, u16 0, u32 body_len = 4, body = u32 count 0.
    let mut payload = vec![0xFE, 0, 0, 0];
    payload.extend_from_slice(&4u32.to_le_bytes());
    payload.extend_from_slice(&0u32.to_le_bytes());
    let mut c = Vec::with_capacity(32 + payload.len());
    c.extend_from_slice(b"STSN");
    c.extend_from_slice(&2u16.to_le_bytes()); // version
    c.extend_from_slice(&1u16.to_le_bytes()); // LAST
    c.extend_from_slice(&id.to_le_bytes());
    c.extend_from_slice(&0u32.to_le_bytes()); // index
    c.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    c.extend_from_slice(&crc32c::crc32c(&payload).to_le_bytes());
    let head = crc32c::crc32c(&c);
    c.extend_from_slice(&head.to_le_bytes());
    c.extend_from_slice(&payload);
    c
}
