//! Writer schemas and rows, checked the way the Storage Write API checks them.
//!
//! - `writer_schema` is a self-contained proto2 `DescriptorProto`; rows are
//!   serialized messages of it ("ProtoSchema: descriptor for input message.
//!   The provided descriptor must be self contained, such that data rows sent
//!   can be fully decoded using only the single descriptor",
//!   https://cloud.google.com/bigquery/docs/reference/storage/rpc/google.cloud.bigquery.storage.v1#protoschema).
//! - A field the table lacks is `SCHEMA_MISMATCH_EXTRA_FIELDS`; field names
//!   match columns case-insensitively; proto types must be ones the
//!   conversion table allows for the column type
//!   (https://cloud.google.com/bigquery/docs/write-api#data_type_conversions).
//! - A row that cannot be decoded, lacks a REQUIRED column or breaks a
//!   `max_length` is a row error: the whole request is rejected ("If a request
//!   failed due to corrupted rows, no rows in the batch will be appended",
//!   AppendRowsResponse.row_errors).

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema, table_field_schema::Mode, table_field_schema::Type,
};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MessageDescriptor, ReflectMessage, Value};
use prost_types::{DescriptorProto, FileDescriptorProto, FileDescriptorSet};

/// Compiles a writer schema into a message descriptor.
pub fn compile(descriptor: &DescriptorProto) -> Result<MessageDescriptor, String> {
    let name = descriptor.name.clone().unwrap_or_default();
    if name.is_empty() {
        return Err("writer_schema.proto_descriptor has no name".into());
    }
    let set = FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("writer_schema.proto".into()),
            message_type: vec![descriptor.clone()],
            ..Default::default()
        }],
    };
    let pool = DescriptorPool::decode(set.encode_to_vec().as_slice())
        .map_err(|e| format!("writer_schema is not a valid self-contained descriptor: {e}"))?;
    pool.get_message_by_name(&name).ok_or_else(|| format!("writer_schema: message {name} not found"))
}

/// Checks a writer schema against the table's columns.
pub fn check(message: &MessageDescriptor, table: &TableSchema) -> Result<(), String> {
    check_fields(message, &table.fields, "")
}

fn check_fields(message: &MessageDescriptor, columns: &[TableFieldSchema], prefix: &str) -> Result<(), String> {
    for field in message.fields() {
        let path = format!("{prefix}{}", field.name());
        let Some(column) = columns.iter().find(|c| c.name.eq_ignore_ascii_case(field.name())) else {
            return Err(format!("Input schema has more fields than BigQuery schema, extra fields: '{path}'"));
        };
        let repeated = column.mode == Mode::Repeated as i32;
        if field.is_list() != repeated {
            return Err(format!(
                "Field {path}: proto field is {} but the column mode is {}",
                if field.is_list() { "repeated" } else { "singular" },
                Mode::try_from(column.mode).map(|m| m.as_str_name()).unwrap_or("?")
            ));
        }
        let ty = Type::try_from(column.r#type).unwrap_or(Type::Unspecified);
        let kind = field.kind();
        let ok = match ty {
            Type::Int64 => matches!(
                kind,
                Kind::Int32
                    | Kind::Int64
                    | Kind::Uint32
                    | Kind::Sint32
                    | Kind::Sint64
                    | Kind::Sfixed32
                    | Kind::Sfixed64
                    | Kind::Fixed32
                    | Kind::Enum(_)
            ),
            Type::Double => matches!(kind, Kind::Float | Kind::Double),
            Type::Bool => matches!(kind, Kind::Bool),
            Type::String | Type::Json => matches!(kind, Kind::String),
            Type::Bytes => matches!(kind, Kind::Bytes),
            Type::Numeric | Type::Bignumeric => matches!(kind, Kind::String | Kind::Bytes),
            Type::Date => matches!(kind, Kind::Int32 | Kind::Int64 | Kind::String),
            Type::Datetime | Type::Time => matches!(kind, Kind::String | Kind::Int64),
            Type::Timestamp => matches!(kind, Kind::Int64 | Kind::String | Kind::Double),
            Type::Struct => match &kind {
                Kind::Message(m) => {
                    check_fields(m, &column.fields, &format!("{path}."))?;
                    true
                }
                _ => false,
            },
            _ => false,
        };
        if !ok {
            return Err(format!(
                "Field {path}: proto type {kind:?} cannot be converted to the column type {}",
                ty.as_str_name()
            ));
        }
    }
    Ok(())
}

/// Decodes and checks one row; the error is a row error's message.
pub fn check_row(message: &MessageDescriptor, bytes: &[u8], table: &TableSchema) -> Result<(), String> {
    let row = DynamicMessage::decode(message.clone(), bytes).map_err(|e| format!("Could not parse the row: {e}"))?;
    check_values(&row, &table.fields, "")
}

fn check_values(row: &DynamicMessage, columns: &[TableFieldSchema], prefix: &str) -> Result<(), String> {
    for column in columns {
        let path = format!("{prefix}{}", column.name);
        let field = row.descriptor().fields().find(|f| f.name().eq_ignore_ascii_case(&column.name));
        let present = field.as_ref().is_some_and(|f| row.has_field(f));
        if column.mode == Mode::Required as i32 && !present {
            return Err(format!("Field {path} is REQUIRED but the row has no value for it"));
        }
        let (Some(field), true) = (field, present) else { continue };
        let value = row.get_field(&field);
        let values: Vec<&Value> = match value.as_ref() {
            Value::List(items) => items.iter().collect(),
            v => vec![v],
        };
        for v in values {
            match v {
                Value::String(s) if column.max_length > 0 && s.chars().count() as i64 > column.max_length => {
                    return Err(format!(
                        "Field {path}: value of length {} exceeds max_length {}",
                        s.chars().count(),
                        column.max_length
                    ));
                }
                Value::Bytes(b) if column.max_length > 0 && b.len() as i64 > column.max_length => {
                    return Err(format!("Field {path}: {} bytes exceed max_length {}", b.len(), column.max_length));
                }
                Value::Message(m) => check_values(m, &column.fields, &format!("{path}."))?,
                _ => {}
            }
        }
    }
    Ok(())
}

/// A stored row as JSON, keyed by the table's column names (for reading back).
pub fn to_json(message: &MessageDescriptor, bytes: &[u8]) -> serde_json::Map<String, serde_json::Value> {
    match DynamicMessage::decode(message.clone(), bytes) {
        Ok(row) => message_json(&row),
        Err(e) => {
            let mut m = serde_json::Map::new();
            m.insert("_undecodable".into(), serde_json::Value::String(e.to_string()));
            m
        }
    }
}

fn message_json(row: &DynamicMessage) -> serde_json::Map<String, serde_json::Value> {
    row.fields().map(|(f, v)| (f.name().to_string(), value_json(v))).collect()
}

fn value_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        Value::Bool(b) => J::Bool(*b),
        Value::I32(i) => J::from(*i),
        Value::I64(i) => J::from(*i),
        Value::U32(i) => J::from(*i),
        Value::U64(i) => J::from(*i),
        Value::F32(f) => J::from(f64::from(*f)),
        Value::F64(f) => J::from(*f),
        Value::String(s) => J::String(s.clone()),
        Value::Bytes(b) => J::String(b.iter().map(|x| format!("{x:02x}")).collect()),
        Value::EnumNumber(n) => J::from(*n),
        Value::Message(m) => J::Object(message_json(m)),
        Value::List(items) => J::Array(items.iter().map(value_json).collect()),
        Value::Map(_) => J::Null,
    }
}
