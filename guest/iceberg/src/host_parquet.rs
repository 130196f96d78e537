//! iceberg-rust's `FileWriter` over the host's `columnar` capability: the
//! rows are encoded as Parquet by the host, natively; this plugin still
//! names the file, picks the properties and describes the file for the
//! manifest from the footer the host returns.
//!
//! Invariants:
//! - it is a drop-in for iceberg's `ParquetWriter` under its rolling,
//!   data-file and fan-out writers: the same properties, the same lazily
//!   created file (none for a writer that got no rows), the same size
//!   accounting for rolling (bytes written plus the open row group's
//!   estimate), and the same data-file description:
//!   column sizes, value counts, null counts, lower and upper bounds (exact
//!   statistics only), NaN counts (every float column, zeros included) and
//!   split offsets, each summed over the row groups;
//! - that description is computed here because iceberg 0.10 keeps its own
//!   (`ParquetWriter::parquet_to_data_file_builder`, the NaN visitor and the
//!   statistics-to-datum conversions) crate-private; the code follows it
//!   rule for rule, and the interop tests compare manifests with PyIceberg;
//! - the host holds the row group being encoded; its memory is reported
//!   after every batch and kept in [`HostFiles`], so the writer keeps all of
//!   its open files within its share of `buffer_mb`, cutting row groups;
//! - a builder made [`HostParquetWriterBuilder::for_input`] is handed
//!   batches of the columns this plugin reads (see `writer.rs`) with an
//!   [`INPUT_ROW`] column last, each row's number in the host's input batch
//!   of the `write` call in progress, and has the host encode those rows of
//!   that batch (`write-input`): the rows never come back across.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arrow_array::{Array, ArrayRef, Float32Array, Float64Array, RecordBatch, StructArray, UInt32Array};
use arrow_schema::{DataType, Field, SchemaRef as ArrowSchemaRef};
use bytes::Bytes;
use iceberg::io::OutputFile;
use iceberg::spec::{DataContentType, DataFileBuilder, DataFileFormat, Datum, PrimitiveType, SchemaRef, Struct, Type};
use iceberg::writer::CurrentFileStatus;
use iceberg::writer::file_writer::{FileWriter, FileWriterBuilder};
use iceberg::{Error, ErrorKind, Result};
use parquet::arrow::PARQUET_FIELD_ID_META_KEY;
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader};
use parquet::file::statistics::Statistics;
use sluice_guest_sdk::columnar::{self, ParquetFile, WriterOptions};

/// A data file the host is writing, shared between its iceberg writer and
/// the [`HostFiles`] registry (which may cut its row group).
type SharedFile = Arc<Mutex<ParquetFile>>;

/// The files this writer has open, shared by its builders (one per table),
/// with the host memory each holds: so the writer can keep them all within
/// its buffer budget, cutting the largest row group first.
#[derive(Debug, Default)]
pub struct HostFiles {
    next: u64,
    open: Vec<(u64, SharedFile, u64)>,
}

impl HostFiles {
    /// Bytes the host holds for every open file together.
    pub fn held(&self) -> u64 {
        self.open.iter().map(|(_, _, b)| b).sum()
    }

    fn register(&mut self, file: SharedFile) -> u64 {
        self.next += 1;
        self.open.push((self.next, file, 0));
        self.next
    }

    fn set(&mut self, id: u64, bytes: u64) {
        if let Some(entry) = self.open.iter_mut().find(|(i, _, _)| *i == id) {
            entry.2 = bytes;
        }
    }

    fn remove(&mut self, id: u64) {
        self.open.retain(|(i, _, _)| *i != id);
    }

    /// Cuts row groups, largest first, until the host holds at most
    /// `budget` bytes for these files (or none is left to cut).
    pub fn keep_within(&mut self, budget: u64) -> std::result::Result<(), String> {
        while self.held() > budget {
            let Some(entry) = self.open.iter_mut().filter(|e| e.2 > 0).max_by_key(|e| e.2) else { return Ok(()) };
            let mut file = entry.1.lock().unwrap_or_else(|p| p.into_inner());
            let location = file.location().to_string();
            let status = file
                .flush()
                .map_err(|e| format!("writing out a row group of {location}: {}", columnar::describe(&e)))?;
            entry.2 = status.memory_bytes;
        }
        Ok(())
    }
}

/// [`HostFiles`] as the builders share them.
#[derive(Debug, Clone, Default)]
pub struct SharedHostFiles(Arc<Mutex<HostFiles>>);

impl SharedHostFiles {
    pub fn lock(&self) -> std::sync::MutexGuard<'_, HostFiles> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The column a batch for a [`HostParquetWriterBuilder::for_input`]
/// writer ends with: each row's number in the host's input batch.
pub const INPUT_ROW: &str = "_sluice_input_row";

/// Builds a [`HostParquetWriter`] per data file.
#[derive(Clone)]
pub struct HostParquetWriterBuilder {
    options: Arc<WriterOptions>,
    schema: SchemaRef,
    arrow: ArrowSchemaRef,
    files: SharedHostFiles,
    /// Rows are numbers of the host's input batch ([`INPUT_ROW`]).
    input: bool,
}

impl HostParquetWriterBuilder {
    pub fn new(options: WriterOptions, schema: SchemaRef, files: SharedHostFiles) -> Result<Self> {
        let arrow = Arc::new(iceberg::arrow::schema_to_arrow_schema(&schema)?);
        Ok(Self { options: Arc::new(options), schema, arrow, files, input: false })
    }

    /// Writers whose batches name rows of the host's input batch (they end
    /// with [`INPUT_ROW`]) instead of carrying them.
    pub fn for_input(mut self) -> Self {
        self.input = true;
        self
    }
}

/// Which rows of the host's input batch the [`INPUT_ROW`] column of
/// `batch` (its last) names: a range when they follow each other, as an
/// unsplit batch's do, so the host slices instead of copying.
fn input_rows(batch: &RecordBatch) -> Result<columnar::InputRows> {
    let rows = batch
        .columns()
        .last()
        .filter(|_| batch.schema().fields().last().is_some_and(|f| f.name() == INPUT_ROW))
        .and_then(|c| c.as_any().downcast_ref::<UInt32Array>())
        .ok_or_else(|| Error::new(ErrorKind::Unexpected, format!("a batch without its {INPUT_ROW} column")))?;
    let values = rows.values();
    let first = values.first().copied().unwrap_or(0);
    let contiguous =
        values.iter().enumerate().all(|(i, v)| u32::try_from(i).ok().and_then(|i| first.checked_add(i)) == Some(*v));
    let count = u32::try_from(values.len())
        .map_err(|_| Error::new(ErrorKind::DataInvalid, "more than 2^32 rows in a batch"))?;
    Ok(if contiguous { columnar::InputRows::Range((first, count)) } else { columnar::InputRows::Rows(values.to_vec()) })
}

impl FileWriterBuilder for HostParquetWriterBuilder {
    type R = HostParquetWriter;

    async fn build(&self, output_file: OutputFile) -> Result<Self::R> {
        Ok(HostParquetWriter {
            builder: self.clone(),
            location: output_file.location().to_string(),
            file: None,
            rows: 0,
            nan_counts: HashMap::new(),
        })
    }
}

/// One data file, encoded by the host.
pub struct HostParquetWriter {
    builder: HostParquetWriterBuilder,
    location: String,
    /// Created at the first rows, as iceberg's writer does; with its
    /// [`HostFiles`] id.
    file: Option<(SharedFile, u64)>,
    rows: usize,
    nan_counts: HashMap<i32, u64>,
}

fn host_error(what: &str, location: &str, e: &columnar::ColumnarError) -> Error {
    let kind = match e {
        columnar::ColumnarError::Invalid(_) => ErrorKind::DataInvalid,
        _ => ErrorKind::Unexpected,
    };
    Error::new(kind, format!("{what} {location}: {}", columnar::describe(e)))
}

impl FileWriter for HostParquetWriter {
    async fn write(&mut self, batch: &RecordBatch) -> Result<()> {
        if batch.num_rows() == 0 {
            return Ok(());
        }
        if self.file.is_none() {
            let file = ParquetFile::create(&self.location, self.builder.arrow.clone(), &self.builder.options, false)
                .map_err(|e| host_error("creating", &self.location, &e))?;
            let file = Arc::new(Mutex::new(file));
            let id = self.builder.files.lock().register(file.clone());
            self.file = Some((file, id));
        }
        let Some((file, id)) = self.file.as_ref() else {
            return Err(Error::new(ErrorKind::Unexpected, "the data file was not opened"));
        };
        let held = if self.builder.input {
            let rows = input_rows(batch)?;
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            file.write_input(&rows).map_err(|e| host_error("writing", &self.location, &e))?.memory_bytes
        } else {
            // iceberg's batches carry the table schema's field ids; the host
            // compares schemas exactly, so hand it the batch under its own.
            let batch = batch.clone().with_schema(self.builder.arrow.clone()).map_err(|e| {
                Error::new(
                    ErrorKind::DataInvalid,
                    format!("rows do not fit the table schema of {}: {e}", self.location),
                )
            })?;
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            file.write(&batch).map_err(|e| host_error("writing", &self.location, &e))?.memory_bytes
        };
        self.builder.files.lock().set(*id, held);
        // Counted once the host took the rows: a refused batch counts none.
        self.rows += batch.num_rows();
        count_nans(batch, &mut self.nan_counts);
        Ok(())
    }

    async fn close(self) -> Result<Vec<DataFileBuilder>> {
        let Some((file, id)) = self.file else { return Ok(vec![]) };
        self.builder.files.lock().remove(id);
        // Made for a batch the host refused: no bytes reached it, so there
        // is no file, and none may be described.
        if self.rows == 0 {
            return Ok(vec![]);
        }
        let file = Arc::try_unwrap(file)
            .map_err(|_| Error::new(ErrorKind::Unexpected, format!("{} is still in use", self.location)))?
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        let closed = file.close().map_err(|e| host_error("finishing", &self.location, &e))?;
        let metadata = ParquetMetaDataReader::decode_metadata(&Bytes::from(closed.footer)).map_err(|e| {
            Error::new(ErrorKind::Unexpected, format!("the footer the host returned for {}: {e}", self.location))
        })?;
        Ok(vec![data_file_builder(
            &self.builder.schema,
            &metadata,
            closed.size,
            self.location.clone(),
            self.nan_counts,
        )?])
    }
}

impl CurrentFileStatus for HostParquetWriter {
    fn current_file_path(&self) -> String {
        self.location.clone()
    }

    fn current_row_num(&self) -> usize {
        self.rows
    }

    fn current_written_size(&self) -> usize {
        match &self.file {
            Some((file, _)) => {
                let file = file.lock().unwrap_or_else(|p| p.into_inner());
                let s = file.last_status();
                (s.written_bytes + s.open_bytes) as usize
            }
            None => 0,
        }
    }
}

/// The field id an Arrow field carries (iceberg's `PARQUET:field_id`).
fn field_id(field: &Field) -> Option<i32> {
    field.metadata().get(PARQUET_FIELD_ID_META_KEY).and_then(|v| v.parse().ok())
}

/// NaN counts of every float column, nested ones included, zeros too: as
/// iceberg's `NanValueCountVisitor` counts them.
fn count_nans(batch: &RecordBatch, counts: &mut HashMap<i32, u64>) {
    for (field, column) in batch.schema().fields().iter().zip(batch.columns()) {
        count_field(field, column, counts);
    }
}

fn count_field(field: &Field, column: &ArrayRef, counts: &mut HashMap<i32, u64>) {
    let id = field_id(field);
    match column.data_type() {
        DataType::Float32 => {
            if let (Some(id), Some(a)) = (id, column.as_any().downcast_ref::<Float32Array>()) {
                *counts.entry(id).or_insert(0) += a.iter().filter(|v| v.is_some_and(f32::is_nan)).count() as u64;
            }
        }
        DataType::Float64 => {
            if let (Some(id), Some(a)) = (id, column.as_any().downcast_ref::<Float64Array>()) {
                *counts.entry(id).or_insert(0) += a.iter().filter(|v| v.is_some_and(f64::is_nan)).count() as u64;
            }
        }
        DataType::Struct(fields) => {
            if let Some(s) = column.as_any().downcast_ref::<StructArray>() {
                for (f, c) in fields.iter().zip(s.columns()) {
                    count_field(f, c, counts);
                }
            }
        }
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) => {
            let values = match column.data_type() {
                DataType::List(_) => column.as_any().downcast_ref::<arrow_array::ListArray>().map(|l| l.values()),
                DataType::LargeList(_) => {
                    column.as_any().downcast_ref::<arrow_array::LargeListArray>().map(|l| l.values())
                }
                _ => column.as_any().downcast_ref::<arrow_array::FixedSizeListArray>().map(|l| l.values()),
            };
            if let Some(values) = values {
                count_field(f, values, counts);
            }
        }
        DataType::Map(entries, _) => {
            if let (Some(m), DataType::Struct(kv)) =
                (column.as_any().downcast_ref::<arrow_array::MapArray>(), entries.data_type())
                && kv.len() == 2
            {
                count_field(&kv[0], m.keys(), counts);
                count_field(&kv[1], m.values(), counts);
            }
        }
        _ => {}
    }
}

/// The data file `metadata` describes, as iceberg's writer describes it.
pub fn data_file_builder(
    schema: &SchemaRef,
    metadata: &ParquetMetaData,
    size: u64,
    path: String,
    nan_value_counts: HashMap<i32, u64>,
) -> Result<DataFileBuilder> {
    let mut sizes: HashMap<i32, u64> = HashMap::new();
    let mut values: HashMap<i32, u64> = HashMap::new();
    let mut nulls: HashMap<i32, u64> = HashMap::new();
    let mut lower: HashMap<i32, Datum> = HashMap::new();
    let mut upper: HashMap<i32, Datum> = HashMap::new();
    for row_group in metadata.row_groups() {
        for chunk in row_group.columns() {
            let info = chunk.column_descr().self_type().get_basic_info();
            if !info.has_id() {
                continue;
            }
            let id = info.id();
            // Iceberg ignores a column its schema does not know.
            let Some(field) = schema.field_by_id(id) else { continue };
            *sizes.entry(id).or_insert(0) += chunk.compressed_size() as u64;
            *values.entry(id).or_insert(0) += chunk.num_values() as u64;
            let Some(stats) = chunk.statistics() else { continue };
            if let Some(n) = stats.null_count_opt() {
                *nulls.entry(id).or_insert(0) += n;
            }
            let Type::Primitive(ty) = field.field_type.as_ref() else {
                return Err(Error::new(
                    ErrorKind::Unexpected,
                    format!("Composed type {} is not supported for min max aggregation.", field.field_type),
                ));
            };
            if stats.min_is_exact() {
                let min = stat_datum(ty, stats, Bound::Min)?.ok_or_else(|| mismatch(ty, stats))?;
                match lower.get(&id) {
                    Some(old) if *old <= min => {}
                    _ => {
                        lower.insert(id, min);
                    }
                }
            }
            if stats.max_is_exact() {
                let max = stat_datum(ty, stats, Bound::Max)?.ok_or_else(|| mismatch(ty, stats))?;
                match upper.get(&id) {
                    Some(old) if *old >= max => {}
                    _ => {
                        upper.insert(id, max);
                    }
                }
            }
        }
    }
    let mut builder = DataFileBuilder::default();
    builder
        .content(DataContentType::Data)
        .file_path(path)
        .file_format(DataFileFormat::Parquet)
        .partition(Struct::empty())
        .record_count(metadata.file_metadata().num_rows() as u64)
        .file_size_in_bytes(size)
        .column_sizes(sizes)
        .value_counts(values)
        .null_value_counts(nulls)
        .nan_value_counts(nan_value_counts)
        .lower_bounds(lower)
        .upper_bounds(upper)
        .split_offsets(Some(metadata.row_groups().iter().filter_map(|g| g.file_offset()).collect()));
    Ok(builder)
}

fn mismatch(ty: &PrimitiveType, stats: &Statistics) -> Error {
    Error::new(ErrorKind::Unexpected, format!("Statistics {stats} is not match with field type {ty}."))
}

#[derive(Clone, Copy)]
enum Bound {
    Min,
    Max,
}

/// A chunk's minimum or maximum as a datum of `ty` (iceberg's
/// `get_parquet_stat_{min,max}_as_datum`, rule for rule).
fn stat_datum(ty: &PrimitiveType, stats: &Statistics, bound: Bound) -> Result<Option<Datum>> {
    macro_rules! pick {
        ($s:expr) => {
            match bound {
                Bound::Min => $s.min_opt(),
                Bound::Max => $s.max_opt(),
            }
        };
    }
    fn bytes(s: &Statistics, bound: Bound) -> Option<&[u8]> {
        match bound {
            Bound::Min => s.min_bytes_opt(),
            Bound::Max => s.max_bytes_opt(),
        }
    }
    Ok(match (ty, stats) {
        (PrimitiveType::Boolean, Statistics::Boolean(s)) => pick!(s).map(|v| Datum::bool(*v)),
        (PrimitiveType::Int, Statistics::Int32(s)) => pick!(s).map(|v| Datum::int(*v)),
        (PrimitiveType::Date, Statistics::Int32(s)) => pick!(s).map(|v| Datum::date(*v)),
        (PrimitiveType::Long, Statistics::Int64(s)) => pick!(s).map(|v| Datum::long(*v)),
        (PrimitiveType::Time, Statistics::Int64(s)) => match pick!(s) {
            Some(v) => Some(Datum::time_micros(*v)?),
            None => None,
        },
        (PrimitiveType::Timestamp, Statistics::Int64(s)) => pick!(s).map(|v| Datum::timestamp_micros(*v)),
        (PrimitiveType::Timestamptz, Statistics::Int64(s)) => pick!(s).map(|v| Datum::timestamptz_micros(*v)),
        (PrimitiveType::TimestampNs, Statistics::Int64(s)) => pick!(s).map(|v| Datum::timestamp_nanos(*v)),
        (PrimitiveType::TimestamptzNs, Statistics::Int64(s)) => pick!(s).map(|v| Datum::timestamptz_nanos(*v)),
        (PrimitiveType::Float, Statistics::Float(s)) => pick!(s).map(|v| Datum::float(*v)),
        (PrimitiveType::Double, Statistics::Double(s)) => pick!(s).map(|v| Datum::double(*v)),
        (PrimitiveType::String, Statistics::ByteArray(s)) => {
            match pick!(s) {
                Some(v) => Some(Datum::string(v.as_utf8().map_err(|e| {
                    Error::new(ErrorKind::DataInvalid, "a string statistic is not UTF-8").with_source(e)
                })?)),
                None => None,
            }
        }
        // A decimal's datum is built from its big-endian unscaled value:
        // `Datum::new` is crate-private, `try_from_bytes` sign-extends it.
        (PrimitiveType::Decimal { .. }, Statistics::ByteArray(_)) => match bytes(stats, bound) {
            Some(b) => {
                let _: [u8; 16] = b
                    .try_into()
                    .map_err(|_| Error::new(ErrorKind::DataInvalid, format!("Can't convert bytes to i128: {b:?}")))?;
                Some(Datum::try_from_bytes(b, ty.clone())?)
            }
            None => None,
        },
        (PrimitiveType::Decimal { .. }, Statistics::FixedLenByteArray(_)) => match bytes(stats, bound) {
            Some(b) if b.len() > 16 => {
                return Err(Error::new(ErrorKind::DataInvalid, format!("Can't convert bytes to i128: {b:?}")));
            }
            Some(b) => Some(Datum::try_from_bytes(b, ty.clone())?),
            None => None,
        },
        (PrimitiveType::Decimal { .. }, Statistics::Int32(s)) => match pick!(s) {
            Some(v) => Some(Datum::try_from_bytes(&i128::from(*v).to_be_bytes(), ty.clone())?),
            None => None,
        },
        (PrimitiveType::Decimal { .. }, Statistics::Int64(s)) => match pick!(s) {
            Some(v) => Some(Datum::try_from_bytes(&i128::from(*v).to_be_bytes(), ty.clone())?),
            None => None,
        },
        (PrimitiveType::Uuid, Statistics::FixedLenByteArray(_)) => match bytes(stats, bound) {
            Some(b) => {
                let b: [u8; 16] =
                    b.try_into().map_err(|_| Error::new(ErrorKind::Unexpected, "Invalid length of uuid bytes."))?;
                Some(Datum::uuid(uuid::Uuid::from_bytes(b)))
            }
            None => None,
        },
        (PrimitiveType::Fixed(len), Statistics::FixedLenByteArray(_)) => match bytes(stats, bound) {
            Some(b) if b.len() as u64 != *len => {
                return Err(Error::new(ErrorKind::Unexpected, "Invalid length of fixed bytes."));
            }
            Some(b) => Some(Datum::fixed(b.to_vec())),
            None => None,
        },
        (PrimitiveType::Binary, Statistics::ByteArray(_)) => bytes(stats, bound).map(|b| Datum::binary(b.to_vec())),
        _ => None,
    })
}
