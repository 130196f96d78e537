//! Job incarnations: a job started over in a fresh state directory stops
//! before writing when its target holds an earlier incarnation's checkpoints,
//! starts a new incarnation beside them only when asked to, and a plugin
//! whose keys collide anyway is caught by the engine.

use sluice::engine::{EngineError, RunOptions, state};
use sluice_tests::{
    TestJob, assert_exactly_once, assert_exactly_once_range, read_iceberg, read_visible, read_visible_where, run_cli,
};

/// The incarnation id kept in a state directory.
fn incarnation(state_dir: &std::path::Path) -> String {
    let text = std::fs::read_to_string(state_dir.join("incarnation")).expect("the state directory has an incarnation");
    let value: serde_json::Value = serde_json::from_str(&text).expect("incarnation file is JSON");
    value["id"].as_str().expect("id").to_string()
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The reproduction, through the CLI: the files job run again with
/// more rows and a fresh state directory used to report every row while a
/// third of them stayed invisible. Now it stops before writing, and
/// `--new-incarnation` lands the source again beside the first incarnation.
#[test]
fn files_job_rerun_in_a_fresh_state_dir_stops_before_writing() {
    let job = TestJob::files("inc-files", 3000, 2, 500);
    job.load(&[]).expect("job file");
    let (code, out, err) = run_cli(&["run", "job.toml", "--progress", "quiet"], job.dir.path());
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("incarnation") && out.contains("(new)"), "{out}");
    let first = incarnation(&job.state());
    let before = listing(&job.out());
    let staging_before = listing(&job.dir.path().join("out/files.staging"));

    let fresh = ["--set", "source.rows=6000", "--set", "job.state_dir=state2"];
    let mut args = vec!["run", "job.toml", "--progress", "quiet"];
    args.extend_from_slice(&fresh);
    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 1, "{out}{err}");
    for part in
        ["job `inc-files` sink `out`", "out/files already holds committed checkpoints", &first, "--new-incarnation"]
    {
        assert!(err.contains(part), "the refusal names {part:?}:\n{err}");
    }
    assert!(!out.contains("rows in total"), "nothing is reported delivered: {out}");
    assert_eq!(listing(&job.out()), before, "nothing became visible");
    assert_eq!(listing(&job.dir.path().join("out/files.staging")), staging_before, "nothing was staged");
    assert!(!job.dir.path().join("state2/incarnation").exists(), "no incarnation was adopted");

    args.push("--new-incarnation");
    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 0, "{out}{err}");
    let second = incarnation(&job.dir.path().join("state2"));
    assert_ne!(first, second);
    assert!(out.contains("6000 rows in total"), "{out}");
    // Each incarnation's checkpoints hold its own rows, every one exactly once.
    assert_exactly_once(&read_visible_where(&job.out(), |d| d.contains(&first)), 3000);
    assert_exactly_once(&read_visible_where(&job.out(), |d| d.contains(&second)), 6000);
    assert_eq!(sluice_tests::ids(&read_visible(&job.out())).len(), 9000);

    // The flag is for a fresh state directory only.
    let (code, _, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains(&format!("already holds incarnation {second}")), "{err}");
}

/// The same for Iceberg: the table already holds snapshots (and the
/// watermark) of the first incarnation; a fresh state directory is refused
/// before any data file is written, and `--new-incarnation` commits its own.
#[test]
fn iceberg_job_rerun_in_a_fresh_state_dir_stops_before_writing() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("inc-ice", warehouse.path(), "db.events", 3000, 0, 2, 500);
    let first = job.run(None).expect("first incarnation");
    assert!(first.new_incarnation);
    let files_before = walk(warehouse.path());

    let err = job.run_with(&["job.state_dir=state2", "source.rows=4000"], None).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("table db.events already holds committed checkpoints"), "{message}");
    assert!(message.contains(&first.incarnation) && message.contains("--new-incarnation"), "{message}");
    assert_eq!(walk(warehouse.path()), files_before, "no file was written");

    let opts = RunOptions { new_incarnation: true, ..RunOptions::default() };
    let second =
        job.run_opts(&["job.state_dir=state2", "source.rows=4000", "source.first_id=3000"], opts).expect("new");
    assert_ne!(first.incarnation, second.incarnation);
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once_range(&table.rows, 0, 7000);
    let props = table.table.metadata().properties();
    // 1500 rows per writer in rounds of 500: checkpoint 3 is the last with rows; 2000: checkpoint 4.
    for (summary, last) in [(&first, 3), (&second, 4)] {
        let key = format!("sluice.committed.inc-ice.lake.{}", summary.incarnation);
        assert_eq!(props.get(&key).map(String::as_str), Some(last.to_string().as_str()), "{props:?}");
    }
}

fn walk(dir: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("dir").flatten() {
        let p = entry.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else if !p.to_string_lossy().contains("catalog.db") {
            out.push(p.display().to_string());
        }
    }
    out.sort();
    out
}

/// A plugin whose idempotence keys ignore the incarnation answers
/// `already-committed` for a checkpoint this very run prepared: the engine
/// fails the run, reports nothing delivered, and halts the state directory so
/// that no later run can count those rows as delivered either.
#[test]
fn a_reused_key_halts_the_state_directory() {
    let job = TestJob::chaos("inc-reuse", 1000, 2, 250, "already-committed", "commit");
    let err = job.run(None).expect_err("a reused key stops the run");
    assert!(matches!(err, EngineError::KeyReused { checkpoint: 1, .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("answered already-committed the first time this run committed"), "{message}");
    assert!(message.contains("nothing of it counts as delivered"), "{message}");

    let err = job.run(None).expect_err("halted");
    assert!(matches!(err, EngineError::Halted { .. }), "{err}");
    let loaded = job.load(&[]).expect("job");
    let report = state::inspect(&loaded).expect("state");
    assert!(report.halted.is_some());
    assert!(report.to_string().contains("HALTED:"), "{report}");
}

/// A state directory written before incarnations (records, no incarnation)
/// adopts one and finishes what it had pending with the keys it was made
/// with: every row once.
#[test]
fn a_state_dir_from_before_incarnations_adopts_one() {
    use sluice::engine::{CrashPoint, Fault};
    let job = TestJob::files("inc-adopt", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let old = incarnation(&job.state());
    std::fs::remove_file(job.state().join("incarnation")).expect("forget the incarnation");
    let summary = job.run(None).expect("resumes");
    assert!(!summary.new_incarnation);
    assert_ne!(summary.incarnation, old, "a new id was adopted");
    assert_eq!(summary.recovered.len(), 1, "{summary:?}");
    assert_exactly_once(&read_visible(&job.out()), 3000);
}
