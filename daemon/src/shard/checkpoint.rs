//! Checkpoint barriers and notifications on a session's queue.

use super::*;

/// Whose checkpoints a session takes: `(owner, job, operator, key groups)`.
pub(super) type Owner<'a> = (&'a [u8], &'a str, &'a str, (u16, u16));

/// A checkpoint barrier or notification (every earlier request of the
/// session has been run). `None`: the checkpoint completes later, through
/// the store's poll.
#[allow(clippy::too_many_arguments)]
pub(super) fn checkpoint_op<I: Io>(
    store: &mut Store<I>,
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
