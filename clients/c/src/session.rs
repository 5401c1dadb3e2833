//! The session handle: open, register, restore, submit, reap, wait, the
//! event fd, value reservations, close and free.
//!
//! A `stator_session` is used by one thread at a time. It may move between
//! threads; two threads in calls on the same session at once is the one
//! misuse the library detects rather than trusts: a call entering while
//! another runs gets `STATOR_E_IN_USE` and does nothing (an atomic flag,
//! not a lock, so no call ever waits on another thread).

use std::cell::UnsafeCell;
use std::ffi::c_char;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
use stator_client::{Kind, Opcode, OpenOptions, Request, Session};

use crate::keygroup::stator_bytes;
use crate::ptr::{bytes, input, out, string};
use crate::snapshot::STATOR_CHUNK_SLOT_LEN;
use crate::status::*;

/// `kind` of `stator_register`: a value state (get, put, delete).
pub const STATOR_KIND_VALUE: u32 = 0;
/// A list state (append, list get, list replace).
pub const STATOR_KIND_LIST: u32 = 1;
/// A map state (map get, put, remove, contains, iterate).
pub const STATOR_KIND_MAP: u32 = 2;

// Opcodes of `stator_request` (ring/PROTOCOL.md §5).
pub const STATOR_OP_NOP: u32 = 0;
pub const STATOR_OP_GET: u32 = 1;
pub const STATOR_OP_PUT: u32 = 2;
pub const STATOR_OP_DELETE: u32 = 3;
pub const STATOR_OP_LIST_APPEND: u32 = 4;
pub const STATOR_OP_LIST_GET: u32 = 5;
pub const STATOR_OP_LIST_REPLACE: u32 = 6;
pub const STATOR_OP_MAP_GET: u32 = 7;
pub const STATOR_OP_MAP_PUT: u32 = 8;
pub const STATOR_OP_MAP_REMOVE: u32 = 9;
pub const STATOR_OP_MAP_CONTAINS: u32 = 10;
pub const STATOR_OP_MAP_ITER: u32 = 11;
pub const STATOR_OP_CLEAR: u32 = 12;
pub const STATOR_OP_CHECKPOINT: u32 = 13;
pub const STATOR_OP_CHECKPOINT_NOTIFY: u32 = 14;
pub const STATOR_OP_SNAPSHOT_EXPORT: u32 = 15;
pub const STATOR_OP_SNAPSHOT_IMPORT: u32 = 16;
pub const STATOR_OP_CHUNK_RELEASE: u32 = 17;

/// `stator_request.flags`: resume a map iteration after `user_key`.
pub const STATOR_FLAG_ITER_RESUME: u32 = 2;

/// Map iteration modes (`mode` of `stator_map_iter`, `arg` of a
/// `STATOR_OP_MAP_ITER` request): user keys, values, or both (a key, then
/// its value).
pub const STATOR_ITER_KEYS: u32 = 1;
pub const STATOR_ITER_VALUES: u32 = 2;
pub const STATOR_ITER_ENTRIES: u32 = 3;

/// Checkpoint notifications (`kind` of `stator_checkpoint_notify`).
pub const STATOR_NOTIFY_COMPLETE: u32 = 1;
pub const STATOR_NOTIFY_ABORT: u32 = 2;
pub const STATOR_NOTIFY_SUBSUME: u32 = 3;

/// `stator_completion.flags`: more map entries follow (resume after the
/// page's cursor).
pub const STATOR_CQE_MORE: u32 = 2;
/// `stator_completion.flags`: the export's last chunk, or the import is
/// installed.
pub const STATOR_CQE_LAST: u32 = 4;

/// `stator_completion.slot` of a request that held no chunk slot.
pub const STATOR_NO_SLOT: u32 = u32::MAX;

/// How to open a session. Initialize with `stator_open_options_init`, then
/// set `job`, `operator_name` and what else differs from the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct stator_open_options {
    /// `sizeof(stator_open_options)` as the caller's header declares it
    /// (set by `stator_open_options_init`): lets a newer library accept an
    /// older caller's struct.
    pub size: u32,
    /// This subtask's index, in `0..parallelism` (default 0).
    pub subtask: u32,
    /// The job's name (NUL-terminated UTF-8; required).
    pub job: *const c_char,
    /// The operator's name (NUL-terminated UTF-8; required).
    pub operator_name: *const c_char,
    /// Subtasks of the operator (default 1).
    pub parallelism: u32,
    /// Key groups of the job (default 128; at most 32768).
    pub max_parallelism: u32,
    /// Submission and completion queue entries; 0: the daemon's default.
    pub sq_entries: u32,
    pub cq_entries: u32,
    /// Shared arena bytes for keys, values and results; 0: the daemon's
    /// default.
    pub arena_bytes: u64,
    /// Result buffer of a read that names no capacity (default 1024).
    pub read_capacity: u32,
    /// How long `stator_wait` spins before it sleeps, microseconds
    /// (default 50).
    pub spin_us: u32,
    /// 4 MiB chunk slots for portable snapshots; 0: the daemon's default.
    pub chunk_slots: u32,
    /// Must be 0.
    pub reserved: u32,
}

/// One request for `stator_submit`. Byte ranges are copied into shared
/// memory by the call (use `stator_value_reserve` to write a value in
/// place instead); zero-initialize unused fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct stator_request {
    /// A `STATOR_OP_*` code.
    pub opcode: u32,
    /// The state id from `stator_register` (keyed opcodes).
    pub state: u32,
    /// The key's key group (in the session's range; at most 65535).
    pub key_group: u32,
    /// `STATOR_FLAG_*` bits.
    pub flags: u32,
    pub key: stator_bytes,
    /// The namespace (Flink's window or `VoidNamespace`); may be empty.
    pub ns: stator_bytes,
    /// Map opcodes: the user key (the resume cursor of a map iteration).
    pub user_key: stator_bytes,
    /// Writes: the value (a list replace: encoded elements).
    pub value: stator_bytes,
    /// Reads: the result buffer's size; 0 takes the session's
    /// `read_capacity`.
    pub capacity: u32,
    /// Second argument (a notification kind, a chunk slot).
    pub arg2: u32,
    /// First argument (a checkpoint or snapshot id, an iteration mode).
    pub arg: u64,
}

/// A completed request, as `stator_reap` returns it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct stator_completion {
    /// The caller's `user_data` from the submit.
    pub user_data: u64,
    /// `STATOR_OK`, `STATOR_NOT_FOUND` or a negative request status.
    pub status: i32,
    /// `STATOR_CQE_*` bits.
    pub flags: u32,
    /// A read's result, or a chunk an export completion announced, both
    /// read in place in shared memory; NULL when there is none. A result
    /// stays valid until the next call on this session that reaps
    /// (`stator_reap`, `stator_export_snapshot`, `stator_import_snapshot`)
    /// or `stator_close`/`stator_free`; a chunk until its slot is handed
    /// back.
    pub value: *const u8,
    pub value_len: u32,
    /// With `STATOR_E_RESULT_TOO_LARGE`: the capacity the result needs;
    /// with a chunk: its length; else the value's length.
    pub len: u32,
    /// Map contains: 1 or 0; a map page: its entry count; an export chunk:
    /// its index; an installed import: the records imported.
    pub aux: u64,
    /// The chunk slot the request held (the caller's again now), or
    /// `STATOR_NO_SLOT`.
    pub slot: u32,
    pub reserved: u32,
}

/// A value buffer reserved in shared memory (`stator_value_reserve`):
/// write up to `capacity` bytes at `data`, then submit it with
/// `stator_submit_reserved` or give it back with `stator_value_release`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct stator_value_buffer {
    pub data: *mut u8,
    pub capacity: u32,
    /// Names the buffer in `stator_submit_reserved` and
    /// `stator_value_release`.
    pub id: u32,
}

const MAGIC: u64 = u64::from_le_bytes(*b"statorS1");
const FREED: u64 = u64::from_le_bytes(*b"freedS1!");

/// A session handle. Opaque.
///
/// The handle itself is never given back to the allocator: `stator_free`
/// drops the session inside it, marks it freed and keeps it for a later
/// `stator_open`. A call that races a free, or comes after it, reads the
/// mark and fails instead of reading freed memory (after the handle is
/// reused it reaches the new session, as a closed fd number would).
/// The session itself is boxed, so the handle is a few words and a call
/// given a pointer to something else reads only those to refuse it (with
/// the session inline, Rust's layout put the mark hundreds of bytes in,
/// past the end of a small object: the C test's 128-byte decoy crashed
/// when it ended a mapping).
pub struct stator_session {
    magic: AtomicU64,
    busy: AtomicBool,
    /// `None` while the handle is spare (freed).
    inner: UnsafeCell<Option<Box<Inner>>>,
}

// SAFETY: `inner` is touched only by the thread that holds `busy` (see
// `with`, `stator_free`, `new_handle`); the other fields are atomics.
unsafe impl Sync for stator_session {}

/// Freed handles, for reuse (reachable, so leak checkers stay quiet).
static SPARE: std::sync::Mutex<Vec<&'static stator_session>> = std::sync::Mutex::new(Vec::new());

fn spare() -> std::sync::MutexGuard<'static, Vec<&'static stator_session>> {
    SPARE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A handle holding `inner`: a spare one if any is free, else a new one.
fn new_handle(inner: Inner) -> *mut stator_session {
    let h = spare()
        .pop()
        // A spare handle a stale caller is still inside (against the
        // contract) stays out of use.
        .filter(|h| {
            h.busy
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        })
        .unwrap_or_else(|| {
            Box::leak(Box::new(stator_session {
                magic: AtomicU64::new(FREED),
                busy: AtomicBool::new(true),
                inner: UnsafeCell::new(None),
            }))
        });
    // SAFETY: this thread holds `busy` (taken above, or a new handle).
    unsafe { *h.inner.get() = Some(Box::new(inner)) };
    h.magic.store(MAGIC, Ordering::Release);
    h.busy.store(false, Ordering::Release);
    std::ptr::from_ref(h).cast_mut()
}

/// Takes the busy flag of the live session behind `s`.
///
/// # Safety
/// `s` is NULL or a pointer `stator_open` returned (handles are never
/// deallocated, so any such pointer stays readable).
unsafe fn enter<'a>(s: *mut stator_session) -> Res<Entered<'a>> {
    // SAFETY: the caller's contract above.
    let h = unsafe { input(s.cast_const(), "session")? };
    if h.magic.load(Ordering::Acquire) != MAGIC {
        return Err(Fail::arg(
            "not a live stator_session (freed, or never opened)",
        ));
    }
    if h.busy
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return Err(Fail::new(
            STATOR_E_IN_USE,
            "another thread is in a call on this session; a session is used by one thread at a time",
        ));
    }
    let e = Entered(h);
    // Freed between the check and the flag (a racing stator_free).
    if h.magic.load(Ordering::Acquire) != MAGIC {
        return Err(Fail::arg("the stator_session was freed"));
    }
    Ok(e)
}

pub(crate) struct Inner {
    /// `None` once closed.
    session: Option<Session>,
    /// A call panicked half-way: the session refuses further calls.
    poisoned: bool,
    /// The fd of `stator_event_fd`, made on first use.
    epoll: Option<Epoll>,
    /// `stator_arm` asked for a doorbell; the next reap or wait disarms.
    armed: bool,
}

impl Inner {
    pub(crate) fn session(&mut self) -> Res<&mut Session> {
        self.session
            .as_mut()
            .ok_or_else(|| Fail::new(STATOR_E_CLOSED, "the session is closed"))
    }

    fn disarm(&mut self) -> Res<()> {
        if std::mem::take(&mut self.armed) {
            self.session()?.disarm()?;
        }
        Ok(())
    }
}

// The session moves between threads with its caller (one at a time).
const _: () = {
    const fn send<T: Send>() {}
    send::<Session>();
};

/// The busy flag of a session, held; released on drop.
struct Entered<'a>(&'a stator_session);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

/// Runs `f` on the session behind `s`: checks the pointer, takes the
/// session's one-thread-at-a-time flag, and turns a failure or a panic
/// into a status code.
pub(crate) fn with(s: *mut stator_session, f: impl FnOnce(&mut Inner) -> Res<i32>) -> i32 {
    // SAFETY: the caller passes NULL or a pointer from `stator_open`
    // (each function's `# Safety`). `enter` does not panic.
    let e = match unsafe { enter(s) } {
        Ok(e) => e,
        Err(f) => return f.report(),
    };
    // SAFETY: the busy flag is ours until `e` drops, so nothing else
    // touches `inner`; the reference ends before it does.
    let inner = unsafe { &mut *e.0.inner.get() };
    let Some(inner) = inner.as_mut() else {
        return Fail::arg("the stator_session was freed").report();
    };
    if inner.poisoned {
        return Fail::new(
            STATOR_E_PANIC,
            "an earlier call on this session failed inside libstator; free it",
        )
        .report();
    }
    let inner: *mut Inner = &mut **inner;
    // One catch_unwind per call (the hot path's only one): a panic poisons
    // this session and becomes a status.
    // SAFETY: as above; the closure's reference ends with it.
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(unsafe { &mut *inner }))) {
        Ok(Ok(v)) => v,
        Ok(Err(f)) => f.report(),
        Err(p) => {
            // SAFETY: as above; the closure's reference is gone.
            unsafe { (*inner).poisoned = true };
            Fail::new(STATOR_E_PANIC, panic_message(&*p)).report()
        }
    }
}

fn with_session(s: *mut stator_session, f: impl FnOnce(&mut Session) -> Res<i32>) -> i32 {
    with(s, |i| f(i.session()?))
}

/// Fills `*options` with the defaults (subtask 0 of 1, max parallelism
/// 128, the daemon's queue and arena sizes, 1 KiB reads, 50 us spin) and
/// its `size`; `job` and `operator_name` are left NULL for the caller.
///
/// # Safety
/// `options` is NULL (`STATOR_E_NULL`) or points to a writable
/// `stator_open_options`. Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_open_options_init(options: *mut stator_open_options) -> i32 {
    guard(|| {
        // SAFETY: the caller passes NULL or a writable struct.
        let o = unsafe { out(options, "options")? };
        let d = OpenOptions::new("", "");
        *o = stator_open_options {
            size: size_of::<stator_open_options>() as u32,
            subtask: d.subtask,
            job: std::ptr::null(),
            operator_name: std::ptr::null(),
            parallelism: d.parallelism,
            max_parallelism: d.max_parallelism,
            sq_entries: d.sq_entries,
            cq_entries: d.cq_entries,
            arena_bytes: d.arena_bytes,
            read_capacity: d.read_capacity,
            spin_us: d.spin.as_micros() as u32,
            chunk_slots: d.chunk_slots,
            reserved: 0,
        };
        Ok(STATOR_OK)
    })
}

/// Reads the caller's options, of the size it says.
///
/// # Safety
/// `o` is NULL or points to `o->size` readable bytes.
unsafe fn read_options(o: *const stator_open_options) -> Res<OpenOptions> {
    // SAFETY: the caller passes NULL or a readable struct.
    let o = unsafe { input(o, "options")? };
    let ours = size_of::<stator_open_options>();
    let size = o.size as usize;
    if size < ours {
        return Err(Fail::arg(format!(
            "options.size is {size}, not sizeof(stator_open_options) ({ours}): call stator_open_options_init"
        )));
    }
    if size > ours {
        // A newer header's struct: what this library does not know of must
        // be zero (unset), else the caller asks for what it cannot do.
        // SAFETY: the caller declares `size` readable bytes at `o`.
        let tail = unsafe {
            std::slice::from_raw_parts(
                (o as *const stator_open_options).cast::<u8>().add(ours),
                size - ours,
            )
        };
        if tail.iter().any(|b| *b != 0) {
            return Err(Fail::arg(
                "options set fields this libstator does not know (a newer stator.h?)",
            ));
        }
    }
    if o.reserved != 0 {
        return Err(Fail::arg("options.reserved must be 0"));
    }
    // SAFETY: NULL or NUL-terminated strings, by the caller's contract.
    let (job, op) = unsafe {
        (
            string(o.job, "options.job")?,
            string(o.operator_name, "options.operator_name")?,
        )
    };
    let mut r = OpenOptions::new(job, op);
    r.subtask = o.subtask;
    r.parallelism = o.parallelism;
    r.max_parallelism = o.max_parallelism;
    r.sq_entries = o.sq_entries;
    r.cq_entries = o.cq_entries;
    r.arena_bytes = o.arena_bytes;
    r.read_capacity = o.read_capacity;
    r.spin = Duration::from_micros(o.spin_us as u64);
    r.chunk_slots = o.chunk_slots;
    Ok(r)
}

/// Connects to `statord` at `socket_path` (its control socket, by default
/// `<run dir>/stator.sock`) and opens a session for one subtask; sets
/// `*session`. The daemon assigns the subtask's key-group range
/// (`stator_session_key_groups`). Returns `STATOR_OK`, or
/// `STATOR_E_CONNECT` (no daemon there), `STATOR_E_REFUSED` (the daemon
/// said no: see `stator_last_error()`), `STATOR_E_NULL`,
/// `STATOR_E_INVALID_ARGUMENT` (options), `STATOR_E_PROTOCOL`. On an
/// error `*session` is left unchanged.
///
/// The session is the caller's until `stator_free`; it holds a socket,
/// a shared mapping and two fds.
///
/// # Safety
/// `socket_path` is NULL or a NUL-terminated string; `options` is NULL or
/// points to a `stator_open_options` whose `size` bytes are readable (set
/// by `stator_open_options_init`), with `job` and `operator_name`
/// NUL-terminated strings; `session` is NULL or writable. Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_open(
    socket_path: *const c_char,
    options: *const stator_open_options,
    session: *mut *mut stator_session,
) -> i32 {
    guard(|| {
        // SAFETY: the caller's contract above.
        let (path, o, slot) = unsafe {
            (
                string(socket_path, "socket_path")?,
                read_options(options)?,
                out(session, "session")?,
            )
        };
        let s = Session::open(path, &o)?;
        *slot = new_handle(Inner {
            session: Some(s),
            poisoned: false,
            epoll: None,
            armed: false,
        });
        Ok(STATOR_OK)
    })
}

/// Closes the session: the daemon drops it (its state stays, for this or
/// a later session of the same subtask), and requests still in flight are
/// abandoned. The shared memory is unmapped: pointers into results,
/// reservations and chunk slots are invalid from here on. The handle
/// stays valid: later calls return `STATOR_E_CLOSED` until `stator_free`. Returns `STATOR_OK`, or the
/// daemon's failure (the session is closed on this side either way), or
/// `STATOR_E_CLOSED` if it was closed already.
///
/// # Safety
/// `session` is NULL or from `stator_open` and not freed. One thread at a
/// time (`STATOR_E_IN_USE` otherwise).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_close(session: *mut stator_session) -> i32 {
    with(session, |i| {
        let s = i
            .session
            .take()
            .ok_or_else(|| Fail::new(STATOR_E_CLOSED, "the session is closed already"))?;
        i.epoll = None;
        i.armed = false;
        s.close()?;
        Ok(STATOR_OK)
    })
}

/// Frees the session (closing it first if it is open, without waiting for
/// the daemon's answer). NULL is a no-op returning `STATOR_OK`. Pointers
/// into its results, reservations and chunk slots are invalid afterwards.
/// The handle is marked freed: a later call with it fails with
/// `STATOR_E_INVALID_ARGUMENT` until a later `stator_open` reuses it.
/// Returns `STATOR_E_IN_USE` (and frees nothing) if another thread is in a
/// call on it. A session poisoned by `STATOR_E_PANIC` can be freed.
///
/// # Safety
/// `session` is NULL or a pointer `stator_open` returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_free(session: *mut stator_session) -> i32 {
    if session.is_null() {
        return STATOR_OK;
    }
    guard(|| {
        // SAFETY: the caller's contract above.
        let e = unsafe { enter(session)? };
        e.0.magic.store(FREED, Ordering::Release);
        // SAFETY: the busy flag is ours (`e`), so nothing else touches
        // `inner`.
        let old = unsafe { (*e.0.inner.get()).take() };
        let h = e.0;
        drop(e);
        spare().push(h);
        drop(old);
        Ok(STATOR_OK)
    })
}

/// The daemon's id of this session (`*id`).
///
/// # Safety
/// `session` as for `stator_close`; `id` is NULL or writable. One thread
/// at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_session_id(session: *mut stator_session, id: *mut u64) -> i32 {
    with_session(session, |s| {
        // SAFETY: NULL or writable, by the caller's contract.
        *unsafe { out(id, "id")? } = s.id();
        Ok(STATOR_OK)
    })
}

/// This session's inclusive key-group range `[*first, *last]` (what the
/// daemon computed from subtask, parallelism and max parallelism).
///
/// # Safety
/// `session` as for `stator_close`; `first` and `last` are NULL or
/// writable. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_session_key_groups(
    session: *mut stator_session,
    first: *mut u32,
    last: *mut u32,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: NULL or writable, by the caller's contract.
        let (f, l) = unsafe { (out(first, "first")?, out(last, "last")?) };
        (*f, *l) = (s.key_groups().0 as u32, s.key_groups().1 as u32);
        Ok(STATOR_OK)
    })
}

/// Requests submitted and not completed yet (>= 0), or an error.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_in_flight(session: *mut stator_session) -> i32 {
    with_session(session, |s| Ok(s.in_flight().min(i32::MAX as usize) as i32))
}

/// Registers (or finds) a state named `name` of `kind`
/// (`STATOR_KIND_*`) for this session's operator; sets `*state_id` for
/// requests. Registering the same name again returns the same id; a name
/// registered with another kind is refused (`STATOR_E_REFUSED`).
///
/// # Safety
/// `session` as for `stator_close`; `name` is NULL or a NUL-terminated
/// string; `state_id` is NULL or writable. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_register(
    session: *mut stator_session,
    name: *const c_char,
    kind: u32,
    state_id: *mut u32,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: the caller's contract above.
        let (name, id) = unsafe { (string(name, "name")?, out(state_id, "state_id")?) };
        let kind = match kind {
            STATOR_KIND_VALUE => Kind::Value,
            STATOR_KIND_LIST => Kind::List,
            STATOR_KIND_MAP => Kind::Map,
            k => return Err(Fail::arg(format!("kind {k} is not a STATOR_KIND_*"))),
        };
        *id = s.register(name, kind)?;
        Ok(STATOR_OK)
    })
}

/// Replaces this session's state (its operator's states in its key-group
/// range) with what the checkpoint handles hold of that range: the
/// handles (bytes a checkpoint completion returned) of the previous run's
/// subtasks whose ranges overlap this one. Segments are referenced, not
/// copied. Call it before submitting requests. A handle of another job or
/// operator, altered, or no longer retained is refused
/// (`STATOR_E_REFUSED`, the reason in `stator_last_error()`) and nothing
/// changes. `*checkpoints` and `*layers` (each may be NULL) get the
/// checkpoints used and segment references added.
///
/// # Safety
/// `session` as for `stator_close`; `handles` points to `count`
/// `stator_bytes` (NULL only with `count` 0), each valid for its length;
/// `checkpoints` and `layers` are NULL or writable. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_restore(
    session: *mut stator_session,
    handles: *const stator_bytes,
    count: usize,
    checkpoints: *mut u32,
    layers: *mut u32,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: the caller's contract above.
        let hs = unsafe { handle_list(handles, count)? };
        let r = s.restore(&hs)?;
        // SAFETY: NULL (skipped) or writable, by the caller's contract.
        unsafe {
            if let Some(c) = checkpoints.as_mut() {
                *c = r.checkpoints;
            }
            if let Some(l) = layers.as_mut() {
                *l = r.layers;
            }
        }
        Ok(STATOR_OK)
    })
}

/// `count` handles from `handles`, borrowed.
///
/// # Safety
/// `handles` points to `count` `stator_bytes` (NULL only with `count` 0),
/// each valid for its length.
unsafe fn handle_list<'a>(handles: *const stator_bytes, count: usize) -> Res<Vec<&'a [u8]>> {
    if count > 0 && handles.is_null() {
        return Err(Fail::null("handles"));
    }
    if !handles.is_aligned() {
        return Err(Fail::arg("handles is misaligned"));
    }
    if count > 4096 {
        return Err(Fail::arg(format!("{count} handles is more than 4096")));
    }
    let mut hs: Vec<&[u8]> = Vec::with_capacity(count);
    for i in 0..count {
        // SAFETY: `handles` holds `count` readable entries, each a valid
        // byte range, by the caller's contract.
        let h = unsafe { &*handles.add(i) };
        // SAFETY: as above.
        hs.push(unsafe { bytes(h.data, h.len, "a handle")? });
    }
    Ok(hs)
}

/// Tells the daemon at `socket_path` that the engine no longer references
/// the checkpoints `handles` of `job`'s `operator_name` (it discarded
/// them), completed or not, with no session and no claim of the job (the
/// caller's uid must own it); `*released` (may be NULL) gets how many the
/// daemon held and deleted. A handle of another daemon, or of a
/// checkpoint already gone, deletes nothing; one that does not decode
/// refuses the whole release (`STATOR_E_REFUSED`).
///
/// # Safety
/// `socket_path`, `job` and `operator_name` are NUL-terminated strings;
/// `handles` as for `stator_restore`; `released` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_release_checkpoints(
    socket_path: *const c_char,
    job: *const c_char,
    operator_name: *const c_char,
    handles: *const stator_bytes,
    count: usize,
    released: *mut u32,
) -> i32 {
    guard(|| {
        // SAFETY: the caller's contract above.
        let (path, job, op, hs) = unsafe {
            (
                string(socket_path, "socket_path")?,
                string(job, "job")?,
                string(operator_name, "operator_name")?,
                handle_list(handles, count)?,
            )
        };
        let n = stator_client::release_checkpoints(path, job, op, &hs)?;
        // SAFETY: NULL (skipped) or writable, by the caller's contract.
        if let Some(r) = unsafe { released.as_mut() } {
            *r = n;
        }
        Ok(STATOR_OK)
    })
}

/// The request a C `stator_request` describes, its byte ranges borrowed.
///
/// # Safety
/// Each range of `r` is NULL with length 0 or valid for its length.
unsafe fn request<'a>(r: &stator_request) -> Res<Request<'a>> {
    let op = u8::try_from(r.opcode)
        .ok()
        .and_then(Opcode::from_u8)
        .ok_or_else(|| Fail::arg(format!("opcode {} is not a STATOR_OP_*", r.opcode)))?;
    let key_group = u16::try_from(r.key_group)
        .map_err(|_| Fail::arg(format!("key group {} is over 65535", r.key_group)))?;
    let flags = u8::try_from(r.flags)
        .map_err(|_| Fail::arg(format!("flags {:#x} are not STATOR_FLAG_* bits", r.flags)))?;
    // SAFETY: the caller's contract above.
    let (key, namespace, user_key, value) = unsafe {
        (
            bytes(r.key.data, r.key.len, "key")?,
            bytes(r.ns.data, r.ns.len, "ns")?,
            bytes(r.user_key.data, r.user_key.len, "user_key")?,
            bytes(r.value.data, r.value.len, "value")?,
        )
    };
    Ok(Request {
        op,
        state: r.state,
        key_group,
        key,
        namespace,
        user_key,
        value,
        capacity: r.capacity,
        arg: r.arg,
        arg2: r.arg2,
        flags,
    })
}

fn submitted(r: Res<()>) -> Res<i32> {
    r.map(|()| STATOR_OK)
}

/// Queues one request; it becomes visible to the daemon at the next
/// `stator_flush` (or wait), and completes with `user_data` in a later
/// `stator_reap`. Byte ranges are copied into shared memory: the caller
/// may reuse them when this returns. Returns `STATOR_OK`, or
/// `STATOR_E_FULL` (the submission queue or the arena is full: reap, then
/// retry), `STATOR_E_REQUEST_TOO_LARGE`, `STATOR_E_INVALID_ARGUMENT`
/// (opcode, key group, flags), `STATOR_E_NULL` (a range with a length
/// and no data), `STATOR_E_INVALID_STATE` (a chunk slot held by the
/// daemon), `STATOR_E_DAEMON_GONE`, `STATOR_E_CLOSED`. What the daemon
/// thinks of the request (an unknown state, a key group outside the
/// range) comes back in its completion.
///
/// # Safety
/// `session` as for `stator_close`; `req` is NULL or points to a
/// `stator_request` whose byte ranges are NULL with length 0 or readable
/// for their lengths. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_submit(
    session: *mut stator_session,
    req: *const stator_request,
    user_data: u64,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: the caller's contract above.
        let r = unsafe { request(input(req, "req")?)? };
        check_slot(s, &r)?;
        submitted(s.submit(&r, user_data).map_err(Fail::from))
    })
}

/// A chunk-slot request on a slot that is not the client's is the
/// caller's mistake, refused here rather than by the daemon.
fn check_slot(s: &Session, r: &Request<'_>) -> Res<()> {
    if matches!(r.op, Opcode::SnapshotImport | Opcode::ChunkRelease) && r.arg2 != STATOR_NO_SLOT {
        crate::snapshot::check_slot(s, r.arg2)?;
    }
    Ok(())
}

/// Arguments common to the keyed submit helpers.
struct Keyed {
    op: Opcode,
    state: u32,
    key_group: u32,
    key: stator_bytes,
    ns: stator_bytes,
}

/// Submits a keyed request built straight from a helper's arguments (no
/// `stator_request` to parse: the opcode is the helper's own).
fn keyed(
    session: *mut stator_session,
    k: Keyed,
    user_key: stator_bytes,
    value: stator_bytes,
    arg: u64,
    flags: u8,
    user_data: u64,
) -> i32 {
    with_session(session, |s| {
        let key_group = u16::try_from(k.key_group)
            .map_err(|_| Fail::arg(format!("key group {} is over 65535", k.key_group)))?;
        // SAFETY: the helpers' callers promise their ranges as for
        // `stator_submit`.
        let (key, namespace, user_key, value) = unsafe {
            (
                bytes(k.key.data, k.key.len, "key")?,
                bytes(k.ns.data, k.ns.len, "ns")?,
                bytes(user_key.data, user_key.len, "user_key")?,
                bytes(value.data, value.len, "value")?,
            )
        };
        let r = Request {
            op: k.op,
            state: k.state,
            key_group,
            key,
            namespace,
            user_key,
            value,
            capacity: 0,
            arg,
            arg2: 0,
            flags,
        };
        submitted(s.submit(&r, user_data).map_err(Fail::from))
    })
}

fn b(data: *const u8, len: usize) -> stator_bytes {
    stator_bytes { data, len }
}

const NONE: stator_bytes = stator_bytes::EMPTY;

/// Value state: reads the value of (key, ns). Completes `STATOR_OK`
/// with the value, or `STATOR_NOT_FOUND`.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_get(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::Get,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, NONE, 0, 0, user_data)
}

/// Value state: writes `value` under (key, ns).
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_put(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    value: *const u8,
    value_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::Put,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, b(value, value_len), 0, 0, user_data)
}

/// Value state: deletes the value of (key, ns).
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_delete(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::Delete,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, NONE, 0, 0, user_data)
}

/// List state: appends `element` to the list of (key, ns).
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_list_append(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    element: *const u8,
    element_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::ListAppend,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, b(element, element_len), 0, 0, user_data)
}

/// List state: reads every element, encoded (walk them with
/// `stator_elements_next`); `STATOR_NOT_FOUND` for an empty list.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_list_get(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::ListGet,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, NONE, 0, 0, user_data)
}

/// List state: replaces the list with `encoded` elements (`u32` LE
/// length, then the bytes, for each).
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_list_replace(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    encoded: *const u8,
    encoded_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::ListReplace,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, b(encoded, encoded_len), 0, 0, user_data)
}

/// Map state: reads the value under `user_key`.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_map_get(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_key: *const u8,
    user_key_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::MapGet,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, b(user_key, user_key_len), NONE, 0, 0, user_data)
}

/// Map state: writes `value` under `user_key`.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_map_put(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_key: *const u8,
    user_key_len: usize,
    value: *const u8,
    value_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::MapPut,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(
        session,
        k,
        b(user_key, user_key_len),
        b(value, value_len),
        0,
        0,
        user_data,
    )
}

/// Map state: removes `user_key`.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_map_remove(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_key: *const u8,
    user_key_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::MapRemove,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, b(user_key, user_key_len), NONE, 0, 0, user_data)
}

/// Map state: completes with `aux` 1 if `user_key` is present, else 0.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_map_contains(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_key: *const u8,
    user_key_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::MapContains,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, b(user_key, user_key_len), NONE, 0, 0, user_data)
}

/// Any state: removes everything of (key, ns): a value, a whole list
/// or a whole map.
///
/// # Safety
/// As for `stator_submit`: `session` from `stator_open` and not freed;
/// each byte range NULL with length 0 or readable for its length. One
/// thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_clear(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    user_data: u64,
) -> i32 {
    let k = Keyed {
        op: Opcode::Clear,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(session, k, NONE, NONE, 0, 0, user_data)
}

/// Map state: one page of the map of (key, ns) in user-key order, `mode`
/// a `STATOR_ITER_*`. `after` NULL starts at the first entry; otherwise
/// the page resumes after that user key (the `resume_after` of the
/// previous page, from `stator_page_split`). The completion has
/// `STATOR_CQE_MORE` while entries follow; `aux` is the page's entry
/// count.
///
/// # Safety
/// As for `stator_submit`; `after` is NULL or readable for `after_len`
/// bytes. One thread at a time.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn stator_map_iter(
    session: *mut stator_session,
    state: u32,
    key_group: u32,
    key: *const u8,
    key_len: usize,
    ns: *const u8,
    ns_len: usize,
    mode: u32,
    after: *const u8,
    after_len: usize,
    user_data: u64,
) -> i32 {
    if !(STATOR_ITER_KEYS..=STATOR_ITER_ENTRIES).contains(&mode) {
        return Fail::arg(format!("mode {mode} is not a STATOR_ITER_*")).report();
    }
    let flags = if after.is_null() {
        0
    } else {
        STATOR_FLAG_ITER_RESUME as u8
    };
    let k = Keyed {
        op: Opcode::MapIter,
        state,
        key_group,
        key: b(key, key_len),
        ns: b(ns, ns_len),
    };
    keyed(
        session,
        k,
        b(after, after_len),
        NONE,
        mode as u64,
        flags,
        user_data,
    )
}

/// A checkpoint barrier with id `checkpoint_id`: it takes effect after
/// every request submitted before it, and completes with the checkpoint's
/// handle as its value (bytes to keep in the engine's checkpoint
/// metadata; give them to `stator_restore`).
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_checkpoint(
    session: *mut stator_session,
    checkpoint_id: u64,
    user_data: u64,
) -> i32 {
    with_session(session, |s| {
        submitted(
            s.submit(&Request::checkpoint(checkpoint_id), user_data)
                .map_err(Fail::from),
        )
    })
}

/// Tells the daemon that checkpoint `checkpoint_id` was completed,
/// aborted or subsumed (`kind`, a `STATOR_NOTIFY_*`): what stays on disk
/// follows.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_checkpoint_notify(
    session: *mut stator_session,
    checkpoint_id: u64,
    kind: u32,
    user_data: u64,
) -> i32 {
    with_session(session, |s| {
        let kind = match kind {
            STATOR_NOTIFY_COMPLETE => stator_client::Notify::Complete,
            STATOR_NOTIFY_ABORT => stator_client::Notify::Abort,
            STATOR_NOTIFY_SUBSUME => stator_client::Notify::Subsume,
            k => return Err(Fail::arg(format!("kind {k} is not a STATOR_NOTIFY_*"))),
        };
        submitted(
            s.submit(&Request::checkpoint_notify(checkpoint_id, kind), user_data)
                .map_err(Fail::from),
        )
    })
}

/// Makes every request submitted so far visible to the daemon (one
/// store) and wakes it if it sleeps.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_flush(session: *mut stator_session) -> i32 {
    with_session(session, |s| submitted(s.flush().map_err(Fail::from)))
}

/// Reaps up to `max` completions ready now into `out[0..n]`; returns `n`
/// (0 when none is ready), or a negative status. Results are read in place
/// in shared memory (no copy): a completion's `value` stays valid until
/// the next call that reaps (or close/free), an export chunk's until its
/// slot is handed back. Ends an `stator_arm`.
///
/// # Safety
/// `session` as for `stator_close`; `out` points to `max` writable
/// `stator_completion`s (NULL only with `max` 0). One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_reap(
    session: *mut stator_session,
    out: *mut stator_completion,
    max: usize,
) -> i32 {
    with(session, |i| {
        if max > 0 && out.is_null() {
            return Err(Fail::null("out"));
        }
        if !out.is_aligned() {
            return Err(Fail::arg("out is misaligned"));
        }
        i.disarm()?;
        let max = max.min(i32::MAX as usize);
        let s = i.session()?;
        let mut n = 0usize;
        // Export chunks reaped (entry, slot): pointed at once the poll ends.
        let mut chunks: Vec<(usize, u32)> = Vec::new();
        s.poll_in_place(max, |c, at| {
            let slot = c.slot.unwrap_or(STATOR_NO_SLOT);
            let status = match c.status {
                Ok(st) => st as i32,
                Err(code) => code,
            };
            let mut flags = 0;
            if c.more {
                flags |= STATOR_CQE_MORE;
            }
            if c.last {
                flags |= STATOR_CQE_LAST;
            }
            // An export chunk (an import's completion has no length).
            if slot != STATOR_NO_SLOT
                && status == STATOR_OK
                && c.len > 0
                && c.len <= STATOR_CHUNK_SLOT_LEN
            {
                chunks.push((n, slot));
            }
            let (value, value_len) = match at {
                Some(p) => (p.as_ptr().cast_const(), c.len),
                None => (std::ptr::null(), 0),
            };
            // SAFETY: `out` holds `max` writable entries (checked non-NULL
            // above) and `n < max` (poll_in_place delivers at most `max`).
            unsafe {
                out.add(n).write(stator_completion {
                    user_data: c.token,
                    status,
                    flags,
                    value,
                    value_len,
                    len: if c.needed > 0 { c.needed } else { c.len },
                    aux: c.aux,
                    slot,
                    reserved: 0,
                })
            };
            n += 1;
        })?;
        for (k, slot) in chunks {
            // The slot is the client's again (its request completed), so
            // this cannot be refused; if it were, the value stays NULL.
            if let Ok(p) = s.chunk_slot_ptr(slot) {
                // SAFETY: entry `k < n` was written above.
                let c = unsafe { &mut *out.add(k) };
                c.value = p.as_ptr();
                c.value_len = c.len;
            }
        }
        Ok(n as i32)
    })
}

/// Waits until a completion is ready, at most `timeout_ms` milliseconds
/// (negative: no limit). Spins for the session's `spin_us`, then sleeps on
/// the doorbell. Returns `STATOR_OK` (reap now), `STATOR_E_TIMED_OUT`, or
/// `STATOR_E_DAEMON_GONE` when the daemon stops or dies meanwhile. Flush
/// before waiting on requests just submitted.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_wait(session: *mut stator_session, timeout_ms: i32) -> i32 {
    with(session, |i| {
        i.disarm()?;
        let s = i.session()?;
        let timeout = (timeout_ms >= 0).then(|| Duration::from_millis(timeout_ms as u64));
        s.wait(timeout)?;
        if s.ready()? > 0 {
            Ok(STATOR_OK)
        } else {
            Err(Fail::new(
                STATOR_E_TIMED_OUT,
                format!("no completion within {timeout_ms} ms"),
            ))
        }
    })
}

/// An fd for the caller's own event loop (epoll, poll, select): readable
/// when completions may be ready or the daemon closed the session, once
/// the session is armed (`stator_arm`). The loop: flush; if
/// `stator_arm` returns 1, reap now; else wait for the fd, then reap
/// (which disarms). Level-triggered; the fd is the session's (do not
/// close it; remove it from your epoll set before `stator_close` or
/// `stator_free` close it). Returns the fd (>= 0) or a negative status.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_event_fd(session: *mut stator_session) -> i32 {
    with(session, |i| {
        if i.epoll.is_none() {
            let s = i.session()?;
            let sys = |e: nix::errno::Errno| Fail::new(STATOR_E_SYSTEM, format!("epoll: {e}"));
            let ep = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC).map_err(sys)?;
            for (k, fd) in s.event_fds().into_iter().enumerate() {
                ep.add(fd, EpollEvent::new(EpollFlags::EPOLLIN, k as u64))
                    .map_err(sys)?;
            }
            i.epoll = Some(ep);
        }
        Ok(i.epoll.as_ref().expect("made above").0.as_fd().as_raw_fd())
    })
}

/// Arms the session's doorbell before the caller sleeps on
/// `stator_event_fd`: returns 1 when completions are ready already (do not
/// sleep; reap), 0 when armed (sleep on the fd), or a negative status.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_arm(session: *mut stator_session) -> i32 {
    with(session, |i| {
        i.disarm()?;
        // Ready already: the flag is cleared again, nothing to undo.
        if i.session()?.arm()? {
            Ok(1)
        } else {
            i.armed = true;
            Ok(0)
        }
    })
}

/// Ends an `stator_arm` without reaping (reap and wait do it themselves):
/// drains the doorbell, and returns `STATOR_E_DAEMON_GONE` if the daemon
/// closed the session.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_disarm(session: *mut stator_session) -> i32 {
    with(session, |i| {
        i.session()?;
        i.disarm()?;
        Ok(STATOR_OK)
    })
}

/// Reserves a value buffer of `capacity` bytes in shared memory: write
/// the value at `out->data`, then submit it with `stator_submit_reserved`
/// (no copy), or give it back with `stator_value_release`. Returns
/// `STATOR_OK`, or `STATOR_E_FULL` (reap completions, then retry).
/// `out->data` stays valid until the buffer is submitted or released, or
/// the session is closed or freed.
///
/// # Safety
/// `session` as for `stator_close`; `out` is NULL or writable. One thread
/// at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_value_reserve(
    session: *mut stator_session,
    capacity: u32,
    out_buf: *mut stator_value_buffer,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: NULL or writable, by the caller's contract.
        let o = unsafe { out(out_buf, "out")? };
        let r = s.reserve_value(capacity)?;
        let p = s.reservation_ptr(r.id).expect("reserved just now");
        *o = stator_value_buffer {
            data: p.as_ptr(),
            capacity: r.cap,
            id: r.id,
        };
        Ok(STATOR_OK)
    })
}

/// Queues a write (`req` with a `STATOR_OP_*` that takes a value; its
/// `value` range is ignored) whose value is the first `len` bytes of
/// reserved buffer `id`. The request owns the buffer from here on (do not
/// touch it again). On an error the buffer stays the caller's (retry
/// after `STATOR_E_FULL`, or release it). Errors as for `stator_submit`,
/// plus `STATOR_E_INVALID_ARGUMENT` for an opcode without a value, an id
/// not reserved, or `len` over the capacity.
///
/// # Safety
/// As for `stator_submit`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_submit_reserved(
    session: *mut stator_session,
    req: *const stator_request,
    id: u32,
    len: u32,
    user_data: u64,
) -> i32 {
    with_session(session, |s| {
        // SAFETY: NULL or a readable request, by the caller's contract;
        // its value range is ignored (never read).
        let mut c = *unsafe { input(req, "req")? };
        c.value = stator_bytes::EMPTY;
        // SAFETY: the other ranges as for `stator_submit`.
        let r = unsafe { request(&c)? };
        if !r.op.fields().value_in {
            return Err(Fail::arg(format!("{:?} takes no value", r.op)));
        }
        match s.reservation_cap(id) {
            None => return Err(Fail::arg(format!("no value buffer {id} is reserved"))),
            Some(cap) if len > cap => {
                return Err(Fail::arg(format!("{len} bytes exceed the {cap} reserved")));
            }
            Some(_) => {}
        }
        submitted(
            s.submit_reserved(&r, user_data, id, len)
                .map_err(Fail::from),
        )
    })
}

/// Gives reserved buffer `id` back unused.
///
/// # Safety
/// `session` as for `stator_close`. One thread at a time.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_value_release(session: *mut stator_session, id: u32) -> i32 {
    with_session(session, |s| {
        s.release_reserved(id)
            .map_err(|_| Fail::arg(format!("no value buffer {id} is reserved")))?;
        Ok(STATOR_OK)
    })
}
