//! Diagnostic: random 4 KiB reads through `UringIo` at a given depth.
//! `cargo run --release -p stator-store --example randread -- FILE DEPTH SECS`
//! (`REUSE=1`: completed reads' buffers are read into again, as the block
//! cache's spares are, instead of fresh ones).
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
    // A fresh seed each run: repeated offsets would be served from the
    // VM host's cache and flatter a later run (see benches/RESULTS.md).
    let mut x = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % pages
    };
    let mut inflight = 0;
    let mut done = 0u64;
    let mut out = Vec::new();
    // REUSE=1: the buffers of completed reads are read into again.
    let reuse = std::env::var("REUSE").is_ok_and(|v| v == "1");
    let mut spare: Vec<AlignedBuf> = Vec::new();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(secs) {
        while inflight < depth {
            let buf = spare.pop().unwrap_or_else(|| AlignedBuf::zeroed(4096));
            io.read(f, next() * 4096, buf, 0);
            inflight += 1;
        }
        io.submit().unwrap();
        io.reap(&mut out);
        if out.is_empty() {
            io.wait(if std::env::var_os("NOTIMEOUT").is_some() {
                None
            } else {
                Some(Duration::from_millis(1))
            })
            .unwrap();
            io.reap(&mut out);
        }
        for c in out.drain(..) {
            assert_eq!(c.result, Ok(4096));
            inflight -= 1;
            done += 1;
            if reuse && let Some(b) = c.buf {
                spare.push(b);
            }
        }
    }
    println!(
        "depth {depth}: {:.0} reads/s",
        done as f64 / t.elapsed().as_secs_f64()
    );
}
