//! Every `unsafe` of the crate: memory the Java side owns (direct
//! buffers, named by address and length), the session handle as a
//! `jlong`, and the two JNI functions that turn addresses into direct
//! buffers and back.
//!
//! The contract with `io.stator.flink.jni.StatorJni` (stated there too):
//! - an address and length passed in name a live direct buffer of at
//!   least that many bytes, which no other thread touches during the call
//!   (the scratch buffer is the calling thread's; a session's command and
//!   completion buffers are kept reachable by the Java session object and
//!   used under its one-thread-at-a-time rule, which the native side checks
//!   too);
//! - a handle is 0 or a value `open` returned and `free` has not been given.

use std::sync::atomic::{AtomicBool, Ordering};

use jni_sys::{JNIEnv, jlong, jobject};

use crate::session::JniSession;
use crate::sleeper::Sleeper;

/// Memory of a Java direct buffer: copies in and out, bounds-checked, and
/// never a Rust reference that outlives the call.
#[derive(Clone, Copy, Debug)]
pub struct JavaBuf {
    ptr: *mut u8,
    len: usize,
}

impl JavaBuf {
    /// Names `len` bytes at `addr`; refuses a null or negative one.
    pub fn new(addr: jlong, len: i64) -> Result<JavaBuf, String> {
        if addr == 0 || len < 0 {
            return Err(format!("bad buffer: address {addr:#x}, length {len}"));
        }
        Ok(JavaBuf {
            ptr: addr as usize as *mut u8,
            len: len as usize,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `out.len()` bytes from offset `at`.
    pub fn read(&self, at: usize, out: &mut [u8]) -> Result<(), String> {
        self.check(at, out.len())?;
        // SAFETY: `check` keeps the range inside the buffer, which the Java
        // side keeps alive and untouched for the call (module doc).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `bytes` to offset `at`.
    pub fn write(&self, at: usize, bytes: &[u8]) -> Result<(), String> {
        self.check(at, bytes.len())?;
        // SAFETY: as in `read`.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(at), bytes.len()) };
        Ok(())
    }

    /// The first `len` bytes, copied out, for decoding an argument block.
    pub fn copy_out(&self, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        self.read(0, &mut v)?;
        Ok(v)
    }

    fn check(&self, at: usize, n: usize) -> Result<(), String> {
        match at.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(format!(
                "{n} bytes at {at} overrun a {}-byte buffer",
                self.len
            )),
        }
    }
}

/// A session as Java holds it: the `JniSession` behind a
/// one-thread-at-a-time flag.
pub struct Handle {
    busy: AtomicBool,
    session: std::cell::UnsafeCell<JniSession>,
}

// SAFETY: a `JavaBuf` names memory of a Java direct buffer (or the shared
// segment) that stays valid while the Java object holding it lives, on
// whichever thread; it is only dereferenced inside a call, under the
// session's busy flag, so moving it between threads moves no access.
unsafe impl Send for JavaBuf {}

/// A session is used from several JVM threads in turn (the task thread,
/// the asynchronous snapshot thread), one at a time under `busy`: it must
/// be `Send`, which this checks at compile time.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<JniSession>();
};

impl Handle {
    pub fn into_jlong(s: JniSession) -> jlong {
        Box::into_raw(Box::new(Handle {
            busy: AtomicBool::new(false),
            session: std::cell::UnsafeCell::new(s),
        })) as jlong
    }

    /// Runs `f` on the session behind `h`, refusing a second thread.
    pub fn with<T>(h: jlong, f: impl FnOnce(&mut JniSession) -> T) -> Result<T, String> {
        if h == 0 {
            return Err("the session is closed".into());
        }
        // SAFETY: a non-zero handle is a live `Box<Handle>` from
        // `into_jlong` that `free` has not taken back (module doc).
        let handle = unsafe { &*(h as usize as *const Handle) };
        if handle.busy.swap(true, Ordering::Acquire) {
            return Err("another thread is inside a call on this session".into());
        }
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _release = Release(&handle.busy);
        // SAFETY: the busy flag is ours until `_release` drops, so no other
        // reference to the session exists; ours ends inside this call.
        Ok(f(unsafe { &mut *handle.session.get() }))
    }

    /// Takes the session back from Java (its handle is dead afterwards).
    pub fn free(h: jlong) -> Option<JniSession> {
        if h == 0 {
            return None;
        }
        // SAFETY: as in `with`; Java gives a handle to `free` once, after
        // its last call, so no call is inside it now.
        let b = unsafe { Box::from_raw(h as usize as *mut Handle) };
        Some(b.session.into_inner())
    }
}

/// A sleeper as Java holds it (`io.stator.flink.jni.Sleeper`): shared by
/// the thread that sleeps and the threads that wake it, freed once after
/// both stopped.
pub struct SleeperHandle;

impl SleeperHandle {
    pub fn into_jlong(s: Sleeper) -> jlong {
        Box::into_raw(Box::new(s)) as jlong
    }

    /// Runs `f` on the sleeper behind `h` (shared: its calls take `&self`).
    pub fn with<T>(h: jlong, f: impl FnOnce(&Sleeper) -> T) -> Result<T, String> {
        if h == 0 {
            return Err("the sleeper is closed".into());
        }
        // SAFETY: a non-zero sleeper handle is a live `Box<Sleeper>` from
        // `into_jlong` that `free` has not taken back: Java frees it once,
        // after the sleeping thread ended and under the lock its wakers
        // take. `Sleeper` is `Sync` (fds and an eventfd, read-only here).
        Ok(f(unsafe { &*(h as usize as *const Sleeper) }))
    }

    pub fn free(h: jlong) {
        if h != 0 {
            // SAFETY: as in `with`; this is the handle's one `free`.
            drop(unsafe { Box::from_raw(h as usize as *mut Sleeper) });
        }
    }
}

/// `NewDirectByteBuffer`: a Java direct buffer over native memory (an
/// arena or a chunk region of a session's shared segment).
pub fn new_direct_buffer(env: *mut JNIEnv, addr: *mut u8, len: usize) -> jobject {
    if env.is_null() || addr.is_null() || len > i64::MAX as usize {
        return std::ptr::null_mut();
    }
    // SAFETY: `env` is the JNIEnv the JVM passed to this native call, whose
    // function table has NewDirectByteBuffer (JNI 1.4); the memory stays
    // mapped while the session lives, and the Java side touches its views
    // only through a channel that refuses every call once it closed the
    // session (under the lock its state calls hold).
    unsafe { ((**env).v1_4.NewDirectByteBuffer)(env, addr.cast(), len as jlong) }
}

/// `GetDirectBufferAddress`: where a Java direct buffer's memory lies
/// (0 for a heap buffer or null).
pub fn direct_buffer_address(env: *mut JNIEnv, buf: jobject) -> jlong {
    if env.is_null() || buf.is_null() {
        return 0;
    }
    // SAFETY: as in `new_direct_buffer`; `buf` is a local reference the JVM
    // passed to this call.
    unsafe { ((**env).v1_4.GetDirectBufferAddress)(env, buf) as usize as jlong }
}
