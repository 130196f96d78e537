//! Kafka → Iceberg with the warehouse and `job.state_dir` on S3 (moto's
//! server on 127.0.0.1; only the SQLite catalog file stays on local disk),
//! against a real broker (tansu): the Kafka source's offsets go into
//! checkpoint records on S3 under the S3 lease, and every message lands
//! once, by key and value, across a resume. A binary of its own: it sets
//! the AWS environment for its process.

use std::path::Path;

use sluice::capability::catalog::CatalogGrant;
use sluice::capability::file_io::StoreConfig;
use sluice::engine::RunOptions;
use sluice::location::{Location, Scheme};
use sluice_store::ObjectStore;
use sluice_tests::harness;
use sluice_tests::kafka::{Broker, assert_orders, kafka_job, order_schema, orders};
use sluice_tests::read_iceberg_as;

const BUCKET: &str = harness::buckets::KAFKA;

fn catalog(database: &Path) -> CatalogGrant {
    let warehouse = Location::ObjectStore { scheme: Scheme::S3, bucket: BUCKET.into(), prefix: "wh".into() };
    CatalogGrant::open_sql_at("sluice", database, &warehouse, &StoreConfig::default())
        .expect("opening the catalog on the S3 warehouse")
}

#[test]
fn kafka_into_an_s3_warehouse_with_state_on_s3_lands_every_message_once_across_resumes() {
    // The process's moto, and the AWS environment pointing the host at it.
    let moto = harness::moto();
    let broker = Broker::start();
    broker.create_topic("s3orders", 3);
    broker.produce("s3orders", &orders(0, 2000, 3));
    let job = kafka_job(&broker, "k-s3", "s3orders", 2, 0.5, "bounded = true");
    let database = job.dir.path().join("catalog.db");
    let sets = [
        format!("sink.catalog.warehouse=s3://{BUCKET}/wh"),
        format!("sink.catalog.database={}", database.display()),
        format!("job.state_dir=s3://{BUCKET}/state"),
        "job.lease_secs=10".to_string(),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let first = job.run_opts(&sets, RunOptions::default()).unwrap_or_else(|e| panic!("first run: {e}"));
    assert_eq!(first.rows_total, 2000, "{first}");
    broker.produce("s3orders", &orders(2000, 3500, 3));
    let second = job.run_opts(&sets, RunOptions::default()).unwrap_or_else(|e| panic!("second run: {e}"));
    assert_eq!(second.rows_this_run, 1500, "the resume did not start at the recorded offsets: {second}");

    let table = read_iceberg_as(&catalog(&database), "lake.s3orders", &order_schema());
    assert_orders(&table.rows, 0..3500);
    table.assert_no_checkpoint_twice();
    // The state and the table are on S3 only.
    let bucket = ObjectStore::s3(BUCKET, &moto.s3_options()).expect("bucket");
    let keys: Vec<String> = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(bucket.list(""))
        .expect("listing the bucket")
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert!(keys.iter().any(|k| k == "state/lease"), "no lease on S3: {keys:?}");
    assert!(keys.iter().any(|k| k.starts_with("state/") && k.contains("/checkpoints/chk-")), "{keys:?}");
    assert!(keys.iter().any(|k| k.starts_with("wh/") && k.ends_with(".parquet")), "no data files on S3: {keys:?}");
    assert!(!job.dir.path().join("warehouse").exists(), "the warehouse was written to local disk");
    assert!(!job.state().exists(), "the state directory was written to local disk");
}
