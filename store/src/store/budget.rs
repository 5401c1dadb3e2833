//! The memory budget, split: memtables, segments' indexes and filters,
//! background work (flushes, compactions, exports, imports) and the block
//! cache.
//!
//! Indexes and filters grow with the state, and so does background work:
//! a compaction holds an index and filter as large as all of its inputs'
//! while it builds its output, and a compaction of every layer is as large
//! as all of them. The memtables give way: the size the active memtable
//! freezes at (the *limit*) is what the budget leaves for two memtables
//! (one flushing, one filling) and a flush's sort once the indexes and
//! filters, the compaction running or waiting to start, the writers, the
//! snapshots in progress and a sixteenth of the budget for the cache are
//! planned for; never above the configured size, nor under an eighth of
//! it. A compaction starts only when it fits beside the memtables as they
//! are (`compaction_fits`); until then the plan holds its place, so the
//! next memtables are smaller, and it starts a flush later. The cache gets
//! what is left at each rebalance. A full `stator-bench load` run, where
//! only the cache gave way, held 338 MiB against a 256 MiB budget; planning
//! a compaction of every layer at all times kept it but shrank the
//! memtable to its floor (benches/RESULTS.md).

use super::*;
use crate::memtable::{CHUNK, SPARES_AHEAD};

/// The plan keeps a sixteenth of the budget for the block cache.
const CACHE_FLOOR_DIVISOR: usize = 16;
/// The memtable limit never falls under an eighth of the configured size
/// (past that the budget is too small for the state, and is passed).
const LIMIT_FLOOR_DIVISOR: usize = 8;

impl<I: Io> Store<I> {
    /// Memory in use, by part.
    pub fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            memtables: self.active.memory_bytes()
                + self.reuse.bytes()
                + self.next_index.as_ref().map_or(0, |i| i.len() * 8)
                + self.frozen_bytes(),
            block_cache: self.cache.bytes(),
            indexes_and_filters: self
                .segments
                .iter()
                .map(|s| s.memory_bytes())
                .sum::<usize>()
                + self.cache.slot_bytes(),
            background: self.background_bytes(),
            checkpoints: self.ckpt.memory_bytes(),
            budget: self.cfg.memory_budget,
            memtable_limit: self.memtable_limit,
        }
    }

    /// The log bytes at which the active memtable freezes now (see the
    /// module doc).
    pub(super) fn memtable_limit(&self) -> usize {
        self.memtable_limit
    }

    /// What a flush or compaction in progress may hold (see
    /// [`MemoryUsage::background`]).
    /// Per job: its write buffers (in flight, one filling, the tail); for
    /// a flush its sort (64 bytes per live key, see `crate::sorted`, and
    /// the last one's kept for the next) and its output's filter (built as
    /// records come, 10 bits a key); for a compaction its read-ahead and
    /// its output's index and filter as they are built.
    pub(super) fn background_bytes(&self) -> usize {
        let flush = self.flush.as_ref().map_or(0, |j| {
            segment::WRITER_BYTES
                + j.mem.len() * bloom::BITS_PER_KEY / 8
                + match &j.order {
                    FlushOrder::Sorting(s) => s.bytes(),
                    FlushOrder::Sorted(s, _) => s.bytes(),
                }
        });
        flush
            + self.sort_buffers.bytes()
            + self
                .compact
                .as_ref()
                .map_or(0, |j| segment::WRITER_BYTES + j.reserve)
            + self.snapshot_reserves()
    }

    /// What exports and imports in progress reserve.
    fn snapshot_reserves(&self) -> usize {
        self.exports
            .iter()
            .map(|(_, e)| e.memory(&self.frozen))
            .sum::<usize>()
            + self.imports.iter().map(|(_, i)| i.reserve()).sum::<usize>()
    }

    /// The memory the budget plans for memtables now (see
    /// [`Store::memtable_plan_for`]).
    pub(super) fn memtable_plan(&self) -> usize {
        self.memtable_plan_for(self.memtable_limit)
    }

    /// The memory two memtables of `limit` bytes of log take: two full
    /// ones (one flushing, one filling), each its log and its index (as
    /// large as the largest one now: small records grow an index past the
    /// size it starts with), and the filling one's chunks mapped ahead.
    fn memtable_plan_for(&self, limit: usize) -> usize {
        let index = std::iter::once(&self.active)
            .chain(self.frozen.iter().map(|(_, m)| &**m))
            .map(|m| m.index_range().1)
            .max()
            .unwrap_or(0)
            .max(Memtable::index_len(initial_entries(&self.cfg)) * 8);
        2 * (limit.next_multiple_of(CHUNK) + index) + (SPARES_AHEAD + 1) * CHUNK
    }

    /// The memtable limit the budget affords beside `m`'s indexes and
    /// filters (see the module doc).
    fn plan_memtable_limit(&self, m: &MemoryUsage) -> usize {
        let configured = self.cfg.memtable_bytes();
        // A flush's writer and a compaction's; the compaction running or
        // the one waiting to start (see `Store::compaction_fits`).
        let compaction = self
            .compact
            .as_ref()
            .map_or(self.compaction_wanted, |j| j.reserve);
        let fixed = m.resident_metadata()
            + 2 * segment::WRITER_BYTES
            + compaction
            + self.snapshot_reserves()
            + self.cfg.memory_budget / CACHE_FLOOR_DIVISOR
            + self.memtable_plan_for(0);
        // Per byte of log: two memtables', and a flush's sort and filter
        // per key (keys per byte as in the active memtable; 256-byte
        // records until it has some). A sort's buffers kept from a larger
        // memtable (up to twice what it needed) count as they are.
        let record = match self.active.len() {
            n if n >= 1024 => self.active.log_bytes() / n,
            _ => 256,
        }
        .max(1);
        let filter = bloom::BITS_PER_KEY.div_ceil(8);
        let room = |fixed: usize, per_key: usize| {
            let room = self.cfg.memory_budget.saturating_sub(fixed) as u128;
            (room * record as u128 / (2 * record + per_key) as u128) as usize
        };
        let planned = room(fixed, crate::sorted::BYTES_PER_KEY + filter);
        let sort = match &self.flush {
            Some(FlushJob {
                order: FlushOrder::Sorting(s),
                ..
            }) => s.bytes(),
            Some(FlushJob {
                order: FlushOrder::Sorted(s, _),
                ..
            }) => s.bytes(),
            None => self.sort_buffers.bytes(),
        };
        let limit = if sort > planned / record * crate::sorted::BYTES_PER_KEY {
            room(fixed + sort, filter)
        } else {
            planned
        };
        limit.clamp(configured / LIMIT_FLOOR_DIVISOR, configured)
    }

    /// Whether a compaction that holds `reserve` may start: the memtables
    /// (as planned, or as they are if more), indexes and filters,
    /// background work and the cache's floor leave room for it. If not,
    /// [`Store::want_compaction`] plans the memtables smaller and the
    /// compaction starts once they have come down (a flush later); or at
    /// once when the memtables are already at their floor (the budget is
    /// then too small for the state, and is passed), or when checkpoints
    /// wait for the backlog.
    pub(super) fn compaction_fits(&self, reserve: usize) -> bool {
        let m = self.memory();
        // The reuse pool's chunks beyond the plan are given back when a
        // compaction starts on their account (`trim_reuse_to_plan`): a
        // store without writes makes no flush that would give them back,
        // and a compaction waited forever on an idle store.
        let held = m.memtables.saturating_sub(self.reuse.chunk_bytes());
        let need = self.memtable_plan().max(held)
            + m.resident_metadata()
            + m.background
            + segment::WRITER_BYTES
            + reserve
            + self.cfg.memory_budget / CACHE_FLOOR_DIVISOR;
        // Nor does a backlog wait that checkpoints wait for: room comes
        // only with a flush, and a store without writes makes none.
        need <= self.cfg.memory_budget
            || self.memtable_limit <= self.cfg.memtable_bytes() / LIMIT_FLOOR_DIVISOR
            || self.checkpoint_should_wait()
    }

    /// Gives back the reuse pool's chunks that the memtables' plan has no
    /// room for (see `compaction_fits`, which admits a compaction on their
    /// account).
    pub(super) fn trim_reuse_to_plan(&mut self) {
        let m = self.memory();
        let held = m.memtables.saturating_sub(self.reuse.chunk_bytes());
        self.reuse.trim(self.memtable_plan().saturating_sub(held));
    }

    /// Records the reserve of the compaction waiting to start (0: none)
    /// and plans for it.
    pub(super) fn want_compaction(&mut self, reserve: usize) {
        if self.compaction_wanted != reserve {
            self.compaction_wanted = reserve;
            self.rebalance_cache();
        }
    }

    /// Plans the memtable limit for what the indexes, filters and
    /// background work hold now, and gives the cache what the budget
    /// leaves.
    pub(super) fn rebalance_cache(&mut self) {
        let m = self.memory();
        self.memtable_limit = self.plan_memtable_limit(&m);
        // The active memtable grows to its limit before the next rebalance
        // (at its freeze): the cache leaves room for all of it, so the
        // memtables, the cache and the indexes together stay in budget.
        // What it grows into from the reuse pool is counted already.
        let growth = self
            .memtable_limit
            .saturating_sub(self.active.log_bytes() + self.reuse.chunk_bytes());
        let others = m.memtables + growth + m.resident_metadata() + m.background;
        let left = self.cfg.memory_budget.saturating_sub(others);
        self.cache
            .set_budget(self.cfg.block_cache_max.map_or(left, |m| m.min(left)));
    }
}

#[cfg(test)]
mod tests {
    use crate::io::SyncIo;
    use crate::reuse::Incoming;
    use crate::{Store, StoreConfig};

    /// A flushed memtable a helper thread is still clearing holds its
    /// memory: writes get that much less room, and the store counts as
    /// busy so its caller looks again soon rather than sleep a second
    /// while writes wait (under CPU contention such memtables piled up
    /// past the budget while writes went on).
    #[test]
    fn memtables_being_cleared_take_room_from_writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
        cfg.memtable_bytes = Some(8 << 20);
        let (s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
        let room = s.write_room();
        assert!(!s.busy());
        let clearing = Incoming::new(&s.reuse, 4 << 20);
        assert_eq!(s.write_room(), room - (4 << 20));
        assert!(s.busy(), "writes wait for the clearing thread");
        drop(clearing);
        assert_eq!(s.write_room(), room);
        assert!(!s.busy());
    }

    /// Pacing leaves memtables being cleared out of the room (no flush
    /// step frees them sooner), while writes count them; with background
    /// work failing the room is unbounded either way (it once overflowed,
    /// adding them back to an unbounded room).
    #[test]
    fn pacing_leaves_memtables_being_cleared_out() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = StoreConfig::new(dir.path(), 64 << 20);
        cfg.memtable_bytes = Some(8 << 20);
        let (mut s, _) = Store::open(cfg, SyncIo::new(false)).unwrap();
        let key = crate::KeyRef {
            key_group: 0,
            state: 1,
            key: b"k",
            namespace: b"",
        };
        s.write_batch(&[crate::Op::Put(key, &[7; 100])]).unwrap();
        s.flush();
        assert!(!s.frozen.is_empty(), "a memtable waits for its flush");
        let m = s.memtable_limit().next_multiple_of(crate::memtable::CHUNK);
        let clearing = Incoming::new(&s.reuse, m);
        assert!(s.headroom() < s.flush_headroom());
        s.stats.last_background_error = Some(crate::StoreError::Invalid("a test's failure"));
        assert_eq!(s.write_room(), usize::MAX);
        assert_eq!((s.headroom(), s.flush_headroom()), (1.0, 1.0));
        drop(clearing);
    }
}
