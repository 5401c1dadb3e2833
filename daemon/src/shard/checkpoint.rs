//! Checkpoint barriers and notifications on a session's queue.

use super::*;

/// Whose checkpoints a session takes: `(owner, job, operator, key groups)`.
pub(super) type Owner<'a> = (&'a [u8], &'a str, &'a str, (u16, u16));

/// A checkpoint barrier or notification (every earlier request of the
/// session has been run). `None`: the checkpoint completes later, through
/// the store's poll.
#[allow(clippy::too_many_arguments)]
pub(super) fn checkpoint_op(
    store: &mut Store<UringIo>,
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    (owner, job, operator, (lo, hi)): Owner<'_>,
    view: &RegistryView,
    pending: &mut Slab<Pending>,
    sid: u64,
    in_flight: &mut u32,
) -> Option<Cqe> {
    let v = match sqe.validate(ring.arena()) {
        Ok(v) => v,
        Err(e) => return Some(Cqe::status(sqe.user_data, Status::from(e))),
    };
    if v.op == Opcode::CheckpointNotify && v.flags & sqe_flags::FROM_CHECKPOINTS != 0 {
        return Some(release(store, ring, &v, owner));
    }
    if v.op == Opcode::CheckpointNotify {
        use stator_ring::sqe::notify_kind;
        let kind = match v.arg2 {
            notify_kind::COMPLETE => Notify::Complete,
            notify_kind::ABORT => Notify::Abort,
            notify_kind::SUBSUME => Notify::Subsume,
            _ => return Some(Cqe::status(v.user_data, Status::BadArgument)),
        };
        // Answered once a completion is durable (its marker, written in
        // the store's background); at once otherwise.
        let tok = pending.insert(Pending {
            t0: Instant::now(),
            session: sid,
            user_data: v.user_data,
            op: v.op,
            out: Out::None,
            arg: v.arg,
        });
        store.checkpoint_notify_acked(owner, v.arg, kind, tok as u64);
        *in_flight += 1;
        return None;
    }
    let out = match take_out(ring, &v) {
        Ok(o) => o,
        Err((st, out)) => return Some(answer(v.user_data, st, out)),
    };
    let (states, meta) = view.get().operator_states(job, operator);
    let tok = pending.insert(Pending {
        t0: Instant::now(),
        session: sid,
        user_data: v.user_data,
        op: v.op,
        out,
        arg: v.arg,
    });
    let spec = CheckpointSpec {
        owner: owner.to_vec(),
        checkpoint_id: v.arg,
        lo,
        hi,
        states,
        meta,
    };
    match store.checkpoint(tok as u64, spec) {
        Ok(()) => {
            *in_flight += 1;
            None
        }
        Err(e) => {
            let p = pending.remove(tok);
            Some(completion(ring, &p, Err(e)))
        }
    }
}

/// A `RELEASE` notification: the engine discarded the checkpoint whose
/// handle `value` holds. Answered at once, `aux = 1` if this store held it
/// for the session's operator and deleted it, 0 if it held nothing of it
/// (already released, or another daemon's).
fn release(
    store: &mut Store<UringIo>,
    ring: &mut Ring<'_>,
    v: &stator_ring::sqe::ValidSqe,
    owner: &[u8],
) -> Cqe {
    const HANDLE: usize = stator_store::manifest::HANDLE_LEN;
    if v.arg2 != stator_ring::sqe::notify_kind::RELEASE || v.value.len != HANDLE {
        return Cqe::status(v.user_data, Status::BadArgument);
    }
    let mut h = [0u8; HANDLE];
    if ring.view().read_into(v.value.off, &mut h).is_err() {
        return Cqe::status(v.user_data, Status::BadRange);
    }
    match store.release_checkpoints(owner, &[&h]) {
        Ok(released) => Cqe {
            aux: released as u64,
            ..Cqe::status(v.user_data, Status::Ok)
        },
        Err(e) => Cqe::status(v.user_data, status_of(&e)),
    }
}
