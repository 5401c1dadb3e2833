//! Size-tiered compaction of adjacent segments, in bounded steps.

use super::*;

/// Segments one compaction merges at most when working off a backlog
/// (each input holds a read window of [`COMPACT_READ_BLOCKS`] blocks).
const MAX_COMPACT_INPUTS: usize = 64;

impl<I: Io> Store<I> {
    pub(super) fn maybe_start_compaction(&mut self) {
        if self.stopping {
            return;
        }
        let mut t = self.cfg.compaction_trigger.max(2);
        let full = self.full_compaction_requested && self.segments.len() >= 2;
        if full {
            // A requested major compaction: every segment into one (the
            // request stands until it starts).
            // (Input numbers fit 12 bits of a read token.)
            t = self.segments.len().min(4095);
        } else if self.segments.len() < t {
            self.full_compaction_requested = false;
            return self.want_compaction(0);
        }
        // The newest window of `t` adjacent segments of similar size
        // (size-tiered: write amplification grows with log(data)).
        let sizes: Vec<u64> = self.segments.iter().map(|s| s.file_len.max(1)).collect();
        let mut window = full.then_some(0);
        for start in 0..=sizes.len() - t {
            if window.is_some() {
                break;
            }
            let w = &sizes[start..start + t];
            let (lo, hi) = (
                *w.iter().min().expect("t >= 2"),
                *w.iter().max().expect("t >= 2"),
            );
            if hi <= lo * 4 {
                window = Some(start);
                break;
            }
        }
        // A backlog (3t layers or more: many restores, an outage) is merged
        // many at once, up to [`MAX_COMPACT_INPUTS`], so it shrinks in a
        // few compactions rather than one per three layers, and reads and
        // restarts stop paying for every layer: a window of similar sizes
        // takes in the similar ones after it; without one, the newest go
        // together anyway.
        let n = self.segments.len();
        if !full && n >= t * 3 {
            let most = (n - 2 * t).clamp(t, MAX_COMPACT_INPUTS.max(t));
            match window {
                Some(start) => {
                    let (mut lo, mut hi) = sizes[start..start + t]
                        .iter()
                        .fold((u64::MAX, 0), |(l, h), &s| (l.min(s), h.max(s)));
                    while t < most && start + t < n {
                        let s = sizes[start + t];
                        if hi.max(s) > lo.min(s) * 4 {
                            break;
                        }
                        (lo, hi) = (lo.min(s), hi.max(s));
                        t += 1;
                    }
                }
                None => {
                    window = Some(0);
                    t = most;
                }
            }
        }
        let Some(start) = window else {
            return self.want_compaction(0);
        };
        let inputs: Vec<Rc<Segment>> = self.segments[start..start + t].to_vec();
        let bottom = start + t == self.segments.len();
        let order = inputs[0].footer.order;
        let generation = inputs
            .iter()
            .map(|s| s.footer.generation)
            .max()
            .expect("t >= 2")
            + 1;
        let min_order = inputs
            .iter()
            .map(|s| s.footer.min_order)
            .min()
            .expect("t >= 2");
        if self.unlink_pending(&self.cfg.dir.join(segment::file_name(order, generation))) {
            // A failed attempt's file is still being removed.
            return;
        }
        // The output's filter and index as built (no larger than the
        // inputs' together: the filter is sized for their records; they
        // are written in pieces through the writer's buffers), and each
        // input's read window.
        let reserve = inputs
            .iter()
            .map(|s| s.memory_bytes() + COMPACT_READ_BLOCKS * crate::aligned::ALIGN)
            .sum();
        if !self.compaction_fits(reserve) {
            return self.want_compaction(reserve);
        }
        self.want_compaction(0);
        self.trim_reuse_to_plan();
        self.job_serial = (self.job_serial + 1) & SERIAL_MASK;
        let serial = self.job_serial;
        let writer = match SegmentWriter::create(
            &mut self.io,
            &self.cfg.dir,
            order,
            generation,
            min_order,
            tag(Tag::CompactWrite, serial),
        ) {
            Ok(mut w) => {
                w.keep_blocks();
                w.expect_at_most(inputs.iter().map(|s| s.footer.records as usize).sum());
                // (A restored layer's clip shares its file's index, which
                // the reserve does not count: its part of the output grows
                // the index as it goes.)
                let whole = || inputs.iter().filter(|s| s.clip.is_none());
                w.expect_index_at_most(
                    whole().map(|s| s.index.len()).sum(),
                    whole().map(|s| s.index.key_bytes()).sum(),
                );
                w
            }
            // (A requested major compaction stands: it did not start.)
            Err(e) => return self.background_failed(e),
        };
        if full {
            self.full_compaction_requested = false;
        }
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        let cursors = inputs
            .iter()
            .map(|s| Cursor::new(s.clone(), COMPACT_READ_BLOCKS, 1))
            .collect();
        self.compact = Some(CompactJob {
            inputs,
            cursors,
            writer,
            bottom,
            clear: None,
            syncing: false,
            error: None,
            scratch: Vec::new(),
            serial,
            reserve,
            id,
            dropped: crate::dropped::DroppedFilter::new(self.dropped.clone()),
        });
        self.rebalance_cache();
    }

    pub(super) fn issue_compact_reads(&mut self) {
        let j = self.compact.as_mut().expect("compaction job");
        let serial = j.serial;
        let mut reads = tier::Reads {
            io: &mut self.io,
            tier: self.tier.as_mut(),
        };
        for (ci, c) in j.cursors.iter_mut().enumerate() {
            c.read_ahead(&mut reads, |first| {
                tag(
                    Tag::CompactRead,
                    (serial << 44) | ((ci as u64) << 32) | first as u64,
                )
            });
        }
    }

    pub(super) fn compact_read_done(&mut self, v: u64, c: IoCompletion) {
        let Some(j) = self.compact.as_mut().filter(|j| j.serial == v >> 44) else {
            // An abandoned compaction's read.
            return;
        };
        let (ci, first) = (((v >> 32) & 0xfff) as usize, (v & 0xffff_ffff) as usize);
        if let Err(e) = j.cursors[ci].read_done(first, c) {
            j.error.get_or_insert(e);
        }
    }

    pub(super) fn step_compaction(&mut self) {
        self.step_compaction_records();
        // The output's blocks replace the inputs' in the cache (which
        // forgets those at install) while there is room: the state stays
        // warm when it fits, and a larger-than-memory merge evicts nothing.
        if let Some(j) = self.compact.as_mut() {
            for (n, buf) in j.writer.take_sealed() {
                if let Ok(b) = Block::parse(buf) {
                    self.cache.insert_if_room(j.id, n, Rc::new(b));
                }
            }
        }
    }

    fn step_compaction_records(&mut self) {
        if let Some(e) = self
            .compact
            .as_ref()
            .and_then(|j| j.error.clone().or_else(|| j.writer.error.clone()))
        {
            return self.abandon_compaction(e);
        }
        if self.compact.as_ref().is_some_and(|j| j.syncing) {
            return self.maybe_sync_compaction();
        }
        self.issue_compact_reads();
        let work = self.cfg.work_per_poll;
        let kg_deletes = self.kg_deletes.clone();
        let deadline = self.step_deadline();
        let j = self.compact.as_mut().expect("compaction job");
        for i in 0..work {
            // The disk has the writer's buffers: wait for it.
            if !j.writer.write_room() || out_of_time(i, deadline) {
                return;
            }
            // Every unfinished input must have its current block loaded.
            if j.cursors.iter_mut().any(|c| matches!(c.at(), At::Waiting)) {
                return;
            }
            // The smallest current key, and every input holding it.
            let mut min: Option<&[u8]> = None;
            for c in &j.cursors {
                if let Some(b) = c.block() {
                    let k = b.view().record(c.rec).key;
                    if min.is_none_or(|m| k < m) {
                        min = Some(k);
                    }
                }
            }
            let Some(min) = min else {
                // The filter's last work, then it and the index
                // written, in steps of the same deadline.
                if !j.writer.finish_until(&mut self.io, deadline) {
                    return;
                }
                j.syncing = true;
                return self.maybe_sync_compaction();
            };
            let key = min.to_vec();
            let mut operands: Vec<Vec<u8>> = Vec::new();
            let mut result: Option<(Kind, Vec<u8>)> = None;
            // A dropped state's records are passed over in every input
            // (none may come back from an older one: no one reads them).
            let mut decided = j.dropped.drops(&key);
            let mut clear_rank = None;
            for (rank, c) in j.cursors.iter_mut().enumerate() {
                let (Some(b), at) = c.split() else { continue };
                if *at >= b.view().len() {
                    continue;
                }
                let rec = b.view().record(*at);
                if rec.key != &key[..] {
                    continue;
                }
                *at += 1;
                if decided {
                    continue;
                }
                let input = &j.inputs[rank];
                if input.clipped(&key) || masked_by(&kg_deletes, input.footer.order, &key) {
                    continue;
                }
                if cleared(&j.clear, &key, rank) {
                    continue;
                }
                match rec.kind {
                    Kind::Put => {
                        result = Some((Kind::Put, join(Some(rec.value), &operands)));
                        decided = true;
                    }
                    Kind::Delete => {
                        result = Some(if operands.is_empty() {
                            (Kind::Delete, Vec::new())
                        } else {
                            (Kind::Put, join(None, &operands))
                        });
                        decided = true;
                    }
                    Kind::Clear => {
                        result = Some((Kind::Clear, Vec::new()));
                        clear_rank = Some(rank);
                        decided = true;
                    }
                    Kind::Merge => operands.push(rec.value.to_vec()),
                }
            }
            if !decided && !operands.is_empty() {
                result = Some((
                    if j.bottom { Kind::Put } else { Kind::Merge },
                    join(None, &operands),
                ));
            }
            if let Some(r) = clear_rank {
                j.clear = Some((key.clone(), r));
            }
            let Some((kind, value)) = result else {
                continue;
            };
            if j.bottom && matches!(kind, Kind::Delete | Kind::Clear) {
                continue;
            }
            if value.len() > format::MAX_RECORD_VALUE {
                // Appends are capped (`list_cap`); only layers from
                // elsewhere could join into more than a record's length
                // holds. Fail the compaction (a background error, retried
                // and reported) rather than write a wrapped length.
                return self.abandon_compaction(StoreError::TooLarge {
                    what: "joined list",
                    len: value.len(),
                    max: format::MAX_RECORD_VALUE,
                });
            }
            j.scratch = value;
            j.writer.add(&mut self.io, kind, &key, &j.scratch);
        }
    }

    pub(super) fn maybe_sync_compaction(&mut self) {
        let j = self.compact.as_mut().expect("compaction job");
        if let Err(e) = j
            .writer
            .sync_if_written(&mut self.io, tag(Tag::CompactSync, j.serial))
        {
            self.abandon_compaction(e);
        }
    }

    pub(super) fn compact_synced(&mut self, r: Result<usize, i32>) {
        let Some(j) = self.compact.as_mut() else {
            return;
        };
        match j.writer.synced(&mut self.io, r) {
            Err(e) => return self.abandon_compaction(e),
            Ok(false) => return self.maybe_sync_compaction(),
            Ok(true) => {}
        }
        let j = self.compact.take().expect("checked above");
        let out = Rc::new(j.writer.into_segment(j.id));
        // The inputs leave by id and the output goes where its order says.
        let ids: Vec<u64> = j.inputs.iter().map(|s| s.id).collect();
        let (removed, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.segments)
            .into_iter()
            .partition(|s| ids.contains(&s.id));
        debug_assert_eq!(
            removed.len(),
            ids.len(),
            "inputs stay in the list while compacting"
        );
        self.segments = kept;
        self.segments.push(out);
        sort_layers(&mut self.segments);
        // The inputs' files go only after the output's directory entry is
        // durable, or a crash could find neither.
        self.awaiting_dir_sync.extend(removed);
        self.sync_dir();
        self.stats.compactions += 1;
        self.rebalance_cache();
    }

    pub(super) fn abandon_compaction(&mut self, e: StoreError) {
        self.drop_compaction();
        self.background_failed(e);
        self.rebalance_cache();
    }

    /// Ends the compaction in progress, if any, deleting its output. Its
    /// inputs stay in the layer list; reads of them still in flight are
    /// ignored when they complete (the serial no longer matches).
    pub(super) fn drop_compaction(&mut self) {
        if let Some(j) = self.compact.take() {
            self.cache.forget_segment(j.id);
            // Writes still in flight own buffers and finish first (a close
            // waits for them); the name goes off the shard.
            self.io.close(j.writer.file);
            self.unlink(&j.writer.path);
        }
    }
}
