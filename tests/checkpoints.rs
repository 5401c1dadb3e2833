//! Checkpoints through statord: a barrier in the submission queue whose
//! handle survives kill -9 of the daemon; restore of exactly the
//! checkpointed state; rescale 1 -> 4 -> 1 by references; refused handles
//! (another job, altered, forged) that change nothing; kill -9 at random
//! moments around checkpoints, after which every returned handle restores
//! exactly.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Daemon, collect, opts, run};
use stator_client::keygroup::{java_long_hash, key_group_for_hash};
use stator_client::{Error, Kind, Notify, Request, Session, Status, ValueState};
use stator_ring::control::status::{BAD_REQUEST, RESTORE_REFUSED};

const MAXP: u32 = 128;

fn kg(k: u64) -> u16 {
    key_group_for_hash(java_long_hash(k as i64), MAXP)
}

/// Opens subtask `i` of `p` of job `job`, registers the value state.
fn open(d: &Daemon, job: &str, i: u32, p: u32) -> (Session, ValueState) {
    let mut s = Session::open(&d.socket, &opts(job, i, p)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    (s, st)
}

/// Puts the entries of `m` that fall in the session's key groups and waits
/// for every acknowledgement.
fn put_all(s: &mut Session, st: ValueState, m: &BTreeMap<u64, u64>) {
    let (lo, hi) = s.key_groups();
    let mut n = 0;
    for (k, v) in m.iter().filter(|(k, _)| (lo..=hi).contains(&kg(**k))) {
        let (kb, vb) = (k.to_be_bytes(), v.to_le_bytes());
        s.submit(&st.put(kg(*k), &kb, &vb), *k).unwrap();
        n += 1;
        if n % 1000 == 0 {
            s.flush().unwrap();
            collect(s, 1000, |_, d| assert_eq!(d.status, Ok(Status::Ok))).unwrap();
            n = 0;
        }
    }
    s.flush().unwrap();
    collect(s, n, |_, d| assert_eq!(d.status, Ok(Status::Ok))).unwrap();
}

fn checkpoint(s: &mut Session, id: u64) -> Vec<u8> {
    let d = run(s, &Request::checkpoint(id)).unwrap();
    assert_eq!(d.status, Ok(Status::Ok), "checkpoint {id}");
    d.value.expect("a checkpoint completes with its handle")
}

fn notify(s: &mut Session, id: u64, kind: Notify) {
    let d = run(s, &Request::checkpoint_notify(id, kind)).unwrap();
    assert_eq!(d.status, Ok(Status::Ok));
}

/// Every key of `universe` in the session's range reads as `m` says.
fn check(s: &mut Session, st: ValueState, universe: u64, m: &BTreeMap<u64, u64>, what: &str) {
    let (lo, hi) = s.key_groups();
    for k in (0..universe).filter(|k| (lo..=hi).contains(&kg(*k))) {
        let kb = k.to_be_bytes();
        let d = run(s, &st.get(kg(k), &kb)).unwrap();
        match m.get(&k) {
            Some(v) => assert_eq!(
                d.value.as_deref(),
                Some(&v.to_le_bytes()[..]),
                "{what}: key {k}"
            ),
            None => assert_eq!(d.status, Ok(Status::NotFound), "{what}: key {k}"),
        }
    }
}

#[test]
fn handle_survives_kill_9_and_restores_exactly_then_rescales_by_reference() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_in(tmp.path(), 64, &[]);
    let (mut s, st) = open(&d, "job", 0, 1);
    let m1: BTreeMap<u64, u64> = (0..3000).map(|k| (k, k * 7)).collect();
    put_all(&mut s, st, &m1);
    // The barrier: puts in the same batch before it are in it, after it not.
    let (kb, vb) = (5u64.to_be_bytes(), 1u64.to_le_bytes());
    s.submit(&st.put(kg(5), &kb, &vb), 1).unwrap();
    s.submit(&Request::checkpoint(1), 2).unwrap();
    let (vb2, kb9) = (2u64.to_le_bytes(), 9u64.to_be_bytes());
    s.submit(&st.put(kg(5), &kb, &vb2), 3).unwrap();
    s.submit(&st.delete(kg(9), &kb9), 4).unwrap();
    s.flush().unwrap();
    let mut h1 = None;
    collect(&mut s, 4, |t, c| {
        assert_eq!(c.status, Ok(Status::Ok), "token {t}");
        if t == 2 {
            h1 = c.value;
        }
    })
    .unwrap();
    let h1 = h1.expect("handle");
    let mut want1 = m1.clone();
    want1.insert(5, 1);
    notify(&mut s, 1, Notify::Complete);
    // Later writes, then the daemon dies without a word.
    let m_late: BTreeMap<u64, u64> = (2000..5000).map(|k| (k, k + 1)).collect();
    put_all(&mut s, st, &m_late);
    d.signal(libc::SIGKILL);
    drop(s);
    drop(d);

    let d = Daemon::start_in(tmp.path(), 64, &[]);
    let (mut s, st) = open(&d, "job", 0, 1);
    let r = s.restore(&[&h1]).unwrap();
    assert_eq!(r.checkpoints, 1);
    check(&mut s, st, 5000, &want1, "restored after kill -9");

    // Scale out 1 -> 4: each subtask references the same checkpoint,
    // clipped to its range; then each checkpoints again.
    s.close().unwrap();
    let mut hs2 = Vec::new();
    let mut want2 = want1.clone();
    for i in 0..4 {
        let (mut s, st) = open(&d, "job", i, 4);
        s.restore(&[&h1]).unwrap();
        check(&mut s, st, 5000, &want1, "scaled out to 4");
        // Each writes its own keys (a disjoint part of the key space).
        let mine: BTreeMap<u64, u64> = (0..6000)
            .filter(|k| {
                let (lo, hi) = s.key_groups();
                (lo..=hi).contains(&kg(*k))
            })
            .filter(|k| k % 3 == i as u64 % 3)
            .map(|k| (k, k * 1000 + i as u64))
            .collect();
        put_all(&mut s, st, &mine);
        want2.extend(mine);
        hs2.push(checkpoint(&mut s, 2));
        s.close().unwrap();
    }
    // Scale in 4 -> 1: one session from the four handles.
    let (mut s, st) = open(&d, "job", 0, 1);
    let refs: Vec<&[u8]> = hs2.iter().map(|h| h.as_slice()).collect();
    let r = s.restore(&refs).unwrap();
    assert_eq!(r.checkpoints, 4);
    check(&mut s, st, 6000, &want2, "scaled in to 1");
    notify(&mut s, 2, Notify::Complete);
    // The engine no longer needs checkpoint 1: its handle is refused.
    notify(&mut s, 1, Notify::Subsume);
    match s.restore(&[&h1]) {
        Err(Error::Refused { status, message }) => {
            assert_eq!(status, RESTORE_REFUSED, "{message}");
        }
        other => panic!("a handle past retention was accepted: {other:?}"),
    }
    check(&mut s, st, 6000, &want2, "after a refused restore");
}

#[test]
fn foreign_altered_and_forged_handles_are_refused_and_change_nothing() {
    let d = Daemon::start(64);
    let (mut a, sa) = open(&d, "job-a", 0, 1);
    let m: BTreeMap<u64, u64> = (0..500).map(|k| (k, k)).collect();
    put_all(&mut a, sa, &m);
    let ha = checkpoint(&mut a, 1);
    let (mut b, sb) = open(&d, "job-b", 0, 1);
    let mb: BTreeMap<u64, u64> = (0..500).map(|k| (k, k + 9)).collect();
    put_all(&mut b, sb, &mb);
    let mut altered = ha.clone();
    altered[9] ^= 0x40;
    let mut forged = ha.clone();
    forged[8..16].copy_from_slice(&77u64.to_le_bytes());
    for (what, h) in [
        ("another job's", ha.clone()),
        ("an altered", altered),
        ("a forged", forged),
        ("a garbage", vec![0xAB; 24]),
        ("an empty", vec![]),
    ] {
        match b.restore(&[&h]) {
            Err(Error::Refused { status, message }) => {
                assert_eq!(status, RESTORE_REFUSED, "{what}: {message}");
                assert!(!message.is_empty());
            }
            other => panic!("{what} handle was accepted: {other:?}"),
        }
        check(&mut b, sb, 500, &mb, what);
    }
    check(&mut a, sa, 500, &m, "the other job");
}

#[test]
fn kill_9_at_random_moments_around_checkpoints_loses_no_returned_handle() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // (handle, the state it must restore)
    let mut returned: Vec<(Vec<u8>, BTreeMap<u64, u64>)> = Vec::new();
    let mut id = 0u64;
    for round in 0..6 {
        let d = Daemon::start_in(tmp.path(), 64, &[]);
        let (mut s, st) = open(&d, "crashy", 0, 1);
        // Restore the newest returned handle: the model continues from it.
        // (The first round starts empty and takes one checkpoint first.)
        let mut m = match returned.last() {
            Some((h, want)) => {
                s.restore(&[h]).unwrap();
                want.clone()
            }
            None => {
                id += 1;
                returned.push((checkpoint(&mut s, id), BTreeMap::new()));
                BTreeMap::new()
            }
        };
        check(&mut s, st, 2000, &m, &format!("round {round} start"));
        // Writes and checkpoints in flight together; kill -9 after a random
        // delay, while some are unanswered.
        let killer = {
            let pid = d.pid();
            let delay = Duration::from_micros(next() % 300_000);
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                // SAFETY: kill(2) on the daemon child's pid.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            })
        };
        let mut pending: BTreeMap<u64, BTreeMap<u64, u64>> = BTreeMap::new();
        'work: for _ in 0..50 {
            for _ in 0..50 {
                let k = next() % 2000;
                let v = next();
                let (kb, vb) = (k.to_be_bytes(), v.to_le_bytes());
                if s.submit(&st.put(kg(k), &kb, &vb), u64::MAX).is_err() {
                    break 'work;
                }
                m.insert(k, v);
            }
            id += 1;
            if s.submit(&Request::checkpoint(id), id).is_err() {
                break;
            }
            pending.insert(id, m.clone());
            if s.flush().is_err() {
                break;
            }
            let r = s.poll(|c| {
                if c.token != u64::MAX && c.status == Ok(Status::Ok) {
                    let want = pending.remove(&c.token).expect("a checkpoint token");
                    returned.push((c.value.expect("handle").to_vec(), want));
                }
            });
            if r.is_err() {
                break;
            }
        }
        // Drain what the daemon still answers before it dies.
        let _ = collect_until_gone(&mut s, &mut pending, &mut returned);
        killer.join().unwrap();
        eprintln!(
            "round {round}: {} handles returned, {} checkpoints unanswered",
            returned.len(),
            pending.len()
        );
        drop(s);
        drop(d);
    }
    // Every handle ever returned restores exactly (retention keeps them:
    // no checkpoint was completed).
    let d = Daemon::start_in(tmp.path(), 64, &[]);
    assert!(
        !returned.is_empty(),
        "no checkpoint completed before the kills"
    );
    for (i, (h, want)) in returned.iter().enumerate() {
        let (mut s, st) = open(&d, "crashy", 0, 1);
        s.restore(&[h]).unwrap();
        check(&mut s, st, 2000, want, &format!("returned handle {i}"));
        s.close().unwrap();
    }
}

fn collect_until_gone(
    s: &mut Session,
    pending: &mut BTreeMap<u64, BTreeMap<u64, u64>>,
    returned: &mut Vec<(Vec<u8>, BTreeMap<u64, u64>)>,
) -> Result<(), Error> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !pending.is_empty() && std::time::Instant::now() < deadline {
        s.poll(|c| {
            if c.token != u64::MAX && c.status == Ok(Status::Ok) {
                let want = pending.remove(&c.token).expect("a checkpoint token");
                returned.push((c.value.expect("handle").to_vec(), want));
            }
        })?;
        s.wait(Some(Duration::from_millis(50)))?;
    }
    Ok(())
}

/// Exports the session's state: its chunks.
fn export(s: &mut Session, id: u64) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    s.export_snapshot(id, |c| {
        chunks.push(c.to_vec());
        Ok(())
    })
    .unwrap();
    chunks
}

/// Portable snapshots through statord: an export larger than the chunk
/// region streams through it; it imports into another job (states resolve
/// by name) at another parallelism, each subtask taking its key groups; a
/// corrupted or foreign chunk fails the import with `BadSnapshot` and
/// changes nothing; native and portable interchange (export a restored
/// session; import, then checkpoint and restore); kill -9 in the middle of
/// an import loses nothing acknowledged and installs nothing.
#[test]
fn portable_snapshots_stream_rescale_migrate_and_refuse_bad_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_in(tmp.path(), 256, &[]);
    let mut o = opts("job", 0, 1);
    o.chunk_slots = 2;
    o.read_capacity = 16 << 10;
    let mut s = Session::open(&d.socket, &o).unwrap();
    assert_eq!(s.chunk_slots(), 2);
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    // ~24 MiB of values: six chunks through a region of two.
    let big = |k: u64| -> Vec<u8> { vec![(k % 251) as u8; 8000] };
    let n = 3000u64;
    for k in 0..n {
        let kb = k.to_be_bytes();
        s.submit(&st.put(kg(k), &kb, &big(k)), k).unwrap();
        if k % 200 == 199 {
            s.flush().unwrap();
            collect(&mut s, 200, |_, c| assert_eq!(c.status, Ok(Status::Ok))).unwrap();
        }
    }
    let chunks = export(&mut s, 7);
    assert!(chunks.len() >= 6, "{} chunks", chunks.len());
    assert!(chunks.iter().all(|c| c.len() <= 4 << 20));
    // Written after the export started: not in it.
    let kb = 1u64.to_be_bytes();
    assert_eq!(
        run(&mut s, &st.put(kg(1), &kb, b"later")).unwrap().status,
        Ok(Status::Ok)
    );

    // Another job, parallelism 3: each subtask imports the whole stream and
    // keeps its key groups.
    let mut total = 0;
    for i in 0..3 {
        let mut o = opts("job-2", i, 3);
        o.chunk_slots = 3;
        o.read_capacity = 16 << 10;
        let mut t = Session::open(&d.socket, &o).unwrap();
        let records = t.import_snapshot(1, &chunks).unwrap();
        total += records;
        let tv = ValueState(t.register("v", Kind::Value).unwrap());
        let (lo, hi) = t.key_groups();
        for k in (0..n).step_by(7).filter(|k| (lo..=hi).contains(&kg(*k))) {
            let kb = k.to_be_bytes();
            let got = run(&mut t, &tv.get(kg(k), &kb)).unwrap();
            assert!(
                got.value == Some(big(k)),
                "subtask {i}, key {k}: {:?} (records {records})",
                got.status
            );
        }
    }
    assert_eq!(total, n, "every record in exactly one subtask");

    // Bad chunks: corrupted, or from another snapshot. Nothing changes.
    let other = export(&mut s, 8);
    for (what, bad) in [
        ("corrupt", {
            let mut c = chunks.clone();
            c[2][1000] ^= 0x40;
            c
        }),
        ("foreign", {
            let mut c = chunks.clone();
            c[3] = other[3].clone();
            c
        }),
    ] {
        match s.import_snapshot(2, &bad) {
            Err(Error::Status(Status::BadSnapshot)) => {}
            r => panic!("{what}: {r:?}"),
        }
        let got = run(&mut s, &st.get(kg(1), &kb)).unwrap();
        assert_eq!(got.value.as_deref(), Some(&b"later"[..]), "{what}");
    }

    // Native and portable interchange: checkpoint, restore in a new
    // session, export that; import it, checkpoint, restore.
    let h = checkpoint(&mut s, 1);
    s.close().unwrap();
    let mut s = Session::open(&d.socket, &o).unwrap();
    s.restore(&[&h]).unwrap();
    let again = export(&mut s, 9);
    assert_eq!(s.import_snapshot(3, &again).unwrap(), n);
    let h2 = checkpoint(&mut s, 2);
    s.close().unwrap();
    let mut s = Session::open(&d.socket, &o).unwrap();
    s.restore(&[&h2]).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    let got = run(&mut s, &st.get(kg(1), &kb)).unwrap();
    assert_eq!(got.value.as_deref(), Some(&b"later"[..]));
    let kb2 = 2u64.to_be_bytes();
    assert!(run(&mut s, &st.get(kg(2), &kb2)).unwrap().value == Some(big(2)));

    // kill -9 after half the chunks of an import: nothing of it installed.
    fn imports(dir: &std::path::Path) -> std::collections::BTreeSet<std::path::PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .flatten()
            .flat_map(|e| {
                if e.path().is_dir() {
                    imports(&e.path())
                } else if e.file_name().to_string_lossy().starts_with("imp-") {
                    [e.path()].into()
                } else {
                    Default::default()
                }
            })
            .collect()
    }
    let before = imports(&tmp.path().join("data"));
    for (k, c) in chunks[..3].iter().enumerate() {
        s.write_chunk(k as u32 % 2, c).unwrap();
        s.submit(&Request::snapshot_import(4, k as u32 % 2), k as u64)
            .unwrap();
        s.flush().unwrap();
        collect(&mut s, 1, |_, c| assert_eq!(c.status, Ok(Status::Ok))).unwrap();
    }
    d.signal(libc::SIGKILL);
    drop(s);
    drop(d);
    let d = Daemon::start_in(tmp.path(), 256, &[]);
    let mut s = Session::open(&d.socket, &o).unwrap();
    s.restore(&[&h2]).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    let got = run(&mut s, &st.get(kg(1), &kb)).unwrap();
    assert_eq!(got.value.as_deref(), Some(&b"later"[..]));
    // The cut import's files are gone. (Earlier import files may be gone
    // too: one a compaction merged away is deleted when nothing names it
    // any more, which may happen at this restart.)
    // What the earlier imports installed is still there.
    assert!(run(&mut s, &st.get(kg(2), &kb2)).unwrap().value == Some(big(2)));
    let after = imports(&tmp.path().join("data"));
    assert!(
        after.is_subset(&before),
        "a cut import left files: {:?}",
        after.difference(&before).collect::<Vec<_>>()
    );
}

/// Issue 27 #6: retention follows the engine. Every completed checkpoint
/// stays restorable until the engine says it is subsumed (a COMPLETE used
/// to delete every older checkpoint of the operator at once); one that
/// never completed goes when a newer one completes; `retained_checkpoints`
/// bounds an engine that never subsumes; a COMPLETE for an id the store
/// never took deletes nothing. Retained ones survive a restart.
#[test]
fn completed_checkpoints_stay_until_subsumed_and_the_cap_bounds_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_with_config(tmp.path(), 64, "retained_checkpoints = 3\n");
    let (mut s, st) = open(&d, "retain", 0, 1);
    let mut states = Vec::new();
    let mut handles = Vec::new();
    for id in 1..=3u64 {
        let m: BTreeMap<u64, u64> = (0..500).map(|k| (k, k * 10 + id)).collect();
        put_all(&mut s, st, &m);
        handles.push(checkpoint(&mut s, id));
        notify(&mut s, id, Notify::Complete);
        states.push(m);
    }
    let refused = |s: &mut Session, h: &[u8], what: &str| match s.restore(&[h]) {
        Err(Error::Refused { status, message }) => {
            assert_eq!(status, RESTORE_REFUSED, "{what}: {message}")
        }
        other => panic!("{what} restored: {other:?}"),
    };
    // Flink with num-retained 3 may restore any of them (after a restart
    // too).
    drop(s);
    drop(d);
    let d = Daemon::start_with_config(tmp.path(), 64, "retained_checkpoints = 3\n");
    let (mut s, st) = open(&d, "retain", 0, 1);
    for (i, h) in handles.iter().enumerate() {
        s.restore(&[h]).unwrap();
        check(
            &mut s,
            st,
            500,
            &states[i],
            &format!("checkpoint {}", i + 1),
        );
    }
    // It subsumes 1: gone; 2 stays.
    notify(&mut s, 1, Notify::Subsume);
    refused(&mut s, &handles[0], "a subsumed checkpoint");
    s.restore(&[&handles[1]]).unwrap();
    check(
        &mut s,
        st,
        500,
        &states[1],
        "checkpoint 2 after 1 was subsumed",
    );
    // A checkpoint that never completed goes when a newer one completes.
    let h4 = checkpoint(&mut s, 4);
    let h5 = checkpoint(&mut s, 5);
    notify(&mut s, 5, Notify::Complete);
    refused(
        &mut s,
        &h4,
        "a checkpoint older than a completed one that never completed",
    );
    // The cap (3 completed: 5, 3, 2) holds without a subsume: 6 pushes 2 out.
    let h6 = checkpoint(&mut s, 6);
    notify(&mut s, 6, Notify::Complete);
    refused(
        &mut s,
        &handles[1],
        "a completed checkpoint past retained_checkpoints",
    );
    for h in [&handles[2], &h5, &h6] {
        s.restore(&[h]).unwrap();
    }
    // A COMPLETE for a checkpoint the store never took (a savepoint the
    // engine took elsewhere, a stray id) deletes nothing: 7 stays pending
    // and restorable.
    let h7 = checkpoint(&mut s, 7);
    notify(&mut s, 99, Notify::Complete);
    s.restore(&[&h7]).unwrap();
    for h in [&handles[2], &h5, &h6] {
        s.restore(&[h]).unwrap();
    }
}

/// Flink's discard of a checkpoint handle (a cancelled job's checkpoints,
/// subsumed or aborted ones) reaches statord as a `Release` with no
/// session, as the JobManager sends it: only the checkpoints it names go,
/// for the operator named only, completed or not, and stay gone after a
/// restart; a release repeats harmlessly; one with a handle that does not
/// decode is refused whole.
#[test]
fn a_released_checkpoint_goes_for_its_operator_only() {
    let tmp = tempfile::tempdir().unwrap();
    let d = Daemon::start_with_config(tmp.path(), 64, "");
    let m: BTreeMap<u64, u64> = (0..500).map(|k| (k, k + 1)).collect();
    let mut handles = Vec::new();
    for i in 0..2 {
        let (mut s, st) = open(&d, "rel", i, 2);
        put_all(&mut s, st, &m);
        handles.push(checkpoint(&mut s, 1));
        notify(&mut s, 1, Notify::Complete);
    }
    let release = |job: &str, op: &str, hs: &[&[u8]]| {
        stator_client::release_checkpoints(&d.socket, job, op, hs)
    };
    let h1: &[u8] = &handles[1];
    let mut altered = handles[1].clone();
    altered[9] ^= 0x40;
    for (what, bad) in [("altered", &altered[..]), ("short", &handles[1][..20])] {
        match release("rel", "op", &[h1, bad]) {
            Err(Error::Refused { status, message }) => {
                assert_eq!(status, BAD_REQUEST, "{what}: {message}")
            }
            other => panic!("a release with an {what} handle: {other:?}"),
        }
    }
    assert_eq!(release("rel-other", "op", &[h1]).unwrap(), 0, "another job");
    assert_eq!(
        release("rel", "other-op", &[h1]).unwrap(),
        0,
        "another operator"
    );
    assert_eq!(release("rel", "op", &[h1]).unwrap(), 1);
    assert_eq!(release("rel", "op", &[h1]).unwrap(), 0, "again");
    drop(d);
    let d = Daemon::start_with_config(tmp.path(), 64, "");
    let (mut s1, _) = open(&d, "rel", 1, 2);
    match s1.restore(&[h1]) {
        Err(Error::Refused { status, message }) => {
            assert_eq!(status, RESTORE_REFUSED, "{message}")
        }
        other => panic!("a released checkpoint restored: {other:?}"),
    }
    let (mut s0, st0) = open(&d, "rel", 0, 2);
    s0.restore(&[&handles[0]]).unwrap();
    check(&mut s0, st0, 500, &m, "the subtask whose checkpoint stays");
}
