//! The status socket: HTTP/1.1 (hyper) on `<run_dir>/status.sock`.
//!
//! - `GET /status`: JSON (version, uptime, shards, sessions, memory used
//!   against the budget, disk used, retained checkpoints, errors);
//! - `GET /metrics`: Prometheus text exposition (`prometheus-client`);
//! - `GET /healthz`: `200 ok` while every shard loop reports, `503` with
//!   the reason when one is stuck or the daemon is stopping.
//!
//! It runs on one thread of its own with a single-threaded tokio runtime,
//! off the shard threads: it reads what the shards publish (relaxed
//! counters, each shard's loop `beat`, and a report rebuilt every
//! [`REPORT_EVERY`](crate::shard::REPORT_EVERY)) and never waits for a
//! shard; gathering a status (which walks `data_dir`) runs on the
//! runtime's blocking pool, so `/healthz` never waits behind it. Only uids
//! that may open sessions, root and the daemon's own uid may read
//! (SO_PEERCRED, checked per request); others get `403` and the
//! connection closes. At most [`MAX_CONNECTIONS`] connections are served
//! at once; more are closed at accept.
//!
//! `curl --unix-socket stator-run/status.sock http://localhost/metrics`

use std::convert::Infallible;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Request, Response, StatusCode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use stator_store::remote::{GET_BUCKETS, RemoteStats};
use stator_store::{StallCause, TierStats};

use crate::control::Ctx;
use crate::metrics::{BUCKETS, OPS, OpSnapshot, ShardReport, bucket_bound_s, op_name};
use crate::status_schema::{
    CheckpointStatus, Disk, Errors, Memory, OpStats, RemoteStatus, ServeState, ShardStatus, Status,
    StoreStatus,
};

/// A shard whose loop has not moved for this long is stuck.
pub const STUCK_AFTER: Duration = Duration::from_secs(5);

/// Status connections served at once.
pub const MAX_CONNECTIONS: usize = 64;

/// When each shard's loop `beat` last moved, as this server saw it.
#[derive(Debug, Default)]
pub struct Beats(std::sync::Mutex<Vec<(u64, Instant)>>);

impl Beats {
    /// The shards whose loop has not moved for [`STUCK_AFTER`], with how
    /// long. An idle shard wakes every second, so a still beat is a stuck
    /// loop.
    pub fn stuck(&self, ctx: &Ctx) -> Vec<(usize, Duration)> {
        let now = Instant::now();
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        seen.resize(ctx.shards.len(), (u64::MAX, now));
        let mut out = Vec::new();
        for (i, (h, s)) in ctx.shards.iter().zip(seen.iter_mut()).enumerate() {
            let b = h.live.beat.load(Ordering::Relaxed);
            if b != s.0 {
                *s = (b, now);
            } else if now.duration_since(s.1) > STUCK_AFTER {
                out.push((i, now.duration_since(s.1)));
            }
        }
        out
    }
}

fn stuck_text(stuck: &[(usize, Duration)]) -> Vec<String> {
    stuck
        .iter()
        .map(|(i, d)| format!("shard {i} has not moved for {:.1} s", d.as_secs_f64()))
        .collect()
}

/// The running status server.
pub struct StatusServer {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl StatusServer {
    /// Binds `<run_dir>/status.sock` and serves it from a thread.
    pub fn start(ctx: Arc<Ctx>, started: Instant) -> std::io::Result<StatusServer> {
        let path = ctx.cfg().status_path();
        // The control socket was checked for another daemon first: a file
        // here is a leftover of a crash.
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        // Who may read is decided per connection (SO_PEERCRED).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
        let beats = Arc::new(Beats::default());
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let thread = std::thread::Builder::new()
            .name("statord-status".into())
            .spawn(move || {
                rt.block_on(async move {
                    let listener = match tokio::net::UnixListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            tracing::error!(error = %e, "the status socket cannot be served");
                            return;
                        }
                    };
                    loop {
                        tokio::select! {
                            _ = &mut rx => break,
                            a = listener.accept() => match a {
                                Ok((stream, _)) => {
                                    // Over the cap: closed at once.
                                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                                        continue;
                                    };
                                    let (c, b) = (ctx.clone(), beats.clone());
                                    tokio::spawn(async move {
                                        serve(stream, c, b, started).await;
                                        drop(slot);
                                    });
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, "status socket accept failed");
                                    tokio::time::sleep(Duration::from_millis(100)).await;
                                }
                            },
                        }
                    }
                });
            })?;
        Ok(StatusServer {
            stop: Some(tx),
            thread: Some(thread),
            path,
        })
    }

    /// Stops serving and removes the socket file.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Whether `uid` may read the status (the configuration in force now).
fn allowed(ctx: &Ctx, uid: Option<u32>) -> bool {
    uid.is_some_and(|u| ctx.cfg().allows(u))
}

async fn serve(stream: tokio::net::UnixStream, ctx: Arc<Ctx>, beats: Arc<Beats>, started: Instant) {
    let uid = stream.peer_cred().map(|c| c.uid()).ok();
    // A stranger gets its 403 and the connection closes.
    let keep_alive = allowed(&ctx, uid);
    let svc = hyper::service::service_fn(move |req| {
        let (ctx, beats) = (ctx.clone(), beats.clone());
        async move {
            let ok = allowed(&ctx, uid);
            let path = req.uri().path().to_string();
            let mut r = if ok && matches!(path.as_str(), "/status" | "/metrics") {
                // Gathering walks data_dir: on the blocking pool.
                let (c, b) = (ctx.clone(), beats.clone());
                match tokio::task::spawn_blocking(move || Gathered::now(&c, &b, started)).await {
                    Ok(g) => route(&req, &ctx, &beats, Some(g), ok, uid),
                    Err(_) => reply(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        TEXT,
                        "status gathering failed\n",
                    ),
                }
            } else {
                route(&req, &ctx, &beats, None, ok, uid)
            };
            if !ok {
                r.headers_mut().insert(
                    hyper::header::CONNECTION,
                    "close".parse().expect("a header"),
                );
            }
            Ok::<_, Infallible>(r)
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .keep_alive(keep_alive)
        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "status connection ended with an error");
    }
}

fn reply(code: StatusCode, ctype: &str, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    Response::builder()
        .status(code)
        .header(hyper::header::CONTENT_TYPE, ctype)
        .header(hyper::header::CACHE_CONTROL, "no-store")
        .body(Full::new(body.into()))
        .expect("a response from valid parts")
}

const TEXT: &str = "text/plain; charset=utf-8";

/// Answers `req`; `gathered` is the status read for `/status` and
/// `/metrics`.
fn route<B>(
    req: &Request<B>,
    ctx: &Ctx,
    beats: &Beats,
    gathered: Option<Gathered>,
    allowed: bool,
    uid: Option<u32>,
) -> Response<Full<Bytes>> {
    if !allowed {
        return reply(
            StatusCode::FORBIDDEN,
            TEXT,
            format!(
                "uid {} may not read this daemon's status (allowed_uids, root or statord's own uid)\n",
                uid.map_or("unknown".into(), |u| u.to_string())
            ),
        );
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "only GET and HEAD are served\n",
        );
        r.headers_mut()
            .insert(hyper::header::ALLOW, "GET, HEAD".parse().expect("a header"));
        return r;
    }
    let mut r = match (req.uri().path(), gathered) {
        ("/status", Some(g)) => {
            let mut body = serde_json::to_vec_pretty(&g.status()).expect("JSON");
            body.push(b'\n');
            reply(StatusCode::OK, "application/json", body)
        }
        ("/metrics", Some(g)) => {
            let mut reg = prometheus_client::registry::Registry::with_prefix("stator");
            reg.register_collector(Box::new(g));
            let mut out = String::new();
            match prometheus_client::encoding::prometheus_text::encode(&mut out, &reg) {
                Ok(()) => reply(
                    StatusCode::OK,
                    prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
                    out,
                ),
                Err(_) => reply(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    TEXT,
                    "metrics could not be encoded\n",
                ),
            }
        }
        ("/healthz", _) => match health(ctx, beats) {
            Ok(()) => reply(StatusCode::OK, TEXT, "ok\n"),
            Err(why) => reply(StatusCode::SERVICE_UNAVAILABLE, TEXT, why + "\n"),
        },
        ("/", _) => reply(
            StatusCode::OK,
            TEXT,
            "statord status socket: GET /status (JSON), /metrics (Prometheus text), /healthz\n",
        ),
        (p, _) => reply(
            StatusCode::NOT_FOUND,
            TEXT,
            format!("no such path {p}: try /status, /metrics or /healthz\n"),
        ),
    };
    if req.method() == Method::HEAD {
        *r.body_mut() = Full::new(Bytes::new());
    }
    r
}

/// `Ok` while the daemon serves and every shard loop moves.
pub fn health(ctx: &Ctx, beats: &Beats) -> Result<(), String> {
    if ctx.stopping.load(Ordering::Acquire) {
        return Err("stopping".into());
    }
    let stuck = beats.stuck(ctx);
    if stuck.is_empty() {
        Ok(())
    } else {
        Err(stuck_text(&stuck).join("; "))
    }
}

/// Bytes of the files under `dir` (recursively; unreadable entries skipped).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// Lower-case hex of `b` (checkpoint handles).
pub fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

/// Bytes of a hex string, or `None`.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

/// Everything the shards published, read at one moment.
#[derive(Debug)]
struct Gathered {
    uptime: Duration,
    stopping: bool,
    sessions_open: usize,
    max_sessions: usize,
    shards: Vec<(Arc<ShardReport>, u64)>,
    stuck: Vec<(usize, Duration)>,
    ops: OpSnapshot,
    /// The shards' loop turns that did work (`Live::turns`), summed.
    turns: crate::metrics::HistSnapshot,
    data_dir: PathBuf,
    data_dir_bytes: u64,
    /// Jobs and states in the registry, and jobs dropped since the start.
    registry: (usize, usize, u64),
}

impl Gathered {
    fn now(ctx: &Ctx, beats: &Beats, started: Instant) -> Gathered {
        let cfg = ctx.cfg();
        let mut ops = OpSnapshot::default();
        let mut turns = crate::metrics::HistSnapshot::default();
        let shards = ctx
            .shards
            .iter()
            .map(|h| {
                let o = h.live.ops.read();
                ops.add(&o);
                turns.add(&h.live.turns.read());
                (h.live.report.get(), o.requests.iter().sum())
            })
            .collect();
        Gathered {
            uptime: started.elapsed(),
            stopping: ctx.stopping.load(Ordering::Acquire),
            sessions_open: ctx.sessions.load(Ordering::Acquire),
            max_sessions: cfg.max_sessions,
            shards,
            stuck: beats.stuck(ctx),
            ops,
            turns,
            data_dir: cfg.data_dir.clone(),
            data_dir_bytes: dir_bytes(&cfg.data_dir),
            registry: {
                let (jobs, states) = ctx.registry_view.get().counts();
                (jobs, states, ctx.jobs_dropped.load(Ordering::Relaxed))
            },
        }
    }

    fn memory(&self) -> stator_store::MemoryUsage {
        self.shards
            .iter()
            .fold(Default::default(), |a, (r, _)| a + r.memory)
    }

    fn status(&self) -> Status {
        let now_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let mut sessions = Vec::new();
        let mut checkpoints = Vec::new();
        let mut problems = stuck_text(&self.stuck);
        let shards: Vec<_> = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, (r, requests))| {
                sessions.extend(r.sessions.iter().cloned());
                for c in &r.checkpoints {
                    let mut parts = c.owner.splitn(2, |&b| b == 0);
                    let mut name =
                        || String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
                    checkpoints.push(CheckpointStatus {
                        shard: i as u64,
                        job: name(),
                        operator: name(),
                        checkpoint_id: c.checkpoint_id,
                        key_group_lo: c.lo,
                        key_group_hi: c.hi,
                        handle: hex(&c.handle),
                        segments: c.segments as u64,
                        completed: c.completed,
                        manifest: c.seq,
                    });
                }
                if let Some(e) = &r.store.last_background_error {
                    problems.push(format!("shard {i}: {e}"));
                }
                let st = &r.store;
                ShardStatus {
                    id: i as u64,
                    report_age_ms: r.at.elapsed().as_millis() as u64,
                    stuck: self.stuck.iter().any(|s| s.0 == i),
                    requests: *requests,
                    sessions: r.sessions.len() as u64,
                    in_flight: r.sessions.iter().map(|s| u64::from(s.in_flight)).sum(),
                    memory: Memory::from(&r.memory),
                    store: StoreStatus {
                        segments: st.segments as u64,
                        segment_bytes: st.segment_bytes,
                        flushes: st.flushes,
                        compactions: st.compactions,
                        torn_files: st.torn_kept as u64,
                        torn_files_removed: st.torn_removed as u64,
                        write_stalls: st.write_stalls().0,
                        write_stall_ms: st.write_stalls().1.as_millis() as u64,
                        block_reads: st.block_reads,
                        cache_hits: st.cache_hits,
                        cache_misses: st.cache_misses,
                        pending_reads: st.pending_reads as u64,
                        checkpoints_retained: st.checkpoints_retained as u64,
                        checkpoints_in_progress: st.checkpoints_in_progress as u64,
                        last_background_error: st
                            .last_background_error
                            .as_ref()
                            .map(|e| e.to_string()),
                    },
                    remote: st
                        .remote
                        .as_ref()
                        .map(|t| remote_status(t, r.remote.as_deref())),
                }
            })
            .collect();
        // Per operation: counts, and latency buckets (not cumulative; upper
        // bounds in `latency_bucket_bounds_s`) so a reader can take
        // quantiles over any interval from two reads.
        let ops = (0..=OPS)
            .map(|i| {
                let lat = self.ops.latency.get(i);
                let op = OpStats {
                    requests: self.ops.requests[i],
                    errors: self.ops.errors[i],
                    latency_sum_s: lat.map_or(0.0, |h| h.sum_ns as f64 / 1e9),
                    latency_buckets: lat.map_or(vec![0; BUCKETS], |h| h.buckets.to_vec()),
                };
                (op_name(i), op)
            })
            .collect();
        let latency_bucket_bounds_s = (0..BUCKETS)
            .map(|i| Some(bucket_bound_s(i)).filter(|b| b.is_finite()))
            .collect();
        let store = |f: fn(&stator_store::StoreStats) -> u64| {
            self.shards.iter().map(|(r, _)| f(&r.store)).sum::<u64>()
        };
        Status {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: std::process::id(),
            uptime_s: self.uptime.as_secs_f64(),
            now_unix,
            state: if self.stopping {
                ServeState::Stopping
            } else {
                ServeState::Serving
            },
            sessions_open: self.sessions_open as u64,
            max_sessions: self.max_sessions as u64,
            requests: self.ops.requests.iter().sum(),
            in_flight: sessions.iter().map(|s| u64::from(s.in_flight)).sum(),
            memory: Memory::from(&self.memory()),
            disk: Disk {
                data_dir: self.data_dir.display().to_string(),
                used_bytes: self.data_dir_bytes,
                segment_bytes: store(|s| s.segment_bytes),
                segments: store(|s| s.segments as u64),
            },
            ops,
            latency_bucket_bounds_s,
            shards,
            sessions,
            checkpoints,
            errors: Errors {
                request_errors: self.ops.errors.iter().sum(),
                problems,
            },
        }
    }
}

/// A shard's remote tier: the store's counters and the client's live
/// ones (zero without them).
fn remote_status(t: &TierStats, live: Option<&RemoteStats>) -> RemoteStatus {
    let get = |f: fn(&RemoteStats) -> &AtomicU64| live.map_or(0, |s| f(s).load(Ordering::Relaxed));
    RemoteStatus {
        objects: t.objects as u64,
        evicted_segments: t.evicted_segments as u64,
        local_cache_bytes: t.local_cache_bytes,
        local_cache_budget_bytes: t.local_cache_budget,
        local_block_reads: t.local_block_reads,
        remote_block_reads: t.remote_block_reads,
        evictions: t.evictions,
        writebacks: t.writebacks,
        refetched: t.refetched,
        uploads_failed: t.uploads_failed,
        deletes_failed: t.deletes_failed,
        eager_uploads: t.eager_uploads,
        last_error: t.last_error.clone(),
        gets: get(|s| &s.gets),
        gets_in_flight: get(|s| &s.gets_in_flight),
        bytes_fetched: get(|s| &s.bytes_fetched),
        uploads_pending: get(|s| &s.uploads_pending),
        bytes_uploaded: get(|s| &s.bytes_uploaded),
        retries: get(|s| &s.retries),
        errors: get(|s| &s.errors),
    }
}

type Fmt = std::fmt::Result;

fn gauge(e: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> Fmt {
    e.encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&v)
}

fn counter(e: &mut DescriptorEncoder, name: &str, help: &str, v: u64) -> Fmt {
    e.encode_descriptor(name, help, None, MetricType::Counter)?
        .encode_counter::<NoLabelSet, _, u64>(&v, None)
}

/// The histogram families of `hists` (label `op`), in seconds.
fn histograms<'a>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    hists: impl Iterator<Item = (String, &'a crate::metrics::HistSnapshot)>,
) -> Fmt {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (op, h) in hists {
        let buckets: Vec<(f64, u64)> = (0..BUCKETS)
            .map(|i| (bucket_bound_s(i), h.buckets[i]))
            .collect();
        let labels = [("op", op)];
        m.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
            h.sum_ns as f64 / 1e9,
            h.count(),
            &buckets,
            None,
        )?;
    }
    Ok(())
}

impl Gathered {
    /// The remote tier's metrics (none while it is off).
    fn encode_remote(&self, e: &mut DescriptorEncoder) -> Fmt {
        let tiers: Vec<(&TierStats, Option<&RemoteStats>)> = self
            .shards
            .iter()
            .filter_map(|(r, _)| Some((r.store.remote.as_ref()?, r.remote.as_deref())))
            .collect();
        if tiers.is_empty() {
            return Ok(());
        }
        let tsum = |f: fn(&TierStats) -> u64| tiers.iter().map(|(t, _)| f(t)).sum::<u64>();
        let rsum = |f: fn(&RemoteStats) -> &AtomicU64| {
            tiers
                .iter()
                .filter_map(|(_, r)| *r)
                .map(|r| f(r).load(Ordering::Relaxed))
                .sum::<u64>()
        };
        let (local, remote) = (
            tsum(|t| t.local_block_reads),
            tsum(|t| t.remote_block_reads),
        );
        {
            let mut m = e.encode_descriptor(
                "remote_block_reads",
                "Segment block reads by where they were served (the local disk cache or the remote tier)",
                None,
                MetricType::Counter,
            )?;
            for (source, v) in [("local", local), ("remote", remote)] {
                m.encode_family(&[("source", source)])?
                    .encode_counter::<NoLabelSet, _, u64>(&v, None)?;
            }
        }
        gauge(
            e,
            "remote_cache_hit_ratio",
            "Block reads the local disk served, of all block reads since start (1 before any)",
            if local + remote == 0 {
                1.0
            } else {
                local as f64 / (local + remote) as f64
            },
        )?;
        gauge(
            e,
            "remote_local_cache_bytes",
            "Bytes segment files take on the local disk (at the last eviction pass)",
            tsum(|t| t.local_cache_bytes) as f64,
        )?;
        gauge(
            e,
            "remote_local_cache_budget_bytes",
            "The local disk cache's budget (remote.local_cache_mib; 0: none)",
            tsum(|t| t.local_cache_budget.unwrap_or(0)) as f64,
        )?;
        gauge(
            e,
            "remote_evicted_segments",
            "Segment files whose data is only remote",
            tsum(|t| t.evicted_segments as u64) as f64,
        )?;
        counter(
            e,
            "remote_evictions",
            "Segment files evicted from the local disk",
            tsum(|t| t.evictions),
        )?;
        counter(
            e,
            "remote_writebacks",
            "Fetched spans written back into local files (the local cache refilling)",
            tsum(|t| t.writebacks),
        )?;
        counter(
            e,
            "remote_refetched",
            "Local blocks that failed their checksum and were read from the remote instead",
            tsum(|t| t.refetched),
        )?;
        gauge(
            e,
            "remote_gets_in_flight",
            "Ranged GETs in flight",
            rsum(|s| &s.gets_in_flight) as f64,
        )?;
        counter(
            e,
            "remote_gets",
            "Ranged GETs issued (after coalescing)",
            rsum(|s| &s.gets),
        )?;
        counter(
            e,
            "remote_bytes_fetched",
            "Bytes read from the remote tier",
            rsum(|s| &s.bytes_fetched),
        )?;
        gauge(
            e,
            "remote_uploads_pending",
            "Uploads in flight",
            rsum(|s| &s.uploads_pending) as f64,
        )?;
        counter(
            e,
            "remote_bytes_uploaded",
            "Bytes uploaded",
            rsum(|s| &s.bytes_uploaded),
        )?;
        counter(
            e,
            "remote_uploads_failed",
            "Uploads that failed after their retries (each fails its checkpoint)",
            tsum(|t| t.uploads_failed),
        )?;
        counter(
            e,
            "remote_retries",
            "Remote request attempts retried",
            rsum(|s| &s.retries),
        )?;
        counter(
            e,
            "remote_errors",
            "Remote requests that failed after their retries",
            rsum(|s| &s.errors),
        )?;
        let mut counts = [0u64; GET_BUCKETS];
        for (_, r) in &tiers {
            if let Some(r) = r {
                for (c, b) in counts.iter_mut().zip(&r.get_hist) {
                    *c += b.load(Ordering::Relaxed);
                }
            }
        }
        let buckets: Vec<(f64, u64)> = counts
            .iter()
            .enumerate()
            .map(|(i, &c)| {
                let bound = if i + 1 == GET_BUCKETS {
                    f64::INFINITY
                } else {
                    (1u64 << i) as f64 / 1e6
                };
                (bound, c)
            })
            .collect();
        e.encode_descriptor(
            "remote_get_duration_seconds",
            "Ranged GET latency, retries included",
            None,
            MetricType::Histogram,
        )?
        .encode_histogram::<NoLabelSet>(
            rsum(|s| &s.get_ns) as f64 / 1e9,
            counts.iter().sum(),
            &buckets,
            None,
        )
    }
}

impl Collector for Gathered {
    fn encode(&self, mut e: DescriptorEncoder) -> Fmt {
        e.encode_descriptor("build", "statord's version", None, MetricType::Info)?
            .encode_info(&[("version", env!("CARGO_PKG_VERSION"))])?;
        gauge(
            &mut e,
            "uptime_seconds",
            "Seconds since statord started",
            self.uptime.as_secs_f64(),
        )?;
        gauge(
            &mut e,
            "sessions",
            "Open sessions",
            self.sessions_open as f64,
        )?;
        gauge(
            &mut e,
            "max_sessions",
            "Sessions allowed at once (max_sessions)",
            self.max_sessions as f64,
        )?;
        gauge(
            &mut e,
            "registered_jobs",
            "Jobs with state names in the registry (states.json)",
            self.registry.0 as f64,
        )?;
        gauge(
            &mut e,
            "registered_states",
            "State names in the registry (states.json)",
            self.registry.1 as f64,
        )?;
        counter(
            &mut e,
            "jobs_dropped",
            "Jobs dropped since the start: no session and no retained checkpoint for drop_idle_jobs_after_secs",
            self.registry.2,
        )?;
        {
            let mut m = e.encode_descriptor(
                "requests",
                "Requests taken off submission queues, by operation",
                None,
                MetricType::Counter,
            )?;
            for i in 0..=OPS {
                m.encode_family(&[("op", op_name(i))])?
                    .encode_counter::<NoLabelSet, _, u64>(&self.ops.requests[i], None)?;
            }
        }
        {
            let mut m = e.encode_descriptor(
                "request_errors",
                "Requests completed with a failure status, by operation",
                None,
                MetricType::Counter,
            )?;
            for i in 0..=OPS {
                m.encode_family(&[("op", op_name(i))])?
                    .encode_counter::<NoLabelSet, _, u64>(&self.ops.errors[i], None)?;
            }
        }
        histograms(
            &mut e,
            "request_duration_seconds",
            "Daemon-side request latency (descriptor taken to completion pushed), by operation; op=\"checkpoint\" is the checkpoint duration (barrier to durable manifest); chunk_release and snapshot_import are not timed",
            self.ops
                .latency
                .iter()
                .enumerate()
                .map(|(i, h)| (op_name(i), h)),
        )?;
        {
            let h = &self.turns;
            let buckets: Vec<(f64, u64)> = (0..BUCKETS)
                .map(|i| (bucket_bound_s(i), h.buckets[i]))
                .collect();
            e.encode_descriptor(
                "shard_turn_duration_seconds",
                "Turns of the shards' loops that did work (control messages, every session's queue, store completions and background steps): a descriptor waits about one turn before it is taken, so a long turn stalls every session of its shard",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<NoLabelSet>(h.sum_ns as f64 / 1e9, h.count(), &buckets, None)?;
        }
        let sess = self.shards.iter().flat_map(|(r, _)| &r.sessions);
        gauge(
            &mut e,
            "in_flight",
            "Requests in the daemon (taken, not completed)",
            sess.clone().map(|s| s.in_flight as f64).sum(),
        )?;
        {
            let mut m = e.encode_descriptor(
                "queue_depth",
                "Entries waiting in session queues (submission: not yet taken; completion: not yet reaped)",
                None,
                MetricType::Gauge,
            )?;
            let sq: u64 = sess.clone().map(|s| s.sq_depth as u64).sum();
            let cq: u64 = sess.clone().map(|s| s.cq_depth as u64).sum();
            m.encode_family(&[("queue", "submission")])?
                .encode_gauge(&sq)?;
            m.encode_family(&[("queue", "completion")])?
                .encode_gauge(&cq)?;
        }
        let mem = self.memory();
        {
            let mut m = e.encode_descriptor(
                "memory_bytes",
                "Store memory in use, by part",
                None,
                MetricType::Gauge,
            )?;
            for (part, v) in [
                ("memtables", mem.memtables),
                ("block_cache", mem.block_cache),
                ("indexes_and_filters", mem.indexes_and_filters),
                ("background", mem.background),
                ("checkpoints", mem.checkpoints),
            ] {
                let v = v as u64;
                m.encode_family(&[("part", part)])?.encode_gauge(&v)?;
            }
        }
        gauge(
            &mut e,
            "memory_budget_bytes",
            "The stores' memory budget (memory_budget_mib)",
            mem.budget as f64,
        )?;
        gauge(
            &mut e,
            "memtable_limit_bytes",
            "The log bytes the active memtables freeze at (memtable_mib, or less as indexes and background work grow)",
            mem.memtable_limit as f64,
        )?;
        let sum = |f: &dyn Fn(&ShardReport) -> u64| -> u64 {
            self.shards.iter().map(|(r, _)| f(r)).sum()
        };
        counter(
            &mut e,
            "cache_hits",
            "Block cache hits",
            sum(&|r| r.store.cache_hits),
        )?;
        counter(
            &mut e,
            "cache_misses",
            "Block cache misses",
            sum(&|r| r.store.cache_misses),
        )?;
        counter(
            &mut e,
            "disk_block_reads",
            "Data blocks read from disk",
            sum(&|r| r.store.block_reads),
        )?;
        gauge(
            &mut e,
            "disk_pending_reads",
            "Disk reads in flight",
            sum(&|r| r.store.pending_reads as u64) as f64,
        )?;
        gauge(
            &mut e,
            "disk_segments",
            "Layers: live segment files, restored ones included (compaction merges more at once past 3 x compaction_trigger)",
            sum(&|r| r.store.segments as u64) as f64,
        )?;
        let live = sum(&|r| r.store.segment_bytes);
        gauge(
            &mut e,
            "disk_space_amplification",
            "Bytes under data_dir per byte of live layers: what retained checkpoints pin, superseded files not yet deleted, registry and markers (1 = nothing but the live state)",
            // The directory and the shards' counts are read at different
            // instants (a compaction between them moves bytes): never
            // below the live state itself.
            if live == 0 {
                1.0
            } else {
                (self.data_dir_bytes as f64 / live as f64).max(1.0)
            },
        )?;
        gauge(
            &mut e,
            "disk_segment_bytes",
            "Bytes of live segment files",
            sum(&|r| r.store.segment_bytes) as f64,
        )?;
        gauge(
            &mut e,
            "disk_used_bytes",
            "Bytes of every file under data_dir (segments that checkpoints keep included)",
            self.data_dir_bytes as f64,
        )?;
        gauge(
            &mut e,
            "torn_files",
            "Torn segment files kept at the last start because a checkpoint or restored layer names them (*.torn)",
            sum(&|r| r.store.torn_kept as u64) as f64,
        )?;
        counter(
            &mut e,
            "torn_files_removed",
            "Torn segment files nothing named, deleted at the last start (a flush or compaction cut off by a crash)",
            sum(&|r| r.store.torn_removed as u64),
        )?;
        counter(
            &mut e,
            "flushes",
            "Memtables written as segments",
            sum(&|r| r.store.flushes),
        )?;
        counter(
            &mut e,
            "compactions",
            "Compactions completed",
            sum(&|r| r.store.compactions),
        )?;
        {
            let mut m = e.encode_descriptor(
                "write_stalls",
                "Times a shard stopped taking writes because its memtables held all the memory planned for them, by cause: flush (memtables waiting for their flush) or clearing (flushed memtables waiting for the helper thread that clears them)",
                None,
                MetricType::Counter,
            )?;
            for c in StallCause::ALL {
                let n = sum(&|r| r.store.write_stalls_by_cause[c.index()].0);
                m.encode_family(&[("cause", c.name())])?
                    .encode_counter::<NoLabelSet, _, u64>(&n, None)?;
            }
        }
        {
            let mut m = e.encode_descriptor(
                "write_stall_seconds",
                "Seconds shards spent with writes stalled (see write_stalls), by cause",
                None,
                MetricType::Gauge,
            )?;
            for c in StallCause::ALL {
                let ms = sum(&|r| r.store.write_stalls_by_cause[c.index()].1.as_millis() as u64);
                m.encode_family(&[("cause", c.name())])?
                    .encode_gauge(&(ms as f64 / 1000.0))?;
            }
        }
        gauge(
            &mut e,
            "checkpoints_retained",
            "Checkpoint manifests retained",
            sum(&|r| r.store.checkpoints_retained as u64) as f64,
        )?;
        gauge(
            &mut e,
            "checkpoints_in_progress",
            "Checkpoints taken and not yet durable",
            sum(&|r| r.store.checkpoints_in_progress as u64) as f64,
        )?;
        {
            let mut m = e.encode_descriptor(
                "shard_up",
                "1 while the shard loop moves, 0 once it has stood still for 5 s",
                None,
                MetricType::Gauge,
            )?;
            for i in 0..self.shards.len() {
                let up = u64::from(!self.stuck.iter().any(|s| s.0 == i));
                m.encode_family(&[("shard", i.to_string())])?
                    .encode_gauge(&up)?;
            }
        }
        self.encode_remote(&mut e)?;
        gauge(
            &mut e,
            "background_errors",
            "Shards whose last flush or compaction failed",
            self.shards
                .iter()
                .filter(|(r, _)| r.store.last_background_error.is_some())
                .count() as f64,
        )?;
        counter(
            &mut e,
            "background_failures",
            "Flush and compaction failures since start, retried or not",
            self.shards
                .iter()
                .map(|(r, _)| r.store.background_failures)
                .sum(),
        )?;
        counter(
            &mut e,
            "delete_failures",
            "Files no longer needed that could not be deleted since start",
            self.shards
                .iter()
                .map(|(r, _)| r.store.delete_failures)
                .sum(),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
    use std::sync::{Mutex, RwLock};

    use crate::config::Config;
    use crate::control::Registry;
    use crate::shard::{Live, ShardHandle};

    fn ctx(dir: &Path) -> Ctx {
        let (tx, _rx) = crossbeam_channel::unbounded();
        let registry = Registry::open(dir).unwrap();
        Ctx {
            cfg: RwLock::new(Arc::new(Config::default())),
            shards: vec![ShardHandle {
                tx,
                bell: Arc::new(stator_ring::Doorbell::new().unwrap()),
                live: Arc::new(Live::default()),
            }],
            registry_view: registry.view(),
            registry: Arc::new(Mutex::new(registry)),
            stopping: AtomicBool::new(false),
            sessions: AtomicUsize::new(0),
            jobs_dropped: AtomicU64::new(0),
            next_session: AtomicU64::new(1),
            connections: AtomicUsize::new(0),
            per_uid: Default::default(),
            conns_per_uid: Default::default(),
        }
    }

    fn get(ctx: &Ctx, beats: &Beats, path: &str, allowed: bool) -> (StatusCode, String) {
        let req = Request::get(path).body(()).unwrap();
        let g = Gathered::now(ctx, beats, Instant::now());
        let r = route(&req, ctx, beats, Some(g), allowed, Some(4242));
        let code = r.status();
        let body = futures_body(r);
        (code, body)
    }

    fn futures_body(r: Response<Full<Bytes>>) -> String {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let b = rt.block_on(http_body_util::BodyExt::collect(r.into_body()));
        String::from_utf8(b.unwrap().to_bytes().to_vec()).unwrap()
    }

    #[test]
    fn healthz_names_a_stuck_shard_and_stopping_and_strangers_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let c = ctx(d.path());
        let b = Beats::default();
        assert_eq!(
            get(&c, &b, "/healthz", true),
            (StatusCode::OK, "ok\n".into())
        );
        // The loop's beat has not moved since longer than STUCK_AFTER.
        b.0.lock().unwrap()[0].1 = Instant::now() - STUCK_AFTER - Duration::from_secs(1);
        let (code, body) = get(&c, &b, "/healthz", true);
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("shard 0 has not moved"), "{body}");
        let (_, m) = get(&c, &b, "/metrics", true);
        assert!(m.contains("stator_shard_up{shard=\"0\"} 0"), "{m}");
        assert!(
            m.contains("stator_shard_turn_duration_seconds_count 0"),
            "{m}"
        );
        // Write stalls are reported by cause (none yet).
        for cause in ["flush", "clearing"] {
            assert!(
                m.contains(&format!("stator_write_stalls_total{{cause=\"{cause}\"}} 0")),
                "{m}"
            );
            assert!(
                m.contains(&format!(
                    "stator_write_stall_seconds{{cause=\"{cause}\"}} 0"
                )),
                "{m}"
            );
        }
        // It moves again: healthy.
        c.shards[0].live.beat.store(7, Ordering::Relaxed);
        assert_eq!(get(&c, &b, "/healthz", true).0, StatusCode::OK);
        c.stopping.store(true, Ordering::Release);
        assert_eq!(
            get(&c, &b, "/healthz", true),
            (StatusCode::SERVICE_UNAVAILABLE, "stopping\n".into())
        );
        let (code, body) = get(&c, &b, "/status", false);
        assert_eq!(code, StatusCode::FORBIDDEN);
        assert!(body.contains("uid 4242"), "{body}");
    }

    #[test]
    fn hex_round_trips_and_refuses_junk() {
        let b = [0u8, 1, 0xab, 0xff];
        assert_eq!(hex(&b), "0001abff");
        assert_eq!(unhex("0001ABff").unwrap(), b);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
        assert!(unhex("é1").is_none());
    }
}
