//! A fault-injecting wrapper: counts operations and, at a chosen one,
//! fails it (EIO, ENOSPC), tears it (a prefix reaches the disk, then the
//! "machine dies": every later operation fails and writes nothing), or
//! flips a bit in the data a read returns (silent corruption the checksums
//! must catch). Besides: fsyncs that take a while (by `crate::clock`), and
//! a power loss at drop, which undoes every write no fsync made durable
//! (writes the device acknowledged and then lost).

use std::collections::{HashMap, VecDeque};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    /// The chosen rename fails with EIO (nothing renamed).
    RenameEio,
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
                | (Fault::RenameEio, OpKind::Rename)
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Fsync,
    Rename,
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
    counts: [u64; 4],
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
    /// With [`FaultIo::lose_unsynced_writes`]: the writes to each open
    /// file that no fsync made durable yet, and those of closed files.
    unsynced: Option<HashMap<FileId, Unsynced>>,
    unsynced_closed: Vec<Unsynced>,
    /// Fsyncs in flight: their file, and how many of its unsynced writes
    /// were issued before them (those the fsync makes durable).
    syncing: HashMap<u64, (FileId, usize)>,
    /// With [`FaultIo::slow_fsyncs`]: how long an fsync takes, when each
    /// in flight may complete, and completions held until then.
    fsync_delay: Option<Duration>,
    fsync_due: HashMap<u64, Instant>,
    delayed: Vec<(Instant, IoCompletion)>,
}

/// A file's writes since its last fsync, each with what it overwrote.
struct Unsynced {
    path: PathBuf,
    /// Its inode: a file deleted (other than through this layer, which
    /// forgets its writes then) and made again under the path is another,
    /// unless the file system gave it the same inode number.
    ino: Option<u64>,
    /// (offset, the bytes it overwrote, the file's length before it).
    undo: Vec<(u64, Vec<u8>, u64)>,
}

impl Unsynced {
    /// Puts the file back as it was before these writes (a power loss),
    /// newest first. A file since deleted or renamed is left alone.
    fn undo(self) {
        use std::os::unix::fs::MetadataExt;
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(&self.path) else {
            return;
        };
        if f.metadata().ok().map(|m| m.ino()) != self.ino {
            return;
        }
        for (offset, old, len_before) in self.undo.into_iter().rev() {
            // (A test tool: a failure here leaves the file as written,
            // which is what the device would have kept anyway.)
            let _ = f.write_all_at(&old, offset);
            let _ = f.set_len(len_before);
        }
    }
}

impl<I: Io> FaultIo<I> {
    /// A read, faulted as planned; passed on as it came (a background
    /// read stays one: see `Io::read_background`).
    fn read_as(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64, background: bool) {
        if self.crashed {
            return self.fail(token, Some(buf), libc::EIO);
        }
        match self.hit(OpKind::Read) {
            Some(Fault::ReadEio) => return self.fail(token, Some(buf), libc::EIO),
            Some(Fault::ReadBitFlip) => self.flip_tokens.push(token),
            _ => {}
        }
        if background {
            self.inner.read_background(f, offset, buf, token);
        } else {
            self.inner.read(f, offset, buf, token);
        }
    }

    pub fn new(inner: I, plan: Option<FaultPlan>) -> Self {
        FaultIo {
            inner,
            plan,
            counts: [0; 4],
            crashed: false,
            injected: 0,
            done: VecDeque::new(),
            torn: HashMap::new(),
            next_internal: 0,
            flip_tokens: Vec::new(),
            held_unlinks: None,
            unsynced: None,
            unsynced_closed: Vec::new(),
            syncing: HashMap::new(),
            fsync_delay: None,
            fsync_due: HashMap::new(),
            delayed: Vec::new(),
        }
    }

    /// From now on, remembers what each write overwrote until an fsync of
    /// its file completes; when this is dropped (the machine loses power),
    /// every write not made durable so is undone.
    pub fn lose_unsynced_writes(&mut self) {
        self.unsynced.get_or_insert_with(HashMap::new);
    }

    /// Every fsync from now on completes `delay` after it was issued, by
    /// `crate::clock` (a slow disk; with a simulated clock, after that
    /// much simulated time).
    pub fn slow_fsyncs(&mut self, delay: Duration) {
        self.fsync_delay = Some(delay);
    }

    /// Notes that `len` bytes go to `f` at `offset`: what they
    /// overwrite is kept until an fsync makes them durable.
    fn journal(&mut self, f: FileId, offset: u64, len: usize) {
        let Some(files) = self.unsynced.as_mut() else {
            return;
        };
        let Some(u) = files.get_mut(&f) else {
            return;
        };
        let Ok(file) = std::fs::File::open(&u.path) else {
            return;
        };
        let len_before = file.metadata().map_or(0, |m| m.len());
        let end = (offset + len as u64).min(len_before);
        let mut old = vec![0; end.saturating_sub(offset) as usize];
        if file.read_exact_at(&mut old, offset).is_err() {
            old.clear();
        }
        u.undo.push((offset, old, len_before));
    }

    /// Completions of slow fsyncs that are due, in the order they were held.
    fn take_due(&mut self, out: &mut Vec<IoCompletion>) {
        if self.delayed.is_empty() {
            return;
        }
        let now = crate::clock::now();
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                out.push(self.delayed.remove(i).1);
            } else {
                i += 1;
            }
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
            self.forget_writes(&path);
            self.inner.unlink(&path, token);
        }
    }

    /// `path` is being deleted: its unsynced writes go with its inode (a
    /// file made again under the name is another, even if the file
    /// system gives it the same inode number).
    fn forget_writes(&mut self, path: &Path) {
        self.unsynced_closed.retain(|u| u.path != path);
        for u in self.unsynced.iter_mut().flat_map(|m| m.values_mut()) {
            if u.path == path {
                u.undo.clear();
                u.path = PathBuf::new();
            }
        }
    }

    /// Replaces the plan and resets the counters.
    pub fn set_plan(&mut self, plan: Option<FaultPlan>) {
        self.plan = plan;
        self.counts = [0; 4];
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
        let f = self.inner.open(path, mode)?;
        if let Some(files) = self.unsynced.as_mut() {
            use std::os::unix::fs::MetadataExt;
            files.insert(
                f,
                Unsynced {
                    path: path.to_path_buf(),
                    ino: std::fs::metadata(path).ok().map(|m| m.ino()),
                    undo: Vec::new(),
                },
            );
        }
        Ok(f)
    }

    fn is_direct(&self, f: FileId) -> bool {
        self.inner.is_direct(f)
    }

    fn file_len(&mut self, f: FileId) -> IoResult<u64> {
        self.inner.file_len(f)
    }

    fn close(&mut self, f: FileId) {
        // Closing makes nothing durable (and the id may be given again).
        if let Some(u) = self.unsynced.as_mut().and_then(|files| files.remove(&f))
            && !u.undo.is_empty()
        {
            self.unsynced_closed.push(u);
        }
        self.inner.close(f)
    }

    fn read(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.read_as(f, offset, buf, token, false);
    }

    fn read_background(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.read_as(f, offset, buf, token, true);
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
                self.journal(f, offset, part.len());
                self.torn.insert(it, (token, buf));
                self.inner.write(f, offset, part, it);
            }
            _ => {
                self.journal(f, offset, buf.len());
                self.inner.write(f, offset, buf, token)
            }
        }
    }

    fn fsync(&mut self, f: FileId, token: u64) {
        if self.crashed {
            return self.fail(token, None, libc::EIO);
        }
        match self.hit(OpKind::Fsync) {
            Some(Fault::FsyncEio) => self.fail(token, None, libc::EIO),
            _ => {
                if let Some(u) = self.unsynced.as_ref().and_then(|files| files.get(&f)) {
                    self.syncing.insert(token, (f, u.undo.len()));
                }
                if let Some(d) = self.fsync_delay {
                    self.fsync_due.insert(token, crate::clock::now() + d);
                }
                self.inner.fsync(f, token)
            }
        }
    }

    fn unlink(&mut self, path: &Path, token: u64) {
        if self.crashed {
            return self.fail(token, None, libc::EIO);
        }
        if let Some(held) = &mut self.held_unlinks {
            return held.push((path.to_path_buf(), token));
        }
        self.forget_writes(path);
        self.inner.unlink(path, token)
    }

    fn rename(&mut self, from: &Path, to: &Path, token: u64) {
        if self.crashed {
            return self.fail(token, None, libc::EIO);
        }
        match self.hit(OpKind::Rename) {
            Some(Fault::RenameEio) => self.fail(token, None, libc::EIO),
            _ => self.inner.rename(from, to, token),
        }
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
            if let Some(due) = self.fsync_due.remove(&t) {
                let c = out.swap_remove(i);
                self.delayed.push((due, c));
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
        self.take_due(out);
        // Fsyncs delivered now made their files' earlier writes durable.
        if !self.syncing.is_empty() {
            for c in &out[start..] {
                if let Some((f, n)) = self.syncing.remove(&c.token)
                    && c.result.is_ok()
                    && let Some(u) = self.unsynced.as_mut().and_then(|files| files.get_mut(&f))
                {
                    u.undo.drain(..n.min(u.undo.len()));
                    for (_, m) in self.syncing.values_mut().filter(|(g, _)| *g == f) {
                        *m = m.saturating_sub(n);
                    }
                }
            }
        }
    }

    fn wait(&mut self, timeout: Option<Duration>) -> IoResult<()> {
        if !self.done.is_empty() {
            return Ok(());
        }
        if let Some(due) = self.delayed.iter().map(|d| d.0).min() {
            if crate::clock::simulated() {
                // Simulated time passes only when moved: the wait is over
                // when the first held fsync is due.
                crate::clock::advance(due.saturating_duration_since(crate::clock::now()));
                return Ok(());
            }
            // A held fsync completes by the clock: look again soon.
            let t = timeout.map_or(Duration::from_millis(1), |t| {
                t.min(Duration::from_millis(1))
            });
            return self.inner.wait(Some(t));
        }
        self.inner.wait(timeout)
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
            + self.done.len()
            + self.delayed.len()
            + self.held_unlinks.as_ref().map_or(0, Vec::len)
    }

    fn poll_readable(&mut self, fd: std::os::fd::BorrowedFd<'_>, token: u64) {
        self.inner.poll_readable(fd, token);
    }

    fn take_ready(&mut self, out: &mut Vec<u64>) {
        self.inner.take_ready(out);
    }
}

impl<I: Io> Drop for FaultIo<I> {
    /// The machine loses power: with [`FaultIo::lose_unsynced_writes`],
    /// every write no fsync made durable is undone.
    fn drop(&mut self) {
        if let Some(files) = self.unsynced.take() {
            // Newest first: open files' writes, then closed files' from
            // the last closed back.
            for u in files
                .into_values()
                .chain(self.unsynced_closed.drain(..).rev())
            {
                u.undo();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::SyncIo;

    fn reap_all(io: &mut impl Io) -> Vec<IoCompletion> {
        let mut out = Vec::new();
        io.reap(&mut out);
        out
    }

    /// A power loss (the wrapper dropped) undoes the writes no fsync made
    /// durable, and keeps those one did.
    #[test]
    fn a_power_loss_undoes_what_no_fsync_made_durable() {
        let d = tempfile::tempdir().unwrap();
        let (kept, lost) = (d.path().join("kept"), d.path().join("lost"));
        let mut io = FaultIo::new(SyncIo::new(false), None);
        io.lose_unsynced_writes();
        let a = io.open(&kept, OpenMode::CreateNew).unwrap();
        let b = io.open(&lost, OpenMode::CreateNew).unwrap();
        io.write(a, 0, AlignedBuf::copy_of(&[1; 4096]), 1);
        io.write(b, 0, AlignedBuf::copy_of(&[2; 4096]), 2);
        io.fsync(a, 3);
        assert!(reap_all(&mut io).iter().all(|c| c.result.is_ok()));
        // Overwritten after its fsync: the overwrite is lost, not the file.
        io.write(a, 0, AlignedBuf::copy_of(&[3; 4096]), 4);
        io.close(a);
        reap_all(&mut io);
        assert_eq!(std::fs::read(&kept).unwrap(), [3; 4096]);
        drop(io);
        assert_eq!(std::fs::read(&kept).unwrap(), [1; 4096]);
        assert_eq!(std::fs::read(&lost).unwrap(), [0u8; 0]);
    }

    /// A file deleted through the layer takes its unsynced writes with it:
    /// the file made again under its name (often with the same inode
    /// number) keeps what its own fsync made durable.
    #[test]
    fn a_deleted_files_lost_writes_do_not_touch_its_successor() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("seg");
        let mut io = FaultIo::new(SyncIo::new(false), None);
        io.lose_unsynced_writes();
        let a = io.open(&p, OpenMode::CreateNew).unwrap();
        io.write(a, 0, AlignedBuf::copy_of(&[1; 4096]), 1);
        io.close(a);
        io.unlink(&p, 2);
        let b = io.open(&p, OpenMode::CreateNew).unwrap();
        io.write(b, 0, AlignedBuf::copy_of(&[2; 8192]), 3);
        io.fsync(b, 4);
        assert!(reap_all(&mut io).iter().all(|c| c.result.is_ok()));
        drop(io);
        assert_eq!(std::fs::read(&p).unwrap(), [2; 8192]);
    }

    /// A slow fsync completes once its delay passed on the clock.
    #[test]
    fn a_slow_fsync_completes_after_its_delay() {
        let d = tempfile::tempdir().unwrap();
        crate::clock::simulate(true);
        let mut io = FaultIo::new(SyncIo::new(false), None);
        io.slow_fsyncs(Duration::from_millis(20));
        let f = io.open(&d.path().join("f"), OpenMode::CreateNew).unwrap();
        io.fsync(f, 7);
        assert!(reap_all(&mut io).is_empty());
        assert_eq!(io.in_flight(), 1);
        crate::clock::advance(Duration::from_millis(20));
        let got = reap_all(&mut io);
        assert_eq!((got.len(), got[0].token, got[0].result), (1, 7, Ok(0)));
        crate::clock::simulate(false);
    }
}
