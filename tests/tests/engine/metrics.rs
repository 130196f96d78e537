//! The metrics server of a run: `/metrics` scraped during and after a run,
//! parsed by the Prometheus project's Python client
//! (`prometheus_client.parser.text_string_to_metric_families`), with its
//! counters checked against the rows read back from the table; `/healthz`
//! turning to 503 while the catalog refuses commits, and back; and the
//! command line's `--metrics-addr` (port 0, the address file, a bad or
//! taken address failing before anything is written); bad rows counted
//! once each with dead letters on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sluice::engine::RunOptions;
use sluice::fault::{CatalogFaults, CommitFault, Faults};
use sluice::metrics::{Metrics, MetricsServer};
use sluice_tests::{
    FILES_PLUGIN, TestJob, assert_exactly_once_range, python, read_iceberg, read_parquet_tree, run_cli, sluice_run,
};

const TABLE: &str = "demo.events";

/// `GET path` on `addr`: the status code and the body.
fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let (head, body) = out.split_once("\r\n\r\n").ok_or_else(|| format!("no header end: {out}"))?;
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("bad status: {head}"))?;
    Ok((status, body.to_string()))
}

/// Every scrape in `texts`, parsed by `prometheus_client`: per scrape, the
/// samples as `name{label=value,...}` (labels sorted) → value, and the
/// families' types by name.
#[derive(Debug)]
struct Scrape {
    samples: std::collections::BTreeMap<String, f64>,
    types: std::collections::BTreeMap<String, String>,
}

impl Scrape {
    fn value(&self, key: &str) -> f64 {
        *self.samples.get(key).unwrap_or_else(|| panic!("no sample {key} in {:#?}", self.samples))
    }
}

fn parse_all(texts: &[String]) -> Vec<Scrape> {
    let dir = tempfile::tempdir().expect("temp dir");
    let files: Vec<String> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let p = dir.path().join(format!("scrape-{i}.txt"));
            std::fs::write(&p, t).expect("writing a scrape");
            p.display().to_string()
        })
        .collect();
    let script = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = []
for path in sys.argv[1:]:
    samples, types = {}, {}
    for family in text_string_to_metric_families(open(path).read()):
        types[family.name] = family.type
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    out.append({"samples": samples, "types": types})
print(json.dumps(out))
"#;
    let args: Vec<&str> = files.iter().map(String::as_str).collect();
    let json = python(script, &args).unwrap_or_else(|e| panic!("prometheus_client could not parse a scrape: {e}"));
    let parsed: Vec<serde_json::Value> = serde_json::from_str(&json).expect("the parser's JSON");
    parsed
        .into_iter()
        .map(|v| Scrape {
            samples: serde_json::from_value(v["samples"].clone()).expect("samples"),
            types: serde_json::from_value(v["types"].clone()).expect("types"),
        })
        .collect()
}

/// Scrapes `/metrics` every 50 ms while `running()`; the scrapes taken.
fn scrape_while(addr: SocketAddr, running: impl Fn() -> bool) -> Vec<String> {
    let mut scrapes = Vec::new();
    let start = Instant::now();
    while running() {
        assert!(start.elapsed() < Duration::from_secs(300), "the run did not end within 5 minutes");
        if let Ok((200, body)) = get(addr, "/metrics") {
            scrapes.push(body);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    scrapes
}

/// A run in this process, scraped while it runs and after: the text parses,
/// the counters only grow, and at the end they agree with the table.
#[test]
fn scrapes_during_and_after_a_run_agree_with_the_table() {
    const ROWS: u64 = 6000;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("metrics-run", warehouse.path(), TABLE, ROWS, 0, 2, 500);
    let metrics = Metrics::new();
    let server = MetricsServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), "test", metrics.clone()).expect("serve");
    let addr = server.addr();
    let (summary, during) = std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            // 6 checkpoints over about 2 s.
            job.run_opts(&["source.rate=3000"], RunOptions { metrics: metrics.clone(), ..RunOptions::default() })
        });
        let during = scrape_while(addr, || !run.is_finished());
        (run.join().expect("run thread"), during)
    });
    let summary = summary.unwrap_or_else(|e| panic!("the run failed: {e}"));
    let (status, after) = get(addr, "/metrics").expect("scrape after the run");
    assert_eq!(status, 200);
    let (status, health) = get(addr, "/healthz").expect("healthz");
    assert_eq!(status, 200, "{health}");
    assert!(health.starts_with("ok: job metrics-run"), "{health}");

    let mut texts = during.clone();
    texts.push(after);
    let scrapes = parse_all(&texts);
    let (last, during) = scrapes.split_last().expect("the scrape after");
    let rows = "sluice_rows_total{job=metrics-run,table=}";
    let committed = "sluice_last_committed_checkpoint{job=metrics-run}";
    // Mid-run: some checkpoints committed, not all rows yet, and nothing ever goes back.
    let mut mid = during.iter().filter(|s| s.samples.get(committed).is_some_and(|c| *c >= 1.0));
    assert!(
        mid.any(|s| s.value(rows) < ROWS as f64),
        "no scrape caught the run between checkpoints ({} scrapes)",
        during.len()
    );
    let seen: Vec<f64> = during.iter().chain([last]).filter_map(|s| s.samples.get(rows).copied()).collect();
    assert!(seen.windows(2).all(|w| w[0] <= w[1]), "rows went back: {seen:?}");

    // After: what landed, read back from the table.
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert_eq!(last.value(rows), table.rows.num_rows() as f64);
    assert_eq!(last.value(rows), summary.rows_total as f64);
    assert!(last.value("sluice_bytes_total{job=metrics-run,table=}") > ROWS as f64, "{:?}", last.samples);
    assert_eq!(last.value("sluice_bad_rows_total{job=metrics-run,table=}"), 0.0);
    let checkpoints = table.snapshots_of("metrics-run") as f64;
    assert_eq!(last.value(committed), summary.last_committed.expect("committed") as f64);
    // Every committed checkpoint, and the empty ones with nothing pending (the last, at the source's end).
    let timed = last.value("sluice_checkpoint_duration_seconds_count{}");
    assert!(timed >= checkpoints && timed <= summary.checkpoints_this_run as f64, "{timed} {summary:?}");
    assert_eq!(last.value("sluice_commit_duration_seconds_count{sink=lake}"), checkpoints);
    assert!(last.value("sluice_commit_duration_seconds_sum{sink=lake}") > 0.0);
    for reason in ["conflict", "unknown_outcome", "retryable_error"] {
        assert_eq!(last.value(&format!("sluice_commit_retries_total{{reason={reason}}}")), 0.0, "{reason}");
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs_f64();
    let at = last.value("sluice_last_commit_timestamp_seconds{job=metrics-run}");
    assert!(at <= now && at > now - 300.0, "{at} vs {now}");
    let limit = last.value("sluice_writer_memory_limit_bytes{}");
    assert_eq!(limit, (512u64 << 20) as f64);
    for subtask in ["0", "1"] {
        let memory = last.value(&format!("sluice_writer_memory_bytes{{subtask={subtask}}}"));
        assert!(memory > 0.0 && memory <= limit, "writer {subtask}: {memory}");
    }
    assert_eq!(last.types.get("sluice_rows").map(String::as_str), Some("counter"), "{:?}", last.types);
    assert_eq!(last.types.get("sluice_checkpoint_duration_seconds").map(String::as_str), Some("histogram"));
    assert_eq!(last.types.get("sluice_last_commit_timestamp_seconds").map(String::as_str), Some("gauge"));
}

/// While the catalog refuses commits for longer than
/// `job.health.max_commit_age`, `/healthz` answers 503 and says why; once
/// commits go through again it answers 200. The retries are counted by
/// reason: one lost reply, twelve conflicts.
#[test]
fn health_turns_unhealthy_while_the_catalog_refuses_commits() {
    const ROWS: u64 = 3000;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("metrics-health", warehouse.path(), TABLE, ROWS, 0, 1, 500);
    // Call 1 (checkpoint 1) loses its reply; calls 3 to 14 (checkpoint 3) conflict, 200 ms apart.
    let mut faults = vec![(1, CommitFault::LoseReply)];
    faults.extend((3..=14).map(|n| (n, CommitFault::Conflict)));
    let catalog = CatalogFaults { faults, ..CatalogFaults::default() };
    let metrics = Metrics::new();
    let server = MetricsServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), "test", metrics.clone()).expect("serve");
    let addr = server.addr();
    let sets = [
        "job.health.max_commit_age=\"1s\"",
        "job.commit.initial_backoff_ms=200",
        "job.commit.max_backoff_ms=200",
        "job.commit.max_attempts=30",
    ];
    let (summary, answers) = std::thread::scope(|scope| {
        let run = scope.spawn(|| {
            let opts = RunOptions {
                metrics: metrics.clone(),
                faults: Faults { catalog, ..Faults::default() },
                ..RunOptions::default()
            };
            job.run_opts(&sets, opts)
        });
        let mut answers = Vec::new();
        while !run.is_finished() {
            if let Ok(answer) = get(addr, "/healthz") {
                answers.push(answer);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        (run.join().expect("run thread"), answers)
    });
    let summary = summary.unwrap_or_else(|e| panic!("the run failed: {e}"));
    assert_eq!(summary.catalog_conflicts, 12, "{summary:?}");
    let unhealthy: Vec<&String> = answers
        .iter()
        .filter(|(status, body)| *status == 503 && body.contains("last committed checkpoint 2"))
        .map(|(_, body)| body)
        .collect();
    let first = unhealthy.first().unwrap_or_else(|| panic!("never 503 while checkpoint 3 conflicted: {answers:?}"));
    assert!(first.contains("job.health.max_commit_age (1.0 s)"), "{first}");
    assert!(first.contains("another writer committed first"), "the last error is named: {first}");
    let (status, body) = get(addr, "/healthz").expect("healthz");
    assert_eq!(status, 200, "healthy again once commits go through: {body}");

    let (_, text) = get(addr, "/metrics").expect("scrape");
    let scrape = parse_all(&[text]).pop().expect("one scrape");
    assert_eq!(scrape.value("sluice_commit_retries_total{reason=conflict}"), 12.0);
    assert_eq!(scrape.value("sluice_commit_retries_total{reason=unknown_outcome}"), 1.0);
    assert_eq!(scrape.value("sluice_commit_retries_total{reason=retryable_error}"), 0.0);
    let table = read_iceberg(warehouse.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert_eq!(scrape.value("sluice_rows_total{job=metrics-health,table=}"), table.rows.num_rows() as f64);
}

/// Waits up to a minute for `path` to hold an address.
fn read_addr_file(path: &Path, child: &mut std::process::Child) -> SocketAddr {
    let start = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && let Ok(addr) = text.trim().parse()
        {
            return addr;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice ended ({status}) before it wrote its metrics address");
        }
        assert!(start.elapsed() < Duration::from_secs(60), "no metrics address within a minute");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `sluice run --metrics-addr 127.0.0.1:0 --metrics-addr-file F`: the port
/// chosen is logged and written to F, and scrapes during the run parse.
#[test]
fn the_command_line_serves_metrics_on_the_port_it_chose() {
    const ROWS: u64 = 6000;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("metrics-cli", warehouse.path(), TABLE, ROWS, 0, 2, 500);
    job.load(&[]).expect("valid job");
    let addr_file = job.dir.path().join("metrics.addr");
    let mut child = sluice_run(&job, &["source.rate=3000".to_string()])
        .args(["--metrics-addr", "127.0.0.1:0", "--metrics-addr-file"])
        .arg(&addr_file)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting sluice");
    let addr = read_addr_file(&addr_file, &mut child);
    assert_eq!(addr.ip().to_string(), "127.0.0.1");
    assert_ne!(addr.port(), 0);
    let (mut scrapes, mut health) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while matches!(child.try_wait(), Ok(None)) {
        assert!(start.elapsed() < Duration::from_secs(300), "the run did not end within 5 minutes");
        if let Ok((200, body)) = get(addr, "/metrics") {
            scrapes.push(body);
        }
        if let Ok(answer) = get(addr, "/healthz") {
            health.push(answer);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("reaping sluice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("serving metrics on http://{addr}/metrics")), "{stderr}");
    assert!(!scrapes.is_empty(), "no scrape during the run");
    let parsed = parse_all(&scrapes);
    let committed = parsed
        .iter()
        .filter_map(|s| s.samples.get("sluice_last_committed_checkpoint{job=metrics-cli}").copied())
        .fold(0.0, f64::max);
    assert!(committed >= 1.0, "no scrape saw a commit: {:?}", parsed.last());
    let rows: Vec<f64> =
        parsed.iter().filter_map(|s| s.samples.get("sluice_rows_total{job=metrics-cli,table=}").copied()).collect();
    assert!(rows.windows(2).all(|w| w[0] <= w[1]), "rows went back: {rows:?}");
    let landed = read_iceberg(warehouse.path(), TABLE).rows.num_rows() as f64;
    assert!(rows.iter().all(|r| *r <= landed), "more rows counted than landed: {rows:?} vs {landed}");
    assert_exactly_once_range(&read_iceberg(warehouse.path(), TABLE).rows, 0, ROWS);
    assert!(health.iter().all(|(status, _)| *status == 200), "{health:?}");
}

/// A bad `job.metrics_addr`, or an address another process holds, fails
/// the run before anything is written, naming the key or the flag.
#[test]
fn a_bad_or_taken_metrics_address_fails_before_anything_is_written() {
    let job = TestJob::files("metrics-bad-addr", 100, 1, 50);
    job.load(&[]).expect("valid job");
    let (code, _, err) = run_cli(&["run", "job.toml", "--set", "job.metrics_addr=\"localhost:http\""], job.dir.path());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("key `job.metrics_addr`"), "{err}");
    assert!(!job.dir.path().join("state").exists(), "the state directory was made");
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let (code, _, err) = run_cli(&["run", "job.toml", "--metrics-addr", &addr], job.dir.path());
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&format!("cannot listen for metrics on {addr} (--metrics-addr)")), "{err}");
    assert!(!job.dir.path().join("state").exists(), "the state directory was made");
    assert!(!job.out().exists(), "output was written");
}

/// With `job.bad_rows = "dead-letter"`: `sluice_bad_rows_total` counts each
/// record that did not convert once, when its checkpoint commits, and
/// `sluice_rows_total` the good rows; both agree with what the files sink
/// made visible, read back.
#[test]
fn bad_rows_are_counted_once_when_their_checkpoint_commits() {
    const FILES: u64 = 3;
    const PER_FILE: u64 = 400;
    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).expect("input folder");
    // The first file gives `qty` its type; the later ones hold bad values.
    let is_bad = |id: u64| id >= PER_FILE && id % 61 == 3;
    for f in 0..FILES {
        let mut text = String::from("id,qty\n");
        for id in f * PER_FILE..(f + 1) * PER_FILE {
            let qty = if is_bad(id) { format!("x{id}") } else { (id % 9).to_string() };
            text.push_str(&format!("{id},{qty}\n"));
        }
        std::fs::write(input.join(format!("part-{f}.csv")), text).expect("input file");
    }
    let bad = (0..FILES * PER_FILE).filter(|id| is_bad(*id)).count() as f64;
    let good = (FILES * PER_FILE) as f64 - bad;
    let job = TestJob {
        dir,
        toml: format!(
            r#"[job]
id = "metrics-bad"
parallelism = 2
state_dir = "state"
bad_rows = "dead-letter"
[job.checkpoint]
every_rows = 150
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 50
[sink]
id = "out"
plugin = "{FILES_PLUGIN}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#
        ),
    };
    let metrics = Metrics::new();
    let server = MetricsServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), "test", metrics.clone()).expect("serve");
    let summary = job
        .run_opts(&[], RunOptions { metrics: metrics.clone(), ..RunOptions::default() })
        .unwrap_or_else(|e| panic!("the run failed: {e}"));
    let (status, text) = get(server.addr(), "/metrics").expect("scrape");
    assert_eq!(status, 200);
    let scrape = parse_all(&[text]).pop().expect("one scrape");
    let landed = read_parquet_tree(&job.out()).num_rows() as f64;
    let letters = read_parquet_tree(&job.out().join("dead_letters")).num_rows() as f64;
    assert_eq!((landed, letters), (good, bad), "what the files sink made visible");
    assert_eq!(scrape.value("sluice_bad_rows_total{job=metrics-bad,table=}"), bad, "{scrape:#?}");
    assert_eq!(scrape.value("sluice_rows_total{job=metrics-bad,table=}"), good);
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), bad as u64)), "{summary}");
}
