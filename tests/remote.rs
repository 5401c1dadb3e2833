//! The remote tier through statord, against a real S3-compatible server on
//! loopback (`s3s-fs`): a checkpoint's handle is returned once its segments
//! and manifest are durable remotely; a new daemon with an empty data
//! directory restores it and rescales it (two subtasks) reading lazily;
//! the server stopped: a checkpoint fails with `REMOTE`, the session keeps
//! serving; restarted: the next checkpoint succeeds and restores exactly on
//! another empty disk. `/metrics` shows the tier. statord SIGKILLed while
//! an upload hangs: every handle it returned restores exactly after a
//! restart, and the unacknowledged checkpoint's state appears nowhere.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::s3::{BUCKET, Fault, KEY, Proxy, SECRET, Server};
use common::{Daemon, collect, metric, metrics, opts, run};
use stator_client::keygroup::{java_long_hash, key_group_for_hash};
use stator_client::{Kind, Notify, Request, Session, Status, ValueState};

const MAXP: u32 = 128;
const KEYS: u64 = 20_000;

fn kg(k: u64) -> u16 {
    key_group_for_hash(java_long_hash(k as i64), MAXP)
}

fn open(d: &Daemon, i: u32, p: u32) -> (Session, ValueState) {
    let mut s = Session::open(&d.socket, &opts("job", i, p)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    (s, st)
}

fn put_all(s: &mut Session, st: ValueState, m: &BTreeMap<u64, u64>) {
    let mut n = 0;
    for (k, v) in m {
        s.submit(&st.put(kg(*k), &k.to_be_bytes(), &v.to_le_bytes()), *k)
            .unwrap();
        n += 1;
        if n == 1000 {
            s.flush().unwrap();
            collect(s, n, |_, d| assert_eq!(d.status, Ok(Status::Ok))).unwrap();
            n = 0;
        }
    }
    s.flush().unwrap();
    collect(s, n, |_, d| assert_eq!(d.status, Ok(Status::Ok))).unwrap();
}

/// Every key of the session's key groups reads as `m` says; many gets in
/// flight at once.
fn check(s: &mut Session, st: ValueState, m: &BTreeMap<u64, u64>, what: &str) {
    let (lo, hi) = s.key_groups();
    let keys: Vec<u64> = (0..KEYS + 10)
        .filter(|k| (lo..=hi).contains(&kg(*k)))
        .collect();
    for chunk in keys.chunks(512) {
        for k in chunk {
            s.submit(&st.get(kg(*k), &k.to_be_bytes()), *k).unwrap();
        }
        s.flush().unwrap();
        collect(s, chunk.len(), |k, d| match m.get(&k) {
            Some(v) => assert_eq!(
                d.value.as_deref(),
                Some(&v.to_le_bytes()[..]),
                "{what}: key {k} {d:?}"
            ),
            None => assert_eq!(d.status, Ok(Status::NotFound), "{what}: key {k}"),
        })
        .unwrap();
    }
}

fn checkpoint(s: &mut Session, id: u64) -> Result<Vec<u8>, Status> {
    let d = run(s, &Request::checkpoint(id)).unwrap();
    match d.status {
        Ok(Status::Ok) => Ok(d.value.expect("a handle")),
        Ok(st) => Err(st),
        Err(v) => panic!("unknown status {v}"),
    }
}

fn notify(s: &mut Session, id: u64) {
    let d = run(s, &Request::checkpoint_notify(id, Notify::Complete)).unwrap();
    assert_eq!(d.status, Ok(Status::Ok));
}

fn config(dir: &Path, port: u16) -> String {
    let p = dir.join("statord.toml");
    std::fs::write(
        &p,
        format!(
            r#"memtable_mib = 1
[remote]
enabled = true
bucket = "{BUCKET}"
endpoint = "http://127.0.0.1:{port}"
region = "us-east-1"
access_key_id = "{KEY}"
secret_access_key = "{SECRET}"
allow_http = true
prefix = "host/stator"
local_cache_mib = 1
timeout_ms = 2000
retries = 1
backoff_ms = 20
"#
        ),
    )
    .unwrap();
    p.display().to_string()
}

#[test]
fn checkpoints_restore_and_rescale_through_the_remote_tier() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("s3");
    let mut server = Server::start(&root, 0);
    let port = server.port;
    let cfg = config(tmp.path(), port);
    let extra = ["--config", cfg.as_str()];
    let want: BTreeMap<u64, u64> = (0..KEYS).map(|k| (k, k * 7 + 1)).collect();

    // Host A: state, a checkpoint durable remotely.
    let a = Daemon::start_in(&tmp.path().join("a"), 64, &extra);
    let (mut s, st) = open(&a, 0, 1);
    put_all(&mut s, st, &want);
    let h1 = checkpoint(&mut s, 1).unwrap();
    notify(&mut s, 1);
    let m = metrics(&a);
    assert!(
        metric(&m, "stator_remote_bytes_uploaded_total") > 0.0,
        "{m}"
    );
    drop(s);
    drop(a);

    // Host B: an empty data directory, the same remote.
    let b_dir = tmp.path().join("b");
    let b = Daemon::start_in(&b_dir, 64, &extra);
    let (mut s, st) = open(&b, 0, 1);
    s.restore(&[&h1]).unwrap();
    check(&mut s, st, &want, "restored on an empty disk");
    let m = metrics(&b);
    assert!(
        metric(&m, "stator_remote_block_reads_total{source=\"remote\"}") > 0.0,
        "{m}"
    );
    assert!(metric(&m, "stator_remote_get_duration_seconds_count") > 0.0);
    assert!(metric(&m, "stator_remote_bytes_fetched_total") > 0.0);
    // Rescale on B: two subtasks, each restores its half from the handle.
    let halves: Vec<(Session, ValueState)> = (0..2).map(|i| open(&b, i, 2)).collect();
    for (mut h, hst) in halves {
        h.restore(&[&h1]).unwrap();
        let part: BTreeMap<u64, u64> = want
            .iter()
            .filter(|(k, _)| (h.key_groups().0..=h.key_groups().1).contains(&kg(**k)))
            .map(|(k, v)| (*k, *v))
            .collect();
        check(&mut h, hst, &part, "rescaled");
    }

    // The server stops: a checkpoint fails clearly; the session serves on.
    server.stop();
    let late: BTreeMap<u64, u64> = (KEYS..KEYS + 10).map(|k| (k, k)).collect();
    put_all(&mut s, st, &late);
    assert_eq!(checkpoint(&mut s, 2), Err(Status::Remote));
    let d = run(&mut s, &st.get(kg(KEYS), &KEYS.to_be_bytes())).unwrap();
    assert_eq!(d.value.as_deref(), Some(&KEYS.to_le_bytes()[..]));
    // Restarted: the next checkpoint uploads what was missing.
    let server = Server::start(&root, port);
    let h3 = checkpoint(&mut s, 3).unwrap();
    notify(&mut s, 3);
    drop(s);
    drop(b);

    // Host C: another empty disk restores checkpoint 3 exactly.
    let c = Daemon::start_in(&tmp.path().join("c"), 64, &extra);
    let (mut s, st) = open(&c, 0, 1);
    s.restore(&[&h3]).unwrap();
    let mut all = want.clone();
    all.extend(late);
    check(&mut s, st, &all, "restored after the outage");
    drop(server);
}

/// statord SIGKILLed while a checkpoint's upload hangs on the wire: that
/// checkpoint was never acknowledged. Restarted on the same data directory,
/// every handle returned before restores exactly (not the newer state),
/// and the next checkpoint uploads what it needs and restores exactly on an
/// empty disk (after a restore refused with `REMOTE` while the server
/// hung).
#[test]
fn sigkill_during_an_upload_loses_no_returned_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let proxy = Proxy::start(server.port, Fault::None);
    let cfg = config(tmp.path(), proxy.port);
    let extra = ["--config", cfg.as_str()];
    let want: BTreeMap<u64, u64> = (0..KEYS).map(|k| (k, k * 7 + 1)).collect();
    let newer: BTreeMap<u64, u64> = (0..KEYS).map(|k| (k, k * 7 + 2)).collect();

    let a_dir = tmp.path().join("a");
    let mut a = Daemon::start_in(&a_dir, 64, &extra);
    let (mut s, st) = open(&a, 0, 1);
    put_all(&mut s, st, &want);
    let h1 = checkpoint(&mut s, 1).unwrap();
    notify(&mut s, 1);
    put_all(&mut s, st, &newer);
    // The server takes the upload's bytes and never answers.
    proxy.set(Fault::Stall);
    let pending = std::thread::spawn(move || {
        let r = run(&mut s, &Request::checkpoint(2));
        drop(s);
        r.map(|d| d.status)
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while metric(&metrics(&a), "stator_remote_uploads_pending") == 0.0 {
        assert!(std::time::Instant::now() < deadline, "no upload started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    a.signal(libc::SIGKILL);
    a.wait_exit(std::time::Duration::from_secs(10));
    let r = pending.join().unwrap();
    assert!(
        !matches!(r, Ok(Ok(Status::Ok))),
        "a checkpoint acknowledged across a SIGKILL: {r:?}"
    );
    proxy.set(Fault::None);

    // Restarted on the same directory: checkpoint 1 is exactly as returned.
    let a = Daemon::start_in(&a_dir, 64, &extra);
    let (mut s, st) = open(&a, 0, 1);
    s.restore(&[&h1]).unwrap();
    check(&mut s, st, &want, "restored after SIGKILL");
    let h3 = checkpoint(&mut s, 3).unwrap();
    notify(&mut s, 3);
    drop(s);
    drop(a);

    // An empty disk restores checkpoint 3 (= checkpoint 1's state); while
    // the server hangs, the restore is answered REMOTE and changes nothing.
    let b = Daemon::start_in(&tmp.path().join("b"), 64, &extra);
    let (mut s, st) = open(&b, 0, 1);
    proxy.set(Fault::Stall);
    match s.restore(&[&h3]) {
        Err(stator_client::Error::Refused { status, message }) => {
            assert_eq!(status, stator_ring::control::status::REMOTE, "{message}")
        }
        other => panic!("a restore through a hung server: {other:?}"),
    }
    proxy.set(Fault::None);
    s.restore(&[&h3]).unwrap();
    check(&mut s, st, &want, "checkpoint 3 on an empty disk");
}
