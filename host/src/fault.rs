//! Test-only fault injection, armed by the cargo feature `fault-injection`,
//! which `tests/`, `conformance/` and `bench/` enable.
//!
//! - [`CrashPoint`]: a step of the checkpoint protocol where a test may make
//!   the engine stop at once, without any cleanup call, as if the process
//!   had died there ([`Faults::check`], [`Crash`]).
//! - The crash after a side effect ([`SideEffectFault`]): armed for one
//!   plugin call, it lets the first host operation with an effect outside
//!   the sandbox (a file written, renamed or deleted, a catalog commit, a
//!   gRPC call) happen and then traps the call ([`Injected`]): "the effect
//!   was applied, the reply was lost".
//! - [`CommitFault`] and catalog latency: applied by a decorator around the
//!   catalog's commit backend (see `capability::catalog_faults`).
//!
//! Invariant: without the feature every type here is empty, so each fault
//! site is written once and costs nothing in a released build. [`Faults`] is
//! zero-sized and its checks are constant `false`; [`Crash`] and [`Injected`]
//! are uninhabited, so the code that handles them is proven unreachable and
//! compiled out; no crash point's name is in the binary.

#[cfg(feature = "fault-injection")]
pub use armed::{CatalogFaults, CommitFault, Fault};

/// Where a test may make the engine "crash" (stop at once, no cleanup), in
/// protocol order.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "fault-injection", derive(Debug))]
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

/// The faults a test armed for a run; without the feature, none.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    /// A crash to inject.
    #[cfg(feature = "fault-injection")]
    pub crash: Option<Fault>,
    /// Faults and latency of the catalog's `commit-table` calls.
    #[cfg(feature = "fault-injection")]
    pub catalog: CatalogFaults,
}

impl Faults {
    /// Whether the crash is due at `point` of checkpoint `c` (in `subtask`,
    /// for the subtask-side points).
    #[inline]
    pub fn due(&self, point: CrashPoint, c: u64, subtask: Option<u32>) -> bool {
        #[cfg(feature = "fault-injection")]
        return self
            .crash
            .is_some_and(|f| f.point == point && f.checkpoint == c && subtask.is_none_or(|s| s == f.subtask));
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = (point, c, subtask);
            false
        }
    }

    /// The crash a test build is asked for by the environment:
    /// `SLUICE_TEST_CRASH=<point>[:<checkpoint>[:<subtask>]]` (checkpoint 1,
    /// subtask 0 by default), for drivers that reach the engine through
    /// another language (the Ray suite). None in a released build.
    pub fn from_env() -> Self {
        #[cfg(feature = "fault-injection")]
        if let Ok(asked) = std::env::var("SLUICE_TEST_CRASH") {
            let crash = armed::parse_crash(&asked);
            if crash.is_none() {
                tracing::warn!(crash = %asked, "unknown SLUICE_TEST_CRASH; no crash injected");
            }
            return Self { crash, ..Self::default() };
        }
        Self::default()
    }

    /// Warns when the armed crash is at none of the points `reached` of
    /// checkpoint `c`, the only ones `by` (a landing) checks: such a crash
    /// never happens, and a test asking for it must hear so. Nothing without
    /// the feature.
    pub fn warn_if_unreached(&self, by: &str, reached: &[CrashPoint], c: u64) {
        #[cfg(feature = "fault-injection")]
        if let Some(f) = self.crash
            && !(f.checkpoint == c && reached.contains(&f.point))
        {
            tracing::warn!(crash = %f.point, checkpoint = f.checkpoint, "{by} never reaches this crash point; no crash injected");
        }
        let _ = (by, reached, c);
    }

    /// Stops the run here ([`Crash`]) when a test asked for a crash at
    /// `point` of checkpoint `c`.
    #[inline]
    pub fn check(&self, point: CrashPoint, c: u64, subtask: Option<u32>) -> Result<(), Crash> {
        #[cfg(feature = "fault-injection")]
        if self.due(point, c, subtask) {
            return Err(Crash { point, checkpoint: c });
        }
        let _ = (point, c, subtask);
        Ok(())
    }
}

/// An injected crash of the engine: the run stops where it is.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("injected crash at {point} of checkpoint {checkpoint}")]
pub struct Crash {
    pub point: CrashPoint,
    pub checkpoint: u64,
}

/// An injected crash of the engine (none without the feature).
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {}

impl Crash {
    /// The crash at `point` of checkpoint `c`, met as the trap `injected`
    /// of a plugin call.
    pub fn after(injected: Injected, point: CrashPoint, c: u64) -> Self {
        #[cfg(feature = "fault-injection")]
        {
            let Injected = injected;
            Crash { point, checkpoint: c }
        }
        #[cfg(not(feature = "fault-injection"))]
        {
            let _ = (point, c);
            match injected {}
        }
    }
}

/// The trap raised inside a plugin call by the crash after a side effect.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("injected crash after a side effect of the plugin call")]
pub struct Injected;

/// The trap of the crash after a side effect (none without the feature).
#[cfg(not(feature = "fault-injection"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {}

#[cfg(not(feature = "fault-injection"))]
mod uninhabited {
    use super::{Crash, Injected};

    impl std::fmt::Display for Crash {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match *self {}
        }
    }
    impl std::error::Error for Crash {}

    impl std::fmt::Display for Injected {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match *self {}
        }
    }
    impl std::error::Error for Injected {}
}

/// Per-instance arming switch of the crash after a side effect.
#[derive(Debug, Default)]
pub struct SideEffectFault {
    #[cfg(feature = "fault-injection")]
    armed: bool,
}

impl SideEffectFault {
    #[inline]
    pub fn arm(&mut self, armed: bool) {
        #[cfg(feature = "fault-injection")]
        {
            self.armed = armed;
        }
        let _ = armed;
    }

    /// Called after every side effect; traps once when armed.
    #[inline]
    pub fn after_side_effect(&mut self) -> wasmtime::Result<()> {
        #[cfg(feature = "fault-injection")]
        if std::mem::take(&mut self.armed) {
            return Err(wasmtime::Error::new(Injected));
        }
        Ok(())
    }
}

#[cfg(feature = "fault-injection")]
mod armed {
    use std::time::Duration;

    use super::CrashPoint;

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

    const POINTS: [CrashPoint; 8] = [
        CrashPoint::AfterWrite,
        CrashPoint::AfterPrepareCommit,
        CrashPoint::AfterSnapshotState,
        CrashPoint::AfterPersist,
        CrashPoint::DuringCommit,
        CrashPoint::AfterCommit,
        CrashPoint::DuringEvolve,
        CrashPoint::AfterEvolve,
    ];

    /// `<point>[:<checkpoint>[:<subtask>]]`, the point as it displays.
    pub(super) fn parse_crash(text: &str) -> Option<Fault> {
        let mut parts = text.split(':');
        let name = parts.next()?;
        let point = POINTS.into_iter().find(|p| p.to_string() == name)?;
        let checkpoint = parts.next().map_or(Some(1), |c| c.parse().ok())?;
        let subtask = parts.next().map_or(Some(0), |s| s.parse().ok())?;
        Some(Fault { point, checkpoint, subtask })
    }

    /// A crash to inject.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Fault {
        pub point: CrashPoint,
        pub checkpoint: u64,
        /// Subtask for the subtask-side points.
        pub subtask: u32,
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
}
