//! State ids whose records no one can name any more (the daemon dropped
//! their names: a finished job's), so that compaction leaves them out.
//!
//! Ids are handed out in increasing order and never reused, so a dropped
//! id is any id below the registry's next one that is not live: a set the
//! size of the live registry, whatever has been dropped before. An older
//! version of it never drops an id a newer one keeps: an id dropped stays
//! dropped, and ids handed out later are not below its bound.

use std::collections::HashSet;

/// Which state ids are dropped (see the module doc).
#[derive(Debug, Default, Clone)]
pub struct DroppedStates {
    /// Ids at or above it were not handed out when this was made.
    below: u32,
    /// Ids below `below` that are still registered.
    live: HashSet<u32>,
}

impl DroppedStates {
    /// Ids below `below` but those in `live` are dropped.
    pub fn new(below: u32, live: impl IntoIterator<Item = u32>) -> DroppedStates {
        DroppedStates {
            below,
            live: live.into_iter().filter(|&id| id < below).collect(),
        }
    }

    /// Whether records of state `id` are dropped.
    pub fn contains(&self, id: u32) -> bool {
        id < self.below && !self.live.contains(&id)
    }

    /// Whether no id is dropped.
    pub fn is_empty(&self) -> bool {
        self.live.len() as u64 >= u64::from(self.below)
    }
}

/// [`DroppedStates::contains`] for a run of sorted keys, which mostly
/// share their state id: one set lookup per change of id.
#[derive(Debug, Default)]
pub struct DroppedFilter {
    states: Option<std::sync::Arc<DroppedStates>>,
    last: Option<(u32, bool)>,
}

impl DroppedFilter {
    pub fn new(states: Option<std::sync::Arc<DroppedStates>>) -> DroppedFilter {
        DroppedFilter {
            states: states.filter(|s| !s.is_empty()),
            last: None,
        }
    }

    /// Whether the record with encoded key `key` is dropped.
    pub fn drops(&mut self, key: &[u8]) -> bool {
        let Some(s) = &self.states else { return false };
        let Some(id) = crate::keys::state_id(key) else {
            return false;
        };
        match self.last {
            Some((last, dropped)) if last == id => dropped,
            _ => {
                let dropped = s.contains(id);
                self.last = Some((id, dropped));
                dropped
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_below_the_bound_that_are_not_live_are_dropped() {
        let d = DroppedStates::new(10, [1, 4, 12]);
        assert!(d.contains(2) && d.contains(9) && d.contains(0));
        assert!(!d.contains(1) && !d.contains(4));
        // Handed out after it was made: never dropped by it.
        assert!(!d.contains(10) && !d.contains(12));
        assert!(!d.is_empty());
        assert!(DroppedStates::new(3, [0, 1, 2]).is_empty());
        assert!(DroppedStates::default().is_empty());
    }

    #[test]
    fn the_filter_reads_the_state_id_of_each_key() {
        let d = std::sync::Arc::new(DroppedStates::new(10, [1]));
        let mut f = DroppedFilter::new(Some(d));
        let key = |state: u32| {
            let mut k = Vec::new();
            crate::keys::encode_base(&mut k, 7, state, b"k", b"");
            k
        };
        assert!(!f.drops(&key(1)));
        assert!(f.drops(&key(2)));
        assert!(f.drops(&key(2)));
        assert!(!f.drops(&key(1)));
        assert!(!f.drops(&key(11)));
        assert!(!DroppedFilter::new(None).drops(&key(2)));
    }
}
