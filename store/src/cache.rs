//! The block cache: validated data blocks by (segment, block number), under
//! a byte budget, evicted with CLOCK (a referenced bit per entry, cleared
//! as the hand passes; an unreferenced entry is evicted). Blocks are
//! reference-counted, so a read in progress keeps its block even if the
//! cache lets go of it.

use rustc_hash::FxHashMap;
use std::rc::Rc;

use crate::aligned::AlignedBuf;
use crate::format::{BlockView, Malformed};

/// A data block that passed its checksum, with its record table located.
pub struct Block {
    buf: Bytes,
    offs_at: usize,
    n: usize,
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("bytes", &self.bytes().len())
            .field("records", &self.n)
            .finish()
    }
}

/// A block's bytes: a buffer of its own (cached blocks), a range of a
/// larger read shared by the blocks it holds (streaming reads: compaction
/// and export parse in place instead of copying every block out), or the
/// bytes of a remote GET as the client fetched them (no copy on the shard
/// thread; a block that shared its GET with others got a copy of its own,
/// see `remote::finish_get`, so it holds exactly its bytes).
enum Bytes {
    Own(AlignedBuf),
    Shared(Rc<AlignedBuf>, std::ops::Range<usize>),
    Fetched(bytes::Bytes),
}

impl Block {
    /// Validates `buf` (one whole block as read from disk).
    pub fn parse(buf: AlignedBuf) -> Result<Block, Malformed> {
        let (offs_at, n) = BlockView::parse(&buf)?.shape();
        Ok(Block {
            buf: Bytes::Own(buf),
            offs_at,
            n,
        })
    }

    /// A block fetched from the remote tier, in place, that
    /// [`Block::check`] passed (on the remote runtime) with `shape`.
    pub fn checked(b: bytes::Bytes, (offs_at, n): (usize, usize)) -> Block {
        Block {
            buf: Bytes::Fetched(b),
            offs_at,
            n,
        }
    }

    /// The check of a fetched block's bytes ([`crate::remote::Check`]): its
    /// checksum and record table, and the shape [`Block::checked`] takes.
    pub fn check(b: &[u8]) -> Result<(usize, usize), &'static str> {
        BlockView::parse(b).map(|v| v.shape()).map_err(|m| m.0)
    }

    /// Validates the block at `range` of a larger read.
    pub fn parse_in(
        buf: &Rc<AlignedBuf>,
        range: std::ops::Range<usize>,
    ) -> Result<Block, Malformed> {
        let (offs_at, n) = BlockView::parse(&buf[range.clone()])?.shape();
        Ok(Block {
            buf: Bytes::Shared(buf.clone(), range),
            offs_at,
            n,
        })
    }

    pub fn view(&self) -> BlockView<'_> {
        BlockView::trusted(self.bytes(), self.offs_at, self.n)
    }

    /// Starts loading the lines a lookup reads first: the header and the
    /// record table's start (the search's first probes).
    #[inline]
    pub(crate) fn prefetch(&self) {
        let b = self.bytes();
        crate::prefetch::line(b.as_ptr());
        crate::prefetch::line(
            b.as_ptr()
                .wrapping_add(crate::format::BLOCK_HEADER + self.offs_at),
        );
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.buf {
            Bytes::Own(b) => b,
            Bytes::Shared(b, r) => &b[r.clone()],
            Bytes::Fetched(b) => b,
        }
    }

    pub fn memory_bytes(&self) -> usize {
        match &self.buf {
            Bytes::Own(b) => b.capacity() + 64,
            Bytes::Shared(_, r) => r.len() + 64,
            Bytes::Fetched(b) => b.len() + 64,
        }
    }
}

struct Entry {
    key: (u64, u32),
    block: Rc<Block>,
    referenced: bool,
}

/// No entry (a [`Slots`] value).
const NO_ENTRY: u32 = u32::MAX;

/// Which entry holds each cached block: per segment, an array by block
/// number. Unlike a hash map, the address of a block's slot is known
/// before it is read, so a batch of reads can load the slots, then the
/// entries, then the blocks, each step overlapping across the batch
/// (see `BlockCache::ahead`). A segment's array costs 4 bytes per block up
/// to the highest one cached, until the segment is forgotten
/// (`BlockCache::slot_bytes`).
#[derive(Default)]
struct Slots {
    by_seg: FxHashMap<u64, Vec<u32>>,
    len: usize,
    /// Bytes the arrays hold (their capacity).
    bytes: usize,
}

impl Slots {
    #[inline]
    fn slot(&self, (seg, block): (u64, u32)) -> Option<&u32> {
        self.by_seg.get(&seg)?.get(block as usize)
    }

    #[inline]
    fn get(&self, key: (u64, u32)) -> Option<usize> {
        self.slot(key)
            .filter(|&&e| e != NO_ENTRY)
            .map(|&e| e as usize)
    }

    fn set(&mut self, (seg, block): (u64, u32), e: usize) {
        let v = self.by_seg.entry(seg).or_default();
        if v.len() <= block as usize {
            let before = v.capacity();
            v.resize(block as usize + 1, NO_ENTRY);
            self.bytes += (v.capacity() - before) * 4;
        }
        if v[block as usize] == NO_ENTRY {
            self.len += 1;
        }
        assert!(e < NO_ENTRY as usize, "fewer than 4 G cached blocks");
        v[block as usize] = e as u32;
    }

    fn remove(&mut self, (seg, block): (u64, u32)) {
        if let Some(e) = self
            .by_seg
            .get_mut(&seg)
            .and_then(|v| v.get_mut(block as usize))
            .filter(|e| **e != NO_ENTRY)
        {
            *e = NO_ENTRY;
            self.len -= 1;
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// Drops segment `seg`'s array (its blocks are gone).
    fn forget(&mut self, seg: u64) {
        if let Some(v) = self.by_seg.remove(&seg) {
            self.bytes -= v.capacity() * 4;
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = ((u64, u32), usize)> + '_ {
        self.by_seg.iter().flat_map(|(&seg, v)| {
            v.iter()
                .enumerate()
                .filter(|(_, e)| **e != NO_ENTRY)
                .map(move |(b, &e)| ((seg, b as u32), e as usize))
        })
    }
}

/// Where a batched read stands in loading its cached block, a step per
/// stage of the batch's pipeline (see [`BlockCache::ahead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ahead {
    /// Nothing to load (not cached, or not looked for).
    None,
    /// The block's slot is loading.
    Slot(u64, u32),
    /// Its entry is loading.
    Entry(u64, u32, u32),
    /// Its block's first lines are loading.
    Block(u64, u32, u32),
}

/// Spare buffers kept at most (see [`BlockCache`]).
pub const MAX_SPARE: usize = 8;

/// Blocks evicted at most by one call (see [`BlockCache::set_budget`]).
pub const EVICT_STEP: usize = 256;

/// CLOCK cache of blocks. It also keeps the buffers of a few evicted
/// blocks no one else holds, for the next blocks read from the local disk
/// (a fresh page-aligned allocation, zeroed, costs more than the read's
/// own work). They count against its budget like the blocks.
pub struct BlockCache {
    /// Index of each key's entry.
    map: Slots,
    /// In CLOCK order; holes are reused by inserts, and squeezed out when
    /// they outnumber the entries (a budget shrunk far), so that the hand
    /// does not walk them.
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    hand: usize,
    bytes: usize,
    budget: usize,
    spare: Vec<AlignedBuf>,
    spare_bytes: usize,
    /// Bytes of the buffers [`BlockCache::buffer`] handed out for reads
    /// still in flight (their blocks will be inserted).
    lent: usize,
    pub hits: u64,
    pub misses: u64,
}

impl BlockCache {
    pub fn new(budget: usize) -> BlockCache {
        BlockCache {
            map: Slots::default(),
            entries: Vec::new(),
            free: Vec::new(),
            hand: 0,
            bytes: 0,
            budget,
            spare: Vec::new(),
            spare_bytes: 0,
            lent: 0,
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, seg: u64, block: u32) -> Option<Rc<Block>> {
        match self.map.get((seg, block)) {
            Some(i) => Some(self.hit(i)),
            None => {
                self.misses += 1;
                None
            }
        }
    }

    fn hit(&mut self, i: usize) -> Rc<Block> {
        self.hits += 1;
        let e = self.entries[i]
            .as_mut()
            .expect("mapped entries are occupied");
        e.referenced = true;
        e.block.clone()
    }

    /// Starts loading block `block` of `seg` for a read a few steps
    /// later: the first step of a pipeline a batch of reads runs
    /// together, each [`BlockCache::advance`] loading the next line the
    /// lookup needs (slot, entry, the block's header and record table)
    /// while the batch's other reads go on, and [`BlockCache::take`]
    /// finishing as [`BlockCache::get`] would.
    #[inline]
    pub fn ahead(&self, seg: u64, block: u32) -> Ahead {
        match self.map.slot((seg, block)) {
            Some(s) => {
                crate::prefetch::line((s as *const u32).cast());
                Ahead::Slot(seg, block)
            }
            None => Ahead::None,
        }
    }

    /// The next step of [`BlockCache::ahead`].
    #[inline]
    pub fn advance(&self, a: Ahead) -> Ahead {
        match a {
            Ahead::Slot(seg, block) => match self.map.get((seg, block)) {
                Some(i) => {
                    crate::prefetch::value(&self.entries[i], 1);
                    Ahead::Entry(seg, block, i as u32)
                }
                None => Ahead::None,
            },
            // (An index taken before a squeeze may be past the end now.)
            Ahead::Entry(seg, block, i) => match self.entries.get(i as usize) {
                Some(Some(e)) if e.key == (seg, block) => {
                    crate::prefetch::line(Rc::as_ptr(&e.block).cast());
                    e.block.prefetch();
                    Ahead::Block(seg, block, i)
                }
                _ => Ahead::None,
            },
            Ahead::None | Ahead::Block(..) => a,
        }
    }

    /// The block a pipeline loaded (counted as [`BlockCache::get`]
    /// counts), or `None`: not cached, or not as far as its entry (the
    /// caller looks it up as usual).
    #[inline]
    pub fn take(&mut self, a: Ahead) -> Option<(u64, u32, Rc<Block>)> {
        match a {
            Ahead::Entry(seg, block, i) | Ahead::Block(seg, block, i)
                if self
                    .entries
                    .get(i as usize)
                    .and_then(Option::as_ref)
                    .is_some_and(|e| e.key == (seg, block)) =>
            {
                Some((seg, block, self.hit(i as usize)))
            }
            _ => None,
        }
    }

    /// A cached block without touching its CLOCK bit or the counters.
    pub fn peek_entry(&self, seg: u64, block: u32) -> Option<Rc<Block>> {
        self.map
            .get((seg, block))
            .map(|i| self.entries[i].as_ref().expect("mapped").block.clone())
    }

    /// Inserts `b` only if it fits without evicting anything.
    pub fn insert_if_room(&mut self, seg: u64, block: u32, b: Rc<Block>) {
        if self.bytes() + b.memory_bytes() <= self.budget {
            self.insert(seg, block, b);
        }
    }

    pub fn insert(&mut self, seg: u64, block: u32, b: Rc<Block>) {
        if self.budget == 0 || self.map.get((seg, block)).is_some() {
            return;
        }
        let size = b.memory_bytes();
        // Spares give way first: they never crowd out a block.
        if self.lent + self.spare_bytes + size > self.budget {
            self.drop_spares();
        }
        // Reads in flight hold the whole budget: no eviction makes room
        // for the block, which is left out; the cached blocks still give
        // way to the reads' buffers (a step at a time), or the daemon
        // would hold the budget twice over.
        if self.lent + size > self.budget {
            self.trim();
            return;
        }
        // An evicted block's buffer may become a spare (its bytes move,
        // they are not freed); once MAX_SPARE are kept, evictions free.
        // A cache far over a budget just lowered is trimmed in steps: the
        // block is left out rather than evict more than a step for it.
        let mut evicted = 0;
        while self.bytes() + size > self.budget {
            if self.map.is_empty() {
                self.drop_spares();
                break;
            }
            if evicted == EVICT_STEP {
                return;
            }
            let old = self.evict_one();
            self.recycle(old);
            evicted += 1;
        }
        let e = Entry {
            key: (seg, block),
            block: b,
            referenced: false,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.entries[i] = Some(e);
                i
            }
            None => {
                self.entries.push(Some(e));
                self.entries.len() - 1
            }
        };
        self.map.set((seg, block), i);
        self.bytes += size;
    }

    fn drop_spares(&mut self) {
        self.spare.clear();
        self.spare_bytes = 0;
    }

    /// Evicts the next unreferenced entry under the hand (the cache must
    /// not be empty).
    fn evict_one(&mut self) -> Rc<Block> {
        if self.entries.len() > 2 * self.map.len() + 64 {
            self.squeeze();
        }
        loop {
            if self.hand >= self.entries.len() {
                self.hand = 0;
            }
            let i = self.hand;
            self.hand += 1;
            let Some(e) = self.entries[i].as_mut() else {
                continue;
            };
            if e.referenced {
                e.referenced = false;
                continue;
            }
            return self.remove_at(i);
        }
    }

    /// Empties slot `i` (occupied) for reuse.
    fn remove_at(&mut self, i: usize) -> Rc<Block> {
        let e = self.entries[i].take().expect("occupied");
        self.map.remove(e.key);
        self.bytes -= e.block.memory_bytes();
        self.free.push(i);
        e.block
    }

    /// Drops the holes, keeping the entries' order and the hand's place
    /// among them (O(entries), once per as many evictions).
    fn squeeze(&mut self) {
        let before_hand = self.entries[..self.hand.min(self.entries.len())]
            .iter()
            .filter(|e| e.is_some())
            .count();
        self.entries.retain(Option::is_some);
        self.free.clear();
        for (i, e) in self.entries.iter().enumerate() {
            let key = e.as_ref().expect("retained").key;
            self.map.set(key, i);
        }
        self.hand = before_hand;
    }

    /// Drops every block of segment `seg` (it was deleted).
    pub fn forget_segment(&mut self, seg: u64) {
        for i in 0..self.entries.len() {
            if self.entries[i].as_ref().is_some_and(|e| e.key.0 == seg) {
                self.remove_at(i);
            }
        }
        self.map.forget(seg);
    }

    /// Bytes held: cached blocks, spare buffers and the buffers of reads
    /// in flight.
    pub fn bytes(&self) -> usize {
        self.bytes + self.spare_bytes + self.lent
    }

    /// Bytes of the per-segment slot arrays (segment metadata: the store
    /// counts them with indexes and filters, not in the cache's budget).
    pub fn slot_bytes(&self) -> usize {
        self.map.bytes
    }

    /// The budget (see [`BlockCache::set_budget`]).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Sets the budget. A smaller one is reached in steps of at most
    /// [`EVICT_STEP`] blocks, this call's and each [`BlockCache::trim`]'s
    /// after it: freeing hundreds of megabytes of blocks at once (a
    /// memtable freeze takes the room its successor will fill) would stall
    /// the caller's thread for milliseconds.
    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.drop_spares();
        self.trim();
    }

    /// Evicts up to [`EVICT_STEP`] blocks while the cache is over its
    /// budget; true if it still is.
    pub fn trim(&mut self) -> bool {
        for _ in 0..EVICT_STEP {
            if self.bytes() <= self.budget || self.map.is_empty() {
                return false;
            }
            self.evict_one();
        }
        self.bytes() > self.budget
    }

    /// A buffer of `len` bytes to read a block into: a spare one when it
    /// fits, else, when the cache is full, the buffer of the block CLOCK
    /// evicts (the block read into it takes its place), else a new one.
    /// Its old bytes are overwritten by the read; a short read is an error,
    /// never parsed. A new buffer is a fresh page-aligned allocation,
    /// zeroed and faulted in: when reads in flight were not counted, a full
    /// cache freed its evicted blocks while 40% of reads at depth 32 took
    /// new buffers. The buffer counts as the cache's until
    /// [`BlockCache::read_done`].
    pub fn buffer(&mut self, len: usize) -> AlignedBuf {
        self.lent += len;
        self.reuse(len).unwrap_or_else(|| AlignedBuf::zeroed(len))
    }

    fn reuse(&mut self, len: usize) -> Option<AlignedBuf> {
        match self.spare.pop() {
            Some(b) if fits(&b, len) => {
                self.spare_bytes -= b.capacity();
                return Some(sized(b, len));
            }
            Some(b) => self.spare_bytes -= b.capacity(),
            None => {}
        }
        // `lent` already counts this read.
        if self.bytes() > self.budget && !self.map.is_empty() {
            return own_buffer(self.evict_one())
                .filter(|b| fits(b, len))
                .map(|b| sized(b, len));
        }
        None
    }

    /// The read into a buffer of `len` bytes from [`BlockCache::buffer`]
    /// completed (its block, if any, is inserted next).
    pub fn read_done(&mut self, len: usize) {
        debug_assert!(self.lent >= len, "a read returned more than it was lent");
        self.lent = self.lent.saturating_sub(len);
    }

    /// Bytes lent to reads in flight (see [`BlockCache::buffer`]).
    pub fn lent(&self) -> usize {
        self.lent
    }

    /// Keeps an evicted block's buffer as a spare if no one else holds the
    /// block, it is block-sized, fewer than [`MAX_SPARE`] are kept and they
    /// stay within an eighth of the budget (spares never crowd out blocks).
    fn recycle(&mut self, b: Rc<Block>) {
        const MAX_SPARE_CAP: usize = 64 << 10;
        let Some(buf) = own_buffer(b) else {
            return;
        };
        let cap = buf.capacity();
        if self.spare.len() < MAX_SPARE
            && cap <= MAX_SPARE_CAP
            && self.spare_bytes + cap <= self.budget / 8
        {
            self.spare_bytes += cap;
            self.spare.push(buf);
        }
    }
}

/// An evicted block's buffer, if it owns one and no one else holds it.
fn own_buffer(b: Rc<Block>) -> Option<AlignedBuf> {
    match Rc::try_unwrap(b) {
        Ok(Block {
            buf: Bytes::Own(buf),
            ..
        }) => Some(buf),
        _ => None,
    }
}

/// Whether a reused buffer suits a read of `len` bytes: large enough, and
/// not much larger (the block would be charged for all of it).
fn fits(b: &AlignedBuf, len: usize) -> bool {
    b.capacity() >= len && b.capacity() <= 2 * len.max(4096)
}

fn sized(mut b: AlignedBuf, len: usize) -> AlignedBuf {
    b.set_len(len);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{BlockBuilder, Kind};

    fn block(i: u32) -> Rc<Block> {
        let mut b = BlockBuilder::default();
        b.add(Kind::Put, &i.to_be_bytes(), b"value");
        let mut buf = AlignedBuf::with_capacity(4096);
        b.finish_into(&mut buf);
        Rc::new(Block::parse(buf).unwrap())
    }

    /// The staged lookup finds what `get` finds, counts one hit, and
    /// gives nothing for a block that left the cache between its steps
    /// (its entry reused by another block) or was never cached.
    #[test]
    fn a_staged_lookup_matches_get_and_notices_eviction() {
        let size = block(0).memory_bytes();
        let mut c = BlockCache::new(4 * size);
        for i in 0..4 {
            c.insert(7, i, block(i));
        }
        let run = |c: &mut BlockCache, seg, b| {
            let a = c.ahead(seg, b);
            let a = c.advance(a);
            let a = c.advance(a);
            c.take(a)
        };
        let hits = c.hits;
        let (seg, b, got) = run(&mut c, 7, 2).expect("cached");
        assert_eq!((seg, b), (7, 2));
        assert!(Rc::ptr_eq(&got, &c.peek_entry(7, 2).unwrap()));
        assert_eq!(c.hits, hits + 1);
        assert!(run(&mut c, 7, 9).is_none() && run(&mut c, 8, 0).is_none());
        // Block 1 leaves the cache between the steps (its entry empty or
        // another block's).
        let a = c.advance(c.ahead(7, 1));
        c.forget_segment(7);
        c.insert(9, 0, block(9));
        assert!(c.take(c.advance(a)).is_none(), "not block 1 any more");
        assert!(c.ahead(7, 1) == Ahead::None, "the segment's slots went");
        consistent(&c);
        c.forget_segment(9);
        assert_eq!(c.slot_bytes(), 0, "every array given back");
        // Entries squeezed out between the steps (a read's fetch or a
        // budget change evicts mid-batch): a staged index past the end
        // gives nothing, no panic.
        let mut c = BlockCache::new(600 * size);
        for i in 0..300 {
            c.insert(1, i, block(i));
        }
        let late = c.advance(c.ahead(1, 299));
        let later = c.advance(late);
        c.forget_segment(1);
        c.insert(2, 0, block(0));
        c.set_budget(size);
        c.insert(2, 1, block(1));
        assert!(c.entries.len() < 299, "squeezed: {}", c.entries.len());
        assert!(c.advance(late) == Ahead::None && c.take(late).is_none());
        assert!(c.take(later).is_none());
        consistent(&c);
    }

    #[test]
    fn a_lower_budget_is_reached_in_bounded_steps() {
        let size = block(0).memory_bytes();
        let n = 4 * EVICT_STEP as u32;
        let mut c = BlockCache::new(n as usize * size);
        for i in 0..n {
            c.insert(1, i, block(i));
        }
        assert_eq!(c.map.len(), n as usize);
        c.set_budget(10 * size);
        assert_eq!(c.map.len(), n as usize - EVICT_STEP, "one step evicted");
        // Far over its budget, an insert leaves its block out rather than
        // evict more than a step for it.
        c.insert(2, 0, block(0));
        assert!(c.peek_entry(2, 0).is_none());
        assert_eq!(c.map.len(), n as usize - 2 * EVICT_STEP);
        assert!(c.trim(), "still over");
        assert!(!c.trim(), "within budget");
        assert!(c.bytes() <= 10 * size && c.map.len() >= 8);
        c.insert(2, 0, block(0));
        assert!(c.peek_entry(2, 0).is_some(), "room once within budget");
    }

    /// A full cache keeps evicted blocks' buffers for the next reads (at
    /// most MAX_SPARE, an eighth of its budget), then gives reads its cold
    /// blocks' buffers, within its budget; a block someone still holds is
    /// not recycled.
    #[test]
    fn evicted_buffers_are_reused_within_the_budget() {
        let size = block(0).memory_bytes();
        let budget = 64 * size;
        let mut c = BlockCache::new(budget);
        for i in 0..64 {
            c.insert(1, i, block(i));
        }
        assert_eq!(c.bytes(), budget);
        let held = c.get(1, 0).unwrap();
        for i in 64..160 {
            c.insert(1, i, block(i));
            assert!(c.bytes() <= budget);
        }
        assert_eq!(c.spare.len(), MAX_SPARE);
        assert!(c.peek_entry(1, 0).is_none() && held.view().len() == 1);
        // Reads take the spares, at the asked length, then (the cache
        // being full) a cold block's buffer; what they hold counts as the
        // cache's until they are done.
        let (before, blocks) = (c.bytes(), c.map.len());
        let lent: Vec<AlignedBuf> = (0..MAX_SPARE).map(|_| c.buffer(4096)).collect();
        assert_eq!((c.bytes(), c.map.len()), (before, blocks));
        assert!(before + 4096 > budget, "full");
        let from_block = c.buffer(4096);
        assert_eq!(c.map.len(), blocks - 1);
        assert!(c.bytes() <= budget);
        assert!(lent.iter().chain([&from_block]).all(|b| b.len() == 4096));
        for _ in 0..=MAX_SPARE {
            c.read_done(4096);
        }
        assert_eq!(c.bytes(), (blocks - 1) * size);
        c.set_budget(32 * size);
        assert!(c.bytes() <= 32 * size && c.spare.is_empty());
        // A tiny cache keeps no spares.
        let mut c = BlockCache::new(4 * size);
        for i in 0..16 {
            c.insert(1, i, block(i));
        }
        assert_eq!((c.map.len(), c.spare.len()), (4, 0));
    }

    fn consistent(c: &BlockCache) {
        assert_eq!(c.map.len(), c.entries.iter().flatten().count());
        for (k, i) in c.map.iter() {
            assert_eq!(c.entries[i].as_ref().unwrap().key, k);
        }
        assert!(c.free.iter().all(|&i| c.entries[i].is_none()));
        let slots: usize = c.map.by_seg.values().map(|v| v.capacity() * 4).sum();
        assert_eq!(c.slot_bytes(), slots, "slot arrays counted as they are");
    }

    /// Holes are squeezed out once they outnumber the entries (the map
    /// follows): the hand of a cache shrunk far walked every empty slot of
    /// its largest size for each eviction (20% of a shard's time under
    /// `stator-bench load`).
    #[test]
    fn holes_are_squeezed_out_and_entries_stay_mapped() {
        let size = block(0).memory_bytes();
        let mut c = BlockCache::new(1024 * size);
        for i in 0..1024 {
            c.insert(1 + u64::from(i % 2), i, block(i));
        }
        let _ = c.get(2, 7);
        c.forget_segment(1);
        consistent(&c);
        assert_eq!(c.map.len(), 512);
        assert_eq!(c.get(2, 7).unwrap().view().len(), 1);
        c.set_budget(16 * size);
        while c.trim() {}
        consistent(&c);
        assert!(c.entries.len() <= 2 * 16 + 64 + 1, "{}", c.entries.len());
        assert!(c.peek_entry(2, 7).is_some(), "the referenced block stays");
        for i in 2000..2100 {
            c.insert(3, i, block(i));
            consistent(&c);
        }
    }

    /// With reads in flight holding the whole budget, an insert leaves its
    /// block out, and the cached blocks make way for the reads' buffers a
    /// step at a time (keeping them held the budget twice over: the
    /// hostile soak's daemon passed its budget + 64 MiB).
    #[test]
    fn reads_holding_the_budget_leave_the_block_out_and_take_the_room() {
        let size = block(0).memory_bytes();
        let mut c = BlockCache::new(8 * size);
        for i in 0..4 {
            c.insert(1, i, block(i));
        }
        c.lent = 7 * size;
        c.insert(1, 98, block(98));
        assert!(c.peek_entry(1, 98).is_some(), "one block still fits");
        assert_eq!(c.map.len(), 1);
        c.lent = 8 * size;
        c.insert(1, 99, block(99));
        assert!(c.peek_entry(1, 99).is_none());
        assert_eq!((c.map.len(), c.bytes()), (0, c.lent));
        consistent(&c);
    }
}
