//! Google access tokens for `auth = "google"` endpoints (`[sink.grpc.<name>]`,
//! `[sink.http.<name>]`): Application Default Credentials as Google's
//! libraries define them (AIP-4110): the JSON file `GOOGLE_APPLICATION_CREDENTIALS`
//! names (service account or authorized user), else gcloud's well-known
//! ADC file, else the metadata server (`GCE_METADATA_HOST` honoured).
//!
//! Invariants:
//! - tokens stay in the host: the grpc and http capabilities add the
//!   `authorization` header themselves; a plugin never sees a token;
//! - a grant opens only with a first token in hand, so unusable credentials
//!   stop the run before anything is written, naming the source tried and
//!   what to do;
//! - a token is renewed before it expires: google-cloud-auth's cache renews
//!   a token 4 minutes before its expiry (Google issues them for 3600 s),
//!   and makes callers wait once one has expired. A token that lives less
//!   than 4 minutes is fetched again only every 10 s, which would make calls
//!   wait, so this layer fetches at once when the cache would wait, learns
//!   how long tokens live here (from one that expired on it, or that the
//!   service refused), and from then on renews every token at half that
//!   age, before it can expire;
//! - a token the service refused is renewed at once ([`GoogleToken::renew`]),
//!   and the caller retries the refused call only where that is safe.
//!
//! Why google-cloud-auth (Google's own crate) and not gcp_auth: gcp_auth
//! 0.12 asks `metadata.google.internal` only and ignores `GCE_METADATA_HOST`.
//! google-cloud-auth is built without default features (no aws-lc-rs); its
//! reqwest 0.13 (already in the build, through opendal) uses rustls with
//! the ring provider, which [`install_ring`] installs process-wide.

use std::time::{Duration, Instant};

use google_cloud_auth::credentials::{AccessTokenCredentials, Builder};
use thiserror::Error;

/// The scope BigQuery's APIs accept.
const SCOPE: &str = "https://www.googleapis.com/auth/cloud-platform";
/// Longest the first token may take at setup.
const FIRST_TOKEN_TIMEOUT: Duration = Duration::from_secs(30);
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

/// Where Application Default Credentials come from, decided as the crate
/// decides (AIP-4110), for error messages.
#[derive(Debug, Clone)]
enum AdcSource {
    EnvFile(String),
    WellKnown(String),
    Metadata(String),
}

impl AdcSource {
    fn current() -> Self {
        if let Some(path) = std::env::var_os("GOOGLE_APPLICATION_CREDENTIALS") {
            return AdcSource::EnvFile(path.to_string_lossy().into_owned());
        }
        if let Some(home) = std::env::var_os("HOME") {
            let path = std::path::Path::new(&home).join(".config/gcloud/application_default_credentials.json");
            if path.exists() {
                return AdcSource::WellKnown(path.to_string_lossy().into_owned());
            }
        }
        let host = std::env::var("GCE_METADATA_HOST").unwrap_or_else(|_| "metadata.google.internal".to_string());
        AdcSource::Metadata(host)
    }

    fn describe(&self) -> String {
        match self {
            AdcSource::EnvFile(p) => format!("the file {p} (GOOGLE_APPLICATION_CREDENTIALS)"),
            AdcSource::WellKnown(p) => format!("gcloud's ADC file {p}"),
            AdcSource::Metadata(h) => format!(
                "the metadata server http://{h}/computeMetadata/v1/instance/service-accounts/default/token \
                 (no GOOGLE_APPLICATION_CREDENTIALS, no gcloud ADC file)"
            ),
        }
    }

    fn hint(&self) -> &'static str {
        match self {
            AdcSource::EnvFile(_) => {
                "point GOOGLE_APPLICATION_CREDENTIALS at a readable service-account or authorized-user JSON file"
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

struct State {
    credentials: AccessTokenCredentials,
    /// The token last handed out, and when this layer first saw it.
    token: String,
    first_seen: Instant,
    /// Renew every token at this age (learned; `None`: the crate's cache suffices).
    renew_at: Option<Duration>,
}

/// One endpoint's Google credentials, shared by the run's instances.
pub struct GoogleToken {
    key: String,
    source: AdcSource,
    state: tokio::sync::Mutex<State>,
}

impl std::fmt::Debug for GoogleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints the token.
        f.debug_struct("GoogleToken").field("key", &self.key).field("source", &self.source).finish()
    }
}

impl GoogleToken {
    /// Builds the credentials for the endpoint `key` (`sink.grpc.bigquery`)
    /// and fetches a first token, on the host runtime. Must not be called
    /// from a runtime thread.
    pub fn open(key: &str) -> Result<Self, GoogleAuthError> {
        install_ring();
        let source = AdcSource::current();
        let fail = |message: String| GoogleAuthError::Credentials {
            key: key.to_string(),
            source_tried: source.describe(),
            message,
            hint: source.hint().to_string(),
        };
        let first = super::runtime().block_on(async {
            let credentials = build().map_err(&fail)?;
            let token = match tokio::time::timeout(FIRST_TOKEN_TIMEOUT, credentials.access_token()).await {
                Err(_) => return Err(fail(format!("no token within {} s", FIRST_TOKEN_TIMEOUT.as_secs()))),
                Ok(Err(e)) => return Err(fail(error_text(&e))),
                Ok(Ok(t)) => t.token,
            };
            Ok(State { credentials, token, first_seen: Instant::now(), renew_at: None })
        })?;
        Ok(Self { key: key.to_string(), source, state: tokio::sync::Mutex::new(first) })
    }

    /// `Bearer <token>`: a token not expired, renewed ahead when tokens
    /// here live shorter than the crate's cache renews them.
    pub async fn bearer(&self) -> Result<String, GoogleAuthError> {
        let mut state = self.state.lock().await;
        if state.renew_at.is_some_and(|age| state.first_seen.elapsed() >= age) {
            self.rebuild(&mut state).await?;
            return Ok(format!("Bearer {}", state.token));
        }
        let asked = Instant::now();
        match tokio::time::timeout(WAITED, state.credentials.access_token()).await {
            Err(_) => {
                // The cache holds an expired token and waits for its next
                // fetch (up to 10 s): tokens live about as long as the last
                // one was in use. Fetch one now instead.
                let life = asked.saturating_duration_since(state.first_seen);
                self.rebuild(&mut state).await?;
                learn(&mut state, life);
            }
            Ok(fetched) => {
                let token = fetched.map_err(|e| self.fail(error_text(&e)))?.token;
                if token != state.token {
                    state.token = token;
                    state.first_seen = Instant::now();
                }
            }
        }
        Ok(format!("Bearer {}", state.token))
    }

    /// The service refused `refused` (`Bearer <token>`) as unauthenticated:
    /// renews it unless that happened already. Whether the token now
    /// handed out differs (`false`: the credentials themselves are refused,
    /// and a retry would be refused again).
    pub async fn renew(&self, refused: &str) -> Result<bool, GoogleAuthError> {
        let mut state = self.state.lock().await;
        if refused.strip_prefix("Bearer ") != Some(state.token.as_str()) {
            return Ok(true);
        }
        let age = state.first_seen.elapsed();
        self.rebuild(&mut state).await?;
        if refused.strip_prefix("Bearer ") == Some(state.token.as_str()) {
            return Ok(false);
        }
        learn(&mut state, age);
        tracing::debug!("{}: the token was refused after {} ms; renewed", self.key, age.as_millis());
        Ok(true)
    }

    /// Fresh credentials (a new cache, whose first act is to fetch a token).
    async fn rebuild(&self, state: &mut State) -> Result<(), GoogleAuthError> {
        let credentials = build().map_err(|m| self.fail(m))?;
        let token = credentials.access_token().await.map_err(|e| self.fail(error_text(&e)))?.token;
        state.credentials = credentials;
        state.token = token;
        state.first_seen = Instant::now();
        Ok(())
    }

    fn fail(&self, message: String) -> GoogleAuthError {
        GoogleAuthError::Credentials {
            key: self.key.clone(),
            source_tried: self.source.describe(),
            message,
            hint: self.source.hint().to_string(),
        }
    }
}

/// Tokens here live about `life`: renew them at half of it.
fn learn(state: &mut State, life: Duration) {
    let age = (life / 2).max(MIN_AGE);
    state.renew_at = Some(state.renew_at.map_or(age, |known| known.min(age)));
}

/// ADC credentials; inside the host runtime (the crate's cache spawns its
/// refresh task there).
fn build() -> Result<AccessTokenCredentials, String> {
    Builder::default().with_scopes([SCOPE]).build_access_token_credentials().map_err(|e| error_text(&e))
}

/// An error with its causes.
fn error_text(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
}
