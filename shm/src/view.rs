//! Bounds-checked, copy-in/copy-out access to memory a peer may change at
//! any time.
//!
//! The rule: no `&T` or `&[u8]` into the mapping ever exists. Every read is a
//! volatile copy into private memory, every write a volatile copy out of it,
//! so the compiler never assumes the bytes are stable, and a value is
//! validated only after it was copied (a peer cannot change it between the
//! check and the use). Atomics are the one exception: [`ShmView::atomic_u32`]
//! hands out a raw, aligned, in-bounds pointer for the caller to wrap in an
//! atomic type, since an atomic is designed to be shared.

use std::marker::PhantomData;
use std::ptr::NonNull;

use zerocopy::{FromBytes, Immutable, IntoBytes};

/// An offset or length named a range outside the view (or overflowed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("range {off}+{len} is outside the {bound}-byte view")]
pub struct OutOfBounds {
    pub off: u64,
    pub len: u64,
    pub bound: u64,
}

/// A view of `len` bytes of shared memory starting at `ptr`, valid for `'a`.
#[derive(Clone, Copy, Debug)]
pub struct ShmView<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _life: PhantomData<&'a [u8]>,
}

// SAFETY: all access through a view is volatile copies or atomics on memory
// that is shared by design; nothing is tied to a thread.
unsafe impl Send for ShmView<'_> {}
// SAFETY: as for `Send`: concurrent volatile copies are what the view is for.
unsafe impl Sync for ShmView<'_> {}

impl<'a> ShmView<'a> {
    /// # Safety
    /// `ptr..ptr+len` must be mapped, readable and writable memory that
    /// stays mapped for `'a`, and that no Rust reference aliases.
    pub unsafe fn from_raw(ptr: NonNull<u8>, len: usize) -> Self {
        ShmView {
            ptr,
            len,
            _life: PhantomData,
        }
    }

    /// Length of the view in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the view has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks that `off..off+len` lies inside the view, without overflow.
    #[inline]
    pub fn check(&self, off: usize, len: usize) -> Result<(), OutOfBounds> {
        match off.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(OutOfBounds {
                off: off as u64,
                len: len as u64,
                bound: self.len as u64,
            }),
        }
    }

    /// A view of `off..off+len` of this one.
    pub fn subview(&self, off: usize, len: usize) -> Result<ShmView<'a>, OutOfBounds> {
        self.check(off, len)?;
        // SAFETY: the range was just checked to lie inside our own valid range.
        Ok(unsafe { ShmView::from_raw(self.ptr.add(off), len) })
    }

    /// Copies `dst.len()` bytes at `off` out of shared memory.
    #[inline]
    pub fn read_into(&self, off: usize, dst: &mut [u8]) -> Result<(), OutOfBounds> {
        self.check(off, dst.len())?;
        // SAFETY: `off..off+dst.len()` is inside the mapping (checked above).
        unsafe { volatile_copy_out(self.ptr.as_ptr().add(off), dst) };
        Ok(())
    }

    /// Copies `src` into shared memory at `off`.
    #[inline]
    pub fn write_from(&self, off: usize, src: &[u8]) -> Result<(), OutOfBounds> {
        self.check(off, src.len())?;
        // SAFETY: `off..off+src.len()` is inside the mapping (checked above).
        unsafe { volatile_copy_in(self.ptr.as_ptr().add(off), src) };
        Ok(())
    }

    /// Hints the CPU to start loading the cache line at `off` (`write`:
    /// with intent to write). Out-of-bounds offsets are ignored; a prefetch
    /// never faults and changes no memory, so it is safe on bytes the peer
    /// may be writing. Used to overlap the cross-core misses of a batch.
    #[inline]
    pub fn prefetch(&self, off: usize, write: bool) {
        if off >= self.len {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_ET0, _MM_HINT_T0, _mm_prefetch};
            // SAFETY: `off < len`, so the address is inside the mapping; a
            // prefetch is a hint that neither faults nor writes.
            let p = unsafe { self.ptr.as_ptr().add(off) } as *const i8;
            if write {
                // SAFETY: as above; the hint only requests the line.
                unsafe { _mm_prefetch::<_MM_HINT_ET0>(p) };
            } else {
                // SAFETY: as above.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(p) };
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = write;
    }

    /// Writes `len` copies of `byte` at `off`.
    pub fn fill(&self, off: usize, len: usize, byte: u8) -> Result<(), OutOfBounds> {
        self.check(off, len)?;
        for i in 0..len {
            // SAFETY: `off + i < off + len <= self.len`, checked above.
            unsafe { self.ptr.as_ptr().add(off + i).write_volatile(byte) };
        }
        Ok(())
    }

    /// Copies a `T` out of shared memory at `off` (any alignment).
    #[inline]
    pub fn read<T: FromBytes + IntoBytes>(&self, off: usize) -> Result<T, OutOfBounds> {
        let mut v = T::new_zeroed();
        self.read_into(off, v.as_mut_bytes())?;
        Ok(v)
    }

    /// Copies `v` into shared memory at `off` (any alignment).
    #[inline]
    pub fn write<T: IntoBytes + Immutable>(&self, off: usize, v: &T) -> Result<(), OutOfBounds> {
        self.write_from(off, v.as_bytes())
    }

    /// A pointer to a naturally aligned `u32` at `off`, for the caller to use
    /// as an atomic (e.g. `AtomicU32::from_ptr`). Fails if out of bounds or
    /// misaligned. The pointer is valid for `'a`.
    pub fn atomic_u32(&self, off: usize) -> Result<NonNull<u32>, OutOfBounds> {
        self.check(off, 4)?;
        // SAFETY: in bounds, checked above.
        let p = unsafe { self.ptr.add(off) };
        if !(p.as_ptr() as usize).is_multiple_of(4) {
            return Err(OutOfBounds {
                off: off as u64,
                len: 4,
                bound: self.len as u64,
            });
        }
        Ok(p.cast())
    }

    /// `off..off+len` as a byte slice, read in place (a snapshot chunk:
    /// megabytes the reader hands on without copying).
    ///
    /// # Safety
    /// Nothing may write the range while the slice lives: the protocol must
    /// give the caller the range (a chunk slot the peer has handed back and
    /// will not touch until it is handed over again).
    pub unsafe fn slice(&self, off: usize, len: usize) -> Result<&'a [u8], OutOfBounds> {
        self.check(off, len)?;
        // SAFETY: in bounds (checked above) and mapped for the view's
        // lifetime `'a`; the caller guarantees no writer meanwhile.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(off), len) })
    }

    /// The raw address of `off..off+len`, for handing to the kernel (for
    /// example as an io_uring read target). Bounds-checked; what the caller
    /// does with the pointer is its own `unsafe` business.
    pub fn raw_range(&self, off: usize, len: usize) -> Result<NonNull<u8>, OutOfBounds> {
        self.check(off, len)?;
        // SAFETY: in bounds, checked above.
        Ok(unsafe { self.ptr.add(off) })
    }
}

/// Word-at-a-time volatile copy from shared memory.
///
/// # Safety
/// `src..src+dst.len()` must be valid for reads.
#[inline]
unsafe fn volatile_copy_out(src: *const u8, dst: &mut [u8]) {
    let n = dst.len();
    let mut i = 0;
    // Leading bytes until `src + i` is 8-aligned.
    while i < n && !(src as usize + i).is_multiple_of(8) {
        // SAFETY: i < n, so src+i is inside the caller's valid range.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
    while i + 8 <= n {
        // SAFETY: src+i is 8-aligned (loop above) and src+i..src+i+8 is inside
        // the valid range since i + 8 <= n.
        let w = unsafe { (src.add(i) as *const u64).read_volatile() };
        dst[i..i + 8].copy_from_slice(&w.to_ne_bytes());
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        dst[i] = unsafe { src.add(i).read_volatile() };
        i += 1;
    }
}

/// Word-at-a-time volatile copy into shared memory.
///
/// # Safety
/// `dst..dst+src.len()` must be valid for writes.
#[inline]
unsafe fn volatile_copy_in(dst: *mut u8, src: &[u8]) {
    let n = src.len();
    let mut i = 0;
    while i < n && !(dst as usize + i).is_multiple_of(8) {
        // SAFETY: i < n, inside the caller's valid range.
        unsafe { dst.add(i).write_volatile(src[i]) };
        i += 1;
    }
    while i + 8 <= n {
        let mut w = [0u8; 8];
        w.copy_from_slice(&src[i..i + 8]);
        // SAFETY: dst+i is 8-aligned and dst+i..dst+i+8 is in range (i+8 <= n).
        unsafe { (dst.add(i) as *mut u64).write_volatile(u64::from_ne_bytes(w)) };
        i += 8;
    }
    while i < n {
        // SAFETY: i < n.
        unsafe { dst.add(i).write_volatile(src[i]) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn with_view<R>(len: usize, f: impl FnOnce(ShmView<'_>) -> R) -> R {
        let mut backing = vec![0u8; len];
        let p = NonNull::new(backing.as_mut_ptr()).unwrap();
        // SAFETY: `backing` lives until the end of this function and is not
        // referenced while the view is in use.
        let v = unsafe { ShmView::from_raw(p, len) };
        f(v)
    }

    #[test]
    fn overflowing_ranges_are_refused() {
        with_view(64, |v| {
            assert!(v.check(usize::MAX, 2).is_err());
            assert!(v.check(1, usize::MAX).is_err());
            assert!(v.check(64, 0).is_ok());
            assert!(v.check(65, 0).is_err());
            assert!(v.read::<u64>(57).is_err());
            assert!(v.write_from(60, &[0; 5]).is_err());
            assert!(v.subview(10, 60).is_err());
            assert!(
                v.atomic_u32(2).is_err(),
                "misaligned atomic must be refused"
            );
            assert!(v.atomic_u32(60).is_ok());
            assert!(v.atomic_u32(61).is_err());
        });
    }

    proptest! {
        #[test]
        fn copy_roundtrip(off in 0usize..200, data in proptest::collection::vec(any::<u8>(), 0..100)) {
            with_view(300, |v| {
                v.write_from(off, &data).unwrap();
                let mut out = vec![0u8; data.len()];
                v.read_into(off, &mut out).unwrap();
                prop_assert_eq!(&out, &data);
                // Neighbouring bytes untouched.
                if off > 0 {
                    prop_assert_eq!(v.read::<u8>(off - 1).unwrap(), 0);
                }
                prop_assert_eq!(v.read::<u8>(off + data.len()).unwrap(), 0);
                Ok(())
            })?;
        }

        #[test]
        fn checked_access_never_escapes(off in any::<usize>(), len in any::<usize>()) {
            with_view(128, |v| {
                let ok = off.checked_add(len).is_some_and(|e| e <= 128);
                prop_assert_eq!(v.check(off, len).is_ok(), ok);
                Ok(())
            })?;
        }
    }
}
