//! Decoding a descriptor into a store operation: its action (one
//! exhaustive mapping from the opcode), state, key group, the bytes it
//! names copied out of shared memory, and where its result goes.

use super::*;

pub(super) type Refusal = (Status, Out);

/// Validates a descriptor (already copied out of shared memory) and copies
/// the bytes it names into `scratch`. `Ok(None)`: answered without the
/// store. `Err`: refused with that status (naming the provided buffer it
/// consumed, if any).
pub(super) fn take(
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    states: &[(StateKind, u32)],
    key_groups: (u16, u16),
    scratch: &mut Vec<u8>,
) -> Result<Option<Item>, Refusal> {
    let v = sqe
        .validate(ring.arena())
        .map_err(|e| (Status::from(e), Out::None))?;
    match Action::of(v.op, v.arg).map_err(|st| (st, Out::None))? {
        Some(action) => take_keyed(ring, &v, states, key_groups, scratch, action),
        // Not keyed: answered without the store.
        None => Ok(None),
    }
}

pub(super) fn take_keyed(
    ring: &mut Ring<'_>,
    v: &stator_ring::ValidSqe,
    states: &[(StateKind, u32)],
    (kg_lo, kg_hi): (u16, u16),
    scratch: &mut Vec<u8>,
    action: Action,
) -> Result<Option<Item>, Refusal> {
    let &(kind, state) = states
        .get(v.state_id as usize)
        .ok_or((Status::BadState, Out::None))?;
    if action.kind().is_some_and(|w| w != kind) {
        return Err((Status::BadState, Out::None));
    }
    if v.key_group < kg_lo || v.key_group > kg_hi {
        return Err((Status::BadKeyGroup, Out::None));
    }
    let fields = v.op.fields();
    let out = take_out(ring, v)?;
    let refuse = |st: Status| (st, out);
    // Sizes are checked before anything is copied: a range may span the
    // whole arena, and only the store's limits are worth copying.
    let part = stator_store::keys::MAX_PART_LEN;
    if v.key.len > part
        || v.namespace.len > part
        || v.user_key.len > part
        || (fields.value_in && v.value.len > stator_store::MAX_VALUE_LEN)
    {
        return Err(refuse(Status::TooLarge));
    }
    let mut copy = |r: SegRange| -> Result<Range<usize>, Refusal> {
        let start = scratch.len();
        scratch.resize(start + r.len, 0);
        ring.view()
            .read_into(r.off, &mut scratch[start..])
            .map_err(|_| refuse(Status::BadRange))?;
        Ok(start..start + r.len)
    };
    let key = copy(v.key)?;
    let ns = copy(v.namespace)?;
    let uk = copy(v.user_key)?;
    let val = if fields.value_in {
        copy(v.value)?
    } else {
        0..0
    };
    Ok(Some(Item {
        user_data: v.user_data,
        op: v.op,
        action,
        flags: v.flags,
        key_group: v.key_group,
        kind,
        state,
        key,
        ns,
        uk,
        val,
        out,
    }))
}

/// Where a request's result goes: nowhere, the range it names, or a
/// provided buffer taken now (a bad one is named in the refusal: the
/// client learns the id is its own again).
pub(super) fn take_out(ring: &mut Ring<'_>, v: &stator_ring::ValidSqe) -> Result<Out, Refusal> {
    if !v.op.fields().output {
        return Ok(Out::None);
    }
    if !v.buffer_select() {
        return Ok(Out::Range(v.value));
    }
    match ring.take_buffer() {
        Ok(Some(b)) => Ok(Out::Buf {
            id: b.buf_id,
            off: b.seg_off,
            len: b.len,
        }),
        Ok(None) | Err(TakeBufError::NoRing) => Err((Status::NoBuffer, Out::None)),
        Err(TakeBufError::Bad(b)) => Err((
            Status::BadBuffer,
            Out::Buf {
                id: b.buf_id,
                off: 0,
                len: 0,
            },
        )),
        Err(TakeBufError::Queue(_)) => Err((Status::BadBuffer, Out::None)),
    }
}

/// Room a map page of a `cap`-byte buffer gives its entries: the rest is
/// kept for the resume cursor after them (a user key is at most 64 KiB):
/// a quarter of the buffer, at least 4 bytes, at most 64 KiB + 4.
pub(super) fn page_entries_bytes(cap: usize) -> usize {
    cap.saturating_sub((cap / 4).clamp(4, (64 << 10) + 4))
}

/// The smallest buffer whose page holds `entry` bytes of entries (the
/// inverse of [`page_entries_bytes`]).
pub(super) fn page_buffer_for(entry: usize) -> usize {
    let cap = (entry * 4).div_ceil(3) + 4;
    if cap / 4 <= (64 << 10) + 4 {
        cap
    } else {
        entry + (64 << 10) + 4
    }
}

/// The store operation of a validated request.
pub(super) fn op_of<'a>(it: &Item, sc: &'a [u8]) -> Op<'a> {
    let k = KeyRef {
        key_group: it.key_group,
        state: it.state,
        key: &sc[it.key.clone()],
        namespace: &sc[it.ns.clone()],
    };
    let uk = &sc[it.uk.clone()];
    let val = &sc[it.val.clone()];
    match it.action {
        Action::Get => Op::Get(k),
        Action::Put => Op::Put(k, val),
        Action::Delete => Op::Delete(k),
        Action::ListAppend if it.flags & sqe_flags::ELEMENTS != 0 => Op::ListAppendAll(k, val),
        Action::ListAppend => Op::ListAppend(k, val),
        Action::ListGet => Op::ListGet(k),
        Action::ListReplace => Op::ListReplace(k, val),
        Action::MapGet => Op::MapGet(k, uk),
        Action::MapPut => Op::MapPut(k, uk, val),
        Action::MapRemove => Op::MapRemove(k, uk),
        Action::MapContains => Op::MapContains(k, uk),
        Action::MapIter(mode) => {
            let cap = match it.out {
                Out::Range(r) => r.len,
                Out::Buf { len, .. } => len,
                Out::None => 0,
            };
            Op::MapIter {
                map: k,
                mode,
                after: (it.flags & sqe_flags::ITER_RESUME != 0).then_some(uk),
                max_bytes: page_entries_bytes(cap),
            }
        }
        Action::Clear => Op::Clear(k, it.kind),
    }
}

/// What a keyed request asks of the store: decided once from its opcode
/// (and a map iteration's mode from its argument) by [`Action::of`],
/// exhaustive, so that no opcode falls through to another's operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Action {
    Get,
    Put,
    Delete,
    ListAppend,
    ListGet,
    ListReplace,
    MapGet,
    MapPut,
    MapRemove,
    MapContains,
    MapIter(IterMode),
    Clear,
}

impl Action {
    /// The action of a keyed opcode; `None` for the others (answered
    /// without the store, or checkpoint and snapshot requests).
    /// `BadArgument`: a map iteration's `arg` names no mode.
    fn of(op: Opcode, arg: u64) -> Result<Option<Action>, Status> {
        Ok(Some(match op {
            Opcode::Get => Action::Get,
            Opcode::Put => Action::Put,
            Opcode::Delete => Action::Delete,
            Opcode::ListAppend => Action::ListAppend,
            Opcode::ListGet => Action::ListGet,
            Opcode::ListReplace => Action::ListReplace,
            Opcode::MapGet => Action::MapGet,
            Opcode::MapPut => Action::MapPut,
            Opcode::MapRemove => Action::MapRemove,
            Opcode::MapContains => Action::MapContains,
            Opcode::MapIter => Action::MapIter(match arg {
                iter_mode::KEYS => IterMode::Keys,
                iter_mode::VALUES => IterMode::Values,
                iter_mode::ENTRIES => IterMode::Entries,
                _ => return Err(Status::BadArgument),
            }),
            Opcode::Clear => Action::Clear,
            Opcode::Nop
            | Opcode::Checkpoint
            | Opcode::CheckpointNotify
            | Opcode::SnapshotExport
            | Opcode::SnapshotImport
            | Opcode::ChunkRelease => return Ok(None),
        }))
    }

    /// The kind of state it applies to; `None`: any (a clear).
    fn kind(self) -> Option<StateKind> {
        match self {
            Action::Get | Action::Put | Action::Delete => Some(StateKind::Value),
            Action::ListAppend | Action::ListGet | Action::ListReplace => Some(StateKind::List),
            Action::MapGet
            | Action::MapPut
            | Action::MapRemove
            | Action::MapContains
            | Action::MapIter(_) => Some(StateKind::Map),
            Action::Clear => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 25: every keyed opcode, and only those, reaches the store,
    /// each as its own operation on its own kind of state (an opcode once
    /// fell through a wildcard arm to `Clear`).
    #[test]
    fn each_keyed_opcode_has_its_own_action() {
        let mut seen = Vec::new();
        for &op in Opcode::ALL {
            let a = Action::of(op, iter_mode::ENTRIES).unwrap();
            assert_eq!(a.is_some(), op.fields().keyed, "{op:?}");
            if let Some(a) = a {
                assert!(!seen.contains(&a), "{op:?} shares {a:?}");
                seen.push(a);
                let name = format!("{a:?}");
                assert_eq!(name.split('(').next(), Some(&*format!("{op:?}")));
                assert_eq!(a.kind().is_none(), op == Opcode::Clear, "{op:?}");
            }
        }
    }

    /// A map iteration's mode is its argument's, and an argument that
    /// names none is refused (it was once read as `Entries`).
    #[test]
    fn a_map_iteration_takes_only_the_modes_there_are() {
        for (arg, mode) in [
            (iter_mode::KEYS, IterMode::Keys),
            (iter_mode::VALUES, IterMode::Values),
            (iter_mode::ENTRIES, IterMode::Entries),
        ] {
            assert_eq!(
                Action::of(Opcode::MapIter, arg),
                Ok(Some(Action::MapIter(mode)))
            );
        }
        for arg in [3, 4, 255, u64::MAX] {
            if ![iter_mode::KEYS, iter_mode::VALUES, iter_mode::ENTRIES].contains(&arg) {
                assert_eq!(Action::of(Opcode::MapIter, arg), Err(Status::BadArgument));
            }
        }
        // Other opcodes do not read it.
        assert_eq!(Action::of(Opcode::Get, u64::MAX), Ok(Some(Action::Get)));
    }

    #[test]
    fn a_page_buffer_for_an_entry_holds_it() {
        for e in [1usize, 3, 100, 3000, 49151, 49152, 196_000, 1 << 20] {
            let cap = page_buffer_for(e);
            assert!(page_entries_bytes(cap) >= e, "entry {e}, cap {cap}");
            assert!(
                cap <= e + e / 3 + (64 << 10) + 8,
                "entry {e}: {cap} is needlessly large"
            );
        }
    }
}
