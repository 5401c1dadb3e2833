//! `stator-bench checkpoint`: checkpoints are metadata, restores are
//! references. For each state size (default 100 MiB, 1 GiB, 4 GiB of
//! 16-byte keys and 100-byte values) the same amount is written between
//! checkpoints; the synchronous part (what the session waits for) and the
//! total (until the handle is durable) are timed per checkpoint. Then
//! restore (1 -> 1) and rescale (1 -> 4, 4 -> 1) are timed. All of them
//! should be flat in state size. The store runs over io_uring with
//! O_DIRECT, one thread, a 256 MiB memory budget.
//!
//! Portable snapshots: after the checkpoint rounds (before the restores),
//! the whole state is exported into a 4 MiB chunk slot
//! (timed per chunk), then up to 256 MiB of the chunks are imported into a
//! fresh store (until installed and durable). Both are compared, in GB/s,
//! with the limit of the same bytes: memcpy into a slot plus CRC32C, from
//! a buffer larger than the caches, measured in the same run, and the
//! export with the disk's own sequential O_DIRECT read of the store's files
//! (an export from disk reads no faster). `--compact` exports one
//! compacted layer instead (no merge: the best case).
//! `export-first-chunk` times an export's first chunk taken right after
//! the same amount of writes as between checkpoints, three times: the
//! memtable they filled is frozen by the export and read where it is.
//!
//! The RocksDB peer (cargo feature `rocksdb`) checkpoints the same state
//! the way an incremental snapshot does: `create_checkpoint` (hard links
//! plus a flush) and a copy of the files the previous checkpoint did not
//! have; its restore copies the checkpoint back and opens it.

use std::time::{Duration, Instant};

use serde_json::json;
use stator_store::io::UringIo;
use stator_store::snapshot::{CHUNK_LEN, StateDesc};
use stator_store::{
    CheckpointSpec, ExportSpec, Fill, ImportSpec, ImportStep, Notify, Op, RestoreSpec, StateKind,
    Store, StoreConfig,
};

use crate::report::{Bound, Case, Reporter, histogram};
use crate::store::{PUT_BATCH, Rng, bench_dir, skey, value};

const SUITE: &str = "checkpoint";
const OWNER: &[u8] = b"bench\0op";
const KGS: u16 = 128;
const VALUE: usize = 100;
/// Bytes a record takes in a segment (key, value, headers), for sizing.
pub const RECORD: u64 = 16 + VALUE as u64 + 8;

#[derive(clap::Args, Debug, Clone)]
pub struct CheckpointArgs {
    /// Finish in about a minute (smaller states, fewer rounds).
    #[arg(long)]
    pub quick: bool,
    /// One JSON object per case on stdout.
    #[arg(long)]
    pub json: bool,
    /// State sizes, MiB (default 100,1024,4096; quick 16,64,256).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Option<Vec<u64>>,
    /// MiB written between two checkpoints (default 16; quick 4).
    #[arg(long)]
    pub write_mib: Option<u64>,
    /// Checkpoints per size (default 20; quick 8).
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Compact the state into one layer before the portable export (its
    /// best case: one sorted run, no merge).
    #[arg(long)]
    pub compact: bool,
    /// Directory for data files (default: a temporary directory under ./target).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
}

pub fn run(args: CheckpointArgs) {
    let q = args.quick;
    let sizes = args.sizes.clone().unwrap_or(if q {
        vec![16, 64, 256]
    } else {
        vec![100, 1024, 4096]
    });
    let write_mib = args.write_mib.unwrap_or(if q { 4 } else { 16 });
    let rounds = args.rounds.unwrap_or(if q { 8 } else { 20 });
    let mut r = Reporter::new(args.json);
    r.machine(
        SUITE,
        json!({"quick": q, "sizes_mib": sizes, "write_mib_between": write_mib, "rounds": rounds,
               "key_bytes": 16, "value_bytes": VALUE, "budget_mib": 256, "io": "io_uring, O_DIRECT",
               "threads": 1, "rocksdb": cfg!(feature = "rocksdb")}),
    );
    let mut flat: Vec<(u64, [u64; 5])> = Vec::new();
    for &mib in &sizes {
        let p50 = stator_size(&args, &mut r, mib, write_mib, rounds);
        // A snapshot's share of what the bytes' copy and checksum allow.
        for (what, ratio) in &p50.1 {
            r.note(
                SUITE,
                &format!("{what} GB/s over memcpy+crc32c GB/s at {mib} MiB"),
                *ratio,
                Bound::AtLeast(0.5),
            );
        }
        let p50 = p50.0;
        #[cfg(feature = "rocksdb")]
        crate::rocks::checkpoint_peer(&args, &mut r, mib, write_mib, rounds.min(8));
        flat.push((mib, p50));
    }
    // Flat in state size: the largest size's median over the smallest's.
    if let (Some((a, first)), Some((b, last))) = (flat.first(), flat.last())
        && a != b
    {
        for (i, what) in ["sync", "total", "restore", "rescale 1->4", "rescale 4->1"]
            .iter()
            .enumerate()
        {
            let ratio = last[i] as f64 / first[i].max(1) as f64;
            r.note(
                SUITE,
                &format!("{what} p50 at {b} MiB / at {a} MiB"),
                ratio,
                Bound::None,
            );
        }
        r.note(
            SUITE,
            &format!("sync p50 ms at {b} MiB"),
            last[0] as f64 / 1e6,
            Bound::AtMost(5.0),
        );
    }
}

fn spec(id: u64, lo: u16, hi: u16) -> CheckpointSpec {
    CheckpointSpec {
        owner: OWNER.to_vec(),
        checkpoint_id: id,
        lo,
        hi,
        states: vec![1],
        meta: Vec::new(),
    }
}

/// Runs `store` until `token` completes; its handle.
fn wait_for(s: &mut Store<UringIo>, token: u64) -> Vec<u8> {
    let mut got = None;
    while got.is_none() {
        s.poll(|t, res| {
            if t == token {
                got = Some(match res {
                    Ok(stator_store::Output::Value(Some(h))) => h.to_vec(),
                    other => panic!("checkpoint failed: {other:?}"),
                });
            }
        });
        if got.is_none() && !s.background_runnable() {
            let _ = s.wait(Some(Duration::from_millis(1)));
        }
    }
    got.expect("set above")
}

/// `n` puts of the keys `next` gives, through `submit_batch`, polling
/// between batches so background work keeps pace.
fn puts(s: &mut Store<UringIo>, n: u64, v: &[u8], mut next: impl FnMut() -> u64) {
    let tokens: Vec<u64> = (0..PUT_BATCH as u64).collect();
    let mut kbs = vec![[0u8; 8]; PUT_BATCH];
    let mut done = 0;
    while done < n {
        let m = PUT_BATCH.min((n - done) as usize);
        let ids: Vec<u64> = (0..m).map(|_| next()).collect();
        let ops: Vec<Op<'_>> = ids
            .iter()
            .zip(kbs.iter_mut())
            .map(|(&i, kb)| Op::Put(skey(i, kb), v))
            .collect();
        s.submit_batch(&tokens[..m], &ops, |_, r| {
            r.expect("put");
        });
        s.poll(|_, _| {});
        done += m as u64;
    }
}

fn settle(s: &mut Store<UringIo>) {
    while s.busy() {
        s.settle();
        if s.busy() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Fills export `id`'s next chunk into `slot`, polling the store while
/// the export waits for reads: its length and whether it is the last.
fn next_chunk(s: &mut Store<UringIo>, id: usize, slot: &mut [u8]) -> (usize, bool) {
    loop {
        match s.export_fill(id, slot).expect("export") {
            Fill::Chunk { len, last } => return (len, last),
            Fill::Again => {}
            Fill::Wait => {
                s.poll(|_, _| {});
                if !s.background_runnable() {
                    let _ = s.wait(Some(Duration::from_micros(200)));
                }
            }
        }
    }
}

/// The export of the whole state (snapshot `id`).
fn export_spec(id: u64) -> ExportSpec {
    ExportSpec {
        owner: OWNER.to_vec(),
        snapshot_id: id,
        lo: 0,
        hi: KGS - 1,
        states: vec![StateDesc {
            id: 1,
            kind: StateKind::Value,
            name: b"v".to_vec(),
        }],
    }
}

/// Times the first chunk of an export taken right after `write_mib` of
/// puts, with the memtable they filled frozen by the export (it is read
/// where it is; an export used to wait for its flush).
fn export_after_writes(
    s: &mut Store<UringIo>,
    r: &mut Reporter,
    mib: u64,
    write_mib: u64,
    mut next_key: impl FnMut() -> u64,
) {
    let reps = 3;
    let mut h = histogram();
    let mut spent = Duration::ZERO;
    let mut slot = vec![0u8; CHUNK_LEN];
    for rep in 0..reps {
        puts(
            s,
            (write_mib << 20) / RECORD,
            &value(1 << 20 | rep, VALUE),
            &mut next_key,
        );
        let t0 = Instant::now();
        let id = s.export(export_spec(mib + 2 + rep)).expect("export");
        next_chunk(s, id, &mut slot);
        let d = t0.elapsed();
        spent += d;
        h.record(d.as_nanos() as u64).expect("in range");
        s.export_cancel(id);
        settle(s);
    }
    r.case(
        &Case::new(SUITE, format!("export-first-chunk/{mib}MiB"), reps, spent)
            .latency(h)
            .with("written_mib", write_mib),
    );
}

/// Bytes of exported chunks kept for the import and the limit.
const KEEP: usize = 256 << 20;

/// Exports the whole state, imports up to [`KEEP`] bytes of it into a new
/// store, and measures memcpy + CRC32C of the kept bytes. Returns the
/// export's and the import's GB/s over the limit's.
fn portable(
    args: &CheckpointArgs,
    s: &mut Store<UringIo>,
    r: &mut Reporter,
    mib: u64,
    dir: &std::path::Path,
) -> Vec<(&'static str, f64)> {
    let spec = export_spec(mib);
    let mut slot = vec![0u8; CHUNK_LEN];
    let mut kept: Vec<Vec<u8>> = Vec::new();
    let (mut bytes, mut kept_bytes) = (0usize, 0usize);
    let mut h = histogram();
    let t0 = Instant::now();
    let id = s.export(spec.clone()).expect("export");
    let mut aside = Duration::ZERO;
    let mut chunk_t = Instant::now();
    loop {
        let (len, last) = next_chunk(s, id, &mut slot);
        h.record(chunk_t.elapsed().as_nanos() as u64)
            .expect("in range");
        bytes += len;
        // Keeping a copy is the bench's business, not the export's (the
        // engine hands the chunk on from the slot).
        let tk = Instant::now();
        if kept_bytes + len <= KEEP {
            kept.push(slot[..len].to_vec());
            kept_bytes += len;
        }
        aside += tk.elapsed();
        if last {
            break;
        }
        chunk_t = Instant::now();
    }
    let export = t0.elapsed() - aside;
    let gbs = |b: usize, d: Duration| b as f64 / d.as_secs_f64() / 1e9;
    let export_gbs = gbs(bytes, export);
    r.case(
        &Case::new(SUITE, format!("export/{mib}MiB"), h.len(), export)
            .latency(h)
            .with("gb_per_s", (export_gbs * 100.0).round() / 100.0)
            .with("mib", bytes >> 20),
    );
    // What the disk gives: the store's files read front to back with
    // O_DIRECT in 4 MiB reads (an export reads no faster).
    let (disk_bytes, disk) = disk_read(dir);
    r.note(
        SUITE,
        &format!("export GB/s over disk-read GB/s at {mib} MiB"),
        export_gbs / gbs(disk_bytes, disk),
        Bound::None,
    );
    r.case(
        &Case::new(
            SUITE,
            format!("disk-read/{mib}MiB"),
            (disk_bytes >> 22) as u64,
            disk,
        )
        .with("gb_per_s", (gbs(disk_bytes, disk) * 100.0).round() / 100.0),
    );
    // The limit: the kept bytes copied into a slot and checksummed, chunk
    // by chunk, as often as it takes to cover the exported bytes.
    let mut h = histogram();
    let mut crc = 0u32;
    let t0 = Instant::now();
    let mut done = 0;
    while done < bytes {
        for c in &kept {
            let t = Instant::now();
            slot[..c.len()].copy_from_slice(c);
            crc ^= crc32c::crc32c(&slot[..c.len()]);
            h.record(t.elapsed().as_nanos() as u64).expect("in range");
            done += c.len();
            if done >= bytes {
                break;
            }
        }
    }
    let limit = t0.elapsed();
    std::hint::black_box(crc);
    let limit_gbs = gbs(done, limit);
    r.case(
        &Case::new(SUITE, format!("memcpy+crc32c/{mib}MiB"), h.len(), limit)
            .latency(h)
            .with("gb_per_s", (limit_gbs * 100.0).round() / 100.0),
    );
    // The import needs a whole stream: the full export if it was kept,
    // else an export of as many key groups as fit the kept size.
    if kept_bytes < bytes {
        let hi = ((KGS as usize * KEEP / bytes).max(1) - 1) as u16;
        let id = s
            .export(ExportSpec {
                hi,
                snapshot_id: mib + 1,
                ..spec
            })
            .expect("export");
        kept.clear();
        kept_bytes = 0;
        loop {
            let (len, last) = next_chunk(s, id, &mut slot);
            kept.push(slot[..len].to_vec());
            kept_bytes += len;
            if last {
                break;
            }
        }
    }
    // Import them into a fresh store, until installed.
    let dir = bench_dir(args.dir.as_deref(), "import-");
    let (mut t, _) = Store::open(
        StoreConfig::new(dir.path(), 256 << 20),
        UringIo::new(4096, true).expect("io_uring"),
    )
    .expect("open");
    let spec = ImportSpec {
        owner: OWNER.to_vec(),
        lo: 0,
        hi: KGS - 1,
        states: vec![1],
    };
    let mut h = histogram();
    let t0 = Instant::now();
    let id = t.import_begin(spec).expect("import");
    let mut resolve = |t: &[StateDesc]| Ok(vec![1; t.len()]);
    for c in &kept {
        let tc = Instant::now();
        let step = t.import_chunk(id, c, 9, &mut resolve).expect("import");
        t.poll(|_, _| {});
        h.record(tc.elapsed().as_nanos() as u64).expect("in range");
        if step == ImportStep::Finishing {
            let mut installed = false;
            while !installed {
                t.poll(|tok, res| {
                    if tok == 9 {
                        res.expect("import installed");
                        installed = true;
                    }
                });
                if !installed {
                    let _ = t.wait(Some(Duration::from_millis(1)));
                }
            }
        }
    }
    let import = t0.elapsed();
    let import_gbs = gbs(kept_bytes, import);
    r.case(
        &Case::new(SUITE, format!("import/{mib}MiB"), kept.len() as u64, import)
            .latency(h)
            .with("gb_per_s", (import_gbs * 100.0).round() / 100.0)
            .with("mib", kept_bytes >> 20),
    );
    vec![
        ("export", export_gbs / limit_gbs),
        ("import", import_gbs / limit_gbs),
    ]
}

/// Reads every segment file in `dir` sequentially with O_DIRECT: bytes,
/// time.
fn disk_read(dir: &std::path::Path) -> (usize, Duration) {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut buf = stator_store::aligned::AlignedBuf::zeroed(4 << 20);
    let (mut bytes, mut spent) = (0, Duration::ZERO);
    for e in std::fs::read_dir(dir).expect("bench dir").flatten() {
        if !e.file_name().to_string_lossy().ends_with(".sst") {
            continue;
        }
        let Ok(mut f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(e.path())
        else {
            continue;
        };
        let t = Instant::now();
        while let Ok(n) = f.read(&mut buf[..]) {
            if n == 0 {
                break;
            }
            bytes += n;
        }
        spent += t.elapsed();
    }
    (bytes, spent.max(Duration::from_nanos(1)))
}

/// One state size: load, then `rounds` of (write, checkpoint), then
/// restores, then a portable export and import. Returns p50 ns of sync,
/// total, restore, 1->4, 4->1, and the portable ratios.
#[allow(clippy::type_complexity)]
fn stator_size(
    args: &CheckpointArgs,
    r: &mut Reporter,
    mib: u64,
    write_mib: u64,
    rounds: usize,
) -> ([u64; 5], Vec<(&'static str, f64)>) {
    let dir = bench_dir(args.dir.as_deref(), "ckpt-");
    let cfg = StoreConfig::new(dir.path(), 256 << 20);
    let (mut s, _) = Store::open(cfg, UringIo::new(4096, true).expect("io_uring")).expect("open");
    let keys = (mib << 20) / RECORD;
    let t = Instant::now();
    let mut next = 0;
    puts(&mut s, keys, &value(0, VALUE), || {
        next += 1;
        next - 1
    });
    s.flush();
    settle(&mut s);
    let load = t.elapsed();
    let st = s.stats();
    r.case(
        &Case::new(SUITE, format!("load/{mib}MiB"), keys, load)
            .with("segments", st.segments)
            .with("segment_mib", st.segment_bytes >> 20),
    );
    let mut rng = Rng(0x5eed ^ mib);
    let per_round = (write_mib << 20) / RECORD;
    let (mut sync_h, mut total_h) = (histogram(), histogram());
    let (mut sync_spent, mut total_spent) = (Duration::ZERO, Duration::ZERO);
    let mut handle = Vec::new();
    for round in 1..=rounds as u64 {
        puts(&mut s, per_round, &value(round, VALUE), || rng.below(keys));
        let t0 = Instant::now();
        s.checkpoint(round, spec(round, 0, KGS - 1))
            .expect("checkpoint");
        let sync = t0.elapsed();
        handle = wait_for(&mut s, round);
        let total = t0.elapsed();
        s.checkpoint_notify(OWNER, round, Notify::Complete);
        sync_spent += sync;
        total_spent += total;
        sync_h.record(sync.as_nanos() as u64).expect("in range");
        total_h.record(total.as_nanos() as u64).expect("in range");
    }
    let st = s.stats();
    let sync = Case::new(SUITE, format!("sync/{mib}MiB"), rounds as u64, sync_spent)
        .latency(sync_h)
        .with("write_mib_between", write_mib);
    let total = Case::new(SUITE, format!("total/{mib}MiB"), rounds as u64, total_spent)
        .latency(total_h)
        .with("segments", st.segments)
        .with("retained", st.checkpoints_retained);
    r.case(&sync);
    r.case(&total);
    // Portable export and import of the state as the writes left it.
    if args.compact {
        s.compact_all();
        settle(&mut s);
    }
    let ratios = portable(args, &mut s, r, mib, dir.path());
    export_after_writes(&mut s, r, mib, write_mib, || rng.below(keys));

    // Restores: 1 -> 1, 1 -> 4 (four ranges from the one handle), 4 -> 1.
    let reps = 5;
    let quarter = KGS / 4;
    let (mut restore_h, mut out_h, mut in_h) = (histogram(), histogram(), histogram());
    let restore = |s: &mut Store<UringIo>, lo: u16, hi: u16, hs: &[&[u8]]| {
        let spec = RestoreSpec {
            owner: OWNER,
            lo,
            hi,
            states: &[1],
        };
        s.restore(spec, hs).expect("restore");
    };
    let mut id = rounds as u64;
    let mut spent = [Duration::ZERO; 3];
    let mut timed = |h: &mut hdrhistogram::Histogram<u64>, i: usize, t0: Instant| {
        let d = t0.elapsed();
        spent[i] += d;
        h.record(d.as_nanos() as u64).expect("in range");
    };
    for _ in 0..reps {
        let t0 = Instant::now();
        restore(&mut s, 0, KGS - 1, &[&handle]);
        timed(&mut restore_h, 0, t0);
        let t0 = Instant::now();
        for q in 0..4 {
            restore(&mut s, q * quarter, (q + 1) * quarter - 1, &[&handle]);
        }
        timed(&mut out_h, 1, t0);
        // Four subtasks checkpoint; one restores from all four.
        id += 1;
        let mut four = Vec::new();
        for q in 0..4 {
            let tok = 1000 + q as u64;
            s.checkpoint(tok, spec(id, q * quarter, (q + 1) * quarter - 1))
                .expect("checkpoint");
            four.push(wait_for(&mut s, tok));
        }
        let refs: Vec<&[u8]> = four.iter().map(|h| h.as_slice()).collect();
        let t0 = Instant::now();
        restore(&mut s, 0, KGS - 1, &refs);
        timed(&mut in_h, 2, t0);
        // The next repetition starts from a checkpoint of the whole range.
        id += 1;
        s.checkpoint(2000, spec(id, 0, KGS - 1))
            .expect("checkpoint");
        handle = wait_for(&mut s, 2000);
        s.checkpoint_notify(OWNER, id, Notify::Complete);
    }
    let cases = [
        Case::new(SUITE, format!("restore/{mib}MiB"), reps, spent[0]).latency(restore_h),
        Case::new(SUITE, format!("rescale-1to4/{mib}MiB"), reps, spent[1]).latency(out_h),
        Case::new(SUITE, format!("rescale-4to1/{mib}MiB"), reps, spent[2]).latency(in_h),
    ];
    for c in &cases {
        r.case(c);
    }
    (
        [
            sync.p(0.5).unwrap_or(0),
            total.p(0.5).unwrap_or(0),
            cases[0].p(0.5).unwrap_or(0),
            cases[1].p(0.5).unwrap_or(0),
            cases[2].p(0.5).unwrap_or(0),
        ],
        ratios,
    )
}
