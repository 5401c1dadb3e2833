//! `statord`: runs in the foreground, logs to stderr, stops cleanly on
//! SIGTERM or SIGINT (no new sessions, in-flight requests answered, stores
//! flushed, exit 0), re-reads its configuration on SIGHUP (the log filter
//! changes; other keys wait for a restart, and say so), and speaks
//! systemd's notification protocol when `NOTIFY_SOCKET` is set. With no
//! arguments it runs on the embedded default configuration (data under
//! `./stator-data`, sockets under `./stator-run`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use statord::Daemon;
use statord::config::{self, Config};
use statord::notify::Notifier;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, reload};

/// jemalloc: page-aligned block buffers without glibc memalign's holes
/// (the daemon's memory stays within its budget; benches/RESULTS.md, load).
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// See [`statord::JEMALLOC_CONF`].
#[cfg(feature = "jemalloc")]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8; statord::JEMALLOC_CONF.len()] = statord::JEMALLOC_CONF;

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
    /// Fault in the memtables' memory at start (`true`, the default) or as
    /// writes first reach it (`false`).
    #[arg(long)]
    prefault_memory: Option<bool>,
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
    if let Some(v) = a.prefault_memory {
        c.prefault_memory = v;
    }
    if !a.allow_uid.is_empty() {
        c.allowed_uids = a.allow_uid.clone();
    }
    if let Some(v) = a.spin_us {
        c.spin_us = v;
    }
    c.resolve().map_err(|e| e.to_string())
}

/// The log filter: `STATOR_LOG`, else `RUST_LOG`, else the config's `log`.
/// `Some(var)` when an environment variable decided it.
fn log_filter(cfg: &Config) -> (EnvFilter, Option<&'static str>) {
    for var in ["STATOR_LOG", "RUST_LOG"] {
        if let Ok(f) = std::env::var(var).map(|v| config::log_filter(&v)) {
            match f {
                Ok(f) => return (f, Some(var)),
                Err(e) => eprintln!("statord: {var} is not a log filter ({e}); ignored"),
            }
        }
    }
    // `log` was checked when the configuration resolved.
    let f = config::log_filter(&cfg.log).unwrap_or_else(|_| EnvFilter::new("info"));
    (f, None)
}

fn main() -> ExitCode {
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
    let (filter, from_env) = log_filter(&cfg);
    let (filter, log_handle) = reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .init();
    // Signals are taken synchronously by this thread: block them before
    // any other thread exists, so every thread inherits the mask.
    let mut sigs = SigSet::empty();
    sigs.add(Signal::SIGTERM);
    sigs.add(Signal::SIGINT);
    sigs.add(Signal::SIGHUP);
    if let Err(e) = sigs.thread_block() {
        eprintln!("statord: cannot block signals: {e}");
        return ExitCode::FAILURE;
    }
    raise_open_file_limit();
    let mut log_now = cfg.log.clone();
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
    let sig = loop {
        match sigs.wait() {
            Ok(Signal::SIGHUP) => reload(&args, &daemon, &mut log_now, from_env, &log_handle),
            other => break other,
        }
    };
    tracing::info!(signal = ?sig, sessions = daemon.sessions(), "stopping");
    if let Some(n) = notifier {
        n.stopping();
    }
    let stats = daemon.stop();
    tracing::info!(?stats, "stopped");
    ExitCode::SUCCESS
}

/// SIGHUP: re-reads the configuration (file, then flags). The log filter
/// and the limits change now (`Config::reload`); every other changed key
/// is named as waiting for a restart. An invalid file changes nothing.
fn reload<S>(
    args: &Args,
    daemon: &Daemon,
    log_now: &mut String,
    from_env: Option<&'static str>,
    log: &reload::Handle<EnvFilter, S>,
) {
    let Some(file) = &args.config else {
        tracing::info!("SIGHUP: statord runs without --config; nothing to reload");
        return;
    };
    let new = match config(args) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(file = %file.display(), error = %e, "SIGHUP: configuration not reloaded; statord runs on as it was");
            return;
        }
    };
    for key in daemon.reload(&new) {
        tracing::warn!(
            key,
            "SIGHUP: this key changed; it takes effect at the next restart"
        );
    }
    if new.log != *log_now {
        match from_env {
            Some(var) => tracing::warn!(
                var,
                "SIGHUP: the log filter comes from the environment; `log` is not applied"
            ),
            None => match config::log_filter(&new.log).map(|f| log.reload(f)) {
                Ok(Ok(())) => *log_now = new.log.clone(),
                Ok(Err(e)) => tracing::error!(error = %e, "SIGHUP: cannot change the log filter"),
                Err(e) => tracing::error!(error = %e, "SIGHUP: not a log filter"),
            },
        }
    }
    let c = daemon.config();
    tracing::info!(
        file = %file.display(),
        log = %log_now,
        max_sessions = c.max_sessions,
        allowed_uids = ?c.allowed_uids,
        "configuration reloaded (session limits apply to sessions opened from now on)"
    );
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
