//! A sleeper: what a thread other than the session's caller sleeps on
//! while requests are in flight (the asynchronous state backend's reaper).
//!
//! It holds duplicates of the session's doorbell and control socket and an
//! eventfd of its own, so it sleeps without holding the session: the
//! thread arms the doorbell under the session (`arm`), sleeps here, and
//! disarms under the session again. Another thread ends a sleep early with
//! `wake` (the task thread does after a call of its own that may have
//! disarmed the doorbell the reaper armed).

use std::os::fd::{AsFd, OwnedFd};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::error::Fail;
use crate::session::JniSession;

/// What ended a sleep (bits of `sleep`'s result).
pub const WOKE_BELL: i32 = 1;
pub const WOKE_SOCKET: i32 = 2;
pub const WOKE_WAKE: i32 = 4;

pub struct Sleeper {
    bell: OwnedFd,
    sock: OwnedFd,
    wake: EventFd,
}

impl Sleeper {
    pub fn new(s: &JniSession) -> Result<Sleeper, Fail> {
        let [bell, sock] = s.s.event_fds();
        let dup = |fd: std::os::fd::BorrowedFd<'_>| {
            fd.try_clone_to_owned()
                .map_err(|e| Fail::arg(format!("duplicating a session fd: {e}")))
        };
        Ok(Sleeper {
            bell: dup(bell)?,
            sock: dup(sock)?,
            wake: EventFd::from_flags(EfdFlags::EFD_NONBLOCK | EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Fail::arg(format!("creating an eventfd: {e}")))?,
        })
    }

    /// Sleeps up to `ms` on the doorbell, the control socket and the wake
    /// fd; returns which were readable (`WOKE_*` bits), having drained the
    /// wake fd. The doorbell is drained by the session's `disarm`.
    pub fn sleep(&self, ms: u16) -> Result<i32, Fail> {
        let mut fds = [
            PollFd::new(self.bell.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.sock.as_fd(), PollFlags::POLLIN),
            PollFd::new(self.wake.as_fd(), PollFlags::POLLIN),
        ];
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Fail::arg(format!("polling the session's fds: {e}"))),
        }
        let ready = |f: &PollFd| f.revents().is_some_and(|r| !r.is_empty());
        let mut woke = 0;
        if ready(&fds[0]) {
            woke |= WOKE_BELL;
        }
        if ready(&fds[1]) {
            woke |= WOKE_SOCKET;
        }
        if ready(&fds[2]) {
            woke |= WOKE_WAKE;
            // Non-blocking: another waker's count may have been read already.
            let _ = self.wake.read();
        }
        Ok(woke)
    }

    /// Ends the current (or the next) sleep.
    pub fn wake(&self) -> Result<(), Fail> {
        match self.wake.write(1) {
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => Ok(()),
            Err(e) => Err(Fail::arg(format!("waking a sleeper: {e}"))),
        }
    }
}
