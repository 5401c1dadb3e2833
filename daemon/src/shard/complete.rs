//! Completions: store outcomes mapped to statuses, results written into
//! the client's buffers, completions pushed into queues whose room was
//! reserved, and published (one tail store and doorbell per session).

use super::*;

pub(super) fn status_of(e: &StoreError) -> Status {
    match e {
        StoreError::Io { .. } => Status::Io,
        StoreError::NoSpace { .. } => Status::NoSpace,
        StoreError::Corrupt { .. } => Status::Corrupt,
        StoreError::TooLarge { .. } => Status::TooLarge,
        // A full disk stops the flushes: say so, not just "busy".
        StoreError::OverBudget { cause, .. } => match **cause {
            StoreError::NoSpace { .. } => Status::NoSpace,
            _ => Status::Busy,
        },
        StoreError::Invalid(_) => Status::BadArgument,
        StoreError::Dir { .. } => Status::Internal,
        StoreError::Restore(_) => Status::BadArgument,
        StoreError::Limit(_) => Status::Busy,
        StoreError::Snapshot(_) => Status::BadSnapshot,
        StoreError::Remote(_) => Status::Remote,
    }
}

/// Pushes one completion into a queue whose room was reserved.
pub(super) fn push(ring: &mut Ring<'_>, c: &Cqe) -> Result<(), QueueError> {
    match ring.cq.push(c)? {
        true => Ok(()),
        // Room is reserved per taken descriptor; a full queue here means
        // the client moved its head backwards, which push reports itself.
        false => Err(QueueError::BadHead {
            previous: 0,
            head: 0,
            tail: ring.cq.position(),
        }),
    }
}

/// Copies `parts` into the request's result buffer; the completion.
/// A completion with `status` that names the provided buffer `out` holds,
/// if any: every buffer taken is named by its request's completion,
/// whatever the status (PROTOCOL.md §7).
pub(super) fn answer(user_data: u64, status: Status, out: Out) -> Cqe {
    let mut c = Cqe::status(user_data, status);
    if let Out::Buf { id, .. } = out {
        c.flags |= cqe_flags::BUFFER;
        c.buf_id = id;
    }
    c
}

pub(super) fn write_result(ring: &Ring<'_>, user_data: u64, out: Out, parts: &[&[u8]]) -> Cqe {
    let need: usize = parts.iter().map(|p| p.len()).sum();
    let mut c = answer(user_data, Status::Ok, out);
    let (off, cap) = match out {
        Out::Range(r) => (r.off, r.len),
        Out::Buf { off, len, .. } => (off, len),
        Out::None => (0, 0),
    };
    if need > cap {
        c.status = Status::ResultTooLarge as i32;
        c.len = need.min(u32::MAX as usize) as u32;
        return c;
    }
    let mut at = off;
    for p in parts {
        if ring.view().write_from(at, p).is_err() {
            c.status = Status::BadRange as i32;
            return c;
        }
        at += p.len();
    }
    c.len = need as u32;
    c
}

/// The completion of a request whose store result is `res`.
pub(super) fn completion(ring: &Ring<'_>, p: &Pending, res: Result<Output<'_>, StoreError>) -> Cqe {
    let (user_data, out) = (p.user_data, p.out);
    match res {
        Err(StoreError::TooLarge { len, .. }) if p.op == Opcode::MapIter => {
            // Not one entry fits the page: say what buffer would hold it
            // (the page keeps a quarter, at most 64 KiB + 4, for the cursor).
            let mut c = answer(user_data, Status::ResultTooLarge, out);
            c.len = page_buffer_for(len).min(u32::MAX as usize) as u32;
            c
        }
        Err(e) => answer(user_data, status_of(&e), out),
        Ok(Output::Done) => answer(user_data, Status::Ok, out),
        Ok(Output::Contains(b)) => {
            let mut c = answer(user_data, Status::Ok, out);
            c.aux = b as u64;
            c
        }
        Ok(Output::Value(None)) => answer(user_data, Status::NotFound, out),
        Ok(Output::Imported(i)) => {
            let mut c = answer(user_data, Status::Ok, out);
            c.aux = i.records;
            c.flags |= cqe_flags::LAST;
            c
        }
        Ok(Output::Value(Some(v))) => write_result(ring, user_data, out, &[v]),
        Ok(Output::Page {
            data,
            entries,
            last_key,
            more,
        }) => {
            // `data | last user key | u32 its length` (PROTOCOL.md §6).
            let klen = (last_key.len() as u32).to_le_bytes();
            let mut c = write_result(ring, user_data, out, &[data, last_key, &klen]);
            c.aux = entries as u64;
            if more {
                c.flags |= cqe_flags::MORE;
            }
            c
        }
    }
}

impl<I: Io> Shard<I> {
    /// Delivers store completions. True if any.
    pub(super) fn reap(&mut self) -> bool {
        let Shard {
            id,
            store,
            sessions,
            by_id,
            pending,
            live,
            ..
        } = self;
        let mut orphans: Vec<Vec<u8>> = Vec::new();
        let mut checkpoints = false;
        let shard = *id;
        let now = Instant::now();
        let n = store.poll(|tok, res| {
            let p = pending.remove(tok as usize);
            live.ops
                .latency(p.op, now.saturating_duration_since(p.t0).as_nanos() as u64, 1);
            checkpoints |= p.op == Opcode::Checkpoint;
            // One log line per checkpoint and per installed import (never
            // one per request).
            match (p.op, &res) {
                (Opcode::Checkpoint, Ok(_)) => {
                    tracing::info!(shard, session = p.session, checkpoint = p.arg, "checkpoint taken")
                }
                (Opcode::Checkpoint, Err(e)) => {
                    tracing::warn!(shard, session = p.session, checkpoint = p.arg, error = %e, "checkpoint failed")
                }
                (Opcode::SnapshotImport, Ok(Output::Imported(i))) => {
                    tracing::info!(shard, session = p.session, import = p.arg, records = i.records, "snapshot imported")
                }
                _ => {}
            }
            let Some(&slot) = by_id.get(&p.session) else {
                // A checkpoint whose session closed before it completed:
                // no one holds its handle, so it can never be completed.
                if p.op == Opcode::Checkpoint
                    && let Ok(Output::Value(Some(h))) = res
                {
                    orphans.push(h.to_vec());
                }
                return;
            };
            let s = &mut sessions[slot];
            s.in_flight -= 1;
            s.dirty = true;
            let r = s.mem.with_dependent_mut(|_, ring| {
                let c = completion(ring, &p, res);
                if c.status < 0 {
                    live.ops.error(p.op as u8);
                }
                push(ring, &c)
            });
            if let Err(e) = r {
                s.break_off(shard, live, e.to_string());
            }
        });
        for h in orphans {
            self.store.discard_checkpoint(&h);
        }
        self.report_now |= checkpoints;
        n > 0
    }

    /// Publishes the completions of every session that has new ones, and
    /// rings the client's doorbell if it sleeps.
    pub(super) fn publish(&mut self) {
        for (_, s) in self.sessions.iter_mut() {
            if !s.dirty {
                continue;
            }
            s.dirty = false;
            if s.mem.with_dependent_mut(|_, ring| ring.cq.publish()) {
                s.to_client.ring();
            }
        }
    }
}
