//! The control socket's requests (`daemon/CONTROL.md`): `Open`,
//! `Register`, `Restore` and `Close`, and the limits they are held to
//! (the state registry they consult is `registry.rs`). `connections.rs` serves the connections that carry
//! them. A connection holds at most one session; when it closes, for
//! whatever reason (a `Close`, the task's exit, a crash, `kill -9`), the
//! session is dropped at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use stator_ring::RingParams;
use stator_ring::control::{CONTROL_VERSION, MAX_PARALLELISM, Response, status};
use stator_ring::keygroup::key_group_range;
use stator_store::StoreError;

use crate::config::Config;
use crate::registry::{Refusal, state_kind};
pub use crate::registry::{Registry, RegistryView};
use crate::shard::{ShardHandle, ShardMsg};

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
    /// Jobs dropped since the start (`drop_idle_jobs_after_secs`).
    pub jobs_dropped: AtomicU64,
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

    /// A session of `job` is gone (see [`Registry::open_session`]).
    fn leave(&self, job: &str) {
        self.registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .leave(job);
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
    if let Err(r) = Registry::open_session(&ctx.registry, job, uid) {
        ctx.sessions.fetch_sub(1, Ordering::AcqRel);
        ctx.give_uid_slot(uid);
        return Err(r);
    }
    let (lo, hi) =
        key_groups.unwrap_or_else(|| key_group_range(max_parallelism, parallelism, subtask));
    let shard = shard_of(ctx, &owner_key(job, operator));
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
            ctx.leave(job);
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
    let store_id = Registry::register_durably(&ctx.registry, &o.job, &o.operator, &[(name, k)])?[0];
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

/// An operator's key in the store, `job\0operator` (checkpoints are
/// owned by it).
fn owner_key(job: &str, operator: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(job.len() + operator.len() + 1);
    b.extend_from_slice(job.as_bytes());
    b.push(0);
    b.extend_from_slice(operator.as_bytes());
    b
}

/// The shard of an operator: its state lives on one, a fixed function of
/// its names (xxh3 of its key, stable across releases), so a reopened or
/// rescaled subtask finds its key groups there. Changing `shards` moves
/// operators; state then comes back through checkpoints.
fn shard_of(ctx: &Ctx, owner: &[u8]) -> usize {
    (xxhash_rust::xxh3::xxh3_64(owner) % ctx.shards.len() as u64) as usize
}

/// Deletes the checkpoints of `job`'s `operator` that the handles name
/// and the daemon retains (a `Release`: the engine discarded them). No
/// session, no claim: `uid` must own the job (or be privileged).
pub(crate) fn release(
    ctx: &Ctx,
    uid: u32,
    job: &str,
    operator: &str,
    handles: Vec<Vec<u8>>,
) -> Result<Response, Refusal> {
    if job.is_empty() || operator.is_empty() || job.contains('\0') || operator.contains('\0') {
        return Err((
            status::BAD_REQUEST,
            "job and operator must be non-empty and contain no NUL".into(),
        ));
    }
    ctx.registry
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .may_release(job, uid)?;
    let owner = owner_key(job, operator);
    let (tx, rx) = crossbeam_channel::bounded(1);
    ctx.shards[shard_of(ctx, &owner)].send(ShardMsg::Release {
        owner,
        handles,
        reply: tx,
    });
    match rx.recv() {
        Ok(Ok(released)) => {
            tracing::debug!(job, operator, released, "checkpoints released");
            Ok(Response::Released { released })
        }
        Ok(Err(e @ StoreError::Invalid(_))) => Err((status::BAD_REQUEST, e.to_string())),
        Ok(Err(e)) => Err((status::INTERNAL, format!("release failed: {e}"))),
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
    ctx.leave(&o.job);
    ctx.sessions.fetch_sub(1, Ordering::AcqRel);
    ctx.give_uid_slot(o.uid);
    tracing::info!(session = o.id, "session closed");
}
