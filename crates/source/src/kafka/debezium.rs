//! Change streams from Kafka: Debezium's change events (`format =
//! "debezium-json"`, and `"debezium-avro"` for its Avro envelope, bare or
//! through the schema registry), and `[source] key` on plain JSON or Avro
//! messages (every message an upsert of its key's row).
//!
//! What a Debezium message is (<https://debezium.io/documentation/reference/stable/connectors/postgresql.html#postgresql-events>):
//! a value `{"before", "after", "op", "source", "ts_ms", "transaction"}`,
//! with the JSON converter's schemas wrapped as `{"schema", "payload"}`,
//! or that envelope as an Avro record; a delete is followed by a tombstone
//! (a message with no value) of the same key, for log compaction.
//!
//! Invariants:
//! - one message is one change: op `c`, `r`, `u` upserts the `after` row;
//!   `d` deletes the `before` row (the message key's columns when `before`
//!   is null); a tombstone deletes the message key's row (a delete and its
//!   tombstone apply twice, harmlessly). `source`, `ts_ms` and
//!   `transaction` never land;
//! - a batch carries the table's columns, then `_sluice_op`,
//!   `_sluice_seq_hi` = 0 and `_sluice_seq_lo` = the message's offset
//!   (`sluice_core::changes`), rows in offset order per partition;
//! - an op that is not one of Debezium's data changes (`t`, `m`, a
//!   missing or null op), an upsert with no `after`, a delete with neither
//!   `before` nor a key, a key column missing or null: the message is
//!   refused naming its topic, partition and offset and the cause
//!   ([`SourceError::Message`]), so it follows `job.bad_rows` as any
//!   message that does not fit its table;
//! - the table's columns are the row's (the declared `columns`, the target
//!   table's, or the Avro envelope's `after` record), every column outside
//!   the key nullable: a tombstone carries the key alone. The key's columns
//!   must be among them (checked when the source opens);
//! - every message's key is its change key: changes are ordered by offset,
//!   which orders a key's changes only when they all share one partition,
//!   and the default partitioner keeps a message key in one partition. So
//!   a message whose key is missing or null, is neither JSON (with or
//!   without the converter's schema) nor registry Avro, does not hold
//!   exactly the key's columns, or holds other values than the row's key,
//!   is refused as above (each topic is its own table, so a key is never
//!   split over topics);
//! - an upsert is a whole row: a string column of a Debezium `after` row
//!   holding Debezium's placeholder for a value it did not capture
//!   ([`UNAVAILABLE`], a TOASTed Postgres column an update left unchanged)
//!   is refused as above, never landed over the stored value.

use std::sync::Arc;

use arrow_array::{Array, ArrayRef, RecordBatch, StructArray, UInt8Array, UInt64Array, new_null_array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde_json::{Map, Value};
use sluice_core::changes::{OP, Op, SEQ_HI, SEQ_LO};

use super::avro::AvroCodec;
/// What Debezium writes for a column value the database did not send
/// (`unavailable.value.placeholder`'s default): a Postgres TOASTed column
/// an update left unchanged, without REPLICA IDENTITY FULL
/// (<https://debezium.io/documentation/reference/stable/connectors/postgresql.html#postgresql-toasted-values>).
pub const UNAVAILABLE: &str = "__debezium_unavailable_value";

use super::decode::{Message, json_batch, json_culprit, refused};
use crate::SourceError;

/// How a change stream's messages are read.
pub enum Inner {
    /// Plain JSON rows against the table's columns: every message upserts.
    Json,
    /// Plain Avro rows: every message upserts.
    Avro(AvroCodec),
    /// Debezium's JSON envelope, with or without the converter's schemas.
    DebeziumJson,
    /// Debezium's Avro envelope; the codec's reader schema is the envelope
    /// cut to `before`, `after` and `op` ([`envelope_reader`]).
    DebeziumAvro(AvroCodec),
}

/// A change stream's codec: the rows, their ops and their positions.
pub struct ChangeCodec {
    inner: Inner,
    /// The change key's columns, in the job's order.
    key: Vec<String>,
    /// Their indexes in `table`.
    key_at: Vec<usize>,
    /// The table's columns (without the reserved ones).
    table: SchemaRef,
    /// `table` with the key's columns nullable too: rows are read so, and
    /// a missing key is then named ([`ChangeCodec::finish`]).
    read: SchemaRef,
    /// `table` and the three reserved columns.
    batch: SchemaRef,
    /// The key's columns alone, nullable: message keys are read so.
    key_schema: SchemaRef,
}

/// The reserved columns a change batch carries after the table's own.
fn reserved() -> [Field; 3] {
    [
        Field::new(OP, DataType::UInt8, false),
        Field::new(SEQ_HI, DataType::UInt64, false),
        Field::new(SEQ_LO, DataType::UInt64, false),
    ]
}

/// `row`'s fields, every one outside `key` nullable.
fn relaxed(row: &Schema, key: &[String]) -> SchemaRef {
    let fields: Vec<Field> = row
        .fields()
        .iter()
        .map(|f| {
            let f = f.as_ref().clone();
            if key.contains(f.name()) { f } else { f.with_nullable(true) }
        })
        .collect();
    Arc::new(Schema::new(fields))
}

impl ChangeCodec {
    /// A codec of `inner`, whose rows have the columns `row` (the declared
    /// or the table's for JSON; the Avro envelope's `after` record, or the
    /// Avro record, for Avro), keyed by `key`.
    pub fn new(inner: Inner, row: &Schema, key: Vec<String>) -> Result<Self, SourceError> {
        if key.is_empty() {
            return Err(SourceError::Config {
                key: "source.key".into(),
                message: "kafka: a change stream needs its key's columns, e.g. key = [\"id\"]".into(),
            });
        }
        let table = match inner {
            Inner::DebeziumJson | Inner::DebeziumAvro(_) => relaxed(row, &key),
            Inner::Json | Inner::Avro(_) => Arc::new(row.clone()),
        };
        let mut key_at = Vec::with_capacity(key.len());
        for k in &key {
            let at = table.index_of(k).map_err(|_| {
                let names: Vec<&str> = table.fields().iter().map(|f| f.name().as_str()).collect();
                SourceError::Config {
                    key: "source.key".into(),
                    message: format!("kafka: key column {k:?} is not a column of the rows ({})", names.join(", ")),
                }
            })?;
            key_at.push(at);
        }
        let mut fields: Vec<Field> = table.fields().iter().map(|f| f.as_ref().clone()).collect();
        fields.extend(reserved());
        let batch = Arc::new(Schema::new(fields));
        let read = relaxed(&table, &[]);
        let key_schema = Arc::new(Schema::new(key_at.iter().map(|at| read.field(*at).clone()).collect::<Vec<_>>()));
        Ok(Self { inner, key, key_at, table, read, batch, key_schema })
    }

    /// A Debezium Avro codec: the table's columns are the envelope's `after` record's.
    pub fn debezium_avro(avro: AvroCodec, from: &str, key: Vec<String>) -> Result<Self, SourceError> {
        let envelope = avro.table_schema();
        let row =
            envelope_row(&envelope).map_err(|why| SourceError::AvroSchema { from: from.to_string(), message: why })?;
        Self::new(Inner::DebeziumAvro(avro), &row, key)
    }

    /// The table's columns.
    pub fn table_schema(&self) -> SchemaRef {
        self.table.clone()
    }

    /// The table's columns and the reserved ones: the batches' schema.
    pub fn batch_schema(&self) -> SchemaRef {
        self.batch.clone()
    }

    pub fn avro_reader_schema(&self) -> Option<&str> {
        match &self.inner {
            Inner::Avro(a) | Inner::DebeziumAvro(a) => Some(a.reader_schema()),
            Inner::Json | Inner::DebeziumJson => None,
        }
    }

    /// The changes of `messages`, all of `topic`, in order.
    pub fn decode(&self, topic: &str, messages: &[Message]) -> Result<RecordBatch, SourceError> {
        let (rows, ops) = match &self.inner {
            Inner::Json => (self.json_rows(topic, messages)?, vec![Op::Upsert; messages.len()]),
            Inner::Avro(avro) => (avro.decode(topic, messages)?, vec![Op::Upsert; messages.len()]),
            Inner::DebeziumJson => self.debezium_json(topic, messages)?,
            Inner::DebeziumAvro(avro) => self.debezium_avro_rows(avro, topic, messages)?,
        };
        self.finish(topic, messages, rows, &ops)
    }

    /// Each message's key as a row of the key's columns (`key_schema`):
    /// JSON (an object of the key's columns, with or without the converter's
    /// schema, or a bare value for a one-column key), else for the Avro
    /// formats Avro in the registry's wire format.
    fn message_keys(&self, topic: &str, messages: &[Message]) -> Result<RecordBatch, SourceError> {
        let avro = match &self.inner {
            Inner::Avro(a) | Inner::DebeziumAvro(a) => Some(a),
            Inner::Json | Inner::DebeziumJson => None,
        };
        // Each key is JSON (0) or Avro (1): its index in `json` or `avros`.
        let mut picks = Vec::with_capacity(messages.len());
        let mut json = Vec::with_capacity(messages.len());
        let mut avros = Vec::new();
        for m in messages {
            let bytes = m.key.as_deref().ok_or_else(|| refused(topic, m, NO_KEY))?;
            match (serde_json::from_slice::<Value>(bytes), avro) {
                (Ok(value), _) => {
                    let row = key_object(value, &self.key).map_err(|why| refused(topic, m, why))?;
                    exactly_the_key(row.keys().map(String::as_str), &self.key).map_err(|why| refused(topic, m, why))?;
                    json.push(as_value(m, Value::Object(row)));
                    picks.push((0, json.len() - 1));
                }
                (Err(_), Some(avro)) => {
                    let key = avro.decode_key(topic, m)?;
                    exactly_the_key(key.schema().fields().iter().map(|f| f.name().as_str()), &self.key)
                        .map_err(|why| refused(topic, m, why))?;
                    let mut columns = Vec::with_capacity(self.key.len());
                    for f in self.key_schema.fields() {
                        let c = key.column_by_name(f.name()).ok_or_else(|| {
                            SourceError::Internal(format!("kafka: an Avro key lost its column {:?}", f.name()))
                        })?;
                        columns.push(arrow_cast::cast(c, f.data_type()).map_err(|e| {
                            refused(
                                topic,
                                m,
                                format!("message key column {:?} does not convert to {}: {e}", f.name(), f.data_type()),
                            )
                        })?);
                    }
                    avros.push(
                        RecordBatch::try_new(self.key_schema.clone(), columns)
                            .map_err(|e| refused(topic, m, format!("its message key: {e}")))?,
                    );
                    picks.push((1, avros.len() - 1));
                }
                (Err(e), None) => return Err(refused(topic, m, format!("its message key is not JSON: {e}"))),
            }
        }
        let json = match json_batch(&self.key_schema, &json) {
            Ok(batch) if batch.num_rows() == json.len() => batch,
            _ => return Err(key_culprit(json_culprit(&self.key_schema, topic, &json))),
        };
        if avros.is_empty() {
            return Ok(json);
        }
        let internal = |e: arrow_schema::ArrowError| SourceError::Rows {
            topic: topic.to_string(),
            message: format!("message keys to the key's columns: {e}"),
        };
        let avros = arrow_select::concat::concat_batches(&self.key_schema, &avros).map_err(internal)?;
        let mut columns = Vec::with_capacity(self.key.len());
        for j in 0..self.key.len() {
            let from: [&dyn Array; 2] = [json.column(j).as_ref(), avros.column(j).as_ref()];
            columns.push(arrow_select::interleave::interleave(&from, &picks).map_err(internal)?);
        }
        RecordBatch::try_new(self.key_schema.clone(), columns).map_err(internal)
    }

    /// The first message whose key does not name its row's key, refused.
    fn check_keys(&self, topic: &str, messages: &[Message], rows: &RecordBatch) -> Result<(), SourceError> {
        let keys = self.message_keys(topic, messages)?;
        for (i, m) in messages.iter().enumerate() {
            for (j, (name, at)) in self.key.iter().zip(&self.key_at).enumerate() {
                let (row, key) = (rows.column(*at).slice(i, 1), keys.column(j).slice(i, 1));
                if key.is_null(0) {
                    return Err(refused(topic, m, format!("{MISMATCH}: its key column {name:?} is null")));
                }
                // ArrayData's equality is arrow's logical one (offsets and all).
                if row.to_data() != key.to_data() {
                    return Err(refused(
                        topic,
                        m,
                        format!(
                            "{MISMATCH}: its key column {name:?} is {} but the row's is {}",
                            shown(&key),
                            shown(&row)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Plain JSON rows of `messages` (values that are rows of the table).
    fn json_rows(&self, topic: &str, messages: &[Message]) -> Result<RecordBatch, SourceError> {
        match json_batch(&self.read, messages) {
            Ok(batch) if batch.num_rows() == messages.len() => Ok(batch),
            _ => Err(json_culprit(&self.read, topic, messages)),
        }
    }

    fn debezium_json(&self, topic: &str, messages: &[Message]) -> Result<(RecordBatch, Vec<Op>), SourceError> {
        let mut rows = Vec::with_capacity(messages.len());
        let mut ops = Vec::with_capacity(messages.len());
        for m in messages {
            let (op, row) = json_change(m, &self.key).map_err(|why| refused(topic, m, why))?;
            ops.push(op);
            rows.push(as_value(m, Value::Object(row)));
        }
        Ok((self.json_rows(topic, &rows)?, ops))
    }

    fn debezium_avro_rows(
        &self,
        avro: &AvroCodec,
        topic: &str,
        messages: &[Message],
    ) -> Result<(RecordBatch, Vec<Op>), SourceError> {
        let valued: Vec<Message>;
        let with_values = if messages.iter().all(|m| m.value.is_some()) {
            messages
        } else {
            valued = messages.iter().filter(|m| m.value.is_some()).cloned().collect();
            &valued[..]
        };
        let envelopes = avro.decode(topic, with_values)?;
        let part = |name: &str| -> Result<StructArray, SourceError> {
            envelopes.column_by_name(name).and_then(|c| c.as_any().downcast_ref::<StructArray>()).cloned().ok_or_else(
                || SourceError::Internal(format!("kafka: topic {topic:?}: the Debezium envelope has no {name} record")),
            )
        };
        let (after, before) = (part("after")?, part("before")?);
        let op = envelopes
            .column_by_name("op")
            .and_then(|c| c.as_any().downcast_ref::<arrow_array::StringArray>())
            .ok_or_else(|| SourceError::Internal(format!("kafka: topic {topic:?}: the Debezium envelope has no op")))?;
        // Each row is taken from `after` (0), `before` (1) or a key (2).
        let mut picks = Vec::with_capacity(messages.len());
        let mut ops = Vec::with_capacity(messages.len());
        let mut keys = Vec::new();
        let mut i = 0;
        for m in messages {
            if m.value.is_none() {
                keys.push(self.avro_key_row(avro, topic, m)?);
                picks.push((2, keys.len() - 1));
                ops.push(Op::Delete);
                continue;
            }
            let text = op.is_valid(i).then(|| op.value(i));
            let parsed = text.and_then(Op::parse).ok_or_else(|| refused(topic, m, unknown_op(text)))?;
            match parsed {
                Op::Upsert if after.is_valid(i) => {
                    if let Some(column) = unavailable_at(&after, i) {
                        return Err(refused(topic, m, partial_row(column)));
                    }
                    picks.push((0, i));
                }
                Op::Upsert => {
                    return Err(refused(topic, m, format!("op {:?} has no \"after\" row", text.unwrap_or(""))));
                }
                Op::Delete if before.is_valid(i) => picks.push((1, i)),
                Op::Delete if m.key.is_some() => {
                    keys.push(self.avro_key_row(avro, topic, m)?);
                    picks.push((2, keys.len() - 1));
                }
                Op::Delete => return Err(refused(topic, m, "op \"d\" has no \"before\" row and the message no key")),
            }
            ops.push(parsed);
            i += 1;
        }
        let internal = |e: arrow_schema::ArrowError| SourceError::Rows {
            topic: topic.to_string(),
            message: format!("Debezium rows to the table's columns: {e}"),
        };
        let keys = arrow_select::concat::concat_batches(&self.read, &keys).map_err(internal)?;
        let mut columns: Vec<ArrayRef> = Vec::with_capacity(self.read.fields().len());
        for (j, field) in self.read.fields().iter().enumerate() {
            let from: [&dyn Array; 3] = [after.column(j).as_ref(), before.column(j).as_ref(), keys.column(j).as_ref()];
            let column = arrow_select::interleave::interleave(&from, &picks).map_err(internal)?;
            // The envelope's record may say not null where the table does not.
            columns.push(if column.data_type() == field.data_type() {
                column
            } else {
                arrow_cast::cast(&column, field.data_type()).map_err(internal)?
            });
        }
        Ok((RecordBatch::try_new(self.read.clone(), columns).map_err(internal)?, ops))
    }

    /// The table row of a key-only delete: the message key's columns, the
    /// others null. A JSON key (with or without the converter's schema),
    /// else an Avro key in the registry's wire format.
    fn avro_key_row(&self, avro: &AvroCodec, topic: &str, m: &Message) -> Result<RecordBatch, SourceError> {
        let bytes = m.key.as_deref().ok_or_else(|| refused(topic, m, "a tombstone with no message key"))?;
        if let Ok(value) = serde_json::from_slice::<Value>(bytes) {
            let row = key_object(value, &self.key).map_err(|why| refused(topic, m, why))?;
            return self.json_rows(topic, &[as_value(m, Value::Object(row))]);
        }
        let key = avro.decode_key(topic, m)?;
        let mut columns = Vec::with_capacity(self.read.fields().len());
        for f in self.read.fields() {
            let column = match key.column_by_name(f.name()) {
                Some(c) => arrow_cast::cast(c, f.data_type()).map_err(|e| {
                    refused(topic, m, format!("key column {:?} does not convert to {}: {e}", f.name(), f.data_type()))
                })?,
                None => new_null_array(f.data_type(), 1),
            };
            columns.push(column);
        }
        RecordBatch::try_new(self.read.clone(), columns).map_err(|e| refused(topic, m, format!("its key: {e}")))
    }

    /// The change batch: key columns checked, the reserved columns added.
    fn finish(
        &self,
        topic: &str,
        messages: &[Message],
        rows: RecordBatch,
        ops: &[Op],
    ) -> Result<RecordBatch, SourceError> {
        if rows.num_rows() != messages.len() || ops.len() != messages.len() {
            return Err(SourceError::Internal(format!(
                "kafka: topic {topic:?}: {} messages made {} rows and {} ops",
                messages.len(),
                rows.num_rows(),
                ops.len()
            )));
        }
        // The first message whose key has a null, naming its first such column.
        let mut first: Option<(usize, &str)> = None;
        for (name, at) in self.key.iter().zip(&self.key_at) {
            let column = rows.column(*at);
            if let Some(i) = (0..column.len()).find(|i| column.is_null(*i))
                && first.is_none_or(|(j, _)| i < j)
            {
                first = Some((i, name));
            }
        }
        if let Some((i, name)) = first {
            return Err(refused(
                topic,
                &messages[i],
                format!("key column {name:?} is missing or null (the change key is {:?})", self.key),
            ));
        }
        self.check_keys(topic, messages, &rows)?;
        let mut lo = Vec::with_capacity(messages.len());
        for m in messages {
            lo.push(u64::try_from(m.offset).map_err(|_| {
                SourceError::Internal(format!("kafka: topic {topic:?}: a message at offset {}", m.offset))
            })?);
        }
        let mut columns = rows.columns().to_vec();
        columns.push(Arc::new(UInt8Array::from_iter_values(ops.iter().map(|o| o.code()))));
        columns.push(Arc::new(UInt64Array::from(vec![0u64; messages.len()])));
        columns.push(Arc::new(UInt64Array::from(lo)));
        RecordBatch::try_new(self.batch.clone(), columns)
            .map_err(|e| SourceError::Rows { topic: topic.to_string(), message: format!("the change columns: {e}") })
    }
}

/// The first string column of row `i` of an Avro `after` record holding
/// [`UNAVAILABLE`] (the row's own string columns; Debezium sends nested
/// values as strings or JSON text, which this covers).
fn unavailable_at(after: &StructArray, i: usize) -> Option<&str> {
    after.fields().iter().zip(after.columns()).find_map(|(f, c)| {
        let text = c.as_any().downcast_ref::<arrow_array::StringArray>()?;
        (text.is_valid(i) && text.value(i) == UNAVAILABLE).then(|| f.name().as_str())
    })
}

/// `m` with `value` as its value (its position kept, for errors).
fn as_value(m: &Message, value: Value) -> Message {
    Message {
        partition: m.partition,
        offset: m.offset,
        timestamp_ms: None,
        key: None,
        value: Some(value.to_string().into_bytes()),
        headers: Vec::new(),
    }
}

/// Why a message with no key is refused.
const NO_KEY: &str = "it has no message key: a change stream's message key must be its change key (source.key), so \
                      that the partitioner keeps each key's changes in one partition, in order";

/// How a message key that is not the row's change key is refused.
const MISMATCH: &str = "its message key is not the row's change key (source.key), so its changes may be spread over \
                        partitions and applied out of order";

/// A one-value array as an error shows it.
fn shown(a: &ArrayRef) -> String {
    arrow_cast::display::array_value_to_string(a, 0).unwrap_or_else(|_| "(a value)".to_string())
}

/// A message key's failure to read as the key's columns, named as such.
fn key_culprit(e: SourceError) -> SourceError {
    match e {
        SourceError::Message { position, reason } => {
            SourceError::Message { position, reason: format!("its message key does not fit source.key: {reason}") }
        }
        other => other,
    }
}

/// Whether a message key's `columns` are exactly the change key's.
fn exactly_the_key<'a>(columns: impl Iterator<Item = &'a str>, key: &[String]) -> Result<(), String> {
    let mut got: Vec<&str> = columns.collect();
    got.sort_unstable();
    let mut want: Vec<&str> = key.iter().map(String::as_str).collect();
    want.sort_unstable();
    if got == want {
        Ok(())
    } else {
        Err(format!("{MISMATCH}: it holds the columns {got:?}, the change key is {key:?}"))
    }
}

/// The first string column of a Debezium `after` row holding [`UNAVAILABLE`].
fn unavailable_column(row: &Map<String, Value>) -> Option<&str> {
    fn holds(v: &Value) -> bool {
        match v {
            Value::String(s) => s == UNAVAILABLE,
            Value::Array(a) => a.iter().any(holds),
            Value::Object(o) => o.values().any(holds),
            _ => false,
        }
    }
    row.iter().find(|(_, v)| holds(v)).map(|(k, _)| k.as_str())
}

/// Why an `after` row with an [`UNAVAILABLE`] `column` is refused.
fn partial_row(column: &str) -> String {
    format!(
        "column {column:?} of its \"after\" row is Debezium's {UNAVAILABLE:?}: the source sent a partial row (a \
         TOASTed column an update left unchanged), and an upsert replaces the whole row. Give the source full row \
         images (Postgres: ALTER TABLE ... REPLICA IDENTITY FULL; MySQL: binlog_row_image = FULL) or have Debezium \
         fill such values in"
    )
}

fn unknown_op(op: Option<&str>) -> String {
    match op {
        Some(op) => format!(
            "op {op:?} is not a change Sluice applies (Debezium's c, r, u or d; a truncate t or a message m is not \
             a row's change)"
        ),
        None => "the change event has no op (Debezium's c, r, u or d)".to_string(),
    }
}

/// The JSON converter's `{"schema": ..., "payload": ...}`, unwrapped.
fn payload(value: Value) -> Value {
    match value {
        Value::Object(mut o) if o.contains_key("schema") && o.contains_key("payload") && !o.contains_key("op") => {
            o.remove("payload").unwrap_or(Value::Null)
        }
        other => other,
    }
}

/// A message key as a row of the key's columns: a JSON object (with or
/// without the converter's schema), or a bare value when the key is one column.
fn key_object(value: Value, key: &[String]) -> Result<Map<String, Value>, String> {
    match payload(value) {
        Value::Object(o) => Ok(o),
        Value::Null => Err("the message key is null".to_string()),
        scalar if key.len() == 1 => Ok(Map::from_iter([(key[0].clone(), scalar)])),
        other => Err(format!("the message key {other} is not an object of the key's columns {key:?}")),
    }
}

/// The change a Debezium JSON message makes, and the row it names.
fn json_change(m: &Message, key: &[String]) -> Result<(Op, Map<String, Value>), String> {
    let from_key = |what: &str| -> Result<Map<String, Value>, String> {
        let bytes = m.key.as_deref().ok_or_else(|| format!("{what} with no message key"))?;
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| format!("{what} whose message key is not JSON: {e}"))?;
        key_object(value, key)
    };
    let Some(bytes) = m.value.as_deref() else {
        return Ok((Op::Delete, from_key("a tombstone")?));
    };
    let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    let mut envelope = match payload(value) {
        // The JSON converter writes a tombstone's null as a null payload.
        Value::Null => return Ok((Op::Delete, from_key("a null payload (a tombstone)")?)),
        Value::Object(o) => o,
        other => return Err(format!("not a Debezium change event (an object with op, before, after): {other}")),
    };
    let text = envelope.get("op").and_then(Value::as_str);
    let op = text.and_then(Op::parse).ok_or_else(|| match envelope.get("op") {
        Some(Value::String(_)) | None | Some(Value::Null) => unknown_op(text),
        Some(other) => format!("op {other} is not a string (Debezium's c, r, u or d)"),
    })?;
    let op_name = text.unwrap_or_default().trim().to_string();
    match op {
        Op::Upsert => match envelope.remove("after") {
            Some(Value::Object(row)) => match unavailable_column(&row) {
                Some(column) => Err(partial_row(column)),
                None => Ok((op, row)),
            },
            Some(Value::Null) | None => Err(format!("op {op_name:?} has no \"after\" row")),
            Some(other) => Err(format!("op {op_name:?}: \"after\" is not an object: {other}")),
        },
        Op::Delete => match envelope.remove("before") {
            Some(Value::Object(row)) => Ok((op, row)),
            Some(Value::Null) | None => Ok((op, from_key(&format!("op {op_name:?} with no \"before\" row and"))?)),
            Some(other) => Err(format!("op {op_name:?}: \"before\" is not an object: {other}")),
        },
    }
}

/// Debezium's Avro envelope (JSON text) cut to the fields Sluice reads:
/// `before`, `after` and `op` (Avro resolution skips the writer's others).
pub fn envelope_reader(text: &str) -> Result<String, String> {
    let mut value: Value = serde_json::from_str(text).map_err(|e| format!("is not JSON: {e}"))?;
    let fields = value
        .get_mut("fields")
        .and_then(Value::as_array_mut)
        .ok_or("is not an Avro record schema (Debezium's envelope: before, after, op, source, ts_ms)")?;
    fields.retain(|f| matches!(f.get("name").and_then(Value::as_str), Some("before" | "after" | "op")));
    for want in ["before", "after", "op"] {
        if !fields.iter().any(|f| f.get("name").and_then(Value::as_str) == Some(want)) {
            return Err(format!(
                "is not Debezium's envelope: it has no {want:?} field (the envelope has before, after, op, source, \
                 ts_ms; the row record alone is not enough)"
            ));
        }
    }
    Ok(value.to_string())
}

/// The row's columns of a decoded envelope: the `after` record's fields,
/// which `before` must share.
fn envelope_row(envelope: &Schema) -> Result<Schema, String> {
    let record = |name: &str| match envelope.field_with_name(name).map(|f| f.data_type()) {
        Ok(DataType::Struct(fields)) => Ok(fields.clone()),
        Ok(other) => Err(format!("its {name:?} field is {other}, not a record (a union of null and the row record)")),
        Err(_) => Err(format!("has no {name:?} field")),
    };
    let (after, before) = (record("after")?, record("before")?);
    if after != before {
        return Err("its \"before\" and \"after\" records differ; Debezium writes both as the row record".into());
    }
    match envelope.field_with_name("op").map(|f| f.data_type()) {
        Ok(DataType::Utf8) => {}
        _ => return Err("its \"op\" field is not a string".into()),
    }
    if after.is_empty() {
        return Err("its row record has no fields; the table needs at least one column".into());
    }
    Ok(Schema::new(after))
}

#[cfg(test)]
mod tests {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Int64Type, UInt8Type, UInt64Type};

    use super::*;
    use crate::kafka::decode::Codec;

    fn row_schema() -> Schema {
        Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
            Field::new("amount", DataType::Float64, true),
        ])
    }

    fn msg(offset: i64, key: Option<&str>, value: Option<&str>) -> Message {
        Message {
            partition: 3,
            offset,
            timestamp_ms: None,
            key: key.map(|k| k.as_bytes().to_vec()),
            value: value.map(|v| v.as_bytes().to_vec()),
            headers: Vec::new(),
        }
    }

    fn json_codec() -> ChangeCodec {
        ChangeCodec::new(Inner::DebeziumJson, &row_schema(), vec!["id".into()]).unwrap_or_else(|e| panic!("{e}"))
    }

    fn error(codec: &ChangeCodec, messages: &[Message]) -> String {
        match codec.decode("pg.orders", messages) {
            Ok(b) => panic!("decoded {} rows", b.num_rows()),
            Err(e) => {
                assert!(matches!(e, SourceError::Message { .. }), "a message's fault: {e}");
                e.to_string()
            }
        }
    }

    /// (id, name, op, lo) of each row.
    fn changes(batch: &RecordBatch) -> Vec<(i64, Option<String>, u8, u64)> {
        let id = batch.column(0).as_primitive::<Int64Type>();
        let name = batch.column(1).as_string::<i32>();
        let n = batch.num_columns();
        let op = batch.column(n - 3).as_primitive::<UInt8Type>();
        let hi = batch.column(n - 2).as_primitive::<UInt64Type>();
        let lo = batch.column(n - 1).as_primitive::<UInt64Type>();
        (0..batch.num_rows())
            .map(|i| {
                assert_eq!(hi.value(i), 0);
                (id.value(i), name.is_valid(i).then(|| name.value(i).to_string()), op.value(i), lo.value(i))
            })
            .collect()
    }

    #[test]
    fn debezium_json_envelopes_with_and_without_schemas_become_changes() {
        let codec = json_codec();
        let schema = codec.batch_schema();
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        assert_eq!(names, ["id", "name", "amount", OP, SEQ_HI, SEQ_LO]);
        assert!(!codec.table_schema().field(0).is_nullable(), "the key keeps its nullability");
        assert!(codec.table_schema().field(1).is_nullable(), "a tombstone carries the key alone");
        let src = r#""source":{"db":"shop","lsn":12},"ts_ms":1700000000000,"transaction":null"#;
        let messages = [
            msg(
                10,
                Some(r#"{"id":1}"#),
                Some(&format!(r#"{{"before":null,"after":{{"id":1,"name":"a"}},"op":"r",{src}}}"#)),
            ),
            msg(
                11,
                Some(r#"{"id":2}"#),
                Some(
                    r#"{"schema":{"type":"struct"},"payload":{"before":null,"after":{"id":2,"name":"b","amount":2.5},"op":"c"}}"#,
                ),
            ),
            msg(
                12,
                Some(r#"{"id":1}"#),
                Some(&format!(r#"{{"before":{{"id":1,"name":"a"}},"after":{{"id":1,"name":"A"}},"op":"u",{src}}}"#)),
            ),
            msg(13, Some(r#"{"id":2}"#), Some(r#"{"before":{"id":2,"name":"b"},"after":null,"op":"d"}"#)),
            msg(14, Some(r#"{"schema":{"type":"struct"},"payload":{"id":2}}"#), None),
            // A delete whose before is null (no replica identity): the key.
            msg(15, Some("7"), Some(r#"{"before":null,"after":null,"op":"d"}"#)),
        ];
        let batch = codec.decode("pg.orders", &messages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.schema(), schema);
        assert_eq!(
            changes(&batch),
            vec![
                (1, Some("a".into()), 0, 10),
                (2, Some("b".into()), 0, 11),
                (1, Some("A".into()), 0, 12),
                (2, Some("b".into()), 1, 13),
                (2, None, 1, 14),
                (7, None, 1, 15),
            ]
        );
    }

    #[test]
    fn bad_changes_are_refused_naming_the_offset_and_the_cause() {
        let codec = json_codec();
        let ok = msg(1, Some(r#"{"id":1}"#), Some(r#"{"after":{"id":1,"name":"a"},"op":"c"}"#));
        let cases = [
            (r#"{"after":{"id":2,"name":"b"},"op":"x"}"#, "op \"x\" is not a change"),
            (r#"{"after":{"id":2,"name":"b"},"op":"t"}"#, "op \"t\""),
            (r#"{"after":{"id":2,"name":"b"}}"#, "has no op"),
            (r#"{"after":{"id":2,"name":"b"},"op":null}"#, "has no op"),
            (r#"{"after":null,"op":"u"}"#, "op \"u\" has no \"after\" row"),
            (r#"{"after":{"name":"b"},"op":"c"}"#, "key column \"id\" is missing or null"),
            (r#"{"after":{"id":2,"name":"b","colour":"red"},"op":"c"}"#, "colour"),
            (r#"{"after":{"id":"two","name":"b"},"op":"c"}"#, "id"),
            ("not json", "not JSON"),
        ];
        for (value, why) in cases {
            let e = error(&codec, &[ok.clone(), msg(2, Some(r#"{"id":2}"#), Some(value))]);
            assert!(e.contains("\"pg.orders\" partition 3 offset 2") && e.contains(why), "{value}: {e}");
        }
        let e = error(&codec, &[ok.clone(), msg(5, None, None)]);
        assert!(e.contains("offset 5") && e.contains("tombstone with no message key"), "{e}");
        let e = error(&codec, &[msg(6, None, Some(r#"{"before":null,"op":"d"}"#))]);
        assert!(e.contains("offset 6") && e.contains("no \"before\" row and with no message key"), "{e}");
        let e = error(&codec, &[msg(8, Some(r#"{"other":3}"#), None)]);
        assert!(e.contains("offset 8") && e.contains("other"), "{e}");
    }

    #[test]
    fn a_key_the_rows_do_not_have_is_refused_naming_source_key() {
        let e = ChangeCodec::new(Inner::DebeziumJson, &row_schema(), vec!["order_id".into()])
            .err()
            .unwrap_or_else(|| panic!("a codec"));
        assert!(e.to_string().contains("source.key") && e.to_string().contains("\"order_id\""), "{e}");
        assert!(ChangeCodec::new(Inner::Json, &row_schema(), vec![]).is_err());
    }

    #[test]
    fn plain_json_rows_with_a_key_are_upserts() {
        let codec = ChangeCodec::new(Inner::Json, &row_schema(), vec!["id".into()]).unwrap_or_else(|e| panic!("{e}"));
        assert!(!codec.table_schema().field(1).is_nullable(), "plain rows keep their columns");
        let batch = codec
            .decode(
                "t",
                &[
                    msg(4, Some(r#"{"id":9}"#), Some(r#"{"id":9,"name":"x"}"#)),
                    msg(5, Some("9"), Some(r#"{"id":9,"name":"y"}"#)),
                    msg(6, Some(r#"{"schema":{"type":"int64"},"payload":{"id":9}}"#), Some(r#"{"id":9,"name":"z"}"#)),
                ],
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            changes(&batch),
            vec![(9, Some("x".into()), 0, 4), (9, Some("y".into()), 0, 5), (9, Some("z".into()), 0, 6)]
        );
    }

    /// Offsets order a key's changes only within one partition, and the
    /// partitioner keeps a message key in one: the message key must be
    /// the change key, with the row's values.
    #[test]
    fn a_message_key_that_is_not_the_rows_change_key_is_refused() {
        let plain = ChangeCodec::new(Inner::Json, &row_schema(), vec!["id".into()]).unwrap_or_else(|e| panic!("{e}"));
        let row = r#"{"id":9,"name":"x"}"#;
        let after = r#"{"before":null,"after":{"id":9,"name":"x"},"op":"c"}"#;
        let cases: [(Option<&str>, &str); 7] = [
            (None, "has no message key"),
            (Some("null"), "the message key is null"),
            (Some(r#"{"customer":3}"#), r#"holds the columns ["customer"], the change key is ["id"]"#),
            (Some(r#"{"id":9,"name":"x"}"#), r#"holds the columns ["id", "name"]"#),
            (Some(r#"{"id":8}"#), "key column \"id\" is 8 but the row's is 9"),
            (Some(r#"{"id":null}"#), "key column \"id\" is null"),
            (Some("not json"), "not JSON"),
        ];
        for codec in [&plain, &json_codec()] {
            let value = if matches!(codec.inner, Inner::Json) { row } else { after };
            for (key, why) in cases {
                let ok = msg(1, Some(r#"{"id":9}"#), Some(value));
                let e = error(codec, &[ok, msg(2, key, Some(value))]);
                assert!(e.contains("\"pg.orders\" partition 3 offset 2") && e.contains(why), "{key:?}: {e}");
            }
        }
        // A Debezium delete's before row, too, is its key's.
        let e = error(&json_codec(), &[msg(7, Some("1"), Some(r#"{"before":{"id":2},"after":null,"op":"d"}"#))]);
        assert!(e.contains("offset 7") && e.contains("is 1 but the row's is 2"), "{e}");
        // With dead letters the message is set aside, once; the others land.
        let codec = Codec::Changes(plain);
        let messages = [
            msg(10, Some("1"), Some(r#"{"id":1,"name":"a"}"#)),
            msg(11, Some("5"), Some(r#"{"id":2,"name":"b"}"#)),
            msg(12, Some("3"), Some(r#"{"id":3,"name":"c"}"#)),
        ];
        let (batch, bad) = codec.decode_keeping_bad("pg.orders", &messages, true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(changes(&batch), vec![(1, Some("a".into()), 0, 10), (3, Some("c".into()), 0, 12)]);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].position, "topic \"pg.orders\" partition 3 offset 11");
        assert!(bad[0].reason.contains("is 5 but the row's is 2"), "{}", bad[0].reason);
    }

    #[test]
    fn a_partial_row_image_is_refused_naming_the_column() {
        let codec = json_codec();
        let toasted = format!(r#"{{"before":null,"after":{{"id":4,"name":"{UNAVAILABLE}"}},"op":"u"}}"#);
        let nested = format!(r#"{{"before":null,"after":{{"id":4,"name":"n","amount":["{UNAVAILABLE}"]}},"op":"u"}}"#);
        for (value, column) in [(&toasted, "name"), (&nested, "amount")] {
            let e = error(&codec, &[msg(21, Some("4"), Some(value))]);
            assert!(e.contains("\"pg.orders\" partition 3 offset 21"), "{e}");
            assert!(e.contains(&format!("column {column:?}")) && e.contains(UNAVAILABLE), "{e}");
            assert!(e.contains("REPLICA IDENTITY FULL") && e.contains("binlog_row_image = FULL"), "{e}");
        }
        // In before, or as part of a longer string, it is a value as any other.
        let fine = format!(
            r#"{{"before":{{"id":4,"name":"{UNAVAILABLE}"}},"after":{{"id":4,"name":"x{UNAVAILABLE}"}},"op":"u"}}"#
        );
        assert!(codec.decode("pg.orders", &[msg(22, Some("4"), Some(&fine))]).is_ok());
        // The Avro envelope's after record: its string columns.
        let after = StructArray::from(vec![
            (
                Arc::new(Field::new("id", DataType::Int64, false)),
                Arc::new(arrow_array::Int64Array::from(vec![1, 2])) as ArrayRef,
            ),
            (
                Arc::new(Field::new("name", DataType::Utf8, true)),
                Arc::new(arrow_array::StringArray::from(vec![Some("a"), Some(UNAVAILABLE)])) as ArrayRef,
            ),
        ]);
        assert_eq!((unavailable_at(&after, 0), unavailable_at(&after, 1)), (None, Some("name")));
    }

    #[test]
    fn the_avro_envelope_is_cut_to_before_after_and_op() {
        let envelope = r#"{"type":"record","name":"Envelope","namespace":"pg.public.orders","fields":[
            {"name":"before","type":["null",{"type":"record","name":"Value","fields":[{"name":"id","type":"long"}]}],"default":null},
            {"name":"after","type":["null","Value"],"default":null},
            {"name":"source","type":{"type":"record","name":"Source","namespace":"io.debezium","fields":[{"name":"db","type":"string"}]}},
            {"name":"op","type":"string"},
            {"name":"ts_ms","type":["null","long"],"default":null}]}"#;
        let cut: Value = serde_json::from_str(&envelope_reader(envelope).unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> =
            cut["fields"].as_array().map(|f| f.iter().filter_map(|f| f["name"].as_str()).collect()).unwrap_or_default();
        assert_eq!(names, ["before", "after", "op"]);
        assert_eq!(cut["namespace"], "pg.public.orders");
        let row = r#"{"type":"record","name":"Value","fields":[{"name":"id","type":"long"}]}"#;
        assert!(envelope_reader(row).is_err_and(|e| e.contains("no \"before\" field")));
    }
}
