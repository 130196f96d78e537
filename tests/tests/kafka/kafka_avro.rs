//! Kafka → Iceberg with Avro messages in the Confluent Schema Registry wire
//! format, against a real broker (tansu, see `tests/src/kafka.rs`) and the
//! registry double (`tests/src/schema_registry.rs`): every message lands
//! exactly once, compared by key and value; a second schema version
//! registered mid-topic resolves; a changed reader schema is refused at
//! resume; a bad message names its partition and offset, and nothing of its
//! checkpoint lands. Messages are encoded by hand from the Avro
//! specification (`schema_registry::avro`), not by the host's crate.

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use sluice::engine::RunOptions;
use sluice_tests::kafka::{Broker, assert_orders, kafka_job_of, order_schema};
use sluice_tests::schema_registry::{SchemaRegistry, avro};
use sluice_tests::{TestJob, catalog, read_iceberg_as};

/// An order: `id`, `name` and `amount` as the JSON tests have them, and a
/// `timestamp-millis` logical type.
const V1: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"name","type":["null","string"]},{"name":"amount","type":["null","double"]},{"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;
/// V1 and a field added with a default: a compatible evolution.
const V2: &str = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"name","type":["null","string"]},{"name":"amount","type":["null","double"]},{"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}},{"name":"region","type":"string","default":"eu"}]}"#;

const EPOCH_MS: i64 = 1_700_000_000_000;

/// Order `id` in the wire format of schema `schema_id` (with `region` when
/// the schema is V2), on partition `id % partitions`.
fn order(id: i64, partitions: i32, schema_id: u32, region: Option<&str>) -> (i32, String, Vec<u8>) {
    let mut datum = Vec::new();
    avro::long(&mut datum, id);
    avro::long(&mut datum, 1);
    avro::string(&mut datum, &format!("order-{id}"));
    avro::long(&mut datum, 1);
    avro::double(&mut datum, id as f64 * 0.25);
    avro::long(&mut datum, EPOCH_MS + id);
    if let Some(r) = region {
        avro::string(&mut datum, r);
    }
    ((id % i64::from(partitions)) as i32, format!("k{id}"), avro::framed(schema_id, &datum))
}

fn orders(from: i64, to: i64, partitions: i32, schema_id: u32, region: Option<&str>) -> Vec<(i32, String, Vec<u8>)> {
    (from..to).map(|id| order(id, partitions, schema_id, region)).collect()
}

/// A job reading Avro `topic` through `registry`, with `format_extra` (an
/// `avro_schema`) among the source's keys.
fn avro_job(broker: &Broker, registry: &SchemaRegistry, id: &str, topic: &str, interval: f64, extra: &str) -> TestJob {
    let format = format!("format = \"avro\"\nschema_registry = \"{}\"\n{extra}", registry.url());
    kafka_job_of(broker, id, topic, 2, interval, &format, "")
}

fn bounded(job: &TestJob, sets: &[&str]) -> Result<sluice::engine::RunSummary, sluice::engine::EngineError> {
    let mut all = vec!["source.bounded=true"];
    all.extend_from_slice(sets);
    job.run_opts(&all, RunOptions::default())
}

fn landed(job: &TestJob, table: &str, schema: &SchemaRef) -> RecordBatch {
    read_iceberg_as(&catalog(&job.dir.path().join("warehouse")), &format!("lake.{table}"), schema).rows
}

fn with_region() -> SchemaRef {
    let mut fields: Vec<Field> = order_schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("region", DataType::Utf8, true));
    std::sync::Arc::new(Schema::new(fields))
}

/// The table's schema and row count as PyIceberg reads them.
fn pyiceberg_schema(job: &TestJob, table: &str) -> serde_json::Value {
    let dir = job.dir.path().join("warehouse").display().to_string();
    let out = sluice_tests::python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         t = cat.load_table(sys.argv[2])\n\
         a = t.scan().to_arrow()\n\
         at = sorted(a.column('at').to_pylist())\n\
         print(json.dumps({\n\
           'schema': [f'{f.name}:{f.field_type}:{\"req\" if f.required else \"opt\"}' for f in t.schema().fields],\n\
           'rows': a.num_rows, 'first_at': at[0].isoformat(),\n\
         }))",
        &[&dir, &format!("lake.{table}")],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it: pip install 'pyiceberg[sql-sqlite,pyarrow]'): {e}"));
    serde_json::from_str(out.trim()).expect("json")
}

#[test]
fn registry_framed_messages_over_two_subtasks_land_once_with_the_schemas_types() {
    let broker = Broker::start();
    let registry = SchemaRegistry::start().expect("registry double");
    broker.create_topic("avro_orders", 3);
    let id = registry.register("avro_orders-value", V1);
    broker.produce("avro_orders", &orders(0, 3000, 3, id, None));
    // No avro_schema: the table's columns are the subject's latest.
    let job = avro_job(&broker, &registry, "k-avro", "avro_orders", 0.5, "");
    let first = bounded(&job, &[]).unwrap_or_else(|e| panic!("bounded run: {e}"));
    assert_eq!(first.rows_total, 3000, "{first}");
    assert_orders(&landed(&job, "avro_orders", &order_schema()), 0..3000);
    // Both subtasks share what was fetched: the writer schema, once.
    assert_eq!(registry.gets_of(id), 1, "the writer schema is fetched once and cached");
    // More messages; the next run starts at the recorded offsets.
    broker.produce("avro_orders", &orders(3000, 4500, 3, id, None));
    let second = bounded(&job, &[]).unwrap_or_else(|e| panic!("second run: {e}"));
    assert_eq!(second.rows_this_run, 1500, "{second}");
    assert_orders(&landed(&job, "avro_orders", &order_schema()), 0..4500);
    read_iceberg_as(&catalog(&job.dir.path().join("warehouse")), "lake.avro_orders", &order_schema())
        .assert_no_checkpoint_twice();
    // Another reader sees Avro's types: long, nullable unions, timestamp-millis as a UTC timestamp.
    let py = pyiceberg_schema(&job, "avro_orders");
    assert_eq!(
        py["schema"],
        serde_json::json!(["id:long:req", "name:string:opt", "amount:double:opt", "at:timestamptz:req"]),
        "{py}"
    );
    assert_eq!(py["rows"], 4500);
    assert_eq!(py["first_at"], "2023-11-14T22:13:20+00:00", "timestamp-millis {EPOCH_MS} is that instant");
}

#[test]
fn a_schema_version_added_mid_topic_resolves_and_a_changed_reader_is_refused_at_resume() {
    let broker = Broker::start();
    let registry = SchemaRegistry::start().expect("registry double");
    broker.create_topic("avro_evolve", 3);
    let v1 = registry.register("avro_evolve-value", V1);
    broker.produce("avro_evolve", &orders(0, 600, 3, v1, None));
    let job = avro_job(&broker, &registry, "k-avro-evolve", "avro_evolve", 0.5, "");
    bounded(&job, &[]).unwrap_or_else(|e| panic!("first run: {e}"));
    assert_orders(&landed(&job, "avro_evolve", &order_schema()), 0..600);
    // A second version (a field added with a default) mid-topic.
    let v2 = registry.register("avro_evolve-value", V2);
    assert_ne!(v1, v2);
    broker.produce("avro_evolve", &orders(600, 1200, 3, v2, Some("us")));
    // The subject's latest is now V2: the table's columns would change under the checkpoint.
    let e = bounded(&job, &[]).expect_err("a changed reader schema must be refused at resume");
    assert!(e.to_string().contains("Avro reader schema"), "{e}");
    // Pinned to the schema it was taken with, it resumes; V2's messages resolve to V1.
    let pinned = format!("source.avro_schema='{V1}'");
    let resumed = bounded(&job, &[&pinned]).unwrap_or_else(|e| panic!("pinned resume: {e}"));
    assert_eq!(resumed.rows_this_run, 600, "{resumed}");
    assert_orders(&landed(&job, "avro_evolve", &order_schema()), 0..1200);
    // A new job reading the whole topic as V2: V1's messages take the default.
    let v2_job = avro_job(&broker, &registry, "k-avro-v2", "avro_evolve", 0.5, &format!("avro_schema = '{V2}'"));
    let all = bounded(&v2_job, &[]).unwrap_or_else(|e| panic!("V2 run: {e}"));
    assert_eq!(all.rows_total, 1200, "{all}");
    let rows = landed(&v2_job, "avro_evolve", &with_region());
    assert_orders(&rows, 0..1200);
    let region = rows.column(3).as_string::<i32>();
    for i in 0..rows.num_rows() {
        let want = if i < 600 { "eu" } else { "us" };
        assert_eq!(region.value(i), want, "region of order {i}");
    }
    assert_eq!(region.null_count(), 0);
}

#[test]
fn a_bad_message_names_its_partition_and_offset_and_nothing_of_its_checkpoint_lands() {
    let broker = Broker::start();
    let registry = SchemaRegistry::start().expect("registry double");
    for (topic, bad) in [("avro_magic", br#"{"id":100}"#.to_vec()), ("avro_unknown", order(100, 2, 99, None).2)] {
        broker.create_topic(topic, 2);
        let id = registry.register(&format!("{topic}-value"), V1);
        let mut messages = orders(0, 200, 2, id, None);
        // Partition 0's offset 50 (orders 0, 2, 4, ... before it).
        messages.insert(100, (0, "bad".into(), bad));
        broker.produce(topic, &messages);
        // One checkpoint would hold the bad message with good ones.
        let job = avro_job(&broker, &registry, &format!("k-{topic}"), topic, 30.0, "");
        let e = bounded(&job, &[]).expect_err("a bad message must stop the run");
        let text = e.to_string();
        assert!(text.contains(&format!("{topic:?} partition 0 offset 50")), "{text}");
        if topic == "avro_magic" {
            assert!(text.contains("magic byte"), "{text}");
        } else {
            assert!(text.contains("schema id 99") && text.contains("Schema not found"), "{text}");
        }
        let ident = iceberg::TableIdent::from_strs(["lake", topic]).expect("ident");
        if let Ok(t) = catalog(&job.dir.path().join("warehouse")).load(&ident) {
            assert!(t.metadata().current_snapshot().is_none(), "rows of the failed checkpoint are visible");
        }
    }
}
