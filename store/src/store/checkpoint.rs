//! Checkpoints are metadata, restores are references.
//!
//! A checkpoint has a synchronous part (`Store::checkpoint`: freeze the
//! memtable, pin the segments that hold the owner's key groups; flat in
//! state size) and an asynchronous part driven by `poll` (wait for the
//! frozen memtables to be flushed, write the manifest, fsync it and the
//! directory) whose cost grows with what was written since the previous
//! checkpoint. It completes with a [`Handle`](crate::manifest::Handle).
//!
//! A segment file is deleted only when no live layer and no retained or
//! in-progress checkpoint names it: manifests pin their files, and
//! notifications (complete, abort, subsume) and the retention count decide
//! which manifests stay.
//!
//! A restore masks the owner's states in the session's key groups in every
//! existing layer, then adds the manifests' segments as new layers, each
//! clipped to what the checkpoint held of that range. Nothing is copied;
//! compaction later rewrites only the clipped-in records.

use super::*;
use crate::manifest::{self, Handle, LayerRef, Manifest, intersect, state_set};

/// Checkpoints of one owner's key-group range (one engine subtask) that may
/// be in progress or retained without a completion at once: each pins
/// segments, so a client that never completes or aborts is refused
/// (`StoreError::Limit`) rather than filling the disk. Counted per range, not
/// per owner: every subtask of an operator checkpoints at each barrier, and
/// a host may run more than this many of them.
pub const MAX_UNCOMPLETED: usize = 64;

/// What to checkpoint.
#[derive(Clone, Debug)]
pub struct CheckpointSpec {
    /// Whose state (the daemon: job and operator). Restores must match it.
    pub owner: Vec<u8>,
    pub checkpoint_id: u64,
    /// Key groups `lo..=hi`.
    pub lo: u16,
    pub hi: u16,
    /// The owner's state ids.
    pub states: Vec<u32>,
    /// Kept in the manifest, returned by a restore (opaque to the store).
    pub meta: Vec<u8>,
}

/// What to restore into.
#[derive(Clone, Copy, Debug)]
pub struct RestoreSpec<'a> {
    pub owner: &'a [u8],
    pub lo: u16,
    pub hi: u16,
    /// Every state id of the owner now: their records in `lo..=hi` are
    /// replaced by the checkpointed ones.
    pub states: &'a [u32],
}

/// A manifest a restore used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoredManifest {
    pub checkpoint_id: u64,
    pub lo: u16,
    pub hi: u16,
    pub states: Vec<u32>,
    pub meta: Vec<u8>,
}

/// What a restore did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restored {
    pub manifests: Vec<RestoredManifest>,
    /// Segment references added (no byte copied).
    pub layers: usize,
}

/// A checkpoint notification from the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notify {
    Complete,
    Abort,
    Subsume,
}

/// What [`Store::release_checkpoints`] did.
#[derive(Debug, Default)]
pub struct Released {
    /// How many retained checkpoints it deleted.
    pub count: usize,
    /// Their manifests' files, whose unlinks are in flight.
    pub unlinking: Vec<PathBuf>,
}

/// A retained checkpoint, as operators see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// Manifest number (its file name).
    pub seq: u64,
    /// Whose state (the daemon: `job \0 operator`).
    pub owner: Vec<u8>,
    pub checkpoint_id: u64,
    /// Key groups `lo..=hi`.
    pub lo: u16,
    pub hi: u16,
    /// The handle a restore presents.
    pub handle: [u8; manifest::HANDLE_LEN],
    /// Segment files it names (and keeps).
    pub segments: usize,
    /// The engine said it completed.
    pub completed: bool,
}

/// A retained manifest.
struct Retained {
    /// As written: restores and exports read it here, not from the disk.
    m: Rc<Manifest>,
    crc: u32,
    /// Completed (the engine said so; remembered in a marker file).
    completed: bool,
}

impl Retained {
    /// The segment files it names.
    fn files(&self) -> impl Iterator<Item = &String> {
        self.m.layers.iter().map(|l| &l.name)
    }
}

/// Which of a checkpoint manifest's I/O operations completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ManifestIo {
    Write,
    Sync,
    DirSync,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for frozen memtables to become segments.
    Flushing,
    /// With a remote tier: waiting for its segments to be durable there.
    Uploading,
    Writing,
    Syncing,
    DirSync,
    /// With a remote tier: the manifest (durable locally) is uploading.
    Publishing,
}

/// A checkpoint between its synchronous part and its completion.
struct Pending {
    token: u64,
    manifest: Manifest,
    /// Captured layers (pinned), with their orders.
    layers: Vec<(u64, LayerRef)>,
    /// Frozen memtables still to be flushed: their orders and clips.
    waiting: Vec<(u64, Clip)>,
    phase: Phase,
    file: Option<crate::io::FileId>,
    handle: [u8; manifest::HANDLE_LEN],
    crc: u32,
}

/// The store's checkpoint state.
#[derive(Default)]
pub(super) struct Checkpoints {
    retained: BTreeMap<u64, Retained>,
    /// What the retained manifests hold in memory.
    retained_bytes: usize,
    /// Segment file name -> retained and in-progress checkpoints naming it.
    pins: HashMap<String, u32>,
    next_seq: u64,
    pending: Slab<Pending>,
    /// Completion markers not yet durable (`markers.rs`).
    pub(super) markers: super::markers::Markers,
}

impl Checkpoints {
    /// Reads every manifest in `dir`; a torn or corrupt one (never
    /// acknowledged: a handle is returned only after its fsync) is set
    /// aside as `*.torn` and reported.
    pub(super) fn load(dir: &Path, report: &mut RecoveryReport) -> Result<Checkpoints, StoreError> {
        let mut c = Checkpoints {
            next_seq: 1,
            ..Default::default()
        };
        let dir_err = |e: std::io::Error| StoreError::Dir {
            path: dir.display().to_string(),
            msg: e.to_string(),
        };
        for e in std::fs::read_dir(dir).map_err(dir_err)? {
            let e = e.map_err(dir_err)?;
            let name = e.file_name().to_string_lossy().to_string();
            // One set aside at an earlier open keeps its number: a number
            // is never given to a second manifest (a handle names one by
            // number and checksum).
            if let Some(seq) = name
                .strip_suffix(".torn")
                .and_then(manifest::parse_file_name)
            {
                c.next_seq = c.next_seq.max(seq + 1);
                continue;
            }
            let Some(seq) = manifest::parse_file_name(&name) else {
                continue;
            };
            let path = e.path();
            let bytes = std::fs::read(&path).map_err(|e| StoreError::io(&path, "read", &e))?;
            match Manifest::decode(&bytes) {
                Ok((m, crc)) if m.seq == seq => {
                    c.next_seq = c.next_seq.max(seq + 1);
                    c.add(
                        seq,
                        Retained {
                            m: Rc::new(m),
                            crc,
                            completed: dir.join(manifest::completed_name(seq)).exists(),
                        },
                    );
                }
                r => {
                    let why = match r {
                        Err(m) => m.0,
                        Ok(_) => "manifest number differs from its file name",
                    };
                    c.next_seq = c.next_seq.max(seq + 1);
                    let torn = path.with_extension("manifest.torn");
                    if report.rename(&path, &torn) {
                        report.torn.push((torn, why.to_string()));
                    } else {
                        report.torn.push((path, why.to_string()));
                    }
                }
            }
        }
        // A marker whose manifest is gone (a crash between the two
        // deletes) must not mark a later manifest of that number.
        for e in std::fs::read_dir(dir).map_err(dir_err)?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(seq) = name
                .strip_suffix(".complete")
                .and_then(|n| manifest::parse_file_name(&format!("{n}.manifest")))
                && !c.retained.contains_key(&seq)
                && let Err(err) = std::fs::remove_file(e.path())
                && err.kind() != std::io::ErrorKind::NotFound
            {
                // Left, it would mark the next manifest of that number
                // completed before it is.
                return Err(StoreError::from_errno(
                    &e.path(),
                    "unlink of a stale checkpoint marker",
                    err.raw_os_error().unwrap_or(libc::EIO),
                ));
            }
        }
        report.manifests = c.retained.len();
        Ok(c)
    }

    /// Whether manifest `seq` is retained.
    pub(super) fn holds(&self, seq: u64) -> bool {
        self.retained.contains_key(&seq)
    }

    fn add(&mut self, seq: u64, r: Retained) {
        for f in r.files() {
            *self.pins.entry(f.clone()).or_default() += 1;
        }
        self.retain(seq, r);
    }

    /// Keeps `r` (its files pinned already).
    fn retain(&mut self, seq: u64, r: Retained) {
        self.retained_bytes += r.m.memory_bytes();
        if let Some(old) = self.retained.insert(seq, r) {
            self.retained_bytes -= old.m.memory_bytes();
        }
    }

    /// Stops keeping manifest `seq` (its files still pinned).
    fn unretain(&mut self, seq: u64) -> Option<Retained> {
        let r = self.retained.remove(&seq)?;
        self.retained_bytes -= r.m.memory_bytes();
        Some(r)
    }

    /// What manifests hold in memory: retained ones and those being
    /// written.
    pub(super) fn memory_bytes(&self) -> usize {
        self.retained_bytes
            + self
                .pending
                .iter()
                .map(|(_, p)| {
                    // Its layers, gathered apart until the manifest is
                    // written (then moved into it).
                    p.manifest.memory_bytes()
                        + p.layers.capacity() * std::mem::size_of::<(u64, LayerRef)>()
                        + p.layers.iter().map(|(_, l)| l.heap_bytes()).sum::<usize>()
                })
                .sum::<usize>()
    }

    /// Whether a retained or in-progress checkpoint names `file`.
    pub(super) fn pinned(&self, file: &str) -> bool {
        self.pins.contains_key(file)
    }

    /// New checkpoints are numbered above `seq`.
    pub(super) fn number_above(&mut self, seq: u64) {
        self.next_seq = self.next_seq.max(seq + 1);
    }

    /// Every file a retained manifest names.
    pub(super) fn all_files(&self) -> impl Iterator<Item = String> + '_ {
        self.retained.values().flat_map(|r| r.files().cloned())
    }

    /// Retained manifests and checkpoints in progress.
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.retained.len(), self.pending.len())
    }

    /// Every retained checkpoint, oldest first.
    pub(super) fn list(&self) -> Vec<CheckpointInfo> {
        self.retained
            .iter()
            .map(|(&seq, r)| CheckpointInfo {
                seq,
                owner: r.m.owner.clone(),
                checkpoint_id: r.m.checkpoint_id,
                lo: r.m.lo,
                hi: r.m.hi,
                handle: Handle {
                    seq,
                    manifest_crc: r.crc,
                }
                .encode(),
                segments: r.m.layers.len(),
                completed: r.completed,
            })
            .collect()
    }
}

impl<I: Io> Store<I> {
    /// The synchronous part of a checkpoint of `spec.owner`'s states in key
    /// groups `spec.lo..=spec.hi`: takes effect after every operation
    /// submitted before it (they are all applied or have fixed their
    /// snapshot), and nothing submitted after it changes what it holds.
    /// Freezes the memtable and pins the segments; the rest runs in `poll`,
    /// which completes `token` with `Output::Value(Some(handle))` once the
    /// manifest is durable, or with the error that stopped it.
    pub fn checkpoint(&mut self, token: u64, spec: CheckpointSpec) -> Result<(), StoreError> {
        if spec.lo > spec.hi {
            return Err(StoreError::Invalid("key-group range with lo > hi"));
        }
        if spec.owner.len() > u16::MAX as usize || spec.meta.len() > 1 << 20 {
            return Err(StoreError::Invalid(
                "checkpoint owner or metadata too large",
            ));
        }
        let open = self
            .ckpt
            .retained
            .values()
            .filter(|r| {
                r.m.owner == spec.owner && (r.m.lo, r.m.hi) == (spec.lo, spec.hi) && !r.completed
            })
            .count()
            + self
                .ckpt
                .pending
                .iter()
                .filter(|(_, p)| {
                    p.manifest.owner == spec.owner
                        && (p.manifest.lo, p.manifest.hi) == (spec.lo, spec.hi)
                })
                .count();
        if open >= MAX_UNCOMPLETED {
            return Err(StoreError::Limit(format!(
                "{open} checkpoints of this owner's key groups {}..={} are neither completed nor aborted",
                spec.lo, spec.hi
            )));
        }
        self.freeze();
        let states = state_set(spec.states);
        let keep = Region {
            lo: spec.lo,
            hi: spec.hi,
            states: Some(states.clone()),
        };
        let mut layers = Vec::new();
        for seg in &self.segments {
            if seg.footer.max_kg < spec.lo || seg.footer.min_kg > spec.hi {
                continue;
            }
            if let Some(clip) = self.capture_clip(seg.footer.order, seg.clip.as_ref(), &keep) {
                let l = LayerRef {
                    name: seg.name(),
                    file_len: seg.file_len,
                    clip,
                };
                layers.push((seg.footer.order, l));
            }
        }
        let waiting: Vec<(u64, Clip)> = self
            .frozen
            .iter()
            .filter_map(|(o, _)| Some((*o, self.capture_clip(*o, None, &keep)?)))
            .collect();
        for (_, l) in &layers {
            *self.ckpt.pins.entry(l.name.clone()).or_default() += 1;
        }
        let seq = self.ckpt.next_seq;
        self.ckpt.next_seq += 1;
        self.ckpt.pending.insert(Pending {
            token,
            manifest: Manifest {
                seq,
                checkpoint_id: spec.checkpoint_id,
                owner: spec.owner,
                lo: spec.lo,
                hi: spec.hi,
                states,
                meta: spec.meta,
                layers: Vec::new(),
            },
            layers,
            waiting,
            phase: Phase::Flushing,
            file: None,
            handle: [0; manifest::HANDLE_LEN],
            crc: 0,
        });
        Ok(())
    }

    /// What of a layer of `order` (with its own clip, if restored) belongs
    /// to the region `keep`, as of now; `None` if nothing.
    pub(super) fn capture_clip(
        &self,
        order: u64,
        own: Option<&Clip>,
        keep: &Region,
    ) -> Option<Clip> {
        let states = keep.states.as_deref().unwrap_or_default();
        let mut clip = match own {
            None => Clip {
                keep: keep.clone(),
                drop: Vec::new(),
            },
            Some(c) => {
                let n = c.narrowed(keep.lo, keep.hi)?;
                let st = match &n.keep.states {
                    Some(s) => intersect(s, states),
                    None => states.to_vec(),
                };
                Clip {
                    keep: Region {
                        lo: n.keep.lo,
                        hi: n.keep.hi,
                        states: Some(st),
                    },
                    drop: n.drop,
                }
            }
        };
        if clip.keep.states.as_ref().is_some_and(|s| s.is_empty()) {
            return None;
        }
        for m in &self.kg_deletes {
            if order <= m.max_order && m.region.overlaps(&clip.keep) {
                if m.region.covers(&clip.keep) {
                    // Nothing of this layer belongs to the checkpoint.
                    return None;
                }
                clip.drop.push(m.region.clone());
            }
        }
        Some(clip)
    }

    /// A frozen memtable became `seg`: checkpoints waiting for it pin it.
    pub(super) fn checkpoint_layer_flushed(&mut self, seg: &Rc<Segment>) {
        let order = seg.footer.order;
        let mut pins = Vec::new();
        for (_, p) in self.ckpt.pending.iter_mut() {
            let Some(i) = p.waiting.iter().position(|(o, _)| *o == order) else {
                continue;
            };
            let (_, clip) = p.waiting.swap_remove(i);
            if seg.footer.max_kg < clip.keep.lo || seg.footer.min_kg > clip.keep.hi {
                continue;
            }
            let name = seg.name();
            pins.push(name.clone());
            p.layers.push((
                order,
                LayerRef {
                    name,
                    file_len: seg.file_len,
                    clip,
                },
            ));
        }
        for n in pins {
            *self.ckpt.pins.entry(n).or_default() += 1;
        }
    }

    /// A flush failed: checkpoints waiting for one fail with its error
    /// (the engine aborts them; a later checkpoint retries).
    pub(super) fn fail_flush_waiters(&mut self, e: &StoreError) {
        let keys: Vec<usize> = self
            .ckpt
            .pending
            .iter()
            .filter(|(_, p)| p.phase == Phase::Flushing && !p.waiting.is_empty())
            .map(|(k, _)| k)
            .collect();
        for k in keys {
            self.fail_checkpoint(k, e.clone());
        }
    }

    /// Whether a checkpoint waits for a flush to land.
    pub(super) fn checkpoint_awaits_flush(&self) -> bool {
        self.ckpt
            .pending
            .iter()
            .any(|(_, p)| p.phase == Phase::Flushing && !p.waiting.is_empty())
    }

    /// Whether a checkpoint's manifest write can start (or an upload it
    /// waits for finished).
    pub(super) fn checkpoint_runnable(&self) -> bool {
        self.tier.as_ref().is_some_and(|t| t.progress)
            || self.ckpt.markers.runnable()
            || self
                .ckpt
                .pending
                .iter()
                .any(|(_, p)| p.phase == Phase::Flushing && p.waiting.is_empty())
    }

    /// Starts the manifest write of every checkpoint whose layers are all
    /// segments now (with a remote tier: uploads them first, and waits for
    /// them), and completes those whose manifest became durable remotely.
    pub(super) fn step_checkpoints(&mut self) {
        let ready: Vec<usize> = self
            .ckpt
            .pending
            .iter()
            .filter(|(_, p)| p.phase == Phase::Flushing && p.waiting.is_empty())
            .map(|(k, _)| k)
            .collect();
        for k in ready {
            match self.tier.as_mut() {
                Some(t) => {
                    let p = &mut self.ckpt.pending[k];
                    p.phase = Phase::Uploading;
                    // Looked at below even if every file is already remote.
                    t.progress = true;
                    for (_, l) in &p.layers {
                        // (Not a copy an open set aside: its bytes may be
                        // what failed the checks.)
                        let path = tier::local_copy(&self.cfg.dir, &l.name)
                            .unwrap_or_else(|| self.cfg.dir.join(&l.name));
                        t.upload(&l.name, path);
                    }
                }
                None => self.write_manifest(k),
            }
        }
        let Some(t) = self.tier.as_mut() else {
            return;
        };
        if !std::mem::take(&mut t.progress) {
            return;
        }
        let mut advance = Vec::new();
        for (k, p) in self.ckpt.pending.iter() {
            let names: Vec<String> = match p.phase {
                Phase::Uploading => p.layers.iter().map(|(_, l)| l.name.clone()).collect(),
                Phase::Publishing => vec![manifest::file_name(p.manifest.seq)],
                _ => continue,
            };
            let mut state = Some(Ok(()));
            for n in &names {
                match t.upload_state(n) {
                    Some(Ok(())) => {}
                    Some(Err(e)) => {
                        state = Some(Err(e));
                        break;
                    }
                    None => state = None,
                }
            }
            if let Some(s) = state {
                advance.push((k, p.phase, s));
            }
        }
        for (k, phase, s) in advance {
            match (phase, s) {
                (_, Err(e)) => self.fail_checkpoint(
                    k,
                    StoreError::Remote(format!(
                        "checkpoint failed, its files are not durable remotely: {e}"
                    )),
                ),
                (Phase::Uploading, Ok(())) => self.write_manifest(k),
                _ => self.finish_checkpoint(k),
            }
        }
    }

    /// Starts writing checkpoint `k`'s manifest.
    fn write_manifest(&mut self, k: usize) {
        let p = &mut self.ckpt.pending[k];
        p.layers.sort_by_key(|l| std::cmp::Reverse(l.0));
        p.manifest.layers = p.layers.iter().map(|(_, l)| l.clone()).collect();
        let bytes = p.manifest.encode();
        let body_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4")) as usize;
        p.crc = u32::from_le_bytes(bytes[body_len..body_len + 4].try_into().expect("4"));
        p.handle = Handle {
            seq: p.manifest.seq,
            manifest_crc: p.crc,
        }
        .encode();
        let path = self.cfg.dir.join(manifest::file_name(p.manifest.seq));
        match self.io.open(&path, OpenMode::CreateNew) {
            Ok(f) => {
                p.file = Some(f);
                p.phase = Phase::Writing;
                let buf = AlignedBuf::copy_of(&bytes);
                self.io.write(f, 0, buf, tag(Tag::CkptWrite, k as u64));
            }
            Err(e) => self.fail_checkpoint(k, StoreError::io(&path, "create", &e)),
        }
    }

    /// Advances a checkpoint's manifest write: write, fsync, directory
    /// fsync, then the handle.
    pub(super) fn checkpoint_io_done(&mut self, t: ManifestIo, k: usize, r: Result<usize, i32>) {
        let Some(p) = self.ckpt.pending.get(k) else {
            return;
        };
        let path = self.cfg.dir.join(manifest::file_name(p.manifest.seq));
        let (op, next) = match t {
            ManifestIo::Write => ("write", Phase::Syncing),
            ManifestIo::Sync => ("fsync", Phase::DirSync),
            ManifestIo::DirSync => ("fsync directory", Phase::DirSync),
        };
        if let Err(errno) = r {
            return self.fail_checkpoint(k, StoreError::from_errno(&path, op, errno));
        }
        let file = p.file.expect("a manifest being written has a file");
        match t {
            ManifestIo::Write => {
                self.ckpt.pending[k].phase = next;
                self.io.fsync(file, tag(Tag::CkptSync, k as u64));
            }
            ManifestIo::Sync => match self.dir_fd() {
                Ok(d) => {
                    self.ckpt.pending[k].phase = next;
                    self.io.fsync(d, tag(Tag::CkptDirSync, k as u64));
                }
                Err(e) => self.fail_checkpoint(k, e),
            },
            ManifestIo::DirSync => {
                self.io.close(file);
                let p = &mut self.ckpt.pending[k];
                p.file = None;
                match self.tier.as_mut() {
                    // Durable locally; the handle waits for the remote copy.
                    Some(t) => {
                        p.phase = Phase::Publishing;
                        let name = manifest::file_name(p.manifest.seq);
                        t.upload(&name, path);
                    }
                    None => self.finish_checkpoint(k),
                }
            }
        }
    }

    /// Checkpoint `k`'s manifest is durable (and, with a remote tier, its
    /// files are too): it is retained and its handle is delivered.
    fn finish_checkpoint(&mut self, k: usize) {
        let p = self.ckpt.pending.remove(k);
        let m = p.manifest;
        self.ckpt.retain(
            m.seq,
            Retained {
                m: Rc::new(m),
                crc: p.crc,
                completed: false,
            },
        );
        self.done
            .push_back((p.token, Ok(Resolved::Owned(p.handle.to_vec()))));
    }

    fn fail_checkpoint(&mut self, k: usize, e: StoreError) {
        let p = self.ckpt.pending.remove(k);
        let name = manifest::file_name(p.manifest.seq);
        if let Some(f) = p.file {
            self.io.close(f);
            self.unlink(&self.cfg.dir.join(&name));
        } else if p.phase == Phase::Publishing {
            self.unlink(&self.cfg.dir.join(&name));
            if let Some(t) = self.tier.as_mut() {
                t.delete(&name);
            }
        }
        for (_, l) in &p.layers {
            self.unpin(&l.name);
        }
        self.done.push_back((p.token, Err(e)));
    }

    /// The store directory, opened through the I/O layer (for fsyncs).
    pub(super) fn dir_fd(&mut self) -> Result<crate::io::FileId, StoreError> {
        if let Some(f) = self.dir_file {
            return Ok(f);
        }
        let f = self
            .io
            .open(&self.cfg.dir, OpenMode::Read)
            .map_err(|e| StoreError::io(&self.cfg.dir, "open directory", &e))?;
        self.dir_file = Some(f);
        Ok(f)
    }

    fn unpin(&mut self, name: &str) {
        if let Some(n) = self.ckpt.pins.get_mut(name) {
            *n -= 1;
            if *n == 0 {
                self.ckpt.pins.remove(name);
                self.delete_if_unreferenced(name);
            }
        }
    }

    /// Deletes segment file `name` if no live layer and no checkpoint
    /// names it.
    pub(super) fn delete_if_unreferenced(&mut self, name: &str) {
        if self.ckpt.pinned(name) {
            return;
        }
        let live = self
            .held_segments()
            .any(|s| s.path.file_name().is_some_and(|n| n == name));
        let writing = self
            .flush
            .as_ref()
            .map(|j| &j.writer.path)
            .into_iter()
            .chain(self.compact.as_ref().map(|j| &j.writer.path))
            .any(|p| p.file_name().is_some_and(|n| n == name));
        if !live && !writing {
            // Through the I/O layer: a large file's unlink took a shard
            // 264 ms (benches/RESULTS.md).
            self.unlink(&self.cfg.dir.join(name));
            if self.tier.is_some() {
                self.unlink(&self.cfg.dir.join(tier::FETCHED_DIR).join(name));
            }
            if let Some(t) = self.tier.as_mut() {
                t.delete(name);
                if let Some(f) = t.wfds.remove(name) {
                    self.io.close(f);
                }
            }
        }
    }

    /// The engine's word on checkpoint `checkpoint_id` of `owner`.
    /// `Complete` (of one the store holds; otherwise nothing happens)
    /// marks it completed and deletes the owner's older checkpoints that
    /// never completed (an engine that completed a newer one never
    /// completes them: Flink aborts them) and, past
    /// `retained_checkpoints` completed ones, the oldest completed. Older
    /// completed checkpoints otherwise stay restorable until the engine
    /// says `Subsume` (or `Abort`, for one that never completed). Returns
    /// how many manifests were deleted.
    pub fn checkpoint_notify(&mut self, owner: &[u8], checkpoint_id: u64, kind: Notify) -> usize {
        let mine = |r: &Retained| r.m.owner == owner;
        let doomed: Vec<u64> = match kind {
            // One the store never took (or already deleted) says nothing
            // about the others: a stray id must not delete pending ones.
            Notify::Complete
                if !self
                    .ckpt
                    .retained
                    .values()
                    .any(|r| mine(r) && r.m.checkpoint_id == checkpoint_id) =>
            {
                Vec::new()
            }
            Notify::Complete => {
                for (seq, r) in self.ckpt.retained.iter_mut() {
                    if mine(r) && r.m.checkpoint_id == checkpoint_id && !r.completed {
                        // Remembered across restarts, and on the remote
                        // tier for another host, by a marker file made
                        // durable in the background.
                        r.completed = true;
                        self.ckpt.markers.push(*seq);
                    }
                }
                let mut ids: Vec<u64> = self
                    .ckpt
                    .retained
                    .values()
                    .filter(|r| mine(r) && r.completed)
                    .map(|r| r.m.checkpoint_id)
                    .collect();
                ids.sort_unstable_by(|a, b| b.cmp(a));
                ids.dedup();
                let keep = self.cfg.retained_checkpoints.max(1);
                let oldest_kept = ids.get(keep - 1).or(ids.last()).copied().unwrap_or(0);
                self.ckpt
                    .retained
                    .iter()
                    .filter(|(_, r)| {
                        mine(r)
                            && ((!r.completed && r.m.checkpoint_id < checkpoint_id)
                                || r.m.checkpoint_id < oldest_kept)
                    })
                    .map(|(s, _)| *s)
                    .collect()
            }
            Notify::Abort => self
                .ckpt
                .retained
                .iter()
                .filter(|(_, r)| mine(r) && r.m.checkpoint_id == checkpoint_id && !r.completed)
                .map(|(s, _)| *s)
                .collect(),
            Notify::Subsume => self
                .ckpt
                .retained
                .iter()
                .filter(|(_, r)| mine(r) && r.m.checkpoint_id == checkpoint_id)
                .map(|(s, _)| *s)
                .collect(),
        };
        for seq in &doomed {
            self.delete_manifest(*seq);
        }
        doomed.len()
    }

    /// Deletes the checkpoint a handle names unless it completed (its
    /// taker is gone and nobody else holds the handle). Whether it did.
    pub fn discard_checkpoint(&mut self, handle: &[u8]) -> bool {
        let Ok(h) = Handle::decode(handle) else {
            return false;
        };
        if self.named(&h).is_none_or(|r| r.completed) {
            return false;
        }
        self.delete_manifest(h.seq);
        true
    }

    /// The engine no longer references the checkpoints the handles name
    /// (Flink discarded them: their job was cancelled, or they were
    /// subsumed or aborted): deletes those this store retains for
    /// `owner`, completed or not. A handle of another store or owner, or
    /// of a checkpoint already deleted, deletes nothing (a release may
    /// repeat, and reach a daemon that never held it). A handle that does
    /// not decode refuses the whole release, before any is deleted.
    ///
    /// The manifests' unlinks are in flight when this returns: a caller
    /// that answers "released" waits until [`Store::unlinks_done`] says so
    /// for [`Released::unlinking`], or a restart right after the answer
    /// could find the checkpoint still there.
    pub fn release_checkpoints(
        &mut self,
        owner: &[u8],
        handles: &[&[u8]],
    ) -> Result<Released, StoreError> {
        let hs = handles
            .iter()
            .map(|h| Handle::decode(h).map_err(|m| StoreError::Invalid(m.0)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut released = Released::default();
        for h in hs {
            if self.named(&h).is_some_and(|r| r.m.owner == owner) {
                released.unlinking.extend(self.delete_manifest(h.seq));
                released.count += 1;
            }
        }
        Ok(released)
    }

    /// Whether none of `paths` is still being unlinked (see
    /// [`Store::release_checkpoints`]).
    pub fn unlinks_done(&self, paths: &[PathBuf]) -> bool {
        !paths.iter().any(|p| self.unlink_pending(p))
    }

    /// The retained checkpoint a decoded handle names (its manifest's CRC
    /// as the handle says), if this store holds it.
    fn named(&self, h: &Handle) -> Option<&Retained> {
        self.ckpt
            .retained
            .get(&h.seq)
            .filter(|r| r.crc == h.manifest_crc)
    }

    /// Deletes manifest `seq` (file and marker) and unpins its segments.
    /// The two files whose unlinks are in flight (none when `seq` is not
    /// retained).
    fn delete_manifest(&mut self, seq: u64) -> Vec<PathBuf> {
        let Some(r) = self.ckpt.unretain(seq) else {
            return Vec::new();
        };
        // (Through the I/O layer: a failure is counted, the shard does
        // not wait.)
        let files = vec![
            self.cfg.dir.join(manifest::file_name(seq)),
            self.cfg.dir.join(manifest::completed_name(seq)),
        ];
        for f in &files {
            self.unlink(f);
        }
        if let Some(t) = self.tier.as_mut() {
            t.delete(&manifest::file_name(seq));
            t.delete(&manifest::completed_name(seq));
        }
        for f in r.files() {
            self.unpin(f);
        }
        files
    }

    /// The manifest a handle names, checked: retained, intact, `owner`'s.
    fn manifest_for(&self, handle: &[u8], owner: &[u8]) -> Result<Rc<Manifest>, StoreError> {
        let refuse = |m: String| StoreError::Restore(m);
        let h = Handle::decode(handle).map_err(|m| refuse(m.0.to_string()))?;
        let r = self.ckpt.retained.get(&h.seq).ok_or_else(|| {
            refuse(format!(
                "no checkpoint manifest {} in {} (subsumed, aborted, past retention, or taken by another store)",
                h.seq,
                self.cfg.dir.display()
            ))
        })?;
        if r.crc != h.manifest_crc {
            return Err(refuse(format!(
                "the handle does not match manifest {} (altered or forged)",
                h.seq
            )));
        }
        if r.m.owner != owner {
            return Err(refuse(format!(
                "checkpoint {} belongs to another job or operator",
                r.m.checkpoint_id
            )));
        }
        Ok(Rc::clone(&r.m))
    }

    /// Whether `m` is still retained (a release between a restore's start
    /// and its end may have deleted its files).
    pub(super) fn still_retained(&self, m: &Rc<Manifest>) -> bool {
        self.ckpt
            .retained
            .get(&m.seq)
            .is_some_and(|r| Rc::ptr_eq(&r.m, m))
    }

    /// The manifests of `handles` (checked: `owner`'s, retained, intact),
    /// each once, refused when two hold the same key group of `lo..=hi`.
    pub(super) fn checkpoint_manifests(
        &self,
        owner: &[u8],
        handles: &[&[u8]],
        lo: u16,
        hi: u16,
    ) -> Result<Vec<Rc<Manifest>>, StoreError> {
        let mut manifests: Vec<Rc<Manifest>> = Vec::new();
        for h in handles {
            let m = self.manifest_for(h, owner)?;
            if manifests.iter().any(|o| o.seq == m.seq) {
                continue;
            }
            // Key groups this checkpoint contributes to the range.
            let part = |m: &Manifest| (m.lo.max(lo), m.hi.min(hi));
            let (mlo, mhi) = part(&m);
            for o in &manifests {
                let (olo, ohi) = part(o);
                if mlo <= mhi && olo <= ohi && mlo <= ohi && olo <= mhi {
                    return Err(StoreError::Restore(format!(
                        "checkpoints {} and {} both hold key groups {}..={}",
                        o.checkpoint_id,
                        m.checkpoint_id,
                        mlo.max(olo),
                        mhi.min(ohi)
                    )));
                }
            }
            manifests.push(m);
        }
        Ok(manifests)
    }
}
