//! Commits to an Iceberg REST catalog: the spec's `updateTable` call
//! (`POST /v1/{prefix}/namespaces/{namespace}/tables/{table}`), made by the
//! host because iceberg-rust's `RestCatalog::update_table` takes a
//! `TableCommit` only the `iceberg` crate can build (see `catalog`).
//!
//! Status codes as the REST catalog spec (`rest-catalog-open-api.yaml`,
//! `updateTable`) defines them:
//! - 200: committed; the reply holds the new metadata;
//! - 409 `CommitFailedException`: a requirement failed, nothing was applied
//!   → `conflict`;
//! - 404 `NoSuchTableException` → `not-found`;
//! - 500, 502, 504 `CommitStateUnknownException` ("the commit may or may
//!   not have succeeded"), and 503 (which Iceberg's Java client treats the
//!   same way) → `unknown-outcome`; so does a request that failed in
//!   transport, since it may have reached the server;
//! - 401 `UnauthorizedResponse` or 419 `AuthenticationTimeoutResponse`:
//!   the request was not authenticated, so not applied; it is sent once
//!   more with a new token ([`CatalogAuth::refused`]), and a second refusal
//!   is `other`;
//! - anything else → `other`.
//!
//! Every request here, and every one iceberg-rust's `RestCatalog` sends for
//! the host ([`RestLoads`]), carries a current token from the one
//! [`CatalogAuth`] of the catalog.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use iceberg::io::StorageFactory;
use iceberg::table::Table;
use iceberg::{
    Catalog, CatalogBuilder, Namespace, NamespaceIdent, TableCommit as IcebergTableCommit, TableCreation, TableIdent,
    TableRequirement, TableUpdate,
};
use iceberg_catalog_rest::{RestCatalog, RestCatalogBuilder};
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use super::catalog_auth::{Bearer, CatalogAuth, CatalogAuthError};
use super::catalog_vended::Vended;
use crate::bindings::v0_2::sluice::connector::iceberg_catalog::{CatalogError, LoadedTable};

/// Posts commits to one REST catalog.
pub(crate) struct RestCommitter {
    http: reqwest::Client,
    /// `{uri}/v1[/{prefix}]`.
    base: Url,
    auth: Arc<CatalogAuth>,
}

/// Why an authenticated request got no answer.
enum SendError {
    /// No token: nothing was sent.
    Token(CatalogAuthError),
    /// It failed in transport, so it may have reached the server.
    Transport(String),
}

/// Whether `status` says the request was not authenticated (and so not
/// processed): 401, or the spec's 419 "credentials have timed out".
fn unauthenticated(status: StatusCode) -> bool {
    status == StatusCode::UNAUTHORIZED || status.as_u16() == 419
}

/// Sends what `build` makes with a current token; refused as
/// unauthenticated, once more with a new one. The status and body of the
/// last answer.
/// `what` names the request in errors (`POST <url>`).
async fn send_authed(
    auth: &CatalogAuth,
    what: &str,
    build: impl Fn() -> reqwest::RequestBuilder,
) -> Result<(StatusCode, Bytes), SendError> {
    let mut bearer = auth.bearer().await.map_err(SendError::Token)?;
    let mut retried = false;
    loop {
        let mut req = build();
        if let Some(t) = bearer.token() {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| SendError::Transport(format!("{what}: {}", chain(&e))))?;
        let status = resp.status();
        let body = resp
            .bytes()
            .await
            .map_err(|e| SendError::Transport(format!("{what}: {status}, reply lost: {}", chain(&e))))?;
        if unauthenticated(status) && !retried {
            // Not authenticated, so not processed: safe to send again.
            match auth.refused(&bearer).await.map_err(SendError::Token)? {
                Some(next) => {
                    bearer = next;
                    retried = true;
                    continue;
                }
                None => return Ok((status, body)),
            }
        }
        return Ok((status, body));
    }
}

#[derive(Deserialize, Default)]
struct ConfigResponse {
    #[serde(default)]
    defaults: std::collections::HashMap<String, String>,
    #[serde(default)]
    overrides: std::collections::HashMap<String, String>,
}

#[derive(Deserialize)]
struct CommitResponse {
    #[serde(rename = "metadata-location")]
    metadata_location: String,
    metadata: serde_json::Value,
}

/// An error with its causes (reqwest's own message omits them: "error sending request").
pub(super) use sluice_core::chain;

/// The `message` of a REST error body (`{"error": {"message": ...}}`), or the body.
pub(super) fn error_message(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct ErrorBody {
        error: ErrorModel,
    }
    #[derive(Deserialize)]
    struct ErrorModel {
        message: String,
        #[serde(rename = "type", default)]
        kind: String,
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) if e.error.kind.is_empty() => e.error.message,
        Ok(e) => format!("{}: {}", e.error.kind, e.error.message),
        Err(_) => String::from_utf8_lossy(body).chars().take(300).collect(),
    }
}

impl RestCommitter {
    /// Reads the catalog's `/v1/config` (for its path prefix), which also
    /// proves the catalog is reachable and takes the token.
    pub(crate) async fn connect(uri: &str, warehouse: &str, auth: Arc<CatalogAuth>) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
        let root = Url::parse(uri.trim_end_matches('/')).map_err(|e| format!("not a URL: {e}"))?;
        let mut config_url = root.clone();
        config_url.path_segments_mut().map_err(|()| "not a base URL".to_string())?.extend(["v1", "config"]);
        config_url.query_pairs_mut().append_pair("warehouse", warehouse);
        let what = format!("GET {config_url}");
        let (status, body) = match send_authed(&auth, &what, || http.get(config_url.clone())).await {
            Ok(reply) => reply,
            Err(SendError::Token(e)) => return Err(e.to_string()),
            Err(SendError::Transport(e)) => return Err(e),
        };
        if status != StatusCode::OK {
            let hint = if unauthenticated(status) {
                "; the catalog refused the credentials (sink.catalog.token_env, credential_env or credential_file)"
            } else {
                ""
            };
            return Err(format!("GET {config_url}: {status}: {}{hint}", error_message(&body)));
        }
        let config: ConfigResponse =
            serde_json::from_slice(&body).map_err(|e| format!("GET {config_url}: not a catalog config: {e}"))?;
        let mut base = root;
        {
            let mut segments = base.path_segments_mut().map_err(|()| "not a base URL".to_string())?;
            segments.push("v1");
            if let Some(prefix) = config.overrides.get("prefix").or(config.defaults.get("prefix")) {
                segments.extend(prefix.split('/').filter(|s| !s.is_empty()));
            }
        }
        Ok(Self { http, base, auth })
    }

    /// The spec's `updateTable` call.
    pub(crate) async fn post(
        &self,
        ident: &TableIdent,
        requirements: &[TableRequirement],
        updates: &[TableUpdate],
    ) -> Result<LoadedTable, CatalogError> {
        let mut url = self.base.clone();
        // Namespace levels are joined by the unit separator (0x1F), then the segment is percent-encoded.
        let levels: Vec<String> = ident.namespace().clone().inner();
        let namespace = levels.join("\u{1f}");
        url.path_segments_mut()
            .map_err(|()| CatalogError::Other("the catalog URL cannot take a path".into()))?
            .extend(["namespaces", namespace.as_str(), "tables", ident.name()]);
        let body = serde_json::json!({
            "identifier": { "namespace": levels, "name": ident.name() },
            "requirements": requirements,
            "updates": updates,
        });
        let body: Bytes = serde_json::to_vec(&body)
            .map_err(|e| CatalogError::Other(format!("cannot encode the commit: {e}")))?
            .into();
        let build =
            || self.http.post(url.clone()).header(reqwest::header::CONTENT_TYPE, "application/json").body(body.clone());
        let what = format!("POST {url}");
        let (status, body) = match send_authed(&self.auth, &what, build).await {
            Ok(reply) => reply,
            // Nothing was sent.
            Err(SendError::Token(e)) => return Err(CatalogError::Other(format!("{what}: not sent: {e}"))),
            Err(SendError::Transport(e)) => return Err(CatalogError::UnknownOutcome(e)),
        };
        match status {
            StatusCode::OK => {
                let reply: CommitResponse = serde_json::from_slice(&body).map_err(|e| {
                    CatalogError::UnknownOutcome(format!(
                        "POST {url}: the catalog's reply is not a commit response: {e}"
                    ))
                })?;
                Ok(LoadedTable {
                    metadata_location: reply.metadata_location,
                    metadata_json: reply.metadata.to_string(),
                })
            }
            StatusCode::CONFLICT => Err(CatalogError::Conflict(error_message(&body))),
            StatusCode::NOT_FOUND => Err(CatalogError::NotFound(error_message(&body))),
            StatusCode::INTERNAL_SERVER_ERROR
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT => {
                Err(CatalogError::UnknownOutcome(format!("{status}: {}", error_message(&body))))
            }
            _ => Err(CatalogError::Other(format!("POST {url}: {status}: {}", error_message(&body)))),
        }
    }
}

/// iceberg-rust's `RestCatalog` (loads, creates, existence checks), always
/// with a current token. Its `token` property is fixed once it is built, so
/// there is one `RestCatalog` per token, built when the token is new
/// (cheaply: it reads `/v1/config` on its first call). A call refused as
/// unauthenticated is made once more with a new token: a 401 or 419 means
/// the catalog did not process it.
pub(crate) struct RestLoads {
    name: String,
    /// `uri` and `warehouse`; never the token.
    props: HashMap<String, String>,
    storage: Arc<dyn StorageFactory>,
    runtime: iceberg::Runtime,
    auth: Arc<CatalogAuth>,
    /// The catalog built for the token of that generation.
    current: Mutex<Option<(u64, Arc<RestCatalog>)>>,
    /// Where the storage credentials tables come with are kept.
    vended: Option<Arc<Vended>>,
}

impl std::fmt::Debug for RestLoads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `RestCatalog`'s own Debug prints its properties, the token among them.
        f.debug_struct("RestLoads").field("name", &self.name).field("auth", &self.auth).finish_non_exhaustive()
    }
}

/// Whether iceberg-rust's `RestCatalog` failed on an unauthenticated answer.
/// It reports statuses it has no case for as `Unexpected` with the context
/// `status: 401 Unauthorized` (`deserialize_unexpected_catalog_error`,
/// iceberg-catalog-rest 0.10.1), which is all that tells them apart.
fn refused(e: &iceberg::Error) -> bool {
    if e.kind() != iceberg::ErrorKind::Unexpected {
        return false;
    }
    let text = e.to_string();
    text.contains("status: 401 Unauthorized") || text.contains("status: 419 ")
}

fn auth_error(e: CatalogAuthError) -> iceberg::Error {
    iceberg::Error::new(iceberg::ErrorKind::Unexpected, e.to_string())
}

impl RestLoads {
    pub(crate) fn new(
        name: &str,
        props: HashMap<String, String>,
        storage: Arc<dyn StorageFactory>,
        runtime: iceberg::Runtime,
        auth: Arc<CatalogAuth>,
        vended: Option<Arc<Vended>>,
    ) -> Self {
        Self { name: name.to_string(), props, storage, runtime, auth, current: Mutex::new(None), vended }
    }

    /// Keeps the storage credentials `table` came with.
    fn record(&self, table: iceberg::Result<Table>) -> iceberg::Result<Table> {
        if let (Ok(table), Some(vended)) = (&table, &self.vended) {
            vended.record(table);
        }
        table
    }

    /// The catalog for `bearer`'s token, built if it is new.
    async fn catalog(&self, bearer: &Bearer) -> iceberg::Result<Arc<RestCatalog>> {
        {
            let current = self.current.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((generation, catalog)) = &*current
                && *generation == bearer.generation()
            {
                return Ok(catalog.clone());
            }
        }
        let mut props = self.props.clone();
        if let Some(t) = bearer.token() {
            props.insert("token".to_string(), t.to_string());
        }
        let catalog = Arc::new(
            RestCatalogBuilder::default()
                .with_storage_factory(self.storage.clone())
                .with_runtime(self.runtime.clone())
                .load(&self.name, props)
                .await?,
        );
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        // A newer token's catalog stays.
        if current.as_ref().is_none_or(|(generation, _)| *generation <= bearer.generation()) {
            *current = Some((bearer.generation(), catalog.clone()));
        }
        Ok(catalog)
    }

    /// `call` with a current token; refused as unauthenticated, once more
    /// with a new one.
    async fn call<T, F, Fut>(&self, call: F) -> iceberg::Result<T>
    where
        F: Fn(Arc<RestCatalog>) -> Fut,
        Fut: Future<Output = iceberg::Result<T>>,
    {
        let bearer = self.auth.bearer().await.map_err(auth_error)?;
        match call(self.catalog(&bearer).await?).await {
            Err(e) if refused(&e) => match self.auth.refused(&bearer).await.map_err(auth_error)? {
                Some(next) => call(self.catalog(&next).await?).await,
                None => Err(e),
            },
            other => other,
        }
    }
}

/// A copy of `c` (`TableCreation` is not `Clone`), for a retried create.
fn copy_creation(c: &TableCreation) -> TableCreation {
    TableCreation {
        name: c.name.clone(),
        location: c.location.clone(),
        schema: c.schema.clone(),
        partition_spec: c.partition_spec.clone(),
        sort_order: c.sort_order.clone(),
        properties: c.properties.clone(),
        format_version: c.format_version,
    }
}

#[async_trait::async_trait]
impl Catalog for RestLoads {
    async fn list_namespaces(&self, parent: Option<&NamespaceIdent>) -> iceberg::Result<Vec<NamespaceIdent>> {
        self.call(|c| async move { c.list_namespaces(parent).await }).await
    }

    async fn create_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> iceberg::Result<Namespace> {
        self.call(|c| {
            let properties = properties.clone();
            async move { c.create_namespace(namespace, properties).await }
        })
        .await
    }

    async fn get_namespace(&self, namespace: &NamespaceIdent) -> iceberg::Result<Namespace> {
        self.call(|c| async move { c.get_namespace(namespace).await }).await
    }

    async fn namespace_exists(&self, namespace: &NamespaceIdent) -> iceberg::Result<bool> {
        self.call(|c| async move { c.namespace_exists(namespace).await }).await
    }

    async fn update_namespace(
        &self,
        namespace: &NamespaceIdent,
        properties: HashMap<String, String>,
    ) -> iceberg::Result<()> {
        self.call(|c| {
            let properties = properties.clone();
            async move { c.update_namespace(namespace, properties).await }
        })
        .await
    }

    async fn drop_namespace(&self, namespace: &NamespaceIdent) -> iceberg::Result<()> {
        self.call(|c| async move { c.drop_namespace(namespace).await }).await
    }

    async fn list_tables(&self, namespace: &NamespaceIdent) -> iceberg::Result<Vec<TableIdent>> {
        self.call(|c| async move { c.list_tables(namespace).await }).await
    }

    async fn create_table(&self, namespace: &NamespaceIdent, creation: TableCreation) -> iceberg::Result<Table> {
        let creation = &creation;
        self.record(self.call(|c| async move { c.create_table(namespace, copy_creation(creation)).await }).await)
    }

    async fn load_table(&self, table: &TableIdent) -> iceberg::Result<Table> {
        self.record(self.call(|c| async move { c.load_table(table).await }).await)
    }

    async fn drop_table(&self, table: &TableIdent) -> iceberg::Result<()> {
        self.call(|c| async move { c.drop_table(table).await }).await
    }

    async fn purge_table(&self, table: &TableIdent) -> iceberg::Result<()> {
        self.call(|c| async move { c.purge_table(table).await }).await
    }

    async fn table_exists(&self, table: &TableIdent) -> iceberg::Result<bool> {
        self.call(|c| async move { c.table_exists(table).await }).await
    }

    async fn rename_table(&self, src: &TableIdent, dest: &TableIdent) -> iceberg::Result<()> {
        self.call(|c| async move { c.rename_table(src, dest).await }).await
    }

    async fn register_table(&self, table: &TableIdent, metadata_location: String) -> iceberg::Result<Table> {
        let metadata_location = &metadata_location;
        self.record(self.call(|c| async move { c.register_table(table, metadata_location.clone()).await }).await)
    }

    /// Not retried: a `TableCommit` cannot be copied. The host commits with
    /// [`RestCommitter`], never through here.
    async fn update_table(&self, commit: IcebergTableCommit) -> iceberg::Result<Table> {
        let bearer = self.auth.bearer().await.map_err(auth_error)?;
        self.catalog(&bearer).await?.update_table(commit).await
    }
}
