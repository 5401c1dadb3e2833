//! Pacing: the part of a shard's time that flushes and compactions take
//! while requests are waiting.
//!
//! Background work runs on the shard's own thread in bounded steps. Run a
//! step after every pass over the queues and, while a flush is under way,
//! the steps take most of the thread: puts measured 150 K/s during a
//! flush's writes against 1.5 M/s outside it, every request in flight
//! waiting behind them. Instead the caller says how long it spent on
//! requests ([`crate::Store::note_foreground`]) and background steps earn
//! time in proportion: a share of a quarter while writes have room,
//! growing to all of it as the room runs out (see
//! `Store::background_share`). A pass that found no request runs short
//! steps: the next request (a task that reads one key at a time sends it
//! microseconds after the last answer) waits for the step under way. Such
//! passes leave the background free once no request came for [`QUIET`],
//! or while something presses (a share above [`BASE_SHARE`]: writes short
//! of room, a checkpoint waiting for a flush or for compaction). Without
//! pressure, in a synchronous task's gaps of a few microseconds a free
//! step began before nearly every read, and a Flink job ran at a third of
//! its rate for the seconds of a compaction (benches/RESULTS.md, "The
//! job's compaction seconds"); there steps take their share.

use std::time::{Duration, Instant};

/// How long without a request before passes leave background work free.
pub(crate) const QUIET: Duration = Duration::from_micros(50);

/// A time budget for background steps, earned by foreground work.
#[derive(Debug)]
pub(crate) struct Pacer {
    /// Nanoseconds background steps may still take (negative: owed).
    credit: f64,
    /// Steps run freely: the caller spent no time on requests lately
    /// (or never says), or writes have no room left.
    unpaced: bool,
    /// The caller's last pass found no request (it said so): steps run
    /// short, since a request may arrive at any moment and would wait for
    /// the step in progress.
    idle: bool,
    /// When the caller last said it spent time on requests.
    last_busy: Option<Instant>,
}

impl Default for Pacer {
    fn default() -> Pacer {
        Pacer {
            credit: 0.0,
            unpaced: true,
            idle: false,
            last_busy: None,
        }
    }
}

/// The share background work has while nothing presses it (writes have
/// room, no checkpoint waits).
pub(crate) const BASE_SHARE: f64 = 0.25;

impl Pacer {
    /// The caller spent `busy` on requests; background work is owed
    /// `share` of the time (0.0 to 1.0), holding at most `cap` in hand.
    pub(crate) fn foreground(&mut self, busy: Duration, share: f64, cap: Duration) {
        if busy.is_zero() {
            // Free after a quiet spell, or at once while something presses
            // (writes short of room, a checkpoint waiting): see the module
            // doc.
            self.unpaced = share > BASE_SHARE
                || self
                    .last_busy
                    .is_none_or(|t| crate::clock::elapsed(t) >= QUIET);
        } else {
            self.unpaced = false;
            self.last_busy = Some(crate::clock::now());
        }
        // Short even while the room falls: full steps between
        // one-at-a-time requests cut such a caller's rate to a tenth (a
        // Flink job measured 60 K records/s against 100-125 K in a
        // flush's second). Not once writes are out of room.
        self.idle = busy.is_zero() && share < 1.0;
        if share >= 1.0 {
            self.unpaced = true;
            return;
        }
        let earned = busy.as_nanos() as f64 * share / (1.0 - share);
        self.credit = (self.credit + earned).min(cap.as_nanos() as f64);
    }

    /// Whether a background step may run now.
    pub(crate) fn allows(&self) -> bool {
        self.unpaced || self.credit > 0.0
    }

    /// No request will come (a drain): steps run freely and in full.
    pub(crate) fn unpace(&mut self) {
        self.unpaced = true;
        self.idle = false;
    }

    /// Whether steps should be short: the caller is between requests
    /// (see `idle`).
    pub(crate) fn idle(&self) -> bool {
        self.idle
    }

    /// A background step took `d`.
    pub(crate) fn spent(&mut self, d: Duration) {
        // What steps take while no request waits is not owed later.
        if !self.unpaced {
            self.credit -= d.as_nanos() as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn background_gets_its_share_of_the_foreground_time() {
        let mut p = Pacer::default();
        assert!(p.allows(), "a caller that never says is never paced");
        p.foreground(3 * MS, 0.25, 10 * MS);
        assert!(p.allows());
        p.spent(MS / 2);
        assert!(p.allows(), "1 ms earned, 0.5 ms spent");
        p.spent(MS);
        assert!(!p.allows(), "overspent");
        p.foreground(3 * MS, 0.25, 10 * MS);
        assert!(p.allows(), "the debt is paid");
    }

    #[test]
    fn idle_means_the_caller_said_it_found_no_request() {
        let mut p = Pacer::default();
        assert!(!p.idle(), "a caller that never says gets full steps");
        p.foreground(Duration::ZERO, 0.25, 10 * MS);
        assert!(p.idle());
        p.foreground(MS, 0.25, 10 * MS);
        assert!(!p.idle(), "a pass with requests");
        p.foreground(Duration::ZERO, 0.5, 10 * MS);
        assert!(p.idle(), "between requests while the room falls");
        p.foreground(Duration::ZERO, 1.0, 10 * MS);
        assert!(!p.idle(), "writes out of room: the flush takes full steps");
        p.foreground(Duration::ZERO, BASE_SHARE, 10 * MS);
        p.unpace();
        assert!(p.allows() && !p.idle(), "a drain: full steps");
    }

    #[test]
    fn idle_passes_and_a_full_share_leave_background_free() {
        let mut p = Pacer::default();
        p.foreground(MS, 0.25, 10 * MS);
        p.spent(5 * MS);
        assert!(!p.allows());
        p.foreground(Duration::ZERO, 0.25, 10 * MS);
        assert!(!p.allows(), "a gap between requests: still owed");
        p.foreground(Duration::ZERO, 0.5, 10 * MS);
        assert!(p.allows(), "a gap while a checkpoint waits: free");
        p.foreground(Duration::ZERO, 0.25, 10 * MS);
        std::thread::sleep(QUIET);
        p.foreground(Duration::ZERO, 0.25, 10 * MS);
        assert!(p.allows(), "no requests for a while: background is free");
        p.foreground(MS, 1.0, 10 * MS);
        assert!(p.allows(), "no room left: background takes what it needs");
    }

    #[test]
    fn credit_in_hand_is_capped() {
        let mut p = Pacer::default();
        p.foreground(100 * MS, 0.5, MS);
        p.spent(2 * MS);
        assert!(!p.allows(), "only 1 ms could be held");
    }
}
