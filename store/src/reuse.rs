//! The memory of flushed memtables, kept for the next ones.
//!
//! A memtable's log chunks and index are anonymous memory. Mapped fresh
//! for every memtable, each page is zeroed and faulted in again: under
//! sustained puts (`stator-bench serve --put-percent 100`) the io_uring
//! worker that prefaults new chunks took a third of statord's CPU, a
//! third runnable thread on cores the shard and its clients already
//! fill. A flushed memtable's chunks hold nothing anyone reads again
//! (a log is read only where it was written), so they go to the next
//! memtables as they are; its index is cleared by the thread that
//! releases it, off the request path.
//!
//! It counts as memtable memory ([`Reuse::bytes`]): the memory budget
//! plans for two memtables, one flushing and one filling, and the filling
//! one draws from here. So a flushed memtable leaves behind only what the
//! memtables can still draw within those two ([`release`]'s `keep`: two
//! memtables' worth less the active one's log and any other frozen
//! one's): kept whole beside a full active memtable and a frozen one, it
//! made three memtables where the budget plans two (the hostile soak saw
//! the daemon's memory pass its budget by half). Keeping less than that
//! leaves the next memtable to fault in fresh chunks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::hugemem::HugeArray;
use crate::memtable::{CHUNK, Memtable};

/// Memory of flushed memtables (shared with the thread that releases
/// them).
pub struct Reuse {
    chunks: Mutex<Vec<HugeArray<u8>>>,
    index: Mutex<Option<HugeArray<u64>>>,
    max_chunks: usize,
    /// Bytes of memtables on their way here (see `release`): counted from
    /// the moment the shard lets go of them, so that the budget the shard
    /// sets its cache to right after a flush already leaves their room.
    incoming: AtomicUsize,
}

impl Reuse {
    /// Keeps up to `max_bytes` of log chunks, and one index.
    pub fn new(max_bytes: usize) -> Reuse {
        Reuse {
            chunks: Mutex::new(Vec::new()),
            index: Mutex::new(None),
            max_chunks: max_bytes / CHUNK,
            incoming: AtomicUsize::new(0),
        }
    }

    /// Fills the pool with chunks faulted in now, on this thread (see
    /// `StoreConfig::prefault_memory`).
    pub fn fill(&self) {
        let mut kept = lock(&self.chunks);
        while kept.len() < self.max_chunks {
            let mut c = HugeArray::zeroed(CHUNK);
            c.populate();
            kept.push(c);
        }
    }

    /// A log chunk, faulted in and ready to append to.
    pub fn take_chunk(&self) -> Option<HugeArray<u8>> {
        lock(&self.chunks).pop()
    }

    /// Whether an index of `len` slots is kept.
    pub fn has_index(&self, len: usize) -> bool {
        lock(&self.index).as_ref().is_some_and(|i| i.len() == len)
    }

    /// A zeroed index of exactly `len` slots.
    pub fn take_index(&self, len: usize) -> Option<HugeArray<u64>> {
        let mut ix = lock(&self.index);
        if ix.as_ref().is_some_and(|i| i.len() == len) {
            ix.take()
        } else {
            None
        }
    }

    /// Takes `m`'s memory for later memtables, up to `keep` bytes of log
    /// chunks in all (what does not fit is unmapped). Clears its index:
    /// call it off the request path.
    pub fn recycle(&self, m: Memtable, keep: usize) {
        let (chunks, mut index) = m.into_memory();
        let max_chunks = self.max_chunks.min(keep.div_ceil(CHUNK));
        {
            let mut kept = lock(&self.chunks);
            for c in chunks {
                if c.len() == CHUNK && kept.len() < max_chunks {
                    kept.push(c);
                }
            }
            // A pool kept for larger memtables than the budget affords
            // now (see `Store::memtable_limit`) gives the rest back.
            kept.truncate(max_chunks);
        }
        index.fill(0);
        let mut ix = lock(&self.index);
        if ix.as_ref().is_none_or(|i| i.len() <= index.len()) {
            *ix = Some(index);
        }
    }

    /// Gives back the log chunks held beyond `keep` bytes, unmapped on a
    /// helper thread (or here when none starts): the pool was kept for
    /// larger memtables than the budget affords now, and work admitted on
    /// its account (a compaction) needs the room before the next flush.
    pub fn trim(&self, keep: usize) {
        let extra = {
            let mut kept = lock(&self.chunks);
            let max_chunks = keep / CHUNK;
            if kept.len() <= max_chunks {
                return;
            }
            kept.split_off(max_chunks)
        };
        crate::helper::hand_off("stator-release", move || drop(extra));
    }

    /// Bytes of log chunks held (what the active memtable grows into).
    pub fn chunk_bytes(&self) -> usize {
        lock(&self.chunks).len() * CHUNK
    }

    /// Bytes of flushed memtables a helper thread is still clearing (or
    /// unmapping) on their way here: memory held as surely as a frozen
    /// memtable's.
    pub fn incoming_bytes(&self) -> usize {
        self.incoming.load(Ordering::Relaxed)
    }

    /// Bytes held, and on their way here.
    pub fn bytes(&self) -> usize {
        lock(&self.chunks).len() * CHUNK
            + lock(&self.index).as_ref().map_or(0, |i| i.len() * 8)
            + self.incoming_bytes()
    }
}

/// Hands a flushed memtable's memory to `reuse` (up to `keep` bytes of
/// log chunks in the pool, see [`Reuse::recycle`]) on a helper thread
/// (clearing a large index, or unmapping what is not kept, takes
/// milliseconds a shard must not spend), or drops it here when no thread
/// can be started. Another holder of `mem` (an export reading it) keeps
/// it alive, and it is simply dropped.
pub fn release(mem: Arc<Memtable>, reuse: &Arc<Reuse>, keep: usize) {
    let incoming = Incoming::new(reuse, mem.memory_bytes());
    // If no thread starts, the closure, and the memtable with it, is
    // dropped here.
    crate::helper::hand_off("stator-release", move || {
        if let Ok(m) = Arc::try_unwrap(mem) {
            incoming.0.recycle(m, keep);
        }
        drop(incoming);
    });
}

/// Bytes counted in [`Reuse::bytes`] until dropped.
pub(crate) struct Incoming(Arc<Reuse>, usize);

impl Incoming {
    pub(crate) fn new(reuse: &Arc<Reuse>, bytes: usize) -> Incoming {
        reuse.incoming.fetch_add(bytes, Ordering::Relaxed);
        Incoming(reuse.clone(), bytes)
    }
}

impl Drop for Incoming {
    fn drop(&mut self) {
        self.0.incoming.fetch_sub(self.1, Ordering::Relaxed);
    }
}

/// A poisoned lock only means a releasing thread panicked mid-push: the
/// vector is still whole.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bloom::hash;
    use crate::format::Kind;

    #[test]
    fn a_recycled_memtables_memory_serves_the_next_one() {
        let r = Reuse::new(4 * CHUNK);
        let mut m = Memtable::new(1 << 12);
        for i in 0u32..200_000 {
            let k = i.to_be_bytes();
            m.write(Kind::Put, &k, hash(&k), &[7; 40]);
        }
        let index_len = m.index_range().1 / 8;
        r.recycle(m, usize::MAX);
        assert_eq!(r.bytes(), 4 * CHUNK + index_len * 8, "capped at 4 chunks");
        let ix = r.take_index(index_len).expect("the index is kept");
        assert!(ix.iter().all(|&s| s == 0), "and cleared");
        let mut n = Memtable::with_index(1 << 12, Some(ix));
        // Two spares ahead, both from the pool: nothing to prefault.
        for _ in 0..3 {
            assert_eq!(n.keep_spares(|| r.take_chunk()), None);
        }
        assert_eq!(r.bytes(), 2 * CHUNK);
        for i in 0u32..100_000 {
            let k = i.to_be_bytes();
            n.write(Kind::Put, &k, hash(&k), &i.to_le_bytes());
        }
        for i in (0u32..100_000).step_by(997) {
            let k = i.to_be_bytes();
            assert_eq!(n.lookup(&k, hash(&k)).unwrap().value, i.to_le_bytes());
        }
    }

    #[test]
    fn the_pool_keeps_no_more_than_it_is_told_to() {
        let r = Reuse::new(64 * CHUNK);
        let fill = |n: u32| {
            let mut m = Memtable::new(1 << 12);
            for i in 0..n {
                let k = i.to_be_bytes();
                m.write(Kind::Put, &k, hash(&k), &[3; 100]);
            }
            m
        };
        let m = fill(100_000);
        let index = m.index_range().1;
        assert!(m.memory_bytes() - index > 4 * CHUNK, "more than it keeps");
        // Room for two chunks and a byte: three are kept.
        r.recycle(m, 2 * CHUNK + 1);
        assert_eq!(r.bytes(), 3 * CHUNK + index);
        // A pool at the bound keeps nothing more.
        r.recycle(fill(100_000), 3 * CHUNK);
        assert_eq!(r.bytes(), 3 * CHUNK + index);
        // A smaller bound (smaller memtables, see `Store::memtable_limit`)
        // gives back what is kept beyond it.
        r.recycle(fill(100_000), CHUNK);
        assert_eq!(r.bytes(), CHUNK + index);
        r.recycle(fill(100_000), 0);
        assert_eq!(r.bytes(), index);
    }

    #[test]
    fn a_released_memtable_counts_from_the_moment_it_is_let_go() {
        let r = Arc::new(Reuse::new(64 * CHUNK));
        let mut m = Memtable::new(1 << 12);
        for i in 0u32..50_000 {
            let k = i.to_be_bytes();
            m.write(Kind::Put, &k, hash(&k), &[1; 40]);
        }
        let bytes = m.memory_bytes();
        release(Arc::new(m), &r, usize::MAX);
        assert!(r.bytes() > 0, "counted before the helper ran");
        let t = std::time::Instant::now();
        while r.incoming.load(Ordering::Relaxed) > 0 {
            assert!(t.elapsed().as_secs() < 30, "the helper never finished");
            std::thread::yield_now();
        }
        let kept = r.bytes();
        assert!(kept > 0 && kept <= bytes, "kept {kept} of {bytes}");
    }
}
