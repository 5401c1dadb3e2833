//! The state registry: each `(job, operator, name)`'s daemon-wide state
//! id and kind (`<data_dir>/states.json`), which uid each job belongs to
//! (`jobs.json`), and the immutable view of it shards read without a lock.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use stator_ring::control::{kind, status};
use stator_store::{DroppedStates, StateKind};

/// A request refused: the control protocol's status (`stator_ring::control::
/// status`) and a message naming what was refused and why. Defined here, the
/// lowest of the modules that refuse, so none of them imports another's.
pub(crate) type Refusal = (i32, String);

/// States the registry holds at most (each new one rewrites the file).
const MAX_REGISTERED: usize = 1 << 16;

/// State names of every job, and their store-wide ids. Persisted, so that
/// a restarted daemon gives the same (job, operator, name) the same id.
/// Also which uid each job belongs to (`jobs.json`): the first uid that
/// opened a session of it, so that one tenant cannot open another's job by
/// its name and reach its state or checkpoints. A job with no session and
/// no retained checkpoint for `drop_idle_jobs_after_secs` is dropped
/// ([`Registry::drop_idle`]): names, owner and (through compaction) live
/// state.
pub struct Registry {
    path: PathBuf,
    entries: Vec<RegEntry>,
    index: HashMap<(String, String, String), usize>,
    /// The id the next new state gets: ids are never reused, so a dropped
    /// job's records stay nobody's (and compaction leaves them out).
    next_id: u32,
    jobs_path: PathBuf,
    jobs: std::collections::BTreeMap<String, u32>,
    /// Open sessions of each job that has had one since the start.
    use_of: HashMap<String, JobUse>,
    /// When the registry was opened: a job no session opened since has
    /// been idle at least as long.
    opened: Instant,
    /// States one job may have registered (`max_states_per_job`).
    max_per_job: usize,
    /// What shards read, published after each change.
    view: RegistryView,
    /// Changes to the states (names, next id) since the registry was
    /// opened: `states.json` holds [`Saver::durable`] of them.
    version: u64,
    /// The state ids dropped as `states.json` holds them durably: what
    /// shards may let compaction leave out. A drop's ids join it only once
    /// the file without their names is durable, so that a crash never
    /// brings back names whose records are gone.
    dropped: Arc<DroppedStates>,
    /// Jobs dropped in memory: the states version whose save makes the
    /// drop durable (such a job is claimed again only after it), and the
    /// owner `jobs.json` keeps until then (names go first, then owners: a
    /// crash between must not leave names without their owner).
    dropping: HashMap<String, (u64, Option<u32>)>,
    /// Writes of `jobs.json`, in order, outside the registry's lock.
    jobs_saver: Arc<Saver>,
    /// Changes to the owners since the registry was opened.
    jobs_version: u64,
    /// Jobs claimed in memory, and the owners version whose save makes the
    /// claim durable: every session of such a job waits for it.
    claimed: HashMap<String, u64>,
}

/// Writes of `states.json`, in order: a registration an import makes on a
/// shard is saved here later, off the shard ([`Registry::save_pending`],
/// on the daemon's registry thread), and the import is not installed
/// before it is durable. Shared by the registry and its views.
#[derive(Default)]
pub struct Saver {
    /// The version the file holds; held while the file is written, so
    /// that an older snapshot never lands over a newer one.
    written: Mutex<u64>,
    /// The same, for readers that must not wait.
    durable: AtomicU64,
    /// Why the last write failed, until one succeeds.
    failure: Mutex<Option<String>>,
    /// Rung when a registration waits to be saved.
    bell: Option<(
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    )>,
}

impl Saver {
    fn new() -> Saver {
        Saver {
            bell: Some(crossbeam_channel::bounded(1)),
            ..Saver::default()
        }
    }

    /// The version of the states `states.json` holds durably.
    pub fn durable(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }

    /// Why saving the states failed last, while it does.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until a registration wants saving or `timeout` passes.
    pub fn wait(&self, timeout: Duration) {
        if let Some((_, rx)) = &self.bell {
            let _ = rx.recv_timeout(timeout);
        }
    }

    /// Ends a [`Saver::wait`] at once.
    pub fn wake(&self) {
        if let Some((tx, _)) = &self.bell {
            let _ = tx.try_send(());
        }
    }

    /// Writes `bytes` (version `version`) to `path` durably, unless a newer
    /// version is there already.
    fn write(&self, path: &Path, version: u64, bytes: &[u8]) -> std::io::Result<()> {
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        if version <= *written {
            return Ok(());
        }
        let r = write_file(path, bytes);
        let mut failure = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        match &r {
            Ok(()) => {
                *written = version;
                self.durable.store(version, Ordering::Release);
                *failure = None;
            }
            Err(e) => *failure = Some(e.to_string()),
        }
        r
    }
}

/// A job's open sessions, and since when it has had none.
struct JobUse {
    sessions: usize,
    idle_since: Instant,
}

/// What the shards' reports say about checkpoints, for
/// [`Registry::drop_idle`].
pub struct Retained {
    /// Jobs with a retained checkpoint (completed or not) on any shard.
    pub jobs: std::collections::HashSet<String>,
    /// When the oldest of those reports was made: a job idle since before
    /// then cannot have a checkpoint it does not list.
    pub as_of: Instant,
}

/// `states.json` as read: the registrations and the next id, or (a file
/// from before jobs could be dropped) the registrations alone.
#[derive(Deserialize)]
#[serde(untagged)]
enum StatesFile {
    Current { next_id: u32, states: Vec<RegEntry> },
    Listed(Vec<RegEntry>),
}

/// `states.json` as written.
#[derive(Serialize)]
struct StatesOut<'a> {
    next_id: u32,
    states: &'a [RegEntry],
}

/// The registry as shards read it: an immutable copy, replaced whole after
/// each change, so that a shard never waits on a registration's file
/// writes and fsyncs. A shard takes the registry's mutex only to register
/// the state names an import brings in memory; the registry thread saves
/// them ([`Saver`]), never under that mutex.
#[derive(Clone, Default)]
pub struct RegistryView {
    view: Arc<RwLock<Arc<RegView>>>,
    saver: Arc<Saver>,
}

impl RegistryView {
    /// The registry as of now.
    pub fn get(&self) -> Arc<RegView> {
        self.view.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How far `states.json` got.
    pub fn saver(&self) -> &Saver {
        &self.saver
    }

    fn publish(&self, entries: &[RegEntry], version: u64, dropped: &Arc<DroppedStates>) {
        let mut v = RegView {
            dropped: dropped.clone(),
            version,
            ..RegView::default()
        };
        for e in entries {
            v.by_operator
                .entry(e.job.clone())
                .or_default()
                .entry(e.operator.clone())
                .or_default()
                .entries
                .push(e.clone());
        }
        // What each checkpoint of an operator keeps, made here (off the
        // shards) once per registration rather than at every checkpoint.
        for op in v.by_operator.values_mut().flat_map(|o| o.values_mut()) {
            op.ids = op.entries.iter().map(|e| e.id).collect();
            op.meta = serde_json::to_vec(&op.entries).unwrap_or_default();
        }
        *self.view.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(v);
    }
}

/// One version of the registry: each operator's states, in registration
/// order.
#[derive(Default)]
pub struct RegView {
    by_operator: HashMap<String, HashMap<String, OperatorStates>>,
    /// State ids of dropped jobs, whose records compaction leaves out.
    dropped: Arc<DroppedStates>,
    /// The registry's version (see [`Saver`]): state installed under
    /// ids read here waits for `Saver::durable` to reach it.
    version: u64,
}

/// One operator's registrations, and what its checkpoints keep of them.
#[derive(Default)]
struct OperatorStates {
    entries: Vec<RegEntry>,
    ids: Vec<u32>,
    /// `entries` as JSON.
    meta: Vec<u8>,
}

impl RegView {
    /// Its version (see [`Saver`]).
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Jobs with registered states, and those states.
    pub fn counts(&self) -> (usize, usize) {
        let states = self
            .by_operator
            .values()
            .flat_map(|o| o.values())
            .map(|o| o.entries.len())
            .sum();
        (self.by_operator.len(), states)
    }

    /// State ids no one may name any more (see [`DroppedStates`]).
    pub fn dropped(&self) -> &Arc<DroppedStates> {
        &self.dropped
    }

    fn operator(&self, job: &str, op: &str) -> Option<&OperatorStates> {
        self.by_operator.get(job).and_then(|o| o.get(op))
    }

    fn of(&self, job: &str, op: &str) -> &[RegEntry] {
        self.operator(job, op).map_or(&[], |o| &o.entries)
    }

    /// Every state id of an operator, and its registrations as JSON (kept
    /// in checkpoint manifests).
    pub fn operator_states(&self, job: &str, op: &str) -> (Vec<u32>, Vec<u8>) {
        match self.operator(job, op) {
            Some(o) => (o.ids.clone(), o.meta.clone()),
            None => (Vec::new(), b"[]".to_vec()),
        }
    }

    /// Every state of an operator, as a portable snapshot names it.
    pub fn operator_descs(&self, job: &str, op: &str) -> Vec<stator_store::snapshot::StateDesc> {
        self.of(job, op)
            .iter()
            .filter_map(|e| {
                Some(stator_store::snapshot::StateDesc {
                    id: e.id,
                    kind: state_kind(e.kind)?,
                    name: e.name.as_bytes().to_vec(),
                })
            })
            .collect()
    }

    /// Whether `(job, op, name)` is registered.
    pub fn is_registered(&self, job: &str, op: &str, name: &str) -> bool {
        self.of(job, op).iter().any(|e| e.name == name)
    }

    /// The id of registered state `(job, op, name)`, if it is of kind `k`.
    pub fn id_of(&self, job: &str, op: &str, name: &str, k: u8) -> Result<u32, String> {
        match self.of(job, op).iter().find(|e| e.name == name) {
            Some(e) if e.kind == k => Ok(e.id),
            Some(e) => Err(conflict(name, op, e.kind, k)),
            None => Err(format!(
                "state `{name}` of operator `{op}` is not registered"
            )),
        }
    }
}

/// Why a state cannot be registered as kind `want`.
fn conflict(name: &str, op: &str, have: u8, want: u8) -> String {
    format!(
        "state `{name}` of operator `{op}` is registered as {}, not {}",
        kind_name(have),
        kind_name(want)
    )
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct RegEntry {
    job: String,
    operator: String,
    name: String,
    kind: u8,
    id: u32,
}

impl Registry {
    /// Loads `<data_dir>/states.json` and `jobs.json` (or starts empty).
    pub fn open(data_dir: &Path) -> std::io::Result<Registry> {
        let path = data_dir.join("states.json");
        let (next_id, entries) = match load_json(&path)? {
            None => (1, Vec::new()),
            Some(StatesFile::Current { next_id, states }) => (next_id, states),
            Some(StatesFile::Listed(states)) => (1, states),
        };
        // Past every id in the file, whatever it says.
        let next_id = entries
            .iter()
            .map(|e| e.id + 1)
            .fold(next_id.max(1), u32::max);
        let jobs_path = data_dir.join("jobs.json");
        let jobs = load_json(&jobs_path)?.unwrap_or_default();
        let index = index_of(&entries);
        let view = RegistryView {
            saver: Arc::new(Saver::new()),
            ..RegistryView::default()
        };
        let dropped = Arc::new(DroppedStates::new(next_id, entries.iter().map(|e| e.id)));
        view.publish(&entries, 0, &dropped);
        Ok(Registry {
            path,
            entries,
            index,
            next_id,
            jobs_path,
            jobs,
            use_of: HashMap::new(),
            opened: Instant::now(),
            max_per_job: crate::config::DEFAULT_MAX_STATES_PER_JOB,
            view,
            version: 0,
            dropped,
            dropping: HashMap::new(),
            jobs_saver: Arc::new(Saver::default()),
            jobs_version: 0,
            claimed: HashMap::new(),
        })
    }

    /// What shards read (see [`RegistryView`]).
    pub fn view(&self) -> RegistryView {
        self.view.clone()
    }

    /// Sets how many states one job may register (`max_states_per_job`;
    /// at start and at a reload).
    pub fn set_max_states_per_job(&mut self, n: usize) {
        self.max_per_job = n;
    }

    /// Lets `uid` open a session of `job`, and counts the session in
    /// ([`Registry::enter`]): a job belongs to the first uid that opens it
    /// (durably); another uid is refused. A job that already has state but
    /// no owner (imported by root, or from before owners were kept) is
    /// refused too: the first comer must not take another's state; the
    /// operator names its uid in `jobs.json`. Root and statord's own uid
    /// may open any job and claim none (statorctl's exports and imports).
    ///
    /// The registry's lock is held for the claim and the count, never for
    /// a file write: a job dropped in memory is claimed only once its drop
    /// is durable (`states.json` without its names, saved first), and the
    /// session of a claim not yet durable waits for it (`jobs.json`, saved
    /// after the lock). A claim whose save fails stays in memory, saved
    /// by the next save that succeeds, and the sessions waiting for it are
    /// refused; undoing it could race another subtask of the uid opening
    /// at the same moment. The session is not counted when refused.
    pub fn open_session(registry: &Mutex<Registry>, job: &str, uid: u32) -> Result<(), Refusal> {
        let lock = || registry.lock().unwrap_or_else(|p| p.into_inner());
        // The drop check and the claim under one lock: a drop between them
        // would let any uid claim a job whose names are still saved.
        let need = loop {
            let mut r = lock();
            let saver = r.view.saver.clone();
            match r.dropping.get(job) {
                Some(&(v, _)) if v > saver.durable() => {
                    drop(r);
                    Registry::save_pending(registry);
                    if saver.durable() < v {
                        let why = saver.failure().unwrap_or_default();
                        return Err((
                            status::INTERNAL,
                            format!(
                                "job `{job}` was dropped, and the state registry cannot be saved: {why}"
                            ),
                        ));
                    }
                }
                _ => {
                    let need = r.claim(job, uid)?;
                    r.enter(job);
                    break need;
                }
            }
        };
        if let Some(v) = need
            && let Err(why) = Registry::save_jobs(registry, v)
        {
            lock().leave(job);
            return Err((
                status::INTERNAL,
                format!("cannot save the job owners: {why}"),
            ));
        }
        Ok(())
    }

    /// [`Registry::open_session`]'s claim, in memory: the owners version
    /// the session needs durable, if `jobs.json` does not hold it yet.
    fn claim(&mut self, job: &str, uid: u32) -> Result<Option<u64>, Refusal> {
        let durable = self.jobs_saver.durable();
        self.claimed.retain(|_, v| *v > durable);
        if self.owned_by(job, uid)? {
            return Ok(self.claimed.get(job).copied());
        }
        if self.jobs.len() >= MAX_REGISTERED {
            return Err((
                status::LIMIT,
                format!("{MAX_REGISTERED} jobs are claimed on this daemon"),
            ));
        }
        self.jobs.insert(job.to_string(), uid);
        self.jobs_version += 1;
        self.claimed.insert(job.to_string(), self.jobs_version);
        tracing::info!(job, uid, "job claimed by its first uid");
        Ok(Some(self.jobs_version))
    }

    /// Makes `jobs.json` hold owners version `version` (or a later one),
    /// written outside the registry's lock; why not. Owners of jobs whose
    /// drop is not durable yet stay in the file.
    fn save_jobs(registry: &Mutex<Registry>, version: u64) -> Result<(), String> {
        let (saver, path, latest, jobs) = {
            let r = registry.lock().unwrap_or_else(|p| p.into_inner());
            if r.jobs_saver.durable() >= version {
                return Ok(());
            }
            let mut jobs = r.jobs.clone();
            let durable = r.view.saver.durable();
            for (job, &(v, owner)) in &r.dropping {
                if let Some(uid) = owner.filter(|_| v > durable) {
                    jobs.insert(job.clone(), uid);
                }
            }
            (
                r.jobs_saver.clone(),
                r.jobs_path.clone(),
                r.jobs_version,
                jobs,
            )
        };
        let bytes = serde_json::to_vec_pretty(&jobs).expect("owners serialize");
        let _ = saver.write(&path, latest, &bytes);
        if saver.durable() >= version {
            return Ok(());
        }
        Err(saver.failure().unwrap_or_default())
    }

    /// Whether `uid` may use `job` as its own: true for its owner, root
    /// and statord's own uid; false for a job no uid owns and that has no
    /// state (free to claim); refused for another uid's job, and for one
    /// with state but no owner (the first comer must not take another's
    /// state; the operator names its uid in `jobs.json`).
    fn owned_by(&self, job: &str, uid: u32) -> Result<bool, Refusal> {
        if uid == 0 || uid == nix::unistd::geteuid().as_raw() {
            return Ok(true);
        }
        match self.jobs.get(job) {
            Some(&owner) if owner == uid => Ok(true),
            Some(&owner) => Err((
                status::DENIED,
                format!(
                    "job `{job}` belongs to uid {owner}, not {uid} (the first uid to open it; jobs.json in the data directory)"
                ),
            )),
            None if self.entries.iter().any(|e| e.job == job) => Err((
                status::DENIED,
                format!(
                    "job `{job}` has state but no owning uid; the operator assigns it in jobs.json in the data directory (\"{job}\": {uid})"
                ),
            )),
            None => Ok(false),
        }
    }

    /// Whether `uid` may release checkpoints of `job` (a `Release`, with
    /// no session, which never claims): as [`Registry::owned_by`], and a
    /// job no uid owns has nothing to release.
    pub fn may_release(&self, job: &str, uid: u32) -> Result<(), Refusal> {
        self.owned_by(job, uid).map(|_| ())
    }

    /// The store-wide ids of states of one operator, registering the new
    /// ones (all or none), durable when it returns (earlier registrations
    /// not saved yet with them). The registry's lock is not held while
    /// the file is written: a shard registering an import's names never
    /// waits for it. A failed save is refused with the reason; the names
    /// stay registered in memory, saved by the next save that succeeds.
    pub fn register_durably(
        registry: &Mutex<Registry>,
        job: &str,
        op: &str,
        states: &[(&str, u8)],
    ) -> Result<Vec<u32>, Refusal> {
        let (ids, version, saver) = {
            let mut r = registry.lock().unwrap_or_else(|p| p.into_inner());
            let (ids, version) = r.register_all_later(job, op, states)?;
            (ids, version, r.view.saver.clone())
        };
        if saver.durable() < version {
            Registry::save_pending(registry);
        }
        if saver.durable() < version {
            let why = saver.failure().unwrap_or_default();
            return Err((
                status::INTERNAL,
                format!("cannot save the state registry: {why}"),
            ));
        }
        Ok(ids)
    }

    /// The ids of states of one operator, registering the new ones in
    /// memory (all or none) and publishing them; saved later, off the
    /// caller's thread (a shard's: see [`Saver`]). Also returns the
    /// version whose durability (`Saver::durable`) makes them safe to
    /// install state under.
    pub fn register_all_later(
        &mut self,
        job: &str,
        op: &str,
        states: &[(&str, u8)],
    ) -> Result<(Vec<u32>, u64), Refusal> {
        let before = self.entries.len();
        let ids = self.add_all(job, op, states)?;
        if self.entries.len() > before {
            self.publish();
        }
        if self.version > self.view.saver.durable() {
            self.view.saver.wake();
        }
        Ok((ids, self.version))
    }

    /// [`Registry::register_durably`] for a registry the caller owns.
    #[cfg(test)]
    fn register(&mut self, job: &str, op: &str, name: &str, k: u8) -> Result<u32, Refusal> {
        let (ids, _) = self.register_all_later(job, op, &[(name, k)])?;
        let bytes = encode_states(self.next_id, &self.entries);
        let saved = self.view.saver.write(&self.path, self.version, &bytes);
        saved.map_err(|e| {
            (
                status::INTERNAL,
                format!("cannot save the state registry: {e}"),
            )
        })?;
        Ok(ids[0])
    }

    /// Saves `states.json` if a registration made with
    /// [`Registry::register_all_later`] waits for it: the registry's lock
    /// is held only to copy the states, not for the file's writes.
    /// Whether it saved; a failure is logged and kept in the [`Saver`]
    /// (the next call tries again).
    pub fn save_pending(registry: &Mutex<Registry>) -> bool {
        // Copied under the lock, encoded after it.
        let (saver, path, version, next_id, entries) = {
            let r = registry.lock().unwrap_or_else(|p| p.into_inner());
            if r.version <= r.view.saver.durable() {
                return false;
            }
            let saver = r.view.saver.clone();
            (
                saver,
                r.path.clone(),
                r.version,
                r.next_id,
                r.entries.clone(),
            )
        };
        let bytes = encode_states(next_id, &entries);
        match saver.write(&path, version, &bytes) {
            Ok(()) => {
                // Drops this version holds are durable: their ids may go.
                let mut r = registry.lock().unwrap_or_else(|p| p.into_inner());
                let (mut durable, mut owners) = (false, false);
                r.dropping.retain(|_, &mut (v, owner)| {
                    let keep = v > version;
                    durable |= !keep;
                    owners |= !keep && owner.is_some();
                    keep
                });
                if durable {
                    r.dropped = Arc::new(DroppedStates::new(next_id, entries.iter().map(|e| e.id)));
                    r.publish();
                }
                // Owners `jobs.json` kept for these drops can go now (the
                // janitor's next save).
                if owners {
                    r.jobs_version += 1;
                }
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "cannot save the state registry; imports naming new states wait for it; retried");
                false
            }
        }
    }

    /// The ids of states of one operator, registering the new ones in
    /// memory (all or none, not published); a new one makes a new
    /// version.
    fn add_all(
        &mut self,
        job: &str,
        op: &str,
        states: &[(&str, u8)],
    ) -> Result<Vec<u32>, (i32, String)> {
        let before = self.entries.len();
        // (One pass over the registry per registration: registrations are
        // rare, at a session's start.)
        let mut of_job = self.entries.iter().filter(|e| e.job == job).count();
        let mut ids = Vec::with_capacity(states.len());
        let first = self.next_id;
        let undo = |r: &mut Registry| {
            for e in r.entries.drain(before..) {
                r.index.remove(&(e.job, e.operator, e.name));
            }
            r.next_id = first;
        };
        for &(name, k) in states {
            let key = (job.to_string(), op.to_string(), name.to_string());
            if let Some(&i) = self.index.get(&key) {
                let e = &self.entries[i];
                if e.kind != k {
                    let msg = conflict(name, op, e.kind, k);
                    undo(self);
                    return Err((status::CONFLICT, msg));
                }
                ids.push(e.id);
                continue;
            }
            if self.entries.len() >= MAX_REGISTERED {
                undo(self);
                return Err((
                    status::LIMIT,
                    format!("{MAX_REGISTERED} states are registered on this daemon"),
                ));
            }
            if of_job >= self.max_per_job {
                undo(self);
                return Err((
                    status::LIMIT,
                    format!(
                        "job `{job}` has {of_job} states registered (max_states_per_job {}); state names are kept across sessions, so a job that makes up new names each run runs out",
                        self.max_per_job
                    ),
                ));
            }
            of_job += 1;
            let Some(after) = self.next_id.checked_add(1) else {
                undo(self);
                return Err((status::LIMIT, "every state id has been handed out".into()));
            };
            let id = std::mem::replace(&mut self.next_id, after);
            self.entries.push(RegEntry {
                job: key.0.clone(),
                operator: key.1.clone(),
                name: key.2.clone(),
                kind: k,
                id,
            });
            self.index.insert(key, self.entries.len() - 1);
            ids.push(id);
        }
        if self.entries.len() > before {
            self.version += 1;
        }
        Ok(ids)
    }

    /// A session of `job` opens (see [`Registry::open_session`]): a job
    /// with a session is never dropped.
    fn enter(&mut self, job: &str) {
        self.use_of
            .entry(job.to_string())
            .or_insert(JobUse {
                sessions: 0,
                idle_since: Instant::now(),
            })
            .sessions += 1;
    }

    /// A session of `job` closed (or failed to open after
    /// [`Registry::enter`]).
    pub fn leave(&mut self, job: &str) {
        if let Some(u) = self.use_of.get_mut(job) {
            u.sessions = u.sessions.saturating_sub(1);
            if u.sessions == 0 {
                u.idle_since = Instant::now();
            }
        }
    }

    /// Drops every job that has had no session for `after` and has no
    /// retained checkpoint: its names (their ids are never handed out
    /// again, and compaction leaves their records out) and its owner, so
    /// that neither file grows with every job that ever ran (a Flink job
    /// is named by its job id unless told otherwise). Returns the jobs
    /// dropped.
    ///
    /// They go from memory under the registry's lock; the files are
    /// written after it, names (`states.json`) first, then owners
    /// (`jobs.json`). Their ids are published as dropped (for compaction)
    /// only once the names' save is durable, and the job is claimed again
    /// only then ([`Registry::open_session`]). A failed save is logged and
    /// retried by the next one (the registry thread's, every second); an
    /// owner left in the file keeps no state.
    pub fn drop_idle(
        registry: &Mutex<Registry>,
        after: Duration,
        retained: &Retained,
    ) -> Vec<String> {
        Registry::save_jobs_pending(registry);
        let (doomed, states, owners, saver) = {
            let mut r = registry.lock().unwrap_or_else(|p| p.into_inner());
            let doomed = r.idle_jobs(after, retained);
            if doomed.is_empty() {
                return Vec::new();
            }
            let owner_of: HashMap<String, u32> = doomed
                .iter()
                .filter_map(|j| r.jobs.get(j).map(|&uid| (j.clone(), uid)))
                .collect();
            let named = r.entries.len();
            r.entries.retain(|e| !doomed.contains(&e.job));
            let states = (r.entries.len() < named).then(|| {
                r.version += 1;
                r.index = index_of(&r.entries);
                r.publish();
                r.version
            });
            let owned = r.jobs.len();
            r.jobs.retain(|j, _| !doomed.contains(j));
            let owners = (r.jobs.len() < owned).then(|| {
                r.jobs_version += 1;
                r.jobs_version
            });
            for j in &doomed {
                r.use_of.remove(j);
                r.claimed.remove(j);
                if let Some(v) = states {
                    r.dropping.insert(j.clone(), (v, owner_of.get(j).copied()));
                }
            }
            (doomed, states, owners, r.view.saver.clone())
        };
        if let Some(v) = states
            && !Registry::save_pending(registry)
            && saver.durable() < v
        {
            tracing::warn!(
                "dropped jobs' names are not saved yet; their state is reclaimed once they are"
            );
        }
        if let Some(v) = owners
            && let Err(why) = Registry::save_jobs(registry, v)
        {
            tracing::warn!(error = %why, "cannot save the job owners after dropping idle jobs; retried");
        }
        doomed.into_iter().collect()
    }

    /// Saves `jobs.json` if a change waits for it (a save that failed, or
    /// owners a durable drop let go).
    fn save_jobs_pending(registry: &Mutex<Registry>) {
        let version = registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .jobs_version;
        if let Err(why) = Registry::save_jobs(registry, version) {
            tracing::warn!(error = %why, "cannot save the job owners; retried");
        }
    }

    /// The jobs [`Registry::drop_idle`] drops now (forgetting closed jobs
    /// with nothing to drop).
    fn idle_jobs(
        &mut self,
        after: Duration,
        retained: &Retained,
    ) -> std::collections::BTreeSet<String> {
        let now = Instant::now();
        // A closed job with neither names nor owner (root's) has nothing to
        // drop: forget it.
        let named: std::collections::HashSet<&str> =
            self.entries.iter().map(|e| e.job.as_str()).collect();
        let jobs = &self.jobs;
        self.use_of
            .retain(|j, u| u.sessions > 0 || jobs.contains_key(j) || named.contains(j.as_str()));
        let idle = |job: &str| -> bool {
            let since = match self.use_of.get(job) {
                Some(u) if u.sessions > 0 => return false,
                Some(u) => u.idle_since,
                None => self.opened,
            };
            now.saturating_duration_since(since) >= after
                && since < retained.as_of
                && !retained.jobs.contains(job)
        };
        self.entries
            .iter()
            .map(|e| e.job.as_str())
            .chain(self.jobs.keys().map(String::as_str))
            .filter(|&j| idle(j))
            .map(str::to_string)
            .collect()
    }

    /// Publishes the registry as it is now (the dropped ids as durable).
    fn publish(&self) {
        self.view
            .publish(&self.entries, self.version, &self.dropped);
    }
}

/// `states.json`'s bytes.
fn encode_states(next_id: u32, states: &[RegEntry]) -> Vec<u8> {
    serde_json::to_vec_pretty(&StatesOut { next_id, states }).expect("the states serialize")
}

/// Where each registration is in `entries`.
fn index_of(entries: &[RegEntry]) -> HashMap<(String, String, String), usize> {
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| ((e.job.clone(), e.operator.clone(), e.name.clone()), i))
        .collect()
}

/// Reads a JSON file; `None` when it does not exist.
fn load_json<T: serde::de::DeserializeOwned>(path: &Path) -> std::io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b).map(Some).map_err(|e| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {e}", path.display()),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces a file durably: a temporary file, fsync, rename, the
/// directory's fsync.
fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(d) = path.parent() {
        std::fs::File::open(d)?.sync_all()?;
    }
    Ok(())
}

fn kind_name(k: u8) -> &'static str {
    match k {
        kind::VALUE => "a value state",
        kind::LIST => "a list state",
        kind::MAP => "a map state",
        _ => "an unknown kind",
    }
}

pub(crate) fn state_kind(k: u8) -> Option<StateKind> {
    match k {
        kind::VALUE => Some(StateKind::Value),
        kind::LIST => Some(StateKind::List),
        kind::MAP => Some(StateKind::Map),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Issue 25: an import's new names were saved (file write, fsyncs,
    /// rename) under the registry's lock on the shard thread. Now the
    /// shard registers them in memory and the registry thread saves them:
    /// nothing is durable until then, a restart without the save forgets
    /// them, their version tells when they are durable, and a control-side
    /// registration saves every earlier one with its own.
    #[test]
    fn names_registered_for_later_are_durable_only_once_saved() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        let view = reg.lock().unwrap().view();
        let (ids, v) = reg
            .lock()
            .unwrap()
            .register_all_later("j", "op", &[("a", kind::VALUE), ("b", kind::MAP)])
            .unwrap();
        assert!(v > view.saver().durable(), "saved at once");
        assert_eq!(view.get().version(), v);
        assert_eq!(view.get().id_of("j", "op", "b", kind::MAP), Ok(ids[1]));
        // A restart before the save: forgotten, as after a crash.
        assert!(
            !Registry::open(d.path())
                .unwrap()
                .view()
                .get()
                .is_registered("j", "op", "a")
        );
        // Known names want nothing saved; the save makes the version durable.
        let (again, v2) = reg
            .lock()
            .unwrap()
            .register_all_later("j", "op", &[("a", kind::VALUE)])
            .unwrap();
        assert_eq!((again[0], v2), (ids[0], v));
        assert!(Registry::save_pending(&reg));
        assert!(!Registry::save_pending(&reg), "nothing left to save");
        assert_eq!(view.saver().durable(), v);
        assert!(
            Registry::open(d.path())
                .unwrap()
                .view()
                .get()
                .is_registered("j", "op", "b")
        );
        // A control-side registration saves the unsaved ones before it.
        reg.lock()
            .unwrap()
            .register_all_later("j", "op", &[("c", kind::LIST)])
            .unwrap();
        Registry::register_durably(&reg, "j", "op2", &[("d", kind::VALUE)]).unwrap();
        let reopened = Registry::open(d.path()).unwrap().view().get();
        assert!(reopened.is_registered("j", "op", "c") && reopened.is_registered("j", "op2", "d"));
        assert!(!Registry::save_pending(&reg));
    }

    /// A failed save is kept (and retried), never taken for durable.
    #[test]
    fn a_failed_save_is_reported_and_retried() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        let view = reg.lock().unwrap().view();
        let (_, v) = reg
            .lock()
            .unwrap()
            .register_all_later("j", "op", &[("a", kind::VALUE)])
            .unwrap();
        // The temporary file's name is a directory: the write fails.
        let tmp = d.path().join("states.json.tmp");
        std::fs::create_dir(&tmp).unwrap();
        assert!(!Registry::save_pending(&reg));
        assert!(view.saver().durable() < v);
        assert!(view.saver().failure().is_some());
        std::fs::remove_dir(&tmp).unwrap();
        assert!(Registry::save_pending(&reg));
        assert_eq!(view.saver().durable(), v);
        assert_eq!(view.saver().failure(), None);
    }

    /// Opens a session of `job` as `uid` (and counts it).
    fn open(reg: &Mutex<Registry>, job: &str, uid: u32) -> Result<(), Refusal> {
        Registry::open_session(reg, job, uid)
    }

    #[test]
    fn a_job_belongs_to_its_first_uid_and_unowned_state_is_not_up_for_grabs() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        // Root (these tests' uid, statord's own) opens anything, claims nothing.
        let root = nix::unistd::geteuid().as_raw();
        open(&reg, "a", root).unwrap();
        open(&reg, "a", 1000).unwrap();
        open(&reg, "a", 1000).unwrap();
        let (st, m) = open(&reg, "a", 1001).unwrap_err();
        assert_eq!(st, status::DENIED);
        assert!(m.contains("belongs to uid 1000"), "{m}");
        open(&reg, "a", root).unwrap();
        // A job with state and no owner (root imported it): nobody's to take.
        reg.lock()
            .unwrap()
            .register("imported", "op", "v", kind::VALUE)
            .unwrap();
        let (st, m) = open(&reg, "imported", 1000).unwrap_err();
        assert_eq!(st, status::DENIED);
        assert!(m.contains("no owning uid"), "{m}");
        // Durable, and an operator's assignment in jobs.json is honoured.
        drop(reg);
        let jobs = d.path().join("jobs.json");
        let mut owners: std::collections::BTreeMap<String, u32> =
            serde_json::from_slice(&std::fs::read(&jobs).unwrap()).unwrap();
        assert_eq!(owners.get("a"), Some(&1000));
        owners.insert("imported".into(), 1001);
        std::fs::write(&jobs, serde_json::to_vec(&owners).unwrap()).unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        assert_eq!(open(&reg, "a", 1001).unwrap_err().0, status::DENIED);
        open(&reg, "imported", 1001).unwrap();
        assert_eq!(open(&reg, "imported", 1000).unwrap_err().0, status::DENIED);
    }

    /// Issue 25: a claim wrote `jobs.json` under the registry's lock, which
    /// a shard registering an import's names takes. It is written after
    /// the lock now. A claim whose save fails refuses the session (not
    /// counted), stays in memory (another uid is still refused), refuses
    /// every session of the job until a save succeeds, and is saved by it.
    #[test]
    fn a_claim_not_saved_refuses_its_sessions_until_it_is() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        // The temporary file's name is a directory: the write fails.
        let tmp = d.path().join("jobs.json.tmp");
        std::fs::create_dir(&tmp).unwrap();
        let (st, m) = open(&reg, "a", 1000).unwrap_err();
        assert_eq!(st, status::INTERNAL);
        assert!(m.contains("cannot save the job owners"), "{m}");
        assert_eq!(open(&reg, "a", 1000).unwrap_err().0, status::INTERNAL);
        assert_eq!(open(&reg, "a", 1001).unwrap_err().0, status::DENIED);
        assert!(
            !reg.lock().unwrap().use_of.values().any(|u| u.sessions > 0),
            "a refused session is not counted"
        );
        std::fs::remove_dir(&tmp).unwrap();
        open(&reg, "a", 1000).unwrap();
        let jobs = std::fs::read_to_string(d.path().join("jobs.json")).unwrap();
        assert!(jobs.contains("\"a\": 1000"), "{jobs}");
        assert_eq!(reg.lock().unwrap().use_of["a"].sessions, 1);
    }

    /// Issue 25: a drop wrote both files under the registry's lock. Now
    /// the names go from memory at once, but their ids are published as
    /// dropped (compaction then leaves their records out) only once
    /// `states.json` without them is durable, and the job is claimed
    /// again only then: a crash before the save brings the names back
    /// with their records, never names without records, nor another uid's
    /// claim on a job whose names the file still holds.
    #[test]
    fn a_drop_takes_effect_for_compaction_and_claims_once_durable() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        open(&reg, "done", 1000).unwrap();
        let id = reg
            .lock()
            .unwrap()
            .register("done", "op", "v", kind::VALUE)
            .unwrap();
        reg.lock().unwrap().leave("done");
        let view = reg.lock().unwrap().view();
        let tmp = d.path().join("states.json.tmp");
        std::fs::create_dir(&tmp).unwrap();
        let retained = Retained {
            jobs: Default::default(),
            as_of: Instant::now() + Duration::from_secs(1),
        };
        assert_eq!(
            Registry::drop_idle(&reg, Duration::ZERO, &retained),
            ["done"]
        );
        assert!(!view.get().is_registered("done", "op", "v"));
        assert!(!view.get().dropped().contains(id), "not durable yet");
        let (st, m) = open(&reg, "done", 1001).unwrap_err();
        assert_eq!(st, status::INTERNAL);
        assert!(m.contains("was dropped"), "{m}");
        let states = std::fs::read_to_string(d.path().join("states.json")).unwrap();
        assert!(states.contains("\"done\""), "{states}");
        // Names first, then owners: the owner stays in the file while the
        // names do (a crash now finds both).
        let jobs = std::fs::read_to_string(d.path().join("jobs.json")).unwrap();
        assert!(jobs.contains("\"done\": 1000"), "{jobs}");
        std::fs::remove_dir(&tmp).unwrap();
        assert!(Registry::save_pending(&reg));
        assert!(view.get().dropped().contains(id));
        open(&reg, "done", 1001).unwrap();
        let states = std::fs::read_to_string(d.path().join("states.json")).unwrap();
        assert!(!states.contains("\"done\""), "{states}");
        let jobs = std::fs::read_to_string(d.path().join("jobs.json")).unwrap();
        assert!(jobs.contains("\"done\": 1001"), "{jobs}");
    }

    /// Shards read the registry's published view, never its lock: a
    /// registration holding the lock across its file writes and fsyncs
    /// (here: held) stalls no checkpoint or export. Each registration is
    /// published before it is answered, and a restart publishes the file.
    #[test]
    fn the_view_is_read_without_the_lock_and_follows_registrations() {
        let d = tempfile::tempdir().unwrap();
        let mut r = Registry::open(d.path()).unwrap();
        let view = r.view();
        let a = r.register("j", "op", "a", kind::VALUE).unwrap();
        let b = r.register("j", "op", "b", kind::MAP).unwrap();
        r.register("j", "other", "c", kind::LIST).unwrap();
        let reg = Mutex::new(r);
        let held = reg.lock().unwrap();
        let v = view.get();
        assert_eq!(v.operator_states("j", "op").0, vec![a, b]);
        let meta: Vec<RegEntry> = serde_json::from_slice(&v.operator_states("j", "op").1).unwrap();
        assert_eq!(
            meta.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(v.operator_descs("j", "op").len(), 2);
        assert!(v.is_registered("j", "other", "c") && !v.is_registered("j", "op", "c"));
        assert_eq!(v.id_of("j", "op", "b", kind::MAP), Ok(b));
        let m = v.id_of("j", "op", "b", kind::VALUE).unwrap_err();
        assert!(m.contains("registered as a map state"), "{m}");
        drop(held);
        // A version read earlier stays as it was; a restart publishes the file.
        let mut r = reg.into_inner().unwrap();
        r.register("j", "op", "d", kind::VALUE).unwrap();
        assert_eq!(v.operator_states("j", "op").0.len(), 2);
        assert_eq!(view.get().operator_states("j", "op").0.len(), 3);
        drop(r);
        let r = Registry::open(d.path()).unwrap();
        assert_eq!(r.view().get().operator_states("j", "op").0.len(), 3);
    }

    /// Issue 27 #5: a job with no session and no retained checkpoint for
    /// the idle time is dropped (names and owner, durably); one with a
    /// session, a checkpoint, or not yet seen by a report since it went
    /// idle is not; ids are never handed out again, across a restart too,
    /// and the published view says which are dropped.
    #[test]
    fn idle_jobs_without_checkpoints_are_dropped_and_their_ids_never_reused() {
        let d = tempfile::tempdir().unwrap();
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        let mut ids = Vec::new();
        for job in ["done", "open", "kept", "late"] {
            open(&reg, job, 1000).unwrap();
            ids.push(
                reg.lock()
                    .unwrap()
                    .register(job, "op", "v", kind::VALUE)
                    .unwrap(),
            );
        }
        for job in ["done", "kept", "late"] {
            reg.lock().unwrap().leave(job);
        }
        // Gone idle before the reports were made, but for "late".
        let reported = Instant::now();
        std::thread::sleep(Duration::from_millis(30));
        reg.lock().unwrap().leave("late");
        open(&reg, "late", 1000).unwrap();
        reg.lock().unwrap().leave("late");
        let retained = Retained {
            jobs: ["kept".to_string()].into(),
            as_of: reported,
        };
        // Not idle long enough: nothing.
        assert!(Registry::drop_idle(&reg, Duration::from_secs(3600), &retained).is_empty());
        let dropped = Registry::drop_idle(&reg, Duration::from_millis(10), &retained);
        assert_eq!(dropped, ["done"]);
        let view = reg.lock().unwrap().view().get();
        assert!(view.dropped().contains(ids[0]));
        assert!(ids[1..].iter().all(|&id| !view.dropped().contains(id)));
        assert!(!view.is_registered("done", "op", "v"));
        // Durably, owner included; a new registration gets a new id.
        drop(reg);
        let states = std::fs::read_to_string(d.path().join("states.json")).unwrap();
        assert!(!states.contains("\"done\""), "{states}");
        let jobs = std::fs::read_to_string(d.path().join("jobs.json")).unwrap();
        assert!(
            !jobs.contains("\"done\"") && jobs.contains("\"kept\""),
            "{jobs}"
        );
        let reg = Mutex::new(Registry::open(d.path()).unwrap());
        assert!(reg.lock().unwrap().view().get().dropped().contains(ids[0]));
        open(&reg, "done", 1001).unwrap();
        let again = reg
            .lock()
            .unwrap()
            .register("done", "op", "v", kind::VALUE)
            .unwrap();
        assert!(ids.iter().all(|&id| id < again), "{ids:?} then {again}");
        reg.lock().unwrap().leave("done");
        // After a restart every job without a session is idle since then.
        let now = Retained {
            jobs: Default::default(),
            as_of: Instant::now() + Duration::from_secs(1),
        };
        let mut dropped = Registry::drop_idle(&reg, Duration::ZERO, &now);
        dropped.sort();
        assert_eq!(dropped, ["done", "kept", "late", "open"]);
    }

    /// A `states.json` from before jobs could be dropped (a bare list)
    /// opens, with the next id past its largest.
    #[test]
    fn a_registry_file_from_before_drops_opens() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("states.json"),
            r#"[{"job":"j","operator":"op","name":"v","kind":1,"id":7}]"#,
        )
        .unwrap();
        let mut r = Registry::open(d.path()).unwrap();
        assert_eq!(r.register("j", "op", "v", kind::VALUE).unwrap(), 7);
        assert_eq!(r.register("j", "op", "w", kind::VALUE).unwrap(), 8);
        assert!(r.view().get().dropped().contains(3));
    }
}
