//! One writer: a BUFFERED write stream of its own, appended with explicit offsets.
//!
//! Invariants:
//! - the stream is created when the writer opens, also on restore: rows a
//!   crashed run appended after its last checkpoint stay in the old stream,
//!   past the offset any checkpoint flushes, so they never become visible, and
//!   a replay that batches rows differently cannot collide with them;
//! - `next_offset` advances only when the service acknowledged the append,
//!   or answered `ALREADY_EXISTS` for the very request being retried (its
//!   earlier try landed and the reply was lost); those rows are never sent
//!   again at another offset;
//! - `OUT_OF_RANGE` fails the writer: the stream and the writer disagree;
//! - the commit info of checkpoint `c` is `(stream, next_offset - 1)`;
//!   nothing is flushed here, so nothing is visible before the committer.

use std::cell::RefCell;
use std::sync::Arc;

use arrow_schema::Schema;
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    AppendRowsRequest, AppendRowsResponse, CreateWriteStreamRequest, ProtoRows, ProtoSchema, WriteStream,
    append_rows_request::{ProtoData, Rows},
    append_rows_response::Response,
    write_stream::Type as StreamType,
};
use prost::Message;
use serde::{Deserialize, Serialize};
use sluice_bigquery_rows::{RowEncoder, split_by_size};
use sluice_guest_sdk::bindings::sluice::connector::grpc::BidiStream;
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, error, ipc, log};

use crate::config::Config;
use crate::rpc::{self, Failure};

/// What a writer persists with a checkpoint: positions and names, never rows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WriterState {
    pub stream: String,
    pub next_offset: i64,
    pub checkpoint: u64,
}

/// What the committer needs to make a writer's rows of a checkpoint visible.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct CommitInfo {
    pub stream: String,
    /// Last offset to flush (inclusive).
    pub offset: i64,
}

struct Inner {
    cfg: Config,
    ctx: SinkContext,
    encoder: RowEncoder,
    writer_schema: ProtoSchema,
    stream: String,
    next_offset: i64,
    /// `next_offset` at the last `prepare-commit`.
    prepared_offset: i64,
    checkpoint: u64,
    conn: Option<BidiStream>,
}

pub struct BigQueryWriter {
    inner: RefCell<Inner>,
}

pub(crate) fn create_stream(cfg: &Config) -> Result<WriteStream, SinkError> {
    let mut attempt = 0;
    loop {
        attempt += 1;
        let req = CreateWriteStreamRequest {
            parent: cfg.table.clone(),
            write_stream: Some(WriteStream { r#type: StreamType::Buffered as i32, ..Default::default() }),
        };
        match rpc::unary::<_, WriteStream>(&cfg.endpoint, "CreateWriteStream", &req, cfg.rpc_timeout_ms) {
            Ok(ws) => return Ok(ws),
            // A lost reply leaves an empty stream behind: harmless, it is never flushed.
            Err(Failure::Transient(m)) if attempt < cfg.attempts => {
                log::warn(&format!("CreateWriteStream on {} failed ({m}); retrying", cfg.table));
                rpc::backoff(cfg.backoff_ms, attempt + 1);
            }
            Err(f) => {
                return Err(error::config(format!(
                    "cannot create a write stream on {} through endpoint `{}`: {}",
                    cfg.table,
                    cfg.endpoint,
                    f.message()
                )));
            }
        }
    }
}

impl Inner {
    fn label(&self) -> String {
        format!("writer {} stream {}", self.ctx.subtask, self.stream)
    }

    /// Sends one request and waits for its reply on the open connection.
    fn try_append(&mut self, request: &[u8]) -> Result<AppendRowsResponse, Failure> {
        if self.conn.is_none() {
            let conn =
                BidiStream::open(&self.cfg.endpoint, &format!("{}AppendRows", rpc::SERVICE)).map_err(rpc::from_grpc)?;
            self.conn = Some(conn);
        }
        let Some(conn) = &self.conn else { return Err(Failure::Transient("no connection".into())) };
        conn.send(request).map_err(rpc::from_grpc)?;
        match conn.receive(self.cfg.rpc_timeout_ms).map_err(rpc::from_grpc)? {
            Some(bytes) => AppendRowsResponse::decode(bytes.as_slice())
                .map_err(|e| Failure::Permanent(format!("AppendRows reply is not a valid message: {e}"))),
            None => Err(Failure::Transient("the service ended the AppendRows call without a reply".into())),
        }
    }

    /// Appends `rows` at `next_offset`, retrying transient failures.
    fn append(&mut self, rows: Vec<Vec<u8>>, first_row: u64) -> Result<(), SinkError> {
        let n = rows.len() as i64;
        let offset = self.next_offset;
        let request = AppendRowsRequest {
            write_stream: self.stream.clone(),
            offset: Some(offset),
            // The schema rides on every request, so any request may open a
            // new connection (its first request must carry the schema).
            rows: Some(Rows::ProtoRows(ProtoData {
                writer_schema: Some(self.writer_schema.clone()),
                rows: Some(ProtoRows { serialized_rows: rows }),
            })),
            ..Default::default()
        }
        .encode_to_vec();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let failure = match self.try_append(&request) {
                Ok(reply) => match &reply.response {
                    Some(Response::AppendResult(r)) => {
                        if let Some(at) = r.offset
                            && at != offset
                        {
                            return Err(error::fatal(format!(
                                "{}: the service appended at offset {at}, the writer asked for {offset}",
                                self.label()
                            )));
                        }
                        self.next_offset += n;
                        return Ok(());
                    }
                    Some(Response::Error(status)) => {
                        if let Some(first) = reply.row_errors.first() {
                            let more = reply.row_errors.len() - 1;
                            return Err(error::invalid_data(format!(
                                "BigQuery rejected row {} of the batch (row {} of this writer's input since it opened): {}{}",
                                first.index,
                                first_row + first.index as u64,
                                first.message,
                                if more > 0 { format!(" (and {more} more rows)") } else { String::new() }
                            )));
                        }
                        rpc::from_rpc_status(status)
                    }
                    None => Failure::Permanent("AppendRows reply has neither a result nor an error".into()),
                },
                Err(f) => {
                    // The connection is gone or unusable; the next try opens another.
                    self.conn = None;
                    f
                }
            };
            match failure {
                Failure::AlreadyExists(m) => {
                    // Only a retry of this very request can find its offset taken.
                    if attempt == 1 {
                        return Err(error::fatal(format!(
                            "{}: offset {offset} already holds rows this writer never sent ({m}); \
                             another writer is using the stream",
                            self.label()
                        )));
                    }
                    log::info(&format!(
                        "{}: rows at offset {offset} were already appended (the earlier reply was lost); counted, not resent",
                        self.label()
                    ));
                    self.next_offset += n;
                    return Ok(());
                }
                Failure::OutOfRange(m) => {
                    return Err(error::fatal(format!(
                        "{}: the stream rejects offset {offset} as out of range ({m}); the writer and the stream disagree, \
                         so the job stops rather than risk duplicates",
                        self.label()
                    )));
                }
                Failure::Transient(m) if attempt < self.cfg.attempts => {
                    log::warn(&format!("{}: append at offset {offset} failed ({m}); retrying", self.label()));
                    rpc::backoff(self.cfg.backoff_ms, attempt + 1);
                }
                Failure::Transient(m) => {
                    return Err(error::fatal(format!(
                        "{}: append at offset {offset} failed {attempt} times, last: {m}",
                        self.label()
                    )));
                }
                Failure::Permanent(m) => {
                    return Err(error::fatal(format!("{}: append at offset {offset} failed: {m}", self.label())));
                }
            }
        }
    }
}

impl GuestWriter for BigQueryWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        schema: Vec<u8>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Config::parse(options)?;
        let arrow: Arc<Schema> = ipc::decode_schema(&schema)?;
        let restored: Option<WriterState> = match restored_state {
            Some(bytes) => Some(
                serde_json::from_slice(&bytes)
                    .map_err(|e| error::fatal(format!("restored writer state is not valid: {e}")))?,
            ),
            None => None,
        };
        let ws = create_stream(&cfg)?;
        let encoder = RowEncoder::new(arrow, ws.table_schema.as_ref())
            .map_err(|e| error::config(format!("{}: {e}", cfg.table)))?;
        if let Some(old) = &restored {
            log::info(&format!(
                "writer {} restored after checkpoint {}: stream {} stays at offset {}, new rows go to {}",
                ctx.subtask, old.checkpoint, old.stream, old.next_offset, ws.name
            ));
        }
        let writer_schema = encoder.writer_schema();
        let inner = Inner {
            cfg,
            ctx,
            encoder,
            writer_schema,
            stream: ws.name,
            next_offset: 0,
            prepared_offset: 0,
            checkpoint: restored.map(|r| r.checkpoint).unwrap_or(0),
            conn: None,
        };
        Ok(sluice_guest_sdk::Writer::new(BigQueryWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let (_, batches) = ipc::decode(&rows)?;
        let mut encoded = Vec::new();
        for batch in &batches {
            inner.encoder.encode(batch, &mut encoded).map_err(|e| error::invalid_data(e.to_string()))?;
        }
        drop(batches);
        drop(rows);
        let runs = split_by_size(&encoded, inner.cfg.max_request_bytes);
        let mut encoded = encoded.into_iter();
        for run in runs {
            let chunk: Vec<Vec<u8>> = encoded.by_ref().take(run.len()).collect();
            let first_row = inner.next_offset as u64;
            inner.append(chunk, first_row)?;
        }
        Ok(())
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.checkpoint = c;
        if inner.next_offset == inner.prepared_offset {
            return Ok(None);
        }
        inner.prepared_offset = inner.next_offset;
        let info = CommitInfo { stream: inner.stream.clone(), offset: inner.next_offset - 1 };
        serde_json::to_vec(&info).map(Some).map_err(|e| error::fatal(format!("cannot encode the commit info: {e}")))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        let inner = self.inner.borrow();
        let state = WriterState { stream: inner.stream.clone(), next_offset: inner.next_offset, checkpoint: c };
        serde_json::to_vec(&state).map_err(|e| error::fatal(format!("cannot encode the writer state: {e}")))
    }

    fn abort_prepare(&self, _c: u64) -> Result<(), SinkError> {
        // Nothing to release: unflushed rows are invisible, and a later
        // checkpoint's flush covers them only if that checkpoint persists them.
        Ok(())
    }

    fn close(&self) -> Result<(), SinkError> {
        // Appends nothing. Rows no checkpoint covers stay unflushed, so invisible.
        self.inner.borrow_mut().conn = None;
        Ok(())
    }
}
