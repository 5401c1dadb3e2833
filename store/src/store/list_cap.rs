//! The list cap: a list holds at most `StoreConfig::max_list_len` bytes of
//! encoded elements ([`MAX_LIST_LEN`] by default, and at most), so that a
//! flush or a compaction that joins a list's layers never passes what a
//! record's `u32` length holds, nor what an engine can take in one array.
//!
//! An append is a blind merge: its list's length lives in older layers,
//! which an append does not read. It is bounded instead from what memory
//! knows of each layer: a memtable knows its part of every list exactly
//! (each `Merge` record carries its chain's bytes), and a segment's index
//! bounds the value of any key it may hold by its block's length
//! (`Segment::value_bound`). An append is refused when that bound, plus
//! the append, passes the cap; it may therefore be refused up to a page
//! per layer early, or while an older copy of a replaced list waits for a
//! compaction. Most appends are decided by the active memtable and two
//! sums, without another lookup.

use super::*;

/// The largest list a store holds (encoded elements, `u32 len | bytes`
/// each): 1 GiB, half of the largest array a JVM allocates.
pub const MAX_LIST_LEN: usize = 1 << 30;

impl<I: Io> Store<I> {
    /// Refuses a list of `len` encoded bytes past the cap.
    pub(super) fn check_list_len(&self, len: usize) -> Result<(), StoreError> {
        if len > self.cfg.max_list_len {
            return Err(StoreError::TooLarge {
                what: "list",
                len,
                max: self.cfg.max_list_len,
            });
        }
        Ok(())
    }

    /// Refuses an append of `add` encoded bytes to the list at `key` (hash
    /// `h`) that might take it past the cap; `active` is what the active
    /// memtable holds of it (`Memtable::list_head`, which the append
    /// then writes onto).
    pub(super) fn check_list_room(
        &self,
        key: &[u8],
        h: u64,
        add: usize,
        active: Option<ListBytes>,
    ) -> Result<(), StoreError> {
        let cap = self.cfg.max_list_len as u64;
        let refuse = |len: u64| {
            Err(StoreError::TooLarge {
                what: "list (bounded from above, after this append)",
                len: usize::try_from(len).unwrap_or(usize::MAX),
                max: cap as usize,
            })
        };
        let within = |len: u64| if len > cap { refuse(len) } else { Ok(()) };
        let mut total = add as u64;
        if let Some(l) = active {
            total += l.bytes;
            if l.decided {
                return within(total);
            }
        }
        // Every older layer at its largest: enough for almost every append.
        let coarse: u64 = self
            .frozen
            .iter()
            .map(|(_, m)| m.log_bytes() as u64)
            .chain(self.segments.iter().map(|s| s.index.largest() as u64))
            .sum();
        if total + coarse <= cap {
            return Ok(());
        }
        for (order, mem) in &self.frozen {
            if self.masked_order(*order, key) {
                continue;
            }
            if let Some(l) = mem.list_bytes(key, h) {
                total += l.bytes;
                if l.decided {
                    return within(total);
                }
            }
        }
        for seg in &self.segments {
            if !self.masked_order(seg.footer.order, key) {
                total += seg.value_bound(key, h);
            }
        }
        within(total)
    }
}
