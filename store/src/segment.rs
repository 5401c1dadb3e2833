//! Segments: immutable sorted files. [`SegmentWriter`] streams records into
//! 4 KiB-aligned blocks and writes them through the store's [`Io`] in 1 MiB
//! pieces; [`Segment`] is an open segment's in-memory part (footer, block
//! index, filter), enough to find the one block that may hold a key.

use std::path::{Path, PathBuf};
use std::rc::Rc;

use crate::aligned::{ALIGN, AlignedBuf};
use crate::bloom::{self, Bloom};
use crate::error::StoreError;
use crate::format::{self, BlockBuilder, BlockIndex, Footer, Kind, Malformed};
use crate::io::{FileId, Io, OpenMode};

/// An open segment.
pub struct Segment {
    /// Unique within the store (cache key).
    pub id: u64,
    pub path: PathBuf,
    /// The file name (what manifests and the remote tier name it by).
    pub name: Rc<str>,
    pub file: FileId,
    pub footer: Footer,
    /// Shared by every layer that references this file (a restore's
    /// references reuse the parsed index and filter of an open segment).
    pub index: Rc<BlockIndex>,
    pub filter: Rc<Bloom>,
    pub file_len: u64,
    /// For a segment referenced by a restore: the records that belong to
    /// the restored state (the rest are invisible). `None`: all of them.
    pub clip: Option<crate::manifest::Clip>,
    /// Where the data region's bytes are (the remote tier): shared by
    /// every layer of the same file.
    pub residency: Rc<Residency>,
}

/// Where a segment's data is, with a remote tier: local (the default), or
/// remote (evicted from the local disk, or never fetched) except for the
/// 4 KiB pages fetched since and written back to the local file, or kept
/// by an eviction because they had been read since the one before
/// ([`Residency::evict`]).
#[derive(Debug, Default)]
pub struct Residency {
    remote: std::cell::Cell<bool>,
    /// Counts evictions: a write-back issued before one marks nothing.
    epoch: std::cell::Cell<u64>,
    /// The store's read clock at the last block read (eviction's LRU).
    last_use: std::cell::Cell<u64>,
    /// Pages cached locally while remote (bit per page of the data region).
    local: std::cell::RefCell<Vec<u64>>,
    /// Pages read since the last eviction (bit per page): an eviction
    /// keeps those still local, a second chance as in CLOCK.
    read: std::cell::RefCell<Vec<u64>>,
}

/// Sets the bits of pages `off..off+len` in `bits`, growing it as needed.
fn set_pages(bits: &mut Vec<u64>, off: u64, len: usize) {
    for p in off / Residency::PAGE..(off + len as u64).div_ceil(Residency::PAGE) {
        let w = (p / 64) as usize;
        if bits.len() <= w {
            bits.resize(w + 1, 0);
        }
        bits[w] |= 1 << (p % 64);
    }
}

impl Residency {
    const PAGE: u64 = ALIGN as u64;

    pub fn is_remote(&self) -> bool {
        self.remote.get()
    }

    /// Whether bytes `off..off+len` must be read from the remote tier.
    #[inline]
    pub fn needs_remote(&self, off: u64, len: usize) -> bool {
        if !self.remote.get() {
            return false;
        }
        let bits = self.local.borrow();
        let (first, last) = (off / Self::PAGE, (off + len as u64).div_ceil(Self::PAGE));
        (first..last).any(|p| {
            bits.get((p / 64) as usize)
                .is_none_or(|w| w & (1 << (p % 64)) == 0)
        })
    }

    /// The data is remote; no page is cached.
    pub fn set_remote(&self) {
        self.remote.set(true);
        self.epoch.set(self.epoch.get() + 1);
        self.local.borrow_mut().clear();
    }

    /// Notes a block read at `tick` of the store's read clock.
    #[inline]
    pub fn touch(&self, tick: u64) {
        self.last_use.set(tick);
    }

    /// When a block was last read (0: never since open).
    pub fn last_use(&self) -> u64 {
        self.last_use.get()
    }

    /// Changes with every [`Residency::set_remote`].
    pub fn epoch(&self) -> u64 {
        self.epoch.get()
    }

    /// Bytes `off..off+len` were written back to the local file.
    pub fn mark_local(&self, off: u64, len: usize) {
        set_pages(&mut self.local.borrow_mut(), off, len);
    }

    /// Bytes `off..off+len` were read (locally, or fetched and written
    /// back).
    #[inline]
    pub fn mark_read(&self, off: u64, len: usize) {
        set_pages(&mut self.read.borrow_mut(), off, len);
    }

    /// The pages below `end` that an eviction now would keep: read since
    /// the last one and local (every page of a local segment; the cached
    /// ones of a remote one). Bit per page, as [`Residency::evict`] takes.
    pub fn keep(&self, end: u64) -> Vec<u64> {
        let pages = end.div_ceil(Self::PAGE);
        let words = pages.div_ceil(64) as usize;
        let read = self.read.borrow();
        let local = self.local.borrow();
        let mut keep: Vec<u64> = (0..words)
            .map(|w| {
                let r = read.get(w).copied().unwrap_or(0);
                match self.remote.get() {
                    true => r & local.get(w).copied().unwrap_or(0),
                    false => r,
                }
            })
            .collect();
        if pages % 64 != 0
            && let Some(last) = keep.last_mut()
        {
            *last &= (1u64 << (pages % 64)) - 1;
        }
        keep
    }

    /// The data is remote but for the pages of `keep` (bit per page, from
    /// [`Residency::keep`]), which stay local; reads since are forgotten,
    /// so a page kept now and not read again goes at the next eviction.
    pub fn evict(&self, keep: Vec<u64>) {
        self.set_remote();
        *self.local.borrow_mut() = keep;
        self.read.borrow_mut().clear();
    }

    /// Bytes of pages set in a [`Residency::keep`] bitmap.
    pub fn kept_bytes(keep: &[u64]) -> u64 {
        keep.iter().map(|w| w.count_ones() as u64).sum::<u64>() * Self::PAGE
    }

    /// The ranges below `end` that are not in `keep`: what an eviction
    /// punches out of the local file.
    pub fn punched(keep: &[u64], end: u64) -> Vec<std::ops::Range<u64>> {
        let mut out: Vec<std::ops::Range<u64>> = Vec::new();
        for p in 0..end.div_ceil(Self::PAGE) {
            let kept = keep
                .get((p / 64) as usize)
                .is_some_and(|w| w & (1 << (p % 64)) != 0);
            if kept {
                continue;
            }
            let (a, b) = (p * Self::PAGE, ((p + 1) * Self::PAGE).min(end));
            match out.last_mut() {
                Some(r) if r.end == a => r.end = b,
                _ => out.push(a..b),
            }
        }
        out
    }

    /// Pages cached locally while remote.
    pub fn cached_pages(&self) -> u64 {
        self.local
            .borrow()
            .iter()
            .map(|w| w.count_ones() as u64)
            .sum()
    }
}

impl Segment {
    /// Checks a block read from this segment against its footer: its
    /// first and last keys (they ascend: [`format::BlockView::parse`]) in
    /// the footer's key groups.
    pub fn check_block(&self, b: &format::BlockView<'_>) -> Result<(), Malformed> {
        let Some(last) = b.len().checked_sub(1) else {
            return Ok(());
        };
        let range = self.footer.min_kg..=self.footer.max_kg;
        let kg = |i: usize| crate::keys::key_group(b.key(i));
        match range.contains(&kg(0)) && range.contains(&kg(last)) {
            true => Ok(()),
            false => Err(Malformed(KEY_GROUPS_OUTSIDE_FOOTER)),
        }
    }

    /// Memory held for this segment (index and filter).
    pub fn memory_bytes(&self) -> usize {
        if self.clip.is_some() && Rc::strong_count(&self.index) > 1 {
            // A restore's reference to a file whose metadata another layer holds.
            return 256;
        }
        self.index.memory_bytes() + self.filter.memory_bytes() + 256
    }

    /// Whether the segment may hold `key` (key-group range and filter).
    #[inline]
    pub fn may_contain(&self, key: &[u8], h: u64) -> bool {
        let kg = crate::keys::key_group(key);
        kg >= self.footer.min_kg && kg <= self.footer.max_kg && self.filter.may_contain(h)
    }

    /// The file name (what manifests record).
    pub fn name(&self) -> String {
        self.name.to_string()
    }

    /// The same file as another layer: a new id and file handle, the
    /// parsed index and filter shared (no clip yet).
    pub fn another_layer(&self, id: u64, file: FileId) -> Segment {
        Segment {
            id,
            path: self.path.clone(),
            name: self.name.clone(),
            file,
            footer: self.footer,
            index: self.index.clone(),
            filter: self.filter.clone(),
            file_len: self.file_len,
            clip: None,
            residency: self.residency.clone(),
        }
    }

    /// An upper bound on the bytes of `key`'s value in this layer, from
    /// memory alone (no read): 0 when the clip, the key-group bounds or
    /// the filter rule the key out; else the length of the block the
    /// index names for it, which is one page unless the block is a single
    /// record (FORMAT.md §4), in which case it counts only if that record
    /// is `key`'s.
    pub fn value_bound(&self, key: &[u8], h: u64) -> u64 {
        if self.clipped(key) || !self.may_contain(key, h) {
            return 0;
        }
        let Some(i) = self.index.find(key) else {
            return 0;
        };
        let (_, len) = self.index.block(i);
        if len as usize > ALIGN && self.index.last_key(i) != key {
            return 0;
        }
        len as u64
    }

    /// Whether the clip hides `key`.
    #[inline]
    pub fn clipped(&self, key: &[u8]) -> bool {
        self.clip.as_ref().is_some_and(|c| !c.admits(key))
    }

    pub fn order(&self) -> u64 {
        self.footer.order
    }

    /// Parses the footer page and meta region read from a file.
    pub fn from_parts(
        id: u64,
        path: PathBuf,
        file: FileId,
        file_len: u64,
        footer_page: &[u8],
        meta: &[u8],
        meta_off: u64,
    ) -> Result<Segment, StoreError> {
        let bad = |m: Malformed, offset: u64| StoreError::Corrupt {
            path: path.display().to_string(),
            offset,
            what: m.0,
        };
        let fpage = format::footer_page(file_len)
            .ok_or_else(|| bad(Malformed("file length is not a whole number of pages"), 0))?;
        let footer = Footer::decode(footer_page, file_len).map_err(|m| bad(m, fpage))?;
        let rel = |off: u64| (off - meta_off) as usize;
        let filter_bytes = meta
            .get(rel(footer.filter_off)..rel(footer.filter_off) + footer.filter_len as usize)
            .ok_or_else(|| {
                bad(
                    Malformed("filter outside the meta region"),
                    footer.filter_off,
                )
            })?;
        let index_bytes = meta
            .get(rel(footer.index_off)..rel(footer.index_off) + footer.index_len as usize)
            .ok_or_else(|| bad(Malformed("index outside the meta region"), footer.index_off))?;
        let mut crc = crc32c::crc32c(filter_bytes);
        crc = crc32c::crc32c_append(crc, index_bytes);
        if crc != footer.meta_crc {
            return Err(bad(
                Malformed("filter/index checksum mismatch"),
                footer.filter_off,
            ));
        }
        let filter = Bloom::decode(filter_bytes)
            .ok_or_else(|| bad(Malformed("filter malformed"), footer.filter_off))?;
        let index = BlockIndex::decode(index_bytes, footer.data_len)
            .map_err(|m| bad(m, footer.index_off))?;
        if index.len() != footer.blocks as usize {
            return Err(bad(
                Malformed("block count differs from the index"),
                footer.index_off,
            ));
        }
        check_footer_against_index(&footer, &index).map_err(|m| bad(m, fpage))?;
        Ok(Segment {
            id,
            name: name_of(&path),
            path,
            file,
            footer,
            index: Rc::new(index),
            filter: Rc::new(filter),
            file_len,
            clip: None,
            residency: Rc::default(),
        })
    }
}

/// What the footer says that the index can confirm without reading data
/// (FORMAT.md §7): records and key groups only with blocks, at least a
/// record per block and at most one per record header the data could
/// hold, every block's last key within the footer's key
/// groups and the last one at its largest. (Reads skip a segment by those
/// key groups: a wrong bound would hide records, not fail.)
fn check_footer_against_index(f: &Footer, index: &BlockIndex) -> Result<(), Malformed> {
    let Some(last) = index.len().checked_sub(1) else {
        return match (f.records, f.min_kg, f.max_kg) {
            (0, 0, 0) => Ok(()),
            _ => Err(Malformed(
                "records or key groups in a segment without blocks",
            )),
        };
    };
    if f.records < index.len() as u64 {
        return Err(Malformed("fewer records than blocks"));
    }
    // A record takes at least its header: a count past that would size a
    // compaction's filter (`expect_at_most`) for records that cannot be.
    if f.records > f.data_len / format::RECORD_HEADER as u64 {
        return Err(Malformed("more records than the data blocks can hold"));
    }
    let kg = |i: usize| crate::keys::key_group(index.last_key(i));
    if (0..index.len()).any(|i| !(f.min_kg..=f.max_kg).contains(&kg(i))) || kg(last) != f.max_kg {
        return Err(Malformed(KEY_GROUPS_OUTSIDE_FOOTER));
    }
    Ok(())
}

/// A block or index key in a key group the footer does not cover.
pub const KEY_GROUPS_OUTSIDE_FOOTER: &str = "keys outside the footer's key groups";

/// `path`'s file name.
/// A segment's name: its file's, or for a file an open set aside
/// (`*.torn`) the name it had, which checkpoints and restored layers still
/// name it by.
fn name_of(path: &Path) -> Rc<str> {
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    match parse_torn_file_name(&file) {
        Some(was) => was.into(),
        None => file.into(),
    }
}

/// The file name of a segment.
pub fn file_name(order: u64, generation: u32) -> String {
    format!("seg-{order:016x}-{generation:08x}.sst")
}

/// The segment file name a `*.torn` file was set aside from
/// (`seg-…-….torn` or `seg-…-….torn.N`, see `Store::open`).
pub fn parse_torn_file_name(name: &str) -> Option<String> {
    let (stem, rest) = name.split_once(".torn")?;
    let numbered = rest.is_empty()
        || rest
            .strip_prefix('.')
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()));
    let was = format!("{stem}.sst");
    (numbered && parse_file_name(&was).is_some()).then_some(was)
}

/// Parses a segment file name into `(order, generation)`.
pub fn parse_file_name(name: &str) -> Option<(u64, u32)> {
    let rest = name.strip_prefix("seg-")?.strip_suffix(".sst")?;
    let (o, g) = rest.split_once('-')?;
    // Only the canonical form: 16 and 8 lowercase hex digits.
    let hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    };
    if !hex(o, 16) || !hex(g, 8) {
        return None;
    }
    Some((
        u64::from_str_radix(o, 16).ok()?,
        u32::from_str_radix(g, 16).ok()?,
    ))
}

/// The file an import writes: not a segment name, so recovery never takes
/// it for a layer of its own; only `LAYERS` (or a manifest) makes it one.
pub fn import_file_name(serial: u64) -> String {
    format!("imp-{serial:016x}.sst")
}

/// The serial of an import file name (only the canonical form).
pub fn parse_import_file_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("imp-")?.strip_suffix(".sst")?;
    let canonical = hex.len() == 16
        && hex
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c));
    canonical
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
}

/// Whether a layer list or manifest may name `name`: a segment or an
/// import file, nothing else (no path, no other file of the directory).
pub fn is_layer_file_name(name: &str) -> bool {
    parse_file_name(name).is_some() || parse_import_file_name(name).is_some()
}

/// Bytes buffered before a write is issued.
pub const WRITE_CHUNK: usize = 1 << 20;
/// Writes a writer keeps in flight at most: a flush or compaction that
/// produces faster than the disk takes waits, so its buffers stay bounded
/// (8 MiB) instead of piling up in memory the budget does not see.
pub const MAX_WRITES_IN_FLIGHT: usize = 8;
/// Capacity of a writer's usual buffer: a write chunk and room for the
/// block that crosses its end.
const BUF_CAP: usize = WRITE_CHUNK + 64 * 1024;
/// What one writer's buffers hold at most: those in flight, the one
/// filling and a spare kept for the next fill.
pub const WRITER_BYTES: usize = (MAX_WRITES_IN_FLIGHT + 2) * BUF_CAP;

/// How a writer builds its segment's filter.
enum FilterBuild {
    /// The keys' hashes, kept until the last key: their count sizes the
    /// filter, then they go in (`filled` of them so far).
    Hashes {
        hashes: Vec<u64>,
        filter: Option<Bloom>,
        filled: usize,
    },
    /// Sized for an upper bound and filled as keys come; at the end folded
    /// by `fold`'s factor, blocks before its second number done.
    Direct {
        filter: Bloom,
        fold: Option<(usize, usize)>,
    },
    /// Done (after `finish`).
    Built(Bloom),
}

impl FilterBuild {
    /// The finished filter (after [`SegmentWriter::fill_filter`] returned
    /// true), leaving `Built` of an empty one behind.
    fn take(&mut self) -> Bloom {
        let done = std::mem::replace(self, FilterBuild::Built(Bloom::with_keys(0)));
        match done {
            FilterBuild::Hashes {
                filter: Some(f),
                filled,
                hashes,
            } if filled == hashes.len() => f,
            FilterBuild::Direct { filter, fold: None } | FilterBuild::Built(filter) => filter,
            FilterBuild::Hashes { .. } | FilterBuild::Direct { .. } => {
                unreachable!("the filter is taken only once fill_filter is done")
            }
        }
    }
}

/// Where a writer's meta region (filter, then index) has got to.
struct MetaProgress {
    /// Where data ends and the meta region begins.
    data_len: u64,
    /// CRC32C of the meta bytes so far.
    crc: u32,
    at: MetaAt,
}

/// The next piece of the meta region.
#[derive(Clone, Copy)]
enum MetaAt {
    /// The filter's words from this one (its head is written).
    Filter(usize),
    /// The index's blocks from this one (its count is written).
    Index(usize),
}

/// Streams a segment to disk. Writes complete asynchronously; the owner
/// routes their completions back with [`SegmentWriter::write_done`].
pub struct SegmentWriter {
    pub path: PathBuf,
    pub file: FileId,
    offset: u64,
    buf: AlignedBuf,
    block: BlockBuilder,
    index: BlockIndex,
    filter: FilterBuild,
    records: u64,
    min_kg: u16,
    max_kg: u16,
    footer: Footer,
    writes_in_flight: usize,
    /// Bytes of those writes (a block of one large record is written
    /// whole, so a count alone does not bound them).
    bytes_in_flight: usize,
    /// The first write error; the file is abandoned after it.
    pub error: Option<StoreError>,
    finished: bool,
    token: u64,
    footer_page: Option<(u64, AlignedBuf)>,
    fsync_issued: bool,
    /// Write buffers the kernel gave back, reused (a fresh one costs a
    /// zeroing pass and page faults).
    spare: Vec<AlignedBuf>,
    finished_data: bool,
    /// The meta region in progress (see `finish_until`).
    meta: Option<MetaProgress>,
    /// One run of meta bytes, reused.
    meta_run: Vec<u8>,
    /// Copies of the data blocks sealed since the last `take_sealed`, by
    /// block number, when the owner asked for them (`keep_blocks`).
    sealed: Option<Vec<(u32, AlignedBuf)>>,
}

impl SegmentWriter {
    /// Creates the file. `token` tags every write this writer issues.
    pub fn create<I: Io>(
        io: &mut I,
        dir: &Path,
        order: u64,
        generation: u32,
        min_order: u64,
        token: u64,
    ) -> Result<SegmentWriter, StoreError> {
        Self::create_at(
            io,
            dir.join(file_name(order, generation)),
            order,
            generation,
            min_order,
            token,
        )
    }

    /// Creates the file at `path` (any name).
    pub fn create_at<I: Io>(
        io: &mut I,
        path: PathBuf,
        order: u64,
        generation: u32,
        min_order: u64,
        token: u64,
    ) -> Result<SegmentWriter, StoreError> {
        let file = io
            .open(&path, OpenMode::CreateNew)
            .map_err(|e| StoreError::io(&path, "create", &e))?;
        Ok(SegmentWriter {
            path,
            file,
            offset: 0,
            buf: AlignedBuf::with_capacity(BUF_CAP),
            block: BlockBuilder::default(),
            index: BlockIndex::default(),
            filter: FilterBuild::Hashes {
                hashes: Vec::new(),
                filter: None,
                filled: 0,
            },
            records: 0,
            min_kg: u16::MAX,
            max_kg: 0,
            footer: Footer {
                order,
                generation,
                min_order,
                ..Footer::default()
            },
            writes_in_flight: 0,
            bytes_in_flight: 0,
            error: None,
            finished: false,
            token,
            footer_page: None,
            fsync_issued: false,
            spare: Vec::new(),
            finished_data: false,
            meta: None,
            meta_run: Vec::new(),
            sealed: None,
        })
    }

    /// Builds the filter as records are added, sized for at most `keys`
    /// of them and folded to the records added at the end (see
    /// [`Bloom::fold`]): about 10 bits per key held while writing instead
    /// of an 8-byte hash each. Call before the first `add`.
    pub fn expect_at_most(&mut self, keys: usize) {
        assert_eq!(self.records, 0, "expect_at_most before the first add");
        self.filter = FilterBuild::Direct {
            filter: Bloom::for_at_most(keys),
            fold: None,
        };
    }

    /// Reserves the index for at most `blocks` blocks whose last keys
    /// take `key_bytes` (a compaction: what its inputs' indexes hold), so
    /// the index never holds doubled capacity beyond that.
    pub fn expect_index_at_most(&mut self, blocks: usize, key_bytes: usize) {
        self.index.reserve(blocks, key_bytes);
    }

    /// Keeps a copy of every data block sealed from now on, for the owner
    /// to put into the block cache (`take_sealed`): what was just written
    /// is what reads want next, and the file bypasses the page cache.
    pub fn keep_blocks(&mut self) {
        self.sealed = Some(Vec::new());
    }

    /// The blocks sealed since the last call, by block number (empty
    /// unless `keep_blocks` was called).
    pub fn take_sealed(&mut self) -> Vec<(u32, AlignedBuf)> {
        self.sealed.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Adds a record; keys in strictly ascending order.
    pub fn add<I: Io>(&mut self, io: &mut I, kind: Kind, key: &[u8], value: &[u8]) {
        if !self.block.is_empty()
            && self.block.size_with(key.len(), value.len()) > format::BLOCK_TARGET
        {
            self.finish_block(io);
        }
        self.block.add(kind, key, value);
        let h = bloom::hash(key);
        match &mut self.filter {
            FilterBuild::Hashes { hashes, .. } => hashes.push(h),
            FilterBuild::Direct { filter, .. } => filter.insert(h),
            FilterBuild::Built(_) => unreachable!("a record added after finish"),
        }
        self.records += 1;
        let kg = crate::keys::key_group(key);
        self.min_kg = self.min_kg.min(kg);
        self.max_kg = self.max_kg.max(kg);
    }

    fn finish_block<I: Io>(&mut self, io: &mut I) {
        let len = self.block.finished_len();
        if self.buf.len() + len > self.buf.capacity() {
            self.flush_buf(io, len);
        }
        let off = self.offset + self.buf.len() as u64;
        self.index.push(off, len as u32, self.block.last_key());
        // Straight into the write buffer.
        let at = self.buf.len();
        self.block.finish_into(&mut self.buf);
        if let Some(sealed) = &mut self.sealed {
            let copy = AlignedBuf::copy_of(&self.buf[at..]);
            sealed.push((self.index.len() as u32 - 1, copy));
        }
        if self.buf.len() >= WRITE_CHUNK {
            self.flush_buf(io, 0);
        }
    }

    /// Issues a write of the buffered bytes; the next buffer can hold `next`.
    fn flush_buf<I: Io>(&mut self, io: &mut I, next: usize) {
        if self.buf.is_empty() {
            if self.buf.capacity() < next {
                self.buf = AlignedBuf::with_capacity(next);
            }
            return;
        }
        let cap = BUF_CAP.max(next);
        let fresh = match self.spare.pop() {
            _ if self.finished_data => AlignedBuf::with_capacity(0),
            Some(mut b) if b.capacity() >= cap => {
                b.clear();
                b
            }
            _ => AlignedBuf::with_capacity(cap),
        };
        let full = std::mem::replace(&mut self.buf, fresh);
        let len = full.len() as u64;
        if self.error.is_none() {
            self.bytes_in_flight += full.len();
            io.write(self.file, self.offset, full, self.token);
            self.writes_in_flight += 1;
        }
        self.offset += len;
    }

    /// Writes the last block, the filter, the index and the footer, in
    /// one go (see [`SegmentWriter::finish_until`]).
    pub fn finish<I: Io>(&mut self, io: &mut I) {
        let done = self.finish_steps(io, None);
        debug_assert!(done);
    }

    /// [`SegmentWriter::finish`] in steps that end at `deadline` or when
    /// the writer's buffers are all with the disk ([`write_room`]): the
    /// filter's last work (see [`SegmentWriter::fill_filter`]), then the
    /// filter and the index encoded a run at a time into the write
    /// buffers (never whole: a compaction's are tens of megabytes, one
    /// more copy of them in memory and a pass of milliseconds), then the
    /// footer. True once it is all issued; call it again until then.
    ///
    /// [`write_room`]: SegmentWriter::write_room
    pub fn finish_until<I: Io>(&mut self, io: &mut I, deadline: std::time::Instant) -> bool {
        self.finish_steps(io, Some(deadline))
    }

    fn finish_steps<I: Io>(&mut self, io: &mut I, deadline: Option<std::time::Instant>) -> bool {
        if self.finished {
            return true;
        }
        let until =
            deadline.unwrap_or_else(|| crate::clock::now() + std::time::Duration::from_secs(3600));
        if !self.fill_filter_until(until) {
            return false;
        }
        let mut meta = match self.meta.take() {
            Some(m) => m,
            None => self.start_meta(io),
        };
        loop {
            if deadline.is_some_and(|d| !self.write_room() || crate::clock::now() >= d) {
                self.meta = Some(meta);
                return false;
            }
            let FilterBuild::Built(filter) = &self.filter else {
                unreachable!("start_meta built the filter")
            };
            // A run: 4 KiB of filter, or up to 64 index entries.
            let mut run = std::mem::take(&mut self.meta_run);
            run.clear();
            meta.at = match meta.at {
                MetaAt::Filter(w) if w < filter.word_count() => {
                    let end = (w + 512).min(filter.word_count());
                    filter.encode_words(w, end, &mut run);
                    MetaAt::Filter(end)
                }
                MetaAt::Filter(_) => {
                    run.extend_from_slice(&(self.index.len() as u32).to_le_bytes());
                    MetaAt::Index(0)
                }
                MetaAt::Index(i) if i < self.index.len() => {
                    let end = (i + 64).min(self.index.len());
                    self.index.encode_blocks(i, end, &mut run);
                    MetaAt::Index(end)
                }
                MetaAt::Index(_) => break,
            };
            self.push_meta(io, &mut meta, &run);
            self.meta_run = run;
        }
        self.end_meta(io, meta);
        true
    }

    /// Seals the last data block and begins the meta region after it
    /// (block-aligned, in the same write buffer) with the filter's head.
    fn start_meta<I: Io>(&mut self, io: &mut I) -> MetaProgress {
        if !self.block.is_empty() {
            self.finish_block(io);
        }
        let filter = self.filter.take();
        let mut meta = MetaProgress {
            data_len: self.offset + self.buf.len() as u64,
            crc: 0,
            at: MetaAt::Filter(0),
        };
        self.push_meta(io, &mut meta, &filter.encode_head());
        self.filter = FilterBuild::Built(filter);
        meta
    }

    /// Appends meta bytes to the write buffer, writing it each time it is
    /// full to its last whole page (every write but the last is of whole
    /// pages at a page-aligned offset, as O_DIRECT needs).
    fn push_meta<I: Io>(&mut self, io: &mut I, meta: &mut MetaProgress, mut bytes: &[u8]) {
        meta.crc = crc32c::crc32c_append(meta.crc, bytes);
        while !bytes.is_empty() {
            let full = self.buf.capacity() / ALIGN * ALIGN;
            let n = (full - self.buf.len()).min(bytes.len());
            self.buf.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            if self.buf.len() == full {
                self.flush_buf(io, 0);
            }
        }
    }

    /// Writes the meta region's last page and records the footer, to be
    /// written once all before it is durable.
    fn end_meta<I: Io>(&mut self, io: &mut I, meta: MetaProgress) {
        let FilterBuild::Built(filter) = &self.filter else {
            unreachable!("start_meta built the filter")
        };
        let filter_len = filter.encoded_len() as u64;
        let index_len = self.index.encoded_len() as u64;
        debug_assert_eq!(
            self.offset + self.buf.len() as u64,
            meta.data_len + filter_len + index_len
        );
        // The last write needs no buffer after it, and none is kept.
        self.finished_data = true;
        self.spare = Vec::new();
        self.buf.pad_to_align();
        self.flush_buf(io, 0);
        self.footer.records = self.records;
        self.footer.data_len = meta.data_len;
        self.footer.filter_off = meta.data_len;
        self.footer.filter_len = filter_len;
        self.footer.index_off = meta.data_len + filter_len;
        self.footer.index_len = index_len;
        self.footer.min_kg = if self.records == 0 { 0 } else { self.min_kg };
        self.footer.max_kg = self.max_kg;
        self.footer.blocks = self.index.len() as u32;
        self.footer.meta_crc = meta.crc;
        // The footer is written only after everything before it is durable
        // (see `write_footer`): a valid footer then proves a whole file,
        // even if the device reorders writes at a power loss.
        let mut page = AlignedBuf::with_capacity(ALIGN);
        page.extend_from_slice(&self.footer.encode());
        page.pad_to_align();
        self.footer_page = Some((self.offset, page));
        self.offset += ALIGN as u64;
        self.finished = true;
        self.meta_run = Vec::new();
    }

    /// Once every write is acknowledged, issues the next fsync (tagged
    /// `token`); does nothing while writes or an fsync are in flight. An
    /// error means a write failed and the file must be abandoned.
    pub fn sync_if_written<I: Io>(&mut self, io: &mut I, token: u64) -> Result<(), StoreError> {
        if !self.all_written() || self.fsync_issued {
            return Ok(());
        }
        if let Some(e) = self.error.clone() {
            return Err(e);
        }
        self.fsync_issued = true;
        io.fsync(self.file, token);
        Ok(())
    }

    /// Records an fsync's result. `Ok(true)`: the file is complete (its
    /// footer is durable). `Ok(false)`: the data just became durable and
    /// the footer was written; `sync_if_written` issues the second fsync.
    pub fn synced<I: Io>(&mut self, io: &mut I, r: Result<usize, i32>) -> Result<bool, StoreError> {
        self.fsync_issued = false;
        if let Err(errno) = r {
            return Err(StoreError::from_errno(&self.path, "fsync", errno));
        }
        Ok(!self.write_footer(io))
    }

    /// Writes the footer page if it is still pending (true) — only after
    /// the first fsync, so a valid footer proves durable data.
    fn write_footer<I: Io>(&mut self, io: &mut I) -> bool {
        let Some((off, page)) = self.footer_page.take() else {
            return false;
        };
        if self.error.is_none() {
            self.bytes_in_flight += page.len();
            io.write(self.file, off, page, self.token);
            self.writes_in_flight += 1;
        }
        true
    }

    /// Records the completion of one of this writer's writes (and takes
    /// its buffer back for the next).
    pub fn write_done(&mut self, result: Result<usize, i32>, buf: Option<AlignedBuf>) {
        self.writes_in_flight -= 1;
        let len = buf.as_ref().map_or(WRITE_CHUNK, |b| b.len());
        self.bytes_in_flight = self.bytes_in_flight.saturating_sub(len);
        if self.writes_in_flight == 0 {
            self.bytes_in_flight = 0;
        }
        // (Not a large record's buffer: spares are for the usual chunk.)
        if let Some(b) = buf
            && b.capacity() >= BUF_CAP
            && b.capacity() <= 2 * WRITE_CHUNK
            && self.spare.len() < 2
            && !self.finished_data
        {
            self.spare.push(b);
        }
        if let Err(errno) = result
            && self.error.is_none()
        {
            self.error = Some(StoreError::from_errno(&self.path, "write", errno));
        }
    }

    /// Writes issued and not yet acknowledged (each at most about
    /// [`WRITE_CHUNK`] bytes).
    pub fn writes_in_flight(&self) -> usize {
        self.writes_in_flight
    }

    /// Whether another chunk may be written now: fewer than
    /// [`MAX_WRITES_IN_FLIGHT`] writes, of fewer bytes than that many
    /// chunks, are in flight.
    pub fn write_room(&self) -> bool {
        self.writes_in_flight < MAX_WRITES_IN_FLIGHT
            && self.bytes_in_flight < MAX_WRITES_IN_FLIGHT * WRITE_CHUNK
    }

    /// No write or fsync of this writer is in flight.
    pub fn idle(&self) -> bool {
        self.writes_in_flight == 0 && !self.fsync_issued
    }

    /// Every byte was handed to the kernel and acknowledged.
    pub fn all_written(&self) -> bool {
        self.finished && self.writes_in_flight == 0
    }

    pub fn records(&self) -> u64 {
        self.records
    }

    /// Does up to `n` more pieces of the filter's last work: inserting the
    /// hashes kept for it, or (after [`SegmentWriter::expect_at_most`])
    /// folding it towards the records added, a block at a time; true once
    /// it is done. Called after the last `add`, in bounded steps by
    /// `finish_until` (a random write per key into a filter of megabytes,
    /// or a pass over it).
    fn fill_filter(&mut self, n: usize) -> bool {
        let records = self.records as usize;
        match &mut self.filter {
            FilterBuild::Hashes {
                hashes,
                filter,
                filled,
            } => {
                let keys = hashes.len();
                let filter = filter.get_or_insert_with(|| Bloom::with_keys(keys));
                let end = filled.saturating_add(n).min(keys);
                for &h in &hashes[*filled..end] {
                    filter.insert(h);
                }
                *filled = end;
                end == keys
            }
            FilterBuild::Direct { filter, fold } => {
                let mut n = n;
                loop {
                    let (k, next) = match *fold {
                        Some(f) => f,
                        None => match filter.fold_factor(records) {
                            Some(k) => (k, 0),
                            None => return true,
                        },
                    };
                    if n == 0 {
                        *fold = Some((k, next));
                        return false;
                    }
                    let blocks = filter.block_count() / k;
                    let end = next.saturating_add(n).min(blocks);
                    filter.fold_blocks(k, next, end);
                    n -= end - next;
                    if end == blocks {
                        filter.end_fold(k);
                        *fold = None;
                    } else {
                        *fold = Some((k, end));
                    }
                }
            }
            FilterBuild::Built(_) => true,
        }
    }

    /// [`SegmentWriter::fill_filter`] in runs of 256 pieces (a kept key's
    /// random write, or a block of the fold) until the filter is done
    /// (true) or `deadline` passes.
    fn fill_filter_until(&mut self, deadline: std::time::Instant) -> bool {
        loop {
            if self.fill_filter(256) {
                return true;
            }
            if crate::clock::now() >= deadline {
                return false;
            }
        }
    }

    /// The open segment this writer produced (after its fsync).
    pub fn into_segment(mut self, id: u64) -> Segment {
        Segment {
            id,
            name: name_of(&self.path),
            path: self.path,
            file: self.file,
            footer: self.footer,
            index: Rc::new({
                let mut ix = std::mem::take(&mut self.index);
                ix.seal();
                ix
            }),
            filter: Rc::new(self.filter.take()),
            file_len: self.offset,
            clip: None,
            residency: Rc::default(),
        }
    }
}
