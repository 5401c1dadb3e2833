//! `statorctl`: the operator's command line for statord.
//!
//! - `status`, `sessions`, `checkpoints`, `metrics`, `health`, `top` read
//!   the status socket (`<run_dir>/status.sock`, HTTP/1.1);
//! - `snapshot export|import` move a portable snapshot between a retained
//!   checkpoint and a file, through a session on the control socket;
//! - `check-config FILE` checks a configuration without a daemon.
//!
//! Exit codes: 0 success; 1 the command could not run (no daemon, a file
//! that cannot be read or written); 2 the input is invalid (a
//! configuration key, a handle, a checkpoint that is not retained, a
//! corrupt snapshot file); 3 the daemon answered but is not healthy.

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Args as ClapArgs, Parser, Subcommand};
use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use indicatif::{ProgressBar, ProgressStyle};
use stator_client::{Error as ClientError, OpenOptions, Request, Session};
use statord::config::{Config, ConfigError};
use statord::metrics::HistSnapshot;
use statord::status::{hex, unhex};
use statord::status_schema::{CheckpointStatus, ServeState, SessionReport, Status};

#[derive(Parser, Debug)]
#[command(
    name = "statorctl",
    version,
    about = "Operate statord: status, sessions, checkpoints, metrics, a live view, snapshots, configuration checks",
    after_help = "Exit codes: 0 success, 1 the command could not run (no daemon, an unreadable file), \
                  2 invalid input, 3 the daemon is not healthy."
)]
struct Args {
    /// statord's run directory (its sockets: stator.sock, status.sock).
    /// Defaults to the `run_dir` of --config, else $STATOR_RUN_DIR, else
    /// ./stator-run (statord's default).
    #[arg(long, global = true)]
    run_dir: Option<PathBuf>,
    /// statord's configuration file, to find its run directory.
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The daemon at a glance: version, uptime, sessions, requests, memory
    /// against the budget, disk, each shard, and any problem.
    Status {
        /// Print the status socket's JSON as it is.
        #[arg(long)]
        json: bool,
    },
    /// Open sessions: job, operator, subtask, key groups, queues, in flight.
    Sessions {
        /// Print the sessions' JSON (from /status) as it is.
        #[arg(long)]
        json: bool,
    },
    /// Retained checkpoints with their handles (what `snapshot export` and
    /// a restore take).
    Checkpoints {
        /// Print the checkpoints' JSON (from /status) as it is.
        #[arg(long)]
        json: bool,
        /// Only this job's.
        #[arg(long)]
        job: Option<String>,
        /// Only this operator's.
        #[arg(long)]
        operator: Option<String>,
    },
    /// The Prometheus text exposition, as scraped from /metrics.
    Metrics,
    /// Exit 0 if the daemon is healthy (every shard loop reports), 3 if
    /// not (the reason is printed), 1 if it cannot be reached.
    Health,
    /// A live view, refreshed every --interval: request rates and latency
    /// quantiles per operation over the last interval, and the busiest
    /// sessions. Ctrl-C leaves.
    Top {
        /// Seconds between refreshes.
        #[arg(long, default_value_t = 1.0)]
        interval: f64,
        /// Stop after this many refreshes (0: run until interrupted).
        #[arg(long, default_value_t = 0)]
        count: u64,
    },
    /// Checks a statord configuration file as statord would read it (the
    /// embedded defaults, then the file), and prints what it resolves to:
    /// shards, memory budget and every limit. Exit 2 names the bad key.
    CheckConfig {
        /// The TOML file (keys as in README.md, "Running statord").
        file: PathBuf,
        /// Print nothing on success; only the exit code tells.
        #[arg(long, short)]
        quiet: bool,
    },
    /// Moves a portable snapshot between a checkpoint and a file.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
}

#[derive(Subcommand, Debug)]
enum SnapshotCmd {
    /// Writes what retained checkpoints of an operator hold into FILE as a
    /// portable snapshot (its 4 MiB chunks back to back, each with its
    /// CRC32C). The live state is not touched: the job may keep running.
    Export {
        #[command(flatten)]
        who: Who,
        /// Every retained checkpoint of this id of the operator (one per
        /// subtask that took it); see `statorctl checkpoints`.
        #[arg(long, required_unless_present = "handle", conflicts_with = "handle")]
        checkpoint: Option<u64>,
        /// Or checkpoint handles in hex (repeat for several subtasks).
        #[arg(long)]
        handle: Vec<String>,
        /// Snapshot id written into every chunk (default: the checkpoint id).
        #[arg(long)]
        snapshot_id: Option<u64>,
        /// Where to write (written to FILE.partial, renamed when whole).
        #[arg(long, short)]
        output: PathBuf,
    },
    /// Installs a portable snapshot file as the operator's state and takes
    /// a checkpoint of it, printing the checkpoint's handle (restore the
    /// job with it). It replaces the operator's live state in the key
    /// groups the snapshot names, so the job must not run: refused while a
    /// session of the operator is open, unless --force.
    Import {
        #[command(flatten)]
        who: Who,
        /// The id of the checkpoint taken after the import.
        #[arg(long)]
        checkpoint: u64,
        /// The snapshot file (from `snapshot export` or an engine).
        #[arg(long, short)]
        input: PathBuf,
        /// Import although a session of the operator is open.
        #[arg(long)]
        force: bool,
    },
}

#[derive(ClapArgs, Debug)]
struct Who {
    /// Job id.
    #[arg(long)]
    job: String,
    /// Operator id.
    #[arg(long)]
    operator: String,
    /// The key-group space: the session covers all of 0..max_parallelism.
    #[arg(long, default_value_t = 32768)]
    max_parallelism: u32,
}

/// A failure with its exit code.
struct Fail(u8, String);

impl Fail {
    fn run(m: impl Into<String>) -> Fail {
        Fail(1, m.into())
    }
    fn input(m: impl Into<String>) -> Fail {
        Fail(2, m.into())
    }
}

type Res<T> = Result<T, Fail>;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fail(code, msg)) => {
            eprintln!("statorctl: {msg}");
            ExitCode::from(code)
        }
    }
}

fn run(args: Args) -> Res<()> {
    if let Command::CheckConfig { file, quiet } = &args.command {
        return check_config(file, *quiet);
    }
    let run_dir = run_dir(&args)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Fail::run(format!("cannot start a runtime: {e}")))?;
    let ctl = Ctl { run_dir, rt };
    match args.command {
        Command::Status { json } => {
            if json {
                // As the daemon sent it (a newer daemon's fields too).
                println!("{}", ctl.status_body()?.trim_end());
            } else {
                print_status(&ctl.status()?);
            }
        }
        Command::Sessions { json } => {
            let s = ctl.status()?;
            if json {
                println!("{}", pretty(&s.sessions));
            } else {
                print_sessions(&s);
            }
        }
        Command::Checkpoints {
            json,
            job,
            operator,
        } => {
            let s = ctl.status()?;
            let list: Vec<&CheckpointStatus> = s
                .checkpoints
                .iter()
                .filter(|c| job.as_ref().is_none_or(|j| c.job == *j))
                .filter(|c| operator.as_ref().is_none_or(|o| c.operator == *o))
                .collect();
            if json {
                println!("{}", pretty(&list));
            } else {
                print_checkpoints(&list);
            }
        }
        Command::Metrics => {
            let (code, body) = ctl.get("/metrics")?;
            if code != 200 {
                return Err(Fail::run(format!("/metrics answered {code}: {body}")));
            }
            print!("{body}");
        }
        Command::Health => {
            let (code, body) = ctl.get("/healthz")?;
            match code {
                200 => print!("{body}"),
                503 => return Err(Fail(3, format!("statord is not healthy: {}", body.trim()))),
                _ => {
                    return Err(Fail::run(format!(
                        "/healthz answered {code}: {}",
                        body.trim()
                    )));
                }
            }
        }
        Command::Top { interval, count } => top(&ctl, interval, count)?,
        Command::Snapshot(SnapshotCmd::Export {
            who,
            checkpoint,
            handle,
            snapshot_id,
            output,
        }) => export(&ctl, &who, checkpoint, &handle, snapshot_id, &output)?,
        Command::Snapshot(SnapshotCmd::Import {
            who,
            checkpoint,
            input,
            force,
        }) => import(&ctl, &who, checkpoint, &input, force)?,
        Command::CheckConfig { .. } => unreachable!("handled above"),
    }
    Ok(())
}

fn check_config(file: &Path, quiet: bool) -> Res<()> {
    match Config::from_file(file).and_then(Config::resolve) {
        Ok(c) => {
            if !quiet {
                println!("{}: valid; statord would run with:\n{c:#?}", file.display());
            }
            Ok(())
        }
        Err(e @ ConfigError::Read { .. }) => Err(Fail::run(e.to_string())),
        Err(e) => Err(Fail::input(e.to_string())),
    }
}

fn run_dir(a: &Args) -> Res<PathBuf> {
    if let Some(d) = &a.run_dir {
        return Ok(d.clone());
    }
    if let Some(f) = &a.config {
        return match Config::from_file(f) {
            Ok(c) => Ok(c.run_dir),
            Err(e @ ConfigError::Read { .. }) => Err(Fail::run(e.to_string())),
            Err(e) => Err(Fail::input(e.to_string())),
        };
    }
    Ok(std::env::var_os("STATOR_RUN_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Config::default().run_dir))
}

struct Ctl {
    run_dir: PathBuf,
    /// One runtime for every status request (`top` makes one a second).
    rt: tokio::runtime::Runtime,
}

impl Ctl {
    /// GETs `path` from the status socket: (HTTP status, body).
    fn get(&self, path: &str) -> Res<(u16, String)> {
        let sock = self.run_dir.join("status.sock");
        self.rt.block_on(async {
            let stream = tokio::net::UnixStream::connect(&sock).await.map_err(|e| {
                Fail::run(format!(
                    "cannot connect to {}: {e} (is statord running? --run-dir or --config name its run directory)",
                    sock.display()
                ))
            })?;
            let io = hyper_util::rt::TokioIo::new(stream);
            let (mut tx, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| Fail::run(format!("status socket: {e}")))?;
            tokio::spawn(conn);
            let req = hyper::Request::get(path)
                .header(hyper::header::HOST, "localhost")
                .body(Empty::<Bytes>::new())
                .expect("a request from valid parts");
            let call = async {
                let res = tx.send_request(req).await?;
                let code = res.status().as_u16();
                let body = res.into_body().collect().await?.to_bytes();
                Ok::<_, hyper::Error>((code, String::from_utf8_lossy(&body).into_owned()))
            };
            match tokio::time::timeout(Duration::from_secs(10), call).await {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => Err(Fail::run(format!("status socket: {e}"))),
                Err(_) => Err(Fail::run("the status socket did not answer within 10 s")),
            }
        })
    }

    /// `GET /status`, as sent.
    fn status_body(&self) -> Res<String> {
        let (code, body) = self.get("/status")?;
        if code != 200 {
            return Err(Fail::run(format!(
                "/status answered {code}: {}",
                body.trim()
            )));
        }
        Ok(body)
    }

    /// `GET /status`, read into its schema (`statord::status_schema`).
    fn status(&self) -> Res<Status> {
        serde_json::from_str(&self.status_body()?).map_err(|e| {
            Fail::run(format!(
                "/status does not match this statorctl's schema (a statord of another version?): {e}"
            ))
        })
    }

    fn open(&self, who: &Who) -> Res<Session> {
        let mut o = OpenOptions::new(&who.job, &who.operator);
        o.subtask = 0;
        o.parallelism = 1;
        o.max_parallelism = who.max_parallelism;
        Session::open(self.run_dir.join("stator.sock"), &o).map_err(|e| match e {
            ClientError::Connect { .. } => Fail::run(e.to_string()),
            e => Fail::input(format!("statord refused the session: {e}")),
        })
    }
}

fn pretty(v: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(v).expect("JSON")
}

fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut i = 0;
    while x >= 1024.0 && i + 1 < U.len() {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", U[i])
    }
}

fn duration(s: f64) -> String {
    let s = s as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

fn seconds(s: f64) -> String {
    if !s.is_finite() {
        "> 8.6s".into()
    } else if s < 1e-3 {
        format!("{:.0}us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{s:.2}s")
    }
}

/// Prints rows as columns padded to their widest cell.
fn table(head: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = head.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<width$}  ", width = w[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(head.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

fn print_status(s: &Status) {
    let m = &s.memory;
    let budget = m.budget_bytes.max(1);
    let state = match s.state {
        ServeState::Serving => "serving",
        ServeState::Stopping => "stopping",
    };
    println!(
        "statord {} (pid {}), {state}, up {}",
        s.version,
        s.pid,
        duration(s.uptime_s)
    );
    println!(
        "sessions   {} open (max {})",
        s.sessions_open, s.max_sessions
    );
    println!(
        "requests   {} served, {} in flight, {} failed",
        s.requests, s.in_flight, s.errors.request_errors
    );
    println!(
        "memory     {} of {} ({:.0}%): memtables {}, block cache {}, indexes and filters {}, checkpoints {}",
        bytes(m.used_bytes),
        bytes(budget),
        m.used_bytes as f64 * 100.0 / budget as f64,
        bytes(m.memtables_bytes),
        bytes(m.block_cache_bytes),
        bytes(m.indexes_and_filters_bytes),
        bytes(m.checkpoints_bytes)
    );
    let d = &s.disk;
    println!(
        "disk       {} under {} ({} live segments, {})",
        bytes(d.used_bytes),
        d.data_dir,
        d.segments,
        bytes(d.segment_bytes)
    );
    println!("checkpoints {} retained", s.checkpoints.len());
    println!();
    let rows: Vec<Vec<String>> = s
        .shards
        .iter()
        .map(|h| {
            let st = &h.store;
            let (hits, misses) = (st.cache_hits, st.cache_misses);
            vec![
                h.id.to_string(),
                h.sessions.to_string(),
                h.requests.to_string(),
                h.in_flight.to_string(),
                format!(
                    "{} / {}",
                    bytes(h.memory.used_bytes),
                    bytes(h.memory.budget_bytes)
                ),
                st.segments.to_string(),
                if hits + misses == 0 {
                    "-".into()
                } else {
                    format!("{:.1}%", hits as f64 * 100.0 / (hits + misses) as f64)
                },
                st.flushes.to_string(),
                st.compactions.to_string(),
                format!("{}ms", h.report_age_ms),
            ]
        })
        .collect();
    table(
        &[
            "SHARD",
            "SESSIONS",
            "REQUESTS",
            "IN-FLIGHT",
            "MEMORY",
            "SEGMENTS",
            "CACHE-HIT",
            "FLUSHES",
            "COMPACTIONS",
            "REPORTED",
        ],
        &rows,
    );
    if !s.errors.problems.is_empty() {
        println!("\nproblems:");
        for p in &s.errors.problems {
            println!("  {p}");
        }
    }
}

fn print_sessions(s: &Status) {
    let rows: Vec<Vec<String>> = s
        .sessions
        .iter()
        .map(|x| {
            vec![
                x.id.to_string(),
                x.shard.to_string(),
                x.job.clone(),
                x.operator.clone(),
                format!("{}/{}", x.subtask, x.parallelism),
                format!("{}..={}", x.key_group_lo, x.key_group_hi),
                x.states.to_string(),
                x.in_flight.to_string(),
                format!("{}/{}", x.sq_depth, x.sq_entries),
                format!("{}/{}", x.cq_depth, x.cq_entries),
                x.requests.to_string(),
                duration(s.now_unix.saturating_sub(x.opened_unix) as f64),
                if x.broken {
                    "broken".into()
                } else if x.export_in_progress {
                    "exporting".into()
                } else if x.import_in_progress {
                    "importing".into()
                } else {
                    "ok".into()
                },
            ]
        })
        .collect();
    if rows.is_empty() {
        println!("no open sessions");
        return;
    }
    table(
        &[
            "ID",
            "SHARD",
            "JOB",
            "OPERATOR",
            "SUBTASK",
            "KEY-GROUPS",
            "STATES",
            "IN-FLIGHT",
            "SQ",
            "CQ",
            "REQUESTS",
            "AGE",
            "STATE",
        ],
        &rows,
    );
}

fn print_checkpoints(list: &[&CheckpointStatus]) {
    if list.is_empty() {
        println!("no retained checkpoints");
        return;
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|c| {
            vec![
                c.job.clone(),
                c.operator.clone(),
                c.checkpoint_id.to_string(),
                format!("{}..={}", c.key_group_lo, c.key_group_hi),
                c.segments.to_string(),
                if c.completed { "yes" } else { "no" }.into(),
                c.shard.to_string(),
                c.handle.clone(),
            ]
        })
        .collect();
    table(
        &[
            "JOB",
            "OPERATOR",
            "CHECKPOINT",
            "KEY-GROUPS",
            "SEGMENTS",
            "COMPLETED",
            "SHARD",
            "HANDLE",
        ],
        &rows,
    );
}

fn top(ctl: &Ctl, interval: f64, count: u64) -> Res<()> {
    if !(interval.is_finite() && interval >= 0.05) {
        return Err(Fail::input("--interval must be at least 0.05 seconds"));
    }
    let tty = std::io::stdout().is_terminal();
    let mut prev = ctl.status()?;
    let mut at = Instant::now();
    let mut n = 0u64;
    loop {
        std::thread::sleep(Duration::from_secs_f64(interval));
        let cur = ctl.status()?;
        let dt = at.elapsed().as_secs_f64();
        at = Instant::now();
        if tty {
            print!("\x1b[2J\x1b[H");
        } else if n > 0 {
            println!();
        }
        let m = &cur.memory;
        println!(
            "statord {} up {}  sessions {}  in flight {}  memory {} / {}  disk {}   (every {interval}s; Ctrl-C leaves)",
            cur.version,
            duration(cur.uptime_s),
            cur.sessions_open,
            cur.in_flight,
            bytes(m.used_bytes),
            bytes(m.budget_bytes),
            bytes(cur.disk.used_bytes)
        );
        println!();
        let mut rows = Vec::new();
        let mut total = 0.0;
        for (name, op) in &cur.ops {
            let Some(was) = prev.ops.get(name) else {
                continue;
            };
            let dreq = op.requests.saturating_sub(was.requests);
            if dreq == 0 {
                continue;
            }
            // The interval's histogram: this read's buckets less the last.
            let mut h = HistSnapshot::default();
            for (i, d) in h.buckets.iter_mut().enumerate() {
                let at = |b: &[u64]| b.get(i).copied().unwrap_or(0);
                *d = at(&op.latency_buckets).saturating_sub(at(&was.latency_buckets));
            }
            let q = |x| h.quantile_bound_s(x).map_or("-".into(), seconds);
            total += dreq as f64 / dt;
            rows.push(vec![
                name.clone(),
                format!("{:.0}", dreq as f64 / dt),
                format!("{:.0}", op.errors.saturating_sub(was.errors) as f64 / dt),
                q(0.5),
                q(0.99),
                q(0.999),
            ]);
        }
        println!("requests/s {total:.0}  (latency: bucket upper bounds, daemon side)");
        if rows.is_empty() {
            println!("  (idle)");
        } else {
            table(&["OP", "REQ/S", "ERR/S", "P50", "P99", "P99.9"], &rows);
        }
        // The busiest sessions over the interval.
        let mut sess: Vec<(f64, &SessionReport)> = cur
            .sessions
            .iter()
            .map(|x| {
                let was = prev
                    .sessions
                    .iter()
                    .find(|p| p.id == x.id)
                    .map_or(0, |p| p.requests);
                (x.requests.saturating_sub(was) as f64 / dt, x)
            })
            .collect();
        sess.sort_by(|a, b| b.0.total_cmp(&a.0));
        println!();
        if sess.is_empty() {
            println!("no open sessions");
        } else {
            let rows: Vec<Vec<String>> = sess
                .iter()
                .take(10)
                .map(|(r, x)| {
                    vec![
                        x.id.to_string(),
                        x.job.clone(),
                        x.operator.clone(),
                        format!("{}/{}", x.subtask, x.parallelism),
                        format!("{r:.0}"),
                        x.in_flight.to_string(),
                        x.sq_depth.to_string(),
                        x.cq_depth.to_string(),
                    ]
                })
                .collect();
            table(
                &[
                    "SESSION",
                    "JOB",
                    "OPERATOR",
                    "SUBTASK",
                    "REQ/S",
                    "IN-FLIGHT",
                    "SQ",
                    "CQ",
                ],
                &rows,
            );
        }
        let _ = std::io::stdout().flush();
        prev = cur;
        n += 1;
        if count > 0 && n >= count {
            return Ok(());
        }
    }
}

fn bar(len: Option<u64>, what: &str) -> ProgressBar {
    let b = match len {
        Some(n) => ProgressBar::new(n).with_style(
            ProgressStyle::with_template(
                "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("a template")
            .progress_chars("=> "),
        ),
        None => ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("{msg} {spinner} {bytes} {bytes_per_sec} {elapsed}")
                .expect("a template"),
        ),
    };
    // indicatif draws only on a terminal (stderr), so scripts see nothing.
    b.with_message(what.to_string())
}

fn export(
    ctl: &Ctl,
    who: &Who,
    checkpoint: Option<u64>,
    handle_hex: &[String],
    snapshot_id: Option<u64>,
    output: &Path,
) -> Res<()> {
    let handles: Vec<Vec<u8>> = match checkpoint {
        Some(id) => {
            let s = ctl.status()?;
            let hs: Vec<Vec<u8>> = s
                .checkpoints
                .iter()
                .filter(|c| c.job == who.job && c.operator == who.operator && c.checkpoint_id == id)
                .filter_map(|c| unhex(&c.handle))
                .collect();
            if hs.is_empty() {
                return Err(Fail::input(format!(
                    "no retained checkpoint {id} of job {} operator {} (`statorctl checkpoints` lists them)",
                    who.job, who.operator
                )));
            }
            hs
        }
        None => handle_hex
            .iter()
            .map(|h| unhex(h).ok_or_else(|| Fail::input(format!("handle {h:?} is not hex"))))
            .collect::<Res<_>>()?,
    };
    let snapshot_id = snapshot_id.or(checkpoint).unwrap_or(1);
    let mut s = ctl.open(who)?;
    let partial = partial_path(output);
    let f = File::create(&partial)
        .map_err(|e| Fail::run(format!("cannot create {}: {e}", partial.display())))?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    let pb = bar(None, "exporting");
    let mut total = 0u64;
    let refs: Vec<&[u8]> = handles.iter().map(|h| h.as_slice()).collect();
    let r = s.export_checkpoints(snapshot_id, &refs, |chunk| {
        w.write_all(chunk)?;
        total += chunk.len() as u64;
        pb.inc(chunk.len() as u64);
        Ok(())
    });
    pb.finish_and_clear();
    let done = r
        .map_err(|e| match e {
            ClientError::Status(stator_client::Status::BadArgument) => Fail::input(format!(
                "statord refused the export: {e} (are the handles this operator's, and retained?)"
            )),
            e => Fail::run(format!("the export failed: {e}")),
        })
        .and_then(|chunks| {
            let f = w
                .into_inner()
                .map_err(|e| Fail::run(format!("cannot write {}: {e}", partial.display())))?;
            f.sync_all()
                .map_err(|e| Fail::run(format!("cannot sync {}: {e}", partial.display())))?;
            std::fs::rename(&partial, output)
                .map_err(|e| Fail::run(format!("cannot rename to {}: {e}", output.display())))?;
            Ok(chunks)
        });
    match done {
        Ok(chunks) => {
            eprintln!(
                "exported {} checkpoint(s) of {}/{} as snapshot {snapshot_id}: {chunks} chunks, {} to {}",
                handles.len(),
                who.job,
                who.operator,
                bytes(total),
                output.display()
            );
            Ok(())
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

fn partial_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Reads the next chunk of a snapshot file (its header, then as much as
/// the header says) into `buf`; `Ok(false)` at the end of the file. The
/// daemon checks the rest.
fn next_chunk(r: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    use stator_store::snapshot::{HEADER_LEN, chunk_len};
    buf.resize(HEADER_LEN, 0);
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut buf[got..])? {
            0 if got == 0 => return Ok(false),
            0 => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "the file ends inside a chunk header",
                ));
            }
            n => got += n,
        }
    }
    let len =
        chunk_len(buf).map_err(|m| std::io::Error::new(std::io::ErrorKind::InvalidData, m))?;
    buf.resize(len, 0);
    r.read_exact(&mut buf[HEADER_LEN..])
        .map_err(|e| std::io::Error::new(e.kind(), format!("the file ends inside a chunk: {e}")))?;
    Ok(true)
}

fn import(ctl: &Ctl, who: &Who, checkpoint: u64, input: &Path, force: bool) -> Res<()> {
    let f = File::open(input)
        .map_err(|e| Fail::run(format!("cannot open {}: {e}", input.display())))?;
    let len = f.metadata().map(|m| m.len()).ok();
    if !force {
        let s = ctl.status()?;
        let open: Vec<u64> = s
            .sessions
            .iter()
            .filter(|x| x.job == who.job && x.operator == who.operator)
            .map(|x| x.id)
            .collect();
        if !open.is_empty() {
            return Err(Fail::input(format!(
                "sessions {open:?} of {}/{} are open: an import replaces the operator's state, so stop the job first (or --force)",
                who.job, who.operator
            )));
        }
    }
    let mut s = ctl.open(who)?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let pb = bar(len, "importing");
    let mut buf = Vec::new();
    let mut file_err: Option<std::io::Error> = None;
    let imported =
        s.import_snapshot_with(checkpoint, |s, slot| match next_chunk(&mut r, &mut buf) {
            Ok(false) => Ok(false),
            Ok(true) => {
                pb.inc(buf.len() as u64);
                s.write_chunk(slot, &buf).map(|()| true)
            }
            Err(e) => {
                let m = e.to_string();
                file_err = Some(e);
                Err(ClientError::Protocol(m))
            }
        });
    pb.finish_and_clear();
    let records = match (imported, file_err) {
        (_, Some(e))
            if e.kind() == std::io::ErrorKind::InvalidData
                || e.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            return Err(Fail::input(format!(
                "{} is not a whole snapshot: {e}; nothing was imported",
                input.display()
            )));
        }
        (_, Some(e)) => {
            return Err(Fail::run(format!("cannot read {}: {e}", input.display())));
        }
        (Ok(n), None) => n,
        (
            Err(
                e @ ClientError::Status(
                    stator_client::Status::BadSnapshot | stator_client::Status::BadArgument,
                ),
            ),
            None,
        ) => {
            return Err(Fail::input(format!(
                "statord refused the snapshot: {e}; nothing was imported"
            )));
        }
        (Err(e), None) => return Err(Fail::run(format!("the import failed: {e}"))),
    };
    const TOKEN: u64 = 1;
    let res = s
        .submit(&Request::checkpoint(checkpoint), TOKEN)
        .and_then(|()| s.flush());
    if let Err(e) = res {
        return Err(Fail::run(format!("cannot take the checkpoint: {e}")));
    }
    let mut handle: Option<Result<Vec<u8>, ClientError>> = None;
    while handle.is_none() {
        s.wait(Some(Duration::from_secs(1)))
            .map_err(|e| Fail::run(format!("the checkpoint failed: {e}")))?;
        s.poll(|c| {
            if c.token == TOKEN {
                handle = Some(c.check().and_then(|()| {
                    c.value.map(<[u8]>::to_vec).ok_or_else(|| {
                        ClientError::Protocol("a checkpoint without a handle".into())
                    })
                }));
            }
        })
        .map_err(|e| Fail::run(format!("the checkpoint failed: {e}")))?;
    }
    let h = handle
        .expect("set above")
        .map_err(|e| Fail::run(format!("the checkpoint failed: {e}")))?;
    eprintln!(
        "imported {records} records from {} into {}/{}; checkpoint {checkpoint} holds them (restore with its handle):",
        input.display(),
        who.job,
        who.operator
    );
    println!("{}", hex(&h));
    Ok(())
}
