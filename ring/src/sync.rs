//! The one place the queue protocol gets its atomics from. Under
//! `--cfg loom` these are loom's model-checked types, so the exact code that
//! runs in production is the code the loom tests explore.
#![allow(clippy::disallowed_types)]

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU32, Ordering, fence};
#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU32, Ordering, fence};

/// A pause inside a spin loop. Under loom, a yield so the model explores
/// the other thread instead of spinning forever.
#[inline]
pub fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}
