//! The memtable: where every write lands first.
//!
//! Records are appended to a log of 2 MiB chunks; an open-addressing hash
//! index (16-bit tag + 48-bit log address per 8-byte slot) finds the newest
//! record of a key. A point lookup costs one slot load and one record load,
//! and [`Memtable::prefetch`] lets a caller with a batch of keys start all
//! of those loads before waiting on any (the ~550 ns random-load latency of
//! a large working set is then overlapped, not paid per key).
//!
//! List appends do not copy the list: a `Merge` record points to the
//! previous record of its key, and a read walks the chain. Map entries are
//! also kept in an ordered set of their keys, so a map can be iterated and
//! cleared without scanning the table. Order of records is only needed at
//! flush, which sorts the live keys (`crate::sorted`).

use std::collections::BTreeSet;
use std::ops::Bound;

use crate::format::Kind;
use crate::hugemem::HugeArray;
use crate::prefetch::line as prefetch;

/// Log chunk size: one huge page each (see `hugemem`).
pub(crate) const CHUNK: usize = 2 << 20;

/// Log chunks a memtable keeps mapped ahead of its tail (see
/// [`Memtable::keep_spares`]).
pub(crate) const SPARES_AHEAD: usize = 2;
const CHUNK_BITS: u32 = 21;
/// `u8 kind | u8 0 | u16 key_len | u32 value_len | u64 prev (addr+1 or 0)`,
/// then key and value; a `Merge` record then has a `u64` trailer: its
/// list's bytes in this memtable so far, shifted left by one, with bit 0
/// set when the chain ends in a `Put` or `Delete` here ([`ListBytes`]).
const REC_HEADER: usize = 16;
const MERGE_TRAILER: usize = 8;
const EMPTY: u64 = 0;
const TOMB: u64 = 1;
const ADDR_MASK: u64 = (1 << 48) - 1;

/// A record in the memtable.
#[derive(Clone, Copy, Debug)]
pub struct MemRecord<'a> {
    pub kind: Kind,
    pub key: &'a [u8],
    pub value: &'a [u8],
    /// The previous record of this key, for `Merge` chains.
    pub prev: Option<u64>,
}

/// What one layer knows of a list's length without reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct ListBytes {
    /// Encoded bytes of the list's elements in this layer.
    pub bytes: u64,
    /// A `Put` or `Delete` in this layer ends the list here: older layers
    /// add nothing to it.
    pub decided: bool,
}

/// A key's newest record and what it says of the key's list (see
/// [`Memtable::list_head`]).
#[derive(Clone, Copy, Debug)]
pub struct ListHead {
    addr: u64,
    pub bytes: ListBytes,
}

/// An in-memory table of records.
pub struct Memtable {
    chunks: Vec<HugeArray<u8>>,
    /// Bytes of `chunks` (asked for on every pass of a shard, through
    /// the write room, so not summed each time).
    chunk_bytes: usize,
    /// Bytes used in the last chunk.
    tail: usize,
    slots: HugeArray<u64>,
    mask: usize,
    /// Slots holding a record or a tombstone.
    occupied: usize,
    live: usize,
    log_bytes: usize,
    map_keys: BTreeSet<Box<[u8]>>,
    map_key_bytes: usize,
    /// The next log chunks, mapped ahead (see [`Memtable::keep_spares`]).
    spares: std::collections::VecDeque<HugeArray<u8>>,
}

#[inline]
fn tag_of(h: u64) -> u64 {
    h >> 48
}

impl Memtable {
    /// A memtable whose index starts with room for `entries` keys.
    pub fn new(entries: usize) -> Memtable {
        Self::with_index(entries, None)
    }

    /// Slots of the index of a memtable made for `entries` keys.
    pub fn index_len(entries: usize) -> usize {
        (entries.max(1024) * 2).next_power_of_two()
    }

    /// As [`Memtable::new`], on `index` (zeroed) if it has the size this
    /// memtable's index needs (see [`crate::reuse`]).
    pub fn with_index(entries: usize, index: Option<HugeArray<u64>>) -> Memtable {
        let cap = Self::index_len(entries);
        Memtable {
            chunks: Vec::new(),
            chunk_bytes: 0,
            tail: CHUNK,
            slots: index
                .filter(|i| i.len() == cap)
                .unwrap_or_else(|| HugeArray::zeroed(cap)),
            mask: cap - 1,
            occupied: 0,
            live: 0,
            log_bytes: 0,
            map_keys: BTreeSet::new(),
            map_key_bytes: 0,
            spares: std::collections::VecDeque::new(),
        }
    }

    /// Live keys.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Keeps the next two log chunks ready ahead: one `recycled` gives
    /// (a flushed memtable's, already faulted in), else a new one, whose
    /// range it returns for the caller to have faulted in off its thread
    /// ([`crate::io::Io::prefault`]) while earlier chunks fill: a write
    /// then rarely waits for a fresh page.
    pub fn keep_spares(
        &mut self,
        recycled: impl FnOnce() -> Option<HugeArray<u8>>,
    ) -> Option<(usize, usize)> {
        if self.spares.len() >= SPARES_AHEAD {
            return None;
        }
        if let Some(c) = recycled() {
            self.spares.push_back(c);
            return None;
        }
        self.spares.push_back(HugeArray::zeroed(CHUNK));
        let c = self.spares.back().expect("just pushed");
        Some((c.as_ptr() as usize, c.len()))
    }

    /// Hands this memtable's spare chunks to `next` (at its freeze: a
    /// frozen memtable appends nothing more, and a memtable frozen early,
    /// for a checkpoint, would otherwise hold two idle chunks until its
    /// flush lands).
    pub fn give_spares(&mut self, next: &mut Memtable) {
        next.spares.append(&mut self.spares);
    }

    /// The log chunks (spares included) and the index, for reuse.
    pub(crate) fn into_memory(self) -> (Vec<HugeArray<u8>>, HugeArray<u64>) {
        let Memtable {
            mut chunks,
            spares,
            slots,
            ..
        } = self;
        chunks.extend(spares);
        (chunks, slots)
    }

    /// Faults in the index's pages now (see `HugeArray::populate`).
    pub fn populate_index(&mut self) {
        self.slots.populate();
    }

    /// The index's memory range (to prefault a new memtable's index).
    pub fn index_range(&self) -> (usize, usize) {
        (self.slots.as_ptr() as usize, self.slots.len() * 8)
    }

    /// Bytes of records appended (the memtable's size for flushing).
    pub fn log_bytes(&self) -> usize {
        self.log_bytes
    }

    /// Bytes its records take (log, index, map key set), without the
    /// unwritten rest of its chunks: grows a write at a time.
    pub fn written_bytes(&self) -> usize {
        self.log_bytes + self.slots.len() * 8 + self.map_key_bytes
    }

    /// Bytes of memory held (chunks, index, map key set).
    pub fn memory_bytes(&self) -> usize {
        self.chunk_bytes
            + self.spares.iter().map(|c| c.len()).sum::<usize>()
            + self.slots.len() * 8
            + self.map_key_bytes
    }

    fn append(
        &mut self,
        kind: Kind,
        key: &[u8],
        value: &[u8],
        prev: Option<u64>,
        list: Option<ListBytes>,
    ) -> u64 {
        let trailer = if list.is_some() { MERGE_TRAILER } else { 0 };
        let need = REC_HEADER + key.len() + value.len() + trailer;
        let need_aligned = need.next_multiple_of(8);
        if self.tail + need_aligned > CHUNK || self.chunks.is_empty() {
            let size = need_aligned.max(CHUNK);
            let chunk = match self.spares.pop_front() {
                Some(c) if size == CHUNK => c,
                other => {
                    if let Some(c) = other {
                        self.spares.push_front(c);
                    }
                    HugeArray::zeroed(size)
                }
            };
            self.chunk_bytes += chunk.len();
            self.chunks.push(chunk);
            self.tail = 0;
            if size > CHUNK {
                // A record larger than a chunk gets a chunk of its own, and
                // the next record starts a fresh one.
                let addr = ((self.chunks.len() - 1) as u64) << CHUNK_BITS;
                self.write_record(addr, kind, key, value, prev, list);
                self.tail = CHUNK;
                self.log_bytes += need;
                return addr;
            }
        }
        let addr = (((self.chunks.len() - 1) as u64) << CHUNK_BITS) | self.tail as u64;
        self.write_record(addr, kind, key, value, prev, list);
        self.tail += need_aligned;
        self.log_bytes += need;
        addr
    }

    fn write_record(
        &mut self,
        addr: u64,
        kind: Kind,
        key: &[u8],
        value: &[u8],
        prev: Option<u64>,
        list: Option<ListBytes>,
    ) {
        let (c, off) = (
            (addr >> CHUNK_BITS) as usize,
            (addr & (CHUNK as u64 - 1)) as usize,
        );
        let buf = &mut self.chunks[c][off..];
        buf[0] = kind as u8;
        buf[1] = 0;
        buf[2..4].copy_from_slice(&(key.len() as u16).to_le_bytes());
        buf[4..8].copy_from_slice(&(value.len() as u32).to_le_bytes());
        buf[8..16].copy_from_slice(&prev.map_or(0, |p| p + 1).to_le_bytes());
        buf[REC_HEADER..REC_HEADER + key.len()].copy_from_slice(key);
        let end = REC_HEADER + key.len() + value.len();
        buf[REC_HEADER + key.len()..end].copy_from_slice(value);
        if let Some(l) = list {
            let t = (l.bytes << 1) | u64::from(l.decided);
            buf[end..end + MERGE_TRAILER].copy_from_slice(&t.to_le_bytes());
        }
    }

    /// The log from `addr` (an address this memtable handed out) on.
    fn bytes_at(&self, addr: u64) -> &[u8] {
        let (c, off) = (
            (addr >> CHUNK_BITS) as usize,
            (addr & (CHUNK as u64 - 1)) as usize,
        );
        &self.chunks[c][off..]
    }

    /// The record at `addr` (an address this memtable handed out).
    pub fn record(&self, addr: u64) -> MemRecord<'_> {
        let b = self.bytes_at(addr);
        let kind = Kind::from_u8(b[0]).expect("the memtable writes only valid kinds");
        let klen = u16::from_le_bytes([b[2], b[3]]) as usize;
        let vlen = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes")) as usize;
        let prev = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        MemRecord {
            kind,
            key: &b[REC_HEADER..REC_HEADER + klen],
            value: &b[REC_HEADER + klen..REC_HEADER + klen + vlen],
            prev: prev.checked_sub(1),
        }
    }

    fn key_at(&self, addr: u64) -> &[u8] {
        let b = self.bytes_at(addr);
        let klen = u16::from_le_bytes([b[2], b[3]]) as usize;
        &b[REC_HEADER..REC_HEADER + klen]
    }

    fn record_ptr(&self, addr: u64) -> *const u8 {
        self.bytes_at(addr).as_ptr()
    }

    /// Starts the first memory load a lookup of hash `h` will need: its
    /// home slot. [`Memtable::prefetch_found`] is the second, once the slot
    /// is cached.
    #[inline]
    pub fn prefetch(&self, h: u64) {
        prefetch(self.slots[(h as usize & self.mask)..].as_ptr() as *const u8);
    }

    /// The second stage of [`Memtable::prefetch`]: starts loading the
    /// record the home slot points to, if it holds the key's tag, and
    /// says whether it does. `false` says the key is most likely not here
    /// (it may sit further along the probe sequence).
    #[inline]
    pub fn prefetch_found(&self, h: u64) -> bool {
        let s = self.slots[h as usize & self.mask];
        let found = s > TOMB && tag_of(s) == tag_of(h);
        if found {
            self.prefetch_record((s & ADDR_MASK) - 2);
        }
        found
    }

    /// Starts loading the record at `addr`: its header and key, and the
    /// value's first lines (a record of a 100-byte value spans three),
    /// which the caller copies next.
    #[inline]
    pub fn prefetch_record(&self, addr: u64) {
        let p = self.record_ptr(addr);
        prefetch(p);
        prefetch(p.wrapping_add(64));
        prefetch(p.wrapping_add(128));
    }

    /// Starts loading the header and first key bytes of the record at
    /// `addr`.
    #[inline]
    pub fn prefetch_key(&self, addr: u64) {
        prefetch(self.record_ptr(addr));
    }

    /// Slot index of `key` (or `None`), by hash `h`.
    #[inline]
    fn find_slot(&self, key: &[u8], h: u64) -> Option<usize> {
        let mut i = h as usize & self.mask;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                return None;
            }
            if s != TOMB && tag_of(s) == tag_of(h) && self.key_at((s & ADDR_MASK) - 2) == key {
                return Some(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// Address of the newest record of `key`.
    #[inline]
    pub fn lookup_addr(&self, key: &[u8], h: u64) -> Option<u64> {
        self.find_slot(key, h)
            .map(|i| (self.slots[i] & ADDR_MASK) - 2)
    }

    /// The newest record of `key` (hash `h` = `bloom::hash(key)`).
    #[inline]
    pub fn lookup(&self, key: &[u8], h: u64) -> Option<MemRecord<'_>> {
        self.lookup_addr(key, h).map(|a| self.record(a))
    }

    /// Points `key`'s slot at `addr`; whether the key is new to the index.
    fn set_slot(&mut self, key: &[u8], h: u64, addr: u64) -> bool {
        if self.occupied + 1 > self.slots.len() / 4 * 3 {
            self.grow();
        }
        let v = (tag_of(h) << 48) | (addr + 2);
        let mut i = h as usize & self.mask;
        let mut first_tomb = None;
        loop {
            let s = self.slots[i];
            if s == EMPTY {
                match first_tomb {
                    Some(t) => self.slots[t] = v,
                    None => {
                        self.slots[i] = v;
                        self.occupied += 1;
                    }
                }
                self.live += 1;
                return true;
            }
            if s == TOMB {
                first_tomb.get_or_insert(i);
            } else if tag_of(s) == tag_of(h) && self.key_at((s & ADDR_MASK) - 2) == key {
                self.slots[i] = v;
                return false;
            }
            i = (i + 1) & self.mask;
        }
    }

    fn grow(&mut self) {
        let cap = self.slots.len() * 2;
        let old = std::mem::replace(&mut self.slots, HugeArray::zeroed(cap));
        self.mask = cap - 1;
        self.occupied = 0;
        // Rehashing reads every key, at random places in the log: the key
        // a few slots ahead is fetched while this one is placed.
        const AHEAD: usize = 16;
        for (j, &s) in old.iter().enumerate() {
            if let Some(&n) = old.get(j + AHEAD)
                && n > TOMB
            {
                prefetch(self.record_ptr((n & ADDR_MASK) - 2));
            }
            if s > TOMB {
                let addr = (s & ADDR_MASK) - 2;
                let h = crate::bloom::hash(self.key_at(addr));
                let mut i = h as usize & self.mask;
                while self.slots[i] != EMPTY {
                    i = (i + 1) & self.mask;
                }
                self.slots[i] = s;
                self.occupied += 1;
            }
        }
    }

    fn remove_slot(&mut self, key: &[u8], h: u64) {
        if let Some(i) = self.find_slot(key, h) {
            self.slots[i] = TOMB;
            self.live -= 1;
        }
    }

    /// Writes a `Put`, `Delete` or `Clear` record for `key`.
    pub fn write(&mut self, kind: Kind, key: &[u8], h: u64, value: &[u8]) {
        debug_assert!(kind != Kind::Merge);
        let addr = self.append(kind, key, value, None, None);
        self.set_slot(key, h, addr);
    }

    /// Writes a map entry's `Put` or `Delete` record, and records the key
    /// for ordered iteration and clear when it is new to this memtable (a
    /// key already in the index got there by a map write, which recorded
    /// it, and leaves the two together: `clear_map`, `delete_key_groups`):
    /// an overwrite costs no ordered-set lookup.
    pub fn write_map_entry(&mut self, kind: Kind, key: &[u8], h: u64, value: &[u8]) {
        debug_assert!(matches!(kind, Kind::Put | Kind::Delete));
        let addr = self.append(kind, key, value, None, None);
        // New to the index, so new to the set: one tree walk, not two.
        if self.set_slot(key, h, addr) && self.map_keys.insert(key.into()) {
            self.map_key_bytes += key.len() + 32;
        }
    }

    /// Appends list elements (already encoded) to `key`'s chain.
    pub fn merge(&mut self, key: &[u8], h: u64, operand: &[u8]) {
        let head = self.list_head(key, h);
        self.merge_onto(key, h, head, operand);
    }

    /// [`Memtable::merge`] onto `head`, what [`Memtable::list_head`] found
    /// for `key` with nothing written since (a caller that looked first,
    /// to check the list's length, looks once).
    pub fn merge_onto(&mut self, key: &[u8], h: u64, head: Option<ListHead>, operand: &[u8]) {
        let before = head.map_or(ListBytes::default(), |x| x.bytes);
        let list = ListBytes {
            bytes: before.bytes + operand.len() as u64,
            decided: before.decided,
        };
        let addr = self.append(Kind::Merge, key, operand, head.map(|x| x.addr), Some(list));
        self.set_slot(key, h, addr);
    }

    /// The newest record of `key` and what this memtable holds of its
    /// list, known without walking its chain (`None`: no record).
    pub fn list_head(&self, key: &[u8], h: u64) -> Option<ListHead> {
        self.lookup_addr(key, h).map(|addr| ListHead {
            addr,
            bytes: self.list_bytes_at(addr),
        })
    }

    /// What this memtable holds of the list at `key` (`None`: no record).
    pub fn list_bytes(&self, key: &[u8], h: u64) -> Option<ListBytes> {
        self.list_head(key, h).map(|x| x.bytes)
    }

    fn list_bytes_at(&self, addr: u64) -> ListBytes {
        let r = self.record(addr);
        match r.kind {
            Kind::Merge => {
                let at = REC_HEADER + r.key.len() + r.value.len();
                let t = u64::from_le_bytes(
                    self.bytes_at(addr)[at..at + MERGE_TRAILER]
                        .try_into()
                        .expect("8 bytes"),
                );
                ListBytes {
                    bytes: t >> 1,
                    decided: t & 1 == 1,
                }
            }
            Kind::Put => ListBytes {
                bytes: r.value.len() as u64,
                decided: true,
            },
            Kind::Delete | Kind::Clear => ListBytes {
                bytes: 0,
                decided: true,
            },
        }
    }

    /// Records that `key` is a map entry (for ordered iteration and clear).
    pub fn note_map_key(&mut self, key: &[u8]) {
        if !self.map_keys.contains(key) {
            self.map_key_bytes += key.len() + 32;
            self.map_keys.insert(key.into());
        }
    }

    /// Map entries (keys) of this memtable that start with `base`, after
    /// `after` (exclusive) when given, in order.
    pub fn map_range<'a>(
        &'a self,
        base: &'a [u8],
        after: Option<&[u8]>,
    ) -> impl Iterator<Item = &'a [u8]> + 'a {
        let lower: Bound<&[u8]> = match after {
            Some(a) => Bound::Excluded(a),
            None => Bound::Excluded(base),
        };
        self.map_keys
            .range::<[u8], _>((lower, Bound::Unbounded))
            .map(|k| &k[..])
            .take_while(move |k| k.starts_with(base))
    }

    /// Removes every map entry under `base` from this memtable and leaves a
    /// `Clear` record at `base`, which hides the map in older layers.
    pub fn clear_map(&mut self, base: &[u8]) {
        let doomed: Vec<Box<[u8]>> = self
            .map_keys
            .range::<[u8], _>((Bound::Excluded(base), Bound::Unbounded))
            .take_while(|k| k.starts_with(base))
            .cloned()
            .collect();
        for k in doomed {
            self.remove_slot(&k, crate::bloom::hash(&k));
            self.map_key_bytes -= k.len() + 32;
            self.map_keys.remove(&k);
        }
        self.write(Kind::Clear, base, crate::bloom::hash(base), &[]);
    }

    /// Removes every record whose key group is in `[lo, hi]`.
    pub fn delete_key_groups(&mut self, lo: u16, hi: u16) {
        for i in 0..self.slots.len() {
            let s = self.slots[i];
            if s > TOMB && crate::keys::in_key_groups(self.key_at((s & ADDR_MASK) - 2), lo, hi) {
                self.slots[i] = TOMB;
                self.live -= 1;
            }
        }
        let doomed: Vec<Box<[u8]>> = self
            .map_keys
            .iter()
            .filter(|k| crate::keys::in_key_groups(k, lo, hi))
            .cloned()
            .collect();
        for k in doomed {
            self.map_key_bytes -= k.len() + 32;
            self.map_keys.remove(&k);
        }
    }

    /// Index slots (see [`Memtable::live_addrs_in`]).
    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// Addresses of the live keys' newest records held by index slots
    /// `slots` (a part of [`Memtable::live_addrs`], to take in steps).
    pub fn live_addrs_in(&self, slots: std::ops::Range<usize>) -> impl Iterator<Item = u64> + '_ {
        self.slots[slots]
            .iter()
            .filter(|&&s| s > TOMB)
            .map(|&s| (s & ADDR_MASK) - 2)
    }

    /// The key of the record at `addr`.
    pub fn key_of(&self, addr: u64) -> &[u8] {
        self.key_at(addr)
    }

    /// Resolves the record chain at `addr` into what a segment stores for
    /// the key: `(kind, value)`. A merge chain ending in a `Put` or `Delete`
    /// becomes a `Put` of the whole list; one that ends in nothing stays a
    /// `Merge` of its operands (older layers hold the rest), oldest first.
    pub fn resolve(&self, addr: u64, out: &mut Vec<u8>) -> Kind {
        let r = self.record(addr);
        if r.kind != Kind::Merge {
            out.extend_from_slice(r.value);
            return r.kind;
        }
        let mut ops: Vec<&[u8]> = Vec::new();
        let mut cur = Some(addr);
        let mut base: Option<Kind> = None;
        while let Some(a) = cur {
            let r = self.record(a);
            match r.kind {
                Kind::Merge => {
                    ops.push(r.value);
                    cur = r.prev;
                }
                Kind::Put => {
                    ops.push(r.value);
                    base = Some(Kind::Put);
                    cur = None;
                }
                Kind::Delete | Kind::Clear => {
                    base = Some(Kind::Delete);
                    cur = None;
                }
            }
        }
        for op in ops.iter().rev() {
            out.extend_from_slice(op);
        }
        if base.is_some() {
            Kind::Put
        } else {
            Kind::Merge
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bloom::hash;

    #[test]
    fn a_merge_record_carries_its_lists_bytes() {
        let mut m = Memtable::new(16);
        let (a, b, c) = (&b"a"[..], &b"b"[..], &b"c"[..]);
        let lb = |bytes, decided| Some(ListBytes { bytes, decided });
        assert_eq!(m.list_bytes(a, hash(a)), None);
        m.merge(a, hash(a), &[0; 7]);
        m.merge(a, hash(a), &[0; 5]);
        assert_eq!(m.list_bytes(a, hash(a)), lb(12, false));
        m.write(Kind::Put, b, hash(b), &[0; 100]);
        m.merge(b, hash(b), &[0; 3]);
        assert_eq!(m.list_bytes(b, hash(b)), lb(103, true));
        m.write(Kind::Delete, c, hash(c), &[]);
        m.merge(c, hash(c), &[0; 9]);
        assert_eq!(m.list_bytes(c, hash(c)), lb(9, true));
        // The trailer changes nothing a read sees.
        let r = m.lookup(c, hash(c)).unwrap();
        assert_eq!((r.kind, r.value.len()), (Kind::Merge, 9));
        m.write(Kind::Put, a, hash(a), &[0; 4]);
        assert_eq!(m.list_bytes(a, hash(a)), lb(4, true));
    }

    #[test]
    fn put_overwrite_delete_and_growth() {
        let mut m = Memtable::new(16);
        for i in 0..10_000u32 {
            let k = i.to_be_bytes();
            m.write(Kind::Put, &k, hash(&k), &i.to_le_bytes());
        }
        for i in 0..10_000u32 {
            let k = i.to_be_bytes();
            let r = m.lookup(&k, hash(&k)).unwrap();
            assert_eq!(r.value, &i.to_le_bytes());
        }
        let k = 5u32.to_be_bytes();
        m.write(Kind::Put, &k, hash(&k), b"new");
        assert_eq!(m.lookup(&k, hash(&k)).unwrap().value, b"new");
        m.write(Kind::Delete, &k, hash(&k), b"");
        assert_eq!(m.lookup(&k, hash(&k)).unwrap().kind, Kind::Delete);
        assert_eq!(m.len(), 10_000);
        assert!(m.lookup(b"absent", hash(b"absent")).is_none());
    }

    #[test]
    fn merge_chains_resolve() {
        let mut m = Memtable::new(16);
        let k = b"list";
        let h = hash(k);
        m.merge(k, h, b"a");
        m.merge(k, h, b"b");
        let mut out = Vec::new();
        assert_eq!(
            m.resolve(m.lookup_addr(k, h).unwrap(), &mut out),
            Kind::Merge
        );
        assert_eq!(out, b"ab");
        m.write(Kind::Put, k, h, b"X");
        m.merge(k, h, b"c");
        out.clear();
        assert_eq!(m.resolve(m.lookup_addr(k, h).unwrap(), &mut out), Kind::Put);
        assert_eq!(out, b"Xc");
        m.write(Kind::Delete, k, h, b"");
        m.merge(k, h, b"d");
        out.clear();
        assert_eq!(m.resolve(m.lookup_addr(k, h).unwrap(), &mut out), Kind::Put);
        assert_eq!(out, b"d");
    }

    #[test]
    fn big_records_get_their_own_chunk() {
        let mut m = Memtable::new(16);
        let big = vec![7u8; 3 << 20];
        m.write(Kind::Put, b"big", hash(b"big"), &big);
        m.write(Kind::Put, b"small", hash(b"small"), b"s");
        assert_eq!(m.lookup(b"big", hash(b"big")).unwrap().value.len(), 3 << 20);
        assert_eq!(m.lookup(b"small", hash(b"small")).unwrap().value, b"s");
    }

    #[test]
    fn map_clear_removes_entries() {
        let mut m = Memtable::new(16);
        let base = b"base".to_vec();
        for u in [b"a", b"b", b"c"] {
            let mut k = base.clone();
            k.extend_from_slice(u);
            m.write(Kind::Put, &k, hash(&k), b"v");
            m.note_map_key(&k);
        }
        assert_eq!(m.map_range(&base, None).count(), 3);
        let mut after = base.clone();
        after.push(b'a');
        assert_eq!(m.map_range(&base, Some(&after)).count(), 2);
        m.clear_map(&base);
        assert_eq!(m.map_range(&base, None).count(), 0);
        assert_eq!(m.lookup(&base, hash(&base)).unwrap().kind, Kind::Clear);
        let mut k = base.clone();
        k.push(b'a');
        assert!(m.lookup(&k, hash(&k)).is_none());
    }
}
