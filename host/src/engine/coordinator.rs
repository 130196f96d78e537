//! The checkpoint coordinator: sets a run up, recovers, then runs one
//! checkpoint after another: gather, combine, persist, commit.
//!
//! Invariants of the protocol (the crash matrix in `tests/` proves each):
//! - nothing is committed before the record naming it is durable, and a
//!   record is written only after every writer prepared its part;
//! - pending checkpoints are committed oldest first, each until the plugin
//!   answers `committed` or `already-committed`; the host alone retries a
//!   `retryable` answer (job.commit), so retries never multiply;
//! - a checkpoint this run prepared that the plugin reports as
//!   `already-committed` on its first commit proves that its idempotence key
//!   was taken before: the run fails, reports nothing delivered, and halts
//!   the state directory;
//! - a failure at any point leaves the job resumable with nothing lost and
//!   nothing committed twice;
//! - a round that ends at a barrier (a new table, a wider schema) is
//!   persisted and committed like any other; only then does the committer
//!   evolve the target, the writers apply the changes, and the next round
//!   start, so no row of a new shape is written before its table takes it.
//!   `evolve` is idempotent: a crash after it replays the barrier, and the
//!   target already has the change.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sluice_retry::{Failed, Policy};

use super::checkpoint::{
    Blob, CheckpointRecord, CheckpointStore, DroppedCommit, Incarnation, PendingCommit, SubtaskRecord, now_ms,
};
use super::pool::{LocalPool, WriterEnv, WriterPool, WriterSetup};
use super::subtask::RoundReport;
use super::tables::{self, Change, TableSet};
use super::{EngineError, RunOptions, crash_point};
use crate::bindings::{CommitOutcome, PluginInfo};
use crate::capability::Granted;
use crate::capability::catalog::CatalogGrant;
use crate::capability::file_io::FileGrants;
use crate::capability::grpc::GrpcGrant;
use crate::capability::http::HttpGrant;
use crate::job::{CatalogConfig, Job, JobError};
use crate::plugin::{
    CommitterInstance, ContractVersion, Limits, Plugin, PluginError, PluginHost, SinkCtx, SinkErrorKind, reserved,
};
use crate::progress::{Progress, peak_memory};
use crate::source::Source;

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub job_id: String,
    /// The incarnation of the job's state directory.
    pub incarnation: String,
    /// This run started the incarnation (its state directory was new).
    pub new_incarnation: bool,
    pub attempt: u32,
    /// Checkpoint the run resumed after, if any.
    pub resumed_from: Option<u64>,
    /// Pending checkpoints committed again on start, with their outcome.
    pub recovered: Vec<(u64, CommitOutcome)>,
    pub rows_this_run: u64,
    pub rows_total: u64,
    pub checkpoints_this_run: u64,
    pub last_committed: Option<u64>,
    pub elapsed: Duration,
    /// Time spent moving rows (from the first read to the end), without
    /// loading the plugin and recovering.
    pub data_elapsed: Duration,
    /// From the start of the run to the first rows written (plugin loaded,
    /// recovered, writers opened): the start-up cost a user waits through.
    pub first_write: Option<Duration>,
    /// The process's peak resident memory so far (Linux), in bytes.
    pub peak_memory: Option<u64>,
    /// The largest linear memory a writer instance had (its sandbox limit
    /// is `sink.sandbox.memory_mb`), in bytes.
    pub writer_memory: Option<u64>,
    /// `commit-table` calls and conflicts the catalog saw (Iceberg sinks).
    pub catalog_commits: u64,
    pub catalog_conflicts: u64,
    /// The job had already finished before this run; nothing was read.
    pub already_complete: bool,
}

impl std::fmt::Display for RunSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64();
        let data_secs = self.data_elapsed.as_secs_f64();
        let rate = if data_secs > 0.0 { self.rows_this_run as f64 / data_secs } else { 0.0 };
        let committed = self.last_committed.map_or("none".to_string(), |c| c.to_string());
        if self.already_complete {
            return write!(
                f,
                "job {} was already complete: {} rows delivered, last committed checkpoint {committed}{}, incarnation {}",
                self.job_id,
                self.rows_total,
                if self.recovered.is_empty() {
                    String::new()
                } else {
                    format!(", {} pending commit(s) finished now", self.recovered.len())
                },
                self.incarnation,
            );
        }
        write!(
            f,
            "job {} finished: {} rows in {secs:.1}s ({rate:.0} rows/s over {data_secs:.1}s of data movement), {} checkpoint(s), last committed checkpoint {committed}, {} rows in total{}, attempt {}, incarnation {}{}",
            self.job_id,
            self.rows_this_run,
            self.checkpoints_this_run,
            self.rows_total,
            self.resumed_from.map_or(String::new(), |c| format!(", resumed after checkpoint {c}")),
            self.attempt,
            self.incarnation,
            if self.new_incarnation { " (new)" } else { "" },
        )?;
        if let Some(bytes) = self.peak_memory {
            write!(f, ", peak memory {} MB", bytes / (1024 * 1024))?;
        }
        Ok(())
    }
}

/// Host-side check of the options against what the plugin declares.
pub(super) fn check_options(job: &Job, info: &PluginInfo) -> Vec<JobError> {
    let mut errors = Vec::new();
    let options = job.sink_options();
    let known: Vec<&str> =
        info.options.iter().map(|o| o.name.as_str()).filter(|name| !reserved::is_reserved(name)).collect();
    for (key, _) in &options {
        if reserved::is_reserved(key) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{key}"),
                message: format!("options starting with `{}` are the host's own; remove it", reserved::PREFIX),
            });
        } else if !known.contains(&key.as_str()) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{key}"),
                message: format!("plugin '{}' has no such option (it takes: {})", info.name, known.join(", ")),
            });
        }
    }
    for spec in info.options.iter().filter(|o| o.required && o.default_value.is_none()) {
        if !reserved::is_reserved(&spec.name) && !options.iter().any(|(k, _)| k == &spec.name) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{}", spec.name),
                message: format!("required by plugin '{}': {}", info.name, spec.description),
            });
        }
    }
    errors
}

/// Who an instance is: writer `subtask`, or the committer (0), of
/// `incarnation`; `refuse_others` on a fresh state directory's first run.
pub(super) fn sink_ctx(
    job: &Job,
    incarnation: &Incarnation,
    refuse_others: bool,
    subtask: u32,
    attempt: u32,
) -> SinkCtx {
    SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: incarnation.id.clone(),
        refuse_other_incarnations: refuse_others,
        beside: incarnation.beside,
        subtask,
        parallelism: job.spec.job.parallelism,
        attempt,
    }
}

/// Refuses a plugin that takes one table for a source of named tables.
fn check_tables(plugin: &Plugin, source: &Source, tables: &TableSet) -> Result<(), EngineError> {
    if plugin.multi_table() || !(source.is_multi_table() || tables.is_named()) {
        return Ok(());
    }
    if plugin.version() == ContractVersion::V0_1 {
        return Err(PluginError::Unsupported {
            plugin: plugin.name.clone(),
            version: plugin.version(),
            what: "take several tables".to_string(),
        }
        .into());
    }
    Err(EngineError::SingleTablePlugin { plugin: plugin.name.to_string(), described: source.describe() })
}

/// `"orders"`, or `the source's table` for the unnamed one.
fn table_label(table: &str) -> String {
    if table.is_empty() { "the source's table".to_string() } else { format!("{table:?}") }
}

/// What a run of `job` grants its plugin instances, and their limits: for
/// tools that drive a plugin directly (the conformance suite).
pub fn grants_and_limits(job: &Job) -> Result<(Granted, Limits), EngineError> {
    Ok((grants(job, &RunOptions::default())?, limits(job)))
}

pub(crate) fn limits(job: &Job) -> Limits {
    Limits::of(&job.spec.sink.sandbox)
}

pub(crate) fn grants(job: &Job, #[allow(unused_variables)] opts: &RunOptions) -> Result<Granted, EngineError> {
    let g = &job.spec.sink.grants;
    let mut locations = g.locations.clone();
    let catalog = match &job.catalog {
        None => None,
        Some(config) => {
            // The tables' files live in the warehouse: the plugin writes them.
            locations.push(config.warehouse().to_string_lossy().into_owned());
            let catalog = match config {
                CatalogConfig::Sql { name, database, warehouse } => CatalogGrant::open_sql(name, database, warehouse)?,
                CatalogConfig::Rest { name, uri, warehouse, token } => {
                    CatalogGrant::open_rest(name, uri, warehouse, token.as_ref().map(|t| t.expose().to_string()))?
                }
            };
            #[cfg(feature = "fault-injection")]
            let catalog = catalog.with_faults(crate::fault::CatalogFaults {
                faults: opts.catalog_faults.clone(),
                latency: opts.catalog_latency,
            });
            Some(Arc::new(catalog))
        }
    };
    let files = FileGrants::new(&job.base_dir, &locations, &g.read_locations)?;
    let grpc = GrpcGrant::open(&job.endpoints)?;
    let http = HttpGrant::open(&job.http_endpoints)?;
    Ok(Granted { files: Arc::new(files), catalog, grpc: Arc::new(grpc), http: Arc::new(http) })
}

/// Result of `sluice check`.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// What was checked and found fine.
    pub passed: Vec<String>,
    /// One line per problem, each naming its cause.
    pub problems: Vec<String>,
}

/// Validates a job without moving data: plugin, options, grants, source, the
/// state directory, and the plugin's own `validate` against the source
/// schema (which, for a new state directory, also looks for checkpoints of
/// another incarnation in the target).
pub fn check(job: &Job, host: &PluginHost) -> CheckReport {
    let mut report = CheckReport::default();
    let plugin = match host.load(&job.spec.sink.plugin) {
        Ok(p) => p,
        Err(e) => {
            report.problems.push(e.to_string());
            return report;
        }
    };
    if let Some(info) = plugin.info() {
        report.passed.push(format!("plugin {} {} ({})", info.name, info.version, plugin.path.display()));
        let option_errors = check_options(job, info);
        if option_errors.is_empty() {
            report.passed.push(format!("{} sink option(s) known to the plugin", job.sink_options().len()));
        }
        report.problems.extend(option_errors.iter().map(ToString::to_string));
    }
    let mut latest = None;
    let identity = match super::state::inspect(job) {
        Ok(state) => {
            report.passed.push(format!("state: {}", state.one_line()));
            if let Some(halt) = &state.halted {
                report.problems.push(format!("the state directory is halted: {}", halt.reason));
            }
            latest = state.latest;
            state.incarnation.map(|i| (i, false))
        }
        Err(e) => {
            report.problems.push(e.to_string());
            None
        }
    };
    let grants = match grants(job, &RunOptions::default()) {
        Ok(g) => {
            report.passed.push(format!("grants: {}", g.describe()));
            Some(g)
        }
        Err(e) => {
            report.problems.push(e.to_string());
            None
        }
    };
    let source = match Source::open(&job.spec.source, job.spec.job.parallelism) {
        Ok(s) => {
            report.passed.push(format!("source: {}", s.describe()));
            if let Some(r) = &latest
                && let Err(change) = s.check_identity(r.source.as_ref())
            {
                report
                    .problems
                    .push(EngineError::SourceChanged { checkpoint: r.checkpoint, what: change.0 }.to_string());
            }
            Some(s)
        }
        Err(e) => {
            report.problems.push(e.to_string());
            None
        }
    };
    if let (Some(grants), Some(source)) = (grants, source)
        && report.problems.is_empty()
    {
        // A new state directory: the first run would refuse another incarnation's checkpoints.
        let (incarnation, refuse) = match identity {
            Some(known) => known,
            None => match Incarnation::generate() {
                Ok(i) => (i, true),
                Err(e) => {
                    report.problems.push(e.to_string());
                    return report;
                }
            },
        };
        let ctx = sink_ctx(job, &incarnation, refuse, 0, 0);
        let options = plugin.options_for(job.sink_options(), &ctx);
        let result = source
            .tables()
            .map_err(EngineError::from)
            .map(TableSet::new)
            .and_then(|known| check_tables(&plugin, &source, &known).map(|()| known))
            .and_then(|known| Ok(known.source_tables()?))
            .and_then(|tables| {
                let mut inst = plugin.instantiate("check", &grants, limits(job))?;
                inst.validate(&ctx, &options, &tables).map_err(EngineError::from)
            });
        match result {
            Ok(()) => report.passed.push("the plugin accepts the options and the source schema".to_string()),
            Err(e) => report.problems.push(e.to_string()),
        }
    }
    report
}

/// Everything a run holds between its checkpoints.
struct Coordinator<'a> {
    job: &'a Job,
    store: CheckpointStore,
    plugin: Plugin,
    grants: Granted,
    committer: CommitterInstance,
    source: Arc<Source>,
    /// The options every instance opens with (the job's and the host's own).
    options: Vec<(String, String)>,
    /// The tables the writers know, with their current schemas.
    tables: TableSet,
    /// Refuse another incarnation's checkpoints (a fresh state directory's first run).
    refuse_others: bool,
    restored: Option<CheckpointRecord>,
    incarnation: Incarnation,
    new_incarnation: bool,
    attempt: u32,
    /// The first checkpoint this run prepares.
    first: u64,
    pending: Vec<PendingCommit>,
    dropped: Vec<DroppedCommit>,
    last_committed: Option<u64>,
    /// Rows covered by the newest persisted checkpoint.
    rows_total: u64,
    progress: Arc<Progress>,
    /// The largest linear memory of a writer instance, once they closed.
    writer_memory: Option<u64>,
    #[cfg(feature = "fault-injection")]
    fault: Option<crate::fault::Fault>,
}

/// Runs a job to the end of its source, resuming from its last checkpoint,
/// with its writers on threads of this process.
pub fn run(job: &Job, host: &PluginHost, opts: &RunOptions) -> Result<RunSummary, EngineError> {
    run_on(job, host, opts, &mut LocalPool::default())
}

/// Like [`run`], with the writers in `pool` (for example Ray actors on
/// other machines). The coordinator, the committer and the checkpoint store
/// stay in this process. A pool that loses a writer fails the run like a
/// crash: nothing is lost, and a new run (with a new pool) resumes from the
/// last persisted checkpoint.
pub fn run_on(
    job: &Job,
    host: &PluginHost,
    opts: &RunOptions,
    pool: &mut dyn WriterPool,
) -> Result<RunSummary, EngineError> {
    let started = Instant::now();
    let progress = Progress::new(opts.progress);
    let _status = progress.start_status_line();
    let mut co = Coordinator::setup(job, host, opts, progress)?;
    let recovered = co.commit_pending(false)?;
    for (c, outcome) in &recovered {
        tracing::info!(checkpoint = c, outcome = ?outcome, "re-committed pending checkpoint on restore");
    }
    if co.restored.as_ref().is_some_and(CheckpointRecord::finished) {
        co.settle_last_record()?;
        return Ok(co.summary(started, recovered, co.first, true));
    }
    co.open_writers(pool)?;
    co.progress.data_started();
    let mut c = co.first;
    pool.start_round(c)?;
    while !co.checkpoint(pool, c)? {
        c += 1;
    }
    co.writer_memory = Some(pool.close()?);
    co.settle_last_record()?;
    Ok(co.summary(started, recovered, c + 1, false))
}

/// Best effort: every writer releases what `prepare-commit(c)` prepared.
fn abort_prepare(pool: &mut dyn WriterPool, c: u64) {
    let all: Vec<u32> = (0..pool.len() as u32).collect();
    pool.abort_prepare(c, &all);
}

impl<'a> Coordinator<'a> {
    /// Loads the plugin and opens the source, then opens the state
    /// directory, checks the newest record against the job (parallelism,
    /// source identity, sink), settles the incarnation and opens the
    /// committer. Nothing is written to the target before the committer has
    /// accepted the incarnation.
    fn setup(job: &'a Job, host: &PluginHost, opts: &RunOptions, progress: Arc<Progress>) -> Result<Self, EngineError> {
        let spec = &job.spec;
        let parallelism = spec.job.parallelism;
        // The plugin and the source first: a job that cannot start leaves
        // the state directory as it was (not created, no attempt counted).
        let plugin = host.load(&spec.sink.plugin)?;
        if let Some(info) = plugin.info()
            && let Some(e) = check_options(job, info).into_iter().next()
        {
            return Err(e.into());
        }
        let source = Arc::new(Source::open(&spec.source, parallelism)?);
        let store = open_unhalted(job)?;
        let restored = store.latest()?;
        if let Some(r) = &restored {
            if r.parallelism != parallelism {
                return Err(EngineError::ParallelismChanged {
                    checkpoint: r.checkpoint,
                    recorded: r.parallelism,
                    now: parallelism,
                });
            }
            if let Err(change) = source.check_identity(r.source.as_ref()) {
                return Err(EngineError::SourceChanged { checkpoint: r.checkpoint, what: change.0 });
            }
            if r.sink_id != spec.sink.id {
                return Err(EngineError::SinkChanged {
                    checkpoint: r.checkpoint,
                    recorded: r.sink_id.clone(),
                    now: spec.sink.id.clone(),
                });
            }
        }
        let (incarnation, new_incarnation) = settle_incarnation(job, &store, restored.as_ref(), opts)?;
        let attempt = store.next_attempt()?;
        match &restored {
            Some(r) => tracing::info!(
                job = %spec.job.id,
                incarnation = %incarnation.id,
                checkpoint = r.checkpoint,
                pending = r.pending.len(),
                attempt,
                "resuming from checkpoint record"
            ),
            None => tracing::info!(
                job = %spec.job.id,
                incarnation = %incarnation.id,
                attempt,
                state_dir = %job.state_dir.display(),
                "starting job from the beginning"
            ),
        }

        let refuse_others = new_incarnation && !opts.new_incarnation;
        warn_about_incarnation_support(job, &plugin, &incarnation, refuse_others);
        // The tables as the last checkpoint left them, else as the source starts.
        let tables = match restored.as_ref().filter(|r| !r.tables.is_empty()) {
            Some(r) => TableSet::from_records(&r.tables)?,
            None => TableSet::new(source.tables()?),
        };
        check_tables(&plugin, &source, &tables)?;
        let grants = grants(job, opts)?;
        let ctx = sink_ctx(job, &incarnation, refuse_others, 0, attempt);
        let options = plugin.options_for(job.sink_options(), &ctx);
        let instance = plugin.instantiate("committer", &grants, limits(job))?;
        let committer = CommitterInstance::open(instance, &ctx, &options, &tables.source_tables()?)?;
        if new_incarnation {
            // The committer found no other incarnation in the target (or was told to accept one).
            store.set_incarnation(&incarnation)?;
            tracing::info!(job = %spec.job.id, incarnation = %incarnation.id, "started a new incarnation of the job");
        }
        Ok(Self {
            job,
            store,
            plugin,
            grants,
            committer,
            source,
            options,
            tables,
            refuse_others,
            first: restored.as_ref().map_or(1, |r| r.checkpoint + 1),
            pending: restored.as_ref().map(|r| r.pending.clone()).unwrap_or_default(),
            dropped: restored.as_ref().map(|r| r.dropped.clone()).unwrap_or_default(),
            last_committed: restored.as_ref().and_then(|r| r.last_committed),
            rows_total: restored.as_ref().map_or(0, CheckpointRecord::total_rows),
            restored,
            incarnation,
            new_incarnation,
            attempt,
            progress,
            writer_memory: None,
            #[cfg(feature = "fault-injection")]
            fault: opts.fault,
        })
    }

    /// Opens one writer (source reader and plugin writer) per subtask,
    /// restored from the last checkpoint, and waits until every one is open.
    fn open_writers(&self, pool: &mut dyn WriterPool) -> Result<(), EngineError> {
        let (every_rows, interval) = self.job.checkpoint_trigger();
        let env = WriterEnv {
            plugin: self.plugin.clone(),
            grants: self.grants.clone(),
            limits: limits(self.job),
            options: self.options.clone(),
            source: self.source.clone(),
            every_rows,
            interval,
            #[cfg(feature = "fault-injection")]
            fault: self.fault,
            progress: self.progress.clone(),
        };
        let tables = self.tables.records()?;
        let setups = (0..self.job.spec.job.parallelism)
            .map(|s| WriterSetup {
                subtask: s,
                ctx: sink_ctx(self.job, &self.incarnation, self.refuse_others, s, self.attempt),
                tables: tables.clone(),
                restored: self.restored.as_ref().and_then(|r| r.subtasks.get(s as usize).cloned()),
            })
            .collect();
        pool.open(Arc::new(env), setups)
    }

    /// Checkpoint `c`, whose round is running: gather every writer's part,
    /// combine, persist, then commit, with the next round already running.
    /// Returns whether the source is exhausted.
    fn checkpoint(&mut self, pool: &mut dyn WriterPool, c: u64) -> Result<bool, EngineError> {
        let waited = Instant::now();
        let reports = self.gather(pool, c)?;
        let gathered = Instant::now();
        let (mut records, mut infos, mut changes, mut refusal) = (Vec::new(), Vec::new(), Vec::new(), None);
        for report in reports {
            records.push(report.record);
            infos.extend(report.info);
            changes.extend(report.changes);
            refusal = refusal.or(report.refusal);
        }
        let combined = match self.combine(c, &infos) {
            Ok(combined) => combined,
            Err(e) => {
                abort_prepare(pool, c);
                return Err(e);
            }
        };
        let combined_at = Instant::now();
        let record = self.persist(pool, c, records, combined)?;
        let persisted = Instant::now();
        crash_point!(self.fault, AfterPersist, c);
        let finished = record.finished();
        // At a barrier the next round waits for the target to change.
        let barrier = !changes.is_empty() || refusal.is_some();
        if !finished && !barrier {
            pool.start_round(c + 1)?;
        }
        if let Err(e) = self.commit_pending(true) {
            if !finished && !barrier && !e.is_injected_crash() {
                // Let the running round end, then release what it prepared.
                if self.gather(pool, c + 1).is_ok() {
                    abort_prepare(pool, c + 1);
                }
            }
            return Err(e);
        }
        tracing::debug!(
            checkpoint = c,
            wait_ms = (gathered - waited).as_millis() as u64,
            combine_ms = (combined_at - gathered).as_millis() as u64,
            persist_ms = (persisted - combined_at).as_millis() as u64,
            commit_ms = persisted.elapsed().as_millis() as u64,
            "checkpoint done"
        );
        if let Some(refused) = refusal {
            return Err(refused.into());
        }
        if barrier {
            let changes = tables::merge_changes(changes)?;
            self.evolve(c, &changes)?;
            crash_point!(self.fault, AfterEvolve, c);
            self.tables.apply(&changes);
            pool.apply(&changes)?;
            pool.start_round(c + 1)?;
        }
        Ok(finished)
    }

    /// Rows of committed checkpoints: those the newest record covers, less
    /// the pending checkpoints' and the dropped ones'.
    fn committed_rows(&self) -> u64 {
        let pending: u64 = self.pending.iter().map(|p| p.rows).sum();
        let dropped: u64 = self.dropped.iter().map(|d| d.rows).sum();
        self.rows_total.saturating_sub(pending).saturating_sub(dropped)
    }

    /// After the last checkpoint of a finished run was committed, its record
    /// says so (nothing pending), so that `sluice state` shows what the run
    /// reported. A crash before this leaves the record as persisted, and the
    /// next run commits it again (already committed).
    fn settle_last_record(&self) -> Result<(), EngineError> {
        let Some(mut record) = self.store.latest()? else { return Ok(()) };
        if record.pending.is_empty() || !self.pending.is_empty() {
            return Ok(());
        }
        record.pending.clear();
        record.last_committed = self.last_committed;
        self.store.persist(&record)?;
        Ok(())
    }

    /// How commits and evolutions are retried (job.commit).
    fn retry_policy(&self) -> Policy {
        let spec = &self.job.spec.job.commit;
        Policy {
            attempts: spec.max_attempts,
            initial: Duration::from_millis(spec.initial_backoff_ms),
            max: Duration::from_millis(spec.max_backoff_ms),
        }
    }

    /// Makes the target take `changes` (the barrier that ended checkpoint
    /// `c`), retrying `retryable` answers like a commit.
    fn evolve(&mut self, c: u64, changes: &[Change]) -> Result<(), EngineError> {
        let described: Vec<String> =
            changes.iter().map(|ch| format!("{} ({:?})", table_label(&ch.table), ch.kind)).collect();
        tracing::info!(checkpoint = c, changes = %described.join(", "), "evolving the target before rows of the new shape");
        let contract = tables::contract_changes(changes)?;
        let retryable =
            |e: &EngineError| matches!(e, EngineError::Plugin(pe) if pe.sink_kind() == Some(SinkErrorKind::Retryable));
        self.retry_policy()
            .run(
                |_| self.evolve_call(c, &contract),
                retryable,
                |e, attempt, wait| {
                    tracing::warn!(checkpoint = c, attempt, wait_ms = wait.as_millis() as u64, error = %e, "evolving the target failed; retrying");
                },
            )
            .map_err(|failed| failed.error)
    }

    #[cfg(not(feature = "fault-injection"))]
    fn evolve_call(&mut self, _c: u64, changes: &[crate::plugin::TableChange]) -> Result<(), EngineError> {
        self.committer.evolve(changes).map_err(EngineError::from)
    }

    /// One `evolve` call, which a test may crash right after its first side
    /// effect (`DuringEvolve`).
    #[cfg(feature = "fault-injection")]
    fn evolve_call(&mut self, c: u64, changes: &[crate::plugin::TableChange]) -> Result<(), EngineError> {
        use crate::fault::{CrashPoint, Fault};
        let arm = Fault::due(self.fault, CrashPoint::DuringEvolve, c, None);
        self.committer.instance_mut().arm_crash_after_side_effect(arm);
        let result = self.committer.evolve(changes);
        self.committer.instance_mut().arm_crash_after_side_effect(false);
        match result {
            Err(e) if e.is_injected_crash() => {
                Err(EngineError::InjectedCrash { point: CrashPoint::DuringEvolve, checkpoint: c })
            }
            other => other.map_err(EngineError::from),
        }
    }

    /// The committer's fan-in of checkpoint `c` (none when no writer has rows).
    fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Option<Vec<u8>>, EngineError> {
        if infos.is_empty() {
            return Ok(None);
        }
        Ok(Some(self.committer.combine(c, infos)?))
    }

    /// Persists the record of checkpoint `c` durably, with `combined` added
    /// to the pending commits. When that fails, checkpoint `c` will never
    /// exist, so what it prepared is released.
    fn persist(
        &mut self,
        pool: &mut dyn WriterPool,
        c: u64,
        subtask_records: Vec<SubtaskRecord>,
        combined: Option<Vec<u8>>,
    ) -> Result<CheckpointRecord, EngineError> {
        let rows: u64 = subtask_records.iter().map(|s| s.rows).sum();
        let mut pending = self.pending.clone();
        if let Some(bytes) = &combined {
            pending.push(PendingCommit {
                checkpoint: c,
                combined: Blob(bytes.clone()),
                rows: rows.saturating_sub(self.rows_total),
            });
        }
        let spec = &self.job.spec;
        let source = self.source.identity(&subtask_records.iter().map(|r| &r.position).collect::<Vec<_>>());
        let record = CheckpointRecord {
            job_id: spec.job.id.clone(),
            sink_id: spec.sink.id.clone(),
            checkpoint: c,
            attempt: self.attempt,
            parallelism: spec.job.parallelism,
            subtasks: subtask_records,
            pending,
            last_committed: self.last_committed,
            dropped: self.dropped.clone(),
            tables: self.tables.records()?,
            source,
            created_at_ms: now_ms(),
        };
        if let Err(e) = self.store.persist(&record) {
            if let Some(bytes) = &combined
                && let Err(ae) = self.committer.abort(c, bytes)
            {
                tracing::warn!(checkpoint = c, error = %ae, "abort of an unpersisted checkpoint failed");
            }
            abort_prepare(pool, c);
            return Err(e.into());
        }
        self.pending = record.pending.clone();
        self.rows_total = rows;
        tracing::debug!(checkpoint = c, rows_total = rows, "checkpoint persisted");
        Ok(record)
    }

    /// Waits for every subtask's report of round `c`. On a failure the other
    /// subtasks' rounds are waited for and released, then the first error
    /// is returned.
    fn gather(&mut self, pool: &mut dyn WriterPool, c: u64) -> Result<Vec<RoundReport>, EngineError> {
        let mut reports = Vec::with_capacity(pool.len());
        let mut first_error: Option<EngineError> = None;
        let mut succeeded = Vec::new();
        for (subtask, result) in pool.gather(c).into_iter().enumerate() {
            match result {
                Ok(report) => {
                    succeeded.push(subtask as u32);
                    reports.push(report);
                }
                Err(e) => {
                    // A crash wins: it must not be turned into a cleanup.
                    if e.is_injected_crash() {
                        return Err(e);
                    }
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            None => Ok(reports),
            Some(e) => {
                pool.abort_prepare(c, &succeeded);
                Err(e)
            }
        }
    }

    /// Commits every pending checkpoint, oldest first. `live`: they are this
    /// run's own checkpoints (not ones recovered from an earlier run).
    fn commit_pending(&mut self, live: bool) -> Result<Vec<(u64, CommitOutcome)>, EngineError> {
        let mut done = Vec::new();
        while let Some(p) = self.pending.first().cloned() {
            let outcome = self.commit_one(&p, live)?;
            self.pending.remove(0);
            self.last_committed = Some(p.checkpoint);
            self.progress.committed(p.checkpoint, self.committed_rows());
            done.push((p.checkpoint, outcome));
            if live {
                crash_point!(self.fault, AfterCommit, p.checkpoint);
            }
        }
        Ok(done)
    }

    /// Commits one checkpoint, retrying `retryable` answers with backoff
    /// (job.commit: the host owns commit retries).
    fn commit_one(&mut self, p: &PendingCommit, live: bool) -> Result<CommitOutcome, EngineError> {
        let policy = self.retry_policy();
        let retryable =
            |e: &EngineError| matches!(e, EngineError::Plugin(pe) if pe.sink_kind() == Some(SinkErrorKind::Retryable));
        let first = self.first;
        let result = policy.run(
            |attempt| match self.commit_call(p, live) {
                // This run's own checkpoint, found committed before this run ever committed it.
                Ok(CommitOutcome::AlreadyCommitted) if live && attempt == 1 && p.checkpoint >= first => {
                    Err(self.key_reused(p.checkpoint))
                }
                other => other,
            },
            retryable,
            |e, attempt, wait| {
                tracing::warn!(checkpoint = p.checkpoint, attempt, wait_ms = wait.as_millis() as u64, error = %e, "commit failed; retrying");
            },
        );
        match result {
            Ok(outcome) => {
                if outcome == CommitOutcome::AlreadyCommitted {
                    tracing::info!(checkpoint = p.checkpoint, "checkpoint was already committed");
                }
                Ok(outcome)
            }
            Err(Failed { error: EngineError::Plugin(last), attempts })
                if last.sink_kind() == Some(SinkErrorKind::Retryable) =>
            {
                Err(EngineError::CommitExhausted { checkpoint: p.checkpoint, attempts, last })
            }
            Err(Failed { error, .. }) => Err(error),
        }
    }

    /// One `commit` call.
    #[cfg(not(feature = "fault-injection"))]
    fn commit_call(&mut self, p: &PendingCommit, _live: bool) -> Result<CommitOutcome, EngineError> {
        self.committer.commit(p.checkpoint, &p.combined.0).map_err(EngineError::from)
    }

    /// One `commit` call, which a test may crash right after its first side
    /// effect (a live checkpoint's `DuringCommit` fault).
    #[cfg(feature = "fault-injection")]
    fn commit_call(&mut self, p: &PendingCommit, live: bool) -> Result<CommitOutcome, EngineError> {
        use crate::fault::{CrashPoint, Fault};
        let arm = live && Fault::due(self.fault, CrashPoint::DuringCommit, p.checkpoint, None);
        self.committer.instance_mut().arm_crash_after_side_effect(arm);
        let result = self.committer.commit(p.checkpoint, &p.combined.0);
        self.committer.instance_mut().arm_crash_after_side_effect(false);
        match result {
            Err(e) if e.is_injected_crash() => {
                Err(EngineError::InjectedCrash { point: CrashPoint::DuringCommit, checkpoint: p.checkpoint })
            }
            other => other.map_err(EngineError::from),
        }
    }

    /// Halts the state directory after a reused idempotence key, saying
    /// whose key it was: a plugin whose keys carry the incarnation found this
    /// very incarnation's checkpoint, so the record of it is missing here (or
    /// a copy of the state directory ran); one whose keys do not may have met
    /// another incarnation's or another job's.
    fn key_reused(&self, checkpoint: u64) -> EngineError {
        let dir = self.job.state_dir.display();
        let delivered = format!(
            "This run's rows of checkpoint {checkpoint} are not visible as its own, so nothing of it counts as \
             delivered, and the state directory {dir} is now halted"
        );
        let why = if self.plugin.incarnation_support().0 {
            let newest = self.restored.as_ref().map_or("none (the run started from the beginning)".to_string(), |r| {
                format!("checkpoint {}", r.checkpoint)
            });
            format!(
                "its keys carry this state directory's incarnation {inc}, so this incarnation committed checkpoint \
                 {checkpoint} before, in a run whose record of it is not here (was it moved away or lost? or did a copy \
                 of this state directory run?): the newest record was {newest}. Resuming from there would deliver the \
                 rows of checkpoint {checkpoint} twice. {delivered}. Restore the record of checkpoint {checkpoint} \
                 (and of any later one) from a backup into {checkpoints}, replacing the one this run wrote, remove \
                 {halt}, and run again; without a backup, start over in a new job.state_dir with --new-incarnation \
                 (the source then lands again beside what is there)",
                inc = self.incarnation.id,
                checkpoints =
                    self.store.record_path(checkpoint).parent().map_or(dir.to_string(), |p| p.display().to_string()),
                halt = self.job.state_dir.join("halted").display(),
            )
        } else {
            format!(
                "the target already holds a checkpoint under the same idempotence key, written by another incarnation \
                 of this job (another state directory) or by another job with the same id (the plugin's keys do not \
                 carry the incarnation). {delivered}. Give the job a job.id of its own (or remove the earlier output), \
                 then start over with a new job.state_dir"
            )
        };
        let error = EngineError::KeyReused {
            job: self.job.spec.job.id.clone(),
            plugin: self.plugin.name.to_string(),
            checkpoint,
            state_dir: self.job.state_dir.clone(),
            why,
        };
        if let Err(e) = self.store.halt(&error.to_string()) {
            tracing::error!(error = %e, "could not mark the state directory as halted");
        }
        error
    }

    fn summary(&self, started: Instant, recovered: Vec<(u64, CommitOutcome)>, next: u64, already: bool) -> RunSummary {
        let catalog = self.grants.catalog.as_ref();
        RunSummary {
            job_id: self.job.spec.job.id.clone(),
            incarnation: self.incarnation.id.clone(),
            new_incarnation: self.new_incarnation,
            attempt: self.attempt,
            resumed_from: self.restored.as_ref().map(|r| r.checkpoint),
            recovered,
            rows_this_run: if already { 0 } else { self.progress.rows() },
            rows_total: self.committed_rows(),
            checkpoints_this_run: next - self.first,
            last_committed: self.last_committed,
            elapsed: started.elapsed(),
            data_elapsed: if already { Duration::ZERO } else { self.progress.elapsed() },
            first_write: self.progress.first_write(),
            peak_memory: peak_memory(),
            writer_memory: self.writer_memory,
            catalog_commits: catalog.map_or(0, |c| c.stats.commit_calls.load(Ordering::Relaxed)),
            catalog_conflicts: catalog.map_or(0, |c| c.stats.conflicts.load(Ordering::Relaxed)),
            already_complete: already,
        }
    }
}

/// Opens and locks the job's state directory, refusing one that is halted.
pub(super) fn open_unhalted(job: &Job) -> Result<CheckpointStore, EngineError> {
    let spec = &job.spec;
    let store = CheckpointStore::open(&job.state_dir, &spec.job.id, spec.job.checkpoint.retain)?;
    match store.halted()? {
        Some(halt) => {
            Err(EngineError::Halted { job: spec.job.id.clone(), state_dir: job.state_dir.clone(), reason: halt.reason })
        }
        None => Ok(store),
    }
}

/// The incarnation this run belongs to, and whether the run starts it.
///
/// - A state directory with an incarnation resumes it (`--new-incarnation`
///   is refused there: it would start over in a directory holding state).
/// - A state directory of an earlier version (records, no incarnation)
///   adopts one now; its pending commits keep the keys they were made with.
/// - A new state directory gets a new id, persisted only once the committer
///   accepted it.
pub(super) fn settle_incarnation(
    job: &Job,
    store: &CheckpointStore,
    restored: Option<&CheckpointRecord>,
    opts: &RunOptions,
) -> Result<(Incarnation, bool), EngineError> {
    let existing = store.incarnation()?;
    if opts.new_incarnation && (existing.is_some() || restored.is_some()) {
        return Err(EngineError::IncarnationNotFresh {
            job: job.spec.job.id.clone(),
            state_dir: job.state_dir.clone(),
            incarnation: existing.map_or_else(|| "(from an earlier version)".to_string(), |i| i.id),
            checkpoint: restored.map_or(String::new(), |r| format!(" (last checkpoint {})", r.checkpoint)),
        });
    }
    match existing {
        Some(incarnation) => Ok((incarnation, false)),
        None if restored.is_some() => {
            // From before incarnations, and so before claims: it keeps landing as it did then.
            let incarnation = Incarnation { beside: true, ..Incarnation::generate()? };
            store.set_incarnation(&incarnation)?;
            tracing::info!(incarnation = %incarnation.id, "the state directory predates incarnations; adopted one");
            Ok((incarnation, false))
        }
        // `--new-incarnation` lands beside the job's other incarnations, so it leaves the target's claim alone.
        None => Ok((Incarnation { beside: opts.new_incarnation, ..Incarnation::generate()? }, true)),
    }
}

/// Says when a plugin cannot keep incarnations apart (it does not declare
/// the host's options), so an operator knows what protects the job.
pub(super) fn warn_about_incarnation_support(
    job: &Job,
    plugin: &Plugin,
    incarnation: &Incarnation,
    refuse_others: bool,
) {
    let (keys, checks) = plugin.incarnation_support();
    if !keys {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin does not take `{}`: the keys it writes cannot tell incarnation {} of job {} from another; \
             the engine still stops the job if a commit of this run finds its key already taken",
            reserved::INCARNATION,
            incarnation.id,
            job.spec.job.id
        );
    }
    if !plugin.takes_claims() && !incarnation.beside {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin does not take `{}`: it cannot claim its target for incarnation {} of job {}, so another \
             fresh state directory of this job run at the same time could land the source a second time",
            reserved::CLAIM,
            incarnation.id,
            job.spec.job.id
        );
    }
    if refuse_others && !checks {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin cannot tell whether its target already holds rows of an earlier incarnation of job {}; \
             this new state directory lands the source as incarnation {}",
            job.spec.job.id,
            incarnation.id
        );
    }
}
