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
//!
//! Here: the shard's types, its loop, its control messages and its sleep;
//! `service` takes and runs a session's descriptors, `decode` turns one
//! into a store operation, `complete` answers and publishes, `checkpoint`
//! and `snapshot` run those barriers, `report` publishes the shard's
//! state.

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
use stator_store::ImportHold;
use stator_store::clock;
use stator_store::io::{Io, UringIo};
use stator_store::snapshot::{CHUNK_LEN, ChunkSlot, HEADER_LEN, StateDesc};
use stator_store::{
    CheckpointSpec, ExportSpec, Fill, ImportSpec, ImportStep, IterMode, KeyRef, Notify, Op, Output,
    RestoreSpec, Restored, StateKind, Store, StoreError, Submitted,
};

use crate::metrics::{Hist, OpMetrics, Report, SessionReport, ShardReport, Tally};
use crate::registry::{Registry, RegistryView};

mod batch;
mod checkpoint;
mod complete;
mod decode;
mod report;
mod service;
mod snapshot;

use batch::*;
use checkpoint::*;
use complete::*;
use decode::*;
use snapshot::*;

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
    /// The engine no longer references these checkpoints of `owner`
    /// (`job\0operator`): those the store retains are deleted. The reply:
    /// how many were.
    Release {
        owner: Vec<u8>,
        handles: Vec<Vec<u8>>,
        reply: Sender<Result<u32, StoreError>>,
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
    /// How long each turn of its loop that did work took (control
    /// messages, every session's queue, the store's completions and
    /// background steps): a descriptor waits for at most about one turn
    /// before it is taken, so a long turn is a stall of every session.
    pub turns: Hist,
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
    /// Its next descriptor is a write that waits for write room (see
    /// `Store::write_headroom`): what it queued is not work while the
    /// store has none. Other sessions' reads are taken meanwhile.
    write_wait: bool,
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
    /// Holds the store back from installing it until its state ids are
    /// durable in the registry (see `registry::Saver`).
    hold: Option<ImportHold>,
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
    out: Out,
}

/// What woke a sleeping shard: the fd it armed with this token became
/// readable (see [`Io::poll_readable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    /// The control side's doorbell.
    Control,
    /// The remote tier's eventfd: reads or uploads finished.
    Remote,
    /// A session's doorbell (by session id; ids start at 1).
    Session(u64),
}

impl Wake {
    fn token(self) -> u64 {
        match self {
            Wake::Control => 0,
            Wake::Remote => u64::MAX,
            Wake::Session(id) => {
                debug_assert!(id != 0 && id != u64::MAX, "session ids start at 1");
                id
            }
        }
    }

    fn of(token: u64) -> Wake {
        match token {
            0 => Wake::Control,
            u64::MAX => Wake::Remote,
            id => Wake::Session(id),
        }
    }
}

/// How many requests ahead the shard starts loading client memory.
const PREFETCH_AHEAD: usize = 8;
/// Bytes of keys and values one batch copies out before it runs: bounds
/// the shard's scratch memory whatever sizes clients name.
const BATCH_BYTES: usize = 8 << 20;

pub struct Shard<I: Io = UringIo> {
    id: usize,
    store: Store<I>,
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
    /// The batch a pass takes from a session, and the descriptors it
    /// popped.
    taken: Batch,
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
    /// When [`Shard::step`] last rebuilt the report, by the store's clock
    /// (simulated in `tests/sim.rs`; `run` keeps its own).
    stepped_report: Instant,
    /// Releases answered once their manifests' unlinks complete.
    releases: Vec<PendingRelease>,
    /// Restores whose segments are being opened (see
    /// `Store::restore_start`), by token, and the next token.
    restoring: Vec<(u64, Sender<Result<Restored, StoreError>>)>,
    restore_serial: u64,
    /// Imports the store holds back from their install until the
    /// registry version their state ids need is durable (see
    /// `registry::Saver`): the store's hold and that version.
    unsaved_imports: Vec<(ImportHold, u64)>,
}

/// A `Release` whose checkpoints are deleted but whose manifests' unlinks
/// are in flight: answered "released" only when they are gone, so that a
/// daemon killed right after the answer does not restore them.
struct PendingRelease {
    reply: Sender<Result<u32, StoreError>>,
    count: u32,
    unlinking: Vec<std::path::PathBuf>,
}

/// Why a session's next descriptor waits for its store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoreWait {
    /// A checkpoint, until compaction merges the layers it would name
    /// (`Store::checkpoint_should_wait`).
    Compaction,
    /// An export, until others end and leave the memory budget room for
    /// its read-ahead (`Store::export_should_wait`).
    Export,
    /// An import, until others end and leave room for its write buffers
    /// (`Store::import_should_wait`).
    Import,
}

impl StoreWait {
    fn why(self) -> &'static str {
        match self {
            StoreWait::Compaction => {
                "a checkpoint waits for compaction to merge the layers it would name"
            }
            StoreWait::Export => {
                "an export waits for other exports or imports to end: the memory budget has no room for its read-ahead"
            }
            StoreWait::Import => {
                "an import waits for other exports or imports to end: the memory budget has no room for its write buffers"
            }
        }
    }
}

impl<I: Io> Shard<I> {
    pub fn new(
        id: usize,
        store: Store<I>,
        rx: Receiver<ShardMsg>,
        bell: Arc<Doorbell>,
        (spin, batch): (Duration, u32),
        registry: Arc<Mutex<Registry>>,
    ) -> Shard<I> {
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
            taken: Batch::default(),
            sqes: Vec::new(),
            ready: Vec::new(),
            chunk: Vec::new(),
            stopping: false,
            stats: ShardStats::default(),
            live: Arc::default(),
            report_now: false,
            stepped_report: clock::now(),
            releases: Vec::new(),
            restoring: Vec::new(),
            restore_serial: 0,
            unsaved_imports: Vec::new(),
        }
    }

    /// Publishes liveness and counters into `live` while it runs.
    pub fn with_live(mut self, live: Arc<Live>) -> Shard<I> {
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
            let turn = Instant::now();
            let told = self.control();
            if self.stopping {
                self.finish();
                return self.stats;
            }
            let progress = self.pass();
            if progress || told {
                self.live.turns.record(turn.elapsed().as_nanos() as u64, 1);
            }
            if progress {
                idle_since = None;
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

    /// One turn of [`Shard::run`]'s loop without its spins and sleeps:
    /// control messages, then a pass over the work at hand. Whether
    /// anything moved (false also once a `Shutdown` came). For a caller that drives the shard itself,
    /// as the simulator (`tests/sim.rs`) does from one thread.
    pub fn step(&mut self) -> bool {
        self.control();
        // The report also hands the store the registry's dropped states.
        let mut at = self.stepped_report;
        self.maybe_report(clock::now(), &mut at);
        self.stepped_report = at;
        !self.stopping && self.pass()
    }

    /// Its store, to look at (the simulator reads its fault injector).
    pub fn store(&self) -> &Store<I> {
        &self.store
    }

    /// Stops as on `Shutdown`: answers what is in flight and flushes the
    /// store (see [`Shard::run`]).
    pub fn stop(mut self) -> ShardStats {
        self.finish();
        self.stats
    }

    /// One pass over the work at hand: every session's queue, the
    /// store's completions, the snapshots, then the completions published.
    /// Whether anything moved.
    fn pass(&mut self) -> bool {
        let mut progress = false;
        // (The store's clock: simulated in tests/sim.rs.)
        let t = clock::now();
        for slot in 0..self.sessions.capacity() {
            if self.sessions.contains(slot) {
                progress |= self.service(slot);
            }
        }
        // Background steps are paced to the time requests took.
        let busy = if progress {
            clock::elapsed(t)
        } else {
            Duration::ZERO
        };
        self.store.note_foreground(busy);
        progress |= self.reap();
        progress |= self.answer_restores();
        self.release_saved_imports();
        progress |= self.drive_snapshots();
        self.answer_releases(false);
        self.publish();
        progress
    }

    /// Handles the control messages waiting; whether there were any.
    fn control(&mut self) -> bool {
        let mut told = false;
        loop {
            let m = match self.rx.try_recv() {
                Ok(m) => m,
                Err(crossbeam_channel::TryRecvError::Empty) => return told,
                // The daemon is gone without a word: stop as on Shutdown.
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    self.stopping = true;
                    return true;
                }
            };
            told = true;
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
                    let token = self.restore_serial;
                    self.restore_serial += 1;
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
                            // Answered when its segments are open (see
                            // `answer_restores`).
                            self.store.restore_start(token, spec, &hs)
                        }
                    };
                    match r {
                        Ok(()) => self.restoring.push((token, reply)),
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                ShardMsg::Release {
                    owner,
                    handles,
                    reply,
                } => self.release(&owner, &handles, reply),
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
            write_wait: false,
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
    /// A `Release` from the control socket (no session): see
    /// [`ShardMsg::Release`]. Answered when the manifests are unlinked.
    fn release(
        &mut self,
        owner: &[u8],
        handles: &[Vec<u8>],
        reply: Sender<Result<u32, StoreError>>,
    ) {
        let hs: Vec<&[u8]> = handles.iter().map(Vec::as_slice).collect();
        match self.store.release_checkpoints(owner, &hs) {
            Ok(r) => {
                if r.count > 0 {
                    tracing::debug!(released = r.count, "checkpoints released");
                }
                self.releases.push(PendingRelease {
                    reply,
                    count: r.count as u32,
                    unlinking: r.unlinking,
                });
                self.answer_releases(false);
            }
            Err(e) => {
                let _ = reply.send(Err(e));
            }
        }
    }

    /// Lets the store install the imports whose state ids the registry
    /// now holds durably.
    fn release_saved_imports(&mut self) {
        if self.unsaved_imports.is_empty() {
            return;
        }
        let durable = self.view.saver().durable();
        let store = &mut self.store;
        self.unsaved_imports.retain(|&(hold, v)| {
            if durable < v {
                return true;
            }
            store.import_release(hold);
            false
        });
    }

    /// Answers the restores that ended; whether there were any.
    fn answer_restores(&mut self) -> bool {
        let mut any = false;
        while let Some((token, r)) = self.store.take_restored() {
            any = true;
            if let Some(i) = self.restoring.iter().position(|(t, _)| *t == token) {
                let (_, reply) = self.restoring.swap_remove(i);
                let _ = reply.send(r);
            }
        }
        any
    }

    /// Answers the releases whose unlinks completed (`all`: every one, at
    /// shutdown, when the unlinks were submitted and no more are reaped).
    fn answer_releases(&mut self, all: bool) {
        if self.releases.is_empty() {
            return;
        }
        let store = &self.store;
        self.releases.retain(|r| {
            if !all && !store.unlinks_done(&r.unlinking) {
                return true;
            }
            let _ = r.reply.send(Ok(r.count));
            false
        });
    }

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

    /// Sleeps until a doorbell, a store completion or a timeout.
    fn sleep(&mut self) {
        self.stats.sleeps += 1;
        let mut work = !self.rx.is_empty();
        // Writes queued while writes are stalled are not work: the shard
        // waits for its store (a flush step or its sort) instead.
        let stalled = self.store.write_headroom() <= 0.0;
        // A wait that is over is work: the store changed in this pass
        // (compaction merged layers, an export or import ended) after the
        // waiting session was looked at.
        let still = |w: StoreWait, store: &Store<I>| match w {
            StoreWait::Compaction => store.checkpoint_should_wait(),
            StoreWait::Export => store.export_should_wait(),
            StoreWait::Import => store.import_should_wait(),
        };
        for (_, s) in self.sessions.iter_mut() {
            if s.broken {
                continue;
            }
            let blocked = s.cq_blocked;
            let waits =
                s.store_wait.is_some_and(|w| still(w, &self.store)) || (stalled && s.write_wait);
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
                Ok(w) => work |= w && !waits,
                Err(e) => s.break_off(self.id, &self.live, e.to_string()),
            }
        }
        if !work {
            let io = self.store.io_mut();
            // The control doorbell first: it must never wait behind
            // session polls for room in the ring.
            if !self.bell_armed {
                io.poll_readable(self.bell.fd(), Wake::Control.token());
                self.bell_armed = true;
            }
            // Remote outcomes (reads, uploads) wake the shard as disk
            // completions do.
            if let Some(fd) = self.remote_bell.as_ref().filter(|_| !self.remote_armed) {
                io.poll_readable(std::os::fd::AsFd::as_fd(fd), Wake::Remote.token());
                self.remote_armed = true;
            }
            for (_, s) in self.sessions.iter_mut() {
                if !s.armed && !s.broken {
                    io.poll_readable(s.to_daemon.fd(), Wake::Session(s.id).token());
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
            match Wake::of(t) {
                Wake::Control => {
                    self.bell.drain();
                    self.bell_armed = false;
                }
                // The store's poll takes the outcomes (and reads the bell).
                Wake::Remote => self.remote_armed = false,
                Wake::Session(id) => {
                    // (A session closed since it was armed is gone.)
                    if let Some(&slot) = self.by_id.get(&id) {
                        let s = &mut self.sessions[slot];
                        s.to_daemon.drain();
                        s.armed = false;
                    }
                }
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
        let deadline = clock::now() + Duration::from_secs(10);
        loop {
            let progress = self.pass();
            if clock::now() >= deadline || (!progress && self.store.pending() == 0) {
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
        // Imports held for the registry: saved here if the registry
        // thread has not yet (a stop may block), then installed below.
        if !self.unsaved_imports.is_empty() {
            Registry::save_pending(&self.registry);
            self.release_saved_imports();
            if !self.unsaved_imports.is_empty() {
                tracing::warn!(
                    shard = self.id,
                    imports = self.unsaved_imports.len(),
                    "imports not installed: the state registry could not save their names"
                );
            }
        }
        // A stop flushes the memtables and finishes what was promised
        // (checkpoints, deletes, uploads); a compaction backlog waits for
        // the next start rather than holding the stop past systemd's
        // TimeoutStopSec.
        self.store.stop_compacting();
        self.store.flush();
        self.store.settle();
        self.answer_releases(true);
        self.answer_restores();
        tracing::info!(
            shard = self.id,
            stats = ?self.stats,
            layers = self.store.stats().segments,
            "shard stopped"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each waker's token names it again, and no session's token is the
    /// control doorbell's or the remote tier's.
    #[test]
    fn wake_tokens_name_their_waker() {
        for w in [
            Wake::Control,
            Wake::Remote,
            Wake::Session(1),
            Wake::Session(u64::MAX - 1),
        ] {
            assert_eq!(Wake::of(w.token()), w);
        }
    }
}
