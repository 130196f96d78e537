//! A landing: a dataset written elsewhere (the write tasks of a Ray Data
//! `Dataset`) committed through a job's sink as the job's one checkpoint.
//! The parts arrive prepared; the landing owns everything after: the
//! record, its persistence, the commit and its retries.
//!
//! Invariants (the coordinator's, for a job of one checkpoint):
//! - a state directory lands one dataset, as checkpoint 1; a landing that
//!   finds a record first commits whatever it left pending (commits are
//!   idempotent), then is refused, so nothing lands twice;
//! - the incarnation is settled as a run settles it, and a new one is
//!   persisted only once the committer has accepted it;
//! - nothing is committed before the record naming it is durable; a caller
//!   hands commit infos and row counts, never a record;
//! - the host alone retries a `retryable` commit (job.commit); an
//!   `already-committed` answer to the first commit of this landing's own
//!   checkpoint means its idempotence key was taken before: the landing
//!   fails, reports nothing delivered, and halts the state directory.

use std::sync::Arc;

use super::checkpoint::{
    Blob, CheckpointRecord, CheckpointStore, Incarnation, PendingCommit, SubtaskRecord, TableRecord, now_ms,
};
use super::commit::{Commit, Committed, Committer};
use super::setup::{load_plugin, open_run_state, settle_incarnation, sink_ctx, warn_about_incarnation_support};
use super::{EngineError, RunOptions};
use crate::bindings::CommitOutcome;
use crate::capability::Granted;
use crate::config::EngineConfig;
use crate::fault::{CrashPoint, Faults};
use crate::plugin::{CommitterInstance, Limits, Plugin, PluginHost, SinkCtx, SourceTable};

/// The one checkpoint of a landing.
pub const CHECKPOINT: u64 = 1;

/// One part of the dataset: what one writer prepared for checkpoint 1.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Part {
    /// What `prepare-commit(1)` returned (`None`: the writer wrote nothing).
    pub info: Option<Vec<u8>>,
    pub rows: u64,
}

/// What a landing did.
#[derive(Debug, Clone, PartialEq)]
pub struct LandingSummary {
    pub job_id: String,
    pub incarnation: String,
    /// The landing started the incarnation (its state directory was new).
    pub new_incarnation: bool,
    pub attempt: u32,
    pub parts: usize,
    pub rows: u64,
    /// The commit's answer; `None` when no part had anything to commit.
    pub outcome: Option<CommitOutcome>,
}

/// A landing in progress: the state directory locked, the incarnation
/// settled, the plugin loaded.
pub struct Landing {
    job: Arc<EngineConfig>,
    store: CheckpointStore,
    plugin: Plugin,
    grants: Granted,
    incarnation: Incarnation,
    new_incarnation: bool,
    /// The new incarnation is persisted (the committer accepted it).
    adopted: bool,
    refuse_others: bool,
    attempt: u32,
    committer: Option<Committer>,
    faults: Faults,
}

impl Landing {
    /// Opens and locks the job's state directory, settles the incarnation
    /// and loads the plugin. A state directory that holds a record already
    /// landed its dataset: what that record left pending is committed now,
    /// then the landing is refused ([`EngineError::AlreadyLanded`]).
    pub fn open(job: Arc<EngineConfig>, host: &PluginHost, opts: &RunOptions) -> Result<Self, EngineError> {
        // The plugin first: one that cannot load leaves no state directory behind.
        let plugin = load_plugin(&job, host)?;
        let store = open_run_state(&job, opts)?;
        let restored = store.latest()?;
        let (incarnation, new_incarnation) = settle_incarnation(&job, &store, restored.as_ref(), opts)?;
        let attempt = store.next_attempt()?;
        let refuse_others = new_incarnation && !opts.new_incarnation;
        warn_about_incarnation_support(&job, &plugin, &incarnation, refuse_others);
        let grants = Granted::open(&job.grants(), &opts.faults)?;
        opts.faults.warn_if_unreached("a landing", &[CrashPoint::AfterPersist, CrashPoint::DuringCommit], CHECKPOINT);
        let mut landing = Self {
            job,
            store,
            plugin,
            grants,
            incarnation,
            new_incarnation,
            adopted: !new_incarnation,
            refuse_others,
            attempt,
            committer: None,
            faults: opts.faults.clone(),
        };
        if let Some(record) = restored {
            landing.finish(record)?;
        }
        tracing::info!(
            job = %landing.job.spec.job.id,
            incarnation = %landing.incarnation.id,
            attempt,
            state_dir = %landing.job.state_dir.display(),
            "landing a dataset"
        );
        Ok(landing)
    }

    /// The sink context of the writers: the caller sets `subtask` (and may
    /// set `attempt`) per writer.
    pub fn writer_ctx(&self) -> SinkCtx {
        sink_ctx(&self.job, &self.incarnation, self.refuse_others, 0, self.attempt)
    }

    /// Opens the committer for a dataset of `schema` (an Arrow IPC stream
    /// without batches), once: a sink that creates its table does so now,
    /// before any writer opens. A new incarnation is persisted here, once
    /// the committer has accepted it.
    pub fn open_committer(&mut self, schema: &[u8]) -> Result<(), EngineError> {
        if self.committer.is_some() {
            return Ok(());
        }
        // A landing is one checkpoint: nothing of its incarnation was
        // committed before it, so its committer starts with no state.
        let committer = self.committer_for(schema, self.refuse_others, None)?;
        self.committer = Some(committer);
        if !self.adopted {
            self.store.set_incarnation(&self.incarnation)?;
            self.adopted = true;
            tracing::info!(job = %self.job.spec.job.id, incarnation = %self.incarnation.id, "started a new incarnation of the job");
        }
        Ok(())
    }

    /// Lands the parts as checkpoint 1: combines their commit infos,
    /// persists the record, then commits it.
    pub fn land(&mut self, parts: &[Part], schema: &[u8]) -> Result<LandingSummary, EngineError> {
        self.open_committer(schema)?;
        let infos: Vec<Vec<u8>> = parts.iter().filter_map(|p| p.info.clone()).collect();
        let rows: u64 = parts.iter().map(|p| p.rows).sum();
        let mut summary = LandingSummary {
            job_id: self.job.spec.job.id.clone(),
            incarnation: self.incarnation.id.clone(),
            new_incarnation: self.new_incarnation,
            attempt: self.attempt,
            parts: parts.len(),
            rows,
            outcome: None,
        };
        let combined = if infos.is_empty() {
            // The end of an empty input may still call for a commit (an
            // overwrite of an empty dataset: `committer-state.finish`).
            match self.committer_mut()?.finish(CHECKPOINT)? {
                Some(combined) => combined,
                None => {
                    tracing::info!(job = %summary.job_id, "the dataset had no rows; nothing to commit");
                    return Ok(summary);
                }
            }
        } else {
            self.committer_mut()?.combine(CHECKPOINT, &infos)?
        };
        let state = self.committer_mut()?.snapshot_state(CHECKPOINT)?;
        let mut record = self.record(parts, schema, combined.clone(), state);
        if let Err(e) = self.store.persist(&record) {
            // Justified only by a definite "not written": a record whose
            // outcome is unknown may be durable, and the next landing then
            // commits it, so its files must stay.
            if !e.outcome_unknown() {
                self.committer_mut()?.abort(CHECKPOINT, &combined);
            }
            return Err(e.into());
        }
        tracing::debug!(checkpoint = CHECKPOINT, rows, "checkpoint persisted");
        self.faults.check(CrashPoint::AfterPersist, CHECKPOINT, None)?;
        let pending = record.pending.clone();
        for p in &pending {
            summary.outcome = Some(self.commit(p, Commit::Own)?);
        }
        self.note_committed(&mut record);
        Ok(summary)
    }

    /// Commits what an earlier landing's record left pending, notes it,
    /// and refuses to land again.
    fn finish(&mut self, mut record: CheckpointRecord) -> Result<(), EngineError> {
        let pending = record.pending.clone();
        if !pending.is_empty() {
            let schema = record.tables.first().map(|t| t.schema.0.clone()).unwrap_or_default();
            let state = record.committer_state.clone().map(|b| b.0);
            self.committer = Some(self.committer_for(&schema, false, state.as_deref())?);
            for p in &pending {
                let outcome = self.commit(p, Commit::Recovered)?;
                tracing::info!(checkpoint = p.checkpoint, outcome = ?outcome, "committed the pending checkpoint of an earlier landing");
            }
            self.note_committed(&mut record);
        }
        Err(EngineError::AlreadyLanded {
            job: self.job.spec.job.id.clone(),
            state_dir: self.job.state_dir.clone(),
            checkpoint: record.checkpoint,
            finished: pending.len(),
        })
    }

    fn committer_for(
        &self,
        schema: &[u8],
        refuse_others: bool,
        state: Option<&[u8]>,
    ) -> Result<Committer, EngineError> {
        let ctx = sink_ctx(&self.job, &self.incarnation, refuse_others, 0, self.attempt);
        let options = super::setup::plugin_options(&self.plugin, &self.job, &ctx);
        let instance = self.plugin.instantiate("committer", &self.grants, Limits::of(&self.job.spec.sink.sandbox))?;
        let tables = [SourceTable { name: String::new(), schema: schema.to_vec() }];
        let instance = CommitterInstance::open(instance, &ctx, &options, &tables)?;
        let mut committer = Committer::new(instance, &self.job, self.faults.clone());
        committer.restore_state(state)?;
        Ok(committer)
    }

    fn committer_mut(&mut self) -> Result<&mut Committer, EngineError> {
        self.committer.as_mut().ok_or_else(|| EngineError::Pool { message: "the committer is not open".to_string() })
    }

    /// The record of checkpoint 1: one finished subtask per part.
    fn record(&self, parts: &[Part], schema: &[u8], combined: Vec<u8>, state: Option<Vec<u8>>) -> CheckpointRecord {
        let spec = &self.job.spec;
        let rows = parts.iter().map(|p| p.rows).sum();
        CheckpointRecord {
            job_id: spec.job.id.clone(),
            sink_id: spec.sink.id.clone(),
            checkpoint: CHECKPOINT,
            attempt: self.attempt,
            parallelism: parts.len() as u32,
            subtasks: parts
                .iter()
                .map(|p| SubtaskRecord {
                    position: serde_json::Value::Null,
                    writer_state: Blob::default(),
                    rows: p.rows,
                    finished: true,
                    seen: Default::default(),
                    bad_rows: 0,
                })
                .collect(),
            pending: vec![PendingCommit {
                checkpoint: CHECKPOINT,
                combined: Blob(combined),
                rows,
                tables: Default::default(),
            }],
            last_committed: None,
            dropped: Vec::new(),
            tables: vec![TableRecord { name: String::new(), schema: Blob(schema.to_vec()) }],
            // A dataset written elsewhere: no source of the job's to resume.
            source: None,
            dead_letters: None,
            committer_state: state.map(Blob),
            created_at_ms: now_ms(),
        }
    }

    /// Persists `record` with its pending commits done, and the committer's
    /// state that holds them. Best effort: if it fails, the next landing
    /// commits them again (idempotently).
    fn note_committed(&mut self, record: &mut CheckpointRecord) {
        record.last_committed = record.pending.last().map(|p| p.checkpoint).or(record.last_committed);
        record.pending.clear();
        record.created_at_ms = now_ms();
        let c = record.checkpoint;
        match self.committer.as_mut().map(|committer| committer.snapshot_state(c)) {
            Some(Ok(Some(state))) => record.committer_state = Some(Blob(state)),
            Some(Ok(None)) | None => {}
            // The commit is done; a landing's state directory lands nothing
            // more, so the record keeps the state from before it.
            Some(Err(e)) => tracing::warn!(error = %e, "could not take the committer's state after the commit"),
        }
        if let Err(e) = self.store.persist(record) {
            tracing::warn!(error = %e, "could not note the commit in the state directory; the next landing commits it again");
        }
    }

    /// Commits one checkpoint, with the host's retries (job.commit).
    fn commit(&mut self, p: &PendingCommit, whose: Commit) -> Result<CommitOutcome, EngineError> {
        // A landing that lost its hold on the state directory commits
        // nothing more: asked right before each attempt.
        let store = &self.store;
        let committer = self
            .committer
            .as_mut()
            .ok_or_else(|| EngineError::Pool { message: "the committer is not open".to_string() })?;
        match committer.commit(p, whose, &|| store.check_held()) {
            Ok(Committed::Done(outcome)) => Ok(outcome),
            // Found committed by a run that took the state directory over:
            // the takeover, not a reused key.
            Ok(Committed::KeyReused) => {
                self.store.check_held()?;
                Err(self.key_reused(p.checkpoint))
            }
            Err(e) => {
                self.store.check_held()?;
                Err(e)
            }
        }
    }

    /// Halts the state directory after a reused idempotence key.
    fn key_reused(&self, checkpoint: u64) -> EngineError {
        let error = EngineError::KeyReused {
            job: self.job.spec.job.id.clone(),
            plugin: self.plugin.name.to_string(),
            checkpoint,
            state_dir: self.job.state_dir.clone(),
            why: format!(
                "the target already holds checkpoint {checkpoint} under this landing's idempotence key, though this \
                 state directory had no record of it (was its record moved away or lost, or did a copy of this state \
                 directory land the dataset?). Nothing of this write counts as delivered, and the state directory \
                 is now halted; land the dataset again in a new job.state_dir only if it is not visible yet"
            ),
        };
        if let Err(e) = self.store.halt(&error.to_string()) {
            tracing::error!(error = %e, "could not mark the state directory as halted");
        }
        error
    }
}
