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

use std::collections::HashMap;
use std::sync::Arc;

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    TableSchema, write_stream::Type as StreamType,
};
use prost_reflect::MessageDescriptor;

/// Rows of one acknowledged append: proto rows with the descriptor that
/// decodes them, or an Arrow record batch.
#[derive(Clone)]
pub enum StoredRows {
    Proto { descriptor: Arc<MessageDescriptor>, rows: Vec<Vec<u8>> },
    Arrow(arrow_array::RecordBatch),
}

impl StoredRows {
    pub fn len(&self) -> usize {
        match self {
            StoredRows::Proto { rows, .. } => rows.len(),
            StoredRows::Arrow(batch) => batch.num_rows(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` rows.
    pub fn head(&self, n: usize) -> StoredRows {
        match self {
            StoredRows::Proto { descriptor, rows } => {
                StoredRows::Proto { descriptor: descriptor.clone(), rows: rows[..n.min(rows.len())].to_vec() }
            }
            StoredRows::Arrow(batch) => StoredRows::Arrow(batch.slice(0, n.min(batch.num_rows()))),
        }
    }

    /// The rows as JSON, keyed by column name.
    pub fn to_json(&self) -> Vec<serde_json::Map<String, serde_json::Value>> {
        match self {
            StoredRows::Proto { descriptor, rows } => {
                rows.iter().map(|r| crate::schema::to_json(descriptor, r)).collect()
            }
            StoredRows::Arrow(batch) => crate::arrow_rows::to_json(batch),
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
}

impl Table {
    pub fn new(schema: TableSchema) -> Self {
        Table { schema, version: 1, labels: serde_json::Map::new(), description: None }
    }
}

#[derive(Default)]
pub struct Inner {
    pub tables: HashMap<String, Table>,
    pub streams: HashMap<String, Stream>,
    pub next_stream: u64,
}

impl Inner {
    /// The rows readers of `table` see now: each stream's rows up to what
    /// is visible of it (flushed, committed, or all for `_default`).
    pub fn visible_batches(&self, table: &str) -> Vec<StoredRows> {
        let mut out = Vec::new();
        for stream in self.streams.values().filter(|s| s.table == table) {
            let mut left = stream.visible();
            for b in &stream.batches {
                if left <= 0 {
                    break;
                }
                let take = (b.len() as i64).min(left);
                left -= take;
                out.push(b.head(take as usize));
            }
        }
        out
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
