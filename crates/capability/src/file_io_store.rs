//! The `file-io` capability on object stores: grants of `s3://bucket/prefix`
//! and `gs://bucket/prefix`, served through `sluice-store`.
//!
//! Invariants:
//! - a plugin's location is judged before any request is sent: it must be
//!   an `s3://` or `gs://` URL with no `%` (no percent-encoding, so no
//!   encoded `/` or `..` reaches the store), no control character and no
//!   surrounding whitespace (which opendal would trim), no empty, `.` or
//!   `..` segment and no `?`, `#` or `\`; and it must lie inside a grant of
//!   the same scheme and bucket, compared segment by segment
//!   ([`Location::is_within`]: `s3://lake/wh` does not cover
//!   `s3://lake/wh-other`). Anything else is `denied`;
//! - `write-file` and `output-file` with `overwrite = false` are conditional
//!   creates (`If-None-Match: *` / `ifGenerationMatch=0`): a taken key is
//!   `already-exists`, never overwritten. On GCS a streamed one larger
//!   than one part first claims its key with an empty object (see
//!   `sluice-store`'s `gcs.rs`), so an upload a crash cut off leaves that
//!   empty object behind (plugins name exclusive files uniquely per attempt);
//! - an `output-file` of at most one part ([`DEFAULT_PART_SIZE`]) is held
//!   by the host and sent as one request at `finish`; a larger one streams
//!   a multipart upload: the host holds the part being filled and the parts
//!   in flight at most ([`upload_buffer_bytes`] of [`DEFAULT_PART_SIZE`],
//!   reserved from the instance's host memory while the file is open), a
//!   full part uploads in the background while the plugin encodes the
//!   next, and nothing is visible before `finish`; one dropped unfinished
//!   is aborted;
//! - a request refused for its credentials (`Denied`: 403, or S3's
//!   `ExpiredToken`) on a table whose credentials a REST catalog vended is
//!   sent once more after the table is loaded again for new ones (it was
//!   not applied, so this holds for conditional writes too); a streaming
//!   upload keeps the credentials it started with;
//! - reads are ranged (only the bytes asked for, reserved from the host
//!   memory before they are fetched); lists read one folder level;
//! - `rename` is refused as `other` with the words "cannot rename on an
//!   object store" (stores have no atomic rename; the WIT's error variants
//!   are frozen and have no `unsupported`), after both locations are judged;
//! - every request is awaited no later than the call's deadline (a
//!   [`HostDeadline`] traps the call); credentials never leave the host:
//!   S3 through the AWS default chain, GCS through Application Default
//!   Credentials (`sluice-store`).
//!
//! Folders do not exist on object stores: `create-dir-all` checks the grant
//! and sends nothing; a folder "exists" when some object lies under it (a
//! grant's root always does); `delete` of a folder deletes the objects
//! under it one by one (not atomically).

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sluice_store::{DEFAULT_PART_SIZE, ObjectStore, ObjectWriter, StoreError, upload_buffer_bytes};

use super::catalog_vended::Vended;
use super::limits::{HostDeadline, HostMemory, Reservation};
use crate::bindings::v0_2::sluice::connector::file_io::{FileStatus, IoError, TreeEntry};
use crate::location::{Location, Scheme, Served};

/// How the host reaches the object stores of its grants (the job's
/// `[sink.s3]` and `[sink.gcs]`; the file source's, from `[source.s3]` and
/// `[source.gcs]`). The default takes everything from the environment
/// (AWS chain, `AWS_REGION`, `AWS_ENDPOINT_URL`; Google ADC, or an emulator
/// named by `STORAGE_EMULATOR_HOST`).
pub use sluice_store::StoreOptions as StoreConfig;

/// Why a `file-io` call on an object store failed: an answer for the
/// plugin, or the call's deadline, which traps it.
#[derive(Debug)]
pub(super) enum Failure {
    Io(IoError),
    Deadline(HostDeadline),
}

impl From<IoError> for Failure {
    fn from(e: IoError) -> Self {
        Failure::Io(e)
    }
}

impl From<HostDeadline> for Failure {
    fn from(e: HostDeadline) -> Self {
        Failure::Deadline(e)
    }
}

impl Failure {
    /// For callers without a deadline (the in-process API): the deadline as `other`.
    pub(super) fn into_io(self) -> IoError {
        match self {
            Failure::Io(e) => e,
            Failure::Deadline(d) => IoError::Other(d.to_string()),
        }
    }
}

/// The answer of a store error, for the plugin.
fn io_error(e: StoreError) -> IoError {
    match e {
        StoreError::AlreadyExists { url } => IoError::AlreadyExists(url),
        StoreError::NotFound { url } => IoError::NotFound(url),
        e @ StoreError::Denied { .. } => {
            IoError::Denied(format!("the object store refused the host's credentials or access: {e}"))
        }
        e => IoError::Other(e.to_string()),
    }
}

/// Whether `location` names an object store (`s3://`, `gs://`, any case).
pub(super) fn is_object_url(location: &str) -> bool {
    let Some((scheme, _)) = location.split_once("://") else { return false };
    Scheme::ALL.iter().any(|s| s.as_str().eq_ignore_ascii_case(scheme))
}

/// A plugin's object-store location, judged strictly (see the module doc).
pub(super) fn parse_plugin_location(location: &str) -> Result<Location, IoError> {
    let denied = |why: &str| IoError::Denied(format!("{location}: {why}"));
    if location.contains('%') {
        return Err(denied("object locations take no percent-encoding (`%` is refused)"));
    }
    if location.chars().any(char::is_control) || location.trim() != location {
        return Err(denied("control characters and surrounding whitespace are refused in object locations"));
    }
    let all = Served { stores: &Scheme::ALL };
    // Object URLs never depend on the base directory.
    Location::parse(location, Path::new("/"), all).map_err(|e| IoError::Denied(e.to_string()))
}

/// One granted object-store location.
#[derive(Clone)]
pub(super) struct ObjectGrant {
    /// `Location::ObjectStore`.
    pub(super) root: Location,
    pub(super) writable: bool,
    store: ObjectStore,
    /// Credentials a REST catalog vended for the tables under this grant.
    vended: Option<Arc<Vended>>,
}

/// `import` names, for deadline traps.
const READ: &str = "sluice:connector/file-io.read";
const STAT: &str = "sluice:connector/file-io.stat";

/// Awaits `fut` no later than the call's deadline.
fn wait<T>(import: &'static str, fut: impl Future<Output = T>) -> Result<T, HostDeadline> {
    super::block_on(import, fut)
}

/// The bucket of `root` (an object-store location), reached as `config`
/// says ([`ObjectStore::open`]). Sends nothing.
pub fn open_store(root: &Location, config: &StoreConfig) -> Result<ObjectStore, String> {
    ObjectStore::open(root, config).map_err(|e| e.to_string())
}

impl ObjectGrant {
    /// The grant of `root` (an object-store location). Sends nothing.
    pub(super) fn open(root: Location, writable: bool, config: &StoreConfig) -> Result<Self, String> {
        let store = open_store(&root, config)?;
        Ok(Self { root, writable, store, vended: None })
    }

    /// Signs the requests for vended tables' objects with their credentials.
    pub(super) fn use_vended(&mut self, vended: Arc<Vended>) {
        self.vended = Some(vended);
    }

    /// The store to reach `key` with: the one of the vended table covering
    /// it (credentials refreshed when due), else the grant's.
    fn store(&self, key: &str) -> ObjectStore {
        if let (Some(vended), Some(location)) = (&self.vended, self.location_of(key))
            && let Some(store) = vended.store_for(&location)
        {
            return store;
        }
        self.store.clone()
    }

    fn location_of(&self, key: &str) -> Option<Location> {
        match &self.root {
            Location::ObjectStore { scheme, bucket, .. } => {
                Some(Location::ObjectStore { scheme: *scheme, bucket: bucket.clone(), prefix: key.to_string() })
            }
            Location::Local(_) => None,
        }
    }

    /// `request` on the store for `key`; refused (`Denied`) with vended
    /// credentials, sent once more with the table's credentials loaded anew
    /// (see `catalog_vended.rs`: a refused request was not applied).
    fn send<T, F, Fut>(
        &self,
        import: &'static str,
        key: &str,
        request: F,
    ) -> Result<Result<T, StoreError>, HostDeadline>
    where
        F: Fn(ObjectStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        let first = wait(import, request(self.store(key)))?;
        let (Err(StoreError::Denied { .. }), Some(vended), Some(location)) =
            (&first, &self.vended, self.location_of(key))
        else {
            return Ok(first);
        };
        match vended.refreshed_store_for(&location) {
            Some(store) => {
                tracing::info!(%location, "refused with the vended credentials: sent again with new ones");
                wait(import, request(store))
            }
            None => Ok(first),
        }
    }

    /// The grant root's key prefix (`""`: the whole bucket).
    fn root_prefix(&self) -> &str {
        match &self.root {
            Location::ObjectStore { prefix, .. } => prefix,
            Location::Local(_) => "",
        }
    }

    /// The number of segments of the root (to pick the deepest grant).
    pub(super) fn depth(&self) -> usize {
        let p = self.root_prefix();
        if p.is_empty() { 0 } else { p.split('/').count() }
    }

    pub(super) fn describe(&self) -> String {
        format!("{} ({})", self.root, if self.writable { "read-write" } else { "read-only" })
    }

    fn is_root(&self, key: &str) -> bool {
        key == self.root_prefix()
    }

    /// `key` names an object (not the grant's root, which is a folder).
    fn file_key<'k>(&self, key: &'k str, location: &str) -> Result<&'k str, IoError> {
        if self.is_root(key) {
            return Err(IoError::Denied(format!("{location} is the granted root {}, not a file", self.root)));
        }
        Ok(key)
    }

    /// Whether `key` is a folder: the root, or a prefix some object lies under.
    fn is_folder(&self, import: &'static str, key: &str) -> Result<bool, Failure> {
        if self.is_root(key) {
            return Ok(true);
        }
        Ok(self.send(import, key, |s| async move { s.has_children(key).await })?.map_err(io_error)?)
    }

    pub(super) fn exists(&self, key: &str) -> Result<bool, Failure> {
        const IMPORT: &str = "sluice:connector/file-io.exists";
        if self.is_root(key) {
            return Ok(true);
        }
        match self.send(IMPORT, key, |s| async move { s.stat(key).await })? {
            Ok(_) => Ok(true),
            Err(StoreError::NotFound { .. }) => self.is_folder(IMPORT, key),
            Err(e) => Err(io_error(e).into()),
        }
    }

    pub(super) fn stat(&self, key: &str, location: &str) -> Result<FileStatus, Failure> {
        if !self.is_root(key) {
            match self.send(STAT, key, |s| async move { s.stat(key).await })? {
                Ok(info) => return Ok(FileStatus { size: info.size, is_dir: false }),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(io_error(e).into()),
            }
        }
        if self.is_folder(STAT, key)? {
            Ok(FileStatus { size: 0, is_dir: true })
        } else {
            Err(IoError::NotFound(location.to_string()).into())
        }
    }

    /// Up to `length` bytes from `offset`, reserved from `memory` first.
    pub(super) fn read(
        &self,
        key: &str,
        location: &str,
        offset: u64,
        length: u64,
        memory: &Arc<HostMemory>,
    ) -> Result<Vec<u8>, Failure> {
        let key = self.file_key(key, location)?;
        let size = self.send(READ, key, |s| async move { s.stat(key).await })?.map_err(io_error)?.size;
        let wanted = length.min(size.saturating_sub(offset));
        let _held = reserve(memory, &format!("reading {location}"), wanted)?;
        // A ranged read of exactly `wanted` bytes: an object that grew since
        // the stat cannot make it hold more.
        let bytes =
            self.send(READ, key, |s| async move { s.read_range(key, offset, wanted).await })?.map_err(io_error)?;
        Ok(bytes.to_vec())
    }

    pub(super) fn list_dir(&self, key: &str, location: &str) -> Result<Vec<String>, Failure> {
        const IMPORT: &str = "sluice:connector/file-io.list-dir";
        let names = self.send(IMPORT, key, |s| async move { s.list_level(key).await })?.map_err(io_error)?;
        if names.is_empty() && !self.is_root(key) {
            return Err(IoError::NotFound(location.to_string()).into());
        }
        Ok(names)
    }

    /// Every object under the folder `key`, named in the form `location`
    /// was given. A missing folder is empty (object stores have none).
    pub(super) fn list_tree(&self, key: &str, location: &str) -> Result<Vec<TreeEntry>, Failure> {
        const IMPORT: &str = "sluice:connector/file-io.list-tree";
        let objects = self.send(IMPORT, key, |s| async move { s.list(key).await })?.map_err(io_error)?;
        let base = location.trim_end_matches('/');
        let prefix = if key.is_empty() { String::new() } else { format!("{}/", key.trim_end_matches('/')) };
        Ok(objects
            .into_iter()
            .filter_map(|o| {
                let rel = o.key.strip_prefix(&prefix)?.to_string();
                Some(TreeEntry { location: format!("{base}/{rel}"), size: o.size, modified_ms: o.modified_ms })
            })
            .collect())
    }

    /// One whole object: a conditional create unless `overwrite`.
    pub(super) fn write_file(
        &self,
        key: &str,
        location: &str,
        contents: Vec<u8>,
        overwrite: bool,
        memory: &Arc<HostMemory>,
    ) -> Result<(), Failure> {
        const IMPORT: &str = "sluice:connector/file-io.write-file";
        let key = self.file_key(key, location)?;
        let _held = reserve(memory, &format!("writing {location}"), contents.len() as u64)?;
        self.put(IMPORT, key, Bytes::from(contents), overwrite)
    }

    /// The object `key`, or every object under the folder `key`.
    pub(super) fn delete(&self, key: &str, location: &str) -> Result<(), Failure> {
        const IMPORT: &str = "sluice:connector/file-io.delete";
        if self.is_root(key) {
            return Err(IoError::Denied(format!("cannot delete the granted root {location}")).into());
        }
        match self.send(IMPORT, key, |s| async move { s.stat(key).await })? {
            Ok(_) => return Ok(self.send(IMPORT, key, |s| async move { s.delete(key).await })?.map_err(io_error)?),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(io_error(e).into()),
        }
        let under = self.send(IMPORT, key, |s| async move { s.list(key).await })?.map_err(io_error)?;
        if under.is_empty() {
            return Err(IoError::NotFound(location.to_string()).into());
        }
        for object in under {
            let key = object.key.as_str();
            self.send(IMPORT, key, |s| async move { s.delete(key).await })?.map_err(io_error)?;
        }
        Ok(())
    }

    /// Starts an upload of `key`: nothing is sent until it holds more than
    /// one part (see [`ObjectOutput`]).
    pub(super) fn create_output(
        &self,
        key: &str,
        location: &str,
        overwrite: bool,
        memory: &Arc<HostMemory>,
    ) -> Result<ObjectOutput, Failure> {
        let key = self.file_key(key, location)?;
        let held =
            reserve(memory, &format!("the upload buffers of {location}"), upload_buffer_bytes(DEFAULT_PART_SIZE))?;
        Ok(ObjectOutput {
            location: location.to_string(),
            grant: self.clone(),
            key: key.to_string(),
            overwrite,
            state: Upload::Buffering(Vec::new()),
            _held: held,
        })
    }

    /// One whole object of `bytes`: a conditional create unless `overwrite`
    /// (the request [`ObjectGrant::send`] may send twice).
    fn put(&self, import: &'static str, key: &str, bytes: Bytes, overwrite: bool) -> Result<(), Failure> {
        if !overwrite {
            self.send(import, key, |s| {
                let bytes = bytes.clone();
                async move { s.create_exclusive(key, bytes).await }
            })?
            .map_err(io_error)?;
            return Ok(());
        }
        self.send(import, key, |store| {
            let bytes = bytes.clone();
            async move {
                let mut writer = store.writer(key, false, DEFAULT_PART_SIZE).await?;
                writer.write(bytes).await?;
                writer.finish().await
            }
        })?
        .map_err(io_error)?;
        Ok(())
    }
}

/// The error `rename` answers on object stores (see the module doc).
pub(super) fn rename_unsupported(from: &str, to: &str) -> IoError {
    IoError::Other(format!(
        "{from} -> {to}: cannot rename on an object store (s3://, gs://): it has no atomic rename; \
         write under the final name with an exclusive create instead"
    ))
}

/// Reserves `bytes` of host memory for `what`, or answers `other` naming the budget.
fn reserve(memory: &Arc<HostMemory>, what: &str, bytes: u64) -> Result<Reservation, IoError> {
    memory.reserve(what, bytes).map_err(|e| IoError::Other(e.to_string()))
}

/// An `output-file` on an object store. It holds what the plugin wrote
/// until that exceeds one part, so an object of at most one part (most
/// manifests and small data files) is one request at `finish`, sent again
/// with new credentials if vended ones are refused; a larger one becomes a
/// streaming upload, which keeps the credentials it started with.
pub struct ObjectOutput {
    location: String,
    grant: ObjectGrant,
    key: String,
    overwrite: bool,
    state: Upload,
    /// The part being filled and the parts in flight, held against the host memory.
    _held: Reservation,
}

enum Upload {
    /// Nothing sent yet: at most one part.
    Buffering(Vec<u8>),
    Streaming(ObjectWriter),
    Finished,
}

impl ObjectOutput {
    pub(super) fn write(&mut self, contents: Vec<u8>) -> Result<(), Failure> {
        const IMPORT: &str = "sluice:connector/file-io.[method]output-file.write";
        match &mut self.state {
            Upload::Finished => Err(IoError::Other(format!("{}: already finished", self.location)).into()),
            Upload::Streaming(writer) => Ok(wait(IMPORT, writer.write(Bytes::from(contents)))?.map_err(io_error)?),
            Upload::Buffering(buffer) if buffer.len() + contents.len() <= DEFAULT_PART_SIZE => {
                buffer.extend_from_slice(&contents);
                Ok(())
            }
            Upload::Buffering(buffer) => {
                let mut first = std::mem::take(buffer);
                first.extend_from_slice(&contents);
                let (key, exclusive) = (self.key.as_str(), !self.overwrite);
                let mut writer = self
                    .grant
                    .send(IMPORT, key, |s| async move { s.writer(key, exclusive, DEFAULT_PART_SIZE).await })?
                    .map_err(io_error)?;
                let sent = wait(IMPORT, writer.write(Bytes::from(first)));
                self.state = Upload::Streaming(writer);
                Ok(sent?.map_err(io_error)?)
            }
        }
    }

    pub(super) fn finish(&mut self) -> Result<(), Failure> {
        const IMPORT: &str = "sluice:connector/file-io.[method]output-file.finish";
        match std::mem::replace(&mut self.state, Upload::Finished) {
            Upload::Finished => Err(IoError::Other(format!("{}: already finished", self.location)).into()),
            Upload::Buffering(buffer) => self.grant.put(IMPORT, &self.key, Bytes::from(buffer), self.overwrite),
            Upload::Streaming(writer) => {
                wait(IMPORT, writer.finish())?.map_err(io_error)?;
                Ok(())
            }
        }
    }
}

impl Drop for ObjectOutput {
    /// An unfinished upload is abandoned: its parts are freed in the
    /// background (best effort; stores also expire unfinished uploads).
    fn drop(&mut self) {
        if let Upload::Streaming(writer) = std::mem::replace(&mut self.state, Upload::Finished) {
            super::runtime().spawn(async move {
                let _ = writer.abort().await;
            });
        }
    }
}
