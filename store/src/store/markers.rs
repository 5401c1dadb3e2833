//! Completion markers: how a completed checkpoint is remembered.
//!
//! A checkpoint the engine completed is marked in memory at once (the
//! retention decisions use it), and an empty file `ckpt-{seq}.complete` beside
//! its manifest remembers it across restarts (without one, a manifest
//! found at open is pending; see FORMAT.md). The marker is made durable
//! here, one at a time, through the store's I/O layer: created, fsynced,
//! the directory fsynced, then (with a remote tier) uploaded. The shard
//! never blocks on it, the fault injector reaches it, and a failure is
//! reported (to whoever waits for it, see [`Store::checkpoint_notify_acked`], and as a
//! background error) and retried after the retry delay; it never leaves a
//! completed checkpoint looking pending silently.

use super::*;
use crate::manifest;

/// The completion markers not yet durable, and who waits for them.
#[derive(Default)]
pub(super) struct Markers {
    /// Manifest numbers of completed checkpoints whose marker is not
    /// durable yet, in order.
    queue: VecDeque<u64>,
    /// The first one's I/O, while it runs.
    io: Option<MarkerIo>,
    /// Markers queued and settled since open.
    queued: u64,
    settled: u64,
    /// Tokens waiting, each with `queued` as it was when it asked.
    waiters: Vec<(u64, u64)>,
}

impl Markers {
    /// Checkpoint `seq` completed: its marker is to be made durable.
    pub(super) fn push(&mut self, seq: u64) {
        self.queue.push_back(seq);
        self.queued += 1;
    }

    /// Tokens waiting for markers.
    pub(super) fn waiting(&self) -> usize {
        self.waiters.len()
    }

    /// Markers not yet durable.
    pub(super) fn outstanding(&self) -> bool {
        !self.queue.is_empty()
    }

    /// Whether the next marker can be started now.
    pub(super) fn runnable(&self) -> bool {
        self.io.is_none() && !self.queue.is_empty()
    }
}

/// The marker being made durable.
struct MarkerIo {
    seq: u64,
    /// Open while its fsync runs; `None` during the directory's fsync.
    file: Option<crate::io::FileId>,
}

impl<I: Io> Store<I> {
    /// [`Store::checkpoint_notify`], and `token` completes (with
    /// `Output::Done`) as its acknowledgement: once every marker queued so
    /// far is durable (they become durable in order), or with the error of
    /// the first that fails, whoever it is for (it is still retried), so
    /// that an acknowledged `Complete` survives a crash. At once when the
    /// notification queued no marker (an abort, a subsume, a repeated or
    /// unknown id): it waits for no one else's. Returns what
    /// `checkpoint_notify` does.
    pub fn checkpoint_notify_acked(
        &mut self,
        owner: &[u8],
        checkpoint_id: u64,
        kind: Notify,
        token: u64,
    ) -> usize {
        let before = self.ckpt.markers.queued;
        let deleted = self.checkpoint_notify(owner, checkpoint_id, kind);
        let m = &mut self.ckpt.markers;
        if m.settled >= m.queued || m.queued == before {
            self.done.push_back((token, Ok(Resolved::Done)));
        } else {
            m.waiters.push((m.queued, token));
        }
        deleted
    }

    /// The first marker in line is settled (durable, or its checkpoint
    /// deleted).
    fn marker_settled(&mut self) {
        let m = &mut self.ckpt.markers;
        m.queue.pop_front();
        m.settled += 1;
        let mut i = 0;
        while i < m.waiters.len() {
            if m.waiters[i].0 <= m.settled {
                let (_, token) = m.waiters.swap_remove(i);
                self.done.push_back((token, Ok(Resolved::Done)));
            } else {
                i += 1;
            }
        }
    }

    fn marker_failed(&mut self, e: StoreError) {
        for (_, token) in std::mem::take(&mut self.ckpt.markers.waiters) {
            self.done.push_back((token, Err(e.clone())));
        }
        self.background_failed(e);
    }

    /// Starts the next marker, unless one is in flight.
    pub(super) fn step_markers(&mut self) {
        if self.ckpt.markers.io.is_some() {
            return;
        }
        // Checkpoints deleted since they completed need none.
        while let Some(&seq) = self.ckpt.markers.queue.front() {
            if self.ckpt.holds(seq) {
                break;
            }
            self.marker_settled();
        }
        let Some(&seq) = self.ckpt.markers.queue.front() else {
            return;
        };
        let path = self.cfg.dir.join(manifest::completed_name(seq));
        // An earlier attempt may have created it before its fsync failed.
        let opened = match self.io.open(&path, OpenMode::CreateNew) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                self.io.open(&path, OpenMode::ReadWrite)
            }
            r => r,
        };
        match opened {
            Ok(f) => {
                self.ckpt.markers.io = Some(MarkerIo { seq, file: Some(f) });
                self.io.fsync(f, tag(Tag::MarkerSync, seq));
            }
            Err(e) => self.marker_failed(StoreError::io(&path, "create", &e)),
        }
    }

    /// Advances marker `seq`: its fsync, then the directory's, then its
    /// upload. A failure leaves it first in line, retried later.
    pub(super) fn marker_io_done(&mut self, t: Tag, seq: u64, r: Result<usize, i32>) {
        let Some(m) = self.ckpt.markers.io.take_if(|m| m.seq == seq) else {
            return;
        };
        if let Some(f) = m.file {
            self.io.close(f);
        }
        let name = manifest::completed_name(seq);
        let path = self.cfg.dir.join(&name);
        if let Err(errno) = r {
            let op = if t == Tag::MarkerSync {
                "fsync"
            } else {
                "fsync directory"
            };
            return self.marker_failed(StoreError::from_errno(&path, op, errno));
        }
        if t == Tag::MarkerSync {
            match self.dir_fd() {
                Ok(d) => {
                    self.ckpt.markers.io = Some(MarkerIo { seq, file: None });
                    self.io.fsync(d, tag(Tag::MarkerDirSync, seq));
                }
                Err(e) => self.marker_failed(e),
            }
            return;
        }
        debug_assert_eq!(self.ckpt.markers.queue.front(), Some(&seq));
        self.marker_settled();
        // (Deleted meanwhile: its marker file went with it.)
        if self.ckpt.holds(seq)
            && let Some(t) = self.tier.as_mut()
        {
            t.upload(&name, path);
        }
    }
}
