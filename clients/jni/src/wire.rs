//! The byte layouts shared with the Java side (`io.stator.flink.jni`):
//! argument blocks read from the caller's scratch buffer, and the command
//! and completion records of the hot path. All integers little-endian.
//!
//! **Command** (64 bytes, written by Java into its command buffer; the
//! same fields as a submission queue entry, `ring/PROTOCOL.md` §5, with
//! the caller's token where the ring has its `user_data`):
//!
//! | Off | Size | Field |
//! |---|---|---|
//! | 0 | 8 | token (echoed in the completion) |
//! | 8 | 1 | opcode |
//! | 9 | 1 | flags |
//! | 10 | 2 | key group |
//! | 12 | 4 | state id |
//! | 16 | 8 | key: `u32 off`, `u32 len` (arena offsets) |
//! | 24 | 8 | namespace |
//! | 32 | 8 | user key |
//! | 40 | 8 | value (input, or the range a read's result lands in) |
//! | 48 | 8 | arg |
//! | 56 | 4 | arg2 |
//! | 60 | 4 | reserved, 0 |
//!
//! **Completion** (32 bytes, written by the native side):
//!
//! | Off | Size | Field |
//! |---|---|---|
//! | 0 | 8 | token |
//! | 8 | 4 | status (`i32`: 0 ok, 1 not found, < 0 the protocol's errors) |
//! | 12 | 4 | flags: bit 0 `MORE` (map page), bit 1 `LAST` |
//! | 16 | 4 | result length (with `ResultTooLarge`: the size needed) |
//! | 20 | 4 | reserved, 0 |
//! | 24 | 8 | aux (contains 1/0, entries in a page) |
//!
//! **Error record** (what `error()` writes): `i32 code` (this crate's
//! `ERR_*`), `i32 detail` (a control or request status, or 0), `u32 len`,
//! then `len` bytes of UTF-8.
//!
//! Strings in argument blocks are `u16 len` then UTF-8; byte strings
//! (checkpoint handles) are `u16 len` then bytes.

use stator_client::{BufRef, Opcode, RawRequest};

pub const COMMAND_LEN: usize = 64;
pub const COMPLETION_LEN: usize = 32;

/// Completion flag bits (the Java side's view).
pub const FLAG_MORE: u32 = 1;
pub const FLAG_LAST: u32 = 2;

/// Reads an argument block.
pub struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("the argument block is truncated".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    pub fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    pub fn u16(&mut self) -> Result<u16, String> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    pub fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    pub fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    pub fn bytes(&mut self) -> Result<&'a [u8], String> {
        let n = self.u16()? as usize;
        self.take(n)
    }

    pub fn str(&mut self) -> Result<&'a str, String> {
        std::str::from_utf8(self.bytes()?).map_err(|_| "a string is not UTF-8".into())
    }
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Decodes one command record into the request and its token.
pub fn command(c: &[u8; COMMAND_LEN]) -> Result<(RawRequest, u64), String> {
    let op = Opcode::from_u8(c[8]).ok_or_else(|| format!("unknown opcode {}", c[8]))?;
    let r = |at| BufRef::new(le_u32(c, at), le_u32(c, at + 4));
    Ok((
        RawRequest {
            op,
            flags: c[9],
            key_group: u16::from_le_bytes([c[10], c[11]]),
            state: le_u32(c, 12),
            key: r(16),
            namespace: r(24),
            user_key: r(32),
            value: r(40),
            arg: le_u64(c, 48),
            arg2: le_u32(c, 56),
        },
        le_u64(c, 0),
    ))
}

/// Encodes one completion record.
pub fn completion(token: u64, status: i32, flags: u32, len: u32, aux: u64) -> [u8; COMPLETION_LEN] {
    let mut b = [0u8; COMPLETION_LEN];
    b[0..8].copy_from_slice(&token.to_le_bytes());
    b[8..12].copy_from_slice(&status.to_le_bytes());
    b[12..16].copy_from_slice(&flags.to_le_bytes());
    b[16..20].copy_from_slice(&len.to_le_bytes());
    b[24..32].copy_from_slice(&aux.to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_decodes_field_by_field() {
        let mut c = [0u8; COMMAND_LEN];
        c[0..8].copy_from_slice(&7u64.to_le_bytes());
        c[8] = Opcode::MapGet as u8;
        c[9] = 0;
        c[10..12].copy_from_slice(&513u16.to_le_bytes());
        c[12..16].copy_from_slice(&3u32.to_le_bytes());
        for (i, at) in [16, 24, 32, 40].into_iter().enumerate() {
            c[at..at + 4].copy_from_slice(&(100 * i as u32 + 1).to_le_bytes());
            c[at + 4..at + 8].copy_from_slice(&(i as u32 + 2).to_le_bytes());
        }
        c[48..56].copy_from_slice(&u64::MAX.to_le_bytes());
        c[56..60].copy_from_slice(&9u32.to_le_bytes());
        let (r, token) = command(&c).unwrap();
        assert_eq!(token, 7);
        assert_eq!(r.op, Opcode::MapGet);
        assert_eq!((r.key_group, r.state), (513, 3));
        assert_eq!(r.key, BufRef::new(1, 2));
        assert_eq!(r.namespace, BufRef::new(101, 3));
        assert_eq!(r.user_key, BufRef::new(201, 4));
        assert_eq!(r.value, BufRef::new(301, 5));
        assert_eq!((r.arg, r.arg2), (u64::MAX, 9));
        c[8] = 200;
        assert!(command(&c).unwrap_err().contains("unknown opcode 200"));
    }

    #[test]
    fn a_truncated_argument_block_is_an_error() {
        let mut r = Reader(&[3, 0, b'a', b'b']);
        assert!(r.str().is_err());
        let mut r = Reader(&[2, 0, b'a', b'b', 1]);
        assert_eq!(r.str().unwrap(), "ab");
        assert!(r.u16().is_err());
    }
}
