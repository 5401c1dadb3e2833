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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use slab::Slab;

use crate::aligned::{ALIGN, AlignedBuf};
use crate::bloom;
use crate::cache::{Block, BlockCache};
use crate::error::StoreError;
use crate::format::{self, Kind};
use crate::io::{Io, IoCompletion, OpenMode};
use crate::keys;
use crate::memtable::Memtable;
use crate::ops::{IterMode, KeyRef, Op, Output, StateKind, Submitted, encode_element};
use crate::segment::{self, Segment, SegmentWriter};

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
    /// After a failed flush or compaction, wait this long before retrying.
    pub retry_delay: Duration,
    /// An upper bound on the block cache (it otherwise takes whatever the
    /// budget leaves after memtables, indexes and filters).
    pub block_cache_max: Option<usize>,
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
            retry_delay: Duration::from_millis(500),
            block_cache_max: None,
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
    pub indexes_and_filters: usize,
    pub budget: usize,
}

impl MemoryUsage {
    pub fn total(&self) -> usize {
        self.memtables + self.block_cache + self.indexes_and_filters
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
    /// The last background (flush/compaction) failure, if any.
    pub last_background_error: Option<StoreError>,
}

/// What reopening a directory found.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    pub segments: usize,
    /// Incomplete or corrupt segment files set aside as `*.torn`, with why.
    pub torn: Vec<(PathBuf, String)>,
    /// Segments superseded by a completed compaction, deleted.
    pub superseded: Vec<PathBuf>,
}

const TAG_SHIFT: u32 = 56;
const TAG_FETCH: u64 = 1;
const TAG_FLUSH_WRITE: u64 = 2;
const TAG_FLUSH_SYNC: u64 = 3;
const TAG_COMPACT_WRITE: u64 = 4;
const TAG_COMPACT_SYNC: u64 = 5;
const TAG_COMPACT_READ: u64 = 6;
const TAG_OPEN: u64 = 7;
const TAG_DIR_SYNC: u64 = 8;

fn tag(t: u64, v: u64) -> u64 {
    (t << TAG_SHIFT) | v
}

/// A key-group range deleted from every segment up to `max_order`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KgDelete {
    lo: u16,
    hi: u16,
    max_order: u64,
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
    /// A block delivered by a fetch, used before the cache.
    hint: Option<(u64, u32, Rc<Block>)>,
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
}

/// A finished read waiting to be delivered by `poll`.
enum Resolved {
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
    mem: Rc<Memtable>,
    unsorted: Vec<u64>,
    runs: Vec<Vec<u64>>,
    cursors: Vec<usize>,
    writer: SegmentWriter,
    bottom: bool,
    /// All records added; waiting for writes, then for the fsync.
    syncing: bool,
    fsync_issued: bool,
    scratch: Vec<u8>,
}

struct Cursor {
    seg: Rc<Segment>,
    next_read: usize,
    arrived: BTreeMap<usize, Vec<Block>>,
    blocks: VecDeque<Block>,
    next_block: usize,
    rec: usize,
    reads_in_flight: usize,
}

struct CompactJob {
    /// Newest first.
    inputs: Vec<Rc<Segment>>,
    cursors: Vec<Cursor>,
    writer: SegmentWriter,
    bottom: bool,
    clear: Option<(Vec<u8>, usize)>,
    syncing: bool,
    fsync_issued: bool,
    error: Option<StoreError>,
    scratch: Vec<u8>,
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
    frozen: Vec<(u64, Rc<Memtable>)>,
    /// Newest first.
    segments: Vec<Rc<Segment>>,
    retired: Vec<Rc<Segment>>,
    /// Compaction inputs whose files may be deleted once the directory
    /// entry of the compaction's output is durable (a directory fsync).
    awaiting_dir_sync: Vec<Rc<Segment>>,
    dir_sync_in_flight: bool,
    dir_file: Option<crate::io::FileId>,
    cache: BlockCache,
    reads: Slab<PendingRead>,
    iters: Slab<PendingIter>,
    fetches: Slab<Fetch>,
    fetch_index: HashMap<(u64, u32), usize>,
    done: VecDeque<(u64, Result<Resolved, StoreError>)>,
    flush: Option<FlushJob>,
    compact: Option<CompactJob>,
    kg_deletes: Vec<KgDelete>,
    next_order: u64,
    next_segment_id: u64,
    retry_at: Option<Instant>,
    stats: StoreStats,
    completions: Vec<IoCompletion>,
    /// Holds what an immediate `Output` borrows.
    scratch: Vec<u8>,
    held_block: Option<Rc<Block>>,
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
    let mut out = Vec::with_capacity(
        base.map_or(0, |b| b.len()) + operands.iter().map(|o| o.len()).sum::<usize>(),
    );
    if let Some(b) = base {
        out.extend_from_slice(b);
    }
    for o in operands.iter().rev() {
        out.extend_from_slice(o);
    }
    out
}

fn corrupt(seg: &Segment, offset: u64, what: &'static str) -> StoreError {
    StoreError::Corrupt {
        path: seg.path.display().to_string(),
        offset,
        what,
    }
}

impl<I: Io> Store<I> {
    /// Opens (or creates) the store in `cfg.dir`, recovering every segment
    /// that was completely written and setting aside torn ones.
    pub fn open(cfg: StoreConfig, mut io: I) -> Result<(Store<I>, RecoveryReport), StoreError> {
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
        for e in std::fs::read_dir(&cfg.dir).map_err(|e| dir_err(e.to_string()))? {
            let e = e.map_err(|e| dir_err(e.to_string()))?;
            let name = e.file_name().to_string_lossy().to_string();
            if let Some((o, g)) = segment::parse_file_name(&name) {
                found.push((o, g, e.path()));
            }
        }
        found.sort();
        let mut segs: Vec<Segment> = Vec::new();
        let mut next_id = 1u64;
        for (_, _, path) in found {
            match Self::open_segment(&mut io, &path, next_id) {
                Ok(s) => {
                    next_id += 1;
                    segs.push(s);
                }
                // Corruption or a torn write: set the file aside (never
                // overwriting an earlier one) and report it. Anything else
                // (a newer format version, EMFILE, EACCES...) stops the open:
                // the file may be fine, and guessing would lose it.
                Err(e) => {
                    let torn_like = matches!(&e, StoreError::Corrupt { what, .. } if *what != format::UNSUPPORTED_VERSION);
                    if !torn_like {
                        return Err(e);
                    }
                    let mut torn = path.with_extension("torn");
                    let mut n = 1;
                    while torn.exists() {
                        torn = path.with_extension(format!("torn.{n}"));
                        n += 1;
                    }
                    let _ = std::fs::rename(&path, &torn);
                    report.torn.push((torn, e.to_string()));
                }
            }
        }
        // A completed compaction supersedes the inputs whose orders it
        // covers with a lower generation (a crash can leave both).
        let covered = |s: &Segment, by: &Segment| {
            by.footer.generation > s.footer.generation
                && by.footer.min_order <= s.footer.min_order
                && s.footer.order <= by.footer.order
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
        let mut live: Vec<Rc<Segment>> = Vec::new();
        for (i, s) in segs.into_iter().enumerate() {
            if keep.contains(&i) {
                live.push(Rc::new(s));
            } else {
                io.close(s.file);
                let _ = std::fs::remove_file(&s.path);
            }
        }
        if !report.torn.is_empty() || !report.superseded.is_empty() {
            // Make the renames and deletes durable before anything new.
            std::fs::File::open(&cfg.dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| dir_err(e.to_string()))?;
        }
        live.sort_by(|a, b| {
            (b.footer.order, b.footer.generation).cmp(&(a.footer.order, a.footer.generation))
        });
        report.segments = live.len();
        let next_order = live.iter().map(|s| s.footer.order + 1).max().unwrap_or(1);
        let kg_deletes = load_kg_deletes(&cfg.dir)?;
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
            reads: Slab::new(),
            iters: Slab::new(),
            fetches: Slab::new(),
            fetch_index: HashMap::new(),
            done: VecDeque::new(),
            flush: None,
            compact: None,
            kg_deletes,
            next_order,
            next_segment_id: next_id,
            retry_at: None,
            stats: StoreStats::default(),
            completions: Vec::new(),
            scratch: Vec::new(),
            held_block: None,
        };
        store.rebalance_cache();
        Ok((store, report))
    }

    /// Reads a segment's footer and meta region (at open; waits for the I/O).
    fn open_segment(io: &mut I, path: &Path, id: u64) -> Result<Segment, StoreError> {
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
                what: "file length is not a whole number of pages (torn)",
            })?;
            let fbuf = read_sync(io, file, page, ALIGN, path)?;
            let footer = format::Footer::decode(&fbuf, len).map_err(|m| StoreError::Corrupt {
                path: path.display().to_string(),
                offset: page,
                what: m.0,
            })?;
            let meta_off = footer.filter_off / ALIGN as u64 * ALIGN as u64;
            let meta_len = (page - meta_off) as usize;
            let meta = read_sync(io, file, meta_off, meta_len, path)?;
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

    /// Memory in use, by part.
    pub fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            memtables: self.active.memory_bytes()
                + self
                    .frozen
                    .iter()
                    .map(|(_, m)| m.memory_bytes())
                    .sum::<usize>(),
            block_cache: self.cache.bytes(),
            indexes_and_filters: self.segments.iter().map(|s| s.memory_bytes()).sum(),
            budget: self.cfg.memory_budget,
        }
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats.clone();
        s.segments = self.segments.len();
        s.segment_bytes = self.segments.iter().map(|s| s.file_len).sum();
        s.cache_hits = self.cache.hits;
        s.cache_misses = self.cache.misses;
        s.pending_reads = self.reads.len() + self.iters.len();
        s
    }

    /// Operations submitted and not yet delivered.
    pub fn pending(&self) -> usize {
        self.reads.len() + self.iters.len() + self.done.len()
    }

    /// Whether background work (flush, compaction, deferred deletes) is
    /// outstanding.
    pub fn busy(&self) -> bool {
        self.flush.is_some()
            || self.compact.is_some()
            || !self.frozen.is_empty()
            || !self.retired.is_empty()
            || !self.awaiting_dir_sync.is_empty()
    }

    /// The cache gets whatever the budget leaves after memtables and
    /// segment metadata.
    fn rebalance_cache(&mut self) {
        let m = self.memory();
        let others = m.memtables + m.indexes_and_filters;
        let left = self.cfg.memory_budget.saturating_sub(others);
        self.cache
            .set_budget(self.cfg.block_cache_max.map_or(left, |m| m.min(left)));
    }

    fn masked(&self, seg: &Segment, key: &[u8]) -> bool {
        self.masked_order(seg.footer.order, key)
    }

    /// Whether a key-group delete removed `key` from a layer of `order`.
    fn masked_order(&self, order: u64, key: &[u8]) -> bool {
        self.kg_deletes
            .iter()
            .any(|d| order <= d.max_order && keys::in_key_groups(key, d.lo, d.hi))
    }

    // ----- writes ---------------------------------------------------------

    fn check_memory(&self) -> Result<(), StoreError> {
        if let Some(e) = &self.stats.last_background_error {
            let m = self.memory();
            if m.memtables > self.cfg.memory_budget {
                return Err(StoreError::OverBudget {
                    used: m.memtables,
                    budget: self.cfg.memory_budget,
                    cause: e.to_string(),
                });
            }
        }
        Ok(())
    }

    fn apply_write(&mut self, op: &Op<'_>) -> Result<(), StoreError> {
        match *op {
            Op::Put(k, v) => {
                let key = encode(&k, None)?;
                check_value(v)?;
                self.active.write(Kind::Put, &key, bloom::hash(&key), v);
            }
            Op::Delete(k) => {
                let key = encode(&k, None)?;
                self.active
                    .write(Kind::Delete, &key, bloom::hash(&key), &[]);
            }
            Op::ListAppend(k, e) => {
                let key = encode(&k, None)?;
                check_value(e)?;
                self.scratch.clear();
                encode_element(&mut self.scratch, e);
                let operand = std::mem::take(&mut self.scratch);
                self.active.merge(&key, bloom::hash(&key), &operand);
                self.scratch = operand;
            }
            Op::ListReplace(k, list) => {
                let key = encode(&k, None)?;
                check_value(list)?;
                crate::ops::check_elements(list)
                    .ok_or(StoreError::Invalid("malformed element list"))?;
                let kind = if list.is_empty() {
                    Kind::Delete
                } else {
                    Kind::Put
                };
                self.active.write(kind, &key, bloom::hash(&key), list);
            }
            Op::MapPut(k, u, v) => {
                let key = encode(&k, Some(u))?;
                check_value(v)?;
                self.active.write(Kind::Put, &key, bloom::hash(&key), v);
                self.active.note_map_key(&key);
            }
            Op::MapRemove(k, u) => {
                let key = encode(&k, Some(u))?;
                self.active
                    .write(Kind::Delete, &key, bloom::hash(&key), &[]);
                self.active.note_map_key(&key);
            }
            Op::Clear(k, kind) => {
                let key = encode(&k, None)?;
                match kind {
                    StateKind::Map => self.active.clear_map(&key),
                    StateKind::Value | StateKind::List => {
                        self.active
                            .write(Kind::Delete, &key, bloom::hash(&key), &[])
                    }
                }
            }
            Op::DeleteKeyGroups { lo, hi } => {
                if lo > hi {
                    return Err(StoreError::Invalid("key-group range with lo > hi"));
                }
                self.delete_key_groups(lo, hi)?;
            }
            _ => return Err(StoreError::Invalid("not a write")),
        }
        Ok(())
    }

    fn delete_key_groups(&mut self, lo: u16, hi: u16) -> Result<(), StoreError> {
        // Every older layer (frozen memtables and segments, which already
        // have orders) is masked; the mask is durable before anything
        // changes, so a failure leaves the store as it was. Then the active
        // memtable drops its records.
        let max_order = self.next_order - 1;
        self.kg_deletes.push(KgDelete { lo, hi, max_order });
        if let Err(e) = save_kg_deletes(&self.cfg.dir, &self.kg_deletes) {
            self.kg_deletes.pop();
            return Err(e);
        }
        self.active.delete_key_groups(lo, hi);
        Ok(())
    }

    /// Forgets key-group deletes that no layer is old enough to be under.
    fn prune_kg_deletes(&mut self) {
        let oldest = self
            .segments
            .iter()
            .map(|s| s.footer.order)
            .chain(self.frozen.iter().map(|(o, _)| *o))
            .chain(self.retired.iter().map(|s| s.footer.order))
            .min()
            .unwrap_or(u64::MAX);
        let before = self.kg_deletes.len();
        self.kg_deletes.retain(|d| d.max_order >= oldest);
        if self.kg_deletes.len() != before
            && let Err(e) = save_kg_deletes(&self.cfg.dir, &self.kg_deletes)
        {
            self.stats.last_background_error = Some(e);
        }
    }

    fn after_write(&mut self) {
        if self.active.log_bytes() >= self.cfg.memtable_bytes() {
            self.freeze();
        }
    }

    fn freeze(&mut self) {
        let entries = initial_entries(&self.cfg);
        if self.active.is_empty() {
            return;
        }
        let m = std::mem::replace(&mut self.active, Memtable::new(entries));
        let order = self.next_order;
        self.next_order += 1;
        self.frozen.insert(0, (order, Rc::new(m)));
        self.rebalance_cache();
    }

    /// Applies all writes of `batch` or none: every operation is checked
    /// first, then all are applied before any read can observe them.
    pub fn write_batch(&mut self, batch: &[Op<'_>]) -> Result<(), StoreError> {
        self.check_memory()?;
        for op in batch {
            match *op {
                Op::Put(k, v) | Op::ListAppend(k, v) | Op::ListReplace(k, v) => {
                    encode(&k, None)?;
                    check_value(v)?;
                    if let Op::ListReplace(_, l) = op {
                        crate::ops::check_elements(l)
                            .ok_or(StoreError::Invalid("malformed element list"))?;
                    }
                }
                Op::Delete(k) | Op::Clear(k, _) => {
                    encode(&k, None)?;
                }
                Op::MapPut(k, u, v) => {
                    encode(&k, Some(u))?;
                    check_value(v)?;
                }
                Op::MapRemove(k, u) => {
                    encode(&k, Some(u))?;
                }
                Op::DeleteKeyGroups { lo, hi } if lo <= hi => {}
                _ => return Err(StoreError::Invalid("a batch holds only writes")),
            }
        }
        for op in batch {
            self.apply_write(op)?;
        }
        self.after_write();
        Ok(())
    }

    // ----- reads ----------------------------------------------------------

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
        let (kind, key, base_len) = match op {
            Op::Get(k) => (ReadKind::Get, encode(&k, None)?, 0),
            Op::ListGet(k) => (ReadKind::ListGet, encode(&k, None)?, 0),
            Op::MapGet(k, u) => {
                let key = encode(&k, Some(u))?;
                (
                    ReadKind::MapGet,
                    key,
                    keys::HEADER_LEN + k.key.len() + 4 + k.namespace.len(),
                )
            }
            Op::MapContains(k, u) => {
                let key = encode(&k, Some(u))?;
                (
                    ReadKind::MapContains,
                    key,
                    keys::HEADER_LEN + k.key.len() + 4 + k.namespace.len(),
                )
            }
            _ => unreachable!("is_read() covers exactly these"),
        };
        let h = bloom::hash(&key);
        self.read_key(token, kind, key, h, base_len)
    }

    /// Looks up many keys at once: hashes and memtable slots of the whole
    /// batch are fetched before any is waited on, so the memory latency of
    /// a large working set overlaps across the batch. `out(i, result)` is
    /// called for each op answered at once; the others complete via `poll`
    /// with `tokens[i]`.
    pub fn get_batch(
        &mut self,
        tokens: &[u64],
        ops: &[Op<'_>],
        mut out: impl FnMut(usize, Result<Submitted<'_>, StoreError>),
    ) {
        let mut encoded: Vec<(Vec<u8>, u64)> = Vec::with_capacity(ops.len());
        for op in ops {
            let k = match op {
                Op::Get(k) => encode(k, None).unwrap_or_default(),
                _ => Vec::new(),
            };
            let h = bloom::hash(&k);
            self.active.prefetch(h, false);
            encoded.push((k, h));
        }
        for (_, h) in &encoded {
            self.active.prefetch(*h, true);
        }
        for (i, op) in ops.iter().enumerate() {
            if let Op::Get(_) = op {
                let (key, h) = std::mem::take(&mut encoded[i]);
                if key.is_empty() {
                    out(i, self.submit(tokens[i], *op));
                } else {
                    out(i, self.read_key(tokens[i], ReadKind::Get, key, h, 0));
                }
            } else {
                out(i, self.submit(tokens[i], *op));
            }
        }
    }

    fn read_key(
        &mut self,
        token: u64,
        kind: ReadKind,
        key: Vec<u8>,
        h: u64,
        base_len: usize,
    ) -> Result<Submitted<'_>, StoreError> {
        let hb = if base_len > 0 {
            bloom::hash(&key[..base_len])
        } else {
            0
        };
        let mut operands: Vec<Vec<u8>> = Vec::new();
        // Memtables: the active one, then the frozen ones, newest first.
        match self.mem_lookup(kind, &key, h, base_len, hb, &mut operands) {
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
            key,
            h,
            base_len,
            hb,
            layers: Vec::new(),
            operands,
            stage: 0,
            hint: None,
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

    /// Keeps what an immediate output borrows alive until the next call.
    fn hold(&mut self, r: Resolved) -> Output<'_> {
        match r {
            Resolved::NotFound => Output::Value(None),
            Resolved::Contains(b) => Output::Contains(b),
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
    fn mem_lookup(
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
                // A key-group delete removed this and every older layer.
                return Some(Immediate::Resolved(finish_operands(kind, operands)));
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
    fn advance(&mut self, r: &mut PendingRead) -> Step {
        while let Some(seg) = r.layers.last().cloned() {
            if self.masked(&seg, &r.key) {
                // A key-group delete removed this and every older layer.
                return Step::Done(finish_operands(r.kind, &r.operands));
            }
            let (probe_len, ph) = if r.stage == 0 {
                (r.key.len(), r.h)
            } else {
                (r.base_len, r.hb)
            };
            let probe = &r.key[..probe_len];
            let mut next_layer = true;
            if seg.may_contain(probe, ph) {
                if let Some(bi) = seg.index.find(probe) {
                    let block = match &r.hint {
                        Some((sid, b, blk)) if *sid == seg.id && *b as usize == bi => {
                            Some(blk.clone())
                        }
                        _ => self.cache.get(seg.id, bi as u32),
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
                                return Step::Done(finish_value(
                                    r.kind,
                                    Some(rec.value),
                                    &r.operands,
                                ));
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

    fn fetch(&mut self, seg: Rc<Segment>, block: u32, read: Option<usize>, iter: Option<usize>) {
        if let Some(&fi) = self.fetch_index.get(&(seg.id, block)) {
            let f = &mut self.fetches[fi];
            f.reads.extend(read);
            f.iters.extend(iter);
            return;
        }
        let (off, len) = seg.index.block(block as usize);
        let file = seg.file;
        let fi = self.fetches.insert(Fetch {
            seg: seg.clone(),
            block,
            reads: read.into_iter().collect(),
            iters: iter.into_iter().collect(),
        });
        self.fetch_index.insert((seg.id, block), fi);
        self.stats.block_reads += 1;
        self.io.read(
            file,
            off,
            AlignedBuf::zeroed(len as usize),
            tag(TAG_FETCH, fi as u64),
        );
    }

    fn fetch_done(&mut self, fi: usize, c: IoCompletion) {
        let f = self.fetches.remove(fi);
        self.fetch_index.remove(&(f.seg.id, f.block));
        let (off, len) = f.seg.index.block(f.block as usize);
        let result = match (c.result, c.buf) {
            (Ok(n), Some(buf)) if n == len as usize => Block::parse(buf)
                .map(Rc::new)
                .map_err(|m| corrupt(&f.seg, off, m.0)),
            (Ok(_), _) => Err(corrupt(
                &f.seg,
                off,
                "short read: block beyond the end of the file",
            )),
            (Err(errno), _) => Err(StoreError::from_errno(&f.seg.path, "read", errno)),
        };
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

    // ----- map iteration --------------------------------------------------

    fn submit_iter(
        &mut self,
        token: u64,
        map: KeyRef<'_>,
        mode: IterMode,
        after: Option<&[u8]>,
        max_bytes: usize,
    ) -> Result<Submitted<'_>, StoreError> {
        let base = encode(&map, None)?;
        let mut start = base.clone();
        if let Some(a) = after {
            start.extend_from_slice(a);
        }
        let mut mem: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut mem_capped_at: Option<Vec<u8>> = None;
        let mut mem_cleared = false;
        let hb = bloom::hash(&base);
        let mut masked = false;
        let layers = std::iter::once((u64::MAX, &self.active))
            .chain(self.frozen.iter().map(|(o, m)| (*o, &**m)));
        for (order, m) in layers {
            if order != u64::MAX && self.masked_order(order, &base) {
                masked = true;
                break;
            }
            for (n, k) in m.map_range(&base, Some(&start)).enumerate() {
                if n == ITER_LAYER_CAP {
                    let cap = k.to_vec();
                    if mem_capped_at.as_ref().is_none_or(|c| cap < *c) {
                        mem_capped_at = Some(cap);
                    }
                    break;
                }
                let rec = m.lookup(k, bloom::hash(k)).expect("map keys are indexed");
                let v = (rec.kind == Kind::Put).then(|| rec.value.to_vec());
                mem.entry(k.to_vec()).or_insert(v);
            }
            if m.lookup(&base, hb).is_some_and(|r| r.kind == Kind::Clear) {
                mem_cleared = true;
                break;
            }
        }
        let layers = if mem_cleared || masked {
            Vec::new()
        } else {
            self.segments.clone()
        };
        let id = self.iters.insert(PendingIter {
            token,
            base,
            start,
            mode,
            max_bytes,
            mem,
            mem_capped_at,
            layers,
            pinned: HashMap::new(),
        });
        self.run_iter(id);
        match self.done.back() {
            Some((t, _)) if *t == token && !self.iters.contains(id) => {
                let (_, r) = self.done.pop_back().expect("checked non-empty");
                Ok(Submitted::Ready(self.hold(r?)))
            }
            _ => Ok(Submitted::Pending),
        }
    }

    /// Runs an iteration as far as pinned and cached blocks allow; either
    /// finishes it (pushing to `done`) or issues the next fetch.
    fn run_iter(&mut self, id: usize) {
        let it = &self.iters[id];
        // Segments newest first: collect each layer's entries in range.
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = it.mem.clone();
        let mut cap: Option<Vec<u8>> = it.mem_capped_at.clone();
        let mut need: Option<(Rc<Segment>, u32)> = None;
        'layers: for seg in &it.layers {
            if self.masked(seg, &it.base) {
                break;
            }
            let mut layer: Vec<(Vec<u8>, Option<Vec<u8>>)> = Vec::new();
            let mut cleared = false;
            // The clear marker, at the base key.
            if seg.may_contain(&it.base, bloom::hash(&it.base))
                && let Some(bi) = seg.index.find(&it.base)
            {
                match self.block_for(&it.pinned, seg, bi) {
                    None => {
                        need = Some((seg.clone(), bi as u32));
                        break 'layers;
                    }
                    Some(b) => {
                        if b.view()
                            .find(&it.base)
                            .is_some_and(|r| r.kind == Kind::Clear)
                        {
                            cleared = true;
                        }
                    }
                }
            }
            if let Some(mut bi) = seg.index.find(&it.start) {
                'blocks: loop {
                    let Some(b) = self.block_for(&it.pinned, seg, bi) else {
                        need = Some((seg.clone(), bi as u32));
                        break 'layers;
                    };
                    let v = b.view();
                    let mut i = v.lower_bound(&it.start);
                    while i < v.len() {
                        let r = v.record(i);
                        i += 1;
                        if r.key <= &it.start[..] {
                            continue;
                        }
                        if !r.key.starts_with(&it.base) {
                            break 'blocks;
                        }
                        if layer.len() == ITER_LAYER_CAP {
                            if cap.as_ref().is_none_or(|c| r.key < &c[..]) {
                                cap = Some(r.key.to_vec());
                            }
                            break 'blocks;
                        }
                        layer.push((
                            r.key.to_vec(),
                            (r.kind == Kind::Put).then(|| r.value.to_vec()),
                        ));
                    }
                    bi += 1;
                    if bi >= seg.index.len() {
                        break;
                    }
                }
            }
            for (k, v) in layer {
                merged.entry(k).or_insert(v);
            }
            if cleared {
                break;
            }
        }
        if let Some((seg, b)) = need {
            self.fetch(seg, b, None, Some(id));
            return;
        }
        let it = self.iters.remove(id);
        let mut data = Vec::new();
        let mut entries = 0u32;
        // The resume cursor: the last user key this page examined (returned
        // or deleted), so a page of only deleted entries still advances.
        let mut last_key = Vec::new();
        // A layer stopped collecting at `cap`: entries from there on are
        // unknown until the next page.
        let mut more = cap.is_some();
        for (k, v) in merged {
            if cap.as_ref().is_some_and(|c| k >= *c) {
                break;
            }
            let ukey = &k[it.base.len()..];
            let Some(v) = v else {
                last_key.clear();
                last_key.extend_from_slice(ukey);
                continue;
            };
            let add = match it.mode {
                IterMode::Keys => 4 + ukey.len(),
                IterMode::Values => 4 + v.len(),
                IterMode::Entries => 8 + ukey.len() + v.len(),
            };
            if data.len() + add > it.max_bytes {
                if entries == 0 {
                    // Not even one entry fits: say how much it needs rather
                    // than return an empty page that cannot advance.
                    let e = StoreError::TooLarge {
                        what: "the next map entry of this page",
                        len: add,
                        max: it.max_bytes,
                    };
                    self.done.push_back((it.token, Err(e)));
                    return;
                }
                more = true;
                break;
            }
            if matches!(it.mode, IterMode::Keys | IterMode::Entries) {
                encode_element(&mut data, ukey);
            }
            if matches!(it.mode, IterMode::Values | IterMode::Entries) {
                encode_element(&mut data, &v);
            }
            entries += 1;
            last_key.clear();
            last_key.extend_from_slice(ukey);
        }
        self.done.push_back((
            it.token,
            Ok(Resolved::Page {
                data,
                entries,
                last_key,
                more,
            }),
        ));
    }

    fn block_for(
        &self,
        pinned: &HashMap<(u64, u32), Rc<Block>>,
        seg: &Segment,
        bi: usize,
    ) -> Option<Rc<Block>> {
        pinned
            .get(&(seg.id, bi as u32))
            .cloned()
            .or_else(|| self.cache.peek(seg.id, bi as u32))
    }

    // ----- polling --------------------------------------------------------

    /// Submits queued I/O, reaps completions, advances background work by a
    /// bounded step, and delivers finished operations to `on_done`. Returns
    /// how many were delivered.
    pub fn poll(&mut self, mut on_done: impl FnMut(u64, Result<Output<'_>, StoreError>)) -> usize {
        self.drive_io();
        self.background();
        let _ = self.io.submit();
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
        if !self.done.is_empty() {
            return Ok(());
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
            let _ = self.wait(Some(Duration::from_millis(5)));
        }
    }

    /// Freezes the active memtable so it is flushed (for tests, checkpoints
    /// and shutdown).
    pub fn flush(&mut self) {
        self.freeze();
    }

    fn drive_io(&mut self) {
        let _ = self.io.submit();
        let mut cs = std::mem::take(&mut self.completions);
        self.io.reap(&mut cs);
        for c in cs.drain(..) {
            let t = c.token >> TAG_SHIFT;
            let v = c.token & ((1 << TAG_SHIFT) - 1);
            match t {
                TAG_FETCH => self.fetch_done(v as usize, c),
                TAG_FLUSH_WRITE => {
                    if let Some(j) = self.flush.as_mut() {
                        j.writer.write_done(c.result);
                    }
                }
                TAG_FLUSH_SYNC => self.flush_synced(c.result),
                TAG_COMPACT_WRITE => {
                    if let Some(j) = self.compact.as_mut() {
                        j.writer.write_done(c.result);
                    }
                }
                TAG_COMPACT_SYNC => self.compact_synced(c.result),
                TAG_COMPACT_READ => self.compact_read_done(v, c),
                TAG_DIR_SYNC => {
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
                _ => {}
            }
        }
        self.completions = cs;
    }

    fn background(&mut self) {
        if let Some(at) = self.retry_at {
            if Instant::now() < at {
                return;
            }
            self.retry_at = None;
        }
        if !self.awaiting_dir_sync.is_empty() && !self.dir_sync_in_flight {
            self.sync_dir();
        }
        if self.flush.is_none() && !self.frozen.is_empty() {
            self.start_flush();
        }
        if self.flush.is_some() {
            self.step_flush();
        }
        if self.compact.is_none() && self.flush.is_none() {
            self.maybe_start_compaction();
        }
        if self.compact.is_some() {
            self.step_compaction();
        }
        self.reap_retired();
        if !self.kg_deletes.is_empty() && self.flush.is_none() && self.compact.is_none() {
            self.prune_kg_deletes();
        }
    }

    /// Issues an fsync of the store directory (through the I/O layer, so
    /// the shard thread does not block).
    fn sync_dir(&mut self) {
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
        self.io.fsync(f, tag(TAG_DIR_SYNC, 0));
    }

    fn reap_retired(&mut self) {
        let mut i = 0;
        while i < self.retired.len() {
            if Rc::strong_count(&self.retired[i]) == 1 {
                let s = self.retired.swap_remove(i);
                self.cache.forget_segment(s.id);
                self.io.close(s.file);
                let _ = std::fs::remove_file(&s.path);
            } else {
                i += 1;
            }
        }
    }

    fn background_failed(&mut self, e: StoreError) {
        self.stats.last_background_error = Some(e);
        self.retry_at = Some(Instant::now() + self.cfg.retry_delay);
    }

    // ----- flush ----------------------------------------------------------

    fn start_flush(&mut self) {
        let (order, mem) = self.frozen.last().expect("checked non-empty").clone();
        let writer = match SegmentWriter::create(
            &mut self.io,
            &self.cfg.dir,
            order,
            0,
            order,
            tag(TAG_FLUSH_WRITE, 0),
        ) {
            Ok(w) => w,
            Err(e) => return self.background_failed(e),
        };
        // Records a key-group delete removed after this memtable froze are
        // not written.
        let unsorted: Vec<u64> = mem
            .live_addrs()
            .into_iter()
            .filter(|&a| !self.masked_order(order, mem.key_of(a)))
            .collect();
        // Nothing older exists: tombstones have nothing to hide.
        let bottom = self.segments.is_empty();
        self.flush = Some(FlushJob {
            mem,
            unsorted,
            runs: Vec::new(),
            cursors: Vec::new(),
            writer,
            bottom,
            syncing: false,
            fsync_issued: false,
            scratch: Vec::new(),
        });
    }

    fn step_flush(&mut self) {
        let work = self.cfg.work_per_poll;
        let j = self.flush.as_mut().expect("called with a flush job");
        if j.syncing {
            return self.maybe_sync_flush();
        }
        if let Some(e) = j.writer.error.clone() {
            return self.abandon_flush(e);
        }
        // Phase 1: sort runs of `work` keys, one run per step.
        if !j.unsorted.is_empty() {
            let n = j.unsorted.len().min(work * 8);
            let mut run: Vec<u64> = j.unsorted.drain(j.unsorted.len() - n..).collect();
            let mem = &j.mem;
            run.sort_unstable_by(|a, b| mem.key_of(*a).cmp(mem.key_of(*b)));
            j.runs.push(run);
            j.cursors.push(0);
            return;
        }
        // Phase 2: merge the runs into the writer, `work` records a step.
        for _ in 0..work {
            let mut best: Option<usize> = None;
            for (r, run) in j.runs.iter().enumerate() {
                if let Some(&a) = run.get(j.cursors[r])
                    && best.is_none_or(|b| j.mem.key_of(a) < j.mem.key_of(j.runs[b][j.cursors[b]]))
                {
                    best = Some(r);
                }
            }
            let Some(r) = best else {
                j.writer.finish(&mut self.io);
                j.syncing = true;
                return self.maybe_sync_flush();
            };
            let addr = j.runs[r][j.cursors[r]];
            j.cursors[r] += 1;
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

    fn maybe_sync_flush(&mut self) {
        let j = self.flush.as_mut().expect("flush job");
        if j.writer.all_written() && !j.fsync_issued {
            if let Some(e) = j.writer.error.clone() {
                return self.abandon_flush(e);
            }
            j.fsync_issued = true;
            let f = j.writer.file;
            self.io.fsync(f, tag(TAG_FLUSH_SYNC, 0));
        }
    }

    fn flush_synced(&mut self, r: Result<usize, i32>) {
        let Some(j) = self.flush.take() else { return };
        if let Err(errno) = r {
            let e = StoreError::from_errno(&j.writer.path, "fsync", errno);
            self.flush = Some(j);
            return self.abandon_flush(e);
        }
        let mut j = j;
        if j.writer.write_footer(&mut self.io) {
            // Data durable; now the footer, then the second fsync.
            j.fsync_issued = false;
            self.flush = Some(j);
            return;
        }
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        let seg = Rc::new(j.writer.into_segment(id));
        self.segments.insert(0, seg);
        let (_, done) = self
            .frozen
            .pop()
            .expect("the flushed memtable is the oldest frozen one");
        debug_assert!(Rc::ptr_eq(&done, &j.mem));
        self.stats.flushes += 1;
        self.sync_dir();
        self.stats.last_background_error = None;
        self.rebalance_cache();
    }

    fn abandon_flush(&mut self, e: StoreError) {
        if let Some(j) = self.flush.take() {
            // Stop writing that file; the frozen memtable stays in memory
            // (nothing is lost) and a later attempt writes a new file.
            self.io.close(j.writer.file);
            let _ = std::fs::remove_file(&j.writer.path);
        }
        self.background_failed(e);
    }

    // ----- compaction -----------------------------------------------------

    fn maybe_start_compaction(&mut self) {
        let t = self.cfg.compaction_trigger.max(2);
        if self.segments.len() < t {
            return;
        }
        // The newest window of `t` adjacent segments of similar size
        // (size-tiered: write amplification grows with log(data)).
        let sizes: Vec<u64> = self.segments.iter().map(|s| s.file_len.max(1)).collect();
        let mut window = None;
        for start in 0..=sizes.len() - t {
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
        // Too many segments of any size: merge the newest `t` anyway.
        if window.is_none() && self.segments.len() >= t * 3 {
            window = Some(0);
        }
        let Some(start) = window else { return };
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
        let writer = match SegmentWriter::create(
            &mut self.io,
            &self.cfg.dir,
            order,
            generation,
            min_order,
            tag(TAG_COMPACT_WRITE, 0),
        ) {
            Ok(w) => w,
            Err(e) => return self.background_failed(e),
        };
        let cursors = inputs
            .iter()
            .map(|s| Cursor {
                seg: s.clone(),
                next_read: 0,
                arrived: BTreeMap::new(),
                blocks: VecDeque::new(),
                next_block: 0,
                rec: 0,
                reads_in_flight: 0,
            })
            .collect();
        self.compact = Some(CompactJob {
            inputs,
            cursors,
            writer,
            bottom,
            clear: None,
            syncing: false,
            fsync_issued: false,
            error: None,
            scratch: Vec::new(),
        });
    }

    fn issue_compact_reads(&mut self) {
        let j = self.compact.as_mut().expect("compaction job");
        for (ci, c) in j.cursors.iter_mut().enumerate() {
            let buffered = c.blocks.len() + c.arrived.values().map(|v| v.len()).sum::<usize>();
            if c.reads_in_flight > 0
                || buffered >= COMPACT_READ_BLOCKS / 2
                || c.next_read >= c.seg.index.len()
            {
                continue;
            }
            let first = c.next_read;
            let last = (first + COMPACT_READ_BLOCKS).min(c.seg.index.len());
            let (off, _) = c.seg.index.block(first);
            let (loff, llen) = c.seg.index.block(last - 1);
            let len = (loff + llen as u64 - off) as usize;
            c.next_read = last;
            c.reads_in_flight += 1;
            let token = tag(TAG_COMPACT_READ, ((ci as u64) << 32) | first as u64);
            self.io
                .read(c.seg.file, off, AlignedBuf::zeroed(len), token);
        }
    }

    fn compact_read_done(&mut self, v: u64, c: IoCompletion) {
        let Some(j) = self.compact.as_mut() else {
            return;
        };
        let (ci, first) = ((v >> 32) as usize, (v & 0xffff_ffff) as usize);
        let cur = &mut j.cursors[ci];
        cur.reads_in_flight -= 1;
        let seg = cur.seg.clone();
        let buf = match (c.result, c.buf) {
            (Ok(n), Some(b)) if n == b.len() => b,
            (Ok(_), _) => {
                j.error.get_or_insert(corrupt(
                    &seg,
                    seg.index.block(first).0,
                    "short read during compaction",
                ));
                return;
            }
            (Err(errno), _) => {
                j.error
                    .get_or_insert(StoreError::from_errno(&seg.path, "read", errno));
                return;
            }
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
            let mut b = AlignedBuf::with_capacity(len as usize);
            b.extend_from_slice(&buf[rel..rel + len as usize]);
            match Block::parse(b) {
                Ok(b) => blocks.push(b),
                Err(m) => {
                    j.error.get_or_insert(corrupt(&seg, off, m.0));
                    return;
                }
            }
            bi += 1;
        }
        cur.arrived.insert(first, blocks);
        while let Some(e) = cur.arrived.first_entry() {
            if *e.key() != cur.next_block {
                break;
            }
            let bs = e.remove();
            cur.next_block += bs.len();
            cur.blocks.extend(bs);
        }
    }

    fn step_compaction(&mut self) {
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
        let j = self.compact.as_mut().expect("compaction job");
        for _ in 0..work {
            // Every unfinished input must have its current block loaded.
            let mut waiting = false;
            for c in j.cursors.iter_mut() {
                while c.blocks.front().is_some_and(|b| c.rec >= b.view().len()) {
                    c.blocks.pop_front();
                    c.rec = 0;
                }
                let finished = c.blocks.is_empty() && c.next_block >= c.seg.index.len();
                if c.blocks.is_empty() && !finished {
                    waiting = true;
                }
            }
            if waiting {
                return;
            }
            // The smallest current key, and every input holding it.
            let mut min: Option<&[u8]> = None;
            for c in &j.cursors {
                if let Some(b) = c.blocks.front() {
                    let k = b.view().record(c.rec).key;
                    if min.is_none_or(|m| k < m) {
                        min = Some(k);
                    }
                }
            }
            let Some(min) = min else {
                j.writer.finish(&mut self.io);
                j.syncing = true;
                return self.maybe_sync_compaction();
            };
            let key = min.to_vec();
            let mut operands: Vec<Vec<u8>> = Vec::new();
            let mut result: Option<(Kind, Vec<u8>)> = None;
            let mut decided = false;
            let mut clear_rank = None;
            for (rank, c) in j.cursors.iter_mut().enumerate() {
                let Some(b) = c.blocks.front() else { continue };
                let rec = b.view().record(c.rec);
                if rec.key != &key[..] {
                    continue;
                }
                c.rec += 1;
                if decided {
                    continue;
                }
                let order = j.inputs[rank].footer.order;
                if kg_deletes
                    .iter()
                    .any(|d| order <= d.max_order && keys::in_key_groups(&key, d.lo, d.hi))
                {
                    continue;
                }
                if let Some((cb, cr)) = &j.clear
                    && key.starts_with(cb)
                    && key.len() > cb.len()
                    && rank > *cr
                {
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
            j.scratch = value;
            j.writer.add(&mut self.io, kind, &key, &j.scratch);
        }
    }

    fn maybe_sync_compaction(&mut self) {
        let j = self.compact.as_mut().expect("compaction job");
        if j.writer.all_written() && !j.fsync_issued {
            if let Some(e) = j.writer.error.clone() {
                return self.abandon_compaction(e);
            }
            j.fsync_issued = true;
            let f = j.writer.file;
            self.io.fsync(f, tag(TAG_COMPACT_SYNC, 0));
        }
    }

    fn compact_synced(&mut self, r: Result<usize, i32>) {
        let Some(j) = self.compact.take() else { return };
        if let Err(errno) = r {
            let e = StoreError::from_errno(&j.writer.path, "fsync", errno);
            self.compact = Some(j);
            return self.abandon_compaction(e);
        }
        let mut j = j;
        if j.writer.write_footer(&mut self.io) {
            j.fsync_issued = false;
            self.compact = Some(j);
            return;
        }
        let id = self.next_segment_id;
        self.next_segment_id += 1;
        let out = Rc::new(j.writer.into_segment(id));
        let pos = self
            .segments
            .iter()
            .position(|s| s.id == j.inputs[0].id)
            .expect("inputs stay in the list while compacting");
        let n = j.inputs.len();
        debug_assert!(
            self.segments[pos..pos + n]
                .iter()
                .zip(&j.inputs)
                .all(|(a, b)| a.id == b.id)
        );
        let removed: Vec<Rc<Segment>> = self.segments.splice(pos..pos + n, [out]).collect();
        // The inputs' files go only after the output's directory entry is
        // durable, or a crash could find neither.
        self.awaiting_dir_sync.extend(removed);
        self.sync_dir();
        self.stats.compactions += 1;
        self.rebalance_cache();
    }

    fn abandon_compaction(&mut self, e: StoreError) {
        if let Some(j) = self.compact.take() {
            if j.writer.all_written() || j.writer.error.is_some() {
                self.io.close(j.writer.file);
                let _ = std::fs::remove_file(&j.writer.path);
            } else {
                // Writes still in flight own buffers; let them finish into a
                // file that is deleted by name now (the fd keeps it alive).
                let _ = std::fs::remove_file(&j.writer.path);
                self.io.close(j.writer.file);
            }
        }
        self.background_failed(e);
    }

    /// Runs background work until flushes and compactions are finished.
    pub fn settle(&mut self) {
        self.drain(true, |_, _| {});
    }
}

impl BlockCache {
    /// A cached block without touching its CLOCK bit or counters.
    pub(crate) fn peek(&self, seg: u64, block: u32) -> Option<Rc<Block>> {
        self.peek_entry(seg, block)
    }
}

/// Index slots a new memtable starts with: enough for a small memtable,
/// capped so an idle session does not hold a large empty table (the index
/// doubles as it fills).
fn initial_entries(cfg: &StoreConfig) -> usize {
    (cfg.memtable_bytes() / 256).min(1 << 16)
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
    }
}

/// Reads `len` bytes at `off` and waits for them (used at open only).
fn read_sync<I: Io>(
    io: &mut I,
    file: u32,
    off: u64,
    len: usize,
    path: &Path,
) -> Result<AlignedBuf, StoreError> {
    io.read(file, off, AlignedBuf::zeroed(len), tag(TAG_OPEN, 0));
    io.submit()
        .map_err(|e| StoreError::io(path, "submit", &e))?;
    let mut out = Vec::new();
    loop {
        io.reap(&mut out);
        if let Some(i) = out.iter().position(|c| c.token == tag(TAG_OPEN, 0)) {
            let c = out.swap_remove(i);
            return match (c.result, c.buf) {
                (Ok(n), Some(b)) if n == len => Ok(b),
                (Ok(_), _) => Err(StoreError::Corrupt {
                    path: path.display().to_string(),
                    offset: off,
                    what: "file shorter than its footer says (torn)",
                }),
                (Err(errno), _) => Err(StoreError::from_errno(path, "read", errno)),
            };
        }
        io.wait(Some(Duration::from_millis(100)))
            .map_err(|e| StoreError::io(path, "wait", &e))?;
    }
}

const KGDEL_FILE: &str = "KGDELETES";

fn load_kg_deletes(dir: &Path) -> Result<Vec<KgDelete>, StoreError> {
    let path = dir.join(KGDEL_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StoreError::io(&path, "read", &e)),
    };
    let bad = |what| StoreError::Corrupt {
        path: path.display().to_string(),
        offset: 0,
        what,
    };
    if bytes.len() < 8 || !(bytes.len() - 8).is_multiple_of(12) {
        return Err(bad("key-group delete list has a bad length"));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc.try_into().expect("4")) {
        return Err(bad("key-group delete list checksum mismatch"));
    }
    let count = u32::from_le_bytes(body[..4].try_into().expect("4")) as usize;
    if count * 12 != body.len() - 4 {
        return Err(bad("key-group delete list count does not match its length"));
    }
    Ok(body[4..]
        .chunks_exact(12)
        .map(|c| KgDelete {
            lo: u16::from_le_bytes([c[0], c[1]]),
            hi: u16::from_le_bytes([c[2], c[3]]),
            max_order: u64::from_le_bytes(c[4..12].try_into().expect("8")),
        })
        .collect())
}

/// Persists the key-group deletes: written to a temporary file, synced,
/// renamed over the old list (a rare operation: rescale).
fn save_kg_deletes(dir: &Path, list: &[KgDelete]) -> Result<(), StoreError> {
    use std::io::Write;
    let path = dir.join(KGDEL_FILE);
    let tmp = dir.join(format!("{KGDEL_FILE}.tmp"));
    let mut body = Vec::new();
    body.extend_from_slice(&(list.len() as u32).to_le_bytes());
    for d in list {
        body.extend_from_slice(&d.lo.to_le_bytes());
        body.extend_from_slice(&d.hi.to_le_bytes());
        body.extend_from_slice(&d.max_order.to_le_bytes());
    }
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    r.map_err(|e| StoreError::io(&path, "write", &e))
}
