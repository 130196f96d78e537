//! A crash at every step of the checkpoint protocol, followed by recovery,
//! always ends with every source row visible exactly once (ids and values).

use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_visible};

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

/// The files pending checkpoint `c` of the files job `job` names (its
/// combined commit, as the state directory holds it): each location as the
/// plugin names it, and its local path.
fn pending_files(job: &TestJob, c: u64) -> Vec<(String, std::path::PathBuf)> {
    let loaded = job.load(&[]).expect("the job loads");
    let state = sluice::engine::state::inspect(&loaded).expect("state");
    let pending = &state.latest.as_ref().expect("a checkpoint record").pending;
    let p = pending.iter().find(|p| p.checkpoint == c).unwrap_or_else(|| panic!("checkpoint {c} is not pending"));
    let combined: serde_json::Value = serde_json::from_slice(&p.combined.0).expect("the combined commit is JSON");
    let mut paths = Vec::new();
    for table in combined["tables"].as_array().expect("tables") {
        let dir = table["staging_dir"].as_str().expect("staging_dir");
        for file in table["files"].as_array().expect("files") {
            let location = format!("{dir}/{}", file["name"].as_str().expect("name"));
            // Locations relative to the job file's directory, as the grants.
            let path = job.dir.path().join(location.strip_prefix("file://").unwrap_or(&location));
            paths.push((location, path));
        }
    }
    paths
}

/// A pending checkpoint naming a staged file that is gone (removed outside
/// Sluice after the record was persisted) is never published: every run
/// refuses it with an error naming the file, the checkpoint and the way
/// out, publishes nothing of it, and leaves it pending. Once the operator
/// drops it, the job goes on and only that checkpoint's rows are missing.
#[test]
fn a_pending_checkpoint_naming_a_missing_file_is_refused_not_published() {
    let job = TestJob::files("missing-file", ROWS, PARALLELISM, EVERY);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let files = pending_files(&job, 2);
    assert!(files.len() >= PARALLELISM as usize, "one file per writer at least: {files:?}");
    assert!(files.iter().all(|(_, f)| f.is_file()), "{files:?}");
    let (named, gone) = &files[1];
    std::fs::remove_file(gone).unwrap_or_else(|e| panic!("removing {}: {e}", gone.display()));
    let before = ids(&read_visible(&job.out()));
    let entries = || std::fs::read_dir(job.out()).expect("the output directory").count();
    let visible_before = entries();

    for _ in 0..2 {
        let err = job.run(None).expect_err("the checkpoint is refused");
        assert!(!err.is_injected_crash(), "{err}");
        let err = err.to_string();
        for part in [
            "checkpoint 2 cannot be committed",
            "1 file(s)",
            "staged file",
            named.as_str(),
            "is missing",
            "--drop-pending 2",
        ] {
            assert!(err.contains(part), "{part:?} in {err}");
        }
        assert_eq!(ids(&read_visible(&job.out())), before, "nothing of checkpoint 2 may be published");
        assert_eq!(entries(), visible_before, "no directory of checkpoint 2 may be published");
        assert_eq!(pending_files(&job, 2), files, "checkpoint 2 stays pending, as it was");
    }

    let loaded = job.load(&[]).expect("the job loads");
    sluice::engine::state::drop_pending(&loaded, 2).expect("the operator drops checkpoint 2");
    let summary = job.run(None).expect("the job goes on");
    assert!(summary.recovered.is_empty(), "{summary:?}");
    // Checkpoint 2 held rows 500..1000 of each writer's 2000.
    let lost = |id: i64| (500..1000).contains(&(id % 2000));
    let expected: Vec<i64> = (0..ROWS as i64).filter(|id| !lost(*id)).collect();
    assert_eq!(ids(&read_visible(&job.out())), expected, "every row but those of the dropped checkpoint, once");
}
