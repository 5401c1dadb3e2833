//! What a shard publishes about itself for the status socket and the
//! watchdog, without a lock or a locked instruction on its hot path:
//!
//! - [`OpMetrics`]: per-operation request and error counters and latency
//!   histograms. Only the shard thread writes them, so an update is a plain
//!   load and store of a relaxed atomic; readers see each counter whole.
//! - [`ShardReport`]: its sessions, store memory and counters and retained
//!   checkpoints, rebuilt a few times a second into a mutex the status
//!   socket reads.
//!
//! Latency is the daemon's part of a request: from the pass that takes
//! its descriptor off the submission queue to the pass that pushes its
//! completion. Requests answered in the same pass share that pass's time.
//! `ChunkRelease` and `SnapshotImport` are not timed: they complete when
//! the export has the next chunk ready or the disk has caught up with the
//! import (flow control, not service time). A request counts as an error
//! when its completion carries a failure status (`NotFound` is not one).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use stator_ring::Opcode;
use stator_store::{CheckpointInfo, MemoryUsage, StoreStats};

/// Opcodes counted (`Opcode::ALL`); index `OPS` counts unknown ones.
pub const OPS: usize = 18;
/// Latency buckets: upper bounds 2^10 ns (~1 us) ... 2^33 ns (~8.6 s),
/// then one for everything slower.
pub const BUCKETS: usize = 25;
const FIRST_SHIFT: u32 = 10;

const _: () = assert!(Opcode::ALL.len() == OPS);

/// Adds `n` to a counter only the calling thread writes.
#[inline]
fn bump(a: &AtomicU64, n: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// The bucket of a latency of `ns` nanoseconds.
#[inline]
pub fn bucket_of(ns: u64) -> usize {
    if ns <= 1 << FIRST_SHIFT {
        return 0;
    }
    let log = 64 - (ns - 1).leading_zeros();
    ((log - FIRST_SHIFT) as usize).min(BUCKETS - 1)
}

/// Upper bound of bucket `i` in seconds (infinite for the last).
pub fn bucket_bound_s(i: usize) -> f64 {
    if i + 1 >= BUCKETS {
        f64::INFINITY
    } else {
        (1u64 << (FIRST_SHIFT as usize + i)) as f64 / 1e9
    }
}

/// A latency histogram with power-of-two buckets (single writer).
#[derive(Debug)]
pub struct Hist {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

impl Default for Hist {
    fn default() -> Self {
        Hist {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// A histogram read at one moment (buckets not cumulative).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HistSnapshot {
    pub buckets: [u64; BUCKETS],
    pub sum_ns: u64,
}

impl HistSnapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    pub fn add(&mut self, o: &HistSnapshot) {
        for (a, b) in self.buckets.iter_mut().zip(o.buckets) {
            *a += b;
        }
        self.sum_ns += o.sum_ns;
    }

    /// The upper bound (seconds) of the bucket holding quantile `q`, or
    /// `None` when empty.
    pub fn quantile_bound_s(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let want = ((n as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= want {
                return Some(bucket_bound_s(i));
            }
        }
        Some(f64::INFINITY)
    }
}

impl Hist {
    /// Adds `n` observations of `ns` nanoseconds (the owning thread only).
    #[inline]
    pub fn record(&self, ns: u64, n: u64) {
        bump(&self.buckets[bucket_of(ns)], n);
        bump(&self.sum_ns, ns.saturating_mul(n));
    }

    pub fn read(&self) -> HistSnapshot {
        HistSnapshot {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            sum_ns: self.sum_ns.load(Ordering::Relaxed),
        }
    }
}

/// Per-operation counters and latencies of one shard (single writer).
#[derive(Debug)]
pub struct OpMetrics {
    /// Descriptors taken, by opcode (`OPS` = unknown opcode).
    requests: [AtomicU64; OPS + 1],
    /// Completions with a failure status, by opcode.
    errors: [AtomicU64; OPS + 1],
    latency: [Hist; OPS],
}

impl Default for OpMetrics {
    fn default() -> Self {
        OpMetrics {
            requests: std::array::from_fn(|_| AtomicU64::new(0)),
            errors: std::array::from_fn(|_| AtomicU64::new(0)),
            latency: std::array::from_fn(|_| Hist::default()),
        }
    }
}

/// Whether `op`'s latency is recorded (see the module doc).
#[inline]
pub fn timed(op: Opcode) -> bool {
    !matches!(op, Opcode::ChunkRelease | Opcode::SnapshotImport)
}

/// Index of a wire opcode byte.
#[inline]
pub fn op_index(opcode: u8) -> usize {
    (opcode as usize).min(OPS)
}

/// The metric label of op index `i`: `map_get`, `checkpoint`, `unknown`.
pub fn op_name(i: usize) -> String {
    let Some(op) = Opcode::ALL.get(i) else {
        return "unknown".into();
    };
    let mut s = String::new();
    for (k, c) in format!("{op:?}").chars().enumerate() {
        if c.is_ascii_uppercase() && k > 0 {
            s.push('_');
        }
        s.push(c.to_ascii_lowercase());
    }
    s
}

impl OpMetrics {
    #[inline]
    pub fn request(&self, opcode: u8) {
        bump(&self.requests[op_index(opcode)], 1);
    }

    #[inline]
    pub fn error(&self, opcode: u8) {
        bump(&self.errors[op_index(opcode)], 1);
    }

    #[inline]
    pub fn latency(&self, op: Opcode, ns: u64, n: u64) {
        if timed(op) {
            self.latency[op as usize].record(ns, n);
        }
    }

    /// Requests taken so far, of every opcode.
    pub fn total(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| r.load(Ordering::Relaxed))
            .sum()
    }

    pub fn read(&self) -> OpSnapshot {
        OpSnapshot {
            requests: std::array::from_fn(|i| self.requests[i].load(Ordering::Relaxed)),
            errors: std::array::from_fn(|i| self.errors[i].load(Ordering::Relaxed)),
            latency: std::array::from_fn(|i| self.latency[i].read()),
        }
    }
}

/// [`OpMetrics`] read at one moment (and summed over shards).
#[derive(Clone, Debug)]
pub struct OpSnapshot {
    pub requests: [u64; OPS + 1],
    pub errors: [u64; OPS + 1],
    pub latency: [HistSnapshot; OPS],
}

impl Default for OpSnapshot {
    fn default() -> Self {
        OpSnapshot {
            requests: [0; OPS + 1],
            errors: [0; OPS + 1],
            latency: std::array::from_fn(|_| HistSnapshot::default()),
        }
    }
}

impl OpSnapshot {
    pub fn add(&mut self, o: &OpSnapshot) {
        for i in 0..=OPS {
            self.requests[i] += o.requests[i];
            self.errors[i] += o.errors[i];
        }
        for (a, b) in self.latency.iter_mut().zip(&o.latency) {
            a.add(b);
        }
    }
}

/// Requests of one pass that completed at once, counted by opcode so the
/// histogram is touched once per opcode per pass, not once per request.
pub struct Tally {
    n: [u32; OPS],
    any: bool,
}

impl Default for Tally {
    fn default() -> Self {
        Tally {
            n: [0; OPS],
            any: false,
        }
    }
}

impl Tally {
    #[inline]
    pub fn add(&mut self, op: Opcode) {
        if timed(op) {
            self.n[op as usize] += 1;
            self.any = true;
        }
    }

    /// Records every counted request with latency `ns` and starts over.
    pub fn record(&mut self, m: &OpMetrics, ns: u64) {
        if !self.any {
            return;
        }
        for (i, n) in self.n.iter_mut().enumerate() {
            if *n > 0 {
                m.latency[i].record(ns, *n as u64);
                *n = 0;
            }
        }
        self.any = false;
    }
}

/// A session as the status socket shows it.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct SessionReport {
    /// The session's id (unique while the daemon runs).
    pub id: u64,
    /// The shard that serves it.
    pub shard: usize,
    pub job: String,
    pub operator: String,
    /// Its subtask index, parallelism and maximum parallelism (the number
    /// of key groups), as its Open said.
    pub subtask: u32,
    pub parallelism: u32,
    pub max_parallelism: u32,
    /// The key groups it owns, `lo..=hi`.
    pub key_group_lo: u16,
    pub key_group_hi: u16,
    /// States it registered.
    pub states: usize,
    /// Requests in the daemon (taken, not yet completed).
    pub in_flight: u32,
    /// Descriptors waiting in its submission queue.
    pub sq_depth: u32,
    /// Completions its client has not reaped yet.
    pub cq_depth: u32,
    pub sq_entries: u32,
    pub cq_entries: u32,
    /// Requests taken so far.
    pub requests: u64,
    /// It broke the queue protocol: told so (QUEUE_BROKEN) and closed.
    pub broken: bool,
    /// When it opened, seconds since the Unix epoch.
    pub opened_unix: u64,
    /// A portable snapshot export or import is under way.
    pub export_in_progress: bool,
    pub import_in_progress: bool,
}

/// What a shard last reported.
#[derive(Clone, Debug)]
pub struct ShardReport {
    /// When it was built: a shard that stops reporting is stuck.
    pub at: Instant,
    pub sessions: Vec<SessionReport>,
    pub memory: MemoryUsage,
    pub store: StoreStats,
    pub checkpoints: Vec<CheckpointInfo>,
    /// The remote client's live counters (with the tier on).
    pub remote: Option<Arc<stator_store::remote::RemoteStats>>,
}

impl Default for ShardReport {
    fn default() -> Self {
        ShardReport {
            at: Instant::now(),
            sessions: Vec::new(),
            memory: MemoryUsage::default(),
            store: StoreStats::default(),
            checkpoints: Vec::new(),
            remote: None,
        }
    }
}

/// The published report of a shard: swapped whole, so neither side holds
/// the lock for more than a pointer copy.
#[derive(Debug, Default)]
pub struct Report(Mutex<Arc<ShardReport>>);

impl Report {
    pub fn get(&self) -> Arc<ShardReport> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Publishes `r`; the previous report is freed outside the lock.
    pub fn set(&self, r: ShardReport) {
        let old = std::mem::replace(
            &mut *self.0.lock().unwrap_or_else(|p| p.into_inner()),
            Arc::new(r),
        );
        drop(old);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two_from_one_microsecond() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1024), 0);
        assert_eq!(bucket_of(1025), 1);
        assert_eq!(bucket_of(2048), 1);
        assert_eq!(bucket_of(2049), 2);
        assert_eq!(bucket_of(1 << 33), BUCKETS - 2);
        assert_eq!(bucket_of((1 << 33) + 1), BUCKETS - 1);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        for ns in [1u64, 999, 1024, 5000, 1 << 20, 3 << 30] {
            let i = bucket_of(ns);
            assert!(ns as f64 / 1e9 <= bucket_bound_s(i));
            if i > 0 {
                assert!(ns as f64 / 1e9 > bucket_bound_s(i - 1));
            }
        }
    }

    #[test]
    fn tally_records_once_per_opcode_and_quantiles_follow() {
        let m = OpMetrics::default();
        let mut t = Tally::default();
        for _ in 0..99 {
            t.add(Opcode::Get);
        }
        t.add(Opcode::Put);
        t.record(&m, 3000);
        m.latency(Opcode::Get, 5_000_000, 1);
        let s = m.read();
        let g = &s.latency[Opcode::Get as usize];
        assert_eq!(g.count(), 100);
        assert_eq!(g.sum_ns, 99 * 3000 + 5_000_000);
        assert_eq!(
            g.quantile_bound_s(0.5),
            Some(bucket_bound_s(bucket_of(3000)))
        );
        assert_eq!(
            g.quantile_bound_s(1.0),
            Some(bucket_bound_s(bucket_of(5_000_000)))
        );
        assert_eq!(s.latency[Opcode::Put as usize].count(), 1);
        assert_eq!(op_name(Opcode::MapGet as usize), "map_get");
        assert_eq!(op_name(OPS), "unknown");
    }
}
