//! `packaging/statord.service` passes `systemd-analyze verify` with no
//! warning (verify exits 0 even on a misspelt value, so its stderr must be
//! empty too), pointing at the statord this build made, and keeps the
//! settings operators rely on.

use std::path::Path;
use std::process::Command;

#[test]
fn the_unit_file_verifies_cleanly() {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/statord.service"),
    )
    .expect("packaging/statord.service");
    for key in [
        "Type=notify",
        "WatchdogSec=",
        "Restart=on-failure",
        "RuntimeDirectory=stator",
        "StateDirectory=stator",
        "LimitMEMLOCK=",
        "LimitNOFILE=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "ReadWritePaths=",
        "CapabilityBoundingSet=\n",
        "io_uring_setup io_uring_enter io_uring_register",
    ] {
        assert!(unit.contains(key), "the unit lost {key:?}");
    }
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("statord.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/statord", env!("CARGO_BIN_EXE_statord")),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("run systemd-analyze (Debian's systemd package; .ci/run installs it)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.trim().is_empty(),
        "systemd-analyze verify: {err}"
    );
}
