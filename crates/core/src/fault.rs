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
//! - [`pause_here`]: a step where a test may freeze the whole process
//!   (SIGSTOP to itself, every thread, the lease's renewer too), as a long
//!   GC pause or a suspended VM would, and wake it later (SIGCONT): the
//!   interleavings of a fenced holder, made deterministic.
//!
//! Invariant: without the feature every type here is empty, so each fault
//! site is written once and costs nothing in a released build. [`Faults`] is
//! zero-sized and its checks are constant `false`; [`Crash`] and [`Injected`]
//! are uninhabited, so the code that handles them is proven unreachable and
//! compiled out; no crash point's name is in the binary.

#[cfg(feature = "fault-injection")]
pub use armed::{CatalogFaults, CommitFault, Fault, Sim, SimFault};

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
    /// Seeded faults at the I/O boundaries (the state directory, file-io),
    /// for the simulation (see [`Sim`]).
    #[cfg(feature = "fault-injection")]
    pub sim: Option<std::sync::Arc<Sim>>,
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

/// Where a test may freeze the process ([`pause_here`]): each comes right
/// after the run last checked that it holds its state directory, so a
/// process frozen there past its lease wakes after another run may have
/// taken the state directory over.
#[derive(Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "fault-injection", derive(Debug))]
pub enum PausePoint {
    /// Before the record of `c` is written to an object store, after the
    /// persist's lease check.
    BeforeRecord,
    /// Before the plugin's `commit(c)` is called, after the lease check of
    /// the attempt.
    BeforeCommit,
}

/// Freezes this whole process (SIGSTOP to itself) when a test build is asked
/// to by the environment, `SLUICE_TEST_PAUSE=<point>:<checkpoint>` (the
/// point as it displays, `before-commit:2`), once per process; it goes on
/// when a test sends SIGCONT. Nothing without the feature.
#[inline]
pub fn pause_here(point: PausePoint, c: u64) {
    #[cfg(feature = "fault-injection")]
    armed::pause(point, c);
    let _ = (point, c);
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

    /// Called after every side effect; fails once when armed (the caller
    /// turns it into a trap of the plugin call).
    #[inline]
    pub fn after_side_effect(&mut self) -> Result<(), Injected> {
        #[cfg(feature = "fault-injection")]
        if std::mem::take(&mut self.armed) {
            return Err(Injected);
        }
        Ok(())
    }
}

#[cfg(feature = "fault-injection")]
mod armed {
    use std::collections::HashMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};
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

    impl CrashPoint {
        /// The points of a checkpoint round, in protocol order (a round
        /// without a schema change reaches no other).
        pub const ROUND: [CrashPoint; 6] = [
            CrashPoint::AfterWrite,
            CrashPoint::AfterPrepareCommit,
            CrashPoint::AfterSnapshotState,
            CrashPoint::AfterPersist,
            CrashPoint::DuringCommit,
            CrashPoint::AfterCommit,
        ];

        /// Every point, in protocol order.
        pub const ALL: [CrashPoint; 8] = [
            CrashPoint::AfterWrite,
            CrashPoint::AfterPrepareCommit,
            CrashPoint::AfterSnapshotState,
            CrashPoint::AfterPersist,
            CrashPoint::DuringCommit,
            CrashPoint::AfterCommit,
            CrashPoint::DuringEvolve,
            CrashPoint::AfterEvolve,
        ];
    }

    impl std::fmt::Display for super::PausePoint {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(match self {
                super::PausePoint::BeforeRecord => "before-record",
                super::PausePoint::BeforeCommit => "before-commit",
            })
        }
    }

    /// See [`super::pause_here`].
    pub(super) fn pause(point: super::PausePoint, c: u64) {
        static PAUSED: AtomicBool = AtomicBool::new(false);
        let Ok(asked) = std::env::var("SLUICE_TEST_PAUSE") else { return };
        if asked != format!("{point}:{c}") || PAUSED.swap(true, Ordering::SeqCst) {
            return;
        }
        let pid = std::process::id();
        tracing::warn!(pid, point = %point, checkpoint = c, "SLUICE_TEST_PAUSE: this process stops itself (SIGSTOP) until it is sent SIGCONT");
        // `kill` stops every thread of this process, this one included, and
        // exits; the wait for it returns once the process is continued.
        match std::process::Command::new("kill").args(["-STOP", &pid.to_string()]).status() {
            Ok(status) if status.success() => {
                tracing::warn!(point = %point, checkpoint = c, "SLUICE_TEST_PAUSE: continued")
            }
            Ok(status) => tracing::warn!(%status, "SLUICE_TEST_PAUSE: kill -STOP failed; not paused"),
            Err(e) => tracing::warn!(error = %e, "SLUICE_TEST_PAUSE: could not run kill; not paused"),
        }
    }

    /// `<point>[:<checkpoint>[:<subtask>]]`, the point as it displays.
    pub(super) fn parse_crash(text: &str) -> Option<Fault> {
        let mut parts = text.split(':');
        let name = parts.next()?;
        let point = CrashPoint::ALL.into_iter().find(|p| p.to_string() == name)?;
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

    /// What [`Sim::decide`] makes of one I/O operation.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum SimFault {
        /// It happens, and its caller hears so.
        Pass,
        /// It fails before anything happens (a refused request).
        FailBefore,
        /// It happens, and then its caller hears an error (the reply is
        /// lost, a timeout, a connection cut after the request was sent).
        LoseReply,
        /// A listing answers what it answered the time before (a lagging
        /// index). Only an operation whose name has `list` in it is ever
        /// answered this (others pass), and a listing that must be current
        /// (the state directory's, to resume) takes it as a pass.
        Stale,
    }

    /// Seeded faults at the engine's I/O boundaries, in the manner of
    /// TigerBeetle's VOPR and FoundationDB's simulation: each operation of a
    /// kind is numbered, and whether the nth one fails is a function of the
    /// seed, the kind and n alone, so a seed replays the same faults for the
    /// same sequence of operations. The state directory is driven by one
    /// thread, so its faults replay exactly; file-io operations of several
    /// writers interleave as threads run, so theirs replay as long as the
    /// order does.
    #[derive(Debug)]
    pub struct Sim {
        seed: u64,
        /// Chances per million that an operation fails before it happens,
        /// happens with its reply lost, or (a listing) answers stale.
        fail_before: u32,
        lose_reply: u32,
        stale: u32,
        enabled: AtomicBool,
        counts: Mutex<HashMap<&'static str, u64>>,
        fired: Mutex<Vec<String>>,
    }

    /// splitmix64's finaliser: a well-mixed 64-bit hash of `x`. Written
    /// here rather than taken from a crate: the simulation needs a pure
    /// function of (seed, operation, n), not a stream of numbers.
    fn mix(mut x: u64) -> u64 {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    fn name_hash(name: &str) -> u64 {
        name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    }

    impl Sim {
        /// Faults with the given chances per million operations.
        pub fn new(seed: u64, fail_before: u32, lose_reply: u32, stale: u32) -> Self {
            Self {
                seed,
                fail_before,
                lose_reply,
                stale,
                enabled: AtomicBool::new(true),
                counts: Mutex::default(),
                fired: Mutex::default(),
            }
        }

        pub fn seed(&self) -> u64 {
            self.seed
        }

        /// Turns the faults on or off (a simulation lets its last run pass).
        pub fn set_enabled(&self, on: bool) {
            self.enabled.store(on, Ordering::SeqCst);
        }

        /// The faults injected so far: `<operation>#<n> <fault> <what>`.
        pub fn fired(&self) -> Vec<String> {
            self.fired.lock().map(|f| f.clone()).unwrap_or_default()
        }

        /// The fault of this call of `op` (on `what`, named in the log only).
        pub fn decide(&self, op: &'static str, what: &str) -> SimFault {
            if !self.enabled.load(Ordering::SeqCst) {
                return SimFault::Pass;
            }
            let n = match self.counts.lock() {
                Ok(mut counts) => {
                    let n = counts.entry(op).or_insert(0);
                    *n += 1;
                    *n
                }
                Err(_) => return SimFault::Pass,
            };
            let roll = (mix(self.seed ^ mix(name_hash(op) ^ mix(n))) % 1_000_000) as u32;
            let fault = if roll < self.fail_before {
                SimFault::FailBefore
            } else if roll < self.fail_before + self.lose_reply {
                SimFault::LoseReply
            } else if roll < self.fail_before + self.lose_reply + self.stale && op.contains("list") {
                // Only a listing can be stale: another operation passes,
                // and is not reported as a fault it did not suffer.
                SimFault::Stale
            } else {
                SimFault::Pass
            };
            if fault != SimFault::Pass {
                tracing::info!(seed = self.seed, op, n, fault = ?fault, what, "simulated fault");
                if let Ok(mut fired) = self.fired.lock() {
                    fired.push(format!("{op}#{n} {fault:?} {what}"));
                }
            }
            fault
        }
    }
}
