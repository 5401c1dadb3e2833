//! Flink's key-group functions (bit for bit, as `stator_ring::keygroup`
//! computes them) and decoders of the encoded results (list elements, map
//! iteration pages). Pure functions: thread-safe, no session needed.

use stator_client::keygroup;

use crate::ptr::{bytes, out};
use crate::status::{Fail, Res, STATOR_OK, guard};

/// Flink's largest max parallelism (`KeyGroupRangeAssignment.UPPER_BOUND_MAX_PARALLELISM`).
pub const STATOR_MAX_PARALLELISM_LIMIT: i32 = 32768;

/// A byte range: `len` bytes at `data` (`data` may be NULL when `len` is 0).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct stator_bytes {
    pub data: *const u8,
    pub len: usize,
}

impl stator_bytes {
    pub(crate) const EMPTY: stator_bytes = stator_bytes {
        data: std::ptr::null(),
        len: 0,
    };

    pub(crate) fn of(b: &[u8]) -> stator_bytes {
        stator_bytes {
            data: b.as_ptr(),
            len: b.len(),
        }
    }
}

fn max_par(max_parallelism: i32) -> Res<u32> {
    if (1..=STATOR_MAX_PARALLELISM_LIMIT).contains(&max_parallelism) {
        Ok(max_parallelism as u32)
    } else {
        Err(Fail::arg(format!(
            "max parallelism {max_parallelism} is outside 1..={STATOR_MAX_PARALLELISM_LIMIT}"
        )))
    }
}

fn par(max_parallelism: u32, parallelism: i32) -> Res<u32> {
    if parallelism >= 1 && parallelism as u32 <= max_parallelism {
        Ok(parallelism as u32)
    } else {
        Err(Fail::arg(format!(
            "parallelism {parallelism} is outside 1..={max_parallelism} (the max parallelism)"
        )))
    }
}

/// Flink's `MathUtils.murmurHash(int)`: non-negative.
///
/// # Safety
/// None: any value is fine. Thread-safe; never fails.
#[unsafe(no_mangle)]
pub extern "C" fn stator_murmur_hash(code: i32) -> i32 {
    keygroup::murmur_hash(code)
}

/// The key group of a key whose Java `hashCode()` is `key_hash`
/// (`KeyGroupRangeAssignment.computeKeyGroupForKeyHash`): in
/// `0..max_parallelism`, or `STATOR_E_INVALID_ARGUMENT` when
/// `max_parallelism` is outside `1..=32768`.
///
/// # Safety
/// None: any values are fine. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn stator_key_group_for_hash(key_hash: i32, max_parallelism: i32) -> i32 {
    guard(|| Ok(keygroup::key_group_for_hash(key_hash, max_par(max_parallelism)?) as i32))
}

/// The inclusive key-group range `[*first, *last]` of subtask
/// `operator_index` of `parallelism`
/// (`computeKeyGroupRangeForOperatorIndex`). Returns `STATOR_OK`, or
/// `STATOR_E_INVALID_ARGUMENT` (max parallelism outside `1..=32768`,
/// parallelism outside `1..=max_parallelism`, index outside
/// `0..parallelism`) or `STATOR_E_NULL`; on an error nothing is written.
///
/// # Safety
/// `first` and `last` are NULL or point to writable `int32_t`s.
/// Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_key_group_range(
    max_parallelism: i32,
    parallelism: i32,
    operator_index: i32,
    first: *mut i32,
    last: *mut i32,
) -> i32 {
    guard(|| {
        let m = max_par(max_parallelism)?;
        let p = par(m, parallelism)?;
        if !(0..parallelism).contains(&operator_index) {
            return Err(Fail::arg(format!(
                "operator index {operator_index} is outside 0..{p}"
            )));
        }
        // SAFETY: the caller passes NULL or writable int32_t pointers.
        let (f, l) = unsafe { (out(first, "first")?, out(last, "last")?) };
        let (lo, hi) = keygroup::key_group_range(m, p, operator_index as u32);
        *f = lo as i32;
        *l = hi as i32;
        Ok(STATOR_OK)
    })
}

/// The subtask index that owns `key_group`
/// (`computeOperatorIndexForKeyGroup`): in `0..parallelism`, or
/// `STATOR_E_INVALID_ARGUMENT` for a max parallelism outside `1..=32768`,
/// a parallelism outside `1..=max_parallelism` or a key group outside
/// `0..max_parallelism`.
///
/// # Safety
/// None: any values are fine. Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn stator_operator_for_key_group(
    max_parallelism: i32,
    parallelism: i32,
    key_group: i32,
) -> i32 {
    guard(|| {
        let m = max_par(max_parallelism)?;
        let p = par(m, parallelism)?;
        if !(0..max_parallelism).contains(&key_group) {
            return Err(Fail::arg(format!(
                "key group {key_group} is outside 0..{m}"
            )));
        }
        Ok(keygroup::operator_index_for_key_group(m, p, key_group as u16) as i32)
    })
}

/// Java's `String.hashCode()` of the string whose UTF-8 bytes are
/// `utf8[0..len]`, as the JVM computes it for `new String(utf8, UTF_8)`
/// (over UTF-16 code units; malformed UTF-8 becomes U+FFFD as in Java).
/// Every `int32_t` is a possible hash, so this cannot report an error:
/// NULL with `len > 0` hashes as the empty string (0) and sets
/// `stator_last_error()`.
///
/// # Safety
/// `utf8` is NULL or points to `len` readable bytes. Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_java_string_hash(utf8: *const u8, len: usize) -> i32 {
    // SAFETY: the caller passes NULL or `len` readable bytes.
    match unsafe { bytes(utf8, len, "utf8") } {
        Ok(b) => {
            std::panic::catch_unwind(|| keygroup::java_string_hash(&String::from_utf8_lossy(b)))
                .unwrap_or(0)
        }
        Err(e) => {
            e.report();
            0
        }
    }
}

/// Steps through encoded elements (`u32 len (LE) | bytes`, repeated): a
/// list get's result, or the entries of a map iteration page (for
/// `STATOR_ITER_ENTRIES` a key, then its value). Start with `*pos = 0`;
/// each call sets `*element` to the element at `*pos` and advances `*pos`.
/// Returns 1 for an element, 0 at the end, `STATOR_E_INVALID_ARGUMENT`
/// when the encoding is malformed (or `*pos` is past `len`).
///
/// # Safety
/// `buf` is NULL (with `len` 0) or points to `len` readable bytes; `pos`
/// and `element` point to writable objects. `element->data` points into
/// `buf`. Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_elements_next(
    buf: *const u8,
    len: usize,
    pos: *mut usize,
    element: *mut stator_bytes,
) -> i32 {
    guard(|| {
        // SAFETY: the caller's contract above.
        let (b, p, e) = unsafe {
            (
                bytes(buf, len, "buf")?,
                out(pos, "pos")?,
                out(element, "element")?,
            )
        };
        let rest = b
            .get(*p..)
            .ok_or_else(|| Fail::arg(format!("position {} is past the {len} bytes", *p)))?;
        if rest.is_empty() {
            *e = stator_bytes::EMPTY;
            return Ok(0);
        }
        let n = rest
            .get(..4)
            .map(|h| u32::from_le_bytes(h.try_into().expect("4 bytes")) as usize)
            .ok_or_else(|| Fail::arg(format!("a truncated length at {}", *p)))?;
        let el = rest.get(4..4 + n).ok_or_else(|| {
            Fail::arg(format!(
                "an element of {n} bytes at {} runs past the end",
                *p
            ))
        })?;
        *e = stator_bytes::of(el);
        *p += 4 + n;
        Ok(1)
    })
}

/// Splits a map iteration page (a `STATOR_OP_MAP_ITER` result) into its
/// encoded entries (walk them with `stator_elements_next`) and the user
/// key to resume after (`resume_after`; pass it to the next
/// `stator_map_iter` while the completion had `STATOR_CQE_MORE`). Returns
/// `STATOR_OK`, or `STATOR_E_INVALID_ARGUMENT` for a malformed page.
///
/// # Safety
/// `page` points to `len` readable bytes (NULL only with `len` 0);
/// `entries` and `resume_after` point to writable `stator_bytes`, which
/// end up pointing into `page`. Thread-safe.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn stator_page_split(
    page: *const u8,
    len: usize,
    entries: *mut stator_bytes,
    resume_after: *mut stator_bytes,
) -> i32 {
    guard(|| {
        // SAFETY: the caller's contract above.
        let (b, e, r) = unsafe {
            (
                bytes(page, len, "page")?,
                out(entries, "entries")?,
                out(resume_after, "resume_after")?,
            )
        };
        let p = stator_client::Page::parse(b)
            .ok_or_else(|| Fail::arg(format!("a malformed page of {len} bytes")))?;
        *e = stator_bytes::of(p.data);
        *r = stator_bytes::of(p.resume_after);
        Ok(STATOR_OK)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_match_the_rust_functions_and_check_their_arguments() {
        assert_eq!(
            stator_key_group_for_hash(42, 128),
            keygroup::key_group_for_hash(42, 128) as i32
        );
        assert!(stator_key_group_for_hash(42, 0) < 0);
        assert!(stator_key_group_for_hash(42, 32769) < 0);
        let (mut f, mut l) = (-1, -1);
        // SAFETY: valid out pointers.
        let rc = unsafe { stator_key_group_range(128, 3, 1, &mut f, &mut l) };
        assert_eq!(rc, STATOR_OK);
        assert_eq!((f, l), (43, 85));
        // SAFETY: NULL out pointers are refused.
        let rc = unsafe { stator_key_group_range(128, 3, 1, std::ptr::null_mut(), &mut l) };
        assert_eq!(rc, crate::status::STATOR_E_NULL);
        assert_eq!(stator_operator_for_key_group(128, 3, 43), 1);
        assert!(stator_operator_for_key_group(128, 3, 128) < 0);
        // SAFETY: a valid byte range.
        let h = unsafe { stator_java_string_hash(b"hello".as_ptr(), 5) };
        assert_eq!(h, 99_162_322);
        // SAFETY: NULL with a length hashes as "".
        assert_eq!(unsafe { stator_java_string_hash(std::ptr::null(), 3) }, 0);
    }
}
