//! The store's errors. Cloneable: one failed block read fails every
//! operation that waited on it.

use std::path::Path;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    #[error("I/O error during {op} on {path}: {msg} (errno {errno})")]
    Io {
        path: String,
        op: &'static str,
        errno: i32,
        msg: String,
    },
    #[error("the disk is full: {op} on {path} failed with ENOSPC")]
    NoSpace { path: String, op: &'static str },
    #[error("corrupt data in {path} at offset {offset}: {what}")]
    Corrupt {
        path: String,
        offset: u64,
        what: &'static str,
    },
    #[error("{what} is {len} bytes, more than the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error(
        "memory budget exhausted ({used} of {budget} bytes) while flushes are failing: {cause}"
    )]
    OverBudget {
        used: usize,
        budget: usize,
        /// Why the last flush or compaction failed.
        cause: Box<StoreError>,
    },
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("limit reached: {0}")]
    Limit(String),
    #[error("restore refused: {0}")]
    Restore(String),
    #[error("snapshot refused: {0}")]
    Snapshot(String),
    /// The remote tier failed a read or an upload after its retries.
    #[error("remote tier: {0}")]
    Remote(String),
    #[error("the store directory {path} cannot be used: {msg}")]
    Dir { path: String, msg: String },
}

impl StoreError {
    pub(crate) fn from_errno(path: &Path, op: &'static str, errno: i32) -> StoreError {
        if errno == libc::ENOSPC || errno == libc::EDQUOT {
            return StoreError::NoSpace {
                path: path.display().to_string(),
                op,
            };
        }
        StoreError::Io {
            path: path.display().to_string(),
            op,
            errno,
            msg: std::io::Error::from_raw_os_error(errno).to_string(),
        }
    }

    pub(crate) fn io(path: &Path, op: &'static str, e: &std::io::Error) -> StoreError {
        Self::from_errno(path, op, crate::io::errno_of(e))
    }
}
