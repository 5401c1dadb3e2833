//! `stator-bench remote`: the remote tier's fetcher (`stator_store::remote`)
//! against object storage with injected latency: object_store's
//! `ThrottledStore` around an in-memory store, so the figure measures
//! Stator's side (batching, the runtime hand-off, completions through an
//! eventfd) and not a disk or a network. Uniform random 4 KiB block reads
//! over objects far larger than any cache, at a fixed number in flight (each
//! completion is replaced by a new read in the same pass, submitted as one
//! batch), beside the peer: Little's law (in flight / latency), the most any
//! client can reach. Prints an SVG of both.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use serde_json::json;
use stator_store::remote::{Remote, RemoteConfig, RemoteDone, RemoteRuntime, Target};

use crate::report::{Bound, Case, Reporter, histogram, process_cpu, thread_cpu};
use crate::store::Rng;

const SUITE: &str = "remote";
const BLOCK: u64 = 4096;

#[derive(clap::Args, Debug)]
pub struct RemoteArgs {
    /// Under a minute: shorter points, fewer latencies.
    #[arg(long)]
    quick: bool,
    /// One JSON object per case on stdout.
    #[arg(long)]
    json: bool,
    /// Injected latency per GET, milliseconds (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![23.0, 1.5])]
    latency_ms: Vec<f64>,
    /// Reads in flight (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 64, 1024, 6000, 65536])]
    depths: Vec<usize>,
    /// Seconds per point (default 4; 1.5 with --quick).
    #[arg(long)]
    seconds: Option<f64>,
    /// Objects (segments) and MiB each: the state read at random.
    #[arg(long, default_value_t = 256)]
    objects: u64,
    #[arg(long, default_value_t = 16)]
    object_mib: u64,
    /// Worker threads of the remote runtime.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Where the SVG goes.
    #[arg(long, default_value = "benches/results")]
    plot_dir: PathBuf,
    /// Keys of the tiered store cases (100-byte values; default 2 M, 400 K
    /// with --quick); 0 skips them.
    #[arg(long)]
    store_keys: Option<u64>,
}

pub fn run(a: RemoteArgs) {
    let secs = a.seconds.unwrap_or(if a.quick { 1.5 } else { 4.0 });
    let latencies: Vec<f64> = if a.quick {
        a.latency_ms.iter().copied().take(1).collect()
    } else {
        a.latency_ms.clone()
    };
    let mut r = Reporter::new(a.json);
    r.machine(
        SUITE,
        json!({
            "latency_ms": latencies, "depths": a.depths, "seconds_per_point": secs,
            "objects": a.objects, "object_mib": a.object_mib, "block_bytes": BLOCK,
            "runtime_threads": a.threads, "store": "object_store ThrottledStore(InMemory)",
            "peer": "Little's law: in flight / injected latency",
        }),
    );
    let rt = RemoteRuntime::new(a.threads).expect("a runtime");
    // One buffer shared by every object (InMemory keeps `Bytes`).
    let body = bytes::Bytes::from(
        (0..(a.object_mib << 20))
            .map(|i| (i as u8) ^ (i >> 12) as u8)
            .collect::<Vec<u8>>(),
    );
    let mem = Arc::new(InMemory::new());
    rt.handle().block_on(async {
        for o in 0..a.objects {
            mem.put(&ObjPath::from(name(o)), body.clone().into())
                .await
                .expect("put into memory");
        }
    });
    let names: Vec<String> = (0..a.objects).map(name).collect();
    let mut all = Vec::new();
    for &ms in &latencies {
        let lat = Duration::from_secs_f64(ms / 1000.0);
        let throttled = ThrottledStore::new(
            mem.clone(),
            ThrottleConfig {
                wait_get_per_call: lat,
                ..Default::default()
            },
        );
        let mut cfg = RemoteConfig::new(Target::Local {
            dir: PathBuf::from("/nonexistent"),
        });
        cfg.max_in_flight = a.depths.iter().copied().max().unwrap_or(1).max(1);
        cfg.timeout = Duration::from_secs(30);
        let mut remote = Remote::new(Arc::new(throttled), cfg, rt.handle()).expect("client");
        let mut sweep = Vec::new();
        for &depth in &a.depths {
            let c = point(&mut remote, &names, a.object_mib << 20, depth, lat, secs);
            r.case(&c);
            if (ms - 23.0).abs() < 1e-9 && depth == 6000 {
                // Little's law is this very number (6,000 / 23 ms): a
                // ratio to it, not the floor, which the store path below
                // is judged by at its best depth.
                r.note(
                    SUITE,
                    "fetcher_gets_per_sec_23ms_6000_in_flight",
                    c.ops_per_sec,
                    Bound::None,
                );
            }
            sweep.push(c);
        }
        all.push((ms, sweep));
    }
    let keys = a
        .store_keys
        .unwrap_or(if a.quick { 400_000 } else { 2_000_000 });
    if keys > 0 {
        let lat = Duration::from_secs_f64(latencies[0] / 1000.0);
        let cases = through_store(&rt, mem.clone(), lat, keys, &a.depths, secs, a.threads);
        for c in &cases {
            r.case(c);
        }
        // The floor: what one session (one store) sustains at 23 ms, at
        // whichever depth it does best.
        if (latencies[0] - 23.0).abs() < 1e-9 {
            let best = cases.iter().map(|c| c.ops_per_sec).fold(0.0, f64::max);
            r.note(
                SUITE,
                "store_gets_per_sec_23ms_best_in_flight",
                best,
                Bound::AtLeast(261_000.0),
            );
        }
    }
    match plot(&a.plot_dir, &all) {
        Ok(()) if !a.json => println!(
            "# plot: {}",
            a.plot_dir.join("remote-inflight.svg").display()
        ),
        Ok(()) => {}
        Err(e) => eprintln!("# no plot: {e}"),
    }
}

/// The same random reads through a tiered store (`Store::open_tiered`):
/// a store's checkpoint uploaded to the throttled in-memory object store,
/// restored on an empty directory with a 1 MiB block cache and a 4 MiB
/// local disk cache, then random gets of its keys at each depth: every get
/// that misses the caches is a ranged GET (coalesced per pass) whose bytes
/// are written back, evicted again under the budget. Little's law beside.
fn through_store(
    rt: &RemoteRuntime,
    mem: Arc<InMemory>,
    lat: Duration,
    keys: u64,
    depths: &[usize],
    secs: f64,
    threads: usize,
) -> Vec<Case> {
    use stator_store::io::UringIo;
    use stator_store::{CheckpointSpec, Op, RestoreSpec, Store, StoreConfig, TierConfig};

    use crate::store::{SHARD_BATCH, bench_dir, skey, stator_depth, value};
    let throttled: Arc<dyn object_store::ObjectStore> = Arc::new(ThrottledStore::new(
        mem,
        ThrottleConfig {
            wait_get_per_call: lat,
            ..Default::default()
        },
    ));
    let remote = || {
        let mut cfg = RemoteConfig::new(Target::Local {
            dir: PathBuf::from("/nonexistent"),
        });
        cfg.prefix = format!("tiered-{}", lat.as_micros());
        cfg.max_in_flight = 1 << 17;
        cfg.timeout = Duration::from_secs(30);
        Remote::new(throttled.clone(), cfg, rt.handle()).expect("client")
    };
    let dirs = bench_dir(None, "remote-store");
    let states: Vec<u32> = vec![1];
    let (lo, hi) = (0u16, (crate::store::MAX_PARALLELISM - 1) as u16);
    // The source: loaded, checkpointed (uploaded), dropped.
    let handle = {
        let mut cfg = StoreConfig::new(dirs.path().join("src"), 512 << 20);
        cfg.memtable_bytes = Some(64 << 20);
        let (mut s, _) = Store::open_tiered(
            cfg,
            UringIo::new(256, true).expect("io_uring"),
            remote(),
            TierConfig::new(None),
        )
        .expect("open the source store");
        let values: Vec<Vec<u8>> = (0..256).map(|i| value(i, 100)).collect();
        let mut kb = [0u8; 8];
        for i in 0..keys {
            s.submit(0, Op::Put(skey(i, &mut kb), &values[(i % 256) as usize]))
                .expect("put");
        }
        s.flush();
        s.settle();
        s.checkpoint(
            7,
            CheckpointSpec {
                owner: b"bench".to_vec(),
                checkpoint_id: 1,
                lo,
                hi,
                states: states.clone(),
                meta: Vec::new(),
            },
        )
        .expect("checkpoint");
        let mut handle = None;
        while handle.is_none() {
            s.poll(|_, r| match r.expect("the checkpoint") {
                stator_store::Output::Value(Some(h)) => handle = Some(h.to_vec()),
                o => panic!("{o:?}"),
            });
            let _ = s.wait(Some(Duration::from_millis(5)));
        }
        handle.expect("a handle")
    };
    // The reader: an empty directory, caches far smaller than the state.
    let mut cfg = StoreConfig::new(dirs.path().join("dst"), 256 << 20);
    cfg.block_cache_max = Some(1 << 20);
    let (mut s, _) = Store::open_tiered(
        cfg,
        UringIo::new(1024, true).expect("io_uring"),
        remote(),
        TierConfig::new(Some(4 << 20)),
    )
    .expect("open the reader");
    s.restore(
        RestoreSpec {
            owner: b"bench",
            lo,
            hi,
            states: &states,
        },
        &[&handle],
    )
    .expect("restore on an empty directory");
    let mut out = Vec::new();
    for &depth in depths {
        let run = format!("{}", lat.as_micros());
        let st0 = s.stats().remote.expect("tiered");
        let (_, rs) = s.remote_stats().expect("tiered");
        let (gets0, get_ns0) = (
            rs.gets.load(Ordering::Relaxed),
            rs.get_ns.load(Ordering::Relaxed),
        );
        let (cpu0, pcpu0, w0) = (thread_cpu(), process_cpu(), Instant::now());
        let c = stator_depth(
            &mut s,
            keys,
            depth,
            SHARD_BATCH,
            Duration::from_secs_f64(secs),
            &run,
        );
        let (cpu, pcpu) = (thread_cpu() - cpu0, process_cpu() - pcpu0);
        let gets_done = (c.ops_per_sec * w0.elapsed().as_secs_f64()).max(1.0);
        let shard_ns = cpu.as_nanos() as f64 / gets_done;
        let others_ns = pcpu.saturating_sub(cpu).as_nanos() as f64 / gets_done;
        let st = s.stats().remote.expect("tiered");
        let gets = rs.gets.load(Ordering::Relaxed) - gets0;
        let get_ms_mean =
            (rs.get_ns.load(Ordering::Relaxed) - get_ns0) as f64 / gets.max(1) as f64 / 1e6;
        let little = depth as f64 / lat.as_secs_f64();
        let remote_per_get = (st.remote_block_reads - st0.remote_block_reads) as f64
            / (c.ops_per_sec * secs).max(1.0);
        let ratio = c.ops_per_sec / little;
        out.push(
            c.named(
                SUITE,
                format!("store_get_{}ms_inflight{depth}", lat.as_secs_f64() * 1e3),
            )
            .with("in_flight", depth as u64)
            .with("latency_ms", lat.as_secs_f64() * 1e3)
            .with("keys", keys)
            .with("runtime_threads", threads as u64)
            .with(
                "remote_reads_per_get",
                (remote_per_get * 1000.0).round() / 1000.0,
            )
            .with("littles_law_ops_per_sec", little.round())
            .with("of_littles_law", (ratio * 1000.0).round() / 1000.0)
            .with("gets_issued", gets)
            .with("shard_cpu_ns_per_get", shard_ns.round())
            .with("runtime_cpu_ns_per_get", others_ns.round())
            .with("get_ms_mean", (get_ms_mean * 100.0).round() / 100.0),
        );
    }
    out
}

fn name(o: u64) -> String {
    format!("seg/{o:05}.sst")
}

/// `depth` random block reads in flight for `secs` (after one latency of
/// warm-up); each pass replaces what completed with one batch of new reads.
fn point(
    remote: &mut Remote,
    names: &[String],
    object_len: u64,
    depth: usize,
    lat: Duration,
    secs: f64,
) -> Case {
    let blocks = object_len / BLOCK;
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ depth as u64);
    let mut started = vec![Instant::now(); depth];
    let pick = |rng: &mut Rng| -> (usize, Range<u64>) {
        let o = rng.below(names.len() as u64) as usize;
        let b = rng.below(blocks);
        (o, b * BLOCK..(b + 1) * BLOCK)
    };
    let mut batch: Vec<(u64, &str, Range<u64>)> = Vec::with_capacity(depth);
    for t in 0..depth {
        let (o, r) = pick(&mut rng);
        batch.push((t as u64, &names[o], r));
    }
    let t0 = Instant::now();
    started.fill(t0);
    remote.get_blocks(&batch);
    let warm = t0 + lat + Duration::from_millis(100);
    let end = warm + Duration::from_secs_f64(secs);
    let mut h = histogram();
    let (mut done, mut failed) = (0u64, 0u64);
    let mut measuring = false;
    let mut m0 = t0;
    let mut ready: Vec<u64> = Vec::with_capacity(depth);
    loop {
        remote.wait(Duration::from_millis(50));
        ready.clear();
        let now = Instant::now();
        if !measuring && now >= warm {
            measuring = true;
            m0 = now;
        }
        remote.poll(|t, res| {
            ready.push(t);
            if measuring {
                match res {
                    Ok(RemoteDone::Bytes(b)) if b.len() as u64 == BLOCK => {
                        done += 1;
                        let _ = h.record(now.duration_since(started[t as usize]).as_nanos() as u64);
                    }
                    _ => failed += 1,
                }
            }
        });
        if now >= end {
            break;
        }
        batch.clear();
        for &t in &ready {
            let (o, r) = pick(&mut rng);
            started[t as usize] = now;
            batch.push((t, &names[o], r));
        }
        remote.get_blocks(&batch);
    }
    let elapsed = m0.elapsed();
    // Let the reads still in flight finish before the next point.
    while remote.outstanding() > 0 {
        remote.wait(Duration::from_millis(50));
        remote.poll(|_, _| {});
    }
    let little = depth as f64 / lat.as_secs_f64();
    let c = Case::new(
        SUITE,
        format!("get_{}ms_inflight{depth}", lat.as_secs_f64() * 1e3),
        done,
        elapsed,
    )
    .latency(h)
    .with("in_flight", depth as u64)
    .with("latency_ms", lat.as_secs_f64() * 1e3)
    .with("littles_law_ops_per_sec", little.round())
    .with("failed", failed);
    let ratio = c.ops_per_sec / little;
    c.with("of_littles_law", (ratio * 1000.0).round() / 1000.0)
}

/// An SVG per latency: ops/s and Little's law over the depths (log x, log y).
fn plot(dir: &Path, all: &[(f64, Vec<Case>)]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let (w, h, m) = (760.0, 440.0, 70.0);
    let depth = |c: &Case| {
        c.extra
            .get("in_flight")
            .and_then(|v| v.as_f64())
            .unwrap_or(1.0)
    };
    let little = |c: &Case| {
        c.extra
            .get("littles_law_ops_per_sec")
            .and_then(|v| v.as_f64())
            .unwrap_or(1.0)
    };
    let cases: Vec<&Case> = all.iter().flat_map(|(_, s)| s).collect();
    if cases.is_empty() {
        return Ok(());
    }
    let xmax = cases
        .iter()
        .map(|c| depth(c))
        .fold(2.0f64, f64::max)
        .log10();
    let ymin = cases
        .iter()
        .map(|c| c.ops_per_sec.min(little(c)))
        .fold(f64::MAX, f64::min)
        .max(1.0)
        .log10()
        .floor();
    let ymax = cases
        .iter()
        .map(|c| c.ops_per_sec.max(little(c)))
        .fold(10.0f64, f64::max)
        .log10()
        .ceil();
    let x = |d: f64| m + d.log10() / xmax * (w - 2.0 * m);
    let y = |v: f64| h - m - (v.max(1.0).log10() - ymin) / (ymax - ymin).max(1.0) * (h - 2.0 * m);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{m}\" y=\"24\" font-size=\"15\">remote fetcher: random 4 KiB GETs/s vs in flight (log-log); dashed: Little's law</text>\n\
         <line x1=\"{m}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
         <line x1=\"{m}\" y1=\"{m}\" x2=\"{m}\" y2=\"{b}\" stroke=\"black\"/>\n",
        b = h - m,
        r = w - m
    );
    for e in (ymin as i32)..=(ymax as i32) {
        let v = 10f64.powi(e);
        s += &format!(
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">1e{e}</text>\n",
            m - 6.0,
            y(v) + 4.0
        );
    }
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"];
    for (i, (ms, sweep)) in all.iter().enumerate() {
        let col = colors[i % colors.len()];
        let pts = |f: &dyn Fn(&Case) -> f64| {
            sweep
                .iter()
                .map(|c| format!("{:.1},{:.1}", x(depth(c)), y(f(c))))
                .collect::<Vec<_>>()
                .join(" ")
        };
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{col}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts(&|c| c.ops_per_sec)
        );
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{col}\" stroke-width=\"1\" stroke-dasharray=\"5,3\" points=\"{}\"/>\n",
            pts(&little)
        );
        s += &format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{col}\">{ms} ms per GET</text>\n",
            m + 10.0,
            m + 16.0 * (i as f64 + 1.0)
        );
        for c in sweep {
            s += &format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" fill=\"{col}\">{:.0}K</text>\n",
                x(depth(c)),
                y(c.ops_per_sec) - 6.0,
                c.ops_per_sec / 1e3
            );
        }
    }
    if let Some((_, sweep)) = all.first() {
        for c in sweep {
            s += &format!(
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
                x(depth(c)),
                h - m + 16.0,
                depth(c)
            );
        }
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">GETs in flight</text>\n</svg>\n",
        w / 2.0,
        h - 24.0
    );
    std::fs::write(dir.join("remote-inflight.svg"), s)
}
