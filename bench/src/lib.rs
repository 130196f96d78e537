//! Shared pieces of Sluice's benchmarks.
//!
//! Invariant: a benchmark never prints an absolute figure alone; every row of
//! its table carries its ratio to a baseline measured in the same run on the
//! same rows, because absolute times are noisy on shared machines.

pub mod contention;
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
use sluice::engine::{self, EngineError, RunOptions, RunSummary};
use sluice::job::Job;
use sluice::plugin::PluginHost;
use sluice::progress::ProgressMode;
use sluice::source::generator::Generator;

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
pub fn write_job(dir: &Path, toml: &str) -> Result<Job> {
    let path = dir.join("job.toml");
    std::fs::write(&path, toml).with_context(|| format!("writing {}", path.display()))?;
    Ok(Job::load(&path, &[])?)
}

/// Runs `job` to the end without progress output.
pub fn run_quiet(job: &Job, host: &PluginHost) -> Result<RunSummary, EngineError> {
    run_quiet_with(job, host, RunOptions::default())
}

/// Runs `job` to the end without progress output, with `opts` (faults, latency).
pub fn run_quiet_with(job: &Job, host: &PluginHost, opts: RunOptions) -> Result<RunSummary, EngineError> {
    engine::run(job, host, &RunOptions { progress: ProgressMode::Quiet, ..opts })
}

/// The workspace root (this crate lives in `bench/`).
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).to_path_buf()
}

/// A plugin component built by `cargo build-plugins`.
pub fn plugin(file: &str) -> Result<PathBuf> {
    let path = workspace().join("target/guests/wasm32-wasip2/release").join(file);
    anyhow::ensure!(path.is_file(), "{} is missing: run `cargo build-plugins` first", path.display());
    Ok(path)
}

/// One measured row of a ratio table.
pub struct Measured {
    pub name: String,
    pub rows: u64,
    pub times: Vec<Duration>,
}

impl Measured {
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

/// Prints a markdown table: rows/s (median, min–max) and the ratio to `baseline`.
pub fn print_ratio_table(title: &str, rows: &[Measured], baseline: &str) -> String {
    let base = rows.iter().find(|m| m.name == baseline).map(Measured::rows_per_sec).unwrap_or(0.0);
    let mut out = format!("### {title}\n\n| path | rows/s (median) | min–max | × {baseline} |\n|---|---:|---:|---:|\n");
    for m in rows {
        let (lo, hi) = m.spread();
        let ratio = if base > 0.0 { m.rows_per_sec() / base } else { 0.0 };
        out.push_str(&format!("| {} | {:.0} | {:.0}–{:.0} | {:.2} |\n", m.name, m.rows_per_sec(), lo, hi, ratio));
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

/// The native baseline: iceberg-rust's writer stack used directly, in this
/// process, one data-file writer per checkpoint and one fast-append commit
/// per checkpoint, on an unpartitioned table. Rows are generated inside the
/// timed loop, as Sluice's source generates them.
pub async fn native_iceberg_write(
    catalog: &SqlCatalog,
    table: &str,
    rows: u64,
    checkpoint_rows: u64,
    batch_rows: u64,
) -> Result<Duration> {
    let ident = TableIdent::from_strs(table.split('.'))?;
    let started = Instant::now();
    let mut table = catalog.load_table(&ident).await?;
    let arrow_schema = Arc::new(schema_to_arrow_schema(table.metadata().current_schema())?);
    let props = WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::default()))
        .build();
    let mut next = 0;
    let mut checkpoint = 0;
    while next < rows {
        checkpoint += 1;
        let end = rows.min(next + checkpoint_rows);
        let names = DefaultFileNameGenerator::new(format!("native-c{checkpoint}"), None, DataFileFormat::Parquet);
        let rolling = RollingFileWriterBuilder::new(
            ParquetWriterBuilder::new(props.clone(), table.metadata().current_schema().clone()),
            128 * 1024 * 1024,
            table.file_io().clone(),
            DefaultLocationGenerator::new(table.metadata())?,
            names,
        );
        let mut writer = DataFileWriterBuilder::new(rolling).build(None).await?;
        while next < end {
            let stop = end.min(next + batch_rows);
            let batch = Generator::batch_for(next, stop);
            writer.write(conform(&batch, &arrow_schema)?).await?;
            next = stop;
        }
        let files = writer.close().await?;
        let tx = Transaction::new(&table);
        let tx = tx.fast_append().with_check_duplicate(false).add_data_files(files).apply(tx)?;
        table = tx.commit(catalog).await?;
    }
    Ok(started.elapsed())
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
