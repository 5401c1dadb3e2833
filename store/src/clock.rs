//! The time the store and the shard decide by (background steps' slices
//! and pacing, retries, stall timing): the wall clock, or, on a thread
//! that asked for one, a simulated clock, so that a seeded simulation of a
//! shard (tests/sim.rs) replays exactly.
//!
//! The simulated clock starts where the wall clock stood when it was
//! turned on and moves only by [`advance`], and by a microsecond at each
//! reading: a loop that reads the clock until a deadline ends after as
//! many readings as it would take in that many microseconds, whatever the
//! machine's speed.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// The simulated time of this thread, when simulated.
    static SIMULATED: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// A simulated clock moves by this at each reading.
const TICK: Duration = Duration::from_micros(1);

/// Now: the wall clock's, or this thread's simulated time (which then
/// moves by a tick).
pub fn now() -> Instant {
    SIMULATED.with(|c| match c.get() {
        None => Instant::now(),
        Some(t) => {
            c.set(Some(t + TICK));
            t
        }
    })
}

/// Time since `t`, by [`now`].
pub fn elapsed(t: Instant) -> Duration {
    now().saturating_duration_since(t)
}

/// Turns this thread's simulated clock on (from the wall clock's now), or
/// off.
pub fn simulate(on: bool) {
    SIMULATED.with(|c| c.set(on.then(Instant::now)));
}

/// Whether this thread's clock is simulated: work a shard would hand to a
/// helper thread is then done at once, on this thread, so that its timing
/// depends on nothing but the run.
pub fn simulated() -> bool {
    SIMULATED.with(|c| c.get().is_some())
}

/// Moves this thread's simulated clock on by `d` (nothing when it is not
/// simulated).
pub fn advance(d: Duration) {
    SIMULATED.with(|c| c.set(c.get().map(|t| t + d)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simulated_clock_moves_only_when_read_or_advanced() {
        simulate(true);
        let t0 = now();
        assert_eq!(now() - t0, TICK);
        advance(Duration::from_secs(5));
        assert_eq!(elapsed(t0), Duration::from_secs(5) + 2 * TICK);
        assert!(simulated());
        simulate(false);
        assert!(!simulated());
    }
}
