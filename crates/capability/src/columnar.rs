//! The `columnar` capability: Parquet files encoded by the host, natively,
//! with the `parquet` crate's `ArrowWriter`, for any plugin. The plugin
//! hands whole Arrow IPC batches across and gets back, at `close`, the
//! file's size and its footer, so it describes the file (Iceberg statistics,
//! manifests) itself: the host only encodes.
//!
//! Why it exists: Parquet's dictionary encoder, hash-table-heavy code, runs
//! about 1.6× slower under Cranelift than under LLVM and was 77 % of the
//! Iceberg plugin's own time in wasm, which held the plugin at 0.63–0.76×
//! native iceberg-rust. What crosses the boundary was measured before
//! choosing it (see `ParquetWriterHandle::write`).
//!
//! Invariants:
//! - a writer writes one file, created through `file-io`'s grant checks
//!   ([`FileGrants`]: the same locations, exclusive-create rules, object
//!   stores and durability as an `output-file`), and nothing else. The grant
//!   is judged at `create`; the file itself is created at its first bytes
//!   (the first row group written out, or `close`), as the SDK's deferred
//!   outputs do, so a writer holding many partitions' files open holds no
//!   file handle for those still in memory. From then on until `close` it
//!   counts as an open file against `sink.sandbox.max_open_files`;
//! - the host memory an open writer holds (the row group being encoded) is
//!   reserved from the instance's budget (`sink.sandbox.host_memory_mb`)
//!   before each batch is encoded, at the writer's memory now plus the
//!   batch's IPC size (the encoder grows by at most about the batch), and set to
//!   what the writer holds after it; a batch that does not fit is refused
//!   with `limit`, naming the setting, and the file is left unfinished;
//! - `close` completes the file; its sync runs off the plugin's thread
//!   ([`super::syncs`]) and is done before the call that closed it returns
//!   and before anything the call does can name it, which is the durability
//!   `output-file.finish` gives. It is a side effect for the fault-injection hook; a writer dropped
//!   without `close` leaves a partial file, never a complete-looking one
//!   (the footer is written only by `close`);
//! - every batch must have exactly the writer's schema (fields, types and
//!   metadata such as Iceberg's field ids); anything else is `invalid`;
//! - `write-input` (0.2.4) reads only the batch the host holds for the
//!   instance's `writer.write` call in progress ([`ColumnarInput`]), which
//!   the host made and checked itself; it is released when the call ends,
//!   however it ends, so no call can encode rows of another call's batch.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::sync::{Arc, Mutex};

use arrow_array::{RecordBatch, RecordBatchOptions, UInt32Array, new_null_array};
use arrow_schema::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{BrotliLevel, Compression as PqCompression, GzipLevel, ZstdLevel};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

use super::file_io::{FileGrants, FileIoCtx, OutputFileHandle, started};
use super::file_io_store::Failure;
use super::limits::{CallDeadline, HandleCap, HostMemory, Reservation};
use super::syncs::Syncs;
use super::{CapabilityHost, Effects};
use crate::bindings::v0_2::sluice::connector::columnar::{
    self as wit, ClosedFile, ColumnarError, Compression, Host, HostParquetWriter, InputRows, Statistics, WriterOptions,
    WriterStatus,
};
use crate::bindings::v0_2::sluice::connector::file_io::IoError;

/// The columns a plugin asked to receive of each table (`project-input`),
/// and the batch of the `writer.write` call in progress, which
/// `write-input` encodes rows of. One per instance.
#[derive(Debug, Default)]
pub struct ColumnarInput {
    projections: HashMap<String, HashSet<String>>,
    /// Table and column names held in `projections`, against
    /// [`MAX_PROJECTED_NAMES`].
    names: usize,
    current: Option<RecordBatch>,
    /// `current` conformed to a writer's schema, made at the call's first
    /// `write-input` and kept for the rest of the call (a refusal too), so
    /// a batch that does not fit is refused before any of its rows is
    /// encoded, and converted once however many files its rows go to.
    conformed: Option<(SchemaRef, Result<RecordBatch, String>)>,
}

/// The most table and column names `project-input` holds for one
/// instance: a bound on host memory a plugin could otherwise grow without
/// limit (the Iceberg plugin names a few per table).
const MAX_PROJECTED_NAMES: usize = 1 << 16;

/// How a `write-input` refusal of rows that cannot be conformed to the
/// writer's schema begins (the contract promises it, so a plugin can tell
/// the rows' fault from its own).
pub const UNFIT: &str = "the rows do not fit the writer's schema";

impl ColumnarInput {
    /// What crosses into the plugin for `batch` of `table`: `None` when the
    /// plugin takes every column (the whole batch crosses), or the batch's
    /// columns the plugin named, in the batch's order (possibly none: the
    /// batch keeps its row count).
    pub fn project(&self, table: &str, batch: &RecordBatch) -> Result<Option<RecordBatch>, arrow_schema::ArrowError> {
        let Some(columns) = self.projections.get(table) else { return Ok(None) };
        let schema = batch.schema();
        let indices: Vec<usize> =
            schema.fields().iter().enumerate().filter(|(_, f)| columns.contains(f.name())).map(|(i, _)| i).collect();
        batch.project(&indices).map(Some)
    }

    /// Whether the plugin asked for some of `table`'s columns only.
    pub fn projects(&self, table: &str) -> bool {
        self.projections.contains_key(table)
    }

    /// Records what `project-input` asked; more names than
    /// [`MAX_PROJECTED_NAMES`] in all is refused.
    fn set_projection(&mut self, table: String, columns: Option<Vec<String>>) -> Result<(), String> {
        if let Some(old) = self.projections.remove(&table) {
            self.names -= 1 + old.len();
        }
        let Some(columns) = columns else { return Ok(()) };
        let names = self.names + 1 + columns.len();
        if names > MAX_PROJECTED_NAMES {
            return Err(format!(
                "columnar.project-input: more than {MAX_PROJECTED_NAMES} table and column names in all"
            ));
        }
        self.names = names;
        self.projections.insert(table, columns.into_iter().collect());
        Ok(())
    }

    /// Holds `batch` as the input of the `write` call about to be made.
    pub fn hold(&mut self, batch: RecordBatch) {
        self.current = Some(batch);
        self.conformed = None;
    }

    /// Ends the call's input: called however the call ended.
    pub fn release(&mut self) {
        self.current = None;
        self.conformed = None;
    }

    /// The call's input in `schema` (see [`conform`]), made once per call
    /// and schema.
    fn conformed(&mut self, schema: &SchemaRef) -> Result<RecordBatch, String> {
        let Some(input) = &self.current else {
            return Err("write-input outside a `write` call: there is no input batch".into());
        };
        if let Some((made_for, made)) = &self.conformed
            && (Arc::ptr_eq(made_for, schema) || made_for == schema)
        {
            return made.clone();
        }
        let made = unpanicked(|| conform(input, schema)).and_then(|r| r);
        self.conformed = Some((schema.clone(), made.clone()));
        made
    }
}

/// About what `batch`'s rows hold in memory, as an IPC body of just them
/// would: `get_slice_memory_size`, except that a sliced list's or map's
/// values count only as far as its offsets reach (arrow counts the whole
/// child, which a slice of a large batch keeps whole).
fn rows_size(batch: &RecordBatch) -> u64 {
    fn size(data: &arrow_data::ArrayData) -> usize {
        use arrow_schema::DataType as D;
        let nulls = if data.nulls().is_some() { data.len().div_ceil(8) } else { 0 };
        let child = |start: usize, end: usize| {
            data.child_data().first().map_or(0, |c| size(&c.slice(start, end.saturating_sub(start))))
        };
        match data.data_type() {
            // `buffer` starts at the array's offset.
            D::List(_) | D::Map(_, _) => {
                let offsets = data.buffer::<i32>(0);
                let at = |i: usize| offsets.get(i).map_or(0, |o| (*o).max(0) as usize);
                nulls + (data.len() + 1) * 4 + child(at(0), at(data.len()))
            }
            D::LargeList(_) => {
                let offsets = data.buffer::<i64>(0);
                let at = |i: usize| offsets.get(i).map_or(0, |o| usize::try_from(*o).unwrap_or(0));
                nulls + (data.len() + 1) * 8 + child(at(0), at(data.len()))
            }
            D::FixedSizeList(_, n) => {
                let n = (*n).max(0) as usize;
                nulls + child(data.offset() * n, (data.offset() + data.len()) * n)
            }
            _ => data.get_slice_memory_size().unwrap_or_else(|_| data.get_buffer_memory_size()),
        }
    }
    batch.columns().iter().map(|c| size(&c.to_data()) as u64).sum()
}

/// `rows` of `input`: a slice for a range (no copy), else the rows taken.
fn select_rows(input: &RecordBatch, rows: InputRows) -> Result<RecordBatch, String> {
    let n = input.num_rows();
    match rows {
        InputRows::Range((first, count)) => {
            let (first, count) = (first as usize, count as usize);
            match first.checked_add(count) {
                Some(end) if end <= n => Ok(input.slice(first, count)),
                _ => Err(format!("rows {first} to {first} + {count} are past the input's {n} rows")),
            }
        }
        InputRows::Rows(indices) => {
            // Increasing, so no more rows than the input's: a list that
            // repeats rows could make the host copy without bound.
            if let Some(w) = indices.windows(2).find(|w| w[0] >= w[1]) {
                return Err(format!("rows must be named in increasing order, without repeats: {} then {}", w[0], w[1]));
            }
            if let Some(past) = indices.last().filter(|i| **i as usize >= n) {
                return Err(format!("row {past} is past the input's {n} rows"));
            }
            let indices = UInt32Array::from(indices);
            arrow_select::take::take_record_batch(input, &indices).map_err(|e| format!("selecting rows: {e}"))
        }
    }
}

/// `batch` in `schema`: its columns found by name, a missing one as nulls,
/// one of another type cast; a null in a non-nullable column is refused.
/// (The Iceberg plugin converts its own columns the same way, so rows read
/// the same whichever way they reached the writer.)
fn conform(batch: &RecordBatch, schema: &SchemaRef) -> Result<RecordBatch, String> {
    let mut columns = Vec::with_capacity(schema.fields().len());
    for field in schema.fields() {
        let column = match batch.column_by_name(field.name()) {
            None => new_null_array(field.data_type(), batch.num_rows()),
            Some(c) if c.data_type() == field.data_type() => c.clone(),
            Some(c) => arrow_cast::cast(c, field.data_type()).map_err(|e| {
                format!(
                    "column `{}`: cannot convert {} to the writer's {}: {e}",
                    field.name(),
                    c.data_type(),
                    field.data_type()
                )
            })?,
        };
        if !field.is_nullable() && column.null_count() > 0 {
            return Err(format!(
                "{UNFIT}: column `{}` is required but {} of the rows are null",
                field.name(),
                column.null_count()
            ));
        }
        columns.push(column);
    }
    let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
    RecordBatch::try_new_with_options(schema.clone(), columns, &options).map_err(|e| format!("{UNFIT}: {e}"))
}

/// An open `parquet-writer`, held in the instance's resource table.
pub struct ParquetWriterHandle {
    location: String,
    schema: SchemaRef,
    /// `None` once closed (or after a failure left the file unfinishable).
    writer: Option<ArrowWriter<Sink>>,
    memory: Arc<HostMemory>,
    /// What the writer holds now, against the instance's budget.
    held: Option<Reservation>,
    /// The output's failure, shared with the [`Sink`].
    failed: SharedFailure,
}

/// The output's failure, which `std::io::Error` would lose (the plugin's
/// `io-error`, or the call's deadline); shared, as the encoder owns the sink.
type SharedFailure = Arc<Mutex<Option<Failure>>>;

/// Where the encoder's bytes go: the file's `output-file` (local or an
/// object-store upload), created at the first bytes that reach it.
struct Sink {
    out: Option<OutputFileHandle>,
    opener: Opener,
    written: u64,
    /// Everything written from the moment this is set (the footer at `close`).
    capture: Option<Vec<u8>>,
    failed: SharedFailure,
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
        if failed.is_some() {
            return Err(std::io::Error::other("the output failed before"));
        }
        // A long flush or close stops at the call's deadline between writes.
        if let Err(d) = CallDeadline::check("sluice:connector/columnar.[method]parquet-writer") {
            let message = d.to_string();
            *failed = Some(Failure::Deadline(d));
            return Err(std::io::Error::other(message));
        }
        if let Some(capture) = &mut self.capture {
            capture.extend_from_slice(buf);
        }
        if self.out.is_none() {
            match self.opener.open() {
                Ok(out) => self.out = Some(out),
                Err(failure) => {
                    let message = failure_message(&failure);
                    *failed = Some(failure);
                    return Err(std::io::Error::other(message));
                }
            }
        }
        let Some(out) = self.out.as_mut() else { return Err(std::io::Error::other("the output is not open")) };
        match out.write_call(buf.to_vec()) {
            Ok(()) => {
                self.written += buf.len() as u64;
                Ok(buf.len())
            }
            Err(failure) => {
                let message = failure_message(&failure);
                *failed = Some(failure);
                Err(std::io::Error::other(message))
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Runs `f`, turning a panic into an error: arrow's IPC reader and the
/// encoder assert on some malformed input instead of answering, and a
/// plugin's bytes must never take the host down.
fn unpanicked<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "malformed input".to_string())
    })
}

/// About what a written-out row group's metadata holds until the footer:
/// an estimate: a fixed part per column chunk (300 bytes, above its Thrift size) and its
/// statistics' values, which a plugin can make large.
fn row_group_bytes(group: &parquet::file::metadata::RowGroupMetaData) -> usize {
    group
        .columns()
        .iter()
        .map(|c| {
            let stats = c
                .statistics()
                .map_or(0, |s| s.min_bytes_opt().map_or(0, <[u8]>::len) + s.max_bytes_opt().map_or(0, <[u8]>::len));
            300 + stats
        })
        .sum()
}

/// Refuses array types whose buffers rows share (dictionaries, views): a
/// small batch of them can expand to far more than its IPC size in the
/// encoder, which the budget reserves by. Plugins send plain arrays.
fn refuse_shared_buffers(schema: &arrow_schema::Schema) -> Result<(), String> {
    fn shared(t: &arrow_schema::DataType) -> bool {
        use arrow_schema::DataType as D;
        match t {
            D::Dictionary(_, _) | D::Utf8View | D::BinaryView | D::ListView(_) | D::LargeListView(_) => true,
            D::RunEndEncoded(_, _) => true,
            D::List(f) | D::LargeList(f) | D::FixedSizeList(f, _) | D::Map(f, _) => shared(f.data_type()),
            D::Struct(fields) => fields.iter().any(|f| shared(f.data_type())),
            D::Union(fields, _) => fields.iter().any(|(_, f)| shared(f.data_type())),
            _ => false,
        }
    }
    match schema.fields().iter().find(|f| shared(f.data_type())) {
        Some(f) => Err(format!(
            "column {:?} is {}: send plain arrays (no dictionary, view or run-end encoded ones)",
            f.name(),
            f.data_type()
        )),
        None => Ok(()),
    }
}

fn failure_message(failure: &Failure) -> String {
    match failure {
        Failure::Io(e) => super::file_io::describe_io(e),
        Failure::Deadline(d) => d.to_string(),
    }
}

/// Creates a writer's file when its first bytes come: the grants, the
/// open-file cap and the host-memory budget of the instance.
struct Opener {
    grants: Arc<FileGrants>,
    memory: Arc<HostMemory>,
    cap: HandleCap,
    location: String,
    overwrite: bool,
}

impl Opener {
    fn open(&self) -> Result<OutputFileHandle, Failure> {
        let slot = self
            .cap
            .take()
            .map_err(|too_many| Failure::Io(IoError::Other(format!("{}: {too_many}", self.location))))?;
        let mut out = self.grants.create_output_call(&self.location, self.overwrite, &self.memory)?;
        out.hold(slot);
        Ok(out)
    }
}

/// Why a call failed: the plugin's answer, or a trap (the deadline).
enum Fail {
    Answer(ColumnarError),
    Trap(wasmtime::Error),
}

impl From<ColumnarError> for Fail {
    fn from(e: ColumnarError) -> Self {
        Fail::Answer(e)
    }
}

impl From<Failure> for Fail {
    fn from(f: Failure) -> Self {
        match f {
            Failure::Io(e) => Fail::Answer(ColumnarError::Io(e)),
            Failure::Deadline(d) => Fail::Trap(wasmtime::Error::new(d)),
        }
    }
}

fn answer<T>(result: Result<T, Fail>) -> wasmtime::Result<Result<T, ColumnarError>> {
    match result {
        Ok(v) => Ok(Ok(v)),
        Err(Fail::Answer(e)) => Ok(Err(e)),
        Err(Fail::Trap(t)) => Err(t),
    }
}

fn invalid(location: &str, what: impl std::fmt::Display) -> ColumnarError {
    ColumnarError::Invalid(format!("{location}: {what}"))
}

fn compression(c: Compression, level: Option<i32>) -> Result<PqCompression, String> {
    Ok(match c {
        Compression::Uncompressed => PqCompression::UNCOMPRESSED,
        Compression::Snappy => PqCompression::SNAPPY,
        Compression::Lz4Raw => PqCompression::LZ4_RAW,
        Compression::Zstd => PqCompression::ZSTD(match level {
            Some(l) => ZstdLevel::try_new(l).map_err(|e| format!("zstd level {l}: {e}"))?,
            None => ZstdLevel::default(),
        }),
        Compression::Gzip => PqCompression::GZIP(match level {
            Some(l) => GzipLevel::try_new(u32::try_from(l).map_err(|_| format!("gzip level {l}"))?)
                .map_err(|e| format!("gzip level {l}: {e}"))?,
            None => GzipLevel::default(),
        }),
        Compression::Brotli => PqCompression::BROTLI(match level {
            Some(l) => BrotliLevel::try_new(u32::try_from(l).map_err(|_| format!("brotli level {l}"))?)
                .map_err(|e| format!("brotli level {l}: {e}"))?,
            None => BrotliLevel::default(),
        }),
    })
}

fn statistics(s: Statistics) -> EnabledStatistics {
    match s {
        Statistics::None => EnabledStatistics::None,
        Statistics::Chunk => EnabledStatistics::Chunk,
        Statistics::Page => EnabledStatistics::Page,
    }
}

fn usize_of(what: &str, v: u64) -> Result<usize, String> {
    match usize::try_from(v) {
        Ok(0) | Err(_) => Err(format!("{what} must be between 1 and {}, not {v}", usize::MAX)),
        Ok(v) => Ok(v),
    }
}

/// The parquet crate's writer properties for `options`.
pub fn writer_properties(options: &WriterOptions) -> Result<WriterProperties, String> {
    let mut b = WriterProperties::builder()
        .set_compression(compression(options.compression, options.compression_level)?)
        .set_dictionary_enabled(options.dictionary)
        .set_statistics_enabled(statistics(options.statistics));
    if let Some(rows) = options.max_row_group_rows {
        b = b.set_max_row_group_row_count(Some(usize_of("max-row-group-rows", rows)?));
    }
    if let Some(bytes) = options.max_row_group_bytes {
        b = b.set_max_row_group_bytes(Some(usize_of("max-row-group-bytes", bytes)?));
    }
    if let Some(v) = options.data_page_size_bytes {
        b = b.set_data_page_size_limit(usize_of("data-page-size-bytes", v)?);
    }
    if let Some(v) = options.data_page_row_limit {
        b = b.set_data_page_row_count_limit(usize_of("data-page-row-limit", v)?);
    }
    if let Some(v) = options.dictionary_page_size_bytes {
        b = b.set_dictionary_page_size_limit(usize_of("dictionary-page-size-bytes", v)?);
    }
    if let Some(v) = options.write_batch_size {
        b = b.set_write_batch_size(usize_of("write-batch-size", v)?);
    }
    if let Some(v) = options.statistics_truncate_length {
        b = b.set_statistics_truncate_length(Some(usize_of("statistics-truncate-length", v)?));
    }
    for column in &options.columns {
        if column.path.is_empty() {
            return Err("a column option names no column (an empty path)".into());
        }
        let path = ColumnPath::new(column.path.split('.').map(str::to_string).collect());
        if let Some(d) = column.dictionary {
            b = b.set_column_dictionary_enabled(path.clone(), d);
        }
        if let Some(c) = column.compression {
            b = b.set_column_compression(path.clone(), compression(c, options.compression_level)?);
        }
        if let Some(s) = column.statistics {
            b = b.set_column_statistics_enabled(path.clone(), statistics(s));
        }
        if let Some(f) = column.bloom_filter {
            b = b.set_column_bloom_filter_enabled(path, f);
        }
    }
    if !options.key_value_metadata.is_empty() {
        let kv = options.key_value_metadata.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())).collect();
        b = b.set_key_value_metadata(Some(kv));
    }
    if let Some(created_by) = &options.created_by {
        b = b.set_created_by(created_by.clone());
    }
    Ok(b.build())
}

impl ParquetWriterHandle {
    fn create(
        file_io: &FileIoCtx,
        location: &str,
        schema: &[u8],
        options: &WriterOptions,
        overwrite: bool,
    ) -> Result<Self, Fail> {
        let schema = unpanicked(|| crate::ipc::decode_schema(schema))
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| invalid(location, format_args!("the schema is no Arrow IPC schema: {e}")))?;
        refuse_shared_buffers(&schema).map_err(|e| invalid(location, e))?;
        let props = writer_properties(options).map_err(|e| invalid(location, e))?;
        // Check the schema before the file exists: nothing is left behind.
        parquet::arrow::ArrowSchemaConverter::new()
            .convert(&schema)
            .map_err(|e| invalid(location, format_args!("the schema cannot be written as Parquet: {e}")))?;
        file_io.grants.check_writable(location).map_err(ColumnarError::Io)?;
        let opener = Opener {
            grants: file_io.grants.clone(),
            memory: file_io.memory.clone(),
            cap: file_io.open.clone(),
            location: location.to_string(),
            overwrite,
        };
        let failed = SharedFailure::default();
        let sink = Sink { out: None, opener, written: 0, capture: None, failed: failed.clone() };
        let writer = ArrowWriter::try_new(sink, schema.clone(), Some(props))
            .map_err(|e| invalid(location, format_args!("starting the Parquet writer: {e}")))?;
        Ok(Self {
            location: location.to_string(),
            schema,
            writer: Some(writer),
            memory: file_io.memory.clone(),
            held: None,
            failed,
        })
    }

    fn writer(&mut self) -> Result<&mut ArrowWriter<Sink>, ColumnarError> {
        let location = &self.location;
        self.writer.as_mut().ok_or_else(|| invalid(location, "the writer is closed (or failed before)"))
    }

    /// A failure of the encoder: the output's own failure when it was that.
    fn failed(&mut self, doing: &str, e: parquet::errors::ParquetError) -> Fail {
        let output = self.failed.lock().unwrap_or_else(|p| p.into_inner()).take();
        // The file cannot be finished any more.
        self.writer = None;
        self.held = None;
        match output {
            Some(failure) => failure.into(),
            None => Fail::Answer(invalid(&self.location, format_args!("{doing}: {e}"))),
        }
    }

    fn status(&self) -> WriterStatus {
        match &self.writer {
            Some(w) => WriterStatus {
                open_rows: w.in_progress_rows() as u64,
                open_bytes: w.in_progress_size() as u64,
                memory_bytes: w.memory_size() as u64,
                row_groups: w.flushed_row_groups().len() as u32,
                rows: w.flushed_row_groups().iter().map(|g| g.num_rows() as u64).sum::<u64>()
                    + w.in_progress_rows() as u64,
                // As iceberg-rust's writer counts them (before the 8 KiB buffer in
                // front of the file), so rolling decides at the same bytes.
                written_bytes: w.bytes_written() as u64,
            },
            None => {
                WriterStatus { open_rows: 0, open_bytes: 0, memory_bytes: 0, row_groups: 0, rows: 0, written_bytes: 0 }
            }
        }
    }

    /// Holds what the writer holds now against the budget.
    /// Holds what the writer holds now against the budget: its open row
    /// group, and the metadata of the row groups it wrote out (kept for the
    /// footer). When that does not fit, the writer fails for good and lets
    /// go of it all.
    fn settle(&mut self) -> Result<(), Fail> {
        let now = self.writer.as_ref().map_or(0, |w| {
            let metadata: usize = w.flushed_row_groups().iter().map(row_group_bytes).sum();
            (w.memory_size() + metadata) as u64
        });
        self.held = None;
        match self.reserve(now) {
            Ok(r) => {
                self.held = Some(r);
                Ok(())
            }
            Err(e) => {
                self.writer = None;
                Err(e.into())
            }
        }
    }

    fn reserve(&self, bytes: u64) -> Result<Reservation, ColumnarError> {
        let what = format!("the Parquet writer of {}", self.location);
        self.memory.reserve(&what, bytes).map_err(|over| ColumnarError::Limit(over.to_string()))
    }

    /// Encodes the batches of `ipc`.
    ///
    /// What crosses is the Arrow IPC stream of each batch, not row indices
    /// into a batch the host still holds. Measured on this machine
    /// (`iceberg-bench --only boundary`: 2,000,000 generator rows in
    /// batches of 8,192, median of 5), one crossing (IPC encoding, the copy
    /// across and a validating decode) costs 31.8 ns a row natively against
    /// 354.4 ns for the Parquet encoding (zstd) the host then does: 9 %.
    /// The Iceberg plugin's rows cross twice (in, and out again per
    /// partition), half of it in wasm, and the plugin ran at 0.96× and
    /// 1.00× native iceberg-rust at 1 and 2 writers in the same run. Row
    /// indices could save the second crossing only, at the price of tying
    /// the host to the plugin's conversions, so IPC it was; later runs on a
    /// quieter machine put the plugin at 0.86-0.92× per CPU-second, and
    /// 0.2.4 added row indices as well ([`Self::write_input`]).
    fn write(&mut self, ipc: Vec<u8>) -> Result<WriterStatus, Fail> {
        let location = self.location.clone();
        let size = ipc.len() as u64;
        // Decoded in place: the batches' columns are slices of the bytes
        // the plugin handed over (validated as Arrow's readers validate).
        let batches = unpanicked(|| crate::ipc::decode_batches(ipc))
            .and_then(|r| r.map_err(|e| e.to_string()))
            .map_err(|e| invalid(&location, format_args!("the batches are no Arrow IPC stream: {e}")))?;
        for batch in batches {
            if batch.schema().fields() != self.schema.fields() {
                return Err(invalid(
                    &location,
                    format_args!(
                        "the batches' schema is not the writer's: {:?} against {:?}",
                        batch.schema().fields(),
                        self.schema.fields()
                    ),
                )
                .into());
            }
            self.encode(&batch, size, "sluice:connector/columnar.[method]parquet-writer.write")?;
        }
        self.settle()?;
        Ok(self.status())
    }

    /// Encodes one batch of the writer's schema, `size` its IPC size (or
    /// what it holds in memory).
    fn encode(&mut self, batch: &RecordBatch, size: u64, import: &'static str) -> Result<(), Fail> {
        // Room for what encoding this batch may add, before it is made:
        // at most about its IPC size (its arrays' own sizes would count
        // the whole IPC body once per column: they are slices of it).
        let now = self.writer()?.memory_size() as u64;
        let need = now.saturating_add(size);
        self.held = None;
        let reserved = self.reserve(need);
        let reserved = match reserved {
            Ok(r) => r,
            Err(e) => {
                // Earlier batches of this stream may be encoded already:
                // the writer fails for good (its file cannot be
                // finished), so no retry of the call can write them twice.
                self.writer = None;
                self.held = None;
                return Err(e.into());
            }
        };
        self.held = Some(reserved);
        CallDeadline::check(import).map_err(|d| Fail::Trap(wasmtime::Error::new(d)))?;
        let writer = self.writer()?;
        let result = unpanicked(|| writer.write(batch)).unwrap_or_else(|p| {
            Err(parquet::errors::ParquetError::General(format!("the encoder refused the batch: {p}")))
        });
        if let Err(e) = result {
            return Err(self.failed("encoding a batch", e));
        }
        Ok(())
    }

    /// Encodes `rows` of `input` (the batch of the `write` call in
    /// progress), conformed to the writer's schema.
    ///
    /// Added in 0.2.4, after the plugin's own overhead stood at 0.86-0.92x
    /// native iceberg-rust per CPU-second with every batch crossing twice
    /// (see `write`): its rows no longer come back out of the plugin, and
    /// the columns the plugin does not read need not go in (`project-input`).
    fn write_input(&mut self, input: &mut ColumnarInput, rows: InputRows) -> Result<WriterStatus, Fail> {
        let location = self.location.clone();
        let conformed = input.conformed(&self.schema).map_err(|e| invalid(&location, e))?;
        let batch = unpanicked(|| select_rows(&conformed, rows)).and_then(|r| r).map_err(|e| invalid(&location, e))?;
        if batch.num_rows() > 0 {
            self.writer()?;
            self.encode(&batch, rows_size(&batch), "sluice:connector/columnar.[method]parquet-writer.write-input")?;
        }
        self.settle()?;
        Ok(self.status())
    }

    fn flush(&mut self) -> Result<WriterStatus, Fail> {
        let result = self.writer()?.flush();
        if let Err(e) = result {
            return Err(self.failed("writing out a row group", e));
        }
        self.settle()?;
        Ok(self.status())
    }

    fn close(&mut self, syncs: &Syncs) -> Result<ClosedFile, Fail> {
        // Write the last row group out first, so what is captured from here
        // on is the page indexes and the footer only.
        let result = self.writer()?.flush();
        if let Err(e) = result {
            return Err(self.failed("writing out the last row group", e));
        }
        self.writer()?.inner_mut().capture = Some(Vec::new());
        let Some(writer) = self.writer.take() else {
            return Err(invalid(&self.location, "the writer is closed").into());
        };
        self.held = None;
        // `into_inner` writes the footer (once) and hands the sink back.
        let mut sink = match writer.into_inner() {
            Ok(sink) => sink,
            Err(e) => return Err(self.failed("writing the footer", e)),
        };
        let mut out = match sink.out.take() {
            Some(out) => out,
            // Every Parquet file has bytes (its magic and footer): never reached.
            None => sink.opener.open()?,
        };
        out.finish_deferred(syncs)?;
        let tail = sink.capture.take().unwrap_or_default();
        let footer = footer_of(&tail).ok_or_else(|| invalid(&self.location, "the written footer is malformed"))?;
        Ok(ClosedFile { size: sink.written, footer: footer.to_vec() })
    }
}

/// The Thrift `FileMetaData` at the end of `tail` (which ends with the
/// metadata's length, little-endian, and `PAR1`).
fn footer_of(tail: &[u8]) -> Option<&[u8]> {
    let end = tail.len().checked_sub(8)?;
    if &tail[end + 4..] != b"PAR1" {
        return None;
    }
    let len = u32::from_le_bytes(tail[end..end + 4].try_into().ok()?) as usize;
    tail.get(end.checked_sub(len)?..end)
}

/// What the `columnar` interface is linked through: the instance's file
/// access (grants, open-file cap, host memory), its resource table and its
/// side-effect hook.
pub struct ColumnarView<'a> {
    pub file_io: &'a FileIoCtx,
    pub table: &'a mut ResourceTable,
    pub effects: &'a mut Effects,
    pub input: &'a mut ColumnarInput,
}

/// The `columnar` capability for wasmtime's linker.
pub struct Columnar;

impl HasData for Columnar {
    type Data<'a> = ColumnarView<'a>;
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, Columnar>(linker, |t| {
        let (caps, table) = t.capabilities();
        ColumnarView { file_io: &caps.file_io, table, effects: &mut caps.effects, input: &mut caps.columnar }
    })
}

impl Host for ColumnarView<'_> {
    fn project_input(&mut self, table: String, columns: Option<Vec<String>>) -> wasmtime::Result<()> {
        self.input.set_projection(table, columns).map_err(wasmtime::Error::msg)
    }
}

impl HostParquetWriter for ColumnarView<'_> {
    fn create(
        &mut self,
        location: String,
        schema: Vec<u8>,
        options: WriterOptions,
        overwrite: bool,
    ) -> wasmtime::Result<Result<Resource<ParquetWriterHandle>, ColumnarError>> {
        started("sluice:connector/columnar.[static]parquet-writer.create")?;
        match answer(ParquetWriterHandle::create(self.file_io, &location, &schema, &options, overwrite))? {
            Ok(handle) => Ok(Ok(self.table.push(handle)?)),
            Err(e) => Ok(Err(e)),
        }
    }

    fn write(
        &mut self,
        this: Resource<ParquetWriterHandle>,
        batches: Vec<u8>,
    ) -> wasmtime::Result<Result<WriterStatus, ColumnarError>> {
        started("sluice:connector/columnar.[method]parquet-writer.write")?;
        answer(self.table.get_mut(&this)?.write(batches))
    }

    fn write_input(
        &mut self,
        this: Resource<ParquetWriterHandle>,
        rows: InputRows,
    ) -> wasmtime::Result<Result<WriterStatus, ColumnarError>> {
        started("sluice:connector/columnar.[method]parquet-writer.write-input")?;
        answer(self.table.get_mut(&this)?.write_input(self.input, rows))
    }

    fn status(&mut self, this: Resource<ParquetWriterHandle>) -> wasmtime::Result<WriterStatus> {
        Ok(self.table.get(&this)?.status())
    }

    fn flush(&mut self, this: Resource<ParquetWriterHandle>) -> wasmtime::Result<Result<WriterStatus, ColumnarError>> {
        started("sluice:connector/columnar.[method]parquet-writer.flush")?;
        answer(self.table.get_mut(&this)?.flush())
    }

    fn close(&mut self, this: Resource<ParquetWriterHandle>) -> wasmtime::Result<Result<ClosedFile, ColumnarError>> {
        started("sluice:connector/columnar.[method]parquet-writer.close")?;
        let result = answer(self.table.get_mut(&this)?.close(&self.file_io.syncs))?;
        if result.is_ok() {
            self.effects.done()?;
        }
        Ok(result)
    }

    fn drop(&mut self, this: Resource<ParquetWriterHandle>) -> wasmtime::Result<()> {
        self.table.delete(this)?;
        Ok(())
    }
}

impl From<IoError> for ColumnarError {
    fn from(e: IoError) -> Self {
        ColumnarError::Io(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use arrow_array::{ArrayRef, Int64Array, ListArray, StringArray};
    use arrow_schema::{DataType, Field, Schema};

    fn input() -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from((0..10).collect::<Vec<i64>>()));
        let names: ArrayRef = Arc::new(StringArray::from((0..10).map(|i| format!("n{i}")).collect::<Vec<_>>()));
        RecordBatch::try_from_iter([("id", ids), ("name", names)]).expect("batch")
    }

    fn writer_schema(name_nullable: bool) -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("name", DataType::LargeUtf8, name_nullable),
            Field::new("id", DataType::Int64, false),
            Field::new("extra", DataType::Int32, true),
        ]))
    }

    #[test]
    fn rows_are_named_in_increasing_order_within_the_input() {
        let batch = input();
        let taken = select_rows(&batch, InputRows::Rows(vec![1, 4, 9])).expect("taken");
        assert_eq!(taken.num_rows(), 3);
        let ids = taken.column(0).as_any().downcast_ref::<Int64Array>().expect("ids");
        assert_eq!(ids.values().to_vec(), vec![1, 4, 9]);
        let repeat = select_rows(&batch, InputRows::Rows(vec![0, 0, 0])).expect_err("repeats");
        assert!(repeat.contains("increasing"), "{repeat}");
        assert!(select_rows(&batch, InputRows::Rows(vec![3, 2])).is_err(), "decreasing");
        let past = select_rows(&batch, InputRows::Rows(vec![2, 10])).expect_err("past the end");
        assert!(past.contains("row 10 is past the input's 10 rows"), "{past}");
        assert_eq!(select_rows(&batch, InputRows::Range((7, 3))).expect("range").num_rows(), 3);
        assert!(select_rows(&batch, InputRows::Range((8, 3))).is_err(), "a range past the end");
        assert!(select_rows(&batch, InputRows::Range((u32::MAX, u32::MAX))).is_err(), "no overflow");
    }

    #[test]
    fn the_input_is_conformed_by_name_once_per_call_and_a_refusal_stays() {
        let mut held = ColumnarInput::default();
        let schema = writer_schema(true);
        assert!(held.conformed(&schema).expect_err("no call").contains("outside a `write` call"));
        held.hold(input());
        let conformed = held.conformed(&schema).expect("conformed");
        assert_eq!(conformed.schema(), schema, "the writer's schema, its order and types");
        assert_eq!(conformed.column(2).null_count(), 10, "a column the input lacks is nulls");
        // A non-nullable column the input lacks: refused, as the rows' fault.
        let strict = Arc::new(Schema::new(vec![Field::new("missing", DataType::Int64, false)]));
        let refused = held.conformed(&strict).expect_err("refused");
        assert!(refused.starts_with(UNFIT) && refused.contains("`missing`"), "{refused}");
        assert_eq!(held.conformed(&strict).expect_err("still refused"), refused);
        held.release();
        assert!(held.conformed(&schema).is_err(), "released with the call");
    }

    #[test]
    fn a_projection_keeps_the_row_count_and_is_bounded() {
        let mut held = ColumnarInput::default();
        held.set_projection("t".into(), Some(vec![])).expect("none of the columns");
        let none = held.project("t", &input()).expect("projected").expect("a projection");
        assert_eq!((none.num_columns(), none.num_rows()), (0, 10));
        held.set_projection("t".into(), Some(vec!["name".into(), "absent".into()])).expect("set");
        let one = held.project("t", &input()).expect("projected").expect("a projection");
        assert_eq!(one.schema().field(0).name(), "name");
        assert!(held.project("other", &input()).expect("whole").is_none(), "other tables cross whole");
        held.set_projection("t".into(), None).expect("reset");
        assert!(!held.projects("t"));
        let many: Vec<String> = (0..MAX_PROJECTED_NAMES).map(|i| i.to_string()).collect();
        assert!(held.set_projection("big".into(), Some(many)).is_err(), "bounded");
    }

    #[test]
    fn a_sliced_lists_size_counts_only_its_own_values() {
        let values: Vec<Option<Vec<Option<i64>>>> = (0..1000).map(|i| Some(vec![Some(i); 100])).collect();
        let list: ArrayRef = Arc::new(ListArray::from_iter_primitive::<arrow_array::types::Int64Type, _, _>(values));
        let batch = RecordBatch::try_from_iter([("l", list)]).expect("batch");
        let whole = rows_size(&batch);
        let tenth = rows_size(&batch.slice(100, 100));
        assert!(whole >= 1000 * 100 * 8, "{whole}");
        assert!(tenth * 8 < whole && tenth >= 100 * 100 * 8, "{tenth} of {whole}");
    }

    #[test]
    fn the_footer_is_found_at_the_end_of_the_tail() {
        let mut tail = b"indexes".to_vec();
        tail.extend_from_slice(b"META");
        tail.extend_from_slice(&4u32.to_le_bytes());
        tail.extend_from_slice(b"PAR1");
        assert_eq!(footer_of(&tail), Some(&b"META"[..]));
        assert_eq!(footer_of(b"PAR1"), None);
        let mut long = 99u32.to_le_bytes().to_vec();
        long.extend_from_slice(b"PAR1");
        assert_eq!(footer_of(&long), None, "a length past the start");
    }
}
