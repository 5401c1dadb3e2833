//! memfd segments: create, seal, map, attach.

use std::ffi::CStr;
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use nix::fcntl::{FcntlArg, SealFlag, fcntl};
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use crate::view::ShmView;

/// Seals every segment carries before it is mapped by a peer. `F_SEAL_SHRINK`
/// is what makes a mapping safe to read: without it the owner could truncate
/// the file and turn our loads into `SIGBUS`. `F_SEAL_GROW` keeps the size we
/// validated the layout against the size forever; `F_SEAL_SEAL` stops anyone
/// from removing or adding seals later.
pub const SEALS_REQUIRED: SealFlag = SealFlag::from_bits_truncate(
    SealFlag::F_SEAL_SHRINK.bits() | SealFlag::F_SEAL_GROW.bits() | SealFlag::F_SEAL_SEAL.bits(),
);

/// Errors creating or attaching a segment.
#[derive(Debug, thiserror::Error)]
pub enum SegmentError {
    #[error("segment length must be non-zero and fit in off_t, got {0}")]
    BadLength(usize),
    #[error("memfd_create failed: {0}")]
    Create(nix::Error),
    #[error("sizing the memfd to {len} bytes failed: {source}")]
    Truncate { len: usize, source: nix::Error },
    #[error("sealing the memfd failed: {0}")]
    Seal(nix::Error),
    #[error("fstat on the segment fd failed: {0}")]
    Stat(nix::Error),
    #[error(
        "the segment fd is missing seals {missing:?}; refusing to map memory the peer could truncate"
    )]
    NotSealed { missing: SealFlag },
    #[error("reading the segment's seals failed (not a memfd?): {0}")]
    GetSeals(nix::Error),
    #[error("mmap of {len} bytes failed: {source}")]
    Map { len: usize, source: nix::Error },
}

/// A mapped, sealed memfd. The mapping lives as long as the `Segment`; views
/// borrow it.
#[derive(Debug)]
pub struct Segment {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `Segment` owns its fd and mapping; the raw pointer is only ever
// used through `ShmView`, whose accesses are volatile copies valid from any
// thread. Nothing in `Segment` is tied to the creating thread.
unsafe impl Send for Segment {}
// SAFETY: see `Send`; shared access only hands out `ShmView`s, which are
// themselves `Sync`.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a memfd of `len` bytes named `name` (shown in /proc/PID/fd),
    /// zero-filled, seals it with [`SEALS_REQUIRED`] and maps it read-write.
    pub fn create(name: &CStr, len: usize) -> Result<Self, SegmentError> {
        let len_off = i64::try_from(len).map_err(|_| SegmentError::BadLength(len))?;
        if len == 0 {
            return Err(SegmentError::BadLength(len));
        }
        let fd = memfd_create(name, MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
            .map_err(SegmentError::Create)?;
        nix::unistd::ftruncate(&fd, len_off)
            .map_err(|source| SegmentError::Truncate { len, source })?;
        fcntl(&fd, FcntlArg::F_ADD_SEALS(SEALS_REQUIRED)).map_err(SegmentError::Seal)?;
        Self::map(fd, len)
    }

    /// Maps a segment received from a peer. The fd must be a memfd carrying
    /// at least [`SEALS_REQUIRED`]; its length is taken from `fstat`, never
    /// from the peer's word.
    pub fn attach(fd: OwnedFd) -> Result<Self, SegmentError> {
        let seals = fcntl(&fd, FcntlArg::F_GET_SEALS).map_err(SegmentError::GetSeals)?;
        let have = SealFlag::from_bits_truncate(seals);
        let missing = SEALS_REQUIRED.difference(have);
        if !missing.is_empty() {
            return Err(SegmentError::NotSealed { missing });
        }
        let st = nix::sys::stat::fstat(&fd).map_err(SegmentError::Stat)?;
        let len = usize::try_from(st.st_size).map_err(|_| SegmentError::BadLength(0))?;
        if len == 0 {
            return Err(SegmentError::BadLength(0));
        }
        Self::map(fd, len)
    }

    fn map(fd: OwnedFd, len: usize) -> Result<Self, SegmentError> {
        let nz = NonZeroUsize::new(len).ok_or(SegmentError::BadLength(len))?;
        // SAFETY: we ask for a fresh shared mapping (no fixed address), so no
        // existing memory is replaced. The fd is sealed against shrinking, so
        // every page of `len` stays backed for the mapping's lifetime.
        let ptr = unsafe {
            mmap(
                None,
                nz,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                &fd,
                0,
            )
        }
        .map_err(|source| SegmentError::Map { len, source })?;
        Ok(Segment {
            fd,
            ptr: ptr.cast(),
            len,
        })
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a segment has a non-zero length.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The memfd, to pass to a peer with [`crate::fdpass::send_fds`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A bounds-checked view of the whole mapping.
    pub fn view(&self) -> ShmView<'_> {
        // SAFETY: `ptr..ptr+len` is our live mapping, which outlives the
        // returned view by its borrow of `self`.
        unsafe { ShmView::from_raw(self.ptr, self.len) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` is exactly the mapping created in `map`, and no
        // view outlives `self` (views borrow it).
        let r = unsafe { munmap(self.ptr.cast(), self.len) };
        debug_assert!(r.is_ok(), "munmap of our own mapping failed: {r:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_is_sealed_and_zeroed() {
        let seg = Segment::create(c"t", 8192).unwrap();
        let seals = fcntl(seg.fd(), FcntlArg::F_GET_SEALS).unwrap();
        assert!(SealFlag::from_bits_truncate(seals).contains(SEALS_REQUIRED));
        let mut b = [1u8; 64];
        seg.view().read_into(8192 - 64, &mut b).unwrap();
        assert_eq!(b, [0u8; 64]);
        // Growing and shrinking are refused by the kernel.
        assert!(nix::unistd::ftruncate(seg.fd(), 4096).is_err());
        assert!(nix::unistd::ftruncate(seg.fd(), 16384).is_err());
    }

    #[test]
    fn attach_refuses_unsealed() {
        let fd = memfd_create(c"u", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
        nix::unistd::ftruncate(&fd, 4096).unwrap();
        let err = Segment::attach(fd).unwrap_err();
        assert!(matches!(err, SegmentError::NotSealed { .. }), "{err}");
    }

    #[test]
    fn attach_refuses_non_memfd() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let err = Segment::attach(OwnedFd::from(f)).unwrap_err();
        assert!(matches!(err, SegmentError::GetSeals(_)), "{err}");
    }

    #[test]
    fn attach_sees_same_memory() {
        let a = Segment::create(c"s", 4096).unwrap();
        let dup = a.fd().try_clone_to_owned().unwrap();
        let b = Segment::attach(dup).unwrap();
        assert_eq!(b.len(), 4096);
        a.view().write_from(100, b"hello").unwrap();
        let mut got = [0u8; 5];
        b.view().read_into(100, &mut got).unwrap();
        assert_eq!(&got, b"hello");
    }

    #[test]
    fn zero_length_is_refused() {
        assert!(matches!(
            Segment::create(c"z", 0),
            Err(SegmentError::BadLength(0))
        ));
    }
}
