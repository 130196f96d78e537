//! A test double of the BigQuery Storage Write API (`BigQueryWrite`), served
//! by tonic over loopback, faithful to the documented semantics it covers:
//! CreateWriteStream (COMMITTED, PENDING, BUFFERED), AppendRows with strict
//! offsets and in-band errors carrying `StorageError` details, FlushRows
//! (inclusive, cumulative), FinalizeWriteStream, GetWriteStream,
//! BatchCommitWriteStreams, and a way to read back the **visible** rows;
//! and, on a second port, the BigQuery API's table methods (`tables.get`,
//! `tables.insert`, `tables.patch`; see [`rest`]) over the same tables,
//! with time-unit column partitioning ([`partition`]), and copy jobs
//! (`jobs.insert`, `jobs.get`; see [`jobs`]) that can replace one partition;
//! and change data capture ([`cdc`]): tables with a primary key take
//! UPSERT and DELETE changes on their `_default` stream, applied by key in
//! `_CHANGE_SEQUENCE_NUMBER` order.
//!
//! Invariants:
//! - rows become visible only as the stream type says (see [`state`]);
//! - an append is applied whole or not at all, and so is a copy job;
//! - a job id is applied at most once per project;
//! - injected faults ([`Fault`], [`RestFault`], [`JobFault`]) act at a
//!   precise point: before applying, or after applying and instead of the
//!   reply.
//!
//! Quotes in the code come from the API reference,
//! https://cloud.google.com/bigquery/docs/reference/storage/rpc/google.cloud.bigquery.storage.v1.

pub mod arrow_rows;
pub mod cdc;
pub mod jobs;
pub mod partition;
mod rest;
pub mod schema;
mod service;
pub mod state;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::serve::ListenerExt as _;
pub use cdc::EqualSequence;
pub use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1 as proto;
pub use jobs::{Job, JobError, JobState};
pub use partition::{PartitionType, TimePartitioning};
use proto::table_field_schema::{Mode, Type};
use proto::{TableFieldSchema, TableSchema};
pub use state::Dataset;
use thiserror::Error;
use tonic::transport::server::TcpIncoming;

/// The RPCs a fault can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rpc {
    /// One AppendRows *request* (a message on the stream).
    Append,
    FlushRows,
    CreateWriteStream,
}

/// What an injected fault does to the nth call of an [`Rpc`] (counted from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Apply the call, then lose the reply: the connection breaks with
    /// UNAVAILABLE instead (the stream ends, for AppendRows).
    ApplyThenDropReply,
    /// Fail without applying, with an in-band INTERNAL error ("INTERNAL:
    /// Indicates server side error(s) that can be retried"); the stream stays open.
    FailBeforeApply,
    /// Fail without applying, the connection breaking with UNAVAILABLE.
    Unavailable,
    /// Answer OUT_OF_RANGE / OFFSET_OUT_OF_RANGE without applying, as when
    /// the client's offset and the stream disagree.
    OutOfRange,
    /// Wait this long, then proceed normally.
    Delay(Duration),
}

/// How the double answers a `FlushRows` at or below the offset already
/// flushed. The API reference does not say ("Flushes up to any previously
/// flushed offset ... to the offset specified"), and services differ, so the
/// double answers each way a client may meet:
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reflush {
    /// OK with the requested offset: flushing is cumulative, nothing changes.
    #[default]
    Ok,
    /// `ALREADY_EXISTS` with a `StorageError` `OFFSET_ALREADY_EXISTS`, which
    /// Apache Beam's Storage API sink reads as "already flushed up to here".
    AlreadyExists,
    /// `OUT_OF_RANGE` "Offset N already flushed; next expected > N", as at
    /// least one independent implementation of the API answers, with a
    /// `StorageError` `OFFSET_OUT_OF_RANGE`, the same code as an offset
    /// beyond the end of the stream: only the message tells them apart.
    OutOfRange,
}

impl std::str::FromStr for Reflush {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ok" => Ok(Self::Ok),
            "already-exists" => Ok(Self::AlreadyExists),
            "out-of-range" => Ok(Self::OutOfRange),
            other => Err(format!("{other:?}: expected ok, already-exists or out-of-range")),
        }
    }
}

impl Reflush {
    pub const ALL: [Reflush; 3] = [Reflush::Ok, Reflush::AlreadyExists, Reflush::OutOfRange];
}

/// A fault of the nth call of a REST table method (counted from 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestFault {
    /// Apply the call, then answer 503 `backendError`: the client cannot
    /// tell whether it was applied.
    ApplyThenFail,
    /// Answer 503 without applying.
    FailBeforeApply,
}

/// A fault of the nth `jobs.insert` call (counted from 1), whatever the
/// job (https://cloud.google.com/bigquery/docs/troubleshooting-errors,
/// `backendError`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobFault {
    /// Answer 503 `backendError` before anything: no job is created, and
    /// the same job id may be inserted again.
    FailBeforeApply,
    /// Create and run the job, then lose the reply: the client gets 503
    /// `backendError` ("If you receive this error when making a
    /// jobs.insert() call, it's unclear if the job succeeded"). A retry
    /// with the same id gets 409 `duplicate`; `jobs.get` tells the outcome.
    ApplyThenDropReply,
    /// Create the job, which ends DONE with `errorResult.reason`
    /// `backendError` and applies nothing ("the job failed. You can safely
    /// retry the job without concerns about data consistency"). Its id is
    /// taken: a retry needs a new one.
    DoneWithBackendError,
    /// Create the job, which ends DONE with `errorResult.reason` set to
    /// this (`rateLimitExceeded`, `quotaExceeded`, ...) and applies
    /// nothing; its id is taken. "rateLimitExceeded: ... retry the
    /// operation after a few seconds. Use exponential backoff";
    /// "quotaExceeded: This error returns when your project exceeds a
    /// BigQuery quota" (troubleshooting-errors).
    DoneWithError(&'static str),
    /// Create the job and keep it RUNNING for this many `jobs.get` polls;
    /// the next poll runs it (whole) and answers DONE.
    RunningFor(u32),
}

/// Whether `tables.patch` honours `If-Match` with the table's etag. The
/// reference does not say, so the double does either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EtagMode {
    /// A stale etag is answered 412 (Precondition Failed).
    #[default]
    Honour,
    /// The header is ignored: the last patch wins.
    Ignore,
}

#[derive(Debug, Error)]
pub enum DoubleError {
    #[error("cannot bind the test double to {addr}: {source}")]
    Bind { addr: String, source: std::io::Error },
    #[error("cannot start the test double's runtime: {0}")]
    Runtime(std::io::Error),
}

/// Counters of what the double saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    pub streams_created: u64,
    pub append_requests: u64,
    pub rows_appended: u64,
    /// Serialized row bytes of the applied appends.
    pub bytes_appended: u64,
    pub already_exists: u64,
    pub flush_calls: u64,
    /// CDC changes received in applied requests, and of them those applied
    /// (the rest were ignored by their sequence numbers).
    pub changes_received: u64,
    pub changes_applied: u64,
}

/// What a call's bearer token must satisfy (see [`BigQueryDouble::require_valid_token`]).
#[derive(Clone)]
pub(crate) struct RequiredToken(Arc<dyn Fn(&str) -> bool + Send + Sync>);

impl RequiredToken {
    /// Whether the `authorization` header value carries an accepted token.
    pub(crate) fn accepts(&self, authorization: Option<&str>) -> bool {
        authorization.and_then(|v| v.strip_prefix("Bearer ")).is_some_and(|t| (self.0)(t))
    }
}

#[derive(Default)]
pub(crate) struct Shared {
    pub(crate) inner: Mutex<state::Inner>,
    pub(crate) faults: Mutex<Vec<(Rpc, u64, Fault)>>,
    pub(crate) calls: Mutex<std::collections::HashMap<Rpc, u64>>,
    pub(crate) stats: Mutex<Stats>,
    /// When set, every call must carry `authorization: Bearer <token>`
    /// with a token this accepts.
    pub(crate) token: Mutex<Option<RequiredToken>>,
    /// Calls refused as unauthenticated.
    pub(crate) unauthenticated: std::sync::atomic::AtomicU64,
    /// Answer CreateWriteStream and GetWriteStream without `table_schema`.
    pub(crate) hide_schema: std::sync::atomic::AtomicBool,
    /// How a flush at or below the flushed offset is answered.
    pub(crate) reflush: Mutex<Reflush>,
    /// Refuse FlushRows on a finalized stream (`STREAM_FINALIZED`).
    pub(crate) refuse_flush_when_finalized: std::sync::atomic::AtomicBool,
    /// How `tables.patch` treats `If-Match`.
    pub(crate) etag_mode: Mutex<EtagMode>,
    /// Calls of the REST table methods, by method.
    pub(crate) rest_calls: Mutex<std::collections::HashMap<&'static str, u64>>,
    pub(crate) rest_faults: Mutex<Vec<(&'static str, u64, RestFault)>>,
    /// The client address (the connection) of each AppendRows call, in order.
    pub(crate) append_peers: Mutex<Vec<SocketAddr>>,
    pub(crate) job_faults: Mutex<Vec<(u64, JobFault)>>,
    /// Numbers the ids of jobs inserted without a `jobReference.jobId`.
    pub(crate) next_job_id: std::sync::atomic::AtomicU64,
    /// How a CDC change with its key's last applied sequence number is treated.
    pub(crate) equal_sequence: Mutex<cdc::EqualSequence>,
}

impl Shared {
    pub(crate) fn inner(&self) -> MutexGuard<'_, state::Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub(crate) fn stats(&self) -> MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Counts a REST call and returns the fault aimed at it, if any.
    pub(crate) fn count_rest(&self, method: &'static str) -> Option<RestFault> {
        let n = {
            let mut calls = self.rest_calls.lock().unwrap_or_else(|p| p.into_inner());
            let n = calls.entry(method).or_insert(0);
            *n += 1;
            *n
        };
        let faults = self.rest_faults.lock().unwrap_or_else(|p| p.into_inner());
        faults.iter().find(|(m, nth, _)| *m == method && *nth == n).map(|(_, _, f)| *f)
    }

    /// Counts a `jobs.insert` call and returns the fault aimed at it, if any.
    pub(crate) fn next_job_fault(&self) -> Option<JobFault> {
        let n = {
            let mut calls = self.rest_calls.lock().unwrap_or_else(|p| p.into_inner());
            let n = calls.entry("jobs.insert").or_insert(0);
            *n += 1;
            *n
        };
        let faults = self.job_faults.lock().unwrap_or_else(|p| p.into_inner());
        faults.iter().find(|(nth, _)| *nth == n).map(|(_, f)| *f)
    }

    /// Counts a call and returns the fault aimed at it, if any.
    pub(crate) fn next_call(&self, rpc: Rpc) -> Option<Fault> {
        let n = {
            let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
            let n = calls.entry(rpc).or_insert(0);
            *n += 1;
            *n
        };
        let faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        faults.iter().find(|(r, nth, _)| *r == rpc && *nth == n).map(|(_, _, f)| *f)
    }
}

/// A running double. Dropping it stops the server.
pub struct BigQueryDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    rest_addr: SocketAddr,
    shutdown: Option<tokio::sync::watch::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BigQueryDouble {
    /// Starts on 127.0.0.1 with a port the OS picks.
    pub fn start() -> Result<Self, DoubleError> {
        Self::start_on("127.0.0.1:0")
    }

    /// Starts on `addr`, serving from its own runtime thread.
    pub fn start_on(addr: &str) -> Result<Self, DoubleError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("bigquery-double")
            .enable_all()
            .build()
            .map_err(DoubleError::Runtime)?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|source| DoubleError::Bind { addr: addr.to_string(), source })?;
        let local = listener.local_addr().map_err(|source| DoubleError::Bind { addr: addr.to_string(), source })?;
        // The table methods listen beside, on a port of their own.
        let rest_bind = format!("{}:0", local.ip());
        let rest_listener = runtime
            .block_on(tokio::net::TcpListener::bind(&rest_bind))
            .map_err(|source| DoubleError::Bind { addr: rest_bind.clone(), source })?;
        let rest_addr = rest_listener.local_addr().map_err(|source| DoubleError::Bind { addr: rest_bind, source })?;
        let shared = Arc::new(Shared::default());
        let (tx, rx) = tokio::sync::watch::channel(false);
        let svc = service::BigQueryWriteService { shared: shared.clone() };
        let router = rest::router(shared.clone());
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let mut rest_rx = rx.clone();
                let rest = tokio::spawn(async move {
                    // As below for gRPC: replies leave at once (no Nagle delay).
                    let rest_listener = rest_listener.tap_io(|tcp| {
                        let _ = tcp.set_nodelay(true);
                    });
                    let served = axum::serve(rest_listener, router)
                        .with_graceful_shutdown(async move {
                            let _ = rest_rx.changed().await;
                        })
                        .await;
                    if let Err(e) = served {
                        tracing::error!("bigquery double (REST) stopped: {e}");
                    }
                });
                // `Server::tcp_nodelay` applies only to listeners the server
                // binds itself, so the accepted connections get it here.
                // Without it, Nagle's algorithm held each small reply back
                // until the client's delayed ACK: a client that waits for
                // replies with requests in flight (as BigQuery clients do)
                // was paced by the double, not by its own work.
                let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
                let mut grpc_rx = rx;
                let served = tonic::transport::Server::builder()
                    .add_service(svc)
                    .serve_with_incoming_shutdown(incoming, async move {
                        let _ = grpc_rx.changed().await;
                    })
                    .await;
                if let Err(e) = served {
                    tracing::error!("bigquery double stopped: {e}");
                }
                let _ = rest.await;
            });
        });
        Ok(Self { shared, addr: local, rest_addr, shutdown: Some(tx), thread: Some(thread) })
    }

    /// `http://127.0.0.1:PORT` of the table methods, for a job's
    /// `[sink.http.<name>] address`.
    pub fn rest_address(&self) -> String {
        format!("http://{}", self.rest_addr)
    }

    /// Aims `fault` at the `nth` call of a REST method (`tables.insert`,
    /// `tables.patch`, `tables.get`, `jobs.get`). On `jobs.get`,
    /// `ApplyThenFail` counts the poll (a RUNNING job may end) and answers 503.
    pub fn inject_rest(&self, method: &'static str, nth: u64, fault: RestFault) {
        self.shared.rest_faults.lock().unwrap_or_else(|p| p.into_inner()).push((method, nth, fault));
    }

    /// Chooses whether `tables.patch` honours `If-Match`.
    pub fn etag_mode(&self, mode: EtagMode) {
        *self.shared.etag_mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
    }

    /// The client address of each AppendRows call, in the order they
    /// began: calls from one address came over one connection.
    pub fn append_peers(&self) -> Vec<SocketAddr> {
        self.shared.append_peers.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many calls of a REST method (`tables.get`, `tables.insert`,
    /// `tables.patch`, `jobs.insert`, `jobs.get`) the double answered.
    pub fn rest_calls(&self, method: &str) -> u64 {
        self.shared.rest_calls.lock().unwrap_or_else(|p| p.into_inner()).get(method).copied().unwrap_or(0)
    }

    /// The table's schema now, if it exists.
    pub fn table_schema(&self, table: &str) -> Option<TableSchema> {
        self.shared.inner().tables.get(table).map(|t| t.schema.clone())
    }

    /// `http://127.0.0.1:PORT`, for a job's `[sink.grpc.<name>] address`.
    pub fn address(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn socket_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Creates (or replaces) a table: `projects/{p}/datasets/{d}/tables/{t}`.
    pub fn create_table(&self, table: &str, schema: TableSchema) {
        self.shared.inner().tables.insert(table.to_string(), state::Table::new(schema));
    }

    /// Creates (or replaces) a time-unit column partitioned table, as
    /// `tables.insert` with `timePartitioning` does; refused as that is
    /// (the column must be a top-level DATE, TIMESTAMP or DATETIME).
    pub fn create_partitioned_table(
        &self,
        table: &str,
        schema: TableSchema,
        partitioning: TimePartitioning,
    ) -> Result<(), String> {
        partitioning.check(&schema)?;
        let mut t = state::Table::new(schema);
        t.time_partitioning = Some(partitioning);
        self.shared.inner().tables.insert(table.to_string(), t);
        Ok(())
    }

    /// Creates (or replaces) a table with a primary key
    /// (`PRIMARY KEY (...) NOT ENFORCED`), which takes CDC changes
    /// ([`cdc`]); `max_staleness` as the table resource's `maxStaleness`.
    pub fn create_keyed_table(&self, table: &str, schema: TableSchema, key: &[&str], max_staleness: Option<&str>) {
        let mut t = state::Table::new(schema);
        t.primary_key = key.iter().map(|k| k.to_string()).collect();
        t.max_staleness = max_staleness.map(str::to_string);
        self.shared.inner().tables.insert(table.to_string(), t);
    }

    /// The table's primary key columns (empty: none), if it exists.
    pub fn primary_key(&self, table: &str) -> Option<Vec<String>> {
        self.shared.inner().tables.get(table).map(|t| t.primary_key.clone())
    }

    /// The table's `maxStaleness`, if it exists and has one.
    pub fn max_staleness(&self, table: &str) -> Option<String> {
        self.shared.inner().tables.get(table).and_then(|t| t.max_staleness.clone())
    }

    /// Every key a CDC change touched, with its last applied sequence
    /// number and its row (`None`: deleted).
    pub fn keyed_rows(&self, table: &str) -> BTreeMap<String, cdc::Applied> {
        self.shared.inner().tables.get(table).map(|t| t.keyed.clone()).unwrap_or_default()
    }

    /// Chooses how a CDC change with its key's last applied sequence
    /// number is treated (the documentation does not say).
    pub fn answer_equal_sequence(&self, answer: cdc::EqualSequence) {
        *self.shared.equal_sequence.lock().unwrap_or_else(|p| p.into_inner()) = answer;
    }

    /// Deletes a table and its write streams, as `tables.delete`
    /// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/delete)
    /// or the table's expiry ("Expired tables will be deleted") would;
    /// whether it existed.
    pub fn delete_table(&self, table: &str) -> bool {
        let mut inner = self.shared.inner();
        let prefix = format!("{table}/streams/");
        inner.streams.retain(|name, _| !name.starts_with(&prefix));
        inner.tables.remove(table).is_some()
    }

    /// Sets what `datasets.get` answers for `dataset`
    /// (`projects/P/datasets/D`), and the defaults `tables.insert` applies.
    pub fn set_dataset(&self, dataset: &str, resource: state::Dataset) {
        self.shared.inner().datasets.insert(dataset.to_string(), resource);
    }

    /// Makes a table with no columns and these `labels`, as a
    /// `tables.insert` of `{labels}` would (a test stands in for another
    /// client); whether it was new.
    pub fn create_labelled_table(&self, table: &str, labels: &[(&str, &str)]) -> bool {
        let mut inner = self.shared.inner();
        if inner.tables.contains_key(table) {
            return false;
        }
        let mut t = state::Table::new(TableSchema { fields: Vec::new() });
        t.labels = labels.iter().map(|(k, v)| (k.to_string(), serde_json::Value::String(v.to_string()))).collect();
        inner.tables.insert(table.to_string(), t);
        true
    }

    /// The table's `expirationTime` (ms since the epoch), if it exists and expires.
    pub fn expiration_time(&self, table: &str) -> Option<i64> {
        self.shared.inner().tables.get(table).and_then(|t| t.expiration_time)
    }

    /// The paths of every table, in order.
    pub fn tables(&self) -> Vec<String> {
        let mut out: Vec<String> = self.shared.inner().tables.keys().cloned().collect();
        out.sort();
        out
    }

    /// The table's `timePartitioning`, if it exists and is partitioned.
    pub fn time_partitioning(&self, table: &str) -> Option<TimePartitioning> {
        self.shared.inner().tables.get(table).and_then(|t| t.time_partitioning.clone())
    }

    /// Adds rows to a table as a load job with WRITE_APPEND would: at once
    /// and whole, checked against the table's columns (types, REQUIRED).
    /// For tests that need rows in a table before a job replaces them.
    pub fn load_rows(&self, table: &str, rows: arrow_array::RecordBatch) -> Result<(), String> {
        let mut inner = self.shared.inner();
        let Some(t) = inner.tables.get(table) else { return Err(format!("Not found: Table {table}")) };
        arrow_rows::check(&rows.schema(), &t.schema)?;
        if let Some((row, why)) = arrow_rows::check_rows(&rows, &t.schema).into_iter().next() {
            return Err(format!("row {row}: {why}"));
        }
        inner.absorb(table);
        if let Some(t) = inner.tables.get_mut(table) {
            t.materialized.push(state::StoredRows::Arrow(rows));
            t.version += 1;
        }
        Ok(())
    }

    /// How many visible rows each partition of a partitioned table holds,
    /// by partition id (`20240131`, or `__NULL__`).
    pub fn partition_counts(&self, table: &str) -> Result<BTreeMap<String, u64>, String> {
        let inner = self.shared.inner();
        let Some(t) = inner.tables.get(table) else { return Err(format!("Not found: Table {table}")) };
        let Some(partitioning) = &t.time_partitioning else { return Err(format!("Table {table} is not partitioned")) };
        let mut counts = BTreeMap::new();
        for batch in inner.visible_batches(table) {
            for row in batch.to_json() {
                *counts.entry(partitioning.partition_of(&row, &t.schema)?).or_insert(0) += 1;
            }
        }
        Ok(counts)
    }

    /// Aims `fault` at the `nth` `jobs.insert` call (counted from 1).
    pub fn inject_job(&self, nth: u64, fault: JobFault) {
        self.shared.job_faults.lock().unwrap_or_else(|p| p.into_inner()).push((nth, fault));
    }

    /// The job `job_id` of `project`, as the double keeps it.
    pub fn job(&self, project: &str, job_id: &str) -> Option<Job> {
        self.shared.inner().jobs.get(&(project.to_string(), job_id.to_string())).cloned()
    }

    /// Every job, by project then job id.
    pub fn jobs(&self) -> Vec<Job> {
        self.shared.inner().jobs.values().cloned().collect()
    }

    /// Requires `authorization: Bearer <token>` on every call; others get
    /// UNAUTHENTICATED ("The request does not have valid authentication
    /// credentials for the operation").
    pub fn require_token(&self, token: &str) {
        let token = token.to_string();
        self.require_valid_token(move |given| given == token);
    }

    /// Requires `authorization: Bearer <token>` on every call with a token
    /// `valid` accepts (a token service's own view: issued by it and not
    /// expired); others get UNAUTHENTICATED, as the real service answers an
    /// expired or unknown OAuth token (gRPC `UNAUTHENTICATED`, HTTP 401).
    /// Like the real service, a streaming call is checked once, when it
    /// opens: a token that expires while AppendRows runs does not end it.
    pub fn require_valid_token(&self, valid: impl Fn(&str) -> bool + Send + Sync + 'static) {
        *self.shared.token.lock().unwrap_or_else(|p| p.into_inner()) = Some(RequiredToken(Arc::new(valid)));
    }

    /// How many calls were refused as unauthenticated (gRPC and REST).
    pub fn unauthenticated(&self) -> u64 {
        self.shared.unauthenticated.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Leaves `table_schema` out of stream replies, as API versions before
    /// the field existed did, so a client must be given the schema.
    pub fn hide_table_schema(&self) {
        self.shared.hide_schema.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Chooses how a flush at or below the flushed offset is answered.
    pub fn answer_reflush(&self, answer: Reflush) {
        *self.shared.reflush.lock().unwrap_or_else(|p| p.into_inner()) = answer;
    }

    /// Makes FlushRows on a finalized BUFFERED stream fail with
    /// `FAILED_PRECONDITION` / `STREAM_FINALIZED`. (The reference does not
    /// say whether a finalized BUFFERED stream can still be flushed; by
    /// default the double lets it be.)
    pub fn refuse_flush_when_finalized(&self) {
        self.shared.refuse_flush_when_finalized.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Deletes a stream, as the service does with abandoned streams: every
    /// later call naming it is `NOT_FOUND` / `STREAM_NOT_FOUND`. Rows it
    /// already made visible stay in the table; the rest are gone.
    pub fn delete_stream(&self, name: &str) -> bool {
        match self.shared.inner().streams.get_mut(name) {
            Some(s) if !s.deleted => {
                s.deleted = true;
                true
            }
            _ => false,
        }
    }

    /// Finalizes a stream: no more appends (`FinalizeWriteStream`).
    pub fn finalize_stream(&self, name: &str) -> bool {
        match self.shared.inner().stream_mut(name) {
            Some(s) => {
                s.finalized = true;
                true
            }
            None => false,
        }
    }

    /// Names of `table`'s streams, in creation order.
    pub fn streams(&self, table: &str) -> Vec<String> {
        let inner = self.shared.inner();
        let mut names: Vec<String> =
            inner.streams.iter().filter(|(_, s)| s.table == table).map(|(n, _)| n.clone()).collect();
        names.sort();
        names
    }

    /// Aims `fault` at the `nth` call of `rpc` (counted from 1 since start).
    pub fn inject(&self, rpc: Rpc, nth: u64, fault: Fault) {
        self.shared.faults.lock().unwrap_or_else(|p| p.into_inner()).push((rpc, nth, fault));
    }

    /// How many calls of `rpc` the double has seen.
    pub fn calls(&self, rpc: Rpc) -> u64 {
        self.shared.calls.lock().unwrap_or_else(|p| p.into_inner()).get(&rpc).copied().unwrap_or(0)
    }

    pub fn stats(&self) -> Stats {
        *self.shared.stats()
    }

    /// The rows readers of `table` see now, decoded with the writer schema
    /// they were appended with.
    pub fn visible_rows(&self, table: &str) -> Vec<serde_json::Map<String, serde_json::Value>> {
        let batches = self.visible_batches(table);
        batches.iter().flat_map(state::StoredRows::to_json).collect()
    }

    /// Number of visible rows of `table` (cheap: nothing is decoded).
    pub fn visible_count(&self, table: &str) -> u64 {
        self.visible_batches(table).iter().map(|b| b.len() as u64).sum()
    }

    fn visible_batches(&self, table: &str) -> Vec<state::StoredRows> {
        self.shared.inner().visible_batches(table)
    }

    /// Rows appended to `table`'s streams but not visible (never flushed).
    pub fn invisible_count(&self, table: &str) -> u64 {
        let inner = self.shared.inner();
        inner.streams.values().filter(|s| s.table == table).map(|s| (s.len - s.visible()) as u64).sum()
    }
}

impl Drop for BigQueryDouble {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(true);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A column of a table schema.
pub fn column(name: &str, ty: Type, mode: Mode) -> TableFieldSchema {
    TableFieldSchema { name: name.to_string(), r#type: ty as i32, mode: mode as i32, ..Default::default() }
}

/// The schema of the rows Sluice's `generator` source produces.
pub fn generator_schema() -> TableSchema {
    TableSchema {
        fields: vec![
            column("id", Type::Int64, Mode::Required),
            column("qty", Type::Int64, Mode::Required),
            column("price", Type::Double, Mode::Required),
            TableFieldSchema { precision: 18, scale: 2, ..column("amount", Type::Numeric, Mode::Required) },
            column("name", Type::String, Mode::Required),
            column("note", Type::String, Mode::Nullable),
            column("day", Type::Date, Mode::Required),
            column("ts", Type::Timestamp, Mode::Required),
        ],
    }
}
