//! One writer: per table, a BUFFERED write stream of its own, appended with
//! explicit offsets.
//!
//! Invariants:
//! - a table's stream is created by this writer when the first rows of the
//!   table arrive (so a checkpoint over N tables costs no calls for tables a
//!   writer never sees), also after a restore: rows a crashed run appended
//!   after its last checkpoint stay in an old stream, past the offset any
//!   checkpoint flushes, so they never become visible, and a replay that
//!   batches rows differently cannot collide with them;
//! - after a schema change (`apply-changes`) the table's rows go to a new
//!   stream, which carries the evolved table schema; the old stream was
//!   drained and committed at the barrier;
//! - `next_offset` advances only when the service acknowledged the append,
//!   or answered `ALREADY_EXISTS` for the very request being retried (its
//!   earlier try landed and the reply was lost); those rows are never sent
//!   again at another offset;
//! - up to `max_inflight` requests are in flight on one connection, each
//!   with its own offset; replies come in order. When a connection fails,
//!   every unacknowledged request is sent again, in order, at the same
//!   offsets, on a new connection;
//! - `OUT_OF_RANGE` fails the writer: the stream and the writer disagree;
//! - the commit info of checkpoint `c` is `(table, stream, next_offset - 1)`
//!   for every stream that took rows since the last checkpoint; nothing is
//!   flushed here, so nothing is visible before the committer;
//! - with `mode = "overwrite-partitions"` a table's stream is opened on the
//!   incarnation's staging table ([`crate::overwrite`]), not the target, and
//!   its part of the commit info also names the partitions of every row
//!   appended since the last checkpoint (the dead-letter table excepted);
//! - with `mode = "upsert"` a table's changes go to its `_default` stream,
//!   without offsets, as protobuf rows with `_CHANGE_TYPE` and
//!   `_CHANGE_SEQUENCE_NUMBER` ([`crate::upsert`] says why at `write`). A
//!   failed or unanswered request is sent again, with the ones after it, in
//!   order: a change that did land is ignored by its sequence number the
//!   second time. `prepare-commit` drains the stream, and its part of the
//!   commit info names the changes sent since the last checkpoint.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::rc::Rc;
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
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, Table, TableChange, error, incarnation, ipc, log};

use crate::config::{self, Config, RowFormat};
use crate::overwrite::{self, Partitioning};
use crate::rpc::{self, Failure};
use crate::{tables, upsert};

/// What a writer persists with a checkpoint: positions and names, never
/// rows. (A state written for contract 0.1 had one `stream`; it reads back
/// with its checkpoint, which is all a restore uses.)
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct WriterState {
    #[serde(default)]
    pub streams: Vec<StreamState>,
    pub checkpoint: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct StreamState {
    pub table: String,
    pub stream: String,
    pub next_offset: i64,
}

/// One stream's part of a checkpoint: flush `stream` up to `offset`.
/// (`table` is absent from commits prepared for contract 0.1: one table.)
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Flush {
    #[serde(default)]
    pub table: String,
    pub stream: String,
    /// Last offset to flush (inclusive).
    pub offset: i64,
    /// With `mode = "overwrite-partitions"`: the partition ids (`20240105`)
    /// of the rows appended since the last checkpoint, which the commit
    /// copies from the staging table to the target. Absent: append.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<String>,
}

/// One table's changes of a checkpoint in `upsert` mode: applied already
/// (the default stream has no flush), named for the record and `sluice state`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Upserted {
    pub table: String,
    /// The table's `_default` stream.
    pub stream: String,
    /// Changes sent and acknowledged since the last checkpoint.
    pub changes: i64,
    /// The `_CHANGE_SEQUENCE_NUMBER` of the last of them.
    pub through: String,
}

/// What the committer needs to make a writer's rows of a checkpoint visible.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct CommitInfo {
    pub flushes: Vec<Flush>,
    /// With `mode = "upsert"`: the changes the checkpoint applied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub upserts: Vec<Upserted>,
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
    /// The partitions of its rows (overwrite mode), counted once it lands.
    partitions: Vec<String>,
}

/// One table's stream, as this writer appends to it.
struct StreamWriter {
    cfg: Rc<Config>,
    subtask: u32,
    /// The source's name of the table.
    table: String,
    encoding: Encoding,
    stream: String,
    /// Every row below this offset is acknowledged.
    next_offset: i64,
    /// Offset of the next request to send (`next_offset` + rows in flight).
    send_offset: i64,
    /// `next_offset` at the last `prepare-commit`.
    prepared_offset: i64,
    /// Rows of this table handed to `write` since the stream opened.
    rows_in: u64,
    conn: Option<BidiStream>,
    /// Requests in flight on `conn`, in offset order (replies come in order).
    in_flight: VecDeque<InFlight>,
    /// The target's partitioning, when the rows overwrite partitions.
    partitioning: Option<Partitioning>,
    /// Partitions of the rows acknowledged since the last `prepare-commit`
    /// (a request the service rejects names none).
    touched: BTreeSet<String>,
    /// CDC changes on the `_default` stream (`mode = "upsert"`): requests
    /// carry no offset.
    cdc: bool,
    /// The sequence number of the last change sent (CDC).
    last_seq: Option<String>,
}

/// A table this writer knows: where it lands, its rows' schema, and its
/// stream once rows arrived.
struct TableWriter {
    /// Where the rows land: the target, or its staging table when they
    /// overwrite partitions.
    path: String,
    /// The target's partitioning is read (at the first rows) only when the
    /// rows overwrite partitions; the target's path.
    overwrite: Option<String>,
    /// The rows are changes applied by key (`mode = "upsert"`).
    upsert: bool,
    arrow: Arc<Schema>,
    stream: Option<StreamWriter>,
}

struct Inner {
    cfg: Rc<Config>,
    ctx: SinkContext,
    tables: BTreeMap<String, TableWriter>,
    checkpoint: u64,
}

pub struct BigQueryWriter {
    inner: RefCell<Inner>,
}

pub(crate) fn create_stream(cfg: &Config, table: &str) -> Result<WriteStream, SinkError> {
    let req = CreateWriteStreamRequest {
        parent: table.to_string(),
        write_stream: Some(WriteStream { r#type: StreamType::Buffered as i32, ..Default::default() }),
    };
    cfg.retry()
        .run(
            |_| rpc::unary::<_, WriteStream>(&cfg.endpoint, "CreateWriteStream", &req, cfg.rpc_timeout_ms),
            // A lost reply leaves an empty stream behind: harmless, it is never flushed.
            |f| matches!(f, Failure::Transient(_)),
            |f, _, _| log::warn(&format!("CreateWriteStream on {table} failed ({}); retrying", f.message())),
        )
        .map_err(|failed| {
            error::config(format!(
                "cannot create a write stream on {table} through endpoint `{}`: {}",
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

impl StreamWriter {
    /// Opens a new stream on `path` for rows of `arrow`.
    fn open(
        cfg: Rc<Config>,
        subtask: u32,
        table: &str,
        path: &str,
        arrow: Arc<Schema>,
        partitioning: Option<Partitioning>,
    ) -> Result<Self, SinkError> {
        let ws = create_stream(&cfg, path)?;
        // The stream's schema is the table's own; the option stands in when it is absent.
        let encoding = Encoding::new(cfg.format, arrow, ws.table_schema.as_ref().or(cfg.table_schema.as_ref()))
            .map_err(|e| error::config(format!("{path}: {e}")))?;
        log::debug(&format!("writer {subtask} appends rows of {path} to {}", ws.name));
        Ok(StreamWriter {
            cfg,
            subtask,
            table: table.to_string(),
            encoding,
            stream: ws.name,
            next_offset: 0,
            send_offset: 0,
            prepared_offset: 0,
            rows_in: 0,
            conn: None,
            in_flight: VecDeque::new(),
            partitioning,
            touched: BTreeSet::new(),
            cdc: false,
            last_seq: None,
        })
    }

    /// Opens `path`'s `_default` stream for changes of `arrow`, after
    /// checking that the table's primary key is the change key.
    fn open_default(
        cfg: Rc<Config>,
        subtask: u32,
        table: &str,
        path: &str,
        arrow: Arc<Schema>,
    ) -> Result<Self, SinkError> {
        let key = cfg.key.clone().unwrap_or_default();
        upsert::check_columns(path, &arrow, &key)?;
        if !upsert::check_key(&cfg, path, &key)? {
            return Err(error::config(format!(
                "table {path} does not exist (the committer creates it before the first rows; was it deleted?)"
            )));
        }
        let schema = tables::read_schema(&cfg, path)?
            .map_err(|why| error::config(format!("table {path} cannot take changes: {why}")))?;
        // CDC takes protobuf rows only, whatever option `format` says.
        let encoder = RowEncoder::new(upsert::change_schema(&arrow), Some(&upsert::change_table_schema(&schema)))
            .map_err(|e| error::config(format!("{path}: {e}")))?;
        let stream = config::default_stream(path);
        log::debug(&format!("writer {subtask} sends the changes of {path} to {stream}"));
        Ok(StreamWriter {
            cfg,
            subtask,
            table: table.to_string(),
            encoding: Encoding::Proto { writer_schema: encoder.writer_schema(), encoder: Box::new(encoder) },
            stream,
            next_offset: 0,
            send_offset: 0,
            prepared_offset: 0,
            rows_in: 0,
            conn: None,
            in_flight: VecDeque::new(),
            partitioning: None,
            touched: BTreeSet::new(),
            cdc: true,
            last_seq: None,
        })
    }

    fn label(&self) -> String {
        format!("writer {} stream {}", self.subtask, self.stream)
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
                if !reply.row_errors.is_empty() {
                    // Each row in the contract's phrase, which the host follows with its place in the
                    // source (showing the first few; with dead letters, it takes every one).
                    let rows: Vec<String> = reply
                        .row_errors
                        .iter()
                        .map(|e| {
                            format!(
                                "row {} of this writer's input for table {:?} (row {} of the request): {}",
                                front.first_row + e.index as u64,
                                self.table,
                                e.index,
                                e.message
                            )
                        })
                        .collect();
                    return Err(Trouble::RowErrors(format!(
                        "BigQuery rejected {} row(s) of the request at offset {}, and with them the request: {}",
                        reply.row_errors.len(),
                        front.offset,
                        rows.join("; "),
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
            self.touched.extend(done.partitions);
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
    fn append(&mut self, n: i64, rows: Rows, partitions: Vec<String>) -> Result<(), SinkError> {
        while self.in_flight.len() >= self.cfg.max_inflight {
            self.settle_one()?;
        }
        let offset = self.send_offset;
        let request = AppendRowsRequest {
            write_stream: self.stream.clone(),
            // The default stream takes no offsets; the writer still counts
            // rows, to name the rows of a request a row error points at.
            offset: if self.cdc { None } else { Some(offset) },
            rows: Some(rows),
            ..Default::default()
        }
        .encode_to_vec();
        let first_row = self.rows_in;
        self.rows_in += n as u64;
        self.send_offset += n;
        let sent = self.send(&request);
        self.in_flight.push_back(InFlight {
            offset,
            rows: n,
            first_row,
            request,
            sent_before: false,
            failures: 0,
            partitions,
        });
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

impl StreamWriter {
    /// Sends the rows of one IPC batch.
    fn write(&mut self, batches: &[RecordBatch]) -> Result<(), SinkError> {
        if self.cdc {
            let mut rows = Vec::with_capacity(batches.len());
            for batch in batches {
                let (changes, last) = upsert::change_rows(batch, self.cfg.incarnation_created_ms)?;
                rows.push(changes);
                if last.is_some() {
                    self.last_seq = last;
                }
            }
            for (n, request) in self.encoding.requests(&rows, self.cfg.max_request_bytes)? {
                self.append(n, request, Vec::new())?;
            }
            return Ok(());
        }
        let partitions = match &self.partitioning {
            Some(p) => Some(overwrite::row_partitions(p, &self.table, self.rows_in, batches)?),
            None => None,
        };
        let max = self.cfg.max_request_bytes;
        // Requests hold the batches' rows in order, so request k's rows are
        // the next `n` after request k-1's.
        let mut first = 0usize;
        for (n, rows) in self.encoding.requests(batches, max)? {
            let of = partitions.as_ref().map(|p| p.of(first, n as usize)).unwrap_or_default();
            first += n as usize;
            self.append(n, rows, of)?;
        }
        Ok(())
    }

    /// Drains the stream and returns what checkpoint `c` must flush, if
    /// rows arrived since the last checkpoint.
    fn prepare(&mut self) -> Result<Option<Flush>, SinkError> {
        // Everything sent so far must be in the stream before its offset is handed over.
        self.drain()?;
        if self.next_offset == self.prepared_offset {
            return Ok(None);
        }
        self.prepared_offset = self.next_offset;
        let partitions = std::mem::take(&mut self.touched).into_iter().collect();
        Ok(Some(Flush {
            table: self.table.clone(),
            stream: self.stream.clone(),
            offset: self.next_offset - 1,
            partitions,
        }))
    }

    /// Drains the `_default` stream (every change sent is applied) and
    /// names the changes of checkpoint `c`, if any arrived since the last.
    fn prepare_changes(&mut self) -> Result<Option<Upserted>, SinkError> {
        self.drain()?;
        let changes = self.next_offset - self.prepared_offset;
        if changes == 0 {
            return Ok(None);
        }
        self.prepared_offset = self.next_offset;
        Ok(Some(Upserted {
            table: self.table.clone(),
            stream: self.stream.clone(),
            changes,
            through: self.last_seq.clone().unwrap_or_default(),
        }))
    }
}

impl Inner {
    fn table_writer(&self, table: &Table) -> Result<TableWriter, SinkError> {
        let target = self.cfg.table_path(&table.name)?;
        let (path, overwrite) = if self.cfg.overwrites(&table.name) {
            (overwrite::staging_path(&self.ctx, &target), Some(target))
        } else {
            (target, None)
        };
        let upsert = self.cfg.upserts(&table.name);
        Ok(TableWriter { path, overwrite, upsert, arrow: ipc::decode_schema(&table.schema)?, stream: None })
    }
}

impl GuestWriter for BigQueryWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<Table>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Rc::new(Config::parse(options)?);
        let restored: Option<WriterState> = sluice_guest_sdk::restored_state(restored_state)?;
        if let Some(old) = &restored {
            let old_streams: Vec<String> =
                old.streams.iter().map(|s| format!("{} at offset {}", s.stream, s.next_offset)).collect();
            log::info(&format!(
                "writer {} of {} restored after checkpoint {}; its old streams stay as they are ({}), new rows go to new streams",
                ctx.subtask,
                incarnation::key(&ctx),
                old.checkpoint,
                if old_streams.is_empty() { "none recorded".to_string() } else { old_streams.join(", ") }
            ));
        }
        let mut inner =
            Inner { cfg, ctx, tables: BTreeMap::new(), checkpoint: restored.map(|r| r.checkpoint).unwrap_or(0) };
        for table in &tables {
            let writer = inner.table_writer(table)?;
            inner.tables.insert(table.name.clone(), writer);
        }
        Ok(sluice_guest_sdk::Writer::new(BigQueryWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let (_, batches) = ipc::decode(rows)?;
        let (cfg, subtask) = (inner.cfg.clone(), inner.ctx.subtask);
        let t = inner.tables.get_mut(&table).ok_or_else(|| {
            error::invalid_data(format!("rows of table {table:?}, which the engine has not announced to this writer"))
        })?;
        if t.stream.is_none() && t.upsert {
            t.stream = Some(StreamWriter::open_default(cfg, subtask, &table, &t.path, t.arrow.clone())?);
        } else if t.stream.is_none() {
            let partitioning = match &t.overwrite {
                Some(target) => Some(Partitioning::read(&cfg, target)?),
                None => None,
            };
            t.stream = Some(StreamWriter::open(cfg, subtask, &table, &t.path, t.arrow.clone(), partitioning)?);
        }
        match &mut t.stream {
            Some(stream) => stream.write(&batches),
            None => Err(error::fatal("the stream was not opened")),
        }
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.checkpoint = c;
        let (mut flushes, mut upserts) = (Vec::new(), Vec::new());
        for t in inner.tables.values_mut() {
            match &mut t.stream {
                Some(stream) if stream.cdc => upserts.extend(stream.prepare_changes()?),
                Some(stream) => flushes.extend(stream.prepare()?),
                None => {}
            }
        }
        if flushes.is_empty() && upserts.is_empty() {
            return Ok(None);
        }
        serde_json::to_vec(&CommitInfo { flushes, upserts })
            .map(Some)
            .map_err(|e| error::fatal(format!("cannot encode the commit info: {e}")))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        let inner = self.inner.borrow();
        let streams = inner
            .tables
            .iter()
            .filter_map(|(table, t)| {
                t.stream.as_ref().map(|s| StreamState {
                    table: table.clone(),
                    stream: s.stream.clone(),
                    next_offset: s.next_offset,
                })
            })
            .collect();
        let state = WriterState { streams, checkpoint: c };
        serde_json::to_vec(&state).map_err(|e| error::fatal(format!("cannot encode the writer state: {e}")))
    }

    fn apply_changes(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        for change in &changes {
            // The barrier drained and committed the old stream; the table's
            // next rows go to a new stream, which carries the evolved schema.
            let writer = inner.table_writer(&change.table)?;
            inner.tables.insert(change.table.name.clone(), writer);
        }
        Ok(())
    }

    fn abort_prepare(&self, _c: u64) -> Result<(), SinkError> {
        // Nothing to release: unflushed rows are invisible, and a later
        // checkpoint's flush covers them only if that checkpoint persists them.
        Ok(())
    }

    fn close(&self) -> Result<(), SinkError> {
        // Appends nothing. Rows no checkpoint covers stay unflushed, so invisible.
        let mut inner = self.inner.borrow_mut();
        for t in inner.tables.values_mut() {
            if let Some(stream) = &mut t.stream {
                stream.in_flight.clear();
                stream.conn = None;
            }
        }
        Ok(())
    }
}
