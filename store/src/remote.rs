//! The remote tier's client: object storage (S3 and compatible stores, or
//! a local directory) reached from a shard thread without blocking it.
//!
//! A shard submits work (ranged reads, file uploads, deletes, listings)
//! with a token and goes on; the requests run on a small tokio runtime
//! beside the shards ([`RemoteRuntime`]), and their outcomes come back
//! through a queue whose eventfd ([`Remote::fd`]) the shard's io_uring
//! watches, so one wait covers disk, remote and clients.
//!
//! - **Batching**: [`Remote::get_blocks`] takes the misses of one pass,
//!   groups them by object, and coalesces ranges that lie within
//!   `coalesce_gap` of each other (up to `max_get_bytes`) into one ranged
//!   GET; each token gets its own bytes back.
//! - **Bounded**: at most `max_in_flight` GETs run at once; more wait for
//!   a slot inside the runtime (the shard never waits).
//! - **Failures stay local**: every GET has a timeout and is retried with
//!   exponential backoff (`retries` times) on errors that may pass; after
//!   that, only the tokens that needed it fail, with an error that names
//!   the object, the range and the attempts. A missing object fails at
//!   once.
//! - **Counted**: [`RemoteStats`] (GETs in flight, issued, bytes fetched,
//!   latency, errors, uploads pending) for the status socket.

use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use nix::sys::eventfd::{EfdFlags, EventFd};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};

/// Where the remote tier lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A directory (the default when the tier is on without S3).
    Local { dir: PathBuf },
    /// An S3 or S3-compatible bucket. Unset credentials and region come
    /// from the standard AWS environment variables.
    S3 {
        bucket: String,
        /// `http://127.0.0.1:9000` for a compatible server; `None` = AWS.
        endpoint: Option<String>,
        region: Option<String>,
        access_key_id: Option<String>,
        secret_access_key: Option<String>,
        /// Plain HTTP endpoints (a server on loopback).
        allow_http: bool,
    },
}

/// How the client behaves.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    pub target: Target,
    /// Key prefix of every object (`<prefix>/<name>`); may be empty.
    pub prefix: String,
    /// GETs in flight at most.
    pub max_in_flight: usize,
    /// One attempt of one request at most.
    pub timeout: Duration,
    /// Attempts after the first, with exponential backoff from `backoff`.
    pub retries: u32,
    pub backoff: Duration,
    /// Ranges of one object closer than this are read by one GET.
    pub coalesce_gap: u64,
    /// Bytes one coalesced GET reads at most.
    pub max_get_bytes: u64,
}

impl RemoteConfig {
    pub fn new(target: Target) -> RemoteConfig {
        RemoteConfig {
            target,
            prefix: String::new(),
            max_in_flight: 8192,
            timeout: Duration::from_secs(10),
            retries: 4,
            backoff: Duration::from_millis(50),
            coalesce_gap: 64 << 10,
            max_get_bytes: 8 << 20,
        }
    }
}

/// Why a remote request failed, after its retries.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RemoteError {
    #[error("remote object {path} not found")]
    NotFound { path: String },
    #[error("remote {op} of {path} failed after {attempts} attempt(s): {msg}")]
    Failed {
        op: &'static str,
        path: String,
        attempts: u32,
        msg: String,
    },
    #[error("remote store configuration: {0}")]
    Config(String),
}

/// What a completed request produced.
#[derive(Debug)]
pub enum RemoteDone {
    /// The bytes of the range asked for: a slice of its GET's body (hold
    /// it briefly, or copy it: it keeps the whole body alive).
    Bytes(Bytes),
    /// The bytes of a range read by [`Remote::get_checked`], with what its
    /// check made of them (on the runtime, not the shard): bytes of its own
    /// unless the range was its GET's whole body, so what a holder keeps
    /// alive is exactly what it asked for and a cache can count it.
    Checked(Bytes, Result<(usize, usize), &'static str>),
    Uploaded,
    Deleted,
    /// Object names under the listed prefix (relative to the tier's
    /// prefix) with their sizes.
    Listed(Vec<(String, u64)>),
    /// The local files a scan found ([`Remote::local_task`]).
    LocalFiles(Vec<LocalFile>),
    /// A local task's work ended (what it made, it hands over itself).
    Ran,
}

/// A local file as a scan of the store's directories found it (the
/// tier's eviction measures the disk off the shard thread).
#[derive(Debug)]
pub struct LocalFile {
    pub name: String,
    pub path: std::path::PathBuf,
    /// Bytes it takes on the disk (allocated blocks).
    pub disk_bytes: u64,
    /// For a file the scan was asked to look into: where its data ends,
    /// and its length (from its footer).
    pub extent: Option<(u64, u64)>,
}

/// A check of a range's bytes run on the runtime before they are handed
/// over ([`Remote::get_checked`]): the store's block check (checksum and
/// record table), so that the shard thread does not read every fetched
/// byte again. What it returns rides along with the bytes.
pub type Check = fn(&[u8]) -> Result<(usize, usize), &'static str>;

/// Counters of one client (all relaxed; read by the status socket).
#[derive(Debug, Default)]
pub struct RemoteStats {
    pub gets_in_flight: AtomicU64,
    /// GETs issued (after coalescing) and ranges asked for.
    pub gets: AtomicU64,
    pub ranges: AtomicU64,
    pub bytes_fetched: AtomicU64,
    /// Sum of GET latencies, nanoseconds (with `gets`, the mean).
    pub get_ns: AtomicU64,
    /// GET latencies (every attempt's retries included): bucket `i` counts
    /// GETs that took less than `2^i` µs (the last, the rest).
    pub get_hist: [AtomicU64; GET_BUCKETS],
    pub retries: AtomicU64,
    pub errors: AtomicU64,
    pub uploads_pending: AtomicU64,
    pub bytes_uploaded: AtomicU64,
}

/// Buckets of [`RemoteStats::get_hist`]: 1 µs .. 2^24 µs (16.8 s), then
/// the rest.
pub const GET_BUCKETS: usize = 26;

impl RemoteStats {
    fn record_get(&self, d: Duration) {
        let us = d.as_micros() as u64;
        // Bucket i: < 2^i µs.
        let i = (64 - us.leading_zeros() as usize).min(GET_BUCKETS - 1);
        self.get_hist[i].fetch_add(1, Ordering::Relaxed);
        self.get_ns
            .fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
    }
}

/// The runtime remote requests run on: a few worker threads beside the
/// shards, shared by every shard's [`Remote`].
pub struct RemoteRuntime {
    rt: tokio::runtime::Runtime,
}

impl RemoteRuntime {
    pub fn new(threads: usize) -> std::io::Result<RemoteRuntime> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("stator-remote")
            .enable_all()
            .build()?;
        Ok(RemoteRuntime { rt })
    }

    pub fn handle(&self) -> tokio::runtime::Handle {
        self.rt.handle().clone()
    }
}

type Outcome = (u64, Result<RemoteDone, RemoteError>);

/// Completions handed from the runtime to the shard.
struct Queue {
    done: Mutex<Vec<Outcome>>,
    /// Outcomes in `done` (read without the lock: an empty poll costs no
    /// syscall).
    len: AtomicU64,
    bell: EventFd,
}

impl Queue {
    fn push(&self, items: impl IntoIterator<Item = Outcome>) {
        let mut d = self.done.lock().unwrap_or_else(|p| p.into_inner());
        let was_empty = d.is_empty();
        let before = d.len();
        d.extend(items);
        self.len
            .fetch_add((d.len() - before) as u64, Ordering::Release);
        // One wake per batch the shard has not taken yet, rung under the
        // lock: the bell is set exactly while outcomes wait (a bell left
        // set with nothing queued would wake the shard forever).
        if was_empty && !d.is_empty() {
            let _ = self.bell.write(1);
        }
    }
}

/// One shard's client of the remote tier.
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Handle,
    cfg: Arc<RemoteConfig>,
    queue: Arc<Queue>,
    slots: Arc<tokio::sync::Semaphore>,
    stats: Arc<RemoteStats>,
    /// Requests submitted whose outcome was not polled yet.
    outstanding: usize,
    /// Swapped with the queue's vector at each poll (and emptied), so that
    /// neither side allocates or regrows one per batch.
    spare: Vec<Outcome>,
}

/// GETs that block their thread, with a client's slots, timeout, retries
/// and counters: for work on the runtime's blocking pool (see
/// [`Remote::local_task`]), never for a shard.
#[derive(Clone)]
pub struct Fetcher {
    store: Arc<dyn ObjectStore>,
    rt: tokio::runtime::Handle,
    cfg: Arc<RemoteConfig>,
    slots: Arc<tokio::sync::Semaphore>,
    stats: Arc<RemoteStats>,
}

impl Fetcher {
    /// The bytes of object `name` in `range`.
    pub fn get(&self, name: &str, range: Range<u64>) -> Result<Bytes, RemoteError> {
        self.rt.block_on(self.fetch(name, range))
    }

    /// [`Fetcher::get`] of every `(name, range)`, all in flight at once;
    /// one result each, in order.
    pub fn get_all(&self, wanted: &[(String, Range<u64>)]) -> Vec<Result<Bytes, RemoteError>> {
        let gets = wanted.iter().map(|(n, r)| self.fetch(n, r.clone()));
        self.rt.block_on(futures_util::future::join_all(gets))
    }

    async fn fetch(&self, name: &str, range: Range<u64>) -> Result<Bytes, RemoteError> {
        let path = object_path(&self.cfg, name);
        let (store, cfg, stats, slots) = (&*self.store, &self.cfg, &self.stats, &self.slots);
        stats.ranges.fetch_add(1, Ordering::Relaxed);
        stats.gets.fetch_add(1, Ordering::Relaxed);
        let fetched = retry_get(store, cfg, stats, slots, &path, range, 0, String::new()).await;
        match &fetched {
            Ok(b) => stats
                .bytes_fetched
                .fetch_add(b.len() as u64, Ordering::Relaxed),
            Err(_) => stats.errors.fetch_add(1, Ordering::Relaxed),
        };
        fetched
    }
}

/// Object `name`'s path under the tier's prefix.
fn object_path(cfg: &RemoteConfig, name: &str) -> ObjPath {
    if cfg.prefix.is_empty() {
        ObjPath::from(name)
    } else {
        ObjPath::from(format!("{}/{name}", cfg.prefix.trim_end_matches('/')))
    }
}

/// The object store `cfg` names.
pub fn object_store(cfg: &RemoteConfig) -> Result<Arc<dyn ObjectStore>, RemoteError> {
    let bad = |e: object_store::Error| RemoteError::Config(e.to_string());
    match &cfg.target {
        Target::Local { dir } => {
            std::fs::create_dir_all(dir)
                .map_err(|e| RemoteError::Config(format!("{}: {e}", dir.display())))?;
            Ok(Arc::new(
                object_store::local::LocalFileSystem::new_with_prefix(dir).map_err(bad)?,
            ))
        }
        Target::S3 {
            bucket,
            endpoint,
            region,
            access_key_id,
            secret_access_key,
            allow_http,
        } => {
            // TLS through rustls with ring (a second install is refused,
            // harmlessly).
            let _ = rustls::crypto::ring::default_provider().install_default();
            let mut b = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_allow_http(*allow_http)
                // Our own retry loop decides (it knows the request's
                // deadline); the client's timeout bounds one attempt.
                .with_retry(object_store::RetryConfig {
                    max_retries: 0,
                    ..Default::default()
                })
                .with_client_options(
                    object_store::ClientOptions::new()
                        .with_timeout(cfg.timeout)
                        .with_connect_timeout(cfg.timeout.min(Duration::from_secs(5)))
                        .with_allow_http(*allow_http),
                );
            if let Some(e) = endpoint {
                b = b.with_endpoint(e).with_virtual_hosted_style_request(false);
            }
            if let Some(r) = region {
                b = b.with_region(r);
            }
            if let Some(k) = access_key_id {
                b = b.with_access_key_id(k);
            }
            if let Some(k) = secret_access_key {
                b = b.with_secret_access_key(k);
            }
            Ok(Arc::new(b.build().map_err(bad)?))
        }
    }
}

/// Whether a failure may pass on a retry.
fn transient(e: &object_store::Error) -> bool {
    !matches!(
        e,
        object_store::Error::NotFound { .. }
            | object_store::Error::InvalidPath { .. }
            | object_store::Error::NotSupported { .. }
            | object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
    )
}

/// Runs `attempt` with the configured timeout, retries and backoff.
async fn with_retries<T, F, Fut>(
    cfg: &RemoteConfig,
    timeout: Duration,
    stats: &RemoteStats,
    op: &'static str,
    path: &ObjPath,
    attempt: F,
) -> Result<T, RemoteError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, object_store::Error>>,
{
    with_retries_after(cfg, timeout, stats, op, path, (0, String::new()), attempt).await
}

/// `with_retries` after `made.0` attempts made elsewhere, the last of which
/// failed with `made.1` (in a way that may pass).
async fn with_retries_after<T, F, Fut>(
    cfg: &RemoteConfig,
    timeout: Duration,
    stats: &RemoteStats,
    op: &'static str,
    path: &ObjPath,
    (made, last): (u32, String),
    mut attempt: F,
) -> Result<T, RemoteError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, object_store::Error>>,
{
    let mut wait = cfg.backoff;
    let mut tries = made;
    if made > 0 {
        if tries > cfg.retries {
            return Err(RemoteError::Failed {
                op,
                path: path.to_string(),
                attempts: tries,
                msg: last,
            });
        }
        stats.retries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(5));
    }
    loop {
        tries += 1;
        let msg = match tokio::time::timeout(timeout, attempt()).await {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(object_store::Error::NotFound { .. })) => {
                return Err(RemoteError::NotFound {
                    path: path.to_string(),
                });
            }
            Ok(Err(e)) if !transient(&e) => {
                return Err(RemoteError::Failed {
                    op,
                    path: path.to_string(),
                    attempts: tries,
                    msg: e.to_string(),
                });
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {timeout:?}"),
        };
        if tries > cfg.retries {
            return Err(RemoteError::Failed {
                op,
                path: path.to_string(),
                attempts: tries,
                msg,
            });
        }
        stats.retries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

/// A range of one object and the token that wants it.
pub type Wanted = (Range<u64>, u64);

/// Splits `(range, token)` of one object into coalesced spans, in offset
/// order: `(span, members)`.
pub fn coalesce(mut wanted: Vec<Wanted>, gap: u64, max: u64) -> Vec<(Range<u64>, Vec<Wanted>)> {
    wanted.sort_by_key(|(r, _)| (r.start, r.end));
    let mut out: Vec<(Range<u64>, Vec<Wanted>)> = Vec::new();
    for (r, t) in wanted {
        if let Some((span, members)) = out.last_mut()
            && r.start <= span.end.saturating_add(gap)
            && r.end.max(span.end) - span.start <= max
        {
            span.end = span.end.max(r.end);
            members.push((r, t));
            continue;
        }
        out.push((r.clone(), vec![(r, t)]));
    }
    out
}

impl Remote {
    /// A client of `store` on runtime `rt`.
    pub fn new(
        store: Arc<dyn ObjectStore>,
        cfg: RemoteConfig,
        rt: tokio::runtime::Handle,
    ) -> std::io::Result<Remote> {
        let bell = EventFd::from_value_and_flags(0, EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
            .map_err(std::io::Error::from)?;
        Ok(Remote {
            store,
            rt,
            slots: Arc::new(tokio::sync::Semaphore::new(cfg.max_in_flight.max(1))),
            cfg: Arc::new(cfg),
            queue: Arc::new(Queue {
                done: Mutex::new(Vec::new()),
                len: AtomicU64::new(0),
                bell,
            }),
            stats: Arc::default(),
            outstanding: 0,
            spare: Vec::new(),
        })
    }

    /// Counters, shared with whoever reports them.
    pub fn stats(&self) -> Arc<RemoteStats> {
        self.stats.clone()
    }

    /// Readable while polled outcomes wait: watch it with the ring.
    pub fn fd(&self) -> RawFd {
        self.queue.bell.as_fd().as_raw_fd()
    }

    /// The eventfd, borrowed.
    pub fn bell(&self) -> BorrowedFd<'_> {
        self.queue.bell.as_fd()
    }

    /// Requests submitted whose outcome was not polled yet.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// What a spawned request needs of its client.
    fn handles(
        &self,
    ) -> (
        Arc<dyn ObjectStore>,
        Arc<RemoteConfig>,
        Arc<RemoteStats>,
        Arc<Queue>,
    ) {
        (
            self.store.clone(),
            self.cfg.clone(),
            self.stats.clone(),
            self.queue.clone(),
        )
    }

    fn path(&self, name: &str) -> ObjPath {
        object_path(&self.cfg, name)
    }

    /// Blocking GETs for a [`Remote::local_task`]'s work.
    pub fn fetcher(&self) -> Fetcher {
        Fetcher {
            store: self.store.clone(),
            rt: self.rt.clone(),
            cfg: self.cfg.clone(),
            slots: self.slots.clone(),
            stats: self.stats.clone(),
        }
    }

    /// Reads byte ranges of objects: `(token, object name, range)` each.
    /// Ranges of one object are coalesced; each token completes with its
    /// own bytes (or the error of the GET that held it).
    ///
    /// One task runs the whole batch ([`run_batch`]): its GETs are futures
    /// of one `FuturesUnordered` (no task spawned per GET), their first
    /// attempts share one deadline and one acquisition of slots, and every
    /// outcome ready at once is handed over in one push (one lock, one wake
    /// of the shard), which is what lets a thread sustain hundreds of
    /// thousands of GETs a second.
    pub fn get_blocks(&mut self, wanted: &[(u64, &str, Range<u64>)]) {
        self.get(wanted, None);
    }

    /// [`Remote::get_blocks`], each range's bytes passed through `check` on
    /// the runtime: they complete as [`RemoteDone::Checked`].
    pub fn get_checked(&mut self, wanted: &[(u64, &str, Range<u64>)], check: Check) {
        self.get(wanted, Some(check));
    }

    fn get(&mut self, wanted: &[(u64, &str, Range<u64>)], check: Option<Check>) {
        if wanted.is_empty() {
            return;
        }
        let mut by_object: rustc_hash::FxHashMap<&str, Vec<Wanted>> = Default::default();
        for (t, name, r) in wanted {
            by_object.entry(name).or_default().push((r.clone(), *t));
        }
        self.outstanding += wanted.len();
        self.stats
            .ranges
            .fetch_add(wanted.len() as u64, Ordering::Relaxed);
        let mut gets: Vec<Get> = Vec::new();
        for (name, ranges) in by_object {
            // One path per object, shared by its GETs.
            let path = Arc::new(self.path(name));
            for (span, members) in coalesce(ranges, self.cfg.coalesce_gap, self.cfg.max_get_bytes) {
                gets.push(Get {
                    path: Arc::clone(&path),
                    span,
                    members,
                });
            }
        }
        let (store, cfg, stats, queue) = self.handles();
        // A batch larger than the slots runs as several, each taking its
        // slots at once.
        let max = cfg.max_in_flight.max(1);
        while gets.len() > max {
            let rest = gets.split_off(max);
            let part = std::mem::replace(&mut gets, rest);
            let h = (store.clone(), cfg.clone(), stats.clone(), queue.clone());
            self.rt.spawn(run_batch(h, self.slots.clone(), part, check));
        }
        let h = (store, cfg, stats, queue);
        self.rt.spawn(run_batch(h, self.slots.clone(), gets, check));
    }

    /// Uploads local file `file` as object `name` (multipart, a few parts
    /// in flight; the whole object appears at once when it completes).
    pub fn upload_file(&mut self, token: u64, name: &str, file: PathBuf) {
        self.outstanding += 1;
        let (store, cfg, stats, queue) = self.handles();
        let path = self.path(name);
        stats.uploads_pending.fetch_add(1, Ordering::Relaxed);
        self.rt.spawn(async move {
            // An attempt may take the timeout per 8 MiB part.
            let len = tokio::fs::metadata(&file).await.map_or(0, |m| m.len());
            let timeout = cfg.timeout * (1 + (len >> 23) as u32);
            let r = with_retries(&cfg, timeout, &stats, "upload", &path, || {
                upload(&*store, &path, &file)
            })
            .await;
            stats.uploads_pending.fetch_sub(1, Ordering::Relaxed);
            let r = r.map(|n| {
                stats.bytes_uploaded.fetch_add(n, Ordering::Relaxed);
                RemoteDone::Uploaded
            });
            if r.is_err() {
                stats.errors.fetch_add(1, Ordering::Relaxed);
            }
            queue.push([(token, r)]);
        });
    }

    /// Runs `work` (local file work that may block: punching a cached
    /// segment's data out of the local disk, listing the directories) on
    /// the runtime's blocking pool; completes with what it returns, or a
    /// failure naming `what`.
    pub fn local_task(
        &mut self,
        token: u64,
        what: String,
        work: impl FnOnce() -> std::io::Result<RemoteDone> + Send + 'static,
    ) {
        self.outstanding += 1;
        let queue = self.queue.clone();
        let rt = self.rt.clone();
        self.rt.spawn(async move {
            let r = match rt.spawn_blocking(work).await {
                Ok(Ok(d)) => Ok(d),
                Ok(Err(e)) => Err(RemoteError::Failed {
                    op: "local",
                    path: what,
                    attempts: 1,
                    msg: e.to_string(),
                }),
                Err(e) => Err(RemoteError::Failed {
                    op: "local",
                    path: what,
                    attempts: 1,
                    msg: e.to_string(),
                }),
            };
            queue.push([(token, r)]);
        });
    }

    /// Deletes object `name` (a missing object counts as deleted).
    pub fn delete(&mut self, token: u64, name: &str) {
        self.outstanding += 1;
        let (store, cfg, stats, queue) = self.handles();
        let path = self.path(name);
        self.rt.spawn(async move {
            let r = match with_retries(&cfg, cfg.timeout, &stats, "DELETE", &path, || {
                store.delete(&path)
            })
            .await
            {
                Ok(()) | Err(RemoteError::NotFound { .. }) => Ok(RemoteDone::Deleted),
                Err(e) => Err(e),
            };
            queue.push([(token, r)]);
        });
    }

    /// Lists the objects under `sub` (a name prefix within the tier's
    /// prefix; empty = all).
    pub fn list(&mut self, token: u64, sub: &str) {
        use futures_util::TryStreamExt;
        self.outstanding += 1;
        let (store, cfg, stats, queue) = self.handles();
        let base = if self.cfg.prefix.is_empty() {
            None
        } else {
            Some(self.path(""))
        };
        let at = if sub.is_empty() {
            base.clone()
        } else {
            Some(self.path(sub))
        };
        let strip = self.cfg.prefix.trim_end_matches('/').to_string();
        self.rt.spawn(async move {
            let shown = at.clone().map_or_else(String::new, |p| p.to_string());
            let path = ObjPath::from(shown);
            let r = with_retries(&cfg, cfg.timeout, &stats, "LIST", &path, || {
                store.list(at.as_ref()).try_collect::<Vec<_>>()
            })
            .await
            .map(|metas| {
                RemoteDone::Listed(
                    metas
                        .into_iter()
                        .map(|m| {
                            let full = m.location.to_string();
                            let name = if strip.is_empty() {
                                full
                            } else {
                                full.strip_prefix(&format!("{strip}/"))
                                    .unwrap_or(&full)
                                    .to_string()
                            };
                            (name, m.size)
                        })
                        .collect(),
                )
            });
            queue.push([(token, r)]);
        });
    }

    /// Hands every outcome that arrived to `f`; returns how many.
    pub fn poll(&mut self, mut f: impl FnMut(u64, Result<RemoteDone, RemoteError>)) -> usize {
        if self.queue.len.load(Ordering::Acquire) == 0 {
            return 0;
        }
        // Taken and cleared under the lock pushes ring under; the queue
        // keeps the emptied vector of the last poll (its capacity).
        debug_assert!(self.spare.is_empty());
        {
            let mut d = self.queue.done.lock().unwrap_or_else(|p| p.into_inner());
            self.queue.len.fetch_sub(d.len() as u64, Ordering::Release);
            let _ = self.queue.bell.read();
            std::mem::swap(&mut *d, &mut self.spare);
        }
        let n = self.spare.len();
        self.outstanding -= n;
        for (t, r) in self.spare.drain(..) {
            f(t, r);
        }
        n
    }

    /// Blocks until an outcome arrives or `timeout` passes (for tests and
    /// tools; a shard waits on [`Remote::fd`] in its ring instead).
    pub fn wait(&self, timeout: Duration) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        if !self
            .queue
            .done
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
        {
            return;
        }
        let mut fds = [PollFd::new(self.queue.bell.as_fd(), PollFlags::POLLIN)];
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        );
    }
}

/// One coalesced GET: an object's span and the members that want parts
/// of it.
struct Get {
    path: Arc<ObjPath>,
    span: Range<u64>,
    members: Vec<Wanted>,
}

/// What a batch's task needs of its client.
type Handles = (
    Arc<dyn ObjectStore>,
    Arc<RemoteConfig>,
    Arc<RemoteStats>,
    Arc<Queue>,
);

/// A GET's later attempts (`retry_get`), by its index in the batch.
type Retry = std::pin::Pin<
    Box<dyn std::future::Future<Output = (usize, Result<Bytes, RemoteError>)> + Send>,
>;

/// What `run_batch` waits for next.
enum Event {
    First(usize, Result<Bytes, object_store::Error>),
    Retried(usize, Result<Bytes, RemoteError>),
    Deadline,
    Finished,
}

/// Runs one batch of GETs to an outcome for every member.
///
/// The first attempts start together, after one acquisition of a slot each
/// (FIFO behind earlier batches), under one deadline: one timer and one
/// clock read per batch, not per GET, because at hundreds of thousands of
/// GETs a second those were a fifth of the runtime thread. A GET that fails
/// in a way that may pass, or is still unanswered at the deadline, hands
/// its slot back and is retried on its own ([`with_retries`]: a slot, a
/// timeout and a backoff per attempt; retries are rare).
async fn run_batch(
    h: Handles,
    slots: Arc<tokio::sync::Semaphore>,
    mut gets: Vec<Get>,
    check: Option<Check>,
) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    let (store, cfg, stats, queue) = h.clone();
    let n = gets.len();
    // The semaphore is never closed; `get_blocks` caps a batch at its size.
    if let Ok(p) = slots.acquire_many(n as u32).await {
        p.forget();
    }
    stats.gets.fetch_add(n as u64, Ordering::Relaxed);
    stats.gets_in_flight.fetch_add(n as u64, Ordering::Relaxed);
    let t0 = Instant::now();
    let mut deadline = std::pin::pin!(tokio::time::sleep(cfg.timeout));
    let mut first: FuturesUnordered<_> = gets
        .iter()
        .enumerate()
        .map(|(i, g)| {
            let (store, path, span) = (store.clone(), g.path.clone(), g.span.clone());
            async move { (i, store.get_range(&path, span).await) }
        })
        .collect();
    let mut answered = vec![false; n];
    let mut retried: FuturesUnordered<Retry> = FuturesUnordered::new();
    // The slot and in-flight count of a first attempt that ended.
    let first_ended = |k: usize| {
        if k > 0 {
            slots.add_permits(k);
            stats.gets_in_flight.fetch_sub(k as u64, Ordering::Relaxed);
        }
    };
    let mut ready: Vec<Outcome> = Vec::new();
    loop {
        let event = std::future::poll_fn(|cx| {
            use std::task::Poll;
            if !first.is_empty()
                && let Poll::Ready(Some((i, r))) = first.poll_next_unpin(cx)
            {
                return Poll::Ready(Event::First(i, r));
            }
            if !retried.is_empty()
                && let Poll::Ready(Some((i, r))) = retried.poll_next_unpin(cx)
            {
                return Poll::Ready(Event::Retried(i, r));
            }
            if first.is_empty() && retried.is_empty() {
                return Poll::Ready(Event::Finished);
            }
            if !first.is_empty() && deadline.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Event::Deadline);
            }
            Poll::Pending
        })
        .await;
        // One clock read for everything that ended at this wake.
        let now = Instant::now();
        let mut event = event;
        let mut ended = 0;
        loop {
            match event {
                Event::Finished => break,
                Event::First(i, r) => {
                    answered[i] = true;
                    ended += 1;
                    let g = &mut gets[i];
                    match r {
                        Err(e) if transient(&e) && cfg.retries > 0 => {
                            retried.push(retry_later(&h, &slots, i, g, e.to_string()));
                        }
                        r => {
                            stats.record_get(now.duration_since(t0));
                            let r = r.map_err(|e| first_error(&g.path, e));
                            finish_get(&stats, g, r, check, &mut ready);
                        }
                    }
                }
                Event::Retried(i, r) => {
                    stats.record_get(now.duration_since(t0));
                    finish_get(&stats, &mut gets[i], r, check, &mut ready);
                }
                Event::Deadline => {
                    // Every first attempt still out missed the deadline.
                    first = FuturesUnordered::new();
                    let msg = format!("no answer within {:?}", cfg.timeout);
                    for (i, g) in gets.iter_mut().enumerate() {
                        if std::mem::replace(&mut answered[i], true) {
                            continue;
                        }
                        ended += 1;
                        if cfg.retries > 0 {
                            retried.push(retry_later(&h, &slots, i, g, msg.clone()));
                        } else {
                            stats.record_get(now.duration_since(t0));
                            let e = RemoteError::Failed {
                                op: "GET",
                                path: g.path.to_string(),
                                attempts: 1,
                                msg: msg.clone(),
                            };
                            finish_get(&stats, g, Err(e), check, &mut ready);
                        }
                    }
                }
            }
            // Whatever else ended meanwhile goes in the same push.
            event = match futures_util::FutureExt::now_or_never(first.next()) {
                Some(Some((i, r))) => Event::First(i, r),
                _ => match futures_util::FutureExt::now_or_never(retried.next()) {
                    Some(Some((i, r))) => Event::Retried(i, r),
                    _ => Event::Finished,
                },
            };
        }
        first_ended(ended);
        if !ready.is_empty() {
            queue.push(ready.drain(..));
        }
        if first.is_empty() && retried.is_empty() {
            return;
        }
    }
}

/// GET `i` of a batch (`g`) retried on its own after a first attempt that
/// failed with `msg` in a way that may pass.
fn retry_later(
    (store, cfg, stats, _): &Handles,
    slots: &Arc<tokio::sync::Semaphore>,
    i: usize,
    g: &Get,
    msg: String,
) -> Retry {
    let (store, cfg, stats, slots) = (store.clone(), cfg.clone(), stats.clone(), slots.clone());
    let (path, span) = (g.path.clone(), g.span.clone());
    Box::pin(async move {
        let r = retry_get(&*store, &cfg, &stats, &slots, &path, span, 1, msg).await;
        (i, r)
    })
}

/// The error of a first attempt that is not retried.
fn first_error(path: &ObjPath, e: object_store::Error) -> RemoteError {
    match e {
        object_store::Error::NotFound { .. } => RemoteError::NotFound {
            path: path.to_string(),
        },
        e => RemoteError::Failed {
            op: "GET",
            path: path.to_string(),
            attempts: 1,
            msg: e.to_string(),
        },
    }
}

/// Attempts after the first `tries` of one GET, each with a slot, the
/// timeout and exponential backoff; `msg` says why the last one failed.
#[allow(clippy::too_many_arguments)]
async fn retry_get(
    store: &dyn ObjectStore,
    cfg: &RemoteConfig,
    stats: &RemoteStats,
    slots: &tokio::sync::Semaphore,
    path: &ObjPath,
    span: Range<u64>,
    tries: u32,
    msg: String,
) -> Result<Bytes, RemoteError> {
    let _slot = slots.acquire().await;
    stats.gets_in_flight.fetch_add(1, Ordering::Relaxed);
    let r = with_retries_after(cfg, cfg.timeout, stats, "GET", path, (tries, msg), || {
        store.get_range(path, span.clone())
    })
    .await;
    stats.gets_in_flight.fetch_sub(1, Ordering::Relaxed);
    r
}

/// The outcome of each member of `g` from its GET's result.
fn finish_get(
    stats: &RemoteStats,
    g: &mut Get,
    r: Result<Bytes, RemoteError>,
    check: Option<Check>,
    ready: &mut Vec<Outcome>,
) {
    let span = g.span.clone();
    let members = std::mem::take(&mut g.members);
    match r {
        Ok(b) if b.len() as u64 == span.end - span.start => {
            stats
                .bytes_fetched
                .fetch_add(b.len() as u64, Ordering::Relaxed);
            // Checked ranges are kept (blocks in a cache): one that is not
            // the whole GET gets a copy of its own (made here, on the
            // runtime, rather than on the shard), so it keeps no larger
            // body alive. Others are copied out by their caller at once.
            let whole = b.len();
            ready.extend(members.into_iter().map(|(m, t)| {
                let s = (m.start - span.start) as usize;
                let e = (m.end - span.start) as usize;
                let bytes = if check.is_none() || e - s == whole {
                    b.slice(s..e)
                } else {
                    Bytes::copy_from_slice(&b[s..e])
                };
                let done = match check {
                    Some(c) => {
                        let shape = c(&bytes);
                        RemoteDone::Checked(bytes, shape)
                    }
                    None => RemoteDone::Bytes(bytes),
                };
                (t, Ok(done))
            }));
        }
        other => {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            let e = match other {
                Err(e) => e,
                Ok(b) => RemoteError::Failed {
                    op: "GET",
                    path: g.path.to_string(),
                    attempts: 1,
                    msg: format!(
                        "range {span:?} returned {} bytes (the object is shorter)",
                        b.len()
                    ),
                },
            };
            ready.extend(members.into_iter().map(|(_, t)| (t, Err(e.clone()))));
        }
    }
}

/// Uploads `file` to `path` in 8 MiB parts, a few at once; its size.
async fn upload(
    store: &dyn ObjectStore,
    path: &ObjPath,
    file: &std::path::Path,
) -> Result<u64, object_store::Error> {
    use tokio::io::AsyncReadExt;
    let io = |e: std::io::Error| object_store::Error::Generic {
        store: "local file",
        source: Box::new(e),
    };
    let mut f = tokio::fs::File::open(file).await.map_err(io)?;
    let len = f.metadata().await.map_err(io)?.len();
    if len <= 8 << 20 {
        let mut buf = Vec::with_capacity(len as usize);
        f.read_to_end(&mut buf).await.map_err(io)?;
        store.put(path, PutPayload::from(buf)).await?;
        return Ok(len);
    }
    let mut w = WriteMultipart::new_with_chunk_size(store.put_multipart(path).await?, 8 << 20);
    let mut buf = vec![0u8; 1 << 20];
    let sent: Result<(), object_store::Error> = async {
        loop {
            let n = f.read(&mut buf).await.map_err(io)?;
            if n == 0 {
                return Ok(());
            }
            w.wait_for_capacity(4).await?;
            w.write(&buf[..n]);
        }
    }
    .await;
    if let Err(e) = sent {
        // Leave no incomplete upload behind (one cut by the attempt's
        // timeout is left to the bucket's lifecycle rule; README).
        let _ = w.abort().await;
        return Err(e);
    }
    w.finish().await?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_ranges_share_a_get_and_far_or_large_ones_do_not() {
        let w = vec![
            (8192..12288, 3),
            (0..4096, 1),
            (4096..8192, 2),
            (1 << 20..(1 << 20) + 4096, 4),
            (0..4096, 5),
        ];
        let c = coalesce(w, 64 << 10, 8 << 20);
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].0, 0..12288);
        assert_eq!(c[0].1.iter().map(|m| m.1).collect::<Vec<_>>(), [1, 5, 2, 3]);
        assert_eq!(c[1].0, 1 << 20..(1 << 20) + 4096);
        // A cap on one GET's bytes splits a long run.
        let run: Vec<_> = (0..10u64).map(|i| (i * 4096..(i + 1) * 4096, i)).collect();
        let c = coalesce(run, 0, 16384);
        assert_eq!(c.len(), 3);
        assert!(c.iter().all(|(s, _)| s.end - s.start <= 16384));
    }
}
