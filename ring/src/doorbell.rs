//! Doorbells: one eventfd per direction, rung only when the other side said
//! it sleeps, and the spin-then-sleep wait built on them.
//!
//! Why spin at all: a wake-up through an eventfd costs a syscall on each
//! side and a scheduler round trip (tens of microseconds); a peer that
//! answers within a few microseconds is cheaper to wait for on the CPU. Why
//! bound the spin: on this 2-core machine two spinning processes own both
//! cores, and a third runnable process then stalls them for milliseconds, so
//! an idle side must sleep soon. [`WaitPolicy::spin`] is that bound.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::queue::{Consumer, Producer, QueueError, Slots};
use crate::sync::spin_hint;

/// An eventfd used as a doorbell. The daemon creates both of a session's
/// doorbells and passes them to the client, so it never has to trust an fd
/// the client chose.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
}

impl Doorbell {
    /// A new non-blocking, close-on-exec eventfd.
    pub fn new() -> std::io::Result<Doorbell> {
        let fd = OwnedFd::from(EventFd::from_value_and_flags(
            0,
            EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC,
        )?);
        Ok(Doorbell { fd })
    }

    /// Wraps an eventfd received from the peer.
    pub fn from_fd(fd: OwnedFd) -> Doorbell {
        Doorbell { fd }
    }

    /// The eventfd, to pass to the peer or to watch in an event loop.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Wakes the sleeper. Never blocks: the eventfd is non-blocking and a
    /// counter near overflow (EAGAIN) already means "woken".
    pub fn ring(&self) {
        let _ = nix::unistd::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Clears pending rings without blocking.
    pub fn drain(&self) {
        let mut b = [0u8; 8];
        let _ = nix::unistd::read(&self.fd, &mut b);
    }

    /// Sleeps until rung or until `timeout` passes (`None`: forever).
    /// Returns true when rung. Clears the ring it consumed.
    pub fn wait(&self, timeout: Option<Duration>) -> std::io::Result<bool> {
        let t = match timeout {
            None => PollTimeout::NONE,
            // Round up: a sub-millisecond rest must sleep, not busy-poll.
            Some(d) => {
                PollTimeout::try_from(d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32)
                    .unwrap_or(PollTimeout::MAX)
            }
        };
        let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLIN)];
        loop {
            match poll(&mut fds, t) {
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(0) => return Ok(false),
                Ok(_) => {
                    self.drain();
                    return Ok(true);
                }
            }
        }
    }
}

impl AsRawFd for Doorbell {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.fd.as_raw_fd()
    }
}

/// How long to spin before sleeping on a doorbell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    /// Spin (re-checking shared memory, no syscalls) at most this long, then
    /// sleep. Zero sleeps at once. Default [`WaitPolicy::DEFAULT_SPIN`].
    pub spin: Duration,
}

impl WaitPolicy {
    /// 50 us: longer than a daemon round trip (a few us), far shorter than
    /// the scheduler's time slice, so a quiet peer sleeps almost at once.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
    /// Never spin.
    pub const SLEEP: WaitPolicy = WaitPolicy {
        spin: Duration::ZERO,
    };
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            spin: Self::DEFAULT_SPIN,
        }
    }
}

/// The result of a wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waited {
    /// The condition held before we slept (spinning found it).
    Ready,
    /// The condition holds after sleeping on the doorbell at least once.
    Woken,
    /// The deadline passed first.
    TimedOut,
}

/// Errors while waiting.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error(transparent)]
    Queue(#[from] QueueError),
    #[error("waiting on the doorbell failed: {0}")]
    Io(#[from] std::io::Error),
}

fn remaining(deadline: Option<Instant>) -> Option<Option<Duration>> {
    match deadline {
        None => Some(None),
        Some(d) => {
            let now = Instant::now();
            if now >= d { None } else { Some(Some(d - now)) }
        }
    }
}

/// Generic spin-then-sleep: `check` says whether we may proceed,
/// `prepare` announces sleep and re-checks (Dekker), `end` clears the flag.
fn wait_with(
    bell: &Doorbell,
    policy: WaitPolicy,
    deadline: Option<Instant>,
    mut check: impl FnMut() -> Result<bool, QueueError>,
    mut prepare: impl FnMut() -> Result<bool, QueueError>,
    end: impl Fn(),
) -> Result<Waited, WaitError> {
    if check()? {
        return Ok(Waited::Ready);
    }
    if !policy.spin.is_zero() {
        let start = Instant::now();
        let mut n = 0u32;
        loop {
            spin_hint();
            if check()? {
                return Ok(Waited::Ready);
            }
            n = n.wrapping_add(1);
            // Reading the clock costs ~20 ns; check it every 64 rounds.
            if n.is_multiple_of(64) && start.elapsed() >= policy.spin {
                break;
            }
        }
    }
    let mut slept = false;
    loop {
        if prepare()? {
            return Ok(if slept { Waited::Woken } else { Waited::Ready });
        }
        let Some(timeout) = remaining(deadline) else {
            end();
            return Ok(Waited::TimedOut);
        };
        let r = bell.wait(timeout);
        slept = true;
        end();
        r?;
        if check()? {
            return Ok(Waited::Woken);
        }
    }
}

/// Waits until `c` has entries, spinning per `policy`, then sleeping on
/// `bell` (the doorbell the producer rings).
pub fn wait_available<T, S: Slots<T>>(
    c: &mut Consumer<'_, T, S>,
    bell: &Doorbell,
    policy: WaitPolicy,
    deadline: Option<Instant>,
) -> Result<Waited, WaitError> {
    let c = std::cell::RefCell::new(c);
    wait_with(
        bell,
        policy,
        deadline,
        || Ok(c.borrow_mut().available()? > 0),
        || c.borrow_mut().prepare_sleep(),
        || c.borrow().end_sleep(),
    )
}

/// Waits until `p` has a free slot, spinning per `policy`, then sleeping on
/// `bell` (the doorbell the consumer rings when it releases).
pub fn wait_space<T, S: Slots<T>>(
    p: &mut Producer<'_, T, S>,
    bell: &Doorbell,
    policy: WaitPolicy,
    deadline: Option<Instant>,
) -> Result<Waited, WaitError> {
    let p = std::cell::RefCell::new(p);
    wait_with(
        bell,
        policy,
        deadline,
        || Ok(p.borrow_mut().free()? > 0),
        || p.borrow_mut().prepare_wait(),
        || p.borrow().end_wait(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_then_wait_returns_at_once_and_clears() {
        let b = Doorbell::new().unwrap();
        b.ring();
        b.ring();
        assert!(b.wait(Some(Duration::from_secs(5))).unwrap());
        assert!(
            !b.wait(Some(Duration::from_millis(1))).unwrap(),
            "rings were consumed"
        );
    }

    #[test]
    fn wait_across_threads() {
        let b = std::sync::Arc::new(Doorbell::new().unwrap());
        let b2 = b.clone();
        let t = std::thread::spawn(move || b2.wait(Some(Duration::from_secs(10))).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        b.ring();
        assert!(t.join().unwrap());
    }
}
