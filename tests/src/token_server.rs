//! A token service double, on 127.0.0.1, issuing tokens that expire after
//! a few seconds, so that a test of a minute sees many renewals. It serves
//! two of Google's token services:
//!
//! **The Compute Engine metadata server's token endpoint**, as documented in
//! - <https://cloud.google.com/compute/docs/metadata/querying-metadata>:
//!   every request must carry `Metadata-Flavor: Google`, else `403
//!   Forbidden`; replies carry `Metadata-Flavor: Google`; the server is
//!   found at `GCE_METADATA_HOST` by Google's client libraries;
//! - <https://cloud.google.com/compute/docs/access/authenticate-workloads#applications>:
//!   `GET /computeMetadata/v1/instance/service-accounts/default/token`
//!   (optionally `?scopes=a,b`) answers
//!   `{"access_token": "...", "expires_in": <seconds>, "token_type": "Bearer"}`.
//!
//! **Google's OAuth 2.0 token endpoint** (`https://oauth2.googleapis.com/token`),
//! here `POST /token` ([`TokenServer::token_uri`], the `token_uri` of the key
//! files [`TokenServer::service_account_file`] and
//! [`TokenServer::authorized_user_file`] write), with two grants:
//! - `grant_type=urn:ietf:params:oauth:grant-type:jwt-bearer` with an
//!   `assertion`, as
//!   <https://developers.google.com/identity/protocols/oauth2/service-account#authorizingrequests>
//!   describes it: a JWT whose header is `{"alg":"RS256","typ":"JWT"}`
//!   (a `kid` allowed), signed with RSASSA-PKCS1-v1_5 SHA-256 by the service
//!   account's key, whose claims are `iss` (the account's email), `scope`
//!   (space-delimited), `aud` ("always" the token endpoint's URL), `exp` (at
//!   most 1 hour after `iat`) and `iat`. The signature is verified against
//!   the public key registered for `iss` ([`TokenServer::add_service_account`]);
//! - `grant_type=refresh_token` with `client_id`, `client_secret` and
//!   `refresh_token`, as
//!   <https://developers.google.com/identity/protocols/oauth2/web-server#offline>
//!   describes it, against the users registered with
//!   [`TokenServer::add_authorized_user`].
//!
//! Requests are form-encoded (`application/x-www-form-urlencoded`, RFC 6749
//! §4.1.3), or JSON, which Google's endpoint also takes and google-cloud-auth
//! sends for refresh tokens. Answers are `{"access_token", "expires_in",
//! "token_type": "Bearer"}` (plus `scope` for a refresh), or an OAuth error
//! (RFC 6749 §5.2) with Google's wording where its documentation gives it:
//! 400 `invalid_grant` ("Invalid JWT Signature.", "Invalid JWT: Token must be
//! a short-lived token (60 minutes) and in a reasonable timeframe. Check your
//! iat and exp values in the JWT claim.", "Invalid grant: account not found",
//! "Token has been expired or revoked."), 400 `invalid_scope`, 401
//! `invalid_client` ("The OAuth client was not found."), 400
//! `unsupported_grant_type`, 400 `invalid_request`.
//!
//! Invariants:
//! - every token is new (unique) and valid from its issue until `lifetime`
//!   after it; [`TokenServer::validator`] is the service's view of it, which
//!   the BigQuery double uses to refuse an expired or unknown token;
//! - `expires_in` is whole seconds rounded down, as a server counting its
//!   own clock reports it: a client never thinks a token lives longer than
//!   it does;
//! - a JWT-bearer grant issues a token only for an assertion whose
//!   signature verifies against the registered key and whose claims hold.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{FromRequest, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Json};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::signature::{KeyPair as _, RSA_PKCS1_2048_8192_SHA256, RsaKeyPair, UnparsedPublicKey};
use serde_json::{Value, json};

/// Path of the default service account's token at the metadata server.
pub const TOKEN_PATH: &str = "/computeMetadata/v1/instance/service-accounts/default/token";
/// Path of the OAuth 2.0 token endpoint.
pub const OAUTH_TOKEN_PATH: &str = "/token";
/// The JWT-bearer grant type (RFC 7523 §2.1).
pub const JWT_BEARER: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
/// The scope the host asks for.
pub const CLOUD_PLATFORM: &str = "https://www.googleapis.com/auth/cloud-platform";
/// The TEST-ONLY RSA key of the service-account key files written here
/// (`tests/fixtures/README.md`): public on purpose, it protects nothing.
pub const TEST_ONLY_PRIVATE_KEY_PEM: &str = include_str!("../fixtures/TEST-ONLY-google-service-account-key.pem");
/// The longest an assertion may live (Google: "a maximum of 1 hour after the issued time").
const MAX_ASSERTION_LIFE: u64 = 3600;
/// Clock skew allowed on `iat`.
const SKEW: u64 = 60;

/// Which grant issued a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Grant {
    /// The metadata server.
    Metadata,
    /// The OAuth 2.0 JWT-bearer grant (a service-account key).
    JwtBearer,
    /// The OAuth 2.0 refresh-token grant (an authorized user).
    RefreshToken,
}

/// The claims of an accepted JWT assertion, and its header's `kid`.
#[derive(Debug, Clone)]
pub struct Assertion {
    pub kid: Option<String>,
    pub iss: String,
    pub aud: String,
    pub scope: String,
    pub iat: u64,
    pub exp: u64,
}

struct AuthorizedUser {
    client_secret: String,
    refresh_token: String,
}

#[derive(Default)]
struct Registry {
    /// `client_email` → PKCS#1 `RSAPublicKey` DER.
    service_accounts: HashMap<String, Vec<u8>>,
    /// `client_id` → the user.
    users: HashMap<String, AuthorizedUser>,
}

#[derive(Default)]
struct Stats {
    by_grant: HashMap<Grant, usize>,
    /// Requests refused for a missing `Metadata-Flavor: Google`.
    flavor_refused: u64,
    /// OAuth errors answered: `error: error_description`.
    oauth_refusals: Vec<String>,
    /// Accepted JWT assertions.
    assertions: Vec<Assertion>,
}

struct Shared {
    lifetime: Duration,
    token_uri: String,
    /// Token → when it expires.
    issued: Mutex<HashMap<String, Instant>>,
    registry: Mutex<Registry>,
    stats: Mutex<Stats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn issued(&self) -> MutexGuard<'_, HashMap<String, Instant>> {
        lock(&self.issued)
    }

    /// A new token of `lifetime`, and its `expires_in` (whole seconds, rounded down).
    fn issue(&self, grant: Grant) -> (String, u64) {
        let mut issued = self.issued();
        let access_token = format!("ya29.double-{}-{:x}", issued.len(), rand::random::<u64>());
        issued.insert(access_token.clone(), Instant::now() + self.lifetime);
        drop(issued);
        *lock(&self.stats).by_grant.entry(grant).or_default() += 1;
        (access_token, self.lifetime.as_secs())
    }
}

/// The token services, serving until dropped.
pub struct TokenServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    /// Starts on a free port; tokens live `lifetime`.
    pub fn start(lifetime: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            lifetime,
            token_uri: format!("http://{addr}{OAUTH_TOKEN_PATH}"),
            issued: Mutex::default(),
            registry: Mutex::default(),
            stats: Mutex::default(),
        });
        let app = axum::Router::new()
            .route(TOKEN_PATH, get(metadata_token))
            .route(OAUTH_TOKEN_PATH, post(oauth_token))
            .with_state(shared.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Ok(Self { shared, addr, shutdown: Some(tx), thread: Some(thread) })
    }

    /// `127.0.0.1:PORT`, the value of `GCE_METADATA_HOST`.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// `http://127.0.0.1:PORT/token`: the OAuth 2.0 token endpoint, a key file's `token_uri`.
    pub fn token_uri(&self) -> String {
        self.shared.token_uri.clone()
    }

    /// Registers a service account and the public half of its key (PKCS#1
    /// `RSAPublicKey` DER): its JWT assertions are verified against it.
    pub fn add_service_account(&self, client_email: &str, public_key_der: Vec<u8>) {
        lock(&self.shared.registry).service_accounts.insert(client_email.to_string(), public_key_der);
    }

    /// Registers an authorized user (an OAuth client and a refresh token).
    pub fn add_authorized_user(&self, client_id: &str, client_secret: &str, refresh_token: &str) {
        lock(&self.shared.registry).users.insert(
            client_id.to_string(),
            AuthorizedUser { client_secret: client_secret.to_string(), refresh_token: refresh_token.to_string() },
        );
    }

    /// Writes a service-account key file for `client_email` with the
    /// TEST-ONLY key, whose `token_uri` is this server (not registered:
    /// see [`Self::add_service_account`]).
    pub fn service_account_file(&self, dir: &Path, client_email: &str) -> PathBuf {
        let key = json!({
            "type": "service_account",
            "project_id": "sluice-test",
            "private_key_id": "test-only-key-1",
            "private_key": TEST_ONLY_PRIVATE_KEY_PEM,
            "client_email": client_email,
            "client_id": "100000000000000000001",
            "auth_uri": "https://accounts.google.com/o/oauth2/auth",
            "token_uri": self.token_uri(),
            "auth_provider_x509_cert_url": "https://www.googleapis.com/oauth2/v1/certs",
            "universe_domain": "googleapis.com",
        });
        let path = dir.join("service-account.json");
        std::fs::write(&path, serde_json::to_vec_pretty(&key).expect("JSON")).expect("writing the key file");
        path
    }

    /// Writes an authorized-user file as `gcloud auth application-default
    /// login` does, with this server as `token_uri`, at `path`.
    pub fn authorized_user_file(&self, path: &Path, client_id: &str, client_secret: &str, refresh_token: &str) {
        let file = json!({
            "type": "authorized_user",
            "client_id": client_id,
            "client_secret": client_secret,
            "refresh_token": refresh_token,
            "token_uri": self.token_uri(),
            "universe_domain": "googleapis.com",
        });
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("creating the file's directory");
        }
        std::fs::write(path, serde_json::to_vec_pretty(&file).expect("JSON")).expect("writing the file");
    }

    /// The service's check of a token: issued here and not expired.
    pub fn validator(&self) -> impl Fn(&str) -> bool + Send + Sync + 'static {
        let shared = self.shared.clone();
        move |token: &str| shared.issued().get(token).is_some_and(|expires| Instant::now() < *expires)
    }

    /// Revokes every token issued so far (as when a service account's
    /// keys are rotated): the service refuses them from now on.
    pub fn revoke_all(&self) {
        let now = Instant::now();
        for expires in self.shared.issued().values_mut() {
            *expires = (*expires).min(now);
        }
    }

    /// Tokens issued so far, by any grant.
    pub fn issued(&self) -> usize {
        self.shared.issued().len()
    }

    /// Tokens issued so far by `grant`.
    pub fn issued_by(&self, grant: Grant) -> usize {
        lock(&self.shared.stats).by_grant.get(&grant).copied().unwrap_or(0)
    }

    /// Metadata requests refused for a missing `Metadata-Flavor: Google` header.
    pub fn refused(&self) -> u64 {
        lock(&self.shared.stats).flavor_refused
    }

    /// The OAuth errors answered so far (`error: error_description`).
    pub fn oauth_refusals(&self) -> Vec<String> {
        lock(&self.shared.stats).oauth_refusals.clone()
    }

    /// The JWT assertions accepted so far.
    pub fn assertions(&self) -> Vec<Assertion> {
        lock(&self.shared.stats).assertions.clone()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The public half (PKCS#1 `RSAPublicKey` DER) of a PKCS#8 PEM RSA key.
pub fn public_key_der(private_key_pem: &str) -> Vec<u8> {
    let body: String = private_key_pem.lines().filter(|l| !l.starts_with("-----")).collect();
    let der = base64::engine::general_purpose::STANDARD.decode(body).expect("the key's PEM body is base64");
    let pair = RsaKeyPair::from_pkcs8(&der).expect("a PKCS#8 RSA key");
    pair.public_key().as_ref().to_vec()
}

async fn metadata_token(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let flavor = HeaderValue::from_static("Google");
    if headers.get("metadata-flavor") != Some(&flavor) {
        lock(&shared.stats).flavor_refused += 1;
        // The documented answer to a request without the header.
        return (StatusCode::FORBIDDEN, "Missing required header: Metadata-Flavor").into_response();
    }
    let (access_token, expires_in) = shared.issue(Grant::Metadata);
    let body = json!({ "access_token": access_token, "expires_in": expires_in, "token_type": "Bearer" });
    let mut response = Json(body).into_response();
    response.headers_mut().insert("metadata-flavor", flavor);
    response
}

/// An OAuth error (RFC 6749 §5.2), recorded.
fn oauth_error(shared: &Shared, status: StatusCode, error: &str, description: &str) -> Response {
    lock(&shared.stats).oauth_refusals.push(format!("{error}: {description}"));
    (status, Json(json!({ "error": error, "error_description": description }))).into_response()
}

/// The request's parameters, form-encoded or JSON.
async fn parameters(request: Request) -> Result<HashMap<String, String>, String> {
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if json {
        let Json(map) = Json::<HashMap<String, Value>>::from_request(request, &()).await.map_err(|e| e.body_text())?;
        Ok(map.into_iter().map(|(k, v)| (k, v.as_str().map_or_else(|| v.to_string(), str::to_string))).collect())
    } else {
        let Form(map) = Form::<HashMap<String, String>>::from_request(request, &()).await.map_err(|e| e.body_text())?;
        Ok(map)
    }
}

async fn oauth_token(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let params = match parameters(request).await {
        Ok(p) => p,
        Err(e) => return oauth_error(&shared, StatusCode::BAD_REQUEST, "invalid_request", &e),
    };
    match params.get("grant_type").map(String::as_str) {
        Some(JWT_BEARER) => jwt_bearer(&shared, &params),
        Some("refresh_token") => refresh(&shared, &params),
        other => oauth_error(
            &shared,
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            &format!("Invalid grant_type: {}", other.unwrap_or("")),
        ),
    }
}

/// The JWT-bearer grant: the assertion's signature against the key
/// registered for its `iss`, then its claims.
fn jwt_bearer(shared: &Shared, params: &HashMap<String, String>) -> Response {
    let invalid_grant = |description: &str| oauth_error(shared, StatusCode::BAD_REQUEST, "invalid_grant", description);
    let Some(assertion) = params.get("assertion") else {
        return oauth_error(
            shared,
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Missing required parameter: assertion",
        );
    };
    let parts: Vec<&str> = assertion.split('.').collect();
    let [header_b64, claims_b64, signature_b64] = parts[..] else {
        return invalid_grant("Invalid JWT: not three dot-separated parts");
    };
    let decode = |part: &str| URL_SAFE_NO_PAD.decode(part).ok();
    let parse = |part: &str| decode(part).and_then(|b| serde_json::from_slice::<Value>(&b).ok());
    let (Some(head), Some(claims), Some(signature)) = (parse(header_b64), parse(claims_b64), decode(signature_b64))
    else {
        return invalid_grant("Invalid JWT: a part is not base64url JSON");
    };
    if head.get("alg").and_then(Value::as_str) != Some("RS256") {
        return invalid_grant(&format!("Invalid JWT: alg must be RS256, got {}", head["alg"]));
    }
    if head.get("typ").and_then(Value::as_str).is_some_and(|t| t != "JWT") {
        return invalid_grant(&format!("Invalid JWT: typ must be JWT, got {}", head["typ"]));
    }
    let Some(iss) = claims.get("iss").and_then(Value::as_str) else {
        return invalid_grant("Invalid JWT: no iss");
    };
    let Some(key) = lock(&shared.registry).service_accounts.get(iss).cloned() else {
        return invalid_grant("Invalid grant: account not found");
    };
    let signed = format!("{header_b64}.{claims_b64}");
    if UnparsedPublicKey::new(&RSA_PKCS1_2048_8192_SHA256, &key).verify(signed.as_bytes(), &signature).is_err() {
        return invalid_grant("Invalid JWT Signature.");
    }
    let aud = claims.get("aud").and_then(Value::as_str).unwrap_or("");
    if aud != shared.token_uri {
        return invalid_grant(&format!(
            "Invalid JWT: Failed audience check. The right audience is {}",
            shared.token_uri
        ));
    }
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (iat, exp) = (claims.get("iat").and_then(Value::as_u64), claims.get("exp").and_then(Value::as_u64));
    let timely = match (iat, exp) {
        (Some(iat), Some(exp)) => iat <= now + SKEW && exp > now && exp > iat && exp - iat <= MAX_ASSERTION_LIFE,
        _ => false,
    };
    let (Some(iat), Some(exp), true) = (iat, exp, timely) else {
        return invalid_grant(
            "Invalid JWT: Token must be a short-lived token (60 minutes) and in a reasonable timeframe. Check \
             your iat and exp values in the JWT claim.",
        );
    };
    let scope = claims.get("scope").and_then(Value::as_str).unwrap_or("");
    if scope.split(' ').all(str::is_empty) {
        return oauth_error(
            shared,
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            "Invalid OAuth scope or ID token audience provided.",
        );
    }
    lock(&shared.stats).assertions.push(Assertion {
        kid: head.get("kid").and_then(Value::as_str).map(str::to_string),
        iss: iss.to_string(),
        aud: aud.to_string(),
        scope: scope.to_string(),
        iat,
        exp,
    });
    let (access_token, expires_in) = shared.issue(Grant::JwtBearer);
    Json(json!({ "access_token": access_token, "expires_in": expires_in, "token_type": "Bearer" })).into_response()
}

/// The refresh-token grant of an authorized user.
fn refresh(shared: &Shared, params: &HashMap<String, String>) -> Response {
    let (Some(client_id), Some(client_secret), Some(refresh_token)) =
        (params.get("client_id"), params.get("client_secret"), params.get("refresh_token"))
    else {
        return oauth_error(
            shared,
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Missing required parameter: client_id, client_secret or refresh_token",
        );
    };
    let known = {
        let registry = lock(&shared.registry);
        registry.users.get(client_id).map(|u| (u.client_secret == *client_secret, u.refresh_token == *refresh_token))
    };
    match known {
        None | Some((false, _)) => {
            oauth_error(shared, StatusCode::UNAUTHORIZED, "invalid_client", "The OAuth client was not found.")
        }
        Some((true, false)) => {
            oauth_error(shared, StatusCode::BAD_REQUEST, "invalid_grant", "Token has been expired or revoked.")
        }
        Some((true, true)) => {
            let scope = params.get("scope").cloned().unwrap_or_else(|| CLOUD_PLATFORM.to_string());
            let (access_token, expires_in) = shared.issue(Grant::RefreshToken);
            Json(json!({
                "access_token": access_token,
                "expires_in": expires_in,
                "scope": scope,
                "token_type": "Bearer",
            }))
            .into_response()
        }
    }
}
