//! The BigQuery API's job methods, as far as copy jobs go: `jobs.insert`
//! with a `configuration.copy` and `jobs.get`, over the same tables.
//!
//! Semantics, quoted from the API reference:
//! - jobs.insert (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/insert)
//!   "Starts a new asynchronous job". A client may choose the id:
//!   `jobReference.jobId` "must contain only letters (a-z, A-Z), numbers
//!   (0-9), underscores (_), or dashes (-). The maximum length is 1,024
//!   characters" (https://cloud.google.com/bigquery/docs/reference/rest/v2/JobReference);
//!   generating it client-side is what lets a client retry the insert
//!   (https://cloud.google.com/bigquery/docs/running-jobs). An id seen
//!   before is refused with HTTP 409, reason `duplicate`: "This error
//!   returns when trying to create a job, dataset, or table that already
//!   exists" (https://cloud.google.com/bigquery/docs/troubleshooting-errors).
//!   The refused insert changes nothing.
//! - jobs.get (https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/get)
//!   "Returns information about a specific job"; an unknown id is 404 `notFound`.
//!   Its `location` parameter: "The geographic location of the job. You
//!   must specify the location to run the job for the following
//!   scenarios: If the location to run a job is not in the us or the eu
//!   multi-regional location; If the job's location is in a single region
//!   (for example, us-central1)". So a job whose location is not the `US`
//!   or `EU` multi-region is 404 to a `jobs.get` without its location (or
//!   with another).
//! - JobStatus (https://cloud.google.com/bigquery/docs/reference/rest/v2/Job#JobStatus):
//!   `state` is PENDING, RUNNING or DONE; `errorResult` "Final error result
//!   of the job. If present, indicates that the job has completed and was
//!   unsuccessful"; `errors` lists the errors met. Both are ErrorProto
//!   `{reason, location, debugInfo, message}`
//!   (https://cloud.google.com/bigquery/docs/reference/rest/v2/ErrorProto).
//! - JobConfigurationTableCopy
//!   (https://cloud.google.com/bigquery/docs/reference/rest/v2/Job#JobConfigurationTableCopy):
//!   `sourceTable` or `sourceTables`, `destinationTable`; `writeDisposition`
//!   WRITE_TRUNCATE ("BigQuery overwrites the table data"), WRITE_APPEND
//!   ("appends the data to the table") or WRITE_EMPTY ("If the table
//!   already exists and contains data, a 'duplicate' error is returned in
//!   the job result"; the default); `createDisposition` CREATE_IF_NEEDED
//!   (the default) or CREATE_NEVER ("The table must already exist. If it
//!   does not, a 'notFound' error is returned in the job result"). "Each
//!   action is atomic and only occurs if BigQuery is able to complete the
//!   job successfully. Creation, truncation and append actions occur as one
//!   atomic update upon job completion."
//! - Partitions (https://cloud.google.com/bigquery/docs/managing-partitioned-table-data):
//!   decorators name one partition on either side ("Copy a partition");
//!   "To copy a partitioned table into another partitioned table, the
//!   partition specifications for the source and destination tables must
//!   match"; for column-partitioned tables "the partition ID specified in
//!   the decorator must match the data being written ... otherwise an error
//!   occurs" (https://cloud.google.com/bigquery/docs/load-data-partitioned-tables).
//!   A decorator's scope is the partition: WRITE_TRUNCATE replaces that
//!   partition's rows and leaves the others, WRITE_EMPTY asks that partition
//!   to be empty.
//! - A copy needs the destination schema to take the source's rows: each
//!   source column must exist in the destination with the same type, and a
//!   REQUIRED destination column must be REQUIRED in the source.
//!
//! Invariants of the double:
//! - a job applies whole, under the state lock, or not at all: every check
//!   (tables, decorators, every row's partition, schemas, WRITE_EMPTY) runs
//!   before the first change;
//! - a job is applied at most once: when it is inserted, or, when a fault
//!   holds it RUNNING, at the `jobs.get` that ends it;
//! - only the copy configuration is served; query, load and extract jobs
//!   are refused with 400 "not supported by this double";
//! - the Job resource carries `jobReference`, `configuration` (with
//!   `jobType`) and `status`; `statistics` is left out, and `location`
//!   is the client's (`jobReference.location`) or else, as BigQuery infers
//!   it from the tables a job references, the destination dataset's
//!   ([`crate::state::Dataset`], `US` unless a test set one). Jobs never leave PENDING/RUNNING by time,
//!   only by a `jobs.get` poll ([`crate::JobFault::RunningFor`]).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::partition::{TimePartitioning, split_decorator};
use crate::proto::TableSchema;
use crate::proto::table_field_schema::Mode;
use crate::rest::{error, unauthorized, unavailable};
use crate::state::{Inner, StoredRows};
use crate::{JobFault, RestFault, Shared};

/// The location the double reports when the client names none.
pub const DEFAULT_LOCATION: &str = "US";

/// `status.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobState {
    Running,
    Done,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Running => "RUNNING",
            JobState::Done => "DONE",
        }
    }
}

/// An ErrorProto of a job's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobError {
    pub reason: String,
    pub message: String,
}

impl JobError {
    fn new(reason: &str, message: impl Into<String>) -> Self {
        Self { reason: reason.to_string(), message: message.into() }
    }

    fn invalid(message: impl Into<String>) -> Self {
        Self::new("invalid", message)
    }

    fn to_json(&self) -> Value {
        json!({ "reason": self.reason, "message": self.message })
    }
}

/// A table a copy names: `{projectId, datasetId, tableId}`, the table id
/// possibly carrying a partition decorator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableRef {
    pub project: String,
    pub dataset: String,
    pub table: String,
    pub decorator: Option<String>,
}

impl TableRef {
    fn from_json(v: &Value, at: &str) -> Result<Self, String> {
        let text = |key: &str| {
            v.get(key)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .ok_or_else(|| format!("{at}.{key} is required"))
        };
        let (table, decorator) = split_decorator(text("tableId")?);
        Ok(Self {
            project: text("projectId")?.to_string(),
            dataset: text("datasetId")?.to_string(),
            table: table.to_string(),
            decorator: decorator.map(str::to_string),
        })
    }

    /// The double's table key, `projects/p/datasets/d/tables/t`.
    pub fn path(&self) -> String {
        format!("projects/{}/datasets/{}/tables/{}", self.project, self.dataset, self.table)
    }

    /// `p:d.t`, as the API's messages name tables.
    fn display(&self) -> String {
        format!("{}:{}.{}", self.project, self.dataset, self.table)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteDisposition {
    Truncate,
    Append,
    Empty,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateDisposition {
    IfNeeded,
    Never,
}

/// A `configuration.copy`, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopySpec {
    pub sources: Vec<TableRef>,
    pub destination: TableRef,
    pub write: WriteDisposition,
    pub create: CreateDisposition,
}

impl CopySpec {
    fn from_json(copy: &Value) -> Result<Self, String> {
        let mut sources = Vec::new();
        if let Some(one) = copy.get("sourceTable") {
            sources.push(TableRef::from_json(one, "configuration.copy.sourceTable")?);
        }
        if let Some(many) = copy.get("sourceTables") {
            let Some(list) = many.as_array() else {
                return Err("configuration.copy.sourceTables must be a list".into());
            };
            for (i, v) in list.iter().enumerate() {
                sources.push(TableRef::from_json(v, &format!("configuration.copy.sourceTables[{i}]"))?);
            }
        }
        if sources.is_empty() {
            return Err("configuration.copy.sourceTable or sourceTables is required".into());
        }
        let destination = TableRef::from_json(
            copy.get("destinationTable").ok_or("configuration.copy.destinationTable is required")?,
            "configuration.copy.destinationTable",
        )?;
        let write = match copy.get("writeDisposition").and_then(Value::as_str) {
            None | Some("WRITE_EMPTY") => WriteDisposition::Empty,
            Some("WRITE_TRUNCATE") => WriteDisposition::Truncate,
            Some("WRITE_APPEND") => WriteDisposition::Append,
            Some(other) => {
                return Err(format!(
                    "configuration.copy.writeDisposition {other:?}: expected WRITE_TRUNCATE, WRITE_APPEND or WRITE_EMPTY"
                ));
            }
        };
        let create = match copy.get("createDisposition").and_then(Value::as_str) {
            None | Some("CREATE_IF_NEEDED") => CreateDisposition::IfNeeded,
            Some("CREATE_NEVER") => CreateDisposition::Never,
            Some(other) => {
                return Err(format!(
                    "configuration.copy.createDisposition {other:?}: expected CREATE_IF_NEEDED or CREATE_NEVER"
                ));
            }
        };
        match copy.get("operationType").and_then(Value::as_str) {
            None | Some("COPY") => {}
            Some(other) => {
                return Err(format!("configuration.copy.operationType {other} is not supported by this double"));
            }
        }
        Ok(Self { sources, destination, write, create })
    }
}

/// A job the double keeps, by (project, job id).
#[derive(Debug, Clone)]
pub struct Job {
    pub project: String,
    pub id: String,
    pub location: String,
    /// The `configuration` as the client sent it.
    pub configuration: Value,
    pub copy: CopySpec,
    pub state: JobState,
    /// `status.errorResult`: set only when the job is DONE and failed.
    pub error: Option<JobError>,
    /// `jobs.get` polls still answered RUNNING ([`JobFault::RunningFor`]).
    pub(crate) polls_left: u32,
}

impl Job {
    fn resource(&self) -> Value {
        let mut configuration = self.configuration.clone();
        if let Some(c) = configuration.as_object_mut() {
            c.insert("jobType".into(), Value::String("COPY".into()));
        }
        let mut status = json!({ "state": self.state.as_str() });
        if let Some(e) = &self.error {
            status["errorResult"] = e.to_json();
            status["errors"] = json!([e.to_json()]);
        }
        json!({
            "kind": "bigquery#job",
            "id": format!("{}:{}.{}", self.project, self.location, self.id),
            "jobReference": { "projectId": self.project, "jobId": self.id, "location": self.location },
            "configuration": configuration,
            "status": status,
        })
    }

    /// Runs the job now and ends it DONE, with its error if it failed.
    fn finish(&mut self, inner: &mut Inner) {
        self.error = run_copy(inner, &self.copy).err();
        self.state = JobState::Done;
    }
}

/// Splits rows into those in partition `id` and the others (each in order).
fn split_partition(
    batches: &[StoredRows],
    partitioning: &TimePartitioning,
    schema: &TableSchema,
    id: &str,
) -> Result<(Vec<StoredRows>, Vec<StoredRows>), String> {
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    for batch in batches {
        let keep = batch
            .to_json()
            .iter()
            .map(|row| partitioning.partition_of(row, schema).map(|p| p == id))
            .collect::<Result<Vec<bool>, String>>()?;
        let other: Vec<bool> = keep.iter().map(|k| !k).collect();
        inside.extend(batch.select(&keep));
        outside.extend(batch.select(&other));
    }
    Ok((inside, outside))
}

/// Why rows of `source` cannot land in a table of schema `dest`.
fn schema_mismatch(source: &TableSchema, dest: &TableSchema) -> Option<String> {
    for s in &source.fields {
        match dest.fields.iter().find(|d| d.name.eq_ignore_ascii_case(&s.name)) {
            None => return Some(format!("Field {} is not in the destination table", s.name)),
            Some(d)
                if d.r#type != s.r#type || (d.mode == Mode::Repeated as i32) != (s.mode == Mode::Repeated as i32) =>
            {
                return Some(format!("Field {} has a different type in the destination table", s.name));
            }
            Some(_) => {}
        }
    }
    for d in dest.fields.iter().filter(|d| d.mode == Mode::Required as i32) {
        if !source.fields.iter().any(|s| s.name.eq_ignore_ascii_case(&d.name) && s.mode == Mode::Required as i32) {
            return Some(format!("Field {} is REQUIRED in the destination table but not in the source", d.name));
        }
    }
    None
}

/// Applies a copy whole, or returns why it cannot and changes nothing.
pub(crate) fn run_copy(inner: &mut Inner, spec: &CopySpec) -> Result<(), JobError> {
    let dest = &spec.destination;
    let dest_path = dest.path();
    let not_found = |t: &TableRef| JobError::new("notFound", format!("Not found: Table {}", t.display()));
    let first = spec.sources.first().ok_or_else(|| JobError::invalid("configuration.copy has no source table"))?;
    // CREATE_IF_NEEDED: a new destination takes the first source's schema
    // and partitioning.
    let (dest_schema, dest_partitioning, create) = match inner.tables.get(&dest_path) {
        Some(t) => (t.schema.clone(), t.time_partitioning.clone(), false),
        None if spec.create == CreateDisposition::Never => return Err(not_found(dest)),
        None => match inner.tables.get(&first.path()) {
            Some(t) => (t.schema.clone(), t.time_partitioning.clone(), true),
            None => return Err(not_found(first)),
        },
    };
    // The rows to write, read from every source.
    let mut rows: Vec<StoredRows> = Vec::new();
    for source in &spec.sources {
        let path = source.path();
        let Some(table) = inner.tables.get(&path) else { return Err(not_found(source)) };
        let batches = inner.visible_batches(&path);
        let batches = match (&source.decorator, &table.time_partitioning) {
            (None, _) => batches,
            (Some(id), None) => {
                return Err(JobError::invalid(format!(
                    "Cannot read partition ${id} of table {}: the table is not partitioned",
                    source.display()
                )));
            }
            (Some(id), Some(tp)) => {
                tp.check_decorator(id).map_err(JobError::invalid)?;
                split_partition(&batches, tp, &table.schema, id).map_err(JobError::invalid)?.0
            }
        };
        if let (Some(s), Some(d)) = (&table.time_partitioning, &dest_partitioning)
            && (s.kind != d.kind || !s.field.eq_ignore_ascii_case(&d.field))
        {
            return Err(JobError::invalid(format!(
                "Partitioning specification of the source table {} ({} on {}) does not match the destination table {} ({} on {})",
                source.display(),
                s.kind.as_str(),
                s.field,
                dest.display(),
                d.kind.as_str(),
                d.field
            )));
        }
        if let Some(why) = schema_mismatch(&table.schema, &dest_schema) {
            return Err(JobError::invalid(format!("Provided Schema does not match Table {}. {why}", dest.display())));
        }
        rows.extend(batches);
    }
    // The destination's scope: one partition, or the whole table.
    let scope = match (&dest.decorator, &dest_partitioning) {
        (None, _) => None,
        (Some(id), None) => {
            return Err(JobError::invalid(format!(
                "Cannot write to partition ${id} of table {}: the table is not partitioned",
                dest.display()
            )));
        }
        (Some(id), Some(tp)) => {
            tp.check_decorator(id).map_err(JobError::invalid)?;
            for batch in &rows {
                for row in batch.to_json() {
                    let partition = tp.partition_of(&row, &dest_schema).map_err(JobError::invalid)?;
                    if &partition != id {
                        return Err(JobError::invalid(format!(
                            "Some rows belong to different partitions rather than destination partition {id}: a row of partition {partition} (column {})",
                            tp.field
                        )));
                    }
                }
            }
            Some((tp.clone(), id.clone()))
        }
    };
    let current = inner.visible_batches(&dest_path);
    let (in_scope, out_of_scope) = match &scope {
        None => (current, Vec::new()),
        Some((tp, id)) => split_partition(&current, tp, &dest_schema, id).map_err(JobError::invalid)?,
    };
    let mut kept = match spec.write {
        WriteDisposition::Empty if in_scope.iter().any(|b| !b.is_empty()) => {
            let what = scope.as_ref().map(|(_, id)| format!("${id}")).unwrap_or_default();
            return Err(JobError::new("duplicate", format!("Already Exists: Table {}{what}", dest.display())));
        }
        WriteDisposition::Truncate => out_of_scope,
        WriteDisposition::Empty | WriteDisposition::Append => {
            let mut all = out_of_scope;
            all.extend(in_scope);
            all
        }
    };
    kept.extend(rows);
    // Every check passed: apply as one update.
    if create {
        let mut table = crate::state::Table::new(dest_schema);
        table.time_partitioning = dest_partitioning;
        inner.tables.insert(dest_path.clone(), table);
    }
    inner.absorb(&dest_path);
    if let Some(table) = inner.tables.get_mut(&dest_path) {
        table.materialized = kept;
        table.version += 1;
    }
    Ok(())
}

fn job_id_ok(id: &str) -> bool {
    !id.is_empty() && id.len() <= 1024 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn bad_request(message: String) -> Response {
    error(StatusCode::BAD_REQUEST, "INVALID_ARGUMENT", "invalid", message)
}

fn job_not_found(p: &str, location: &str, j: &str) -> Response {
    error(StatusCode::NOT_FOUND, "NOT_FOUND", "notFound", format!("Not found: Job {p}:{location}.{j}"))
}

/// `POST /bigquery/v2/projects/{p}/jobs`.
pub(crate) async fn insert_job(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(p): Path<String>,
    Json(body): Json<Value>,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let fault = shared.next_job_fault();
    if fault == Some(JobFault::FailBeforeApply) {
        return unavailable();
    }
    let Some(configuration) = body.get("configuration").filter(|c| c.is_object()) else {
        return bad_request("configuration is required".into());
    };
    let Some(copy) = configuration.get("copy") else {
        let kind = ["query", "load", "extract"].into_iter().find(|k| configuration.get(*k).is_some());
        return bad_request(format!(
            "configuration.{} jobs are not supported by this double (only configuration.copy is)",
            kind.unwrap_or("<none>")
        ));
    };
    let copy = match CopySpec::from_json(copy) {
        Ok(c) => c,
        Err(m) => return bad_request(m),
    };
    let reference = body.get("jobReference");
    if let Some(given) = reference.and_then(|r| r.get("projectId")).and_then(Value::as_str)
        && given != p
    {
        return bad_request(format!("jobReference.projectId {given} does not match the project {p} of the request"));
    }
    let location = match reference.and_then(|r| r.get("location")).and_then(Value::as_str) {
        Some(given) => given.to_string(),
        None => {
            let dataset = format!("projects/{}/datasets/{}", copy.destination.project, copy.destination.dataset);
            shared.inner().datasets.get(&dataset).map_or_else(|| DEFAULT_LOCATION.to_string(), |d| d.location.clone())
        }
    };
    let id = match reference.and_then(|r| r.get("jobId")).and_then(Value::as_str) {
        Some(id) if job_id_ok(id) => id.to_string(),
        Some(id) => {
            return bad_request(format!(
                "Invalid job ID {id:?}: it may contain only letters, numbers, underscores and dashes, at most 1024 characters"
            ));
        }
        None => format!("job_double_{}", shared.next_job_id.fetch_add(1, std::sync::atomic::Ordering::SeqCst)),
    };
    let mut inner = shared.inner();
    let key = (p.clone(), id.clone());
    if inner.jobs.contains_key(&key) {
        return error(
            StatusCode::CONFLICT,
            "ALREADY_EXISTS",
            "duplicate",
            format!("Already Exists: Job {p}:{location}.{id}"),
        );
    }
    let mut job = Job {
        project: p,
        id,
        location,
        configuration: configuration.clone(),
        copy,
        state: JobState::Running,
        error: None,
        polls_left: 0,
    };
    match fault {
        // "If the job completes but includes an error object that contains
        // backendError, the job failed. You can safely retry the job without
        // concerns about data consistency" (troubleshooting-errors).
        Some(JobFault::DoneWithBackendError) => {
            job.state = JobState::Done;
            job.error = Some(JobError::new("backendError", "Backend error. Job aborted; nothing was applied."));
        }
        Some(JobFault::DoneWithError(reason)) => {
            job.state = JobState::Done;
            job.error = Some(JobError::new(reason, format!("{reason}: the job applied nothing.")));
        }
        Some(JobFault::RunningFor(n)) => job.polls_left = n,
        _ => job.finish(&mut inner),
    }
    let reply = job.resource();
    inner.jobs.insert(key, job);
    drop(inner);
    if fault == Some(JobFault::ApplyThenDropReply) {
        // "If you receive this error when making a jobs.insert() call, it's
        // unclear if the job succeeded" (backendError, troubleshooting-errors).
        return unavailable();
    }
    Json(reply).into_response()
}

/// `GET /bigquery/v2/projects/{p}/jobs/{jobId}`.
pub(crate) async fn get_job(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path((p, j)): Path<(String, String)>,
    uri: axum::http::Uri,
) -> Response {
    if let Some(r) = unauthorized(&shared, &headers) {
        return r;
    }
    let fault = shared.count_rest("jobs.get");
    if fault == Some(RestFault::FailBeforeApply) {
        return unavailable();
    }
    let mut inner = shared.inner();
    let key = (p.clone(), j.clone());
    // The `location` query parameter (region names need no percent-decoding).
    let asked = uri.query().unwrap_or("").split('&').find_map(|kv| kv.strip_prefix("location="));
    let multi_region = |l: &str| l.eq_ignore_ascii_case("US") || l.eq_ignore_ascii_case("EU");
    let found = inner.jobs.get(&key).is_some_and(|job| match asked {
        Some(asked) => asked.eq_ignore_ascii_case(&job.location),
        None => multi_region(&job.location),
    });
    let Some(mut job) = (if found { inner.jobs.remove(&key) } else { None }) else {
        return job_not_found(&p, asked.unwrap_or(DEFAULT_LOCATION), &j);
    };
    if job.state == JobState::Running {
        if job.polls_left > 0 {
            job.polls_left -= 1;
        } else {
            job.finish(&mut inner);
        }
    }
    let reply = job.resource();
    inner.jobs.insert(key, job);
    drop(inner);
    if fault == Some(RestFault::ApplyThenFail) {
        return unavailable();
    }
    Json(reply).into_response()
}
