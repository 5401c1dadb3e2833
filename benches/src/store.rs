//! `stator-bench store`: the storage engine on one core against its peers
//! on the same data: std `HashMap` and hashbrown (what Flink's heap backend
//! is), and RocksDB with Flink's usual settings (cargo feature `rocksdb`).
//!
//! Keys are 16 bytes (a key-group prefix and a u64), values 100 bytes in
//! memory and 256 bytes for the larger-than-memory run; keys are drawn
//! uniformly at random by a seeded generator, the same for every system.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use slab::Slab;
use stator_store::io::UringIo;
use stator_store::{KeyRef, Op, Output, Store, StoreConfig, Submitted};

use crate::report::{Bound, Case, Reporter, histogram};

const SUITE: &str = "store";
pub(crate) const MAX_PARALLELISM: u64 = 128;

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// Finish in about a minute (smaller data sets, shorter runs).
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per case on stdout.
    #[arg(long)]
    pub json: bool,
    /// Keys of the in-memory workloads (default 5 M; quick 1 M).
    #[arg(long)]
    pub keys: Option<u64>,
    /// Keys of the larger-than-memory run (default 20 M x 256 B; quick 2 M).
    #[arg(long)]
    pub big_keys: Option<u64>,
    /// Memory budget of the larger-than-memory run, MiB (default 256; quick 32).
    #[arg(long)]
    pub big_budget_mib: Option<u64>,
    /// Seconds per depth in the larger-than-memory run (default 30; quick 5).
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Skip the larger-than-memory run.
    #[arg(long)]
    pub no_big: bool,
    /// Skip the in-memory run.
    #[arg(long)]
    pub no_memory: bool,
    /// Directory for data files (default: a temporary directory under ./target).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Keep the larger-than-memory data set in this directory and reuse it
    /// on later runs with the same key count (skips the load).
    #[arg(long)]
    pub reuse: Option<PathBuf>,
}

/// xorshift64*: fast, seeded, the same sequence for every system.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }
}

/// The 16-byte key of item `i`: key group (BE u16), 6 zero bytes, `i` (BE u64).
pub fn raw_key(i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..2].copy_from_slice(&((i % MAX_PARALLELISM) as u16).to_be_bytes());
    k[8..].copy_from_slice(&i.to_be_bytes());
    k
}

/// `n` uniform random gets of loaded keys `0..n`, one at a time (1 in
/// `SAMPLE` timed); every key must be found.
pub(crate) fn single_gets(
    s: &mut Store<UringIo>,
    suite: &'static str,
    name: &str,
    n: u64,
    seed: u64,
) -> Case {
    let mut rng = Rng(seed);
    let mut h = histogram();
    let (mut kb, mut out) = ([0u8; 8], [0u8; 4096]);
    let mut found = 0u64;
    let t = Instant::now();
    for op in 0..n {
        let i = rng.below(n);
        let t0 = (op % SAMPLE == 0).then(Instant::now);
        if let Ok(Submitted::Ready(Output::Value(Some(v)))) = s.submit(0, Op::Get(skey(i, &mut kb)))
        {
            out[..v.len()].copy_from_slice(v);
            found += 1;
        }
        if let Some(t0) = t0 {
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
        }
    }
    assert_eq!(found, n, "every key was loaded");
    std::hint::black_box(&out);
    Case::new(suite, name, n, t.elapsed()).latency(h)
}

/// `n` uniform random gets of loaded keys `0..n` through `submit_batch`,
/// `batch` at a time; every key must be found.
pub(crate) fn batched_gets(
    s: &mut Store<UringIo>,
    suite: &'static str,
    name: &str,
    n: u64,
    batch: usize,
    seed: u64,
) -> Case {
    let mut rng = Rng(seed);
    let tokens: Vec<u64> = (0..batch as u64).collect();
    let mut keys: Vec<[u8; 8]> = vec![[0; 8]; batch];
    let mut out = [0u8; 4096];
    let (mut found, mut done) = (0u64, 0u64);
    let t = Instant::now();
    while done < n {
        let m = batch.min((n - done) as usize);
        for k in keys.iter_mut().take(m) {
            *k = rng.below(n).to_be_bytes();
        }
        let ops: Vec<Op<'_>> = keys[..m]
            .iter()
            .map(|k| {
                Op::Get(KeyRef {
                    key_group: (u64::from_be_bytes(*k) % MAX_PARALLELISM) as u16,
                    state: 1,
                    key: k,
                    namespace: b"",
                })
            })
            .collect();
        s.submit_batch(&tokens[..m], &ops, |_, res| {
            if let Ok(Submitted::Ready(Output::Value(Some(v)))) = res {
                out[..v.len()].copy_from_slice(v);
                found += 1;
            }
        });
        done += m as u64;
    }
    assert_eq!(found, n, "every key was loaded");
    std::hint::black_box(&out);
    Case::new(suite, name, n, t.elapsed()).with("batch", batch)
}

/// The same key as Stator takes it: key group, state 1, key bytes `i`.
pub(crate) fn skey(i: u64, buf: &mut [u8; 8]) -> KeyRef<'_> {
    *buf = i.to_be_bytes();
    KeyRef {
        key_group: (i % MAX_PARALLELISM) as u16,
        state: 1,
        key: buf,
        namespace: b"",
    }
}

pub(crate) fn value(i: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    for (j, b) in v.iter_mut().enumerate() {
        *b = (i as usize).wrapping_add(j) as u8;
    }
    v
}

/// A fresh directory for one system's data under `base` (default
/// `./target/bench-data`), removed when dropped.
pub fn bench_dir(base: Option<&Path>, name: &str) -> tempfile::TempDir {
    let base = base.unwrap_or(Path::new("target/bench-data"));
    std::fs::create_dir_all(base).expect("create bench data dir");
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(base)
        .expect("temp dir")
}

/// Times every 8th operation: an `Instant` pair costs ~40 ns, too much to
/// pay on every ~100 ns operation, and a 1-in-8 sample keeps the tails.
const SAMPLE: u64 = 8;
/// Puts per batch in the batched load (Stator `submit_batch`, RocksDB `WriteBatch`).
pub const PUT_BATCH: usize = 64;

pub fn run(args: StoreArgs) {
    let q = args.quick;
    let n = args.keys.unwrap_or(if q { 1_000_000 } else { 5_000_000 });
    let big_n = args
        .big_keys
        .unwrap_or(if q { 2_000_000 } else { 20_000_000 });
    let big_budget = args.big_budget_mib.unwrap_or(if q { 32 } else { 256 }) << 20;
    let secs = args.seconds.unwrap_or(if q { 5 } else { 30 });
    let mut r = Reporter::new(args.json);
    r.machine(
        SUITE,
        json!({"quick": q, "keys": n, "value_bytes": 100, "big_keys": big_n, "big_value_bytes": 256,
               "big_budget_mib": big_budget >> 20, "seconds_per_depth": secs, "rocksdb": cfg!(feature = "rocksdb"),
               "io": "io_uring, O_DIRECT", "threads": 1}),
    );
    if !args.no_memory {
        in_memory(&args, &mut r, n);
    }
    if !args.no_big {
        larger_than_memory(&args, &mut r, big_n, big_budget as usize, secs);
    }
}

struct Ratios {
    stator_get: f64,
    stator_batch_get: f64,
    stator_put: f64,
    stator_batch_put: f64,
    hashbrown_get: f64,
    rocks_get: Option<f64>,
    rocks_put: Option<f64>,
    rocks_batch_put: Option<f64>,
}

fn in_memory(args: &StoreArgs, r: &mut Reporter, n: u64) {
    let dir = bench_dir(args.dir.as_deref(), "mem-");
    let mut cfg = StoreConfig::new(dir.path(), (n as usize * 700).max(256 << 20));
    cfg.memtable_bytes = Some(n as usize * 300);
    let (mut s, _) =
        Store::open(cfg, UringIo::new(256, true).expect("io_uring")).expect("open store");
    let v100: Vec<Vec<u8>> = (0..256).map(|i| value(i, 100)).collect();
    let mut kb = [0u8; 8];
    let mut out = [0u8; 256];

    // Load: the first half one put at a time, the second half in batches
    // of 64, as a shard applies a drained queue.
    let half = n / 2;
    let t = Instant::now();
    for i in 0..half {
        s.submit(0, Op::Put(skey(i, &mut kb), &v100[(i % 256) as usize]))
            .expect("put");
    }
    let c = Case::new(SUITE, "mem_load_stator", half, t.elapsed()).with("keys", half);
    let stator_put = c.ops_per_sec;
    r.case(&c);
    let t = Instant::now();
    let mut keys = [[0u8; 8]; PUT_BATCH];
    let tokens = [0u64; PUT_BATCH];
    let mut i = half;
    while i < n {
        let m = PUT_BATCH.min((n - i) as usize);
        for (j, k) in keys.iter_mut().take(m).enumerate() {
            *k = (i + j as u64).to_be_bytes();
        }
        let ops: Vec<Op<'_>> = keys[..m]
            .iter()
            .map(|k| {
                let x = u64::from_be_bytes(*k);
                Op::Put(
                    KeyRef {
                        key_group: (x % MAX_PARALLELISM) as u16,
                        state: 1,
                        key: k,
                        namespace: b"",
                    },
                    &v100[(x % 256) as usize],
                )
            })
            .collect();
        s.submit_batch(&tokens[..m], &ops, |_, res| {
            res.expect("put");
        });
        i += m as u64;
    }
    let c = Case::new(
        SUITE,
        format!("mem_load_batch{PUT_BATCH}_stator"),
        n - half,
        t.elapsed(),
    )
    .with("keys", n - half)
    .with("batch", PUT_BATCH);
    let stator_batch_put = c.ops_per_sec;
    r.case(&c);

    // Random gets, one at a time, then in batches whose memory loads
    // overlap.
    let c = single_gets(&mut s, SUITE, "mem_get_stator", n, 42).with("keys", n);
    r.case(&c);
    let stator_get = c.ops_per_sec;
    let mut stator_batch_get = 0.0;
    for batch in [16usize, 64] {
        let c = batched_gets(
            &mut s,
            SUITE,
            &format!("mem_get_batch{batch}_stator"),
            n,
            batch,
            43,
        );
        stator_batch_get = f64::max(stator_batch_get, c.ops_per_sec);
        r.case(&c);
    }

    // 50/50 get/put.
    {
        let mut rng = Rng(44);
        let mut h = histogram();
        let t = Instant::now();
        for op in 0..n {
            let i = rng.below(n);
            let t0 = (op % SAMPLE == 0).then(Instant::now);
            if op % 2 == 0 {
                if let Ok(Submitted::Ready(Output::Value(Some(v)))) =
                    s.submit(0, Op::Get(skey(i, &mut kb)))
                {
                    out[..v.len()].copy_from_slice(v);
                }
            } else {
                s.submit(0, Op::Put(skey(i, &mut kb), &v100[(op % 256) as usize]))
                    .expect("put");
            }
            if let Some(t0) = t0 {
                h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            }
        }
        r.case(&Case::new(SUITE, "mem_get_put_50_50_stator", n, t.elapsed()).latency(h));
    }

    // List appends (a window operator's state), one 100-byte element at
    // a time to random lists of the same keys: each is a blind merge
    // whose list length is checked against the cap.
    {
        let appends = n / 2;
        let mut rng = Rng(45);
        let mut h = histogram();
        let t = Instant::now();
        for op in 0..appends {
            let mut k = skey(rng.below(n), &mut kb);
            k.state = 2;
            let t0 = (op % SAMPLE == 0).then(Instant::now);
            s.submit(0, Op::ListAppend(k, &v100[(op % 256) as usize]))
                .expect("append");
            if let Some(t0) = t0 {
                h.record(t0.elapsed().as_nanos() as u64).expect("in range");
            }
        }
        r.case(&Case::new(SUITE, "mem_list_append_stator", appends, t.elapsed()).latency(h));
    }
    let m = s.memory();
    r.note(
        SUITE,
        "mem_stator_memory_used_mib",
        m.total() as f64 / (1 << 20) as f64,
        Bound::AtMost((m.budget >> 20) as f64),
    );
    drop(s);
    drop(dir);

    // Peers: std HashMap and hashbrown, values on the heap as a heap
    // backend keeps them.
    let hashbrown_get =
        map_peer::<hashbrown::HashMap<[u8; 16], Vec<u8>>>(SUITE, r, n, "hashbrown", &v100);
    map_peer::<HashMap<[u8; 16], Vec<u8>>>(SUITE, r, n, "std_hashmap", &v100);

    #[cfg(feature = "rocksdb")]
    let (rocks_get, rocks_put, rocks_batch_put) = {
        let (g, p, b) = crate::rocks::in_memory(args, r, n, &v100);
        (Some(g), Some(p), Some(b))
    };
    #[cfg(not(feature = "rocksdb"))]
    let (rocks_get, rocks_put, rocks_batch_put) = (None::<f64>, None::<f64>, None::<f64>);

    let x = Ratios {
        stator_get,
        stator_batch_get,
        stator_put,
        stator_batch_put,
        hashbrown_get,
        rocks_get,
        rocks_put,
        rocks_batch_put,
    };
    if !r.json {
        println!("# in-memory ratios and floors");
    }
    r.note(
        SUITE,
        "mem_get_stator_vs_hashbrown",
        x.stator_get / x.hashbrown_get,
        Bound::AtLeast(0.5),
    );
    r.note(
        SUITE,
        "mem_get_batch_stator_vs_hashbrown",
        x.stator_batch_get / x.hashbrown_get,
        Bound::AtLeast(0.5),
    );
    match (x.rocks_get, x.rocks_put, x.rocks_batch_put) {
        (Some(g), Some(p), Some(bp)) => {
            r.note(
                SUITE,
                "mem_get_stator_vs_rocksdb_get",
                x.stator_get / g,
                Bound::AtLeast(5.0),
            );
            r.note(
                SUITE,
                "mem_put_stator_vs_rocksdb_put",
                x.stator_put / p,
                Bound::AtLeast(5.0),
            );
            r.note(
                SUITE,
                "mem_put_batch_stator_vs_rocksdb_put",
                x.stator_batch_put / p,
                Bound::AtLeast(5.0),
            );
            r.note(
                SUITE,
                "mem_put_batch_stator_vs_rocksdb_write_batch",
                x.stator_batch_put / bp,
                Bound::None,
            );
        }
        _ => {
            if !r.json {
                println!("  (RocksDB peer not built: rebuild with --features rocksdb, see README)");
            }
        }
    }
}

/// The operations a hash-map peer needs.
pub trait MapPeer: Default {
    fn put(&mut self, k: [u8; 16], v: Vec<u8>);
    fn get(&self, k: &[u8; 16]) -> Option<&Vec<u8>>;
}

impl MapPeer for hashbrown::HashMap<[u8; 16], Vec<u8>> {
    fn put(&mut self, k: [u8; 16], v: Vec<u8>) {
        self.insert(k, v);
    }
    fn get(&self, k: &[u8; 16]) -> Option<&Vec<u8>> {
        hashbrown::HashMap::get(self, k)
    }
}

impl MapPeer for HashMap<[u8; 16], Vec<u8>> {
    fn put(&mut self, k: [u8; 16], v: Vec<u8>) {
        self.insert(k, v);
    }
    fn get(&self, k: &[u8; 16]) -> Option<&Vec<u8>> {
        HashMap::get(self, k)
    }
}

pub(crate) fn map_peer<M: MapPeer>(
    suite: &'static str,
    r: &mut Reporter,
    n: u64,
    name: &str,
    v100: &[Vec<u8>],
) -> f64 {
    let mut m = M::default();
    let t = Instant::now();
    for i in 0..n {
        m.put(raw_key(i), v100[(i % 256) as usize].clone());
    }
    r.case(&Case::new(
        suite,
        format!("mem_load_{name}"),
        n,
        t.elapsed(),
    ));
    let mut rng = Rng(42);
    let mut h = histogram();
    let mut out = [0u8; 256];
    let t = Instant::now();
    let mut found = 0;
    for op in 0..n {
        let k = raw_key(rng.below(n));
        let t0 = (op % SAMPLE == 0).then(Instant::now);
        if let Some(v) = m.get(&k) {
            out[..v.len()].copy_from_slice(v);
            found += 1;
        }
        if let Some(t0) = t0 {
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
        }
    }
    assert_eq!(found, n);
    std::hint::black_box(&out);
    let c = Case::new(suite, format!("mem_get_{name}"), n, t.elapsed()).latency(h);
    r.case(&c);
    // 50/50 get/put, the same sequence as Stator's.
    let mut rng = Rng(44);
    let mut h = histogram();
    let t = Instant::now();
    for op in 0..n {
        let k = raw_key(rng.below(n));
        let t0 = (op % SAMPLE == 0).then(Instant::now);
        if op % 2 == 0 {
            if let Some(v) = m.get(&k) {
                out[..v.len()].copy_from_slice(v);
            }
        } else {
            m.put(k, v100[(op % 256) as usize].clone());
        }
        if let Some(t0) = t0 {
            h.record(t0.elapsed().as_nanos() as u64).expect("in range");
        }
    }
    std::hint::black_box(&out);
    r.case(&Case::new(suite, format!("mem_get_put_50_50_{name}"), n, t.elapsed()).latency(h));
    c.ops_per_sec
}

fn larger_than_memory(args: &StoreArgs, r: &mut Reporter, n: u64, budget: usize, secs: u64) {
    let tmp;
    let path = match &args.reuse {
        Some(p) => {
            std::fs::create_dir_all(p).expect("create --reuse dir");
            p.clone()
        }
        None => {
            tmp = bench_dir(args.dir.as_deref(), "big-");
            tmp.path().to_path_buf()
        }
    };
    let marker = path.join(format!("loaded-{n}"));
    let mut cfg = StoreConfig::new(&path, budget);
    cfg.work_per_poll = 8192;
    // A bulk load: nothing waits on the flushes' steps.
    cfg.background_slice = Duration::from_millis(20);
    let v256: Vec<Vec<u8>> = (0..256).map(|i| value(i, 256)).collect();
    let mut kb = [0u8; 8];
    if !marker.exists() {
        let (mut s, _) = Store::open(cfg.clone(), UringIo::new(256, true).expect("io_uring"))
            .expect("open store");
        let t = Instant::now();
        let mut rng = Rng(7);
        for op in 0..n {
            // Insert in a random order (a permutation by multiplication
            // modulo a power of two would do; a random walk is closer to a
            // stream's arrival order).
            let i = if op % 2 == 0 { op } else { rng.below(n) };
            s.submit(0, Op::Put(skey(i, &mut kb), &v256[(i % 256) as usize]))
                .expect("put");
            if op % 4096 == 0 {
                s.poll(|_, _| {});
            }
        }
        // Keys skipped by the random half are written now, so all exist.
        for i in (1..n).step_by(2) {
            s.submit(0, Op::Put(skey(i, &mut kb), &v256[(i % 256) as usize]))
                .expect("put");
            if i % 4096 == 1 {
                s.poll(|_, _| {});
            }
        }
        s.flush();
        s.settle();
        // One segment holding everything, so that fio can read the very
        // same file the store reads.
        s.compact_all();
        s.settle();
        let st = s.stats();
        let c = Case::new(SUITE, "big_load_stator", n + n / 2, t.elapsed())
            .with("segments", st.segments)
            .with("segment_bytes", st.segment_bytes)
            .with("flushes", st.flushes)
            .with("compactions", st.compactions);
        r.case(&c);
        std::fs::write(&marker, b"").expect("write load marker");
    }

    // The peer's data set, loaded before either side reads, so that its
    // reads run between Stator's at depth 32 (the disk drifts in minutes).
    #[cfg(feature = "rocksdb")]
    let peer = crate::rocks::BigPeer::load(args, r, n, budget, &v256);

    // Reopen cold: the page cache is bypassed (O_DIRECT) and the block
    // cache starts empty.
    let (mut s, _) = Store::open(cfg, UringIo::new(1024, true).expect("io_uring")).expect("reopen");
    // Measure reads alone: finish any compaction the reopened store starts.
    s.settle();
    let st = s.stats();
    if !r.json {
        println!(
            "# reopened: {} segments, {:.2} GB on disk",
            st.segments,
            st.segment_bytes as f64 / 1e9
        );
    }
    // The disk's speed drifts (the VM host caches what was read lately),
    // so each depth runs Stator, then fio on the same segment files (and
    // at depth 32 RocksDB's get and multi_get), then Stator again; the
    // ratios take the mean of the two Stator runs.
    #[cfg(feature = "rocksdb")]
    let mut rocks = (0.0, 0.0);
    for depth in [1usize, 32, 256] {
        let a = stator_depth(
            &mut s,
            n,
            depth,
            SHARD_BATCH,
            Duration::from_secs(secs),
            "a",
        )
        .named(SUITE, format!("big_get_depth{depth}_stator_a"));
        r.case(&a);
        let f = fio(r, &path, depth, secs.min(10));
        #[cfg(feature = "rocksdb")]
        if depth == 32 {
            rocks = (peer.get1(r, secs, 99), peer.multi_get32(r, secs, 98));
        }
        let b = stator_depth(
            &mut s,
            n,
            depth,
            SHARD_BATCH,
            Duration::from_secs(secs),
            "b",
        )
        .named(SUITE, format!("big_get_depth{depth}_stator_b"));
        r.case(&b);
        let mean = (a.ops_per_sec + b.ops_per_sec) / 2.0;
        #[cfg(feature = "rocksdb")]
        if depth == 32 {
            r.note(
                SUITE,
                "big_get_depth32_stator_vs_rocksdb_get",
                mean / rocks.0,
                Bound::AtLeast(3.0),
            );
            r.note(
                SUITE,
                "big_get_depth32_stator_vs_rocksdb_multi_get",
                mean / rocks.1,
                Bound::AtLeast(1.0),
            );
        }
        if let Some(f) = f {
            let bound = if depth == 32 {
                Bound::AtLeast(0.8)
            } else {
                Bound::None
            };
            r.note(
                SUITE,
                &format!("big_get_depth{depth}_stator_vs_fio_iops"),
                mean / f,
                bound,
            );
        }
    }
    let m = s.memory();
    r.note(
        SUITE,
        "big_stator_memory_used_mib",
        m.total() as f64 / (1 << 20) as f64,
        Bound::AtMost((budget >> 20) as f64),
    );
    drop(s);
    #[cfg(not(feature = "rocksdb"))]
    if !r.json {
        println!("  (RocksDB peer not built: rebuild with --features rocksdb, see README)");
    }
}

/// New requests a shard takes from a session per pass (statord's default
/// `session.batch`).
pub(crate) const SHARD_BATCH: usize = 64;

/// Random gets of keys `0..n` (loaded with `skey`) kept `depth` in flight
/// for `dur`; a case to be named by the caller. The loop is a shard's:
/// at most `batch` new gets per pass go through `submit_batch` (the
/// daemon's `session.batch`), then the store is polled, so a pass's I/O is
/// sent while the next pass is prepared instead of after every refill.
pub(crate) fn stator_depth(
    s: &mut Store<UringIo>,
    n: u64,
    depth: usize,
    batch: usize,
    dur: Duration,
    run: &str,
) -> Case {
    // A different seed per run: a repeated sequence would hit the cache.
    let mut rng = Rng(99 + depth as u64 + run.bytes().map(|b| b as u64 * 1000).sum::<u64>());
    let mut h = histogram();
    let mut started: Slab<Instant> = Slab::with_capacity(depth);
    let batch = batch.max(1);
    let mut kbs = vec![[0u8; 8]; batch];
    let mut tokens: Vec<u64> = Vec::with_capacity(batch);
    let mut done = 0u64;
    let mut missing = 0u64;
    let mut errors = 0u64;
    let reads_before = s.stats().block_reads;
    let (hits_before, misses_before) = (s.stats().cache_hits, s.stats().cache_misses);
    let t = Instant::now();
    let end = t + dur;
    while Instant::now() < end {
        let want = depth.saturating_sub(started.len()).min(batch);
        if want > 0 {
            let now = Instant::now();
            tokens.clear();
            for kb in kbs.iter_mut().take(want) {
                *kb = rng.below(n).to_be_bytes();
                tokens.push(started.insert(now) as u64);
            }
            let ops: Vec<Op<'_>> = kbs[..want]
                .iter()
                .map(|kb| {
                    let i = u64::from_be_bytes(*kb);
                    Op::Get(KeyRef {
                        key_group: (i % MAX_PARALLELISM) as u16,
                        state: 1,
                        key: kb,
                        namespace: b"",
                    })
                })
                .collect();
            s.submit_batch(&tokens, &ops, |i, res| match res {
                Ok(Submitted::Ready(o)) => {
                    started.remove(tokens[i] as usize);
                    h.record(now.elapsed().as_nanos().max(1) as u64)
                        .expect("in range");
                    done += 1;
                    missing += matches!(o, Output::Value(None)) as u64;
                }
                Ok(Submitted::Pending) => {}
                Err(_) => {
                    started.remove(tokens[i] as usize);
                    errors += 1;
                }
            });
        }
        let got = s.poll(|tok, res| {
            let t0 = started.remove(tok as usize);
            h.record(t0.elapsed().as_nanos().max(1) as u64)
                .expect("in range");
            match res {
                Ok(Output::Value(None)) => missing += 1,
                Ok(_) => {}
                Err(_) => errors += 1,
            }
        });
        done += got as u64;
        if got == 0 && started.len() >= depth {
            let _ = s.wait(Some(Duration::from_millis(1)));
        }
    }
    // Drain what is still in flight (not counted).
    s.drain(false, |tok, _| {
        started.remove(tok as usize);
    });
    assert_eq!(errors, 0, "reads failed");
    assert_eq!(missing, 0, "loaded keys not found");
    let st = s.stats();
    let (hits, misses) = (st.cache_hits - hits_before, st.cache_misses - misses_before);
    let hit = hits as f64 / (hits + misses).max(1) as f64;
    let reads_per_get = (st.block_reads - reads_before) as f64 / done.max(1) as f64;
    Case::new(SUITE, String::new(), done, t.elapsed())
        .latency(h)
        .with("in_flight", depth)
        .with("cache_hit_ratio", (hit * 1000.0).round() / 1000.0)
        .with(
            "block_reads_per_get",
            (reads_per_get * 1000.0).round() / 1000.0,
        )
}

/// fio reads the store's largest segment file (read-only, 4 KiB random
/// O_DIRECT reads through io_uring): the same bytes on the same disk in the
/// same cache state, so the ratio measures Stator's overhead, not the
/// difference between a freshly written file (which the VM's host may still
/// cache) and an older one.
fn fio(r: &mut Reporter, dir: &Path, d: usize, secs: u64) -> Option<f64> {
    if std::process::Command::new("fio")
        .arg("--version")
        .output()
        .is_err()
    {
        if !r.json {
            println!("  (fio not installed: apt-get install fio)");
        }
        return None;
    }
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sst"))
        .map(|p| p.display().to_string())
        .collect();
    // The largest segment only: fio splits its range evenly over several
    // files, and reads past the end of a smaller one return at once.
    files.sort_by_key(|f| std::cmp::Reverse(std::fs::metadata(f).map(|m| m.len()).unwrap_or(0)));
    files.truncate(1);
    let size: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    {
        let out = std::process::Command::new("fio")
            .args([
                "--name=randread",
                "--rw=randread",
                "--bs=4k",
                "--direct=1",
                "--ioengine=io_uring",
                "--time_based",
                "--output-format=json",
                // A fresh random sequence each run: fio's default seed
                // repeats the same offsets every time, which the VM's host
                // then serves from its cache (p50 48 us instead of 200+).
                "--randrepeat=0",
            ])
            .arg("--readonly")
            .arg(format!("--filename={}", files.join(":")))
            .arg(format!("--iodepth={d}"))
            .arg(format!("--runtime={secs}"))
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        let read = &v["jobs"][0]["read"];
        let iops = read["iops"].as_f64()?;
        let mut c = Case {
            suite: SUITE,
            case: format!("big_fio_randread_4k_depth{d}"),
            ops_per_sec: iops,
            latency_ns: None,
            extra: Default::default(),
        };
        c = c.with("in_flight", d).with("file_bytes", size);
        if let Some(p) = read["clat_ns"]["percentile"].as_object() {
            c = c
                .with("p50_ns", p.get("50.000000").cloned().unwrap_or_default())
                .with("p99_ns", p.get("99.000000").cloned().unwrap_or_default())
                .with("p999_ns", p.get("99.900000").cloned().unwrap_or_default());
        }
        r.case(&c);
        Some(iops)
    }
}
