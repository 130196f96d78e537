//! Files are synced off the plugin's thread (`capability::syncs`); a
//! checkpoint's record must still be persisted only after every file it
//! names is durable. The real `sluice` binary runs with every sync slowed
//! (`SLUICE_TEST_SYNC`, test builds), so that a missing wait would let a
//! record be persisted first, and its debug log is read back in order.

use std::collections::BTreeSet;
use std::path::Path;

use sluice_tests::{TestJob, assert_exactly_once, read_iceberg, sluice_cli, sluice_run};

const ROWS: u64 = 6_000;

fn parquet_files(dir: &Path, out: &mut BTreeSet<String>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            parquet_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "parquet") {
            out.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
}

/// The file name a log line's `location=...` ends with.
fn file_name_in(line: &str) -> Option<String> {
    let at = line.find("location=")? + "location=".len();
    let location = line[at..].split_whitespace().next()?.trim_matches('"');
    Some(location.rsplit('/').next()?.to_string())
}

fn run_logged(job: &TestJob, sync: &str) -> (bool, String) {
    job.load(&[]).expect("a valid job (and its file written)");
    let out = sluice_run(job, &[])
        .env("SLUICE_TEST_SYNC", sync)
        .env("RUST_LOG", "warn,sluice_capability::syncs=debug,sluice_engine::coordinator=debug")
        .output()
        .expect("running sluice");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn every_file_a_record_names_is_synced_before_the_record_is_persisted() {
    let warehouse = tempfile::tempdir().expect("temp dir");
    let job = TestJob::iceberg("synced", warehouse.path(), "db.synced", ROWS, 0, 2, 1000);
    // 60 ms a file: a round's files are still being synced long after the
    // writers answered, unless the host waits for them.
    let (ok, log) = run_logged(&job, "60");
    assert!(ok, "the run failed:\n{log}");

    let mut deferred = BTreeSet::new();
    let mut synced = BTreeSet::new();
    let mut persisted = 0;
    for line in log.lines() {
        if line.contains("deferred the sync of a finished file") {
            deferred.insert(file_name_in(line).unwrap_or_else(|| panic!("no location in {line}")));
        } else if line.contains("synced a finished file") {
            synced.insert(file_name_in(line).unwrap_or_else(|| panic!("no location in {line}")));
        } else if line.contains("persisting the checkpoint's record") {
            persisted += 1;
            let unsynced: Vec<_> = deferred.difference(&synced).collect();
            assert!(unsynced.is_empty(), "a record was persisted before these files were synced: {unsynced:?}\n{log}");
        }
    }
    assert!(persisted >= 3, "expected a record per checkpoint, saw {persisted}:\n{log}");
    assert!(deferred.len() >= 6, "the writers' files were not synced in the background: {deferred:?}\n{log}");

    // Every data file the table can name went through a sync.
    let mut on_disk = BTreeSet::new();
    parquet_files(warehouse.path(), &mut on_disk);
    let missed: Vec<_> = on_disk.difference(&synced).collect();
    assert!(missed.is_empty(), "data files never synced: {missed:?}");
    assert_exactly_once(&read_iceberg(warehouse.path(), "db.synced").rows, ROWS);
}

#[test]
fn a_file_that_cannot_be_synced_stops_the_run_before_any_record_names_it() {
    let warehouse = tempfile::tempdir().expect("temp dir");
    let job = TestJob::iceberg("unsynced", warehouse.path(), "db.unsynced", ROWS, 0, 2, 1000);
    let (ok, log) = run_logged(&job, "0:fail");
    assert!(!ok, "the run succeeded although no file could be synced:\n{log}");
    assert!(log.contains("syncing the finished file to disk failed") && log.contains("injected I/O error"), "{log}");
    assert!(!log.contains("persisting the checkpoint's record"), "a record was persisted:\n{log}");

    // The next run, whose syncs work, writes everything exactly once.
    let (ok, log) = run_logged(&job, "0");
    assert!(ok, "the rerun failed:\n{log}");
    let table = read_iceberg(warehouse.path(), "db.unsynced");
    assert_exactly_once(&table.rows, ROWS);
    table.assert_no_checkpoint_twice();
}

/// `sluice maintain` on `job`'s table with `sync` as `SLUICE_TEST_SYNC`.
fn maintain_logged(job: &TestJob, sync: &str) -> (bool, String) {
    let out = sluice_cli(&["maintain", "job.toml"], job.dir.path())
        .env("SLUICE_TEST_SYNC", sync)
        .output()
        .expect("running sluice maintain");
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Compaction closes its new files and commits them in one plugin call: the
/// writes that name them (its manifests, then the catalog commit) must wait
/// for their syncs, and a file that cannot be synced must stop them, so the
/// table keeps its old files. (Checked: with those waits removed, the
/// compaction is committed and this fails.)
#[test]
fn a_compaction_whose_files_cannot_be_synced_commits_nothing() {
    let warehouse = tempfile::tempdir().expect("temp dir");
    let job = TestJob::iceberg("compacted", warehouse.path(), "db.compacted", ROWS, 0, 2, 1000);
    let (ok, log) = run_logged(&job, "0");
    assert!(ok, "the run failed:\n{log}");
    let head = |w: &Path| read_iceberg(w, "db.compacted").table.metadata().current_snapshot_id();
    let before = head(warehouse.path());

    let (ok, out) = maintain_logged(&job, "0:fail");
    assert!(!ok, "the compaction succeeded although its files could not be synced:\n{out}");
    assert!(out.contains("syncing the finished file to disk failed"), "{out}");
    assert_eq!(head(warehouse.path()), before, "a compaction was committed over files that are not durable");
    assert_exactly_once(&read_iceberg(warehouse.path(), "db.compacted").rows, ROWS);

    let (ok, out) = maintain_logged(&job, "0");
    assert!(ok, "the compaction failed:\n{out}");
    assert_ne!(head(warehouse.path()), before, "nothing was compacted:\n{out}");
    assert_exactly_once(&read_iceberg(warehouse.path(), "db.compacted").rows, ROWS);
}
