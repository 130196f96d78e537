//! `kafka`: topics read by partition, with the offsets in the checkpoint.
//!
//! Client: rdkafka (librdkafka), the client Flink's and Spark's peers and
//! most Rust services use. Sluice needs, of a client: reads by explicit
//! partition and offset (`assign`, never a group rebalance), watermarks and
//! offsets for a timestamp, consumer-group offset commits for lag tooling,
//! TLS and SASL PLAIN/SCRAM. The pure-Rust clients on crates.io lack group
//! offset commits (rskafka) or SASL (kafka), so the C client is the one that
//! serves all of it; it lives in the host only, never in a plugin.
//!
//! Invariants:
//! - partition `p` of topic `t` belongs to subtask
//!   `(fnv1a32(t) + p) % parallelism` ([`owner`]); the rule's name is in the
//!   checkpoint, so a resume never reads a partition another subtask owned;
//! - a subtask's position holds the next offset to read of every partition
//!   it owns and knows, taken just past the rows it returned; a resume seeks
//!   there, and a recorded offset that the topic no longer holds (deleted by
//!   retention, or a topic made anew) is refused by name before any read;
//! - a partition met with no recorded offset starts where `start` says if
//!   the run started from no checkpoint and the partition existed then, and
//!   at its beginning otherwise (it appeared after the job started);
//! - each topic is a table named after it, except that a source of one
//!   listed topic has one unnamed table;
//! - a message that does not fit its table fails the read, naming its
//!   topic, partition and offset, or with dead letters is handed on as one
//!   beside the batch of the others; either way the position moves past it
//!   only with the batch it came in;
//! - offsets committed to `group_id` follow committed checkpoints only; the
//!   checkpoint stays the truth, and a failed group commit is logged;
//! - the checkpoint records the cluster id the brokers report: offsets are
//!   never taken to another cluster whose topics have the same names.

mod avro;
pub mod config;
mod debezium;
mod decode;
mod reader;

use std::collections::BTreeMap;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow_schema::SchemaRef;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};
use sluice_core::ErrorKind;

use super::{BadRows, SourceChange, SourceError};
use crate::kafka::config::{ColumnSpec, Decoding, KafkaConfig, MessageFormat, StartAt};

pub use avro::{RegistryError, RegistryFault};
pub use reader::KafkaReader;

/// How long a metadata or watermark request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The name of the partition rule, as checkpoints record it.
pub const ASSIGNMENT_RULE: &str = "fnv1a32(topic)+partition mod parallelism";

/// The subtask that owns partition `partition` of `topic`.
pub fn owner(topic: &str, partition: i32, parallelism: u32) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in topic.as_bytes() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(0x0100_0193);
    }
    ((u64::from(h) + partition.max(0) as u64) % u64::from(parallelism.max(1))) as u32
}

/// What a checkpoint records of a Kafka source: a resume must read the
/// same topics, the same way, split by the same rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KafkaIdentity {
    /// The topic list (comma-separated) or `/pattern/`.
    pub topics: String,
    pub format: MessageFormat,
    /// The change key (`source.key`), for a change stream.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub columns: Vec<ColumnSpec>,
    /// The Avro reader schema, compact JSON: the job's `avro_schema`, or
    /// the registry's latest of `{topic}-value` at open when it gives none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub avro_schema: Option<String>,
    pub assignment: String,
    /// The Kafka cluster's id, as its brokers report it: offsets mean
    /// nothing in another cluster whose topics have the same names (a
    /// disaster-recovery cluster, a test cluster made anew).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
}

/// A subtask's position: the next offset of each partition it owns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KafkaPosition {
    /// topic → partition → next offset to read.
    pub offsets: BTreeMap<String, BTreeMap<i32, i64>>,
}

impl KafkaPosition {
    pub fn parse(value: &serde_json::Value) -> Result<Self, SourceError> {
        serde_json::from_value(value.clone()).map_err(|e| SourceError::Position {
            position: value.to_string(),
            message: format!("not a Kafka position: {e}"),
        })
    }
}

/// Consumer lag per partition, as the readers saw it last.
#[derive(Debug, Default)]
pub struct LagBoard {
    /// (topic, partition) → (next offset, high watermark).
    seen: Mutex<BTreeMap<(String, i32), (i64, i64)>>,
}

impl LagBoard {
    pub fn set(&self, topic: &str, partition: i32, next: i64, high: i64) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.insert((topic.to_string(), partition), (next, high));
        }
    }

    /// Lag per partition: `(topic, partition, messages not read yet)`.
    pub fn per_partition(&self) -> Vec<(String, i32, i64)> {
        match self.seen.lock() {
            Ok(seen) => seen.iter().map(|((t, p), (next, high))| (t.clone(), *p, (high - next).max(0))).collect(),
            Err(_) => Vec::new(),
        }
    }

    /// Lag per topic: messages at the broker not read yet.
    pub fn per_topic(&self) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        if let Ok(seen) = self.seen.lock() {
            for ((topic, _), (next, high)) in seen.iter() {
                *out.entry(topic.clone()).or_insert(0) += (high - next).max(0);
            }
        }
        out
    }
}

/// A configured Kafka source.
pub struct KafkaSource {
    config: Arc<KafkaConfig>,
    parallelism: u32,
    schema: SchemaRef,
    decoder: Arc<decode::Codec>,
    /// Metadata requests.
    meta: Mutex<BaseConsumer>,
    /// Group offset commits, on a thread of their own.
    group: Option<Mutex<GroupCommitter>>,
    lag: Arc<LagBoard>,
    /// The cluster id the brokers reported at open, if they report one.
    cluster: Option<String>,
    /// What a message that does not fit its table does (`job.bad_rows`).
    bad_rows: BadRows,
}

/// The base client settings every consumer of the source shares.
fn client(config: &KafkaConfig, group: Option<&str>) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", &config.brokers)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        // A position the topic no longer holds is an error, never a silent jump.
        .set("auto.offset.reset", "error")
        .set("isolation.level", "read_committed")
        .set("allow.auto.create.topics", "false");
    // librdkafka needs a group id to commit offsets; consumers that never
    // commit get one that names them.
    c.set("group.id", group.unwrap_or("sluice-reader"));
    for (k, v) in &config.client {
        c.set(k, v.expose());
    }
    c
}

/// `config` with the columns of its topics' target tables, loaded from the
/// job's catalog ([`Decoding::JsonOfTable`]): each listed topic's table (the
/// sink's `table` option, `{topic}` or `{table}` its name) must exist, and
/// all of them must have the same columns. The catalog is only read: a SQL
/// catalog whose database file does not exist yet holds no table, and is
/// not created.
pub fn with_table_columns(target: &crate::TargetTables, config: &KafkaConfig) -> Result<KafkaConfig, SourceError> {
    use sluice_capability::config::CatalogConfig;
    let refuse = |why: String| SourceError::Config {
        key: "source.columns".into(),
        message: format!(
            "kafka: source.columns are not given, so they come from the target table, but {why}; \
             declare the columns in [source] (or create the table first)"
        ),
    };
    let catalog_config = target.catalog.as_ref().ok_or_else(|| refuse("the sink has no [sink.catalog]".into()))?;
    let crate::kafka::config::Topics::List(topics) = &config.topics else {
        return Err(refuse("the source reads a topic pattern".into()));
    };
    let pattern =
        target.table_pattern.clone().ok_or_else(|| refuse("the sink has no `table` option naming it".into()))?;
    let mut catalog = None;
    let mut found: Option<(String, SchemaRef)> = None;
    for topic in topics {
        let name = if sluice_core::naming::in_pattern_form(&pattern, topic) {
            topic.clone()
        } else {
            pattern.replace("{table}", topic).replace("{topic}", topic)
        };
        if let CatalogConfig::Sql { database, .. } = catalog_config
            && !database.exists()
        {
            return Err(refuse(format!("table {name:?} does not exist (no catalog at {})", database.display())));
        }
        if catalog.is_none() {
            catalog = Some(
                sluice_capability::catalog::CatalogGrant::for_config(catalog_config, &target.stores)
                    .map_err(|e| refuse(format!("the catalog cannot be opened: {e}")))?,
            );
        }
        let Some(grant) = &catalog else { continue };
        let ident = iceberg::TableIdent::from_strs(name.split('.'))
            .map_err(|e| refuse(format!("{name:?} is not a table name: {e}")))?;
        let table = grant.load(&ident).map_err(|e| refuse(format!("table {name:?} cannot be loaded: {e}")))?;
        let arrow = iceberg::arrow::schema_to_arrow_schema(table.metadata().current_schema())
            .map_err(|e| refuse(format!("table {name:?} has columns Sluice cannot read JSON into: {e}")))?;
        // The columns alone: the table's field ids are the sink's business.
        let columns: SchemaRef = Arc::new(arrow_schema::Schema::new(
            arrow.fields().iter().map(|f| f.as_ref().clone().with_metadata(Default::default())).collect::<Vec<_>>(),
        ));
        match &found {
            Some((first, schema)) if schema != &columns => {
                return Err(refuse(format!("tables {first:?} and {name:?} have different columns")));
            }
            Some(_) => {}
            None => found = Some((name, columns)),
        }
    }
    let (_, schema) = found.ok_or_else(|| refuse("the source lists no topic".into()))?;
    let mut resolved = config.clone();
    resolved.decoding = Decoding::Json(schema);
    Ok(resolved)
}

pub(crate) fn kafka_error(context: &str, e: KafkaError) -> SourceError {
    SourceError::Kafka { context: context.to_string(), source: e }
}

/// The kind of a Kafka client error, from its error code: a broker that
/// cannot be reached or answered too late may answer later
/// ([`ErrorKind::Retryable`]); settings or credentials the brokers refuse
/// are the job's ([`ErrorKind::Config`]); anything else is fatal.
pub fn kind_of(e: &KafkaError) -> ErrorKind {
    match e {
        KafkaError::ClientConfig(..) | KafkaError::ClientCreation(_) => ErrorKind::Config,
        KafkaError::MessageConsumptionFatal(_) => ErrorKind::Fatal,
        _ => e.rdkafka_error_code().map_or(ErrorKind::Fatal, kind_of_code),
    }
}

/// The kind of a Kafka error code (see [`kind_of`]).
pub fn kind_of_code(code: RDKafkaErrorCode) -> ErrorKind {
    use RDKafkaErrorCode as C;
    match code {
        C::BrokerTransportFailure
        | C::AllBrokersDown
        | C::Resolve
        | C::OperationTimedOut
        | C::MessageTimedOut
        | C::TimedOutQueue
        | C::RequestTimedOut
        | C::NetworkException
        | C::LeaderNotAvailable
        | C::NotLeaderForPartition
        | C::BrokerNotAvailable
        | C::ReplicaNotAvailable
        | C::CoordinatorLoadInProgress
        | C::CoordinatorNotAvailable
        | C::NotCoordinator
        | C::WaitingForCoordinator
        | C::NotEnoughReplicas
        | C::KafkaStorageError
        | C::Retry => ErrorKind::Retryable,
        C::Authentication
        | C::SaslAuthenticationFailed
        | C::UnsupportedSASLMechanism
        | C::SSL
        | C::TopicAuthorizationFailed
        | C::GroupAuthorizationFailed
        | C::ClusterAuthorizationFailed
        | C::InvalidArgument => ErrorKind::Config,
        _ => ErrorKind::Fatal,
    }
}

impl KafkaSource {
    pub fn open(config: &KafkaConfig, parallelism: u32) -> Result<Self, SourceError> {
        let config = Arc::new(config.clone());
        let meta: BaseConsumer = client(&config, None)
            .create()
            .map_err(|e| kafka_error(&format!("cannot make a client for {}", config.brokers), e))?;
        let decoder = Arc::new(decode::Codec::for_config(&config)?);
        // The table's columns (a change stream's batches carry more).
        let schema = decoder.table_schema();
        let group = match &config.group_id {
            Some(g) => Some(Mutex::new(GroupCommitter::spawn(client(&config, Some(g)), g.clone())?)),
            None => None,
        };
        let cluster = meta.client().fetch_cluster_id(REQUEST_TIMEOUT);
        let source = Self {
            config,
            parallelism,
            schema,
            decoder,
            meta: Mutex::new(meta),
            group,
            lag: Arc::default(),
            cluster,
            bad_rows: BadRows::Fail,
        };
        // The brokers must answer, and a listed topic must exist, before the
        // run writes anything.
        let topics = source.partitions()?;
        if let crate::kafka::config::Topics::List(list) = &source.config.topics {
            for t in list {
                if !topics.contains_key(t) {
                    return Err(SourceError::Config {
                        key: "source.topics".into(),
                        message: format!(
                            "kafka: topic {t:?} does not exist on {} (Sluice never creates topics)",
                            source.config.brokers
                        ),
                    });
                }
            }
        }
        Ok(source)
    }

    /// The topics that match, each with its partitions, as the brokers list them now.
    pub fn partitions(&self) -> Result<BTreeMap<String, Vec<i32>>, SourceError> {
        let meta =
            self.meta.lock().map_err(|_| SourceError::Internal("kafka: the metadata client is poisoned".into()))?;
        partitions_of(&meta, &self.config, false)
    }

    /// With [`BadRows::DeadLetter`], a message that does not fit its table
    /// is handed on as a dead letter instead of failing the read.
    pub fn with_bad_rows(mut self, bad_rows: BadRows) -> Self {
        self.bad_rows = bad_rows;
        self
    }

    pub fn config(&self) -> &KafkaConfig {
        &self.config
    }

    /// The change key when the source is a change stream (`source.key`;
    /// the Debezium formats need one): its batches carry
    /// `sluice_core::changes`' columns after the table's own, their
    /// position `(0, offset)`.
    pub fn change_key(&self) -> Option<&[String]> {
        (!self.config.key.is_empty()).then_some(self.config.key.as_slice())
    }

    pub fn batch_rows(&self) -> usize {
        self.config.batch_rows
    }

    pub fn lag(&self) -> &LagBoard {
        &self.lag
    }

    /// The table a topic's rows land in.
    pub fn table_of(&self, topic: &str) -> String {
        if self.config.single_topic().is_some() { String::new() } else { topic.to_string() }
    }

    pub fn is_multi_table(&self) -> bool {
        self.config.single_topic().is_none()
    }

    /// The topics there are now, as tables.
    pub fn tables(&self) -> Result<Vec<(String, SchemaRef)>, SourceError> {
        Ok(self.partitions()?.keys().map(|t| (self.table_of(t), self.schema.clone())).collect())
    }

    pub fn identity(&self) -> KafkaIdentity {
        KafkaIdentity {
            topics: self.config.topics.describe(),
            format: self.config.format,
            key: self.config.key.clone(),
            columns: self.config.columns.clone(),
            avro_schema: self.decoder.avro_reader_schema().map(str::to_string),
            assignment: ASSIGNMENT_RULE.to_string(),
            cluster: self.cluster.clone(),
        }
    }

    pub fn check_identity(&self, recorded: &KafkaIdentity) -> Result<(), SourceChange> {
        let now = self.identity();
        let what = if now.topics != recorded.topics {
            format!("it read topics {}, and the job now reads {}", recorded.topics, now.topics)
        } else if now.format != recorded.format {
            format!("it read {:?} messages, and the job now reads {:?}", recorded.format, now.format)
        } else if now.key != recorded.key {
            format!("its change key was {:?}, and the job's source.key is now {:?}", recorded.key, now.key)
        } else if now.columns != recorded.columns {
            "the job's columns changed since".to_string()
        } else if now.avro_schema != recorded.avro_schema {
            "its Avro reader schema (the table's columns: the job's avro_schema, or the registry's latest version \
             of the topic's subject when the job gives none) differs from the one now; give the job the schema \
             it was taken with as avro_schema, or start a new job.state_dir"
                .to_string()
        } else if let (Some(then), Some(now_id)) = (&recorded.cluster, &now.cluster)
            && then != now_id
        {
            format!(
                "it read Kafka cluster {then:?}, and the brokers {} are cluster {now_id:?}: its offsets mean nothing there",
                self.config.brokers
            )
        } else if now.assignment != recorded.assignment {
            format!("its partitions were split by {:?}, not {:?}", recorded.assignment, now.assignment)
        } else {
            return Ok(());
        };
        Err(SourceChange(what))
    }

    pub fn reader(&self, subtask: u32, position: Option<&serde_json::Value>) -> Result<KafkaReader, SourceError> {
        let position = position.map(KafkaPosition::parse).transpose()?;
        let consumer: BaseConsumer = client(&self.config, None)
            .set("enable.partition.eof", "false")
            .create()
            .map_err(|e| kafka_error("cannot make a consumer", e))?;
        KafkaReader::open(reader::ReaderSetup {
            consumer,
            config: self.config.clone(),
            decoder: self.decoder.clone(),
            subtask,
            parallelism: self.parallelism,
            position,
            single_table: self.config.single_topic().is_some(),
            lag: self.lag.clone(),
            keep_bad: self.bad_rows == BadRows::DeadLetter,
        })
    }

    /// After checkpoints up to the one at `positions` are committed: their
    /// offsets go to the consumer group, for lag tooling (best effort).
    pub fn acknowledge(&self, positions: &[&serde_json::Value]) {
        let Some(group) = &self.group else { return };
        let mut tpl = TopicPartitionList::new();
        for p in positions {
            let Ok(position) = KafkaPosition::parse(p) else { continue };
            for (topic, parts) in &position.offsets {
                for (partition, next) in parts {
                    if tpl.add_partition_offset(topic, *partition, Offset::Offset(*next)).is_err() {
                        tracing::warn!(topic, partition, "kafka: cannot note an offset for the group commit");
                    }
                }
            }
        }
        if tpl.count() == 0 {
            return;
        }
        if let Ok(committer) = group.lock() {
            committer.send(tpl);
        }
    }

    /// `next offsets orders[0]=120, orders[1]=98`.
    pub fn describe_positions(&self, positions: &[&serde_json::Value]) -> String {
        let mut parts = Vec::new();
        for p in positions {
            if let Ok(position) = KafkaPosition::parse(p) {
                for (topic, offsets) in &position.offsets {
                    for (partition, next) in offsets {
                        parts.push((topic.clone(), *partition, *next));
                    }
                }
            }
        }
        parts.sort();
        let text: Vec<String> = parts.iter().map(|(t, p, n)| format!("{t}[{p}]={n}")).collect();
        format!("next offsets {}", text.join(", "))
    }

    pub fn describe(&self) -> String {
        format!(
            "kafka topics {} on {} ({:?} messages{})",
            self.config.topics.describe(),
            self.config.brokers,
            self.config.format,
            if self.config.bounded { ", bounded to the end offsets at start" } else { ", unbounded" }
        )
    }

    /// Consumer lag per topic, for the status line and the summary.
    pub fn status(&self) -> Option<String> {
        let lag = self.lag.per_topic();
        if lag.is_empty() {
            return None;
        }
        let parts: Vec<String> = lag.iter().map(|(t, l)| format!("{t} {l}")).collect();
        Some(format!("lag {}", parts.join(", ")))
    }

    pub fn start(&self) -> StartAt {
        self.config.start
    }
}

/// The matching topics and their partitions.
/// The matching topics and their partitions. A topic the brokers answer
/// with an error for (a leader not elected yet, just after it was made)
/// fails the call, unless `skip_failing`: discovery then leaves it for its
/// next look.
pub(crate) fn partitions_of(
    consumer: &BaseConsumer,
    config: &KafkaConfig,
    skip_failing: bool,
) -> Result<BTreeMap<String, Vec<i32>>, SourceError> {
    let metadata = consumer
        .fetch_metadata(None, REQUEST_TIMEOUT)
        .map_err(|e| kafka_error(&format!("cannot list the topics of {}", config.brokers), e))?;
    let mut out = BTreeMap::new();
    for topic in metadata.topics() {
        let name = topic.name();
        if name.starts_with("__") || !config.topics.matches(name) {
            continue;
        }
        if let Some(e) = topic.error() {
            if skip_failing {
                tracing::info!(topic = %name, error = ?e, "kafka: the brokers cannot serve this topic yet; looking again later");
                continue;
            }
            return Err(SourceError::KafkaTopic { topic: name.to_string(), code: RDKafkaErrorCode::from(e) });
        }
        let mut parts: Vec<i32> = topic.partitions().iter().map(|p| p.id()).collect();
        parts.sort_unstable();
        out.insert(name.to_string(), parts);
    }
    Ok(out)
}

/// How long the end of a run waits for the last group commit.
const GROUP_DRAIN: Duration = Duration::from_secs(10);

/// A thread that commits offsets to a consumer group, one list after
/// another, so that no checkpoint waits on it. When the source is dropped
/// (the run ends, a clean stop included) it waits up to `GROUP_DRAIN` for
/// the last list to be committed, so lag tooling sees where the run
/// stopped.
struct GroupCommitter {
    tx: Option<Sender<TopicPartitionList>>,
    done: std::sync::mpsc::Receiver<()>,
    group: String,
}

impl GroupCommitter {
    fn spawn(config: ClientConfig, group: String) -> Result<Self, SourceError> {
        let consumer: BaseConsumer =
            config.create().map_err(|e| kafka_error(&format!("cannot make a client for group {group:?}"), e))?;
        let (tx, rx) = channel::<TopicPartitionList>();
        let (done_tx, done) = channel::<()>();
        let name = group.clone();
        std::thread::Builder::new()
            .name("sluice-kafka-group".into())
            .spawn(move || {
                while let Ok(mut tpl) = rx.recv() {
                    // Only the newest list matters.
                    while let Ok(newer) = rx.try_recv() {
                        tpl = newer;
                    }
                    match consumer.commit(&tpl, CommitMode::Sync) {
                        Ok(()) => tracing::debug!(group = %name, "kafka: offsets committed to the consumer group"),
                        Err(e) => tracing::warn!(
                            group = %name,
                            error = %e,
                            "kafka: could not commit offsets to the consumer group (for lag tooling only; the checkpoint holds them)"
                        ),
                    }
                }
                let _ = done_tx.send(());
            })
            .map_err(|e| SourceError::Thread { what: "the Kafka group-commit thread", source: e })?;
        Ok(Self { tx: Some(tx), done, group })
    }

    fn send(&self, tpl: TopicPartitionList) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(tpl);
        }
    }
}

impl Drop for GroupCommitter {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it committed what it holds.
        drop(self.tx.take());
        if self.done.recv_timeout(GROUP_DRAIN).is_err() {
            tracing::warn!(
                group = %self.group,
                "kafka: the last group commit did not finish in time (for lag tooling only; the checkpoint holds the offsets)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_owner_rule_is_stable_and_spreads_a_topics_partitions() {
        // Fixed values: a change of the rule must change ASSIGNMENT_RULE.
        assert_eq!(owner("orders", 0, 2), owner("orders", 2, 2));
        assert_ne!(owner("orders", 0, 2), owner("orders", 1, 2));
        let spread: std::collections::BTreeSet<u32> = (0..6).map(|p| owner("events", p, 3)).collect();
        assert_eq!(spread.len(), 3);
        assert_eq!(owner("orders", 5, 1), 0);
    }

    fn config(brokers: &str, client: Vec<(String, config::ClientValue)>) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.into(),
            topics: config::Topics::List(vec!["orders".into()]),
            start: StartAt::Earliest,
            start_timestamp_ms: None,
            format: MessageFormat::Raw,
            key: Vec::new(),
            columns: Vec::new(),
            decoding: Decoding::Raw,
            group_id: None,
            bounded: true,
            batch_rows: 10,
            discover_every: Duration::from_secs(1),
            client,
        }
    }

    #[test]
    fn client_errors_take_their_kind_from_the_error_code() {
        use RDKafkaErrorCode as C;
        for code in [C::BrokerTransportFailure, C::AllBrokersDown, C::RequestTimedOut, C::LeaderNotAvailable] {
            assert_eq!(kind_of(&KafkaError::MetadataFetch(code)), ErrorKind::Retryable, "{code:?}");
        }
        for code in [C::SaslAuthenticationFailed, C::TopicAuthorizationFailed, C::SSL] {
            assert_eq!(kind_of(&KafkaError::MessageConsumption(code)), ErrorKind::Config, "{code:?}");
        }
        assert_eq!(kind_of(&KafkaError::MetadataFetch(C::UnknownTopicOrPartition)), ErrorKind::Fatal);
        // The client gave up for good, whatever the code.
        assert_eq!(kind_of(&KafkaError::MessageConsumptionFatal(C::AllBrokersDown)), ErrorKind::Fatal);
        assert_eq!(kind_of(&KafkaError::Canceled), ErrorKind::Fatal);
    }

    #[test]
    fn a_client_setting_librdkafka_refuses_is_the_jobs_to_fix() {
        use sluice_core::error::Kind;
        let client = vec![("no.such.property".to_string(), config::ClientValue::Plain("1".into()))];
        let e = KafkaSource::open(&config("127.0.0.1:9", client), 1).err().unwrap_or_else(|| panic!("opened"));
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("cannot make a client for 127.0.0.1:9"), "{e}");
        assert!(e.to_string().contains("no.such.property"), "{e}");
    }

    #[test]
    fn brokers_that_do_not_answer_may_answer_later() {
        use sluice_core::error::Kind;
        // Nothing listens on the discard port: the metadata request times out.
        let e = KafkaSource::open(&config("127.0.0.1:9", Vec::new()), 1).err().unwrap_or_else(|| panic!("opened"));
        assert!(matches!(e, SourceError::Kafka { .. }), "{e}");
        assert_eq!(e.kind(), ErrorKind::Retryable, "{e}");
        assert!(e.to_string().contains("cannot list the topics of 127.0.0.1:9"), "{e}");
    }

    #[test]
    fn lag_adds_up_per_topic() {
        let lag = LagBoard::default();
        lag.set("a", 0, 10, 15);
        lag.set("a", 1, 3, 3);
        lag.set("b", 0, 7, 9);
        assert_eq!(lag.per_topic(), BTreeMap::from([("a".to_string(), 5), ("b".to_string(), 2)]));
        assert_eq!(
            lag.per_partition(),
            vec![("a".to_string(), 0, 5), ("a".to_string(), 1, 0), ("b".to_string(), 0, 2)]
        );
    }
}
