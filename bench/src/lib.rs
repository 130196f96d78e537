//! Shared pieces of Sluice's benchmarks.
//!
//! Invariant: a benchmark never prints an absolute figure alone; every row of
//! its table carries its ratio to a baseline measured in the same run on the
//! same rows, because absolute times are noisy on shared machines.

pub mod contention;
pub mod kafka;
pub mod report;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arrow_array::RecordBatch;
use iceberg::arrow::{arrow_schema_to_schema_auto_assign_ids, schema_to_arrow_schema};
use iceberg::io::LocalFsStorageFactory;
use iceberg::spec::{DataFileFormat, UnboundPartitionSpec};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::writer::base_writer::data_file_writer::DataFileWriterBuilder;
use iceberg::writer::file_writer::ParquetWriterBuilder;
use iceberg::writer::file_writer::location_generator::{DefaultFileNameGenerator, DefaultLocationGenerator};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::{IcebergWriter, IcebergWriterBuilder};
use iceberg::{Catalog, CatalogBuilder, TableCreation, TableIdent};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalog, SqlCatalogBuilder};
use parquet::file::properties::WriterProperties;
use sluice_engine::config::EngineConfig;
use sluice_engine::plugin::PluginHost;
use sluice_engine::progress::ProgressMode;
use sluice_engine::source::generator::Generator;
use sluice_engine::{self as engine, EngineError, RunOptions, RunSummary};

/// A job file: generator source of `rows` rows with ids from `first_id`, in
/// batches of `batch_rows`, `parallelism` writers, a checkpoint every
/// `every_rows` rows per writer, state in `state/`; then `sink`, the job's
/// `[sink]` tables as text.
pub fn generator_job_toml(
    id: &str,
    parallelism: u32,
    every_rows: u64,
    rows: u64,
    first_id: u64,
    batch_rows: u64,
    sink: &str,
) -> String {
    format!(
        r#"
[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "generator"
rows = {rows}
first_id = {first_id}
batch_rows = {batch_rows}
{sink}"#
    )
}

/// Writes `toml` as `dir/job.toml` and loads it.
pub fn write_job(dir: &Path, toml: &str) -> Result<EngineConfig> {
    let path = dir.join("job.toml");
    std::fs::write(&path, toml).with_context(|| format!("writing {}", path.display()))?;
    Ok(sluice_job::load(&path, &[])?)
}

/// Runs `job` to the end without progress output.
pub fn run_quiet(job: &EngineConfig, host: &PluginHost) -> Result<RunSummary, EngineError> {
    run_quiet_with(job, host, RunOptions::default())
}

/// Runs `job` to the end without progress output, with `opts` (faults, latency).
pub fn run_quiet_with(job: &EngineConfig, host: &PluginHost, opts: RunOptions) -> Result<RunSummary, EngineError> {
    engine::run(job, host, &RunOptions { progress: ProgressMode::Quiet, ..opts })
}

/// The workspace root (this crate lives in `bench/`).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).to_path_buf()
}

/// A plugin component built by `cargo build-plugins`.
/// The `sluice` binary a benchmark runs as a process: `given`, or the one
/// beside the benchmark's own executable (the same release build).
pub fn sluice_binary(given: Option<&Path>) -> Result<PathBuf> {
    let sluice = match given {
        Some(p) => p.to_path_buf(),
        None => std::env::current_exe()?.with_file_name("sluice"),
    };
    anyhow::ensure!(sluice.is_file(), "{} is missing: run `cargo build --release -p sluice` first", sluice.display());
    Ok(sluice)
}

/// The Iceberg sink component a benchmark runs: `given`, or
/// `cargo build-plugins`'s.
pub fn iceberg_plugin(given: Option<&Path>) -> Result<PathBuf> {
    let plugin = match given {
        Some(p) => p.to_path_buf(),
        None => plugin("sluice_sink_iceberg.wasm")?,
    };
    anyhow::ensure!(plugin.is_file(), "no plugin at {}", plugin.display());
    Ok(plugin)
}

pub fn plugin(file: &str) -> Result<PathBuf> {
    let path = workspace().join("target/guests/wasm32-wasip2/release").join(file);
    anyhow::ensure!(path.is_file(), "{} is missing: run `cargo build-plugins` first", path.display());
    Ok(path)
}

/// One measured row of a ratio table.
#[derive(Clone, Default)]
pub struct Measured {
    pub name: String,
    pub rows: u64,
    pub times: Vec<Duration>,
    /// CPU time (user and system, this process and its waited-for children)
    /// of each repetition, where measured: parallelism cannot flatter a
    /// path per CPU-second.
    pub cpu: Vec<Duration>,
}

/// CPU time this process and its waited-for children used so far (Linux:
/// `/proc/self/stat`'s utime, stime, cutime and cstime, in clock ticks).
pub fn cpu_time() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return Duration::ZERO };
    // Fields after the command name (which may hold spaces) in parentheses.
    let Some((_, rest)) = stat.rsplit_once(')') else { return Duration::ZERO };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime is field 14 of the whole line: index 11 after the state.
    let ticks: u64 = fields.get(11..15).map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    // Linux reports in USER_HZ, 100 on every architecture it runs on here.
    Duration::from_millis(ticks * 10)
}

/// Runs `f`, which times its own measured part, and adds that time and
/// the CPU time of the whole call to `m`.
pub fn measure(m: &mut Measured, f: impl FnOnce() -> Result<Duration>) -> Result<()> {
    let cpu = cpu_time();
    let wall = f()?;
    m.times.push(wall);
    m.cpu.push(cpu_time().saturating_sub(cpu));
    Ok(())
}

impl Measured {
    pub fn new(name: impl Into<String>, rows: u64) -> Self {
        Self { name: name.into(), rows, ..Self::default() }
    }

    /// Median CPU time, if measured.
    pub fn cpu_median(&self) -> Option<Duration> {
        let mut t = self.cpu.clone();
        t.sort();
        t.get(t.len() / 2).copied()
    }

    /// Rows per CPU-second (median CPU time), if measured.
    pub fn rows_per_cpu_sec(&self) -> Option<f64> {
        self.cpu_median().map(|c| if c.as_secs_f64() > 0.0 { self.rows as f64 / c.as_secs_f64() } else { 0.0 })
    }

    /// Median time.
    pub fn median(&self) -> Duration {
        let mut t = self.times.clone();
        t.sort();
        t.get(t.len() / 2).copied().unwrap_or_default()
    }

    pub fn rows_per_sec(&self) -> f64 {
        let s = self.median().as_secs_f64();
        if s > 0.0 { self.rows as f64 / s } else { 0.0 }
    }

    /// Spread as (min, max) rows/s.
    pub fn spread(&self) -> (f64, f64) {
        let rate = |d: &Duration| if d.as_secs_f64() > 0.0 { self.rows as f64 / d.as_secs_f64() } else { 0.0 };
        let rates: Vec<f64> = self.times.iter().map(rate).collect();
        (rates.iter().copied().fold(f64::INFINITY, f64::min), rates.iter().copied().fold(0.0, f64::max))
    }
}

/// Prints a markdown table: rows/s (median, min–max) and the ratio to
/// `baseline`; where CPU time was measured, rows per CPU-second beside it,
/// with its ratio to the baseline's.
pub fn print_ratio_table(title: &str, rows: &[Measured], baseline: &str) -> String {
    let base = rows.iter().find(|m| m.name == baseline);
    let base_wall = base.map(Measured::rows_per_sec).unwrap_or(0.0);
    let base_cpu = base.and_then(Measured::rows_per_cpu_sec).unwrap_or(0.0);
    let with_cpu = rows.iter().any(|m| !m.cpu.is_empty());
    let mut out = format!("### {title}\n\n| path | rows/s (median) | min–max | × {baseline} |");
    if with_cpu {
        out.push_str(" CPU-s (median) | rows per CPU-s | × per CPU-s |\n|---|---:|---:|---:|---:|---:|---:|\n");
    } else {
        out.push_str("\n|---|---:|---:|---:|\n");
    }
    for m in rows {
        let (lo, hi) = m.spread();
        let ratio = if base_wall > 0.0 { m.rows_per_sec() / base_wall } else { 0.0 };
        out.push_str(&format!("| {} | {:.0} | {:.0}–{:.0} | {:.2} |", m.name, m.rows_per_sec(), lo, hi, ratio));
        if with_cpu {
            match (m.cpu_median(), m.rows_per_cpu_sec()) {
                (Some(cpu), Some(per_cpu)) => {
                    let r = if base_cpu > 0.0 { per_cpu / base_cpu } else { 0.0 };
                    out.push_str(&format!(" {:.2} | {per_cpu:.0} | {r:.2} |", cpu.as_secs_f64()));
                }
                _ => out.push_str(" – | – | – |"),
            }
        }
        out.push('\n');
    }
    println!("{out}");
    out
}

/// Opens (creating) the SQLite catalog `<warehouse>/catalog.db`.
pub async fn sql_catalog(warehouse: &Path) -> Result<SqlCatalog> {
    std::fs::create_dir_all(warehouse)?;
    let uri = format!("sqlite:{}?mode=rwc", warehouse.join("catalog.db").display());
    SqlCatalogBuilder::default()
        .with_storage_factory(Arc::new(LocalFsStorageFactory))
        .load(
            "sluice",
            HashMap::from([
                ("uri".to_string(), uri),
                ("warehouse".to_string(), format!("file://{}", warehouse.display())),
                ("sql_bind_style".to_string(), SqlBindStyle::QMark.to_string()),
            ]),
        )
        .await
        .context("opening the SQLite catalog")
}

/// Creates `ns.name` from the generator's schema, optionally partitioned by `day(day)`.
pub async fn create_generator_table(catalog: &SqlCatalog, table: &str, by_day: bool) -> Result<Table> {
    let ident = TableIdent::from_strs(table.split('.'))?;
    let ns = ident.namespace().clone();
    if !catalog.namespace_exists(&ns).await? {
        catalog.create_namespace(&ns, HashMap::new()).await?;
    }
    let schema = arrow_schema_to_schema_auto_assign_ids(&Generator::schema_ref())?;
    let mut creation = TableCreation::builder().name(ident.name().to_string()).schema(schema.clone()).build();
    if by_day {
        let day = schema.field_by_name("day").context("day column")?.id;
        creation.partition_spec = Some(
            UnboundPartitionSpec::builder().add_partition_field(day, "day_day", iceberg::spec::Transform::Day)?.build(),
        );
    }
    Ok(catalog.create_table(&ns, creation).await?)
}

/// Writer properties of the native baselines: zstd, as the plugin writes.
/// The plugin's Parquet settings for an unpartitioned table at its default
/// `buffer_mb` (64): zstd, row groups cut at a sixth of the buffer.
fn native_props() -> WriterProperties {
    WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::default()))
        .set_max_row_group_bytes(Some(64 * 1024 * 1024 / 6))
        .build()
}

/// A data-file writer of iceberg-rust's stack for `table`, naming its files with `prefix`.
async fn native_data_writer(
    table: &Table,
    prefix: String,
) -> Result<impl IcebergWriter<RecordBatch, Vec<iceberg::spec::DataFile>> + 'static> {
    let names = DefaultFileNameGenerator::new(prefix, None, DataFileFormat::Parquet);
    let rolling = RollingFileWriterBuilder::new(
        ParquetWriterBuilder::new(native_props(), table.metadata().current_schema().clone()),
        128 * 1024 * 1024,
        table.file_io().clone(),
        DefaultLocationGenerator::new(table.metadata())?,
        names,
    );
    Ok(DataFileWriterBuilder::new(rolling).build(None).await?)
}

/// The native baseline: iceberg-rust's writer stack used directly, in this
/// process, on an unpartitioned table. Each checkpoint's rows are split
/// among `writers` concurrent writers (tokio tasks, as the plugin's writers
/// are threads), and committed as one fast-append snapshot, as the fan-in
/// committer does. Rows are generated inside the timed loop, as Sluice's
/// source generates them.
pub async fn native_iceberg_write(
    catalog: &SqlCatalog,
    table: &str,
    rows: u64,
    checkpoint_rows: u64,
    batch_rows: u64,
    writers: u32,
) -> Result<Duration> {
    let ident = TableIdent::from_strs(table.split('.'))?;
    let started = Instant::now();
    let mut table = catalog.load_table(&ident).await?;
    let arrow_schema = Arc::new(schema_to_arrow_schema(table.metadata().current_schema())?);
    let mut next = 0;
    let mut checkpoint = 0;
    let writers = u64::from(writers.max(1));
    while next < rows {
        checkpoint += 1;
        let end = rows.min(next + checkpoint_rows);
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (from, to) = (next + (end - next) * w / writers, next + (end - next) * (w + 1) / writers);
            let mut writer = native_data_writer(&table, format!("native-c{checkpoint}-w{w}")).await?;
            let arrow_schema = arrow_schema.clone();
            tasks.push(tokio::spawn(async move {
                let mut at = from;
                while at < to {
                    let stop = to.min(at + batch_rows);
                    writer.write(conform(&Generator::batch_for(at, stop), &arrow_schema)?).await?;
                    at = stop;
                }
                anyhow::Ok(writer.close().await?)
            }));
        }
        let mut files = Vec::new();
        for task in tasks {
            files.extend(task.await??);
        }
        next = end;
        let tx = Transaction::new(&table);
        let tx = tx.fast_append().with_check_duplicate(false).add_data_files(files).apply(tx)?;
        table = tx.commit(catalog).await?;
    }
    Ok(started.elapsed())
}

/// The native end-to-end baseline: reads `files` (Parquet) in order with the
/// parquet crate and appends their rows to `table` with one writer of
/// iceberg-rust's stack, committing a snapshot every `commit_rows` rows.
pub async fn native_iceberg_append_files(
    catalog: &SqlCatalog,
    table: &str,
    files: &[PathBuf],
    commit_rows: u64,
    batch_rows: usize,
) -> Result<Duration> {
    let ident = TableIdent::from_strs(table.split('.'))?;
    let started = Instant::now();
    let mut table = catalog.load_table(&ident).await?;
    let arrow_schema = Arc::new(schema_to_arrow_schema(table.metadata().current_schema())?);
    let mut pending = 0u64;
    let mut snapshot = 0;
    let mut writer = native_data_writer(&table, "native-s0".to_string()).await?;
    for path in files {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)?
            .with_batch_size(batch_rows)
            .build()?;
        for batch in reader {
            let batch = batch?;
            let mut offset = 0;
            while offset < batch.num_rows() {
                let take = (batch.num_rows() - offset).min((commit_rows - pending) as usize);
                writer.write(conform(&batch.slice(offset, take), &arrow_schema)?).await?;
                offset += take;
                pending += take as u64;
                if pending == commit_rows {
                    let files = writer.close().await?;
                    let tx = Transaction::new(&table);
                    let tx = tx.fast_append().with_check_duplicate(false).add_data_files(files).apply(tx)?;
                    table = tx.commit(catalog).await?;
                    snapshot += 1;
                    writer = native_data_writer(&table, format!("native-s{snapshot}")).await?;
                    pending = 0;
                }
            }
        }
    }
    let files = writer.close().await?;
    if !files.is_empty() {
        let tx = Transaction::new(&table);
        let tx = tx.fast_append().with_check_duplicate(false).add_data_files(files).apply(tx)?;
        tx.commit(catalog).await?;
    }
    Ok(started.elapsed())
}

/// Peak resident memory of this process while `f` runs, sampled every 5 ms
/// (Linux `VmRSS`), and `f`'s result.
pub fn peak_rss_during<T>(f: impl FnOnce() -> T) -> (T, Option<u64>) {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    fn rss() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    }
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(rss().unwrap_or(0)));
    let sampler = {
        let (stop, peak) = (stop.clone(), peak.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(now) = rss() {
                    peak.fetch_max(now, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let out = f();
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.join();
    let peak = peak.load(Ordering::Relaxed);
    (out, (peak > 0).then_some(peak))
}

/// Casts a generator batch to a table's Arrow schema (field ids, `+00:00`).
pub fn conform(batch: &RecordBatch, schema: &arrow_schema::SchemaRef) -> Result<RecordBatch> {
    let columns = schema
        .fields()
        .iter()
        .map(|f| {
            let col = batch.column_by_name(f.name()).context("column")?;
            Ok(arrow_cast::cast(col, f.data_type())?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// `YYYY-MM-DD` of `days` since 1970-01-01 (Howard Hinnant's civil-from-days).
pub fn civil(days: i64) -> String {
    let days = days + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// Today in UTC: the docs date every figure.
pub fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    civil(i64::try_from(secs / 86_400).unwrap_or(0))
}

/// CPU time (user and system) of this process's waited-for children so far
/// (Linux: `/proc/self/stat`'s cutime and cstime, in clock ticks).
pub fn children_cpu() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return Duration::ZERO };
    let Some((_, rest)) = stat.rsplit_once(')') else { return Duration::ZERO };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // cutime and cstime are fields 16 and 17 of the whole line: 13 and 14 after the state.
    let ticks: u64 = fields.get(13..15).map_or(0, |f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum());
    // USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis(ticks * 10)
}
