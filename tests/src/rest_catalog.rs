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

use axum::serve::ListenerExt as _;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
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

struct Shared {
    /// Held across a commit's metadata write: check, write and swap never interleave.
    catalog: tokio::sync::Mutex<Catalog>,
    warehouse: PathBuf,
    file_io: FileIO,
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

fn load_result(entry: &TableEntry) -> Response {
    Json(json!({ "metadata-location": entry.location, "metadata": entry.metadata, "config": {} })).into_response()
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

async fn load_table(State(s): State<Arc<Shared>>, UrlPath((ns, table)): UrlPath<(String, String)>) -> Response {
    match s.lock().await.tables.get(&(namespace(&ns), table.clone())) {
        Some(entry) => load_result(entry),
        None => error(StatusCode::NOT_FOUND, "NoSuchTableException", format!("table {table} does not exist")),
    }
}

async fn create_table(
    State(s): State<Arc<Shared>>,
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
        .unwrap_or_else(|| format!("file://{}", s.warehouse.join(ns.join("/")).join(&req.name).display()));
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
    let reply = load_result(&entry);
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
    let reply = load_result(&entry);
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

impl RestCatalogDouble {
    /// Starts on 127.0.0.1 (a port the OS picks); tables go under `warehouse`.
    pub fn start(warehouse: &Path) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            catalog: tokio::sync::Mutex::new(Catalog::default()),
            warehouse: warehouse.to_path_buf(),
            file_io: FileIOBuilder::new(Arc::new(LocalFsStorageFactory)).build(),
        });
        let app = axum::Router::new()
            .route("/v1/config", get(config))
            .route("/v1/namespaces", axum::routing::post(create_namespace))
            .route("/v1/namespaces/{ns}", get(get_namespace).head(namespace_exists))
            .route("/v1/namespaces/{ns}/tables", axum::routing::post(create_table))
            .route("/v1/namespaces/{ns}/tables/{table}", get(load_table).head(table_exists).post(commit_table))
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
