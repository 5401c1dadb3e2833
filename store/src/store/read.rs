//! Point reads: memtables first, then segments through the block cache,
//! with one shared block read for every read waiting on the same block.

use super::*;

impl<I: Io> Store<I> {
    /// Submits one operation. Writes and reads that memory answers return
    /// `Ready`; the rest complete through [`Store::poll`] with `token`.
    pub fn submit(&mut self, token: u64, op: Op<'_>) -> Result<Submitted<'_>, StoreError> {
        if !op.is_read() {
            self.check_memory()?;
            self.apply_write(&op)?;
            self.after_write();
            return Ok(Submitted::Ready(Output::Done));
        }
        if let Op::MapIter {
            map,
            mode,
            after,
            max_bytes,
        } = op
        {
            return self.submit_iter(token, map, mode, after, max_bytes);
        }
        // Keys are encoded on the stack: a read that memory answers
        // allocates nothing.
        let (kind, key, base_len) = match op {
            Op::Get(k) => (ReadKind::Get, KeyBuf::encode(&k, None)?, 0),
            Op::ListGet(k) => (ReadKind::ListGet, KeyBuf::encode(&k, None)?, 0),
            Op::MapGet(k, u) => {
                let key = KeyBuf::encode(&k, Some(u))?;
                (
                    ReadKind::MapGet,
                    key,
                    keys::HEADER_LEN + k.key.len() + 4 + k.namespace.len(),
                )
            }
            Op::MapContains(k, u) => {
                let key = KeyBuf::encode(&k, Some(u))?;
                (
                    ReadKind::MapContains,
                    key,
                    keys::HEADER_LEN + k.key.len() + 4 + k.namespace.len(),
                )
            }
            _ => unreachable!("is_read() covers exactly these"),
        };
        let h = bloom::hash(key.as_slice());
        self.read_key(token, kind, key.as_slice(), h, base_len, None)
    }

    /// Submits many operations at once, as a shard drains its queue: the
    /// memtable slots and records of the gets and puts in the batch are
    /// fetched a window ahead of their use, so the memory latency of a
    /// large working set overlaps across the batch instead of adding up.
    /// `out(i, result)` is called for each op, in order, with what
    /// [`Store::submit`] would return; pending ones complete via `poll` with
    /// `tokens[i]`. Effects take place in batch order.
    pub fn submit_batch(
        &mut self,
        tokens: &[u64],
        ops: &[Op<'_>],
        mut out: impl FnMut(usize, Result<Submitted<'_>, StoreError>),
    ) {
        // All keys of the batch in one reused buffer: (start, end, hash).
        let mut keys = std::mem::take(&mut self.batch_keys);
        let mut spans = std::mem::take(&mut self.batch_spans);
        keys.clear();
        spans.clear();
        for op in ops {
            let start = keys.len();
            // Gets and every write of one key: what a task sends most.
            let keyed = match op {
                Op::Get(k)
                | Op::Put(k, _)
                | Op::Delete(k)
                | Op::ListAppend(k, _)
                | Op::ListAppendAll(k, _)
                | Op::ListReplace(k, _)
                | Op::Clear(k, _) => Some((k, None)),
                Op::MapPut(k, u, _) | Op::MapRemove(k, u) => Some((k, Some(*u))),
                _ => None,
            };
            if let Some((k, user_key)) = keyed
                && check_key(k).is_ok()
            {
                keys::encode_base(&mut keys, k.key_group, k.state, k.key, k.namespace);
                keys.extend_from_slice(user_key.unwrap_or_default());
            }
            let h = bloom::hash(&keys[start..]);
            spans.push((start, keys.len(), h));
        }
        // A software pipeline: while op i runs, the slot of op i + 2D and
        // the record of op i + D (whose slot has arrived by then) load, so
        // about 2D misses are in flight and none is waited for twice. For
        // a get, the frozen memtables' slots and the newest segments'
        // filter lines load at i + 2D too; one that no memtable's home
        // slot holds (most likely in none) is located in the segments at
        // i + D, and its cached block's slot, entry and first lines load
        // at i + D, i + E and i + B: a read of a flushed key waits for its
        // block's lines once, not for each step of the walk in turn.
        const D: usize = 8;
        const E: usize = 5;
        const B: usize = 2;
        let ahead = !self.segments.is_empty();
        let is_get = |j: usize| matches!(ops.get(j), Some(Op::Get(_)));
        let mut staged = [Ahead::None; 2 * D];
        let first = |me: &Self, j: usize| {
            if let Some(&(start, end, h)) = spans.get(j)
                && end > start
            {
                me.active.prefetch(h);
                if is_get(j) {
                    for (_, m) in &me.frozen {
                        m.prefetch(h);
                    }
                    for seg in me.segments.iter().rev().take(FILTERS_AHEAD) {
                        seg.filter.prefetch(h);
                    }
                }
            }
        };
        let second = |me: &Self, j: usize, staged: &mut [Ahead; 2 * D]| {
            let Some(&(start, end, h)) = spans.get(j) else {
                return;
            };
            if end == start {
                return;
            }
            let in_active = me.active.prefetch_found(h);
            if !is_get(j) {
                return;
            }
            // Every frozen one's record loads too (not only the first).
            let in_frozen = me
                .frozen
                .iter()
                .fold(false, |any, (_, m)| m.prefetch_found(h) | any);
            if ahead && !in_active && !in_frozen && end - start <= keys::MAX_KEY_LEN {
                staged[j % (2 * D)] = me.locate_ahead(&keys[start..end], h);
            }
        };
        let step = |me: &Self, j: usize, staged: &mut [Ahead; 2 * D]| {
            let a = &mut staged[j % (2 * D)];
            *a = me.cache.advance(*a);
        };
        for j in 0..2 * D {
            first(self, j);
        }
        for j in 0..D {
            second(self, j, &mut staged);
        }
        for j in 0..E {
            step(self, j, &mut staged);
        }
        for j in 0..B {
            step(self, j, &mut staged);
        }
        for (i, op) in ops.iter().enumerate() {
            first(self, i + 2 * D);
            second(self, i + D, &mut staged);
            step(self, i + E, &mut staged);
            step(self, i + B, &mut staged);
            let hint = self
                .cache
                .take(std::mem::replace(&mut staged[i % (2 * D)], Ahead::None));
            let (start, end, h) = spans[i];
            let key = &keys[start..end];
            if end == start || key.len() > keys::MAX_KEY_LEN {
                // Another kind of op, or a key the checks refuse: the
                // general path gives the right result or error.
                out(i, self.submit(tokens[i], *op));
                continue;
            }
            match op {
                Op::Get(_) => out(i, self.read_key(tokens[i], ReadKind::Get, key, h, 0, hint)),
                _ => {
                    let r = self
                        .check_memory()
                        .and_then(|()| self.apply_keyed(op, key, h));
                    if r.is_ok() {
                        self.after_write();
                    }
                    out(i, r.map(|()| Submitted::Ready(Output::Done)));
                }
            }
        }
        self.batch_keys = keys;
        self.batch_spans = spans;
    }

    pub(super) fn read_key(
        &mut self,
        token: u64,
        kind: ReadKind,
        key: &[u8],
        h: u64,
        base_len: usize,
        hint: Option<Hint>,
    ) -> Result<Submitted<'_>, StoreError> {
        let hb = if base_len > 0 {
            bloom::hash(&key[..base_len])
        } else {
            0
        };
        let mut operands: Vec<Vec<u8>> = Vec::new();
        // Memtables: the active one, then the frozen ones, newest first.
        match self.mem_lookup(kind, key, h, base_len, hb, &mut operands) {
            Some(Immediate::ActiveValue(addr)) => {
                let v = self.active.record(addr).value;
                return Ok(Submitted::Ready(match kind {
                    ReadKind::MapContains => Output::Contains(true),
                    _ => Output::Value(Some(v)),
                }));
            }
            Some(Immediate::Frozen(i, addr)) => {
                let v = self.frozen[i].1.record(addr).value;
                return Ok(Submitted::Ready(match kind {
                    ReadKind::MapContains => Output::Contains(true),
                    _ => Output::Value(Some(v)),
                }));
            }
            Some(Immediate::Resolved(r)) => return Ok(Submitted::Ready(self.hold(r))),
            None => {}
        }
        let mut layers: Vec<Rc<Segment>> = self.segments.iter().rev().cloned().collect();
        if layers.is_empty() {
            let r = finish_operands(kind, &operands);
            return Ok(Submitted::Ready(self.hold(r)));
        }
        // Try to finish from the cache without allocating a pending slot.
        let mut read = PendingRead {
            token,
            kind,
            key: key.to_vec(),
            h,
            base_len,
            hb,
            layers: Vec::new(),
            operands,
            stage: 0,
            hint,
        };
        std::mem::swap(&mut read.layers, &mut layers);
        match self.advance(&mut read) {
            Step::Done(r) => Ok(Submitted::Ready(self.hold(r))),
            Step::Wait(seg, block) => {
                let id = self.reads.insert(read);
                self.fetch(seg, block, Some(id), None);
                Ok(Submitted::Pending)
            }
        }
    }

    /// Where a get the memtables do not answer looks first (the walk of
    /// [`Store::advance`], ahead of time): the newest layer whose filter
    /// admits `key` and the block its index names, whose cache slot starts
    /// loading (see [`BlockCache::ahead`]). `Ahead::None` when no layer
    /// may hold the key or a mask decides first.
    fn locate_ahead(&self, key: &[u8], h: u64) -> Ahead {
        for seg in self.segments.iter().rev() {
            if seg.clipped(key) {
                continue;
            }
            if self.masked_order(seg.footer.order, key) {
                return Ahead::None;
            }
            if seg.may_contain(key, h)
                && let Some(bi) = seg.index.find(key)
            {
                return self.cache.ahead(seg.id, bi as u32);
            }
        }
        Ahead::None
    }

    /// Keeps what an immediate output borrows alive until the next call.
    pub(super) fn hold(&mut self, r: Resolved) -> Output<'_> {
        match r {
            Resolved::Done => Output::Done,
            Resolved::NotFound => Output::Value(None),
            Resolved::Contains(b) => Output::Contains(b),
            Resolved::Imported(i) => Output::Imported(i),
            Resolved::Owned(v) => {
                self.scratch = v;
                Output::Value(Some(&self.scratch))
            }
            Resolved::Block(b, range) => {
                let b = self.held_block.insert(b);
                Output::Value(Some(&b.bytes()[range]))
            }
            Resolved::Page {
                data,
                entries,
                last_key,
                more,
            } => {
                self.scratch = data;
                let split = self.scratch.len();
                self.scratch.extend_from_slice(&last_key);
                let (d, l) = self.scratch.split_at(split);
                Output::Page {
                    data: d,
                    entries,
                    last_key: l,
                    more,
                }
            }
        }
    }

    /// Consults the memtables. `Some` when they decide the read.
    pub(super) fn mem_lookup(
        &self,
        kind: ReadKind,
        key: &[u8],
        h: u64,
        base_len: usize,
        hb: u64,
        operands: &mut Vec<Vec<u8>>,
    ) -> Option<Immediate> {
        let layers = std::iter::once((u64::MAX, &self.active))
            .chain(self.frozen.iter().map(|(o, m)| (*o, &**m)));
        for (li, (order, mem)) in layers.enumerate() {
            if order != u64::MAX && self.masked_order(order, key) {
                // A mask removed this and every older memtable. Segments a
                // restore added since are newer, so the segments decide
                // (the first masked one ends the read).
                return None;
            }
            if let Some(addr) = mem.lookup_addr(key, h) {
                let rec = mem.record(addr);
                match rec.kind {
                    Kind::Put if operands.is_empty() => {
                        return Some(if kind == ReadKind::MapContains {
                            Immediate::Resolved(Resolved::Contains(true))
                        } else if li == 0 {
                            Immediate::ActiveValue(addr)
                        } else {
                            Immediate::Frozen(li - 1, addr)
                        });
                    }
                    Kind::Put | Kind::Delete | Kind::Clear | Kind::Merge => {
                        // Walk the chain: operands until a Put or Delete.
                        let mut cur = Some(addr);
                        while let Some(a) = cur {
                            let r = mem.record(a);
                            match r.kind {
                                Kind::Merge => {
                                    operands.push(r.value.to_vec());
                                    cur = r.prev;
                                }
                                Kind::Put => {
                                    return Some(Immediate::Resolved(finish_value(
                                        kind,
                                        Some(r.value),
                                        operands,
                                    )));
                                }
                                Kind::Delete | Kind::Clear => {
                                    return Some(Immediate::Resolved(finish_value(
                                        kind, None, operands,
                                    )));
                                }
                            }
                        }
                        // Chain ended inside this layer: older layers hold the base.
                        continue;
                    }
                }
            }
            if base_len > 0
                && let Some(r) = mem.lookup(&key[..base_len], hb)
                && r.kind == Kind::Clear
            {
                return Some(Immediate::Resolved(finish_value(kind, None, operands)));
            }
        }
        None
    }

    /// Evaluates a read against its remaining segments until it is decided
    /// or needs a block that is not in memory.
    pub(super) fn advance(&mut self, r: &mut PendingRead) -> Step {
        while let Some(seg) = r.layers.last().cloned() {
            if seg.clipped(&r.key) {
                // Not this layer's part of the key space; older ones may hold it.
                r.layers.pop();
                r.stage = 0;
                continue;
            }
            if self.masked_order(seg.footer.order, &r.key) {
                // A mask removed this and every older layer.
                return Step::Done(finish_operands(r.kind, &r.operands));
            }
            let (probe_len, ph) = if r.stage == 0 {
                (r.key.len(), r.h)
            } else {
                (r.base_len, r.hb)
            };
            let probe = &r.key[..probe_len];
            let mut next_layer = true;
            // Resumed with the block this layer's probe waited for: its
            // filter and index were consulted before the wait.
            // Or located ahead in a batch (`locate_ahead`), which may have
            // passed newer layers: the hint waits for its own.
            let located = match &r.hint {
                Some((sid, _, _)) if *sid == seg.id => {
                    let (_, b, blk) = r.hint.take().expect("matched");
                    Some((b as usize, Some(blk)))
                }
                _ if seg.may_contain(probe, ph) => seg.index.find(probe).map(|bi| (bi, None)),
                _ => None,
            };
            if let Some((bi, hinted)) = located {
                let block = match hinted {
                    Some(b) => Some(b),
                    None => self.cache.get(seg.id, bi as u32),
                };
                let Some(block) = block else {
                    return Step::Wait(seg, bi as u32);
                };
                let view = block.view();
                if let Some(rec) = view.find(probe) {
                    match (r.stage, rec.kind) {
                        (0, Kind::Put) => {
                            if r.operands.is_empty() && r.kind != ReadKind::MapContains {
                                let range = view.value_range(&rec);
                                return Step::Done(Resolved::Block(block.clone(), range));
                            }
                            return Step::Done(finish_value(r.kind, Some(rec.value), &r.operands));
                        }
                        (0, Kind::Delete) | (0, Kind::Clear) => {
                            return Step::Done(finish_value(r.kind, None, &r.operands));
                        }
                        (0, Kind::Merge) => {
                            r.operands.push(rec.value.to_vec());
                        }
                        (_, Kind::Clear) => {
                            return Step::Done(finish_value(r.kind, None, &r.operands));
                        }
                        _ => {}
                    }
                } else if r.stage == 0 && r.base_len > 0 {
                    next_layer = false;
                }
            } else if r.stage == 0 && r.base_len > 0 {
                next_layer = false;
            }
            if next_layer || r.stage == 1 {
                r.layers.pop();
                r.stage = 0;
            } else {
                r.stage = 1;
            }
        }
        Step::Done(finish_operands(r.kind, &r.operands))
    }

    pub(super) fn fetch(
        &mut self,
        seg: Rc<Segment>,
        block: u32,
        read: Option<usize>,
        iter: Option<usize>,
    ) {
        if let Some(&fi) = self.fetch_index.get(&(seg.id, block)) {
            let f = &mut self.fetches[fi];
            f.reads.extend(read);
            f.iters.extend(iter);
            return;
        }
        let fi = self.fetches.insert(Fetch {
            seg: seg.clone(),
            block,
            reads: read.into_iter().collect(),
            iters: iter.into_iter().collect(),
            local: true,
            retried: false,
        });
        self.fetch_index.insert((seg.id, block), fi);
        if self.fetches_waiting.is_empty() && self.read_room(fi) {
            self.issue_fetch(fi);
        } else {
            self.fetches_waiting.push_back(fi);
        }
    }

    /// Whether fetch `fi`'s read may be issued now: the buffers of reads
    /// in flight are the cache's (see `BlockCache::buffer`), and issued
    /// beyond its budget they would pass the memory budget (thousands of
    /// gets that miss the cache, at 4 KiB each, held 64 MiB against a
    /// cache squeezed to 27 in a full `stator-bench load` run). At least
    /// [`MIN_READ_BYTES`] of reads are let through, and one always.
    fn read_room(&self, fi: usize) -> bool {
        let f = &self.fetches[fi];
        let len = f.seg.index.block(f.block as usize).1 as usize;
        let lent = self.cache.lent();
        lent == 0 || lent + len <= self.cache.budget().max(MIN_READ_BYTES)
    }

    /// Issues the fetches waiting for [`Store::read_room`], in order.
    fn issue_waiting_fetches(&mut self) {
        while let Some(&fi) = self.fetches_waiting.front() {
            if !self.read_room(fi) {
                return;
            }
            self.fetches_waiting.pop_front();
            self.issue_fetch(fi);
        }
    }

    /// Reads fetch `fi`'s block, from the local disk or the remote tier.
    fn issue_fetch(&mut self, fi: usize) {
        let f = &mut self.fetches[fi];
        let (off, len) = f.seg.index.block(f.block as usize);
        self.stats.block_reads += 1;
        let cache = &mut self.cache;
        f.local = !tier::Reads {
            io: &mut self.io,
            tier: self.tier.as_mut(),
        }
        .read_block(
            &f.seg,
            off,
            len as usize,
            tag(Tag::Fetch, fi as u64),
            || cache.buffer(len as usize),
        );
    }

    pub(super) fn fetch_done(&mut self, fi: usize, c: IoCompletion) {
        let f = self.fetches.remove(fi);
        self.fetch_index.remove(&(f.seg.id, f.block));
        let (off, len) = f.seg.index.block(f.block as usize);
        if f.local {
            // The buffer the cache lent is the block's now, or dropped.
            self.cache.read_done(len as usize);
            self.issue_waiting_fetches();
        }
        // Every local read returns what it was lent: a leak here would
        // shrink the cache for good.
        debug_assert!(self.fetches.len() > 0 || self.cache.lent() == 0);
        debug_assert!(self.fetches_waiting.is_empty() || self.cache.lent() > 0);
        let result = match (c.result, c.buf, c.remote_block) {
            (Ok(n), Some(buf), _) if n == len as usize => Block::parse(buf)
                .and_then(|b| f.seg.check_block(&b.view()).map(|()| Rc::new(b)))
                .map_err(|m| corrupt(&f.seg, off, m.0)),
            // Fetched remotely: checked on the remote runtime, in the bytes
            // the client fetched.
            (Ok(n), None, Some(b)) if n == len as usize => b
                .and_then(|b| f.seg.check_block(&b.view()).map(|()| Rc::new(b)))
                .map_err(|m| corrupt(&f.seg, off, m.0)),
            (Ok(_), _, _) => Err(corrupt(
                &f.seg,
                off,
                "short read: block beyond the end of the file",
            )),
            (Err(errno), _, _) => Err(crate::io::read_error(c.remote_error, &f.seg.path, errno)),
        };
        // A local block of a segment durable remotely that fails its
        // checksum is read again from the remote (once; also a read that
        // raced an eviction's punch).
        if matches!(result, Err(StoreError::Corrupt { .. }))
            && f.local
            && !f.retried
            && self.remote_copy_for(&f.seg)
        {
            let key = (f.seg.id, f.block);
            let mut f = f;
            f.retried = true;
            let fi = self.fetches.insert(f);
            self.fetch_index.insert(key, fi);
            self.issue_fetch(fi);
            return;
        }
        match result {
            Ok(block) => {
                self.cache.insert(f.seg.id, f.block, block.clone());
                for id in f.reads {
                    let mut r = self.reads.remove(id);
                    r.hint = Some((f.seg.id, f.block, block.clone()));
                    match self.advance(&mut r) {
                        Step::Done(res) => self.done.push_back((r.token, Ok(res))),
                        Step::Wait(seg, b) => {
                            r.hint = None;
                            let id = self.reads.insert(r);
                            self.fetch(seg, b, Some(id), None);
                        }
                    }
                }
                for id in f.iters {
                    self.iters[id]
                        .pinned
                        .insert((f.seg.id, f.block), block.clone());
                    self.run_iter(id);
                }
            }
            Err(e) => {
                for id in f.reads {
                    let r = self.reads.remove(id);
                    self.done.push_back((r.token, Err(e.clone())));
                }
                for id in f.iters {
                    let it = self.iters.remove(id);
                    self.done.push_back((it.token, Err(e.clone())));
                }
            }
        }
    }
}
