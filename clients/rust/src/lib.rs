//! `stator-client`: what a task links to keep its keyed state in `statord`.
//!
//! - [`Session`]: connect, open a session for one subtask, register states,
//!   and the batch API: [`Session::submit`] many requests, [`Session::flush`]
//!   them with one tail store, [`Session::poll`] completions, and
//!   [`Session::wait`] when nothing is ready. Thousands of requests can be in
//!   flight; per key, they take effect in submission order.
//! - [`AsyncSession`]: the same session behind futures that work on any
//!   executor (a small reaper thread completes them; no runtime needed).
//! - [`ValueState`], [`ListState`], [`MapState`]: typed handles that build
//!   requests for a registered state.
//! - [`keygroup`]: Flink's key-group functions, bit for bit.
//!
//! A daemon that stops or dies makes every pending and later call fail
//! with [`Error::DaemonGone`]; nothing waits forever.

mod asyncs;
mod session;

pub use asyncs::AsyncSession;
pub use session::{
    Completion, IterMode, Kind, Notify, OpenOptions, RawRequest, Request, Reservation, Restored,
    Session, ValueWriter, release_checkpoints,
};
pub use stator_ring::keygroup;
pub use stator_ring::{BufRef, Opcode, Status};

/// Everything a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot connect to statord at {path}: {err}")]
    Connect { path: String, err: std::io::Error },
    #[error("statord refused: {message} (control status {status})")]
    Refused { status: i32, message: String },
    #[error("statord is gone: {0}")]
    DaemonGone(String),
    #[error("request failed: {0}")]
    Status(Status),
    #[error("the result needs a buffer of {needed} bytes; retry with that capacity")]
    ResultTooLarge { needed: u32 },
    #[error("the submission queue or the arena is full; reap completions and retry")]
    Full,
    #[error("request larger than the arena can hold")]
    TooLarge,
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An argument past a documented limit (a name longer than 1,024
    /// bytes), refused before anything is sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    pub(crate) fn gone(e: impl std::fmt::Display) -> Error {
        Error::DaemonGone(format!("the control connection failed: {e}"))
    }
}

/// A registered value state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValueState(pub u32);
/// A registered list state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListState(pub u32);
/// A registered map state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapState(pub u32);

impl ValueState {
    pub fn get<'a>(&self, kg: u16, key: &'a [u8]) -> Request<'a> {
        Request::new(Opcode::Get, self.0, kg, key)
    }
    pub fn put<'a>(&self, kg: u16, key: &'a [u8], value: &'a [u8]) -> Request<'a> {
        Request {
            value,
            ..Request::new(Opcode::Put, self.0, kg, key)
        }
    }
    pub fn delete<'a>(&self, kg: u16, key: &'a [u8]) -> Request<'a> {
        Request::new(Opcode::Delete, self.0, kg, key)
    }
}

impl ListState {
    pub fn append<'a>(&self, kg: u16, key: &'a [u8], element: &'a [u8]) -> Request<'a> {
        Request {
            value: element,
            ..Request::new(Opcode::ListAppend, self.0, kg, key)
        }
    }
    /// All elements, encoded `u32 len (LE) | bytes` each; see [`elements`].
    pub fn get<'a>(&self, kg: u16, key: &'a [u8]) -> Request<'a> {
        Request::new(Opcode::ListGet, self.0, kg, key)
    }
    /// Replaces the list with `encoded` (as [`encode_elements`] makes).
    pub fn replace<'a>(&self, kg: u16, key: &'a [u8], encoded: &'a [u8]) -> Request<'a> {
        Request {
            value: encoded,
            ..Request::new(Opcode::ListReplace, self.0, kg, key)
        }
    }
    pub fn clear<'a>(&self, kg: u16, key: &'a [u8]) -> Request<'a> {
        Request::new(Opcode::Clear, self.0, kg, key)
    }
}

impl MapState {
    pub fn get<'a>(&self, kg: u16, key: &'a [u8], user_key: &'a [u8]) -> Request<'a> {
        Request {
            user_key,
            ..Request::new(Opcode::MapGet, self.0, kg, key)
        }
    }
    pub fn put<'a>(
        &self,
        kg: u16,
        key: &'a [u8],
        user_key: &'a [u8],
        value: &'a [u8],
    ) -> Request<'a> {
        Request {
            user_key,
            value,
            ..Request::new(Opcode::MapPut, self.0, kg, key)
        }
    }
    pub fn remove<'a>(&self, kg: u16, key: &'a [u8], user_key: &'a [u8]) -> Request<'a> {
        Request {
            user_key,
            ..Request::new(Opcode::MapRemove, self.0, kg, key)
        }
    }
    /// Completes with `aux` 1 if present, else 0.
    pub fn contains<'a>(&self, kg: u16, key: &'a [u8], user_key: &'a [u8]) -> Request<'a> {
        Request {
            user_key,
            ..Request::new(Opcode::MapContains, self.0, kg, key)
        }
    }
    /// One page of entries; see [`Page`].
    pub fn iter<'a>(
        &self,
        kg: u16,
        key: &'a [u8],
        mode: IterMode,
        after: Option<&'a [u8]>,
    ) -> Request<'a> {
        Request::map_iter(self.0, kg, key, mode, after)
    }
    pub fn clear<'a>(&self, kg: u16, key: &'a [u8]) -> Request<'a> {
        Request::new(Opcode::Clear, self.0, kg, key)
    }
}

/// Encodes list elements as the daemon stores them.
pub fn encode_elements<'a>(elements: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for e in elements {
        out.extend_from_slice(&(e.len() as u32).to_le_bytes());
        out.extend_from_slice(e);
    }
    out
}

/// Splits an encoded element list (a list get, or a map page's
/// `u32 len | bytes` fields). `None` if it is malformed.
pub fn elements(mut b: &[u8]) -> Option<Vec<&[u8]>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let n = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
        out.push(b.get(4..4 + n)?);
        b = &b[4 + n..];
    }
    Some(out)
}

/// A map iteration page as the daemon writes it: the entries
/// (`u32 len | field` per key, value or both, by mode), then the last user
/// key examined and its `u32` length: resume after it.
#[derive(Debug, PartialEq, Eq)]
pub struct Page<'a> {
    pub data: &'a [u8],
    pub resume_after: &'a [u8],
}

impl<'a> Page<'a> {
    /// Splits a page result. `None` if it is malformed.
    pub fn parse(b: &'a [u8]) -> Option<Page<'a>> {
        let n = b.len().checked_sub(4)?;
        let k = u32::from_le_bytes(b[n..].try_into().ok()?) as usize;
        let split = n.checked_sub(k)?;
        Some(Page {
            data: &b[..split],
            resume_after: &b[split..n],
        })
    }
}
