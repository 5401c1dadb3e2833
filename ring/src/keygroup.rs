//! Key groups, bit for bit as Apache Flink computes them
//! (`org.apache.flink.runtime.state.KeyGroupRangeAssignment` and
//! `org.apache.flink.util.MathUtils`), so that a key lands in the same key
//! group, and a subtask owns the same range, as in the engine.

/// Flink's `MathUtils.murmurHash(int)`: one Murmur3 round plus finalizer,
/// made non-negative.
pub fn murmur_hash(code: i32) -> i32 {
    let mut c = code as u32;
    c = c.wrapping_mul(0xcc9e_2d51);
    c = c.rotate_left(15);
    c = c.wrapping_mul(0x1b87_3593);
    c = c.rotate_left(13);
    c = c.wrapping_mul(5).wrapping_add(0xe654_6b64);
    c ^= 4;
    c = fmix(c);
    let h = c as i32;
    if h >= 0 {
        h
    } else if h != i32::MIN {
        -h
    } else {
        0
    }
}

fn fmix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// `computeKeyGroupForKeyHash(keyHash, maxParallelism)`: the key group of
/// a key whose Java `hashCode()` is `key_hash`.
pub fn key_group_for_hash(key_hash: i32, max_parallelism: u32) -> u16 {
    (murmur_hash(key_hash) as u32 % max_parallelism.max(1)) as u16
}

/// `computeKeyGroupRangeForOperatorIndex`: the inclusive key-group range
/// `(start, end)` of subtask `index` of `parallelism`.
pub fn key_group_range(max_parallelism: u32, parallelism: u32, index: u32) -> (u16, u16) {
    let (m, p, i) = (
        max_parallelism as u64,
        parallelism.max(1) as u64,
        index as u64,
    );
    let start = (i * m).div_ceil(p);
    let end = ((i + 1) * m - 1) / p;
    (start as u16, end as u16)
}

/// `computeOperatorIndexForKeyGroup`: the subtask that owns `key_group`.
pub fn operator_index_for_key_group(max_parallelism: u32, parallelism: u32, key_group: u16) -> u32 {
    (key_group as u64 * parallelism as u64 / max_parallelism.max(1) as u64) as u32
}

/// Java's `String.hashCode()` (over UTF-16 code units).
pub fn java_string_hash(s: &str) -> i32 {
    s.encode_utf16()
        .fold(0i32, |h, u| h.wrapping_mul(31).wrapping_add(u as i32))
}

/// Java's `Long.hashCode()`.
pub fn java_long_hash(v: i64) -> i32 {
    (v ^ ((v as u64) >> 32) as i64) as i32
}

/// Java's `Integer.hashCode()`.
pub fn java_int_hash(v: i32) -> i32 {
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn java_hash_codes() {
        assert_eq!(java_string_hash(""), 0);
        assert_eq!(java_string_hash("a"), 97);
        assert_eq!(java_string_hash("hello"), 99162322);
        assert_eq!(java_string_hash("Hello, World!"), 1498789909);
        assert_eq!(java_string_hash("polygenelubricants"), i32::MIN);
        assert_eq!(java_string_hash("\u{1F600}"), 0xD83D * 31 + 0xDE00);
        assert_eq!(java_long_hash(0), 0);
        assert_eq!(java_long_hash(1), 1);
        assert_eq!(java_long_hash(-1), 0);
        assert_eq!(java_long_hash(1 << 32), 1);
        assert_eq!(java_long_hash(i64::MAX), i32::MIN);
    }

    /// Expected values from an independent Murmur3-32 (Python's `mmh3`,
    /// seed 0, over the int's 4 little-endian bytes, which is Flink's
    /// `murmurHash(int)` before it takes the absolute value).
    #[test]
    fn murmur_and_key_groups_match_flink() {
        for (code, want) in [
            (0, 593689054),
            (1, 68075478),
            (-1, 1982413648),
            (42, 1134849565),
            (i32::MAX, 1653689534),
            (i32::MIN, 1718298732),
            (99162322, 1715862179),
        ] {
            assert_eq!(murmur_hash(code), want, "murmurHash({code})");
        }
        assert_eq!(key_group_for_hash(java_string_hash("hello"), 128), 35);
        assert_eq!(key_group_for_hash(java_string_hash("hello"), 32768), 31395);
        assert_eq!(java_string_hash("user-1"), -836031825);
        assert_eq!(key_group_for_hash(java_string_hash("user-1"), 128), 121);
        assert_eq!(key_group_for_hash(java_string_hash("Flink"), 128), 127);
        assert_eq!(key_group_for_hash(java_long_hash(0), 128), 94);
        assert_eq!(java_long_hash(123456789012), -1097262584);
        assert_eq!(key_group_for_hash(java_long_hash(123456789012), 128), 123);
    }

    #[test]
    fn ranges_cover_every_key_group_once_and_invert() {
        for m in [1u32, 7, 128, 1000, 32768] {
            for p in [1u32, 2, 3, 7, 128] {
                if p > m {
                    continue;
                }
                let mut next = 0u32;
                for i in 0..p {
                    let (lo, hi) = key_group_range(m, p, i);
                    assert_eq!(lo as u32, next, "m={m} p={p} i={i}");
                    assert!(hi >= lo);
                    for kg in [lo, hi] {
                        assert_eq!(operator_index_for_key_group(m, p, kg), i);
                    }
                    next = hi as u32 + 1;
                }
                assert_eq!(next, m);
            }
        }
        assert_eq!(key_group_range(128, 4, 1), (32, 63));
        assert_eq!(key_group_range(10, 3, 1), (4, 6));
    }
}
