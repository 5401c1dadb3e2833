//! `stator-store`: Stator's storage engine. Keyed state (value, list, map)
//! in memory and on local disk through io_uring, shaped for one shard
//! thread: one instance per shard, no locks, no blocking call on the
//! request path, thousands of operations pending at once.
//!
//! - [`Store`]: submit operations with a token; memory answers at once,
//!   the rest completes through [`Store::poll`]; per-key order holds.
//! - [`memtable`]: the write buffer (hash-indexed log, batched prefetch).
//! - [`hugemem`]: zeroed arrays in huge-page mappings (the memtable's).
//! - [`format`], [`segment`]: immutable sorted files, byte by byte in
//!   `store/FORMAT.md` (CRC32C per block, block index, bloom filter,
//!   checksummed footer).
//! - [`cache`]: the block cache under a byte budget.
//! - [`dropped`]: state ids compaction leaves out (a finished job's).
//! - [`manifest`]: checkpoint manifests and handles; [`Store::checkpoint`],
//!   [`Store::restore`] and [`Store::checkpoint_notify`] make checkpoints
//!   metadata and restores references (FORMAT.md §10–§12).
//! - [`snapshot`]: portable snapshot chunks (key-group frames of records
//!   as stored, 4 MiB chunks with CRC32C), encoder and checking decoder.
//! - [`io`]: the I/O layer (io_uring, pread/pwrite, fault injection).
//! - [`remote`]: the remote tier's client (S3-compatible object storage or
//!   a local directory on a tokio runtime; coalesced ranged GETs, bounded
//!   in flight, timeouts and retries, completions through an eventfd).
//!
//! What it must never do: return bytes that failed their checksum, lose a
//! segment that was completely written, block the caller's thread on disk
//! I/O in `submit`, or know about queues, sessions or processes.
//! `unsafe` lives only in `aligned.rs` (aligned buffers), `hugemem.rs`
//! (anonymous mappings), `io/uring.rs` (handing buffers to the kernel) and
//! the prefetch hint in `memtable.rs`.

pub mod aligned;
pub mod bloom;
pub mod cache;
pub mod clock;
pub mod dropped;
pub mod error;
pub mod format;
mod helper;
pub mod hugemem;
pub mod io;
pub mod keys;
pub mod manifest;
pub mod memtable;
pub mod ops;
mod pace;
mod pool;
mod prefetch;
pub mod remote;
mod reuse;
pub mod segment;
pub mod snapshot;
mod sorted;
mod store;

pub use dropped::DroppedStates;
pub use error::StoreError;
pub use ops::{IterMode, KeyRef, Op, Output, StateKind, Submitted};
pub use store::{
    CheckpointInfo, CheckpointSpec, DEFAULT_CHECKPOINT_LAYER_LIMIT, DEFAULT_RETAINED_CHECKPOINTS,
    ExportSpec, Fill, ImportHold, ImportSpec, ImportStep, Imported, MAX_EXPORTS, MAX_IMPORTS,
    MAX_LIST_LEN, MAX_UNCOMPLETED, MAX_VALUE_LEN, MIN_CHECKPOINT_LAYER_LIMIT, MemoryUsage, Notify,
    RecoveryReport, Released, RestoreSpec, Restored, RestoredManifest, StallCause, Store,
    StoreConfig, StoreStats, TierConfig, TierStats,
};
