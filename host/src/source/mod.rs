//! Built-in sources. Each splits its work over the subtasks and can resume a
//! subtask from a persisted position.
//!
//! Invariants:
//! - the split depends only on the job (rows, files, parallelism), never on
//!   timing, so a restored subtask reads exactly what it read before;
//! - a position taken after a batch points just past that batch; resuming
//!   from it yields the remaining rows, each exactly once;
//! - rows are produced as Arrow record batches of a schema fixed at start.

pub mod file;
pub mod generator;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use thiserror::Error;

use crate::job::SourceSpec;

#[derive(Debug, Error)]
pub enum SourceError {
    #[error("source file {path}: {message}")]
    File { path: String, message: String },
    #[error("source position {position} cannot be restored: {message}")]
    Position { position: String, message: String },
    #[error("source: {0}")]
    Other(String),
}

/// One subtask's reader.
pub trait SourceReader: Send {
    /// Up to `max_rows` rows, or `None` when this subtask's share is exhausted.
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<RecordBatch>, SourceError>;
    /// Where to resume after the rows returned so far.
    fn position(&self) -> serde_json::Value;
}

/// A configured source.
pub enum Source {
    Generator(generator::Generator),
    File(file::FileSource),
}

impl Source {
    pub fn open(spec: &SourceSpec, parallelism: u32) -> Result<Self, SourceError> {
        match spec {
            SourceSpec::Generator { rows, first_id, rate, batch_rows } => Ok(Source::Generator(
                generator::Generator::new(*rows, *rate, *batch_rows, parallelism).starting_at(*first_id),
            )),
            SourceSpec::File { path, format, batch_rows, csv_header } => {
                Ok(Source::File(file::FileSource::open(path, *format, *batch_rows, *csv_header, parallelism)?))
            }
        }
    }

    pub fn schema(&self) -> SchemaRef {
        match self {
            Source::Generator(g) => g.schema(),
            Source::File(f) => f.schema(),
        }
    }

    /// Rows per batch the source prefers.
    pub fn batch_rows(&self) -> usize {
        match self {
            Source::Generator(g) => g.batch_rows(),
            Source::File(f) => f.batch_rows(),
        }
    }

    /// Total rows per second over all subtasks, when limited.
    pub fn rate(&self) -> Option<f64> {
        match self {
            Source::Generator(g) => g.rate(),
            Source::File(_) => None,
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
        }
    }

    /// One line for logs and `check`.
    pub fn describe(&self) -> String {
        match self {
            Source::Generator(g) => format!("generator of {} rows", g.rows()),
            Source::File(f) => f.describe(),
        }
    }
}
