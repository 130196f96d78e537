//! Time-unit column partitioning: a table's `timePartitioning`, the
//! partition a row falls in, and partition decorators (`table$20240131`).
//!
//! Documented semantics the double follows:
//! - TimePartitioning (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables#TimePartitioning):
//!   "type: Required. The supported types are DAY, HOUR, MONTH, and YEAR,
//!   which will generate one partition per day, hour, month, and year,
//!   respectively"; "field: If not set, the table is partitioned by pseudo
//!   column '_PARTITIONTIME'; if set, the table is partitioned by this field.
//!   The field must be a top-level TIMESTAMP or DATE field. Its mode must be
//!   NULLABLE or REQUIRED"; `expirationMs` is an int64 sent as a string.
//!   DATETIME columns may be partitioned too, and a DATE column takes DAY,
//!   MONTH or YEAR only
//!   (https://cloud.google.com/bigquery/docs/partitioned-tables#date_timestamp_partitioned_tables).
//! - Partitions are in UTC; rows whose column is NULL are in the `__NULL__`
//!   partition, and rows whose value "is earlier than 1960-01-01 or later
//!   than 2159-12-31" in `__UNPARTITIONED__` (same page).
//! - "A partition decorator has the form table_name$partition_id where the
//!   format of the partition_id segment depends on the type of
//!   partitioning": hourly `yyyymmddhh`, daily `yyyymmdd`, monthly `yyyymm`,
//!   yearly `yyyy`
//!   (https://cloud.google.com/bigquery/docs/managing-partitioned-table-data#partition_decorators).
//!
//! Not supported by the double, and refused as such: ingestion-time
//! partitioning (no `field`) and integer-range partitioning.
//!
//! Invariant: [`TimePartitioning::partition_of`] never guesses. A value it
//! cannot read is an error naming the column and the value, so a copy job
//! that meets it fails instead of placing the row somewhere.

use chrono::{DateTime, Datelike, NaiveDate, NaiveDateTime, Timelike};
use serde_json::{Map, Value, json};

use crate::proto::TableSchema;
use crate::proto::table_field_schema::{Mode, Type};

/// The partition id of rows whose partitioning column is NULL.
pub const NULL_PARTITION: &str = "__NULL__";

/// `timePartitioning.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PartitionType {
    Hour,
    Day,
    Month,
    Year,
}

impl PartitionType {
    pub fn as_str(self) -> &'static str {
        match self {
            PartitionType::Hour => "HOUR",
            PartitionType::Day => "DAY",
            PartitionType::Month => "MONTH",
            PartitionType::Year => "YEAR",
        }
    }

    /// The partition id of a civil date and hour.
    fn id(self, date: NaiveDate, hour: u32) -> String {
        let (y, m, d) = (date.year(), date.month(), date.day());
        match self {
            PartitionType::Hour => format!("{y:04}{m:02}{d:02}{hour:02}"),
            PartitionType::Day => format!("{y:04}{m:02}{d:02}"),
            PartitionType::Month => format!("{y:04}{m:02}"),
            PartitionType::Year => format!("{y:04}"),
        }
    }
}

impl std::str::FromStr for PartitionType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "HOUR" => Ok(Self::Hour),
            "DAY" => Ok(Self::Day),
            "MONTH" => Ok(Self::Month),
            "YEAR" => Ok(Self::Year),
            other => Err(format!("Invalid timePartitioning.type {other:?}: expected DAY, HOUR, MONTH or YEAR")),
        }
    }
}

/// A table's time-unit column partitioning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimePartitioning {
    pub kind: PartitionType,
    /// The partitioning column (top level).
    pub field: String,
    /// `expirationMs`, kept and returned; the double expires nothing.
    pub expiration_ms: Option<i64>,
}

impl TimePartitioning {
    pub fn new(kind: PartitionType, field: &str) -> Self {
        Self { kind, field: field.to_string(), expiration_ms: None }
    }

    /// Reads the REST form, checked against the table's schema.
    pub fn from_json(value: &Value, schema: &TableSchema) -> Result<Self, String> {
        let Some(object) = value.as_object() else { return Err("timePartitioning must be an object".into()) };
        let kind: PartitionType =
            object.get("type").and_then(Value::as_str).ok_or("timePartitioning.type is required")?.parse()?;
        let Some(field) = object.get("field").and_then(Value::as_str) else {
            return Err(
                "Ingestion-time partitioning (timePartitioning without field) is not supported by this double".into()
            );
        };
        let expiration_ms = match object.get("expirationMs") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                Some(s.parse::<i64>().map_err(|e| format!("timePartitioning.expirationMs {s:?}: {e}"))?)
            }
            Some(Value::Number(n)) => {
                Some(n.as_i64().ok_or_else(|| format!("timePartitioning.expirationMs {n} is not an int64"))?)
            }
            Some(other) => return Err(format!("timePartitioning.expirationMs {other} is not an int64")),
        };
        let partitioning = Self { kind, field: field.to_string(), expiration_ms };
        partitioning.check(schema)?;
        Ok(partitioning)
    }

    /// The REST form, as `tables.get` answers it (int64 as a string).
    pub fn to_json(&self) -> Value {
        let mut v = json!({ "type": self.kind.as_str(), "field": self.field });
        if let Some(ms) = self.expiration_ms {
            v["expirationMs"] = Value::String(ms.to_string());
        }
        v
    }

    /// Whether the partitioning column exists at the top level, with a type
    /// and mode that may be partitioned on.
    pub fn check(&self, schema: &TableSchema) -> Result<(), String> {
        let Some(column) = schema.fields.iter().find(|c| c.name.eq_ignore_ascii_case(&self.field)) else {
            return Err(format!(
                "The field specified for time partitioning can only be a top-level field: {} not found",
                self.field
            ));
        };
        if column.mode == Mode::Repeated as i32 {
            return Err(format!(
                "The field specified for time partitioning must be NULLABLE or REQUIRED: {}",
                self.field
            ));
        }
        match Type::try_from(column.r#type).unwrap_or(Type::Unspecified) {
            Type::Date if self.kind == PartitionType::Hour => {
                Err(format!("HOUR partitioning is not supported for the DATE field {}", self.field))
            }
            Type::Date | Type::Timestamp | Type::Datetime => Ok(()),
            other => Err(format!(
                "The field specified for time partitioning can only be of type TIMESTAMP, DATE or DATETIME: {} is {}",
                self.field,
                other.as_str_name()
            )),
        }
    }

    /// Whether `id` is a partition id of this partitioning: a decorator
    /// of the right length naming a real date (or `__NULL__`, `__UNPARTITIONED__`).
    pub fn check_decorator(&self, id: &str) -> Result<(), String> {
        if id == NULL_PARTITION || id == UNPARTITIONED {
            return Ok(());
        }
        let invalid = || format!("Invalid partition decorator ${id} for a table partitioned by {}", self.kind.as_str());
        let (len, text) = match self.kind {
            PartitionType::Hour => (10, id.get(..8).map(str::to_string)),
            PartitionType::Day => (8, Some(id.to_string())),
            PartitionType::Month => (6, Some(format!("{id}01"))),
            PartitionType::Year => (4, Some(format!("{id}0101"))),
        };
        if id.len() != len || !id.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        text.and_then(|t| NaiveDate::parse_from_str(&t, "%Y%m%d").ok()).ok_or_else(invalid)?;
        if self.kind == PartitionType::Hour && id[8..].parse::<u32>().map_or(true, |h| h > 23) {
            return Err(invalid());
        }
        Ok(())
    }

    /// The partition id of a row read back as JSON (`StoredRows::to_json`).
    pub fn partition_of(&self, row: &Map<String, Value>, schema: &TableSchema) -> Result<String, String> {
        let value = row.iter().find(|(k, _)| k.eq_ignore_ascii_case(&self.field)).map(|(_, v)| v);
        let value = match value {
            None | Some(Value::Null) => return Ok(NULL_PARTITION.to_string()),
            Some(v) => v,
        };
        let ty = schema
            .fields
            .iter()
            .find(|c| c.name.eq_ignore_ascii_case(&self.field))
            .and_then(|c| Type::try_from(c.r#type).ok())
            .unwrap_or(Type::Unspecified);
        let unreadable =
            || format!("Cannot read the partitioning column {} value {value} as {}", self.field, ty.as_str_name());
        let (date, hour) = match (ty, value) {
            // DATE rows read back as days since the epoch (INT32/INT64 and
            // Arrow Date32) or as `YYYY-MM-DD` text.
            (Type::Date, Value::Number(n)) => {
                let days = n.as_i64().ok_or_else(unreadable)?;
                let epoch = NaiveDate::from_ymd_opt(1970, 1, 1).ok_or_else(unreadable)?;
                let date = epoch.checked_add_signed(chrono::TimeDelta::try_days(days).ok_or_else(unreadable)?);
                (date.ok_or_else(unreadable)?, 0)
            }
            (Type::Date, Value::String(s)) => (NaiveDate::parse_from_str(s, "%Y-%m-%d").map_err(|_| unreadable())?, 0),
            // TIMESTAMP: microseconds since the epoch, or text; in UTC.
            (Type::Timestamp, Value::Number(n)) => {
                let t = n.as_i64().and_then(DateTime::from_timestamp_micros).ok_or_else(unreadable)?;
                (t.date_naive(), t.hour())
            }
            (Type::Timestamp, Value::String(s)) => {
                let t = DateTime::parse_from_rfc3339(s)
                    .map(|t| t.naive_utc())
                    .or_else(|_| civil(s))
                    .map_err(|_| unreadable())?;
                (t.date(), t.hour())
            }
            // DATETIME: civil text, or the packed INT64 civil-time encoding
            // of the Storage Write API (seconds bit fields above 20 bits of
            // microseconds).
            (Type::Datetime, Value::String(s)) => {
                let t = civil(s).map_err(|_| unreadable())?;
                (t.date(), t.hour())
            }
            (Type::Datetime, Value::Number(n)) => {
                let packed = n.as_i64().ok_or_else(unreadable)? >> 20;
                let field = |shift: u32, bits: u32| ((packed >> shift) & ((1 << bits) - 1)) as u32;
                let date = NaiveDate::from_ymd_opt(field(26, 14) as i32, field(22, 4), field(17, 5));
                (date.ok_or_else(unreadable)?, field(12, 5))
            }
            _ => return Err(unreadable()),
        };
        if !partitioned(date) {
            return Ok(UNPARTITIONED.to_string());
        }
        Ok(self.kind.id(date, hour))
    }
}

/// The partition of rows whose column lies outside the partitioned range.
pub const UNPARTITIONED: &str = "__UNPARTITIONED__";

/// Whether `date` lies in the range BigQuery partitions, 1960-01-01 to 2159-12-31.
fn partitioned(date: NaiveDate) -> bool {
    (1960..=2159).contains(&date.year())
}

/// Civil date-time text, with a space or `T`, and optional fractions.
fn civil(s: &str) -> Result<NaiveDateTime, chrono::ParseError> {
    NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
        .or_else(|_| NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f"))
}

/// Splits a table id into the table and its partition decorator, if any.
pub fn split_decorator(table_id: &str) -> (&str, Option<&str>) {
    match table_id.split_once('$') {
        Some((table, id)) => (table, Some(id)),
        None => (table_id, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::column;
    use crate::proto::TableSchema;

    fn schema() -> TableSchema {
        TableSchema {
            fields: vec![
                column("day", Type::Date, Mode::Required),
                column("ts", Type::Timestamp, Mode::Nullable),
                column("dt", Type::Datetime, Mode::Nullable),
                column("id", Type::Int64, Mode::Required),
            ],
        }
    }

    fn row(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn rows_fall_in_utc_partitions_by_type() {
        let s = schema();
        let day = TimePartitioning::new(PartitionType::Day, "day");
        // 19723 days after 1970-01-01 is 2024-01-01.
        assert_eq!(day.partition_of(&row(json!({"day": 19723})), &s), Ok("20240101".into()));
        assert_eq!(day.partition_of(&row(json!({"DAY": "2024-02-29"})), &s), Ok("20240229".into()));
        assert_eq!(day.partition_of(&row(json!({"id": 1})), &s), Ok(NULL_PARTITION.into()));
        // Outside 1960-01-01..=2159-12-31: __UNPARTITIONED__.
        for out in ["1959-12-31", "2160-01-01"] {
            assert_eq!(day.partition_of(&row(json!({"day": out})), &s), Ok(UNPARTITIONED.into()), "{out}");
        }
        assert_eq!(day.partition_of(&row(json!({"day": "1960-01-01"})), &s), Ok("19600101".into()));
        assert_eq!(day.partition_of(&row(json!({"day": "2159-12-31"})), &s), Ok("21591231".into()));
        assert!(day.partition_of(&row(json!({"day": "yesterday"})), &s).is_err_and(|m| m.contains("day")));
        let hour = TimePartitioning::new(PartitionType::Hour, "ts");
        // 2024-01-01T05:30:00Z in microseconds.
        assert_eq!(hour.partition_of(&row(json!({"ts": 1_704_087_000_000_000_i64})), &s), Ok("2024010105".into()));
        assert_eq!(hour.partition_of(&row(json!({"ts": "2024-01-01T23:59:59+02:00"})), &s), Ok("2024010121".into()));
        let month = TimePartitioning::new(PartitionType::Month, "dt");
        assert_eq!(month.partition_of(&row(json!({"dt": "2024-03-05 10:00:00.5"})), &s), Ok("202403".into()));
        let packed = ((2024_i64 << 26) | (3 << 22) | (5 << 17) | (10 << 12)) << 20;
        assert_eq!(month.partition_of(&row(json!({"dt": packed})), &s), Ok("202403".into()));
        let year = TimePartitioning::new(PartitionType::Year, "day");
        assert_eq!(year.partition_of(&row(json!({"day": 19723})), &s), Ok("2024".into()));
    }

    #[test]
    fn decorators_and_specs_are_checked() {
        let s = schema();
        let day = TimePartitioning::new(PartitionType::Day, "day");
        assert_eq!(day.check_decorator("20240131"), Ok(()));
        assert_eq!(day.check_decorator(NULL_PARTITION), Ok(()));
        for bad in ["2024013", "20240132", "2024013100", "2024-1-3", ""] {
            assert!(day.check_decorator(bad).is_err(), "{bad}");
        }
        let hour = TimePartitioning::new(PartitionType::Hour, "ts");
        assert_eq!(hour.check_decorator("2024013123"), Ok(()));
        assert!(hour.check_decorator("2024013124").is_err());
        assert_eq!(TimePartitioning::new(PartitionType::Month, "day").check_decorator("202402"), Ok(()));
        assert!(TimePartitioning::new(PartitionType::Month, "day").check_decorator("202413").is_err());
        assert_eq!(TimePartitioning::new(PartitionType::Year, "day").check_decorator("2024"), Ok(()));

        assert!(TimePartitioning::new(PartitionType::Hour, "day").check(&s).is_err_and(|m| m.contains("HOUR")));
        assert!(TimePartitioning::new(PartitionType::Day, "id").check(&s).is_err_and(|m| m.contains("INT64")));
        assert!(TimePartitioning::new(PartitionType::Day, "nope").check(&s).is_err());
        let parsed =
            TimePartitioning::from_json(&json!({"type": "DAY", "field": "day", "expirationMs": "86400000"}), &s);
        assert_eq!(
            parsed.as_ref().map(TimePartitioning::to_json),
            Ok(json!({"type": "DAY", "field": "day", "expirationMs": "86400000"}))
        );
        let ingestion = TimePartitioning::from_json(&json!({"type": "DAY"}), &s);
        assert!(ingestion.is_err_and(|m| m.contains("not supported by this double")));
        assert_eq!(split_decorator("t$20240101"), ("t", Some("20240101")));
        assert_eq!(split_decorator("t"), ("t", None));
    }
}
