//! Arrow record batches to BigQuery Storage Write `ProtoRows`.
//!
//! [`RowEncoder::new`] maps each Arrow column to a BigQuery column type and
//! builds the proto2 `writer_schema` (a self-contained `DescriptorProto`,
//! nested types for STRUCT columns). [`RowEncoder::encode`] turns a batch
//! into serialized rows of that message.
//!
//! The mapping follows the Storage Write API's data type conversions
//! (https://cloud.google.com/bigquery/docs/write-api#data_type_conversions):
//!
//! | Arrow                                   | BigQuery    | proto field            |
//! |-----------------------------------------|-------------|------------------------|
//! | Int8/16/32/64, UInt8/16/32              | INT64       | int64                  |
//! | Float16/32/64                           | FLOAT64     | double                 |
//! | Decimal128 (scale ≤ 9, ≤ 29 int digits) | NUMERIC     | string ("-12.34")      |
//! | Decimal128, Decimal256                  | BIGNUMERIC  | string                 |
//! | Boolean                                 | BOOL        | bool                   |
//! | Utf8, LargeUtf8, Utf8View               | STRING/JSON | string                 |
//! | Binary, LargeBinary, FixedSizeBinary    | BYTES       | bytes                  |
//! | Date32, Date64                          | DATE        | int32 (days)           |
//! | Timestamp with a time zone              | TIMESTAMP   | int64 (µs since epoch) |
//! | Timestamp without a time zone           | DATETIME    | string (civil time)    |
//! | List/LargeList of one of the above      | REPEATED    | repeated field         |
//! | Struct                                  | STRUCT      | nested message         |
//!
//! Invariants:
//! - every mismatch or unsupported type is found by `new`, before any row is
//!   written, and named by its column path;
//! - a null value is an absent field; a null list is an empty REPEATED field
//!   (BigQuery stores no NULL arrays).

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::DecimalType;
use arrow_array::types::{
    Date32Type, Date64Type, Decimal64Type, Decimal128Type, Decimal256Type, Float16Type, Float32Type, Float64Type,
    Int8Type, Int16Type, Int32Type, Int64Type, TimestampMicrosecondType, TimestampMillisecondType,
    TimestampNanosecondType, TimestampSecondType, UInt8Type, UInt16Type, UInt32Type,
};
use arrow_array::{Array, ArrayRef, BinaryArray, BooleanArray, RecordBatch, StringArray};
use arrow_buffer::NullBuffer;
use arrow_schema::{DataType, Field, Fields, Schema, TimeUnit};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    ProtoSchema, TableFieldSchema, TableSchema,
    table_field_schema::{Mode, Type},
};
use prost::encoding::{WireType, encode_key, encode_varint};
use prost_types::field_descriptor_proto::{Label, Type as ProtoType};
use prost_types::{DescriptorProto, FieldDescriptorProto};
use thiserror::Error;

mod arrow_rows;
pub use arrow_rows::ArrowEncoder;
pub mod evolve;

/// Name of the writer schema's top-level message.
pub const ROW_MESSAGE: &str = "sluice_row";

#[derive(Debug, Error, PartialEq, Eq)]
pub enum SchemaError {
    #[error("column `{column}`: Arrow type {arrow} is not supported by the BigQuery sink ({hint})")]
    Unsupported { column: String, arrow: String, hint: String },
    #[error("column `{column}` is not in the BigQuery table (its columns: {columns})")]
    NotInTable { column: String, columns: String },
    #[error("column `{column}`: Arrow type {arrow} cannot land in the BigQuery column of type {bigquery}")]
    Mismatch { column: String, arrow: String, bigquery: String },
    #[error("column `{column}` may hold nulls, but the BigQuery table declares it REQUIRED")]
    NullableIntoRequired { column: String },
    #[error("column `{column}`: the table declares it {table_mode}, the rows give {source_mode}")]
    Mode { column: String, table_mode: String, source_mode: String },
    #[error("the BigQuery table has a REQUIRED column `{column}` the rows do not have")]
    MissingRequired { column: String },
}

/// Reads a table schema in BigQuery's JSON form, as `bq show --schema`
/// prints it: `[{"name": "id", "type": "INTEGER", "mode": "REQUIRED"},
/// {"name": "p", "type": "RECORD", "fields": [...]}]` (legacy and standard
/// type names both work; the mode defaults to NULLABLE).
pub fn parse_table_schema(json: &str) -> Result<TableSchema, String> {
    #[derive(serde::Deserialize)]
    struct JsonField {
        name: String,
        #[serde(rename = "type")]
        ty: String,
        #[serde(default)]
        mode: Option<String>,
        #[serde(default)]
        fields: Vec<JsonField>,
    }
    fn convert(f: JsonField) -> Result<TableFieldSchema, String> {
        let ty = match f.ty.to_ascii_uppercase().as_str() {
            "INTEGER" | "INT64" => Type::Int64,
            "FLOAT" | "FLOAT64" => Type::Double,
            "NUMERIC" => Type::Numeric,
            "BIGNUMERIC" => Type::Bignumeric,
            "BOOLEAN" | "BOOL" => Type::Bool,
            "STRING" => Type::String,
            "BYTES" => Type::Bytes,
            "DATE" => Type::Date,
            "DATETIME" => Type::Datetime,
            "TIME" => Type::Time,
            "TIMESTAMP" => Type::Timestamp,
            "RECORD" | "STRUCT" => Type::Struct,
            "JSON" => Type::Json,
            "GEOGRAPHY" => Type::Geography,
            other => return Err(format!("column `{}`: unknown type {other:?}", f.name)),
        };
        let mode = match f.mode.as_deref().map(str::to_ascii_uppercase).as_deref() {
            None | Some("NULLABLE") => Mode::Nullable,
            Some("REQUIRED") => Mode::Required,
            Some("REPEATED") => Mode::Repeated,
            Some(other) => return Err(format!("column `{}`: unknown mode {other:?}", f.name)),
        };
        Ok(TableFieldSchema {
            name: f.name,
            r#type: ty as i32,
            mode: mode as i32,
            fields: f.fields.into_iter().map(convert).collect::<Result<_, _>>()?,
            ..Default::default()
        })
    }
    let fields: Vec<JsonField> = serde_json::from_str(json).map_err(|e| format!("not a BigQuery JSON schema: {e}"))?;
    Ok(TableSchema { fields: fields.into_iter().map(convert).collect::<Result<_, _>>()? })
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EncodeError {
    #[error("encoding rows as Arrow: {0}")]
    Arrow(String),
    #[error("batch column {index} (`{name}`) has type {found}, but the writer was opened for {expected}")]
    Schema { index: usize, name: String, found: String, expected: String },
    #[error("batch has {found} columns, the writer was opened for {expected}")]
    Columns { found: usize, expected: usize },
}

/// How one column's values become a proto field.
#[derive(Debug, Clone)]
enum Conv {
    Int64,
    Double,
    Bool,
    String,
    Bytes,
    Date,
    /// TIMESTAMP: µs since the epoch, from this unit.
    Timestamp(TimeUnit),
    /// DATETIME: civil time as text, from this unit.
    Datetime(TimeUnit),
    /// NUMERIC / BIGNUMERIC text of this precision and scale.
    Decimal(u8, i8),
    Struct(Vec<Plan>),
}

#[derive(Debug, Clone)]
struct Plan {
    tag: u32,
    repeated: bool,
    conv: Conv,
}

/// Encodes batches of one Arrow schema as rows of one writer schema.
#[derive(Debug, Clone)]
pub struct RowEncoder {
    arrow: Arc<Schema>,
    plans: Vec<Plan>,
    descriptor: DescriptorProto,
}

fn bq_type_name(t: i32) -> String {
    Type::try_from(t).map(|t| t.as_str_name().to_string()).unwrap_or_else(|_| format!("type {t}"))
}

impl RowEncoder {
    /// Plans the encoding of `arrow`. With `table`, checks every column
    /// against the table's schema first.
    pub fn new(arrow: Arc<Schema>, table: Option<&TableSchema>) -> Result<Self, SchemaError> {
        let columns = table.map(|t| t.fields.as_slice());
        let (plans, descriptor) = plan_fields(arrow.fields(), columns, ROW_MESSAGE, "", &format!(".{ROW_MESSAGE}"))?;
        Ok(Self { arrow, plans, descriptor })
    }

    /// The `writer_schema` for AppendRows.
    pub fn writer_schema(&self) -> ProtoSchema {
        ProtoSchema { proto_descriptor: Some(self.descriptor.clone()) }
    }

    /// The BigQuery table schema these rows would create (for tests and tools).
    pub fn table_schema(arrow: &Schema) -> Result<TableSchema, SchemaError> {
        Ok(TableSchema { fields: arrow.fields().iter().map(|f| table_field(f, "")).collect::<Result<_, _>>()? })
    }

    /// Serializes every row of `batch`, appending to `out`.
    pub fn encode(&self, batch: &RecordBatch, out: &mut Vec<Vec<u8>>) -> Result<(), EncodeError> {
        if batch.num_columns() != self.arrow.fields().len() {
            return Err(EncodeError::Columns { found: batch.num_columns(), expected: self.arrow.fields().len() });
        }
        for (i, (col, field)) in batch.columns().iter().zip(self.arrow.fields()).enumerate() {
            if col.data_type() != field.data_type() {
                return Err(EncodeError::Schema {
                    index: i,
                    name: field.name().clone(),
                    found: col.data_type().to_string(),
                    expected: field.data_type().to_string(),
                });
            }
        }
        // Each column is downcast once here, not once per value.
        let readers: Vec<Reader<'_>> =
            batch.columns().iter().zip(&self.plans).map(|(col, plan)| Reader::new(plan, col)).collect();
        out.reserve(batch.num_rows());
        let mut scratch = Vec::new();
        for row in 0..batch.num_rows() {
            let mut buf = Vec::with_capacity(96);
            for (plan, reader) in self.plans.iter().zip(&readers) {
                reader.encode(plan, row, &mut buf, &mut scratch);
            }
            out.push(buf);
        }
        Ok(())
    }
}

/// A top-level column with its values downcast once per batch, so that
/// encoding a value is a slice read, not several dynamic calls (in a
/// plugin each is an indirect call: they were most of ProtoRows' cost).
/// Lists, structs and the rarer types take the general path, which gives
/// the same bytes.
enum Reader<'a> {
    Int64(Option<&'a NullBuffer>, &'a [i64]),
    Int32(Option<&'a NullBuffer>, &'a [i32]),
    Double(Option<&'a NullBuffer>, &'a [f64]),
    Bool(&'a BooleanArray),
    Utf8(&'a StringArray),
    Binary(&'a BinaryArray),
    Date32(Option<&'a NullBuffer>, &'a [i32]),
    Timestamp(Option<&'a NullBuffer>, &'a [i64], TimeUnit),
    Decimal128(Option<&'a NullBuffer>, &'a [i128], u8, i8),
    General(&'a ArrayRef),
}

impl<'a> Reader<'a> {
    fn new(plan: &Plan, col: &'a ArrayRef) -> Self {
        if plan.repeated {
            return Reader::General(col);
        }
        // Physical nulls are the logical ones for every type read here.
        let nulls = col.nulls();
        match (&plan.conv, col.data_type()) {
            (Conv::Int64, DataType::Int64) => Reader::Int64(nulls, col.as_primitive::<Int64Type>().values()),
            (Conv::Int64, DataType::Int32) => Reader::Int32(nulls, col.as_primitive::<Int32Type>().values()),
            (Conv::Double, DataType::Float64) => Reader::Double(nulls, col.as_primitive::<Float64Type>().values()),
            (Conv::Bool, DataType::Boolean) => Reader::Bool(col.as_boolean()),
            (Conv::String, DataType::Utf8) => Reader::Utf8(col.as_string::<i32>()),
            (Conv::Bytes, DataType::Binary) => Reader::Binary(col.as_binary::<i32>()),
            (Conv::Date, DataType::Date32) => Reader::Date32(nulls, col.as_primitive::<Date32Type>().values()),
            (Conv::Timestamp(unit), DataType::Timestamp(..)) => {
                let values = match unit {
                    TimeUnit::Second => col.as_primitive::<TimestampSecondType>().values(),
                    TimeUnit::Millisecond => col.as_primitive::<TimestampMillisecondType>().values(),
                    TimeUnit::Microsecond => col.as_primitive::<TimestampMicrosecondType>().values(),
                    TimeUnit::Nanosecond => col.as_primitive::<TimestampNanosecondType>().values(),
                };
                Reader::Timestamp(nulls, values, *unit)
            }
            (Conv::Decimal(p, s), DataType::Decimal128(..)) => {
                Reader::Decimal128(nulls, col.as_primitive::<Decimal128Type>().values(), *p, *s)
            }
            _ => Reader::General(col),
        }
    }

    fn encode(&self, plan: &Plan, row: usize, buf: &mut Vec<u8>, scratch: &mut Vec<u8>) {
        let null = |nulls: &Option<&NullBuffer>| nulls.is_some_and(|n| n.is_null(row));
        let tag = plan.tag;
        match self {
            Reader::Int64(nulls, v) if !null(nulls) => put_varint(tag, v[row] as u64, buf),
            Reader::Int32(nulls, v) if !null(nulls) => put_varint(tag, i64::from(v[row]) as u64, buf),
            Reader::Double(nulls, v) if !null(nulls) => {
                encode_key(tag, WireType::SixtyFourBit, buf);
                buf.extend_from_slice(&v[row].to_le_bytes());
            }
            Reader::Bool(a) if a.is_valid(row) => put_varint(tag, u64::from(a.value(row)), buf),
            Reader::Utf8(a) if a.is_valid(row) => put_len_delimited(tag, a.value(row).as_bytes(), buf),
            Reader::Binary(a) if a.is_valid(row) => put_len_delimited(tag, a.value(row), buf),
            // int32 fields carry negative values sign-extended to 64 bits.
            Reader::Date32(nulls, v) if !null(nulls) => put_varint(tag, i64::from(v[row]) as u64, buf),
            Reader::Timestamp(nulls, v, unit) if !null(nulls) => put_varint(tag, to_micros(*unit, v[row]) as u64, buf),
            Reader::Decimal128(nulls, v, p, s) if !null(nulls) => {
                put_len_delimited(tag, decimal128_text(v[row], *p, *s).as_bytes(), buf)
            }
            Reader::General(col) => encode_column(plan, col, row, buf, scratch),
            // A null: an absent field.
            _ => {}
        }
    }
}

fn unsupported(column: &str, dt: &DataType, hint: &str) -> SchemaError {
    SchemaError::Unsupported { column: column.to_string(), arrow: dt.to_string(), hint: hint.to_string() }
}

/// The BigQuery type an Arrow type maps to (see the module table).
fn natural_type(path: &str, dt: &DataType) -> Result<(Type, Conv), SchemaError> {
    Ok(match dt {
        DataType::Int8
        | DataType::Int16
        | DataType::Int32
        | DataType::Int64
        | DataType::UInt8
        | DataType::UInt16
        | DataType::UInt32 => (Type::Int64, Conv::Int64),
        DataType::UInt64 => {
            return Err(unsupported(path, dt, "INT64 cannot hold every UInt64; cast it to Int64 or Decimal"));
        }
        DataType::Float16 | DataType::Float32 | DataType::Float64 => (Type::Double, Conv::Double),
        DataType::Boolean => (Type::Bool, Conv::Bool),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => (Type::String, Conv::String),
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView | DataType::FixedSizeBinary(_) => {
            (Type::Bytes, Conv::Bytes)
        }
        DataType::Date32 | DataType::Date64 => (Type::Date, Conv::Date),
        DataType::Timestamp(unit, Some(_)) => (Type::Timestamp, Conv::Timestamp(*unit)),
        DataType::Timestamp(unit, None) => (Type::Datetime, Conv::Datetime(*unit)),
        DataType::Decimal128(p, s) => {
            if *s < 0 {
                return Err(unsupported(path, dt, "negative scales have no BigQuery type"));
            }
            let numeric = *s <= 9 && (i16::from(*p) - i16::from(*s)) <= 29;
            (if numeric { Type::Numeric } else { Type::Bignumeric }, Conv::Decimal(*p, *s))
        }
        DataType::Decimal256(p, s) => {
            if *s < 0 || *s > 38 || *p > 76 {
                return Err(unsupported(path, dt, "BIGNUMERIC holds at most 38 fractional digits"));
            }
            (Type::Bignumeric, Conv::Decimal(*p, *s))
        }
        DataType::Struct(_) => (Type::Struct, Conv::Struct(Vec::new())),
        other => {
            return Err(unsupported(
                path,
                other,
                "supported: integers, floats, decimals, bool, strings, binary, dates, timestamps, lists and structs",
            ));
        }
    })
}

/// Whether a value of the Arrow type may land in a column of `column`'s type.
fn compatible(natural: Type, column: Type, dt: &DataType) -> bool {
    natural == column
        || matches!((natural, column), (Type::String, Type::Json))
        || matches!((natural, column, dt), (Type::Numeric, Type::Bignumeric, _))
        || matches!((natural, column, dt), (Type::Bignumeric, Type::Numeric, DataType::Decimal128(_, s)) if *s <= 9)
}

fn element(field: &Field) -> (bool, &Field) {
    match field.data_type() {
        DataType::List(inner) | DataType::LargeList(inner) => (true, inner.as_ref()),
        _ => (false, field),
    }
}

/// The plans and the writer-schema message for `fields`, checked against the
/// table's `columns` when they are known. Fields are checked in order, each
/// before its children; the table's REQUIRED columns last.
fn plan_fields(
    fields: &Fields,
    columns: Option<&[TableFieldSchema]>,
    message_name: &str,
    prefix: &str,
    full_name: &str,
) -> Result<(Vec<Plan>, DescriptorProto), SchemaError> {
    let mut plans = Vec::new();
    let mut descriptor = DescriptorProto { name: Some(message_name.to_string()), ..Default::default() };
    for (i, field) in fields.iter().enumerate() {
        let tag = u32::try_from(i + 1).unwrap_or(u32::MAX);
        let planned = plan_field(field, tag, columns, prefix, full_name)?;
        descriptor.nested_type.extend(planned.nested);
        descriptor.field.push(planned.proto);
        plans.push(planned.plan);
    }
    check_required_given(fields, columns, prefix)?;
    Ok((plans, descriptor))
}

/// One field's plan, its proto field and, for a STRUCT, its nested message.
struct PlannedField {
    plan: Plan,
    proto: FieldDescriptorProto,
    nested: Option<DescriptorProto>,
}

fn plan_field(
    field: &Field,
    tag: u32,
    columns: Option<&[TableFieldSchema]>,
    prefix: &str,
    full_name: &str,
) -> Result<PlannedField, SchemaError> {
    let path = format!("{prefix}{}", field.name());
    let (repeated, value_field) = element(field);
    if repeated && matches!(value_field.data_type(), DataType::List(_) | DataType::LargeList(_)) {
        return Err(unsupported(&path, field.data_type(), "BigQuery has no arrays of arrays"));
    }
    let (natural, mut conv) = natural_type(&path, value_field.data_type())?;
    let column = match columns {
        None => None,
        Some(cols) => Some(find_column(cols, field, &path)?),
    };
    if let Some(col) = column {
        check_column(col, field, natural, repeated, &path)?;
    }
    let mut type_name = None;
    let mut nested = None;
    if let DataType::Struct(children) = value_field.data_type() {
        let nested_name = format!("f{}_{}", tag, field.name());
        let nested_full = format!("{full_name}.{nested_name}");
        let child_columns = column.map(|c| c.fields.as_slice());
        let (child_plans, child_desc) =
            plan_fields(children, child_columns, &nested_name, &format!("{path}."), &nested_full)?;
        conv = Conv::Struct(child_plans);
        nested = Some(child_desc);
        type_name = Some(nested_full);
    }
    let proto = FieldDescriptorProto {
        name: Some(field.name().clone()),
        number: Some(tag as i32),
        label: Some(if repeated { Label::Repeated } else { Label::Optional } as i32),
        r#type: Some(proto_type(&conv) as i32),
        type_name,
        ..Default::default()
    };
    Ok(PlannedField { plan: Plan { tag, repeated, conv }, proto, nested })
}

/// The table's column for `field` (names match case-insensitively).
fn find_column<'c>(
    cols: &'c [TableFieldSchema],
    field: &Field,
    path: &str,
) -> Result<&'c TableFieldSchema, SchemaError> {
    cols.iter().find(|c| c.name.eq_ignore_ascii_case(field.name())).ok_or_else(|| SchemaError::NotInTable {
        column: path.to_string(),
        columns: cols.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", "),
    })
}

/// Whether `field`'s values may land in the table's column `col`: its type,
/// its mode (REPEATED for a list) and its nullability.
fn check_column(
    col: &TableFieldSchema,
    field: &Field,
    natural: Type,
    repeated: bool,
    path: &str,
) -> Result<(), SchemaError> {
    let (_, value_field) = element(field);
    let col_type = Type::try_from(col.r#type).unwrap_or(Type::Unspecified);
    if !compatible(natural, col_type, value_field.data_type()) {
        return Err(SchemaError::Mismatch {
            column: path.to_string(),
            arrow: field.data_type().to_string(),
            bigquery: bq_type_name(col.r#type),
        });
    }
    let col_repeated = col.mode == Mode::Repeated as i32;
    if col_repeated != repeated {
        return Err(SchemaError::Mode {
            column: path.to_string(),
            table_mode: Mode::try_from(col.mode).map(|m| m.as_str_name()).unwrap_or("NULLABLE").to_string(),
            source_mode: if repeated { "a list".into() } else { "single values".into() },
        });
    }
    if col.mode == Mode::Required as i32 && field.is_nullable() {
        return Err(SchemaError::NullableIntoRequired { column: path.to_string() });
    }
    Ok(())
}

/// The proto field type a conversion writes.
fn proto_type(conv: &Conv) -> ProtoType {
    match conv {
        Conv::Int64 | Conv::Timestamp(_) => ProtoType::Int64,
        Conv::Double => ProtoType::Double,
        Conv::Bool => ProtoType::Bool,
        Conv::String | Conv::Datetime(_) | Conv::Decimal(..) => ProtoType::String,
        Conv::Bytes => ProtoType::Bytes,
        Conv::Date => ProtoType::Int32,
        Conv::Struct(_) => ProtoType::Message,
    }
}

/// A table's REQUIRED columns must all be given.
fn check_required_given(
    fields: &Fields,
    columns: Option<&[TableFieldSchema]>,
    prefix: &str,
) -> Result<(), SchemaError> {
    for col in columns.unwrap_or_default() {
        if col.mode == Mode::Required as i32 && !fields.iter().any(|f| f.name().eq_ignore_ascii_case(&col.name)) {
            return Err(SchemaError::MissingRequired { column: format!("{prefix}{}", col.name) });
        }
    }
    Ok(())
}

fn table_field(field: &Field, prefix: &str) -> Result<TableFieldSchema, SchemaError> {
    let path = format!("{prefix}{}", field.name());
    let (repeated, value_field) = element(field);
    let (ty, _) = natural_type(&path, value_field.data_type())?;
    let mut out = TableFieldSchema {
        name: field.name().clone(),
        r#type: ty as i32,
        mode: if repeated {
            Mode::Repeated
        } else if field.is_nullable() {
            Mode::Nullable
        } else {
            Mode::Required
        } as i32,
        ..Default::default()
    };
    if let DataType::Struct(children) = value_field.data_type() {
        out.fields = children.iter().map(|c| table_field(c, &format!("{path}."))).collect::<Result<_, _>>()?;
    }
    Ok(out)
}

fn encode_row(plans: &[Plan], cols: &[&ArrayRef], row: usize, buf: &mut Vec<u8>, scratch: &mut Vec<u8>) {
    for (plan, col) in plans.iter().zip(cols) {
        encode_column(plan, col, row, buf, scratch);
    }
}

/// Row `row` of one column (the general path).
fn encode_column(plan: &Plan, col: &ArrayRef, row: usize, buf: &mut Vec<u8>, scratch: &mut Vec<u8>) {
    if !col.is_null(row) {
        if plan.repeated {
            let (values, start, end) = match col.data_type() {
                DataType::List(_) => {
                    let l = col.as_list::<i32>();
                    let o = l.value_offsets();
                    (l.values(), o[row] as usize, o[row + 1] as usize)
                }
                _ => {
                    let l = col.as_list::<i64>();
                    let o = l.value_offsets();
                    (l.values(), o[row] as usize, o[row + 1] as usize)
                }
            };
            for i in start..end {
                if !values.is_null(i) {
                    encode_value(plan, values, i, buf, scratch);
                }
            }
        } else {
            encode_value(plan, col, row, buf, scratch);
        }
    }
}

fn put_len_delimited(tag: u32, bytes: &[u8], buf: &mut Vec<u8>) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

fn put_varint(tag: u32, v: u64, buf: &mut Vec<u8>) {
    encode_key(tag, WireType::Varint, buf);
    encode_varint(v, buf);
}

fn to_micros(unit: TimeUnit, v: i64) -> i64 {
    match unit {
        TimeUnit::Second => v.saturating_mul(1_000_000),
        TimeUnit::Millisecond => v.saturating_mul(1_000),
        TimeUnit::Microsecond => v,
        TimeUnit::Nanosecond => v.div_euclid(1_000),
    }
}

fn timestamp_value(col: &ArrayRef, i: usize) -> i64 {
    match col.data_type() {
        DataType::Timestamp(TimeUnit::Second, _) => col.as_primitive::<TimestampSecondType>().value(i),
        DataType::Timestamp(TimeUnit::Millisecond, _) => col.as_primitive::<TimestampMillisecondType>().value(i),
        DataType::Timestamp(TimeUnit::Microsecond, _) => col.as_primitive::<TimestampMicrosecondType>().value(i),
        _ => col.as_primitive::<TimestampNanosecondType>().value(i),
    }
}

/// DATETIME text, `YYYY-MM-DD HH:MM:SS.ffffff`, the canonical civil format.
/// Beyond chrono's range (±262,000 years, far past BigQuery's years 1 to
/// 9999) the text says so, and the service rejects the row, naming it.
pub fn datetime_text(micros: i64) -> String {
    match chrono::DateTime::from_timestamp_micros(micros) {
        Some(t) => t.naive_utc().format("%Y-%m-%d %H:%M:%S%.6f").to_string(),
        None => format!("{micros} microseconds from the epoch (out of range)"),
    }
}

/// NUMERIC / BIGNUMERIC text of decimal `i` of `col`, with arrow's formatting.
fn decimal_text(col: &ArrayRef, i: usize, precision: u8, scale: i8) -> String {
    match col.data_type() {
        DataType::Decimal256(_, _) => {
            Decimal256Type::format_decimal(col.as_primitive::<Decimal256Type>().value(i), precision, scale)
        }
        _ => decimal128_text(col.as_primitive::<Decimal128Type>().value(i), precision, scale),
    }
}

fn decimal128_text(v: i128, precision: u8, scale: i8) -> String {
    // 128-bit division is slow (and emulated on wasm32): most values fit 64 bits.
    match i64::try_from(v) {
        Ok(small) => Decimal64Type::format_decimal(small, precision, scale),
        Err(_) => Decimal128Type::format_decimal(v, precision, scale),
    }
}

fn encode_value(plan: &Plan, col: &ArrayRef, i: usize, buf: &mut Vec<u8>, scratch: &mut Vec<u8>) {
    let tag = plan.tag;
    match &plan.conv {
        Conv::Int64 => {
            let v: i64 = match col.data_type() {
                DataType::Int8 => col.as_primitive::<Int8Type>().value(i).into(),
                DataType::Int16 => col.as_primitive::<Int16Type>().value(i).into(),
                DataType::Int32 => col.as_primitive::<Int32Type>().value(i).into(),
                DataType::UInt8 => col.as_primitive::<UInt8Type>().value(i).into(),
                DataType::UInt16 => col.as_primitive::<UInt16Type>().value(i).into(),
                DataType::UInt32 => col.as_primitive::<UInt32Type>().value(i).into(),
                _ => col.as_primitive::<Int64Type>().value(i),
            };
            put_varint(tag, v as u64, buf);
        }
        Conv::Double => {
            let v: f64 = match col.data_type() {
                DataType::Float16 => col.as_primitive::<Float16Type>().value(i).to_f64(),
                DataType::Float32 => col.as_primitive::<Float32Type>().value(i).into(),
                _ => col.as_primitive::<Float64Type>().value(i),
            };
            encode_key(tag, WireType::SixtyFourBit, buf);
            buf.extend_from_slice(&v.to_le_bytes());
        }
        Conv::Bool => put_varint(tag, u64::from(col.as_boolean().value(i)), buf),
        Conv::String => {
            let s: &str = match col.data_type() {
                DataType::LargeUtf8 => col.as_string::<i64>().value(i),
                DataType::Utf8View => col.as_string_view().value(i),
                _ => col.as_string::<i32>().value(i),
            };
            put_len_delimited(tag, s.as_bytes(), buf);
        }
        Conv::Bytes => {
            let b: &[u8] = match col.data_type() {
                DataType::LargeBinary => col.as_binary::<i64>().value(i),
                DataType::BinaryView => col.as_binary_view().value(i),
                DataType::FixedSizeBinary(_) => col.as_fixed_size_binary().value(i),
                _ => col.as_binary::<i32>().value(i),
            };
            put_len_delimited(tag, b, buf);
        }
        Conv::Date => {
            let days: i64 = match col.data_type() {
                DataType::Date64 => col.as_primitive::<Date64Type>().value(i).div_euclid(86_400_000),
                _ => col.as_primitive::<Date32Type>().value(i).into(),
            };
            // int32 fields carry negative values sign-extended to 64 bits.
            put_varint(tag, days as u64, buf);
        }
        Conv::Timestamp(unit) => put_varint(tag, to_micros(*unit, timestamp_value(col, i)) as u64, buf),
        Conv::Datetime(unit) => {
            put_len_delimited(tag, datetime_text(to_micros(*unit, timestamp_value(col, i))).as_bytes(), buf)
        }
        Conv::Decimal(precision, scale) => {
            put_len_delimited(tag, decimal_text(col, i, *precision, *scale).as_bytes(), buf);
        }
        Conv::Struct(children) => {
            let s = col.as_struct();
            let child_cols: Vec<&ArrayRef> = s.columns().iter().collect();
            let mut inner = std::mem::take(scratch);
            inner.clear();
            let mut nested_scratch = Vec::new();
            encode_row(children, &child_cols, i, &mut inner, &mut nested_scratch);
            put_len_delimited(tag, &inner, buf);
            *scratch = inner;
        }
    }
}

/// Splits `rows` into consecutive runs whose ProtoRows stay under
/// `max_bytes` (each run has at least one row).
pub fn split_by_size(rows: &[Vec<u8>], max_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut size = 0usize;
    for (i, r) in rows.iter().enumerate() {
        // Each row costs its bytes plus a tag and a length prefix.
        let cost = r.len() + 1 + prost::length_delimiter_len(r.len());
        if i > start && size + cost > max_bytes {
            out.push(start..i);
            start = i;
            size = 0;
        }
        size += cost;
    }
    if start < rows.len() {
        out.push(start..rows.len());
    }
    out
}

#[cfg(test)]
mod tests;
