//! Parquet files encoded by the host (the `columnar` capability, contract
//! 0.2.1): a plugin hands whole Arrow batches across and gets the footer
//! back at `close`.
//!
//! Invariants:
//! - each `write` crosses the boundary once, as one Arrow IPC stream of the
//!   whole batch (never a call per row);
//! - a batch must have exactly the file's schema, field metadata included
//!   (Iceberg's `PARQUET:field_id`); the host refuses any other;
//! - the footer returned by [`ParquetFile::close`] is the file's own, so a
//!   plugin describes the file from what was written, not from a guess;
//! - [`ParquetFile::write_input`] (0.2.4) encodes rows of the batch the
//!   host holds for the `write` call in progress, which a plugin that
//!   called [`project_input`] for the table sees only part of; it is valid
//!   only inside that call.

use arrow_array::RecordBatch;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{Schema, SchemaRef};

pub use crate::bindings::sluice::connector::columnar::{
    ClosedFile, ColumnOptions, ColumnarError, Compression, InputRows, ParquetWriter, Statistics, WriterOptions,
    WriterStatus,
};

/// What a `write-input` refusal of rows that do not fit the file's schema
/// contains (the contract's words): the rows' fault, not the plugin's.
pub const UNFIT: &str = "the rows do not fit the writer's schema";

/// From the next `write` of `table` on, the writer receives only the named
/// columns of its batches (`None`: every column again), and the host keeps
/// the whole batch for the call as the input [`ParquetFile::write_input`]
/// encodes rows of (contract 0.2.4).
pub fn project_input(table: &str, columns: Option<&[String]>) {
    crate::bindings::sluice::connector::columnar::project_input(table, columns)
}
use crate::{SinkError, files};

/// Renders a `columnar-error` for a message.
pub fn describe(err: &ColumnarError) -> String {
    match err {
        ColumnarError::Io(e) => files::describe(e),
        ColumnarError::Invalid(m) => format!("cannot encode as Parquet: {m}"),
        ColumnarError::Limit(m) => m.clone(),
    }
}

/// Maps a `columnar-error` to a sink error: a denied location or a host
/// limit is a configuration problem, a batch that cannot be encoded is
/// invalid data, the rest is fatal.
pub fn to_sink_error(context: &str, err: ColumnarError) -> SinkError {
    match err {
        ColumnarError::Io(e) => files::to_sink_error(context, e),
        ColumnarError::Limit(m) => SinkError::Config(format!("{context}: {m}")),
        e @ ColumnarError::Invalid(_) => SinkError::InvalidData(format!("{context}: {}", describe(&e))),
    }
}

/// Writer options with the parquet crate's defaults for everything but
/// the compression.
pub fn options(compression: Compression, level: Option<i32>) -> WriterOptions {
    WriterOptions {
        compression,
        compression_level: level,
        dictionary: true,
        statistics: Statistics::Page,
        max_row_group_rows: None,
        max_row_group_bytes: None,
        data_page_size_bytes: None,
        data_page_row_limit: None,
        dictionary_page_size_bytes: None,
        write_batch_size: None,
        statistics_truncate_length: None,
        columns: Vec::new(),
        key_value_metadata: Vec::new(),
        created_by: None,
    }
}

/// One batch as a whole Arrow IPC stream (schema, batch, end marker).
pub fn encode(batch: &RecordBatch) -> Result<Vec<u8>, String> {
    let size = batch.get_array_memory_size() + 1024;
    let mut writer = StreamWriter::try_new(Vec::with_capacity(size), &batch.schema())
        .map_err(|e| format!("encoding a batch: {e}"))?;
    writer.write(batch).map_err(|e| format!("encoding a batch: {e}"))?;
    writer.finish().map_err(|e| format!("encoding a batch: {e}"))?;
    writer.into_inner().map_err(|e| format!("encoding a batch: {e}"))
}

fn encode_schema(schema: &Schema) -> Result<Vec<u8>, String> {
    let mut writer = StreamWriter::try_new(Vec::new(), schema).map_err(|e| format!("encoding a schema: {e}"))?;
    writer.finish().map_err(|e| format!("encoding a schema: {e}"))?;
    writer.into_inner().map_err(|e| format!("encoding a schema: {e}"))
}

/// A Parquet file the host is writing.
pub struct ParquetFile {
    writer: ParquetWriter,
    location: String,
    schema: SchemaRef,
    status: WriterStatus,
}

impl std::fmt::Debug for ParquetFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParquetFile").field("location", &self.location).finish_non_exhaustive()
    }
}

impl ParquetFile {
    /// Creates the file at `location` for rows of `schema`.
    pub fn create(
        location: &str,
        schema: SchemaRef,
        options: &WriterOptions,
        overwrite: bool,
    ) -> Result<Self, ColumnarError> {
        let ipc = encode_schema(&schema).map_err(ColumnarError::Invalid)?;
        let writer = ParquetWriter::create(location, &ipc, options, overwrite)?;
        let status = writer.status();
        Ok(Self { writer, location: location.to_string(), schema, status })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Encodes `batch`; where the writer stands after it.
    pub fn write(&mut self, batch: &RecordBatch) -> Result<&WriterStatus, ColumnarError> {
        if batch.num_rows() == 0 {
            return Ok(&self.status);
        }
        let ipc = encode(batch).map_err(ColumnarError::Invalid)?;
        self.status = self.writer.write(&ipc)?;
        Ok(&self.status)
    }

    /// Encodes the batches of `ipc`, an Arrow IPC stream of the file's
    /// schema as the engine hands it over (no decoding here): where the
    /// writer stands after them.
    pub fn write_ipc(&mut self, ipc: &[u8]) -> Result<&WriterStatus, ColumnarError> {
        self.status = self.writer.write(ipc)?;
        Ok(&self.status)
    }

    /// Encodes `rows` of the input batch of the `write` call in progress,
    /// conformed by the host to the file's schema (see [`project_input`]):
    /// where the writer stands after them.
    pub fn write_input(&mut self, rows: &InputRows) -> Result<&WriterStatus, ColumnarError> {
        self.status = self.writer.write_input(rows)?;
        Ok(&self.status)
    }

    /// Where the writer stood after the last call (no boundary crossing).
    pub fn last_status(&self) -> &WriterStatus {
        &self.status
    }

    /// Cuts the open row group now.
    pub fn flush(&mut self) -> Result<&WriterStatus, ColumnarError> {
        self.status = self.writer.flush()?;
        Ok(&self.status)
    }

    /// Completes the file: its size and footer.
    pub fn close(self) -> Result<ClosedFile, ColumnarError> {
        self.writer.close()
    }
}
