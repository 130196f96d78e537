//! Sluice on a local Ray cluster of three nodes (one CPU each), through the
//! Python package (`python/`, built here as a wheel with maturin):
//! - six writers, as actors spread over the nodes, land every row of an
//!   Iceberg table exactly once, read back by PyIceberg;
//! - a node removed in the middle of a run and added back: the driver
//!   resumes from the last persisted checkpoint with new actors, and every
//!   row still lands exactly once;
//! - the files sink and the BigQuery double through the same runner;
//! - a Ray Dataset written through `sluice.ray.Datasink`, with one commit,
//!   and a second write into the same state directory refused;
//! - a Datasink driver SIGKILLed between persisting its checkpoint and
//!   committing it: the next write finishes the commit exactly once (rows
//!   compared by id and value) and refuses to land the dataset again;
//! - a bounded Kafka source (a real broker, three partitions over three
//!   writers) into Iceberg: every message once, by key and value;
//! - the package's own calls without Ray: a writer driven through one
//!   checkpoint that the engine's landing persists and commits, the GIL free
//!   during plugin calls, and errors carrying the message the CLI prints.
//!
//! Every job keeps its state directory on S3 (moto's server on 127.0.0.1),
//! so the driver and the nodes share no disk for it: the state is held by
//! the engine's lease there, also across the killed Datasink driver.
//!
//! One cluster serves every scenario (`tests/ray/cluster_suite.py`): on two
//! cores a cluster per scenario would cost more than the scenarios.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use arrow_array::{Array, Int64Array, StringArray};
use serde_json::Value;
use sluice_bigquery_double::{BigQueryDouble, generator_schema};
use sluice_tests::kafka::{Broker, assert_orders, kafka_job, order_schema, orders};
use sluice_tests::store_servers::{ACCESS_KEY_ID, Moto, REGION, SECRET_ACCESS_KEY};
use sluice_tests::{
    TestJob, assert_exactly_once_range, bigquery_rows, cache_dir, python_interpreter, read_visible, run_cli,
};

const TARGET: &str = env!("SLUICE_TEST_TARGET_DIR");
const BQ_TABLE: &str = "projects/p/datasets/d/tables/ray";
const STATE_BUCKET: &str = "ray-state";
/// Messages of the Kafka scenario.
const KAFKA_ROWS: i64 = 20_000;

/// `job`, with its state directory on S3 under its id, and a short lease
/// (the killed driver's lease expires in 3 s).
fn on_s3(mut job: TestJob, id: &str) -> TestJob {
    let url = state_url(id);
    job.toml = job.toml.replacen("state_dir = \"state\"", &format!("state_dir = \"{url}\"\nlease_secs = 3"), 1);
    assert!(job.toml.contains(&url), "the test job has no state_dir line to replace:\n{}", job.toml);
    job
}

fn state_url(id: &str) -> String {
    format!("s3://{STATE_BUCKET}/{id}")
}

/// Builds the `sluice` wheel (abi3, the dev profile: it shares the test
/// build's compiled crates; with the engine's crash points, which only a
/// test build has) and installs it into a directory of its own; returns
/// that directory, for PYTHONPATH.
fn install_wheel(python: &Path) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let wheels = Path::new(TARGET).join("python-wheels");
    let site = Path::new(TARGET).join("python-site");
    let _ = std::fs::remove_dir_all(&wheels);
    let started = Instant::now();
    let mut maturin = Command::new(python);
    // Its cargo must not see this test's CARGO_MANIFEST_DIR and CARGO_PKG_*,
    // or it rebuilds ring and all above it (`nested_cargo`'s invariants).
    sluice_tests::nested_cargo::clear_outer_cargo_env(&mut maturin);
    let out = maturin
        .args(["-m", "maturin", "build", "--profile", "dev", "--features", "fault-injection", "--quiet"])
        .arg("--manifest-path")
        .arg(root.join("python/Cargo.toml"))
        .arg("--out")
        .arg(&wheels)
        .env("CARGO_TARGET_DIR", TARGET)
        .output()
        .expect("running maturin");
    assert!(out.status.success(), "maturin build failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let wheel = std::fs::read_dir(&wheels)
        .expect("wheel directory")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .expect("maturin wrote a wheel");
    let name = wheel.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    assert!(name.contains("-abi3-"), "the wheel is not abi3: {name}");
    let _ = std::fs::remove_dir_all(&site);
    let out = Command::new(python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&site)
        .arg(&wheel)
        .output()
        .expect("running pip");
    assert!(out.status.success(), "pip install of {name} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    eprintln!("built and installed {name} in {:.1} s", started.elapsed().as_secs_f64());
    site
}

/// Writes a job's file; its path, for the suite.
fn job_file(job: &TestJob) -> String {
    std::fs::write(job.path(), &job.toml).expect("writing job file");
    job.path().display().to_string()
}

fn summary<'a>(results: &'a Value, scenario: &str) -> &'a Value {
    &passed(results, scenario)["summary"]
}

fn passed<'a>(results: &'a Value, scenario: &str) -> &'a Value {
    let r = &results[scenario];
    assert!(r["error"].is_null(), "scenario {scenario} failed: {}\n{}", r["error"], r["trace"]);
    r
}

/// Asserts that the files sink shows the suite's hand-written batch (ids
/// `0..rows`, names `row-<id>`) exactly `writes` times: every row, by value.
fn assert_same_batch_repeated(dir: &Path, rows: u64, writes: u64) {
    let visible = sluice_tests::read_parquet_tree(dir);
    let ids = visible.column_by_name("id").and_then(|c| c.as_any().downcast_ref::<Int64Array>()).expect("id: int64");
    let names =
        visible.column_by_name("name").and_then(|c| c.as_any().downcast_ref::<StringArray>()).expect("name: string");
    let mut seen = vec![0u64; rows as usize];
    for i in 0..visible.num_rows() {
        let id = ids.value(i);
        assert_eq!(names.value(i), format!("row-{id}"), "row {i} has another name than its id's");
        let slot = seen.get_mut(id as usize).unwrap_or_else(|| panic!("id {id} was never written"));
        *slot += 1;
    }
    let wrong: Vec<(usize, u64)> = seen.iter().copied().enumerate().filter(|(_, n)| *n != writes).take(5).collect();
    assert!(wrong.is_empty(), "ids not visible exactly {writes} times (id, times): {wrong:?}");
}

/// Asserts that `visible` holds the suite's dataset (ids `0..rows`, names
/// `row-<id>`, amounts 3 × id) exactly once, by id and value.
fn assert_dataset_once(visible: &arrow_array::RecordBatch, rows: u64) {
    let ids = visible.column_by_name("id").and_then(|c| c.as_any().downcast_ref::<Int64Array>()).expect("id: int64");
    let names =
        visible.column_by_name("name").and_then(|c| c.as_any().downcast_ref::<StringArray>()).expect("name: string");
    let amounts =
        visible.column_by_name("amount").and_then(|c| c.as_any().downcast_ref::<Int64Array>()).expect("amount: int64");
    let mut seen = vec![0u32; rows as usize];
    for i in 0..visible.num_rows() {
        let id = ids.value(i);
        assert_eq!(names.value(i), format!("row-{id}"), "row {i}: the name is not its id's");
        assert_eq!(amounts.value(i), 3 * id, "row {i}: the amount is not its id's");
        let slot = seen.get_mut(id as usize).unwrap_or_else(|| panic!("id {id} is not the dataset's"));
        *slot += 1;
    }
    let wrong: Vec<(usize, u32)> = seen.iter().copied().enumerate().filter(|(_, n)| *n != 1).take(5).collect();
    assert!(wrong.is_empty(), "ids not visible exactly once (id, times): {wrong:?}");
}

/// Asserts that a scenario landed `rows` rows in `table` exactly once, as
/// PyIceberg (in the suite) and iceberg-rust read it, with no checkpoint
/// committed twice; its run summary.
fn assert_iceberg_once<'a>(results: &'a Value, scenario: &str, warehouse: &Path, table: &str, rows: u64) -> &'a Value {
    let s = summary(results, scenario);
    let r = &results[scenario];
    assert_eq!(s["rows_total"], rows, "{s}");
    assert_eq!(r["problem"], Value::Null, "PyIceberg, {scenario}: {r}");
    assert_eq!(r["pyiceberg_rows"], rows, "{r}");
    assert_eq!(r["snapshots"], r["distinct_checkpoints"], "a checkpoint was committed twice: {r}");
    let native = sluice_tests::read_iceberg(warehouse, table);
    assert_exactly_once_range(&native.rows, 0, rows);
    native.assert_no_checkpoint_twice();
    s
}

#[test]
fn writers_as_ray_actors_on_three_nodes_land_every_row_exactly_once() {
    let python = python_interpreter();
    let site = install_wheel(python);
    let moto = Moto::start(&[STATE_BUCKET]);

    // Six writers into one Iceberg table.
    let ice_wh = tempfile::tempdir().expect("warehouse");
    let ice = on_s3(TestJob::iceberg("ray-ice", ice_wh.path(), "ray.events", 60_000, 0, 6, 2_000), "ray-ice");
    // The same, rate-limited so that a node can be removed mid-run.
    let loss_wh = tempfile::tempdir().expect("warehouse");
    let loss = on_s3(TestJob::iceberg("ray-loss", loss_wh.path(), "ray.loss", 120_000, 0, 6, 2_000), "ray-loss");
    let files = on_s3(TestJob::files("ray-files", 30_000, 6, 1_000), "ray-files");
    let double = BigQueryDouble::start().expect("starting the BigQuery double");
    double.create_table(BQ_TABLE, generator_schema());
    let bq = on_s3(TestJob::bigquery("ray-bq", &double.address(), BQ_TABLE, 30_000, 6, 1_000), "ray-bq");
    // The package without Ray: a writer and the committer by hand; and a
    // job whose plugin is missing, for the error message.
    let low = on_s3(TestJob::files("ray-low", 1, 1, 1_000), "ray-low");
    let bad = TestJob::files_with("/nonexistent/sluice_sink_files.wasm", "ray-bad", 1, 1, 1_000);
    // The Datasink reads only the job's [sink]; the dataset is the source.
    let ds_wh = tempfile::tempdir().expect("warehouse");
    let datasink = on_s3(TestJob::iceberg("ray-datasink", ds_wh.path(), "ray.dataset", 1, 0, 1, 1_000), "ray-datasink");
    // The same, with its driver killed between persist and commit.
    let kill_wh = tempfile::tempdir().expect("warehouse");
    let killed =
        on_s3(TestJob::iceberg("ray-datasink-kill", kill_wh.path(), "ray.killed", 1, 0, 1, 1_000), "ray-datasink-kill");

    // A bounded Kafka source, its partitions over three writers.
    let broker = Broker::start();
    broker.create_topic("rayorders", 3);
    broker.produce("rayorders", &orders(0, KAFKA_ROWS, 3));
    let kafka = on_s3(kafka_job(&broker, "ray-kafka", "rayorders", 3, 1.0, "bounded = true"), "ray-kafka");
    let kafka_wh = kafka.dir.path().join("warehouse");

    let spec = serde_json::json!({
        "cache_dir": cache_dir(),
        "order": ["low_level", "iceberg", "files", "bigquery", "datasink", "datasink_kill", "kafka", "node_loss"],
        "low_level": {"job": job_file(&low), "bad_job": job_file(&bad), "rows": 20_000},
        "iceberg": {"job": job_file(&ice), "warehouse": ice_wh.path(), "table": "ray.events", "rows": 60_000},
        "node_loss": {
            "job": job_file(&loss), "warehouse": loss_wh.path(), "table": "ray.loss", "rows": 120_000,
            "rate": 24_000, "state_dir": state_url("ray-loss"),
        },
        "files": {"job": job_file(&files)},
        "bigquery": {"job": job_file(&bq)},
        "datasink": {
            "job": job_file(&datasink), "warehouse": ds_wh.path(), "table": "ray.dataset", "rows": 50_000,
            "rerun_state_dir": state_url("ray-datasink-rerun"),
            "bad_mode_state_dir": state_url("ray-datasink-bad-mode"),
        },
        "datasink_kill": {"job": job_file(&killed), "warehouse": kill_wh.path(), "table": "ray.killed", "rows": 30_000},
        "kafka": {"job": job_file(&kafka), "warehouse": kafka_wh, "table": "lake.rayorders", "rows": KAFKA_ROWS},
    });
    let spec_path = ice.dir.path().join("ray-suite.json");
    std::fs::write(&spec_path, spec.to_string()).expect("writing the suite's spec");

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("ray/cluster_suite.py");
    let started = Instant::now();
    let out = Command::new(python)
        .arg(&script)
        .arg(&spec_path)
        .env("PYTHONPATH", &site)
        .env("RAY_AUTH_MODE", "disabled")
        .env("RAY_USAGE_STATS_ENABLED", "0")
        .env("AWS_ENDPOINT_URL", &moto.endpoint)
        .env("AWS_REGION", REGION)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        .output()
        .expect("running the Ray suite");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the Ray suite failed:\n{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let results: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("the Ray suite printed no results ({e}):\n{stdout}\n{stderr}"));
    eprintln!("Ray suite: {:.1} s in all; {results}", started.elapsed().as_secs_f64());
    assert_eq!(results["nodes"], 3, "the cluster has three nodes");
    // Every job's state went to S3 only: a lease and records there, nothing on disk.
    let store = sluice_store::ObjectStore::s3(STATE_BUCKET, &moto.s3_options()).expect("bucket");
    let listed = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(store.list(""))
        .expect("listing the state bucket");
    let keys: Vec<&str> = listed.iter().map(|o| o.key.as_str()).collect();
    for (job, id) in [(&ice, "ray-ice"), (&loss, "ray-loss"), (&files, "ray-files"), (&bq, "ray-bq"), (&low, "ray-low")]
        .into_iter()
        .chain([(&datasink, "ray-datasink"), (&killed, "ray-datasink-kill"), (&kafka, "ray-kafka")])
    {
        assert!(keys.contains(&format!("{id}/lease").as_str()), "{id}: no lease on S3: {keys:?}");
        assert!(
            keys.iter().any(|k| k.starts_with(&format!("{id}/epoch-")) && k.contains("/checkpoints/chk-")),
            "{id}: no checkpoint record on S3: {keys:?}"
        );
        assert!(!job.state().exists() && !job.dir.path().join(".sluice").exists(), "{id}: state on local disk");
    }

    // The package's own calls: one checkpoint by hand, which the engine's
    // landing persists and commits, and a second landing refused.
    let r = passed(&results, "low_level");
    assert_eq!(r["outcome"], "committed", "{r}");
    assert_eq!(r["record_pending"], 0, "the landing did not note its commit: {r}");
    assert_eq!(r["record_committed"], 1, "{r}");
    assert!(
        r["second_landing_error"].as_str().is_some_and(|e| e.contains("already landed a dataset")),
        "a second landing into the same state directory was not refused: {r}"
    );
    let writes = r["writes"].as_u64().unwrap_or(0);
    assert!(writes >= 2, "{r}");
    assert_eq!(r["rows"].as_u64(), Some(writes * 20_000), "{r}");
    assert_eq!(r["landed_rows"], r["rows"], "{r}");
    assert_same_batch_repeated(&low.out(), 20_000, writes);
    // Bytes that are not a whole IPC stream: refused by name, nothing landed
    // (the batch count above), and the writer went on.
    for bad in ["garbage", "truncated"] {
        let message = r["refused"][bad].as_str().unwrap_or_default();
        assert!(message.contains("Arrow IPC stream") || message.contains("corrupt Arrow"), "{bad}: {r}");
    }
    // Valid structure, invalid values: the host refuses them before the
    // plugin (which trusts the host's batches) sees them.
    let message = r["refused"]["invalid_utf8"].as_str().unwrap_or_default();
    assert!(
        message.contains("not a valid Arrow IPC stream") && message.to_lowercase().contains("utf"),
        "invalid UTF-8 was not refused by the host: {r}"
    );
    let message = r["refused"]["reordered"].as_str().unwrap_or_default();
    assert!(
        message.contains("not in the table's schema") && message.contains("the table's are [id Int64, name Utf8"),
        "a batch with the table's columns in another order was not refused: {r}"
    );
    // The GIL is released during plugin calls: another Python thread ran
    // while the writer was inside the plugin (with a 10 s switch interval).
    assert!(
        r["counted_while_writing"].as_u64().unwrap_or(0) > r["writes"].as_u64().unwrap_or(0),
        "the GIL was held during plugin calls: {r}"
    );
    // The same error message as the CLI prints, from the package and the Ray runner.
    let bad_path = bad.path().display().to_string();
    let (code, _, stderr) = run_cli(&["run", &bad_path], bad.dir.path());
    assert_ne!(code, 0);
    let cli = stderr.lines().find_map(|l| l.strip_prefix("error: ")).unwrap_or_default().to_string();
    assert!(cli.contains("no plugin file at /nonexistent/sluice_sink_files.wasm"), "{stderr}");
    assert_eq!(r["bad_job_error"].as_str(), Some(cli.as_str()), "the package's message differs from the CLI's");
    assert_eq!(r["ray_error"].as_str(), Some(cli.as_str()), "sluice.ray's message differs from the CLI's");

    // Six writers, spread over the three nodes, into one Iceberg table.
    let s = assert_iceberg_once(&results, "iceberg", ice_wh.path(), "ray.events", 60_000);
    assert_eq!(s["nodes"], 3, "the writers were not spread over the three nodes: {s}");

    // A node removed mid-run, then added back.
    let s = assert_iceberg_once(&results, "node_loss", loss_wh.path(), "ray.loss", 120_000);
    let recoveries = s["recoveries"].as_array().map_or(0, Vec::len);
    assert!(recoveries >= 1, "the run did not notice the lost node: {}", results["node_loss"]);
    assert!(
        s["recoveries"][0].as_str().is_some_and(|m| m.contains("was lost")),
        "the recovery does not say a writer was lost: {s}"
    );

    // The files sink and the BigQuery double through the same runner.
    let s = summary(&results, "files");
    assert_eq!(s["rows_total"], 30_000, "{s}");
    assert_exactly_once_range(&read_visible(&files.out()), 0, 30_000);
    let s = summary(&results, "bigquery");
    assert_eq!(s["rows_total"], 30_000, "{s}");
    assert_exactly_once_range(&bigquery_rows(&double.visible_rows(BQ_TABLE)), 0, 30_000);

    // The Datasink: one commit, and no second landing from the same state directory.
    let r = passed(&results, "datasink");
    assert_eq!(r["problem"], Value::Null, "PyIceberg after the Datasink: {r}");
    assert_eq!(r["pyiceberg_rows"], 50_000, "{r}");
    assert_eq!(r["snapshots"], 1, "the Datasink commits once: {r}");
    assert_eq!(r["wrong_values"], 0, "the Datasink landed other values than the dataset's: {r}");
    assert!(
        r["second_write_error"].as_str().is_some_and(|e| e.contains("already landed a dataset")),
        "a second write into the same state directory was not refused: {r}"
    );
    assert_eq!(r["rows_after_second"], 50_000, "{r}");
    // The same dataset again with mode = "overwrite-partitions" from a fresh
    // state directory (a new incarnation): it replaces, in one snapshot.
    assert_eq!(r["overwrite_outcome"], "committed", "{r}");
    assert_eq!(r["overwrite_problem"], Value::Null, "PyIceberg after the overwrite: {r}");
    assert_eq!(r["overwrite_snapshots"], 2, "the overwrite commits one snapshot: {r}");
    assert!(
        r["bad_mode_error"].as_str().is_some_and(|e| e.contains("mode") && e.contains("sideways")),
        "an unknown mode was not refused by name: {r}"
    );

    // A driver SIGKILLed after its checkpoint was persisted and before the
    // commit: nothing visible, the commit pending; the next write finishes
    // it once and refuses a second landing.
    let r = passed(&results, "datasink_kill");
    assert_eq!(r["crash_point_reached"], true, "the driver did not reach the crash point: {r}");
    assert_eq!(r["killed_by_sigkill"], true, "the driver did not die by SIGKILL: {r}");
    assert_eq!(r["pending_after_kill"], 1, "the killed driver left no pending record: {r}");
    assert_eq!(r["committed_after_kill"], Value::Null, "{r}");
    assert_eq!(r["rows_visible_after_kill"], 0, "rows were visible before the commit: {r}");
    assert!(
        r["second_write_error"].as_str().is_some_and(|e| e.contains("whose pending commit is finished now")),
        "the next write did not finish the pending commit and refuse to land again: {r}"
    );
    assert_eq!(r["problem"], Value::Null, "PyIceberg after the recovered commit: {r}");
    assert_eq!(r["pyiceberg_rows"], 30_000, "{r}");
    assert_eq!(r["rows_read"], 30_000, "{r}");
    assert_eq!(r["wrong_values"], 0, "the recovered commit landed other values than the dataset's: {r}");
    assert_eq!(r["snapshots"], 1, "the pending commit was committed more than once: {r}");
    assert_eq!(r["pending_at_end"], 0, "{r}");
    assert_eq!(r["committed_at_end"], 1, "{r}");
    let shape = std::sync::Arc::new(arrow_schema::Schema::new(vec![
        arrow_schema::Field::new("id", arrow_schema::DataType::Int64, true),
        arrow_schema::Field::new("name", arrow_schema::DataType::Utf8, true),
        arrow_schema::Field::new("amount", arrow_schema::DataType::Int64, true),
    ]));
    let native = sluice_tests::read_iceberg_as(&sluice_tests::catalog(kill_wh.path()), "ray.killed", &shape);
    assert_dataset_once(&native.rows, 30_000);
    native.assert_no_checkpoint_twice();

    // Kafka through the Ray runner: every message once, by key and value,
    // read back by PyIceberg (the suite) and by iceberg-rust here.
    let s = summary(&results, "kafka");
    let r = &results["kafka"];
    assert_eq!(s["rows_total"], KAFKA_ROWS, "{s}");
    assert_eq!(r["problem"], Value::Null, "PyIceberg, kafka: {r}");
    assert_eq!(r["pyiceberg_rows"], KAFKA_ROWS, "{r}");
    assert_eq!(r["snapshots"], r["distinct_checkpoints"], "a checkpoint was committed twice: {r}");
    let native = sluice_tests::read_iceberg_as(&sluice_tests::catalog(&kafka_wh), "lake.rayorders", &order_schema());
    assert_orders(&native.rows, 0..KAFKA_ROWS);
    native.assert_no_checkpoint_twice();
}
