//! Cross-process test plumbing: the test binary re-runs itself as the peer
//! process (an `#[ignore]`d test selected with `--exact --ignored`), and the
//! two meet on a Unix socket where the segment and doorbells are passed
//! with SCM_RIGHTS.
#![allow(dead_code)]

use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

pub const SOCK_ENV: &str = "STATOR_TEST_PEER_SOCK";

/// Starts this test binary as a child running only `peer_test`, and
/// returns it with the parent's end of the socket.
pub fn spawn_peer(peer_test: &str) -> (Child, UnixStream, PathBuf) {
    let dir = std::env::temp_dir().join(format!("stator-ring-{}-{peer_test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("peer.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            peer_test,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(SOCK_ENV, &path)
        // The child's own test-harness summary would read like ours.
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (sock, _) = listener.accept().unwrap();
    (child, sock, dir)
}

/// In the child: connects to the parent, receives `n` fds and a payload.
pub fn connect_peer(n: usize) -> Option<(UnixStream, Vec<OwnedFd>, Vec<u8>)> {
    let path = std::env::var_os(SOCK_ENV)?;
    let sock = UnixStream::connect(path).unwrap();
    let mut buf = vec![0u8; 256];
    let (len, fds) = stator_shm::fdpass::recv_fds(&sock, &mut buf).unwrap();
    assert_eq!(fds.len(), n, "expected {n} fds");
    buf.truncate(len);
    Some((sock, fds, buf))
}
