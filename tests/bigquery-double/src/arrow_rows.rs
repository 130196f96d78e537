//! `arrow_rows`, checked the way the Storage Write API checks them.
//!
//! - `ArrowSchema.serialized_schema` is an IPC-serialized Arrow schema and
//!   `ArrowRecordBatch.serialized_record_batch` an IPC-serialized record
//!   batch ("Arrow schema as specified in
//!   https://arrow.apache.org/docs/python/api/datatypes.html and serialized
//!   to bytes using IPC", ArrowSchema); together they read as an IPC stream.
//! - "The `writer_schema` field must be specified at the initial request and
//!   currently, it will be ignored if specified in following requests"
//!   (AppendRowsRequest.rows).
//! - The API documents which Arrow types each column type takes ("Supported
//!   Apache Arrow data types"). Where that table is not precise, this double
//!   takes only the one type per column type that a careful client sends
//!   (see `sluice-bigquery-rows`'s `arrow_rows`), so a client it accepts is
//!   one the service accepts too.
//! - REQUIRED columns and `max_length` are checked per row, as for proto
//!   rows; a bad row rejects the whole request with `row_errors`.
//! - Arrow ingestion is marked "an experimental feature only selected for
//!   allowlisted customers" in the reference (ArrowData); the double serves
//!   it to every client.

use std::io::Cursor;

use arrow_array::cast::AsArray;
use arrow_array::types::{Date32Type, Decimal128Type, Decimal256Type, DecimalType, Float64Type, Int64Type};
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_ipc::reader::StreamReader;
use arrow_schema::{DataType, Field, SchemaRef, TimeUnit};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema, table_field_schema::Mode, table_field_schema::Type,
};

/// Reads an IPC-serialized schema.
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef, String> {
    StreamReader::try_new(Cursor::new(bytes), None)
        .map(|r| r.schema())
        .map_err(|e| format!("writer_schema.serialized_schema is not an IPC-serialized Arrow schema: {e}"))
}

/// Reads one IPC-serialized record batch of `schema_bytes`' schema.
pub fn decode_batch(schema_bytes: &[u8], batch_bytes: &[u8]) -> Result<RecordBatch, String> {
    let stream: Vec<u8> = [schema_bytes, batch_bytes].concat();
    let mut reader = StreamReader::try_new(Cursor::new(stream), None)
        .map_err(|e| format!("the Arrow writer schema cannot be read: {e}"))?;
    match reader.next() {
        Some(Ok(batch)) => Ok(batch),
        Some(Err(e)) => Err(format!("rows.serialized_record_batch is not an IPC-serialized record batch: {e}")),
        None => Err("rows.serialized_record_batch holds no record batch".into()),
    }
}

/// The Arrow type a column of `column` type takes.
fn accepted(column: Type) -> Option<DataType> {
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

/// Checks a writer schema against the table's columns.
pub fn check(schema: &SchemaRef, table: &TableSchema) -> Result<(), String> {
    check_fields(schema.fields(), &table.fields, "")
}

fn check_fields(fields: &arrow_schema::Fields, columns: &[TableFieldSchema], prefix: &str) -> Result<(), String> {
    for field in fields {
        let path = format!("{prefix}{}", field.name());
        let Some(column) = columns.iter().find(|c| c.name.eq_ignore_ascii_case(field.name())) else {
            return Err(format!("Input schema has more fields than BigQuery schema, extra fields: '{path}'"));
        };
        let repeated = column.mode == Mode::Repeated as i32;
        let value: &Field = match (field.data_type(), repeated) {
            (DataType::List(item), true) => item,
            (_, false) => field,
            (other, true) => return Err(format!("Field {path}: a REPEATED column takes an Arrow list, not {other}")),
        };
        let column_type = Type::try_from(column.r#type).unwrap_or(Type::Unspecified);
        if let DataType::Struct(children) = value.data_type() {
            if column_type != Type::Struct {
                return Err(format!("Field {path}: an Arrow struct cannot land in a {}", column_type.as_str_name()));
            }
            check_fields(children, &column.fields, &format!("{path}."))?;
            continue;
        }
        match accepted(column_type) {
            Some(expected) if &expected == value.data_type() => {}
            Some(expected) => {
                return Err(format!(
                    "Field {path}: Arrow type {} cannot land in a {} column (expected {expected})",
                    value.data_type(),
                    column_type.as_str_name()
                ));
            }
            None => return Err(format!("Field {path}: {} columns take no Arrow data", column_type.as_str_name())),
        }
    }
    for column in columns.iter().filter(|c| c.mode == Mode::Required as i32) {
        if !fields.iter().any(|f| f.name().eq_ignore_ascii_case(&column.name)) {
            return Err(format!("Field {prefix}{} is REQUIRED but the writer schema lacks it", column.name));
        }
    }
    Ok(())
}

/// The row errors of a batch: a null in a REQUIRED column, a value over
/// `max_length`. `(row index, message)`.
pub fn check_rows(batch: &RecordBatch, table: &TableSchema) -> Vec<(usize, String)> {
    let mut errors = Vec::new();
    for (field, col) in batch.schema().fields().iter().zip(batch.columns()) {
        let Some(column) = table.fields.iter().find(|c| c.name.eq_ignore_ascii_case(field.name())) else { continue };
        for row in 0..col.len() {
            if column.mode == Mode::Required as i32 && col.is_null(row) {
                errors.push((row, format!("Field {} is REQUIRED but the row has no value for it", column.name)));
            } else if column.max_length > 0
                && matches!(col.data_type(), DataType::Utf8)
                && !col.is_null(row)
                && col.as_string::<i32>().value(row).chars().count() as i64 > column.max_length
            {
                let len = col.as_string::<i32>().value(row).chars().count();
                errors.push((
                    row,
                    format!("Field {}: value of length {len} exceeds max_length {}", column.name, column.max_length),
                ));
            }
        }
    }
    errors.sort_by_key(|(row, _)| *row);
    errors
}

/// The rows of a batch as JSON, with the conventions of the proto rows'
/// reading (`schema::to_json`): DATE as days, TIMESTAMP as microseconds,
/// DATETIME as civil-time text, NUMERIC as decimal text, BYTES as hex.
pub fn to_json(batch: &RecordBatch) -> Vec<serde_json::Map<String, serde_json::Value>> {
    (0..batch.num_rows())
        .map(|row| {
            batch
                .schema()
                .fields()
                .iter()
                .zip(batch.columns())
                .filter(|(_, col)| !col.is_null(row))
                .map(|(f, col)| (f.name().clone(), value_json(col, row)))
                .collect()
        })
        .collect()
}

/// Decimal text without trailing fractional zeros, as BigQuery shows NUMERIC.
fn trimmed(text: String) -> String {
    if !text.contains('.') {
        return text;
    }
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn value_json(col: &ArrayRef, row: usize) -> serde_json::Value {
    use serde_json::Value as J;
    match col.data_type() {
        DataType::Int64 => J::from(col.as_primitive::<Int64Type>().value(row)),
        DataType::Float64 => J::from(col.as_primitive::<Float64Type>().value(row)),
        DataType::Boolean => J::Bool(col.as_boolean().value(row)),
        DataType::Utf8 => J::String(col.as_string::<i32>().value(row).to_string()),
        DataType::Binary => J::String(col.as_binary::<i32>().value(row).iter().map(|x| format!("{x:02x}")).collect()),
        DataType::Date32 => J::from(col.as_primitive::<Date32Type>().value(row)),
        DataType::Decimal128(p, s) => {
            J::String(trimmed(Decimal128Type::format_decimal(col.as_primitive::<Decimal128Type>().value(row), *p, *s)))
        }
        DataType::Decimal256(p, s) => {
            J::String(trimmed(Decimal256Type::format_decimal(col.as_primitive::<Decimal256Type>().value(row), *p, *s)))
        }
        DataType::Timestamp(_, Some(_)) => {
            J::from(col.as_primitive::<arrow_array::types::TimestampMicrosecondType>().value(row))
        }
        DataType::Timestamp(_, None) => {
            let micros = col.as_primitive::<arrow_array::types::TimestampMicrosecondType>().value(row);
            J::String(
                chrono::DateTime::from_timestamp_micros(micros)
                    .map(|t| t.naive_utc().format("%Y-%m-%d %H:%M:%S%.6f").to_string())
                    .unwrap_or_default(),
            )
        }
        DataType::Struct(_) => {
            let s = col.as_struct();
            J::Object(
                s.fields()
                    .iter()
                    .zip(s.columns())
                    .filter(|(_, c)| !c.is_null(row))
                    .map(|(f, c)| (f.name().clone(), value_json(c, row)))
                    .collect(),
            )
        }
        DataType::List(_) => {
            let list = col.as_list::<i32>();
            let values = list.value(row);
            J::Array((0..values.len()).filter(|i| !values.is_null(*i)).map(|i| value_json(&values, i)).collect())
        }
        _ => J::Null,
    }
}
