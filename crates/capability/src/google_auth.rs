//! Google access tokens for `auth = "google"` endpoints (`[sink.grpc.<name>]`,
//! `[sink.http.<name>]`): Application Default Credentials as Google's
//! libraries define them (AIP-4110), tried in this order:
//! 1. the JSON file `GOOGLE_APPLICATION_CREDENTIALS` names: a service-account
//!    key (`"type": "service_account"`) or an authorized user
//!    (`"authorized_user"`, what `gcloud auth application-default login`
//!    writes), or one of the other types google-cloud-auth reads
//!    (impersonated service account, workload identity federation);
//! 2. gcloud's ADC file: `$CLOUDSDK_CONFIG/application_default_credentials.json`,
//!    else `~/.config/gcloud/application_default_credentials.json`
//!    (`%APPDATA%\gcloud\...` on Windows). gcloud writes it under
//!    `CLOUDSDK_CONFIG` when that is set, and Google's Python library
//!    (google-auth) reads it there; google-cloud-auth 1.19 reads `HOME`
//!    only, so the host finds the file itself;
//! 3. the metadata server, `GCE_METADATA_HOST` honoured (google-cloud-auth's
//!    `mds` credentials).
//!
//! Invariants:
//! - tokens stay in the host: the grpc and http capabilities add the
//!   `authorization` header themselves; a plugin never sees a token, and no
//!   `Debug` prints one;
//! - a grant opens only with a first token in hand, so unusable credentials
//!   stop `sluice check` and `sluice run` before anything is written, naming
//!   the source tried (the file, or the metadata server's URL) and what to do;
//! - a token is renewed before it expires, and a token the service refused is
//!   renewed at once ([`GoogleToken::renew`]); the caller retries the refused
//!   call only where that is safe.
//!
//! Two ways to a token:
//! - **A service-account key or an authorized-user file: the host's own
//!   OAuth 2.0 grant at the file's `token_uri`** (`FileGrant`; Google's
//!   `https://oauth2.googleapis.com/token` when the file names none), the
//!   answer's `expires_in` saying when to renew (`expires_in - min(expires_in
//!   / 2, 4 min)` after the request left; a renewal that fails while the
//!   token is valid keeps it and tries again):
//!   - a service account, the JWT-bearer grant as Google documents it
//!     (<https://developers.google.com/identity/protocols/oauth2/service-account#authorizingrequests>):
//!     an RS256-signed JWT (`iss` = `client_email`, `scope`, `aud` = the
//!     `token_uri`, `iat`, `exp` = `iat` + 1 h) posted as
//!     `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer`. Not
//!     google-cloud-auth's: version 1.19 never calls a token endpoint for a
//!     service account, it sends the self-signed JWT itself as the bearer
//!     token (AIP-4111, its `service_account.rs`), and BigQuery has been
//!     reported to refuse self-signed JWTs with scopes
//!     (googleapis/google-cloud-rust#4024, googleapis/google-cloud-dotnet#9326).
//!     The token endpoint is what Google's Python library uses when scopes
//!     are given, and the flow Google's OAuth documentation gives for
//!     service accounts. The JWT is signed by
//!     google-cloud-auth's own service-account signer (its key parsing,
//!     rustls' RSA signing); only the claims and the form post are here;
//!   - an authorized user, the refresh-token grant
//!     (<https://developers.google.com/identity/protocols/oauth2/web-server#offline>):
//!     `client_id`, `client_secret`, `refresh_token`. google-cloud-auth
//!     does this one, but its cache cannot renew a token living under 4
//!     minutes ahead of time (below), and its refusals read "Request to
//!     fetch the token failed. ... body=<{...}>"; with the same exchange as
//!     a key, both file kinds renew from `expires_in` and a refusal names
//!     the endpoint, Google's answer and what to do.
//! - **The metadata server and the other file types: google-cloud-auth's
//!   credentials and cache** (`AdcCache`), which renews a token 4 minutes
//!   before its expiry (Google issues them for 3600 s) and makes callers
//!   wait once one has expired. A token that lives less than 4 minutes is
//!   fetched again only every 10 s, which would make calls wait, so this
//!   layer fetches at once when the cache would wait, learns how long
//!   tokens live here (from one that expired on it, or that the service
//!   refused), and from then on renews every token at half that age,
//!   before it can expire.
//!
//! Why google-cloud-auth (Google's own crate) and not gcp_auth: gcp_auth
//! 0.12 asks `metadata.google.internal` only and ignores `GCE_METADATA_HOST`.
//! google-cloud-auth is built without default features (no aws-lc-rs); its
//! reqwest 0.13 (already in the build, through opendal) uses rustls with
//! the ring provider, which [`install_ring`] installs process-wide.

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use google_cloud_auth::credentials::{
    AccessTokenCredentials, external_account, external_account_authorized_user, impersonated, mds, service_account,
};
use google_cloud_auth::signer::Signer;
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

/// The scope BigQuery's APIs accept.
const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// Google's token endpoint, for a file without `token_uri`.
const GOOGLE_TOKEN_URI: &str = "https://oauth2.googleapis.com/token";
/// The grant type of a JWT assertion (RFC 7523 §2.1).
const JWT_BEARER: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
/// How long a JWT assertion claims to live: Google's maximum.
const ASSERTION_LIFE: Duration = Duration::from_secs(3600);
/// The name of gcloud's ADC file in its configuration directory.
const ADC_FILE: &str = "application_default_credentials.json";
/// Longest the first token may take at setup.
const FIRST_TOKEN_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest one token request of a file grant may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// The most a file grant's token is renewed ahead of its expiry.
const MAX_MARGIN: Duration = Duration::from_secs(240);
/// The shortest wait before a file grant tries again after a failed renewal.
const MIN_RETRY: Duration = Duration::from_millis(100);
/// A cached token taking longer than this is one the cache waits to
/// replace (it answers a valid one at once).
const WAITED: Duration = Duration::from_millis(200);
/// Shortest renewal age learned: below it, a token service is misbehaving.
const MIN_AGE: Duration = Duration::from_millis(200);

/// Credentials that cannot be used, named by the endpoint's job key.
#[derive(Debug, Error)]
pub enum GoogleAuthError {
    #[error("{key}.auth: Application Default Credentials: {source_tried}: {message}; {hint}")]
    Credentials { key: String, source_tried: String, message: String, hint: String },
}

/// Where Application Default Credentials come from (AIP-4110).
#[derive(Debug, Clone)]
enum AdcSource {
    /// The file `GOOGLE_APPLICATION_CREDENTIALS` names.
    EnvFile(PathBuf),
    /// gcloud's ADC file.
    WellKnown(PathBuf),
    /// The metadata server at this host.
    Metadata(String),
}

/// gcloud's ADC file: in `CLOUDSDK_CONFIG` if set (gcloud writes it there),
/// else in gcloud's default configuration directory.
fn well_known_path() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("CLOUDSDK_CONFIG").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir).join(ADC_FILE));
    }
    #[cfg(windows)]
    let dir = std::env::var_os("APPDATA").map(|root| PathBuf::from(root).join("gcloud"));
    #[cfg(not(windows))]
    let dir = std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".config").join("gcloud"));
    dir.map(|d| d.join(ADC_FILE))
}

impl AdcSource {
    /// The source ADC resolves to, and the file's JSON (none for the
    /// metadata server). A file named by `GOOGLE_APPLICATION_CREDENTIALS`
    /// must be readable JSON; gcloud's file is skipped when it is absent.
    fn resolve() -> Result<(Self, Option<Value>), (Self, String)> {
        let (source, path) = match std::env::var_os("GOOGLE_APPLICATION_CREDENTIALS") {
            Some(path) => {
                let path = PathBuf::from(path);
                if path.as_os_str().is_empty() {
                    return Err((AdcSource::EnvFile(path), "the variable is set but empty".to_string()));
                }
                (AdcSource::EnvFile(path.clone()), path)
            }
            None => match well_known_path() {
                Some(path) if path.exists() => (AdcSource::WellKnown(path.clone()), path),
                _ => {
                    let host =
                        std::env::var("GCE_METADATA_HOST").unwrap_or_else(|_| "metadata.google.internal".to_string());
                    return Ok((AdcSource::Metadata(host), None));
                }
            },
        };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => return Err((source, format!("cannot read the file: {e}"))),
        };
        match serde_json::from_str::<Value>(&text) {
            Ok(json @ Value::Object(_)) => Ok((source, Some(json))),
            Ok(_) => Err((source, "the file is JSON but not an object".to_string())),
            Err(e) => Err((source, format!("the file is not JSON: {e}"))),
        }
    }

    fn describe(&self) -> String {
        match self {
            AdcSource::EnvFile(p) => format!("the file {} (GOOGLE_APPLICATION_CREDENTIALS)", p.display()),
            AdcSource::WellKnown(p) => format!("gcloud's ADC file {}", p.display()),
            AdcSource::Metadata(h) => format!(
                "the metadata server http://{h}/computeMetadata/v1/instance/service-accounts/default/token \
                 (no GOOGLE_APPLICATION_CREDENTIALS, no gcloud ADC file)"
            ),
        }
    }

    fn hint(&self) -> &'static str {
        match self {
            AdcSource::EnvFile(_) => {
                "point GOOGLE_APPLICATION_CREDENTIALS at a readable service-account key file (`gcloud iam \
                 service-accounts keys create`) or authorized-user file (`gcloud auth application-default login`), \
                 or unset it to use gcloud's ADC file or the metadata server"
            }
            AdcSource::WellKnown(_) => {
                "run `gcloud auth application-default login` again, or set GOOGLE_APPLICATION_CREDENTIALS to a \
                 service-account key file"
            }
            AdcSource::Metadata(_) => {
                "outside Google Cloud, set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file or run \
                 `gcloud auth application-default login`; on Google Cloud, check that the metadata server \
                 (GCE_METADATA_HOST, if set) is reachable; or give the endpoint a static token_env/token_file \
                 instead of auth"
            }
        }
    }
}

/// Installs rustls' ring provider as the process default, which
/// google-cloud-auth (built without its aws-lc-rs default) requires. A
/// provider installed already (by anyone) is kept.
fn install_ring() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One endpoint's Google credentials, shared by the run's instances.
pub struct GoogleToken {
    key: String,
    source: AdcSource,
    inner: Inner,
}

enum Inner {
    File(Box<FileGrant>),
    Adc(tokio::sync::Mutex<AdcCache>),
}

impl std::fmt::Debug for GoogleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints a token or a key.
        let kind = match &self.inner {
            Inner::File(g) => format!("{} at {}", g.who(), g.token_uri),
            Inner::Adc(_) => "google-cloud-auth".to_string(),
        };
        f.debug_struct("GoogleToken")
            .field("key", &self.key)
            .field("source", &self.source)
            .field("kind", &kind)
            .finish()
    }
}

impl GoogleToken {
    /// Builds the credentials for the endpoint `key` (`sink.grpc.bigquery`)
    /// and fetches a first token, on the host runtime. Must not be called
    /// from a runtime thread.
    pub fn open(key: &str) -> Result<Self, GoogleAuthError> {
        install_ring();
        let fail = |source: &AdcSource, message: String, hint: Option<String>| GoogleAuthError::Credentials {
            key: key.to_string(),
            source_tried: source.describe(),
            message,
            hint: hint.unwrap_or_else(|| source.hint().to_string()),
        };
        let (source, json) = AdcSource::resolve().map_err(|(source, message)| fail(&source, message, None))?;
        let inner = super::runtime().block_on(async {
            let first = async {
                match json {
                    Some(json) if matches!(file_type(&json), Some("service_account" | "authorized_user")) => {
                        let user = file_type(&json) == Some("authorized_user");
                        FileGrant::open(json, user).await.map(|g| Inner::File(Box::new(g)))
                    }
                    json => AdcCache::open(json).await.map(|c| Inner::Adc(tokio::sync::Mutex::new(c))),
                }
            };
            match tokio::time::timeout(FIRST_TOKEN_TIMEOUT, first).await {
                Err(_) => Err(fail(&source, format!("no token within {} s", FIRST_TOKEN_TIMEOUT.as_secs()), None)),
                Ok(Err(e)) => Err(fail(&source, e.message, e.hint)),
                Ok(Ok(inner)) => Ok(inner),
            }
        })?;
        Ok(Self { key: key.to_string(), source, inner })
    }

    /// `Bearer <token>`: a token not expired, renewed ahead of its expiry.
    pub async fn bearer(&self) -> Result<String, GoogleAuthError> {
        let token = match &self.inner {
            Inner::File(g) => g.current(&self.key).await,
            Inner::Adc(c) => c.lock().await.current().await,
        };
        token.map(|t| format!("Bearer {t}")).map_err(|e| self.fail(e))
    }

    /// The service refused `refused` (`Bearer <token>`) as unauthenticated:
    /// renews it unless that happened already. Whether the token now
    /// handed out differs (`false`: the credentials themselves are refused,
    /// and a retry would be refused again).
    pub async fn renew(&self, refused: &str) -> Result<bool, GoogleAuthError> {
        let Some(refused) = refused.strip_prefix("Bearer ") else { return Ok(false) };
        let renewed = match &self.inner {
            Inner::File(g) => g.renew(refused).await,
            Inner::Adc(c) => c.lock().await.renew(refused).await,
        };
        let renewed = renewed.map_err(|e| self.fail(e))?;
        if let Some(age) = renewed.refused_after {
            tracing::debug!("{}: the token was refused after {} ms; renewed", self.key, age.as_millis());
        }
        Ok(renewed.changed)
    }

    fn fail(&self, e: Failure) -> GoogleAuthError {
        GoogleAuthError::Credentials {
            key: self.key.clone(),
            source_tried: self.source.describe(),
            message: e.message,
            hint: e.hint.unwrap_or_else(|| self.source.hint().to_string()),
        }
    }
}

/// Why a token could not be had, and what to do if the source's own hint
/// does not say it.
struct Failure {
    message: String,
    hint: Option<String>,
}

impl Failure {
    fn new(message: impl Into<String>) -> Self {
        Self { message: message.into(), hint: None }
    }

    fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

/// What a renewal after a refusal did.
struct Renewed {
    /// The token handed out now differs from the refused one.
    changed: bool,
    /// How old the refused token was, when this renewal replaced it.
    refused_after: Option<Duration>,
}

/// The fields of a service-account key file the grant reads itself (the
/// signer reads `private_key`).
#[derive(Deserialize)]
struct KeyFile {
    client_email: String,
    private_key_id: String,
    #[serde(default)]
    token_uri: Option<String>,
}

/// The fields of an authorized-user file.
#[derive(Deserialize)]
struct UserFile {
    client_id: String,
    client_secret: String,
    refresh_token: String,
    #[serde(default)]
    token_uri: Option<String>,
}

/// What a file grant proves itself with.
enum Grantor {
    /// A service account: a JWT assertion signed with its key.
    ServiceAccount { client_email: String, private_key_id: String, signer: Signer },
    /// An authorized user: an OAuth client and the user's refresh token.
    User { client_id: String, client_secret: String, refresh_token: String },
}

/// A token of a file grant and when to renew it.
struct FileToken {
    value: String,
    issued: Instant,
    renew_at: Option<Instant>,
    expires_at: Option<Instant>,
}

/// An ADC file's OAuth 2.0 grant at its `token_uri`.
struct FileGrant {
    grantor: Grantor,
    token_uri: reqwest::Url,
    http: reqwest::Client,
    /// Held across an exchange: one at a time.
    state: tokio::sync::Mutex<FileToken>,
}

/// A token endpoint's answer (RFC 6749 §5.1).
#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    #[serde(default)]
    token_type: Option<String>,
    #[serde(default)]
    expires_in: Option<u64>,
}

/// A token endpoint's refusal (RFC 6749 §5.2).
#[derive(Deserialize)]
struct OAuthError {
    error: String,
    #[serde(default)]
    error_description: Option<String>,
}

const KEY_HINT: &str = "use the JSON key file Google issued (`gcloud iam service-accounts keys create`)";
const USER_HINT: &str = "run `gcloud auth application-default login` again, or point \
     GOOGLE_APPLICATION_CREDENTIALS at a service-account key file";

impl FileGrant {
    /// The grant of a file of `"type": "service_account"` or
    /// `"authorized_user"` (`user`), and a first token.
    async fn open(json: Value, user: bool) -> Result<Self, Failure> {
        let (grantor, token_uri) = if user {
            let file: UserFile = serde_json::from_value(json)
                .map_err(|e| Failure::new(format!("not an authorized-user file: {e}")).hint(USER_HINT))?;
            let grantor = Grantor::User {
                client_id: file.client_id,
                client_secret: file.client_secret,
                refresh_token: file.refresh_token,
            };
            (grantor, file.token_uri)
        } else {
            let file: KeyFile = serde_json::from_value(json.clone())
                .map_err(|e| Failure::new(format!("not a service-account key file: {e}")).hint(KEY_HINT))?;
            let signer = service_account::Builder::new(json).build_signer().map_err(|e| {
                Failure::new(format!("not a service-account key file: {}", error_text(&e))).hint(KEY_HINT)
            })?;
            let grantor = Grantor::ServiceAccount {
                client_email: file.client_email,
                private_key_id: file.private_key_id,
                signer,
            };
            (grantor, file.token_uri)
        };
        let uri = token_uri.as_deref().unwrap_or(GOOGLE_TOKEN_URI);
        let token_uri = reqwest::Url::parse(uri).map_err(|e| {
            Failure::new(format!("its token_uri {uri:?} is not a URL: {e}"))
                .hint(format!("set token_uri to Google's token endpoint, {GOOGLE_TOKEN_URI}, or remove it"))
        })?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(EXCHANGE_TIMEOUT)
            .build()
            .map_err(|e| Failure::new(format!("cannot build an HTTP client: {e}")))?;
        let mut grant = Self {
            grantor,
            token_uri,
            http,
            state: tokio::sync::Mutex::new(FileToken {
                value: String::new(),
                issued: Instant::now(),
                renew_at: None,
                expires_at: None,
            }),
        };
        let first = grant.exchange().await?;
        *grant.state.get_mut() = first;
        Ok(grant)
    }

    /// Who the grant is for, for messages (never a secret).
    fn who(&self) -> String {
        match &self.grantor {
            Grantor::ServiceAccount { client_email, .. } => format!("the service account {client_email}"),
            Grantor::User { client_id, .. } => format!("the authorized user of OAuth client {client_id}"),
        }
    }

    /// The current token, renewed first if it is due. A renewal that fails
    /// while the token is still valid keeps it and tries again at half its
    /// remaining life.
    async fn current(&self, key: &str) -> Result<String, Failure> {
        let mut token = self.state.lock().await;
        let now = Instant::now();
        if token.renew_at.is_some_and(|at| now >= at) {
            match self.exchange().await {
                Ok(new) => *token = new,
                Err(e) => match token.expires_at.and_then(|at| at.checked_duration_since(now)) {
                    Some(left) if !left.is_zero() => {
                        let again = (left / 2).max(MIN_RETRY);
                        token.renew_at = Some(now + again);
                        tracing::warn!(
                            "{key}: renewing the token of {} failed: {}; the current one is valid for {} ms \
                             more, trying again in {} ms",
                            self.who(),
                            e.message,
                            left.as_millis(),
                            again.as_millis()
                        );
                    }
                    _ => return Err(e),
                },
            }
        }
        Ok(token.value.clone())
    }

    async fn renew(&self, refused: &str) -> Result<Renewed, Failure> {
        let mut token = self.state.lock().await;
        if token.value != refused {
            return Ok(Renewed { changed: true, refused_after: None });
        }
        let age = token.issued.elapsed();
        *token = self.exchange().await?;
        Ok(Renewed { changed: token.value != refused, refused_after: Some(age) })
    }

    /// A service account's signed JWT assertion: header, claims and RS256
    /// signature.
    async fn assertion(&self, client_email: &str, private_key_id: &str, signer: &Signer) -> Result<String, Failure> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).map_err(|_| {
            Failure::new("this machine's clock is before 1970").hint("set the system clock (the JWT carries it)")
        })?;
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT", "kid": private_key_id});
        let claims = serde_json::json!({
            "iss": client_email,
            "scope": SCOPE,
            "aud": self.token_uri.as_str(),
            "iat": now.as_secs(),
            "exp": (now + ASSERTION_LIFE).as_secs(),
        });
        let signing_input =
            format!("{}.{}", URL_SAFE_NO_PAD.encode(header.to_string()), URL_SAFE_NO_PAD.encode(claims.to_string()));
        let signature = signer.sign(signing_input.as_bytes()).await.map_err(|e| {
            Failure::new(format!("cannot sign with the file's private_key: {}", error_text(&e))).hint(
                "the private_key must be the PKCS#8 PEM key (`-----BEGIN PRIVATE KEY-----`) of a key file Google \
                 issued (`gcloud iam service-accounts keys create`)",
            )
        })?;
        Ok(format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature)))
    }

    /// One exchange at `token_uri`: the JWT-bearer grant of a service
    /// account, the refresh-token grant of a user.
    async fn exchange(&self) -> Result<FileToken, Failure> {
        let form: Vec<(&str, String)> = match &self.grantor {
            Grantor::ServiceAccount { client_email, private_key_id, signer } => vec![
                ("grant_type", JWT_BEARER.to_string()),
                ("assertion", self.assertion(client_email, private_key_id, signer).await?),
            ],
            Grantor::User { client_id, client_secret, refresh_token } => vec![
                ("grant_type", "refresh_token".to_string()),
                ("client_id", client_id.clone()),
                ("client_secret", client_secret.clone()),
                ("refresh_token", refresh_token.clone()),
                ("scope", SCOPE.to_string()),
            ],
        };
        let at = &self.token_uri;
        let asked = Instant::now();
        let reply = self
            .http
            .post(self.token_uri.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .form(&form)
            .send()
            .await
            .map_err(|e| {
                Failure::new(format!(
                    "the token endpoint {at} (the file's token_uri) did not answer: {}",
                    error_text(&e)
                ))
                .hint(format!("check that {at} is reachable from here"))
            })?;
        let status = reply.status();
        let body = reply.bytes().await.map_err(|e| {
            Failure::new(format!(
                "the token endpoint {at} answered {status}, and the reply was lost: {}",
                error_text(&e)
            ))
            .hint("try again")
        })?;
        if !status.is_success() {
            let (code, text) = match serde_json::from_slice::<OAuthError>(&body) {
                Ok(e) => {
                    let text = match &e.error_description {
                        Some(d) => format!("{}: {d}", e.error),
                        None => e.error.clone(),
                    };
                    (Some(e.error), text)
                }
                Err(_) => (None, String::from_utf8_lossy(&body).chars().take(500).collect()),
            };
            let what = match &self.grantor {
                Grantor::ServiceAccount { .. } => "JWT assertion",
                Grantor::User { .. } => "refresh token",
            };
            let message = format!("the token endpoint {at} refused {}'s {what}: {status}: {text}", self.who());
            return Err(Failure::new(message).hint(self.hint(status, code.as_deref())));
        }
        let not_google = || format!("set the file's token_uri to Google's token endpoint, {GOOGLE_TOKEN_URI}");
        let reply: TokenResponse = serde_json::from_slice(&body).map_err(|e| {
            Failure::new(format!("the token endpoint {at} answered {status} with no OAuth 2.0 token: {e}"))
                .hint(not_google())
        })?;
        if reply.token_type.as_deref().is_some_and(|t| !t.eq_ignore_ascii_case("bearer")) {
            return Err(Failure::new(format!("the token endpoint {at} issued a token of type {:?}", reply.token_type))
                .hint(not_google()));
        }
        if reply.access_token.is_empty() || http::HeaderValue::from_str(&reply.access_token).is_err() {
            return Err(Failure::new(format!("the token endpoint {at} issued an empty or unusable access token"))
                .hint(not_google()));
        }
        let (renew_at, expires_at) = match reply.expires_in {
            Some(secs) => {
                let life = Duration::from_secs(secs);
                let margin = (life / 2).min(MAX_MARGIN);
                (Some(asked + (life - margin)), Some(asked + life))
            }
            None => (None, None),
        };
        Ok(FileToken { value: reply.access_token, issued: asked, renew_at, expires_at })
    }

    /// What to do about a refusal with `status` and the OAuth 2.0 `error` code.
    fn hint(&self, status: reqwest::StatusCode, code: Option<&str>) -> String {
        match (&self.grantor, code) {
            (Grantor::ServiceAccount { client_email, .. }, Some("invalid_grant")) => format!(
                "the key may have been deleted or disabled, or the service account removed: create a new key \
                 (`gcloud iam service-accounts keys create --iam-account {client_email}`) and point \
                 GOOGLE_APPLICATION_CREDENTIALS at it; if the key is current, check this machine's clock (the JWT \
                 carries it)"
            ),
            (Grantor::ServiceAccount { client_email, .. }, Some("invalid_scope" | "unauthorized_client")) => {
                format!("the service account {client_email} may not ask for the scope {SCOPE}")
            }
            (Grantor::User { .. }, Some("invalid_grant")) => {
                format!("the refresh token has expired or was revoked: {USER_HINT}")
            }
            (Grantor::User { .. }, Some("invalid_client" | "unauthorized_client")) => {
                format!("the token endpoint does not know the file's OAuth client: {USER_HINT}")
            }
            (Grantor::User { .. }, Some("invalid_scope")) => {
                format!("the login did not grant the scope {SCOPE}: {USER_HINT}")
            }
            _ if status.is_server_error() => "the token endpoint failed: try again later".to_string(),
            _ => format!("check the file's token_uri ({}); Google's is {GOOGLE_TOKEN_URI}", self.token_uri.as_str()),
        }
    }
}

/// google-cloud-auth's credentials: its cache, and what this layer learned
/// about how long tokens live.
struct AdcCache {
    /// The file's JSON (none: the metadata server), to build anew from.
    json: Option<Value>,
    credentials: AccessTokenCredentials,
    /// The token last handed out, and when this layer first saw it.
    token: String,
    first_seen: Instant,
    /// Renew every token at this age (learned; `None`: the crate's cache suffices).
    renew_at: Option<Duration>,
}

impl AdcCache {
    /// Credentials and a first token, inside the host runtime (the crate's
    /// cache spawns its refresh task there).
    async fn open(json: Option<Value>) -> Result<Self, Failure> {
        let credentials = build(json.as_ref())?;
        let token = credentials.access_token().await.map_err(|e| Failure::new(error_text(&e)))?.token;
        Ok(Self { json, credentials, token, first_seen: Instant::now(), renew_at: None })
    }

    async fn current(&mut self) -> Result<String, Failure> {
        if self.renew_at.is_some_and(|age| self.first_seen.elapsed() >= age) {
            self.rebuild().await?;
            return Ok(self.token.clone());
        }
        let asked = Instant::now();
        match tokio::time::timeout(WAITED, self.credentials.access_token()).await {
            Err(_) => {
                // The cache holds an expired token and waits for its next
                // fetch (up to 10 s): tokens live about as long as the last
                // one was in use. Fetch one now instead.
                let life = asked.saturating_duration_since(self.first_seen);
                self.rebuild().await?;
                self.learn(life);
            }
            Ok(fetched) => {
                let token = fetched.map_err(|e| Failure::new(error_text(&e)))?.token;
                if token != self.token {
                    self.token = token;
                    self.first_seen = Instant::now();
                }
            }
        }
        Ok(self.token.clone())
    }

    async fn renew(&mut self, refused: &str) -> Result<Renewed, Failure> {
        if refused != self.token {
            return Ok(Renewed { changed: true, refused_after: None });
        }
        let age = self.first_seen.elapsed();
        self.rebuild().await?;
        if refused == self.token {
            return Ok(Renewed { changed: false, refused_after: None });
        }
        self.learn(age);
        Ok(Renewed { changed: true, refused_after: Some(age) })
    }

    /// Fresh credentials (a new cache, whose first act is to fetch a token).
    async fn rebuild(&mut self) -> Result<(), Failure> {
        let credentials = build(self.json.as_ref())?;
        let token = credentials.access_token().await.map_err(|e| Failure::new(error_text(&e)))?.token;
        self.credentials = credentials;
        self.token = token;
        self.first_seen = Instant::now();
        Ok(())
    }

    /// Tokens here live about `life`: renew them at half of it.
    fn learn(&mut self, life: Duration) {
        let age = (life / 2).max(MIN_AGE);
        self.renew_at = Some(self.renew_at.map_or(age, |known| known.min(age)));
    }
}

/// google-cloud-auth's credentials for an ADC file's JSON (by its `type`,
/// as the crate's own ADC builder dispatches) or, without one, the metadata
/// server's.
fn build(json: Option<&Value>) -> Result<AccessTokenCredentials, Failure> {
    let built = match json {
        None => mds::Builder::default().with_scopes([SCOPE]).build_access_token_credentials(),
        Some(json) => match json.get("type").and_then(Value::as_str) {
            Some("impersonated_service_account") => {
                impersonated::Builder::new(json.clone()).with_scopes([SCOPE]).build_access_token_credentials()
            }
            Some("external_account") => {
                external_account::Builder::new(json.clone()).with_scopes([SCOPE]).build_access_token_credentials()
            }
            Some("external_account_authorized_user") => {
                external_account_authorized_user::Builder::new(json.clone()).build_access_token_credentials()
            }
            Some(other) => {
                return Err(Failure::new(format!("credentials of type {other:?} are not supported")).hint(
                    "use a service-account key file (\"type\": \"service_account\") or an authorized-user file \
                     (\"type\": \"authorized_user\", from `gcloud auth application-default login`)",
                ));
            }
            None => {
                return Err(Failure::new("the file has no \"type\"").hint(
                    "use a service-account key file (\"type\": \"service_account\") or an authorized-user file \
                     (\"type\": \"authorized_user\", from `gcloud auth application-default login`)",
                ));
            }
        },
    };
    built.map_err(|e| Failure::new(error_text(&e)))
}

/// An ADC file's `"type"`.
fn file_type(json: &Value) -> Option<&str> {
    json.get("type").and_then(Value::as_str)
}

/// An error with its causes.
use sluice_core::chain as error_text;
