//! Portable snapshots (`store/FORMAT.md` §13): export streams an owner's
//! state in a key-group range into chunk slots, import installs a chunk
//! stream as new layers.
//!
//! An export has the synchronous part of a checkpoint (freeze, capture
//! the layers and what each holds of the range) and then merges the
//! captured layers in one pass, newest first, with the merge rules of a
//! bottom compaction: a key's newest put wins, deletes and clears hide
//! what is older, list operands are joined. A record that needs no merge
//! (the common case) is copied as stored, and runs of them out of one block
//! in one copy, straight into the caller's slot, CRC computed on the way.
//!
//! An import decodes chunks as they arrive (each checked before any of its
//! records is used) into new segment files that no reader sees; only after
//! the last chunk, when every file is durable, are they installed, like a
//! restore: a mask over the owner's states in the range, the new layers
//! above it. A bad chunk, a refused state or a failed write abandons the
//! files and leaves the store as it was. State ids are local to a store, so
//! the stream names its states and the caller resolves each name to a
//! local id; records are rewritten to the local ids on the way in.

use std::cmp::Reverse;

use super::opening::Purpose;
use super::*;
use crate::format::RECORD_HEADER;
use crate::manifest::{Clip, Region, intersect, state_set};
use crate::snapshot::{
    ChunkDecoder, ChunkEncoder, ChunkSlot, Decoded, Item, MAX_ITEM, SnapshotError, StateDesc,
    encode_states,
};

/// Exports (and imports) in progress at once per store. Each holds read
/// buffers (or write buffers), counted in the memory budget
/// ([`Store::memory`]'s `background`): past the budget, a second one waits
/// (`Limit`) until others end; one alone always runs.
pub const MAX_EXPORTS: usize = 64;
pub const MAX_IMPORTS: usize = 64;
/// Files one import may write (one per run of states whose ids ascend in
/// both stores); each holds a write buffer until installed.
const MAX_IMPORT_FILES: usize = 64;
/// Layers an export can merge (cursor numbers fit its read tokens).
const MAX_EXPORT_LAYERS: usize = 4095;
/// Blocks per export read (1 MiB at the 4 KiB block size) and reads in
/// flight per layer, at most; an export's read-ahead over all its layers
/// aims at `EXPORT_WINDOW` (smaller reads when it has many layers, down to
/// 8 blocks per layer).
const EXPORT_READ_BLOCKS: usize = 256;
const EXPORT_READS: usize = 4;
const EXPORT_WINDOW: usize = 64 << 20;
/// Read-ahead one layer of an export holds at least: 8 blocks, a read in
/// flight and one being consumed.
const EXPORT_LAYER_MIN: usize = 8 * ALIGN * 2;
/// What an import's file writer holds: its write buffers.
const IMPORT_WRITER_BYTES: usize = segment::WRITER_BYTES;
/// Bytes one `export_fill` writes at most: bounds the pause it costs the
/// other work of the thread that calls it.
const FILL_BUDGET: usize = 1 << 20;

/// What to export.
#[derive(Clone, Debug)]
pub struct ExportSpec {
    pub owner: Vec<u8>,
    /// Written into every chunk; the importer checks all chunks carry it.
    pub snapshot_id: u64,
    pub lo: u16,
    pub hi: u16,
    /// The owner's states (their records are exported), with the names
    /// and kinds an importer resolves them by.
    pub states: Vec<StateDesc>,
}

/// What `export_fill` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// Waiting for a flush or a read: call again after `poll`.
    Wait,
    /// Progress, the slot is not full yet: call again with the same slot.
    Again,
    /// The slot holds a whole chunk of `len` bytes; the next call starts a
    /// new chunk (in any slot). After the `last` one the export is over.
    Chunk { len: usize, last: bool },
}

/// What holds an import back from its install (see [`Store::import_hold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportHold(u64);

/// Gives the local ids of the states a snapshot's table names, in its
/// order, or refuses them with the reason.
pub type Resolve<'a> = dyn FnMut(&[StateDesc]) -> Result<Vec<u32>, String> + 'a;

/// What to import into.
#[derive(Clone, Debug)]
pub struct ImportSpec {
    pub owner: Vec<u8>,
    pub lo: u16,
    pub hi: u16,
    /// Every state id of the owner now: their records in `lo..=hi` are
    /// replaced by the snapshot's.
    pub states: Vec<u32>,
}

/// What `import_chunk` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportStep {
    /// The chunk was checked and its records written (not yet visible).
    Consumed,
    /// It was the last chunk: `poll` completes the token once the
    /// snapshot's files are durable and installed (`Output::Imported`;
    /// the layer list naming them is written in the background, see
    /// `layers`), or with the error that stopped it.
    Finishing,
}

/// What an import installed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    pub chunks: u32,
    pub groups: u32,
    pub records: u64,
    /// Key groups (and their records) outside the range, skipped.
    pub skipped_groups: u32,
    pub skipped_records: u64,
    /// New layers (segment files) installed.
    pub layers: u32,
}

impl Export {
    /// The segment files it reads (eviction leaves them whole meanwhile).
    pub(super) fn paths(&self) -> impl Iterator<Item = &Path> {
        self.layers
            .iter()
            .filter_map(|l| match &l.1 {
                Captured::Segment(s) => Some(s.path.as_path()),
                Captured::Memtable(_) => None,
            })
            .chain(self.cursors.iter().filter_map(Source::path))
    }

    /// The memory it holds: its read-ahead, and what its memtables hold
    /// beside the store's plan (see `Source::memory`).
    pub(super) fn memory(&self, frozen: &[(u64, Arc<Memtable>)]) -> usize {
        self.reserve
            + self
                .layers
                .iter()
                .map(|l| match &l.1 {
                    Captured::Memtable(m) => m.get().map_or(0, |m| {
                        MemCursor::sort_bytes(m) + source::outside_plan(m, frozen)
                    }),
                    Captured::Segment(_) => 0,
                })
                .sum::<usize>()
            + self.cursors.iter().map(|c| c.memory(frozen)).sum::<usize>()
    }
}

/// A layer an export captured: a segment, or a frozen memtable (read as
/// it is, not after its flush).
enum Captured {
    Segment(Rc<Segment>),
    Memtable(HeldMemtable),
}

pub(super) struct Export {
    enc: ChunkEncoder,
    /// Captured layers (order, layer, what of it the export holds).
    layers: Vec<(u64, Captured, Clip)>,
    started: bool,
    /// Newest first, each with its clip.
    cursors: Vec<Source>,
    clips: Vec<Clip>,
    /// Bytes of an item that did not fit the previous chunk.
    carry: Vec<u8>,
    carry_at: usize,
    /// A clear marker (its base key and cursor): older layers' keys under
    /// it are hidden.
    clear: Option<(Vec<u8>, usize)>,
    merged: Vec<u8>,
    /// The smallest key of the other layers while one layer's run is
    /// copied.
    bound: Vec<u8>,
    /// Layers with a current record, by (key, layer): the newest first
    /// among equal keys. And layers that moved and must be placed again.
    heads: Vec<usize>,
    moved: Vec<usize>,
    finished: bool,
    cancelled: bool,
    /// Read-ahead it may hold (counted in the memory budget), and the
    /// window its layers share.
    pub(super) reserve: usize,
    window: usize,
    error: Option<StoreError>,
    /// Files opened for this export alone (a checkpoint export's
    /// segments): closed when it ends.
    files: Vec<crate::io::FileId>,
    /// The serial of the opening of its checkpoints' layers, while it runs
    /// (see `opening`).
    opening: Option<u64>,
}

pub(super) struct Import {
    spec: ImportSpec,
    decoder: Option<ChunkDecoder>,
    /// Snapshot state id -> (local id, writer), sorted by snapshot id.
    map: Vec<(u32, u32, usize)>,
    /// Local ids per writer (a writer's ids ascend with the snapshot's, so
    /// its keys stay sorted after rewriting).
    writer_states: Vec<Vec<u32>>,
    writers: Vec<Option<SegmentWriter>>,
    /// Writers whose file is complete (durable, footer included).
    complete: Vec<bool>,
    key: Vec<u8>,
    token: Option<u64>,
    decoded: Option<Decoded>,
    error: Option<StoreError>,
    cancelled: bool,
    /// Not installed until released (see [`Store::import_hold`]).
    held: Option<ImportHold>,
}

impl Export {
    pub(super) fn in_flight(&self) -> bool {
        self.cursors.iter().any(|c| c.reads_in_flight() > 0)
    }

    /// Sorts its memtables' records until `deadline`: true once all are.
    fn sort_until(&mut self, deadline: Instant) -> bool {
        self.cursors.iter_mut().all(|c| c.sort_until(deadline))
    }

    /// Writes `bytes` into the chunk; what does not fit is carried to the
    /// next one. Whether the chunk is full.
    fn emit<S: ChunkSlot + ?Sized>(
        enc: &mut ChunkEncoder,
        carry: &mut Vec<u8>,
        slot: &mut S,
        bytes: &[u8],
    ) -> bool {
        let n = enc.put(slot, bytes);
        if n < bytes.len() {
            carry.extend_from_slice(&bytes[n..]);
            return true;
        }
        false
    }

    /// Fills `slot` from where the previous call stopped.
    fn fill<S: ChunkSlot + ?Sized>(&mut self, slot: &mut S) -> Fill {
        let start = self.enc.pos();
        loop {
            if self.carry_at < self.carry.len() {
                let n = self.enc.put(slot, &self.carry[self.carry_at..]);
                self.carry_at += n;
                if self.carry_at < self.carry.len() {
                    let len = self.enc.end(slot, false);
                    return Fill::Chunk { len, last: false };
                }
                self.carry.clear();
                self.carry_at = 0;
            }
            if self.finished {
                let len = self.enc.end(slot, true);
                return Fill::Chunk { len, last: true };
            }
            if self.enc.pos().saturating_sub(start) >= FILL_BUDGET {
                return Fill::Again;
            }
            match self.step(slot) {
                Some(true) => {
                    let len = self.enc.end(slot, false);
                    return Fill::Chunk { len, last: false };
                }
                Some(false) => {}
                None => return Fill::Wait,
            }
        }
    }

    /// Emits the next key (or a run of keys). `Some(full)`, or `None` when
    /// a layer's next block is still being read.
    fn step<S: ChunkSlot + ?Sized>(&mut self, slot: &mut S) -> Option<bool> {
        // Layers that moved take their place in key order again.
        while let Some(&i) = self.moved.last() {
            match self.cursors[i].at() {
                At::Waiting => return None,
                At::Finished => {}
                At::Record => {
                    let cs = &self.cursors;
                    let k = cs[i].key();
                    let pos = self.heads.partition_point(|&j| (cs[j].key(), j) < (k, i));
                    self.heads.insert(pos, i);
                }
            }
            self.moved.pop();
        }
        let Some(&ci) = self.heads.first() else {
            self.finished = true;
            return Some(false);
        };
        let first = self.cursors[ci].key();
        // Every layer holding the smallest key (newest first).
        let tied = self.heads[1..]
            .iter()
            .take_while(|&&j| self.cursors[j].key() == first)
            .count()
            + 1;
        if self.clear.is_some() || tied > 1 {
            return Some(self.merge(tied, slot));
        }
        // The next key of any other layer: records below it need no merge.
        let bounded = self.heads.len() > 1;
        self.bound.clear();
        if bounded {
            let next = self.cursors[self.heads[1]].key();
            self.bound.extend_from_slice(next);
        }
        Some(self.run(ci, bounded, slot))
    }

    /// Copies the longest run of plain puts of one key group (below the
    /// bound, if `bounded`) out of layer `ci`'s current block in one piece.
    fn run<S: ChunkSlot + ?Sized>(&mut self, ci: usize, bounded: bool, slot: &mut S) -> bool {
        // Not copied as stored (a memtable's records, a segment's other
        // than plain puts): through the general path.
        let Source::Segment(c) = &mut self.cursors[ci] else {
            return self.merge(1, slot);
        };
        let plain = c.block().is_some_and(|b| {
            let r = b.view().record(c.rec);
            r.kind == Kind::Put && self.clips[ci].admits(r.key)
        });
        if !plain {
            return self.merge(1, slot);
        }
        let (Some(b), at) = c.split() else {
            return false;
        };
        let v = b.view();
        let clip = &self.clips[ci];
        let first = v.record(*at);
        let kg = keys::key_group(first.key);
        if let Some(h) = self.enc.group_header(kg)
            && Self::emit(&mut self.enc, &mut self.carry, slot, &h)
        {
            // The header is carried; the run starts the next chunk.
            return true;
        }
        let span = v.raw(&first);
        if span.len() > MAX_ITEM {
            // An importer would refuse it (a list joined by compaction).
            self.error.get_or_insert(too_large(span.len()));
            return false;
        }
        let room = slot.slot_len().saturating_sub(self.enc.pos());
        // A clip admits by key group and state only: a key with the first
        // record's 6-byte prefix (both) is admitted like it.
        let mut prefix = [0xffu8; keys::HEADER_LEN - 4];
        if let Some(p) = first.key.get(..prefix.len()) {
            prefix.copy_from_slice(p);
        }
        let (len, j) = v.put_run(*at, span.len(), room, |k| {
            (!bounded || k < &self.bound[..])
                && if k.starts_with(&prefix) {
                    true
                } else {
                    let same = keys::key_group(k) == kg && clip.admits(k);
                    if same {
                        prefix.copy_from_slice(&k[..keys::HEADER_LEN - 4]);
                    }
                    same
                }
        });
        *at = j;
        self.heads.remove(0);
        self.moved.push(ci);
        // `first`'s bytes through record `j - 1`'s, adjacent in the block.
        let whole = v.raw_span(&first, len);
        Self::emit(&mut self.enc, &mut self.carry, slot, whole)
    }

    /// The smallest key over every layer, merged.
    fn merge<S: ChunkSlot + ?Sized>(&mut self, tied: usize, slot: &mut S) -> bool {
        let key = self.cursors[self.heads[0]].key().to_vec();
        let ranks: Vec<usize> = self.heads.drain(..tied).collect();
        self.moved.extend_from_slice(&ranks);
        if self
            .clear
            .as_ref()
            .is_some_and(|(cb, _)| !key.starts_with(cb))
        {
            // Keys ascend: nothing under that clear marker follows.
            self.clear = None;
        }
        let mut operands: Vec<&[u8]> = Vec::new();
        let mut base: Option<&[u8]> = None;
        let mut raw: Option<&[u8]> = None;
        let mut decided = false;
        let mut clear_rank = None;
        for (rank, c) in self.cursors.iter_mut().enumerate() {
            if !ranks.contains(&rank) {
                continue;
            }
            let Some(rec) = c.take() else {
                continue;
            };
            if decided || !self.clips[rank].admits(&key) {
                continue;
            }
            if cleared(&self.clear, &key, rank) {
                continue;
            }
            match rec.kind {
                Kind::Put => {
                    if operands.is_empty() {
                        raw = rec.raw;
                    }
                    base = Some(rec.value);
                    decided = true;
                }
                Kind::Delete => decided = true,
                Kind::Clear => {
                    clear_rank = Some(rank);
                    decided = true;
                }
                Kind::Merge => operands.push(rec.value),
            }
        }
        if let Some(r) = clear_rank {
            self.clear = Some((key.clone(), r));
        }
        if raw.is_none() && base.is_none() && operands.is_empty() {
            return false;
        }
        let vlen = joined_len(base, &operands);
        if RECORD_HEADER + key.len() + vlen > MAX_ITEM {
            // An importer would refuse it (and a u32 could not say it).
            self.error.get_or_insert(too_large(vlen));
            return false;
        }
        let kg = keys::key_group(&key);
        if let Some(h) = self.enc.group_header(kg)
            && Self::emit(&mut self.enc, &mut self.carry, slot, &h)
        {
            // Everything after the header is carried too.
            match raw {
                Some(r) => self.carry.extend_from_slice(r),
                None => {
                    let rec = merged_record(&mut self.merged, &key, base, &operands);
                    self.carry.extend_from_slice(rec);
                }
            }
            return true;
        }
        match raw {
            Some(r) => Self::emit(&mut self.enc, &mut self.carry, slot, r),
            None => {
                let rec = merged_record(&mut self.merged, &key, base, &operands);
                Self::emit(&mut self.enc, &mut self.carry, slot, rec)
            }
        }
    }
}

fn too_large(len: usize) -> StoreError {
    StoreError::TooLarge {
        what: "a record (a joined list) in a snapshot",
        len,
        max: MAX_ITEM,
    }
}

/// A put record of `key` whose value is `base` followed by the operands,
/// oldest first (operands come newest first).
fn merged_record<'a>(
    out: &'a mut Vec<u8>,
    key: &[u8],
    base: Option<&[u8]>,
    operands: &[&[u8]],
) -> &'a [u8] {
    out.clear();
    out.extend_from_slice(&[Kind::Put as u8, 0]);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(&(joined_len(base, operands) as u32).to_le_bytes());
    out.extend_from_slice(key);
    join_into(out, base, operands);
    out
}

impl Export {
    fn new(spec: &ExportSpec, layers: Vec<(u64, Captured, Clip)>) -> Export {
        Export {
            enc: ChunkEncoder::new(spec.snapshot_id),
            layers,
            started: false,
            cursors: Vec::new(),
            clips: Vec::new(),
            carry: encode_states(&spec.states),
            carry_at: 0,
            clear: None,
            merged: Vec::new(),
            bound: Vec::new(),
            heads: Vec::new(),
            moved: Vec::new(),
            finished: false,
            cancelled: false,
            error: None,
            files: Vec::new(),
            opening: None,
            reserve: 0,
            window: 0,
        }
    }
}

impl Import {
    /// Memory its writers hold (one counted from the start).
    pub(super) fn reserve(&self) -> usize {
        self.writers.iter().flatten().count().max(1) * IMPORT_WRITER_BYTES
    }

    pub(super) fn in_flight(&self) -> bool {
        self.writers.iter().flatten().any(|w| !w.idle())
    }

    /// After its last chunk, until installed (not while held: what
    /// releases it is the caller's, see [`Store::import_hold`]).
    pub(super) fn finishing(&self) -> bool {
        self.token.is_some() && !self.cancelled && self.held.is_none()
    }
}

impl<I: Io> Store<I> {
    /// The synchronous part of a portable export of `spec.owner`'s states
    /// in key groups `spec.lo..=spec.hi` (like a checkpoint's: freezes the
    /// memtable and captures the layers, frozen memtables included, which
    /// it reads where they are; later writes are not exported). Returns
    /// the export's id for [`Store::export_fill`].
    pub fn export(&mut self, spec: ExportSpec) -> Result<usize, StoreError> {
        if spec.lo > spec.hi {
            return Err(StoreError::Invalid("key-group range with lo > hi"));
        }
        if self.exports.len() >= MAX_EXPORTS {
            return Err(StoreError::Limit(format!(
                "{MAX_EXPORTS} exports are in progress"
            )));
        }
        // Admitted before anything changes, for every layer it could take
        // (and a sort of every memtable).
        let (reserve, window) = self.export_reserve(self.segments.len());
        self.admit(reserve + self.export_sorts(), "an export")?;
        self.freeze();
        let keep = Region {
            lo: spec.lo,
            hi: spec.hi,
            states: Some(state_set(spec.states.iter().map(|s| s.id).collect())),
        };
        let mut layers = Vec::new();
        for seg in &self.segments {
            if seg.footer.max_kg < spec.lo || seg.footer.min_kg > spec.hi {
                continue;
            }
            if let Some(clip) = self.capture_clip(seg.footer.order, seg.clip.as_ref(), &keep) {
                layers.push((seg.footer.order, Captured::Segment(seg.clone()), clip));
            }
        }
        for (o, m) in &self.frozen {
            if let Some(clip) = self.capture_clip(*o, None, &keep) {
                layers.push((*o, Captured::Memtable(HeldMemtable::new(m.clone())), clip));
            }
        }
        if layers.len() > MAX_EXPORT_LAYERS {
            return Err(StoreError::Limit(format!(
                "the range has {} layers; compact before exporting",
                layers.len()
            )));
        }
        let mut e = Export::new(&spec, layers);
        (e.reserve, e.window) = (reserve, window);
        let id = self.exports.insert(e);
        self.rebalance_cache();
        Ok(id)
    }

    /// What an export of `layers` segments reserves for its read-ahead,
    /// and the window they share: 64 MiB, or an eighth of the budget if
    /// less (at least 1 MiB).
    fn export_reserve(&self, layers: usize) -> (usize, usize) {
        let window = (self.cfg.memory_budget / 8).clamp(1 << 20, EXPORT_WINDOW);
        (window.max(layers * EXPORT_LAYER_MIN), window)
    }

    /// What sorts of the memtables an export started now would take (the
    /// active one is frozen by it).
    fn export_sorts(&self) -> usize {
        std::iter::once(&self.active)
            .chain(self.frozen.iter().map(|(_, m)| &**m))
            .map(MemCursor::sort_bytes)
            .sum()
    }

    /// Whether an export started now would have to wait for others to end
    /// (the budget has no room for its read-ahead and sorts): a caller
    /// that can leave it queued does, rather than see `Limit`.
    pub fn export_should_wait(&self) -> bool {
        !self.has_room(self.export_reserve(self.segments.len()).0 + self.export_sorts())
    }

    /// As [`Store::export_should_wait`], for an import.
    pub fn import_should_wait(&self) -> bool {
        !self.has_room(IMPORT_WRITER_BYTES)
    }

    /// Whether `reserve` more bytes fit the memory budget beside what the
    /// store holds and plans (memtables, indexes, background work, exports
    /// and imports; the block cache gives way); with no export or import
    /// in progress, always.
    fn has_room(&self, reserve: usize) -> bool {
        (self.exports.is_empty() && self.imports.is_empty())
            || self.snapshot_memory_held() + reserve <= self.cfg.memory_budget
    }

    fn snapshot_memory_held(&self) -> usize {
        self.memtable_plan()
            + self
                .segments
                .iter()
                .map(|s| s.memory_bytes())
                .sum::<usize>()
            + self.background_bytes()
    }

    /// `Limit` unless [`Store::has_room`] for `what`'s `reserve`.
    fn admit(&self, reserve: usize, what: &str) -> Result<(), StoreError> {
        if !self.has_room(reserve) {
            let held = self.snapshot_memory_held();
            return Err(StoreError::Limit(format!(
                "{what} needs {} MiB of read or write buffers and the memory budget ({} MiB) has {} MiB left beside the memtables, indexes, background work and the {} exports and {} imports in progress; retry when one ends",
                reserve >> 20,
                self.cfg.memory_budget >> 20,
                self.cfg.memory_budget.saturating_sub(held) >> 20,
                self.exports.len(),
                self.imports.len()
            )));
        }
        Ok(())
    }

    /// Like [`Store::export`], but of what the retained checkpoints
    /// `handles` of `spec.owner` hold of key groups `spec.lo..=spec.hi`
    /// (as a restore of them would install it), leaving the live state as
    /// it is. The handles are checked as for a restore; nothing starts
    /// when one is refused.
    pub fn export_checkpoints(
        &mut self,
        spec: ExportSpec,
        handles: &[&[u8]],
    ) -> Result<usize, StoreError> {
        if spec.lo > spec.hi {
            return Err(StoreError::Invalid("key-group range with lo > hi"));
        }
        if self.exports.len() >= MAX_EXPORTS {
            return Err(StoreError::Limit(format!(
                "{MAX_EXPORTS} exports are in progress"
            )));
        }
        let manifests = self.checkpoint_manifests(&spec.owner, handles, spec.lo, spec.hi)?;
        // Counted before any file is opened.
        let named: usize = manifests.iter().map(|m| m.layers.len()).sum();
        if named > MAX_EXPORT_LAYERS {
            return Err(StoreError::Limit(format!(
                "the checkpoints name {named} layers; at most {MAX_EXPORT_LAYERS} export at once"
            )));
        }
        let (reserve, window) = self.export_reserve(named);
        self.admit(reserve, "an export")?;
        // It waits for its layers (see `export_fill`).
        let serial = self.next_opening();
        let mut e = Export::new(&spec, Vec::new());
        (e.reserve, e.window, e.opening) = (reserve, window, Some(serial));
        let id = self.exports.insert(e);
        let states = spec.states.iter().map(|s| s.id).collect();
        let purpose = Purpose::Export { id, states };
        if let Err(err) = self.open_layers(serial, purpose, manifests, spec.lo, spec.hi) {
            self.exports.remove(id);
            return Err(err);
        }
        self.rebalance_cache();
        Ok(id)
    }

    /// The layers of export `id`'s checkpoints are open (opening `serial`):
    /// they become its own, or its error does. An export that ended
    /// meanwhile closes them.
    pub(super) fn export_opened(
        &mut self,
        id: usize,
        serial: u64,
        states: &[u32],
        opened: Result<Vec<Segment>, StoreError>,
    ) {
        let ours = |e: &Export| e.opening == Some(serial) && !e.cancelled;
        let Some(e) = self.exports.get_mut(id).filter(|e| ours(e)) else {
            if let Ok(segs) = opened {
                for s in segs {
                    self.io.close(s.file);
                }
            }
            return;
        };
        e.opening = None;
        let opened = match opened {
            Ok(o) => o,
            Err(err) => {
                e.error = Some(err);
                return;
            }
        };
        e.files = opened.iter().map(|s| s.file).collect();
        let states = state_set(states.to_vec());
        let n = opened.len() as u64;
        for (i, mut seg) in opened.into_iter().enumerate() {
            let Some(c) = seg.clip.take() else { continue };
            let kept = match &c.keep.states {
                Some(st) => intersect(st, &states),
                None => states.clone(),
            };
            if kept.is_empty() {
                continue;
            }
            let clip = Clip {
                keep: Region {
                    lo: c.keep.lo,
                    hi: c.keep.hi,
                    states: Some(kept),
                },
                drop: c.drop,
            };
            // Newest first within a manifest; manifests hold disjoint key
            // groups, so their relative order does not matter.
            e.layers
                .push((n - i as u64, Captured::Segment(Rc::new(seg)), clip));
        }
        self.rebalance_cache();
    }

    /// Forgets export `id` and closes the files opened for it alone.
    fn end_export(&mut self, id: usize) {
        let e = self.exports.remove(id);
        for f in e.files {
            self.io.close(f);
        }
        self.rebalance_cache();
    }

    /// Writes export `id`'s next bytes into `slot` (at least 4 KiB; a
    /// whole chunk is [`crate::snapshot::CHUNK_LEN`]). A slot must be
    /// passed again until it returns `Chunk`. An error ends the export.
    pub fn export_fill<S: ChunkSlot + ?Sized>(
        &mut self,
        id: usize,
        slot: &mut S,
    ) -> Result<Fill, StoreError> {
        let Some(e) = self.exports.get_mut(id).filter(|e| !e.cancelled) else {
            return Err(StoreError::Invalid("no such export"));
        };
        if slot.slot_len() < 4096 {
            return Err(StoreError::Invalid("a chunk slot of less than 4 KiB"));
        }
        if let Some(err) = e.error.take() {
            self.export_cancel(id);
            return Err(err);
        }
        if e.opening.is_some() {
            return Ok(Fill::Wait);
        }
        if !e.started {
            e.layers.sort_by_key(|l| Reverse(l.0));
            let segments = e
                .layers
                .iter()
                .filter(|l| matches!(l.1, Captured::Segment(_)))
                .count();
            let per_layer = e.window / segments.max(1);
            let blocks = (per_layer / ALIGN / 2).clamp(8, EXPORT_READ_BLOCKS);
            let reads = (per_layer / (blocks * ALIGN)).clamp(1, EXPORT_READS);
            for (_, layer, clip) in e.layers.drain(..) {
                let (lo, hi) = (clip.keep.lo, clip.keep.hi);
                e.cursors.push(match layer {
                    Captured::Segment(seg) => {
                        Source::Segment(Cursor::key_groups(seg, lo, hi, blocks, reads))
                    }
                    Captured::Memtable(m) => Source::Memtable(MemCursor::new(m, lo, hi)),
                });
                e.clips.push(clip);
            }
            e.moved = (0..e.cursors.len()).rev().collect();
            e.started = true;
            self.rebalance_cache();
        }
        let e = self.exports.get_mut(id).expect("checked above");
        let read = |e: &mut Export, reads: &mut tier::Reads<'_, I>| {
            for (ci, c) in e.cursors.iter_mut().enumerate() {
                let Source::Segment(c) = c else { continue };
                c.read_ahead(reads, |first| {
                    tag(
                        Tag::ExportRead,
                        ((id as u64) << 44) | ((ci as u64) << 32) | first as u64,
                    )
                });
            }
        };
        let mut reads = tier::Reads {
            io: &mut self.io,
            tier: self.tier.as_mut(),
        };
        read(e, &mut reads);
        // Memtables are put in key order first, a bounded step per call.
        if !e.sort_until(crate::clock::now() + self.cfg.background_slice) {
            let _ = self.io.submit();
            return Ok(Fill::Again);
        }
        let fill = e.fill(slot);
        read(e, &mut reads);
        if let Some(err) = e.error.take() {
            self.export_cancel(id);
            return Err(err);
        }
        let _ = self.io.submit();
        if let Fill::Chunk { last: true, .. } = fill {
            self.end_export(id);
        }
        Ok(fill)
    }

    /// Abandons export `id` (its reads in flight finish first).
    pub fn export_cancel(&mut self, id: usize) {
        if let Some(e) = self.exports.get_mut(id) {
            e.cancelled = true;
            e.layers.clear();
            if !e.in_flight() {
                self.end_export(id);
            }
        }
    }

    pub(super) fn export_read_done(&mut self, v: u64, c: IoCompletion) {
        let (id, ci, first) = (
            (v >> 44) as usize,
            ((v >> 32) & 0xfff) as usize,
            (v & 0xffff_ffff) as usize,
        );
        let Some(e) = self.exports.get_mut(id) else {
            return;
        };
        if let Source::Segment(cursor) = &mut e.cursors[ci]
            && let Err(err) = cursor.read_done(first, c)
        {
            e.error.get_or_insert(err);
        }
        if e.cancelled && !e.in_flight() {
            self.end_export(id);
        }
    }

    /// Starts importing a snapshot into `spec.owner`'s key groups
    /// `spec.lo..=spec.hi`. Returns the import's id.
    pub fn import_begin(&mut self, spec: ImportSpec) -> Result<usize, StoreError> {
        if spec.lo > spec.hi {
            return Err(StoreError::Invalid("key-group range with lo > hi"));
        }
        if self.imports.len() >= MAX_IMPORTS {
            return Err(StoreError::Limit(format!(
                "{MAX_IMPORTS} imports are in progress"
            )));
        }
        self.admit(IMPORT_WRITER_BYTES, "an import")?;
        let id = self.imports.insert(Import {
            decoder: Some(ChunkDecoder::new(spec.lo, spec.hi)),
            spec,
            map: Vec::new(),
            writer_states: Vec::new(),
            writers: Vec::new(),
            complete: Vec::new(),
            key: Vec::new(),
            token: None,
            decoded: None,
            error: None,
            cancelled: false,
            held: None,
        });
        self.rebalance_cache();
        Ok(id)
    }

    /// Holds import `id` back from its install, once its files are
    /// written, until [`Store::import_release`] with what this returns:
    /// the daemon holds an import whose state ids are not yet durable in
    /// its registry.
    pub fn import_hold(&mut self, id: usize) -> Option<ImportHold> {
        let i = self.imports.get_mut(id)?;
        self.import_holds += 1;
        let h = ImportHold(self.import_holds);
        i.held = Some(h);
        Some(h)
    }

    /// Lets the import `hold` holds be installed (at once if its files are
    /// written). An import that ended meanwhile is not another's: the hold
    /// finds nothing.
    pub fn import_release(&mut self, hold: ImportHold) {
        if let Some((_, i)) = self.imports.iter_mut().find(|(_, i)| i.held == Some(hold)) {
            i.held = None;
            self.step_imports();
        }
    }

    /// Checks one chunk of import `id` and writes its records. `resolve`
    /// gives the local ids of the states the snapshot's table names, in
    /// its order (or refuses them), once per import. After the last chunk, `token` completes through `poll`. An
    /// error abandons the import; nothing of it is installed.
    pub fn import_chunk(
        &mut self,
        id: usize,
        chunk: &[u8],
        token: u64,
        resolve: &mut Resolve<'_>,
    ) -> Result<ImportStep, StoreError> {
        let Some(imp) = self
            .imports
            .get_mut(id)
            .filter(|i| !i.cancelled && i.token.is_none())
        else {
            return Err(StoreError::Invalid("no such import, or it is finishing"));
        };
        if let Some(e) = imp.error.take() {
            self.import_cancel(id);
            return Err(e);
        }
        let dir = self.cfg.dir.clone();
        let io = &mut self.io;
        let serial = &mut self.next_import_file;
        let mut decoder = imp.decoder.take().expect("a live import has its decoder");
        let fed = decoder.feed(chunk, |item| match item {
            Item::States(table) => imp.resolve_states(table, resolve),
            Item::Record(_, key, value) => imp.add(io, &dir, serial, id, key, value),
        });
        let done = decoder.done();
        imp.decoder = Some(decoder);
        if let Err(e) = fed {
            // A store error (a full disk) beats the refusal it caused.
            let err = imp
                .error
                .take()
                .unwrap_or_else(|| StoreError::Snapshot(e.to_string()));
            self.import_cancel(id);
            return Err(err);
        }
        if !done {
            return Ok(ImportStep::Consumed);
        }
        let imp = &mut self.imports[id];
        let decoded = imp
            .decoder
            .take()
            .expect("kept above")
            .finish()
            .expect("the decoder saw its last chunk");
        imp.decoded = Some(decoded);
        imp.token = Some(token);
        for w in imp.writers.iter_mut().flatten() {
            w.finish(&mut self.io);
        }
        self.step_imports();
        Ok(ImportStep::Finishing)
    }

    /// Bytes import `id` has handed to the disk and not yet seen written:
    /// a caller feeding chunks faster than the disk takes them should
    /// hold back while this is large.
    pub fn import_backlog(&self, id: usize) -> usize {
        self.imports.get(id).map_or(0, |i| {
            i.writers
                .iter()
                .flatten()
                .map(|w| w.writes_in_flight() * segment::WRITE_CHUNK)
                .sum()
        })
    }

    /// Abandons import `id`: its files are deleted (once its writes in
    /// flight finish).
    pub fn import_cancel(&mut self, id: usize) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        // Called again when its last write in flight finishes: the files
        // were unlinked the first time (a second unlink fails, counted).
        let first = !imp.cancelled;
        imp.cancelled = true;
        let in_flight = imp.in_flight();
        let paths: Vec<PathBuf> = match first {
            true => imp
                .writers
                .iter()
                .flatten()
                .map(|w| w.path.clone())
                .collect(),
            false => Vec::new(),
        };
        for p in &paths {
            self.unlink(p);
        }
        if !in_flight {
            let imp = self.imports.remove(id);
            for w in imp.writers.into_iter().flatten() {
                self.io.close(w.file);
            }
            self.rebalance_cache();
        }
    }

    pub(super) fn import_io_done(&mut self, t: Tag, v: u64, c: IoCompletion) {
        let r = c.result;
        let (id, w) = ((v >> 16) as usize, (v & 0xffff) as usize);
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        let Some(writer) = imp.writers[w].as_mut() else {
            return;
        };
        if t == Tag::ImportWrite {
            writer.write_done(r, c.buf);
        } else {
            match writer.synced(&mut self.io, r) {
                Ok(true) => imp.complete[w] = true,
                Ok(false) => {}
                Err(e) => {
                    imp.error.get_or_insert(e);
                }
            }
        }
        if imp.cancelled {
            if !imp.in_flight() {
                self.import_cancel(id);
            }
            return;
        }
        self.step_imports();
    }

    /// Advances finishing imports: fsyncs, then the install.
    pub(super) fn step_imports(&mut self) {
        let keys: Vec<usize> = self
            .imports
            .iter()
            .filter(|(_, i)| i.token.is_some() && !i.cancelled)
            .map(|(k, _)| k)
            .collect();
        for k in keys {
            let imp = &mut self.imports[k];
            let token = imp.token.expect("filtered");
            let mut err = imp.error.take();
            for (w, writer) in imp.writers.iter_mut().enumerate() {
                let Some(writer) = writer else { continue };
                if err.is_none() && !imp.complete[w] {
                    let t = tag(Tag::ImportSync, ((k as u64) << 16) | w as u64);
                    if let Err(e) = writer.sync_if_written(&mut self.io, t) {
                        err = Some(e);
                    }
                }
            }
            if let Some(e) = err {
                self.import_cancel(k);
                self.done.push_back((token, Err(e)));
                continue;
            }
            if imp.held.is_none()
                && imp
                    .writers
                    .iter()
                    .zip(&imp.complete)
                    .all(|(w, c)| w.is_none() || *c)
            {
                let imp = self.imports.remove(k);
                let r = self.install_import(imp);
                self.rebalance_cache();
                self.done.push_back((token, r.map(Resolved::Imported)));
            }
        }
    }

    fn install_import(&mut self, imp: Import) -> Result<Imported, StoreError> {
        let d = imp.decoded.clone().unwrap_or_default();
        let mut added = Vec::new();
        // The owner's states and every state the snapshot named (one
        // without records in the range is emptied there too).
        let mut states = imp.spec.states.clone();
        states.extend(imp.map.iter().map(|m| m.1));
        for (writer, mine) in imp.writers.into_iter().zip(imp.writer_states) {
            let Some(writer) = writer else { continue };
            let id = self.next_segment_id;
            self.next_segment_id += 1;
            let mut seg = writer.into_segment(id);
            seg.clip = Some(Clip {
                keep: Region {
                    lo: imp.spec.lo,
                    hi: imp.spec.hi,
                    states: Some(state_set(mine)),
                },
                drop: Vec::new(),
            });
            added.push(seg);
        }
        let layers = added.len() as u32;
        self.install_layers(added, imp.spec.lo, imp.spec.hi, states);
        Ok(Imported {
            chunks: d.chunks,
            groups: d.groups,
            records: d.records,
            skipped_groups: d.skipped_groups,
            skipped_records: d.skipped_records,
            layers,
        })
    }

    /// Masks `states` in key groups `lo..=hi` in every existing layer and
    /// places `added` (newest first) above them; the layer list is
    /// written in the background (see `layers`).
    pub(super) fn install_layers(
        &mut self,
        added: Vec<Segment>,
        lo: u16,
        hi: u16,
        states: Vec<u32>,
    ) -> usize {
        self.freeze();
        let mask = KgDelete {
            region: Region {
                lo,
                hi,
                states: Some(state_set(states)),
            },
            max_order: self.next_order - 1,
        };
        let mut ids = Vec::new();
        for mut s in added.into_iter().rev() {
            s.footer.order = self.next_order;
            s.footer.min_order = self.next_order;
            self.next_order += 1;
            ids.push(s.id);
            self.segments.push(Rc::new(s));
        }
        sort_layers(&mut self.segments);
        self.push_mask(mask);
        self.rebalance_cache();
        ids.len()
    }
}

impl Import {
    /// Maps each snapshot state to a local id and a writer. A writer takes
    /// states whose local ids ascend with the snapshot's (so rewritten keys
    /// stay sorted): one writer when the orders agree, as in a restore on
    /// the same daemon.
    fn resolve_states(
        &mut self,
        table: &[StateDesc],
        resolve: &mut Resolve<'_>,
    ) -> Result<(), SnapshotError> {
        // In snapshot-id order: states new to the importer get ascending
        // ids in that order, so their keys share one file.
        let mut table = table.to_vec();
        table.sort_unstable_by_key(|d| d.id);
        let table = &table[..];
        let locals = resolve(table).map_err(SnapshotError::Refused)?;
        if locals.len() != table.len() {
            return Err(SnapshotError::Refused(
                "the state resolver answered for another number of states".into(),
            ));
        }
        let mut pairs: Vec<(u32, u32, &[u8])> = table
            .iter()
            .zip(&locals)
            .map(|(d, &l)| (d.id, l, &d.name[..]))
            .collect();
        pairs.sort_unstable_by_key(|p| p.0);
        let mut seen = std::collections::HashSet::with_capacity(pairs.len());
        for (id, local, name) in pairs {
            if !seen.insert(local) {
                return Err(SnapshotError::Refused(format!(
                    "two states of the snapshot are state {} here",
                    String::from_utf8_lossy(name)
                )));
            }
            let w = match self
                .writer_states
                .iter()
                .position(|ids| ids.last().is_some_and(|&l| l < local))
            {
                Some(w) => w,
                None if self.writer_states.len() >= MAX_IMPORT_FILES => {
                    return Err(SnapshotError::Refused(format!(
                        "the snapshot's states would need more than {MAX_IMPORT_FILES} files here (their ids are ordered too differently)"
                    )));
                }
                None => {
                    self.writer_states.push(Vec::new());
                    self.writers.push(None);
                    self.complete.push(false);
                    self.writer_states.len() - 1
                }
            };
            self.writer_states[w].push(local);
            // Sorted by snapshot id: records look their state up by search.
            self.map.push((id, local, w));
        }
        Ok(())
    }

    /// Writes one record, its state id rewritten to the local one.
    fn add<I: Io>(
        &mut self,
        io: &mut I,
        dir: &Path,
        serial: &mut u64,
        id: usize,
        key: &[u8],
        value: &[u8],
    ) -> Result<(), SnapshotError> {
        let sid = keys::state_id(key).expect("the decoder checked the key's length");
        let i = self
            .map
            .binary_search_by_key(&sid, |m| m.0)
            .expect("the decoder checked the state is in the table");
        let (_, local, w) = self.map[i];
        if keys::base_len(key).is_none() {
            return Err(SnapshotError::Refused(
                "a record whose key is malformed".into(),
            ));
        }
        if self.writers[w].is_none() {
            let path = dir.join(segment::import_file_name(*serial));
            *serial += 1;
            let t = tag(Tag::ImportWrite, ((id as u64) << 16) | w as u64);
            match SegmentWriter::create_at(io, path, 0, 0, 0, t) {
                Ok(writer) => self.writers[w] = Some(writer),
                Err(e) => return Err(self.fail(e)),
            }
        }
        let writer = self.writers[w].as_mut().expect("created above");
        if let Some(e) = writer.error.clone() {
            return Err(self.fail(e));
        }
        if local == sid {
            writer.add(io, Kind::Put, key, value);
        } else {
            self.key.clear();
            self.key.extend_from_slice(key);
            self.key[2..6].copy_from_slice(&local.to_be_bytes());
            writer.add(io, Kind::Put, &self.key, value);
        }
        Ok(())
    }

    /// Keeps a store error for `import_chunk` to return; the decoder stops.
    fn fail(&mut self, e: StoreError) -> SnapshotError {
        let msg = e.to_string();
        self.error = Some(e);
        SnapshotError::Refused(msg)
    }
}
