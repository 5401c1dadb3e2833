//! Failures as the Java side sees them: a negative code from the call,
//! and the details (code, a control or request status, a message) kept
//! for this thread until the next failure, fetched with `error()`.

use std::cell::RefCell;

use stator_client::Error;

/// The arguments (a handle, a buffer, an argument block) are not valid.
pub const ERR_ARGUMENT: i32 = -1;
/// statord refused a control request; `detail` is its control status.
pub const ERR_REFUSED: i32 = -2;
/// statord is gone (it stopped or died) or the connection broke.
pub const ERR_GONE: i32 = -3;
/// The submission queue or the arena is full.
pub const ERR_FULL: i32 = -4;
/// A request larger than the arena can ever hold.
pub const ERR_TOO_LARGE: i32 = -5;
/// The daemon broke the protocol, or a call came out of order.
pub const ERR_PROTOCOL: i32 = -6;
/// A request completed with an error; `detail` is its status.
pub const ERR_STATUS: i32 = -7;
/// statord's socket could not be reached.
pub const ERR_CONNECT: i32 = -8;
/// A bug in this library (a panic); the session must be freed.
pub const ERR_PANIC: i32 = -9;

/// One failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fail {
    pub code: i32,
    pub detail: i32,
    pub message: String,
}

impl Fail {
    pub fn new(code: i32, message: impl Into<String>) -> Fail {
        Fail {
            code,
            detail: 0,
            message: message.into(),
        }
    }

    pub fn arg(message: impl Into<String>) -> Fail {
        Fail::new(ERR_ARGUMENT, message)
    }

    pub fn status(status: i32, message: impl Into<String>) -> Fail {
        Fail {
            code: ERR_STATUS,
            detail: status,
            message: message.into(),
        }
    }

    /// Keeps the details for `error()` and returns the code.
    pub fn report(self) -> i32 {
        let code = self.code;
        LAST.with(|l| *l.borrow_mut() = Some(self));
        code
    }

    /// The error record (`wire` module doc) of this thread's last failure.
    pub fn last_record() -> Vec<u8> {
        LAST.with(|l| {
            let l = l.borrow();
            let (code, detail, msg) = match &*l {
                Some(f) => (f.code, f.detail, f.message.as_str()),
                None => (0, 0, ""),
            };
            let mut b = Vec::with_capacity(12 + msg.len());
            b.extend_from_slice(&code.to_le_bytes());
            b.extend_from_slice(&detail.to_le_bytes());
            b.extend_from_slice(&(msg.len() as u32).to_le_bytes());
            b.extend_from_slice(msg.as_bytes());
            b
        })
    }
}

thread_local! {
    static LAST: RefCell<Option<Fail>> = const { RefCell::new(None) };
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        let message = e.to_string();
        match e {
            Error::Connect { .. } => Fail::new(ERR_CONNECT, message),
            Error::Refused { status, .. } => Fail {
                code: ERR_REFUSED,
                detail: status,
                message,
            },
            Error::DaemonGone(_) => Fail::new(ERR_GONE, message),
            Error::Status(s) => Fail::status(s as i32, message),
            Error::ResultTooLarge { .. } => {
                Fail::status(stator_client::Status::ResultTooLarge as i32, message)
            }
            Error::Full => Fail::new(ERR_FULL, message),
            Error::TooLarge => Fail::new(ERR_TOO_LARGE, message),
            Error::Protocol(_) => Fail::new(ERR_PROTOCOL, message),
            Error::InvalidArgument(_) => Fail::arg(message),
        }
    }
}

impl From<String> for Fail {
    fn from(message: String) -> Fail {
        Fail::arg(message)
    }
}
