//! What `GET /status` answers, as types: statord writes its JSON from
//! them and statorctl reads it into them, so the two cannot drift apart.
//! The same definitions, with these doc comments as descriptions, are
//! published as a JSON Schema (draft 2020-12) in
//! `daemon/status.schema.json`; a test fails when the file and the types
//! differ (`STATOR_BLESS=1 cargo test -p statord --lib status_schema`
//! rewrites it).
//!
//! Compatibility: fields are only added within a major version; a reader
//! ignores fields it does not know. Counters count since the daemon
//! started; byte sizes are bytes; `_s`, `_ms` and `_unix` fields are
//! seconds, milliseconds and seconds since the Unix epoch.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use crate::metrics::SessionReport;

/// The whole answer of `GET /status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct Status {
    /// statord's version (its crate version).
    pub version: String,
    pub pid: u32,
    pub uptime_s: f64,
    /// The daemon's clock when it answered (session ages are taken
    /// against it).
    pub now_unix: u64,
    pub state: ServeState,
    pub sessions_open: u64,
    /// `max_sessions` of the configuration.
    pub max_sessions: u64,
    /// Requests taken, all shards.
    pub requests: u64,
    /// Requests taken and not yet completed, all sessions.
    pub in_flight: u64,
    /// The stores' memory, all shards.
    pub memory: Memory,
    pub disk: Disk,
    /// Per operation: its opcode's name in snake case (`get`, `map_put`,
    /// ...), `unknown` for descriptors that name none.
    pub ops: BTreeMap<String, OpStats>,
    /// Upper bounds of the latency buckets of `ops`, seconds; `null` is
    /// the last, unbounded one.
    pub latency_bucket_bounds_s: Vec<Option<f64>>,
    pub shards: Vec<ShardStatus>,
    pub sessions: Vec<SessionReport>,
    /// Checkpoints the stores retain (completed or in progress), all
    /// shards.
    pub checkpoints: Vec<CheckpointStatus>,
    pub errors: Errors,
}

/// Whether the daemon serves or has begun to stop (SIGTERM).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum ServeState {
    Serving,
    Stopping,
}

/// Store memory against the budget (`memory_budget_mib`), by part.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct Memory {
    /// The sum of the parts below.
    pub used_bytes: u64,
    pub budget_bytes: u64,
    /// Active and frozen memtables, and flushed ones' memory kept for the
    /// next.
    pub memtables_bytes: u64,
    pub block_cache_bytes: u64,
    /// Segments' indexes and Bloom filters, always resident.
    pub indexes_and_filters_bytes: u64,
    /// What flushes and compactions in progress may hold (write buffers,
    /// sorts, read-ahead).
    pub background_bytes: u64,
    /// Checkpoint manifests kept in memory (retained ones and those being
    /// written), with the engine's metadata in each. Absent from an older
    /// statord.
    #[serde(default)]
    pub checkpoints_bytes: u64,
    /// The log bytes the active memtables freeze at (summed over shards):
    /// the configured size, or less where indexes, filters and background
    /// work leave less of the budget for memtables. Absent from an older
    /// statord.
    #[serde(default)]
    pub memtable_limit_bytes: u64,
}

impl From<&stator_store::MemoryUsage> for Memory {
    fn from(m: &stator_store::MemoryUsage) -> Memory {
        Memory {
            used_bytes: m.total() as u64,
            budget_bytes: m.budget as u64,
            memtables_bytes: m.memtables as u64,
            block_cache_bytes: m.block_cache as u64,
            indexes_and_filters_bytes: m.indexes_and_filters as u64,
            background_bytes: m.background as u64,
            checkpoints_bytes: m.checkpoints as u64,
            memtable_limit_bytes: m.memtable_limit as u64,
        }
    }
}

/// The data directory.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct Disk {
    pub data_dir: String,
    /// Every file under `data_dir`.
    pub used_bytes: u64,
    /// The stores' live segments.
    pub segment_bytes: u64,
    pub segments: u64,
}

/// One operation's counts and latency.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct OpStats {
    pub requests: u64,
    /// Completions with an error status.
    pub errors: u64,
    pub latency_sum_s: f64,
    /// Requests per latency bucket (not cumulative; bounds in
    /// `latency_bucket_bounds_s`): two reads give quantiles over the time
    /// between them.
    pub latency_buckets: Vec<u64>,
}

/// One shard, as it last reported.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct ShardStatus {
    pub id: u64,
    /// Age of the report this is built from (a shard reports every
    /// 250 ms).
    pub report_age_ms: u64,
    /// Its loop has not moved for 5 s (`/healthz` then answers 503).
    pub stuck: bool,
    pub requests: u64,
    pub sessions: u64,
    pub in_flight: u64,
    pub memory: Memory,
    pub store: StoreStatus,
    /// With the remote tier on.
    pub remote: Option<RemoteStatus>,
}

/// A shard's store.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct StoreStatus {
    pub segments: u64,
    pub segment_bytes: u64,
    pub flushes: u64,
    pub compactions: u64,
    /// Incomplete or damaged segment files kept aside (`*.torn`).
    pub torn_files: u64,
    /// Incomplete segment files deleted at open (nothing named them).
    pub torn_files_removed: u64,
    /// Times writes found no room (a flush behind) and waited.
    pub write_stalls: u64,
    pub write_stall_ms: u64,
    pub block_reads: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    /// Reads waiting for the disk now.
    pub pending_reads: u64,
    pub checkpoints_retained: u64,
    pub checkpoints_in_progress: u64,
    /// The last flush or compaction failure, until one succeeds.
    pub last_background_error: Option<String>,
}

/// A shard's remote tier.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct RemoteStatus {
    /// Objects known durable remotely (segments, manifests, markers).
    pub objects: u64,
    /// Segment files whose data is only remote.
    pub evicted_segments: u64,
    /// Bytes the segment files take on the local disk (at the last
    /// eviction pass).
    pub local_cache_bytes: u64,
    /// `null`: the local cache is unbounded.
    pub local_cache_budget_bytes: Option<u64>,
    pub local_block_reads: u64,
    pub remote_block_reads: u64,
    pub evictions: u64,
    /// Fetched spans written back into local files (the cache refilling).
    pub writebacks: u64,
    /// Local blocks that failed their checksum and were read remotely.
    pub refetched: u64,
    pub uploads_failed: u64,
    pub deletes_failed: u64,
    /// Uploads eviction started to make room: segments no checkpoint had
    /// uploaded yet, when they alone passed the local cache's budget.
    pub eager_uploads: u64,
    /// The last remote failure (read, upload, delete, eviction).
    pub last_error: Option<String>,
    /// GETs issued (after coalescing).
    pub gets: u64,
    pub gets_in_flight: u64,
    pub bytes_fetched: u64,
    pub uploads_pending: u64,
    pub bytes_uploaded: u64,
    pub retries: u64,
    /// Requests that failed after their retries.
    pub errors: u64,
}

/// A checkpoint a store retains.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct CheckpointStatus {
    pub shard: u64,
    pub job: String,
    pub operator: String,
    pub checkpoint_id: u64,
    pub key_group_lo: u16,
    pub key_group_hi: u16,
    /// Its handle, lower-case hex (what a restore sends).
    pub handle: String,
    /// Segments its manifest names.
    pub segments: u64,
    /// The engine said COMPLETE.
    pub completed: bool,
    /// Its manifest's sequence number (`MANIFEST-<seq>`).
    pub manifest: u64,
}

/// What went wrong.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(test, derive(schemars::JsonSchema))]
pub struct Errors {
    /// Completions with an error status, all operations.
    pub request_errors: u64,
    /// Conditions an operator should look at now (a stuck shard, a
    /// failing flush), one sentence each.
    pub problems: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/status.schema.json");

    /// A newer statord's added fields do not break an older reader.
    #[test]
    fn a_reader_ignores_fields_it_does_not_know() {
        let s = Status {
            version: "0.1.0".into(),
            pid: 7,
            uptime_s: 1.5,
            now_unix: 1,
            state: ServeState::Stopping,
            sessions_open: 0,
            max_sessions: 8,
            requests: 3,
            in_flight: 0,
            memory: Memory::default(),
            disk: Disk::default(),
            ops: BTreeMap::new(),
            latency_bucket_bounds_s: vec![Some(1e-6), None],
            shards: Vec::new(),
            sessions: vec![SessionReport::default()],
            checkpoints: Vec::new(),
            errors: Errors::default(),
        };
        let mut v = serde_json::to_value(&s).expect("JSON");
        v["added_later"] = serde_json::json!({"x": 1});
        v["sessions"][0]["added_later"] = serde_json::json!(2);
        let back: Status = serde_json::from_value(v).expect("read");
        assert_eq!(back, s);
        assert_eq!(
            serde_json::to_value(ServeState::Stopping).expect("JSON"),
            "stopping"
        );
    }

    #[test]
    fn the_published_schema_is_what_the_types_say() {
        let schema = schemars::schema_for!(Status);
        let text = serde_json::to_string_pretty(&schema).expect("JSON") + "\n";
        if std::env::var_os("STATOR_BLESS").is_some() {
            std::fs::write(SCHEMA, &text).expect("write the schema");
        }
        let committed = std::fs::read_to_string(SCHEMA).unwrap_or_default();
        assert!(
            committed == text,
            "{SCHEMA} is out of date with daemon/src/status_schema.rs: run `STATOR_BLESS=1 cargo test -p statord --lib status_schema` and commit it"
        );
    }
}
