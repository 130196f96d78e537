//! Table schemas as the BigQuery REST API (`tables.get`, `tables.insert`,
//! `tables.patch`) carries them, and the evolution of a table's schema to
//! take rows of a wider Arrow schema.
//!
//! BigQuery's documented schema changes ("Modifying table schemas",
//! https://cloud.google.com/bigquery/docs/managing-table-schemas) without
//! rewriting data are: adding a NULLABLE or REPEATED column (also inside a
//! RECORD), and relaxing a REQUIRED column to NULLABLE. Widening an Arrow
//! integer, float or decimal usually maps to the same BigQuery type (INT64,
//! FLOAT64, NUMERIC), so it needs no change; a decimal that outgrows
//! NUMERIC would need `ALTER COLUMN ... SET DATA TYPE BIGNUMERIC`, which
//! `tables.patch` cannot do, so it is refused like any other type change.
//!
//! Invariants:
//! - [`evolve`] never drops, renames or narrows a column: every refusal is
//!   an [`EvolveError`] naming the column;
//! - the result is `None` when the table takes the rows as it is, so
//!   evolving twice (a replay after a crash) changes nothing.

use arrow_schema::Schema;
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema,
    table_field_schema::{Mode, Type},
};
use serde_json::{Value, json};
use thiserror::Error;

use crate::{RowEncoder, SchemaError};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum EvolveError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("the rows add column `{column}` as REQUIRED; only NULLABLE or REPEATED columns can be added")]
    NewRequired { column: String },
    #[error("the rows no longer have the REQUIRED column `{column}`; BigQuery cannot drop it on the fly")]
    DroppedRequired { column: String },
    #[error("column `{column}` would change from {from} to {to}, which is not a change BigQuery can make in place")]
    TypeChange { column: String, from: String, to: String },
    #[error("column `{column}` would change mode from {from} to {to}")]
    ModeChange { column: String, from: String, to: String },
}

fn mode_of(f: &TableFieldSchema) -> Mode {
    Mode::try_from(f.mode).unwrap_or(Mode::Nullable)
}

fn type_of(f: &TableFieldSchema) -> Type {
    Type::try_from(f.r#type).unwrap_or(Type::Unspecified)
}

/// The REST name of a column type (the standard SQL names of `TableFieldSchema.type`).
pub fn rest_type_name(t: Type) -> &'static str {
    match t {
        Type::Int64 => "INT64",
        Type::Double => "FLOAT64",
        Type::Numeric => "NUMERIC",
        Type::Bignumeric => "BIGNUMERIC",
        Type::Bool => "BOOL",
        Type::String => "STRING",
        Type::Bytes => "BYTES",
        Type::Date => "DATE",
        Type::Datetime => "DATETIME",
        Type::Time => "TIME",
        Type::Timestamp => "TIMESTAMP",
        Type::Struct => "STRUCT",
        Type::Json => "JSON",
        Type::Geography => "GEOGRAPHY",
        Type::Interval => "INTERVAL",
        Type::Range => "RANGE",
        Type::Unspecified => "TYPE_UNSPECIFIED",
    }
}

/// The `schema.fields` array of a REST table resource.
pub fn to_rest_fields(schema: &TableSchema) -> Value {
    fn field(f: &TableFieldSchema) -> Value {
        let mut v = json!({
            "name": f.name,
            "type": rest_type_name(type_of(f)),
            "mode": match mode_of(f) {
                Mode::Required => "REQUIRED",
                Mode::Repeated => "REPEATED",
                _ => "NULLABLE",
            },
        });
        if !f.fields.is_empty() {
            v["fields"] = Value::Array(f.fields.iter().map(field).collect());
        }
        if f.precision > 0 {
            // int64 values cross REST as strings.
            v["precision"] = Value::String(f.precision.to_string());
            v["scale"] = Value::String(f.scale.to_string());
        }
        v
    }
    Value::Array(schema.fields.iter().map(field).collect())
}

/// Reads the `schema.fields` array of a REST table resource.
pub fn from_rest_fields(fields: &Value) -> Result<TableSchema, String> {
    fn number(v: Option<&Value>) -> i64 {
        match v {
            Some(Value::String(s)) => s.parse().unwrap_or(0),
            Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
            _ => 0,
        }
    }
    fn strip(v: &Value) -> Value {
        // `parse_table_schema` reads names, types, modes and nested fields.
        let mut out = json!({ "name": v.get("name"), "type": v.get("type") });
        if let Some(mode) = v.get("mode") {
            out["mode"] = mode.clone();
        }
        if let Some(Value::Array(children)) = v.get("fields") {
            out["fields"] = Value::Array(children.iter().map(strip).collect());
        }
        out
    }
    fn params(schema: &mut [TableFieldSchema], fields: &[Value]) {
        for (f, v) in schema.iter_mut().zip(fields) {
            f.precision = number(v.get("precision"));
            f.scale = number(v.get("scale"));
            if let Some(Value::Array(children)) = v.get("fields") {
                params(&mut f.fields, children);
            }
        }
    }
    let Value::Array(list) = fields else { return Err("schema.fields is not an array".to_string()) };
    let stripped = Value::Array(list.iter().map(strip).collect());
    let mut schema = crate::parse_table_schema(&stripped.to_string())?;
    params(&mut schema.fields, list);
    Ok(schema)
}

/// The schema a new table gets for rows of `arrow`.
pub fn creation_schema(arrow: &Schema) -> Result<TableSchema, SchemaError> {
    RowEncoder::table_schema(arrow)
}

/// The schema `table` must change to so that rows of `arrow` land in it, or
/// `None` when they land already.
pub fn evolve(table: &TableSchema, arrow: &Schema) -> Result<Option<TableSchema>, EvolveError> {
    let wanted = RowEncoder::table_schema(arrow)?;
    let mut fields = table.fields.clone();
    let changed = merge(&mut fields, &wanted.fields, "")?;
    Ok(changed.then_some(TableSchema { fields }))
}

/// Whether a column of type `from` takes values of type `to` as it is.
fn takes(from: Type, to: Type) -> bool {
    from == to
        || matches!(
            (from, to),
            // A wider type holds every value; JSON columns take JSON text.
            (Type::Bignumeric, Type::Numeric) | (Type::Json, Type::String)
        )
}

fn merge(table: &mut Vec<TableFieldSchema>, wanted: &[TableFieldSchema], prefix: &str) -> Result<bool, EvolveError> {
    let mut changed = false;
    for w in wanted {
        let column = format!("{prefix}{}", w.name);
        // BigQuery column names are case-insensitive.
        match table.iter_mut().find(|t| t.name.eq_ignore_ascii_case(&w.name)) {
            None => {
                if mode_of(w) == Mode::Required {
                    return Err(EvolveError::NewRequired { column });
                }
                table.push(w.clone());
                changed = true;
            }
            Some(t) => {
                let (from, to) = (type_of(t), type_of(w));
                if !takes(from, to) {
                    return Err(EvolveError::TypeChange {
                        column,
                        from: rest_type_name(from).to_string(),
                        to: rest_type_name(to).to_string(),
                    });
                }
                match (mode_of(t), mode_of(w)) {
                    (a, b) if a == b => {}
                    (Mode::Required, Mode::Nullable) => {
                        t.mode = Mode::Nullable as i32;
                        changed = true;
                    }
                    // Rows that never hold null land in a NULLABLE column.
                    (Mode::Nullable, Mode::Required) => {}
                    (a, b) => {
                        return Err(EvolveError::ModeChange {
                            column,
                            from: a.as_str_name().to_string(),
                            to: b.as_str_name().to_string(),
                        });
                    }
                }
                if from == Type::Struct {
                    changed |= merge(&mut t.fields, &w.fields, &format!("{column}."))?;
                }
            }
        }
    }
    for t in table.iter() {
        if mode_of(t) == Mode::Required && !wanted.iter().any(|w| w.name.eq_ignore_ascii_case(&t.name)) {
            return Err(EvolveError::DroppedRequired { column: format!("{prefix}{}", t.name) });
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_schema::{DataType, Field};

    use super::*;

    fn schema(fields: Vec<Field>) -> Schema {
        Schema::new(fields)
    }

    fn base() -> TableSchema {
        RowEncoder::table_schema(&schema(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("qty", DataType::Int32, false),
        ]))
        .expect("table schema")
    }

    #[test]
    fn adds_nullable_columns_and_relaxes_required_ones() {
        let rows = schema(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("qty", DataType::Int64, true),
            Field::new("tag", DataType::Utf8, true),
        ]);
        let evolved = evolve(&base(), &rows).expect("allowed").expect("a change");
        let names: Vec<&str> = evolved.fields.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["id", "qty", "tag"]);
        assert_eq!(evolved.fields[1].mode, Mode::Nullable as i32);
        assert_eq!(evolved.fields[2].mode, Mode::Nullable as i32);
        // Evolving again changes nothing.
        assert_eq!(evolve(&evolved, &rows), Ok(None));
    }

    #[test]
    fn integer_widening_needs_no_change() {
        let rows = schema(vec![Field::new("id", DataType::Int64, false), Field::new("qty", DataType::Int64, false)]);
        assert_eq!(evolve(&base(), &rows), Ok(None));
    }

    #[test]
    fn refuses_what_bigquery_cannot_do_naming_the_column() {
        let dropped = schema(vec![Field::new("id", DataType::Int64, false)]);
        assert_eq!(evolve(&base(), &dropped), Err(EvolveError::DroppedRequired { column: "qty".into() }));
        let required = schema(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("qty", DataType::Int64, false),
            Field::new("tag", DataType::Utf8, false),
        ]);
        assert_eq!(evolve(&base(), &required), Err(EvolveError::NewRequired { column: "tag".into() }));
        let retyped = schema(vec![Field::new("id", DataType::Utf8, false), Field::new("qty", DataType::Int64, false)]);
        assert!(
            matches!(evolve(&base(), &retyped), Err(EvolveError::TypeChange { ref column, .. }) if column == "id"),
            "{:?}",
            evolve(&base(), &retyped)
        );
    }

    #[test]
    fn nested_records_take_new_nullable_fields() {
        let inner = |extra: bool| {
            let mut f = vec![Field::new("a", DataType::Int64, true)];
            if extra {
                f.push(Field::new("b", DataType::Utf8, true));
            }
            Field::new("p", DataType::Struct(f.into()), true)
        };
        let table = RowEncoder::table_schema(&schema(vec![inner(false)])).expect("table");
        let evolved = evolve(&table, &schema(vec![inner(true)])).expect("allowed").expect("a change");
        assert_eq!(evolved.fields[0].fields.len(), 2);
    }

    #[test]
    fn rest_fields_round_trip() {
        let rows = Arc::new(schema(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("price", DataType::Float64, true),
            Field::new("amount", DataType::Decimal128(18, 2), false),
            Field::new("tags", DataType::List(Arc::new(Field::new("item", DataType::Utf8, true))), true),
        ]));
        let mut table = creation_schema(&rows).expect("schema");
        table.fields[2].precision = 18;
        table.fields[2].scale = 2;
        let rest = to_rest_fields(&table);
        assert_eq!(rest[1]["type"], "FLOAT64");
        assert_eq!(rest[2]["precision"], "18");
        assert_eq!(rest[3]["mode"], "REPEATED");
        assert_eq!(from_rest_fields(&rest), Ok(table));
    }
}
