//! A seeded simulator of a statord shard, driven from one thread.
//!
//! One shard (`statord::shard::Shard`, the daemon's own) runs over the
//! store's fault-injecting `Io` on the synchronous one, in this process;
//! the simulator plays the control side (opening sessions, registering
//! states, restores, closes) by sending the shard the messages the
//! control thread sends, and every client is the Rust client's `Session`
//! over the session's real shared-memory segment. Three operators each
//! run one or two subtasks (sessions over parts of their key groups). One
//! seeded generator decides everything: which operator does what to its
//! value, list and map states (lists under a small cap, so appends meet
//! it), its keys and values, when a checkpoint is taken (a barrier in every
//! subtask, then its completion or abort told to every subtask, as Flink's
//! coordinator tells them, so the store deletes what it no longer needs),
//! when a subtask dies in the middle of its requests, when a
//! hostile client scribbles over its own segment, when the machine crashes
//! (a power loss: writes no fsync made durable are lost), how many
//! subtasks each operator comes back with (a rescale, restored by
//! reference from the same handles), when a subtask exports its state as
//! a portable snapshot that a new operator imports (over the sessions'
//! chunk slots, as the Rust client does; each import is a job of its own,
//! which the daemon's janitor drops once its session closed, its records
//! then left out by compaction), and which disk fault (EIO, ENOSPC, a
//! torn write and then nothing, a flipped bit, a failed or slow fsync) the
//! next incarnation of the store meets and after how many operations.
//!
//! What must hold, checked at every completion and restart:
//! - an honest client's read returns what its model holds (per-key order:
//!   a read sees every write submitted before it); an error status is
//!   allowed only while a fault was planned, a wrong value never (and an
//!   append may be refused at the list cap, which a small cap makes
//!   common: a refused one changes nothing, a taken one never takes a
//!   list past the cap);
//! - a checkpoint that completed in every subtask restores exactly its
//!   model after a crash and a rescale (nothing acknowledged is lost);
//! - an imported snapshot reads back exactly what its exporter's model
//!   held in its key groups, every value and map entry;
//! - hostile and dying clients reach nothing of the others: the honest
//!   sessions are never broken off, and the shard never panics.
//!
//! Every run prints its seed and a digest of what the clients saw, and
//! the same seed replays the same run exactly: the store and the shard
//! read a simulated clock (`stator_store::clock`) that the turns move, and
//! work they would hand to a helper thread is done at once.
//!
//! `cargo test -p statord --test sim` runs a fixed set of seeds (CI).
//! `SIM_SEED=N` replays one seed; `SIM_SECONDS=S` runs fresh seeds for S
//! seconds (`SIM_SECONDS=14400 cargo test --release -p statord --test sim
//! -- --nocapture` for hours).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use stator_client::{Notify, Opcode, OpenOptions, Request, Session, Status};
use stator_ring::control::kind;
use stator_ring::{Doorbell, RingParams};
use stator_shm::Segment;
use stator_store::io::{Fault, FaultIo, FaultPlan, SyncIo};
use stator_store::{StateKind, Store, StoreConfig};
use statord::registry::Registry;
use statord::shard::{Shard, ShardMsg};

/// splitmix64: small, fast, and the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next() as u8).collect()
    }
}

type Key = (u16, Vec<u8>);

/// What an honest client's state holds, as far as it knows.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
struct Model {
    values: BTreeMap<Key, Vec<u8>>,
    maps: BTreeMap<(Key, Vec<u8>), Vec<u8>>,
    /// Lists, encoded as `ListGet` returns them (`u32 len | bytes` each).
    lists: BTreeMap<Key, Vec<u8>>,
}

impl Model {
    /// The part of the model in key groups `kg`, less `skip`'s keys.
    fn part(&self, kg: (u16, u16), skip: &HashSet<Key>) -> Model {
        let mine = |k: &Key| (kg.0..=kg.1).contains(&k.0) && !skip.contains(k);
        Model {
            values: self
                .values
                .iter()
                .filter(|(k, _)| mine(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            maps: self
                .maps
                .iter()
                .filter(|((k, _), _)| mine(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            lists: self
                .lists
                .iter()
                .filter(|(k, _)| mine(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }
}

/// What a request in flight must answer.
enum Expect {
    /// A value read: found (with these bytes) or not.
    Read(Key, Option<Vec<u8>>),
    /// A map entry read.
    MapRead(Key, Vec<u8>, Option<Vec<u8>>),
    /// A list read: the whole list, or not found.
    ListRead(Key, Option<Vec<u8>>),
    /// An append of this encoded element, applied to the model when it
    /// completes (`Operator::appending`): the store may refuse it at the
    /// list cap.
    Append(Key, Vec<u8>),
    /// A write to this key (its failure makes the key unknown).
    Write(Key),
    /// A checkpoint of one part of its operator (see `Operator::pending`).
    Checkpoint(u64, usize),
    /// A checkpoint's completion or abort, told to a part as Flink tells
    /// its tasks (without it, checkpoints pile up until the store refuses
    /// more: `MAX_UNCOMPLETED`).
    Notify,
}

impl Expect {
    fn what(&self) -> String {
        match self {
            Expect::Read(..) => "read".to_string(),
            Expect::MapRead(_, uk, _) => format!("map read of entry {uk:?}"),
            Expect::ListRead(..) => "list read".to_string(),
            Expect::Append(..) => "append".to_string(),
            Expect::Write(..) => "write".to_string(),
            Expect::Checkpoint(id, _) => format!("checkpoint {id}"),
            Expect::Notify => "notify".to_string(),
        }
    }
}

const JOB: &str = "sim";
const KEY_GROUPS: u16 = 128;
/// Small key spaces: reads find what was written, writes overwrite.
const KEYS: u64 = 600;
const USER_KEYS: u64 = 4;
/// The store's list cap (`StoreConfig::max_list_len`), small so that
/// lists reach it: a few of the larger values, or ~100 small ones.
const LIST_CAP: usize = 12 << 10;

/// An operator: its state, as far as it knows, over every key group;
/// one session (a part) per subtask serves a range of them.
struct Operator {
    name: String,
    model: Model,
    /// Keys whose value is not known: a write to them failed, or was in
    /// flight when a session of this operator died.
    unknown: HashSet<Key>,
    /// The last checkpoint that completed in every part.
    restorable: Option<Point>,
    /// Checkpoints in progress: each part's handle as it completes, the
    /// model as of the barriers (taken in one turn, no write between).
    pending: HashMap<u64, PendingCheckpoint>,
    /// Lists with an append in flight: whether the store takes it is
    /// known only at its completion, so no other request of that list is
    /// sent meanwhile, and no barrier (see `Sim::checkpoint`).
    appending: HashSet<Key>,
}

impl Operator {
    /// An append of `element` to the list at `k` answered: taken (`ok`),
    /// refused at the list cap (`capped`), or failed (the list becomes
    /// unknown). A taken one must leave the list within the cap.
    fn appended(&mut self, seed: u64, k: Key, element: &[u8], ok: bool, capped: bool) {
        self.appending.remove(&k);
        if !ok {
            if !capped {
                self.unknown.insert(k);
            }
            return;
        }
        if self.unknown.contains(&k) {
            return;
        }
        let list = self.model.lists.entry(k.clone()).or_default();
        list.extend_from_slice(element);
        assert!(
            list.len() <= LIST_CAP,
            "seed {seed}: {} list {k:?} was taken past the cap: {} bytes",
            self.name,
            list.len()
        );
    }
}

struct PendingCheckpoint {
    handles: Vec<Option<Vec<u8>>>,
    answered: usize,
    failed: bool,
    model: Model,
}

/// A checkpoint that completed in every part: its id, the parts' handles
/// and the model.
type Point = (u64, Vec<Vec<u8>>, Model);

/// A completion as `Sim::drive` hands it on (owned).
struct Seen {
    token: u64,
    /// `Ok` or `NotFound`.
    ok: bool,
    /// `Ok`.
    found: bool,
    /// `TooLarge` (an append at the list cap).
    too_large: bool,
    slot: Option<u32>,
    len: u32,
    last: bool,
    aux: u64,
    value: Option<Vec<u8>>,
}

/// One session of an operator (a subtask), over key groups `kg`.
struct Client {
    op: usize,
    part: usize,
    kg: (u16, u16),
    session: Session,
    sid: u64,
    /// Session-local ids of its value, map and list states.
    value_state: u32,
    map_state: u32,
    list_state: u32,
    in_flight: HashMap<u64, Expect>,
    next_token: u64,
}

struct Hostile {
    sid: u64,
    session: Session,
    /// Its own mapping of the segment, which it scribbles over.
    segment: Segment,
}

struct Sim {
    rng: Rng,
    seed: u64,
    dir: tempfile::TempDir,
    /// `None` only while it is replaced.
    shard: Option<Shard<FaultIo<SyncIo>>>,
    tx: Sender<ShardMsg>,
    registry: Arc<Mutex<Registry>>,
    operators: Vec<Operator>,
    clients: Vec<Client>,
    hostile: Vec<Hostile>,
    next_session: u64,
    next_checkpoint: u64,
    next_snapshot: u64,
    /// A fault is planned in this incarnation of the store: error
    /// statuses are allowed (wrong values never).
    faulty: bool,
    /// The planned fault kills the machine (a torn write, after which
    /// nothing reaches the disk): requests may then never complete.
    dying: bool,
    /// The planned fault stays once it struck (a disk that fails every
    /// fsync from then on): a checkpoint waiting for a flush waits for
    /// good, as the store retries the flush (the engine's checkpoint
    /// timeout aborts it).
    stuck: bool,
    /// A digest of every completion the clients saw, in order.
    digest: u64,
    counts: Counts,
}

#[derive(Default, Debug)]
struct Counts {
    requests: u64,
    checked_reads: u64,
    errors: u64,
    checkpoints: u64,
    crashes: u64,
    restores: u64,
    deaths: u64,
    scribbles: u64,
    failed_opens: u64,
    rescales: u64,
    /// Appends refused at the list cap.
    list_refusals: u64,
    /// Importing jobs the janitor dropped.
    jobs_dropped: u64,
    /// Portable snapshots exported and imported into a new operator, and
    /// how many of the exports were of a retained checkpoint.
    exports: u64,
    imports: u64,
    checkpoint_exports: u64,
}

type Opened = (
    Shard<FaultIo<SyncIo>>,
    Sender<ShardMsg>,
    Arc<Mutex<Registry>>,
);

/// The shard over the store in `dir`, as statord opens it (with the fault
/// `plan` ahead, and fsyncs taking `slow_fsync` if set), and the control
/// side's ends of it. When the shard is dropped (a crash), every write no
/// fsync made durable is lost.
fn open_shard(
    dir: &Path,
    plan: Option<FaultPlan>,
    slow_fsync: Option<Duration>,
) -> Result<Opened, stator_store::StoreError> {
    let mut cfg = StoreConfig::new(dir.join("store"), 24 << 20);
    // Small memtables: flushes and compactions run throughout.
    cfg.memtable_bytes = Some(1 << 20);
    // A failed flush is retried after this (wall-clock) delay: short, as
    // the simulation's turns are.
    cfg.retry_delay = Duration::from_millis(1);
    cfg.max_list_len = LIST_CAP;
    let mut io = FaultIo::new(SyncIo::new(false), plan);
    io.lose_unsynced_writes();
    if let Some(d) = slow_fsync {
        io.slow_fsyncs(d);
    }
    let (store, _) = Store::open(cfg, io)?;
    let registry = Arc::new(Mutex::new(Registry::open(dir).unwrap()));
    let (tx, rx): (Sender<ShardMsg>, Receiver<ShardMsg>) = crossbeam_channel::unbounded();
    let bell = Arc::new(Doorbell::new().unwrap());
    let shard = Shard::new(0, store, rx, bell, (Duration::ZERO, 64), registry.clone());
    Ok((shard, tx, registry))
}

impl Sim {
    /// One turn of the shard's loop; the simulated clock moves a
    /// microsecond (a client waiting for an answer lets time pass: a slow
    /// fsync that blocks a flush is due after so many steps). The daemon's
    /// registry thread saves what imports registered now and then
    /// (`Registry::save_pending`): an import is installed only once that
    /// save is done.
    fn step(&mut self) -> bool {
        stator_store::clock::advance(Duration::from_micros(1));
        if self.rng.chance(2) {
            Registry::save_pending(&self.registry);
        }
        self.shard.as_mut().expect("a shard runs").step()
    }

    fn new(seed: u64) -> Sim {
        let mut sim = Sim::bare(seed, None);
        for i in 0..3 {
            sim.add_operator(i);
            // One subtask for the first, two for the others.
            sim.open_parts(i, 1 + usize::from(i > 0));
        }
        // A first checkpoint of the empty state: every operator has one to
        // restore after a crash.
        for o in 0..sim.operators.len() {
            sim.checkpoint(o);
        }
        while sim.operators.iter().any(|o| o.restorable.is_none()) {
            sim.step();
            sim.reap();
        }
        sim
    }

    /// A simulator with a shard and no operators yet (fsyncs taking
    /// `slow_fsync` if set).
    fn bare(seed: u64, slow_fsync: Option<Duration>) -> Sim {
        // The store's and the shard's clock is this thread's own, moved by
        // the turns: the run depends on nothing but the seed.
        stator_store::clock::simulate(true);
        let dir = tempfile::tempdir().unwrap();
        let (shard, tx, registry) = open_shard(dir.path(), None, slow_fsync).unwrap();
        Sim {
            rng: Rng(seed),
            seed,
            dir,
            shard: Some(shard),
            tx,
            registry,
            operators: Vec::new(),
            clients: Vec::new(),
            hostile: Vec::new(),
            next_session: 1,
            next_checkpoint: 1,
            next_snapshot: 1,
            faulty: false,
            dying: false,
            stuck: false,
            digest: 0xcbf2_9ce4_8422_2325,
            counts: Counts::default(),
        }
    }

    /// Operator `i` (`op{i}`), with no state and no subtask yet.
    fn add_operator(&mut self, i: usize) {
        self.operators.push(Operator {
            name: format!("op{i}"),
            model: Model::default(),
            unknown: HashSet::new(),
            restorable: None,
            pending: HashMap::new(),
            appending: HashSet::new(),
        });
    }

    /// Opens `parts` sessions of operator `o`, over its key groups split
    /// as Flink splits them among subtasks.
    fn open_parts(&mut self, o: usize, parts: usize) {
        for part in 0..parts {
            let kg = stator_ring::keygroup::key_group_range(
                u32::from(KEY_GROUPS),
                parts as u32,
                part as u32,
            );
            let c = self.open_client(o, part, kg);
            self.clients.push(c);
        }
    }

    /// One turn of the world: the generator picks what happens.
    fn turn(&mut self) {
        stator_store::clock::advance(Duration::from_micros(self.rng.below(100)));
        match self.rng.below(1000) {
            0..=549 => {
                let o = self.rng.below(self.operators.len() as u64) as usize;
                self.submit_batch(o);
            }
            550..=929 => {
                for _ in 0..1 + self.rng.below(4) {
                    self.step();
                }
                self.reap();
            }
            930..=964 => {
                let o = self.rng.below(self.operators.len() as u64) as usize;
                self.checkpoint(o);
            }
            965..=979 => self.scribble(),
            980..=991 => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.die(c);
            }
            992..=993 => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.export_import(c);
            }
            _ => self.crash(true),
        }
    }

    /// Runs `turns` turns, then lets everything in flight complete (a
    /// machine a torn write killed, or whose disk fails for good, crashes
    /// first and comes back on a sound disk).
    fn run(&mut self, turns: u64) {
        for _ in 0..turns {
            self.turn();
        }
        let struck = self
            .shard
            .as_ref()
            .is_some_and(|s| s.store().io().injected > 0);
        if self.dying || (self.stuck && struck) {
            self.crash(false);
        }
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end {
            if self.clients.iter().all(|c| c.in_flight.is_empty()) {
                return;
            }
            self.step();
            self.reap();
        }
        let left: Vec<String> = self
            .clients
            .iter()
            .flat_map(|c| {
                c.in_flight
                    .values()
                    .map(move |e| format!("{} part {}: {}", c.op, c.part, e.what()))
            })
            .collect();
        panic!(
            "seed {}: requests never completed (fault planned: {}): {left:?}",
            self.seed, self.faulty
        );
    }

    /// Steps the shard until `rx` answers (the control thread blocks so).
    fn await_reply<T>(&mut self, rx: &Receiver<T>) -> T {
        for _ in 0..1_000_000 {
            if let Ok(r) = rx.try_recv() {
                return r;
            }
            self.step();
        }
        panic!(
            "seed {}: the shard never answered a control message",
            self.seed
        );
    }

    /// A session of `job`'s `operator` over key groups `kg`, claimed and
    /// counted in the registry as the control thread does (the janitor
    /// drops only jobs without sessions).
    fn open_session(
        &mut self,
        job: &str,
        operator: &str,
        kg: (u16, u16),
    ) -> (u64, [std::os::fd::OwnedFd; 3]) {
        Registry::open_session(&self.registry, job, 0)
            .unwrap_or_else(|r| panic!("seed {}: {job} refused: {r:?}", self.seed));
        let sid = self.next_session;
        self.next_session += 1;
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(ShardMsg::Open {
                session: sid,
                owner: (job.into(), operator.into()),
                subtask: (0, 1, u32::from(KEY_GROUPS)),
                params: RingParams {
                    sq_entries: 256,
                    cq_entries: 256,
                    buf_entries: 256,
                    arena_len: 4 << 20,
                    // Two slots for portable snapshots.
                    chunk_len: 2 * stator_store::snapshot::CHUNK_LEN as u64,
                },
                key_groups: kg,
                max_in_flight: 4096,
                reply,
            })
            .unwrap();
        let fds = self.await_reply(&rx).expect("the shard opens a session");
        (sid, [fds.memfd, fds.to_daemon, fds.to_client])
    }

    fn add_state(&mut self, sid: u64, job: &str, operator: &str, name: &str, k: u8) -> u32 {
        let store_id =
            Registry::register_durably(&self.registry, job, operator, &[(name, k)]).unwrap()[0];
        let (reply, rx) = crossbeam_channel::bounded(1);
        let kind = match k {
            kind::MAP => StateKind::Map,
            kind::LIST => StateKind::List,
            _ => StateKind::Value,
        };
        self.tx
            .send(ShardMsg::AddState {
                session: sid,
                kind,
                store_id,
                max_states: 16,
                reply,
            })
            .unwrap();
        self.await_reply(&rx).unwrap()
    }

    /// Part `part` of operator `o`, a session over key groups `kg` (its
    /// state as the store holds it).
    fn open_client(&mut self, o: usize, part: usize, kg: (u16, u16)) -> Client {
        let name = self.operators[o].name.clone();
        let (sid, fds) = self.open_session(JOB, &name, kg);
        let value_state = self.add_state(sid, JOB, &name, "value", kind::VALUE);
        let map_state = self.add_state(sid, JOB, &name, "map", kind::MAP);
        let list_state = self.add_state(sid, JOB, &name, "list", kind::LIST);
        let (sock, _) = UnixStream::pair().unwrap();
        let session = Session::attach(sock, fds, sid, kg, &OpenOptions::new(JOB, &name)).unwrap();
        Client {
            op: o,
            part,
            kg,
            session,
            sid,
            value_state,
            map_state,
            list_state,
            in_flight: HashMap::new(),
            next_token: 1,
        }
    }

    fn key(&mut self) -> Key {
        let k = self.rng.below(KEYS);
        ((k % u64::from(KEY_GROUPS)) as u16, k.to_be_bytes().to_vec())
    }

    fn value(&mut self) -> Vec<u8> {
        let len = if self.rng.chance(3) {
            self.rng.below(9000)
        } else {
            self.rng.below(120)
        };
        self.rng.bytes(len as usize)
    }

    /// Operator `o` submits a batch of requests, each to the part that
    /// serves its key group, each checked later.
    fn submit_batch(&mut self, o: usize) {
        let n = 1 + self.rng.below(48);
        let mut used = Vec::new();
        for _ in 0..n {
            let key = self.key();
            let uk = self.rng.below(USER_KEYS).to_be_bytes().to_vec();
            let value = self.value();
            let pick = self.rng.below(120);
            if pick >= 100 && self.operators[o].appending.contains(&key) {
                // Its list's length is not known until the append answers.
                continue;
            }
            let mut element = (value.len() as u32).to_le_bytes().to_vec();
            element.extend_from_slice(&value);
            let c = self
                .clients
                .iter()
                .position(|c| c.op == o && (c.kg.0..=c.kg.1).contains(&key.0))
                .expect("every key group has its part");
            if !used.contains(&c) {
                used.push(c);
            }
            let (cl, op) = (&mut self.clients[c], &mut self.operators[o]);
            let token = cl.next_token;
            let (vs, ms, ls) = (cl.value_state, cl.map_state, cl.list_state);
            let (req, expect) = match pick {
                0..=29 => (
                    Request {
                        value: &value,
                        ..Request::new(Opcode::Put, vs, key.0, &key.1)
                    },
                    Expect::Write(key.clone()),
                ),
                30..=59 => (
                    Request {
                        capacity: 16 << 10,
                        ..Request::new(Opcode::Get, vs, key.0, &key.1)
                    },
                    Expect::Read(key.clone(), op.model.values.get(&key).cloned()),
                ),
                60..=64 => (
                    Request::new(Opcode::Delete, vs, key.0, &key.1),
                    Expect::Write(key.clone()),
                ),
                65..=79 => (
                    Request {
                        user_key: &uk,
                        value: &value,
                        ..Request::new(Opcode::MapPut, ms, key.0, &key.1)
                    },
                    Expect::Write(key.clone()),
                ),
                80..=94 => (
                    Request {
                        user_key: &uk,
                        capacity: 16 << 10,
                        ..Request::new(Opcode::MapGet, ms, key.0, &key.1)
                    },
                    Expect::MapRead(
                        key.clone(),
                        uk.clone(),
                        op.model.maps.get(&(key.clone(), uk.clone())).cloned(),
                    ),
                ),
                95..=99 => (
                    Request::new(Opcode::Clear, ms, key.0, &key.1),
                    Expect::Write(key.clone()),
                ),
                100..=109 => (
                    Request {
                        value: &value,
                        ..Request::new(Opcode::ListAppend, ls, key.0, &key.1)
                    },
                    Expect::Append(key.clone(), element),
                ),
                110..=116 => (
                    Request {
                        capacity: 16 << 10,
                        ..Request::new(Opcode::ListGet, ls, key.0, &key.1)
                    },
                    Expect::ListRead(key.clone(), op.model.lists.get(&key).cloned()),
                ),
                _ => (
                    Request::new(Opcode::Clear, ls, key.0, &key.1),
                    Expect::Write(key.clone()),
                ),
            };
            if cl.session.submit(&req, token).is_err() {
                // Full: the rest waits for the next turn.
                break;
            }
            // The write takes effect for every later request of this
            // session (per-key order).
            match req.op {
                Opcode::Put => {
                    op.model.values.insert(key.clone(), value.clone());
                }
                Opcode::Delete => {
                    op.model.values.remove(&key);
                }
                Opcode::MapPut => {
                    op.model
                        .maps
                        .insert((key.clone(), uk.clone()), value.clone());
                }
                Opcode::Clear if req.state == ls => {
                    op.model.lists.remove(&key);
                }
                Opcode::Clear => op.model.maps.retain(|(k, _), _| *k != key),
                Opcode::ListAppend => {
                    op.appending.insert(key.clone());
                }
                _ => {}
            }
            cl.in_flight.insert(token, expect);
            cl.next_token += 1;
            self.counts.requests += 1;
        }
        for c in used {
            let _ = self.clients[c].session.flush();
        }
    }

    /// Operator `o` checkpoints: a barrier in each of its parts, in one
    /// turn (no write between them), so the model as of now is what the
    /// checkpoint holds once every part completed it.
    fn checkpoint(&mut self, o: usize) {
        // An append in flight at a barrier may or may not be in the
        // checkpoint (the cap decides): the model could not say, so the
        // barrier waits for the operator's appends to answer (or, on a
        // machine a fault stopped, is not taken).
        for _ in 0..10_000 {
            if self.operators[o].appending.is_empty() {
                break;
            }
            self.step();
            self.reap();
        }
        if !self.operators[o].appending.is_empty() {
            return;
        }
        let id = self.next_checkpoint;
        self.next_checkpoint += 1;
        let parts: Vec<usize> = (0..self.clients.len())
            .filter(|&c| self.clients[c].op == o)
            .collect();
        let mut failed = false;
        for &c in &parts {
            let cl = &mut self.clients[c];
            let token = cl.next_token;
            if cl.session.submit(&Request::checkpoint(id), token).is_ok() {
                cl.in_flight.insert(token, Expect::Checkpoint(id, cl.part));
                cl.next_token += 1;
                let _ = cl.session.flush();
            } else {
                // That part will never answer: the checkpoint is not whole.
                failed = true;
            }
        }
        let op = &mut self.operators[o];
        op.pending.insert(
            id,
            PendingCheckpoint {
                handles: vec![None; parts.len()],
                answered: usize::from(failed) * parts.len(),
                failed,
                model: op.model.clone(),
            },
        );
    }

    /// Every client takes what completed, and checks it.
    fn reap(&mut self) {
        let seed = self.seed;
        // Error statuses only once the planned fault struck.
        let faulty = self
            .shard
            .as_ref()
            .is_some_and(|s| s.store().io().injected > 0);
        let mut notices = Vec::new();
        for cl in &mut self.clients {
            let op = &mut self.operators[cl.op];
            let mut seen = Vec::new();
            cl.session
                .poll(|d| seen.push((d.token, d.status, d.value.map(<[u8]>::to_vec))))
                .unwrap_or_else(|e| panic!("seed {seed}: an honest session failed: {e}"));
            for (token, status, value) in seen {
                self.digest = fold(self.digest, token, status, value.as_deref());
                let expect = cl
                    .in_flight
                    .remove(&token)
                    .unwrap_or_else(|| panic!("seed {seed}: a completion nobody awaits ({token})"));
                let ok = matches!(status, Ok(Status::Ok) | Ok(Status::NotFound));
                let capped = matches!(expect, Expect::Append(..)) && status == Ok(Status::TooLarge);
                if capped {
                    self.counts.list_refusals += 1;
                } else if !ok {
                    self.counts.errors += 1;
                    assert!(
                        faulty,
                        "seed {seed}: {} got {status:?} with no fault planned ({})",
                        op.name,
                        expect.what()
                    );
                }
                match expect {
                    Expect::Write(k) => {
                        if !ok {
                            op.unknown.insert(k);
                        }
                    }
                    Expect::Read(k, want) => {
                        if ok && !op.unknown.contains(&k) {
                            let got = (status == Ok(Status::Ok)).then_some(value);
                            assert_eq!(
                                got.as_ref().map(|v| v.as_ref().map(Vec::len)),
                                want.as_ref().map(|w| Some(w.len())),
                                "seed {seed}: {} read {k:?}",
                                op.name
                            );
                            assert!(
                                got.flatten() == want,
                                "seed {seed}: {} read {k:?}: wrong bytes",
                                op.name
                            );
                            self.counts.checked_reads += 1;
                        }
                    }
                    Expect::Append(k, element) => op.appended(seed, k, &element, ok, capped),
                    Expect::ListRead(ref k, ref want) | Expect::MapRead(ref k, _, ref want) => {
                        if ok && !op.unknown.contains(k) {
                            let got = (status == Ok(Status::Ok)).then(|| value.unwrap_or_default());
                            assert!(
                                got == *want,
                                "seed {seed}: {} {} {k:?}: {:?} bytes, want {:?}",
                                op.name,
                                expect.what(),
                                got.map(|g| g.len()),
                                want.as_ref().map(|w| w.len())
                            );
                            self.counts.checked_reads += 1;
                        }
                    }
                    Expect::Notify => {}
                    Expect::Checkpoint(id, part) => {
                        let Some(p) = op.pending.get_mut(&id) else {
                            continue;
                        };
                        p.answered += 1;
                        match (ok, value) {
                            (true, Some(h)) => p.handles[part] = Some(h),
                            _ => p.failed = true,
                        }
                        if p.answered < p.handles.len() {
                            continue;
                        }
                        let p = op.pending.remove(&id).expect("looked up above");
                        // Keys unknown at the barrier stay unknown in it:
                        // only a checkpoint with none is a restore point.
                        // One older than the restore point completed last
                        // is not one either: as Flink's coordinator does,
                        // the newer one subsumed it (the store deleted it
                        // when told the newer one completed).
                        let whole = !p.failed
                            && op.unknown.is_empty()
                            && op.restorable.as_ref().is_none_or(|r| r.0 < id);
                        notices.push((
                            cl.op,
                            id,
                            if whole {
                                Notify::Complete
                            } else {
                                Notify::Abort
                            },
                        ));
                        // Half the time the restore point it replaces is
                        // subsumed too (Flink says so once a newer one
                        // completed; the store deletes it, completed).
                        if let (true, 0, Some((prev, _, _))) = (whole, id % 2, &op.restorable) {
                            notices.push((cl.op, *prev, Notify::Subsume));
                        }
                        if whole {
                            let handles = p
                                .handles
                                .into_iter()
                                .map(|h| h.expect("all answered"))
                                .collect();
                            op.restorable = Some((id, handles, p.model));
                            self.counts.checkpoints += 1;
                            if std::env::var_os("SIM_VERBOSE").is_some() {
                                eprintln!("sim: {} checkpoint {id} done", op.name);
                            }
                        }
                    }
                }
            }
        }
        for (o, id, kind) in notices {
            if std::env::var_os("SIM_VERBOSE").is_some() {
                eprintln!("sim: {} checkpoint {id}: {kind:?}", self.operators[o].name);
            }
            for cl in self.clients.iter_mut().filter(|c| c.op == o) {
                let token = cl.next_token;
                // A full queue drops the notice, as a lost RPC would.
                if cl
                    .session
                    .submit(&Request::checkpoint_notify(id, kind), token)
                    .is_ok()
                {
                    cl.in_flight.insert(token, Expect::Notify);
                    cl.next_token += 1;
                    let _ = cl.session.flush();
                }
            }
        }
    }

    /// Client `c` dies with its requests in flight; a new session of its
    /// operator, over the same key groups, carries on from what the store
    /// holds.
    fn die(&mut self, c: usize) {
        self.counts.deaths += 1;
        let old = self.clients.remove(c);
        let op = &mut self.operators[old.op];
        for e in old.in_flight.values() {
            match e {
                Expect::Write(k) | Expect::Append(k, _) => {
                    op.appending.remove(k);
                    op.unknown.insert(k.clone());
                }
                // That part never answers: the checkpoint is not whole.
                Expect::Checkpoint(id, _) => {
                    op.pending.remove(id);
                }
                Expect::Read(..) | Expect::MapRead(..) | Expect::ListRead(..) | Expect::Notify => {}
            }
        }
        self.close(old.sid, JOB, old.session);
        let fresh = self.open_client(old.op, old.part, old.kg);
        self.clients.insert(c, fresh);
    }

    /// A hostile client opens a session and writes garbage over its own
    /// segment (queues, indices, arena) at random.
    fn scribble(&mut self) {
        self.counts.scribbles += 1;
        if self.hostile.is_empty() || self.rng.chance(30) {
            let operator = format!("hostile{}", self.next_session);
            let (sid, fds) = self.open_session(JOB, &operator, (0, KEY_GROUPS - 1));
            self.add_state(sid, JOB, &operator, "value", kind::VALUE);
            let mine = Segment::attach(fds[0].try_clone().unwrap()).unwrap();
            let (sock, _) = UnixStream::pair().unwrap();
            let o = OpenOptions::new(JOB, &operator);
            let session = Session::attach(sock, fds, sid, (0, KEY_GROUPS - 1), &o).unwrap();
            self.hostile.push(Hostile {
                sid,
                session,
                segment: mine,
            });
        }
        let h = self.rng.below(self.hostile.len() as u64) as usize;
        // Some honest-looking requests first, then garbage.
        for i in 0..self.rng.below(8) {
            let k = i.to_be_bytes();
            let _ = self.hostile[h]
                .session
                .submit(&Request::new(Opcode::Get, 0, 1, &k), i);
        }
        let _ = self.hostile[h].session.flush();
        let len = self.hostile[h].segment.view().len();
        for _ in 0..1 + self.rng.below(64) {
            // Mostly the control page and queues at the start.
            let off = if self.rng.chance(70) {
                self.rng.below(16 << 10)
            } else {
                self.rng.below(len as u64)
            } as usize;
            let n = 1 + self.rng.below(16) as usize;
            let bytes = self.rng.bytes(n);
            let end = (off + bytes.len()).min(len);
            let _ = self.hostile[h]
                .segment
                .view()
                .write_from(off, &bytes[..end - off]);
        }
        if self.rng.chance(20) {
            let gone = self.hostile.swap_remove(h);
            self.close(gone.sid, JOB, gone.session);
        }
    }

    /// Steps the shard, and hands `f` what `session` completed each time
    /// (maybe nothing), until `f` says it is done: `false` when it never
    /// is (a fault may stop a request for good).
    fn drive(
        &mut self,
        session: &mut Session,
        mut f: impl FnMut(&mut Session, &[Seen]) -> bool,
    ) -> bool {
        let mut seen = Vec::new();
        for _ in 0..200_000 {
            if f(session, &seen) {
                return true;
            }
            self.step();
            seen.clear();
            session
                .poll(|d| {
                    seen.push(Seen {
                        token: d.token,
                        ok: d.check().is_ok(),
                        found: d.status == Ok(Status::Ok),
                        too_large: d.status == Ok(Status::TooLarge),
                        slot: d.slot,
                        len: d.len,
                        last: d.last,
                        aux: d.aux,
                        value: d.value.map(<[u8]>::to_vec),
                    })
                })
                .unwrap_or_else(|e| panic!("seed {}: an honest session failed: {e}", self.seed));
        }
        false
    }

    /// Client `c` exports its part of its operator's state (a portable
    /// snapshot, over the session's two chunk slots), live or, half the
    /// time, as the operator's last completed checkpoint holds it; a new
    /// operator imports it in a session over the same key groups: every
    /// key the part's model (or the checkpoint's) knows reads back the
    /// same there, and no other. A failure is allowed only while a fault
    /// was planned.
    fn export_import(&mut self, c: usize) {
        if self.dying {
            return;
        }
        let (seed, id) = (self.seed, self.next_snapshot);
        self.next_snapshot += 1;
        let mut cl = self.clients.remove(c);
        // An export needs its session idle: what it has in flight completes
        // first (an error only with a fault planned; a failed write's key
        // becomes unknown; reads' answers are not checked here).
        let mut early = Vec::new();
        let idle = self.drive(&mut cl.session, |_, seen| {
            early.extend(seen.iter().map(|d| (d.token, d.ok, d.too_large)));
            early.len() == cl.in_flight.len()
        });
        for (t, ok, too_large) in early {
            let expect = cl.in_flight.remove(&t);
            let capped = too_large && matches!(expect, Some(Expect::Append(..)));
            assert!(
                ok || capped || self.faulty,
                "seed {seed}: an error with no fault planned"
            );
            let op = &mut self.operators[cl.op];
            match expect {
                Some(Expect::Write(k)) if !ok => {
                    op.unknown.insert(k);
                }
                Some(Expect::Append(k, element)) => op.appended(seed, k, &element, ok, capped),
                _ => {}
            }
        }
        if !idle {
            self.clients.insert(c, cl);
            assert!(self.faulty, "seed {seed}: requests never completed");
            return;
        }
        let faulty = self.faulty;
        // (The handles of every part: the export takes this part's key
        // groups of them.)
        let from = self.operators[cl.op]
            .restorable
            .clone()
            .filter(|_| self.rng.chance(50));
        let (chunks, model, skip) = match from {
            Some((_, handles, model)) => {
                let chunks = self.export(&mut cl.session, id, Some(&handles.concat()));
                let model = model.part(cl.kg, &HashSet::new());
                self.counts.checkpoint_exports += u64::from(chunks.is_some());
                (chunks, model, HashSet::new())
            }
            None => {
                let chunks = self.export(&mut cl.session, id, None);
                let unknown = self.operators[cl.op].unknown.clone();
                (chunks, self.part_model(&cl), unknown)
            }
        };
        let kg = cl.kg;
        self.clients.insert(c, cl);
        let Some(chunks) = chunks else {
            assert!(
                faulty,
                "seed {seed}: an export failed with no fault planned"
            );
            return;
        };
        self.counts.exports += 1;
        // Import into a new job's operator, then read every key back.
        let (job, name) = (format!("imp{id}"), "op".to_string());
        let (sid, fds) = self.open_session(&job, &name, kg);
        let (sock, _) = UnixStream::pair().unwrap();
        let mut session =
            Session::attach(sock, fds, sid, kg, &OpenOptions::new(&job, &name)).unwrap();
        if !self.import(&mut session, id, &chunks) {
            assert!(
                faulty,
                "seed {seed}: an import failed with no fault planned"
            );
            self.close(sid, &job, session);
            return;
        }
        self.counts.imports += 1;
        let value_state = self.add_state(sid, &job, &name, "value", kind::VALUE);
        let map_state = self.add_state(sid, &job, &name, "map", kind::MAP);
        let list_state = self.add_state(sid, &job, &name, "list", kind::LIST);
        let keys: Vec<Key> = (0..KEYS)
            .map(|k| ((k % u64::from(KEY_GROUPS)) as u16, k.to_be_bytes().to_vec()))
            .filter(|k| (kg.0..=kg.1).contains(&k.0))
            .collect();
        let uks: Vec<Vec<u8>> = (0..USER_KEYS).map(|u| u.to_be_bytes().to_vec()).collect();
        // Each read, its token (its place here) and what it must answer.
        let mut want: Vec<(u64, Request<'_>, Option<Vec<u8>>)> = Vec::new();
        let mut read = |req, user_key, expect| {
            let req = Request {
                user_key,
                capacity: 16 << 10,
                ..req
            };
            want.push((want.len() as u64, req, expect));
        };
        for k in keys.iter().filter(|k| !skip.contains(k)) {
            let get = |op, state| Request::new(op, state, k.0, &k.1);
            read(
                get(Opcode::Get, value_state),
                b"",
                model.values.get(k).cloned(),
            );
            read(
                get(Opcode::ListGet, list_state),
                b"",
                model.lists.get(k).cloned(),
            );
            for uk in &uks {
                let entry = model.maps.get(&(k.clone(), uk.clone())).cloned();
                read(get(Opcode::MapGet, map_state), uk, entry);
            }
        }
        let mut next = 0;
        let mut answered = 0;
        let ok = self.drive(&mut session, |s, seen| {
            for d in seen {
                let (_, req, expect) = &want[d.token as usize];
                assert!(
                    d.ok || faulty,
                    "seed {seed}: imported {:?} of {name}: error with no fault planned",
                    req.op
                );
                if d.ok {
                    let got = d.found.then(|| d.value.clone().unwrap_or_default());
                    assert!(
                        got == *expect,
                        "seed {seed}: imported {name} reads {:?} {:?}: {got:?}, exported {expect:?}",
                        req.op,
                        req.key
                    );
                }
                answered += 1;
            }
            while next < want.len() && s.submit(&want[next].1, want[next].0).is_ok() {
                next += 1;
            }
            let _ = s.flush();
            answered == want.len()
        });
        assert!(
            ok || faulty,
            "seed {seed}: reads of an import never completed"
        );
        self.close(sid, &job, session);
        if self.rng.chance(50) {
            self.janitor();
        }
    }

    /// The daemon's janitor with no grace time: every job without a
    /// session or a retained checkpoint is dropped (here, the importing
    /// jobs done with), and compaction leaves its records out once the
    /// names' save is durable. The operators' job always has sessions, so
    /// it is never dropped, and its reads go on checking that nothing of
    /// it went with the others'.
    fn janitor(&mut self) {
        let retained = statord::registry::Retained {
            jobs: HashSet::new(),
            as_of: Instant::now(),
        };
        let dropped = Registry::drop_idle(&self.registry, Duration::ZERO, &retained);
        assert!(
            !dropped.iter().any(|j| j == JOB),
            "seed {}: a job with sessions was dropped",
            self.seed
        );
        self.counts.jobs_dropped += dropped.len() as u64;
    }

    /// Exports `session`'s state as snapshot `id`, live or what the
    /// checkpoints `handles` (back to back) hold: its chunks in order, or
    /// `None` if it failed.
    fn export(
        &mut self,
        session: &mut Session,
        id: u64,
        handles: Option<&[u8]>,
    ) -> Option<Vec<Vec<u8>>> {
        let mut chunks: BTreeMap<u32, Vec<u8>> = BTreeMap::new();
        let (mut started, mut ended, mut failed) = (false, false, false);
        let mut held = 0u32;
        let req = match handles {
            Some(h) => Request::snapshot_export_checkpoints(id, h),
            None => Request::snapshot_export(id),
        };
        let _ = session.submit(&req, u64::MAX);
        let _ = session.flush();
        let ok = self.drive(session, |s, seen| {
            for d in seen {
                failed |= !d.ok;
                if d.token == u64::MAX {
                    if d.ok {
                        started = true;
                        // Both slots to it, one chunk each.
                        for slot in 0..2u32 {
                            let _ = s.submit(&Request::chunk_release(id, slot), u64::from(slot));
                            held += 1;
                        }
                    }
                    continue;
                }
                held -= 1;
                if d.found {
                    let slot = d.slot.expect("a chunk names its slot");
                    chunks.insert(
                        d.aux as u32,
                        s.chunk(slot, d.len as usize).unwrap().to_vec(),
                    );
                    ended |= d.last;
                    if !ended && !failed {
                        let _ = s.submit(&Request::chunk_release(id, slot), u64::from(slot));
                        held += 1;
                    }
                }
            }
            let _ = s.flush();
            held == 0 && (started || failed)
        });
        if !ok || failed || !ended {
            return None;
        }
        let n = chunks.len() as u32;
        assert_eq!(
            chunks.keys().copied().collect::<Vec<_>>(),
            (0..n).collect::<Vec<_>>(),
            "seed {}: an export's chunks",
            self.seed
        );
        Some(chunks.into_values().collect())
    }

    /// Imports `chunks` (in order) as import `id` into `session`: whether
    /// it was installed.
    fn import(&mut self, session: &mut Session, id: u64, chunks: &[Vec<u8>]) -> bool {
        let mut free: Vec<u32> = vec![1, 0];
        let (mut next, mut in_flight, mut installed, mut failed) = (0usize, 0u32, false, false);
        let ok = self.drive(session, |s, seen| {
            for d in seen {
                in_flight -= 1;
                failed |= !d.ok;
                installed |= d.last && d.ok;
                free.extend(d.slot);
            }
            while !failed && next < chunks.len() {
                let Some(slot) = free.pop() else { break };
                s.write_chunk(slot, &chunks[next]).unwrap();
                let _ = s.submit(&Request::snapshot_import(id, slot), u64::from(slot));
                next += 1;
                in_flight += 1;
            }
            let _ = s.flush();
            in_flight == 0 && (installed || failed || next == chunks.len())
        });
        if ok && !installed {
            // Not installed: the daemon lets go of it.
            let _ = session.submit(&Request::import_cancel(id), u64::MAX - 2);
            let _ = session.flush();
            let mut cancelled = false;
            self.drive(session, |_, seen| {
                cancelled |= !seen.is_empty();
                cancelled
            });
        }
        ok && installed
    }

    /// What client `cl`'s part of its operator holds, as far as the model
    /// knows: (values, map entries) of its key groups, unknown keys left
    /// out.
    fn part_model(&self, cl: &Client) -> Model {
        let op = &self.operators[cl.op];
        op.model.part(cl.kg, &op.unknown)
    }

    /// Closes session `sid` as the control side does when its client's
    /// connection ends: the client's end goes first, then the shard's.
    fn close(&mut self, sid: u64, job: &str, session: Session) {
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(ShardMsg::Close {
                session: sid,
                reply,
            })
            .unwrap();
        drop(session);
        self.await_reply(&rx);
        self.registry.lock().unwrap().leave(job);
    }

    /// The machine dies: the shard and everything in memory are gone. The
    /// store reopens (maybe with a fault ahead), and every operator
    /// restores its last completed checkpoint, which must hold exactly its
    /// model. A restore the planned fault fails is tried again after
    /// another crash, with no fault.
    fn crash(&mut self, fault_allowed: bool) {
        self.counts.crashes += 1;
        let mut plan = (fault_allowed && self.rng.chance(60)).then(|| self.plan());
        if std::env::var_os("SIM_VERBOSE").is_some() {
            eprintln!("sim: crash {}: next fault {plan:?}", self.counts.crashes);
        }
        self.clients.clear();
        self.hostile.clear();
        // The old shard (and its store, with every memtable) goes first,
        // as in a crash: nothing of it is flushed.
        drop(self.shard.take());
        let slow = self
            .rng
            .chance(25)
            .then(|| Duration::from_micros(100 + self.rng.below(20_000)));
        let (shard, tx, registry) = match open_shard(self.dir.path(), plan, slow) {
            Ok(o) => o,
            Err(e) => {
                // The fault met the store's recovery: statord would not
                // start, saying why. The disk mends; start again.
                assert!(
                    plan.is_some(),
                    "seed {}: the store did not open: {e}",
                    self.seed
                );
                self.counts.failed_opens += 1;
                plan = None;
                open_shard(self.dir.path(), None, slow).unwrap_or_else(|e| {
                    panic!(
                        "seed {}: the store did not open on a sound disk: {e}",
                        self.seed
                    )
                })
            }
        };
        (self.shard, self.tx, self.registry) = (Some(shard), tx, registry);
        self.faulty = plan.is_some();
        self.dying = plan.is_some_and(|p| p.fault == Fault::TornWriteCrash);
        self.stuck = plan.is_some_and(|p| p.sticky);
        let mut failed = false;
        for o in 0..self.operators.len() {
            // Each operator comes back with one or two subtasks: a rescale
            // when that differs from before. Every part restores the same
            // handles, each clipped to its key groups.
            let parts = 1 + self.rng.below(2) as usize;
            self.open_parts(o, parts);
            let op = &mut self.operators[o];
            op.pending.clear();
            op.unknown.clear();
            op.appending.clear();
            let (id, handles, model) = op
                .restorable
                .clone()
                .expect("every operator has a checkpoint");
            if handles.len() != parts {
                self.counts.rescales += 1;
            }
            let (states, _) = self
                .registry
                .lock()
                .unwrap()
                .view()
                .get()
                .operator_states(JOB, &self.operators[o].name);
            let sids: Vec<u64> = self
                .clients
                .iter()
                .filter(|c| c.op == o)
                .map(|c| c.sid)
                .collect();
            for sid in sids {
                let (reply, rx) = crossbeam_channel::bounded(1);
                self.tx
                    .send(ShardMsg::Restore {
                        session: sid,
                        states: states.clone(),
                        handles: handles.clone(),
                        reply,
                    })
                    .unwrap();
                match self.await_reply(&rx) {
                    Ok(_) => self.counts.restores += 1,
                    Err(e) => {
                        let struck = self
                            .shard
                            .as_ref()
                            .is_some_and(|s| s.store().io().injected > 0);
                        assert!(
                            struck,
                            "seed {}: restore of checkpoint {id} failed with no fault injected: {e}",
                            self.seed
                        );
                        failed = true;
                    }
                }
            }
            self.operators[o].model = model;
        }
        if failed {
            self.crash(false);
            return;
        }
        // What each operator restored, read back at once: a sample of its
        // model's keys and of keys it does not hold.
        for o in 0..self.operators.len() {
            self.verify(o);
        }
    }

    /// Reads up to 64 keys of operator `o`'s model and 16 others, each
    /// checked against the model at its completion.
    fn verify(&mut self, o: usize) {
        let mut keys: Vec<Key> = self.operators[o].model.values.keys().cloned().collect();
        let mut entries: Vec<(Key, Vec<u8>)> =
            self.operators[o].model.maps.keys().cloned().collect();
        let mut lists: Vec<Key> = self.operators[o].model.lists.keys().cloned().collect();
        while lists.len() > 32 {
            let i = self.rng.below(lists.len() as u64) as usize;
            lists.swap_remove(i);
        }
        for _ in 0..8 {
            lists.push(self.key());
        }
        // The same sample for the same seed: pick by the generator.
        while keys.len() > 64 {
            let i = self.rng.below(keys.len() as u64) as usize;
            keys.swap_remove(i);
        }
        while entries.len() > 64 {
            let i = self.rng.below(entries.len() as u64) as usize;
            entries.swap_remove(i);
        }
        for _ in 0..16 {
            keys.push(self.key());
        }
        for key in keys {
            let want = self.operators[o].model.values.get(&key).cloned();
            let r = |vs| Request {
                capacity: 16 << 10,
                ..Request::new(Opcode::Get, vs, key.0, &key.1)
            };
            self.submit_checked(o, key.0, r, Expect::Read(key.clone(), want));
        }
        for key in lists {
            let want = self.operators[o].model.lists.get(&key).cloned();
            let r = |ls| Request {
                capacity: 16 << 10,
                ..Request::new(Opcode::ListGet, ls, key.0, &key.1)
            };
            self.submit_checked(o, key.0, r, Expect::ListRead(key.clone(), want));
        }
        for (key, uk) in entries {
            let want = self.operators[o]
                .model
                .maps
                .get(&(key.clone(), uk.clone()))
                .cloned();
            let r = |ms| Request {
                user_key: &uk,
                capacity: 16 << 10,
                ..Request::new(Opcode::MapGet, ms, key.0, &key.1)
            };
            self.submit_checked(o, key.0, r, Expect::MapRead(key.clone(), uk.clone(), want));
        }
    }

    /// Submits the read `req` (given the part's value, map or list state
    /// id, as its kind needs) to the part of operator `o` that serves key group
    /// `kg`, stepping the shard while the part's queue is full.
    fn submit_checked<'a>(
        &mut self,
        o: usize,
        kg: u16,
        req: impl Fn(u32) -> Request<'a>,
        expect: Expect,
    ) {
        let c = self
            .clients
            .iter()
            .position(|c| c.op == o && (c.kg.0..=c.kg.1).contains(&kg))
            .expect("every key group has its part");
        for _ in 0..100_000 {
            let cl = &mut self.clients[c];
            let r = req(match expect {
                Expect::MapRead(..) => cl.map_state,
                Expect::ListRead(..) => cl.list_state,
                _ => cl.value_state,
            });
            let token = cl.next_token;
            if cl.session.submit(&r, token).is_ok() {
                let _ = cl.session.flush();
                cl.in_flight.insert(token, expect);
                cl.next_token += 1;
                self.counts.requests += 1;
                return;
            }
            let _ = cl.session.flush();
            self.step();
            self.reap();
        }
        panic!("seed {}: a read never found room", self.seed);
    }

    fn plan(&mut self) -> FaultPlan {
        let fault = match self.rng.below(7) {
            0 => Fault::ReadEio,
            1 => Fault::WriteEio,
            2 => Fault::NoSpace,
            3 => Fault::FsyncEio,
            4 => Fault::TornWriteCrash,
            5 => Fault::RenameEio,
            _ => Fault::ReadBitFlip,
        };
        FaultPlan {
            after: self.rng.below(40),
            fault,
            sticky: self.rng.chance(15),
        }
    }
}

/// FNV-1a over what a client saw.
fn fold(mut h: u64, token: u64, status: Result<Status, i32>, value: Option<&[u8]>) -> u64 {
    let status = match status {
        Ok(s) => s as i32,
        Err(e) => e,
    };
    let mut eat = |b: &[u8]| {
        for &x in b {
            h ^= u64::from(x);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&token.to_le_bytes());
    eat(&status.to_le_bytes());
    eat(value.unwrap_or(b"-"));
    h
}

fn run_seed(seed: u64, turns: u64) -> (u64, Counts) {
    eprintln!("sim: seed {seed} ({turns} turns); replay with SIM_SEED={seed}");
    let mut sim = Sim::new(seed);
    sim.run(turns);
    let shard = sim.shard.take().expect("a shard runs");
    drop(sim.clients.drain(..));
    shard.stop();
    stator_store::clock::simulate(false);
    (sim.digest, std::mem::take(&mut sim.counts))
}

/// Turns per seed in the fixed set CI runs.
const TURNS: u64 = 20_000;

/// A fixed set of seeds (or `SIM_SEED`'s one); with `SIM_SECONDS`, fresh
/// seeds until that time has passed.
#[test]
fn seeded_runs_keep_every_acknowledged_write() {
    let one: Option<u64> = std::env::var("SIM_SEED")
        .ok()
        .map(|s| s.parse().expect("SIM_SEED is a number"));
    let seconds: Option<u64> = std::env::var("SIM_SECONDS")
        .ok()
        .map(|s| s.parse().expect("SIM_SECONDS is a number"));
    let turns = std::env::var("SIM_TURNS")
        .ok()
        .map_or(TURNS, |s| s.parse().expect("SIM_TURNS is a number"));
    let seeds: Vec<u64> = match (one, seconds) {
        (Some(s), _) => vec![s],
        (None, None) => (1..=12).collect(),
        (None, Some(_)) => Vec::new(),
    };
    let mut total = Counts::default();
    let mut add = |c: Counts| {
        total.requests += c.requests;
        total.checked_reads += c.checked_reads;
        total.errors += c.errors;
        total.checkpoints += c.checkpoints;
        total.crashes += c.crashes;
        total.restores += c.restores;
        total.deaths += c.deaths;
        total.scribbles += c.scribbles;
        total.failed_opens += c.failed_opens;
        total.rescales += c.rescales;
        total.exports += c.exports;
        total.imports += c.imports;
        total.checkpoint_exports += c.checkpoint_exports;
        total.list_refusals += c.list_refusals;
        total.jobs_dropped += c.jobs_dropped;
    };
    for seed in seeds {
        let (digest, c) = run_seed(seed, turns);
        eprintln!("sim: seed {seed}: digest {digest:016x}, {c:?}");
        add(c);
    }
    if let Some(s) = seconds {
        let end = Instant::now() + Duration::from_secs(s);
        let mut seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        while Instant::now() < end {
            seed = Rng(seed).next();
            let (digest, c) = run_seed(seed, turns);
            eprintln!("sim: seed {seed}: digest {digest:016x}, {c:?}");
            add(c);
        }
    }
    eprintln!("sim: in all {total:?}");
    assert!(
        total.checked_reads > 0
            && total.restores > 0
            && total.list_refusals > 0
            && total.jobs_dropped > 0,
        "the runs checked something: {total:?}"
    );
}

/// The same seed gives the same run: every completion, in the same order,
/// with the same status and bytes.
#[test]
fn a_seed_replays_exactly() {
    let (a, ca) = run_seed(99, 4_000);
    let (b, cb) = run_seed(99, 4_000);
    assert_eq!(a, b, "{ca:?} then {cb:?}");
    assert_eq!(format!("{ca:?}"), format!("{cb:?}"));
}

/// While writes wait for room (the frozen memtable's flush waits for a
/// slow fsync and the active one is full), a session's writes stay queued
/// and another session's reads are still taken and answered.
#[test]
fn reads_are_answered_while_writes_wait_for_room() {
    let mut sim = Sim::bare(5, Some(Duration::from_secs(3600)));
    sim.add_operator(0);
    sim.add_operator(1);
    let kg = (0, KEY_GROUPS - 1);
    let mut writer = sim.open_client(0, 0, kg);
    let mut reader = sim.open_client(1, 0, kg);
    let value = vec![7u8; 4000];
    let room = |sim: &Sim| sim.shard.as_ref().unwrap().store().write_room();
    let mut token = 0u64;
    // Writes until the store has no room left for more.
    for _ in 0..100_000 {
        if room(&sim) == 0 {
            break;
        }
        for _ in 0..32 {
            let key = token.to_be_bytes();
            let put = Request {
                value: &value,
                ..Request::new(Opcode::Put, writer.value_state, (token % 128) as u16, &key)
            };
            if writer.session.submit(&put, token).is_err() {
                break;
            }
            token += 1;
        }
        writer.session.flush().unwrap();
        sim.step();
        writer.session.poll(|_| {}).unwrap();
    }
    assert_eq!(room(&sim), 0, "writes never ran out of room");
    // More writes queue up behind the stall.
    for t in token..token + 8 {
        let key = t.to_be_bytes();
        let put = Request {
            value: &value,
            ..Request::new(Opcode::Put, writer.value_state, (t % 128) as u16, &key)
        };
        writer.session.submit(&put, t).unwrap();
    }
    writer.session.flush().unwrap();
    let keys: Vec<[u8; 8]> = (0..64u64).map(u64::to_be_bytes).collect();
    for (i, key) in keys.iter().enumerate() {
        let get = Request {
            capacity: 16 << 10,
            ..Request::new(Opcode::Get, reader.value_state, (i % 128) as u16, key)
        };
        reader.session.submit(&get, i as u64).unwrap();
    }
    reader.session.flush().unwrap();
    let mut answered = 0;
    for _ in 0..50 {
        sim.step();
        reader
            .session
            .poll(|d| {
                assert_eq!(
                    d.status,
                    Ok(Status::NotFound),
                    "the reader's own state is empty"
                );
                answered += 1;
            })
            .unwrap();
    }
    assert_eq!(
        answered,
        keys.len(),
        "reads waited behind another session's writes"
    );
    assert_eq!(room(&sim), 0, "writes still wait for room");
    let mut written = 0;
    writer.session.poll(|_| written += 1).unwrap();
    assert_eq!(written, 0, "no write was taken without room");
    let shard = sim.shard.take().unwrap();
    drop((writer, reader));
    drop(shard);
    stator_store::clock::simulate(false);
}
