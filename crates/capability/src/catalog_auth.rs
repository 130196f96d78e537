//! Bearer tokens for an Iceberg REST catalog (`[sink.catalog] kind =
//! "rest"`): none, a static token (`token_env`), or OAuth2 client
//! credentials (`credential_env` / `credential_file`) exchanged at a token
//! endpoint (`oauth2_server_uri`, by default the REST spec's
//! `<uri>/v1/oauth/tokens`).
//!
//! The exchange is the REST spec's `getToken` (`rest-catalog-open-api.yaml`
//! in apache/iceberg) with an `OAuthClientCredentialsRequest` (RFC 6749
//! §4.4): `POST`, `application/x-www-form-urlencoded`, with
//! `grant_type=client_credentials`, `client_id`, `client_secret` and `scope`
//! in the body, as iceberg-rust's, Iceberg Java's and PyIceberg's legacy
//! clients send it. The answer is an `OAuthTokenResponse` (`access_token`,
//! `token_type`, `expires_in`) or, with 400 or 401, an `OAuthError`.
//!
//! Invariants:
//! - the credential and the tokens stay in the host: a plugin never sees
//!   them, and no `Debug` prints them;
//! - a grant opens only with a first token in hand ([`CatalogAuth::open`]),
//!   so a credential that cannot be used stops `sluice check` and `sluice
//!   run` before anything is written, naming the token endpoint, where the
//!   credential was read and what to do;
//! - a token is replaced before it expires: once `expires_in - min(expires_in
//!   / 2, 5 min)` has passed since its request was sent (an hour's token is
//!   replaced 5 minutes ahead, a 2 s token after 1 s); the clock starts
//!   before the request, so the server's own count is never behind ours. A
//!   token without `expires_in` is kept until the catalog refuses it;
//! - one exchange at a time: callers that find the token due wait for the
//!   exchange under way and share its token;
//! - a replacement that fails while the current token is still valid keeps
//!   that token (logged) and tries again at half its remaining life; once it
//!   has expired, the failure is the caller's error;
//! - a token the catalog refused (401 Unauthorized, or 419 "credentials
//!   have timed out, the client should refresh credentials and retry") is
//!   replaced once ([`CatalogAuth::refused`]) unless another caller replaced
//!   it already, and the caller retries the refused request once. A 401
//!   answers a request that was not authenticated, hence not processed: the
//!   retry cannot apply anything twice.
//!
//! Why this is the host's and not iceberg-catalog-rest's `credential`
//! property: in 0.10.1 that client exchanges the credential once and keeps
//! the token for good (its `HttpClient::authenticate` says "TODO: Support
//! automatic token refreshing"). It ignores `expires_in`, does not retry a
//! 401, and its token cannot be read for the host's own `updateTable` call
//! (`catalog_rest`). So the host obtains the tokens here and hands each one
//! to iceberg-rust's `RestCatalog` as its `token` property
//! (`catalog_rest::RestLoads`); the request sent is the one iceberg-rust
//! sends. The `oauth2` crate would do the single form POST but none of the
//! caching or refreshing, for another HTTP client stack.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{StatusCode, Url};
use serde::Deserialize;
use thiserror::Error;

use super::catalog_rest::chain;
use crate::config::{OAuth2Config, RestAuth};

/// The longest a token is replaced ahead of its expiry.
const MAX_MARGIN: Duration = Duration::from_secs(300);
/// The shortest wait before trying again after a failed replacement.
const MIN_RETRY: Duration = Duration::from_millis(100);
/// Longest one token request may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// A token that cannot be obtained: where from, with which credential, and
/// what to do.
#[derive(Debug, Error)]
pub enum CatalogAuthError {
    #[error(
        "cannot obtain an OAuth2 token from {endpoint} with the client credential in {credential_source}: \
         {message}; {hint}"
    )]
    Token { endpoint: String, credential_source: String, message: String, hint: String },
}

/// What one request carries: the token (if any) and which one it is.
#[derive(Clone)]
pub(crate) struct Bearer {
    token: Option<Arc<str>>,
    generation: u64,
}

impl std::fmt::Debug for Bearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints the token.
        f.debug_struct("Bearer").field("generation", &self.generation).finish_non_exhaustive()
    }
}

impl Bearer {
    /// The token, sent as `Authorization: Bearer <token>`.
    pub(crate) fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Which token this is: a new one has a new generation.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }
}

/// A token in use and when to replace it.
struct Token {
    value: Arc<str>,
    generation: u64,
    issued: Instant,
    renew_at: Option<Instant>,
    expires_at: Option<Instant>,
}

/// An OAuth2 client-credentials grant.
struct OAuth2 {
    http: reqwest::Client,
    endpoint: Url,
    client_id: Option<String>,
    secret: String,
    scope: String,
    credential_source: String,
    /// Held across an exchange: one at a time.
    state: tokio::sync::Mutex<Token>,
}

enum Inner {
    None,
    Static(Arc<str>),
    OAuth2(Box<OAuth2>),
}

/// The catalog's credentials, shared by every request the host sends it.
pub(crate) struct CatalogAuth {
    inner: Inner,
}

impl std::fmt::Debug for CatalogAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints the credential or a token.
        let kind = match &self.inner {
            Inner::None => "none".to_string(),
            Inner::Static(_) => "static token".to_string(),
            Inner::OAuth2(o) => format!("OAuth2 client credentials at {}", o.endpoint),
        };
        f.debug_struct("CatalogAuth").field("kind", &kind).finish()
    }
}

#[derive(Deserialize)]
struct TokenResponse {
    access_token: String,
    token_type: String,
    #[serde(default)]
    expires_in: Option<u64>,
}

/// What the token endpoint said when it refused, as an `OAuthError`
/// (`{"error": "invalid_client", "error_description": ...}`), the REST
/// spec's `IcebergErrorResponse`, or the body.
fn refusal(body: &[u8]) -> (Option<String>, String) {
    #[derive(Deserialize)]
    struct OAuthError {
        error: String,
        #[serde(default)]
        error_description: Option<String>,
    }
    if let Ok(e) = serde_json::from_slice::<OAuthError>(body) {
        let text = match &e.error_description {
            Some(d) => format!("{}: {d}", e.error),
            None => e.error.clone(),
        };
        return (Some(e.error), text);
    }
    (None, super::catalog_rest::error_message(body))
}

impl CatalogAuth {
    /// Credentials as the job gives them; OAuth2 ones are exchanged for a
    /// first token here, so that unusable ones stop the run before anything
    /// is written.
    pub(crate) async fn open(auth: Option<&RestAuth>) -> Result<Self, CatalogAuthError> {
        let inner = match auth {
            None => Inner::None,
            Some(RestAuth::Token(t)) => Inner::Static(Arc::from(t.expose())),
            Some(RestAuth::OAuth2(config)) => Inner::OAuth2(Box::new(OAuth2::open(config).await?)),
        };
        Ok(Self { inner })
    }

    /// A token not due for replacement (replaced first if it is).
    pub(crate) async fn bearer(&self) -> Result<Bearer, CatalogAuthError> {
        match &self.inner {
            Inner::None => Ok(Bearer { token: None, generation: 0 }),
            Inner::Static(t) => Ok(Bearer { token: Some(t.clone()), generation: 0 }),
            Inner::OAuth2(o) => o.current().await,
        }
    }

    /// The catalog refused `refused` as unauthenticated: the token to retry
    /// with, replaced unless that happened meanwhile. `None`: there is no
    /// other token to try (a static one, or none), and the refusal stands.
    pub(crate) async fn refused(&self, refused: &Bearer) -> Result<Option<Bearer>, CatalogAuthError> {
        match &self.inner {
            Inner::None | Inner::Static(_) => Ok(None),
            Inner::OAuth2(o) => o.replace_refused(refused).await.map(Some),
        }
    }
}

impl OAuth2 {
    async fn open(config: &OAuth2Config) -> Result<Self, CatalogAuthError> {
        let fail = |message: String, hint: String| CatalogAuthError::Token {
            endpoint: config.server_uri.clone(),
            credential_source: config.credential_source.clone(),
            message,
            hint,
        };
        let endpoint = Url::parse(&config.server_uri).map_err(|e| {
            fail(format!("not a URL: {e}"), "set sink.catalog.oauth2_server_uri to the token endpoint's URL".into())
        })?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(EXCHANGE_TIMEOUT)
            .build()
            .map_err(|e| fail(format!("cannot build an HTTP client: {e}"), "report this".into()))?;
        // Iceberg's clients split at the first ':'; a bare secret has no client id.
        let (client_id, secret) = match config.credential.expose().split_once(':') {
            Some((id, secret)) => (Some(id.to_string()), secret.to_string()),
            None => (None, config.credential.expose().to_string()),
        };
        let mut this = Self {
            http,
            endpoint,
            client_id,
            secret,
            scope: config.scope.clone(),
            credential_source: config.credential_source.clone(),
            state: tokio::sync::Mutex::new(Token {
                value: Arc::from(""),
                generation: 0,
                issued: Instant::now(),
                renew_at: None,
                expires_at: None,
            }),
        };
        let first = this.exchange(1).await?;
        *this.state.get_mut() = first;
        Ok(this)
    }

    async fn current(&self) -> Result<Bearer, CatalogAuthError> {
        let mut token = self.state.lock().await;
        let now = Instant::now();
        if token.renew_at.is_some_and(|at| now >= at) {
            match self.exchange(token.generation + 1).await {
                Ok(new) => {
                    tracing::debug!(
                        "sink.catalog: OAuth2 token {} replaced ahead of its expiry after {} ms",
                        token.generation,
                        token.issued.elapsed().as_millis()
                    );
                    *token = new;
                }
                Err(e) => match token.expires_at.and_then(|at| at.checked_duration_since(now)) {
                    Some(left) if !left.is_zero() => {
                        let again = (left / 2).max(MIN_RETRY);
                        token.renew_at = Some(now + again);
                        tracing::warn!(
                            "{e}; the current token is valid for {} ms more, trying again in {} ms",
                            left.as_millis(),
                            again.as_millis()
                        );
                    }
                    _ => return Err(e),
                },
            }
        }
        Ok(Bearer { token: Some(token.value.clone()), generation: token.generation })
    }

    async fn replace_refused(&self, refused: &Bearer) -> Result<Bearer, CatalogAuthError> {
        let mut token = self.state.lock().await;
        if token.generation == refused.generation {
            let age = token.issued.elapsed();
            *token = self.exchange(token.generation + 1).await?;
            tracing::info!(
                "sink.catalog: the catalog refused OAuth2 token {} after {} ms; obtained a new one",
                refused.generation,
                age.as_millis()
            );
        }
        Ok(Bearer { token: Some(token.value.clone()), generation: token.generation })
    }

    fn fail(&self, message: String, hint: String) -> CatalogAuthError {
        CatalogAuthError::Token {
            endpoint: self.endpoint.to_string(),
            credential_source: self.credential_source.clone(),
            message,
            hint,
        }
    }

    /// One client-credentials exchange: the token numbered `generation`.
    async fn exchange(&self, generation: u64) -> Result<Token, CatalogAuthError> {
        let mut form: Vec<(&str, &str)> = vec![("grant_type", "client_credentials")];
        if let Some(id) = &self.client_id {
            form.push(("client_id", id));
        }
        form.push(("client_secret", &self.secret));
        form.push(("scope", &self.scope));
        let asked = Instant::now();
        let reply =
            self.http.post(self.endpoint.clone()).header(reqwest::header::ACCEPT, "application/json").form(&form);
        let reply = reply.send().await.map_err(|e| {
            self.fail(
                format!("the request failed: {}", chain(&e)),
                "check that the token endpoint is reachable (sink.catalog.oauth2_server_uri; by default the \
                 catalog's <uri>/v1/oauth/tokens)"
                    .into(),
            )
        })?;
        let status = reply.status();
        let body = reply
            .bytes()
            .await
            .map_err(|e| self.fail(format!("{status}, and the reply was lost: {}", chain(&e)), "try again".into()))?;
        if status != StatusCode::OK {
            let (code, text) = refusal(&body);
            return Err(self.fail(format!("{status}: {text}"), self.hint(status, code.as_deref())));
        }
        let reply: TokenResponse = serde_json::from_slice(&body).map_err(|e| {
            self.fail(
                format!("the reply is not an OAuth2 token response: {e}"),
                "set sink.catalog.oauth2_server_uri to an OAuth2 token endpoint".into(),
            )
        })?;
        if !reply.token_type.eq_ignore_ascii_case("bearer") {
            return Err(self.fail(
                format!("the token's type is {:?}, not bearer", reply.token_type),
                "use a token endpoint that issues bearer tokens".into(),
            ));
        }
        if reply.access_token.is_empty() || reqwest::header::HeaderValue::from_str(&reply.access_token).is_err() {
            return Err(self.fail(
                "the access token is empty or not a valid header value".into(),
                "check the token endpoint".into(),
            ));
        }
        let (renew_at, expires_at) = match reply.expires_in {
            Some(secs) => {
                let life = Duration::from_secs(secs);
                let margin = (life / 2).min(MAX_MARGIN);
                (Some(asked + (life - margin)), Some(asked + life))
            }
            None => (None, None),
        };
        Ok(Token { value: Arc::from(reply.access_token), generation, issued: asked, renew_at, expires_at })
    }

    /// What to do about a refusal with `status` and the OAuth2 `error` code.
    fn hint(&self, status: StatusCode, code: Option<&str>) -> String {
        let credential = format!("check the client id and secret in {}", self.credential_source);
        match code {
            Some("invalid_scope") => format!("check sink.catalog.scope (asked: {:?})", self.scope),
            Some("unsupported_grant_type") => "the endpoint does not take the client_credentials grant: set \
                 sink.catalog.oauth2_server_uri to one that does"
                .into(),
            Some(_) => credential,
            None => match status {
                StatusCode::BAD_REQUEST | StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => credential,
                StatusCode::NOT_FOUND | StatusCode::METHOD_NOT_ALLOWED => "the catalog serves no OAuth2 token \
                     endpoint there: set sink.catalog.oauth2_server_uri to your identity provider's token endpoint"
                    .into(),
                _ => "the token endpoint failed: try again later".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_the_oauth_error_or_the_iceberg_error() {
        let (code, text) = refusal(br#"{"error": "invalid_client", "error_description": "wrong secret"}"#);
        assert_eq!(code.as_deref(), Some("invalid_client"));
        assert_eq!(text, "invalid_client: wrong secret");
        let (code, text) = refusal(br#"{"error": {"message": "no", "type": "NotAuthorizedException", "code": 401}}"#);
        assert_eq!(code, None);
        assert_eq!(text, "NotAuthorizedException: no");
    }

    #[test]
    fn debug_never_shows_a_token() {
        let b = Bearer { token: Some(Arc::from("s3cr3t")), generation: 7 };
        assert!(!format!("{b:?}").contains("s3cr3t"));
        let a = CatalogAuth { inner: Inner::Static(Arc::from("s3cr3t")) };
        assert!(!format!("{a:?}").contains("s3cr3t"));
    }
}
