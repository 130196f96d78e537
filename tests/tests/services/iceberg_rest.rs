//! The Iceberg sink with a REST catalog (`[sink.catalog] kind = "rest"`),
//! against the REST catalog double in `tests/src/rest_catalog.rs` over real
//! HTTP: every row once, one snapshot per checkpoint, through lost commit
//! replies (504), refused commits (409, 503), a crash during the commit and
//! two jobs writing the same table at once.

use std::path::Path;

use sluice::engine::{CrashPoint, Fault};
use sluice_tests::rest_catalog::{RestCatalogDouble, RestFault};
use sluice_tests::{TestJob, assert_exactly_once_range, read_iceberg_rest};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
const EVERY: u64 = 500;
const TABLE: &str = "db.events";

/// A generator → Iceberg job whose catalog is the REST catalog at `uri`.
fn job(id: &str, uri: &str, warehouse: &Path, first_id: u64) -> TestJob {
    let mut job = TestJob::iceberg(id, warehouse, TABLE, ROWS, first_id, PARALLELISM, EVERY);
    let sql = format!("database = \"{}/catalog.db\"", warehouse.display());
    assert!(job.toml.contains(&sql), "the Iceberg job names its SQLite catalog");
    job.toml = job.toml.replace(&sql, &format!("kind = \"rest\"\nuri = \"{uri}\""));
    job
}

fn assert_landed_once(rest: &RestCatalogDouble, warehouse: &Path, id: &str) {
    let table = read_iceberg_rest(&rest.uri(), warehouse, TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert_eq!(table.snapshots_of(id), 4, "one snapshot per non-empty checkpoint: {:?}", table.commits);
}

#[test]
fn rows_land_once_through_a_rest_catalog() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    job("rest-happy", &rest.uri(), warehouse.path(), 0).run(None).expect("run");
    assert_landed_once(&rest, warehouse.path(), "rest-happy");
    assert_eq!(rest.commits(), (4, 0));
}

#[test]
fn a_lost_commit_reply_is_checked_not_reapplied() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    rest.inject(2, RestFault::LoseReply);
    rest.inject(3, RestFault::Unavailable);
    job("rest-lost", &rest.uri(), warehouse.path(), 0).run(None).expect("run");
    assert_landed_once(&rest, warehouse.path(), "rest-lost");
}

#[test]
fn refused_commits_are_retried() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    rest.inject(1, RestFault::Conflict);
    rest.inject(2, RestFault::Conflict);
    job("rest-conflict", &rest.uri(), warehouse.path(), 0).run(None).expect("run");
    assert_landed_once(&rest, warehouse.path(), "rest-conflict");
    assert_eq!(rest.commits().1, 2, "both refusals were answered 409");
}

#[test]
fn a_crash_during_the_commit_recovers_exactly_once() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    let job = job("rest-crash", &rest.uri(), warehouse.path(), 0);
    let err = job.run(Some(Fault { point: CrashPoint::DuringCommit, checkpoint: 2, subtask: 0 })).expect_err("crash");
    assert!(err.is_injected_crash(), "{err}");
    job.run(None).expect("recovery");
    assert_landed_once(&rest, warehouse.path(), "rest-crash");
}

#[test]
fn two_jobs_share_a_rest_table() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    let a = job("rest-a", &rest.uri(), warehouse.path(), 0);
    let b = job("rest-b", &rest.uri(), warehouse.path(), ROWS);
    std::thread::scope(|s| {
        let ha = s.spawn(|| a.run(None));
        let hb = s.spawn(|| b.run(None));
        ha.join().expect("thread").expect("job a");
        hb.join().expect("thread").expect("job b");
    });
    let table = read_iceberg_rest(&rest.uri(), warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, 2 * ROWS);
    table.assert_no_checkpoint_twice();
    assert_eq!(table.snapshots_of("rest-a"), 4);
    assert_eq!(table.snapshots_of("rest-b"), 4);
}

#[test]
fn an_unreachable_rest_catalog_is_a_clear_error() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("rest-down", "http://127.0.0.1:9", warehouse.path(), 0);
    let err = job.run(None).expect_err("no catalog").to_string();
    assert!(err.contains("sink.catalog") && err.contains("http://127.0.0.1:9"), "{err}");
}

/// PyIceberg's own REST client reads the table through the same catalog:
/// the rows and the snapshot summaries Sluice wrote.
#[test]
fn pyiceberg_reads_the_table_through_the_rest_catalog() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    job("rest-py", &rest.uri(), warehouse.path(), 0).run(None).expect("run");
    let out = sluice_tests::python(
        "import sys, json\n\
         from pyiceberg.catalog.rest import RestCatalog\n\
         t = RestCatalog('sluice', uri=sys.argv[1]).load_table('db.events')\n\
         ids = sorted(t.scan().to_arrow().column('id').to_pylist())\n\
         cps = sorted((s.summary['sluice.checkpoint-id'] for s in t.snapshots()), key=int)\n\
         print(json.dumps({'n': len(ids), 'distinct': len(set(ids)), 'min': ids[0], 'max': ids[-1], 'checkpoints': cps}))",
        &[&rest.uri()],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it): {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    assert_eq!(v["n"], ROWS);
    assert_eq!(v["distinct"], ROWS);
    assert_eq!((v["min"].as_u64(), v["max"].as_u64()), (Some(0), Some(ROWS - 1)));
    assert_eq!(v["checkpoints"], serde_json::json!(["1", "2", "3", "4"]));
}
