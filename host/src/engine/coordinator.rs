//! The checkpoint coordinator: gathers rounds, persists, then commits.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::checkpoint::{Blob, CheckpointRecord, CheckpointStore, PendingCommit, SubtaskRecord};
use super::subtask::{Command, Reply, RoundReport, SubtaskHandle, SubtaskSetup};
use super::{CrashPoint, EngineError, Fault, RunOptions, backoff};
use crate::capability::Granted;
use crate::capability::catalog::{CatalogFaults, CatalogGrant, CommitFault};
use crate::capability::file_io::{FileGrants, MemoryStore};
use crate::capability::grpc::GrpcGrant;
use crate::ipc;
use crate::job::CatalogKind;
use crate::job::{Job, JobError};
use crate::plugin::bindings::{CommitOutcome, PluginInfo};
use crate::plugin::{CommitterInstance, Limits, PluginHost, SinkCtx, SinkErrorKind};
use crate::progress::Progress;
use crate::source::Source;

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub job_id: String,
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
                "job {} was already complete: {} rows delivered, last committed checkpoint {committed}{}",
                self.job_id,
                self.rows_total,
                if self.recovered.is_empty() {
                    String::new()
                } else {
                    format!(", {} pending commit(s) finished now", self.recovered.len())
                }
            );
        }
        write!(
            f,
            "job {} finished: {} rows in {secs:.1}s ({rate:.0} rows/s over {data_secs:.1}s of data movement), {} checkpoint(s), last committed checkpoint {committed}, {} rows in total{}{}",
            self.job_id,
            self.rows_this_run,
            self.checkpoints_this_run,
            self.rows_total,
            self.resumed_from.map_or(String::new(), |c| format!(", resumed after checkpoint {c}")),
            format_args!(", attempt {}", self.attempt),
        )
    }
}

/// Host-side check of the options against what the plugin declares.
fn check_options(job: &Job, info: &PluginInfo) -> Vec<JobError> {
    let mut errors = Vec::new();
    let options = job.sink_options();
    let known: Vec<&str> = info.options.iter().map(|o| o.name.as_str()).collect();
    for (key, _) in &options {
        if !known.contains(&key.as_str()) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{key}"),
                message: format!("plugin '{}' has no such option (it takes: {})", info.name, known.join(", ")),
            });
        }
    }
    for spec in info.options.iter().filter(|o| o.required && o.default_value.is_none()) {
        if !options.iter().any(|(k, _)| k == &spec.name) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{}", spec.name),
                message: format!("required by plugin '{}': {}", info.name, spec.description),
            });
        }
    }
    errors
}

fn limits(job: &Job) -> Limits {
    Limits { call_timeout: job.spec.sink.sandbox.call_timeout(), memory_mb: job.spec.sink.sandbox.memory_mb }
}

fn grants(job: &Job, faults: &[(u64, CommitFault)]) -> Result<Granted, EngineError> {
    let g = &job.spec.sink.grants;
    let mut locations = g.locations.clone();
    let catalog = match &job.spec.sink.catalog {
        None => None,
        Some(spec) => {
            let warehouse = job.resolve(&spec.warehouse);
            // The tables' files live in the warehouse: the plugin writes them.
            locations.push(warehouse.to_string_lossy().into_owned());
            let faults =
                CatalogFaults { faults: faults.to_vec(), commit_delay: Duration::from_millis(spec.commit_delay_ms) };
            let catalog = match spec.kind {
                CatalogKind::Sql => {
                    let Some(database) = &spec.database else {
                        return Err(EngineError::Catalog("kind = \"sql\" needs `database` (the SQLite file)".into()));
                    };
                    CatalogGrant::open_sql(&spec.name, &job.resolve(database), &warehouse, faults)
                        .map_err(|e| EngineError::Catalog(e.to_string()))?
                }
                CatalogKind::Rest => {
                    if spec.database.is_some() {
                        return Err(EngineError::Catalog(
                            "kind = \"rest\" takes no `database` (that is the SQLite catalog's file)".into(),
                        ));
                    }
                    let Some(uri) = &spec.uri else {
                        return Err(EngineError::Catalog(
                            "kind = \"rest\" needs `uri` (the catalog's base URI)".into(),
                        ));
                    };
                    let token = match &spec.token_env {
                        None => None,
                        Some(var) => Some(std::env::var(var).map_err(|_| {
                            EngineError::Catalog(format!("token_env: the environment variable {var} is not set"))
                        })?),
                    };
                    CatalogGrant::open_rest(&spec.name, uri, &warehouse, token, faults)
                        .map_err(|e| EngineError::Catalog(e.to_string()))?
                }
            };
            Some(Arc::new(catalog))
        }
    };
    let files = FileGrants::new(&job.base_dir, &locations, &g.read_locations, Arc::new(MemoryStore::default()))?;
    let grpc = GrpcGrant::open(&job.spec.sink.grpc, &job.base_dir).map_err(|e| EngineError::Grpc(e.to_string()))?;
    Ok(Granted { files: Arc::new(files), catalog, grpc: Arc::new(grpc) })
}

/// Result of `sluice check`.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// What was checked and found fine.
    pub passed: Vec<String>,
    /// One line per problem, each naming its cause.
    pub problems: Vec<String>,
}

/// Validates a job without moving data: plugin, options, grants, source, and
/// the plugin's own `validate` against the source schema.
pub fn check(job: &Job, host: &PluginHost) -> CheckReport {
    let mut report = CheckReport::default();
    let plugin = match host.load(&job.spec.sink.plugin) {
        Ok(p) => p,
        Err(e) => {
            report.problems.push(e.to_string());
            return report;
        }
    };
    let info = plugin.info().cloned();
    if let Some(info) = &info {
        report.passed.push(format!("plugin {} {} ({})", info.name, info.version, plugin.path.display()));
        let option_errors = check_options(job, info);
        if option_errors.is_empty() {
            report.passed.push(format!("{} sink option(s) known to the plugin", job.sink_options().len()));
        }
        report.problems.extend(option_errors.iter().map(ToString::to_string));
    }
    let grants = match grants(job, &[]) {
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
        let result =
            ipc::encode_schema(&source.schema()).map_err(|e| EngineError::Ipc(e.to_string())).and_then(|schema| {
                let mut inst = plugin.instantiate("check", &grants, limits(job))?;
                inst.validate(&job.sink_options(), &schema).map_err(EngineError::from)
            });
        match result {
            Ok(()) => report.passed.push("the plugin accepts the options and the source schema".to_string()),
            Err(e) => report.problems.push(e.to_string()),
        }
    }
    report
}

struct Coordinator<'a> {
    job: &'a Job,
    store: CheckpointStore,
    committer: CommitterInstance,
    pending: Vec<PendingCommit>,
    last_committed: Option<u64>,
    fault: Option<Fault>,
    progress: Arc<Progress>,
    /// Rows covered by the newest persisted checkpoint.
    rows_total: u64,
}

/// Runs a job to the end of its source, resuming from its last checkpoint.
pub fn run(job: &Job, host: &PluginHost, opts: &RunOptions) -> Result<RunSummary, EngineError> {
    let started = Instant::now();
    let spec = &job.spec;
    let parallelism = spec.job.parallelism;
    let store = CheckpointStore::open(&job.state_dir, &spec.job.id, spec.job.checkpoint.retain)?;
    let attempt = store.next_attempt()?;
    let restored = store.latest()?;
    if let Some(r) = &restored {
        if r.parallelism != parallelism {
            return Err(EngineError::ParallelismChanged {
                checkpoint: r.checkpoint,
                recorded: r.parallelism,
                now: parallelism,
            });
        }
        if r.sink_id != spec.sink.id {
            return Err(EngineError::SinkChanged {
                checkpoint: r.checkpoint,
                recorded: r.sink_id.clone(),
                now: spec.sink.id.clone(),
            });
        }
        tracing::info!(
            job = %spec.job.id,
            checkpoint = r.checkpoint,
            pending = r.pending.len(),
            attempt,
            "resuming from checkpoint record"
        );
    } else {
        tracing::info!(job = %spec.job.id, attempt, state_dir = %job.state_dir.display(), "starting job from the beginning");
    }

    let plugin = host.load(&spec.sink.plugin)?;
    if let Some(info) = plugin.info()
        && let Some(e) = check_options(job, info).into_iter().next()
    {
        return Err(e.into());
    }
    let source = Arc::new(Source::open(&spec.source, parallelism)?);
    let schema_ipc = ipc::encode_schema(&source.schema()).map_err(|e| EngineError::Ipc(e.to_string()))?;
    let grants = grants(job, &opts.catalog_faults)?;
    let limits = limits(job);
    let options = job.sink_options();
    let ctx = |subtask: u32| SinkCtx {
        job_id: spec.job.id.clone(),
        sink_id: spec.sink.id.clone(),
        subtask,
        parallelism,
        attempt,
    };
    let progress = Progress::new(opts.progress);
    let _status = progress.start_status_line();

    let committer =
        CommitterInstance::open(plugin.instantiate("committer", &grants, limits)?, &ctx(0), &options, &schema_ipc)?;
    let mut co = Coordinator {
        job,
        store,
        committer,
        pending: restored.as_ref().map(|r| r.pending.clone()).unwrap_or_default(),
        last_committed: restored.as_ref().and_then(|r| r.last_committed),
        fault: opts.fault,
        progress: progress.clone(),
        rows_total: restored.as_ref().map_or(0, |r| r.total_rows()),
    };

    // Recovery: finish what the last run persisted but may not have committed.
    let recovered = co.commit_pending(false)?;
    for (c, outcome) in &recovered {
        tracing::info!(checkpoint = c, outcome = ?outcome, "re-committed pending checkpoint on restore");
    }
    let restored_rows = restored.as_ref().map_or(0, |r| r.total_rows());
    if let Some(r) = &restored
        && r.finished()
    {
        return Ok(RunSummary {
            job_id: spec.job.id.clone(),
            attempt,
            resumed_from: Some(r.checkpoint),
            recovered,
            rows_this_run: 0,
            rows_total: restored_rows,
            checkpoints_this_run: 0,
            last_committed: co.last_committed,
            elapsed: started.elapsed(),
            data_elapsed: Duration::ZERO,
            catalog_commits: grants.catalog.as_ref().map_or(0, |c| c.stats.commit_calls.load(Ordering::Relaxed)),
            catalog_conflicts: grants.catalog.as_ref().map_or(0, |c| c.stats.conflicts.load(Ordering::Relaxed)),
            already_complete: true,
        });
    }

    let (every_rows, interval) = job.checkpoint_trigger();
    let mut subtasks = Vec::with_capacity(parallelism as usize);
    for s in 0..parallelism {
        subtasks.push(SubtaskHandle::spawn(SubtaskSetup {
            subtask: s,
            plugin: plugin.clone(),
            grants: grants.clone(),
            limits,
            ctx: ctx(s),
            options: options.clone(),
            schema_ipc: schema_ipc.clone(),
            restored: restored.as_ref().and_then(|r| r.subtasks.get(s as usize).cloned()),
            source: source.clone(),
            every_rows,
            interval,
            fault: opts.fault,
            progress: progress.clone(),
        })?);
    }
    let mut open_error = None;
    for handle in &subtasks {
        match handle.recv() {
            Ok(_) => {}
            Err(e) => {
                open_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = open_error {
        return Err(e);
    }

    let first = restored.as_ref().map_or(1, |r| r.checkpoint + 1);
    let mut c = first;
    let mut rows_total;
    start_round(&subtasks, c)?;
    loop {
        let reports = co.gather(&subtasks, c)?;
        let mut records: Vec<SubtaskRecord> = Vec::with_capacity(reports.len());
        let mut infos = Vec::new();
        for report in reports {
            infos.extend(report.info);
            records.push(report.record);
        }
        let combined = if infos.is_empty() {
            None
        } else {
            match co.committer.combine(c, &infos) {
                Ok(bytes) => Some(bytes),
                Err(e) => {
                    abort_prepare(&subtasks, c);
                    return Err(e.into());
                }
            }
        };
        if let Some(bytes) = &combined {
            co.pending.push(PendingCommit { checkpoint: c, combined: Blob(bytes.clone()) });
        }
        let record = CheckpointRecord {
            job_id: spec.job.id.clone(),
            sink_id: spec.sink.id.clone(),
            checkpoint: c,
            attempt,
            parallelism,
            subtasks: records,
            pending: co.pending.clone(),
            last_committed: co.last_committed,
            created_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        };
        if let Err(e) = co.store.persist(&record) {
            // The checkpoint will never exist: release what it prepared.
            if let Some(bytes) = &combined {
                co.pending.pop();
                if let Err(ae) = co.committer.abort(c, bytes) {
                    tracing::warn!(checkpoint = c, error = %ae, "abort of an unpersisted checkpoint failed");
                }
            }
            abort_prepare(&subtasks, c);
            return Err(e.into());
        }
        rows_total = record.total_rows();
        co.rows_total = rows_total;
        tracing::debug!(checkpoint = c, rows_total, "checkpoint persisted");
        co.crash_if(CrashPoint::AfterPersist, c)?;
        let finished = record.finished();
        if !finished {
            // The next round runs while this one commits.
            start_round(&subtasks, c + 1)?;
        }
        if let Err(e) = co.commit_pending(true) {
            if !finished && !e.is_injected_crash() {
                // Let the running round end, then release what it prepared.
                if co.gather(&subtasks, c + 1).is_ok() {
                    abort_prepare(&subtasks, c + 1);
                }
            }
            return Err(e);
        }
        if finished {
            break;
        }
        c += 1;
    }

    for handle in &subtasks {
        handle.send(Command::Close)?;
    }
    for handle in &subtasks {
        handle.recv()?;
    }
    drop(_status);
    Ok(RunSummary {
        job_id: spec.job.id.clone(),
        attempt,
        resumed_from: restored.as_ref().map(|r| r.checkpoint),
        recovered,
        rows_this_run: progress.rows(),
        rows_total,
        checkpoints_this_run: c + 1 - first,
        last_committed: co.last_committed,
        elapsed: started.elapsed(),
        data_elapsed: progress.elapsed(),
        catalog_commits: grants.catalog.as_ref().map_or(0, |c| c.stats.commit_calls.load(Ordering::Relaxed)),
        catalog_conflicts: grants.catalog.as_ref().map_or(0, |c| c.stats.conflicts.load(Ordering::Relaxed)),
        already_complete: false,
    })
}

fn start_round(subtasks: &[SubtaskHandle], c: u64) -> Result<(), EngineError> {
    for handle in subtasks {
        handle.send(Command::Round(c))?;
    }
    Ok(())
}

/// Best effort: every writer releases what `prepare-commit(c)` prepared.
fn abort_prepare(subtasks: &[SubtaskHandle], c: u64) {
    for handle in subtasks {
        if handle.send(Command::AbortPrepare(c)).is_ok() {
            let _ = handle.recv();
        }
    }
}

impl Coordinator<'_> {
    fn crash_if(&self, point: CrashPoint, c: u64) -> Result<(), EngineError> {
        match self.fault {
            Some(f) if f.point == point && f.checkpoint == c => {
                Err(EngineError::InjectedCrash { point, checkpoint: c })
            }
            _ => Ok(()),
        }
    }

    /// Waits for every subtask's report of round `c`. On a failure the other
    /// subtasks' rounds are waited for and released, then the first error
    /// is returned.
    fn gather(&mut self, subtasks: &[SubtaskHandle], c: u64) -> Result<Vec<RoundReport>, EngineError> {
        let mut reports = Vec::with_capacity(subtasks.len());
        let mut first_error: Option<EngineError> = None;
        let mut succeeded = Vec::new();
        for handle in subtasks {
            match handle.recv() {
                Ok(Reply::Round(report)) if report.c == c => {
                    succeeded.push(handle);
                    reports.push(report);
                }
                Ok(_) => {
                    first_error.get_or_insert(EngineError::SubtaskLost(handle.subtask));
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
                for handle in succeeded {
                    if handle.send(Command::AbortPrepare(c)).is_ok() {
                        let _ = handle.recv();
                    }
                }
                Err(e)
            }
        }
    }

    /// Commits every pending checkpoint, oldest first. `live` marks commits of
    /// this run's checkpoints (where test faults apply).
    fn commit_pending(&mut self, live: bool) -> Result<Vec<(u64, CommitOutcome)>, EngineError> {
        let mut done = Vec::new();
        while let Some(p) = self.pending.first().cloned() {
            let outcome = self.commit_one(&p, live)?;
            self.pending.remove(0);
            self.last_committed = Some(p.checkpoint);
            self.progress.committed(p.checkpoint, self.rows_total);
            done.push((p.checkpoint, outcome));
            if live {
                self.crash_if(CrashPoint::AfterCommit, p.checkpoint)?;
            }
        }
        Ok(done)
    }

    fn commit_one(&mut self, p: &PendingCommit, live: bool) -> Result<CommitOutcome, EngineError> {
        let policy = &self.job.spec.job.commit;
        let initial = Duration::from_millis(policy.initial_backoff_ms);
        let max = Duration::from_millis(policy.max_backoff_ms);
        let arm =
            live && self.fault.is_some_and(|f| f.point == CrashPoint::DuringCommit && f.checkpoint == p.checkpoint);
        let mut attempt = 0;
        loop {
            attempt += 1;
            self.committer.instance_mut().arm_crash_after_side_effect(arm);
            let result = self.committer.commit(p.checkpoint, &p.combined.0);
            self.committer.instance_mut().arm_crash_after_side_effect(false);
            match result {
                Ok(outcome) => {
                    if outcome == CommitOutcome::AlreadyCommitted {
                        tracing::info!(checkpoint = p.checkpoint, "checkpoint was already committed");
                    }
                    return Ok(outcome);
                }
                Err(e) if e.is_injected_crash() => {
                    return Err(EngineError::InjectedCrash {
                        point: CrashPoint::DuringCommit,
                        checkpoint: p.checkpoint,
                    });
                }
                Err(e) if e.sink_kind() == Some(SinkErrorKind::Retryable) => {
                    if attempt >= policy.max_attempts {
                        return Err(EngineError::CommitExhausted {
                            checkpoint: p.checkpoint,
                            attempts: attempt,
                            last: e,
                        });
                    }
                    let wait = backoff(attempt, initial, max);
                    tracing::warn!(checkpoint = p.checkpoint, attempt, wait_ms = wait.as_millis() as u64, error = %e, "commit failed; retrying");
                    std::thread::sleep(wait);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}
