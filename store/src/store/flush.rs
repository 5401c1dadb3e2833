//! Flush: a frozen memtable sorted (see `crate::sorted`) and written into
//! a segment, both in time-bounded steps paced against the caller's
//! requests (see `crate::pace`).

use super::*;
use crate::sorted;

/// Units of sorting work (`sorted::Sort::step`) between looks at the
/// clock: tens of microseconds.
const SORT_UNITS: usize = 256;

impl<I: Io> Store<I> {
    pub(super) fn start_flush(&mut self) {
        if !self.flush_can_start() {
            // (A failed attempt's file is still being removed.)
            return;
        }
        let (order, mem) = self.frozen.last().expect("checked non-empty").clone();
        self.job_serial = (self.job_serial + 1) & SERIAL_MASK;
        let serial = self.job_serial;
        let writer = match SegmentWriter::create(
            &mut self.io,
            &self.cfg.dir,
            order,
            0,
            order,
            tag(Tag::FlushWrite, serial),
        ) {
            Ok(mut w) => {
                w.keep_blocks();
                w.expect_at_most(mem.len());
                w
            }
            Err(e) => {
                self.fail_flush_waiters(&e);
                return self.background_failed(e);
            }
        };
        // Every record is written, even those a mask hides: reads apply
        // masks by order, and a checkpoint taken before the mask was added
        // needs them; compaction drops them.
        let buffers = std::mem::take(&mut self.sort_buffers);
        let order = FlushOrder::Sorting(Box::new(sorted::Sort::new(&mem, buffers)));
        // Nothing older exists: tombstones have nothing to hide.
        let bottom = self.segments.is_empty();
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        self.flush = Some(FlushJob {
            mem,
            order,
            writer,
            bottom,
            syncing: false,
            scratch: Vec::new(),
            serial,
            id,
        });
        self.rebalance_cache();
    }

    pub(super) fn step_flush(&mut self) {
        self.step_flush_records();
        // What was just written is what reads want next (the frozen
        // memtable answered them until now); the file bypasses the page
        // cache, so without this every read after the flush would go to
        // the disk. It may evict: recent writes are the hot set.
        if let Some(j) = self.flush.as_mut() {
            for (n, buf) in j.writer.take_sealed() {
                if let Ok(b) = Block::parse(buf) {
                    self.cache.insert(j.id, n, Rc::new(b));
                }
            }
        }
    }

    fn step_flush_records(&mut self) {
        let work = self.cfg.work_per_poll;
        let deadline = self.step_deadline();
        let j = self.flush.as_mut().expect("called with a flush job");
        if j.syncing {
            return self.maybe_sync_flush();
        }
        if let Some(e) = j.writer.error.clone() {
            return self.abandon_flush(e);
        }
        // The sort takes steps of the same bound first (see `sorted`).
        let (addrs, next) = match &mut j.order {
            FlushOrder::Sorting(sort) => {
                while !sort.step(&j.mem, SORT_UNITS) {
                    if crate::clock::now() >= deadline {
                        return;
                    }
                }
                let sorted = sort.take_sorted();
                j.order = FlushOrder::Sorted(sorted, 0);
                return;
            }
            FlushOrder::Sorted(addrs, next) => (addrs, next),
        };
        // Write `work` records a step (waiting while the disk has the
        // writer's buffers), each record's loads started a few ahead.
        const AHEAD: usize = 8;
        for i in 0..work {
            if !j.writer.write_room() || out_of_time(i, deadline) {
                return;
            }
            let Some(addr) = addrs.get(*next) else {
                // Then the filter's last work, then it and the index
                // written, in steps of the same deadline.
                if !j.writer.finish_until(&mut self.io, deadline) {
                    return;
                }
                j.syncing = true;
                return self.maybe_sync_flush();
            };
            if let Some(a) = addrs.get(*next + AHEAD) {
                j.mem.prefetch_record(a);
            }
            *next += 1;
            j.scratch.clear();
            let mut kind = j.mem.resolve(addr, &mut j.scratch);
            if j.bottom {
                match kind {
                    Kind::Delete | Kind::Clear => continue,
                    Kind::Merge => kind = Kind::Put,
                    Kind::Put => {}
                }
            }
            let key = j.mem.key_of(addr);
            j.writer.add(&mut self.io, kind, key, &j.scratch);
        }
    }

    pub(super) fn maybe_sync_flush(&mut self) {
        let j = self.flush.as_mut().expect("flush job");
        if let Err(e) = j
            .writer
            .sync_if_written(&mut self.io, tag(Tag::FlushSync, j.serial))
        {
            self.abandon_flush(e);
        }
    }

    pub(super) fn flush_synced(&mut self, r: Result<usize, i32>) {
        let Some(j) = self.flush.as_mut() else { return };
        match j.writer.synced(&mut self.io, r) {
            Err(e) => return self.abandon_flush(e),
            // Data durable and the footer written: a second fsync follows.
            Ok(false) => return self.maybe_sync_flush(),
            Ok(true) => {}
        }
        let j = self.flush.take().expect("checked above");
        let order = self.frozen.last().expect("a flush has a frozen memtable").0;
        if let FlushOrder::Sorted(sorted, _) = j.order {
            self.sort_buffers = sorted.into_buffers();
        }
        let seg = Rc::new(j.writer.into_segment(j.id));
        // Newest first by order: a restore can have placed newer layers.
        let pos = self
            .segments
            .iter()
            .position(|s| s.footer.order < order)
            .unwrap_or(self.segments.len());
        self.segments.insert(pos, seg.clone());
        let (_, done) = self
            .frozen
            .pop()
            .expect("the flushed memtable is the oldest frozen one");
        debug_assert!(Arc::ptr_eq(&done, &j.mem));
        drop(j.mem);
        // The pool keeps what the memtables can still draw within the two
        // memtables' worth the budget plans (see `crate::reuse`): with
        // none other frozen, the rest of the active one and all of the
        // next. Keeping only the active one's rest left the next to fault
        // in fresh chunks until this flush's successor landed: an io-wq
        // worker zeroing pages took 11 % of the shard's core under
        // sustained puts.
        let frozen: usize = self.frozen.iter().map(|(_, m)| m.log_bytes()).sum();
        let keep = (2 * self.memtable_limit()).saturating_sub(frozen + self.active.log_bytes());
        crate::reuse::release(done, &self.reuse, keep);
        self.stats.flushes += 1;
        self.checkpoint_layer_flushed(&seg);
        self.sync_dir();
        self.stats.last_background_error = None;
        self.rebalance_cache();
    }

    pub(super) fn abandon_flush(&mut self, e: StoreError) {
        if let Some(j) = self.flush.take() {
            // Stop writing that file and unlink it; the frozen memtable
            // stays in memory (nothing is lost) and a later attempt writes
            // the file again, under the same name once the unlink is done
            // (`flush_can_start`).
            self.cache.forget_segment(j.id);
            self.io.close(j.writer.file);
            self.unlink(&j.writer.path);
        }
        self.fail_flush_waiters(&e);
        self.background_failed(e);
        self.rebalance_cache();
    }
}
