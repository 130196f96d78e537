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
//!   effect (the reply is lost); the crash wins over every cleanup;
//! - every retry is counted by reason (`sluice_commit_retries_total`): a
//!   conflict or an unknown outcome when the catalog answered one during
//!   the attempt (or, without a catalog, when the plugin's message says
//!   so), any other `retryable` answer apart.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_retry::{Failed, Policy};

use super::EngineError;
use super::checkpoint::{CheckpointError, PendingCommit};
use crate::bindings::CommitOutcome;
use crate::capability::catalog::CatalogGrant;
use crate::config::EngineConfig;
use crate::fault::{Crash, CrashPoint, Faults};
use crate::kinds::{ErrorKind, Kind};
use crate::metrics::{Metrics, RetryReason};
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
    metrics: Metrics,
    /// The catalog the plugin commits through, if any: its answers tell a
    /// retry's reason.
    catalog: Option<Arc<CatalogGrant>>,
}

/// The catalog's conflict and unknown-outcome answers so far.
fn catalog_answers(catalog: Option<&Arc<CatalogGrant>>) -> (u64, u64) {
    catalog.map_or((0, 0), |c| {
        (c.stats.conflicts.load(Ordering::Relaxed), c.stats.unknown_outcomes.load(Ordering::Relaxed))
    })
}

/// Why an attempt that failed with `e` is retried: what the catalog
/// answered during it (`before` → `after`), else what the message says.
fn retry_reason(e: &EngineError, before: (u64, u64), after: (u64, u64)) -> RetryReason {
    if after.1 > before.1 {
        return RetryReason::UnknownOutcome;
    }
    if after.0 > before.0 {
        return RetryReason::Conflict;
    }
    let text = e.to_string().to_ascii_lowercase();
    if text.contains("unknown outcome") || text.contains("unknown-outcome") || text.contains("outcome is unknown") {
        RetryReason::UnknownOutcome
    } else if text.contains("conflict") {
        RetryReason::Conflict
    } else {
        RetryReason::Retryable
    }
}

/// Why one commit attempt did not land.
enum Attempt {
    Failed(EngineError),
    KeyReused,
}

/// Whether another attempt may follow: only the plugin's own `retryable`
/// answer is of that kind (see `crate::kinds`).
fn retryable(e: &EngineError) -> bool {
    e.kind() == ErrorKind::Retryable
}

impl Committer {
    pub(super) fn new(instance: CommitterInstance, job: &EngineConfig, faults: Faults) -> Self {
        let spec = &job.spec.job.commit;
        let policy = Policy {
            attempts: spec.max_attempts,
            initial: Duration::from_millis(spec.initial_backoff_ms),
            max: Duration::from_millis(spec.max_backoff_ms),
        };
        Self { instance, policy, faults, metrics: Metrics::default(), catalog: None }
    }

    /// Reports retries into `metrics`, telling their reasons by `catalog`'s answers.
    pub(super) fn reporting(mut self, metrics: Metrics, catalog: Option<Arc<CatalogGrant>>) -> Self {
        self.metrics = metrics;
        self.catalog = catalog;
        self
    }

    /// The fan-in of checkpoint `c`'s commit infos.
    pub(super) fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Vec<u8>, EngineError> {
        Ok(self.instance.combine(c, infos)?)
    }

    /// Hands the committer its state from the newest record (0.2.3's
    /// `committer-state`; nothing for a committer that keeps none).
    pub(super) fn restore_state(&mut self, state: Option<&[u8]>) -> Result<(), EngineError> {
        Ok(self.instance.restore_state(state)?)
    }

    /// The committer's state for the record of checkpoint `c`; `None` when
    /// it keeps none (an empty state is none: the contract's stateless
    /// default, which records need not carry).
    pub(super) fn snapshot_state(&mut self, c: u64) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(self.instance.snapshot_state(c)?.filter(|state| !state.is_empty()))
    }

    /// The combined commit that the end of a bounded input calls for, when
    /// its last round `c` prepared nothing (see `committer-state.finish`).
    pub(super) fn finish(&mut self, c: u64) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(self.instance.finish(c)?)
    }

    /// Releases a combined commit that will never be committed (its record
    /// could not be persisted). Best effort.
    pub(super) fn abort(&mut self, c: u64, combined: &[u8]) {
        if let Err(e) = self.instance.abort(c, combined) {
            tracing::warn!(checkpoint = c, error = %e, "abort of an unpersisted checkpoint failed");
        }
    }

    /// Commits `p`, retrying `retryable` answers with backoff. `held` is
    /// asked right before every attempt: once the run no longer holds its
    /// state directory (another run took it over), no commit call is made.
    pub(super) fn commit(
        &mut self,
        p: &PendingCommit,
        whose: Commit,
        held: &dyn Fn() -> Result<(), CheckpointError>,
    ) -> Result<Committed, EngineError> {
        let c = p.checkpoint;
        let arm = whose != Commit::Recovered;
        let policy = self.policy;
        let (metrics, catalog) = (self.metrics.clone(), self.catalog.clone());
        let seen = Cell::new(catalog_answers(catalog.as_ref()));
        let result = policy.run(
            |attempt| {
                seen.set(catalog_answers(catalog.as_ref()));
                held().map_err(|e| Attempt::Failed(e.into()))?;
                match self.armed(CrashPoint::DuringCommit, c, arm, |i| i.commit(c, &p.combined.0)) {
                    Ok(CommitOutcome::AlreadyCommitted) if whose == Commit::Own && attempt == 1 => {
                        Err(Attempt::KeyReused)
                    }
                    other => other.map_err(Attempt::Failed),
                }
            },
            |a| matches!(a, Attempt::Failed(e) if retryable(e)),
            |a, attempt, wait| {
                if let Attempt::Failed(e) = a {
                    let reason = retry_reason(e, seen.get(), catalog_answers(catalog.as_ref()));
                    metrics.commit_retry(reason, &e.to_string());
                    tracing::warn!(checkpoint = c, attempt, wait_ms = wait.as_millis() as u64, reason = reason.label(), error = %e, "commit failed; retrying");
                }
            },
        );
        if let Err(Failed { error: Attempt::Failed(e), .. }) = &result {
            self.metrics.commit_failed(&e.to_string());
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_reason_comes_from_the_catalog_else_from_the_message() {
        let e = |m: &str| EngineError::Pool { message: m.to_string() };
        let plain = e("the stream broke");
        assert_eq!(retry_reason(&plain, (0, 0), (1, 0)), RetryReason::Conflict);
        assert_eq!(retry_reason(&plain, (1, 0), (1, 1)), RetryReason::UnknownOutcome);
        assert_eq!(retry_reason(&plain, (1, 1), (1, 1)), RetryReason::Retryable);
        assert_eq!(retry_reason(&e("commit conflict on table t"), (0, 0), (0, 0)), RetryReason::Conflict);
        assert_eq!(retry_reason(&e("unknown-outcome: reply lost"), (0, 0), (0, 0)), RetryReason::UnknownOutcome);
    }
}
