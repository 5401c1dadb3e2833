//! Diagnostic: random 4 KiB reads through `UringIo` at a given depth.
//! `cargo run --release -p stator-store --example randread -- FILE DEPTH SECS`
use std::time::{Duration, Instant};

use stator_store::aligned::AlignedBuf;
use stator_store::io::{Io, OpenMode, UringIo};

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (file, depth, secs): (&str, usize, u64) =
        (&a[1], a[2].parse().unwrap(), a[3].parse().unwrap());
    let mut io = UringIo::new(1024, true).unwrap();
    let f = io.open(std::path::Path::new(file), OpenMode::Read).unwrap();
    let pages = io.file_len(f).unwrap() / 4096;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % pages
    };
    let mut inflight = 0;
    let mut done = 0u64;
    let mut out = Vec::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        while inflight < depth {
            io.read(f, next() * 4096, AlignedBuf::zeroed(4096), 0);
            inflight += 1;
        }
        io.submit().unwrap();
        io.reap(&mut out);
        if out.is_empty() {
            io.wait(Some(Duration::from_millis(1))).unwrap();
            io.reap(&mut out);
        }
        for c in out.drain(..) {
            assert_eq!(c.result, Ok(4096));
            inflight -= 1;
            done += 1;
        }
    }
    println!(
        "depth {depth}: {:.0} reads/s",
        done as f64 / t.elapsed().as_secs_f64()
    );
}
