//! Streaming a segment front to back (compaction inputs, snapshot export):
//! large reads issued ahead, blocks parsed in place inside each read.

use super::*;

/// One segment read in key order.
pub(super) struct Cursor {
    pub seg: Rc<Segment>,
    /// Blocks per read, and reads in flight at most.
    read_blocks: usize,
    max_reads: usize,
    next_read: usize,
    /// Reads that completed ahead of an earlier one, by first block.
    arrived: BTreeMap<usize, Vec<Block>>,
    blocks: VecDeque<Block>,
    next_block: usize,
    /// The current record of the front block.
    pub rec: usize,
    reads_in_flight: usize,
}

/// Where a cursor is.
pub(super) enum At {
    Record,
    /// Its next block is still being read.
    Waiting,
    Finished,
}

impl Cursor {
    pub fn new(seg: Rc<Segment>, read_blocks: usize, max_reads: usize) -> Cursor {
        Cursor {
            seg,
            read_blocks: read_blocks.max(1),
            max_reads: max_reads.max(1),
            next_read: 0,
            arrived: BTreeMap::new(),
            blocks: VecDeque::new(),
            next_block: 0,
            rec: 0,
            reads_in_flight: 0,
        }
    }

    /// Issues reads while fewer than a window of blocks is buffered or in
    /// flight; `token(first_block)` tags each.
    pub fn read_ahead<I: Io>(&mut self, io: &mut I, token: impl Fn(usize) -> u64) {
        let n = self.seg.index.len();
        while self.reads_in_flight < self.max_reads && self.next_read < n {
            let buffered = self.blocks.len() + self.arrived.values().map(Vec::len).sum::<usize>();
            let window = self.read_blocks * self.max_reads;
            if buffered + self.reads_in_flight * self.read_blocks
                > window.saturating_sub(self.read_blocks / 2)
            {
                return;
            }
            let first = self.next_read;
            let last = (first + self.read_blocks).min(n);
            let (off, _) = self.seg.index.block(first);
            let (loff, llen) = self.seg.index.block(last - 1);
            let len = (loff + llen as u64 - off) as usize;
            self.next_read = last;
            self.reads_in_flight += 1;
            io.read(self.seg.file, off, AlignedBuf::zeroed(len), token(first));
        }
    }

    /// A read that started at block `first` completed: its blocks are
    /// checked and queued (in block order).
    pub fn read_done(&mut self, first: usize, c: IoCompletion) -> Result<(), StoreError> {
        self.reads_in_flight -= 1;
        let seg = &self.seg;
        let buf = match (c.result, c.buf) {
            (Ok(n), Some(b)) if n == b.len() => Rc::new(b),
            (Ok(_), _) => {
                return Err(corrupt(seg, seg.index.block(first).0, "short read"));
            }
            (Err(errno), _) => return Err(StoreError::from_errno(&seg.path, "read", errno)),
        };
        let base = seg.index.block(first).0;
        let mut blocks = Vec::new();
        let mut bi = first;
        while bi < seg.index.len() {
            let (off, len) = seg.index.block(bi);
            let rel = (off - base) as usize;
            if rel + len as usize > buf.len() {
                break;
            }
            let b = Block::parse_in(&buf, rel..rel + len as usize)
                .map_err(|m| corrupt(seg, off, m.0))?;
            blocks.push(b);
            bi += 1;
        }
        self.arrived.insert(first, blocks);
        while let Some(e) = self.arrived.first_entry() {
            if *e.key() != self.next_block {
                break;
            }
            let bs = e.remove();
            self.next_block += bs.len();
            self.blocks.extend(bs);
        }
        Ok(())
    }

    /// Steps past exhausted blocks and says where the cursor is.
    pub fn at(&mut self) -> At {
        while self
            .blocks
            .front()
            .is_some_and(|b| self.rec >= b.view().len())
        {
            self.blocks.pop_front();
            self.rec = 0;
        }
        match self.blocks.front() {
            Some(_) => At::Record,
            None if self.next_block >= self.seg.index.len() => At::Finished,
            None => At::Waiting,
        }
    }

    pub fn reads_in_flight(&self) -> usize {
        self.reads_in_flight
    }

    /// The current record's block, if one is loaded and not exhausted
    /// (after `at` said `Record`).
    pub fn block(&self) -> Option<&Block> {
        self.blocks.front().filter(|b| self.rec < b.view().len())
    }

    /// The front block and the record counter, borrowed apart (a record
    /// stays borrowed while the cursor moves past it).
    pub fn split(&mut self) -> (Option<&Block>, &mut usize) {
        (self.blocks.front(), &mut self.rec)
    }
}
