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

/// Reads a fuzz input as a script: numbers and byte strings, little-endian,
/// `None` once it runs out.
pub struct Script<'a>(pub &'a [u8]);

impl<'a> Script<'a> {
    pub fn u8(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }

    pub fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes([self.u8()?, self.u8()?]))
    }

    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes([
            self.u8()?,
            self.u8()?,
            self.u8()?,
            self.u8()?,
        ]))
    }

    /// Exactly `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let (b, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(b)
    }

    /// A `u16` length, then up to that many bytes.
    pub fn sized(&mut self) -> &'a [u8] {
        let n = self.u16().unwrap_or(0) as usize;
        let (b, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        b
    }
}
