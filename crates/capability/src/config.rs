//! The capabilities' configuration, resolved: what the job file's
//! `[sink.catalog]`, `[sink.grpc.<name>]`, `[sink.http.<name>]` and
//! `[sink.grants]` turn into once read and checked (secrets read, paths
//! made absolute, locations parsed). The job file's own types and their
//! checks live with the job loader; each capability opens its grant from
//! these.
//!
//! Invariant: a [`Secret`] never shows its value in `Debug` output.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use sluice_core::location::Location;
use sluice_store::StoreOptions;

/// A credential read from the environment or a file. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A credential given by a caller (tools and tests); jobs read theirs.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(...)")
    }
}

/// The sink's catalog, resolved from `[sink.catalog]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogConfig {
    /// iceberg-rust's `SqlCatalog` on the local SQLite file `database`; its
    /// warehouse is local or on an object store.
    Sql { name: String, database: PathBuf, warehouse: Location },
    /// An Iceberg REST catalog at `uri`; its warehouse is local or on S3
    /// (whose credentials the catalog may vend with each table).
    Rest { name: String, uri: String, warehouse: Location, auth: Option<RestAuth> },
}

/// How the host authenticates to a REST catalog.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestAuth {
    /// A static bearer token (`token_env`).
    Token(Secret),
    /// OAuth2 client credentials (`credential_env` / `credential_file`).
    OAuth2(OAuth2Config),
}

/// The OAuth2 client-credentials grant of a REST catalog, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OAuth2Config {
    /// `client_id:secret`, or a bare secret.
    pub credential: Secret,
    /// Where the credential was read, for messages: `the environment
    /// variable X (sink.catalog.credential_env)`.
    pub credential_source: String,
    /// The token endpoint.
    pub server_uri: String,
    pub scope: String,
}

/// The scope asked for when the job names none: the REST spec's only one
/// (`catalog`), and what the Java, Python and Rust clients send.
pub const DEFAULT_OAUTH2_SCOPE: &str = "catalog";

impl CatalogConfig {
    /// The warehouse, granted to the plugin read-write.
    pub fn warehouse(&self) -> Location {
        match self {
            CatalogConfig::Sql { warehouse, .. } | CatalogConfig::Rest { warehouse, .. } => warehouse.clone(),
        }
    }
}

/// A gRPC endpoint, resolved from `[sink.grpc.<name>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointConfig {
    /// An `http://` or `https://` URI.
    pub address: String,
    pub tls: bool,
    /// Sent as `authorization: Bearer <token>`.
    pub token: Option<Secret>,
    /// Google's Application Default Credentials instead of a static token
    /// (`auth = "google"`; never with `token`).
    pub google_auth: bool,
    pub connect_timeout: Duration,
}

/// What a run grants its plugin, resolved from the job file's
/// `[sink.grants]`, `[sink.catalog]`, `[sink.grpc]`, `[sink.http]` and
/// `[sink.s3]`/`[sink.gcs]`.
#[derive(Debug, Clone)]
pub struct GrantsConfig {
    /// The job file's directory: the base of relative locations.
    pub base_dir: PathBuf,
    /// Locations the plugin may read and write (`sink.grants.locations`).
    pub locations: Vec<String>,
    /// Locations the plugin may only read (`sink.grants.read_locations`).
    pub read_locations: Vec<String>,
    /// The catalog, if the job configures one.
    pub catalog: Option<CatalogConfig>,
    /// How the grants' object stores are reached.
    pub stores: StoreOptions,
    /// The gRPC endpoints, by name.
    pub endpoints: BTreeMap<String, EndpointConfig>,
    /// The HTTP endpoints, by name.
    pub http_endpoints: BTreeMap<String, EndpointConfig>,
}
