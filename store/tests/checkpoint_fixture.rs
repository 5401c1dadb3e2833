//! Checkpoint format fixture: a store directory with manifests (version 1),
//! a `LAYERS` file with a mask and restored layers, a completion marker,
//! and the handles the engine kept, checked in under
//! `tests/fixtures/checkpoint-v1/`. Every future version must keep
//! restoring those handles exactly. Regenerate (only when adding a new
//! version's fixture) with
//! `STATOR_WRITE_FIXTURES=1 cargo test -p stator-store --test checkpoint_fixture`.

mod common;

use std::path::{Path, PathBuf};

use common::{Owned, checkpoint, copy_dir, run, settle_fully};
use stator_store::io::SyncIo;
use stator_store::manifest::{Handle, Manifest};
use stator_store::{CheckpointSpec, KeyRef, Notify, Op, RestoreSpec, Store, StoreConfig};

const OWNER: &[u8] = b"job\0op";
const STATES: [u32; 1] = [7];

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-v1")
}

fn cfg(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir, 64 << 20);
    c.memtable_bytes = Some(16 << 20);
    c.compaction_trigger = 100;
    c.retained_checkpoints = 2;
    c
}

fn key(i: u32) -> [u8; 4] {
    i.to_be_bytes()
}

fn kr(k: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: (k[3] % 8) as u16,
        state: 7,
        key: k,
        namespace: b"",
    }
}

fn spec(id: u64) -> CheckpointSpec {
    CheckpointSpec {
        owner: OWNER.to_vec(),
        checkpoint_id: id,
        lo: 0,
        hi: 7,
        states: STATES.to_vec(),
        meta: format!("meta-{id}").into_bytes(),
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

/// Checkpoint 1 of 100 values; then overwrites; a restore of key groups
/// 0..=3 from it (a mask and imports); checkpoint 2 over the mixture.
fn write(dir: &Path) {
    let (mut s, _) = Store::open(cfg(dir), SyncIo::new(true)).unwrap();
    for i in 0..100u32 {
        run(&mut s, Op::Put(kr(&key(i)), format!("one-{i}").as_bytes())).unwrap();
    }
    let h1 = checkpoint(&mut s, spec(1)).unwrap();
    s.checkpoint_notify(OWNER, 1, Notify::Complete);
    for i in 0..100u32 {
        run(&mut s, Op::Put(kr(&key(i)), format!("two-{i}").as_bytes())).unwrap();
    }
    s.restore(restore_spec(0, 3), &[&h1]).unwrap();
    let h2 = checkpoint(&mut s, spec(2)).unwrap();
    s.flush();
    settle_fully(&mut s);
    std::fs::write(dir.join("handle-1"), &h1).unwrap();
    std::fs::write(dir.join("handle-2"), &h2).unwrap();
}

/// Key `i` as checkpoint 2 holds it: groups 0..=3 came back from
/// checkpoint 1.
fn in_two(i: u32) -> String {
    if (i % 8) < 4 {
        format!("one-{i}")
    } else {
        format!("two-{i}")
    }
}

fn check(dir: &Path) {
    let h1 = std::fs::read(dir.join("handle-1")).unwrap();
    let h2 = std::fs::read(dir.join("handle-2")).unwrap();
    // The bytes themselves decode.
    let m2 = Handle::decode(&h2).unwrap();
    let bytes = std::fs::read(dir.join(stator_store::manifest::file_name(m2.seq))).unwrap();
    let (m, crc) = Manifest::decode(&bytes).unwrap();
    assert_eq!(
        (m.checkpoint_id, m.lo, m.hi, crc),
        (2, 0, 7, m2.manifest_crc)
    );
    assert_eq!(m.meta, b"meta-2");
    assert!(
        m.layers.iter().any(|l| l.clip.keep.hi == 3),
        "a clipped import"
    );
    let (mut s, rep) = Store::open(cfg(dir), SyncIo::new(true)).unwrap();
    assert!(rep.torn.is_empty(), "{rep:?}");
    assert_eq!(rep.manifests, 2);
    // The live state after the restore (LAYERS: mask and imports).
    for i in 0..100u32 {
        let want = Owned::Value(Some(in_two(i).into_bytes()));
        assert_eq!(run(&mut s, Op::Get(kr(&key(i)))).unwrap(), want, "live {i}");
    }
    // Each handle restores exactly its checkpoint.
    s.restore(restore_spec(0, 7), &[&h1]).unwrap();
    for i in 0..100u32 {
        let want = Owned::Value(Some(format!("one-{i}").into_bytes()));
        assert_eq!(run(&mut s, Op::Get(kr(&key(i)))).unwrap(), want, "h1 {i}");
    }
    s.restore(restore_spec(0, 7), &[&h2]).unwrap();
    for i in 0..100u32 {
        let want = Owned::Value(Some(in_two(i).into_bytes()));
        assert_eq!(run(&mut s, Op::Get(kr(&key(i)))).unwrap(), want, "h2 {i}");
    }
}

#[test]
fn checkpoint_version_1_fixture_restores_exactly() {
    let fixture = fixture_dir();
    if std::env::var_os("STATOR_WRITE_FIXTURES").is_some() {
        let _ = std::fs::remove_dir_all(&fixture);
        std::fs::create_dir_all(&fixture).unwrap();
        write(&fixture);
    }
    assert!(
        fixture.join("handle-2").exists() && fixture.join("LAYERS").exists(),
        "fixture missing: {}",
        fixture.display()
    );
    let d = tempfile::tempdir().unwrap();
    copy_dir(&fixture, d.path());
    check(d.path());
}

/// The records of the snapshot fixture: three key groups, one larger than
/// its chunks.
fn snapshot_records() -> Vec<(u16, Vec<u8>, Vec<u8>)> {
    let mut r = Vec::new();
    for kg in [1u16, 5, 6] {
        let n = if kg == 5 { 40 } else { 3 };
        for i in 0..n {
            let mut k = Vec::new();
            stator_store::keys::encode_base(&mut k, kg, 7, &(i as u32).to_be_bytes(), b"ns");
            r.push((kg, k, vec![kg as u8 ^ i as u8; 100 + i]));
        }
    }
    r
}

#[test]
fn snapshot_chunk_version_2_fixture_decodes_exactly() {
    use stator_store::StateKind;
    use stator_store::format::Kind;
    use stator_store::snapshot::{ChunkDecoder, ChunkEncoder, Item, StateDesc, encode_states};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/snapshot-v2");
    let recs = snapshot_records();
    if std::env::var_os("STATOR_WRITE_FIXTURES").is_some() {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut e = ChunkEncoder::new(0x5eed);
        let mut slot = vec![0u8; 1024];
        let mut n = 0;
        let mut emit = |e: &mut ChunkEncoder, slot: &mut Vec<u8>, mut b: &[u8], last: bool| {
            loop {
                let w = e.put(&mut slot[..], b);
                b = &b[w..];
                if b.is_empty() && !last {
                    return;
                }
                let len = e.end(&mut slot[..], b.is_empty() && last);
                std::fs::write(dir.join(format!("chunk-{n:03}")), &slot[..len]).unwrap();
                n += 1;
                if b.is_empty() {
                    return;
                }
            }
        };
        e.begin();
        let table = encode_states(&[StateDesc {
            id: 7,
            kind: StateKind::Map,
            name: b"fixture-state".to_vec(),
        }]);
        emit(&mut e, &mut slot, &table, false);
        for (kg, k, v) in &recs {
            if let Some(h) = e.group_header(*kg) {
                emit(&mut e, &mut slot, &h, false);
            }
            let mut r = vec![Kind::Put as u8, 0];
            r.extend_from_slice(&(k.len() as u16).to_le_bytes());
            r.extend_from_slice(&(v.len() as u32).to_le_bytes());
            r.extend_from_slice(k);
            r.extend_from_slice(v);
            emit(&mut e, &mut slot, &r, false);
        }
        emit(&mut e, &mut slot, &[], true);
    }
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .expect("snapshot fixture")
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    assert!(names.len() > 3, "fixture missing or too small");
    let mut d = ChunkDecoder::new(0, 5);
    let mut got = Vec::new();
    for p in &names {
        d.feed(&std::fs::read(p).unwrap(), |item| {
            match item {
                Item::States(s) => {
                    assert_eq!(s.len(), 1);
                    assert_eq!((s[0].id, s[0].kind), (7, StateKind::Map));
                    assert_eq!(s[0].name, b"fixture-state");
                }
                Item::Record(kind, k, v) => {
                    assert_eq!(kind, Kind::Put);
                    got.push((k.to_vec(), v.to_vec()));
                }
            }
            Ok(())
        })
        .unwrap();
    }
    let stats = d.finish().unwrap();
    let want: Vec<_> = recs
        .iter()
        .filter(|(kg, _, _)| *kg <= 5)
        .map(|(_, k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(got, want);
    assert_eq!(
        (stats.groups, stats.skipped_groups, stats.skipped_records),
        (3, 1, 3)
    );
}
