//! A real S3-compatible server on loopback for the remote tier's tests:
//! `s3s-fs`'s file system behind `s3s`, served in the test's own process
//! on a runtime of its own (dev-dependencies: nothing to install, so the
//! remote tier is tested wherever the tests run).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use stator_store::remote::Target;

pub const KEY: &str = "stator-test-key";
pub const SECRET: &str = "stator-test-secret";
pub const BUCKET: &str = "stator";

pub struct Server {
    /// Serves it; dropped (every connection with it) by [`Server::stop`].
    rt: Option<tokio::runtime::Runtime>,
    pub port: u16,
    pub root: PathBuf,
}

impl Server {
    /// Serves S3 over the directory `root` (bucket [`BUCKET`], credentials
    /// [`KEY`] and [`SECRET`]) on `port` of 127.0.0.1 (0: a free one).
    pub fn start(root: &Path, port: u16) -> Server {
        Server::start_delayed(root, port, Duration::ZERO, 2)
    }

    /// [`Server::start`] on `threads` runtime threads, with every request
    /// held `delay` before it is served: object storage's latency, added
    /// at the server's door rather than by a [`Proxy`] (whose thread per
    /// connection and second copy of every byte would cost the benchmark
    /// that runs beside it more CPU than the server itself).
    pub fn start_delayed(root: &Path, port: u16, delay: Duration, threads: usize) -> Server {
        use hyper::service::Service;
        use hyper_util::rt::{TokioExecutor, TokioIo};
        use hyper_util::server::conn::auto::Builder;
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("s3-server")
            .enable_all()
            .build()
            .unwrap();
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(("127.0.0.1", port)))
            .unwrap_or_else(|e| panic!("cannot serve S3 on port {port}: {e}"));
        let port = listener.local_addr().unwrap().port();
        let fs = s3s_fs::FileSystem::new(root).expect("an s3s-fs root");
        let mut b = s3s::service::S3ServiceBuilder::new(fs);
        b.set_auth(s3s::auth::SimpleAuth::from_single(KEY, SECRET));
        let service = b.build();
        rt.spawn(async move {
            let http = Builder::new(TokioExecutor::new());
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                let service = service.clone();
                let delayed = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        // The trait's call (S3Service has an inherent one on
                        // its own body type); its future starts when polled.
                        let served = Service::call(&service, req);
                        async move {
                            if !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                            served.await
                        }
                    },
                );
                let conn = http
                    .serve_connection(TokioIo::new(socket), delayed)
                    .into_owned();
                tokio::spawn(async move {
                    let _ = conn.await;
                });
            }
        });
        Server {
            rt: Some(rt),
            port,
            root: root.to_path_buf(),
        }
    }

    /// Stops serving: the port is closed and every connection dropped.
    pub fn stop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
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

/// What a [`Proxy`] does to the traffic it carries, from the moment it is
/// set (connections already open included: the HTTP client pools them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(dead_code)] // each test binary uses some
pub enum Fault {
    /// Pass everything through.
    None,
    /// Hold every chunk from the client this long before passing it on
    /// (each request is late by at least that much).
    Delay(Duration),
    /// Answer every `n`-th new connection's first request with
    /// `503 Slow Down` and close it, as S3 does when it throttles: an HTTP
    /// error a client must retry.
    Throttle(usize),
    /// Pass at most this many bytes of the next response chunk, then reset
    /// the connection (TCP RST): a response cut partway.
    ResetResponse(usize),
    /// Reset a connection once it has carried more than this many request
    /// bytes since the fault was set: a large upload cut partway, small
    /// requests untouched.
    ResetRequestAfter(usize),
    /// Swallow what the client sends and never answer: a server that hangs
    /// (the client's timeout must end it).
    Stall,
}

/// A TCP proxy on loopback in front of `upstream` that injects [`Fault`]s.
pub struct Proxy {
    pub port: u16,
    /// The fault, and a generation bumped at each change (byte counts of
    /// [`Fault::ResetRequestAfter`] start again at each).
    fault: std::sync::Arc<std::sync::Mutex<(Fault, u64)>>,
}

impl Proxy {
    pub fn start(upstream: u16, fault: Fault) -> Proxy {
        use std::sync::{Arc, Mutex};
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let shared = Arc::new(Mutex::new((fault, 0u64)));
        let state = shared.clone();
        std::thread::spawn(move || {
            for (n, c) in l.incoming().enumerate() {
                let Ok(c) = c else { continue };
                if let (Fault::Throttle(every), _) = *state.lock().unwrap()
                    && n % every == every - 1
                {
                    std::thread::spawn(move || refuse_slow_down(c));
                    continue;
                }
                let Ok(u) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let (c2, u2) = (c.try_clone().unwrap(), u.try_clone().unwrap());
                let (s1, s2) = (state.clone(), state.clone());
                let cut = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
                let cut2 = cut.clone();
                std::thread::spawn(move || pipe(c2, u2, true, s1, cut));
                std::thread::spawn(move || pipe(u, c, false, s2, cut2));
            }
        });
        Proxy {
            port,
            fault: shared,
        }
    }

    /// Injects `f` from now on.
    #[allow(dead_code)]
    pub fn set(&self, f: Fault) {
        let mut g = self.fault.lock().unwrap();
        *g = (f, g.1 + 1);
    }
}

/// Copies `from` to `to` (`up`: client to server), applying the fault
/// current at each chunk. `cut`: the pair was reset (by either direction).
fn pipe(
    mut from: TcpStream,
    mut to: TcpStream,
    up: bool,
    state: std::sync::Arc<std::sync::Mutex<(Fault, u64)>>,
    cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::sync::atomic::Ordering::SeqCst;
    let mut buf = vec![0u8; 64 << 10];
    let (mut generation, mut sent) = (u64::MAX, 0usize);
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let (fault, g) = *state.lock().unwrap();
        if g != generation {
            (generation, sent) = (g, 0);
        }
        let pass = match (fault, up) {
            (Fault::Delay(d), true) => {
                std::thread::sleep(d);
                n
            }
            (Fault::Stall, true) => 0,
            (Fault::ResetResponse(k), false) => {
                let _ = to.write_all(&buf[..k.min(n)]);
                cut.store(true, SeqCst);
                return reset(&from, &to);
            }
            (Fault::ResetRequestAfter(k), true) => {
                sent += n;
                if sent > k {
                    cut.store(true, SeqCst);
                    return reset(&from, &to);
                }
                n
            }
            _ => n,
        };
        if to.write_all(&buf[..pass]).is_err() {
            break;
        }
    }
    // A clean end passes the FIN on; after a reset nothing more is sent
    // (a FIN now would precede the RST).
    if !cut.load(SeqCst) {
        let _ = to.shutdown(std::net::Shutdown::Write);
    }
}

/// Resets both connections: SO_LINGER 0, and their reading sides shut
/// (which wakes the other direction's thread without sending a FIN), so
/// that the last close of each socket sends an RST.
fn reset(a: &TcpStream, b: &TcpStream) {
    use std::os::fd::AsRawFd;
    for s in [a, b] {
        let l = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid socket fd, and a linger struct of the size given.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&l as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
        let _ = s.shutdown(std::net::Shutdown::Read);
    }
}

/// Reads a request head and answers `503 Slow Down`, then closes.
fn refuse_slow_down(mut c: TcpStream) {
    let mut head = Vec::new();
    let mut b = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut b) {
            Ok(0) | Err(_) => return,
            Ok(k) => head.extend_from_slice(&b[..k]),
        }
    }
    let body =
        "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
    let _ = write!(
        c,
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = c.shutdown(std::net::Shutdown::Both);
}
