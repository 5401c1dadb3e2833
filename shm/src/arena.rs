//! Offset-addressed arenas for variable-size buffers (keys, values, results).
//!
//! # Ownership of arena memory
//!
//! The arena is a region of a session segment. Its bytes are always named by
//! `(offset, length)` relative to the arena's start, never by address.
//!
//! - **The client owns the arena.** It alone allocates and frees buffers, with
//!   an [`ArenaAllocator`] kept in its own private memory: no allocator state
//!   lives in shared memory, so nothing the daemon reads depends on it and a
//!   buggy client can only corrupt its own buffers.
//! - **A request buffer** (key, namespace, user key, value) is written by the
//!   client before it publishes the descriptor naming it; from then until the
//!   request's completion is reaped, the client must not change or free it
//!   (the daemon may read it at any time in between). The client frees it
//!   after reaping the completion.
//! - **A result buffer** is given to the daemon in advance (the provided-buffer
//!   ring of `stator-ring`) or named by a request. From then until a
//!   completion names it, only the daemon writes it; after that the client
//!   reads it and frees or re-provides it.
//! - **The daemon never trusts an offset.** It resolves every `(offset, len)`
//!   through [`ArenaRegion::resolve`], which checks it against the arena's
//!   bounds (and so against the segment), with overflow-safe arithmetic. A
//!   client that breaks the rules above can only read or corrupt its own
//!   data.

use crate::view::OutOfBounds;

/// The daemon's (or any reader's) idea of where the arena lies in a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaRegion {
    /// Offset of the arena from the start of the segment.
    pub base: usize,
    /// Length of the arena in bytes.
    pub len: usize,
}

impl ArenaRegion {
    /// Translates an arena-relative `(off, len)` into a segment offset,
    /// refusing anything outside the arena.
    #[inline]
    pub fn resolve(&self, off: u32, len: u32) -> Result<usize, OutOfBounds> {
        let (o, l) = (off as usize, len as usize);
        match o.checked_add(l) {
            Some(end) if end <= self.len => Ok(self.base + o),
            _ => Err(OutOfBounds {
                off: off as u64,
                len: len as u64,
                bound: self.len as u64,
            }),
        }
    }
}

/// A buffer in the arena: arena-relative offset and capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArenaBuf {
    pub off: u32,
    pub cap: u32,
}

/// Smallest allocation; also the alignment of every buffer (a cache line, so
/// two buffers never share one and a value can be read in whole words).
pub const MIN_ALLOC: u32 = 64;
const CLASSES: usize = 27; // 64 B .. 4 GiB

/// The client's allocator for its arena: a buddy allocator over
/// power-of-two size classes. The arena starts as a few free blocks, each
/// aligned to its own size; a request takes a free block of its class, else
/// splits the smallest larger one (its upper halves go to the free lists of
/// the classes between). Freed blocks go back to their class's list as
/// they are (allocation and free are O(1) in a steady mix of sizes, and
/// allocate nothing on the heap once the lists have grown); only when a
/// request finds nothing are free buddies merged, level by level, and the
/// request tried again. So a large request never fails for free bytes cut
/// into small buffers long ago: it fails only when no aligned block of its
/// size is free even after merging.
#[derive(Debug)]
pub struct ArenaAllocator {
    len: u64,
    /// Free blocks of each class (64 B << class), each aligned to its size.
    free: [Vec<u32>; CLASSES],
    in_use_bytes: u64,
}

/// Bytes of a block of `class`.
const fn block_size(class: usize) -> u64 {
    (MIN_ALLOC as u64) << class
}

/// An arena of `len` bytes as the largest aligned blocks that fit, front
/// to back: `(offset, class)`. No two are buddies (two of a class side by
/// side at an even offset would have been one of the next).
fn top_blocks(len: u64) -> impl Iterator<Item = (u64, usize)> {
    let mut off = 0u64;
    std::iter::from_fn(move || {
        if len - off < MIN_ALLOC as u64 {
            return None;
        }
        let class = (0..CLASSES)
            .rev()
            .find(|&c| off.is_multiple_of(block_size(c)) && off + block_size(c) <= len)
            .expect("a 64-byte block fits at a 64-byte boundary");
        let at = off;
        off += block_size(class);
        Some((at, class))
    })
}

impl ArenaAllocator {
    /// An allocator for an arena of `len` bytes (at most 4 GiB; a tail
    /// shorter than [`MIN_ALLOC`] is not used).
    pub fn new(len: usize) -> Self {
        let len = (len as u64).min(u32::MAX as u64 + 1);
        let mut free: [Vec<u32>; CLASSES] = std::array::from_fn(|_| Vec::new());
        for (off, class) in top_blocks(len) {
            free[class].push(off as u32);
        }
        ArenaAllocator {
            len,
            free,
            in_use_bytes: 0,
        }
    }

    fn class_of(len: u32) -> (usize, u64) {
        let size = (len.max(MIN_ALLOC) as u64).next_power_of_two();
        let class = (size.trailing_zeros() - MIN_ALLOC.trailing_zeros()) as usize;
        (class, size)
    }

    /// A buffer of at least `len` bytes (aligned to its size class), or
    /// `None` when no block that large is free.
    pub fn alloc(&mut self, len: u32) -> Option<ArenaBuf> {
        let (class, size) = Self::class_of(len);
        if class >= CLASSES {
            return None;
        }
        let off = match self.take(class) {
            Some(off) => off,
            None => {
                self.merge_buddies();
                self.take(class)?
            }
        };
        self.in_use_bytes += size;
        Some(ArenaBuf {
            off,
            cap: u32::try_from(size).unwrap_or(u32::MAX),
        })
    }

    /// A free block of `class`, split from a larger one if need be.
    fn take(&mut self, class: usize) -> Option<u32> {
        if let Some(off) = self.free[class].pop() {
            return Some(off);
        }
        let from = (class + 1..CLASSES).find(|&c| !self.free[c].is_empty())?;
        let off = self.free[from].pop()?;
        // Keep the lowest block of `class`; the upper half at each level
        // down is free (below 4 GiB: fits a u32).
        for c in (class..from).rev() {
            self.free[c].push(off + block_size(c) as u32);
        }
        Some(off)
    }

    /// Merges every pair of free buddies into their parent, from the
    /// smallest class up (a merged block may merge again).
    fn merge_buddies(&mut self) {
        for c in 0..CLASSES - 1 {
            let size = block_size(c);
            let mut list = std::mem::take(&mut self.free[c]);
            list.sort_unstable();
            let (mut i, mut kept) = (0, 0);
            while i < list.len() {
                let off = list[i];
                if (off as u64).is_multiple_of(2 * size)
                    && list
                        .get(i + 1)
                        .is_some_and(|&next| next as u64 == off as u64 + size)
                {
                    self.free[c + 1].push(off);
                    i += 2;
                } else {
                    list[kept] = off;
                    kept += 1;
                    i += 1;
                }
            }
            list.truncate(kept);
            self.free[c] = list;
        }
    }

    /// Returns `buf` (as returned by [`Self::alloc`]) for reuse.
    pub fn free(&mut self, buf: ArenaBuf) {
        let (class, size) = Self::class_of(buf.cap);
        debug_assert!(
            buf.off as u64 + size <= self.len && (buf.off as u64).is_multiple_of(size),
            "freeing a buffer we never gave out"
        );
        self.in_use_bytes -= size;
        self.free[class].push(buf.off);
    }

    /// Whether buffers of these lengths could ever be held at once, by an
    /// empty arena (each rounded up to its size class, placed largest
    /// first as the allocator would). `false` means [`Self::alloc`] fails
    /// for them however many buffers are freed.
    pub fn could_ever_fit(&self, lens: &[u32]) -> bool {
        let mut classes = Vec::with_capacity(lens.len());
        for &l in lens {
            let (class, _) = Self::class_of(l);
            if class >= CLASSES {
                return false;
            }
            classes.push(class);
        }
        classes.sort_unstable_by(|a, b| b.cmp(a));
        // Free blocks per class of an empty arena, split as needed.
        let mut blocks = [0u64; CLASSES];
        for (_, class) in top_blocks(self.len) {
            blocks[class] += 1;
        }
        for class in classes {
            let Some(from) = (class..CLASSES).find(|&c| blocks[c] > 0) else {
                return false;
            };
            blocks[from] -= 1;
            for b in &mut blocks[class..from] {
                *b += 1;
            }
        }
        true
    }

    /// Bytes handed out and not yet freed (rounded to size classes).
    pub fn in_use_bytes(&self) -> u64 {
        self.in_use_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn region_resolve_checks_bounds() {
        let r = ArenaRegion {
            base: 4096,
            len: 1000,
        };
        assert_eq!(r.resolve(0, 1000), Ok(4096));
        assert_eq!(r.resolve(999, 1), Ok(4096 + 999));
        assert!(r.resolve(999, 2).is_err());
        assert!(r.resolve(u32::MAX, u32::MAX).is_err());
        assert_eq!(r.resolve(1000, 0), Ok(5096));
    }

    #[test]
    fn alloc_until_full_then_reuse() {
        let mut a = ArenaAllocator::new(4096);
        let bufs: Vec<_> = (0..64).map(|_| a.alloc(10).unwrap()).collect();
        assert!(a.alloc(1).is_none(), "arena of 64 x 64 B is full");
        a.free(bufs[7]);
        assert_eq!(a.alloc(64), Some(bufs[7]));
        assert_eq!(a.in_use_bytes(), 4096);
    }

    /// Issue 25: power-of-two classes that never merged left a large
    /// request `Full` forever once small buffers had cut the arena up,
    /// although every byte was free again.
    #[test]
    fn freed_small_buffers_merge_back_for_a_large_one() {
        let mut a = ArenaAllocator::new(1 << 20);
        let small: Vec<_> = std::iter::from_fn(|| a.alloc(64)).collect();
        assert_eq!(small.len(), (1 << 20) / 64);
        assert!(a.alloc(1 << 19).is_none(), "full");
        // Every other one freed: 512 KiB free, but no two buddies.
        for b in small.iter().step_by(2) {
            a.free(*b);
        }
        assert!(a.alloc(128).is_none(), "no 128-byte block is free");
        for b in small.iter().skip(1).step_by(2) {
            a.free(*b);
        }
        assert_eq!(a.in_use_bytes(), 0);
        let whole = a.alloc(1 << 20).expect("the whole arena, merged back");
        assert_eq!((whole.off, whole.cap), (0, 1 << 20));
        a.free(whole);
        // And cut up again by a mix of sizes.
        let mix: Vec<_> = (0..1000).filter_map(|i| a.alloc(64 << (i % 5))).collect();
        for b in mix {
            a.free(b);
        }
        assert!(a.alloc(1 << 20).is_some());
    }

    /// An arena that is not a power of two is used whole, in blocks no
    /// larger than fit.
    #[test]
    fn an_odd_arena_is_used_whole() {
        let len = (3 << 20) + 5 * 64 + 10;
        let mut a = ArenaAllocator::new(len);
        assert!(a.could_ever_fit(&[2 << 20, 1 << 20, 256, 64]));
        assert!(!a.could_ever_fit(&[2 << 20, 2 << 20]));
        assert!(!a.could_ever_fit(&[4 << 20]));
        let big = a.alloc(2 << 20).unwrap();
        let mid = a.alloc(1 << 20).unwrap();
        let rest: Vec<_> = std::iter::from_fn(|| a.alloc(64)).collect();
        assert_eq!(rest.len(), 5);
        assert!(big.off as u64 + big.cap as u64 <= len as u64);
        assert!(mid.off as u64 + mid.cap as u64 <= len as u64);
        assert!(rest.iter().all(|b| b.off as usize + 64 <= len));
    }

    proptest! {
        /// What `could_ever_fit` says an empty arena holds, it holds.
        #[test]
        fn what_could_fit_fits(len in 64usize..(1 << 22), lens in proptest::collection::vec(1u32..(1 << 21), 0..40)) {
            let a = ArenaAllocator::new(len);
            let fits = a.could_ever_fit(&lens);
            let mut empty = ArenaAllocator::new(len);
            let mut sorted = lens.clone();
            sorted.sort_unstable_by(|x, y| y.cmp(x));
            let all = sorted.iter().all(|&l| empty.alloc(l).is_some());
            prop_assert_eq!(fits, all);
        }

        #[test]
        fn buffers_never_overlap_and_stay_inside(ops in proptest::collection::vec((any::<bool>(), 1u32..20_000), 1..300)) {
            let mut a = ArenaAllocator::new(1 << 20);
            let mut live: Vec<ArenaBuf> = Vec::new();
            for (free, len) in ops {
                if free && !live.is_empty() {
                    let b = live.swap_remove(len as usize % live.len());
                    a.free(b);
                } else if let Some(b) = a.alloc(len) {
                    prop_assert!(b.cap >= len);
                    prop_assert!(b.off as u64 + b.cap as u64 <= 1 << 20);
                    prop_assert_eq!(b.off % MIN_ALLOC, 0);
                    prop_assert_eq!(b.off % b.cap, 0, "aligned to its size");
                    for o in &live {
                        let disjoint = b.off + b.cap <= o.off || o.off + o.cap <= b.off;
                        prop_assert!(disjoint, "{b:?} overlaps {o:?}");
                    }
                    live.push(b);
                }
            }
            // Everything freed: the arena is whole again.
            for b in live.drain(..) {
                a.free(b);
            }
            prop_assert_eq!(a.in_use_bytes(), 0);
            prop_assert!(a.alloc(1 << 20).is_some());
        }
    }
}
