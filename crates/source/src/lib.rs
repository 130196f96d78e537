//! Built-in sources. Each splits its work over the subtasks and can resume a
//! subtask from a persisted position.
//!
//! Invariants:
//! - the split depends only on the job (rows, files, parallelism), never on
//!   timing, so a restored subtask reads exactly what it read before;
//! - a position taken after a batch points just past that batch; resuming
//!   from it yields the remaining rows, each exactly once;
//! - every batch names its table (`""` for a single-table source) and holds
//!   rows of one schema; a table's schema may change between batches (the
//!   engine evolves the target at a barrier, see `engine::tables`);
//! - the tables a source knows at start, with the schemas of their first
//!   rows, are [`Source::tables`]; a source may meet more later;
//! - a checkpoint records the source's [`SourceIdentity`] (the generator's
//!   parameters, or each file a subtask consumed with its size and
//!   modification time, or an object's ETag), and a resume from a source that no longer matches
//!   it is refused by [`Source::check_identity`] before anything is read:
//!   resuming from positions into other rows would lose or repeat rows;
//! - every [`SourceError`] says its kind: a setting of the job is
//!   `Config` and names its key, a record's own fault is `InvalidData`,
//!   a broker or schema registry that may answer later is `Retryable`
//!   (read from the client's error code or the HTTP status, never from
//!   the text); the host retries no read itself, the kind tells the
//!   operator or a runner whether a rerun may succeed.

pub mod changes;
pub mod config;
pub mod file;
pub mod generator;
pub mod kafka;
mod object;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use thiserror::Error;

use serde::{Deserialize, Serialize};

pub use config::{FileFormat, SourceConfig, SourceSpec, TargetTables};
use sluice_store::StoreOptions;

/// Why a source cannot go on. Every variant says its [`ErrorKind`]
/// ([`Kind`]); a caller decides from that, never from the text.
///
/// [`ErrorKind`]: sluice_core::ErrorKind
/// [`Kind`]: sluice_core::error::Kind
#[derive(Debug, Error)]
pub enum SourceError {
    #[error("source file {path}: {message}")]
    File { path: String, message: String },
    #[error("source position {position} cannot be restored: {message}")]
    Position { position: String, message: String },
    /// The job sets up the source in a way it cannot run: `key` is the job
    /// file's key to change (`source.avro_schema`, `job.dead_letter.table`).
    #[error("source: key `{key}`: {message}")]
    Config { key: String, message: String },
    /// The Kafka client or the brokers failed; the kind follows the
    /// client's error code ([`kafka::kind_of`]).
    #[error("source: kafka: {context}: {source}")]
    Kafka {
        context: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// The brokers answer a topic's metadata with an error code.
    #[error("source: kafka: topic {topic:?}: the brokers answer {code:?} ({code})")]
    KafkaTopic { topic: String, code: rdkafka::types::RDKafkaErrorCode },
    /// A Schema Registry request failed; the kind follows its HTTP status.
    #[error("source: kafka: {context}: {source}")]
    Registry {
        context: String,
        #[source]
        source: kafka::RegistryError,
    },
    /// An Avro reader schema (the job's, or the registry's latest) that
    /// cannot be the table's: `from` says where it came from.
    #[error("source: kafka: {from}: {message}")]
    AvroSchema { from: String, message: String },
    /// Messages of `topic` that each read whole but together did not make
    /// the table's rows (no single message can be named).
    #[error("source: kafka: topic {topic:?}: {message}")]
    Rows { topic: String, message: String },
    /// A Kafka message that does not fit its table (no fault of the
    /// brokers or the registry): with dead letters, it becomes one.
    #[error("source: kafka: {position}: the message does not fit the table: {reason}")]
    Message { position: String, reason: String },
    /// A record that does not convert to its table's types, handed on as a
    /// [`BadRow`] where no dead letters are kept.
    #[error("source: {position}: {reason}")]
    BadRow { position: String, reason: String },
    /// A thread the source needs could not be started.
    #[error("source: cannot start {what}: {source}")]
    Thread {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A state Sluice itself got wrong (a poisoned lock, a source opened
    /// the wrong way): a bug, never the job's or the data's fault.
    #[error("source: internal error: {0}")]
    Internal(String),
}

impl sluice_core::error::Kind for SourceError {
    fn kind(&self) -> sluice_core::ErrorKind {
        use sluice_core::ErrorKind;
        match self {
            SourceError::Config { .. } | SourceError::AvroSchema { .. } => ErrorKind::Config,
            SourceError::Message { .. } | SourceError::BadRow { .. } | SourceError::Rows { .. } => {
                ErrorKind::InvalidData
            }
            SourceError::Kafka { source, .. } => kafka::kind_of(source),
            SourceError::KafkaTopic { code, .. } => kafka::kind_of_code(*code),
            SourceError::Registry { source, .. } => source.kind(),
            SourceError::File { .. }
            | SourceError::Position { .. }
            | SourceError::Thread { .. }
            | SourceError::Internal(_) => ErrorKind::Fatal,
        }
    }
}

/// What a checkpoint was taken from: the rows a resume relies on being the
/// same. Stored in the checkpoint record (`source`); records written before
/// it was kept have none and resume unchecked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceIdentity {
    /// The generator's parameters that decide which rows exist.
    Generator(generator::Params),
    /// Per subtask, the files it consumed (the last one possibly in part), in
    /// reading order; and a change stream's key (its split and its rows
    /// differ from an append stream's; none in records before change streams)
    /// with the scheme that hashed its keys to subtasks
    /// ([`changes::KEY_HASH_SCHEME`]; none in records before it was kept).
    File {
        subtasks: Vec<Vec<FileIdentity>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<Vec<String>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key_hash: Option<String>,
    },
    /// The topics, the message format and the partition rule.
    Kafka(kafka::KafkaIdentity),
}

/// A source file as it was when it was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIdentity {
    /// Relative to the source's path (`<table>/<file>` in a tree of tables).
    pub name: String,
    pub size: u64,
    /// Modification time, nanoseconds since the Unix epoch (0 for an object).
    pub mtime_ns: u64,
    /// An object's ETag as listed (none for a local file, and in records
    /// written before object-store sources).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
}

/// Why a resume from a checkpoint of another source is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct SourceChange(pub String);

/// Rows of one table.
#[derive(Debug, Clone)]
pub struct TableBatch {
    /// The table's name; `""` for a single-table source.
    pub table: String,
    /// The rows that converted (possibly none).
    pub batch: RecordBatch,
    /// Records of the same stretch of the source that did not convert to
    /// the table's types, in source order. Only a source asked to keep them
    /// ([`BadRows::DeadLetter`]) gives any; otherwise such a record is an
    /// error. A position after the batch is after these records too.
    pub bad: Vec<BadRow>,
    /// Where the rows are in the source (files only), so that a row a sink
    /// rejects can be named by its file and line.
    pub origin: Option<Origin>,
}

impl TableBatch {
    pub fn new(table: String, batch: RecordBatch) -> Self {
        Self { table, batch, bad: Vec::new(), origin: None }
    }
}

/// Where a batch's rows are in a file: a stretch of its records, some of
/// which (bad ones) are not rows of the batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The file, as positions and dead letters name it.
    pub file: String,
    /// The stretch's first record, counted from 0 over the file's records.
    pub first: u64,
    /// Offsets in the stretch of the records that are not rows, ascending.
    pub skipped: Vec<u64>,
    /// How a record is shown: a CSV record by its line (`record + n`, the
    /// header counted; a record spanning lines shifts the ones after it),
    /// others by their 1-based number.
    pub line_offset: Option<u64>,
}

impl Origin {
    /// The record (counted from 0 over the file's) of row `row` of the batch.
    pub fn record(&self, row: u64) -> u64 {
        let mut record = self.first + row;
        for s in &self.skipped {
            if self.first + s <= record {
                record += 1;
            }
        }
        record
    }

    /// Row `row` of the batch, as `orders.csv line 502`.
    pub fn describe(&self, row: u64) -> String {
        let record = self.record(row);
        match self.line_offset {
            Some(n) => format!("{} line {}", self.file, record + n),
            None => format!("{} record {}", self.file, record + 1),
        }
    }
}

/// Records a sink rejected as invalid data, by file and record (counted
/// from 0), with the sink's reason: read again, each is a dead letter.
pub type Rejected = std::sync::Arc<std::collections::BTreeMap<(String, u64), String>>;

/// What a source does with a record that does not convert to its table's
/// types (`job.bad_rows`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum BadRows {
    /// The read fails, naming the file, the line, the column and the value.
    #[default]
    Fail,
    /// The record is handed on as a [`BadRow`] beside the batch.
    DeadLetter,
}

/// A record that did not convert, as the source read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadRow {
    /// The record's text: a CSV record as one line, a JSON lines line.
    pub raw: String,
    /// Where it is: the file and its line.
    pub position: String,
    /// Why it did not convert (the column, the value, the type).
    pub reason: String,
}

/// What a read gave.
#[derive(Debug)]
pub enum Read {
    Batch(TableBatch),
    /// Nothing now (a streaming source waited a moment); more may come.
    Idle,
    /// This subtask's share is exhausted.
    End,
}

/// One subtask's reader.
pub trait SourceReader: Send {
    /// Up to `max_rows` rows of one table, or `None` when this subtask's
    /// share is exhausted. A streaming reader blocks until it has rows.
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<TableBatch>, SourceError>;
    /// Like `next_batch`, but a streaming reader that has nothing after a
    /// short wait answers [`Read::Idle`] instead of blocking.
    fn read(&mut self, max_rows: usize) -> Result<Read, SourceError> {
        Ok(match self.next_batch(max_rows)? {
            Some(batch) => Read::Batch(batch),
            None => Read::End,
        })
    }
    /// Where to resume after the rows returned so far.
    fn position(&self) -> serde_json::Value;
}

/// A configured source.
pub enum Source {
    Generator(generator::Generator),
    File(file::FileSource),
    Kafka(kafka::KafkaSource),
}

impl Source {
    /// The source `config` describes.
    pub fn of_config(config: &SourceConfig) -> Result<Self, SourceError> {
        Self::of_config_rejecting(config, &Rejected::default())
    }

    /// [`Source::of_config`], with the records a sink rejected read as dead
    /// letters (a file source with dead letters only).
    pub fn of_config_rejecting(wanted: &SourceConfig, rejected: &Rejected) -> Result<Self, SourceError> {
        match &wanted.kafka {
            Some(config) => {
                let of_table;
                let config = match config.decoding {
                    kafka::config::Decoding::JsonOfTable => {
                        of_table = kafka::with_table_columns(&wanted.target, config)?;
                        &of_table
                    }
                    _ => config,
                };
                let source = kafka::KafkaSource::open(config, wanted.parallelism)?;
                Ok(Source::Kafka(match &wanted.dead_letter_table {
                    Some(dl) if config.topics.matches(dl) => {
                        return Err(SourceError::Config {
                            key: "job.dead_letter.table".into(),
                            message: format!(
                                "kafka: topics {} include {:?}, the dead-letter table: give dead letters a table of \
                                 their own",
                                config.topics.describe(),
                                dl
                            ),
                        });
                    }
                    Some(_) => source.with_bad_rows(BadRows::DeadLetter),
                    None => source,
                }))
            }
            None => {
                let source = Self::open(&wanted.spec, wanted.parallelism, &wanted.stores)?;
                match (source, &wanted.dead_letter_table) {
                    (Source::File(f), Some(_)) => match f.format() {
                        FileFormat::Csv | FileFormat::Json => {
                            Ok(Source::File(f.with_bad_rows(BadRows::DeadLetter).with_rejected(rejected.clone())))
                        }
                        FileFormat::Parquet => Err(SourceError::Config {
                            key: "job.bad_rows".into(),
                            message: format!(
                                "{} holds Parquet files, whose values carry their types, so no record turns into a \
                                 dead letter: set job.bad_rows = \"fail\"",
                                f.describe()
                            ),
                        }),
                    },
                    (source, _) => Ok(source),
                }
            }
        }
    }

    /// The source `spec` describes; a file source on an object store is
    /// reached as `stores` says (the job's `source_stores`). A Kafka source
    /// opens from its resolved configuration ([`Source::of_config`]).
    pub fn open(spec: &SourceSpec, parallelism: u32, stores: &StoreOptions) -> Result<Self, SourceError> {
        match spec {
            SourceSpec::Generator { rows, first_id, rate, batch_rows, tables, evolve_at, new_table_at } => {
                let shape =
                    generator::Shape { tables: tables.clone(), evolve_at: *evolve_at, new_table_at: *new_table_at };
                Ok(Source::Generator(
                    generator::Generator::new(*rows, *rate, *batch_rows, parallelism)
                        .starting_at(*first_id)
                        .with_shape(shape),
                ))
            }
            SourceSpec::File { path, format, batch_rows, csv_header, rate, key, change_column, .. } => {
                let changes = match (key, change_column) {
                    (Some(key), column) => {
                        Some(changes::ChangeSpec { key: key.names().to_vec(), column: column.clone() })
                    }
                    (None, Some(column)) => {
                        return Err(SourceError::Config {
                            key: "source.change_column".into(),
                            message: format!(
                                "{column:?} needs a change key: set source.key (or the sink's `key` option)"
                            ),
                        });
                    }
                    (None, None) => None,
                };
                Ok(Source::File(
                    file::FileSource::open(path, *format, *batch_rows, *csv_header, parallelism, stores)?
                        .with_rate(*rate)
                        .with_changes(changes)?,
                ))
            }
            SourceSpec::Kafka(_) => Err(SourceError::Internal(
                "a Kafka source opens from its loaded job (Source::of_config), where its secrets are read".to_string(),
            )),
        }
    }

    /// The identity of what the subtasks have read, at `positions` (one per
    /// subtask, as their readers reported them). `None` when the positions
    /// predate identities (the file source's index positions).
    pub fn identity(&self, positions: &[&serde_json::Value]) -> Option<SourceIdentity> {
        match self {
            Source::Generator(g) => Some(SourceIdentity::Generator(g.params())),
            Source::File(f) => f.identity(positions),
            Source::Kafka(k) => Some(SourceIdentity::Kafka(k.identity())),
        }
    }

    /// Refuses to resume from a checkpoint whose source was `recorded` when
    /// this source no longer matches it. A record without an identity (from
    /// an earlier version) is not checked.
    pub fn check_identity(&self, recorded: Option<&SourceIdentity>) -> Result<(), SourceChange> {
        let read = |r: &SourceIdentity| match r {
            SourceIdentity::Generator(_) => "ran the generator",
            SourceIdentity::File { .. } => "read files",
            SourceIdentity::Kafka(_) => "read Kafka topics",
        };
        match (self, recorded) {
            (_, None) => Ok(()),
            (Source::Generator(g), Some(SourceIdentity::Generator(p))) => g.params().check(p),
            (Source::File(f), Some(SourceIdentity::File { subtasks, key, key_hash })) => {
                f.check_identity(subtasks, key.as_deref(), key_hash.as_deref())
            }
            (Source::Kafka(k), Some(SourceIdentity::Kafka(id))) => k.check_identity(id),
            (now, Some(then)) => Err(SourceChange(format!("it {}, and the job now {}", read(then), now.kind_phrase()))),
        }
    }

    /// What the source does, as a refusal names it.
    fn kind_phrase(&self) -> &'static str {
        match self {
            Source::Generator(_) => "runs the generator",
            Source::File(_) => "reads files",
            Source::Kafka(_) => "reads Kafka topics",
        }
    }

    /// The tables known at start, with the schemas of their first rows
    /// (a file source reads its first files for them).
    pub fn tables(&self) -> Result<Vec<(String, SchemaRef)>, SourceError> {
        match self {
            Source::Generator(g) => Ok(g.tables()),
            Source::File(f) => f.tables(),
            Source::Kafka(k) => k.tables(),
        }
    }

    /// The change key when the source is a change stream: its batches carry
    /// `sluice_core::changes`' columns after the table's own (see
    /// [`changes`]), and the sink is given the key (`sluice.key`).
    pub fn change_key(&self) -> Option<&[String]> {
        match self {
            Source::File(f) => f.change_key(),
            Source::Kafka(k) => k.change_key(),
            Source::Generator(_) => None,
        }
    }

    /// Whether the source names its tables (a single-table source has one
    /// table, `""`).
    pub fn is_multi_table(&self) -> bool {
        match self {
            Source::Generator(g) => !g.shape().tables.is_empty(),
            Source::File(f) => f.is_tree(),
            Source::Kafka(k) => k.is_multi_table(),
        }
    }

    /// Rows per batch the source prefers.
    pub fn batch_rows(&self) -> usize {
        match self {
            Source::Generator(g) => g.batch_rows(),
            Source::File(f) => f.batch_rows(),
            Source::Kafka(k) => k.batch_rows(),
        }
    }

    /// Total rows per second over all subtasks, when limited.
    pub fn rate(&self) -> Option<f64> {
        match self {
            Source::Generator(g) => g.rate(),
            Source::File(f) => f.rate(),
            Source::Kafka(_) => None,
        }
    }

    pub fn reader(
        &self,
        subtask: u32,
        position: Option<&serde_json::Value>,
    ) -> Result<Box<dyn SourceReader>, SourceError> {
        match self {
            Source::Generator(g) => Ok(Box::new(g.reader(subtask, position)?)),
            Source::File(f) => Ok(Box::new(f.reader(subtask, position)?)),
            Source::Kafka(k) => Ok(Box::new(k.reader(subtask, position)?)),
        }
    }

    /// One line for logs and `check`.
    pub fn describe(&self) -> String {
        match self {
            Source::Generator(g) => format!("generator of {} rows", g.rows()),
            Source::File(f) => f.describe(),
            Source::Kafka(k) => k.describe(),
        }
    }

    /// Whether the source is a stream (Kafka): reaching its end once does not
    /// finish the job; a later run reads what came since.
    pub fn streaming(&self) -> bool {
        matches!(self, Source::Kafka(_))
    }

    /// Whether the source runs until stopped.
    pub fn unbounded(&self) -> bool {
        matches!(self, Source::Kafka(k) if !k.config().bounded)
    }

    /// After the checkpoint at `positions` is committed (with every one
    /// before it): a Kafka source commits those offsets to its consumer
    /// group, for lag tooling.
    pub fn acknowledge(&self, positions: &[&serde_json::Value]) {
        if let Source::Kafka(k) = self {
            k.acknowledge(positions);
        }
    }

    /// Where the subtasks stand at `positions`, for a person (a Kafka
    /// source's offsets).
    pub fn describe_positions(&self, positions: &[&serde_json::Value]) -> Option<String> {
        match self {
            Source::Kafka(k) => Some(k.describe_positions(positions)),
            _ => None,
        }
    }

    /// A short status for the progress line (a Kafka source's lag).
    pub fn status(&self) -> Option<String> {
        match self {
            Source::Kafka(k) => k.status(),
            _ => None,
        }
    }

    /// A Kafka source's lag per partition as its readers in this process
    /// saw it last: `(topic, partition, high watermark - next offset)`.
    pub fn lag(&self) -> Vec<(String, i32, i64)> {
        match self {
            Source::Kafka(k) => k.lag().per_partition(),
            _ => Vec::new(),
        }
    }
}
