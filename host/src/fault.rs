//! Test-only fault injection. Compiled only with the cargo feature
//! `fault-injection`, which `tests/` and `bench/` enable; the released
//! binary has none of it.
//!
//! - [`Fault`]: a crash at a step of the checkpoint protocol ([`CrashPoint`]).
//!   The engine stops at once, without any cleanup call, as if the process
//!   had died there.
//! - [`SideEffectFault`]: armed for one plugin call, it lets the first host
//!   operation with an effect outside the sandbox (a file written, renamed
//!   or deleted, a catalog commit, a gRPC call) happen and then traps the
//!   call: "the effect was applied, the reply was lost".
//! - [`CommitFault`] and catalog latency: applied by a decorator around the
//!   catalog's commit backend (see `capability::catalog_faults`).

use std::time::Duration;

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
    /// Inside `evolve` at the barrier that ended checkpoint `c`, right after
    /// its first side effect (a table created or altered; the reply is lost).
    DuringEvolve,
    /// After `evolve` at the barrier that ended checkpoint `c` returned,
    /// before the writers apply the changes.
    AfterEvolve,
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
            CrashPoint::DuringEvolve => "during-evolve",
            CrashPoint::AfterEvolve => "after-evolve",
        })
    }
}

/// A crash to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    pub point: CrashPoint,
    pub checkpoint: u64,
    /// Subtask for the subtask-side points.
    pub subtask: u32,
}

impl Fault {
    /// Whether the crash is due at `point` of checkpoint `c` (in `subtask`,
    /// for the subtask-side points).
    pub fn due(fault: Option<Fault>, point: CrashPoint, c: u64, subtask: Option<u32>) -> bool {
        fault.is_some_and(|f| f.point == point && f.checkpoint == c && subtask.is_none_or(|s| s == f.subtask))
    }
}

/// A fault of the nth `commit-table` call of a run (counted from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitFault {
    /// Apply the commit, then answer `unknown-outcome` (the reply is lost).
    LoseReply,
    /// Answer `conflict` without applying (another writer won the race).
    Conflict,
    /// Apply the commit, then crash the engine before the plugin hears of it.
    CrashAfterApply,
}

/// Faults and latency of a run's catalog commits.
#[derive(Debug, Clone, Default)]
pub struct CatalogFaults {
    /// (nth commit-table call, fault)
    pub faults: Vec<(u64, CommitFault)>,
    /// Added before every commit, to stand in for a remote catalog.
    pub latency: Duration,
}

impl CatalogFaults {
    pub fn is_empty(&self) -> bool {
        self.faults.is_empty() && self.latency.is_zero()
    }
}

/// Message of the trap raised by an injected crash.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("injected crash after a side effect of the plugin call")]
pub struct InjectedCrash;

/// Per-instance arming switch of the crash after a side effect.
#[derive(Debug, Default)]
pub struct SideEffectFault {
    armed: bool,
}

impl SideEffectFault {
    pub fn arm(&mut self, armed: bool) {
        self.armed = armed;
    }

    /// Called after every side effect; traps once when armed.
    pub fn after_side_effect(&mut self) -> wasmtime::Result<()> {
        if self.armed {
            self.armed = false;
            return Err(wasmtime::Error::new(InjectedCrash));
        }
        Ok(())
    }
}
