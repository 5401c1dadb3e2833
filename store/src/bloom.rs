//! A cache-line-blocked bloom filter: every probe of one key touches one
//! 64-byte block, so a lookup costs at most one cache miss. About 10 bits
//! per key and 6 probes give roughly a 1% false-positive rate.
//!
//! The hash is XXH3-64 of the encoded key; it is part of the segment format
//! (FORMAT.md) and must never change for a given format version.

use xxhash_rust::xxh3::xxh3_64;

/// Bits per key.
pub const BITS_PER_KEY: usize = 10;
/// Probes per key.
pub const PROBES: u32 = 6;
const BLOCK_BITS: u64 = 512;

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
        let blocks = (keys * BITS_PER_KEY).div_ceil(BLOCK_BITS as usize).max(1);
        Bloom {
            words: vec![0; blocks * 8],
            probes: PROBES,
        }
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

    /// Serialized form: `u32 probes | u32 blocks | words (LE)`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.probes.to_le_bytes());
        out.extend_from_slice(&(self.blocks() as u32).to_le_bytes());
        for w in &self.words {
            out.extend_from_slice(&w.to_le_bytes());
        }
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
        assert_eq!(Bloom::decode(&enc), Some(f));
        assert_eq!(Bloom::decode(&enc[..enc.len() - 1]), None);
    }
}
