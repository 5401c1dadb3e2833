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
    let dir = super::store::bench_dir(args.dir.as_deref(), "rocks-mem-");
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

/// The larger-than-memory peer: the same 20 M x 256 B loaded into RocksDB
/// (then fully compacted) and reopened, so that its reads can run in the
/// same minutes as Stator's (the VM's disk drifts). With `--reuse DIR` the
/// data set is kept in `DIR-rocksdb` and reused by later runs.
pub struct BigPeer {
    db: DB,
    n: u64,
    _tmp: Option<tempfile::TempDir>,
}

impl BigPeer {
    pub fn load(
        args: &StoreArgs,
        r: &mut Reporter,
        n: u64,
        budget: usize,
        v256: &[Vec<u8>],
    ) -> BigPeer {
        let (path, tmp) = match &args.reuse {
            Some(p) => {
                let mut d = p.clone().into_os_string();
                d.push("-rocksdb");
                let d = std::path::PathBuf::from(d);
                std::fs::create_dir_all(&d).expect("create the RocksDB --reuse dir");
                (d, None)
            }
            None => {
                let t = super::store::bench_dir(args.dir.as_deref(), "rocks-big-");
                (t.path().to_path_buf(), Some(t))
            }
        };
        let marker = path.with_extension(format!("loaded-{n}"));
        if !marker.exists() {
            let db = open(&path, budget, true);
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
            std::fs::write(&marker, b"").expect("write the RocksDB load marker");
        }
        BigPeer {
            db: open(&path, budget, true),
            n,
            _tmp: tmp,
        }
    }

    /// Random gets one at a time for `secs`.
    pub fn get1(&self, r: &mut Reporter, secs: u64, seed: u64) -> f64 {
        let mut rng = Rng(seed);
        let mut h = histogram();
        let t = Instant::now();
        let mut done = 0u64;
        while t.elapsed() < Duration::from_secs(secs) {
            let t0 = Instant::now();
            let v = self
                .db
                .get_pinned(key(rng.below(self.n)))
                .expect("get")
                .expect("loaded");
            std::hint::black_box(&v);
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            done += 1;
        }
        let c = Case::new(SUITE, "big_get_depth1_rocksdb", done, t.elapsed())
            .latency(h)
            .with("in_flight", 1);
        r.case(&c);
        c.ops_per_sec
    }

    /// Batched multi-gets of 32 random keys with async I/O for `secs`.
    pub fn multi_get32(&self, r: &mut Reporter, secs: u64, seed: u64) -> f64 {
        let mut rng = Rng(seed);
        let mut ro = ReadOptions::default();
        ro.set_async_io(true);
        let cf = self.db.cf_handle("default").expect("default column family");
        let mut h = histogram();
        let t = Instant::now();
        let mut done = 0u64;
        while t.elapsed() < Duration::from_secs(secs) {
            let keys: Vec<[u8; 16]> = (0..32).map(|_| key(rng.below(self.n))).collect();
            let t0 = Instant::now();
            for v in self.db.batched_multi_get_cf_opt(&cf, &keys, false, &ro) {
                std::hint::black_box(v.expect("get").expect("loaded"));
            }
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            done += 32;
        }
        let c = Case::new(SUITE, "big_multi_get32_async_rocksdb", done, t.elapsed())
            .latency(h)
            .with("in_flight", 32)
            .with("latency_is", "per batch of 32");
        r.case(&c);
        c.ops_per_sec
    }
}

/// `n` puts of the keys `next` gives, in `WriteBatch`es of `PUT_BATCH`.
fn rocks_puts(db: &DB, w: &WriteOptions, n: u64, v: &[u8], mut next: impl FnMut() -> u64) {
    let mut done = 0;
    while done < n {
        let mut b = rocksdb::WriteBatch::default();
        for _ in 0..(PUT_BATCH as u64).min(n - done) {
            b.put(key(next()), v);
        }
        db.write_opt(b, w).expect("write");
        done += PUT_BATCH as u64;
    }
}

/// Copies every file of `from` missing (by name) in `to`; bytes copied.
fn copy_new_files(from: &std::path::Path, to: &std::path::Path) -> u64 {
    let mut bytes = 0;
    for e in std::fs::read_dir(from).expect("read checkpoint dir") {
        let e = e.expect("dir entry");
        let dst = to.join(e.file_name());
        if !dst.exists() {
            bytes += std::fs::copy(e.path(), &dst).expect("copy checkpoint file");
            // Durable, as an upload would be.
            std::fs::File::open(&dst)
                .and_then(|f| f.sync_all())
                .expect("sync copied file");
        }
    }
    bytes
}

/// The checkpoint suite's peer: the same state in RocksDB (partitioned
/// index/filters, WAL off); a checkpoint is `create_checkpoint` (flush and
/// hard links: the synchronous part) plus copying the files the previous
/// checkpoints did not have (an incremental upload); a restore copies the
/// checkpoint's files into a fresh directory and opens it.
pub fn checkpoint_peer(
    args: &crate::checkpoint::CheckpointArgs,
    r: &mut Reporter,
    mib: u64,
    write_mib: u64,
    rounds: usize,
) {
    const CK: &str = "checkpoint";
    let base = crate::store::bench_dir(args.dir.as_deref(), "rocks-ckpt-");
    let (dbp, remote) = (base.path().join("db"), base.path().join("remote"));
    std::fs::create_dir_all(&remote).expect("remote dir");
    let db = open(&dbp, 256 << 20, true);
    let w = write_opts();
    let keys = (mib << 20) / crate::checkpoint::RECORD;
    let v = crate::store::value(0, 100);
    let mut next = 0;
    rocks_puts(&db, &w, keys, &v, || {
        next += 1;
        next - 1
    });
    db.flush().expect("flush");
    let mut rng = Rng(0x5eed ^ mib);
    let per_round = (write_mib << 20) / crate::checkpoint::RECORD;
    let (mut sync_h, mut total_h) = (histogram(), histogram());
    let (mut sync_spent, mut total_spent, mut copied) = (Duration::ZERO, Duration::ZERO, 0u64);
    let mut last = None;
    for round in 1..=rounds {
        let v = crate::store::value(round as u64, 100);
        rocks_puts(&db, &w, per_round, &v, || rng.below(keys));
        let dir = base.path().join(format!("ck-{round}"));
        let t0 = Instant::now();
        rocksdb::checkpoint::Checkpoint::new(&db)
            .and_then(|c| c.create_checkpoint(&dir))
            .expect("create_checkpoint");
        let sync = t0.elapsed();
        copied += copy_new_files(&dir, &remote);
        let total = t0.elapsed();
        sync_spent += sync;
        total_spent += total;
        sync_h.record(sync.as_nanos() as u64).expect("in range");
        total_h.record(total.as_nanos() as u64).expect("in range");
        if let Some(old) = last.replace(dir) {
            let _ = std::fs::remove_dir_all(old);
        }
    }
    r.case(
        &Case::new(
            CK,
            format!("rocksdb-sync/{mib}MiB"),
            rounds as u64,
            sync_spent,
        )
        .latency(sync_h),
    );
    r.case(
        &Case::new(
            CK,
            format!("rocksdb-total/{mib}MiB"),
            rounds as u64,
            total_spent,
        )
        .latency(total_h)
        .with("copied_mib", copied >> 20),
    );
    drop(db);
    // Full-copy restore of the last checkpoint.
    let last = last.expect("at least one round");
    let mut h = histogram();
    let mut spent = Duration::ZERO;
    for rep in 0..3 {
        let to = base.path().join(format!("restore-{rep}"));
        std::fs::create_dir_all(&to).expect("restore dir");
        let t0 = Instant::now();
        copy_new_files(&last, &to);
        let db = open(&to, 256 << 20, true);
        let d = t0.elapsed();
        drop(db);
        spent += d;
        h.record(d.as_nanos() as u64).expect("in range");
        let _ = std::fs::remove_dir_all(&to);
    }
    r.case(&Case::new(CK, format!("rocksdb-restore/{mib}MiB"), 3, spent).latency(h));
}
