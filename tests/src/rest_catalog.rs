//! A test double of an Apache Iceberg REST catalog, on 127.0.0.1 over real
//! HTTP, serving the endpoints a writer and a reader need, as the REST
//! catalog spec (`open-api/rest-catalog-open-api.yaml` in apache/iceberg)
//! defines them:
//!
//! - `GET /v1/config`: `{"defaults": {}, "overrides": {}}`;
//! - `HEAD`/`GET /v1/namespaces/{ns}`, `POST /v1/namespaces`;
//! - `HEAD`/`GET /v1/namespaces/{ns}/tables/{table}` (`LoadTableResult`);
//! - `POST /v1/namespaces/{ns}/tables` (`createTable`, 409 when it exists);
//! - `POST /v1/namespaces/{ns}/tables/{table}` (`updateTable`): every
//!   requirement is checked against the current metadata ("409: Conflict -
//!   CommitFailedException, one or more requirements failed. The client may
//!   retry."), the updates are applied, a new metadata file is written, and
//!   the table points at it, atomically under one lock.
//!
//! Errors have the spec's `{"error": {"message", "type", "code"}}` body.
//! Faults: lose the reply of an applied commit (504, "CommitStateUnknown"),
//! refuse a commit as a conflict (409), or fail before applying (503).
//!
//! With OAuth2 ([`RestCatalogDouble::start_with_oauth`]) it is also the
//! token service, as the spec's `securitySchemes` describe it ("OAuth2 ...
//! flows: clientCredentials: tokenUrl: /v1/oauth/tokens"; "For unauthorized
//! requests, services should return an appropriate 401 or 403 response"):
//! - `POST /v1/oauth/tokens` (`getToken`): an `OAuthClientCredentialsRequest`,
//!   form-encoded: `grant_type=client_credentials`, `client_id` and
//!   `client_secret` in the body or, as RFC 6749 §2.3.1 prefers, in an HTTP
//!   Basic `Authorization` header, and optionally `scope` (the spec's one
//!   scope, `catalog`). It answers an `OAuthTokenResponse` (`access_token`,
//!   `token_type: bearer`, `expires_in` in whole seconds rounded down,
//!   `issued_token_type`), or an `OAuthError`: 400 `invalid_request`,
//!   `unsupported_grant_type`, `invalid_scope`; 401 `invalid_client`;
//! - `POST /idp/token`: the same grant at a path of its own, standing in for
//!   an external identity provider's token endpoint (`oauth2-server-uri`);
//! - every catalog route (`/v1/config` included, as each lists `401:
//!   UnauthorizedResponse`) requires `Authorization: Bearer <token>` with a
//!   token issued here and not expired, else answers 401 with the spec's
//!   example body (`NotAuthorizedException`) and `WWW-Authenticate: Bearer
//!   error="invalid_token"` (RFC 6750 §3).
//!
//! Fault: the token endpoints can be taken down (503) and brought back.
//!
//! Vended credentials ([`RestCatalogDouble::start_vending`]): a `loadTable`
//! or `createTable` request with `X-Iceberg-Access-Delegation:
//! vended-credentials` (the spec's header: "vended-credentials: allows
//! the server to vend credentials for accessing table data") gets a
//! `LoadTableResult` whose `config` holds a new set of S3 keys
//! (`s3.access-key-id`, `s3.secret-access-key`, `s3.session-token`,
//! `s3.session-token-expires-at-ms`, the keys of Iceberg's `S3FileIO`),
//! each with an access key id of its own, so a store's request log tells
//! which set signed a request and whether it had expired by then.
//!
//! Invariants: every token is new (unique) and valid from its issue until
//! `lifetime` after it, unless revoked; a client is never told a token lives
//! longer than it does.

use axum::serve::ListenerExt as _;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::rejection::FormRejection;
use axum::extract::{Form, Path as UrlPath, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use iceberg::io::{FileIO, FileIOBuilder, LocalFsStorageFactory};
use iceberg::spec::{Schema, SortOrder, TableMetadata, TableMetadataBuilder, UnboundPartitionSpec};
use iceberg::{MetadataLocation, TableCreation, TableRequirement, TableUpdate};
use serde::Deserialize;
use serde_json::json;

/// What the nth `updateTable` call (counted from 1) suffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestFault {
    /// Apply the commit, then answer 504 (the outcome is unknown to the client).
    LoseReply,
    /// Answer 409 without applying, as if another writer had committed first.
    Conflict,
    /// Answer 503 without applying.
    Unavailable,
}

struct TableEntry {
    location: String,
    metadata: TableMetadata,
}

#[derive(Default)]
struct Catalog {
    namespaces: BTreeMap<Vec<String>, HashMap<String, String>>,
    tables: BTreeMap<(Vec<String>, String), TableEntry>,
    commits: u64,
    faults: Vec<(u64, RestFault)>,
    conflicts: u64,
}

/// The one OAuth2 client the double knows, and how long its tokens live.
#[derive(Debug, Clone)]
pub struct OAuthClient {
    pub client_id: String,
    pub secret: String,
    pub lifetime: Duration,
}

/// What the token service and the catalog routes saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuthStats {
    /// Tokens issued at `/v1/oauth/tokens`.
    pub issued_spec: u64,
    /// Tokens issued at `/idp/token`.
    pub issued_idp: u64,
    /// Token requests refused (bad client, grant, scope or body).
    pub token_refusals: u64,
    /// Catalog requests answered 401 (no token, an unknown or an expired one).
    pub unauthorized: u64,
    /// Catalog requests that carried a valid token.
    pub authorized: u64,
}

struct OAuth {
    client: OAuthClient,
    /// The token endpoints answer 503 (a fault).
    down: std::sync::atomic::AtomicBool,
    /// Token → when it expires.
    issued: Mutex<HashMap<String, Instant>>,
    stats: Mutex<AuthStats>,
}

impl OAuth {
    fn issued(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.issued.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, AuthStats> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// S3 credentials the double vends, as one vended set is described to the test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VendedKey {
    pub access_key_id: String,
    /// Milliseconds since the Unix epoch.
    pub expires_at_ms: u64,
}

/// Vended credentials: a new set for every load or create that asks for
/// them, each living `lifetime`, unless a [`Hold`] is set.
struct Vending {
    lifetime: Duration,
    issued: Mutex<Vec<VendedKey>>,
    hold: Mutex<Option<Hold>>,
}

/// The newest set is vended again on every load until `until` is true
/// (see [`RestCatalogDouble::hold_newest_until`]).
struct Hold {
    key: VendedKey,
    until: Box<dyn Fn() -> bool + Send + Sync>,
}

impl Vending {
    /// A new set (or the held one), as the `LoadTableResult`'s `config`.
    fn issue(&self) -> serde_json::Value {
        let mut issued = self.issued.lock().unwrap_or_else(|p| p.into_inner());
        let mut hold = self.hold.lock().unwrap_or_else(|p| p.into_inner());
        let held = match hold.as_ref() {
            // The predicate may block briefly (a test asks a loopback
            // server); a test double's worker can afford it.
            Some(h) if !(h.until)() => Some(h.key.clone()),
            _ => None,
        };
        let key = match held {
            Some(key) => key,
            None => {
                *hold = None;
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                let key = VendedKey {
                    access_key_id: format!("VENDED{:06}", issued.len() + 1),
                    expires_at_ms: (now + self.lifetime).as_millis() as u64,
                };
                issued.push(key.clone());
                key
            }
        };
        json!({
            "s3.access-key-id": key.access_key_id,
            "s3.secret-access-key": format!("secret-of-{}", key.access_key_id),
            "s3.session-token": format!("session-of-{}", key.access_key_id),
            "s3.session-token-expires-at-ms": key.expires_at_ms.to_string(),
        })
    }
}

struct Shared {
    /// Held across a commit's metadata write: check, write and swap never interleave.
    catalog: tokio::sync::Mutex<Catalog>,
    /// The URL new tables go under (`file:///…` or `s3://bucket/prefix`).
    warehouse: String,
    file_io: FileIO,
    oauth: Option<OAuth>,
    vending: Option<Vending>,
}

impl Shared {
    /// The `config` of a `LoadTableResult` for a request with `headers`:
    /// vended credentials when it asks for them (the spec's
    /// `X-Iceberg-Access-Delegation: vended-credentials`) and the double vends.
    fn table_config(&self, headers: &HeaderMap) -> serde_json::Value {
        let asked = headers
            .get("x-iceberg-access-delegation")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|m| m.trim() == "vended-credentials"));
        match &self.vending {
            Some(vending) if asked => vending.issue(),
            _ => json!({}),
        }
    }
}

impl Shared {
    async fn lock(&self) -> tokio::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().await
    }
}

/// A running REST catalog. Dropping it stops the server.
pub struct RestCatalogDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn error(status: StatusCode, kind: &str, message: impl Into<String>) -> Response {
    let body = json!({ "error": { "message": message.into(), "type": kind, "code": status.as_u16() } });
    (status, Json(body)).into_response()
}

fn namespace(ns: &str) -> Vec<String> {
    ns.split('\u{1f}').map(str::to_string).collect()
}

fn load_result(entry: &TableEntry, config: serde_json::Value) -> Response {
    Json(json!({ "metadata-location": entry.location, "metadata": entry.metadata, "config": config })).into_response()
}

#[derive(Deserialize)]
struct CreateNamespace {
    namespace: Vec<String>,
    #[serde(default)]
    properties: HashMap<String, String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "kebab-case")]
struct CreateTable {
    name: String,
    location: Option<String>,
    schema: Schema,
    partition_spec: Option<UnboundPartitionSpec>,
    write_order: Option<SortOrder>,
    #[serde(default)]
    properties: HashMap<String, String>,
}

#[derive(Deserialize)]
struct CommitTable {
    #[serde(default)]
    requirements: Vec<TableRequirement>,
    updates: Vec<TableUpdate>,
}

async fn config() -> Response {
    Json(json!({ "defaults": {}, "overrides": {} })).into_response()
}

async fn get_namespace(State(s): State<Arc<Shared>>, UrlPath(ns): UrlPath<String>) -> Response {
    let ns = namespace(&ns);
    match s.lock().await.namespaces.get(&ns) {
        Some(props) => Json(json!({ "namespace": ns, "properties": props })).into_response(),
        None => error(StatusCode::NOT_FOUND, "NoSuchNamespaceException", format!("namespace {ns:?} does not exist")),
    }
}

async fn create_namespace(State(s): State<Arc<Shared>>, Json(req): Json<CreateNamespace>) -> Response {
    let mut c = s.lock().await;
    if c.namespaces.contains_key(&req.namespace) {
        return error(StatusCode::CONFLICT, "AlreadyExistsException", "namespace already exists");
    }
    c.namespaces.insert(req.namespace.clone(), req.properties.clone());
    Json(json!({ "namespace": req.namespace, "properties": req.properties })).into_response()
}

async fn load_table(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    UrlPath((ns, table)): UrlPath<(String, String)>,
) -> Response {
    match s.lock().await.tables.get(&(namespace(&ns), table.clone())) {
        Some(entry) => load_result(entry, s.table_config(&headers)),
        None => error(StatusCode::NOT_FOUND, "NoSuchTableException", format!("table {table} does not exist")),
    }
}

async fn create_table(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    UrlPath(ns): UrlPath<String>,
    Json(req): Json<CreateTable>,
) -> Response {
    let ns = namespace(&ns);
    let key = (ns.clone(), req.name.clone());
    {
        let c = s.lock().await;
        if !c.namespaces.contains_key(&ns) {
            return error(
                StatusCode::NOT_FOUND,
                "NoSuchNamespaceException",
                format!("namespace {ns:?} does not exist"),
            );
        }
        if c.tables.contains_key(&key) {
            return error(StatusCode::CONFLICT, "AlreadyExistsException", format!("table {} already exists", req.name));
        }
    }
    let location = req
        .location
        .clone()
        .unwrap_or_else(|| format!("{}/{}/{}", s.warehouse.trim_end_matches('/'), ns.join("/"), req.name));
    let creation = TableCreation::builder()
        .name(req.name.clone())
        .location(location.clone())
        .schema(req.schema)
        .partition_spec_opt(req.partition_spec)
        .sort_order_opt(req.write_order)
        .properties(req.properties)
        .build();
    let metadata = match TableMetadataBuilder::from_table_creation(creation).and_then(|b| b.build()) {
        Ok(b) => b.metadata,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestException", e.to_string()),
    };
    let file = MetadataLocation::new_with_metadata(&location, &metadata);
    if let Err(e) = metadata.write_to(&s.file_io, &file).await {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "ServerError", e.to_string());
    }
    let entry = TableEntry { location: file.to_string(), metadata };
    let mut c = s.lock().await;
    if c.tables.contains_key(&key) {
        return error(StatusCode::CONFLICT, "AlreadyExistsException", format!("table {} already exists", req.name));
    }
    let reply = load_result(&entry, s.table_config(&headers));
    c.tables.insert(key, entry);
    reply
}

async fn commit_table(
    State(s): State<Arc<Shared>>,
    UrlPath((ns, table)): UrlPath<(String, String)>,
    Json(req): Json<CommitTable>,
) -> Response {
    let key = (namespace(&ns), table.clone());
    // One commit at a time: check, write and swap cannot interleave.
    let mut c = s.lock().await;
    c.commits += 1;
    let n = c.commits;
    let fault = c.faults.iter().find(|(k, _)| *k == n).map(|(_, f)| *f);
    if fault == Some(RestFault::Unavailable) {
        return error(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableException", "injected: not applied");
    }
    let Some(entry) = c.tables.get(&key) else {
        return error(StatusCode::NOT_FOUND, "NoSuchTableException", format!("table {table} does not exist"));
    };
    for r in &req.requirements {
        if let Err(e) = r.check(Some(&entry.metadata)) {
            c.conflicts += 1;
            return error(StatusCode::CONFLICT, "CommitFailedException", format!("requirement failed: {e}"));
        }
    }
    if fault == Some(RestFault::Conflict) {
        c.conflicts += 1;
        return error(StatusCode::CONFLICT, "CommitFailedException", "injected: another writer committed first");
    }
    let mut builder = entry.metadata.clone().into_builder(Some(entry.location.clone()));
    for u in req.updates {
        builder = match u.apply(builder) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestException", e.to_string()),
        };
    }
    let metadata = match builder.build() {
        Ok(b) => b.metadata,
        Err(e) => return error(StatusCode::BAD_REQUEST, "BadRequestException", e.to_string()),
    };
    let file = match MetadataLocation::from_str(&entry.location) {
        Ok(l) => l.with_next_version().with_new_metadata(&metadata),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, "ServerError", e.to_string()),
    };
    let written = metadata.write_to(&s.file_io, &file).await;
    if let Err(e) = written {
        return error(StatusCode::INTERNAL_SERVER_ERROR, "ServerError", e.to_string());
    }
    let entry = TableEntry { location: file.to_string(), metadata };
    // The spec's `CommitTableResponse` has no `config`.
    let reply = Json(json!({ "metadata-location": entry.location, "metadata": entry.metadata })).into_response();
    c.tables.insert(key, entry);
    if fault == Some(RestFault::LoseReply) {
        return error(StatusCode::GATEWAY_TIMEOUT, "CommitStateUnknownException", "injected: applied, reply lost");
    }
    reply
}

async fn table_exists(State(s): State<Arc<Shared>>, UrlPath((ns, table)): UrlPath<(String, String)>) -> StatusCode {
    if s.lock().await.tables.contains_key(&(namespace(&ns), table)) {
        StatusCode::NO_CONTENT
    } else {
        StatusCode::NOT_FOUND
    }
}

async fn namespace_exists(State(s): State<Arc<Shared>>, UrlPath(ns): UrlPath<String>) -> StatusCode {
    if s.lock().await.namespaces.contains_key(&namespace(&ns)) { StatusCode::NO_CONTENT } else { StatusCode::NOT_FOUND }
}

/// An `OAuthError` reply (RFC 6749 §5.2, the spec's `OAuthErrorResponse`).
fn oauth_error(oauth: &OAuth, status: StatusCode, error: &str, description: &str) -> Response {
    oauth.stats().token_refusals += 1;
    let body = json!({ "error": error, "error_description": description });
    let mut response = (status, Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic"));
    }
    response
}

/// `Authorization: Basic base64(client_id:client_secret)`, if sent.
fn basic_credentials(headers: &HeaderMap) -> Option<(String, String)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let (id, secret) = String::from_utf8(decoded).ok()?.split_once(':').map(|(a, b)| (a.to_string(), b.to_string()))?;
    Some((id, secret))
}

/// The client-credentials grant, at `/v1/oauth/tokens` (`spec`) or `/idp/token`.
fn grant(
    s: &Shared,
    spec: bool,
    headers: &HeaderMap,
    form: Result<Form<HashMap<String, String>>, FormRejection>,
) -> Response {
    let Some(oauth) = &s.oauth else {
        return error(StatusCode::NOT_FOUND, "NotFoundException", "this catalog serves no tokens");
    };
    if oauth.down.load(std::sync::atomic::Ordering::SeqCst) {
        oauth.stats().token_refusals += 1;
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableException",
            "injected: the token service is down",
        );
    }
    let form = match form {
        Ok(Form(f)) => f,
        Err(e) => return oauth_error(oauth, StatusCode::BAD_REQUEST, "invalid_request", &e.body_text()),
    };
    if form.get("grant_type").map(String::as_str) != Some("client_credentials") {
        let given = form.get("grant_type").cloned().unwrap_or_default();
        return oauth_error(
            oauth,
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            &format!("grant_type {given:?} is not client_credentials"),
        );
    }
    let in_body = form.get("client_id").zip(form.get("client_secret")).map(|(a, b)| (a.clone(), b.clone()));
    let Some((id, secret)) = basic_credentials(headers).or(in_body) else {
        return oauth_error(oauth, StatusCode::BAD_REQUEST, "invalid_request", "client_id and client_secret missing");
    };
    if id != oauth.client.client_id || secret != oauth.client.secret {
        return oauth_error(oauth, StatusCode::UNAUTHORIZED, "invalid_client", "unknown client or wrong secret");
    }
    if let Some(scope) = form.get("scope")
        && scope.split(' ').any(|s| s != "catalog")
    {
        return oauth_error(
            oauth,
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            &format!("scope {scope:?} is not catalog"),
        );
    }
    let access_token = {
        let mut issued = oauth.issued();
        let token = format!("rest-double-{}-{:x}", issued.len(), rand::random::<u64>());
        issued.insert(token.clone(), Instant::now() + oauth.client.lifetime);
        token
    };
    {
        let mut stats = oauth.stats();
        if spec {
            stats.issued_spec += 1;
        } else {
            stats.issued_idp += 1;
        }
    }
    Json(json!({
        "access_token": access_token,
        "token_type": "bearer",
        "expires_in": oauth.client.lifetime.as_secs(),
        "issued_token_type": "urn:ietf:params:oauth:token-type:access_token",
    }))
    .into_response()
}

async fn spec_token(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    form: Result<Form<HashMap<String, String>>, FormRejection>,
) -> Response {
    grant(&s, true, &headers, form)
}

async fn idp_token(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    form: Result<Form<HashMap<String, String>>, FormRejection>,
) -> Response {
    grant(&s, false, &headers, form)
}

/// Every catalog route: a token issued here and not expired, else 401.
async fn require_token(State(s): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let Some(oauth) = &s.oauth else { return next.run(request).await };
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim().to_string());
    let valid = token.as_ref().and_then(|t| oauth.issued().get(t).copied()).is_some_and(|exp| Instant::now() < exp);
    if !valid {
        oauth.stats().unauthorized += 1;
        let message = match &token {
            None => "Not authorized to make this request: no bearer token",
            Some(_) => "Not authorized to make this request: the token is unknown or expired",
        };
        let mut response = error(StatusCode::UNAUTHORIZED, "NotAuthorizedException", message);
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer error=\"invalid_token\""));
        return response;
    }
    oauth.stats().authorized += 1;
    next.run(request).await
}

/// A local warehouse and its `FileIO`.
fn local(warehouse: &Path) -> (String, FileIO) {
    (format!("file://{}", warehouse.display()), FileIOBuilder::new(Arc::new(LocalFsStorageFactory)).build())
}

impl RestCatalogDouble {
    /// Starts on 127.0.0.1 (a port the OS picks); tables go under `warehouse`.
    /// Every route is open.
    pub fn start(warehouse: &Path) -> std::io::Result<Self> {
        Self::start_inner(local(warehouse), None, None)
    }

    /// Starts with its warehouse at `warehouse` (`s3://bucket/prefix`),
    /// written through `file_io`; every table it loads or creates for a
    /// request that asks for vended credentials comes with a new set of S3
    /// keys living `lifetime` (see [`RestCatalogDouble::vended`]).
    pub fn start_vending(warehouse: &str, file_io: FileIO, lifetime: Duration) -> std::io::Result<Self> {
        let vending = Vending { lifetime, issued: Mutex::default(), hold: Mutex::default() };
        Self::start_inner((warehouse.to_string(), file_io), None, Some(vending))
    }

    /// Starts with its warehouse at `warehouse` (an object-store URL),
    /// written through `file_io`; it vends no credentials. Every route is open.
    pub fn start_on(warehouse: &str, file_io: FileIO) -> std::io::Result<Self> {
        Self::start_inner((warehouse.to_string(), file_io), None, None)
    }

    /// From now on every load vends the newest set again, until `until`
    /// answers true (asked at each load); then new sets as before. Returns
    /// the held set, or `None` when none was vended yet (nothing is held).
    /// A test revoking the held set so knows the host must use it, be
    /// refused, and load the table again.
    pub fn hold_newest_until(&self, until: impl Fn() -> bool + Send + Sync + 'static) -> Option<VendedKey> {
        let vending = self.shared.vending.as_ref()?;
        let issued = vending.issued.lock().unwrap_or_else(|p| p.into_inner());
        let key = issued.last()?.clone();
        *vending.hold.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Hold { key: key.clone(), until: Box::new(until) });
        Some(key)
    }

    /// Every set of credentials vended so far, oldest first.
    pub fn vended(&self) -> Vec<VendedKey> {
        self.shared
            .vending
            .as_ref()
            .map(|v| v.issued.lock().unwrap_or_else(|p| p.into_inner()).clone())
            .unwrap_or_default()
    }

    /// Starts as [`RestCatalogDouble::start`], as its own OAuth2 token
    /// service for `client`: every catalog route requires a current token.
    pub fn start_with_oauth(warehouse: &Path, client: OAuthClient) -> std::io::Result<Self> {
        Self::start_inner(local(warehouse), Some(client), None)
    }

    fn start_inner(
        (warehouse, file_io): (String, FileIO),
        client: Option<OAuthClient>,
        vending: Option<Vending>,
    ) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            catalog: tokio::sync::Mutex::new(Catalog::default()),
            warehouse,
            file_io,
            vending,
            oauth: client.map(|client| OAuth {
                client,
                down: Default::default(),
                issued: Mutex::default(),
                stats: Mutex::default(),
            }),
        });
        let app = axum::Router::new()
            .route("/v1/config", get(config))
            .route("/v1/namespaces", post(create_namespace))
            .route("/v1/namespaces/{ns}", get(get_namespace).head(namespace_exists))
            .route("/v1/namespaces/{ns}/tables", post(create_table))
            .route("/v1/namespaces/{ns}/tables/{table}", get(load_table).head(table_exists).post(commit_table))
            // Only the routes above: the token endpoints take no bearer token.
            .route_layer(axum::middleware::from_fn_with_state(shared.clone(), require_token))
            .route("/v1/oauth/tokens", post(spec_token))
            .route("/idp/token", post(idp_token))
            .with_state(shared.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                // Replies leave at once (no Nagle delay), as from a real service.
                let listener = listener.tap_io(|tcp| {
                    let _ = tcp.set_nodelay(true);
                });
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Ok(Self { shared, addr, shutdown: Some(tx), thread: Some(thread) })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Aims `fault` at the nth `updateTable` call (counted from 1).
    pub fn inject(&self, nth: u64, fault: RestFault) {
        self.shared.catalog.blocking_lock().faults.push((nth, fault));
    }

    /// What the token service and the catalog routes saw (all zero without OAuth2).
    pub fn auth_stats(&self) -> AuthStats {
        self.shared.oauth.as_ref().map(|o| *o.stats()).unwrap_or_default()
    }

    /// Takes the token endpoints down (503) or brings them back; tokens
    /// already issued stay valid until they expire.
    pub fn tokens_down(&self, down: bool) {
        if let Some(oauth) = &self.shared.oauth {
            oauth.down.store(down, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Revokes every token issued so far (as when a client's secret is
    /// rotated): the catalog refuses them from now on.
    pub fn revoke_all(&self) {
        if let Some(oauth) = &self.shared.oauth {
            let now = Instant::now();
            for expires in oauth.issued().values_mut() {
                *expires = (*expires).min(now);
            }
        }
    }

    /// `updateTable` calls so far, and how many were refused as conflicts.
    pub fn commits(&self) -> (u64, u64) {
        let c = self.shared.catalog.blocking_lock();
        (c.commits, c.conflicts)
    }
}

impl Drop for RestCatalogDouble {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
