//! Completion queue entries: 32 bytes, daemon -> client.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// One completion, exactly as it sits in the completion queue.
///
/// Layout (little-endian, no padding):
/// `user_data@0 status@8 flags@12 buf_id@16 len@20 aux@24`.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct Cqe {
    /// The request's `user_data`, untouched.
    pub user_data: u64,
    /// A [`Status`] as `i32`: 0 and positive are outcomes, negative are errors.
    pub status: i32,
    /// [`cqe_flags`] bits.
    pub flags: u32,
    /// The provided buffer the result was written to (with
    /// [`cqe_flags::BUFFER`]); the client owns it again from now on.
    pub buf_id: u32,
    /// Result length in bytes; with [`Status::ResultTooLarge`], the size the
    /// result needs.
    pub len: u32,
    /// Opcode-specific: `MapContains` 1/0, element or entry count, no-op echo.
    pub aux: u64,
}

/// Completion flag bits.
pub mod cqe_flags {
    /// `buf_id` names a provided buffer this completion returns to the client.
    pub const BUFFER: u32 = 1 << 0;
    /// Map iterate: more entries follow; resume after the last user key.
    pub const MORE: u32 = 1 << 1;
    /// Snapshot chunks: the snapshot's last chunk (export), or the import
    /// is installed (the last chunk's completion).
    pub const LAST: u32 = 1 << 2;
}

macro_rules! statuses {
    ($($(#[$m:meta])* $name:ident = $v:literal, $msg:literal;)*) => {
        /// Completion status codes. Numbers are part of the wire format.
        #[repr(i32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Status { $($(#[$m])* $name = $v,)* }

        impl Status {
            /// All statuses.
            pub const ALL: &'static [Status] = &[$(Status::$name,)*];

            /// The status with wire value `v`, if defined.
            pub fn from_i32(v: i32) -> Option<Status> {
                match v { $($v => Some(Status::$name),)* _ => None }
            }

            /// A one-line description.
            pub fn message(self) -> &'static str {
                match self { $(Status::$name => $msg,)* }
            }
        }
    };
}

statuses! {
    Ok = 0, "success";
    /// The key (or user key) has no value. Not an error.
    NotFound = 1, "not found";
    BadOpcode = -1, "unknown opcode";
    BadFlags = -2, "flags not valid for this opcode";
    BadRange = -3, "a key, namespace, user key or value range lies outside the arena, or is set where the opcode takes none";
    BadState = -4, "state id not registered in this session, or of the wrong kind";
    BadKeyGroup = -5, "key group outside this session's key-group range";
    ResultTooLarge = -6, "result does not fit the buffer; len holds the size needed";
    NoBuffer = -7, "BUFFER_SELECT with no provided buffer available";
    BadBuffer = -8, "a provided buffer lies outside the arena";
    BadArgument = -9, "an argument (arg, arg2, reserved, size) is invalid";
    TooLarge = -10, "key or value exceeds the session's limits";
    Busy = -11, "a per-session limit is reached; retry after completions";
    Io = -12, "storage I/O error";
    Corrupt = -13, "stored data failed its checksum";
    NoSpace = -14, "the disk is full";
    Unsupported = -15, "the daemon does not support this request";
    ShuttingDown = -16, "the daemon is shutting down";
    Remote = -17, "remote storage failed";
    Internal = -18, "internal daemon error";
    BadSnapshot = -19, "a snapshot chunk failed its checks (checksum, framing, snapshot id, order, states); the import was abandoned and nothing of it installed";
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?} ({}): {}", self, *self as i32, self.message())
    }
}

impl From<crate::SqeError> for Status {
    fn from(e: crate::SqeError) -> Status {
        use crate::SqeError::*;
        match e {
            BadOpcode(_) => Status::BadOpcode,
            BadFlags { .. } => Status::BadFlags,
            Reserved(_) => Status::BadArgument,
            OutOfArena { .. } | UnexpectedField { .. } | NoOutput { .. } => Status::BadRange,
        }
    }
}

impl Cqe {
    /// A completion with `status` and nothing else.
    pub fn status(user_data: u64, status: Status) -> Cqe {
        Cqe {
            user_data,
            status: status as i32,
            ..Cqe::default()
        }
    }

    /// The status, or `None` when the daemon sent a code this client does
    /// not know (a newer daemon).
    pub fn status_code(&self) -> Option<Status> {
        Status::from_i32(self.status)
    }
}
