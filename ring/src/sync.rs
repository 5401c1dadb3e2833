//! The one place the queue protocol gets its atomics from. Under
//! `--cfg loom` these are loom's model-checked types, so the exact code that
//! runs in production is the code the loom tests explore. `ring/clippy.toml`
//! bans the std atomic types everywhere else in this crate.
#![allow(clippy::disallowed_types)]

#[cfg(loom)]
use loom::sync::atomic as imp;
#[cfg(not(loom))]
use std::sync::atomic as imp;

pub use imp::{Ordering, fence};

/// A `u32` atomic: std's, or loom's under `cfg(loom)`.
#[repr(transparent)]
#[derive(Debug)]
pub struct AtomicU32(imp::AtomicU32);

impl AtomicU32 {
    /// A new atomic holding `v` (used by the loom models; production atomics
    /// live in shared memory and come from [`AtomicU32::from_ptr`]).
    #[cfg(loom)]
    pub fn new(v: u32) -> Self {
        AtomicU32(imp::AtomicU32::new(v))
    }

    /// Views an aligned `u32` in shared memory as an atomic.
    ///
    /// # Safety
    /// `p` must be non-null, 4-byte aligned, valid for reads and writes for
    /// `'a`, and only ever accessed atomically while the reference lives.
    #[cfg(not(loom))]
    pub unsafe fn from_ptr<'a>(p: *mut u32) -> &'a AtomicU32 {
        // SAFETY: the caller upholds `AtomicU32::from_ptr`'s contract; our
        // type is `repr(transparent)` over std's, so the cast keeps layout.
        unsafe { &*(imp::AtomicU32::from_ptr(p) as *const imp::AtomicU32 as *const AtomicU32) }
    }

    #[inline]
    pub fn load(&self, o: Ordering) -> u32 {
        self.0.load(o)
    }

    #[inline]
    pub fn store(&self, v: u32, o: Ordering) {
        self.0.store(v, o)
    }

    #[inline]
    pub fn swap(&self, v: u32, o: Ordering) -> u32 {
        self.0.swap(v, o)
    }
}

/// A pause inside a spin loop. Under loom, a yield so the model explores
/// the other thread instead of spinning forever.
#[inline]
pub fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
