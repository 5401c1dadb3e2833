//! `stator-bench`: Stator's benchmarks, one suite per capability, each run
//! against its named peer in the same process run. Every suite takes
//! `--quick` (under a minute) and `--json` (one JSON object per case on
//! stdout: `suite`, `case`, `ops_per_sec`, and `p50_ns`/`p99_ns`/`p999_ns`
//! where latency applies). Figures and the commands that produced them are
//! recorded in `benches/RESULTS.md`.

mod c_abi;
mod checkpoint;
mod load;
mod remote;
mod report;
mod ring;
#[cfg(feature = "rocksdb")]
mod rocks;
mod s3_server;
mod serve;
mod store;

use clap::{Parser, Subcommand};

/// The daemon process of the serve and load suites runs on the allocator
/// statord runs on.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The daemon's jemalloc options (this binary also runs it, `__statord`).
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8; statord::JEMALLOC_CONF.len()] = statord::JEMALLOC_CONF;

#[derive(Parser)]
#[command(
    name = "stator-bench",
    about = "Stator benchmarks: each suite against its peer, medians and tails"
)]
struct Cli {
    #[command(subcommand)]
    suite: Suite,
}

#[derive(Subcommand)]
enum Suite {
    /// Session queues between two processes vs. a Unix-domain socket.
    Ring(ring::RingArgs),
    /// The storage engine vs. hash maps and RocksDB, in memory and larger than memory.
    Store(store::StoreArgs),
    /// statord under load (sessions x in-flight depth x op mix) vs. the in-process store and hashbrown.
    Serve(serve::ServeArgs),
    /// Checkpoint, restore and rescale durations at growing state sizes (vs. RocksDB checkpoints).
    Checkpoint(checkpoint::CheckpointArgs),
    /// The load test: sessions at full depth for minutes; latency tails and daemon memory per window.
    Load(load::LoadArgs),
    /// The remote tier's fetcher: random ranged GETs against object storage with injected latency, vs. Little's law.
    Remote(remote::RemoteArgs),
    /// A tool, not a suite: the tests' S3 server with object storage's latency per request.
    #[command(name = "s3-server")]
    S3Server(s3_server::S3ServerArgs),
    /// Internal: the peer process of the ring suite.
    #[command(name = "__ring-peer", hide = true)]
    RingPeer(ring::PeerArgs),
    /// Internal: the daemon process of the serve suite.
    #[command(name = "__statord", hide = true)]
    Statord(serve::DaemonArgs),
}

fn main() {
    match Cli::parse().suite {
        Suite::Ring(a) => ring::run(a),
        Suite::Store(a) => store::run(a),
        Suite::RingPeer(a) => ring::peer_main(a),
        Suite::Serve(a) => serve::run(a),
        Suite::Checkpoint(a) => checkpoint::run(a),
        Suite::Remote(a) => remote::run(a),
        Suite::Load(a) => load::run(a),
        Suite::Statord(a) => serve::daemon_main(a),
        Suite::S3Server(a) => s3_server::run(a),
    }
}
