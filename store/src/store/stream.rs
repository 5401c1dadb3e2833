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
    /// One past the last block to read.
    end: usize,
    /// Reads that completed ahead of an earlier one, by first block.
    arrived: BTreeMap<usize, Vec<Block>>,
    blocks: VecDeque<Block>,
    next_block: usize,
    /// The current record of the front block.
    pub rec: usize,
    reads_in_flight: usize,
    /// Bytes of those reads.
    bytes_in_flight: usize,
    /// Read buffers blocks still point into, and spare ones to read into
    /// next (fresh buffers cost a zeroing pass and page faults).
    in_use: Vec<Rc<AlignedBuf>>,
    spare: Vec<AlignedBuf>,
    /// Records parsed so far, when it reads the whole segment: checked
    /// against the footer's count once every block is in.
    records: Option<u64>,
}

/// A segment whose blocks hold another number of records than its footer
/// says.
pub const RECORDS_DIFFER: &str = "record count differs from the footer";

/// Where a cursor is.
pub(super) enum At {
    Record,
    /// Its next block is still being read.
    Waiting,
    Finished,
}

impl Cursor {
    pub fn new(seg: Rc<Segment>, read_blocks: usize, max_reads: usize) -> Cursor {
        let end = seg.index.len();
        Cursor {
            seg,
            read_blocks: read_blocks.max(1),
            max_reads: max_reads.max(1),
            next_read: 0,
            end,
            arrived: BTreeMap::new(),
            blocks: VecDeque::new(),
            next_block: 0,
            rec: 0,
            reads_in_flight: 0,
            bytes_in_flight: 0,
            in_use: Vec::new(),
            spare: Vec::new(),
            records: Some(0),
        }
    }

    /// A cursor over only the blocks that may hold key groups `lo..=hi`
    /// (a restored layer is often a slice of a larger file).
    pub fn key_groups(
        seg: Rc<Segment>,
        lo: u16,
        hi: u16,
        read_blocks: usize,
        max_reads: usize,
    ) -> Cursor {
        let mut c = Cursor::new(seg, read_blocks, max_reads);
        let n = c.seg.index.len();
        let first = c.seg.index.find(&keys::key_group_start(lo)).unwrap_or(n);
        c.end = match hi.checked_add(1) {
            Some(next) => c
                .seg
                .index
                .find(&keys::key_group_start(next))
                .map_or(n, |b| b + 1),
            None => n,
        };
        c.next_read = first.min(c.end);
        c.next_block = c.next_read;
        c.records = None;
        c
    }

    /// Issues reads while fewer than a window of blocks is buffered or in
    /// flight; `token(first_block)` tags each.
    pub fn read_ahead<I: Io>(
        &mut self,
        reads: &mut super::tier::Reads<'_, I>,
        token: impl Fn(usize) -> u64,
    ) {
        let n = self.end;
        while self.reads_in_flight < self.max_reads && self.next_read < n {
            let buffered = self.blocks.len() + self.arrived.values().map(Vec::len).sum::<usize>();
            let window = self.read_blocks * self.max_reads;
            if buffered + self.reads_in_flight * self.read_blocks
                > window.saturating_sub(self.read_blocks / 2)
            {
                return;
            }
            let first = self.next_read;
            let (off, _) = self.seg.index.block(first);
            // `read_blocks` blocks, but no more bytes than that many
            // blocks of the target size: a block of one large record can
            // be 64 MiB, and 64 of them would make one read take 4 GiB
            // (at least one block, whatever its size).
            let cap = self.read_bytes();
            let mut last = first + 1;
            while last < (first + self.read_blocks).min(n) {
                let (loff, llen) = self.seg.index.block(last);
                if (loff + llen as u64 - off) as usize > cap {
                    break;
                }
                last += 1;
            }
            let (loff, llen) = self.seg.index.block(last - 1);
            let len = (loff + llen as u64 - off) as usize;
            // Nor more bytes held (being read, or read and not yet let
            // go) than the window's worth of target-size blocks plus the
            // read being consumed, once anything is: the next read starts
            // while the last is parsed (with `max_reads` 1 it would wait).
            let ahead = self.bytes_in_flight + self.in_use.iter().map(|b| b.len()).sum::<usize>();
            if ahead > 0 && ahead + len > cap * (self.max_reads + 1) {
                return;
            }
            self.next_read = last;
            self.reads_in_flight += 1;
            self.bytes_in_flight += len;
            let buf = match self.spare.pop() {
                Some(mut b) if b.capacity() >= len => {
                    b.set_len(len);
                    b
                }
                _ => AlignedBuf::zeroed(len),
            };
            let _ = reads.read(&self.seg, off, buf, token(first));
        }
    }

    /// A read that started at block `first` completed: its blocks are
    /// checked and queued (in block order).
    pub fn read_done(&mut self, first: usize, c: IoCompletion) -> Result<(), StoreError> {
        self.reads_in_flight -= 1;
        self.bytes_in_flight = self
            .bytes_in_flight
            .saturating_sub(c.buf.as_ref().map_or(0, |b| b.len()));
        if self.reads_in_flight == 0 {
            self.bytes_in_flight = 0;
        }
        let seg = &self.seg;
        let buf = match (c.result, c.buf) {
            (Ok(n), Some(b)) if n == b.len() => Rc::new(b),
            (Ok(_), _) => {
                return Err(corrupt(seg, seg.index.block(first).0, "short read"));
            }
            (Err(errno), _) => {
                return Err(crate::io::read_error(c.remote_error, &seg.path, errno));
            }
        };
        self.in_use.push(buf.clone());
        let base = seg.index.block(first).0;
        let mut blocks = Vec::new();
        let mut bi = first;
        while bi < self.end {
            let (off, len) = seg.index.block(bi);
            let rel = (off - base) as usize;
            if rel + len as usize > buf.len() {
                break;
            }
            let b = Block::parse_in(&buf, rel..rel + len as usize)
                .and_then(|b| seg.check_block(&b.view()).map(|()| b))
                .map_err(|m| corrupt(seg, off, m.0))?;
            // The whole segment's first key is in its smallest key group.
            if bi == 0
                && self.records.is_some()
                && !b.view().is_empty()
                && keys::key_group(b.view().key(0)) != seg.footer.min_kg
            {
                return Err(corrupt(seg, off, segment::KEY_GROUPS_OUTSIDE_FOOTER));
            }
            if let Some(n) = &mut self.records {
                *n += b.view().len() as u64;
            }
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
        if self.next_block >= self.end && self.records.is_some_and(|n| n != self.seg.footer.records)
        {
            return Err(corrupt(
                &self.seg,
                self.seg.file_len - ALIGN as u64,
                RECORDS_DIFFER,
            ));
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
            self.recycle();
        }
        match self.blocks.front() {
            Some(_) => At::Record,
            None if self.next_block >= self.end => At::Finished,
            None => At::Waiting,
        }
    }

    /// Bytes a read takes at most, unless one block is larger:
    /// `read_blocks` blocks of the target size.
    fn read_bytes(&self) -> usize {
        self.read_blocks * format::BLOCK_TARGET.next_power_of_two()
    }

    /// Takes back read buffers no block points into any more (not one a
    /// large block needed: it goes back to the allocator).
    fn recycle(&mut self) {
        let mut i = 0;
        while i < self.in_use.len() {
            if Rc::strong_count(&self.in_use[i]) == 1 {
                let b = self.in_use.swap_remove(i);
                if let Ok(b) = Rc::try_unwrap(b)
                    && b.capacity() <= self.read_bytes()
                    && self.spare.len() < self.max_reads
                {
                    self.spare.push(b);
                }
            } else {
                i += 1;
            }
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
