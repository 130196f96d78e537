//! The run's metrics and health: one Prometheus registry, which the
//! coordinator updates, and the health verdict `/healthz` gives.
//! [`server`] serves both over HTTP.
//!
//! Invariants:
//! - there is one registry per process run ([`Metrics`] is a cheap handle
//!   to it); only the host updates it, in the coordinator (and the committer
//!   it drives): a plugin reports nothing except through what the host sees;
//! - rows and bytes count when their checkpoint is committed (landed), per
//!   table, as the writers handed them to the plugin (bytes: Arrow IPC);
//!   a checkpoint recovered from an earlier run's record is not counted
//!   again, since that run's writers wrote it;
//! - health is a verdict on the age of the last commit (or of the run's
//!   start, before its first commit) against `job.health.max_commit_age`;
//! - this module imports nothing of the engine, the sources or the CLI: they
//!   all call into it, and the imports point one way.

pub mod server;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub use server::{MetricsServer, ServeError};

/// How long a job may go without a commit before it is unhealthy, when the
/// job says nothing and checkpoints by rows only: three default intervals.
pub const DEFAULT_MAX_COMMIT_AGE: Duration = Duration::from_secs(30);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobTable {
    job: String,
    table: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobLabel {
    job: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct JobResult {
    job: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SinkLabel {
    sink: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SubtaskLabel {
    subtask: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PartitionLabel {
    topic: String,
    partition: String,
}

/// Why the host retried a commit (`sluice_commit_retries_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    /// The catalog refused the commit: another writer committed first.
    Conflict,
    /// The commit may or may not have been applied (a lost reply); the
    /// next attempt checks first.
    UnknownOutcome,
    /// Any other `retryable` answer of the plugin (a transient failure).
    Retryable,
}

impl RetryReason {
    pub fn label(self) -> &'static str {
        match self {
            RetryReason::Conflict => "conflict",
            RetryReason::UnknownOutcome => "unknown_outcome",
            RetryReason::Retryable => "retryable_error",
        }
    }
}

/// Rows and bytes of one table in one checkpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tally {
    pub rows: u64,
    pub bytes: u64,
    /// Records of the table that did not convert (dead letters).
    #[serde(default)]
    pub bad: u64,
}

/// The families of the registry.
#[derive(Debug)]
struct Families {
    rows: Family<JobTable, Counter>,
    bytes: Family<JobTable, Counter>,
    bad_rows: Family<JobTable, Counter>,
    checkpoint_duration: Histogram,
    commit_duration: Family<SinkLabel, Histogram, fn() -> Histogram>,
    commit_retries: Family<ReasonLabel, Counter>,
    last_committed: Family<JobLabel, Gauge>,
    last_commit_time: Family<JobLabel, Gauge<f64, AtomicU64>>,
    writer_memory: Family<SubtaskLabel, Gauge>,
    writer_memory_limit: Gauge,
    source_lag: Family<PartitionLabel, Gauge>,
    maintenance_passes: Family<JobResult, Counter>,
    files_compacted: Family<JobLabel, Counter>,
}

fn seconds_buckets() -> Histogram {
    // 5 ms to about 164 s.
    Histogram::new(exponential_buckets(0.005, 2.0, 16))
}

/// What `/healthz` judges.
#[derive(Debug)]
struct HealthState {
    job: Option<String>,
    max_commit_age: Duration,
    /// The run's start, or its last commit.
    since: Instant,
    last_committed: Option<u64>,
    /// The last commit attempt's error, cleared by a commit.
    last_error: Option<String>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    families: Families,
    health: Mutex<HealthState>,
}

/// The run's metrics registry and health; clones share it.
#[derive(Debug, Clone)]
pub struct Metrics(Arc<Inner>);

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let families = Families {
            rows: Family::default(),
            bytes: Family::default(),
            bad_rows: Family::default(),
            checkpoint_duration: seconds_buckets(),
            commit_duration: Family::new_with_constructor(seconds_buckets as fn() -> Histogram),
            commit_retries: Family::default(),
            last_committed: Family::default(),
            last_commit_time: Family::default(),
            writer_memory: Family::default(),
            writer_memory_limit: Gauge::default(),
            source_lag: Family::default(),
            maintenance_passes: Family::default(),
            files_compacted: Family::default(),
        };
        let f = &families;
        registry.register("sluice_rows", "Rows landed: in checkpoints committed by this run", f.rows.clone());
        registry.register(
            "sluice_bytes",
            "Bytes landed (Arrow IPC as handed to the plugin: only the columns it reads, when it asked for some), in checkpoints committed by this run",
            f.bytes.clone(),
        );
        registry.register("sluice_bad_rows", "Records of the table that did not convert and landed as dead letters, counted when their checkpoint committed", f.bad_rows.clone());
        registry.register(
            "sluice_checkpoint_duration_seconds",
            "From a checkpoint's barrier (the writers' cut) until it is committed",
            f.checkpoint_duration.clone(),
        );
        registry.register(
            "sluice_commit_duration_seconds",
            "One checkpoint's commit by the sink, retries included",
            f.commit_duration.clone(),
        );
        registry.register(
            "sluice_commit_retries",
            "Commit attempts the host retried, by reason (conflict, unknown_outcome, retryable_error)",
            f.commit_retries.clone(),
        );
        for reason in [RetryReason::Conflict, RetryReason::UnknownOutcome, RetryReason::Retryable] {
            drop(f.commit_retries.get_or_create(&ReasonLabel { reason: reason.label().to_string() }));
        }
        registry.register(
            "sluice_last_committed_checkpoint",
            "The newest checkpoint committed",
            f.last_committed.clone(),
        );
        registry.register(
            "sluice_last_commit_timestamp_seconds",
            "When the newest checkpoint was committed (Unix time)",
            f.last_commit_time.clone(),
        );
        registry.register(
            "sluice_writer_memory_bytes",
            "Linear memory of a writer's plugin instance, at its last checkpoint",
            f.writer_memory.clone(),
        );
        registry.register(
            "sluice_writer_memory_limit_bytes",
            "The linear-memory cap of one plugin instance (sink.sandbox.memory_mb)",
            f.writer_memory_limit.clone(),
        );
        registry.register(
            "sluice_source_lag",
            "Kafka messages not read yet: high watermark minus the next offset",
            f.source_lag.clone(),
        );
        registry.register(
            "sluice_maintenance_passes",
            "Maintenance passes of a running job ([sink.maintenance]), by result (ok, failed)",
            f.maintenance_passes.clone(),
        );
        registry.register(
            "sluice_maintenance_files_compacted",
            "Data files a running job's maintenance replaced by compacted ones",
            f.files_compacted.clone(),
        );
        let health = HealthState {
            job: None,
            max_commit_age: DEFAULT_MAX_COMMIT_AGE,
            since: Instant::now(),
            last_committed: None,
            last_error: None,
        };
        Self(Arc::new(Inner { registry, families, health: Mutex::new(health) }))
    }

    fn health(&self) -> MutexGuard<'_, HealthState> {
        // A panic while holding the lock leaves plain data behind.
        self.0.health.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn f(&self) -> &Families {
        &self.0.families
    }

    /// A maintenance pass of `job` ended: `compacted` files replaced, or failed.
    pub fn maintained(&self, job: &str, compacted: Option<u64>) {
        let result = if compacted.is_some() { "ok" } else { "failed" };
        self.f()
            .maintenance_passes
            .get_or_create(&JobResult { job: job.to_string(), result: result.to_string() })
            .inc();
        if let Some(n) = compacted {
            self.f().files_compacted.get_or_create(&JobLabel { job: job.to_string() }).inc_by(n);
        }
    }

    /// A run of `job` starts: health counts from now, against `max_commit_age`.
    pub fn start_run(&self, job: &str, max_commit_age: Duration, memory_limit_bytes: u64) {
        let mut h = self.health();
        h.job = Some(job.to_string());
        h.max_commit_age = max_commit_age;
        h.since = Instant::now();
        h.last_error = None;
        drop(h);
        self.f().writer_memory_limit.set(i64::try_from(memory_limit_bytes).unwrap_or(i64::MAX));
    }

    /// Checkpoint `checkpoint` of `job` is committed; `landed` are its rows
    /// and bytes per table. Checkpoints commit in order, so one at or
    /// below the last committed one this registry saw was counted already
    /// (a run started again in this process re-commits its recovered
    /// checkpoints): its rows are not counted twice.
    pub fn committed(&self, job: &str, checkpoint: u64, landed: &BTreeMap<String, Tally>) {
        let f = self.f();
        let labels = JobLabel { job: job.to_string() };
        let number = i64::try_from(checkpoint).unwrap_or(i64::MAX);
        if number > f.last_committed.get_or_create(&labels).get() {
            for (table, tally) in landed {
                let labels = JobTable { job: job.to_string(), table: table.clone() };
                f.rows.get_or_create(&labels).inc_by(tally.rows);
                f.bytes.get_or_create(&labels).inc_by(tally.bytes);
                f.bad_rows.get_or_create(&labels).inc_by(tally.bad);
            }
        }
        f.last_committed.get_or_create(&labels).set(number);
        self.health().last_committed = Some(checkpoint);
        self.settled(job);
    }

    /// Checkpoint `checkpoint` had nothing to commit and nothing is pending
    /// (an idle source): the job is as current as a commit would make it.
    /// It took `elapsed` from its barrier.
    pub fn caught_up(&self, checkpoint: u64, elapsed: Duration) {
        self.checkpoint_duration(elapsed);
        let job = self.health().job.clone().unwrap_or_default();
        tracing::trace!(checkpoint, "checkpoint had nothing to commit");
        self.settled(&job);
    }

    /// Every checkpoint persisted so far is committed, now.
    fn settled(&self, job: &str) {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        self.f().last_commit_time.get_or_create(&JobLabel { job: job.to_string() }).set(now);
        let mut h = self.health();
        h.since = Instant::now();
        h.last_error = None;
    }

    /// Makes `sluice_bad_rows_total{job,table}` show (at 0) before any bad row.
    pub fn declare_table(&self, job: &str, table: &str) {
        let labels = JobTable { job: job.to_string(), table: table.to_string() };
        drop(self.f().bad_rows.get_or_create(&labels));
    }

    /// A checkpoint took `elapsed` from its barrier to its commit.
    pub fn checkpoint_duration(&self, elapsed: Duration) {
        self.f().checkpoint_duration.observe(elapsed.as_secs_f64());
    }

    /// One checkpoint's commit by `sink` took `elapsed`, retries included.
    pub fn commit_duration(&self, sink: &str, elapsed: Duration) {
        self.f().commit_duration.get_or_create(&SinkLabel { sink: sink.to_string() }).observe(elapsed.as_secs_f64());
    }

    /// The host retries a commit after `error`, for `reason`.
    pub fn commit_retry(&self, reason: RetryReason, error: &str) {
        self.f().commit_retries.get_or_create(&ReasonLabel { reason: reason.label().to_string() }).inc();
        self.health().last_error = Some(error.to_string());
    }

    /// A commit failed for good (the run fails with it).
    pub fn commit_failed(&self, error: &str) {
        self.health().last_error = Some(error.to_string());
    }

    /// A writer's instance has `bytes` of linear memory.
    pub fn writer_memory(&self, subtask: u32, bytes: u64) {
        let labels = SubtaskLabel { subtask: subtask.to_string() };
        self.f().writer_memory.get_or_create(&labels).set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A Kafka partition's lag, as its reader saw it last.
    pub fn source_lag(&self, topic: &str, partition: i32, lag: i64) {
        let labels = PartitionLabel { topic: topic.to_string(), partition: partition.to_string() };
        self.f().source_lag.get_or_create(&labels).set(lag);
    }

    /// The registry in the OpenMetrics text format (with `# EOF`).
    pub fn openmetrics_text(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.0.registry) {
            // Writing into a String fails only if a metric's encoder does.
            tracing::warn!(error = %e, "encoding the metrics failed");
        }
        out
    }

    /// The registry in the Prometheus text format 0.0.4 (what a scrape
    /// that asks for no OpenMetrics gets).
    pub fn prometheus_text(&self) -> String {
        to_prometheus_text(&self.openmetrics_text())
    }

    /// `Ok(what)` while the job commits within its maximum commit age,
    /// `Err(why)` otherwise.
    pub fn verdict(&self) -> Result<String, String> {
        let h = self.health();
        let job = h.job.as_deref().unwrap_or("(not started)");
        let age = h.since.elapsed();
        let last = match h.last_committed {
            Some(c) => format!("last committed checkpoint {c}, {:.1} s ago", age.as_secs_f64()),
            None => format!("no checkpoint committed yet, run started {:.1} s ago", age.as_secs_f64()),
        };
        if age <= h.max_commit_age {
            return Ok(format!("ok: job {job}: {last}\n"));
        }
        let mut why = format!(
            "unhealthy: job {job}: {last}, longer than job.health.max_commit_age ({:.1} s)",
            h.max_commit_age.as_secs_f64()
        );
        if let Some(e) = &h.last_error {
            let _ = write!(why, "; the last commit attempt failed: {e}");
        }
        why.push('\n');
        Err(why)
    }
}

/// OpenMetrics text as the Prometheus text format 0.0.4: a counter family
/// is named with its `_total` suffix (as its samples are), `# UNIT` and
/// `# EOF` go, and so do `_created` samples.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters.contains(&name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(line) => out.push_str(line.trim_end()),
            None => {
                let name = line.split(['{', ' ']).next().unwrap_or("");
                if !line.starts_with('#') && name.ends_with("_created") {
                    continue;
                }
                out.push_str(line);
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_named_with_their_total_in_the_prometheus_text() {
        let m = Metrics::new();
        let mut landed = BTreeMap::new();
        landed.insert("orders".to_string(), Tally { rows: 5, bytes: 100, bad: 2 });
        m.committed("j", 3, &landed);
        m.commit_retry(RetryReason::Conflict, "another writer committed first");
        let text = m.prometheus_text();
        assert!(text.contains("# TYPE sluice_rows_total counter\n"), "{text}");
        assert!(text.contains("# HELP sluice_rows_total Rows landed"), "{text}");
        assert!(text.contains("sluice_rows_total{job=\"j\",table=\"orders\"} 5\n"), "{text}");
        assert!(text.contains("sluice_bad_rows_total{job=\"j\",table=\"orders\"} 2\n"), "{text}");
        assert!(text.contains("sluice_commit_retries_total{reason=\"conflict\"} 1\n"), "{text}");
        assert!(text.contains("sluice_commit_retries_total{reason=\"unknown_outcome\"} 0\n"), "{text}");
        assert!(text.contains("sluice_last_committed_checkpoint{job=\"j\"} 3\n"), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
        assert!(m.openmetrics_text().ends_with("# EOF\n"));
    }

    #[test]
    fn health_turns_with_the_age_of_the_last_commit() {
        let m = Metrics::new();
        m.start_run("j", Duration::from_millis(50), 1 << 20);
        assert!(m.verdict().is_ok());
        std::thread::sleep(Duration::from_millis(80));
        m.commit_retry(RetryReason::Conflict, "refused");
        let why = m.verdict().expect_err("too old");
        assert!(why.contains("no checkpoint committed yet") && why.contains("refused"), "{why}");
        m.committed("j", 1, &BTreeMap::new());
        let ok = m.verdict().expect("a commit makes it healthy");
        assert!(ok.contains("last committed checkpoint 1"), "{ok}");
    }
}
