//! The block cache: validated data blocks by (segment, block number), under
//! a byte budget, evicted with CLOCK (a referenced bit per entry, cleared
//! as the hand passes; an unreferenced entry is evicted). Blocks are
//! reference-counted, so a read in progress keeps its block even if the
//! cache lets go of it.

use std::collections::HashMap;
use std::rc::Rc;

use crate::aligned::AlignedBuf;
use crate::format::{BlockView, Malformed};

/// A data block that passed its checksum, with its record table located.
pub struct Block {
    buf: Bytes,
    offs_at: usize,
    n: usize,
}

/// A block's bytes: a buffer of its own (cached blocks), or a range of a
/// larger read shared by the blocks it holds (streaming reads: compaction
/// and export parse in place instead of copying every block out).
enum Bytes {
    Own(AlignedBuf),
    Shared(Rc<AlignedBuf>, std::ops::Range<usize>),
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

    pub fn bytes(&self) -> &[u8] {
        match &self.buf {
            Bytes::Own(b) => b,
            Bytes::Shared(b, r) => &b[r.clone()],
        }
    }

    pub fn memory_bytes(&self) -> usize {
        match &self.buf {
            Bytes::Own(b) => b.capacity() + 64,
            Bytes::Shared(_, r) => r.len() + 64,
        }
    }
}

struct Entry {
    key: (u64, u32),
    block: Rc<Block>,
    referenced: bool,
}

/// CLOCK cache of blocks.
pub struct BlockCache {
    map: HashMap<(u64, u32), usize>,
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    hand: usize,
    bytes: usize,
    budget: usize,
    pub hits: u64,
    pub misses: u64,
}

impl BlockCache {
    pub fn new(budget: usize) -> BlockCache {
        BlockCache {
            map: HashMap::new(),
            entries: Vec::new(),
            free: Vec::new(),
            hand: 0,
            bytes: 0,
            budget,
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, seg: u64, block: u32) -> Option<Rc<Block>> {
        match self.map.get(&(seg, block)) {
            Some(&i) => {
                self.hits += 1;
                let e = self.entries[i]
                    .as_mut()
                    .expect("mapped entries are occupied");
                e.referenced = true;
                Some(e.block.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// A cached block without touching its CLOCK bit or the counters.
    pub fn peek_entry(&self, seg: u64, block: u32) -> Option<Rc<Block>> {
        self.map.get(&(seg, block)).map(|&i| {
            self.entries[i]
                .as_ref()
                .expect("mapped entries are occupied")
                .block
                .clone()
        })
    }

    pub fn insert(&mut self, seg: u64, block: u32, b: Rc<Block>) {
        if self.budget == 0 || self.map.contains_key(&(seg, block)) {
            return;
        }
        let size = b.memory_bytes();
        while self.bytes + size > self.budget && !self.map.is_empty() {
            self.evict_one();
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
        self.map.insert((seg, block), i);
        self.bytes += size;
    }

    fn evict_one(&mut self) {
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
            let e = self.entries[i].take().expect("checked occupied");
            self.map.remove(&e.key);
            self.bytes -= e.block.memory_bytes();
            self.free.push(i);
            return;
        }
    }

    /// Drops every block of segment `seg` (it was deleted).
    pub fn forget_segment(&mut self, seg: u64) {
        for i in 0..self.entries.len() {
            if self.entries[i].as_ref().is_some_and(|e| e.key.0 == seg) {
                let e = self.entries[i].take().expect("checked occupied");
                self.map.remove(&e.key);
                self.bytes -= e.block.memory_bytes();
                self.free.push(i);
            }
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        while self.bytes > self.budget && !self.map.is_empty() {
            self.evict_one();
        }
    }
}
