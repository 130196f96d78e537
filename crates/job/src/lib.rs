//! The job file: TOML, overridden by `--set key=value`, with `${VAR}` and
//! `${VAR:-default}` taken from the environment, then validated and
//! assembled into the crates' configurations ([`EngineConfig`]).
//!
//! Invariants:
//! - every error names the offending key (`job.parallelism`, `sink.plugin`, ...)
//!   and the file;
//! - relative paths are resolved against the job file's directory, so a job
//!   behaves the same from any working directory;
//! - every location (state dir, warehouse, catalog database, source path,
//!   grants, plugin and token files) is parsed by `sluice_core::location`: a
//!   URL whose scheme the key does not serve is refused here, naming the
//!   key, before anything is written, and is never taken for a relative path;
//! - what [`load`] returns is valid in full: every path is absolute, every
//!   value in range, the catalog and the endpoints are resolved (their
//!   tokens read), the jobs `[sink.maintenance]` protects are loaded, so the
//!   engine never checks a job key again.
//!
//! Only the `sluice` binary, the Python module and the test and benchmark
//! harnesses read job files; the engine takes an [`EngineConfig`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sluice_core::location::{Location, Scheme, Served};
use sluice_engine::config::*;
use sluice_store::StoreOptions;

pub use sluice_engine::config::{EngineConfig, JobError};

pub mod reference;

/// What `sink.catalog.warehouse` serves besides local paths: the host's
/// catalog writes the table metadata there through `sluice-store`
/// (`capability/catalog_storage.rs`), the plugin its data and manifest files
/// through `file-io`, as exclusive streaming uploads (on GCS a claimed key
/// and a resumable upload, see `sluice-store`'s `gcs.rs`).
const SQL_WAREHOUSE_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
/// The file source reads objects through `sluice-store` (`source::object`).
const SOURCE_PATH_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };

/// The job file as read: `[source]` is deserialized on its own
/// ([`source_spec`]), so that an error inside it names its full key.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJobSpec {
    job: JobSection,
    source: toml::Value,
    sink: SinkSpec,
}

/// Reads, overrides, interpolates, parses and validates a job file.
pub fn load(path: &Path, overrides: &[String]) -> Result<EngineConfig, JobError> {
    load_as(path, overrides, Depth::Job)
}

/// Like [`load`] for a file's text (`path` names it and anchors paths).
pub fn from_str(text: &str, path: &Path, overrides: &[String]) -> Result<EngineConfig, JobError> {
    from_str_as(text, path, overrides, Depth::Job)
}

/// Whether a job file is loaded as the job, or as one its maintenance
/// protects (whose own `protect` list is not followed, so that two jobs
/// may protect each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Depth {
    Job,
    Protected,
}

fn load_as(path: &Path, overrides: &[String], depth: Depth) -> Result<EngineConfig, JobError> {
    let text = std::fs::read_to_string(path).map_err(|source| JobError::Read { path: path.to_path_buf(), source })?;
    from_str_as(&text, path, overrides, depth)
}

fn from_str_as(text: &str, path: &Path, overrides: &[String], depth: Depth) -> Result<EngineConfig, JobError> {
    let mut table: toml::Table =
        text.parse().map_err(|source| JobError::Syntax { path: path.to_path_buf(), source })?;
    for arg in overrides {
        apply_override(&mut table, arg)?;
    }
    interpolate_env(&mut table, "", path)?;
    let raw: RawJobSpec = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
        let key = e.path().to_string();
        JobError::Invalid {
            path: path.to_path_buf(),
            key: if key == "." { "(top level)".to_string() } else { key },
            message: hint_integer(e.into_inner().to_string()),
        }
    })?;
    let source = source_spec(raw.source).map_err(|(key, message)| JobError::Invalid {
        path: path.to_path_buf(),
        key,
        message,
    })?;
    let spec = JobSpec { job: raw.job, source, sink: raw.sink };
    let base_dir = absolute(path.parent().unwrap_or(Path::new("."))).map_err(|e| JobError::Invalid {
        path: path.to_path_buf(),
        key: "(job file)".into(),
        message: e,
    })?;
    let mut job = Loading {
        depth,
        cfg: EngineConfig {
            state_dir: PathBuf::new(),
            state: Location::Local(PathBuf::new()),
            state_stores: StoreOptions::default(),
            source_stores: StoreOptions::default(),
            sink_stores: StoreOptions::default(),
            spec,
            path: path.to_path_buf(),
            base_dir,
            catalog: None,
            endpoints: BTreeMap::new(),
            http_endpoints: BTreeMap::new(),
            kafka: None,
            metrics_addr: None,
            max_commit_age: Duration::ZERO,
            maintenance: None,
            dead_letters: None,
        },
    };
    job.validate()?;
    Ok(job.cfg)
}

/// A job as far as it is checked: each step reads the configuration
/// assembled so far and fills in what it resolves.
struct Loading {
    cfg: EngineConfig,
    depth: Depth,
}

impl Deref for Loading {
    type Target = EngineConfig;
    fn deref(&self) -> &EngineConfig {
        &self.cfg
    }
}

impl DerefMut for Loading {
    fn deref_mut(&mut self) -> &mut EngineConfig {
        &mut self.cfg
    }
}

impl Loading {
    /// Checks the job in named steps, each resolving what it checks.
    fn validate(&mut self) -> Result<(), JobError> {
        self.check_job_section()?;
        self.check_metrics()?;
        self.check_source()?;
        self.check_change_stream()?;
        self.check_dead_letters()?;
        self.check_plugin()?;
        self.check_sandbox()?;
        self.check_maintenance()?;
        self.check_sink_options()?;
        self.check_grants()?;
        self.resolve_state_dir()?;
        self.state_stores = self.store_options("job", &self.spec.job.s3, &self.spec.job.gcs)?;
        // A generator reads no store: `[source.s3]` there is an unknown key.
        self.source_stores = match &self.spec.source {
            SourceSpec::File { s3, gcs, .. } => self.store_options("source", s3, gcs)?,
            SourceSpec::Generator { .. } | SourceSpec::Kafka(_) => StoreOptions::default(),
        };
        self.sink_stores = self.store_options("sink", &self.spec.sink.s3, &self.spec.sink.gcs)?;
        self.catalog = self.spec.sink.catalog.as_ref().map(|c| self.catalog_config(c)).transpose()?;
        self.resolve_endpoints()
    }

    /// `[job]`: the ids, the parallelism, the checkpoint trigger and the commit retries.
    fn check_job_section(&self) -> Result<(), JobError> {
        check_id(&self.spec.job.id).map_err(|m| self.invalid("job.id", m))?;
        check_id(&self.spec.sink.id).map_err(|m| self.invalid("sink.id", m))?;
        if self.spec.job.parallelism == 0 || self.spec.job.parallelism > 1024 {
            return Err(self.invalid("job.parallelism", "must be between 1 and 1024"));
        }
        let ck = &self.spec.job.checkpoint;
        if ck.every_rows == Some(0) {
            return Err(self.invalid("job.checkpoint.every_rows", "must be at least 1"));
        }
        if let Some(s) = ck.interval_secs {
            seconds(s, INTERVAL_SECS).map_err(|m| self.invalid("job.checkpoint.interval_secs", m))?;
        }
        if ck.retain == 0 {
            return Err(self.invalid("job.checkpoint.retain", "must be at least 1"));
        }
        seconds(self.spec.job.lease_secs, LEASE_SECS).map_err(|m| self.invalid("job.lease_secs", m))?;
        let commit = &self.spec.job.commit;
        if commit.max_attempts == 0 {
            return Err(self.invalid("job.commit.max_attempts", "must be at least 1"));
        }
        for (key, ms) in [
            ("job.commit.initial_backoff_ms", commit.initial_backoff_ms),
            ("job.commit.max_backoff_ms", commit.max_backoff_ms),
        ] {
            if ms > MAX_WAIT_MS {
                return Err(self.invalid(key, format!("must be at most {MAX_WAIT_MS} (an hour), got {ms}")));
            }
        }
        Ok(())
    }

    /// `job.bad_rows`, `[job.dead_letter]` and `job.max_bad_rows`: dead
    /// letters are refused where no record can turn into one (Parquet
    /// files, whose values carry their types), so that nobody counts on
    /// them there.
    fn check_dead_letters(&mut self) -> Result<(), JobError> {
        use sluice_engine::source::BadRows;
        let job = &self.spec.job;
        match (job.bad_rows, &job.dead_letter) {
            (BadRows::Fail, None) => {
                if job.max_bad_rows.is_some() {
                    return Err(self.invalid(
                        "job.max_bad_rows",
                        "limits dead letters; with job.bad_rows = \"fail\" (the default) the first bad row stops the job",
                    ));
                }
                return Ok(());
            }
            (BadRows::Fail, Some(_)) => {
                return Err(self.invalid(
                    "job.dead_letter",
                    "is used only with job.bad_rows = \"dead-letter\"; set that too, or remove [job.dead_letter]",
                ));
            }
            (BadRows::DeadLetter, None) => {
                return Err(self.invalid(
                    "job.bad_rows",
                    "\"dead-letter\" needs a table: add [job.dead_letter] with table = \"...\"",
                ));
            }
            (BadRows::DeadLetter, Some(_)) => {}
        }
        let table = job.dead_letter.as_ref().map(|d| d.table.clone()).unwrap_or_default();
        if table.trim().is_empty() || table.trim() != table {
            return Err(self.invalid("job.dead_letter.table", format!("{table:?} is not a table name")));
        }
        // A dotted name is a table named in full (`namespace.table`), which
        // the sink lands as it is. Beside a sink `table` pattern it must be
        // in the pattern's form (`lake.dead_letters` beside `lake.{table}`),
        // or the sink would nest it in the pattern (`lake.other.dl`) while
        // every message names it as written.
        if table.contains('.')
            && let Some((_, pattern)) = self.sink_options().into_iter().find(|(k, _)| k == "table")
            && let Some((before, after)) = pattern.split_once("{table}")
            && !in_pattern_form(&pattern, &table)
        {
            return Err(self.invalid(
                "job.dead_letter.table",
                format!(
                    "{table:?} is a table named in full (namespace.table), but the sink's table pattern \
                     sink.options.table = {pattern:?} would land it in {:?}; name it {:?} to land it as \
                     written, or give a plain name such as \"dead_letters\" (which lands in {:?})",
                    pattern.replace("{table}", &table),
                    format!("{before}<name>{after}"),
                    pattern.replace("{table}", "dead_letters"),
                ),
            ));
        }
        match &self.spec.source {
            SourceSpec::File { format, path, .. } => {
                let format = format.or_else(|| FileFormat::from_path(path));
                if format == Some(FileFormat::Parquet) {
                    return Err(self.invalid(
                        "job.bad_rows",
                        "Parquet values carry their types, so no Parquet record turns into a dead letter; use \"fail\"",
                    ));
                }
            }
            SourceSpec::Generator { tables, .. } => {
                if tables.iter().any(|t| self.land_together(t, &table)) {
                    return Err(self.invalid(
                        "job.dead_letter.table",
                        format!("{table:?} is a table of the source; give dead letters a table of their own"),
                    ));
                }
            }
            // A topic pattern is matched against the table when the source opens.
            SourceSpec::Kafka(spec) => {
                if spec.topics.contains(&table) {
                    return Err(self.invalid(
                        "job.dead_letter.table",
                        format!("{table:?} is a topic the source reads; give dead letters a table of their own"),
                    ));
                }
            }
        }
        let max = match &job.max_bad_rows {
            None => None,
            Some(toml::Value::Integer(n)) if *n >= 0 => Some(MaxBadRows::Count(*n as u64)),
            Some(toml::Value::Float(x)) if x.is_finite() && *x > 0.0 && *x < 1.0 => Some(MaxBadRows::Fraction(*x)),
            Some(other) => {
                return Err(self.invalid(
                    "job.max_bad_rows",
                    format!(
                        "{other} is neither a count of bad rows over the job (an integer, 0 or more) nor a share of the records read over the job (a fraction between 0 and 1, such as 0.01)"
                    ),
                ));
            }
        };
        self.dead_letters = Some(DeadLetters { table, max });
        Ok(())
    }

    /// `job.metrics_addr` and `job.health.max_commit_age`.
    fn check_metrics(&mut self) -> Result<(), JobError> {
        const ADDR: &str = "job.metrics_addr";
        if let Some(text) = &self.spec.job.metrics_addr {
            let addr = text.trim().parse::<SocketAddr>().map_err(|_| {
                self.invalid(ADDR, format!("{text:?} is not an address to listen on, such as \"127.0.0.1:9464\""))
            })?;
            self.metrics_addr = Some(addr);
        }
        const AGE: &str = "job.health.max_commit_age";
        self.max_commit_age = match &self.spec.job.health.max_commit_age {
            Some(value) => parse_duration(value).map_err(|m| self.invalid(AGE, m))?,
            None => match self.checkpoint_trigger().1 {
                Some(interval) => interval.saturating_mul(3),
                None => seconds_within(DEFAULT_INTERVAL_SECS * 3.0, INTERVAL_SECS),
            },
        };
        Ok(())
    }

    /// `[source]`; a file source's path becomes absolute.
    fn check_source(&mut self) -> Result<(), JobError> {
        match &self.spec.source {
            SourceSpec::Generator { rows, first_id, rate, batch_rows, tables, new_table_at, .. } => {
                // Ids are stored as Int64: the last one must fit.
                let last = first_id.checked_add(rows.saturating_sub(1)).filter(|&id| id <= MAX_GENERATOR_ID);
                if last.is_none() && *rows > 0 {
                    let key = if *first_id > MAX_GENERATOR_ID { "source.first_id" } else { "source.rows" };
                    return Err(self.invalid(
                        key,
                        format!(
                            "source.first_id = {first_id} with source.rows = {rows} gives ids past \
                             {MAX_GENERATOR_ID} (i64::MAX), the largest id the Int64 `id` column holds"
                        ),
                    ));
                }
                let mut names = std::collections::BTreeSet::new();
                for t in tables {
                    if t.is_empty() || !names.insert(t.as_str()) {
                        return Err(
                            self.invalid("source.tables", format!("{t:?}: table names must be unique and not empty"))
                        );
                    }
                }
                if new_table_at.is_some() && tables.len() < 2 {
                    return Err(
                        self.invalid("source.new_table_at", "needs at least two `tables` (the last one appears late)")
                    );
                }
                self.check_rate_and_batch(*rate, *batch_rows)
            }
            SourceSpec::File { path, batch_rows, format, rate, .. } => {
                self.check_rate_and_batch(*rate, *batch_rows)?;
                let text = path
                    .to_str()
                    .ok_or_else(|| self.invalid("source.path", format!("{} is not UTF-8", path.display())))?;
                // An object store is listed when the source opens (`sluice
                // check` opens it too); here only the URL is judged.
                let resolved = match self.location("source.path", text, SOURCE_PATH_SERVED)? {
                    Location::Local(resolved) => resolved,
                    store => {
                        if let SourceSpec::File { path, .. } = &mut self.spec.source {
                            *path = PathBuf::from(store.to_string());
                        }
                        return Ok(());
                    }
                };
                if !resolved.exists() {
                    return Err(self.invalid("source.path", format!("{} does not exist", resolved.display())));
                }
                if resolved.is_file() && format.is_none() && FileFormat::from_path(&resolved).is_none() {
                    return Err(self.invalid(
                        "source.format",
                        format!(
                            "cannot tell the format of {} from its extension; set csv, json or parquet",
                            resolved.display()
                        ),
                    ));
                }
                if let SourceSpec::File { path, .. } = &mut self.spec.source {
                    *path = resolved;
                }
                Ok(())
            }
            SourceSpec::Kafka(spec) => {
                let spec = spec.clone();
                self.kafka = Some(spec.resolve(self)?);
                Ok(())
            }
        }
    }

    /// `[source] key` and `change_column`: a change stream's key names at
    /// least one column; `change_column` without `key` takes the key from
    /// `[sink.options] key` (a column name, names separated by commas, or a
    /// list of names), and without either is refused naming both; a sink
    /// `key` beside `[source] key` must name the same columns.
    fn check_change_stream(&mut self) -> Result<(), JobError> {
        let SourceSpec::File { key, change_column, .. } = &self.spec.source else { return Ok(()) };
        if key.is_none() && change_column.is_none() {
            return Ok(());
        }
        let sink_key = match self.spec.sink.options.get("key") {
            None => None,
            Some(toml::Value::String(names)) => Some(names.split(',').map(|n| n.trim().to_string()).collect()),
            Some(toml::Value::Array(names)) => Some(
                names
                    .iter()
                    .map(|n| n.as_str().map(str::to_string))
                    .collect::<Option<Vec<String>>>()
                    .ok_or_else(|| self.invalid("sink.options.key", "must be a column name or a list of them"))?,
            ),
            Some(_) => return Err(self.invalid("sink.options.key", "must be a column name or a list of them")),
        };
        let names = match (key, &sink_key, change_column) {
            (Some(key), Some(sink), _) if key.names() != sink.as_slice() => {
                return Err(self.invalid(
                    "sink.options.key",
                    format!(
                        "names {:?} but source.key names {:?}: the sink's key must be the source's change key",
                        sink,
                        key.names()
                    ),
                ));
            }
            (Some(key), _, _) => key.names().to_vec(),
            // The fallback applies only with a change column: a sink key alone
            // never makes the source a change stream.
            (None, Some(sink), Some(_)) => sink.clone(),
            (None, None, Some(column)) => {
                return Err(self.invalid(
                    "source.change_column",
                    format!(
                        "{column:?} makes the source a change stream, which needs a key: set source.key (or the \
                         sink's `key` option) to the column(s) that identify a row"
                    ),
                ));
            }
            (None, _, None) => return Ok(()),
        };
        if names.is_empty() || names.iter().any(|n| n.is_empty()) {
            return Err(self.invalid("source.key", "must name at least one column, and no empty name"));
        }
        if let Some(column) = change_column
            && names.contains(column)
        {
            return Err(self.invalid(
                "source.change_column",
                format!("{column:?} is also a key column (source.key); the change column is consumed"),
            ));
        }
        if let SourceSpec::File { key, .. } = &mut self.spec.source {
            *key = Some(sluice_engine::source::config::Columns(names));
        }
        Ok(())
    }

    fn check_rate_and_batch(&self, rate: Option<f64>, batch_rows: usize) -> Result<(), JobError> {
        let (min, max) = RATE;
        if let Some(r) = rate
            && !(r.is_finite() && min <= r && r <= max)
        {
            return Err(self.invalid(
                "source.rate",
                format!("must be between {} and {} rows per second, got {}", show(min), show(max), show(r)),
            ));
        }
        if batch_rows == 0 || batch_rows > MAX_BATCH_ROWS {
            return Err(
                self.invalid("source.batch_rows", format!("must be between 1 and {MAX_BATCH_ROWS}, got {batch_rows}"))
            );
        }
        Ok(())
    }

    /// `sink.plugin` must be a file; it becomes absolute.
    fn check_plugin(&mut self) -> Result<(), JobError> {
        let plugin = self.local_path("sink.plugin", &self.spec.sink.plugin)?;
        if !plugin.is_file() {
            return Err(self.invalid(
                "sink.plugin",
                format!("no plugin file at {} (build the plugins with `cargo build-plugins`)", plugin.display()),
            ));
        }
        self.spec.sink.plugin = plugin;
        Ok(())
    }

    /// `[sink.sandbox]`: every limit in range.
    fn check_sandbox(&self) -> Result<(), JobError> {
        let sb = &self.spec.sink.sandbox;
        seconds(sb.call_timeout_secs, CALL_TIMEOUT_SECS)
            .map_err(|m| self.invalid("sink.sandbox.call_timeout_secs", m))?;
        if sb.memory_mb < 16 {
            return Err(self.invalid("sink.sandbox.memory_mb", "must be at least 16"));
        }
        if sb.memory_mb > MAX_MEMORY_MB {
            return Err(self.invalid(
                "sink.sandbox.memory_mb",
                format!(
                    "{} is more than a plugin instance can use: a 32-bit WebAssembly instance addresses at most \
                     {MAX_MEMORY_MB} MB; set at most {MAX_MEMORY_MB}",
                    sb.memory_mb
                ),
            ));
        }
        if sb.host_memory_mb < 16 {
            return Err(self.invalid("sink.sandbox.host_memory_mb", "must be at least 16"));
        }
        for (key, value) in [
            ("sink.sandbox.log_bytes_per_call", sb.log_bytes_per_call),
            ("sink.sandbox.log_bytes_per_sec", sb.log_bytes_per_sec),
            ("sink.sandbox.max_open_files", u64::from(sb.max_open_files)),
            ("sink.sandbox.max_grpc_streams", u64::from(sb.max_grpc_streams)),
            ("sink.sandbox.max_http_requests", u64::from(sb.max_http_requests)),
        ] {
            if value == 0 {
                return Err(self.invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// `[sink.maintenance]`: every duration parses, and orphan cleanup
    /// beside running writers keeps at least [`MIN_RUNNING_ORPHAN_AGE`].
    fn check_maintenance(&mut self) -> Result<(), JobError> {
        let Some(spec) = &self.spec.sink.maintenance else { return Ok(()) };
        let key = |k: &str| format!("sink.maintenance.{k}");
        let duration = |k: &str, v: &toml::Value| parse_long_duration(v).map_err(|m| self.invalid(&key(k), m));
        let every = duration("compact_every", &spec.compact_every)?;
        // The plugin is 32-bit: its rolling writer counts bytes in a `usize`.
        if spec.target_file_mb == 0 || spec.target_file_mb > 4095 {
            return Err(self.invalid(&key("target_file_mb"), "must be between 1 and 4095"));
        }
        let expire_older_than =
            spec.expire_older_than.as_ref().map(|v| duration("expire_older_than", v)).transpose()?;
        if spec.keep_last == Some(0) {
            return Err(self.invalid(&key("keep_last"), "must be at least 1 (the current snapshot is always kept)"));
        }
        let orphans =
            spec.remove_orphans_older_than.as_ref().map(|v| duration("remove_orphans_older_than", v)).transpose()?;
        let timeout = spec.timeout.as_ref().map(|v| duration("timeout", v)).transpose()?;
        if let Some(age) = orphans {
            // Unnamed files live as long as a checkpoint round (its files
            // are named once it is persisted) or a compaction pass (until
            // its replace commits): the retention must outlast both.
            let (_, interval) = self.checkpoint_trigger();
            let Some(interval) = interval else {
                return Err(self.invalid(
                    &key("remove_orphans_older_than"),
                    "needs job.checkpoint.interval_secs: with rows alone a checkpoint round may last any time, \
                     and the files of the round under way are named by no checkpoint yet, so only their age \
                     protects them",
                ));
            };
            let pass = timeout.unwrap_or(Duration::from_secs(3600));
            let least = MIN_RUNNING_ORPHAN_AGE.max(interval.saturating_mul(3)).max(pass);
            if age < least {
                return Err(self.invalid(
                    &key("remove_orphans_older_than"),
                    format!(
                        "{} is too short beside running writers: the files of the round under way, and of a \
                         compaction not yet committed, are named by no checkpoint or snapshot yet, so only their \
                         age protects them; use at least {} (1h, 3 checkpoint intervals and the maintenance \
                         timeout), or `sluice maintain --remove-orphans-older-than` while no job writes",
                        humantime::format_duration(age),
                        humantime::format_duration(least)
                    ),
                ));
            }
        }
        // The jobs to protect load now, so that a wrong path is refused
        // before the run writes anything; each pass reads their state anew.
        let protect = match self.depth {
            Depth::Job => spec
                .protect
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    load_as(&self.resolve(p), &[], Depth::Protected)
                        .map_err(|e| self.invalid(&key(&format!("protect[{i}]")), e.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()?,
            Depth::Protected => Vec::new(),
        };
        self.maintenance = Some(ContinuousMaintenance {
            every,
            target_file_bytes: spec.target_file_mb * 1024 * 1024,
            expire_older_than,
            keep_last: spec.keep_last,
            remove_orphans_older_than: orphans,
            timeout: timeout.unwrap_or(Duration::from_secs(3600)),
            protect,
        });
        Ok(())
    }

    /// `[sink.options]`: plain values only (the plugin receives strings).
    fn check_sink_options(&self) -> Result<(), JobError> {
        for (key, value) in &self.spec.sink.options {
            if matches!(value, toml::Value::Table(_)) {
                return Err(self.invalid(&format!("sink.options.{key}"), "must be a plain value, not a table"));
            }
        }
        Ok(())
    }

    /// `[sink.grants]`: every location parses and is served (local paths,
    /// `s3://` and `gs://`); the file-io capability resolves them again as
    /// it sets them up.
    fn check_grants(&self) -> Result<(), JobError> {
        const GRANTS: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
        let g = &self.spec.sink.grants;
        for (list, name) in [(&g.locations, "locations"), (&g.read_locations, "read_locations")] {
            for (i, location) in list.iter().enumerate() {
                self.location(&format!("sink.grants.{name}[{i}]"), location, GRANTS)?;
            }
        }
        Ok(())
    }

    /// `[<part>.s3]` and `[<part>.gcs]`, their keys read from the environment.
    fn store_options(&self, part: &str, s3: &S3Spec, gcs: &GcsSpec) -> Result<StoreOptions, JobError> {
        let endpoint = |key: &str, value: &Option<String>| -> Result<Option<String>, JobError> {
            let Some(v) = value else { return Ok(None) };
            let rest = v.strip_prefix("https://").or_else(|| v.strip_prefix("http://"));
            match rest {
                Some(host) if !host.is_empty() && !host.starts_with('/') && v.trim() == v => Ok(Some(v.clone())),
                _ => Err(self.invalid(key, format!("{v:?} is not an http:// or https:// URL"))),
            }
        };
        let secret = |key: &str, var: &str| -> Result<String, JobError> {
            match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => Ok(v),
                _ => {
                    Err(self.invalid(key, format!("names the environment variable {var}, which is not set (or empty)")))
                }
            }
        };
        let credentials = match (&s3.access_key_id_env, &s3.secret_access_key_env) {
            (None, None) => {
                if s3.session_token_env.is_some() {
                    return Err(self.invalid(
                        &format!("{part}.s3.session_token_env"),
                        "goes with access_key_id_env and secret_access_key_env",
                    ));
                }
                None
            }
            (Some(id), Some(secret_var)) => Some(sluice_store::S3Credentials {
                access_key_id: secret(&format!("{part}.s3.access_key_id_env"), id)?,
                secret_access_key: secret(&format!("{part}.s3.secret_access_key_env"), secret_var)?,
                session_token: s3
                    .session_token_env
                    .as_ref()
                    .map(|v| secret(&format!("{part}.s3.session_token_env"), v))
                    .transpose()?,
            }),
            _ => {
                return Err(self.invalid(
                    &format!("{part}.s3"),
                    "access_key_id_env and secret_access_key_env go together (or leave both out for the AWS chain)",
                ));
            }
        };
        if let Some(region) = &s3.region
            && (region.is_empty() || !region.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        {
            return Err(self.invalid(&format!("{part}.s3.region"), format!("{region:?} is not a region name")));
        }
        let gcs_endpoint = endpoint(&format!("{part}.gcs.endpoint"), &gcs.endpoint)?;
        if gcs.anonymous && gcs_endpoint.is_none() {
            return Err(self.invalid(
                &format!("{part}.gcs.anonymous"),
                "sends requests unsigned, which only an emulator takes: set an endpoint too",
            ));
        }
        Ok(StoreOptions {
            s3: sluice_store::S3Options {
                region: s3.region.clone(),
                endpoint: endpoint(&format!("{part}.s3.endpoint"), &s3.endpoint)?,
                credentials,
                virtual_host_style: s3.virtual_host_style,
            },
            // No endpoint named: Google's, or the emulator `STORAGE_EMULATOR_HOST` names.
            gcs: match gcs_endpoint {
                Some(endpoint) => sluice_store::GcsOptions { endpoint: Some(endpoint), anonymous: gcs.anonymous },
                None => sluice_store::GcsOptions::from_env(),
            },
        })
    }

    /// `job.state_dir`, or `.sluice/<id>` next to the job file.
    /// S3 and GCS are served: records are exclusive creates, the run's lease
    /// a compare-and-swap on the object's version (S3's ETag, GCS's
    /// generation); see `engine/object_state.rs`.
    fn resolve_state_dir(&mut self) -> Result<(), JobError> {
        const KEY: &str = "job.state_dir";
        self.state = match &self.spec.job.state_dir {
            Some(dir) => {
                let text = dir.to_str().ok_or_else(|| self.invalid(KEY, format!("{} is not UTF-8", dir.display())))?;
                Location::parse(text, &self.base_dir, STATE_DIR_SERVED).map_err(|e| self.invalid(KEY, e.to_string()))?
            }
            None => Location::Local(self.base_dir.join(".sluice").join(&self.spec.job.id)),
        };
        self.state_dir = match &self.state {
            Location::Local(path) => path.clone(),
            store => PathBuf::from(store.to_string()),
        };
        Ok(())
    }

    /// `[sink.grpc.*]` and `[sink.http.*]`, their tokens read.
    fn resolve_endpoints(&mut self) -> Result<(), JobError> {
        let mut endpoints = BTreeMap::new();
        for (name, spec) in &self.spec.sink.grpc {
            endpoints.insert(name.clone(), self.endpoint_config("grpc", name, spec)?);
        }
        self.endpoints = endpoints;
        let mut http = BTreeMap::new();
        for (name, spec) in &self.spec.sink.http {
            http.insert(name.clone(), self.endpoint_config("http", name, spec)?);
        }
        self.http_endpoints = http;
        Ok(())
    }

    /// The location `raw` given for `key`, refused unless `served` lists its kind.
    fn location(&self, key: &str, raw: &str, served: Served) -> Result<Location, JobError> {
        Location::parse(raw, &self.base_dir, served).map_err(|e| self.invalid(key, e.to_string()))
    }

    /// The absolute local path given for `key`, which serves local paths only:
    /// a URL of any other scheme is refused, never taken for a relative path.
    pub(crate) fn local_path(&self, key: &str, raw: &Path) -> Result<PathBuf, JobError> {
        let text = raw.to_str().ok_or_else(|| self.invalid(key, format!("{} is not UTF-8", raw.display())))?;
        let location = self.location(key, text, Served::LOCAL)?;
        location.into_local().ok_or_else(|| self.invalid(key, format!("{text:?} is not a local path")))
    }

    /// A secret from the environment variable `var`; `key` names the job key.
    fn token_from_env(&self, key: &str, var: &str) -> Result<Secret, JobError> {
        match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => Ok(Secret::new(v.trim())),
            Ok(_) => Err(self.invalid(key, format!("the environment variable {var} is empty"))),
            Err(_) => Err(self.invalid(key, format!("the environment variable {var} is not set"))),
        }
    }

    fn catalog_config(&self, spec: &CatalogSpec) -> Result<CatalogConfig, JobError> {
        const WAREHOUSE: &str = "sink.catalog.warehouse";
        let name = spec.name.clone();
        let text = spec
            .warehouse
            .to_str()
            .ok_or_else(|| self.invalid(WAREHOUSE, format!("{} is not UTF-8", spec.warehouse.display())))?;
        // Both kinds serve the same stores: the plugin writes the data files through `file-io`.
        let warehouse = Location::parse(text, &self.base_dir, SQL_WAREHOUSE_SERVED)
            .map_err(|e| self.invalid(WAREHOUSE, e.to_string()))?;
        match spec.kind {
            CatalogKind::Sql => {
                let rest_only = [
                    ("uri", spec.uri.is_some()),
                    ("token_env", spec.token_env.is_some()),
                    ("credential_env", spec.credential_env.is_some()),
                    ("credential_file", spec.credential_file.is_some()),
                    ("oauth2_server_uri", spec.oauth2_server_uri.is_some()),
                    ("scope", spec.scope.is_some()),
                ];
                if let Some((key, _)) = rest_only.iter().find(|(_, given)| *given) {
                    return Err(self.invalid(
                        &format!("sink.catalog.{key}"),
                        format!("kind = \"sql\" takes no `{key}` (that is the REST catalog's)"),
                    ));
                }
                let Some(database) = &spec.database else {
                    return Err(self.invalid("sink.catalog.database", "kind = \"sql\" needs the SQLite file"));
                };
                let database = self.local_path("sink.catalog.database", database)?;
                Ok(CatalogConfig::Sql { name, database, warehouse })
            }
            CatalogKind::Rest => {
                if spec.database.is_some() {
                    return Err(self.invalid(
                        "sink.catalog.database",
                        "kind = \"rest\" takes no `database` (that is the SQLite catalog's file)",
                    ));
                }
                let Some(uri) = &spec.uri else {
                    return Err(self.invalid("sink.catalog.uri", "kind = \"rest\" needs the catalog's base URI"));
                };
                if !(uri.starts_with("http://") || uri.starts_with("https://")) {
                    return Err(self.invalid("sink.catalog.uri", format!("{uri:?} is not an http:// or https:// URI")));
                }
                let auth = self.rest_auth(spec, uri)?;
                Ok(CatalogConfig::Rest { name, uri: uri.clone(), warehouse, auth })
            }
        }
    }

    /// The REST catalog's credentials: none, a static token, or OAuth2
    /// client credentials read from an environment variable or a file.
    fn rest_auth(&self, spec: &CatalogSpec, uri: &str) -> Result<Option<RestAuth>, JobError> {
        // Keys that contradict each other are refused before any is read.
        if spec.credential_env.is_some() && spec.credential_file.is_some() {
            return Err(
                self.invalid("sink.catalog.credential_env", "set at most one of credential_env and credential_file")
            );
        }
        if (spec.credential_env.is_some() || spec.credential_file.is_some()) && spec.token_env.is_some() {
            return Err(self.invalid(
                "sink.catalog.token_env",
                "OAuth2 client credentials obtain and refresh their own tokens: remove `token_env` (a static \
                 token), or remove credential_env/credential_file to send the static token",
            ));
        }
        let (credential, credential_source) = match (&spec.credential_env, &spec.credential_file) {
            (Some(var), _) => {
                let key = "sink.catalog.credential_env";
                (self.token_from_env(key, var)?, format!("the environment variable {var} ({key})"))
            }
            (None, Some(file)) => {
                let key = "sink.catalog.credential_file";
                let path = self.local_path(key, file)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| self.invalid(key, format!("cannot read {}: {e}", path.display())))?;
                if text.trim().is_empty() {
                    return Err(self.invalid(key, format!("{} is empty", path.display())));
                }
                (Secret::new(text.trim()), format!("the file {} ({key})", path.display()))
            }
            (None, None) => {
                for (key, given) in
                    [("oauth2_server_uri", spec.oauth2_server_uri.is_some()), ("scope", spec.scope.is_some())]
                {
                    if given {
                        return Err(self.invalid(
                            &format!("sink.catalog.{key}"),
                            "applies to OAuth2 client credentials only: set credential_env or credential_file too",
                        ));
                    }
                }
                let token = spec
                    .token_env
                    .as_deref()
                    .map(|var| self.token_from_env("sink.catalog.token_env", var))
                    .transpose()?;
                return Ok(token.map(RestAuth::Token));
            }
        };
        let server_uri = match &spec.oauth2_server_uri {
            Some(u) if u.starts_with("http://") || u.starts_with("https://") => u.clone(),
            Some(u) => {
                return Err(
                    self.invalid("sink.catalog.oauth2_server_uri", format!("{u:?} is not an http:// or https:// URI"))
                );
            }
            None => format!("{}/v1/oauth/tokens", uri.trim_end_matches('/')),
        };
        let scope = spec.scope.clone().unwrap_or_else(|| DEFAULT_OAUTH2_SCOPE.to_string());
        Ok(Some(RestAuth::OAuth2(OAuth2Config { credential, credential_source, server_uri, scope })))
    }

    /// `[sink.<section>.<name>]` (`grpc` or `http`), resolved.
    fn endpoint_config(&self, section: &str, name: &str, spec: &EndpointSpec) -> Result<EndpointConfig, JobError> {
        let key = |k: &str| format!("sink.{section}.{name}.{k}");
        let address: tonic::transport::Uri = spec
            .address
            .parse()
            .map_err(|e| self.invalid(&key("address"), format!("{:?} is not a valid URI: {e}", spec.address)))?;
        let tls = match address.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(
                    self.invalid(&key("address"), format!("{:?} must start with http:// or https://", spec.address))
                );
            }
        };
        if spec.auth.is_some() && (spec.token_env.is_some() || spec.token_file.is_some()) {
            let given = if spec.token_env.is_some() { "token_env" } else { "token_file" };
            return Err(self.invalid(
                &key("auth"),
                format!(
                    "auth = \"google\" obtains and refreshes its own tokens: remove `{given}` (a static token), \
                     or remove `auth` to send the static token"
                ),
            ));
        }
        let token = match (&spec.token_env, &spec.token_file) {
            (Some(_), Some(_)) => {
                return Err(self.invalid(&key("token_env"), "set at most one of token_env and token_file"));
            }
            (None, None) => None,
            (Some(var), None) => Some(self.token_from_env(&key("token_env"), var)?),
            (None, Some(file)) => {
                let path = self.local_path(&key("token_file"), file)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| self.invalid(&key("token_file"), format!("cannot read {}: {e}", path.display())))?;
                if text.trim().is_empty() {
                    return Err(self.invalid(&key("token_file"), format!("{} is empty", path.display())));
                }
                Some(Secret::new(text.trim()))
            }
        };
        if !(1..=MAX_WAIT_MS).contains(&spec.connect_timeout_ms) {
            return Err(self.invalid(
                &key("connect_timeout_ms"),
                format!("must be between 1 and {MAX_WAIT_MS} (an hour), got {}", spec.connect_timeout_ms),
            ));
        }
        if let Some(t) = &token
            && !t.expose().bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(self.invalid(&key("token_env"), "the token holds characters a header value cannot"));
        }
        Ok(EndpointConfig {
            address: spec.address.clone(),
            tls,
            token,
            google_auth: spec.auth == Some(EndpointAuth::Google),
            connect_timeout: Duration::from_millis(spec.connect_timeout_ms),
        })
    }
}

/// `[source]`, with any error named by its full key (`source.rows`): the
/// table's `kind` picks the variant, and the rest is deserialized as that
/// variant's fields, their path tracked.
fn source_spec(value: toml::Value) -> Result<SourceSpec, (String, String)> {
    const KINDS: &str = "\"generator\", \"file\" or \"kafka\"";
    let toml::Value::Table(mut fields) = value else {
        return Err(("source".into(), format!("must be a table ([source]), not {}", value.type_str())));
    };
    let kind = match fields.remove("kind") {
        Some(toml::Value::String(kind)) => kind,
        Some(other) => return Err(("source.kind".into(), format!("{other} is not a kind of source; use {KINDS}"))),
        None => return Err(("source.kind".into(), format!("is missing: set {KINDS}"))),
    };
    let tagged = toml::Table::from_iter([(kind, toml::Value::Table(fields))]);
    serde_path_to_error::deserialize(toml::Value::Table(tagged)).map_err(|e| {
        // The first segment is the variant (the kind); the rest is the key in `[source]`.
        let mut key = "source".to_string();
        for segment in e.path().iter().skip(1) {
            match segment {
                serde_path_to_error::Segment::Seq { index } => key.push_str(&format!("[{index}]")),
                other => key.push_str(&format!(".{other}")),
            }
        }
        let message = e.into_inner().to_string();
        if key == "source" && message.starts_with("unknown variant") {
            key = "source.kind".into();
        }
        (key, hint_integer(message))
    })
}

/// A deserializing error's `message` on one line (the key is named
/// apart: toml's "in `key`" lines are dropped), with a hint when it is
/// about an integer written past what a TOML integer holds (such a `--set`
/// value is read as a string).
fn hint_integer(message: String) -> String {
    let message = message
        .lines()
        .map(str::trim)
        .filter(|l| !(l.is_empty() || l.starts_with("in `") && l.ends_with('`')))
        .collect::<Vec<_>>()
        .join(" ");
    let digits = message
        .strip_prefix("invalid type: string \"")
        .and_then(|rest| rest.split_once('"'))
        .is_some_and(|(text, _)| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()));
    if digits { format!("{message} (a job file's integers go up to {}, i64::MAX)", i64::MAX) } else { message }
}

fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 64 {
        return Err("must be 1 to 64 characters long".to_string());
    }
    if !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(format!("{id:?} may only hold ASCII letters, digits, `-` and `_`"));
    }
    Ok(())
}

/// Applies one `key.path=value` override. The value is read as a TOML value
/// (`4`, `true`, `"x"`, `[1, 2]`) and taken as a plain string otherwise.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), JobError> {
    let err = |message: &str| JobError::Override { arg: arg.to_string(), message: message.to_string() };
    let (key, raw) = arg.split_once('=').ok_or_else(|| err("expected key=value"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(err("the key must be a dotted path such as sink.options.path"));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    let (last, parents) = parts.split_last().ok_or_else(|| err("empty key"))?;
    let mut cur = table;
    for part in parents {
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(err(&format!("`{part}` is not a table in the job file"))),
        };
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

/// Replaces `${NAME}` and `${NAME:-default}` in every string value.
fn interpolate_env(table: &mut toml::Table, prefix: &str, path: &Path) -> Result<(), JobError> {
    for (key, value) in table.iter_mut() {
        let full = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        interpolate_value(value, &full, path)?;
    }
    Ok(())
}

fn interpolate_value(value: &mut toml::Value, key: &str, path: &Path) -> Result<(), JobError> {
    match value {
        toml::Value::String(s) => {
            *s = expand(s).map_err(|message| JobError::Invalid {
                path: path.to_path_buf(),
                key: key.to_string(),
                message,
            })?;
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate_value(item, &format!("{key}[{i}]"), path)?;
            }
        }
        toml::Value::Table(t) => interpolate_env(t, key, path)?,
        _ => {}
    }
    Ok(())
}

fn expand(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unclosed `${{` in {s:?}"))?;
        let expr = &after[..end];
        let (name, default) = match expr.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (expr, None),
        };
        match (std::env::var(name), default) {
            (Ok(v), _) if !v.is_empty() => out.push_str(&v),
            (_, Some(d)) => out.push_str(d),
            (Ok(v), None) => out.push_str(&v),
            (Err(_), None) => {
                return Err(format!(
                    "environment variable {name} is not set (write ${{{name}:-default}} for a default)"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

impl sluice_engine::source::kafka::config::Resolver for Loading {
    type Error = JobError;

    fn invalid(&self, key: &str, message: String) -> JobError {
        EngineConfig::invalid(self, key, message)
    }

    fn read_file(&self, key: &str, path: &Path) -> Result<String, JobError> {
        let file = self.local_path(key, path)?;
        std::fs::read_to_string(&file).map_err(|e| self.invalid(key, format!("cannot read {}: {e}", file.display())))
    }

    fn sink_catalog(&self) -> bool {
        self.spec.sink.catalog.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, sets: &[&str]) -> Result<EngineConfig, JobError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.wasm"), b"x").unwrap();
        let path = dir.path().join("job.toml");
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        from_str(text, &path, &sets)
    }

    const MINIMAL: &str = r#"
        [job]
        id = "j1"
        [source]
        kind = "generator"
        rows = 10
        [sink]
        plugin = "p.wasm"
    "#;

    /// [`MINIMAL`] with a Kafka source whose `[source]` keys are `keys`.
    fn kafka_source(keys: &str) -> String {
        MINIMAL.replace("kind = \"generator\"\n        rows = 10", &format!("kind = \"kafka\"\n{keys}"))
    }

    const KAFKA: &str = r#"
        brokers = ["127.0.0.1:9092"]
        topics = ["orders"]
        format = "json"
        columns = [{ name = "id", type = "long", nullable = false }, { name = "amount", type = "decimal(12,2)" }]
    "#;

    #[test]
    fn a_kafka_source_resolves_its_columns_topic_and_table_pattern() {
        let text = kafka_source(KAFKA)
            .replace("plugin = \"p.wasm\"", "plugin = \"p.wasm\"\n[sink.options]\ntable = \"lake.{topic}\"");
        let job = load(&text, &[]).unwrap_or_else(|e| panic!("{e}"));
        let kafka = job.kafka.as_ref().expect("resolved");
        assert_eq!(kafka.single_topic(), Some("orders"));
        assert!(job.unbounded());
        assert_eq!(job.sink_options(), vec![("table".to_string(), "lake.orders".to_string())]);
        let job = load(&text, &["source.bounded=true"]).unwrap_or_else(|e| panic!("{e}"));
        assert!(!job.unbounded());
    }

    #[test]
    fn a_kafka_source_refuses_what_it_cannot_serve_by_key() {
        let refused = |keys: &str, key: &str, words: &str| {
            let e = load(&kafka_source(keys), &[]).expect_err(keys).to_string();
            assert!(e.contains(key) && e.contains(words), "{keys}: {e}");
        };
        refused(&KAFKA.replace("\"long\"", "\"varchar\""), "source.columns[0]", "not a column type");
        refused(&KAFKA.replace("topics = [\"orders\"]", "topics = [\"a/b\"]"), "source.topics", "a topic name");
        refused(&format!("{KAFKA}\nstart = \"timestamp\""), "source.start_timestamp_ms", "needs");
        refused(
            &format!("{KAFKA}\n[source.properties]\n\"sasl.password\" = \"x\""),
            "source.properties.sasl.password",
            "security",
        );
        refused(
            &format!("{KAFKA}\n[source.properties]\n\"group.id\" = \"x\""),
            "source.properties.group.id",
            "set by Sluice",
        );
        refused(
            &format!(
                "{KAFKA}\n[source.security]\nprotocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-512\"\nusername = \"u\"\npassword_env = \"SLUICE_TEST_UNSET_PASSWORD\""
            ),
            "source.security.password_env",
            "SLUICE_TEST_UNSET_PASSWORD",
        );
        refused(&KAFKA.replace("format = \"json\"", "format = \"raw\""), "source.format", "fixed columns");
        refused(&format!("{KAFKA}\ntopic_pattern = \"o.*\""), "source.topic_pattern", "either topics or topic_pattern");
        // JSON without columns: only with a catalog whose tables give them,
        // and only for listed topics.
        let no_columns = KAFKA.replace(
            "columns = [{ name = \"id\", type = \"long\", nullable = false }, { name = \"amount\", type = \"decimal(12,2)\" }]",
            "",
        );
        assert!(!no_columns.contains("columns"), "{no_columns}");
        refused(&no_columns, "source.columns", "or a [sink.catalog] whose target table gives them");
        let with_catalog = |keys: &str| {
            kafka_source(keys).replace(
                "plugin = \"p.wasm\"",
                "plugin = \"p.wasm\"\n[sink.catalog]\ndatabase = \"wh/c.db\"\nwarehouse = \"wh\"",
            )
        };
        let job = load(&with_catalog(&no_columns), &[]).unwrap_or_else(|e| panic!("{e}"));
        let kafka = job.kafka.as_ref().expect("resolved");
        assert!(matches!(kafka.decoding, kafka::Decoding::JsonOfTable), "{:?}", kafka.decoding);
        let pattern = no_columns.replace("topics = [\"orders\"]", "topic_pattern = \"o.*\"");
        let e = load(&with_catalog(&pattern), &[]).expect_err("a pattern without columns").to_string();
        assert!(e.contains("source.columns") && e.contains("need listed topics"), "{e}");
        let registry = r#"
        brokers = ["127.0.0.1:9092"]
        topic_pattern = "orders.*"
        format = "avro"
        schema_registry = "http://127.0.0.1:8081"
    "#;
        refused(registry, "source.avro_schema", "with topic_pattern, give avro_schema");
        let listed = registry.replace("topic_pattern = \"orders.*\"", "topics = [\"orders\"]");
        refused(&listed.replace("http://", "ftp://"), "source.schema_registry", "not an http(s) URL");
    }

    /// [`MINIMAL`] with a file source at `path`.
    fn file_source(path: &str) -> String {
        let job = MINIMAL
            .replace("kind = \"generator\"\n        rows = 10", &format!("kind = \"file\"\n        path = \"{path}\""));
        assert!(job.contains(path), "{job}");
        job
    }

    /// `[source] key` and `change_column` (#41): a key is one name or a
    /// list; `change_column` without one takes the sink's `key`, or is
    /// refused naming both keys; a sink key that differs is refused.
    #[test]
    fn change_stream_keys_are_resolved_or_refused_naming_both() {
        let src = file_source(".");
        let key_of = |job: &EngineConfig| job.spec.source.change_key().map(<[String]>::to_vec);
        let job = load(&src, &["source.key=\"id\""]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(key_of(&job), Some(vec!["id".to_string()]));
        let job = load(&src, &["source.key=[\"a\", \"b\"]", "source.change_column=\"op\""]).unwrap();
        assert_eq!(key_of(&job), Some(vec!["a".to_string(), "b".to_string()]));
        assert_eq!(key_of(&load(&src, &[]).unwrap()), None, "no key: an append stream");
        // The sink's key is the fallback, as a string (commas) or a list.
        let job = load(&src, &["source.change_column=\"op\"", "sink.options.key=\"id, region\""]).unwrap();
        assert_eq!(key_of(&job), Some(vec!["id".to_string(), "region".to_string()]));
        let job = load(&src, &["source.change_column=\"op\"", "sink.options.key=[\"id\"]"]).unwrap();
        assert_eq!(key_of(&job), Some(vec!["id".to_string()]));
        // A sink key without a change column and without source.key leaves an append stream.
        let job = load(&src, &["sink.options.key=\"id\""]).unwrap();
        assert_eq!(key_of(&job), None, "a sink key alone makes no change stream");
        let err = load(&src, &["source.change_column=\"op\""]).unwrap_err().to_string();
        assert!(err.contains("key `source.change_column`") && err.contains("set source.key"), "{err}");
        let err = load(&src, &["source.key=\"id\"", "sink.options.key=\"other\""]).unwrap_err().to_string();
        assert!(err.contains("key `sink.options.key`") && err.contains("source.key"), "{err}");
        let err = load(&src, &["source.key=[]"]).unwrap_err().to_string();
        assert!(err.contains("key `source.key`") && err.contains("at least one column"), "{err}");
        let err = load(&src, &["source.key=\"op\"", "source.change_column=\"op\""]).unwrap_err().to_string();
        assert!(err.contains("key `source.change_column`") && err.contains("also a key column"), "{err}");
        let err = load(&src, &["source.key=3"]).unwrap_err().to_string();
        assert!(err.contains("source.key") && err.contains("a column name or a list"), "{err}");
    }

    #[test]
    fn minimal_job_gets_defaults() {
        let job = load(MINIMAL, &[]).unwrap();
        assert_eq!(job.spec.job.parallelism, 1);
        assert_eq!(job.spec.sink.id, "sink");
        assert!(job.state_dir.ends_with(".sluice/j1"));
        assert!(job.spec.sink.plugin.is_absolute());
        assert_eq!(job.checkpoint_trigger(), (None, Some(Duration::from_secs(10))));
    }

    #[test]
    fn metrics_address_and_health_age_are_parsed_strictly() {
        let job = load(MINIMAL, &[]).unwrap();
        assert_eq!(job.metrics_addr, None);
        assert_eq!(job.max_commit_age, Duration::from_secs(30), "three default intervals");
        let job = load(MINIMAL, &["job.checkpoint.interval_secs=2"]).unwrap();
        assert_eq!(job.max_commit_age, Duration::from_secs(6));
        let with = MINIMAL.replace(
            "id = \"j1\"",
            "id = \"j1\"\nmetrics_addr = \"127.0.0.1:0\"\n[job.health]\nmax_commit_age = \"1.5m\"",
        );
        let job = load(&with, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(job.metrics_addr, Some("127.0.0.1:0".parse().unwrap()));
        assert_eq!(job.max_commit_age, Duration::from_secs(90));
        for (set, key) in [
            ("job.metrics_addr=\"localhost\"", "job.metrics_addr"),
            ("job.metrics_addr=\"127.0.0.1:99999\"", "job.metrics_addr"),
            ("job.health.max_commit_age=\"10 parsecs\"", "job.health.max_commit_age"),
            ("job.health.max_commit_age=0", "job.health.max_commit_age"),
            ("job.health.max_age=\"1s\"", "max_age"),
        ] {
            let err = load(MINIMAL, &[set]).expect_err(set).to_string();
            assert!(err.contains(key), "{set}: {err}");
        }
        for (text, ms) in [("500ms", 500), ("2s", 2000), ("1h", 3_600_000), ("3", 3000)] {
            assert_eq!(parse_duration(&toml::Value::String(text.into())), Ok(Duration::from_millis(ms)), "{text}");
        }
        assert_eq!(parse_duration(&toml::Value::Integer(4)), Ok(Duration::from_secs(4)));
    }

    #[test]
    fn set_overrides_any_key() {
        let job = load(MINIMAL, &["job.parallelism=3", "sink.options.path=out dir", "source.rows=5"]).unwrap();
        assert_eq!(job.spec.job.parallelism, 3);
        assert_eq!(job.sink_options(), vec![("path".to_string(), "out dir".to_string())]);
        assert!(matches!(job.spec.source, SourceSpec::Generator { rows: 5, .. }));
    }

    #[test]
    fn errors_name_the_key() {
        let err = load(MINIMAL, &["job.parallelism=\"two\""]).unwrap_err().to_string();
        assert!(err.contains("key `job.parallelism`"), "{err}");
        let err = load(MINIMAL, &["job.paralelism=2"]).unwrap_err().to_string();
        assert!(err.contains("paralelism"), "{err}");
        let err = load(MINIMAL, &["job.parallelism=0"]).unwrap_err().to_string();
        assert!(err.contains("key `job.parallelism`: must be between 1 and 1024"), "{err}");
        let err = load(MINIMAL, &["sink.plugin=missing.wasm"]).unwrap_err().to_string();
        assert!(err.contains("key `sink.plugin`: no plugin file at"), "{err}");
        let err = load(MINIMAL, &["source.kind=pulsar"]).unwrap_err().to_string();
        assert!(err.contains("source") && err.contains("pulsar"), "{err}");
        let err = load("[job\nid=1", &[]).unwrap_err().to_string();
        assert!(err.contains("not valid TOML"), "{err}");
        let err = load(MINIMAL, &["novalue"]).unwrap_err().to_string();
        assert!(err.contains("expected key=value"), "{err}");
        // Catalog latency is a test fault (feature `fault-injection`), not a job key.
        let err =
            load(MINIMAL, &["sink.catalog.warehouse=wh", "sink.catalog.commit_delay_ms=5"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `commit_delay_ms`"), "{err}");
    }

    /// Every duration and rate is bounded at load, naming the full key,
    /// and an error inside `[source]` names its key in it.
    #[test]
    fn out_of_range_values_name_the_full_key() {
        for (set, says) in [
            (
                "job.checkpoint.interval_secs=1e300",
                "key `job.checkpoint.interval_secs`: must be between 0.001 and 604800 seconds, got 1e300",
            ),
            ("job.checkpoint.interval_secs=1e-9", "key `job.checkpoint.interval_secs`: must be between"),
            ("job.checkpoint.interval_secs=nan", "key `job.checkpoint.interval_secs`: must be between"),
            ("sink.sandbox.call_timeout_secs=1e300", "key `sink.sandbox.call_timeout_secs`: must be between 0.01"),
            ("job.lease_secs=0.1", "key `job.lease_secs`: must be between 0.3 and 3600 seconds, got 0.1"),
            ("source.rate=1e-300", "key `source.rate`: must be between 0.001 and 1e12 rows per second, got 1e-300"),
            ("source.rate=-1", "key `source.rate`"),
            ("source.batch_rows=100000000", "key `source.batch_rows`: must be between 1 and 10000000"),
            ("job.commit.max_backoff_ms=3600001", "key `job.commit.max_backoff_ms`: must be at most 3600000"),
            ("source.rows=18446744073709551616", "key `source.rows`: invalid type: string"),
            ("source.first_id=\"x\"", "key `source.first_id`: invalid type: string"),
            ("source.evolve_at=-1", "key `source.evolve_at`"),
            ("source.kind=3", "key `source.kind`"),
            ("source.kind=pulsar", "key `source.kind`: unknown variant `pulsar`"),
            ("source.rowz=3", "key `source.rowz`: unknown field `rowz`"),
            ("job.health.max_commit_age=\"1e300s\"", "key `job.health.max_commit_age`"),
        ] {
            let err = load(MINIMAL, &[set]).unwrap_err().to_string();
            assert!(err.contains(says), "{set}: {err}");
        }
        let err = load(MINIMAL, &["source.rows=18446744073709551616"]).unwrap_err().to_string();
        assert!(err.contains("i64::MAX"), "{err}");
        let job = load(MINIMAL, &["job.checkpoint.interval_secs=0.001", "source.rate=0.001"]).unwrap();
        assert_eq!(job.checkpoint_trigger().1, Some(Duration::from_millis(1)));
        let err = load(MINIMAL, &["sink.maintenance.compact_every=\"1000000years\""]).unwrap_err().to_string();
        assert!(err.contains("key `sink.maintenance.compact_every`") && err.contains("100 years"), "{err}");
    }

    /// Generator ids are Int64: `first_id + rows - 1` up to `i64::MAX`.
    #[test]
    fn generator_ids_past_i64_max_are_refused() {
        let err = load(MINIMAL, &["source.first_id=9223372036854775800", "source.rows=100"]).unwrap_err().to_string();
        assert!(
            err.contains("key `source.rows`")
                && err.contains("source.first_id = 9223372036854775800 with source.rows = 100 gives ids past"),
            "{err}"
        );
        load(MINIMAL, &["source.first_id=9223372036854775707", "source.rows=100"]).expect("the last id is i64::MAX");
        load(MINIMAL, &["source.first_id=9223372036854775807", "source.rows=0"]).expect("no ids at all");
    }

    /// A dotted dead-letter table beside a sink `table` pattern must be in
    /// the pattern's form, which the sink lands as written.
    #[test]
    fn a_dotted_dead_letter_table_must_fit_the_sink_pattern() {
        let load_dl = |table: &str| {
            let sets = [
                "job.bad_rows=\"dead-letter\"".to_string(),
                format!("job.dead_letter.table=\"{table}\""),
                "source.tables=[\"a\", \"b\"]".to_string(),
                "sink.options.table=\"lake.{table}\"".to_string(),
            ];
            load(MINIMAL, &sets.iter().map(String::as_str).collect::<Vec<_>>())
        };
        assert_eq!(load_dl("lake.dead_letters").unwrap().dead_letters.unwrap().table, "lake.dead_letters");
        assert_eq!(load_dl("dead_letters").unwrap().dead_letters.unwrap().table, "dead_letters");
        let err = load_dl("other.dl").unwrap_err().to_string();
        assert!(
            err.contains("key `job.dead_letter.table`")
                && err.contains("would land it in \"lake.other.dl\"")
                && err.contains("name it \"lake.<name>\""),
            "{err}"
        );
        assert!(in_pattern_form("lake.{table}", "lake.x") && !in_pattern_form("lake.{table}", "lake."));
        // `lake.a` lands where the source's table `a` does: refused.
        let err = load_dl("lake.a").unwrap_err().to_string();
        assert!(err.contains("key `job.dead_letter.table`") && err.contains("table of the source"), "{err}");
    }

    /// The file source's `path` serves object stores: the URL is kept
    /// (normalized), never taken for a relative path, and an unknown scheme
    /// is refused naming the key.
    #[test]
    fn a_file_source_path_may_be_an_object_store() {
        let file = file_source;
        for (given, kept) in [("s3://lake/in/", "s3://lake/in"), ("GS://lake/a/b", "gs://lake/a/b")] {
            let job = load(&file(given), &[]).unwrap();
            let SourceSpec::File { path, .. } = &job.spec.source else { panic!("a file source") };
            assert_eq!(path, &PathBuf::from(kept));
        }
        let err = load(&file("s4://lake/in"), &[]).unwrap_err().to_string();
        assert!(err.contains("key `source.path`") && err.contains("s4:// is not a scheme Sluice knows"), "{err}");
        assert!(err.contains("served here: local paths and file:// URLs, s3://, gs://"), "{err}");
    }

    /// `[source.s3]` and `[source.gcs]` are read as `[sink.s3]` and
    /// `[sink.gcs]` are, into `source_stores` alone: the state directory and
    /// the sink keep the environment's.
    #[test]
    fn a_file_source_reaches_its_store_by_its_own_settings() {
        // Any variable set in the test's environment will do: only its name is in the job.
        let path_var = std::env::var("PATH").expect("PATH is set");
        let sets = [
            "source.s3.region=eu-west-1",
            "source.s3.endpoint=http://127.0.0.1:9000",
            "source.s3.virtual_host_style=true",
            "source.s3.access_key_id_env=PATH",
            "source.s3.secret_access_key_env=PATH",
            "source.gcs.endpoint=http://127.0.0.1:4443",
            "source.gcs.anonymous=true",
        ];
        let job = load(&file_source("s3://lake/in"), &sets).unwrap();
        let s3 = &job.source_stores.s3;
        assert_eq!(s3.region.as_deref(), Some("eu-west-1"));
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(s3.virtual_host_style);
        let keys = s3.credentials.as_ref().expect("static keys");
        assert_eq!((keys.access_key_id.as_str(), keys.secret_access_key.as_str()), (&*path_var, &*path_var));
        assert!(keys.session_token.is_none());
        let gcs = &job.source_stores.gcs;
        assert_eq!((gcs.endpoint.as_deref(), gcs.anonymous), (Some("http://127.0.0.1:4443"), true));
        for other in [&job.state_stores, &job.sink_stores] {
            assert!(other.s3.endpoint.is_none() && other.s3.region.is_none() && other.s3.credentials.is_none());
            assert!(!other.s3.virtual_host_style && !other.gcs.anonymous);
        }
        // Without the tables: the environment's, as for the sink and the state directory.
        let job = load(&file_source("s3://lake/in"), &[]).unwrap();
        assert!(job.source_stores.s3.endpoint.is_none() && job.source_stores.s3.credentials.is_none());
    }

    /// Every `[source.s3]`/`[source.gcs]` value that cannot work is refused
    /// naming its key, as the sink's are; a generator, which reads no store,
    /// takes no such table; a local file source takes it unused, as a local
    /// state directory takes `[job.s3]` and local grants `[sink.s3]`.
    #[test]
    fn source_store_settings_are_refused_naming_the_key() {
        let on_s3 = file_source("s3://lake/in");
        for (sets, key, says) in [
            (&["source.s3.endpoint=minio.lan:9000"][..], "source.s3.endpoint", "is not an http:// or https:// URL"),
            (&["source.s3.region=eu west"], "source.s3.region", "is not a region name"),
            (
                &["source.s3.access_key_id_env=PATH"],
                "source.s3",
                "access_key_id_env and secret_access_key_env go together",
            ),
            (&["source.s3.session_token_env=PATH"], "source.s3.session_token_env", "goes with access_key_id_env"),
            (
                &["source.s3.access_key_id_env=SLUICE_TEST_SURELY_UNSET", "source.s3.secret_access_key_env=PATH"],
                "source.s3.access_key_id_env",
                "names the environment variable SLUICE_TEST_SURELY_UNSET, which is not set",
            ),
            (&["source.gcs.endpoint=ftp://x"], "source.gcs.endpoint", "is not an http:// or https:// URL"),
            (&["source.gcs.anonymous=true"], "source.gcs.anonymous", "set an endpoint too"),
        ] {
            let err = load(&on_s3, sets).unwrap_err().to_string();
            assert!(err.contains(&format!("key `{key}`: ")) && err.contains(says), "{sets:?}: {err}");
        }
        // A secret is named by variable, never written inline.
        let err = load(&on_s3, &["source.s3.secret_access_key=oops"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `secret_access_key`"), "{err}");
        let err = load(MINIMAL, &["source.s3.region=eu-west-1"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `s3`"), "{err}");
        let job = load(&file_source("."), &["source.s3.region=eu-west-1"]).unwrap();
        assert_eq!(job.source_stores.s3.region.as_deref(), Some("eu-west-1"));
    }

    #[test]
    fn a_warehouse_may_be_on_s3_or_gcs_but_not_elsewhere() {
        let sql = "sink.catalog.database=c.db";
        let rest = ["sink.catalog.kind=rest", "sink.catalog.uri=http://127.0.0.1:9"];
        for (scheme, url) in [(Scheme::S3, "s3://lake/wh/"), (Scheme::Gs, "gs://lake/wh")] {
            let warehouse = format!("sink.catalog.warehouse={url}");
            let expected = Location::ObjectStore { scheme, bucket: "lake".into(), prefix: "wh".into() };
            let job = load(MINIMAL, &[sql, &warehouse]).unwrap();
            assert_eq!(job.catalog.as_ref().map(CatalogConfig::warehouse), Some(expected.clone()));
            let job = load(MINIMAL, &[rest[0], rest[1], &warehouse]).unwrap();
            assert_eq!(job.catalog.as_ref().map(CatalogConfig::warehouse), Some(expected));
        }
        let err = load(MINIMAL, &[sql, "sink.catalog.warehouse=abfss://c@a.dfs.core.windows.net/wh"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `sink.catalog.warehouse`") && err.contains("abfss://"), "{err}");
    }

    /// `[sink.maintenance] protect` loads the jobs it names with the job
    /// (their own `protect` lists are not followed, so two jobs may protect
    /// each other), and a job file that cannot be loaded is refused naming
    /// the key.
    #[test]
    fn maintenance_loads_the_jobs_it_protects() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.wasm"), b"x").unwrap();
        let job = |id: &str, protects: &str| {
            MINIMAL.replace("id = \"j1\"", &format!("id = \"{id}\""))
                + &format!("[sink.maintenance]\ncompact_every = \"1h\"\nprotect = [\"{protects}\"]\n")
        };
        std::fs::write(dir.path().join("a.toml"), job("a", "b.toml")).unwrap();
        std::fs::write(dir.path().join("b.toml"), job("b", "a.toml")).unwrap();
        let a = super::load(&dir.path().join("a.toml"), &[]).unwrap();
        let protected = &a.maintenance.as_ref().expect("maintenance").protect;
        assert_eq!(protected.iter().map(|j| j.spec.job.id.as_str()).collect::<Vec<_>>(), ["b"]);
        assert_eq!(protected[0].path, dir.path().join("b.toml"));
        assert!(protected[0].maintenance.as_ref().expect("b's maintenance").protect.is_empty());

        std::fs::write(dir.path().join("c.toml"), job("c", "missing.toml")).unwrap();
        let err = super::load(&dir.path().join("c.toml"), &[]).unwrap_err().to_string();
        assert!(err.contains("key `sink.maintenance.protect[0]`") && err.contains("missing.toml"), "{err}");
    }

    #[test]
    fn env_interpolation_with_default() {
        let job = load(MINIMAL, &["sink.options.path=${SLUICE_TEST_SURELY_UNSET:-fallback}/x"]).unwrap();
        assert_eq!(job.sink_options()[0].1, "fallback/x");
        let err = load(MINIMAL, &["sink.options.path=${SLUICE_TEST_SURELY_UNSET}"]).unwrap_err().to_string();
        assert!(err.contains("sink.options.path") && err.contains("SLUICE_TEST_SURELY_UNSET"), "{err}");
    }

    #[test]
    fn normalize_resolves_dots() {
        assert_eq!(normalize(Path::new("/a/b/../c/./d")), PathBuf::from("/a/c/d"));
        assert_eq!(normalize(Path::new("/a/../../etc")), PathBuf::from("/etc"));
    }
}
