//! Helpers for the end-to-end tests: a real `statord` process in a
//! temporary directory, and sessions against it.
#![allow(dead_code)]

/// The S3-compatible server the store's remote tests use.
#[path = "../../store/tests/common/s3.rs"]
pub mod s3;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stator_client::{Completion, Error, OpenOptions, Request, Session, Status};

/// A `statord` child process with its own data and run directories.
pub struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Daemon {
    /// Starts a daemon with one shard and `budget_mib` of memory.
    pub fn start(budget_mib: u64) -> Daemon {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut d = Daemon::start_in(&dir, budget_mib, &[]);
        d._tmp = Some(tmp);
        d
    }

    /// Starts a daemon over `dir` with `toml` as its configuration file
    /// (`dir/statord.toml`).
    #[allow(dead_code)] // each test binary uses some
    pub fn start_with_config(dir: &Path, budget_mib: u64, toml: &str) -> Daemon {
        let conf = dir.join("statord.toml");
        std::fs::write(&conf, toml).expect("write statord.toml");
        Daemon::start_in(
            dir,
            budget_mib,
            &["--config", conf.to_str().expect("UTF-8")],
        )
    }

    /// Starts a daemon over `dir` (kept; for restart tests).
    pub fn start_in(dir: &Path, budget_mib: u64, extra: &[&str]) -> Daemon {
        let socket = dir.join("run/stator.sock");
        let child = Command::new(env!("CARGO_BIN_EXE_statord"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--run-dir")
            .arg(dir.join("run"))
            .args([
                "--shards",
                "1",
                "--memory-budget-mib",
                &budget_mib.to_string(),
            ])
            .args(extra)
            .env("STATOR_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn statord");
        let mut d = Daemon {
            child,
            dir: dir.to_path_buf(),
            socket,
            _tmp: None,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::os::unix::net::UnixStream::connect(&d.socket).is_err() {
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("statord exited at start ({st}); its stderr says why");
            }
            assert!(Instant::now() < deadline, "statord did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        d
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends `sig` to the daemon.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Stops the daemon (SIGSTOP) and waits until every thread is stopped.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let all = std::fs::read_dir(format!("/proc/{}/task", self.pid()))
                .expect("task dir")
                .filter_map(|t| t.ok())
                .all(|t| {
                    std::fs::read_to_string(t.path().join("stat"))
                        .ok()
                        .and_then(|s| {
                            s.rsplit(')')
                                .next()
                                .map(|r| r.trim_start().starts_with('T'))
                        })
                        .unwrap_or(true)
                });
            if all {
                return;
            }
            assert!(Instant::now() < deadline, "statord did not stop");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Session mappings the daemon holds (its memfds in /proc/PID/maps).
    pub fn mapped_sessions(&self) -> usize {
        std::fs::read_to_string(format!("/proc/{}/maps", self.pid()))
            .map(|m| {
                m.lines()
                    .filter(|l| l.contains("memfd:stator-session"))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Waits for the daemon to exit; its exit status.
    pub fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return s;
            }
            assert!(Instant::now() < deadline, "statord did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A completion, owned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Done {
    pub status: Result<Status, i32>,
    pub value: Option<Vec<u8>>,
    pub aux: u64,
    pub more: bool,
}

impl From<Completion<'_>> for Done {
    fn from(c: Completion<'_>) -> Done {
        Done {
            status: c.status,
            value: c.value.map(|v| v.to_vec()),
            aux: c.aux,
            more: c.more,
        }
    }
}

pub fn opts(job: &str, subtask: u32, parallelism: u32) -> OpenOptions {
    OpenOptions {
        subtask,
        parallelism,
        ..OpenOptions::new(job, "op")
    }
}

/// Runs one request to completion.
pub fn run(s: &mut Session, r: &Request<'_>) -> Result<Done, Error> {
    s.submit(r, u64::MAX)?;
    s.flush()?;
    let mut got = None;
    while got.is_none() {
        s.poll(|c| got = Some(Done::from(c)))?;
        if got.is_none() {
            s.wait(Some(Duration::from_secs(1)))?;
        }
    }
    Ok(got.unwrap())
}

/// Polls until `n` completions arrived, giving each to `f`.
pub fn collect(s: &mut Session, mut n: usize, mut f: impl FnMut(u64, Done)) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while n > 0 {
        let got = s.poll(|c| f(c.token, Done::from(c)))?;
        n -= got;
        if got == 0 {
            assert!(
                Instant::now() < deadline,
                "completions did not arrive ({n} missing)"
            );
            s.wait(Some(Duration::from_millis(100)))?;
        }
    }
    Ok(())
}

/// Runs the `statorctl` binary: (exit code, stdout, stderr).
pub fn statorctl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_statorctl"))
        .args(args)
        .output()
        .expect("run statorctl");
    (
        out.status.code().expect("an exit code"),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A small deterministic generator (xorshift64) for test workloads.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Up to `max` random bytes.
    pub fn bytes(&mut self, max: u64) -> Vec<u8> {
        let n = self.below(max + 1) as usize;
        (0..n).map(|_| self.next() as u8).collect()
    }
}

/// A session opened by hand over the control protocol (no client
/// library), for a hostile client to scribble on: its connection, its
/// segment, the doorbell that wakes the daemon, and its key groups.
pub struct RawSession {
    pub sock: std::os::unix::net::UnixStream,
    pub seg: stator_shm::Segment,
    pub to_daemon: stator_ring::Doorbell,
    pub key_groups: (u16, u16),
}

/// The `Open` frame of subtask `subtask` of `parallelism` of `job`
/// (operator `op`, 256 entries per queue, a 1 MiB arena).
pub fn open_frame(job: &str, subtask: u32, parallelism: u32) -> Vec<u8> {
    let mut f = Vec::new();
    stator_ring::control::Request::Open {
        version: stator_ring::control::CONTROL_VERSION,
        job: job.into(),
        operator: "op".into(),
        subtask,
        parallelism,
        max_parallelism: 128,
        sq_entries: 256,
        cq_entries: 256,
        arena_bytes: 1 << 20,
        chunk_slots: 0,
        key_groups: None,
    }
    .encode(&mut f)
    .unwrap();
    f
}

/// Opens the session [`open_frame`] describes, by hand.
pub fn raw_session(
    socket: &Path,
    job: &str,
    subtask: u32,
    parallelism: u32,
) -> std::io::Result<RawSession> {
    use stator_ring::control::{Response, frame_len};
    use std::io::{Error as IoError, Write};
    let mut sock = std::os::unix::net::UnixStream::connect(socket)?;
    sock.write_all(&open_frame(job, subtask, parallelism))?;
    let mut buf = vec![0u8; 70 * 1024];
    let (n, mut fds) = stator_shm::fdpass::recv_fds(&sock, &mut buf).map_err(IoError::other)?;
    let frame = n >= 4 && frame_len(buf[..4].try_into().unwrap()).is_ok_and(|len| n == len + 4);
    let opened = frame.then(|| Response::decode(&buf[4..n]).ok()).flatten();
    let Some(Response::Opened {
        key_group_lo,
        key_group_hi,
        ..
    }) = opened
    else {
        return Err(IoError::other(format!("not opened: {opened:?}")));
    };
    if fds.len() != 3 {
        return Err(IoError::other(format!("{} fds with Opened", fds.len())));
    }
    // The daemon's doorbell to us is never waited on: dropped.
    fds.pop();
    let to_daemon = stator_ring::Doorbell::from_fd(fds.pop().unwrap());
    let seg = stator_shm::Segment::attach(fds.pop().unwrap()).map_err(IoError::other)?;
    Ok(RawSession {
        sock,
        seg,
        to_daemon,
        key_groups: (key_group_lo, key_group_hi),
    })
}

impl RawSession {
    /// Registers state `name` of `kind` (`stator_ring::control::kind`).
    pub fn register(&mut self, kind: u8, name: &str) -> std::io::Result<u32> {
        use stator_ring::control::{Request as Ctl, Response, frame_len};
        use std::io::{Error as IoError, Read, Write};
        let mut f = Vec::new();
        Ctl::Register {
            kind,
            name: name.into(),
        }
        .encode(&mut f)
        .unwrap();
        self.sock.write_all(&f)?;
        let mut pre = [0u8; 4];
        self.sock.read_exact(&mut pre)?;
        let len = frame_len(pre).map_err(|e| IoError::other(format!("{e:?}")))?;
        let mut b = vec![0u8; len];
        self.sock.read_exact(&mut b)?;
        match Response::decode(&b) {
            Ok(Response::Registered { state }) => Ok(state),
            r => Err(IoError::other(format!("not registered: {r:?}"))),
        }
    }
}

/// The daemon's `/metrics`, through statorctl.
pub fn metrics(d: &Daemon) -> String {
    let (code, out, err) = statorctl(&[
        "--run-dir",
        &d.dir.join("run").display().to_string(),
        "metrics",
    ]);
    assert_eq!(code, 0, "{err}");
    out
}

/// The value of the first sample of `name` (with its labels, if given)
/// in a `/metrics` text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}
