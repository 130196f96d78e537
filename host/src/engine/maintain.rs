//! `sluice maintain`: table maintenance of a job's sink (compaction,
//! snapshot expiry, orphan cleanup), done by the plugin's `maintenance`
//! export (contract 0.2.2) in an instance of its own, under the job's
//! grants.
//!
//! Invariants:
//! - the host knows nothing of the target's format: it only says what to do
//!   and which checkpoints are pending; the plugin keeps exactly-once;
//! - orphan cleanup is handed every pending checkpoint of this job and of
//!   every job the operator names (`--protect`), read after the plugin is
//!   loaded and right before the call, so no file a persisted but not yet
//!   committed checkpoint names is ever removed;
//! - the state directories are only read, never locked or changed, so a
//!   running job is not disturbed.

use std::fmt;
use std::time::Duration;

use super::EngineError;
use super::checkpoint::{CheckpointError, CheckpointStore, now_ms};
use crate::job::Job;
use crate::plugin::{MaintainRequest, PluginError, PluginHost, SinkCtx};

/// What to do (see `sluice maintain --help`).
#[derive(Debug, Clone, Default)]
pub struct MaintainOptions {
    /// The source's names of the tables; none: those the job's last
    /// checkpoint knows (or the job's single table).
    pub tables: Vec<String>,
    pub compact: bool,
    pub target_file_bytes: u64,
    pub expire_older_than: Option<Duration>,
    pub keep_last: Option<u32>,
    pub remove_orphans_older_than: Option<Duration>,
    /// Other jobs whose pending checkpoints orphan cleanup must spare.
    pub protect: Vec<Job>,
    pub dry_run: bool,
    /// How long the plugin's call may take.
    pub timeout: Duration,
}

/// What was done to one table.
#[derive(Debug, Clone)]
pub struct TableMaintained {
    pub target: String,
    pub files_compacted: u64,
    pub files_written: u64,
    pub rows_rewritten: u64,
    pub snapshots_expired: u64,
    pub files_removed: Vec<String>,
    pub notes: Vec<String>,
}

/// What `sluice maintain` did (or, in a dry run, would do).
#[derive(Debug, Clone)]
pub struct MaintainReport {
    pub dry_run: bool,
    pub tables: Vec<TableMaintained>,
}

impl fmt::Display for MaintainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let removed = if self.dry_run { "would remove" } else { "removed" };
        for t in &self.tables {
            writeln!(
                f,
                "table {}: compacted {} file(s) into {} ({} rows), expired {} snapshot(s), {removed} {} file(s)",
                t.target,
                t.files_compacted,
                t.files_written,
                t.rows_rewritten,
                t.snapshots_expired,
                t.files_removed.len()
            )?;
            if self.dry_run {
                for file in &t.files_removed {
                    writeln!(f, "  would remove {file}")?;
                }
            }
            for note in &t.notes {
                writeln!(f, "  note: {note}")?;
            }
        }
        Ok(())
    }
}

/// The combined commits of `job`'s pending checkpoints, for its own sink.
fn pending_of(job: &Job) -> Result<Vec<Vec<u8>>, CheckpointError> {
    let Some(store) = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)? else {
        return Ok(Vec::new());
    };
    Ok(store.latest()?.map(|r| r.pending.into_iter().map(|p| p.combined.0).collect()).unwrap_or_default())
}

fn cutoff(age: Duration) -> i64 {
    let now = i64::try_from(now_ms()).unwrap_or(i64::MAX);
    now.saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX))
}

/// Runs the maintenance `opts` asks for on `job`'s sink tables.
pub fn maintain(job: &Job, host: &PluginHost, opts: &MaintainOptions) -> Result<MaintainReport, EngineError> {
    let plugin = super::setup::load_plugin(job, host)?;
    if !plugin.maintains() {
        return Err(PluginError::Unsupported {
            plugin: plugin.name.clone(),
            version: plugin.version(),
            what: format!("maintain tables (it was built for {}, without the `maintenance` export)", plugin.contract()),
        }
        .into());
    }
    let store = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)?;
    let (incarnation, attempt, known) = match &store {
        Some(store) => {
            let latest = store.latest()?;
            let tables: Vec<String> = latest.iter().flat_map(|r| r.tables.iter().map(|t| t.name.clone())).collect();
            (store.incarnation()?.map(|i| i.id), store.attempts()?, tables)
        }
        None => (None, 0, Vec::new()),
    };
    let tables = if !opts.tables.is_empty() {
        opts.tables.clone()
    } else if !known.is_empty() {
        known
    } else {
        vec![String::new()]
    };
    let (grants, mut limits) = super::setup::grants_and_limits(job)?;
    limits.call_timeout = opts.timeout;
    let ctx = SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: incarnation.unwrap_or_else(|| "maintenance".to_string()),
        refuse_other_incarnations: false,
        beside: false,
        subtask: 0,
        parallelism: 1,
        attempt: attempt.saturating_add(1),
    };
    let options = plugin.options_for(job.sink_options(), &ctx);
    let mut instance = plugin.instantiate_maintainer("maintainer", &grants, limits)?;
    let mut request = MaintainRequest {
        tables,
        target_file_bytes: opts.compact.then_some(opts.target_file_bytes),
        expiry: (opts.expire_older_than.is_some() || opts.keep_last.is_some()).then(|| {
            // `--keep-last` alone keeps the newest N whatever their age.
            let older = opts.expire_older_than.map_or_else(|| cutoff(Duration::ZERO), cutoff);
            (Some(older), opts.keep_last)
        }),
        orphans_older_than_ms: opts.remove_orphans_older_than.map(cutoff),
        protected: Vec::new(),
        dry_run: opts.dry_run,
    };
    if request.orphans_older_than_ms.is_some() {
        request.protected = pending_of(job)?;
        for other in &opts.protect {
            request.protected.extend(pending_of(other)?);
        }
    }
    let reports = instance.maintain(&ctx, &options, &request)?;
    Ok(MaintainReport {
        dry_run: opts.dry_run,
        tables: reports
            .into_iter()
            .map(|r| TableMaintained {
                target: r.target,
                files_compacted: r.files_compacted,
                files_written: r.files_written,
                rows_rewritten: r.rows_rewritten,
                snapshots_expired: r.snapshots_expired,
                files_removed: r.files_removed,
                notes: r.notes,
            })
            .collect(),
    })
}
