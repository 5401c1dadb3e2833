//! A full disk under a running `statord`: its data directory is a small
//! tmpfs. Writes go on while memory holds them, then fail with `NoSpace`
//! (not a vague `Busy`); a checkpoint fails with `NoSpace`; every
//! acknowledged write still reads back. Once the operator makes room
//! (the tmpfs grows), the failed flushes are retried, writes and a
//! checkpoint succeed, the failures are counted in `/metrics`, and after a
//! SIGKILL the checkpoint restores every acknowledged write exactly.
//! Needs root (mount); skipped, and says so, without it.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Daemon, collect, metric, metrics, opts, run};
use stator_client::keygroup::{java_long_hash, key_group_for_hash};
use stator_client::{Kind, Request, Session, Status, ValueState};

const VALUE: usize = 1024;

fn kg(k: u64) -> u16 {
    key_group_for_hash(java_long_hash(k as i64), 128)
}

fn value(k: u64) -> Vec<u8> {
    let mut v = vec![(k % 251) as u8; VALUE];
    v[..8].copy_from_slice(&k.to_le_bytes());
    v
}

/// A tmpfs of `mib` at `path`, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: &Path, mib: u64) -> Option<Tmpfs> {
        std::fs::create_dir_all(path).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Tmpfs(path.to_path_buf()))
    }

    fn resize(&self, mib: u64) {
        let st = Command::new("mount")
            .args(["-o", &format!("remount,size={mib}m")])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(st.success(), "remount {}", self.0.display());
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn open(d: &Daemon) -> (Session, ValueState) {
    let mut s = Session::open(&d.socket, &opts("job", 0, 1)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    (s, st)
}

/// Puts keys `from..from+n` in one batch; the statuses, by key.
fn put_batch(s: &mut Session, st: ValueState, from: u64, n: u64) -> Vec<(u64, Status)> {
    for k in from..from + n {
        s.submit(&st.put(kg(k), &k.to_be_bytes(), &value(k)), k)
            .unwrap();
    }
    s.flush().unwrap();
    let mut out = Vec::new();
    collect(s, n as usize, |k, d| out.push((k, d.status.unwrap()))).unwrap();
    out
}

/// Every acknowledged key reads back exactly.
fn check(s: &mut Session, st: ValueState, acked: &BTreeSet<u64>, what: &str) {
    let keys: Vec<u64> = acked.iter().copied().collect();
    for chunk in keys.chunks(512) {
        for k in chunk {
            s.submit(&st.get(kg(*k), &k.to_be_bytes()), *k).unwrap();
        }
        s.flush().unwrap();
        collect(s, chunk.len(), |k, d| {
            assert_eq!(
                d.value.as_deref(),
                Some(&value(k)[..]),
                "{what}: key {k} {:?}",
                d.status
            )
        })
        .unwrap();
    }
}

fn checkpoint(s: &mut Session, id: u64) -> (Status, Option<Vec<u8>>) {
    let d = run(s, &Request::checkpoint(id)).unwrap();
    (d.status.unwrap(), d.value)
}

#[test]
fn a_full_disk_fails_writes_clearly_and_loses_nothing_acknowledged() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(fs) = Tmpfs::mount(&tmp.path().join("data"), 24) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "cannot mount a tmpfs in CI (root is needed)"
        );
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    // 16 MiB of memory, 2 MiB memtables: the disk fills first, then memory.
    let extra = ["--memtable-mib", "2"];
    let d = Daemon::start_in(tmp.path(), 16, &extra);
    let (mut s, st) = open(&d);

    // Write until the disk and then memory are full.
    let mut acked = BTreeSet::new();
    let mut next = 0u64;
    let refused = loop {
        assert!(next < 200_000, "200 MB written into a 24 MiB disk");
        let got = put_batch(&mut s, st, next, 256);
        next += 256;
        let mut refused = None;
        for (k, status) in got {
            match status {
                Status::Ok => {
                    acked.insert(k);
                }
                other => refused = Some(other),
            }
        }
        if let Some(r) = refused {
            break r;
        }
    };
    assert_eq!(refused, Status::NoSpace, "a full disk is named as such");
    assert!(
        acked.len() > 10_000,
        "{} writes before the disk filled",
        acked.len()
    );
    // A checkpoint either fails with NoSpace or (if a retried flush found
    // room the failed one freed) returns a handle that must then restore
    // exactly what was acknowledged before it.
    let first = match checkpoint(&mut s, 1) {
        (Status::NoSpace, _) => None,
        (Status::Ok, h) => Some((h.expect("a handle"), acked.clone())),
        (other, _) => panic!("a checkpoint on a full disk: {other:?}"),
    };
    eprintln!(
        "checkpoint on the full disk: {}",
        if first.is_some() { "taken" } else { "NoSpace" }
    );
    check(&mut s, st, &acked, "while the disk is full");
    assert!(metric(&metrics(&d), "stator_background_failures_total") > 0.0);

    // The operator makes room: the flushes are retried, writes go on.
    fs.resize(256);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = put_batch(&mut s, st, next, 64);
        next += 64;
        let ok = got.iter().all(|(_, st)| *st == Status::Ok);
        for (k, status) in got {
            if status == Status::Ok {
                acked.insert(k);
            }
        }
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "writes never resumed");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, handle) = checkpoint(&mut s, 2);
    assert_eq!(status, Status::Ok);
    let handle = handle.expect("a handle");
    check(&mut s, st, &acked, "after room was made");
    drop(s);

    // A crash, then a restore of the checkpoint: every acknowledged write.
    drop(d);
    let d = Daemon::start_in(tmp.path(), 16, &extra);
    let (mut s, st) = open(&d);
    if let Some((h, before)) = first {
        s.restore(&[&h]).unwrap();
        check(&mut s, st, &before, "the full disk's checkpoint, restored");
    }
    s.restore(&[&handle]).unwrap();
    check(&mut s, st, &acked, "restored after a SIGKILL");
    drop(s);
    drop(d);
    drop(fs);
}
