//! Zeroed arrays in their own anonymous mapping, backed by transparent huge
//! pages where the kernel allows (`MADV_HUGEPAGE`).
//!
//! The memtable's log chunks and hash index are read at random; with 4 KiB
//! pages a random load in a large table also misses the TLB and walks the
//! page tables (more loads), with 2 MiB pages it mostly does not. Mappings
//! of at least 2 MiB are aligned to 2 MiB so that every whole 2 MiB of them
//! can be a huge page. The kernel zero-fills the pages on first touch.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

const HUGE: usize = 2 << 20;

/// Element types an all-zero mapping is a valid array of.
pub trait Zeroed: Copy + sealed::Sealed {}
impl Zeroed for u8 {}
impl Zeroed for u64 {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u64 {}
}

/// A fixed-length, zero-initialized array in its own mapping.
pub struct HugeArray<T: Zeroed> {
    ptr: NonNull<T>,
    len: usize,
    /// The mapping (start, bytes) to unmap.
    map: (NonNull<u8>, usize),
}

// SAFETY: a HugeArray owns its mapping exclusively, like a Box<[T]>.
unsafe impl<T: Zeroed + Send> Send for HugeArray<T> {}
// SAFETY: shared access is read-only through Deref, like a Box<[T]>.
unsafe impl<T: Zeroed + Sync> Sync for HugeArray<T> {}

impl<T: Zeroed> HugeArray<T> {
    /// `len` zeroed elements, in huge pages where the kernel allows.
    /// Panics if the address space is exhausted (as `vec!` aborts when
    /// memory is).
    pub fn zeroed(len: usize) -> HugeArray<T> {
        Self::with_pages(len, true)
    }

    /// `len` zeroed elements; `huge`: ask for huge pages.
    pub fn with_pages(len: usize, huge: bool) -> HugeArray<T> {
        let bytes = (len * size_of::<T>()).max(1);
        let (huge, map_len) = if huge && bytes >= HUGE {
            (true, bytes.next_multiple_of(HUGE) + HUGE)
        } else {
            (false, bytes.next_multiple_of(4096))
        };
        // SAFETY: an anonymous private mapping at an address of the
        // kernel's choosing touches no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(
            p != libc::MAP_FAILED,
            "mmap of {map_len} bytes failed: {}",
            std::io::Error::last_os_error()
        );
        let base = p as usize;
        let (start, map) = if huge {
            // Keep a 2 MiB-aligned window; return the slop at both ends.
            let start = base.next_multiple_of(HUGE);
            let end = start + bytes.next_multiple_of(HUGE);
            // SAFETY: both ranges lie inside the mapping just created and
            // are not referenced by anything.
            unsafe {
                if start > base {
                    libc::munmap(base as *mut libc::c_void, start - base);
                }
                if base + map_len > end {
                    libc::munmap(end as *mut libc::c_void, base + map_len - end);
                }
                // A hint: without THP the mapping simply keeps 4 KiB pages.
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
            (start, end - start)
        } else {
            (base, map_len)
        };
        let start = NonNull::new(start as *mut u8).expect("mmap never returns null on success");
        HugeArray {
            ptr: start.cast(),
            len,
            map: (start, map),
        }
    }

    /// Bytes of address space held.
    pub fn mapped_bytes(&self) -> usize {
        self.map.1
    }

    /// Faults in every page now, on this thread (`MADV_POPULATE_WRITE`).
    /// False if the kernel refused (the pages then fault in on first
    /// touch, as without this).
    pub fn populate(&mut self) -> bool {
        // SAFETY: faults in pages of this array's own mapping, which self
        // owns; populating never changes their contents (zero).
        let r = unsafe {
            libc::madvise(
                self.map.0.as_ptr() as *mut libc::c_void,
                self.map.1,
                libc::MADV_POPULATE_WRITE,
            )
        };
        r == 0
    }
}

impl<T: Zeroed> Deref for HugeArray<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the mapping holds `len` elements, page-aligned (so aligned
        // for T), zero-initialized by the kernel (a valid T), and owned by
        // self for as long as the borrow.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroed> DerefMut for HugeArray<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroed> Drop for HugeArray<T> {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `zeroed` and nothing borrows
        // it once self is dropped.
        unsafe { libc::munmap(self.map.0.as_ptr() as *mut libc::c_void, self.map.1) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_are_zeroed_writable_and_aligned() {
        for len in [1usize, 4095, 4096, 1 << 20, (2 << 20) + 1, 3 << 20] {
            let mut a = HugeArray::<u8>::zeroed(len);
            assert_eq!(a.len(), len);
            assert!(a.iter().all(|&b| b == 0));
            a[len - 1] = 7;
            assert_eq!(a[len - 1], 7);
            if len >= HUGE {
                assert_eq!(a.as_ptr() as usize % HUGE, 0);
            }
        }
        let mut w = HugeArray::<u64>::zeroed(1 << 19);
        assert!(w.populate());
        w[12345] = u64::MAX;
        assert_eq!(w.iter().filter(|&&x| x != 0).count(), 1);
    }
}
