//! `mode = "upsert"`: a change stream lands through BigQuery's change data
//! capture ("Stream table updates with change data capture",
//! https://cloud.google.com/bigquery/docs/change-data-capture).
//!
//! - The table has a primary key (`PRIMARY KEY (...) NOT ENFORCED`, in the
//!   table resource `tableConstraints.primaryKey.columns`) equal to the
//!   change key (`sluice.key`, from `[source] key`); a table the sink
//!   creates gets it, and `max_staleness` when the job sets it. An existing
//!   table without a primary key, or with another, is refused before
//!   anything is written, naming the table, its key and the job's.
//! - Every change goes through the table's **default stream**
//!   (`.../streams/_default`; CDC takes no other stream) as protobuf rows
//!   (CDC takes no Arrow) carrying the pseudo-columns `_CHANGE_TYPE`
//!   (`UPSERT` or `DELETE`, from `_sluice_op`) and `_CHANGE_SEQUENCE_NUMBER`
//!   = `format!("{incarnation:X}/{hi:X}/{lo:X}")`: when the job's
//!   incarnation began (ms, reserved option `sluice.incarnation-created-ms`),
//!   then the batch's source position (`_sluice_seq_hi`, `_sluice_seq_lo`).
//!   BigQuery compares the numbers section by section and ignores a change
//!   lower than the one it applied for the key, so a change sent again
//!   within the incarnation (a lost reply, a replay after a crash) changes
//!   nothing: **effectively once**. The incarnation comes first because
//!   source positions start again in a new incarnation (a fresh state
//!   directory over a new folder whose first file is ordinal 0): without
//!   it, the new incarnation's changes would number lower than the old
//!   one's and BigQuery would silently ignore them. A rerun over the same
//!   input applies its changes again, in order, and ends where the first
//!   run ended.
//!
//! WHEN the writer sends: at `write`, as the batches come, not held until
//! `prepare-commit`. The default stream applies a change as soon as it is
//! acknowledged and has no flush or commit step, so holding changes back
//! would not make a checkpoint atomic (a crash between two appends of one
//! prepare shows part of it either way); it would only cost memory for a
//! whole checkpoint of rows. What makes replays harmless is the sequence
//! number, not the timing. `prepare-commit` waits until every change sent
//! is acknowledged, so once the engine persists checkpoint `c` (and moves
//! the source past it), every change before it is applied.
//!
//! WHAT the commit records: nothing in BigQuery. Its part of the commit info
//! only names, per table, how many changes the checkpoint sent and the last
//! sequence number (for `sluice state`); the committer takes the dataset's
//! claim, as append mode does (so a second incarnation stops at its first
//! commit, although its changes, the same changes with the same numbers,
//! would be harmless), and notes in its state that this incarnation
//! upserts, so a switch to another mode is refused both ways. A lost reply
//! or an unknown outcome of an AppendRows is simply sent again (see
//! [`crate::writer`]); it never counts as "not done" for anything else.
//!
//! Tables the sink creates have the key columns as the rows declare them
//! and every other column NULLABLE: a DELETE row carries the key and often
//! nulls elsewhere.

use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema,
    table_field_schema::{Mode, Type},
};
use sluice_bigquery_rows::evolve;
use sluice_guest_sdk::changes::{self, Changes};
use sluice_guest_sdk::{SinkError, error, log};

use crate::config::Config;
use crate::rest::{RestError, Tables};

/// The pseudo-column naming the kind of change.
pub(crate) const CHANGE_TYPE: &str = "_CHANGE_TYPE";
/// The pseudo-column ordering the changes of one key.
pub(crate) const CHANGE_SEQUENCE_NUMBER: &str = "_CHANGE_SEQUENCE_NUMBER";

/// BigQuery's sequence number of the change at source position `(hi, lo)`:
/// two hexadecimal sections, compared in order as BigQuery does, so it
/// orders exactly as `(hi, lo)` does.
pub(crate) fn sequence_number(incarnation_ms: u64, hi: u64, lo: u64) -> String {
    format!("{incarnation_ms:X}/{hi:X}/{lo:X}")
}

fn key_text(key: &[String]) -> String {
    format!("[{}]", key.join(", "))
}

fn tables(cfg: &Config) -> Tables<'_> {
    crate::tables::api(cfg)
}

fn rest_failed(path: &str, e: RestError) -> SinkError {
    match e {
        RestError::Denied(m) => error::config(format!(
            "reading table {path}: {m}; mode = \"upsert\" reads and creates the table's primary key through the \
             BigQuery API (option `rest_endpoint`), so grant it"
        )),
        e if e.is_transient() => error::retryable(format!("reading table {path}: {e}")),
        e => error::config(format!("reading table {path}: {e}")),
    }
}

/// Refuses rows whose schema lacks a key column.
pub(crate) fn check_columns(path: &str, arrow: &Schema, key: &[String]) -> Result<(), SinkError> {
    for k in key {
        if arrow.field_with_name(k).is_err() {
            return Err(error::config(format!(
                "table {path}: the change key column `{k}` ([source] key = {}) is not among the rows' columns",
                key_text(key)
            )));
        }
    }
    Ok(())
}

/// Checks, without writing, that `path` (if it exists) has `key` as its
/// primary key. `Ok(false)`: the table does not exist.
pub(crate) fn check_key(cfg: &Config, path: &str, key: &[String]) -> Result<bool, SinkError> {
    let Some(table) = tables(cfg).get(path).map_err(|e| rest_failed(path, e))? else { return Ok(false) };
    if table.primary_key != key {
        let has = if table.primary_key.is_empty() {
            "has no primary key".to_string()
        } else {
            format!("has the primary key {}", key_text(&table.primary_key))
        };
        return Err(error::config(format!(
            "table {path} {has}, but the job's change key is {} ([source] key): with mode = \"upsert\" BigQuery \
             applies each change to the row of the table's primary key, so they must be the same; nothing was \
             written. Land the changes in a table with PRIMARY KEY ({}) NOT ENFORCED (`ALTER TABLE ... ADD \
             PRIMARY KEY (...) NOT ENFORCED`), or a new one the sink creates",
            key_text(key),
            key.join(", ")
        )));
    }
    if let Some(wanted) = &cfg.max_staleness
        && table.max_staleness.as_deref() != Some(wanted.as_str())
    {
        log::warn(&format!(
            "table {path} exists with maxStaleness {:?}; [sink.options] max_staleness ({wanted}) applies only to \
             tables the sink creates, so it is left as it is",
            table.max_staleness
        ));
    }
    Ok(true)
}

/// The schema a table the sink creates gets: the rows' columns, the key
/// columns as the rows declare them and every other one NULLABLE.
fn creation_schema(path: &str, arrow: &Schema, key: &[String]) -> Result<TableSchema, SinkError> {
    let mut schema = evolve::creation_schema(arrow).map_err(|e| error::config(format!("{path}: {e}")))?;
    for f in &mut schema.fields {
        if f.mode == Mode::Required as i32 && !key.iter().any(|k| k == &f.name) {
            f.mode = Mode::Nullable as i32;
        }
    }
    Ok(schema)
}

/// Checks that `path` can be created for rows of `arrow` (without creating it).
pub(crate) fn check_creation(path: &str, arrow: &Schema, key: &[String]) -> Result<(), SinkError> {
    creation_schema(path, arrow, key).map(|_| ())
}

/// Creates `path` with the primary key `key` (and `max_staleness`);
/// `Ok(false)` when it existed already (someone else created it first).
pub(crate) fn create(cfg: &Config, path: &str, arrow: &Schema, key: &[String], why: &str) -> Result<bool, SinkError> {
    let schema = creation_schema(path, arrow, key)?;
    let fields = evolve::to_rest_fields(&schema);
    let context = format!("table {path} does not exist ({why}); creating it with PRIMARY KEY {}", key_text(key));
    // An insert that landed with its reply lost answers 409 the next time.
    let created = cfg
        .retry()
        .run(
            |_| tables(cfg).insert_keyed(path, &fields, key, cfg.max_staleness.as_deref()),
            RestError::is_transient,
            |e, _, _| log::warn(&format!("{context}: {e}; retrying")),
        )
        .map_err(|failed| match failed.error {
            RestError::Denied(m) => error::config(format!("{context}: {m}")),
            e if e.is_transient() => error::retryable(format!("{context}: {e}")),
            e => error::fatal(format!("{context}: {e}")),
        })?;
    if created {
        log::info(&format!("created table {path} with PRIMARY KEY {} NOT ENFORCED", key_text(key)));
    }
    Ok(created)
}

/// The rows' schema with the two pseudo-columns after the table's own.
pub(crate) fn change_schema(arrow: &Schema) -> Arc<Schema> {
    let mut fields: Vec<Field> = arrow.fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new(CHANGE_TYPE, DataType::Utf8, false));
    fields.push(Field::new(CHANGE_SEQUENCE_NUMBER, DataType::Utf8, false));
    Arc::new(Schema::new_with_metadata(fields, arrow.metadata().clone()))
}

/// The table's schema with the two pseudo-columns, which a CDC writer
/// schema carries beside the table's columns.
pub(crate) fn change_table_schema(table: &TableSchema) -> TableSchema {
    let mut fields = table.fields.clone();
    for name in [CHANGE_TYPE, CHANGE_SEQUENCE_NUMBER] {
        fields.push(TableFieldSchema {
            name: name.to_string(),
            r#type: Type::String as i32,
            mode: Mode::Nullable as i32,
            ..Default::default()
        });
    }
    TableSchema { fields }
}

/// A change-stream batch as the rows CDC takes: the table's columns, then
/// `_CHANGE_TYPE` and `_CHANGE_SEQUENCE_NUMBER`. Returns the last sequence
/// number too.
pub(crate) fn change_rows(
    batch: &RecordBatch,
    incarnation_ms: u64,
) -> Result<(RecordBatch, Option<String>), SinkError> {
    let Changes { rows, ops, seqs } = changes::split(batch)?;
    let kinds: StringArray =
        ops.iter().map(|op| Some(if *op == changes::DELETE { "DELETE" } else { "UPSERT" })).collect();
    let numbers: StringArray = seqs.iter().map(|(hi, lo)| Some(sequence_number(incarnation_ms, *hi, *lo))).collect();
    let last = seqs.last().map(|(hi, lo)| sequence_number(incarnation_ms, *hi, *lo));
    let mut columns: Vec<ArrayRef> = rows.columns().to_vec();
    columns.push(Arc::new(kinds));
    columns.push(Arc::new(numbers));
    let out = RecordBatch::try_new(change_schema(&rows.schema()), columns)
        .map_err(|e| error::invalid_data(format!("change-stream batch does not match the table's columns: {e}")))?;
    Ok((out, last))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, UInt8Array, UInt64Array};

    #[test]
    fn sequence_numbers_order_as_source_positions_do() {
        assert_eq!(sequence_number(0, 0, 10), "0/0/A");
        assert_eq!(sequence_number(0x19A, 0x1F, 0xABC), "19A/1F/ABC");
        // Section by section, as numbers: (1, 0) after (0, u64::MAX), and a
        // later incarnation after every position of an earlier one.
        assert_eq!(sequence_number(5, 0, u64::MAX), "5/0/FFFFFFFFFFFFFFFF");
        assert_eq!(sequence_number(5, 1, 0), "5/1/0");
        assert_eq!(sequence_number(6, 0, 0), "6/0/0");
    }

    #[test]
    fn a_change_batch_becomes_cdc_rows() {
        let batch = RecordBatch::try_new(
            Arc::new(Schema::new(vec![
                Field::new("id", DataType::Int64, false),
                Field::new(changes::OP, DataType::UInt8, false),
                Field::new(changes::SEQ_HI, DataType::UInt64, false),
                Field::new(changes::SEQ_LO, DataType::UInt64, false),
            ])),
            vec![
                Arc::new(Int64Array::from(vec![1, 2])),
                Arc::new(UInt8Array::from(vec![0, 1])),
                Arc::new(UInt64Array::from(vec![2, 2])),
                Arc::new(UInt64Array::from(vec![9, 10])),
            ],
        )
        .unwrap();
        let (rows, last) = change_rows(&batch, 0x10).unwrap();
        assert_eq!(rows.num_columns(), 3);
        let kinds = rows.column(1).as_any().downcast_ref::<StringArray>().unwrap();
        assert_eq!((kinds.value(0), kinds.value(1)), ("UPSERT", "DELETE"));
        let numbers = rows.column(2).as_any().downcast_ref::<StringArray>().unwrap();
        assert_eq!((numbers.value(0), numbers.value(1)), ("10/2/9", "10/2/A"));
        assert_eq!(last.as_deref(), Some("10/2/A"));
    }
}
