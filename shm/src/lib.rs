//! `stator-shm`: the shared-memory layer under Stator's session protocol.
//!
//! A session's memory is one memfd, created by one process (the daemon),
//! sealed against shrinking and growing, mapped, and passed to the other
//! process (the task) over a Unix socket with `SCM_RIGHTS`. This crate owns:
//!
//! - [`Segment`]: create, seal, map and attach memfd segments;
//! - [`ShmView`]: a bounds-checked view of memory that a peer may change at
//!   any time. Reads copy out and writes copy in with volatile accesses; every
//!   offset and length is checked against the view with overflow-safe
//!   arithmetic, so no input can reach outside the mapping;
//! - [`fdpass`]: sending and receiving file descriptors with `SCM_RIGHTS`;
//! - [`arena`]: offset-addressed buffers for keys, values and results, with a
//!   documented owner for every region.
//!
//! What it must never do: create a Rust reference (`&T`, `&[u8]`) into
//! peer-writable memory, trust a length or offset read from it, or know
//! anything about requests and storage (that is `stator-ring`'s and
//! `stator-store`'s business).
//!
//! All `unsafe` code of the crate lives in `segment.rs` (mapping) and
//! `view.rs` (volatile access); each block says why it is sound.

pub mod arena;
pub mod fdpass;
mod segment;
mod view;

pub use segment::{SEALS_REQUIRED, Segment, SegmentError};
pub use view::{OutOfBounds, ShmView};
