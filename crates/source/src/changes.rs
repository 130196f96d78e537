//! A source's rows as a change stream (`[source] key`, `change_column`):
//! the step that turns a batch read from the input into a change batch.
//!
//! Invariants:
//! - the change column is consumed: it is in no batch handed on and in no
//!   table schema ([`ChangeSpec::table_schema`]);
//! - a batch handed on carries the input's other columns, in their order,
//!   then exactly [`OP`], [`SEQ_HI`] and [`SEQ_LO`], non-null (the shape
//!   `sluice_core::changes` fixes);
//! - a row whose operation does not parse ([`Op::parse`]: unknown, null, or
//!   no change column at all) or whose key column is missing or null is no
//!   change: it is returned as a [`BadChange`] (its row, and a reason naming
//!   the column and the value) for the caller's bad-row machinery, never
//!   handed on;
//! - with a [`Share`], a row is handed on only by the subtask its key hashes
//!   to ([`owner`]), and a bad row only by the one share that reports them,
//!   so each row of the input reaches exactly one subtask however many read
//!   it;
//! - the key's hash ([`key_hash`], scheme [`KEY_HASH_SCHEME`]) is FNV-1a
//!   over canonical bytes of the key's typed values ([`key_bytes`]), never
//!   over Arrow's text rendering (not pinned across Arrow versions): a
//!   column widened between files (Int32 to Int64, Utf8 to LargeUtf8,
//!   Decimal128 to Decimal256) keeps every key on its subtask, and a
//!   checkpoint records the scheme so that a resume under another one is
//!   refused (a key could move to another subtask);
//! - a key column of a type without a single identity per value (floats:
//!   0.0 and -0.0, NaN) or of a type the scheme does not cover is refused
//!   ([`check_key_type`]).

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch, StringArray, UInt8Array, UInt64Array};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use sluice_core::changes::{OP, Op, SEQ_HI, SEQ_LO, is_change_column};

/// How a source's rows are changes: the key columns, and the column that
/// holds each row's operation (none: every row is an upsert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeSpec {
    pub key: Vec<String>,
    pub column: Option<String>,
}

/// Which rows one subtask of several keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    pub subtask: u32,
    pub parallelism: u32,
    /// This subtask reports the input's bad rows (exactly one share does).
    pub reports_bad: bool,
}

/// A row of the input that is no change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadChange {
    /// Its row in the input batch.
    pub row: usize,
    /// Why: the column and its value.
    pub reason: String,
}

/// An input batch as changes.
#[derive(Debug)]
pub struct Changes {
    /// The rows handed on, as a change batch.
    pub batch: RecordBatch,
    /// The input row of each row of `batch`, ascending.
    pub kept: Vec<usize>,
    /// The bad rows this share reports, ascending.
    pub bad: Vec<BadChange>,
}

/// The operations a change column may hold, as a reason lists them.
const OPERATIONS: &str = "insert, update, delete, or Debezium's c, r, u, d";

/// FNV-1a (64 bit): stable across runs, platforms and versions, as the
/// file source's split by name uses it. Hand-rolled (eight lines) so that
/// the split can never change under a dependency update.
pub fn fnv1a64(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The subtask a key with hash `hash` belongs to.
pub fn owner(hash: u64, parallelism: u32) -> u32 {
    (hash % u64::from(parallelism.max(1))) as u32
}

/// The key hash scheme a checkpoint of a change stream records: which
/// bytes of a key [`fnv1a64`] hashes ([`key_bytes`]). Change it (and the
/// name) whenever those bytes change: a resume under another scheme is
/// refused, since a key could move to another subtask.
pub const KEY_HASH_SCHEME: &str = "key-hash-v1";

/// Refuses a key column of `data_type` whose values have no canonical bytes
/// in [`KEY_HASH_SCHEME`]: floats (0.0 and -0.0 are equal, NaN equals
/// nothing, so a key has no single identity) and types the scheme does not
/// cover. The reason names neither the column nor the key: the caller does.
pub fn check_key_type(data_type: &DataType) -> Result<(), String> {
    use DataType as D;
    match data_type {
        D::Int8 | D::Int16 | D::Int32 | D::Int64 | D::UInt8 | D::UInt16 | D::UInt32 | D::UInt64 => Ok(()),
        D::Utf8 | D::LargeUtf8 | D::Utf8View | D::Binary | D::LargeBinary | D::BinaryView => Ok(()),
        D::FixedSizeBinary(_) | D::Boolean | D::Date32 | D::Date64 | D::Timestamp(..) => Ok(()),
        D::Decimal32(..) | D::Decimal64(..) | D::Decimal128(..) | D::Decimal256(..) => Ok(()),
        D::Dictionary(_, value) => check_key_type(value),
        D::Float16 | D::Float32 | D::Float64 => Err(format!(
            "is of type {data_type}, and a floating-point value is no key (0.0 and -0.0 are equal, NaN equals \
             nothing): key by an integer, string, date, timestamp or decimal column"
        )),
        other => Err(format!(
            "is of type {other}, which is no key type (integers, strings, binary, booleans, dates, timestamps, \
             decimals)"
        )),
    }
}

/// The key columns of `batch` (`None` for a column the batch lacks), a
/// dictionary-encoded one unpacked to its values (a typed unpacking, no
/// formatting). A key column of a type [`check_key_type`] refuses is an
/// error naming it.
fn key_columns(batch: &RecordBatch, key: &[String]) -> Result<Vec<Option<ArrayRef>>, ArrowError> {
    key.iter()
        .map(|name| {
            let Some(col) = batch.column_by_name(name) else { return Ok(None) };
            check_key_type(col.data_type())
                .map_err(|why| ArrowError::InvalidArgumentError(format!("key column `{name}` (source.key) {why}")))?;
            match col.data_type() {
                DataType::Dictionary(_, value) => arrow_cast::cast(col, value).map(Some),
                _ => Ok(Some(col.clone())),
            }
        })
        .collect()
}

/// Appends value `row` of `col` (not null there) to `out` as the canonical
/// bytes of [`KEY_HASH_SCHEME`] "key-hash-v1": a class byte, then
/// - integers of every width (`i`): the value as i64, little-endian (a
///   UInt64 past i64::MAX as its bits), so a widened column keeps its keys;
/// - strings (`s`) and binary (`b`): the length (u64, little-endian) and
///   the bytes (a string's UTF-8);
/// - booleans (`o`): one byte, 0 or 1;
/// - dates (`d`): days since the Unix epoch as i64 (a Date64 floored to
///   its day);
/// - timestamps (`t`): microseconds since the Unix epoch as i64, from the
///   column's unit (seconds and milliseconds multiplied, saturating;
///   nanoseconds floored), whatever the zone (the value is an instant);
/// - decimals (`n`): the unscaled value as i128, little-endian, then the
///   scale as one byte (a Decimal256 past i128 as its 32 bytes).
///
/// `None` for a type [`check_key_type`] refuses.
fn key_bytes(col: &dyn Array, row: usize, out: &mut Vec<u8>) -> Option<()> {
    use DataType as D;
    use arrow_array::cast::AsArray;
    use arrow_array::types as T;
    use arrow_schema::TimeUnit;
    let int = |out: &mut Vec<u8>, v: i64| {
        out.push(b'i');
        out.extend_from_slice(&v.to_le_bytes());
    };
    let bytes = |out: &mut Vec<u8>, class: u8, v: &[u8]| {
        out.push(class);
        out.extend_from_slice(&(v.len() as u64).to_le_bytes());
        out.extend_from_slice(v);
    };
    let tagged = |out: &mut Vec<u8>, class: u8, v: i64| {
        out.push(class);
        out.extend_from_slice(&v.to_le_bytes());
    };
    let decimal = |out: &mut Vec<u8>, v: i128, scale: i8| {
        out.push(b'n');
        out.extend_from_slice(&v.to_le_bytes());
        out.extend_from_slice(&scale.to_le_bytes());
    };
    match col.data_type() {
        D::Int8 => int(out, i64::from(col.as_primitive_opt::<T::Int8Type>()?.value(row))),
        D::Int16 => int(out, i64::from(col.as_primitive_opt::<T::Int16Type>()?.value(row))),
        D::Int32 => int(out, i64::from(col.as_primitive_opt::<T::Int32Type>()?.value(row))),
        D::Int64 => int(out, col.as_primitive_opt::<T::Int64Type>()?.value(row)),
        D::UInt8 => int(out, i64::from(col.as_primitive_opt::<T::UInt8Type>()?.value(row))),
        D::UInt16 => int(out, i64::from(col.as_primitive_opt::<T::UInt16Type>()?.value(row))),
        D::UInt32 => int(out, i64::from(col.as_primitive_opt::<T::UInt32Type>()?.value(row))),
        D::UInt64 => int(out, i64::from_le_bytes(col.as_primitive_opt::<T::UInt64Type>()?.value(row).to_le_bytes())),
        D::Utf8 => bytes(out, b's', col.as_string_opt::<i32>()?.value(row).as_bytes()),
        D::LargeUtf8 => bytes(out, b's', col.as_string_opt::<i64>()?.value(row).as_bytes()),
        D::Utf8View => bytes(out, b's', col.as_string_view_opt()?.value(row).as_bytes()),
        D::Binary => bytes(out, b'b', col.as_binary_opt::<i32>()?.value(row)),
        D::LargeBinary => bytes(out, b'b', col.as_binary_opt::<i64>()?.value(row)),
        D::BinaryView => bytes(out, b'b', col.as_binary_view_opt()?.value(row)),
        D::FixedSizeBinary(_) => bytes(out, b'b', col.as_fixed_size_binary_opt()?.value(row)),
        D::Boolean => out.extend_from_slice(&[b'o', u8::from(col.as_boolean_opt()?.value(row))]),
        D::Date32 => tagged(out, b'd', i64::from(col.as_primitive_opt::<T::Date32Type>()?.value(row))),
        D::Date64 => tagged(out, b'd', col.as_primitive_opt::<T::Date64Type>()?.value(row).div_euclid(86_400_000)),
        D::Timestamp(unit, _) => {
            let micros = match unit {
                TimeUnit::Second => {
                    col.as_primitive_opt::<T::TimestampSecondType>()?.value(row).saturating_mul(1_000_000)
                }
                TimeUnit::Millisecond => {
                    col.as_primitive_opt::<T::TimestampMillisecondType>()?.value(row).saturating_mul(1_000)
                }
                TimeUnit::Microsecond => col.as_primitive_opt::<T::TimestampMicrosecondType>()?.value(row),
                TimeUnit::Nanosecond => {
                    col.as_primitive_opt::<T::TimestampNanosecondType>()?.value(row).div_euclid(1_000)
                }
            };
            tagged(out, b't', micros)
        }
        D::Decimal32(_, scale) => {
            decimal(out, i128::from(col.as_primitive_opt::<T::Decimal32Type>()?.value(row)), *scale)
        }
        D::Decimal64(_, scale) => {
            decimal(out, i128::from(col.as_primitive_opt::<T::Decimal64Type>()?.value(row)), *scale)
        }
        D::Decimal128(_, scale) => decimal(out, col.as_primitive_opt::<T::Decimal128Type>()?.value(row), *scale),
        D::Decimal256(_, scale) => {
            let v = col.as_primitive_opt::<T::Decimal256Type>()?.value(row);
            match v.to_i128() {
                Some(v) => decimal(out, v, *scale),
                None => {
                    out.push(b'n');
                    out.extend_from_slice(&v.to_le_bytes());
                    out.extend_from_slice(&scale.to_le_bytes());
                }
            }
        }
        _ => return None,
    }
    Some(())
}

/// The hash of row `row`'s key, from the key columns ([`key_columns`]):
/// [`fnv1a64`] of each value's canonical bytes ([`key_bytes`]), in key
/// order. `None` when a key column is missing or null there.
fn hash_of(cols: &[Option<ArrayRef>], row: usize) -> Option<u64> {
    let mut bytes = Vec::new();
    for col in cols {
        let col = col.as_ref()?;
        if col.is_null(row) {
            return None;
        }
        key_bytes(col.as_ref(), row, &mut bytes)?;
    }
    Some(fnv1a64(bytes))
}

/// The key hash of every row of `batch` (`None` where the key is missing or
/// null). A key column of a type [`check_key_type`] refuses is an error.
pub fn key_hash(batch: &RecordBatch, key: &[String]) -> Result<Vec<Option<u64>>, ArrowError> {
    let cols = key_columns(batch, key)?;
    Ok((0..batch.num_rows()).map(|row| hash_of(&cols, row)).collect())
}

/// A value as a reason shows it: quoted, cut short.
fn shown(value: &str) -> String {
    if value.chars().count() <= 60 {
        format!("{value:?}")
    } else {
        format!("{:?}...", value.chars().take(60).collect::<String>())
    }
}

impl ChangeSpec {
    /// The schema a table of this source has: the input's without the
    /// change column.
    pub fn table_schema(&self, schema: &Schema) -> SchemaRef {
        let fields: Vec<_> =
            schema.fields().iter().filter(|f| Some(f.name()) != self.column.as_ref()).cloned().collect();
        Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
    }

    /// The operation of every row (`Err` with the reason where it is none).
    fn ops(&self, batch: &RecordBatch) -> Result<Vec<Result<Op, String>>, ArrowError> {
        let n = batch.num_rows();
        let Some(name) = &self.column else { return Ok(vec![Ok(Op::Upsert); n]) };
        let Some(col) = batch.column_by_name(name) else {
            let reason = format!("has no column `{name}` (the change column)");
            return Ok(vec![Err(reason); n]);
        };
        let text = arrow_cast::cast(col, &DataType::Utf8)?;
        let Some(text) = text.as_any().downcast_ref::<StringArray>() else {
            return Err(ArrowError::CastError(format!("column `{name}` did not read as text")));
        };
        Ok((0..n)
            .map(|row| {
                if text.is_null(row) {
                    return Err(format!("column `{name}` is null, which is not an operation ({OPERATIONS})"));
                }
                let value = text.value(row);
                Op::parse(value).ok_or_else(|| {
                    format!("column `{name}` holds {}, which is not an operation ({OPERATIONS})", shown(value))
                })
            })
            .collect())
    }

    /// `batch` as changes: the change column dropped, the operations and
    /// `seq(row)` (the source position of input row `row`) appended, the
    /// bad rows set apart, and with `share` only the rows of that share.
    /// Refused when the input already has a column of a change batch's own.
    pub fn apply(
        &self,
        batch: &RecordBatch,
        seq: impl Fn(usize) -> (u64, u64),
        share: Option<Share>,
    ) -> Result<Changes, ArrowError> {
        if let Some(f) = batch.schema().fields().iter().find(|f| is_change_column(f.name())) {
            return Err(ArrowError::InvalidArgumentError(format!(
                "column `{}` is a name Sluice keeps for change streams; rename it in the source",
                f.name()
            )));
        }
        let ops = self.ops(batch)?;
        let keys = key_columns(batch, &self.key)?;
        let (mut kept, mut bad) = (Vec::new(), Vec::new());
        let mut op_col = Vec::new();
        for (row, op) in ops.into_iter().enumerate() {
            let reports_bad = share.is_none_or(|s| s.reports_bad);
            let op = match op {
                Ok(op) => op,
                Err(reason) => {
                    if reports_bad {
                        bad.push(BadChange { row, reason });
                    }
                    continue;
                }
            };
            let Some(hash) = hash_of(&keys, row) else {
                if reports_bad {
                    bad.push(BadChange { row, reason: self.key_fault(batch, row) });
                }
                continue;
            };
            if share.is_none_or(|s| owner(hash, s.parallelism) == s.subtask) {
                kept.push(row);
                op_col.push(op.code());
            }
        }
        let indices = arrow_array::UInt32Array::from(kept.iter().map(|r| *r as u32).collect::<Vec<_>>());
        let mut fields = Vec::new();
        let mut columns: Vec<ArrayRef> = Vec::new();
        for (field, col) in batch.schema().fields().iter().zip(batch.columns()) {
            if Some(field.name()) == self.column.as_ref() {
                continue;
            }
            fields.push(field.as_ref().clone());
            columns.push(arrow_select::take::take(col, &indices, None)?);
        }
        let (hi, lo): (Vec<u64>, Vec<u64>) = kept.iter().map(|r| seq(*r)).unzip();
        fields.push(Field::new(OP, DataType::UInt8, false));
        fields.push(Field::new(SEQ_HI, DataType::UInt64, false));
        fields.push(Field::new(SEQ_LO, DataType::UInt64, false));
        columns.push(Arc::new(UInt8Array::from(op_col)));
        columns.push(Arc::new(UInt64Array::from(hi)));
        columns.push(Arc::new(UInt64Array::from(lo)));
        let schema = Arc::new(Schema::new_with_metadata(fields, batch.schema().metadata().clone()));
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(kept.len()));
        let batch = RecordBatch::try_new_with_options(schema, columns, &options)?;
        Ok(Changes { batch, kept, bad })
    }

    /// Why row `row` of `batch` has no key: its first missing or null key column.
    fn key_fault(&self, batch: &RecordBatch, row: usize) -> String {
        for name in &self.key {
            match batch.column_by_name(name) {
                None => return format!("has no key column `{name}`"),
                Some(col) if col.is_null(row) => return format!("key column `{name}` is null"),
                Some(_) => {}
            }
        }
        "its key has no canonical bytes".to_string()
    }
}

/// The table's own columns of a change batch's `schema`: without [`OP`],
/// [`SEQ_HI`] and [`SEQ_LO`] (the schema itself when it has none of them).
pub fn without_change_columns(schema: &SchemaRef) -> SchemaRef {
    if !schema.fields().iter().any(|f| is_change_column(f.name())) {
        return schema.clone();
    }
    let fields: Vec<_> = schema.fields().iter().filter(|f| !is_change_column(f.name())).cloned().collect();
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int32Array, Int64Array};

    fn input(ids: Vec<Option<i64>>, ops: Vec<Option<&str>>) -> RecordBatch {
        let n = ids.len();
        RecordBatch::try_from_iter(vec![
            ("id", Arc::new(Int64Array::from(ids)) as ArrayRef),
            ("op", Arc::new(StringArray::from(ops)) as ArrayRef),
            ("v", Arc::new(StringArray::from((0..n).map(|i| format!("v{i}")).collect::<Vec<_>>())) as ArrayRef),
        ])
        .unwrap()
    }

    fn spec() -> ChangeSpec {
        ChangeSpec { key: vec!["id".into()], column: Some("op".into()) }
    }

    fn u64s(b: &RecordBatch, name: &str) -> Vec<u64> {
        b.column_by_name(name).unwrap().as_any().downcast_ref::<UInt64Array>().unwrap().values().to_vec()
    }

    #[test]
    fn the_change_column_is_consumed_and_the_reserved_columns_come_last() {
        let b = input(vec![Some(1), Some(2), Some(1)], vec![Some("c"), Some(" INSERT "), Some("d")]);
        let out = spec().apply(&b, |r| (7, r as u64 + 1), None).unwrap();
        let schema = out.batch.schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, vec!["id", "v", OP, SEQ_HI, SEQ_LO]);
        assert!(out.batch.schema().fields()[2..].iter().all(|f| !f.is_nullable()));
        let ops = out.batch.column_by_name(OP).unwrap().as_any().downcast_ref::<UInt8Array>().unwrap();
        assert_eq!(ops.values().to_vec(), vec![0, 0, 1]);
        assert_eq!(u64s(&out.batch, SEQ_HI), vec![7, 7, 7]);
        assert_eq!(u64s(&out.batch, SEQ_LO), vec![1, 2, 3]);
        assert_eq!(out.kept, vec![0, 1, 2]);
        assert!(out.bad.is_empty());
        let table: Vec<String> = spec().table_schema(&b.schema()).fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(table, vec!["id", "v"]);
        assert_eq!(without_change_columns(&out.batch.schema()).fields().len(), 2);
    }

    #[test]
    fn unknown_operations_and_missing_keys_are_bad_rows_naming_column_and_value() {
        let b = input(vec![Some(1), None, Some(3), Some(4)], vec![Some("merge"), Some("u"), None, Some("u")]);
        let out = spec().apply(&b, |r| (0, r as u64), None).unwrap();
        assert_eq!(out.kept, vec![3]);
        assert_eq!(out.batch.num_rows(), 1);
        let bad: Vec<(usize, &str)> = out.bad.iter().map(|b| (b.row, b.reason.as_str())).collect();
        assert_eq!(bad[0].0, 0);
        assert!(bad[0].1.starts_with("column `op` holds \"merge\", which is not an operation"), "{}", bad[0].1);
        assert_eq!(bad[1], (1, "key column `id` is null"));
        assert!(bad[2].1.starts_with("column `op` is null"), "{}", bad[2].1);
        // No key column at all, and no change column at all.
        let other = ChangeSpec { key: vec!["nope".into()], column: Some("op".into()) };
        assert_eq!(other.apply(&b, |_| (0, 0), None).unwrap().bad[3].reason, "has no key column `nope`");
        let no_op = ChangeSpec { key: vec!["id".into()], column: Some("kind".into()) };
        let out = no_op.apply(&b, |_| (0, 0), None).unwrap();
        assert_eq!(out.bad.len(), 4);
        assert_eq!(out.bad[0].reason, "has no column `kind` (the change column)");
        // Without a change column every keyed row is an upsert.
        let upserts = ChangeSpec { key: vec!["id".into()], column: None };
        let out = upserts.apply(&b, |_| (0, 0), None).unwrap();
        assert_eq!(out.kept, vec![0, 2, 3]);
        assert_eq!(out.batch.num_columns(), 3 + 3, "the op column is not consumed when it is not the change column");
    }

    #[test]
    fn shares_split_rows_by_key_and_report_bad_rows_once() {
        let ids: Vec<Option<i64>> = (0..200).map(|i| if i == 50 { None } else { Some(i % 37) }).collect();
        let b = input(ids, vec![Some("u"); 200]);
        let p = 3;
        let mut all = Vec::new();
        let mut bad = 0;
        for s in 0..p {
            let share = Share { subtask: s, parallelism: p, reports_bad: s == 1 };
            let out = spec().apply(&b, |r| (0, r as u64), Some(share)).unwrap();
            bad += out.bad.len();
            let hashes = key_hash(&b, &spec().key).unwrap();
            for r in &out.kept {
                assert_eq!(owner(hashes[*r].unwrap(), p), s, "row {r} on its key's subtask");
            }
            all.extend(out.kept);
        }
        all.sort_unstable();
        assert_eq!(all, (0..200).filter(|r| *r != 50).collect::<Vec<_>>(), "every good row exactly once");
        assert_eq!(bad, 1, "the bad row is reported by one share");
    }

    #[test]
    fn a_keys_hash_does_not_depend_on_its_arrow_type() {
        let narrow =
            RecordBatch::try_from_iter(vec![("id", Arc::new(Int32Array::from(vec![5, 6])) as ArrayRef)]).unwrap();
        let wide =
            RecordBatch::try_from_iter(vec![("id", Arc::new(Int64Array::from(vec![5, 6])) as ArrayRef)]).unwrap();
        let key = vec!["id".to_string()];
        assert_eq!(key_hash(&narrow, &key).unwrap(), key_hash(&wide, &key).unwrap());
        // Two columns are told apart from one column holding both values.
        let two = RecordBatch::try_from_iter(vec![
            ("a", Arc::new(StringArray::from(vec!["ab"])) as ArrayRef),
            ("b", Arc::new(StringArray::from(vec!["c"])) as ArrayRef),
        ])
        .unwrap();
        let other = RecordBatch::try_from_iter(vec![
            ("a", Arc::new(StringArray::from(vec!["a"])) as ArrayRef),
            ("b", Arc::new(StringArray::from(vec!["bc"])) as ArrayRef),
        ])
        .unwrap();
        let ab = vec!["a".to_string(), "b".to_string()];
        assert_ne!(key_hash(&two, &ab).unwrap(), key_hash(&other, &ab).unwrap());
    }

    fn one(name: &str, col: ArrayRef) -> RecordBatch {
        RecordBatch::try_from_iter(vec![(name, col)]).unwrap()
    }

    fn hashes(col: ArrayRef) -> Vec<Option<u64>> {
        key_hash(&one("k", col), &["k".to_string()]).unwrap()
    }

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        // http://www.isthe.com/chongo/src/fnv/test_fnv.c (FNV1A_64 of "", "a", "foobar").
        assert_eq!(fnv1a64(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(*b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_key_hash_is_fnv1a64_of_the_documented_canonical_bytes() {
        let bytes = |parts: &[&[u8]]| fnv1a64(parts.concat());
        assert_eq!(hashes(Arc::new(Int64Array::from(vec![5]))), vec![Some(bytes(&[b"i", &5i64.to_le_bytes()]))]);
        assert_eq!(
            hashes(Arc::new(StringArray::from(vec!["ab"]))),
            vec![Some(bytes(&[b"s", &2u64.to_le_bytes(), b"ab"]))]
        );
        assert_eq!(
            hashes(Arc::new(arrow_array::BinaryArray::from(vec![&b"ab"[..]]))),
            vec![Some(bytes(&[b"b", &2u64.to_le_bytes(), b"ab"]))]
        );
        assert_eq!(hashes(Arc::new(arrow_array::BooleanArray::from(vec![true]))), vec![Some(bytes(&[b"o\x01"]))]);
        assert_eq!(
            hashes(Arc::new(arrow_array::Date32Array::from(vec![20_000]))),
            vec![Some(bytes(&[b"d", &20_000i64.to_le_bytes()]))]
        );
        assert_eq!(
            hashes(Arc::new(arrow_array::TimestampMillisecondArray::from(vec![1_700_000_000_123]))),
            vec![Some(bytes(&[b"t", &1_700_000_000_123_000i64.to_le_bytes()]))]
        );
        let dec = arrow_array::Decimal128Array::from(vec![-12_345i128]).with_precision_and_scale(10, 2).unwrap();
        assert_eq!(hashes(Arc::new(dec)), vec![Some(bytes(&[b"n", &(-12_345i128).to_le_bytes(), &[2]]))]);
        // Two key columns: each value's bytes in key order.
        let two = RecordBatch::try_from_iter(vec![
            ("a", Arc::new(Int32Array::from(vec![7])) as ArrayRef),
            ("b", Arc::new(StringArray::from(vec!["x"])) as ArrayRef),
        ])
        .unwrap();
        let want = bytes(&[b"i", &7i64.to_le_bytes(), b"s", &1u64.to_le_bytes(), b"x"]);
        assert_eq!(key_hash(&two, &["a".to_string(), "b".to_string()]).unwrap(), vec![Some(want)]);
    }

    #[test]
    fn a_widened_or_reencoded_key_column_keeps_its_hashes() {
        use arrow_array::*;
        let ints = hashes(Arc::new(Int64Array::from(vec![0, 5, 100, -3])));
        assert_eq!(hashes(Arc::new(Int8Array::from(vec![0, 5, 100, -3]))), ints);
        assert_eq!(hashes(Arc::new(Int16Array::from(vec![0, 5, 100, -3]))), ints);
        assert_eq!(hashes(Arc::new(Int32Array::from(vec![0, 5, 100, -3]))), ints);
        let unsigned = hashes(Arc::new(UInt64Array::from(vec![0, 5, 100])));
        assert_eq!(&unsigned[..], &ints[..3]);
        assert_eq!(hashes(Arc::new(UInt8Array::from(vec![0, 5, 100]))), unsigned);
        assert_eq!(hashes(Arc::new(UInt16Array::from(vec![0, 5, 100]))), unsigned);
        assert_eq!(hashes(Arc::new(UInt32Array::from(vec![0, 5, 100]))), unsigned);
        let strings = hashes(Arc::new(StringArray::from(vec!["a", "é", ""])));
        assert_eq!(hashes(Arc::new(LargeStringArray::from(vec!["a", "é", ""]))), strings);
        assert_eq!(hashes(Arc::new(StringViewArray::from(vec!["a", "é", ""]))), strings);
        let dict: DictionaryArray<types::Int32Type> = vec!["a", "é", ""].into_iter().collect();
        assert_eq!(hashes(Arc::new(dict)), strings);
        let dates = hashes(Arc::new(Date32Array::from(vec![0, 19_000, -1])));
        let ms = |d: i64| d * 86_400_000;
        assert_eq!(hashes(Arc::new(Date64Array::from(vec![ms(0), ms(19_000) + 5, ms(-1)]))), dates);
        // The same instants in every unit and zone.
        let micros = vec![1_700_000_000_000_000i64, -1_000_000];
        let ts = hashes(Arc::new(TimestampMicrosecondArray::from(micros.clone())));
        assert_eq!(hashes(Arc::new(TimestampSecondArray::from(vec![1_700_000_000, -1]))), ts);
        assert_eq!(hashes(Arc::new(TimestampMillisecondArray::from(vec![1_700_000_000_000, -1_000]))), ts);
        let nanos: Vec<i64> = micros.iter().map(|m| m * 1_000 + 999).collect();
        assert_eq!(hashes(Arc::new(TimestampNanosecondArray::from(nanos))), ts, "nanoseconds floored");
        let zoned = TimestampMicrosecondArray::from(micros).with_timezone("+05:30");
        assert_eq!(hashes(Arc::new(zoned)), ts);
        let d128 = hashes(Arc::new(Decimal128Array::from(vec![150, -7]).with_precision_and_scale(20, 2).unwrap()));
        type I256 = <types::Decimal256Type as ArrowPrimitiveType>::Native;
        let d256 = Decimal256Array::from(vec![I256::from_i128(150), I256::from_i128(-7)])
            .with_precision_and_scale(40, 2)
            .unwrap();
        assert_eq!(hashes(Arc::new(d256)), d128);
        let d64 = Decimal64Array::from(vec![150, -7]).with_precision_and_scale(12, 2).unwrap();
        assert_eq!(hashes(Arc::new(d64)), d128);
        // The scale is part of the value: 1.50 (scale 2) is not 15.0 (scale 1).
        let scale1 = hashes(Arc::new(Decimal128Array::from(vec![150, -7]).with_precision_and_scale(20, 1).unwrap()));
        assert_ne!(scale1, d128);
        // Nulls have no hash.
        assert_eq!(hashes(Arc::new(Int64Array::from(vec![None, Some(1)])))[0], None);
    }

    #[test]
    fn float_and_other_untyped_keys_are_refused_naming_the_column() {
        use arrow_array::{Float32Array, Float64Array};
        for col in [Arc::new(Float64Array::from(vec![0.0])) as ArrayRef, Arc::new(Float32Array::from(vec![-0.0]))] {
            let e = key_hash(&one("price", col), &["price".to_string()]).unwrap_err().to_string();
            assert!(e.contains("key column `price` (source.key)") && e.contains("floating-point"), "{e}");
        }
        assert!(check_key_type(&DataType::Float16).is_err());
        let e = check_key_type(&DataType::List(Arc::new(Field::new("item", DataType::Int64, true)))).unwrap_err();
        assert!(e.contains("no key type"), "{e}");
        assert!(check_key_type(&DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8))).is_ok());
        // apply refuses a float key too, rather than route by it.
        let b = RecordBatch::try_from_iter(vec![
            ("id", Arc::new(Float64Array::from(vec![1.0])) as ArrayRef),
            ("op", Arc::new(StringArray::from(vec!["u"])) as ArrayRef),
        ])
        .unwrap();
        assert!(spec().apply(&b, |_| (0, 0), None).unwrap_err().to_string().contains("key column `id`"));
    }

    #[test]
    fn a_column_named_like_a_reserved_one_is_refused() {
        let b = RecordBatch::try_from_iter(vec![("id", Arc::new(Int64Array::from(vec![1])) as ArrayRef)]).unwrap();
        let b = RecordBatch::try_from_iter(vec![
            ("id", b.column(0).clone()),
            (OP, Arc::new(UInt8Array::from(vec![0])) as ArrayRef),
        ])
        .unwrap();
        let e = spec().apply(&b, |_| (0, 0), None).unwrap_err().to_string();
        assert!(e.contains("_sluice_op"), "{e}");
    }
}
