//! `stator-jni`: the native half of the `stator-flink` jar
//! (`libstator_jni.so`), over `stator-client`.
//!
//! The Java side (`io.stator.flink.jni.StatorJni`, native methods only)
//! serializes keys and values itself, straight into a region of the
//! session's shared arena that it owns (a direct buffer over the arena),
//! and describes each request as a 64-byte command in a private direct
//! buffer; one `call` submits a batch of commands, publishes them, waits
//! if asked, and writes the ready completions back as 32-byte records.
//! Results are read in place in the arena. So a write costs no JNI call
//! (it rides with the next batch), a read one, and no byte is copied on
//! either side (`wire` has the layouts).
//!
//! Every native method takes and returns primitives: addresses and
//! lengths of direct buffers, handles, ids and status codes. Arguments
//! that are not numbers (socket path, names, checkpoint handles) travel
//! in the caller's scratch buffer as an argument block, and a failure is a
//! negative code whose details `error` writes into it (`error` module).
//! Nothing throws across the boundary and no panic unwinds into the JVM
//! (each call catches them: `ERR_PANIC`).
//!
//! It must never trust a handle it did not make: a handle is checked for
//! 0 and used by one thread at a time (`ffi::Handle`), but a freed or
//! forged non-zero handle is the Java side's bug, which its session class
//! rules out (it hands out no handle and frees once, under a lock).

mod error;
mod export;
mod ffi;
mod session;
mod sleeper;
pub mod wire;

use jni_sys::{JNIEnv, jboolean, jclass, jint, jlong, jobject};

pub use error::{
    ERR_ARGUMENT, ERR_CONNECT, ERR_FULL, ERR_GONE, ERR_PANIC, ERR_PROTOCOL, ERR_REFUSED,
    ERR_STATUS, ERR_TOO_LARGE, Fail,
};
use ffi::{Handle, JavaBuf, SleeperHandle};
pub use session::JniSession;

/// What `exportNext` returns once the stream has ended.
pub const EXPORT_END: jlong = jlong::MAX;

/// Runs `f`, turning a failure or a panic into a negative code.
fn guard<T>(on_fail: impl Fn(i32) -> T, f: impl FnOnce() -> Result<T, Fail>) -> T {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => on_fail(e.report()),
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            on_fail(Fail::new(ERR_PANIC, format!("libstator_jni failed: {msg}")).report())
        }
    }
}

/// Runs `f` on the session behind `h`.
fn on<T>(h: jlong, f: impl FnOnce(&mut JniSession) -> Result<T, Fail>) -> Result<T, Fail> {
    Handle::with(h, f).map_err(Fail::arg)?
}

fn args(io: jlong, len: jint) -> Result<Vec<u8>, Fail> {
    Ok(JavaBuf::new(io, len.into())?.copy_out(len as usize)?)
}

/// Writes `bytes` into the scratch buffer; returns their length, or
/// `ERR_ARGUMENT` if they do not fit.
fn put(io: jlong, cap: jint, bytes: &[u8]) -> Result<jint, Fail> {
    let b = JavaBuf::new(io, cap.into())?;
    if bytes.len() > b.len() {
        return Err(Fail::arg(format!(
            "{} bytes do not fit a {}-byte scratch buffer",
            bytes.len(),
            b.len()
        )));
    }
    b.write(0, bytes)?;
    Ok(bytes.len() as jint)
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_address(
    env: *mut JNIEnv,
    _: jclass,
    buf: jobject,
) -> jlong {
    ffi::direct_buffer_address(env, buf)
}

/// This library's version (the workspace's), for the jar to compare.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_version(
    _: *mut JNIEnv,
    _: jclass,
    io: jlong,
    cap: jint,
) -> jint {
    guard(|c| c, || put(io, cap, env!("CARGO_PKG_VERSION").as_bytes()))
}

/// The error record of this thread's last failure (`wire` module doc);
/// returns its length (it is cut to `cap`).
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_error(
    _: *mut JNIEnv,
    _: jclass,
    io: jlong,
    cap: jint,
) -> jint {
    let mut rec = Fail::last_record();
    rec.truncate(cap.max(0) as usize);
    let n = rec.len() as u32;
    if rec.len() >= 12 {
        let msg = (n - 12).to_le_bytes();
        rec[8..12].copy_from_slice(&msg);
    }
    guard(|c| c, || put(io, cap, &rec))
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_open(
    _: *mut JNIEnv,
    _: jclass,
    io: jlong,
    len: jint,
) -> jlong {
    guard(jlong::from, || {
        Ok(Handle::into_jlong(JniSession::open(&args(io, len)?)?))
    })
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_register(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    io: jlong,
    len: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let a = args(io, len)?;
            on(h, |s| Ok(s.register(&a)? as jint))
        },
    )
}

/// Returns the segment references the restore added.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_restore(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    io: jlong,
    len: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let a = args(io, len)?;
            on(h, |s| Ok(s.restore(&a)? as jint))
        },
    )
}

/// Reserves the Java side's region; returns its arena offset.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_region(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    bytes: jint,
) -> jlong {
    guard(jlong::from, || {
        let bytes = u32::try_from(bytes).map_err(|_| Fail::arg("a negative region size"))?;
        on(h, |s| Ok(jlong::from(s.region(bytes)?)))
    })
}

/// A direct buffer over the session's whole arena (null on failure).
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_arena(
    env: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jobject {
    guard(
        |_| std::ptr::null_mut(),
        || {
            let (p, len) = on(h, |s| Ok(s.arena()))?;
            Ok(ffi::new_direct_buffer(env, p.as_ptr(), len))
        },
    )
}

/// A direct buffer over chunk slot `slot` (null on failure).
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_chunkSlot(
    env: *mut JNIEnv,
    _: jclass,
    h: jlong,
    slot: jint,
) -> jobject {
    guard(
        |_| std::ptr::null_mut(),
        || {
            let p = on(h, |s| s.chunk_slot(slot as u32))?;
            Ok(ffi::new_direct_buffer(
                env,
                p.as_ptr(),
                stator_ring::sqe::CHUNK_SLOT_LEN,
            ))
        },
    )
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_chunkSlots(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| Ok(s.s.chunk_slots() as jint)))
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_bind(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    commands: jlong,
    commands_len: jint,
    completions: jlong,
    completions_len: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let c = JavaBuf::new(commands, commands_len.into())?;
            let d = JavaBuf::new(completions, completions_len.into())?;
            on(h, |s| s.bind(c, d).map(|()| 0))
        },
    )
}

/// The hot path (`JniSession::call`): returns the completions written.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_call(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    count: jint,
    wait: jboolean,
) -> jint {
    guard(
        |c| c,
        || {
            let count = u32::try_from(count).map_err(|_| Fail::arg("a negative command count"))?;
            on(h, |s| Ok(s.call(count, wait)? as jint))
        },
    )
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_checkpoint(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    id: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| s.checkpoint(id as u64).map(|()| 0)))
}

/// Waits up to `timeout_ms` for checkpoint `id`; writes its handle into
/// the scratch buffer and returns the handle's length, or 0 if the
/// checkpoint is not durable yet.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_checkpointWait(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    id: jlong,
    timeout_ms: jint,
    io: jlong,
    cap: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let timeout = std::time::Duration::from_millis(timeout_ms.max(0) as u64);
            match on(h, |s| s.checkpoint_wait(id as u64, timeout))? {
                Some(handle) => put(io, cap, &handle),
                None => Ok(0),
            }
        },
    )
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_notifyCheckpoint(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    id: jlong,
    kind: jint,
) -> jint {
    guard(
        |c| c,
        || on(h, |s| s.notify(id as u64, kind as u32).map(|()| 0)),
    )
}

/// Releases checkpoints with no session (argument block: socket, job,
/// operator, handles); returns how many statord deleted.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_releaseCheckpoints(
    _: *mut JNIEnv,
    _: jclass,
    io: jlong,
    len: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let a = args(io, len)?;
            Ok(session::release(&a)? as jint)
        },
    )
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_reset(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    import_id: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| s.reset(import_id as u64).map(|()| 0)))
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_exportStart(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
    id: jlong,
    io: jlong,
    len: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let a = if len == 0 { Vec::new() } else { args(io, len)? };
            on(h, |s| s.export_start(id as u64, &a).map(|()| 0))
        },
    )
}

/// The next chunk as `slot << 32 | len`, or `EXPORT_END`.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_exportNext(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jlong {
    guard(jlong::from, || {
        on(h, |s| {
            Ok(match s.export_next()? {
                Some((slot, len)) => (jlong::from(slot) << 32) | jlong::from(len),
                None => EXPORT_END,
            })
        })
    })
}

#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_exportCancel(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| s.export_cancel().map(|()| 0)))
}

/// Streams `from`'s export into `to`'s import; returns the records
/// installed.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_transfer(
    _: *mut JNIEnv,
    _: jclass,
    from: jlong,
    to: jlong,
    id: jlong,
    io: jlong,
    len: jint,
) -> jlong {
    guard(jlong::from, || {
        if from == to {
            return Err(Fail::arg("a transfer needs two sessions"));
        }
        let a = if len == 0 { Vec::new() } else { args(io, len)? };
        on(from, |f| {
            on(to, |t| Ok(export::transfer(f, t, id as u64, &a)? as jlong))
        })
    })
}

/// Closes the session (statord drops it; its state stays) and frees it;
/// the handle is dead afterwards, whatever the outcome.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_close(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jint {
    guard(
        |c| c,
        || match Handle::free(h) {
            Some(s) => s.close().map(|()| 0),
            None => Ok(0),
        },
    )
}

/// Arms the doorbell for a sleeper: 1 if completions are ready already
/// (do not sleep), 0 if armed.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_arm(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| Ok(s.arm()? as jint)))
}

/// Ends a sleeper's sleep on the session (after `sleep` returned).
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_disarm(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jint {
    guard(|c| c, || on(h, |s| s.disarm().map(|()| 0)))
}

/// A sleeper over the session's fds (`sleeper.rs`): its handle, or a
/// negative code.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_sleeper(
    _: *mut JNIEnv,
    _: jclass,
    h: jlong,
) -> jlong {
    guard(
        |c| c.into(),
        || {
            on(h, |s| {
                Ok(SleeperHandle::into_jlong(sleeper::Sleeper::new(s)?))
            })
        },
    )
}

/// Sleeps up to `ms` milliseconds (at most 65,535); returns the
/// `sleeper::WOKE_*` bits of what ended it.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_sleep(
    _: *mut JNIEnv,
    _: jclass,
    sleeper: jlong,
    ms: jint,
) -> jint {
    guard(
        |c| c,
        || {
            let ms = u16::try_from(ms).map_err(|_| Fail::arg(format!("a sleep of {ms} ms")))?;
            SleeperHandle::with(sleeper, |s| s.sleep(ms)).map_err(Fail::arg)?
        },
    )
}

/// Ends the sleeper's current or next sleep.
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_wake(
    _: *mut JNIEnv,
    _: jclass,
    sleeper: jlong,
) -> jint {
    guard(
        |c| c,
        || SleeperHandle::with(sleeper, |s| s.wake().map(|()| 0)).map_err(Fail::arg)?,
    )
}

/// Frees a sleeper (after its sleeping thread ended).
#[unsafe(no_mangle)]
pub extern "system" fn Java_io_stator_flink_jni_StatorJni_sleeperClose(
    _: *mut JNIEnv,
    _: jclass,
    sleeper: jlong,
) -> jint {
    guard(
        |c| c,
        || {
            SleeperHandle::free(sleeper);
            Ok(0)
        },
    )
}
