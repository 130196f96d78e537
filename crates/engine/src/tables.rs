//! The tables of a run and their schemas: what a batch needs before it can
//! be written, and the changes the engine carries to the sink at a barrier.
//!
//! Invariants:
//! - every batch handed to a writer has exactly its table's current schema
//!   (a batch of an older, narrower shape is conformed: missing nullable
//!   columns become null, narrower types are cast up);
//! - a batch that needs a table the writers do not know, or a wider schema,
//!   is never written before the sink evolved the target: it ends the round
//!   (a barrier) and waits for the change to be applied;
//! - the only changes are the compatible ones: a nullable column added, a
//!   type widened (Int8 → … → Int64, Float16 → Float32 → Float64, a decimal's
//!   precision up at the same scale), a required column made nullable. A
//!   source that drops a column or narrows a type compared with what it sent
//!   before is refused, naming the table and the column, and nothing of that
//!   shape is written.
//! - a change stream's reserved columns (`sluice_core::changes`: `_sluice_op`,
//!   `_sluice_seq_hi`, `_sluice_seq_lo`) are no table's columns: [`fit`]
//!   judges a batch by its other columns, so no schema here (a table's, a
//!   change's, what a reader sent) carries them, and [`conform`] keeps them
//!   last, as the batch had them.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions, new_null_array};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use thiserror::Error;

use super::checkpoint::{Blob, TableRecord};
use crate::ipc;
use crate::plugin::{ChangeKind, SourceTable, TableChange};
use crate::source::changes::without_change_columns;
use sluice_core::changes::is_change_column;

/// A schema change the source asks for, refused.
#[derive(Debug, Clone, Error, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[error(
    "table {table:?}: {message}; nothing of the new shape was written, and the job stops here until the source or the target is fixed"
)]
pub struct SchemaRefusal {
    pub table: String,
    pub message: String,
}

/// A change met by a subtask: a table the writers do not know yet, or a
/// table's schema widened.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub kind: ChangeKind,
    pub table: String,
    /// The table's schema after the change.
    pub schema: SchemaRef,
}

/// What a batch needs before it is written.
#[derive(Debug)]
pub enum Fit {
    /// It has the table's schema.
    AsIs,
    /// It fits the table's schema once conformed to it.
    Conform(SchemaRef),
    /// The target must change first.
    Barrier(Change),
}

/// Whether two schemas have the same columns (names, types, nullability),
/// whatever their metadata.
pub fn same_shape(a: &Schema, b: &Schema) -> bool {
    a.fields().len() == b.fields().len()
        && a.fields()
            .iter()
            .zip(b.fields())
            .all(|(x, y)| x.name() == y.name() && x.data_type() == y.data_type() && x.is_nullable() == y.is_nullable())
}

/// Whether every value of type `from` is a value of type `to` without loss,
/// by a widening Iceberg and BigQuery can take in place.
pub fn widens(from: &DataType, to: &DataType) -> bool {
    use DataType::*;
    match (from, to) {
        (Int8, Int16 | Int32 | Int64) | (Int16, Int32 | Int64) | (Int32, Int64) => true,
        (UInt8, UInt16 | UInt32 | Int16 | Int32 | Int64) | (UInt16, UInt32 | Int32 | Int64) | (UInt32, Int64) => true,
        (Float16, Float32 | Float64) | (Float32, Float64) => true,
        (Decimal128(p1, s1), Decimal128(p2, s2)) | (Decimal128(p1, s1), Decimal256(p2, s2)) => s1 == s2 && p1 < p2,
        (Decimal256(p1, s1), Decimal256(p2, s2)) => s1 == s2 && p1 < p2,
        _ => false,
    }
}

fn refusal(table: &str, message: String) -> SchemaRefusal {
    SchemaRefusal { table: table.to_string(), message }
}

/// Checks that `to` is a compatible evolution of `from`, the shape the same
/// reader sent before: no column dropped, no type narrowed or changed, new
/// columns nullable.
pub fn check_evolution(table: &str, from: &Schema, to: &Schema) -> Result<(), SchemaRefusal> {
    for old in from.fields() {
        let Ok(new) = to.field_with_name(old.name()) else {
            return Err(refusal(table, format!("the source dropped column `{}`", old.name())));
        };
        if new.data_type() != old.data_type() && !widens(old.data_type(), new.data_type()) {
            let how = if widens(new.data_type(), old.data_type()) { "narrows" } else { "changes" };
            return Err(refusal(
                table,
                format!("the source {how} column `{}` from {} to {}", old.name(), old.data_type(), new.data_type()),
            ));
        }
    }
    for new in to.fields() {
        if from.field_with_name(new.name()).is_err() && !new.is_nullable() {
            return Err(refusal(
                table,
                format!("the source adds column `{}` as required; only nullable columns can be added", new.name()),
            ));
        }
    }
    Ok(())
}

/// The schema a table with schema `current` must evolve to so that rows of
/// `incoming` fit it, or `None` when they fit it already (possibly after
/// conforming). Columns keep `current`'s order; new ones come last.
pub fn merge(table: &str, current: &Schema, incoming: &Schema) -> Result<Option<SchemaRef>, SchemaRefusal> {
    let mut fields: Vec<Field> = current.fields().iter().map(|f| f.as_ref().clone()).collect();
    for field in incoming.fields() {
        match fields.iter_mut().find(|f| f.name() == field.name()) {
            Some(f) => {
                let (have, want) = (f.data_type().clone(), field.data_type());
                if &have != want {
                    if widens(&have, want) {
                        *f = f.clone().with_data_type(want.clone());
                    } else if !widens(want, &have) {
                        return Err(refusal(
                            table,
                            format!("column `{}` is {have} in the table but {want} in the rows", field.name()),
                        ));
                    }
                }
                if field.is_nullable() && !f.is_nullable() {
                    *f = f.clone().with_nullable(true);
                }
            }
            None if field.is_nullable() => fields.push(field.as_ref().clone()),
            None => {
                return Err(refusal(
                    table,
                    format!("the rows add column `{}` as required; only nullable columns can be added", field.name()),
                ));
            }
        }
    }
    for f in current.fields() {
        if !f.is_nullable() && incoming.field_with_name(f.name()).is_err() {
            return Err(refusal(table, format!("the rows lack the table's required column `{}`", f.name())));
        }
    }
    let merged = Schema::new(fields);
    Ok((!same_shape(&merged, current)).then(|| Arc::new(merged)))
}

/// What a batch of `table` with schema `incoming` needs. `current`: the
/// table's schema, if the writers know the table; `seen`: the shape this
/// reader sent for the table before, if any.
pub fn fit(
    table: &str,
    current: Option<&SchemaRef>,
    seen: Option<&SchemaRef>,
    incoming: &SchemaRef,
) -> Result<Fit, SchemaRefusal> {
    let incoming = &without_change_columns(incoming);
    let seen = seen.map(without_change_columns);
    if let Some(seen) = &seen
        && !same_shape(seen, incoming)
    {
        check_evolution(table, seen, incoming)?;
    }
    let Some(current) = current else {
        return Ok(Fit::Barrier(Change {
            kind: ChangeKind::NewTable,
            table: table.to_string(),
            schema: incoming.clone(),
        }));
    };
    if same_shape(current, incoming) {
        return Ok(Fit::AsIs);
    }
    Ok(match merge(table, current, incoming)? {
        None => Fit::Conform(current.clone()),
        Some(schema) => Fit::Barrier(Change { kind: ChangeKind::Evolved, table: table.to_string(), schema }),
    })
}

/// `batch` with exactly the columns of `target`: cast up where narrower,
/// null where missing; a change batch's reserved columns stay, last.
pub fn conform(batch: &RecordBatch, target: &SchemaRef) -> Result<RecordBatch, ArrowError> {
    let reserved: Vec<usize> = batch
        .schema()
        .fields()
        .iter()
        .enumerate()
        .filter(|(_, f)| is_change_column(f.name()))
        .map(|(i, _)| i)
        .collect();
    let mut columns: Vec<ArrayRef> = target
        .fields()
        .iter()
        .map(|field| match batch.column_by_name(field.name()) {
            Some(col) if col.data_type() == field.data_type() => Ok(col.clone()),
            Some(col) => arrow_cast::cast(col, field.data_type()),
            None => Ok(new_null_array(field.data_type(), batch.num_rows())),
        })
        .collect::<Result<_, _>>()?;
    if reserved.is_empty() {
        return RecordBatch::try_new(target.clone(), columns);
    }
    let mut fields: Vec<Field> = target.fields().iter().map(|f| f.as_ref().clone()).collect();
    for i in reserved {
        fields.push(batch.schema().field(i).clone());
        columns.push(batch.column(i).clone());
    }
    let schema = Arc::new(Schema::new_with_metadata(fields, target.metadata().clone()));
    RecordBatch::try_new_with_options(
        schema,
        columns,
        &RecordBatchOptions::new().with_row_count(Some(batch.num_rows())),
    )
}

/// The changes several subtasks met in one round, one per table: schemas of
/// the same table are merged, and a table new to the writers stays new.
pub fn merge_changes(changes: Vec<Change>) -> Result<Vec<Change>, SchemaRefusal> {
    let mut by_table: BTreeMap<String, Change> = BTreeMap::new();
    for change in changes {
        match by_table.remove(&change.table) {
            None => {
                by_table.insert(change.table.clone(), change);
            }
            Some(mut acc) => {
                if let Some(schema) = merge(&acc.table, &acc.schema, &change.schema)? {
                    acc.schema = schema;
                }
                if change.kind == ChangeKind::NewTable {
                    acc.kind = ChangeKind::NewTable;
                }
                by_table.insert(acc.table.clone(), acc);
            }
        }
    }
    Ok(by_table.into_values().collect())
}

/// The tables the writers know, with their current schemas.
#[derive(Debug, Clone, Default)]
pub struct TableSet {
    tables: BTreeMap<String, SchemaRef>,
}

impl TableSet {
    pub fn new(tables: impl IntoIterator<Item = (String, SchemaRef)>) -> Self {
        Self { tables: tables.into_iter().collect() }
    }

    pub fn from_records(records: &[TableRecord]) -> Result<Self, ArrowError> {
        let mut tables = BTreeMap::new();
        for r in records {
            tables.insert(r.name.clone(), ipc::decode_schema(&r.schema.0)?);
        }
        Ok(Self { tables })
    }

    pub fn records(&self) -> Result<Vec<TableRecord>, ArrowError> {
        self.tables
            .iter()
            .map(|(name, schema)| Ok(TableRecord { name: name.clone(), schema: Blob(ipc::encode_schema(schema)?) }))
            .collect()
    }

    /// The tables as the contract carries them.
    pub fn source_tables(&self) -> Result<Vec<SourceTable>, ArrowError> {
        self.tables
            .iter()
            .map(|(name, schema)| Ok(SourceTable { name: name.clone(), schema: ipc::encode_schema(schema)? }))
            .collect()
    }

    pub fn get(&self, table: &str) -> Option<&SchemaRef> {
        self.tables.get(table)
    }

    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// Whether the set holds named tables (not just the one unnamed table).
    pub fn is_named(&self) -> bool {
        self.tables.keys().any(|t| !t.is_empty())
    }

    pub fn apply(&mut self, changes: &[Change]) {
        for c in changes {
            self.tables.insert(c.table.clone(), c.schema.clone());
        }
    }
}

/// The changes as the contract carries them.
pub fn contract_changes(changes: &[Change]) -> Result<Vec<TableChange>, ArrowError> {
    changes
        .iter()
        .map(|c| {
            Ok(TableChange {
                kind: c.kind,
                table: SourceTable { name: c.table.clone(), schema: ipc::encode_schema(&c.schema)? },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(fields: &[(&str, DataType, bool)]) -> SchemaRef {
        Arc::new(Schema::new(fields.iter().map(|(n, t, null)| Field::new(*n, t.clone(), *null)).collect::<Vec<_>>()))
    }

    #[test]
    fn widening_and_new_nullable_columns_are_a_barrier_then_fit() {
        let base = schema(&[("id", DataType::Int64, false), ("qty", DataType::Int32, false)]);
        let wide =
            schema(&[("id", DataType::Int64, false), ("qty", DataType::Int64, false), ("tag", DataType::Utf8, true)]);
        let Fit::Barrier(change) = fit("t", Some(&base), Some(&base), &wide).expect("allowed") else {
            panic!("a wider shape needs the target changed first")
        };
        assert_eq!(change.kind, ChangeKind::Evolved);
        assert!(same_shape(&change.schema, &wide));
        // Once applied, the old shape from another reader is conformed.
        let Fit::Conform(target) = fit("t", Some(&change.schema), None, &base).expect("fits") else {
            panic!("the old shape fits the evolved table")
        };
        let batch = crate::source::generator::Generator::batch_for(0, 3).project(&[0, 1]).expect("project");
        let conformed = conform(&batch, &target).expect("conforms");
        assert_eq!(conformed.column(1).data_type(), &DataType::Int64);
        assert_eq!(conformed.column(2).null_count(), 3);
    }

    /// A change batch is judged by its table's columns: its reserved columns
    /// make no schema change, reach no table schema, and survive conforming.
    #[test]
    fn the_reserved_columns_of_a_change_batch_are_no_table_columns() {
        use sluice_core::changes::{OP, SEQ_HI, SEQ_LO};
        let table = schema(&[("id", DataType::Int64, false), ("v", DataType::Utf8, true)]);
        let narrow = schema(&[
            ("id", DataType::Int64, false),
            (OP, DataType::UInt8, false),
            (SEQ_HI, DataType::UInt64, false),
            (SEQ_LO, DataType::UInt64, false),
        ]);
        let wide = schema(&[
            ("id", DataType::Int64, false),
            ("v", DataType::Utf8, true),
            (OP, DataType::UInt8, false),
            (SEQ_HI, DataType::UInt64, false),
            (SEQ_LO, DataType::UInt64, false),
        ]);
        assert!(matches!(fit("t", Some(&table), Some(&narrow), &wide), Ok(Fit::AsIs)));
        let Ok(Fit::Barrier(new)) = fit("t", None, None, &wide) else { panic!("a new table") };
        assert!(same_shape(&new.schema, &table), "{:?}", new.schema);
        let Ok(Fit::Conform(target)) = fit("t", Some(&table), None, &narrow) else { panic!("conformed") };
        let batch = RecordBatch::try_new(
            narrow.clone(),
            vec![
                Arc::new(arrow_array::Int64Array::from(vec![1, 2])),
                Arc::new(arrow_array::UInt8Array::from(vec![0, 1])),
                Arc::new(arrow_array::UInt64Array::from(vec![0, 0])),
                Arc::new(arrow_array::UInt64Array::from(vec![3, 4])),
            ],
        )
        .unwrap();
        let conformed = conform(&batch, &target).unwrap();
        assert!(same_shape(&conformed.schema(), &wide), "{:?}", conformed.schema());
        assert_eq!(conformed.column(1).null_count(), 2);
    }

    #[test]
    fn drops_and_narrowing_are_refused_naming_the_column() {
        let wide = schema(&[("id", DataType::Int64, false), ("qty", DataType::Int64, true)]);
        let narrow = schema(&[("id", DataType::Int64, false), ("qty", DataType::Int32, true)]);
        let dropped = schema(&[("id", DataType::Int64, false)]);
        let err = fit("orders", Some(&wide), Some(&wide), &narrow).expect_err("narrowing");
        assert!(err.to_string().contains("narrows column `qty` from Int64 to Int32"), "{err}");
        assert!(err.to_string().contains("\"orders\""), "{err}");
        let err = fit("orders", Some(&wide), Some(&wide), &dropped).expect_err("a drop");
        assert!(err.to_string().contains("dropped column `qty`"), "{err}");
        let retyped = schema(&[("id", DataType::Utf8, false), ("qty", DataType::Int64, true)]);
        let err = fit("orders", Some(&wide), None, &retyped).expect_err("a type change");
        assert!(err.to_string().contains("column `id` is Int64 in the table but Utf8 in the rows"), "{err}");
    }

    #[test]
    fn a_table_the_writers_do_not_know_is_new() {
        let s = schema(&[("id", DataType::Int64, false)]);
        assert!(matches!(fit("late", None, None, &s), Ok(Fit::Barrier(Change { kind: ChangeKind::NewTable, .. }))));
        let wide = schema(&[("id", DataType::Int64, false), ("tag", DataType::Utf8, true)]);
        let merged = merge_changes(vec![
            Change { kind: ChangeKind::NewTable, table: "late".into(), schema: s.clone() },
            Change { kind: ChangeKind::NewTable, table: "late".into(), schema: wide.clone() },
        ])
        .expect("compatible");
        assert_eq!(merged.len(), 1);
        assert!(same_shape(&merged[0].schema, &wide));
    }
}
