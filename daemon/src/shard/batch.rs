//! A batch: the keyed requests among the descriptors one pass takes off
//! a session's submission queue, validated, with the bytes they name
//! copied out of shared memory, then run against the store together. Its buffers live as long as the shard, so a pass allocates
//! nothing once they have grown.

use super::*;

#[derive(Default)]
pub(super) struct Batch {
    /// The keyed requests taken so far; their byte ranges index `scratch`.
    items: Vec<Item>,
    /// Each item's `pending` slot, the store's token for it.
    tokens: Vec<u64>,
    scratch: Vec<u8>,
    /// The store operations' buffer, empty between runs (its capacity is
    /// what is kept, see [`Batch::run`]).
    ops: Vec<Op<'static>>,
}

/// What became of a descriptor offered to the batch.
pub(super) enum Taken {
    /// In the batch; `full`: the batch holds [`BATCH_BYTES`] or more and
    /// runs before it takes more (one batch never holds much more).
    Batched { full: bool },
    /// Not keyed: answered without the store ([`immediate`]).
    Answered,
    /// Refused with this status.
    Refused(Refusal),
}

/// Whose batch runs, and where its answers and counts go.
pub(super) struct Runner<'a> {
    pub(super) session: u64,
    /// When the pass took the batch (the daemon-side latency's start).
    pub(super) t0: Instant,
    pub(super) in_flight: &'a mut u32,
    pub(super) stats: &'a mut ShardStats,
    pub(super) ops: &'a OpMetrics,
    pub(super) tally: &'a mut Tally,
}

impl Batch {
    /// Starts a pass's batch: nothing taken.
    pub(super) fn clear(&mut self) {
        self.items.clear();
        self.scratch.clear();
    }

    /// Validates `sqe` (popped this pass) and takes it into the batch if
    /// it is a keyed request, its bytes copied out of shared memory.
    pub(super) fn take(
        &mut self,
        ring: &mut Ring<'_>,
        sqe: &Sqe,
        states: &[(StateKind, u32)],
        key_groups: (u16, u16),
    ) -> Taken {
        match take(ring, sqe, states, key_groups, &mut self.scratch) {
            Ok(Some(item)) => {
                self.items.push(item);
                Taken::Batched {
                    full: self.scratch.len() >= BATCH_BYTES,
                }
            }
            Ok(None) => Taken::Answered,
            Err(r) => Taken::Refused(r),
        }
    }

    /// Runs the requests taken so far through the store and pushes the
    /// completions of those answered at once; the others complete through
    /// [`Shard::reap`]. Leaves the batch empty.
    pub(super) fn run<I: Io>(
        &mut self,
        store: &mut Store<I>,
        ring: &mut Ring<'_>,
        pending: &mut Slab<Pending>,
        who: &mut Runner<'_>,
    ) -> Result<(), QueueError> {
        if self.items.is_empty() {
            return Ok(());
        }
        let Batch {
            items,
            tokens,
            scratch,
            ops,
            ..
        } = self;
        tokens.clear();
        for it in items.iter() {
            tokens.push(pending.insert(Pending {
                t0: who.t0,
                session: who.session,
                user_data: it.user_data,
                op: it.op,
                out: it.out,
                arg: 0,
            }) as u64);
        }
        let mut batch_ops = relabel(std::mem::take(ops));
        batch_ops.extend(items.iter().map(|it| op_of(it, scratch)));
        let mut err: Result<(), QueueError> = Ok(());
        store.submit_batch(tokens, &batch_ops, |i, res| {
            // The result buffer a few requests ahead: write intent.
            if let Some(Out::Range(r)) = items.get(i + PREFETCH_AHEAD).map(|it| it.out) {
                ring.view().prefetch(r.off, true);
                ring.view().prefetch(r.off + 64, true);
            }
            let tok = tokens[i] as usize;
            let (p, res) = match res {
                Ok(Submitted::Pending) => {
                    *who.in_flight += 1;
                    return;
                }
                Ok(Submitted::Ready(o)) => (pending.remove(tok), Ok(o)),
                Err(e) => {
                    who.stats.errors += 1;
                    (pending.remove(tok), Err(e))
                }
            };
            who.tally.add(p.op);
            let c = completion(ring, &p, res);
            if c.status < 0 {
                who.ops.error(p.op as u8);
            }
            if err.is_ok() {
                err = push(ring, &c);
            }
        });
        *ops = relabel(batch_ops);
        items.clear();
        scratch.clear();
        err
    }

    /// Gives back scratch memory past twice [`BATCH_BYTES`] (a batch of
    /// large values), keeping one batch's worth.
    pub(super) fn trim(&mut self) {
        if self.scratch.capacity() > 2 * BATCH_BYTES {
            self.scratch.clear();
            self.scratch.shrink_to(BATCH_BYTES);
        }
    }
}

/// An emptied vector of operations under another lifetime: the same
/// allocation (a collect from a vector's own iterator into elements of the
/// same layout reuses it), so the buffer outlives the bytes each batch's
/// operations borrow without an allocation per batch.
fn relabel<'b>(mut v: Vec<Op<'_>>) -> Vec<Op<'b>> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operations' buffer keeps its allocation across lifetimes.
    #[test]
    fn relabel_keeps_the_allocation() {
        let bytes = vec![1u8; 8];
        let mut v: Vec<Op<'_>> = Vec::with_capacity(64);
        let key = KeyRef {
            key_group: 0,
            state: 0,
            key: &bytes,
            namespace: &[],
        };
        v.push(Op::Get(key));
        let (ptr, cap) = (v.as_ptr() as usize, v.capacity());
        let w: Vec<Op<'static>> = relabel(v);
        assert!(w.is_empty());
        assert_eq!((w.as_ptr() as usize, w.capacity()), (ptr, cap));
    }
}
