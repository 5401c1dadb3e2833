//! Printing results: a table for people, one JSON object per case for
//! machines, and the machine and settings every run starts with.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{Map, Value, json};

/// One measured case.
pub struct Case {
    pub suite: &'static str,
    pub case: String,
    pub ops_per_sec: f64,
    /// Latency histogram in nanoseconds, where latency applies.
    pub latency_ns: Option<Histogram<u64>>,
    /// Settings and extra figures for this case.
    pub extra: Map<String, Value>,
}

impl Case {
    pub fn new(suite: &'static str, case: impl Into<String>, ops: u64, elapsed: Duration) -> Case {
        Case {
            suite,
            case: case.into(),
            ops_per_sec: ops as f64 / elapsed.as_secs_f64(),
            latency_ns: None,
            extra: Map::new(),
        }
    }

    /// The same figures under another suite and name.
    pub fn named(mut self, suite: &'static str, case: impl Into<String>) -> Case {
        self.suite = suite;
        self.case = case.into();
        self
    }

    pub fn latency(mut self, h: Histogram<u64>) -> Case {
        self.latency_ns = Some(h);
        self
    }

    pub fn with(mut self, k: &str, v: impl Into<Value>) -> Case {
        self.extra.insert(k.to_string(), v.into());
        self
    }

    pub fn p(&self, q: f64) -> Option<u64> {
        self.latency_ns.as_ref().map(|h| h.value_at_quantile(q))
    }

    pub fn to_json(&self) -> Value {
        let mut o = Map::new();
        o.insert("suite".into(), json!(self.suite));
        o.insert("case".into(), json!(self.case));
        o.insert("ops_per_sec".into(), json!(self.ops_per_sec.round()));
        if let Some(h) = &self.latency_ns {
            o.insert("p50_ns".into(), json!(h.value_at_quantile(0.50)));
            o.insert("p99_ns".into(), json!(h.value_at_quantile(0.99)));
            o.insert("p999_ns".into(), json!(h.value_at_quantile(0.999)));
            o.insert("max_ns".into(), json!(h.max()));
            o.insert("samples".into(), json!(h.len()));
        }
        for (k, v) in &self.extra {
            o.insert(k.clone(), v.clone());
        }
        Value::Object(o)
    }
}

/// Where results go.
pub struct Reporter {
    pub json: bool,
    header_done: bool,
}

fn fmt_ns(v: Option<u64>) -> String {
    match v {
        None => "-".into(),
        Some(n) if n >= 10_000_000 => format!("{:.1}ms", n as f64 / 1e6),
        Some(n) if n >= 10_000 => format!("{:.1}us", n as f64 / 1e3),
        Some(n) => format!("{n}ns"),
    }
}

fn fmt_ops(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.1}K", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

impl Reporter {
    pub fn new(json: bool) -> Reporter {
        Reporter {
            json,
            header_done: false,
        }
    }

    /// The machine and the run's settings: to stdout as text, or to stderr
    /// as one JSON object when stdout carries the case objects.
    pub fn machine(&self, suite: &str, settings: Value) {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let cores = crate::ring::online_cpus();
        let kernel = nix::sys::utsname::uname()
            .map(|u| {
                format!(
                    "{} {}",
                    u.sysname().to_string_lossy(),
                    u.release().to_string_lossy()
                )
            })
            .unwrap_or_default();
        let mem_kib = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .next()
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .unwrap_or(0);
        let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        let m = json!({
            "suite": suite,
            "machine": {"cpu": cpu, "cores": cores, "kernel": kernel, "mem_gib": mem_kib / (1 << 20), "loadavg": load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")},
            "settings": settings,
            "version": env!("CARGO_PKG_VERSION"),
        });
        if self.json {
            eprintln!("{m}");
        } else {
            println!("# stator-bench {suite}");
            println!(
                "# machine: {cpu}, {cores} cores, {} GiB, {kernel}, load {}",
                mem_kib / (1 << 20),
                m["machine"]["loadavg"].as_str().unwrap_or("")
            );
            println!("# settings: {settings}");
        }
    }

    pub fn case(&mut self, c: &Case) {
        if self.json {
            println!("{}", c.to_json());
            return;
        }
        if !self.header_done {
            println!(
                "{:<34} {:>10} {:>9} {:>9} {:>9} {:>9}",
                "case", "ops/s", "p50", "p99", "p999", "max"
            );
            self.header_done = true;
        }
        let extra: Vec<String> = c.extra.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "{:<34} {:>10} {:>9} {:>9} {:>9} {:>9}  {}",
            c.case,
            fmt_ops(c.ops_per_sec),
            fmt_ns(c.p(0.5)),
            fmt_ns(c.p(0.99)),
            fmt_ns(c.p(0.999)),
            fmt_ns(c.latency_ns.as_ref().map(|h| h.max())),
            extra.join(" ")
        );
    }

    /// A derived figure (a ratio, a floor check): a line of text, or a JSON
    /// object with `suite`, `case` and the figure.
    pub fn note(&self, suite: &str, name: &str, value: f64, bound: Bound) {
        let pass = match bound {
            Bound::None => None,
            Bound::AtLeast(f) => Some(value >= f),
            Bound::AtMost(f) => Some(value <= f),
        };
        if self.json {
            let (kind, limit) = match bound {
                Bound::None => ("none", None),
                Bound::AtLeast(f) => ("at_least", Some(f)),
                Bound::AtMost(f) => ("at_most", Some(f)),
            };
            println!(
                "{}",
                json!({"suite": suite, "case": name, "value": (value * 100.0).round() / 100.0, "bound": kind, "limit": limit, "pass": pass})
            );
        } else {
            let verdict = match (bound, pass) {
                (Bound::AtLeast(f), Some(ok)) => {
                    format!("  (floor >= {f}: {})", if ok { "ok" } else { "MISSED" })
                }
                (Bound::AtMost(f), Some(ok)) => {
                    format!("  (ceiling <= {f}: {})", if ok { "ok" } else { "MISSED" })
                }
                _ => String::new(),
            };
            println!("  {name:<48} {value:>10.2}{verdict}");
        }
    }
}

/// What a derived figure is held to.
#[derive(Clone, Copy, Debug)]
pub enum Bound {
    None,
    AtLeast(f64),
    AtMost(f64),
}

/// A latency histogram from 1 ns to 100 s, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("static histogram bounds are valid")
}

/// CPU time this thread has used.
pub fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map_or(Duration::ZERO, Duration::from)
}

/// CPU time every thread of this process has used.
pub fn process_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map_or(Duration::ZERO, Duration::from)
}
