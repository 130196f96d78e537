//! The Kafka source's benchmarks, against a real broker (tansu, as in the
//! tests), each beside a baseline measured in the same run:
//!
//! 1. throughput: the generator's rows, produced beforehand as one JSON
//!    message each to a topic of three partitions, read by a bounded Kafka
//!    job into the Iceberg plugin, beside the same rows from the generator
//!    into the same plugin, at the same parallelism, the same rows and the
//!    same rows per snapshot, and beside bare rdkafka consumers reading the
//!    same messages (the broker's pace). CPU-seconds are reported beside
//!    wall time: the source must not be the bottleneck;
//! 2. latency: an unbounded job with a checkpoint every second while a
//!    producer writes at a steady rate; for each message, the time from its
//!    send to the first moment the table's current snapshot holds it (a
//!    watcher polls the catalog every 20 ms and scans each new snapshot).
//!    Median and p99, beside the checkpoint interval as the baseline.
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin kafka-bench`
//! (the broker: `SLUICE_TANSU`, or what `tests/run` installs).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arrow_array::{Array, Int64Array};
use clap::Parser;
use futures::TryStreamExt;
use iceberg::{Catalog, TableIdent};
use sluice_bench::kafka::Broker;
use sluice_bench::{Measured, generator_job_toml, measure, plugin, print_ratio_table, run_quiet, run_quiet_with};
use sluice_engine::plugin::PluginHost;
use sluice_engine::source::generator::Generator;
use sluice_engine::{RunOptions, Stop};

#[derive(Parser)]
struct Args {
    /// Messages (rows) per measured run of the throughput comparison.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Rows per checkpoint (per snapshot), over all writers.
    #[arg(long, default_value_t = 250_000)]
    checkpoint_rows: u64,
    /// Writers (subtasks) on both sides.
    #[arg(long, default_value_t = 2)]
    parallelism: u32,
    /// Repetitions of each path (the tables show the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seconds the latency run's producer writes for.
    #[arg(long, default_value_t = 30)]
    latency_secs: u64,
    /// Messages per second the latency run's producer writes.
    #[arg(long, default_value_t = 2_000)]
    rate: u64,
    /// Only these sections: `throughput`, `latency` (both when absent).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

const BATCH_ROWS: u64 = 8192;
const PARTITIONS: i32 = 3;

fn host() -> Result<PluginHost> {
    let cache = sluice_bench::workspace().join("target/bench-component-cache");
    Ok(PluginHost::new(Some(cache))?)
}

fn iceberg_sink(wasm: &Path, table: &str) -> String {
    format!(
        r#"[sink]
plugin = "{wasm}"
[sink.options]
table = "{table}"
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "warehouse"
[sink.sandbox]
memory_mb = 2048
"#,
        wasm = wasm.display(),
    )
}

/// The `[source]` columns of the generator's rows (its schema, declared).
const GENERATOR_COLUMNS: &str = r#"columns = [
  { name = "id", type = "long", nullable = false },
  { name = "qty", type = "int", nullable = false },
  { name = "price", type = "double", nullable = false },
  { name = "amount", type = "decimal(18,2)", nullable = false },
  { name = "name", type = "string", nullable = false },
  { name = "note", type = "string" },
  { name = "day", type = "date", nullable = false },
  { name = "ts", type = "timestamp", nullable = false },
]"#;

/// A Kafka job reading `topic` from the start; `checkpoint` is the
/// `[job.checkpoint]` trigger line, `extra` more `[source]` keys.
fn kafka_job_toml(broker: &Broker, args: &Args, topic: &str, checkpoint: &str, extra: &str, sink: &str) -> String {
    format!(
        r#"[job]
id = "kafka-bench"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
{checkpoint}
[source]
kind = "kafka"
brokers = ["{bootstrap}"]
topics = ["{topic}"]
start = "earliest"
format = "json"
batch_rows = {BATCH_ROWS}
{extra}
{sink}"#,
        parallelism = args.parallelism,
        bootstrap = broker.bootstrap(),
    )
}

/// Produces the generator's rows `0..rows` to `topic`, one JSON message
/// each (arrow-json's encoding of the generator's batches), spread over
/// the partitions by id. Not timed.
fn produce_generator_rows(broker: &Broker, topic: &str, rows: u64) -> Result<()> {
    let mut at = 0;
    while at < rows {
        let end = rows.min(at + 100_000);
        let batch = Generator::batch_for(at, end);
        let mut writer = arrow_json::LineDelimitedWriter::new(Vec::new());
        writer.write(&batch)?;
        writer.finish()?;
        let text = writer.into_inner();
        let messages: Vec<(i32, String, Vec<u8>)> = text
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .zip(at..end)
            .map(|(line, id)| ((id % PARTITIONS as u64) as i32, format!("k{id}"), line.to_vec()))
            .collect();
        anyhow::ensure!(messages.len() as u64 == end - at, "arrow-json wrote {} lines", messages.len());
        broker.produce(topic, &messages);
        at = end;
    }
    Ok(())
}

fn run_generator(host: &PluginHost, wasm: &Path, args: &Args) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let every = args.checkpoint_rows / u64::from(args.parallelism);
    let sink = iceberg_sink(wasm, "bench.generator");
    let toml = generator_job_toml("gen-bench", args.parallelism, every, args.rows, 0, BATCH_ROWS, &sink);
    let job = sluice_bench::write_job(dir.path(), &toml)?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the generator job landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

fn run_kafka_bounded(host: &PluginHost, wasm: &Path, broker: &Broker, args: &Args, topic: &str) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let every = args.checkpoint_rows / u64::from(args.parallelism);
    let sink = iceberg_sink(wasm, "bench.kafka");
    let extra = format!("bounded = true\n{GENERATOR_COLUMNS}");
    let toml = kafka_job_toml(broker, args, topic, &format!("every_rows = {every}"), &extra, &sink);
    let job = sluice_bench::write_job(dir.path(), &toml)?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the Kafka job landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

/// The broker's own pace: a bare rdkafka consumer per writer, each reading
/// its share of the partitions from the start, counting messages and
/// decoding nothing.
fn bare_consumers(broker: &Broker, args: &Args, topic: &str) -> Result<Duration> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{Offset, TopicPartitionList};
    let started = Instant::now();
    let counts = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.parallelism)
            .map(|w| {
                s.spawn(move || -> Result<u64> {
                    let consumer: BaseConsumer = rdkafka::config::ClientConfig::new()
                        .set("bootstrap.servers", broker.bootstrap())
                        .set("group.id", "bench-bare")
                        .set("enable.auto.commit", "false")
                        .create()?;
                    let mut tpl = TopicPartitionList::new();
                    let mine: Vec<i32> = (0..PARTITIONS).filter(|p| *p as u32 % args.parallelism == w).collect();
                    for p in &mine {
                        tpl.add_partition_offset(topic, *p, Offset::Beginning)?;
                    }
                    consumer.assign(&tpl)?;
                    let want = (0..args.rows).filter(|id| mine.contains(&((id % PARTITIONS as u64) as i32))).count();
                    let mut got = 0usize;
                    let deadline = Instant::now() + Duration::from_secs(300);
                    while got < want {
                        anyhow::ensure!(Instant::now() < deadline, "a bare consumer read {got} of {want}");
                        if let Some(m) = consumer.poll(Duration::from_millis(100)) {
                            m?;
                            got += 1;
                        }
                    }
                    Ok(got as u64)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a consumer panicked"))?).sum::<Result<u64>>()
    })?;
    anyhow::ensure!(counts == args.rows, "the bare consumers read {counts} messages");
    Ok(started.elapsed())
}

/// Section 1: Kafka → Iceberg beside generator → Iceberg.
fn throughput(host: &PluginHost, wasm: &Path, broker: &Broker, args: &Args) -> Result<()> {
    let topic = "bench-throughput";
    broker.create_topic(topic, PARTITIONS);
    let started = Instant::now();
    produce_generator_rows(broker, topic, args.rows)?;
    eprintln!("throughput: produced {} messages in {:.1} s (not timed)", args.rows, started.elapsed().as_secs_f64());
    let w = args.parallelism;
    let mut generator = Measured::new(format!("generator → iceberg plugin, {w} writers"), args.rows);
    let mut kafka =
        Measured::new(format!("kafka (JSON, {PARTITIONS} partitions) → iceberg plugin, {w} writers"), args.rows);
    let mut bare = Measured::new(format!("bare rdkafka consumers, {w} (the broker's pace; no rows made)"), args.rows);
    for rep in 0..args.reps {
        eprintln!("throughput: repetition {}/{}", rep + 1, args.reps);
        measure(&mut generator, || run_generator(host, wasm, args))?;
        measure(&mut kafka, || run_kafka_bounded(host, wasm, broker, args, topic))?;
        measure(&mut bare, || bare_consumers(broker, args, topic))?;
    }
    let baseline = generator.name.clone();
    print_ratio_table(
        &format!(
            "Kafka source against the generator, into the Iceberg plugin: {} rows, {} rows per snapshot, zstd, median of {}",
            args.rows, args.checkpoint_rows, args.reps
        ),
        &[generator, kafka, bare],
        &baseline,
    );
    println!(
        "The Kafka side also parses one JSON message per row; the generator makes its rows in memory. \
         All run at the same parallelism. The bare consumers are the broker's pace: the Kafka source is \
         not the bottleneck when its row matches theirs. CPU-seconds are this process's (the broker's \
         own are not counted).\n"
    );
    Ok(())
}

/// The ids the table's current snapshot holds, with the snapshot's id;
/// `None` when the table does not exist yet.
async fn visible_ids(catalog: &iceberg_catalog_sql::SqlCatalog, ident: &TableIdent) -> Result<Option<(i64, Vec<i64>)>> {
    if !catalog.table_exists(ident).await? {
        return Ok(None);
    }
    let table = catalog.load_table(ident).await?;
    let Some(snapshot) = table.metadata().current_snapshot_id() else { return Ok(None) };
    let stream = table.scan().snapshot_id(snapshot).select(["id"]).build()?.to_arrow().await?;
    let batches: Vec<_> = stream.try_collect().await?;
    let mut ids = Vec::new();
    for b in &batches {
        let col = b.column(0).as_any().downcast_ref::<Int64Array>().context("the id column")?;
        ids.extend(col.iter().flatten());
    }
    Ok(Some((snapshot, ids)))
}

/// Sends orders `0..total` to `topic` at `rate` a second, in bursts every
/// 20 ms, keeping each one's send time by id.
fn produce_steadily(
    bootstrap: &str,
    topic: &str,
    rate: u64,
    total: u64,
    sent: &Mutex<HashMap<i64, Instant>>,
    producing: &AtomicBool,
) -> Result<()> {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer =
        rdkafka::config::ClientConfig::new().set("bootstrap.servers", bootstrap).set("linger.ms", "0").create()?;
    let started = Instant::now();
    const TICK_MS: u64 = 20;
    let per_tick = (rate * TICK_MS / 1000).max(1);
    let mut next = 0u64;
    while next < total {
        let end = (next + per_tick).min(total);
        for (p, key, value) in sluice_bench::kafka::orders(next as i64, end as i64, PARTITIONS) {
            let id: i64 = key.trim_start_matches('k').parse()?;
            sent.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.insert(id, Instant::now());
            let record = BaseRecord::to(topic).partition(p).key(key.as_bytes()).payload(value.as_slice());
            producer.send(record).map_err(|(e, _)| e)?;
        }
        producer.poll(Duration::ZERO);
        next = end;
        let due = started + Duration::from_millis(TICK_MS * next.div_ceil(per_tick));
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    producer.flush(Duration::from_secs(30))?;
    producing.store(false, Ordering::SeqCst);
    Ok(())
}

/// Polls the table `bench.latency` under `warehouse` every 20 ms until it
/// holds `total` ids; each id with the poll that first saw it.
fn watch(warehouse: &Path, total: u64, limit: Duration) -> Result<HashMap<i64, Instant>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let deadline = Instant::now() + limit;
    rt.block_on(async {
        // The job creates the warehouse and its catalog: wait for them.
        while !warehouse.join("catalog.db").exists() {
            anyhow::ensure!(Instant::now() < deadline, "the job made no catalog");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let catalog = sluice_bench::sql_catalog(warehouse).await?;
        let ident = TableIdent::from_strs(["bench", "latency"])?;
        let mut seen = HashMap::new();
        let mut last_snapshot = None;
        while (seen.len() as u64) < total {
            anyhow::ensure!(Instant::now() < deadline, "only {} of {total} messages became visible", seen.len());
            let polled = Instant::now();
            // The catalog may be busy with the job's commit: poll again.
            if let Ok(Some((snapshot, ids))) = visible_ids(&catalog, &ident).await
                && last_snapshot != Some(snapshot)
            {
                last_snapshot = Some(snapshot);
                for id in ids {
                    seen.entry(id).or_insert(polled);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(seen)
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Section 2: produce-to-visible latency at a 1 s checkpoint interval.
fn latency(host: &PluginHost, wasm: &Path, broker: &Broker, args: &Args) -> Result<()> {
    let topic = "bench-latency";
    broker.create_topic(topic, PARTITIONS);
    let dir = tempfile::tempdir()?;
    let sink = iceberg_sink(wasm, "bench.latency");
    let extra = sluice_bench::kafka::ORDER_COLUMNS;
    let toml = kafka_job_toml(broker, args, topic, "interval_secs = 1.0", extra, &sink);
    let job = sluice_bench::write_job(dir.path(), &toml)?;
    let total = args.rate * args.latency_secs;

    // The job, unbounded, in a thread until asked to stop; the producer
    // and the watcher beside it.
    let stop = Stop::default();
    let opts = RunOptions { stop: stop.clone(), ..RunOptions::default() };
    let sent: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let producing = Arc::new(AtomicBool::new(true));
    let (summary, seen) = std::thread::scope(|s| -> Result<_> {
        let runner = s.spawn(|| run_quiet_with(&job, host, opts));
        let producer = s.spawn(|| produce_steadily(&broker.bootstrap(), topic, args.rate, total, &sent, &producing));
        let watched = watch(&dir.path().join("warehouse"), total, Duration::from_secs(args.latency_secs + 120));
        // Stop the job whatever the watcher found, so that the scope ends.
        stop.request();
        let produced = producer.join().map_err(|_| anyhow::anyhow!("the producer panicked"))?;
        let summary = runner.join().map_err(|_| anyhow::anyhow!("the job panicked"))?;
        let seen = watched?;
        produced?;
        Ok((summary?, seen))
    })?;
    anyhow::ensure!(!producing.load(Ordering::SeqCst), "the producer did not finish");
    anyhow::ensure!(summary.rows_total == total, "the job landed {} rows for {total} messages", summary.rows_total);

    let sent = sent.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
    let mut lat: Vec<f64> = seen
        .iter()
        .filter_map(|(id, at)| sent.get(id).map(|s| at.saturating_duration_since(*s).as_secs_f64()))
        .collect();
    anyhow::ensure!(lat.len() as u64 == total, "{} visible ids were never sent", total - lat.len() as u64);
    lat.sort_by(f64::total_cmp);
    let (median, p99) = (percentile(&lat, 0.5), percentile(&lat, 0.99));
    println!(
        "### Produce to visible: {total} messages at {} per second over {} s, {PARTITIONS} partitions, {} writers, a checkpoint every 1 s\n",
        args.rate, args.latency_secs, args.parallelism
    );
    println!("| measure | seconds | × the checkpoint interval |\n|---|---:|---:|");
    println!("| checkpoint interval (baseline) | 1.000 | 1.00 |");
    println!("| median latency | {median:.3} | {median:.2} |");
    println!("| p99 latency | {p99:.3} | {p99:.2} |");
    println!("| max latency | {:.3} | {:.2} |", lat[lat.len() - 1], lat[lat.len() - 1]);
    println!(
        "\n{} checkpoints committed. A message waits on average half an interval for its barrier, then for the \
         persist and the catalog commit; the watcher's 20 ms poll and its scan add to what it measures.\n",
        summary.checkpoints_this_run
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let wanted = |section: &str| args.only.is_empty() || args.only.iter().any(|s| s == section);
    let wasm = plugin("sluice_sink_iceberg.wasm")?;
    let host = host()?;
    host.load(&wasm)?; // compile (or load the cached compilation) before timing
    let broker = Broker::start();
    if wanted("throughput") {
        throughput(&host, &wasm, &broker, &args)?;
    }
    if wanted("latency") {
        latency(&host, &wasm, &broker, &args)?;
    }
    Ok(())
}
