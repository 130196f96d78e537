//! One subtask's Kafka reader: its partitions, assigned by offset.
//!
//! Invariants:
//! - `next` holds, per owned partition, the offset after the last message
//!   returned in a batch: messages fetched but not yet returned never count,
//!   so the position is always just past the rows handed to the writer;
//! - a re-assignment (new partitions found) drops what was fetched and not
//!   returned, and fetches again from `next`, so nothing is read twice;
//! - bounded, a partition's end is fixed early: the larger of the end offset
//!   seen at open and the high watermark of the first fetch answer (a broker
//!   that under-reports the end at open, as tansu 0.6's ListOffsets does
//!   with the base offset of the last batch, does not end it early). Messages
//!   at or past the end are not returned, so producers that keep writing do
//!   not keep a bounded run going; the next run reads them from `next`;
//! - errors the client reports while it reconnects (a broker restarting,
//!   all brokers briefly down) are waited out for `RECONNECT_PATIENCE`;
//!   an offset the partition no longer holds stops the run at once.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use super::decode::{Codec, Message};
use super::{KafkaPosition, LagBoard, REQUEST_TIMEOUT, kafka_error, owner, partitions_of};
use crate::kafka::config::{KafkaConfig, StartAt};
use crate::{Read, SourceError, SourceReader, TableBatch};

/// How long one read waits for the first message.
const POLL_WAIT: Duration = Duration::from_millis(100);
/// How often the lag board is updated.
const LAG_EVERY: Duration = Duration::from_millis(500);
/// Bounded: reads in a row that found nothing, every partition at its end
/// and caught up, before the reader ends (a broker's answer that trails the
/// log must not end it before the last batch was fetched).
const IDLE_READS_TO_END: u32 = 5;

/// How long transient client errors in a row are waited out before the
/// run stops (resumable, as any failed run).
const RECONNECT_PATIENCE: Duration = Duration::from_secs(60);

type Partition = (String, i32);

pub(crate) struct ReaderSetup {
    pub consumer: BaseConsumer,
    pub config: Arc<KafkaConfig>,
    pub decoder: Arc<Codec>,
    pub subtask: u32,
    pub parallelism: u32,
    pub position: Option<KafkaPosition>,
    pub single_table: bool,
    pub lag: Arc<LagBoard>,
    /// Messages that do not fit become dead letters (`job.bad_rows`).
    pub keep_bad: bool,
}

pub struct KafkaReader {
    consumer: BaseConsumer,
    config: Arc<KafkaConfig>,
    decoder: Arc<Codec>,
    subtask: u32,
    parallelism: u32,
    single_table: bool,
    keep_bad: bool,
    /// The next offset to return, per owned partition.
    next: BTreeMap<Partition, i64>,
    /// Bounded: the end offset per partition; see `frozen`.
    end: BTreeMap<Partition, i64>,
    /// Bounded: the partitions whose `end` took the first fetch answer's
    /// high watermark into account, and is fixed from then on.
    frozen: BTreeSet<Partition>,
    /// The first and the latest of the transient client errors of the
    /// current spell, if one is going on.
    errors: Option<(Instant, Instant)>,
    /// Fetched, not yet returned, per topic, in fetch order.
    pending: BTreeMap<String, VecDeque<Message>>,
    discovered_at: Instant,
    lag: Arc<LagBoard>,
    lag_at: Instant,
    /// Bounded: reads in a row that found nothing and every partition done.
    idle_at_end: u32,
}

impl KafkaReader {
    pub(crate) fn open(setup: ReaderSetup) -> Result<Self, SourceError> {
        let mut reader = Self {
            consumer: setup.consumer,
            config: setup.config,
            decoder: setup.decoder,
            subtask: setup.subtask,
            parallelism: setup.parallelism,
            single_table: setup.single_table,
            keep_bad: setup.keep_bad,
            next: BTreeMap::new(),
            end: BTreeMap::new(),
            frozen: BTreeSet::new(),
            errors: None,
            pending: BTreeMap::new(),
            discovered_at: Instant::now(),
            lag: setup.lag,
            lag_at: Instant::now(),
            idle_at_end: 0,
        };
        let restored = setup.position.is_some();
        let recorded = setup.position.unwrap_or_default();
        // A recorded partition this subtask does not own: the rule or the
        // parallelism changed (both are checked before, so: a bug).
        for (topic, parts) in &recorded.offsets {
            for p in parts.keys() {
                if owner(topic, *p, reader.parallelism) != reader.subtask {
                    return Err(SourceError::Position {
                        position: format!("{topic}[{p}]"),
                        message: format!(
                            "the checkpoint gives it to subtask {}, which does not own it",
                            reader.subtask
                        ),
                    });
                }
            }
        }
        let topics = partitions_of(&reader.consumer, &reader.config, false)?;
        for (topic, parts) in &recorded.offsets {
            for (p, next) in parts {
                if !topics.get(topic).is_some_and(|ps| ps.contains(p)) {
                    return Err(SourceError::Position {
                        position: format!("{topic}[{p}] at offset {next}"),
                        message: "the checkpoint read this partition, and the brokers no longer have it (was the \
                                  topic deleted?); its remaining messages cannot be read"
                            .to_string(),
                    });
                }
            }
        }
        for (topic, parts) in &topics {
            for p in parts {
                if owner(topic, *p, reader.parallelism) != reader.subtask {
                    continue;
                }
                let recorded_next = recorded.offsets.get(topic).and_then(|ps| ps.get(p)).copied();
                let start = match recorded_next {
                    Some(n) => reader.check_recorded(topic, *p, n)?,
                    // A resumed job meets a partition that came after its
                    // start: from its beginning.
                    None if restored => reader.watermarks(topic, *p)?.0,
                    None => reader.start_offset(topic, *p)?,
                };
                reader.next.insert((topic.clone(), *p), start);
                if reader.config.bounded {
                    let high = reader.watermarks(topic, *p)?.1;
                    reader.end.insert((topic.clone(), *p), high);
                }
            }
        }
        reader.assign()?;
        tracing::debug!(subtask = reader.subtask, partitions = reader.next.len(), "kafka reader open");
        Ok(reader)
    }

    fn watermarks(&self, topic: &str, p: i32) -> Result<(i64, i64), SourceError> {
        self.consumer
            .fetch_watermarks(topic, p, REQUEST_TIMEOUT)
            .map_err(|e| kafka_error(&format!("cannot read the offsets of {topic}[{p}]"), e))
    }

    /// A recorded offset the partition must still hold.
    fn check_recorded(&self, topic: &str, p: i32, next: i64) -> Result<i64, SourceError> {
        let (low, _) = self.watermarks(topic, p)?;
        if next < low {
            return Err(SourceError::Position {
                position: format!("{topic}[{p}] at offset {next}"),
                message: format!(
                    "the partition now starts at offset {low}: messages {next} to {} were deleted (retention) before \
                     this job read them, so resuming would skip them. Nothing was read; to accept the loss, start a new \
                     job.state_dir with start = \"earliest\"",
                    low - 1
                ),
            });
        }
        Ok(next)
    }

    /// Where a partition starts in a run from no checkpoint.
    fn start_offset(&self, topic: &str, p: i32) -> Result<i64, SourceError> {
        let (low, high) = self.watermarks(topic, p)?;
        match self.config.start {
            StartAt::Earliest => Ok(low),
            StartAt::Latest => Ok(high),
            StartAt::Timestamp => {
                let ts = self.config.start_timestamp_ms.unwrap_or(0);
                let mut tpl = TopicPartitionList::new();
                tpl.add_partition_offset(topic, p, Offset::Offset(ts))
                    .map_err(|e| kafka_error("cannot ask for an offset by time", e))?;
                let found = self
                    .consumer
                    .offsets_for_times(tpl, REQUEST_TIMEOUT)
                    .map_err(|e| kafka_error(&format!("cannot find the offset of {topic}[{p}] at {ts} ms"), e))?;
                match found.find_partition(topic, p).map(|e| e.offset()) {
                    Some(Offset::Offset(o)) => Ok(o),
                    // No message at or after the time: from the end.
                    _ => Ok(high),
                }
            }
        }
    }

    fn assign(&mut self) -> Result<(), SourceError> {
        let mut tpl = TopicPartitionList::new();
        for ((topic, p), next) in &self.next {
            if self.at_end(&(topic.clone(), *p), *next) {
                continue;
            }
            tpl.add_partition_offset(topic, *p, Offset::Offset(*next))
                .map_err(|e| kafka_error("cannot assign a partition", e))?;
        }
        self.pending.clear();
        self.consumer.assign(&tpl).map_err(|e| kafka_error("cannot assign the partitions", e))
    }

    /// Bounded: fixes the end of each partition that has had its first
    /// fetch answer (the high watermark it carried, when larger).
    fn settle_ends(&mut self) {
        if !self.config.bounded {
            return;
        }
        for (key, end) in self.end.iter_mut() {
            if !self.frozen.contains(key)
                && let Some(high) = cached_high(&self.consumer, &key.0, key.1)
            {
                *end = (*end).max(high);
                self.frozen.insert(key.clone());
            }
        }
    }

    /// Bounded: whether the partition's fixed end is reached at `next`.
    fn at_end(&self, key: &Partition, next: i64) -> bool {
        self.frozen.contains(key) && self.end.get(key).is_some_and(|end| next >= *end)
    }

    /// Bounded: whether a fetched message lies at or past its partition's
    /// fixed end (it is not returned; a later run reads it).
    fn past_end(&self, key: &Partition, offset: i64) -> bool {
        self.frozen.contains(key) && self.end.get(key).is_some_and(|end| offset >= *end)
    }

    /// A client error: an offset the partition no longer holds stops the
    /// run at once, as do errors that cannot pass; others are waited out
    /// while the client reconnects, for `RECONNECT_PATIENCE` in a row.
    fn client_error(&mut self, e: KafkaError) -> Result<(), SourceError> {
        let code = match &e {
            KafkaError::MessageConsumption(code) | KafkaError::MessageConsumptionFatal(code) => Some(*code),
            _ => None,
        };
        if matches!(code, Some(RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset)) {
            return Err(self.out_of_range());
        }
        let transient = matches!(e, KafkaError::MessageConsumption(_))
            && !matches!(
                code,
                Some(
                    RDKafkaErrorCode::Fatal
                        | RDKafkaErrorCode::TopicAuthorizationFailed
                        | RDKafkaErrorCode::GroupAuthorizationFailed
                        | RDKafkaErrorCode::ClusterAuthorizationFailed
                        | RDKafkaErrorCode::SaslAuthenticationFailed
                        | RDKafkaErrorCode::Authentication
                        | RDKafkaErrorCode::SSL
                        | RDKafkaErrorCode::UnknownTopic
                        | RDKafkaErrorCode::UnknownPartition
                )
            );
        let now = Instant::now();
        // A spell ends when the client went quiet for as long as the patience.
        let first = match self.errors {
            Some((first, last)) if now.duration_since(last) < RECONNECT_PATIENCE => first,
            _ => now,
        };
        self.errors = Some((first, now));
        if !transient || now.duration_since(first) >= RECONNECT_PATIENCE {
            return Err(kafka_error(&format!("subtask {}: reading failed", self.subtask), e));
        }
        tracing::warn!(subtask = self.subtask, error = %e, "kafka: the client reports an error; waiting for it to reconnect");
        Ok(())
    }

    /// Looks for partitions (and topics) that appeared since, now and then.
    fn discover(&mut self) -> Result<(), SourceError> {
        if self.config.bounded || self.discovered_at.elapsed() < self.config.discover_every {
            return Ok(());
        }
        self.discovered_at = Instant::now();
        let topics = partitions_of(&self.consumer, &self.config, true)?;
        let mut added = Vec::new();
        for (topic, parts) in &topics {
            for p in parts {
                let key = (topic.clone(), *p);
                if owner(topic, *p, self.parallelism) == self.subtask && !self.next.contains_key(&key) {
                    added.push(key);
                }
            }
        }
        if added.is_empty() {
            return Ok(());
        }
        for (topic, p) in &added {
            let low = self.watermarks(topic, *p)?.0;
            tracing::info!(subtask = self.subtask, topic = %topic, partition = p, from = low, "kafka: reading a new partition");
            self.next.insert((topic.clone(), *p), low);
        }
        self.assign()
    }

    /// Bounded: every partition reached its fixed end.
    fn done(&self) -> bool {
        self.config.bounded
            && self.pending.values().all(VecDeque::is_empty)
            && self.next.iter().all(|(key, next)| self.at_end(key, *next))
    }

    /// Polls what the client has, up to `max_rows` messages of one topic.
    fn fill(&mut self, max_rows: usize) -> Result<(), SourceError> {
        let mut wait = POLL_WAIT;
        loop {
            if self.pending.values().any(|q| q.len() >= max_rows) {
                return Ok(());
            }
            let Some(polled) = self.consumer.poll(wait) else { return Ok(()) };
            wait = Duration::ZERO;
            // The message borrows the client: made owned before `self` is used.
            let (topic, message) = match polled {
                Ok(m) => {
                    let headers = m
                        .headers()
                        .map(|hs| hs.iter().map(|h| (h.key.to_string(), h.value.map(<[u8]>::to_vec))).collect())
                        .unwrap_or_default();
                    let message = Message {
                        partition: m.partition(),
                        offset: m.offset(),
                        timestamp_ms: m.timestamp().to_millis(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                        headers,
                    };
                    (m.topic().to_string(), message)
                }
                Err(KafkaError::PartitionEOF(_)) => continue,
                Err(e) => {
                    self.client_error(e)?;
                    continue;
                }
            };
            self.errors = None;
            let key = (topic.clone(), message.partition);
            // A message before `next` was returned already (a re-fetch).
            if self.next.get(&key).is_none_or(|n| message.offset < *n) {
                continue;
            }
            // The answer that brought it carried the high watermark.
            self.settle_ends();
            if self.past_end(&key, message.offset) {
                continue;
            }
            self.pending.entry(topic).or_default().push_back(message);
        }
    }

    fn out_of_range(&self) -> SourceError {
        let owned: Vec<String> = self.next.iter().map(|((t, p), n)| format!("{t}[{p}]@{n}")).collect();
        SourceError::Position {
            position: owned.join(", "),
            message: "a broker answered that an offset is out of range: the partition no longer holds it (deleted by \
                      retention, or the topic was made anew). Nothing of it was read; resuming would skip or repeat \
                      messages, so the run stops"
                .to_string(),
        }
    }

    fn report_lag(&mut self) {
        if self.lag_at.elapsed() < LAG_EVERY {
            return;
        }
        self.lag_at = Instant::now();
        for ((topic, p), next) in &self.next {
            if let Some(high) = cached_high(&self.consumer, topic, *p) {
                self.lag.set(topic, *p, *next, high);
            }
        }
    }

    /// Up to `max_rows` of the topic with the most fetched, as a batch.
    fn take(&mut self, max_rows: usize) -> Result<Option<TableBatch>, SourceError> {
        let Some(topic) =
            self.pending.iter().filter(|(_, q)| !q.is_empty()).max_by_key(|(_, q)| q.len()).map(|(t, _)| t.clone())
        else {
            return Ok(None);
        };
        let queue = self.pending.entry(topic.clone()).or_default();
        let n = queue.len().min(max_rows);
        let messages: Vec<Message> = queue.drain(..n).collect();
        let (batch, bad) = self.decoder.decode_keeping_bad(&topic, &messages, self.keep_bad)?;
        for m in &messages {
            self.next.insert((topic.clone(), m.partition), m.offset + 1);
        }
        let table = if self.single_table { String::new() } else { topic };
        Ok(Some(TableBatch { bad, ..TableBatch::new(table, batch) }))
    }
}

/// The high watermark of a partition as the client last heard it from a
/// fetch answer (no request is sent); `None` before the first answer.
///
/// rdkafka 0.39 binds librdkafka's `rd_kafka_get_watermark_offsets` to no
/// safe method (only `fetch_watermarks`, which asks the broker), so it is
/// called here directly.
fn cached_high(consumer: &BaseConsumer, topic: &str, partition: i32) -> Option<i64> {
    let topic = std::ffi::CString::new(topic).ok()?;
    let (mut low, mut high) = (-1i64, -1i64);
    // SAFETY: the client pointer is live for as long as `consumer` is; the
    // topic is a NUL-terminated string that outlives the call; librdkafka
    // only writes the two offsets, and reads its own cache under its lock.
    let err = unsafe {
        rdkafka::bindings::rd_kafka_get_watermark_offsets(
            consumer.client().native_ptr(),
            topic.as_ptr(),
            partition,
            &mut low,
            &mut high,
        )
    };
    (err == rdkafka::bindings::rd_kafka_resp_err_t::RD_KAFKA_RESP_ERR_NO_ERROR && high >= 0).then_some(high)
}

impl SourceReader for KafkaReader {
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<TableBatch>, SourceError> {
        loop {
            match self.read(max_rows)? {
                Read::Batch(b) => return Ok(Some(b)),
                Read::End => return Ok(None),
                Read::Idle => {}
            }
        }
    }

    fn read(&mut self, max_rows: usize) -> Result<Read, SourceError> {
        self.discover()?;
        self.fill(max_rows.max(1))?;
        self.settle_ends();
        self.report_lag();
        if let Some(batch) = self.take(max_rows.max(1))? {
            self.idle_at_end = 0;
            return Ok(Read::Batch(batch));
        }
        if self.done() {
            self.idle_at_end += 1;
            if self.idle_at_end >= IDLE_READS_TO_END {
                return Ok(Read::End);
            }
        } else {
            self.idle_at_end = 0;
        }
        Ok(Read::Idle)
    }

    fn position(&self) -> serde_json::Value {
        let mut position = KafkaPosition::default();
        for ((topic, p), next) in &self.next {
            position.offsets.entry(topic.clone()).or_default().insert(*p, *next);
        }
        serde_json::to_value(&position).unwrap_or(serde_json::Value::Null)
    }
}
