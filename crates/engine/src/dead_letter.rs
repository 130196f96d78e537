//! Dead letters: source records that did not convert to their table's
//! types (`job.bad_rows = "dead-letter"`), as rows of the dead-letter table.
//!
//! Invariants:
//! - a dead letter is written by the subtask that read its record, in the
//!   same round as the good rows of the same stretch of the source, so it
//!   belongs to the same checkpoint and is committed through the same
//!   persist-before-commit protocol: a crash anywhere leaves it either
//!   committed once with that checkpoint or not at all, and a resume from
//!   the checkpoint's positions reads it again only if it was not;
//! - its columns are fixed ([`schema`]); the table is never evolved;
//! - the table may not be one of the source's.

use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};

use crate::source::BadRow;

/// The dead-letter table's columns.
pub fn schema() -> SchemaRef {
    let text = |name: &str| Field::new(name, DataType::Utf8, false);
    Arc::new(Schema::new(vec![
        // The record as the source read it.
        text("raw"),
        // The file and the line.
        text("source_position"),
        // Why it did not convert: the column, the value, the type.
        text("reason"),
        // The table it was meant for (`""` for a single-table source).
        text("target_table"),
        text("job"),
        text("incarnation"),
        Field::new("checkpoint", DataType::Int64, false),
    ]))
}

/// Who writes the dead letters of one subtask.
#[derive(Debug, Clone)]
pub struct Letterhead {
    pub job: String,
    pub incarnation: String,
}

/// The dead letters of `bad` (records of `table`) in checkpoint `c`.
pub fn batch(bad: &[BadRow], table: &str, from: &Letterhead, c: u64) -> Result<RecordBatch, ArrowError> {
    let n = bad.len();
    let column =
        |f: &dyn Fn(&BadRow) -> &str| -> ArrayRef { Arc::new(bad.iter().map(|b| Some(f(b))).collect::<StringArray>()) };
    let same = |v: &str| -> ArrayRef { Arc::new(StringArray::from(vec![v; n])) };
    let checkpoint = i64::try_from(c).map_err(|_| ArrowError::InvalidArgumentError(format!("checkpoint {c}")))?;
    RecordBatch::try_new(
        schema(),
        vec![
            column(&|b| &b.raw),
            column(&|b| &b.position),
            column(&|b| &b.reason),
            same(table),
            same(&from.job),
            same(&from.incarnation),
            Arc::new(Int64Array::from(vec![checkpoint; n])),
        ],
    )
}

/// A few bad rows, for a message.
pub fn sample(bad: &[(String, BadRow)]) -> String {
    bad.iter()
        .take(3)
        .map(|(table, b)| {
            let raw: String = b.raw.chars().take(80).collect();
            let table = if table.is_empty() { String::new() } else { format!("table {table:?}, ") };
            format!("{table}{}: {} (record: {raw:?})", b.position, b.reason)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_holds_the_record_where_and_why_and_whose() {
        let bad = vec![BadRow { raw: "1,x7".into(), position: "a.csv line 2".into(), reason: "no".into() }];
        let from = Letterhead { job: "j".into(), incarnation: "inc".into() };
        let b = batch(&bad, "orders", &from, 4).expect("batch");
        assert_eq!(b.num_rows(), 1);
        let col = |i: usize| b.column(i).as_any().downcast_ref::<StringArray>().map(|a| a.value(0).to_string());
        assert_eq!(col(0).as_deref(), Some("1,x7"));
        assert_eq!(col(1).as_deref(), Some("a.csv line 2"));
        assert_eq!(col(3).as_deref(), Some("orders"));
        assert_eq!(col(5).as_deref(), Some("inc"));
        let c = b.column(6).as_any().downcast_ref::<Int64Array>().map(|a| a.value(0));
        assert_eq!(c, Some(4));
    }
}
