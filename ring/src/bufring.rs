//! Provided result buffers: the client hands buffers of its arena to the
//! daemon in advance (as io_uring's provided-buffer rings do), the daemon
//! takes one when a request with `BUFFER_SELECT` produces a result, writes
//! the result into it, and names it in the completion.

use stator_shm::arena::ArenaRegion;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// One provided buffer, as it sits in the buffer ring.
/// Layout: `off@0 len@4 buf_id@8 reserved@12`.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct BufEntry {
    /// Arena-relative offset.
    pub off: u32,
    /// Capacity in bytes.
    pub len: u32,
    /// The client's name for the buffer, echoed in the completion.
    pub buf_id: u32,
    /// Must be zero.
    pub reserved: u32,
}

/// A provided buffer the daemon took and validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProvidedBuf {
    pub buf_id: u32,
    /// Offset from the start of the segment.
    pub seg_off: usize,
    pub len: usize,
}

/// A provided buffer that does not lie inside the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("provided buffer {buf_id} at {off}+{len} lies outside the arena (or reserved={reserved})")]
pub struct BadBuffer {
    pub buf_id: u32,
    pub off: u32,
    pub len: u32,
    pub reserved: u32,
}

impl BufEntry {
    /// Checks the entry against the arena.
    pub fn validate(&self, arena: &ArenaRegion) -> Result<ProvidedBuf, BadBuffer> {
        let bad = BadBuffer {
            buf_id: self.buf_id,
            off: self.off,
            len: self.len,
            reserved: self.reserved,
        };
        if self.reserved != 0 {
            return Err(bad);
        }
        let seg_off = arena.resolve(self.off, self.len).map_err(|_| bad)?;
        Ok(ProvidedBuf {
            buf_id: self.buf_id,
            seg_off,
            len: self.len as usize,
        })
    }
}
