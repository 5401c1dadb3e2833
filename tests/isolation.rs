//! Multi-tenant isolation through a real `statord`: a job belongs to the
//! first uid that opens it; a session of another uid cannot open it, so it
//! cannot read, write, restore or abort its state; a handle of one job is
//! refused by another; the control socket refuses uids not allowed; no uid
//! holds more than `max_sessions_per_uid` sessions. The other uids are
//! real: this test binary re-executes itself as them.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use common::{Daemon, opts, run};
use stator_client::keygroup::{java_long_hash, key_group_for_hash};
use stator_client::{Error, Kind, Notify, Request, Session, Status, ValueState};

/// The script a re-executed child runs (see [`child`]).
const SCRIPT: &str = "STATOR_ISOLATION_SCRIPT";
const SOCKET: &str = "STATOR_ISOLATION_SOCKET";

fn kg(k: u64) -> u16 {
    key_group_for_hash(java_long_hash(k as i64), 128)
}

/// Runs `script` as `uid` (a child process of this test binary, running
/// only [`child`]); returns what it reported.
fn as_uid(uid: u32, socket: &Path, script: &str) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(SCRIPT, script)
        .env(SOCKET, socket)
        .uid(uid)
        .gid(uid)
        .output()
        .expect("re-execute the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child as uid {uid} ({script}) failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("child as uid {uid} ({script}) reported nothing: {stdout}"))
        .to_string()
}

/// What a child does: `open|put|get|restore|abort|release JOB [ARG]`, `hold JOB N`
/// (N sessions of JOB open at once), or `flood JOB N DIR` (N connections
/// that send nothing, then an open of JOB; then it creates `DIR/ready`
/// and holds them until `DIR/done` exists). Prints one `RESULT` line:
/// `ok ...`, `refused <message>` when the daemon said no, or `error ...`.
/// Ignored: not a test of its own (run with `--ignored --exact`).
#[test]
#[ignore = "a child process of the isolation tests"]
fn child() {
    let script =
        std::env::var(SCRIPT).expect("run by the isolation tests (STATOR_ISOLATION_SCRIPT)");
    let socket = std::env::var(SOCKET).unwrap();
    let w: Vec<&str> = script.split(' ').collect();
    let result = (|| -> Result<String, Error> {
        if w[0] == "flood" {
            let n: usize = w[2].parse().unwrap();
            let dir = std::path::Path::new(w[3]);
            let held: Vec<_> = (0..n)
                .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
                .collect();
            // Let the daemon count them before the open.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let r = Session::open(&socket, &opts(w[1], 0, 1)).map(|_| "ok".to_string());
            std::fs::write(dir.join("ready"), b"").unwrap();
            while !dir.join("done").exists() {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            drop(held);
            return r;
        }
        if w[0] == "hold" {
            // Closed explicitly (Close is answered once the daemon gave
            // the slot back), so the next child finds them given back.
            let n: u32 = w[2].parse().unwrap();
            let mut held = Vec::new();
            let mut refused = None;
            for i in 0..n {
                match Session::open(&socket, &opts(w[1], i, n)) {
                    Ok(s) => held.push(s),
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                }
            }
            let opened = held.len();
            for s in held {
                s.close()?;
            }
            return match refused {
                Some(e) => Err(e),
                None => Ok(format!("ok {opened}")),
            };
        }
        if w[0] == "release" {
            // No session: as Flink's JobManager releases a discarded one.
            let n = stator_client::release_checkpoints(&socket, w[1], "op", &[&unhex(w[2])])?;
            return Ok(format!("ok {n}"));
        }
        let mut s = Session::open(&socket, &opts(w[1], 0, 1))?;
        let st = ValueState(s.register("v", Kind::Value)?);
        let key = 7u64.to_be_bytes();
        Ok(match w[0] {
            "open" => "ok".into(),
            "put" => {
                let d = run(&mut s, &st.put(kg(7), &key, w[2].as_bytes()))?;
                assert_eq!(d.status, Ok(Status::Ok));
                let d = run(&mut s, &Request::checkpoint(1))?;
                assert_eq!(d.status, Ok(Status::Ok));
                format!("ok {}", hex(&d.value.unwrap()))
            }
            "get" => {
                let d = run(&mut s, &st.get(kg(7), &key))?;
                let v = d.value.map(|v| String::from_utf8(v).unwrap());
                format!("ok {}", v.as_deref().unwrap_or("<none>"))
            }
            "restore" => {
                s.restore(&[&unhex(w[2])])?;
                "ok".into()
            }
            "abort" => {
                let d = run(
                    &mut s,
                    &Request::checkpoint_notify(w[2].parse().unwrap(), Notify::Abort),
                )?;
                format!("ok {:?}", d.status)
            }
            other => panic!("unknown script {other}"),
        })
    })();
    match result {
        Ok(r) => println!("RESULT {r}"),
        Err(Error::Refused { message, .. }) => println!("RESULT refused {message}"),
        Err(e) => println!("RESULT error {e}"),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn jobs_belong_to_their_first_uid_and_no_other_uid_reaches_them() {
    if !nix::unistd::geteuid().is_root() {
        // Counted as passed, so only where nobody relies on it: CI runs as
        // root and must not pass a test that did nothing.
        assert!(
            std::env::var_os("CI").is_none(),
            "switching uids needs root, and CI runs as root"
        );
        eprintln!("SKIPPED: switching uids needs root");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    // Other uids must reach the socket through the test's directory.
    std::fs::set_permissions(
        tmp.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let allow = [
        "--allow-uid",
        "0",
        "--allow-uid",
        "1000",
        "--allow-uid",
        "1001",
    ];
    let cfg = tmp.path().join("statord.toml");
    std::fs::write(&cfg, "max_sessions_per_uid = 2\n").unwrap();
    let allow = [&allow[..], &["--config", cfg.to_str().unwrap()]].concat();
    let d = Daemon::start_in(tmp.path(), 64, &allow);
    let sock = d.socket.clone();

    // Tenant 1000 owns job-a, tenant 1001 job-b; each writes and checkpoints.
    let ha = as_uid(1000, &sock, "put job-a from-a");
    let ha = ha
        .strip_prefix("ok ")
        .expect("uid 1000 writes job-a")
        .to_string();
    let hb = as_uid(1001, &sock, "put job-b from-b");
    let hb = hb
        .strip_prefix("ok ")
        .expect("uid 1001 writes job-b")
        .to_string();

    // 1001 cannot open job-a, so it can neither read, write, restore nor
    // abort anything of it.
    for script in [
        "open job-a".to_string(),
        "get job-a".to_string(),
        "put job-a overwritten".to_string(),
        format!("restore job-a {ha}"),
        "abort job-a 1".to_string(),
        format!("release job-a {ha}"),
    ] {
        let r = as_uid(1001, &sock, &script);
        assert!(
            r.starts_with("refused") && r.contains("belongs to uid 1000"),
            "uid 1001 `{script}`: {r}"
        );
    }
    // A handle of one job is refused by the other, in both directions,
    // and changes nothing.
    let r = as_uid(1000, &sock, &format!("restore job-a {hb}"));
    assert!(
        r.starts_with("refused") && r.contains("belongs to another job"),
        "job-b's handle restored into job-a: {r}"
    );
    let r = as_uid(1001, &sock, &format!("restore job-b {ha}"));
    assert!(
        r.starts_with("refused") && r.contains("belongs to another job"),
        "job-a's handle restored into job-b: {r}"
    );
    assert_eq!(as_uid(1000, &sock, "get job-a"), "ok from-a");
    assert_eq!(as_uid(1001, &sock, "get job-b"), "ok from-b");
    // No uid holds more than max_sessions_per_uid sessions; closed ones
    // are given back.
    let r = as_uid(1000, &sock, "hold job-a 3");
    assert!(
        r.starts_with("refused") && r.contains("max_sessions_per_uid 2"),
        "uid 1000 held 3 sessions: {r}"
    );
    assert_eq!(as_uid(1000, &sock, "hold job-a 2"), "ok 2");
    assert_eq!(as_uid(1001, &sock, "hold job-b 2"), "ok 2");
    // Nor more than max_sessions_per_uid + 8 connections: one uid holding
    // them (half-open handshakes) does not keep another uid out.
    let flags = tmp.path().join("flags");
    std::fs::create_dir(&flags).unwrap();
    std::fs::set_permissions(&flags, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let flood = {
        let (sock, script) = (sock.clone(), format!("flood job-a 10 {}", flags.display()));
        std::thread::spawn(move || as_uid(1000, &sock, &script))
    };
    while !flags.join("ready").exists() {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(as_uid(1001, &sock, "open job-b"), "ok");
    std::fs::write(flags.join("done"), b"").unwrap();
    let r = flood.join().unwrap();
    // (Answered LIMIT, not reset: issue 27 #1.)
    assert!(
        r.starts_with("refused") && r.contains("max_sessions_per_uid + 8"),
        "uid 1000's 11th connection: {r}"
    );
    // A uid not allowed at all is refused at the socket.
    let r = as_uid(1002, &sock, "open job-c");
    assert!(r.contains("not allowed"), "uid 1002: {r}");

    // Ownership is durable: after a restart 1001 is still refused, and the
    // owner restores its handle.
    drop(d);
    let d = Daemon::start_in(tmp.path(), 64, &allow);
    let r = as_uid(1001, &sock, "get job-a");
    assert!(r.contains("belongs to uid 1000"), "after a restart: {r}");
    assert_eq!(as_uid(1000, &sock, &format!("restore job-a {ha}")), "ok");
    assert_eq!(as_uid(1000, &sock, "get job-a"), "ok from-a");

    // Root (statorctl's exports and imports) may open any job and claims
    // none: the owner keeps it.
    let mut s = Session::open(&d.socket, &opts("job-b", 0, 1)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    let got = run(&mut s, &st.get(kg(7), &7u64.to_be_bytes())).unwrap();
    assert_eq!(got.value.as_deref(), Some(&b"from-b"[..]));
    s.close().unwrap();
    assert_eq!(as_uid(1001, &sock, "get job-b"), "ok from-b");
    // A job root made (an import) has state and no owner: no tenant may
    // take it by opening it first.
    let mut s = Session::open(&d.socket, &opts("job-r", 0, 1)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    run(&mut s, &st.put(kg(7), &7u64.to_be_bytes(), b"root's")).unwrap();
    s.close().unwrap();
    let r = as_uid(1000, &sock, "get job-r");
    assert!(r.contains("no owning uid"), "uid 1000 took job-r: {r}");
    // Releases claim nothing: a tenant releasing in a job no one owns
    // gets 0 and the job stays free; the owner releases its own.
    assert_eq!(
        as_uid(1001, &sock, &format!("release job-free {ha}")),
        "ok 0"
    );
    assert_eq!(as_uid(1000, &sock, &format!("release job-a {ha}")), "ok 1");
    let r = as_uid(1000, &sock, &format!("restore job-a {ha}"));
    assert!(
        r.starts_with("refused"),
        "a released checkpoint restored: {r}"
    );
    let jobs = std::fs::read_to_string(tmp.path().join("data/jobs.json")).unwrap();
    assert!(
        jobs.contains("\"job-a\": 1000")
            && jobs.contains("\"job-b\": 1001")
            && !jobs.contains("job-free"),
        "{jobs}"
    );
}
