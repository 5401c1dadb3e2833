//! `stator-bench serve`: a load generator against a real `statord`
//! process (this binary re-executed as `__statord`, which runs the daemon's
//! library exactly as the `statord` binary does), and, in the same run,
//! the in-process store (no IPC) and an in-process hashbrown map on the
//! same data.
//!
//! Cases: load; random gets over an in-flight sweep (1 ... 65,536); a
//! get/put mix; the daemon's idle CPU. Each session is a client thread
//! pinned to core 0 (the daemon to core 1) when the machine has two cores
//! or more. The sweep is also drawn as an SVG in `benches/results/`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::json;
use slab::Slab;
use stator_client::{Kind, OpenOptions, Session, Status, ValueState};
use stator_store::io::UringIo;
use stator_store::{Op, Store};

use crate::c_abi::{CSession, Submitted};
use crate::report::{Bound, Case, Reporter, histogram, thread_cpu};
use crate::store::{Rng, batched_gets, map_peer, single_gets, skey, value};

const SUITE: &str = "serve";
const MAX_PARALLELISM: u64 = 128;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Under a minute: fewer keys, a shorter sweep.
    #[arg(long)]
    quick: bool,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
    /// Keys loaded (default 5 M; 500 K with --quick).
    #[arg(long)]
    keys: Option<u64>,
    /// Value size in bytes.
    #[arg(long, default_value_t = 100)]
    value_bytes: usize,
    /// Sessions (client threads) at once.
    #[arg(long, default_value_t = 1)]
    sessions: u32,
    /// Seconds per point of the sweep (default 3; 1 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Percent of puts in the sweep (the rest are gets).
    #[arg(long, default_value_t = 0)]
    put_percent: u64,
    /// In-flight depths to sweep (comma-separated).
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<usize>>,
    /// The daemon's idle spin before it sleeps, microseconds.
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Skip the in-process peers.
    #[arg(long)]
    no_peers: bool,
    /// Skip the C ABI client (each sweep point runs the Rust client, then
    /// the same workload through libstator's C functions).
    #[arg(long)]
    no_c_abi: bool,
    /// Where the SVG of the sweep goes.
    #[arg(long, default_value = "benches/results")]
    plot_dir: PathBuf,
    /// Also gets at depth 256 on every session but the first while the
    /// first puts at depth 1,024, at once (needs --sessions 2 or more):
    /// what a writer at full speed costs its shard's readers.
    #[arg(long)]
    beside_writer: bool,
    /// Also report every window of this many milliseconds of each daemon
    /// point (cases `t=<end>s`, with `of` naming the point): latency over
    /// time, for one depth at a time (`benches/plot-load.py` plots them).
    #[arg(long)]
    window_ms: Option<u64>,
    /// Start statord with `prefault_memory = false` (its memtables' memory
    /// faulted in as writes first reach it, not at start as by default).
    #[arg(long)]
    no_prefault_memory: bool,
}

/// Arguments of the hidden daemon process.
#[derive(clap::Args, Debug)]
pub struct DaemonArgs {
    dir: PathBuf,
    #[arg(long)]
    budget_mib: u64,
    #[arg(long)]
    memtable_mib: u64,
    #[arg(long)]
    spin_us: u64,
    #[arg(long)]
    cpu: Option<usize>,
    #[arg(long)]
    no_prefault_memory: bool,
}

/// Adds the shard's turns between two reads of
/// [`DaemonProc::shard_turns`] to a case: the p99 and the longest turn
/// (bucket upper bounds, powers of two), in microseconds. A stall of the
/// daemon shows here; a client's own scheduling does not.
fn with_turns(c: Case, before: &[(f64, u64)], after: &[(f64, u64)]) -> Case {
    let count = |v: &[(f64, u64)], i: usize| v.get(i).map_or(0, |b| b.1);
    let total = count(after, after.len().wrapping_sub(1))
        .saturating_sub(count(before, before.len().wrapping_sub(1)));
    if after.is_empty() || before.len() != after.len() || total == 0 {
        return c;
    }
    let at = |q: f64| {
        let want = ((total as f64) * q).ceil() as u64;
        let i = (0..after.len())
            .find(|&i| count(after, i).saturating_sub(count(before, i)) >= want)
            .unwrap_or(after.len() - 1);
        (after[i].0 * 1e6).round()
    };
    c.with("shard_turn_p99_us", at(0.99))
        .with("shard_turn_max_us", at(1.0))
}

pub(crate) fn pin(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The daemon process: runs until SIGTERM.
pub fn daemon_main(a: DaemonArgs) {
    if let Some(c) = a.cpu {
        pin(c);
    }
    let mut cfg = statord::config::Config {
        data_dir: a.dir.join("data"),
        run_dir: a.dir.join("run"),
        shards: 1,
        memory_budget_mib: a.budget_mib,
        memtable_mib: a.memtable_mib,
        spin_us: a.spin_us,
        ..Default::default()
    };
    if a.no_prefault_memory {
        cfg.prefault_memory = false;
    }
    cfg.session.max_entries = 1 << 17;
    let cfg = cfg.resolve().expect("daemon config");
    let mut sigs = nix::sys::signal::SigSet::empty();
    sigs.add(nix::sys::signal::Signal::SIGTERM);
    sigs.thread_block().expect("block SIGTERM");
    let d = statord::Daemon::start(cfg).expect("start statord");
    let _ = sigs.wait();
    d.stop();
}

pub(crate) struct DaemonProc {
    pub(crate) child: Child,
    pub(crate) socket: PathBuf,
}

impl DaemonProc {
    pub(crate) fn start(
        dir: &Path,
        budget_mib: u64,
        memtable_mib: u64,
        spin_us: u64,
        prefault_memory: bool,
    ) -> DaemonProc {
        let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
        cmd.arg("__statord")
            .arg(dir)
            .args(["--budget-mib", &budget_mib.to_string()])
            .args(["--memtable-mib", &memtable_mib.to_string()])
            .args(["--spin-us", &spin_us.to_string()])
            .args((!prefault_memory).then_some("--no-prefault-memory"))
            .env("STATOR_LOG", "warn");
        if cores() >= 2 {
            cmd.args(["--cpu", "1"]);
        }
        let child = cmd.spawn().expect("spawn the daemon");
        let socket = dir.join("run/stator.sock");
        let t = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "statord did not come up"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        DaemonProc { child, socket }
    }

    /// The daemon's `stator_shard_turn_duration_seconds` histogram from
    /// its status socket: (upper bound in seconds, cumulative count) per
    /// bucket; empty if it could not be read.
    pub(crate) fn shard_turns(&self) -> Vec<(f64, u64)> {
        use std::io::{Read, Write};
        let read = || -> std::io::Result<String> {
            let mut c =
                std::os::unix::net::UnixStream::connect(self.socket.with_file_name("status.sock"))?;
            c.write_all(b"GET /metrics HTTP/1.1\r\nHost: statord\r\nConnection: close\r\n\r\n")?;
            let mut body = String::new();
            c.read_to_string(&mut body)?;
            Ok(body)
        };
        let Ok(body) = read() else {
            return Vec::new();
        };
        body.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("stator_shard_turn_duration_seconds_bucket{le=\"")?;
                let (le, count) = rest.split_once("\"} ")?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, count.trim().parse().ok()?))
            })
            .collect()
    }

    /// User + system CPU seconds the daemon has used.
    pub(crate) fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.child.id())).unwrap_or_default();
        let f: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        let ticks: f64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0.0)
            + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        // SAFETY: sysconf has no memory-safety preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        ticks / hz
    }
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn key(i: u64) -> ([u8; 8], u16) {
    (i.to_be_bytes(), (i % MAX_PARALLELISM) as u16)
}

pub(crate) fn open(socket: &Path, subtask: u32, sessions: u32) -> (Session, ValueState) {
    let mut o = OpenOptions::new("bench", "serve");
    o.subtask = subtask;
    o.parallelism = sessions;
    o.max_parallelism = MAX_PARALLELISM as u32;
    o.sq_entries = 1 << 16;
    o.cq_entries = 1 << 16;
    o.arena_bytes = 256 << 20;
    o.read_capacity = 256;
    let mut s = Session::open(socket, &o).expect("open session");
    let st = ValueState(s.register("values", Kind::Value).expect("register"));
    (s, st)
}

/// What one closed-loop run measured.
struct Run {
    ops: u64,
    elapsed: Duration,
    hist: hdrhistogram::Histogram<u64>,
    errors: u64,
    /// CPU time of the client thread(s).
    cpu: Duration,
    /// With `Point::window`: each window's completions and latencies, in
    /// order from the start.
    windows: Vec<(u64, hdrhistogram::Histogram<u64>)>,
}

impl Run {
    /// Adds a run of the same point that came after this one (ops and time
    /// add up, its windows follow).
    fn merge(&mut self, o: Run) {
        self.ops += o.ops;
        self.elapsed += o.elapsed;
        self.hist.add(&o.hist).expect("same bounds");
        self.errors += o.errors;
        self.cpu += o.cpu;
        self.windows.extend(o.windows);
    }

    /// Adds a run of the same point that ran at the same time (counts add
    /// up, window by window; the time is the longer).
    fn merge_at_once(&mut self, mut o: Run) {
        let elapsed = self.elapsed.max(o.elapsed);
        let theirs = std::mem::take(&mut o.windows);
        if self.windows.len() < theirs.len() {
            self.windows.resize_with(theirs.len(), || (0, histogram()));
        }
        for ((n, h), (m, g)) in self.windows.iter_mut().zip(theirs) {
            *n += m;
            h.add(&g).expect("same bounds");
        }
        self.merge(o);
        self.elapsed = elapsed;
    }

    /// Its windows as cases `t=<end>s` of point `of`.
    fn window_cases(&self, of: &str, window: Duration) -> Vec<Case> {
        self.windows
            .iter()
            .enumerate()
            .map(|(i, (n, h))| {
                let t = (i + 1) as f64 * window.as_secs_f64();
                Case::new(SUITE, format!("t={t:.3}s"), *n, window)
                    .latency(h.clone())
                    .with("of", of)
            })
            .collect()
    }

    /// Client CPU nanoseconds per completed request.
    fn cpu_ns_per_op(&self) -> f64 {
        self.cpu.as_nanos() as f64 / self.ops.max(1) as f64
    }
}

/// One point of a closed-loop run: `depth` requests in flight for `dur`;
/// of random loaded keys, `put_percent` of them puts of `value`, the rest
/// gets.
struct Point<'a> {
    depth: usize,
    dur: Duration,
    put_percent: u64,
    value: &'a [u8],
    seed: u64,
    /// Also keep each window of this length apart.
    window: Option<Duration>,
}

/// A client the closed loop drives: the Rust client, or the C ABI.
trait Client {
    /// Queues a get of `key`, or a put of `value`; `false` when full.
    fn submit(&mut self, kg: u16, key: &[u8], value: Option<&[u8]>, token: u64) -> bool;
    fn flush(&mut self);
    /// Hands each ready completion's token and success to `f`; how many.
    fn poll(&mut self, f: impl FnMut(u64, bool)) -> usize;
    fn wait(&mut self);
}

impl Client for (&mut Session, ValueState) {
    fn submit(&mut self, kg: u16, key: &[u8], value: Option<&[u8]>, token: u64) -> bool {
        let r = match value {
            Some(v) => self.1.put(kg, key, v),
            None => self.1.get(kg, key),
        };
        match self.0.submit(&r, token) {
            Ok(()) => true,
            Err(stator_client::Error::Full) => false,
            Err(e) => panic!("submit: {e}"),
        }
    }
    fn flush(&mut self) {
        self.0.flush().expect("flush");
    }
    fn poll(&mut self, mut f: impl FnMut(u64, bool)) -> usize {
        self.0
            .poll(|c| f(c.token, c.status == Ok(Status::Ok)))
            .expect("poll")
    }
    fn wait(&mut self) {
        self.0.wait(Some(Duration::from_millis(10))).expect("wait");
    }
}

/// The C ABI client with its state id and a completion batch.
struct CClient<'a> {
    s: &'a mut CSession,
    st: u32,
    batch: Vec<stator::stator_completion>,
    scratch: Vec<u8>,
}

// SAFETY: the session moves with its one user (see CSession); the batch's
// value pointers are plain data, read only by the thread that reaped them.
unsafe impl Send for CClient<'_> {}

impl Client for CClient<'_> {
    fn submit(&mut self, kg: u16, key: &[u8], value: Option<&[u8]>, token: u64) -> bool {
        matches!(self.s.submit(self.st, kg, key, value, token), Submitted::Ok)
    }
    fn flush(&mut self) {
        self.s.flush();
    }
    fn poll(&mut self, mut f: impl FnMut(u64, bool)) -> usize {
        let mut n = 0;
        loop {
            let got = self.s.reap(&mut self.batch);
            for c in got {
                // Read the value out, as the Rust client's poll copies it.
                if !c.value.is_null() {
                    // SAFETY: a reaped result: `value_len` readable bytes,
                    // valid until the next reap.
                    let v = unsafe { std::slice::from_raw_parts(c.value, c.value_len as usize) };
                    self.scratch.clear();
                    self.scratch.extend_from_slice(v);
                }
                f(c.user_data, c.status == stator::STATOR_OK);
            }
            n += got.len();
            if got.len() < self.batch.len() {
                return n;
            }
        }
    }
    fn wait(&mut self) {
        self.s.wait(10);
    }
}

/// Runs `point(i)` on every client at once (a thread each, pinned like
/// the load), client `i` over `keys[i]`; the runs merged.
fn on_every_session<'v, C: Client + Send>(
    clients: &mut [C],
    keys: &[&[u64]],
    point: impl Fn(usize) -> Point<'v> + Sync,
) -> Run {
    let runs: Vec<Run> = std::thread::scope(|sc| {
        let hs: Vec<_> = clients
            .iter_mut()
            .enumerate()
            .map(|(i, c)| {
                let (mine, p) = (keys[i], point(i));
                sc.spawn(move || {
                    if cores() >= 2 {
                        pin(0);
                    }
                    closed_loop(c, mine, p)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    // The clients ran at once: counts add up, the time is the longest.
    let mut runs = runs.into_iter();
    let mut all = runs.next().expect("one client at least");
    for x in runs {
        all.merge_at_once(x);
    }
    all
}

fn closed_loop(c: &mut impl Client, keys: &[u64], p: Point<'_>) -> Run {
    let Point {
        depth,
        dur,
        put_percent,
        value: v,
        seed,
        window,
    } = p;
    let mut rng = Rng(seed);
    let mut hist = histogram();
    let mut windows = Vec::new();
    let mut win = (0u64, histogram());
    let mut started: Slab<Instant> = Slab::with_capacity(depth);
    let (mut ops, mut errors) = (0u64, 0u64);
    let cpu0 = thread_cpu();
    let t = Instant::now();
    let end = t + dur;
    let mut now = t;
    let mut win_end = window.map(|w| t + w);
    while now < end {
        while started.len() < depth {
            let i = keys[rng.below(keys.len() as u64) as usize];
            let (k, kg) = key(i);
            let put = put_percent > 0 && rng.below(100) < put_percent;
            let slot = started.vacant_key();
            if !c.submit(kg, &k, put.then_some(v), slot as u64) {
                break;
            }
            started.insert(Instant::now());
        }
        c.flush();
        let got = c.poll(|token, ok| {
            let t0 = started.remove(token as usize);
            let ns = t0.elapsed().as_nanos().max(1) as u64;
            hist.record(ns).expect("in range");
            if win_end.is_some() {
                win.1.record(ns).expect("in range");
            }
            if !ok {
                errors += 1;
            }
        });
        ops += got as u64;
        win.0 += got as u64;
        if got == 0 {
            c.wait();
        }
        now = Instant::now();
        if let (Some(e), Some(w)) = (win_end.as_mut(), window)
            && now >= *e
        {
            windows.push(std::mem::replace(&mut win, (0, histogram())));
            *e += w;
        }
    }
    let elapsed = t.elapsed();
    let cpu = thread_cpu().saturating_sub(cpu0);
    // Drain what is in flight (not counted).
    while !started.is_empty() {
        c.poll(|token, _| {
            started.remove(token as usize);
        });
        if !started.is_empty() {
            c.wait();
        }
    }
    Run {
        ops,
        elapsed,
        hist,
        errors,
        cpu,
        windows,
    }
}

pub fn run(a: ServeArgs) {
    let n = a.keys.unwrap_or(if a.quick { 500_000 } else { 5_000_000 });
    let secs = a.seconds.unwrap_or(if a.quick { 1.0 } else { 3.0 });
    let depths = a.depths.clone().unwrap_or_else(|| {
        if a.quick {
            vec![1, 16, 256, 4096, 65536]
        } else {
            vec![1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]
        }
    });
    let dur = Duration::from_secs_f64(secs);
    let window = a.window_ms.map(|ms| Duration::from_millis(ms.max(1)));
    // Everything in memory: the memtable holds the whole load.
    let memtable_mib = ((n * (a.value_bytes as u64 + 64)) >> 20).max(64) * 2;
    let budget_mib = memtable_mib * 3;
    let mut r = Reporter::new(a.json);
    r.machine(
        SUITE,
        json!({"keys": n, "value_bytes": a.value_bytes, "sessions": a.sessions, "put_percent": a.put_percent,
               "seconds_per_point": secs, "depths": depths, "daemon_spin_us": a.spin_us,
               "budget_mib": budget_mib, "memtable_mib": memtable_mib, "quick": a.quick,
               "prefault_memory": !a.no_prefault_memory,
               "pinned": cores() >= 2}),
    );
    let dir = tempfile::Builder::new()
        .prefix("stator-serve-")
        .tempdir_in(
            std::env::var_os("STATOR_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from),
        )
        .expect("bench dir");
    let vals: Vec<Vec<u8>> = (0..256).map(|i| value(i, a.value_bytes)).collect();
    let d = DaemonProc::start(
        dir.path(),
        budget_mib,
        memtable_mib,
        a.spin_us,
        !a.no_prefault_memory,
    );
    if cores() >= 2 {
        pin(0);
    }

    // Load, through the daemon, each session its own key groups.
    let sessions = a.sessions.max(1);
    let mut conns: Vec<(Session, ValueState, Vec<u64>)> = (0..sessions)
        .map(|i| {
            let (s, st) = open(&d.socket, i, sessions);
            let (lo, hi) = s.key_groups();
            let mine: Vec<u64> = (0..n)
                .filter(|k| (lo..=hi).contains(&((k % MAX_PARALLELISM) as u16)))
                .collect();
            (s, st, mine)
        })
        .collect();
    let t = Instant::now();
    for (s, st, mine) in conns.iter_mut() {
        let mut inflight = 0usize;
        for &i in mine.iter() {
            let (k, kg) = key(i);
            loop {
                match s.submit(&st.put(kg, &k, &vals[(i % 256) as usize]), i) {
                    Ok(()) => break,
                    Err(stator_client::Error::Full) => {
                        s.flush().expect("flush");
                        let got = s
                            .poll(|c| assert_eq!(c.status, Ok(Status::Ok), "load put failed"))
                            .expect("poll");
                        inflight -= got;
                        if got == 0 {
                            s.wait(Some(Duration::from_millis(10))).expect("wait");
                        }
                    }
                    Err(e) => panic!("load: {e}"),
                }
            }
            inflight += 1;
        }
        s.flush().expect("flush");
        while inflight > 0 {
            inflight -= s
                .poll(|c| assert_eq!(c.status, Ok(Status::Ok)))
                .expect("poll");
            if inflight > 0 {
                s.wait(Some(Duration::from_millis(10))).expect("wait");
            }
        }
    }
    r.case(&Case::new(SUITE, "load_daemon", n, t.elapsed()).with("sessions", sessions));

    // Idle: sessions open, nothing submitted.
    std::thread::sleep(Duration::from_millis(200));
    let (c0, t0) = (d.cpu_seconds(), Instant::now());
    std::thread::sleep(Duration::from_secs(if a.quick { 1 } else { 3 }));
    let idle = (d.cpu_seconds() - c0) / t0.elapsed().as_secs_f64() * 100.0;
    r.note(SUITE, "daemon_idle_cpu_percent", idle, Bound::AtMost(1.0));

    // The in-flight sweep of random gets: at each depth the Rust client,
    // then the same sessions' subtasks through the C ABI (a second
    // session of each subtask, on the same data), back to back.
    let mut cabi: Vec<(CSession, u32)> = if a.no_c_abi {
        Vec::new()
    } else {
        (0..sessions)
            .map(|i| CSession::open(&d.socket, "bench", "serve", i, sessions))
            .collect()
    };
    let mut sweep = Vec::new();
    let put_percent = a.put_percent.min(100);
    for &depth in &depths {
        let per = depth.div_ceil(sessions as usize).max(1);
        // With the C ABI, the point is cut into slices that alternate
        // Rust, C, C, Rust, ... (each client gets the same time), so that
        // drift and the daemon's background stalls favour neither.
        let slices: u32 = if cabi.is_empty() {
            1
        } else if a.quick {
            2
        } else {
            6
        };
        let v: &[u8] = &vals[7];
        // (Windows of a point cut into slices would interleave clients.)
        let window = window.filter(|_| slices == 1);
        let point = |round: u32| {
            move |i: usize| Point {
                depth: per,
                dur: dur / slices,
                put_percent,
                value: v,
                seed: 1000 + depth as u64 + i as u64 + 7919 * round as u64,
                window,
            }
        };
        let (mut rust, keys): (Vec<(&mut Session, ValueState)>, Vec<&[u64]>) = conns
            .iter_mut()
            .map(|(s, st, mine)| ((s, *st), &mine[..]))
            .unzip();
        let mut cc: Vec<CClient<'_>> = cabi
            .iter_mut()
            .map(|(s, st)| CClient {
                s,
                st: *st,
                batch: vec![crate::c_abi::completion(); 1024],
                scratch: Vec::new(),
            })
            .collect();
        let turns0 = d.shard_turns();
        let (mut x, mut y): (Option<Run>, Option<Run>) = (None, None);
        let add = |acc: &mut Option<Run>, r: Run| match acc {
            Some(a) => a.merge(r),
            None => *acc = Some(r),
        };
        for round in 0..slices {
            let c_first = round % 2 == 1;
            if c_first {
                add(&mut y, on_every_session(&mut cc, &keys, point(round)));
            }
            add(&mut x, on_every_session(&mut rust, &keys, point(round)));
            if !c_first && !cc.is_empty() {
                add(&mut y, on_every_session(&mut cc, &keys, point(round)));
            }
        }
        let x = x.expect("one slice at least");
        assert_eq!(x.errors, 0, "gets failed at depth {depth}");
        let name = if put_percent > 0 {
            format!("get_put{put_percent}_depth{depth}_daemon")
        } else {
            format!("get_depth{depth}_daemon")
        };
        let rust_cpu = x.cpu_ns_per_op();
        let windows = window.map(|w| x.window_cases(&name, w));
        // (The shard's turns over the point: both clients' slices.)
        let c = Case::new(SUITE, name, x.ops, x.elapsed)
            .latency(x.hist)
            .with("in_flight", depth)
            .with("sessions", sessions)
            .with("client", "rust")
            .with("client_cpu_ns_per_op", rust_cpu.round());
        let c = with_turns(c, &turns0, &d.shard_turns());
        r.case(&c);
        for w in windows.iter().flatten() {
            r.case(w);
        }
        if let Some(y) = y {
            assert_eq!(
                y.errors, 0,
                "gets through the C ABI failed at depth {depth}"
            );
            let ratio = y.ops as f64 / y.elapsed.as_secs_f64() / c.ops_per_sec;
            let c_cpu = y.cpu_ns_per_op();
            let cname = c.case.replace("_daemon", "_c_abi");
            r.case(
                &Case::new(SUITE, cname, y.ops, y.elapsed)
                    .latency(y.hist)
                    .with("in_flight", depth)
                    .with("sessions", sessions)
                    .with("client", "c")
                    .with("client_cpu_ns_per_op", c_cpu.round())
                    .with("vs_rust", (ratio * 1000.0).round() / 1000.0),
            );
            // The ABI's cost: at most 10% of the Rust client's rate.
            r.note(
                SUITE,
                &format!("c_abi_vs_rust_depth{depth}"),
                ratio,
                Bound::AtLeast(0.9),
            );
        }
        sweep.push(c);
    }
    drop(cabi);

    // A 50/50 get/put mix at depth 256 on the first session.
    {
        let (s, st, mine) = &mut conns[0];
        let p = Point {
            depth: 256,
            dur,
            put_percent: 50,
            value: &vals[9],
            seed: 77,
            window,
        };
        let turns0 = d.shard_turns();
        let x = closed_loop(&mut (s, *st), mine, p);
        assert_eq!(x.errors, 0);
        let name = "get_put_50_50_depth256_daemon";
        let windows = window.map(|w| x.window_cases(name, w));
        let c = Case::new(SUITE, name, x.ops, x.elapsed).latency(x.hist);
        r.case(&with_turns(c, &turns0, &d.shard_turns()));
        for w in windows.iter().flatten() {
            r.case(w);
        }
    }
    if a.beside_writer && conns.len() >= 2 {
        gets_beside_a_writer(&mut r, &d, &mut conns, (dur, window), &vals[11]);
    }
    drop(conns);
    drop(d);

    let best_deep = sweep
        .iter()
        .filter(|c| {
            c.extra
                .get("in_flight")
                .and_then(|v| v.as_u64())
                .unwrap_or(0)
                >= 256
        })
        .map(|c| c.ops_per_sec)
        .fold(0.0, f64::max);
    if let Some(d1) = sweep
        .iter()
        .find(|c| c.extra.get("in_flight").and_then(|v| v.as_u64()) == Some(1))
        && let Some(p50) = d1.p(0.5)
    {
        r.note(
            SUITE,
            "depth1_round_trip_p50_us",
            p50 as f64 / 1000.0,
            Bound::AtMost(5.0),
        );
    }
    if let Err(e) = plot(&a.plot_dir, &sweep) {
        if !r.json {
            println!("  (no plot: {e})");
        }
    } else if !r.json {
        println!(
            "# plot: {}",
            a.plot_dir.join("serve-inflight.svg").display()
        );
    }

    if a.no_peers {
        return;
    }
    // The in-process store, same configuration, no IPC.
    let (store_one, store_batch) =
        in_process_store(&mut r, dir.path(), n, budget_mib, memtable_mib, &vals);
    let hashbrown =
        map_peer::<hashbrown::HashMap<[u8; 16], Vec<u8>>>(SUITE, &mut r, n, "hashbrown", &vals);
    let _ = store_one;
    if !r.json {
        println!("# floors (best daemon get rate at depth >= 256: {best_deep:.0}/s)");
    }
    r.note(
        SUITE,
        "get_daemon_deep_vs_hashbrown_one_at_a_time",
        best_deep / hashbrown,
        Bound::AtLeast(1.0),
    );
    r.note(
        SUITE,
        "get_daemon_deep_vs_inprocess_store_batched",
        best_deep / store_batch,
        Bound::AtLeast(0.5),
    );
}

/// Gets at depth 256 on every session but the first while the first
/// puts at depth 1,024, all at once for `dur`: the readers' latency (one
/// case, their runs merged) beside the writer's rate.
fn gets_beside_a_writer(
    r: &mut Reporter,
    d: &DaemonProc,
    conns: &mut [(Session, ValueState, Vec<u64>)],
    (dur, window): (Duration, Option<Duration>),
    value: &[u8],
) {
    let turns0 = d.shard_turns();
    let runs: Vec<Run> = std::thread::scope(|sc| {
        let hs: Vec<_> = conns
            .iter_mut()
            .enumerate()
            .map(|(i, (s, st, mine))| {
                let p = Point {
                    depth: if i == 0 { 1024 } else { 256 },
                    dur,
                    put_percent: if i == 0 { 100 } else { 0 },
                    value,
                    seed: 4242 + i as u64,
                    window,
                };
                sc.spawn(move || {
                    if cores() >= 2 {
                        pin(0);
                    }
                    closed_loop(&mut (s, *st), mine, p)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    let mut runs = runs.into_iter();
    let writer = runs.next().expect("the writer");
    let mut readers = runs.next().expect("a reader");
    for x in runs {
        readers.merge_at_once(x);
    }
    assert_eq!(writer.errors + readers.errors, 0, "beside a writer");
    let puts_per_sec = writer.ops as f64 / writer.elapsed.as_secs_f64();
    let name = "get_beside_writer_depth256_daemon";
    let windows = window.map(|w| readers.window_cases(name, w));
    let c = Case::new(SUITE, name, readers.ops, readers.elapsed)
        .latency(readers.hist)
        .with("in_flight", 256)
        .with("writer_puts_per_sec", puts_per_sec.round());
    r.case(&with_turns(c, &turns0, &d.shard_turns()));
    for w in windows.iter().flatten() {
        r.case(w);
    }
}

/// Loads the same keys into a `Store` in this process; gets one at a time
/// and in batches of 256. Returns both rates.
fn in_process_store(
    r: &mut Reporter,
    dir: &Path,
    n: u64,
    budget_mib: u64,
    memtable_mib: u64,
    vals: &[Vec<u8>],
) -> (f64, f64) {
    let mut cfg = stator_store::StoreConfig::new(dir.join("inproc"), (budget_mib << 20) as usize);
    cfg.memtable_bytes = Some((memtable_mib << 20) as usize);
    let (mut s, _) =
        Store::open(cfg, UringIo::new(256, true).expect("io_uring")).expect("open store");
    let mut kb = [0u8; 8];
    for i in 0..n {
        s.submit(0, Op::Put(skey(i, &mut kb), &vals[(i % 256) as usize]))
            .expect("put");
    }
    let one = single_gets(&mut s, SUITE, "get_inprocess_store", n, 5);
    r.case(&one);
    let b = batched_gets(&mut s, SUITE, "get_batch256_inprocess_store", n, 256, 6);
    r.case(&b);
    (one.ops_per_sec, b.ops_per_sec)
}

/// An SVG of throughput and p99 over the in-flight sweep (log x).
fn plot(dir: &Path, sweep: &[Case]) -> std::io::Result<()> {
    if sweep.len() < 2 {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    let (w, h, m) = (720.0, 400.0, 60.0);
    let depth = |c: &Case| {
        c.extra
            .get("in_flight")
            .and_then(|v| v.as_f64())
            .unwrap_or(1.0)
    };
    let xmax = sweep
        .iter()
        .map(depth)
        .fold(1.0f64, f64::max)
        .log2()
        .max(1.0);
    let ymax = sweep.iter().map(|c| c.ops_per_sec).fold(1.0, f64::max) * 1.1;
    let pmax = sweep.iter().filter_map(|c| c.p(0.99)).max().unwrap_or(1) as f64 * 1.1;
    let x = |c: &Case| m + depth(c).log2() / xmax * (w - 2.0 * m);
    let y = |v: f64, max: f64| h - m - v / max * (h - 2.0 * m);
    let line = |f: &dyn Fn(&Case) -> f64, max: f64| {
        sweep
            .iter()
            .map(|c| format!("{:.1},{:.1}", x(c), y(f(c), max)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{m}\" y=\"24\" font-size=\"15\">statord: random gets vs requests in flight (one session)</text>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n",
        b = h - m,
        r = w - m
    );
    s += &format!(
        "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"2\" points=\"{}\"/>\n",
        line(&|c| c.ops_per_sec, ymax)
    );
    s += &format!(
        "<polyline fill=\"none\" stroke=\"#d62728\" stroke-width=\"2\" stroke-dasharray=\"5,3\" points=\"{}\"/>\n",
        line(&|c| c.p(0.99).unwrap_or(0) as f64, pmax)
    );
    for c in sweep {
        s += &format!(
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"#1f77b4\">{:.2}M</text>\n",
            x(c),
            h - m + 16.0,
            depth(c),
            x(c),
            y(c.ops_per_sec, ymax) - 6.0,
            c.ops_per_sec / 1e6
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">requests in flight</text>\n\
         <text x=\"{m}\" y=\"{}\" fill=\"#1f77b4\">ops/s (solid, max {:.2}M)</text>\n\
         <text x=\"{}\" y=\"{}\" fill=\"#d62728\" text-anchor=\"end\">p99 latency (dashed, max {:.0} us)</text>\n</svg>\n",
        w / 2.0,
        h - 20.0,
        m - 10.0,
        ymax / 1.1 / 1e6,
        w - m,
        m - 10.0,
        pmax / 1.1 / 1000.0
    );
    std::fs::write(dir.join("serve-inflight.svg"), s)
}
