//! The remote tier's client against a real S3-compatible server on
//! loopback (`s3s-fs`'s file system behind `s3s`, served in-process:
//! `common/s3.rs`) and against a local directory:
//! uploads (single and multipart), coalesced ranged GETs thousands at once,
//! listing and deleting; the server stopped (requests that need it fail
//! clearly and alone), restarted (the tier recovers, every uploaded object
//! is intact), and slow (latency injected by a proxy: nothing times out
//! that should not).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::s3::{Fault, Proxy, Server, s3};

use stator_store::remote::{
    Remote, RemoteConfig, RemoteDone, RemoteError, RemoteRuntime, Target, object_store,
};

fn client(rt: &RemoteRuntime, target: Target, f: impl FnOnce(&mut RemoteConfig)) -> Remote {
    let mut cfg = RemoteConfig::new(target);
    cfg.prefix = "tier".into();
    f(&mut cfg);
    let store = object_store(&cfg).expect("object store");
    Remote::new(store, cfg, rt.handle()).unwrap()
}

/// Polls until every outstanding request completed (within 60 s).
fn drain(r: &mut Remote) -> Vec<(u64, Result<RemoteDone, RemoteError>)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut out = Vec::new();
    while r.outstanding() > 0 {
        assert!(
            Instant::now() < deadline,
            "{} requests never completed",
            r.outstanding()
        );
        r.wait(Duration::from_millis(100));
        r.poll(|t, res| out.push((t, res)));
    }
    out.sort_by_key(|o| o.0);
    out
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 12) as u8)
        .collect()
}

/// Upload, list, thousands of ranged GETs (coalesced), a missing object,
/// delete: the same behaviour from S3 and from a directory.
fn round_trip(r: &mut Remote, tmp: &Path) {
    let small = pattern(100_000, 1);
    let large = pattern(20 << 20, 2); // multipart
    for (name, bytes) in [("a.sst", &small), ("b.sst", &large)] {
        let p = tmp.join(name);
        std::fs::write(&p, bytes).unwrap();
    }
    r.upload_file(1, "seg/a.sst", tmp.join("a.sst"));
    r.upload_file(2, "seg/b.sst", tmp.join("b.sst"));
    for (t, res) in drain(r) {
        assert!(
            matches!(res, Ok(RemoteDone::Uploaded)),
            "upload {t}: {res:?}"
        );
    }
    r.list(3, "seg");
    let listed = drain(r);
    let Ok(RemoteDone::Listed(mut names)) = listed.into_iter().next().unwrap().1 else {
        panic!("no listing")
    };
    names.sort();
    assert_eq!(
        names,
        [
            ("seg/a.sst".to_string(), small.len() as u64),
            ("seg/b.sst".to_string(), large.len() as u64)
        ]
    );

    // 3,000 4 KiB blocks of the large object, some adjacent, some repeated.
    let stats = r.stats();
    let mut want = Vec::new();
    let mut x = 12345u64;
    for t in 0..3000u64 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let block = (x >> 33) % (large.len() as u64 / 4096);
        want.push((t, block * 4096..block * 4096 + 4096));
    }
    let reqs: Vec<(u64, &str, std::ops::Range<u64>)> = want
        .iter()
        .map(|(t, r)| (*t, "seg/b.sst", r.clone()))
        .collect();
    r.get_blocks(&reqs);
    let got = drain(r);
    assert_eq!(got.len(), 3000);
    for ((t, res), (wt, range)) in got.into_iter().zip(&want) {
        assert_eq!(t, *wt);
        match res {
            Ok(RemoteDone::Bytes(b)) => assert_eq!(
                &b[..],
                &large[range.start as usize..range.end as usize],
                "block of token {t}"
            ),
            other => panic!("token {t}: {other:?}"),
        }
    }
    let gets = stats.gets.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        gets < 3000,
        "3,000 blocks of one 20 MiB object took {gets} GETs"
    );

    // A missing object fails its tokens at once, and only them.
    r.get_blocks(&[(7, "seg/missing.sst", 0..4096), (8, "seg/a.sst", 0..4096)]);
    let got = drain(r);
    assert!(
        matches!(&got[0].1, Err(RemoteError::NotFound { path }) if path.contains("missing")),
        "{:?}",
        got[0].1
    );
    assert!(matches!(&got[1].1, Ok(RemoteDone::Bytes(b)) if b[..] == small[..4096]));

    r.delete(9, "seg/a.sst");
    r.delete(10, "seg/never-there.sst");
    for (t, res) in drain(r) {
        assert!(
            matches!(res, Ok(RemoteDone::Deleted)),
            "delete {t}: {res:?}"
        );
    }
    r.list(11, "seg");
    let Ok(RemoteDone::Listed(names)) = drain(r).into_iter().next().unwrap().1 else {
        panic!("no listing")
    };
    assert_eq!(names.len(), 1);
}

#[test]
fn s3_round_trip_with_thousands_of_coalesced_gets() {
    let tmp = tempfile::tempdir().unwrap();
    let _server = Server::start(&tmp.path().join("s3"), 0);
    let rt = RemoteRuntime::new(1).unwrap();
    let mut r = client(&rt, s3(_server.port), |_| {});
    round_trip(&mut r, tmp.path());
}

#[test]
fn a_local_directory_behaves_the_same() {
    let tmp = tempfile::tempdir().unwrap();
    let rt = RemoteRuntime::new(1).unwrap();
    let mut r = client(
        &rt,
        Target::Local {
            dir: tmp.path().join("remote"),
        },
        |_| {},
    );
    round_trip(&mut r, tmp.path());
}

#[test]
fn a_stopped_server_fails_only_its_requests_and_a_restarted_one_serves_all() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("s3");
    let mut server = Server::start(&root, 0);
    let port = server.port;
    let rt = RemoteRuntime::new(1).unwrap();
    let mut r = client(&rt, s3(port), |c| {
        c.timeout = Duration::from_secs(2);
        c.retries = 2;
        c.backoff = Duration::from_millis(20);
    });
    let data = pattern(1 << 20, 3);
    std::fs::write(tmp.path().join("x.sst"), &data).unwrap();
    r.upload_file(1, "x.sst", tmp.path().join("x.sst"));
    assert!(matches!(drain(&mut r)[0].1, Ok(RemoteDone::Uploaded)));

    // Stopped: the GETs fail with an error naming the object and the
    // attempts; the client itself keeps working (a local tier beside it
    // on the same runtime is served meanwhile).
    server.stop();
    let mut local = client(
        &rt,
        Target::Local {
            dir: tmp.path().join("local"),
        },
        |_| {},
    );
    local.upload_file(5, "y.sst", tmp.path().join("x.sst"));
    r.get_blocks(&[(2, "x.sst", 0..4096), (3, "x.sst", 8192..12288)]);
    let t0 = Instant::now();
    let failed = drain(&mut r);
    assert!(t0.elapsed() < Duration::from_secs(30));
    for (t, res) in &failed {
        match res {
            Err(RemoteError::Failed { path, attempts, .. }) => {
                assert!(
                    path.ends_with("x.sst") && *attempts == 3,
                    "token {t}: {res:?}"
                )
            }
            other => panic!("token {t} did not fail clearly: {other:?}"),
        }
    }
    assert!(matches!(drain(&mut local)[0].1, Ok(RemoteDone::Uploaded)));

    // Restarted on the same data: everything uploaded before is intact.
    let server = Server::start(&server.root.clone(), port);
    r.get_blocks(&[(4, "x.sst", 0..(1 << 20))]);
    match &drain(&mut r)[0].1 {
        Ok(RemoteDone::Bytes(b)) => assert_eq!(&b[..], &data[..]),
        other => panic!("after the restart: {other:?}"),
    }
    drop(server);
}

#[test]
fn a_slow_server_is_waited_for_within_the_timeout() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let rt = RemoteRuntime::new(1).unwrap();
    let data = pattern(256 << 10, 4);
    std::fs::write(tmp.path().join("z.sst"), &data).unwrap();
    let mut direct = client(&rt, s3(server.port), |_| {});
    direct.upload_file(1, "z.sst", tmp.path().join("z.sst"));
    assert!(matches!(drain(&mut direct)[0].1, Ok(RemoteDone::Uploaded)));

    let slow = Proxy::start(server.port, Fault::Delay(Duration::from_millis(300))).port;
    let mut r = client(&rt, s3(slow), |c| {
        c.timeout = Duration::from_secs(3);
        c.retries = 0;
        c.coalesce_gap = 0;
    });
    let stats = r.stats();
    let reqs: Vec<(u64, &str, std::ops::Range<u64>)> = (0..50u64)
        .map(|t| (t, "z.sst", t * 5000..t * 5000 + 100))
        .collect();
    let t0 = Instant::now();
    r.get_blocks(&reqs);
    let got = drain(&mut r);
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "the proxy added no latency"
    );
    for (t, res) in got {
        match res {
            Ok(RemoteDone::Bytes(b)) => {
                assert_eq!(
                    &b[..],
                    &data[(t * 5000) as usize..(t * 5000 + 100) as usize]
                )
            }
            other => panic!("token {t} under 300 ms of latency: {other:?}"),
        }
    }
    assert_eq!(stats.retries.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(stats.errors.load(std::sync::atomic::Ordering::Relaxed), 0);
    let _ = Arc::strong_count(&stats);
}

/// A batch's first attempts share one deadline: a server that hangs past
/// it has every GET of the batch retried on its own, and once it answers
/// again each token gets exactly its bytes (nothing lost, nothing failed).
#[test]
fn gets_past_the_batch_deadline_are_retried_until_the_server_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let rt = RemoteRuntime::new(1).unwrap();
    let data = pattern(256 << 10, 5);
    std::fs::write(tmp.path().join("h.sst"), &data).unwrap();
    let mut direct = client(&rt, s3(server.port), |_| {});
    direct.upload_file(1, "h.sst", tmp.path().join("h.sst"));
    assert!(matches!(drain(&mut direct)[0].1, Ok(RemoteDone::Uploaded)));

    let proxy = Proxy::start(server.port, Fault::Stall);
    let mut r = client(&rt, s3(proxy.port), |c| {
        c.timeout = Duration::from_millis(300);
        c.retries = 6;
        c.backoff = Duration::from_millis(100);
        c.coalesce_gap = 0;
    });
    let stats = r.stats();
    let reqs: Vec<(u64, &str, std::ops::Range<u64>)> = (0..20u64)
        .map(|t| (t, "h.sst", t * 10_000..t * 10_000 + 512))
        .collect();
    r.get_blocks(&reqs);
    // Every first attempt hangs past the deadline.
    std::thread::sleep(Duration::from_millis(500));
    proxy.set(Fault::None);
    let got = drain(&mut r);
    assert_eq!(got.len(), 20);
    for (t, res) in got {
        match res {
            Ok(RemoteDone::Bytes(b)) => assert_eq!(
                &b[..],
                &data[(t * 10_000) as usize..(t * 10_000 + 512) as usize],
                "token {t}"
            ),
            other => panic!("token {t} after the server recovered: {other:?}"),
        }
    }
    let retries = stats.retries.load(std::sync::atomic::Ordering::Relaxed);
    assert!(retries >= 20, "each GET retried at least once: {retries}");
    assert_eq!(
        stats
            .gets_in_flight
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(stats.errors.load(std::sync::atomic::Ordering::Relaxed), 0);
}

/// A server that never answers fails each token after its retries, with
/// an error naming the object and the attempts, and hands every slot back.
#[test]
fn a_hung_server_fails_each_get_after_its_retries() {
    let tmp = tempfile::tempdir().unwrap();
    let server = Server::start(&tmp.path().join("s3"), 0);
    let rt = RemoteRuntime::new(1).unwrap();
    let proxy = Proxy::start(server.port, Fault::Stall);
    let mut r = client(&rt, s3(proxy.port), |c| {
        c.timeout = Duration::from_millis(200);
        c.retries = 2;
        c.backoff = Duration::from_millis(20);
        c.coalesce_gap = 0;
        c.max_in_flight = 4;
    });
    let stats = r.stats();
    let reqs: Vec<(u64, &str, std::ops::Range<u64>)> = (0..10u64)
        .map(|t| (t, "never.sst", t * 10_000..t * 10_000 + 512))
        .collect();
    let t0 = Instant::now();
    r.get_blocks(&reqs);
    let got = drain(&mut r);
    assert_eq!(got.len(), 10);
    for (t, res) in got {
        match res {
            // The last attempt ends by our deadline or the HTTP client's
            // own timeout (both are `timeout`), whichever fires first.
            Err(RemoteError::Failed {
                attempts,
                msg,
                path,
                ..
            }) => {
                assert_eq!(attempts, 3, "token {t}: {msg}");
                assert!(path.ends_with("never.sst"), "{path}");
            }
            other => panic!("token {t} from a hung server: {other:?}"),
        }
    }
    // Three rounds of 200 ms at least (batches of at most 4 slots each).
    assert!(t0.elapsed() >= Duration::from_millis(600));
    assert_eq!(
        stats
            .gets_in_flight
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
