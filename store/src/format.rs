//! The segment file format, byte by byte in `store/FORMAT.md`:
//!
//! ```text
//! [data block]* [filter] [index] (padded to 4 KiB) [footer page: 4 KiB]
//! ```
//!
//! Every data block is a multiple of 4 KiB and starts on a 4 KiB boundary,
//! so one aligned read fetches it (O_DIRECT-ready). Parsing goes through an
//! unvalidated form: lengths are checked before use and a checksum that
//! fails is an error naming the file and offset, never data.

use crate::aligned::ALIGN;

/// Footer magic.
pub const FOOTER_MAGIC: [u8; 8] = *b"STATSEG1";
/// Segment format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of a footer (inside the last 4 KiB page of a file).
pub const FOOTER_LEN: usize = 128;
/// The footer's `what` for a file written by another format version: not
/// corruption, and not to be set aside (a newer binary can read it).
pub const UNSUPPORTED_VERSION: &str = "unsupported segment format version";

/// Target payload per data block before padding.
pub const BLOCK_TARGET: usize = 4096 - 16;
/// The longest value a record may hold: its block's `u32` payload length
/// and the index's `u32` block length (rounded up to a page) must hold the
/// value with its key (at most 64 KiB) and headers.
pub const MAX_RECORD_VALUE: usize = u32::MAX as usize - (1 << 20);

/// Record header: `u8 kind | u8 0 | u16 key_len | u32 value_len`.
pub const RECORD_HEADER: usize = 8;
/// Block header: `u32 payload_len | u32 crc32c(payload)`.
pub const BLOCK_HEADER: usize = 8;

/// What a record says about its key.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The value (a value state's value, a list's whole encoded element list, a map entry's value).
    Put = 1,
    /// The key is deleted.
    Delete = 2,
    /// List elements appended to whatever older layers hold.
    Merge = 3,
    /// At a map's base key: every entry of the map in older layers is gone.
    Clear = 4,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Put,
            2 => Kind::Delete,
            3 => Kind::Merge,
            4 => Kind::Clear,
            _ => return None,
        })
    }
}

/// A parse failure inside one block or region (the caller adds the file
/// and offset).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Malformed(pub &'static str);

/// Builds one data block in memory.
#[derive(Default)]
pub struct BlockBuilder {
    payload: Vec<u8>,
    offsets: Vec<u32>,
}

/// Where a finished block is appended: a `Vec`, or the aligned buffer a
/// segment writer hands to the disk (no staging copy).
pub trait BlockSink {
    fn append(&mut self, bytes: &[u8]);
}

impl BlockSink for Vec<u8> {
    fn append(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl BlockSink for crate::aligned::AlignedBuf {
    fn append(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

static ZEROS: [u8; ALIGN] = [0; ALIGN];

impl BlockBuilder {
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// Payload bytes if `key`/`value` were added now (for the size check).
    pub fn size_with(&self, key_len: usize, value_len: usize) -> usize {
        self.payload.len() + RECORD_HEADER + key_len + value_len + (self.offsets.len() + 1) * 4 + 4
    }

    /// Adds a record; keys must arrive in strictly ascending order.
    pub fn add(&mut self, kind: Kind, key: &[u8], value: &[u8]) {
        debug_assert!(
            self.offsets.is_empty() || key > self.last_key(),
            "keys out of order"
        );
        self.offsets.push(self.payload.len() as u32);
        self.payload.push(kind as u8);
        self.payload.push(0);
        self.payload
            .extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.payload
            .extend_from_slice(&(value.len() as u32).to_le_bytes());
        self.payload.extend_from_slice(key);
        self.payload.extend_from_slice(value);
    }

    /// The key of the last record added (empty if none).
    pub fn last_key(&self) -> &[u8] {
        let Some(&o) = self.offsets.last() else {
            return &[];
        };
        let o = o as usize;
        let klen = u16::from_le_bytes([self.payload[o + 2], self.payload[o + 3]]) as usize;
        &self.payload[o + RECORD_HEADER..o + RECORD_HEADER + klen]
    }

    /// Bytes the finished block will take (padded to 4 KiB).
    pub fn finished_len(&self) -> usize {
        (BLOCK_HEADER + self.payload.len() + self.offsets.len() * 4 + 4).next_multiple_of(ALIGN)
    }

    /// Appends the finished block (header, payload, offsets, zero padding
    /// to 4 KiB) to `out` and resets the builder. Returns its length.
    pub fn finish_into<S: BlockSink + ?Sized>(&mut self, out: &mut S) -> usize {
        let padded = self.finished_len();
        for o in &self.offsets {
            self.payload.extend_from_slice(&o.to_le_bytes());
        }
        self.payload
            .extend_from_slice(&(self.offsets.len() as u32).to_le_bytes());
        out.append(&(self.payload.len() as u32).to_le_bytes());
        out.append(&crc32c::crc32c(&self.payload).to_le_bytes());
        out.append(&self.payload);
        out.append(&ZEROS[..padded - BLOCK_HEADER - self.payload.len()]);
        self.payload.clear();
        // A block of one large record does not keep its size for the
        // blocks after it.
        self.payload.shrink_to(4 * BLOCK_TARGET);
        self.offsets.clear();
        padded
    }
}

/// A validated view of a data block's payload.
#[derive(Clone, Copy, Debug)]
pub struct BlockView<'a> {
    payload: &'a [u8],
    /// Start of the offsets array inside `payload`.
    offs_at: usize,
    n: usize,
}

/// One record inside a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record<'a> {
    pub kind: Kind,
    pub key: &'a [u8],
    pub value: &'a [u8],
}

impl<'a> BlockView<'a> {
    /// Checks the header, CRC and record table of a whole block (as read
    /// from disk, padding included).
    pub fn parse(block: &'a [u8]) -> Result<BlockView<'a>, Malformed> {
        if block.len() < BLOCK_HEADER + 4 {
            return Err(Malformed("block shorter than its header"));
        }
        let plen = u32::from_le_bytes(block[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(block[4..8].try_into().expect("4 bytes"));
        let payload = block
            .get(
                BLOCK_HEADER
                    ..BLOCK_HEADER
                        .checked_add(plen)
                        .ok_or(Malformed("payload length overflows"))?,
            )
            .ok_or(Malformed("payload length beyond the block"))?;
        if crc32c::crc32c(payload) != crc {
            return Err(Malformed("block checksum mismatch"));
        }
        if payload.len() < 4 {
            return Err(Malformed("payload without a record count"));
        }
        let n =
            u32::from_le_bytes(payload[payload.len() - 4..].try_into().expect("4 bytes")) as usize;
        let offs_at = payload
            .len()
            .checked_sub(
                4 + n
                    .checked_mul(4)
                    .ok_or(Malformed("record count overflows"))?,
            )
            .ok_or(Malformed("record table larger than the payload"))?;
        if payload.len() > BLOCK_TARGET && n != 1 {
            // What lets a list's length be bounded from the index alone
            // (`Segment::value_bound`).
            return Err(Malformed(
                "a block larger than its target holds more than one record",
            ));
        }
        // Validate every record's bounds, and that keys ascend, once, so
        // lookups can index and search freely: one pass over the record
        // table (the remote runtime runs this for every fetched block).
        let mut prev: Option<&[u8]> = None;
        for c in payload[offs_at..payload.len() - 4].chunks_exact(4) {
            let off = u32::from_le_bytes(c.try_into().expect("4 bytes")) as usize;
            let Some(h) = payload.get(off..off + RECORD_HEADER) else {
                return Err(Malformed("record header out of bounds"));
            };
            let klen = u16::from_le_bytes([h[2], h[3]]) as usize;
            let vlen = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
            // No overflow: off < 2^32, klen < 2^16, vlen < 2^32.
            let end = off + RECORD_HEADER + klen + vlen;
            if end > offs_at || Kind::from_u8(h[0]).is_none() {
                return Err(Malformed(if Kind::from_u8(h[0]).is_none() {
                    "unknown record kind"
                } else {
                    "record runs past the record table"
                }));
            }
            let key = &payload[off + RECORD_HEADER..off + RECORD_HEADER + klen];
            if prev.is_some_and(|p| p >= key) {
                return Err(Malformed(KEYS_OUT_OF_ORDER));
            }
            prev = Some(key);
        }
        Ok(BlockView {
            payload,
            offs_at,
            n,
        })
    }

    /// Rebuilds a view of a block that [`BlockView::parse`] validated before
    /// (no checksum or bounds work): `offs_at` and `n` as parse found them.
    pub fn trusted(block: &'a [u8], offs_at: usize, n: usize) -> BlockView<'a> {
        let plen = u32::from_le_bytes(block[0..4].try_into().expect("4 bytes")) as usize;
        BlockView {
            payload: &block[BLOCK_HEADER..BLOCK_HEADER + plen],
            offs_at,
            n,
        }
    }

    /// `(offs_at, n)`, to rebuild the view later with [`BlockView::trusted`].
    pub fn shape(&self) -> (usize, usize) {
        (self.offs_at, self.n)
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn try_record(&self, i: usize) -> Result<Record<'a>, Malformed> {
        let at = self.offs_at + i * 4;
        let off =
            u32::from_le_bytes(self.payload[at..at + 4].try_into().expect("4 bytes")) as usize;
        let h = self
            .payload
            .get(off..off + RECORD_HEADER)
            .filter(|_| off + RECORD_HEADER <= self.offs_at)
            .ok_or(Malformed("record header out of bounds"))?;
        let kind = Kind::from_u8(h[0]).ok_or(Malformed("unknown record kind"))?;
        let klen = u16::from_le_bytes([h[2], h[3]]) as usize;
        let vlen = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let kstart = off + RECORD_HEADER;
        let vstart = kstart + klen;
        let end = vstart
            .checked_add(vlen)
            .ok_or(Malformed("value length overflows"))?;
        if end > self.offs_at {
            return Err(Malformed("record runs past the record table"));
        }
        Ok(Record {
            kind,
            key: &self.payload[kstart..vstart],
            value: &self.payload[vstart..end],
        })
    }

    /// The key of record `i` (validated at parse), without the rest.
    #[inline]
    pub fn key(&self, i: usize) -> &'a [u8] {
        let at = self.offs_at + i * 4;
        let off =
            u32::from_le_bytes(self.payload[at..at + 4].try_into().expect("4 bytes")) as usize;
        let klen = u16::from_le_bytes([self.payload[off + 2], self.payload[off + 3]]) as usize;
        &self.payload[off + RECORD_HEADER..off + RECORD_HEADER + klen]
    }

    /// Record `i` (validated at parse).
    pub fn record(&self, i: usize) -> Record<'a> {
        self.try_record(i)
            .expect("records were validated when the block was parsed")
    }

    /// Index of the first record whose key is >= `key`.
    pub fn lower_bound(&self, key: &[u8]) -> usize {
        let (mut lo, mut hi) = (0, self.n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.key(mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The record with exactly `key`.
    pub fn find(&self, key: &[u8]) -> Option<Record<'a>> {
        let i = self.lower_bound(key);
        (i < self.n)
            .then(|| self.record(i))
            .filter(|r| r.key == key)
    }

    /// The bytes of record `r` as stored (header, key, value).
    pub fn raw(&self, r: &Record<'a>) -> &'a [u8] {
        let start = r.key.as_ptr() as usize - self.payload.as_ptr() as usize - RECORD_HEADER;
        let end = r.value.as_ptr() as usize - self.payload.as_ptr() as usize + r.value.len();
        &self.payload[start..end]
    }

    /// The longest run of plain puts from record `i` (whose bytes are
    /// `first_len` long) that are adjacent in the block, whose keys pass
    /// `keep`, and that fits `room` bytes (at least record `i`): its length
    /// in bytes and the record after it. Reads only record headers and keys.
    pub fn put_run(
        &self,
        i: usize,
        first_len: usize,
        room: usize,
        mut keep: impl FnMut(&[u8]) -> bool,
    ) -> (usize, usize) {
        let p = self.payload;
        let off_of = |j: usize| {
            let at = self.offs_at + j * 4;
            u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes")) as usize
        };
        let start = off_of(i);
        let mut end = start + first_len;
        let mut j = i + 1;
        while j < self.n && end - start < room {
            if off_of(j) != end || p[end] != Kind::Put as u8 {
                break;
            }
            let klen = u16::from_le_bytes([p[end + 2], p[end + 3]]) as usize;
            let vlen =
                u32::from_le_bytes(p[end + 4..end + 8].try_into().expect("4 bytes")) as usize;
            let key = &p[end + RECORD_HEADER..end + RECORD_HEADER + klen];
            if !keep(key) {
                break;
            }
            end += RECORD_HEADER + klen + vlen;
            j += 1;
        }
        (end - start, j)
    }

    /// `len` bytes of the block from the start of record `first` (a run of
    /// adjacent records).
    pub fn raw_span(&self, first: &Record<'a>, len: usize) -> &'a [u8] {
        let start = first.key.as_ptr() as usize - self.payload.as_ptr() as usize - RECORD_HEADER;
        &self.payload[start..start + len]
    }

    /// Payload byte range of record `i`'s value, for referencing it later.
    pub fn value_range(&self, r: &Record<'a>) -> std::ops::Range<usize> {
        let start = r.value.as_ptr() as usize - self.payload.as_ptr() as usize + BLOCK_HEADER;
        start..start + r.value.len()
    }
}

/// The in-memory block index of a segment: for each block, its offset,
/// length and last key, keys packed in one buffer.
///
/// Searching it is on every read's path, so [`BlockIndex::seal`] adds two
/// aids. Blocks whose last keys begin with the same two bytes (a key
/// group) form a *run*, whose keys share a longer prefix too (the state id
/// and key length of fixed-size keys): each run keeps that prefix length
/// and its last key, in a small array that stays in cache. For each block,
/// `heads` holds the 8 bytes of its last key after its run's prefix, as a
/// big-endian integer. A search finds the run among the few run keys, then
/// compares integers within it, and reads a whole key only where two heads
/// tie. (The first 8 bytes of a key are its key group, state id and half
/// its length: they tie across a whole key group.)
#[derive(Default, Debug, Clone)]
pub struct BlockIndex {
    keys: Vec<u8>,
    key_ends: Vec<u32>,
    offsets: Vec<u64>,
    lens: Vec<u32>,
    /// The longest block's length.
    largest: u32,
    /// Built by `seal` (empty until then, and after a `push`).
    heads: Vec<u64>,
    /// Per run, the head of every [`GROUP`]-th block's group's last
    /// block (from `Run::top_start`): an eighth of `heads`, so it stays in
    /// the CPU's caches where `heads` (one entry per 4 KiB block, 11 MB
    /// for a 6 GB segment) does not; a search reads it and then one group
    /// of heads (a cache line) instead of a miss per halving.
    tops: Vec<u64>,
    runs: Vec<Run>,
    /// Each run's last key, packed (`Run::key_end`).
    run_keys: Vec<u8>,
}

/// Blocks `..end` (from the previous run's end) whose last keys share
/// their first `prefix` bytes; its last key ends at `key_end` of
/// `BlockIndex::run_keys`.
#[derive(Clone, Copy, Debug)]
struct Run {
    end: u32,
    prefix: u32,
    key_end: u32,
    /// Where the run's groups start in `BlockIndex::tops`.
    top_start: u32,
}

/// Blocks per group of heads searched by a scan (8 x 8 bytes: a line).
const GROUP: usize = 8;

/// A key's first 8 bytes, zero-padded, big-endian: `head(a) < head(b)`
/// implies `a < b` (equal heads decide nothing).
#[inline]
fn head(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = key.len().min(8);
    b[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(b)
}

impl BlockIndex {
    /// Makes room for `blocks` more blocks whose last keys take
    /// `key_bytes` together, so pushing them does not grow the vectors by
    /// doubling (a compaction's output reserves what its inputs' indexes
    /// hold: up to twice that in doubled capacity otherwise, past the
    /// memory it was admitted with).
    pub fn reserve(&mut self, blocks: usize, key_bytes: usize) {
        self.keys.reserve_exact(key_bytes);
        self.key_ends.reserve_exact(blocks);
        self.offsets.reserve_exact(blocks);
        self.lens.reserve_exact(blocks);
    }

    /// Bytes of the blocks' last keys together.
    pub fn key_bytes(&self) -> usize {
        self.keys.len()
    }

    /// Adds the next block (last keys ascending). Call [`BlockIndex::seal`]
    /// after the last one.
    pub fn push(&mut self, offset: u64, len: u32, last_key: &[u8]) {
        self.keys.extend_from_slice(last_key);
        self.key_ends.push(self.keys.len() as u32);
        self.offsets.push(offset);
        self.lens.push(len);
        self.largest = self.largest.max(len);
        if !self.runs.is_empty() {
            self.heads.clear();
            self.tops.clear();
            self.runs.clear();
            self.run_keys.clear();
        }
    }

    /// Builds the search aids (see the type): runs and heads.
    pub fn seal(&mut self) {
        let n = self.len();
        let (mut heads, mut runs, mut run_keys) = (Vec::with_capacity(n), Vec::new(), Vec::new());
        let mut tops = Vec::with_capacity(n.div_ceil(GROUP));
        let mut a = 0;
        while a < n {
            // Keys shorter than two bytes make runs of their own.
            let tag = self.last_key(a).get(..2);
            let mut b = a + 1;
            while b < n && tag.is_some() && self.last_key(b).get(..2) == tag {
                b += 1;
            }
            // Keys sorted between the run's first and last share the
            // prefix those two share.
            let (first, last) = (self.last_key(a), self.last_key(b - 1));
            let prefix = first.iter().zip(last).take_while(|(x, y)| x == y).count();
            let top_start = tops.len() as u32;
            heads.extend((a..b).map(|i| head(&self.last_key(i)[prefix..])));
            tops.extend((a..b).step_by(GROUP).map(|g| heads[(g + GROUP).min(b) - 1]));
            run_keys.extend_from_slice(last);
            runs.push(Run {
                end: b as u32,
                prefix: prefix as u32,
                key_end: run_keys.len() as u32,
                top_start,
            });
            a = b;
        }
        self.heads = heads;
        self.tops = tops;
        self.runs = runs;
        self.run_keys = run_keys;
    }

    pub fn len(&self) -> usize {
        self.offsets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    pub fn last_key(&self, i: usize) -> &[u8] {
        let start = if i == 0 {
            0
        } else {
            self.key_ends[i - 1] as usize
        };
        &self.keys[start..self.key_ends[i] as usize]
    }

    fn run_key(&self, r: usize) -> &[u8] {
        let start = if r == 0 {
            0
        } else {
            self.runs[r - 1].key_end as usize
        };
        &self.run_keys[start..self.runs[r].key_end as usize]
    }

    pub fn block(&self, i: usize) -> (u64, u32) {
        (self.offsets[i], self.lens[i])
    }

    /// The longest block's length in bytes (0 without blocks): no record
    /// of the segment has a longer value.
    pub fn largest(&self) -> u32 {
        self.largest
    }

    /// Starts loading what [`BlockIndex::block`] reads for `i`.
    #[inline]
    pub(crate) fn prefetch(&self, i: usize) {
        if let (Some(o), Some(l)) = (self.offsets.get(i), self.lens.get(i)) {
            crate::prefetch::value(o, 1);
            crate::prefetch::value(l, 1);
        }
    }

    /// The block that may hold `key`: the first whose last key is >= it.
    pub fn find(&self, key: &[u8]) -> Option<usize> {
        if self.runs.is_empty() {
            // Not sealed: a plain binary search over the keys.
            return self.find_plain(key);
        }
        // The first run whose last key is >= key.
        let (mut lo, mut hi) = (0, self.runs.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.run_key(mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo == self.runs.len() {
            return None;
        }
        let run = self.runs[lo];
        let start = if lo == 0 {
            0
        } else {
            self.runs[lo - 1].end as usize
        };
        let prefix = run.prefix as usize;
        // `key` is at most the run's last key, which begins with the
        // prefix: a key that does not sorts before the whole run.
        if !key.starts_with(&self.run_key(lo)[..prefix]) {
            return Some(start);
        }
        let kh = head(&key[prefix..]);
        let end = run.end as usize;
        // Block `i` sorts before `key` (monotone: true, then false; false
        // for the run's last block, whose last key is >= key).
        let before = |i: usize, h: u64| h < kh || (h == kh && self.last_key(i) < key);
        // The first group whose last block is not before `key`, from the
        // cached tops...
        let tops = &self.tops[run.top_start as usize..][..(end - start).div_ceil(GROUP)];
        let (mut lo, mut hi) = (0, tops.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if before((start + GROUP * (mid + 1)).min(end) - 1, tops[mid]) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        // ...then the first block of that group not before it.
        let g = start + GROUP * lo;
        let last = (g + GROUP).min(end) - 1;
        Some(
            (g..last)
                .find(|&i| !before(i, self.heads[i]))
                .unwrap_or(last),
        )
    }

    fn find_plain(&self, key: &[u8]) -> Option<usize> {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.last_key(mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo < self.len()).then_some(lo)
    }

    pub fn memory_bytes(&self) -> usize {
        self.heads.capacity() * 8
            + self.tops.capacity() * 8
            + self.runs.capacity() * std::mem::size_of::<Run>()
            + self.run_keys.capacity()
            + self.keys.capacity()
            + self.key_ends.capacity() * 4
            + self.offsets.capacity() * 8
            + self.lens.capacity() * 4
    }

    /// Bytes [`BlockIndex::encode`] appends.
    pub fn encoded_len(&self) -> usize {
        4 + (0..self.len())
            .map(|i| 14 + self.last_key(i).len())
            .sum::<usize>()
    }

    /// Serialized form: `u32 count`, then per block `u64 offset | u32 len |
    /// u16 key_len | key`; in pieces, the count then
    /// [`BlockIndex::encode_blocks`].
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.len() as u32).to_le_bytes());
        self.encode_blocks(0, self.len(), out);
    }

    /// Blocks `from..to` of [`BlockIndex::encode`]'s form.
    pub fn encode_blocks(&self, from: usize, to: usize, out: &mut Vec<u8>) {
        for i in from..to {
            out.extend_from_slice(&self.offsets[i].to_le_bytes());
            out.extend_from_slice(&self.lens[i].to_le_bytes());
            let k = self.last_key(i);
            out.extend_from_slice(&(k.len() as u16).to_le_bytes());
            out.extend_from_slice(k);
        }
    }

    /// Parses [`BlockIndex::encode`]'s output, checking that blocks are
    /// aligned, ascending, inside `data_len`, and keys ascending.
    pub fn decode(mut b: &[u8], data_len: u64) -> Result<BlockIndex, Malformed> {
        let take = |b: &mut &[u8], n: usize| -> Result<Vec<u8>, Malformed> {
            if b.len() < n {
                return Err(Malformed("index truncated"));
            }
            let (h, t) = b.split_at(n);
            *b = t;
            Ok(h.to_vec())
        };
        let count = u32::from_le_bytes(take(&mut b, 4)?.try_into().expect("4")) as usize;
        let mut ix = BlockIndex::default();
        let mut next_off = 0u64;
        for i in 0..count {
            let off = u64::from_le_bytes(take(&mut b, 8)?.try_into().expect("8"));
            let len = u32::from_le_bytes(take(&mut b, 4)?.try_into().expect("4"));
            let klen = u16::from_le_bytes(take(&mut b, 2)?.try_into().expect("2")) as usize;
            let key = take(&mut b, klen)?;
            if off != next_off
                || len == 0
                || !(len as usize).is_multiple_of(ALIGN)
                || off + len as u64 > data_len
            {
                return Err(Malformed("index block bounds inconsistent"));
            }
            if i > 0 && key.as_slice() <= ix.last_key(i - 1) {
                return Err(Malformed("index keys not ascending"));
            }
            next_off = off + len as u64;
            ix.push(off, len, &key);
        }
        if !b.is_empty() || next_off != data_len {
            return Err(Malformed("index does not cover the data exactly"));
        }
        ix.seal();
        Ok(ix)
    }
}

/// How a footer fails when no footer was written (a write a crash cut
/// off, or not a segment at all).
pub const BAD_FOOTER_MAGIC: &str = "bad footer magic (torn or not a segment)";

/// A block whose keys do not strictly ascend.
pub const KEYS_OUT_OF_ORDER: &str = "keys not ascending within the block";

/// The footer, at the start of a segment's last 4 KiB page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Footer {
    /// Place of this segment in the store's order (newer is larger).
    pub order: u64,
    /// Compaction generation: a compaction's output keeps the order of its
    /// newest input and a higher generation.
    pub generation: u32,
    /// Oldest order merged into this segment (== `order` for a flush).
    pub min_order: u64,
    pub records: u64,
    /// Bytes of data blocks (they start at offset 0).
    pub data_len: u64,
    pub filter_off: u64,
    pub filter_len: u64,
    pub index_off: u64,
    pub index_len: u64,
    pub min_kg: u16,
    pub max_kg: u16,
    pub blocks: u32,
    /// CRC32C of filter and index bytes (contiguous).
    pub meta_crc: u32,
}

impl Footer {
    pub fn encode(&self) -> [u8; FOOTER_LEN] {
        let mut b = [0u8; FOOTER_LEN];
        b[0..8].copy_from_slice(&FOOTER_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        // 12..16 flags: zero.
        b[16..24].copy_from_slice(&self.order.to_le_bytes());
        b[24..28].copy_from_slice(&self.generation.to_le_bytes());
        b[32..40].copy_from_slice(&self.min_order.to_le_bytes());
        b[40..48].copy_from_slice(&self.records.to_le_bytes());
        b[48..56].copy_from_slice(&self.data_len.to_le_bytes());
        b[56..64].copy_from_slice(&self.filter_off.to_le_bytes());
        b[64..72].copy_from_slice(&self.filter_len.to_le_bytes());
        b[72..80].copy_from_slice(&self.index_off.to_le_bytes());
        b[80..88].copy_from_slice(&self.index_len.to_le_bytes());
        b[88..90].copy_from_slice(&self.min_kg.to_le_bytes());
        b[90..92].copy_from_slice(&self.max_kg.to_le_bytes());
        b[96..100].copy_from_slice(&self.blocks.to_le_bytes());
        b[104..108].copy_from_slice(&self.meta_crc.to_le_bytes());
        let crc = crc32c::crc32c(&b[..124]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Parses and checks a footer found in a file of `file_len` bytes.
    pub fn decode(b: &[u8], file_len: u64) -> Result<Footer, Malformed> {
        let b = b.get(..FOOTER_LEN).ok_or(Malformed("footer truncated"))?;
        if b[0..8] != FOOTER_MAGIC {
            return Err(Malformed(BAD_FOOTER_MAGIC));
        }
        let crc = u32::from_le_bytes(b[124..128].try_into().expect("4"));
        if crc32c::crc32c(&b[..124]) != crc {
            return Err(Malformed("footer checksum mismatch"));
        }
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        let version = u32_at(8);
        if version != FORMAT_VERSION {
            return Err(Malformed(UNSUPPORTED_VERSION));
        }
        let f = Footer {
            order: u64_at(16),
            generation: u32_at(24),
            min_order: u64_at(32),
            records: u64_at(40),
            data_len: u64_at(48),
            filter_off: u64_at(56),
            filter_len: u64_at(64),
            index_off: u64_at(72),
            index_len: u64_at(80),
            min_kg: u16::from_le_bytes([b[88], b[89]]),
            max_kg: u16::from_le_bytes([b[90], b[91]]),
            blocks: u32_at(96),
            meta_crc: u32_at(104),
        };
        let meta_end = f
            .index_off
            .checked_add(f.index_len)
            .ok_or(Malformed("meta overflows"))?;
        let filter_end = f
            .filter_off
            .checked_add(f.filter_len)
            .ok_or(Malformed("filter overflows"))?;
        if b[12..16] != [0; 4]
            || b[28..32] != [0; 4]
            || b[92..96] != [0; 4]
            || b[100..104] != [0; 4]
            || b[108..124] != [0; 16]
        {
            return Err(Malformed("reserved footer bytes are not zero"));
        }
        if f.filter_off != f.data_len
            || f.index_off != filter_end
            || meta_end.next_multiple_of(ALIGN as u64) + ALIGN as u64 != file_len
            || f.min_order > f.order
        {
            return Err(Malformed(
                "footer regions inconsistent with the file length",
            ));
        }
        Ok(f)
    }
}

/// Offset of the footer page in a file of `file_len` bytes.
pub fn footer_page(file_len: u64) -> Option<u64> {
    (file_len >= ALIGN as u64 && file_len.is_multiple_of(ALIGN as u64))
        .then(|| file_len - ALIGN as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An index reserved for what it will hold grows to exactly that
    /// (a compaction's output was admitted for its inputs' index memory;
    /// pushing into unreserved vectors left up to twice that allocated).
    #[test]
    fn a_reserved_index_holds_no_doubled_capacity() {
        let keys: Vec<Vec<u8>> = (0..1000u32)
            .map(|i| format!("key-{i:08}").into_bytes())
            .collect();
        let key_bytes: usize = keys.iter().map(Vec::len).sum();
        let exact = key_bytes + keys.len() * (4 + 8 + 4);
        let mut grown = BlockIndex::default();
        let mut reserved = BlockIndex::default();
        reserved.reserve(keys.len(), key_bytes);
        for (i, k) in keys.iter().enumerate() {
            grown.push(i as u64 * 4096, 4096, k);
            reserved.push(i as u64 * 4096, 4096, k);
        }
        assert_eq!(reserved.memory_bytes(), exact);
        assert!(grown.memory_bytes() > exact, "{}", grown.memory_bytes());
        assert_eq!(reserved.key_bytes(), key_bytes);
    }

    /// `find` against a scan, sealed and not, over keys that share heads,
    /// run tags and prefixes, are shorter than 8 bytes or end in zeros.
    fn check_index(mut keys: Vec<Vec<u8>>, extra_probes: &[Vec<u8>]) {
        keys.sort();
        keys.dedup();
        let mut ix = BlockIndex::default();
        for (i, k) in keys.iter().enumerate() {
            ix.push(i as u64 * 4096, 4096, k);
        }
        let mut probes = keys.clone();
        probes.extend_from_slice(extra_probes);
        for k in &keys {
            let mut shorter = k.clone();
            shorter.pop();
            let mut longer = k.clone();
            longer.push(0);
            let mut bumped = k.clone();
            if let Some(b) = bumped.last_mut() {
                *b = b.wrapping_add(1);
            }
            probes.extend([shorter, longer, bumped]);
        }
        probes.push(Vec::new());
        for sealed in [false, true] {
            if sealed {
                ix.seal();
            }
            for p in &probes {
                let scan = keys.iter().position(|k| k.as_slice() >= p.as_slice());
                assert_eq!(ix.find(p), scan, "probe {p:?} (sealed: {sealed})");
            }
        }
    }

    #[test]
    fn index_search_agrees_with_a_scan_where_heads_tie() {
        check_index(
            vec![
                vec![0],
                vec![0, 0],
                vec![1],
                vec![1, 2, 3, 4, 5, 6, 7, 8],
                vec![1, 2, 3, 4, 5, 6, 7, 8, 0],
                vec![1, 2, 3, 4, 5, 6, 7, 8, 0, 1],
                vec![1, 2, 3, 4, 5, 6, 7, 8, 9],
                vec![1, 2, 3, 4, 5, 6, 7, 9],
                vec![1, 2, 9],
                vec![1, 3],
                vec![9; 20],
            ],
            &[vec![1, 2], vec![1, 2, 3], vec![1, 2, 4], vec![2]],
        );
    }

    #[test]
    fn index_search_agrees_with_a_scan_on_random_keys() {
        // Keys as the store encodes them (key group, state, length, key)
        // and arbitrary short ones, from a small alphabet so prefixes and
        // heads tie often.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..200 {
            let n = 1 + (next() % 300) as usize;
            let mut keys = Vec::new();
            for _ in 0..n {
                let k: Vec<u8> = if round % 2 == 0 {
                    let mut k = Vec::new();
                    crate::keys::encode_base(
                        &mut k,
                        (next() % 4) as u16,
                        (next() % 2) as u32,
                        &(next() % 1000).to_be_bytes(),
                        b"",
                    );
                    k
                } else {
                    (0..next() % 12).map(|_| (next() % 3) as u8).collect()
                };
                keys.push(k);
            }
            let probes: Vec<Vec<u8>> = (0..50)
                .map(|_| (0..next() % 24).map(|_| (next() % 4) as u8).collect())
                .collect();
            check_index(keys, &probes);
        }
    }

    #[test]
    fn a_block_past_its_target_holds_one_record() {
        let mut b = BlockBuilder::default();
        b.add(Kind::Merge, b"a", &[1; 10_000]);
        let mut one = Vec::new();
        assert_eq!(b.finish_into(&mut one), 3 * ALIGN);
        assert_eq!(BlockView::parse(&one).unwrap().len(), 1);
        // The writer never makes this; a file that has it is corrupt.
        b.add(Kind::Put, b"a", &[1; 10]);
        b.add(Kind::Merge, b"b", &[1; 10_000]);
        let mut two = Vec::new();
        b.finish_into(&mut two);
        assert!(BlockView::parse(&two).is_err());
    }

    #[test]
    fn block_roundtrip_and_corruption() {
        let mut b = BlockBuilder::default();
        for i in 0..50u32 {
            b.add(Kind::Put, &i.to_be_bytes(), &[i as u8; 20]);
        }
        let mut out = Vec::new();
        let len = b.finish_into(&mut out);
        assert_eq!(len % ALIGN, 0);
        let v = BlockView::parse(&out).unwrap();
        assert_eq!(v.len(), 50);
        assert_eq!(v.find(&7u32.to_be_bytes()).unwrap().value, &[7u8; 20]);
        assert!(v.find(&70u32.to_be_bytes()).is_none());
        for at in [
            0,
            4,
            8,
            100,
            out.len() - 1 - (ALIGN - 1000).min(out.len() - 20),
        ] {
            let mut bad = out.clone();
            bad[at] ^= 1;
            if at >= 8 + u32::from_le_bytes(out[0..4].try_into().unwrap()) as usize {
                continue; // padding is not covered by the CRC
            }
            assert!(BlockView::parse(&bad).is_err(), "flip at {at} not caught");
        }
    }

    #[test]
    fn footer_roundtrip() {
        let f = Footer {
            order: 9,
            generation: 1,
            min_order: 3,
            records: 10,
            data_len: 8192,
            filter_off: 8192,
            filter_len: 72,
            index_off: 8264,
            index_len: 40,
            min_kg: 1,
            max_kg: 5,
            blocks: 2,
            meta_crc: 7,
        };
        let e = f.encode();
        assert_eq!(Footer::decode(&e, 16384), Ok(f));
        assert!(Footer::decode(&e, 20480).is_err());
        let mut bad = e;
        bad[20] ^= 1;
        assert!(Footer::decode(&bad, 16384).is_err());
    }
}
