//! io_uring: one ring per store instance, owned by the caller's thread.
//!
//! Every operation lives in a slab slot whose index is its `user_data`; the
//! slot owns the buffer until the completion is reaped, so the kernel never
//! writes into memory we freed. Short reads and writes are continued from
//! where they stopped; `EINTR`/`EAGAIN` are resubmitted; any other error
//! fails that operation (for a read, its bytes are lost to the caller, never
//! returned as data). Operations beyond the submission queue's room wait in
//! a backlog and enter as completions free slots (bounded in-flight).
//!
//! Disk operations in the kernel are bounded too (`disk_depth`, below the
//! device's request queue): with its queue full, the block layer puts the
//! submitting thread to sleep for a free request slot, inside
//! `io_uring_enter`, even for a read io_uring issues as non-blocking
//! (`blk_mq_get_tag`, seen holding a shard 31-77 ms at once while the
//! device sat on one slow write). Ops past the bound wait here, in order,
//! in two lanes: gets' reads, and background work (writes, fsyncs, and a
//! compaction's or an export's reads: `Io::read_background`). Each lane
//! takes at most three quarters of the bound, so that neither a flush
//! nor a compaction is queued behind thousands of gets, nor gets behind
//! them.
//!
//! The ring is set up for one issuing thread whose completions wait until
//! it asks for them (`DEFER_TASKRUN`); `reap` asks, with a system call
//! only when the kernel flags some pending (`TASKRUN_FLAG`), and `submit`
//! makes none with nothing to submit. While the device is
//! busy, new entries are submitted in small batches (`holds_back`). Drop
//! waits for every op the kernel holds (cancelling doorbell polls), since
//! a read in flight still writes into its buffer.

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
    /// off this thread. One [`PREFAULT_CHUNK`] at a time, the next issued
    /// when it completes. Completes silently.
    Prefault(usize, usize),
    /// `unlinkat` of the path at this index of `UringIo::paths` (run by
    /// an io-wq worker).
    Unlink(usize),
    /// `renameat` of the path at the first index of `UringIo::paths` to
    /// the one at the second (run by an io-wq worker).
    Rename(usize, usize),
    /// One-shot readiness of a foreign fd (a client's doorbell): the
    /// caller's, not the store's; its completion goes to `ready`.
    Poll(i32),
}

/// Bytes one prefault populates at most. `MADV_POPULATE_WRITE` holds the
/// address space's lock (shared) while it faults: over a whole memtable
/// index (tens of MiB, 120 ms here) it kept the shard's next `mmap`, which
/// needs that lock exclusively, waiting for all of it (a 150-225 ms stall
/// of every request under `stator-bench serve --put-percent 100`). A chunk
/// holds it for about a millisecond.
const PREFAULT_CHUNK: usize = 4 << 20;

struct Op {
    token: u64,
    kind: Kind,
    file: FileId,
    offset: u64,
    buf: Option<AlignedBuf>,
    /// Bytes transferred so far (reads and writes continue from here).
    done: usize,
    /// A read for background work (see `UringIo::disk_room`).
    background: bool,
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
    /// Paths of unlinks and renames in flight (see `Kind::Unlink`).
    paths: Slab<std::ffi::CString>,
    /// Ops waiting for submission-queue room, in order.
    backlog: VecDeque<usize>,
    done: VecDeque<IoCompletion>,
    /// Tokens of `poll_readable` fds that became readable.
    ready: Vec<u64>,
    /// Ops pushed to the SQ and not yet completed by the kernel.
    in_kernel: usize,
    /// Of those, reads, writes and fsyncs (not doorbell polls, which may
    /// stay in the kernel indefinitely).
    disk_in_kernel: usize,
    /// Of those, reads not for background work.
    reads_in_kernel: usize,
    /// Disk ops the kernel may hold at once (see the module doc).
    disk_depth: usize,
    /// Disk ops waiting for room under `disk_depth`, each lane in order:
    /// gets' reads, and background work (writes, fsyncs, background
    /// reads).
    reads_waiting: VecDeque<usize>,
    background_waiting: VecDeque<usize>,
    /// Scratch for `drain_cq` (kept: it runs on every poll).
    cqes: Vec<(u64, i32)>,
    direct: bool,
    /// The ring is this thread's alone (single issuer): not `Send`.
    _thread: std::marker::PhantomData<*const ()>,
}

/// `IORING_ENTER_GETEVENTS`: the enter runs deferred completions.
const ENTER_GETEVENTS: u32 = 1;

/// Disk ops in the device above which new entries may wait for company
/// (see `UringIo::holds_back`).
pub const HOLD_FLOOR: usize = 16;
/// New entries submitted together while the device is busy.
pub const HOLD_BATCH: usize = 8;
/// Disk ops in the kernel at most, unless set (`UringIo::with_disk_depth`):
/// half of a common request queue (`nr_requests` 256).
pub const DISK_DEPTH: usize = 128;

impl UringIo {
    /// A ring with `entries` submission slots. `direct`: open files with
    /// O_DIRECT where the file system allows.
    ///
    /// The ring is set up as fio sets up its own: a single issuer (this
    /// thread) whose completions are handled when it asks for them
    /// (`DEFER_TASKRUN`), not by interrupting it as each read finishes.
    /// The kernel flags pending completions in the SQ ring
    /// (`TASKRUN_FLAG`), so asking costs a system call only when there is
    /// something to run. On a kernel without these (before 6.1), with
    /// `COOP_TASKRUN` only.
    pub fn new(entries: u32, direct: bool) -> IoResult<UringIo> {
        let ring = match IoUring::builder()
            .setup_coop_taskrun()
            .setup_taskrun_flag()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(entries)
        {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                IoUring::builder().setup_coop_taskrun().build(entries)?
            }
            Err(e) => return Err(e),
        };
        Ok(UringIo {
            ring,
            files: Slab::new(),
            ops: Slab::new(),
            paths: Slab::new(),
            backlog: VecDeque::new(),
            done: VecDeque::new(),
            ready: Vec::new(),
            in_kernel: 0,
            disk_in_kernel: 0,
            reads_in_kernel: 0,
            disk_depth: DISK_DEPTH,
            reads_waiting: VecDeque::new(),
            background_waiting: VecDeque::new(),
            cqes: Vec::new(),
            direct,
            _thread: std::marker::PhantomData,
        })
    }

    /// Bounds the disk ops the kernel holds at once to `depth` (at least
    /// 4; see the module doc): below the device's request queue, shared
    /// by every ring on it.
    pub fn with_disk_depth(mut self, depth: usize) -> UringIo {
        self.disk_depth = depth.max(4);
        self
    }

    /// Whether the kernel holds completions for us: deferred ones
    /// (`IORING_SQ_TASKRUN`) or ones that overflowed the CQ.
    fn kernel_has_completions(&mut self) -> bool {
        let sq = self.ring.submission();
        sq.taskrun() || sq.cq_overflow()
    }

    /// Moves completions the kernel holds for this thread into the CQ,
    /// submitting nothing: held entries stay in the SQ (see `holds_back`).
    /// No system call when it holds none.
    fn run_deferred(&mut self) {
        if self.kernel_has_completions() {
            // SAFETY: no argument pointer is passed and nothing is
            // submitted.
            let _ = unsafe {
                self.ring
                    .submitter()
                    .enter::<libc::sigset_t>(0, 0, ENTER_GETEVENTS, None)
            };
        }
    }

    fn enqueue(&mut self, op: Op) {
        if let Some(f) = self.files.get_mut(op.file as usize) {
            f.pending += 1;
        }
        let lane = Lane::of(&op);
        let idx = self.ops.insert(op);
        // Behind the ones of its lane already waiting, in order.
        if !self.queue(lane).is_empty() || !self.push(idx) {
            self.wait_for_room(idx, false);
        }
    }

    /// Queues op `idx` until it can be pushed: `first` for one continued
    /// (a short or interrupted transfer), which goes ahead of the rest.
    fn wait_for_room(&mut self, idx: usize, first: bool) {
        let lane = Lane::of(&self.ops[idx]);
        let q = self.queue(lane);
        if first {
            q.push_front(idx);
        } else {
            q.push_back(idx);
        }
    }

    /// Whether a disk op in `lane` may enter the kernel now: under
    /// `disk_depth`, each lane at most three quarters of it, so that the
    /// other always has a quarter (the drain refills background work
    /// first; gets must not starve behind a compaction and a flush).
    fn disk_room(&self, lane: Lane) -> bool {
        let lane_max = self.disk_depth - self.disk_depth / 4;
        let background = self.disk_in_kernel - self.reads_in_kernel;
        self.disk_in_kernel < self.disk_depth
            && match lane {
                Lane::Gets => self.reads_in_kernel < lane_max,
                Lane::Background => background < lane_max,
                Lane::Other => true,
            }
    }

    /// Pushes op `idx` (its remaining part) to the SQ; false when full.
    fn push(&mut self, idx: usize) -> bool {
        let op = &mut self.ops[idx];
        if let Kind::Prefault(addr, len) = op.kind {
            let entry = opcode::Madvise::new(
                addr as *const libc::c_void,
                len.min(PREFAULT_CHUNK) as libc::off_t,
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
        if let Kind::Unlink(i) = op.kind {
            let entry = opcode::UnlinkAt::new(types::Fd(libc::AT_FDCWD), self.paths[i].as_ptr())
                .build()
                .user_data(idx as u64);
            // SAFETY: the path is owned by `paths[i]` until the op's
            // completion is reaped (`finish` removes it only then).
            let pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
            self.in_kernel += pushed as usize;
            return pushed;
        }
        if let Kind::Rename(from, to) = op.kind {
            let cwd = types::Fd(libc::AT_FDCWD);
            let entry =
                opcode::RenameAt::new(cwd, self.paths[from].as_ptr(), cwd, self.paths[to].as_ptr())
                    .build()
                    .user_data(idx as u64);
            // SAFETY: both paths are owned by `paths` until the op's
            // completion is reaped (`finish` removes them only then).
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
        let (lane, file) = (Lane::of(op), op.file);
        if !self.disk_room(lane) {
            return false;
        }
        let Some(fe) = self.files.get(file as usize) else {
            let op = self.ops.remove(idx);
            self.done
                .push_back(IoCompletion::local(op.token, op.buf, Err(libc::EBADF)));
            return true;
        };
        let fd = types::Fd(fe.file.as_raw_fd());
        let op = &mut self.ops[idx];
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
            Kind::Poll(_) | Kind::Prefault(..) | Kind::Unlink(_) | Kind::Rename(..) => {
                unreachable!("pushed above")
            }
        }
        .user_data(idx as u64);
        // SAFETY: the entry's buffer pointer is owned by `ops[idx]` and
        // stays valid and unaliased until its completion is reaped (the slot
        // is removed only then); the fd is kept open while `pending > 0`.
        let pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
        if pushed {
            self.in_kernel += 1;
            self.disk_in_kernel += 1;
            self.reads_in_kernel += (lane == Lane::Gets) as usize;
        }
        pushed
    }

    fn finish(&mut self, idx: usize, result: Result<usize, i32>) {
        let op = self.ops.remove(idx);
        match op.kind {
            // Readable, or an error on the fd: either way its owner looks.
            Kind::Poll(_) => return self.ready.push(op.token),
            // A hint; its outcome does not matter. The rest of the range
            // follows, once this chunk's hold of the address space is over.
            Kind::Prefault(addr, len) => {
                if len > PREFAULT_CHUNK {
                    self.enqueue(Op {
                        kind: Kind::Prefault(addr + PREFAULT_CHUNK, len - PREFAULT_CHUNK),
                        ..op
                    });
                }
                return;
            }
            Kind::Unlink(i) => {
                self.paths.remove(i);
            }
            Kind::Rename(from, to) => {
                self.paths.remove(from);
                self.paths.remove(to);
            }
            Kind::Read | Kind::Write | Kind::Fsync => {}
        }
        if let Some(f) = self.files.get_mut(op.file as usize) {
            f.pending -= 1;
            if f.closing && f.pending == 0 {
                self.files.remove(op.file as usize);
            }
        }
        self.done
            .push_back(IoCompletion::local(op.token, op.buf, result));
    }

    /// Whether `submit` leaves the SQ's entries for a later one: while the
    /// device already has [`HOLD_FLOOR`] disk ops and fewer than
    /// [`HOLD_BATCH`] new entries wait. Each submission that reaches the
    /// device costs a doorbell write (a VM exit on a virtual disk); one
    /// per read, as a shard refilling slot by slot makes, measured ~15%
    /// fewer random reads/s at depth 32 here than batches of 6-8 (fio
    /// batches the same way). Held entries go in at the next `submit`
    /// that finds the device below the floor or the batch full, or at the
    /// next `wait` (a thread never sleeps on held work).
    fn holds_back(&mut self) -> bool {
        let queued = self.ring.submission().len();
        queued > 0
            && queued < HOLD_BATCH
            && self.disk_in_kernel.saturating_sub(queued) >= HOLD_FLOOR
    }

    /// Drains the CQ into `done`, continuing short and interrupted ops.
    fn drain_cq(&mut self) {
        // With deferred completions nothing reaches the CQ until we ask.
        self.run_deferred();
        let mut resubmit = Vec::new();
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &cqes {
            self.in_kernel -= 1;
            let idx = ud as usize;
            let Some(op) = self.ops.get_mut(idx) else {
                continue;
            };
            if matches!(op.kind, Kind::Read | Kind::Write | Kind::Fsync) {
                self.disk_in_kernel -= 1;
            }
            if Lane::of(op) == Lane::Gets {
                self.reads_in_kernel -= 1;
            }
            if res == -libc::EINTR || res == -libc::EAGAIN {
                resubmit.push(idx);
                continue;
            }
            if res < 0 {
                self.finish(idx, Err(-res));
                continue;
            }
            match op.kind {
                Kind::Fsync
                | Kind::Poll(_)
                | Kind::Prefault(..)
                | Kind::Unlink(_)
                | Kind::Rename(..) => self.finish(idx, Ok(0)),
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
        cqes.clear();
        self.cqes = cqes;
        // (In reverse: each goes to the front of its queue.)
        for &idx in resubmit.iter().rev() {
            self.wait_for_room(idx, true);
        }
        // Doorbell polls and the like first: a sleep relies on them.
        for q in [Lane::Other, Lane::Background, Lane::Gets] {
            while let Some(&idx) = self.queue(q).front() {
                if !self.push(idx) {
                    break;
                }
                self.queue(q).pop_front();
            }
        }
    }

    /// Drops every op not yet in the kernel from its queue (their slots
    /// stay, holding their buffers, until the ring is dropped).
    fn forget_waiting(&mut self) {
        self.backlog.clear();
        self.reads_waiting.clear();
        self.background_waiting.clear();
    }

    /// Where ops of `lane` wait before they enter the kernel.
    fn queue(&mut self, lane: Lane) -> &mut VecDeque<usize> {
        match lane {
            Lane::Other => &mut self.backlog,
            Lane::Background => &mut self.background_waiting,
            Lane::Gets => &mut self.reads_waiting,
        }
    }
}

/// Which queue an op waits in before it enters the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    /// Not a disk op (doorbell polls, unlinks, ...): waits only for room
    /// in the submission queue.
    Other,
    /// Writes, fsyncs and background reads: bounded by three quarters of
    /// `disk_depth`.
    Background,
    /// Other reads (gets'): bounded by three quarters of `disk_depth`.
    Gets,
}

impl Lane {
    fn of(op: &Op) -> Lane {
        match op.kind {
            Kind::Read if !op.background => Lane::Gets,
            Kind::Read | Kind::Write | Kind::Fsync => Lane::Background,
            Kind::Prefault(..) | Kind::Unlink(_) | Kind::Rename(..) | Kind::Poll(_) => Lane::Other,
        }
    }
}

/// `user_data` of the cancellations `Drop` sends (no op slot has it).
const CANCEL_TAG: u64 = u64::MAX;

impl Drop for UringIo {
    /// Waits until the kernel is done with every buffer it was given: a
    /// read still in flight writes into its buffer when the device answers,
    /// even after the ring's fd is closed, so freeing the buffers first
    /// would let the device write into memory the allocator has handed out
    /// again. Doorbell polls, which may never fire, are cancelled; disk
    /// ops are left to finish. If the kernel does not answer within 30 s,
    /// the buffers are leaked rather than freed under it.
    fn drop(&mut self) {
        self.forget_waiting();
        let _ = self.ring.submit();
        self.drain_cq();
        self.forget_waiting();
        let polls: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, op)| matches!(op.kind, Kind::Poll(_)))
            .map(|(i, _)| i as u64)
            .collect();
        for ud in polls {
            let e = opcode::AsyncCancel::new(ud).build().user_data(CANCEL_TAG);
            loop {
                // SAFETY: a cancellation references no memory of ours.
                if unsafe { self.ring.submission().push(&e) }.is_ok() {
                    self.in_kernel += 1;
                    break;
                }
                if self.ring.submit().is_err() {
                    break;
                }
            }
        }
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        while self.in_kernel > 0 && std::time::Instant::now() < give_up {
            let ts = types::Timespec::from(Duration::from_millis(100));
            let args = types::SubmitArgs::new().timespec(&ts);
            let _ = self.ring.submitter().submit_with_args(1, &args);
            self.drain_cq();
            // Short reads are not continued now.
            self.forget_waiting();
        }
        if self.in_kernel > 0 {
            // A hung device: a bounded leak, never a use after free.
            std::mem::forget(std::mem::take(&mut self.ops));
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
            background: false,
        });
    }

    fn read_background(&mut self, f: FileId, offset: u64, buf: AlignedBuf, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Read,
            file: f,
            offset,
            buf: Some(buf),
            done: 0,
            background: true,
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
            background: false,
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
            background: false,
        });
    }

    fn unlink(&mut self, path: &Path, token: u64) {
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
            return self
                .done
                .push_back(IoCompletion::local(token, None, Err(libc::EINVAL)));
        };
        let i = self.paths.insert(c);
        self.enqueue(Op {
            token,
            kind: Kind::Unlink(i),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
            background: false,
        });
    }

    fn rename(&mut self, from: &Path, to: &Path, token: u64) {
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).ok();
        let (Some(from), Some(to)) = (c(from), c(to)) else {
            return self
                .done
                .push_back(IoCompletion::local(token, None, Err(libc::EINVAL)));
        };
        let (from, to) = (self.paths.insert(from), self.paths.insert(to));
        self.enqueue(Op {
            token,
            kind: Kind::Rename(from, to),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
            background: false,
        });
    }

    fn submit(&mut self) -> IoResult<()> {
        // Nothing to submit and nothing to run: no system call (a shard
        // polls its store on every pass, most of them in memory).
        let queued = self.ring.submission().len();
        if (queued == 0 && !self.kernel_has_completions()) || self.holds_back() {
            return Ok(());
        }
        loop {
            // Also runs deferred completions when flagged (the crate adds
            // GETEVENTS then), so a `reap` right after sees them.
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
            // Entries `submit` held back for company go now: a caller that
            // waits for one of them (a restore's footer read) and keeps
            // finding a doorbell's readiness here would spin forever.
            if !self.ring.submission().is_empty() {
                // (A failure, say EBUSY with the CQ full, is `submit`'s to
                // handle on the next call.)
                let _ = self.ring.submit();
            }
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

    fn poll_readable(&mut self, fd: std::os::fd::BorrowedFd<'_>, token: u64) {
        self.enqueue(Op {
            token,
            kind: Kind::Poll(fd.as_raw_fd()),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
            background: false,
        });
    }

    fn take_ready(&mut self, out: &mut Vec<u64>) {
        self.drain_cq();
        out.append(&mut self.ready);
    }

    fn prefault(&mut self, addr: usize, len: usize) {
        self.enqueue(Op {
            token: 0,
            kind: Kind::Prefault(addr, len),
            file: FileId::MAX,
            offset: 0,
            buf: None,
            done: 0,
            background: false,
        });
        // Now, not at the next poll: a writer may not poll for a while.
        let _ = self.ring.submit();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::Instant;

    /// A file of `pages` pages, page `i` filled with byte `i as u8`.
    fn file(pages: usize) -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let mut v = Vec::with_capacity(pages * 4096);
        for i in 0..pages {
            v.extend(std::iter::repeat_n(i as u8, 4096));
        }
        std::fs::write(&p, v).unwrap();
        (d, p)
    }

    fn collect(io: &mut UringIo, want: usize, wait: bool) -> Vec<IoCompletion> {
        let mut out = Vec::new();
        let end = Instant::now() + Duration::from_secs(20);
        while out.len() < want {
            assert!(Instant::now() < end, "{} of {want} completed", out.len());
            io.submit().unwrap();
            io.reap(&mut out);
            if wait && out.len() < want {
                io.wait(Some(Duration::from_millis(10))).unwrap();
            }
        }
        out
    }

    #[test]
    fn reads_submitted_one_at_a_time_past_the_hold_floor_all_complete() {
        let (_d, p) = file(64);
        let mut io = UringIo::new(256, true).unwrap();
        let f = io.open(&p, OpenMode::Read).unwrap();
        // One read per submit, as a shard refilling slot by slot: past
        // HOLD_FLOOR in the device, some wait in the SQ for company.
        let n = HOLD_FLOOR + HOLD_BATCH + 3;
        for i in 0..n {
            io.read(f, i as u64 * 4096, AlignedBuf::zeroed(4096), i as u64);
            io.submit().unwrap();
        }
        let mut got = collect(&mut io, n, true);
        got.sort_by_key(|c| c.token);
        for (i, c) in got.iter().enumerate() {
            assert_eq!((c.token, c.result), (i as u64, Ok(4096)));
            let b = c.buf.as_ref().unwrap();
            assert!(b.iter().all(|&x| x == i as u8), "page {i}");
        }
        assert_eq!(io.in_flight(), 0);
    }

    /// Issue 25: with thousands of reads in the kernel the device's
    /// request queue filled, and the block layer put the shard thread to
    /// sleep inside `io_uring_enter` until a slot freed. The kernel now
    /// holds at most `disk_depth` disk ops, gets' reads at most three
    /// quarters of them: a compaction's read and a write enqueued behind
    /// many gets go in at once, the rest wait their turn, and all
    /// complete with their data.
    #[test]
    fn disk_ops_in_the_kernel_are_bounded_and_writes_keep_a_share() {
        let (_d, p) = file(64);
        let mut io = UringIo::new(256, true).unwrap().with_disk_depth(8);
        let f = io.open(&p, OpenMode::Read).unwrap();
        let n = 64;
        for i in 0..n {
            io.read(f, i as u64 * 4096, AlignedBuf::zeroed(4096), i as u64);
        }
        assert_eq!((io.reads_in_kernel, io.disk_in_kernel), (6, 6));
        assert_eq!(io.reads_waiting.len(), n - 6);
        let w = io
            .open(&p.with_file_name("w"), OpenMode::CreateNew)
            .unwrap();
        let mut page = AlignedBuf::zeroed(4096);
        page.fill(0xab);
        io.read_background(f, 5 * 4096, AlignedBuf::zeroed(4096), 1005);
        io.write(w, 0, page, 1000);
        assert_eq!(
            io.disk_in_kernel, 8,
            "the background read and the write go in at once"
        );
        io.fsync(w, 1001);
        assert_eq!(
            io.background_waiting.len(),
            1,
            "past the bound, the fsync waits"
        );
        let mut got = Vec::new();
        let end = Instant::now() + Duration::from_secs(20);
        while got.len() < n + 3 {
            assert!(Instant::now() < end, "{} of {} completed", got.len(), n + 3);
            io.submit().unwrap();
            io.reap(&mut got);
            assert!(io.disk_in_kernel <= 8 && io.reads_in_kernel <= 6);
            io.wait(Some(Duration::from_millis(10))).unwrap();
        }
        let mut reads: Vec<u64> = got.iter().map(|c| c.token).filter(|&t| t < 1000).collect();
        reads.sort_unstable();
        assert_eq!(reads, (0..n as u64).collect::<Vec<_>>());
        for c in &got {
            assert!(c.result.is_ok(), "{:?}", c.result);
            let page = match c.token {
                t if t < 1000 => t as u8,
                1005 => 5,
                _ => continue,
            };
            assert!(c.buf.as_ref().unwrap().iter().all(|&x| x == page));
        }
        assert_eq!(io.in_flight(), 0);
    }

    /// The other way round: background work enqueued first (a compaction's
    /// reads) leaves the gets a quarter of the bound.
    #[test]
    fn background_work_leaves_gets_a_share() {
        let (_d, p) = file(32);
        let mut io = UringIo::new(256, true).unwrap().with_disk_depth(8);
        let f = io.open(&p, OpenMode::Read).unwrap();
        for i in 0..16u64 {
            io.read_background(f, i * 4096, AlignedBuf::zeroed(4096), 100 + i);
        }
        for i in 0..4u64 {
            io.read(f, i * 4096, AlignedBuf::zeroed(4096), i);
        }
        assert_eq!((io.disk_in_kernel, io.reads_in_kernel), (8, 2));
        let got = collect(&mut io, 20, true);
        assert!(got.iter().all(|c| c.result == Ok(4096)));
        assert_eq!(io.in_flight(), 0);
    }

    #[test]
    fn completions_are_reaped_without_waiting() {
        // With deferred completions nothing reaches the CQ unless the
        // thread asks; `reap` alone must ask.
        let (_d, p) = file(4);
        let mut io = UringIo::new(64, true).unwrap();
        let f = io.open(&p, OpenMode::Read).unwrap();
        io.read(f, 4096, AlignedBuf::zeroed(4096), 7);
        let got = collect(&mut io, 1, false);
        assert_eq!((got[0].token, got[0].result), (7, Ok(4096)));
    }

    #[test]
    fn dropping_a_ring_waits_for_its_reads_and_cancels_its_polls() {
        let (_d, p) = file(256);
        let bell = nix::sys::eventfd::EventFd::new().unwrap();
        let mut io = UringIo::new(512, true).unwrap();
        let f = io.open(&p, OpenMode::Read).unwrap();
        // A doorbell that never rings: drop must not wait for it.
        io.poll_readable(bell.as_fd(), 1);
        for i in 0..256u64 {
            io.read(f, i * 4096, AlignedBuf::zeroed(4096), i);
        }
        io.submit().unwrap();
        let t = Instant::now();
        drop(io);
        assert!(t.elapsed() < Duration::from_secs(25), "drop hung");
        // The buffers were freed only after the kernel was done with
        // them; allocate and check fresh memory is not written under us.
        let bufs: Vec<AlignedBuf> = (0..256).map(|_| AlignedBuf::zeroed(4096)).collect();
        std::thread::sleep(Duration::from_millis(50));
        assert!(bufs.iter().all(|b| b.iter().all(|&x| x == 0)));
    }

    /// An unlink runs in the kernel and completes with its token: the
    /// file is gone after it, and a missing file's errno comes back.
    #[test]
    fn an_unlink_completes_with_its_result() {
        let (_d, p) = file(1);
        let mut io = UringIo::new(8, false).unwrap();
        io.unlink(&p, 7);
        io.unlink(&p.with_extension("missing"), 8);
        let mut got = collect(&mut io, 2, true);
        got.sort_by_key(|c| c.token);
        assert_eq!((got[0].token, got[0].result), (7, Ok(0)));
        assert_eq!((got[1].token, got[1].result), (8, Err(libc::ENOENT)));
        assert!(!p.exists(), "the file is still there");
        assert_eq!(io.in_flight(), 0);
    }

    /// A rename runs in the kernel and completes with its token: the file
    /// is under its new name after it (replacing what was there), and a
    /// missing file's errno comes back.
    #[test]
    fn a_rename_completes_with_its_result() {
        let (_d, p) = file(1);
        let to = p.with_extension("renamed");
        std::fs::write(&to, b"replaced").unwrap();
        let mut io = UringIo::new(8, false).unwrap();
        io.rename(&p, &to, 7);
        io.rename(&p.with_extension("missing"), &to, 8);
        let mut got = collect(&mut io, 2, true);
        got.sort_by_key(|c| c.token);
        assert_eq!((got[0].token, got[0].result), (7, Ok(0)));
        assert_eq!((got[1].token, got[1].result), (8, Err(libc::ENOENT)));
        assert!(!p.exists());
        assert_eq!(std::fs::metadata(&to).unwrap().len(), 4096);
        assert_eq!(io.in_flight(), 0);
    }

    /// A prefault of several chunks populates every page of its range,
    /// one chunk after the other (the last one partial).
    #[test]
    fn a_prefault_of_many_chunks_populates_the_whole_range() {
        let len = 3 * PREFAULT_CHUNK + 8192;
        let mut v: Vec<u8> = Vec::with_capacity(len + 4096);
        // (madvise takes page-aligned addresses.)
        let addr = (v.as_mut_ptr() as usize).next_multiple_of(4096);
        let mut io = UringIo::new(8, false).unwrap();
        io.prefault(addr, len);
        let end = Instant::now() + Duration::from_secs(20);
        while io.in_flight() > 0 {
            assert!(Instant::now() < end, "the prefault never finished");
            io.submit().unwrap();
            io.reap(&mut Vec::new());
            io.wait(Some(Duration::from_millis(10))).unwrap();
        }
        let mut resident = vec![0u8; len / 4096];
        // SAFETY: `mincore` writes one byte per page of the range into a
        // vector of at least that many bytes; the range is `v`'s own.
        let r = unsafe { libc::mincore(addr as *mut libc::c_void, len, resident.as_mut_ptr()) };
        assert_eq!(r, 0);
        let n = resident.len();
        let missing: Vec<usize> = (0..n).filter(|&i| resident[i] & 1 == 0).collect();
        assert!(
            missing.is_empty(),
            "{} of {n} pages left out, first {:?}",
            missing.len(),
            &missing[..missing.len().min(4)]
        );
        // (`v` is still allocated here.)
        v.push(0);
    }

    /// A read `submit` held back (the device busy) still goes in when the
    /// caller waits, even while a doorbell's readiness makes every wait
    /// return at once (a restore's footer read spun forever that way).
    #[test]
    fn a_held_back_read_is_submitted_by_a_wait_that_returns_at_once() {
        let (_d, p) = file(4);
        let mut io = UringIo::new(64, false).unwrap();
        let f = io.open(&p, OpenMode::Read).unwrap();
        // The device as busy as `holds_back` needs, and a readiness pending.
        io.disk_in_kernel += HOLD_FLOOR;
        io.ready.push(7);
        io.read(f, 4096, AlignedBuf::zeroed(4096), 1);
        io.submit().unwrap();
        assert!(io.holds_back() || io.ring.submission().is_empty());
        let mut out = Vec::new();
        let end = Instant::now() + Duration::from_secs(10);
        while out.is_empty() {
            assert!(Instant::now() < end, "the held-back read never went in");
            io.wait(Some(Duration::from_millis(10))).unwrap();
            io.reap(&mut out);
        }
        io.disk_in_kernel -= HOLD_FLOOR;
        assert_eq!(out[0].result, Ok(4096));
        assert_eq!(out[0].buf.as_ref().unwrap()[0], 1);
    }
}
