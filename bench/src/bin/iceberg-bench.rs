//! Iceberg sink throughput, measured in one run on the same generated rows:
//! the Sluice plugin (through the engine, checkpoints and one snapshot per
//! checkpoint), a native Rust program using iceberg-rust's writer directly
//! (the practical limit), and PyIceberg's `append`.
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin iceberg-bench`

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use sluice::plugin::PluginHost;
use sluice::source::generator::Generator;
use sluice_bench::{
    Measured, create_generator_table, generator_job_toml, native_iceberg_write, plugin, print_ratio_table, run_quiet,
    sql_catalog, write_job,
};

#[derive(Parser)]
struct Args {
    /// Rows per measured run.
    #[arg(long, default_value_t = 2_000_000)]
    rows: u64,
    /// Rows per checkpoint (per snapshot), over all writers.
    #[arg(long, default_value_t = 500_000)]
    checkpoint_rows: u64,
    /// Repetitions of each path (the table shows the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the PyIceberg baseline.
    #[arg(long)]
    skip_python: bool,
}

const BATCH_ROWS: u64 = 8192;

fn run_plugin(host: &PluginHost, wasm: &Path, args: &Args, parallelism: u32) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let sink = format!(
        r#"[sink]
plugin = "{wasm}"
[sink.options]
table = "bench.plugin"
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "warehouse"
[sink.sandbox]
memory_mb = 2048
"#,
        wasm = wasm.display(),
    );
    let every = args.checkpoint_rows / u64::from(parallelism);
    let job = write_job(dir.path(), &generator_job_toml("bench", parallelism, every, args.rows, 0, BATCH_ROWS, &sink))?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the plugin landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

fn run_native(rt: &tokio::runtime::Runtime, args: &Args) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    rt.block_on(async {
        let catalog = sql_catalog(dir.path()).await?;
        create_generator_table(&catalog, "bench.native", false).await?;
        native_iceberg_write(&catalog, "bench.native", args.rows, args.checkpoint_rows, BATCH_ROWS).await
    })
}

const PYICEBERG: &str = r#"
import sys, time, pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
w, data, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
t = pq.read_table(data)
cat = SqlCatalog('bench', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')
cat.create_namespace('bench')
tbl = cat.create_table('bench.py', schema=t.schema)
start = time.perf_counter()
for off in range(0, t.num_rows, chunk):
    tbl.append(t.slice(off, chunk))
print(time.perf_counter() - start)
"#;

fn run_pyiceberg(data: &Path, args: &Args) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let out = Command::new("python3")
        .arg("-c")
        .arg(PYICEBERG)
        .arg(dir.path())
        .arg(data)
        .arg(args.checkpoint_rows.to_string())
        .output()
        .context("running python3")?;
    if !out.status.success() {
        bail!(
            "PyIceberg failed (pip install 'pyiceberg[sql-sqlite,pyarrow]'): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let secs: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().context("PyIceberg's timing")?;
    Ok(Duration::from_secs_f64(secs))
}

/// The generator's rows as one Parquet file, for PyIceberg (not timed).
fn write_rows(path: &Path, rows: u64) -> Result<()> {
    let file = std::fs::File::create(path)?;
    let mut writer = parquet::arrow::ArrowWriter::try_new(file, Generator::schema_ref(), None)?;
    let mut next = 0;
    while next < rows {
        let stop = rows.min(next + 100_000);
        writer.write(&Generator::batch_for(next, stop))?;
        next = stop;
    }
    writer.close()?;
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let wasm = plugin("sluice_sink_iceberg.wasm")?;
    let cache = sluice_bench::workspace().join("target/bench-component-cache");
    let host = PluginHost::new(Some(cache))?;
    host.load(&wasm)?; // compile (or load the cached compilation) before timing
    let rt = tokio::runtime::Runtime::new()?;
    let data_dir = tempfile::tempdir()?;
    let data = data_dir.path().join("rows.parquet");
    if !args.skip_python {
        write_rows(&data, args.rows)?;
    }

    let mut plugin1 = Measured { name: "sluice iceberg plugin, 1 writer".into(), rows: args.rows, times: vec![] };
    let mut plugin2 = Measured { name: "sluice iceberg plugin, 2 writers".into(), rows: args.rows, times: vec![] };
    let mut native = Measured { name: "native iceberg-rust, 1 writer".into(), rows: args.rows, times: vec![] };
    let mut python = Measured { name: "PyIceberg append".into(), rows: args.rows, times: vec![] };
    for rep in 0..args.reps {
        eprintln!("repetition {}/{}", rep + 1, args.reps);
        native.times.push(run_native(&rt, &args)?);
        plugin1.times.push(run_plugin(&host, &wasm, &args, 1)?);
        plugin2.times.push(run_plugin(&host, &wasm, &args, 2)?);
        if !args.skip_python {
            python.times.push(run_pyiceberg(&data, &args)?);
        }
    }
    let mut rows = vec![native, plugin1, plugin2];
    if !args.skip_python {
        rows.push(python);
    }
    print_ratio_table(
        &format!(
            "Iceberg sink: {} rows, {} rows per snapshot, unpartitioned, zstd, median of {}",
            args.rows, args.checkpoint_rows, args.reps
        ),
        &rows,
        "native iceberg-rust, 1 writer",
    );
    if let Some(py) = rows.iter().find(|m| m.name == "PyIceberg append") {
        let p1 = rows[1].rows_per_sec();
        println!("plugin (1 writer) / PyIceberg append: {:.1}×", p1 / py.rows_per_sec().max(f64::MIN_POSITIVE));
    }
    Ok(())
}
