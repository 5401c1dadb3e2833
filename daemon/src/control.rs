//! The control socket's requests (`daemon/CONTROL.md`): `Open`,
//! `Register`, `Restore` and `Close`, the state registry and the limits
//! they are held to. `connections.rs` serves the connections that carry
//! them. A connection holds at most one session; when it closes, for
//! whatever reason (a `Close`, the task's exit, a crash, `kill -9`), the
//! session is dropped at once.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use stator_ring::RingParams;
use stator_ring::control::{CONTROL_VERSION, MAX_PARALLELISM, Response, kind, status};
use stator_ring::keygroup::key_group_range;
use stator_store::StateKind;
use stator_store::StoreError;

use crate::config::Config;
use crate::shard::{ShardHandle, ShardMsg};

/// States the registry holds at most (each new one rewrites the file).
const MAX_REGISTERED: usize = 1 << 16;

/// State names of every job, and their store-wide ids. Persisted, so that
/// a restarted daemon gives the same (job, operator, name) the same id.
/// Also which uid each job belongs to (`jobs.json`): the first uid that
/// opened a session of it, so that one tenant cannot open another's job by
/// its name and reach its state or checkpoints.
pub struct Registry {
    path: PathBuf,
    entries: Vec<RegEntry>,
    index: HashMap<(String, String, String), usize>,
    jobs_path: PathBuf,
    jobs: std::collections::BTreeMap<String, u32>,
    /// States one job may have registered (`max_states_per_job`).
    max_per_job: usize,
    /// What shards read, published after each change.
    view: RegistryView,
}

/// The registry as shards read it: an immutable copy, replaced whole after
/// each change, so that a shard never waits on a registration's file
/// writes and fsyncs (they run under the registry's mutex, which a shard
/// takes only for an import that brings state names new to its operator).
#[derive(Clone, Default)]
pub struct RegistryView(Arc<RwLock<Arc<RegView>>>);

impl RegistryView {
    /// The registry as of now.
    pub fn get(&self) -> Arc<RegView> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn publish(&self, entries: &[RegEntry]) {
        let mut v = RegView::default();
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
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(v);
    }
}

/// One version of the registry: each operator's states, in registration
/// order.
#[derive(Default)]
pub struct RegView {
    by_operator: HashMap<String, HashMap<String, OperatorStates>>,
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
        let entries: Vec<RegEntry> = load_json(&path)?.unwrap_or_default();
        let jobs_path = data_dir.join("jobs.json");
        let jobs = load_json(&jobs_path)?.unwrap_or_default();
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| ((e.job.clone(), e.operator.clone(), e.name.clone()), i))
            .collect();
        let view = RegistryView::default();
        view.publish(&entries);
        Ok(Registry {
            path,
            entries,
            index,
            jobs_path,
            jobs,
            max_per_job: crate::config::DEFAULT_MAX_STATES_PER_JOB,
            view,
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

    /// Lets `uid` open a session of `job`: a job belongs to the first uid
    /// that opens it (durably); another uid is refused. A job that already
    /// has state but no owner (imported by root, or from before owners were
    /// kept) is refused too: the first comer must not take another's state;
    /// the operator names its uid in `jobs.json`. Root and statord's own
    /// uid may open any job and claim none (statorctl's exports and
    /// imports). A claim stays even if the open then fails (a limit): the
    /// uid asked for the job, and undoing it could race another of its
    /// subtasks opening at the same moment.
    pub fn claim(&mut self, job: &str, uid: u32) -> Result<(), Refusal> {
        if uid == 0 || uid == nix::unistd::geteuid().as_raw() {
            return Ok(());
        }
        match self.jobs.get(job) {
            Some(&owner) if owner == uid => Ok(()),
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
            None if self.jobs.len() >= MAX_REGISTERED => Err((
                status::LIMIT,
                format!("{MAX_REGISTERED} jobs are claimed on this daemon"),
            )),
            None => {
                self.jobs.insert(job.to_string(), uid);
                if let Err(e) = save_json(&self.jobs_path, &self.jobs) {
                    self.jobs.remove(job);
                    return Err((status::INTERNAL, format!("cannot save the job owners: {e}")));
                }
                tracing::info!(job, uid, "job claimed by its first uid");
                Ok(())
            }
        }
    }

    /// The store-wide id of a state, registering it (durably) if new.
    fn register(&mut self, job: &str, op: &str, name: &str, k: u8) -> Result<u32, (i32, String)> {
        self.register_all(job, op, &[(name, k)]).map(|ids| ids[0])
    }

    /// The store-wide ids of states of one operator, registering the new
    /// ones with one durable save (all or none).
    pub fn register_all(
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
        let mut next = self.next_id();
        let undo = |r: &mut Registry| {
            for e in r.entries.drain(before..) {
                r.index.remove(&(e.job, e.operator, e.name));
            }
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
            let id = next;
            next += 1;
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
            if let Err(e) = self.save() {
                undo(self);
                return Err((
                    status::INTERNAL,
                    format!("cannot save the state registry: {e}"),
                ));
            }
            self.view.publish(&self.entries);
        }
        Ok(ids)
    }

    fn next_id(&self) -> u32 {
        self.entries.iter().map(|e| e.id + 1).max().unwrap_or(1)
    }

    fn save(&self) -> std::io::Result<()> {
        save_json(&self.path, &self.entries)
    }
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

/// Replaces a JSON file durably (a temporary file, fsync, rename, the
/// directory's fsync).
fn save_json<T: Serialize>(path: &Path, v: &T) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(v)?)?;
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

fn state_kind(k: u8) -> Option<StateKind> {
    match k {
        kind::VALUE => Some(StateKind::Value),
        kind::LIST => Some(StateKind::List),
        kind::MAP => Some(StateKind::Map),
        _ => None,
    }
}

/// What every connection thread shares.
pub struct Ctx {
    /// The configuration: replaced whole by a reload (SIGHUP), so a request
    /// reads one consistent version (`Ctx::cfg`).
    pub cfg: RwLock<Arc<Config>>,
    pub shards: Vec<ShardHandle>,
    pub registry: Arc<Mutex<Registry>>,
    pub registry_view: RegistryView,
    pub stopping: AtomicBool,
    pub sessions: AtomicUsize,
    pub next_session: AtomicU64,
    /// Open control connections (capped at `max_sessions` + 64).
    pub connections: AtomicUsize,
    /// Open sessions per peer uid (for `max_sessions_per_uid`).
    pub per_uid: Mutex<HashMap<u32, usize>>,
    /// Open control connections per peer uid (capped at
    /// `max_sessions_per_uid` + 8 when that is set).
    pub conns_per_uid: Mutex<HashMap<u32, usize>>,
}

impl Ctx {
    /// The configuration in force now.
    pub fn cfg(&self) -> Arc<Config> {
        self.cfg.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Counts a session of `uid` against `max_sessions_per_uid` (0: none).
    fn take_uid_slot(&self, uid: u32, limit: usize) -> Result<(), Refusal> {
        take(&self.per_uid, uid, limit).map_err(|n| {
            (
                status::LIMIT,
                format!("uid {uid} has {n} sessions open (max_sessions_per_uid {limit})"),
            )
        })
    }

    /// Gives back a slot [`Ctx::take_uid_slot`] took.
    fn give_uid_slot(&self, uid: u32) {
        give(&self.per_uid, uid);
    }
}

/// Counts one more for `uid` in `m` unless `limit` (0: none) is reached;
/// else the count.
pub(crate) fn take(m: &Mutex<HashMap<u32, usize>>, uid: u32, limit: usize) -> Result<(), usize> {
    let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
    let n = m.entry(uid).or_insert(0);
    if limit > 0 && *n >= limit {
        return Err(*n);
    }
    *n += 1;
    Ok(())
}

/// Gives back one [`take`] counted.
pub(crate) fn give(m: &Mutex<HashMap<u32, usize>>, uid: u32) {
    let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(n) = m.get_mut(&uid) {
        *n -= 1;
        if *n == 0 {
            m.remove(&uid);
        }
    }
}

/// A session a connection opened.
pub(crate) struct Open {
    pub(crate) id: u64,
    shard: usize,
    /// The peer's uid (its session counts against `max_sessions_per_uid`).
    uid: u32,
    job: String,
    operator: String,
    /// Names this session registered (bounds what it can add to the
    /// registry to `session.max_states`).
    names: std::collections::HashSet<String>,
}

pub(crate) type Refusal = (i32, String);

pub(crate) fn open(
    ctx: &Ctx,
    uid: u32,
    version: u16,
    job: &str,
    operator: &str,
    (subtask, parallelism, max_parallelism, key_groups): (u32, u32, u32, Option<(u16, u16)>),
    (sq, cq, arena, chunk_slots): (u32, u32, u64, u32),
) -> Result<(Open, Response, crate::shard::SessionFds), Refusal> {
    let bad = |m: String| Err((status::BAD_REQUEST, m));
    if version != CONTROL_VERSION {
        return Err((
            status::VERSION,
            format!(
                "control protocol version {version} is not supported (this daemon speaks {CONTROL_VERSION})"
            ),
        ));
    }
    if ctx.stopping.load(Ordering::Acquire) {
        return Err((status::SHUTTING_DOWN, "the daemon is shutting down".into()));
    }
    if job.is_empty() || operator.is_empty() {
        return bad("job and operator ids must not be empty".into());
    }
    if job.contains('\0') || operator.contains('\0') {
        // `job \0 operator` names whose checkpoints these are.
        return bad("job and operator ids must not contain NUL".into());
    }
    if max_parallelism == 0 || max_parallelism > MAX_PARALLELISM {
        return bad(format!(
            "max parallelism {max_parallelism} is not in 1..={MAX_PARALLELISM}"
        ));
    }
    if parallelism == 0 || parallelism > max_parallelism || subtask >= parallelism {
        return bad(format!(
            "subtask {subtask} of parallelism {parallelism} (max parallelism {max_parallelism}) is not a valid subtask"
        ));
    }
    if let Some((lo, hi)) = key_groups
        && (lo > hi || u32::from(hi) >= max_parallelism)
    {
        return bad(format!(
            "key groups {lo}..={hi} are not a range within 0..{max_parallelism} (max parallelism)"
        ));
    }
    let cfg = ctx.cfg();
    let lim = &cfg.session;
    let pick = |v: u32, d: u32, what: &str| -> Result<u32, Refusal> {
        let v = if v == 0 { d } else { v };
        if !v.is_power_of_two() || !(64..=lim.max_entries).contains(&v) {
            return Err((
                status::LIMIT,
                format!(
                    "{what} {v} is not a power of two in 64..={} (session.max_entries)",
                    lim.max_entries
                ),
            ));
        }
        Ok(v)
    };
    let sq_entries = pick(sq, lim.sq_entries, "sq_entries")?;
    let cq_entries = pick(cq, lim.cq_entries, "cq_entries")?;
    let arena_len = if arena == 0 {
        lim.arena_mib << 20
    } else {
        arena
    };
    if arena_len > lim.max_arena_mib << 20 {
        return Err((
            status::LIMIT,
            format!(
                "arena of {arena_len} bytes exceeds session.max_arena_mib ({} MiB)",
                lim.max_arena_mib
            ),
        ));
    }
    let chunk_slots = if chunk_slots == 0 {
        lim.chunk_slots
    } else {
        chunk_slots
    };
    if chunk_slots > lim.max_chunk_slots {
        return Err((
            status::LIMIT,
            format!(
                "{chunk_slots} chunk slots exceed session.max_chunk_slots ({})",
                lim.max_chunk_slots
            ),
        ));
    }
    // The limits first: a refused Open claims no job name.
    ctx.take_uid_slot(uid, cfg.max_sessions_per_uid)?;
    if ctx.sessions.fetch_add(1, Ordering::AcqRel) >= cfg.max_sessions {
        ctx.sessions.fetch_sub(1, Ordering::AcqRel);
        ctx.give_uid_slot(uid);
        return Err((
            status::LIMIT,
            format!("{} sessions are open (max_sessions)", cfg.max_sessions),
        ));
    }
    if let Err(r) = ctx
        .registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .claim(job, uid)
    {
        ctx.sessions.fetch_sub(1, Ordering::AcqRel);
        ctx.give_uid_slot(uid);
        return Err(r);
    }
    let (lo, hi) =
        key_groups.unwrap_or_else(|| key_group_range(max_parallelism, parallelism, subtask));
    // An operator's state lives on one shard, a fixed function of its
    // names (xxh3, stable across releases), so a reopened or rescaled
    // subtask finds its key groups there. Changing `shards` moves
    // operators; state then comes back through checkpoints.
    let shard = {
        let mut b = Vec::with_capacity(job.len() + operator.len() + 1);
        b.extend_from_slice(job.as_bytes());
        b.push(0);
        b.extend_from_slice(operator.as_bytes());
        (xxhash_rust::xxh3::xxh3_64(&b) % ctx.shards.len() as u64) as usize
    };
    let id = ctx.next_session.fetch_add(1, Ordering::Relaxed);
    let params = RingParams {
        sq_entries,
        cq_entries,
        buf_entries: cq_entries,
        arena_len,
        chunk_len: chunk_slots as u64 * stator_store::snapshot::CHUNK_LEN as u64,
    };
    let (tx, rx) = crossbeam_channel::bounded(1);
    let sent = ctx.shards[shard].send(ShardMsg::Open {
        session: id,
        owner: (job.to_string(), operator.to_string()),
        subtask: (subtask, parallelism, max_parallelism),
        params,
        key_groups: (lo, hi),
        max_in_flight: lim.max_in_flight,
        reply: tx,
    });
    let r = if sent { rx.recv().ok() } else { None };
    match r {
        Some(Ok(fds)) => {
            tracing::info!(session = id, job, operator, subtask, key_groups = ?(lo, hi), shard, "session opened");
            Ok((
                Open {
                    id,
                    shard,
                    uid,
                    job: job.to_string(),
                    operator: operator.to_string(),
                    names: Default::default(),
                },
                Response::Opened {
                    session: id,
                    key_group_lo: lo,
                    key_group_hi: hi,
                    shard: shard as u32,
                },
                fds,
            ))
        }
        other => {
            ctx.sessions.fetch_sub(1, Ordering::AcqRel);
            ctx.give_uid_slot(uid);
            let m = match other {
                Some(Err(m)) => m,
                _ => "the shard is not running".into(),
            };
            Err((status::INTERNAL, format!("cannot create the session: {m}")))
        }
    }
}

pub(crate) fn register(ctx: &Ctx, o: &mut Open, k: u8, name: &str) -> Result<u32, Refusal> {
    let kind = state_kind(k).ok_or((status::BAD_REQUEST, format!("unknown state kind {k}")))?;
    if name.is_empty() {
        return Err((status::BAD_REQUEST, "state name must not be empty".into()));
    }
    let max_states = ctx.cfg().session.max_states;
    if !o.names.contains(name) && o.names.len() as u32 >= max_states {
        return Err((
            status::LIMIT,
            format!("the session already has {max_states} states (session.max_states)"),
        ));
    }
    let store_id = ctx
        .registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .register(&o.job, &o.operator, name, k)?;
    o.names.insert(name.to_string());
    let (tx, rx) = crossbeam_channel::bounded(1);
    ctx.shards[o.shard].send(ShardMsg::AddState {
        session: o.id,
        kind,
        store_id,
        max_states,
        reply: tx,
    });
    match rx.recv() {
        Ok(Ok(id)) => Ok(id),
        Ok(Err(m)) => Err((status::LIMIT, m)),
        Err(_) => Err((status::INTERNAL, "the shard is not running".into())),
    }
}

/// Replaces the session's state by what checkpoints hold of its range.
pub(crate) fn restore(ctx: &Ctx, o: &Open, handles: Vec<Vec<u8>>) -> Result<Response, Refusal> {
    if handles.is_empty() {
        return Err((
            status::BAD_REQUEST,
            "a restore needs at least one handle".into(),
        ));
    }
    let (states, _) = ctx.registry_view.get().operator_states(&o.job, &o.operator);
    let (tx, rx) = crossbeam_channel::bounded(1);
    ctx.shards[o.shard].send(ShardMsg::Restore {
        session: o.id,
        states,
        handles,
        reply: tx,
    });
    match rx.recv() {
        Ok(Ok(r)) => {
            tracing::info!(session = o.id, checkpoints = ?r.manifests.iter().map(|m| m.checkpoint_id).collect::<Vec<_>>(), layers = r.layers, "session restored");
            Ok(Response::Restored {
                checkpoints: r.manifests.len() as u32,
                layers: r.layers as u32,
            })
        }
        Ok(Err(e @ StoreError::Restore(_))) => Err((status::RESTORE_REFUSED, e.to_string())),
        Ok(Err(e @ StoreError::Remote(_))) => Err((status::REMOTE, e.to_string())),
        Ok(Err(e)) => Err((status::INTERNAL, format!("restore failed: {e}"))),
        Err(_) => Err((status::INTERNAL, "the shard is not running".into())),
    }
}

pub(crate) fn close(ctx: &Ctx, o: &Open) {
    let (tx, rx) = crossbeam_channel::bounded(1);
    if ctx.shards[o.shard].send(ShardMsg::Close {
        session: o.id,
        reply: tx,
    }) {
        let _ = rx.recv_timeout(Duration::from_secs(5));
    }
    ctx.sessions.fetch_sub(1, Ordering::AcqRel);
    ctx.give_uid_slot(o.uid);
    tracing::info!(session = o.id, "session closed");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_belongs_to_its_first_uid_and_unowned_state_is_not_up_for_grabs() {
        let d = tempfile::tempdir().unwrap();
        let mut r = Registry::open(d.path()).unwrap();
        // Root (these tests' uid, statord's own) opens anything, claims nothing.
        let root = nix::unistd::geteuid().as_raw();
        r.claim("a", root).unwrap();
        r.claim("a", 1000).unwrap();
        r.claim("a", 1000).unwrap();
        let (st, m) = r.claim("a", 1001).unwrap_err();
        assert_eq!(st, status::DENIED);
        assert!(m.contains("belongs to uid 1000"), "{m}");
        r.claim("a", root).unwrap();
        // A job with state and no owner (root imported it): nobody's to take.
        r.register("imported", "op", "v", kind::VALUE).unwrap();
        let (st, m) = r.claim("imported", 1000).unwrap_err();
        assert_eq!(st, status::DENIED);
        assert!(m.contains("no owning uid"), "{m}");
        // Durable, and an operator's assignment in jobs.json is honoured.
        drop(r);
        let jobs = d.path().join("jobs.json");
        let mut owners: std::collections::BTreeMap<String, u32> =
            serde_json::from_slice(&std::fs::read(&jobs).unwrap()).unwrap();
        assert_eq!(owners.get("a"), Some(&1000));
        owners.insert("imported".into(), 1001);
        std::fs::write(&jobs, serde_json::to_vec(&owners).unwrap()).unwrap();
        let mut r = Registry::open(d.path()).unwrap();
        assert_eq!(r.claim("a", 1001).unwrap_err().0, status::DENIED);
        r.claim("imported", 1001).unwrap();
        assert_eq!(r.claim("imported", 1000).unwrap_err().0, status::DENIED);
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
        let b = r.register_all("j", "op", &[("b", kind::MAP)]).unwrap()[0];
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
}
