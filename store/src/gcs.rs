//! Exclusive create, compare-and-swap and versioned reads on GCS, through
//! its JSON API, with the object's **generation** as the version token.
//!
//! Why by hand: opendal 0.57's GCS service sends `ifGenerationMatch=0` on
//! uploads but no other generation precondition, and reports no generation
//! with a read, so it can neither replace conditionally nor tell which
//! version a read returned. These few requests are built here and sent
//! through the store's HTTP client (the one its opendal operator uses),
//! signed as opendal signs its GCS requests.
//!
//! Invariants:
//! - the version token is the object's generation (a decimal `u64`), never
//!   its ETag: an ETag may repeat (fake-gcs-server's is the MD5 of the
//!   contents, so writing back the same bytes keeps it), a generation never
//!   does;
//! - a write is one `uploadType=multipart` upload with `ifGenerationMatch`:
//!   `0` to create (only if no live object is there), the generation read to
//!   replace. That is the upload type fake-gcs-server honours preconditions
//!   on (it ignores them on `uploadType=media`); real GCS honours them on
//!   every upload type
//!   (<https://cloud.google.com/storage/docs/request-preconditions>);
//! - a failed precondition is documented as `412 Precondition Failed`; a
//!   `409 Conflict` is read the same way (neither writes anything), so of
//!   two writers on one generation exactly one succeeds and the other gets
//!   [`StoreError::AlreadyExists`] (create) or [`StoreError::Conflict`]
//!   (replace). A replace of an object that is gone is a conflict too (GCS
//!   answers 412 there; a server answering 404 means the same);
//! - a versioned read is consistent: the metadata gives generation `g`, then
//!   the media is read pinned to `generation=g` with `ifGenerationMatch=g`
//!   (and must not carry another `x-goog-generation`), so the bytes are
//!   those of generation `g`. Replaced in between, the media read fails
//!   (404/412) and the pair is read again. (Metadata and media fetched
//!   separately are not atomic, and fake-gcs-server ignores
//!   `ifGenerationMatch` on reads; the pinned generation holds on both.);
//! - requests are signed by reqsign's Google signer with the same
//!   Application Default Credentials chain and `devstorage.read_write`
//!   scope that opendal's GCS service builds (`GOOGLE_APPLICATION_CREDENTIALS`,
//!   gcloud's well-known file, the metadata server at `GCE_METADATA_HOST`);
//!   an anonymous store (a test server) signs nothing;
//! - nothing is retried (see the crate's invariants).

use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HOST};
use http::{HeaderValue, Request, Response, StatusCode};
use opendal::raw::{HttpClient, Multipart, RelatedPart};
use opendal::{Buffer, ErrorKind};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use reqsign_core::{Context, Env, OsEnv, Signer, StaticEnv};
use reqsign_file_read_tokio::TokioFileRead;
use reqsign_google::{Credential, DefaultCredentialProvider, RequestSigner};

use super::{GcsOptions, ObjectStore, StoreError, Versioned};

/// What opendal's GCS service defaults to, so both reach the same place.
const DEFAULT_ENDPOINT: &str = "https://storage.googleapis.com";
const SCOPE: &str = "https://www.googleapis.com/auth/devstorage.read_write";

/// Everything but RFC 3986's unreserved characters is escaped in an object
/// name, `/` included: the name is one path segment, or one query value.
const NAME: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// How often a versioned read starts over when the object is replaced
/// between its metadata and its media.
const READ_TRIES: usize = 4;

/// What the credential error says to do.
pub(crate) const ADC_HINT: &str = "tried Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's \
    well-known file (~/.config/gcloud/application_default_credentials.json), then the metadata server \
    (GCE_METADATA_HOST, default metadata.google.internal). Set GOOGLE_APPLICATION_CREDENTIALS to a \
    service-account key file, or run `gcloud auth application-default login`";

/// The JSON API of one bucket.
pub(crate) struct GcsJson {
    /// `https://storage.googleapis.com`, without a trailing `/`.
    endpoint: String,
    bucket: String,
    client: HttpClient,
    /// `None`: anonymous.
    signer: Option<Signer<Credential>>,
}

impl GcsJson {
    /// Sends nothing: credentials are loaded at the first request. `client`
    /// is the store's own (the one its opendal operator sends with).
    pub(crate) fn new(bucket: &str, options: &GcsOptions, client: HttpClient) -> Self {
        let endpoint = options.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT).trim_end_matches('/').to_string();
        let signer = (!options.anonymous).then(|| {
            // As opendal's GCS builder: the environment as it is now, with
            // the scope that a service-account key is exchanged for.
            let mut envs = OsEnv.vars();
            envs.insert("GOOGLE_SCOPE".to_string(), SCOPE.to_string());
            let ctx = Context::new()
                .with_file_read(TokioFileRead)
                .with_http_send(client.clone())
                .with_env(StaticEnv { home_dir: OsEnv.home_dir(), envs });
            Signer::new(ctx, DefaultCredentialProvider::new(), RequestSigner::new("storage").with_scope(SCOPE))
        });
        Self { endpoint, bucket: bucket.to_string(), client, signer }
    }

    /// `{endpoint}/storage/v1/b/{bucket}/o/{name}`
    fn object_url(&self, key: &str) -> String {
        format!("{}/storage/v1/b/{}/o/{}", self.endpoint, self.bucket, utf8_percent_encode(key, NAME))
    }

    /// Signs (unless anonymous) and sends `req`.
    async fn send(&self, req: Request<Buffer>) -> Result<Response<Buffer>, opendal::Error> {
        let req = match &self.signer {
            None => req,
            Some(signer) => {
                let (mut parts, body) = req.into_parts();
                signer.sign(&mut parts, None).await.map_err(|e| {
                    let retryable = e.is_retryable();
                    let err =
                        opendal::Error::new(ErrorKind::PermissionDenied, format!("no Google access token: {ADC_HINT}"))
                            .set_source(e);
                    if retryable { err.set_temporary() } else { err }
                })?;
                // As opendal does: the client sets Host for the HTTP version
                // it speaks (Google resets HTTP/2 streams that carry one).
                parts.headers.remove(HOST);
                Request::from_parts(parts, body)
            }
        };
        self.client.send(req).await
    }
}

/// The generation in a JSON object resource (a string in the JSON API, as
/// every int64; a number accepted too).
fn generation_of(body: &[u8]) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    match value.get("generation")? {
        serde_json::Value::String(s) => s.parse().ok(),
        serde_json::Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// A version token given back to [`ObjectStore::replace_if`] on GCS: a
/// generation, never 0 (which would turn the replace into a create).
pub(crate) fn parse_generation(token: &str) -> Option<u64> {
    token.parse().ok().filter(|&g| g != 0)
}

fn body_text(body: &Buffer) -> String {
    let bytes = body.to_bytes();
    let text = String::from_utf8_lossy(&bytes);
    let text = text.trim();
    match text.char_indices().nth(300) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_string(),
    }
}

impl ObjectStore {
    /// The error of an answer that is not one the caller handles.
    fn gcs_status_error(&self, key: &str, operation: &'static str, resp: &Response<Buffer>) -> StoreError {
        let status = resp.status();
        let kind = match status {
            StatusCode::NOT_FOUND => return StoreError::NotFound { url: self.url(key) },
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => ErrorKind::PermissionDenied,
            _ => ErrorKind::Unexpected,
        };
        let err = opendal::Error::new(kind, format!("GCS answered {status}: {}", body_text(resp.body())))
            .with_operation(operation)
            .with_context("service", "gcs (JSON API)");
        let temporary = status == StatusCode::TOO_MANY_REQUESTS
            || status == StatusCode::REQUEST_TIMEOUT
            || status.is_server_error();
        self.error(key, operation, if temporary { err.set_temporary() } else { err })
    }

    /// Uploads `bytes` to `key` only if its generation is `generation` (0:
    /// only if there is no live object); returns the new generation.
    pub(crate) async fn gcs_insert(
        &self,
        json: &GcsJson,
        key: &str,
        bytes: Bytes,
        generation: u64,
    ) -> Result<String, StoreError> {
        let operation = if generation == 0 { "exclusive create" } else { "conditional replace" };
        let url = format!(
            "{}/upload/storage/v1/b/{}/o?uploadType=multipart&name={}&ifGenerationMatch={generation}",
            json.endpoint,
            json.bucket,
            utf8_percent_encode(key, NAME)
        );
        let metadata = serde_json::json!({ "name": key, "contentType": super::CONTENT_TYPE }).to_string();
        let req = Multipart::new()
            .part(
                RelatedPart::new()
                    .header(CONTENT_TYPE, HeaderValue::from_static("application/json; charset=UTF-8"))
                    .content(metadata),
            )
            .part(
                RelatedPart::new()
                    .header(CONTENT_TYPE, HeaderValue::from_static(super::CONTENT_TYPE))
                    .content(Buffer::from(bytes)),
            )
            .apply(Request::post(url))
            .map_err(|e| self.error(key, operation, e))?;
        let resp = json.send(req).await.map_err(|e| self.error(key, operation, e))?;
        let status = resp.status();
        if status.is_success() {
            let body = resp.into_body().to_bytes();
            return generation_of(&body).map(|g| g.to_string()).ok_or_else(|| StoreError::Config {
                url: self.url(key),
                message: format!("GCS answered the upload with no generation: {}", String::from_utf8_lossy(&body)),
            });
        }
        let failed_precondition = status == StatusCode::PRECONDITION_FAILED || status == StatusCode::CONFLICT;
        match (generation, status) {
            (0, _) if failed_precondition => Err(StoreError::AlreadyExists { url: self.url(key) }),
            (g, _) if g != 0 && (failed_precondition || status == StatusCode::NOT_FOUND) => {
                Err(StoreError::Conflict { url: self.url(key), expected: g.to_string() })
            }
            _ => Err(self.gcs_status_error(key, operation, &resp)),
        }
    }

    /// The object and its generation, read consistently (see the module doc).
    pub(crate) async fn gcs_read_versioned(&self, json: &GcsJson, key: &str) -> Result<Versioned, StoreError> {
        let operation = "read";
        let object = json.object_url(key);
        for _ in 0..READ_TRIES {
            let req = Request::get(&object).body(Buffer::new()).map_err(|e| self.request_error(key, e))?;
            let resp = json.send(req).await.map_err(|e| self.error(key, "stat", e))?;
            if resp.status() != StatusCode::OK {
                return Err(self.gcs_status_error(key, "stat", &resp));
            }
            let Some(generation) = generation_of(&resp.into_body().to_bytes()) else {
                return Err(StoreError::Config {
                    url: self.url(key),
                    message: "GCS sent the object's metadata without a generation".into(),
                });
            };
            let media = format!("{object}?alt=media&generation={generation}&ifGenerationMatch={generation}");
            let req = Request::get(media).body(Buffer::new()).map_err(|e| self.request_error(key, e))?;
            let resp = json.send(req).await.map_err(|e| self.error(key, operation, e))?;
            match resp.status() {
                StatusCode::OK => {
                    let sent = resp.headers().get("x-goog-generation").and_then(|v| v.to_str().ok());
                    if sent.is_some_and(|g| g.parse::<u64>().ok() != Some(generation)) {
                        continue;
                    }
                    return Ok(Versioned { bytes: resp.into_body().to_bytes(), etag: generation.to_string() });
                }
                // Replaced (or removed) since its metadata was read.
                StatusCode::NOT_FOUND | StatusCode::PRECONDITION_FAILED => continue,
                _ => return Err(self.gcs_status_error(key, operation, &resp)),
            }
        }
        Err(StoreError::Contended { url: self.url(key) })
    }

    /// `length` bytes of `key` from `offset`, of generation `generation`
    /// only: a media GET pinned to it (`generation=<g>`), which answers 404
    /// once that generation is no longer live (measured on
    /// fake-gcs-server; real GCS keeps no noncurrent generation without
    /// versioning, and `ifGenerationMatch` says the same where it is honoured).
    pub(crate) async fn gcs_read_range(
        &self,
        json: &GcsJson,
        key: &str,
        offset: u64,
        length: u64,
        generation: &str,
    ) -> Result<Bytes, StoreError> {
        const OPERATION: &str = "ranged read";
        let url = format!("{}?alt=media&generation={generation}&ifGenerationMatch={generation}", json.object_url(key));
        let range = format!("bytes={offset}-{}", offset.saturating_add(length) - 1);
        let req = Request::get(url)
            .header(http::header::RANGE, range)
            .body(Buffer::new())
            .map_err(|e| self.request_error(key, e))?;
        let resp = json.send(req).await.map_err(|e| self.error(key, OPERATION, e))?;
        match resp.status() {
            status @ (StatusCode::OK | StatusCode::PARTIAL_CONTENT) => {
                let sent = resp.headers().get("x-goog-generation").and_then(|v| v.to_str().ok());
                if sent.is_some_and(|g| g != generation) {
                    return Err(StoreError::Conflict { url: self.url(key), expected: generation.to_string() });
                }
                let bytes = resp.into_body().to_bytes();
                if status == StatusCode::OK && bytes.len() as u64 > length {
                    // 200 to a ranged GET: the whole object; keep the range.
                    let start = (offset as usize).min(bytes.len());
                    let end = (offset.saturating_add(length) as usize).min(bytes.len());
                    return Ok(bytes.slice(start..end));
                }
                Ok(bytes)
            }
            StatusCode::NOT_FOUND | StatusCode::PRECONDITION_FAILED => {
                Err(StoreError::Conflict { url: self.url(key), expected: generation.to_string() })
            }
            StatusCode::RANGE_NOT_SATISFIABLE => Ok(Bytes::new()),
            _ => Err(self.gcs_status_error(key, OPERATION, &resp)),
        }
    }

    /// An unexpected answer, described by `message`.
    fn other(&self, key: &str, operation: &'static str, message: String) -> StoreError {
        self.error(key, operation, opendal::Error::new(ErrorKind::Unexpected, message))
    }

    fn request_error(&self, key: &str, e: http::Error) -> StoreError {
        let err = opendal::Error::new(ErrorKind::Unexpected, "cannot build the GCS request").set_source(e);
        self.error(key, "build a request", err)
    }
}

/// GCS wants every chunk of a resumable upload but the last to be a
/// multiple of 256 KiB.
const CHUNK_QUANTUM: usize = 256 << 10;

/// How often one chunk is sent again when the server persisted only part of
/// it (a `308` whose `Range` ends short) before the upload fails.
const SHORT_PERSIST_TRIES: usize = 3;

/// An exclusive streaming upload on GCS, which opendal cannot make (its
/// multipart uploads go through the XML API without a precondition).
///
/// How it stays exclusive, provably against every server we test:
/// - an object smaller than one chunk is one `uploadType=multipart` upload
///   with `ifGenerationMatch=0` at [`GcsUpload::finish`] (the request
///   fake-gcs-server honours preconditions on);
/// - a larger one first **claims** its key with an empty object created the
///   same way (`ifGenerationMatch=0`): of two writers of one key only one
///   claim succeeds, and the other gets [`StoreError::AlreadyExists`]. The
///   contents then go up as a resumable upload whose session names
///   `ifGenerationMatch=<the claim's generation>`, so it replaces the claim
///   and nothing else (real GCS checks it when the upload completes;
///   fake-gcs-server ignores preconditions on resumable uploads, measured,
///   which is why the claim, not this, is what the exclusivity rests on);
/// - chunks are sent one at a time in the background (a resumable upload is
///   sequential) while the caller fills the next: upload overlaps encoding;
/// - a chunk the server persisted only in part (a `308` whose `Range` ends
///   short) is sent again from where it stopped;
/// - unlike S3's multipart upload, the claim is visible: an upload abandoned
///   by a crash leaves an empty object under its key ([`GcsUpload::abort`]
///   deletes it, on its generation). Writers of exclusive uploads name their
///   objects uniquely per attempt (the Iceberg plugin does), so such a leftover
///   is an orphan no reader follows.
pub(crate) struct GcsUpload {
    json: Arc<GcsJson>,
    store: ObjectStore,
    key: String,
    /// A multiple of [`CHUNK_QUANTUM`].
    chunk: usize,
    /// Bytes not yet sent (less than a chunk once a chunk was handed off).
    pending: Vec<Bytes>,
    pending_len: usize,
    /// The claim and session, once the object outgrew one chunk.
    session: Option<Session>,
    /// Bytes handed to sent chunks so far (the offset of the next one).
    offset: u64,
    in_flight: Option<tokio::task::JoinHandle<Result<Sent, StoreError>>>,
}

struct Session {
    claim: u64,
    uri: String,
}

/// What a chunk's request came back with.
enum Sent {
    /// Persisted up to the chunk's end; more may follow.
    More,
    /// The last chunk: the object's generation.
    Done(u64),
}

impl GcsUpload {
    pub(crate) fn new(json: Arc<GcsJson>, store: ObjectStore, key: &str, part_size: usize) -> Self {
        let chunk = part_size.div_ceil(CHUNK_QUANTUM).max(1) * CHUNK_QUANTUM;
        Self {
            json,
            store,
            key: key.to_string(),
            chunk,
            pending: Vec::new(),
            pending_len: 0,
            session: None,
            offset: 0,
            in_flight: None,
        }
    }

    pub(crate) async fn write(&mut self, bytes: Bytes) -> Result<(), StoreError> {
        self.pending_len += bytes.len();
        self.pending.push(bytes);
        while self.pending_len >= self.chunk {
            let chunk = self.take(self.chunk);
            self.send(chunk, None).await?;
        }
        Ok(())
    }

    /// The first `n` pending bytes, as one buffer.
    fn take(&mut self, n: usize) -> Bytes {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let Some(first) = self.pending.first_mut() else { break };
            let want = n - out.len();
            if first.len() <= want {
                out.extend_from_slice(first);
                self.pending.remove(0);
            } else {
                out.extend_from_slice(&first.split_to(want));
            }
        }
        self.pending_len -= out.len();
        Bytes::from(out)
    }

    /// Waits for the chunk in flight, then sends `chunk` in the background
    /// (`total`: the object's size, for the last chunk).
    async fn send(&mut self, chunk: Bytes, total: Option<u64>) -> Result<Option<u64>, StoreError> {
        if let Some(Sent::Done(generation)) = self.settle().await? {
            return Ok(Some(generation));
        }
        let uri = match &self.session {
            Some(session) => session.uri.clone(),
            None => {
                let session = self.open_session().await?;
                let uri = session.uri.clone();
                self.session = Some(session);
                uri
            }
        };
        let task = put_chunk(
            Arc::clone(&self.json),
            self.store.clone(),
            self.key.clone(),
            uri,
            self.offset,
            chunk.clone(),
            total,
        );
        self.offset += chunk.len() as u64;
        self.in_flight = Some(tokio::spawn(task));
        Ok(None)
    }

    /// Waits for the chunk in flight, if any.
    async fn settle(&mut self) -> Result<Option<Sent>, StoreError> {
        let Some(task) = self.in_flight.take() else { return Ok(None) };
        match task.await {
            Ok(sent) => sent.map(Some),
            Err(e) => Err(self.store.other(&self.key, "upload a part", format!("the upload task failed: {e}"))),
        }
    }

    /// Claims the key with an empty object and opens a resumable session
    /// that may only replace that claim.
    async fn open_session(&self) -> Result<Session, StoreError> {
        const OPERATION: &str = "start an upload";
        let claim = self.store.gcs_insert(&self.json, &self.key, Bytes::new(), 0).await?;
        let claim = parse_generation(&claim)
            .ok_or_else(|| self.store.other(&self.key, OPERATION, format!("the claim's generation {claim:?}")))?;
        let url = format!(
            "{}/upload/storage/v1/b/{}/o?uploadType=resumable&name={}&ifGenerationMatch={claim}",
            self.json.endpoint,
            self.json.bucket,
            utf8_percent_encode(&self.key, NAME)
        );
        let metadata = serde_json::json!({ "name": self.key, "contentType": super::CONTENT_TYPE }).to_string();
        let req = Request::post(url)
            .header(CONTENT_TYPE, "application/json; charset=UTF-8")
            .header("X-Upload-Content-Type", super::CONTENT_TYPE)
            .body(Buffer::from(metadata))
            .map_err(|e| self.store.request_error(&self.key, e))?;
        let resp = self.json.send(req).await.map_err(|e| self.store.error(&self.key, OPERATION, e))?;
        match resp.status() {
            StatusCode::PRECONDITION_FAILED | StatusCode::CONFLICT => {
                return Err(StoreError::AlreadyExists { url: self.store.url(&self.key) });
            }
            s if !s.is_success() => return Err(self.store.gcs_status_error(&self.key, OPERATION, &resp)),
            _ => {}
        }
        let uri =
            resp.headers().get(http::header::LOCATION).and_then(|v| v.to_str().ok()).map(str::to_string).ok_or_else(
                || self.store.other(&self.key, OPERATION, "GCS opened no upload session (no Location)".into()),
            )?;
        Ok(Session { claim, uri })
    }

    /// Sends what is left and completes the upload; returns the generation.
    pub(crate) async fn finish(mut self) -> Result<String, StoreError> {
        let rest = self.take(self.pending_len);
        if self.session.is_none() && self.in_flight.is_none() {
            // Smaller than a chunk: one exclusive request.
            return self.store.gcs_insert(&self.json, &self.key, rest, 0).await;
        }
        let total = self.offset + rest.len() as u64;
        if let Some(generation) = self.send(rest, Some(total)).await? {
            return Ok(generation.to_string());
        }
        match self.settle().await? {
            Some(Sent::Done(generation)) => Ok(generation.to_string()),
            _ => Err(self.store.other(&self.key, "complete an upload", "GCS did not complete the upload".into())),
        }
    }

    /// Abandons the upload: cancels the session and deletes the claim (on
    /// its generation, so an object someone else wrote there stays).
    pub(crate) async fn abort(mut self) -> Result<(), StoreError> {
        if let Some(task) = self.in_flight.take() {
            task.abort();
        }
        let Some(session) = self.session.take() else { return Ok(()) };
        const OPERATION: &str = "abort an upload";
        // GCS answers 499 to a cancelled session; nothing to check.
        if let Ok(req) = Request::delete(&session.uri).body(Buffer::new()) {
            let _ = self.json.send(req).await;
        }
        let url = format!("{}?ifGenerationMatch={}", self.json.object_url(&self.key), session.claim);
        let req = Request::delete(url).body(Buffer::new()).map_err(|e| self.store.request_error(&self.key, e))?;
        let resp = self.json.send(req).await.map_err(|e| self.store.error(&self.key, OPERATION, e))?;
        match resp.status() {
            s if s.is_success() => Ok(()),
            StatusCode::NOT_FOUND | StatusCode::PRECONDITION_FAILED => Ok(()),
            _ => Err(self.store.gcs_status_error(&self.key, OPERATION, &resp)),
        }
    }
}

/// One chunk of a resumable upload at `offset` (see [`GcsUpload`]).
async fn put_chunk(
    json: Arc<GcsJson>,
    store: ObjectStore,
    key: String,
    uri: String,
    offset: u64,
    chunk: Bytes,
    total: Option<u64>,
) -> Result<Sent, StoreError> {
    const OPERATION: &str = "upload a part";
    let end = offset + chunk.len() as u64;
    let mut from = offset;
    let mut tries = 0;
    loop {
        let part = chunk.slice((from - offset) as usize..);
        let size = total.map_or("*".to_string(), |t| t.to_string());
        let range =
            if part.is_empty() { format!("bytes */{size}") } else { format!("bytes {from}-{}/{size}", end - 1) };
        let req = Request::put(&uri)
            .header(http::header::CONTENT_RANGE, range)
            .body(Buffer::from(part))
            .map_err(|e| store.request_error(&key, e))?;
        let resp = json.send(req).await.map_err(|e| store.error(&key, OPERATION, e))?;
        match resp.status().as_u16() {
            200 | 201 => {
                let body = resp.into_body().to_bytes();
                return generation_of(&body).map(Sent::Done).ok_or_else(|| StoreError::Config {
                    url: store.url(&key),
                    message: format!("GCS completed the upload with no generation: {}", String::from_utf8_lossy(&body)),
                });
            }
            308 if total.is_none() => {
                // `Range: bytes=0-<last persisted byte>`; none: nothing yet.
                let persisted = resp
                    .headers()
                    .get(http::header::RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.rsplit('-').next())
                    .and_then(|last| last.trim().parse::<u64>().ok())
                    .map_or(0, |last| last + 1);
                if persisted >= end {
                    return Ok(Sent::More);
                }
                tries += 1;
                if persisted < offset || tries > SHORT_PERSIST_TRIES {
                    return Err(store.other(
                        &key,
                        OPERATION,
                        format!("GCS persisted {persisted} bytes of an upload that sent {end}"),
                    ));
                }
                from = persisted;
            }
            // The claim was replaced by someone else since it was made.
            412 => return Err(StoreError::AlreadyExists { url: store.url(&key) }),
            _ => return Err(store.gcs_status_error(&key, OPERATION, &resp)),
        }
    }
}
