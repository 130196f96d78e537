//! The Iceberg sink with its warehouse in a bucket and `job.state_dir` there
//! too (only the SQLite catalog file stays on local disk): the checks that
//! hold the same on every object store, written once and run on each
//! [`Backend`] by `iceberg_s3` (moto) and `iceberg_gcs` (fake-gcs-server).
//! The host's catalog writes table metadata through its warehouse storage
//! (`sluice-store`), the plugin writes data files through `file-io`
//! (`sluice-store` again): one store crate, one credential path.
//!
//! - the crash matrix: a crash at each step of the checkpoint protocol, one
//!   checkpoint per step (the cases `iceberg.rs` runs on disk), then a
//!   rerun: every row once, by id and value, one snapshot per checkpoint;
//!   read back through iceberg-rust's scan over the host's catalog storage,
//!   and again by PyIceberg with its own FileIO for the store (pyarrow's);
//! - the real `sluice` binary running `examples/iceberg-<store>.toml`,
//!   SIGKILLed twice mid-job and run again (each rerun takes the lease over
//!   once it expired); then PyIceberg reads every row once, by id and value;
//! - nothing of the table is written to local disk.

use std::path::Path;
use std::process::Child;
use std::time::Duration;

use sluice::capability::catalog::CatalogGrant;
use sluice::capability::file_io::StoreConfig;
use sluice::engine::{CrashPoint, Fault};
use sluice::location::{Location, Scheme};
use sluice::source::generator::Generator;
use sluice_store::ObjectStore;
use sluice_tests::harness::{block, buckets};
use sluice_tests::{
    ICEBERG_PLUGIN, TestJob, assert_exactly_once_range, python, read_iceberg_from, read_parquet_tree, sluice_run,
    sort_by_id,
};

use crate::state_object::{Backend, refs, spawn_until};

/// The bucket of the warehouses, on each server.
pub(crate) const BUCKET: &str = buckets::ICEBERG;
pub(crate) const ROWS: u64 = 6000;
pub(crate) const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
pub(crate) const EVERY: u64 = 500;
pub(crate) const TABLE: &str = "db.events";

/// The warehouses' bucket, as the test sees it (not through the host).
pub(crate) fn bucket(b: Backend) -> ObjectStore {
    b.store(BUCKET)
}

/// `prefix` in the warehouses' bucket.
pub(crate) fn location(b: Backend, prefix: &str) -> Location {
    let scheme = match b {
        Backend::S3 => Scheme::S3,
        Backend::Gcs => Scheme::Gs,
    };
    Location::ObjectStore { scheme, bucket: BUCKET.into(), prefix: prefix.into() }
}

/// The job's catalog, opened as the host opens it (through the environment
/// the server's start set).
pub(crate) fn catalog(b: Backend, database: &Path, warehouse: &str) -> CatalogGrant {
    b.start();
    CatalogGrant::open_sql_at("sluice", database, &location(b, warehouse), &StoreConfig::default())
        .expect("opening the catalog on the bucket's warehouse")
}

/// `--set`s that put a job's warehouse and state in the bucket under
/// `prefix` (the SQLite catalog in `dir`).
pub(crate) fn on(b: Backend, dir: &Path, prefix: &str) -> Vec<String> {
    b.start();
    let root = format!("{}://{BUCKET}/{prefix}", b.scheme());
    vec![
        format!("sink.catalog.warehouse={root}/wh"),
        format!("sink.catalog.database={}", dir.join("catalog.db").display()),
        format!("job.state_dir={root}/state"),
        "job.lease_secs=2".to_string(),
    ]
}

/// A generator → Iceberg job; [`on`] moves its warehouse and state.
pub(crate) fn job(id: &str, rows: u64, parallelism: u32, every: u64) -> TestJob {
    // The local warehouse these name is replaced by `on`.
    TestJob::iceberg(id, Path::new("/nonexistent-local-warehouse"), TABLE, rows, 0, parallelism, every)
}

/// The data files of the table's current snapshot, each with its size in
/// the bucket; asserts that the table's location, its current metadata
/// file and every data file are there, and that no table file is on local
/// disk under `job_dir`.
pub(crate) fn files_in_bucket(
    b: Backend,
    table: &iceberg::table::Table,
    warehouse: &str,
    job_dir: &Path,
) -> Vec<(String, u64)> {
    let root = format!("{}://{BUCKET}/", b.scheme());
    let location = table.metadata().location().to_string();
    assert!(location.starts_with(&format!("{root}{warehouse}/")), "{location}");
    let listed = block(bucket(b).list(warehouse)).expect("listing the bucket");
    let size = |url: &str| {
        let key = url.strip_prefix(&root).unwrap_or_else(|| panic!("{url} is not in the bucket"));
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
    let local = local_files(job_dir)
        .into_iter()
        .filter(|p| p.ends_with(".parquet") || p.ends_with(".avro") || p.ends_with(".metadata.json"))
        .collect::<Vec<_>>();
    assert!(local.is_empty(), "table files on local disk: {local:?}");
    data_files.into_iter().map(|f| (f.clone(), size(&f))).collect()
}

/// Every file under `dir`, at any depth.
fn local_files(dir: &Path) -> Vec<String> {
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

/// A crash at `point` of `checkpoint`, then a rerun: every row once, by id
/// and value, for iceberg-rust and for PyIceberg; one snapshot per
/// non-empty checkpoint; the right checkpoint recovered; the records and
/// the table in the bucket.
pub(crate) fn crash_then_recover(b: Backend, point: CrashPoint, checkpoint: u64) {
    let id = format!("ice-{}", b.job(&format!("{point}-{checkpoint}")));
    let prefix = id.to_lowercase();
    let job = job(&id, ROWS, PARALLELISM, EVERY);
    let sets = on(b, job.dir.path(), &prefix);
    let warehouse = format!("{prefix}/wh");
    let database = job.dir.path().join("catalog.db");
    let read = || read_iceberg_from(&catalog(b, &database, &warehouse), TABLE);
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
    sluice_tests::assert_iceberg_recovery(point, checkpoint, &restored.summary.recovered);
    // The state is in the bucket too: the run's records are objects there.
    let state = block(bucket(b).list(&format!("{prefix}/state"))).expect("listing the state");
    assert!(state.iter().any(|o| o.key.contains("/checkpoints/")), "checkpoint records in the bucket: {state:?}");
    files_in_bucket(b, &table.table, &warehouse, job.dir.path());

    // Another reader, with its own client for the store: PyIceberg's FileIO.
    let (v, rows) = read_with_pyiceberg(b, &database, &warehouse, TABLE);
    assert_eq!(v["location"], format!("{}://{BUCKET}/{warehouse}/db/events", b.scheme()), "{v}");
    assert_eq!(v["io"], "PyArrowFileIO", "{v}");
    assert_eq!(v["rows"], ROWS, "{v}");
    assert_exactly_once_range(&rows, 0, ROWS);
    let snapshots: Vec<(String, String)> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    let seen: Vec<&str> = snapshots.iter().filter(|(j, _)| *j == id).map(|(_, c)| c.as_str()).collect();
    assert_eq!(seen, ["1", "2", "3", "4"], "PyIceberg sees one snapshot per non-empty checkpoint: {snapshots:?}");
}

/// Commits so far: metadata files of the table beyond the one its creation wrote.
fn commits(b: Backend, metadata_prefix: &str) -> u64 {
    let listed = block(bucket(b).list(metadata_prefix)).expect("listing the metadata");
    (listed.iter().filter(|o| o.key.ends_with(".metadata.json")).count() as u64).saturating_sub(1)
}

/// Starts `sluice run` with `sets` and SIGKILLs it once `progress()`
/// reaches `at_least`; panics if it ended first.
fn run_and_kill(job: &TestJob, sets: &[String], progress: impl Fn() -> u64, at_least: u64) {
    let what = format!("{at_least} commits");
    let mut child: Child =
        spawn_until(sluice_run(job, sets), &what, Duration::from_secs(180), |_| progress() >= at_least);
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reaping sluice");
    assert!(!status.success(), "a killed process reported success");
}

/// `examples/iceberg-<store>.toml` run by the real binary, SIGKILLed twice
/// mid-job and run again to its end; then PyIceberg, with its own FileIO,
/// and iceberg-rust read every row once, by id and value.
pub(crate) fn the_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg(b: Backend) {
    const ROWS: u64 = 40_000;
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../examples/iceberg-{}.toml", b.short()));
    let dir = tempfile::tempdir().expect("job dir");
    let toml = std::fs::read_to_string(&example).expect("reading the example");
    std::fs::write(dir.path().join("job.toml"), &toml).expect("job file");
    let job = TestJob { dir, toml };
    let prefix = "example";
    let mut sets = on(b, job.dir.path(), prefix);
    // A lease of 2 s lets the reruns take over soon, but a renewal answered
    // after 2 s (moto or fake-gcs-server on a loaded machine) stops the run
    // that sent it, as it must. 6 s keeps both: quick takeovers, and a
    // renewal may take twice its period.
    sets.retain(|s| !s.starts_with("job.lease_secs="));
    sets.extend([
        "job.lease_secs=6".to_string(),
        format!("sink.plugin={ICEBERG_PLUGIN}"),
        format!("source.rows={ROWS}"),
        // About 4 s for the whole job: slow enough to be killed mid-way.
        "source.rate=10000.0".to_string(),
        "job.checkpoint.every_rows=1000".to_string(),
    ]);
    let metadata = format!("{prefix}/wh/demo/events/metadata");
    let progress = || commits(b, &metadata);

    run_and_kill(&job, &sets, progress, 2);
    let first = progress();
    // The rerun waits for the killed run's lease (6 s) to expire, then resumes.
    run_and_kill(&job, &sets, progress, first + 2);
    let out = sluice_run(&job, &sets).output().expect("running sluice");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains(&format!("{ROWS} rows in total")) && stdout.contains("attempt 3"), "{stdout}\n{stderr}");

    let database = job.dir.path().join("catalog.db");
    let warehouse = format!("{prefix}/wh");
    let (v, rows) = read_with_pyiceberg(b, &database, &warehouse, "demo.events");
    assert_eq!(v["location"], format!("{}://{BUCKET}/{prefix}/wh/demo/events", b.scheme()), "{v}");
    assert_eq!(v["io"], "PyArrowFileIO", "{v}");
    assert_eq!(v["rows"], ROWS, "{v}");
    let snapshots: Vec<(String, String)> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    let mut seen: Vec<&String> = snapshots.iter().map(|(_, c)| c).collect();
    seen.dedup();
    assert_eq!(seen.len(), snapshots.len(), "no checkpoint committed twice: {snapshots:?}");
    let example_job = format!("iceberg-{}-demo", b.short());
    assert!(snapshots.iter().all(|(j, _)| *j == example_job), "{snapshots:?}");
    // Every row PyIceberg read, by id and value.
    assert_exactly_once_range(&rows, 0, ROWS);

    let table = read_iceberg_from(&catalog(b, &database, &warehouse), "demo.events");
    assert_exactly_once_range(&table.rows, 0, ROWS);
    files_in_bucket(b, &table.table, &warehouse, job.dir.path());
}

/// What PyIceberg reads: the table through `SqlCatalog` on the same SQLite
/// file, its files through PyIceberg's own FileIO (pyarrow's filesystem for
/// the store) configured by the properties in argv[6] (JSON). It writes
/// the rows it scanned to `out/rows/all.parquet` and prints the snapshots'
/// Sluice properties.
const PYICEBERG: &str = r#"
import sys, json, os
import pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
db, warehouse, table, out, io = sys.argv[1:6]
cat = SqlCatalog('sluice', **{
    'uri': f'sqlite:///{db}',
    'warehouse': warehouse,
    'py-io-impl': 'pyiceberg.io.pyarrow.PyArrowFileIO',
    **json.loads(io),
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

/// PyIceberg's FileIO properties that reach the server: on S3 the endpoint,
/// region and keys (pyarrow's S3 filesystem pointed at moto); on GCS the
/// endpoint and a token with an expiry (pyarrow's GCS filesystem wants one;
/// fake-gcs-server never checks it).
fn pyiceberg_io(b: Backend) -> serde_json::Value {
    let endpoint = b.start();
    let env = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is set by the harness"));
    match b {
        Backend::S3 => serde_json::json!({
            "s3.endpoint": endpoint,
            "s3.region": env("AWS_REGION"),
            "s3.access-key-id": env("AWS_ACCESS_KEY_ID"),
            "s3.secret-access-key": env("AWS_SECRET_ACCESS_KEY"),
        }),
        Backend::Gcs => serde_json::json!({
            "gcs.service.host": endpoint,
            "gcs.oauth2.token": "unused",
            "gcs.oauth2.token-expires-at": "4102444800000",
        }),
    }
}

/// What PyIceberg reads of `table` ([`PYICEBERG`]) from the SQLite catalog
/// `db` and the warehouse `<scheme>://<bucket>/<warehouse>`: its summary,
/// and the rows it scanned, in the generator's types, sorted by id.
pub(crate) fn read_with_pyiceberg(
    b: Backend,
    db: &Path,
    warehouse: &str,
    table: &str,
) -> (serde_json::Value, arrow_array::RecordBatch) {
    let scratch = tempfile::tempdir().expect("scratch");
    let read = python(
        PYICEBERG,
        &[
            &db.display().to_string(),
            &format!("{}://{BUCKET}/{warehouse}", b.scheme()),
            table,
            &scratch.path().display().to_string(),
            &pyiceberg_io(b).to_string(),
        ],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it: pip install -r tests/requirements.txt): {e}"));
    let v: serde_json::Value = serde_json::from_str(read.trim()).expect("json");
    let schema = Generator::schema_ref();
    let rows = sluice_bench::conform(&read_parquet_tree(scratch.path()), &schema).expect("the generator's types");
    (v, sort_by_id(&rows))
}
