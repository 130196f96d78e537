//! Format-version-2 position-delete files: written for an upsert commit,
//! and read back (ours and other writers') for the key index.
//!
//! Invariants:
//! - a delete file has the spec's two required columns `file_path` (field
//!   id 2147483546) and `pos` (2147483545), rows sorted by path, then
//!   position; it holds deletes of one partition (the partition of the
//!   data files it points at, which it carries), and names its one data
//!   file in `referenced_data_file` when it points at one;
//! - rows are read back by field id through iceberg's Arrow reader, in file
//!   order, with no delete applied, so a row's position is its ordinal;
//! - [`read`] reads a format-version-3 deletion vector as well, as the
//!   rows it stands for.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use futures::TryStreamExt;
use iceberg::arrow::ArrowReaderBuilder;
use iceberg::io::FileIO;
use iceberg::scan::FileScanTask;
use iceberg::spec::{
    DataContentType, DataFile, DataFileFormat, NestedField, PartitionSpecRef, PrimitiveType, Schema, SchemaRef, Struct,
    Type,
};
use iceberg::table::Table;
use iceberg::writer::file_writer::{FileWriter, FileWriterBuilder};
use sluice_guest_sdk::{SinkError, error};

use crate::host_parquet::{HostParquetWriterBuilder, SharedHostFiles};
use crate::runtime::{block_on, iceberg_runtime};
use crate::writer::iceberg_error;

/// The spec's field id of a position delete's `file_path`.
pub(crate) const FILE_PATH_ID: i32 = 2147483546;
/// The spec's field id of a position delete's `pos`.
pub(crate) const POS_ID: i32 = 2147483545;

/// The schema of a position-delete file.
pub(crate) fn schema() -> Result<SchemaRef, SinkError> {
    Schema::builder()
        .with_fields(vec![
            NestedField::required(FILE_PATH_ID, "file_path", Type::Primitive(PrimitiveType::String)).into(),
            NestedField::required(POS_ID, "pos", Type::Primitive(PrimitiveType::Long)).into(),
        ])
        .build()
        .map(Arc::new)
        .map_err(|e| iceberg_error("building the position-delete schema", e))
}

/// The deletes of one partition: data file → positions.
pub(crate) struct Group {
    pub(crate) spec_id: i32,
    pub(crate) partition: Struct,
    pub(crate) positions: BTreeMap<String, Vec<u64>>,
}

/// Writes one position-delete file per group, named `<folder><n>-<uuid>.parquet`
/// (`folder` ends in `/`), and describes each as a delete file of its group's
/// partition; `options` are the Parquet settings.
pub(crate) fn write(
    table: &Table,
    folder: &str,
    groups: Vec<Group>,
    options: sluice_guest_sdk::columnar::WriterOptions,
) -> Result<Vec<(i32, DataFile)>, SinkError> {
    let schema = schema()?;
    let files = SharedHostFiles::default();
    let builder = HostParquetWriterBuilder::new(options, schema.clone(), files)
        .map_err(|e| iceberg_error("preparing the position-delete writer", e))?;
    let arrow = Arc::new(
        iceberg::arrow::schema_to_arrow_schema(&schema)
            .map_err(|e| iceberg_error("converting the position-delete schema", e))?,
    );
    let attempt = uuid::Uuid::new_v4().simple();
    let mut out = Vec::with_capacity(groups.len());
    for (n, mut group) in groups.into_iter().enumerate() {
        let mut paths = Vec::new();
        let mut positions = Vec::new();
        for (path, pos) in group.positions.iter_mut() {
            pos.sort_unstable();
            pos.dedup();
            for p in pos.iter() {
                paths.push(path.as_str());
                positions.push(i64::try_from(*p).map_err(|_| error::fatal(format!("row position {p} of {path}")))?);
            }
        }
        if positions.is_empty() {
            continue;
        }
        let location = format!("{folder}{n:05}-{attempt}.parquet");
        let columns: Vec<ArrayRef> = vec![Arc::new(StringArray::from(paths)), Arc::new(Int64Array::from(positions))];
        let batch = RecordBatch::try_new(arrow.clone(), columns)
            .map_err(|e| error::fatal(format!("building the position deletes of {location}: {e}")))?;
        let referenced = (group.positions.len() == 1).then(|| group.positions.keys().next().cloned()).flatten();
        let file = block_on(async {
            let output = table.file_io().new_output(&location)?;
            let mut writer = builder.build(output).await?;
            writer.write(&batch).await?;
            let mut built = writer.close().await?;
            let Some(mut b) = built.pop() else {
                return Err(iceberg::Error::new(iceberg::ErrorKind::Unexpected, "no file was written"));
            };
            b.content(DataContentType::PositionDeletes)
                .partition(group.partition.clone())
                .partition_spec_id(group.spec_id)
                .referenced_data_file(referenced);
            b.build().map_err(|e| iceberg::Error::new(iceberg::ErrorKind::DataInvalid, e.to_string()))
        })
        .map_err(|e| iceberg_error(&format!("writing position-delete file {location}"), e))?;
        out.push((group.spec_id, file));
    }
    Ok(out)
}

fn task(file: &DataFile, schema: SchemaRef, ids: Vec<i32>, spec: Option<PartitionSpecRef>) -> FileScanTask {
    FileScanTask::builder()
        .with_file_size_in_bytes(file.file_size_in_bytes())
        .with_start(0)
        .with_length(file.file_size_in_bytes())
        .with_record_count(Some(file.record_count()))
        .with_data_file_path(file.file_path().to_string())
        .with_data_file_format(DataFileFormat::Parquet)
        .with_schema(schema)
        .with_project_field_ids(ids)
        .with_partition(spec.as_ref().map(|_| file.partition().clone()))
        .with_partition_spec(spec)
        .with_case_sensitive(true)
        .build()
}

/// Reads the columns `ids` of `file` (of spec `spec`, in schema `schema`)
/// in file order, handing each batch to `each`.
pub(crate) fn read_columns(
    io: &FileIO,
    file: &DataFile,
    schema: SchemaRef,
    ids: Vec<i32>,
    spec: Option<PartitionSpecRef>,
    mut each: impl FnMut(RecordBatch) -> Result<(), SinkError>,
) -> Result<(), SinkError> {
    if file.file_format() != DataFileFormat::Parquet {
        return Err(error::fatal(format!(
            "{} is a {:?} file; mode upsert reads Parquet files only",
            file.file_path(),
            file.file_format()
        )));
    }
    let task = task(file, schema, ids, spec);
    let mut failure = None;
    block_on(async {
        let reader = ArrowReaderBuilder::new(io.clone(), iceberg_runtime()).with_data_file_concurrency_limit(1).build();
        let mut stream = reader.read(Box::pin(futures::stream::iter([Ok(task)])))?.stream();
        while let Some(batch) = stream.try_next().await? {
            if let Err(e) = each(batch) {
                failure = Some(e);
                break;
            }
        }
        Ok::<_, iceberg::Error>(())
    })
    .map_err(|e| iceberg_error(&format!("reading {}", file.file_path()), e))?;
    failure.map_or(Ok(()), Err)
}

/// The `(file_path, pos)` rows of position-delete file `file`: a Parquet
/// position-delete file, or a deletion vector (Puffin, format version 3;
/// [`crate::deletion_vectors`]).
pub(crate) fn read(io: &FileIO, file: &DataFile) -> Result<Vec<(String, u64)>, SinkError> {
    if crate::deletion_vectors::is_vector(file) {
        let (data_file, positions) = crate::deletion_vectors::read(io, file)?;
        return Ok(positions.into_iter().map(|p| (data_file.clone(), p)).collect());
    }
    let mut out = Vec::new();
    read_columns(io, file, schema()?, vec![FILE_PATH_ID, POS_ID], None, |batch| {
        let bad = || error::fatal(format!("position-delete file {} does not hold file_path and pos", file.file_path()));
        let paths = arrow_cast::cast(batch.column(0), &arrow_schema::DataType::Utf8).map_err(|_| bad())?;
        let paths = paths.as_string_opt::<i32>().ok_or_else(bad)?;
        let pos = batch.column(1).as_primitive_opt::<Int64Type>().ok_or_else(bad)?;
        for (p, n) in paths.iter().zip(pos.iter()) {
            let (Some(p), Some(n)) = (p, n) else { return Err(bad()) };
            out.push((p.to_string(), u64::try_from(n).map_err(|_| bad())?));
        }
        Ok(())
    })?;
    Ok(out)
}
