//! Helper threads: work a shard hands off (releasing a flushed memtable),
//! run at a low priority.
//!
//! On a host whose cores are all busy serving requests, a helper that
//! competed with them as an equal would take whole scheduler ticks (4 ms
//! here) from a shard at a time; at nice 10 it mostly runs in the gaps.
//! Work that must keep pace with writes (a flush's sort) runs on the
//! shard in bounded steps instead (see `crate::sorted`).

/// Runs `f` on a helper thread (see [`spawn`]), or here at once while the
/// clock is simulated (`crate::clock`: a simulation's run must not depend
/// on when another thread gets to it). If no thread starts, `f` is dropped
/// unrun, and what it holds is freed here.
pub fn hand_off(name: &str, f: impl FnOnce() + Send + 'static) {
    if crate::clock::simulated() {
        f();
    } else {
        let _ = spawn(name, f);
    }
}

/// Runs `f` on a new thread named `name` at nice 10. False if no thread
/// could be started (the caller then does the work itself, or not at
/// all).
pub fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> bool {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            // SAFETY: setpriority touches no memory of ours; on Linux,
            // with PRIO_PROCESS and 0, it sets the calling thread's nice
            // value. A failure leaves the priority as it was.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 10);
            }
            f()
        })
        .is_ok()
}
