//! `stator-bench ring`: the session queues between two processes, against
//! a Unix-domain socket carrying the same 64-byte messages.
//!
//! Every case spawns a fresh peer process (this binary, `__ring-peer`) that
//! plays the daemon: it receives the memfd and doorbells over a Unix socket
//! with SCM_RIGHTS and echoes descriptors as completions. The client and the
//! peer are pinned to different cores when the machine has two or more.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use serde_json::json;
use stator_ring::doorbell::{Doorbell, WaitPolicy, Waited, wait_available, wait_space};
use stator_ring::header::{RingLayout, RingParams};
use stator_ring::session::{ClientRing, DaemonRing};
use stator_ring::{Cqe, Opcode, Sqe};
use stator_shm::Segment;
use stator_shm::fdpass::{recv_fds, send_fds};

use crate::report::{Bound, Case, Reporter, histogram};

const SUITE: &str = "ring";
/// `arg2` of a bench descriptor: the peer answers it.
const REPLY: u32 = 0;
/// `arg2`: the peer consumes it silently (one-way streaming).
const NO_REPLY: u32 = 1;
/// `arg2`: the peer answers with its count of out-of-order descriptors and exits.
const STOP: u32 = 2;

#[derive(clap::Args, Debug, Clone)]
pub struct RingArgs {
    /// Finish in well under a minute (fewer iterations).
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per case on stdout.
    #[arg(long)]
    pub json: bool,
    /// Spin bound of the spin-then-sleep waits, microseconds.
    #[arg(long, default_value_t = 50)]
    pub spin_us: u64,
    /// Do not pin the two processes to different cores.
    #[arg(long)]
    pub no_pin: bool,
}

#[derive(clap::Args, Debug, Clone)]
pub struct PeerArgs {
    pub sock: PathBuf,
    /// ring | uds-echo | uds-sink
    pub mode: String,
    #[arg(long, default_value_t = 50)]
    pub spin_us: u64,
    #[arg(long)]
    pub cpu: Option<usize>,
}

fn pin(cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        let mut set = nix::sched::CpuSet::new();
        if set.set(cpu).is_ok() {
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
        }
    }
}

fn nop(user_data: u64, arg2: u32) -> Sqe {
    Sqe {
        user_data,
        opcode: Opcode::Nop as u8,
        arg: user_data,
        arg2,
        ..Sqe::default()
    }
}

struct Peer {
    child: Child,
    sock: UnixStream,
    dir: PathBuf,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How the peer process runs.
#[derive(Clone, Copy)]
struct PeerOpts {
    spin_us: u64,
    pinned: bool,
}

fn spawn_peer(mode: &str, o: PeerOpts) -> Peer {
    let dir = std::env::temp_dir().join(format!("stator-bench-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create temp dir");
    let path = dir.join("peer.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).expect("bind peer socket");
    let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
    cmd.arg("__ring-peer")
        .arg(&path)
        .arg(mode)
        .arg("--spin-us")
        .arg(o.spin_us.to_string());
    if o.pinned {
        cmd.arg("--cpu").arg("1");
    }
    let child = cmd.spawn().expect("spawn peer");
    let (sock, _) = listener.accept().expect("peer connects");
    Peer { child, sock, dir }
}

/// Online CPUs (not the affinity mask, which pinning narrows).
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    n.max(1) as usize
}

fn pin_cpus(args: &RingArgs) -> Option<()> {
    (!args.no_pin && online_cpus() >= 2).then_some(())
}

/// A client end over a fresh segment whose daemon end lives in a peer.
struct Session {
    _peer: Peer,
    seg: Box<Segment>,
    to_daemon: Doorbell,
    to_client: Doorbell,
}

fn session(entries: u32, o: PeerOpts) -> Session {
    // As with the daemon: the peer creates the segment and both doorbells
    // and passes them to us with SCM_RIGHTS; we only attach.
    let mut peer = spawn_peer("ring", o);
    peer.sock
        .write_all(&entries.to_le_bytes())
        .expect("send params");
    let mut buf = [0u8; 16];
    let (_, mut fds) = recv_fds(&peer.sock, &mut buf).expect("receive fds");
    assert_eq!(fds.len(), 3, "peer sends memfd and two doorbells");
    let to_client = Doorbell::from_fd(fds.pop().expect("3 fds"));
    let to_daemon = Doorbell::from_fd(fds.pop().expect("3 fds"));
    let seg = Box::new(Segment::attach(fds.pop().expect("3 fds")).expect("attach"));
    Session {
        _peer: peer,
        seg,
        to_daemon,
        to_client,
    }
}

/// The peer: the daemon's loop, reduced to echoing.
fn run_ring_peer(mut sock: UnixStream, policy: WaitPolicy) {
    let mut e = [0u8; 4];
    sock.read_exact(&mut e).expect("params");
    let entries = u32::from_le_bytes(e);
    let params = RingParams {
        sq_entries: entries,
        cq_entries: entries,
        buf_entries: 0,
        arena_len: 1 << 16,
        chunk_len: 0,
    };
    let layout = RingLayout::new(params).expect("valid bench layout");
    let seg = Segment::create(c"stator-bench", layout.total_len).expect("memfd");
    let mut ring = DaemonRing::create(seg.view(), params).expect("init segment");
    let to_daemon = Doorbell::new().expect("eventfd");
    let to_client = Doorbell::new().expect("eventfd");
    send_fds(&sock, b"ring", &[seg.fd(), to_daemon.fd(), to_client.fd()]).expect("send fds");
    let mut expected = 0u64;
    let mut out_of_order = 0u64;
    loop {
        let mut progressed = false;
        while ring.cq.free().expect("valid cq") > 0 {
            let Some(d) = ring.sq.pop().expect("valid sq") else {
                break;
            };
            progressed = true;
            out_of_order += (d.user_data != expected) as u64;
            expected = d.user_data.wrapping_add(1);
            match d.arg2 {
                NO_REPLY => {}
                STOP => {
                    ring.cq
                        .push(&Cqe {
                            user_data: d.user_data,
                            aux: out_of_order,
                            ..Cqe::default()
                        })
                        .expect("valid cq");
                    ring.sq.release();
                    if ring.cq.publish() {
                        to_client.ring();
                    }
                    return;
                }
                _ => {
                    ring.cq
                        .push(&Cqe {
                            user_data: d.user_data,
                            aux: d.arg,
                            ..Cqe::default()
                        })
                        .expect("valid cq");
                }
            }
        }
        if ring.sq.release() {
            to_client.ring();
        }
        if ring.cq.publish() {
            to_client.ring();
        }
        if !progressed {
            let w = if ring.cq.free().expect("valid cq") == 0 {
                wait_space(
                    &mut ring.cq,
                    &to_daemon,
                    policy,
                    Some(Instant::now() + Duration::from_secs(30)),
                )
            } else {
                wait_available(
                    &mut ring.sq,
                    &to_daemon,
                    policy,
                    Some(Instant::now() + Duration::from_secs(30)),
                )
            };
            if matches!(w, Ok(Waited::TimedOut) | Err(_)) {
                return;
            }
        }
    }
}

pub fn peer_main(a: PeerArgs) {
    pin(a.cpu);
    let sock = UnixStream::connect(&a.sock).expect("connect to bench");
    let policy = WaitPolicy {
        spin: Duration::from_micros(a.spin_us),
    };
    match a.mode.as_str() {
        "ring" => run_ring_peer(sock, policy),
        "uds-echo" => uds_echo(sock),
        "uds-sink" => uds_sink(sock),
        m => panic!("unknown peer mode {m}"),
    }
}

fn uds_echo(mut s: UnixStream) {
    let mut m = [0u8; 64];
    while s.read_exact(&mut m).is_ok() {
        if s.write_all(&m).is_err() {
            return;
        }
    }
}

fn uds_sink(mut s: UnixStream) {
    let mut buf = vec![0u8; 1 << 16];
    let mut total = 0u64;
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => total += n as u64,
        }
        if total >= u64::MAX / 2 {
            break;
        }
    }
    let _ = s.write_all(&total.to_le_bytes());
}

fn deadline() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(30))
}

/// Ping-pong: one descriptor, one completion, `n` times.
fn ping_pong(o: PeerOpts, n: u64, policy: WaitPolicy, gap: Duration, name: &str) -> Case {
    let s = session(64, o);
    let mut ring = ClientRing::attach(s.seg.view()).expect("attach");
    let mut h = histogram();
    // Warm-up, unrecorded.
    let warm = n / 10;
    let start = Instant::now();
    let mut measured_start = start;
    for i in 0..warm + n {
        if i == warm {
            measured_start = Instant::now();
        }
        let t0 = Instant::now();
        assert!(ring.sq.push(&nop(i, REPLY)).expect("sq"));
        if ring.sq.publish() {
            s.to_daemon.ring();
        }
        let c = loop {
            if let Some(c) = ring.cq.pop().expect("cq") {
                break c;
            }
            let w = wait_available(&mut ring.cq, &s.to_client, policy, deadline()).expect("wait");
            assert_ne!(w, Waited::TimedOut, "peer stalled");
        };
        ring.cq.release();
        let dt = t0.elapsed();
        assert_eq!(c.user_data, i);
        if i >= warm {
            h.record(dt.as_nanos() as u64).expect("in histogram range");
        }
        if !gap.is_zero() {
            std::thread::sleep(gap);
        }
    }
    let elapsed = measured_start.elapsed();
    stop(&mut ring, &s, warm + n);
    Case::new(SUITE, name, n, elapsed)
        .latency(h)
        .with("in_flight", 1)
        .with("client_spin_us", policy.spin.as_micros() as u64)
        .with("peer_spin_us", o.spin_us)
}

fn stop(ring: &mut ClientRing<'_>, s: &Session, next: u64) -> u64 {
    while !ring.sq.push(&nop(next, STOP)).expect("sq") {
        // Drain completions until space frees up.
        while ring.cq.pop().expect("cq").is_some() {}
        ring.cq.release();
        std::thread::yield_now();
    }
    if ring.sq.publish() {
        s.to_daemon.ring();
    }
    loop {
        if let Some(c) = ring.cq.pop().expect("cq") {
            if c.user_data == next {
                ring.cq.release();
                return c.aux;
            }
            continue;
        }
        let w = wait_available(
            &mut ring.cq,
            &s.to_client,
            WaitPolicy::default(),
            deadline(),
        )
        .expect("wait");
        assert_ne!(w, Waited::TimedOut, "peer did not stop");
    }
}

/// One-way streaming: descriptors in batches, published with one store per
/// batch; the peer drains and releases in batches.
fn stream(args: &RingArgs, n: u64, entries: u32, batch: u32) -> Case {
    let s = session(
        entries,
        PeerOpts {
            spin_us: args.spin_us,
            pinned: pin_cpus(args).is_some(),
        },
    );
    let mut ring = ClientRing::attach(s.seg.view()).expect("attach");
    let policy = WaitPolicy {
        spin: Duration::from_micros(args.spin_us),
    };
    let start = Instant::now();
    let mut i = 0u64;
    while i < n {
        let mut k = 0;
        while k < batch && i < n && ring.sq.push(&nop(i, NO_REPLY)).expect("sq") {
            i += 1;
            k += 1;
        }
        if ring.sq.publish() {
            s.to_daemon.ring();
        }
        if k == 0 {
            let w = wait_space(&mut ring.sq, &s.to_client, policy, deadline()).expect("wait");
            assert_ne!(w, Waited::TimedOut, "peer stalled");
        }
    }
    let out_of_order = stop(&mut ring, &s, n);
    let elapsed = start.elapsed();
    assert_eq!(out_of_order, 0, "peer saw descriptors out of order");
    Case::new(SUITE, format!("stream_oneway_batch{batch}"), n, elapsed)
        .with("entries", entries)
        .with("batch", batch)
}

/// Request + response with `depth` requests in flight; latency is from the
/// batch a request was published in to the batch its completion was reaped in.
fn req_resp(args: &RingArgs, n: u64, depth: u32) -> Case {
    let entries = depth.next_power_of_two().max(64);
    let s = session(
        entries,
        PeerOpts {
            spin_us: args.spin_us,
            pinned: pin_cpus(args).is_some(),
        },
    );
    let mut ring = ClientRing::attach(s.seg.view()).expect("attach");
    let policy = WaitPolicy {
        spin: Duration::from_micros(args.spin_us),
    };
    let mut h = histogram();
    let mut sent_at = vec![0u64; entries as usize];
    let epoch = Instant::now();
    let (mut sent, mut done, mut in_flight) = (0u64, 0u64, 0u32);
    let start = Instant::now();
    while done < n {
        let now = epoch.elapsed().as_nanos() as u64;
        while in_flight < depth && sent < n && ring.sq.push(&nop(sent, REPLY)).expect("sq") {
            sent_at[(sent % entries as u64) as usize] = now;
            sent += 1;
            in_flight += 1;
        }
        if ring.sq.publish() {
            s.to_daemon.ring();
        }
        let mut got = 0;
        let mut reaped_at = 0;
        while let Some(c) = ring.cq.pop().expect("cq") {
            if got == 0 {
                reaped_at = epoch.elapsed().as_nanos() as u64;
            }
            debug_assert_eq!(c.user_data, done);
            let t = sent_at[(c.user_data % entries as u64) as usize];
            h.record(reaped_at.saturating_sub(t).max(1))
                .expect("in histogram range");
            got += 1;
        }
        if ring.cq.release() {
            s.to_daemon.ring();
        }
        done += got;
        in_flight -= got as u32;
        if got == 0 && (in_flight >= depth || sent == n) {
            let w = wait_available(&mut ring.cq, &s.to_client, policy, deadline()).expect("wait");
            assert_ne!(w, Waited::TimedOut, "peer stalled");
        }
    }
    let elapsed = start.elapsed();
    stop(&mut ring, &s, n);
    Case::new(SUITE, format!("req_resp_depth{depth}"), n, elapsed)
        .latency(h)
        .with("in_flight", depth)
        .with("entries", entries)
}

fn uds_ping_pong(n: u64, pinned: bool) -> Case {
    let mut p = spawn_peer("uds-echo", PeerOpts { spin_us: 0, pinned });
    let mut h = histogram();
    let mut m = [7u8; 64];
    let warm = n / 10;
    let mut measured_start = Instant::now();
    for i in 0..warm + n {
        if i == warm {
            measured_start = Instant::now();
        }
        let t0 = Instant::now();
        m[..8].copy_from_slice(&i.to_le_bytes());
        p.sock.write_all(&m).expect("uds write");
        p.sock.read_exact(&mut m).expect("uds read");
        if i >= warm {
            h.record(t0.elapsed().as_nanos() as u64)
                .expect("in histogram range");
        }
    }
    let name = if pinned {
        "uds_ping_pong_pinned"
    } else {
        "uds_ping_pong_unpinned"
    };
    Case::new(SUITE, name, n, measured_start.elapsed())
        .latency(h)
        .with("in_flight", 1)
        .with("pinned", pinned)
}

fn uds_stream(n: u64, pinned: bool) -> Case {
    let mut p = spawn_peer("uds-sink", PeerOpts { spin_us: 0, pinned });
    let m = [7u8; 64];
    let start = Instant::now();
    for _ in 0..n {
        p.sock.write_all(&m).expect("uds write");
    }
    p.sock
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    let mut total = [0u8; 8];
    p.sock.read_exact(&mut total).expect("sink total");
    let elapsed = start.elapsed();
    assert_eq!(u64::from_le_bytes(total), n * 64, "sink lost bytes");
    let name = if pinned {
        "uds_stream_64B_per_write_pinned"
    } else {
        "uds_stream_64B_per_write_unpinned"
    };
    Case::new(SUITE, name, n, elapsed).with("pinned", pinned)
}

pub fn run(args: RingArgs) {
    let mut r = Reporter::new(args.json);
    pin(pin_cpus(&args).map(|_| 0));
    let q = args.quick;
    let scale = |full: u64, quick: u64| if q { quick } else { full };
    r.machine(
        SUITE,
        json!({"quick": q, "spin_us": args.spin_us, "pinned": pin_cpus(&args).is_some(), "message_bytes": 64}),
    );
    let busy = WaitPolicy {
        spin: Duration::from_secs(3600),
    };

    let pinned = pin_cpus(&args).is_some();
    // Both sides spin: the floor of a round trip.
    let rtt_busy = ping_pong(
        PeerOpts {
            spin_us: 3_600_000_000,
            pinned,
        },
        scale(1_000_000, 200_000),
        busy,
        Duration::ZERO,
        "rtt_busy_poll",
    );
    r.case(&rtt_busy);
    // The peer sleeps on its doorbell before every request (a 200 us pause
    // between requests, not timed, lets it fall asleep): each round trip
    // pays an eventfd wake-up of the peer. ops/s here counts the pauses.
    let rtt_sleep = ping_pong(
        PeerOpts { spin_us: 0, pinned },
        scale(20_000, 4_000),
        WaitPolicy::default(),
        Duration::from_micros(200),
        "rtt_doorbell_sleeping_peer",
    );
    r.case(&rtt_sleep);
    let mut streams = Vec::new();
    for batch in [64u32, 256] {
        let c = stream(&args, scale(200_000_000, 40_000_000), 4096, batch);
        r.case(&c);
        streams.push(c);
    }
    let mut rr = Vec::new();
    for depth in [1u32, 64, 1024, 65_536] {
        let n = if depth == 1 {
            scale(500_000, 100_000)
        } else {
            scale(50_000_000, 10_000_000)
        };
        let c = req_resp(&args, n, depth);
        r.case(&c);
        rr.push(c);
    }
    // The socket peer gets both placements; the comparison takes its best,
    // since a blocking socket round trip is fastest when the scheduler may
    // run both ends on one core.
    let mut uds_pp: Option<Case> = None;
    let mut uds_st: Option<Case> = None;
    for pin in [false, pinned] {
        let c = uds_ping_pong(scale(200_000, 50_000), pin);
        r.case(&c);
        if uds_pp
            .as_ref()
            .is_none_or(|b| c.ops_per_sec > b.ops_per_sec)
        {
            uds_pp = Some(c);
        }
        let c = uds_stream(scale(5_000_000, 1_000_000), pin);
        r.case(&c);
        if uds_st
            .as_ref()
            .is_none_or(|b| c.ops_per_sec > b.ops_per_sec)
        {
            uds_st = Some(c);
        }
        if !pinned {
            break;
        }
    }
    let (uds_pp, uds_st) = (
        uds_pp.expect("measured above"),
        uds_st.expect("measured above"),
    );

    let best_stream = streams.iter().map(|c| c.ops_per_sec).fold(0.0, f64::max);
    let rr1024 = rr
        .iter()
        .find(|c| c.case == "req_resp_depth1024")
        .map(|c| c.ops_per_sec)
        .unwrap_or(0.0);
    let p50_us = rtt_busy.p(0.5).unwrap_or(u64::MAX) as f64 / 1000.0;
    if !args.json {
        println!("# derived figures and floors");
    }
    r.note(
        SUITE,
        "stream_oneway_Mdesc_per_sec",
        best_stream / 1e6,
        Bound::AtLeast(20.0),
    );
    r.note(
        SUITE,
        "req_resp_depth1024_Mops_per_sec",
        rr1024 / 1e6,
        Bound::AtLeast(10.0),
    );
    r.note(SUITE, "rtt_busy_poll_p50_us", p50_us, Bound::AtMost(2.0));
    r.note(
        SUITE,
        "ring_vs_uds_round_trips_per_sec_ratio",
        rtt_busy.ops_per_sec / uds_pp.ops_per_sec,
        Bound::AtLeast(10.0),
    );
    r.note(
        SUITE,
        "ring_vs_uds_stream_ratio",
        best_stream / uds_st.ops_per_sec,
        Bound::None,
    );
    r.note(
        SUITE,
        "uds_vs_ring_rtt_p50_ratio",
        uds_pp.p(0.5).unwrap_or(0) as f64 / rtt_busy.p(0.5).unwrap_or(1) as f64,
        Bound::None,
    );
}
