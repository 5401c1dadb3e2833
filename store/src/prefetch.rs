//! Software prefetch: start the memory load of a cache line the code will
//! touch soon, so that the misses of a batch (a pass's submissions, a
//! pass's completions) overlap instead of adding up (a random load in a
//! large working set costs hundreds of nanoseconds here).

/// Starts loading the cache line holding `p` into every cache level.
#[inline]
pub(crate) fn line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint; it never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Starts loading the first `lines` cache lines of `r`.
#[inline]
pub(crate) fn value<T: ?Sized>(r: &T, lines: usize) {
    let p = r as *const T as *const u8;
    for i in 0..lines {
        line(p.wrapping_add(i * 64));
    }
}
