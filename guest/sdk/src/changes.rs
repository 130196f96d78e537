//! Change streams, the plugin side: the reserved option that names the key
//! columns, and the three columns a change-stream batch carries after the
//! table's own (the host side is `sluice_core::changes`; the contract page
//! has the rules).
//!
//! Invariants:
//! - a plugin declares [`KEY_OPTION`] in `describe()` to be given change
//!   streams at all; the host refuses, before writing, a change stream for
//!   a plugin that does not;
//! - [`split`] hands back the table's rows without the reserved columns, and
//!   refuses a batch whose reserved columns are missing, misplaced, of the
//!   wrong type, null, or hold an operation other than 0 and 1.

use crate::SinkError;
use arrow_array::cast::AsArray;
use arrow_array::types::{UInt8Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use arrow_schema::DataType;

/// The reserved option naming the key columns, a JSON array of names.
pub const KEY_OPTION: &str = "sluice.key";
/// The operation column: 0 upsert, 1 delete.
pub const OP: &str = "_sluice_op";
/// The source position's major part.
pub const SEQ_HI: &str = "_sluice_seq_hi";
/// The source position's minor part.
pub const SEQ_LO: &str = "_sluice_seq_lo";

/// `_sluice_op` of an insert or update.
pub const UPSERT: u8 = 0;
/// `_sluice_op` of a delete.
pub const DELETE: u8 = 1;

/// The option spec a plugin lists in `describe()` to take change streams.
pub fn key_option_spec() -> crate::OptionSpec {
    crate::option_spec(
        KEY_OPTION,
        "set by the host, not the job file: the change stream's key columns ([source] key), a JSON array",
        false,
        None,
    )
}

/// Reads the key columns from the value of [`KEY_OPTION`].
pub fn parse_key(value: &str) -> Result<Vec<String>, SinkError> {
    let key: Vec<String> = serde_json::from_str(value)
        .map_err(|e| SinkError::Config(format!("option `{KEY_OPTION}` is not a JSON array of column names: {e}")))?;
    if key.is_empty() || key.iter().any(|k| k.is_empty()) {
        return Err(SinkError::Config(format!("option `{KEY_OPTION}` names no key column: {value}")));
    }
    Ok(key)
}

/// One change-stream batch taken apart.
#[derive(Debug, Clone)]
pub struct Changes {
    /// The table's rows, in the table's schema (no reserved column).
    pub rows: RecordBatch,
    /// Per row: [`UPSERT`] or [`DELETE`].
    pub ops: Vec<u8>,
    /// Per row: the source position `(hi, lo)`.
    pub seqs: Vec<(u64, u64)>,
}

fn bad(what: impl std::fmt::Display) -> SinkError {
    SinkError::InvalidData(format!("change-stream batch: {what}"))
}

/// Splits a change-stream batch into rows, operations and positions.
pub fn split(batch: &RecordBatch) -> Result<Changes, SinkError> {
    let n = batch.num_columns();
    if n < 4 {
        return Err(bad(format!("{n} columns; expected the table's columns, then {OP}, {SEQ_HI}, {SEQ_LO}")));
    }
    let schema = batch.schema();
    for (i, (name, ty)) in
        [(OP, DataType::UInt8), (SEQ_HI, DataType::UInt64), (SEQ_LO, DataType::UInt64)].into_iter().enumerate()
    {
        let field = schema.field(n - 3 + i);
        if field.name() != name || field.data_type() != &ty {
            return Err(bad(format!(
                "column {} is `{}` ({}); expected `{name}` ({ty})",
                n - 3 + i,
                field.name(),
                field.data_type()
            )));
        }
        if batch.column(n - 3 + i).null_count() > 0 {
            return Err(bad(format!("`{name}` holds nulls")));
        }
    }
    if let Some(f) = schema.fields().iter().take(n - 3).find(|f| [OP, SEQ_HI, SEQ_LO].contains(&f.name().as_str())) {
        return Err(bad(format!("`{}` appears among the table's columns", f.name())));
    }
    let ops: Vec<u8> = batch.column(n - 3).as_primitive::<UInt8Type>().values().to_vec();
    if let Some(op) = ops.iter().find(|o| **o > DELETE) {
        return Err(bad(format!("`{OP}` holds {op}; only 0 (upsert) and 1 (delete) are defined")));
    }
    let hi = batch.column(n - 2).as_primitive::<UInt64Type>().values();
    let lo = batch.column(n - 1).as_primitive::<UInt64Type>().values();
    let seqs = hi.iter().copied().zip(lo.iter().copied()).collect();
    let rows = batch.project(&(0..n - 3).collect::<Vec<_>>()).map_err(bad)?;
    Ok(Changes { rows, ops, seqs })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, UInt8Array, UInt64Array};
    use arrow_schema::{Field, Schema};
    use std::sync::Arc;

    fn batch(op_type: DataType, ops: Vec<u8>) -> RecordBatch {
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new(OP, op_type, false),
            Field::new(SEQ_HI, DataType::UInt64, false),
            Field::new(SEQ_LO, DataType::UInt64, false),
        ]);
        let n = ops.len();
        RecordBatch::try_new(
            Arc::new(schema),
            vec![
                Arc::new(Int64Array::from_iter_values(0..n as i64)),
                Arc::new(UInt8Array::from(ops)),
                Arc::new(UInt64Array::from(vec![7; n])),
                Arc::new(UInt64Array::from_iter_values(1..=n as u64)),
            ],
        )
        .unwrap()
    }

    #[test]
    fn a_change_batch_splits_into_rows_ops_and_positions() {
        let c = split(&batch(DataType::UInt8, vec![0, 1, 0])).unwrap();
        assert_eq!(c.rows.num_columns(), 1);
        assert_eq!(c.rows.schema().field(0).name(), "id");
        assert_eq!(c.ops, vec![0, 1, 0]);
        assert_eq!(c.seqs, vec![(7, 1), (7, 2), (7, 3)]);
    }

    #[test]
    fn a_malformed_change_batch_is_refused_by_name() {
        let e = split(&batch(DataType::UInt8, vec![0, 2])).unwrap_err();
        assert!(format!("{e:?}").contains("holds 2"), "{e:?}");
        let plain = batch(DataType::UInt8, vec![0]).project(&[0]).unwrap();
        assert!(format!("{:?}", split(&plain).unwrap_err()).contains("1 columns"));
        assert_eq!(parse_key(r#"["id","day"]"#).unwrap(), vec!["id", "day"]);
        assert!(parse_key("[]").is_err() && parse_key("id").is_err());
    }
}
