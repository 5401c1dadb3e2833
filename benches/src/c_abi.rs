//! The serve suite's client through the C ABI: libstator's exported
//! `stator_*` functions, called exactly as a C program linked with
//! `libstator.a` calls them (argument checks, the one-thread guard, the
//! panic guard, completions copied into C structs). Safe wrappers; the
//! `unsafe` stays here.

use std::ffi::CString;
use std::path::Path;

use stator::{
    STATOR_E_FULL, STATOR_KIND_VALUE, STATOR_OK, stator_completion, stator_flush, stator_free,
    stator_get, stator_open, stator_open_options, stator_open_options_init, stator_put,
    stator_reap, stator_register, stator_session, stator_wait,
};

/// A session opened through `stator_open`.
pub struct CSession(*mut stator_session);

// SAFETY: a stator_session may move between threads (one at a time): the
// C contract, which `&mut self` on every call upholds.
unsafe impl Send for CSession {}

impl Drop for CSession {
    fn drop(&mut self) {
        // SAFETY: from stator_open, freed once, here.
        unsafe { stator_free(self.0) };
    }
}

fn check(what: &str, rc: i32) {
    assert!(rc >= 0, "{what}: status {rc}");
}

/// What a submit said.
pub enum Submitted {
    Ok,
    Full,
}

impl CSession {
    /// Opens subtask `subtask` of `parallelism` of `job`/`op` with the
    /// serve suite's sizes, and registers the value state `state`.
    pub fn open(
        socket: &Path,
        job: &str,
        op: &str,
        subtask: u32,
        parallelism: u32,
    ) -> (CSession, u32) {
        let path = CString::new(socket.as_os_str().as_encoded_bytes()).expect("socket path");
        let (job, op) = (CString::new(job).unwrap(), CString::new(op).unwrap());
        let mut o = std::mem::MaybeUninit::<stator_open_options>::uninit();
        // SAFETY: a writable options struct; initialized by the call.
        check("init", unsafe { stator_open_options_init(o.as_mut_ptr()) });
        // SAFETY: initialized just above (checked).
        let mut o = unsafe { o.assume_init() };
        o.job = job.as_ptr();
        o.operator_name = op.as_ptr();
        o.subtask = subtask;
        o.parallelism = parallelism;
        o.max_parallelism = 128;
        o.sq_entries = 1 << 16;
        o.cq_entries = 1 << 16;
        o.arena_bytes = 256 << 20;
        o.read_capacity = 256;
        let mut s = std::ptr::null_mut();
        // SAFETY: valid strings and structs that outlive the call.
        check("open", unsafe { stator_open(path.as_ptr(), &o, &mut s) });
        let s = CSession(s);
        let name = CString::new("values").unwrap();
        let mut st = 0u32;
        // SAFETY: a live session, a valid name and out pointer.
        check("register", unsafe {
            stator_register(s.0, name.as_ptr(), STATOR_KIND_VALUE, &mut st)
        });
        (s, st)
    }

    /// Queues a get, or a put when `value` is given.
    pub fn submit(
        &mut self,
        st: u32,
        kg: u16,
        key: &[u8],
        value: Option<&[u8]>,
        token: u64,
    ) -> Submitted {
        // SAFETY: a live session; the ranges are valid for the call.
        let rc = unsafe {
            match value {
                Some(v) => stator_put(
                    self.0,
                    st,
                    kg as u32,
                    key.as_ptr(),
                    key.len(),
                    std::ptr::null(),
                    0,
                    v.as_ptr(),
                    v.len(),
                    token,
                ),
                None => stator_get(
                    self.0,
                    st,
                    kg as u32,
                    key.as_ptr(),
                    key.len(),
                    std::ptr::null(),
                    0,
                    token,
                ),
            }
        };
        match rc {
            STATOR_OK => Submitted::Ok,
            STATOR_E_FULL => Submitted::Full,
            rc => panic!("submit: status {rc}"),
        }
    }

    pub fn flush(&mut self) {
        // SAFETY: a live session.
        check("flush", unsafe { stator_flush(self.0) });
    }

    /// Reaps into `out`; the completions reaped.
    pub fn reap<'a>(&mut self, out: &'a mut [stator_completion]) -> &'a [stator_completion] {
        // SAFETY: a live session; `out` holds `out.len()` writable entries.
        let n = unsafe { stator_reap(self.0, out.as_mut_ptr(), out.len()) };
        check("reap", n);
        &out[..n as usize]
    }

    pub fn wait(&mut self, ms: i32) {
        // SAFETY: a live session.
        let rc = unsafe { stator_wait(self.0, ms) };
        assert!(
            rc == STATOR_OK || rc == stator::STATOR_E_TIMED_OUT,
            "wait: status {rc}"
        );
    }
}

/// An empty completion to reap into.
pub fn completion() -> stator_completion {
    stator_completion {
        user_data: 0,
        status: 0,
        flags: 0,
        value: std::ptr::null(),
        value_len: 0,
        len: 0,
        aux: 0,
        slot: 0,
        reserved: 0,
    }
}
