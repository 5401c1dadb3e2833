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

/// The client's allocator for its arena: power-of-two size classes with
/// per-class free lists, carved from a bump pointer. Allocation and free are
/// O(1) and allocate nothing on the heap once the free lists have grown to
/// their working size. Freed blocks are reused for the same class and never
/// coalesced: the working set of a stream task is a steady mix of sizes.
#[derive(Debug)]
pub struct ArenaAllocator {
    len: u64,
    bump: u64,
    free: [Vec<u32>; CLASSES],
    in_use_bytes: u64,
}

impl ArenaAllocator {
    /// An allocator for an arena of `len` bytes (at most 4 GiB).
    pub fn new(len: usize) -> Self {
        ArenaAllocator {
            len: (len as u64).min(u32::MAX as u64 + 1),
            bump: 0,
            free: std::array::from_fn(|_| Vec::new()),
            in_use_bytes: 0,
        }
    }

    fn class_of(len: u32) -> (usize, u64) {
        let size = (len.max(MIN_ALLOC) as u64).next_power_of_two();
        let class = (size.trailing_zeros() - MIN_ALLOC.trailing_zeros()) as usize;
        (class, size)
    }

    /// A buffer of at least `len` bytes, or `None` when the arena is full.
    pub fn alloc(&mut self, len: u32) -> Option<ArenaBuf> {
        let (class, size) = Self::class_of(len);
        if class >= CLASSES {
            return None;
        }
        let off = if let Some(off) = self.free[class].pop() {
            off
        } else {
            // Buffers are aligned to their own size class up to 4 KiB, and to
            // 4 KiB above it (page-aligned buffers can take O_DIRECT reads).
            let align = size.min(4096);
            let start = self.bump.next_multiple_of(align);
            let end = start.checked_add(size)?;
            if end > self.len {
                return None;
            }
            self.bump = end;
            start as u32
        };
        self.in_use_bytes += size;
        Some(ArenaBuf {
            off,
            cap: u32::try_from(size).unwrap_or(u32::MAX),
        })
    }

    /// Returns `buf` (as returned by [`Self::alloc`]) for reuse.
    pub fn free(&mut self, buf: ArenaBuf) {
        let (class, size) = Self::class_of(buf.cap);
        debug_assert!(
            buf.off as u64 + size <= self.bump,
            "freeing a buffer we never gave out"
        );
        self.in_use_bytes -= size;
        self.free[class].push(buf.off);
    }

    /// Whether buffers of these lengths could ever be held at once, by an
    /// empty arena (each rounded up to its size class). `false` means
    /// [`Self::alloc`] fails for them however many buffers are freed.
    pub fn could_ever_fit(&self, lens: &[u32]) -> bool {
        let mut total = 0u64;
        for &l in lens {
            let (class, size) = Self::class_of(l);
            if class >= CLASSES {
                return false;
            }
            total += size;
        }
        total <= self.len
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

    proptest! {
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
                    for o in &live {
                        let disjoint = b.off + b.cap <= o.off || o.off + o.cap <= b.off;
                        prop_assert!(disjoint, "{b:?} overlaps {o:?}");
                    }
                    live.push(b);
                }
            }
        }
    }
}
