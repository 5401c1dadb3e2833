//! Helpers shared by the fuzz targets.
//!
//! Most formats carry CRC32Cs, so random bytes almost never get past the
//! checksum to the parser behind it. Each target therefore runs twice per
//! input: once on the bytes as given (the checksum path) and once after
//! [`set_crc`] has made the checksums right (the structure behind them).

/// Writes the CRC32C of `b[range]` as a little-endian u32 at `at`, when
/// both lie inside `b`.
pub fn set_crc(b: &mut [u8], range: std::ops::Range<usize>, at: usize) {
    if range.start > range.end
        || range.end > b.len()
        || at.checked_add(4).is_none_or(|e| e > b.len())
    {
        return;
    }
    let crc = crc32c::crc32c(&b[range]);
    b[at..at + 4].copy_from_slice(&crc.to_le_bytes());
}

/// A little-endian u32 at `at`, or 0 past the end.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

/// A little-endian u64 at `at`, or 0 past the end.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}
