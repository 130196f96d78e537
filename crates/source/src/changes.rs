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
//! - the key's hash ([`key_hash`]) depends on the key's values as text, not
//!   on their Arrow types, so a column widened between files (Int32 to
//!   Int64, Utf8 to LargeUtf8) keeps every key on its subtask.

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

/// The key columns of `batch` as text (`None` for a column the batch lacks).
fn key_text(batch: &RecordBatch, key: &[String]) -> Result<Vec<Option<ArrayRef>>, ArrowError> {
    key.iter()
        .map(|name| match batch.column_by_name(name) {
            Some(col) => arrow_cast::cast(col, &DataType::Utf8).map(Some),
            None => Ok(None),
        })
        .collect()
}

/// The hash of row `row`'s key, from the key columns as text
/// ([`key_text`]): each value as its length (8 bytes, little-endian) and
/// its UTF-8 bytes, in key order. `None` when a key column is missing or
/// null there.
fn hash_of(text: &[Option<ArrayRef>], row: usize) -> Option<u64> {
    let mut bytes = Vec::new();
    for col in text {
        let col = col.as_ref()?.as_any().downcast_ref::<StringArray>()?;
        if col.is_null(row) {
            return None;
        }
        let v = col.value(row).as_bytes();
        bytes.extend_from_slice(&(v.len() as u64).to_le_bytes());
        bytes.extend_from_slice(v);
    }
    Some(fnv1a64(bytes))
}

/// The key hash of every row of `batch` (`None` where the key is missing or
/// null).
pub fn key_hash(batch: &RecordBatch, key: &[String]) -> Result<Vec<Option<u64>>, ArrowError> {
    let text = key_text(batch, key)?;
    Ok((0..batch.num_rows()).map(|row| hash_of(&text, row)).collect())
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
        let text = key_text(batch, &self.key)?;
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
            let Some(hash) = hash_of(&text, row) else {
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
        "its key did not read as text".to_string()
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
