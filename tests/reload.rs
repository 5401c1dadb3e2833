//! SIGHUP re-reads the configuration: the log filter and the limits
//! change at once, other changed keys are named as waiting for a restart,
//! and an invalid file changes nothing (statord serves on).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use stator_client::{OpenOptions, Request, Session};

/// Waits for a stderr line containing `what`; the lines seen before it.
fn expect_line(rx: &Receiver<String>, what: &str) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(what) => return seen,
            Ok(l) => seen.push(l),
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                panic!("no line with {what:?}; saw {seen:#?}")
            }
        }
    }
}

#[test]
fn sighup_reloads_the_log_filter_and_names_what_needs_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("statord.toml");
    let base = format!(
        "data_dir = {:?}\nrun_dir = {:?}\nshards = 1\nmemory_budget_mib = 128\n",
        tmp.path().join("data"),
        tmp.path().join("run")
    );
    std::fs::write(&file, format!("{base}log = \"warn\"\n")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_statord"))
        .arg("--config")
        .arg(&file)
        .env_remove("STATOR_LOG")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn statord");
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let socket = tmp.path().join("run/stator.sock");
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "statord did not come up");
        std::thread::sleep(Duration::from_millis(10));
    }
    let hup = |pid: u32| {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    };

    // At `warn`, a session opening logs nothing.
    let s = Session::open(&socket, &OpenOptions::new("reload", "op")).unwrap();
    s.close().unwrap();

    // `log` to info, `shards` to 2: the first applies, the second waits.
    std::fs::write(
        &file,
        format!(
            "{}log = \"info\"\n",
            base.replace("shards = 1", "shards = 2")
        ),
    )
    .unwrap();
    hup(child.id());
    let before = expect_line(&rx, "configuration reloaded");
    assert!(
        before
            .iter()
            .any(|l| l.contains("takes effect at the next restart") && l.contains("shards")),
        "{before:#?}"
    );
    assert!(
        !before.iter().any(|l| l.contains("session opened")),
        "{before:#?}"
    );
    let mut s = Session::open(&socket, &OpenOptions::new("reload", "op")).unwrap();
    expect_line(&rx, "session opened");
    // A checkpoint gets its line (requests do not).
    s.submit(&Request::checkpoint(7), 1).unwrap();
    s.flush().unwrap();
    let mut done = false;
    while !done {
        s.wait(Some(Duration::from_secs(5))).unwrap();
        s.poll(|c| done |= c.token == 1 && c.check().is_ok())
            .unwrap();
    }
    let l = expect_line(&rx, "checkpoint taken");
    assert!(!l.iter().any(|l| l.contains("request")), "{l:#?}");
    s.close().unwrap();

    // An invalid file: nothing changes, and statord serves on.
    std::fs::write(
        &file,
        format!("{base}log = \"info\"\n[session]\nsq_entries = 1000\n"),
    )
    .unwrap();
    hup(child.id());
    expect_line(&rx, "configuration not reloaded");
    let s = Session::open(&socket, &OpenOptions::new("reload", "op")).unwrap();
    s.close().unwrap();

    // Limits change at runtime: max_sessions to 1 refuses a second
    // session at once (no restart named), and back to 2 allows it.
    std::fs::write(&file, format!("{base}log = \"info\"\nmax_sessions = 1\n")).unwrap();
    hup(child.id());
    let before = expect_line(&rx, "configuration reloaded");
    assert!(
        !before.iter().any(|l| l.contains("next restart")),
        "{before:#?}"
    );
    let one = Session::open(&socket, &OpenOptions::new("reload", "op")).unwrap();
    match Session::open(&socket, &OpenOptions::new("reload", "op2")) {
        Err(stator_client::Error::Refused { message, .. }) => {
            assert!(message.contains("max_sessions"), "{message}")
        }
        other => panic!("a second session was not refused: {:?}", other.err()),
    }
    std::fs::write(&file, format!("{base}log = \"info\"\nmax_sessions = 2\n")).unwrap();
    hup(child.id());
    expect_line(&rx, "configuration reloaded");
    let two = Session::open(&socket, &OpenOptions::new("reload", "op2")).unwrap();
    one.close().unwrap();
    two.close().unwrap();

    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "statord exited with {status}");
}
