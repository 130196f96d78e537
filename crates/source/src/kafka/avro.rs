//! Avro messages to rows, with arrow-avro (arrow-rs's own Avro crate),
//! optionally through a Confluent Schema Registry.
//!
//! What a message is:
//! - without `schema_registry`, each message value is one bare Avro binary
//!   datum (no header, no framing) of the job's `avro_schema`. The
//!   Confluent wire format is not guessed at: its magic byte 0 is also how
//!   many datums start (a long 0, an empty string, union branch 0);
//! - with `schema_registry`, every message value is in the Confluent wire
//!   format: byte 0 is 0x00, bytes 1..5 the writer schema's id (big-endian),
//!   then the Avro binary datum. Writer schemas are fetched by id
//!   (`GET {registry}/schemas/ids/{id}`) the first time an id is met, and
//!   kept for the run.
//!
//! The reader schema (the table's columns) is the job's `avro_schema`, or,
//! with a registry and no `avro_schema`, the latest version of subject
//! `{topic}-value` (TopicNameStrategy) at open; a source of several topics
//! needs their latest versions to be one schema. Writers resolve to it by
//! Avro schema resolution (arrow-avro does it: a field added with a
//! default, a promoted type, a field the reader lacks): a writer id whose
//! schema does not resolve is refused naming the message that carried it.
//!
//! Invariants:
//! - a fetched batch of messages is decoded by one decoder into one
//!   `RecordBatch`; a message is fed whole and must yield exactly one row:
//!   a bad magic byte, an unknown schema id, a truncated datum or bytes
//!   after it are refused naming topic, partition, offset (and schema id);
//! - the table's Arrow schema is the one Iceberg takes: no field metadata,
//!   timestamps in microseconds (zone "UTC" for `timestamp-*`, none for
//!   `local-timestamp-*`), `time-millis` as microseconds, enums as strings;
//!   nullable exactly where the Avro type is a union with null;
//! - the checkpoint records the reader schema (compact JSON): a resume
//!   whose reader schema changed (the job's, or the registry's latest) is
//!   refused; new writer ids are not a change;
//! - a registry's failure keeps the request's URL and its kind comes from
//!   the answer ([`RegistryError`]): unreachable, a timeout, 5xx, 408 or
//!   429 may pass; 401, 403 and a missing subject are the job's to fix; an
//!   unknown writer id (404) is the message's fault.
//!
//! The registry's REST API: <https://docs.confluent.io/platform/current/schema-registry/develop/api.html>;
//! the wire format: <https://docs.confluent.io/platform/current/schema-registry/fundamentals/serdes-develop/index.html#wire-format>.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_array::{ArrayRef, RecordBatch};
use arrow_avro::reader::{Decoder, ReaderBuilder};
use arrow_avro::schema::{AvroSchema, Fingerprint, FingerprintAlgorithm, SchemaStore};
use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef, TimeUnit};

use sluice_core::ErrorKind;

use super::super::SourceError;
use super::decode::{Message, refused};
use crate::kafka::config::{Decoding, KafkaConfig, MessageFormat, Topics};

/// How long one registry request may take.
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(10);
/// The Confluent wire format's magic byte and its header's length.
const MAGIC: u8 = 0;
const HEADER: usize = 5;
/// Bare datums are fed to the decoder behind this header: schema "id" 0,
/// which names the job's schema in the decoder's store.
const BARE_HEADER: [u8; HEADER] = [MAGIC, 0, 0, 0, 0];
/// Idle decoders kept for reuse (one per subtask decoding at once).
const IDLE_DECODERS: usize = 8;

/// How messages carry their writer schema.
enum Framing {
    /// Bare datums of the reader schema.
    Bare,
    /// The Confluent wire format; writers come from the registry.
    Registry(Registry),
}

pub struct AvroCodec {
    /// The reader schema, as the job or the registry wrote it.
    reader: AvroSchema,
    /// The reader schema as compact JSON, as the checkpoint records it.
    reader_json: String,
    table: SchemaRef,
    framing: Framing,
    batch_size: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Writer schemas by registry id (bare: 0 is the reader schema).
    writers: BTreeMap<u32, AvroSchema>,
    /// Bumped whenever `writers` grows: decoders of older generations lack ids.
    generation: u64,
    idle: Vec<(u64, Decoder)>,
    /// Message keys' writer schemas by registry id (Debezium's tombstones).
    keys: BTreeMap<u32, AvroSchema>,
}

fn builder(reader: &AvroSchema, batch_size: usize) -> ReaderBuilder {
    ReaderBuilder::new()
        .with_batch_size(batch_size)
        .with_tz(arrow_avro::codec::Tz::Utc)
        .with_reader_schema(reader.clone())
}

/// A decoder of the given writers, resolved to `reader`.
fn build_decoder<'a>(
    reader: &AvroSchema,
    batch_size: usize,
    writers: impl IntoIterator<Item = (&'a u32, &'a AvroSchema)>,
) -> Result<Decoder, String> {
    let mut store = SchemaStore::new_with_type(FingerprintAlgorithm::Id);
    for (id, schema) in writers {
        store.set(Fingerprint::Id(*id), schema.clone()).map_err(|e| e.to_string())?;
    }
    builder(reader, batch_size).with_writer_schema_store(store).build_decoder().map_err(|e| e.to_string())
}

impl AvroCodec {
    pub fn open(config: &KafkaConfig) -> Result<Self, SourceError> {
        let Decoding::Avro { schema, registry } = &config.decoding else {
            return Err(SourceError::Internal("kafka: an Avro codec opened for a source that is not Avro".into()));
        };
        let framing = match registry {
            Some(url) => Framing::Registry(Registry::new(url)?),
            None => Framing::Bare,
        };
        let (text, from) = match (schema, &framing) {
            (Some(text), _) => (text.clone(), "the job's avro_schema".to_string()),
            (None, Framing::Registry(r)) => r.latest_of(&config.topics)?,
            (None, Framing::Bare) => {
                return Err(SourceError::Config {
                    key: "source.avro_schema".into(),
                    message: "kafka: an Avro source needs avro_schema (or _file) or schema_registry".into(),
                });
            }
        };
        let text = match config.format {
            // Debezium's envelope, read as its before, after and op alone.
            MessageFormat::DebeziumAvro => super::debezium::envelope_reader(&text)
                .map_err(|why| SourceError::AvroSchema { from: from.clone(), message: why })?,
            _ => text,
        };
        Self::new(text, &from, framing, config.batch_rows)
    }

    /// Where the reader schema came from, as errors name it.
    pub fn reader_origin(config: &KafkaConfig) -> &'static str {
        match &config.decoding {
            Decoding::Avro { schema: Some(_), .. } => "the job's avro_schema",
            _ => "the registry's latest of the topic's value subject",
        }
    }

    /// A codec of reader schema `text` (which came `from` there).
    fn new(text: String, from: &str, framing: Framing, batch_rows: usize) -> Result<Self, SourceError> {
        let bad = |why: String| SourceError::AvroSchema { from: from.to_string(), message: why };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("is not JSON (an Avro schema is JSON): {e}")))?;
        if value.get("type").and_then(|t| t.as_str()) != Some("record") {
            return Err(bad("is not an Avro record schema; a message's fields become the table's columns".into()));
        }
        let reader = AvroSchema::new(text);
        let batch_size = batch_rows.max(1);
        // The reader read by itself gives the table's columns.
        let decoder = build_decoder(&reader, batch_size, [(&0, &reader)])
            .map_err(|e| bad(format!("is not an Avro schema arrow-avro can read: {e}")))?;
        let table = table_schema(&decoder.schema());
        if table.fields().is_empty() {
            return Err(bad("has no fields; the table needs at least one column".into()));
        }
        let mut state = State::default();
        if matches!(framing, Framing::Bare) {
            state.writers.insert(0, reader.clone());
            state.idle.push((0, decoder));
        }
        Ok(Self { reader, reader_json: value.to_string(), table, framing, batch_size, state: Mutex::new(state) })
    }

    /// The columns of every table.
    pub fn table_schema(&self) -> SchemaRef {
        self.table.clone()
    }

    /// The reader schema as the checkpoint records it.
    pub fn reader_schema(&self) -> &str {
        &self.reader_json
    }

    /// The rows of `messages`, all of `topic`, in order: one decoder, one batch.
    pub fn decode(&self, topic: &str, messages: &[Message]) -> Result<RecordBatch, SourceError> {
        let values = self.framed(topic, messages)?;
        let (generation, mut decoder) = self.decoder_for(topic, messages, &values)?;
        let mut run = Run { decoder: &mut decoder, batch_size: self.batch_size, flushed: 0, out: Vec::new() };
        for (i, (m, (id, value))) in messages.iter().zip(&values).enumerate() {
            let pieces: [&[u8]; 2] = match self.framing {
                Framing::Bare => [&BARE_HEADER[..], value],
                Framing::Registry(_) => [value, &[][..]],
            };
            run.message(i, &pieces).map_err(|why| match id {
                Some(id) => refused(topic, m, format!("Avro datum of schema id {id}: {why}")),
                None => refused(topic, m, format!("Avro datum: {why}")),
            })?;
        }
        run.flush().map_err(|e| SourceError::Rows { topic: topic.to_string(), message: format!("Avro batch: {e}") })?;
        let batches = std::mem::take(&mut run.out);
        let rows = batches
            .iter()
            .map(|b| self.conform(b))
            .collect::<Result<Vec<_>, _>>()
            .and_then(|bs| arrow_select::concat::concat_batches(&self.table, &bs))
            .map_err(|e| SourceError::Rows {
                topic: topic.to_string(),
                message: format!("Avro rows to the table's columns: {e}"),
            })?;
        if rows.num_rows() != messages.len() {
            // Each message was fed whole and made one row (`Run::message`).
            return Err(SourceError::Internal(format!(
                "kafka: topic {topic:?}: {} Avro messages decoded to {} rows",
                messages.len(),
                rows.num_rows()
            )));
        }
        if let Ok(mut state) = self.state.lock()
            && state.idle.len() < IDLE_DECODERS
        {
            state.idle.push((generation, decoder));
        }
        Ok(rows)
    }

    /// A message key in the registry's wire format, read by its own writer
    /// schema (a record of the key's columns): one row, in the table's types.
    pub fn decode_key(&self, topic: &str, m: &Message) -> Result<RecordBatch, SourceError> {
        let bytes = m.key.as_deref().ok_or_else(|| refused(topic, m, "the message has no key"))?;
        let Framing::Registry(registry) = &self.framing else {
            return Err(refused(
                topic,
                m,
                "its message key is not JSON, and without schema_registry an Avro key has no schema to be read with",
            ));
        };
        let id = wire_id(bytes).map_err(|why| refused(topic, m, format!("its message key: {why}")))?;
        let poisoned = || SourceError::Internal("kafka: the Avro decoder state is poisoned".into());
        let known = self.state.lock().map_err(|_| poisoned())?.keys.get(&id).cloned();
        let writer = match known {
            Some(w) => w,
            None => {
                let w = registry.schema_by_id(id).map_err(|e| match e {
                    Fetch::Missing(why) => refused(topic, m, format!("key schema id {id}: {why}")),
                    Fetch::Failed(source) => SourceError::Registry {
                        context: format!(
                            "topic {topic:?} partition {} offset {}: cannot fetch key schema id {id}",
                            m.partition, m.offset
                        ),
                        source,
                    },
                })?;
                self.state.lock().map_err(|_| poisoned())?.keys.insert(id, w.clone());
                w
            }
        };
        let mut decoder = build_decoder(&writer, 1, [(&id, &writer)])
            .map_err(|why| refused(topic, m, format!("key schema id {id} cannot be read: {why}")))?;
        let mut run = Run { decoder: &mut decoder, batch_size: 1, flushed: 0, out: Vec::new() };
        run.message(0, &[bytes]).map_err(|why| refused(topic, m, format!("Avro key of schema id {id}: {why}")))?;
        run.flush().map_err(|why| refused(topic, m, format!("Avro key of schema id {id}: {why}")))?;
        let key = run.out.pop().ok_or_else(|| refused(topic, m, format!("Avro key of schema id {id}: no row")))?;
        let columns = key
            .columns()
            .iter()
            .map(|c| {
                let t = table_type(c.data_type());
                if &t == c.data_type() { Ok(c.clone()) } else { arrow_cast::cast(c, &t) }
            })
            .collect::<Result<Vec<_>, _>>()
            .and_then(|cs| RecordBatch::try_new(table_schema(&key.schema()), cs))
            .map_err(|e| refused(topic, m, format!("Avro key of schema id {id}: {e}")))?;
        Ok(columns)
    }

    /// Each message's value (a tombstone is refused), with the schema id
    /// its wire-format header names.
    fn framed<'m>(&self, topic: &str, messages: &'m [Message]) -> Result<Vec<Framed<'m>>, SourceError> {
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            let value = m.value.as_deref().ok_or_else(|| refused(topic, m, "a message with no value (a tombstone)"))?;
            let id = match self.framing {
                Framing::Bare => None,
                Framing::Registry(_) => Some(wire_id(value).map_err(|why| refused(topic, m, why))?),
            };
            out.push((id, value));
        }
        Ok(out)
    }

    /// A decoder that knows every writer id of `values`, fetching the ones
    /// not met before.
    fn decoder_for(
        &self,
        topic: &str,
        messages: &[Message],
        values: &[Framed<'_>],
    ) -> Result<(u64, Decoder), SourceError> {
        let poisoned = || SourceError::Internal("kafka: the Avro decoder state is poisoned".into());
        let mut state = self.state.lock().map_err(|_| poisoned())?;
        if let Framing::Registry(registry) = &self.framing {
            for (m, (id, _)) in messages.iter().zip(values) {
                let Some(id) = *id else { continue };
                if state.writers.contains_key(&id) {
                    continue;
                }
                let writer = registry.schema_by_id(id).map_err(|e| match e {
                    Fetch::Missing(why) => refused(topic, m, format!("schema id {id}: {why}")),
                    Fetch::Failed(source) => SourceError::Registry {
                        context: format!(
                            "topic {topic:?} partition {} offset {}: cannot fetch schema id {id}",
                            m.partition, m.offset
                        ),
                        source,
                    },
                })?;
                // Resolvable to the reader, alone: else the id is at fault.
                build_decoder(&self.reader, 1, [(&id, &writer)]).map_err(|why| {
                    refused(
                        topic,
                        m,
                        format!("writer schema id {id} does not resolve to the table's reader schema: {why}"),
                    )
                })?;
                tracing::info!(topic, schema_id = id, "kafka: a new Avro writer schema from the registry");
                state.writers.insert(id, writer);
                state.generation += 1;
            }
        }
        let generation = state.generation;
        state.idle.retain(|(g, _)| *g == generation);
        if let Some((g, d)) = state.idle.pop() {
            return Ok((g, d));
        }
        if state.writers.is_empty() {
            return Err(SourceError::Internal(format!("kafka: topic {topic:?}: no Avro writer schema is known")));
        }
        let decoder =
            build_decoder(&self.reader, self.batch_size, &state.writers).map_err(|e| SourceError::AvroSchema {
                from: format!("topic {topic:?}"),
                message: format!("the writer schemas met so far make no Avro decoder together: {e}"),
            })?;
        Ok((generation, decoder))
    }

    /// A decoded batch with the table's types and no Avro metadata.
    fn conform(&self, batch: &RecordBatch) -> Result<RecordBatch, arrow_schema::ArrowError> {
        let columns: Vec<ArrayRef> = batch
            .columns()
            .iter()
            .zip(self.table.fields())
            .map(
                |(c, f)| {
                    if c.data_type() == f.data_type() { Ok(c.clone()) } else { arrow_cast::cast(c, f.data_type()) }
                },
            )
            .collect::<Result<_, _>>()?;
        RecordBatch::try_new(self.table.clone(), columns)
    }
}

/// The schema id of a Confluent wire-format value.
fn wire_id(value: &[u8]) -> Result<u32, String> {
    match value {
        [MAGIC, a, b, c, d, ..] => Ok(u32::from_be_bytes([*a, *b, *c, *d])),
        [MAGIC, ..] => Err(format!(
            "{} bytes, shorter than the Schema Registry wire format's 5-byte header (magic byte 0, schema id)",
            value.len()
        )),
        [first, ..] => Err(format!(
            "its first byte is 0x{first:02x}, not the Schema Registry wire format's magic byte 0x00 (schema_registry \
             is set, so every message must carry a schema id)"
        )),
        [] => Err("an empty value, not the Schema Registry wire format".into()),
    }
}

/// A message's value, with the schema id its wire-format header names.
type Framed<'m> = (Option<u32>, &'m [u8]);

/// One batch's decoding: the decoder, and the rows it flushed so far.
struct Run<'d> {
    decoder: &'d mut Decoder,
    batch_size: usize,
    flushed: usize,
    out: Vec<RecordBatch>,
}

impl Run<'_> {
    /// Rows decoded so far (exact only when the decoder is not full; see `flush_if_full`).
    fn rows(&self) -> usize {
        self.flushed + (self.batch_size - self.decoder.capacity())
    }

    fn flush(&mut self) -> Result<(), String> {
        if let Some(b) = self.decoder.flush().map_err(|e| e.to_string())? {
            self.flushed += b.num_rows();
            self.out.push(b);
        }
        Ok(())
    }

    /// A full decoder (the batch size reached, or a new writer id met
    /// mid-batch, which arrow-avro marks so) is flushed before anything
    /// else is read from it.
    fn flush_if_full(&mut self) -> Result<(), String> {
        if self.decoder.batch_is_full() { self.flush() } else { Ok(()) }
    }

    /// Feeds message `i` (its pieces in order); it must end exactly at
    /// the end of one datum, row `i`.
    fn message(&mut self, i: usize, pieces: &[&[u8]]) -> Result<(), String> {
        for piece in pieces {
            let mut rest = *piece;
            while !rest.is_empty() {
                self.flush_if_full()?;
                if self.rows() > i {
                    return Err(format!("{} bytes follow the datum (not of this schema?)", rest.len()));
                }
                match self.decoder.decode(rest) {
                    Ok(0) => break,
                    Ok(n) => rest = &rest[n..],
                    Err(e) => {
                        self.flush_if_full()?;
                        return Err(if self.rows() > i {
                            "bytes follow the datum (not of this schema?)".to_string()
                        } else {
                            e.to_string()
                        });
                    }
                }
            }
            if !rest.is_empty() {
                return Err(format!(
                    "the datum ends early: {} bytes do not make a whole row (truncated, or not of this schema)",
                    rest.len()
                ));
            }
        }
        self.flush_if_full()?;
        if self.rows() != i + 1 {
            return Err("the message ends before its datum does (truncated, or not of this schema)".into());
        }
        Ok(())
    }
}

/// The table's type of a decoded Avro column (see the module's invariants).
fn table_type(t: &DataType) -> DataType {
    match t {
        DataType::Timestamp(unit, tz) => {
            let unit = if *unit == TimeUnit::Nanosecond { TimeUnit::Nanosecond } else { TimeUnit::Microsecond };
            DataType::Timestamp(unit, tz.as_ref().map(|_| "UTC".into()))
        }
        DataType::Time32(_) => DataType::Time64(TimeUnit::Microsecond),
        DataType::Dictionary(_, v) if matches!(**v, DataType::Utf8) => DataType::Utf8,
        DataType::Utf8View => DataType::Utf8,
        DataType::Struct(fields) => DataType::Struct(table_fields(fields)),
        DataType::List(f) => DataType::List(Arc::new(table_field(f))),
        DataType::LargeList(f) => DataType::LargeList(Arc::new(table_field(f))),
        DataType::FixedSizeList(f, n) => DataType::FixedSizeList(Arc::new(table_field(f)), *n),
        DataType::Map(f, sorted) => DataType::Map(Arc::new(table_field(f)), *sorted),
        other => other.clone(),
    }
}

fn table_field(f: &Field) -> Field {
    Field::new(f.name(), table_type(f.data_type()), f.is_nullable())
}

fn table_fields(fields: &Fields) -> Fields {
    fields.iter().map(|f| table_field(f)).collect()
}

/// The table schema of a decoder's output schema.
fn table_schema(decoded: &Schema) -> SchemaRef {
    Arc::new(Schema::new(table_fields(decoded.fields())))
}

/// Why a schema was not had from the registry.
enum Fetch {
    /// The registry has no such Avro schema (it answered 404, or the
    /// schema is of another type): whoever named it is at fault.
    Missing(String),
    /// The registry could not be asked, failed, or answered nonsense.
    Failed(RegistryError),
}

/// What went wrong with a Schema Registry request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegistryFault {
    /// The registry answered this HTTP status (not a success).
    Status(u16),
    /// No answer: the registry could not be reached, or did not answer in time.
    Unreachable,
    /// A success whose body is not what the registry's API says.
    Malformed,
    /// This host could not make an HTTP client (its TLS setup) or run the
    /// request (its I/O runtime).
    Client,
}

/// A Schema Registry request that failed: the request's URL, what went
/// wrong, and the registry's own words.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RegistryError {
    /// The request's URL.
    pub url: String,
    pub fault: RegistryFault,
    /// Says what was asked, of which registry, and its answer.
    pub message: String,
}

impl sluice_core::error::Kind for RegistryError {
    /// A registry that cannot be reached, times out, is overloaded or fails
    /// (5xx, 408, 429) may answer later; one that refuses the credentials
    /// or has no such subject (401, 403, 404) needs the job changed; any
    /// other answer is fatal.
    fn kind(&self) -> ErrorKind {
        match self.fault {
            RegistryFault::Unreachable => ErrorKind::Retryable,
            RegistryFault::Status(s) if s >= 500 || s == 408 || s == 429 => ErrorKind::Retryable,
            RegistryFault::Status(401 | 403 | 404) => ErrorKind::Config,
            RegistryFault::Status(_) | RegistryFault::Malformed | RegistryFault::Client => ErrorKind::Fatal,
        }
    }
}

/// A Confluent Schema Registry client: the few GETs Sluice needs.
struct Registry {
    base: String,
    http: reqwest::Client,
}

impl Registry {
    fn new(url: &str) -> Result<Self, SourceError> {
        let http = reqwest::Client::builder().timeout(REGISTRY_TIMEOUT).build().map_err(|e| SourceError::Registry {
            context: format!("schema registry {url}"),
            source: RegistryError {
                url: url.to_string(),
                fault: RegistryFault::Client,
                message: format!("cannot make a client: {}", sluice_core::chain(&e)),
            },
        })?;
        Ok(Self { base: url.trim_end_matches('/').to_string(), http })
    }

    /// `GET {base}{path}`: the status and body. The request runs on the
    /// host's I/O runtime from a thread of its own, so that it blocks no
    /// runtime thread whatever thread calls it.
    fn get(&self, path: &str) -> Result<(reqwest::StatusCode, String), RegistryError> {
        let url = format!("{}{path}", self.base);
        let request = self
            .http
            .get(&url)
            .header(reqwest::header::ACCEPT, "application/vnd.schemaregistry.v1+json, application/json");
        let call = async move {
            let response = request.send().await?;
            let status = response.status();
            Ok::<_, reqwest::Error>((status, response.text().await?))
        };
        let failed =
            |fault, why: String| RegistryError { url: url.clone(), fault, message: format!("GET {url}: {why}") };
        match sluice_core::runtime::wait(call) {
            Err(e) => Err(failed(RegistryFault::Client, e.to_string())),
            Ok(Err(e)) => {
                let fault = match e.status() {
                    Some(status) => RegistryFault::Status(status.as_u16()),
                    None if e.is_timeout() || e.is_connect() || e.is_request() => RegistryFault::Unreachable,
                    // The body could not be read or decoded as text.
                    None => RegistryFault::Malformed,
                };
                Err(failed(fault, sluice_core::chain(&e)))
            }
            Ok(Ok(answer)) => Ok(answer),
        }
    }

    /// A response's JSON object; an error answer's `message`.
    fn json(&self, path: &str) -> Result<serde_json::Value, Fetch> {
        let (status, body) = self.get(path).map_err(Fetch::Failed)?;
        let value: Option<serde_json::Value> = serde_json::from_str(&body).ok();
        let url = format!("{}{path}", self.base);
        if status.is_success() {
            return value.ok_or_else(|| {
                Fetch::Failed(RegistryError {
                    message: format!("GET {url}: the answer is not JSON"),
                    url,
                    fault: RegistryFault::Malformed,
                })
            });
        }
        let message = value
            .as_ref()
            .and_then(|v| Some(format!("{} (error_code {})", v.get("message")?.as_str()?, v.get("error_code")?)))
            .unwrap_or(body);
        let why = format!("the registry at {} answered {status} to GET {path}: {message}", self.base);
        if status == reqwest::StatusCode::NOT_FOUND {
            Err(Fetch::Missing(why))
        } else {
            Err(Fetch::Failed(RegistryError { url, fault: RegistryFault::Status(status.as_u16()), message: why }))
        }
    }

    /// The Avro schema text of a response holding `schema` (and maybe `schemaType`).
    fn schema_of(&self, path: &str, value: &serde_json::Value) -> Result<String, Fetch> {
        match value.get("schemaType").and_then(|t| t.as_str()) {
            None | Some("AVRO") => {}
            Some(other) => {
                return Err(Fetch::Missing(format!("GET {path}: a {other} schema, not Avro")));
            }
        }
        match value.get("schema").and_then(|s| s.as_str()) {
            Some(s) => Ok(s.to_string()),
            None => {
                let url = format!("{}{path}", self.base);
                Err(Fetch::Failed(RegistryError {
                    message: format!("GET {url}: the answer holds no \"schema\" string"),
                    url,
                    fault: RegistryFault::Malformed,
                }))
            }
        }
    }

    /// `GET /schemas/ids/{id}`.
    fn schema_by_id(&self, id: u32) -> Result<AvroSchema, Fetch> {
        let path = format!("/schemas/ids/{id}");
        let value = self.json(&path)?;
        Ok(AvroSchema::new(self.schema_of(&path, &value)?))
    }

    /// The reader schema of a source with no `avro_schema`: the latest
    /// version of each listed topic's `{topic}-value`, which must be one
    /// schema; and where it came from.
    fn latest_of(&self, topics: &Topics) -> Result<(String, String), SourceError> {
        let no_schema = |message: String| SourceError::Config { key: "source.avro_schema".into(), message };
        let Topics::List(list) = topics else {
            return Err(no_schema(
                "kafka: with topic_pattern, give avro_schema: the table's columns cannot come from the registry \
                 subjects of topics not known yet"
                    .into(),
            ));
        };
        let mut found: Option<(String, serde_json::Value, String)> = None;
        for topic in list {
            let subject = format!("{topic}-value");
            let path = format!("/subjects/{subject}/versions/latest");
            let context = format!(
                "topic {topic:?}: no reader schema: the job gives no avro_schema, and the registry's latest version \
                 of subject {subject:?} cannot be had"
            );
            let value = self.json(&path).map_err(|e| match e {
                Fetch::Missing(why) => no_schema(format!("kafka: {context}: {why}")),
                Fetch::Failed(source) => SourceError::Registry { context: context.clone(), source },
            })?;
            let text = self.schema_of(&path, &value).map_err(|e| match e {
                Fetch::Missing(why) => no_schema(format!("kafka: topic {topic:?}: {why}")),
                Fetch::Failed(source) => SourceError::Registry { context: format!("topic {topic:?}"), source },
            })?;
            let parsed: serde_json::Value = serde_json::from_str(&text).map_err(|e| SourceError::AvroSchema {
                from: format!("the registry's latest of {subject:?}"),
                message: format!("is not JSON: {e}"),
            })?;
            let version = value.get("version").map(|v| v.to_string()).unwrap_or_else(|| "?".into());
            let id = value.get("id").map(|v| v.to_string()).unwrap_or_else(|| "?".into());
            let from = format!("the registry's latest of {subject:?} (version {version}, id {id})");
            match &found {
                None => found = Some((text, parsed, from)),
                Some((_, first, first_from)) if *first != parsed => {
                    return Err(no_schema(format!(
                        "kafka: {first_from} and {from} differ; the topics of one source land with one table \
                         schema, so give avro_schema"
                    )));
                }
                Some(_) => {}
            }
        }
        found
            .map(|(text, _, from)| (text, from))
            .ok_or_else(|| no_schema("kafka: an Avro source with a registry lists no topic".into()))
    }
}

#[cfg(test)]
mod tests {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Int64Type, TimestampMicrosecondType};

    use super::*;

    const V1: &str = r#"{"type":"record","name":"Order","fields":[
        {"name":"id","type":"long"},
        {"name":"name","type":["null","string"]},
        {"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}}]}"#;
    /// V1 and a field added with a default.
    const V2: &str = r#"{"type":"record","name":"Order","fields":[
        {"name":"id","type":"long"},
        {"name":"name","type":["null","string"]},
        {"name":"at","type":{"type":"long","logicalType":"timestamp-millis"}},
        {"name":"region","type":"string","default":"eu"}]}"#;

    fn long(out: &mut Vec<u8>, n: i64) {
        let mut z = ((n << 1) ^ (n >> 63)) as u64;
        while z >= 0x80 {
            out.push((z as u8 & 0x7f) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
    }

    fn string(out: &mut Vec<u8>, s: &str) {
        long(out, s.len() as i64);
        out.extend_from_slice(s.as_bytes());
    }

    /// A V1 datum (V2's with `region`).
    fn datum(id: i64, name: Option<&str>, region: Option<&str>) -> Vec<u8> {
        let mut out = Vec::new();
        long(&mut out, id);
        match name {
            None => long(&mut out, 0),
            Some(n) => {
                long(&mut out, 1);
                string(&mut out, n);
            }
        }
        long(&mut out, 1_700_000_000_000 + id);
        if let Some(r) = region {
            string(&mut out, r);
        }
        out
    }

    fn framed(id: u32, datum: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(datum);
        out
    }

    fn msg(offset: i64, value: Vec<u8>) -> Message {
        Message { partition: 1, offset, timestamp_ms: None, key: None, value: Some(value), headers: vec![] }
    }

    fn bare(reader: &str, batch_rows: usize) -> AvroCodec {
        AvroCodec::new(reader.into(), "test", Framing::Bare, batch_rows).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A registry codec whose writers are known already (the registry's
    /// address answers nothing: an unknown id fails to fetch).
    fn registry(reader: &str, writers: &[(u32, &str)]) -> AvroCodec {
        let framing = Framing::Registry(Registry::new("http://127.0.0.1:9").unwrap_or_else(|e| panic!("{e}")));
        let codec = AvroCodec::new(reader.into(), "test", framing, 3).unwrap_or_else(|e| panic!("{e}"));
        if let Ok(mut state) = codec.state.lock() {
            for (id, w) in writers {
                state.writers.insert(*id, AvroSchema::new(w.to_string()));
            }
            state.generation += 1;
        }
        codec
    }

    fn error(codec: &AvroCodec, messages: &[Message]) -> String {
        match codec.decode("orders", messages) {
            Ok(b) => panic!("decoded {} rows", b.num_rows()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bare_datums_become_one_batch_in_the_tables_types() {
        let codec = bare(V1, 2);
        let table = codec.table_schema();
        assert_eq!(table.field(0), &Field::new("id", DataType::Int64, false));
        assert_eq!(table.field(1), &Field::new("name", DataType::Utf8, true));
        let ts = DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()));
        assert_eq!(table.field(2), &Field::new("at", ts, false));
        // More messages than the decoder's batch size: still one batch.
        let messages: Vec<Message> = (0..5).map(|i| msg(i, datum(i, (i % 2 == 0).then_some("x"), None))).collect();
        let batch = codec.decode("orders", &messages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.schema(), table);
        let ids: Vec<i64> = batch.column(0).as_primitive::<Int64Type>().values().to_vec();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        assert_eq!(batch.column(1).null_count(), 2);
        let at = batch.column(2).as_primitive::<TimestampMicrosecondType>();
        assert_eq!(at.value(3), (1_700_000_000_000 + 3) * 1000);
        // The decoder is reused for the next batch.
        let again = codec.decode("orders", &messages[..1]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(again.num_rows(), 1);
    }

    #[test]
    fn bad_bare_datums_are_named_by_offset() {
        let codec = bare(V1, 8);
        let mut truncated = datum(5, Some("five"), None);
        truncated.truncate(4);
        let e = error(&codec, &[msg(4, datum(4, None, None)), msg(5, truncated)]);
        assert!(e.contains("partition 1 offset 5") && e.contains("ends early"), "{e}");
        let mut long_one = datum(7, None, None);
        long_one.extend_from_slice(b"junk");
        let e = error(&codec, &[msg(7, long_one)]);
        assert!(e.contains("offset 7") && e.contains("follow the datum"), "{e}");
        let mut tombstone = msg(9, vec![]);
        tombstone.value = None;
        let e = error(&codec, &[tombstone]);
        assert!(e.contains("offset 9") && e.contains("tombstone"), "{e}");
        // A failed batch leaves the codec usable.
        assert_eq!(codec.decode("orders", &[msg(10, datum(10, None, None))]).map(|b| b.num_rows()).ok(), Some(1));
    }

    #[test]
    fn writer_schemas_resolve_to_the_reader_within_one_batch() {
        let codec = registry(V2, &[(1, V1), (2, V2)]);
        let messages = vec![
            msg(0, framed(1, &datum(0, Some("a"), None))),
            msg(1, framed(2, &datum(1, Some("b"), Some("us")))),
            msg(2, framed(1, &datum(2, None, None))),
            msg(3, framed(1, &datum(3, None, None))),
            msg(4, framed(2, &datum(4, None, Some("ap")))),
        ];
        let batch = codec.decode("orders", &messages).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(batch.num_rows(), 5);
        let region: Vec<&str> = batch.column(3).as_string::<i32>().iter().map(|r| r.unwrap_or("?")).collect();
        assert_eq!(region, vec!["eu", "us", "eu", "eu", "ap"]);
        let ids: Vec<i64> = batch.column(0).as_primitive::<Int64Type>().values().to_vec();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn wire_format_faults_name_offset_and_schema_id() {
        let codec = registry(V1, &[(1, V1)]);
        let good = msg(0, framed(1, &datum(0, None, None)));
        let e = error(&codec, &[good.clone(), msg(1, b"{\"id\":1}".to_vec())]);
        assert!(e.contains("partition 1 offset 1") && e.contains("magic byte"), "{e}");
        let e = error(&codec, &[good.clone(), msg(2, framed(77, &datum(2, None, None)))]);
        assert!(e.contains("offset 2") && e.contains("schema id 77"), "{e}");
        let mut truncated = framed(1, &datum(3, Some("three"), None));
        truncated.truncate(8);
        let e = error(&codec, &[good, msg(3, truncated)]);
        assert!(e.contains("offset 3") && e.contains("schema id 1") && e.contains("ends early"), "{e}");
    }

    #[test]
    fn a_writer_that_does_not_resolve_is_refused_when_built() {
        // A reader field with no default that the writer lacks.
        let reader = V2.replace(r#","default":"eu""#, "");
        let e = build_decoder(&AvroSchema::new(reader), 1, [(&1, &AvroSchema::new(V1.into()))])
            .err()
            .unwrap_or_else(|| panic!("resolved"));
        assert!(e.contains("region"), "{e}");
    }

    #[test]
    fn table_types_are_the_ones_iceberg_takes() {
        let ms = DataType::Timestamp(TimeUnit::Millisecond, Some("+00:00".into()));
        assert_eq!(table_type(&ms), DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())));
        let local = DataType::Timestamp(TimeUnit::Millisecond, None);
        assert_eq!(table_type(&local), DataType::Timestamp(TimeUnit::Microsecond, None));
        assert_eq!(table_type(&DataType::Time32(TimeUnit::Millisecond)), DataType::Time64(TimeUnit::Microsecond));
        let e = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
        assert_eq!(table_type(&e), DataType::Utf8);
    }

    /// A registry on a local port that answers every request with
    /// `status` and `body`, for `n` requests.
    fn answering(status: &str, body: &'static str, n: usize) -> String {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let status = status.to_string();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(n) {
                let Ok(mut stream) = stream else { return };
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(k) => request.extend_from_slice(&buf[..k]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes());
            }
        });
        format!("http://{addr}")
    }

    fn failed(fetch: Result<AvroSchema, Fetch>) -> RegistryError {
        match fetch {
            Err(Fetch::Failed(e)) => e,
            Err(Fetch::Missing(why)) => panic!("missing: {why}"),
            Ok(_) => panic!("a schema"),
        }
    }

    #[test]
    fn a_registry_that_may_answer_later_is_retryable_and_one_that_refuses_is_not() {
        use sluice_core::error::Kind;
        let registry = |url: &str| Registry::new(url).unwrap_or_else(|e| panic!("{e}"));
        // Overloaded: 503 is worth another try, and names the request.
        let url = answering("503 Service Unavailable", r#"{"error_code":50301,"message":"busy"}"#, 1);
        let e = failed(registry(&url).schema_by_id(7));
        assert_eq!((e.fault, e.kind()), (RegistryFault::Status(503), ErrorKind::Retryable), "{e}");
        assert!(e.message.contains("/schemas/ids/7") && e.message.contains("busy (error_code 50301)"), "{e}");
        assert_eq!(e.url, format!("{url}/schemas/ids/7"));
        // Credentials refused: the job's to fix.
        let url = answering("401 Unauthorized", r#"{"error_code":401,"message":"no"}"#, 1);
        assert_eq!(failed(registry(&url).schema_by_id(7)).kind(), ErrorKind::Config);
        // A request the registry calls malformed: nothing to retry.
        let url = answering("422 Unprocessable Entity", r#"{"error_code":42201,"message":"bad"}"#, 1);
        assert_eq!(failed(registry(&url).schema_by_id(7)).kind(), ErrorKind::Fatal);
        // A success that is not the API's answer.
        let url = answering("200 OK", "<html>a proxy</html>", 1);
        let e = failed(registry(&url).schema_by_id(7));
        assert_eq!((e.fault, e.kind()), (RegistryFault::Malformed, ErrorKind::Fatal), "{e}");
        // Nobody listens: may answer later.
        let e = failed(registry("http://127.0.0.1:9").schema_by_id(7));
        assert_eq!((e.fault, e.kind()), (RegistryFault::Unreachable, ErrorKind::Retryable), "{e}");
        assert!(e.message.contains("GET http://127.0.0.1:9/schemas/ids/7"), "{e}");
        // An id the registry does not have is the message's fault, not the registry's.
        let url = answering("404 Not Found", r#"{"error_code":40403,"message":"Schema not found"}"#, 1);
        assert!(matches!(registry(&url).schema_by_id(7), Err(Fetch::Missing(w)) if w.contains("Schema not found")));
    }

    #[test]
    fn the_kind_of_a_registry_failure_reaches_the_source_error() {
        use sluice_core::error::Kind;
        let topics = Topics::List(vec!["orders".into()]);
        // No subject for the topic: the job must give avro_schema.
        let url = answering("404 Not Found", r#"{"error_code":40401,"message":"Subject not found"}"#, 1);
        let e = Registry::new(&url).and_then(|r| r.latest_of(&topics)).err().unwrap_or_else(|| panic!("a schema"));
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("source.avro_schema") && e.to_string().contains("Subject not found"), "{e}");
        // The registry failing: a rerun may succeed.
        let url = answering("502 Bad Gateway", "", 1);
        let e = Registry::new(&url).and_then(|r| r.latest_of(&topics)).err().unwrap_or_else(|| panic!("a schema"));
        assert_eq!(e.kind(), ErrorKind::Retryable, "{e}");
        assert!(e.to_string().contains("\"orders-value\"") && e.to_string().contains("502"), "{e}");
        // A message naming an id the registry cannot be asked about fails
        // the read (no dead letter): a rerun may succeed.
        let codec = registry(V1, &[(1, V1)]);
        let e = codec.decode("orders", &[msg(3, framed(5, &datum(3, None, None)))]).err();
        let e = e.unwrap_or_else(|| panic!("decoded"));
        assert!(matches!(e, SourceError::Registry { .. }), "{e}");
        assert_eq!(e.kind(), ErrorKind::Retryable, "{e}");
        assert!(e.to_string().contains("partition 1 offset 3: cannot fetch schema id 5"), "{e}");
    }

    #[test]
    fn a_reader_schema_that_cannot_be_the_tables_is_a_config_error() {
        use sluice_core::error::Kind;
        let e = AvroCodec::new(r#"{"type":"string"}"#.into(), "the job's avro_schema", Framing::Bare, 1)
            .err()
            .unwrap_or_else(|| panic!("a codec"));
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("the job's avro_schema: is not an Avro record schema"), "{e}");
        // A message's own fault is invalid data.
        let e = bare(V1, 2).decode("orders", &[msg(1, vec![0x80])]).err().unwrap_or_else(|| panic!("decoded"));
        assert_eq!(e.kind(), ErrorKind::InvalidData, "{e}");
    }

    #[test]
    fn the_wire_header_is_checked() {
        assert_eq!(wire_id(&[0, 0, 0, 1, 2, 9]), Ok(258));
        assert!(wire_id(&[0, 0, 1]).is_err_and(|e| e.contains("5-byte header")));
        assert!(wire_id(b"{\"id\":1}").is_err_and(|e| e.contains("0x7b")));
    }
}
