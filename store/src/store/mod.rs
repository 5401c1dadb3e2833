//! The engine: one instance per shard thread, no locks, no blocking call on
//! the request path.
//!
//! Writes go to the active memtable and complete at once. A full memtable
//! is frozen and flushed to a segment in the background; segments are
//! merged by compaction in the background. Both run in bounded steps inside
//! [`Store::poll`], so a foreground request never waits behind a whole
//! flush or compaction.
//!
//! Reads consult the layers newest first: the active memtable, the frozen
//! ones, then the segments. What memory can answer completes at once; a
//! read that needs a block not in the cache captures its snapshot (the list
//! of segments still to consult, and list operands found so far) and issues
//! the block read; reads waiting for the same block share one I/O. Because
//! writes never wait and every read fixes its snapshot at submission, each
//! key's effects take place in submission order: a put submitted after a
//! pending get is not seen by it, and a get submitted after the put sees it.

mod background;
mod budget;
mod checkpoint;
mod compact;
mod flush;
mod iter;
mod layers;
mod list_cap;
mod markers;
mod opening;
mod portable;
mod read;
mod source;
mod stream;
mod tier;
mod write;

pub use checkpoint::{
    CheckpointInfo, CheckpointSpec, MAX_UNCOMPLETED, Notify, Released, RestoreSpec, Restored,
    RestoredManifest,
};
pub use list_cap::MAX_LIST_LEN;
pub use portable::{
    ExportSpec, Fill, ImportHold, ImportSpec, ImportStep, Imported, MAX_EXPORTS, MAX_IMPORTS,
};
pub use tier::{TierConfig, TierStats};

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use slab::Slab;

use crate::aligned::{ALIGN, AlignedBuf};
use crate::bloom;
use crate::cache::{Ahead, Block, BlockCache};
use crate::error::StoreError;
use crate::format::{self, Kind};
use crate::hugemem::HugeArray;
use crate::io::{Io, IoCompletion, OpenMode};
use crate::keys;
use crate::manifest::{Clip, Region};
use crate::memtable::{ListBytes, Memtable};
use crate::ops::{IterMode, KeyRef, Op, Output, StateKind, Submitted, encode_element};
use crate::pool::Pool;
use crate::segment::{self, Segment, SegmentWriter};
use layers::{ImportRec, LAYERS_FILE, Layers, load_layers, save_layers};
use source::{HeldMemtable, MemCursor, Source};
use stream::{At, Cursor};

/// Store configuration.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub dir: PathBuf,
    /// Everything the store holds in memory (memtables, block cache,
    /// indexes, filters) stays within this.
    pub memory_budget: usize,
    /// Size at which the active memtable is frozen and flushed. Default:
    /// a quarter of the budget, between 4 MiB and 256 MiB.
    pub memtable_bytes: Option<usize>,
    /// Open segments with O_DIRECT where the file system allows.
    pub direct_io: bool,
    /// Compact when this many similar-sized segments are adjacent.
    pub compaction_trigger: usize,
    /// Records a flush or compaction processes per `poll` at most.
    pub work_per_poll: usize,
    /// Time a flush or compaction spends per `poll` at most (each checks
    /// it every few records): the shard's requests wait while a step
    /// runs, so a step must stay far below their latency target. Up to
    /// five times this while writes run out of room (see
    /// [`Store::write_headroom`]); a fortieth of it between the caller's
    /// requests (see `crate::pace`).
    pub background_slice: Duration,
    /// Local block reads finished per `poll` at most: this many, or an
    /// eighth of the block reads in flight if that is more; the rest wait
    /// for the next poll. A finished read's slot in the device stays empty
    /// until the caller, having taken the result, sends the next request.
    /// The reads in flight complete in bursts (28 of 32 per pass here),
    /// and finishing a whole burst before returning left the device half
    /// idle: random gets at depth 32 over a larger-than-memory store
    /// measured 38-47 K/s finishing every read per pass, 52-84 K/s with
    /// 4-8 (benches/RESULTS.md). Smaller costs more passes.
    pub disk_reads_per_poll: usize,
    /// After a failed flush or compaction, wait this long before retrying.
    pub retry_delay: Duration,
    /// An upper bound on the block cache (it otherwise takes whatever the
    /// budget leaves after memtables, indexes and filters).
    pub block_cache_max: Option<usize>,
    /// Completed checkpoints kept per owner at most. The engine says which
    /// it no longer needs (`Notify::Subsume`, as Flink does for those past
    /// `state.checkpoints.num-retained`); this cap only bounds an engine
    /// that never does: past it, the oldest completed ones are deleted
    /// when a newer one completes.
    pub retained_checkpoints: usize,
    /// Layers past which a checkpoint waits for compaction before it
    /// begins (see [`Store::checkpoint_should_wait`]); at least 3 x
    /// `compaction_trigger`, where a backlog is merged many at once.
    pub checkpoint_layer_limit: usize,
    /// Fault in the memtables' memory when the store opens (log chunks
    /// for two memtables, kept for reuse, and both indexes), on the
    /// opening thread, instead of as writes first reach it. Fresh pages
    /// cost a zero-fill on first touch (on this project's VM about 4 ms
    /// per 2 MiB, taken from the shard's core): without this, the first
    /// two memtables' worth of writes after a start pay it, with this the
    /// open does (benches/RESULTS.md). The memory is held from the start,
    /// as the JVM's `-XX:+AlwaysPreTouch` holds its heap.
    pub prefault_memory: bool,
    /// The largest list, in encoded bytes: an append that might take a
    /// list past it is refused (`list_cap`). At most [`MAX_LIST_LEN`].
    pub max_list_len: usize,
}

impl StoreConfig {
    pub fn new(dir: impl Into<PathBuf>, memory_budget: usize) -> StoreConfig {
        StoreConfig {
            dir: dir.into(),
            memory_budget,
            memtable_bytes: None,
            direct_io: true,
            compaction_trigger: 4,
            work_per_poll: 2048,
            background_slice: Duration::from_micros(200),
            disk_reads_per_poll: 8,
            retry_delay: Duration::from_millis(500),
            block_cache_max: None,
            retained_checkpoints: DEFAULT_RETAINED_CHECKPOINTS,
            checkpoint_layer_limit: DEFAULT_CHECKPOINT_LAYER_LIMIT,
            prefault_memory: false,
            max_list_len: MAX_LIST_LEN,
        }
    }

    fn memtable_bytes(&self) -> usize {
        self.memtable_bytes
            .unwrap_or((self.memory_budget / 4).clamp(4 << 20, 256 << 20))
    }
}

/// What the store holds in memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub memtables: usize,
    pub block_cache: usize,
    /// Segments' indexes and filters, and the block cache's per-segment
    /// slot arrays (4 bytes per block up to the highest cached).
    pub indexes_and_filters: usize,
    /// Held by a flush or compaction in progress (write buffers, read-ahead,
    /// the output's index and filter as they grow, a flush's sort), the
    /// last flush's sort buffers kept for the next, and portable exports
    /// and imports (read-ahead, write buffers): an upper estimate.
    pub background: usize,
    /// Checkpoint manifests kept in memory (retained ones, which restores
    /// and exports read, and those being written), with the engine's
    /// metadata in each.
    pub checkpoints: usize,
    pub budget: usize,
    /// The log bytes the active memtable freezes at: the configured
    /// size, or less where indexes, filters and background work leave
    /// less of the budget for memtables (see `budget`).
    pub memtable_limit: usize,
}

impl MemoryUsage {
    pub fn total(&self) -> usize {
        self.memtables
            + self.block_cache
            + self.indexes_and_filters
            + self.background
            + self.checkpoints
    }

    /// Memory the budget holds apart before it plans memtables and the
    /// cache: indexes and filters, and checkpoint manifests.
    pub(crate) fn resident_metadata(&self) -> usize {
        self.indexes_and_filters + self.checkpoints
    }
}

/// The sum of two stores' usage.
impl std::ops::Add for MemoryUsage {
    type Output = MemoryUsage;

    fn add(self, o: MemoryUsage) -> MemoryUsage {
        MemoryUsage {
            memtables: self.memtables + o.memtables,
            block_cache: self.block_cache + o.block_cache,
            indexes_and_filters: self.indexes_and_filters + o.indexes_and_filters,
            background: self.background + o.background,
            checkpoints: self.checkpoints + o.checkpoints,
            budget: self.budget + o.budget,
            memtable_limit: self.memtable_limit + o.memtable_limit,
        }
    }
}

/// Counters for operators and benchmarks.
#[derive(Clone, Debug, Default)]
pub struct StoreStats {
    pub segments: usize,
    pub segment_bytes: u64,
    pub flushes: u64,
    pub compactions: u64,
    pub block_reads: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub pending_reads: usize,
    /// Checkpoint manifests retained, and checkpoints in progress.
    pub checkpoints_retained: usize,
    pub checkpoints_in_progress: usize,
    /// The last background (flush/compaction) failure, if any; cleared
    /// when a flush lands.
    pub last_background_error: Option<StoreError>,
    /// Background failures since open, retried or not (a transient fault
    /// that a retry mended still counts: failures are reported, never
    /// hidden).
    pub background_failures: u64,
    /// Unreferenced segment files whose deletion failed (other than being
    /// gone already): they take disk space until the store reopens and
    /// removes what no layer or checkpoint references.
    pub delete_failures: u64,
    /// The remote tier's, when there is one.
    pub remote: Option<TierStats>,
    /// Times writes stalled (see [`Store::write_headroom`]) and for how
    /// long, by what held the memory when the stall began (indexed by
    /// [`StallCause::index`]; a stall in progress counts its time so far).
    /// [`StoreStats::write_stalls`] sums them.
    pub write_stalls_by_cause: [(u64, Duration); StallCause::ALL.len()],
    /// Torn files found at open: kept (something names them) and deleted.
    pub torn_kept: usize,
    pub torn_removed: usize,
}

impl StoreStats {
    /// Times writes stalled, and for how long in all, whatever the cause.
    pub fn write_stalls(&self) -> (u64, Duration) {
        self.write_stalls_by_cause
            .iter()
            .fold((0, Duration::ZERO), |(n, t), &(m, d)| (n + m, t + d))
    }
}

/// Why writes stopped (see [`Store::write_headroom`]): what held the
/// memtables' memory when the room ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StallCause {
    /// Memtables waiting for their flush: flushing is behind the writes.
    Flush,
    /// Flushed memtables waiting for the helper thread that clears them
    /// for reuse (it runs at a lower priority: a busy machine delays it).
    Clearing,
}

impl StallCause {
    pub const ALL: [StallCause; 2] = [StallCause::Flush, StallCause::Clearing];

    /// Its place in [`StoreStats::write_stalls_by_cause`].
    pub fn index(self) -> usize {
        match self {
            StallCause::Flush => 0,
            StallCause::Clearing => 1,
        }
    }

    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            StallCause::Flush => "flush",
            StallCause::Clearing => "clearing",
        }
    }
}

/// Whether the room writes have counts the flushed memtables a helper
/// thread is still clearing (see [`Store::write_room`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clearing {
    Counted,
    Left,
}

/// [`StoreConfig::retained_checkpoints`] unless set.
pub const DEFAULT_RETAINED_CHECKPOINTS: usize = 16;

/// The default [`StoreConfig::checkpoint_layer_limit`].
pub const DEFAULT_CHECKPOINT_LAYER_LIMIT: usize = 32;

/// The least [`StoreConfig::checkpoint_layer_limit`] that takes effect with
/// the default compaction trigger (3 x 4: compaction merges a backlog of
/// that many layers whatever their sizes).
pub const MIN_CHECKPOINT_LAYER_LIMIT: usize = 12;

/// What reopening a directory found.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    pub segments: usize,
    /// Corrupt segment files (complete, with a bad checksum), and
    /// incomplete ones a retained checkpoint names, set aside as `*.torn`
    /// (kept as evidence; what names them fails clearly), with why; and
    /// torn manifests, likewise set aside. (One a restored layer names
    /// fails the open instead, and stays where it is.)
    pub torn: Vec<(PathBuf, String)>,
    /// Incomplete segment files nothing names (a flush or compaction cut
    /// off by a crash; or `*.torn` files set aside by an earlier version),
    /// deleted, with why. Nothing durable lived only in
    /// them: a flush's records are durable only once its segment is
    /// complete, and a compaction's inputs outlive its output.
    pub torn_removed: Vec<(PathBuf, String)>,
    /// Segments superseded by a completed compaction: deleted, unless a
    /// retained checkpoint still names them.
    pub superseded: Vec<PathBuf>,
    /// Checkpoint manifests found intact (each pins its segments).
    pub manifests: usize,
    /// Files recovery meant to delete or set aside but could not, with
    /// the error: left where they were (the next open looks at them
    /// again; nothing live names them).
    pub left: Vec<(PathBuf, String)>,
}

impl RecoveryReport {
    /// Deletes `path` (gone already counts); false, with why in `left`,
    /// when it stays.
    pub(crate) fn remove(&mut self, path: &Path) -> bool {
        match std::fs::remove_file(path) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => {
                self.left
                    .push((path.to_path_buf(), format!("not deleted: {e}")));
                false
            }
        }
    }

    /// Renames `from` to `to`; false, with why in `left`, when it stays.
    pub(crate) fn rename(&mut self, from: &Path, to: &Path) -> bool {
        match std::fs::rename(from, to) {
            Ok(()) => true,
            Err(e) => {
                self.left.push((
                    from.to_path_buf(),
                    format!("not set aside as {}: {e}", to.display()),
                ));
                false
            }
        }
    }
}

/// What an I/O completion belongs to: the top byte of its token (below
/// it, [`value_of`]: the operation's own index, serial or sequence
/// number). Completions are dispatched by exhaustive matches on it, so a
/// new kind cannot fall through to another's handler unnoticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Tag {
    /// A get's (or a batch's) block read.
    Fetch = 1,
    FlushWrite = 2,
    FlushSync = 3,
    CompactWrite = 4,
    CompactSync = 5,
    CompactRead = 6,
    /// A segment's meta region read at open (reaped by the open itself).
    Open = 7,
    DirSync = 8,
    CkptWrite = 9,
    CkptSync = 10,
    CkptDirSync = 11,
    ExportRead = 12,
    ImportWrite = 13,
    ImportSync = 14,
    MarkerSync = 15,
    MarkerDirSync = 16,
    Unlink = 17,
    /// A step of the layer list's write (see `layers`).
    Layers = 18,
    /// A checkpoint segment's footer or metadata read (see `opening`).
    Opening = 19,
    /// The remote tier's own requests (`tier.rs`): never completions of
    /// the local I/O layer.
    TierUpload = 20,
    TierDelete = 21,
    TierPunch = 22,
    TierSync = 23,
    /// A block the remote tier fetched, written back into its local file.
    CacheWrite = 24,
    /// A read the remote serves: its value is the read's key in the
    /// tier's `bufs` (which keeps the store's own token), so an outcome
    /// finds its read by index, not by hashing.
    TierRead = 25,
    /// The eviction's scan of the local directories.
    TierScan = 26,
}

impl Tag {
    /// The tag a token carries (none: not one of the store's).
    #[inline]
    fn of(token: u64) -> Option<Tag> {
        Some(match token >> TAG_SHIFT {
            1 => Tag::Fetch,
            2 => Tag::FlushWrite,
            3 => Tag::FlushSync,
            4 => Tag::CompactWrite,
            5 => Tag::CompactSync,
            6 => Tag::CompactRead,
            7 => Tag::Open,
            8 => Tag::DirSync,
            9 => Tag::CkptWrite,
            10 => Tag::CkptSync,
            11 => Tag::CkptDirSync,
            12 => Tag::ExportRead,
            13 => Tag::ImportWrite,
            14 => Tag::ImportSync,
            15 => Tag::MarkerSync,
            16 => Tag::MarkerDirSync,
            17 => Tag::Unlink,
            18 => Tag::Layers,
            19 => Tag::Opening,
            20 => Tag::TierUpload,
            21 => Tag::TierDelete,
            22 => Tag::TierPunch,
            23 => Tag::TierSync,
            24 => Tag::CacheWrite,
            25 => Tag::TierRead,
            26 => Tag::TierScan,
            _ => return None,
        })
    }
}

const TAG_SHIFT: u32 = 56;
const VALUE_MASK: u64 = (1 << TAG_SHIFT) - 1;

/// Serial bits a job's tokens carry.
const SERIAL_MASK: u64 = 0xfff;

fn tag(t: Tag, v: u64) -> u64 {
    ((t as u64) << TAG_SHIFT) | v
}

/// The operation's own value in a token (an index, a job's serial, a
/// sequence number).
fn value_of(token: u64) -> u64 {
    token & VALUE_MASK
}

/// Part of the key space removed from every layer up to `max_order`: a
/// key-group delete (every state) or the state a restore replaced.
#[derive(Clone, Debug, PartialEq, Eq)]
struct KgDelete {
    region: Region,
    max_order: u64,
}

impl KgDelete {
    #[inline]
    fn hides(&self, order: u64, key: &[u8]) -> bool {
        order <= self.max_order && self.region.contains(key)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadKind {
    Get,
    ListGet,
    MapGet,
    MapContains,
}

/// A read waiting for a block.
struct PendingRead {
    token: u64,
    kind: ReadKind,
    key: Vec<u8>,
    h: u64,
    /// Map reads: the base (clear-marker) key length and hash.
    base_len: usize,
    hb: u64,
    /// Segments still to consult, oldest first (the next is the last).
    layers: Vec<Rc<Segment>>,
    /// List operands found in newer layers, newest first.
    operands: Vec<Vec<u8>>,
    /// 0: look up the key in the current segment; 1: the map's base.
    stage: u8,
    /// The block of one layer (the current one after a fetch, or one a
    /// batch located ahead), used instead of the filter, index and cache.
    hint: Option<Hint>,
}

/// A map iteration waiting for blocks.
struct PendingIter {
    token: u64,
    base: Vec<u8>,
    start: Vec<u8>,
    mode: IterMode,
    max_bytes: usize,
    /// Memtable layers' entries (newest wins), captured at submission.
    mem: BTreeMap<Vec<u8>, Option<Vec<u8>>>,
    mem_capped_at: Option<Vec<u8>>,
    layers: Vec<Rc<Segment>>,
    pinned: HashMap<(u64, u32), Rc<Block>>,
}

/// A block read in flight, shared by every read that needs it.
struct Fetch {
    seg: Rc<Segment>,
    block: u32,
    reads: Vec<usize>,
    iters: Vec<usize>,
    /// Served by the local disk (with a remote tier, a local block that
    /// fails its checksum is read from the remote instead, once).
    local: bool,
    retried: bool,
}

/// A finished read waiting to be delivered by `poll`.
enum Resolved {
    /// Done, with no output.
    Done,
    NotFound,
    Block(Rc<Block>, std::ops::Range<usize>),
    Owned(Vec<u8>),
    Contains(bool),
    Page {
        data: Vec<u8>,
        entries: u32,
        last_key: Vec<u8>,
        more: bool,
    },
    Imported(Imported),
}

/// Outcome of evaluating a read against the layers it can reach now.
enum Step {
    Done(Resolved),
    Wait(Rc<Segment>, u32),
}

enum Immediate {
    /// Answered by the active memtable without copying.
    ActiveValue(u64),
    Frozen(usize, u64),
    Resolved(Resolved),
}

struct FlushJob {
    mem: Arc<Memtable>,
    order: FlushOrder,
    writer: SegmentWriter,
    bottom: bool,
    /// All records added; waiting for writes, then for the fsyncs.
    syncing: bool,
    scratch: Vec<u8>,
    /// In its I/O tokens: completions of an abandoned job's writes (still
    /// in flight when it was dropped) are not taken for a later job's.
    serial: u64,
    /// The segment's id, taken at the start: its blocks enter the block
    /// cache under it as they are written.
    id: u64,
}

/// The records a flush writes, in key order.
enum FlushOrder {
    /// Being sorted, in steps (see `crate::sorted`).
    Sorting(Box<crate::sorted::Sort>),
    /// Sorted; the records from the index on are still to be written.
    Sorted(crate::sorted::Sorted, usize),
}

struct CompactJob {
    /// Newest first.
    inputs: Vec<Rc<Segment>>,
    cursors: Vec<Cursor>,
    writer: SegmentWriter,
    bottom: bool,
    clear: Option<(Vec<u8>, usize)>,
    syncing: bool,
    error: Option<StoreError>,
    scratch: Vec<u8>,
    /// As `FlushJob::serial` (12 bits in read tokens).
    serial: u64,
    /// Memory its read-ahead and its output's index and filter may take
    /// (the inputs' together: the index is reserved for that much, the
    /// filter sized for their records and folded), counted in the budget
    /// (`Store::compaction_fits` admitted it).
    reserve: usize,
    /// The output's id, as `FlushJob::id`.
    id: u64,
    /// Records of dropped states it leaves out.
    dropped: crate::dropped::DroppedFilter,
}

/// Blocks of read-ahead per compaction input.
const COMPACT_READ_BLOCKS: usize = 64;
/// Entries a map iteration collects per layer before cutting the page.
const ITER_LAYER_CAP: usize = 4096;

/// The storage engine over an I/O layer `I`.
pub struct Store<I: Io> {
    cfg: StoreConfig,
    io: I,
    active: Memtable,
    /// Newest first, each with the order its segment will get.
    frozen: Vec<(u64, Arc<Memtable>)>,
    /// Newest first.
    segments: Vec<Rc<Segment>>,
    retired: Vec<Rc<Segment>>,
    /// Compaction inputs whose files may be deleted once the directory
    /// entry of the compaction's output is durable (a directory fsync).
    awaiting_dir_sync: Vec<Rc<Segment>>,
    dir_sync_in_flight: bool,
    dir_file: Option<crate::io::FileId>,
    /// `compact_all` was called: the next compaction takes every segment.
    full_compaction_requested: bool,
    /// `stop_compacting` was called: no compaction starts (a stop).
    stopping: bool,
    cache: BlockCache,
    reads: Pool<PendingRead>,
    iters: Slab<PendingIter>,
    fetches: Pool<Fetch>,
    fetch_index: rustc_hash::FxHashMap<(u64, u32), usize>,
    /// Fetches not issued yet, oldest first (see `Store::read_room`).
    fetches_waiting: VecDeque<usize>,
    done: VecDeque<(u64, Result<Resolved, StoreError>)>,
    flush: Option<FlushJob>,
    compact: Option<CompactJob>,
    kg_deletes: Vec<KgDelete>,
    /// States whose records compaction leaves out (`set_dropped_states`).
    dropped: Option<Arc<crate::DroppedStates>>,
    /// Checkpoints: retained manifests, pinned files, checkpoints in
    /// progress (see `checkpoint.rs`).
    ckpt: checkpoint::Checkpoints,
    /// Portable exports and imports in progress (see `portable.rs`).
    exports: Slab<portable::Export>,
    /// The layer list's write to the disk (see `layers`).
    layers: Layers,
    /// Checkpoint layers being opened for restores and exports, the last
    /// one's serial, and the restores that ended (see `opening`).
    openings: Vec<opening::Opening>,
    opening_serial: u64,
    restored: VecDeque<(u64, Result<Restored, StoreError>)>,
    /// Serial of the next flush or compaction job.
    job_serial: u64,
    imports: Slab<portable::Import>,
    next_import_file: u64,
    /// The last import hold handed out (see `Store::import_hold`).
    import_holds: u64,
    next_order: u64,
    next_segment_id: u64,
    retry_at: Option<Instant>,
    /// Flushed memtables' memory, for the next memtables.
    reuse: Arc<crate::reuse::Reuse>,
    /// Since when writes have been stalled (see `write_headroom`).
    stalled_since: Option<(Instant, StallCause)>,
    /// Unlinks issued and not completed, by serial (see `Store::unlink`).
    unlinking: Vec<(u64, PathBuf)>,
    unlink_serial: u64,
    /// The last flush's sort memory, for the next (see `crate::sorted`).
    sort_buffers: crate::sorted::Buffers,
    /// The next memtable's index, made ahead of the first freeze (see
    /// `Store::after_write`).
    next_index: Option<HugeArray<u64>>,
    /// Whether the active memtable's `after_write` looked for one.
    next_index_looked: bool,
    /// See `Store::memtable_limit`.
    memtable_limit: usize,
    /// The reserve of a compaction waiting for room (see
    /// `Store::compaction_fits`); 0 when none waits.
    compaction_wanted: usize,
    /// The shard's time background steps may take (see `crate::pace`).
    pacer: crate::pace::Pacer,
    stats: StoreStats,
    completions: Vec<IoCompletion>,
    /// Holds what an immediate `Output` borrows.
    scratch: Vec<u8>,
    held_block: Option<Rc<Block>>,
    /// Reused by `submit_batch`: the batch's encoded keys and their spans.
    batch_keys: Vec<u8>,
    batch_spans: Vec<(usize, usize, u64)>,
    /// The remote tier, when configured (`Store::open_tiered`).
    tier: Option<tier::Tier>,
}

/// Keys and values larger than this are refused.
pub const MAX_VALUE_LEN: usize = 64 << 20;

fn check_key(k: &KeyRef<'_>) -> Result<(), StoreError> {
    if k.key.len() > keys::MAX_PART_LEN {
        return Err(StoreError::TooLarge {
            what: "key",
            len: k.key.len(),
            max: keys::MAX_PART_LEN,
        });
    }
    if k.namespace.len() > keys::MAX_PART_LEN {
        return Err(StoreError::TooLarge {
            what: "namespace",
            len: k.namespace.len(),
            max: keys::MAX_PART_LEN,
        });
    }
    Ok(())
}

fn encode(k: &KeyRef<'_>, user_key: Option<&[u8]>) -> Result<Vec<u8>, StoreError> {
    check_key(k)?;
    let mut out = Vec::new();
    keys::encode_base(&mut out, k.key_group, k.state, k.key, k.namespace);
    if let Some(u) = user_key {
        out.extend_from_slice(u);
    }
    if out.len() > keys::MAX_KEY_LEN {
        return Err(StoreError::TooLarge {
            what: "encoded key",
            len: out.len(),
            max: keys::MAX_KEY_LEN,
        });
    }
    Ok(out)
}

/// An encoded key: on the stack when it fits (the common case), so that a
/// read answered from memory allocates nothing.
struct KeyBuf {
    inline: [u8; KeyBuf::INLINE],
    len: usize,
    heap: Vec<u8>,
}

impl KeyBuf {
    const INLINE: usize = 128;

    fn encode(k: &KeyRef<'_>, user_key: Option<&[u8]>) -> Result<KeyBuf, StoreError> {
        check_key(k)?;
        let u = user_key.unwrap_or_default();
        let len = keys::HEADER_LEN + k.key.len() + 4 + k.namespace.len() + u.len();
        if len > keys::MAX_KEY_LEN {
            return Err(StoreError::TooLarge {
                what: "encoded key",
                len,
                max: keys::MAX_KEY_LEN,
            });
        }
        let mut b = KeyBuf {
            inline: [0; KeyBuf::INLINE],
            len,
            heap: Vec::new(),
        };
        if len > KeyBuf::INLINE {
            b.heap = encode(k, user_key)?;
            return Ok(b);
        }
        let mut at = 0;
        for part in [
            &k.key_group.to_be_bytes()[..],
            &k.state.to_be_bytes(),
            &(k.key.len() as u32).to_be_bytes(),
            k.key,
            &(k.namespace.len() as u32).to_be_bytes(),
            k.namespace,
            u,
        ] {
            b.inline[at..at + part.len()].copy_from_slice(part);
            at += part.len();
        }
        Ok(b)
    }

    fn as_slice(&self) -> &[u8] {
        if self.len > KeyBuf::INLINE {
            &self.heap
        } else {
            &self.inline[..self.len]
        }
    }
}

fn check_value(v: &[u8]) -> Result<(), StoreError> {
    if v.len() > MAX_VALUE_LEN {
        return Err(StoreError::TooLarge {
            what: "value",
            len: v.len(),
            max: MAX_VALUE_LEN,
        });
    }
    Ok(())
}

/// Joins a base value (if any) with operands given newest first.
fn join(base: Option<&[u8]>, operands: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(joined_len(base, operands));
    join_into(&mut out, base, operands);
    out
}

/// Whether a clear marker seen in a newer layer (its base key and the
/// layer's rank; ranks count from the newest) hides `key` of layer `rank`:
/// every entry under the marker's map in an older layer.
fn cleared(clear: &Option<(Vec<u8>, usize)>, key: &[u8], rank: usize) -> bool {
    clear
        .as_ref()
        .is_some_and(|(cb, cr)| key.starts_with(cb) && key.len() > cb.len() && rank > *cr)
}

/// Bytes of `base` and `operands` joined.
fn joined_len<T: AsRef<[u8]>>(base: Option<&[u8]>, operands: &[T]) -> usize {
    base.map_or(0, <[u8]>::len) + operands.iter().map(|o| o.as_ref().len()).sum::<usize>()
}

/// Appends `base`, then the list operands oldest first (they come newest
/// first), to `out`.
fn join_into<T: AsRef<[u8]>>(out: &mut Vec<u8>, base: Option<&[u8]>, operands: &[T]) {
    if let Some(b) = base {
        out.extend_from_slice(b);
    }
    for o in operands.iter().rev() {
        out.extend_from_slice(o.as_ref());
    }
}

fn corrupt(seg: &Segment, offset: u64, what: &'static str) -> StoreError {
    StoreError::Corrupt {
        path: seg.path.display().to_string(),
        offset,
        what,
    }
}

/// A segment file whose length is not whole pages (a write cut off).
const NOT_WHOLE_PAGES: &str = "file length is not a whole number of pages (torn)";
/// A segment file shorter than its footer says (a write cut off).
const SHORTER_THAN_FOOTER: &str = "file shorter than its footer says (torn)";

/// Whether a segment failed its checks the way a write a crash cut off
/// fails them (short, not whole pages, no footer), not with a bad
/// checksum; a complete file whose footer page was damaged looks the same,
/// so `Store::open` also asks where the file sits. Told by the failure's
/// own constant, not by its wording.
fn cut_off(e: &StoreError) -> bool {
    matches!(e, StoreError::Corrupt { what, .. }
        if [NOT_WHOLE_PAGES, SHORTER_THAN_FOOTER, format::BAD_FOOTER_MAGIC].contains(what))
}

impl<I: Io> Store<I> {
    /// Opens (or creates) the store in `cfg.dir`, recovering every segment
    /// that was completely written and setting aside torn ones.
    pub fn open(cfg: StoreConfig, io: I) -> Result<(Store<I>, RecoveryReport), StoreError> {
        Self::open_inner(cfg, io, false)
    }

    /// `open`, for a store with a remote tier (`tiered`) or without one:
    /// without, a segment whose data region has a hole (evicted to a remote
    /// tier that is no longer configured) refuses the open rather than
    /// failing every read of it.
    pub(super) fn open_inner(
        cfg: StoreConfig,
        mut io: I,
        tiered: bool,
    ) -> Result<(Store<I>, RecoveryReport), StoreError> {
        if cfg.max_list_len > MAX_LIST_LEN {
            return Err(StoreError::Invalid(
                "max_list_len must be at most MAX_LIST_LEN (1 GiB)",
            ));
        }
        if cfg.memtable_bytes() > cfg.memory_budget / 2 {
            return Err(StoreError::Invalid(
                "memtable_bytes must be at most half the memory budget: the active memtable and the one being flushed share it",
            ));
        }
        let dir_err = |msg: String| StoreError::Dir {
            path: cfg.dir.display().to_string(),
            msg,
        };
        std::fs::create_dir_all(&cfg.dir).map_err(|e| dir_err(e.to_string()))?;
        let mut report = RecoveryReport::default();
        let mut found: Vec<(u64, u32, PathBuf)> = Vec::new();
        // Segment files that failed their checks, each with the name it
        // had, why, and whether it is incomplete (a write a crash cut
        // off) rather than corrupt (complete, with a bad checksum).
        let mut torn: Vec<(PathBuf, String, String, bool)> = Vec::new();
        for e in std::fs::read_dir(&cfg.dir).map_err(|e| dir_err(e.to_string()))? {
            let e = e.map_err(|e| dir_err(e.to_string()))?;
            let name = e.file_name().to_string_lossy().to_string();
            if let Some((o, g)) = segment::parse_file_name(&name) {
                found.push((o, g, e.path()));
            } else if let Some(was) = segment::parse_torn_file_name(&name) {
                // Set aside by an earlier open (or version): checked again,
                // so that only a cut-off write may go.
                let (why, incomplete) =
                    match Self::open_segment(&mut io, &e.path(), 0, &mut Vec::new()) {
                        Ok(seg) => {
                            io.close(seg.file);
                            ("set aside at an earlier open".to_string(), false)
                        }
                        Err(e) => (format!("set aside at an earlier open: {e}"), cut_off(&e)),
                    };
                torn.push((e.path(), was, why, incomplete));
            }
        }
        found.sort();
        // New segments take orders above every name seen here, damaged
        // files' too: a name is never given to a second file.
        let seen_order = found
            .iter()
            .map(|(o, _, _)| *o)
            .chain(
                torn.iter()
                    .filter_map(|(_, was, _, _)| segment::parse_file_name(was).map(|(o, _)| o)),
            )
            .max()
            .unwrap_or(0);
        let mut segs: Vec<Segment> = Vec::new();
        let mut next_id = 1u64;
        for (_, _, path) in found {
            match Self::open_segment(&mut io, &path, next_id, &mut Vec::new()) {
                Ok(s) => {
                    next_id += 1;
                    segs.push(s);
                }
                // Corruption or a torn write: set the file aside (never
                // overwriting an earlier one) and report it. Anything else
                // (a newer format version, EMFILE, EACCES...) stops the open:
                // the file may be fine, and guessing would lose it.
                Err(e) => {
                    let incomplete = match &e {
                        StoreError::Corrupt { what, .. }
                            if *what == format::UNSUPPORTED_VERSION =>
                        {
                            return Err(e);
                        }
                        StoreError::Corrupt { .. } => cut_off(&e),
                        _ => return Err(e),
                    };
                    let name = path.file_name().map(|n| n.to_string_lossy().to_string());
                    torn.push((path, name.unwrap_or_default(), e.to_string(), incomplete));
                }
            }
        }
        // A completed compaction supersedes the inputs whose orders it
        // covers with a lower generation (a crash can leave both).
        let covered = |s: &Segment, by: &Segment| {
            supersedes(
                &by.footer,
                s.footer.generation,
                s.footer.min_order,
                s.footer.order,
            )
        };
        let mut keep = Vec::new();
        for (i, s) in segs.iter().enumerate() {
            if segs
                .iter()
                .enumerate()
                .any(|(j, by)| i != j && covered(s, by))
            {
                report.superseded.push(s.path.clone());
            } else {
                keep.push(i);
            }
        }
        // Manifests of retained checkpoints pin the segments they name, and
        // restored layers (`LAYERS`) name theirs: those stay on disk even
        // when compaction superseded their own layer. An import a completed
        // compaction merged (the list is rewritten lazily) is dropped: the
        // output holds its records, and its file may be gone.
        let ckpt = checkpoint::Checkpoints::load(&cfg.dir, &mut report)?;
        let (kg_deletes, imports, mut rewrite) = load_layers(&cfg.dir)?;
        // An incomplete segment nothing names (no retained checkpoint, no
        // restored layer) is deleted, or every crash under systemd's
        // Restart=on-failure would leak a segment's worth of disk, but only
        // where a write a crash cut off can be: newer than every complete
        // segment (a flush), or a compaction's output whose newest input
        // is still there. A restored layer's fails the open before anything
        // changes, and stays where it is: a later open that reads it sound
        // has it again (a read error need not last; set aside, a passing
        // fault failed every later open, as a seeded simulation of the
        // daemon found). An open that went on without it could not leave it
        // in place: out of the layers, a segment could come back at a later
        // open after compactions had dropped the deletes that hid its
        // records. So one a checkpoint names (which then fails clearly), a
        // corrupt one (complete, with a bad checksum: evidence of the
        // disk), and one of the right shape in the wrong place (a complete
        // segment whose footer was damaged looks cut off) are set aside.
        let newest = segs.iter().map(|s| s.footer.order).max();
        let in_flight = |was: &str| {
            segment::parse_file_name(was).is_some_and(|(o, g)| {
                newest.is_none_or(|n| o > n)
                    || (g > 0
                        && segs
                            .iter()
                            .any(|s| s.footer.order == o && s.footer.generation < g))
            })
        };
        if let Some((_, was, why, _)) = torn.iter().find(|(path, was, _, _)| {
            path.file_name().is_some_and(|n| *n == **was)
                && imports.iter().any(|imp| imp.name == *was)
        }) {
            return Err(StoreError::Restore(format!(
                "{LAYERS_FILE} names {was} for a restored state, which failed its checks (left where it is): {why}"
            )));
        }
        // Every restored layer's file is opened before any segment is set
        // aside or deleted: an open that fails here must have moved none
        // (a read error need not last, and a compaction output set aside
        // by one would leave the layers it merged, whose files are gone,
        // failing every later open; the simulator found it).
        let (merged, imports): (Vec<ImportRec>, Vec<ImportRec>) =
            imports.into_iter().partition(|imp| {
                keep.iter()
                    .any(|&j| supersedes(&segs[j].footer, imp.generation, imp.order, imp.order))
            });
        rewrite |= !merged.is_empty();
        // Segments a restore references, under the order the restore gave
        // them.
        let mut restored = Vec::new();
        for imp in &imports {
            let path = tier::layer_path(&cfg.dir, &imp.name);
            let cannot = |e: StoreError| {
                StoreError::Restore(format!(
                    "{} names {} for a restored state, which cannot be opened: {e}",
                    LAYERS_FILE, imp.name
                ))
            };
            // A file that is also a layer of its own shares its metadata.
            let mut seg = match keep.iter().map(|&j| &segs[j]).find(|s| s.path == path) {
                Some(k) => {
                    let file = io
                        .open(&path, OpenMode::Read)
                        .map_err(|e| cannot(StoreError::io(&path, "open", &e)))?;
                    k.another_layer(next_id, file)
                }
                None => {
                    Self::open_segment(&mut io, &path, next_id, &mut Vec::new()).map_err(cannot)?
                }
            };
            next_id += 1;
            seg.footer.order = imp.order;
            seg.footer.min_order = imp.order;
            seg.clip = Some(imp.clip.clone());
            restored.push(seg);
        }
        for (path, was, why, incomplete) in torn {
            let layer = imports.iter().chain(&merged).any(|imp| imp.name == was);
            let named = layer || ckpt.pinned(&was);
            if incomplete && !named && in_flight(&was) {
                if report.remove(&path) {
                    report.torn_removed.push((path, why));
                }
            } else if path.file_name().is_some_and(|n| *n == *was) && !layer {
                let mut aside = path.with_extension("torn");
                let mut n = 1;
                while aside.exists() {
                    aside = path.with_extension(format!("torn.{n}"));
                    n += 1;
                }
                if report.rename(&path, &aside) {
                    report.torn.push((aside, why));
                } else {
                    report.torn.push((path, why));
                }
            } else {
                report.torn.push((path, why));
            }
        }
        let mut live: Vec<Rc<Segment>> = Vec::new();
        let mut superseded_kept = Vec::new();
        for (i, s) in segs.into_iter().enumerate() {
            if keep.contains(&i) {
                live.push(Rc::new(s));
            } else {
                io.close(s.file);
                let name = s.name();
                if ckpt.pinned(&name) || imports.iter().any(|imp| imp.name == name) {
                    superseded_kept.push(s.footer);
                } else {
                    report.remove(&s.path);
                }
            }
        }
        // Import files no layer list and no manifest names: an import that
        // never installed (a crash, or a refused snapshot), or a merged one.
        let mut next_import_file = 1;
        for e in std::fs::read_dir(&cfg.dir).map_err(|e| dir_err(e.to_string()))? {
            let e = e.map_err(|e| dir_err(e.to_string()))?;
            let name = e.file_name().to_string_lossy().to_string();
            let Some(serial) = segment::parse_import_file_name(&name) else {
                continue;
            };
            next_import_file = next_import_file.max(serial + 1);
            if !ckpt.pinned(&name)
                && !imports.iter().any(|imp| imp.name == name)
                && report.remove(&e.path())
            {
                report.superseded.push(e.path());
            }
        }
        if !report.torn.is_empty()
            || !report.torn_removed.is_empty()
            || !report.superseded.is_empty()
        {
            // Make the renames and deletes durable before anything new.
            std::fs::File::open(&cfg.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| dir_err(e.to_string()))?;
        }
        live.extend(restored.into_iter().map(Rc::new));
        if !tiered
            && let Some(s) = live
                .iter()
                .find(|s| tier::has_hole(&s.path, tier::data_end(&s.footer)))
        {
            return Err(StoreError::Dir {
                path: cfg.dir.display().to_string(),
                msg: format!(
                    "segment {} holds only part of its data: the rest is on a remote tier; open it with the remote tier configured ([remote])",
                    s.path.display()
                ),
            });
        }
        sort_layers(&mut live);
        report.segments = live.len();
        let next_order = live
            .iter()
            .map(|s| s.footer.order + 1)
            .chain(superseded_kept.iter().map(|f| f.order + 1))
            .chain(std::iter::once(seen_order + 1))
            .max()
            .unwrap_or(1);
        if rewrite {
            save_layers(&cfg.dir, &kg_deletes, &live)?;
        }
        // New layers must be newer than every recorded key-group delete,
        // even if the layers it was recorded against were never flushed.
        let next_order = next_order.max(
            kg_deletes
                .iter()
                .map(|d| d.max_order + 1)
                .max()
                .unwrap_or(0),
        );
        let memtable_entries = initial_entries(&cfg);
        let memtable_limit = cfg.memtable_bytes();
        let reuse = Arc::new(crate::reuse::Reuse::new(2 * memtable_limit));
        let mut store = Store {
            cache: BlockCache::new(cfg.memory_budget / 2),
            active: Memtable::new(memtable_entries),
            cfg,
            io,
            frozen: Vec::new(),
            segments: live,
            retired: Vec::new(),
            awaiting_dir_sync: Vec::new(),
            dir_sync_in_flight: false,
            dir_file: None,
            full_compaction_requested: false,
            stopping: false,
            reads: Pool::default(),
            iters: Slab::new(),
            fetches: Pool::default(),
            fetch_index: Default::default(),
            fetches_waiting: VecDeque::new(),
            done: VecDeque::new(),
            flush: None,
            compact: None,
            kg_deletes,
            dropped: None,
            ckpt,
            exports: Slab::new(),
            layers: Layers::default(),
            openings: Vec::new(),
            opening_serial: 0,
            restored: VecDeque::new(),
            job_serial: 0,
            imports: Slab::new(),
            next_import_file,
            import_holds: 0,
            next_order,
            next_segment_id: next_id,
            retry_at: None,
            stalled_since: None,
            pacer: Default::default(),
            sort_buffers: Default::default(),
            unlinking: Vec::new(),
            unlink_serial: 0,
            next_index: None,
            next_index_looked: false,
            memtable_limit,
            compaction_wanted: 0,
            reuse,
            stats: StoreStats {
                torn_kept: report.torn.len(),
                torn_removed: report.torn_removed.len(),
                ..StoreStats::default()
            },
            completions: Vec::new(),
            scratch: Vec::new(),
            held_block: None,
            batch_keys: Vec::new(),
            batch_spans: Vec::new(),
            tier: None,
        };
        store.rebalance_cache();
        if store.cfg.prefault_memory {
            store.prefault_memory();
        } else {
            let (addr, len) = store.active.index_range();
            store.io.prefault(addr, len);
        }
        Ok((store, report))
    }

    /// Reads a segment's footer and meta region (at open; waits for the I/O).
    /// Other operations that complete meanwhile are appended to `others`
    /// (the store's own completions, when the store is running).
    pub(super) fn open_segment(
        io: &mut I,
        path: &Path,
        id: u64,
        others: &mut Vec<IoCompletion>,
    ) -> Result<Segment, StoreError> {
        let file = io
            .open(path, OpenMode::Read)
            .map_err(|e| StoreError::io(path, "open", &e))?;
        let r = (|| {
            let len = io
                .file_len(file)
                .map_err(|e| StoreError::io(path, "stat", &e))?;
            let page = format::footer_page(len).ok_or(StoreError::Corrupt {
                path: path.display().to_string(),
                offset: len,
                what: NOT_WHOLE_PAGES,
            })?;
            let fbuf = read_sync(io, file, page, ALIGN, path, others)?;
            let footer = format::Footer::decode(&fbuf, len).map_err(|m| StoreError::Corrupt {
                path: path.display().to_string(),
                offset: page,
                what: m.0,
            })?;
            let meta_off = tier::data_end(&footer);
            let meta_len = (page - meta_off) as usize;
            let meta = read_sync(io, file, meta_off, meta_len, path, others)?;
            Segment::from_parts(id, path.to_path_buf(), file, len, &fbuf, &meta, meta_off)
        })();
        if r.is_err() {
            io.close(file);
        }
        r
    }

    /// The I/O layer (tests inspect a fault injector through it).
    pub fn io(&self) -> &I {
        &self.io
    }

    /// The I/O layer, mutably (tests re-plan faults through it).
    pub fn io_mut(&mut self) -> &mut I {
        &mut self.io
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// How much room writes have left before they must wait for a flush:
    /// 1.0 while no flush is behind, falling to 0.0 as the memtables
    /// approach two memtables' worth (one flushing, one filled after
    /// it), which is all the memory budget plans for them. The store never
    /// refuses a write for this. Its caller takes requests in proportion
    /// (a client then sees its queue fill a little at a time) and none at
    /// 0.0, and keeps polling, so the flush, whose share of the caller's
    /// time grows as the room falls (`crate::pace`), catches up: writes
    /// slow down smoothly instead of
    /// stopping at once. Each stop (0.0) is counted and timed in
    /// [`StoreStats`]. While background work fails (a full disk) it stays
    /// 1.0: writes then go on until the memtables pass the whole budget
    /// and are refused with the failure as their cause, which a client
    /// can act on, rather than wait in silence.
    pub fn write_headroom(&mut self) -> f64 {
        let headroom = self.headroom();
        match (headroom == 0.0, self.stalled_since) {
            (true, None) => {
                let cause = self.stall_cause();
                self.stalled_since = Some((crate::clock::now(), cause));
                self.stats.write_stalls_by_cause[cause.index()].0 += 1;
            }
            (false, Some((t, cause))) => {
                self.stats.write_stalls_by_cause[cause.index()].1 += crate::clock::elapsed(t);
                self.stalled_since = None;
            }
            _ => {}
        }
        headroom
    }

    /// What holds the memtables' memory now: memtables still to flush, or
    /// flushed ones still being cleared, whichever holds more.
    fn stall_cause(&self) -> StallCause {
        if self.reuse.incoming_bytes() > self.frozen_bytes() {
            StallCause::Clearing
        } else {
            StallCause::Flush
        }
    }

    /// See [`Store::write_headroom`] (without counting stalls).
    fn headroom(&self) -> f64 {
        self.headroom_of(Clearing::Counted)
    }

    /// The write room as flushes can give it back: [`Store::headroom`]
    /// without the memtables a helper thread is still clearing, which no
    /// flush or compaction step of the shard's frees sooner (pacing them
    /// up for it would only take the helper's CPU).
    fn flush_headroom(&self) -> f64 {
        self.headroom_of(Clearing::Left)
    }

    fn headroom_of(&self, clearing: Clearing) -> f64 {
        let held = clearing == Clearing::Counted && self.reuse.incoming_bytes() > 0;
        if self.frozen.is_empty() && !held {
            return 1.0;
        }
        // A memtable holds whole chunks: the plan's room for one.
        let m = self
            .memtable_limit()
            .next_multiple_of(crate::memtable::CHUNK);
        (self.room(clearing) as f64 / m.max(1) as f64).min(1.0)
    }

    /// Bytes the frozen memtables hold.
    pub(super) fn frozen_bytes(&self) -> usize {
        self.frozen.iter().map(|(_, m)| m.memory_bytes()).sum()
    }

    /// Bytes writes may add before the memtables (the active one, and
    /// those frozen until their flush lands) hold two memtables' worth of
    /// memory, all the memory budget plans for them
    /// ([`Store::memtable_plan`]). A caller that takes writes should stop
    /// at this (after at least one, so a write larger than the room still
    /// goes in: the memtables then pass the plan by at most one write,
    /// [`MAX_VALUE_LEN`]) and leave the rest queued. Frozen memtables count
    /// all the memory they hold: checkpoints freeze memtables early, and
    /// many small ones waiting for their flushes each hold a log chunk and
    /// an index (the hostile soak piled up fourteen). The active one counts
    /// its log and index as they grow, so the room falls a write at a
    /// time; its chunk being filled and those mapped ahead are held beside
    /// that, and the room leaves them their place in the plan (without it
    /// the memtables passed the plan by those three chunks, a test on a
    /// 48 MiB budget found). Flushed memtables a helper thread is still
    /// clearing count until it is done: under CPU contention they piled
    /// up past the budget while writes went on. With background work
    /// failing (a full disk) it is unbounded: writes go on until the
    /// memtables pass the whole budget and are refused with the failure as
    /// their cause (`check_memory`), rather than wait in silence for as
    /// long as the failure lasts.
    pub fn write_room(&self) -> usize {
        self.room(Clearing::Counted)
    }

    /// [`Store::write_room`], counting the memtables being cleared or not.
    fn room(&self, clearing: Clearing) -> usize {
        if self.stats.last_background_error.is_some() {
            return usize::MAX;
        }
        let cleared = match clearing {
            Clearing::Counted => self.reuse.incoming_bytes(),
            Clearing::Left => 0,
        };
        let used = self.frozen_bytes() + cleared + self.active.written_bytes();
        let ahead = (crate::memtable::SPARES_AHEAD + 1) * crate::memtable::CHUNK;
        self.memtable_plan().saturating_sub(used + ahead)
    }

    /// The caller spent `busy` on requests since its last `poll`: flush
    /// and compaction steps are paced to a share of it (see `crate::pace`).
    /// A caller that never says lets them run at every poll.
    pub fn note_foreground(&mut self, busy: Duration) {
        let cap = 2 * self.cfg.background_slice;
        self.pacer.foreground(busy, self.background_share(), cap);
    }

    /// The share of the caller's time flushes and compactions take: a
    /// quarter while writes have at least half a memtable of room (a
    /// flush's sort and writes take about that of a full core at full
    /// write speed, measured in benches/RESULTS.md), all of it as the room
    /// runs out; at least half while a checkpoint waits for a flush (the
    /// engine's barrier waits for it) or checkpoints wait for compaction
    /// (see [`Store::checkpoint_should_wait`]).
    pub(super) fn background_share(&self) -> f64 {
        const BASE: f64 = crate::pace::BASE_SHARE;
        const AWAITED: f64 = 0.5;
        const FROM: f64 = 0.5;
        let short = ((FROM - self.flush_headroom()) / FROM).clamp(0.0, 1.0);
        let share = BASE + (1.0 - BASE) * short;
        if self.checkpoint_awaits_flush() || self.checkpoint_should_wait() {
            share.max(AWAITED)
        } else {
            share
        }
    }

    /// When a flush or compaction step must end: `background_slice` from
    /// now, up to five times that as writes run out of room (a flush that
    /// falls behind gets more of the shard); a fortieth of it (5 us)
    /// between a caller's requests unless writes are out of room. A task that sends one read at a time (Flink's
    /// synchronous backend) sends the next a few microseconds after each
    /// answer, into the step the shard began meanwhile: with full slices
    /// a Flink job ran at a twentieth of its rate while a flush ran.
    fn step_deadline(&self) -> Instant {
        if self.pacer.idle() {
            return crate::clock::now() + self.cfg.background_slice / 40;
        }
        let stretch = 1.0 + 4.0 * (1.0 - self.flush_headroom());
        crate::clock::now() + self.cfg.background_slice.mul_f64(stretch)
    }

    /// What the block cache may hold: what the budget leaves after the
    /// rest of [`Store::memory`] and the active memtable's growth.
    pub fn cache_budget(&self) -> usize {
        self.cache.budget()
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats.clone();
        s.segments = self.segments.len();
        s.segment_bytes = self.segments.iter().map(|s| s.file_len).sum();
        s.cache_hits = self.cache.hits;
        s.cache_misses = self.cache.misses;
        s.pending_reads = self.reads.len() + self.iters.len();
        (s.checkpoints_retained, s.checkpoints_in_progress) = self.ckpt.counts();
        s.remote = self.tier.as_ref().map(|t| t.stats());
        if let Some((t, cause)) = self.stalled_since {
            s.write_stalls_by_cause[cause.index()].1 += crate::clock::elapsed(t);
        }
        s
    }

    /// Every retained checkpoint, oldest first.
    pub fn checkpoints(&self) -> Vec<CheckpointInfo> {
        self.ckpt.list()
    }

    /// Operations submitted and not yet delivered, and restores and
    /// exports whose checkpoint segments are being opened.
    pub fn pending(&self) -> usize {
        self.reads.len()
            + self.iters.len()
            + self.done.len()
            + self.ckpt.counts().1
            + self.ckpt.markers.waiting()
            + self.imports.iter().filter(|(_, i)| i.finishing()).count()
            + self.openings.len()
    }

    /// Whether a checkpoint should wait before it begins: the store holds
    /// `checkpoint_layer_limit` layers or more, and a compaction, running
    /// or about to start, will merge them. The caller then leaves the
    /// checkpoint (and what its client queued after it) waiting, and asks
    /// again after polling. A checkpoint names every layer it covers and a
    /// restore of it brings them all back: a daemon that died after the
    /// first checkpoint of each life (a crash loop) grew that chain by a
    /// flush per life, without bound (issue 27: 75 segment files after 60
    /// lives, 163 layers). Never while stopping, or while background work
    /// fails (a full disk): the checkpoint then goes ahead as it is.
    pub fn checkpoint_should_wait(&self) -> bool {
        let limit = self
            .cfg
            .checkpoint_layer_limit
            .max(3 * self.cfg.compaction_trigger.max(2));
        self.segments.len() >= limit && !self.stopping && self.stats.last_background_error.is_none()
    }

    /// Whether background work (flush, compaction, deferred deletes, the
    /// remote tier's uploads and deletes, flushed memtables being cleared
    /// for reuse) is outstanding.
    pub fn busy(&self) -> bool {
        self.flush.is_some()
            || self.compact.is_some()
            || !self.frozen.is_empty()
            || !self.retired.is_empty()
            || !self.awaiting_dir_sync.is_empty()
            || !self.unlinking.is_empty()
            || self.ckpt.markers.outstanding()
            || self.layers.pending()
            // Writes wait for these (see `write_room`): a shard that slept
            // the full second would stall them that long.
            || self.reuse.incoming_bytes() > 0
            || (self.full_compaction_requested && !self.stopping && self.segments.len() >= 2)
            || self.exports.iter().any(|(_, e)| e.in_flight())
            || self.imports.iter().any(|(_, i)| i.in_flight())
            || self
                .tier
                .as_ref()
                .is_some_and(|t| t.outstanding() > 0 || !t.wb.is_empty())
    }

    /// Leaves the records of `states`' dropped ids out of every compaction
    /// that starts from now on (their space comes back as compaction
    /// passes through the layers holding them). Reads do not filter: no
    /// one may name a dropped id.
    pub fn set_dropped_states(&mut self, states: Arc<crate::DroppedStates>) {
        self.dropped = Some(states);
    }

    /// Requests a major compaction: once the running background work is
    /// done, every segment is merged into one (run it with `poll`/`settle`).
    pub fn compact_all(&mut self) {
        self.full_compaction_requested = true;
    }

    /// Prepares a stop: no compaction starts any more, and one in progress
    /// is given up (its partial output deleted, its inputs untouched), so
    /// that `settle` waits only for flushes, checkpoints, deletes and
    /// uploads. A backlog of layers costs a stop nothing: compaction picks
    /// it up when the directory is opened again.
    pub fn stop_compacting(&mut self) {
        self.stopping = true;
        self.drop_compaction();
        self.rebalance_cache();
    }

    /// Every segment the store holds: its layers, retired ones not yet
    /// deleted, compaction inputs waiting for the directory's fsync, and
    /// layers a mask hid that the durable layer list may still name.
    pub(super) fn held_segments(&self) -> impl Iterator<Item = &Rc<Segment>> {
        self.segments
            .iter()
            .chain(&self.retired)
            .chain(&self.awaiting_dir_sync)
            .chain(self.layers.hidden())
    }

    /// Whether a key-group delete removed `key` from a layer of `order`.
    pub(super) fn masked_order(&self, order: u64, key: &[u8]) -> bool {
        masked_by(&self.kg_deletes, order, key)
    }
}

/// A read's block found before its turn: segment id, block number and
/// the block (see `PendingRead::hint`).
pub(super) type Hint = (u64, u32, Rc<Block>);

/// Bytes of reads in flight a store lets through however small its cache
/// budget (256 blocks of 4 KiB).
const MIN_READ_BYTES: usize = 1 << 20;

/// The newest layers whose filter lines a batched get loads ahead.
const FILTERS_AHEAD: usize = 4;

impl BlockCache {
    /// A cached block without touching its CLOCK bit or counters.
    pub(crate) fn peek(&self, seg: u64, block: u32) -> Option<Rc<Block>> {
        self.peek_entry(seg, block)
    }
}

/// Whether a background step that has done `i` records is past its
/// `deadline` (the clock is read every 4 records: a step between requests
/// is a few microseconds, and 32 records of a merge took 15-30 of them).
fn out_of_time(i: usize, deadline: Instant) -> bool {
    i % 4 == 3 && crate::clock::now() >= deadline
}

/// Whether a compaction output `by` merged a layer of `generation` that
/// held orders `min_order..=order` (FORMAT.md §9).
fn supersedes(by: &format::Footer, generation: u32, min_order: u64, order: u64) -> bool {
    by.generation > generation && by.min_order <= min_order && order <= by.order
}

/// Newest first: descending `(order, generation)`, the order reads consult.
fn sort_layers(layers: &mut [Rc<Segment>]) {
    layers.sort_by(|a, b| {
        (b.footer.order, b.footer.generation).cmp(&(a.footer.order, a.footer.generation))
    });
}

/// Whether a mask hides `key` in a layer of `order`.
fn masked_by(masks: &[KgDelete], order: u64, key: &[u8]) -> bool {
    masks.iter().any(|d| d.hides(order, key))
}

/// Index entries a new memtable starts with: room for records of 256 bytes
/// on average (growing the index rehashes it, a stall on the write path),
/// capped at 4 M entries (64 MiB of slots) beyond which it doubles as it
/// fills.
fn initial_entries(cfg: &StoreConfig) -> usize {
    (cfg.memtable_bytes() / 256).min(1 << 22)
}

fn finish_value(kind: ReadKind, base: Option<&[u8]>, operands: &[Vec<u8>]) -> Resolved {
    match kind {
        ReadKind::MapContains => Resolved::Contains(base.is_some() || !operands.is_empty()),
        _ if base.is_none() && operands.is_empty() => Resolved::NotFound,
        _ => Resolved::Owned(join(base, operands)),
    }
}

fn finish_operands(kind: ReadKind, operands: &[Vec<u8>]) -> Resolved {
    finish_value(kind, None, operands)
}

fn resolved_output(r: &Resolved) -> Output<'_> {
    match r {
        Resolved::Done => Output::Done,
        Resolved::NotFound => Output::Value(None),
        Resolved::Contains(b) => Output::Contains(*b),
        Resolved::Owned(v) => Output::Value(Some(v)),
        Resolved::Block(b, range) => Output::Value(Some(&b.bytes()[range.clone()])),
        Resolved::Page {
            data,
            entries,
            last_key,
            more,
        } => Output::Page {
            data,
            entries: *entries,
            last_key,
            more: *more,
        },
        Resolved::Imported(i) => Output::Imported(*i),
    }
}

/// Reads `len` bytes at `off` and waits for them (at open, and for a
/// restore's segment footers); other completions go to `others`.
fn read_sync<I: Io>(
    io: &mut I,
    file: u32,
    off: u64,
    len: usize,
    path: &Path,
    others: &mut Vec<IoCompletion>,
) -> Result<AlignedBuf, StoreError> {
    io.read(file, off, AlignedBuf::zeroed(len), tag(Tag::Open, 0));
    io.submit()
        .map_err(|e| StoreError::io(path, "submit", &e))?;
    let mut out = Vec::new();
    loop {
        io.reap(&mut out);
        if let Some(i) = out.iter().position(|c| c.token == tag(Tag::Open, 0)) {
            let c = out.swap_remove(i);
            others.append(&mut out);
            return match (c.result, c.buf) {
                (Ok(n), Some(b)) if n == len => Ok(b),
                (Ok(_), _) => Err(StoreError::Corrupt {
                    path: path.display().to_string(),
                    offset: off,
                    what: SHORTER_THAN_FOOTER,
                }),
                (Err(errno), _) => Err(StoreError::from_errno(path, "read", errno)),
            };
        }
        io.wait(Some(Duration::from_millis(100)))
            .map_err(|e| StoreError::io(path, "wait", &e))?;
    }
}
