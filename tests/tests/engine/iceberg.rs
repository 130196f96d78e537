//! The Iceberg sink, exactly once: the crash matrix, lost commit replies,
//! injected conflicts, exhausted attempts, three jobs writing one table at
//! the same time, partitioned tables and schema checks. Tables are read back
//! through iceberg-rust's own scan, compared by id and value.

use std::path::{Path, PathBuf};

use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, EngineError, Fault, RunOptions};
use sluice::fault::{CatalogFaults, CommitFault, Faults};
use sluice_tests::{TestJob, assert_exactly_once_range, read_iceberg};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
const EVERY: u64 = 500;
const TABLE: &str = "db.events";

fn job(id: &str, warehouse: &Path) -> TestJob {
    TestJob::iceberg(id, warehouse, TABLE, ROWS, 0, PARALLELISM, EVERY)
}

/// Exactly once by id and value, one snapshot per non-empty checkpoint, and
/// no checkpoint committed twice.
fn assert_landed_once(warehouse: &Path, id: &str) {
    let table = read_iceberg(warehouse, TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert_eq!(table.snapshots_of(id), 4, "one snapshot per non-empty checkpoint: {:?}", table.commits);
    let checkpoints: Vec<u64> = table.commits.iter().filter(|(j, _)| j == id).map(|(_, c)| *c).collect();
    assert_eq!(checkpoints, vec![1, 2, 3, 4]);
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let id = format!("ice-{point}-{checkpoint}");
    let job = job(&id, warehouse.path());
    // The check `sluice plugin test` runs; then what this sink promises beyond it.
    let restored = sluice_conformance::crash_and_restore(&sluice_conformance::CrashCheck {
        fault: Fault { point, checkpoint, subtask: 1 },
        first_id: 0,
        rows: ROWS,
        run: &|fault| job.run(fault),
        visible: &|| Ok(sluice_tests::ids(&read_iceberg(warehouse.path(), TABLE).rows)),
        may_not_happen: false,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_landed_once(warehouse.path(), &id);
    sluice_tests::assert_iceberg_recovery(point, checkpoint, &restored.summary.recovered);
}

sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 2;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 1;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit: CrashPoint::AfterCommit, 4;
}

fn with_catalog_faults(faults: Vec<(u64, CommitFault)>) -> RunOptions {
    let catalog = CatalogFaults { faults, ..CatalogFaults::default() };
    RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() }
}

/// The catalog applies commit 2 and crashes the engine before the plugin
/// hears of it: the restart finds the snapshot and does not re-apply it.
#[test]
fn crash_right_after_the_catalog_applied_the_commit() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("ice-applied-crash", warehouse.path());
    let err = job
        .run_opts(&[], with_catalog_faults(vec![(2, CommitFault::CrashAfterApply)]))
        .expect_err("the injected crash stops the run");
    assert!(err.is_injected_crash(), "{err}");
    let summary = job.run(None).expect("recovers");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::AlreadyCommitted)]);
    assert_landed_once(warehouse.path(), "ice-applied-crash");
}

/// A commit whose reply is lost (`unknown-outcome` after it was applied) is
/// checked, not re-applied, and the run goes on.
#[test]
fn lost_commit_replies_are_checked_not_reapplied() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("ice-lost-reply", warehouse.path());
    let summary = job
        .run_opts(&[], with_catalog_faults(vec![(1, CommitFault::LoseReply), (3, CommitFault::LoseReply)]))
        .expect("the run completes despite lost replies");
    assert_eq!(summary.rows_total, ROWS);
    // Four snapshots, and no more commit calls than checkpoints: nothing was re-applied.
    assert_eq!(summary.catalog_commits, 4, "{summary:?}");
    assert_landed_once(warehouse.path(), "ice-lost-reply");
}

/// Injected conflicts are retried after reloading the table.
#[test]
fn conflicts_are_retried_with_a_fresh_table() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("ice-conflicts", warehouse.path());
    let faults = vec![(1, CommitFault::Conflict), (2, CommitFault::Conflict), (4, CommitFault::Conflict)];
    let summary = job.run_opts(&[], with_catalog_faults(faults)).expect("the run completes");
    assert_eq!(summary.catalog_conflicts, 3, "{summary:?}");
    assert_eq!(summary.catalog_commits, 7, "{summary:?}");
    assert_landed_once(warehouse.path(), "ice-conflicts");
}

/// When every attempt conflicts the job stops with a clear error; the
/// checkpoint stays pending and the next run commits it.
#[test]
fn exhausted_attempts_leave_the_checkpoint_pending() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("ice-exhausted", warehouse.path());
    let faults = (1..=20).map(|n| (n, CommitFault::Conflict)).collect();
    let err = job
        .run_opts(&["job.commit.max_attempts=3", "job.commit.initial_backoff_ms=1"], with_catalog_faults(faults))
        .expect_err("the commit gives up");
    assert!(matches!(err, EngineError::CommitExhausted { checkpoint: 1, attempts: 3, .. }), "{err}");
    assert!(err.to_string().contains("stays pending"), "{err}");
    assert!(read_iceberg(warehouse.path(), TABLE).commits.is_empty(), "nothing may be committed");
    let summary = job.run(None).expect("the next run commits");
    assert_eq!(summary.recovered.first(), Some(&(1, CommitOutcome::Committed)), "{summary:?}");
    assert!(summary.recovered.iter().all(|(_, o)| *o == CommitOutcome::Committed), "{summary:?}");
    assert_landed_once(warehouse.path(), "ice-exhausted");
}

/// Three jobs, three writers each, commit to one table at the same time
/// (with a slow catalog, so their commits overlap). Every row lands exactly
/// once and each job has one snapshot per non-empty checkpoint.
#[test]
fn three_jobs_write_one_table_at_the_same_time() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    const JOB_ROWS: u64 = 4500;
    let jobs: Vec<(String, TestJob)> = (0..3u64)
        .map(|k| {
            let id = format!("ice-concurrent-{k}");
            let job = TestJob::iceberg(&id, warehouse.path(), TABLE, JOB_ROWS, k * JOB_ROWS, 3, 300);
            (id, job)
        })
        .collect();
    let summaries: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|(_, job)| {
                scope.spawn(move || {
                    let catalog =
                        CatalogFaults { latency: std::time::Duration::from_millis(15), ..CatalogFaults::default() };
                    let slow_catalog =
                        RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() };
                    job.run_opts(&["job.commit.max_attempts=50", "job.commit.max_backoff_ms=500"], slow_catalog)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("job thread")).collect()
    });
    let mut conflicts = 0;
    for ((id, _), summary) in jobs.iter().zip(summaries) {
        let summary = summary.unwrap_or_else(|e| panic!("job {id} failed: {e}"));
        assert_eq!(summary.rows_total, JOB_ROWS);
        conflicts += summary.catalog_conflicts;
    }
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, 3 * JOB_ROWS);
    table.assert_no_checkpoint_twice();
    for (id, _) in &jobs {
        // 1500 rows per writer in rounds of 300: 5 non-empty checkpoints.
        assert_eq!(table.snapshots_of(id), 5, "{id}: {:?}", table.commits);
    }
    eprintln!("three concurrent jobs: {conflicts} commit conflicts resolved by retry");
}

/// Partitioned tables (identity, day and hour transforms) land the same rows.
#[test]
fn partitioned_tables() {
    for spec in ["day(day), identity(note)", "hour(ts)"] {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let job = job("ice-partitioned", warehouse.path());
        let set = format!("sink.options.partition_by={spec:?}");
        job.run_with(&[&set], None).unwrap_or_else(|e| panic!("{spec}: {e}"));
        assert_landed_once(warehouse.path(), "ice-partitioned");
        let table = read_iceberg(warehouse.path(), TABLE);
        let fields: Vec<String> = table
            .table
            .metadata()
            .default_partition_spec()
            .fields()
            .iter()
            .map(|f| format!("{}:{}", f.name, f.transform))
            .collect();
        let expected = match spec {
            "hour(ts)" => vec!["ts_hour:hour".to_string()],
            _ => vec!["day_day:day".to_string(), "note:identity".to_string()],
        };
        assert_eq!(fields, expected);
    }
}

/// A table whose schema does not fit the source is refused before any row is
/// written, by `check` and by `run`, naming the column.
#[test]
fn schema_mismatch_is_a_clear_error_before_any_write() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let catalog = sluice_tests::catalog(warehouse.path());
    let ident = iceberg::TableIdent::from_strs(["db", "events"]).expect("ident");
    let request = r#"{"name":"events","schema":{"type":"struct","schema-id":0,"fields":[
        {"id":1,"name":"id","required":true,"type":"string"},
        {"id":2,"name":"qty","required":true,"type":"int"}]}}"#;
    catalog.create_table(&ident, request).expect("creating the mismatched table");

    let job = job("ice-mismatch", warehouse.path());
    let loaded = job.load(&[]).expect("job file");
    let report = sluice::engine::check(&loaded, sluice_tests::host());
    let problems = report.problems.join("\n");
    // (`price` and the other columns the table lacks would be added as
    // optional columns; the type of `id` cannot change.)
    assert!(problems.contains("column `id` is long in the source but string in the table"), "{problems}");
    assert!(problems.contains("table db.events"), "{problems}");

    let err = job.run(None).expect_err("the run refuses the table");
    assert!(err.to_string().contains("column `id` is long in the source but string in the table"), "{err}");
    let table = read_iceberg_raw_snapshots(warehouse.path());
    assert_eq!(table, 0, "nothing may be committed");
}

fn read_iceberg_raw_snapshots(warehouse: &Path) -> usize {
    let ident = iceberg::TableIdent::from_strs(["db", "events"]).expect("ident");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("table");
    table.metadata().snapshots().count()
}

/// Without `create_table` a missing table is a config error naming the option.
#[test]
fn missing_table_without_create_is_a_config_error() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("ice-missing", warehouse.path());
    let err = job.run_with(&["sink.options.create_table=false"], None).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("db.events does not exist") && message.contains("create_table"), "{message}");
}

/// Idempotence does not depend on snapshot history: job A crashes right
/// after committing checkpoint 2 (its record still lists 2 as pending), job
/// B commits to the same table, and iceberg-rust's snapshot expiry removes
/// every snapshot but the current one, A's among them. A's recovery finds
/// checkpoint 2 committed by the table's watermark and applies nothing again.
#[test]
fn expired_snapshots_do_not_make_a_recovery_commit_twice() {
    use iceberg::transaction::{ApplyTransactionAction, Transaction};
    use iceberg::{Catalog, TableIdent};
    let warehouse = tempfile::tempdir().expect("warehouse");
    let a = job("ice-expire-a", warehouse.path());
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(a.run(Some(crash)).expect_err("crash").is_injected_crash());
    let b = TestJob::iceberg("ice-expire-b", warehouse.path(), TABLE, ROWS, ROWS, PARALLELISM, EVERY);
    b.run(None).expect("job B");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let catalog = sluice_bench::sql_catalog(warehouse.path()).await.expect("catalog");
        let table = catalog.load_table(&TableIdent::from_strs(["db", "events"]).expect("ident")).await.expect("load");
        let now = table.metadata().last_updated_ms() + 1;
        let tx = Transaction::new(&table);
        let tx = tx.expire_snapshots().expire_older_than_ms(now).retain_last(1).apply(tx).expect("expire action");
        tx.commit(&catalog).await.expect("snapshot expiry commits");
    });
    let expired = read_iceberg(warehouse.path(), TABLE);
    assert_eq!(expired.table.metadata().snapshots().count(), 1, "only the current snapshot is left");
    assert_eq!(expired.snapshots_of("ice-expire-a"), 0, "A's snapshots are gone from the history");

    let summary = a.run(None).expect("A recovers");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::AlreadyCommitted)]);
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, 2 * ROWS);
}

/// The local paths of the data files pending checkpoint `c` of `job` names
/// (its combined commit, as the state directory holds it).
fn pending_data_files(job: &TestJob, c: u64) -> Vec<PathBuf> {
    let loaded = job.load(&[]).expect("the job loads");
    let state = sluice::engine::state::inspect(&loaded).expect("state");
    let pending = &state.latest.as_ref().expect("a checkpoint record").pending;
    let p = pending.iter().find(|p| p.checkpoint == c).unwrap_or_else(|| panic!("checkpoint {c} is not pending"));
    let combined: serde_json::Value = serde_json::from_slice(&p.combined.0).expect("the combined commit is JSON");
    let mut paths = Vec::new();
    for table in combined["tables"].as_array().expect("tables") {
        for file in table["files"].as_array().expect("files") {
            let file: serde_json::Value = serde_json::from_str(file.as_str().expect("data file JSON")).expect("JSON");
            let location = file["file_path"].as_str().expect("file_path");
            paths.push(PathBuf::from(location.strip_prefix("file://").unwrap_or(location)));
        }
    }
    paths
}

/// Every id of the table by PyIceberg's full scan (planning reads every
/// manifest; reading opens every live data file), sorted; DuckDB's
/// `iceberg_scan` must read the same ids.
fn pyiceberg_ids(warehouse: &Path) -> Vec<i64> {
    sluice_tests::readers_ids(warehouse, TABLE)
}

/// A pending checkpoint naming data files that are gone or changed (removed
/// or rewritten outside Sluice after the record was persisted) is never
/// committed: every run refuses it, before the catalog is asked, with an
/// error naming each such file, the checkpoint and the way out, and leaves
/// it pending; the table keeps its snapshots and stays whole for PyIceberg's
/// full scan. Once the operator drops the checkpoint, the job goes on and
/// only that checkpoint's rows are missing.
#[test]
fn a_pending_checkpoint_naming_a_missing_file_is_refused_not_committed() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let id = "ice-missing-file";
    let job = job(id, warehouse.path());
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let files = pending_data_files(&job, 2);
    assert!(files.len() >= PARALLELISM as usize, "one file per writer at least: {files:?}");
    let (gone, cut) = (&files[0], &files[1]);
    std::fs::remove_file(gone).unwrap_or_else(|e| panic!("removing {}: {e}", gone.display()));
    let bytes = std::fs::read(cut).expect("a data file");
    std::fs::write(cut, &bytes[..bytes.len() / 2]).expect("truncating a data file");

    let before = read_iceberg(warehouse.path(), TABLE);
    assert_eq!(before.commits, vec![(id.to_string(), 1)]);
    for _ in 0..2 {
        let err = job.run(None).expect_err("the checkpoint is refused");
        assert!(!err.is_injected_crash(), "{err}");
        assert!(!matches!(err, EngineError::CommitExhausted { .. }), "a refusal is not retried: {err}");
        let err = err.to_string();
        let gone = gone.display().to_string();
        let cut = cut.display().to_string();
        let holds = format!("holds {} bytes, and its writer wrote {}", bytes.len() / 2, bytes.len());
        for part in [
            "checkpoint 2 cannot be committed",
            "2 file(s)",
            "table db.events",
            gone.as_str(),
            "is missing",
            cut.as_str(),
            holds.as_str(),
            "--drop-pending 2",
        ] {
            assert!(err.contains(part), "{part:?} in {err}");
        }
        let after = read_iceberg(warehouse.path(), TABLE);
        assert_eq!(after.commits, before.commits, "no snapshot may be added");
        assert_eq!(
            after.table.metadata().snapshots().count(),
            before.table.metadata().snapshots().count(),
            "no snapshot may be added"
        );
        assert_eq!(sluice_tests::ids(&after.rows), sluice_tests::ids(&before.rows));
        assert_eq!(pending_data_files(&job, 2), files, "checkpoint 2 stays pending, as it was");
    }
    assert_eq!(pyiceberg_ids(warehouse.path()), sluice_tests::ids(&before.rows), "PyIceberg reads the table whole");

    let loaded = job.load(&[]).expect("the job loads");
    sluice::engine::state::drop_pending(&loaded, 2).expect("the operator drops checkpoint 2");
    let summary = job.run(None).expect("the job goes on");
    assert!(summary.recovered.is_empty(), "{summary:?}");
    // Checkpoint 2 held rows 500..1000 of each writer's 2000.
    let lost = |id: i64| (500..1000).contains(&(id % 2000));
    let expected: Vec<i64> = (0..ROWS as i64).filter(|id| !lost(*id)).collect();
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_eq!(sluice_tests::ids(&table.rows), expected, "every row but those of the dropped checkpoint, once");
    table.assert_no_checkpoint_twice();
    assert_eq!(pyiceberg_ids(warehouse.path()), expected);
}

/// A recovered checkpoint that is committed already answers
/// `already-committed` even when its data files are gone since (compacted
/// away, then expired): the idempotence check comes before any file is
/// looked at.
#[test]
fn a_committed_checkpoint_whose_files_were_compacted_away_stays_already_committed() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let id = "ice-compacted-away";
    let job = job(id, warehouse.path());
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let files = pending_data_files(&job, 2);
    let loaded = job.load(&[]).expect("the job loads");
    let opts = sluice::engine::maintain::MaintainOptions {
        compact: true,
        target_file_bytes: 128 * 1024 * 1024,
        keep_last: Some(1),
        timeout: std::time::Duration::from_secs(600),
        ..Default::default()
    };
    sluice::engine::maintain::maintain(&loaded, sluice_tests::host(), &opts).expect("compaction and expiry");
    assert!(files.iter().all(|f| !f.exists()), "compaction and expiry removed checkpoint 2's files: {files:?}");

    let summary = job.run(None).expect("recovers");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::AlreadyCommitted)]);
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert_eq!(pyiceberg_ids(warehouse.path()), (0..ROWS as i64).collect::<Vec<_>>());
}

/// Metadata files do not pile up (#42): a table Sluice creates bounds its
/// metadata log to 100 entries and deletes, with each commit, the metadata
/// file that commit drops from the log. After 130 checkpoints the table's
/// metadata folder holds the current file and the 100 the log names, the
/// rows are exact, and PyIceberg reads the table.
#[test]
fn metadata_files_dropped_from_the_log_are_deleted_by_the_commit() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 1300;
    let job = TestJob::iceberg("ice-metadata-log", warehouse.path(), TABLE, rows, 0, 1, 10);
    job.run(None).expect("run");
    let ident = iceberg::TableIdent::from_strs(["db", "events"]).expect("ident");
    let table = sluice_tests::catalog(warehouse.path()).load(&ident).expect("table");
    let metadata = table.metadata();
    assert_eq!(
        metadata.properties().get("write.metadata.delete-after-commit.enabled").map(String::as_str),
        Some("true")
    );
    assert_eq!(metadata.metadata_log().len(), 100, "the log is bounded to write.metadata.previous-versions-max");
    let current = table.metadata_location().expect("a metadata location");
    let folder = Path::new(current.trim_start_matches("file://")).parent().expect("metadata folder").to_path_buf();
    let mut on_disk: Vec<String> = std::fs::read_dir(&folder)
        .expect("metadata folder")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".metadata.json"))
        .collect();
    on_disk.sort();
    let mut named: Vec<String> = metadata
        .metadata_log()
        .iter()
        .map(|e| e.metadata_file.as_str())
        .chain([current])
        .filter_map(|f| f.rsplit('/').next().map(str::to_string))
        .collect();
    named.sort();
    assert_eq!(on_disk, named, "exactly the files the log names, and the current one, are left");
    assert!(read_iceberg_raw_snapshots(warehouse.path()) >= 130, "one snapshot per checkpoint");
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, rows);
    assert_eq!(pyiceberg_ids(warehouse.path()), (0..rows as i64).collect::<Vec<_>>(), "PyIceberg reads the table");
}

/// Commit cost that does not grow with history (#42): a table that merges
/// manifests once a group has 4 (`commit.manifest.min-count-to-merge`, set
/// by PyIceberg as an operator would) and a job that keeps its newest 5
/// snapshots (`keep_snapshots`: expired once 5 more piled up) stay small
/// over 90 checkpoints, and every row lands once though the job is crashed
/// at steps of a checkpoint, every catalog reply of a run is lost (the
/// appends' and the expiries' alike), and the catalog applies a commit
/// then the engine dies. Read back by iceberg-rust, PyIceberg and DuckDB;
/// the metadata folder holds a manifest list for each remaining snapshot
/// and few more (an expiry whose engine died before it deleted files
/// leaves them to orphan cleanup).
#[test]
fn a_long_job_merges_manifests_and_keeps_its_newest_snapshots_exactly_once_across_crashes() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 900;
    let job = TestJob::iceberg("ice-retention", warehouse.path(), TABLE, rows, 0, 1, 10);
    let sets = ["sink.options.keep_snapshots=5"];
    let first = Fault { point: CrashPoint::AfterCommit, checkpoint: 3, subtask: 0 };
    assert!(job.run_with(&sets, Some(first)).expect_err("crash").is_injected_crash());
    sluice_tests::python(
        "import sys\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table('db.events')\n\
         with t.transaction() as tx:\n\
         \x20   tx.set_properties({'commit.manifest.min-count-to-merge': '4'})\n",
        &[&warehouse.path().display().to_string()],
    )
    .expect("setting the merge property with PyIceberg");
    // An expiry follows every fifth commit from checkpoint 11 on, a merge
    // every third.
    for (point, checkpoint) in
        [(CrashPoint::DuringCommit, 20), (CrashPoint::AfterCommit, 31), (CrashPoint::AfterPersist, 37)]
    {
        let crash = Fault { point, checkpoint, subtask: 0 };
        let err = job.run_with(&sets, Some(crash)).expect_err("crash");
        assert!(err.is_injected_crash(), "{point:?} at {checkpoint}: {err}");
    }
    // Every reply lost, appends and expiries alike, until a crash.
    let lost = CatalogFaults { faults: (1..=200).map(|n| (n, CommitFault::LoseReply)).collect(), ..Default::default() };
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 60, subtask: 0 };
    let opts = RunOptions {
        faults: Faults { crash: Some(crash), catalog: lost, ..Faults::default() },
        ..RunOptions::default()
    };
    assert!(job.run_opts(&sets, opts).expect_err("crash").is_injected_crash());
    // Applied, then the engine dies: at an append or at an expiry.
    for n in [3, 4, 5, 6] {
        let err = job.run_opts(&sets, with_catalog_faults(vec![(n, CommitFault::CrashAfterApply)])).expect_err("crash");
        assert!(err.is_injected_crash(), "crash after commit-table call {n}: {err}");
    }
    job.run_with(&sets, None).expect("the last run");

    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, rows);
    table.assert_no_checkpoint_twice();
    assert_eq!(pyiceberg_ids(warehouse.path()), (0..rows as i64).collect::<Vec<_>>(), "PyIceberg and DuckDB");
    let ident = iceberg::TableIdent::from_strs(["db", "events"]).expect("ident");
    let loaded = sluice_tests::catalog(warehouse.path()).load(&ident).expect("table");
    let metadata = loaded.metadata();
    let snapshots = metadata.snapshots().count();
    assert!((5..=10).contains(&snapshots), "kept 5 and at most 5 more: {snapshots}");
    let head = metadata.current_snapshot().expect("a head");
    let manifests =
        sluice_tests::harness::block(loaded.manifest_list_reader(head).load()).expect("manifest list").entries().len();
    assert!(manifests <= 4, "the head has {manifests} manifests: merged once a group reached 4");
    let folder = Path::new(metadata.location().trim_start_matches("file://")).join("metadata");
    let lists = std::fs::read_dir(&folder)
        .expect("metadata folder")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("snap-"))
        .count();
    for snapshot in metadata.snapshots() {
        let list = snapshot.manifest_list().trim_start_matches("file://");
        assert!(Path::new(list).exists(), "snapshot {} lost its manifest list {list}", snapshot.snapshot_id());
    }
    assert!(lists <= snapshots + 20, "{lists} manifest lists for {snapshots} snapshots: expired ones were deleted");
}
