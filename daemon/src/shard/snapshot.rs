//! Portable snapshots on a session's queue: exports into chunk slots,
//! imports from them, and the state they keep between requests.

use super::*;

/// States new to the operator one import may register.
pub(super) const IMPORT_NEW_STATES: usize = 256;

/// Bytes of import writes in flight past which chunk completions wait.
pub(super) const IMPORT_BACKLOG: usize = 16 << 20;

/// Completes an import's held chunks (`status`) and forgets it.
pub(super) fn end_import(
    ring: &mut Ring<'_>,
    imp: &mut Option<ImportState>,
    in_flight: &mut u32,
    status: Status,
) -> Result<(), QueueError> {
    if let Some(i) = imp.take() {
        for user_data in i.held {
            *in_flight -= 1;
            push(ring, &Cqe::status(user_data, status))?;
        }
    }
    Ok(())
}

const _: () = assert!(CHUNK_LEN == stator_ring::sqe::CHUNK_SLOT_LEN);

/// A chunk slot in shared memory: written, never read back (the client may
/// be scribbling on it; the CRC is computed from the store's bytes).
pub(super) struct ShmChunk<'a, 'b> {
    view: &'b ShmView<'a>,
    off: usize,
}

impl ChunkSlot for ShmChunk<'_, '_> {
    fn slot_len(&self) -> usize {
        CHUNK_LEN
    }
    fn write_at(&mut self, off: usize, bytes: &[u8]) {
        // In bounds: the region holds whole slots (checked at open).
        let _ = self.view.write_from(self.off + off, bytes);
    }
}

/// What a snapshot request may touch of its shard and session.
pub(super) struct SnapshotCtx<'s> {
    pub(super) registry: &'s Mutex<Registry>,
    pub(super) view: &'s RegistryView,
    pub(super) pending: &'s mut Slab<Pending>,
    pub(super) sid: u64,
    pub(super) in_flight: &'s mut u32,
    pub(super) chunk_slots: u32,
    pub(super) export: &'s mut Option<ExportState>,
    pub(super) import: &'s mut Option<ImportState>,
    pub(super) chunk: &'s mut Vec<u8>,
    /// Imports held until the registry saves their state ids (see
    /// `Shard::unsaved_imports`).
    pub(super) unsaved_imports: &'s mut Vec<(ImportHold, u64)>,
}

/// Completes the slots still released to an ended export with `NotFound`.
pub(super) fn end_export(
    ring: &mut Ring<'_>,
    e: &mut ExportState,
    in_flight: &mut u32,
) -> Result<(), QueueError> {
    while let Some((_, user_data)) = e.queue.pop_front() {
        *in_flight -= 1;
        push(ring, &Cqe::status(user_data, Status::NotFound))?;
    }
    Ok(())
}

/// `SnapshotExport`, `ChunkRelease` and `SnapshotImport` (every earlier
/// request of the session has been run). `None`: completes later.
pub(super) fn snapshot_op<I: Io>(
    store: &mut Store<I>,
    ring: &mut Ring<'_>,
    sqe: &Sqe,
    (owner, job, operator, (lo, hi)): Owner<'_>,
    cx: SnapshotCtx<'_>,
) -> Result<Option<Cqe>, QueueError> {
    let v = match sqe.validate(ring.arena()) {
        Ok(v) => v,
        Err(e) => return Ok(Some(Cqe::status(sqe.user_data, Status::from(e)))),
    };
    let done = |st: Status| Ok(Some(Cqe::status(v.user_data, st)));
    let lock = || cx.registry.lock().unwrap_or_else(|p| p.into_inner());
    match v.op {
        Opcode::SnapshotExport => {
            if cx.export.as_ref().is_some_and(|e| e.id.is_some()) {
                return done(Status::Busy);
            }
            let states = cx.view.get().operator_descs(job, operator);
            let spec = ExportSpec {
                owner: owner.to_vec(),
                snapshot_id: v.arg,
                lo,
                hi,
                states,
            };
            let started = if v.flags & sqe_flags::FROM_CHECKPOINTS != 0 {
                // Handles back to back, copied out of shared memory first.
                const HANDLE: usize = stator_store::manifest::HANDLE_LEN;
                if v.value.len == 0
                    || !v.value.len.is_multiple_of(HANDLE)
                    || v.value.len > 4096 * HANDLE
                {
                    return done(Status::BadArgument);
                }
                let mut hs = vec![0u8; v.value.len];
                if ring.view().read_into(v.value.off, &mut hs).is_err() {
                    return done(Status::BadRange);
                }
                let handles: Vec<&[u8]> = hs.chunks(HANDLE).collect();
                store.export_checkpoints(spec, &handles)
            } else {
                store.export(spec)
            };
            match started {
                Ok(id) => {
                    *cx.export = Some(ExportState {
                        snapshot: v.arg,
                        id: Some(id),
                        queue: VecDeque::new(),
                        next_chunk: 0,
                    });
                    done(Status::Ok)
                }
                Err(e) => done(status_of(&e)),
            }
        }
        Opcode::ChunkRelease => {
            let Some(e) = cx.export.as_mut().filter(|e| e.snapshot == v.arg) else {
                return done(Status::BadArgument);
            };
            if v.arg2 == CANCEL_SNAPSHOT {
                if let Some(id) = e.id.take() {
                    store.export_cancel(id);
                }
                end_export(ring, e, cx.in_flight)?;
                return done(Status::Ok);
            }
            if v.arg2 >= cx.chunk_slots || e.queue.iter().any(|q| q.0 == v.arg2) {
                return done(Status::BadArgument);
            }
            if e.id.is_none() {
                return done(Status::NotFound);
            }
            e.queue.push_back((v.arg2, v.user_data));
            *cx.in_flight += 1;
            Ok(None)
        }
        _ => {
            // SnapshotImport: the chunk in slot `arg2`, of import `arg`.
            if v.arg2 == CANCEL_SNAPSHOT {
                if let Some(i) = cx.import.as_ref().filter(|i| i.import == v.arg) {
                    store.import_cancel(i.id);
                    end_import(ring, cx.import, cx.in_flight, Status::Ok)?;
                }
                return done(Status::Ok);
            }
            if v.arg2 >= cx.chunk_slots {
                return done(Status::BadArgument);
            }
            if cx.import.as_ref().is_some_and(|i| i.import != v.arg) {
                return done(Status::Busy);
            }
            let off = ring.layout().chunk_off + v.arg2 as usize * CHUNK_LEN;
            let mut h = [0u8; HEADER_LEN];
            let _ = ring.view().read_into(off, &mut h);
            let len = HEADER_LEN + u32::from_le_bytes(h[20..24].try_into().expect("4")) as usize;
            let len = len.min(CHUNK_LEN);
            // A private copy: the checks and the records see bytes the
            // client can no longer change.
            cx.chunk.resize(len, 0);
            let _ = ring.view().read_into(off, &mut cx.chunk[..]);
            let id = match cx.import.as_ref() {
                Some(i) => i.id,
                None => {
                    let (states, _) = cx.view.get().operator_states(job, operator);
                    let spec = ImportSpec {
                        owner: owner.to_vec(),
                        lo,
                        hi,
                        states,
                    };
                    match store.import_begin(spec) {
                        Ok(id) => {
                            *cx.import = Some(ImportState {
                                import: v.arg,
                                id,
                                held: VecDeque::new(),
                                // Installed once its state ids are durable.
                                hold: store.import_hold(id),
                            });
                            id
                        }
                        Err(e) => return done(status_of(&e)),
                    }
                }
            };
            let tok = cx.pending.insert(Pending {
                t0: Instant::now(),
                session: cx.sid,
                user_data: v.user_data,
                op: v.op,
                out: Out::None,
                arg: v.arg,
            });
            // The states the snapshot names become (or are) states of this
            // operator, by name and kind, registered together. New ones are
            // saved off the shard: the import is installed once they are
            // durable (the registry version it needs).
            let mut needs: Option<u64> = None;
            let mut resolve = |table: &[StateDesc]| -> Result<Vec<u32>, String> {
                let mut named = Vec::with_capacity(table.len());
                for d in table {
                    let name = std::str::from_utf8(&d.name)
                        .map_err(|_| "a state name that is not UTF-8".to_string())?;
                    named.push((name, wire_kind(d.kind)));
                }
                let current = cx.view.get();
                let new = named
                    .iter()
                    .filter(|(n, _)| !current.is_registered(job, operator, n))
                    .count();
                if new > IMPORT_NEW_STATES {
                    // Registrations outlive a refused import: a snapshot
                    // cannot fill the daemon's registry with names.
                    return Err(format!(
                        "the snapshot names {new} states this operator does not have (at most {IMPORT_NEW_STATES})"
                    ));
                }
                if new == 0 {
                    // Nothing to register: no lock.
                    needs = Some(current.version());
                    return named
                        .iter()
                        .map(|&(n, k)| current.id_of(job, operator, n, k))
                        .collect();
                }
                let (ids, version) = lock()
                    .register_all_later(job, operator, &named)
                    .map_err(|(_, m)| m)?;
                needs = Some(version);
                Ok(ids)
            };
            let step = store.import_chunk(id, &cx.chunk[..], tok as u64, &mut resolve);
            // Once its state ids are known (or it ends without naming any:
            // nothing to wait for).
            let finishing = matches!(step, Ok(ImportStep::Finishing));
            // The shard releases it (`Shard::release_saved_imports`, later
            // in this pass) once that version is durable.
            if (needs.is_some() || finishing)
                && let Some(h) = cx.import.as_mut().and_then(|i| i.hold.take())
            {
                cx.unsaved_imports.push((h, needs.unwrap_or(0)));
            }
            match step {
                Ok(ImportStep::Consumed) => {
                    cx.pending.remove(tok);
                    let imp = cx.import.as_mut().expect("set above");
                    if imp.held.is_empty() && store.import_backlog(id) <= IMPORT_BACKLOG {
                        return done(Status::Ok);
                    }
                    // The disk is behind: the slot comes back later.
                    imp.held.push_back(v.user_data);
                    *cx.in_flight += 1;
                    Ok(None)
                }
                Ok(ImportStep::Finishing) => {
                    *cx.in_flight += 1;
                    end_import(ring, cx.import, cx.in_flight, Status::Ok)?;
                    Ok(None)
                }
                Err(e) => {
                    cx.pending.remove(tok);
                    tracing::warn!(import = v.arg, error = %e, "snapshot import refused");
                    let st = status_of(&e);
                    end_import(ring, cx.import, cx.in_flight, st)?;
                    done(st)
                }
            }
        }
    }
}

/// A state kind as the control protocol numbers it.
pub(super) fn wire_kind(k: StateKind) -> u8 {
    match k {
        StateKind::Value => stator_ring::control::kind::VALUE,
        StateKind::List => stator_ring::control::kind::LIST,
        StateKind::Map => stator_ring::control::kind::MAP,
    }
}

impl<I: Io> Shard<I> {
    /// Fills the slots clients released to their exports, a bounded step
    /// each, and gives back import chunks held while the disk caught up.
    /// True if a step made progress without waiting.
    pub(super) fn drive_snapshots(&mut self) -> bool {
        let mut progress = false;
        let Shard {
            id: shard,
            store,
            sessions,
            live,
            ..
        } = self;
        let shard = *shard;
        for (_, s) in sessions.iter_mut() {
            if s.broken {
                continue;
            }
            let in_flight = &mut s.in_flight;
            let (export, import) = (&mut s.export, &mut s.import);
            let r = s.mem.with_dependent_mut(|_, ring| -> Result<bool, QueueError> {
                let mut pushed = false;
                if let Some(i) = import.as_mut()
                    && !i.held.is_empty()
                    && store.import_backlog(i.id) <= IMPORT_BACKLOG
                {
                    for user_data in i.held.drain(..) {
                        *in_flight -= 1;
                        push(ring, &Cqe::status(user_data, Status::Ok))?;
                    }
                    pushed = true;
                }
                let Some(e) = export.as_mut() else {
                    return Ok(pushed);
                };
                let (Some(id), Some(&(slot, user_data))) = (e.id, e.queue.front()) else {
                    return Ok(pushed);
                };
                let off = ring.layout().chunk_off + slot as usize * CHUNK_LEN;
                let mut target = ShmChunk {
                    view: ring.view(),
                    off,
                };
                let mut c = Cqe::status(user_data, Status::Ok);
                match store.export_fill(id, &mut target) {
                    Ok(Fill::Wait) => return Ok(pushed),
                    Ok(Fill::Again) => {
                        progress = true;
                        return Ok(pushed);
                    }
                    Ok(Fill::Chunk { len, last }) => {
                        progress = true;
                        c.len = len as u32;
                        c.aux = e.next_chunk as u64;
                        e.next_chunk += 1;
                        if last {
                            c.flags |= cqe_flags::LAST;
                            e.id = None;
                        }
                    }
                    Err(err) => {
                        live.ops.error(Opcode::ChunkRelease as u8);
                        tracing::warn!(snapshot = e.snapshot, error = %err, "snapshot export failed");
                        c.status = status_of(&err) as i32;
                        e.id = None;
                    }
                }
                e.queue.pop_front();
                *in_flight -= 1;
                push(ring, &c)?;
                if e.id.is_none() {
                    // The export is over: the other released slots go back.
                    end_export(ring, e, in_flight)?;
                }
                Ok(true)
            });
            match r {
                Ok(pushed) => s.dirty |= pushed,
                Err(e) => s.break_off(shard, live, e.to_string()),
            }
        }
        progress
    }
}
