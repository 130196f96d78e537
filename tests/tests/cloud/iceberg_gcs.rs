//! The Iceberg sink with its warehouse on GCS (fake-gcs-server on
//! 127.0.0.1) and `job.state_dir` on GCS too; only the SQLite catalog file
//! stays on local disk. `iceberg_s3.rs` again, on the other store:
//!
//! - the crash matrix: a crash at each step of the checkpoint protocol, then
//!   a rerun: every row once, by id and value, one snapshot per checkpoint;
//! - the real `sluice` binary running `examples/iceberg-gcs.toml`, SIGKILLed
//!   twice mid-job and run again; then PyIceberg reads the table from GCS
//!   with its own GCS FileIO (pyarrow's) and every row comes back once;
//! - a REST catalog (the test double) whose warehouse is on GCS: it writes
//!   the metadata, the plugin the data files, through a crash and a rerun;
//! - a data file larger than one upload part, so the plugin's exclusive
//!   `output-file` goes through the claim and the resumable upload
//!   (`store/src/gcs.rs`), read back whole.
//!
//! The host reaches the server as Google's client libraries reach an
//! emulator, through `STORAGE_EMULATOR_HOST` (unsigned requests), set once
//! for this process and inherited by the `sluice run` processes it starts.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sluice::bindings::CommitOutcome;
use sluice::capability::catalog::CatalogGrant;
use sluice::capability::catalog_storage::{WarehouseStorage, WarehouseStorageFactory};
use sluice::capability::file_io::StoreConfig;
use sluice::engine::{CrashPoint, Fault};
use sluice::location::{Location, Scheme};
use sluice::source::generator::Generator;
use sluice_store::{DEFAULT_PART_SIZE, GcsOptions, ObjectStore};
use sluice_tests::harness::{block, buckets, gcs};
use sluice_tests::rest_catalog::RestCatalogDouble;
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
    let options = GcsOptions { endpoint: Some(gcs().endpoint.clone()), anonymous: true };
    ObjectStore::gcs(BUCKET, &options).expect("bucket")
}

fn gs(prefix: &str) -> Location {
    Location::ObjectStore { scheme: Scheme::Gs, bucket: BUCKET.into(), prefix: prefix.into() }
}

/// The job's catalog, opened as the host opens it (`STORAGE_EMULATOR_HOST`).
fn catalog(database: &Path, warehouse: &str) -> CatalogGrant {
    gcs();
    CatalogGrant::open_sql_at("sluice", database, &gs(warehouse), &StoreConfig::default())
        .expect("opening the catalog on the GCS warehouse")
}

/// `--set`s that put a job's warehouse and state on GCS under `prefix`
/// (the SQLite catalog in `dir`).
fn on_gcs(dir: &Path, prefix: &str) -> Vec<String> {
    gcs();
    vec![
        format!("sink.catalog.warehouse=gs://{BUCKET}/{prefix}/wh"),
        format!("sink.catalog.database={}", dir.join("catalog.db").display()),
        format!("job.state_dir=gs://{BUCKET}/{prefix}/state"),
        "job.lease_secs=2".to_string(),
    ]
}

fn refs(sets: &[String]) -> Vec<&str> {
    sets.iter().map(String::as_str).collect()
}

/// A generator → Iceberg job; `on_gcs` moves its warehouse and state.
fn job(id: &str, rows: u64, parallelism: u32, every: u64) -> TestJob {
    // The local warehouse these name is replaced by `on_gcs`.
    TestJob::iceberg(id, Path::new("/nonexistent-local-warehouse"), TABLE, rows, 0, parallelism, every)
}

/// The data files of the table's current snapshot, each with its size in
/// the bucket; asserts the table's location and metadata are there and
/// that no table file is on local disk.
fn files_in_bucket(table: &iceberg::table::Table, warehouse: &str, job_dir: &Path) -> Vec<(String, u64)> {
    let location = table.metadata().location().to_string();
    assert!(location.starts_with(&format!("gs://{BUCKET}/{warehouse}/")), "{location}");
    let listed = block(bucket().list(warehouse)).expect("listing the bucket");
    let size = |url: &str| {
        let key = url.strip_prefix(&format!("gs://{BUCKET}/")).unwrap_or_else(|| panic!("{url} is not in the bucket"));
        listed.iter().find(|o| o.key == key).map(|o| o.size).unwrap_or_else(|| panic!("{key} is not in the bucket"))
    };
    size(table.metadata_location().expect("a metadata location"));
    let data_files = block(async {
        use futures::TryStreamExt;
        let scan = table.scan().select_all().build().expect("scan");
        let tasks: Vec<_> = scan.plan_files().await.expect("plan").try_collect().await.expect("tasks");
        tasks.into_iter().map(|t| t.data_file_path).collect::<Vec<String>>()
    });
    assert!(!data_files.is_empty(), "the table has data files");
    let local = walk(job_dir)
        .into_iter()
        .filter(|p| p.ends_with(".parquet") || p.ends_with(".avro") || p.ends_with(".metadata.json"))
        .collect::<Vec<_>>();
    assert!(local.is_empty(), "table files on local disk: {local:?}");
    data_files.into_iter().map(|f| (f.clone(), size(&f))).collect()
}

fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() { stack.push(path) } else { out.push(path.display().to_string()) }
        }
    }
    out
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let id = format!("ice-gcs-{point}-{checkpoint}");
    let prefix = id.to_lowercase();
    let job = job(&id, ROWS, PARALLELISM, EVERY);
    let sets = on_gcs(job.dir.path(), &prefix);
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
    let state = block(bucket().list(&format!("{prefix}/state"))).expect("list");
    assert!(state.iter().any(|o| o.key.contains("/checkpoints/")), "checkpoint records in the bucket: {state:?}");
    files_in_bucket(&table.table, &warehouse, job.dir.path());
}

sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 2;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 1;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit: CrashPoint::AfterCommit, 4;
}

/// Data files larger than one upload part (8 MiB): the plugin's exclusive
/// `output-file` claims each name and streams it as a resumable upload.
/// Every row comes back once, so every chunk landed whole and in order.
#[test]
fn data_files_larger_than_one_part_stream_through_the_claim() {
    const BIG: u64 = 1_200_000;
    let id = "ice-gcs-big";
    // One subtask and one checkpoint: one data file per table partition.
    let job = job(id, BIG, 1, BIG);
    let sets = on_gcs(job.dir.path(), "big");
    let summary = job.run_with(&refs(&sets), None).expect("the run");
    assert_eq!(summary.rows_total, BIG, "{summary:?}");
    let table = read_iceberg_from(&catalog(&job.dir.path().join("catalog.db"), "big/wh"), TABLE);
    assert_exactly_once_range(&table.rows, 0, BIG);
    let files = files_in_bucket(&table.table, "big/wh", job.dir.path());
    assert!(
        files.iter().any(|(_, size)| *size > DEFAULT_PART_SIZE as u64),
        "no data file outgrew one part ({DEFAULT_PART_SIZE} bytes), so the resumable upload went untested: {files:?}"
    );
}

/// Commits so far: metadata files of the table beyond the one its creation wrote.
fn commits(metadata_prefix: &str) -> u64 {
    let listed = block(bucket().list(metadata_prefix)).expect("list");
    (listed.iter().filter(|o| o.key.ends_with(".metadata.json")).count() as u64).saturating_sub(1)
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
/// file, its files through PyIceberg's own GCS FileIO (pyarrow's GCS
/// filesystem) pointed at fake-gcs-server (`gcs.service.host`; pyarrow wants
/// a token with an expiry, which the server never checks). It writes the
/// rows it scanned to `out/rows/all.parquet` and prints the snapshots'
/// Sluice properties.
const PYICEBERG_GCS: &str = r#"
import sys, json, os
import pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
db, warehouse, endpoint, table, out = sys.argv[1:6]
cat = SqlCatalog('sluice', **{
    'uri': f'sqlite:///{db}',
    'warehouse': warehouse,
    'py-io-impl': 'pyiceberg.io.pyarrow.PyArrowFileIO',
    'gcs.service.host': endpoint,
    'gcs.oauth2.token': 'unused',
    'gcs.oauth2.token-expires-at': '4102444800000',
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

/// `examples/iceberg-gcs.toml` run by the real binary, SIGKILLed twice
/// mid-job and run again to its end; then PyIceberg reads every row once.
#[test]
fn the_gcs_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg() {
    const ROWS: u64 = 40_000;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/iceberg-gcs.toml");
    let dir = tempfile::tempdir().expect("job dir");
    let toml = std::fs::read_to_string(&example).expect("reading the example");
    std::fs::write(dir.path().join("job.toml"), &toml).expect("job file");
    let job = TestJob { dir, toml };
    let prefix = "example";
    let mut sets = on_gcs(job.dir.path(), prefix);
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

    let scratch = tempfile::tempdir().expect("scratch");
    let db = job.dir.path().join("catalog.db").display().to_string();
    let read = python(
        PYICEBERG_GCS,
        &[
            &db,
            &format!("gs://{BUCKET}/{prefix}/wh"),
            &gcs().endpoint,
            "demo.events",
            &scratch.path().display().to_string(),
        ],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it: pip install -r tests/requirements.txt): {e}"));
    let v: serde_json::Value = serde_json::from_str(read.trim()).expect("json");
    assert_eq!(v["location"], format!("gs://{BUCKET}/{prefix}/wh/demo/events"), "{v}");
    assert_eq!(v["io"], "PyArrowFileIO", "{v}");
    assert_eq!(v["rows"], ROWS, "{v}");
    let snapshots: Vec<(String, String)> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    let mut seen: Vec<&String> = snapshots.iter().map(|(_, c)| c).collect();
    seen.dedup();
    assert_eq!(seen.len(), snapshots.len(), "no checkpoint committed twice: {snapshots:?}");
    assert!(snapshots.iter().all(|(j, _)| j == "iceberg-gcs-demo"), "{snapshots:?}");

    let schema = Generator::schema_ref();
    let rows = sluice_bench::conform(&read_parquet_tree(scratch.path()), &schema).expect("the generator's types");
    assert_exactly_once_range(&sort_by_id(&rows), 0, ROWS);
    let table = read_iceberg_from(&catalog(&job.dir.path().join("catalog.db"), &format!("{prefix}/wh")), "demo.events");
    assert_exactly_once_range(&table.rows, 0, ROWS);
    files_in_bucket(&table.table, &format!("{prefix}/wh"), job.dir.path());
}

/// A REST catalog whose warehouse is on GCS: the catalog (the double, over
/// the host's own warehouse storage) writes the metadata, the plugin the
/// data and manifest files through `file-io` with the job's GCS settings;
/// a crash after the record is persisted, then a rerun, lands every row once.
#[test]
fn a_rest_catalog_with_its_warehouse_on_gcs_recovers_a_crash() {
    gcs();
    let stores = StoreConfig::default();
    let root = gs("rest/wh");
    let storage = WarehouseStorage::open(root.clone(), &stores).expect("the double's warehouse storage");
    let file_io =
        iceberg::io::FileIOBuilder::new(std::sync::Arc::new(WarehouseStorageFactory::new(storage, &stores))).build();
    let rest = RestCatalogDouble::start_on(&format!("gs://{BUCKET}/rest/wh"), file_io).expect("REST catalog");
    let id = "ice-gcs-rest";
    let mut job = job(id, ROWS, PARALLELISM, EVERY);
    let local = "database = \"/nonexistent-local-warehouse/catalog.db\"\nwarehouse = \"/nonexistent-local-warehouse\"";
    assert!(job.toml.contains(local), "the Iceberg job names its SQLite catalog and warehouse");
    job.toml = job
        .toml
        .replace(local, &format!("kind = \"rest\"\nuri = \"{}\"\nwarehouse = \"gs://{BUCKET}/rest/wh\"", rest.uri()));
    let sets = [format!("job.state_dir=gs://{BUCKET}/rest/state"), "job.lease_secs=2".to_string()];
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let summary = job.run_with(&refs(&sets), None).expect("the rerun");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::Committed)], "{summary:?}");
    let catalog = CatalogGrant::open_rest_at("sluice", &rest.uri(), &root, None, &stores).expect("catalog");
    let table = read_iceberg_from(&catalog, TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    files_in_bucket(&table.table, "rest/wh", job.dir.path());
}
