//! A crash at every step of the checkpoint protocol, followed by recovery,
//! always ends with every source row visible exactly once (ids and values).

use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::{TestJob, assert_exactly_once, read_visible};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
const EVERY: u64 = 500;

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let job = TestJob::files(&format!("crash-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
    sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
}

sluice_tests::crash_tests! {
    after_write_first: CrashPoint::AfterWrite, 1;
    after_write_middle: CrashPoint::AfterWrite, 3;
    after_prepare_commit_first: CrashPoint::AfterPrepareCommit, 1;
    after_prepare_commit_middle: CrashPoint::AfterPrepareCommit, 3;
    after_snapshot_state_first: CrashPoint::AfterSnapshotState, 1;
    after_snapshot_state_middle: CrashPoint::AfterSnapshotState, 3;
    after_persist_first: CrashPoint::AfterPersist, 1;
    after_persist_middle: CrashPoint::AfterPersist, 3;
    after_persist_last: CrashPoint::AfterPersist, 4;
    during_commit_first: CrashPoint::DuringCommit, 1;
    during_commit_middle: CrashPoint::DuringCommit, 3;
    during_commit_last: CrashPoint::DuringCommit, 4;
    after_commit_first: CrashPoint::AfterCommit, 1;
    after_commit_middle: CrashPoint::AfterCommit, 3;
    after_commit_last: CrashPoint::AfterCommit, 4;
}

/// Two crashes in a row, the second during the recovery run, and a replay
/// that batches rows differently than the run that crashed.
#[test]
fn repeated_crashes_and_rebatched_replay() {
    let job = TestJob::files("crash-twice", ROWS, PARALLELISM, EVERY);
    let first = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(first)).expect_err("crash").is_injected_crash());
    let second = Fault { point: CrashPoint::DuringCommit, checkpoint: 3, subtask: 0 };
    let err = job.run_with(&["source.batch_rows=333"], Some(second)).expect_err("crash");
    assert!(err.is_injected_crash(), "{err}");
    let summary = job.run_with(&["source.batch_rows=1001"], None).expect("completes");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
    assert_eq!(summary.attempt, 3);
    assert_eq!(summary.recovered, vec![(3, CommitOutcome::AlreadyCommitted)]);
}

/// A finished job run again changes nothing.
#[test]
fn rerun_of_a_finished_job_is_a_no_op() {
    let job = TestJob::files("rerun", 1500, 2, 400);
    let first = job.run(None).expect("runs");
    assert!(!first.already_complete);
    let before = read_visible(&job.out());
    assert_exactly_once(&before, 1500);
    let again = job.run(None).expect("runs");
    assert!(again.already_complete, "{again}");
    assert_eq!(read_visible(&job.out()), before);
}
