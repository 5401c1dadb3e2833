//! The C ABI end to end: `libstator` installed with its install rule into
//! a temporary prefix, the C tests and examples compiled with `cc` against
//! it through `pkg-config` (shared and static, and under AddressSanitizer
//! with UndefinedBehaviorSanitizer), and run against a real `statord`.
//! Also: the shared library exports `stator_*` symbols only, and a daemon
//! killed under a C client gives it `STATOR_E_DAEMON_GONE`.
//!
//! Needs `cc`, `make`, `pkg-config` and `nm` (`.ci/run` installs them).

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::Daemon;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Where Cargo put this test's dependencies, `libstator.so` and
/// `libstator.a` among them (stator-c is a dev-dependency of statord).
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let dir = exe.parent().expect("deps dir").to_path_buf();
    for lib in ["libstator.so", "libstator.a"] {
        assert!(
            dir.join(lib).exists(),
            "{lib} is not in {}: stator-c must be built with this test",
            dir.display()
        );
    }
    dir
}

fn ok(what: &str, out: Output) -> Output {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The library installed into a temporary prefix by `make install-only`.
struct Installed {
    _tmp: tempfile::TempDir,
    prefix: PathBuf,
}

impl Installed {
    fn new() -> Installed {
        let tmp = tempfile::tempdir().expect("tempdir");
        let prefix = tmp.path().join("prefix");
        let out = Command::new("make")
            .arg("-C")
            .arg(root().join("clients/c"))
            .arg("install-only")
            .arg(format!("PREFIX={}", prefix.display()))
            .arg(format!("BUILD_DIR={}", deps_dir().display()))
            .output()
            .expect("run make (is it installed?)");
        ok("make install-only", out);
        Installed { _tmp: tmp, prefix }
    }

    fn lib(&self) -> PathBuf {
        self.prefix.join("lib")
    }

    fn pkg_config(&self, args: &[&str]) -> Vec<String> {
        let out = Command::new("pkg-config")
            .args(args)
            .arg("stator")
            .env("PKG_CONFIG_PATH", self.lib().join("pkgconfig"))
            .output()
            .expect("run pkg-config (is it installed?)");
        let out = ok("pkg-config", out);
        String::from_utf8(out.stdout)
            .expect("utf-8")
            .split_whitespace()
            .map(String::from)
            .collect()
    }

    /// Compiles `src` with `cc` and the flags pkg-config gives for stator.
    fn cc(&self, src: &str, out: &str, extra: &[&str], static_link: bool) -> PathBuf {
        let exe = self.prefix.join(out);
        let mut cmd = Command::new("cc");
        cmd.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
            .args(extra)
            .arg(root().join(src))
            .arg("-o")
            .arg(&exe)
            .args(self.pkg_config(&["--cflags"]));
        if static_link {
            // The archive itself, then what `pkg-config --static` adds to
            // it (Libs.private).
            cmd.arg(self.lib().join("libstator.a")).args(
                self.pkg_config(&["--static", "--libs"])
                    .into_iter()
                    .filter(|f| f.starts_with("-l") && f != "-lstator"),
            );
        } else {
            cmd.args(self.pkg_config(&["--libs"]))
                .arg(format!("-Wl,-rpath,{}", self.lib().display()));
        }
        ok(
            &format!("cc {src}"),
            cmd.output().expect("run cc (is it installed?)"),
        );
        exe
    }
}

fn run(exe: &Path, args: &[&str], socket: &Path) -> Output {
    Command::new(exe)
        .args(args)
        .env("STATOR_SOCKET", socket)
        // Leaks are errors; the sanitizers stop at the first report.
        .env(
            "ASAN_OPTIONS",
            "detect_leaks=1:abort_on_error=0:halt_on_error=1",
        )
        .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
        .output()
        .expect("run a C program")
}

#[test]
fn only_stator_symbols_are_exported() {
    let lib = Installed::new();
    let out = ok(
        "nm -D",
        Command::new("nm")
            .args(["-D", "--defined-only"])
            .arg(lib.lib().join("libstator.so"))
            .output()
            .expect("run nm (binutils)"),
    );
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    assert!(names.len() >= 40, "few symbols exported: {names:?}");
    let foreign: Vec<&&str> = names.iter().filter(|n| !n.starts_with("stator_")).collect();
    assert!(
        foreign.is_empty(),
        "exported without the prefix: {foreign:?}"
    );
    // Every function the header declares is exported, and nothing else.
    let header = std::fs::read_to_string(root().join("clients/c/include/stator.h")).unwrap();
    let declared: Vec<&str> = header
        .lines()
        .filter(|l| {
            l.starts_with(|c: char| c.is_ascii_alphabetic())
                && !l.starts_with("typedef")
                && l.contains("stator_")
                && l.contains('(')
        })
        .filter_map(|l| l.split('(').next()?.split([' ', '*']).next_back())
        .collect();
    let mut a = declared.clone();
    let mut b = names.clone();
    a.sort();
    b.sort();
    assert_eq!(a, b, "stator.h and libstator.so disagree");
    let soname = ok(
        "readelf",
        Command::new("readelf")
            .arg("-d")
            .arg(lib.lib().join("libstator.so"))
            .output()
            .expect("readelf"),
    );
    assert!(String::from_utf8_lossy(&soname.stdout).contains("[libstator.so.1]"));
}

#[test]
fn c_tests_and_examples_against_statord() {
    let lib = Installed::new();
    let sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"];
    let builds = [
        lib.cc("clients/c/tests/test_stator.c", "test_shared", &[], false),
        lib.cc("clients/c/tests/test_stator.c", "test_static", &[], true),
        lib.cc(
            "clients/c/tests/test_stator.c",
            "test_asan",
            &sanitize,
            false,
        ),
    ];
    let examples = [
        lib.cc("clients/c/examples/quickstart.c", "quickstart", &[], false),
        lib.cc("clients/c/examples/eventloop.c", "eventloop", &[], false),
        lib.cc(
            "clients/c/examples/quickstart.c",
            "quickstart_asan",
            &sanitize,
            false,
        ),
        lib.cc(
            "clients/c/examples/eventloop.c",
            "eventloop_asan",
            &sanitize,
            false,
        ),
    ];
    let d = Daemon::start(256);
    for exe in &builds {
        let out = run(exe, &[d.socket.to_str().unwrap()], &d.socket);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{} failed:\n{err}", exe.display());
        assert!(err.contains(" 0 failed"), "{}: {err}", exe.display());
    }
    for exe in &examples {
        let out = ok(&exe.display().to_string(), run(exe, &["20000"], &d.socket));
        let text = String::from_utf8_lossy(&out.stdout);
        if exe.ends_with("eventloop") || exe.ends_with("eventloop_asan") {
            assert_eq!(text.matches("\"ops\":20000").count(), 2, "{text}");
        } else {
            assert!(
                text.contains("stream: ") && text.contains("state: "),
                "{text}"
            );
        }
    }
}

#[test]
fn a_dead_daemon_is_reported_to_a_c_client() {
    let lib = Installed::new();
    let exe = lib.cc("clients/c/tests/test_stator.c", "test_gone", &[], false);
    let mut d = Daemon::start(64);
    let mut child = Command::new(&exe)
        .args([d.socket.to_str().unwrap(), "gone"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the C client");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("read ready");
    assert_eq!(line.trim(), "ready");
    d.signal(libc::SIGKILL);
    d.wait_exit(Duration::from_secs(10));
    let out = child.wait_with_output().expect("the C client exits");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains(" 0 failed"), "{err}");
}
