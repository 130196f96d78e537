//! A committer's own state (contract 0.2.3's `committer-state`) outlives
//! crashes and never holds a checkpoint that was not committed.
//!
//! The chaos plugin's committer keeps, as its state, each checkpoint it
//! committed and their rows; the host persists that state in every record
//! and hands it back on resume. If a resume lost it, the state at the end
//! would miss the checkpoints committed before the crash; if a record held
//! a state taken after its own commit, a dropped checkpoint would be in it.

use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::TestJob;

const ROWS: u64 = 2000;

/// The committer's state `(checkpoints, rows)` in the newest record of the
/// job's state directory.
fn recorded_state(job: &TestJob) -> (Vec<u64>, u64) {
    let loaded = job.load(&[]).expect("job");
    let store = CheckpointStore::inspect(&job.state(), &loaded.spec.job.id).expect("state dir").expect("a state dir");
    let record = store.latest().expect("reading the newest record").expect("a checkpoint record");
    let state =
        record.committer_state.unwrap_or_else(|| panic!("record {} holds no committer state", record.checkpoint));
    let value: serde_json::Value = serde_json::from_slice(&state.0).expect("the chaos state is JSON");
    let checkpoints =
        value["checkpoints"].as_array().expect("checkpoints").iter().map(|c| c.as_u64().expect("id")).collect();
    (checkpoints, value["rows"].as_u64().expect("rows"))
}

fn journal_has(job: &TestJob, instance: &str, entry: &str) -> bool {
    job.dir.path().join("journal").join(format!("{instance}.log")).exists()
        && job.journal(instance).iter().any(|(_, e)| e.starts_with(entry))
}

/// At every crash point, at a middle and at the last checkpoint: after the
/// resume, the state names each of the four checkpoints once, with every row.
#[test]
fn the_committer_state_outlives_a_crash_at_every_point() {
    for point in CrashPoint::ALL {
        if matches!(point, CrashPoint::DuringEvolve | CrashPoint::AfterEvolve) {
            continue; // the generator's one table never evolves
        }
        for checkpoint in [2, 4] {
            let job = TestJob::chaos(&format!("state-{point}-{checkpoint}"), ROWS, 2, 300, "none", "write");
            let fault = Fault { point, checkpoint, subtask: 1 };
            let crashed = job.run(Some(fault)).expect_err("crash");
            assert!(crashed.is_injected_crash(), "{point} at {checkpoint}: {crashed}");
            let summary = job.run(None).unwrap_or_else(|e| panic!("{point} at {checkpoint}: the resume failed: {e}"));
            assert_eq!(summary.last_committed, Some(4), "{point} at {checkpoint}");
            assert_eq!(recorded_state(&job), (vec![1, 2, 3, 4], ROWS), "{point} at {checkpoint}");
            assert!(
                journal_has(&job, "a2-committer", "restore some "),
                "{point} at {checkpoint}: the resume restored nothing"
            );
        }
    }
}

/// A pending checkpoint an operator drops never enters the state, and a
/// resume after the drop starts from the state of the commits before it.
#[test]
fn a_dropped_checkpoint_never_enters_the_state() {
    let job = TestJob::chaos("state-drop", ROWS, 2, 300, "none", "write");
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 3, subtask: 0 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    let loaded = job.load(&[]).expect("job");
    sluice::engine::state::drop_pending(&loaded, 3).expect("drop");
    job.run(None).expect("resumes after the drop");
    let committer = job.journal("a2-committer");
    let restore = committer.iter().find(|(_, e)| e.starts_with("restore ")).expect("a restore").1.clone();
    assert_eq!(restore, "restore some checkpoints=[1, 2] rows=1200", "the record of 3 holds the state before it");
    let (checkpoints, _) = recorded_state(&job);
    assert!(!checkpoints.contains(&3), "the dropped checkpoint is in the state: {checkpoints:?}");
    assert_eq!(checkpoints, vec![1, 2, 4], "the run after the drop commits the rest as checkpoint 4");
}

/// An input that was entirely empty asks the committer whether its end
/// calls for a commit (`finish`: an overwrite of nothing may have to empty
/// what it covers), and commits what it returns as that checkpoint's own; a
/// committer with nothing to say adds no commit. (A run whose last round
/// has rows never asks: `lifecycle::lifecycle_order` lists every call.)
#[test]
fn an_empty_input_asks_the_committer_at_its_end() {
    let quiet = TestJob::chaos("finish-none", 0, 2, 300, "none", "write");
    let summary = quiet.run(None).expect("runs");
    assert_eq!(summary.last_committed, None, "{summary}");
    let calls: Vec<String> = quiet.journal("a1-committer").into_iter().map(|(_, e)| e).collect();
    assert_eq!(calls.iter().filter(|e| e.starts_with("finish")).collect::<Vec<_>>(), vec!["finish 1"], "{calls:?}");
    assert!(!calls.iter().any(|e| e.starts_with("commit ")), "{calls:?}");

    let asking = TestJob::chaos("finish-commits", 0, 2, 300, "finish-commits", "commit");
    let summary = asking.run(None).expect("runs");
    assert_eq!(summary.last_committed, Some(1), "the finish commit is checkpoint 1's: {summary}");
    let commits: Vec<String> =
        asking.journal("a1-committer").into_iter().map(|(_, e)| e).filter(|e| e.starts_with("commit ")).collect();
    assert_eq!(commits, vec!["commit 1 rows=0".to_string()]);
    assert_eq!(recorded_state(&asking), (vec![1], 0));
    // Its rerun is a finished job's: nothing asked, nothing committed again.
    asking.run(None).expect("rerun");
    assert!(
        !asking.dir.path().join("journal/a2-committer.log").exists() || {
            let again = asking.journal("a2-committer");
            !again.iter().any(|(_, e)| e.starts_with("commit ") || e.starts_with("finish"))
        }
    );
}
