//! Tables and write streams, with the semantics the Storage Write API
//! documents (google.cloud.bigquery.storage.v1, `storage.proto` and
//! `stream.proto`; https://cloud.google.com/bigquery/docs/reference/storage/rpc).
//!
//! - A stream's rows have offsets 0, 1, 2, ... in append order.
//! - BUFFERED: "Data is only visible up to the offset to which it was
//!   flushed" (WriteStream.Type.BUFFERED). FlushRows "flushes up to any
//!   previously flushed offset in a BUFFERED stream, to the offset specified
//!   in the request" and the response's offset means "the rows before this
//!   offset (including this offset) are flushed": inclusive and cumulative.
//! - COMMITTED and the `_default` stream: rows are visible as soon as the
//!   append is acknowledged. PENDING: visible after BatchCommitWriteStreams,
//!   which needs the streams finalized.
//! - A finalized stream takes no more appends (`STREAM_FINALIZED`).
//!
//! A table's rows are its **materialized** rows (written by copy jobs, or
//! loaded by a test) followed by the visible rows of its streams, streams
//! in name (creation) order. When a job writes a table, the table first
//! absorbs its streams' visible rows into the materialized ones (each
//! stream remembers how many it gave, `absorbed`), so that truncating a
//! partition drops streamed rows too. Absorbing changes neither what
//! readers see nor the order they see it in, nor any stream's offsets.
//!
//! Jobs ([`crate::jobs`]) are kept by (project, job id).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableSchema, write_stream::Type as StreamType,
};
use prost_reflect::MessageDescriptor;

use crate::partition::TimePartitioning;

/// Rows of one acknowledged append: proto rows with the descriptor that
/// decodes them, or an Arrow record batch.
#[derive(Clone)]
pub enum StoredRows {
    Proto {
        descriptor: Arc<MessageDescriptor>,
        rows: Vec<Vec<u8>>,
    },
    Arrow(arrow_array::RecordBatch),
    /// Rows already decoded, keyed by column name: a CDC table's rows by
    /// primary key ([`crate::cdc`]).
    Json(Vec<serde_json::Map<String, serde_json::Value>>),
}

impl StoredRows {
    pub fn len(&self) -> usize {
        match self {
            StoredRows::Proto { rows, .. } => rows.len(),
            StoredRows::Arrow(batch) => batch.num_rows(),
            StoredRows::Json(rows) => rows.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` rows.
    pub fn head(&self, n: usize) -> StoredRows {
        self.slice(0, n)
    }

    /// Up to `len` rows from row `start` (clamped to the rows there are).
    pub fn slice(&self, start: usize, len: usize) -> StoredRows {
        let start = start.min(self.len());
        let len = len.min(self.len() - start);
        match self {
            StoredRows::Proto { descriptor, rows } => {
                StoredRows::Proto { descriptor: descriptor.clone(), rows: rows[start..start + len].to_vec() }
            }
            StoredRows::Arrow(batch) => StoredRows::Arrow(batch.slice(start, len)),
            StoredRows::Json(rows) => StoredRows::Json(rows[start..start + len].to_vec()),
        }
    }

    /// The rows whose `keep` is true, in order. Arrow rows are cut into
    /// slices of consecutive kept rows (zero-copy) rather than filtered
    /// with `arrow-select`, which this crate does not otherwise need.
    pub fn select(&self, keep: &[bool]) -> Vec<StoredRows> {
        match self {
            StoredRows::Proto { descriptor, rows } => {
                let rows: Vec<Vec<u8>> = rows.iter().zip(keep).filter(|(_, k)| **k).map(|(r, _)| r.clone()).collect();
                if rows.is_empty() {
                    Vec::new()
                } else {
                    vec![StoredRows::Proto { descriptor: descriptor.clone(), rows }]
                }
            }
            StoredRows::Json(rows) => {
                let rows: Vec<_> = rows.iter().zip(keep).filter(|(_, k)| **k).map(|(r, _)| r.clone()).collect();
                if rows.is_empty() { Vec::new() } else { vec![StoredRows::Json(rows)] }
            }
            StoredRows::Arrow(_) => {
                let mut out = Vec::new();
                let mut run: Option<usize> = None;
                for (i, k) in keep.iter().copied().chain(std::iter::once(false)).enumerate() {
                    match (k, run) {
                        (true, None) => run = Some(i),
                        (false, Some(start)) => {
                            out.push(self.slice(start, i - start));
                            run = None;
                        }
                        _ => {}
                    }
                }
                out
            }
        }
    }

    /// The rows as JSON, keyed by column name.
    pub fn to_json(&self) -> Vec<serde_json::Map<String, serde_json::Value>> {
        match self {
            StoredRows::Proto { descriptor, rows } => {
                rows.iter().map(|r| crate::schema::to_json(descriptor, r)).collect()
            }
            StoredRows::Arrow(batch) => crate::arrow_rows::to_json(batch),
            StoredRows::Json(rows) => rows.clone(),
        }
    }
}

pub struct Stream {
    pub table: String,
    pub kind: StreamType,
    /// The table's schema when the stream was created: appends are checked
    /// against it ("the stream's schema"; `None` for `_default`, which
    /// follows the table).
    pub schema: Option<TableSchema>,
    pub batches: Vec<StoredRows>,
    /// Number of rows appended (the next offset).
    pub len: i64,
    /// Rows visible in a BUFFERED stream: offsets `< flushed`.
    pub flushed: i64,
    pub finalized: bool,
    pub committed: bool,
    /// Deleted by the service: every call naming it is NOT_FOUND. Rows it
    /// made visible stay in the table.
    pub deleted: bool,
    /// Leading visible rows the table absorbed into its materialized rows
    /// (`absorbed <= visible()` always: visibility only grows).
    pub absorbed: i64,
}

impl Stream {
    pub fn new(table: &str, kind: StreamType) -> Self {
        Self {
            table: table.to_string(),
            kind,
            schema: None,
            batches: Vec::new(),
            len: 0,
            flushed: 0,
            finalized: false,
            committed: false,
            deleted: false,
            absorbed: 0,
        }
    }

    /// How many leading rows readers see.
    pub fn visible(&self) -> i64 {
        match self.kind {
            StreamType::Committed | StreamType::Unspecified => self.len,
            StreamType::Buffered => self.flushed,
            StreamType::Pending => {
                if self.committed {
                    self.len
                } else {
                    0
                }
            }
        }
    }
}

pub struct Table {
    pub schema: TableSchema,
    /// Raised by every change of the table (its etag).
    pub version: u64,
    /// The table resource's `labels` and `description`, kept as given.
    pub labels: serde_json::Map<String, serde_json::Value>,
    pub description: Option<String>,
    /// `timePartitioning`, for a time-unit column partitioned table.
    pub time_partitioning: Option<TimePartitioning>,
    /// `expirationTime`: when the table expires, in ms since the epoch
    /// (absent: never). The double keeps and returns it; a test makes a
    /// table expire with [`crate::BigQueryDouble::delete_table`].
    pub expiration_time: Option<i64>,
    /// Rows written by jobs (and absorbed from streams), before the
    /// streams' unabsorbed visible rows.
    pub materialized: Vec<StoredRows>,
    /// `tableConstraints.primaryKey.columns` (empty: no primary key).
    pub primary_key: Vec<String>,
    /// `maxStaleness`, kept as given (an INTERVAL's canonical text).
    pub max_staleness: Option<String>,
    /// The rows CDC changes made, by primary key ([`crate::cdc`]); readers
    /// see the live ones after every other row.
    pub keyed: BTreeMap<String, crate::cdc::Applied>,
}

impl Table {
    pub fn new(schema: TableSchema) -> Self {
        Table {
            schema,
            version: 1,
            labels: serde_json::Map::new(),
            description: None,
            time_partitioning: None,
            expiration_time: None,
            materialized: Vec::new(),
            primary_key: Vec::new(),
            max_staleness: None,
            keyed: BTreeMap::new(),
        }
    }
}

#[derive(Default)]
pub struct Inner {
    pub tables: HashMap<String, Table>,
    pub streams: HashMap<String, Stream>,
    pub next_stream: u64,
    /// Jobs by (project, job id).
    pub jobs: BTreeMap<(String, String), crate::jobs::Job>,
    /// Datasets a test configured, by `projects/P/datasets/D`.
    pub datasets: HashMap<String, Dataset>,
}

/// What the double keeps of a dataset resource
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/datasets).
/// A dataset no test configured is answered as one in `US` with no
/// defaults: the double makes tables without datasets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    /// `location`: "The geographic location where the dataset should
    /// reside", e.g. `US`, `EU`, `europe-west1`.
    pub location: String,
    /// `defaultTableExpirationMs`: "all newly-created tables in the dataset
    /// will have an expirationTime property set to the creation time plus
    /// the value in this property".
    pub default_table_expiration_ms: Option<i64>,
    /// `defaultPartitionExpirationMs`: "When new time-partitioned tables are
    /// created in a dataset where this property is set, the table will
    /// inherit this value, propagated as the TimePartitioning.expirationMs
    /// property on the new table. If you set TimePartitioning.expirationMs
    /// explicitly when creating a table, the defaultPartitionExpirationMs of
    /// the containing dataset is ignored. When creating a partitioned table,
    /// if defaultPartitionExpirationMs is set, the defaultTableExpirationMs
    /// value is ignored and the table will not inherit a table expiration
    /// deadline."
    pub default_partition_expiration_ms: Option<i64>,
}

impl Default for Dataset {
    fn default() -> Self {
        Dataset {
            location: crate::jobs::DEFAULT_LOCATION.to_string(),
            default_table_expiration_ms: None,
            default_partition_expiration_ms: None,
        }
    }
}

impl Inner {
    /// The rows readers of `table` see now: its materialized rows, then
    /// each stream's rows from what it gave the table up to what is visible
    /// of it (flushed, committed, or all for `_default`), streams in name
    /// order (creation order).
    pub fn visible_batches(&self, table: &str) -> Vec<StoredRows> {
        let mut out: Vec<StoredRows> = self.tables.get(table).map(|t| t.materialized.clone()).unwrap_or_default();
        for (_, stream) in self.table_streams(table) {
            out.extend(stream_rows(stream, stream.absorbed, stream.visible()));
        }
        if let Some(t) = self.tables.get(table) {
            let live: Vec<_> = t.keyed.values().filter_map(|a| a.row.clone()).collect();
            if !live.is_empty() {
                out.push(StoredRows::Json(live));
            }
        }
        out
    }

    /// `table`'s streams, in name order.
    fn table_streams(&self, table: &str) -> Vec<(&String, &Stream)> {
        let mut streams: Vec<(&String, &Stream)> = self.streams.iter().filter(|(_, s)| s.table == table).collect();
        streams.sort_by(|a, b| a.0.cmp(b.0));
        streams
    }

    /// Moves the visible rows of `table`'s streams that the table has not
    /// absorbed yet to the end of its materialized rows. Readers see the
    /// same rows in the same order before and after.
    pub fn absorb(&mut self, table: &str) {
        let mut names: Vec<String> =
            self.streams.iter().filter(|(_, s)| s.table == table).map(|(n, _)| n.clone()).collect();
        names.sort();
        let Some(target) = self.tables.get_mut(table) else { return };
        for name in names {
            if let Some(stream) = self.streams.get_mut(&name) {
                let visible = stream.visible();
                target.materialized.extend(stream_rows(stream, stream.absorbed, visible));
                stream.absorbed = visible;
            }
        }
    }

    /// The table a stream name belongs to, and whether it names `_default`.
    pub fn default_stream_table(name: &str) -> Option<&str> {
        name.strip_suffix("/streams/_default")
    }

    /// Whether `name` is a table's `_default` stream.
    pub fn is_default(name: &str) -> bool {
        Self::default_stream_table(name).is_some()
    }

    /// A stream calls may name (not deleted). Resolves `_default` streams
    /// lazily (they always exist for a table).
    pub fn stream_mut(&mut self, name: &str) -> Option<&mut Stream> {
        if !self.streams.contains_key(name)
            && let Some(table) = Self::default_stream_table(name)
            && self.tables.contains_key(table)
        {
            self.streams.insert(name.to_string(), Stream::new(table, StreamType::Committed));
        }
        self.streams.get_mut(name).filter(|s| !s.deleted)
    }
}

/// A stream's rows at offsets `from..to`.
fn stream_rows(stream: &Stream, from: i64, to: i64) -> Vec<StoredRows> {
    let mut out = Vec::new();
    let mut start = 0_i64;
    for b in &stream.batches {
        let end = start + b.len() as i64;
        let (lo, hi) = (from.max(start), to.min(end));
        if lo < hi {
            out.push(b.slice((lo - start) as usize, (hi - lo) as usize));
        }
        start = end;
        if start >= to {
            break;
        }
    }
    out
}
