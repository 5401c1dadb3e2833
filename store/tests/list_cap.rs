//! The list cap: an append that might take a list past
//! `StoreConfig::max_list_len` is refused with `TooLarge`, wherever the
//! list's layers are (active and frozen memtables, segments, after a
//! compaction and a restart), and nothing accepted is lost.

mod common;

use common::{Owned, run};

use stator_store::io::{SyncIo, UringIo};
use stator_store::{KeyRef, Op, Store, StoreConfig, StoreError};

const CAP: usize = 64 << 10;
const ELEMENT: usize = 1000;
/// Encoded, an element takes its `u32` length too.
const ENCODED: usize = 4 + ELEMENT;
/// Elements a list holds at the cap when the bound is exact.
const EXACT: usize = CAP / ENCODED;

fn list(key: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: 5,
        state: 2,
        key,
        namespace: b"ns",
    }
}

fn element(i: usize) -> Vec<u8> {
    vec![i as u8; ELEMENT]
}

/// Elements `range`, encoded as a list.
fn encoded(range: std::ops::Range<usize>) -> Vec<u8> {
    let mut out = Vec::new();
    for i in range {
        out.extend_from_slice(&(ELEMENT as u32).to_le_bytes());
        out.extend_from_slice(&element(i));
    }
    out
}

fn config(dir: &std::path::Path) -> StoreConfig {
    let mut cfg = StoreConfig::new(dir, 64 << 20);
    cfg.memtable_bytes = Some(4 << 20);
    cfg.max_list_len = CAP;
    cfg
}

/// Appends elements `from..` until one is refused; the refused one's
/// error must be `TooLarge`. Returns how many were accepted in all.
fn append_until_refused<I: stator_store::io::Io>(
    s: &mut Store<I>,
    key: &[u8],
    from: usize,
) -> usize {
    for i in from..10 * EXACT {
        match run(s, Op::ListAppend(list(key), &element(i))) {
            Ok(_) => {}
            Err(StoreError::TooLarge { what, max, .. }) => {
                assert!(what.starts_with("list"), "{what}");
                assert_eq!(max, CAP);
                return i;
            }
            Err(e) => panic!("append {i}: {e}"),
        }
    }
    panic!("no append was refused")
}

/// The list holds exactly elements `0..n`, in order.
fn assert_list<I: stator_store::io::Io>(s: &mut Store<I>, key: &[u8], n: usize) {
    let Owned::Value(Some(got)) = run(s, Op::ListGet(list(key))).unwrap() else {
        panic!("list {key:?} missing");
    };
    assert_eq!(got.len(), n * ENCODED, "list {key:?}");
    for (i, e) in got.chunks(ENCODED).enumerate() {
        assert_eq!(
            u32::from_le_bytes(e[..4].try_into().unwrap()) as usize,
            ELEMENT
        );
        assert_eq!(&e[4..], &element(i)[..], "element {i}");
    }
}

#[test]
fn an_append_past_the_cap_is_refused_in_memory() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = Store::open(config(d.path()), SyncIo::new(false)).unwrap();
    assert_eq!(append_until_refused(&mut s, b"a", 0), EXACT);
    assert_list(&mut s, b"a", EXACT);
    // Several elements at once are refused whole.
    let two = encoded(EXACT..EXACT + 2);
    assert!(matches!(
        run(&mut s, Op::ListAppendAll(list(b"a"), &two)),
        Err(StoreError::TooLarge { .. })
    ));
    assert_list(&mut s, b"a", EXACT);
    // Another list is not affected, and a frozen memtable counts exactly.
    assert!(run(&mut s, Op::ListAppend(list(b"b"), &element(0))).is_ok());
    s.flush();
    assert_eq!(append_until_refused(&mut s, b"b", 1), EXACT);
    assert_list(&mut s, b"b", EXACT);
    // A replaced list starts again from its new length.
    run(&mut s, Op::ListReplace(list(b"a"), &two)).unwrap();
    assert_eq!(append_until_refused(&mut s, b"a", 2), EXACT);
    s.settle();
    assert_list(&mut s, b"b", EXACT);
}

#[test]
fn the_cap_holds_across_segments_compaction_and_restart() {
    let d = tempfile::tempdir().unwrap();
    let cfg = config(d.path());
    let (mut s, _) = Store::open(cfg.clone(), UringIo::new(256, true).unwrap()).unwrap();
    // Three layers of the list: two segments and the active memtable.
    let mut n = 0;
    for upto in [EXACT / 3, 2 * EXACT / 3] {
        while n < upto {
            run(&mut s, Op::ListAppend(list(b"l"), &element(n))).unwrap();
            n += 1;
        }
        s.flush();
        s.settle();
    }
    assert!(s.stats().flushes >= 2);
    let accepted = append_until_refused(&mut s, b"l", n);
    // Each segment's bound may be early by up to a page and a header.
    let slack = 2 * (4096usize + 64).div_ceil(ENCODED);
    assert!(
        (EXACT - slack..=EXACT).contains(&accepted),
        "{accepted} accepted, {EXACT} fit"
    );
    assert_list(&mut s, b"l", accepted);
    // One segment: the bound is early by at most a page and a header.
    s.flush();
    s.compact_all();
    s.settle();
    let compacted = append_until_refused(&mut s, b"l", accepted);
    assert!(
        (EXACT - slack / 2..=EXACT).contains(&compacted) && compacted >= accepted,
        "{compacted} accepted after compaction, {accepted} before, {EXACT} fit"
    );
    assert_list(&mut s, b"l", compacted);
    // What a restart keeps: the segments (a memtable lives until a flush).
    s.flush();
    s.settle();
    drop(s);
    let (mut s, _) = Store::open(cfg, UringIo::new(256, true).unwrap()).unwrap();
    assert_eq!(append_until_refused(&mut s, b"l", compacted), compacted);
    assert_list(&mut s, b"l", compacted);
}

#[test]
fn a_batch_that_would_pass_the_cap_applies_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = Store::open(config(d.path()), SyncIo::new(false)).unwrap();
    let elements: Vec<Vec<u8>> = (0..=EXACT).map(element).collect();
    // Each append fits alone; together they pass the cap.
    let mut batch: Vec<Op<'_>> = elements
        .iter()
        .map(|e| Op::ListAppend(list(b"x"), e))
        .collect();
    batch.push(Op::ListAppend(list(b"y"), &elements[0]));
    assert!(matches!(
        s.write_batch(&batch),
        Err(StoreError::TooLarge { .. })
    ));
    for key in [&b"x"[..], b"y"] {
        assert_eq!(
            run(&mut s, Op::ListGet(list(key))).unwrap(),
            Owned::Value(None)
        );
    }
    batch.remove(0);
    s.write_batch(&batch).unwrap();
    let Owned::Value(Some(x)) = run(&mut s, Op::ListGet(list(b"x"))).unwrap() else {
        panic!("no list x");
    };
    assert_eq!(x.len(), EXACT * ENCODED);
    // A replace earlier in the batch decides what later appends add to:
    // one that would then pass the cap refuses the batch, replace and all.
    let big = encoded(0..EXACT);
    let small = encoded(0..1);
    s.write_batch(&[Op::ListReplace(list(b"z"), &small)])
        .unwrap();
    let past = [
        Op::ListReplace(list(b"z"), &big),
        Op::ListAppend(list(b"z"), &elements[EXACT]),
    ];
    assert!(matches!(
        s.write_batch(&past),
        Err(StoreError::TooLarge { .. })
    ));
    assert_list(&mut s, b"z", 1);
    // While a replace of the full list (already in the memtable) followed
    // by a delete leaves room for the append after it.
    s.write_batch(&[Op::ListReplace(list(b"x"), &big)]).unwrap();
    s.write_batch(&[
        Op::ListReplace(list(b"x"), &big),
        Op::Delete(list(b"x")),
        Op::ListAppend(list(b"x"), &elements[0]),
    ])
    .unwrap();
    assert_list(&mut s, b"x", 1);
}

#[test]
fn a_replacing_list_past_the_cap_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (mut s, _) = Store::open(config(d.path()), SyncIo::new(false)).unwrap();
    let mut big = encoded(0..EXACT + 1);
    assert!(matches!(
        run(&mut s, Op::ListReplace(list(b"r"), &big)),
        Err(StoreError::TooLarge { .. })
    ));
    assert!(matches!(
        s.write_batch(&[Op::ListReplace(list(b"r"), &big)]),
        Err(StoreError::TooLarge { .. })
    ));
    assert_eq!(
        run(&mut s, Op::ListGet(list(b"r"))).unwrap(),
        Owned::Value(None)
    );
    big.truncate(EXACT * ENCODED);
    run(&mut s, Op::ListReplace(list(b"r"), &big)).unwrap();
    assert_list(&mut s, b"r", EXACT);
}

#[test]
fn a_cap_above_the_ceiling_is_refused_at_open() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = config(d.path());
    cfg.max_list_len = stator_store::MAX_LIST_LEN + 1;
    assert!(matches!(
        Store::open(cfg, SyncIo::new(false)),
        Err(StoreError::Invalid(_))
    ));
}
