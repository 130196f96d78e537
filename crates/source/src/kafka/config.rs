//! `[source] kind = "kafka"`: what the job file says, and what it resolves
//! to ([`KafkaConfig`]) before anything is read.
//!
//! Invariants:
//! - everything a user can get wrong here is refused at load, naming the
//!   key: a column type, a pattern, a start, a secret's variable or file;
//! - secrets are named (an environment variable or a file), never inline,
//!   and a client property that carries one is refused;
//! - the message schema is decided here, once: the declared `columns` for
//!   JSON, the Avro reader schema's record for Avro (the job's, or the
//!   registry's latest of `{topic}-value` at open; writer schemas resolve to
//!   it), the fixed raw columns for `raw`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};

use sluice_capability::config::Secret;

/// `[source]` with `kind = "kafka"`, as written.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KafkaSpec {
    /// Bootstrap brokers, each `host:port` as its own string.
    pub brokers: Vec<String>,
    /// Topics to read; each lands in the table of its name.
    #[serde(default)]
    pub topics: Vec<String>,
    /// Instead of `topics`: every topic whose whole name matches this regular
    /// expression, topics created during the run included.
    pub topic_pattern: Option<String>,
    /// Where a partition with no recorded offset starts: `earliest`,
    /// `latest`, or `timestamp` (with `start_timestamp_ms`). Partitions that
    /// appear during a run start at their beginning.
    #[serde(default)]
    pub start: StartAt,
    /// For `start = "timestamp"`: milliseconds since the Unix epoch.
    pub start_timestamp_ms: Option<i64>,
    /// How messages become rows.
    pub format: MessageFormat,
    /// The change key: the columns that name a row. With it the source is
    /// a change stream: each message is a change of the target's row with
    /// the same key (Debezium's op, or an upsert for `json` and `avro`),
    /// applied in partition order, its position the message's offset. A
    /// message whose key column is missing or null is a bad row
    /// (`job.bad_rows`). Needed by `debezium-json` and `debezium-avro`;
    /// not taken by `raw`. The message key must be the change key (JSON,
    /// with or without the converter's schema, or Avro through
    /// `schema_registry`; exactly these columns, the row's values), so that
    /// the producer's default partitioner keeps each key's changes in one
    /// partition, in order; a message whose key is missing, null or another
    /// is a bad row. Adding partitions to a topic breaks this: a key's
    /// later changes may land in another partition and apply out of order.
    /// An upsert replaces the whole row, so the source must send full row
    /// images (Postgres `REPLICA IDENTITY FULL`, MySQL
    /// `binlog_row_image = FULL`): a Debezium `after` value
    /// `__debezium_unavailable_value` is a bad row.
    #[serde(default)]
    pub key: Option<crate::config::Columns>,
    /// The columns of a JSON message (and the table). Without them, each
    /// listed topic's table must exist in the sink's catalog, and its
    /// columns are the message's.
    #[serde(default)]
    pub columns: Vec<ColumnSpec>,
    /// The Avro schema (JSON text; or `avro_schema_file`): the table's
    /// columns. Without a registry, messages are bare datums of it; with
    /// one, the writer schemas the messages name resolve to it.
    pub avro_schema: Option<String>,
    /// A file holding the Avro schema (relative to the job file), instead
    /// of `avro_schema`.
    pub avro_schema_file: Option<PathBuf>,
    /// A Confluent Schema Registry: messages carry the registry's wire format
    /// (magic byte 0, a 4-byte schema id). With no `avro_schema`, the table's
    /// columns come from the latest version of `{topic}-value`.
    pub schema_registry: Option<String>,
    /// After each committed checkpoint its offsets are committed to this
    /// consumer group too, for lag tooling. The checkpoint stays the truth.
    pub group_id: Option<String>,
    /// Read up to the end offsets seen at start, then end (a backfill).
    #[serde(default)]
    pub bounded: bool,
    /// Rows per batch a subtask hands the sink (at most 10,000,000).
    #[serde(default = "default_batch_rows")]
    pub batch_rows: usize,
    /// How often new partitions (and, with `topic_pattern`, new topics) are
    /// looked for, in seconds (0.1 to 3600); they are read from the next
    /// checkpoint on.
    #[serde(default = "default_discover_secs")]
    pub discover_secs: f64,
    #[serde(default)]
    pub security: SecuritySpec,
    /// More librdkafka client properties (see its CONFIGURATION.md).
    /// Properties that carry secrets are refused here: use `security`.
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
}

fn default_batch_rows() -> usize {
    8192
}
/// The range of `source.discover_secs`.
const DISCOVER_SECS: (f64, f64) = (0.1, 3600.0);

fn default_discover_secs() -> f64 {
    5.0
}

/// Where a partition with no recorded offset starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum StartAt {
    /// At its first message.
    #[default]
    Earliest,
    /// After its last message when the run starts.
    Latest,
    /// At the first message at or after `start_timestamp_ms`.
    Timestamp,
}

/// How a Kafka message becomes a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum MessageFormat {
    /// A JSON object per message, read against `columns` (or the table's columns).
    Json,
    /// Avro: bare datums of `avro_schema`, or the Schema Registry's wire format.
    Avro,
    /// The message as it is: partition, offset, timestamp, key, value and headers.
    Raw,
    /// Debezium change events from its JSON converter, with or without
    /// schemas (`{"schema", "payload"}`): op `c`, `r`, `u` upserts the
    /// `after` row, `d` deletes the `before` row (or the message key's),
    /// and a tombstone (no value) deletes the message key's row (a JSON
    /// key). `source`, `ts_ms` and `transaction` never land. The rows are
    /// read against `columns` (or the table's columns) as `json` reads
    /// them, every column outside `key` nullable; `key` is needed. Any other
    /// op (`t`, `m`), an upsert with no `after` or a key column missing is
    /// a bad row (`job.bad_rows`).
    #[serde(rename = "debezium-json")]
    DebeziumJson,
    /// Debezium change events from its Avro converter: the envelope record
    /// (`before`, `after`, `op`, `source`, `ts_ms`), bare datums of
    /// `avro_schema` or through `schema_registry` (the envelope is then the
    /// latest of `{topic}-value` unless `avro_schema` gives it); the table's
    /// columns are the `after` record's. The same rules as
    /// `debezium-json`; a tombstone's key is JSON or Avro in the registry's
    /// wire format.
    #[serde(rename = "debezium-avro")]
    DebeziumAvro,
}

impl MessageFormat {
    /// Debezium's envelope: each message a change event.
    pub fn is_debezium(self) -> bool {
        matches!(self, MessageFormat::DebeziumJson | MessageFormat::DebeziumAvro)
    }
}

/// One declared column.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ColumnSpec {
    /// The column's name, unique in `columns`.
    pub name: String,
    /// `boolean`, `int`, `long`, `float`, `double`, `string`, `binary`,
    /// `date`, `timestamp` (UTC, microseconds), `timestamp_ntz`, or
    /// `decimal(P,S)`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Whether the column may be null (or absent from a message).
    #[serde(default = "yes")]
    pub nullable: bool,
}

fn yes() -> bool {
    true
}

/// TLS and SASL, as librdkafka names them.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SecuritySpec {
    /// `plaintext` (default), `ssl`, `sasl_plaintext` or `sasl_ssl`.
    pub protocol: Option<String>,
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512`.
    pub sasl_mechanism: Option<String>,
    /// The SASL user name, written inline (or `username_env`).
    pub username: Option<String>,
    /// The environment variable holding the SASL user name (or `username`).
    pub username_env: Option<String>,
    /// The environment variable holding the SASL password (or `password_file`).
    pub password_env: Option<String>,
    /// A file holding the SASL password, relative to the job file (or `password_env`).
    pub password_file: Option<PathBuf>,
    /// CA certificates (PEM) to verify the brokers with.
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM) for mutual TLS, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's private key (PEM), with `cert_file`.
    pub key_file: Option<PathBuf>,
    /// The environment variable holding the private key's password, if it has one.
    pub key_password_env: Option<String>,
}

/// Which topics: a list, or a pattern.
#[derive(Debug, Clone)]
pub enum Topics {
    List(Vec<String>),
    Pattern(regex::Regex),
}

impl Topics {
    pub fn matches(&self, topic: &str) -> bool {
        match self {
            Topics::List(list) => list.iter().any(|t| t == topic),
            Topics::Pattern(re) => re.is_match(topic),
        }
    }

    /// As the checkpoint records it.
    pub fn describe(&self) -> String {
        match self {
            Topics::List(list) => list.join(","),
            Topics::Pattern(re) => format!("/{}/", re.as_str()),
        }
    }
}

/// How messages become rows.
#[derive(Debug, Clone)]
pub enum Decoding {
    Json(SchemaRef),
    /// JSON against the target table's columns: no `columns` are given, so
    /// the source loads its listed topics' tables from the sink's catalog
    /// when it opens (`source::Source::of_config`), and refuses to start
    /// when a table is missing or two of them differ.
    JsonOfTable,
    /// The reader schema (JSON text) when the job gives it, and the
    /// registry when messages name their writer schemas; the table's
    /// columns come from the reader schema (the registry's latest, when
    /// none is given) at open.
    Avro {
        schema: Option<String>,
        registry: Option<String>,
    },
    Raw,
}

/// The columns of `format = "raw"`.
pub fn raw_schema() -> SchemaRef {
    let header = DataType::Struct(
        vec![Field::new("key", DataType::Utf8, false), Field::new("value", DataType::Binary, true)].into(),
    );
    Arc::new(Schema::new(vec![
        Field::new("partition", DataType::Int32, false),
        Field::new("offset", DataType::Int64, false),
        Field::new("timestamp", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
        Field::new("key", DataType::Binary, true),
        Field::new("value", DataType::Binary, true),
        Field::new("headers", DataType::List(Arc::new(Field::new("item", header, true))), true),
    ]))
}

/// The source resolved: what the Kafka source opens with.
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topics: Topics,
    pub start: StartAt,
    pub start_timestamp_ms: Option<i64>,
    pub format: MessageFormat,
    /// The change key (`source.key`): empty unless the source is a change stream.
    pub key: Vec<String>,
    pub columns: Vec<ColumnSpec>,
    pub decoding: Decoding,
    pub group_id: Option<String>,
    pub bounded: bool,
    pub batch_rows: usize,
    pub discover_every: std::time::Duration,
    /// librdkafka properties for every client (security included).
    pub client: Vec<(String, ClientValue)>,
}

impl KafkaConfig {
    /// The one topic of a source that lists exactly one: its rows are the
    /// source's one (unnamed) table.
    pub fn single_topic(&self) -> Option<&str> {
        match &self.topics {
            Topics::List(list) if list.len() == 1 => Some(&list[0]),
            _ => None,
        }
    }
}

/// A client property's value; a secret one never shows in `Debug`.
#[derive(Debug, Clone)]
pub enum ClientValue {
    Plain(String),
    Secret(Secret),
}

impl ClientValue {
    pub fn expose(&self) -> &str {
        match self {
            ClientValue::Plain(s) => s,
            ClientValue::Secret(s) => s.expose(),
        }
    }
}

/// Properties the host sets itself, or that would carry a secret inline.
const RESERVED_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "group.id",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.offset.reset",
    "enable.partition.eof",
    "isolation.level",
];

fn secret_property(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("password") || n.contains("secret") || n.contains("sasl.oauthbearer.config") || n.ends_with(".pem")
}

/// Parses a declared column type.
pub fn column_type(kind: &str) -> Result<DataType, String> {
    let k = kind.trim().to_ascii_lowercase();
    Ok(match k.as_str() {
        "boolean" | "bool" => DataType::Boolean,
        "int" | "int32" | "integer" => DataType::Int32,
        "long" | "int64" | "bigint" => DataType::Int64,
        "float" | "float32" => DataType::Float32,
        "double" | "float64" => DataType::Float64,
        "string" | "utf8" => DataType::Utf8,
        "binary" | "bytes" => DataType::Binary,
        "date" => DataType::Date32,
        "timestamp" | "timestamptz" => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
        "timestamp_ntz" => DataType::Timestamp(TimeUnit::Microsecond, None),
        _ => {
            let inner = k.strip_prefix("decimal(").and_then(|r| r.strip_suffix(')')).ok_or_else(|| {
                format!(
                    "{kind:?} is not a column type (boolean, int, long, float, double, string, binary, date, \
                     timestamp, timestamp_ntz, decimal(P,S))"
                )
            })?;
            let (p, s) = inner.split_once(',').ok_or_else(|| format!("{kind:?}: write decimal(P,S)"))?;
            let p: u8 = p.trim().parse().map_err(|_| format!("{kind:?}: the precision is not a number"))?;
            let s: i8 = s.trim().parse().map_err(|_| format!("{kind:?}: the scale is not a number"))?;
            if !(1..=38).contains(&p) || s < 0 || s as u8 > p {
                return Err(format!("{kind:?}: precision must be 1 to 38 and scale 0 to the precision"));
            }
            DataType::Decimal128(p, s)
        }
    })
}

/// The arrow schema of declared columns.
pub fn columns_schema(columns: &[ColumnSpec]) -> Result<SchemaRef, (usize, String)> {
    let mut fields = Vec::with_capacity(columns.len());
    let mut names = std::collections::BTreeSet::new();
    for (i, c) in columns.iter().enumerate() {
        if c.name.is_empty() || !names.insert(c.name.as_str()) {
            return Err((i, format!("{:?}: column names must be unique and not empty", c.name)));
        }
        fields.push(Field::new(&c.name, column_type(&c.kind).map_err(|m| (i, m))?, c.nullable));
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// What `resolve` needs of the job: key errors, secrets, files.
pub trait Resolver {
    /// The loader's error, naming the job file and the key.
    type Error;
    fn invalid(&self, key: &str, message: String) -> Self::Error;
    fn read_file(&self, key: &str, path: &std::path::Path) -> Result<String, Self::Error>;
    /// Whether the sink has a catalog (`[sink.catalog]`) its tables can be loaded from.
    fn sink_catalog(&self) -> bool;
}

impl KafkaSpec {
    /// Checks every key and resolves secrets and schemas.
    pub fn resolve<R: Resolver + ?Sized>(&self, r: &R) -> Result<KafkaConfig, R::Error> {
        let bad = |key: &str, m: String| r.invalid(&format!("source.{key}"), m);
        if self.brokers.is_empty() || self.brokers.iter().any(|b| b.trim().is_empty() || b.contains(',')) {
            return Err(bad("brokers", "list one or more brokers as \"host:port\", each its own string".into()));
        }
        let topics = match (&self.topics[..], &self.topic_pattern) {
            ([], None) => return Err(bad("topics", "name the topics to read (or set topic_pattern)".into())),
            ([_, ..], Some(_)) => return Err(bad("topic_pattern", "set either topics or topic_pattern".into())),
            (list, None) => {
                let mut seen = std::collections::BTreeSet::new();
                for t in list {
                    if !valid_topic(t) || !seen.insert(t) {
                        return Err(bad(
                            "topics",
                            format!(
                                "{t:?}: a topic name is 1 to 249 of letters, digits, '.', '_' and '-', each listed once"
                            ),
                        ));
                    }
                }
                Topics::List(list.to_vec())
            }
            ([], Some(p)) => {
                let whole = format!("^(?:{p})$");
                Topics::Pattern(
                    regex::Regex::new(&whole)
                        .map_err(|e| bad("topic_pattern", format!("{p:?} is not a pattern: {e}")))?,
                )
            }
        };
        match (self.start, self.start_timestamp_ms) {
            (StartAt::Timestamp, None) => {
                return Err(bad("start_timestamp_ms", "start = \"timestamp\" needs start_timestamp_ms".into()));
            }
            (StartAt::Timestamp, Some(ts)) if ts < 0 => {
                return Err(bad("start_timestamp_ms", "must be milliseconds since the Unix epoch".into()));
            }
            (StartAt::Earliest | StartAt::Latest, Some(_)) => {
                return Err(bad("start_timestamp_ms", "goes with start = \"timestamp\"".into()));
            }
            _ => {}
        }
        let decoding = self.decoding(r)?;
        self.check_key(r)?;
        if self.batch_rows == 0 {
            return Err(bad("batch_rows", "must be at least 1".into()));
        }
        let discover_every =
            sluice_core::duration::seconds(self.discover_secs, DISCOVER_SECS).map_err(|m| bad("discover_secs", m))?;
        if let Some(g) = &self.group_id
            && g.trim().is_empty()
        {
            return Err(bad("group_id", "must not be empty".into()));
        }
        let mut client = Vec::new();
        for (name, value) in &self.properties {
            if RESERVED_PROPERTIES.contains(&name.as_str()) {
                return Err(bad(
                    &format!("properties.{name}"),
                    "is set by Sluice itself (offsets live in the checkpoint); use the source's own keys".into(),
                ));
            }
            if secret_property(name)
                || name.starts_with("sasl.")
                || name.starts_with("ssl.")
                || name == "security.protocol"
            {
                return Err(bad(
                    &format!("properties.{name}"),
                    "set TLS and SASL in [source.security], where secrets are named by variable or file".into(),
                ));
            }
            client.push((name.clone(), ClientValue::Plain(value.clone())));
        }
        client.extend(self.security.resolve(r)?);
        Ok(KafkaConfig {
            brokers: self.brokers.join(","),
            topics,
            start: self.start,
            start_timestamp_ms: self.start_timestamp_ms,
            format: self.format,
            key: self.key_names().to_vec(),
            columns: self.columns.clone(),
            decoding,
            group_id: self.group_id.clone(),
            bounded: self.bounded,
            batch_rows: self.batch_rows,
            discover_every,
            client,
        })
    }

    /// `key`: needed by the Debezium formats, refused by `raw`, each column
    /// once, and among the declared columns when they are declared (else
    /// checked against the rows' columns when the source opens).
    /// The change key's columns (none: not a change stream).
    pub fn key_names(&self) -> &[String] {
        self.key.as_ref().map_or(&[], |k| k.names())
    }

    fn check_key<R: Resolver + ?Sized>(&self, r: &R) -> Result<(), R::Error> {
        let bad = |m: String| r.invalid("source.key", m);
        let format = match self.format {
            MessageFormat::DebeziumJson => "debezium-json",
            MessageFormat::DebeziumAvro => "debezium-avro",
            MessageFormat::Json => "json",
            MessageFormat::Avro => "avro",
            MessageFormat::Raw => "raw",
        };
        if self.key.is_some() && self.key_names().is_empty() {
            return Err(bad("must name at least one column".into()));
        }
        if self.key_names().is_empty() {
            if self.format.is_debezium() {
                return Err(bad(format!(
                    "format = \"{format}\" is a change stream and needs its key's columns, e.g. key = [\"id\"]"
                )));
            }
            return Ok(());
        }
        if self.format == MessageFormat::Raw {
            return Err(bad(
                "format = \"raw\" has fixed columns and no change key: use json, avro or debezium-*".into()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for k in self.key_names() {
            if k.is_empty() || !seen.insert(k) {
                return Err(bad(format!("{k:?}: name each key column once, not empty")));
            }
            if !self.columns.is_empty() && !self.columns.iter().any(|c| &c.name == k) {
                return Err(bad(format!("{k:?} is not one of source.columns")));
            }
        }
        Ok(())
    }

    fn decoding<R: Resolver + ?Sized>(&self, r: &R) -> Result<Decoding, R::Error> {
        let bad = |key: &str, m: String| r.invalid(&format!("source.{key}"), m);
        let declared = |this: &Self| -> Result<Option<SchemaRef>, R::Error> {
            if this.columns.is_empty() {
                return Ok(None);
            }
            columns_schema(&this.columns).map(Some).map_err(|(i, m)| bad(&format!("columns[{i}]"), m))
        };
        match self.format {
            MessageFormat::Json | MessageFormat::DebeziumJson => {
                if self.avro_schema.is_some() || self.avro_schema_file.is_some() || self.schema_registry.is_some() {
                    return Err(bad(
                        "format",
                        "avro_schema and schema_registry go with format = \"avro\" or \"debezium-avro\"".into(),
                    ));
                }
                match declared(self)? {
                    Some(schema) => Ok(Decoding::Json(schema)),
                    None if !r.sink_catalog() => Err(bad(
                        "columns",
                        "format = \"json\" needs the message's columns, e.g. columns = [{ name = \"id\", type = \"long\" }] \
                         (or a [sink.catalog] whose target table gives them)"
                            .into(),
                    )),
                    None if self.topic_pattern.is_some() => Err(bad(
                        "columns",
                        "columns taken from the target table need listed topics (a pattern's tables are not known \
                         before the run): list the topics, or declare the columns"
                            .into(),
                    )),
                    None => Ok(Decoding::JsonOfTable),
                }
            }
            MessageFormat::Raw => {
                if !self.columns.is_empty()
                    || self.avro_schema.is_some()
                    || self.avro_schema_file.is_some()
                    || self.schema_registry.is_some()
                {
                    return Err(bad(
                        "format",
                        "format = \"raw\" has fixed columns (partition, offset, timestamp, key, value, headers)".into(),
                    ));
                }
                Ok(Decoding::Raw)
            }
            MessageFormat::Avro | MessageFormat::DebeziumAvro => {
                if !self.columns.is_empty() {
                    return Err(bad("columns", "an Avro source takes its columns from the Avro schema".into()));
                }
                let schema = match (&self.avro_schema, &self.avro_schema_file) {
                    (Some(_), Some(_)) => {
                        return Err(bad("avro_schema", "set at most one of avro_schema and avro_schema_file".into()));
                    }
                    (Some(s), None) => Some(s.clone()),
                    (None, Some(f)) => Some(r.read_file("source.avro_schema_file", f)?),
                    (None, None) => None,
                };
                if schema.is_none() && self.schema_registry.is_none() {
                    return Err(bad(
                        "avro_schema",
                        "an Avro source needs avro_schema (or _file) or schema_registry".into(),
                    ));
                }
                if schema.is_none() && self.topic_pattern.is_some() {
                    return Err(bad(
                        "avro_schema",
                        "with topic_pattern, give avro_schema: the table's columns cannot come from the registry \
                         subjects of topics not known yet"
                            .into(),
                    ));
                }
                if let Some(url) = &self.schema_registry
                    && !(url.starts_with("http://") || url.starts_with("https://"))
                {
                    return Err(bad("schema_registry", format!("{url:?} is not an http(s) URL")));
                }
                if let Some(text) = &schema
                    && let Err(e) = serde_json::from_str::<serde_json::Value>(text)
                {
                    let key = if self.avro_schema.is_some() { "avro_schema" } else { "avro_schema_file" };
                    return Err(bad(key, format!("is not JSON (an Avro schema is written in JSON): {e}")));
                }
                Ok(Decoding::Avro { schema, registry: self.schema_registry.clone() })
            }
        }
    }
}

impl SecuritySpec {
    fn resolve<R: Resolver + ?Sized>(&self, r: &R) -> Result<Vec<(String, ClientValue)>, R::Error> {
        let bad = |key: &str, m: String| r.invalid(&format!("source.security.{key}"), m);
        let env = |key: &str, var: &str| -> Result<Secret, R::Error> {
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => Ok(Secret::new(v)),
                _ => Err(bad(key, format!("names the environment variable {var}, which is not set (or empty)"))),
            }
        };
        let mut out = Vec::new();
        let protocol = self.protocol.as_deref().unwrap_or("plaintext").to_ascii_lowercase();
        if !["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"].contains(&protocol.as_str()) {
            return Err(bad("protocol", format!("{protocol:?}: one of plaintext, ssl, sasl_plaintext, sasl_ssl")));
        }
        out.push(("security.protocol".to_string(), ClientValue::Plain(protocol.clone())));
        let sasl = protocol.starts_with("sasl");
        let tls = protocol.ends_with("ssl");
        match (&self.sasl_mechanism, sasl) {
            (Some(m), true) => {
                let m = m.to_ascii_uppercase();
                if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&m.as_str()) {
                    return Err(bad("sasl_mechanism", format!("{m:?}: one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512")));
                }
                out.push(("sasl.mechanism".into(), ClientValue::Plain(m)));
                let user = match (&self.username, &self.username_env) {
                    (Some(u), None) => Secret::new(u.clone()),
                    (None, Some(v)) => env("username_env", v)?,
                    _ => return Err(bad("username", "set one of username and username_env".into())),
                };
                out.push(("sasl.username".into(), ClientValue::Secret(user)));
                let password = match (&self.password_env, &self.password_file) {
                    (Some(v), None) => env("password_env", v)?,
                    (None, Some(f)) => {
                        let text = r.read_file("source.security.password_file", f)?;
                        Secret::new(text.trim_end_matches(['\n', '\r']).to_string())
                    }
                    _ => return Err(bad("password_env", "set one of password_env and password_file".into())),
                };
                out.push(("sasl.password".into(), ClientValue::Secret(password)));
            }
            (None, true) => return Err(bad("sasl_mechanism", format!("security.protocol {protocol} needs one"))),
            (Some(_), false) => {
                return Err(bad("sasl_mechanism", format!("goes with a sasl_* protocol, not {protocol}")));
            }
            (None, false) => {
                if self.username.is_some()
                    || self.username_env.is_some()
                    || self.password_env.is_some()
                    || self.password_file.is_some()
                {
                    return Err(bad(
                        "protocol",
                        "a username or password needs protocol sasl_plaintext or sasl_ssl".into(),
                    ));
                }
            }
        }
        let files = [
            ("ca_file", &self.ca_file, "ssl.ca.location"),
            ("cert_file", &self.cert_file, "ssl.certificate.location"),
            ("key_file", &self.key_file, "ssl.key.location"),
        ];
        for (key, file, property) in files {
            if let Some(f) = file {
                if !tls {
                    return Err(bad(key, format!("goes with protocol ssl or sasl_ssl, not {protocol}")));
                }
                // Read now, so that a missing file is refused before anything runs.
                r.read_file(&format!("source.security.{key}"), f)?;
                out.push((property.into(), ClientValue::Plain(f.display().to_string())));
            }
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(bad("cert_file", "cert_file and key_file go together".into()));
        }
        if let Some(v) = &self.key_password_env {
            out.push(("ssl.key.password".into(), ClientValue::Secret(env("key_password_env", v)?)));
        }
        Ok(out)
    }
}

/// Kafka's rule for topic names.
pub fn valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t != "."
        && t != ".."
        && t.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn column_types_parse_and_refuse_by_name() {
        assert_eq!(column_type("long"), Ok(DataType::Int64));
        assert_eq!(column_type("Decimal(10, 2)"), Ok(DataType::Decimal128(10, 2)));
        assert!(column_type("decimal(40,2)").is_err());
        let e = column_type("varchar").unwrap_err();
        assert!(e.contains("\"varchar\" is not a column type"), "{e}");
    }

    #[test]
    fn duplicate_columns_are_refused() {
        let c = |n: &str| ColumnSpec { name: n.into(), kind: "long".into(), nullable: true };
        let e = columns_schema(&[c("a"), c("a")]).unwrap_err();
        assert_eq!(e.0, 1);
    }

    #[test]
    fn topic_names_follow_kafka() {
        assert!(valid_topic("orders.v1_x-2"));
        assert!(!valid_topic("orders/v1"));
        assert!(!valid_topic(".."));
        assert!(!valid_topic(""));
    }

    #[test]
    fn secret_properties_are_recognised() {
        assert!(secret_property("sasl.password"));
        assert!(secret_property("ssl.key.password"));
        assert!(!secret_property("fetch.max.bytes"));
    }
}
