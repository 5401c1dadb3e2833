//! Format fixtures: a store directory written by format version 1 is
//! checked in under `tests/fixtures/v1/`, and every future version must keep
//! reading it exactly. Regenerate (only when adding a new version's
//! fixture, never to paper over a change) with
//! `STATOR_WRITE_FIXTURES=1 cargo test -p stator-store --test fixtures`.

mod common;

use std::path::{Path, PathBuf};

use common::{Owned, copy_dir, run, settle_fully};
use stator_store::io::SyncIo;
use stator_store::ops::encode_element;
use stator_store::{IterMode, KeyRef, Op, StateKind, Store, StoreConfig};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1")
}

fn cfg(dir: &Path) -> StoreConfig {
    let mut c = StoreConfig::new(dir, 64 << 20);
    c.memtable_bytes = Some(16 << 20);
    // Two segments must stay two: no compaction.
    c.compaction_trigger = 100;
    c
}

fn vk(i: u32) -> [u8; 4] {
    i.to_be_bytes()
}

fn value_key(k: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: (k[3] % 4) as u16,
        state: 1,
        key: k,
        namespace: b"ns",
    }
}

const LIST: KeyRef<'static> = KeyRef {
    key_group: 2,
    state: 2,
    key: b"list",
    namespace: b"",
};
const MAP: KeyRef<'static> = KeyRef {
    key_group: 3,
    state: 3,
    key: b"map",
    namespace: b"w1",
};
const CLEARED: KeyRef<'static> = KeyRef {
    key_group: 3,
    state: 3,
    key: b"gone",
    namespace: b"",
};

fn write(dir: &Path) {
    let (mut s, _) = Store::open(cfg(dir), SyncIo::new(true)).unwrap();
    for i in 0..200u32 {
        run(
            &mut s,
            Op::Put(value_key(&vk(i)), format!("value-{i}").as_bytes()),
        )
        .unwrap();
    }
    run(&mut s, Op::ListAppend(LIST, b"first")).unwrap();
    for u in 0..20u8 {
        run(&mut s, Op::MapPut(MAP, &[u], &[u; 5])).unwrap();
        run(&mut s, Op::MapPut(CLEARED, &[u], &[u; 5])).unwrap();
    }
    s.flush();
    settle_fully(&mut s);
    // Second segment: tombstones, merges, a clear marker, overwrites.
    for i in (0..200u32).step_by(10) {
        run(&mut s, Op::Delete(value_key(&vk(i)))).unwrap();
    }
    run(&mut s, Op::Put(value_key(&vk(1)), b"overwritten")).unwrap();
    run(&mut s, Op::ListAppend(LIST, b"second")).unwrap();
    run(&mut s, Op::MapRemove(MAP, &[3])).unwrap();
    run(&mut s, Op::Clear(CLEARED, StateKind::Map)).unwrap();
    run(&mut s, Op::MapPut(CLEARED, &[7], b"after-clear")).unwrap();
    s.flush();
    settle_fully(&mut s);
    // A key-group delete of group 1 (KGDELETES).
    run(&mut s, Op::DeleteKeyGroups { lo: 1, hi: 1 }).unwrap();
}

fn check(dir: &Path) {
    let (mut s, rep) = Store::open(cfg(dir), SyncIo::new(true)).unwrap();
    assert_eq!(rep.segments, 2, "{rep:?}");
    assert!(rep.torn.is_empty(), "{rep:?}");
    for i in 0..200u32 {
        let k = vk(i);
        // Key group 1 was deleted; every tenth key has a tombstone.
        let want = if i % 4 == 1 || i % 10 == 0 {
            None
        } else {
            Some(format!("value-{i}").into_bytes())
        };
        assert_eq!(
            run(&mut s, Op::Get(value_key(&k))).unwrap(),
            Owned::Value(want),
            "key {i}"
        );
    }
    let mut list = Vec::new();
    encode_element(&mut list, b"first");
    encode_element(&mut list, b"second");
    assert_eq!(
        run(&mut s, Op::ListGet(LIST)).unwrap(),
        Owned::Value(Some(list))
    );
    assert_eq!(
        run(&mut s, Op::MapGet(MAP, &[3])).unwrap(),
        Owned::Value(None)
    );
    assert_eq!(
        run(&mut s, Op::MapGet(MAP, &[4])).unwrap(),
        Owned::Value(Some(vec![4; 5]))
    );
    match run(
        &mut s,
        Op::MapIter {
            map: MAP,
            mode: IterMode::Keys,
            after: None,
            max_bytes: 1 << 20,
        },
    )
    .unwrap()
    {
        Owned::Page(_, n, last, more) => {
            assert_eq!((n, last, more), (19, vec![19], false));
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(
        run(&mut s, Op::MapGet(CLEARED, &[2])).unwrap(),
        Owned::Value(None)
    );
    assert_eq!(
        run(&mut s, Op::MapGet(CLEARED, &[7])).unwrap(),
        Owned::Value(Some(b"after-clear".to_vec()))
    );
}

#[test]
fn version_1_fixture_reads_back_exactly() {
    let fixture = fixture_dir();
    if std::env::var_os("STATOR_WRITE_FIXTURES").is_some() {
        let _ = std::fs::remove_dir_all(&fixture);
        std::fs::create_dir_all(&fixture).unwrap();
        write(&fixture);
    }
    assert!(
        fixture.join("KGDELETES").exists(),
        "fixture missing: {}",
        fixture.display()
    );
    // Work on a copy: opening may rewrite files (e.g. prune KGDELETES).
    let d = tempfile::tempdir().unwrap();
    copy_dir(&fixture, d.path());
    check(d.path());
    // After an open, `LAYERS` has replaced `KGDELETES`, and the state
    // reads the same from it.
    let (mut s, _) = Store::open(cfg(d.path()), SyncIo::new(true)).unwrap();
    settle_fully(&mut s);
    drop(s);
    assert!(d.path().join("LAYERS").exists());
    assert!(!d.path().join("KGDELETES").exists());
    check(d.path());
}
