//! io_uring: one ring per store instance, owned by the caller's thread.
//!
//! Every operation lives in a slab slot whose index is its `user_data`; the
//! slot owns the buffer until the completion is reaped, so the kernel never
//! writes into memory we freed. Short reads and writes are continued from
//! where they stopped; `EINTR`/`EAGAIN` are resubmitted; any other error
//! fails that operation (for a read, its bytes are lost to the caller, never
//! returned as data). Operations beyond the submission queue's room wait in
//! a backlog and enter as completions free slots (bounded in-flight).

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use io_uring::{IoUring, opcode, types};
use slab::Slab;

use super::{FileId, Io, IoCompletion, IoResult, OpenMode, open_file};
use crate::aligned::AlignedBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Fsync,
    /// `MADV_POPULATE_WRITE` of `(addr, len)`: run by an io-wq worker, so
    /// page faults (zeroing, and a VM host backing fresh memory) happen
    /// off this thread. Completes silently.
    Prefault(usize, usize),
    /// One-shot readiness of a foreign fd (a client's doorbell): the
    /// caller's, not the store's; its completion goes to `ready`.
    Poll(i32),
}

struct Op {
    token: u64,
    kind: Kind,
    file: FileId,
    offset: u64,
    buf: Option<AlignedBuf>,
    /// Bytes transferred so far (reads and writes continue from here).
    done: usize,
}

struct FileEntry {
    file: File,
    direct: bool,
    /// Operations still referring to the fd.
    pending: usize,
    /// `close` was called; drop when `pending` reaches zero.
    closing: bool,
}

/// io_uring-backed I/O.
pub struct UringIo {
    ring: IoUring,
    files: Slab<FileEntry>,
    ops: Slab<Op>,
    /// Ops waiting for submission-queue room, in order.
    backlog: VecDeque<usize>,
    done: VecDeque<IoCompletion>,
    /// Tokens of `poll_readable` fds that became readable.
    ready: Vec<u64>,
    /// Ops pushed to the SQ and not yet completed by the kernel.
    in_kernel: usize,
    direct: bool,
}

impl UringIo {
    /// A ring with `entries` submission slots. `direct`: open files with
    /// O_DIRECT where the file system allows.
    pub fn new(entries: u32, direct: bool) -> IoResult<UringIo> {
        let ring = IoUring::builder().setup_coop_taskrun().build(entries)?;
        Ok(UringIo {
            ring,
            files: Slab::new(),
            ops: Slab::new(),
            backlog: VecDeque::new(),
            done: VecDeque::new(),
            ready: Vec::new(),
            in_kernel: 0,
            direct,
        })
    }

    fn enqueue(&mut self, op: Op) {
        if let Some(f) = self.files.get_mut(op.file as usize) {
            f.pending += 1;
        }
        let idx = self.ops.insert(op);
        if !self.push(idx) {
            self.backlog.push_back(idx);
        }
    }

    /// Arms a one-shot wait for `fd` to become readable, so that one
    /// [`Io::wait`] covers disk completions and, say, a client's doorbell
    /// eventfd. When it fires, `token` comes out of [`UringIo::take_ready`]
    /// (never out of `reap`). The caller keeps `fd` open until then; to
    /// disarm, make the fd readable (ring the eventfd) and ignore the token.
    pub fn poll_readable(&mut self, fd: std::os::fd::BorrowedFd<'_>, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Poll(fd.as_raw_fd()),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
        });
    }

    /// Moves the tokens of fds that became readable into `out`.
    pub fn take_ready(&mut self, out: &mut Vec<u64>) {
        self.drain_cq();
        out.append(&mut self.ready);
    }

    /// Pushes op `idx` (its remaining part) to the SQ; false when full.
    fn push(&mut self, idx: usize) -> bool {
        let op = &mut self.ops[idx];
        if let Kind::Prefault(addr, len) = op.kind {
            let entry = opcode::Madvise::new(
                addr as *const libc::c_void,
                len as libc::off_t,
                libc::MADV_POPULATE_WRITE,
            )
            .build()
            .user_data(idx as u64);
            // SAFETY: the kernel only faults in pages of this process's
            // mappings and never changes their contents; if the range was
            // unmapped meanwhile it fails with ENOMEM, or, if something
            // else was mapped there, faults that in unchanged.
            let pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
            self.in_kernel += pushed as usize;
            return pushed;
        }
        if let Kind::Poll(fd) = op.kind {
            let entry = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32)
                .build()
                .user_data(idx as u64);
            // SAFETY: a poll references no memory of ours; the caller keeps
            // the fd open until the poll fires (see `poll_readable`).
            let pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
            self.in_kernel += pushed as usize;
            return pushed;
        }
        let Some(fe) = self.files.get(op.file as usize) else {
            let op = self.ops.remove(idx);
            self.done.push_back(IoCompletion {
                token: op.token,
                buf: op.buf,
                result: Err(libc::EBADF),
                remote_error: None,
                remote_block: None,
            });
            return true;
        };
        let fd = types::Fd(fe.file.as_raw_fd());
        let entry = match op.kind {
            Kind::Read | Kind::Write => {
                let buf = op
                    .buf
                    .as_mut()
                    .expect("read and write ops own a buffer until completion");
                let total = buf.len();
                // SAFETY: `done <= total <= capacity`, so the pointer stays
                // inside the buffer, which the op slot owns until completion.
                let ptr = unsafe { buf.as_mut_ptr().add(op.done) };
                let len = (total - op.done).min(u32::MAX as usize) as u32;
                let off = op.offset + op.done as u64;
                if op.kind == Kind::Read {
                    opcode::Read::new(fd, ptr, len).offset(off).build()
                } else {
                    opcode::Write::new(fd, ptr, len).offset(off).build()
                }
            }
            Kind::Fsync => opcode::Fsync::new(fd).build(),
            Kind::Poll(_) | Kind::Prefault(..) => unreachable!("pushed above"),
        }
        .user_data(idx as u64);
        // SAFETY: the entry's buffer pointer is owned by `ops[idx]` and
        // stays valid and unaliased until its completion is reaped (the slot
        // is removed only then); the fd is kept open while `pending > 0`.
        let pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
        if pushed {
            self.in_kernel += 1;
        }
        pushed
    }

    fn finish(&mut self, idx: usize, result: Result<usize, i32>) {
        let op = self.ops.remove(idx);
        match op.kind {
            // Readable, or an error on the fd: either way its owner looks.
            Kind::Poll(_) => return self.ready.push(op.token),
            // A hint; its outcome does not matter.
            Kind::Prefault(..) => return,
            _ => {}
        }
        if let Some(f) = self.files.get_mut(op.file as usize) {
            f.pending -= 1;
            if f.closing && f.pending == 0 {
                self.files.remove(op.file as usize);
            }
        }
        self.done.push_back(IoCompletion {
            token: op.token,
            buf: op.buf,
            result,
            remote_error: None,
            remote_block: None,
        });
    }

    /// Drains the CQ into `done`, continuing short and interrupted ops.
    fn drain_cq(&mut self) {
        let mut resubmit = Vec::new();
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in cqes {
            self.in_kernel -= 1;
            let idx = ud as usize;
            let Some(op) = self.ops.get_mut(idx) else {
                continue;
            };
            if res == -libc::EINTR || res == -libc::EAGAIN {
                resubmit.push(idx);
                continue;
            }
            if res < 0 {
                self.finish(idx, Err(-res));
                continue;
            }
            match op.kind {
                Kind::Fsync | Kind::Poll(_) | Kind::Prefault(..) => self.finish(idx, Ok(0)),
                Kind::Read | Kind::Write => {
                    let total = op.buf.as_ref().map_or(0, |b| b.len());
                    if res == 0 {
                        // End of file for a read; a write that makes no
                        // progress means the device is full.
                        let r = if op.kind == Kind::Read {
                            Ok(op.done)
                        } else {
                            Err(libc::ENOSPC)
                        };
                        self.finish(idx, r);
                        continue;
                    }
                    op.done += res as usize;
                    if op.done >= total {
                        let d = op.done;
                        self.finish(idx, Ok(d));
                    } else {
                        resubmit.push(idx);
                    }
                }
            }
        }
        for idx in resubmit {
            self.backlog.push_front(idx);
        }
        while let Some(&idx) = self.backlog.front() {
            if !self.push(idx) {
                break;
            }
            self.backlog.pop_front();
        }
    }
}

impl Io for UringIo {
    fn open(&mut self, path: &Path, mode: OpenMode) -> IoResult<FileId> {
        let (file, direct) = open_file(path, mode, self.direct)?;
        Ok(self.files.insert(FileEntry {
            file,
            direct,
            pending: 0,
            closing: false,
        }) as FileId)
    }

    fn is_direct(&self, f: FileId) -> bool {
        self.files.get(f as usize).is_some_and(|e| e.direct)
    }

    fn file_len(&mut self, f: FileId) -> IoResult<u64> {
        let e = self
            .files
            .get(f as usize)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EBADF))?;
        Ok(e.file.metadata()?.len())
    }

    fn close(&mut self, f: FileId) {
        if let Some(e) = self.files.get_mut(f as usize) {
            if e.pending == 0 {
                self.files.remove(f as usize);
            } else {
                e.closing = true;
            }
        }
    }

    fn read(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Read,
            file: f,
            offset,
            buf: Some(buf),
            done: 0,
        });
    }

    fn write(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Write,
            file: f,
            offset,
            buf: Some(buf),
            done: 0,
        });
    }

    fn fsync(&mut self, f: FileId, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Fsync,
            file: f,
            offset: 0,
            buf: None,
            done: 0,
        });
    }

    fn submit(&mut self) -> IoResult<()> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                // The CQ is full of unreaped completions: reap, then retry.
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                    self.drain_cq();
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>) {
        self.drain_cq();
        out.extend(self.done.drain(..));
    }

    fn wait(&mut self, timeout: Option<Duration>) -> IoResult<()> {
        self.drain_cq();
        if !self.done.is_empty() || !self.ready.is_empty() || self.in_kernel == 0 {
            return Ok(());
        }
        let r = match timeout {
            None => self.ring.submit_and_wait(1),
            Some(t) => {
                let ts = types::Timespec::from(t);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
        };
        match r {
            Ok(_) => Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    fn in_flight(&self) -> usize {
        self.ops.len() + self.done.len()
    }

    fn prefault(&mut self, addr: usize, len: usize) {
        self.enqueue(Op {
            token: 0,
            kind: Kind::Prefault(addr, len),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
        });
        // Now, not at the next poll: a writer may not poll for a while.
        let _ = self.ring.submit();
    }
}
