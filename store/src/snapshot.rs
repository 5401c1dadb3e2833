//! Portable snapshot chunks (`store/FORMAT.md` §13): the byte stream of a
//! snapshot is a state table, then key-group frames of records as stored,
//! cut into chunks of at most [`CHUNK_LEN`] bytes, each with a header and a
//! CRC32C.
//!
//! The stream is one pass: a state table item names the states whose ids
//! the records carry (ids are local to a daemon; names and kinds are not),
//! then a group header `0xFF 0 0 0 | u32 kg` is followed by that key
//! group's records, byte for byte as a data block stores them (§4: `kind |
//! 0 | u16 key_len | u32 value_len | key | value`), so an exporter writes
//! each record once, straight into the chunk slot the consumer reads (the
//! CRC is computed as the bytes are written), and never needs a length it
//! does not know yet. Every non-empty key group appears once, in ascending
//! order; empty ones cost nothing.
//!
//! [`ChunkEncoder`] fills caller-provided slots ([`ChunkSlot`]: a byte
//! slice, or shared memory the store never reads back); [`ChunkDecoder`]
//! checks every chunk (magic, version, snapshot id, index, CRCs) and every
//! item (framing, key group, order, state) before handing it on.

use crate::format::{Kind, RECORD_HEADER};
use crate::ops::StateKind;

/// Bytes of one chunk, header included.
pub const CHUNK_LEN: usize = 4 << 20;
/// Bytes of a chunk header.
pub const HEADER_LEN: usize = 32;
pub const MAGIC: [u8; 4] = *b"STSN";
/// Version 2: the stream starts with a state table. (Version 1, without
/// it, was a codec no released statord ever exported with; it is refused.)
pub const VERSION: u16 = 2;
/// Header flag: the snapshot's last chunk.
pub const FLAG_LAST: u16 = 1;
/// First byte of a group header (no record kind has it).
pub const GROUP: u8 = 0xFF;
/// First byte of the state table item.
pub const STATES: u8 = 0xFE;
/// The largest item (record or state table) a decoder accepts: one cut
/// by chunk boundaries is held in memory until it is whole.
pub const MAX_ITEM: usize = 256 << 20;
/// States a state table may name, and bytes of a state name.
pub const MAX_STATES: usize = 4096;
pub const MAX_NAME: usize = 1024;

/// The whole length (header included) of the chunk whose header begins
/// `h`, after checking its magic and header CRC: how a reader of chunks
/// laid back to back (a snapshot file) finds where each one ends. The
/// rest of the chunk is checked by [`ChunkDecoder::feed`].
pub fn chunk_len(h: &[u8]) -> Result<usize, &'static str> {
    if h.len() < HEADER_LEN || h[0..4] != MAGIC {
        return Err("not a snapshot chunk (bad magic or too short)");
    }
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4"));
    if crc32c::crc32c(&h[..28]) != u32_at(28) {
        return Err("chunk header checksum mismatch");
    }
    let len = HEADER_LEN + u32_at(20) as usize;
    if len > CHUNK_LEN {
        return Err("a chunk longer than 4 MiB");
    }
    Ok(len)
}

/// Where a chunk is written: the encoder only writes, never reads back
/// (the consumer may be scribbling on shared memory meanwhile).
pub trait ChunkSlot {
    fn slot_len(&self) -> usize;
    /// Copies `bytes` to offset `off` (`off + bytes.len() <= slot_len()`).
    fn write_at(&mut self, off: usize, bytes: &[u8]);
}

impl ChunkSlot for [u8] {
    fn slot_len(&self) -> usize {
        self.len()
    }
    fn write_at(&mut self, off: usize, bytes: &[u8]) {
        self[off..off + bytes.len()].copy_from_slice(bytes);
    }
}

/// A state named in a snapshot: the id its records carry, its kind and
/// its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateDesc {
    pub id: u32,
    pub kind: StateKind,
    pub name: Vec<u8>,
}

fn kind_byte(k: StateKind) -> u8 {
    match k {
        StateKind::Value => 1,
        StateKind::List => 2,
        StateKind::Map => 3,
    }
}

/// The state table item: `0xFE 0 0 0 | u32 body_len`, then `u32 count`
/// and per state `u32 id | u8 kind | u8 0 | u16 name_len | name`.
pub fn encode_states(states: &[StateDesc]) -> Vec<u8> {
    let mut body = (states.len() as u32).to_le_bytes().to_vec();
    for s in states {
        body.extend_from_slice(&s.id.to_le_bytes());
        body.extend_from_slice(&[kind_byte(s.kind), 0]);
        body.extend_from_slice(&(s.name.len().min(u16::MAX as usize) as u16).to_le_bytes());
        body.extend_from_slice(&s.name[..s.name.len().min(u16::MAX as usize)]);
    }
    let mut item = vec![STATES, 0, 0, 0];
    item.extend_from_slice(&(body.len() as u32).to_le_bytes());
    item.extend_from_slice(&body);
    item
}

fn decode_states(body: &[u8]) -> Option<Vec<StateDesc>> {
    let n = u32::from_le_bytes(body.get(..4)?.try_into().ok()?) as usize;
    if n > MAX_STATES {
        return None;
    }
    let mut p = &body[4..];
    let mut out = Vec::with_capacity(n);
    let mut ids = std::collections::HashSet::with_capacity(n);
    let mut names = std::collections::HashSet::with_capacity(n);
    for _ in 0..n {
        let id = u32::from_le_bytes(p.get(..4)?.try_into().ok()?);
        let kind = match p.get(4)? {
            1 => StateKind::Value,
            2 => StateKind::List,
            3 => StateKind::Map,
            _ => return None,
        };
        if *p.get(5)? != 0 {
            return None;
        }
        let len = u16::from_le_bytes(p.get(6..8)?.try_into().ok()?) as usize;
        let name = p.get(8..8 + len)?.to_vec();
        if len == 0 || len > MAX_NAME || !ids.insert(id) || !names.insert(name.clone()) {
            return None;
        }
        out.push(StateDesc { id, kind, name });
        p = &p[8 + len..];
    }
    p.is_empty().then_some(out)
}

/// The length of the item `b` starts, once its first 8 bytes are there.
fn item_len(b: &[u8]) -> Option<usize> {
    let h = b.get(..RECORD_HEADER)?;
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4")) as usize;
    Some(match h[0] {
        GROUP => 8,
        STATES => 8 + u32_at(4),
        _ => RECORD_HEADER + u16::from_le_bytes([h[2], h[3]]) as usize + u32_at(4),
    })
}

/// Why a snapshot was refused; nothing of it may be installed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("chunk {index}: {what}")]
    Chunk { index: u32, what: &'static str },
    #[error("chunk {index}: a chunk of snapshot {got:#x}, not {want:#x}")]
    Foreign { index: u32, got: u64, want: u64 },
    #[error("chunk {got} arrived where chunk {want} was expected")]
    OutOfOrder { got: u32, want: u32 },
    #[error("the snapshot ends without its last chunk, or inside an item")]
    Truncated,
    #[error("a chunk arrived after the last one")]
    AfterLast,
    #[error("{0}")]
    Refused(String),
}

/// Writes the stream into chunk slots. Per slot: [`ChunkEncoder::begin`],
/// then [`ChunkEncoder::put`] until it returns less than it was given (the
/// slot is full), then [`ChunkEncoder::end`].
pub struct ChunkEncoder {
    snapshot: u64,
    index: u32,
    pos: usize,
    crc: u32,
    /// The key group of the last group header written.
    group: Option<u16>,
}

impl ChunkEncoder {
    pub fn new(snapshot: u64) -> ChunkEncoder {
        ChunkEncoder {
            snapshot,
            index: 0,
            pos: HEADER_LEN,
            crc: 0,
            group: None,
        }
    }

    /// Starts a chunk in a slot (at least `HEADER_LEN + 8` bytes).
    pub fn begin(&mut self) {
        self.pos = HEADER_LEN;
        self.crc = 0;
    }

    /// Bytes written into the current chunk so far (header included).
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Copies as much of `bytes` as fits into `slot`; how much.
    pub fn put<S: ChunkSlot + ?Sized>(&mut self, slot: &mut S, bytes: &[u8]) -> usize {
        let n = bytes.len().min(slot.slot_len().saturating_sub(self.pos));
        slot.write_at(self.pos, &bytes[..n]);
        self.crc = crc32c::crc32c_append(self.crc, &bytes[..n]);
        self.pos += n;
        n
    }

    /// The bytes that start key group `kg` if it is not the current one
    /// (`None` otherwise). Groups must come in ascending order.
    pub fn group_header(&mut self, kg: u16) -> Option<[u8; 8]> {
        if self.group == Some(kg) {
            return None;
        }
        self.group = Some(kg);
        let mut h = [GROUP, 0, 0, 0, 0, 0, 0, 0];
        h[4..8].copy_from_slice(&(kg as u32).to_le_bytes());
        Some(h)
    }

    /// Closes the chunk in `slot`: writes its header. Returns its length.
    pub fn end<S: ChunkSlot + ?Sized>(&mut self, slot: &mut S, last: bool) -> usize {
        let payload = (self.pos - HEADER_LEN) as u32;
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(if last { FLAG_LAST } else { 0 }).to_le_bytes());
        h[8..16].copy_from_slice(&self.snapshot.to_le_bytes());
        h[16..20].copy_from_slice(&self.index.to_le_bytes());
        h[20..24].copy_from_slice(&payload.to_le_bytes());
        h[24..28].copy_from_slice(&self.crc.to_le_bytes());
        let hcrc = crc32c::crc32c(&h[..28]);
        h[28..32].copy_from_slice(&hcrc.to_le_bytes());
        slot.write_at(0, &h);
        self.index += 1;
        let len = self.pos;
        self.begin();
        len
    }
}

/// What a decoded snapshot held.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    pub chunks: u32,
    pub groups: u32,
    pub records: u64,
    /// Key groups outside the accepted range, skipped, and their records.
    pub skipped_groups: u32,
    pub skipped_records: u64,
}

/// An item handed on by the decoder.
#[derive(Debug)]
pub enum Item<'a> {
    /// The state table (first, once).
    States(&'a [StateDesc]),
    Record(Kind, &'a [u8], &'a [u8]),
}

/// Checks chunks in order and hands on the state table and the records of
/// key groups in `lo..=hi` (others are skipped and counted: a snapshot
/// rescales).
pub struct ChunkDecoder {
    snapshot: Option<u64>,
    next: u32,
    lo: u16,
    hi: u16,
    done: bool,
    /// Bytes of an item cut by a chunk boundary.
    carry: Vec<u8>,
    states: Option<Vec<StateDesc>>,
    /// The table's ids, sorted (records are checked against it).
    ids: Vec<u32>,
    group: Option<u16>,
    last_key: Vec<u8>,
    stats: Decoded,
}

impl ChunkDecoder {
    pub fn new(lo: u16, hi: u16) -> ChunkDecoder {
        ChunkDecoder {
            snapshot: None,
            next: 0,
            lo,
            hi,
            done: false,
            carry: Vec::new(),
            states: None,
            ids: Vec::new(),
            group: None,
            last_key: Vec::new(),
            stats: Decoded::default(),
        }
    }

    /// The snapshot id (after the first chunk).
    pub fn snapshot(&self) -> Option<u64> {
        self.snapshot
    }

    /// Whether the last chunk was fed.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Checks one chunk and hands each item to `f` (which may refuse it).
    /// On an error the snapshot must be abandoned.
    pub fn feed(
        &mut self,
        chunk: &[u8],
        mut f: impl FnMut(Item<'_>) -> Result<(), SnapshotError>,
    ) -> Result<(), SnapshotError> {
        let index = self.next;
        let bad = |what| SnapshotError::Chunk { index, what };
        if self.done {
            return Err(SnapshotError::AfterLast);
        }
        chunk_len(chunk).map_err(bad)?;
        let h = &chunk[..HEADER_LEN];
        let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4"));
        if u16::from_le_bytes([h[4], h[5]]) != VERSION {
            return Err(bad("unsupported chunk version"));
        }
        let flags = u16::from_le_bytes([h[6], h[7]]);
        if flags & !FLAG_LAST != 0 {
            return Err(bad("unknown chunk flags"));
        }
        let snap = u64::from_le_bytes(h[8..16].try_into().expect("8"));
        match self.snapshot {
            Some(want) if want != snap => {
                return Err(SnapshotError::Foreign {
                    index,
                    got: snap,
                    want,
                });
            }
            _ => self.snapshot = Some(snap),
        }
        let got = u32_at(16);
        if got != index {
            return Err(SnapshotError::OutOfOrder { got, want: index });
        }
        let len = u32_at(20) as usize;
        if HEADER_LEN + len != chunk.len() || chunk.len() > CHUNK_LEN {
            return Err(bad("payload length differs from the chunk's (truncated)"));
        }
        let payload = &chunk[HEADER_LEN..];
        if crc32c::crc32c(payload) != u32_at(24) {
            return Err(bad("chunk payload checksum mismatch"));
        }
        self.next += 1;
        self.stats.chunks += 1;
        // An item cut by the previous boundary is completed from here.
        let mut p = payload;
        if !self.carry.is_empty() {
            loop {
                let need = item_len(&self.carry).unwrap_or(RECORD_HEADER);
                if need > MAX_ITEM {
                    return Err(bad("an item larger than the 256 MiB limit"));
                }
                let take = need.saturating_sub(self.carry.len()).min(p.len());
                if take == 0 {
                    break;
                }
                self.carry.extend_from_slice(&p[..take]);
                p = &p[take..];
            }
            if item_len(&self.carry) == Some(self.carry.len()) {
                let item = std::mem::take(&mut self.carry);
                self.item(&item, index, &mut f)?;
            }
        }
        while !p.is_empty() {
            match item_len(p) {
                Some(n) if n <= p.len() => {
                    self.item(&p[..n], index, &mut f)?;
                    p = &p[n..];
                }
                Some(n) if n > MAX_ITEM => {
                    return Err(bad("an item larger than the 256 MiB limit"));
                }
                _ => {
                    self.carry.extend_from_slice(p);
                    break;
                }
            }
        }
        if flags & FLAG_LAST != 0 {
            if !self.carry.is_empty() || self.states.is_none() {
                return Err(SnapshotError::Truncated);
            }
            self.done = true;
        }
        Ok(())
    }

    fn item(
        &mut self,
        b: &[u8],
        index: u32,
        f: &mut impl FnMut(Item<'_>) -> Result<(), SnapshotError>,
    ) -> Result<(), SnapshotError> {
        let bad = |what| SnapshotError::Chunk { index, what };
        if b[0] == STATES {
            if b[1..4] != [0, 0, 0] || self.states.is_some() {
                return Err(bad("a malformed or repeated state table"));
            }
            let states = decode_states(&b[8..]).ok_or(bad(
                "malformed state table (or over 4096 states, an empty or over-long name, a repeated id or name)",
            ))?;
            f(Item::States(&states))?;
            self.ids = states.iter().map(|s| s.id).collect();
            self.ids.sort_unstable();
            self.states = Some(states);
            return Ok(());
        }
        if self.states.is_none() {
            return Err(bad("the stream does not begin with its state table"));
        }
        if b[0] == GROUP {
            if b[1..4] != [0, 0, 0] {
                return Err(bad("malformed group header"));
            }
            let kg = u32::from_le_bytes(b[4..8].try_into().expect("4"));
            let kg = u16::try_from(kg).map_err(|_| bad("key group out of range"))?;
            if self.group.is_some_and(|g| g >= kg) {
                return Err(bad("key groups not in ascending order (or repeated)"));
            }
            self.group = Some(kg);
            self.last_key.clear();
            self.stats.groups += 1;
            if kg < self.lo || kg > self.hi {
                self.stats.skipped_groups += 1;
            }
            return Ok(());
        }
        let kind = Kind::from_u8(b[0]).ok_or(bad("unknown record kind"))?;
        if kind != Kind::Put || b[1] != 0 {
            return Err(bad("a record that is not a plain put"));
        }
        let Some(g) = self.group else {
            return Err(bad("a record before any group header"));
        };
        let klen = u16::from_le_bytes([b[2], b[3]]) as usize;
        let (key, value) = b[RECORD_HEADER..].split_at(klen);
        if key.len() < crate::keys::HEADER_LEN || crate::keys::key_group(key) != g {
            return Err(bad("a record of another key group inside a group"));
        }
        let state = crate::keys::state_id(key).unwrap_or(u32::MAX);
        if self.ids.binary_search(&state).is_err() {
            return Err(bad("a record of a state the table does not name"));
        }
        if key <= &self.last_key[..] && !self.last_key.is_empty() {
            return Err(bad("records not in ascending key order"));
        }
        self.last_key.clear();
        self.last_key.extend_from_slice(key);
        if g < self.lo || g > self.hi {
            self.stats.skipped_records += 1;
            return Ok(());
        }
        self.stats.records += 1;
        f(Item::Record(kind, key, value))
    }

    /// Ends the snapshot: it must have ended with its last chunk.
    pub fn finish(self) -> Result<Decoded, SnapshotError> {
        if !self.done {
            return Err(SnapshotError::Truncated);
        }
        Ok(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

    /// Encodes `(kg, key, value)` records (sorted) into chunks of `slot` bytes.
    fn encode(snapshot: u64, recs: &[(u16, Vec<u8>, Vec<u8>)], slot: usize) -> Vec<Vec<u8>> {
        let mut e = ChunkEncoder::new(snapshot);
        let mut out = Vec::new();
        let mut buf = vec![0u8; slot];
        e.begin();
        let emit =
            |e: &mut ChunkEncoder, buf: &mut Vec<u8>, mut bytes: &[u8], out: &mut Vec<Vec<u8>>| {
                while !bytes.is_empty() {
                    let n = e.put(&mut buf[..], bytes);
                    bytes = &bytes[n..];
                    if !bytes.is_empty() {
                        let len = e.end(&mut buf[..], false);
                        out.push(buf[..len].to_vec());
                    }
                }
            };
        let states = [StateDesc {
            id: 1,
            kind: StateKind::Value,
            name: b"s".to_vec(),
        }];
        emit(&mut e, &mut buf, &encode_states(&states), &mut out);
        for (kg, k, v) in recs {
            if let Some(h) = e.group_header(*kg) {
                emit(&mut e, &mut buf, &h, &mut out);
            }
            let mut r = vec![Kind::Put as u8, 0];
            r.extend_from_slice(&(k.len() as u16).to_le_bytes());
            r.extend_from_slice(&(v.len() as u32).to_le_bytes());
            r.extend_from_slice(k);
            r.extend_from_slice(v);
            emit(&mut e, &mut buf, &r, &mut out);
        }
        let len = e.end(&mut buf[..], true);
        out.push(buf[..len].to_vec());
        out
    }

    fn key(kg: u16, i: u32) -> Vec<u8> {
        let mut k = Vec::new();
        crate::keys::encode_base(&mut k, kg, 1, &i.to_be_bytes(), b"");
        k
    }

    fn decode(chunks: &[Vec<u8>], lo: u16, hi: u16) -> Result<(Decoded, Pairs), SnapshotError> {
        let mut d = ChunkDecoder::new(lo, hi);
        let mut got = Vec::new();
        for c in chunks {
            d.feed(c, |item| {
                if let Item::Record(_, k, v) = item {
                    got.push((k.to_vec(), v.to_vec()));
                }
                Ok(())
            })?;
        }
        Ok((d.finish()?, got))
    }

    fn records() -> Vec<(u16, Vec<u8>, Vec<u8>)> {
        let mut r = Vec::new();
        for kg in [0u16, 3, 4, 9] {
            for i in 0..50u32 {
                r.push((
                    kg,
                    key(kg, i),
                    vec![(i % 251) as u8; (i as usize * 37) % 300],
                ));
            }
        }
        // One key group far larger than a chunk.
        for i in 0..40u32 {
            r.push((12, key(12, i), vec![7; 1000]));
        }
        r
    }

    #[test]
    fn round_trip_across_every_slot_size_and_rescale_skips() {
        let recs = records();
        let want: Vec<_> = recs
            .iter()
            .map(|(_, k, v)| (k.clone(), v.clone()))
            .collect();
        for slot in [HEADER_LEN + 8, HEADER_LEN + 13, 256, 1000, 4096, 1 << 20] {
            let chunks = encode(9, &recs, slot);
            assert!(chunks.iter().all(|c| c.len() <= slot));
            let (d, got) = decode(&chunks, 0, u16::MAX).unwrap();
            assert_eq!(got, want, "slot {slot}");
            assert_eq!((d.groups, d.records), (5, recs.len() as u64));
            let (d, got) = decode(&chunks, 3, 9).unwrap();
            assert_eq!(got.len(), 150);
            assert_eq!((d.skipped_groups, d.skipped_records), (2, 90));
        }
        // An empty snapshot: one last chunk with nothing in it.
        let chunks = encode(1, &[], 4096);
        assert_eq!(chunks.len(), 1);
        assert_eq!(decode(&chunks, 0, 10).unwrap().0.records, 0);
    }

    #[test]
    fn corrupt_truncated_foreign_reordered_and_misframed_chunks_fail() {
        let recs = records();
        let chunks = encode(9, &recs, 4096);
        assert!(chunks.len() > 3);
        // Every byte of a chunk is covered.
        for i in 0..chunks[1].len() {
            let mut c = chunks.clone();
            c[1][i] ^= 0x20;
            assert!(decode(&c, 0, u16::MAX).is_err(), "flip at {i}");
        }
        let mut c = chunks.clone();
        let n = c[2].len();
        c[2].truncate(n - 1);
        assert!(decode(&c, 0, u16::MAX).is_err());
        let c: Vec<_> = chunks[..chunks.len() - 1].to_vec();
        assert_eq!(
            decode(&c, 0, u16::MAX).err(),
            Some(SnapshotError::Truncated)
        );
        let mut c = chunks.clone();
        c.swap(1, 2);
        assert!(matches!(
            decode(&c, 0, u16::MAX),
            Err(SnapshotError::OutOfOrder { .. })
        ));
        let other = encode(10, &recs, 4096);
        let mut c = chunks.clone();
        c[1] = other[1].clone();
        assert!(matches!(
            decode(&c, 0, u16::MAX),
            Err(SnapshotError::Foreign { .. })
        ));
        let mut c = chunks.clone();
        c.push(chunks[0].clone());
        assert_eq!(
            decode(&c, 0, u16::MAX).err(),
            Some(SnapshotError::AfterLast)
        );
        // Well-checksummed but misframed streams: a repeated group, a record
        // of another group, keys out of order.
        // A group header naming a key group over 65535, well checksummed.
        let mut e = ChunkEncoder::new(6);
        let mut buf = vec![0u8; 4096];
        e.begin();
        e.put(&mut buf[..], &encode_states(&[]));
        let mut h = [GROUP, 0, 0, 0, 0, 0, 0, 0];
        h[4..8].copy_from_slice(&70_000u32.to_le_bytes());
        e.put(&mut buf[..], &h);
        let n = e.end(&mut buf[..], true);
        assert!(matches!(
            decode(&[buf[..n].to_vec()], 0, u16::MAX),
            Err(SnapshotError::Chunk { what, .. }) if what.contains("key group out of range")
        ));
        for bad in [
            vec![(3u16, key(3, 1), vec![1]), (2, key(2, 1), vec![1])],
            vec![(3, key(4, 1), vec![1])],
            vec![(3, key(3, 2), vec![1]), (3, key(3, 1), vec![1])],
        ] {
            assert!(
                decode(&encode(5, &bad, 4096), 0, u16::MAX).is_err(),
                "{bad:?}"
            );
        }
    }
}
