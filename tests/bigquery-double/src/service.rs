//! The `google.cloud.bigquery.storage.v1.BigQueryWrite` service over tonic.
//!
//! The published crate generates the client only, so the routing below does
//! by hand what tonic's generated server code does: match the method path,
//! decode with prost, call the handler.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use googleapis_tonic_google_rpc::google::rpc::Status as RpcStatus;
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, StdError, http};
use tonic::server::{Grpc, NamedService, StreamingService, UnaryService};
use tonic::{Code, Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

use crate::proto::append_rows_request::Rows;
use crate::proto::append_rows_response::{AppendResult, Response as AppendReply};
use crate::proto::storage_error::StorageErrorCode;
use crate::proto::write_stream::Type as StreamType;
use crate::proto::{
    AppendRowsRequest, AppendRowsResponse, BatchCommitWriteStreamsRequest, BatchCommitWriteStreamsResponse,
    CreateWriteStreamRequest, FinalizeWriteStreamRequest, FinalizeWriteStreamResponse, FlushRowsRequest,
    FlushRowsResponse, GetWriteStreamRequest, RowError, StorageError, TableSchema, WriteStream, WriteStreamView,
    row_error::RowErrorCode,
};
use crate::state::{Inner, StoredRows, Stream};
use crate::{Fault, Rpc, Shared, arrow_rows, cdc, schema};

/// "The size of a single AppendRowsRequest must be less than 10 MB in size.
/// Requests larger than this return an error, typically INVALID_ARGUMENT."
pub const MAX_REQUEST_BYTES: usize = 10 * 1024 * 1024;

const SERVICE: &str = "google.cloud.bigquery.storage.v1.BigQueryWrite";
const STORAGE_ERROR_TYPE: &str = "type.googleapis.com/google.cloud.bigquery.storage.v1.StorageError";

#[derive(Clone)]
pub struct BigQueryWriteService {
    pub(crate) shared: Arc<Shared>,
}

impl NamedService for BigQueryWriteService {
    const NAME: &'static str = SERVICE;
}

/// A `google.rpc.Status` whose details hold a `StorageError`.
fn rpc_status(code: Code, message: &str, storage: Option<(StorageErrorCode, &str)>) -> RpcStatus {
    let details = storage
        .map(|(c, entity)| prost_types::Any {
            type_url: STORAGE_ERROR_TYPE.to_string(),
            value: StorageError { code: c as i32, entity: entity.to_string(), error_message: message.to_string() }
                .encode_to_vec(),
        })
        .into_iter()
        .collect();
    RpcStatus { code: code as i32, message: message.to_string(), details }
}

/// The same error as a gRPC status with `grpc-status-details-bin`.
fn status(code: Code, message: &str, storage: Option<(StorageErrorCode, &str)>) -> Status {
    let details = rpc_status(code, message, storage).encode_to_vec();
    Status::with_details(code, message.to_string(), details.into())
}

fn table_not_found(table: &str) -> Status {
    status(Code::NotFound, &format!("Table {table} not found"), Some((StorageErrorCode::TableNotFound, table)))
}

fn stream_not_found(name: &str) -> Status {
    status(Code::NotFound, &format!("Stream {name} not found"), Some((StorageErrorCode::StreamNotFound, name)))
}

impl BigQueryWriteService {
    async fn delay(fault: Option<Fault>) {
        if let Some(Fault::Delay(d)) = fault {
            tokio::time::sleep(d).await;
        }
    }

    async fn create_write_stream(&self, req: CreateWriteStreamRequest) -> Result<WriteStream, Status> {
        let fault = self.shared.next_call(Rpc::CreateWriteStream);
        Self::delay(fault).await;
        if matches!(fault, Some(Fault::Unavailable | Fault::FailBeforeApply)) {
            return Err(Status::unavailable("injected: connection reset before CreateWriteStream"));
        }
        let requested = req.write_stream.unwrap_or_default();
        let kind = StreamType::try_from(requested.r#type).unwrap_or(StreamType::Unspecified);
        if kind == StreamType::Unspecified {
            return Err(status(
                Code::InvalidArgument,
                "write_stream.type must be COMMITTED, PENDING or BUFFERED",
                None,
            ));
        }
        let mut inner = self.shared.inner();
        let Some(table) = inner.tables.get(&req.parent) else { return Err(table_not_found(&req.parent)) };
        let table_schema = table.schema.clone();
        let hide = self.shared.hide_schema.load(std::sync::atomic::Ordering::Relaxed);
        inner.next_stream += 1;
        let name = format!("{}/streams/s{:06}", req.parent, inner.next_stream);
        let mut stream = Stream::new(&req.parent, kind);
        stream.schema = Some(table_schema.clone());
        inner.streams.insert(name.clone(), stream);
        drop(inner);
        self.shared.stats().streams_created += 1;
        let reply = WriteStream {
            name,
            r#type: kind as i32,
            // "table_schema: ... It is only returned in CreateWriteStream
            // response. Caller should generate data that's compatible with
            // this schema to send in initial AppendRowsRequest."
            table_schema: if hide { None } else { Some(table_schema) },
            ..Default::default()
        };
        if fault == Some(Fault::ApplyThenDropReply) {
            return Err(Status::unavailable("injected: connection reset after CreateWriteStream"));
        }
        Ok(reply)
    }

    fn get_write_stream(&self, req: GetWriteStreamRequest) -> Result<WriteStream, Status> {
        let mut inner = self.shared.inner();
        let full = req.view == WriteStreamView::Full as i32
            && !self.shared.hide_schema.load(std::sync::atomic::Ordering::Relaxed);
        if let Some(table) = Inner::default_stream_table(&req.name)
            && !inner.tables.contains_key(table)
        {
            return Err(table_not_found(table));
        }
        let Some(stream) = inner.stream_mut(&req.name) else { return Err(stream_not_found(&req.name)) };
        let (table, kind) = (stream.table.clone(), stream.kind);
        let schema = inner.tables.get(&table).map(|t| t.schema.clone());
        Ok(WriteStream {
            name: req.name,
            r#type: kind as i32,
            // "FULL: ... includes the table schema" (WriteStreamView).
            table_schema: if full { schema } else { None },
            ..Default::default()
        })
    }

    async fn flush_rows(&self, req: FlushRowsRequest) -> Result<FlushRowsResponse, Status> {
        let fault = self.shared.next_call(Rpc::FlushRows);
        Self::delay(fault).await;
        self.shared.stats().flush_calls += 1;
        match fault {
            Some(Fault::Unavailable | Fault::FailBeforeApply) => {
                return Err(Status::unavailable("injected: connection reset before FlushRows"));
            }
            Some(Fault::OutOfRange) => {
                return Err(status(
                    Code::OutOfRange,
                    "injected: flush offset beyond the end of the stream",
                    Some((StorageErrorCode::OffsetOutOfRange, &req.write_stream)),
                ));
            }
            _ => {}
        }
        let mut inner = self.shared.inner();
        if Inner::is_default(&req.write_stream) {
            // "Flush is not supported on the _default stream, since it is not BUFFERED."
            return Err(status(
                Code::InvalidArgument,
                "Flush is not supported on the _default stream",
                Some((StorageErrorCode::InvalidStreamType, &req.write_stream)),
            ));
        }
        let Some(stream) = inner.stream_mut(&req.write_stream) else {
            return Err(stream_not_found(&req.write_stream));
        };
        if stream.kind != StreamType::Buffered {
            return Err(status(
                Code::InvalidArgument,
                "FlushRows needs a BUFFERED stream",
                Some((StorageErrorCode::InvalidStreamType, &req.write_stream)),
            ));
        }
        if stream.finalized && self.shared.refuse_flush_when_finalized.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(status(
                Code::FailedPrecondition,
                &format!("Stream {} is finalized", req.write_stream),
                Some((StorageErrorCode::StreamFinalized, &req.write_stream)),
            ));
        }
        let offset = req.offset.unwrap_or(stream.len - 1);
        if offset < 0 || offset >= stream.len {
            // The wording of the real service, which Apache Beam matches.
            return Err(status(
                Code::OutOfRange,
                &format!("Offset {offset} is beyond the end of the stream ({} rows)", stream.len),
                Some((StorageErrorCode::OffsetOutOfRange, &req.write_stream)),
            ));
        }
        if offset < stream.flushed {
            // Already flushed up to here: nothing changes, whatever the answer.
            let answer = *self.shared.reflush.lock().unwrap_or_else(|p| p.into_inner());
            let flushed = stream.flushed - 1;
            match answer {
                crate::Reflush::Ok => {}
                crate::Reflush::AlreadyExists => {
                    return Err(status(
                        Code::AlreadyExists,
                        &format!("Offset {offset} already flushed (flushed up to {flushed})"),
                        Some((StorageErrorCode::OffsetAlreadyExists, &req.write_stream)),
                    ));
                }
                crate::Reflush::OutOfRange => {
                    return Err(status(
                        Code::OutOfRange,
                        &format!("Offset {offset} already flushed; next expected > {flushed}"),
                        Some((StorageErrorCode::OffsetOutOfRange, &req.write_stream)),
                    ));
                }
            }
        }
        // Inclusive and cumulative.
        stream.flushed = stream.flushed.max(offset + 1);
        drop(inner);
        if fault == Some(Fault::ApplyThenDropReply) {
            return Err(Status::unavailable("injected: connection reset after FlushRows was applied"));
        }
        Ok(FlushRowsResponse { offset })
    }

    fn finalize(&self, req: FinalizeWriteStreamRequest) -> Result<FinalizeWriteStreamResponse, Status> {
        let mut inner = self.shared.inner();
        if Inner::is_default(&req.name) {
            return Err(status(
                Code::InvalidArgument,
                "The _default stream cannot be finalized",
                Some((StorageErrorCode::InvalidStreamType, &req.name)),
            ));
        }
        let Some(stream) = inner.stream_mut(&req.name) else { return Err(stream_not_found(&req.name)) };
        stream.finalized = true;
        Ok(FinalizeWriteStreamResponse { row_count: stream.len })
    }

    fn batch_commit(&self, req: BatchCommitWriteStreamsRequest) -> Result<BatchCommitWriteStreamsResponse, Status> {
        let mut inner = self.shared.inner();
        let mut errors = Vec::new();
        for name in &req.write_streams {
            let error = match inner.streams.get(name).filter(|s| !s.deleted) {
                None => Some((StorageErrorCode::StreamNotFound, "stream not found")),
                Some(s) if s.table != req.parent => Some((StorageErrorCode::StreamNotFound, "stream of another table")),
                Some(s) if s.kind != StreamType::Pending => Some((StorageErrorCode::InvalidStreamType, "not PENDING")),
                Some(s) if !s.finalized => Some((StorageErrorCode::InvalidStreamState, "not finalized")),
                Some(s) if s.committed => Some((StorageErrorCode::StreamAlreadyCommitted, "already committed")),
                Some(_) => None,
            };
            if let Some((code, message)) = error {
                errors.push(StorageError { code: code as i32, entity: name.clone(), error_message: message.into() });
            }
        }
        // "If any stream fails to commit, none of the streams are committed."
        if errors.is_empty() {
            for name in &req.write_streams {
                if let Some(s) = inner.streams.get_mut(name) {
                    s.committed = true;
                }
            }
            return Ok(BatchCommitWriteStreamsResponse {
                commit_time: Some(prost_types::Timestamp::default()),
                stream_errors: vec![],
            });
        }
        Ok(BatchCommitWriteStreamsResponse { commit_time: None, stream_errors: errors })
    }
}

/// Per-connection state of an AppendRows call.
#[derive(Default)]
struct Connection {
    stream: Option<String>,
    /// The writer schema of the connection's first request.
    format: Option<Format>,
    /// Whether the proto writer schema carries `_CHANGE_TYPE`: its rows are
    /// CDC changes ([`crate::cdc`]).
    cdc: bool,
}

/// How a connection's rows are encoded.
enum Format {
    Proto(Arc<prost_reflect::MessageDescriptor>),
    /// The IPC-serialized schema, which every record batch is read with.
    Arrow(Vec<u8>),
}

impl Connection {
    /// Takes the request's writer schema when it carries one, checked
    /// against the table's columns.
    fn take_writer_schema(&mut self, rows: &Rows, table: &TableSchema) -> Result<(), String> {
        match rows {
            Rows::ProtoRows(p) => {
                if let Some(ws) = p.writer_schema.as_ref().and_then(|s| s.proto_descriptor.as_ref()) {
                    let message = schema::compile(ws)?;
                    // The pseudo-columns ride beside the table's own.
                    let cdc = message.fields().any(|f| f.name().eq_ignore_ascii_case(cdc::CHANGE_TYPE));
                    if cdc {
                        schema::check(&message, &cdc::with_pseudo_columns(table))?;
                    } else {
                        schema::check(&message, table)?;
                    }
                    self.cdc = cdc;
                    self.format = Some(Format::Proto(Arc::new(message)));
                }
            }
            Rows::ArrowRows(a) => {
                // "it will be ignored if specified in following requests"
                if let (None, Some(ws)) = (&self.format, &a.writer_schema) {
                    let arrow = arrow_rows::decode_schema(&ws.serialized_schema)?;
                    if arrow.fields().iter().any(|f| f.name().eq_ignore_ascii_case(cdc::CHANGE_TYPE)) {
                        // "You must use the protobuf format as the ingestion format.
                        // The Apache Arrow format isn't supported" (change-data-capture).
                        return Err(format!(
                            "{}: change data capture takes protobuf rows only; the Apache Arrow format isn't supported",
                            cdc::CHANGE_TYPE
                        ));
                    }
                    arrow_rows::check(&arrow, table)?;
                    self.format = Some(Format::Arrow(ws.serialized_schema.clone()));
                }
            }
        }
        Ok(())
    }

    /// Decodes a request's rows with the connection's writer schema: the
    /// rows, their row errors and their size.
    fn rows(&self, rows: Rows, table: &TableSchema) -> Result<(StoredRows, Vec<RowError>, u64), String> {
        let row_error = |(index, message): (usize, String)| RowError {
            index: index as i64,
            code: RowErrorCode::FieldsError as i32,
            message,
        };
        match (rows, &self.format) {
            (Rows::ProtoRows(p), Some(Format::Proto(descriptor))) => {
                let rows = p.rows.map(|r| r.serialized_rows).unwrap_or_default();
                let checked = if self.cdc { cdc::with_pseudo_columns(table) } else { table.clone() };
                let errors = rows
                    .iter()
                    .enumerate()
                    .filter_map(|(i, r)| schema::check_row(descriptor, r, &checked).err().map(|m| row_error((i, m))))
                    .collect();
                let bytes = rows.iter().map(|r| r.len() as u64).sum();
                Ok((StoredRows::Proto { descriptor: descriptor.clone(), rows }, errors, bytes))
            }
            (Rows::ArrowRows(a), Some(Format::Arrow(schema_bytes))) => {
                let serialized = a.rows.map(|r| r.serialized_record_batch).unwrap_or_default();
                let batch = arrow_rows::decode_batch(schema_bytes, &serialized)?;
                let errors = arrow_rows::check_rows(&batch, table).into_iter().map(row_error).collect();
                Ok((StoredRows::Arrow(batch), errors, serialized.len() as u64))
            }
            // "Following requests must have data in the same format as the initial request."
            _ => Err("the rows are not in the format of the connection's first request".to_string()),
        }
    }
}

enum Outcome {
    Reply(AppendRowsResponse),
    /// End the call with this status (the connection is lost or refused).
    End(Status),
}

fn in_band(stream: &str, status: RpcStatus) -> Outcome {
    Outcome::Reply(AppendRowsResponse {
        write_stream: stream.to_string(),
        response: Some(AppendReply::Error(status)),
        ..Default::default()
    })
}

impl BigQueryWriteService {
    /// Handles one request of an AppendRows connection.
    async fn append(&self, conn: &mut Connection, req: AppendRowsRequest) -> Outcome {
        let size = req.encoded_len();
        let fault = self.shared.next_call(Rpc::Append);
        Self::delay(fault).await;
        self.shared.stats().append_requests += 1;
        // "The first request must always have write_stream set"; later ones may omit it.
        if !req.write_stream.is_empty() {
            if conn.stream.as_ref().is_some_and(|s| s != &req.write_stream) {
                return Outcome::End(status(Code::InvalidArgument, "write_stream changed within one connection", None));
            }
            conn.stream = Some(req.write_stream.clone());
        }
        let Some(name) = conn.stream.clone() else {
            return Outcome::End(status(
                Code::InvalidArgument,
                "the first AppendRowsRequest must set write_stream",
                None,
            ));
        };
        if size > MAX_REQUEST_BYTES {
            return in_band(
                &name,
                rpc_status(
                    Code::InvalidArgument,
                    &format!("AppendRows request too large: {size} bytes, limit {MAX_REQUEST_BYTES}"),
                    None,
                ),
            );
        }
        match fault {
            Some(Fault::Unavailable) => {
                return Outcome::End(Status::unavailable("injected: connection reset before the append"));
            }
            Some(Fault::FailBeforeApply) => {
                return in_band(
                    &name,
                    rpc_status(Code::Internal, "injected: internal error, the append was not applied", None),
                );
            }
            Some(Fault::OutOfRange) => {
                return in_band(
                    &name,
                    rpc_status(
                        Code::OutOfRange,
                        "injected: offset beyond the end of the stream",
                        Some((StorageErrorCode::OffsetOutOfRange, &name)),
                    ),
                );
            }
            _ => {}
        }
        let Some(rows) = req.rows else {
            return in_band(&name, rpc_status(Code::InvalidArgument, "the request has no rows", None));
        };
        // Schema: "The first request ... must include writer_schema"; it stays for the connection.
        let table_schema = {
            let mut inner = self.shared.inner();
            let Some(stream) = inner.stream_mut(&name) else {
                return in_band(
                    &name,
                    rpc_status(
                        Code::NotFound,
                        &format!("Stream {name} not found"),
                        Some((StorageErrorCode::StreamNotFound, &name)),
                    ),
                );
            };
            let (table, own) = (stream.table.clone(), stream.schema.clone());
            match inner.tables.get(&table) {
                // A stream checks rows against the schema it was created with.
                Some(t) => own.unwrap_or_else(|| t.schema.clone()),
                None => {
                    return in_band(
                        &name,
                        rpc_status(
                            Code::NotFound,
                            &format!("Table {table} not found"),
                            Some((StorageErrorCode::TableNotFound, &table)),
                        ),
                    );
                }
            }
        };
        if let Err(e) = conn.take_writer_schema(&rows, &table_schema) {
            let code = e
                .starts_with("Input schema has more fields")
                .then_some((StorageErrorCode::SchemaMismatchExtraFields, name.as_str()));
            return in_band(&name, rpc_status(Code::InvalidArgument, &e, code));
        }
        if conn.format.is_none() {
            return in_band(
                &name,
                rpc_status(Code::InvalidArgument, "the first request of a connection must carry writer_schema", None),
            );
        }
        if conn.cdc {
            return self.apply_changes(&name, conn, rows, &table_schema, fault).await;
        }
        // Offsets are checked before the rows, on the stream as it is now.
        {
            let mut inner = self.shared.inner();
            let Some(stream) = inner.stream_mut(&name) else {
                return in_band(
                    &name,
                    rpc_status(Code::NotFound, "stream vanished", Some((StorageErrorCode::StreamNotFound, &name))),
                );
            };
            if stream.finalized {
                return in_band(
                    &name,
                    rpc_status(
                        Code::InvalidArgument,
                        "Stream is finalized",
                        Some((StorageErrorCode::StreamFinalized, &name)),
                    ),
                );
            }
            if let Some(offset) = req.offset {
                // "ALREADY_EXISTS: Happens when an append specified an offset,
                // and the backend already has received data at this offset."
                if offset < stream.len {
                    drop(inner);
                    self.shared.stats().already_exists += 1;
                    return in_band(
                        &name,
                        rpc_status(
                            Code::AlreadyExists,
                            &format!("Offset {offset} already exists"),
                            Some((StorageErrorCode::OffsetAlreadyExists, &name)),
                        ),
                    );
                }
                // "OUT_OF_RANGE: Returned when the specified offset in the
                // stream is beyond the current end of the stream."
                if offset > stream.len {
                    return in_band(
                        &name,
                        rpc_status(
                            Code::OutOfRange,
                            &format!("Offset {offset} is beyond the end of the stream ({})", stream.len),
                            Some((StorageErrorCode::OffsetOutOfRange, &name)),
                        ),
                    );
                }
            }
        }
        // "If a request failed due to corrupted rows, no rows in the batch will be appended."
        let (rows, row_errors, bytes) = match conn.rows(rows, &table_schema) {
            Ok(decoded) => decoded,
            Err(e) => return in_band(&name, rpc_status(Code::InvalidArgument, &e, None)),
        };
        if !row_errors.is_empty() {
            return Outcome::Reply(AppendRowsResponse {
                write_stream: name.clone(),
                response: Some(AppendReply::Error(rpc_status(
                    Code::InvalidArgument,
                    "Rows are invalid; see row_errors",
                    None,
                ))),
                row_errors,
                ..Default::default()
            });
        }
        let n = rows.len() as i64;
        let start = {
            let mut inner = self.shared.inner();
            let Some(stream) = inner.stream_mut(&name) else {
                return in_band(
                    &name,
                    rpc_status(Code::NotFound, "stream vanished", Some((StorageErrorCode::StreamNotFound, &name))),
                );
            };
            // Offsets were checked above; another connection may have raced us.
            if req.offset.is_some_and(|o| o != stream.len) {
                return in_band(
                    &name,
                    rpc_status(
                        Code::AlreadyExists,
                        "Offset already exists",
                        Some((StorageErrorCode::OffsetAlreadyExists, &name)),
                    ),
                );
            }
            let start = stream.len;
            stream.len += n;
            stream.batches.push(rows);
            start
        };
        {
            let mut stats = self.shared.stats();
            stats.rows_appended += n as u64;
            stats.bytes_appended += bytes;
        }
        if fault == Some(Fault::ApplyThenDropReply) {
            return Outcome::End(Status::unavailable("injected: connection reset after the append was applied"));
        }
        Outcome::Reply(AppendRowsResponse {
            write_stream: name,
            response: Some(AppendReply::AppendResult(AppendResult { offset: req.offset.map(|_| start) })),
            ..Default::default()
        })
    }
}

impl BigQueryWriteService {
    /// A request of CDC changes ([`crate::cdc`]): refused unless it goes to
    /// a `_default` stream of a table with a primary key; its rows are
    /// checked whole (a bad row rejects the request), then applied in order
    /// by key and sequence number.
    async fn apply_changes(
        &self,
        name: &str,
        conn: &Connection,
        rows: Rows,
        table_schema: &TableSchema,
        fault: Option<Fault>,
    ) -> Outcome {
        let Some(table) = Inner::default_stream_table(name).map(str::to_string) else {
            return in_band(
                name,
                rpc_status(
                    Code::InvalidArgument,
                    &format!("{} is only supported on the _default stream; {name} is not one", cdc::CHANGE_TYPE),
                    Some((StorageErrorCode::InvalidStreamType, name)),
                ),
            );
        };
        let key = self.shared.inner().tables.get(&table).map(|t| t.primary_key.clone()).unwrap_or_default();
        if key.is_empty() {
            return in_band(
                name,
                rpc_status(
                    Code::InvalidArgument,
                    &format!("{} needs a primary key on table {table}, which has none", cdc::CHANGE_TYPE),
                    None,
                ),
            );
        }
        let (stored, mut row_errors, bytes) = match conn.rows(rows, table_schema) {
            Ok(decoded) => decoded,
            Err(e) => return in_band(name, rpc_status(Code::InvalidArgument, &e, None)),
        };
        let mut changes = Vec::with_capacity(stored.len());
        if row_errors.is_empty() {
            for (i, row) in stored.to_json().into_iter().enumerate() {
                match cdc::read_change(row, &key) {
                    Ok(c) => changes.push(c),
                    Err(message) => {
                        row_errors.push(RowError { index: i as i64, code: RowErrorCode::FieldsError as i32, message })
                    }
                }
            }
        }
        if !row_errors.is_empty() {
            return Outcome::Reply(AppendRowsResponse {
                write_stream: name.to_string(),
                response: Some(AppendReply::Error(rpc_status(
                    Code::InvalidArgument,
                    "Rows are invalid; see row_errors",
                    None,
                ))),
                row_errors,
                ..Default::default()
            });
        }
        let equal = *self.shared.equal_sequence.lock().unwrap_or_else(|p| p.into_inner());
        let received = changes.len() as u64;
        let applied = {
            let mut inner = self.shared.inner();
            let Some(t) = inner.tables.get_mut(&table) else {
                return in_band(
                    name,
                    rpc_status(
                        Code::NotFound,
                        &format!("Table {table} not found"),
                        Some((StorageErrorCode::TableNotFound, &table)),
                    ),
                );
            };
            let applied = cdc::apply(&mut t.keyed, changes, equal);
            t.version += 1;
            applied as u64
        };
        {
            let mut stats = self.shared.stats();
            stats.rows_appended += received;
            stats.bytes_appended += bytes;
            stats.changes_received += received;
            stats.changes_applied += applied;
        }
        if fault == Some(Fault::ApplyThenDropReply) {
            return Outcome::End(Status::unavailable("injected: connection reset after the changes were applied"));
        }
        Outcome::Reply(AppendRowsResponse {
            write_stream: name.to_string(),
            response: Some(AppendReply::AppendResult(AppendResult { offset: None })),
            ..Default::default()
        })
    }
}

macro_rules! unary {
    ($name:ident, $req:ty, $resp:ty, |$svc:ident, $r:ident| $body:expr) => {
        struct $name(BigQueryWriteService);
        impl UnaryService<$req> for $name {
            type Response = $resp;
            type Future = BoxFuture<Response<$resp>, Status>;
            fn call(&mut self, request: Request<$req>) -> Self::Future {
                let $svc = self.0.clone();
                let $r = request.into_inner();
                Box::pin(async move { $body.map(Response::new) })
            }
        }
    };
}

unary!(CreateSvc, CreateWriteStreamRequest, WriteStream, |s, r| s.create_write_stream(r).await);
unary!(GetSvc, GetWriteStreamRequest, WriteStream, |s, r| s.get_write_stream(r));
unary!(FlushSvc, FlushRowsRequest, FlushRowsResponse, |s, r| s.flush_rows(r).await);
unary!(FinalizeSvc, FinalizeWriteStreamRequest, FinalizeWriteStreamResponse, |s, r| s.finalize(r));
unary!(CommitSvc, BatchCommitWriteStreamsRequest, BatchCommitWriteStreamsResponse, |s, r| s.batch_commit(r));

struct AppendSvc(BigQueryWriteService);

impl StreamingService<AppendRowsRequest> for AppendSvc {
    type Response = AppendRowsResponse;
    type ResponseStream = ReceiverStream<Result<AppendRowsResponse, Status>>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<AppendRowsRequest>>) -> Self::Future {
        let svc = self.0.clone();
        if let Some(peer) = request.remote_addr() {
            svc.shared.append_peers.lock().unwrap_or_else(|p| p.into_inner()).push(peer);
        }
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let mut conn = Connection::default();
            loop {
                let req = match inbound.message().await {
                    Ok(Some(r)) => r,
                    Ok(None) => break,
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        break;
                    }
                };
                match svc.append(&mut conn, req).await {
                    Outcome::Reply(r) => {
                        if tx.send(Ok(r)).await.is_err() {
                            break;
                        }
                    }
                    Outcome::End(s) => {
                        let _ = tx.send(Err(s)).await;
                        break;
                    }
                }
            }
        });
        Box::pin(async move { Ok(Response::new(ReceiverStream::new(rx))) })
    }
}

impl<B> Service<http::Request<B>> for BigQueryWriteService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let svc = self.clone();
        let required = self.shared.token.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(token) = required {
            let given = req.headers().get("authorization").and_then(|v| v.to_str().ok());
            if !token.accepts(given) {
                self.shared.unauthenticated.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                return Box::pin(async move {
                    Ok(Status::unauthenticated("Request is missing required authentication credential").into_http())
                });
            }
        }
        // Requests up to the API's own limit (and a little over, so that the
        // limit is reported the way the API reports it) are decoded.
        let limit = Some(MAX_REQUEST_BYTES * 2);
        macro_rules! route_unary {
            ($s:expr) => {{
                let s = $s;
                Box::pin(async move {
                    let mut g = Grpc::new(ProstCodec::default()).apply_max_message_size_config(limit, None);
                    Ok(g.unary(s, req).await)
                }) as Self::Future
            }};
        }
        match req.uri().path().strip_prefix(concat!("/", "google.cloud.bigquery.storage.v1.BigQueryWrite", "/")) {
            Some("CreateWriteStream") => route_unary!(CreateSvc(svc)),
            Some("GetWriteStream") => route_unary!(GetSvc(svc)),
            Some("FlushRows") => route_unary!(FlushSvc(svc)),
            Some("FinalizeWriteStream") => route_unary!(FinalizeSvc(svc)),
            Some("BatchCommitWriteStreams") => route_unary!(CommitSvc(svc)),
            Some("AppendRows") => Box::pin(async move {
                let mut g = Grpc::new(ProstCodec::default()).apply_max_message_size_config(limit, None);
                Ok(g.streaming(AppendSvc(svc), req).await)
            }),
            _ => Box::pin(async move { Ok(Status::unimplemented("no such method in BigQueryWrite").into_http()) }),
        }
    }
}
