//! `statord`: the per-host Stator daemon.
//!
//! - [`config`]: the embedded default, the TOML file and flags, checked
//!   once with errors that name the key;
//! - [`control`]: the control socket (`daemon/CONTROL.md`): sessions are
//!   opened, states registered and sessions closed there, and a connection
//!   that closes drops its session;
//! - [`shard`]: the shard threads, each with its own io_uring and store,
//!   serving the sessions pinned to it through shared memory;
//! - [`notify`]: systemd's notification protocol (`READY=1`, `STATUS=`,
//!   `WATCHDOG=1` while every shard loop moves, `STOPPING=1`);
//! - [`metrics`]: what shards publish (per-operation counters and latency
//!   histograms, a report of sessions, store and checkpoints);
//! - [`status`]: the status socket, HTTP/1.1 on `<run_dir>/status.sock`
//!   (`/status` JSON, `/metrics` Prometheus text, `/healthz`), which
//!   `statorctl` and `curl --unix-socket` read.
//!
//! [`Daemon::start`] brings it all up; [`Daemon::stop`] drains it. The
//! binary adds flags, logging and signals around them.

/// jemalloc's options for a process that runs the daemon (its binaries
/// export them as `_rjem_malloc_conf`, read when jemalloc starts): pages
/// freed go back to the OS within a second, purged by one jemalloc thread.
/// By default jemalloc keeps them 10 s and purges inline, in whichever
/// thread frees: resident memory, which the budget bounds, ran tens of MiB
/// past what the daemon held (the hostile soak's peak: 128-193 MiB in 8
/// runs, 108-170 MiB in 7 with these), and a shard freeing a large extent
/// spent milliseconds in `madvise`.
pub const JEMALLOC_CONF: &[u8; 85] =
    b"background_thread:true,max_background_threads:1,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

pub mod config;
pub mod connections;
pub mod control;
pub mod metrics;
pub mod notify;
pub mod registry;
pub mod shard;
pub mod status;
pub mod status_schema;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use stator_ring::Doorbell;
use stator_store::Store;
use stator_store::io::UringIo;
use stator_store::remote::{Remote, RemoteRuntime};

use crate::config::Config;
use crate::control::{Ctx, Registry};
use crate::shard::{Live, Shard, ShardHandle, ShardMsg, ShardStats};
use crate::status::StatusServer;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{what} {path}: {err}")]
    Path {
        what: &'static str,
        path: String,
        err: std::io::Error,
    },
    #[error("another statord is serving {0}")]
    InUse(String),
    #[error("shard {shard}: {msg}")]
    Shard { shard: usize, msg: String },
    #[error("the remote tier: {0}")]
    Remote(String),
}

/// A running daemon.
pub struct Daemon {
    ctx: Arc<Ctx>,
    acceptor: Option<JoinHandle<Vec<std::os::unix::net::UnixStream>>>,
    shards: Vec<JoinHandle<ShardStats>>,
    status: Option<StatusServer>,
    /// Where the remote tier's requests run (dropped after the shards).
    remote_rt: Option<RemoteRuntime>,
    /// Drops idle jobs; stops when its sender is dropped.
    janitor: Option<(crossbeam_channel::Sender<()>, JoinHandle<()>)>,
    /// Saves the registrations shards make (see `registry::Saver`);
    /// stops when told, after the shards.
    saver: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

fn path_err(what: &'static str, p: &std::path::Path) -> impl FnOnce(std::io::Error) -> StartError {
    let path = p.display().to_string();
    move |err| StartError::Path { what, path, err }
}

impl Daemon {
    /// Opens every shard's store, binds the control socket and starts
    /// serving. `cfg` must come from [`Config::resolve`].
    pub fn start(cfg: Config) -> Result<Daemon, StartError> {
        let started = Instant::now();
        std::fs::create_dir_all(&cfg.data_dir)
            .map_err(path_err("cannot create data_dir", &cfg.data_dir))?;
        std::fs::create_dir_all(&cfg.run_dir)
            .map_err(path_err("cannot create run_dir", &cfg.run_dir))?;
        let sock = cfg.socket_path();
        if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
            return Err(StartError::InUse(sock.display().to_string()));
        }
        // A socket file nobody answers on is a leftover of a crash.
        let _ = std::fs::remove_file(&sock);
        let mut registry = Registry::open(&cfg.data_dir)
            .map_err(path_err("cannot read the state registry in", &cfg.data_dir))?;
        registry.set_max_states_per_job(cfg.max_states_per_job);
        let registry_view = registry.view();
        let registry = Arc::new(Mutex::new(registry));

        // The remote tier: one runtime and one object store client shared
        // by every shard's `Remote`.
        let remote_rt = match cfg.remote_config(0) {
            None => None,
            Some(rc) => {
                let rt = RemoteRuntime::new(cfg.remote.threads)
                    .map_err(|e| StartError::Remote(format!("cannot start its runtime: {e}")))?;
                let os = stator_store::remote::object_store(&rc)
                    .map_err(|e| StartError::Remote(e.to_string()))?;
                Some((rt, os))
            }
        };
        let mut handles = Vec::new();
        let mut shards = Vec::new();
        let depth = disk_depth(&cfg.data_dir, cfg.shards);
        tracing::info!(
            per_shard = depth,
            "disk ops each shard keeps in the kernel at most"
        );
        for i in 0..cfg.shards {
            let store_cfg = cfg.store_config(i);
            let remote = match (&remote_rt, cfg.remote_config(i)) {
                (Some((rt, os)), Some(rc)) => Some(
                    Remote::new(os.clone(), rc, rt.handle())
                        .map_err(|e| StartError::Remote(format!("eventfd: {e}")))?,
                ),
                _ => None,
            };
            let tier_cfg = cfg.tier_config();
            let dir = store_cfg.dir.clone();
            let (tx, rx) = crossbeam_channel::unbounded();
            let bell = Arc::new(Doorbell::new().map_err(|e| StartError::Shard {
                shard: i,
                msg: format!("eventfd: {e}"),
            })?);
            let (spin, batch) = (Duration::from_micros(cfg.spin_us), cfg.session.batch);
            let b = bell.clone();
            let reg = registry.clone();
            let (ready_tx, ready_rx) = crossbeam_channel::bounded(1);
            let live = Arc::new(Live::default());
            let l = live.clone();
            // The store is the shard thread's own (it is not Send): it is
            // opened there, and the outcome reported back.
            let j = std::thread::Builder::new()
                .name(format!("statord-shard-{i}"))
                .spawn(move || {
                    // Room for a doorbell poll per session plus disk reads.
                    let opened = UringIo::new(4096, true)
                        .map(|io| io.with_disk_depth(depth))
                        .map_err(|e| format!("cannot create an io_uring: {e}"))
                        .and_then(|io| {
                            match remote {
                                Some(r) => Store::open_tiered(store_cfg, io, r, tier_cfg),
                                None => Store::open(store_cfg, io),
                            }
                            .map_err(|e| e.to_string())
                        });
                    match opened {
                        Ok((store, report)) => {
                            if !report.torn.is_empty() {
                                tracing::warn!(shard = i, torn = ?report.torn, "torn files a checkpoint names, or corrupt ones, were set aside");
                            }
                            if !report.torn_removed.is_empty() {
                                tracing::warn!(shard = i, torn = ?report.torn_removed, "torn segment files nothing named were deleted");
                            }
                            if !report.left.is_empty() {
                                tracing::warn!(shard = i, left = ?report.left, "files recovery could not delete or set aside were left where they are");
                            }
                            tracing::info!(shard = i, dir = %dir.display(), segments = report.segments, "store opened");
                            let _ = ready_tx.send(Ok(()));
                            Shard::new(i, store, rx, b, (spin, batch), reg)
                                .with_live(l)
                                .run()
                        }
                        Err(m) => {
                            let _ = ready_tx.send(Err(m));
                            ShardStats::default()
                        }
                    }
                })
                .map_err(|e| StartError::Shard {
                    shard: i,
                    msg: format!("cannot start the thread: {e}"),
                })?;
            match ready_rx.recv() {
                Ok(Ok(())) => {}
                Ok(Err(msg)) => return Err(StartError::Shard { shard: i, msg }),
                Err(_) => {
                    return Err(StartError::Shard {
                        shard: i,
                        msg: "the shard thread died while opening its store".into(),
                    });
                }
            }
            shards.push(j);
            handles.push(ShardHandle { tx, bell, live });
        }

        let listener =
            UnixListener::bind(&sock).map_err(path_err("cannot bind the control socket", &sock))?;
        // Any local user may connect; SO_PEERCRED decides who may open.
        let _ = std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777));
        let status_path = cfg.status_path();
        let ctx = Arc::new(Ctx {
            cfg: RwLock::new(Arc::new(cfg)),
            shards: handles,
            registry,
            registry_view,
            stopping: AtomicBool::new(false),
            sessions: AtomicUsize::new(0),
            jobs_dropped: AtomicU64::new(0),
            next_session: AtomicU64::new(1),
            connections: AtomicUsize::new(0),
            per_uid: Default::default(),
            conns_per_uid: Default::default(),
        });
        // Before anything serves: a failure stops only the shards. (It
        // stops when its sender, dropped on any early return, is.)
        let (stop_janitor, stopped) = crossbeam_channel::bounded(0);
        let c = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("statord-janitor".into())
            .spawn(move || janitor(&c, &stopped));
        let begun = match spawned {
            Err(e) => Err(StartError::Shard {
                shard: usize::MAX,
                msg: format!("cannot start the janitor: {e}"),
            }),
            Ok(j) => start_saver(ctx.clone())
                .map_err(|e| StartError::Shard {
                    shard: usize::MAX,
                    msg: format!("cannot start the registry's saver: {e}"),
                })
                .and_then(|saver| {
                    StatusServer::start(ctx.clone(), started)
                        .map(|s| (j, saver, s))
                        .map_err(path_err("cannot serve the status socket", &status_path))
                }),
        };
        let (janitor, saver, status) = match begun {
            Ok(b) => b,
            Err(e) => {
                // Nothing serves yet: undo what was started.
                drop(listener);
                let _ = std::fs::remove_file(&sock);
                for h in &ctx.shards {
                    h.send(ShardMsg::Shutdown);
                }
                for j in shards {
                    let _ = j.join();
                }
                return Err(e);
            }
        };
        let c = ctx.clone();
        let acceptor = std::thread::Builder::new()
            .name("statord-control".into())
            .spawn(move || connections::serve(listener, c))
            .map_err(|e| StartError::Shard {
                shard: usize::MAX,
                msg: format!("cannot start the acceptor: {e}"),
            })?;
        tracing::info!(socket = %sock.display(), status = %status_path.display(), shards = ctx.shards.len(), "statord is serving");
        Ok(Daemon {
            ctx,
            acceptor: Some(acceptor),
            shards,
            status: Some(status),
            remote_rt: remote_rt.map(|(rt, _)| rt),
            janitor: Some((stop_janitor, janitor)),
            saver: Some(saver),
        })
    }

    /// The configuration it runs with now.
    pub fn config(&self) -> Arc<Config> {
        self.ctx.cfg()
    }

    /// Applies what of `new` can change at runtime (see
    /// [`Config::reload`]) and returns the changed keys that wait for a
    /// restart. Sessions opened from now on get the new limits.
    pub fn reload(&self, new: &Config) -> Vec<&'static str> {
        let (max_states_per_job, restart) = {
            let mut cur = self.ctx.cfg.write().unwrap_or_else(|p| p.into_inner());
            let (run, restart) = cur.reload(new);
            let max = run.max_states_per_job;
            *cur = Arc::new(run);
            (max, restart)
        };
        // Not under the configuration's lock: a registration holds the
        // registry's lock and may read the configuration.
        self.ctx
            .registry
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set_max_states_per_job(max_states_per_job);
        restart
    }

    /// Open sessions.
    pub fn sessions(&self) -> usize {
        self.ctx.sessions.load(Ordering::Acquire)
    }

    /// Reads the open sessions from another thread.
    pub fn session_count(&self) -> impl Fn() -> usize + Send + 'static {
        let c = self.ctx.clone();
        move || c.sessions.load(Ordering::Acquire)
    }

    /// Each shard's published liveness and counters.
    pub fn shards_live(&self) -> Vec<Arc<Live>> {
        self.ctx.shards.iter().map(|h| h.live.clone()).collect()
    }

    /// Stops accepting sessions, answers what is in flight, flushes every
    /// store and joins the threads.
    pub fn stop(mut self) -> Vec<ShardStats> {
        self.ctx.stopping.store(true, Ordering::Release);
        if let Some((stop, j)) = self.janitor.take() {
            drop(stop);
            let _ = j.join();
        }
        // Open control connections stay open until the shards have
        // answered what is in flight: a client takes its connection's end
        // for the daemon's.
        let connections = self
            .acceptor
            .take()
            .and_then(|a| a.join().ok())
            .unwrap_or_default();
        let _ = std::fs::remove_file(self.ctx.cfg().socket_path());
        for h in &self.ctx.shards {
            h.send(ShardMsg::Shutdown);
        }
        let stats = self
            .shards
            .drain(..)
            .filter_map(|j| j.join().ok())
            .collect();
        drop(connections);
        if let Some((stop, j)) = self.saver.take() {
            stop.store(true, Ordering::Release);
            self.ctx.registry_view.saver().wake();
            let _ = j.join();
        }
        // Last: `/healthz` says "stopping" while the shards drain.
        if let Some(s) = self.status.take() {
            s.stop();
        }
        drop(self.remote_rt.take());
        stats
    }
}

/// Starts the thread that saves the registrations shards make for
/// imports ([`Registry::save_pending`]) and wakes the shards once they
/// are durable (an import waits for that before its install); a failed
/// save is retried each second. It saves once more when `stop` is set,
/// and stops within a second when `stop` is dropped (a failed start).
fn start_saver(ctx: Arc<Ctx>) -> std::io::Result<(Arc<AtomicBool>, JoinHandle<()>)> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let j = std::thread::Builder::new()
        .name("statord-registry".into())
        .spawn(move || {
            loop {
                let stopping = s.load(Ordering::Acquire);
                if Registry::save_pending(&ctx.registry) {
                    for h in &ctx.shards {
                        h.bell.ring();
                    }
                }
                if stopping || Arc::strong_count(&s) == 1 {
                    return;
                }
                ctx.registry_view.saver().wait(Duration::from_secs(1));
            }
        })?;
    Ok((stop, j))
}

/// The disk ops each shard's ring may hold in the kernel at once: half of
/// the request queue (`queue/nr_requests`) of the data directory's device,
/// shared by the shards, so that none of them is put to sleep for a free
/// request slot (see `stator_store::io::UringIo`). Where the device's
/// queue cannot be read (not a block device), the ring's default, shared
/// the same way.
fn disk_depth(dir: &std::path::Path, shards: usize) -> usize {
    use std::os::unix::fs::MetadataExt;
    let queue = std::fs::metadata(dir).ok().and_then(|m| {
        let (major, minor) = (libc::major(m.dev()), libc::minor(m.dev()));
        // A partition's queue is its disk's.
        ["queue/nr_requests", "../queue/nr_requests"]
            .iter()
            .find_map(|q| {
                std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{q}"))
                    .ok()?
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
    });
    let queue = queue.unwrap_or(2 * stator_store::io::DISK_DEPTH);
    (queue / 2 / shards.max(1)).max(4)
}

/// Drops jobs with no session and no retained checkpoint for
/// `drop_idle_jobs_after_secs` ([`Registry::drop_idle`]), checking every
/// quarter of that time (at least every 100 ms, at most every minute),
/// until `stop`'s sender is dropped.
fn janitor(ctx: &Ctx, stop: &crossbeam_channel::Receiver<()>) {
    // Reports made before now are the shards' empty first ones.
    let started = Instant::now();
    loop {
        let after = Duration::from_secs(ctx.cfg().drop_idle_jobs_after_secs);
        let every = if after.is_zero() {
            Duration::from_secs(5)
        } else {
            (after / 4).clamp(Duration::from_millis(100), Duration::from_secs(60))
        };
        if stop.recv_timeout(every) != Err(crossbeam_channel::RecvTimeoutError::Timeout) {
            return;
        }
        if after.is_zero() || ctx.stopping.load(Ordering::Acquire) {
            continue;
        }
        let Some(retained) = retained(ctx, started) else {
            continue;
        };
        let jobs = Registry::drop_idle(&ctx.registry, after, &retained);
        ctx.jobs_dropped
            .fetch_add(jobs.len() as u64, Ordering::Relaxed);
        for job in jobs {
            tracing::info!(
                job,
                idle_secs = after.as_secs(),
                "job dropped: no session and no retained checkpoint; its names are forgotten and compaction reclaims its state"
            );
        }
    }
}

/// The jobs with a retained checkpoint on any shard, as the shards last
/// reported; `None` while a shard has not reported since `since`.
fn retained(ctx: &Ctx, since: Instant) -> Option<registry::Retained> {
    let mut r = registry::Retained {
        jobs: Default::default(),
        as_of: Instant::now(),
    };
    for h in &ctx.shards {
        let report = h.live.report.get();
        if report.at < since {
            return None;
        }
        r.as_of = r.as_of.min(report.at);
        for c in &report.checkpoints {
            let job = c.owner.split(|&b| b == 0).next().unwrap_or_default();
            r.jobs.insert(String::from_utf8_lossy(job).into_owned());
        }
    }
    Some(r)
}
