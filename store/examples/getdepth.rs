//! Diagnostic: random gets through a `Store` at a given depth, with the
//! CPU time they cost. `cargo run --release -p stator-store --example
//! getdepth -- DIR KEYS DEPTH SECS [READS_PER_POLL]` (DIR from
//! `stator-bench store --reuse`; READS_PER_POLL sets
//! `StoreConfig::disk_reads_per_poll`).
use std::time::{Duration, Instant};

use stator_store::io::UringIo;
use stator_store::{KeyRef, Op, Store, StoreConfig, Submitted};

/// User and system CPU seconds of this process.
fn cpu() -> (f64, f64) {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    (t(r.ru_utime), t(r.ru_stime))
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (dir, n, depth, secs): (&str, u64, usize, u64) = (
        &a[1],
        a[2].parse().unwrap(),
        a[3].parse().unwrap(),
        a[4].parse().unwrap(),
    );
    let mut cfg = StoreConfig::new(dir, 256 << 20);
    if let Some(r) = a.get(5) {
        cfg.disk_reads_per_poll = r.parse().unwrap();
    }
    let (mut s, _) = Store::open(cfg, UringIo::new(1024, true).unwrap()).unwrap();
    s.settle();
    // A fresh seed each run: repeated offsets would be served from the
    // VM host's cache and flatter a later run (see benches/RESULTS.md).
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut pending = 0usize;
    let mut done = 0u64;
    let mut passes = 0u64;
    let c0 = cpu();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        while pending < depth {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let i = x % n;
            let kb = i.to_be_bytes();
            let k = KeyRef {
                key_group: (i % 128) as u16,
                state: 1,
                key: &kb,
                namespace: b"",
            };
            match s.submit(0, Op::Get(k)).unwrap() {
                Submitted::Pending => pending += 1,
                Submitted::Ready(_) => done += 1,
            }
        }
        let got = s.poll(|_, r| {
            r.unwrap();
        });
        pending -= got;
        passes += (got > 0) as u64;
        done += got as u64;
        if got == 0 {
            s.wait(Some(Duration::from_millis(1))).unwrap();
        }
    }
    let el = t.elapsed().as_secs_f64();
    let ((u, s), (u0, s0)) = (cpu(), c0);
    let per = |secs: f64| secs / done.max(1) as f64 * 1e6;
    println!(
        "depth {depth}: {:.0} gets/s, cpu {:.0}% (user {:.2} us, system {:.2} us per get), {:.1} per pass that finished any",
        done as f64 / el,
        (u - u0 + s - s0) / el * 100.0,
        per(u - u0),
        per(s - s0),
        done as f64 / passes.max(1) as f64
    );
}
