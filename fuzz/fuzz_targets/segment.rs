//! Segment files (`store/FORMAT.md` §4-§7) as the store opens and reads
//! them: the footer page, the filter and index it points to, and every data
//! block the index names, walked and searched the way gets, iterations and
//! exports do.
//!
//! The first byte picks how the rest becomes a file:
//! - odd: a footer (128 bytes) and the file's other bytes, as given (the
//!   checksum and bounds checks);
//! - even: a recipe, so the fuzzer reaches the structure behind the
//!   checksums: up to 8 block payloads with the last key the index gives
//!   each, and filter bytes, laid out with correct headers, index, footer
//!   and checksums; then (offset, xor) pairs that damage the result.
#![no_main]

use libfuzzer_sys::fuzz_target;
use stator_fuzz::Script;
use stator_store::aligned::ALIGN;
use stator_store::bloom;
use stator_store::format::{self, BLOCK_HEADER, BlockIndex, BlockView, FOOTER_LEN, Footer};
use stator_store::ops;
use stator_store::segment::Segment;

/// A file from the recipe.
fn build(s: &mut Script<'_>) -> Vec<u8> {
    let mut f = Vec::new();
    let mut index = BlockIndex::default();
    let blocks = s.u8().unwrap_or(0) % 9;
    for _ in 0..blocks {
        let payload = s.sized();
        let key = s.sized();
        let off = f.len();
        f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        f.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        f.extend_from_slice(payload);
        f.resize(
            (off + BLOCK_HEADER + payload.len()).next_multiple_of(ALIGN),
            0,
        );
        index.push(off as u64, (f.len() - off) as u32, key);
    }
    let data_len = f.len() as u64;
    let filter = s.sized();
    f.extend_from_slice(filter);
    let index_off = f.len() as u64;
    index.encode(&mut f);
    let meta_end = f.len() as u64;
    let footer = Footer {
        order: 5,
        generation: 1,
        min_order: 4,
        records: s.u32().unwrap_or(0) as u64,
        data_len,
        filter_off: data_len,
        filter_len: filter.len() as u64,
        index_off,
        index_len: meta_end - index_off,
        min_kg: 0,
        max_kg: s.u16().unwrap_or(u16::MAX),
        blocks: index.len() as u32,
        meta_crc: crc32c::crc32c(&f[data_len as usize..]),
    };
    f.resize(f.len().next_multiple_of(ALIGN), 0);
    f.extend_from_slice(&footer.encode());
    f.resize(f.len().next_multiple_of(ALIGN), 0);
    // Damage.
    while let (Some(at), Some(x)) = (s.u32(), s.u8()) {
        let at = at as usize % f.len();
        f[at] ^= x;
    }
    f
}

fuzz_target!(|data: &[u8]| {
    let mut s = Script(data);
    let Some(mode) = s.u8() else { return };
    let f = if mode & 1 == 1 {
        let (footer, rest) = s.0.split_at(FOOTER_LEN.min(s.0.len()));
        let mut f = rest.to_vec();
        f.resize(f.len().next_multiple_of(ALIGN), 0);
        f.extend_from_slice(footer);
        f.resize(f.len().next_multiple_of(ALIGN).max(ALIGN), 0);
        f
    } else {
        build(&mut s)
    };
    let len = f.len();
    // As `Store::open_segment`: the footer, then the meta region it names.
    let Some(fpage) = format::footer_page(len as u64) else {
        return;
    };
    let fpage = fpage as usize;
    let Ok(footer) = format::Footer::decode(&f[fpage..], len as u64) else {
        return;
    };
    let meta_off = (footer.filter_off / ALIGN as u64 * ALIGN as u64) as usize;
    let Some(meta) = f.get(meta_off..fpage) else {
        panic!("a footer that decodes names a meta region outside the file")
    };
    let Ok(seg) = Segment::from_parts(
        0,
        "fuzz".into(),
        0,
        len as u64,
        &f[fpage..],
        meta,
        meta_off as u64,
    ) else {
        return;
    };
    // Every block, as a get, an iteration or an export reads it.
    for i in 0..seg.index.len() {
        let (off, blen) = seg.index.block(i);
        let Some(bytes) = f.get(off as usize..off as usize + blen as usize) else {
            panic!("the index names bytes outside the data region");
        };
        let Ok(v) = BlockView::parse(bytes) else {
            continue;
        };
        for j in 0..v.len() {
            let r = v.record(j);
            assert_eq!(v.key(j), r.key);
            let raw = v.raw(&r);
            assert!(v.value_range(&r).end <= bytes.len());
            // An export's run of adjacent puts, as it copies them.
            let (run, next) = v.put_run(j, raw.len(), 1 << 16, |_| true);
            assert!(next > j && next <= v.len());
            let _ = v.raw_span(&r, run);
            let found = v.find(r.key);
            assert!(found.is_none_or(|x| x.key == r.key));
            let _ = seg.may_contain(r.key, bloom::hash(r.key));
            let _ = ops::check_elements(r.value).map(|_| ops::elements(r.value).count());
        }
        let last = seg.index.last_key(i);
        let _ = v.lower_bound(last);
        let _ = seg.index.find(last);
    }
});
