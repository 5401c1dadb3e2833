//! Entry keys as stored: `(key group, state, key bytes, namespace bytes[,
//! user key])`, encoded so that byte order is the order we need.
//!
//! ```text
//! u16 BE key group | u32 BE state id | u32 BE key len | key | u32 BE namespace len | namespace [| user key]
//! ```
//!
//! The key group comes first, so a key-group range is a contiguous key
//! range. Lengths are prefixed, so the *base* of a map entry (everything but
//! the user key) is an unambiguous prefix of all of its user keys, and sorts
//! right before them: a map is a contiguous range, and its clear marker (a
//! record at the base key) is read together with its entries.

/// Largest key, namespace or user key, in bytes.
pub const MAX_PART_LEN: usize = 64 * 1024;
/// Largest encoded key (fits the u16 key length of a record).
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

/// Fixed bytes before the key: key group, state id, key length.
pub const HEADER_LEN: usize = 2 + 4 + 4;

/// Appends the base key (a value/list entry, or a map's base) to `out`.
pub fn encode_base(out: &mut Vec<u8>, kg: u16, state: u32, key: &[u8], ns: &[u8]) {
    out.reserve(HEADER_LEN + key.len() + 4 + ns.len());
    out.extend_from_slice(&kg.to_be_bytes());
    out.extend_from_slice(&state.to_be_bytes());
    out.extend_from_slice(&(key.len() as u32).to_be_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(ns.len() as u32).to_be_bytes());
    out.extend_from_slice(ns);
}

/// The key group of an encoded key (its first two bytes).
#[inline]
pub fn key_group(k: &[u8]) -> u16 {
    match k {
        [a, b, ..] => u16::from_be_bytes([*a, *b]),
        _ => 0,
    }
}

/// The smallest key of key group `kg`.
pub fn key_group_start(kg: u16) -> [u8; 2] {
    kg.to_be_bytes()
}

/// The state id of an encoded key.
pub fn state_id(k: &[u8]) -> Option<u32> {
    k.get(2..6)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

/// Length of the base part of an encoded map key (or of a whole base key),
/// parsed from its own length prefixes; `None` if malformed.
pub fn base_len(k: &[u8]) -> Option<usize> {
    let klen = u32::from_be_bytes(k.get(6..10)?.try_into().ok()?) as usize;
    let ns_at = HEADER_LEN.checked_add(klen)?;
    let nslen = u32::from_be_bytes(k.get(ns_at..ns_at + 4)?.try_into().ok()?) as usize;
    let end = ns_at.checked_add(4)?.checked_add(nslen)?;
    (end <= k.len()).then_some(end)
}

/// Whether `k` lies in the key-group range `[lo, hi]`.
#[inline]
pub fn in_key_groups(k: &[u8], lo: u16, hi: u16) -> bool {
    let kg = key_group(k);
    lo <= kg && kg <= hi
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_prefixes() {
        let mut a = Vec::new();
        encode_base(&mut a, 1, 7, b"k", b"");
        let mut b = Vec::new();
        encode_base(&mut b, 2, 0, b"", b"");
        assert!(a < b, "key group orders first");
        let mut m1 = a.clone();
        m1.extend_from_slice(b"uk1");
        let mut m2 = a.clone();
        m2.extend_from_slice(b"uk2");
        assert!(a < m1 && m1 < m2);
        assert_eq!(base_len(&m1), Some(a.len()));
        assert_eq!(base_len(&a), Some(a.len()));
        assert_eq!(key_group(&m1), 1);
        assert_eq!(state_id(&m1), Some(7));
        assert_eq!(base_len(&[0, 1, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff]), None);
        // "k" + "" vs "k\0\0\0\0" + ...: different key lengths, never a prefix clash.
        let mut c = Vec::new();
        encode_base(&mut c, 1, 7, b"k\0\0\0\0", b"");
        assert!(!c.starts_with(&a) || base_len(&c) != Some(a.len()));
    }
}
