//! The Flink state backend's tests (`flink/`, Maven): Flink's own keyed
//! backend test suite, restores and MiniCluster jobs, each against real
//! statord processes (this package's `statord`) through this build's
//! `libstator_jni.so` (a dev-dependency, built with this test).
//!
//! Needs Java 17 and Maven (`.ci/run` installs them); without them the
//! test fails and says so, it is not skipped. `STATOR_FLINK_TESTS` picks
//! Maven's `-Dtest` pattern (all by default).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where Cargo put this test's dependencies, `libstator_jni.so` among them.
fn native_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().expect("deps dir").to_path_buf();
    assert!(
        dir.join("libstator_jni.so").exists(),
        "libstator_jni.so is not in {}: stator-jni must be built with this test",
        dir.display()
    );
    dir
}

#[test]
fn flink_backend_tests_pass_against_a_real_statord() {
    let mvn = std::env::var("MVN").unwrap_or_else(|_| "mvn".into());
    let mut cmd = Command::new(&mvn);
    cmd.current_dir(root().join("flink"))
        .args(["-B", "-q", "-ntp", "verify", "-Dstator.cargo.skip=true"])
        .arg(format!("-Dstator.native.dir={}", native_dir().display()))
        .arg(format!(
            "-Dstator.statord={}",
            env!("CARGO_BIN_EXE_statord")
        ));
    if let Ok(pattern) = std::env::var("STATOR_FLINK_TESTS") {
        cmd.arg(format!("-Dtest={pattern}"));
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("cannot run {mvn} (Maven and Java 17 are needed for the Flink backend's tests): {e}")
    });
    assert!(
        status.success(),
        "the Flink backend's Maven build or tests failed ({status}); see the output above and flink/target/surefire-reports"
    );
}
