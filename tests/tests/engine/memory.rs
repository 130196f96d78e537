//! The coordinator in this process against the engine's memory state
//! backend (`sluice::engine::memory_state`, [`RunOptions::memory_state`]):
//! its checkpoint round, its recovery and its halts, with a real plugin and
//! no state folder, server or process of its own. The seeded faults under
//! that backend run in the simulation (`simulation.rs`, every fourth seed).
//!
//! What holds here, for every crash point of the protocol: a run stopped at
//! it leaves the memory state resumable; the next run (a new store opened
//! on the same contents, as a new process would) resumes from the newest
//! durable record, commits what it left pending, and every row lands once.

use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::memory_state::MemoryDir;
use sluice::engine::{CrashPoint, EngineError, Fault, Faults, RunOptions};
use sluice_tests::{TestJob, assert_exactly_once, read_visible};

const ROWS: u64 = 1200;

fn with_memory(dir: &MemoryDir, crash: Option<Fault>) -> RunOptions {
    RunOptions {
        faults: Faults { crash, ..Faults::default() },
        memory_state: Some(dir.clone()),
        ..RunOptions::default()
    }
}

/// A crash at each point of checkpoint 2's round, then a run on the same
/// memory state: it resumes (not from the start), and every row is
/// visible once.
#[test]
fn a_run_resumes_from_memory_after_a_crash_at_every_point() {
    for point in CrashPoint::ROUND {
        let job = TestJob::files(&format!("memory-{point}"), ROWS, 2, 200);
        let dir = MemoryDir::new(&format!("memory-{point}"));
        let crash = Fault { point, checkpoint: 2, subtask: 1 };
        let err = job.run_opts(&[], with_memory(&dir, Some(crash))).expect_err("the crash");
        assert!(err.is_injected_crash(), "{point}: {err}");
        // Checkpoint 1 is durable whatever the point; from AfterPersist on, 2 as well.
        let newest = dir.records().first().map(|(c, _)| *c);
        let durable = if point >= CrashPoint::AfterPersist { 2 } else { 1 };
        assert_eq!(newest, Some(durable), "{point}: records {:?}", dir.records());

        let summary = job.run_opts(&[], with_memory(&dir, None)).expect("the next run");
        assert_eq!(summary.resumed_from, Some(durable), "{point}: {summary:?}");
        assert_eq!(summary.attempt, 2, "{point}: {summary:?}");
        assert_exactly_once(&read_visible(&job.out()), ROWS);
        assert!(!job.state().exists(), "{point}: the job's state folder was never used");
        // A finished job lands nothing more.
        job.run_opts(&[], with_memory(&dir, None)).expect("a rerun");
        assert_exactly_once(&read_visible(&job.out()), ROWS);
    }
}

/// A halt is durable: every later run on that state is refused, naming
/// the reason, before it writes anything.
#[test]
fn a_halted_memory_state_refuses_every_run() {
    let job = TestJob::files("memory-halted", ROWS, 1, 300);
    let dir = MemoryDir::new("memory-halted");
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(job.run_opts(&[], with_memory(&dir, Some(crash))).expect_err("the crash").is_injected_crash());
    let before = dir.records();
    let visible = read_visible(&job.out()).num_rows();
    CheckpointStore::in_memory(&dir, "memory-halted", 2)
        .expect("open")
        .halt("checkpoint 1 was found committed by another incarnation")
        .expect("halt");
    for _ in 0..2 {
        match job.run_opts(&[], with_memory(&dir, None)) {
            Err(EngineError::Halted { reason, .. }) => assert!(reason.contains("another incarnation"), "{reason}"),
            other => panic!("a halted state ran: {other:?}"),
        }
    }
    assert_eq!(dir.records(), before, "a refused run wrote no record");
    assert_eq!(read_visible(&job.out()).num_rows(), visible, "a refused run landed nothing");
}
