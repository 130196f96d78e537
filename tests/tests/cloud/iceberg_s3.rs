//! The Iceberg sink with its warehouse and `job.state_dir` on S3 (moto's
//! server on 127.0.0.1): the checks every object store must pass
//! (`iceberg_object`, run here on S3: the crash matrix and the example
//! killed twice, read back by iceberg-rust and by PyIceberg with its own S3
//! FileIO), and two of the catalog's storage: it writes nothing outside its
//! warehouse, and a warehouse in a missing bucket is refused before the
//! catalog is made.
//!
//! The host reaches moto through the standard AWS environment
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`), set once for this process and inherited by the
//! `sluice run` processes it starts.

use sluice::capability::file_io::StoreConfig;
use sluice::engine::CrashPoint;
use sluice_tests::harness::{block, moto};

use crate::iceberg_object::{self, BUCKET, EVERY, PARALLELISM, ROWS, bucket, job, location};
use crate::state_object::{Backend, refs};

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    iceberg_object::crash_then_recover(Backend::S3, point, checkpoint);
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
fn the_s3_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg() {
    iceberg_object::the_example_killed_twice_then_rerun_lands_every_row_once_for_pyiceberg(Backend::S3);
}

/// Every key under `prefix`.
fn keys(prefix: &str) -> Vec<String> {
    block(bucket(Backend::S3).list(prefix)).expect("listing the bucket").into_iter().map(|o| o.key).collect()
}

/// The catalog's storage writes nowhere but its warehouse: a table whose
/// location a commit moved outside it cannot have metadata written there.
#[test]
fn the_catalog_writes_nothing_outside_its_warehouse() {
    use iceberg::io::Storage;
    use sluice::capability::catalog_storage::WarehouseStorage;
    moto();
    let storage =
        WarehouseStorage::open(location(Backend::S3, "guarded/wh"), &StoreConfig::default()).expect("storage");
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
    let job = job("ice-s3-nobucket", ROWS, PARALLELISM, EVERY);
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
