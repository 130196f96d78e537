//! The `iceberg-catalog` capability: the one catalog the job file configures
//! for the sink (`[sink.catalog]`), served with iceberg-rust's `SqlCatalog`
//! (the embedded default) or `RestCatalog` (`kind = "rest"`), whose token
//! (static, or OAuth2 client credentials refreshed ahead of expiry) is the
//! host's, see `catalog_auth`.
//!
//! Invariants:
//! - a plugin reaches only this catalog; its address and credentials never
//!   cross into the guest;
//! - `commit-table` applies the plugin's REST-spec requirements and updates
//!   atomically or not at all: requirements are checked on the table as the
//!   catalog holds it, the new metadata file is written under a fresh name,
//!   and the catalog pointer moves with one compare-and-swap on the previous
//!   metadata location. It is never rebased and never retried here;
//! - errors tell the plugin what is safe: `conflict` means definitely not
//!   applied, `unknown-outcome` means it may have been applied;
//! - no catalog call outlasts the plugin call's deadline: past it the call
//!   is cancelled and the plugin traps (a commit cancelled so may have been
//!   applied; recovery finds out, as after any crash).
//!
//! Why the commit is not `SqlCatalog::update_table`: that takes iceberg's
//! `TableCommit`, whose constructor is private to the `iceberg` crate (only
//! its `Transaction` builds one). The plugin builds its commit with that
//! `Transaction` and sends the result as REST-spec JSON; here the host
//! applies it with iceberg's public `TableRequirement::check`,
//! `TableUpdate::apply` and `TableMetadata::write_to`, and performs the same
//! compare-and-swap `SqlCatalog::update_table` does, on the same table of the
//! same database (schema shared with PyIceberg's `SqlCatalog`). For the same
//! reason a REST commit is the spec's `updateTable` call made here
//! ([`RestCommitter`]), which is what `RestCatalog::update_table` sends.
//!
//! A SQLite catalog's warehouse is a local directory or an object-store
//! location (`s3://bucket/prefix`, `gs://bucket/prefix`). On a store, the
//! catalog's metadata files go through [`WarehouseStorage`]
//! (`sluice-store`, reached as `file-io` reaches it), and the plugin writes
//! the data files through `file-io`, whose grant is the same warehouse; the
//! SQLite database itself stays on local disk.
//!
//! A REST catalog's warehouse is a local directory or an `s3://` location;
//! on S3 the host asks for vended credentials with each table and signs the
//! requests for that table's files with them, the plugin's `file-io` calls
//! included (`catalog_vended`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use iceberg::io::{LocalFsStorageFactory, StorageFactory};
use iceberg::spec::{Schema, TableMetadata, UnboundPartitionSpec};
use iceberg::table::Table;
use iceberg::{
    Catalog, CatalogBuilder, ErrorKind, MetadataLocation, NamespaceIdent, TableCreation, TableIdent, TableRequirement,
    TableUpdate,
};
use iceberg_catalog_rest::{REST_CATALOG_PROP_URI, REST_CATALOG_PROP_WAREHOUSE};
use iceberg_catalog_sql::{SqlBindStyle, SqlCatalogBuilder};
use serde::Deserialize;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use thiserror::Error;

use wasmtime::component::{HasData, Linker};

use super::catalog_auth::{CatalogAuth, CatalogAuthError};
use super::catalog_rest::{RestCommitter, RestLoads};
use super::catalog_storage::{WarehouseStorage, WarehouseStorageFactory};
use super::catalog_vended::{ACCESS_DELEGATION_HEADER, VENDED_CREDENTIALS, Vended};
use super::file_io::StoreConfig;
use super::limits::HostDeadline;
use super::syncs::Syncs;
use super::{CapabilityHost, Effects};
use crate::bindings::v0_2::sluice::connector::iceberg_catalog::{self as wit, CatalogError, LoadedTable};
use crate::config::{CatalogConfig, RestAuth};
use crate::location::Location;

/// A catalog that cannot be set up (named in the job's `[sink.catalog]`).
#[derive(Debug, Error)]
pub enum CatalogSetupError {
    #[error("cannot create {path}: {source}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot open the catalog {uri}: {message}")]
    Open { uri: String, message: String },
    #[error("{0}")]
    Auth(#[from] CatalogAuthError),
    /// An object-store warehouse that cannot be set up or reached.
    #[error("sink.catalog.warehouse = {warehouse:?}: {message}")]
    Warehouse { warehouse: String, message: String },
}

/// What the catalog saw, for reports and benchmarks.
#[derive(Debug, Default)]
pub struct CatalogStats {
    pub commit_calls: AtomicU64,
    pub conflicts: AtomicU64,
    /// Commits answered `unknown-outcome` (they may have been applied).
    pub unknown_outcomes: AtomicU64,
}

/// Why a commit did not happen, as a backend reports it.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// The catalog's answer, for the plugin.
    Catalog(CatalogError),
    /// The plugin call's deadline passed during the commit.
    Deadline(HostDeadline),
    /// A test asked the engine to die right after the commit was applied
    /// (never without the `fault-injection` feature).
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    InjectedCrash(crate::fault::Injected),
}

const LOAD: &str = "sluice:connector/iceberg-catalog.load-table";
const CREATE: &str = "sluice:connector/iceberg-catalog.create-table";
const COMMIT: &str = "sluice:connector/iceberg-catalog.commit-table";

impl From<CatalogError> for CommitError {
    fn from(e: CatalogError) -> Self {
        CommitError::Catalog(e)
    }
}

/// What one commit asks of a table: every requirement holding, every update.
pub(crate) struct TableCommit {
    pub requirements: Vec<TableRequirement>,
    pub updates: Vec<TableUpdate>,
}

/// Where commits go. A commit applies every update with every requirement
/// holding, or nothing; it is never rebased or retried here.
pub(crate) trait CommitBackend: Send + Sync {
    fn commit(&self, ident: &TableIdent, commit: TableCommit) -> Result<LoadedTable, CommitError>;
}

/// Commits to `SqlCatalog`'s own table with a compare-and-swap on the
/// previous metadata location, as `SqlCatalog::update_table` does.
struct SqlCommits {
    catalog_name: String,
    /// Loads the table the commit applies to.
    catalog: Arc<dyn Catalog>,
    pool: SqlitePool,
    /// Serialises this process's compare-and-swaps, so SQLite's writer lock
    /// is taken by one of them at a time (other processes wait on it).
    cas: tokio::sync::Mutex<()>,
}

impl CommitBackend for SqlCommits {
    fn commit(&self, ident: &TableIdent, commit: TableCommit) -> Result<LoadedTable, CommitError> {
        let TableCommit { requirements, updates } = commit;
        super::block_on(COMMIT, self.commit_async(ident, requirements, updates))
            .map_err(CommitError::Deadline)?
            .map_err(CommitError::Catalog)
    }
}

impl SqlCommits {
    async fn commit_async(
        &self,
        ident: &TableIdent,
        requirements: Vec<TableRequirement>,
        updates: Vec<TableUpdate>,
    ) -> Result<LoadedTable, CatalogError> {
        let table = self.catalog.load_table(ident).await.map_err(load_error)?;
        let current = table.metadata_location_result().map_err(other)?.to_string();
        for requirement in &requirements {
            requirement.check(Some(table.metadata())).map_err(|e| CatalogError::Conflict(e.to_string()))?;
        }
        let mut builder = table.metadata().clone().into_builder(Some(current.clone()));
        for update in updates {
            builder =
                update.apply(builder).map_err(|e| CatalogError::Other(format!("update cannot be applied: {e}")))?;
        }
        let metadata: TableMetadata =
            builder.build().map_err(|e| CatalogError::Other(format!("updated metadata is not valid: {e}")))?.metadata;
        let location =
            MetadataLocation::from_str(&current).map_err(other)?.with_next_version().with_new_metadata(&metadata);
        metadata.write_to(table.file_io(), &location).await.map_err(other)?;
        let new_location = location.to_string();
        let swapped = {
            let _one_at_a_time = self.cas.lock().await;
            sqlx::query(
                "UPDATE iceberg_tables SET metadata_location = ?, previous_metadata_location = ? \
                 WHERE catalog_name = ? AND table_namespace = ? AND table_name = ? \
                 AND (iceberg_type = 'TABLE' OR iceberg_type IS NULL) AND metadata_location = ?",
            )
            .bind(&new_location)
            .bind(&current)
            .bind(&self.catalog_name)
            .bind(ident.namespace().join("."))
            .bind(ident.name())
            .bind(&current)
            .execute(&self.pool)
            .await
        };
        match swapped {
            Ok(done) if done.rows_affected() == 1 => {
                remove_dropped_metadata(ident, table.metadata(), &metadata, table.file_io()).await;
                let json = serde_json::to_string(&metadata).map_err(|e| {
                    CatalogError::UnknownOutcome(format!("committed, but the reply cannot be built: {e}"))
                })?;
                Ok(LoadedTable { metadata_location: new_location, metadata_json: json })
            }
            Ok(_) => {
                Err(CatalogError::Conflict(format!("table {ident} changed since its metadata {current} was loaded")))
            }
            // SQLITE_BUSY / SQLITE_LOCKED: the statement did not run.
            Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("5") | Some("6")) => {
                Err(CatalogError::Conflict(format!("the catalog database is busy: {e}")))
            }
            Err(e) => Err(CatalogError::UnknownOutcome(format!("updating the catalog failed: {e}"))),
        }
    }
}

/// The table property that has a commit delete the metadata files it
/// drops from the metadata log (whose length `write.metadata.previous-versions-max`
/// bounds; iceberg's metadata builder trims the log to it). Sluice sets it
/// on the tables it creates; a table without it keeps every file, as the
/// Java library's default does.
pub const DELETE_AFTER_COMMIT: &str = "write.metadata.delete-after-commit.enabled";

/// After a commit landed: deletes the metadata files `base`'s log named
/// that `committed`'s log no longer does, when `committed` asks for it
/// ([`DELETE_AFTER_COMMIT`]), as the Java library's
/// `CatalogUtil.deleteRemovedMetadataFiles` does. Never `base`'s own file
/// (the new log's newest entry) nor the new one. Best effort: the commit
/// stands whatever happens here, a file left behind is an orphan that
/// `sluice maintain --remove-orphans` removes, and a failure is logged.
///
/// Safe for exactly-once: Sluice's idempotence and recovery read the
/// snapshots of the current metadata only, never an older metadata file.
async fn remove_dropped_metadata(
    ident: &TableIdent,
    base: &TableMetadata,
    committed: &TableMetadata,
    io: &iceberg::io::FileIO,
) {
    let enabled = committed.properties().get(DELETE_AFTER_COMMIT).is_some_and(|v| v.eq_ignore_ascii_case("true"));
    if !enabled {
        return;
    }
    let kept: std::collections::HashSet<&str> =
        committed.metadata_log().iter().map(|e| e.metadata_file.as_str()).collect();
    for entry in base.metadata_log() {
        let file = entry.metadata_file.as_str();
        if kept.contains(file) {
            continue;
        }
        if let Err(e) = io.delete(file).await {
            tracing::warn!(table = %ident, file, error = %e, "a metadata file dropped from the log was not deleted; orphan cleanup can remove it");
        }
    }
}

impl CommitBackend for RestCommitter {
    fn commit(&self, ident: &TableIdent, commit: TableCommit) -> Result<LoadedTable, CommitError> {
        let TableCommit { requirements, updates } = commit;
        super::block_on(COMMIT, self.post(ident, &requirements, &updates))
            .map_err(CommitError::Deadline)?
            .map_err(CommitError::Catalog)
    }
}

/// The sink's catalog, shared by the instances of a run.
pub struct CatalogGrant {
    catalog_name: String,
    /// Loads and creates tables: iceberg-rust's `SqlCatalog` or `RestCatalog`.
    catalog: Arc<dyn Catalog>,
    backend: Box<dyn CommitBackend>,
    uri: String,
    pub stats: CatalogStats,
    /// A REST catalog's vended storage credentials.
    vended: Option<Arc<Vended>>,
}

impl std::fmt::Debug for CatalogGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatalogGrant").field("catalog", &self.catalog_name).field("uri", &self.uri).finish()
    }
}

fn to_file_uri(path: &Path) -> String {
    format!("file://{}", path.display())
}

impl CatalogGrant {
    /// Opens (creating when missing) the SQLite catalog `database` with its
    /// warehouse directory `warehouse`.
    pub fn open_sql(name: &str, database: &Path, warehouse: &Path) -> Result<Self, CatalogSetupError> {
        Self::open_sql_at(name, database, &Location::Local(warehouse.to_path_buf()), &StoreConfig::default())
    }

    /// Opens (creating when missing) the SQLite catalog `database` with its
    /// warehouse `warehouse`: a local directory (created when missing) or an
    /// object-store location, whose bucket is reached as `stores` says and
    /// listed once here, so a missing bucket or refused credentials stop the
    /// run before anything is written.
    pub fn open_sql_at(
        name: &str,
        database: &Path,
        warehouse: &Location,
        stores: &StoreConfig,
    ) -> Result<Self, CatalogSetupError> {
        let rt = super::runtime();
        let (factory, warehouse_uri): (Arc<dyn StorageFactory>, String) = match warehouse {
            Location::Local(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|source| CatalogSetupError::Dir { path: dir.to_path_buf(), source })?;
                (Arc::new(LocalFsStorageFactory), to_file_uri(dir))
            }
            Location::ObjectStore { .. } => {
                let warehouse_err =
                    |message: String| CatalogSetupError::Warehouse { warehouse: warehouse.to_string(), message };
                let storage = WarehouseStorage::open(warehouse.clone(), stores).map_err(warehouse_err)?;
                rt.block_on(storage.check_reachable()).map_err(warehouse_err)?;
                (Arc::new(WarehouseStorageFactory::new(storage, stores)), warehouse.to_string())
            }
        };
        let db_dir = database.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(db_dir)
            .map_err(|source| CatalogSetupError::Dir { path: db_dir.to_path_buf(), source })?;
        let uri = format!("sqlite:{}?mode=rwc", database.display());
        let open_err = |message: String| CatalogSetupError::Open { uri: uri.clone(), message };
        let sql = rt
            .block_on(
                SqlCatalogBuilder::default()
                    .with_storage_factory(factory)
                    .with_runtime(iceberg::Runtime::new(rt))
                    .load(
                        name,
                        HashMap::from([
                            ("uri".to_string(), uri.clone()),
                            ("warehouse".to_string(), warehouse_uri),
                            ("sql_bind_style".to_string(), SqlBindStyle::QMark.to_string()),
                        ]),
                    ),
            )
            .map_err(|e| open_err(e.to_string()))?;
        let options = SqliteConnectOptions::from_str(&uri)
            .map_err(|e| open_err(e.to_string()))?
            .busy_timeout(Duration::from_secs(30));
        let pool = rt
            .block_on(SqlitePoolOptions::new().max_connections(2).connect_with(options))
            .map_err(|e| open_err(e.to_string()))?;
        let catalog: Arc<dyn Catalog> = Arc::new(sql);
        let backend = SqlCommits {
            catalog_name: name.to_string(),
            catalog: catalog.clone(),
            pool,
            cas: tokio::sync::Mutex::new(()),
        };
        Ok(Self {
            catalog_name: name.to_string(),
            catalog,
            backend: Box::new(backend),
            uri,
            stats: CatalogStats::default(),
            vended: None,
        })
    }

    /// Connects to the REST catalog at `uri` (its `/v1/config` must answer).
    /// `warehouse` is passed to the catalog as the warehouse it should use.
    /// `auth` is a static bearer token or OAuth2 client credentials, whose
    /// first token is obtained here (see `catalog_auth`).
    pub fn open_rest(
        name: &str,
        uri: &str,
        warehouse: &Path,
        auth: Option<&RestAuth>,
    ) -> Result<Self, CatalogSetupError> {
        Self::open_rest_at(name, uri, &Location::Local(warehouse.to_path_buf()), auth, &StoreConfig::default())
    }

    /// [`CatalogGrant::open_rest`] with the warehouse `warehouse`: a local
    /// directory (created when missing) or an `s3://` location. On S3 the
    /// catalog is asked for vended credentials with every table it loads
    /// (`catalog_vended`); those sign the requests for that table's files,
    /// and anything else is reached as `stores` says.
    pub fn open_rest_at(
        name: &str,
        uri: &str,
        warehouse: &Location,
        auth: Option<&RestAuth>,
        stores: &StoreConfig,
    ) -> Result<Self, CatalogSetupError> {
        let open_err = |message: String| CatalogSetupError::Open { uri: uri.to_string(), message };
        let (factory, warehouse_uri, vended): (Arc<dyn StorageFactory>, String, Option<Arc<Vended>>) = match warehouse {
            Location::Local(dir) => {
                std::fs::create_dir_all(dir)
                    .map_err(|source| CatalogSetupError::Dir { path: dir.to_path_buf(), source })?;
                (Arc::new(LocalFsStorageFactory), to_file_uri(dir), None)
            }
            Location::ObjectStore { .. } => {
                // Not listed here: the credentials for it may be the catalog's alone.
                let storage = WarehouseStorage::open(warehouse.clone(), stores)
                    .map_err(|message| CatalogSetupError::Warehouse { warehouse: warehouse.to_string(), message })?;
                let factory = Arc::new(WarehouseStorageFactory::new(storage, stores));
                (factory, warehouse.to_string(), Some(Arc::new(Vended::new(stores.clone()))))
            }
        };
        let rt = super::runtime();
        let auth = Arc::new(rt.block_on(CatalogAuth::open(auth))?);
        let committer = rt.block_on(RestCommitter::connect(uri, &warehouse_uri, auth.clone())).map_err(open_err)?;
        let mut props = HashMap::from([
            (REST_CATALOG_PROP_URI.to_string(), uri.trim_end_matches('/').to_string()),
            (REST_CATALOG_PROP_WAREHOUSE.to_string(), warehouse_uri),
        ]);
        if vended.is_some() {
            props.insert(ACCESS_DELEGATION_HEADER.to_string(), VENDED_CREDENTIALS.to_string());
        }
        let loads: Arc<dyn Catalog> =
            Arc::new(RestLoads::new(name, props, factory, iceberg::Runtime::new(rt), auth, vended.clone()));
        if let Some(v) = &vended {
            v.set_catalog(Arc::downgrade(&loads));
        }
        Ok(Self {
            catalog_name: name.to_string(),
            catalog: loads,
            backend: Box::new(committer),
            uri: uri.to_string(),
            stats: CatalogStats::default(),
            vended,
        })
    }

    /// The storage credentials the catalog vends (a REST catalog whose
    /// warehouse is on S3), for the `file-io` grants.
    pub(crate) fn vended(&self) -> Option<Arc<Vended>> {
        self.vended.clone()
    }

    /// How many times a table came with vended storage credentials.
    pub fn vended_credentials_received(&self) -> u64 {
        self.vended.as_ref().map_or(0, |v| v.received())
    }

    /// The catalog `config` names (`[sink.catalog]`).
    /// Its object-store warehouse is reached as `stores` says (the job's
    /// `[sink.s3]`, the sink's grants being in the same place).
    pub fn for_config(config: &CatalogConfig, stores: &StoreConfig) -> Result<Self, CatalogSetupError> {
        match config {
            CatalogConfig::Sql { name, database, warehouse } => Self::open_sql_at(name, database, warehouse, stores),
            CatalogConfig::Rest { name, uri, warehouse, auth } => {
                Self::open_rest_at(name, uri, warehouse, auth.as_ref(), stores)
            }
        }
    }

    /// Wraps the commit backend in the test faults and latency of a run.
    pub fn with_faults(mut self, faults: &crate::fault::Faults) -> Self {
        self.backend = super::catalog_faults::wrap(self.backend, faults);
        self
    }

    pub fn describe(&self) -> String {
        format!("iceberg catalog {:?} ({})", self.catalog_name, self.uri)
    }

    /// Loads a table (for the host's own checks and for tests).
    pub fn load(&self, ident: &TableIdent) -> Result<Table, CatalogError> {
        super::runtime().block_on(self.catalog.load_table(ident)).map_err(load_error)
    }

    /// Drops `ident` from the catalog (its files stay): for tools that made a
    /// scratch table (the conformance suite), never called by a run.
    pub fn drop_table(&self, ident: &TableIdent) -> Result<(), CatalogError> {
        super::runtime().block_on(self.catalog.drop_table(ident)).map_err(load_error)
    }

    /// Loads a table for the plugin, within the call's deadline.
    fn load_table(&self, ident: &TableIdent) -> Result<Result<LoadedTable, CatalogError>, HostDeadline> {
        let table = super::block_on(LOAD, self.catalog.load_table(ident))?;
        Ok(table.map_err(load_error).and_then(|t| loaded(&t)))
    }

    /// Creates a table from a REST-spec create-table request (for the host's
    /// tools and tests: no plugin call's deadline applies).
    pub fn create_table(&self, ident: &TableIdent, request: &str) -> Result<LoadedTable, CatalogError> {
        self.create_table_within(ident, request).unwrap_or_else(|late| Err(CatalogError::Other(late.to_string())))
    }

    /// Creates a table for the plugin, within the call's deadline.
    fn create_table_within(
        &self,
        ident: &TableIdent,
        request: &str,
    ) -> Result<Result<LoadedTable, CatalogError>, HostDeadline> {
        #[derive(Deserialize)]
        #[serde(rename_all = "kebab-case")]
        struct CreateTableRequest {
            name: String,
            schema: Schema,
            partition_spec: Option<UnboundPartitionSpec>,
            #[serde(default)]
            properties: HashMap<String, String>,
        }
        let request: CreateTableRequest = match serde_json::from_str(request) {
            Ok(r) => r,
            Err(e) => return Ok(Err(CatalogError::Other(format!("create-table request is not valid: {e}")))),
        };
        if request.name != ident.name() {
            return Ok(Err(CatalogError::Other(format!(
                "create-table request names table {:?} but the call names {:?}",
                request.name,
                ident.name()
            ))));
        }
        let namespace = ident.namespace().clone();
        let mut properties = request.properties;
        // The REST spec's reserved property `format-version` picks the new
        // table's format version: a REST server reads it from the
        // properties; iceberg's SQL catalog refuses reserved properties and
        // takes the version from `TableCreation::format_version`.
        let mut format_version = iceberg::spec::FormatVersion::V2;
        if self.uri.starts_with("sqlite:")
            && let Some(v) = properties.remove(iceberg::spec::TableProperties::PROPERTY_FORMAT_VERSION)
        {
            format_version = match v.trim() {
                "1" => iceberg::spec::FormatVersion::V1,
                "2" => iceberg::spec::FormatVersion::V2,
                "3" => iceberg::spec::FormatVersion::V3,
                other => {
                    return Ok(Err(CatalogError::Other(format!(
                        "create-table request for {ident} asks for format-version {other:?}; 1, 2 or 3 are known"
                    ))));
                }
            };
        }
        let creation = TableCreation::builder()
            .name(request.name)
            .schema(request.schema)
            .partition_spec_opt(request.partition_spec)
            .properties(properties)
            .format_version(format_version)
            .build();
        super::block_on(CREATE, async {
            if !self.catalog.namespace_exists(&namespace).await.map_err(other)? {
                // Another job may create it at the same moment: that is fine.
                if let Err(e) = self.catalog.create_namespace(&namespace, HashMap::new()).await
                    && !self.catalog.namespace_exists(&namespace).await.map_err(other)?
                {
                    return Err(other(e));
                }
            }
            match self.catalog.create_table(&namespace, creation).await {
                Ok(table) => loaded(&table),
                Err(e) if e.kind() == ErrorKind::TableAlreadyExists => Err(CatalogError::Conflict(e.to_string())),
                // Lost a creation race: the insert hit the primary key.
                Err(e) if self.catalog.table_exists(ident).await.unwrap_or(false) => {
                    Err(CatalogError::Conflict(format!("table {ident} was created concurrently: {e}")))
                }
                Err(e) => Err(other(e)),
            }
        })
    }

    /// Commits the plugin's REST-spec requirements and updates (JSON).
    pub(crate) fn commit_table(
        &self,
        ident: &TableIdent,
        requirements: &str,
        updates: &str,
    ) -> Result<LoadedTable, CommitError> {
        self.stats.commit_calls.fetch_add(1, Ordering::Relaxed);
        let requirements: Vec<TableRequirement> = serde_json::from_str(requirements)
            .map_err(|e| CatalogError::Other(format!("commit requirements are not valid REST-spec JSON: {e}")))?;
        let updates: Vec<TableUpdate> = serde_json::from_str(updates)
            .map_err(|e| CatalogError::Other(format!("commit updates are not valid REST-spec JSON: {e}")))?;
        let result = self.backend.commit(ident, TableCommit { requirements, updates });
        match &result {
            Err(CommitError::Catalog(CatalogError::Conflict(_))) => {
                self.stats.conflicts.fetch_add(1, Ordering::Relaxed);
            }
            Err(CommitError::Catalog(CatalogError::UnknownOutcome(_))) => {
                self.stats.unknown_outcomes.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        result
    }
}

fn other(e: impl std::fmt::Display) -> CatalogError {
    CatalogError::Other(e.to_string())
}

fn load_error(e: iceberg::Error) -> CatalogError {
    match e.kind() {
        ErrorKind::TableNotFound | ErrorKind::NamespaceNotFound => CatalogError::NotFound(e.to_string()),
        _ => CatalogError::Other(e.to_string()),
    }
}

fn loaded(table: &Table) -> Result<LoadedTable, CatalogError> {
    let metadata_location = table.metadata_location_result().map_err(other)?.to_string();
    let metadata_json = serde_json::to_string(table.metadata()).map_err(other)?;
    Ok(LoadedTable { metadata_location, metadata_json })
}

fn ident(wit: &wit::TableIdent) -> Result<TableIdent, CatalogError> {
    let namespace = NamespaceIdent::from_vec(wit.namespace.clone())
        .map_err(|e| CatalogError::Other(format!("table namespace {:?} is not valid: {e}", wit.namespace)))?;
    if wit.name.is_empty() {
        return Err(CatalogError::Other("table name is empty".to_string()));
    }
    Ok(TableIdent::new(namespace, wit.name.clone()))
}

fn no_catalog() -> CatalogError {
    CatalogError::Other("this sink has no catalog: configure one in the job file's [sink.catalog]".to_string())
}

/// One instance's catalog: the run's, when the job configures one.
pub struct CatalogCtx {
    pub catalog: Option<Arc<CatalogGrant>>,
    /// The instance's deferred syncs, settled before a table changes.
    pub syncs: Arc<Syncs>,
}

/// What the `iceberg-catalog` interface is linked through.
pub struct CatalogView<'a> {
    pub ctx: &'a CatalogCtx,
    pub effects: &'a mut Effects,
}

/// The `iceberg-catalog` capability for wasmtime's linker.
pub struct IcebergCatalog;

impl HasData for IcebergCatalog {
    type Data<'a> = CatalogView<'a>;
}

/// The view of a store's data.
pub(super) fn view<T: CapabilityHost>(t: &mut T) -> CatalogView<'_> {
    let caps = t.capabilities().0;
    CatalogView { ctx: &caps.catalog, effects: &mut caps.effects }
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, IcebergCatalog>(linker, view::<T>)
}

impl wit::Host for CatalogView<'_> {
    fn load_table(&mut self, table: wit::TableIdent) -> wasmtime::Result<Result<LoadedTable, CatalogError>> {
        let Some(catalog) = self.ctx.catalog.clone() else { return Ok(Err(no_catalog())) };
        match ident(&table) {
            Ok(ident) => Ok(catalog.load_table(&ident)?),
            Err(e) => Ok(Err(e)),
        }
    }

    fn create_table(
        &mut self,
        table: wit::TableIdent,
        request_json: String,
    ) -> wasmtime::Result<Result<LoadedTable, CatalogError>> {
        let Some(catalog) = self.ctx.catalog.clone() else { return Ok(Err(no_catalog())) };
        self.ctx.syncs.before_publishing()?;
        let result = match ident(&table) {
            Ok(ident) => catalog.create_table_within(&ident, &request_json)?,
            Err(e) => Err(e),
        };
        if result.is_ok() {
            self.effects.done()?;
        }
        Ok(result)
    }

    fn commit_table(
        &mut self,
        table: wit::TableIdent,
        requirements_json: String,
        updates_json: String,
    ) -> wasmtime::Result<Result<LoadedTable, CatalogError>> {
        let Some(catalog) = self.ctx.catalog.clone() else { return Ok(Err(no_catalog())) };
        self.ctx.syncs.before_publishing()?;
        let result = ident(&table)
            .map_err(CommitError::Catalog)
            .and_then(|ident| catalog.commit_table(&ident, &requirements_json, &updates_json));
        let result = match result {
            Ok(loaded) => Ok(loaded),
            Err(CommitError::Catalog(e)) => Err(e),
            Err(CommitError::Deadline(d)) => return Err(wasmtime::Error::new(d)),
            Err(CommitError::InjectedCrash(injected)) => return Err(wasmtime::Error::new(injected)),
        };
        if !matches!(result, Err(CatalogError::Conflict(_))) {
            // A crash "during commit" happens right after the commit's effect.
            self.effects.done()?;
        }
        Ok(result)
    }
}
