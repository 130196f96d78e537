//! Kafka → Iceberg (and the BigQuery double) against a real broker (tansu,
//! see `tests/src/kafka.rs`): every message lands exactly once, compared by
//! key and value, across resumes, SIGKILLs, SIGTERMs, partitions added
//! mid-run and bad messages.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use arrow_array::{Array, Int64Array, RecordBatch};
use sluice::engine::RunOptions;
use sluice_tests::kafka::{Broker, ORDER_COLUMNS, assert_orders, kafka_job, order_schema, orders};
use sluice_tests::{TestJob, catalog, read_iceberg_as, sluice_run};

fn warehouse(job: &TestJob) -> std::path::PathBuf {
    job.dir.path().join("warehouse")
}

/// The rows of `lake.<table>`, sorted by id.
fn landed(job: &TestJob, table: &str) -> RecordBatch {
    read_iceberg_as(&catalog(&warehouse(job)), &format!("lake.{table}"), &order_schema()).rows
}

fn run_bounded(job: &TestJob) -> sluice::engine::RunSummary {
    job.run_opts(&["source.bounded=true"], RunOptions::default()).unwrap_or_else(|e| panic!("bounded run: {e}"))
}

#[test]
fn three_partitions_over_two_subtasks_land_every_message_once_across_resumes() {
    let broker = Broker::start();
    broker.create_topic("orders", 3);
    broker.produce("orders", &orders(0, 3000, 3));
    let job = kafka_job(&broker, "k-three", "orders", 2, 0.5, "");
    let first = run_bounded(&job);
    assert_eq!(first.rows_total, 3000, "{first}");
    assert_orders(&landed(&job, "orders"), 0..3000);
    // More messages; the next run starts at the recorded offsets.
    broker.produce("orders", &orders(3000, 4500, 3));
    let second = run_bounded(&job);
    assert_eq!(second.rows_this_run, 1500, "{second}");
    assert_orders(&landed(&job, "orders"), 0..4500);
    // Nothing new: nothing read, nothing committed.
    let table = read_iceberg_as(&catalog(&warehouse(&job)), "lake.orders", &order_schema());
    let snapshots = table.commits.len();
    let third = run_bounded(&job);
    assert_eq!(third.rows_this_run, 0, "{third}");
    let table = read_iceberg_as(&catalog(&warehouse(&job)), "lake.orders", &order_schema());
    assert_eq!(table.commits.len(), snapshots, "a run with nothing new made a snapshot");
    table.assert_no_checkpoint_twice();
}

#[test]
fn a_bad_message_stops_the_run_naming_its_offset_and_nothing_of_its_checkpoint_lands() {
    let broker = Broker::start();
    broker.create_topic("bad", 1);
    let mut messages = orders(0, 100, 1);
    messages.push((0, "k100".into(), br#"{"id":100,"name":"x","amount":"lots"}"#.to_vec()));
    messages.extend(orders(101, 150, 1));
    broker.produce("bad", &messages);
    let job = kafka_job(&broker, "k-bad", "bad", 1, 30.0, "");
    let e = job.run_opts(&["source.bounded=true"], RunOptions::default()).expect_err("a bad message must stop the run");
    let text = e.to_string();
    assert!(text.contains("\"bad\" partition 0 offset 100"), "{text}");
    assert!(text.contains("amount") || text.contains("lots"), "the column or value is named: {text}");
    // One checkpoint would have held the bad message with the good ones: none of it landed.
    let table = catalog(&warehouse(&job));
    let ident = iceberg::TableIdent::from_strs(["lake", "bad"]).expect("ident");
    if let Ok(t) = table.load(&ident) {
        assert!(t.metadata().current_snapshot().is_none(), "rows of the failed checkpoint are visible");
    }
}

#[test]
fn a_resume_reading_other_topics_is_refused() {
    let broker = Broker::start();
    broker.create_topic("one", 1);
    broker.create_topic("two", 1);
    broker.produce("one", &orders(0, 10, 1));
    let job = kafka_job(&broker, "k-topics", "one", 1, 0.5, "");
    run_bounded(&job);
    let e = job
        .run_opts(&["source.bounded=true", "source.topics=[\"two\"]"], RunOptions::default())
        .expect_err("other topics must be refused");
    assert!(e.to_string().contains("it read topics one, and the job now reads two"), "{e}");
}

/// `sluice run` of the job, unbounded, with its stderr kept.
fn start(job: &TestJob) -> Child {
    std::fs::write(job.path(), &job.toml).expect("job file");
    sluice_run(job, &[]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting sluice")
}

fn signal(child: &Child, sig: &str) {
    let status =
        std::process::Command::new("kill").args([&format!("-{sig}"), &child.id().to_string()]).status().expect("kill");
    assert!(status.success());
}

/// Waits until the job's table holds at least `rows` rows.
fn wait_for_rows(job: &TestJob, table: &str, rows: usize, child: &mut Child) {
    let start = Instant::now();
    loop {
        let ident = iceberg::TableIdent::from_strs(["lake", table]).expect("ident");
        if catalog(&warehouse(job)).load(&ident).is_ok() && landed(job, table).num_rows() >= rows {
            return;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice ended ({status}) before {rows} rows landed");
        }
        assert!(start.elapsed() < Duration::from_secs(120), "{rows} rows did not land within 2 minutes");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn sigterm_mid_stream_ends_with_a_committed_checkpoint_and_exit_0_then_resumes() {
    let broker = Broker::start();
    broker.create_topic("stream", 3);
    broker.produce("stream", &orders(0, 2000, 3));
    let job = kafka_job(&broker, "k-term", "stream", 2, 0.5, "");
    let mut child = start(&job);
    wait_for_rows(&job, "stream", 2000, &mut child);
    broker.produce("stream", &orders(2000, 2600, 3));
    signal(&child, "TERM");
    let out = child.wait_with_output().expect("reaping sluice");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "a clean stop exits 0: {stderr}");
    assert!(stdout.contains("stopped on request after checkpoint"), "{stdout}");
    assert!(stdout.contains("next offsets stream[0]="), "it says where it stopped: {stdout}");
    // Whatever it read is committed; the rest comes with the next run.
    broker.produce("stream", &orders(2600, 3000, 3));
    run_bounded(&job);
    assert_orders(&landed(&job, "stream"), 0..3000);
}

#[test]
fn a_second_signal_stops_at_once_and_the_next_run_resumes_exactly_once() {
    let broker = Broker::start();
    broker.create_topic("twice", 2);
    broker.produce("twice", &orders(0, 1000, 2));
    let job = kafka_job(&broker, "k-twice", "twice", 2, 0.5, "");
    let mut child = start(&job);
    wait_for_rows(&job, "twice", 1000, &mut child);
    signal(&child, "INT");
    signal(&child, "INT");
    let status = child.wait().expect("reaping sluice");
    assert!(status.code() == Some(130) || status.success(), "{status}");
    broker.produce("twice", &orders(1000, 1500, 2));
    run_bounded(&job);
    assert_orders(&landed(&job, "twice"), 0..1500);
}

#[test]
fn sigkills_at_random_moments_while_producers_write_lose_and_double_nothing() {
    use rand::Rng;
    let broker = Broker::start();
    broker.create_topic("chaos", 3);
    let job = kafka_job(&broker, "k-kill", "chaos", 2, 0.3, "");
    std::fs::write(job.path(), &job.toml).expect("job file");
    let bootstrap = broker.bootstrap();
    let total: i64 = 6000;
    // The producer writes on while runs are killed.
    let producer = std::thread::spawn(move || {
        let broker = ProducerOnly(bootstrap);
        for chunk in 0..(total / 200) {
            broker.produce("chaos", &orders(chunk * 200, (chunk + 1) * 200, 3));
            std::thread::sleep(Duration::from_millis(40));
        }
    });
    let mut rng = rand::rng();
    for _ in 0..4 {
        let mut child = sluice_run(&job, &[]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("sluice");
        std::thread::sleep(Duration::from_millis(rng.random_range(1500..4000)));
        if let Ok(Some(status)) = child.try_wait() {
            panic!("an unbounded run ended on its own ({status})");
        }
        child.kill().expect("SIGKILL");
        let _ = child.wait();
    }
    producer.join().expect("producer");
    run_bounded(&job);
    assert_orders(&landed(&job, "chaos"), 0..total);
    read_iceberg_as(&catalog(&warehouse(&job)), "lake.chaos", &order_schema()).assert_no_checkpoint_twice();
}

/// A producer on a broker another thread owns.
struct ProducerOnly(String);

impl ProducerOnly {
    fn produce(&self, topic: &str, messages: &[(i32, String, Vec<u8>)]) {
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
        let producer: BaseProducer =
            rdkafka::ClientConfig::new().set("bootstrap.servers", &self.0).create().expect("producer");
        for (p, k, v) in messages {
            producer
                .send(BaseRecord::to(topic).partition(*p).key(k.as_bytes()).payload(v.as_slice()))
                .unwrap_or_else(|(e, _)| panic!("producing: {e}"));
        }
        producer.flush(Duration::from_secs(30)).expect("flush");
    }
}

/// Partitions that appear during a run are found and read from their
/// beginning. tansu 0.6 serves no CreatePartitions, so the partitions here
/// come with a topic created mid-run that the job's pattern matches: the
/// same discovery (a (topic, partition) the reader did not own before),
/// and a new table for the sink at the next checkpoint.
#[test]
fn partitions_that_appear_mid_run_are_read_from_their_beginning() {
    let broker = Broker::start();
    broker.create_topic("grow_a", 2);
    broker.produce("grow_a", &orders(0, 400, 2));
    let mut job = kafka_job(&broker, "k-grow", "grow_a", 2, 0.5, "");
    job.toml = job.toml.replace("topics = [\"grow_a\"]", "topic_pattern = \"grow_.*\"");
    assert!(job.toml.contains("topic_pattern"), "{}", job.toml);
    let mut child = start(&job);
    wait_for_rows(&job, "grow_a", 400, &mut child);
    broker.create_topic("grow_b", 3);
    broker.produce("grow_b", &orders(400, 700, 3));
    broker.produce("grow_a", &orders(700, 800, 2));
    wait_for_rows(&job, "grow_b", 300, &mut child);
    wait_for_rows(&job, "grow_a", 500, &mut child);
    signal(&child, "TERM");
    let out = child.wait_with_output().expect("reaping sluice");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("grow_b[2]="), "the new partitions are in the checkpoint: {stdout}");
    let mut a: Vec<i64> = (0..400).chain(700..800).collect();
    a.sort_unstable();
    assert_orders(&landed(&job, "grow_a"), a.into_iter());
    assert_orders(&landed(&job, "grow_b"), 400..700);
}

#[test]
fn a_quiet_topic_costs_no_commits() {
    let broker = Broker::start();
    broker.create_topic("quiet", 1);
    broker.produce("quiet", &orders(0, 50, 1));
    let job = kafka_job(&broker, "k-quiet", "quiet", 1, 0.2, "");
    let mut child = start(&job);
    wait_for_rows(&job, "quiet", 50, &mut child);
    let before = read_iceberg_as(&catalog(&warehouse(&job)), "lake.quiet", &order_schema()).commits.len();
    std::thread::sleep(Duration::from_secs(3));
    let after = read_iceberg_as(&catalog(&warehouse(&job)), "lake.quiet", &order_schema()).commits.len();
    signal(&child, "TERM");
    let out = child.wait_with_output().expect("reaping");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(before, after, "checkpoints of a quiet topic made snapshots");
}

#[test]
fn committed_offsets_reach_the_consumer_group_for_lag_tooling() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let broker = Broker::start();
    broker.create_topic("lagged", 2);
    broker.produce("lagged", &orders(0, 600, 2));
    let job = kafka_job(&broker, "k-group", "lagged", 2, 0.3, "group_id = \"sluice-orders\"");
    run_bounded(&job);
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.bootstrap())
        .set("group.id", "sluice-orders")
        .create()
        .expect("consumer");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition("lagged", 0);
    tpl.add_partition("lagged", 1);
    // The group commit runs beside the run, and the run's end waits for
    // its last one: the offsets are there when the run has returned.
    let committed = consumer.committed_offsets(tpl, Duration::from_secs(10)).expect("committed offsets");
    let offsets: Vec<_> = committed.elements().iter().map(|e| e.offset()).collect();
    assert_eq!(offsets, vec![rdkafka::Offset::Offset(300), rdkafka::Offset::Offset(300)], "group offsets");
}

#[test]
fn raw_messages_keep_key_headers_partition_offset_and_timestamp() {
    let broker = Broker::start();
    broker.create_topic("raw", 1);
    broker.produce("raw", &orders(0, 20, 1));
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("out/files");
    let toml = format!(
        r#"
[job]
id = "k-raw"
parallelism = 1
state_dir = "state"
[source]
kind = "kafka"
brokers = ["{}"]
topics = ["raw"]
format = "raw"
[sink]
id = "files"
plugin = "{}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#,
        broker.bootstrap(),
        sluice_tests::FILES_PLUGIN
    );
    let job = TestJob { dir, toml };
    run_bounded(&job);
    let rows = sluice_tests::read_parquet_tree(&out);
    assert_eq!(rows.num_rows(), 20);
    let offsets = rows.column_by_name("offset").expect("offset").as_any().downcast_ref::<Int64Array>().expect("i64");
    let mut got: Vec<i64> = offsets.values().to_vec();
    got.sort_unstable();
    assert_eq!(got, (0..20).collect::<Vec<_>>());
    let key = rows.column_by_name("key").expect("key");
    assert_eq!(key.null_count(), 0);
    assert!(rows.column_by_name("timestamp").expect("timestamp").null_count() == 0);
}

#[test]
fn three_partitions_over_two_subtasks_land_once_in_bigquery() {
    use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
    use sluice_bigquery_double::proto::{TableFieldSchema, TableSchema};
    use sluice_bigquery_double::{BigQueryDouble, column};
    const TABLE: &str = "projects/p/datasets/d/tables/orders";
    let broker = Broker::start();
    broker.create_topic("bq", 3);
    broker.produce("bq", &orders(0, 2000, 3));
    let d = BigQueryDouble::start().expect("double");
    let fields: Vec<TableFieldSchema> = vec![
        column("id", Type::Int64, Mode::Required),
        column("name", Type::String, Mode::Nullable),
        column("amount", Type::Double, Mode::Nullable),
    ];
    d.create_table(TABLE, TableSchema { fields });
    let dir = tempfile::tempdir().expect("temp dir");
    let toml = format!(
        r#"
[job]
id = "k-bq"
parallelism = 2
state_dir = "state"
[job.checkpoint]
interval_secs = 0.3
[source]
kind = "kafka"
brokers = ["{}"]
topics = ["bq"]
format = "json"
batch_rows = 300
{ORDER_COLUMNS}
[sink]
id = "bq"
plugin = "{}"
[sink.options]
table = "{TABLE}"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{}"
[sink.sandbox]
memory_mb = 512
"#,
        broker.bootstrap(),
        sluice_tests::BIGQUERY_PLUGIN,
        d.address()
    );
    let job = TestJob { dir, toml };
    run_bounded(&job);
    broker.produce("bq", &orders(2000, 2600, 3));
    run_bounded(&job);
    let mut rows: Vec<(i64, String, f64)> = d
        .visible_rows(TABLE)
        .iter()
        .map(|r| {
            let id = r["id"].as_str().and_then(|s| s.parse().ok()).or_else(|| r["id"].as_i64()).expect("id");
            (id, r["name"].as_str().expect("name").to_string(), r["amount"].as_f64().expect("amount"))
        })
        .collect();
    rows.sort_by_key(|r| r.0);
    let expected: Vec<(i64, String, f64)> = (0..2600).map(|k| (k, format!("order-{k}"), k as f64 * 0.25)).collect();
    assert_eq!(rows.len(), expected.len(), "rows landed in BigQuery");
    assert_eq!(rows, expected);
}

/// `format = "json"` without `columns`: the columns are the target table's,
/// loaded from the sink's catalog; a job whose table does not exist yet is
/// refused before it writes anything.
#[test]
fn json_columns_come_from_the_target_table_when_not_declared() {
    let broker = Broker::start();
    broker.create_topic("declared", 2);
    broker.create_topic("undeclared", 2);
    broker.produce("declared", &orders(0, 500, 2));
    broker.produce("undeclared", &orders(500, 1000, 2));
    let declared = kafka_job(&broker, "k-declared", "declared", 2, 0.5, "");
    // Another job, without columns, into the first one's table.
    let mut undeclared = kafka_job(&broker, "k-undeclared", "undeclared", 2, 0.5, "");
    undeclared.toml = undeclared
        .toml
        .replace(ORDER_COLUMNS, "")
        .replace(&warehouse(&undeclared).display().to_string(), &warehouse(&declared).display().to_string())
        .replace("lake.{topic}", "lake.declared");
    assert!(!undeclared.toml.contains("columns"), "{}", undeclared.toml);
    let e = undeclared.run_opts(&["source.bounded=true"], RunOptions::default()).expect_err("no table, no columns");
    let text = e.to_string();
    assert!(text.contains("come from the target table") && text.contains("\"lake.declared\" does not exist"), "{text}");
    assert!(!undeclared.state().exists(), "a refused job made its state directory");

    run_bounded(&declared);
    let s = run_bounded(&undeclared);
    assert_eq!(s.rows_total, 500, "{s}");
    assert_orders(&landed(&declared, "declared"), 0..1000);
}

/// A bounded run ends at the ends it fixed at its start even while a
/// producer keeps writing; what came after is read by the next run.
#[test]
fn a_bounded_run_ends_while_producers_keep_writing() {
    let broker = Broker::start();
    broker.create_topic("live", 3);
    broker.produce("live", &orders(0, 2000, 3));
    let job = kafka_job(&broker, "k-live", "live", 2, 0.5, "");
    let writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let produced = std::thread::scope(|s| {
        let producer = s.spawn(|| {
            let mut next = 2000;
            while writing.load(std::sync::atomic::Ordering::SeqCst) {
                broker.produce("live", &orders(next, next + 50, 3));
                next += 50;
                std::thread::sleep(Duration::from_millis(20));
            }
            next
        });
        let started = Instant::now();
        let first = run_bounded(&job);
        let took = started.elapsed();
        writing.store(false, std::sync::atomic::Ordering::SeqCst);
        let produced = producer.join().expect("producer");
        assert!(first.rows_total >= 2000, "{first}");
        assert!(first.rows_total < produced as u64, "the bounded run read all that was written after its start");
        assert!(took < Duration::from_secs(60), "the bounded run took {took:?}");
        produced
    });
    let second = run_bounded(&job);
    assert_eq!(second.rows_total, produced as u64, "{second}");
    assert_orders(&landed(&job, "live"), 0..produced);
}

/// Offsets mean nothing in another cluster whose topic has the same name:
/// a resume against it is refused, naming both cluster ids.
#[test]
fn a_resume_against_another_cluster_is_refused() {
    let first = Broker::start_as("cluster-one");
    first.create_topic("same", 1);
    first.produce("same", &orders(0, 100, 1));
    let job = kafka_job(&first, "k-cluster", "same", 1, 0.5, "");
    assert_eq!(run_bounded(&job).rows_total, 100);
    let other = Broker::start_as("cluster-two");
    other.create_topic("same", 1);
    other.produce("same", &orders(0, 300, 1));
    let brokers = format!("source.brokers=[\"{}\"]", other.bootstrap());
    let e = job
        .run_opts(&["source.bounded=true", &brokers], RunOptions::default())
        .expect_err("another cluster must be refused");
    let text = e.to_string();
    assert!(text.contains("\"cluster-one\"") && text.contains("\"cluster-two\""), "{text}");
    assert_orders(&landed(&job, "same"), 0..100);
}

/// `job.bad_rows = "dead-letter"`: messages that do not fit the columns (a
/// wrong type, no JSON, two objects in one message, binary bytes) land in
/// the dead-letter table with their topic, partition and offset, each
/// once, through a crash during the commit of the checkpoint that holds
/// them (the run's one: a resume in the middle of a produced batch of a
/// topic nobody writes to stalls on tansu 0.6, whose fetch answers
/// nothing there); every other message lands once, by key and value.
#[test]
fn bad_messages_become_dead_letters_once_through_a_crash() {
    use sluice::engine::{CrashPoint, Fault, Faults};
    let broker = Broker::start();
    broker.create_topic("dl", 2);
    let mut messages = orders(0, 600, 2);
    // (index in `messages`, partition, value); a message's offset is how
    // many of its partition's came before it.
    let bad: [(usize, i32, &[u8]); 4] = [
        (50, 0, br#"{"id":9000,"name":"x","amount":"lots"}"#),
        (51, 1, b"not json at all"),
        (301, 1, br#"{"id":9001}{"id":9002}"#),
        (450, 0, &[0xff, 0x00, 0x01]),
    ];
    for (k, (at, p, value)) in bad.iter().enumerate() {
        messages.insert(*at, (*p, format!("bad{k}"), value.to_vec()));
    }
    let mut want = std::collections::BTreeMap::new();
    for (at, p, value) in bad {
        let offset = messages[..at].iter().filter(|m| m.0 == p).count();
        let raw = match std::str::from_utf8(value) {
            Ok(text) => text.to_string(),
            Err(_) => "base64:/wAB".to_string(),
        };
        want.insert(format!("topic \"dl\" partition {p} offset {offset}"), raw);
    }
    broker.produce("dl", &messages);
    let job = kafka_job(&broker, "k-dl", "dl", 2, 600.0, "");
    let sets = ["source.bounded=true", "job.bad_rows=\"dead-letter\"", "job.dead_letter.table=\"lake.dl_dead\""];
    let crash = Fault { point: CrashPoint::DuringCommit, checkpoint: 1, subtask: 0 };
    let opts = RunOptions { faults: Faults { crash: Some(crash), ..Faults::default() }, ..RunOptions::default() };
    let e = job.run_opts(&sets, opts).expect_err("the injected crash");
    assert!(e.is_injected_crash(), "{e}");
    let summary = job.run_opts(&sets, RunOptions::default()).unwrap_or_else(|e| panic!("recovery: {e}"));
    assert_eq!(summary.dead_letters, Some(("lake.dl_dead".to_string(), want.len() as u64)), "{summary}");
    assert_orders(&landed(&job, "dl"), 0..600);
    let out = sluice_tests::python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         print(json.dumps(cat.load_table('lake.dl_dead').scan().to_arrow().to_pylist()))",
        &[&warehouse(&job).display().to_string()],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
    let letters: Vec<serde_json::Value> = serde_json::from_str(out.trim()).expect("json");
    let got: std::collections::BTreeMap<String, String> = letters
        .iter()
        .map(|l| (l["source_position"].as_str().unwrap_or("").to_string(), l["raw"].as_str().unwrap_or("").to_string()))
        .collect();
    assert_eq!(letters.len(), want.len(), "each dead letter once: {letters:?}");
    assert_eq!(got, want);
    for l in &letters {
        assert_eq!(l["job"], "k-dl", "{l}");
        assert_eq!(l["target_table"], "", "a single topic's table is unnamed: {l}");
        assert!(!l["reason"].as_str().unwrap_or("").is_empty(), "{l}");
    }
    // A rerun reads nothing new and adds nothing.
    let again = job.run_opts(&sets, RunOptions::default()).unwrap_or_else(|e| panic!("rerun: {e}"));
    assert_eq!(again.rows_this_run, 0, "{again}");
}

/// A dead-letter table that is one of the topics read is refused before
/// anything is written: named as a listed topic when the job loads, and
/// when a topic pattern matches it, when the source opens.
#[test]
fn a_dead_letter_table_among_the_topics_is_refused() {
    let broker = Broker::start();
    broker.create_topic("dlx", 1);
    let job = kafka_job(&broker, "k-dl-clash", "dlx", 1, 30.0, "");
    let e = job.load(&["job.bad_rows=\"dead-letter\"", "job.dead_letter.table=\"dlx\""]).expect_err("refused");
    assert!(e.to_string().contains("job.dead_letter.table") && e.to_string().contains("topic"), "{e}");
    let mut job = kafka_job(&broker, "k-dl-pattern", "dlx", 1, 30.0, "");
    job.toml = job.toml.replace("topics = [\"dlx\"]", "topic_pattern = \"dl.*\"");
    assert!(job.toml.contains("topic_pattern"), "{}", job.toml);
    let sets = ["source.bounded=true", "job.bad_rows=\"dead-letter\"", "job.dead_letter.table=\"dlx\""];
    let e = job.run_opts(&sets, RunOptions::default()).expect_err("refused");
    assert!(e.to_string().contains("the dead-letter table"), "{e}");
    assert!(!warehouse(&job).join("lake").exists(), "something was written");
}
