//! Checkpoint records on disk: a corrupt record is refused loudly and never
//! used; the state directory is locked against a second concurrent run.

use sluice::engine::checkpoint::CheckpointError;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_visible};

#[test]
fn corrupt_checkpoint_is_rejected_loudly() {
    let job = TestJob::files("corrupt", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let before = ids(&read_visible(&job.out()));

    let record = job.state().join("checkpoints").join(format!("chk-{:020}.json", 2));
    let original = std::fs::read(&record).expect("record of checkpoint 2");
    let mut bytes = original.clone();
    let i = bytes.len() - 10;
    bytes[i] ^= 0x01;
    std::fs::write(&record, &bytes).expect("corrupt");

    let err = job.run(None).expect_err("a corrupt record stops the run");
    assert!(
        matches!(&err, EngineError::Checkpoint(CheckpointError::Corrupt { reason, .. }) if reason == "checksum mismatch"),
        "{err}"
    );
    let err = err.to_string();
    assert!(err.contains(&record.display().to_string()), "the message names the file: {err}");
    assert!(err.contains("previous record (checkpoint 1)"), "{err}");
    assert_eq!(ids(&read_visible(&job.out())), before, "output changed although the run refused to start");

    // Truncation is caught as well.
    std::fs::write(&record, &original[..original.len() / 2]).expect("truncate");
    let err = job.run(None).expect_err("refused").to_string();
    assert!(err.contains("truncated"), "{err}");

    std::fs::write(&record, &original).expect("restore");
    job.run(None).expect("resumes from the restored record");
    assert_exactly_once(&read_visible(&job.out()), 3000);
}

#[test]
fn parallelism_change_is_refused() {
    let job = TestJob::files("reparallel", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let err = job.run_with(&["job.parallelism=3"], None).expect_err("refused");
    assert!(matches!(err, EngineError::ParallelismChanged { checkpoint: 1, recorded: 2, now: 3 }), "{err}");
    assert!(err.to_string().contains("job.parallelism = 2, but the job now sets 3"), "{err}");
    job.run(None).expect("same parallelism resumes");
    assert_exactly_once(&read_visible(&job.out()), 3000);
}
