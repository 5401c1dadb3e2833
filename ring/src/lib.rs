//! `stator-ring`: the wire protocol between a task and `statord`, both sides.
//!
//! A session segment (see `stator-shm`) holds a control page (header and
//! shared indices), a submission queue of 64-byte [`Sqe`] descriptors
//! (client -> daemon), a completion queue of 32-byte [`Cqe`]s
//! (daemon -> client), a ring of provided result buffers ([`BufEntry`]),
//! the arena of keys, values and results, and an optional chunk region for
//! snapshots. Every byte is described in `ring/PROTOCOL.md`.
//!
//! - [`header`]: magic, version, sizes and feature bits, checked on attach;
//! - [`queue`]: the SPSC protocol with private indices, validated peer
//!   indices and the `NEED_WAKEUP`-style sleep flags;
//! - [`sqe`], [`cqe`], [`bufring`]: the entry types and their validation;
//! - [`doorbell`]: eventfd doorbells and the bounded spin-then-sleep wait;
//! - [`session`]: the client's and the daemon's ends of a segment.
//!
//! What it must never do: trust a byte the peer can write (every index is
//! validated and every entry is copied out before it is checked), panic on
//! peer input, or know about storage or sockets. Atomics come from
//! [`sync`], which is loom's under `--cfg loom`.

// Every field is native-endian in shared memory and documented as
// little-endian; the two agree only on little-endian hosts.
#[cfg(not(target_endian = "little"))]
compile_error!("stator-ring's wire format is little-endian");

pub mod bufring;
pub mod control;
pub mod cqe;
#[cfg(not(loom))]
pub mod doorbell;
#[cfg(not(loom))]
pub mod header;
pub mod keygroup;
pub mod queue;
#[cfg(not(loom))]
pub mod session;
pub mod sqe;
pub mod sync;

pub use bufring::{BufEntry, ProvidedBuf};
pub use cqe::{Cqe, Status, cqe_flags};
#[cfg(not(loom))]
pub use doorbell::{Doorbell, WaitPolicy, Waited};
#[cfg(not(loom))]
pub use header::{AttachError, RingLayout, RingParams};
pub use queue::QueueError;
#[cfg(not(loom))]
pub use session::{ClientRing, DaemonRing, RingError};
pub use sqe::{BufRef, Opcode, Sqe, SqeError, ValidSqe, sqe_flags};
