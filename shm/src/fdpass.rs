//! Passing file descriptors between processes with `SCM_RIGHTS`.
//!
//! A message carries a small payload and up to [`MAX_FDS`] descriptors. The
//! receiver gets `OwnedFd`s with `CLOEXEC` set, so nothing leaks into a
//! child process, and a message whose descriptors were cut short by the
//! kernel (`MSG_CTRUNC`) is an error after closing what did arrive.

use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, UnixAddr, recvmsg, sendmsg};

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 8;

/// Errors passing descriptors.
#[derive(Debug, thiserror::Error)]
pub enum FdPassError {
    #[error("too many descriptors in one message: {0} > {MAX_FDS}")]
    TooMany(usize),
    #[error("sendmsg failed: {0}")]
    Send(nix::Error),
    #[error("recvmsg failed: {0}")]
    Recv(nix::Error),
    #[error("the peer closed the socket")]
    Closed,
    #[error("short send: {sent} of {len} payload bytes")]
    ShortSend { sent: usize, len: usize },
    #[error("descriptors were truncated by the kernel (MSG_CTRUNC); all received ones were closed")]
    Truncated,
}

/// Sends `payload` and `fds` as one message. The payload must be non-empty
/// (a zero-byte stream message cannot carry ancillary data reliably).
pub fn send_fds(
    sock: &UnixStream,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
) -> Result<(), FdPassError> {
    if fds.len() > MAX_FDS {
        return Err(FdPassError::TooMany(fds.len()));
    }
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let cmsgs: &[ControlMessage<'_>] = if raw.is_empty() { &[] } else { &cmsg };
    let iov = [IoSlice::new(payload)];
    let sent = sendmsg::<UnixAddr>(sock.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None)
        .map_err(FdPassError::Send)?;
    if sent != payload.len() {
        return Err(FdPassError::ShortSend {
            sent,
            len: payload.len(),
        });
    }
    Ok(())
}

/// Receives one message into `buf`; returns the payload length and the
/// descriptors that came with it (possibly none).
pub fn recv_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>), FdPassError> {
    let mut cmsg_buf = nix::cmsg_space!([RawFd; MAX_FDS]);
    let mut iov = [IoSliceMut::new(buf)];
    let msg = loop {
        match recvmsg::<UnixAddr>(
            sock.as_raw_fd(),
            &mut iov,
            Some(&mut cmsg_buf),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::Error::EINTR) => continue,
            r => break r.map_err(FdPassError::Recv)?,
        }
    };
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(FdPassError::Recv)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            for fd in raw {
                // SAFETY: the kernel just installed `fd` in our table for us;
                // nobody else owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        drop(fds);
        return Err(FdPassError::Truncated);
    }
    let n = msg.bytes;
    if n == 0 && fds.is_empty() {
        return Err(FdPassError::Closed);
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Segment;
    use std::os::fd::AsFd;

    #[test]
    fn segment_travels_with_scm_rights() {
        let (a, b) = UnixStream::pair().unwrap();
        let seg = Segment::create(c"pass", 4096).unwrap();
        seg.view().write_from(0, b"across").unwrap();
        send_fds(&a, b"seg", &[seg.fd()]).unwrap();
        let mut buf = [0u8; 16];
        let (n, mut fds) = recv_fds(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"seg");
        assert_eq!(fds.len(), 1);
        let other = Segment::attach(fds.pop().unwrap()).unwrap();
        let mut got = [0u8; 6];
        other.view().read_into(0, &mut got).unwrap();
        assert_eq!(&got, b"across");
        // Writes are visible both ways.
        other.view().write_from(8, b"back").unwrap();
        let mut back = [0u8; 4];
        seg.view().read_into(8, &mut back).unwrap();
        assert_eq!(&back, b"back");
    }

    #[test]
    fn closed_peer_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut buf = [0u8; 4];
        assert!(matches!(recv_fds(&b, &mut buf), Err(FdPassError::Closed)));
    }

    #[test]
    fn too_many_fds_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let fds: Vec<_> = (0..MAX_FDS + 1).map(|_| a.as_fd()).collect();
        assert!(matches!(
            send_fds(&a, b"x", &fds),
            Err(FdPassError::TooMany(_))
        ));
    }
}
