//! The remote tier inside the store: segments on object storage, the local
//! disk as a bounded cache of them (FORMAT.md §14).
//!
//! - **Uploads at checkpoint.** A checkpoint's segments are uploaded before
//!   its manifest is written, and the manifest after its fsync; the handle
//!   is returned only when both are durable remotely. A failed upload fails
//!   that checkpoint; a later one uploads what is still missing.
//! - **Local disk as a cache.** A segment that is durable remotely may lose
//!   its data region on the local disk (a punched hole: the footer, index
//!   and filter stay, so opening it and finding a key's block cost no
//!   remote request). Its blocks are then read by ranged GETs, all of one
//!   pass submitted together so that the client coalesces neighbours.
//!   Eviction keeps the segment files under `local_cache_bytes`, least
//!   recently read first, but an evicted file keeps the pages gets read
//!   since its previous eviction (CLOCK's second chance, per page), so a
//!   state that is read stays local while one only written goes. Segments
//!   no checkpoint uploaded yet are uploaded early when they alone pass the
//!   budget. A hole in the data region is what says "remote" after a
//!   restart (`SEEK_HOLE`), so eviction needs no journal.
//! - **Refilling.** What a get fetched is written back into the local file
//!   while the cache has room (a fetch that found none makes the next
//!   eviction pass free some), and its pages are read locally from then
//!   on (a bitmap per file, an epoch per eviction so a write that races a
//!   punch marks nothing). A local block that fails its checksum (bit rot,
//!   or a read that raced a punch) is read from the remote instead, once.
//! - **Restore on an empty disk.** At open, the manifests (and completion
//!   markers) the remote holds and the local disk lacks are downloaded. A
//!   restore that names a segment the local disk lacks fetches its footer
//!   and metadata (two rounds of GETs for all of them) into a sparse local
//!   file; its data is read lazily.
//! - **Garbage collection.** An object is deleted when its local file is
//!   (no live layer and no retained checkpoint names it), and at open every
//!   segment object that no retained manifest and no local file names.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use super::*;
use crate::format::Malformed;
use crate::manifest;
use crate::remote::{Fetcher, LocalFile, Remote, RemoteDone, RemoteError, RemoteStats};
use crate::segment::Residency;

/// How the store uses its remote tier.
#[derive(Clone, Debug, Default)]
pub struct TierConfig {
    /// Bytes of segment files kept on the local disk; beyond it, the least
    /// recently read segments that are durable remotely lose their local
    /// data. `None`: no eviction.
    pub local_cache_bytes: Option<u64>,
    /// Least time between two eviction passes (each lists the directory).
    pub evict_interval: Duration,
}

impl TierConfig {
    pub fn new(local_cache_bytes: Option<u64>) -> TierConfig {
        TierConfig {
            local_cache_bytes,
            evict_interval: Duration::from_millis(500),
        }
    }
}

/// The remote tier's counters (see [`StoreStats::remote`]).
#[derive(Clone, Debug, Default)]
pub struct TierStats {
    /// Objects known durable remotely (segments, manifests, markers).
    pub objects: usize,
    /// Segment files whose data is only remote.
    pub evicted_segments: usize,
    /// Bytes the segment files take on the local disk (at the last
    /// eviction pass) and the budget.
    pub local_cache_bytes: u64,
    pub local_cache_budget: Option<u64>,
    /// Block reads served by the local disk and by the remote.
    pub local_block_reads: u64,
    pub remote_block_reads: u64,
    pub evictions: u64,
    /// Fetched spans written back into local files (the cache refilling).
    pub writebacks: u64,
    /// Local blocks that failed their checksum and were read remotely.
    pub refetched: u64,
    /// Fetched spans not written back (too many writes in flight).
    pub writebacks_skipped: u64,
    pub uploads_failed: u64,
    pub deletes_failed: u64,
    /// Uploads eviction started to make room (segments no checkpoint had
    /// uploaded yet).
    pub eager_uploads: u64,
    /// The last remote failure (read, upload, delete, eviction).
    pub last_error: Option<String>,
}

type Outcome = (u64, Result<RemoteDone, RemoteError>);

/// Write-backs in flight at most (a disk does a few tens of thousands of
/// writes a second; remote reads can arrive faster).
const MAX_WRITEBACKS: usize = 512;

/// Uploads that eviction starts on its own at most at once (segments no
/// checkpoint uploaded yet, when they alone pass the local cache's budget).
const EAGER_UPLOADS: usize = 4;

/// A read the remote serves.
struct RemoteRead {
    /// The store's token of the read (what its completion carries).
    token: u64,
    /// The caller's buffer to copy the bytes into; `None`: hand them over
    /// as fetched (`IoCompletion::remote_block`), `len` of them.
    buf: Option<AlignedBuf>,
    len: usize,
    name: Rc<str>,
    off: u64,
    residency: Rc<Residency>,
}

/// A write-back in flight: file, residency, offset, length, and the
/// residency's epoch when it was issued.
pub(super) type InFlightWrite = (Rc<str>, Rc<Residency>, u64, usize, u64);

/// Fetched bytes on their way back into the local file.
pub(super) struct WriteBack {
    pub name: Rc<str>,
    pub off: u64,
    pub buf: AlignedBuf,
    pub residency: Rc<Residency>,
}

pub(super) struct Tier {
    pub remote: Remote,
    cfg: TierConfig,
    /// Objects durable remotely (names relative to the store's prefix).
    uploaded: HashSet<String>,
    /// Uploads in flight, by token.
    uploading: HashMap<u64, String>,
    /// Names whose last upload failed, with why (until the next attempt).
    failed: HashMap<String, String>,
    /// Deleted while their upload ran: deleted when it ends.
    doomed: HashSet<String>,
    next_token: u64,
    /// Segment files whose data region is only remote.
    evicted: HashSet<String>,
    /// This pass's remote reads (spans into buffers, and block fetches,
    /// checked on the runtime), and the reads in flight (their buffers).
    batch: Vec<(u64, Rc<str>, Range<u64>)>,
    blocks: Vec<(u64, Rc<str>, Range<u64>)>,
    bufs: crate::pool::Pool<RemoteRead>,
    /// Fetched bytes to write back into their local files (the store
    /// issues them), and the writes in flight (file, residency, offset,
    /// length, the residency's epoch at the write).
    pub writebacks: Vec<WriteBack>,
    pub wb: Slab<InFlightWrite>,
    /// Files opened for writing back, by name.
    pub wfds: HashMap<String, crate::io::FileId>,
    /// Bytes admitted for write-back since the last eviction pass measured
    /// the disk.
    admitted: u64,
    /// A fetched block was not written back for lack of room since the
    /// last eviction pass: the next one makes room (down to 90 %) even
    /// within the budget, so that blocks read now can replace pages no
    /// get read since the pass before.
    room_wanted: bool,
    /// Files whose data region is being punched (by token): nothing is
    /// written back into them meanwhile.
    punching: HashMap<u64, String>,
    /// The read clock (each file's residency keeps its last tick).
    tick: u64,
    next_evict: Instant,
    /// A scan of the local directories runs (off the shard thread), or
    /// its result waits for the next eviction pass.
    scanning: bool,
    scanned: Option<Vec<LocalFile>>,
    /// An upload finished since the checkpoints last looked.
    pub progress: bool,
    /// Outcomes that arrived during a synchronous wait for others.
    stash: Vec<Outcome>,
    /// Outcomes being handled by `reap` (kept for its capacity).
    reaped: Vec<Outcome>,
    stats: TierStats,
}

/// Whether `path`'s data region (`..data_end`) has a hole: its blocks are
/// only remote. A file that cannot be asked says no.
pub(super) fn has_hole(path: &Path, data_end: u64) -> bool {
    let Ok(f) = std::fs::File::open(path) else {
        return false;
    };
    match nix::unistd::lseek(&f, 0, nix::unistd::Whence::SeekHole) {
        Ok(at) => (at as u64) < data_end,
        Err(_) => false,
    }
}

/// Where a segment's data region ends: its first metadata page (punching
/// stops there, so the filter, index and footer stay whole).
pub(super) fn data_end(footer: &format::Footer) -> u64 {
    footer.filter_off / ALIGN as u64 * ALIGN as u64
}

/// Where a restore puts the segments it fetched from the remote (their
/// metadata; the data stays remote): a subdirectory, so that reopening the
/// store never takes another host's segments for its own live layers.
pub(super) const FETCHED_DIR: &str = "fetched";

/// The file of segment `name`: in the store directory (its own, live or
/// kept by a checkpoint), else among the fetched ones.
pub(super) fn layer_path(dir: &Path, name: &str) -> PathBuf {
    let own = dir.join(name);
    local_copy(dir, name)
        .or_else(|| set_aside(&own))
        .unwrap_or(own)
}

/// Where layer file `name` is on the local disk under its own name, in
/// the store's directory or fetched from the remote tier (never a copy an
/// open set aside: what is uploaded or counted as held locally).
pub(super) fn local_copy(dir: &Path, name: &str) -> Option<PathBuf> {
    let own = dir.join(name);
    if own.exists() {
        return Some(own);
    }
    let fetched = dir.join(FETCHED_DIR).join(name);
    fetched.exists().then_some(fetched)
}

/// Where an open set `path` aside (`*.torn`), if it did: out of the live
/// layers for good, but still what checkpoints and restored layers name
/// it by, so a read fault that passed does not cost them (it did, as
/// `tests/sim.rs` found). A file still damaged fails its checks where it
/// is opened. (A name is never given to a second file, so a `*.torn.N`
/// beside it is not this one's.)
fn set_aside(path: &Path) -> Option<PathBuf> {
    let torn = path.with_extension("torn");
    torn.exists().then_some(torn)
}

/// Whether `name` is a segment or import file (what the tier caches).
fn is_layer(name: &str) -> bool {
    segment::is_layer_file_name(name)
}

impl Tier {
    fn token(&mut self, t: Tag) -> u64 {
        self.next_token += 1;
        tag(t, value_of(self.next_token))
    }

    pub fn stats_arc(&self) -> Arc<RemoteStats> {
        self.remote.stats()
    }

    pub fn stats(&self) -> TierStats {
        let mut s = self.stats.clone();
        s.objects = self.uploaded.len();
        s.evicted_segments = self.evicted.len();
        s.local_cache_budget = self.cfg.local_cache_bytes;
        s
    }

    /// Queues a read of `seg`'s bytes `off..off+len` from the remote (sent
    /// with the pass's others by [`Tier::send`]). With `buf` (of `len`
    /// bytes) they are copied into it; without, the completion carries
    /// them as fetched (`IoCompletion::remote_block`).
    pub fn read(
        &mut self,
        seg: &Segment,
        off: u64,
        len: usize,
        buf: Option<AlignedBuf>,
        token: u64,
    ) {
        self.stats.remote_block_reads += 1;
        let name = seg.name.clone();
        self.touch(seg);
        let end = off + len as u64;
        let block = buf.is_none();
        let k = self.bufs.insert(RemoteRead {
            token,
            buf,
            len,
            name: name.clone(),
            off,
            residency: seg.residency.clone(),
        });
        let t = tag(Tag::TierRead, k as u64);
        if block {
            self.blocks.push((t, name, off..end));
        } else {
            self.batch.push((t, name, off..end));
        }
    }

    /// Notes a read of `seg` (for the LRU).
    #[inline]
    pub fn touch(&mut self, seg: &Segment) {
        self.tick += 1;
        seg.residency.touch(self.tick);
    }

    /// Sends this pass's remote reads (coalesced by the client).
    pub fn send(&mut self) {
        fn refs(b: &[(u64, Rc<str>, Range<u64>)]) -> Vec<(u64, &str, Range<u64>)> {
            b.iter().map(|(t, n, r)| (*t, &**n, r.clone())).collect()
        }
        if !self.batch.is_empty() {
            self.remote.get_blocks(&refs(&self.batch));
            self.batch.clear();
        }
        if !self.blocks.is_empty() {
            self.remote.get_checked(&refs(&self.blocks), Block::check);
            self.blocks.clear();
        }
    }

    /// Starts uploading `path` as `name` unless it is durable or on its way.
    pub fn upload(&mut self, name: &str, path: PathBuf) {
        // Whoever waits for it looks at its state at the next step.
        self.progress = true;
        if self.uploaded.contains(name) || self.uploading.values().any(|n| n == name) {
            self.doomed.remove(name);
            return;
        }
        self.failed.remove(name);
        let t = self.token(Tag::TierUpload);
        self.uploading.insert(t, name.to_string());
        self.remote.upload_file(t, name, path);
    }

    /// Where an upload of `name` stands: `Some(Ok)` durable, `Some(Err)`
    /// failed, `None` in flight (or never asked).
    pub fn upload_state(&self, name: &str) -> Option<Result<(), String>> {
        if self.uploaded.contains(name) {
            return Some(Ok(()));
        }
        self.failed.get(name).map(|e| Err(e.clone()))
    }

    /// Deletes object `name` if it was uploaded (or once its upload ends).
    pub fn delete(&mut self, name: &str) {
        self.failed.remove(name);
        if self.uploaded.remove(name) {
            let t = self.token(Tag::TierDelete);
            self.remote.delete(t, name);
        } else if self.uploading.values().any(|n| n == name) {
            self.doomed.insert(name.to_string());
        }
        self.evicted.remove(name);
    }

    /// Takes every outcome: reads become completions in `out` (their
    /// buffers filled), the tier's own requests update its state.
    pub fn reap(&mut self, out: &mut Vec<IoCompletion>) {
        let mut got = std::mem::take(&mut self.reaped);
        got.append(&mut self.stash);
        self.remote.poll(|t, r| got.push((t, r)));
        // The reads' entries load a few outcomes ahead of their use.
        const AHEAD: usize = 8;
        let slot = |t: u64| (Tag::of(t) == Some(Tag::TierRead)).then_some(value_of(t) as usize);
        for &(t, _) in got.iter().take(AHEAD) {
            if let Some(k) = slot(t) {
                self.bufs.prefetch(k, 2);
            }
        }
        for i in 0..got.len() {
            if let Some(k) = got.get(i + AHEAD).and_then(|&(t, _)| slot(t)) {
                self.bufs.prefetch(k, 2);
            }
            let (t, r) = std::mem::replace(&mut got[i], (0, Ok(RemoteDone::Deleted)));
            self.outcome(t, r, out);
        }
        got.clear();
        self.reaped = got;
    }

    fn outcome(&mut self, t: u64, r: Result<RemoteDone, RemoteError>, out: &mut Vec<IoCompletion>) {
        match Tag::of(t) {
            Some(Tag::TierUpload) => {
                let Some(name) = self.uploading.remove(&t) else {
                    return;
                };
                self.progress = true;
                if self.doomed.remove(&name) {
                    if r.is_ok() {
                        let t = self.token(Tag::TierDelete);
                        self.remote.delete(t, &name);
                    }
                    return;
                }
                match r {
                    Ok(_) => {
                        self.uploaded.insert(name);
                    }
                    Err(e) => {
                        self.stats.uploads_failed += 1;
                        self.stats.last_error = Some(e.to_string());
                        self.failed.insert(name, e.to_string());
                    }
                }
            }
            Some(Tag::TierDelete) => {
                if let Err(e) = r {
                    self.stats.deletes_failed += 1;
                    self.stats.last_error = Some(e.to_string());
                }
            }
            Some(Tag::TierPunch) => {
                self.punching.remove(&t);
                if let Err(e) = r {
                    self.stats.last_error = Some(e.to_string());
                }
            }
            Some(Tag::TierScan) => {
                self.scanning = false;
                match r {
                    Ok(RemoteDone::LocalFiles(f)) => self.scanned = Some(f),
                    Ok(_) => {}
                    Err(e) => self.stats.last_error = Some(e.to_string()),
                }
            }
            // A synchronous wait's outcome arriving after it gave up: none
            // (it waits for every one), so nothing to do.
            Some(Tag::TierSync) => {}
            // A fetch of metadata for an opening ended (what it did is in
            // the opening's slot): handed to the opening like its reads.
            Some(Tag::Opening) => out.push(IoCompletion::local(t, None, Ok(0))),
            Some(Tag::TierRead) => {
                let k = value_of(t) as usize;
                if self.bufs.get(k).is_none() {
                    return;
                }
                let RemoteRead {
                    token: t,
                    mut buf,
                    len,
                    name,
                    off,
                    residency,
                } = self.bufs.remove(k);
                let mut remote_block = None;
                // The bytes (and a block's check, run on the runtime), or
                // the remote's error (`None`: an outcome that is no read's).
                let (b, shape) = match r {
                    Ok(RemoteDone::Bytes(b)) => (Ok(b), None),
                    Ok(RemoteDone::Checked(b, shape)) => (Ok(b), Some(shape)),
                    Ok(_) => (Err(None), None),
                    Err(e) => (Err(Some(e)), None),
                };
                let (result, remote_error) = match b {
                    Ok(b) if b.len() == len => {
                        // The local disk keeps what was read while it has
                        // room (a full cache admits again once eviction
                        // made room; a fetch that found none asks the next
                        // pass for some, at most a tenth of the budget a
                        // pass), unless the file is being punched or was
                        // deleted.
                        // Only a get's block (compaction's and exports' long
                        // spans are read once), and at most MAX_WRITEBACKS
                        // in flight: beyond, the disk would set the pace.
                        let room = self.cfg.local_cache_bytes.is_none_or(|cap| {
                            self.stats.local_cache_bytes + self.admitted + b.len() as u64 <= cap
                        });
                        let busy = self.wb.len() + self.writebacks.len() >= MAX_WRITEBACKS;
                        if busy {
                            self.stats.writebacks_skipped += 1;
                        }
                        if !room && Tag::of(t) == Some(Tag::Fetch) {
                            self.room_wanted = true;
                        }
                        if room
                            && !busy
                            && Tag::of(t) == Some(Tag::Fetch)
                            && shape.is_none_or(|s| s.is_ok())
                            && !self.punching.values().any(|n| **n == *name)
                            && self.uploaded.contains(&*name)
                        {
                            self.admitted += b.len() as u64;
                            let copy = AlignedBuf::copy_of(&b);
                            self.writebacks.push(WriteBack {
                                name,
                                off,
                                buf: copy,
                                residency,
                            });
                        }
                        match buf.as_mut() {
                            Some(buf) => buf.copy_from_slice(&b),
                            None => {
                                let shape = shape.unwrap_or_else(|| Block::check(&b));
                                remote_block =
                                    Some(shape.map(|s| Block::checked(b, s)).map_err(Malformed));
                            }
                        }
                        (Ok(len), None)
                    }
                    Ok(_) | Err(None) => (Err(libc::EIO), None),
                    Err(Some(e)) => {
                        self.stats.last_error = Some(e.to_string());
                        (Err(libc::EREMOTEIO), Some(Box::new(e)))
                    }
                };
                out.push(IoCompletion {
                    token: t,
                    buf,
                    result,
                    remote_error,
                    remote_block,
                });
            }
            // The remote is handed only the tier's own tokens.
            Some(
                Tag::Fetch
                | Tag::FlushWrite
                | Tag::FlushSync
                | Tag::CompactWrite
                | Tag::CompactSync
                | Tag::CompactRead
                | Tag::Open
                | Tag::DirSync
                | Tag::CkptWrite
                | Tag::CkptSync
                | Tag::CkptDirSync
                | Tag::ExportRead
                | Tag::ImportWrite
                | Tag::ImportSync
                | Tag::MarkerSync
                | Tag::MarkerDirSync
                | Tag::Unlink
                | Tag::Layers
                | Tag::CacheWrite,
            )
            | None => {}
        }
    }

    /// Requests outstanding at the remote.
    pub fn outstanding(&self) -> usize {
        self.remote.outstanding() + self.batch.len() + self.blocks.len()
    }

    /// Whether eviction should look at the disk now (without a budget,
    /// only to measure it, every few seconds).
    fn evict_due(&mut self) -> bool {
        let now = Instant::now();
        if now < self.next_evict {
            return false;
        }
        let every = match self.cfg.local_cache_bytes {
            Some(_) => self.cfg.evict_interval,
            None => self.cfg.evict_interval.max(Duration::from_secs(5)),
        };
        self.next_evict = now + every;
        true
    }

    /// Waits for the outcomes of the `n` synchronous tokens numbered from
    /// `base`: one per token, in order; other outcomes are kept for the
    /// next `reap`.
    fn wait_sync(&mut self, base: u64, n: usize) -> Vec<Option<Result<RemoteDone, RemoteError>>> {
        let mut res: Vec<Option<Result<RemoteDone, RemoteError>>> = (0..n).map(|_| None).collect();
        let mut left = n;
        while left > 0 {
            let mut got = std::mem::take(&mut self.stash);
            self.remote.poll(|t, r| got.push((t, r)));
            for (t, r) in got {
                let i = value_of(t).wrapping_sub(base) as usize;
                if Tag::of(t) == Some(Tag::TierSync) && i < n && res[i].is_none() {
                    res[i] = Some(r);
                    left -= 1;
                } else {
                    self.stash.push((t, r));
                }
            }
            if left > 0 {
                self.remote.wait(Duration::from_millis(50));
            }
        }
        res
    }

    /// Lists the store's objects and waits for the answer (bounded by the
    /// client's timeout and retries).
    fn list_sync(&mut self) -> Result<Vec<(String, u64)>, RemoteError> {
        let t = self.token(Tag::TierSync);
        self.remote.list(t, "");
        let base = value_of(t);
        match self.wait_sync(base, 1).pop().flatten() {
            Some(Ok(RemoteDone::Listed(v))) => Ok(v),
            Some(Err(e)) => Err(e),
            _ => Err(RemoteError::Config("a LIST answered without names".into())),
        }
    }
}

/// The remote's view at open: its manifests downloaded where the local
/// disk lacked them, and its objects.
pub(super) fn prepare(
    dir: &Path,
    remote: Remote,
    cfg: TierConfig,
) -> Result<(Tier, Vec<(String, u64)>), StoreError> {
    let mut tier = Tier {
        remote,
        cfg,
        uploaded: HashSet::new(),
        uploading: HashMap::new(),
        failed: HashMap::new(),
        doomed: HashSet::new(),
        next_token: 0,
        evicted: HashSet::new(),
        batch: Vec::new(),
        blocks: Vec::new(),
        bufs: Default::default(),
        writebacks: Vec::new(),
        wb: Slab::new(),
        wfds: HashMap::new(),
        punching: HashMap::new(),
        admitted: 0,
        room_wanted: false,
        tick: 0,
        next_evict: Instant::now(),
        scanning: false,
        scanned: None,
        progress: false,
        stash: Vec::new(),
        reaped: Vec::new(),
        stats: TierStats::default(),
    };
    let unreachable = |e: RemoteError| {
        StoreError::Remote(format!(
            "cannot list the remote tier at open (the store will not guess which objects it holds): {e}"
        ))
    };
    let listed = tier.list_sync().map_err(unreachable)?;
    let dir_err = |e: std::io::Error| StoreError::Dir {
        path: dir.display().to_string(),
        msg: e.to_string(),
    };
    // A directory that holds no store yet (a new host, a lost disk) takes
    // the remote's manifests; one that holds a store is the truth, and the
    // remote's manifests it lacks are deletes that did not finish.
    let fresh = std::fs::read_dir(dir).map_err(dir_err)?.flatten().all(|e| {
        let n = e.file_name().to_string_lossy().to_string();
        manifest::parse_file_name(&n).is_none() && !is_layer(&n) && n != "LAYERS"
    });
    let checkpoint_file =
        |n: &str| manifest::parse_file_name(n).is_some() || n.ends_with(".complete");
    let missing: Vec<(String, Range<u64>)> = listed
        .iter()
        .filter(|(n, _)| checkpoint_file(n) && !dir.join(n).exists())
        .map(|(n, len)| (n.clone(), 0..*len))
        .collect();
    if !fresh {
        for (n, _) in &missing {
            let t = tier.token(Tag::TierDelete);
            tier.remote.delete(t, n);
        }
        let listed: Vec<(String, u64)> = listed
            .into_iter()
            .filter(|(n, _)| !missing.iter().any(|(m, _)| m == n))
            .collect();
        tier.uploaded = listed.iter().map(|(n, _)| n.clone()).collect();
        return Ok((tier, listed));
    }
    if !missing.is_empty() {
        // Completion markers are empty: nothing to read.
        let (empty, missing): (Vec<_>, Vec<_>) =
            missing.into_iter().partition(|(_, r)| r.is_empty());
        for (name, _) in &empty {
            let path = dir.join(name);
            write_durably(&path, &path.with_extension("part"), &[], 0).map_err(dir_err)?;
        }
        for ((name, _), got) in missing.iter().zip(tier.remote.fetcher().get_all(&missing)) {
            let bytes = match got {
                Ok(b) => b,
                // Deleted between the listing and the GET (a marker of a
                // subsumed checkpoint): nothing to restore.
                Err(RemoteError::NotFound { .. }) => continue,
                Err(e) => return Err(unreachable(e)),
            };
            let path = dir.join(name);
            let tmp = path.with_extension("part");
            write_durably(&path, &tmp, &[(0, &bytes)], bytes.len() as u64).map_err(dir_err)?;
        }
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(dir_err)?;
    }
    tier.uploaded = listed.iter().map(|(n, _)| n.clone()).collect();
    Ok((tier, listed))
}

/// What a fetch of metadata ([`Store::fetch_metadata`]) did: the segments
/// it wrote, and whether it failed. Empty until it ends.
pub(super) type Fetched = Arc<std::sync::Mutex<Option<(Vec<String>, Result<(), StoreError>)>>>;

/// Fetches the footer page, then the metadata, of each segment `missing`
/// names (every GET of a round in flight at once), and writes each as a
/// sparse file under [`FETCHED_DIR`], durably, through a temporary name
/// of its own (`tag`: two restores may fetch one segment at once; the
/// files they rename are the same bytes). Blocks: on the remote runtime's
/// blocking pool only. What it wrote goes in `written`, also on an error.
fn fetch_and_write_metadata(
    f: &Fetcher,
    dir: &Path,
    missing: &[(String, u64)],
    tag: u64,
    written: &mut Vec<String>,
) -> Result<(), StoreError> {
    let refuse = |n: &str, what: String| {
        StoreError::Restore(format!(
            "segment {n} is not on the local disk and the remote tier cannot supply it: {what}"
        ))
    };
    // A missing object refuses the restore; a remote that fails to answer
    // fails it as a remote error (the same restore may succeed later).
    let fetch_failed = |n: &str, e: RemoteError| match e {
        RemoteError::Failed { .. } => StoreError::Remote(format!(
            "segment {n} is not on the local disk and fetching its metadata failed: {e}"
        )),
        e => refuse(n, e.to_string()),
    };
    let fetched = dir.join(FETCHED_DIR);
    std::fs::create_dir_all(&fetched).map_err(|e| StoreError::io(&fetched, "create", &e))?;
    let mut pages = Vec::new();
    for (n, len) in missing {
        let page = format::footer_page(*len)
            .ok_or_else(|| refuse(n, format!("{len} bytes is not a whole number of pages")))?;
        pages.push((n.clone(), page..*len));
    }
    let mut metas = Vec::new();
    let mut parsed = Vec::new();
    for ((n, len), got) in missing.iter().zip(f.get_all(&pages)) {
        let page = got.map_err(|e| fetch_failed(n, e))?;
        let footer = format::Footer::decode(&page, *len).map_err(|m| StoreError::Corrupt {
            path: format!("remote:{n}"),
            offset: *len - ALIGN as u64,
            what: m.0,
        })?;
        let meta_off = data_end(&footer);
        metas.push((n.clone(), meta_off..*len - ALIGN as u64));
        parsed.push((page, meta_off));
    }
    for (((n, len), meta), (page, meta_off)) in missing.iter().zip(f.get_all(&metas)).zip(parsed) {
        let meta = meta.map_err(|e| fetch_failed(n, e))?;
        let path = fetched.join(n);
        let tmp = path.with_extension(format!("part{tag}"));
        write_durably(
            &path,
            &tmp,
            &[(meta_off, &meta[..]), (*len - ALIGN as u64, &page[..])],
            *len,
        )
        .map_err(|e| StoreError::io(&path, "write", &e))?;
        written.push(n.clone());
    }
    std::fs::File::open(&fetched)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io(&fetched, "fsync directory", &e))
}

/// Writes `parts` (offset, bytes) into a new file of `len` bytes at `path`
/// (through the temporary name `tmp`, synced, then renamed).
fn write_durably(path: &Path, tmp: &Path, parts: &[(u64, &[u8])], len: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(tmp)?;
    f.set_len(len)?;
    for (off, b) in parts {
        f.write_all_at(b, *off)?;
    }
    f.sync_all()?;
    std::fs::rename(tmp, path)
}

impl<I: Io> Store<I> {
    /// Opens the store with a remote tier: the remote's manifests are
    /// fetched where the local disk lacks them, its orphan segments are
    /// deleted, and segment files whose data is only remote are read from
    /// it. Fails if the remote cannot be listed.
    pub fn open_tiered(
        cfg: StoreConfig,
        io: I,
        remote: Remote,
        tier_cfg: TierConfig,
    ) -> Result<(Store<I>, RecoveryReport), StoreError> {
        std::fs::create_dir_all(&cfg.dir).map_err(|e| StoreError::Dir {
            path: cfg.dir.display().to_string(),
            msg: e.to_string(),
        })?;
        let (tier, listed) = prepare(&cfg.dir, remote, tier_cfg)?;
        let (mut store, mut report) = Store::open_inner(cfg, io, true)?;
        store.tier = Some(tier);
        // Names a manifest holds must never be reused by this host's new
        // segments (an upload would replace an object a checkpoint needs).
        let named: Vec<String> = store
            .ckpt
            .all_files()
            .chain(listed.iter().map(|(n, _)| n.clone()))
            .collect();
        for n in &named {
            // Checkpoint numbers too: a stale marker must never mark a
            // new checkpoint of the same number.
            let seq = n
                .strip_suffix(".complete")
                .map_or(n.clone(), |s| format!("{s}.manifest"));
            if let Some(seq) = manifest::parse_file_name(&seq) {
                store.ckpt.number_above(seq);
            }
            if let Some((order, _)) = segment::parse_file_name(n) {
                store.next_order = store.next_order.max(order + 1);
            }
            if let Some(serial) = segment::parse_import_file_name(n) {
                store.next_import_file = store.next_import_file.max(serial + 1);
            }
        }
        let segs: Vec<Rc<Segment>> = store.segments.clone();
        for s in &segs {
            store.note_remote(s);
        }
        // Fetched segments no retained manifest and no layer names: a
        // restore refused after it fetched them, or one since replaced.
        if let Ok(rd) = std::fs::read_dir(store.cfg.dir.join(FETCHED_DIR)) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().to_string();
                let path = e.path();
                if !store.ckpt.pinned(&n) && !segs.iter().any(|s| s.path == path) {
                    report.remove(&path);
                }
            }
        }
        // Objects no retained manifest and no local file names: left by a
        // failed checkpoint, or by a delete that did not finish.
        let orphans: Vec<String> = listed
            .iter()
            .map(|(n, _)| n)
            .filter(|n| {
                is_layer(n) && !store.ckpt.pinned(n) && local_copy(&store.cfg.dir, n).is_none()
            })
            .cloned()
            .collect();
        let tier = store.tier.as_mut().expect("set above");
        for n in orphans {
            tier.delete(&n);
        }
        Ok((store, report))
    }

    /// Marks `seg` remote if its data region is a hole (it was evicted, or
    /// fetched by a restore on an empty disk).
    pub(super) fn note_remote(&mut self, seg: &Segment) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let name = seg.name();
        if tier.evicted.contains(&name) {
            seg.residency.set_remote();
        } else if tier.uploaded.contains(&name) && has_hole(&seg.path, data_end(&seg.footer)) {
            seg.residency.set_remote();
            tier.evicted.insert(name);
        }
    }

    /// Starts bringing the metadata of the segments among `wanted` (file
    /// names and lengths, as manifests give them) that only the remote
    /// holds to the local disk, on the remote runtime's blocking pool:
    /// sparse files with their footer, index and filter, the data staying
    /// remote. `token`'s outcome says it ended; the slot returned holds
    /// what it did. `None`: nothing to fetch.
    pub(super) fn fetch_metadata(
        &mut self,
        token: u64,
        wanted: &[(String, u64)],
    ) -> Option<Fetched> {
        let dir = self.cfg.dir.clone();
        let tier = self.tier.as_mut()?;
        let mut missing: Vec<(String, u64)> = wanted
            .iter()
            // (A copy an open set aside is fetched again: the remote's
            // may be sound where the local one is not.)
            .filter(|(n, _)| local_copy(&dir, n).is_none())
            .cloned()
            .collect();
        missing.sort();
        missing.dedup();
        if missing.is_empty() {
            return None;
        }
        let slot = Fetched::default();
        let out = slot.clone();
        let fetcher = tier.remote.fetcher();
        let what = dir.join(FETCHED_DIR).display().to_string();
        tier.remote.local_task(token, what, move || {
            let mut written = Vec::new();
            let r = fetch_and_write_metadata(&fetcher, &dir, &missing, token, &mut written);
            *out.lock().unwrap_or_else(|p| p.into_inner()) = Some((written, r));
            Ok(RemoteDone::Ran)
        });
        Some(slot)
    }

    /// The segments a fetch of metadata wrote: their data is remote.
    pub(super) fn note_fetched(&mut self, names: Vec<String>) {
        if let Some(t) = self.tier.as_mut() {
            t.evicted.extend(names);
        }
    }

    /// Keeps the local segment files (own and fetched) under the cache
    /// budget: the least recently read ones that are durable remotely lose
    /// their data region (and the pages written back since).
    pub(super) fn maybe_evict(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        if let Some(files) = tier.scanned.take() {
            return self.evict_from(files);
        }
        if tier.scanning || !tier.evict_due() {
            return;
        }
        // The listing, a stat per file and the footers of files no layer
        // has open (only checkpoints name them) are read off the shard.
        let open: HashSet<PathBuf> = self.held_segments().map(|s| s.path.clone()).collect();
        let dirs = [self.cfg.dir.clone(), self.cfg.dir.join(FETCHED_DIR)];
        let tier = self.tier.as_mut().expect("checked");
        tier.scanning = true;
        let t = tier.token(Tag::TierScan);
        let what = self.cfg.dir.display().to_string();
        tier.remote.local_task(t, what, move || {
            use std::os::unix::fs::MetadataExt;
            let mut files = Vec::new();
            for d in dirs {
                let Ok(rd) = std::fs::read_dir(&d) else {
                    continue;
                };
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().to_string();
                    if !is_layer(&name) {
                        continue;
                    }
                    let Ok(m) = e.metadata() else { continue };
                    let path = e.path();
                    let extent = (!open.contains(&path))
                        .then(|| read_footer(&path).map(|(f, len)| (data_end(&f), len)))
                        .flatten();
                    files.push(LocalFile {
                        name,
                        path,
                        disk_bytes: m.blocks() * 512,
                        extent,
                    });
                }
            }
            Ok(RemoteDone::LocalFiles(files))
        });
    }

    /// Evicts the least recently read segments durable remotely while the
    /// local files (as a scan found them) pass the budget, down to 90% of
    /// it. An evicted segment keeps the pages read since its last eviction
    /// (a second chance, as in CLOCK): a state that is read stays local
    /// while one only written goes, whatever segments they share. Only
    /// when those pages alone pass the budget do they go too, least
    /// recently read segments first.
    fn evict_from(&mut self, files: Vec<LocalFile>) {
        let tier = self.tier.as_mut().expect("evicting with a tier");
        let budget = tier.cfg.local_cache_bytes.unwrap_or(u64::MAX);
        let mut used: u64 = files.iter().map(|f| f.disk_bytes).sum();
        tier.stats.local_cache_bytes = used;
        tier.admitted = 0;
        let target = budget / 10 * 9;
        let room_wanted = std::mem::take(&mut tier.room_wanted);
        if used <= budget && !(room_wanted && used > target) {
            return;
        }
        // Compaction and export inputs stay whole while they are read (a
        // get that races the punch finds a bad checksum and reads the
        // remote instead; a write-back that races it marks nothing).
        let busy: HashSet<PathBuf> = self
            .compact
            .iter()
            .flat_map(|j| j.inputs.iter().map(|s| s.path.as_path()))
            .chain(self.exports.iter().flat_map(|(_, e)| e.paths()))
            .map(Path::to_path_buf)
            .collect();
        // (One map, not a scan of the layers per file.)
        let by_path: HashMap<&Path, &Rc<Segment>> = self
            .held_segments()
            .map(|s| (s.path.as_path(), s))
            .collect();
        let open = |p: &Path| by_path.get(p).copied();
        let tier = self.tier.as_ref().expect("checked");
        // Where a file's data ends: an open segment's footer, else what the
        // scan read (a file only checkpoints name; one neither open nor
        // pinned now was deleted since the scan).
        let extent = |f: &LocalFile| match open(&f.path) {
            Some(s) => Some((data_end(&s.footer), s.file_len)),
            None if self.ckpt.pinned(&f.name) => f.extent,
            None => None,
        };
        // A file already remote is a candidate again when it holds more
        // than its metadata: pages written back since (or a write that
        // landed after its punch).
        struct Candidate {
            last_use: u64,
            name: String,
            path: PathBuf,
            /// Local bytes of its data region (as the scan found them).
            data_bytes: u64,
            end: u64,
            keep: Vec<u64>,
        }
        let mut candidates: Vec<Candidate> = files
            .into_iter()
            .filter(|f| {
                tier.uploaded.contains(&f.name)
                    && !busy.contains(f.path.as_path())
                    && !tier.punching.values().any(|x| *x == f.name)
            })
            .filter_map(|f| {
                let (end, len) = extent(&f)?;
                let data_bytes = f.disk_bytes.saturating_sub(len.saturating_sub(end));
                let seg = open(&f.path);
                let keep = seg.map_or_else(Vec::new, |s| s.residency.keep(end));
                // Already remote and holding no more than what it would
                // keep: nothing to free.
                if tier.evicted.contains(&f.name)
                    && data_bytes <= Residency::kept_bytes(&keep) + ALIGN as u64
                {
                    return None;
                }
                Some(Candidate {
                    last_use: seg.map_or(0, |s| s.residency.last_use()),
                    name: f.name,
                    path: f.path,
                    data_bytes,
                    end,
                    keep,
                })
            })
            .collect();
        candidates.sort_by_key(|c| c.last_use);
        // What the kept pages of `c` hold of its local data (a write-back
        // that landed after the scan may make `keep` the larger).
        let kept = |c: &Candidate| Residency::kept_bytes(&c.keep).min(c.data_bytes);
        let mut victims = Vec::new();
        for c in candidates {
            if used <= target {
                break;
            }
            used = used.saturating_sub(c.data_bytes - kept(&c));
            victims.push(c);
        }
        // The pages read since the last eviction pass the budget alone.
        for c in &mut victims {
            if used <= target {
                break;
            }
            used = used.saturating_sub(kept(c));
            c.keep.clear();
        }
        for c in victims {
            self.evict(&c.name, c.path, c.end, c.keep);
        }
        if used > target {
            self.upload_for_room(used - target, &busy);
        }
    }

    /// Only a segment durable remotely can be evicted, and checkpoints
    /// upload only what they name: flushes and compactions between two
    /// checkpoints would hold the local disk past its budget (and squeeze
    /// out what gets read). Uploads the largest live segments not yet
    /// remote, enough to cover `excess` bytes, a few at a time; the next
    /// passes evict them. Their objects go with their files, as a
    /// checkpoint's do. Compaction and export inputs (`busy`: soon
    /// deleted) are not uploaded, nor a segment whose upload failed (the
    /// next checkpoint that names it tries again): no upload loop against
    /// a remote that is down.
    fn upload_for_room(&mut self, mut excess: u64, busy: &HashSet<PathBuf>) {
        let tier = self.tier.as_mut().expect("evicting with a tier");
        let mut slots = EAGER_UPLOADS.saturating_sub(tier.uploading.len());
        let mut live: Vec<&Rc<Segment>> = self
            .segments
            .iter()
            .filter(|s| {
                !busy.contains(&s.path)
                    && !tier.uploaded.contains(&*s.name)
                    && !tier.failed.contains_key(&*s.name)
                    && !tier.uploading.values().any(|n| **n == *s.name)
            })
            .collect();
        live.sort_by(|a, b| {
            b.file_len
                .cmp(&a.file_len)
                .then_with(|| a.name.cmp(&b.name))
        });
        // (A file two layers share is one upload.)
        live.dedup_by(|a, b| a.name == b.name);
        for s in live {
            if excess == 0 || slots == 0 {
                break;
            }
            excess = excess.saturating_sub(s.file_len);
            slots -= 1;
            tier.stats.eager_uploads += 1;
            tier.upload(&s.name, s.path.clone());
        }
    }

    /// Makes `name`'s data (up to `end`) remote but for the pages of
    /// `keep` ([`Residency::keep`]): reads of the rest go to the remote
    /// from now on, and it is punched out of the local file off the shard
    /// thread.
    fn evict(&mut self, name: &str, path: PathBuf, end: u64, keep: Vec<u64>) {
        let punched = Residency::punched(&keep, end);
        for s in self.held_segments().filter(|s| s.path == path) {
            s.residency.evict(keep.clone());
        }
        let tier = self.tier.as_mut().expect("evicting with a tier");
        tier.evicted.insert(name.to_string());
        tier.stats.evictions += 1;
        let t = tier.token(Tag::TierPunch);
        tier.punching.insert(t, name.to_string());
        tier.remote
            .local_task(t, path.display().to_string(), move || {
                let f = match std::fs::OpenOptions::new().write(true).open(&path) {
                    Ok(f) => f,
                    // Deleted since (a compaction retired it): nothing to punch.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        return Ok(RemoteDone::Deleted);
                    }
                    Err(e) => return Err(e),
                };
                for r in punched {
                    nix::fcntl::fallocate(
                        &f,
                        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
                            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
                        r.start as i64,
                        (r.end - r.start) as i64,
                    )?;
                }
                Ok(RemoteDone::Deleted)
            });
    }

    /// Whether block `off..off+len` of `seg`, read locally and found
    /// corrupt, can be read from the remote instead: the segment is durable
    /// there. Its data is then treated as remote from now on.
    pub(super) fn remote_copy_for(&mut self, seg: &Segment) -> bool {
        let Some(tier) = self.tier.as_mut() else {
            return false;
        };
        let name = seg.name();
        if !tier.uploaded.contains(&name) {
            return false;
        }
        // Every page of it, cached ones too (one of them was bad).
        seg.residency.set_remote();
        tier.evicted.insert(name);
        tier.stats.refetched += 1;
        true
    }

    /// Writes this pass's fetched blocks back into their local files.
    pub(super) fn issue_writebacks(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        if tier.writebacks.is_empty() {
            return;
        }
        // Drained in place: the vector keeps its capacity for the next pass.
        let mut pass = std::mem::take(&mut tier.writebacks);
        for w in pass.drain(..) {
            let f = match tier.wfds.get(&*w.name) {
                Some(&f) => f,
                None => match self
                    .io
                    .open(&layer_path(&self.cfg.dir, &w.name), OpenMode::ReadWrite)
                {
                    Ok(f) => *tier.wfds.entry(w.name.to_string()).or_insert(f),
                    // Not cached, still served: the next read fetches again.
                    Err(_) => continue,
                },
            };
            let len = w.buf.len();
            let epoch = w.residency.epoch();
            let k = tier.wb.insert((w.name, w.residency, w.off, len, epoch));
            self.io
                .write(f, w.off, w.buf, tag(Tag::CacheWrite, k as u64));
        }
        tier.writebacks = pass;
    }

    /// A write-back finished: its pages are local from now on.
    pub(super) fn writeback_done(&mut self, k: usize, r: Result<usize, i32>) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        let Some((name, residency, off, len, epoch)) = tier.wb.try_remove(k) else {
            return;
        };
        match r {
            // Evicted meanwhile: the punch may have gone over it.
            Ok(n) if n == len && residency.is_remote() && residency.epoch() == epoch => {
                residency.mark_local(off, len);
                residency.mark_read(off, len);
                tier.stats.writebacks += 1;
            }
            Ok(_) => {}
            Err(errno) => {
                tier.stats.last_error = Some(format!(
                    "writing a fetched block back into {name}: {}",
                    std::io::Error::from_raw_os_error(errno)
                ));
            }
        }
    }

    /// The remote tier's counters, if there is one.
    pub fn remote_stats(&self) -> Option<(TierStats, Arc<RemoteStats>)> {
        self.tier.as_ref().map(|t| (t.stats(), t.stats_arc()))
    }

    /// The eventfd that is readable while remote outcomes wait (a shard
    /// watches it with its ring).
    pub fn remote_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.tier.as_ref().map(|t| t.remote.bell())
    }
}

/// A segment file's footer and length, read with a plain `pread`
/// (eviction of a file no layer has open; rare, one page).
fn read_footer(path: &Path) -> Option<(format::Footer, u64)> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let page = format::footer_page(len)?;
    let mut buf = vec![0u8; ALIGN];
    f.read_exact_at(&mut buf, page).ok()?;
    format::Footer::decode(&buf, len).ok().map(|f| (f, len))
}

/// Routes a segment read to the local disk or to the remote tier.
pub(super) struct Reads<'a, I: Io> {
    pub io: &'a mut I,
    pub tier: Option<&'a mut Tier>,
}

impl<I: Io> Reads<'_, I> {
    /// Issues a background read (a compaction's or an export's
    /// read-ahead: see [`Io::read_background`]); whether the remote tier
    /// serves it.
    pub fn read(&mut self, seg: &Segment, off: u64, buf: AlignedBuf, token: u64) -> bool {
        match self.tier.as_deref_mut() {
            Some(t) if seg.residency.needs_remote(off, buf.len()) => {
                t.read(seg, off, buf.len(), Some(buf), token);
                true
            }
            _ => {
                self.note_local(seg);
                self.io.read_background(seg.file, off, buf, token);
                false
            }
        }
    }

    /// Issues a get's read of the block of `len` bytes at `off`; `buf`
    /// makes the buffer, only for a local read (a remote one completes
    /// with the bytes as fetched: `IoCompletion::remote_block`). Whether
    /// the remote tier serves it. A local read marks the block read, so
    /// that eviction keeps it (compaction's and exports' reads, through
    /// [`Reads::read`], do not).
    pub fn read_block(
        &mut self,
        seg: &Segment,
        off: u64,
        len: usize,
        token: u64,
        buf: impl FnOnce() -> AlignedBuf,
    ) -> bool {
        match self.tier.as_deref_mut() {
            Some(t) if seg.residency.needs_remote(off, len) => {
                t.read(seg, off, len, None, token);
                true
            }
            _ => {
                if self.tier.is_some() {
                    seg.residency.mark_read(off, len);
                }
                self.note_local(seg);
                self.io.read(seg.file, off, buf(), token);
                false
            }
        }
    }

    /// A read of `seg` served by the local disk: counted, and the file
    /// kept in the cache as recently used.
    fn note_local(&mut self, seg: &Segment) {
        if let Some(t) = self.tier.as_deref_mut() {
            t.stats.local_block_reads += 1;
            t.touch(seg);
        }
    }
}
