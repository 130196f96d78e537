//! Kafka test helpers: the broker harness is `sluice_bench::kafka` (the
//! benchmark starts the same broker); here, the jobs and checks the Kafka
//! tests share.

use arrow_array::{Array, Float64Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
pub use sluice_bench::kafka::{Broker, ORDER_COLUMNS, order, orders};

/// A Kafka → Iceberg job reading `topic` into `lake.orders`, with
/// `parallelism` writers and a checkpoint every `interval` seconds.
pub fn kafka_job(
    broker: &Broker,
    id: &str,
    topic: &str,
    parallelism: u32,
    interval: f64,
    extra: &str,
) -> crate::TestJob {
    kafka_job_of(broker, id, topic, parallelism, interval, &format!("format = \"json\"\n{ORDER_COLUMNS}"), extra)
}

/// [`kafka_job`] with `format`: the source's format keys (`format = ...`,
/// its columns or schemas).
pub fn kafka_job_of(
    broker: &Broker,
    id: &str,
    topic: &str,
    parallelism: u32,
    interval: f64,
    format: &str,
    extra: &str,
) -> crate::TestJob {
    let dir = tempfile::tempdir().expect("temp dir");
    let warehouse = dir.path().join("warehouse");
    let bootstrap = broker.bootstrap();
    let warehouse = warehouse.display();
    let plugin = crate::ICEBERG_PLUGIN;
    let toml = format!(
        r#"
[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
interval_secs = {interval}
[source]
kind = "kafka"
brokers = ["{bootstrap}"]
topics = ["{topic}"]
batch_rows = 500
discover_secs = 0.5
{format}
{extra}
[sink]
id = "lake"
plugin = "{plugin}"
[sink.options]
table = "lake.{{topic}}"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#
    );
    crate::TestJob { dir, toml }
}

/// The table schema of [`order`] messages.
pub fn order_schema() -> SchemaRef {
    std::sync::Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("amount", DataType::Float64, true),
    ]))
}

/// Asserts that `rows` are orders `ids` exactly once each, by id and value.
pub fn assert_orders(rows: &RecordBatch, ids: impl Iterator<Item = i64>) {
    let expected: Vec<i64> = ids.collect();
    let id = rows.column(0).as_any().downcast_ref::<Int64Array>().expect("id column");
    let name = rows.column(1).as_any().downcast_ref::<StringArray>().expect("name column");
    let amount = rows.column(2).as_any().downcast_ref::<Float64Array>().expect("amount column");
    let got: Vec<i64> = id.values().to_vec();
    if got != expected {
        let dups = got.windows(2).filter(|w| w[0] == w[1]).count();
        let missing = expected.iter().filter(|i| got.binary_search(i).is_err()).count();
        panic!("{} rows landed for {} orders: {dups} doubled, {missing} missing", got.len(), expected.len());
    }
    for i in 0..rows.num_rows() {
        let k = id.value(i);
        assert_eq!(name.value(i), format!("order-{k}"), "name of order {k}");
        assert_eq!(amount.value(i), k as f64 * 0.25, "amount of order {k}");
    }
}
