//! A cache-line-blocked bloom filter: every probe of one key touches one
//! 64-byte block, so a lookup costs at most one cache miss. About 10 bits
//! per key and 6 probes give roughly a 1% false-positive rate.
//!
//! The hash is XXH3-64 of the encoded key; it is part of the segment format
//! (FORMAT.md) and must never change for a given format version.
//!
//! A writer that knows only an upper bound of its keys (a compaction: the
//! inputs' records, before duplicates meet) sizes the filter for the bound
//! with [`Bloom::for_at_most`], inserts as it goes, and then
//! [`Bloom::fold`]s it down towards the keys it got: the block of a hash
//! is `floor(x * blocks)` for `x = (h >> 32) / 2^32`, so with `k` dividing
//! `blocks`, OR-ing every run of `k` adjacent blocks gives exactly the
//! filter of `blocks / k` blocks (`floor(floor(y) / k) = floor(y / k)`),
//! and the format and readers do not change.

use xxhash_rust::xxh3::xxh3_64;

/// Bits per key.
pub const BITS_PER_KEY: usize = 10;
/// Probes per key.
pub const PROBES: u32 = 6;
const BLOCK_BITS: u64 = 512;
/// The block count of a large [`Bloom::for_at_most`] filter is a multiple
/// of this (2^3 * 3 * 5 * 7: every factor from 2 to 8 divides it).
const FOLD_GRANULE: usize = 840;

/// Blocks that give `keys` keys [`BITS_PER_KEY`] bits each.
fn blocks_for(keys: usize) -> usize {
    (keys * BITS_PER_KEY).div_ceil(BLOCK_BITS as usize).max(1)
}

/// A filter being built or read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bloom {
    /// 64-byte blocks, as little-endian u64 words.
    words: Vec<u64>,
    probes: u32,
}

/// The filter hash of an encoded key.
#[inline]
pub fn hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

impl Bloom {
    /// An empty filter sized for `keys` keys.
    pub fn with_keys(keys: usize) -> Bloom {
        Bloom {
            words: vec![0; blocks_for(keys) * 8],
            probes: PROBES,
        }
    }

    /// An empty filter for at most `keys` keys, whose block count has the
    /// small factors [`Bloom::fold`] divides by (within 1/10 of
    /// [`Bloom::with_keys`]'s, or 7 blocks for a small one).
    pub fn for_at_most(keys: usize) -> Bloom {
        let need = blocks_for(keys);
        let granule = if need >= 10 * FOLD_GRANULE {
            FOLD_GRANULE
        } else {
            8
        };
        Bloom {
            words: vec![0; need.next_multiple_of(granule) * 8],
            probes: PROBES,
        }
    }

    /// The factor (2 to 8, dividing the block count) by which the filter
    /// can fold while `keys` keys keep [`BITS_PER_KEY`] bits each; `None`
    /// when it cannot.
    pub fn fold_factor(&self, keys: usize) -> Option<usize> {
        let (blocks, need) = (self.words.len() / 8, blocks_for(keys));
        (2..=8)
            .rev()
            .find(|&k| blocks % k == 0 && blocks / k >= need)
    }

    /// One piece of a fold by `k` (from [`Bloom::fold_factor`]): ORs the
    /// `k` blocks of each folded block `from..to` into it, in place (block
    /// `j` reads blocks `j * k..` and nothing before `j` is read again, so
    /// pieces run in ascending order). After the last piece,
    /// [`Bloom::end_fold`].
    pub fn fold_blocks(&mut self, k: usize, from: usize, to: usize) {
        for j in from..to {
            for w in 0..8 {
                let or = (0..k).fold(0, |acc, i| acc | self.words[(j * k + i) * 8 + w]);
                self.words[j * 8 + w] = or;
            }
        }
    }

    /// Ends a fold by `k`: drops the blocks folded into the others.
    pub fn end_fold(&mut self, k: usize) {
        self.words.truncate(self.words.len() / k);
        self.words.shrink_to_fit();
    }

    /// Folds the filter to the fewest blocks that still give `keys` keys
    /// [`BITS_PER_KEY`] bits each, by factors of 2 to 8 that divide the
    /// block count, in one go. The result is the filter
    /// [`Bloom::insert`] would have built at that size; a filter at or
    /// under the size stays as it is.
    pub fn fold(&mut self, keys: usize) {
        while let Some(k) = self.fold_factor(keys) {
            self.fold_blocks(k, 0, self.words.len() / 8 / k);
            self.end_fold(k);
        }
    }

    /// The number of 64-byte blocks.
    pub fn block_count(&self) -> usize {
        self.words.len() / 8
    }

    fn blocks(&self) -> u64 {
        (self.words.len() / 8) as u64
    }

    #[inline]
    fn positions(&self, h: u64) -> (usize, u32, u32) {
        let block = (((h >> 32) * self.blocks()) >> 32) as usize * 8;
        let h1 = h as u32;
        let delta = h1.rotate_left(15) | 1;
        (block, h1, delta)
    }

    /// Adds a key by its [`hash`].
    pub fn insert(&mut self, h: u64) {
        let (block, mut bit, delta) = self.positions(h);
        for _ in 0..self.probes {
            let b = (bit as u64 % BLOCK_BITS) as usize;
            self.words[block + b / 64] |= 1 << (b % 64);
            bit = bit.wrapping_add(delta);
        }
    }

    /// Starts loading the lines [`Bloom::may_contain`] reads for `h` (a
    /// block of 64 bytes; the vector is not line-aligned, so two lines).
    #[inline]
    pub fn prefetch(&self, h: u64) {
        let (block, _, _) = self.positions(h);
        let p = self.words[block..].as_ptr() as *const u8;
        crate::prefetch::line(p);
        crate::prefetch::line(p.wrapping_add(63));
    }

    /// False when the key was certainly never inserted.
    #[inline]
    pub fn may_contain(&self, h: u64) -> bool {
        let (block, mut bit, delta) = self.positions(h);
        for _ in 0..self.probes {
            let b = (bit as u64 % BLOCK_BITS) as usize;
            if self.words[block + b / 64] & (1 << (b % 64)) == 0 {
                return false;
            }
            bit = bit.wrapping_add(delta);
        }
        true
    }

    /// Bytes of memory the filter holds.
    pub fn memory_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Bytes [`Bloom::encode`] appends.
    pub fn encoded_len(&self) -> usize {
        8 + self.words.len() * 8
    }

    /// Serialized form: `u32 probes | u32 blocks | words (LE)`; in
    /// pieces, [`Bloom::encode_head`] then [`Bloom::encode_words`].
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.encode_head());
        self.encode_words(0, self.word_count(), out);
    }

    /// The first 8 bytes of [`Bloom::encode`]'s form.
    pub fn encode_head(&self) -> [u8; 8] {
        let mut h = [0; 8];
        h[..4].copy_from_slice(&self.probes.to_le_bytes());
        h[4..].copy_from_slice(&(self.blocks() as u32).to_le_bytes());
        h
    }

    /// Words `from..to` of [`Bloom::encode`]'s form.
    pub fn encode_words(&self, from: usize, to: usize, out: &mut Vec<u8>) {
        for w in &self.words[from..to] {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }

    /// The number of 8-byte words.
    pub fn word_count(&self) -> usize {
        self.words.len()
    }

    /// Parses [`Bloom::encode`]'s output; `None` when malformed.
    pub fn decode(b: &[u8]) -> Option<Bloom> {
        let probes = u32::from_le_bytes(b.get(0..4)?.try_into().ok()?);
        let blocks = u32::from_le_bytes(b.get(4..8)?.try_into().ok()?) as usize;
        let body = b.get(8..)?;
        if probes == 0 || probes > 32 || blocks == 0 || body.len() != blocks * 64 {
            return None;
        }
        let words = body
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        Some(Bloom { words, probes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_few_false_positives() {
        let n = 100_000u64;
        let mut f = Bloom::with_keys(n as usize);
        for i in 0..n {
            f.insert(hash(&i.to_le_bytes()));
        }
        for i in 0..n {
            assert!(f.may_contain(hash(&i.to_le_bytes())));
        }
        let fp = (n..2 * n)
            .filter(|i| f.may_contain(hash(&i.to_le_bytes())))
            .count();
        let rate = fp as f64 / n as f64;
        assert!(rate < 0.03, "false-positive rate {rate}");
        let mut enc = Vec::new();
        f.encode(&mut enc);
        assert_eq!(enc.len(), f.encoded_len());
        assert_eq!(Bloom::decode(&enc), Some(f.clone()));
        assert_eq!(Bloom::decode(&enc[..enc.len() - 1]), None);
    }

    /// A filter sized for an upper bound and folded equals, bit for bit,
    /// the filter built at the folded size; and it keeps every key.
    #[test]
    fn a_folded_filter_is_the_filter_of_its_size() {
        for (bound, keys) in [
            (1_000_000, 120_000),
            (40_000, 9_000),
            (500, 3),
            (9_000, 8_999),
        ] {
            let hashes: Vec<u64> = (0..keys as u64).map(|i| hash(&i.to_be_bytes())).collect();
            let mut f = Bloom::for_at_most(bound);
            let before = f.blocks();
            assert!(before as usize >= blocks_for(bound));
            for &h in &hashes {
                f.insert(h);
            }
            f.fold(keys);
            let blocks = f.blocks() as usize;
            assert!(
                blocks >= blocks_for(keys),
                "{bound}/{keys}: {blocks} blocks"
            );
            assert_eq!(before as usize % blocks, 0);
            let mut direct = Bloom {
                words: vec![0; blocks * 8],
                probes: PROBES,
            };
            for &h in &hashes {
                direct.insert(h);
            }
            assert_eq!(f, direct, "{bound}/{keys}");
            assert!(hashes.iter().all(|&h| f.may_contain(h)));
        }
        // Heavy duplicates fold far: 1 M bound, 120 K keys.
        let mut f = Bloom::for_at_most(1_000_000);
        f.fold(120_000);
        assert!(f.blocks() as usize <= 2 * blocks_for(120_000));
    }
}
