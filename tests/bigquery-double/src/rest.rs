//! The BigQuery API's table methods (REST, `bigquery/v2`), as far as Sluice
//! uses them: `tables.get`, `tables.insert` and `tables.patch`, over the same
//! tables the Storage Write API side serves; and `tabledata.list`, for tools
//! that read back what became visible (`sluice plugin test --verify-cmd`).
//!
//! Semantics (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables
//! and "Modifying table schemas",
//! https://cloud.google.com/bigquery/docs/managing-table-schemas):
//! - `get` of a missing table: 404 `notFound` ("Not found: Table p:d.t");
//! - `insert` of an existing table: 409 `duplicate` ("Already Exists: Table p:d.t");
//! - `patch` "only replaces fields that are provided": a `schema` replaces
//!   the whole schema, which may only add NULLABLE or REPEATED columns (also
//!   in RECORDs) and relax REQUIRED to NULLABLE. Dropping, retyping or
//!   tightening a column is 400 `invalid` ("Provided Schema does not match
//!   Table ...");
//! - the `etag` of a table changes with every change. Whether `If-Match` is
//!   honoured by `tables.patch` is not documented, so the double answers
//!   both ways ([`crate::EtagMode`]): 412 on a stale etag, or ignoring it;
//! - a table resource's `labels` and `description` are kept as `insert`
//!   gave them and returned by `get`, left out when absent, as the API does;
//!   labels are checked against the documented requirements;
//! - `timePartitioning` (time-unit column partitioning, see
//!   [`crate::partition`]) is read by `insert`, checked against the schema
//!   and returned by `get`; ingestion-time and integer-range partitioning
//!   are refused with 400 "not supported by this double". `patch` leaves
//!   the partitioning as it is;
//! - `expirationTime` ("The time when this table expires, in milliseconds
//!   since the epoch. If not present, the table will persist indefinitely.
//!   Expired tables will be deleted and their storage reclaimed", an int64
//!   sent as a string, https://cloud.google.com/bigquery/docs/reference/rest/v2/tables#Table.FIELDS.expiration_time)
//!   is taken by `insert` and by `patch` (alone or beside `schema`) and
//!   returned by `get`. The double never deletes a table by itself: a test
//!   that lets one expire deletes it ([`crate::BigQueryDouble::delete_table`]);
//! - errors are Google API error bodies: `{"error": {"code", "message", "status", "errors": [{"reason"}]}}`.
//!
//! - `tables.list` pages through a dataset's tables by id, with their labels;
//! - `tables.delete` removes the table and its streams (200 `{}`), 404 when
//!   it does not exist;
//! - `datasets.get` answers a dataset's `location` and default expirations
//!   ([`crate::state::Dataset`]), which `tables.insert` applies to what a
//!   request leaves out.
//!
//! - `tableConstraints.primaryKey.columns` and `maxStaleness` (change data
//!   capture, see [`crate::cdc`]) are read by `insert`, checked, kept and
//!   returned by `get`; `patch` leaves them as they are.
//!
//! The job methods (`jobs.insert`, `jobs.get`) live in [`crate::jobs`] and
//! are routed here.
//!
//! Write streams keep the schema they were created with; only streams
//! created after a change see it, as the Storage Write API documents.
//!
//! `tabledata.list` (https://cloud.google.com/bigquery/docs/reference/rest/v2/tabledata/list)
//! answers the table's rows (materialized rows, then visible stream rows:
//! [`crate::state::Inner::visible_batches`]) as
//! `{"kind": "bigquery#tableDataList", "totalRows", "rows": [{"f": [{"v"}]}]}`
//! with cells in the schema's column order and scalars as strings, as the
//! API does. The API pages at a size of its choosing; the double answers
//! with one page (no `pageToken`), which a client must accept.
//!
//! The JSON schema is read by the double's own parser, not the sink's.

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableFieldSchema, TableSchema,
    table_field_schema::{Mode, Type},
};
use serde_json::{Value, json};

use crate::partition::TimePartitioning;
use crate::{EtagMode, RestFault, Shared, jobs, state};

pub(crate) fn error(code: StatusCode, status: &str, reason: &str, message: String) -> Response {
    let body = json!({
        "error": {
            "code": code.as_u16(),
            "message": message,
            "status": status,
            "errors": [{ "message": message, "domain": "global", "reason": reason }],
        }
    });
    (code, Json(body)).into_response()
}

fn type_name(t: i32) -> &'static str {
    match Type::try_from(t).unwrap_or(Type::Unspecified) {
        Type::Int64 => "INTEGER",
        Type::Double => "FLOAT",
        Type::Numeric => "NUMERIC",
        Type::Bignumeric => "BIGNUMERIC",
        Type::Bool => "BOOLEAN",
        Type::String => "STRING",
        Type::Bytes => "BYTES",
        Type::Date => "DATE",
        Type::Datetime => "DATETIME",
        Type::Time => "TIME",
        Type::Timestamp => "TIMESTAMP",
        Type::Struct => "RECORD",
        Type::Json => "JSON",
        Type::Geography => "GEOGRAPHY",
        Type::Interval => "INTERVAL",
        Type::Range => "RANGE",
        Type::Unspecified => "TYPE_UNSPECIFIED",
    }
}

fn mode_name(m: i32) -> &'static str {
    match Mode::try_from(m).unwrap_or(Mode::Nullable) {
        Mode::Required => "REQUIRED",
        Mode::Repeated => "REPEATED",
        _ => "NULLABLE",
    }
}

/// The REST form of a schema's fields (legacy type names, as `tables.get` answers).
fn to_json(fields: &[TableFieldSchema]) -> Value {
    Value::Array(
        fields
            .iter()
            .map(|f| {
                let mut v = json!({ "name": f.name, "type": type_name(f.r#type), "mode": mode_name(f.mode) });
                if !f.fields.is_empty() {
                    v["fields"] = to_json(&f.fields);
                }
                if f.precision > 0 {
                    v["precision"] = Value::String(f.precision.to_string());
                    v["scale"] = Value::String(f.scale.to_string());
                }
                v
            })
            .collect(),
    )
}

/// Reads REST schema fields: standard and legacy type names, mode
/// defaulting to NULLABLE, int64 numbers as strings or numbers.
fn from_json(fields: &Value) -> Result<Vec<TableFieldSchema>, String> {
    let Value::Array(list) = fields else { return Err("schema.fields must be an array".into()) };
    let number = |v: Option<&Value>| match v {
        Some(Value::String(s)) => s.parse::<i64>().map_err(|e| format!("{s:?}: {e}")),
        Some(Value::Number(n)) => n.as_i64().ok_or_else(|| format!("{n} is not an integer")),
        _ => Ok(0),
    };
    list.iter()
        .map(|f| {
            let name = f.get("name").and_then(Value::as_str).ok_or("a field has no name")?.to_string();
            let ty = match f.get("type").and_then(Value::as_str).unwrap_or("").to_ascii_uppercase().as_str() {
                "INTEGER" | "INT64" => Type::Int64,
                "FLOAT" | "FLOAT64" => Type::Double,
                "NUMERIC" => Type::Numeric,
                "BIGNUMERIC" => Type::Bignumeric,
                "BOOLEAN" | "BOOL" => Type::Bool,
                "STRING" => Type::String,
                "BYTES" => Type::Bytes,
                "DATE" => Type::Date,
                "DATETIME" => Type::Datetime,
                "TIME" => Type::Time,
                "TIMESTAMP" => Type::Timestamp,
                "RECORD" | "STRUCT" => Type::Struct,
                "JSON" => Type::Json,
                "GEOGRAPHY" => Type::Geography,
                other => return Err(format!("Invalid field type {other:?} for field {name}")),
            };
            let mode = match f.get("mode").and_then(Value::as_str).map(str::to_ascii_uppercase).as_deref() {
                None | Some("NULLABLE") => Mode::Nullable,
                Some("REQUIRED") => Mode::Required,
                Some("REPEATED") => Mode::Repeated,
                Some(other) => return Err(format!("Invalid mode {other:?} for field {name}")),
            };
            let children = match f.get("fields") {
                Some(v) => from_json(v)?,
                None => Vec::new(),
            };
            Ok(TableFieldSchema {
                name,
                r#type: ty as i32,
                mode: mode as i32,
                fields: children,
                precision: number(f.get("precision"))?,
                scale: number(f.get("scale"))?,
                ..Default::default()
            })
        })
        .collect()
}

/// Why `new` may not replace `old` ("Modifying table schemas").
fn check_patch(old: &[TableFieldSchema], new: &[TableFieldSchema], prefix: &str) -> Result<(), String> {
    for o in old {
        let path = format!("{prefix}{}", o.name);
        let Some(n) = new.iter().find(|n| n.name.eq_ignore_ascii_case(&o.name)) else {
            return Err(format!("Field {path} is missing in new schema"));
        };
        if n.r#type != o.r#type {
            return Err(format!(
                "Field {path} has changed type from {} to {}",
                type_name(o.r#type),
                type_name(n.r#type)
            ));
        }
        let relaxed = o.mode == Mode::Required as i32 && n.mode == Mode::Nullable as i32;
        if n.mode != o.mode && !relaxed {
            return Err(format!("Field {path} has changed mode from {} to {}", mode_name(o.mode), mode_name(n.mode)));
        }
        check_patch(&o.fields, &n.fields, &format!("{path}."))?;
    }
    for n in new {
        if !old.iter().any(|o| o.name.eq_ignore_ascii_case(&n.name)) && n.mode == Mode::Required as i32 {
            return Err(format!("Cannot add required fields to an existing schema. (field: {prefix}{})", n.name));
        }
    }
    Ok(())
}

pub(crate) fn unavailable() -> Response {
    error(StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE", "backendError", "Backend error. Please try again.".into())
}

fn table_path(p: &str, d: &str, t: &str) -> String {
    format!("projects/{p}/datasets/{d}/tables/{t}")
}

fn resource(p: &str, d: &str, t: &str, table: &state::Table) -> Value {
    let mut resource = json!({
        "kind": "bigquery#table",
        "etag": etag(table),
        "id": format!("{p}:{d}.{t}"),
        "tableReference": { "projectId": p, "datasetId": d, "tableId": t },
        "schema": { "fields": to_json(&table.schema.fields) },
        "type": "TABLE",
    });
    // Like the API, the resource leaves out what the table does not have.
    if !table.labels.is_empty() {
        resource["labels"] = Value::Object(table.labels.clone());
    }
    if let Some(description) = &table.description {
        resource["description"] = Value::String(description.clone());
    }
    if let Some(partitioning) = &table.time_partitioning {
        resource["timePartitioning"] = partitioning.to_json();
    }
    if let Some(at) = table.expiration_time {
        resource["expirationTime"] = Value::String(at.to_string());
    }
    if !table.primary_key.is_empty() {
        resource["tableConstraints"] = json!({ "primaryKey": { "columns": table.primary_key } });
    }
    if let Some(staleness) = &table.max_staleness {
        resource["maxStaleness"] = Value::String(staleness.clone());
    }
    resource
}

/// `tableConstraints.primaryKey.columns` of a table resource
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables#TableConstraints):
/// every column must be a top-level column of the schema, named once, at
/// most 16 of them ("composite primary keys containing up to 16 columns are
/// supported", change-data-capture); empty when absent.
fn primary_key(body: &Value, schema: &TableSchema) -> Result<Vec<String>, String> {
    let Some(columns) = body.pointer("/tableConstraints/primaryKey/columns") else { return Ok(Vec::new()) };
    let Some(columns) = columns.as_array() else { return Err("primaryKey.columns must be an array".into()) };
    let mut key: Vec<String> = Vec::new();
    for c in columns {
        let Some(name) = c.as_str() else { return Err(format!("primaryKey.columns: {c} is not a column name")) };
        if !schema.fields.iter().any(|f| f.name.eq_ignore_ascii_case(name)) {
            return Err(format!("Primary key column {name} does not exist in the table schema"));
        }
        if key.iter().any(|k| k.eq_ignore_ascii_case(name)) {
            return Err(format!("Primary key column {name} is named twice"));
        }
        key.push(name.to_string());
    }
    if key.len() > 16 {
        return Err(format!("A primary key may have at most 16 columns, not {}", key.len()));
    }
    Ok(key)
}

/// `maxStaleness` of a table resource: "The maximum staleness of data that
/// could be returned when the table (or stale MV) is queried. Staleness
/// encoded as a string encoding of sql IntervalValue type", i.e. BigQuery's
/// canonical INTERVAL text `Y-M D H:M:S` (e.g. `0-0 0 0:15:0`). The double
/// checks that shape and keeps the text.
fn max_staleness(body: &Value) -> Result<Option<String>, String> {
    match body.get("maxStaleness") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            let parts: Vec<&str> = s.split(' ').collect();
            let num =
                |t: &str| !t.is_empty() && t.trim_start_matches('-').chars().all(|c| c.is_ascii_digit() || c == '.');
            let ok = parts.len() == 3
                && parts[0].split('-').filter(|p| !p.is_empty()).count() == 2
                && num(parts[1])
                && parts[2].split(':').count() == 3
                && parts[2].split(':').all(num);
            if ok {
                Ok(Some(s.clone()))
            } else {
                Err(format!("Invalid maxStaleness {s:?}: expected an INTERVAL as Y-M D H:M:S"))
            }
        }
        Some(other) => Err(format!("Invalid maxStaleness: {other}")),
    }
}

/// `expirationTime` of a table resource: an int64 in ms since the epoch,
/// which JSON carries as a string (a number is taken too); `Ok(None)` when absent.
fn expiration(body: &Value) -> Result<Option<i64>, String> {
    match body.get("expirationTime") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => s.parse().map(Some).map_err(|_| format!("Invalid expirationTime: {s}")),
        Some(Value::Number(n)) => n.as_i64().map(Some).ok_or_else(|| format!("Invalid expirationTime: {n}")),
        Some(other) => Err(format!("Invalid expirationTime: {other}")),
    }
}

/// The labels of a table resource as given: keys and values of at most 63
/// lowercase letters, digits, `_` and `-`, keys starting with a letter
/// (https://cloud.google.com/bigquery/docs/labels-intro#requirements).
fn labels(body: &Value) -> Result<serde_json::Map<String, Value>, String> {
    let Some(given) = body.get("labels") else { return Ok(serde_json::Map::new()) };
    let Some(map) = given.as_object() else { return Err("labels must be an object".into()) };
    let ok = |s: &str| {
        s.len() <= 63 && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
    };
    for (key, value) in map {
        let value = value.as_str().unwrap_or("");
        if !ok(key) || !key.starts_with(|c: char| c.is_ascii_lowercase()) || !ok(value) {
            return Err(format!("Invalid label: {key}:{value}"));
        }
    }
    Ok(map.clone())
}

fn etag(table: &state::Table) -> String {
    format!("\"v{}\"", table.version)
}

/// UNAUTHENTICATED unless the call carries the token the double requires.
pub(crate) fn unauthorized(shared: &Shared, headers: &HeaderMap) -> Option<Response> {
    let token = shared.token.lock().unwrap_or_else(|p| p.into_inner()).clone()?;
    let given = headers.get("authorization").and_then(|v| v.to_str().ok());
    if token.accepts(given) {
        return None;
    }
    shared.unauthenticated.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    Some(error(
        StatusCode::UNAUTHORIZED,
        "UNAUTHENTICATED",
        "required",
        "Request is missing required authentication credential.".into(),
    ))
}

async fn get_table(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d, t)): Path<(String, String, String)>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    if shared.count_rest("tables.get").is_some() {
        return unavailable();
    }
    let inner = shared.inner();
    match inner.tables.get(&table_path(&p, &d, &t)) {
        Some(table) => Json(resource(&p, &d, &t, table)).into_response(),
        None => error(StatusCode::NOT_FOUND, "NOT_FOUND", "notFound", format!("Not found: Table {p}:{d}.{t}")),
    }
}

async fn insert_table(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d)): Path<(String, String)>,
    Json(body): Json<Value>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let fault = shared.count_rest("tables.insert");
    if fault == Some(RestFault::FailBeforeApply) {
        return unavailable();
    }
    let Some(t) = body.pointer("/tableReference/tableId").and_then(Value::as_str).map(str::to_string) else {
        return error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "invalid",
            "tableReference.tableId is required".into(),
        );
    };
    let fields = match from_json(body.pointer("/schema/fields").unwrap_or(&Value::Array(Vec::new()))) {
        Ok(f) => f,
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    };
    let path = table_path(&p, &d, &t);
    let mut inner = shared.inner();
    if inner.tables.contains_key(&path) {
        return error(
            StatusCode::CONFLICT,
            "ALREADY_EXISTS",
            "duplicate",
            format!("Already Exists: Table {p}:{d}.{t}"),
        );
    }
    let labels = match labels(&body) {
        Ok(l) => l,
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    };
    if body.get("rangePartitioning").is_some() {
        return error(
            StatusCode::BAD_REQUEST,
            "INVALID_ARGUMENT",
            "invalid",
            "rangePartitioning is not supported by this double".into(),
        );
    }
    let schema = TableSchema { fields };
    let time_partitioning = match body.get("timePartitioning") {
        None | Some(Value::Null) => None,
        Some(v) => match TimePartitioning::from_json(v, &schema) {
            Ok(tp) => Some(tp),
            Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
        },
    };
    let expiration_time = match expiration(&body) {
        Ok(at) => at,
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    };
    // The dataset's defaults apply to what the request leaves out
    // (`state::Dataset`): a partitioned table takes the default partition
    // expiration, and then no table expiration; another takes the default
    // table expiration from now.
    let dataset = inner.datasets.get(&format!("projects/{p}/datasets/{d}")).cloned().unwrap_or_default();
    let mut time_partitioning = time_partitioning;
    let mut expiration_time = expiration_time;
    match time_partitioning.as_mut() {
        Some(tp) if dataset.default_partition_expiration_ms.is_some() => {
            if tp.expiration_ms.is_none() {
                tp.expiration_ms = dataset.default_partition_expiration_ms;
            }
        }
        _ => {
            if expiration_time.is_none()
                && let Some(ms) = dataset.default_table_expiration_ms
            {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as i64)
                    .unwrap_or(0);
                expiration_time = Some(now + ms);
            }
        }
    }
    let key = match primary_key(&body, &schema) {
        Ok(k) => k,
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    };
    let staleness = match max_staleness(&body) {
        Ok(s) => s,
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    };
    let mut table = state::Table::new(schema);
    table.primary_key = key;
    table.max_staleness = staleness;
    table.time_partitioning = time_partitioning;
    table.expiration_time = expiration_time;
    table.labels = labels;
    table.description = body.get("description").and_then(Value::as_str).map(str::to_string);
    let reply = resource(&p, &d, &t, &table);
    inner.tables.insert(path, table);
    if fault == Some(RestFault::ApplyThenFail) {
        return unavailable();
    }
    Json(reply).into_response()
}

async fn patch_table(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d, t)): Path<(String, String, String)>,
    Json(body): Json<Value>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let fault = shared.count_rest("tables.patch");
    if fault == Some(RestFault::FailBeforeApply) {
        return unavailable();
    }
    let honour = *shared.etag_mode.lock().unwrap_or_else(|e| e.into_inner()) == EtagMode::Honour;
    let mut inner = shared.inner();
    let Some(table) = inner.tables.get_mut(&table_path(&p, &d, &t)) else {
        return error(StatusCode::NOT_FOUND, "NOT_FOUND", "notFound", format!("Not found: Table {p}:{d}.{t}"));
    };
    if honour
        && let Some(given) = headers.get("if-match").and_then(|v| v.to_str().ok())
        && given != etag(table)
    {
        return error(
            StatusCode::PRECONDITION_FAILED,
            "FAILED_PRECONDITION",
            "conditionNotMet",
            "Precondition check failed.".into(),
        );
    }
    if let Some(fields) = body.pointer("/schema/fields") {
        let fields = match from_json(fields) {
            Ok(f) => f,
            Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
        };
        if let Err(why) = check_patch(&table.schema.fields, &fields, "") {
            return error(
                StatusCode::BAD_REQUEST,
                "INVALID_ARGUMENT",
                "invalid",
                format!("Provided Schema does not match Table {p}:{d}.{t}. {why}"),
            );
        }
        table.schema = TableSchema { fields };
        table.version += 1;
    }
    match expiration(&body) {
        Ok(None) => {}
        Ok(Some(at)) => {
            table.expiration_time = Some(at);
            table.version += 1;
        }
        Err(m) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", m),
    }
    if fault == Some(RestFault::ApplyThenFail) {
        return unavailable();
    }
    Json(resource(&p, &d, &t, table)).into_response()
}

/// `GET /bigquery/v2/projects/{p}/datasets/{d}/tables`
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/list):
/// "Lists all tables in the specified dataset", as
/// `{"kind": "bigquery#tableList", "tables": [...], "nextPageToken", "totalItems"}`,
/// each entry with `tableReference`, `type` and `labels` ("The labels
/// associated with this table"). Pages hold `maxResults` tables (the
/// double's default is 50); `pageToken` is the `nextPageToken` of the page
/// before, which the last page leaves out. Tables are listed by id.
async fn list_tables(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d)): Path<(String, String)>,
    uri: axum::http::Uri,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    if shared.count_rest("tables.list").is_some() {
        return unavailable();
    }
    let param = |name: &str| {
        uri.query().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=').map(str::to_string))
    };
    let page = match param("maxResults").map(|v| v.parse::<usize>()) {
        None => 50,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", "Invalid maxResults".into()),
    };
    let start = match param("pageToken").map(|v| v.parse::<usize>()) {
        None => 0,
        Some(Ok(n)) => n,
        Some(Err(_)) => {
            return error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", "Invalid pageToken".into());
        }
    };
    let inner = shared.inner();
    let prefix = format!("projects/{p}/datasets/{d}/tables/");
    let mut ids: Vec<(&str, &state::Table)> =
        inner.tables.iter().filter_map(|(path, t)| Some((path.strip_prefix(&prefix)?, t))).collect();
    ids.sort_by(|a, b| a.0.cmp(b.0));
    let total = ids.len();
    let tables: Vec<Value> = ids
        .iter()
        .skip(start)
        .take(page)
        .map(|(t, table)| {
            let mut entry = json!({
                "kind": "bigquery#table",
                "id": format!("{p}:{d}.{t}"),
                "tableReference": { "projectId": p, "datasetId": d, "tableId": t },
                "type": "TABLE",
            });
            if !table.labels.is_empty() {
                entry["labels"] = Value::Object(table.labels.clone());
            }
            entry
        })
        .collect();
    let mut reply = json!({ "kind": "bigquery#tableList", "tables": tables, "totalItems": total });
    if start + page < total {
        reply["nextPageToken"] = Value::String((start + page).to_string());
    }
    Json(reply).into_response()
}

/// `GET /bigquery/v2/projects/{p}/datasets/{d}`
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/datasets/get):
/// the dataset resource with `datasetReference`, `location` and, when set,
/// `defaultTableExpirationMs` and `defaultPartitionExpirationMs` (int64s
/// as strings).
async fn get_dataset(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d)): Path<(String, String)>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    if shared.count_rest("datasets.get").is_some() {
        return unavailable();
    }
    let dataset = shared.inner().datasets.get(&format!("projects/{p}/datasets/{d}")).cloned().unwrap_or_default();
    let mut resource = json!({
        "kind": "bigquery#dataset",
        "id": format!("{p}:{d}"),
        "datasetReference": { "projectId": p, "datasetId": d },
        "location": dataset.location,
    });
    if let Some(ms) = dataset.default_table_expiration_ms {
        resource["defaultTableExpirationMs"] = Value::String(ms.to_string());
    }
    if let Some(ms) = dataset.default_partition_expiration_ms {
        resource["defaultPartitionExpirationMs"] = Value::String(ms.to_string());
    }
    Json(resource).into_response()
}

/// `DELETE /bigquery/v2/projects/{p}/datasets/{d}/tables/{t}`
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/delete):
/// "Deletes the table specified by tableId from the dataset. If the table
/// contains data, all the data will be deleted"; "If successful, the
/// response body is an empty JSON object". A missing table is 404
/// `notFound`, as for `get`. Its write streams go with it.
async fn delete_table(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d, t)): Path<(String, String, String)>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let fault = shared.count_rest("tables.delete");
    if fault == Some(RestFault::FailBeforeApply) {
        return unavailable();
    }
    let path = table_path(&p, &d, &t);
    let mut inner = shared.inner();
    if inner.tables.remove(&path).is_none() {
        return error(StatusCode::NOT_FOUND, "NOT_FOUND", "notFound", format!("Not found: Table {p}:{d}.{t}"));
    }
    let prefix = format!("{path}/streams/");
    inner.streams.retain(|name, _| !name.starts_with(&prefix));
    drop(inner);
    if fault == Some(RestFault::ApplyThenFail) {
        return unavailable();
    }
    Json(serde_json::json!({})).into_response()
}

/// A cell of `tabledata.list`: scalars as strings, REPEATED as a list of
/// cells, RECORD as a row.
fn cell(value: &Value) -> Value {
    match value {
        Value::Null => Value::Null,
        Value::String(s) => Value::String(s.clone()),
        Value::Array(items) => Value::Array(items.iter().map(|v| serde_json::json!({ "v": cell(v) })).collect()),
        Value::Object(fields) => {
            serde_json::json!({ "f": fields.values().map(|v| serde_json::json!({ "v": cell(v) })).collect::<Vec<_>>() })
        }
        other => Value::String(other.to_string()),
    }
}

async fn list_table_data(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, d, t)): Path<(String, String, String)>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let inner = shared.inner();
    let path = table_path(&p, &d, &t);
    let Some(table) = inner.tables.get(&path) else {
        return error(StatusCode::NOT_FOUND, "NOT_FOUND", "notFound", format!("Not found: Table {p}:{d}.{t}"));
    };
    let names: Vec<&str> = table.schema.fields.iter().map(|f| f.name.as_str()).collect();
    let rows: Vec<Value> = inner
        .visible_batches(&path)
        .iter()
        .flat_map(crate::state::StoredRows::to_json)
        .map(|row| {
            let cells: Vec<Value> =
                names.iter().map(|n| serde_json::json!({ "v": cell(row.get(*n).unwrap_or(&Value::Null)) })).collect();
            serde_json::json!({ "f": cells })
        })
        .collect();
    Json(serde_json::json!({
        "kind": "bigquery#tableDataList",
        "totalRows": rows.len().to_string(),
        "rows": rows,
    }))
    .into_response()
}

/// The routes of the table methods.
pub(crate) fn router(shared: Arc<Shared>) -> axum::Router {
    axum::Router::new()
        .route(
            "/bigquery/v2/projects/{p}/datasets/{d}/tables/{t}",
            get(get_table).patch(patch_table).delete(delete_table),
        )
        .route("/bigquery/v2/projects/{p}/datasets/{d}/tables/{t}/data", get(list_table_data))
        .route("/bigquery/v2/projects/{p}/datasets/{d}/tables", post(insert_table).get(list_tables))
        .route("/bigquery/v2/projects/{p}/datasets/{d}", get(get_dataset))
        .route("/bigquery/v2/projects/{p}/jobs", post(jobs::insert_job))
        .route("/bigquery/v2/projects/{p}/jobs/{j}", get(jobs::get_job))
        .with_state(shared)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str, ty: Type, mode: Mode) -> TableFieldSchema {
        TableFieldSchema { name: name.into(), r#type: ty as i32, mode: mode as i32, ..Default::default() }
    }

    #[test]
    fn patches_may_only_add_nullable_columns_and_relax_modes() {
        let old = vec![field("id", Type::Int64, Mode::Required), field("qty", Type::Int64, Mode::Required)];
        let ok = vec![
            field("id", Type::Int64, Mode::Required),
            field("qty", Type::Int64, Mode::Nullable),
            field("tag", Type::String, Mode::Nullable),
        ];
        assert_eq!(check_patch(&old, &ok, ""), Ok(()));
        let dropped = vec![field("id", Type::Int64, Mode::Required)];
        assert!(check_patch(&old, &dropped, "").is_err_and(|m| m.contains("qty is missing")));
        let retyped = vec![field("id", Type::String, Mode::Required), field("qty", Type::Int64, Mode::Required)];
        assert!(check_patch(&old, &retyped, "").is_err_and(|m| m.contains("changed type")));
        let mut required = ok.clone();
        required[2].mode = Mode::Required as i32;
        assert!(check_patch(&old, &required, "").is_err_and(|m| m.contains("Cannot add required")));
        assert_eq!(from_json(&to_json(&ok)), Ok(ok));
    }
}
