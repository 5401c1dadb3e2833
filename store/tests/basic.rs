//! End-to-end behaviour of the store over each I/O layer.

mod common;

use common::{Owned, run};

use stator_store::io::{Io, SyncIo, UringIo};
use stator_store::{
    CheckpointSpec, IterMode, KeyRef, Op, StateKind, Store, StoreConfig, Submitted,
};

fn k(kg: u16, key: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: kg,
        state: 1,
        key,
        namespace: b"",
    }
}

fn exercise<I: Io>(io: I, dir: &std::path::Path) {
    let mut cfg = StoreConfig::new(dir, 64 << 20);
    cfg.memtable_bytes = Some(256 << 10);
    let (mut s, rep) = Store::open(cfg.clone(), io).unwrap();
    assert_eq!(rep.segments, 0);
    for i in 0..20_000u32 {
        let key = i.to_be_bytes();
        run(&mut s, Op::Put(k((i % 128) as u16, &key), &[i as u8; 100])).unwrap();
    }
    s.settle();
    let st = s.stats();
    assert!(st.flushes > 5, "{st:?}");
    for i in (0..20_000u32).step_by(7) {
        let key = i.to_be_bytes();
        assert_eq!(
            run(&mut s, Op::Get(k((i % 128) as u16, &key))).unwrap(),
            Owned::Value(Some(vec![i as u8; 100])),
            "key {i}"
        );
    }
    assert_eq!(
        run(&mut s, Op::Get(k(3, b"nope"))).unwrap(),
        Owned::Value(None)
    );
    // Lists and maps across flushes.
    let lk = KeyRef {
        key_group: 9,
        state: 2,
        key: b"list",
        namespace: b"ns",
    };
    run(&mut s, Op::ListAppend(lk, b"a")).unwrap();
    s.flush();
    s.settle();
    run(&mut s, Op::ListAppend(lk, b"bb")).unwrap();
    let mut want = Vec::new();
    stator_store::ops::encode_element(&mut want, b"a");
    stator_store::ops::encode_element(&mut want, b"bb");
    assert_eq!(
        run(&mut s, Op::ListGet(lk)).unwrap(),
        Owned::Value(Some(want.clone()))
    );
    // Several elements in one append, after the others and in order; a
    // malformed list is refused and appends nothing.
    let mut more = Vec::new();
    stator_store::ops::encode_element(&mut more, b"ccc");
    stator_store::ops::encode_element(&mut more, b"");
    run(&mut s, Op::ListAppendAll(lk, &more)).unwrap();
    assert!(run(&mut s, Op::ListAppendAll(lk, &[9, 0, 0, 0, 1])).is_err());
    let mut all = want.clone();
    all.extend_from_slice(&more);
    assert_eq!(
        run(&mut s, Op::ListGet(lk)).unwrap(),
        Owned::Value(Some(all))
    );
    run(&mut s, Op::ListReplace(lk, &want)).unwrap();
    let mk = KeyRef {
        key_group: 9,
        state: 3,
        key: b"map",
        namespace: b"",
    };
    for u in 0..10u8 {
        run(&mut s, Op::MapPut(mk, &[u], &[u; 3])).unwrap();
    }
    s.flush();
    s.settle();
    run(&mut s, Op::MapRemove(mk, &[4])).unwrap();
    assert_eq!(
        run(&mut s, Op::MapContains(mk, &[4])).unwrap(),
        Owned::Contains(false)
    );
    assert_eq!(
        run(&mut s, Op::MapContains(mk, &[5])).unwrap(),
        Owned::Contains(true)
    );
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[5])).unwrap(),
        Owned::Value(Some(vec![5; 3]))
    );
    match run(
        &mut s,
        Op::MapIter {
            map: mk,
            mode: IterMode::Keys,
            after: Some(&[2]),
            max_bytes: 1000,
        },
    )
    .unwrap()
    {
        Owned::Page(_, n, last, more) => {
            assert_eq!(n, 6, "3,5,6,7,8,9");
            assert_eq!(last, vec![9]);
            assert!(!more);
        }
        o => panic!("{o:?}"),
    }
    run(&mut s, Op::Clear(mk, StateKind::Map)).unwrap();
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[5])).unwrap(),
        Owned::Value(None)
    );
    run(&mut s, Op::MapPut(mk, &[1], b"new")).unwrap();
    s.flush();
    s.settle();
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[5])).unwrap(),
        Owned::Value(None)
    );
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[1])).unwrap(),
        Owned::Value(Some(b"new".to_vec()))
    );
    // A major compaction leaves one segment and loses nothing.
    s.compact_all();
    s.settle();
    assert_eq!(s.stats().segments, 1);
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[1])).unwrap(),
        Owned::Value(Some(b"new".to_vec()))
    );
    assert_eq!(
        run(&mut s, Op::Get(k(5, &5u32.to_be_bytes()))).unwrap(),
        Owned::Value(Some(vec![5; 100]))
    );
    drop(s);
    // Reopen: everything flushed is there.
    let (mut s, rep) = Store::open(cfg, SyncIo::new(true)).unwrap();
    assert!(rep.torn.is_empty(), "{rep:?}");
    assert_eq!(
        run(&mut s, Op::Get(k(5, &5u32.to_be_bytes()))).unwrap(),
        Owned::Value(Some(vec![5; 100]))
    );
    assert_eq!(
        run(&mut s, Op::ListGet(lk)).unwrap(),
        Owned::Value(Some(want))
    );
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[1])).unwrap(),
        Owned::Value(Some(b"new".to_vec()))
    );
    assert_eq!(
        run(&mut s, Op::MapGet(mk, &[2])).unwrap(),
        Owned::Value(None)
    );
}

#[test]
fn works_over_sync_io() {
    let d = tempfile::tempdir().unwrap();
    exercise(SyncIo::new(true), d.path());
}

#[test]
fn works_over_io_uring() {
    let d = tempfile::tempdir().unwrap();
    exercise(UringIo::new(256, true).unwrap(), d.path());
}

#[test]
fn map_iteration_pages_through_a_large_map_and_refuses_a_page_too_small() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = Store::open(StoreConfig::new(d.path(), 64 << 20), SyncIo::new(true)).unwrap();
    let mk = KeyRef {
        key_group: 1,
        state: 3,
        key: b"big",
        namespace: b"",
    };
    for u in 0..10_000u32 {
        run(&mut s, Op::MapPut(mk, &u.to_be_bytes(), b"v")).unwrap();
    }
    s.flush();
    s.settle();
    // Some deleted in the memtable, in the middle of a page.
    for u in 100..200u32 {
        run(&mut s, Op::MapRemove(mk, &u.to_be_bytes())).unwrap();
    }
    let mut after: Option<Vec<u8>> = None;
    let mut total = 0;
    let mut pages = 0;
    loop {
        let r = run(
            &mut s,
            Op::MapIter {
                map: mk,
                mode: IterMode::Keys,
                after: after.as_deref(),
                max_bytes: 1 << 20,
            },
        )
        .unwrap();
        let Owned::Page(_, n, last, more) = r else {
            panic!("{r:?}")
        };
        total += n;
        pages += 1;
        if !more {
            break;
        }
        assert!(!last.is_empty());
        after = Some(last);
    }
    assert_eq!(total, 9_900);
    assert!(
        pages >= 3,
        "a layer yields at most 4096 entries per page ({pages} pages)"
    );
    let e = run(
        &mut s,
        Op::MapIter {
            map: mk,
            mode: IterMode::Entries,
            after: None,
            max_bytes: 5,
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            stator_store::StoreError::TooLarge {
                len: 13,
                max: 5,
                ..
            }
        ),
        "{e}"
    );
}

/// A batch applies its ops in order (a get after a put of the same key in
/// one batch sees it), answers each op as `submit` would, refuses a bad op
/// without losing the others, and leaves what needs disk pending.
#[test]
fn submit_batch_applies_ops_in_order_and_answers_each() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(256 << 10);
    let (mut s, _) = Store::open(cfg.clone(), SyncIo::new(false)).unwrap();
    run(&mut s, Op::Put(k(1, b"on-disk"), b"old")).unwrap();
    s.flush();
    s.settle();
    // Reopened, so the key is only on disk (a flush leaves what it wrote in
    // the block cache).
    drop(s);
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    let big = vec![0u8; (64 << 20) + 1];
    let ops = [
        Op::Get(k(1, b"a")),
        Op::Put(k(1, b"a"), b"1"),
        Op::Get(k(1, b"a")),
        Op::Put(k(1, b"a"), b"2"),
        Op::Put(k(2, b"too-big"), &big),
        Op::Delete(k(1, b"b")),
        Op::Get(k(1, b"a")),
        Op::Get(k(1, b"on-disk")),
        Op::Get(k(2, b"too-big")),
    ];
    let tokens: Vec<u64> = (0..ops.len() as u64).collect();
    let mut got: Vec<Option<Result<Owned, String>>> = vec![None; ops.len()];
    let mut pending = Vec::new();
    s.submit_batch(&tokens, &ops, |i, r| match r {
        Ok(stator_store::Submitted::Ready(o)) => got[i] = Some(Ok(Owned::from(o))),
        Ok(stator_store::Submitted::Pending) => pending.push(i),
        Err(e) => got[i] = Some(Err(e.to_string())),
    });
    s.drain(false, |t, r| {
        got[t as usize] = Some(r.map(Owned::from).map_err(|e| e.to_string()))
    });
    assert_eq!(pending, vec![7], "only the key on disk waits");
    let ok = |v: &[u8]| Some(Ok(Owned::Value(Some(v.to_vec()))));
    assert_eq!(got[0], Some(Ok(Owned::Value(None))));
    assert_eq!(got[1], Some(Ok(Owned::Done)));
    assert_eq!(got[2], ok(b"1"));
    assert_eq!(got[3], Some(Ok(Owned::Done)));
    assert!(
        matches!(&got[4], Some(Err(e)) if e.contains("value")),
        "{:?}",
        got[4]
    );
    assert_eq!(got[5], Some(Ok(Owned::Done)));
    assert_eq!(got[6], ok(b"2"));
    assert_eq!(got[7], ok(b"old"));
    assert_eq!(
        got[8],
        Some(Ok(Owned::Value(None))),
        "the refused put wrote nothing"
    );
}

/// Batched gets locate flushed keys ahead of their turn (filters, index,
/// cache slot, entry, block): across memtables, a frozen memtable and
/// several segments with overwrites and deletes, with a cache too small
/// for every block, each answers what a get alone answers.
#[test]
fn batched_gets_located_ahead_answer_as_gets_alone() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(1 << 20);
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    let n = 6000u32;
    let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
    let mut model = std::collections::BTreeMap::new();
    let mut put = |s: &mut Store<SyncIo>, i: u32, v: Option<Vec<u8>>| {
        let kb = key(i);
        let kr = k((i % 13) as u16, &kb);
        match &v {
            Some(v) => run(s, Op::Put(kr, v)).unwrap(),
            None => run(s, Op::Delete(kr)).unwrap(),
        };
        model.insert(i, v);
    };
    // Three segments: all keys, then every third overwritten and every
    // fifth deleted, then every seventh overwritten again.
    for (step, pick) in [(1u32, 0u8), (3, 1), (5, 2), (7, 3)] {
        for i in (0..n).step_by(step as usize) {
            let v = (pick != 2).then(|| vec![pick; 40 + (i % 50) as usize]);
            put(&mut s, i, v);
        }
        s.flush();
        common::settle_fully(&mut s);
    }
    // A frozen memtable (flushing) and the active one.
    for i in (0..n).step_by(11) {
        put(&mut s, i, Some(vec![11; 30]));
    }
    s.flush();
    for i in (0..n).step_by(13) {
        put(&mut s, i, Some(vec![13; 20]));
    }
    let keys: Vec<[u8; 4]> = (0..n + 500).map(key).collect();
    let mut got: Vec<Option<Owned>> = vec![None; keys.len()];
    let before = s.stats();
    for (c, chunk) in keys.chunks(64).enumerate() {
        let ops: Vec<Op> = chunk
            .iter()
            .enumerate()
            .map(|(j, kb)| Op::Get(k(((c * 64 + j) as u32 % 13) as u16, kb)))
            .collect();
        let tokens: Vec<u64> = (0..ops.len() as u64).map(|j| c as u64 * 64 + j).collect();
        s.submit_batch(&tokens, &ops, |j, r| match r {
            Ok(stator_store::Submitted::Ready(o)) => got[c * 64 + j] = Some(Owned::from(o)),
            Ok(stator_store::Submitted::Pending) => {}
            Err(e) => panic!("{e}"),
        });
    }
    s.drain(false, |t, r| {
        got[t as usize] = Some(r.map(Owned::from).unwrap())
    });
    let after = s.stats();
    for (i, g) in got.iter().enumerate() {
        let want = model.get(&(i as u32)).cloned().flatten();
        assert_eq!(g, &Some(Owned::Value(want)), "key {i}");
    }
    assert!(
        after.cache_hits > before.cache_hits,
        "some blocks came from the cache"
    );
}

/// A flush leaves the blocks it wrote in the block cache (the file
/// bypasses the page cache): reads of what was just flushed are answered
/// at once, not from the disk, and a reopened store reads them from disk.
#[test]
fn a_flush_leaves_what_it_wrote_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(256 << 10);
    let (mut s, _) = Store::open(cfg.clone(), SyncIo::new(false)).unwrap();
    let keys: Vec<Vec<u8>> = (0..2000u32).map(|i| i.to_be_bytes().to_vec()).collect();
    for key in &keys {
        run(&mut s, Op::Put(k(3, key), b"flushed")).unwrap();
    }
    s.flush();
    s.settle();
    let pending_gets = |s: &mut Store<SyncIo>| {
        let ops: Vec<Op> = keys.iter().map(|key| Op::Get(k(3, key))).collect();
        let tokens: Vec<u64> = (0..ops.len() as u64).collect();
        let mut pending = 0;
        s.submit_batch(&tokens, &ops, |_, r| match r {
            Ok(stator_store::Submitted::Ready(o)) => {
                assert_eq!(Owned::from(o), Owned::Value(Some(b"flushed".to_vec())))
            }
            Ok(stator_store::Submitted::Pending) => pending += 1,
            Err(e) => panic!("{e}"),
        });
        s.drain(false, |_, r| {
            assert_eq!(
                r.map(Owned::from).unwrap(),
                Owned::Value(Some(b"flushed".to_vec()))
            )
        });
        pending
    };
    assert_eq!(pending_gets(&mut s), 0, "every flushed block is cached");
    drop(s);
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    assert!(pending_gets(&mut s) > 0, "a reopened store reads from disk");
}

/// A large memtable is sorted and written in many time-bounded steps;
/// every record comes back, before and after a reopen, in both I/O
/// layers.
#[test]
fn a_large_flush_sorted_in_steps_keeps_every_record() {
    fn check<I: Io>(mk: fn() -> I) {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = StoreConfig::new(dir.path(), 256 << 20);
        cfg.memtable_bytes = Some(128 << 20);
        // Steps small enough that the flush takes many of them.
        cfg.work_per_poll = 97;
        let (mut s, _) = Store::open(cfg.clone(), mk()).unwrap();
        const N: u32 = 40_000;
        let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
        let list = |i: u32| KeyRef {
            key_group: (i % 61) as u16,
            state: 2,
            key: b"list",
            namespace: b"",
        };
        for i in 0..N {
            let kb = key(i);
            run(&mut s, Op::Put(k((i % 61) as u16, &kb), &i.to_le_bytes())).unwrap();
            if i % 7 == 0 {
                run(&mut s, Op::Delete(k((i % 61) as u16, &kb))).unwrap();
            }
            if i < 61 * 3 {
                run(&mut s, Op::ListAppend(list(i), &i.to_le_bytes())).unwrap();
            }
        }
        assert_eq!(s.stats().flushes, 0, "one memtable holds it all");
        s.flush();
        s.settle();
        assert_eq!(s.stats().flushes, 1);
        let verify = |s: &mut Store<I>| {
            for i in 0..N {
                let kb = key(i);
                let want = (i % 7 != 0).then(|| i.to_le_bytes().to_vec());
                assert_eq!(
                    run(s, Op::Get(k((i % 61) as u16, &kb))).unwrap(),
                    Owned::Value(want),
                    "key {i}"
                );
            }
            for g in 0..61u32 {
                let Owned::Value(Some(v)) = run(s, Op::ListGet(list(g))).unwrap() else {
                    panic!("list of group {g} is gone");
                };
                let mut want = Vec::new();
                for n in 0..3 {
                    stator_store::ops::encode_element(&mut want, &(g + 61 * n).to_le_bytes());
                }
                assert_eq!(v, want, "list of group {g}");
            }
        };
        verify(&mut s);
        drop(s);
        let (mut s, _) = Store::open(cfg, mk()).unwrap();
        verify(&mut s);
    }
    check(|| SyncIo::new(false));
    check(|| UringIo::new(256, true).unwrap());
}

/// A store of 64 MiB whose memtables freeze at `memtable` bytes.
fn open_with_memtable(dir: &std::path::Path, memtable: usize) -> Store<SyncIo> {
    let mut cfg = StoreConfig::new(dir, 64 << 20);
    cfg.memtable_bytes = Some(memtable);
    Store::open(cfg, SyncIo::new(false)).unwrap().0
}

/// While a flush lags, the room writes have left falls as the next
/// memtable fills, reaches nothing at the memory the budget plans for
/// memtables (a stall, counted and timed), and comes back once the
/// flushes land.
#[test]
fn writes_run_out_of_room_while_a_flush_lags_and_get_it_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_with_memtable(dir.path(), 1 << 20);
    assert_eq!(s.write_headroom(), 1.0);
    let value = [7u8; 100];
    let mut i = 0u32;
    // `write_batch` does not poll: nothing flushes meanwhile.
    let mut put = |s: &mut Store<SyncIo>| {
        let key = i.to_be_bytes();
        i += 1;
        s.write_batch(&[Op::Put(k(1, &key), &value)]).unwrap();
    };
    // The room is whole until the first memtable froze and the next one
    // took a write.
    while s.write_headroom() == 1.0 {
        put(&mut s);
    }
    let mut last = s.write_headroom();
    let mut steps = 0;
    loop {
        put(&mut s);
        let h = s.write_headroom();
        assert!(h <= last, "the room only shrinks while nothing flushes");
        if h < last {
            steps += 1;
        }
        last = h;
        if h == 0.0 {
            break;
        }
    }
    assert!(steps > 100, "it fell in small steps ({steps}), not at once");
    assert_eq!(s.stats().write_stalls().0, 1);
    s.settle();
    assert_eq!(s.write_headroom(), 1.0);
    let st = s.stats();
    let (stalls, stalled) = st.write_stalls();
    assert_eq!(stalls, 1);
    assert!(stalled > std::time::Duration::ZERO);
    // Nothing flushed while the room ran out: the memtables waiting for
    // their flush were the cause, and all of the stall's time is its.
    let flush = st.write_stalls_by_cause[stator_store::StallCause::Flush.index()];
    assert_eq!(flush, (1, stalled));
    assert!(st.flushes >= 1);
}

/// Memtables frozen early (each checkpoint freezes one) count all the
/// memory they hold while their flushes wait, not only their records: a
/// pile of nearly empty ones, each a log chunk and an index, runs the
/// room out as full ones would, and the memtables stay within the plan.
#[test]
fn memtables_frozen_by_checkpoints_count_their_memory() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_with_memtable(dir.path(), 4 << 20);
    let room = s.write_room();
    let mut frozen = 0u64;
    // Neither `write_batch` nor `checkpoint` polls: no flush lands.
    while s.write_room() > 0 {
        s.write_batch(&[Op::Put(k(1, &frozen.to_be_bytes()), b"v")])
            .unwrap();
        let spec = CheckpointSpec {
            owner: b"o".to_vec(),
            checkpoint_id: frozen + 1,
            lo: 0,
            hi: 0,
            states: vec![1],
            meta: Vec::new(),
        };
        s.checkpoint(frozen + 1, spec).unwrap();
        frozen += 1;
        assert!(frozen < 40, "forty memtables frozen and room is left");
    }
    // Each held a 2 MiB log chunk and its index for a record of a few
    // bytes: counted by records alone, the room would hardly have moved.
    assert!(frozen >= 3, "the room ran out after {frozen} memtables");
    // Beside the room, the plan holds the active memtable's chunk and the
    // two it maps ahead.
    let used = s.memory().memtables;
    let plan = room + (3 << 21);
    assert!(used <= plan, "memtables hold {used} B, the plan {plan} B");
    s.settle();
    assert!(s.write_room() > room / 2, "the flushes gave the room back");
}

/// A dropped state's records (a finished job's, whose names the daemon
/// dropped) leave at the next compaction through them; every other
/// state's stay, and a state handed out after the drop set was made is
/// never taken for a dropped one.
#[test]
fn compaction_leaves_out_the_records_of_dropped_states() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_with_memtable(dir.path(), 256 << 10);
    let key = |state: u32, i: u32| (state, (i % 64) as u16, i.to_be_bytes());
    fn kr((state, kg, k): &(u32, u16, [u8; 4])) -> KeyRef<'_> {
        KeyRef {
            key_group: *kg,
            state: *state,
            key: &k[..],
            namespace: b"",
        }
    }
    for i in 0..6_000u32 {
        for state in [1, 2, 3] {
            run(&mut s, Op::Put(kr(&key(state, i)), &[state as u8; 100])).unwrap();
        }
    }
    s.flush();
    s.settle();
    let before = s.stats().segment_bytes;
    // State 2 is dropped; 3 was handed out after the set was made.
    s.set_dropped_states(std::sync::Arc::new(stator_store::DroppedStates::new(
        3,
        [1],
    )));
    s.compact_all();
    s.settle();
    assert_eq!(s.stats().segments, 1);
    let after = s.stats().segment_bytes;
    assert!(
        after < before * 3 / 4,
        "a third of the records left: {before} -> {after} bytes"
    );
    for i in (0..6_000u32).step_by(13) {
        for (state, want) in [(1, Some(vec![1; 100])), (2, None), (3, Some(vec![3; 100]))] {
            assert_eq!(
                run(&mut s, Op::Get(kr(&key(state, i)))).unwrap(),
                Owned::Value(want),
                "state {state} key {i}"
            );
        }
    }
}

/// A batch's list appends, map puts and removes and deletes (prefetched
/// together since they joined the batch pipeline) leave the state that the
/// same ops one at a time leave, in order within the batch.
#[test]
fn batched_writes_of_every_kind_equal_writes_one_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut one = open_with_memtable(&dir.path().join("one"), 1 << 20);
    let mut batched = open_with_memtable(&dir.path().join("batched"), 1 << 20);
    let key = |i: u64| KeyRef {
        key_group: (i % 7) as u16,
        state: 1 + (i % 3) as u32,
        key: Box::leak(i.to_be_bytes().to_vec().into_boxed_slice()),
        namespace: b"ns",
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut ops = Vec::new();
    for _ in 0..4000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let (k, u) = (key(x % 50), [(x >> 8) as u8 % 5]);
        let u: &'static [u8] = Box::leak(Box::new(u));
        let v: &'static [u8] = Box::leak((x >> 16).to_le_bytes().to_vec().into_boxed_slice());
        ops.push(match (x >> 32) % 6 {
            0 => Op::Put(k, v),
            1 => Op::Delete(k),
            2 | 3 => Op::ListAppend(k, v),
            4 => Op::MapPut(k, u, v),
            _ => Op::MapRemove(k, u),
        });
    }
    // Kinds as the ops use them: lists and values share keys here, which
    // the store allows (it does not know kinds); reads compare raw records.
    for op in &ops {
        run(&mut one, *op).unwrap();
    }
    for chunk in ops.chunks(64) {
        let tokens: Vec<u64> = (0..chunk.len() as u64).collect();
        batched.submit_batch(&tokens, chunk, |_, r| {
            assert!(matches!(r, Ok(stator_store::Submitted::Ready(_))), "{r:?}")
        });
    }
    for i in 0..50 {
        for read in [Op::Get(key(i)), Op::ListGet(key(i))] {
            assert_eq!(run(&mut one, read), run(&mut batched, read), "key {i}");
        }
        for u in 0..5u8 {
            let read = Op::MapGet(key(i), Box::leak(Box::new([u])));
            assert_eq!(run(&mut one, read), run(&mut batched, read), "key {i}/{u}");
        }
    }
}

/// A caller that says how long it spent on requests gets its flush paced
/// to a share of that time: the flush takes many more polls than for a
/// caller that never says (whose polls each run a step), and still lands.
#[test]
fn flush_steps_are_paced_to_the_callers_request_time() {
    let free = polls_to_flush(Caller::NeverSays);
    let paced = polls_to_flush(Caller::Busy);
    assert!(
        paced >= 3 * free,
        "paced flush took {paced} polls, unpaced {free}"
    );
}

/// Between a caller's requests (it says it spent no time on them), steps
/// run freely but short: a request arriving meanwhile waits for a short
/// step, not a full slice. The flush still lands, in more polls than for
/// a caller that never says.
#[test]
fn steps_between_requests_are_short() {
    let free = polls_to_flush(Caller::NeverSays);
    let idle = polls_to_flush(Caller::Idle);
    assert!(idle >= 3 * free, "idle: {idle} polls, unpaced {free}");
}

#[derive(Clone, Copy, PartialEq)]
enum Caller {
    NeverSays,
    Busy,
    Idle,
}

/// A store (64 MiB memtable) holding `puts` 100-byte values, its
/// memtable frozen and its flush started.
fn flushing_store(puts: u32) -> (tempfile::TempDir, Store<SyncIo>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 256 << 20);
    cfg.memtable_bytes = Some(64 << 20);
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    for i in 0..puts {
        let kb = i.wrapping_mul(2_654_435_761).to_be_bytes();
        run(&mut s, Op::Put(k((i % 61) as u16, &kb), &[7; 100])).unwrap();
    }
    s.flush();
    (dir, s)
}

/// Polls until a 64 MiB memtable's flush lands, with the caller saying
/// what `caller` says before each.
fn polls_to_flush(caller: Caller) -> usize {
    let (_dir, mut s) = flushing_store(200_000);
    let mut polls = 0;
    while s.stats().flushes == 0 {
        match caller {
            Caller::NeverSays => {}
            // 30 us of requests earn 10 us of background at a quarter
            // share: a step of up to 200 us every twenty polls or so.
            Caller::Busy => s.note_foreground(std::time::Duration::from_micros(30)),
            Caller::Idle => s.note_foreground(std::time::Duration::ZERO),
        }
        s.poll(|_, _| {});
        polls += 1;
        assert!(polls < 10_000_000, "the flush never landed");
    }
    polls
}

/// `prefault_memory` faults in two memtables' worth of log chunks and
/// the next memtable's index at open (counted as memtable memory, within
/// the budget), and the store works as without it, across freezes.
#[test]
fn prefaulted_memory_is_counted_and_the_store_works_on_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(8 << 20);
    cfg.prefault_memory = true;
    let (mut s, _) = Store::open(cfg.clone(), SyncIo::new(false)).unwrap();
    let m = s.memory();
    assert!(
        m.memtables >= 2 * (8 << 20),
        "{} bytes of memtables after a prefaulting open",
        m.memtables
    );
    // The cache gets exactly what the rest leaves: the pool's chunks are
    // what the active memtable grows into, counted once.
    assert_eq!(
        m.memtables + s.cache_budget() + m.indexes_and_filters + m.background,
        64 << 20,
        "{m:?}, cache budget {}",
        s.cache_budget()
    );
    let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
    for i in 0u32..200_000 {
        run(
            &mut s,
            Op::Put(k((i % 61) as u16, &key(i)), &[i as u8; 100]),
        )
        .unwrap();
    }
    s.settle();
    assert!(
        s.stats().flushes >= 2,
        "the memtables were frozen and flushed"
    );
    for i in (0u32..200_000).step_by(997) {
        assert_eq!(
            run(&mut s, Op::Get(k((i % 61) as u16, &key(i)))).unwrap(),
            Owned::Value(Some(vec![i as u8; 100])),
            "key {i}"
        );
    }
}

/// A drain right after busy passes (a shutdown under load) is not paced:
/// the time the last passes left owing never holds its flush back.
#[test]
fn a_drain_after_busy_passes_finishes_its_flush() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (_dir, mut s) = flushing_store(100_000);
        // Busy passes that earn less than the steps they let run.
        for _ in 0..50 {
            s.note_foreground(std::time::Duration::from_micros(1));
            s.poll(|_, _| {});
        }
        s.settle();
        let _ = tx.send(s.stats().flushes);
    });
    let flushes = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the drain never finished: its flush was held back");
    assert_eq!(flushes, 1);
}

/// Indexes, filters and background work grow with the state; the
/// memtables give way to them so that the store's memory stays in its
/// budget (a full `stator-bench load` run held 338 MiB against 256 when
/// only the cache gave way). A budget with room for everything keeps the
/// configured memtable size.
#[test]
fn memory_stays_in_budget_as_the_state_grows() {
    let dir = tempfile::tempdir().unwrap();
    let mut roomy = StoreConfig::new(dir.path(), 256 << 20);
    roomy.memtable_bytes = Some(64 << 20);
    let (s, _) = Store::open(roomy, SyncIo::new(false)).unwrap();
    assert_eq!(s.memory().memtable_limit, 64 << 20);
    drop(s);

    let dir = tempfile::tempdir().unwrap();
    let budget = 48 << 20;
    let mut cfg = StoreConfig::new(dir.path(), budget);
    cfg.memtable_bytes = Some(16 << 20);
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    let first = s.memory().memtable_limit;
    assert!(
        first < 16 << 20,
        "limit {first}: two 16 MiB memtables and two writers do not fit 48 MiB"
    );
    let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
    let n = 400_000u32;
    for i in 0..n {
        // A caller takes writes only while there is room (as a shard does).
        while s.write_room() == 0 {
            s.poll(|_, _| {});
        }
        run(
            &mut s,
            Op::Put(k((i % 61) as u16, &key(i)), &[i as u8; 100]),
        )
        .unwrap();
        if i % 997 == 0 {
            // Beside it, at most one flushed memtable on its way to the
            // reuse pool: it is counted until the thread that clears it
            // hands it over (slower while other tests run).
            let m = s.memory();
            let in_transit = m.memtable_limit.next_multiple_of(2 << 20) + (1 << 20);
            assert!(m.total() <= budget + in_transit, "{m:?} at put {i}");
        }
    }
    s.settle();
    let m = s.memory();
    assert!(m.total() <= budget, "{m:?} settled");
    assert!(
        m.memtable_limit < first,
        "the limit fell as indexes and filters grew: {first} -> {}",
        m.memtable_limit
    );
    assert!(s.stats().compactions > 0, "compactions ran");
    for i in (0..n).step_by(1009) {
        assert_eq!(
            run(&mut s, Op::Get(k((i % 61) as u16, &key(i)))).unwrap(),
            Owned::Value(Some(vec![i as u8; 100])),
            "key {i}"
        );
    }
}

/// A compaction's filter and index of more than a write buffer go to
/// disk in pieces, a run per look at the clock between requests, and a
/// reopened store reads them back whole (their checksum spans the
/// pieces).
#[test]
fn a_meta_region_written_in_pieces_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 256 << 20);
    cfg.memtable_bytes = Some(16 << 20);
    let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
    let n = 1_200_000u32;
    {
        let (mut s, _) = Store::open(cfg.clone(), SyncIo::new(false)).unwrap();
        for i in 0..n {
            s.write_batch(&[Op::Put(k((i % 61) as u16, &key(i)), &i.to_le_bytes())])
                .unwrap();
            if i % 4096 == 0 {
                s.poll(|_, _| {});
            }
        }
        // (Memtables are made durable by a flush or a checkpoint.)
        s.flush();
        s.settle();
        s.compact_all();
        // Steps as between requests: 5 us each.
        while s.stats().compactions == 0 {
            s.note_foreground(std::time::Duration::ZERO);
            s.poll(|_, _| {});
        }
        s.settle();
        let st = s.stats();
        assert_eq!(st.segments, 1, "{st:?}");
    }
    let (mut s, rep) = Store::open(cfg, SyncIo::new(false)).unwrap();
    assert!(
        rep.torn.is_empty() && rep.torn_removed.is_empty(),
        "{rep:?}"
    );
    let meta = s.memory().indexes_and_filters;
    assert!(
        meta > 1 << 20,
        "{meta} bytes of index and filter: more than one buffer"
    );
    for i in (0..n).step_by(7919) {
        assert_eq!(
            run(&mut s, Op::Get(k((i % 61) as u16, &key(i)))).unwrap(),
            Owned::Value(Some(i.to_le_bytes().to_vec())),
            "key {i}"
        );
    }
    assert_eq!(
        run(&mut s, Op::Get(k(3, b"absent"))).unwrap(),
        Owned::Value(None)
    );
}

/// Reads that miss the cache take their buffers from its budget: issued
/// all at once, thousands of them passed it (and the memory budget) by
/// tens of MiB; past the budget they wait for earlier ones, and every one
/// completes with its value.
#[test]
fn reads_in_flight_stay_within_the_cache_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(4 << 20);
    cfg.block_cache_max = Some(2 << 20);
    let key = |i: u32| i.wrapping_mul(2_654_435_761).to_be_bytes();
    let n = 100_000u32;
    let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
    for i in 0..n {
        run(
            &mut s,
            Op::Put(k((i % 61) as u16, &key(i)), &[i as u8; 100]),
        )
        .unwrap();
    }
    s.flush();
    s.settle();
    let budget = s.cache_budget();
    assert!(budget <= 2 << 20);
    // 4,000 gets spread over the state: most miss the cache.
    let picked: Vec<u32> = (0..n).step_by(25).collect();
    let mut pending = 0;
    for &i in &picked {
        match s
            .submit(u64::from(i), Op::Get(k((i % 61) as u16, &key(i))))
            .unwrap()
        {
            Submitted::Pending => pending += 1,
            Submitted::Ready(o) => {
                assert_eq!(Owned::from(o), Owned::Value(Some(vec![i as u8; 100])))
            }
        }
        let cached = s.memory().block_cache;
        assert!(
            cached <= budget.max(1 << 20) + (64 << 10),
            "{cached} bytes in the cache and lent to reads, budget {budget}"
        );
    }
    assert!(pending > 1_000, "{pending} gets went to the disk");
    let mut done = 0;
    while done < pending {
        s.poll(|t, r| {
            let i = t as u32;
            assert_eq!(
                r.map(Owned::from).unwrap(),
                Owned::Value(Some(vec![i as u8; 100])),
                "key {i}"
            );
            done += 1;
        });
        let cached = s.memory().block_cache;
        assert!(cached <= budget.max(1 << 20) + (64 << 10), "{cached}");
    }
}
