//! The BigQuery API's table methods (REST, `bigquery/v2`), over `wasi:http`:
//! `tables.get`, `tables.insert` and `tables.patch`, to create tables,
//! evolve their schemas and move a staging table's expiration. The plugin addresses the host's HTTP endpoint by
//! name (`http://<rest_endpoint>/bigquery/v2/...`); the host maps it to the
//! job's address and adds the credentials.
//!
//! Semantics relied on (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables):
//! - `tables.get` answers 404 for a missing table;
//! - `tables.insert` answers 409 when the table exists already (another
//!   writer created it first: read it and go on);
//! - `tables.patch` "only replaces fields that are provided in the submitted
//!   table resource": a patch with `schema` replaces the whole schema, and
//!   the service refuses one that drops or narrows a column. The documentation
//!   does not say whether `If-Match` with the table's `etag` is honoured, so
//!   the request carries it and the caller survives both: a 412 (someone
//!   changed the table) and a refusal are answered by reading the table again.
//!
//! - jobs.insert (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/insert)
//!   with a client-chosen `jobReference.jobId` answers 409 `duplicate` for
//!   an id it has seen ("If the BigQuery REST API receives a jobs.insert
//!   request for a job with the same ID, the REST API fails because the job
//!   already exists"); jobs.get
//!   (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/get)
//!   answers 404 for an unknown id. [`Jobs`] keeps those answers apart,
//!   because they are what tells a lost insert from one never made.
//!
//! The `wasi:http` client is written here rather than taken from a crate:
//! the crates that wrap it (waki, wstd) are async runtimes or pull in more
//! than these three calls need, and the raw bindings come with `wasip2`.

use std::io::{Read, Write};

use serde_json::{Value, json};
use wasip2::http::outgoing_handler;
use wasip2::http::types::{ErrorCode, Fields, Method, OutgoingBody, OutgoingRequest, RequestOptions, Scheme};

/// What went wrong with one HTTP call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RestError {
    /// The host refused the endpoint name (not granted in `[sink.http]`).
    Denied(String),
    /// The request did not get an answer (connection, timeout): may be retried.
    Transport(String),
    /// The service answered with an error status; `reason` is the first
    /// `error.errors[].reason` of the body (`rateLimitExceeded`, `duplicate`, ...).
    Status { status: u16, message: String, reason: Option<String> },
}

impl std::fmt::Display for RestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestError::Denied(m) | RestError::Transport(m) => f.write_str(m),
            RestError::Status { status, message, .. } => write!(f, "HTTP {status}: {message}"),
        }
    }
}

impl RestError {
    pub fn is_transient(&self) -> bool {
        match self {
            RestError::Transport(_) => true,
            // Rate limits and the service's own failures. BigQuery answers a
            // rate or quota limit as 403 with reason `rateLimitExceeded` or
            // `quotaExceeded` ("retry the operation after a few seconds.
            // Use exponential backoff", https://cloud.google.com/bigquery/docs/troubleshooting-errors);
            // the request applied nothing.
            RestError::Status { status, reason, .. } => {
                matches!(status, 429 | 500 | 502 | 503 | 504)
                    || (*status == 403 && reason.as_deref().is_some_and(|r| LIMIT_REASONS.contains(&r)))
            }
            RestError::Denied(_) => false,
        }
    }
}

/// The `reason`s of a rate or quota limit: nothing was applied, and the
/// same request may be sent again after a wait
/// (https://cloud.google.com/bigquery/docs/troubleshooting-errors).
pub(crate) const LIMIT_REASONS: [&str; 2] = ["rateLimitExceeded", "quotaExceeded"];

/// One answered call: status and body.
struct Reply {
    status: u16,
    body: Vec<u8>,
}

fn transport(endpoint: &str, e: ErrorCode) -> RestError {
    match e {
        ErrorCode::HttpRequestDenied => RestError::Denied(format!(
            "the host denied HTTP endpoint `{endpoint}`: grant it in the job file as [sink.http.{endpoint}] address = \"https://bigquery.googleapis.com\""
        )),
        other => RestError::Transport(format!("HTTP endpoint `{endpoint}`: {other}")),
    }
}

/// Sends one request to `http://<endpoint><path>` and reads the whole reply.
fn send(
    endpoint: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
    timeout_ms: u32,
) -> Result<Reply, RestError> {
    let local = |what: &str| RestError::Transport(format!("HTTP endpoint `{endpoint}`: {what}"));
    let fields = Fields::new();
    for (name, value) in headers {
        fields.append(name, value.as_bytes()).map_err(|e| local(&format!("header {name}: {e:?}")))?;
    }
    if body.is_some() {
        fields.append("content-type", b"application/json").map_err(|e| local(&format!("header: {e:?}")))?;
    }
    let request = OutgoingRequest::new(fields);
    request.set_method(&method).map_err(|()| local("bad method"))?;
    request.set_scheme(Some(&Scheme::Http)).map_err(|()| local("bad scheme"))?;
    request.set_authority(Some(endpoint)).map_err(|()| local("bad endpoint name"))?;
    request.set_path_with_query(Some(path)).map_err(|()| local("bad path"))?;
    let outgoing = request.body().map_err(|()| local("no request body"))?;
    let options = RequestOptions::new();
    let nanos = u64::from(timeout_ms) * 1_000_000;
    // Hosts that do not support a timeout refuse to set it; theirs applies.
    let _ = options.set_connect_timeout(Some(nanos));
    let _ = options.set_first_byte_timeout(Some(nanos));
    let _ = options.set_between_bytes_timeout(Some(nanos));
    // The body is written after `handle`: the host streams it out, so a body
    // larger than its buffer cannot stall before the request leaves.
    let pending = outgoing_handler::handle(request, Some(options)).map_err(|e| transport(endpoint, e))?;
    // A request without a body writes none: a server may answer such a
    // request (a GET) before the client closes the body, and a write or a
    // flush into a body already closed fails although the answer is good.
    let written = (|| -> Result<(), String> {
        let Some(bytes) = body else { return Ok(()) };
        let mut stream = outgoing.write().map_err(|()| "cannot write the request body".to_string())?;
        stream.write_all(bytes).map_err(|e| format!("writing the request body: {e}"))?;
        stream.flush().map_err(|e| format!("writing the request body: {e}"))
    })();
    let response = match written {
        // The body could not be written: the request failed before its body
        // was taken (denied, refused), or the server answered first; the
        // response says which.
        Err(why) => {
            pending.subscribe().block();
            match pending.get() {
                Some(Ok(Ok(response))) => response,
                Some(Ok(Err(e))) => return Err(transport(endpoint, e)),
                Some(Err(())) | None => return Err(local(&why)),
            }
        }
        Ok(()) => {
            // Finishing a body the host already closed (the request was
            // answered or failed) is no failure of its own: the response
            // says how it went.
            let _ = OutgoingBody::finish(outgoing, None);
            pending.subscribe().block();
            match pending.get() {
                Some(Ok(Ok(response))) => response,
                Some(Ok(Err(e))) => return Err(transport(endpoint, e)),
                Some(Err(())) | None => return Err(local("the response was already taken")),
            }
        }
    };
    let status = response.status();
    let incoming = response.consume().map_err(|()| local("no response body"))?;
    let mut bytes = Vec::new();
    {
        let mut stream = incoming.stream().map_err(|()| local("no response body stream"))?;
        stream.read_to_end(&mut bytes).map_err(|e| local(&format!("reading the response: {e}")))?;
    }
    drop(incoming);
    Ok(Reply { status, body: bytes })
}

/// The message of a Google API error body (`{"error": {"message": ...}}`),
/// or the body itself.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(300).collect())
}

/// The first `error.errors[].reason` of a Google API error body.
fn error_reason(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/errors/0/reason").and_then(Value::as_str).map(str::to_string))
}

fn json_reply(reply: Reply) -> Result<Value, RestError> {
    if !(200..300).contains(&reply.status) {
        return Err(RestError::Status {
            status: reply.status,
            message: error_message(&reply.body),
            reason: error_reason(&reply.body),
        });
    }
    serde_json::from_slice(&reply.body).map_err(|e| RestError::Status {
        status: reply.status,
        message: format!("the reply is not JSON: {e}"),
        reason: None,
    })
}

/// A table's `labels`.
pub(crate) type Labels = serde_json::Map<String, Value>;

/// A table as `tables.get` returns it, as far as Sluice reads it.
#[derive(Debug, Clone)]
pub(crate) struct RestTable {
    /// `schema.fields`.
    pub fields: Value,
    pub etag: Option<String>,
    /// `labels` (absent: none).
    pub labels: serde_json::Map<String, Value>,
    /// `expirationTime` (ms since the epoch, as a string), when the table expires.
    pub expires: Option<String>,
    /// `timePartitioning` as the API returns it (absent: not time-partitioned).
    pub time_partitioning: Option<Value>,
    /// `tableConstraints.primaryKey.columns` (empty: no primary key).
    pub primary_key: Vec<String>,
    /// `maxStaleness` (an INTERVAL's text), when set.
    pub max_staleness: Option<String>,
}

impl RestTable {
    fn from_json(v: Value) -> Self {
        RestTable {
            fields: v.pointer("/schema/fields").cloned().unwrap_or(Value::Array(Vec::new())),
            etag: v.get("etag").and_then(Value::as_str).map(str::to_string),
            labels: v.get("labels").and_then(Value::as_object).cloned().unwrap_or_default(),
            expires: v.get("expirationTime").and_then(Value::as_str).map(str::to_string),
            time_partitioning: v.get("timePartitioning").filter(|t| t.is_object()).cloned(),
            primary_key: v
                .pointer("/tableConstraints/primaryKey/columns")
                .and_then(Value::as_array)
                .map(|cols| cols.iter().filter_map(Value::as_str).map(str::to_string).collect())
                .unwrap_or_default(),
            max_staleness: v.get("maxStaleness").and_then(Value::as_str).map(str::to_string),
        }
    }
}

/// The tables API of one endpoint.
pub(crate) struct Tables<'a> {
    pub endpoint: &'a str,
    pub timeout_ms: u32,
    /// How reads are retried on transient failures (a read changes
    /// nothing, so it is always safe to send again).
    pub retry: sluice_retry::Policy,
}

/// `projects/P/datasets/D/tables/T` → (`P`, `D`, `T`).
pub(crate) fn parts(table: &str) -> (&str, &str, &str) {
    let p: Vec<&str> = table.split('/').collect();
    match p.as_slice() {
        [_, project, _, dataset, _, id] => (project, dataset, id),
        _ => ("", "", ""),
    }
}

impl Tables<'_> {
    /// `tables.get`: `None` when the table does not exist.
    pub fn get(&self, table: &str) -> Result<Option<RestTable>, RestError> {
        let once = |_| {
            let reply = send(self.endpoint, Method::Get, &format!("/bigquery/v2/{table}"), &[], None, self.timeout_ms)?;
            if reply.status == 404 {
                return Ok(None);
            }
            json_reply(reply).map(|v| Some(RestTable::from_json(v)))
        };
        self.retry.run(once, RestError::is_transient, |_, _, _| {}).map_err(|failed| failed.error)
    }

    /// The `location` of a dataset, read with `datasets.get`
    /// (https://cloud.google.com/bigquery/docs/reference/rest/v2/datasets/get);
    /// `None` when the dataset does not exist or names none.
    pub fn dataset_location(&self, project: &str, dataset: &str) -> Result<Option<String>, RestError> {
        let once = |_| {
            let path = format!("/bigquery/v2/projects/{project}/datasets/{dataset}");
            let reply = send(self.endpoint, Method::Get, &path, &[], None, self.timeout_ms)?;
            if reply.status == 404 {
                return Ok(None);
            }
            json_reply(reply).map(|v| v.get("location").and_then(Value::as_str).map(str::to_string))
        };
        self.retry.run(once, RestError::is_transient, |_, _, _| {}).map_err(|failed| failed.error)
    }

    /// Every table of a dataset, with its labels: `tables.list`
    /// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/list),
    /// page by page (`pageToken` from `nextPageToken`).
    pub fn list(&self, project: &str, dataset: &str) -> Result<Vec<(String, Labels)>, RestError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut path = format!("/bigquery/v2/projects/{project}/datasets/{dataset}/tables?maxResults=1000");
            if let Some(t) = &token {
                // The token is opaque (it may hold any character): encoded.
                path.push_str("&pageToken=");
                path.extend(percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC));
            }
            let once = |_| json_reply(send(self.endpoint, Method::Get, &path, &[], None, self.timeout_ms)?);
            let page = self.retry.run(once, RestError::is_transient, |_, _, _| {}).map_err(|failed| failed.error)?;
            for table in page.get("tables").and_then(Value::as_array).into_iter().flatten() {
                if let Some(id) = table.pointer("/tableReference/tableId").and_then(Value::as_str) {
                    let labels = table.get("labels").and_then(Value::as_object).cloned().unwrap_or_default();
                    out.push((id.to_string(), labels));
                }
            }
            match page.get("nextPageToken").and_then(Value::as_str).filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t.to_string()),
                None => return Ok(out),
            }
        }
    }

    /// `tables.insert`: `Ok(false)` when the table exists already (409).
    pub fn insert(&self, table: &str, fields: &Value) -> Result<bool, RestError> {
        self.insert_with(table, json!({ "schema": { "fields": fields } }))
    }

    /// `tables.insert` of a table with `fields`, a primary key
    /// (`tableConstraints.primaryKey.columns`, which BigQuery keeps NOT
    /// ENFORCED) and, when given, `maxStaleness` (an INTERVAL's text), as
    /// change data capture needs
    /// (https://cloud.google.com/bigquery/docs/change-data-capture,
    /// https://cloud.google.com/bigquery/docs/reference/rest/v2/tables#TableConstraints):
    /// `Ok(false)` when it exists already (409).
    pub fn insert_keyed(
        &self,
        table: &str,
        fields: &Value,
        key: &[String],
        max_staleness: Option<&str>,
    ) -> Result<bool, RestError> {
        let mut resource = json!({
            "schema": { "fields": fields },
            "tableConstraints": { "primaryKey": { "columns": key } },
        });
        if let Some(staleness) = max_staleness {
            resource["maxStaleness"] = Value::String(staleness.to_string());
        }
        self.insert_with(table, resource)
    }

    /// `tables.insert` of a table with no columns, a description and
    /// labels: `Ok(false)` when it exists already (409). The API documents
    /// the 409, which makes this an exclusive create.
    pub fn insert_marker(&self, table: &str, description: &str, labels: &Value) -> Result<bool, RestError> {
        self.insert_with(table, json!({ "description": description, "labels": labels }))
    }

    /// [`Tables::insert_marker`] of a table that expires at `expires_ms`
    /// (ms since the epoch), set explicitly so that no dataset default
    /// (`defaultTableExpirationMs`) applies.
    pub fn insert_marker_expiring(
        &self,
        table: &str,
        description: &str,
        labels: &Value,
        expires_ms: u64,
    ) -> Result<bool, RestError> {
        self.insert_with(
            table,
            json!({ "description": description, "labels": labels, "expirationTime": expires_ms.to_string() }),
        )
    }

    /// `tables.insert` of a table with `fields`, `timePartitioning` and an
    /// expiration (ms since the epoch): `Ok(false)` when it exists already (409).
    pub fn insert_partitioned(
        &self,
        table: &str,
        fields: &Value,
        time_partitioning: &Value,
        expires_ms: u64,
    ) -> Result<bool, RestError> {
        self.insert_with(
            table,
            json!({
                "schema": { "fields": fields },
                "timePartitioning": time_partitioning,
                "expirationTime": expires_ms.to_string(),
            }),
        )
    }

    /// `tables.insert` of `resource` (given without its `tableReference`).
    fn insert_with(&self, table: &str, mut resource: Value) -> Result<bool, RestError> {
        let (project, dataset, id) = parts(table);
        resource["tableReference"] = json!({ "projectId": project, "datasetId": dataset, "tableId": id });
        let body = resource;
        let path = format!("/bigquery/v2/projects/{project}/datasets/{dataset}/tables");
        let reply = send(self.endpoint, Method::Post, &path, &[], Some(body.to_string().as_bytes()), self.timeout_ms)?;
        if reply.status == 409 {
            return Ok(false);
        }
        json_reply(reply).map(|_| true)
    }

    /// `tables.patch` of `expirationTime` alone (ms since the epoch): the
    /// patch "only replaces fields that are provided in the submitted table
    /// resource" (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/patch),
    /// so it leaves the schema and the rows as they are. Setting it again
    /// to the same time changes nothing, so it may be sent again.
    pub fn patch_expiration(&self, table: &str, expires_ms: u64) -> Result<(), RestError> {
        let body = json!({ "expirationTime": expires_ms.to_string() });
        let path = format!("/bigquery/v2/{table}");
        let reply = send(self.endpoint, Method::Patch, &path, &[], Some(body.to_string().as_bytes()), self.timeout_ms)?;
        json_reply(reply).map(|_| ())
    }

    /// `tables.delete` (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/delete):
    /// `Ok(false)` when no such table exists (404), so deleting again
    /// after a lost reply is no failure.
    pub fn delete(&self, table: &str) -> Result<bool, RestError> {
        let path = format!("/bigquery/v2/{table}");
        let reply = send(self.endpoint, Method::Delete, &path, &[], None, self.timeout_ms)?;
        if reply.status == 404 {
            return Ok(false);
        }
        if !(200..300).contains(&reply.status) {
            return Err(RestError::Status {
                status: reply.status,
                message: error_message(&reply.body),
                reason: error_reason(&reply.body),
            });
        }
        Ok(true)
    }

    /// `tables.patch` of the schema, guarded by `etag` where the service honours it.
    pub fn patch_schema(&self, table: &str, fields: &Value, etag: Option<&str>) -> Result<(), RestError> {
        let body = json!({ "schema": { "fields": fields } });
        let headers: Vec<(&str, &str)> = etag.map(|e| ("if-match", e)).into_iter().collect();
        let path = format!("/bigquery/v2/{table}");
        let reply =
            send(self.endpoint, Method::Patch, &path, &headers, Some(body.to_string().as_bytes()), self.timeout_ms)?;
        json_reply(reply).map(|_| ())
    }
}

/// How `jobs.insert` answered.
#[derive(Debug, Clone)]
pub(crate) enum Inserted {
    /// The job was created; its resource as the reply gives it.
    Created(Value),
    /// 409: a job with this id exists already (ours, from a try whose reply
    /// was lost, or from a run before a crash).
    Duplicate,
}

/// The job methods of one endpoint.
pub(crate) struct Jobs<'a> {
    pub endpoint: &'a str,
    pub timeout_ms: u32,
}

impl Jobs<'_> {
    /// `jobs.insert` of `job` (a Job resource with its `jobReference`) in
    /// `project`. An error may be an unknown outcome: only `jobs.get` of
    /// the same id can tell whether the job exists.
    pub fn insert(&self, project: &str, job: &Value) -> Result<Inserted, RestError> {
        let path = format!("/bigquery/v2/projects/{project}/jobs");
        let reply = send(self.endpoint, Method::Post, &path, &[], Some(job.to_string().as_bytes()), self.timeout_ms)?;
        if reply.status == 409 {
            return Ok(Inserted::Duplicate);
        }
        json_reply(reply).map(Inserted::Created)
    }

    /// `jobs.get`: `None` when no job has this id (404).
    pub fn get(&self, project: &str, job_id: &str, location: Option<&str>) -> Result<Option<Value>, RestError> {
        let mut path = format!("/bigquery/v2/projects/{project}/jobs/{job_id}");
        if let Some(location) = location {
            path.push_str(&format!("?location={location}"));
        }
        let reply = send(self.endpoint, Method::Get, &path, &[], None, self.timeout_ms)?;
        if reply.status == 404 {
            return Ok(None);
        }
        json_reply(reply).map(Some)
    }
}
