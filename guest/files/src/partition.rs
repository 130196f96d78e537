//! `partition_by`: identity partitioning by columns, Hive-style.
//!
//! Invariants:
//! - a partition is named by its path: one `col=value` segment per column
//!   of `partition_by`, in that order (`region=eu/day=2024-01-05`); the
//!   same values always render the same path, so a partition's path is its
//!   identity in the overwrite log too;
//! - values render as Arrow displays them, in formats that need no escape
//!   on any store: ISO 8601 dates (`2024-01-05`; a `Date64` by its date),
//!   timestamps in ISO 8601's basic format (`20240105T100000`, with
//!   `.fff…` when they have a fraction), and a timestamp with a time zone
//!   (`Timestamp(us, "UTC")`, `"+02:00"`) as its instant in UTC with a `Z`
//!   (`20240105T080000Z`), so one instant is one partition whatever zone
//!   it was given in; decimal for integers, `true`/`false`; a null (or
//!   empty string) is Hive's `__HIVE_DEFAULT_PARTITION__`;
//! - a string value with a character a path cannot carry is escaped as
//!   Hive escapes it ([`escape`]) on local disk; on an object store, whose
//!   locations the host refuses with a `%` in them, such a value is
//!   refused as invalid data, naming its row ([`split`]);
//! - only columns whose values have one obvious rendering can partition
//!   (integers, strings, booleans, dates, timestamps); anything else is
//!   refused before a row is written, naming the table and the column;
//! - splitting keeps every row and the row order within a partition.

use std::collections::BTreeMap;

use arrow_array::{ArrayRef, RecordBatch, UInt32Array, make_array};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{ArrowError, DataType, SchemaRef};
use sluice_guest_sdk::{SinkError, error};

/// Hive's name for the partition of nulls.
pub const NULL_PARTITION: &str = "__HIVE_DEFAULT_PARTITION__";

/// Parses `partition_by` (`"day"`, `"region, day"`): identity column names.
pub fn parse(raw: &str) -> Result<Vec<String>, SinkError> {
    let mut columns: Vec<String> = Vec::new();
    for name in raw.split(',').map(str::trim) {
        if name.is_empty() {
            return Err(error::config(format!(
                "[sink.options] partition_by = {raw:?} names an empty column; give column names separated by commas, \
                 e.g. \"region, day\""
            )));
        }
        if name.contains(['(', ')', ' ', '/', '=']) {
            return Err(error::config(format!(
                "[sink.options] partition_by = {raw:?}: {name:?} is not a column name; the files sink partitions by \
                 identity columns only (Hive-style `col=value` directories), so derive the column in the source \
                 (e.g. a `day` column) and name it"
            )));
        }
        if columns.iter().any(|c| c == name) {
            return Err(error::config(format!("[sink.options] partition_by = {raw:?} names column {name:?} twice")));
        }
        columns.push(name.to_string());
    }
    Ok(columns)
}

/// Whether values of `ty` have one obvious rendering as a path segment.
fn partitionable(ty: &DataType) -> bool {
    matches!(
        ty,
        DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::UInt64
            | DataType::Utf8
            | DataType::LargeUtf8
            | DataType::Utf8View
            | DataType::Boolean
            | DataType::Date32
            | DataType::Date64
            | DataType::Timestamp(_, _)
    )
}

/// The indices of `columns` in `schema` of `table`, each checked.
pub fn indices(table: &str, schema: &SchemaRef, columns: &[String]) -> Result<Vec<usize>, SinkError> {
    let label = if table.is_empty() { "the table".to_string() } else { format!("table {table:?}") };
    columns
        .iter()
        .map(|column| {
            let (i, field) = schema.column_with_name(column).ok_or_else(|| {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                error::config(format!(
                    "[sink.options] partition_by names column {column:?}, which {label} does not have (its columns: \
                     {})",
                    names.join(", ")
                ))
            })?;
            if !partitionable(field.data_type()) {
                return Err(error::config(format!(
                    "[sink.options] partition_by: column {column:?} of {label} is {}, which cannot name a partition; \
                     partition by integer, string, boolean, date or timestamp columns",
                    field.data_type()
                )));
            }
            Ok(i)
        })
        .collect()
}

/// Escapes `value` for a path segment as Hive does
/// (`org.apache.hadoop.hive.common.FileUtils.escapePathName`: control
/// characters and `"#%'*/:=?\{[]^` and DEL become `%XX`). Hand-rolled, as
/// no kept crate carries Hive's set (`percent-encoding` would take an
/// `AsciiSet` spelled out just the same).
pub fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        if c < ' ' || c == '\u{7f}' || "\"#%'*/:=?\\{[]^".contains(c) {
            out.push_str(&format!("%{:02X}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// A timestamp without a zone: ISO 8601's basic format, which has no `:`.
const NAIVE_TIMESTAMP: &str = "%Y%m%dT%H%M%S%.f";
/// A timestamp with a zone, normalised to UTC.
const UTC_TIMESTAMP: &str = "%Y%m%dT%H%M%S%.fZ";

/// The array to render for partition column `array`, and whether it is a
/// timestamp with a zone: such a column's values (instants, stored as UTC)
/// are taken without the zone, so they render as UTC wall time and need
/// no time zone database.
fn renderable(array: &ArrayRef) -> Result<(ArrayRef, bool), ArrowError> {
    match array.data_type() {
        DataType::Timestamp(unit, Some(_)) => {
            let data = array.to_data().into_builder().data_type(DataType::Timestamp(*unit, None)).build()?;
            Ok((make_array(data), true))
        }
        _ => Ok((array.clone(), false)),
    }
}

/// Splits `batch` of `table` by the values of columns `cols` (indices, in
/// `partition_by` order, named `names`): each partition's path and its rows.
/// Without columns the whole batch is the partition `""`. `object_store`:
/// a value that needs escaping is refused as invalid data, naming its row
/// as row `first_row + i` of this writer's input for the table.
pub fn split(
    table: &str,
    batch: &RecordBatch,
    cols: &[usize],
    names: &[String],
    object_store: bool,
    first_row: u64,
) -> Result<Vec<(String, RecordBatch)>, SinkError> {
    if cols.is_empty() || batch.num_rows() == 0 {
        return Ok(vec![(String::new(), batch.clone())]);
    }
    let base = FormatOptions::default().with_null(NULL_PARTITION).with_datetime_format(Some("%Y-%m-%d"));
    let naive = base.clone().with_timestamp_format(Some(NAIVE_TIMESTAMP));
    let utc = base.with_timestamp_format(Some(UTC_TIMESTAMP));
    let rendering = |e: ArrowError| error::fatal(format!("table {table:?}: rendering partition values: {e}"));
    let arrays = cols.iter().map(|&i| renderable(batch.column(i))).collect::<Result<Vec<_>, _>>().map_err(rendering)?;
    let formatters = arrays
        .iter()
        .map(|(array, zoned)| ArrayFormatter::try_new(array.as_ref(), if *zoned { &utc } else { &naive }))
        .collect::<Result<Vec<_>, _>>()
        .map_err(rendering)?;
    let mut rows: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for row in 0..batch.num_rows() {
        let mut path = String::new();
        for (formatter, name) in formatters.iter().zip(names) {
            let raw = formatter.value(row).to_string();
            let value = if raw.is_empty() { NULL_PARTITION.to_string() } else { escape(&raw) };
            if object_store && value != raw && !raw.is_empty() {
                return Err(error::invalid_data(format!(
                    "row {} of this writer's input for table {table:?}: its partition_by column {name:?} is {raw:?}, \
                     which has a character an object-store folder name cannot carry (one of \
                     `\"#%'*/:=?\\{{[]^`, or a control character); on an object store the files sink names \
                     partitions by their values unescaped, so map such values in the source",
                    first_row + row as u64
                )));
            }
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(&format!("{name}={value}"));
        }
        let index =
            u32::try_from(row).map_err(|_| error::fatal(format!("table {table:?}: a batch of over 2^32 rows")))?;
        rows.entry(path).or_default().push(index);
    }
    if rows.len() == 1 {
        return Ok(rows.into_keys().map(|path| (path, batch.clone())).collect());
    }
    rows.into_iter()
        .map(|(path, indices)| {
            let taken = arrow_select::take::take_record_batch(batch, &UInt32Array::from(indices))
                .map_err(|e| error::fatal(format!("table {table:?}: splitting rows by partition: {e}")))?;
            Ok((path, taken))
        })
        .collect()
}

/// The values of a partition path, by column (`day=2024-01-05` → `day`,
/// `2024-01-05`), unescaped.
pub fn values(path: &str) -> BTreeMap<String, String> {
    path.split('/')
        .filter_map(|segment| segment.split_once('='))
        .map(|(column, value)| (column.to_string(), unescape(value)))
        .collect()
}

/// Undoes [`escape`].
fn unescape(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(code) = value.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(code);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{Date32Array, Date64Array, Int64Array, StringArray, TimestampMicrosecondArray};
    use arrow_schema::{Field, Schema};

    use super::*;

    #[test]
    fn partition_by_takes_identity_columns_only() {
        assert_eq!(parse("day").unwrap(), vec!["day"]);
        assert_eq!(parse(" region , day ").unwrap(), vec!["region", "day"]);
        let Err(SinkError::Config(err)) = parse("day(ts)") else { panic!("refused") };
        assert!(err.contains("identity columns only"), "{err}");
        let Err(SinkError::Config(err)) = parse("day, day") else { panic!("refused") };
        assert!(err.contains("twice"), "{err}");
        assert!(parse("day,").is_err());
    }

    #[test]
    fn rows_split_by_rendered_values_keeping_order() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("region", DataType::Utf8, true),
            Field::new("day", DataType::Date32, false),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![1, 2, 3, 4])),
                Arc::new(StringArray::from(vec![Some("eu"), Some("a/b"), Some("eu"), None])),
                Arc::new(Date32Array::from(vec![19727, 19727, 19727, 19728])),
            ],
        )
        .unwrap();
        let names = vec!["region".to_string(), "day".to_string()];
        let cols = indices("t", &schema, &names).unwrap();
        let parts = split("t", &batch, &cols, &names, false, 0).unwrap();
        let got: Vec<(String, Vec<i64>)> = parts
            .iter()
            .map(|(p, b)| {
                let ids = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap().values().to_vec();
                (p.clone(), ids)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (format!("region={NULL_PARTITION}/day=2024-01-06"), vec![4]),
                ("region=a%2Fb/day=2024-01-05".to_string(), vec![2]),
                ("region=eu/day=2024-01-05".to_string(), vec![1, 3]),
            ]
        );
        assert_eq!(values("region=a%2Fb/day=2024-01-05")["region"], "a/b");
    }

    /// The partition paths of the rows of `array` (column `ts`).
    fn paths(array: ArrayRef, object_store: bool) -> Result<Vec<String>, SinkError> {
        let schema = Arc::new(Schema::new(vec![Field::new("ts", array.data_type().clone(), true)]));
        let batch = RecordBatch::try_new(schema, vec![array]).unwrap();
        let parts = split("t", &batch, &[0], &["ts".to_string()], object_store, 7)?;
        Ok(parts.into_iter().map(|(p, _)| p).collect())
    }

    #[test]
    fn timestamps_render_without_escapes_and_zoned_ones_as_their_utc_instant() {
        // 2024-01-05T10:00:00Z and 2024-01-05T10:00:00.5Z, in microseconds.
        let us = [1_704_448_800_000_000_i64, 1_704_448_800_500_000];
        let naive = Arc::new(TimestampMicrosecondArray::from(us.to_vec()));
        assert_eq!(paths(naive, true).unwrap(), vec!["ts=20240105T100000", "ts=20240105T100000.500"]);
        // What pyarrow writes: a named zone (no time zone database needed).
        let utc = Arc::new(TimestampMicrosecondArray::from(vec![us[0]]).with_timezone("UTC"));
        assert_eq!(paths(utc, true).unwrap(), vec!["ts=20240105T100000Z"]);
        // The same instant given with a fixed offset is the same partition.
        let offset = Arc::new(TimestampMicrosecondArray::from(vec![us[0]]).with_timezone("+02:00"));
        assert_eq!(paths(offset, true).unwrap(), vec!["ts=20240105T100000Z"]);
        let date64 = Arc::new(Date64Array::from(vec![1_704_412_800_000]));
        assert_eq!(paths(date64, true).unwrap(), vec!["ts=2024-01-05"]);
    }

    #[test]
    fn on_an_object_store_a_value_needing_an_escape_is_refused_by_its_row() {
        let values = || Arc::new(StringArray::from(vec!["eu", "a:b"])) as ArrayRef;
        assert_eq!(paths(values(), false).unwrap(), vec!["ts=a%3Ab", "ts=eu"]);
        let Err(SinkError::InvalidData(err)) = paths(values(), true) else { panic!("refused") };
        assert!(err.starts_with("row 8 of this writer's input for table \"t\": "), "{err}");
        assert!(err.contains("\"a:b\""), "{err}");
    }

    #[test]
    fn unsupported_or_missing_columns_are_named() {
        let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Float64, false)]));
        let Err(SinkError::Config(err)) = indices("t", &schema, &["v".to_string()]) else { panic!("refused") };
        assert!(err.contains("column \"v\" of table \"t\" is Float64"), "{err}");
        let Err(SinkError::Config(err)) = indices("t", &schema, &["day".to_string()]) else { panic!("refused") };
        assert!(err.contains("\"day\"") && err.contains("its columns: v"), "{err}");
    }
}
