//! The segment header: what both sides check before touching a queue.
//!
//! The first 4 KiB of a session segment is the control page: the header
//! fields (bytes 0..256), written once by the creator before it sets the
//! ready flag, then the shared words, each on its own 128-byte line (two
//! cache lines, so the adjacent-line prefetcher does not couple them).

use stator_shm::ShmView;
use stator_shm::arena::ArenaRegion;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::bufring::BufEntry;
use crate::cqe::Cqe;
use crate::sqe::Sqe;

/// `"STATORQ1"` read as bytes.
pub const MAGIC: [u8; 8] = *b"STATORQ1";
/// Incompatible changes bump the major version; both sides must agree.
pub const VERSION_MAJOR: u16 = 1;
/// Compatible additions bump the minor version (see PROTOCOL.md).
pub const VERSION_MINOR: u16 = 0;

/// Feature bits (header `features`).
pub mod features {
    /// The provided-buffer ring is present.
    pub const BUF_RING: u64 = 1 << 0;
    /// A chunk region for snapshot export/import is present.
    pub const CHUNKS: u64 = 1 << 1;
    /// Every bit this version understands.
    pub const KNOWN: u64 = BUF_RING | CHUNKS;
}

/// Size of the control page.
pub const CONTROL_PAGE: usize = 4096;
/// Alignment of every region after the control page.
pub const REGION_ALIGN: usize = 4096;
/// Smallest queue capacity.
pub const MIN_ENTRIES: u32 = 64;
/// Largest queue capacity.
pub const MAX_ENTRIES: u32 = 1 << 20;

/// Values of the `STATE` word (written by the daemon only).
pub mod state {
    /// Served.
    pub const OPEN: u32 = 0;
    /// The daemon is stopping: requests already queued are answered.
    pub const CLOSING: u32 = 1;
    /// The client broke the queue protocol (a bad tail or head index, a
    /// malformed queue); nothing more is taken or answered, and the
    /// reason follows on the control connection before it is closed.
    pub const BROKEN: u32 = 2;
}

/// Offsets of the shared words inside the control page.
pub mod word {
    pub const READY: usize = 0x100;
    /// Session state, written by the daemon: see [`super::state`].
    pub const STATE: usize = 0x104;
    pub const SQ_HEAD: usize = 0x180;
    pub const SQ_TAIL: usize = 0x200;
    pub const CQ_HEAD: usize = 0x280;
    pub const CQ_TAIL: usize = 0x300;
    pub const BUF_HEAD: usize = 0x380;
    pub const BUF_TAIL: usize = 0x400;
    pub const SQ_CONSUMER_SLEEPING: usize = 0x480;
    pub const SQ_PRODUCER_SLEEPING: usize = 0x500;
    pub const CQ_CONSUMER_SLEEPING: usize = 0x580;
    pub const CQ_PRODUCER_SLEEPING: usize = 0x600;
    pub const BUF_CONSUMER_SLEEPING: usize = 0x680;
    pub const BUF_PRODUCER_SLEEPING: usize = 0x700;
}

/// The header fields, bytes 0..256 of the segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable)]
pub struct Header {
    pub magic: [u8; 8],
    pub version_major: u16,
    pub version_minor: u16,
    /// Size of the control page (4096).
    pub control_len: u32,
    pub features: u64,
    /// Total bytes the layout needs (the segment may be larger).
    pub segment_len: u64,
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub buf_entries: u32,
    pub sqe_size: u16,
    pub cqe_size: u16,
    pub sq_off: u64,
    pub cq_off: u64,
    pub buf_off: u64,
    pub arena_off: u64,
    pub arena_len: u64,
    pub chunk_off: u64,
    pub chunk_len: u64,
    /// Zero when written; ignored when read (a later minor version may
    /// define fields here that older peers can safely ignore).
    pub reserved: [u8; 152],
}

/// What the creator asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingParams {
    pub sq_entries: u32,
    pub cq_entries: u32,
    /// Provided-buffer ring entries; 0 for none.
    pub buf_entries: u32,
    pub arena_len: u64,
    /// Chunk region for snapshots; 0 for none.
    pub chunk_len: u64,
}

impl Default for RingParams {
    fn default() -> Self {
        RingParams {
            sq_entries: 4096,
            cq_entries: 4096,
            buf_entries: 4096,
            arena_len: 64 << 20,
            chunk_len: 0,
        }
    }
}

/// A layout that failed its checks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{what} = {value} must be a power of two in {MIN_ENTRIES}..={MAX_ENTRIES}")]
    Entries { what: &'static str, value: u32 },
    #[error("arena length {0} must be in 1..=4 GiB")]
    Arena(u64),
    #[error("the layout's total size overflows")]
    Overflow,
}

/// Errors attaching to a segment made by the other side.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    #[error("segment of {len} bytes is smaller than the {CONTROL_PAGE}-byte control page")]
    TooSmall { len: usize },
    #[error("bad magic {found:02x?}: not a Stator session segment")]
    BadMagic { found: [u8; 8] },
    #[error(
        "protocol version {found_major}.{found_minor} is not compatible with ours {VERSION_MAJOR}.{VERSION_MINOR}"
    )]
    Version { found_major: u16, found_minor: u16 },
    #[error("segment not ready: the creator has not finished initializing it")]
    NotReady,
    #[error("unsupported feature bits {0:#x}")]
    Features(u64),
    #[error("header describes an invalid layout: {0}")]
    Layout(#[from] LayoutError),
    #[error("header field {field} = {found} does not match the layout ({expected})")]
    Mismatch {
        field: &'static str,
        found: u64,
        expected: u64,
    },
    #[error("layout needs {needed} bytes, segment has {len}")]
    Short { needed: u64, len: usize },
}

/// Where everything lies in a segment, computed from [`RingParams`] the same
/// way on both sides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    pub params: RingParams,
    pub features: u64,
    pub sq_off: usize,
    pub cq_off: usize,
    pub buf_off: usize,
    pub arena: ArenaRegion,
    pub chunk_off: usize,
    pub chunk_len: usize,
    pub total_len: usize,
}

fn check_entries(what: &'static str, value: u32) -> Result<(), LayoutError> {
    if value.is_power_of_two() && (MIN_ENTRIES..=MAX_ENTRIES).contains(&value) {
        Ok(())
    } else {
        Err(LayoutError::Entries { what, value })
    }
}

impl RingLayout {
    /// Computes and checks a layout.
    pub fn new(params: RingParams) -> Result<Self, LayoutError> {
        check_entries("sq_entries", params.sq_entries)?;
        check_entries("cq_entries", params.cq_entries)?;
        if params.buf_entries != 0 {
            check_entries("buf_entries", params.buf_entries)?;
        }
        if params.arena_len == 0 || params.arena_len > 1 << 32 {
            return Err(LayoutError::Arena(params.arena_len));
        }
        let align = |x: u64| {
            x.checked_next_multiple_of(REGION_ALIGN as u64)
                .ok_or(LayoutError::Overflow)
        };
        let sq_off = CONTROL_PAGE as u64;
        let cq_off = align(sq_off + params.sq_entries as u64 * size_of::<Sqe>() as u64)?;
        let buf_off = align(cq_off + params.cq_entries as u64 * size_of::<Cqe>() as u64)?;
        let arena_off = align(buf_off + params.buf_entries as u64 * size_of::<BufEntry>() as u64)?;
        let chunk_off = align(arena_off + params.arena_len)?;
        let total = align(
            chunk_off
                .checked_add(params.chunk_len)
                .ok_or(LayoutError::Overflow)?,
        )?;
        let total_len = usize::try_from(total).map_err(|_| LayoutError::Overflow)?;
        let mut features = 0;
        if params.buf_entries != 0 {
            features |= features::BUF_RING;
        }
        if params.chunk_len != 0 {
            features |= features::CHUNKS;
        }
        Ok(RingLayout {
            params,
            features,
            sq_off: sq_off as usize,
            cq_off: cq_off as usize,
            buf_off: buf_off as usize,
            arena: ArenaRegion {
                base: arena_off as usize,
                len: params.arena_len as usize,
            },
            chunk_off: chunk_off as usize,
            chunk_len: params.chunk_len as usize,
            total_len,
        })
    }

    /// The header describing this layout.
    pub fn header(&self) -> Header {
        Header {
            magic: MAGIC,
            version_major: VERSION_MAJOR,
            version_minor: VERSION_MINOR,
            control_len: CONTROL_PAGE as u32,
            features: self.features,
            segment_len: self.total_len as u64,
            sq_entries: self.params.sq_entries,
            cq_entries: self.params.cq_entries,
            buf_entries: self.params.buf_entries,
            sqe_size: size_of::<Sqe>() as u16,
            cqe_size: size_of::<Cqe>() as u16,
            sq_off: self.sq_off as u64,
            cq_off: self.cq_off as u64,
            buf_off: self.buf_off as u64,
            arena_off: self.arena.base as u64,
            arena_len: self.arena.len as u64,
            chunk_off: self.chunk_off as u64,
            chunk_len: self.chunk_len as u64,
            reserved: [0; 152],
        }
    }

    /// Writes the header into a fresh (zeroed) segment and sets the ready
    /// flag last. The creator calls this once, before passing the segment on.
    pub fn init(&self, view: &ShmView<'_>) -> Result<(), AttachError> {
        if view.len() < self.total_len {
            return Err(AttachError::Short {
                needed: self.total_len as u64,
                len: view.len(),
            });
        }
        view.write(0, &self.header())
            .map_err(|_| AttachError::TooSmall { len: view.len() })?;
        let ready = crate::session::shared_word(view, word::READY);
        // SYNC POINT. Release: the header bytes written above are visible to
        // an attacher that Acquire-loads ready == 1.
        ready.store(1, crate::sync::Ordering::Release);
        Ok(())
    }

    /// Reads and validates the header of a segment made by the peer. The
    /// returned layout is recomputed from the sizes, so nothing else the
    /// peer wrote is trusted, and the header is never read again.
    pub fn attach(view: &ShmView<'_>) -> Result<Self, AttachError> {
        if view.len() < CONTROL_PAGE {
            return Err(AttachError::TooSmall { len: view.len() });
        }
        let ready = crate::session::shared_word(view, word::READY);
        // SYNC POINT. Acquire: pairs with the Release in `init`.
        if ready.load(crate::sync::Ordering::Acquire) != 1 {
            // Not ready yet, or not ours at all: a magic that is neither ours
            // nor still zero says the latter.
            let found: [u8; 8] = view
                .read(0)
                .map_err(|_| AttachError::TooSmall { len: view.len() })?;
            if found != MAGIC && found != [0; 8] {
                return Err(AttachError::BadMagic { found });
            }
            return Err(AttachError::NotReady);
        }
        let h: Header = view
            .read(0)
            .map_err(|_| AttachError::TooSmall { len: view.len() })?;
        if h.magic != MAGIC {
            return Err(AttachError::BadMagic { found: h.magic });
        }
        if h.version_major != VERSION_MAJOR {
            return Err(AttachError::Version {
                found_major: h.version_major,
                found_minor: h.version_minor,
            });
        }
        if h.features & !features::KNOWN != 0 {
            return Err(AttachError::Features(h.features & !features::KNOWN));
        }
        let layout = RingLayout::new(RingParams {
            sq_entries: h.sq_entries,
            cq_entries: h.cq_entries,
            buf_entries: h.buf_entries,
            arena_len: h.arena_len,
            chunk_len: h.chunk_len,
        })?;
        let expect = layout.header();
        let checks: [(&'static str, u64, u64); 10] = [
            (
                "control_len",
                h.control_len as u64,
                expect.control_len as u64,
            ),
            ("features", h.features, expect.features),
            ("segment_len", h.segment_len, expect.segment_len),
            ("sqe_size", h.sqe_size as u64, expect.sqe_size as u64),
            ("cqe_size", h.cqe_size as u64, expect.cqe_size as u64),
            ("sq_off", h.sq_off, expect.sq_off),
            ("cq_off", h.cq_off, expect.cq_off),
            ("buf_off", h.buf_off, expect.buf_off),
            ("arena_off", h.arena_off, expect.arena_off),
            ("chunk_off", h.chunk_off, expect.chunk_off),
        ];
        for (field, found, expected) in checks {
            if found != expected {
                return Err(AttachError::Mismatch {
                    field,
                    found,
                    expected,
                });
            }
        }
        if view.len() < layout.total_len {
            return Err(AttachError::Short {
                needed: layout.total_len as u64,
                len: view.len(),
            });
        }
        Ok(layout)
    }
}
