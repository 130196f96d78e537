//! The file source's input on an object store (`source.path =
//! "s3://bucket/prefix"` or `"gs://bucket/prefix"`), read through
//! `sluice-store`.
//!
//! Invariants:
//! - a folder is listed once, when the source opens: every object's key,
//!   size and ETag come from that one listing, and a resume compares them
//!   with what the checkpoint recorded before anything is read;
//! - an object is read only by ranged GETs of the bytes asked for: a
//!   sequential reader (CSV, JSON lines) holds one chunk at a time
//!   (growing from [`FIRST_CHUNK`] to [`MAX_CHUNK`]), and Parquet asks for
//!   its footer and the column chunks it decodes, never the whole object;
//! - a read asks for the object's size as listed, so an object that grew
//!   since cannot hand over more rows than the listing promised (its ETag
//!   check refuses the resume anyway);
//! - every read of an object is pinned to the version listed (`If-Match` on
//!   its ETag on S3; on GCS its generation, stated at the first read and
//!   checked against the listed ETag): an object replaced while it is read
//!   stops the run, naming it, and never hands over bytes of two versions;
//! - the store's futures run on the host's I/O runtime and the caller waits
//!   on a channel, so this works on any thread, inside a runtime or not;
//! - the store is reached as the job's `[source.s3]` / `[source.gcs]` say
//!   (`Job::source_stores`), every key left out from the environment: the
//!   AWS default chain for S3, Google Application Default Credentials (or
//!   `STORAGE_EMULATOR_HOST`) for GCS; credentials stay in the host.

use std::io::{BufRead, Read};
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use sluice_store::{ObjectInfo, ObjectStore, Pinned, StoreError};

use super::SourceError;

/// The first ranged GET of a sequential reader: small, since a reader may
/// want only a few bytes (a Parquet footer, a short CSV).
pub const FIRST_CHUNK: u64 = 256 << 10;
/// The largest ranged GET a sequential reader holds.
pub const MAX_CHUNK: u64 = 8 << 20;

/// Runs `fut` on the host's I/O runtime and waits for it on this thread.
fn block<T: Send + 'static>(url: &str, fut: impl Future<Output = T> + Send + 'static) -> Result<T, SourceError> {
    sluice_core::runtime::wait(fut).map_err(|e| SourceError::File { path: url.to_string(), message: e.to_string() })
}

fn store_err(e: StoreError) -> SourceError {
    let url = match &e {
        StoreError::AlreadyExists { url }
        | StoreError::Conflict { url, .. }
        | StoreError::Contended { url }
        | StoreError::NotFound { url }
        | StoreError::Denied { url, .. }
        | StoreError::Unsupported { url, .. }
        | StoreError::Config { url, .. }
        | StoreError::NoCredentials { url, .. }
        | StoreError::InvalidKey { url, .. }
        | StoreError::Other { url, .. } => url.clone(),
    };
    SourceError::File { path: url, message: e.to_string() }
}

/// One bucket the source reads.
#[derive(Debug, Clone)]
pub struct Bucket {
    store: ObjectStore,
}

impl Bucket {
    pub fn new(store: ObjectStore) -> Self {
        Self { store }
    }

    /// `s3://bucket/key`.
    pub fn url(&self, key: &str) -> String {
        self.store.url(key)
    }

    /// The object `key`, when there is one (`None`: no such object).
    pub fn stat(&self, key: &str) -> Result<Option<ObjectInfo>, SourceError> {
        let store = self.store.clone();
        let owned = key.to_string();
        match block(&self.url(key), async move { store.stat(&owned).await })? {
            Ok(info) => Ok(Some(info)),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(e)),
        }
    }

    /// Every object under the folder `prefix`, at any depth, sorted by key.
    pub fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, SourceError> {
        let store = self.store.clone();
        let owned = prefix.to_string();
        block(&self.url(prefix), async move { store.list(&owned).await })?.map_err(store_err)
    }

    /// One object as listed, to read.
    pub fn file(&self, info: &ObjectInfo) -> ObjectFile {
        ObjectFile {
            store: self.store.clone(),
            key: info.key.clone(),
            size: info.size,
            etag: info.etag.clone(),
            pinned: Arc::default(),
            url: self.url(&info.key),
        }
    }
}

/// An object to read, with the size and ETag it was listed with.
#[derive(Debug, Clone)]
pub struct ObjectFile {
    store: ObjectStore,
    key: String,
    size: u64,
    etag: Option<String>,
    /// The version every read is pinned to, found at the first read (shared
    /// by the clones a reader makes).
    pinned: Arc<OnceLock<Pinned>>,
    url: String,
}

impl ObjectFile {
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Up to `length` bytes from `offset`, no further than the listed size.
    fn range(&self, offset: u64, length: u64) -> Result<Bytes, SourceError> {
        let length = length.min(self.size.saturating_sub(offset));
        if length == 0 {
            return Ok(Bytes::new());
        }
        let pinned = self.pinned()?;
        let (store, key) = (self.store.clone(), self.key.clone());
        block(&self.url, async move { store.read_range_of(&key, offset, length, &pinned).await })?
            .map_err(|e| self.read_err(e))
    }

    /// The version listed, which every read must return.
    fn pinned(&self) -> Result<Pinned, SourceError> {
        if let Some(pinned) = self.pinned.get() {
            return Ok(pinned.clone());
        }
        let Some(etag) = self.etag.clone() else {
            return Err(SourceError::File {
                path: self.url.clone(),
                message: "the store listed it without an ETag, so its reads cannot be held to one version".into(),
            });
        };
        let (store, key) = (self.store.clone(), self.key.clone());
        let pinned = block(&self.url, async move { store.pin(&key, &etag).await })?.map_err(|e| self.read_err(e))?;
        Ok(self.pinned.get_or_init(|| pinned).clone())
    }

    /// A read that failed; a version other than the one listed says so.
    fn read_err(&self, e: StoreError) -> SourceError {
        match e {
            StoreError::Conflict { .. } => SourceError::File {
                path: self.url.clone(),
                message: format!(
                    "it was replaced since it was listed (with ETag {}): the run stops rather than land rows of \
                     two versions. Put the listed version back and run again, or start over with \
                     --new-incarnation to read what is there now",
                    self.etag.as_deref().unwrap_or("none")
                ),
            },
            e => store_err(e),
        }
    }

    /// A sequential reader from `offset`.
    pub fn reader(&self, offset: u64) -> ObjectRead {
        ObjectRead { file: self.clone(), next: offset, chunk: FIRST_CHUNK, buf: Bytes::new() }
    }
}

fn io_err(e: SourceError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Reads an object front to back in ranged GETs, one chunk held at a time.
pub struct ObjectRead {
    file: ObjectFile,
    /// The offset of the byte after `buf`.
    next: u64,
    /// The size of the next GET.
    chunk: u64,
    buf: Bytes,
}

impl BufRead for ObjectRead {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        if self.buf.is_empty() && self.next < self.file.size {
            self.buf = self.file.range(self.next, self.chunk).map_err(io_err)?;
            if self.buf.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "{} ended at byte {} although it was listed with {} bytes (was it replaced?)",
                        self.file.url, self.next, self.file.size
                    ),
                ));
            }
            self.next += self.buf.len() as u64;
            self.chunk = (self.chunk * 2).min(MAX_CHUNK);
        }
        Ok(&self.buf)
    }

    fn consume(&mut self, amt: usize) {
        let amt = amt.min(self.buf.len());
        let _ = self.buf.split_to(amt);
    }
}

impl Read for ObjectRead {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let available = self.fill_buf()?;
        let n = available.len().min(out.len());
        out[..n].copy_from_slice(&available[..n]);
        self.consume(n);
        Ok(n)
    }
}

impl parquet::file::reader::Length for ObjectFile {
    fn len(&self) -> u64 {
        self.size
    }
}

impl parquet::file::reader::ChunkReader for ObjectFile {
    type T = ObjectRead;

    fn get_read(&self, start: u64) -> parquet::errors::Result<ObjectRead> {
        Ok(self.reader(start))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let bytes = self.range(start, length as u64).map_err(|e| parquet::errors::ParquetError::External(e.into()))?;
        if bytes.len() != length {
            return Err(parquet::errors::ParquetError::EOF(format!(
                "{}: asked for {length} bytes at {start}, got {} (the object is {} bytes as listed)",
                self.url,
                bytes.len(),
                self.size
            )));
        }
        Ok(bytes)
    }
}
