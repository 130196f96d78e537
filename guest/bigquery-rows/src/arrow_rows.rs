//! Arrow record batches as the Storage Write API's `arrow_rows`: the rows
//! stay Arrow, cast to the Arrow type the API takes for each BigQuery
//! column, and cross as IPC messages (`ArrowSchema.serialized_schema`, one
//! `ArrowRecordBatch.serialized_record_batch` per request).
//!
//! The Arrow type of each BigQuery column type (the API's "Supported Apache
//! Arrow data types"; where a column type takes several, the widest):
//!
//! | BigQuery    | Arrow                       |
//! |-------------|-----------------------------|
//! | INT64       | Int64                       |
//! | FLOAT64     | Float64                     |
//! | NUMERIC     | Decimal128(38, 9)           |
//! | BIGNUMERIC  | Decimal256(76, 38)          |
//! | BOOL        | Boolean                     |
//! | STRING/JSON | Utf8                        |
//! | BYTES       | Binary                      |
//! | DATE        | Date32                      |
//! | DATETIME    | Timestamp(µs) without zone  |
//! | TIMESTAMP   | Timestamp(µs, "UTC")        |
//! | STRUCT      | Struct of the above         |
//! | REPEATED    | List of the above           |
//!
//! Columns are checked against the table exactly as for `ProtoRows`
//! ([`crate::RowEncoder`]), so both formats refuse the same sources.

use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_ipc::writer::{CompressionContext, DictionaryTracker, IpcDataGenerator, IpcWriteOptions, write_message};
use arrow_schema::{ArrowError, DataType, Field, Fields, Schema, SchemaRef, TimeUnit};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    ArrowSchema, TableFieldSchema, TableSchema,
    table_field_schema::{Mode, Type},
};

use crate::{EncodeError, RowEncoder, SchemaError};

/// The Arrow type the API takes for a column of `column` type.
fn canonical_type(column: Type) -> Option<DataType> {
    Some(match column {
        Type::Int64 => DataType::Int64,
        Type::Double => DataType::Float64,
        Type::Numeric => DataType::Decimal128(38, 9),
        Type::Bignumeric => DataType::Decimal256(76, 38),
        Type::Bool => DataType::Boolean,
        Type::String | Type::Json => DataType::Utf8,
        Type::Bytes => DataType::Binary,
        Type::Date => DataType::Date32,
        Type::Datetime => DataType::Timestamp(TimeUnit::Microsecond, None),
        Type::Timestamp => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        _ => return None,
    })
}

/// The field a source field becomes, given its table column.
fn canonical_field(field: &Field, column: &TableFieldSchema) -> Result<Field, SchemaError> {
    let column_type = Type::try_from(column.r#type).unwrap_or(Type::Unspecified);
    let value_type = |inner: &DataType| -> Result<DataType, SchemaError> {
        if let DataType::Struct(children) = inner {
            return Ok(DataType::Struct(canonical_fields(children, &column.fields)?));
        }
        canonical_type(column_type).ok_or_else(|| SchemaError::Unsupported {
            column: field.name().clone(),
            arrow: inner.to_string(),
            hint: format!("no Arrow form for BigQuery type {}", column_type.as_str_name()),
        })
    };
    let data_type = match field.data_type() {
        DataType::List(item) | DataType::LargeList(item) if column.mode == Mode::Repeated as i32 => {
            DataType::List(Arc::new(Field::new("item", value_type(item.data_type())?, true)))
        }
        other => value_type(other)?,
    };
    Ok(Field::new(field.name(), data_type, field.is_nullable()))
}

fn canonical_fields(fields: &Fields, columns: &[TableFieldSchema]) -> Result<Fields, SchemaError> {
    fields
        .iter()
        .map(|f| {
            let column = columns.iter().find(|c| c.name.eq_ignore_ascii_case(f.name())).ok_or_else(|| {
                SchemaError::NotInTable {
                    column: f.name().clone(),
                    columns: columns.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
                }
            })?;
            canonical_field(f, column)
        })
        .collect()
}

/// Encodes batches of one Arrow schema as `arrow_rows` for one table.
#[derive(Debug, Clone)]
pub struct ArrowEncoder {
    source: SchemaRef,
    target: SchemaRef,
    serialized_schema: Vec<u8>,
}

/// An Arrow encoding failure.
fn ipc_error(e: ArrowError) -> EncodeError {
    EncodeError::Arrow(e.to_string())
}

impl ArrowEncoder {
    /// Plans the encoding of `source` into `table`'s columns (or the columns
    /// `source` would create, without a table), with the same checks as
    /// [`RowEncoder::new`].
    pub fn new(source: SchemaRef, table: Option<&TableSchema>) -> Result<Self, SchemaError> {
        RowEncoder::new(source.clone(), table)?;
        let derived;
        let table = match table {
            Some(t) => t,
            None => {
                derived = RowEncoder::table_schema(&source)?;
                &derived
            }
        };
        let target = Arc::new(Schema::new(canonical_fields(source.fields(), &table.fields)?));
        let mut tracker = DictionaryTracker::new(false);
        let encoded = IpcDataGenerator::default().schema_to_bytes_with_dictionary_tracker(
            &target,
            &mut tracker,
            &IpcWriteOptions::default(),
        );
        let mut serialized_schema = Vec::new();
        write_message(&mut serialized_schema, encoded, &IpcWriteOptions::default()).map_err(|e| {
            SchemaError::Unsupported { column: "(schema)".into(), arrow: String::new(), hint: e.to_string() }
        })?;
        Ok(Self { source, target, serialized_schema })
    }

    /// The `writer_schema` of `arrow_rows`.
    pub fn writer_schema(&self) -> ArrowSchema {
        ArrowSchema { serialized_schema: self.serialized_schema.clone() }
    }

    /// The Arrow schema the rows are sent in.
    pub fn target_schema(&self) -> &SchemaRef {
        &self.target
    }

    /// Casts `batch` to the API's types and serializes it in pieces of at
    /// most `max_bytes` each: `(rows, serialized record batch)`, in order.
    pub fn encode(&self, batch: &RecordBatch, max_bytes: usize) -> Result<Vec<(usize, Vec<u8>)>, EncodeError> {
        if batch.num_columns() != self.source.fields().len() {
            return Err(EncodeError::Columns { found: batch.num_columns(), expected: self.source.fields().len() });
        }
        let columns: Vec<ArrayRef> = batch
            .columns()
            .iter()
            .zip(self.target.fields())
            .map(|(col, field)| arrow_cast::cast(col, field.data_type()).map_err(ipc_error))
            .collect::<Result<_, _>>()?;
        let cast = RecordBatch::try_new(self.target.clone(), columns).map_err(ipc_error)?;
        let mut out = Vec::new();
        self.split(&cast, max_bytes, &mut out)?;
        Ok(out)
    }

    /// Serializes `batch`, halving it until every piece fits `max_bytes`.
    fn split(&self, batch: &RecordBatch, max_bytes: usize, out: &mut Vec<(usize, Vec<u8>)>) -> Result<(), EncodeError> {
        let bytes = serialize(batch)?;
        if bytes.len() <= max_bytes || batch.num_rows() <= 1 {
            out.push((batch.num_rows(), bytes));
            return Ok(());
        }
        let half = batch.num_rows() / 2;
        self.split(&batch.slice(0, half), max_bytes, out)?;
        self.split(&batch.slice(half, batch.num_rows() - half), max_bytes, out)
    }
}

/// One record batch as an encapsulated IPC message (no schema, no end marker).
fn serialize(batch: &RecordBatch) -> Result<Vec<u8>, EncodeError> {
    let options = IpcWriteOptions::default();
    let mut tracker = DictionaryTracker::new(false);
    let (dictionaries, encoded) = IpcDataGenerator::default()
        .encode(batch, &mut tracker, &options, &mut CompressionContext::default())
        .map_err(ipc_error)?;
    if !dictionaries.is_empty() {
        return Err(EncodeError::Arrow("dictionary-encoded columns cannot be sent as arrow_rows".into()));
    }
    let mut out = Vec::with_capacity(encoded.arrow_data.len() + encoded.ipc_message.len() + 16);
    write_message(&mut out, encoded, &options).map_err(ipc_error)?;
    Ok(out)
}
