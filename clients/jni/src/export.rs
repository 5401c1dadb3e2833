//! Portable snapshot streams, pulled one chunk at a time: the Java side
//! reads each chunk in place in its slot (savepoints in Flink's format,
//! key scans), and `transfer` moves a stream from one session's export
//! into another's import (a restore across owners).

use stator_client::Request;

use crate::error::{ERR_PROTOCOL, Fail};
use crate::session::{JniSession, TOKEN_CANCEL, TOKEN_EXPORT, TOKEN_SLOT, read_handles};

/// An export in progress on one session.
pub(crate) struct Export {
    id: u64,
    /// The index of the chunk to hand out next.
    next: u32,
    /// The slot the caller is reading (handed back at the next call).
    reading: Option<u32>,
    /// The last chunk was handed out, or the export failed.
    ended: bool,
}

impl JniSession {
    /// Starts export `id` of the session's state (an empty `handles`
    /// block: the live state, as of now; else the retained checkpoints the
    /// handles name) and hands every chunk slot to it. The session must be
    /// idle.
    pub fn export_start(&mut self, id: u64, handles: &[u8]) -> Result<(), Fail> {
        if self.export.is_some() || self.s.in_flight() > 0 {
            return Err(Fail::new(
                ERR_PROTOCOL,
                "an export needs an idle session with no other export",
            ));
        }
        if self.s.chunk_slots() == 0 {
            return Err(Fail::new(ERR_PROTOCOL, "the session has no chunk slots"));
        }
        let handles = if handles.is_empty() {
            Vec::new()
        } else {
            read_handles(handles)?.concat()
        };
        let start = if handles.is_empty() {
            Request::snapshot_export(id)
        } else {
            Request::snapshot_export_checkpoints(id, &handles)
        };
        self.s.submit(&start, TOKEN_EXPORT)?;
        self.s.flush()?;
        self.wait_done(TOKEN_EXPORT)?.status?;
        // The export exists in statord from here on: record it first, so a failure below
        // leaves something `export_cancel` can cancel.
        self.export = Some(Export {
            id,
            next: 0,
            reading: None,
            ended: false,
        });
        for slot in 0..self.s.chunk_slots() {
            self.s.submit(
                &Request::chunk_release(id, slot),
                TOKEN_SLOT + u64::from(slot),
            )?;
        }
        self.s.flush()?;
        Ok(())
    }

    /// The next chunk: `Some((slot, len))`, readable in place until the
    /// next call; `None` once the stream ended (the session is idle again).
    pub fn export_next(&mut self) -> Result<Option<(u32, u32)>, Fail> {
        let Some(mut e) = self.export.take() else {
            return Err(Fail::new(ERR_PROTOCOL, "no export is in progress"));
        };
        let r = self.export_step(&mut e);
        if r.is_err() || matches!(r, Ok(None)) {
            // Ended or failed: let every released slot come back, so the
            // session is idle and its slots are the client's again.
            self.drain_slots();
        } else {
            self.export = Some(e);
        }
        r
    }

    fn export_step(&mut self, e: &mut Export) -> Result<Option<(u32, u32)>, Fail> {
        if let Some(slot) = e.reading.take()
            && !e.ended
        {
            self.s.submit(
                &Request::chunk_release(e.id, slot),
                TOKEN_SLOT + u64::from(slot),
            )?;
            self.s.flush()?;
        }
        if e.ended {
            return Ok(None);
        }
        loop {
            let found = self
                .done
                .iter()
                .find(|(t, d)| {
                    **t >= TOKEN_SLOT
                        && (d.status.is_err() || (!d.not_found && d.aux == u64::from(e.next)))
                })
                .map(|(t, _)| *t);
            if let Some(t) = found {
                let d = self.done.remove(&t).expect("found above");
                if let Err(f) = d.status {
                    e.ended = true;
                    return Err(f);
                }
                let slot = (t - TOKEN_SLOT) as u32;
                e.next += 1;
                e.ended = d.last;
                e.reading = Some(slot);
                return Ok(Some((slot, d.len)));
            }
            if self.s.in_flight() == 0 {
                e.ended = true;
                return Err(Fail::new(
                    ERR_PROTOCOL,
                    format!("export {} ended without its last chunk", e.id),
                ));
            }
            self.pump()?;
        }
    }

    /// Abandons the export in progress (if any) and waits until the
    /// session is idle again.
    pub fn export_cancel(&mut self) -> Result<(), Fail> {
        let Some(e) = self.export.take() else {
            return Ok(());
        };
        if !e.ended {
            self.s.submit(&Request::export_cancel(e.id), TOKEN_CANCEL)?;
            self.s.flush()?;
        }
        self.drain_slots();
        Ok(())
    }

    /// Waits until no request is in flight, forgetting the outcomes of
    /// slot releases and cancels (they carry no chunk any more).
    fn drain_slots(&mut self) {
        while self.s.in_flight() > 0 {
            if self.pump().is_err() {
                break;
            }
        }
        self.done
            .retain(|t, _| *t < TOKEN_SLOT && *t != TOKEN_CANCEL);
    }

    /// Where chunk slot `slot` lies (4 MiB).
    pub fn chunk_slot(&self, slot: u32) -> Result<std::ptr::NonNull<u8>, Fail> {
        Ok(self.s.chunk_slot_ptr(slot)?)
    }
}

/// Streams export `id` of `from` (its live state, or the checkpoints named
/// by the `handles` block) into import `id` of `to`, chunk by chunk, each
/// copied once from one session's slot into the other's. Returns the
/// records installed. Both sessions must be idle; on failure nothing of
/// the import is installed.
pub fn transfer(
    from: &mut JniSession,
    to: &mut JniSession,
    id: u64,
    handles: &[u8],
) -> Result<u64, Fail> {
    from.export_start(id, handles)?;
    let mut failed: Option<Fail> = None;
    let installed =
        to.s.import_snapshot_with(id, |s, slot| match from.export_next() {
            Ok(Some((from_slot, len))) => {
                let chunk = from.s.chunk(from_slot, len as usize)?;
                s.write_chunk(slot, chunk)?;
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(f) => {
                let e = stator_client::Error::Protocol(format!("the export failed: {}", f.message));
                failed = Some(f);
                Err(e)
            }
        });
    let _ = from.export_cancel();
    match (installed, failed) {
        (_, Some(f)) => Err(f),
        (Ok(n), None) => Ok(n),
        (Err(e), None) => Err(e.into()),
    }
}
