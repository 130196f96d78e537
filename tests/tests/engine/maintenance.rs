//! `sluice maintain` on Iceberg tables (contract 0.2.2's `maintenance`
//! export): compaction, snapshot expiry and orphan cleanup, read back by
//! PyIceberg, DuckDB and iceberg-rust, and a job resumed after it.
//!
//! DuckDB reads the live data files that PyIceberg's scan plans (its
//! `iceberg_scan` extension is downloaded at run time, which the test
//! machines cannot do).

use std::path::{Path, PathBuf};
use std::time::Duration;

use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::maintain::{MaintainOptions, MaintainReport};
use sluice::engine::{CrashPoint, Fault};
use sluice::fault::{CatalogFaults, CommitFault, Faults};
use sluice_tests::harness::{buckets, moto};
use sluice_tests::{ICEBERG_PLUGIN, TestJob, assert_exactly_once, python, read_iceberg, run_cli};

/// A generator → Iceberg job partitioned by day (30 days), one writer, a
/// checkpoint every `every_rows` rows.
fn job(id: &str, warehouse: &Path, rows: u64, every_rows: u64) -> TestJob {
    job_from(id, warehouse, rows, every_rows, 0)
}

/// [`job`], its ids starting at `first_id` (another job beside it on the table).
fn job_from(id: &str, warehouse: &Path, rows: u64, every_rows: u64, first_id: u64) -> TestJob {
    let warehouse = warehouse.display();
    let sink = format!(
        r#"[sink]
id = "lake"
plugin = "{ICEBERG_PLUGIN}"
[sink.options]
table = "db.events"
partition_by = "day(day)"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let toml = sluice_bench::generator_job_toml(id, 1, every_rows, rows, first_id, every_rows, &sink);
    TestJob { dir, toml }
}

/// Live data files per partition, and the rows as `[id, amount]` sorted by
/// id, read by PyIceberg; and the same rows read by DuckDB from the files.
/// Rows as `(id, amount)`, sorted by id.
type Rows = Vec<(i64, String)>;

fn read_back(warehouse: &Path) -> (Vec<usize>, Rows, Rows) {
    let out = python(
        "import sys, json, collections, duckdb\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         t = cat.load_table('db.events')\n\
         tasks = list(t.scan().plan_files())\n\
         per = collections.Counter(str(task.file.partition) for task in tasks)\n\
         a = t.scan(selected_fields=('id', 'amount')).to_arrow()\n\
         rows = sorted(zip(a.column('id').to_pylist(), [str(x) for x in a.column('amount').to_pylist()]))\n\
         files = [task.file.file_path.removeprefix('file://') for task in tasks]\n\
         d = duckdb.sql(f\"select id, cast(amount as varchar) from read_parquet({files!r}) order by id\").fetchall()\n\
         print(json.dumps({'per': sorted(per.values()), 'rows': rows, 'duck': d}))",
        &[&warehouse.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("PyIceberg or DuckDB failed: {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let per: Vec<usize> = serde_json::from_value(v["per"].clone()).expect("per");
    let rows: Rows = serde_json::from_value(v["rows"].clone()).expect("rows");
    let duck: Rows = serde_json::from_value(v["duck"].clone()).expect("duck");
    (per, rows, duck)
}

fn maintain(job: &TestJob, args: &[&str]) -> String {
    let path = job.path();
    let path = path.display().to_string();
    let mut all = vec!["maintain", path.as_str()];
    all.extend_from_slice(args);
    let (code, out, err) = run_cli(&all, job.dir.path());
    assert_eq!(code, 0, "sluice maintain failed:\n{out}\n{err}");
    out
}

/// Data files (not metadata) under the table's location.
fn data_files(warehouse: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = vec![warehouse.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                out.push(path.display().to_string());
            }
        }
    }
    out.sort();
    out
}

#[test]
fn compaction_after_200_checkpoints_over_30_partitions_keeps_every_row() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    // 200 checkpoints of 60 rows; each touches 30 day partitions.
    let rows = 200 * 60;
    let job = job("maint-200", warehouse.path(), rows, 60);
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.last_committed, Some(200), "{summary}");
    let (per_before, rows_before, duck_before) = read_back(warehouse.path());
    assert_eq!(per_before.len(), 30);
    assert!(per_before.iter().all(|n| *n >= 100), "{per_before:?}");
    assert_eq!(rows_before.len() as u64, rows);
    assert_eq!(rows_before, duck_before);

    let out = maintain(&job, &["--target-file-mb", "128"]);
    assert!(out.contains("table db.events: compacted 6000 file(s)"), "{out}");
    let (per_after, rows_after, duck_after) = read_back(warehouse.path());
    assert_eq!(per_after.len(), 30);
    assert!(per_after.iter().all(|n| *n <= 2), "live files per partition after compaction: {per_after:?}");
    assert_eq!(rows_after, rows_before, "PyIceberg reads other rows after compaction");
    assert_eq!(duck_after, rows_before, "DuckDB reads other rows after compaction");

    // Expiry and orphan cleanup: the replaced files go, the rows stay, and
    // the job resumed after it stays exactly once.
    let before = data_files(warehouse.path()).len();
    let out = maintain(&job, &["--no-compact", "--keep-last", "1", "--remove-orphans-older-than", "0s"]);
    assert!(out.contains("expired 200 snapshot(s)"), "{out}");
    let after = data_files(warehouse.path()).len();
    assert!(after <= 60 && after < before, "data files on disk: {before} → {after}");
    let (_, rows_expired, duck_expired) = read_back(warehouse.path());
    assert_eq!(rows_expired, rows_before);
    assert_eq!(duck_expired, rows_before);
    // A rerun after maintenance finds every checkpoint committed (the
    // watermarks survived expiry) and lands nothing twice.
    let rerun = job.run(None).expect("reruns after maintenance");
    assert_eq!(rerun.rows_this_run, 0, "{rerun}");
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once(&table.rows, rows);
}

/// Orphan cleanup with a persisted, uncommitted checkpoint on disk: its
/// files survive and the next run commits them; expiry between the crash
/// and the recovery changes nothing of that.
#[test]
fn orphan_cleanup_spares_a_pending_checkpoint_and_recovery_commits_it() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 20 * 60;
    let job = job("maint-pending", warehouse.path(), rows, 60);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 5, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let on_disk = data_files(warehouse.path());
    let committed: std::collections::BTreeSet<String> = {
        let table = read_iceberg(warehouse.path(), "db.events");
        assert_eq!(table.rows.num_rows(), 4 * 60, "checkpoints 1-4 are visible");
        let out = python(
            "import sys, json\n\
             from pyiceberg.catalog.sql import SqlCatalog\n\
             w = sys.argv[1]\n\
             t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table('db.events')\n\
             print(json.dumps([x.file.file_path.removeprefix('file://') for x in t.scan().plan_files()]))",
            &[&warehouse.path().display().to_string()],
        )
        .expect("pyiceberg");
        serde_json::from_str::<Vec<String>>(out.trim()).expect("json").into_iter().collect()
    };
    let pending: Vec<&String> = on_disk.iter().filter(|f| !committed.contains(*f)).collect();
    assert!(!pending.is_empty(), "checkpoint 5's files are on disk, not yet in the table");

    let out = maintain(&job, &["--keep-last", "1", "--remove-orphans-older-than", "0s"]);
    for file in &pending {
        assert!(Path::new(file.as_str()).exists(), "orphan cleanup removed {file} of the pending checkpoint:\n{out}");
    }
    // A file no checkpoint names is removed.
    let data_dir = Path::new(on_disk[0].as_str()).parent().expect("a data file's folder").to_path_buf();
    let stray = data_dir.join("stray.parquet");
    std::fs::write(&stray, b"not referenced").expect("stray file");
    let dry = maintain(&job, &["--no-compact", "--remove-orphans-older-than", "0s", "--dry-run"]);
    assert!(dry.contains("would remove") && dry.contains("stray.parquet"), "{dry}");
    assert!(stray.exists(), "a dry run removes nothing");
    // While a run holds the state directory, a short retention is refused.
    {
        let _held = sluice::engine::checkpoint::CheckpointStore::open(&job.state(), "maint-orphans", 10)
            .expect("the state directory locks");
        let path = job.path().display().to_string();
        let (code, _, err) =
            run_cli(&["maintain", &path, "--no-compact", "--remove-orphans-older-than", "0s"], job.dir.path());
        assert_ne!(code, 0);
        assert!(err.contains("is too short while job") && err.contains("use at least 1h"), "{err}");
        assert!(stray.exists(), "the refused cleanup removed nothing");
    }
    maintain(&job, &["--no-compact", "--remove-orphans-older-than", "0s"]);
    assert!(!stray.exists(), "the stray file was removed");

    let summary = job.run(None).expect("recovers");
    assert_eq!(summary.recovered.first().map(|(c, _)| *c), Some(5), "{summary}");
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once(&table.rows, rows);
}

/// A plugin without the export (the files sink answers that it keeps no
/// tables) is refused with a clear message, and nothing changes.
#[test]
fn a_sink_without_tables_to_maintain_is_refused() {
    let job = TestJob::files("maint-files", 100, 1, 50);
    std::fs::write(job.path(), &job.toml).expect("job file");
    let path = job.path().display().to_string();
    let (code, _, err) = run_cli(&["maintain", &path], job.dir.path());
    assert_ne!(code, 0);
    assert!(err.contains("keeps no tables to maintain"), "{err}");
}

/// `sluice maintain` in this process, with `faults` injected.
fn maintain_with(job: &TestJob, faults: Faults) -> Result<MaintainReport, sluice::engine::EngineError> {
    let loaded = job.load(&[]).expect("the job loads");
    let opts = MaintainOptions {
        compact: true,
        target_file_bytes: 128 * 1024 * 1024,
        timeout: Duration::from_secs(600),
        faults,
        ..MaintainOptions::default()
    };
    sluice::engine::maintain::maintain(&loaded, sluice_tests::host(), &opts)
}

fn catalog_faults(faults: Vec<(u64, CommitFault)>) -> Faults {
    Faults { catalog: CatalogFaults { faults, ..CatalogFaults::default() }, ..Faults::default() }
}

/// The operations of the table's snapshots, oldest first, by PyIceberg.
fn operations(warehouse: &Path, table: &str) -> Vec<String> {
    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         print(json.dumps([s.summary.operation.value for s in t.snapshots()]))",
        &[&warehouse.display().to_string(), table],
    )
    .expect("pyiceberg");
    serde_json::from_str(out.trim()).expect("json")
}

/// A crash right after the replace snapshot reached the catalog, a lost
/// reply and a conflict with another writer, each inside compaction's
/// commit: the rows stay as they were, the replace lands at most once, and
/// the next `maintain` (the recovery) finds the table compacted, or
/// compacts it.
#[test]
fn faults_inside_compactions_commit_then_recovery() {
    for (name, fault) in
        [("crash", CommitFault::CrashAfterApply), ("lost", CommitFault::LoseReply), ("conflict", CommitFault::Conflict)]
    {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let rows = 30 * 60;
        let job = job(&format!("maint-fault-{name}"), warehouse.path(), rows, 60);
        job.run(None).expect("runs");
        let (per_before, rows_before, _) = read_back(warehouse.path());
        assert!(per_before.iter().all(|n| *n >= 15), "{per_before:?}");

        let first = maintain_with(&job, catalog_faults(vec![(1, fault)]));
        match fault {
            CommitFault::CrashAfterApply => {
                let e = first.expect_err("the injected crash stops maintain");
                assert!(e.is_injected_crash(), "{e}");
            }
            _ => {
                let report = first.unwrap_or_else(|e| panic!("{name}: maintain settles the fault itself: {e}"));
                assert_eq!(report.tables[0].files_compacted, 900, "{name}: {report}");
            }
        }
        // The crash applied the replace: what is live is compacted, once.
        let (per_mid, rows_mid, duck_mid) = read_back(warehouse.path());
        assert_eq!(rows_mid, rows_before, "{name}: the rows changed");
        assert_eq!(duck_mid, rows_before, "{name}: DuckDB reads other rows");
        assert!(per_mid.iter().all(|n| *n <= 2), "{name}: {per_mid:?}");
        let ops = operations(warehouse.path(), "db.events");
        assert_eq!(ops.iter().filter(|o| *o == "replace").count(), 1, "{name}: one replace snapshot: {ops:?}");

        // Recovery: maintain again has nothing left to compact.
        let again = maintain_with(&job, Faults::default()).expect("maintain again");
        assert_eq!(again.tables[0].files_compacted, 0, "{name}: {again}");
        let (_, rows_after, _) = read_back(warehouse.path());
        assert_eq!(rows_after, rows_before, "{name}");
        let rerun = job.run(None).expect("reruns");
        assert_eq!(rerun.rows_this_run, 0, "{rerun}");
        assert_exactly_once(&read_iceberg(warehouse.path(), "db.events").rows, rows);
    }
}

/// Compaction across a schema evolution (`qty` widened, `tag` added
/// halfway, a table created late): old files read the added column as null
/// before and after, every row and value is unchanged, by PyIceberg and
/// iceberg-rust.
#[test]
fn compaction_across_a_schema_evolution_keeps_rows_and_nulls() {
    use sluice::source::generator::Generator;
    use sluice_tests::tables::{TABLES, assert_table, sets};
    const ROWS: u64 = 6000;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("maint-evolved", warehouse.path(), "lake.{table}", ROWS, 0, 3, 250);
    let sets = sets(ROWS);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    job.run_with(&sets, None).expect("runs");
    let read = || {
        python(
            "import sys, json\n\
             from pyiceberg.catalog.sql import SqlCatalog\n\
             w = sys.argv[1]\n\
             cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
             out = {}\n\
             for name in ['orders', 'users', 'events']:\n\
             \x20   t = cat.load_table(f'lake.{name}')\n\
             \x20   a = t.scan().to_arrow().sort_by('id')\n\
             \x20   out[name] = {'files': len(list(t.scan().plan_files())),\n\
             \x20                'schema': [f'{f.field_id}:{f.name}:{f.field_type}' for f in t.schema().fields],\n\
             \x20                'rows': [[r['id'], r['qty'], r['tag']] for r in a.select(['id', 'qty', 'tag']).to_pylist()]}\n\
             print(json.dumps(out))",
            &[&warehouse.path().display().to_string()],
        )
        .map(|out| serde_json::from_str::<serde_json::Value>(out.trim()).expect("json"))
        .unwrap_or_else(|e| panic!("PyIceberg failed: {e}"))
    };
    let before = read();
    let report = maintain_with(&job, Faults::default()).expect("maintain");
    assert_eq!(report.tables.len(), 3, "{report}");
    let after = read();
    for table in TABLES {
        let (b, a) = (&before[table], &after[table]);
        assert!(b["files"].as_u64().expect("files") > 5, "{table}: {b}");
        assert!(a["files"].as_u64().expect("files") <= 1, "{table}: {} files after compaction", a["files"]);
        assert_eq!(a["schema"], b["schema"], "{table}: the schema changed");
        assert_eq!(a["rows"], b["rows"], "{table}: rows or values changed");
        let rows = a["rows"].as_array().expect("rows");
        let old_tags = rows.iter().filter(|r| r[0].as_u64() < Some(ROWS / 2) && !r[2].is_null()).count();
        assert_eq!(old_tags, 0, "{table}: rows from before the change read null in `tag`");
    }
    let catalog = sluice_tests::catalog(warehouse.path());
    let target = Generator::evolved_schema();
    for (t, table) in TABLES.iter().enumerate() {
        let read = sluice_tests::read_iceberg_as(&catalog, &format!("lake.{table}"), &target);
        assert_table(&read.rows, ROWS, t);
    }
}

/// `[sink.maintenance]` in a running job: passes compact the table while
/// checkpoints keep committing, every row lands once, and a plugin that
/// cannot maintain is refused before anything is written.
#[test]
fn a_running_job_compacts_between_its_checkpoints() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 120 * 60;
    let mut job = job("maint-running", warehouse.path(), rows, 60);
    // About 4 s of rows; a pass every 300 ms.
    job.toml = job.toml.replace("batch_rows = 60", "batch_rows = 60\nrate = 1800.0")
        + "[sink.maintenance]\ncompact_every = \"300ms\"\nexpire_older_than = \"1ms\"\nkeep_last = 5\n";
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.last_committed, Some(120), "{summary}");
    let ops = operations(warehouse.path(), "db.events");
    assert!(ops.iter().any(|o| o == "replace"), "no pass compacted: {ops:?}");
    assert!(ops.len() < 121, "no pass expired snapshots: {} snapshots", ops.len());
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once(&table.rows, rows);
    let (per, rows_read, duck) = read_back(warehouse.path());
    assert_eq!(rows_read.len() as u64, rows);
    assert_eq!(duck, rows_read);
    assert!(per.iter().all(|n| *n < 120), "{per:?}");

    let files = TestJob::files("maint-running-files", 100, 1, 50);
    let files = TestJob { toml: files.toml + "[sink.maintenance]\ncompact_every = \"1m\"\n", dir: files.dir };
    let e = files.run(None).expect_err("refused");
    assert!(e.to_string().contains("keeps no tables to maintain"), "{e}");
    assert!(!files.state().exists(), "the refused job wrote its state directory");
}

/// `[sink.maintenance]` refuses an orphan retention a running job's own
/// writers could fall under.
#[test]
fn a_running_job_refuses_a_short_orphan_retention() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let mut job = job("maint-short", warehouse.path(), 100, 50);
    job.toml += "[sink.maintenance]\ncompact_every = \"10m\"\nremove_orphans_older_than = \"5m\"\n";
    // Rows alone bound no round's length: no retention is safe.
    let e = job.load(&[]).expect_err("refused");
    let message = e.to_string();
    assert!(
        message.contains("sink.maintenance.remove_orphans_older_than")
            && message.contains("needs job.checkpoint.interval_secs"),
        "{message}"
    );
    let e = job.load(&["job.checkpoint.interval_secs=60"]).expect_err("refused");
    let message = e.to_string();
    assert!(message.contains("5m is too short") && message.contains("at least 1h"), "{message}");
    // Three intervals of 30 minutes, or a pass's timeout of 2h, ask for more.
    let e = job.load(&["job.checkpoint.interval_secs=1800"]).expect_err("refused");
    assert!(e.to_string().contains("at least 1h 30m"), "{e}");
    let e = job
        .load(&[
            "job.checkpoint.interval_secs=60",
            "sink.maintenance.timeout=\"2h\"",
            "sink.maintenance.remove_orphans_older_than=\"1h\"",
        ])
        .expect_err("refused");
    assert!(e.to_string().contains("at least 2h"), "{e}");
    job.load(&["job.checkpoint.interval_secs=60", "sink.maintenance.remove_orphans_older_than=\"1h\""])
        .expect("1h is enough");
    assert!(!job.state().exists());
}

/// The data files PyIceberg's full scan plans (the live ones), and every id
/// that scan reads, sorted; DuckDB's `iceberg_scan` must read the same ids.
fn pyiceberg_scan(warehouse: &Path) -> (std::collections::BTreeSet<String>, Vec<i64>) {
    let script = format!(
        "{}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table('db.events')\n\
         files = [x.file.file_path.removeprefix('file://') for x in t.scan().plan_files()]\n\
         ids = sorted(t.scan(selected_fields=('id',)).to_arrow().column('id').to_pylist())\n\
         assert duckdb_ids(t.metadata_location) == ids, 'DuckDB iceberg_scan reads other ids than PyIceberg'\n\
         print(json.dumps({{'files': files, 'ids': ids}}))",
        sluice_tests::DUCKDB_ICEBERG
    );
    let out = python(&script, &[&warehouse.display().to_string()])
        .unwrap_or_else(|e| panic!("PyIceberg's (and DuckDB's) full scan failed: {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    (serde_json::from_value(v["files"].clone()).expect("files"), serde_json::from_value(v["ids"].clone()).expect("ids"))
}

/// Jobs A and B write one table; B is killed after persisting its third
/// checkpoint, whose files are on disk and in no snapshot. Returns (A, B,
/// B's pending files, a stray unreferenced file).
fn two_writers_b_pending(warehouse: &Path, prefix: &str, rows: u64) -> (TestJob, TestJob, Vec<String>, PathBuf) {
    two_writers_b_pending_at(warehouse, prefix, rows, 3)
}

/// [`two_writers_b_pending`], B killed after persisting checkpoint `at`
/// (1: B has never committed to the table, so no property names it).
fn two_writers_b_pending_at(
    warehouse: &Path,
    prefix: &str,
    rows: u64,
    at: u64,
) -> (TestJob, TestJob, Vec<String>, PathBuf) {
    let a = job_from(&format!("{prefix}-a"), warehouse, rows, 60, 0);
    let b = job_from(&format!("{prefix}-b"), warehouse, rows, 60, rows);
    a.run(None).expect("A runs");
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: at, subtask: 0 };
    assert!(b.run(Some(crash)).expect_err("B crashes").is_injected_crash());
    let (live, ids) = pyiceberg_scan(warehouse);
    assert_eq!(ids.len() as u64, rows + (at - 1) * 60, "A's rows and B's checkpoints before {at} are visible");
    let pending: Vec<String> = data_files(warehouse)
        .into_iter()
        .filter(|f| !live.contains(f) && f.contains(&format!("{prefix}-b.")))
        .collect();
    assert!(!pending.is_empty(), "B's checkpoint 3 has files on disk, not yet in the table");
    let data_dir = Path::new(pending[0].as_str()).parent().expect("a data file's folder").to_path_buf();
    let stray = data_dir.join("stray.parquet");
    std::fs::write(&stray, b"not referenced").expect("stray file");
    (a, b, pending, stray)
}

/// `sluice maintain` that must succeed: its stdout and stderr.
fn maintain_out_err(job: &TestJob, args: &[&str]) -> (String, String) {
    let path = job.path().display().to_string();
    let mut all = vec!["maintain", path.as_str()];
    all.extend_from_slice(args);
    let (code, out, err) = run_cli(&all, job.dir.path());
    assert_eq!(code, 0, "sluice maintain failed:\n{out}\n{err}");
    (out, err)
}

/// Orphan cleanup run as job A without `--protect B.toml`, beside job B
/// killed with a persisted, uncommitted checkpoint: the table names B, so
/// every file younger than the 3-day floor stays (B's pending ones and a
/// stray one), and the report names B. With B protected the retention
/// asked for applies (the stray file goes, B's stay) and the report does
/// not ask for the file that was given. B then recovers; PyIceberg's full
/// scan reads every id once.
#[test]
fn orphan_cleanup_without_protect_keeps_the_floor_beside_a_killed_job() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 600;
    let (a, b, pending, stray) = two_writers_b_pending(warehouse.path(), "maint-2w", rows);

    let (out, err) = maintain_out_err(&a, &["--no-compact", "--remove-orphans-older-than", "0s"]);
    for file in &pending {
        assert!(Path::new(file.as_str()).exists(), "orphan cleanup removed {file} of B's pending checkpoint:\n{out}");
    }
    assert!(stray.exists(), "the floor keeps every young file, the stray one too:\n{out}");
    assert!(
        out.contains("kept every file younger than 3days (the floor)") && out.contains("maint-2w-b.lake"),
        "the report names B and the floor:\n{out}"
    );
    assert!(err.contains("orphan cleanup keeps every file younger than 3days"), "{err}");
    assert!(!out.contains("other writers named by the table"), "the plugin's own note is not shown:\n{out}");

    let b_file = b.path().display().to_string();
    let (out, _) = maintain_out_err(&a, &["--no-compact", "--remove-orphans-older-than", "0s", "--protect", &b_file]);
    assert!(!stray.exists(), "with B protected the retention asked for applies:\n{out}");
    for file in &pending {
        assert!(Path::new(file.as_str()).exists(), "orphan cleanup removed {file} of protected B:\n{out}");
    }
    assert!(!out.contains("floor") && !out.contains("protected only if"), "B was given:\n{out}");

    let summary = b.run(None).expect("B recovers");
    assert_eq!(summary.recovered.first().map(|(c, _)| *c), Some(3), "{summary}");
    let (_, ids) = pyiceberg_scan(warehouse.path());
    let want: Vec<i64> = (0..2 * rows as i64).collect();
    assert!(ids == want, "ids read by PyIceberg: {} of {}, not each once", ids.len(), want.len());
    assert_exactly_once(&read_iceberg(warehouse.path(), "db.events").rows, 2 * rows);
}

/// Job B killed after persisting its first checkpoint has committed
/// nothing: no table property names it, only the names of its files. Orphan
/// cleanup as A without `--protect` still keeps the floor and names B; B
/// then recovers, and every id reads once.
#[test]
fn orphan_cleanup_keeps_the_files_of_a_job_that_never_committed() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 300;
    let (a, b, pending, stray) = two_writers_b_pending_at(warehouse.path(), "maint-first", rows, 1);
    let (out, _) = maintain_out_err(&a, &["--no-compact", "--remove-orphans-older-than", "0s"]);
    for file in &pending {
        assert!(Path::new(file.as_str()).exists(), "orphan cleanup removed {file} of B's first checkpoint:\n{out}");
    }
    assert!(stray.exists(), "the floor keeps every young file:\n{out}");
    assert!(out.contains("maint-first-b.lake"), "the report names B by its files:\n{out}");
    let summary = b.run(None).expect("B recovers");
    assert_eq!(summary.recovered.first().map(|(c, _)| *c), Some(1), "{summary}");
    let (_, ids) = pyiceberg_scan(warehouse.path());
    let want: Vec<i64> = (0..2 * rows as i64).collect();
    assert!(ids == want, "ids read by PyIceberg: {} of {}, not each once", ids.len(), want.len());
}

/// `--force` lowers the floor beside job B killed with a pending
/// checkpoint: the warning names the risk and B, and the risk is real: B's
/// pending files are gone (B's recovery would now commit missing files, so
/// it is not run; the table as committed still reads whole).
#[test]
fn orphan_cleanup_forced_below_the_floor_warns_and_removes_a_killed_jobs_pending_files() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 300;
    let (a, _b, pending, stray) = two_writers_b_pending(warehouse.path(), "maint-force", rows);
    let (out, err) = maintain_out_err(&a, &["--no-compact", "--remove-orphans-older-than", "0s", "--force"]);
    assert!(
        err.contains("--force: orphan cleanup removes files down to 0s, below the floor of 3days")
            && err.contains("maint-force-b.lake"),
        "{err}"
    );
    assert!(out.contains("--force: orphan cleanup went down to 0s") && out.contains("maint-force-b.lake"), "{out}");
    assert!(!stray.exists(), "{out}");
    for file in &pending {
        assert!(!Path::new(file.as_str()).exists(), "--force kept {file}:\n{out}");
    }
    let (_, ids) = pyiceberg_scan(warehouse.path());
    assert_eq!(ids.len() as u64, rows + 2 * 60, "what is committed still reads whole");
}

const S3_BUCKET: &str = buckets::MAINTENANCE;

/// A job whose state directory is on S3 (moto): a short orphan retention is
/// refused while a run holds its lease, and while the lease cannot be read
/// (fails closed); once the lease is released it is accepted.
#[test]
fn a_short_orphan_retention_is_refused_while_a_run_holds_an_s3_lease() {
    let moto = moto();
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("maint-s3", warehouse.path(), 120, 60);
    let sets = [format!("job.state_dir=s3://{S3_BUCKET}/maint-s3"), "job.lease_secs=30".to_string()];
    let set_refs: Vec<&str> = sets.iter().map(String::as_str).collect();
    let summary = job.run_with(&set_refs, None).expect("runs with its state on S3");
    assert_eq!(summary.last_committed, Some(2), "{summary}");
    let data_dir = data_files(warehouse.path())
        .first()
        .and_then(|f| Path::new(f).parent().map(Path::to_path_buf))
        .expect("a data file's folder");
    let stray = data_dir.join("stray.parquet");
    std::fs::write(&stray, b"not referenced").expect("stray file");
    let path = job.path().display().to_string();
    let mut args = vec!["maintain", path.as_str()];
    for set in &sets {
        args.extend(["--set", set.as_str()]);
    }
    args.extend(["--no-compact", "--remove-orphans-older-than", "0s"]);

    let loaded = job.load(&set_refs).expect("loads");
    let held =
        CheckpointStore::open_at(&loaded.state, &loaded.spec.job.id, 10, Duration::from_secs(30), &loaded.state_stores)
            .expect("takes the lease");
    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_ne!(code, 0, "accepted beside a live lease:\n{out}");
    assert!(err.contains("is too short while job \"maint-s3\" runs") && err.contains("holds its lease"), "{err}");
    assert!(stray.exists(), "the refused cleanup removed nothing");
    drop(held);

    // Released now, but its lease cannot be read: refused all the same.
    moto.fail_requests("GET", "/maint-s3/lease", 0, 1);
    let (code, out, err) = run_cli(&args, job.dir.path());
    moto.fail_requests("GET", "/maint-s3/lease", 0, 0);
    assert_ne!(code, 0, "accepted though the lease could not be read:\n{out}");
    assert!(err.contains("cannot tell whether a run of job \"maint-s3\" holds its state directory"), "{err}");
    assert!(stray.exists(), "the refused cleanup removed nothing");

    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 0, "refused once the lease was released:\n{out}\n{err}");
    assert!(!stray.exists(), "the stray file was removed:\n{out}");
    assert_exactly_once(&read_iceberg(warehouse.path(), "db.events").rows, 120);
}
