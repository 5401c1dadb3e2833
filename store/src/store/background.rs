//! Polling: I/O completions, bounded background steps, deferred deletes,
//! and delivery of finished operations.

use super::*;
use checkpoint::ManifestIo;

impl<I: Io> Store<I> {
    /// Submits queued I/O, reaps completions, advances background work by a
    /// bounded step, and delivers finished operations to `on_done`. Returns
    /// how many were delivered.
    pub fn poll(&mut self, mut on_done: impl FnMut(u64, Result<Output<'_>, StoreError>)) -> usize {
        self.drive_io();
        self.background();
        let _ = self.io.submit();
        if let Some(t) = self.tier.as_mut() {
            // This pass's misses, coalesced by the client.
            t.send();
        }
        let mut n = 0;
        while let Some((token, r)) = self.done.pop_front() {
            n += 1;
            match r {
                Ok(res) => on_done(token, Ok(resolved_output(&res))),
                Err(e) => on_done(token, Err(e)),
            }
        }
        n
    }

    /// Blocks until I/O completes or `timeout` passes (when nothing is
    /// ready to deliver).
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<(), StoreError> {
        // Completions an earlier pass reaped and left wait to be finished.
        if !self.done.is_empty() || !self.completions.is_empty() {
            return Ok(());
        }
        let mut timeout = timeout;
        if let Some(t) = self.tier.as_ref().filter(|t| t.outstanding() > 0) {
            if self.io.in_flight() == 0 {
                t.remote.wait(timeout.unwrap_or(Duration::from_secs(1)));
                return Ok(());
            }
            // Both may answer: look at each often.
            timeout = Some(timeout.map_or(Duration::from_millis(1), |d| {
                d.min(Duration::from_millis(1))
            }));
        }
        self.io
            .wait(timeout)
            .map_err(|e| StoreError::io(&self.cfg.dir, "wait", &e))
    }

    /// Runs `poll` until every submitted operation is delivered and, with
    /// `background`, until flushes and compactions are done.
    pub fn drain(
        &mut self,
        background: bool,
        mut on_done: impl FnMut(u64, Result<Output<'_>, StoreError>),
    ) {
        // No request is served while draining: background steps are not
        // paced (a pacer left owing time by the last busy pass would
        // otherwise never let a shutdown's flush step again), nor cut
        // short for requests that will not come.
        self.pacer.unpace();
        loop {
            self.poll(&mut on_done);
            let idle = self.pending() == 0 && (!background || !self.busy());
            if idle {
                return;
            }
            if self.retry_at.is_some() && background && self.pending() == 0 {
                // A failing background job would retry forever; stop here.
                return;
            }
            // Steps are bounded by time: with CPU work ready, a wait after
            // each would make a drain (a shutdown's) mostly sleep.
            if !self.background_runnable() {
                let _ = self.wait(Some(Duration::from_millis(5)));
            }
        }
    }

    /// Freezes the active memtable so it is flushed (for tests, checkpoints
    /// and shutdown).
    pub fn flush(&mut self) {
        self.freeze();
    }

    pub(super) fn drive_io(&mut self) {
        let _ = self.io.submit();
        let mut cs = std::mem::take(&mut self.completions);
        self.io.reap(&mut cs);
        if let Some(t) = self.tier.as_mut() {
            t.send();
            t.reap(&mut cs);
        }
        self.issue_writebacks();
        // A software pipeline over the pass's block fetches: the fetch's
        // entry loads 2D completions ahead, then (D ahead, the entry in
        // cache by then) its first read's entry and the block's header and
        // record table, so their misses overlap instead of adding up.
        const D: usize = 4;
        // A bounded number of local block reads is finished per pass; the
        // rest wait in `completions` for the next one. Each read finished
        // leaves the device a read short until the caller has taken the
        // result and sent the next request, so finishing a whole burst
        // first (with deferred completions, most of the reads in flight
        // arrive together) lets the device's queue run dry. An eighth of
        // the reads in flight, at least `disk_reads_per_poll`: the device
        // keeps most of its queue, and with hundreds in flight the passes
        // stay few (see StoreConfig::disk_reads_per_poll).
        let cap = self
            .cfg
            .disk_reads_per_poll
            .max(self.fetches.len() / 8)
            .max(1);
        let mut local = 0;
        let mut n = cs.len();
        for c in cs.iter().take(2 * D) {
            self.prefetch_fetch(c, false);
        }
        for i in 0..cs.len() {
            if is_local_fetch(&cs[i]) {
                if local == cap {
                    n = i;
                    break;
                }
                local += 1;
            }
            if let Some(c) = cs.get(i + 2 * D) {
                self.prefetch_fetch(c, false);
            }
            if let Some(c) = cs.get(i + D) {
                self.prefetch_fetch(c, true);
            }
            let c = std::mem::replace(&mut cs[i], IoCompletion::taken());
            let v = value_of(c.token);
            let Some(t) = Tag::of(c.token) else {
                continue;
            };
            match t {
                Tag::Fetch => self.fetch_done(v as usize, c),
                // A job's own completions only: an abandoned job's writes
                // may still complete after a later job started.
                Tag::FlushWrite => {
                    if let Some(j) = self.flush.as_mut().filter(|j| j.serial == v) {
                        j.writer.write_done(c.result, c.buf);
                    }
                }
                Tag::FlushSync => {
                    if self.flush.as_ref().is_some_and(|j| j.serial == v) {
                        self.flush_synced(c.result)
                    }
                }
                Tag::CompactWrite => {
                    if let Some(j) = self.compact.as_mut().filter(|j| j.serial == v) {
                        j.writer.write_done(c.result, c.buf);
                    }
                }
                Tag::CompactSync => {
                    if self.compact.as_ref().is_some_and(|j| j.serial == v) {
                        self.compact_synced(c.result)
                    }
                }
                Tag::CompactRead => self.compact_read_done(v, c),
                Tag::CkptWrite => self.checkpoint_io_done(ManifestIo::Write, v as usize, c.result),
                Tag::CkptSync => self.checkpoint_io_done(ManifestIo::Sync, v as usize, c.result),
                Tag::CkptDirSync => {
                    self.checkpoint_io_done(ManifestIo::DirSync, v as usize, c.result)
                }
                Tag::MarkerSync | Tag::MarkerDirSync => self.marker_io_done(t, v, c.result),
                Tag::ExportRead => self.export_read_done(v, c),
                Tag::CacheWrite => self.writeback_done(v as usize, c.result),
                Tag::ImportWrite | Tag::ImportSync => self.import_io_done(t, v, c),
                Tag::Layers => self.layers_io_done(v, c.result),
                Tag::Opening => self.opening_read_done(v, c),
                Tag::Unlink => {
                    self.unlinking.retain(|(serial, _)| *serial != v);
                    if c.result.is_err_and(|e| e != libc::ENOENT) {
                        self.stats.delete_failures += 1;
                    }
                }
                Tag::DirSync => {
                    self.dir_sync_in_flight = false;
                    match c.result {
                        Ok(_) => {
                            let done = std::mem::take(&mut self.awaiting_dir_sync);
                            self.retired.extend(done);
                        }
                        Err(errno) => {
                            // Keep the inputs (harmless duplicates: the output
                            // supersedes them at recovery) and retry later.
                            self.background_failed(StoreError::from_errno(
                                &self.cfg.dir,
                                "fsync directory",
                                errno,
                            ));
                        }
                    }
                }
                // An open reaps its reads itself; the tier's own requests
                // complete in the tier.
                Tag::Open
                | Tag::TierUpload
                | Tag::TierDelete
                | Tag::TierPunch
                | Tag::TierSync
                | Tag::TierRead
                | Tag::TierScan => {}
            }
        }
        cs.drain(..n);
        self.completions = cs;
    }

    /// The loads `fetch_done` will need for completion `c`, if it is a
    /// block fetch's: its entry (`second` false), or, once that is cached,
    /// what it points to.
    #[inline]
    fn prefetch_fetch(&self, c: &IoCompletion, second: bool) {
        if Tag::of(c.token) != Some(Tag::Fetch) {
            return;
        }
        let fi = value_of(c.token) as usize;
        if !second {
            self.fetches.prefetch(fi, 2);
            return;
        }
        if let Some(f) = self.fetches.get(fi) {
            if let Some(&id) = f.reads.first() {
                self.reads.prefetch(id, 3);
            }
            f.seg.index.prefetch(f.block as usize);
        }
        if let Some(Ok(b)) = &c.remote_block {
            b.prefetch();
        }
    }

    pub(super) fn background(&mut self) {
        if let Some(at) = self.retry_at {
            if crate::clock::now() < at {
                return;
            }
            self.retry_at = None;
        }
        if !self.awaiting_dir_sync.is_empty() && !self.dir_sync_in_flight {
            self.sync_dir();
        }
        self.step_layers();
        if self.flush.is_none() && !self.frozen.is_empty() {
            self.start_flush();
        }
        // (The clock is read only around a step that runs.)
        if self.flush.is_some() && self.pacer.allows() {
            let t = crate::clock::now();
            self.step_flush();
            self.pacer.spent(crate::clock::elapsed(t));
        }
        // Not while a memtable waits for its flush: its segment may fall
        // between a window's inputs in order (restored layers are newer
        // than memtables frozen before the restore).
        if self.compact.is_none() && self.flush.is_none() && self.frozen.is_empty() {
            self.maybe_start_compaction();
        }
        // A flush that something presses (a checkpoint waiting, writes
        // short of room) goes first: the two sharing the steps made a Flink job's checkpoints
        // twice as long once compaction was paced in the task's gaps.
        // (Not a backlog checkpoints wait for: that presses compaction.)
        let flush_pressed =
            self.flush.is_some() && (self.checkpoint_awaits_flush() || self.flush_headroom() < 0.5);
        if self.compact.is_some() && self.pacer.allows() && !flush_pressed {
            let t = crate::clock::now();
            self.step_compaction();
            self.pacer.spent(crate::clock::elapsed(t));
        }
        self.step_checkpoints();
        self.step_markers();
        self.cache.trim();
        self.reap_retired();
        self.maybe_evict();
        if !self.kg_deletes.is_empty() && self.flush.is_none() && self.compact.is_none() {
            self.prune_kg_deletes();
        }
    }

    /// Removes `path` through the I/O layer (see `Io::unlink`): a large
    /// file's blocks are freed off the shard. The store stays busy until
    /// it completes; a failure counts in `StoreStats::delete_failures`.
    pub(super) fn unlink(&mut self, path: &Path) {
        self.unlink_serial = (self.unlink_serial + 1) & 0xffff_ffff;
        self.io.unlink(path, tag(Tag::Unlink, self.unlink_serial));
        self.unlinking
            .push((self.unlink_serial, path.to_path_buf()));
    }

    /// Whether an unlink of `path` is in flight: a flush or compaction
    /// retried after its output was abandoned writes a file of the same
    /// name, which must wait for it (creating it first failed with
    /// EEXIST, and the unlink would then remove the new file).
    pub(super) fn unlink_pending(&self, path: &Path) -> bool {
        self.unlinking.iter().any(|(_, p)| p == path)
    }

    /// Whether a frozen memtable waits for its flush and that flush's
    /// output name is not being unlinked (a failed attempt's file): the
    /// unlink's completion wakes a caller that waits meanwhile.
    pub(super) fn flush_can_start(&self) -> bool {
        let Some((order, _)) = self.frozen.last() else {
            return false;
        };
        // A newer layer must not be durable before the list (see `layers`).
        if self.layers.pending() {
            return false;
        }
        self.unlinking.is_empty()
            || !self.unlink_pending(&self.cfg.dir.join(segment::file_name(*order, 0)))
    }

    /// Issues an fsync of the store directory (through the I/O layer, so
    /// the shard thread does not block).
    pub(super) fn sync_dir(&mut self) {
        if self.dir_sync_in_flight {
            return;
        }
        let f = match self.dir_file {
            Some(f) => f,
            None => match self.io.open(&self.cfg.dir, OpenMode::Read) {
                Ok(f) => *self.dir_file.insert(f),
                Err(e) => {
                    return self.background_failed(StoreError::io(
                        &self.cfg.dir,
                        "open directory",
                        &e,
                    ));
                }
            },
        };
        self.dir_sync_in_flight = true;
        self.io.fsync(f, tag(Tag::DirSync, 0));
    }

    pub(super) fn reap_retired(&mut self) {
        let mut i = 0;
        while i < self.retired.len() {
            if Rc::strong_count(&self.retired[i]) == 1 {
                let s = self.retired.swap_remove(i);
                self.cache.forget_segment(s.id);
                self.io.close(s.file);
                self.delete_if_unreferenced(&s.name());
            } else {
                i += 1;
            }
        }
    }

    pub(super) fn background_failed(&mut self, e: StoreError) {
        self.stats.last_background_error = Some(e);
        self.stats.background_failures += 1;
        self.retry_at = Some(crate::clock::now() + self.cfg.retry_delay);
    }

    /// Whether background work can take a step now without waiting for
    /// I/O (a flush to start or to sort and write, a compaction step, a
    /// checkpoint manifest to start): a caller with nothing else to do
    /// should poll again rather than wait.
    pub fn background_runnable(&self) -> bool {
        self.retry_at.is_none()
            && (self.layers.startable()
                || self.flush.as_ref().map_or(self.flush_can_start(), |j| {
                    !j.syncing
                        && (matches!(j.order, FlushOrder::Sorting(_)) || j.writer.write_room())
                })
                || self.compact.as_ref().is_some_and(|j| {
                    // Every input has its block, or none waits for a read (it
                    // is finished, or the step issues its read).
                    !j.syncing
                        && j.error.is_none()
                        && j.writer.write_room()
                        && j.cursors
                            .iter()
                            .all(|c| c.block().is_some() || c.reads_in_flight() == 0)
                })
                || self.checkpoint_runnable())
    }

    /// Runs background work until flushes and compactions are finished.
    pub fn settle(&mut self) {
        self.drain(true, |_, _| {});
    }
}

/// A block read from the local disk (not from the remote tier, whose
/// latency dwarfs a pass and whose replies come in large batches).
fn is_local_fetch(c: &IoCompletion) -> bool {
    Tag::of(c.token) == Some(Tag::Fetch) && c.remote_block.is_none()
}
