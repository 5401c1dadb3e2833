//! A seeded simulator of a statord shard, driven from one thread.
//!
//! One shard (`statord::shard::Shard`, the daemon's own) runs over the
//! store's fault-injecting `Io` on the synchronous one, in this process;
//! the simulator plays the control side (opening sessions, registering
//! states, restores, closes) by sending the shard the messages the
//! control thread sends, and every client is the Rust client's `Session`
//! over the session's real shared-memory segment. One seeded generator
//! decides everything: which client does what, its keys and values, when
//! a checkpoint is taken, when a client dies in the middle of its
//! requests, when a hostile client scribbles over its own segment, when
//! the machine crashes, and which disk fault (EIO, ENOSPC, a torn write
//! and then nothing, a flipped bit, a failed fsync) the next incarnation
//! of the store meets and after how many operations.
//!
//! What must hold, checked at every completion and restart:
//! - an honest client's read returns what its model holds (per-key order:
//!   a read sees every write submitted before it); an error status is
//!   allowed only while a fault was planned, a wrong value never;
//! - a checkpoint that completed restores exactly its model after a
//!   crash (nothing acknowledged is lost);
//! - hostile and dying clients reach nothing of the others: the honest
//!   sessions are never broken off, and the shard never panics.
//!
//! Every run prints its seed and a digest of what the clients saw. The
//! client side replays exactly from a seed; the shard's background work is
//! paced by the wall clock (`stator_store::pace`), so how far a flush got
//! between two steps, and so which completion a fault lands on, can vary
//! between replays of a seed (the store has no simulated clock yet).
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
use stator_client::{Opcode, OpenOptions, Request, Session, Status};
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
}

/// What a request in flight must answer.
enum Expect {
    /// A value read: found (with these bytes) or not.
    Read(Key, Option<Vec<u8>>),
    /// A map entry read.
    MapRead(Key, Vec<u8>, Option<Vec<u8>>),
    /// A write to this key (its failure makes the key unknown).
    Write(Key),
    /// A checkpoint, with the model as of its barrier.
    Checkpoint(u64, Box<Model>),
}

const JOB: &str = "sim";
const KEY_GROUPS: u16 = 128;
/// Small key spaces: reads find what was written, writes overwrite.
const KEYS: u64 = 600;
const USER_KEYS: u64 = 4;

struct Client {
    operator: String,
    session: Session,
    sid: u64,
    /// Session-local ids of its value and map states.
    value_state: u32,
    map_state: u32,
    model: Model,
    in_flight: HashMap<u64, Expect>,
    next_token: u64,
    /// Keys whose value is not known: a write to them failed, or was in
    /// flight when an earlier session of this operator died.
    unknown: HashSet<Key>,
    /// The last checkpoint that completed.
    restorable: Option<Point>,
}

/// A checkpoint that completed: its id, handle and model.
type Point = (u64, Vec<u8>, Model);

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
    clients: Vec<Client>,
    hostile: Vec<Hostile>,
    next_session: u64,
    next_checkpoint: u64,
    /// A fault is planned in this incarnation of the store: error
    /// statuses are allowed (wrong values never).
    faulty: bool,
    /// The planned fault kills the machine (a torn write, after which
    /// nothing reaches the disk): requests may then never complete.
    dying: bool,
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
}

type Opened = (
    Shard<FaultIo<SyncIo>>,
    Sender<ShardMsg>,
    Arc<Mutex<Registry>>,
);

/// The shard over the store in `dir`, as statord opens it (with the fault
/// `plan` ahead), and the control side's ends of it.
fn open_shard(dir: &Path, plan: Option<FaultPlan>) -> Result<Opened, stator_store::StoreError> {
    let mut cfg = StoreConfig::new(dir.join("store"), 24 << 20);
    // Small memtables: flushes and compactions run throughout.
    cfg.memtable_bytes = Some(1 << 20);
    // A failed flush is retried after this (wall-clock) delay: short, as
    // the simulation's turns are.
    cfg.retry_delay = Duration::from_millis(1);
    let io = FaultIo::new(SyncIo::new(false), plan);
    let (store, _) = Store::open(cfg, io)?;
    let registry = Arc::new(Mutex::new(Registry::open(dir).unwrap()));
    let (tx, rx): (Sender<ShardMsg>, Receiver<ShardMsg>) = crossbeam_channel::unbounded();
    let bell = Arc::new(Doorbell::new().unwrap());
    let shard = Shard::new(0, store, rx, bell, (Duration::ZERO, 64), registry.clone());
    Ok((shard, tx, registry))
}

impl Sim {
    fn step(&mut self) -> bool {
        self.shard.as_mut().expect("a shard runs").step()
    }

    fn new(seed: u64) -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let (shard, tx, registry) = open_shard(dir.path(), None).unwrap();
        let mut sim = Sim {
            rng: Rng(seed),
            seed,
            dir,
            shard: Some(shard),
            tx,
            registry,
            clients: Vec::new(),
            hostile: Vec::new(),
            next_session: 1,
            next_checkpoint: 1,
            faulty: false,
            dying: false,
            digest: 0xcbf2_9ce4_8422_2325,
            counts: Counts::default(),
        };
        for i in 0..3 {
            let c = sim.open_client(format!("op{i}"));
            sim.clients.push(c);
        }
        // A first checkpoint of the empty state: every operator has one to
        // restore after a crash.
        for c in 0..sim.clients.len() {
            sim.checkpoint(c);
        }
        while sim.clients.iter().any(|c| c.restorable.is_none()) {
            sim.step();
            sim.reap();
        }
        sim
    }

    /// One turn of the world: the generator picks what happens.
    fn turn(&mut self) {
        match self.rng.below(1000) {
            0..=549 => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.submit_batch(c);
            }
            550..=929 => {
                for _ in 0..1 + self.rng.below(4) {
                    self.step();
                }
                self.reap();
            }
            930..=964 => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.checkpoint(c);
            }
            965..=979 => self.scribble(),
            980..=993 => {
                let c = self.rng.below(self.clients.len() as u64) as usize;
                self.die(c);
            }
            _ => self.crash(true),
        }
    }

    /// Runs `turns` turns, then lets everything in flight complete (a
    /// machine a torn write killed crashes first, as it would).
    fn run(&mut self, turns: u64) {
        for _ in 0..turns {
            self.turn();
        }
        if self.dying {
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
                c.in_flight.values().map(move |e| {
                    let what = match e {
                        Expect::Read(..) => "read".to_string(),
                        Expect::MapRead(..) => "map read".to_string(),
                        Expect::Write(..) => "write".to_string(),
                        Expect::Checkpoint(id, _) => format!("checkpoint {id}"),
                    };
                    format!("{}: {what}", c.operator)
                })
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

    fn open_session(&mut self, operator: &str) -> (u64, [std::os::fd::OwnedFd; 3]) {
        let sid = self.next_session;
        self.next_session += 1;
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(ShardMsg::Open {
                session: sid,
                owner: (JOB.into(), operator.into()),
                subtask: (0, 1, u32::from(KEY_GROUPS)),
                params: RingParams {
                    sq_entries: 256,
                    cq_entries: 256,
                    buf_entries: 256,
                    arena_len: 4 << 20,
                    chunk_len: 0,
                },
                key_groups: (0, KEY_GROUPS - 1),
                max_in_flight: 4096,
                reply,
            })
            .unwrap();
        let fds = self.await_reply(&rx).expect("the shard opens a session");
        (sid, [fds.memfd, fds.to_daemon, fds.to_client])
    }

    fn add_state(&mut self, sid: u64, operator: &str, name: &str, k: u8) -> u32 {
        let store_id = self
            .registry
            .lock()
            .unwrap()
            .register_all(JOB, operator, &[(name, k)])
            .unwrap()[0];
        let (reply, rx) = crossbeam_channel::bounded(1);
        let kind = if k == kind::MAP {
            StateKind::Map
        } else {
            StateKind::Value
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

    /// A session for `operator` (its state as the store holds it).
    fn open_client(&mut self, operator: String) -> Client {
        let (sid, fds) = self.open_session(&operator);
        let value_state = self.add_state(sid, &operator, "value", kind::VALUE);
        let map_state = self.add_state(sid, &operator, "map", kind::MAP);
        let (sock, _) = UnixStream::pair().unwrap();
        let o = OpenOptions::new(JOB, &operator);
        let session = Session::attach(sock, fds, sid, (0, KEY_GROUPS - 1), &o).unwrap();
        Client {
            operator,
            session,
            sid,
            value_state,
            map_state,
            model: Model::default(),
            in_flight: HashMap::new(),
            next_token: 1,
            unknown: HashSet::new(),
            restorable: None,
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

    /// Client `c` submits a batch of requests, each checked later.
    fn submit_batch(&mut self, c: usize) {
        let n = 1 + self.rng.below(48);
        for _ in 0..n {
            let key = self.key();
            let uk = self.rng.below(USER_KEYS).to_be_bytes().to_vec();
            let value = self.value();
            let pick = self.rng.below(100);
            let cl = &mut self.clients[c];
            let token = cl.next_token;
            let (vs, ms) = (cl.value_state, cl.map_state);
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
                    Expect::Read(key.clone(), cl.model.values.get(&key).cloned()),
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
                        cl.model.maps.get(&(key.clone(), uk.clone())).cloned(),
                    ),
                ),
                _ => (
                    Request::new(Opcode::Clear, ms, key.0, &key.1),
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
                    cl.model.values.insert(key.clone(), value.clone());
                }
                Opcode::Delete => {
                    cl.model.values.remove(&key);
                }
                Opcode::MapPut => {
                    cl.model
                        .maps
                        .insert((key.clone(), uk.clone()), value.clone());
                }
                Opcode::Clear => cl.model.maps.retain(|(k, _), _| *k != key),
                _ => {}
            }
            cl.in_flight.insert(token, expect);
            cl.next_token += 1;
            self.counts.requests += 1;
        }
        let _ = self.clients[c].session.flush();
    }

    fn checkpoint(&mut self, c: usize) {
        let id = self.next_checkpoint;
        self.next_checkpoint += 1;
        let cl = &mut self.clients[c];
        let token = cl.next_token;
        if cl.session.submit(&Request::checkpoint(id), token).is_ok() {
            cl.in_flight
                .insert(token, Expect::Checkpoint(id, Box::new(cl.model.clone())));
            cl.next_token += 1;
            let _ = cl.session.flush();
        }
    }

    /// Every client takes what completed, and checks it.
    fn reap(&mut self) {
        let seed = self.seed;
        let faulty = self.faulty;
        for cl in &mut self.clients {
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
                if !ok {
                    self.counts.errors += 1;
                    assert!(
                        faulty,
                        "seed {seed}: {} got {status:?} with no fault planned",
                        cl.operator
                    );
                }
                match expect {
                    Expect::Write(k) => {
                        if !ok {
                            cl.unknown.insert(k);
                        }
                    }
                    Expect::Read(k, want) => {
                        if ok && !cl.unknown.contains(&k) {
                            let got = (status == Ok(Status::Ok)).then_some(value);
                            assert_eq!(
                                got.as_ref().map(|v| v.as_ref().map(Vec::len)),
                                want.as_ref().map(|w| Some(w.len())),
                                "seed {seed}: {} read {k:?}",
                                cl.operator
                            );
                            assert!(
                                got.flatten() == want,
                                "seed {seed}: {} read {k:?}: wrong bytes",
                                cl.operator
                            );
                            self.counts.checked_reads += 1;
                        }
                    }
                    Expect::MapRead(k, uk, want) => {
                        if ok && !cl.unknown.contains(&k) {
                            let got = (status == Ok(Status::Ok)).then(|| value.unwrap_or_default());
                            assert!(
                                got == want,
                                "seed {seed}: {} map read {k:?}/{uk:?}: {:?} bytes, want {:?}",
                                cl.operator,
                                got.map(|g| g.len()),
                                want.map(|w| w.len())
                            );
                            self.counts.checked_reads += 1;
                        }
                    }
                    Expect::Checkpoint(id, model) => {
                        if ok {
                            let handle = value.expect("a checkpoint completes with its handle");
                            // Keys unknown at the barrier stay unknown in it:
                            // only a checkpoint with none is a restore point.
                            if cl.unknown.is_empty() {
                                cl.restorable = Some((id, handle, *model));
                            }
                            self.counts.checkpoints += 1;
                        }
                    }
                }
            }
        }
    }

    /// Client `c` dies with its requests in flight; a new session of its
    /// operator carries on from what the store holds.
    fn die(&mut self, c: usize) {
        self.counts.deaths += 1;
        let old = self.clients.remove(c);
        let (reply, rx) = crossbeam_channel::bounded(1);
        self.tx
            .send(ShardMsg::Close {
                session: old.sid,
                reply,
            })
            .unwrap();
        let mut unknown = old.unknown.clone();
        for e in old.in_flight.values() {
            if let Expect::Write(k) = e {
                unknown.insert(k.clone());
            }
        }
        drop(old.session);
        self.await_reply(&rx);
        let mut fresh = self.open_client(old.operator);
        fresh.model = old.model;
        fresh.unknown = unknown;
        fresh.restorable = old.restorable;
        self.clients.insert(c, fresh);
    }

    /// A hostile client opens a session and writes garbage over its own
    /// segment (queues, indices, arena) at random.
    fn scribble(&mut self) {
        self.counts.scribbles += 1;
        if self.hostile.is_empty() || self.rng.chance(30) {
            let operator = format!("hostile{}", self.next_session);
            let (sid, fds) = self.open_session(&operator);
            self.add_state(sid, &operator, "value", kind::VALUE);
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
            let (reply, rx) = crossbeam_channel::bounded(1);
            self.tx
                .send(ShardMsg::Close {
                    session: gone.sid,
                    reply,
                })
                .unwrap();
            drop(gone);
            self.await_reply(&rx);
        }
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
        let points: Vec<(String, Option<Point>)> = self
            .clients
            .drain(..)
            .map(|c| (c.operator, c.restorable))
            .collect();
        self.hostile.clear();
        // The old shard (and its store, with every memtable) goes first,
        // as in a crash: nothing of it is flushed.
        drop(self.shard.take());
        let (shard, tx, registry) = match open_shard(self.dir.path(), plan) {
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
                open_shard(self.dir.path(), None).unwrap_or_else(|e| {
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
        let mut failed = false;
        for (operator, point) in points {
            let mut cl = self.open_client(operator);
            let (id, handle, model) = point.expect("every operator has a checkpoint");
            let (states, _) = self
                .registry
                .lock()
                .unwrap()
                .view()
                .get()
                .operator_states(JOB, &cl.operator);
            let (reply, rx) = crossbeam_channel::bounded(1);
            self.tx
                .send(ShardMsg::Restore {
                    session: cl.sid,
                    states,
                    handles: vec![handle.clone()],
                    reply,
                })
                .unwrap();
            match self.await_reply(&rx) {
                Ok(_) => self.counts.restores += 1,
                Err(e) => {
                    assert!(
                        self.faulty,
                        "seed {}: restore of checkpoint {id} failed with no fault planned: {e}",
                        self.seed
                    );
                    failed = true;
                }
            }
            cl.model = model.clone();
            cl.restorable = Some((id, handle, model));
            self.clients.push(cl);
        }
        if failed {
            self.crash(false);
        }
    }

    fn plan(&mut self) -> FaultPlan {
        let fault = match self.rng.below(6) {
            0 => Fault::ReadEio,
            1 => Fault::WriteEio,
            2 => Fault::NoSpace,
            3 => Fault::FsyncEio,
            4 => Fault::TornWriteCrash,
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
        total.checked_reads > 0 && total.restores > 0,
        "the runs checked something: {total:?}"
    );
}
