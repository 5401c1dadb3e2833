//! The I/O layer the store runs on, behind one trait so the same engine and
//! the same tests run against io_uring ([`UringIo`]), plain `pread`/`pwrite`
//! ([`SyncIo`]) and a fault injector ([`FaultIo`]).
//!
//! Shape: operations are submitted with a caller token and complete later;
//! a buffer handed to an operation is owned by it until its completion is
//! reaped, which returns the buffer. Reads and writes are full-length: an
//! implementation continues short transfers itself, so a completion's byte
//! count is short only for a read that hit end of file.

mod fault;
mod sync;
mod uring;

use std::path::Path;
use std::time::Duration;

pub use fault::{Fault, FaultIo, FaultPlan};
pub use sync::SyncIo;
pub use uring::{DISK_DEPTH, UringIo};

use crate::aligned::AlignedBuf;

/// A file opened through an [`Io`].
pub type FileId = u32;

/// How to open a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Read only.
    Read,
    /// Create (fail if it exists), read and write.
    CreateNew,
    /// An existing file, read and write (the remote tier writes fetched
    /// blocks back into a segment's file).
    ReadWrite,
}

/// A finished operation.
#[derive(Debug)]
pub struct IoCompletion {
    pub token: u64,
    /// The buffer of a read or write, returned to the caller (`None` for a
    /// block fetch the remote tier served: see `remote_block`).
    pub buf: Option<AlignedBuf>,
    /// Bytes transferred, or an errno.
    pub result: Result<usize, i32>,
    /// A read the remote tier served and could not (`result` is then
    /// `EREMOTEIO`): why, naming the object and the attempts.
    pub remote_error: Option<Box<crate::remote::RemoteError>>,
    /// A block read the remote tier served without a buffer of the
    /// caller's ([`crate::store`]'s block fetches): the block in its bytes
    /// as fetched, checked on the remote runtime.
    pub remote_block: Option<Result<crate::cache::Block, crate::format::Malformed>>,
}

impl IoCompletion {
    /// The completion of a local operation (no remote tier involved).
    pub(crate) fn local(
        token: u64,
        buf: Option<AlignedBuf>,
        result: Result<usize, i32>,
    ) -> IoCompletion {
        IoCompletion {
            token,
            buf,
            result,
            remote_error: None,
            remote_block: None,
        }
    }

    /// A placeholder left where a completion was taken from a batch.
    pub(crate) fn taken() -> IoCompletion {
        IoCompletion::local(0, None, Ok(0))
    }
}

/// The error of a failed read of `path`: the remote tier's own when it
/// served the read (`remote`, an [`IoCompletion::remote_error`]).
pub(crate) fn read_error(
    remote: Option<Box<crate::remote::RemoteError>>,
    path: &Path,
    errno: i32,
) -> crate::StoreError {
    match remote {
        Some(e) => crate::StoreError::Remote(format!("{e} (segment {})", path.display())),
        None => crate::StoreError::from_errno(path, "read", errno),
    }
}

/// Errors of the synchronous calls (open, size, close).
pub type IoResult<T> = std::io::Result<T>;

/// The store's I/O layer. One instance per store, used from one thread.
pub trait Io {
    /// Opens `path`. With `direct`, tries O_DIRECT and falls back to
    /// buffered I/O where the file system refuses it (see [`Io::is_direct`]).
    fn open(&mut self, path: &Path, mode: OpenMode) -> IoResult<FileId>;
    /// Whether `f` was opened with O_DIRECT.
    fn is_direct(&self, f: FileId) -> bool;
    /// Current length of `f`.
    fn file_len(&mut self, f: FileId) -> IoResult<u64>;
    /// Closes `f`. Operations still in flight on it complete first.
    fn close(&mut self, f: FileId);
    /// Reads `buf.len()` bytes at `offset` into `buf`.
    fn read(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64);
    /// [`Io::read`] for background work (a compaction's or an export's
    /// read-ahead), which an implementation that bounds the disk ops it
    /// has in flight queues with writes rather than behind the gets
    /// waiting (see `UringIo`).
    fn read_background(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.read(f, offset, buf, token);
    }
    /// Writes all of `buf` at `offset`.
    fn write(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64);
    /// Makes everything written to `f` durable.
    fn fsync(&mut self, f: FileId, token: u64);
    /// Removes the directory entry `path`, off the caller's thread where
    /// the implementation can: freeing a large file's blocks takes the
    /// unlink a while (280 ms for 1.5 GB on this project's ext4), which a
    /// shard must not wait for. Completes with `Ok(0)` or the errno.
    fn unlink(&mut self, path: &Path, token: u64);
    /// Renames `from` to `to` (replacing `to`), off the caller's thread
    /// where the implementation can. Durable once the directory is
    /// fsynced. Completes with `Ok(0)` or the errno.
    fn rename(&mut self, from: &Path, to: &Path, token: u64);
    /// Hands queued operations to the kernel (one syscall for a batch).
    fn submit(&mut self) -> IoResult<()>;
    /// Moves finished operations to `out` without blocking.
    fn reap(&mut self, out: &mut Vec<IoCompletion>);
    /// Blocks until at least one operation finished or `timeout` passed.
    fn wait(&mut self, timeout: Option<Duration>) -> IoResult<()>;
    /// Operations submitted and not yet reaped.
    fn in_flight(&self) -> usize;
    /// Arms a one-shot wait for `fd` to become readable, so that one
    /// [`Io::wait`] covers disk completions and, say, a client's doorbell
    /// eventfd (a shard sleeps so). When it fires, `token` comes out of
    /// [`Io::take_ready`] (never out of `reap`). The caller keeps `fd` open
    /// until then; to disarm, make the fd readable (ring the eventfd) and
    /// ignore the token.
    fn poll_readable(&mut self, fd: std::os::fd::BorrowedFd<'_>, token: u64);
    /// Moves the tokens of armed fds that became readable into `out`.
    fn take_ready(&mut self, out: &mut Vec<u64>);
    /// A hint: fault in the pages of `addr..addr+len` (memory this process
    /// mapped) before they are used, off the caller's thread where the
    /// implementation can (io_uring runs it in a kernel worker). Never
    /// changes their contents; nothing completes. Default: nothing.
    fn prefault(&mut self, addr: usize, len: usize) {
        let _ = (addr, len);
    }
}

/// The errno of an `std::io::Error`, or EIO.
pub(crate) fn errno_of(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

/// Opens a file with std, trying O_DIRECT first when asked.
pub(crate) fn open_file(
    path: &Path,
    mode: OpenMode,
    direct: bool,
) -> IoResult<(std::fs::File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    match mode {
        OpenMode::CreateNew => {
            o.write(true).create_new(true);
        }
        OpenMode::ReadWrite => {
            o.write(true);
        }
        OpenMode::Read => {}
    }
    if direct {
        let mut od = o.clone();
        od.custom_flags(libc::O_DIRECT);
        match od.open(path) {
            Ok(f) => return Ok((f, true)),
            // Not every file system takes O_DIRECT (tmpfs refuses with
            // EINVAL): fall back to buffered I/O, which is always correct.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(e),
        }
    }
    Ok((o.open(path)?, false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::Instant;

    /// A shard sleeps in `wait` with its sessions' doorbells armed, and
    /// looks for rung ones between passes: each implementation sees a rung
    /// doorbell both ways, once per arming.
    fn a_rung_doorbell_is_seen_by_take_ready_and_by_wait(io: &mut impl Io) {
        let bell = nix::sys::eventfd::EventFd::new().unwrap();
        let mut ready = Vec::new();
        // Seen without a wait (the shard looks between passes)...
        io.poll_readable(bell.as_fd(), 5);
        io.submit().unwrap();
        io.take_ready(&mut ready);
        assert!(ready.is_empty(), "not rung yet");
        bell.write(1).unwrap();
        let end = Instant::now() + Duration::from_secs(20);
        while ready.is_empty() {
            assert!(Instant::now() < end, "doorbell not seen");
            io.take_ready(&mut ready);
        }
        assert_eq!(ready, [5]);
        // Once: still readable, but no longer armed.
        ready.clear();
        io.take_ready(&mut ready);
        assert!(ready.is_empty(), "fired twice");
        bell.read().unwrap();
        // ...and a wait returns for it, long before its timeout.
        io.poll_readable(bell.as_fd(), 6);
        io.submit().unwrap();
        bell.write(1).unwrap();
        let t = Instant::now();
        while ready.is_empty() {
            assert!(Instant::now() < end, "doorbell not seen");
            io.wait(Some(Duration::from_secs(30))).unwrap();
            io.take_ready(&mut ready);
        }
        assert!(t.elapsed() < Duration::from_secs(25), "the wait ran out");
        assert_eq!(ready, [6]);
    }

    #[test]
    fn io_uring_sees_a_rung_doorbell() {
        a_rung_doorbell_is_seen_by_take_ready_and_by_wait(&mut UringIo::new(64, true).unwrap());
    }

    #[test]
    fn sync_io_sees_a_rung_doorbell() {
        a_rung_doorbell_is_seen_by_take_ready_and_by_wait(&mut SyncIo::new(false));
    }

    #[test]
    fn fault_io_sees_a_rung_doorbell() {
        let mut io = FaultIo::new(SyncIo::new(false), None);
        a_rung_doorbell_is_seen_by_take_ready_and_by_wait(&mut io);
    }
}
