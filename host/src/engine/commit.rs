//! The committer's side of the protocol, for a run and for a landing alike:
//! `combine`, `commit` and `evolve` with the host's retries.
//!
//! Invariants:
//! - the host alone retries a `retryable` answer, by `job.commit`'s policy,
//!   so retries never multiply;
//! - an `already-committed` answer to the first commit of a checkpoint the
//!   caller prepared itself ([`Commit::Own`]) proves that its idempotence
//!   key was taken before: it is reported as [`Committed::KeyReused`], never
//!   as delivered, and never retried;
//! - a test may crash a commit or an evolve right after its first side
//!   effect (the reply is lost); the crash wins over every cleanup.

use std::time::Duration;

use sluice_retry::{Failed, Policy};

use super::EngineError;
use super::checkpoint::PendingCommit;
use crate::bindings::CommitOutcome;
use crate::fault::{Crash, CrashPoint, Faults};
use crate::job::Job;
use crate::plugin::{CommitterInstance, PluginError, SinkErrorKind, TableChange};

/// Whose checkpoint a commit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Commit {
    /// Recovered from an earlier run's record: committed again, idempotently.
    Recovered,
    /// Live in this run but prepared by an earlier one.
    Live,
    /// Prepared by this run (or landing): its first commit must not find it
    /// committed.
    Own,
}

/// What a commit came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Committed {
    Done(CommitOutcome),
    /// The checkpoint's idempotence key was taken before this run ever
    /// committed it: the caller halts.
    KeyReused,
}

/// The committer instance, with the retry policy and the faults of a run.
pub(super) struct Committer {
    instance: CommitterInstance,
    policy: Policy,
    faults: Faults,
}

/// Why one commit attempt did not land.
enum Attempt {
    Failed(EngineError),
    KeyReused,
}

fn retryable(e: &EngineError) -> bool {
    matches!(e, EngineError::Plugin(pe) if pe.sink_kind() == Some(SinkErrorKind::Retryable))
}

impl Committer {
    pub(super) fn new(instance: CommitterInstance, job: &Job, faults: Faults) -> Self {
        let spec = &job.spec.job.commit;
        let policy = Policy {
            attempts: spec.max_attempts,
            initial: Duration::from_millis(spec.initial_backoff_ms),
            max: Duration::from_millis(spec.max_backoff_ms),
        };
        Self { instance, policy, faults }
    }

    /// The fan-in of checkpoint `c`'s commit infos.
    pub(super) fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Vec<u8>, EngineError> {
        Ok(self.instance.combine(c, infos)?)
    }

    /// Releases a combined commit that will never be committed (its record
    /// could not be persisted). Best effort.
    pub(super) fn abort(&mut self, c: u64, combined: &[u8]) {
        if let Err(e) = self.instance.abort(c, combined) {
            tracing::warn!(checkpoint = c, error = %e, "abort of an unpersisted checkpoint failed");
        }
    }

    /// Commits `p`, retrying `retryable` answers with backoff.
    pub(super) fn commit(&mut self, p: &PendingCommit, whose: Commit) -> Result<Committed, EngineError> {
        let c = p.checkpoint;
        let arm = whose != Commit::Recovered;
        let policy = self.policy;
        let result = policy.run(
            |attempt| match self.armed(CrashPoint::DuringCommit, c, arm, |i| i.commit(c, &p.combined.0)) {
                Ok(CommitOutcome::AlreadyCommitted) if whose == Commit::Own && attempt == 1 => Err(Attempt::KeyReused),
                other => other.map_err(Attempt::Failed),
            },
            |a| matches!(a, Attempt::Failed(e) if retryable(e)),
            |a, attempt, wait| {
                if let Attempt::Failed(e) = a {
                    tracing::warn!(checkpoint = c, attempt, wait_ms = wait.as_millis() as u64, error = %e, "commit failed; retrying");
                }
            },
        );
        match result {
            Ok(outcome) => {
                if outcome == CommitOutcome::AlreadyCommitted {
                    tracing::info!(checkpoint = c, "checkpoint was already committed");
                }
                Ok(Committed::Done(outcome))
            }
            Err(Failed { error: Attempt::KeyReused, .. }) => Ok(Committed::KeyReused),
            Err(Failed { error: Attempt::Failed(EngineError::Plugin(last)), attempts })
                if last.sink_kind() == Some(SinkErrorKind::Retryable) =>
            {
                Err(EngineError::CommitExhausted { checkpoint: c, attempts, last })
            }
            Err(Failed { error: Attempt::Failed(error), .. }) => Err(error),
        }
    }

    /// Makes the target take `changes` (the barrier that ended checkpoint
    /// `c`), retrying `retryable` answers like a commit.
    pub(super) fn evolve(&mut self, c: u64, changes: &[TableChange]) -> Result<(), EngineError> {
        let policy = self.policy;
        policy
            .run(
                |_| self.armed(CrashPoint::DuringEvolve, c, true, |i| i.evolve(changes)),
                retryable,
                |e, attempt, wait| {
                    tracing::warn!(checkpoint = c, attempt, wait_ms = wait.as_millis() as u64, error = %e, "evolving the target failed; retrying");
                },
            )
            .map_err(|failed| failed.error)
    }

    /// One call, with the crash after its first side effect armed when a
    /// test asked for one at `point` of checkpoint `c` (and `arm`).
    fn armed<T>(
        &mut self,
        point: CrashPoint,
        c: u64,
        arm: bool,
        call: impl FnOnce(&mut CommitterInstance) -> Result<T, PluginError>,
    ) -> Result<T, EngineError> {
        let armed = arm && self.faults.due(point, c, None);
        self.instance.instance_mut().arm_crash_after_side_effect(armed);
        let result = call(&mut self.instance);
        self.instance.instance_mut().arm_crash_after_side_effect(false);
        result.map_err(|e| match e.injected() {
            Some(injected) => Crash::after(injected, point, c).into(),
            None => e.into(),
        })
    }
}
