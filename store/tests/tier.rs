//! The store with its remote tier, against a real S3-compatible server on
//! loopback (`s3s-fs`) and against a directory:
//! - a checkpoint uploads its segments and manifest before its handle;
//! - restore and rescale on an empty local disk read lazily from the remote;
//! - eviction keeps the local disk under its budget, and evicted segments
//!   are read remotely (also after a reopen) but for the pages gets read
//!   since the eviction before;
//! - garbage collection deletes what no retained checkpoint names, never
//!   what one needs (orphans too, at open);
//! - the server stopped: a checkpoint fails clearly, remote reads fail
//!   alone while local ones go on; restarted: a later checkpoint uploads
//!   what was missing, and nothing acknowledged is lost.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::s3::{Fault, Proxy, Server, s3};
use common::{Owned, checkpoint, run, settle_fully};
use stator_store::io::UringIo;
use stator_store::remote::{Remote, RemoteConfig, RemoteDone, RemoteRuntime, Target, object_store};
use stator_store::{
    CheckpointSpec, KeyRef, Notify, Op, RestoreSpec, Store, StoreConfig, StoreError, TierConfig,
};

const OWNER: &[u8] = b"job\0op";
const STATES: [u32; 1] = [7];
const KGS: u16 = 16;
const KEYS: usize = 12_000;

fn rt() -> &'static RemoteRuntime {
    static RT: OnceLock<RemoteRuntime> = OnceLock::new();
    RT.get_or_init(|| RemoteRuntime::new(2).unwrap())
}

fn remote(target: &Target, prefix: &str) -> Remote {
    let mut cfg = RemoteConfig::new(target.clone());
    cfg.prefix = prefix.into();
    cfg.retries = 1;
    cfg.backoff = Duration::from_millis(20);
    cfg.timeout = Duration::from_secs(3);
    let store = object_store(&cfg).unwrap();
    Remote::new(store, cfg, rt().handle()).unwrap()
}

fn open(
    dir: &Path,
    target: &Target,
    prefix: &str,
    budget: Option<u64>,
) -> Result<Store<UringIo>, StoreError> {
    open_with(dir, target, prefix, budget, None)
}

fn open_with(
    dir: &Path,
    target: &Target,
    prefix: &str,
    budget: Option<u64>,
    block_cache: Option<usize>,
) -> Result<Store<UringIo>, StoreError> {
    let mut cfg = StoreConfig::new(dir, 16 << 20);
    cfg.memtable_bytes = Some(1 << 20);
    cfg.block_cache_max = block_cache;
    cfg.retained_checkpoints = 1;
    let mut t = TierConfig::new(budget);
    t.evict_interval = Duration::ZERO;
    Store::open_tiered(
        cfg,
        UringIo::new(256, true).unwrap(),
        remote(target, prefix),
        t,
    )
    .map(|(s, _)| s)
}

fn key(i: usize) -> (u16, Vec<u8>) {
    (
        (i % KGS as usize) as u16,
        format!("key-{i:08}").into_bytes(),
    )
}

fn kr(kg: u16, k: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: kg,
        state: STATES[0],
        key: k,
        namespace: b"",
    }
}

fn value(i: usize, round: u8) -> Vec<u8> {
    let mut v = vec![round; 180];
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v
}

fn put_all<I: stator_store::io::Io>(s: &mut Store<I>, round: u8) {
    for i in 0..KEYS {
        let (kg, k) = key(i);
        run(s, Op::Put(kr(kg, &k), &value(i, round))).unwrap();
    }
    s.flush();
    settle_fully(s);
}

/// Gets keys `0..n`, all pending at once (the misses of a pass go out
/// together); each key's outcome, in key order.
fn get_all<I: stator_store::io::Io>(s: &mut Store<I>, n: usize) -> Vec<Result<Owned, StoreError>> {
    let mut out: Vec<Option<Result<Owned, StoreError>>> = (0..n).map(|_| None).collect();
    for (i, o) in out.iter_mut().enumerate() {
        let (kg, k) = key(i);
        match s.submit(i as u64, Op::Get(kr(kg, &k))) {
            Ok(stator_store::Submitted::Ready(r)) => *o = Some(Ok(Owned::from(r))),
            Ok(stator_store::Submitted::Pending) => {}
            Err(e) => *o = Some(Err(e)),
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        s.poll(|t, r| out[t as usize] = Some(r.map(Owned::from)));
        let left = out.iter().filter(|o| o.is_none()).count();
        if left == 0 {
            return out.into_iter().map(Option::unwrap).collect();
        }
        assert!(Instant::now() < deadline, "{left} reads never completed");
        s.wait(Some(Duration::from_millis(5))).unwrap();
    }
}

/// Every key in `lo..=hi` reads `round`'s value; the others read nothing.
fn check_all<I: stator_store::io::Io>(s: &mut Store<I>, round: u8, lo: u16, hi: u16) {
    for (i, r) in get_all(s, KEYS).into_iter().enumerate() {
        check_one(i, key(i).0, r.unwrap(), round, lo, hi);
    }
}

fn check_one(i: usize, kg: u16, got: Owned, round: u8, lo: u16, hi: u16) {
    let expect = (lo..=hi).contains(&kg).then(|| value(i, round));
    assert_eq!(got, Owned::Value(expect), "key {i}");
}

/// A store in `dir` loaded with `round`'s values, its checkpoint 1 taken
/// (uploaded) and completed, then closed: the handle.
fn checkpointed(dir: &Path, target: &Target, prefix: &str, round: u8) -> Vec<u8> {
    let mut s = open(dir, target, prefix, None).unwrap();
    put_all(&mut s, round);
    let h = checkpoint(&mut s, spec(1)).unwrap();
    s.checkpoint_notify(OWNER, 1, Notify::Complete);
    settle_fully(&mut s);
    h
}

/// Flips a byte in the first data block of every segment file in `dir`.
fn corrupt_first_blocks(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".sst") {
            let mut b = std::fs::read(e.path()).unwrap();
            b[100] ^= 0x5a;
            std::fs::write(e.path(), &b).unwrap();
        }
    }
}

fn spec(id: u64) -> CheckpointSpec {
    CheckpointSpec {
        owner: OWNER.to_vec(),
        checkpoint_id: id,
        lo: 0,
        hi: KGS - 1,
        states: STATES.to_vec(),
        meta: b"meta".to_vec(),
    }
}

fn restore_spec(lo: u16, hi: u16) -> RestoreSpec<'static> {
    RestoreSpec {
        owner: OWNER,
        lo,
        hi,
        states: &STATES,
    }
}

/// The object names under `prefix`.
fn objects(target: &Target, prefix: &str) -> BTreeSet<String> {
    let mut r = remote(target, prefix);
    r.list(1, "");
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = None;
    while out.is_none() {
        assert!(Instant::now() < deadline);
        r.wait(Duration::from_millis(50));
        r.poll(|_, res| out = Some(res));
    }
    match out.unwrap().unwrap() {
        RemoteDone::Listed(v) => v.into_iter().map(|(n, _)| n).collect(),
        o => panic!("{o:?}"),
    }
}

fn segment_names(names: &BTreeSet<String>) -> BTreeSet<String> {
    names
        .iter()
        .filter(|n| n.ends_with(".sst"))
        .cloned()
        .collect()
}

/// Bytes the store directory's files take on the disk.
fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().blocks() * 512)
        .sum()
}

/// Polls `s` until it has evicted and its directory is within `budget`
/// (and a scan's slack); fails after 30 s with the tier's counters.
fn await_within_budget(s: &mut Store<UringIo>, dir: &Path, budget: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        s.poll(|_, _| {});
        let st = s.stats().remote.unwrap();
        if st.evictions > 0 && disk_bytes(dir) <= budget + (256 << 10) {
            return;
        }
        assert!(Instant::now() < deadline, "never evicted: {st:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Each segment file in `dir` and whether its data has holes (far fewer
/// bytes on the disk than its length).
fn sparse_segments(dir: &Path) -> Vec<(String, bool)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
        .map(|e| {
            let m = e.metadata().unwrap();
            let name = e.file_name().to_string_lossy().to_string();
            (name, m.blocks() * 512 + (64 << 10) < m.len())
        })
        .collect()
}

/// Upload on checkpoint, then restore and rescale on empty local disks.
fn upload_restore_rescale(target: &Target) {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let mut s = open(&a, target, "t/shard-0", None).unwrap();
    put_all(&mut s, 1);
    assert!(s.stats().segments >= 2, "{:?}", s.stats());
    let h = checkpoint(&mut s, spec(1)).unwrap();
    s.checkpoint_notify(OWNER, 1, Notify::Complete);
    settle_fully(&mut s);
    // A checkpoint whose files are all remote already completes too.
    let again = checkpoint(&mut s, spec(9)).unwrap();
    assert!(s.discard_checkpoint(&again));
    settle_fully(&mut s);
    // Every segment the checkpoint names, and its manifest, are remote.
    let names = objects(target, "t/shard-0");
    let local: BTreeSet<String> = std::fs::read_dir(&a)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.ends_with(".sst"))
        .collect();
    let remote_segs = segment_names(&names);
    assert_eq!(
        remote_segs.len(),
        s.checkpoints()[0].segments,
        "every segment the checkpoint names is uploaded: {names:?}"
    );
    assert!(remote_segs.is_subset(&local), "{remote_segs:?} {local:?}");
    assert!(names.iter().any(|n| n.ends_with(".manifest")), "{names:?}");
    assert!(names.iter().any(|n| n.ends_with(".complete")), "{names:?}");
    // The live state moves on; the checkpoint does not.
    run(&mut s, Op::Put(kr(0, b"later"), b"x")).unwrap();
    drop(s);

    // A new host: an empty local disk, the same prefix.
    let b = tmp.path().join("b");
    let mut s = open(&b, target, "t/shard-0", None).unwrap();
    assert_eq!(
        s.checkpoints().len(),
        1,
        "the manifest came from the remote"
    );
    let r = s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    assert_eq!(r.manifests[0].meta, b"meta");
    // Only metadata was fetched: the files are sparse.
    let seg_bytes: u64 = s.stats().segment_bytes;
    assert!(
        disk_bytes(&b) < seg_bytes / 2,
        "restore downloaded data: {} of {} bytes",
        disk_bytes(&b),
        seg_bytes
    );
    check_all(&mut s, 1, 0, KGS - 1);
    let st = s.stats().remote.unwrap();
    assert!(st.remote_block_reads > 0, "{st:?}");
    assert_eq!(
        run(&mut s, Op::Get(kr(0, b"later"))).unwrap(),
        Owned::Value(None)
    );
    // Compaction over remote-only segments reads them remotely and writes
    // a local one; the state is unchanged.
    s.compact_all();
    settle_fully(&mut s);
    check_all(&mut s, 1, 0, KGS - 1);
    drop(s);

    // Rescale: another empty disk takes half the key groups.
    let c = tmp.path().join("c");
    let mut s = open(&c, target, "t/shard-0", None).unwrap();
    s.restore(restore_spec(0, KGS / 2 - 1), &[&h]).unwrap();
    check_all(&mut s, 1, 0, KGS / 2 - 1);
    // Reopened (once the layer list naming them is durable: it is written
    // in the background): the fetched segments are the restore's layers,
    // clipped to its half, never live layers of their own.
    settle_fully(&mut s);
    drop(s);
    let mut s = open(&c, target, "t/shard-0", None).unwrap();
    check_all(&mut s, 1, 0, KGS / 2 - 1);
    assert!(s.stats().remote.unwrap().evicted_segments > 0);
}

#[test]
fn upload_restore_and_rescale_on_empty_disks_s3() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    upload_restore_rescale(&s3(server.port));
}

#[test]
fn upload_restore_and_rescale_on_empty_disks_directory() {
    let tmp = tempfile::tempdir().unwrap();
    upload_restore_rescale(&Target::Local {
        dir: tmp.path().join("remote"),
    });
}

/// The local disk stays within its budget once segments are durable
/// remotely; evicted segments read from the remote, also after a reopen.
#[test]
fn eviction_keeps_the_local_disk_within_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let target = s3(server.port);
    let dir = tmp.path().join("d");
    let budget = 512 << 10;
    let mut s = open(&dir, &target, "e", Some(budget)).unwrap();
    put_all(&mut s, 2);
    // Nothing is evicted before it is durable remotely (eviction uploads
    // what no checkpoint named yet, and evicts it once it is).
    s.poll(|_, _| {});
    let remote = segment_names(&objects(&target, "e"));
    for (name, holes) in sparse_segments(&dir) {
        assert!(
            !holes || remote.contains(&name),
            "{name} evicted, not remote"
        );
    }
    checkpoint(&mut s, spec(1)).unwrap();
    await_within_budget(&mut s, &dir, budget);
    check_all(&mut s, 2, 0, KGS - 1);
    assert!(s.stats().remote.unwrap().remote_block_reads > 0);
    drop(s);
    // Reopened: the holes say which segments are remote.
    let mut s = open(&dir, &target, "e", Some(budget)).unwrap();
    assert!(s.stats().remote.unwrap().evicted_segments > 0);
    check_all(&mut s, 2, 0, KGS - 1);
    drop(s);
    // Without the tier, the store refuses to open (every read of an
    // evicted segment would fail) and says why.
    let mut cfg = StoreConfig::new(&dir, 16 << 20);
    cfg.memtable_bytes = Some(1 << 20);
    let e = Store::open(cfg, UringIo::new(64, true).unwrap())
        .err()
        .expect("refused");
    assert!(e.to_string().contains("remote tier"), "{e}");
}

/// Segments no checkpoint named yet (flushes and compactions between two
/// checkpoints) are uploaded when they alone pass the local cache's
/// budget, then evicted: the budget holds without a checkpoint, and every
/// key reads back, also after a reopen.
#[test]
fn segments_no_checkpoint_named_are_uploaded_to_keep_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let dir = tmp.path().join("d");
    let budget = 512 << 10;
    let mut s = open(&dir, &target, "u", Some(budget)).unwrap();
    put_all(&mut s, 4);
    await_within_budget(&mut s, &dir, budget);
    assert!(s.stats().remote.unwrap().eager_uploads > 0);
    assert!(s.checkpoints().is_empty());
    check_all(&mut s, 4, 0, KGS - 1);
    drop(s);
    let mut s = open(&dir, &target, "u", Some(budget)).unwrap();
    assert!(s.stats().remote.unwrap().evicted_segments > 0);
    check_all(&mut s, 4, 0, KGS - 1);
}

/// Eviction keeps what gets read: an evicted segment keeps the pages gets
/// read since its last eviction, so that a state that is read stays on the
/// local disk while one that is only written goes, though every segment
/// holds both (a Flink job's count, read and updated per record, beside a
/// larger map entry only written). Before, eviction punched whole
/// segments, and most reads of the small state went to the remote.
#[test]
fn eviction_keeps_the_pages_gets_read() {
    const N: usize = 4_000;
    const HOT: u32 = 7;
    const COLD: u32 = 9;
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let dir = tmp.path().join("d");
    let budget = 1 << 20;
    // A block cache far smaller than the read state: its reads reach the
    // disk.
    let mut s = open_with(&dir, &target, "k", Some(budget), Some(16 << 10)).unwrap();
    let at = |i: usize, state: u32| KeyRef {
        key_group: (i % KGS as usize) as u16,
        state,
        key: format!("key-{i:08}").leak().as_bytes(),
        namespace: b"",
    };
    let cold = vec![0x5au8; 400];
    let mut counts = vec![0u64; N];
    for (i, c) in counts.iter_mut().enumerate() {
        *c = i as u64;
        run(&mut s, Op::Put(at(i, HOT), &c.to_le_bytes())).unwrap();
        run(&mut s, Op::Put(at(i, COLD), &cold)).unwrap();
    }
    // Rounds of a job's records: get the count, put it back plus one, put
    // the large value; (reads from the remote, gets) in the last rounds.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut last = (0u64, 0u64);
    for round in 0..60 {
        let before = s.stats().remote.unwrap().remote_block_reads;
        for _ in 0..400 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % N as u64) as usize;
            let got = run(&mut s, Op::Get(at(i, HOT))).unwrap();
            assert_eq!(
                got,
                Owned::Value(Some(counts[i].to_le_bytes().to_vec())),
                "key {i}"
            );
            counts[i] += 1;
            run(&mut s, Op::Put(at(i, HOT), &counts[i].to_le_bytes())).unwrap();
            run(&mut s, Op::Put(at(i, COLD), &cold)).unwrap();
        }
        s.poll(|_, _| {});
        std::thread::sleep(Duration::from_millis(10));
        s.poll(|_, _| {});
        if round >= 40 {
            last.0 += s.stats().remote.unwrap().remote_block_reads - before;
            last.1 += 400;
        }
    }
    let st = s.stats().remote.unwrap();
    assert!(st.evictions > 0 && st.eager_uploads > 0, "{st:?}");
    assert!(
        disk_bytes(&dir) <= budget + (512 << 10),
        "{}",
        disk_bytes(&dir)
    );
    let per_get = last.0 as f64 / last.1 as f64;
    eprintln!("remote reads per get in the last rounds: {per_get:.3} ({st:?})");
    assert!(
        per_get < 0.1,
        "the read state went to the remote: {per_get:.3} remote reads per get ({st:?})"
    );
}

/// GC: a subsumed checkpoint's segments go from the remote when no retained
/// checkpoint and no live layer names them; the retained one's stay and
/// restore; an orphan object is deleted at open.
#[test]
fn remote_gc_deletes_only_what_no_retained_checkpoint_needs() {
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let dir = tmp.path().join("d");
    let mut s = open(&dir, &target, "g", None).unwrap();
    put_all(&mut s, 1);
    checkpoint(&mut s, spec(1)).unwrap();
    s.checkpoint_notify(OWNER, 1, Notify::Complete);
    settle_fully(&mut s);
    let first = segment_names(&objects(&target, "g"));
    let gdir = tmp.path().join("remote").join("g");
    let m1 = std::fs::read_dir(&gdir)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".manifest"))
        .unwrap();
    let (m1_name, m1_bytes) = (m1.file_name(), std::fs::read(m1.path()).unwrap());
    put_all(&mut s, 2);
    s.compact_all();
    settle_fully(&mut s);
    let h2 = checkpoint(&mut s, spec(2)).unwrap();
    s.checkpoint_notify(OWNER, 2, Notify::Complete);
    settle_fully(&mut s);
    // The compaction retired the first checkpoint's segments; once it was
    // subsumed nothing names them, and the remote lets them go.
    let deadline = Instant::now() + Duration::from_secs(30);
    let names = loop {
        s.poll(|_, _| {});
        let names = objects(&target, "g");
        let manifests = names.iter().filter(|n| n.ends_with(".manifest")).count();
        if manifests == 1 && segment_names(&names).is_disjoint(&first) {
            break names;
        }
        assert!(Instant::now() < deadline, "{names:?}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let second = segment_names(&names);
    assert_eq!(second.len(), 1, "one compacted segment: {second:?}");
    drop(s);
    // An orphan (a failed checkpoint's upload) is deleted at open, and a
    // subsumed manifest whose remote delete never happened is not taken
    // back: the local store is the truth, and the delete is finished.
    let orphan = "seg-00000000000000f0-00000000.sst";
    std::fs::write(gdir.join(orphan), b"orphan").unwrap();
    std::fs::write(gdir.join(&m1_name), &m1_bytes).unwrap();
    let s = open(&dir, &target, "g", None).unwrap();
    assert_eq!(
        s.checkpoints().len(),
        1,
        "the subsumed checkpoint stays gone"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut s = s;
    while gdir.join(orphan).exists() || gdir.join(&m1_name).exists() {
        s.poll(|_, _| {});
        assert!(Instant::now() < deadline, "orphan stayed");
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(s);
    // The retained checkpoint restores on an empty disk.
    let mut s = open(&tmp.path().join("e"), &target, "g", None).unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h2]).unwrap();
    check_all(&mut s, 2, 0, KGS - 1);
}

/// The server stopped: a checkpoint fails with a clear error and nothing
/// else stops (local reads and writes go on; reads that need the remote
/// fail alone). Restarted: the next checkpoint uploads what was missing and
/// restores exactly.
#[test]
fn server_stopped_fails_only_what_needs_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("s3");
    let mut server = Server::start(&root, 0);
    let port = server.port;
    let target = s3(port);
    // A restored (remote-only) layer and a local one.
    let h = checkpointed(&tmp.path().join("src"), &target, "f", 3);
    let dir = tmp.path().join("d");
    let mut s = open(&dir, &target, "f", None).unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    run(&mut s, Op::Put(kr(1, b"local"), b"here")).unwrap();
    s.flush();
    settle_fully(&mut s);

    server.stop();
    let e = checkpoint(&mut s, spec(2)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Remote(_)), "{e}");
    assert!(
        msg.contains("not durable remotely") && msg.contains("attempt"),
        "{msg}"
    );
    // Local state answers; a remote-only key fails clearly.
    assert_eq!(
        run(&mut s, Op::Get(kr(1, b"local"))).unwrap(),
        Owned::Value(Some(b"here".to_vec()))
    );
    let (kg, k) = key(5);
    let e = run(&mut s, Op::Get(kr(kg, &k))).unwrap_err();
    assert!(matches!(e, StoreError::Remote(_)), "{e}");
    run(&mut s, Op::Put(kr(2, b"during"), b"outage")).unwrap();

    let server = Server::start(&root, port);
    let h2 = checkpoint(&mut s, spec(2)).unwrap();
    s.checkpoint_notify(OWNER, 2, Notify::Complete);
    check_all(&mut s, 3, 0, KGS - 1);
    drop(s);
    let mut s = open(&tmp.path().join("e"), &target, "f", None).unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h2]).unwrap();
    check_all(&mut s, 3, 0, KGS - 1);
    for (kg, k, v) in [(1, &b"local"[..], &b"here"[..]), (2, b"during", b"outage")] {
        assert_eq!(
            run(&mut s, Op::Get(kr(kg, k))).unwrap(),
            Owned::Value(Some(v.to_vec()))
        );
    }
    drop(server);
}

/// The local disk refills with what is read remotely: after a restore on
/// an empty disk, the blocks one pass fetched are written back, and the
/// next pass reads them locally (the memory cache kept too small to hold
/// them).
#[test]
fn fetched_blocks_are_written_back_and_read_locally() {
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let h = checkpointed(&tmp.path().join("a"), &target, "w", 4);
    let b = tmp.path().join("b");
    let mut s = open_with(&b, &target, "w", None, Some(64 << 10)).unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    let before = disk_bytes(&b.join("fetched"));
    check_all(&mut s, 4, 0, KGS - 1);
    settle_fully(&mut s);
    let first = s.stats().remote.unwrap();
    assert!(first.remote_block_reads > 0, "{first:?}");
    assert!(first.writebacks > 0, "{first:?}");
    assert!(first.last_error.is_none(), "{first:?}");
    assert!(disk_bytes(&b.join("fetched")) > before + (1 << 20));
    // What was written back is read locally; what was not (at most 512
    // write-backs are in flight, the rest stay remote only) is fetched
    // again and written back then, so the remote reads of each pass fall
    // until a pass reads nothing remotely. (Counted per pass, not per
    // block: a block read again before its write-back completes is fetched
    // twice, and one the memory cache served waits for a later pass.)
    let first_remote = first.remote_block_reads;
    let mut last = first;
    for pass in 2.. {
        check_all(&mut s, 4, 0, KGS - 1);
        settle_fully(&mut s);
        let now = s.stats().remote.unwrap();
        assert!(now.local_block_reads > last.local_block_reads, "{now:?}");
        let remote = now.remote_block_reads - last.remote_block_reads;
        if remote == 0 {
            break;
        }
        assert!(
            pass < 6 && remote < first_remote,
            "pass {pass} read {remote} blocks remotely: {now:?}"
        );
        last = now;
    }
}

/// A local block of a segment durable remotely that fails its checksum is
/// read from the remote instead: the get succeeds, nothing is lost.
#[test]
fn a_corrupt_local_block_is_read_from_the_remote() {
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let dir = tmp.path().join("a");
    checkpointed(&dir, &target, "c", 5);
    corrupt_first_blocks(&dir);
    let mut s = open(&dir, &target, "c", None).unwrap();
    check_all(&mut s, 5, 0, KGS - 1);
    let st = s.stats().remote.unwrap();
    assert!(st.refetched > 0, "{st:?}");
}

/// A slow server (300 ms added to every request by a proxy): a restore on
/// an empty disk and reads of remote-only data wait for it within their
/// timeout, and nothing times out or retries.
#[test]
fn a_slow_server_is_waited_for() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let h = checkpointed(&tmp.path().join("a"), &s3(server.port), "slow", 6);

    let slow = Proxy::start(server.port, Fault::Delay(Duration::from_millis(300))).port;
    let (mut s, stats) = tiered_through(
        &tmp.path().join("b"),
        slow,
        "slow",
        0,
        Duration::from_secs(3),
    )
    .unwrap();
    let t0 = Instant::now();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(600),
        "two slow rounds"
    );
    check_all(&mut s, 6, 0, KGS - 1);
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(stats.retries.load(Relaxed), 0);
    assert_eq!(stats.errors.load(Relaxed), 0);
    assert!(s.stats().remote.unwrap().remote_block_reads > 0);
}

/// A tiered store and its remote's counters.
type Through = (
    Store<UringIo>,
    std::sync::Arc<stator_store::remote::RemoteStats>,
);

/// A tiered store over a remote reached through `port`, with `retries` and
/// a per-attempt `timeout`; its remote's counters.
fn tiered_through(
    dir: &Path,
    port: u16,
    prefix: &str,
    retries: u32,
    timeout: Duration,
) -> Result<Through, StoreError> {
    tiered_with(dir, port, prefix, retries, timeout, 1 << 20)
}

/// [`tiered_through`] with a memtable of `memtable` bytes.
fn tiered_with(
    dir: &Path,
    port: u16,
    prefix: &str,
    retries: u32,
    timeout: Duration,
    memtable: usize,
) -> Result<Through, StoreError> {
    let mut cfg = RemoteConfig::new(s3(port));
    cfg.prefix = prefix.into();
    cfg.retries = retries;
    cfg.backoff = Duration::from_millis(10);
    cfg.timeout = timeout;
    cfg.max_in_flight = 32;
    let r = Remote::new(object_store(&cfg).unwrap(), cfg, rt().handle()).unwrap();
    let stats = r.stats();
    let mut scfg = StoreConfig::new(dir, (4 * memtable).max(16 << 20));
    scfg.memtable_bytes = Some(memtable);
    let (s, _) = Store::open_tiered(
        scfg,
        UringIo::new(256, true).unwrap(),
        r,
        TierConfig::new(None),
    )?;
    Ok((s, stats))
}

/// A server that throttles (503 Slow Down on every other new connection):
/// uploads, the restore on an empty disk and its remote reads all succeed
/// through retries, which are counted, and the data is exact.
#[test]
fn throttling_is_retried_counted_and_loses_nothing() {
    use std::sync::atomic::Ordering::Relaxed;
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let proxy = Proxy::start(server.port, Fault::Throttle(2)).port;
    // Upload through it.
    let (mut s, up) = tiered_through(
        &tmp.path().join("a"),
        proxy,
        "thr",
        8,
        Duration::from_secs(5),
    )
    .unwrap();
    put_all(&mut s, 4);
    let h = checkpoint(&mut s, spec(1)).unwrap();
    s.checkpoint_notify(OWNER, 1, Notify::Complete);
    settle_fully(&mut s);
    drop(s);
    // Restore through it on an empty disk.
    let (mut s, down) = tiered_through(
        &tmp.path().join("b"),
        proxy,
        "thr",
        8,
        Duration::from_secs(5),
    )
    .unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    check_all(&mut s, 4, 0, KGS - 1);
    assert!(s.stats().remote.unwrap().remote_block_reads > 0);
    let retried = up.retries.load(Relaxed) + down.retries.load(Relaxed);
    assert!(retried > 0, "no request met a 503: the test proved nothing");
    assert_eq!(up.errors.load(Relaxed) + down.errors.load(Relaxed), 0);
}

/// A server slower than the timeout: opening the tier over it fails with
/// an error that says so, after its retries (the store will not guess
/// what the remote holds), and creates nothing; the checkpoint then
/// restores exactly from a server that answers.
#[test]
fn a_server_slower_than_the_timeout_fails_clearly_and_loses_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let h = checkpointed(&tmp.path().join("a"), &s3(server.port), "late", 5);
    let slow = Proxy::start(server.port, Fault::Delay(Duration::from_millis(700))).port;
    let b = tmp.path().join("b");
    let t0 = Instant::now();
    let Err(e) = tiered_through(&b, slow, "late", 1, Duration::from_millis(200)) else {
        panic!("a tier that cannot answer within its timeout opened");
    };
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Remote(_)), "{e:?}");
    // Our deadline or the HTTP client's (both the per-attempt timeout)
    // ends each attempt: either way the error names the attempts.
    assert!(
        msg.contains("LIST") && msg.contains("after 2 attempt(s)"),
        "{msg}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the timeout bounds the wait"
    );
    let left: Vec<_> = std::fs::read_dir(&b)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter()
            .all(|n| !n.to_string_lossy().ends_with(".manifest")),
        "{left:?}"
    );
    let (mut s, _) = tiered_through(
        &tmp.path().join("c"),
        server.port,
        "late",
        1,
        Duration::from_secs(5),
    )
    .unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    check_all(&mut s, 5, 0, KGS - 1);
}

/// The same block corrupt locally and remotely: the gets that need it fail
/// with a checksum error naming the segment (after one remote read, no
/// loop), and every other get answers.
#[test]
fn a_block_corrupt_everywhere_fails_its_gets_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let target = Target::Local {
        dir: tmp.path().join("remote"),
    };
    let dir = tmp.path().join("a");
    checkpointed(&dir, &target, "x", 7);
    corrupt_first_blocks(&dir);
    corrupt_first_blocks(&tmp.path().join("remote").join("x"));
    let mut s = open(&dir, &target, "x", None).unwrap();
    let (mut ok, mut corrupt) = (0, 0);
    for i in 0..KEYS {
        let (kg, k) = key(i);
        match run(&mut s, Op::Get(kr(kg, &k))) {
            Ok(o) => {
                assert_eq!(o, Owned::Value(Some(value(i, 7))), "key {i}");
                ok += 1;
            }
            Err(StoreError::Corrupt { path, .. }) => {
                assert!(path.ends_with(".sst"), "{path}");
                corrupt += 1;
            }
            Err(e) => panic!("key {i}: {e}"),
        }
    }
    assert!(corrupt > 0 && ok > corrupt, "{ok} {corrupt}");
    let st = s.stats().remote.unwrap();
    assert!(
        st.refetched > 0 && st.refetched <= corrupt as u64 + 4,
        "{st:?}"
    );
}

/// Connections reset partway through a response, then a server that takes
/// requests and never answers, each after a restore on an empty disk: the
/// gets that need the remote fail with a remote error (never wrong data),
/// local state serves on, a checkpoint fails clearly; once the server
/// answers, every key reads exactly and the next checkpoint restores
/// exactly elsewhere. A hang during a restore fails that restore alone.
#[test]
fn resets_and_hangs_fail_only_what_needs_the_remote_and_lose_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let proxy = Proxy::start(server.port, Fault::None);
    // Long enough for a loaded machine's honest GETs; a stalled one waits
    // it out twice (two attempts).
    let attempt = Duration::from_secs(2);
    for (n, fault) in [Fault::ResetResponse(100), Fault::Stall]
        .into_iter()
        .enumerate()
    {
        // Each round its own prefix: a round's checkpoint retires the last.
        let prefix = format!("cut{n}");
        let h = checkpointed(
            &tmp.path().join(format!("a{n}")),
            &s3(server.port),
            &prefix,
            6,
        );
        let dir = tmp.path().join(format!("b{n}"));
        let (mut s, stats) = tiered_through(&dir, proxy.port, &prefix, 1, attempt).unwrap();
        if fault == Fault::Stall {
            // Hung while restoring: the restore fails and changes nothing.
            proxy.set(fault);
            let e = s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap_err();
            assert!(matches!(e, StoreError::Remote(_)), "{e:?}");
            let (kg, k) = key(3);
            assert_eq!(
                run(&mut s, Op::Get(kr(kg, &k))).unwrap(),
                Owned::Value(None)
            );
            proxy.set(Fault::None);
        }
        s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
        run(&mut s, Op::Put(kr(1, b"local"), b"here")).unwrap();
        proxy.set(fault);
        let (mut ok, mut failed) = (0, 0);
        for (i, r) in get_all(&mut s, KEYS).into_iter().enumerate() {
            match r {
                Ok(o) => {
                    check_one(i, key(i).0, o, 6, 0, KGS - 1);
                    ok += 1;
                }
                Err(StoreError::Remote(msg)) => {
                    assert!(msg.contains("attempt"), "{msg}");
                    failed += 1;
                }
                Err(e) => panic!("{fault:?}: key {i}: {e:?}"),
            }
        }
        assert!(failed > 0, "{fault:?}: no get met the fault ({ok} ok)");
        assert!(
            stats.errors.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "{fault:?}"
        );
        assert_eq!(
            run(&mut s, Op::Get(kr(1, b"local"))).unwrap(),
            Owned::Value(Some(b"here".to_vec()))
        );
        let e = checkpoint(&mut s, spec(10 + n as u64)).unwrap_err();
        assert!(matches!(e, StoreError::Remote(_)), "{fault:?}: {e:?}");
        // The server answers again: nothing was lost or damaged.
        proxy.set(Fault::None);
        check_all(&mut s, 6, 0, KGS - 1);
        let h2 = checkpoint(&mut s, spec(20 + n as u64)).unwrap();
        s.checkpoint_notify(OWNER, 20 + n as u64, Notify::Complete);
        settle_fully(&mut s);
        drop(s);
        let (mut s, _) = tiered_through(
            &tmp.path().join(format!("c{n}")),
            server.port,
            &prefix,
            1,
            attempt,
        )
        .unwrap();
        s.restore(restore_spec(0, KGS - 1), &[&h2]).unwrap();
        check_all(&mut s, 6, 0, KGS - 1);
        assert_eq!(
            run(&mut s, Op::Get(kr(1, b"local"))).unwrap(),
            Owned::Value(Some(b"here".to_vec()))
        );
    }
}

/// An upload cut partway (the connection reset while a multipart part is
/// on the wire): the checkpoint fails clearly and the store serves on; the
/// next checkpoint uploads the segment whole, and it restores exactly on
/// an empty disk.
#[test]
fn an_upload_cut_partway_fails_its_checkpoint_and_the_next_succeeds() {
    // About 12 MiB in one segment: more than one 8 MiB part.
    const BIG: usize = 60_000;
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let proxy = Proxy::start(server.port, Fault::None);
    let a = tmp.path().join("a");
    let attempt = Duration::from_secs(5);
    let (mut s, _) = tiered_with(&a, proxy.port, "mp", 1, attempt, 24 << 20).unwrap();
    for i in 0..BIG {
        let (kg, k) = key(i);
        run(&mut s, Op::Put(kr(kg, &k), &value(i, 8))).unwrap();
    }
    s.flush();
    settle_fully(&mut s);
    let largest = std::fs::read_dir(&a)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sst"))
        .map(|e| e.metadata().unwrap().len())
        .max()
        .unwrap();
    assert!(largest > 8 << 20, "no multipart upload: {largest} bytes");

    proxy.set(Fault::ResetRequestAfter(1 << 20));
    let e = checkpoint(&mut s, spec(1)).unwrap_err();
    assert!(
        matches!(&e, StoreError::Remote(m) if m.contains("not durable remotely")),
        "{e:?}"
    );
    let (kg, k) = key(7);
    assert_eq!(
        run(&mut s, Op::Get(kr(kg, &k))).unwrap(),
        Owned::Value(Some(value(7, 8)))
    );
    proxy.set(Fault::None);
    let h = checkpoint(&mut s, spec(2)).unwrap();
    s.checkpoint_notify(OWNER, 2, Notify::Complete);
    settle_fully(&mut s);
    drop(s);

    let (mut s, _) = tiered_through(&tmp.path().join("b"), server.port, "mp", 1, attempt).unwrap();
    s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap();
    for (i, r) in get_all(&mut s, BIG).into_iter().enumerate() {
        check_one(i, key(i).0, r.unwrap(), 8, 0, KGS - 1);
    }
}

/// Issue 25: a restore on an empty disk fetched its segments' metadata
/// with blocking GETs on the caller's thread (a shard's, for up to 2 s).
/// Now the fetch runs on the remote runtime: requests are answered while
/// the server hangs, and the restore ends once it answers. A segment the
/// remote lacks refuses a restore, a stopped server fails one as a remote
/// error; neither changes anything.
#[test]
fn a_restore_on_an_empty_disk_fetches_metadata_off_the_callers_thread() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("s3");
    let mut server = Server::start(&root, 0);
    let h = checkpointed(&tmp.path().join("src"), &s3(server.port), "g", 3);
    let proxy = Proxy::start(server.port, Fault::None);
    let mut s = open(&tmp.path().join("d"), &s3(proxy.port), "g", None).unwrap();
    run(&mut s, Op::Put(kr(1, b"local"), b"here")).unwrap();
    proxy.set(Fault::Stall);
    s.restore_start(1, restore_spec(0, KGS - 1), &[&h]).unwrap();
    for _ in 0..10 {
        // (Time for the fetch's GETs to reach the hung server.)
        std::thread::sleep(Duration::from_millis(50));
        s.poll(|_, _| {});
        assert!(s.take_restored().is_none(), "restored from a hung server");
        assert_eq!(
            run(&mut s, Op::Get(kr(1, b"local"))).unwrap(),
            Owned::Value(Some(b"here".to_vec())),
            "answered while the fetch waits"
        );
    }
    // The client's timeout ends the hung attempt; the retry is answered.
    proxy.set(Fault::None);
    let deadline = Instant::now() + Duration::from_secs(60);
    let r = loop {
        if let Some((t, r)) = s.take_restored() {
            assert_eq!(t, 1);
            break r;
        }
        assert!(Instant::now() < deadline, "the restore never ended");
        s.poll(|_, _| {});
        s.wait(Some(Duration::from_millis(5))).unwrap();
    };
    assert!(r.unwrap().layers > 0);
    check_all(&mut s, 3, 0, KGS - 1);
    drop(s);

    // A segment the remote lacks: refused, nothing changes.
    let mut s = open(&tmp.path().join("e"), &s3(server.port), "g", None).unwrap();
    let seg = segment_names(&objects(&s3(server.port), "g"))
        .pop_first()
        .unwrap();
    let object = root.join(common::s3::BUCKET).join("g").join(&seg);
    let bytes = std::fs::read(&object).unwrap();
    std::fs::remove_file(&object).unwrap();
    let e = s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap_err();
    assert!(matches!(e, StoreError::Restore(_)), "{e}");
    assert!(e.to_string().contains("cannot supply"), "{e}");
    assert_eq!(s.stats().segments, 0);
    std::fs::write(&object, bytes).unwrap();
    // A stopped server: a remote error, nothing changes.
    server.stop();
    let e = s.restore(restore_spec(0, KGS - 1), &[&h]).unwrap_err();
    assert!(matches!(e, StoreError::Remote(_)), "{e}");
    assert!(
        e.to_string().contains("fetching its metadata failed"),
        "{e}"
    );
    assert_eq!(s.stats().segments, 0);
}
