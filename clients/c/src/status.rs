//! Status codes, the thread's last error message, and the guard that keeps
//! panics from crossing the boundary.

use std::borrow::Cow;
use std::cell::RefCell;
use std::ffi::{CStr, c_char};

use stator_client::Error;

/// Success.
pub const STATOR_OK: i32 = 0;
/// A read found nothing (a completion status; not an error).
pub const STATOR_NOT_FOUND: i32 = 1;

// Request statuses: what a completion carries when the daemon refused or
// failed a request. Same values as the wire protocol (ring/PROTOCOL.md §6).
/// Unknown opcode.
pub const STATOR_E_BAD_OPCODE: i32 = -1;
/// Flags not valid for this opcode.
pub const STATOR_E_BAD_FLAGS: i32 = -2;
/// A key, namespace, user key or value lies outside the arena, or is set
/// where the opcode takes none.
pub const STATOR_E_BAD_RANGE: i32 = -3;
/// State id not registered in this session, or of the wrong kind.
pub const STATOR_E_BAD_STATE: i32 = -4;
/// Key group outside this session's key-group range.
pub const STATOR_E_BAD_KEY_GROUP: i32 = -5;
/// The result does not fit its buffer: `len` holds the size it needs;
/// resubmit with `capacity` at least that.
pub const STATOR_E_RESULT_TOO_LARGE: i32 = -6;
/// No provided buffer was available.
pub const STATOR_E_NO_BUFFER: i32 = -7;
/// A provided buffer lies outside the arena.
pub const STATOR_E_BAD_BUFFER: i32 = -8;
/// An argument (arg, arg2, a size) is invalid.
pub const STATOR_E_BAD_ARGUMENT: i32 = -9;
/// A key or value exceeds the session's limits.
pub const STATOR_E_TOO_LARGE: i32 = -10;
/// A per-session limit is reached; retry after completions.
pub const STATOR_E_BUSY: i32 = -11;
/// Storage I/O error.
pub const STATOR_E_IO: i32 = -12;
/// Stored data failed its checksum.
pub const STATOR_E_CORRUPT: i32 = -13;
/// The daemon's disk is full.
pub const STATOR_E_NO_SPACE: i32 = -14;
/// The daemon does not support this request.
pub const STATOR_E_UNSUPPORTED: i32 = -15;
/// The daemon is shutting down.
pub const STATOR_E_SHUTTING_DOWN: i32 = -16;
/// Remote storage failed.
pub const STATOR_E_REMOTE: i32 = -17;
/// Internal daemon error.
pub const STATOR_E_INTERNAL: i32 = -18;
/// A snapshot chunk is corrupt, truncated, out of order or of another
/// snapshot, or its states cannot be resolved.
pub const STATOR_E_BAD_SNAPSHOT: i32 = -19;

// Library statuses: what a call returns when it could not do its part.
/// A pointer argument that must not be NULL was NULL.
pub const STATOR_E_NULL: i32 = -100;
/// An argument is out of range: a length, an opcode, a kind, a slot, a
/// reservation id, a string that is not UTF-8, a max parallelism outside
/// 1..=32768.
pub const STATOR_E_INVALID_ARGUMENT: i32 = -101;
/// The session was closed with `stator_close`.
pub const STATOR_E_CLOSED: i32 = -102;
/// Another thread is inside a call on this session right now. A session
/// is used by one thread at a time; this call did nothing.
pub const STATOR_E_IN_USE: i32 = -103;
/// The submission queue or the shared arena is full: reap completions,
/// then retry.
pub const STATOR_E_FULL: i32 = -104;
/// The request is larger than the session's arena can ever hold.
pub const STATOR_E_REQUEST_TOO_LARGE: i32 = -105;
/// The daemon's socket could not be reached.
pub const STATOR_E_CONNECT: i32 = -106;
/// The daemon refused the call (open, register, restore, close); the
/// reason is in `stator_last_error()`.
pub const STATOR_E_REFUSED: i32 = -107;
/// The daemon stopped or died; the session is unusable (close and free
/// it, then open a new one).
pub const STATOR_E_DAEMON_GONE: i32 = -108;
/// The daemon broke the protocol (or a chunk slot was used out of turn).
pub const STATOR_E_PROTOCOL: i32 = -109;
/// The wait timed out with no completion ready.
pub const STATOR_E_TIMED_OUT: i32 = -110;
/// The call is not valid in the session's current state: a chunk slot
/// handed to the daemon, a snapshot helper with requests in flight.
pub const STATOR_E_INVALID_STATE: i32 = -111;
/// A callback of the caller returned an error; the operation was undone.
pub const STATOR_E_CALLBACK: i32 = -112;
/// A bug in libstator (a Rust panic, caught at the boundary). The session
/// it happened in refuses further calls; free it.
pub const STATOR_E_PANIC: i32 = -113;
/// A system call failed (out of fds or memory); `stator_last_error()`
/// names it.
pub const STATOR_E_SYSTEM: i32 = -114;

/// A failed call: its status code and what to say about it.
#[derive(Debug)]
pub(crate) struct Fail {
    pub code: i32,
    pub msg: Cow<'static, str>,
}

impl Fail {
    pub fn new(code: i32, msg: impl Into<Cow<'static, str>>) -> Fail {
        Fail {
            code,
            msg: msg.into(),
        }
    }

    pub fn null(what: &'static str) -> Fail {
        Fail::new(STATOR_E_NULL, format!("{what} is NULL"))
    }

    pub fn arg(msg: impl Into<Cow<'static, str>>) -> Fail {
        Fail::new(STATOR_E_INVALID_ARGUMENT, msg)
    }

    /// Records the message as this thread's last error; returns the code.
    pub fn report(self) -> i32 {
        set_last_error(&self.msg);
        self.code
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        // A full queue is routine at depth: no allocation for it.
        if let Error::Full = e {
            return Fail::new(
                STATOR_E_FULL,
                "the submission queue or the arena is full; reap completions and retry",
            );
        }
        let code = match &e {
            Error::Connect { .. } => STATOR_E_CONNECT,
            Error::Refused { .. } => STATOR_E_REFUSED,
            Error::DaemonGone(_) => STATOR_E_DAEMON_GONE,
            Error::Status(s) => *s as i32,
            Error::ResultTooLarge { .. } => STATOR_E_RESULT_TOO_LARGE,
            Error::Full => STATOR_E_FULL,
            Error::TooLarge => STATOR_E_REQUEST_TOO_LARGE,
            Error::Protocol(_) => STATOR_E_PROTOCOL,
            Error::InvalidArgument(_) => STATOR_E_INVALID_ARGUMENT,
        };
        Fail::new(code, e.to_string())
    }
}

pub(crate) type Res<T> = Result<T, Fail>;

thread_local! {
    /// The thread's last error message, NUL-terminated (empty: none yet).
    static LAST_ERROR: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

fn set_last_error(msg: &str) {
    // `try_with`: a call from a thread-exit destructor finds the slot gone;
    // the message is then dropped rather than panicking across the ABI.
    let _ = LAST_ERROR.try_with(|l| {
        let mut l = l.borrow_mut();
        l.clear();
        l.extend(msg.bytes().map(|b| if b == 0 { b' ' } else { b }));
        l.push(0);
    });
}

/// Runs `f`, turning its failure or panic into a status code (and the
/// thread's last error). Every exported function ends here, so no panic
/// unwinds into C.
pub(crate) fn guard(f: impl FnOnce() -> Res<i32>) -> i32 {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => e.report(),
        Err(p) => Fail::new(STATOR_E_PANIC, panic_message(&*p)).report(),
    }
}

pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let what = p
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(no message)");
    format!("libstator bug (a panic, caught): {what}")
}

/// What status `code` means, in one line (a static string; never NULL,
/// also for codes this library does not know).
///
/// # Safety
/// None: any code is fine. The string is static (do not free it).
/// Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn stator_strerror(code: i32) -> *const c_char {
    let s: &'static CStr = match code {
        STATOR_OK => c"success",
        STATOR_NOT_FOUND => c"not found",
        STATOR_E_BAD_OPCODE => c"unknown opcode",
        STATOR_E_BAD_FLAGS => c"flags not valid for this opcode",
        STATOR_E_BAD_RANGE => {
            c"a key, namespace, user key or value lies outside the arena, or is set where the opcode takes none"
        }
        STATOR_E_BAD_STATE => c"state id not registered in this session, or of the wrong kind",
        STATOR_E_BAD_KEY_GROUP => c"key group outside this session's key-group range",
        STATOR_E_RESULT_TOO_LARGE => {
            c"result does not fit its buffer; the completion's len holds the size needed"
        }
        STATOR_E_NO_BUFFER => c"no provided buffer available",
        STATOR_E_BAD_BUFFER => c"a provided buffer lies outside the arena",
        STATOR_E_BAD_ARGUMENT => c"an argument (arg, arg2, a size) is invalid",
        STATOR_E_TOO_LARGE => c"key or value exceeds the session's limits",
        STATOR_E_BUSY => c"a per-session limit is reached; retry after completions",
        STATOR_E_IO => c"storage I/O error",
        STATOR_E_CORRUPT => c"stored data failed its checksum",
        STATOR_E_NO_SPACE => c"the daemon's disk is full",
        STATOR_E_UNSUPPORTED => c"the daemon does not support this request",
        STATOR_E_SHUTTING_DOWN => c"the daemon is shutting down",
        STATOR_E_REMOTE => c"remote storage failed",
        STATOR_E_INTERNAL => c"internal daemon error",
        STATOR_E_BAD_SNAPSHOT => {
            c"bad snapshot chunk: corrupt, truncated, out of order, of another snapshot, or with states that cannot be resolved"
        }
        STATOR_E_NULL => c"a required pointer argument is NULL",
        STATOR_E_INVALID_ARGUMENT => c"an argument is out of range",
        STATOR_E_CLOSED => c"the session is closed",
        STATOR_E_IN_USE => c"another thread is in a call on this session",
        STATOR_E_FULL => c"the submission queue or the arena is full; reap completions and retry",
        STATOR_E_REQUEST_TOO_LARGE => c"the request is larger than the session's arena",
        STATOR_E_CONNECT => c"cannot connect to statord",
        STATOR_E_REFUSED => c"statord refused the call (see stator_last_error)",
        STATOR_E_DAEMON_GONE => c"statord stopped or died; the session is unusable",
        STATOR_E_PROTOCOL => c"protocol error",
        STATOR_E_TIMED_OUT => c"timed out",
        STATOR_E_INVALID_STATE => c"the call is not valid in the session's current state",
        STATOR_E_CALLBACK => c"a callback returned an error",
        STATOR_E_PANIC => c"internal libstator error",
        STATOR_E_SYSTEM => c"a system call failed (see stator_last_error)",
        _ => c"unknown status code",
    };
    s.as_ptr()
}

/// The detailed message of the last call that failed on this thread (what
/// the daemon said, which argument was wrong); "" if none failed yet.
///
/// # Safety
/// None needed. The string is the thread's own and stays valid until the
/// next failing call on this thread; copy it to keep it.
#[unsafe(no_mangle)]
pub extern "C" fn stator_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|l| {
            let l = l.borrow();
            if l.is_empty() {
                c"".as_ptr()
            } else {
                l.as_ptr().cast()
            }
        })
        .unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;
    use stator_client::Status;

    #[test]
    fn request_statuses_match_the_wire() {
        let ours = [
            STATOR_OK,
            STATOR_NOT_FOUND,
            STATOR_E_BAD_OPCODE,
            STATOR_E_BAD_FLAGS,
            STATOR_E_BAD_RANGE,
            STATOR_E_BAD_STATE,
            STATOR_E_BAD_KEY_GROUP,
            STATOR_E_RESULT_TOO_LARGE,
            STATOR_E_NO_BUFFER,
            STATOR_E_BAD_BUFFER,
            STATOR_E_BAD_ARGUMENT,
            STATOR_E_TOO_LARGE,
            STATOR_E_BUSY,
            STATOR_E_IO,
            STATOR_E_CORRUPT,
            STATOR_E_NO_SPACE,
            STATOR_E_UNSUPPORTED,
            STATOR_E_SHUTTING_DOWN,
            STATOR_E_REMOTE,
            STATOR_E_INTERNAL,
            STATOR_E_BAD_SNAPSHOT,
        ];
        let wire: Vec<i32> = Status::ALL.iter().map(|s| *s as i32).collect();
        assert_eq!(ours.to_vec(), wire, "a status was added to the wire");
        for s in Status::ALL {
            // SAFETY: stator_strerror returns a static NUL-terminated string.
            let m = unsafe { CStr::from_ptr(stator_strerror(*s as i32)) };
            assert_ne!(m.to_bytes(), b"unknown status code", "{s:?}");
        }
    }

    #[test]
    fn panics_become_a_status() {
        let code = guard(|| panic!("boom"));
        assert_eq!(code, STATOR_E_PANIC);
        // SAFETY: the thread's last error is a valid C string.
        let m = unsafe { CStr::from_ptr(stator_last_error()) };
        assert!(m.to_str().unwrap().contains("boom"));
    }
}
