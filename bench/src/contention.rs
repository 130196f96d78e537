//! Seed 002's commit-contention study on a real Iceberg table (SqlCatalog on
//! SQLite, local warehouse, partitioned by `day(day)`).
//!
//! W writers each land K windows; a window covers D = 30 day-partitions.
//! Strategies A0, A, A-fixed and C commit each day-partition separately, as
//! the seed does; B commits a window at once; D is Sluice itself (the Iceberg
//! plugin, W writers, one fan-in committer, one snapshot per window).
//!
//! Invariants: every strategy writes the same rows (ids unique per writer and
//! window); a commit attempt goes to the catalog exactly once, never through
//! iceberg-rust's own rebase-and-retry; "lost" means a window (or one of its
//! days) was given up after the retries ran out; duplicates are counted by
//! reading the table back.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use arrow_array::{Array, Int64Array, RecordBatch};
use iceberg::arrow::{RecordBatchPartitionSplitter, schema_to_arrow_schema};
use iceberg::spec::{DataFile, DataFileFormat, PartitionKey};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::writer::base_writer::data_file_writer::DataFileWriterBuilder;
use iceberg::writer::file_writer::ParquetWriterBuilder;
use iceberg::writer::file_writer::location_generator::{DefaultFileNameGenerator, DefaultLocationGenerator};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::{IcebergWriter, IcebergWriterBuilder};
use iceberg::{Catalog, ErrorKind, Namespace, NamespaceIdent, TableCommit, TableCreation, TableIdent};
use iceberg_catalog_sql::SqlCatalog;
use parquet::file::properties::WriterProperties;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_engine::RunOptions;
use sluice_engine::fault::{CatalogFaults, Faults};
use sluice_engine::plugin::PluginHost;
use sluice_engine::source::generator::{DAYS, Generator};

use crate::{conform, create_generator_table, sql_catalog};

/// The six strategies of the study.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    A0,
    A,
    AFixed,
    B,
    C,
    D,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [Strategy::A0, Strategy::A, Strategy::AFixed, Strategy::B, Strategy::C, Strategy::D];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::A0 => "A0",
            Strategy::A => "A",
            Strategy::AFixed => "A-fixed",
            Strategy::B => "B",
            Strategy::C => "C",
            Strategy::D => "D (Sluice)",
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Strategy::A0 => "table loaded once, every error retried, no sleep (the seed's anti-pattern)",
            Strategy::A => "reload per attempt, retry conflicts only, exponential backoff with full jitter",
            Strategy::AFixed => "A with a fixed backoff",
            Strategy::B => "A, one transaction per window instead of per day",
            Strategy::C => "A with commits serialised (concurrency 1)",
            Strategy::D => "Sluice: W writers, one fan-in committer, one snapshot per window",
        }
    }
}

/// One study configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub writers: u32,
    pub windows: u32,
    /// Rows per day-partition per writer per window.
    pub rows_per_partition: u64,
    pub max_attempts: u32,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// Injected catalog commit latency (stands in for a remote catalog).
    pub commit_delay: Duration,
    pub seed: u64,
}

impl Config {
    pub fn rows_per_window(&self) -> u64 {
        DAYS * self.rows_per_partition
    }
    pub fn expected_rows(&self) -> u64 {
        u64::from(self.writers) * u64::from(self.windows) * self.rows_per_window()
    }
    /// First id of writer `w`'s window `k`.
    fn first_id(&self, w: u32, k: u32) -> u64 {
        (u64::from(k) * u64::from(self.writers) + u64::from(w)) * self.rows_per_window()
    }
}

/// What one run of one strategy did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub wall: Duration,
    pub attempts: u64,
    pub conflicts: u64,
    pub lost_windows: u64,
    pub rows_landed: u64,
    pub rows_expected: u64,
    pub duplicated_rows: u64,
}

#[derive(Default)]
struct Counters {
    attempts: AtomicU64,
    conflicts: AtomicU64,
}

/// A catalog for one commit attempt: `load_table` hands the transaction the
/// table the strategy chose (so iceberg never rebases), the injected delay
/// precedes the real compare-and-swap, and no error is retryable (so
/// iceberg's own retry never runs).
#[derive(Debug)]
struct OneShot<'a> {
    inner: &'a SqlCatalog,
    table: Table,
    delay: Duration,
}

fn unsupported() -> iceberg::Error {
    iceberg::Error::new(ErrorKind::FeatureUnsupported, "not used by the study")
}

#[async_trait::async_trait]
impl Catalog for OneShot<'_> {
    async fn list_namespaces(&self, _: Option<&NamespaceIdent>) -> iceberg::Result<Vec<NamespaceIdent>> {
        Err(unsupported())
    }
    async fn create_namespace(&self, _: &NamespaceIdent, _: HashMap<String, String>) -> iceberg::Result<Namespace> {
        Err(unsupported())
    }
    async fn get_namespace(&self, _: &NamespaceIdent) -> iceberg::Result<Namespace> {
        Err(unsupported())
    }
    async fn namespace_exists(&self, _: &NamespaceIdent) -> iceberg::Result<bool> {
        Err(unsupported())
    }
    async fn update_namespace(&self, _: &NamespaceIdent, _: HashMap<String, String>) -> iceberg::Result<()> {
        Err(unsupported())
    }
    async fn drop_namespace(&self, _: &NamespaceIdent) -> iceberg::Result<()> {
        Err(unsupported())
    }
    async fn list_tables(&self, _: &NamespaceIdent) -> iceberg::Result<Vec<TableIdent>> {
        Err(unsupported())
    }
    async fn create_table(&self, _: &NamespaceIdent, _: TableCreation) -> iceberg::Result<Table> {
        Err(unsupported())
    }
    async fn load_table(&self, _: &TableIdent) -> iceberg::Result<Table> {
        Ok(self.table.clone())
    }
    async fn drop_table(&self, _: &TableIdent) -> iceberg::Result<()> {
        Err(unsupported())
    }
    async fn purge_table(&self, _: &TableIdent) -> iceberg::Result<()> {
        Err(unsupported())
    }
    async fn table_exists(&self, _: &TableIdent) -> iceberg::Result<bool> {
        Ok(true)
    }
    async fn rename_table(&self, _: &TableIdent, _: &TableIdent) -> iceberg::Result<()> {
        Err(unsupported())
    }
    async fn register_table(&self, _: &TableIdent, _: String) -> iceberg::Result<Table> {
        Err(unsupported())
    }
    async fn update_table(&self, commit: TableCommit) -> iceberg::Result<Table> {
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        self.inner.update_table(commit).await.map_err(|e| {
            let kind = e.kind();
            iceberg::Error::new(kind, e.to_string()).with_retryable(false)
        })
    }
}

enum Attempt {
    Committed,
    Conflict,
    Failed(String),
}

struct Native {
    catalog: Arc<SqlCatalog>,
    ident: TableIdent,
    cfg: Config,
    counters: Counters,
    /// Strategy C: one commit at a time.
    serial: tokio::sync::Mutex<()>,
}

impl Native {
    async fn attempt(&self, table: &Table, files: Vec<DataFile>) -> Attempt {
        self.counters.attempts.fetch_add(1, Ordering::Relaxed);
        let tx = Transaction::new(table);
        let tx = match tx.fast_append().with_check_duplicate(false).add_data_files(files).apply(tx) {
            Ok(tx) => tx,
            Err(e) => return Attempt::Failed(e.to_string()),
        };
        let one = OneShot { inner: &self.catalog, table: table.clone(), delay: self.cfg.commit_delay };
        match tx.commit(&one).await {
            Ok(_) => Attempt::Committed,
            Err(e) if e.kind() == ErrorKind::CatalogCommitConflicts => {
                self.counters.conflicts.fetch_add(1, Ordering::Relaxed);
                Attempt::Conflict
            }
            Err(e) => Attempt::Failed(e.to_string()),
        }
    }

    /// Commits `files` under `strategy`; `false` when given up.
    async fn commit(&self, strategy: Strategy, stale: &Table, files: Vec<DataFile>, rng: &mut StdRng) -> bool {
        let _serial = if strategy == Strategy::C { Some(self.serial.lock().await) } else { None };
        for attempt in 1..=self.cfg.max_attempts {
            let table = if strategy == Strategy::A0 {
                stale.clone()
            } else {
                match self.catalog.load_table(&self.ident).await {
                    Ok(t) => t,
                    Err(_) => return false,
                }
            };
            match self.attempt(&table, files.clone()).await {
                Attempt::Committed => return true,
                // A0 retries everything at once, on the same stale table.
                _ if strategy == Strategy::A0 => {}
                Attempt::Conflict => {
                    let cap = self.cfg.backoff_base.saturating_mul(1 << attempt.min(16)).min(self.cfg.backoff_cap);
                    let sleep = match strategy {
                        Strategy::AFixed => self.cfg.backoff_base,
                        _ => Duration::from_micros(rng.random_range(0..=cap.as_micros() as u64)),
                    };
                    tokio::time::sleep(sleep).await;
                }
                Attempt::Failed(message) => {
                    eprintln!("{}: commit failed, giving it up: {message}", strategy.name());
                    return false;
                }
            }
        }
        false
    }

    /// One writer's work under a native strategy: write, then commit per day (or per window for B).
    async fn writer(&self, strategy: Strategy, w: u32) -> Result<u64> {
        let mut rng = StdRng::seed_from_u64(self.cfg.seed ^ (u64::from(w) << 32) ^ strategy as u64);
        let stale = self.catalog.load_table(&self.ident).await?;
        let mut lost = 0;
        for k in 0..self.cfg.windows {
            let table = self.catalog.load_table(&self.ident).await?;
            let first = self.cfg.first_id(w, k);
            let batch = Generator::batch_for(first, first + self.cfg.rows_per_window());
            let parts = write_partitions(&table, &batch, &format!("{}-w{w}-k{k}", strategy.name())).await?;
            let ok = if strategy == Strategy::B {
                self.commit(strategy, &stale, parts.into_iter().flatten().collect(), &mut rng).await
            } else {
                let mut all = true;
                for files in parts {
                    all &= self.commit(strategy, &stale, files, &mut rng).await;
                }
                all
            };
            if !ok {
                lost += 1;
            }
        }
        Ok(lost)
    }
}

/// Writes one data file per day-partition of `batch`.
async fn write_partitions(table: &Table, batch: &RecordBatch, prefix: &str) -> Result<Vec<Vec<DataFile>>> {
    let metadata = table.metadata();
    let schema = metadata.current_schema().clone();
    let arrow_schema = Arc::new(schema_to_arrow_schema(&schema)?);
    let batch = conform(batch, &arrow_schema)?;
    let splitter = RecordBatchPartitionSplitter::try_new_with_computed_values(
        schema.clone(),
        metadata.default_partition_spec().clone(),
    )?;
    let props = WriterProperties::builder().build();
    let mut out = Vec::new();
    for (i, (key, part)) in splitter.split(&batch)?.into_iter().enumerate() {
        let names = DefaultFileNameGenerator::new(format!("{prefix}-p{i}"), None, DataFileFormat::Parquet);
        let rolling = RollingFileWriterBuilder::new(
            ParquetWriterBuilder::new(props.clone(), schema.clone()),
            128 * 1024 * 1024,
            table.file_io().clone(),
            DefaultLocationGenerator::new(metadata)?,
            names,
        );
        let key: PartitionKey = key;
        let mut writer = DataFileWriterBuilder::new(rolling).build(Some(key)).await?;
        writer.write(part).await?;
        out.push(writer.close().await?);
    }
    Ok(out)
}

/// Reads the table's ids: (rows, duplicated rows).
async fn landed(catalog: &SqlCatalog, ident: &TableIdent) -> Result<(u64, u64)> {
    use futures::TryStreamExt;
    let table = catalog.load_table(ident).await?;
    let batches: Vec<RecordBatch> = table.scan().select(["id"]).build()?.to_arrow().await?.try_collect().await?;
    let mut ids = Vec::new();
    for b in &batches {
        let col = b.column(0).as_any().downcast_ref::<Int64Array>().context("id is int64")?;
        ids.extend((0..col.len()).map(|i| col.value(i)));
    }
    ids.sort_unstable();
    let total = ids.len() as u64;
    ids.dedup();
    Ok((total, total - ids.len() as u64))
}

/// Runs one strategy once on a fresh table in `dir`.
pub fn run_once(
    rt: &tokio::runtime::Runtime,
    host: &PluginHost,
    plugin: &Path,
    strategy: Strategy,
    cfg: &Config,
    dir: &Path,
) -> Result<Outcome> {
    let warehouse = dir.join("warehouse");
    let ident = TableIdent::from_strs(["study", "events"])?;
    let catalog = Arc::new(rt.block_on(sql_catalog(&warehouse))?);
    if strategy == Strategy::D {
        let outcome = run_sluice(host, plugin, cfg, dir)?;
        let (rows, dup) = rt.block_on(landed(&catalog, &ident))?;
        return Ok(Outcome { rows_landed: rows, duplicated_rows: dup, ..outcome });
    }
    rt.block_on(create_generator_table(&catalog, "study.events", true))?;
    let native = Arc::new(Native {
        catalog: catalog.clone(),
        ident: ident.clone(),
        cfg: cfg.clone(),
        counters: Counters::default(),
        serial: tokio::sync::Mutex::new(()),
    });
    let started = Instant::now();
    let lost = rt.block_on(async {
        let tasks: Vec<_> = (0..cfg.writers)
            .map(|w| {
                let native = native.clone();
                tokio::spawn(async move { native.writer(strategy, w).await })
            })
            .collect();
        let mut lost = 0;
        for t in tasks {
            lost += t.await.context("writer task")??;
        }
        anyhow::Ok(lost)
    })?;
    let wall = started.elapsed();
    let (rows, dup) = rt.block_on(landed(&catalog, &ident))?;
    Ok(Outcome {
        wall,
        attempts: native.counters.attempts.load(Ordering::Relaxed),
        conflicts: native.counters.conflicts.load(Ordering::Relaxed),
        lost_windows: lost,
        rows_landed: rows,
        rows_expected: cfg.expected_rows(),
        duplicated_rows: dup,
    })
}

/// Strategy D: the Sluice engine with the Iceberg plugin.
fn run_sluice(host: &PluginHost, plugin: &Path, cfg: &Config, dir: &Path) -> Result<Outcome> {
    // The same ids as the native runs (0..W·K·30·R), and each checkpoint is
    // one window: every writer's 30·R rows, committed as one snapshot.
    let sink = format!(
        r#"[sink]
plugin = "{plugin}"
[sink.options]
table = "study.events"
partition_by = "day(day)"
compression = "snappy"
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "warehouse"
[sink.sandbox]
memory_mb = 1024
[job.commit]
max_attempts = {attempts}
"#,
        plugin = plugin.display(),
        attempts = cfg.max_attempts,
    );
    let per_window = cfg.rows_per_window();
    let toml = crate::generator_job_toml("study-d", cfg.writers, per_window, cfg.expected_rows(), 0, per_window, &sink);
    let job = crate::write_job(dir, &toml)?;
    // The same catalog latency as the native strategies' commits.
    let catalog = CatalogFaults { latency: cfg.commit_delay, ..CatalogFaults::default() };
    let slow_catalog = RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() };
    match crate::run_quiet_with(&job, host, slow_catalog) {
        Ok(summary) => Ok(Outcome {
            wall: summary.data_elapsed,
            attempts: summary.catalog_commits,
            conflicts: summary.catalog_conflicts,
            lost_windows: 0,
            rows_landed: 0,
            rows_expected: cfg.expected_rows(),
            duplicated_rows: 0,
        }),
        // A failed job loses nothing it committed; what it did not commit is counted as lost below.
        Err(e) => {
            eprintln!("strategy D failed: {e}");
            Ok(Outcome {
                wall: Duration::ZERO,
                lost_windows: u64::from(cfg.windows),
                rows_expected: cfg.expected_rows(),
                ..Outcome::default()
            })
        }
    }
}
