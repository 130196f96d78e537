//! `[source]` of the job file: which source, and its keys. The source owns
//! its configuration; the job loader deserializes it (naming the full key of
//! an error) and the generated job-file reference reads its doc comments.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use sluice_store::StoreOptions;
use sluice_store::spec::{GcsSpec, S3Spec};

use sluice_capability::config::CatalogConfig;

use super::kafka::config as kafka;

fn default_batch_rows() -> usize {
    8192
}

fn default_true() -> bool {
    true
}

/// Where rows come from: `[source]` with `kind = "generator"`, `"file"` or
/// `"kafka"`, and the keys of that kind.
// Deserialized as `{kind = {...}}` by [`source_spec`] (an internally
// tagged enum would lose the path of an error inside it); the schema
// (`reference.rs`) shows it as the job file writes it, tagged by `kind`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
#[schemars(tag = "kind")]
pub enum SourceSpec {
    /// Deterministic rows with ids `first_id..first_id + rows`, split into
    /// contiguous ranges per subtask.
    Generator {
        /// How many rows in all.
        rows: u64,
        /// The first id (so that several jobs can write disjoint ids).
        #[serde(default)]
        first_id: u64,
        /// Total rows per second over all subtasks, 0.001 to 10^12
        /// (unlimited when absent).
        rate: Option<f64>,
        /// Rows per batch a subtask hands the sink (at most 10,000,000).
        #[serde(default = "default_batch_rows")]
        batch_rows: usize,
        /// Table names: row `id` lands in table `id % n` (one unnamed table when empty).
        #[serde(default)]
        tables: Vec<String>,
        /// From this id on, rows have the evolved schema (`qty` widened to
        /// Int64, a nullable `tag` added): a schema change during the run.
        #[serde(default)]
        evolve_at: Option<u64>,
        /// The last table of `tables` appears at this id (before it, its
        /// share lands in the first table): a table the run meets late.
        #[serde(default)]
        new_table_at: Option<u64>,
    },
    /// JSON lines, CSV or Parquet files: one file, every such file in a
    /// directory (one table), or a tree with one folder per table
    /// (`<path>/<table>/*`). Files are read in name order; their schemas may
    /// evolve from file to file.
    File {
        /// A file, a directory, or a tree with one folder per table:
        /// local (relative to the job file), `s3://bucket/prefix` or
        /// `gs://bucket/prefix`.
        path: PathBuf,
        /// `csv`, `json` or `parquet`; taken from the file extension when absent.
        format: Option<FileFormat>,
        /// Rows per batch a subtask hands the sink (at most 10,000,000).
        #[serde(default = "default_batch_rows")]
        batch_rows: usize,
        /// Whether CSV files start with a header line.
        #[serde(default = "default_true")]
        csv_header: bool,
        /// Total rows per second over all subtasks, 0.001 to 10^12
        /// (unlimited when absent).
        rate: Option<f64>,
        /// How a `path` on S3 is reached.
        #[serde(default)]
        s3: S3Spec,
        /// How a `path` on Google Cloud Storage is reached.
        #[serde(default)]
        gcs: GcsSpec,
        /// The change key: a column name, or a list of them. With it the
        /// source is a change stream: each row is a change (an upsert, or a
        /// delete with `change_column`) of the target's row with the same
        /// key, applied in source order (files in name order, lines in
        /// order, at any parallelism). A row whose key column is missing or
        /// null is a bad row (`job.bad_rows`). When absent but
        /// `change_column` is set, the key is taken from `[sink.options]
        /// key` (a column name or a list of them).
        #[serde(default)]
        key: Option<Columns>,
        /// The column holding each row's operation: `insert`, `update`,
        /// `delete`, or Debezium's `c`, `r`, `u`, `d` (any case). It is
        /// consumed: it never lands in the target. Any other value, or a
        /// null, is a bad row (`job.bad_rows`). Needs a key (`key`, or
        /// `[sink.options] key`); without `change_column` every row of a
        /// keyed source is an upsert.
        #[serde(default)]
        change_column: Option<String>,
    },
    /// Kafka topics, each landing in the table of its name; unbounded
    /// unless `bounded`. Offsets are the checkpoint's: a consumer group,
    /// when named, only mirrors them.
    Kafka(Box<kafka::KafkaSpec>),
}

/// One column name or a list of them (`key = "id"`, `key = ["a", "b"]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns(pub Vec<String>);

impl Columns {
    pub fn names(&self) -> &[String] {
        &self.0
    }
}

impl<'de> Deserialize<'de> for Columns {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum OneOrMany {
            One(String),
            Many(Vec<String>),
        }
        match OneOrMany::deserialize(d) {
            Ok(OneOrMany::One(name)) => Ok(Columns(vec![name])),
            Ok(OneOrMany::Many(names)) => Ok(Columns(names)),
            Err(_) => Err(serde::de::Error::custom("expected a column name or a list of column names")),
        }
    }
}

impl schemars::JsonSchema for Columns {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Columns".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        // "x-type": how the job-file reference shows the type (`sluice_engine::config::schema::X_TYPE`).
        schemars::json_schema!({
            "type": ["string", "array"],
            "x-type": "a column name, or a list of column names",
        })
    }
}

impl SourceSpec {
    /// The change key when the source is a change stream (`[source] key`).
    pub fn change_key(&self) -> Option<&[String]> {
        match self {
            SourceSpec::File { key, .. } => key.as_ref().map(Columns::names),
            SourceSpec::Kafka(k) => k.key.as_ref().map(Columns::names),
            SourceSpec::Generator { .. } => None,
        }
    }
}

/// The format of a file source's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FileFormat {
    Csv,
    Json,
    Parquet,
}

impl FileFormat {
    /// The format a file extension names, if any.
    pub fn from_path(path: &Path) -> Option<Self> {
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "csv" => Some(Self::Csv),
            "json" | "jsonl" | "ndjson" => Some(Self::Json),
            "parquet" => Some(Self::Parquet),
            _ => None,
        }
    }
}

/// A source as a run opens it: `[source]` with what the job resolved for it.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    pub spec: SourceSpec,
    /// `job.parallelism`: the source is split into this many subtasks.
    pub parallelism: u32,
    /// How a file source's object store is reached (`[source.s3]`, `[source.gcs]`).
    pub stores: StoreOptions,
    /// A Kafka source, resolved (secrets read, schema decided).
    pub kafka: Option<kafka::KafkaConfig>,
    /// `job.dead_letter.table`, when bad rows become dead letters.
    pub dead_letter_table: Option<String>,
    /// Where a Kafka source without declared columns finds its tables.
    pub target: TargetTables,
}

/// The sink's tables, as a source that takes its columns from them reads
/// them (a Kafka source of JSON without `source.columns`).
#[derive(Debug, Clone, Default)]
pub struct TargetTables {
    /// `[sink.catalog]`, resolved.
    pub catalog: Option<CatalogConfig>,
    /// How the catalog's warehouse store is reached (`[sink.s3]`, `[sink.gcs]`).
    pub stores: StoreOptions,
    /// The sink's `table` option (`lake.{table}`), naming each topic's table.
    pub table_pattern: Option<String>,
}
