//! A fault-injecting wrapper: counts operations and, at a chosen one,
//! fails it (EIO, ENOSPC), tears it (a prefix reaches the disk, then the
//! "machine dies": every later operation fails and writes nothing), or
//! flips a bit in the data a read returns (silent corruption the checksums
//! must catch).

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::Duration;

use super::{FileId, Io, IoCompletion, IoResult, OpenMode};
use crate::aligned::{ALIGN, AlignedBuf};

/// What to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The chosen read fails with EIO.
    ReadEio,
    /// The chosen write fails with EIO (nothing written).
    WriteEio,
    /// The chosen write fails with ENOSPC (nothing written).
    NoSpace,
    /// The chosen fsync fails with EIO.
    FsyncEio,
    /// The chosen write reaches the disk only in part (whole 4 KiB pages,
    /// about half), then everything fails: a crash in the middle of a write.
    TornWriteCrash,
    /// The chosen read returns data with one bit flipped.
    ReadBitFlip,
}

impl Fault {
    fn applies_to(self, kind: OpKind) -> bool {
        matches!(
            (self, kind),
            (Fault::ReadEio | Fault::ReadBitFlip, OpKind::Read)
                | (
                    Fault::WriteEio | Fault::NoSpace | Fault::TornWriteCrash,
                    OpKind::Write
                )
                | (Fault::FsyncEio, OpKind::Fsync)
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Fsync,
}

/// When to inject.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultPlan {
    /// Inject at the first operation of the fault's kind after this many
    /// operations of that kind went through.
    pub after: u64,
    pub fault: Fault,
    /// Keep injecting at every later operation of that kind.
    pub sticky: bool,
}

/// Token bit marking FaultIo's own internal operations.
const INTERNAL: u64 = 1 << 63;

/// Wraps an [`Io`] and injects one planned fault.
pub struct FaultIo<I: Io> {
    inner: I,
    plan: Option<FaultPlan>,
    counts: [u64; 3],
    crashed: bool,
    /// Faults injected so far.
    pub injected: u64,
    done: VecDeque<IoCompletion>,
    /// Internal op token -> the caller's op it stands for.
    torn: HashMap<u64, (u64, AlignedBuf)>,
    next_internal: u64,
    flip_tokens: Vec<u64>,
    /// Unlinks held back (see `hold_unlinks`), in order.
    held_unlinks: Option<Vec<(std::path::PathBuf, u64)>>,
}

impl<I: Io> FaultIo<I> {
    pub fn new(inner: I, plan: Option<FaultPlan>) -> Self {
        FaultIo {
            inner,
            plan,
            counts: [0; 3],
            crashed: false,
            injected: 0,
            done: VecDeque::new(),
            torn: HashMap::new(),
            next_internal: 0,
            flip_tokens: Vec::new(),
            held_unlinks: None,
        }
    }

    /// Holds every unlink from now on (a slow file system: an unlink of a
    /// large file took 265 ms here) until `release_unlinks`.
    pub fn hold_unlinks(&mut self) {
        self.held_unlinks.get_or_insert_with(Vec::new);
    }

    /// Issues the unlinks held, and holds no more.
    pub fn release_unlinks(&mut self) {
        for (path, token) in self.held_unlinks.take().unwrap_or_default() {
            self.inner.unlink(&path, token);
        }
    }

    /// Replaces the plan and resets the counters.
    pub fn set_plan(&mut self, plan: Option<FaultPlan>) {
        self.plan = plan;
        self.counts = [0; 3];
    }

    /// True once a torn write "crashed the machine".
    pub fn crashed(&self) -> bool {
        self.crashed
    }

    /// Whether this operation gets the fault.
    fn hit(&mut self, kind: OpKind) -> Option<Fault> {
        let n = &mut self.counts[kind as usize];
        *n += 1;
        let plan = self.plan?;
        if !plan.fault.applies_to(kind) || *n <= plan.after {
            return None;
        }
        if !plan.sticky {
            self.plan = None;
        }
        self.injected += 1;
        Some(plan.fault)
    }

    fn fail(&mut self, token: u64, buf: Option<AlignedBuf>, errno: i32) {
        self.done
            .push_back(IoCompletion::local(token, buf, Err(errno)));
    }
}

impl<I: Io> Io for FaultIo<I> {
    fn open(&mut self, path: &Path, mode: OpenMode) -> IoResult<FileId> {
        if self.crashed {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.inner.open(path, mode)
    }

    fn is_direct(&self, f: FileId) -> bool {
        self.inner.is_direct(f)
    }

    fn file_len(&mut self, f: FileId) -> IoResult<u64> {
        self.inner.file_len(f)
    }

    fn close(&mut self, f: FileId) {
        self.inner.close(f)
    }

    fn read(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        if self.crashed {
            return self.fail(token, Some(buf), libc::EIO);
        }
        match self.hit(OpKind::Read) {
            Some(Fault::ReadEio) => self.fail(token, Some(buf), libc::EIO),
            Some(Fault::ReadBitFlip) => {
                self.flip_tokens.push(token);
                self.inner.read(f, offset, buf, token);
            }
            _ => self.inner.read(f, offset, buf, token),
        }
    }

    fn write(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        if self.crashed {
            return self.fail(token, Some(buf), libc::EIO);
        }
        match self.hit(OpKind::Write) {
            Some(Fault::WriteEio) => self.fail(token, Some(buf), libc::EIO),
            Some(Fault::NoSpace) => self.fail(token, Some(buf), libc::ENOSPC),
            Some(Fault::TornWriteCrash) => {
                // About half of the write, in whole pages, reaches the disk.
                let keep = (buf.len() / 2) / ALIGN * ALIGN;
                self.crashed = true;
                if keep == 0 {
                    return self.fail(token, Some(buf), libc::EIO);
                }
                let mut part = AlignedBuf::with_capacity(keep);
                part.extend_from_slice(&buf[..keep]);
                let it = INTERNAL | self.next_internal;
                self.next_internal += 1;
                self.torn.insert(it, (token, buf));
                self.inner.write(f, offset, part, it);
            }
            _ => self.inner.write(f, offset, buf, token),
        }
    }

    fn fsync(&mut self, f: FileId, token: u64) {
        if self.crashed {
            return self.fail(token, None, libc::EIO);
        }
        match self.hit(OpKind::Fsync) {
            Some(Fault::FsyncEio) => self.fail(token, None, libc::EIO),
            _ => self.inner.fsync(f, token),
        }
    }

    fn unlink(&mut self, path: &Path, token: u64) {
        if self.crashed {
            return self.fail(token, None, libc::EIO);
        }
        if let Some(held) = &mut self.held_unlinks {
            return held.push((path.to_path_buf(), token));
        }
        self.inner.unlink(path, token)
    }

    fn submit(&mut self) -> IoResult<()> {
        self.inner.submit()
    }

    fn reap(&mut self, out: &mut Vec<IoCompletion>) {
        let start = out.len();
        self.inner.reap(out);
        let mut i = start;
        while i < out.len() {
            let t = out[i].token;
            if t & INTERNAL != 0 {
                let c = out.swap_remove(i);
                if let Some((token, buf)) = self.torn.remove(&t) {
                    drop(c);
                    self.done
                        .push_back(IoCompletion::local(token, Some(buf), Err(libc::EIO)));
                }
                continue;
            }
            if let Some(p) = self.flip_tokens.iter().position(|&x| x == t) {
                self.flip_tokens.swap_remove(p);
                let result = out[i].result;
                if let (Some(b), Ok(n)) = (out[i].buf.as_mut(), result)
                    && n > 0
                {
                    let at = n / 2;
                    b[at] ^= 0x10;
                }
            }
            i += 1;
        }
        out.extend(self.done.drain(..));
    }

    fn wait(&mut self, timeout: Option<Duration>) -> IoResult<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        self.inner.wait(timeout)
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.done.len() + self.held_unlinks.as_ref().map_or(0, Vec::len)
    }

    fn poll_readable(&mut self, fd: std::os::fd::BorrowedFd<'_>, token: u64) {
        self.inner.poll_readable(fd, token);
    }

    fn take_ready(&mut self, out: &mut Vec<u64>) {
        self.inner.take_ready(out);
    }
}
