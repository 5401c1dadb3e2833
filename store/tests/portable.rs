//! Portable snapshots at the edges: exact 4 MiB chunk boundaries, a key
//! group larger than a chunk, empty states, states that resolve to other
//! ids in another order, chunks of another snapshot, and a crash in the
//! middle of an import.

mod common;

use common::{Owned, checkpoint, export_chunks, fill_chunks, import_chunks, run, settle_fully};
use stator_store::io::SyncIo;
use stator_store::snapshot::{CHUNK_LEN, ChunkDecoder, HEADER_LEN, StateDesc, encode_states};
use stator_store::{
    CheckpointSpec, ExportSpec, Fill, ImportSpec, ImportStep, KeyRef, Op, StateKind, Store,
    StoreConfig, StoreError,
};

const OWNER: &[u8] = b"job\0op";

fn open(dir: &std::path::Path) -> Store<SyncIo> {
    let mut cfg = StoreConfig::new(dir, 1 << 30);
    cfg.memtable_bytes = Some(64 << 20);
    Store::open(cfg, SyncIo::new(true)).expect("open").0
}

fn kr(kg: u16, state: u32, key: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: kg,
        state,
        key,
        namespace: b"",
    }
}

fn value(s: &mut Store<SyncIo>, kg: u16, state: u32, key: &[u8]) -> Option<Vec<u8>> {
    match run(s, Op::Get(kr(kg, state, key))).unwrap() {
        Owned::Value(v) => v,
        o => panic!("{o:?}"),
    }
}

fn desc(id: u32, name: &str) -> StateDesc {
    StateDesc {
        id,
        kind: StateKind::Value,
        name: name.as_bytes().to_vec(),
    }
}

fn export_spec(lo: u16, hi: u16, states: Vec<StateDesc>) -> ExportSpec {
    ExportSpec {
        owner: OWNER.to_vec(),
        snapshot_id: 77,
        lo,
        hi,
        states,
    }
}

fn import_spec(lo: u16, hi: u16, states: Vec<u32>) -> ImportSpec {
    ImportSpec {
        owner: OWNER.to_vec(),
        lo,
        hi,
        states,
    }
}

/// Records fill chunk 0 to exactly 4 MiB; key group 3 alone spans several
/// chunks; key groups without records do not appear; the states come back
/// under other ids in the reverse order (two files keep keys sorted).
#[test]
fn exact_boundaries_large_groups_and_reordered_states_round_trip() {
    let d1 = tempfile::tempdir().unwrap();
    let mut s = open(d1.path());
    let states = vec![desc(1, "a"), desc(2, "b")];
    let table = encode_states(&states).len();
    // One record: header 8 + key (kg 2, state 4, len 4, key 4, ns len 4)
    // + value. Key group 1 holds n records of state 1 sized so that the
    // table, its group header and them fill the payload exactly.
    let key_len = 2 + 4 + 4 + 4 + 4;
    let payload = CHUNK_LEN - HEADER_LEN - table - 8;
    let n = 64usize;
    let rec = payload / n;
    let extra = payload - rec * n;
    let mut want = Vec::new();
    for i in 0..n as u32 {
        let vlen = rec - 8 - key_len + if i == n as u32 - 1 { extra } else { 0 };
        let v = vec![i as u8; vlen];
        run(&mut s, Op::Put(kr(1, 1, &i.to_be_bytes()), &v)).unwrap();
        want.push((1u16, 1u32, i, v));
    }
    // Key group 3: about 10 MiB over both states.
    for i in 0..2500u32 {
        let st = 1 + i % 2;
        let v = vec![(i % 251) as u8; 4000];
        run(&mut s, Op::Put(kr(3, st, &i.to_be_bytes()), &v)).unwrap();
        want.push((3, st, i, v));
    }
    // Another owner's state in the range is not exported.
    run(&mut s, Op::Put(kr(3, 9, b"other"), b"x")).unwrap();
    s.flush();
    settle_fully(&mut s);
    let chunks = export_chunks(&mut s, export_spec(0, 9, states.clone()), CHUNK_LEN).unwrap();
    assert_eq!(chunks[0].len(), CHUNK_LEN, "chunk 0 is exactly full");
    assert!(chunks.len() >= 4, "key group 3 spans chunks");
    assert!(chunks.iter().all(|c| c.len() <= CHUNK_LEN));
    let mut dec = ChunkDecoder::new(0, u16::MAX);
    for c in &chunks {
        dec.feed(c, |_| Ok(())).unwrap();
    }
    let stats = dec.finish().unwrap();
    assert_eq!(stats.groups, 2, "empty key groups cost nothing");
    assert_eq!(stats.records, want.len() as u64);

    // Into another store where "a" is 20 and "b" is 10.
    let d2 = tempfile::tempdir().unwrap();
    let mut t = open(d2.path());
    run(&mut t, Op::Put(kr(1, 20, b"old"), b"gone after the import")).unwrap();
    run(&mut t, Op::Put(kr(5, 30, b"kept"), b"another state")).unwrap();
    let names: [(&[u8], u32); 2] = [(b"a", 20), (b"b", 10)];
    let r = import_chunks(&mut t, import_spec(0, 9, vec![10, 20]), &chunks, &names).unwrap();
    assert_eq!(r.records, want.len() as u64);
    assert_eq!(r.layers, 2, "reversed ids need two files");
    for (kg, st, i, v) in &want {
        let local = if *st == 1 { 20 } else { 10 };
        assert_eq!(
            value(&mut t, *kg, local, &i.to_be_bytes()).as_ref(),
            Some(v)
        );
    }
    assert_eq!(value(&mut t, 1, 20, b"old"), None);
    assert_eq!(
        value(&mut t, 5, 30, b"kept"),
        Some(b"another state".to_vec())
    );
    assert_eq!(value(&mut t, 3, 9, b"other"), None);
    // It survives a reopen, and a compaction.
    drop(t);
    let mut t = open(d2.path());
    t.compact_all();
    settle_fully(&mut t);
    for (kg, st, i, v) in want.iter().step_by(97) {
        let local = if *st == 1 { 20 } else { 10 };
        assert_eq!(
            value(&mut t, *kg, local, &i.to_be_bytes()).as_ref(),
            Some(v)
        );
    }

    // A narrower range skips (and counts) the other key groups.
    let d3 = tempfile::tempdir().unwrap();
    let mut u = open(d3.path());
    let r = import_chunks(&mut u, import_spec(2, 5, vec![10, 20]), &chunks, &names).unwrap();
    assert_eq!((r.skipped_groups, r.skipped_records), (1, n as u64));
    assert_eq!(r.records, 2500);
    assert_eq!(value(&mut u, 1, 20, &0u32.to_be_bytes()), None);
}

/// An export of nothing is one chunk holding the state table; importing
/// it empties the range.
#[test]
fn an_empty_state_exports_one_chunk_and_imports_as_empty() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let chunks = export_chunks(&mut s, export_spec(0, 3, vec![desc(1, "a")]), CHUNK_LEN).unwrap();
    assert_eq!(chunks.len(), 1);
    run(&mut s, Op::Put(kr(2, 1, b"k"), b"v")).unwrap();
    let r = import_chunks(&mut s, import_spec(0, 3, vec![1]), &chunks, &[(b"a", 1)]).unwrap();
    assert_eq!((r.records, r.layers), (0, 0));
    assert_eq!(value(&mut s, 2, 1, b"k"), None);
}

/// Corrupt, foreign and unresolvable snapshots are refused and change
/// nothing; an import cut by a crash leaves no file and no state.
#[test]
fn bad_snapshots_and_a_crash_mid_import_change_nothing() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    for i in 0..3000u32 {
        run(&mut s, Op::Put(kr(1, 1, &i.to_be_bytes()), &[7u8; 3000])).unwrap();
    }
    let a = export_chunks(&mut s, export_spec(0, 3, vec![desc(1, "a")]), CHUNK_LEN).unwrap();
    let mut spec = export_spec(0, 3, vec![desc(1, "a")]);
    spec.snapshot_id = 78;
    let b = export_chunks(&mut s, spec, CHUNK_LEN).unwrap();
    assert!(a.len() >= 3);
    // The live state differs from the snapshot.
    run(&mut s, Op::Put(kr(1, 1, b"live"), b"kept")).unwrap();
    let names: [(&[u8], u32); 1] = [(b"a", 1)];
    let check = |s: &mut Store<SyncIo>| {
        assert_eq!(value(s, 1, 1, b"live"), Some(b"kept".to_vec()));
        let files: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("imp-"))
            .collect();
        assert!(files.is_empty(), "import files left: {files:?}");
    };
    let spec = import_spec(0, 3, vec![1]);
    let mut bad = a.clone();
    bad[1][HEADER_LEN + 100] ^= 1;
    let r = import_chunks(&mut s, spec.clone(), &bad, &names);
    assert!(
        matches!(&r, Err(StoreError::Snapshot(m)) if m.contains("checksum")),
        "{r:?}"
    );
    check(&mut s);
    let mut mixed = a.clone();
    mixed[1] = b[1].clone();
    let r = import_chunks(&mut s, spec.clone(), &mixed, &names);
    assert!(
        matches!(&r, Err(StoreError::Snapshot(m)) if m.contains("snapshot")),
        "{r:?}"
    );
    check(&mut s);
    let r = import_chunks(&mut s, spec.clone(), &a[..a.len() - 1], &names);
    assert!(r.is_err());
    check(&mut s);
    let r = import_chunks(&mut s, spec.clone(), &a, &[(b"z", 1)]);
    assert!(
        matches!(&r, Err(StoreError::Snapshot(m)) if m.contains("no state a")),
        "{r:?}"
    );
    check(&mut s);
    // Two chunks in, then the process dies.
    let id = s.import_begin(spec.clone()).unwrap();
    let mut resolve = |t: &[StateDesc]| Ok(vec![1; t.len()]);
    for c in &a[..2] {
        assert_eq!(
            s.import_chunk(id, c, 1, &mut resolve).unwrap(),
            ImportStep::Consumed
        );
    }
    s.flush();
    settle_fully(&mut s);
    drop(s);
    let mut s = open(d.path());
    check(&mut s);
    assert_eq!(
        value(&mut s, 1, 1, &5u32.to_be_bytes()),
        Some(vec![7u8; 3000])
    );
    // And the good snapshot still imports.
    import_chunks(&mut s, spec, &a, &names).unwrap();
    assert_eq!(value(&mut s, 1, 1, b"live"), None);
    assert_eq!(
        value(&mut s, 1, 1, &5u32.to_be_bytes()),
        Some(vec![7u8; 3000])
    );
}

/// A checkpoint exports as it was taken, whatever was written since, and
/// the live state is left alone; a handle of another owner, or a key group
/// held by two handles, starts nothing.
#[test]
fn a_checkpoint_exports_as_taken_and_leaves_the_live_state_alone() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let key = |k: u32| k.to_be_bytes();
    for k in 0..200u32 {
        run(
            &mut s,
            Op::Put(kr((k % 4) as u16, 1, &key(k)), format!("old{k}").as_bytes()),
        )
        .unwrap();
    }
    let spec = |id| CheckpointSpec {
        owner: OWNER.to_vec(),
        checkpoint_id: id,
        lo: 0,
        hi: 3,
        states: vec![1],
        meta: Vec::new(),
    };
    let h = checkpoint(&mut s, spec(1)).unwrap();
    // Half of it overwritten and flushed, a quarter deleted after it.
    for k in 0..100u32 {
        run(
            &mut s,
            Op::Put(kr((k % 4) as u16, 1, &key(k)), format!("new{k}").as_bytes()),
        )
        .unwrap();
    }
    s.flush();
    settle_fully(&mut s);
    for k in 100..150u32 {
        run(&mut s, Op::Delete(kr((k % 4) as u16, 1, &key(k)))).unwrap();
    }
    let id = s
        .export_checkpoints(export_spec(0, 3, vec![desc(1, "a")]), &[&h])
        .unwrap();
    let chunks = fill_chunks(&mut s, id, CHUNK_LEN).unwrap();
    // The live state is as written after the checkpoint.
    for k in [0u32, 99, 120, 199] {
        let want = match k {
            0..100 => Some(format!("new{k}")),
            100..150 => None,
            _ => Some(format!("old{k}")),
        };
        assert_eq!(
            value(&mut s, (k % 4) as u16, 1, &key(k)),
            want.map(String::into_bytes)
        );
    }
    // Importing the export brings back the checkpoint exactly.
    let r = import_chunks(&mut s, import_spec(0, 3, vec![1]), &chunks, &[(b"a", 1)]).unwrap();
    assert_eq!(r.records, 200);
    for k in 0..200u32 {
        assert_eq!(
            value(&mut s, (k % 4) as u16, 1, &key(k)),
            Some(format!("old{k}").into_bytes()),
            "key {k}"
        );
    }
    let mut foreign = export_spec(0, 3, vec![desc(1, "a")]);
    foreign.owner = b"other\0op".to_vec();
    assert!(s.export_checkpoints(foreign, &[&h]).is_err());
    let h2 = checkpoint(&mut s, spec(2)).unwrap();
    assert!(
        s.export_checkpoints(export_spec(0, 3, vec![desc(1, "a")]), &[&h, &h2])
            .is_err(),
        "two handles holding the same key groups"
    );
}

/// Issue 25: exports' read-ahead (up to 64 MiB each) and imports' write
/// buffers were held outside the memory budget, 64 of each per store. Now
/// they count in it (the block cache gives way), and past the budget a
/// second one waits (`export_should_wait`, `Limit` if started anyway)
/// until another ends; one alone always runs.
#[test]
fn exports_and_imports_count_in_the_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
    cfg.memtable_bytes = Some(8 << 20);
    let (mut s, _) = Store::open(cfg, SyncIo::new(true)).unwrap();
    run(&mut s, Op::Put(kr(1, 1, b"k"), b"v")).unwrap();
    let before = s.memory().background;
    let mut ids = Vec::new();
    let refusal = loop {
        let waits = s.export_should_wait();
        match s.export(export_spec(0, 9, vec![desc(1, "v")])) {
            Ok(id) => {
                assert!(!waits, "admitted after saying it would wait");
                ids.push(id);
            }
            Err(e) => {
                assert!(waits, "refused without saying it would wait");
                break e;
            }
        }
        assert!(
            ids.len() < 64,
            "never refused: exports are outside the budget"
        );
    };
    assert!(!ids.is_empty());
    assert!(
        matches!(&refusal, StoreError::Limit(m) if m.contains("memory budget")),
        "{refusal}"
    );
    let m = s.memory();
    // Each export counts a window of an eighth of the budget, 8 MiB here.
    assert!(
        m.background >= before + ids.len() * (8 << 20),
        "{m:?} with {} exports",
        ids.len()
    );
    assert!(m.total() <= m.budget + (8 << 20), "{m:?}");
    // An import waits the same way; once exports end there is room (an
    // import's writer holds about 10 MiB).
    assert!(s.import_should_wait());
    assert!(s.import_begin(import_spec(0, 9, vec![1])).is_err());
    for id in ids.drain(1..) {
        s.export_cancel(id);
    }
    assert!(!s.import_should_wait());
    let imp = s.import_begin(import_spec(0, 9, vec![1])).unwrap();
    assert!(s.memory().background > before);
    s.import_cancel(imp);
    for id in ids {
        s.export_cancel(id);
    }
    assert_eq!(s.memory().background, before);
    // One alone always runs, whatever the budget says.
    assert!(!s.export_should_wait());
}

fn kind_desc(id: u32, name: &str, kind: StateKind) -> StateDesc {
    StateDesc {
        id,
        kind,
        name: name.as_bytes().to_vec(),
    }
}

/// Asserts two exports are the same bytes (saying where they part, not
/// printing megabytes).
fn assert_same_chunks(a: &[Vec<u8>], b: &[Vec<u8>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: chunk counts");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if let Some(at) = (0..x.len().min(y.len())).find(|&j| x[j] != y[j]) {
            let near = |c: &[u8]| c[at.saturating_sub(16)..(at + 16).min(c.len())].to_vec();
            panic!(
                "{what}: chunk {i} differs at byte {at}: {:?} vs {:?}",
                near(x),
                near(y)
            );
        }
        assert_eq!(x.len(), y.len(), "{what}: chunk {i} lengths");
    }
}

/// Fills export `id` without ever polling the store: no flush, read or
/// other background work can run meanwhile. `None` if it had to wait.
fn fill_unpolled(s: &mut Store<SyncIo>, id: usize) -> Option<Vec<Vec<u8>>> {
    let mut slot = vec![0u8; CHUNK_LEN];
    let mut out = Vec::new();
    loop {
        match s.export_fill(id, &mut slot[..]).unwrap() {
            Fill::Chunk { len, last } => {
                out.push(slot[..len].to_vec());
                if last {
                    return Some(out);
                }
            }
            Fill::Again => {}
            Fill::Wait => return None,
        }
    }
}

/// Issue 25: an export waited for the flush of every memtable it froze
/// (`Fill::Wait` until the segment was installed). Now it reads a frozen
/// memtable where it is: with nothing polled, so that no flush can run, it
/// completes, and its chunks are the very bytes the same export makes once
/// the memtable is a segment. Above an older segment, overwrites, deletes,
/// list appends and map clears in the memtable merge with it exactly as a
/// compaction merges them.
#[test]
fn an_export_reads_frozen_memtables_without_waiting_for_their_flush() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let states = vec![
        kind_desc(1, "v", StateKind::Value),
        kind_desc(2, "l", StateKind::List),
        kind_desc(3, "m", StateKind::Map),
    ];
    let spec = || export_spec(0, 7, states.clone());
    for kg in 0..8u16 {
        for i in 0..300u32 {
            let k = i.to_be_bytes();
            run(&mut s, Op::Put(kr(kg, 1, &k), &[kg as u8; 40])).unwrap();
            run(&mut s, Op::ListAppend(kr(kg, 2, &k), b"old")).unwrap();
            run(&mut s, Op::MapPut(kr(kg, 3, &k), b"mk", b"old")).unwrap();
        }
    }
    // Another owner's key group 8 is out of the range.
    run(&mut s, Op::Put(kr(8, 1, b"out"), b"x")).unwrap();
    let id = s.export(spec()).unwrap();
    let from_memtable = fill_unpolled(&mut s, id).expect("waited for the memtable's flush");
    s.flush();
    settle_fully(&mut s);
    let from_segment = export_chunks(&mut s, spec(), CHUNK_LEN).unwrap();
    assert_same_chunks(
        &from_memtable,
        &from_segment,
        "memtable against its segment",
    );

    // Newer records above that segment, in the memtable.
    for kg in 0..8u16 {
        for i in (0..300u32).step_by(3) {
            let k = i.to_be_bytes();
            match i % 4 {
                0 => run(&mut s, Op::Put(kr(kg, 1, &k), b"new")).unwrap(),
                1 => run(&mut s, Op::Delete(kr(kg, 1, &k))).unwrap(),
                2 => run(&mut s, Op::Clear(kr(kg, 3, &k), StateKind::Map)).unwrap(),
                _ => run(&mut s, Op::MapPut(kr(kg, 3, &k), b"nk", b"new")).unwrap(),
            };
            run(&mut s, Op::ListAppend(kr(kg, 2, &k), b"new")).unwrap();
        }
        run(&mut s, Op::Put(kr(kg, 1, b"fresh"), b"new")).unwrap();
    }
    let id = s.export(spec()).unwrap();
    let merged = fill_chunks(&mut s, id, CHUNK_LEN).unwrap();
    s.compact_all();
    settle_fully(&mut s);
    let compacted = export_chunks(&mut s, spec(), CHUNK_LEN).unwrap();
    assert_same_chunks(&merged, &compacted, "merged against compacted");

    // And it imports as the state it was.
    let d2 = tempfile::tempdir().unwrap();
    let mut t = open(d2.path());
    let names: [(&[u8], u32); 3] = [(b"v", 1), (b"l", 2), (b"m", 3)];
    import_chunks(&mut t, import_spec(0, 7, vec![1, 2, 3]), &merged, &names).unwrap();
    for kg in 0..8u16 {
        for i in 0..300u32 {
            let k = i.to_be_bytes();
            let want: Option<&[u8]> = match (i % 3, i % 4) {
                (0, 0) => Some(b"new"),
                (0, 1) => None,
                _ => Some(&[kg as u8; 40]),
            };
            assert_eq!(value(&mut t, kg, 1, &k).as_deref(), want, "kg {kg} key {i}");
            let entry = match run(&mut t, Op::MapGet(kr(kg, 3, &k), b"mk")).unwrap() {
                Owned::Value(v) => v,
                o => panic!("{o:?}"),
            };
            let cleared = i % 3 == 0 && i % 4 == 2;
            assert_eq!(entry.is_none(), cleared, "kg {kg} map {i}");
        }
        assert_eq!(value(&mut t, kg, 1, b"fresh").as_deref(), Some(&b"new"[..]));
    }
    assert_eq!(value(&mut t, 8, 1, b"out"), None);
}

/// Issue 25 (review of c48d6fa): an import held back from its install
/// (the daemon holds one until its state names are durable) is installed
/// only once released; while held it does not count as pending, so a
/// drain or a stop does not wait for it forever; and a hold that outlived
/// its import does not release the next one in its slot.
#[test]
fn a_held_import_is_installed_only_once_released() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    run(&mut s, Op::Put(kr(2, 1, b"k"), b"v")).unwrap();
    let chunks = export_chunks(&mut s, export_spec(0, 3, vec![desc(1, "a")]), CHUNK_LEN).unwrap();
    run(&mut s, Op::Put(kr(2, 1, b"k"), b"later")).unwrap();
    let mut resolve = |_: &[StateDesc]| Ok(vec![1]);
    // A hold whose import was cancelled finds nothing.
    let gone = s.import_begin(import_spec(0, 3, vec![1])).unwrap();
    let stale = s.import_hold(gone).unwrap();
    s.import_cancel(gone);
    settle_fully(&mut s);
    let id = s.import_begin(import_spec(0, 3, vec![1])).unwrap();
    let hold = s.import_hold(id).unwrap();
    let mut last = ImportStep::Consumed;
    for c in &chunks {
        last = s.import_chunk(id, c, 9, &mut resolve).unwrap();
    }
    assert_eq!(last, ImportStep::Finishing);
    s.import_release(stale);
    settle_fully(&mut s);
    assert_eq!(s.pending(), 0, "a held import is not pending");
    let mut got = Vec::new();
    s.poll(|t, r| got.push((t, r.is_ok())));
    assert!(got.is_empty(), "installed while held: {got:?}");
    assert_eq!(value(&mut s, 2, 1, b"k"), Some(b"later".to_vec()));
    s.import_release(hold);
    let r = common::wait_token(&mut s, 9).unwrap();
    assert!(matches!(r, Owned::Imported(_)), "{r:?}");
    assert_eq!(value(&mut s, 2, 1, b"k"), Some(b"v".to_vec()));
}
