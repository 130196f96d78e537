//! The engine: runs a job through the checkpoint protocol.
//!
//! For checkpoint `c`:
//! 1. every subtask writes its rows, then `prepare-commit(c)` and
//!    `snapshot-state(c)`;
//! 2. the committer `combine`s the commit infos (skipped when no writer has any);
//! 3. the record `{c, positions, states, pending commits}` is persisted
//!    atomically with a checksum;
//! 4. only then the pending commits are committed, oldest first, retrying
//!    `retryable` answers with backoff; the next round already runs meanwhile.
//!
//! On start the newest record is restored: its pending commits are committed
//! again first (commits are idempotent), then the writers reopen with their
//! states and the sources resume from their positions.
//!
//! Invariants: nothing is committed before the record naming it is durable;
//! a failure at any point leaves the job resumable with nothing lost and
//! nothing committed twice.

pub mod checkpoint;
mod coordinator;
mod subtask;

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

pub use coordinator::{CheckReport, RunSummary, check, run};

use crate::capability::catalog::CommitFault;
use crate::capability::file_io::GrantError;
use crate::job::JobError;
use crate::plugin::PluginError;
use crate::progress::ProgressMode;
use crate::source::SourceError;
use checkpoint::CheckpointError;

/// Where a test may make the engine "crash" (stop at once, no cleanup), in
/// protocol order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CrashPoint {
    /// In subtask `s`, right after the first batch of checkpoint `c` was written.
    AfterWrite,
    /// In subtask `s`, right after `prepare-commit(c)` returned.
    AfterPrepareCommit,
    /// In subtask `s`, right after `snapshot-state(c)` returned.
    AfterSnapshotState,
    /// After the record of `c` is durable, before any commit of it.
    AfterPersist,
    /// Inside `commit(c)`, right after its first side effect (the reply is lost).
    DuringCommit,
    /// After `commit(c)` returned, before any later record notes it.
    AfterCommit,
}

impl std::fmt::Display for CrashPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CrashPoint::AfterWrite => "after-write",
            CrashPoint::AfterPrepareCommit => "after-prepare-commit",
            CrashPoint::AfterSnapshotState => "after-snapshot-state",
            CrashPoint::AfterPersist => "after-persist",
            CrashPoint::DuringCommit => "during-commit",
            CrashPoint::AfterCommit => "after-commit",
        })
    }
}

/// A crash to inject (tests only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub point: CrashPoint,
    pub checkpoint: u64,
    /// Subtask for the subtask-side points.
    pub subtask: u32,
}

/// How to run a job.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub progress: ProgressMode,
    pub fault: Option<Fault>,
    /// Faults of the catalog's `commit-table` calls (tests only).
    pub catalog_faults: Vec<(u64, CommitFault)>,
}

#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error(transparent)]
    Plugin(#[from] PluginError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("job file: key `sink.catalog`: {0}")]
    Catalog(String),
    #[error("job file: {0}")]
    Grpc(String),
    #[error("job file: key `sink.grants`: {0}")]
    Grant(#[from] GrantError),
    #[error(
        "the last checkpoint ({checkpoint}) was taken with job.parallelism = {recorded}, but the job now sets {now}; \
         restore needs the same parallelism (or a new job.state_dir to start over)"
    )]
    ParallelismChanged { checkpoint: u64, recorded: u32, now: u32 },
    #[error(
        "the last checkpoint ({checkpoint}) belongs to sink {recorded:?}, but the job now names sink {now:?}; \
         use a new job.state_dir to start over"
    )]
    SinkChanged { checkpoint: u64, recorded: String, now: String },
    #[error(
        "commit of checkpoint {checkpoint} still failed after {attempts} attempts: {last}; \
         the checkpoint stays pending and is committed again on the next run"
    )]
    CommitExhausted { checkpoint: u64, attempts: u32, last: PluginError },
    #[error("injected crash at {point} of checkpoint {checkpoint}")]
    InjectedCrash { point: CrashPoint, checkpoint: u64 },
    #[error("subtask {0} stopped unexpectedly")]
    SubtaskLost(u32),
    #[error("cannot start a thread: {0}")]
    Thread(String),
    #[error("encoding rows as Arrow IPC: {0}")]
    Ipc(String),
    #[error("the job's state directory {0} cannot be used: {1}")]
    StateDir(PathBuf, String),
}

impl EngineError {
    pub fn is_injected_crash(&self) -> bool {
        match self {
            EngineError::InjectedCrash { .. } => true,
            EngineError::Plugin(p) => p.is_injected_crash(),
            _ => false,
        }
    }
}

/// Exponential backoff with full jitter: a random wait in `[0, cap]`, where
/// `cap` doubles per attempt up to `max`.
pub(crate) fn backoff(attempt: u32, initial: Duration, max: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let cap = initial.saturating_mul(1u32 << attempt.min(16)).min(max);
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    let fraction = (random % 10_000) as f64 / 10_000.0;
    cap.mul_f64(fraction)
}
