//! The control socket's connections, served without a thread each.
//!
//! One thread (`statord-control`) accepts, reads and writes every
//! connection through epoll (mio). A complete request goes, with its
//! connection, to one of [`WORKERS`] threads, which runs it (a shard
//! round trip, a registry fsync; `control.rs`) and writes what of the
//! answer the socket takes without waiting, then hands the connection
//! back; the reactor writes the rest as the peer reads. A connection has
//! one request at a time in a worker and is not read while an answer is
//! unwritten, so answers keep the order of requests, and a peer that
//! does not read its answers holds no worker.
//!
//! Limits (`daemon/CONTROL.md`, Connections):
//! - A connection without a session must open one within
//!   [`HANDSHAKE_TIMEOUT`] of its accept: a deadline, not a timeout per
//!   read, so bytes trickled one at a time cannot hold it open. Past it,
//!   it is answered `BAD_REQUEST` and closed.
//! - At most `max_sessions` + 64 connections in all, and with
//!   `max_sessions_per_uid` set at most that + 8 of one uid: one past a
//!   cap is answered `LIMIT` (never reset) and closed.
//! - An answer the peer has not taken within [`WRITE_TIMEOUT`] ends the
//!   connection (and its session).
//! - A connection the daemon ends is shut down for writing and drained
//!   for [`LINGER`], so that its peer reads the reason (closing a Unix
//!   socket with unread input resets the peer, which may lose it).

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use slab::Slab;
use stator_ring::control::{MAX_FRAME, Request, Response, frame_len, msg, status};
use stator_shm::fdpass::send_fds;

use crate::control::{self, Ctx, Open};

/// How long a connection may go without a session after its accept.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an ended connection is drained before it is dropped.
const LINGER: Duration = Duration::from_millis(100);
/// How long an answer may wait for its peer to read it (a peer that
/// does not read its answers loses its connection).
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Threads that run requests.
const WORKERS: usize = 4;
/// Ended connections draining at once; past this they are dropped at
/// once (a flood of refused connections must not pile up).
const MAX_LINGERING: usize = 1024;

/// How long a broken session's reason waits for its connection to come
/// back from a worker.
const BROKEN_KEPT: Duration = Duration::from_secs(60);

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX - 2);

/// A live connection: counted against the caps.
struct Conn {
    stream: UnixStream,
    uid: u32,
    /// Bytes received that are not yet a whole frame (with its prefix).
    buf: Vec<u8>,
    /// The peer shut down its side.
    eof: bool,
    accepted: Instant,
    session: Option<Open>,
    /// Answer bytes the socket has not taken yet, and since when.
    out: Vec<u8>,
    out_since: Option<Instant>,
}

impl Conn {
    /// Queues `bytes` after any unwritten answer and writes what the
    /// socket takes without waiting.
    fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.out.extend_from_slice(bytes);
        self.flush()
    }

    /// Writes what of the unwritten answer the socket takes now.
    fn flush(&mut self) -> std::io::Result<()> {
        let mut done = 0;
        let r = loop {
            if done == self.out.len() {
                break Ok(());
            }
            match (&self.stream).write(&self.out[done..]) {
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        self.out.drain(..done);
        self.out_since = match self.out.is_empty() {
            true => None,
            false => self.out_since.or(Some(Instant::now())),
        };
        r
    }

    /// When it is ended unless it opens a session or its peer reads.
    fn deadline(&self) -> Option<Instant> {
        let handshake = match self.session {
            None => Some(self.accepted + HANDSHAKE_TIMEOUT),
            Some(_) => None,
        };
        let write = self.out_since.map(|t| t + WRITE_TIMEOUT);
        handshake.into_iter().chain(write).min()
    }
}

enum Slot {
    Reading(Conn),
    /// With a worker; it comes back through the done channel.
    Busy,
    /// Ended: shut down for writing, drained until EOF or `until`.
    Lingering {
        stream: UnixStream,
        until: Instant,
    },
}

/// What a worker is given: a request of the connection, or `None` for
/// a connection that ended with a session (the session is dropped).
struct Job {
    conn: Conn,
    request: Option<Vec<u8>>,
}

/// What a worker hands back with the connection.
enum Next {
    Keep,
    /// Answered and ended (any session already dropped).
    End,
}

/// Serves the control socket until `ctx.stopping`. Returns the
/// connections still open then: the caller keeps them until the shards
/// have answered what is in flight, so no client takes the stop for a
/// crash before its last completions.
pub fn serve(listener: UnixListener, ctx: Arc<Ctx>) -> Vec<UnixStream> {
    let mut r = match Reactor::new(&listener, ctx) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(error = %e, "cannot poll the control socket");
            return Vec::new();
        }
    };
    r.run(&listener);
    r.into_streams()
}

struct Reactor {
    ctx: Arc<Ctx>,
    poll: Poll,
    conns: Slab<Slot>,
    /// Sessions the shards gave up on whose connection was not found
    /// reading (with a worker, most likely): told when it comes back;
    /// forgotten after [`BROKEN_KEPT`] (the connection is gone).
    broken: std::collections::HashMap<u64, (String, Instant)>,
    lingering: usize,
    /// An accept failed for want of a resource (EMFILE and the like);
    /// retried on each pass, as the edge-triggered listener may not
    /// raise another event for connections already queued.
    accept_pending: bool,
    jobs: Option<crossbeam_channel::Sender<(usize, Job)>>,
    done: crossbeam_channel::Receiver<(usize, Conn, Next)>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl Reactor {
    fn new(listener: &UnixListener, ctx: Arc<Ctx>) -> std::io::Result<Reactor> {
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let (jobs, job_rx) = crossbeam_channel::unbounded::<(usize, Job)>();
        let (done_tx, done) = crossbeam_channel::unbounded();
        let mut workers = Vec::new();
        for i in 0..WORKERS {
            let (rx, tx, waker, ctx) =
                (job_rx.clone(), done_tx.clone(), waker.clone(), ctx.clone());
            workers.push(
                std::thread::Builder::new()
                    .name(format!("statord-control-{i}"))
                    .spawn(move || {
                        for (slot, Job { mut conn, request }) in rx {
                            let next = run_job(&ctx, &mut conn, request);
                            let _ = tx.send((slot, conn, next));
                            let _ = waker.wake();
                        }
                    })?,
            );
        }
        Ok(Reactor {
            ctx,
            poll,
            conns: Slab::new(),
            broken: Default::default(),
            lingering: 0,
            accept_pending: false,
            jobs: Some(jobs),
            done,
            workers,
        })
    }

    fn run(&mut self, listener: &UnixListener) {
        let mut events = Events::with_capacity(256);
        while !self.ctx.stopping.load(Ordering::Acquire) {
            // Wake for the nearest deadline, and at least every 100 ms to
            // notice a stop.
            let now = Instant::now();
            let wait = self
                .next_deadline()
                .map_or(Duration::from_millis(100), |d| {
                    d.saturating_duration_since(now)
                        .min(Duration::from_millis(100))
                });
            if let Err(e) = self.poll.poll(&mut events, Some(wait))
                && e.kind() != ErrorKind::Interrupted
            {
                tracing::error!(error = %e, "polling the control socket failed");
                std::thread::sleep(Duration::from_millis(100));
            }
            let mut accept = std::mem::take(&mut self.accept_pending);
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => accept = true,
                    WAKER => {}
                    Token(i) => self.ready(i),
                }
            }
            if accept {
                self.accept(listener);
            }
            while let Ok((i, c, next)) = self.done.try_recv() {
                match next {
                    Next::Keep
                        if c.session
                            .as_ref()
                            .is_some_and(|o| self.broken.contains_key(&o.id)) =>
                    {
                        let id = c.session.as_ref().expect("checked").id;
                        let (why, _) = self.broken.remove(&id).expect("checked");
                        self.tell_broken(i, c, why);
                    }
                    Next::Keep => {
                        self.conns[i] = Slot::Reading(c);
                        // Input that came while it was away raised no
                        // new event (edge-triggered).
                        self.ready(i);
                    }
                    Next::End => self.end(i, c),
                }
            }
            self.expire(Instant::now());
            self.take_broken();
        }
    }

    /// Tells the clients of sessions their shard gave up on why, and ends
    /// their connections (at least every 100 ms: the loop's wake-up).
    fn take_broken(&mut self) {
        let now = Instant::now();
        self.broken
            .retain(|_, (_, at)| now.duration_since(*at) < BROKEN_KEPT);
        let ctx = self.ctx.clone();
        for (id, why) in ctx.shards.iter().flat_map(|h| h.live.broken.take()) {
            let reading = self.conns.iter().find_map(|(i, s)| match s {
                Slot::Reading(c) if c.session.as_ref().is_some_and(|o| o.id == id) => Some(i),
                Slot::Reading(_) | Slot::Busy | Slot::Lingering { .. } => None,
            });
            match reading {
                Some(i) => {
                    let Slot::Reading(c) = std::mem::replace(&mut self.conns[i], Slot::Busy) else {
                        unreachable!("found above")
                    };
                    self.tell_broken(i, c, why);
                }
                // With a worker: told when it comes back.
                None => {
                    self.broken.insert(id, (why, now));
                }
            }
        }
    }

    /// Sends the reason a session broke and hangs up (slot `i` is Busy).
    fn tell_broken(&mut self, i: usize, mut c: Conn, why: String) {
        let _ = c.send(&refusal(
            0,
            status::QUEUE_BROKEN,
            format!("the session broke the queue protocol and is closed: {why}"),
        ));
        self.dispatch(
            i,
            Job {
                conn: c,
                request: None,
            },
        );
    }

    /// The connections still open, once the workers are done.
    fn into_streams(mut self) -> Vec<UnixStream> {
        drop(self.jobs.take());
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        let mut out: Vec<UnixStream> = self
            .conns
            .drain()
            .filter_map(|s| match s {
                Slot::Reading(c) => Some(c.stream),
                Slot::Busy | Slot::Lingering { .. } => None,
            })
            .collect();
        out.extend(self.done.try_iter().map(|(_, c, _)| c.stream));
        out
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.conns.iter().filter_map(|(_, s)| deadline(s)).min()
    }

    fn accept(&mut self, listener: &UnixListener) {
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and the like: retried on the next pass.
                    tracing::error!(error = %e, "accept failed");
                    self.accept_pending = true;
                    return;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                tracing::warn!(error = %e, "a connection could not be made non-blocking; dropped");
                continue;
            }
            let uid = match nix::sys::socket::getsockopt(
                &stream,
                nix::sys::socket::sockopt::PeerCredentials,
            ) {
                Ok(c) => c.uid(),
                Err(e) => {
                    tracing::warn!(error = %e, "SO_PEERCRED failed; connection refused");
                    continue;
                }
            };
            let refused = self.admit(uid);
            let i = self.conns.insert(Slot::Busy);
            if let Err(e) = self.poll.registry().register(
                &mut SourceFd(&stream.as_raw_fd()),
                Token(i),
                Interest::READABLE | Interest::WRITABLE,
            ) {
                tracing::error!(error = %e, "cannot poll a connection; dropped");
                self.conns.remove(i);
                if refused.is_none() {
                    self.release(uid);
                }
                continue;
            }
            if let Some((st, why)) = refused {
                tracing::warn!(uid, "{why}; connection refused");
                let _ = (&stream).write(&refusal(msg::OPEN, st, why));
                self.linger(i, stream);
                continue;
            }
            self.conns[i] = Slot::Reading(Conn {
                stream,
                uid,
                buf: Vec::new(),
                eof: false,
                accepted: Instant::now(),
                session: None,
                out: Vec::new(),
                out_since: None,
            });
            // Bytes sent before the registration raised no event.
            self.ready(i);
        }
    }

    /// Counts a new connection of `uid` against the caps, or says why
    /// not.
    fn admit(&self, uid: u32) -> Option<crate::registry::Refusal> {
        let cfg = self.ctx.cfg();
        if !cfg.allows(uid) {
            return Some((
                status::DENIED,
                format!(
                    "uid {uid} is not allowed (allowed_uids; root and statord's own uid always are)"
                ),
            ));
        }
        let per_uid = match cfg.max_sessions_per_uid {
            0 => 0,
            n => n + 8,
        };
        if let Err(n) = control::take(&self.ctx.conns_per_uid, uid, per_uid) {
            return Some((
                status::LIMIT,
                format!(
                    "uid {uid} has {n} control connections open (max_sessions_per_uid + 8 = {per_uid})"
                ),
            ));
        }
        let cap = cfg.max_sessions + 64;
        let n = self.ctx.connections.fetch_add(1, Ordering::AcqRel);
        if n >= cap {
            self.ctx.connections.fetch_sub(1, Ordering::AcqRel);
            control::give(&self.ctx.conns_per_uid, uid);
            return Some((
                status::LIMIT,
                format!("{n} control connections are open (max_sessions + 64 = {cap})"),
            ));
        }
        None
    }

    /// Gives back what [`Reactor::admit`] counted.
    fn release(&self, uid: u32) {
        self.ctx.connections.fetch_sub(1, Ordering::AcqRel);
        control::give(&self.ctx.conns_per_uid, uid);
    }

    /// Writes what connection `i` has unwritten, reads what it has sent
    /// and acts on it.
    fn ready(&mut self, i: usize) {
        let frame = match self.conns.get_mut(i) {
            None | Some(Slot::Busy) => return,
            Some(Slot::Lingering { stream, .. }) => {
                if drained(stream) {
                    self.conns.remove(i);
                    self.lingering -= 1;
                }
                return;
            }
            Some(Slot::Reading(c)) => {
                if c.flush().is_err() {
                    c.eof = true;
                    None
                } else if !c.out.is_empty() {
                    // The next request waits for the answer to go.
                    return;
                } else {
                    match read_request(c) {
                        Ok(Some(frame)) => Some(frame),
                        Ok(None) if c.eof => None,
                        Ok(None) => return,
                        Err((st, why)) => {
                            tracing::debug!(uid = c.uid, "{why}");
                            let request = c.buf.get(4).copied().unwrap_or(0);
                            let _ = c.send(&refusal(request, st, why));
                            None
                        }
                    }
                }
            }
        };
        let c = self.take(i);
        match frame {
            Some(frame) => self.dispatch(
                i,
                Job {
                    conn: c,
                    request: Some(frame),
                },
            ),
            None => self.hang_up(i, c),
        }
    }

    /// Takes the connection out of reading slot `i` (it becomes Busy).
    fn take(&mut self, i: usize) -> Conn {
        match std::mem::replace(&mut self.conns[i], Slot::Busy) {
            Slot::Reading(c) => c,
            Slot::Busy | Slot::Lingering { .. } => unreachable!("slot {i} is not reading"),
        }
    }

    /// Ends connection `i` (Busy), dropping its session first if it has
    /// one.
    fn hang_up(&mut self, i: usize, c: Conn) {
        match c.session {
            Some(_) => self.dispatch(
                i,
                Job {
                    conn: c,
                    request: None,
                },
            ),
            None => self.end(i, c),
        }
    }

    fn dispatch(&mut self, i: usize, job: Job) {
        let jobs = self
            .jobs
            .as_ref()
            .expect("workers run until the reactor ends");
        if let Err(crossbeam_channel::SendError((_, job))) = jobs.send((i, job)) {
            // No worker left (they never exit before the reactor): drop.
            self.conns.remove(i);
            self.release(job.conn.uid);
        }
    }

    /// Ends connection `i` (Busy, its session dropped): what of its
    /// answer the socket takes now is written, and it lingers.
    fn end(&mut self, i: usize, mut c: Conn) {
        let _ = c.flush();
        self.release(c.uid);
        self.linger(i, c.stream);
    }

    /// Shuts down for writing `stream`, polled as slot `i`, and drains it
    /// for [`LINGER`] in that slot (or drops it now).
    fn linger(&mut self, i: usize, stream: UnixStream) {
        let _ = stream.shutdown(std::net::Shutdown::Write);
        if self.lingering >= MAX_LINGERING || drained(&stream) {
            // Closing the last descriptor takes it out of the epoll set.
            self.conns.remove(i);
            return;
        }
        self.conns[i] = Slot::Lingering {
            stream,
            until: Instant::now() + LINGER,
        };
        self.lingering += 1;
    }

    /// Ends connections past their deadline.
    fn expire(&mut self, now: Instant) {
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, s)| deadline(s).is_some_and(|d| now >= d))
            .map(|(i, _)| i)
            .collect();
        for i in late {
            if let Slot::Lingering { .. } = self.conns[i] {
                self.conns.remove(i);
                self.lingering -= 1;
                continue;
            }
            let mut c = self.take(i);
            if c.out.is_empty() {
                tracing::debug!(uid = c.uid, "control connection opened no session in time");
                let _ = c.send(&refusal(
                    0,
                    status::BAD_REQUEST,
                    format!("no session opened within {HANDSHAKE_TIMEOUT:?} of connecting"),
                ));
            } else {
                tracing::debug!(
                    uid = c.uid,
                    "control connection did not read its answer in time"
                );
            }
            self.hang_up(i, c);
        }
    }
}

/// When the connection in a slot is ended (or, lingering, dropped).
fn deadline(s: &Slot) -> Option<Instant> {
    match s {
        Slot::Reading(c) => c.deadline(),
        Slot::Lingering { until, .. } => Some(*until),
        Slot::Busy => None,
    }
}

/// Reads toward the next whole request of `c`: `Ok(Some(frame))` once
/// one is in, `Ok(None)` when the socket has no more for now (or the peer
/// shut down, `c.eof`), `Err` with the refusal for a frame that cannot
/// be taken (a bad length, or the peer's end in the middle of one).
fn read_request(c: &mut Conn) -> Result<Option<Vec<u8>>, crate::registry::Refusal> {
    loop {
        // Only as much as the frame under way needs: the next request
        // stays in the socket until this one is answered.
        let need = if c.buf.len() < 4 {
            4 - c.buf.len()
        } else {
            let pre: [u8; 4] = c.buf[..4].try_into().expect("4 bytes");
            let n = frame_len(pre).map_err(|e| (status::BAD_REQUEST, e.to_string()))?;
            if c.buf.len() == 4 + n {
                let frame = c.buf[4..].to_vec();
                c.buf.clear();
                return Ok(Some(frame));
            }
            4 + n - c.buf.len()
        };
        let at = c.buf.len();
        c.buf.resize(at + need.min(MAX_FRAME), 0);
        match c.stream.read(&mut c.buf[at..]) {
            Ok(0) => {
                c.buf.truncate(at);
                c.eof = true;
                return match at {
                    0 => Ok(None),
                    1..4 => Err((
                        status::BAD_REQUEST,
                        format!(
                            "the connection was shut down {at} bytes into a frame's 4-byte length"
                        ),
                    )),
                    _ => Err((
                        status::BAD_REQUEST,
                        format!(
                            "the connection was shut down {} bytes into a {}-byte frame",
                            at - 4,
                            at - 4 + need
                        ),
                    )),
                };
            }
            Ok(n) => c.buf.truncate(at + n),
            Err(e) => {
                c.buf.truncate(at);
                match e.kind() {
                    ErrorKind::WouldBlock => return Ok(None),
                    ErrorKind::Interrupted => {}
                    _ => {
                        c.eof = true;
                        return Ok(None);
                    }
                }
            }
        }
    }
}

/// Reads and discards what `s` has; whether it is done (EOF or error).
fn drained(mut s: &UnixStream) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return e.kind() != ErrorKind::WouldBlock,
        }
    }
}

/// An `Error` frame answering `request`.
fn refusal(request: u8, st: i32, message: impl Into<String>) -> Vec<u8> {
    let mut out = Vec::new();
    Response::Error {
        request,
        status: st,
        message: message.into(),
    }
    .encode(&mut out);
    out
}

/// Runs a job on a worker thread: what becomes of the connection. A
/// panic ends the connection (its session dropped) and nothing else.
fn run_job(ctx: &Ctx, c: &mut Conn, request: Option<Vec<u8>>) -> Next {
    let next = catch_unwind(AssertUnwindSafe(|| match request {
        Some(frame) => answer(ctx, c, &frame),
        None => Next::End,
    }))
    .unwrap_or_else(|_| {
        tracing::error!(
            uid = c.uid,
            "a control request panicked; its connection is closed"
        );
        Next::End
    });
    if let Next::End = next
        && let Some(o) = c.session.take()
        && catch_unwind(AssertUnwindSafe(|| control::close(ctx, &o))).is_err()
    {
        tracing::error!(session = o.id, "closing a session panicked");
    }
    next
}

/// Runs one request of `c` and queues its answer.
fn answer(ctx: &Ctx, c: &mut Conn, frame: &[u8]) -> Next {
    let req = match Request::decode(frame) {
        Ok(r) => r,
        Err(e) => {
            let first = frame.first().copied().unwrap_or(0);
            let _ = c.send(&refusal(first, status::BAD_REQUEST, e.to_string()));
            return Next::End;
        }
    };
    let mut out = Vec::new();
    let (request, r) = match req {
        Request::Open { .. } if c.session.is_some() => (
            msg::OPEN,
            Err((
                status::STATE,
                "this connection already has a session".to_string(),
            )),
        ),
        Request::Open {
            version,
            job,
            operator,
            subtask,
            parallelism,
            max_parallelism,
            sq_entries,
            cq_entries,
            arena_bytes,
            chunk_slots,
            key_groups,
        } => match control::open(
            ctx,
            c.uid,
            version,
            &job,
            &operator,
            (subtask, parallelism, max_parallelism, key_groups),
            (sq_entries, cq_entries, arena_bytes, chunk_slots),
        ) {
            Ok((o, resp, fds)) => {
                resp.encode(&mut out);
                // The answer is the connection's first and the socket's
                // buffer holds it: a send that would block is a peer
                // that filled it with requests it never reads answers to.
                let sent = send_fds(
                    &c.stream,
                    &out,
                    &[
                        fds.memfd.as_fd(),
                        fds.to_daemon.as_fd(),
                        fds.to_client.as_fd(),
                    ],
                );
                c.session = Some(o);
                return if sent.is_ok() { Next::Keep } else { Next::End };
            }
            Err(r) => (msg::OPEN, Err(r)),
        },
        Request::Register { kind, name } => (
            msg::REGISTER,
            match &mut c.session {
                None => Err((status::STATE, "open a session first".to_string())),
                Some(o) => control::register(ctx, o, kind, &name)
                    .map(|state| Response::Registered { state }),
            },
        ),
        Request::Restore { handles } => (
            msg::RESTORE,
            match &c.session {
                None => Err((status::STATE, "open a session first".to_string())),
                Some(o) => control::restore(ctx, o, handles),
            },
        ),
        // With or without a session (a JobManager's connection has none).
        Request::Release {
            job,
            operator,
            handles,
        } => (
            msg::RELEASE,
            control::release(ctx, c.uid, &job, &operator, handles),
        ),
        Request::Close => {
            if let Some(o) = c.session.take() {
                control::close(ctx, &o);
            }
            Response::Closed.encode(&mut out);
            let _ = c.send(&out);
            return Next::End;
        }
    };
    let sent = match r {
        Ok(resp) => {
            resp.encode(&mut out);
            c.send(&out)
        }
        Err((st, m)) => c.send(&refusal(request, st, m)),
    };
    match sent {
        Ok(()) => Next::Keep,
        Err(_) => Next::End,
    }
}
