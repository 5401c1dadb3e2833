//! The portable snapshot chunk stream: export into and import from the
//! session's chunk slots (4 MiB each, in shared memory), as single
//! requests for the caller's own loop, or as two helpers that run the
//! whole stream with a callback per chunk.

use std::ffi::c_void;

use stator_client::Request;

use crate::ptr::out;
use crate::session::{STATOR_NO_SLOT, stator_session, with};
use crate::status::*;

/// Bytes in one chunk slot (a chunk is at most this long).
pub const STATOR_CHUNK_SLOT_LEN: u32 = 4 << 20;

/// Receives one exported chunk, in order: `len` bytes at `chunk`, valid
/// during the call only (they sit in a chunk slot the daemon refills
/// afterwards). Returns 0 to go on, anything else to cancel the export.
pub type stator_chunk_sink =
    Option<unsafe extern "C" fn(ctx: *mut c_void, chunk: *const u8, len: usize) -> i32>;

/// Writes the next chunk to import into `slot` (`capacity` bytes,
/// `STATOR_CHUNK_SLOT_LEN`), in place, and sets `*len` (checked against
/// the capacity; the daemon reads the length from the chunk's own header).
/// Returns 1 when it wrote a chunk, 0 when there are no more, a negative
/// value to cancel the import.
pub type stator_chunk_source = Option<
    unsafe extern "C" fn(ctx: *mut c_void, slot: *mut u8, capacity: usize, len: *mut usize) -> i32,
>;

fn submit(session: *mut stator_session, r: Request<'_>, user_data: u64) -> i32 {
    with(session, |i| {
        i.session()?.submit(&r, user_data)?;
        Ok(STATOR_OK)
    })
}

/// Chunk slots of this session (0 if it was opened without any), or a
/// negative status.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_chunk_slots(session: *mut stator_session) -> i32 {
    with(session, |i| Ok(i.session()?.chunk_slots() as i32))
}

/// Where chunk slot `slot` lies (`*data`, `STATOR_CHUNK_SLOT_LEN` bytes):
/// to write a chunk to import in place. Refused with
/// `STATOR_E_INVALID_STATE` while the slot is handed to the daemon (from
/// the submit that names it to that request's completion);
/// `STATOR_E_INVALID_ARGUMENT` for a slot out of range.
///
/// # Safety
/// `session` from `stator_open` and not freed; `data` is NULL or
/// writable. The pointer stays valid until the session is closed or freed
/// (which unmap the shared memory); the bytes are the caller's only while
/// the slot is. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_chunk_slot(
    session: *mut stator_session,
    slot: u32,
    data: *mut *mut u8,
) -> i32 {
    with(session, |i| {
        // SAFETY: NULL or writable, by the caller's contract.
        let d = unsafe { out(data, "data")? };
        let s = i.session()?;
        check_slot(s, slot)?;
        *d = s.chunk_slot_ptr(slot)?.as_ptr();
        Ok(STATOR_OK)
    })
}

/// Starts a portable export of this session's state (its operator's
/// states in its key groups) as snapshot `snapshot_id`: a barrier like a
/// checkpoint, completing once the snapshot is fixed. Then hand slots to
/// it with `stator_chunk_release`.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_snapshot_export(
    session: *mut stator_session,
    snapshot_id: u64,
    user_data: u64,
) -> i32 {
    submit(session, Request::snapshot_export(snapshot_id), user_data)
}

/// Hands chunk slot `slot` to export `snapshot_id`: the completion comes
/// when the slot holds the next chunk (`value`/`value_len` point at it in
/// place, `aux` is its index, `STATOR_CQE_LAST` on the last), or with
/// `STATOR_NOT_FOUND` once the export has ended. Read the chunk, then
/// release the slot again for the next one. `STATOR_E_INVALID_STATE` if
/// the slot is handed over already.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_chunk_release(
    session: *mut stator_session,
    snapshot_id: u64,
    slot: u32,
    user_data: u64,
) -> i32 {
    if slot == STATOR_NO_SLOT {
        return Fail::arg("slot UINT32_MAX is the cancel marker: use stator_export_cancel")
            .report();
    }
    with(session, |i| {
        let s = i.session()?;
        check_slot(s, slot)?;
        s.submit(&Request::chunk_release(snapshot_id, slot), user_data)?;
        Ok(STATOR_OK)
    })
}

/// Abandons export `snapshot_id`; slots handed to it come back with
/// `STATOR_NOT_FOUND`.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_export_cancel(
    session: *mut stator_session,
    snapshot_id: u64,
    user_data: u64,
) -> i32 {
    submit(session, Request::export_cancel(snapshot_id), user_data)
}

/// Imports the chunk in slot `slot` (written there through
/// `stator_chunk_slot`) as the next chunk of import `import_id`; chunks in
/// order, several slots in flight at once. The completion hands the slot
/// back; the last chunk's completes once the snapshot is installed
/// (`STATOR_CQE_LAST`, `aux` = records). A bad chunk fails with
/// `STATOR_E_BAD_SNAPSHOT` and nothing of the import is installed.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_snapshot_import(
    session: *mut stator_session,
    import_id: u64,
    slot: u32,
    user_data: u64,
) -> i32 {
    if slot == STATOR_NO_SLOT {
        return Fail::arg("slot UINT32_MAX is the cancel marker: use stator_import_cancel")
            .report();
    }
    with(session, |i| {
        let s = i.session()?;
        check_slot(s, slot)?;
        s.submit(&Request::snapshot_import(import_id, slot), user_data)?;
        Ok(STATOR_OK)
    })
}

/// Abandons import `import_id`: nothing of it is installed, and its
/// chunks still waiting come back.
///
/// # Safety
/// `session` from `stator_open` and not freed. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_import_cancel(
    session: *mut stator_session,
    import_id: u64,
    user_data: u64,
) -> i32 {
    submit(session, Request::import_cancel(import_id), user_data)
}

/// Refuses a slot out of range or handed to the daemon.
pub(crate) fn check_slot(s: &stator_client::Session, slot: u32) -> Res<()> {
    match s.slot_held(slot) {
        None => Err(Fail::arg(format!(
            "chunk slot {slot} is not one of the session's {}",
            s.chunk_slots()
        ))),
        Some(true) => Err(Fail::new(
            STATOR_E_INVALID_STATE,
            format!("chunk slot {slot} is handed to the daemon already"),
        )),
        Some(false) => Ok(()),
    }
}

/// Runs a whole export of snapshot `snapshot_id`: every chunk goes to
/// `sink` in order, read in place while the daemon fills the next slots.
/// Needs a session with chunk slots and nothing in flight
/// (`STATOR_E_INVALID_STATE` otherwise). `*chunks` (may be NULL) gets the
/// chunk count. A sink that returns non-zero cancels the export:
/// `STATOR_E_CALLBACK`.
///
/// # Safety
/// `session` from `stator_open` and not freed; `sink` is a function safe
/// to call with `ctx`; `chunks` is NULL or writable. One thread at a time;
/// the sink must not call into this session.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_export_snapshot(
    session: *mut stator_session,
    snapshot_id: u64,
    sink: stator_chunk_sink,
    ctx: *mut c_void,
    chunks: *mut u32,
) -> i32 {
    with(session, |i| {
        let sink = sink.ok_or_else(|| Fail::null("sink"))?;
        let s = i.session()?;
        idle(s)?;
        let mut refused = 0;
        let r = s.export_snapshot(snapshot_id, |c| {
            // SAFETY: the caller vouches for `sink` with `ctx`; the chunk is
            // readable for `len` bytes during the call.
            match unsafe { sink(ctx, c.as_ptr(), c.len()) } {
                0 => Ok(()),
                rc => {
                    refused = rc;
                    Err(std::io::Error::other(format!("the sink returned {rc}")))
                }
            }
        });
        match r {
            Ok(n) => {
                // SAFETY: NULL (skipped) or writable, by the caller's contract.
                if let Some(c) = unsafe { chunks.as_mut() } {
                    *c = n;
                }
                Ok(STATOR_OK)
            }
            Err(_) if refused != 0 => Err(Fail::new(
                STATOR_E_CALLBACK,
                format!("the chunk sink returned {refused}; the export was cancelled"),
            )),
            Err(e) => Err(e.into()),
        }
    })
}

/// Runs a whole import as import `import_id`: `source` writes each chunk
/// in order straight into a free chunk slot; every slot is kept busy.
/// Needs a session with chunk slots and nothing in flight. `*records`
/// (may be NULL) gets the records installed. A bad chunk:
/// `STATOR_E_BAD_SNAPSHOT`; a source that fails (negative) or claims an
/// impossible length: `STATOR_E_CALLBACK`; chunks that end before the
/// snapshot's last one: `STATOR_E_PROTOCOL`. In every failure the import
/// is cancelled and nothing of it is installed.
///
/// # Safety
/// `session` from `stator_open` and not freed; `source` is a function
/// safe to call with `ctx`; `records` is NULL or writable. One thread at a
/// time; the source must not call into this session.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_import_snapshot(
    session: *mut stator_session,
    import_id: u64,
    source: stator_chunk_source,
    ctx: *mut c_void,
    records: *mut u64,
) -> i32 {
    with(session, |i| {
        let source = source.ok_or_else(|| Fail::null("source"))?;
        let s = i.session()?;
        idle(s)?;
        let mut failed: Option<String> = None;
        let r = s.import_snapshot_with(import_id, |s, slot| {
            let p = s.chunk_slot_ptr(slot)?;
            let mut len = 0usize;
            let cap = STATOR_CHUNK_SLOT_LEN as usize;
            // SAFETY: the caller vouches for `source` with `ctx`; the slot
            // is the client's (not handed over) and `cap` bytes long.
            let rc = unsafe { source(ctx, p.as_ptr(), cap, &mut len) };
            let why = match rc {
                0 => return Ok(false),
                1 if (1..=cap).contains(&len) => return Ok(true),
                1 => format!("the chunk source wrote {len} bytes into a {cap}-byte slot"),
                rc => format!("the chunk source returned {rc}"),
            };
            failed = Some(why.clone());
            Err(stator_client::Error::Protocol(why))
        });
        match r {
            Ok(n) => {
                // SAFETY: NULL (skipped) or writable, by the caller's contract.
                if let Some(c) = unsafe { records.as_mut() } {
                    *c = n;
                }
                Ok(STATOR_OK)
            }
            Err(_) if failed.is_some() => Err(Fail::new(
                STATOR_E_CALLBACK,
                format!("{}; the import was cancelled", failed.unwrap_or_default()),
            )),
            Err(e) => Err(e.into()),
        }
    })
}

fn idle(s: &stator_client::Session) -> Res<()> {
    if s.in_flight() > 0 || s.chunk_slots() == 0 {
        return Err(Fail::new(
            STATOR_E_INVALID_STATE,
            format!(
                "the snapshot helpers need a session with chunk slots ({}) and nothing in flight ({})",
                s.chunk_slots(),
                s.in_flight()
            ),
        ));
    }
    Ok(())
}
