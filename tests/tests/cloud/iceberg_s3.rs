//! The Iceberg sink with its warehouse on S3 (moto's server on 127.0.0.1)
//! and `job.state_dir` on S3 too; only the SQLite catalog file stays on
//! local disk. The host's catalog writes table metadata through its
//! warehouse storage (`sluice-store`), the plugin writes data files through
//! `file-io` (`sluice-store` again): one store crate, one credential path.
//!
//! - the crash matrix: a crash at each step of the checkpoint protocol, one
//!   checkpoint per step (the same six cases `iceberg.rs` runs on disk),
//!   then a rerun: every row once, by id and value, one snapshot per
//!   checkpoint; read back through iceberg-rust's scan over the host's
//!   catalog storage, and again by PyIceberg with its own S3 FileIO;
//! - the real `sluice` binary running `examples/iceberg-s3.toml`, SIGKILLed
//!   twice mid-job and run again (each rerun takes the S3 lease over once it
//!   expired); then PyIceberg reads the table from S3 with its own S3 FileIO
//!   (pyarrow's S3 filesystem pointed at moto) and every row comes back
//!   once, compared by id and value;
//! - nothing of the table is written to local disk, and a location outside
//!   the warehouse is refused.
//!
//! The host reaches moto through the standard AWS environment
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`), set once for this process and inherited by the
//! `sluice run` processes it starts.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sluice::bindings::CommitOutcome;
use sluice::capability::catalog::CatalogGrant;
use sluice::capability::file_io::StoreConfig;
use sluice::engine::{CrashPoint, Fault};
use sluice::location::{Location, Scheme};
use sluice::source::generator::Generator;
use sluice_store::ObjectStore;
use sluice_tests::harness::{block, buckets, moto};
use sluice_tests::{
    ICEBERG_PLUGIN, TestJob, assert_exactly_once_range, python, read_iceberg_from, read_parquet_tree, sluice_run,
    sort_by_id,
};

const BUCKET: &str = buckets::ICEBERG;
const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
const EVERY: u64 = 500;
const TABLE: &str = "db.events";

/// The bucket, as the test sees it (not through the host).
fn bucket() -> ObjectStore {
    ObjectStore::s3(BUCKET, &moto().s3_options()).expect("bucket")
}

/// Every key under `prefix`.
fn keys(prefix: &str) -> Vec<String> {
    block(bucket().list(prefix)).expect("listing the bucket").into_iter().map(|o| o.key).collect()
}

fn s3(prefix: &str) -> Location {
    Location::ObjectStore { scheme: Scheme::S3, bucket: BUCKET.into(), prefix: prefix.into() }
}

/// The job's catalog, opened as the host opens it (the AWS environment).
fn catalog(database: &Path, warehouse: &str) -> CatalogGrant {
    moto();
    CatalogGrant::open_sql_at("sluice", database, &s3(warehouse), &StoreConfig::default())
        .expect("opening the catalog on the S3 warehouse")
}

/// `--set`s that put a job's warehouse and state on S3 under `prefix`
/// (the SQLite catalog in `dir`).
fn on_s3(dir: &Path, prefix: &str) -> Vec<String> {
    moto();
    vec![
        format!("sink.catalog.warehouse=s3://{BUCKET}/{prefix}/wh"),
        format!("sink.catalog.database={}", dir.join("catalog.db").display()),
        format!("job.state_dir=s3://{BUCKET}/{prefix}/state"),
        "job.lease_secs=2".to_string(),
    ]
}

fn refs(sets: &[String]) -> Vec<&str> {
    sets.iter().map(String::as_str).collect()
}

/// A generator → Iceberg job; `on_s3` moves its warehouse and state.
fn job(id: &str) -> TestJob {
    // The local warehouse these name is replaced by `on_s3`.
    TestJob::iceberg(id, Path::new("/nonexistent-local-warehouse"), TABLE, ROWS, 0, PARALLELISM, EVERY)
}

/// Every file under `dir`, at any depth.
fn local_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path.display().to_string());
            }
        }
    }
    out
}

/// The table's files are in the bucket: its location, its current metadata
/// file and every data file of its current snapshot; no data or metadata
/// file is on local disk.
fn assert_table_in_bucket(table: &iceberg::table::Table, warehouse: &str, job_dir: &Path) {
    let metadata = table.metadata();
    let location = metadata.location().to_string();
    assert!(location.starts_with(&format!("s3://{BUCKET}/{warehouse}/")), "{location}");
    let keys = keys(warehouse);
    let key_of = |url: &str| url.strip_prefix(&format!("s3://{BUCKET}/")).map(str::to_string);
    let current = table.metadata_location().expect("a metadata location");
    let current = key_of(current).unwrap_or_else(|| panic!("metadata {current} is not in the bucket"));
    assert!(keys.contains(&current), "{current} in {keys:?}");
    let data_files = block(async {
        use futures::TryStreamExt;
        let scan = table.scan().select_all().build().expect("scan");
        let tasks: Vec<_> = scan.plan_files().await.expect("plan").try_collect().await.expect("tasks");
        tasks.into_iter().map(|t| t.data_file_path).collect::<Vec<String>>()
    });
    assert!(!data_files.is_empty(), "the table has data files");
    for file in &data_files {
        let key = key_of(file).unwrap_or_else(|| panic!("data file {file} is not in the bucket"));
        assert!(keys.contains(&key), "{key} in the bucket");
    }
    let local: Vec<String> = local_files(job_dir)
        .into_iter()
        .filter(|p| p.ends_with(".parquet") || p.ends_with(".avro") || p.ends_with(".metadata.json"))
        .collect();
    assert!(local.is_empty(), "table files on local disk: {local:?}");
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let id = format!("ice-s3-{point}-{checkpoint}");
    let prefix = id.to_lowercase();
    let job = job(&id);
    let sets = on_s3(job.dir.path(), &prefix);
    let warehouse = format!("{prefix}/wh");
    let read = || read_iceberg_from(&catalog(&job.dir.path().join("catalog.db"), &warehouse), TABLE);
    let restored = sluice_conformance::crash_and_restore(&sluice_conformance::CrashCheck {
        fault: Fault { point, checkpoint, subtask: 1 },
        first_id: 0,
        rows: ROWS,
        run: &|fault| job.run_with(&refs(&sets), fault),
        visible: &|| Ok(sluice_tests::ids(&read().rows)),
        may_not_happen: false,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let table = read();
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    let checkpoints: Vec<u64> = table.commits.iter().filter(|(j, _)| *j == id).map(|(_, c)| *c).collect();
    assert_eq!(checkpoints, vec![1, 2, 3, 4], "one snapshot per non-empty checkpoint");
    let recovered = restored.summary.recovered.clone();
    match point {
        CrashPoint::AfterPersist | CrashPoint::DuringCommit => {
            assert_eq!(recovered, vec![(checkpoint, CommitOutcome::Committed)])
        }
        CrashPoint::AfterCommit => assert_eq!(recovered, vec![(checkpoint, CommitOutcome::AlreadyCommitted)]),
        _ if checkpoint == 1 => assert!(recovered.is_empty(), "nothing was pending: {recovered:?}"),
        _ => assert_eq!(recovered, vec![(checkpoint - 1, CommitOutcome::AlreadyCommitted)]),
    }
    // The state is on S3 too: the run's records are objects there.
    let state = keys(&format!("{prefix}/state"));
    assert!(state.iter().any(|k| k.contains("/checkpoints/")), "checkpoint records in the bucket: {state:?}");
    assert_table_in_bucket(&table.table, &warehouse, job.dir.path());

    // Another reader, with its own S3 client: PyIceberg's S3 FileIO.
    let (v, rows) = read_with_pyiceberg(&job.dir.path().join("catalog.db"), &warehouse, TABLE);
    assert_eq!(v["location"], format!("s3://{BUCKET}/{warehouse}/db/events"), "{v}");
    assert_eq!(v["io"], "PyArrowFileIO", "{v}");
    assert_eq!(v["rows"], ROWS, "{v}");
    assert_exactly_once_range(&rows, 0, ROWS);
    let snapshots: Vec<(String, String)> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    let seen: Vec<&str> = snapshots.iter().filter(|(j, _)| *j == id).map(|(_, c)| c.as_str()).collect();
    assert_eq!(seen, ["1", "2", "3", "4"], "PyIceberg sees one snapshot per non-empty checkpoint: {snapshots:?}");
}

sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 2;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 1;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit: CrashPoint::AfterCommit, 4;
}

/// Commits so far: metadata files of the table beyond the one its creation wrote.
fn commits(metadata_prefix: &str) -> u64 {
    let metadata_files = keys(metadata_prefix).iter().filter(|k| k.ends_with(".metadata.json")).count() as u64;
    metadata_files.saturating_sub(1)
}

/// Starts `sluice run` with `sets` and SIGKILLs it once `progress()`
/// reaches `at_least`; panics if it ended first.
fn run_and_kill(job: &TestJob, sets: &[String], progress: impl Fn() -> u64, at_least: u64) {
    let mut child =
        sluice_run(job, sets).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting sluice");
    let start = Instant::now();
    while progress() < at_least {
        if let Ok(Some(status)) = child.try_wait() {
            let out = child.wait_with_output().expect("reaping sluice");
            panic!("sluice ended ({status}) before it could be killed:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        assert!(start.elapsed() < Duration::from_secs(180), "no progress within 3 minutes");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reaping sluice");
    assert!(!status.success(), "a killed process reported success");
}

/// What PyIceberg reads: the table through `SqlCatalog` on the same SQLite
/// file, its files through PyIceberg's own S3 FileIO (pyarrow's S3
/// filesystem) pointed at moto. It writes the rows it scanned to
/// `out/rows/all.parquet` and prints the snapshots' Sluice properties.
const PYICEBERG_S3: &str = r#"
import sys, json, os
import pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
db, warehouse, endpoint, table, out = sys.argv[1:6]
cat = SqlCatalog('sluice', **{
    'uri': f'sqlite:///{db}',
    'warehouse': warehouse,
    'py-io-impl': 'pyiceberg.io.pyarrow.PyArrowFileIO',
    's3.endpoint': endpoint,
    's3.region': os.environ['AWS_REGION'],
    's3.access-key-id': os.environ['AWS_ACCESS_KEY_ID'],
    's3.secret-access-key': os.environ['AWS_SECRET_ACCESS_KEY'],
})
t = cat.load_table(table)
a = t.scan().to_arrow()
os.makedirs(f'{out}/rows')
pq.write_table(a, f'{out}/rows/all.parquet')
snaps = sorted(t.snapshots(), key=lambda s: s.sequence_number)
print(json.dumps({
    'location': t.location(),
    'io': type(t.io).__name__,
    'rows': a.num_rows,
    'snapshots': [[s.summary.additional_properties.get('sluice.job-id'),
                   s.summary.additional_properties.get('sluice.checkpoint-id')] for s in snaps],
}))
"#;

/// What PyIceberg reads of `table` ([`PYICEBERG_S3`]) from the SQLite
/// catalog `db` and the warehouse `s3://lake/<warehouse>`: its summary, and
/// the rows it scanned, in the generator's types, sorted by id.
fn read_with_pyiceberg(db: &Path, warehouse: &str, table: &str) -> (serde_json::Value, arrow_array::RecordBatch) {
    let scratch = tempfile::tempdir().expect("scratch");
    let read = python(
        PYICEBERG_S3,
        &[
            &db.display().to_string(),
            &format!("s3://{BUCKET}/{warehouse}"),
            &moto().endpoint,
            table,
            &scratch.path().display().to_string(),
        ],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it: pip install -r tests/requirements.txt): {e}"));
    let v: serde_json::Value = serde_json::from_str(read.trim()).expect("json");
    let schema = Generator::schema_ref();
    let rows = sluice_bench::conform(&read_parquet_tree(scratch.path()), &schema).expect("the generator's types");
    (v, sort_by_id(&rows))
}

/// `examples/iceberg-s3.toml` run by the real binary, SIGKILLed twice
/// mid-job and run again to its end; then PyIceberg reads every row once.
#[test]
fn the_s3_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg() {
    const ROWS: u64 = 40_000;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/iceberg-s3.toml");
    let dir = tempfile::tempdir().expect("job dir");
    let toml = std::fs::read_to_string(&example).expect("reading the example");
    std::fs::write(dir.path().join("job.toml"), &toml).expect("job file");
    let job = TestJob { dir, toml };
    let prefix = "example";
    let mut sets = on_s3(job.dir.path(), prefix);
    sets.extend([
        format!("sink.plugin={ICEBERG_PLUGIN}"),
        format!("source.rows={ROWS}"),
        // About 4 s for the whole job: slow enough to be killed mid-way.
        "source.rate=10000.0".to_string(),
        "job.checkpoint.every_rows=1000".to_string(),
    ]);
    let metadata = format!("{prefix}/wh/demo/events/metadata");
    let progress = || commits(&metadata);

    run_and_kill(&job, &sets, progress, 2);
    let first = progress();
    // The rerun waits for the killed run's lease (2 s) to expire, then resumes.
    run_and_kill(&job, &sets, progress, first + 2);
    let out = sluice_run(&job, &sets).output().expect("running sluice");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(&format!("{ROWS} rows in total")) && stdout.contains("attempt 3"), "{stdout}\n{stderr}");

    // PyIceberg, with its own S3 FileIO.
    let (v, rows) = read_with_pyiceberg(&job.dir.path().join("catalog.db"), &format!("{prefix}/wh"), "demo.events");
    assert_eq!(v["location"], format!("s3://{BUCKET}/{prefix}/wh/demo/events"), "{v}");
    assert_eq!(v["io"], "PyArrowFileIO", "{v}");
    assert_eq!(v["rows"], ROWS, "{v}");
    let snapshots: Vec<(String, String)> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    let mut seen: Vec<&String> = snapshots.iter().map(|(_, c)| c).collect();
    seen.dedup();
    assert_eq!(seen.len(), snapshots.len(), "no checkpoint committed twice: {snapshots:?}");
    assert!(snapshots.iter().all(|(j, _)| j == "iceberg-s3-demo"), "{snapshots:?}");

    // Every row PyIceberg read, by id and value.
    assert_exactly_once_range(&rows, 0, ROWS);

    let table = read_iceberg_from(&catalog(&job.dir.path().join("catalog.db"), &format!("{prefix}/wh")), "demo.events");
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert_table_in_bucket(&table.table, &format!("{prefix}/wh"), job.dir.path());
}

/// The catalog's storage writes nowhere but its warehouse: a table whose
/// location a commit moved outside it cannot have metadata written there.
#[test]
fn the_catalog_writes_nothing_outside_its_warehouse() {
    use iceberg::io::Storage;
    use sluice::capability::catalog_storage::WarehouseStorage;
    moto();
    let storage = WarehouseStorage::open(s3("guarded/wh"), &StoreConfig::default()).expect("storage");
    block(async {
        let inside = format!("s3://{BUCKET}/guarded/wh/t/metadata/1.json");
        storage.write(&inside, "{}".into()).await.expect("inside");
        for outside in ["guarded/wh-other/m.json", "guarded/m.json", "guarded/wh/../m.json"] {
            let outside = format!("s3://{BUCKET}/{outside}");
            let err = storage.write(&outside, "{}".into()).await.expect_err(&outside);
            assert!(err.to_string().contains(&outside), "{err}");
        }
        assert_eq!(storage.read(&inside).await.expect("read"), "{}");
    });
    assert_eq!(keys("guarded"), ["guarded/wh/t/metadata/1.json"]);
}

/// A warehouse in a missing bucket stops the run before the catalog is
/// created, naming the key and the bucket.
#[test]
fn a_warehouse_in_a_missing_bucket_is_refused_before_the_catalog_is_made() {
    moto();
    let job = job("ice-s3-nobucket");
    let db = job.dir.path().join("db/catalog.db");
    let sets = [
        "sink.catalog.warehouse=s3://no-such-bucket/wh".to_string(),
        format!("sink.catalog.database={}", db.display()),
    ];
    let err = job.run_with(&refs(&sets), None).expect_err("refused");
    let message = err.to_string();
    assert!(
        message.contains("sink.catalog.warehouse")
            && message.contains("s3://no-such-bucket/wh")
            && message.contains("cannot be listed"),
        "{message}"
    );
    assert!(!db.parent().expect("db dir").exists(), "no catalog was made");
}
