//! The RocksDB peer (cargo feature `rocksdb`), configured as Flink's
//! RocksDB backend usually is: WAL off, no compression, a block cache of
//! the same budget as Stator's, bloom filters (10 bits/key), and for the
//! larger-than-memory run Flink's `partitioned-index-filters` layout
//! (two-level index, partitioned filters, pinned top level) with direct
//! reads, so both systems bypass the page cache.

use std::time::{Duration, Instant};

use rocksdb::{
    BlockBasedIndexType, BlockBasedOptions, Cache, DB, DBCompressionType, Options, ReadOptions,
    WriteOptions,
};

use crate::report::{Case, Reporter, histogram};
use crate::store::{PUT_BATCH, Rng, StoreArgs, raw_key as key};

const SUITE: &str = "store";

fn open(path: &std::path::Path, cache_bytes: usize, partitioned: bool) -> DB {
    let mut bo = BlockBasedOptions::default();
    let cache = Cache::new_lru_cache(cache_bytes);
    bo.set_block_cache(&cache);
    bo.set_bloom_filter(10.0, false);
    bo.set_cache_index_and_filter_blocks(true);
    bo.set_pin_l0_filter_and_index_blocks_in_cache(true);
    if partitioned {
        bo.set_index_type(BlockBasedIndexType::TwoLevelIndexSearch);
        bo.set_partition_filters(true);
        bo.set_metadata_block_size(4096);
        bo.set_pin_top_level_index_and_filter(true);
    }
    let mut o = Options::default();
    o.create_if_missing(true);
    o.set_block_based_table_factory(&bo);
    o.set_compression_type(DBCompressionType::None);
    o.set_write_buffer_size(64 << 20);
    o.set_max_write_buffer_number(2);
    o.set_use_direct_reads(partitioned);
    o.set_max_background_jobs(1);
    // Opened with its column family named, so `cf_handle("default")`
    // works for batched multi-get.
    DB::open_cf(&o, path, ["default"]).expect("open rocksdb")
}

fn write_opts() -> WriteOptions {
    let mut w = WriteOptions::default();
    w.disable_wal(true);
    w
}

/// In-memory: returns (get ops/s, put ops/s, batched put ops/s).
pub fn in_memory(args: &StoreArgs, r: &mut Reporter, n: u64, v100: &[Vec<u8>]) -> (f64, f64, f64) {
    let dir = super::store::bench_dir(args, "rocks-mem-");
    let db = open(dir.path(), (n as usize * 400).max(256 << 20), false);
    let w = write_opts();
    // The same load as Stator's: one put at a time, then batches.
    let half = n / 2;
    let t = Instant::now();
    for i in 0..half {
        db.put_opt(key(i), &v100[(i % 256) as usize], &w)
            .expect("put");
    }
    let c = Case::new(SUITE, "mem_load_rocksdb", half, t.elapsed());
    let put = c.ops_per_sec;
    r.case(&c);
    let t = Instant::now();
    let mut i = half;
    while i < n {
        let mut b = rocksdb::WriteBatch::default();
        for j in i..(i + PUT_BATCH as u64).min(n) {
            b.put(key(j), &v100[(j % 256) as usize]);
        }
        db.write_opt(b, &w).expect("write batch");
        i += PUT_BATCH as u64;
    }
    let c = Case::new(
        SUITE,
        format!("mem_load_batch{PUT_BATCH}_rocksdb"),
        n - half,
        t.elapsed(),
    )
    .with("batch", PUT_BATCH);
    let batch_put = c.ops_per_sec;
    r.case(&c);
    db.flush().expect("flush");
    let mut rng = Rng(42);
    let mut h = histogram();
    let mut out = [0u8; 256];
    // Warm the block cache once, then measure.
    for i in 0..n {
        let _ = db.get_pinned(key(i));
    }
    let t = Instant::now();
    for op in 0..n {
        let t0 = (op % 8 == 0).then(Instant::now);
        let v = db
            .get_pinned(key(rng.below(n)))
            .expect("get")
            .expect("loaded");
        out[..v.len()].copy_from_slice(&v);
        if let Some(t0) = t0 {
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
        }
    }
    let c = Case::new(SUITE, "mem_get_rocksdb", n, t.elapsed()).latency(h);
    let get = c.ops_per_sec;
    r.case(&c);
    let mut rng = Rng(43);
    let t = Instant::now();
    let mut done = 0;
    let ro = ReadOptions::default();
    while done < n {
        let keys: Vec<[u8; 16]> = (0..64).map(|_| key(rng.below(n))).collect();
        let cf = db.cf_handle("default").expect("default column family");
        for v in db.batched_multi_get_cf_opt(&cf, &keys, false, &ro) {
            let v = v.expect("get").expect("loaded");
            out[..v.len()].copy_from_slice(&v);
        }
        done += 64;
    }
    r.case(&Case::new(
        SUITE,
        "mem_multi_get64_rocksdb",
        done,
        t.elapsed(),
    ));
    // 50/50 get/put, the same sequence as Stator's.
    let mut rng = Rng(44);
    let mut h = histogram();
    let t = Instant::now();
    for op in 0..n {
        let k = key(rng.below(n));
        let t0 = (op % 8 == 0).then(Instant::now);
        if op % 2 == 0 {
            if let Some(v) = db.get_pinned(k).expect("get") {
                out[..v.len()].copy_from_slice(&v);
            }
        } else {
            db.put_opt(k, &v100[(op % 256) as usize], &w).expect("put");
        }
        if let Some(t0) = t0 {
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
        }
    }
    r.case(&Case::new(SUITE, "mem_get_put_50_50_rocksdb", n, t.elapsed()).latency(h));
    (get, put, batch_put)
}

/// Larger than memory: returns (get at depth 1 ops/s, multi_get of 32 ops/s).
pub fn larger_than_memory(
    args: &StoreArgs,
    r: &mut Reporter,
    n: u64,
    budget: usize,
    secs: u64,
    v256: &[Vec<u8>],
) -> (f64, f64) {
    let dir = super::store::bench_dir(args, "rocks-big-");
    let (get1, mget) = {
        let db = open(dir.path(), budget, true);
        let w = write_opts();
        let t = Instant::now();
        for i in 0..n {
            db.put_opt(key(i), &v256[(i % 256) as usize], &w)
                .expect("put");
        }
        db.flush().expect("flush");
        db.compact_range::<&[u8], &[u8]>(None, None);
        r.case(&Case::new(SUITE, "big_load_rocksdb", n, t.elapsed()));
        drop(db);
        let db = open(dir.path(), budget, true);
        let mut rng = Rng(99);
        let mut h = histogram();
        let t = Instant::now();
        let mut done = 0u64;
        while t.elapsed() < Duration::from_secs(secs) {
            let t0 = Instant::now();
            let v = db
                .get_pinned(key(rng.below(n)))
                .expect("get")
                .expect("loaded");
            std::hint::black_box(&v);
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            done += 1;
        }
        let c = Case::new(SUITE, "big_get_depth1_rocksdb", done, t.elapsed())
            .latency(h)
            .with("in_flight", 1);
        let get1 = c.ops_per_sec;
        r.case(&c);
        let mut ro = ReadOptions::default();
        ro.set_async_io(true);
        let cf = db.cf_handle("default").expect("default column family");
        let mut h = histogram();
        let t = Instant::now();
        let mut done = 0u64;
        while t.elapsed() < Duration::from_secs(secs) {
            let keys: Vec<[u8; 16]> = (0..32).map(|_| key(rng.below(n))).collect();
            let t0 = Instant::now();
            for v in db.batched_multi_get_cf_opt(&cf, &keys, false, &ro) {
                std::hint::black_box(v.expect("get").expect("loaded"));
            }
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            done += 32;
        }
        let c = Case::new(SUITE, "big_multi_get32_async_rocksdb", done, t.elapsed())
            .latency(h)
            .with("in_flight", 32)
            .with("latency_is", "per batch of 32");
        let mget = c.ops_per_sec;
        r.case(&c);
        (get1, mget)
    };
    (get1, mget)
}
