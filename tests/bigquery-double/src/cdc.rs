//! Change data capture (CDC) ingestion, as "Stream table updates with change
//! data capture" documents it
//! (https://cloud.google.com/bigquery/docs/change-data-capture):
//!
//! - the table declares a primary key (`PRIMARY KEY (...) NOT ENFORCED`;
//!   in the table resource `tableConstraints.primaryKey.columns`, "composite
//!   primary keys containing up to 16 columns are supported");
//! - changes arrive through the Storage Write API's **default stream**, as
//!   protobuf rows ("You must use the protobuf format as the ingestion
//!   format. The Apache Arrow format isn't supported"), with the pseudo-column
//!   `_CHANGE_TYPE`, which "only accepts the values UPSERT and DELETE";
//! - `_CHANGE_SEQUENCE_NUMBER` (a STRING of hexadecimal sections separated
//!   by `/`, up to four sections of up to 16 hex digits, e.g. `FFF/B`,
//!   compared section by section as numbers) orders the changes of one key:
//!   a change whose number is lower than the one already applied for its key
//!   is ignored;
//! - `maxStaleness` (table option `max_staleness`, an INTERVAL) bounds how
//!   old what queries read may be; the double applies every change at once,
//!   which is the freshest answer the option allows.
//!
//! Where the page is silent the double picks an answer and says so:
//! - a change whose number **equals** the key's last applied one: ignored
//!   by default ([`EqualSequence::Ignore`]), applied with
//!   [`EqualSequence::Apply`]; a client must be right under both;
//! - a delete's number is remembered, so a later change with a lower or
//!   equal number stays ignored after the row is gone;
//! - sections are compared one by one; when one number has fewer sections
//!   and they equal the other's first ones, the shorter is lower;
//! - a change without `_CHANGE_SEQUENCE_NUMBER` applies in arrival order
//!   (the page: without it BigQuery orders by ingestion), and then leaves
//!   the key's remembered number as it was;
//! - `_CHANGE_TYPE` on a table without a primary key, or on a stream other
//!   than `_default`, refuses the request with INVALID_ARGUMENT; a row with
//!   another change type, a malformed sequence number or a key column
//!   without a value is a row error, which rejects the whole request (as
//!   for any row error);
//! - REQUIRED columns are checked on DELETE rows too.

use std::collections::BTreeMap;

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema, table_field_schema::Mode, table_field_schema::Type,
};
use serde_json::{Map, Value};

/// The pseudo-column naming the kind of change.
pub const CHANGE_TYPE: &str = "_CHANGE_TYPE";
/// The pseudo-column ordering the changes of one key.
pub const CHANGE_SEQUENCE_NUMBER: &str = "_CHANGE_SEQUENCE_NUMBER";

/// How a change whose sequence number equals the key's last applied one is
/// treated (the page does not say).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EqualSequence {
    /// Ignored, like a lower one.
    #[default]
    Ignore,
    /// Applied, like a higher one.
    Apply,
}

impl EqualSequence {
    pub const ALL: [EqualSequence; 2] = [EqualSequence::Ignore, EqualSequence::Apply];
}

/// What the table holds for one key: its last applied sequence number and
/// its row (`None` once deleted; the number stays).
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    pub seq: Option<Vec<u64>>,
    pub row: Option<Map<String, Value>>,
}

/// One change read from a row.
#[derive(Debug, Clone)]
pub struct Change {
    pub key: String,
    pub delete: bool,
    pub seq: Option<Vec<u64>>,
    /// The row without the pseudo-columns.
    pub row: Map<String, Value>,
}

/// Reads a `_CHANGE_SEQUENCE_NUMBER`: 1 to 4 sections of 1 to 16
/// hexadecimal digits (either case), separated by `/`.
pub fn parse_sequence(text: &str) -> Result<Vec<u64>, String> {
    let sections: Vec<&str> = text.split('/').collect();
    if sections.len() > 4 {
        return Err(format!("{CHANGE_SEQUENCE_NUMBER} {text:?} has more than 4 sections"));
    }
    sections
        .iter()
        .map(|s| {
            if s.is_empty() || s.len() > 16 || !s.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(format!(
                    "{CHANGE_SEQUENCE_NUMBER} {text:?}: section {s:?} is not 1 to 16 hexadecimal digits"
                ));
            }
            u64::from_str_radix(s, 16).map_err(|e| format!("{CHANGE_SEQUENCE_NUMBER} {text:?}: {e}"))
        })
        .collect()
}

/// The table's columns and the two pseudo-columns, which a CDC writer
/// schema may carry beside them.
pub fn with_pseudo_columns(schema: &TableSchema) -> TableSchema {
    let mut fields = schema.fields.clone();
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

fn field<'a>(row: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    row.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v)
}

/// Reads one decoded row as a change of a table keyed by `key`.
pub fn read_change(mut row: Map<String, Value>, key: &[String]) -> Result<Change, String> {
    let kind = match field(&row, CHANGE_TYPE) {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(format!("{CHANGE_TYPE} has no value; it only accepts UPSERT and DELETE")),
    };
    let delete = match kind.as_str() {
        "UPSERT" => false,
        "DELETE" => true,
        other => return Err(format!("{CHANGE_TYPE} {other:?}: only UPSERT and DELETE are accepted")),
    };
    let seq = match field(&row, CHANGE_SEQUENCE_NUMBER) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(parse_sequence(s)?),
        Some(other) => return Err(format!("{CHANGE_SEQUENCE_NUMBER} {other} is not a STRING")),
    };
    row.retain(|k, _| !k.eq_ignore_ascii_case(CHANGE_TYPE) && !k.eq_ignore_ascii_case(CHANGE_SEQUENCE_NUMBER));
    let mut values = Vec::with_capacity(key.len());
    for column in key {
        match field(&row, column) {
            None | Some(Value::Null) => {
                return Err(format!("primary key column {column} has no value"));
            }
            Some(v) => values.push(v.clone()),
        }
    }
    Ok(Change { key: Value::Array(values).to_string(), delete, seq, row })
}

/// Applies `changes` in order to the table's keyed rows; returns how many
/// were applied (the others were ignored by their sequence numbers).
pub fn apply(rows: &mut BTreeMap<String, Applied>, changes: Vec<Change>, equal: EqualSequence) -> usize {
    let mut applied = 0;
    for change in changes {
        let newer = match (rows.get(&change.key).and_then(|a| a.seq.as_ref()), &change.seq) {
            (Some(last), Some(seq)) => seq > last || (seq == last && equal == EqualSequence::Apply),
            _ => true,
        };
        if !newer {
            continue;
        }
        let kept_seq = rows.get(&change.key).and_then(|a| a.seq.clone());
        let seq = change.seq.or(kept_seq);
        let row = if change.delete { None } else { Some(change.row) };
        rows.insert(change.key, Applied { seq, row });
        applied += 1;
    }
    applied
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn change(id: i64, kind: &str, seq: &str, v: i64) -> Change {
        let row = json!({ "id": id, "v": v, CHANGE_TYPE: kind, CHANGE_SEQUENCE_NUMBER: seq });
        let Value::Object(row) = row else { unreachable!() };
        read_change(row, &["id".to_string()]).unwrap()
    }

    #[test]
    fn sequence_numbers_compare_section_by_section() {
        assert_eq!(parse_sequence("FFF/B").unwrap(), vec![0xFFF, 0xB]);
        assert!(parse_sequence("A/B").unwrap() < parse_sequence("A/C").unwrap());
        assert!(parse_sequence("2/0").unwrap() > parse_sequence("1/FFFFFFFF").unwrap());
        assert!(parse_sequence("1").unwrap() < parse_sequence("1/0").unwrap());
        for bad in ["", "1//2", "G", "1/2/3/4/5", "12345678901234567"] {
            assert!(parse_sequence(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn changes_apply_per_key_by_sequence_number() {
        for equal in EqualSequence::ALL {
            let mut rows = BTreeMap::new();
            let n = apply(
                &mut rows,
                vec![
                    change(1, "UPSERT", "0/2", 10),
                    change(1, "UPSERT", "0/1", 99), // lower: ignored
                    change(2, "UPSERT", "0/3", 20),
                    change(2, "DELETE", "1/1", 0),
                    change(2, "UPSERT", "1/0", 99), // lower than the delete: ignored
                    change(1, "UPSERT", "0/2", 11), // equal: as `equal` says
                ],
                equal,
            );
            let one = rows[&json!([1]).to_string()].row.as_ref().unwrap()["v"].clone();
            assert_eq!(one, json!(if equal == EqualSequence::Apply { 11 } else { 10 }));
            assert_eq!(rows[&json!([2]).to_string()].row, None, "the delete holds");
            assert_eq!(n, if equal == EqualSequence::Apply { 4 } else { 3 });
        }
        let Value::Object(row) = json!({ "id": 1, CHANGE_TYPE: "INSERT" }) else { unreachable!() };
        assert!(read_change(row, &["id".to_string()]).unwrap_err().contains("only UPSERT and DELETE"));
        let Value::Object(row) = json!({ "v": 1, CHANGE_TYPE: "DELETE" }) else { unreachable!() };
        assert!(read_change(row, &["id".to_string()]).unwrap_err().contains("primary key column id"));
    }
}
