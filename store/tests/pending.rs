//! 10,000 gets pending at once over io_uring, completing out of order,
//! interleaved with writes to the same keys: each get sees exactly the
//! state at its submission (per-key order).

mod common;

use std::collections::HashMap;

use stator_store::io::UringIo;
use stator_store::{KeyRef, Op, Output, Store, StoreConfig, Submitted};

fn kr(key: &[u8]) -> KeyRef<'_> {
    KeyRef {
        key_group: key[7] as u16 % 64,
        state: 1,
        key,
        namespace: b"",
    }
}

#[test]
fn ten_thousand_pending_gets_keep_per_key_order() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(d.path(), 2 << 30);
    cfg.block_cache_max = Some(2 << 20);
    cfg.memtable_bytes = Some(1 << 30);
    let n_keys = 50_000u64;
    {
        let (mut s, _) = Store::open(cfg.clone(), UringIo::new(256, true).unwrap()).unwrap();
        for i in 0..n_keys {
            common::run(&mut s, Op::Put(kr(&i.to_be_bytes()), &i.to_le_bytes())).unwrap();
        }
        s.flush();
        common::settle_fully(&mut s);
    }
    // Reopen with a cold, small cache: gets go to disk.
    let (mut s, _) = Store::open(cfg, UringIo::new(256, true).unwrap()).unwrap();
    let mut model: HashMap<u64, Vec<u8>> =
        (0..n_keys).map(|i| (i, i.to_le_bytes().to_vec())).collect();
    let mut expect: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    let mut got: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let mut max_pending = 0;
    let mut token = 0u64;
    let mut immediate = 0;
    while token < 10_000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let key = rng % n_keys;
        let kb = key.to_be_bytes();
        // A get, then (sometimes) a write to the same key right behind it.
        expect.insert(token, model.get(&key).cloned());
        match s.submit(token, Op::Get(kr(&kb))).unwrap() {
            Submitted::Ready(Output::Value(v)) => {
                got.insert(token, v.map(|v| v.to_vec()));
                order.push(token);
                immediate += 1;
            }
            Submitted::Ready(o) => panic!("{o:?}"),
            Submitted::Pending => {}
        }
        token += 1;
        match rng % 4 {
            0 => {
                let v = format!("new-{token}").into_bytes();
                s.submit(u64::MAX, Op::Put(kr(&kb), &v)).unwrap();
                model.insert(key, v);
            }
            1 => {
                s.submit(u64::MAX, Op::Delete(kr(&kb))).unwrap();
                model.remove(&key);
            }
            _ => {}
        }
        max_pending = max_pending.max(s.pending());
    }
    while got.len() < 10_000 {
        s.poll(|t, r| {
            let v = match r.unwrap() {
                Output::Value(v) => v.map(|v| v.to_vec()),
                o => panic!("{o:?}"),
            };
            got.insert(t, v);
            order.push(t);
        });
        if got.len() < 10_000 {
            s.wait(Some(std::time::Duration::from_millis(10))).unwrap();
        }
    }
    for t in 0..10_000u64 {
        assert_eq!(
            got[&t], expect[&t],
            "get {t} saw a state other than at its submission"
        );
    }
    assert!(
        max_pending >= 5_000,
        "only {max_pending} pending at once ({immediate} answered at once)"
    );
    let inversions = order.windows(2).filter(|w| w[0] > w[1]).count();
    assert!(inversions > 0, "completions arrived strictly in order");
    eprintln!(
        "max pending {max_pending}, immediate {immediate}, inversions {inversions}, block reads {}",
        s.stats().block_reads
    );
}

/// A poll finishes at most `disk_reads_per_poll` local block reads (or an
/// eighth of those in flight, if more); the rest wait for later polls, and
/// every get still completes with its value.
#[test]
fn a_poll_finishes_a_bounded_number_of_disk_reads() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = StoreConfig::new(d.path(), 256 << 20);
    cfg.block_cache_max = Some(1 << 20);
    let n_keys = 100_000u64;
    {
        let (mut s, _) = Store::open(cfg.clone(), UringIo::new(256, true).unwrap()).unwrap();
        for i in 0..n_keys {
            common::run(&mut s, Op::Put(kr(&i.to_be_bytes()), &[7; 100])).unwrap();
        }
        s.flush();
        common::settle_fully(&mut s);
    }
    cfg.disk_reads_per_poll = 2;
    let (mut s, _) = Store::open(cfg, UringIo::new(256, true).unwrap()).unwrap();
    // Keys 1,000 apart: each in a block of its own, so one read per get.
    let gets = 96u64;
    for t in 0..gets {
        let kb = (t * 1_000).to_be_bytes();
        assert!(matches!(
            s.submit(t, Op::Get(kr(&kb))).unwrap(),
            Submitted::Pending
        ));
    }
    let mut got = 0;
    let mut capped = 0;
    while got < gets {
        s.wait(Some(std::time::Duration::from_secs(5))).unwrap();
        let cap = (s.pending() / 8).max(2);
        let n = s.poll(|t, r| match r.unwrap() {
            Output::Value(Some(v)) => assert_eq!(v, &[7; 100], "get {t}"),
            o => panic!("get {t}: {o:?}"),
        });
        assert!(n <= cap, "a poll finished {n} disk reads of {cap}");
        capped += (n == cap) as u32;
        got += n as u64;
    }
    assert!(
        capped > 0,
        "no poll reached its bound: the test shows nothing"
    );
    assert_eq!(s.stats().block_reads, gets, "one read per get");
}
