//! Page-aligned, owned byte buffers: what O_DIRECT reads and writes need,
//! and what an I/O operation owns while the kernel may touch it.

use std::alloc::{Layout, alloc, dealloc};
use std::ptr::NonNull;

/// Alignment of every buffer and of every direct I/O offset and length.
pub const ALIGN: usize = 4096;

/// A zero-initialized buffer of `capacity` bytes (a multiple of [`ALIGN`])
/// aligned to [`ALIGN`], with a logical length `len <= capacity`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: the buffer is plain owned memory, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads, like `&Vec<u8>`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer with room for at least `min_cap` bytes (rounded up to
    /// [`ALIGN`], at least one page), length 0.
    pub fn with_capacity(min_cap: usize) -> AlignedBuf {
        let cap = min_cap.max(1).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(cap, ALIGN)
            .expect("capacity rounded to ALIGN is a valid layout");
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // Zero by writing, not `alloc_zeroed`: calloc leaves fresh pages
        // untouched (they read as zero), and an O_DIRECT read into a page
        // that is not yet mapped cannot be issued without blocking, so
        // io_uring hands it to a worker thread (a few at most per CPU),
        // which halves the random-read IOPS at depth. Writing maps them.
        // SAFETY: `p..p+cap` is the allocation just made.
        unsafe { std::ptr::write_bytes(p, 0, cap) };
        AlignedBuf { ptr, len: 0, cap }
    }

    /// A buffer holding a copy of `data` (capacity rounded up, the rest
    /// zeroed). Writes each byte once: a block copied into the cache as a
    /// flush writes it was zeroed and then copied over (zeroing in
    /// `with_capacity` was 2.6 % of statord's time in Flink's
    /// `listUpdate` benchmark, these copies among its callers).
    pub fn copy_of(data: &[u8]) -> AlignedBuf {
        let cap = data.len().max(1).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(cap, ALIGN)
            .expect("capacity rounded to ALIGN is a valid layout");
        // SAFETY: `layout` has a non-zero size.
        let p = unsafe { alloc(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        // SAFETY: `p..p+cap` is the allocation just made, `data` lies
        // outside it, and `data.len() <= cap`: every byte up to `cap` is
        // written once (the copy, then zeros), as `set_len` requires.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len());
            std::ptr::write_bytes(p.add(data.len()), 0, cap - data.len());
        }
        AlignedBuf {
            ptr,
            len: data.len(),
            cap,
        }
    }

    /// A buffer of exactly `len` zero bytes (capacity rounded up).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::with_capacity(len);
        b.len = len;
        b
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the logical length. Bytes up to `capacity` are always
    /// initialized (zeroed at allocation), so any length up to it is sound.
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.cap,
            "set_len {len} beyond capacity {}",
            self.cap
        );
        self.len = len;
    }

    /// Appends `data`; panics if it does not fit (callers size buffers first).
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let end = self.len + data.len();
        assert!(
            end <= self.cap,
            "append of {} bytes overflows a {}-byte buffer",
            data.len(),
            self.cap
        );
        self.spare_mut()[..data.len()].copy_from_slice(data);
        self.len = end;
    }

    /// Pads with zeros up to the next multiple of `ALIGN`.
    pub fn pad_to_align(&mut self) {
        let end = self.len.next_multiple_of(ALIGN);
        assert!(end <= self.cap);
        let len = self.len;
        self.as_full_mut()[len..end].fill(0);
        self.len = end;
    }

    /// Resets the length to zero (capacity and contents kept).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn as_full_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr+cap` is our allocation, fully initialized at
        // allocation, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }

    /// The bytes after `len`, up to capacity.
    pub fn spare_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.as_full_mut()[len..]
    }

    /// Raw pointer for handing to the kernel. The buffer must stay alive
    /// and unmoved-from until the operation completes (an I/O layer owns it).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= cap`, the range is initialized and owned by us.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.as_full_mut()[..len]
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, ALIGN).expect("same layout as allocated");
        // SAFETY: allocated in `with_capacity` with exactly this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} of {} bytes)", self.len, self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut c = AlignedBuf::copy_of(&[9u8; 5000]);
        assert_eq!((c.len(), c.capacity()), (5000, 8192));
        assert_eq!(c.as_mut_ptr() as usize % ALIGN, 0);
        assert!(c.iter().all(|&x| x == 9));
        c.set_len(8192);
        assert!(c[5000..].iter().all(|&x| x == 0), "the tail is zeroed");
        let mut b = AlignedBuf::with_capacity(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.as_mut_ptr() as usize % ALIGN, 0);
        b.extend_from_slice(b"abc");
        assert_eq!(&b[..], b"abc");
        b.pad_to_align();
        assert_eq!(b.len(), 4096);
        assert!(b[3..].iter().all(|&x| x == 0));
    }
}
