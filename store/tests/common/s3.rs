//! A real S3-compatible server on loopback for the remote tier's tests:
//! `s3s-fs` (which `.ci/run` installs; without it the tests say so and
//! pass only outside CI).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use stator_store::remote::Target;

pub const KEY: &str = "stator-test-key";
pub const SECRET: &str = "stator-test-secret";
pub const BUCKET: &str = "stator";

pub struct Server {
    child: Child,
    pub port: u16,
    pub root: PathBuf,
}

impl Server {
    /// Starts s3s-fs over `root` on `port` (0: a free one); `None` if the
    /// binary is not installed (and not in CI, where that is a failure).
    pub fn start(root: &Path, port: u16) -> Option<Server> {
        let port = if port == 0 { free_port() } else { port };
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let child = match Command::new("s3s-fs")
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", KEY, "--secret-key", SECRET])
            .arg(root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "s3s-fs is not installed ({e}); .ci/run installs it"
                );
                eprintln!(
                    "SKIPPED: s3s-fs is not installed (cargo install s3s-fs@0.14.1 --features binary)"
                );
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "s3s-fs did not come up");
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Server {
            child,
            port,
            root: root.to_path_buf(),
        })
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn s3(port: u16) -> Target {
    Target::S3 {
        bucket: BUCKET.into(),
        endpoint: Some(format!("http://127.0.0.1:{port}")),
        region: Some("us-east-1".into()),
        access_key_id: Some(KEY.into()),
        secret_access_key: Some(SECRET.into()),
        allow_http: true,
    }
}

/// A TCP proxy that holds every chunk from the client for `delay` before
/// passing it on (each request is late by at least that much).
pub fn slow_proxy(upstream: u16, delay: Duration) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(c) = c else { continue };
            let Ok(u) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            let pipe = |mut from: TcpStream, mut to: TcpStream, delay: Option<Duration>| {
                std::thread::spawn(move || {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if let Some(d) = delay {
                                    std::thread::sleep(d);
                                }
                                if to.write_all(&buf[..n]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            };
            pipe(c.try_clone().unwrap(), u.try_clone().unwrap(), Some(delay));
            pipe(u, c, None);
        }
    });
    port
}

/// A proxy to `upstream` on loopback that answers every `every`-th
/// connection's first request with `503 Slow Down` and closes it (as S3
/// does when it throttles), and passes the others through: HTTP errors a
/// client must retry.
pub fn throttling_proxy(upstream: u16, every: usize) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for (n, c) in l.incoming().enumerate() {
            let Ok(mut c) = c else { continue };
            if n % every == every - 1 {
                std::thread::spawn(move || {
                    // Read the request head, then refuse it.
                    let mut head = Vec::new();
                    let mut b = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match c.read(&mut b) {
                            Ok(0) | Err(_) => return,
                            Ok(k) => head.extend_from_slice(&b[..k]),
                        }
                    }
                    let body = "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                    let _ = write!(
                        c,
                        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = c.shutdown(std::net::Shutdown::Both);
                });
                continue;
            }
            let Ok(u) = TcpStream::connect(("127.0.0.1", upstream)) else {
                continue;
            };
            for (mut from, mut to) in [(c.try_clone().unwrap(), u.try_clone().unwrap()), (u, c)] {
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(std::net::Shutdown::Write);
                });
            }
        }
    });
    port
}
