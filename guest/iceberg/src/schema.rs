//! Source (Arrow) schema versus table (Iceberg) schema.
//!
//! Invariants:
//! - every mismatch is found before any row is written, and is a `config`
//!   error naming the column;
//! - columns are matched by name; a source column may be promoted the way
//!   Iceberg allows (int → long, float → double, wider decimal), a table
//!   column the source lacks must be optional and is written as null;
//! - batches handed to iceberg's writers carry the table's Arrow schema, with
//!   its field ids.

use std::collections::HashSet;
use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions, new_null_array};
use arrow_schema::{Schema as ArrowSchema, SchemaRef as ArrowSchemaRef};
use iceberg::arrow::{arrow_schema_to_schema_auto_assign_ids, arrow_type_to_type, schema_to_arrow_schema};
use iceberg::spec::{NestedField, PrimitiveType, Schema, Type, UnboundPartitionSpec};
use iceberg::table::Table;
use sluice_guest_sdk::{SinkError, error};

use crate::config::{Config, PartitionField};

/// The schema of a table Sluice creates for this source.
pub fn creation_schema(source: &ArrowSchema) -> Result<Schema, SinkError> {
    arrow_schema_to_schema_auto_assign_ids(source)
        .map_err(|e| error::config(format!("the source schema cannot become an Iceberg table schema: {e}")))
}

fn promotable(from: &Type, to: &Type) -> bool {
    if from == to {
        return true;
    }
    match (from, to) {
        (Type::Primitive(f), Type::Primitive(t)) => {
            matches!((f, t), (PrimitiveType::Int, PrimitiveType::Long) | (PrimitiveType::Float, PrimitiveType::Double))
                || matches!(
                    (f, t),
                    (PrimitiveType::Decimal { precision: p1, scale: s1 }, PrimitiveType::Decimal { precision: p2, scale: s2 })
                        if s1 == s2 && p1 <= p2
                )
        }
        _ => false,
    }
}

/// Checks that rows of `source` can be written to a table with `table`'s schema.
pub fn check_compatible(source: &ArrowSchema, table: &Schema) -> Result<(), SinkError> {
    let mut problems = Vec::new();
    for field in source.fields() {
        let Some(target) = table.field_by_name(field.name()) else {
            problems.push(format!("source column `{}` is not in the table", field.name()));
            continue;
        };
        match arrow_type_to_type(field.data_type()) {
            Ok(ty) if promotable(&ty, &target.field_type) => {}
            Ok(ty) => problems.push(format!(
                "column `{}` is {ty} in the source but {} in the table",
                field.name(),
                target.field_type
            )),
            Err(e) => problems.push(format!("column `{}` has a type Iceberg cannot store: {e}", field.name())),
        }
        if field.is_nullable() && target.required {
            problems.push(format!("column `{}` may be null in the source but is required in the table", field.name()));
        }
    }
    let names: HashSet<&str> = source.fields().iter().map(|f| f.name().as_str()).collect();
    for target in table.as_struct().fields() {
        if target.required && !names.contains(target.name.as_str()) {
            problems.push(format!("required table column `{}` is missing from the source", target.name));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(error::config(format!("source schema does not match the table: {}", problems.join("; "))))
    }
}

/// The schema `table` must evolve to so that rows of `source` fit it, or
/// `None` when they fit already. Columns are added (optional, with new ids),
/// types widened the way Iceberg allows (int → long, float → double, a
/// wider decimal) and required columns made optional. Anything narrower is a
/// `config` error naming the table and the column.
pub fn evolved_schema(table: &Table, source: &ArrowSchema) -> Result<Option<Schema>, SinkError> {
    let metadata = table.metadata();
    let current = metadata.current_schema();
    let name = table.identifier();
    let refuse = |why: String| error::config(format!("table {name}: {why}; the table is left as it is"));
    let mut fields: Vec<NestedField> = current.as_struct().fields().iter().map(|f| f.as_ref().clone()).collect();
    let mut next_id = metadata.last_column_id() + 1;
    let mut changed = false;
    for column in source.fields() {
        let ty = arrow_type_to_type(column.data_type())
            .map_err(|e| refuse(format!("column `{}` has a type Iceberg cannot store: {e}", column.name())))?;
        match fields.iter_mut().find(|f| f.name == *column.name()) {
            Some(field) => {
                if field.field_type.as_ref() != &ty {
                    if promotable(&field.field_type, &ty) {
                        *field.field_type = ty;
                        changed = true;
                    } else if !promotable(&ty, &field.field_type) {
                        return Err(refuse(format!(
                            "column `{}` is {ty} in the source but {} in the table, which is not a widening Iceberg allows",
                            column.name(),
                            field.field_type
                        )));
                    }
                }
                if column.is_nullable() && field.required {
                    field.required = false;
                    changed = true;
                }
            }
            None => {
                if !column.is_nullable() {
                    return Err(refuse(format!(
                        "the new column `{}` is required; only optional columns can be added",
                        column.name()
                    )));
                }
                if !matches!(ty, Type::Primitive(_)) {
                    return Err(refuse(format!(
                        "the new column `{}` is nested; only primitive columns can be added",
                        column.name()
                    )));
                }
                fields.push(NestedField::optional(next_id, column.name(), ty));
                next_id += 1;
                changed = true;
            }
        }
    }
    for field in current.as_struct().fields() {
        if field.required && source.field_with_name(&field.name).is_err() {
            return Err(refuse(format!("the source dropped the required column `{}`", field.name)));
        }
    }
    if !changed {
        return Ok(None);
    }
    let schema = Schema::builder()
        .with_schema_id(metadata.schemas_iter().map(|s| s.schema_id()).max().unwrap_or(0) + 1)
        .with_identifier_field_ids(current.identifier_field_ids())
        .with_fields(fields.into_iter().map(Arc::new))
        .build()
        .map_err(|e| refuse(format!("the evolved schema is not valid: {e}")))?;
    Ok(Some(schema))
}

/// The partition spec for a table Sluice creates.
pub fn creation_spec(fields: &[PartitionField], schema: &Schema) -> Result<UnboundPartitionSpec, SinkError> {
    let mut builder = UnboundPartitionSpec::builder();
    for f in fields {
        let column = schema.field_by_name(&f.column).ok_or_else(|| {
            error::config(format!("option `partition_by`: column `{}` is not in the source schema", f.column))
        })?;
        let name = partition_field_name(f);
        builder = builder
            .add_partition_field(column.id, &name, f.transform)
            .map_err(|e| error::config(format!("option `partition_by`: {e}")))?;
    }
    Ok(builder.build())
}

/// The partition field's name as Iceberg's engines spell it (`ts_day`).
fn partition_field_name(f: &PartitionField) -> String {
    use iceberg::spec::Transform;
    match f.transform {
        Transform::Identity => f.column.clone(),
        Transform::Year => format!("{}_year", f.column),
        Transform::Month => format!("{}_month", f.column),
        Transform::Day => format!("{}_day", f.column),
        Transform::Hour => format!("{}_hour", f.column),
        Transform::Bucket(_) => format!("{}_bucket", f.column),
        Transform::Truncate(_) => format!("{}_trunc", f.column),
        _ => format!("{}_{}", f.column, f.transform),
    }
}

/// Checks that an existing table is partitioned as `partition_by` asks.
pub fn check_partitioning(cfg: &Config, table: &Table) -> Result<(), SinkError> {
    let Some(wanted) = &cfg.partition_by else { return Ok(()) };
    let metadata = table.metadata();
    let schema = metadata.current_schema();
    let spec = metadata.default_partition_spec();
    let actual: Vec<PartitionField> = spec
        .fields()
        .iter()
        .map(|f| PartitionField {
            column: schema.name_by_field_id(f.source_id).unwrap_or("?").to_string(),
            transform: f.transform,
        })
        .collect();
    if &actual == wanted {
        return Ok(());
    }
    let show = |fields: &[PartitionField]| {
        if fields.is_empty() {
            "unpartitioned".to_string()
        } else {
            fields.iter().map(|f| format!("{}({})", f.transform, f.column)).collect::<Vec<_>>().join(", ")
        }
    };
    Err(error::config(format!(
        "option `partition_by` = {} but table {} is partitioned by {}; drop the option or match the table",
        show(wanted),
        table.identifier(),
        show(&actual)
    )))
}

/// Converts source batches to the table's Arrow schema.
pub struct BatchConverter {
    target: ArrowSchemaRef,
}

impl BatchConverter {
    pub fn new(table: &Schema) -> Result<Self, SinkError> {
        let target = schema_to_arrow_schema(table)
            .map_err(|e| error::fatal(format!("the table schema has no Arrow form: {e}")))?;
        Ok(Self { target: Arc::new(target) })
    }

    pub fn convert(&self, batch: &RecordBatch) -> Result<RecordBatch, SinkError> {
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.target.fields().len());
        for field in self.target.fields() {
            let column = match batch.column_by_name(field.name()) {
                None => new_null_array(field.data_type(), batch.num_rows()),
                Some(col) if col.data_type() == field.data_type() => col.clone(),
                Some(col) => arrow_cast::cast(col, field.data_type()).map_err(|e| {
                    error::invalid_data(format!(
                        "column `{}`: cannot convert {} to the table's {}: {e}",
                        field.name(),
                        col.data_type(),
                        field.data_type()
                    ))
                })?,
            };
            if !field.is_nullable() && column.null_count() > 0 {
                return Err(error::invalid_data(format!(
                    "column `{}` is required in the table but {} row(s) of the batch are null",
                    field.name(),
                    column.null_count()
                )));
            }
            columns.push(column);
        }
        // The row count is given: a writer that reads none of a table's
        // columns converts batches of none (see `writer::input_schema`).
        let options = RecordBatchOptions::new().with_row_count(Some(batch.num_rows()));
        RecordBatch::try_new_with_options(self.target.clone(), columns, &options)
            .map_err(|e| error::invalid_data(format!("batch does not fit the table schema: {e}")))
    }
}
