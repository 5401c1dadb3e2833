//! Futures over a [`Session`], for any executor.
//!
//! A call's future submits its request the first time it is polled and
//! completes when the reaper thread has seen its completion. The reaper
//! sleeps on the session's doorbell and control socket while nothing is
//! ready, so a daemon that dies fails every pending future at once.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;

use crate::session::poll_two;
use crate::{Error, Kind, Request, Session, Status};

/// A finished request, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: Status,
    pub value: Option<Vec<u8>>,
    pub aux: u64,
    pub more: bool,
}

enum Slot {
    Waiting(Waker),
    Done(Result<Reply, String>),
    /// Its future was dropped before the reply came: the reply is dropped.
    Abandoned,
}

struct Inner {
    session: Session,
    slots: HashMap<u64, Slot>,
    next: u64,
    /// Futures waiting for queue or arena room.
    blocked: Vec<Waker>,
    dead: Option<String>,
}

struct Shared {
    inner: Mutex<Inner>,
    stop: AtomicBool,
}

/// A session whose calls are futures. Cheap to clone; the last clone
/// dropped stops the reaper.
pub struct AsyncSession {
    shared: Arc<Shared>,
    reaper: Option<Arc<JoinHandle<()>>>,
}

impl Clone for AsyncSession {
    fn clone(&self) -> Self {
        AsyncSession {
            shared: self.shared.clone(),
            reaper: self.reaper.clone(),
        }
    }
}

fn lock(s: &Shared) -> MutexGuard<'_, Inner> {
    s.inner.lock().unwrap_or_else(|p| p.into_inner())
}

impl AsyncSession {
    /// Wraps an open session and starts its reaper thread.
    pub fn new(session: Session) -> Result<AsyncSession, Error> {
        let (bell, sock) = session
            .wait_fds()
            .map_err(|e| Error::Protocol(format!("cannot duplicate session fds: {e}")))?;
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                session,
                slots: HashMap::new(),
                next: 0,
                blocked: Vec::new(),
                dead: None,
            }),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let reaper = std::thread::Builder::new()
            .name("stator-reaper".into())
            .spawn(move || reap(&s, bell, sock))
            .map_err(|e| Error::Protocol(format!("cannot start the reaper thread: {e}")))?;
        Ok(AsyncSession {
            shared,
            reaper: Some(Arc::new(reaper)),
        })
    }

    /// Registers (or finds) a state.
    pub fn register(&self, name: &str, kind: Kind) -> Result<u32, Error> {
        lock(&self.shared).session.register(name, kind)
    }

    /// The session's key-group range.
    pub fn key_groups(&self) -> (u16, u16) {
        lock(&self.shared).session.key_groups()
    }

    /// Runs one request: resolves to its reply (`NotFound` included) or
    /// the error it failed with.
    pub fn call(&self, r: &Request<'_>) -> Call {
        Call {
            shared: self.shared.clone(),
            req: Some(Owned::from(r)),
            token: None,
        }
    }

    /// A value (or list, or map entry) read: `None` when absent.
    pub async fn read(&self, r: &Request<'_>) -> Result<Option<Vec<u8>>, Error> {
        let reply = self.call(r).await?;
        Ok(match reply.status {
            Status::NotFound => None,
            _ => Some(reply.value.unwrap_or_default()),
        })
    }

    /// A write (or any request whose reply carries no bytes).
    pub async fn write(&self, r: &Request<'_>) -> Result<(), Error> {
        self.call(r).await.map(|_| ())
    }
}

impl Drop for AsyncSession {
    fn drop(&mut self) {
        if let Some(r) = self.reaper.take()
            && let Ok(j) = Arc::try_unwrap(r)
        {
            self.shared.stop.store(true, Ordering::Release);
            let _ = j.join();
        }
    }
}

/// A request's bytes, owned by its future until it is submitted.
struct Owned {
    op: crate::Opcode,
    state: u32,
    key_group: u16,
    key: Vec<u8>,
    namespace: Vec<u8>,
    user_key: Vec<u8>,
    value: Vec<u8>,
    capacity: u32,
    arg: u64,
    arg2: u32,
    flags: u8,
}

impl From<&Request<'_>> for Owned {
    fn from(r: &Request<'_>) -> Owned {
        Owned {
            op: r.op,
            state: r.state,
            key_group: r.key_group,
            key: r.key.to_vec(),
            namespace: r.namespace.to_vec(),
            user_key: r.user_key.to_vec(),
            value: r.value.to_vec(),
            capacity: r.capacity,
            arg: r.arg,
            arg2: r.arg2,
            flags: r.flags,
        }
    }
}

impl Owned {
    fn request(&self) -> Request<'_> {
        Request {
            op: self.op,
            state: self.state,
            key_group: self.key_group,
            key: &self.key,
            namespace: &self.namespace,
            user_key: &self.user_key,
            value: &self.value,
            capacity: self.capacity,
            arg: self.arg,
            arg2: self.arg2,
            flags: self.flags,
        }
    }
}

/// The future of one request.
pub struct Call {
    shared: Arc<Shared>,
    req: Option<Owned>,
    token: Option<u64>,
}

impl Future for Call {
    type Output = Result<Reply, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut g = lock(&this.shared);
        if let Some(m) = &g.dead {
            return Poll::Ready(Err(Error::DaemonGone(m.clone())));
        }
        let Some(token) = this.token else {
            let req = this.req.as_ref().expect("a call is submitted once");
            let token = g.next;
            match g.session.submit(&req.request(), token) {
                Ok(()) => {}
                Err(Error::Full) if g.session.in_flight() == 0 => {
                    // Nothing in flight will free room: it can never fit.
                    return Poll::Ready(Err(Error::TooLarge));
                }
                Err(Error::Full) => {
                    g.blocked.push(cx.waker().clone());
                    return Poll::Pending;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
            if let Err(e) = g.session.flush() {
                return Poll::Ready(Err(e));
            }
            g.next += 1;
            g.slots.insert(token, Slot::Waiting(cx.waker().clone()));
            this.token = Some(token);
            this.req = None;
            return Poll::Pending;
        };
        match g.slots.remove(&token) {
            Some(Slot::Done(r)) => {
                Poll::Ready(
                    r.map_err(Error::DaemonGone)
                        .and_then(|reply| match reply.status {
                            Status::Ok | Status::NotFound => Ok(reply),
                            Status::ResultTooLarge => Err(Error::ResultTooLarge {
                                needed: reply.aux as u32,
                            }),
                            s => Err(Error::Status(s)),
                        }),
                )
            }
            Some(Slot::Waiting(_)) | Some(Slot::Abandoned) | None => {
                g.slots.insert(token, Slot::Waiting(cx.waker().clone()));
                Poll::Pending
            }
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        // A submitted request completes anyway; forget its reply then.
        if let Some(token) = self.token {
            let mut g = lock(&self.shared);
            if let Some(Slot::Waiting(_)) = g.slots.get(&token) {
                g.slots.insert(token, Slot::Abandoned);
            } else {
                g.slots.remove(&token);
            }
        }
    }
}

/// The reaper: delivers completions and wakes their futures; sleeps on the
/// doorbell and the control socket when nothing is ready.
fn reap(shared: &Shared, bell: std::os::fd::OwnedFd, sock: std::os::fd::OwnedFd) {
    while !shared.stop.load(Ordering::Acquire) {
        let sleep = {
            let mut g = lock(shared);
            let Inner {
                session,
                slots,
                blocked,
                ..
            } = &mut *g;
            let r = session.poll(|c| {
                let reply = match c.status {
                    Ok(status) => Ok(Reply {
                        status,
                        value: c.value.map(|v| v.to_vec()),
                        aux: if status == Status::ResultTooLarge {
                            c.needed as u64
                        } else {
                            c.aux
                        },
                        more: c.more,
                    }),
                    Err(code) => Err(format!("unknown completion status {code}")),
                };
                match slots.insert(c.token, Slot::Done(reply)) {
                    Some(Slot::Waiting(w)) => w.wake(),
                    Some(Slot::Abandoned) => {
                        slots.remove(&c.token);
                    }
                    _ => {}
                }
            });
            match r {
                Ok(n) => {
                    if n > 0 {
                        blocked.drain(..).for_each(Waker::wake);
                        false
                    } else {
                        match session.prepare_sleep() {
                            Ok(ready) => !ready,
                            Err(e) => {
                                fail_all(&mut g, e.to_string());
                                return;
                            }
                        }
                    }
                }
                Err(e) => {
                    fail_all(&mut g, e.to_string());
                    return;
                }
            }
        };
        if !sleep {
            continue;
        }
        let ready = poll_two(bell.as_fd(), sock.as_fd(), 50);
        let mut g = lock(shared);
        let r = match ready {
            Ok((b, s)) => g.session.after_sleep(b, s),
            Err(e) => Err(e),
        };
        if let Err(e) = r {
            fail_all(&mut g, e.to_string());
            return;
        }
    }
}

fn fail_all(g: &mut Inner, why: String) {
    let _ = g.session.fail(why.clone());
    g.dead = Some(why.clone());
    for (_, slot) in g.slots.iter_mut() {
        match std::mem::replace(slot, Slot::Done(Err(why.clone()))) {
            Slot::Waiting(w) => w.wake(),
            Slot::Abandoned => *slot = Slot::Abandoned,
            Slot::Done(r) => *slot = Slot::Done(r),
        }
    }
    g.blocked.drain(..).for_each(Waker::wake);
}
