//! Model-based property test: random sequences of every operation,
//! flushes, compactions, clean reopens and crashes, run against the store
//! over a fault-injecting I/O layer and against a `BTreeMap` model.
//!
//! Faults (EIO on reads, writes and fsyncs, ENOSPC, flipped bits in data
//! read back) are injected on a countdown. A read may fail only if a fault
//! was injected while it ran, and must never return wrong data; background
//! work that fails is retried, and nothing acknowledged-as-flushed is lost.
//! A crash (drop without flushing) loses exactly the writes since the last
//! completed flush, as the durability contract says.
//!
//! proptest prints the failing case (shrunk) and stores its seed in
//! `proptest-regressions/`; `PROPTEST_CASES` sets the number of cases.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Owned, run, settle_fully};
use proptest::prelude::*;
use stator_store::io::{Fault, FaultIo, FaultPlan, Io, SyncIo, UringIo};
use stator_store::ops::encode_element;
use stator_store::{IterMode, KeyRef, Op, StateKind, Store, StoreConfig};

type Key = (u16, Vec<u8>, Vec<u8>);

#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    values: BTreeMap<Key, Vec<u8>>,
    lists: BTreeMap<Key, Vec<Vec<u8>>>,
    maps: BTreeMap<Key, BTreeMap<Vec<u8>, Vec<u8>>>,
}

impl Model {
    fn delete_kgs(&mut self, lo: u16, hi: u16) {
        let keep = |k: &Key| k.0 < lo || k.0 > hi;
        self.values.retain(|k, _| keep(k));
        self.lists.retain(|k, _| keep(k));
        self.maps.retain(|k, _| keep(k));
    }
}

#[derive(Clone, Debug)]
enum MOp {
    Put(Key, Vec<u8>),
    Delete(Key),
    Get(Key),
    Append(Key, Vec<u8>),
    AppendAll(Key, Vec<Vec<u8>>),
    Replace(Key, Vec<Vec<u8>>),
    ListGet(Key),
    ClearValue(Key),
    ClearList(Key),
    MapPut(Key, Vec<u8>, Vec<u8>),
    MapRemove(Key, Vec<u8>),
    MapGet(Key, Vec<u8>),
    MapContains(Key, Vec<u8>),
    MapIter(Key, u8, usize),
    ClearMap(Key),
    DeleteKeyGroups(u16, u16),
    Flush,
    Reopen,
    Crash,
    Faults(u64, u8),
}

/// A small key space, so that operations meet on the same keys across
/// flushes, compactions and clears.
fn key() -> impl Strategy<Value = Key> {
    (
        0u16..3,
        prop::collection::vec(0u8..3, 1..2),
        prop::collection::vec(0u8..1, 0..2),
    )
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..40)
}

fn ukey() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0u8..5, 1..2)
}

fn op() -> impl Strategy<Value = MOp> {
    prop_oneof![
        6 => (key(), bytes()).prop_map(|(k, v)| MOp::Put(k, v)),
        2 => key().prop_map(MOp::Delete),
        6 => key().prop_map(MOp::Get),
        4 => (key(), bytes()).prop_map(|(k, v)| MOp::Append(k, v)),
        2 => (key(), prop::collection::vec(bytes(), 0..4)).prop_map(|(k, v)| MOp::AppendAll(k, v)),
        1 => (key(), prop::collection::vec(bytes(), 0..3)).prop_map(|(k, v)| MOp::Replace(k, v)),
        4 => key().prop_map(MOp::ListGet),
        1 => key().prop_map(MOp::ClearValue),
        1 => key().prop_map(MOp::ClearList),
        6 => (key(), ukey(), bytes()).prop_map(|(k, u, v)| MOp::MapPut(k, u, v)),
        2 => (key(), ukey()).prop_map(|(k, u)| MOp::MapRemove(k, u)),
        4 => (key(), ukey()).prop_map(|(k, u)| MOp::MapGet(k, u)),
        2 => (key(), ukey()).prop_map(|(k, u)| MOp::MapContains(k, u)),
        3 => (key(), 0u8..3, 50usize..200).prop_map(|(k, m, b)| MOp::MapIter(k, m, b)),
        2 => key().prop_map(MOp::ClearMap),
        1 => (0u16..3, 0u16..2).prop_map(|(lo, n)| MOp::DeleteKeyGroups(lo, lo + n)),
        4 => Just(MOp::Flush),
        1 => Just(MOp::Reopen),
        1 => Just(MOp::Crash),
        2 => (0u64..40, 0u8..5).prop_map(|(n, f)| MOp::Faults(n, f)),
    ]
}

const VALUE: u32 = 1;
const LIST: u32 = 2;
const MAP: u32 = 3;

fn kr(k: &Key, state: u32) -> KeyRef<'_> {
    KeyRef {
        key_group: k.0,
        state,
        key: &k.1,
        namespace: &k.2,
    }
}

type S<I> = Store<FaultIo<I>>;

/// Opens the store; after a clean shutdown no file may be reported torn
/// (after a crash, a flush or compaction cut short is reported torn).
fn open<I: Io>(dir: &std::path::Path, clean: bool, mk: fn() -> I) -> S<I> {
    let mut cfg = StoreConfig::new(dir, 2 << 30);
    // A tiny cache, so reads go to the (faulty) disk.
    cfg.block_cache_max = Some(16 << 10);
    // Only explicit flushes freeze the memtable, so the durable state is
    // exactly the model at the last completed flush.
    cfg.memtable_bytes = Some(1 << 30);
    cfg.compaction_trigger = 3;
    cfg.work_per_poll = 7;
    cfg.retry_delay = Duration::from_millis(1);
    let (s, rep) = Store::open(cfg, FaultIo::new(mk(), None)).expect("reopen");
    if clean {
        assert!(rep.torn.is_empty(), "clean files reported torn: {rep:?}");
    }
    s
}

fn check_read<I: Io>(s: &mut S<I>, op: Op<'_>, want: Owned, what: &str) {
    let before = s.io().injected;
    match run(s, op) {
        Ok(got) => assert_eq!(got, want, "{what}"),
        Err(e) => assert!(
            s.io().injected > before,
            "{what}: error without an injected fault: {e}"
        ),
    }
}

fn list_bytes(l: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in l {
        encode_element(&mut out, e);
    }
    out
}

fn run_case<I: Io>(ops: Vec<MOp>, mk: fn() -> I) {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, mk);
    let mut m = Model::default();
    let mut durable = Model::default();
    for op in ops {
        match op {
            MOp::Put(k, v) => {
                run(&mut s, Op::Put(kr(&k, VALUE), &v)).unwrap();
                m.values.insert(k, v);
            }
            MOp::Delete(k) => {
                run(&mut s, Op::Delete(kr(&k, VALUE))).unwrap();
                m.values.remove(&k);
            }
            MOp::ClearValue(k) => {
                run(&mut s, Op::Clear(kr(&k, VALUE), StateKind::Value)).unwrap();
                m.values.remove(&k);
            }
            MOp::Get(k) => {
                let want = Owned::Value(m.values.get(&k).cloned());
                check_read(&mut s, Op::Get(kr(&k, VALUE)), want, "get");
            }
            MOp::Append(k, v) => {
                run(&mut s, Op::ListAppend(kr(&k, LIST), &v)).unwrap();
                m.lists.entry(k).or_default().push(v);
            }
            MOp::AppendAll(k, l) => {
                run(&mut s, Op::ListAppendAll(kr(&k, LIST), &list_bytes(&l))).unwrap();
                if !l.is_empty() {
                    m.lists.entry(k).or_default().extend(l);
                }
            }
            MOp::Replace(k, l) => {
                run(&mut s, Op::ListReplace(kr(&k, LIST), &list_bytes(&l))).unwrap();
                if l.is_empty() {
                    m.lists.remove(&k);
                } else {
                    m.lists.insert(k, l);
                }
            }
            MOp::ClearList(k) => {
                run(&mut s, Op::Clear(kr(&k, LIST), StateKind::List)).unwrap();
                m.lists.remove(&k);
            }
            MOp::ListGet(k) => {
                let want = Owned::Value(m.lists.get(&k).map(|l| list_bytes(l)));
                check_read(&mut s, Op::ListGet(kr(&k, LIST)), want, "list get");
            }
            MOp::MapPut(k, u, v) => {
                run(&mut s, Op::MapPut(kr(&k, MAP), &u, &v)).unwrap();
                m.maps.entry(k).or_default().insert(u, v);
            }
            MOp::MapRemove(k, u) => {
                run(&mut s, Op::MapRemove(kr(&k, MAP), &u)).unwrap();
                if let Some(mm) = m.maps.get_mut(&k) {
                    mm.remove(&u);
                }
            }
            MOp::ClearMap(k) => {
                run(&mut s, Op::Clear(kr(&k, MAP), StateKind::Map)).unwrap();
                m.maps.remove(&k);
            }
            MOp::MapGet(k, u) => {
                let want = Owned::Value(m.maps.get(&k).and_then(|mm| mm.get(&u)).cloned());
                check_read(&mut s, Op::MapGet(kr(&k, MAP), &u), want, "map get");
            }
            MOp::MapContains(k, u) => {
                let want = Owned::Contains(m.maps.get(&k).is_some_and(|mm| mm.contains_key(&u)));
                check_read(
                    &mut s,
                    Op::MapContains(kr(&k, MAP), &u),
                    want,
                    "map contains",
                );
            }
            MOp::MapIter(k, mode, page) => {
                let mode = [IterMode::Keys, IterMode::Values, IterMode::Entries][mode as usize];
                let want: Vec<(Vec<u8>, Vec<u8>)> = m
                    .maps
                    .get(&k)
                    .map(|mm| mm.iter().map(|(a, b)| (a.clone(), b.clone())).collect())
                    .unwrap_or_default();
                let mut got_data = Vec::new();
                let mut after: Option<Vec<u8>> = None;
                let mut pages = 0;
                loop {
                    let before = s.io().injected;
                    let r = run(
                        &mut s,
                        Op::MapIter {
                            map: kr(&k, MAP),
                            mode,
                            after: after.as_deref(),
                            max_bytes: page,
                        },
                    );
                    let (data, n, last, more) = match r {
                        Ok(Owned::Page(d, n, l, more)) => (d, n, l, more),
                        Ok(o) => panic!("iterate returned {o:?}"),
                        Err(e) => {
                            assert!(
                                s.io().injected > before,
                                "iterate failed without a fault: {e}"
                            );
                            break;
                        }
                    };
                    got_data.extend_from_slice(&data);
                    pages += 1;
                    assert!(pages < 1000, "iteration does not advance");
                    if !more {
                        let mut want_data = Vec::new();
                        for (uk, v) in &want {
                            if matches!(mode, IterMode::Keys | IterMode::Entries) {
                                encode_element(&mut want_data, uk);
                            }
                            if matches!(mode, IterMode::Values | IterMode::Entries) {
                                encode_element(&mut want_data, v);
                            }
                        }
                        assert_eq!(got_data, want_data, "map iterate ({mode:?}, page {page})");
                        break;
                    }
                    // The cursor advances even over a page of deleted entries.
                    assert!(
                        n > 0 || !last.is_empty(),
                        "a page with more to come did not advance"
                    );
                    after = Some(last);
                }
            }
            MOp::DeleteKeyGroups(lo, hi) => {
                run(&mut s, Op::DeleteKeyGroups { lo, hi }).unwrap();
                m.delete_kgs(lo, hi);
                // Durable once the layer list is written, in the
                // background (let finish here).
                settle_fully(&mut s);
                durable.delete_kgs(lo, hi);
            }
            MOp::Flush => {
                s.flush();
                settle_fully(&mut s);
                durable = m.clone();
            }
            MOp::Reopen => {
                s.flush();
                settle_fully(&mut s);
                drop(s);
                s = open(dir.path(), true, mk);
                durable = m.clone();
            }
            MOp::Crash => {
                // Unflushed writes are lost by contract; flushed ones are not.
                drop(s);
                s = open(dir.path(), false, mk);
                m = durable.clone();
            }
            MOp::Faults(after, kind) => {
                let fault = [
                    Fault::ReadEio,
                    Fault::WriteEio,
                    Fault::NoSpace,
                    Fault::FsyncEio,
                    Fault::ReadBitFlip,
                ][kind as usize];
                s.io_mut().set_plan(Some(FaultPlan {
                    after,
                    fault,
                    sticky: false,
                }));
            }
        }
    }
    // Finally everything the model holds reads back, after a clean reopen.
    s.io_mut().set_plan(None);
    s.flush();
    settle_fully(&mut s);
    drop(s);
    let mut s = open(dir.path(), true, mk);
    for (k, v) in &m.values {
        assert_eq!(
            run(&mut s, Op::Get(kr(k, VALUE))).unwrap(),
            Owned::Value(Some(v.clone()))
        );
    }
    for (k, l) in &m.lists {
        assert_eq!(
            run(&mut s, Op::ListGet(kr(k, LIST))).unwrap(),
            Owned::Value(Some(list_bytes(l)))
        );
    }
    for (k, mm) in &m.maps {
        for (u, v) in mm {
            assert_eq!(
                run(&mut s, Op::MapGet(kr(k, MAP), u)).unwrap(),
                Owned::Value(Some(v.clone()))
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, max_shrink_iters: 4000, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_model(ops in prop::collection::vec(op(), 1..150)) {
        run_case(ops, || SyncIo::new(true));
    }
}

proptest! {
    // The same model over io_uring (fewer cases: the two layers are also
    // compared directly by the basic tests).
    #![proptest_config(ProptestConfig { cases: 64, max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn store_matches_model_over_io_uring(ops in prop::collection::vec(op(), 1..150)) {
        run_case(ops, || UringIo::new(64, true).unwrap());
    }
}

/// Fixed sequences the random search might take long to find.
#[test]
fn map_clear_hides_flushed_entries() {
    let k: Key = (1, vec![1], vec![]);
    let ops = vec![
        MOp::MapPut(k.clone(), vec![1], b"old".to_vec()),
        MOp::Flush,
        MOp::ClearMap(k.clone()),
        MOp::MapGet(k.clone(), vec![1]),
        MOp::MapContains(k.clone(), vec![1]),
        MOp::MapIter(k.clone(), 2, 100),
        MOp::Flush,
        MOp::MapGet(k.clone(), vec![1]),
        MOp::MapPut(k.clone(), vec![2], b"new".to_vec()),
        MOp::Flush,
        MOp::Flush,
        MOp::MapGet(k.clone(), vec![1]),
        MOp::MapIter(k.clone(), 2, 100),
    ];
    run_case(ops.clone(), || SyncIo::new(true));
    run_case(ops, || UringIo::new(64, true).unwrap());
}
