//! The daemon's life: SIGTERM answers what is in flight, exits 0 and keeps
//! the state for a restart; a daemon SIGKILLed with calls pending fails
//! them with a clear error (batch and async APIs); a bad configuration is
//! an error that names the key.

mod common;

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use common::{Daemon, collect, opts, run};
use stator_client::{AsyncSession, Error, Kind, Session, Status, ValueState};

fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_answers_in_flight_exits_zero_and_state_survives_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let mut d = Daemon::start_in(tmp.path(), 64, &[]);
    let mut o = opts("durable", 0, 1);
    o.sq_entries = 8192;
    o.cq_entries = 8192;
    let mut s = Session::open(&d.socket, &o).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    for k in 0..5000u64 {
        s.submit(
            &st.put((k % 128) as u16, &k.to_be_bytes(), &k.to_le_bytes()),
            k,
        )
        .unwrap();
    }
    s.flush().unwrap();
    // SIGTERM with the puts possibly still queued: each is answered.
    d.signal(libc::SIGTERM);
    let mut acked = 0;
    let r = collect(&mut s, 5000, |_, c| {
        assert_eq!(c.status, Ok(Status::Ok));
        acked += 1;
    });
    assert!(r.is_ok() || acked == 5000, "{r:?} after {acked} acks");
    assert!(
        d.wait_exit(Duration::from_secs(30)).success(),
        "statord exits 0 on SIGTERM"
    );
    // The session notices the daemon is gone.
    let e = s
        .wait(Some(Duration::from_secs(2)))
        .and_then(|()| run(&mut s, &st.get(0, b"x")).map(|_| ()));
    assert!(matches!(e, Err(Error::DaemonGone(_))), "{e:?}");

    let d = Daemon::start_in(tmp.path(), 64, &[]);
    let mut s = Session::open(&d.socket, &opts("durable", 0, 1)).unwrap();
    let st2 = ValueState(s.register("v", Kind::Value).unwrap());
    assert_eq!(st2, st, "a state keeps its id across restarts");
    for k in (0..5000u64).step_by(37) {
        let got = run(&mut s, &st.get((k % 128) as u16, &k.to_be_bytes())).unwrap();
        assert_eq!(got.value.as_deref(), Some(&k.to_le_bytes()[..]), "key {k}");
    }
}

#[test]
fn a_killed_daemon_fails_pending_calls_with_a_clear_error() {
    let d = Daemon::start(64);
    let mut s = Session::open(&d.socket, &opts("victim", 0, 1)).unwrap();
    let st = ValueState(s.register("v", Kind::Value).unwrap());
    run(&mut s, &st.put(1, b"k", b"v")).unwrap();
    let a = AsyncSession::new(Session::open(&d.socket, &opts("victim", 0, 1)).unwrap()).unwrap();
    let ast = ValueState(a.register("v", Kind::Value).unwrap());
    assert_eq!(
        block_on(a.read(&ast.get(1, b"k"))).unwrap().as_deref(),
        Some(&b"v"[..])
    );

    // Frozen, so the calls stay pending; then killed.
    d.freeze();
    s.submit(&st.get(1, b"k"), 1).unwrap();
    s.flush().unwrap();
    let a2 = a.clone();
    let pending = std::thread::spawn(move || block_on(a2.read(&ast.get(1, b"k"))));
    std::thread::sleep(Duration::from_millis(100));
    d.signal(libc::SIGKILL);
    let t = Instant::now();
    let e = loop {
        match s.poll(|_| panic!("a frozen daemon answered")) {
            Err(e) => break e,
            Ok(_) => {
                if let Err(e) = s.wait(Some(Duration::from_millis(200))) {
                    break e;
                }
            }
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the batch API hangs");
    };
    assert!(matches!(e, Error::DaemonGone(_)), "{e}");
    assert!(e.to_string().contains("statord is gone"), "{e}");
    let r = pending.join().unwrap();
    assert!(matches!(r, Err(Error::DaemonGone(_))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5));
    // Later calls fail at once too.
    assert!(matches!(
        s.submit(&st.get(1, b"k"), 2),
        Err(Error::DaemonGone(_))
    ));
    assert!(matches!(
        block_on(a.read(&ast.get(1, b"k"))),
        Err(Error::DaemonGone(_))
    ));
}

#[test]
fn a_bad_configuration_names_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("bad.toml");
    for (text, key) in [
        ("shardz = 2\n", "shardz"),
        ("[session]\nsq_entries = 100\n", "session.sq_entries"),
        ("spin_us = \"fast\"\n", "spin_us"),
    ] {
        std::fs::write(&cfg, text).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_statord"))
            .arg("--config")
            .arg(&cfg)
            .args(["--run-dir", "/nonexistent-never-created"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{text}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(key), "{text}: {err}");
    }
}
