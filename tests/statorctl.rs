//! `statorctl check-config`: what statord would run with, or the bad key
//! named, with exit codes scripts can use (0 valid, 1 unreadable, 2
//! invalid).

mod common;

use common::statorctl as ctl;

#[test]
fn check_config_says_valid_invalid_or_unreadable() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good.toml");
    std::fs::write(
        &good,
        "shards = 3\nmemory_budget_mib = 512\n[session]\nsq_entries = 1024\n",
    )
    .unwrap();
    let (code, out, _) = ctl(&["check-config", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("valid") && out.contains("shards: 3") && out.contains("sq_entries: 1024"),
        "{out}"
    );
    let (code, out, _) = ctl(&["check-config", "--quiet", good.to_str().unwrap()]);
    assert_eq!((code, out.as_str()), (0, ""));

    let bad = tmp.path().join("bad.toml");
    std::fs::write(&bad, "[session]\nsq_entries = 1000\n").unwrap();
    let (code, _, err) = ctl(&["check-config", bad.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("session.sq_entries"), "{err}");

    let unknown = tmp.path().join("unknown.toml");
    std::fs::write(&unknown, "shardz = 2\n").unwrap();
    let (code, _, err) = ctl(&["check-config", unknown.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("shardz"), "{err}");

    let (code, _, err) = ctl(&[
        "check-config",
        tmp.path().join("missing.toml").to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("missing.toml"), "{err}");

    let (code, out, _) = ctl(&["--help"]);
    assert_eq!(code, 0);
    assert!(
        out.contains("check-config") && out.contains("Exit codes"),
        "{out}"
    );
    let (code, out, _) = ctl(&["check-config", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("FILE"), "{out}");
    // No command: usage, and clap's exit code 2.
    assert_eq!(ctl(&[]).0, 2);
}
