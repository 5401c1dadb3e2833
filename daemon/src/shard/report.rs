//! What a shard publishes about itself (sessions, store, checkpoints)
//! for the status socket.

use super::*;

impl<I: Io> Shard<I> {
    /// Rebuilds the report if asked to, or if it is [`REPORT_EVERY`] old.
    pub(super) fn maybe_report(&mut self, now: Instant, reported: &mut Instant) {
        let age = now.duration_since(*reported);
        // Asked for (a session came or went, a checkpoint completed): soon,
        // but at most every 20 ms, so a burst of them costs one rebuild.
        if (self.report_now && age >= Duration::from_millis(20)) || age >= REPORT_EVERY {
            *reported = now;
            self.report_now = false;
            self.report();
        }
    }

    /// Rebuilds the published report: sessions, store, checkpoints.
    pub(super) fn report(&mut self) {
        let shard = self.id;
        // Dropped jobs' states reach compaction within a report's period.
        self.store
            .set_dropped_states(self.view.get().dropped().clone());
        let sessions = self
            .sessions
            .iter_mut()
            .map(|(_, s)| {
                let (sq_depth, cq_free) = s.mem.with_dependent_mut(|_, ring| {
                    (
                        ring.sq.available().unwrap_or(0),
                        ring.cq.free_now().unwrap_or(0),
                    )
                });
                SessionReport {
                    id: s.id,
                    shard,
                    job: s.job.clone(),
                    operator: s.operator.clone(),
                    subtask: s.subtask.0,
                    parallelism: s.subtask.1,
                    max_parallelism: s.subtask.2,
                    key_group_lo: s.key_groups.0,
                    key_group_hi: s.key_groups.1,
                    states: s.states.len(),
                    in_flight: s.in_flight,
                    sq_depth,
                    cq_depth: s.entries.1.saturating_sub(cq_free),
                    sq_entries: s.entries.0,
                    cq_entries: s.entries.1,
                    requests: s.requests,
                    broken: s.broken,
                    opened_unix: s.opened_unix,
                    export_in_progress: s.export.as_ref().is_some_and(|e| e.id.is_some()),
                    import_in_progress: s.import.is_some(),
                }
            })
            .collect();
        let r = ShardReport {
            at: Instant::now(),
            sessions,
            memory: self.store.memory(),
            store: self.store.stats(),
            checkpoints: self.store.checkpoints(),
            remote: self.store.remote_stats().map(|(_, r)| r),
        };
        self.live.report.set(r);
    }
}
