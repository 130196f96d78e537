//! Canonical key bytes of a change stream's key columns.
//!
//! Invariants:
//! - the bytes of a key depend only on its values under the table's Iceberg
//!   types, never on the Arrow type that carried them: every integer-like
//!   type (int, long, date, time, timestamps) is 8 bytes big-endian of its
//!   value as `i64` (so `int` promoted to `long` keeps its keys), decimals
//!   16 bytes of their unscaled `i128`, booleans one byte, strings, binary,
//!   fixed and uuid a 4-byte length and their bytes; the columns follow one
//!   another in key order. So a key written by a writer and the same key
//!   read back from a Parquet data file later encode identically;
//! - a key column must exist in the table and be of one of those types
//!   (floating point keys are refused: NaN and -0.0 have no one identity),
//!   and a null key value is refused, by name.

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, ArrayRef, RecordBatch};
use arrow_schema::{DataType, TimeUnit};
use iceberg::spec::{PrimitiveType, Schema, Type};
use sluice_guest_sdk::{SinkError, error};

/// The key columns of a table: their names and Iceberg field ids, in key order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KeyColumns {
    pub(crate) names: Vec<String>,
    pub(crate) ids: Vec<i32>,
}

/// Finds `key` in `schema` (table `table`) and checks every column can be a key.
pub(crate) fn key_columns(table: &str, schema: &Schema, key: &[String]) -> Result<KeyColumns, SinkError> {
    let mut ids = Vec::with_capacity(key.len());
    for name in key {
        let field = schema.field_by_name(name).ok_or_else(|| {
            error::config(format!(
                "[source] key column {name:?} is not a column of table {table} (its columns: {})",
                schema.as_struct().fields().iter().map(|f| f.name.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })?;
        let fits = matches!(
            field.field_type.as_ref(),
            Type::Primitive(
                PrimitiveType::Boolean
                    | PrimitiveType::Int
                    | PrimitiveType::Long
                    | PrimitiveType::Date
                    | PrimitiveType::Time
                    | PrimitiveType::Timestamp
                    | PrimitiveType::Timestamptz
                    | PrimitiveType::TimestampNs
                    | PrimitiveType::TimestamptzNs
                    | PrimitiveType::String
                    | PrimitiveType::Uuid
                    | PrimitiveType::Fixed(_)
                    | PrimitiveType::Binary
                    | PrimitiveType::Decimal { .. }
            )
        );
        if !fits {
            return Err(error::config(format!(
                "[source] key column {name:?} of table {table} is of type {}, which cannot be an upsert key; a key \
                 column is an integer, string, date, time, timestamp, decimal, uuid, binary or boolean column",
                field.field_type
            )));
        }
        ids.push(field.id);
    }
    Ok(KeyColumns { names: key.to_vec(), ids })
}

/// The canonical bytes of the key of every row of `batch`, whose columns
/// `columns` (indices, in key order) hold the key; `what` names the rows
/// in an error ("row N of ...").
pub(crate) fn encode(batch: &RecordBatch, columns: &[usize], names: &[String]) -> Result<Vec<Vec<u8>>, String> {
    let mut keys: Vec<Vec<u8>> = vec![Vec::with_capacity(8 * columns.len()); batch.num_rows()];
    for (&i, name) in columns.iter().zip(names) {
        let column = plain(batch.column(i)).map_err(|e| format!("key column {name:?}: {e}"))?;
        if let Some(row) = (0..column.len()).find(|r| column.is_null(*r)) {
            return Err(format!("key column {name:?} is null in row {row}"));
        }
        append(&column, &mut keys).map_err(|e| format!("key column {name:?}: {e}"))?;
    }
    Ok(keys)
}

/// `column`, run-end-encoded columns (how iceberg's reader hands back an
/// identity-partitioned column) cast to their values' type.
fn plain(column: &ArrayRef) -> Result<ArrayRef, String> {
    match column.data_type() {
        DataType::RunEndEncoded(_, values) => {
            arrow_cast::cast(column, values.data_type()).map_err(|e| format!("decoding it: {e}"))
        }
        DataType::Dictionary(_, values) => {
            arrow_cast::cast(column, values.as_ref()).map_err(|e| format!("decoding it: {e}"))
        }
        _ => Ok(column.clone()),
    }
}

fn put_i64(keys: &mut [Vec<u8>], values: impl Iterator<Item = i64>) {
    for (key, v) in keys.iter_mut().zip(values) {
        key.extend_from_slice(&v.to_be_bytes());
    }
}

fn put_bytes<'a>(keys: &mut [Vec<u8>], values: impl Iterator<Item = Option<&'a [u8]>>) {
    for (key, v) in keys.iter_mut().zip(values) {
        let v = v.unwrap_or_default();
        key.extend_from_slice(&(v.len() as u32).to_be_bytes());
        key.extend_from_slice(v);
    }
}

fn append(column: &ArrayRef, keys: &mut [Vec<u8>]) -> Result<(), String> {
    macro_rules! ints {
        ($t:ty) => {
            put_i64(keys, column.as_primitive::<$t>().values().iter().map(|v| i64::from(*v)))
        };
    }
    match column.data_type() {
        DataType::Boolean => {
            let b = column.as_boolean();
            for (r, key) in keys.iter_mut().enumerate() {
                key.push(u8::from(b.value(r)));
            }
        }
        DataType::Int8 => ints!(Int8Type),
        DataType::Int16 => ints!(Int16Type),
        DataType::Int32 => ints!(Int32Type),
        DataType::Int64 => ints!(Int64Type),
        DataType::UInt8 => ints!(UInt8Type),
        DataType::UInt16 => ints!(UInt16Type),
        DataType::UInt32 => ints!(UInt32Type),
        DataType::Date32 => ints!(Date32Type),
        DataType::Date64 => ints!(Date64Type),
        DataType::Time32(TimeUnit::Second) => ints!(Time32SecondType),
        DataType::Time32(_) => ints!(Time32MillisecondType),
        DataType::Time64(TimeUnit::Nanosecond) => ints!(Time64NanosecondType),
        DataType::Time64(_) => ints!(Time64MicrosecondType),
        DataType::Timestamp(TimeUnit::Second, _) => ints!(TimestampSecondType),
        DataType::Timestamp(TimeUnit::Millisecond, _) => ints!(TimestampMillisecondType),
        DataType::Timestamp(TimeUnit::Microsecond, _) => ints!(TimestampMicrosecondType),
        DataType::Timestamp(TimeUnit::Nanosecond, _) => ints!(TimestampNanosecondType),
        DataType::Decimal128(_, _) => {
            for (key, v) in keys.iter_mut().zip(column.as_primitive::<Decimal128Type>().values().iter()) {
                key.extend_from_slice(&v.to_be_bytes());
            }
        }
        DataType::Utf8 => put_bytes(keys, column.as_string::<i32>().iter().map(|s| s.map(str::as_bytes))),
        DataType::LargeUtf8 => put_bytes(keys, column.as_string::<i64>().iter().map(|s| s.map(str::as_bytes))),
        DataType::Utf8View => put_bytes(keys, column.as_string_view().iter().map(|s| s.map(str::as_bytes))),
        DataType::Binary => put_bytes(keys, column.as_binary::<i32>().iter()),
        DataType::LargeBinary => put_bytes(keys, column.as_binary::<i64>().iter()),
        DataType::BinaryView => put_bytes(keys, column.as_binary_view().iter()),
        DataType::FixedSizeBinary(_) => put_bytes(keys, column.as_fixed_size_binary().iter()),
        other => return Err(format!("values of Arrow type {other} cannot be a key")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Int32Array, Int64Array, LargeStringArray, StringArray};
    use arrow_schema::{Field, Schema as ArrowSchema};
    use iceberg::spec::NestedField;

    use super::*;

    fn batch(columns: Vec<ArrayRef>) -> RecordBatch {
        let fields: Vec<Field> =
            columns.iter().enumerate().map(|(i, c)| Field::new(format!("c{i}"), c.data_type().clone(), true)).collect();
        RecordBatch::try_new(Arc::new(ArrowSchema::new(fields)), columns).unwrap()
    }

    /// The same key carried by other Arrow types (an `int` read back as
    /// `long`, a string as a large string) encodes the same.
    #[test]
    fn a_key_encodes_the_same_whatever_arrow_type_carries_it() {
        let names = ["id".to_string(), "name".to_string()];
        let a = batch(vec![Arc::new(Int32Array::from(vec![1, -2])), Arc::new(StringArray::from(vec!["x", "yz"]))]);
        let b = batch(vec![Arc::new(Int64Array::from(vec![1, -2])), Arc::new(LargeStringArray::from(vec!["x", "yz"]))]);
        let ka = encode(&a, &[0, 1], &names).unwrap();
        assert_eq!(ka, encode(&b, &[0, 1], &names).unwrap());
        assert_ne!(ka[0], ka[1]);
        // A length prefix keeps ("a", "bc") apart from ("ab", "c").
        let s = |x: &str, y: &str| {
            let b = batch(vec![Arc::new(StringArray::from(vec![x])), Arc::new(StringArray::from(vec![y]))]);
            encode(&b, &[0, 1], &names).unwrap().remove(0)
        };
        assert_ne!(s("a", "bc"), s("ab", "c"));
        let nulls = batch(vec![Arc::new(Int32Array::from(vec![Some(1), None]))]);
        assert!(encode(&nulls, &[0], &names[..1]).unwrap_err().contains("\"id\" is null in row 1"));
    }

    #[test]
    fn key_columns_are_found_and_checked_by_name() {
        let schema = Schema::builder()
            .with_fields(vec![
                NestedField::required(1, "id", Type::Primitive(PrimitiveType::Long)).into(),
                NestedField::optional(2, "score", Type::Primitive(PrimitiveType::Double)).into(),
            ])
            .build()
            .unwrap();
        assert_eq!(key_columns("ns.t", &schema, &["id".into()]).unwrap().ids, vec![1]);
        let missing = format!("{:?}", key_columns("ns.t", &schema, &["nope".into()]).unwrap_err());
        assert!(missing.contains("nope") && missing.contains("ns.t"), "{missing}");
        let float = format!("{:?}", key_columns("ns.t", &schema, &["score".into()]).unwrap_err());
        assert!(float.contains("score") && float.contains("double"), "{float}");
    }
}
