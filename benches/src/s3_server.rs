//! `stator-bench s3-server`: the S3-compatible server the remote tier's
//! tests use (`s3s` over `s3s-fs`, store/tests/common/s3.rs), as a process
//! of its own, with object storage's latency added to every request. The
//! Flink benchmark's remote case starts it, points statord's `[remote]` at
//! it and kills it at the end.
//!
//! It prints one line, `listening on 127.0.0.1:PORT`, once it accepts
//! connections, then serves until its standard input closes (so it never
//! outlives the process that started it) or it is killed.

use std::io::Read;
use std::path::PathBuf;
use std::time::Duration;

#[path = "../../store/tests/common/s3.rs"]
#[allow(dead_code)] // the tests' fault proxy is not used here
mod s3;

#[derive(clap::Args)]
pub struct S3ServerArgs {
    /// The data root: bucket `stator` is the directory `<dir>/stator`.
    #[arg(long)]
    dir: PathBuf,
    /// Port on 127.0.0.1 (0: a free one, printed).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Milliseconds every request is held before it is served.
    #[arg(long, default_value_t = 23)]
    delay_ms: u64,
    /// Runtime threads serving requests.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

pub fn run(a: S3ServerArgs) {
    let server = s3::Server::start_delayed(
        &a.dir,
        a.port,
        Duration::from_millis(a.delay_ms),
        a.threads.max(1),
    );
    println!(
        "listening on 127.0.0.1:{} (bucket {}, access key {}, secret {}, {} ms per request)",
        server.port,
        s3::BUCKET,
        s3::KEY,
        s3::SECRET,
        a.delay_ms
    );
    // Serve until the parent closes our standard input (or dies).
    let mut sink = [0u8; 256];
    while let Ok(n) = std::io::stdin().read(&mut sink) {
        if n == 0 {
            break;
        }
    }
    drop(server);
}
