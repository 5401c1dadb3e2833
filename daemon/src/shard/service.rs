//! Taking a session's descriptors and running them: one pass copies a
//! batch of descriptors and the bytes they name out of shared memory,
//! runs the keyed ones against the store together, and answers the rest
//! (barriers first run what was taken before them).

use super::*;

/// The completion of a request answered without the store.
pub(super) fn immediate(sqe: &Sqe) -> Cqe {
    match Opcode::from_u8(sqe.opcode) {
        Some(Opcode::Nop) => {
            let mut c = Cqe::status(sqe.user_data, Status::Ok);
            c.aux = sqe.arg;
            c
        }
        _ => Cqe::status(sqe.user_data, Status::Unsupported),
    }
}

impl<I: Io> Shard<I> {
    /// Takes up to one batch of descriptors from session `slot` and runs
    /// them. True if anything was taken.
    pub(super) fn service(&mut self, slot: usize) -> bool {
        let Shard {
            store,
            registry,
            view,
            sessions,
            pending,
            taken,
            sqes,
            stats,
            batch,
            chunk,
            live,
            unsaved_imports,
            ..
        } = self;
        let s = &mut sessions[slot];
        if s.broken {
            return false;
        }
        // While a flush is behind, writes are taken in proportion to the
        // room they have left, and none when there is none: a session's
        // queue stops at its first write that may not be taken (the
        // client's queue fills), while reads, here and in sessions that
        // do not write, are taken as before.
        let headroom = store.write_headroom();
        // Bytes of writes this pass may take (see Store::write_room): a
        // burst of large puts waits in its queue instead of piling into
        // memtables past the budget.
        let mut write_room = store.write_room();
        let sid = s.id;
        let (owner, job, operator) = (&s.owner, &s.job, &s.operator);
        let (kg_lo, kg_hi) = s.key_groups;
        let states = &s.states;
        let in_flight = &mut s.in_flight;
        let max_in_flight = s.max_in_flight;
        let cq_blocked = &mut s.cq_blocked;
        let store_wait = &mut s.store_wait;
        let write_wait = &mut s.write_wait;
        let to_client = &s.to_client;
        let chunk_slots = s.chunk_slots;
        let requests = &mut s.requests;
        let (export, import) = (&mut s.export, &mut s.import);
        let r = s
            .mem
            .with_dependent_mut(|_, ring| -> Result<bool, QueueError> {
                let avail = ring.sq.available()?;
                if avail == 0 {
                    return Ok(false);
                }
                let room = ring.cq.free_now()?.saturating_sub(*in_flight);
                let room = room.min(max_in_flight.saturating_sub(*in_flight));
                // (A negative headroom saturates to none.)
                let write_admit = (*batch as f64 * headroom).ceil() as u32;
                let n = avail.min(room).min(*batch);
                *cq_blocked = n == 0;
                if n == 0 {
                    return Ok(false);
                }
                // Stopped at a write last pass, which is still the queue's
                // head (nothing behind it was taken): with no room for
                // writes yet there is nothing to take, and nothing to pop
                // and put back.
                if *write_wait && write_admit == 0 {
                    return Ok(false);
                }
                *write_wait = false;
                let mut tally = Tally::default();
                let mut who = Runner {
                    session: sid,
                    t0: Instant::now(),
                    in_flight,
                    stats,
                    ops: &live.ops,
                    tally: &mut tally,
                };
                *requests += n as u64;
                taken.clear();
                sqes.clear();
                for _ in 0..n {
                    let Some(sqe) = ring.sq.pop()? else { break };
                    sqes.push(sqe);
                }
                // Keys were written by the client and sit in its cache: a
                // rolling window of loads ahead overlaps those misses.
                let base = ring.arena().base;
                for q in sqes.iter().take(PREFETCH_AHEAD) {
                    ring.view().prefetch(base + q.key.off as usize, false);
                }
                let mut writes = 0u32;
                for (i, sqe) in sqes.iter().enumerate() {
                    if let Some(q) = sqes.get(i + PREFETCH_AHEAD) {
                        ring.view().prefetch(base + q.key.off as usize, false);
                    }
                    if let Some(op) = Opcode::from_u8(sqe.opcode)
                        && op.fields().value_in
                    {
                        // (Lengths as the client says: an invalid one is
                        // refused by `take`, this only counts.)
                        let len = [sqe.key, sqe.namespace, sqe.user_key, sqe.value]
                            .iter()
                            .map(|b| b.len as usize)
                            .sum::<usize>();
                        if writes >= write_admit || (writes > 0 && len > write_room) {
                            // This write and the rest stay queued until a
                            // flush makes room (the first write of a pass
                            // with any room is taken, however large).
                            let rest = (sqes.len() - i) as u32;
                            ring.sq.unpop(rest);
                            *requests -= u64::from(rest);
                            *write_wait = true;
                            if i == 0 {
                                return Ok(false);
                            }
                            break;
                        }
                        writes += 1;
                        write_room = write_room.saturating_sub(len);
                    }
                    let op = Opcode::from_u8(sqe.opcode);
                    // A session with an export or import of its own under
                    // way never waits for memory: the requests that would
                    // end it may be queued behind (a second one gets Busy
                    // from the store instead). Nor does a cancel.
                    let idle = export.as_ref().is_none_or(|e| e.id.is_none()) && import.is_none();
                    let new = idle && sqe.arg2 != CANCEL_SNAPSHOT;
                    let wait = match op {
                        Some(Opcode::Checkpoint) if store.checkpoint_should_wait() => {
                            Some(StoreWait::Compaction)
                        }
                        Some(Opcode::SnapshotExport) if new && store.export_should_wait() => {
                            Some(StoreWait::Export)
                        }
                        Some(Opcode::SnapshotImport) if new && store.import_should_wait() => {
                            Some(StoreWait::Import)
                        }
                        _ => None,
                    };
                    if let Some(w) = wait {
                        // It and the rest stay queued until compaction
                        // shrinks the layers a checkpoint would name, or
                        // other exports and imports end.
                        if *store_wait != Some(w) {
                            tracing::info!(session = sid, "{}", w.why());
                        }
                        *store_wait = Some(w);
                        let rest = (sqes.len() - i) as u32;
                        ring.sq.unpop(rest);
                        *requests -= u64::from(rest);
                        if i == 0 {
                            return Ok(false);
                        }
                        break;
                    }
                    *store_wait = None;
                    who.stats.requests += 1;
                    live.ops.request(sqe.opcode);
                    if matches!(
                        op,
                        Some(
                            Opcode::Checkpoint
                                | Opcode::CheckpointNotify
                                | Opcode::SnapshotExport
                                | Opcode::SnapshotImport
                                | Opcode::ChunkRelease
                        )
                    ) {
                        // A barrier: every earlier request takes effect
                        // (or fixes its snapshot) first.
                        taken.run(store, ring, pending, &mut who)?;
                        let id = (&owner[..], &job[..], &operator[..], (kg_lo, kg_hi));
                        let in_flight = &mut *who.in_flight;
                        let c = if matches!(op, Some(Opcode::Checkpoint | Opcode::CheckpointNotify))
                        {
                            checkpoint_op(store, ring, sqe, id, view, pending, sid, in_flight)
                        } else {
                            let ctx = SnapshotCtx {
                                registry,
                                view,
                                pending,
                                sid,
                                in_flight,
                                chunk_slots,
                                export,
                                import,
                                chunk,
                                unsaved_imports,
                            };
                            snapshot_op(store, ring, sqe, id, ctx)?
                        };
                        if let Some(c) = c {
                            if c.status < 0 {
                                live.ops.error(sqe.opcode);
                            }
                            who.tally.add(op.expect("matched above"));
                            push(ring, &c)?;
                        }
                        continue;
                    }
                    match taken.take(ring, sqe, states, (kg_lo, kg_hi)) {
                        Taken::Batched { full } => {
                            if full {
                                // Large values: run what is copied so far.
                                taken.run(store, ring, pending, &mut who)?;
                            }
                        }
                        Taken::Answered => {
                            // Answered at once (no-op, not supported here).
                            let c = immediate(sqe);
                            if let Some(op) = op {
                                who.tally.add(op);
                            }
                            push(ring, &c)?;
                        }
                        Taken::Refused((st, out)) => {
                            who.stats.errors += 1;
                            live.ops.error(sqe.opcode);
                            if let Some(op) = op {
                                who.tally.add(op);
                            }
                            push(ring, &answer(sqe.user_data, st, out))?;
                        }
                    }
                }
                if ring.sq.release() {
                    // The client waits for room in its submission queue.
                    to_client.ring();
                }
                taken.run(store, ring, pending, &mut who)?;
                who.tally
                    .record(&live.ops, who.t0.elapsed().as_nanos() as u64);
                taken.trim();
                // Published per batch, not per pass: the client refills
                // its queue while the next batch runs.
                if ring.cq.publish() {
                    to_client.ring();
                }
                Ok(true)
            });
        match r {
            Ok(progress) => progress,
            Err(e) => {
                s.break_off(self.id, &self.live, e.to_string());
                false
            }
        }
    }
}
