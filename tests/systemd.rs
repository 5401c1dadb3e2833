//! systemd's notification protocol, emulated: a datagram socket stands in
//! for `NOTIFY_SOCKET`, and a real `statord` talks to it. `READY=1` comes
//! only once the control socket answers; `WATCHDOG=1` comes every half
//! `WATCHDOG_USEC` while the shards run; `STATUS=` counts sessions;
//! `STOPPING=1` comes at SIGTERM, and the daemon exits 0.

mod common;

use std::os::unix::net::{UnixDatagram, UnixStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use stator_client::{OpenOptions, Session};

fn next(sock: &UnixDatagram) -> String {
    let mut buf = vec![0u8; 4096];
    let n = sock
        .recv(&mut buf)
        .expect("a notification within the timeout");
    String::from_utf8(buf[..n].to_vec()).expect("utf-8")
}

#[test]
fn ready_watchdog_status_and_stopping_over_notify_socket() {
    let tmp = tempfile::tempdir().unwrap();
    let notify = tmp.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let control = tmp.path().join("run/stator.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_statord"))
        .arg("--data-dir")
        .arg(tmp.path().join("data"))
        .arg("--run-dir")
        .arg(tmp.path().join("run"))
        .args(["--shards", "2", "--memory-budget-mib", "128"])
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "200000")
        .env("STATOR_LOG", "warn")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn statord");

    // READY=1 first, and by then the control socket answers.
    let first = next(&sock);
    assert!(first.contains("READY=1"), "{first:?}");
    assert!(first.contains("STATUS=0 sessions, 2 shards"), "{first:?}");
    UnixStream::connect(&control).expect("the control socket listens at READY=1");

    // Pings every 100 ms while the shards run.
    let t = Instant::now();
    let mut pings = 0;
    while pings < 5 {
        let m = next(&sock);
        if m.contains("WATCHDOG=1") {
            pings += 1;
        }
    }
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "5 pings took {:?}",
        t.elapsed()
    );

    // The status counts sessions.
    let s = Session::open(&control, &OpenOptions::new("systemd-test", "op")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = next(&sock);
        if m.contains("STATUS=1 sessions, 2 shards") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no status with the session: {m:?}"
        );
    }
    s.close().unwrap();

    // SIGTERM: STOPPING=1, then exit 0.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = next(&sock);
        if m.contains("STOPPING=1") {
            break;
        }
        assert!(Instant::now() < deadline, "no STOPPING=1");
    }
    let status = child.wait().unwrap();
    assert!(status.success(), "statord exited with {status}");
}
