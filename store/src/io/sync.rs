//! Plain `pread`/`pwrite`/`fsync`: each operation runs when submitted and
//! its completion waits in a queue. The reference implementation the other
//! two are tested against, and the fallback where io_uring is unavailable.
//! Armed fds are watched with `poll(2)` in [`Io::wait`] and
//! [`Io::take_ready`].

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use slab::Slab;

use super::{FileId, Io, IoCompletion, IoResult, OpenMode, errno_of, open_file};
use crate::aligned::AlignedBuf;

/// Synchronous I/O behind the asynchronous interface.
pub struct SyncIo {
    files: Slab<(File, bool)>,
    done: VecDeque<IoCompletion>,
    direct: bool,
    /// Fds armed by [`Io::poll_readable`] (duplicates: the caller may close
    /// its own, say to disarm, before the token is taken), and the tokens
    /// of those seen readable.
    armed: Vec<(OwnedFd, u64)>,
    ready: Vec<u64>,
}

impl SyncIo {
    /// `direct`: open files with O_DIRECT where the file system allows.
    pub fn new(direct: bool) -> SyncIo {
        SyncIo {
            files: Slab::new(),
            done: VecDeque::new(),
            direct,
            armed: Vec::new(),
            ready: Vec::new(),
        }
    }

    /// Waits up to `timeout` for an armed fd to become readable, and moves
    /// the tokens of those that are to `ready` (they fire once).
    fn poll_armed(&mut self, timeout: PollTimeout) -> IoResult<()> {
        if self.armed.is_empty() {
            return Ok(());
        }
        let mut fds: Vec<PollFd<'_>> = self
            .armed
            .iter()
            .map(|(fd, _)| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
        let fired: Vec<bool> = fds
            .iter()
            .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
            .collect();
        let mut fired = fired.into_iter();
        let ready = &mut self.ready;
        self.armed.retain(|&(_, token)| {
            let f = fired.next().unwrap_or(false);
            if f {
                ready.push(token);
            }
            !f
        });
        Ok(())
    }

    fn file(&self, f: FileId) -> Option<&File> {
        self.files.get(f as usize).map(|(f, _)| f)
    }
}

/// Reads until `buf` is full or end of file, continuing short reads.
pub(crate) fn read_full(file: &File, offset: u64, buf: &mut [u8]) -> Result<usize, i32> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(errno_of(&e)),
        }
    }
    Ok(done)
}

/// Writes all of `buf`, continuing short writes.
pub(crate) fn write_full(file: &File, offset: u64, buf: &[u8]) -> Result<usize, i32> {
    let mut done = 0;
    while done < buf.len() {
        match file.write_at(&buf[done..], offset + done as u64) {
            Ok(0) => return Err(libc::ENOSPC),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(errno_of(&e)),
        }
    }
    Ok(done)
}

impl Io for SyncIo {
    fn open(&mut self, path: &Path, mode: OpenMode) -> IoResult<FileId> {
        let (f, d) = open_file(path, mode, self.direct)?;
        Ok(self.files.insert((f, d)) as FileId)
    }

    fn is_direct(&self, f: FileId) -> bool {
        self.files.get(f as usize).is_some_and(|(_, d)| *d)
    }

    fn file_len(&mut self, f: FileId) -> IoResult<u64> {
        let file = self
            .file(f)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        Ok(file.metadata()?.len())
    }

    fn close(&mut self, f: FileId) {
        self.files.try_remove(f as usize);
    }

    fn read(&mut self, f: FileId, offset: u64, mut buf: AlignedBuf, token: u64) {
        let result = match self.file(f) {
            None => Err(libc::EBADF),
            Some(file) => read_full(file, offset, &mut buf),
        };
        self.done
            .push_back(IoCompletion::local(token, Some(buf), result));
    }

    fn write(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        let result = match self.file(f) {
            None => Err(libc::EBADF),
            Some(file) => write_full(file, offset, &buf),
        };
        self.done
            .push_back(IoCompletion::local(token, Some(buf), result));
    }

    fn fsync(&mut self, f: FileId, token: u64) {
        let result = match self.file(f) {
            None => Err(libc::EBADF),
            Some(file) => file.sync_all().map(|_| 0).map_err(|e| errno_of(&e)),
        };
        self.done
            .push_back(IoCompletion::local(token, None, result));
    }

    fn unlink(&mut self, path: &Path, token: u64) {
        let result = std::fs::remove_file(path)
            .map(|_| 0)
            .map_err(|e| errno_of(&e));
        self.done
            .push_back(IoCompletion::local(token, None, result));
    }

    fn rename(&mut self, from: &Path, to: &Path, token: u64) {
        let result = std::fs::rename(from, to)
            .map(|_| 0)
            .map_err(|e| errno_of(&e));
        self.done
            .push_back(IoCompletion::local(token, None, result));
    }

    fn submit(&mut self) -> IoResult<()> {
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>) {
        out.extend(self.done.drain(..));
    }

    fn wait(&mut self, timeout: Option<Duration>) -> IoResult<()> {
        if !self.done.is_empty() || !self.ready.is_empty() {
            return Ok(());
        }
        if !self.armed.is_empty() {
            // Operations complete at submission: only an armed fd can end
            // the wait early.
            // Whole milliseconds, rounded up: a shorter wait would be none.
            let t = timeout.map_or(PollTimeout::NONE, |t| {
                let ms = t.as_micros().div_ceil(1000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            });
            return self.poll_armed(t);
        }
        // Everything completes at submission; nothing to wait for but time.
        if let Some(t) = timeout {
            std::thread::sleep(t.min(Duration::from_millis(1)));
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.done.len()
    }

    fn poll_readable(&mut self, fd: BorrowedFd<'_>, token: u64) {
        match fd.try_clone_to_owned() {
            Ok(fd) => self.armed.push((fd, token)),
            // No fd left to duplicate it into: report it ready, so the
            // caller looks (and arms it again) rather than sleep through it.
            Err(_) => self.ready.push(token),
        }
    }

    fn take_ready(&mut self, out: &mut Vec<u64>) {
        // A failed poll leaves them armed: the next look tries again.
        let _ = self.poll_armed(PollTimeout::ZERO);
        out.append(&mut self.ready);
    }
}
