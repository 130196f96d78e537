//! Debezium change streams from a real broker (tansu, see
//! `tests/src/kafka.rs`), read through the Kafka source: `format =
//! "debezium-json"` (envelopes with and without the JSON converter's
//! schemas, deletes followed by tombstones, updates of earlier rows) and
//! `"debezium-avro"` through the schema registry double. The batches the
//! source hands on are applied key by key and compared with a model the
//! test computes from what it produced: every change once, in partition
//! order, with `(0, offset)` as its position. An unknown op, and a
//! message whose key is not its row's key, are refused naming the offset,
//! or set aside once as a dead letter.
//!
//! Event shapes: <https://debezium.io/documentation/reference/stable/connectors/postgresql.html#postgresql-events>.

use std::collections::BTreeMap;
use std::time::Duration;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int64Type, UInt8Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use rdkafka::producer::{BaseRecord, Producer};
use serde_json::{Value, json};
use sluice::source::{Source, TableBatch};
use sluice_tests::TestJob;
use sluice_tests::kafka::{Broker, ORDER_COLUMNS, kafka_job_of};
use sluice_tests::schema_registry::{SchemaRegistry, avro};

/// A row's state: name and amount.
type Row = (Option<String>, Option<f64>);

/// One message: partition, key, value (`None`: a tombstone).
type Produced = (i32, Vec<u8>, Option<Vec<u8>>);

/// Produces `messages` to `topic` in order, tombstones included.
fn produce(broker: &Broker, topic: &str, messages: &[Produced]) {
    let producer = broker.producer();
    for (p, key, value) in messages {
        let mut record = BaseRecord::<[u8], [u8]>::to(topic).partition(*p).key(key.as_slice());
        if let Some(v) = value {
            record = record.payload(v.as_slice());
        }
        producer.send(record).unwrap_or_else(|(e, _)| panic!("producing to {topic}: {e}"));
        producer.poll(Duration::ZERO);
    }
    producer.flush(Duration::from_secs(30)).expect("flush");
}

/// Every batch of a bounded read of the job's source by one subtask.
fn read_all(job: &TestJob, sets: &[&str], dead_letters: bool) -> Result<Vec<TableBatch>, String> {
    let mut all = vec!["source.bounded=true"];
    all.extend_from_slice(sets);
    let config = job.load(&all).map_err(|e| e.to_string())?;
    let mut source_config = config.source_config();
    if dead_letters {
        source_config.dead_letter_table = Some("lake.dead".into());
    }
    let source = Source::of_config(&source_config).map_err(|e| e.to_string())?;
    assert_eq!(source.change_key().map(<[String]>::to_vec), Some(vec!["id".to_string()]), "a change stream");
    let mut reader = source.reader(0, None).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while let Some(batch) = reader.next_batch(7).map_err(|e| e.to_string())? {
        out.push(batch);
    }
    Ok(out)
}

/// Applies a source's change batches (the table's columns id, name,
/// amount, then op, seq hi, seq lo), checking every key's positions rise
/// and every position is `(0, offset)` of a message of `partition_of(id)`.
/// Returns the final rows and how many changes were applied.
fn apply(batches: &[TableBatch], offsets: &BTreeMap<(i64, u64), u8>) -> (BTreeMap<i64, Row>, usize) {
    let mut state = BTreeMap::new();
    let mut last: BTreeMap<i64, u64> = BTreeMap::new();
    let mut applied = 0;
    for b in batches {
        let batch: &RecordBatch = &b.batch;
        let names: Vec<&str> = batch.schema_ref().fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["id", "name", "amount", "_sluice_op", "_sluice_seq_hi", "_sluice_seq_lo"]);
        let id = batch.column(0).as_primitive::<Int64Type>();
        let name = batch.column(1).as_string::<i32>();
        let amount = batch.column(2).as_primitive::<Float64Type>();
        let op = batch.column(3).as_primitive::<UInt8Type>();
        let hi = batch.column(4).as_primitive::<UInt64Type>();
        let lo = batch.column(5).as_primitive::<UInt64Type>();
        for i in 0..batch.num_rows() {
            let k = id.value(i);
            assert_eq!(hi.value(i), 0, "Kafka's hi is 0");
            assert_eq!(
                offsets.get(&(k, lo.value(i))),
                Some(&op.value(i)),
                "key {k} at offset {} is a change",
                lo.value(i)
            );
            if let Some(prev) = last.insert(k, lo.value(i)) {
                assert!(prev < lo.value(i), "key {k}: offset {} after {prev}", lo.value(i));
            }
            applied += 1;
            match op.value(i) {
                0 => {
                    let row = (
                        name.is_valid(i).then(|| name.value(i).to_string()),
                        amount.is_valid(i).then(|| amount.value(i)),
                    );
                    state.insert(k, row);
                }
                1 => {
                    state.remove(&k);
                }
                other => panic!("op {other}"),
            }
        }
    }
    (state, applied)
}

/// The change stream the tests produce, and its model: ids 0..40 over
/// `partitions` partitions (a key stays in its partition, as Debezium
/// keys its topics); snapshot reads, inserts, updates of earlier rows,
/// deletes followed by tombstones, and re-inserts after a delete.
struct Stream {
    /// (id, op as Debezium spells it, after row), in production order.
    events: Vec<(i64, &'static str, Option<Row>)>,
}

impl Stream {
    fn new() -> Self {
        let mut events = Vec::new();
        let row = |id: i64, v: i64| Some((Some(format!("order-{id}-v{v}")), Some(id as f64 * 0.5 + v as f64)));
        for id in 0..20 {
            events.push((id, "r", row(id, 0)));
        }
        for id in 20..40 {
            events.push((id, "c", row(id, 0)));
        }
        for id in (0..40).step_by(3) {
            events.push((id, "u", row(id, 1)));
        }
        for id in (0..40).step_by(5) {
            events.push((id, "d", None));
            events.push((id, "tombstone", None));
        }
        for id in (0..40).step_by(10) {
            events.push((id, "c", row(id, 2)));
        }
        for id in (1..40).step_by(7) {
            events.push((id, "u", Some((None, None))));
        }
        Self { events }
    }

    /// The final rows, applying every change in order.
    fn model(&self) -> BTreeMap<i64, Row> {
        let mut state = BTreeMap::new();
        for (id, op, after) in &self.events {
            match (*op, after) {
                ("d" | "tombstone", _) => {
                    state.remove(id);
                }
                (_, Some(row)) => {
                    state.insert(*id, row.clone());
                }
                (_, None) => unreachable!(),
            }
        }
        state
    }

    /// (id, offset) → op code of every change, the offsets as the broker
    /// gives them (per partition, from 0, in production order).
    fn offsets(&self, partitions: i32) -> BTreeMap<(i64, u64), u8> {
        let mut next = vec![0u64; partitions as usize];
        let mut out = BTreeMap::new();
        for (id, op, _) in &self.events {
            let p = (id % i64::from(partitions)) as usize;
            out.insert((*id, next[p]), if matches!(*op, "d" | "tombstone") { 1 } else { 0 });
            next[p] += 1;
        }
        out
    }
}

fn json_row(id: i64, row: &Row) -> Value {
    json!({ "id": id, "name": row.0, "amount": row.1 })
}

/// The stream as Debezium's JSON converter writes it: the envelope with
/// schemas for even ids, without for odd ones; the `before` of a delete
/// carries the key alone (Postgres' default replica identity).
fn json_messages(stream: &Stream, partitions: i32) -> Vec<Produced> {
    let mut current: BTreeMap<i64, Row> = BTreeMap::new();
    let mut out = Vec::new();
    for (i, (id, op, after)) in stream.events.iter().enumerate() {
        let wrapped = id % 2 == 0;
        let key = if wrapped {
            json!({ "schema": { "type": "struct", "fields": [{ "field": "id", "type": "int64" }] }, "payload": { "id": id } })
        } else {
            json!({ "id": id })
        };
        let p = (id % i64::from(partitions)) as i32;
        if *op == "tombstone" {
            out.push((p, key.to_string().into_bytes(), None));
            continue;
        }
        let before = if *op == "d" { Some(json!({ "id": id })) } else { current.get(id).map(|r| json_row(*id, r)) };
        let after_json = after.as_ref().map(|r| json_row(*id, r));
        match after {
            Some(r) => current.insert(*id, r.clone()),
            None => current.remove(id),
        };
        let payload = json!({
            "before": before,
            "after": after_json,
            "source": { "connector": "postgresql", "db": "shop", "lsn": 1000 + i },
            "op": op,
            "ts_ms": 1_700_000_000_000i64 + i as i64,
            "transaction": null,
        });
        let value = if wrapped {
            json!({ "schema": { "type": "struct", "name": "Envelope" }, "payload": payload })
        } else {
            payload
        };
        out.push((p, key.to_string().into_bytes(), Some(value.to_string().into_bytes())));
    }
    out
}

fn debezium_json_job(broker: &Broker, id: &str, topic: &str) -> TestJob {
    let format = format!("format = \"debezium-json\"\nkey = [\"id\"]\n{ORDER_COLUMNS}");
    kafka_job_of(broker, id, topic, 1, 30.0, &format, "")
}

#[test]
fn debezium_json_changes_reach_the_source_in_partition_order_with_offsets_as_positions() {
    let broker = Broker::start();
    broker.create_topic("pg_orders", 3);
    let stream = Stream::new();
    produce(&broker, "pg_orders", &json_messages(&stream, 3));
    let job = debezium_json_job(&broker, "k-dbz-json", "pg_orders");
    let batches = read_all(&job, &[], false).unwrap_or_else(|e| panic!("reading: {e}"));
    assert!(batches.iter().all(|b| b.bad.is_empty()));
    let (state, applied) = apply(&batches, &stream.offsets(3));
    assert_eq!(applied, stream.events.len(), "every change once");
    assert_eq!(state, stream.model(), "the final rows, key by key");
    // Deleted and not re-inserted: 5, 15, 25, 35; re-inserted: 0, 10, 20, 30.
    assert!(!state.contains_key(&5) && state.get(&10).and_then(|r| r.0.as_deref()) == Some("order-10-v2"));
}

#[test]
fn an_unknown_op_is_refused_naming_its_offset_or_set_aside_once_as_a_dead_letter() {
    let broker = Broker::start();
    broker.create_topic("pg_bad", 1);
    let event = |id: i64, op: &str| {
        let value = json!({ "before": null, "after": { "id": id, "name": format!("n{id}") }, "op": op });
        (0, json!({ "id": id }).to_string().into_bytes(), Some(value.to_string().into_bytes()))
    };
    let messages = vec![event(1, "c"), event(2, "c"), event(3, "c"), event(2, "t"), event(3, "u"), event(4, "c")];
    produce(&broker, "pg_bad", &messages);
    let job = debezium_json_job(&broker, "k-dbz-bad", "pg_bad");
    let e = read_all(&job, &[], false).expect_err("an unknown op must stop the read");
    assert!(e.contains("\"pg_bad\" partition 0 offset 3") && e.contains("op \"t\""), "{e}");
    // With dead letters: the others' changes, and the bad one once.
    let batches = read_all(&job, &[], true).unwrap_or_else(|e| panic!("reading: {e}"));
    let bad: Vec<_> = batches.iter().flat_map(|b| b.bad.iter()).collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].position, "topic \"pg_bad\" partition 0 offset 3");
    assert!(bad[0].raw.contains("\"op\":\"t\""), "{:?}", bad[0]);
    let lo: Vec<u64> =
        batches.iter().flat_map(|b| b.batch.column(5).as_primitive::<UInt64Type>().values().to_vec()).collect();
    assert_eq!(lo, vec![0, 1, 2, 4, 5]);
}

/// Offsets order a key's changes only within one partition, which the
/// partitioner keeps a message key in: a message keyed by another value
/// than its row's key (a producer keyed by another column) is a bad row.
#[test]
fn a_message_whose_key_is_not_its_rows_key_is_refused_naming_its_offset_or_set_aside_once() {
    let broker = Broker::start();
    broker.create_topic("pg_miskeyed", 1);
    let event = |key: Value, id: i64| {
        let value = json!({ "before": null, "after": { "id": id, "name": format!("n{id}") }, "op": "c" });
        (0, key.to_string().into_bytes(), Some(value.to_string().into_bytes()))
    };
    let messages = vec![
        event(json!({ "id": 1 }), 1),
        event(json!({ "id": 2 }), 2),
        event(json!({ "id": 7 }), 3),
        event(json!({ "schema": { "type": "struct" }, "payload": { "id": 4 } }), 4),
    ];
    produce(&broker, "pg_miskeyed", &messages);
    let job = debezium_json_job(&broker, "k-dbz-miskeyed", "pg_miskeyed");
    let e = read_all(&job, &[], false).expect_err("a message keyed by another value must stop the read");
    assert!(e.contains("\"pg_miskeyed\" partition 0 offset 2") && e.contains("is 7 but the row's is 3"), "{e}");
    // With dead letters: the others' changes, and the bad one once.
    let batches = read_all(&job, &[], true).unwrap_or_else(|e| panic!("reading: {e}"));
    let bad: Vec<_> = batches.iter().flat_map(|b| b.bad.iter()).collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    assert_eq!(bad[0].position, "topic \"pg_miskeyed\" partition 0 offset 2");
    assert!(bad[0].reason.contains("not the row's change key") && bad[0].raw.contains("\"id\":3"), "{:?}", bad[0]);
    let rows: Vec<(i64, u64)> = batches
        .iter()
        .flat_map(|b| {
            let id = b.batch.column(0).as_primitive::<Int64Type>();
            let lo = b.batch.column(5).as_primitive::<UInt64Type>();
            (0..b.batch.num_rows()).map(|i| (id.value(i), lo.value(i))).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(rows, vec![(1, 0), (2, 1), (4, 3)]);
}

#[test]
fn the_debezium_formats_need_a_key_in_the_rows() {
    let broker = Broker::start();
    broker.create_topic("pg_keyless", 1);
    let format = format!("format = \"debezium-json\"\n{ORDER_COLUMNS}");
    let job = kafka_job_of(&broker, "k-dbz-keyless", "pg_keyless", 1, 30.0, &format, "");
    let e = job.load(&[]).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("loaded"));
    assert!(e.contains("source.key") && e.contains("debezium-json"), "{e}");
    let e = job.load(&["source.key=[\"order_id\"]"]).err().map(|e| e.to_string()).unwrap_or_else(|| panic!("loaded"));
    assert!(e.contains("source.key") && e.contains("\"order_id\""), "{e}");
}

/// Debezium's Avro envelope of the orders table, as its Avro converter
/// registers it under `{topic}-value`.
const ENVELOPE: &str = r#"{"type":"record","name":"Envelope","namespace":"pg.public.orders","fields":[
{"name":"before","type":["null",{"type":"record","name":"Value","fields":[{"name":"id","type":"long"},{"name":"name","type":["null","string"],"default":null},{"name":"amount","type":["null","double"],"default":null}]}],"default":null},
{"name":"after","type":["null","Value"],"default":null},
{"name":"source","type":{"type":"record","name":"Source","namespace":"io.debezium.connector.postgresql","fields":[{"name":"db","type":"string"},{"name":"lsn","type":["null","long"],"default":null}]}},
{"name":"op","type":"string"},
{"name":"ts_ms","type":["null","long"],"default":null},
{"name":"transaction","type":["null",{"type":"record","name":"block","namespace":"event","fields":[{"name":"id","type":"string"}]}],"default":null}]}"#;
/// The key schema, under `{topic}-key`.
const KEY: &str =
    r#"{"type":"record","name":"Key","namespace":"pg.public.orders","fields":[{"name":"id","type":"long"}]}"#;

fn avro_row(out: &mut Vec<u8>, id: i64, row: Option<&Row>) {
    let Some((name, amount)) = row else {
        avro::long(out, 0);
        return;
    };
    avro::long(out, 1);
    avro::long(out, id);
    match name {
        Some(n) => {
            avro::long(out, 1);
            avro::string(out, n);
        }
        None => avro::long(out, 0),
    }
    match amount {
        Some(a) => {
            avro::long(out, 1);
            avro::double(out, *a);
        }
        None => avro::long(out, 0),
    }
}

/// The stream as Debezium's Avro converter writes it: wire-format keys and
/// envelopes; a delete's `before` is the whole row.
fn avro_messages(stream: &Stream, partitions: i32, value_id: u32, key_id: u32) -> Vec<Produced> {
    let mut current: BTreeMap<i64, Row> = BTreeMap::new();
    let mut out = Vec::new();
    for (i, (id, op, after)) in stream.events.iter().enumerate() {
        let mut key = Vec::new();
        avro::long(&mut key, *id);
        let key = avro::framed(key_id, &key);
        let p = (id % i64::from(partitions)) as i32;
        if *op == "tombstone" {
            out.push((p, key, None));
            continue;
        }
        let mut datum = Vec::new();
        avro_row(&mut datum, *id, current.get(id));
        avro_row(&mut datum, *id, after.as_ref());
        avro::string(&mut datum, "shop");
        avro::long(&mut datum, 1);
        avro::long(&mut datum, 1000 + i as i64);
        avro::string(&mut datum, op);
        avro::long(&mut datum, 1);
        avro::long(&mut datum, 1_700_000_000_000 + i as i64);
        avro::long(&mut datum, 0);
        match after {
            Some(r) => current.insert(*id, r.clone()),
            None => current.remove(id),
        };
        out.push((p, key, Some(avro::framed(value_id, &datum))));
    }
    out
}

#[test]
fn debezium_avro_envelopes_through_the_registry_reach_the_source_as_changes() {
    let broker = Broker::start();
    let registry = SchemaRegistry::start().expect("registry double");
    broker.create_topic("pg_avro", 2);
    let value_id = registry.register("pg_avro-value", ENVELOPE);
    let key_id = registry.register("pg_avro-key", KEY);
    let stream = Stream::new();
    let mut messages = avro_messages(&stream, 2, value_id, key_id);
    // An unknown op, at partition 1's next offset.
    let mut bad = Vec::new();
    avro_row(&mut bad, 41, None);
    avro_row(&mut bad, 41, Some(&(Some("x".into()), None)));
    avro::string(&mut bad, "shop");
    avro::long(&mut bad, 0);
    avro::string(&mut bad, "m");
    avro::long(&mut bad, 0);
    avro::long(&mut bad, 0);
    let bad_offset = messages.iter().filter(|m| m.0 == 1).count();
    messages.push((1, b"{\"id\":41}".to_vec(), Some(avro::framed(value_id, &bad))));
    produce(&broker, "pg_avro", &messages);
    let format = format!("format = \"debezium-avro\"\nkey = [\"id\"]\nschema_registry = \"{}\"", registry.url());
    let job = kafka_job_of(&broker, "k-dbz-avro", "pg_avro", 1, 30.0, &format, "");
    let e = read_all(&job, &[], false).expect_err("op m must stop the read");
    assert!(e.contains(&format!("\"pg_avro\" partition 1 offset {bad_offset}")) && e.contains("op \"m\""), "{e}");
    let batches = read_all(&job, &[], true).unwrap_or_else(|e| panic!("reading: {e}"));
    let bad: Vec<_> = batches.iter().flat_map(|b| b.bad.iter()).collect();
    assert_eq!(bad.len(), 1, "{bad:?}");
    let (state, applied) = apply(&batches, &stream.offsets(2));
    assert_eq!(applied, stream.events.len(), "every change once");
    assert_eq!(state, stream.model(), "the final rows, key by key");
    // The envelope's Value record is the table: no source, op or ts_ms column.
    assert_eq!(batches[0].batch.num_columns(), 6);
}

/// The rows of `lake.<table>` as PyIceberg reads them, sorted by id,
/// after checking that DuckDB's `iceberg_scan` reads the same rows.
fn landed(job: &TestJob, table: &str) -> BTreeMap<i64, Row> {
    let warehouse = job.dir.path().join("warehouse");
    let script = format!(
        "{}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table(name)\n\
         a = t.scan(selected_fields=('id', 'name', 'amount')).to_arrow()\n\
         py = sorted([i, n, v] for i, n, v in zip(a.column('id').to_pylist(), a.column('name').to_pylist(), a.column('amount').to_pylist()))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted([i, n, v] for i, n, v in con.execute('select id, name, amount from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}}: {{py}} / {{dd}}')\n\
         print(json.dumps(py))",
        sluice_tests::DUCKDB_ICEBERG
    );
    let out = sluice_tests::python(&script, &[&warehouse.display().to_string(), &format!("lake.{table}")])
        .unwrap_or_else(|e| panic!("reading lake.{table} with PyIceberg and DuckDB: {e}"));
    let rows: Vec<(i64, Option<String>, Option<f64>)> = serde_json::from_str(out.trim()).expect("rows as JSON");
    let mut out = BTreeMap::new();
    for (id, name, amount) in rows {
        assert!(out.insert(id, (name, amount)).is_none(), "key {id} holds two rows");
    }
    out
}

#[test]
fn debezium_json_lands_in_an_iceberg_upsert_table_key_by_key_across_runs() {
    let broker = Broker::start();
    broker.create_topic("pg_lake", 3);
    let stream = Stream::new();
    let messages = json_messages(&stream, 3);
    // Two runs: the second updates and deletes rows the first committed.
    let half = messages.len() / 2;
    produce(&broker, "pg_lake", &messages[..half]);
    let format = format!("format = \"debezium-json\"\nkey = [\"id\"]\n{ORDER_COLUMNS}");
    let mut job = kafka_job_of(&broker, "k-dbz-lake", "pg_lake", 2, 0.3, &format, "");
    job.toml = job.toml.replace("table = \"lake.{topic}\"", "table = \"lake.{topic}\"\nmode = \"upsert\"");
    let run = |job: &TestJob| {
        job.run_opts(&["source.bounded=true"], sluice::engine::RunOptions::default())
            .unwrap_or_else(|e| panic!("bounded run: {e}"))
    };
    run(&job);
    let first = Stream { events: stream.events[..half].to_vec() };
    assert_eq!(landed(&job, "pg_lake"), first.model(), "after the first run");
    produce(&broker, "pg_lake", &messages[half..]);
    let second = run(&job);
    assert_eq!(second.rows_this_run, (messages.len() - half) as u64, "{second}");
    assert_eq!(landed(&job, "pg_lake"), stream.model(), "after the second run");
    // Nothing new: the table stays as it is.
    run(&job);
    assert_eq!(landed(&job, "pg_lake"), stream.model(), "after a run with nothing new");
}
