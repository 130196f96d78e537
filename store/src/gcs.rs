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
const ADC_HINT: &str = "tried Application Default Credentials: GOOGLE_APPLICATION_CREDENTIALS, gcloud's \
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

    fn request_error(&self, key: &str, e: http::Error) -> StoreError {
        let err = opendal::Error::new(ErrorKind::Unexpected, "cannot build the GCS request").set_source(e);
        self.error(key, "build a request", err)
    }
}
