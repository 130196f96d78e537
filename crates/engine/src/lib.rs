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

mod check;
pub mod config;
pub mod kinds;
pub mod metrics;

// The crates the engine drives, under the names its modules use.
pub use sluice_capability::{self as capability, bindings};
pub use sluice_core::{fault, ipc, location, progress};
pub use sluice_plugin as plugin;
pub use sluice_source as source;
pub mod checkpoint;
mod commit;
mod coordinator;
pub mod dead_letter;
pub mod landing;
pub mod maintain;
#[cfg(any(test, feature = "fault-injection"))]
pub mod memory_state;
mod object_state;
mod objects;
#[cfg(any(test, feature = "fault-injection"))]
pub mod objects_memory;
pub mod pool;
mod rejected;
mod setup;
pub mod state;
#[cfg(feature = "fault-injection")]
mod state_faults;
mod subtask;
mod summary;
pub mod tables;
mod writer;

use std::path::PathBuf;

use thiserror::Error;

pub use check::{CheckReport, check};
pub use coordinator::{MIN_RECORDS_FOR_A_SHARE, run, run_on};
pub use setup::grants_and_limits;
pub use subtask::RoundReport;
pub use summary::RunSummary;

use crate::config::JobError;
use crate::plugin::PluginError;
use crate::progress::ProgressMode;
use crate::source::SourceError;
use checkpoint::CheckpointError;

#[cfg(feature = "fault-injection")]
pub use crate::fault::Fault;
pub use crate::fault::{CrashPoint, Faults};

/// How to run a job.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub progress: ProgressMode,
    /// The state directory is new and the run starts a new incarnation of
    /// the job, even when the target holds checkpoints of another one
    /// (`sluice run --new-incarnation`).
    pub new_incarnation: bool,
    /// The faults a test armed (none in a released build).
    pub faults: Faults,
    /// Set to stop the run at its next checkpoint (SIGTERM, SIGINT).
    pub stop: Stop,
    /// The registry the run reports into (a fresh one unless the caller
    /// serves one: `sluice run --metrics-addr`).
    pub metrics: crate::metrics::Metrics,
    /// A test's state directory in memory, used in place of the job's
    /// `job.state_dir` (and behind the same seeded faults): the
    /// coordinator's rounds, recovery and halts run in-process against it.
    #[cfg(feature = "fault-injection")]
    pub memory_state: Option<memory_state::MemoryDir>,
}

/// A request to stop a run cleanly: the running round ends at once, its
/// checkpoint is persisted and committed, and the run ends resumable.
#[derive(Debug, Clone, Default)]
pub struct Stop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Stop {
    pub fn request(&self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn requested(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl RunOptions {
    /// Options of a released run (no faults).
    pub fn new(progress: ProgressMode, new_incarnation: bool) -> Self {
        Self { progress, new_incarnation, ..Self::default() }
    }
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
    #[error(transparent)]
    Grants(#[from] crate::capability::SetupError),
    #[error(transparent)]
    SchemaRefused(#[from] tables::SchemaRefusal),
    #[error(
        "plugin '{plugin}' writes one table, but the source ({described}) delivers named tables; use a plugin that takes several (its `plugin inspect` says `tables: many`)"
    )]
    SingleTablePlugin { plugin: String, described: String },
    #[error(
        "the last checkpoint ({checkpoint}) was taken with job.parallelism = {recorded}, but the job now sets {now}; \
         restore needs the same parallelism (or a new job.state_dir to start over)"
    )]
    ParallelismChanged { checkpoint: u64, recorded: u32, now: u32 },
    #[error(
        "the last checkpoint ({checkpoint}) was taken from another source than the job reads now: {what}. \
         Restore needs the source as it was (a folder of files may only gain files that sort after those read). \
         To land the source as it is now from the start, use a new job.state_dir and run with --new-incarnation \
         (what earlier runs landed stays in the target)"
    )]
    SourceChanged { checkpoint: u64, what: String },
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
    /// A crash a test injected (never without the `fault-injection` feature).
    #[error(transparent)]
    InjectedCrash(#[from] crate::fault::Crash),
    #[error(
        "job {job}: the state directory {state_dir} is halted and is not resumed: {reason}. \
         Start the job over with a new job.state_dir once the cause is dealt with"
    )]
    Halted { job: String, state_dir: PathBuf, reason: String },
    #[error(
        "job {job}: --new-incarnation starts a job over in a fresh state directory, but {state_dir} already holds \
         incarnation {incarnation}{checkpoint}. Resume it without the flag, or set job.state_dir to a new directory"
    )]
    IncarnationNotFresh { job: String, state_dir: PathBuf, incarnation: String, checkpoint: String },
    /// `why` says whose key it was and what to do: see `Coordinator::key_reused`.
    #[error(
        "job {job}: plugin '{plugin}' answered already-committed the first time this run committed its own \
         checkpoint {checkpoint}: {why}"
    )]
    KeyReused { job: String, plugin: String, checkpoint: u64, state_dir: PathBuf, why: String },
    #[error(
        "job {job}: the state directory {state_dir} already landed a dataset (checkpoint {checkpoint}{}); \
         writing it again would land it twice. Use a new job.state_dir for another dataset",
        if *finished > 0 { ", whose pending commit is finished now" } else { "" }
    )]
    AlreadyLanded { job: String, state_dir: PathBuf, checkpoint: u64, finished: usize },
    #[error("job {job}: checkpoint {checkpoint} is not pending (pending: {pending})")]
    NotPending { job: String, checkpoint: u64, pending: String },
    #[error("subtask {0} stopped unexpectedly")]
    SubtaskLost(u32),
    #[error("could not start the job's maintenance thread: {0}")]
    MaintenanceThread(std::io::Error),
    /// `sluice maintain` refused a short orphan retention before it ran:
    /// whether a run of `job` holds its state directory could not be read.
    #[error(
        "--remove-orphans-older-than {age}: cannot tell whether a run of job {job:?} holds its state directory \
         {state_dir} ({source}), so a retention this short is refused (a running round's files are named by no \
         checkpoint yet); use at least {least}, or try again once it can be read"
    )]
    OrphanAgeUnchecked {
        /// The retention asked for, as the flag is shown.
        age: String,
        job: String,
        state_dir: String,
        /// The least retention that is safe beside a run of `job`.
        least: String,
        #[source]
        source: Box<CheckpointError>,
    },
    /// `sluice maintain` refused a short orphan retention before it ran: a
    /// run of `job` (`holder`) holds its state directory.
    #[error(
        "--remove-orphans-older-than {age} is too short while job {job:?} runs ({holder}): the files of its round \
         under way are named by no checkpoint yet, so only their age protects them, and a round of this job may \
         last {least} (3 checkpoint intervals and its commit retries); use at least {least}, or run it while no \
         job writes"
    )]
    OrphanAgeTooShort { age: String, job: String, holder: String, least: String },
    #[error("writer {subtask} was lost: {message}")]
    WriterLost { subtask: u32, message: String },
    /// Writers of a pool were lost, not one named writer.
    #[error("writers were lost: {message}")]
    WritersLost { message: String },
    /// A remote writer failed; the message is the one its process gave.
    #[error("writer {subtask}: {message}")]
    Remote { subtask: u32, message: String },
    /// The pool running the writers failed (not one writer).
    #[error("{message}")]
    Pool { message: String },
    #[error("cannot read {what} from another process: {message}")]
    Wire { what: String, message: String },
    /// Another process speaks another version of the wire documents.
    #[error(
        "cannot read {what} from another process: it is of wire version {peer}, this host speaks {ours}: run the \
         same Sluice version on every node"
    )]
    WireVersion { what: String, peer: u32, ours: u32 },
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("encoding rows as Arrow IPC: {0}")]
    Ipc(#[from] arrow_schema::ArrowError),
    /// `job.max_bad_rows` was passed; nothing of the checkpoint was
    /// committed.
    #[error("{0}")]
    TooManyBadRows(Box<BadRowLimit>),
    /// The sink rejected rows as invalid data, every one found in the
    /// source: with dead letters, the run starts again from its last
    /// checkpoint with them read as dead letters.
    #[error("{}", .0.message)]
    SinkRejected(Box<SinkRejected>),
}

/// A job's dead letters passed `job.max_bad_rows` ([`BadRowLimit::KEY`]):
/// how many, the limit, and where the run stopped.
#[derive(Debug, Clone)]
pub struct BadRowLimit {
    pub job: String,
    /// `job.max_bad_rows`.
    pub limit: config::MaxBadRows,
    /// The table the job's dead letters land in.
    pub dead_letter_table: String,
    pub passed: BadRowsPassed,
}

/// Where a job's dead letters passed `job.max_bad_rows`.
#[derive(Debug, Clone)]
pub enum BadRowsPassed {
    /// Before checkpoint `checkpoint` was committed: `bad` bad rows of
    /// `read` records read over the job, `in_checkpoint` of them in it.
    Checkpoint {
        checkpoint: u64,
        bad: u64,
        read: u64,
        in_checkpoint: u64,
        /// The first bad rows of the checkpoint, each with its position and reason.
        sample: String,
    },
    /// Before a run started again after the sink rejected `rejected` rows
    /// as invalid data past checkpoint `after` (`None`: the job's start),
    /// with `before` dead letters before them.
    Rejected { rejected: u64, before: u64, after: Option<u64>, sample: Vec<String> },
}

impl BadRowLimit {
    /// The job file's key of the limit.
    pub const KEY: &str = "job.max_bad_rows";

    /// The bad rows the limit is held against: over the job, with the new ones.
    pub fn count(&self) -> u64 {
        match &self.passed {
            BadRowsPassed::Checkpoint { bad, .. } => *bad,
            BadRowsPassed::Rejected { rejected, before, .. } => before + rejected,
        }
    }
}

impl std::fmt::Display for BadRowLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (job, key, limit, table) = (&self.job, Self::KEY, self.limit, &self.dead_letter_table);
        match &self.passed {
            BadRowsPassed::Checkpoint { checkpoint: c, bad, read, in_checkpoint, sample } => write!(
                f,
                "job {job}: {bad} bad rows of {read} records read over the job ({in_checkpoint} in checkpoint {c}), \
                 more than {key} allows ({limit}); nothing of checkpoint {c} was committed (earlier checkpoints stay \
                 committed, and their dead letters are in table {table:?}). First bad rows of checkpoint {c}: {sample}"
            ),
            BadRowsPassed::Rejected { rejected, before, after, sample } => {
                let after = after.map_or_else(|| "the start".to_string(), |c| format!("checkpoint {c}"));
                write!(
                    f,
                    "job {job}: the sink rejected {rejected} rows as invalid data after {after}; as dead letters, \
                     with the {before} before them, they would be more than {key} allows ({limit}); nothing after \
                     {after} was committed (earlier checkpoints stay committed, and their dead letters are in table \
                     {table:?}). Rejected: {}",
                    sample.join(", ")
                )
            }
        }
    }
}

/// Rows a sink rejected, by file and record, with its reasons.
#[derive(Debug)]
pub struct SinkRejected {
    /// The sink's message, each row followed by its place in the source.
    pub message: String,
    pub rows: std::collections::BTreeMap<(String, u64), String>,
}

impl EngineError {
    /// Whether this is a crash injected by a test (never without the
    /// `fault-injection` feature).
    pub fn is_injected_crash(&self) -> bool {
        match self {
            EngineError::InjectedCrash(_) => true,
            EngineError::Plugin(p) => p.is_injected_crash(),
            _ => false,
        }
    }
}
