//! systemd's notification protocol (`sd_notify(3)`), through the
//! `sd-notify` crate: nothing is sent unless `NOTIFY_SOCKET` is set.
//!
//! - `READY=1` once the control socket listens and every store is open
//!   ([`Daemon::start`](crate::Daemon::start) has returned);
//! - `STATUS=` with sessions, shards and the request rate, refreshed by
//!   the [`Notifier`] thread;
//! - `WATCHDOG=1` every half `WATCHDOG_USEC`, only while every shard's
//!   loop keeps moving ([`Liveness`]): a stuck shard stops the pings, and
//!   systemd restarts the daemon;
//! - `STOPPING=1` when shutdown begins.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sd_notify::NotifyState;

use crate::shard::Live;

/// Whether every shard moved lately.
#[derive(Debug)]
pub struct Liveness {
    /// Per shard: the last beat seen and when it last changed.
    last: Vec<(u64, Instant)>,
    /// How long a beat may stand still before its shard counts as stuck.
    stall: Duration,
}

impl Liveness {
    /// For `shards` shards, seen alive at `now`.
    pub fn new(shards: usize, stall: Duration, now: Instant) -> Liveness {
        Liveness {
            last: vec![(0, now); shards],
            stall,
        }
    }

    /// Records `beats` seen at `now`; the shards whose beat has not moved
    /// for longer than the stall limit.
    pub fn stuck(&mut self, beats: &[u64], now: Instant) -> Vec<usize> {
        let mut stuck = Vec::new();
        for (i, (&b, last)) in beats.iter().zip(self.last.iter_mut()).enumerate() {
            if b != last.0 {
                *last = (b, now);
            } else if now.duration_since(last.1) > self.stall {
                stuck.push(i);
            }
        }
        stuck
    }
}

/// The thread that refreshes `STATUS=` and pings the watchdog.
pub struct Notifier {
    stop: Sender<()>,
    thread: Option<JoinHandle<()>>,
}

/// The status line: sessions, shards, requests per second.
pub fn status_line(sessions: usize, shards: usize, rate: f64, stuck: &[usize]) -> String {
    let mut s = format!("{sessions} sessions, {shards} shards, {rate:.0} requests/s");
    if !stuck.is_empty() {
        s.push_str(&format!("; shards not moving: {stuck:?}"));
    }
    s
}

impl Notifier {
    /// Sends `READY=1` with a first status, then starts the thread when
    /// `NOTIFY_SOCKET` is set (`None` otherwise). `sessions` reads the
    /// open sessions.
    pub fn start(
        live: Vec<Arc<Live>>,
        sessions: impl Fn() -> usize + Send + 'static,
    ) -> Option<Notifier> {
        let status = status_line(sessions(), live.len(), 0.0, &[]);
        if let Err(e) = sd_notify::notify(&[NotifyState::Ready, NotifyState::Status(&status)]) {
            tracing::warn!(error = %e, "cannot notify systemd");
        }
        std::env::var_os("NOTIFY_SOCKET")?;
        let watchdog = sd_notify::watchdog_enabled();
        // Ping twice per watchdog period; refresh the status every 5 s
        // without one. An idle shard's loop moves each second, so a beat
        // standing still for 3 s (or half the period, if longer) is stuck.
        let period = watchdog.map_or(Duration::from_secs(5), |w| {
            (w / 2).max(Duration::from_millis(10))
        });
        let stall = watchdog.map_or(Duration::from_secs(3), |w| {
            (w / 2).max(Duration::from_secs(3))
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("statord-notify".into())
            .spawn(move || run(rx, live, sessions, period, stall, watchdog.is_some()))
            .ok()?;
        Some(Notifier {
            stop: tx,
            thread: Some(thread),
        })
    }

    /// Stops the thread and sends `STOPPING=1`.
    pub fn stopping(mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = sd_notify::notify(&[NotifyState::Stopping, NotifyState::Status("stopping")]);
    }
}

fn run(
    stop: Receiver<()>,
    live: Vec<Arc<Live>>,
    sessions: impl Fn() -> usize,
    period: Duration,
    stall: Duration,
    watchdog: bool,
) {
    let mut liveness = Liveness::new(live.len(), stall, Instant::now());
    let requests = || -> u64 { live.iter().map(|l| l.ops.total()).sum() };
    let (mut last_requests, mut last_at) = (requests(), Instant::now());
    let mut warned = false;
    loop {
        match stop.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let now = Instant::now();
        let beats: Vec<u64> = live
            .iter()
            .map(|l| l.beat.load(Ordering::Relaxed))
            .collect();
        let stuck = liveness.stuck(&beats, now);
        let r = requests();
        let rate =
            r.saturating_sub(last_requests) as f64 / now.duration_since(last_at).as_secs_f64();
        (last_requests, last_at) = (r, now);
        let status = status_line(sessions(), live.len(), rate, &stuck);
        let mut states = vec![NotifyState::Status(&status)];
        if stuck.is_empty() {
            warned = false;
            if watchdog {
                states.push(NotifyState::Watchdog);
            }
        } else if !warned {
            warned = true;
            tracing::error!(
                ?stuck,
                "shards stopped moving: no watchdog pings until they do"
            );
        }
        let _ = sd_notify::notify(&states);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_that_stands_still_past_the_limit_is_stuck() {
        let t0 = Instant::now();
        let s = Duration::from_secs(3);
        let mut l = Liveness::new(2, s, t0);
        assert!(l.stuck(&[1, 1], t0 + Duration::from_secs(1)).is_empty());
        // Shard 1 stands still; within the limit it is not stuck yet.
        assert!(l.stuck(&[5, 1], t0 + Duration::from_secs(3)).is_empty());
        assert_eq!(l.stuck(&[9, 1], t0 + Duration::from_secs(5)), vec![1]);
        // It moves again: alive.
        assert!(l.stuck(&[12, 2], t0 + Duration::from_secs(6)).is_empty());
        assert_eq!(l.stuck(&[12, 3], t0 + Duration::from_secs(10)), vec![0]);
    }

    #[test]
    fn the_status_line_names_stuck_shards() {
        assert_eq!(
            status_line(3, 2, 1234.4, &[]),
            "3 sessions, 2 shards, 1234 requests/s"
        );
        assert!(status_line(0, 2, 0.0, &[1]).ends_with("shards not moving: [1]"));
    }
}
