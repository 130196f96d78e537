//! The Iceberg sink with its warehouse and `job.state_dir` on GCS
//! (fake-gcs-server on 127.0.0.1): the checks every object store must pass
//! (`iceberg_object`, run here on GCS: the crash matrix and the example
//! killed twice, read back by iceberg-rust and by PyIceberg with its own GCS
//! FileIO), and two only GCS shows:
//!
//! - a REST catalog (the test double) whose warehouse is on GCS: it writes
//!   the metadata, the plugin the data files, through a crash and a rerun;
//! - a data file larger than one upload part, so the plugin's exclusive
//!   `output-file` goes through the claim and the resumable upload
//!   (`store/src/gcs.rs`), read back whole.
//!
//! The host reaches the server as Google's client libraries reach an
//! emulator, through `STORAGE_EMULATOR_HOST` (unsigned requests), set once
//! for this process and inherited by the `sluice run` processes it starts.

use sluice::bindings::CommitOutcome;
use sluice::capability::catalog::CatalogGrant;
use sluice::capability::catalog_storage::{WarehouseStorage, WarehouseStorageFactory};
use sluice::capability::file_io::StoreConfig;
use sluice::engine::{CrashPoint, Fault};
use sluice_store::DEFAULT_PART_SIZE;
use sluice_tests::harness::gcs;
use sluice_tests::rest_catalog::RestCatalogDouble;
use sluice_tests::{assert_exactly_once_range, read_iceberg_from};

use crate::iceberg_object::{
    self, BUCKET, EVERY, PARALLELISM, ROWS, TABLE, catalog, files_in_bucket, job, location, on,
};
use crate::state_object::{Backend, refs};

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    iceberg_object::crash_then_recover(Backend::Gcs, point, checkpoint);
}

sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 2;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 1;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit: CrashPoint::AfterCommit, 4;
}

#[test]
fn the_gcs_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg() {
    iceberg_object::the_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg(Backend::Gcs);
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
    let sets = on(Backend::Gcs, job.dir.path(), "big");
    let summary = job.run_with(&refs(&sets), None).expect("the run");
    assert_eq!(summary.rows_total, BIG, "{summary:?}");
    let table = read_iceberg_from(&catalog(Backend::Gcs, &job.dir.path().join("catalog.db"), "big/wh"), TABLE);
    assert_exactly_once_range(&table.rows, 0, BIG);
    let files = files_in_bucket(Backend::Gcs, &table.table, "big/wh", job.dir.path());
    assert!(
        files.iter().any(|(_, size)| *size > DEFAULT_PART_SIZE as u64),
        "no data file outgrew one part ({DEFAULT_PART_SIZE} bytes), so the resumable upload went untested: {files:?}"
    );
}

/// A REST catalog whose warehouse is on GCS: the catalog (the double, over
/// the host's own warehouse storage) writes the metadata, the plugin the
/// data and manifest files through `file-io` with the job's GCS settings;
/// a crash after the record is persisted, then a rerun, lands every row once.
#[test]
fn a_rest_catalog_with_its_warehouse_on_gcs_recovers_a_crash() {
    gcs();
    let stores = StoreConfig::default();
    let root = location(Backend::Gcs, "rest/wh");
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
    files_in_bucket(Backend::Gcs, &table.table, "rest/wh", job.dir.path());
}
