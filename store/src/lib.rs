//! Sluice's object-store layer: one bucket of S3 (or an S3-compatible store)
//! or Google Cloud Storage, with the operations the engine's exactly-once
//! protocol needs of it: exclusive create, read with the object's ETag,
//! compare-and-swap on that ETag, list, delete, and a streaming (multipart)
//! writer.
//!
//! Invariants:
//! - an exclusive create is a conditional write (`If-None-Match: *` on S3,
//!   on `PutObject` and on `CompleteMultipartUpload`; `ifGenerationMatch=0`
//!   on GCS), so of two creators exactly one succeeds and the other gets
//!   [`StoreError::AlreadyExists`]; nothing is read first and compared;
//! - a replace names the version it expects, and a stale one is
//!   [`StoreError::Conflict`], never an overwrite. The version token (the
//!   `etag` of [`Versioned`], and what [`ObjectStore::create_exclusive`] and
//!   [`ObjectStore::replace_if`] return) is the ETag on S3 (`If-Match`) and
//!   the object's generation on GCS (`ifGenerationMatch`; see `gcs.rs`);
//! - the layer never retries. A conditional write whose answer was lost may
//!   have been applied, and its retry would answer "already exists" or
//!   "conflict" for its own first attempt; so any error other than those two
//!   leaves the outcome unknown, and the caller decides by reading back;
//! - every error names the object as a URL (`s3://bucket/key`);
//! - keys are plain object keys: not empty, no leading or trailing `/`, no
//!   control character, and no segment that starts or ends with
//!   whitespace (opendal would trim it, and reach another object).
//!
//! Credentials stay in the host and come from the platforms' standard
//! chains, through reqsign's signers (opendal's own, and for `gcs.rs`'s
//! requests a Google signer built as opendal builds it); no signing code
//! of our own:
//! - S3: the AWS default chain (the `AWS_*` variables, the shared config and
//!   credentials files with `AWS_PROFILE`, web identity, ECS, IMDS), the
//!   region from [`S3Options::region`], `AWS_REGION`/`AWS_DEFAULT_REGION`,
//!   or the active profile's `region` in the shared config file (`aws.rs`:
//!   opendal reads no config file for it), the endpoint from
//!   [`S3Options::endpoint`] or `AWS_ENDPOINT_URL`;
//!   `http://` endpoints are allowed (local test servers);
//! - GCS: Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
//!   the gcloud well-known file, the metadata server at `GCE_METADATA_HOST`);
//!   with `STORAGE_EMULATOR_HOST` set ([`GcsOptions::from_env`]), requests go
//!   unsigned to that emulator instead, as Google's own client libraries do.
//!
//! Why opendal rather than object_store: the host's SQL catalog must write
//! table metadata to the same stores, and iceberg 0.10.1 (pinned) ships its
//! pluggable storage for S3 and GCS as `iceberg-storage-opendal` 0.10.1, on
//! this same opendal 0.57; object_store would mean a second store crate (or
//! an iceberg `Storage` of our own) beside it. opendal also sends the
//! conditional headers on multipart completion and loads AWS profile files,
//! which object_store does not. What opendal 0.57 lacks: a conditional
//! replace on GCS (its GCS service sends no generation precondition but
//! `ifGenerationMatch=0`, and reads report no generation), so on GCS
//! [`ObjectStore::create_exclusive`], [`ObjectStore::replace_if`] and
//! [`ObjectStore::read_versioned`] send JSON API requests of their own
//! (`gcs.rs`), through opendal's HTTP client and signed by the same
//! reqsign Google chain; and its GCS multipart uploads carry no
//! precondition, so an exclusive [`ObjectStore::writer`] on GCS claims its
//! key with an exclusive empty object and then streams a resumable upload
//! that may replace only that claim (`gcs.rs`).
//!
//! TLS is rustls on ring with the system's roots (rustls-platform-verifier),
//! as the host's other clients.
//!
//! Why a crate of its own: opendal, its signers and a second reqwest (0.13,
//! which opendal 0.57 needs; the host's is 0.12) compile in parallel with
//! the host instead of inside it, and the host takes them only once a
//! location is wired to a store.

use std::sync::Arc;

use bytes::Bytes;
use opendal::{ErrorKind, Operator};
use sluice_core::location::{Location, Scheme};
use thiserror::Error;

pub mod aws;
mod gcs;
pub mod spec;

/// Parts of a streaming upload (S3's minimum part is 5 MiB).
pub const DEFAULT_PART_SIZE: usize = 8 << 20;

/// Parts of one streaming upload in flight at once, on the tokio runtime
/// the writer is driven from (opendal's `executors-tokio`): a full part is
/// sent in the background while the caller fills the next, so uploading
/// overlaps encoding instead of stalling it.
pub const UPLOAD_CONCURRENCY: usize = 2;

/// The most an upload of `part_size` parts holds in memory: the part being
/// filled and [`UPLOAD_CONCURRENCY`] parts in flight.
pub const fn upload_buffer_bytes(part_size: usize) -> u64 {
    (part_size * (1 + UPLOAD_CONCURRENCY)) as u64
}

/// The content type of every object written: it also makes opendal's GCS
/// service send uploads as `uploadType=multipart`, which every GCS server
/// we test against honours preconditions on (fake-gcs-server ignores them
/// on `uploadType=media`).
const CONTENT_TYPE: &str = "application/octet-stream";

/// An object-store operation that failed.
#[derive(Debug, Error)]
pub enum StoreError {
    /// An exclusive create found the object there.
    #[error("{url} already exists")]
    AlreadyExists { url: String },
    /// A replace's ETag no longer matches: someone else wrote in between.
    #[error("{url} changed since it was read: its ETag is no longer {expected}")]
    Conflict { url: String, expected: String },
    /// Another conditional write of the same object is in flight (S3's 409
    /// `ConditionalRequestConflict`); the outcome of this one is not decided.
    #[error("{url}: a concurrent conditional write of the same object is in flight; try again")]
    Contended { url: String },
    #[error("{url} does not exist")]
    NotFound { url: String },
    #[error("{url}: access denied: {source}")]
    Denied {
        url: String,
        #[source]
        source: Box<opendal::Error>,
    },
    /// The store cannot do what was asked (an operation its service lacks).
    #[error("{url}: {operation} is not supported by this store: {source}")]
    Unsupported {
        url: String,
        operation: &'static str,
        #[source]
        source: Box<opendal::Error>,
    },
    /// The store could not be set up (bucket, region, endpoint, TLS).
    #[error("{url}: cannot set up the store: {message}")]
    Config { url: String, message: String },
    /// The AWS chain gave no credential to sign with: nothing was sent.
    /// `message` names what was tried and what to do.
    #[error("{url}: {message}")]
    NoCredentials { url: String, message: String },
    #[error("{url} is not a valid object key: {message}")]
    InvalidKey { url: String, message: &'static str },
    /// Anything else: the outcome of a write is unknown.
    #[error("{url}: {operation} failed: {source}")]
    Other {
        url: String,
        operation: &'static str,
        #[source]
        source: Box<opendal::Error>,
    },
}

impl StoreError {
    /// Whether trying again later may succeed (throttling, a 5xx, a timeout,
    /// a contended conditional write). A retried write must first find out
    /// whether the failed one was applied.
    pub fn is_temporary(&self) -> bool {
        match self {
            StoreError::Contended { .. } => true,
            StoreError::Other { source, .. } => source.is_temporary(),
            _ => false,
        }
    }
}

/// Where and how to reach an S3 bucket; unset fields come from the AWS
/// environment.
#[derive(Debug, Clone, Default)]
pub struct S3Options {
    /// The signing region; default `AWS_REGION`, then `AWS_DEFAULT_REGION`,
    /// then the active profile's in the shared config file ([`aws::region`]).
    pub region: Option<String>,
    /// e.g. `http://127.0.0.1:5000`; default `AWS_ENDPOINT_URL`, then AWS.
    pub endpoint: Option<String>,
    /// Keys to sign with before the default chain is asked (credentials a
    /// REST catalog vends for a table; a test server's keys).
    pub credentials: Option<S3Credentials>,
    /// Address the bucket as `https://<bucket>.<endpoint>/<key>` instead of
    /// the default path style `https://<endpoint>/<bucket>/<key>`, which
    /// every S3-compatible server on a LAN (MinIO, Ceph) answers.
    pub virtual_host_style: bool,
}

/// How to reach each store, for one part of a job (its sink, its source,
/// its state directory). The default is the environment's: the AWS chain,
/// and Google's (or the emulator `STORAGE_EMULATOR_HOST` names).
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub s3: S3Options,
    pub gcs: GcsOptions,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self { s3: S3Options::default(), gcs: GcsOptions::from_env() }
    }
}

/// Static AWS keys. `Debug` never shows the secret parts.
#[derive(Clone)]
pub struct S3Credentials {
    pub access_key_id: String,
    pub secret_access_key: String,
    pub session_token: Option<String>,
}

impl std::fmt::Debug for S3Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Credentials").field("access_key_id", &self.access_key_id).finish_non_exhaustive()
    }
}

/// Where and how to reach a GCS bucket.
#[derive(Debug, Clone, Default)]
pub struct GcsOptions {
    /// e.g. `http://127.0.0.1:4443` for a test server; default Google's.
    pub endpoint: Option<String>,
    /// Send requests unsigned (a local test server); never for real GCS.
    pub anonymous: bool,
}

/// The variable Google's Cloud Storage client libraries read for an
/// emulator's address (`host:port` or a URL); when set they send requests
/// there, unauthenticated.
pub const STORAGE_EMULATOR_HOST: &str = "STORAGE_EMULATOR_HOST";

impl GcsOptions {
    /// Google's by default; an emulator's (unsigned) when the environment
    /// names one in [`STORAGE_EMULATOR_HOST`], as Google's client libraries
    /// do (a test server such as fake-gcs-server, never real GCS).
    pub fn from_env() -> Self {
        match std::env::var(STORAGE_EMULATOR_HOST) {
            Ok(host) if !host.trim().is_empty() => Self::emulator(host.trim()),
            _ => Self::default(),
        }
    }

    /// An emulator at `host` (`127.0.0.1:4443` or `http://127.0.0.1:4443`).
    pub fn emulator(host: &str) -> Self {
        let endpoint = if host.contains("://") { host.to_string() } else { format!("http://{host}") };
        Self { endpoint: Some(endpoint.trim_end_matches('/').to_string()), anonymous: true }
    }
}

/// An object's size and version, as listed or stated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The key, relative to the bucket.
    pub key: String,
    pub size: u64,
    /// The store's version tag, quoted as the store sends it.
    pub etag: Option<String>,
    /// When the object was last written, in ms since the Unix epoch, when
    /// the store says (S3 and GCS listings do).
    pub modified_ms: Option<i64>,
}

fn millis(meta: &opendal::Metadata) -> Option<i64> {
    let at = std::time::SystemTime::from(meta.last_modified()?);
    at.duration_since(std::time::UNIX_EPOCH).ok().and_then(|d| i64::try_from(d.as_millis()).ok())
}

/// The one version of an object reads are pinned to ([`ObjectStore::pin`]):
/// an ETag on S3, a generation on GCS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pinned(String);

/// Contents and the version they had when read (for a later [`ObjectStore::replace_if`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub bytes: Bytes,
    /// The version token: the ETag on S3; on GCS the object's generation
    /// (decimal), which unlike its ETag never repeats.
    pub etag: String,
}

/// One bucket.
#[derive(Clone)]
pub struct ObjectStore {
    op: Operator,
    /// GCS's JSON API, for what opendal does not send (`gcs.rs`).
    gcs_json: Option<Arc<gcs::GcsJson>>,
    /// `s3://bucket` or `gs://bucket`: the start of every URL in an error.
    root: String,
}

impl std::fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectStore").field("root", &self.root).finish()
    }
}

/// Makes ring the process's TLS provider if none is set yet. opendal's
/// HTTP client (reqwest 0.13 on rustls, built without a provider of its own
/// so that aws-lc-rs stays out of the build) panics without one; the rest of
/// the host uses ring too, so this changes nothing for it.
pub(crate) fn ensure_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An `Err` means a provider is already installed, which is all we need.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

impl ObjectStore {
    /// The bucket of `root` (an object-store location), reached as
    /// `options` say. Sends nothing. The one way Sluice opens a store for a
    /// location it was given: state directories, the file source, `file-io`
    /// grants and the catalog's warehouse storage.
    pub fn open(root: &Location, options: &StoreOptions) -> Result<Self, StoreError> {
        match root {
            Location::ObjectStore { scheme, bucket, .. } => Self::of(*scheme, bucket, options),
            Location::Local(path) => Err(StoreError::Config {
                url: path.display().to_string(),
                message: "a local path is not an object-store location".to_string(),
            }),
        }
    }

    /// Bucket `bucket` of the store `scheme` names. Sends nothing.
    pub fn of(scheme: Scheme, bucket: &str, options: &StoreOptions) -> Result<Self, StoreError> {
        match scheme {
            Scheme::S3 => Self::s3(bucket, &options.s3),
            Scheme::Gs => Self::gcs(bucket, &options.gcs),
        }
    }

    /// An S3 bucket, with credentials from the AWS default chain.
    pub fn s3(bucket: &str, options: &S3Options) -> Result<Self, StoreError> {
        ensure_tls_provider();
        let root = format!("s3://{bucket}");
        let (region, _) = aws::region(options).map_err(|message| StoreError::Config { url: root.clone(), message })?;
        let mut builder = opendal::services::S3::default().bucket(bucket).root("/").region(&region);
        if let Some(endpoint) = &options.endpoint {
            builder = builder.endpoint(endpoint);
        }
        if options.virtual_host_style {
            builder = builder.enable_virtual_host_style();
        }
        if let Some(keys) = &options.credentials {
            builder = builder.access_key_id(&keys.access_key_id).secret_access_key(&keys.secret_access_key);
            if let Some(token) = &keys.session_token {
                builder = builder.session_token(token);
            }
        }
        Self::finish(root, None, Operator::new(builder))
    }

    /// A GCS bucket, with Application Default Credentials (unless `anonymous`).
    pub fn gcs(bucket: &str, options: &GcsOptions) -> Result<Self, StoreError> {
        ensure_tls_provider();
        let root = format!("gs://{bucket}");
        let mut builder = opendal::services::Gcs::default().bucket(bucket).root("/");
        if let Some(endpoint) = &options.endpoint {
            builder = builder.endpoint(endpoint);
        }
        if options.anonymous {
            builder = builder.skip_signature().disable_vm_metadata();
        }
        Self::finish(root, Some((bucket, options)), Operator::new(builder))
    }

    /// The store, with an HTTP client of its own. opendal's default is one
    /// reqwest client for the whole process, whose pooled connections run
    /// on the tokio runtime that opened them: once that runtime is dropped,
    /// a request of any other store on such a connection fails ("dispatch
    /// task is gone"), or is cut off after it was sent, its outcome unknown.
    /// A client per store keeps one store's runtime from breaking another's.
    ///
    /// `gcs`: the bucket and options of a GCS store, whose JSON API
    /// requests (`gcs.rs`) go through the same client.
    fn finish(
        root: String,
        gcs: Option<(&str, &GcsOptions)>,
        built: opendal::Result<opendal::OperatorBuilder<impl opendal::raw::Access>>,
    ) -> Result<Self, StoreError> {
        let config = |message: String| StoreError::Config { url: root.clone(), message };
        let builder = built.map_err(|e| config(e.to_string()))?;
        let client =
            reqwest::Client::builder().build().map_err(|e| config(format!("cannot build an HTTP client: {e}")))?;
        let client = opendal::raw::HttpClient::with(client);
        let op = builder.layer(opendal::layers::HttpClientLayer::new(client.clone())).finish();
        let gcs_json = gcs.map(|(bucket, options)| Arc::new(gcs::GcsJson::new(bucket, options, client)));
        Ok(Self { op, gcs_json, root })
    }

    /// `s3://bucket/key`.
    pub fn url(&self, key: &str) -> String {
        if key.is_empty() { self.root.clone() } else { format!("{}/{key}", self.root) }
    }

    fn check_key(&self, key: &str) -> Result<(), StoreError> {
        let invalid = |message| Err(StoreError::InvalidKey { url: self.url(key), message });
        if key.is_empty() {
            return invalid("empty");
        }
        if key.starts_with('/') || key.ends_with('/') {
            return invalid("it starts or ends with `/`");
        }
        // opendal trims whitespace off the paths it is given, and this
        // layer's own GCS requests would not: such a key would name one
        // object to some requests and another to the rest.
        if key.split('/').any(|seg| seg.starts_with(char::is_whitespace) || seg.ends_with(char::is_whitespace)) {
            return invalid("a segment starts or ends with whitespace");
        }
        if key.chars().any(char::is_control) {
            return invalid("it holds a control character");
        }
        Ok(())
    }

    /// The error for `key`, by kind.
    fn error(&self, key: &str, operation: &'static str, e: opendal::Error) -> StoreError {
        let url = self.url(key);
        match e.kind() {
            ErrorKind::NotFound => StoreError::NotFound { url },
            ErrorKind::PermissionDenied => StoreError::Denied { url, source: Box::new(e) },
            _ if no_credential(&e) => {
                let hint = if self.gcs_json.is_some() { gcs::ADC_HINT } else { aws::CHAIN_HINT };
                StoreError::NoCredentials { url, message: format!("no credential to sign the request with: {hint}") }
            }
            _ if refused_credentials(&e) => StoreError::Denied { url, source: Box::new(e) },
            ErrorKind::Unsupported => StoreError::Unsupported { url, operation, source: Box::new(e) },
            _ => StoreError::Other { url, operation, source: Box::new(e) },
        }
    }

    /// A failed exclusive create: taken by someone else, or contended.
    fn create_error(&self, key: &str, operation: &'static str, e: opendal::Error) -> StoreError {
        match e.kind() {
            ErrorKind::ConditionNotMatch | ErrorKind::AlreadyExists if e.is_temporary() => {
                StoreError::Contended { url: self.url(key) }
            }
            ErrorKind::ConditionNotMatch | ErrorKind::AlreadyExists => StoreError::AlreadyExists { url: self.url(key) },
            _ => self.error(key, operation, e),
        }
    }

    /// Creates `key` with `bytes` only if no object is there; returns its
    /// version token (the ETag; on GCS the generation, always sent).
    pub async fn create_exclusive(&self, key: &str, bytes: Bytes) -> Result<Option<String>, StoreError> {
        self.check_key(key)?;
        if let Some(json) = &self.gcs_json {
            return self.gcs_insert(json, key, bytes, 0).await.map(Some);
        }
        let meta = self
            .op
            .write_with(key, bytes)
            .if_not_exists(true)
            .content_type(CONTENT_TYPE)
            .await
            .map_err(|e| self.create_error(key, "exclusive create", e))?;
        Ok(meta.etag().map(str::to_string))
    }

    /// Replaces `key` with `bytes` only if its version is still `etag` (a
    /// token from [`Versioned`] or a write: on GCS a generation, not the
    /// ETag of [`ObjectStore::stat`]); returns the new version token. An
    /// object gone meanwhile is a [`StoreError::Conflict`] on GCS.
    pub async fn replace_if(&self, key: &str, bytes: Bytes, etag: &str) -> Result<Option<String>, StoreError> {
        self.check_key(key)?;
        if let Some(json) = &self.gcs_json {
            let Some(generation) = gcs::parse_generation(etag) else {
                let why = format!("{etag:?} is not a GCS generation (the version token of read_versioned or a write)");
                return Err(StoreError::Other {
                    url: self.url(key),
                    operation: "conditional replace",
                    source: Box::new(opendal::Error::new(ErrorKind::Unexpected, why)),
                });
            };
            return self.gcs_insert(json, key, bytes, generation).await.map(Some);
        }
        let meta =
            self.op.write_with(key, bytes).if_match(etag).content_type(CONTENT_TYPE).await.map_err(|e| {
                match e.kind() {
                    ErrorKind::ConditionNotMatch if e.is_temporary() => StoreError::Contended { url: self.url(key) },
                    ErrorKind::ConditionNotMatch => {
                        StoreError::Conflict { url: self.url(key), expected: etag.to_string() }
                    }
                    _ => self.error(key, "conditional replace", e),
                }
            })?;
        Ok(meta.etag().map(str::to_string))
    }

    /// The whole object.
    pub async fn read(&self, key: &str) -> Result<Bytes, StoreError> {
        self.check_key(key)?;
        let buffer = self.op.read(key).await.map_err(|e| self.error(key, "read", e))?;
        Ok(buffer.to_bytes())
    }

    /// The whole object and the version token of exactly these contents
    /// (read with `If-Match` on the ETag just stated, again if it changed in
    /// between; on GCS pinned to the generation just stated).
    pub async fn read_versioned(&self, key: &str) -> Result<Versioned, StoreError> {
        self.check_key(key)?;
        if let Some(json) = &self.gcs_json {
            return self.gcs_read_versioned(json, key).await;
        }
        let mut attempts = 0;
        loop {
            let info = self.stat(key).await?;
            let Some(etag) = info.etag else {
                return Err(StoreError::Config {
                    url: self.url(key),
                    message: "the store sent no ETag, which a conditional replace needs".into(),
                });
            };
            match self.op.read_with(key).if_match(&etag).await {
                Ok(buffer) => return Ok(Versioned { bytes: buffer.to_bytes(), etag }),
                Err(e) if e.kind() == ErrorKind::ConditionNotMatch && attempts < 3 => attempts += 1,
                Err(e) => return Err(self.error(key, "read", e)),
            }
        }
    }

    /// Size and ETag of `key`.
    pub async fn stat(&self, key: &str) -> Result<ObjectInfo, StoreError> {
        self.check_key(key)?;
        let meta = self.op.stat(key).await.map_err(|e| self.error(key, "stat", e))?;
        Ok(ObjectInfo {
            key: key.to_string(),
            size: meta.content_length(),
            etag: meta.etag().map(str::to_string),
            modified_ms: millis(&meta),
        })
    }

    /// Every object under the folder `prefix` (`""`: the whole bucket), at
    /// any depth, sorted by key. `a/b` lists `a/b/...`, never `a/bc`.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>, StoreError> {
        let dir = if prefix.is_empty() {
            String::new()
        } else {
            self.check_key(prefix)?;
            format!("{prefix}/")
        };
        let entries = self.op.list_with(&dir).recursive(true).await.map_err(|e| self.error(prefix, "list", e))?;
        let mut out: Vec<ObjectInfo> = entries
            .into_iter()
            .filter(|e| e.metadata().is_file())
            .map(|e| ObjectInfo {
                key: e.path().to_string(),
                size: e.metadata().content_length(),
                etag: e.metadata().etag().map(str::to_string),
                modified_ms: millis(e.metadata()),
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// The version of `key` whose ETag is `etag` (as listed), to read with
    /// [`ObjectStore::read_range_of`]: on S3 the ETag itself (`If-Match`);
    /// on GCS the object's generation, stated now, after checking that the
    /// ETag is still `etag` (a generation, unlike an ETag, pins a read to
    /// one upload). Replaced since it was listed: [`StoreError::Conflict`].
    pub async fn pin(&self, key: &str, etag: &str) -> Result<Pinned, StoreError> {
        self.check_key(key)?;
        if self.gcs_json.is_none() {
            return Ok(Pinned(etag.to_string()));
        }
        let meta = self.op.stat(key).await.map_err(|e| self.error(key, "stat", e))?;
        let changed = || StoreError::Conflict { url: self.url(key), expected: etag.to_string() };
        if meta.etag() != Some(etag) {
            return Err(changed());
        }
        let generation = meta.version().ok_or_else(|| StoreError::Config {
            url: self.url(key),
            message: "GCS stated the object without a generation".into(),
        })?;
        Ok(Pinned(generation.to_string()))
    }

    /// Up to `length` bytes of `key` from `offset`, of the version `pinned`
    /// only: on S3 a ranged GET with `If-Match: <etag>`, on GCS one pinned
    /// to the generation (`generation=<g>`, which fails once that upload is
    /// no longer the live object). Another version there is
    /// [`StoreError::Conflict`], so bytes of two versions never mix.
    pub async fn read_range_of(
        &self,
        key: &str,
        offset: u64,
        length: u64,
        pinned: &Pinned,
    ) -> Result<Bytes, StoreError> {
        self.check_key(key)?;
        if length == 0 {
            return Ok(Bytes::new());
        }
        let changed = || StoreError::Conflict { url: self.url(key), expected: pinned.0.clone() };
        if let Some(json) = &self.gcs_json {
            return self.gcs_read_range(json, key, offset, length, &pinned.0).await;
        }
        let end = offset.saturating_add(length);
        match self.op.read_with(key).range(offset..end).if_match(&pinned.0).await {
            Ok(buffer) => Ok(buffer.to_bytes()),
            Err(e) if e.kind() == ErrorKind::ConditionNotMatch => Err(changed()),
            Err(e) => Err(self.error(key, "ranged read", e)),
        }
    }

    /// Up to `length` bytes of `key` from `offset` (fewer at its end; none
    /// at or past it): one ranged GET, so only those bytes are held.
    pub async fn read_range(&self, key: &str, offset: u64, length: u64) -> Result<Bytes, StoreError> {
        self.check_key(key)?;
        if length == 0 {
            return Ok(Bytes::new());
        }
        let end = offset.saturating_add(length);
        let buffer = self.op.read_with(key).range(offset..end).await.map_err(|e| self.error(key, "ranged read", e))?;
        Ok(buffer.to_bytes())
    }

    /// The names directly under the folder `prefix` (`""`: the bucket's
    /// top level), sorted: objects by their last segment, deeper objects by
    /// the one folder segment that leads to them (without a trailing `/`).
    pub async fn list_level(&self, prefix: &str) -> Result<Vec<String>, StoreError> {
        let dir = self.folder(prefix)?;
        let entries = self.op.list_with(&dir).await.map_err(|e| self.error(prefix, "list", e))?;
        let mut names: Vec<String> = entries
            .into_iter()
            .filter_map(|e| {
                let rest = e.path().strip_prefix(dir.as_str())?;
                let name = rest.trim_end_matches('/');
                (!name.is_empty()).then(|| name.to_string())
            })
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// Whether any object lies under the folder `prefix`: reads one page of
    /// a listing at most.
    pub async fn has_children(&self, prefix: &str) -> Result<bool, StoreError> {
        use tokio_stream::StreamExt;
        let dir = self.folder(prefix)?;
        let mut lister = self.op.lister_with(&dir).await.map_err(|e| self.error(prefix, "list", e))?;
        while let Some(entry) = lister.next().await {
            let entry = entry.map_err(|e| self.error(prefix, "list", e))?;
            if entry.path() != dir {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `prefix/` for a listing (`""` for the whole bucket).
    fn folder(&self, prefix: &str) -> Result<String, StoreError> {
        if prefix.is_empty() {
            return Ok(String::new());
        }
        self.check_key(prefix)?;
        Ok(format!("{prefix}/"))
    }

    /// Deletes `key`; deleting a missing object succeeds (as S3 and GCS do).
    pub async fn delete(&self, key: &str) -> Result<(), StoreError> {
        self.check_key(key)?;
        self.op.delete(key).await.map_err(|e| self.error(key, "delete", e))
    }

    /// A streaming writer of `key` in parts of `part_size` bytes (a single
    /// upload when the whole object is smaller). With `exclusive`, the
    /// upload completes only if no object is there. On S3 nothing is visible
    /// until [`ObjectWriter::finish`]; an exclusive upload on GCS larger
    /// than one part claims its key first with an empty object (see
    /// `gcs.rs`: opendal 0.57 uploads GCS parts through the XML multipart API
    /// without a precondition, so the JSON API's resumable upload is used).
    pub async fn writer(&self, key: &str, exclusive: bool, part_size: usize) -> Result<ObjectWriter, StoreError> {
        self.check_key(key)?;
        if exclusive && let Some(json) = &self.gcs_json {
            let upload = gcs::GcsUpload::new(Arc::clone(json), self.clone(), key, part_size);
            return Ok(ObjectWriter {
                store: self.clone(),
                key: key.to_string(),
                exclusive,
                inner: Inner::Gcs(Box::new(upload)),
                written: 0,
            });
        }
        let inner = self
            .op
            .writer_with(key)
            .if_not_exists(exclusive)
            .chunk(part_size)
            .concurrent(UPLOAD_CONCURRENCY)
            .content_type(CONTENT_TYPE)
            .await
            .map_err(|e| self.error(key, "start an upload", e))?;
        Ok(ObjectWriter {
            store: self.clone(),
            key: key.to_string(),
            exclusive,
            inner: Inner::Opendal(inner),
            written: 0,
        })
    }
}

/// S3 error codes that refuse the request's credentials rather than the
/// request, answered with `400` as well as `403`
/// (<https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html>):
/// `ExpiredToken` and `TokenRefreshRequired` are `400 Bad Request`, which
/// opendal reports as unexpected; the caller may get new credentials and
/// send the request again (it was not applied).
const CREDENTIAL_CODES: [&str; 5] =
    ["ExpiredToken", "TokenRefreshRequired", "InvalidToken", "InvalidAccessKeyId", "SignatureDoesNotMatch"];

/// Whether signing `e`'s request failed because the credential chain gave
/// no credential at all (reqsign's `Signer`: "failed to load signing
/// credential"), so the request was never sent.
fn no_credential(e: &opendal::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<reqsign_core::Error>()
            && r.kind() == reqsign_core::ErrorKind::CredentialInvalid
            && r.to_string().contains("failed to load signing credential")
        {
            return true;
        }
        source = s.source();
    }
    false
}

/// Whether `e` is the store refusing the request's credentials (opendal
/// puts the S3 error's `code` in its message). A `HEAD` (a stat) answers
/// with no body to name its code, so S3's bare `400 Bad Request` to a stat,
/// which is how it refuses an expired token there, counts too: opendal
/// exposes neither status nor operation but in its error's `Display`.
fn refused_credentials(e: &opendal::Error) -> bool {
    let message = e.message();
    if CREDENTIAL_CODES.iter().any(|code| message.contains(&format!("code: \"{code}\""))) {
        return true;
    }
    let shown = e.to_string();
    e.kind() == ErrorKind::Unexpected
        && message.trim().is_empty()
        && shown.contains(") at stat")
        && shown.contains("status: 400")
}

/// An upload in progress; dropped unfinished, it never becomes visible
/// (call [`ObjectWriter::abort`] to free the parts already sent), except
/// for the empty claim of an exclusive GCS upload (see [`ObjectStore::writer`]).
pub struct ObjectWriter {
    store: ObjectStore,
    key: String,
    exclusive: bool,
    inner: Inner,
    written: u64,
}

enum Inner {
    Opendal(opendal::Writer),
    Gcs(Box<gcs::GcsUpload>),
}

impl ObjectWriter {
    pub async fn write(&mut self, bytes: Bytes) -> Result<(), StoreError> {
        let len = bytes.len() as u64;
        match &mut self.inner {
            Inner::Opendal(inner) => {
                inner.write(bytes).await.map_err(|e| self.store.error(&self.key, "upload a part", e))?
            }
            Inner::Gcs(upload) => upload.write(bytes).await?,
        }
        self.written += len;
        Ok(())
    }

    /// Bytes handed to [`ObjectWriter::write`] so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Completes the upload and makes the object visible; returns its
    /// version token (the ETag; on an exclusive GCS upload the generation).
    pub async fn finish(self) -> Result<Option<String>, StoreError> {
        match self.inner {
            Inner::Gcs(upload) => upload.finish().await.map(Some),
            Inner::Opendal(mut inner) => match inner.close().await {
                Ok(meta) => Ok(meta.etag().map(str::to_string)),
                Err(e) if self.exclusive => Err(self.store.create_error(&self.key, "complete an upload", e)),
                Err(e) => Err(self.store.error(&self.key, "complete an upload", e)),
            },
        }
    }

    /// Abandons the upload and frees its parts.
    pub async fn abort(self) -> Result<(), StoreError> {
        match self.inner {
            Inner::Gcs(upload) => upload.abort().await,
            Inner::Opendal(mut inner) => {
                inner.abort().await.map_err(|e| self.store.error(&self.key, "abort an upload", e))
            }
        }
    }
}
