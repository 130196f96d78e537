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
//!   target already has the change;
//! - `[sink.maintenance]` runs beside the checkpoints in an instance and on
//!   a thread of its own (`maintain::Background`), never between a
//!   checkpoint and its commit; the run waits for a pass under way when it
//!   ends;
//! - the run's metrics are updated here (and by the committer this drives)
//!   only: rows and bytes when their checkpoint is committed, so that they
//!   count what landed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::checkpoint::{
    Blob, CheckpointRecord, CheckpointStore, DroppedCommit, Incarnation, PendingCommit, SubtaskRecord, now_ms,
};
use super::commit::{Commit, Committed, Committer};
use super::dead_letter;
use super::maintain::{self, Background};
use super::pool::{LocalPool, WriterPool};
use super::setup::{
    check_restored, check_tables, load_plugin, open_run_state, settle_incarnation, sink_ctx,
    warn_about_incarnation_support,
};
use super::subtask::RoundReport;
use super::summary::RunSummary;
use super::tables::{self, Change, TableSet};
use super::writer::{WriterEnv, WriterSetup};
use super::{EngineError, RunOptions, Stop};
use crate::bindings::CommitOutcome;
use crate::capability::Granted;
use crate::config::{EngineConfig, MaxBadRows};
use crate::fault::{CrashPoint, Faults};
use crate::metrics::{Metrics, Tally};
use crate::plugin::{CommitterInstance, Limits, Plugin, PluginHost};
use crate::progress::{Progress, peak_memory};
use crate::source::{Rejected, Source};

/// `"orders"`, or `the source's table` for the unnamed one.
fn table_label(table: &str) -> String {
    if table.is_empty() { "the source's table".to_string() } else { format!("{table:?}") }
}

/// Where the run stands in the job's checkpoints.
struct Ledger {
    /// The first checkpoint this run prepares.
    first: u64,
    pending: Vec<PendingCommit>,
    dropped: Vec<DroppedCommit>,
    last_committed: Option<u64>,
    /// Rows covered by the newest persisted checkpoint.
    rows_total: u64,
}

impl Ledger {
    /// As the newest record left it (a run from the beginning: nothing).
    fn of(restored: Option<&CheckpointRecord>) -> Self {
        Self {
            first: restored.map_or(1, |r| r.checkpoint + 1),
            pending: restored.map(|r| r.pending.clone()).unwrap_or_default(),
            dropped: restored.map(|r| r.dropped.clone()).unwrap_or_default(),
            last_committed: restored.and_then(|r| r.last_committed),
            rows_total: restored.map_or(0, CheckpointRecord::total_rows),
        }
    }

    /// Rows of committed checkpoints: those the newest record covers, less
    /// the pending checkpoints' and the dropped ones'.
    fn committed_rows(&self) -> u64 {
        let pending: u64 = self.pending.iter().map(|p| p.rows).sum();
        let dropped: u64 = self.dropped.iter().map(|d| d.rows).sum();
        self.rows_total.saturating_sub(pending).saturating_sub(dropped)
    }
}

/// Who the run is: the incarnation it belongs to and its attempt.
struct Identity {
    incarnation: Incarnation,
    /// This run starts the incarnation (its state directory was new).
    new_incarnation: bool,
    /// Refuse another incarnation's checkpoints (a fresh state directory's first run).
    refuse_others: bool,
    attempt: u32,
}

/// Everything a run holds between its checkpoints.
struct Coordinator<'a> {
    job: &'a EngineConfig,
    store: CheckpointStore,
    plugin: Plugin,
    grants: Granted,
    committer: Committer,
    source: Arc<Source>,
    /// The options every instance opens with (the job's and the host's own).
    options: Vec<(String, String)>,
    /// The tables the writers know, with their current schemas.
    tables: TableSet,
    restored: Option<CheckpointRecord>,
    who: Identity,
    at: Ledger,
    progress: Arc<Progress>,
    /// The largest linear memory of a writer instance, once they closed.
    writer_memory: Option<u64>,
    /// The most host memory held for one writer instance, once they closed.
    writer_host_memory: Option<u64>,
    faults: Faults,
    stop: Stop,
    /// The run ended on a stop request, after this checkpoint, with the
    /// source's positions then.
    stopped: Option<(u64, Vec<serde_json::Value>)>,
    metrics: Metrics,
    /// This run's checkpoints persisted but not committed yet: when their
    /// barrier was (what they land is in their pending commit).
    inflight: BTreeMap<u64, Inflight>,
}

/// A checkpoint of this run on its way to the target.
struct Inflight {
    /// The writers' cut (the barrier), as near as the coordinator can tell.
    cut: Instant,
}

/// Records a job reads before `job.max_bad_rows` as a fraction is judged
/// (unless its source ends first).
pub const MIN_RECORDS_FOR_A_SHARE: u64 = 1000;

/// Runs a job to the end of its source, resuming from its last checkpoint,
/// with its writers on threads of this process.
///
/// With dead letters, rows the sink rejects as invalid data that are all
/// records of the file source make the run start again from its last
/// checkpoint (as after a crash: nothing of the failed round was
/// persisted), with those records read as dead letters. A record is
/// rejected this way at most once per run, so this ends.
pub fn run(job: &EngineConfig, host: &PluginHost, opts: &RunOptions) -> Result<RunSummary, EngineError> {
    let mut rejected: std::collections::BTreeMap<(String, u64), String> = Default::default();
    let mut opts = opts.clone();
    // The records the last attempt's sink rejected that no attempt had before.
    let mut fresh: Vec<(String, u64)> = Vec::new();
    loop {
        let excluded: Rejected = Arc::new(rejected.clone());
        let ran = run_attempt(job, host, &opts, &mut LocalPool::default(), &excluded, &fresh);
        // The first attempt settled the incarnation; the next ones resume in it.
        opts.new_incarnation = false;
        match ran {
            Err(EngineError::SinkRejected(r)) if job.dead_letters.is_some() => {
                let before = rejected.len();
                let count = r.rows.len();
                fresh = r.rows.keys().filter(|k| !rejected.contains_key(*k)).cloned().collect();
                rejected.extend(r.rows.clone());
                if rejected.len() == before {
                    // The sink rejected again what is already read as dead letters: no progress.
                    return Err(EngineError::SinkRejected(r));
                }
                tracing::warn!(
                    rows = count,
                    "the sink rejected rows as invalid data; going on from the last checkpoint with them as dead letters: {}",
                    r.message
                );
            }
            other => return other,
        }
    }
}

/// Like [`run`], with the writers in `pool` (for example Ray actors on
/// other machines). The coordinator, the committer and the checkpoint store
/// stay in this process. A pool that loses a writer fails the run like a
/// crash: nothing is lost, and a new run (with a new pool) resumes from the
/// last persisted checkpoint.
pub fn run_on(
    job: &EngineConfig,
    host: &PluginHost,
    opts: &RunOptions,
    pool: &mut dyn WriterPool,
) -> Result<RunSummary, EngineError> {
    run_attempt(job, host, opts, pool, &Rejected::default(), &[])
}

/// One run, with `rejected` records read as dead letters.
fn run_attempt(
    job: &EngineConfig,
    host: &PluginHost,
    opts: &RunOptions,
    pool: &mut dyn WriterPool,
    rejected: &Rejected,
    fresh: &[(String, u64)],
) -> Result<RunSummary, EngineError> {
    let started = Instant::now();
    let memory_limit = job.spec.sink.sandbox.memory_mb.saturating_mul(1024 * 1024);
    opts.metrics.start_run(&job.spec.job.id, job.max_commit_age, memory_limit);
    let progress = Progress::new(opts.progress);
    let _status = progress.start_status_line();
    let mut co = Coordinator::setup(job, host, opts, progress, rejected)?;
    let recovered = co.commit_pending(false)?;
    for (c, outcome) in &recovered {
        tracing::info!(checkpoint = c, outcome = ?outcome, "re-committed pending checkpoint on restore");
    }
    co.check_rejected(fresh)?;
    // A finished job is complete, but a stream has no end: a Kafka job that
    // read to its end offsets reads on from there.
    if !co.source.streaming() && co.restored.as_ref().is_some_and(CheckpointRecord::finished) {
        co.settle_last_record()?;
        return Ok(co.summary(started, recovered, co.at.first, true));
    }
    // `[sink.maintenance]`: passes beside the checkpoints, until the run ends.
    let ctx = sink_ctx(job, &co.who.incarnation, false, 0, co.who.attempt);
    let _maintenance = Background::start(job, &co.plugin, &co.grants, ctx, co.metrics.clone())?;
    co.open_writers(pool)?;
    co.progress.data_started();
    let mut c = co.at.first;
    pool.start_round(c)?;
    while !co.checkpoint(pool, c)? {
        c += 1;
    }
    co.writer_memory = Some(pool.close()?);
    co.writer_host_memory = pool.host_memory_peak();
    co.settle_last_record()?;
    Ok(co.summary(started, recovered, c + 1, false))
}

/// Best effort: every writer releases what `prepare-commit(c)` prepared.
fn abort_prepare(pool: &mut dyn WriterPool, c: u64) {
    let all: Vec<u32> = (0..pool.len() as u32).collect();
    pool.abort_prepare(c, &all);
}

/// The newest record's checkpoint and pending commits, or the start.
fn log_start(job: &EngineConfig, who: &Identity, restored: Option<&CheckpointRecord>) {
    let (job_id, incarnation, attempt) = (&job.spec.job.id, &who.incarnation.id, who.attempt);
    match restored {
        Some(r) => tracing::info!(
            job = %job_id,
            incarnation = %incarnation,
            checkpoint = r.checkpoint,
            pending = r.pending.len(),
            attempt,
            "resuming from checkpoint record"
        ),
        None => tracing::info!(
            job = %job_id,
            incarnation = %incarnation,
            attempt,
            state_dir = %job.state_dir.display(),
            "starting job from the beginning"
        ),
    }
}

impl<'a> Coordinator<'a> {
    /// Loads the plugin and opens the source, then opens the state
    /// directory, checks the newest record against the job (parallelism,
    /// source identity, sink), settles the incarnation and opens the
    /// committer. Nothing is written to the target before the committer has
    /// accepted the incarnation.
    fn setup(
        job: &'a EngineConfig,
        host: &PluginHost,
        opts: &RunOptions,
        progress: Arc<Progress>,
        rejected: &Rejected,
    ) -> Result<Self, EngineError> {
        // The plugin and the source first: a job that cannot start leaves
        // the state directory as it was (not created, no attempt counted).
        let plugin = load_plugin(job, host)?;
        if job.maintenance.is_some() {
            maintain::probe(job, &plugin)?;
        }
        let source = Arc::new(Source::of_config_rejecting(&job.source_config(), rejected)?);
        let store = open_run_state(job, opts)?;
        let restored = store.latest()?;
        if let Some(r) = &restored {
            check_restored(job, &source, r)?;
        }
        let who = Self::identify(job, &store, restored.as_ref(), opts)?;
        log_start(job, &who, restored.as_ref());
        warn_about_incarnation_support(job, &plugin, &who.incarnation, who.refuse_others);
        // The tables as the last checkpoint left them, else as the source starts.
        let known = source.tables()?;
        if let Some(dl) = &job.dead_letters
            && let Some((t, _)) = known.iter().find(|(t, _)| job.lands_with_dead_letters(t))
        {
            return Err(EngineError::Job(job.invalid(
                "job.dead_letter.table",
                format!(
                    "{:?} lands in the same table as the source's table {t:?}; give dead letters a table of their own",
                    dl.table
                ),
            )));
        }
        // A run that turns dead letters on later meets their table as a new
        // one, at a barrier, like any table the source starts to deliver.
        let tables = match restored.as_ref().filter(|r| !r.tables.is_empty()) {
            Some(r) => TableSet::from_records(&r.tables)?,
            None => TableSet::new(
                known.into_iter().chain(job.dead_letters.iter().map(|dl| (dl.table.clone(), dead_letter::schema()))),
            ),
        };
        check_tables(&plugin, &source, &tables)?;
        let grants = Granted::open(&job.grants(), &opts.faults)?;
        let ctx = sink_ctx(job, &who.incarnation, who.refuse_others, 0, who.attempt);
        let options = super::setup::plugin_options(&plugin, job, &ctx);
        let instance = plugin.instantiate("committer", &grants, Limits::of(&job.spec.sink.sandbox))?;
        let committer = CommitterInstance::open(instance, &ctx, &options, &tables.source_tables()?)?;
        let mut committer =
            Committer::new(committer, job, opts.faults.clone()).reporting(opts.metrics.clone(), grants.catalog.clone());
        // Before the pending checkpoints are committed again: their commits
        // fold themselves into this state.
        committer.restore_state(restored.as_ref().and_then(|r| r.committer_state.as_ref()).map(|b| b.0.as_slice()))?;
        if who.new_incarnation {
            // The committer found no other incarnation in the target (or was told to accept one).
            store.set_incarnation(&who.incarnation)?;
            tracing::info!(job = %job.spec.job.id, incarnation = %who.incarnation.id, "started a new incarnation of the job");
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
            at: Ledger::of(restored.as_ref()),
            restored,
            who,
            progress,
            writer_memory: None,
            writer_host_memory: None,
            faults: opts.faults.clone(),
            stop: opts.stop.clone(),
            stopped: None,
            metrics: opts.metrics.clone(),
            inflight: BTreeMap::new(),
        })
    }

    /// Settles the incarnation and counts the attempt.
    fn identify(
        job: &EngineConfig,
        store: &CheckpointStore,
        restored: Option<&CheckpointRecord>,
        opts: &RunOptions,
    ) -> Result<Identity, EngineError> {
        let (incarnation, new_incarnation) = settle_incarnation(job, store, restored, opts)?;
        let attempt = store.next_attempt()?;
        let refuse_others = new_incarnation && !opts.new_incarnation;
        Ok(Identity { incarnation, new_incarnation, refuse_others, attempt })
    }

    /// Opens one writer (source reader and plugin writer) per subtask,
    /// restored from the last checkpoint, and waits until every one is open.
    fn open_writers(&self, pool: &mut dyn WriterPool) -> Result<(), EngineError> {
        let mut env = WriterEnv::for_job(
            self.job,
            self.plugin.clone(),
            self.grants.clone(),
            self.options.clone(),
            self.source.clone(),
            self.faults.clone(),
            self.progress.clone(),
        );
        env.stop = self.stop.clone();
        let tables = self.tables.records()?;
        let who = &self.who;
        let setups = (0..self.job.spec.job.parallelism)
            .map(|s| WriterSetup {
                subtask: s,
                ctx: sink_ctx(self.job, &who.incarnation, who.refuse_others, s, who.attempt),
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
        let round = Round::of(self.gather(pool, c)?);
        if let Err(e) = self.check_bad_rows(c, &round) {
            // Justified: no record of checkpoint `c` was written (the check
            // comes before the persist), so nothing names what it prepared.
            abort_prepare(pool, c);
            return Err(e);
        }
        let gathered = Instant::now();
        let cut = gathered.checked_sub(round.prepare).unwrap_or(gathered);
        self.report_writers(&round);
        let ends = round.records.iter().all(|r| r.finished);
        let combined = match self.combine(c, &round.infos, ends) {
            Ok(combined) => combined,
            Err(e) => {
                // Justified: the combine failed before any record of
                // checkpoint `c` was written.
                abort_prepare(pool, c);
                return Err(e);
            }
        };
        let combined_at = Instant::now();
        let record = self.persist(pool, c, round.records, combined, &round.tables)?;
        let persisted = Instant::now();
        if record.pending.iter().any(|p| p.checkpoint == c) {
            self.inflight.insert(c, Inflight { cut });
        } else if record.pending.is_empty() {
            // Nothing to commit, and nothing behind it: the job is caught up.
            self.metrics.caught_up(c, cut.elapsed());
        }
        self.faults.check(CrashPoint::AfterPersist, c, None)?;
        let finished = record.finished();
        // Asked to stop: this checkpoint is the run's last; no round follows.
        let stopping = !finished && self.stop.requested();
        // At a barrier the next round waits for the target to change.
        let barrier = !round.changes.is_empty() || round.refusal.is_some();
        self.progress.set_source_note(self.source.status());
        self.commit_overlapped(pool, c, !finished && !barrier && !stopping)?;
        let positions: Vec<serde_json::Value> = record.subtasks.iter().map(|s| s.position.clone()).collect();
        if self.at.pending.is_empty() {
            self.source.acknowledge(&positions.iter().collect::<Vec<_>>());
        }
        tracing::debug!(
            checkpoint = c,
            wait_ms = (gathered - waited).as_millis() as u64,
            combine_ms = (combined_at - gathered).as_millis() as u64,
            persist_ms = (persisted - combined_at).as_millis() as u64,
            commit_ms = persisted.elapsed().as_millis() as u64,
            "checkpoint done"
        );
        if let Some(refused) = round.refusal {
            return Err(refused.into());
        }
        if stopping {
            // A barrier's change waits for the next run, which meets it again.
            self.stopped = Some((c, positions));
            return Ok(true);
        }
        if barrier {
            self.cross_barrier(pool, c, round.changes)?;
        }
        Ok(finished)
    }

    /// Stops a run started again after the sink rejected rows, before it
    /// writes anything, when those rows (`fresh`: records past the last
    /// checkpoint, so none of them is counted in it yet) would take the
    /// job's dead letters past a `job.max_bad_rows` count: rather than
    /// reading on until the checkpoint that holds them.
    fn check_rejected(&self, fresh: &[(String, u64)]) -> Result<(), EngineError> {
        let Some(dl) = &self.job.dead_letters else { return Ok(()) };
        let Some(max @ MaxBadRows::Count(n)) = dl.max else { return Ok(()) };
        let before = self.restored.as_ref().map_or(0, CheckpointRecord::bad_rows);
        let more = fresh.len() as u64;
        if more == 0 || before + more <= n {
            return Ok(());
        }
        let sample = fresh.iter().take(3).map(|(file, record)| format!("{file} record {}", record + 1)).collect();
        Err(EngineError::TooManyBadRows(Box::new(crate::BadRowLimit {
            job: self.job.spec.job.id.clone(),
            limit: max,
            dead_letter_table: dl.table.clone(),
            passed: crate::BadRowsPassed::Rejected {
                rejected: more,
                before,
                after: self.restored.as_ref().map(|r| r.checkpoint),
                sample,
            },
        })))
    }

    /// Stops the job before checkpoint `c` when its dead letters pass
    /// `job.max_bad_rows`: a count of them over the job, or their share of
    /// the records read over the job. A share is judged only once the job
    /// has read [`MIN_RECORDS_FOR_A_SHARE`] records, or at the source's
    /// end: one bad record in a short checkpoint (the last, or one cut short
    /// by a barrier) is no share of anything, and a share of the job does
    /// not depend on where the checkpoints happened to fall.
    fn check_bad_rows(&self, c: u64, round: &Round) -> Result<(), EngineError> {
        let Some(dl) = &self.job.dead_letters else { return Ok(()) };
        let Some(max) = dl.max else { return Ok(()) };
        let bad: u64 = round.tables.values().map(|t| t.bad).sum();
        let dropped: u64 = self.at.dropped.iter().map(|d| d.bad).sum();
        let total = round.records.iter().map(|r| r.bad_rows).sum::<u64>().saturating_sub(dropped);
        // Records read over the job: the good ones delivered and the bad.
        let read: u64 = round.records.iter().map(|r| r.rows + r.bad_rows).sum();
        let finished = round.records.iter().all(|r| r.finished);
        let over = match max {
            // Only a checkpoint that adds dead letters passes a count.
            MaxBadRows::Count(n) => bad > 0 && total > n,
            MaxBadRows::Fraction(f) => (read >= MIN_RECORDS_FOR_A_SHARE || finished) && total as f64 > f * read as f64,
        };
        if !over {
            return Ok(());
        }
        let sample =
            if round.bad_sample.is_empty() { "none".to_string() } else { dead_letter::sample(&round.bad_sample) };
        Err(EngineError::TooManyBadRows(Box::new(crate::BadRowLimit {
            job: self.job.spec.job.id.clone(),
            limit: max,
            dead_letter_table: dl.table.clone(),
            passed: crate::BadRowsPassed::Checkpoint { checkpoint: c, bad: total, read, in_checkpoint: bad, sample },
        })))
    }

    /// The writers' memory and the source's lag, as round reports and the
    /// source tell them.
    fn report_writers(&self, round: &Round) {
        for (subtask, memory) in round.memory.iter().enumerate() {
            self.metrics.writer_memory(subtask as u32, *memory);
        }
        for (topic, partition, lag) in self.source.lag() {
            self.metrics.source_lag(&topic, partition, lag);
        }
    }

    /// Commits what is pending, with round `c + 1` running meanwhile when
    /// `overlap` (the source goes on, and no barrier stops it).
    fn commit_overlapped(&mut self, pool: &mut dyn WriterPool, c: u64, overlap: bool) -> Result<(), EngineError> {
        if overlap {
            pool.start_round(c + 1)?;
        }
        if let Err(e) = self.commit_pending(true) {
            if overlap && !e.is_injected_crash() {
                // Let the running round end, then release what it prepared.
                // Justified: round `c + 1` is gathered but never persisted
                // (the persist comes after this commit), so no record names it.
                if self.gather(pool, c + 1).is_ok() {
                    abort_prepare(pool, c + 1);
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// The barrier that ended checkpoint `c`, once it is committed: the
    /// committer evolves the target, the writers apply the changes, and
    /// round `c + 1` starts.
    fn cross_barrier(&mut self, pool: &mut dyn WriterPool, c: u64, changes: Vec<Change>) -> Result<(), EngineError> {
        let changes = tables::merge_changes(changes)?;
        self.evolve(c, &changes)?;
        self.faults.check(CrashPoint::AfterEvolve, c, None)?;
        self.tables.apply(&changes);
        pool.apply(&changes)?;
        pool.start_round(c + 1)
    }

    /// After the last checkpoint of a finished run was committed, its record
    /// says so (nothing pending), so that `sluice state` shows what the run
    /// reported. A crash before this leaves the record as persisted, and the
    /// next run commits it again (already committed).
    fn settle_last_record(&mut self) -> Result<(), EngineError> {
        let Some(mut record) = self.store.latest()? else { return Ok(()) };
        if record.pending.is_empty() || !self.at.pending.is_empty() {
            return Ok(());
        }
        record.pending.clear();
        record.last_committed = self.at.last_committed;
        // The committer's state now holds the commits the record had
        // pending; a resume must not find it without them. When it cannot
        // be taken, the record stays as persisted: the next run commits its
        // pending checkpoints again (already committed), which folds them
        // into the state it restores, so nothing is lost by leaving it.
        match self.committer.snapshot_state(record.checkpoint) {
            Ok(Some(state)) => record.committer_state = Some(Blob(state)),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(checkpoint = record.checkpoint, error = %e, "could not take the committer's state after the last commit; the record keeps its pending checkpoints, which the next run commits again");
                return Ok(());
            }
        }
        self.store.persist(&record)?;
        Ok(())
    }

    /// Makes the target take `changes` (the barrier that ended checkpoint
    /// `c`), retrying `retryable` answers like a commit.
    fn evolve(&mut self, c: u64, changes: &[Change]) -> Result<(), EngineError> {
        let described: Vec<String> =
            changes.iter().map(|ch| format!("{} ({:?})", table_label(&ch.table), ch.kind)).collect();
        tracing::info!(checkpoint = c, changes = %described.join(", "), "evolving the target before rows of the new shape");
        let contract = tables::contract_changes(changes)?;
        self.committer.evolve(c, &contract)
    }

    /// The committer's fan-in of checkpoint `c`. When no writer has rows it
    /// is none, unless `c` `ends` a bounded input and the committer asks
    /// for a commit at the end (`committer-state.finish`: an overwrite of
    /// an input that was entirely empty).
    fn combine(&mut self, c: u64, infos: &[Vec<u8>], ends: bool) -> Result<Option<Vec<u8>>, EngineError> {
        if infos.is_empty() {
            if ends && !self.source.streaming() {
                return self.committer.finish(c);
            }
            return Ok(None);
        }
        Ok(Some(self.committer.combine(c, infos)?))
    }

    /// Persists the record of checkpoint `c` durably, with `combined` added
    /// to the pending commits. When the store answers that the record was
    /// not written (a definite "not done"), checkpoint `c` will never exist,
    /// so what it prepared is released. When it cannot tell (a lost reply,
    /// a timeout: the record may be durable, or become so), nothing is
    /// released: the run stops, and the next run decides from what the
    /// state directory holds (it re-commits the record if it is there; the
    /// files are orphans for orphan cleanup if it is not).
    fn persist(
        &mut self,
        pool: &mut dyn WriterPool,
        c: u64,
        subtask_records: Vec<SubtaskRecord>,
        combined: Option<Vec<u8>>,
        tables: &BTreeMap<String, Tally>,
    ) -> Result<CheckpointRecord, EngineError> {
        let rows: u64 = subtask_records.iter().map(|s| s.rows).sum();
        let state = match self.committer.snapshot_state(c) {
            Ok(state) => state,
            Err(e) => {
                // Justified: no record of checkpoint `c` was written (the
                // state goes into it), so nothing names what it prepared.
                if let Some(bytes) = &combined {
                    self.committer.abort(c, bytes);
                }
                abort_prepare(pool, c);
                return Err(e);
            }
        };
        let record = self.record(c, subtask_records, combined.as_deref(), rows, tables, state)?;
        tracing::debug!(checkpoint = c, "persisting the checkpoint's record");
        if let Err(e) = self.store.persist(&record) {
            if e.outcome_unknown() {
                tracing::error!(checkpoint = c, error = %e, "whether the checkpoint's record is durable is unknown; its files are kept, and the next run decides");
                return Err(e.into());
            }
            // Justified: the store answered that the record was not written
            // and cannot be later (refused before it was sent), so no
            // record names what checkpoint `c` prepared.
            if let Some(bytes) = &combined {
                self.committer.abort(c, bytes);
            }
            abort_prepare(pool, c);
            return Err(e.into());
        }
        self.at.pending = record.pending.clone();
        self.at.rows_total = rows;
        tracing::debug!(checkpoint = c, rows_total = rows, "checkpoint persisted");
        Ok(record)
    }

    /// The record of checkpoint `c`: the writers' parts, the pending
    /// commits with `combined` added, the tables and the source's identity.
    fn record(
        &self,
        c: u64,
        subtasks: Vec<SubtaskRecord>,
        combined: Option<&[u8]>,
        rows: u64,
        tables: &BTreeMap<String, Tally>,
        committer_state: Option<Vec<u8>>,
    ) -> Result<CheckpointRecord, EngineError> {
        let mut pending = self.at.pending.clone();
        if let Some(bytes) = combined {
            let rows = rows.saturating_sub(self.at.rows_total);
            pending.push(PendingCommit { checkpoint: c, combined: Blob(bytes.to_vec()), rows, tables: tables.clone() });
        }
        let spec = &self.job.spec;
        let source = self.source.identity(&subtasks.iter().map(|r| &r.position).collect::<Vec<_>>());
        Ok(CheckpointRecord {
            job_id: spec.job.id.clone(),
            sink_id: spec.sink.id.clone(),
            checkpoint: c,
            attempt: self.who.attempt,
            parallelism: spec.job.parallelism,
            subtasks,
            pending,
            last_committed: self.at.last_committed,
            dropped: self.at.dropped.clone(),
            tables: self.tables.records()?,
            source,
            dead_letters: self.job.dead_letters.as_ref().map(|dl| dl.table.clone()),
            committer_state: committer_state.map(Blob),
            created_at_ms: now_ms(),
        })
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
                // Justified: a round that did not gather whole is never
                // persisted, so no record names what its subtasks prepared.
                pool.abort_prepare(c, &succeeded);
                Err(e)
            }
        }
    }

    /// Commits every pending checkpoint, oldest first. `live`: they are this
    /// run's own checkpoints (not ones recovered from an earlier run).
    fn commit_pending(&mut self, live: bool) -> Result<Vec<(u64, CommitOutcome)>, EngineError> {
        let mut done = Vec::new();
        while let Some(p) = self.at.pending.first().cloned() {
            let whose = match (live, p.checkpoint >= self.at.first) {
                (false, _) => Commit::Recovered,
                (true, false) => Commit::Live,
                (true, true) => Commit::Own,
            };
            // A run that lost its hold on the state directory commits
            // nothing more: asked right before each attempt.
            let committing = Instant::now();
            let store = &self.store;
            let committed = self.committer.commit(&p, whose, &|| store.check_held());
            self.metrics.commit_duration(&self.job.spec.sink.id, committing.elapsed());
            // One line per commit, for `scale-bench` (commit cost against the table's age).
            tracing::debug!(
                checkpoint = p.checkpoint,
                commit_us = committing.elapsed().as_micros() as u64,
                "commit done"
            );
            let outcome = match committed {
                Ok(Committed::Done(outcome)) => outcome,
                // A fenced holder (paused past its lease, then woken) may find
                // its checkpoint committed by the run that took over: that is
                // the takeover, not a reused key, and halts nothing.
                Ok(Committed::KeyReused) => {
                    self.store.check_held()?;
                    return Err(self.key_reused(p.checkpoint));
                }
                Err(e) => {
                    self.store.check_held()?;
                    return Err(e);
                }
            };
            let landed = self.inflight.remove(&p.checkpoint);
            // A recovered checkpoint's tallies come from its record too.
            self.metrics.committed(&self.job.spec.job.id, p.checkpoint, &p.tables);
            if let Some(l) = landed {
                self.metrics.checkpoint_duration(l.cut.elapsed());
            }
            self.at.pending.remove(0);
            self.at.last_committed = Some(p.checkpoint);
            self.progress.committed(p.checkpoint, self.at.committed_rows());
            done.push((p.checkpoint, outcome));
            if live {
                self.faults.check(CrashPoint::AfterCommit, p.checkpoint, None)?;
            }
        }
        Ok(done)
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
                inc = self.who.incarnation.id,
                checkpoints = self.store.records_dir().display(),
                halt = self.store.halt_path().display(),
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
            incarnation: self.who.incarnation.id.clone(),
            new_incarnation: self.who.new_incarnation,
            attempt: self.who.attempt,
            resumed_from: self.restored.as_ref().map(|r| r.checkpoint),
            recovered,
            rows_this_run: if already { 0 } else { self.progress.rows() },
            rows_total: self.at.committed_rows(),
            checkpoints_this_run: next - self.at.first,
            last_committed: self.at.last_committed,
            elapsed: started.elapsed(),
            data_elapsed: if already { Duration::ZERO } else { self.progress.elapsed() },
            first_write: self.progress.first_write(),
            peak_memory: peak_memory(),
            writer_memory: self.writer_memory,
            writer_host_memory: self.writer_host_memory,
            catalog_commits: catalog.map_or(0, |c| c.stats.commit_calls.load(Ordering::Relaxed)),
            catalog_conflicts: catalog.map_or(0, |c| c.stats.conflicts.load(Ordering::Relaxed)),
            already_complete: already,
            stopped: self.stopped.as_ref().map(|(c, positions)| {
                let at = self.source.describe_positions(&positions.iter().collect::<Vec<_>>());
                (*c, at)
            }),
            source_note: self.source.status(),
            dead_letters: self.job.dead_letters.as_ref().map(|dl| {
                let bad = self.store.latest().ok().flatten().map_or(0, |r| r.bad_rows());
                (dl.table.clone(), bad)
            }),
        }
    }
}

/// What every writer reported for one round, gathered.
struct Round {
    records: Vec<SubtaskRecord>,
    infos: Vec<Vec<u8>>,
    changes: Vec<Change>,
    refusal: Option<tables::SchemaRefusal>,
    /// Rows and bytes per table, over every writer.
    tables: BTreeMap<String, Tally>,
    /// Each writer's linear memory, in subtask order.
    memory: Vec<u64>,
    /// The longest a writer took from its cut to its report.
    prepare: Duration,
    /// The first dead letters of the round.
    bad_sample: Vec<(String, crate::source::BadRow)>,
}

impl Round {
    fn of(reports: Vec<RoundReport>) -> Self {
        let mut round = Round {
            records: Vec::new(),
            infos: Vec::new(),
            changes: Vec::new(),
            refusal: None,
            tables: BTreeMap::new(),
            memory: Vec::new(),
            prepare: Duration::ZERO,
            bad_sample: Vec::new(),
        };
        for report in reports {
            for (table, tally) in report.tables {
                let sum = round.tables.entry(table).or_default();
                sum.rows += tally.rows;
                sum.bytes += tally.bytes;
                sum.bad += tally.bad;
            }
            round.bad_sample.extend(report.bad_sample);
            round.memory.push(report.memory);
            round.prepare = round.prepare.max(report.prepare);
            round.records.push(report.record);
            round.infos.extend(report.info);
            round.changes.extend(report.changes);
            round.refusal = round.refusal.or(report.refusal);
        }
        round
    }
}
