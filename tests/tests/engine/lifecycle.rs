//! The engine calls the plugin in the order the contract promises.

use sluice::engine::{CrashPoint, Fault};
use sluice_tests::TestJob;

fn entries(journal: &[(u128, String)]) -> Vec<String> {
    journal.iter().map(|(_, e)| e.clone()).filter(|e| !e.starts_with("write ")).collect()
}

fn time_of(journal: &[(u128, String)], entry: &str) -> u128 {
    journal.iter().find(|(_, e)| e.starts_with(entry)).unwrap_or_else(|| panic!("no `{entry}` in {journal:?}")).0
}

#[test]
fn lifecycle_order() {
    // Two writers of 1000 rows each, checkpoints every 300 rows: 4 checkpoints.
    let job = TestJob::chaos("lifecycle", 2000, 2, 300, "none", "write");
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.last_committed, Some(4));

    for w in 0..2 {
        let journal = job.journal(&format!("a1-writer{w}"));
        let mut expected = vec!["open restored=none".to_string()];
        for (c, rows) in [(1, 300), (2, 300), (3, 300), (4, 100)] {
            expected.push(format!("prepare-commit {c} rows={rows}"));
            expected.push(format!("snapshot-state {c}"));
        }
        expected.push("close".to_string());
        assert_eq!(entries(&journal), expected, "writer {w}");
        let written: u64 = journal
            .iter()
            .filter_map(|(_, e)| e.strip_prefix("write rows="))
            .map(|n| n.parse::<u64>().expect("count"))
            .sum();
        assert_eq!(written, 1000);
    }

    // The committer's state (contract 0.2.3): restored right after open,
    // taken for each record after combine and before commit (so the record
    // of `c` holds the commits before `c`), and once more after the last
    // commit, for the record that settles the run.
    let committer = job.journal("a1-committer");
    let mut expected = vec!["open".to_string(), "restore none checkpoints=[] rows=0".to_string()];
    for c in 1..=4u64 {
        let rows = if c == 4 { 200 } else { 600 };
        expected.push(format!("combine {c} infos=2 rows={rows}"));
        expected.push(format!("state-snapshot {c} checkpoints={:?}", (1..c).collect::<Vec<_>>()));
        expected.push(format!("commit {c} rows={rows}"));
    }
    expected.push("state-snapshot 4 checkpoints=[1, 2, 3, 4]".to_string());
    assert_eq!(entries(&committer), expected);

    // combine(c) only after every writer's snapshot-state(c). (commit(c) after
    // its persisted record is checked by the plugin itself: it fails the job
    // when the record is missing.)
    for c in 1..=4 {
        let combine = time_of(&committer, &format!("combine {c} "));
        for w in 0..2 {
            let snap = time_of(&job.journal(&format!("a1-writer{w}")), &format!("snapshot-state {c}"));
            assert!(snap < combine, "combine {c} ran before writer {w}'s snapshot-state");
        }
    }
}

#[test]
fn restore_recommits_before_reopening_writers() {
    let job = TestJob::chaos("lifecycle-restore", 2000, 2, 300, "none", "write");
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    job.run(None).expect("recovers");

    let committer = job.journal("a2-committer");
    assert_eq!(
        entries(&committer)[..3],
        [
            "open".to_string(),
            // The record of checkpoint 2 holds the state before its commit.
            "restore some checkpoints=[1] rows=600".to_string(),
            "commit 2 rows=600".to_string()
        ]
    );
    let recommit = time_of(&committer, "commit 2 ");
    for w in 0..2 {
        let journal = job.journal(&format!("a2-writer{w}"));
        assert_eq!(journal[0].1, "open restored=c2", "writer {w} reopens with its checkpoint-2 state");
        assert!(journal[0].0 > recommit, "writer {w} opened before the pending commit was finished");
        assert_eq!(entries(&journal)[1], "prepare-commit 3 rows=300");
    }
}
