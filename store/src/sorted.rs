//! A frozen memtable's live records in key order: what a flush writes.
//!
//! The memtable is a hash table over an append-only log, so its order is
//! made at flush time. Sorting millions of keys by comparing them where
//! they lie costs a random load per key per comparison (~550 ns each in
//! a large working set: tens of seconds for a 600 MiB memtable), so each
//! key's first 16 bytes are gathered once, with loads overlapped across a
//! batch, and the sort compares those; only keys that share all 16 bytes
//! are compared in full. The flush runs this on a helper thread for any
//! memtable large enough for it to matter ([`sort_on_thread`]): the
//! frozen memtable is immutable and shared, and the shard that owns it
//! keeps serving requests meanwhile.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};

use crate::memtable::Memtable;

/// Bytes of memory a sort holds per live key while it runs.
pub const BYTES_PER_KEY: usize = std::mem::size_of::<Entry>();

/// A memtable of at most this many live keys is sorted on the caller's
/// thread: a thread costs more than the sort (under a millisecond).
pub const INLINE_MAX_KEYS: usize = 8192;

/// Loads started ahead of use while gathering prefixes.
const AHEAD: usize = 16;

/// A key's first 16 bytes, big-endian (zero-padded), and its record.
struct Entry {
    hi: u64,
    lo: u64,
    addr: u64,
}

/// The address of every live key's newest record, in ascending key order.
pub fn sorted_live(mem: &Memtable) -> Vec<u64> {
    let mut entries: Vec<Entry> = Vec::with_capacity(mem.len());
    let mut ring = [0u64; AHEAD];
    let mut seen = 0usize;
    let take = |entries: &mut Vec<Entry>, addr: u64| {
        let k = mem.key_of(addr);
        let mut p = [0u8; 16];
        let n = k.len().min(16);
        p[..n].copy_from_slice(&k[..n]);
        let (hi, lo) = p.split_at(8);
        entries.push(Entry {
            hi: u64::from_be_bytes(hi.try_into().expect("8 bytes")),
            lo: u64::from_be_bytes(lo.try_into().expect("8 bytes")),
            addr,
        });
    };
    // A software pipeline: the key `AHEAD` places on is requested before
    // this one is read.
    for addr in mem.live_addrs() {
        mem.prefetch_key(addr);
        let slot = seen % AHEAD;
        if seen >= AHEAD {
            take(&mut entries, ring[slot]);
        }
        ring[slot] = addr;
        seen += 1;
    }
    for i in seen.saturating_sub(AHEAD)..seen {
        take(&mut entries, ring[i % AHEAD]);
    }
    // A prefix that is a true prefix of the key (zero-padded) orders as
    // the key does, and equal prefixes fall back to the keys themselves.
    entries.sort_unstable_by(|a, b| {
        (a.hi, a.lo)
            .cmp(&(b.hi, b.lo))
            .then_with(|| mem.key_of(a.addr).cmp(mem.key_of(b.addr)))
    });
    entries.into_iter().map(|e| e.addr).collect()
}

/// Sorts `mem` on a helper thread; its answer arrives on the receiver.
/// `None` if no thread could be started (the caller sorts inline).
pub fn sort_on_thread(mem: &Arc<Memtable>) -> Option<Receiver<Vec<u64>>> {
    let (tx, rx) = sync_channel(1);
    let mem = mem.clone();
    crate::helper::spawn("stator-flush-sort", move || {
        // The flush may have been abandoned: then nobody listens.
        let _ = tx.send(sorted_live(&mem));
    })
    .then_some(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bloom::hash;
    use crate::format::Kind;

    #[test]
    fn keys_come_out_in_byte_order_whatever_their_shared_prefixes() {
        let mut m = Memtable::new(1024);
        let mut keys: Vec<Vec<u8>> = Vec::new();
        // Keys sharing 16+ bytes, shorter than 16, and with zero bytes
        // where a shorter key is padded.
        for i in 0u32..5000 {
            let mut k = vec![7u8; 20];
            k.extend_from_slice(&i.wrapping_mul(2_654_435_761).to_be_bytes());
            keys.push(k);
            keys.push(i.to_le_bytes()[..(i % 4 + 1) as usize].to_vec());
        }
        keys.push(vec![1, 2]);
        keys.push(vec![1, 2, 0]);
        keys.push(vec![1, 2, 0, 0]);
        keys.sort();
        keys.dedup();
        for k in keys.iter().rev() {
            m.write(Kind::Put, k, hash(k), b"v");
        }
        let got: Vec<Vec<u8>> = sorted_live(&m)
            .into_iter()
            .map(|a| m.key_of(a).to_vec())
            .collect();
        assert_eq!(got, keys);
        // The same from a helper thread.
        let m = Arc::new(m);
        let rx = sort_on_thread(&m).expect("a thread");
        let addrs = rx.recv().expect("the sort's answer");
        assert_eq!(addrs.len(), keys.len());
        assert!(addrs.windows(2).all(|w| m.key_of(w[0]) < m.key_of(w[1])));
    }
}
