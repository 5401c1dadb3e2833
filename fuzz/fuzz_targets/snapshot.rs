//! Portable snapshot chunks (`store/FORMAT.md` §13) as an import reads
//! them from a client's shared memory or a snapshot file: headers, payload
//! checksums, the state table, group frames and records, items cut across
//! chunk boundaries. The input is a script of chunks, each a `u16` length
//! and that many bytes, fed to one decoder in order.
//!
//! The first byte picks the mode: odd feeds the chunks as given; even
//! takes each as a payload and writes a correct header before it (index,
//! length, checksums; the flags and the last-chunk bit from the script), so
//! the fuzzer reaches the stream behind the checksums.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stator_fuzz::set_crc;
use stator_store::keys;
use stator_store::snapshot::{
    ChunkDecoder, FLAG_LAST, HEADER_LEN, Item, MAGIC, VERSION, chunk_len,
};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, mut rest)) = data.split_first() else {
        return;
    };
    let fix = mode & 1 == 0;
    // The accepted key-group range, as a rescaled restore asks for it.
    let (lo, hi) = if mode & 2 == 0 { (0, u16::MAX) } else { (3, 9) };
    let mut d = ChunkDecoder::new(lo, hi);
    let mut index = 0u32;
    let mut records = 0u64;
    while rest.len() >= 2 {
        let n = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        let Some((body, tail)) = rest[2..].split_at_checked(n.min(rest.len() - 2)) else {
            break;
        };
        rest = tail;
        let mut chunk = Vec::with_capacity(HEADER_LEN + body.len());
        if fix {
            let last = tail.len() < 2;
            chunk.extend_from_slice(&MAGIC);
            chunk.extend_from_slice(&VERSION.to_le_bytes());
            chunk.extend_from_slice(&(if last { FLAG_LAST } else { 0 }).to_le_bytes());
            chunk.extend_from_slice(&7u64.to_le_bytes());
            chunk.extend_from_slice(&index.to_le_bytes());
            chunk.extend_from_slice(&(body.len() as u32).to_le_bytes());
            chunk.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
            chunk.extend_from_slice(&[0; 4]);
            set_crc(&mut chunk, 0..28, 28);
            chunk.extend_from_slice(body);
            assert_eq!(chunk_len(&chunk), Ok(chunk.len()));
        } else {
            chunk.extend_from_slice(body);
            let _ = chunk_len(&chunk);
        }
        index += 1;
        let r = d.feed(&chunk, |item| {
            match item {
                Item::States(_) => {}
                Item::Record(_, key, _) => {
                    records += 1;
                    // Records handed on carry a key group in range.
                    let kg = keys::key_group(key);
                    assert!(
                        (lo..=hi).contains(&kg),
                        "key group {kg} outside {lo}..={hi}"
                    );
                }
            }
            Ok(())
        });
        if r.is_err() {
            return;
        }
    }
    if d.done()
        && let Ok(stats) = d.finish()
    {
        assert_eq!(stats.records, records);
    }
});
