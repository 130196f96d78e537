//! The Kafka example as docs/src/sources/kafka.md ("Try it") shows it,
//! against a real broker (tansu): the page's producer command,
//! `examples/kafka_produce.py`, run with the tests' Python and this test's
//! broker in place of `127.0.0.1:9092`, then `sluice run
//! examples/kafka.toml` with the example's own job file, redirected into a
//! temp dir and bounded (the page's run goes on until Ctrl-C). The
//! producer makes the topic with 3 partitions, and a second run of it (the
//! topic there, FIRST_ID given) adds to it; every order it sent lands in
//! `kafka.orders` exactly once, as PyIceberg and DuckDB both read it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};

use sluice_tests::kafka::Broker;
use sluice_tests::run_example;

/// The producer command the page shows, word for word; the test runs it with
/// its own broker's address and the tests' Python.
const PRODUCE: &str = "python3 examples/kafka_produce.py 127.0.0.1:9092 orders 100000";

/// How many orders [`PRODUCE`] sends.
const ORDERS: i64 = 100_000;

/// Runs `python3 examples/kafka_produce.py ARGS` from the repository root
/// with the tests' Python; asserts it succeeded and said what it sent.
fn run_producer(broker: &Broker, args: &[&str], sent: i64) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lives in the workspace");
    let out = Command::new(sluice_tests::python_interpreter())
        .arg("examples/kafka_produce.py")
        .args(args)
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("running examples/kafka_produce.py {args:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "examples/kafka_produce.py {args:?} failed ({}): {stdout}{}\nbroker log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        broker.log_text()
    );
    assert!(stdout.contains(&format!("sent {sent} orders to orders on {}", broker.bootstrap())), "{stdout}");
}

/// Runs [`PRODUCE`] against `broker`.
fn produce(broker: &Broker) {
    let words: Vec<&str> = PRODUCE.split_whitespace().collect();
    let [python3, script, address, topic, count] = words.as_slice() else { panic!("{PRODUCE}: five words") };
    assert_eq!(
        (*python3, *script, *address, count.parse::<i64>().ok()),
        ("python3", "examples/kafka_produce.py", "127.0.0.1:9092", Some(ORDERS))
    );
    run_producer(broker, &[broker.bootstrap().as_str(), topic, count], ORDERS);
}

/// How many partitions `topic` has, as the broker's metadata says (asked
/// with rdkafka, not the producer's client).
fn partitions(broker: &Broker, topic: &str) -> usize {
    let consumer: BaseConsumer =
        ClientConfig::new().set("bootstrap.servers", broker.bootstrap()).create().expect("a metadata client");
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)).expect("the topic's metadata");
    let found = metadata.topics().iter().find(|t| t.name() == topic).expect("the topic in the metadata");
    found.partitions().len()
}

#[test]
fn the_pages_producer_and_example_job_land_every_order_once() {
    let broker = Broker::start();
    produce(&broker);
    // The topic is there now: a second run leaves it be and adds orders
    // from FIRST_ID on.
    run_producer(&broker, &[broker.bootstrap().as_str(), "orders", "1000", &ORDERS.to_string()], 1000);
    let total = ORDERS + 1000;

    let dir = tempfile::tempdir().expect("temp dir");
    let warehouse = dir.path().join("warehouse");
    std::fs::create_dir_all(&warehouse).expect("warehouse dir");
    let sets = [
        format!("sink.plugin={}", sluice_tests::ICEBERG_PLUGIN),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.catalog.database={}", warehouse.join("catalog.db").display()),
        format!("sink.catalog.warehouse={}", warehouse.display()),
        format!("source.brokers=[\"{}\"]", broker.bootstrap()),
        // The page's run goes on until Ctrl-C; this one ends at the end
        // offsets seen at its start, as `--until-end` does.
        "source.bounded=true".to_string(),
    ];
    let (code, stdout, err) = run_example("kafka.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}\nbroker log:\n{}", broker.log_text());
    assert!(stdout.contains(&format!("job kafka-orders finished: {total} rows")), "{stdout}");
    assert!(stdout.contains("source lag orders 0"), "a bounded run reads to the end: {stdout}");
    assert_eq!(partitions(&broker, "orders"), 3, "the producer makes the topic with 3 partitions");
    assert_eq!(sluice_tests::readers_ids(&warehouse, "kafka.orders"), (0..total).collect::<Vec<i64>>());
}
