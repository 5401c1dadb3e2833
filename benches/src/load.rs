//! `stator-bench load`: the load test. N sessions of a real `statord`
//! (this binary re-executed as `__statord`, as the serve suite does), each
//! a client thread at full depth, a get/put mix over a key space larger
//! than the daemon's memory budget, for minutes. Every window (1 s) it
//! prints the window's throughput, latency percentiles and the daemon's
//! memory: its own (anonymous) memory against the budget, and the session
//! segments it shares with the clients. At the end: the whole run's
//! figures, the peak memory, and whether the daemon stayed within budget.
//!
//! The peer is the run itself over time: the first windows (empty store,
//! all in memory) against the last (flushes, compactions, a full cache).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use slab::Slab;
use stator_client::{Session, Status, ValueState};

use crate::report::{Case, Reporter, histogram};
use crate::serve::{DaemonProc, cores, key, open, pin};
use crate::store::{Rng, value};

const SUITE: &str = "load";

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// 20 seconds instead of the default length.
    #[arg(long)]
    quick: bool,
    /// One JSON object per window and for the whole run on stdout.
    #[arg(long)]
    json: bool,
    /// Seconds to run (default 180; 20 with --quick).
    #[arg(long)]
    seconds: Option<u64>,
    /// Sessions (client threads) at once.
    #[arg(long, default_value_t = 4)]
    sessions: u32,
    /// Requests in flight per session.
    #[arg(long, default_value_t = 4096)]
    depth: usize,
    /// Key space (default 8 M: ~1.4 GB of 100-byte values, several times
    /// the budget).
    #[arg(long)]
    keys: Option<u64>,
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Percent of puts (the rest are gets).
    #[arg(long, default_value_t = 50)]
    put_percent: u64,
    /// The daemon's memory budget.
    #[arg(long, default_value_t = 256)]
    budget_mib: u64,
    /// Window length, seconds.
    #[arg(long, default_value_t = 1.0)]
    window: f64,
    /// Exit 1 when the daemon's memory went over its budget + the allowed
    /// overhead (it is always reported as `within_budget`).
    #[arg(long)]
    strict: bool,
}

/// What the daemon's memory is, from `/proc/PID/status`, in bytes: its
/// own (anonymous) memory and the shared memory it maps (session
/// segments, which the clients' requests and results live in).
pub(crate) fn daemon_memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb << 10)
    };
    (field("RssAnon:"), field("RssShmem:"))
}

/// The daemon's own memory beyond its budget that is still expected:
/// code, thread stacks, io_uring rings, per-session bookkeeping.
pub(crate) const OVERHEAD_MIB: u64 = 64;

/// One window of one client.
struct Window {
    ops: u64,
    errors: u64,
    hist: hdrhistogram::Histogram<u64>,
}

fn client(
    s: &mut Session,
    st: ValueState,
    keys: &[u64],
    a: &LoadArgs,
    seed: u64,
    t0: Instant,
    stop: &AtomicBool,
) -> Vec<Window> {
    let vals: Vec<Vec<u8>> = (0..64).map(|i| value(i, a.value_bytes)).collect();
    let mut rng = Rng(seed);
    let mut started: Slab<Instant> = Slab::with_capacity(a.depth);
    let win = Duration::from_secs_f64(a.window);
    let mut windows = Vec::new();
    let mut cur = Window {
        ops: 0,
        errors: 0,
        hist: histogram(),
    };
    let mut next = t0 + win;
    while !stop.load(Ordering::Relaxed) {
        while started.len() < a.depth {
            let i = keys[rng.below(keys.len() as u64) as usize];
            let (k, kg) = key(i);
            let r = if rng.below(100) < a.put_percent {
                st.put(kg, &k, &vals[(i % 64) as usize])
            } else {
                st.get(kg, &k)
            };
            match s.submit(&r, started.vacant_key() as u64) {
                Ok(()) => {
                    started.insert(Instant::now());
                }
                Err(stator_client::Error::Full) => break,
                Err(e) => panic!("submit: {e}"),
            }
        }
        s.flush().expect("flush");
        let got = s
            .poll(|c| {
                let t = started.remove(c.token as usize);
                cur.hist
                    .record(t.elapsed().as_nanos().max(1) as u64)
                    .expect("in range");
                if !matches!(c.status, Ok(Status::Ok | Status::NotFound)) {
                    cur.errors += 1;
                }
            })
            .expect("poll");
        cur.ops += got as u64;
        if got == 0 {
            s.wait(Some(Duration::from_millis(10))).expect("wait");
        }
        if Instant::now() >= next {
            windows.push(std::mem::replace(
                &mut cur,
                Window {
                    ops: 0,
                    errors: 0,
                    hist: histogram(),
                },
            ));
            next += win;
        }
    }
    while !started.is_empty() {
        s.poll(|c| {
            started.remove(c.token as usize);
        })
        .expect("poll");
        if !started.is_empty() {
            s.wait(Some(Duration::from_millis(10))).expect("wait");
        }
    }
    windows
}

pub fn run(a: LoadArgs) {
    let secs = a.seconds.unwrap_or(if a.quick { 20 } else { 180 });
    let n = a.keys.unwrap_or(8_000_000);
    let memtable_mib = (a.budget_mib / 4).clamp(4, 256);
    let mut r = Reporter::new(a.json);
    r.machine(
        SUITE,
        json!({"seconds": secs, "sessions": a.sessions, "depth_per_session": a.depth, "keys": n,
               "value_bytes": a.value_bytes, "put_percent": a.put_percent,
               "budget_mib": a.budget_mib, "memtable_mib": memtable_mib, "window_s": a.window,
               "overhead_allowed_mib": OVERHEAD_MIB, "pinned": cores() >= 2}),
    );
    let dir = tempfile::Builder::new()
        .prefix("stator-load-")
        .tempdir_in(
            std::env::var_os("STATOR_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from),
        )
        .expect("bench dir");
    let d = DaemonProc::start(dir.path(), a.budget_mib, memtable_mib, 50, true);
    let pid = d.child.id();
    let sessions = a.sessions.max(1);
    let mut conns: Vec<(Session, ValueState, Vec<u64>)> = (0..sessions)
        .map(|i| {
            let (s, st) = open(&d.socket, i, sessions);
            let (lo, hi) = s.key_groups();
            let mine: Vec<u64> = (0..n).filter(|k| (lo..=hi).contains(&key(*k).1)).collect();
            (s, st, mine)
        })
        .collect();
    let stop = AtomicBool::new(false);
    let mut memory: Vec<(u64, u64)> = Vec::new();
    let t0 = Instant::now();
    let windows: Vec<Vec<Window>> = std::thread::scope(|sc| {
        let clients: Vec<_> = conns
            .iter_mut()
            .enumerate()
            .map(|(i, (s, st, mine))| {
                let (a, stop, st) = (&a, &stop, *st);
                sc.spawn(move || {
                    if cores() >= 2 {
                        pin(0);
                    }
                    client(s, st, mine, a, 0x5eed + i as u64, t0, stop)
                })
            })
            .collect();
        let win = Duration::from_secs_f64(a.window);
        let mut next = t0 + win;
        while t0.elapsed() < Duration::from_secs(secs) {
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            memory.push(daemon_memory(pid));
            next += win;
        }
        stop.store(true, Ordering::Relaxed);
        clients
            .into_iter()
            .map(|c| c.join().expect("client thread"))
            .collect()
    });
    let cpu = d.cpu_seconds();
    let count = windows.iter().map(Vec::len).min().unwrap_or(0);
    let mut total = histogram();
    let (mut ops, mut errors) = (0u64, 0u64);
    let (mut peak_anon, mut peak_shmem) = (0u64, 0u64);
    for w in 0..count {
        let mut h = histogram();
        let (mut wops, mut werr) = (0u64, 0u64);
        for c in &windows {
            h.add(&c[w].hist).expect("same bounds");
            wops += c[w].ops;
            werr += c[w].errors;
        }
        total.add(&h).expect("same bounds");
        ops += wops;
        errors += werr;
        let (anon, shmem) = memory.get(w).copied().unwrap_or_default();
        peak_anon = peak_anon.max(anon);
        peak_shmem = peak_shmem.max(shmem);
        let t = (w + 1) as f64 * a.window;
        r.case(
            &Case::new(
                SUITE,
                format!("t={t:.0}s"),
                wops,
                Duration::from_secs_f64(a.window),
            )
            .latency(h)
            .with("errors", werr)
            .with("daemon_anon_mib", anon >> 20)
            .with("daemon_shmem_mib", shmem >> 20),
        );
    }
    // The whole windows every client completed.
    let elapsed = Duration::from_secs_f64(count as f64 * a.window);
    let within = peak_anon <= (a.budget_mib + OVERHEAD_MIB) << 20;
    r.case(
        &Case::new(SUITE, "whole run", ops, elapsed)
            .latency(total)
            .with("errors", errors)
            .with("peak_daemon_anon_mib", peak_anon >> 20)
            .with("peak_daemon_shmem_mib", peak_shmem >> 20)
            .with("budget_mib", a.budget_mib)
            .with("within_budget", within)
            .with("daemon_cpu_s", (cpu * 10.0).round() / 10.0),
    );
    drop(conns);
    drop(d);
    if !within {
        eprintln!(
            "the daemon's own memory peaked at {} MiB: over its {} MiB budget + {OVERHEAD_MIB} MiB",
            peak_anon >> 20,
            a.budget_mib
        );
        if a.strict {
            std::process::exit(1);
        }
    }
}
