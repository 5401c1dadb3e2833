//! Checked conversions of the caller's pointers. NULL and impossible
//! lengths become errors here; what the C caller promises in each
//! function's `# Safety` section (the pointer is valid for that many
//! bytes) is what these functions rely on.

use std::ffi::{CStr, c_char};

use crate::status::{Fail, Res};

/// `len` bytes at `p`; NULL is the empty slice when `len` is 0.
///
/// # Safety
/// `p` is NULL or valid for reads of `len` bytes for `'a`, not written
/// meanwhile.
pub(crate) unsafe fn bytes<'a>(p: *const u8, len: usize, what: &'static str) -> Res<&'a [u8]> {
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Fail::null(what));
    }
    if len > isize::MAX as usize {
        return Err(Fail::arg(format!("{what}: {len} bytes is not a length")));
    }
    // SAFETY: non-NULL, length in range, valid for `len` bytes by the
    // caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// The object at `p` to write a result into.
///
/// # Safety
/// `p` is NULL or valid, aligned and writable for `'a`.
pub(crate) unsafe fn out<'a, T>(p: *mut T, what: &'static str) -> Res<&'a mut T> {
    if !p.is_aligned() {
        return Err(Fail::arg(format!("{what} is misaligned")));
    }
    // SAFETY: aligned; NULL is refused by as_mut; valid by the caller's
    // contract.
    unsafe { p.as_mut() }.ok_or_else(|| Fail::null(what))
}

/// The object at `p` to read.
///
/// # Safety
/// `p` is NULL or valid, aligned and readable for `'a`.
pub(crate) unsafe fn input<'a, T>(p: *const T, what: &'static str) -> Res<&'a T> {
    if !p.is_aligned() {
        return Err(Fail::arg(format!("{what} is misaligned")));
    }
    // SAFETY: aligned; NULL is refused by as_ref; valid by the caller's
    // contract.
    unsafe { p.as_ref() }.ok_or_else(|| Fail::null(what))
}

/// A NUL-terminated UTF-8 string.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for `'a`.
pub(crate) unsafe fn string<'a>(p: *const c_char, what: &'static str) -> Res<&'a str> {
    if p.is_null() {
        return Err(Fail::null(what));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Fail::arg(format!("{what} is not UTF-8")))
}
