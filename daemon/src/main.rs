//! `statord`: runs in the foreground, logs to stderr, stops cleanly on
//! SIGTERM or SIGINT (no new sessions, in-flight requests answered, stores
//! flushed, exit 0). With no arguments it runs on the embedded default
//! configuration (data under `./stator-data`, sockets under `./stator-run`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use statord::Daemon;
use statord::config::Config;
use statord::notify::Notifier;

#[derive(Parser, Debug)]
#[command(
    name = "statord",
    version,
    about = "Stator: keyed state for stream processors, served over shared memory"
)]
struct Args {
    /// TOML configuration file (keys as in README.md); flags override it.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Where the stores live.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Where the control socket lives (`stator.sock`).
    #[arg(long)]
    run_dir: Option<PathBuf>,
    /// Shard threads (0 = one per spare core).
    #[arg(long)]
    shards: Option<usize>,
    /// Memory budget of all stores, MiB (0 = a quarter of the machine).
    #[arg(long)]
    memory_budget_mib: Option<u64>,
    /// Memtable size per shard, MiB (0 = the store's default).
    #[arg(long)]
    memtable_mib: Option<u64>,
    /// A uid allowed to open sessions (repeat for more).
    #[arg(long = "allow-uid")]
    allow_uid: Vec<u32>,
    /// How long an idle shard spins before sleeping, microseconds.
    #[arg(long)]
    spin_us: Option<u64>,
    /// Print the configuration it would run with, then exit.
    #[arg(long)]
    print_config: bool,
}

fn config(a: &Args) -> Result<Config, String> {
    let mut c = match &a.config {
        Some(p) => Config::from_file(p).map_err(|e| e.to_string())?,
        None => Config::default(),
    };
    if let Some(v) = &a.data_dir {
        c.data_dir = v.clone();
    }
    if let Some(v) = &a.run_dir {
        c.run_dir = v.clone();
    }
    if let Some(v) = a.shards {
        c.shards = v;
    }
    if let Some(v) = a.memory_budget_mib {
        c.memory_budget_mib = v;
    }
    if let Some(v) = a.memtable_mib {
        c.memtable_mib = v;
    }
    if !a.allow_uid.is_empty() {
        c.allowed_uids = a.allow_uid.clone();
    }
    if let Some(v) = a.spin_us {
        c.spin_us = v;
    }
    c.resolve().map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STATOR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let cfg = match config(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("statord: {e}");
            return ExitCode::from(2);
        }
    };
    if args.print_config {
        println!("{cfg:#?}");
        return ExitCode::SUCCESS;
    }
    // Signals are taken synchronously by this thread: block them before
    // any other thread exists, so every thread inherits the mask.
    let mut sigs = SigSet::empty();
    sigs.add(Signal::SIGTERM);
    sigs.add(Signal::SIGINT);
    if let Err(e) = sigs.thread_block() {
        eprintln!("statord: cannot block signals: {e}");
        return ExitCode::FAILURE;
    }
    raise_open_file_limit();
    let daemon = match Daemon::start(cfg) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("statord: {e}");
            return ExitCode::FAILURE;
        }
    };
    // READY=1 now that the socket listens and the stores are open; the
    // notifier refreshes STATUS= and pings the watchdog while shards move.
    let notifier = Notifier::start(daemon.shards_live(), daemon.session_count());
    let sig = sigs.wait();
    tracing::info!(signal = ?sig, sessions = daemon.sessions(), "stopping");
    if let Some(n) = notifier {
        n.stopping();
    }
    let stats = daemon.stop();
    tracing::info!(?stats, "stopped");
    ExitCode::SUCCESS
}

/// Segments, their restored references and sessions each hold a file
/// descriptor: take the hard limit, not the 1024 soft default.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(soft, hard, error = %e, "cannot raise the open-file limit");
            }
        }
        _ => {}
    }
}
