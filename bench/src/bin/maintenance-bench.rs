//! Table maintenance benchmark (`sluice maintain`'s compaction), each row
//! against a baseline measured in the same run on the same rows:
//!
//! 1. scans: a day-partitioned table written by a job with many small
//!    checkpoints (one file per partition per checkpoint), scanned in full
//!    before and after compaction, by PyIceberg (plan and read) and by
//!    DuckDB (reading the files PyIceberg's scan plans: its `iceberg_scan`
//!    extension is downloaded at run time, which this machine cannot do);
//!    the baseline is each reader's scan of the fragmented table;
//! 2. compaction: rows rewritten per second and per CPU-second by the
//!    plugin's compaction, against the same rows written fresh by the same
//!    plugin at the same parallelism (one writer) into the same
//!    partitioning, in one checkpoint (one snapshot).
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin maintenance-bench`

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use sluice_bench::{Measured, generator_job_toml, measure, plugin, print_ratio_table, run_quiet, write_job};
use sluice_engine::maintain::{MaintainOptions, maintain};
use sluice_engine::plugin::PluginHost;

#[derive(Parser)]
struct Args {
    /// Checkpoints of the fragmented table (each one file per partition).
    #[arg(long, default_value_t = 200)]
    checkpoints: u64,
    /// Rows per checkpoint; the generator spreads them over 30 days.
    #[arg(long, default_value_t = 3000)]
    checkpoint_rows: u64,
    /// Repetitions (each on a freshly written table; the tables show the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Scans of each table state per repetition (the median is kept).
    #[arg(long, default_value_t = 3)]
    scans: usize,
}

fn host() -> Result<PluginHost> {
    let cache = sluice_bench::workspace().join("target/bench-component-cache");
    Ok(PluginHost::new(Some(cache))?)
}

/// The job's `[sink]`: the Iceberg plugin, `bench.events` partitioned by day.
fn sink(wasm: &Path) -> String {
    format!(
        r#"[sink]
plugin = "{wasm}"
[sink.options]
table = "bench.events"
partition_by = "day(day)"
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "warehouse"
[sink.sandbox]
memory_mb = 2048
"#,
        wasm = wasm.display(),
    )
}

/// Full scans of `bench.events` in `warehouse`, `scans` times each: prints
/// the median seconds of PyIceberg's planning, of its full scan (plan and
/// read, all columns), and of DuckDB reading the planned files, then the
/// rows and live files.
const SCAN: &str = r#"
import sys, time, statistics, duckdb
from pyiceberg.catalog.sql import SqlCatalog
w, scans = sys.argv[1], int(sys.argv[2])
cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')
plan, full, duck = [], [], []
rows = files = None
for _ in range(scans):
    t = cat.load_table('bench.events')
    s = time.perf_counter()
    tasks = list(t.scan().plan_files())
    plan.append(time.perf_counter() - s)
    s = time.perf_counter()
    a = t.scan().to_arrow()
    full.append(time.perf_counter() - s)
    paths = [task.file.file_path.removeprefix('file://') for task in tasks]
    s = time.perf_counter()
    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")  # it would print on stdout
    n = con.execute(f"select count(*), sum(id) from read_parquet({paths!r}, union_by_name=true)").fetchone()
    # Every column is read, as in a full scan.
    con.execute(f"select * from read_parquet({paths!r}, union_by_name=true)").to_arrow_table()
    con.close()
    duck.append(time.perf_counter() - s)
    if n[0] != a.num_rows:
        sys.exit(f"DuckDB counts {n[0]} rows, PyIceberg {a.num_rows}")
    rows, files = a.num_rows, len(tasks)
print(statistics.median(plan), statistics.median(full), statistics.median(duck), rows, files)
"#;

struct Scan {
    plan: Duration,
    full: Duration,
    duck: Duration,
    rows: u64,
    files: u64,
}

fn scan(warehouse: &Path, scans: usize) -> Result<Scan> {
    let out = Command::new("python3")
        .arg("-c")
        .arg(SCAN)
        .arg(warehouse)
        .arg(scans.to_string())
        .output()
        .context("running python3 (python3 -m pip install -r tests/requirements.txt)")?;
    if !out.status.success() {
        bail!("the PyIceberg/DuckDB scan failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = text.split_whitespace().collect();
    ensure!(fields.len() == 5, "unexpected scan output: {text}");
    let secs = |i: usize| -> Result<Duration> {
        Ok(Duration::from_secs_f64(fields[i].parse().with_context(|| format!("scan output {text}"))?))
    };
    Ok(Scan { plan: secs(0)?, full: secs(1)?, duck: secs(2)?, rows: fields[3].parse()?, files: fields[4].parse()? })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let wasm = plugin("sluice_sink_iceberg.wasm")?;
    let host = host()?;
    let rows = args.checkpoints * args.checkpoint_rows;
    let names = [
        "PyIceberg plan, before",
        "PyIceberg plan, after",
        "PyIceberg full scan, before",
        "PyIceberg full scan, after",
        "DuckDB read, before",
        "DuckDB read, after",
    ];
    let mut scans: Vec<Measured> = names.iter().map(|n| Measured::new(*n, rows)).collect();
    let mut compaction = Measured::new("compaction (sluice maintain)", rows);
    let mut fresh = Measured::new("the same rows written fresh, one snapshot", rows);
    let mut files = (0, 0);

    for rep in 0..args.reps {
        eprintln!(
            "rep {}/{}: writing {} checkpoints of {} rows",
            rep + 1,
            args.reps,
            args.checkpoints,
            args.checkpoint_rows
        );
        let dir = tempfile::tempdir()?;
        let every = args.checkpoint_rows;
        let job = write_job(dir.path(), &generator_job_toml("fragmented", 1, every, rows, 0, every, &sink(&wasm)))?;
        let summary = run_quiet(&job, &host)?;
        ensure!(summary.rows_this_run == rows, "the job wrote {} rows, not {rows}", summary.rows_this_run);
        let warehouse = dir.path().join("warehouse");

        let before = scan(&warehouse, args.scans)?;
        ensure!(before.rows == rows, "PyIceberg reads {} rows before compaction, not {rows}", before.rows);
        let opts = MaintainOptions {
            compact: true,
            target_file_bytes: 128 * 1024 * 1024,
            timeout: Duration::from_secs(3600),
            ..MaintainOptions::default()
        };
        let mut rewritten = 0;
        measure(&mut compaction, || {
            let started = Instant::now();
            let report = maintain(&job, &host, &opts)?;
            let elapsed = started.elapsed();
            rewritten = report.tables.iter().map(|t| t.rows_rewritten).sum();
            Ok(elapsed)
        })?;
        ensure!(rewritten == rows, "compaction rewrote {rewritten} rows, not {rows}");
        let after = scan(&warehouse, args.scans)?;
        ensure!(after.rows == rows, "PyIceberg reads {} rows after compaction, not {rows}", after.rows);
        files = (before.files, after.files);
        for (m, d) in scans.iter_mut().zip([before.plan, after.plan, before.full, after.full, before.duck, after.duck])
        {
            m.times.push(d);
        }

        let dir = tempfile::tempdir()?;
        let job = write_job(dir.path(), &generator_job_toml("fresh", 1, rows, rows, 0, every, &sink(&wasm)))?;
        measure(&mut fresh, || {
            let summary = run_quiet(&job, &host)?;
            ensure!(summary.rows_this_run == rows, "the fresh job wrote {} rows, not {rows}", summary.rows_this_run);
            // The whole run, plugin start included, as compaction's time is.
            Ok(summary.elapsed)
        })?;
    }

    println!(
        "\n{} rows, day-partitioned over 30 days, one writer; {} checkpoints of {} rows: {} live data files before compaction, {} after; {} repetitions\n",
        rows, args.checkpoints, args.checkpoint_rows, files.0, files.1, args.reps
    );
    for pair in scans.chunks(2) {
        print_ratio_table(&format!("Scan: {}", pair[0].name.trim_end_matches(", before")), pair, &pair[0].name);
    }
    print_ratio_table("Compaction against the same rows written fresh", &[fresh.clone(), compaction], &fresh.name);
    Ok(())
}
