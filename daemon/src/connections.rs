//! The control socket's connections, served without a thread each.
//!
//! One thread (`statord-control`) accepts and reads every connection
//! through epoll (mio). A complete request goes, with its connection, to
//! one of [`WORKERS`] threads, which runs it (a shard round trip, a
//! registry fsync; `control.rs`) and writes the answer, then hands the
//! connection back; a connection has one request at a time in a worker,
//! so answers keep the order of requests.
//!
//! Limits (`daemon/CONTROL.md`, Connections):
//! - A connection without a session must open one within
//!   [`HANDSHAKE_TIMEOUT`] of its accept: a deadline, not a timeout per
//!   read, so bytes trickled one at a time cannot hold it open. Past it,
//!   it is answered `BAD_REQUEST` and closed.
//! - At most `max_sessions` + 64 connections in all, and with
//!   `max_sessions_per_uid` set at most that + 8 of one uid: one past a
//!   cap is answered `LIMIT` (never reset) and closed.
//! - A connection the daemon ends is shut down for writing and drained
//!   for [`LINGER`], so that its peer reads the reason (closing a Unix
//!   socket with unread input resets the peer, which may lose it).

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
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
/// How long a worker waits for room to write an answer (a peer that
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

/// What a worker is given.
enum Job {
    Request(Conn, Vec<u8>),
    /// The peer closed a connection with a session: drop the session.
    Hangup(Conn),
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
                        for (slot, job) in rx {
                            if let Some((c, next)) = work(&ctx, job) {
                                let _ = tx.send((slot, c, next));
                                let _ = waker.wake();
                            }
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
            for ev in events.iter() {
                match ev.token() {
                    LISTENER => self.accept(listener),
                    WAKER => {}
                    Token(i) => self.readable(i),
                }
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
                        self.readable(i);
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
    fn tell_broken(&mut self, i: usize, c: Conn, why: String) {
        refuse(
            &c.stream,
            0,
            status::QUEUE_BROKEN,
            format!("the session broke the queue protocol and is closed: {why}"),
            Duration::ZERO,
        );
        self.dispatch(i, Job::Hangup(c));
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
        self.conns
            .iter()
            .filter_map(|(_, s)| match s {
                Slot::Reading(c) if c.session.is_none() => Some(c.accepted + HANDSHAKE_TIMEOUT),
                Slot::Lingering { until, .. } => Some(*until),
                Slot::Reading(_) | Slot::Busy => None,
            })
            .min()
    }

    fn accept(&mut self, listener: &UnixListener) {
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE and the like: the next event retries.
                    tracing::error!(error = %e, "accept failed");
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
            if let Some((st, why)) = self.admit(uid) {
                tracing::warn!(uid, "{why}; connection refused");
                refuse(&stream, msg::OPEN, st, why, Duration::ZERO);
                self.linger(stream);
                continue;
            }
            let entry = self.conns.vacant_entry();
            let i = entry.key();
            if let Err(e) = self.poll.registry().register(
                &mut SourceFd(&stream.as_raw_fd()),
                Token(i),
                Interest::READABLE,
            ) {
                tracing::error!(error = %e, "cannot poll a connection; dropped");
                self.release(uid);
                continue;
            }
            entry.insert(Slot::Reading(Conn {
                stream,
                uid,
                buf: Vec::new(),
                eof: false,
                accepted: Instant::now(),
                session: None,
            }));
            // Bytes sent before the registration raised no event.
            self.readable(i);
        }
    }

    /// Counts a new connection of `uid` against the caps, or says why
    /// not.
    fn admit(&self, uid: u32) -> Option<control::Refusal> {
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

    /// Reads what connection `i` has sent and acts on it.
    fn readable(&mut self, i: usize) {
        enum Then {
            Wait,
            Run(Vec<u8>),
            Ended,
        }
        let then = match self.conns.get_mut(i) {
            None | Some(Slot::Busy) => Then::Wait,
            Some(Slot::Lingering { stream, .. }) => {
                if drained(stream) {
                    self.conns.remove(i);
                    self.lingering -= 1;
                }
                Then::Wait
            }
            Some(Slot::Reading(c)) => match read_request(c) {
                Ok(Some(frame)) => Then::Run(frame),
                Ok(None) if c.eof => Then::Ended,
                Ok(None) => Then::Wait,
                Err((st, why)) => {
                    tracing::debug!(uid = c.uid, "{why}");
                    let request = c.buf.get(4).copied().unwrap_or(0);
                    refuse(&c.stream, request, st, why, Duration::ZERO);
                    Then::Ended
                }
            },
        };
        let c = match then {
            Then::Wait => return,
            Then::Run(_) | Then::Ended => match std::mem::replace(&mut self.conns[i], Slot::Busy) {
                Slot::Reading(c) => c,
                Slot::Busy | Slot::Lingering { .. } => unreachable!("read above"),
            },
        };
        match then {
            Then::Run(frame) => self.dispatch(i, Job::Request(c, frame)),
            // Its session (if any) is dropped by a worker first.
            Then::Ended if c.session.is_some() => self.dispatch(i, Job::Hangup(c)),
            Then::Ended => self.end(i, c),
            Then::Wait => unreachable!("returned above"),
        }
    }

    fn dispatch(&mut self, i: usize, job: Job) {
        let jobs = self
            .jobs
            .as_ref()
            .expect("workers run until the reactor ends");
        if let Err(crossbeam_channel::SendError((_, job))) = jobs.send((i, job)) {
            // No worker left (they never exit before the reactor): drop.
            let c = match job {
                Job::Request(c, _) | Job::Hangup(c) => c,
            };
            self.conns.remove(i);
            self.release(c.uid);
        }
    }

    /// A worker ended connection `i` after answering it.
    fn end(&mut self, i: usize, c: Conn) {
        self.conns.remove(i);
        self.release(c.uid);
        self.linger(c.stream);
    }

    /// Shuts `stream` down for writing and drains it for [`LINGER`].
    fn linger(&mut self, stream: UnixStream) {
        let _ = stream.shutdown(std::net::Shutdown::Write);
        if self.lingering >= MAX_LINGERING || drained(&stream) {
            return;
        }
        let entry = self.conns.vacant_entry();
        let i = entry.key();
        if self
            .poll
            .registry()
            .register(
                &mut SourceFd(&stream.as_raw_fd()),
                Token(i),
                Interest::READABLE,
            )
            .is_ok()
        {
            entry.insert(Slot::Lingering {
                stream,
                until: Instant::now() + LINGER,
            });
            self.lingering += 1;
        }
    }

    /// Ends connections past their deadline.
    fn expire(&mut self, now: Instant) {
        let late: Vec<usize> = self
            .conns
            .iter()
            .filter(|(_, s)| match s {
                Slot::Reading(c) => c.session.is_none() && now >= c.accepted + HANDSHAKE_TIMEOUT,
                Slot::Lingering { until, .. } => now >= *until,
                Slot::Busy => false,
            })
            .map(|(i, _)| i)
            .collect();
        for i in late {
            match self.conns.remove(i) {
                Slot::Reading(c) => {
                    tracing::debug!(uid = c.uid, "control connection opened no session in time");
                    refuse(
                        &c.stream,
                        0,
                        status::BAD_REQUEST,
                        format!("no session opened within {HANDSHAKE_TIMEOUT:?} of connecting"),
                        Duration::ZERO,
                    );
                    self.release(c.uid);
                    self.linger(c.stream);
                }
                Slot::Lingering { .. } => self.lingering -= 1,
                Slot::Busy => unreachable!("filtered above"),
            }
        }
    }
}

/// Reads toward the next whole request of `c`: `Ok(Some(frame))` once
/// one is in, `Ok(None)` when the socket has no more for now (or the peer
/// shut down, `c.eof`), `Err` with the refusal for a frame that cannot
/// be taken (a bad length, or the peer's end in the middle of one).
fn read_request(c: &mut Conn) -> Result<Option<Vec<u8>>, control::Refusal> {
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

/// Writes all of `bytes` to a non-blocking `s`, waiting for room at most
/// `wait` in all.
fn write_all(mut s: &UnixStream, mut bytes: &[u8], wait: Duration) -> std::io::Result<()> {
    let deadline = Instant::now() + wait;
    while !bytes.is_empty() {
        match s.write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(ErrorKind::TimedOut.into());
                }
                let ms = u16::try_from(left.as_millis().max(1)).unwrap_or(u16::MAX);
                let mut pfd = [nix::poll::PollFd::new(
                    s.as_fd(),
                    nix::poll::PollFlags::POLLOUT,
                )];
                let _ = nix::poll::poll(&mut pfd, nix::poll::PollTimeout::from(ms));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Answers `request` with an `Error` frame (best effort).
fn refuse(s: &UnixStream, request: u8, st: i32, message: impl Into<String>, wait: Duration) {
    let mut out = Vec::new();
    Response::Error {
        request,
        status: st,
        message: message.into(),
    }
    .encode(&mut out);
    let _ = write_all(s, &out, wait);
}

/// Runs a job on a worker thread; the connection back, unless it is gone.
fn work(ctx: &Ctx, job: Job) -> Option<(Conn, Next)> {
    match job {
        Job::Hangup(mut c) => {
            if let Some(o) = c.session.take() {
                control::close(ctx, &o);
            }
            Some((c, Next::End))
        }
        Job::Request(mut c, frame) => {
            let next = answer(ctx, &mut c, &frame);
            if matches!(next, Next::End)
                && let Some(o) = c.session.take()
            {
                control::close(ctx, &o);
            }
            Some((c, next))
        }
    }
}

/// Runs one request of `c` and writes its answer.
fn answer(ctx: &Ctx, c: &mut Conn, frame: &[u8]) -> Next {
    let s = &c.stream;
    let req = match Request::decode(frame) {
        Ok(r) => r,
        Err(e) => {
            let first = frame.first().copied().unwrap_or(0);
            refuse(s, first, status::BAD_REQUEST, e.to_string(), WRITE_TIMEOUT);
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
                    s,
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
        Request::Close => {
            if let Some(o) = c.session.take() {
                control::close(ctx, &o);
            }
            Response::Closed.encode(&mut out);
            let _ = write_all(s, &out, WRITE_TIMEOUT);
            return Next::End;
        }
    };
    match r {
        Ok(resp) => {
            resp.encode(&mut out);
            match write_all(s, &out, WRITE_TIMEOUT) {
                Ok(()) => Next::Keep,
                Err(_) => Next::End,
            }
        }
        Err((st, m)) => {
            refuse(s, request, st, m, WRITE_TIMEOUT);
            Next::Keep
        }
    }
}
