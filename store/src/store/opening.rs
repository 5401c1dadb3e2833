//! Opening a checkpoint's layers, for a restore or for an export of
//! retained checkpoints, without blocking the shard.
//!
//! The manifests are in memory (a retained checkpoint keeps its own).
//! Segments only the remote tier holds (an empty local disk) first get
//! their footer and metadata fetched into sparse local files, on the
//! remote runtime's blocking pool. A segment a live layer already has open shares that layer's index and
//! filter: only its file is opened again. Any other segment is opened and
//! its footer page read, then its metadata (index and filter) from the
//! offset the footer gives. Every segment's reads are in flight at once,
//! through the I/O layer, and the shard serves requests meanwhile.
//!
//! When the last read lands, the manifests are checked again (a release
//! in the meantime may have deleted their files), then the layers are
//! installed (a restore) or handed to the export, which waited. All or
//! nothing: on any error every file opened for it is closed and nothing
//! changed.
//!
//! A token's value carries the opening's serial (32 bits) above its slot
//! (24 bits): a completion of an opening that ended finds nothing.

use super::*;
use crate::io::FileId;
use crate::manifest::Manifest;

/// Serial bits an opening's tokens carry.
const SERIAL_BITS: u32 = 32;
const SLOT_BITS: u32 = 24;
/// The slot a fetch of metadata's token names (one past the last a slot
/// may take).
const FETCH_SLOT: usize = (1 << SLOT_BITS) - 1;

/// A restore driven to its end by [`Store::restore`] (never a caller's:
/// the daemon numbers its restores from 0).
const SYNC_RESTORE: u64 = u64::MAX;

/// What the layers are opened for.
pub(super) enum Purpose {
    /// A restore: installs them, then completes `token` (see
    /// [`Store::take_restored`]). `states`: the owner's states now and the
    /// checkpoints', all masked in the range.
    Restore { token: u64, states: Vec<u32> },
    /// Export `id`, which waits until they are open. `states`: those it
    /// exports.
    Export { id: usize, states: Vec<u32> },
}

/// Layers being opened.
pub(super) struct Opening {
    serial: u64,
    purpose: Purpose,
    lo: u16,
    hi: u16,
    manifests: Vec<Rc<Manifest>>,
    /// Newest first within each manifest, manifests in the order given.
    slots: Vec<Slot>,
    /// Reads in flight (a fetch of metadata counts as one).
    reads: usize,
    /// The fetch of metadata only the remote tier holds, while it runs.
    fetch: Option<tier::Fetched>,
    failed: Option<StoreError>,
}

struct Slot {
    /// The segment's file name, and where it is (once its metadata is on
    /// the local disk).
    name: String,
    path: PathBuf,
    id: u64,
    /// The length its manifest records.
    want_len: u64,
    clip: Clip,
    /// Its file while its reads run (an open segment holds its own).
    file: Option<FileId>,
    state: SlotState,
}

enum SlotState {
    /// Its footer page (at `page`) is being read.
    Footer {
        len: u64,
        page: u64,
    },
    /// Its metadata, `meta_len` bytes from `meta_off` to the footer page,
    /// is being read.
    Meta {
        len: u64,
        footer: AlignedBuf,
        meta_off: u64,
        meta_len: usize,
    },
    Open(Segment),
    /// Failed (its file closed), or not begun.
    Closed,
}

impl Slot {
    fn close<I: Io>(&mut self, io: &mut I) {
        if let Some(f) = self.file.take() {
            io.close(f);
        }
        if let SlotState::Open(s) = std::mem::replace(&mut self.state, SlotState::Closed) {
            io.close(s.file);
        }
    }

    fn corrupt(&self, offset: u64, what: &'static str) -> StoreError {
        StoreError::Corrupt {
            path: self.path.display().to_string(),
            offset,
            what,
        }
    }

    /// The bytes read `c` brought: `want` of them, read at `off`.
    fn read(&self, c: IoCompletion, want: usize, off: u64) -> Result<AlignedBuf, StoreError> {
        match (c.result, c.buf) {
            (Ok(n), Some(b)) if n == want => Ok(b),
            (Ok(_), _) => Err(self.corrupt(off, SHORTER_THAN_FOOTER)),
            (Err(errno), _) => Err(StoreError::from_errno(&self.path, "read", errno)),
        }
    }
}

impl<I: Io> Store<I> {
    /// Starts a restore of what the checkpoints `handles` hold of
    /// `spec.owner`'s key groups `spec.lo..=spec.hi`. Refused at once
    /// (nothing changes) when a handle is refused or a segment cannot be
    /// opened; otherwise the segments' metadata is read in the background
    /// and [`Store::take_restored`] gives `token`'s outcome, after which
    /// the restore has taken effect (see [`Store::restore`]).
    pub fn restore_start(
        &mut self,
        token: u64,
        spec: RestoreSpec<'_>,
        handles: &[&[u8]],
    ) -> Result<(), StoreError> {
        if spec.lo > spec.hi {
            return Err(StoreError::Invalid("key-group range with lo > hi"));
        }
        let manifests = self.checkpoint_manifests(spec.owner, handles, spec.lo, spec.hi)?;
        // Mask the owner's states now and the checkpoints'.
        let mut states: Vec<u32> = spec.states.to_vec();
        for m in &manifests {
            states.extend_from_slice(&m.states);
        }
        let serial = self.next_opening();
        let purpose = Purpose::Restore { token, states };
        self.open_layers(serial, purpose, manifests, spec.lo, spec.hi)
    }

    /// The serial of the next opening.
    pub(super) fn next_opening(&mut self) -> u64 {
        self.opening_serial = (self.opening_serial + 1) & ((1 << SERIAL_BITS) - 1);
        self.opening_serial
    }

    /// A restore that ended (see [`Store::restore_start`]), if any.
    pub fn take_restored(&mut self) -> Option<(u64, Result<Restored, StoreError>)> {
        self.restored.pop_front()
    }

    /// Replaces `spec.owner`'s state in key groups `spec.lo..=spec.hi` by
    /// what the checkpoints `handles` hold of those key groups (any
    /// parallelism: rescale is a restore from several handles, or of a part
    /// of one). Every handle and segment is checked before anything
    /// changes; a refused restore leaves the store as it was. The segments
    /// are referenced, not copied. [`Store::restore_start`], waited for:
    /// blocks until the segments' metadata is read (a shard uses that
    /// instead). The layer list naming the restored layers is written in
    /// the background (see `layers`), durable before any newer layer is
    /// flushed.
    pub fn restore(
        &mut self,
        spec: RestoreSpec<'_>,
        handles: &[&[u8]],
    ) -> Result<Restored, StoreError> {
        self.restore_start(SYNC_RESTORE, spec, handles)?;
        loop {
            if let Some(i) = self.restored.iter().position(|r| r.0 == SYNC_RESTORE) {
                return self.restored.remove(i).expect("found").1;
            }
            self.drive_io();
            if self.completions.is_empty() && !self.restored.iter().any(|r| r.0 == SYNC_RESTORE) {
                // Not `Store::wait`: it returns at once while requests'
                // results wait to be polled. (A failed wait is tried again:
                // the restore must end here, not in a later call.)
                let remote = self.tier.as_ref().is_some_and(|t| t.outstanding() > 0);
                let ms = if remote { 1 } else { 100 };
                let _ = self.io.wait(Some(Duration::from_millis(ms)));
            }
        }
    }

    /// Opens every segment `manifests` name that holds key groups of
    /// `lo..=hi`, each with its manifest clip narrowed to that range, for
    /// `purpose`, as opening `serial`. An error before any read is in
    /// flight refuses it at once, every file opened so far closed.
    pub(super) fn open_layers(
        &mut self,
        serial: u64,
        purpose: Purpose,
        manifests: Vec<Rc<Manifest>>,
        lo: u16,
        hi: u16,
    ) -> Result<(), StoreError> {
        let mut o = Opening {
            serial,
            purpose,
            lo,
            hi,
            manifests,
            slots: Vec::new(),
            reads: 0,
            fetch: None,
            failed: None,
        };
        for m in &o.manifests {
            for l in &m.layers {
                let Some(clip) = l.clip.narrowed(lo, hi) else {
                    continue;
                };
                let id = self.next_segment_id;
                self.next_segment_id += 1;
                o.slots.push(Slot {
                    name: l.name.clone(),
                    path: PathBuf::new(),
                    id,
                    want_len: l.file_len,
                    clip,
                    file: None,
                    state: SlotState::Closed,
                });
            }
        }
        if o.slots.len() >= FETCH_SLOT {
            return Err(StoreError::Limit(format!(
                "the checkpoints name {} layers of the range",
                o.slots.len()
            )));
        }
        // Segments only the remote tier holds (an empty local disk) get
        // their metadata first, all at once.
        let wanted: Vec<(String, u64)> = o
            .slots
            .iter()
            .map(|s| (s.name.clone(), s.want_len))
            .collect();
        let token = self.opening_token(serial, FETCH_SLOT);
        o.fetch = self.fetch_metadata(token, &wanted);
        if o.fetch.is_some() {
            o.reads = 1;
            self.openings.push(o);
            return Ok(());
        }
        self.begin_opening(o, true)
    }

    /// Opens `o`'s files and starts their reads. An error before any read
    /// is in flight refuses it: returned when `at_once`, else delivered.
    fn begin_opening(&mut self, mut o: Opening, at_once: bool) -> Result<(), StoreError> {
        for i in 0..o.slots.len() {
            if let Err(e) = self.begin_slot(&mut o, i) {
                for s in &mut o.slots {
                    s.close(&mut self.io);
                }
                if o.reads == 0 && at_once {
                    return Err(e);
                }
                // Reads in flight end first.
                o.failed = Some(e);
                break;
            }
        }
        let _ = self.io.submit();
        if o.reads == 0 {
            self.finish_opening(o);
        } else {
            self.openings.push(o);
        }
        Ok(())
    }

    /// The fetch of `o`'s metadata ended: its files are opened next.
    fn opening_fetched(&mut self, mut o: Opening) {
        let done = o
            .fetch
            .take()
            .and_then(|f| f.lock().unwrap_or_else(|p| p.into_inner()).take());
        match done {
            Some((names, Ok(()))) => {
                self.note_fetched(names);
                let _ = self.begin_opening(o, false);
            }
            Some((names, Err(e))) => {
                self.note_fetched(names);
                o.failed = Some(e);
                self.finish_opening(o);
            }
            None => {
                o.failed = Some(StoreError::Remote(
                    "the fetch of the segments' metadata from the remote tier ended without a word"
                        .into(),
                ));
                self.finish_opening(o);
            }
        }
    }

    /// Opens slot `i`'s file: shared with a live layer, or its footer read.
    fn begin_slot(&mut self, o: &mut Opening, i: usize) -> Result<(), StoreError> {
        let s = &mut o.slots[i];
        s.path = tier::layer_path(&self.cfg.dir, &s.name);
        let path = s.path.clone();
        let file = self
            .io
            .open(&path, OpenMode::Read)
            .map_err(|e| StoreError::io(&path, "open", &e))?;
        let shared = self
            .held_segments()
            .find(|h| h.path == path)
            .map(|k| k.another_layer(s.id, file));
        if let Some(seg) = shared {
            s.state = SlotState::Open(seg);
            return self.check_len(o, i);
        }
        s.file = Some(file);
        let len = match self.io.file_len(file) {
            Ok(l) => l,
            Err(e) => {
                s.close(&mut self.io);
                return Err(StoreError::io(&path, "stat", &e));
            }
        };
        let Some(page) = format::footer_page(len) else {
            s.close(&mut self.io);
            return Err(s.corrupt(len, NOT_WHOLE_PAGES));
        };
        s.state = SlotState::Footer { len, page };
        self.io.read(
            file,
            page,
            AlignedBuf::zeroed(ALIGN),
            self.opening_token(o.serial, i),
        );
        o.reads += 1;
        Ok(())
    }

    fn opening_token(&self, serial: u64, slot: usize) -> u64 {
        tag(Tag::Opening, (serial << SLOT_BITS) | slot as u64)
    }

    /// Refuses slot `i`'s segment (closing it) if its length is not its
    /// manifest's.
    fn check_len(&mut self, o: &mut Opening, i: usize) -> Result<(), StoreError> {
        let s = &mut o.slots[i];
        let SlotState::Open(seg) = &s.state else {
            return Ok(());
        };
        if seg.file_len == s.want_len {
            return Ok(());
        }
        let e = s.corrupt(
            seg.file_len,
            "segment length differs from its checkpoint manifest",
        );
        s.close(&mut self.io);
        Err(e)
    }

    /// A read of an opening completed: its footer (the metadata's read
    /// follows) or its metadata (the segment is open).
    pub(super) fn opening_read_done(&mut self, v: u64, c: IoCompletion) {
        let serial = v >> SLOT_BITS;
        let i = (v & ((1 << SLOT_BITS) - 1)) as usize;
        let Some(k) = self.openings.iter().position(|o| o.serial == serial) else {
            return;
        };
        let mut o = self.openings.swap_remove(k);
        o.reads -= 1;
        if i == FETCH_SLOT {
            return self.opening_fetched(o);
        }
        if let Err(e) = self.slot_read_done(&mut o, i, c) {
            o.slots[i].close(&mut self.io);
            o.failed.get_or_insert(e);
        }
        if o.reads > 0 {
            self.openings.push(o);
            return;
        }
        let _ = self.io.submit();
        self.finish_opening(o);
    }

    fn slot_read_done(
        &mut self,
        o: &mut Opening,
        i: usize,
        c: IoCompletion,
    ) -> Result<(), StoreError> {
        let token = self.opening_token(o.serial, i);
        let failed = o.failed.is_some();
        let s = &mut o.slots[i];
        // (A slot reads only while it holds its file.)
        let Some(file) = s.file else {
            return Ok(());
        };
        let state = std::mem::replace(&mut s.state, SlotState::Closed);
        match state {
            SlotState::Footer { len, page } => {
                let fbuf = s.read(c, ALIGN, page)?;
                if failed {
                    // Another slot failed: no more reads.
                    s.close(&mut self.io);
                    return Ok(());
                }
                let footer =
                    format::Footer::decode(&fbuf, len).map_err(|m| s.corrupt(page, m.0))?;
                let meta_off = tier::data_end(&footer);
                let meta_len = page
                    .checked_sub(meta_off)
                    .filter(|&n| n > 0)
                    .ok_or_else(|| s.corrupt(page, "metadata offset past the footer"))?
                    as usize;
                let buf = AlignedBuf::zeroed(meta_len);
                self.io.read(file, meta_off, buf, token);
                s.state = SlotState::Meta {
                    len,
                    footer: fbuf,
                    meta_off,
                    meta_len,
                };
                o.reads += 1;
                Ok(())
            }
            SlotState::Meta {
                len,
                footer,
                meta_off,
                meta_len,
            } => {
                let meta = s.read(c, meta_len, meta_off)?;
                let path = s.path.clone();
                let seg = Segment::from_parts(s.id, path, file, len, &footer, &meta, meta_off)?;
                s.file = None;
                s.state = SlotState::Open(seg);
                self.check_len(o, i)
            }
            // Not reading: nothing to do.
            st @ (SlotState::Open(_) | SlotState::Closed) => {
                s.state = st;
                Ok(())
            }
        }
    }

    /// Every read of `o` landed: its layers go to its purpose, or its
    /// error does.
    fn finish_opening(&mut self, mut o: Opening) {
        if o.failed.is_none()
            && let Some(m) = o.manifests.iter().find(|m| !self.still_retained(m))
        {
            o.failed = Some(StoreError::Restore(format!(
                "checkpoint {} was released while its segments were opened",
                m.checkpoint_id
            )));
        }
        let layers = match o.failed.take() {
            Some(e) => {
                for s in &mut o.slots {
                    s.close(&mut self.io);
                }
                Err(e)
            }
            // (Not reached: an opening without a failure opened every
            // slot.)
            None if o
                .slots
                .iter()
                .any(|s| !matches!(s.state, SlotState::Open(_))) =>
            {
                for s in &mut o.slots {
                    s.close(&mut self.io);
                }
                Err(StoreError::Restore(
                    "a checkpoint segment was not opened".into(),
                ))
            }
            None => {
                let mut segs = Vec::with_capacity(o.slots.len());
                for s in o.slots {
                    if let SlotState::Open(mut seg) = s.state {
                        // Remote, as the tier knows it now (its eviction
                        // may have punched the file since the reads).
                        self.note_remote(&seg);
                        seg.clip = Some(s.clip);
                        segs.push(seg);
                    }
                }
                Ok(segs)
            }
        };
        match o.purpose {
            Purpose::Restore { token, states } => {
                let r = layers.map(|added| {
                    // Mask the states in the range in every existing layer,
                    // then place the checkpoints' layers above, in order.
                    let layers = self.install_layers(added, o.lo, o.hi, states);
                    Restored {
                        layers,
                        manifests: o
                            .manifests
                            .iter()
                            .map(|m| RestoredManifest {
                                checkpoint_id: m.checkpoint_id,
                                lo: m.lo,
                                hi: m.hi,
                                states: m.states.clone(),
                                meta: m.meta.clone(),
                            })
                            .collect(),
                    }
                });
                self.restored.push_back((token, r));
            }
            Purpose::Export { id, states } => self.export_opened(id, o.serial, &states, layers),
        }
    }
}
