//! Configuration: an embedded default, a TOML file, then flags, in that
//! order. Every key is checked once, here; an invalid one is an error that
//! names it (`session.sq_entries: must be a power of two in 64..=1048576`).

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// The whole configuration, as the TOML file spells it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where each shard keeps its store (`<data_dir>/shard-<n>`).
    pub data_dir: PathBuf,
    /// Where the control socket lives (`<run_dir>/stator.sock`).
    pub run_dir: PathBuf,
    /// Shard threads; 0 = one per spare core (cores - 1, at least 1).
    pub shards: usize,
    /// Memory budget of all shards' stores together, MiB; 0 = a quarter of
    /// the machine's memory, at least 256 MiB.
    pub memory_budget_mib: u64,
    /// Memtable size per shard, MiB; 0 = the store's default (a quarter of
    /// the shard's budget, 4..=256 MiB). Two memtables and 4 MiB of block
    /// cache must fit in the shard's budget.
    pub memtable_mib: u64,
    /// Fault in each shard's memtable memory (two memtables and their
    /// indexes) at start (the default), so that writes right after a start
    /// run as fast as later ones; the start takes longer and the memory is
    /// held from it (see `stator_store::StoreConfig::prefault_memory`).
    pub prefault_memory: bool,
    /// Uids allowed to open sessions; empty = the daemon's own (effective) uid.
    pub allowed_uids: Vec<u32>,
    /// How long an idle shard spins before it sleeps, microseconds.
    pub spin_us: u64,
    /// Open sessions at most, over all shards.
    pub max_sessions: usize,
    /// Open sessions at most per uid; 0 = no limit but `max_sessions`. On
    /// a host shared by tenants, keeps one from taking every session.
    pub max_sessions_per_uid: usize,
    /// Completed checkpoints kept per operator (and shard) at most, for an
    /// engine that never says which it no longer needs; Flink says so
    /// (subsumed), and every completed checkpoint it still lists stays
    /// restorable up to this many. Keep it above Flink's
    /// `state.checkpoints.num-retained`. At least 1.
    pub retained_checkpoints: usize,
    /// Layers (segments) of a shard's store past which a checkpoint waits
    /// for compaction before it begins: its client's requests after it
    /// wait too. A checkpoint names every layer it covers and a restore
    /// brings them back, so without it a daemon that dies after the first
    /// checkpoint of each life grows that list without bound. At least
    /// 3 x the compaction trigger (12); well above what compaction leaves
    /// under a steady load.
    pub checkpoint_layer_limit: usize,
    /// States (names) one job may have registered, over all its operators
    /// and sessions: names are kept across sessions and restarts, so this
    /// bounds a tenant that makes up new ones. At least 1.
    pub max_states_per_job: usize,
    /// A job with no open session and no retained checkpoint (completed or
    /// not) for this many seconds is dropped: its state names, its owning
    /// uid and its live state (which compaction then reclaims). 0 = never.
    /// A job opened again after that starts empty.
    pub drop_idle_jobs_after_secs: u64,
    /// Log filter: targets and levels (`info`, `warn,statord=debug`; no span
    /// or field filters).
    /// `STATOR_LOG` or `RUST_LOG` override it. SIGHUP re-reads it (and
    /// `max_sessions`, `allowed_uids` and `session.*` but `session.batch`).
    pub log: String,
    pub session: SessionLimits,
    /// The remote tier (off unless `remote.enabled`).
    pub remote: RemoteSettings,
}

/// The remote tier: segments on object storage, the local disk as a cache.
/// (Its `Debug` hides the secret key: `--print-config` shows the rest.)
#[derive(Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RemoteSettings {
    pub enabled: bool,
    /// An S3 or S3-compatible bucket; empty = a directory (`dir`).
    pub bucket: String,
    /// `http://127.0.0.1:9000` for a compatible server; empty = AWS.
    pub endpoint: String,
    /// Empty: `AWS_REGION`/`AWS_DEFAULT_REGION`, or the client's default.
    pub region: String,
    /// Empty: `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`.
    pub access_key_id: String,
    pub secret_access_key: String,
    /// Allow plain-HTTP endpoints (a server on loopback).
    pub allow_http: bool,
    /// The remote directory when no bucket is set; empty =
    /// `<data_dir>/remote`.
    pub dir: PathBuf,
    /// Key prefix of this daemon's objects (`<prefix>/shard-<n>/...`). One
    /// daemon per prefix: two writing the same prefix would collect each
    /// other's objects.
    pub prefix: String,
    /// Bytes of segment files kept on the local disk, MiB (over all
    /// shards); 0 = no limit (nothing is evicted).
    pub local_cache_mib: u64,
    /// GETs in flight at most, per shard.
    pub max_in_flight: usize,
    /// One attempt of one request at most, milliseconds.
    pub timeout_ms: u64,
    /// Attempts after the first (exponential backoff from `backoff_ms`).
    pub retries: u32,
    pub backoff_ms: u64,
    /// Threads of the runtime remote requests run on.
    pub threads: usize,
}

impl std::fmt::Debug for RemoteSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = if self.secret_access_key.is_empty() {
            ""
        } else {
            "(set, not shown)"
        };
        f.debug_struct("RemoteSettings")
            .field("enabled", &self.enabled)
            .field("bucket", &self.bucket)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &secret)
            .field("allow_http", &self.allow_http)
            .field("dir", &self.dir)
            .field("prefix", &self.prefix)
            .field("local_cache_mib", &self.local_cache_mib)
            .field("max_in_flight", &self.max_in_flight)
            .field("timeout_ms", &self.timeout_ms)
            .field("retries", &self.retries)
            .field("backoff_ms", &self.backoff_ms)
            .field("threads", &self.threads)
            .finish()
    }
}

impl Default for RemoteSettings {
    fn default() -> Self {
        RemoteSettings {
            enabled: false,
            bucket: String::new(),
            endpoint: String::new(),
            region: String::new(),
            access_key_id: String::new(),
            secret_access_key: String::new(),
            allow_http: false,
            dir: PathBuf::new(),
            prefix: "stator".into(),
            local_cache_mib: 0,
            max_in_flight: 8192,
            timeout_ms: 10_000,
            retries: 4,
            backoff_ms: 50,
            threads: 2,
        }
    }
}

/// Per-session sizes and limits.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct SessionLimits {
    /// Submission queue entries when the client asks for none.
    pub sq_entries: u32,
    /// Completion queue entries when the client asks for none.
    pub cq_entries: u32,
    /// Largest queue a client may ask for.
    pub max_entries: u32,
    /// Arena bytes when the client asks for none, MiB.
    pub arena_mib: u64,
    /// Largest arena a client may ask for, MiB.
    pub max_arena_mib: u64,
    /// Requests one session may have in the daemon at once (also bounded
    /// by its completion queue).
    pub max_in_flight: u32,
    /// States one session may register.
    pub max_states: u32,
    /// Descriptors taken from one session per shard pass (fairness).
    pub batch: u32,
    /// 4 MiB snapshot chunk slots when the client asks for none (shared
    /// memory pages cost nothing until a snapshot touches them).
    pub chunk_slots: u32,
    /// Most chunk slots a client may ask for.
    pub max_chunk_slots: u32,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            data_dir: PathBuf::from("./stator-data"),
            run_dir: PathBuf::from("./stator-run"),
            shards: 0,
            memory_budget_mib: 0,
            memtable_mib: 0,
            prefault_memory: true,
            allowed_uids: Vec::new(),
            spin_us: 50,
            max_sessions: 1024,
            max_sessions_per_uid: 0,
            retained_checkpoints: stator_store::DEFAULT_RETAINED_CHECKPOINTS,
            checkpoint_layer_limit: stator_store::DEFAULT_CHECKPOINT_LAYER_LIMIT,
            max_states_per_job: DEFAULT_MAX_STATES_PER_JOB,
            drop_idle_jobs_after_secs: DEFAULT_DROP_IDLE_JOBS_AFTER_SECS,
            log: "info".into(),
            session: SessionLimits::default(),
            remote: RemoteSettings::default(),
        }
    }
}

impl Default for SessionLimits {
    fn default() -> Self {
        SessionLimits {
            sq_entries: 4096,
            cq_entries: 4096,
            max_entries: 1 << 17,
            arena_mib: 64,
            max_arena_mib: 1024,
            max_in_flight: 1 << 17,
            max_states: 4096,
            batch: 64,
            chunk_slots: 4,
            max_chunk_slots: 64,
        }
    }
}

/// A configuration error, naming the key (or the file).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("config file {path}: {msg}")]
    Parse { path: PathBuf, msg: String },
    #[error("config key `{key}`: {msg}")]
    Invalid { key: &'static str, msg: String },
}

fn invalid(key: &'static str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        msg: msg.into(),
    }
}

fn queue_ok(n: u32) -> bool {
    n.is_power_of_two() && (64..=1 << 20).contains(&n)
}

impl Config {
    /// What a reload (SIGHUP) changes at runtime: `log`, `max_sessions`,
    /// `max_sessions_per_uid`, `max_states_per_job`,
    /// `drop_idle_jobs_after_secs`,
    /// `allowed_uids` and the `session.*` limits but `session.batch` (they
    /// apply to sessions opened from then on; open sessions keep theirs).
    /// Returns the configuration to run with (`new`'s runtime keys, this
    /// one's others) and the keys that changed in `new` but take effect
    /// only at a restart.
    pub fn reload(&self, new: &Config) -> (Config, Vec<&'static str>) {
        let mut run = self.clone();
        run.log = new.log.clone();
        run.max_sessions = new.max_sessions;
        run.max_states_per_job = new.max_states_per_job;
        run.drop_idle_jobs_after_secs = new.drop_idle_jobs_after_secs;
        run.max_sessions_per_uid = new.max_sessions_per_uid;
        run.allowed_uids = new.allowed_uids.clone();
        run.session = SessionLimits {
            batch: self.session.batch,
            ..new.session.clone()
        };
        let restart = [
            ("data_dir", self.data_dir != new.data_dir),
            ("run_dir", self.run_dir != new.run_dir),
            ("shards", self.shards != new.shards),
            (
                "memory_budget_mib",
                self.memory_budget_mib != new.memory_budget_mib,
            ),
            ("memtable_mib", self.memtable_mib != new.memtable_mib),
            (
                "prefault_memory",
                self.prefault_memory != new.prefault_memory,
            ),
            (
                "retained_checkpoints",
                self.retained_checkpoints != new.retained_checkpoints,
            ),
            (
                "checkpoint_layer_limit",
                self.checkpoint_layer_limit != new.checkpoint_layer_limit,
            ),
            ("spin_us", self.spin_us != new.spin_us),
            ("session.batch", self.session.batch != new.session.batch),
            ("remote", self.remote != new.remote),
        ]
        .into_iter()
        .filter_map(|(k, changed)| changed.then_some(k))
        .collect();
        (run, restart)
    }

    /// Reads a TOML file over the defaults.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
            path: path.to_path_buf(),
            err,
        })?;
        Config::from_toml(&text).map_err(|msg| ConfigError::Parse {
            path: path.to_path_buf(),
            msg,
        })
    }

    /// Parses TOML text over the defaults (errors name the key and line).
    pub fn from_toml(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_string())
    }

    /// Checks every key; fills in the automatic values (shards, budget,
    /// allowed uids). Returns the configuration the daemon runs with.
    pub fn resolve(mut self) -> Result<Config, ConfigError> {
        if let Err(e) = log_filter(&self.log) {
            return Err(invalid("log", format!("not a log filter: {e}")));
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if self.shards == 0 {
            self.shards = cores.saturating_sub(1).max(1);
        }
        if self.shards > 256 {
            return Err(invalid("shards", "at most 256"));
        }
        if self.memory_budget_mib == 0 {
            self.memory_budget_mib = ((physical_memory() / 4) >> 20).max(256);
        }
        if self.memory_budget_mib < 16 * self.shards as u64 {
            return Err(invalid(
                "memory_budget_mib",
                format!("at least 16 MiB per shard ({} shards)", self.shards),
            ));
        }
        // While a full memtable flushes, the next one fills: two memtables
        // at once, and the block cache must keep some room beside them.
        let share = self.memory_budget_mib / self.shards as u64;
        if self.memtable_mib > share.saturating_sub(MIN_CACHE_MIB) / 2 {
            return Err(invalid(
                "memtable_mib",
                format!(
                    "at most {} MiB here: two memtables (one flushing, one filling) and a {MIN_CACHE_MIB} MiB block cache must fit in each shard's {share} MiB share of memory_budget_mib",
                    share.saturating_sub(MIN_CACHE_MIB) / 2
                ),
            ));
        }
        if self.allowed_uids.is_empty() {
            self.allowed_uids.push(nix::unistd::geteuid().as_raw());
        }
        if self.spin_us > 1_000_000 {
            return Err(invalid("spin_us", "at most 1000000 (one second)"));
        }
        if self.max_sessions == 0 {
            return Err(invalid("max_sessions", "must be at least 1"));
        }
        if self.max_states_per_job == 0 {
            return Err(invalid("max_states_per_job", "must be at least 1"));
        }
        if self.retained_checkpoints == 0 {
            return Err(invalid(
                "retained_checkpoints",
                "must be at least 1 (the newest completed checkpoint is always kept)",
            ));
        }
        if self.checkpoint_layer_limit < stator_store::MIN_CHECKPOINT_LAYER_LIMIT {
            return Err(invalid(
                "checkpoint_layer_limit",
                format!(
                    "must be at least {} (3 x the compaction trigger: below that, compaction may not run and a checkpoint would wait forever)",
                    stator_store::MIN_CHECKPOINT_LAYER_LIMIT
                ),
            ));
        }
        if self.data_dir.as_os_str().is_empty() {
            return Err(invalid("data_dir", "must not be empty"));
        }
        if self.run_dir.as_os_str().is_empty() {
            return Err(invalid("run_dir", "must not be empty"));
        }
        let s = &self.session;
        if !queue_ok(s.max_entries) {
            return Err(invalid(
                "session.max_entries",
                "must be a power of two in 64..=1048576",
            ));
        }
        for (key, v) in [
            ("session.sq_entries", s.sq_entries),
            ("session.cq_entries", s.cq_entries),
        ] {
            if !queue_ok(v) || v > s.max_entries {
                return Err(invalid(
                    key,
                    "must be a power of two in 64..=1048576 and at most session.max_entries",
                ));
            }
        }
        if s.arena_mib == 0 || s.arena_mib > s.max_arena_mib || s.max_arena_mib > 4096 {
            return Err(invalid(
                "session.arena_mib",
                "must be in 1..=session.max_arena_mib, and session.max_arena_mib at most 4096",
            ));
        }
        if s.chunk_slots == 0 || s.chunk_slots > s.max_chunk_slots || s.max_chunk_slots > 256 {
            return Err(invalid(
                "session.chunk_slots",
                "must be in 1..=session.max_chunk_slots, and session.max_chunk_slots at most 256",
            ));
        }
        if s.max_in_flight == 0 {
            return Err(invalid("session.max_in_flight", "must be at least 1"));
        }
        if s.max_states == 0 {
            return Err(invalid("session.max_states", "must be at least 1"));
        }
        if s.batch == 0 || s.batch > 65536 {
            return Err(invalid("session.batch", "must be in 1..=65536"));
        }
        let r = &mut self.remote;
        if r.enabled {
            if r.bucket.is_empty() && r.dir.as_os_str().is_empty() {
                r.dir = self.data_dir.join("remote");
            }
            if r.bucket.is_empty() && !r.endpoint.is_empty() {
                return Err(invalid("remote.endpoint", "needs remote.bucket"));
            }
            if r.access_key_id.is_empty() != r.secret_access_key.is_empty() {
                return Err(invalid(
                    "remote.access_key_id",
                    "set with remote.secret_access_key, or neither (the AWS environment variables)",
                ));
            }
            if r.prefix
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
            {
                return Err(invalid(
                    "remote.prefix",
                    "must be non-empty path parts separated by single slashes",
                ));
            }
            if r.max_in_flight == 0 || r.max_in_flight > 1 << 20 {
                return Err(invalid("remote.max_in_flight", "must be in 1..=1048576"));
            }
            if r.timeout_ms == 0 {
                return Err(invalid("remote.timeout_ms", "must be at least 1"));
            }
            if r.retries > 100 {
                return Err(invalid("remote.retries", "at most 100"));
            }
            if r.threads == 0 || r.threads > 64 {
                return Err(invalid("remote.threads", "must be in 1..=64"));
            }
        }
        Ok(self)
    }

    /// The control socket's path.
    pub fn socket_path(&self) -> PathBuf {
        self.run_dir.join("stator.sock")
    }

    /// The status socket's path (HTTP: `/status`, `/metrics`, `/healthz`).
    pub fn status_path(&self) -> PathBuf {
        self.run_dir.join("status.sock")
    }

    /// Whether `uid` may use the control and status sockets: root and
    /// statord's own uid always (they can read the data directory anyway,
    /// and statorctl's snapshot commands need a session), others when
    /// `allowed_uids` lists them.
    pub fn allows(&self, uid: u32) -> bool {
        uid == 0 || uid == nix::unistd::geteuid().as_raw() || self.allowed_uids.contains(&uid)
    }

    /// One shard's store configuration.
    pub fn store_config(&self, shard: usize) -> stator_store::StoreConfig {
        let mut c = stator_store::StoreConfig::new(
            self.data_dir.join(format!("shard-{shard}")),
            ((self.memory_budget_mib << 20) / self.shards as u64) as usize,
        );
        if self.memtable_mib > 0 {
            c.memtable_bytes = Some((self.memtable_mib << 20) as usize);
        }
        c.retained_checkpoints = self.retained_checkpoints;
        c.prefault_memory = self.prefault_memory;
        c.checkpoint_layer_limit = self.checkpoint_layer_limit;
        c
    }

    /// The remote client's configuration for one shard (`None`: the tier
    /// is off).
    pub fn remote_config(&self, shard: usize) -> Option<stator_store::remote::RemoteConfig> {
        use stator_store::remote::{RemoteConfig, Target};
        let r = &self.remote;
        if !r.enabled {
            return None;
        }
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        let target = if r.bucket.is_empty() {
            Target::Local { dir: r.dir.clone() }
        } else {
            Target::S3 {
                bucket: r.bucket.clone(),
                endpoint: some(&r.endpoint),
                region: some(&r.region),
                access_key_id: some(&r.access_key_id),
                secret_access_key: some(&r.secret_access_key),
                allow_http: r.allow_http,
            }
        };
        let mut c = RemoteConfig::new(target);
        c.prefix = format!("{}/shard-{shard}", r.prefix);
        c.max_in_flight = r.max_in_flight;
        c.timeout = std::time::Duration::from_millis(r.timeout_ms);
        c.retries = r.retries;
        c.backoff = std::time::Duration::from_millis(r.backoff_ms);
        Some(c)
    }

    /// One shard's remote tier settings.
    pub fn tier_config(&self) -> stator_store::TierConfig {
        let per_shard = (self.remote.local_cache_mib << 20) / self.shards.max(1) as u64;
        stator_store::TierConfig::new((per_shard > 0).then_some(per_shard))
    }
}

/// The longest `log` filter accepted.
const MAX_LOG_FILTER: usize = 4096;

/// Parses a log filter: `tracing-subscriber` directives of targets and
/// levels only (`info`, `warn,statord=debug`). Three findings of the
/// `config` fuzz target in tracing-subscriber 0.3's parser shape it: a
/// field pattern compiled as a regular expression took seconds and
/// gigabytes; a multi-byte character after leading blanks panicked (it
/// slices the untrimmed directive at the trimmed copy's indices); and two
/// equal field filters failed one of its debug assertions. So span and
/// field filters (`[...]`, `{...}`) are refused, only printable ASCII is
/// accepted, and each directive is trimmed.
pub fn log_filter(directives: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    if directives.len() > MAX_LOG_FILTER {
        return Err(format!("longer than {MAX_LOG_FILTER} bytes"));
    }
    if let Some(c) = directives.chars().find(|c| {
        !(c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '-' | '=' | ',' | ' ' | '\t'))
    }) {
        return Err(format!(
            "{c:?} is not allowed: targets and levels only (letters, digits, _ : - = , and blanks)"
        ));
    }
    let trimmed: Vec<&str> = directives.split(',').map(str::trim).collect();
    tracing_subscriber::EnvFilter::builder()
        .with_regex(false)
        .parse(trimmed.join(","))
        .map_err(|e| e.to_string())
}

/// The block cache's room at least, per shard, beside two memtables.
const MIN_CACHE_MIB: u64 = 4;

/// [`Config::max_states_per_job`] unless set.
pub const DEFAULT_MAX_STATES_PER_JOB: usize = 4096;

/// [`Config::drop_idle_jobs_after_secs`] unless set: a week.
pub const DEFAULT_DROP_IDLE_JOBS_AFTER_SECS: u64 = 7 * 24 * 3600;

fn physical_memory() -> u64 {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return 1 << 30;
    }
    pages as u64 * size as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_resolve_and_bad_keys_are_named() {
        let c = Config::default().resolve().unwrap();
        assert!(c.shards >= 1);
        assert!(c.memory_budget_mib >= 256);
        assert_eq!(c.allowed_uids.len(), 1);

        // Two memtables and 4 MiB of cache fit each shard's share.
        let mut c =
            Config::from_toml("shards = 1\nmemory_budget_mib = 16\nmemtable_mib = 7").unwrap();
        let e = c.clone().resolve().unwrap_err().to_string();
        assert!(
            e.contains("memtable_mib") && e.contains("at most 6 MiB"),
            "{e}"
        );
        c.memtable_mib = 6;
        c.resolve().unwrap();

        let e = Config::from_toml("shardz = 3").unwrap_err();
        assert!(e.contains("shardz"), "{e}");
        let e = Config::from_toml("[session]\nsq_entries = \"many\"").unwrap_err();
        assert!(e.contains("sq_entries"), "{e}");

        let mut c = Config::from_toml("[session]\nsq_entries = 100").unwrap();
        c.shards = 1;
        let e = c.resolve().unwrap_err().to_string();
        assert!(e.contains("session.sq_entries"), "{e}");

        let c = Config::from_toml("memory_budget_mib = 1\nshards = 2").unwrap();
        let e = c.resolve().unwrap_err().to_string();
        assert!(e.contains("memory_budget_mib"), "{e}");

        // Below 3 x the compaction trigger a checkpoint could wait forever.
        let c = Config::from_toml("checkpoint_layer_limit = 11").unwrap();
        let e = c.resolve().unwrap_err().to_string();
        assert!(
            e.contains("checkpoint_layer_limit") && e.contains("at least 12"),
            "{e}"
        );
        let c = Config::from_toml("checkpoint_layer_limit = 12").unwrap();
        assert_eq!(
            c.resolve().unwrap().store_config(0).checkpoint_layer_limit,
            12
        );
    }

    #[test]
    fn a_reload_takes_runtime_keys_and_names_the_others() {
        let old = Config::default().resolve().unwrap();
        let mut new = old.clone();
        new.log = "debug".into();
        new.max_sessions = 7;
        new.allowed_uids = vec![1, 2];
        new.session.max_in_flight = 99;
        new.session.batch = 3;
        new.shards += 1;
        let (run, restart) = old.reload(&new);
        assert_eq!(restart, ["shards", "session.batch"]);
        assert_eq!(run.log, "debug");
        assert_eq!(run.max_sessions, 7);
        assert_eq!(run.allowed_uids, [1, 2]);
        assert_eq!(run.session.max_in_flight, 99);
        assert_eq!(run.session.batch, old.session.batch);
        assert_eq!(run.shards, old.shards);
        assert_eq!(old.reload(&old), (old.clone(), vec![]));
    }

    /// Found by the `config` fuzz target: this filter's field pattern,
    /// compiled as a regular expression, took 11 s and over 2 GiB; a
    /// multi-byte character after blanks panicked in the parser; two equal
    /// field filters failed its debug assertion. Span and field filters
    /// and non-ASCII are refused, blanks around directives are fine, and
    /// the filter's length is capped.
    #[test]
    fn log_filters_are_targets_and_levels_only() {
        assert!(log_filter(" info , statord=debug,stator_store::tier=trace ").is_ok());
        for bad in [
            "[{x=(}]",
            ",,\t\tI\u{51f}.[f",
            "[{g =+}],[{g =+}],V[{=+}],V}]VVVVVVVV",
            "statord[span]=debug",
        ] {
            let e = log_filter(bad).unwrap_err();
            assert!(e.contains("targets and levels only"), "{bad}: {e}");
        }
        let log = r#",,,,,[[[[[[[t{ [[<=[6666]@@@@@@@@@@@@@ ............*...............0......................................;................lol@@@@@@@@66666666666666666660908&920560575185332uuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuuu88-66666666666666$6666666666666======'=====================6[t{ [[[[[[[[[[[[[[33289-66666666666666$66666666666666[t{ [[[[[[[[[[[[[[[}[[[[[{f"#;
        let e = Config::from_toml(&format!("log = {log:?}"))
            .unwrap()
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a log filter"), "{e}");
        let e = Config::from_toml(&format!("log = {:?}", "x".repeat(5000)))
            .unwrap()
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(e.contains("longer than 4096"), "{e}");
    }
}
