//! Messages to rows: JSON against the declared columns, Avro (see
//! `avro.rs`), or the raw record.
//!
//! Invariants:
//! - one message is one row: a message holding no JSON value, or more than
//!   one, or a value split over two messages, is refused;
//! - a message that does not parse, or does not fit the columns (a wrong
//!   type, an unknown field, a missing required one), is refused naming
//!   its topic, partition and offset, and arrow's reason, which names the
//!   column;
//! - a batch is decoded whole; only when that fails is it decoded again
//!   message by message, to name the one at fault or, with dead letters,
//!   to keep the others' rows and hand the ones at fault on as dead
//!   letters (named `topic "t" partition p offset o`).

use std::sync::Arc;

use arrow_array::builder::{
    BinaryBuilder, Int32Builder, Int64Builder, ListBuilder, StringBuilder, StructBuilder, TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_json::reader::ReaderBuilder;
use arrow_schema::{DataType, Field, Fields, SchemaRef};

use super::super::{BadRow, SourceError};
use super::avro::AvroCodec;
use super::debezium::{ChangeCodec, Inner};
use crate::kafka::config::{Decoding, KafkaConfig, MessageFormat, raw_schema};

/// A message as fetched, owned (the client's buffer is reused).
#[derive(Debug, Clone)]
pub struct Message {
    pub partition: i32,
    pub offset: i64,
    /// Milliseconds since the Unix epoch, when the record has one.
    pub timestamp_ms: Option<i64>,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

/// How a source's messages become rows.
pub enum Codec {
    Json(SchemaRef),
    Avro(AvroCodec),
    Raw(SchemaRef),
    /// A change stream (`source.key`; Debezium's envelopes).
    Changes(ChangeCodec),
}

/// Where message `m` of `topic` is, as errors and dead letters name it.
fn position(topic: &str, m: &Message) -> String {
    format!("topic {topic:?} partition {} offset {}", m.partition, m.offset)
}

/// Why message `m` of `topic` is refused: the message's own fault, so with
/// dead letters it becomes one ([`Codec::decode_keeping_bad`]).
pub(super) fn refused(topic: &str, m: &Message, why: impl std::fmt::Display) -> SourceError {
    SourceError::Message { position: position(topic, m), reason: why.to_string() }
}

/// A message's value as a dead letter's `raw` text: as it is when it is
/// UTF-8 (JSON), else `base64:` and its bytes in base64 (Avro); `""` for a
/// tombstone.
fn raw_text(m: &Message) -> String {
    use base64::Engine as _;
    let value = m.value.as_deref().unwrap_or_default();
    match std::str::from_utf8(value) {
        Ok(text) => text.to_string(),
        Err(_) => format!("base64:{}", base64::engine::general_purpose::STANDARD.encode(value)),
    }
}

impl Codec {
    pub fn for_config(config: &KafkaConfig) -> Result<Self, SourceError> {
        let plain = Self::plain(config)?;
        if config.key.is_empty() && !config.format.is_debezium() {
            return Ok(plain);
        }
        let key = config.key.clone();
        let changes = match (plain, config.format) {
            (Codec::Json(schema), MessageFormat::DebeziumJson) => ChangeCodec::new(Inner::DebeziumJson, &schema, key)?,
            (Codec::Json(schema), _) => ChangeCodec::new(Inner::Json, &schema, key)?,
            (Codec::Avro(avro), MessageFormat::DebeziumAvro) => {
                ChangeCodec::debezium_avro(avro, AvroCodec::reader_origin(config), key)?
            }
            (Codec::Avro(avro), _) => {
                let row = avro.table_schema();
                ChangeCodec::new(Inner::Avro(avro), &row, key)?
            }
            (Codec::Raw(_) | Codec::Changes(_), _) => {
                return Err(SourceError::Config {
                    key: "source.key".into(),
                    message: "kafka: format = \"raw\" has no change key".into(),
                });
            }
        };
        Ok(Codec::Changes(changes))
    }

    /// The codec of the rows, before any change-stream reading.
    fn plain(config: &KafkaConfig) -> Result<Self, SourceError> {
        match &config.decoding {
            Decoding::Json(schema) => Ok(Codec::Json(schema.clone())),
            Decoding::Raw => Ok(Codec::Raw(raw_schema())),
            // `with_table_columns` turns it into `Json` before the source opens.
            Decoding::JsonOfTable => Err(SourceError::Internal(
                "kafka: the target table's columns were not loaded before the source opened".into(),
            )),
            Decoding::Avro { .. } => Ok(Codec::Avro(AvroCodec::open(config)?)),
        }
    }

    /// The columns of every table.
    pub fn table_schema(&self) -> SchemaRef {
        match self {
            Codec::Json(s) | Codec::Raw(s) => s.clone(),
            Codec::Avro(a) => a.table_schema(),
            Codec::Changes(c) => c.table_schema(),
        }
    }

    /// The columns of every batch: the table's, and a change stream's
    /// reserved columns after them.
    pub fn batch_schema(&self) -> SchemaRef {
        match self {
            Codec::Changes(c) => c.batch_schema(),
            _ => self.table_schema(),
        }
    }

    /// The Avro reader schema (compact JSON), as the checkpoint records it.
    pub fn avro_reader_schema(&self) -> Option<&str> {
        match self {
            Codec::Avro(a) => Some(a.reader_schema()),
            Codec::Changes(c) => c.avro_reader_schema(),
            Codec::Json(_) | Codec::Raw(_) => None,
        }
    }

    /// The rows of `messages`, all of `topic`, in order.
    pub fn decode(&self, topic: &str, messages: &[Message]) -> Result<RecordBatch, SourceError> {
        match self {
            Codec::Json(schema) => match json_batch(schema, messages) {
                Ok(batch) if batch.num_rows() == messages.len() => Ok(batch),
                _ => Err(json_culprit(schema, topic, messages)),
            },
            Codec::Avro(avro) => avro.decode(topic, messages),
            // The raw columns take any message: a failure is Sluice's own.
            Codec::Raw(schema) => raw_batch(schema, messages)
                .map_err(|e| SourceError::Internal(format!("kafka: topic {topic:?}: raw records: {e}"))),
            Codec::Changes(c) => c.decode(topic, messages),
        }
    }
}

impl Codec {
    /// [`Codec::decode`], keeping the messages that do not fit (when
    /// `keep_bad`) as dead letters, in order, instead of failing: the rows
    /// are then the other messages'. Only a message's own fault makes a
    /// dead letter; any other failure (a registry that cannot be reached)
    /// is an error still. The batch is decoded whole first; only when that
    /// fails is it decoded again message by message.
    pub fn decode_keeping_bad(
        &self,
        topic: &str,
        messages: &[Message],
        keep_bad: bool,
    ) -> Result<(RecordBatch, Vec<BadRow>), SourceError> {
        match self.decode(topic, messages) {
            Ok(batch) => Ok((batch, Vec::new())),
            Err(SourceError::Message { .. }) if keep_bad => self.sort_out(topic, messages),
            Err(e) => Err(e),
        }
    }

    /// Each message decoded alone: the rows of those that fit, and the
    /// others as dead letters.
    fn sort_out(&self, topic: &str, messages: &[Message]) -> Result<(RecordBatch, Vec<BadRow>), SourceError> {
        let mut rows = Vec::new();
        let mut bad = Vec::new();
        for m in messages {
            match self.decode(topic, std::slice::from_ref(m)) {
                Ok(row) => rows.push(row),
                Err(SourceError::Message { position, reason }) => {
                    bad.push(BadRow { raw: raw_text(m), position, reason });
                }
                Err(e) => return Err(e),
            }
        }
        let schema = self.batch_schema();
        let batch = arrow_select::concat::concat_batches(&schema, &rows).map_err(|e| SourceError::Rows {
            topic: topic.to_string(),
            message: format!("the rows around a bad message: {e}"),
        })?;
        Ok((batch, bad))
    }
}

pub(super) fn json_batch(schema: &SchemaRef, messages: &[Message]) -> Result<RecordBatch, String> {
    let mut decoder = ReaderBuilder::new(schema.clone())
        .with_batch_size(messages.len() + 1)
        .with_strict_mode(true)
        .build_decoder()
        .map_err(|e| e.to_string())?;
    for (i, m) in messages.iter().enumerate() {
        let value = m.value.as_deref().ok_or("a message with no value (a tombstone)")?;
        feed(&mut decoder, value)?;
        feed(&mut decoder, b"\n")?;
        // Each message on its own holds one whole value, whatever the
        // batch's boundaries: a count over the batch alone would let two
        // values in one message make up for none in the next.
        if decoder.len() != i + 1 || decoder.has_partial_record() {
            return Err(format!("message {i} of the batch does not hold exactly one JSON object"));
        }
    }
    match decoder.flush().map_err(|e| e.to_string())? {
        Some(batch) => Ok(batch),
        None => Ok(RecordBatch::new_empty(schema.clone())),
    }
}

/// Feeds all of `bytes` (the decoder stops early only at its batch size).
fn feed(decoder: &mut arrow_json::reader::Decoder, mut bytes: &[u8]) -> Result<(), String> {
    while !bytes.is_empty() {
        let read = decoder.decode(bytes).map_err(|e| e.to_string())?;
        if read == 0 {
            return Err("more JSON values than messages".to_string());
        }
        bytes = &bytes[read..];
    }
    Ok(())
}

/// The first message of a batch that failed, and why.
pub(super) fn json_culprit(schema: &SchemaRef, topic: &str, messages: &[Message]) -> SourceError {
    for m in messages {
        match json_batch(schema, std::slice::from_ref(m)) {
            Ok(b) if b.num_rows() == 1 => continue,
            Ok(b) => {
                let why = format!("it holds {} JSON values; a message must hold exactly one object", b.num_rows());
                return refused(topic, m, why);
            }
            Err(why) => return refused(topic, m, why),
        }
    }
    // Each message decodes alone but not together: a value split over two.
    match messages.first() {
        Some(m) => refused(topic, m, "its JSON value runs on into the next message"),
        None => SourceError::Internal(format!("kafka: topic {topic:?}: an empty batch failed to decode")),
    }
}

fn raw_batch(schema: &SchemaRef, messages: &[Message]) -> Result<RecordBatch, arrow_schema::ArrowError> {
    let n = messages.len();
    let mut partition = Int32Builder::with_capacity(n);
    let mut offset = Int64Builder::with_capacity(n);
    let mut timestamp = TimestampMicrosecondBuilder::with_capacity(n).with_timezone("UTC");
    let mut key = BinaryBuilder::with_capacity(n, 0);
    let mut value = BinaryBuilder::with_capacity(n, 0);
    let header_fields =
        Fields::from(vec![Field::new("key", DataType::Utf8, false), Field::new("value", DataType::Binary, true)]);
    let entry =
        StructBuilder::new(header_fields.clone(), vec![Box::new(StringBuilder::new()), Box::new(BinaryBuilder::new())]);
    let mut headers =
        ListBuilder::new(entry).with_field(Arc::new(Field::new("item", DataType::Struct(header_fields), true)));
    for m in messages {
        partition.append_value(m.partition);
        offset.append_value(m.offset);
        timestamp.append_option(m.timestamp_ms.map(|ms| ms.saturating_mul(1000)));
        key.append_option(m.key.as_deref());
        value.append_option(m.value.as_deref());
        let entries = headers.values();
        for (k, v) in &m.headers {
            if let Some(b) = entries.field_builder::<StringBuilder>(0) {
                b.append_value(k);
            }
            if let Some(b) = entries.field_builder::<BinaryBuilder>(1) {
                b.append_option(v.as_deref());
            }
            entries.append(true);
        }
        headers.append(true);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(partition.finish()),
        Arc::new(offset.finish()),
        Arc::new(timestamp.finish()),
        Arc::new(key.finish()),
        Arc::new(value.finish()),
        Arc::new(headers.finish()),
    ];
    RecordBatch::try_new(schema.clone(), columns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kafka::config::{ColumnSpec, columns_schema};

    fn msg(offset: i64, value: &str) -> Message {
        Message {
            partition: 2,
            offset,
            timestamp_ms: Some(1_700_000_000_000),
            key: Some(b"k".to_vec()),
            value: Some(value.as_bytes().to_vec()),
            headers: vec![("h".into(), Some(b"v".to_vec()))],
        }
    }

    fn schema() -> SchemaRef {
        let c = |n: &str, t: &str, nullable| ColumnSpec { name: n.into(), kind: t.into(), nullable };
        columns_schema(&[c("id", "long", false), c("name", "string", true), c("amount", "double", true)])
            .unwrap_or_else(|e| panic!("{e:?}"))
    }

    fn error(codec: &Codec, messages: &[Message]) -> String {
        match codec.decode("orders", messages) {
            Ok(b) => panic!("decoded {} rows", b.num_rows()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn json_messages_become_one_row_each() {
        let codec = Codec::Json(schema());
        let batch = codec
            .decode("orders", &[msg(0, r#"{"id":1,"name":"a"}"#), msg(1, r#"{"id":2,"amount":2.5}"#)])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.num_rows(), 2);
    }

    /// Declared `timestamp` columns are zoned "UTC": arrow-json parses into
    /// them only with arrow's `chrono-tz` feature (offsets alone otherwise).
    #[test]
    fn timestamps_dates_and_decimals_decode_into_their_declared_types() {
        let c = |n: &str, t: &str| ColumnSpec { name: n.into(), kind: t.into(), nullable: true };
        let schema = columns_schema(&[c("ts", "timestamp"), c("day", "date"), c("amount", "decimal(18,2)")])
            .unwrap_or_else(|e| panic!("{e:?}"));
        let batch = Codec::Json(schema)
            .decode("orders", &[msg(0, r#"{"ts":"2026-12-02T10:00:00Z","day":"2026-12-02","amount":"12.50"}"#)])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.num_rows(), 1);
        let ts = batch.column(0).as_any().downcast_ref::<arrow_array::TimestampMicrosecondArray>().expect("ts");
        assert_eq!(ts.value(0), 1_796_205_600_000_000);
    }

    #[test]
    fn a_bad_message_is_named_by_partition_offset_and_column() {
        let codec = Codec::Json(schema());
        let e = error(&codec, &[msg(7, r#"{"id":1}"#), msg(8, r#"{"id":2,"amount":"lots"}"#)]);
        assert!(e.contains("partition 2 offset 8"), "{e}");
        assert!(e.contains("amount") || e.contains("lots"), "{e}");
        let e = error(&codec, &[msg(3, r#"{"id":1,"colour":"red"}"#)]);
        assert!(e.contains("offset 3") && e.contains("colour"), "{e}");
        let e = error(&codec, &[msg(4, r#"{"name":"no id"}"#)]);
        assert!(e.contains("offset 4"), "{e}");
        let e = error(&codec, &[msg(5, r#"{"id":1}{"id":2}"#)]);
        assert!(e.contains("offset 5") && e.contains("exactly one JSON object"), "{e}");
        // Two values in one message and none in the next: refused in one
        // batch as in two, naming the first.
        let e = error(&codec, &[msg(10, r#"{"id":1}{"id":2}"#), msg(11, " ")]);
        assert!(e.contains("offset 10") && e.contains("exactly one JSON object"), "{e}");
        let e = error(&codec, &[msg(6, r#"{"id":"#), msg(7, r#"1}"#)]);
        assert!(e.contains("offset 6"), "{e}");
        let mut tombstone = msg(9, "");
        tombstone.value = None;
        let e = error(&codec, &[tombstone]);
        assert!(e.contains("offset 9") && e.contains("tombstone"), "{e}");
    }

    #[test]
    fn with_dead_letters_the_messages_that_do_not_fit_are_kept_apart() {
        let codec = Codec::Json(schema());
        let mut binary = msg(11, "");
        binary.value = Some(vec![0xff, 0x00]);
        let messages = [
            msg(7, r#"{"id":1}"#),
            msg(8, r#"{"id":2,"amount":"lots"}"#),
            msg(9, "not json"),
            binary,
            msg(10, r#"{"id":3,"name":"c"}"#),
        ];
        let (batch, bad) = codec.decode_keeping_bad("orders", &messages, true).unwrap_or_else(|e| panic!("{e}"));
        let ids = batch.column(0).as_any().downcast_ref::<arrow_array::Int64Array>().expect("ids");
        assert_eq!(ids.values().to_vec(), vec![1, 3], "the others' rows, in order");
        let shown: Vec<(&str, &str)> = bad.iter().map(|b| (b.position.as_str(), b.raw.as_str())).collect();
        assert_eq!(
            shown,
            vec![
                ("topic \"orders\" partition 2 offset 8", r#"{"id":2,"amount":"lots"}"#),
                ("topic \"orders\" partition 2 offset 9", "not json"),
                ("topic \"orders\" partition 2 offset 11", "base64:/wA="),
            ]
        );
        assert!(bad[0].reason.contains("amount") || bad[0].reason.contains("lots"), "{}", bad[0].reason);
        // Without dead letters, the first one is the error.
        let e = codec.decode_keeping_bad("orders", &messages, false).expect_err("refused").to_string();
        assert!(e.contains("partition 2 offset 8"), "{e}");
        // Nothing fits: no rows, the table's columns.
        let (batch, bad) = codec.decode_keeping_bad("orders", &messages[2..3], true).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((batch.num_rows(), batch.schema(), bad.len()), (0, schema(), 1));
    }

    #[test]
    fn raw_messages_keep_key_headers_and_timestamp() {
        let codec = Codec::Raw(raw_schema());
        let batch = codec.decode("orders", &[msg(0, "x"), msg(1, "y")]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.num_rows(), 2);
        assert_eq!(batch.schema(), raw_schema());
    }
}
