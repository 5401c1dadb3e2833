//! Checkpoints, restores and rescales against a model.
//!
//! Two owners (think: two operators of one job) share one store. Random
//! writes (values, list appends, map puts and clears) are interleaved with
//! checkpoints taken at a random parallelism (one checkpoint per key-group
//! range), completions, aborts, restores of any retained checkpoint into a
//! random parallelism (all ranges, or only one), flushes, major
//! compactions, clean reopens and crashes. After every step the store must
//! read exactly like the model: a restore gives each range exactly the
//! checkpointed state of its key groups, and nothing outside the range or
//! of the other owner changes. Handles of deleted checkpoints, of the other
//! owner, and altered handles are refused and change nothing.

mod common;

use std::collections::BTreeMap;

use common::{Owned, checkpoint, export_chunks, import_chunks, notify, run, settle_fully};
use proptest::prelude::*;
use stator_store::io::{Io, SyncIo, UringIo};
use stator_store::ops::encode_element;
use stator_store::snapshot::StateDesc;
use stator_store::{
    CheckpointSpec, ExportSpec, ImportSpec, IterMode, KeyRef, Notify, Op, RestoreSpec, StateKind,
    Store, StoreConfig, StoreError,
};

const KGS: u16 = 8;
const OWNERS: [&[u8]; 2] = [b"job\0op-a", b"job\0op-b"];
/// Value, list and map state ids of each owner.
const STATES: [[u32; 3]; 2] = [[1, 2, 3], [4, 5, 6]];

/// State names (what a portable snapshot carries), by kind index.
const NAMES: [&[u8]; 3] = [b"value", b"list", b"map"];

fn descs(o: usize) -> Vec<StateDesc> {
    let kinds = [StateKind::Value, StateKind::List, StateKind::Map];
    (0..3)
        .map(|i| StateDesc {
            id: STATES[o][i],
            kind: kinds[i],
            name: NAMES[i].to_vec(),
        })
        .collect()
}

fn names(o: usize) -> Vec<(&'static [u8], u32)> {
    (0..3).map(|i| (NAMES[i], STATES[o][i])).collect()
}

/// (owner, key group, key)
type K = (usize, u16, u8);

#[derive(Clone, Debug, Default, PartialEq)]
struct Model {
    values: BTreeMap<K, Vec<u8>>,
    lists: BTreeMap<K, Vec<Vec<u8>>>,
    maps: BTreeMap<K, BTreeMap<u8, Vec<u8>>>,
}

impl Model {
    /// `from`'s owner-`src` entries as owner `dst`'s.
    fn as_owner(&self, src: usize, dst: usize) -> Model {
        let mv = |k: &K| (k.0 == src).then_some((dst, k.1, k.2));
        Model {
            values: self
                .values
                .iter()
                .filter_map(|(k, v)| Some((mv(k)?, v.clone())))
                .collect(),
            lists: self
                .lists
                .iter()
                .filter_map(|(k, v)| Some((mv(k)?, v.clone())))
                .collect(),
            maps: self
                .maps
                .iter()
                .filter_map(|(k, v)| Some((mv(k)?, v.clone())))
                .collect(),
        }
    }

    /// Replaces `owner`'s state in key groups `lo..=hi` by `from`'s.
    fn restore(&mut self, owner: usize, lo: u16, hi: u16, from: &Model) {
        let inside = |k: &K| k.0 == owner && lo <= k.1 && k.1 <= hi;
        self.values.retain(|k, _| !inside(k));
        self.lists.retain(|k, _| !inside(k));
        self.maps.retain(|k, _| !inside(k));
        for (k, v) in from.values.iter().filter(|(k, _)| inside(k)) {
            self.values.insert(*k, v.clone());
        }
        for (k, v) in from.lists.iter().filter(|(k, _)| inside(k)) {
            self.lists.insert(*k, v.clone());
        }
        for (k, v) in from.maps.iter().filter(|(k, _)| inside(k)) {
            self.maps.insert(*k, v.clone());
        }
    }
}

#[derive(Clone, Debug)]
enum COp {
    Put(K, u8),
    Delete(K),
    Append(K, u8),
    MapPut(K, u8, u8),
    ClearMap(K),
    /// Checkpoint an owner at a parallelism; then complete, abort or leave it.
    Checkpoint(usize, u16, u8),
    /// Restore an owner from its n-th newest retained checkpoint into a
    /// parallelism, all ranges or only range `only % p`.
    Restore(usize, usize, u16, Option<u16>),
    /// Try handles that must be refused.
    BadRestore(usize, u8),
    /// Export an owner at a parallelism (portable chunks, each range into
    /// slots of 4 KiB << n).
    Export(usize, u16, u8),
    /// Import the n-th newest export into an owner (maybe the other one:
    /// states resolve by name) at a parallelism, all ranges or one; or
    /// with one chunk corrupted (refused, nothing changes).
    Import(usize, usize, u16, Option<u16>, bool),
    Flush,
    Compact,
    Reopen,
    Crash,
}

fn k() -> impl Strategy<Value = K> {
    (0usize..2, 0u16..KGS, 0u8..3)
}

fn cop() -> impl Strategy<Value = COp> {
    prop_oneof![
        8 => (k(), any::<u8>()).prop_map(|(k, v)| COp::Put(k, v)),
        2 => k().prop_map(COp::Delete),
        4 => (k(), any::<u8>()).prop_map(|(k, v)| COp::Append(k, v)),
        4 => (k(), 0u8..3, any::<u8>()).prop_map(|(k, u, v)| COp::MapPut(k, u, v)),
        1 => k().prop_map(COp::ClearMap),
        4 => (0usize..2, 1u16..5, 0u8..3).prop_map(|(o, p, n)| COp::Checkpoint(o, p, n)),
        3 => (0usize..2, 0usize..3, 1u16..5, prop::option::of(0u16..4))
            .prop_map(|(o, n, p, only)| COp::Restore(o, n, p, only)),
        1 => (0usize..2, 0u8..3).prop_map(|(o, w)| COp::BadRestore(o, w)),
        2 => (0usize..2, 1u16..5, 0u8..3).prop_map(|(o, p, n)| COp::Export(o, p, n)),
        2 => (0usize..2, 0usize..3, 1u16..5, prop::option::of(0u16..4), prop::bool::weighted(0.2))
            .prop_map(|(o, n, p, only, bad)| COp::Import(o, n, p, only, bad)),
        2 => Just(COp::Flush),
        1 => Just(COp::Compact),
        1 => Just(COp::Reopen),
        1 => Just(COp::Crash),
    ]
}

/// Key groups of range `i` of `p` (Flink's split of 8 groups).
fn range(p: u16, i: u16) -> (u16, u16) {
    (i * KGS / p, (i + 1) * KGS / p - 1)
}

fn kr(k: &K, kind: usize) -> KeyRef<'static> {
    const KEYS: [[u8; 1]; 3] = [[0], [1], [2]];
    KeyRef {
        key_group: k.1,
        state: STATES[k.0][kind],
        key: &KEYS[k.2 as usize],
        namespace: b"",
    }
}

/// Opens the store; only after a crash may a file be torn (a flush or
/// compaction cut short).
fn open<I: Io>(dir: &std::path::Path, clean: bool, mk: fn() -> I) -> Store<I> {
    let mut cfg = StoreConfig::new(dir, 2 << 30);
    cfg.block_cache_max = Some(16 << 10);
    cfg.memtable_bytes = Some(1 << 30);
    cfg.compaction_trigger = 3;
    cfg.work_per_poll = 5;
    cfg.retained_checkpoints = 2;
    let (s, rep) = Store::open(cfg, mk()).expect("open");
    assert!(!clean || rep.torn.is_empty(), "{rep:?}");
    s
}

fn list_bytes(l: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in l {
        encode_element(&mut out, e);
    }
    out
}

/// Every key of the key space reads as the model says.
fn check<I: Io>(s: &mut Store<I>, m: &Model, what: &str) {
    for o in 0..2 {
        for kg in 0..KGS {
            for key in 0..3 {
                let k = (o, kg, key);
                assert_eq!(
                    run(s, Op::Get(kr(&k, 0))).unwrap(),
                    Owned::Value(m.values.get(&k).cloned()),
                    "{what}: value {k:?}"
                );
                assert_eq!(
                    run(s, Op::ListGet(kr(&k, 1))).unwrap(),
                    Owned::Value(m.lists.get(&k).map(|l| list_bytes(l))),
                    "{what}: list {k:?}"
                );
                let mut want = Vec::new();
                for (u, v) in m.maps.get(&k).into_iter().flatten() {
                    encode_element(&mut want, &[*u]);
                    encode_element(&mut want, v);
                }
                let got = run(
                    s,
                    Op::MapIter {
                        map: kr(&k, 2),
                        mode: IterMode::Entries,
                        after: None,
                        max_bytes: 1 << 20,
                    },
                )
                .unwrap();
                match got {
                    Owned::Page(d, _, _, false) => assert_eq!(d, want, "{what}: map {k:?}"),
                    o => panic!("{what}: map {k:?}: {o:?}"),
                }
            }
        }
    }
}

/// A checkpoint the model remembers.
struct Ckpt {
    owner: usize,
    id: u64,
    completed: bool,
    handles: Vec<((u16, u16), Vec<u8>)>,
    state: Model,
}

fn run_case<I: Io>(ops: Vec<COp>, mk: fn() -> I) {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, mk);
    let mut m = Model::default();
    let mut durable = Model::default();
    let mut ckpts: Vec<Ckpt> = Vec::new();
    let mut dead: Vec<(usize, Vec<u8>)> = Vec::new();
    let mut next_id = 1u64;
    // Exports: owner, chunks per range, the state they hold.
    type Export = (usize, Vec<((u16, u16), Vec<Vec<u8>>)>, Model);
    let mut exports: Vec<Export> = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        let what = format!("step {step} ({op:?})");
        match op {
            COp::Put(k, v) => {
                run(&mut s, Op::Put(kr(&k, 0), &[v])).unwrap();
                m.values.insert(k, vec![v]);
            }
            COp::Delete(k) => {
                run(&mut s, Op::Delete(kr(&k, 0))).unwrap();
                m.values.remove(&k);
            }
            COp::Append(k, v) => {
                run(&mut s, Op::ListAppend(kr(&k, 1), &[v])).unwrap();
                m.lists.entry(k).or_default().push(vec![v]);
            }
            COp::MapPut(k, u, v) => {
                run(&mut s, Op::MapPut(kr(&k, 2), &[u], &[v])).unwrap();
                m.maps.entry(k).or_default().insert(u, vec![v]);
            }
            COp::ClearMap(k) => {
                run(&mut s, Op::Clear(kr(&k, 2), StateKind::Map)).unwrap();
                m.maps.remove(&k);
            }
            COp::Checkpoint(o, p, then) => {
                let id = next_id;
                next_id += 1;
                let mut handles = Vec::new();
                for i in 0..p {
                    let (lo, hi) = range(p, i);
                    let spec = CheckpointSpec {
                        owner: OWNERS[o].to_vec(),
                        checkpoint_id: id,
                        lo,
                        hi,
                        states: STATES[o].to_vec(),
                        meta: format!("meta {id}/{i}").into_bytes(),
                    };
                    handles.push(((lo, hi), checkpoint(&mut s, spec).unwrap()));
                }
                // Completion implies every earlier write was flushed.
                durable = m.clone();
                ckpts.push(Ckpt {
                    owner: o,
                    id,
                    completed: false,
                    handles,
                    state: m.clone(),
                });
                match then {
                    0 => {
                        notify(&mut s, OWNERS[o], id, Notify::Complete).unwrap();
                        ckpts.last_mut().unwrap().completed = true;
                        // Retention 2: the owner's checkpoints older than
                        // its second-newest completed one are deleted, and
                        // older ones that never completed.
                        let mut done: Vec<u64> = ckpts
                            .iter()
                            .filter(|c| c.owner == o && c.completed)
                            .map(|c| c.id)
                            .collect();
                        done.sort_unstable_by(|a, b| b.cmp(a));
                        let oldest = done.get(1).copied().unwrap_or(done[0]);
                        let doomed = |c: &Ckpt| {
                            c.owner == o && (c.id < oldest || (!c.completed && c.id < id))
                        };
                        for c in ckpts.iter().filter(|c| doomed(c)) {
                            dead.extend(c.handles.iter().map(|(_, h)| (o, h.clone())));
                        }
                        ckpts.retain(|c| !doomed(c));
                    }
                    1 => {
                        s.checkpoint_notify(OWNERS[o], id, Notify::Abort);
                        let c = ckpts.pop().unwrap();
                        dead.extend(c.handles.into_iter().map(|(_, h)| (o, h)));
                    }
                    _ => {}
                }
            }
            COp::Restore(o, n, p, only) => {
                let mine: Vec<&Ckpt> = ckpts.iter().filter(|c| c.owner == o).rev().collect();
                let Some(c) = mine.get(n.min(mine.len().saturating_sub(1))) else {
                    continue;
                };
                let parts: Vec<u16> = match only {
                    Some(i) => vec![i % p],
                    None => (0..p).collect(),
                };
                let from = c.state.clone();
                for i in parts {
                    let (lo, hi) = range(p, i);
                    let hs: Vec<&[u8]> = c
                        .handles
                        .iter()
                        .filter(|((a, b), _)| *a <= hi && lo <= *b)
                        .map(|(_, h)| h.as_slice())
                        .collect();
                    let r = s
                        .restore(
                            RestoreSpec {
                                owner: OWNERS[o],
                                lo,
                                hi,
                                states: &STATES[o],
                            },
                            &hs,
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(r.manifests.len(), hs.len());
                    assert!(r.manifests.iter().all(|x| x.checkpoint_id == c.id));
                    m.restore(o, lo, hi, &from);
                }
                // A restore freezes the memtable; once its flush is done
                // (waited for here, so a crash loses a known set), the
                // writes before it are durable too.
                settle_fully(&mut s);
                durable = m.clone();
            }
            COp::BadRestore(o, which) => {
                let (lo, hi) = (0, KGS - 1);
                let h: Vec<u8> = match which {
                    0 => match dead.iter().find(|(owner, _)| *owner == o) {
                        Some((_, h)) => h.clone(),
                        None => continue,
                    },
                    1 => match ckpts.iter().find(|c| c.owner != o) {
                        Some(c) => c.handles[0].1.clone(),
                        None => continue,
                    },
                    _ => match ckpts.iter().find(|c| c.owner == o) {
                        Some(c) => {
                            let mut h = c.handles[0].1.clone();
                            h[10] ^= 1;
                            h
                        }
                        None => continue,
                    },
                };
                let r = s.restore(
                    RestoreSpec {
                        owner: OWNERS[o],
                        lo,
                        hi,
                        states: &STATES[o],
                    },
                    &[&h],
                );
                assert!(
                    matches!(r, Err(StoreError::Restore(_))),
                    "{what}: a bad handle was not refused: {r:?}"
                );
            }
            COp::Export(o, p, n) => {
                let mut parts = Vec::new();
                for i in 0..p {
                    let (lo, hi) = range(p, i);
                    let spec = ExportSpec {
                        owner: OWNERS[o].to_vec(),
                        snapshot_id: next_id * 16 + i as u64,
                        lo,
                        hi,
                        states: descs(o),
                    };
                    let chunks = export_chunks(&mut s, spec, 4096 << n)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    parts.push(((lo, hi), chunks));
                }
                next_id += 1;
                // An export freezes the memtable but reads it where it is,
                // without waiting for its flush: once that flush is done
                // (let finish here), what it holds is durable.
                settle_fully(&mut s);
                durable = m.clone();
                exports.push((o, parts, m.clone()));
            }
            COp::Import(o, n, p, only, bad) => {
                let Some((src, parts, state)) = exports
                    .iter()
                    .rev()
                    .nth(n.min(exports.len().saturating_sub(1)))
                else {
                    continue;
                };
                let ranges: Vec<u16> = match only {
                    Some(i) => vec![i % p],
                    None => (0..p).collect(),
                };
                let from = state.as_owner(*src, o);
                for i in ranges {
                    let (lo, hi) = range(p, i);
                    let spec = ImportSpec {
                        owner: OWNERS[o].to_vec(),
                        lo,
                        hi,
                        states: STATES[o].to_vec(),
                    };
                    // Every exported part overlapping the range, one after
                    // the other (each is a snapshot of its own).
                    for ((a, b), chunks) in parts.iter().filter(|((a, b), _)| *a <= hi && lo <= *b)
                    {
                        let mut chunks = chunks.clone();
                        if bad {
                            let c = chunks.len() - 1;
                            let at = chunks[c].len() / 2;
                            chunks[c][at] ^= 0x10;
                            let r = import_chunks(&mut s, spec.clone(), &chunks, &names(o));
                            assert!(matches!(r, Err(StoreError::Snapshot(_))), "{what}: {r:?}");
                            continue;
                        }
                        let r = import_chunks(
                            &mut s,
                            ImportSpec {
                                lo: lo.max(*a),
                                hi: hi.min(*b),
                                ..spec.clone()
                            },
                            &chunks,
                            &names(o),
                        )
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                        let (lo, hi) = (lo.max(*a), hi.min(*b));
                        let inside = |k: &&K| lo <= k.1 && k.1 <= hi;
                        let want = from.values.keys().filter(inside).count()
                            + from.lists.keys().filter(inside).count()
                            + from
                                .maps
                                .iter()
                                .filter(|(k, _)| inside(k))
                                .map(|(_, v)| v.len())
                                .sum::<usize>();
                        assert_eq!(r.records as usize, want, "{what}: records imported");
                        m.restore(o, lo, hi, &from);
                    }
                }
                if !bad {
                    settle_fully(&mut s);
                    durable = m.clone();
                }
            }
            COp::Flush => {
                s.flush();
                settle_fully(&mut s);
                durable = m.clone();
            }
            COp::Compact => {
                s.flush();
                s.compact_all();
                settle_fully(&mut s);
                durable = m.clone();
            }
            COp::Reopen => {
                s.flush();
                settle_fully(&mut s);
                drop(s);
                s = open(dir.path(), true, mk);
                durable = m.clone();
            }
            COp::Crash => {
                drop(s);
                s = open(dir.path(), false, mk);
                m = durable.clone();
            }
        }
        if step % 8 == 7 {
            check(&mut s, &m, &what);
        }
    }
    check(&mut s, &m, "end");
    // Every retained checkpoint still restores exactly, after a crash.
    drop(s);
    let mut s = open(dir.path(), false, mk);
    let mut m = durable;
    check(&mut s, &m, "after the final crash");
    for c in &ckpts {
        for ((lo, hi), h) in &c.handles {
            s.restore(
                RestoreSpec {
                    owner: OWNERS[c.owner],
                    lo: *lo,
                    hi: *hi,
                    states: &STATES[c.owner],
                },
                &[h.as_slice()],
            )
            .unwrap();
            m.restore(c.owner, *lo, *hi, &c.state);
        }
        check(
            &mut s,
            &m,
            &format!("restore of checkpoint {} at the end", c.id),
        );
    }
    // No file is left that nothing references once every checkpoint is
    // subsumed and everything compacted.
    for c in &ckpts {
        s.checkpoint_notify(OWNERS[c.owner], c.id, Notify::Subsume);
    }
    s.flush();
    s.compact_all();
    settle_fully(&mut s);
    let st = s.stats();
    assert_eq!(st.checkpoints_retained, 0);
    let ssts = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            let n = e.as_ref().unwrap().file_name();
            let n = n.to_string_lossy();
            n.ends_with(".sst") || n.ends_with(".manifest")
        })
        .count();
    assert_eq!(
        ssts, st.segments,
        "files nothing references were left behind"
    );
    check(&mut s, &m, "after subsuming everything");
    // And it all opens again (restored layers whose checkpoints are gone).
    drop(s);
    let mut s = open(dir.path(), true, mk);
    check(&mut s, &m, "reopened after subsuming everything");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 4000, ..ProptestConfig::default() })]
    #[test]
    fn checkpoints_match_model(ops in prop::collection::vec(cop(), 1..80)) {
        run_case(ops, || SyncIo::new(true));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, max_shrink_iters: 2000, ..ProptestConfig::default() })]
    #[test]
    fn checkpoints_match_model_over_io_uring(ops in prop::collection::vec(cop(), 1..80)) {
        run_case(ops, || UringIo::new(64, true).unwrap());
    }
}

/// A checkpoint of owner 0's states in every key group.
fn whole(id: u64) -> CheckpointSpec {
    CheckpointSpec {
        owner: OWNERS[0].to_vec(),
        checkpoint_id: id,
        lo: 0,
        hi: KGS - 1,
        states: STATES[0].to_vec(),
        meta: Vec::new(),
    }
}

/// A restore of owner 0's states in every key group.
const WHOLE: RestoreSpec<'static> = RestoreSpec {
    owner: OWNERS[0],
    lo: 0,
    hi: KGS - 1,
    states: &STATES[0],
};

/// A checkpoint whose taker is gone is discarded (unless it completed):
/// its handle is refused afterwards and its pins are released.
#[test]
fn discarded_checkpoints_are_gone_and_completed_ones_stay() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let k = (0usize, 1u16, 0u8);
    run(&mut s, Op::Put(kr(&k, 0), b"v")).unwrap();
    let h1 = checkpoint(&mut s, whole(1)).unwrap();
    let h2 = checkpoint(&mut s, whole(2)).unwrap();
    assert!(s.discard_checkpoint(&h1), "an uncompleted checkpoint goes");
    assert!(!s.discard_checkpoint(&h1), "only once");
    s.checkpoint_notify(OWNERS[0], 2, Notify::Complete);
    assert!(!s.discard_checkpoint(&h2), "a completed checkpoint stays");
    assert_eq!(s.stats().checkpoints_retained, 1);
    assert!(matches!(
        s.restore(WHOLE, &[&h1]),
        Err(StoreError::Restore(_))
    ));
    s.restore(WHOLE, &[&h2]).unwrap();
    assert_eq!(
        run(&mut s, Op::Get(kr(&k, 0))).unwrap(),
        Owned::Value(Some(b"v".to_vec()))
    );
}

/// A checkpoint the engine released (Flink discarded it) goes, completed
/// or not, but only for its owner and only the one the handle names; a
/// release repeats harmlessly, and one with a handle that does not decode
/// is refused whole (the good handle beside it stays).
#[test]
fn released_checkpoints_go_for_their_owner_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let k = (0usize, 1u16, 0u8);
    run(&mut s, Op::Put(kr(&k, 0), b"v")).unwrap();
    let h1 = checkpoint(&mut s, whole(1)).unwrap();
    let h2 = checkpoint(&mut s, whole(2)).unwrap();
    s.checkpoint_notify(OWNERS[0], 1, Notify::Complete);
    assert_eq!(s.stats().checkpoints_retained, 2);
    assert_eq!(
        s.release_checkpoints(OWNERS[1], &[&h1]).unwrap().count,
        0,
        "another owner's"
    );
    assert_eq!(
        s.release_checkpoints(OWNERS[0], &[&h1]).unwrap().count,
        1,
        "a completed one goes"
    );
    assert_eq!(
        s.release_checkpoints(OWNERS[0], &[&h1]).unwrap().count,
        0,
        "only once"
    );
    let mut altered = h2.clone();
    altered[10] ^= 1;
    assert!(matches!(
        s.release_checkpoints(OWNERS[0], &[&h2, &altered]),
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        s.release_checkpoints(OWNERS[0], &[&h2[..20]]),
        Err(StoreError::Invalid(_))
    ));
    assert_eq!(s.stats().checkpoints_retained, 1);
    assert!(matches!(
        s.restore(WHOLE, &[&h1]),
        Err(StoreError::Restore(_))
    ));
    s.restore(WHOLE, &[&h2]).unwrap();
    assert_eq!(
        s.release_checkpoints(OWNERS[0], &[&h2, &h1]).unwrap().count,
        1,
        "an uncompleted one goes"
    );
    assert_eq!(s.stats().checkpoints_retained, 0);
    assert_eq!(
        run(&mut s, Op::Get(kr(&k, 0))).unwrap(),
        Owned::Value(Some(b"v".to_vec())),
        "the live state restored from it stays"
    );
}

/// Retained manifests are held in memory with the engine's metadata in
/// each (restores and exports read them there): the budget counts them,
/// from the checkpoint's end to its release, and after a reopen too.
#[test]
fn retained_manifests_count_against_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    run(&mut s, Op::Put(kr(&(0usize, 1u16, 0u8), 0), b"v")).unwrap();
    assert_eq!(s.memory().checkpoints, 0, "none yet");
    let meta = 256 << 10;
    let h = checkpoint(
        &mut s,
        CheckpointSpec {
            meta: vec![7; meta],
            ..whole(1)
        },
    )
    .unwrap();
    let m = s.memory();
    assert!(m.checkpoints >= meta, "{m:?}");
    assert!(m.total() >= m.indexes_and_filters + m.checkpoints, "{m:?}");
    drop(s);
    let mut s = open(dir.path(), false, || SyncIo::new(true));
    assert!(s.memory().checkpoints >= meta, "read back at open");
    assert_eq!(s.release_checkpoints(OWNERS[0], &[&h]).unwrap().count, 1);
    assert_eq!(s.memory().checkpoints, 0, "released");
}

/// Polls until restore `token` ends (within 60 s).
fn restored<I: Io>(s: &mut Store<I>, token: u64) -> Result<stator_store::Restored, StoreError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some((t, r)) = s.take_restored() {
            assert_eq!(t, token);
            return r;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "restore {token} never ended"
        );
        s.poll(|_, _| {});
        s.wait(Some(std::time::Duration::from_millis(5))).unwrap();
    }
}

/// A restore of segments no live layer holds reads their metadata in the
/// background: requests are answered meanwhile (as before it), and it
/// takes effect when it ends. A release of its checkpoint in that window
/// refuses it, and nothing changes.
#[test]
fn a_restore_opens_its_segments_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let (k1, k2) = ((0usize, 1u16, 0u8), (0usize, 2u16, 1u8));
    let get = |s: &mut Store<SyncIo>, k: &K| run(s, Op::Get(kr(k, 0))).unwrap();
    let val = |v: &[u8]| Owned::Value(Some(v.to_vec()));
    run(&mut s, Op::Put(kr(&k1, 0), b"old")).unwrap();
    let h1 = checkpoint(&mut s, whole(1)).unwrap();
    run(&mut s, Op::Put(kr(&k2, 0), b"two")).unwrap();
    let h2 = checkpoint(&mut s, whole(2)).unwrap();
    run(&mut s, Op::Put(kr(&k1, 0), b"new")).unwrap();
    // The checkpoints' segments are merged away: no live layer holds them.
    s.flush();
    s.compact_all();
    settle_fully(&mut s);
    assert_eq!(s.stats().segments, 1);

    // Released while its segments are read: refused, nothing changes.
    s.restore_start(1, WHOLE, &[&h2]).unwrap();
    assert!(s.take_restored().is_none(), "ended before its reads");
    assert_eq!(s.release_checkpoints(OWNERS[0], &[&h2]).unwrap().count, 1);
    match restored(&mut s, 1) {
        Err(StoreError::Restore(m)) => assert!(m.contains("released"), "{m}"),
        other => panic!("a released checkpoint restored: {other:?}"),
    }
    assert_eq!(s.stats().segments, 1);
    assert_eq!(get(&mut s, &k1), val(b"new"));
    assert_eq!(get(&mut s, &k2), val(b"two"));

    // Requests are answered while a restore's reads run, as before it.
    s.restore_start(2, WHOLE, &[&h1]).unwrap();
    assert!(s.take_restored().is_none(), "ended before its reads");
    assert_eq!(get(&mut s, &k2), val(b"two"));
    let r = restored(&mut s, 2).unwrap();
    assert_eq!((r.layers, r.manifests.len()), (1, 1));
    assert_eq!(get(&mut s, &k1), val(b"old"));
    assert_eq!(get(&mut s, &k2), Owned::Value(None));
    // And it is what a reopen finds.
    settle_fully(&mut s);
    drop(s);
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    assert_eq!(get(&mut s, &k1), val(b"old"));
    assert_eq!(get(&mut s, &k2), Owned::Value(None));
}

/// The bound on checkpoints neither completed nor aborted is per key-group
/// range (one engine subtask): more subtasks of one operator than the bound
/// all checkpoint at one barrier, and only a range that piles up more is
/// refused, until a completion lets it go on.
#[test]
fn uncompleted_checkpoints_are_bounded_per_key_group_range() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let spec = |id: u64, lo: u16, hi: u16| CheckpointSpec {
        lo,
        hi,
        ..whole(id)
    };
    // One checkpoint each of more subtasks than the bound, at one barrier.
    let subtasks = (stator_store::MAX_UNCOMPLETED + 8) as u64;
    for i in 0..subtasks {
        let kg = (i % u64::from(KGS)) as u16;
        checkpoint(&mut s, spec(1 + i / u64::from(KGS), kg, kg)).unwrap();
    }
    // One range piling up: the bound holds there, with a clear error.
    for id in 100..100 + stator_store::MAX_UNCOMPLETED as u64 {
        checkpoint(&mut s, whole(id)).unwrap();
    }
    match checkpoint(&mut s, whole(999)) {
        Err(StoreError::Limit(m)) => assert!(m.contains("key groups 0..=7"), "{m}"),
        other => panic!("a checkpoint past the bound: {other:?}"),
    }
    s.checkpoint_notify(OWNERS[0], 150, Notify::Complete);
    checkpoint(&mut s, whole(1000)).unwrap();
}

/// Manifests torn or corrupted on disk: at open they are set aside and
/// reported, their handles are refused with a clear error, and the state
/// is intact. One corrupted while the store runs still restores (the store
/// keeps each manifest as it wrote it) and is set aside at the next open.
#[test]
fn torn_and_corrupt_manifests_are_set_aside_and_refused() {
    use stator_store::manifest::{Handle, file_name};
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let (k1, k2) = ((0usize, 1u16, 0u8), (0usize, 2u16, 1u8));
    run(&mut s, Op::Put(kr(&k1, 0), b"one")).unwrap();
    let h1 = checkpoint(&mut s, whole(1)).unwrap();
    run(&mut s, Op::Put(kr(&k2, 0), b"two")).unwrap();
    let h2 = checkpoint(&mut s, whole(2)).unwrap();
    let h3 = checkpoint(&mut s, whole(3)).unwrap();
    drop(s);
    let path = |h: &[u8]| dir.path().join(file_name(Handle::decode(h).unwrap().seq));
    // Torn (cut short) and corrupted (one flipped bit in the body).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path(&h1))
        .unwrap();
    f.set_len(100).unwrap();
    let mut b = std::fs::read(path(&h2)).unwrap();
    b[60] ^= 0x04;
    std::fs::write(path(&h2), &b).unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 2 << 30);
    cfg.memtable_bytes = Some(1 << 30);
    let (mut s, rep) = Store::open(cfg, SyncIo::new(true)).unwrap();
    assert_eq!(rep.manifests, 1, "{rep:?}");
    assert_eq!(rep.torn.len(), 2, "{rep:?}");
    assert!(
        rep.torn
            .iter()
            .all(|(p, why)| { p.to_string_lossy().ends_with(".manifest.torn") && !why.is_empty() })
    );
    for h in [&h1, &h2] {
        match s.restore(WHOLE, &[h]) {
            Err(StoreError::Restore(m)) => assert!(m.contains("no checkpoint manifest"), "{m}"),
            other => panic!("a torn checkpoint restored: {other:?}"),
        }
    }
    let want = |s: &mut Store<SyncIo>| {
        assert_eq!(
            run(s, Op::Get(kr(&k1, 0))).unwrap(),
            Owned::Value(Some(b"one".to_vec()))
        );
        assert_eq!(
            run(s, Op::Get(kr(&k2, 0))).unwrap(),
            Owned::Value(Some(b"two".to_vec()))
        );
    };
    want(&mut s);
    // Corrupted while the store runs: the restore reads the manifest the
    // store wrote, not the damaged file.
    let mut b = std::fs::read(path(&h3)).unwrap();
    b[70] ^= 0x01;
    std::fs::write(path(&h3), &b).unwrap();
    run(&mut s, Op::Put(kr(&k1, 0), b"later")).unwrap();
    let r = s.restore(WHOLE, &[&h3]).unwrap();
    assert_eq!(r.manifests.len(), 1);
    want(&mut s);
    drop(s);
    let mut cfg = StoreConfig::new(dir.path(), 2 << 30);
    cfg.memtable_bytes = Some(1 << 30);
    let (mut s, rep) = Store::open(cfg, SyncIo::new(true)).unwrap();
    assert_eq!(rep.manifests, 0, "{rep:?}");
    assert_eq!(rep.torn.len(), 1, "{rep:?}");
    match s.restore(WHOLE, &[&h3]) {
        Err(StoreError::Restore(m)) => assert!(m.contains("no checkpoint manifest"), "{m}"),
        other => panic!("a damaged checkpoint restored: {other:?}"),
    }
    // A manifest's number is never given to another, even when every one
    // was set aside: the next checkpoint's is past them all.
    let seq = |h: &[u8]| Handle::decode(h).unwrap().seq;
    let h4 = checkpoint(&mut s, whole(4)).unwrap();
    assert!(seq(&h4) > seq(&h3), "{} reused", seq(&h4));
    drop(s);
    let mut cfg = StoreConfig::new(dir.path(), 2 << 30);
    cfg.memtable_bytes = Some(1 << 30);
    let (mut s, _) = Store::open(cfg, SyncIo::new(true)).unwrap();
    assert!(s.restore(WHOLE, &[&h4]).is_ok());
    let h5 = checkpoint(&mut s, whole(5)).unwrap();
    assert!(seq(&h5) > seq(&h4), "{} reused", seq(&h5));
}

/// Past `checkpoint_layer_limit` layers a checkpoint should wait, until
/// compaction merges them; the checkpoint then names fewer. Each one
/// would otherwise name every layer there is, and a restore of it bring
/// them all back (a crash loop grew that list by a flush per life).
#[test]
fn a_checkpoint_waits_for_compaction_past_the_layer_limit() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |trigger: usize| {
        let mut c = StoreConfig::new(dir.path(), 64 << 20);
        c.compaction_trigger = trigger;
        c.checkpoint_layer_limit = 12;
        c
    };
    // Fourteen layers, laid down by a store that never compacts.
    {
        let (mut s, _) = Store::open(cfg(1000), SyncIo::new(true)).unwrap();
        for i in 0u8..14 {
            run(
                &mut s,
                Op::Put(kr(&(0, u16::from(i) % KGS, i / 8), 0), &[i; 64]),
            )
            .unwrap();
            s.flush();
            settle_fully(&mut s);
        }
        assert_eq!(s.stats().segments, 14);
        assert!(!s.checkpoint_should_wait(), "past no limit it can act on");
    }
    let (mut s, _) = Store::open(cfg(4), SyncIo::new(true)).unwrap();
    assert_eq!(s.stats().segments, 14);
    assert!(s.checkpoint_should_wait());
    let t = std::time::Instant::now();
    while s.checkpoint_should_wait() {
        s.settle();
        assert!(t.elapsed().as_secs() < 30, "compaction never caught up");
    }
    assert!(s.stats().compactions >= 1);
    let h = checkpoint(&mut s, whole(1)).unwrap();
    let m = stator_store::manifest::Handle::decode(&h).unwrap();
    let named = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".manifest"))
        .find_map(|e| {
            let (man, _) =
                stator_store::manifest::Manifest::decode(&std::fs::read(e.path()).ok()?).ok()?;
            (man.seq == m.seq).then_some(man.layers.len())
        })
        .expect("its manifest");
    assert!(named < 12, "the checkpoint names {named} layers");
    for i in 0u8..14 {
        assert_eq!(
            run(&mut s, Op::Get(kr(&(0, u16::from(i) % KGS, i / 8), 0))).unwrap(),
            Owned::Value(Some(vec![i; 64]))
        );
    }
}

/// A completion marker whose manifest is gone is deleted at open, or the
/// open fails: left, it would mark the next manifest of that number
/// completed before it is (its delete's failure was once ignored).
#[test]
fn a_stale_marker_that_cannot_be_deleted_fails_the_open() {
    use stator_store::manifest::completed_name;
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path(), true, || SyncIo::new(true)));
    // A plain stale marker goes.
    let stale = dir.path().join(completed_name(7));
    std::fs::write(&stale, b"").unwrap();
    drop(open(dir.path(), true, || SyncIo::new(true)));
    assert!(!stale.exists(), "the stale marker is deleted");
    // One that cannot be (a directory: unlink fails with EISDIR).
    std::fs::create_dir(&stale).unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 2 << 30);
    cfg.memtable_bytes = Some(1 << 30);
    match Store::open(cfg, SyncIo::new(true)) {
        Err(e) => assert!(e.to_string().contains("stale checkpoint marker"), "{e}"),
        Ok(_) => panic!("a stale marker that stayed let the store open"),
    }
}

/// A read error at open must change nothing when the open then fails: a
/// compaction that merged a restored layer (whose file was deleted once
/// its checkpoint went, while `LAYERS` still names it until the list is
/// rewritten) read with a flipped bit would be set aside, and every later
/// open would then fail on the restored layer's missing file (the
/// daemon's simulator found it).
#[test]
fn a_failed_open_sets_nothing_aside() {
    use stator_store::io::{Fault, FaultIo, FaultPlan};
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path(), true, || SyncIo::new(true));
    let k1 = (0usize, 1u16, 0u8);
    run(&mut s, Op::Put(kr(&k1, 0), b"old")).unwrap();
    // Enough keys that the middle of the output's filter and index region
    // (where the flip lands) is covered by their checksum.
    for i in 0..20_000u32 {
        let key = KeyRef {
            key_group: (i % u32::from(KGS)) as u16,
            state: STATES[0][0],
            key: &i.to_be_bytes(),
            namespace: b"filler",
        };
        run(&mut s, Op::Put(key, &[7; 20])).unwrap();
    }
    let h1 = checkpoint(&mut s, whole(1)).unwrap();
    run(&mut s, Op::Put(kr(&k1, 0), b"new")).unwrap();
    s.restore(WHOLE, &[&h1]).unwrap();
    settle_fully(&mut s);
    // The list naming the restored layer, as a crash before its rewrite
    // leaves it.
    let named = std::fs::read(dir.path().join("LAYERS")).unwrap();
    s.flush();
    s.compact_all();
    settle_fully(&mut s);
    assert_eq!(s.stats().segments, 1);
    assert_eq!(s.release_checkpoints(OWNERS[0], &[&h1]).unwrap().count, 1);
    settle_fully(&mut s);
    drop(s);
    std::fs::write(dir.path().join("LAYERS"), &named).unwrap();
    let segments = || {
        std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with("seg-"))
            .collect::<Vec<_>>()
    };
    let before = segments();
    // The second read of the open (the compaction output's filter and
    // index) comes back with a flipped bit.
    let flip = FaultPlan {
        after: 1,
        fault: Fault::ReadBitFlip,
        sticky: false,
    };
    let mut cfg = StoreConfig::new(dir.path(), 2 << 30);
    cfg.memtable_bytes = Some(1 << 30);
    match Store::open(cfg.clone(), FaultIo::new(SyncIo::new(true), Some(flip))) {
        Err(StoreError::Restore(m)) => assert!(m.contains("cannot be opened"), "{m}"),
        Err(e) => panic!("another error: {e}"),
        Ok((_, rep)) => panic!("opened without a layer's file: {rep:?}"),
    }
    assert_eq!(segments(), before, "a failed open changed the files");
    let (mut s, rep) = Store::open(cfg, SyncIo::new(true)).unwrap();
    assert!(rep.torn.is_empty() && rep.segments == 1, "{rep:?}");
    assert_eq!(
        run(&mut s, Op::Get(kr(&k1, 0))).unwrap(),
        Owned::Value(Some(b"old".to_vec()))
    );
}
