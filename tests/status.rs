//! The status socket and statorctl over a real statord: `/status`,
//! `/metrics` and `/healthz` through curl (HTTP/1.1 on a Unix socket) and
//! through statorctl's commands, with the counts the requests made; and a
//! checkpoint moved through a file by `statorctl snapshot export|import`
//! without touching the live state it came from.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{Daemon, run};
use stator_client::{Kind, Opcode, OpenOptions, Request, Session, Status};

fn curl(d: &Daemon, args: &[&str], path: &str) -> (String, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code}",
            "--unix-socket",
        ])
        .arg(d.dir.join("run/status.sock"))
        .args(args)
        .arg(format!("http://localhost{path}"))
        .output()
        .expect("curl is installed (.ci/run installs it)");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').expect("the status code line");
    (code.to_string(), body.to_string())
}

fn ctl(d: &Daemon, args: &[&str]) -> (i32, String, String) {
    let run = d.dir.join("run");
    let mut all = vec!["--run-dir", run.to_str().unwrap()];
    all.extend(args);
    common::statorctl(&all)
}

/// `statorctl snapshot <what> --job <job> --operator op <rest>`.
fn snapshot(d: &Daemon, what: &str, job: &str, rest: &[&str]) -> (i32, String, String) {
    let mut all = vec!["snapshot", what, "--job", job, "--operator", "op"];
    all.extend(rest);
    ctl(d, &all)
}

fn put(s: &mut Session, st: u32, kg: u16, key: &[u8], v: &[u8]) {
    let d = run(
        s,
        &Request {
            value: v,
            ..Request::new(Opcode::Put, st, kg, key)
        },
    )
    .unwrap();
    assert_eq!(d.status, Ok(Status::Ok));
}

fn get(s: &mut Session, st: u32, kg: u16, key: &[u8]) -> Option<Vec<u8>> {
    run(s, &Request::new(Opcode::Get, st, kg, key))
        .unwrap()
        .value
}

/// Polls `/status` until `ok` holds of it (the shard report is refreshed
/// every 250 ms).
fn status_until(d: &Daemon, ok: impl Fn(&serde_json::Value) -> bool) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = curl(d, &[], "/status");
        assert_eq!(code, "200", "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
        if ok(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "status never matched: {v:#}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn status_metrics_and_healthz_answer_curl_and_statorctl_with_what_happened() {
    let d = Daemon::start(256);
    let mut s = Session::open(&d.socket, &common::opts("jobA", 1, 2)).unwrap();
    let st = s.register("v", Kind::Value).unwrap();
    let (lo, hi) = s.key_groups();
    for i in 0..300u32 {
        put(&mut s, st, lo, &i.to_be_bytes(), b"value");
    }
    for i in 0..400u32 {
        let want = (i < 300).then(|| b"value".to_vec());
        assert_eq!(get(&mut s, st, lo, &i.to_be_bytes()), want);
    }
    // A key group outside the session's range: refused, and counted.
    let bad = run(&mut s, &Request::new(Opcode::Get, st, hi + 1, b"k")).unwrap();
    assert_eq!(bad.status, Ok(Status::BadKeyGroup));
    let h = run(&mut s, &Request::checkpoint(5)).unwrap();
    let handle = h.value.expect("a handle");

    // /metrics: Prometheus text with the counts and histograms.
    let (code, m) = curl(&d, &[], "/metrics");
    assert_eq!(code, "200", "{m}");
    for want in [
        "# TYPE stator_requests_total counter",
        "stator_requests_total{op=\"put\"} 300",
        "stator_requests_total{op=\"get\"} 401",
        "stator_requests_total{op=\"checkpoint\"} 1",
        "stator_request_errors_total{op=\"get\"} 1",
        "stator_request_errors_total{op=\"put\"} 0",
        "# TYPE stator_request_duration_seconds histogram",
        "stator_request_duration_seconds_count{op=\"put\"} 300",
        "stator_request_duration_seconds_count{op=\"get\"} 401",
        "stator_request_duration_seconds_bucket{op=\"get\",le=\"+Inf\"} 401",
        "stator_request_duration_seconds_count{op=\"checkpoint\"} 1",
        "stator_sessions 1",
        "stator_memory_budget_bytes 268435456",
        "stator_shard_up{shard=\"0\"} 1",
        "stator_build_info{version=",
    ] {
        assert!(m.contains(want), "/metrics lacks {want:?}:\n{m}");
    }
    // Buckets are cumulative and end at the count.
    let buckets: Vec<u64> = m
        .lines()
        .filter(|l| l.starts_with("stator_request_duration_seconds_bucket{op=\"put\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert_eq!(buckets.last(), Some(&300));

    // /status: JSON with the session, memory within budget, the checkpoint.
    let v = status_until(&d, |v| {
        v["sessions"].as_array().is_some_and(|a| a.len() == 1)
            && v["checkpoints"].as_array().is_some_and(|a| a.len() == 1)
    });
    let sess = &v["sessions"][0];
    assert_eq!(sess["job"], "jobA");
    assert_eq!(sess["operator"], "op");
    assert_eq!(
        (sess["subtask"].as_u64(), sess["parallelism"].as_u64()),
        (Some(1), Some(2))
    );
    assert_eq!(sess["key_group_lo"].as_u64(), Some(lo as u64));
    assert_eq!(sess["key_group_hi"].as_u64(), Some(hi as u64));
    assert_eq!(sess["states"].as_u64(), Some(1));
    assert_eq!(sess["requests"].as_u64(), Some(702));
    assert_eq!(v["requests"].as_u64(), Some(702));
    assert_eq!(v["state"], "serving");
    let used = v["memory"]["used_bytes"].as_u64().unwrap();
    assert!(used > 0 && used <= v["memory"]["budget_bytes"].as_u64().unwrap());
    assert!(v["disk"]["used_bytes"].as_u64().unwrap() > 0);
    let hex: String = handle.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(v["checkpoints"][0]["handle"], hex.as_str());
    assert_eq!(v["checkpoints"][0]["checkpoint_id"].as_u64(), Some(5));
    assert_eq!(v["ops"]["put"]["requests"].as_u64(), Some(300));

    // /healthz, a wrong path, a wrong method.
    assert_eq!(curl(&d, &[], "/healthz"), ("200".into(), "ok\n".into()));
    assert_eq!(curl(&d, &[], "/nope").0, "404");
    assert_eq!(curl(&d, &["-X", "POST"], "/status").0, "405");

    // statorctl reads the same socket.
    let (code, out, err) = ctl(&d, &["status"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("sessions   1 open") && out.contains("SHARD"),
        "{out}"
    );
    let (code, out, _) = ctl(&d, &["sessions"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("jobA") && out.contains("1/2") && out.contains("702"),
        "{out}"
    );
    let (code, out, _) = ctl(&d, &["checkpoints", "--job", "jobA"]);
    assert_eq!(code, 0);
    assert!(out.contains(&hex) && out.contains("HANDLE"), "{out}");
    let (code, out, _) = ctl(&d, &["checkpoints", "--job", "nobody"]);
    assert_eq!((code, out.trim()), (0, "no retained checkpoints"));
    let (code, out, _) = ctl(&d, &["checkpoints", "--json"]);
    assert_eq!(code, 0);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j[0]["handle"], hex.as_str());
    let (code, out, _) = ctl(&d, &["metrics"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("stator_requests_total{op=\"put\"} 300"),
        "{out}"
    );
    assert_eq!(ctl(&d, &["health"]).0, 0);

    // top: two refreshes while requests flow, then it exits.
    let flow = std::thread::spawn(move || {
        for i in 0..3000u32 {
            put(&mut s, st, lo, &i.to_be_bytes(), b"again");
        }
        s
    });
    let (code, out, err) = ctl(&d, &["top", "--interval", "0.3", "--count", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.matches("requests/s").count() == 2 && out.contains("SESSION"),
        "{out}"
    );
    let s = flow.join().unwrap();
    s.close().unwrap();

    // No daemon there: exit 1, and the path named.
    let (code, _, err) = common::statorctl(&["--run-dir", "/nonexistent-stator", "status"]);
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent-stator/status.sock"), "{err}");
    let (code, out, _) = ctl(&d, &["--help"]);
    assert_eq!(code, 0);
    for c in [
        "status",
        "sessions",
        "checkpoints",
        "metrics",
        "top",
        "check-config",
        "snapshot",
    ] {
        assert!(out.contains(c), "--help lacks {c}: {out}");
    }
    let (code, out, _) = ctl(&d, &["snapshot", "export", "--help"]);
    assert!(
        code == 0 && out.contains("--checkpoint") && out.contains("--output"),
        "{out}"
    );
}

fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map_or(0, |m| m.len())
}

#[test]
fn snapshot_export_and_import_move_a_checkpoint_through_a_file() {
    let d = Daemon::start(256);
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("snap.stator");
    let mut a = Session::open(&d.socket, &OpenOptions::new("src", "op")).unwrap();
    let v = a.register("v", Kind::Value).unwrap();
    let n = 5000u32;
    for i in 0..n {
        put(
            &mut a,
            v,
            (i % 16) as u16,
            &i.to_be_bytes(),
            format!("old{i}").as_bytes(),
        );
    }
    let h = run(&mut a, &Request::checkpoint(3)).unwrap();
    assert_eq!(h.status, Ok(Status::Ok));
    for i in 0..n / 2 {
        put(&mut a, v, (i % 16) as u16, &i.to_be_bytes(), b"new");
    }
    // The checkpoint must be listed before the export can find it.
    status_until(&d, |s| {
        s["checkpoints"].as_array().is_some_and(|c| !c.is_empty())
    });

    let (code, _, err) = snapshot(&d, "export", "src", &["--checkpoint", "3", "-o"]);
    assert_eq!(code, 2, "a missing file argument is invalid input: {err}");
    let f = file.to_str().unwrap();
    let (code, _, err) = snapshot(&d, "export", "src", &["--checkpoint", "3", "-o", f]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("exported 1 checkpoint"), "{err}");
    assert!(file_len(&file) > 0 && !tmp.path().join("snap.stator.partial").exists());
    // The source's live state is as it was written after the checkpoint.
    assert_eq!(
        get(&mut a, v, 0, &0u32.to_be_bytes()),
        Some(b"new".to_vec())
    );
    assert_eq!(
        get(&mut a, v, ((n - 1) % 16) as u16, &(n - 1).to_be_bytes()),
        Some(format!("old{}", n - 1).into_bytes())
    );

    // Unknown checkpoint, a handle that is not hex, a forged handle.
    for (args, what) in [
        (vec!["--checkpoint", "99"], "no retained checkpoint 99"),
        (vec!["--handle", "zz"], "not hex"),
        (vec!["--handle", "00112233"], "refused"),
    ] {
        let mut all = vec!["-o", f];
        all.extend(args);
        let (code, _, err) = snapshot(&d, "export", "src", &all);
        assert_eq!(code, 2, "{what}: {err}");
        assert!(err.contains(what), "{what}: {err}");
    }
    assert!(
        file_len(&file) > 0,
        "a failed export left the earlier file alone"
    );

    // Import into another job, then restore that job from the new handle.
    let (code, out, err) = snapshot(&d, "import", "dst", &["--checkpoint", "9", "-i", f]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(&format!("imported {n} records")), "{err}");
    let handle = statord::status::unhex(&out).expect("a hex handle");
    let mut b = Session::open(&d.socket, &OpenOptions::new("dst", "op")).unwrap();
    let bv = b.register("v", Kind::Value).unwrap();
    b.restore(&[&handle]).unwrap();
    for i in (0..n).step_by(7) {
        assert_eq!(
            get(&mut b, bv, (i % 16) as u16, &i.to_be_bytes()),
            Some(format!("old{i}").into_bytes()),
            "key {i}"
        );
    }

    // While a session of dst/op is open, an import is refused.
    let (code, _, err) = snapshot(&d, "import", "dst", &["--checkpoint", "10", "-i", f]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stop the job first"), "{err}");
    b.close().unwrap();

    // A corrupt file and a truncated one: refused, nothing imported.
    let bytes = std::fs::read(&file).unwrap();
    let mut bad = bytes.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x40;
    let badf = tmp.path().join("bad.stator");
    std::fs::write(&badf, &bad).unwrap();
    // --force: the previous refused import's own session may still be
    // listed as open for a moment after statorctl exits (the open-session
    // check is advisory, read from /status); these cases test the file.
    let refused = |what: &str| {
        let (code, _, err) = snapshot(
            &d,
            "import",
            "other",
            &["--checkpoint", "1", "--force", "-i", badf.to_str().unwrap()],
        );
        assert_eq!(code, 2, "{what}: {err}");
        assert!(err.contains("nothing was imported"), "{what}: {err}");
    };
    refused("a flipped byte");
    std::fs::write(&badf, &bytes[..bytes.len() - 10]).unwrap();
    refused("a truncated file");
    let mut c = Session::open(&d.socket, &OpenOptions::new("other", "op")).unwrap();
    let cv = c.register("v", Kind::Value).unwrap();
    assert_eq!(get(&mut c, cv, 1, &1u32.to_be_bytes()), None);
    c.close().unwrap();
    a.close().unwrap();
}
