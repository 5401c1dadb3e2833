//! Submission queue entries (descriptors): 64 bytes, client -> daemon.

use stator_shm::arena::ArenaRegion;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// A byte range in the session's arena, arena-relative. `len == 0` means
/// "absent" for optional fields; its `off` must then be zero too.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct BufRef {
    pub off: u32,
    pub len: u32,
}

impl BufRef {
    pub const NONE: BufRef = BufRef { off: 0, len: 0 };

    pub fn new(off: u32, len: u32) -> Self {
        BufRef { off, len }
    }

    pub fn is_none(&self) -> bool {
        *self == Self::NONE
    }
}

/// One request, exactly as it sits in the submission queue.
///
/// Layout (little-endian, 8-byte aligned, no padding):
/// `user_data@0 opcode@8 flags@9 key_group@10 state_id@12 key@16
/// namespace@24 user_key@32 value@40 arg@48 arg2@56 reserved@60`.
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
pub struct Sqe {
    /// Echoed untouched in the completion.
    pub user_data: u64,
    /// An [`Opcode`].
    pub opcode: u8,
    /// [`sqe_flags`] bits.
    pub flags: u8,
    /// Key group of the key, `0..max_parallelism`.
    pub key_group: u16,
    /// State id from `register state`.
    pub state_id: u32,
    /// Serialized key.
    pub key: BufRef,
    /// Serialized namespace (may be empty).
    pub namespace: BufRef,
    /// Map user key (map ops), or the resume cursor of a map iteration.
    pub user_key: BufRef,
    /// Value to write, or the result buffer for reads without
    /// [`sqe_flags::BUFFER_SELECT`].
    pub value: BufRef,
    /// Opcode argument: checkpoint id, iteration mode, echo value of a no-op.
    pub arg: u64,
    /// Second opcode argument: notification kind, chunk index.
    pub arg2: u32,
    /// Must be zero.
    pub reserved: u32,
}

/// Descriptor flag bits.
pub mod sqe_flags {
    /// Write the result into a buffer taken from the provided-buffer ring
    /// instead of the `value` range.
    pub const BUFFER_SELECT: u8 = 1 << 0;
    /// Map iterate: resume after the user key in `user_key`.
    pub const ITER_RESUME: u8 = 1 << 1;
    /// Snapshot export: export what the checkpoints whose handles `value`
    /// holds (back to back) hold of the session's key groups, instead of
    /// its live state. The live state is not touched.
    pub const FROM_CHECKPOINTS: u8 = 1 << 2;
    /// List append: `value` is an encoded element list (`u32 len | bytes`
    /// each, as `ListReplace` takes), appended whole and in order: one
    /// request for what would take one per element.
    pub const ELEMENTS: u8 = 1 << 3;
    /// Every defined bit.
    pub const ALL: u8 = BUFFER_SELECT | ITER_RESUME | FROM_CHECKPOINTS | ELEMENTS;
}

/// Map iteration modes (`arg` of [`Opcode::MapIter`]).
pub mod iter_mode {
    pub const KEYS: u64 = 1;
    pub const VALUES: u64 = 2;
    pub const ENTRIES: u64 = 3;
}

/// Checkpoint notification kinds (`arg2` of [`Opcode::CheckpointNotify`]).
pub mod notify_kind {
    pub const COMPLETE: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const SUBSUME: u32 = 3;
}

/// `arg2` of `ChunkRelease` (or `SnapshotImport`) that cancels the export
/// (or the import) instead of naming a slot.
pub const CANCEL_SNAPSHOT: u32 = u32::MAX;

/// Bytes of one chunk slot of the chunk region (a whole snapshot chunk,
/// `store/FORMAT.md` §13). The region holds `chunk_len / CHUNK_SLOT_LEN`
/// slots.
pub const CHUNK_SLOT_LEN: usize = 4 << 20;

macro_rules! opcodes {
    ($($(#[$m:meta])* $name:ident = $v:literal, $fields:expr;)*) => {
        /// Every request the protocol defines. Numbers are part of the wire
        /// format and never reused.
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Opcode { $($(#[$m])* $name = $v,)* }

        impl Opcode {
            /// All opcodes, in numeric order.
            pub const ALL: &'static [Opcode] = &[$(Opcode::$name,)*];

            /// The opcode with wire value `v`, if defined.
            pub fn from_u8(v: u8) -> Option<Opcode> {
                match v { $($v => Some(Opcode::$name),)* _ => None }
            }

            /// Which descriptor fields this opcode uses.
            pub const fn fields(self) -> Fields {
                match self { $(Opcode::$name => $fields,)* }
            }
        }
    };
}

impl Opcode {
    /// Whether `value` is an input of this opcode with `flags`: a
    /// value-in opcode, or a checkpoint export's handles
    /// (`FROM_CHECKPOINTS`).
    pub fn value_in(self, flags: u8) -> bool {
        self.fields().value_in
            || (self == Opcode::SnapshotExport && flags & sqe_flags::FROM_CHECKPOINTS != 0)
    }
}

/// Which descriptor fields an opcode uses; an unused range must be
/// [`BufRef::NONE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fields {
    /// Uses state id, key group, key and namespace.
    pub keyed: bool,
    /// Uses `user_key`.
    pub user_key: bool,
    /// `value` is an input.
    pub value_in: bool,
    /// Produces a result (into `value` or a provided buffer).
    pub output: bool,
}

const fn f(keyed: bool, user_key: bool, value_in: bool, output: bool) -> Fields {
    Fields {
        keyed,
        user_key,
        value_in,
        output,
    }
}

opcodes! {
    /// Does nothing; completes with `aux = arg`. For measuring the queues.
    Nop = 0, f(false, false, false, false);
    /// Value state: read the value of (key, namespace).
    Get = 1, f(true, false, false, true);
    /// Value state: write `value`.
    Put = 2, f(true, false, true, false);
    /// Value state: delete the value of (key, namespace). (`Clear` removes a
    /// list or a whole map.)
    Delete = 3, f(true, false, false, false);
    /// List state: append the element `value`.
    ListAppend = 4, f(true, false, true, false);
    /// List state: read all elements (encoded `[u32 len][bytes]...`).
    ListGet = 5, f(true, false, false, true);
    /// List state: replace all elements with `value` (encoded as for `ListGet`).
    ListReplace = 6, f(true, false, true, false);
    /// Map state: read the value of `user_key`.
    MapGet = 7, f(true, true, false, true);
    /// Map state: write `value` under `user_key`.
    MapPut = 8, f(true, true, true, false);
    /// Map state: remove `user_key`.
    MapRemove = 9, f(true, true, false, false);
    /// Map state: completes with `aux = 1` if `user_key` is present, else 0.
    MapContains = 10, f(true, true, false, false);
    /// Map state: one page of entries (mode in `arg`), resumable after the
    /// user key in `user_key` with `ITER_RESUME`.
    MapIter = 11, f(true, true, false, true);
    /// Any state: remove everything of (key, namespace).
    Clear = 12, f(true, false, false, false);
    /// Checkpoint barrier with id `arg`; the result is the checkpoint handle.
    Checkpoint = 13, f(false, false, false, true);
    /// Checkpoint `arg` was completed, aborted or subsumed (kind in `arg2`).
    CheckpointNotify = 14, f(false, false, false, false);
    /// Start a portable snapshot export of checkpoint `arg` into the chunk region.
    SnapshotExport = 15, f(false, false, false, false);
    /// Import the chunk in chunk-region slot `arg2` into import `arg`.
    SnapshotImport = 16, f(false, false, false, false);
    /// Release chunk slot `arg2` of export `arg` back to the daemon.
    ChunkRelease = 17, f(false, false, false, false);
}

/// Why a descriptor was refused. Each maps to a completion status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SqeError {
    #[error("unknown opcode {0}")]
    BadOpcode(u8),
    #[error("flags {flags:#x} not valid for {op:?}")]
    BadFlags { op: Opcode, flags: u8 },
    #[error("reserved field is {0:#x}, must be zero")]
    Reserved(u32),
    #[error("{field} range {off}+{len} is outside the {bound}-byte arena")]
    OutOfArena {
        field: &'static str,
        off: u32,
        len: u32,
        bound: u64,
    },
    #[error("{field} must be unset for {op:?}")]
    UnexpectedField { op: Opcode, field: &'static str },
    #[error("{op:?} without a result buffer (set BUFFER_SELECT or a value range)")]
    NoOutput { op: Opcode },
}

/// A byte range resolved to segment offsets, after bounds checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SegRange {
    /// Offset from the start of the segment.
    pub off: usize,
    pub len: usize,
}

/// A descriptor that passed the protocol-level checks. State id and key
/// group are still the session's to check (it knows its registrations and
/// key-group range).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ValidSqe {
    pub user_data: u64,
    pub op: Opcode,
    pub flags: u8,
    pub key_group: u16,
    pub state_id: u32,
    pub key: SegRange,
    pub namespace: SegRange,
    pub user_key: SegRange,
    /// Input value, or explicit result buffer (see [`Fields`]).
    pub value: SegRange,
    pub arg: u64,
    pub arg2: u32,
}

impl ValidSqe {
    /// True when the result goes to a provided buffer.
    pub fn buffer_select(&self) -> bool {
        self.flags & sqe_flags::BUFFER_SELECT != 0
    }
}

impl Sqe {
    /// Validates a descriptor that was already copied out of shared memory.
    pub fn validate(&self, arena: &ArenaRegion) -> Result<ValidSqe, SqeError> {
        let op = Opcode::from_u8(self.opcode).ok_or(SqeError::BadOpcode(self.opcode))?;
        if self.reserved != 0 {
            return Err(SqeError::Reserved(self.reserved));
        }
        let fields = op.fields();
        let mut allowed = 0;
        if fields.output {
            allowed |= sqe_flags::BUFFER_SELECT;
        }
        if op == Opcode::MapIter {
            allowed |= sqe_flags::ITER_RESUME;
        }
        if op == Opcode::SnapshotExport {
            allowed |= sqe_flags::FROM_CHECKPOINTS;
        }
        if op == Opcode::ListAppend {
            allowed |= sqe_flags::ELEMENTS;
        }
        if self.flags & !allowed != 0 {
            return Err(SqeError::BadFlags {
                op,
                flags: self.flags,
            });
        }
        let resolve = |field: &'static str, r: BufRef, used: bool| -> Result<SegRange, SqeError> {
            if !used {
                return if r.is_none() {
                    Ok(SegRange::default())
                } else {
                    Err(SqeError::UnexpectedField { op, field })
                };
            }
            let off = arena
                .resolve(r.off, r.len)
                .map_err(|_| SqeError::OutOfArena {
                    field,
                    off: r.off,
                    len: r.len,
                    bound: arena.len as u64,
                })?;
            Ok(SegRange {
                off,
                len: r.len as usize,
            })
        };
        let key = resolve("key", self.key, fields.keyed)?;
        let namespace = resolve("namespace", self.namespace, fields.keyed)?;
        // A map iteration's `user_key` is its resume cursor: set only with
        // ITER_RESUME.
        let user_key_used =
            fields.user_key && (op != Opcode::MapIter || self.flags & sqe_flags::ITER_RESUME != 0);
        let user_key = resolve("user_key", self.user_key, user_key_used)?;
        let buffer_select = self.flags & sqe_flags::BUFFER_SELECT != 0;
        // `value` is an input, or the explicit result buffer of an output op
        // without BUFFER_SELECT.
        let value_used = op.value_in(self.flags) || (fields.output && !buffer_select);
        let value = resolve("value", self.value, value_used)?;
        if fields.output && !buffer_select && value.len == 0 {
            return Err(SqeError::NoOutput { op });
        }
        if !fields.keyed && (self.state_id != 0 || self.key_group != 0) {
            return Err(SqeError::UnexpectedField {
                op,
                field: "state_id/key_group",
            });
        }
        Ok(ValidSqe {
            user_data: self.user_data,
            op,
            flags: self.flags,
            key_group: self.key_group,
            state_id: self.state_id,
            key,
            namespace,
            user_key,
            value,
            arg: self.arg,
            arg2: self.arg2,
        })
    }
}
