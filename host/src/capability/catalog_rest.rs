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
//! - anything else → `other`.

use std::time::Duration;

use iceberg::{TableIdent, TableRequirement, TableUpdate};
use reqwest::{StatusCode, Url};
use serde::Deserialize;

use crate::bindings::v0_2::sluice::connector::iceberg_catalog::{CatalogError, LoadedTable};

/// Posts commits to one REST catalog.
pub(crate) struct RestCommitter {
    http: reqwest::Client,
    /// `{uri}/v1[/{prefix}]`.
    base: Url,
    token: Option<String>,
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
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// The `message` of a REST error body (`{"error": {"message": ...}}`), or the body.
fn error_message(body: &[u8]) -> String {
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
    /// proves the catalog is reachable.
    pub(crate) async fn connect(uri: &str, warehouse: &str, token: Option<String>) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
        let root = Url::parse(uri.trim_end_matches('/')).map_err(|e| format!("not a URL: {e}"))?;
        let mut config_url = root.clone();
        config_url.path_segments_mut().map_err(|()| "not a base URL".to_string())?.extend(["v1", "config"]);
        config_url.query_pairs_mut().append_pair("warehouse", warehouse);
        let mut req = http.get(config_url.clone());
        if let Some(t) = &token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| format!("GET {config_url}: {}", chain(&e)))?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| format!("GET {config_url}: {e}"))?;
        if status != StatusCode::OK {
            return Err(format!("GET {config_url}: {status}: {}", error_message(&body)));
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
        Ok(Self { http, base, token })
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
        let body =
            serde_json::to_vec(&body).map_err(|e| CatalogError::Other(format!("cannot encode the commit: {e}")))?;
        let mut req = self.http.post(url.clone()).header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => return Err(CatalogError::UnknownOutcome(format!("POST {url}: {}", chain(&e)))),
        };
        let status = resp.status();
        let body = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return Err(CatalogError::UnknownOutcome(format!("POST {url}: {status}, reply lost: {e}"))),
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
