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
//! - up to `max_inflight` requests are in flight on one connection, each
//!   with its own offset; replies come in order. When a connection fails,
//!   every unacknowledged request is sent again, in order, at the same
//!   offsets, on a new connection;
//! - `OUT_OF_RANGE` fails the writer: the stream and the writer disagree;
//! - the commit info of checkpoint `c` is `(stream, next_offset - 1)`;
//!   nothing is flushed here, so nothing is visible before the committer.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::Schema;
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    AppendRowsRequest, AppendRowsResponse, ArrowRecordBatch, ArrowSchema, CreateWriteStreamRequest, ProtoRows,
    ProtoSchema, TableSchema, WriteStream,
    append_rows_request::{ArrowData, ProtoData, Rows},
    append_rows_response::Response,
    write_stream::Type as StreamType,
};
use prost::Message;
use serde::{Deserialize, Serialize};
use sluice_bigquery_rows::{ArrowEncoder, RowEncoder, SchemaError, split_by_size};
use sluice_guest_sdk::bindings::sluice::connector::grpc::{BidiStream, Received};
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, error, ipc, log};

use crate::config::{Config, RowFormat};
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

/// One AppendRows request sent on the current connection and not yet acknowledged.
struct InFlight {
    offset: i64,
    rows: i64,
    /// Index of its first row in this writer's input (for row errors).
    first_row: u64,
    /// The encoded request, kept to resend it after a broken connection.
    request: Vec<u8>,
    /// Whether an earlier try may have reached the service: only then may
    /// `ALREADY_EXISTS` mean "it landed and the reply was lost".
    sent_before: bool,
    /// Transient failures of this request so far.
    failures: u32,
}

struct Inner {
    cfg: Config,
    ctx: SinkContext,
    encoding: Encoding,
    stream: String,
    /// Every row below this offset is acknowledged.
    next_offset: i64,
    /// Offset of the next request to send (`next_offset` + rows in flight).
    send_offset: i64,
    /// `next_offset` at the last `prepare-commit`.
    prepared_offset: i64,
    checkpoint: u64,
    /// Rows handed to `write` since the writer opened.
    rows_in: u64,
    conn: Option<BidiStream>,
    /// Requests in flight on `conn`, in offset order (replies come in order).
    in_flight: VecDeque<InFlight>,
}

pub struct BigQueryWriter {
    inner: RefCell<Inner>,
}

pub(crate) fn create_stream(cfg: &Config) -> Result<WriteStream, SinkError> {
    let req = CreateWriteStreamRequest {
        parent: cfg.table.clone(),
        write_stream: Some(WriteStream { r#type: StreamType::Buffered as i32, ..Default::default() }),
    };
    cfg.retry()
        .run(
            |_| rpc::unary::<_, WriteStream>(&cfg.endpoint, "CreateWriteStream", &req, cfg.rpc_timeout_ms),
            // A lost reply leaves an empty stream behind: harmless, it is never flushed.
            |f| matches!(f, Failure::Transient(_)),
            |f, _, _| log::warn(&format!("CreateWriteStream on {} failed ({}); retrying", cfg.table, f.message())),
        )
        .map_err(|failed| {
            error::config(format!(
                "cannot create a write stream on {} through endpoint `{}`: {}",
                cfg.table,
                cfg.endpoint,
                failed.error.message()
            ))
        })
}

/// How a writer encodes its rows: each request carries the writer schema,
/// so any request may be the first of a new connection.
enum Encoding {
    Proto { encoder: Box<RowEncoder>, writer_schema: ProtoSchema },
    Arrow { encoder: ArrowEncoder, writer_schema: ArrowSchema },
}

impl Encoding {
    fn new(format: RowFormat, arrow: Arc<Schema>, table: Option<&TableSchema>) -> Result<Self, SchemaError> {
        Ok(match format {
            RowFormat::Proto => {
                let encoder = RowEncoder::new(arrow, table)?;
                Encoding::Proto { writer_schema: encoder.writer_schema(), encoder: Box::new(encoder) }
            }
            RowFormat::Arrow => {
                let encoder = ArrowEncoder::new(arrow, table)?;
                Encoding::Arrow { writer_schema: encoder.writer_schema(), encoder }
            }
        })
    }

    /// The rows of `batches` as requests of at most `max_bytes`: `(rows, request rows)`.
    fn requests(&self, batches: &[RecordBatch], max_bytes: usize) -> Result<Vec<(i64, Rows)>, SinkError> {
        let invalid = |e: sluice_bigquery_rows::EncodeError| error::invalid_data(e.to_string());
        let mut out = Vec::new();
        match self {
            Encoding::Proto { encoder, writer_schema } => {
                let mut encoded = Vec::new();
                for batch in batches {
                    encoder.encode(batch, &mut encoded).map_err(invalid)?;
                }
                let runs = split_by_size(&encoded, max_bytes);
                let mut encoded = encoded.into_iter();
                for run in runs {
                    let rows: Vec<Vec<u8>> = encoded.by_ref().take(run.len()).collect();
                    let n = rows.len() as i64;
                    let data = ProtoData {
                        writer_schema: Some(writer_schema.clone()),
                        rows: Some(ProtoRows { serialized_rows: rows }),
                    };
                    out.push((n, Rows::ProtoRows(data)));
                }
            }
            Encoding::Arrow { encoder, writer_schema } => {
                // Room for the schema and the request's other fields (stream name, offset).
                let room = max_bytes.saturating_sub(writer_schema.serialized_schema.len() + 1024);
                for batch in batches {
                    for (n, serialized_record_batch) in encoder.encode(batch, room).map_err(invalid)? {
                        let data = ArrowData {
                            writer_schema: Some(writer_schema.clone()),
                            rows: Some(ArrowRecordBatch { serialized_record_batch, ..Default::default() }),
                        };
                        out.push((n as i64, Rows::ArrowRows(data)));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// A failure of the oldest request in flight, or of the connection.
enum Trouble {
    Failure(Failure),
    RowErrors(String),
}

impl Inner {
    fn label(&self) -> String {
        format!("writer {} stream {}", self.ctx.subtask, self.stream)
    }

    fn connection(&mut self) -> Result<&BidiStream, Failure> {
        if self.conn.is_none() {
            let conn =
                BidiStream::open(&self.cfg.endpoint, &format!("{}AppendRows", rpc::SERVICE)).map_err(rpc::from_grpc)?;
            self.conn = Some(conn);
        }
        self.conn.as_ref().ok_or_else(|| Failure::Transient("no connection".into()))
    }

    /// Sends an encoded request on the current connection.
    fn send(&mut self, request: &[u8]) -> Result<(), Failure> {
        self.connection()?.send(request).map_err(rpc::from_grpc)
    }

    /// Reads the reply to the oldest request in flight, waiting at most
    /// `timeout_ms`. `Ok(false)`: nothing arrived yet.
    fn take_reply(&mut self, timeout_ms: u32) -> Result<bool, Trouble> {
        let Some(conn) = &self.conn else {
            return Err(Trouble::Failure(Failure::Transient("the connection was lost".into())));
        };
        let reply = match conn.receive(timeout_ms).map_err(|e| Trouble::Failure(rpc::from_grpc(e)))? {
            Received::Message(bytes) => AppendRowsResponse::decode(bytes.as_slice()).map_err(|e| {
                Trouble::Failure(Failure::Permanent(format!("AppendRows reply is not a valid message: {e}")))
            })?,
            Received::Pending if timeout_ms == 0 => return Ok(false),
            Received::Pending => {
                return Err(Trouble::Failure(Failure::Transient(format!(
                    "no AppendRows reply within {timeout_ms} ms"
                ))));
            }
            Received::Ended => {
                return Err(Trouble::Failure(Failure::Transient(
                    "the service ended the AppendRows call before replying".into(),
                )));
            }
        };
        let Some(front) = self.in_flight.front() else {
            return Err(Trouble::Failure(Failure::Permanent(
                "an AppendRows reply arrived with nothing in flight".into(),
            )));
        };
        match &reply.response {
            Some(Response::AppendResult(r)) => {
                if let Some(at) = r.offset
                    && at != front.offset
                {
                    return Err(Trouble::Failure(Failure::Permanent(format!(
                        "the service appended at offset {at}, the writer asked for {}",
                        front.offset
                    ))));
                }
                self.acknowledge();
                Ok(true)
            }
            Some(Response::Error(status)) => {
                if let Some(first) = reply.row_errors.first() {
                    let more = reply.row_errors.len() - 1;
                    return Err(Trouble::RowErrors(format!(
                        "BigQuery rejected row {} of the request at offset {} (row {} of this writer's input): {}{}",
                        first.index,
                        front.offset,
                        front.first_row + first.index as u64,
                        first.message,
                        if more > 0 { format!(" (and {more} more rows)") } else { String::new() }
                    )));
                }
                Err(Trouble::Failure(rpc::from_rpc_status(status)))
            }
            None => {
                Err(Trouble::Failure(Failure::Permanent("AppendRows reply has neither a result nor an error".into())))
            }
        }
    }

    /// The oldest request in flight is in the stream.
    fn acknowledge(&mut self) {
        if let Some(done) = self.in_flight.pop_front() {
            self.next_offset = done.offset + done.rows;
        }
    }

    /// Handles a failure of the oldest request in flight. Returns once the
    /// writer may go on (the request landed, or was resent with the ones
    /// after it), or with the error that stops the job.
    fn recover(&mut self, trouble: Trouble) -> Result<(), SinkError> {
        let failure = match trouble {
            Trouble::RowErrors(m) => return Err(error::invalid_data(format!("{}: {m}", self.label()))),
            Trouble::Failure(f) => f,
        };
        let Some(front) = self.in_flight.front_mut() else {
            // The connection failed with nothing in flight: open another next time.
            self.conn = None;
            return Ok(());
        };
        let offset = front.offset;
        match failure {
            Failure::AlreadyExists(m) => {
                // Only a request that may have reached the service before can find its offset taken.
                if !front.sent_before {
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
                self.acknowledge();
                Ok(())
            }
            Failure::OutOfRange(m) => Err(error::fatal(format!(
                "{}: the stream rejects offset {offset} as out of range ({m}); the writer and the stream disagree, \
                 so the job stops rather than risk duplicates",
                self.label()
            ))),
            Failure::Permanent(m) => {
                let hint = if matches!(self.encoding, Encoding::Arrow { .. }) {
                    "; if the service takes no arrow_rows, set option `format` = \"proto\""
                } else {
                    ""
                };
                Err(error::fatal(format!("{}: append at offset {offset} failed: {m}{hint}", self.label())))
            }
            Failure::Transient(m) => {
                front.failures += 1;
                let failures = front.failures;
                if failures >= self.cfg.attempts {
                    return Err(error::fatal(format!(
                        "{}: append at offset {offset} failed {failures} times, last: {m}",
                        self.label()
                    )));
                }
                log::warn(&format!(
                    "{}: append at offset {offset} failed ({m}); resending it and the {} request(s) after it",
                    self.label(),
                    self.in_flight.len() - 1
                ));
                // Replies still due on the old connection are dropped with it;
                // every request in flight is sent again, in order, on a new one.
                self.conn = None;
                if let Some(wait) = self.cfg.retry().delay(failures) {
                    std::thread::sleep(wait);
                }
                self.resend_all()
            }
        }
    }

    /// Sends every request in flight again on a fresh connection.
    fn resend_all(&mut self) -> Result<(), SinkError> {
        for f in self.in_flight.iter_mut() {
            f.sent_before = true;
        }
        for i in 0..self.in_flight.len() {
            let request = std::mem::take(&mut self.in_flight[i].request);
            let sent = self.send(&request);
            self.in_flight[i].request = request;
            if let Err(f) = sent {
                return self.recover(Trouble::Failure(f));
            }
        }
        Ok(())
    }

    /// Waits for the oldest request in flight, recovering from failures.
    fn settle_one(&mut self) -> Result<(), SinkError> {
        match self.take_reply(self.cfg.rpc_timeout_ms) {
            Ok(_) => Ok(()),
            Err(t) => self.recover(t),
        }
    }

    /// Takes the replies that already arrived, without waiting.
    fn settle_ready(&mut self) -> Result<(), SinkError> {
        while !self.in_flight.is_empty() {
            match self.take_reply(0) {
                Ok(true) => {}
                Ok(false) => break,
                Err(t) => self.recover(t)?,
            }
        }
        Ok(())
    }

    /// Waits until every request sent is acknowledged.
    fn drain(&mut self) -> Result<(), SinkError> {
        while !self.in_flight.is_empty() {
            self.settle_one()?;
        }
        Ok(())
    }

    /// Appends `n` rows at the next offset, keeping at most `max_inflight`
    /// requests unacknowledged.
    fn append(&mut self, n: i64, rows: Rows) -> Result<(), SinkError> {
        while self.in_flight.len() >= self.cfg.max_inflight {
            self.settle_one()?;
        }
        let offset = self.send_offset;
        let request = AppendRowsRequest {
            write_stream: self.stream.clone(),
            offset: Some(offset),
            rows: Some(rows),
            ..Default::default()
        }
        .encode_to_vec();
        let first_row = self.rows_in;
        self.rows_in += n as u64;
        self.send_offset += n;
        let sent = self.send(&request);
        self.in_flight.push_back(InFlight { offset, rows: n, first_row, request, sent_before: false, failures: 0 });
        if let Err(f) = sent {
            // The connection broke while sending: whatever is in flight goes again.
            self.conn = None;
            log::warn(&format!("{}: sending the append at offset {offset} failed ({})", self.label(), f.message()));
            if let Some(last) = self.in_flight.back_mut() {
                // It may have left before the connection broke.
                last.sent_before = true;
            }
            self.resend_all()?;
        }
        self.settle_ready()
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
        let restored: Option<WriterState> = sluice_guest_sdk::restored_state(restored_state)?;
        let ws = create_stream(&cfg)?;
        // The stream's schema is the table's own; the option stands in when it is absent.
        let encoding = Encoding::new(cfg.format, arrow, ws.table_schema.as_ref().or(cfg.table_schema.as_ref()))
            .map_err(|e| error::config(format!("{}: {e}", cfg.table)))?;
        match &restored {
            Some(old) => log::info(&format!(
                "writer {} of {} restored after checkpoint {}: stream {} stays at offset {}, new rows go to {}",
                ctx.subtask,
                cfg.incarnation.key(&ctx),
                old.checkpoint,
                old.stream,
                old.next_offset,
                ws.name
            )),
            None => {
                log::debug(&format!("writer {} of {} appends to {}", ctx.subtask, cfg.incarnation.key(&ctx), ws.name))
            }
        }
        let inner = Inner {
            cfg,
            ctx,
            encoding,
            stream: ws.name,
            next_offset: 0,
            send_offset: 0,
            prepared_offset: 0,
            checkpoint: restored.map(|r| r.checkpoint).unwrap_or(0),
            rows_in: 0,
            conn: None,
            in_flight: VecDeque::new(),
        };
        Ok(sluice_guest_sdk::Writer::new(BigQueryWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let (_, batches) = ipc::decode(&rows)?;
        drop(rows);
        let max = inner.cfg.max_request_bytes;
        for (n, rows) in inner.encoding.requests(&batches, max)? {
            inner.append(n, rows)?;
        }
        Ok(())
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        // Everything sent so far must be in the stream before its offset is handed over.
        inner.drain()?;
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
        let mut inner = self.inner.borrow_mut();
        inner.in_flight.clear();
        inner.conn = None;
        Ok(())
    }
}
