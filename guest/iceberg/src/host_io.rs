//! The host's capabilities as iceberg-rust sees them: a `Storage` over the
//! `file-io` import and a `Catalog` over the `iceberg-catalog` import.
//!
//! Invariants:
//! - every byte of the table goes through `file-io`, so the host's grants
//!   bound what the plugin can touch;
//! - [`PinnedCatalog`] hands iceberg's `Transaction` exactly the table this
//!   attempt checked, so the transaction never rebases silently; its commit
//!   errors are never `retryable`, so iceberg never retries on its own; the
//!   committer reads the catalog's verdict from [`PinnedCatalog::verdict`].

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use iceberg::io::{
    FileIO, FileIOBuilder, FileMetadata, FileRead, FileWrite, InputFile, OutputFile, Storage, StorageConfig,
    StorageFactory,
};
use iceberg::spec::TableMetadata;
use iceberg::table::Table;
use iceberg::{Catalog, Error, ErrorKind, Namespace, NamespaceIdent, Result, TableCommit, TableCreation, TableIdent};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::bindings::sluice::connector::file_io as fio;
use sluice_guest_sdk::bindings::sluice::connector::iceberg_catalog as cat;
use sluice_guest_sdk::files::{OutputWriter, describe};
use sluice_guest_sdk::{SinkError, error};

use crate::runtime;

fn io_err(op: &str, location: &str, e: fio::IoError) -> Error {
    let hint = match e {
        fio::IoError::Denied(_) => "; grant the table's location in [sink.grants] locations",
        _ => "",
    };
    let kind = match e {
        fio::IoError::NotFound(_) => ErrorKind::DataInvalid,
        _ => ErrorKind::Unexpected,
    };
    Error::new(kind, format!("{op} {location}: {}{hint}", describe(&e)))
}

/// Storage over the host's `file-io` capability.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct HostStorage;

#[async_trait]
#[typetag::serde]
impl Storage for HostStorage {
    async fn exists(&self, path: &str) -> Result<bool> {
        fio::exists(path).map_err(|e| io_err("checking", path, e))
    }

    async fn metadata(&self, path: &str) -> Result<FileMetadata> {
        let status = fio::stat(path).map_err(|e| io_err("reading the size of", path, e))?;
        Ok(FileMetadata { size: status.size })
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        let status = fio::stat(path).map_err(|e| io_err("reading", path, e))?;
        let bytes = fio::read(path, 0, status.size).map_err(|e| io_err("reading", path, e))?;
        Ok(Bytes::from(bytes))
    }

    async fn reader(&self, path: &str) -> Result<Box<dyn FileRead>> {
        Ok(Box::new(HostRead { path: path.to_string() }))
    }

    async fn write(&self, path: &str, bs: Bytes) -> Result<()> {
        fio::write_file(path, &bs, true).map_err(|e| io_err("writing", path, e))
    }

    async fn writer(&self, path: &str) -> Result<Box<dyn FileWrite>> {
        // Data, manifest and manifest-list names are unique per attempt, so an
        // existing file means a bug: never overwrite.
        // Deferred: a fan-out writer may hold hundreds of small partition
        // files open; none of them costs a host file handle until it has data.
        let out = OutputWriter::deferred(path, false);
        Ok(Box::new(HostWrite { out: SingleThreaded(Some(out)), path: path.to_string() }))
    }

    async fn delete(&self, path: &str) -> Result<()> {
        match fio::delete(path) {
            Ok(()) | Err(fio::IoError::NotFound(_)) => Ok(()),
            Err(e) => Err(io_err("deleting", path, e)),
        }
    }

    async fn delete_prefix(&self, path: &str) -> Result<()> {
        let entries = match fio::list_dir(path) {
            Ok(entries) => entries,
            Err(fio::IoError::NotFound(_)) => return Ok(()),
            Err(e) => return Err(io_err("listing", path, e)),
        };
        for entry in entries {
            let child = sluice_guest_sdk::files::join(path, &entry);
            let is_dir = fio::stat(&child).map(|s| s.is_dir).unwrap_or(false);
            if is_dir {
                Box::pin(self.delete_prefix(&child)).await?;
            }
            self.delete(&child).await?;
        }
        Ok(())
    }

    async fn delete_stream(&self, paths: BoxStream<'static, String>) -> Result<()> {
        use futures::StreamExt;
        let paths: Vec<String> = paths.collect().await;
        for path in paths {
            self.delete(&path).await?;
        }
        Ok(())
    }

    fn new_input(&self, path: &str) -> Result<InputFile> {
        Ok(InputFile::new(Arc::new(self.clone()), path.to_string()))
    }

    fn new_output(&self, path: &str) -> Result<OutputFile> {
        Ok(OutputFile::new(Arc::new(self.clone()), path.to_string()))
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct HostStorageFactory;

#[typetag::serde]
impl StorageFactory for HostStorageFactory {
    fn build(&self, _config: &StorageConfig) -> Result<Arc<dyn Storage>> {
        Ok(Arc::new(HostStorage))
    }
}

pub fn file_io() -> FileIO {
    FileIOBuilder::new(Arc::new(HostStorageFactory)).build()
}

struct HostRead {
    path: String,
}

#[async_trait]
impl FileRead for HostRead {
    async fn read(&self, range: Range<u64>) -> Result<Bytes> {
        let len = range.end.saturating_sub(range.start);
        let bytes = fio::read(&self.path, range.start, len).map_err(|e| io_err("reading", &self.path, e))?;
        Ok(Bytes::from(bytes))
    }
}

/// Lets a value that is not `Send` (a component resource handle) satisfy
/// iceberg's `Send` bounds.
struct SingleThreaded<T>(T);

// SAFETY: a wasm32-wasip2 component instance has exactly one thread; no value
// of this guest can ever be observed from another thread.
unsafe impl<T> Send for SingleThreaded<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SingleThreaded<T> {}

struct HostWrite {
    out: SingleThreaded<Option<OutputWriter>>,
    path: String,
}

#[async_trait]
impl FileWrite for HostWrite {
    async fn write(&mut self, bs: Bytes) -> Result<()> {
        use std::io::Write;
        let out = self
            .out
            .0
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Unexpected, format!("{} is already closed", self.path)))?;
        out.write_all(&bs).map_err(|e| Error::new(ErrorKind::Unexpected, format!("writing {}: {e}", self.path)))
    }

    async fn close(&mut self) -> Result<()> {
        let out = self
            .out
            .0
            .take()
            .ok_or_else(|| Error::new(ErrorKind::Unexpected, format!("{} is already closed", self.path)))?;
        out.finish().map_err(|e| io_err("finishing", &self.path, e))
    }
}

fn wit_ident(ident: &TableIdent) -> cat::TableIdent {
    cat::TableIdent { namespace: ident.namespace().clone().inner(), name: ident.name().to_string() }
}

/// Why loading a table failed.
#[derive(Debug)]
pub enum LoadError {
    NotFound(String),
    Catalog(cat::CatalogError),
    Invalid(String),
}

impl LoadError {
    pub fn into_sink_error(self, table: &TableIdent) -> SinkError {
        match self {
            LoadError::NotFound(m) => error::config(format!("table {table} does not exist: {m}")),
            LoadError::Catalog(e) => catalog_sink_error(&format!("loading table {table}"), e),
            LoadError::Invalid(m) => error::fatal(format!("table {table}: {m}")),
        }
    }
}

pub fn catalog_message(e: &cat::CatalogError) -> String {
    match e {
        cat::CatalogError::Conflict(m) => format!("conflict: {m}"),
        cat::CatalogError::UnknownOutcome(m) => format!("outcome unknown: {m}"),
        cat::CatalogError::NotFound(m) => format!("not found: {m}"),
        cat::CatalogError::Other(m) => m.clone(),
    }
}

pub fn catalog_sink_error(context: &str, e: cat::CatalogError) -> SinkError {
    match e {
        cat::CatalogError::NotFound(_) => error::config(format!("{context}: {}", catalog_message(&e))),
        cat::CatalogError::Conflict(_) | cat::CatalogError::UnknownOutcome(_) => {
            error::retryable(format!("{context}: {}", catalog_message(&e)))
        }
        cat::CatalogError::Other(_) => error::fatal(format!("{context}: {}", catalog_message(&e))),
    }
}

fn build_table(ident: &TableIdent, loaded: cat::LoadedTable) -> std::result::Result<Table, LoadError> {
    let metadata: TableMetadata = serde_json::from_str(&loaded.metadata_json)
        .map_err(|e| LoadError::Invalid(format!("the catalog returned table metadata that is not valid: {e}")))?;
    Table::builder()
        .metadata(metadata)
        .metadata_location(loaded.metadata_location)
        .identifier(ident.clone())
        .file_io(file_io())
        .runtime(runtime::iceberg_runtime())
        .build()
        .map_err(|e| LoadError::Invalid(e.to_string()))
}

/// Loads the table's current state from the host's catalog.
pub async fn load_table(ident: &TableIdent) -> std::result::Result<Table, LoadError> {
    match cat::load_table(&wit_ident(ident)) {
        Ok(loaded) => build_table(ident, loaded),
        Err(cat::CatalogError::NotFound(m)) => Err(LoadError::NotFound(m)),
        Err(e) => Err(LoadError::Catalog(e)),
    }
}

/// How often a load that decides something is tried: a catalog that fails
/// to answer (a dropped connection, a 503) is usually back within seconds.
pub const LOAD_RETRY: sluice_retry::Policy = sluice_retry::Policy {
    attempts: 5,
    initial: std::time::Duration::from_millis(200),
    max: std::time::Duration::from_secs(3),
};

/// `load` (a load of table `ident`, for `context`), tried again by `policy`
/// while the catalog fails to answer; a table that is not there or not
/// valid is not retried. A catalog still failing after the last try is
/// `retryable`, as a failed commit is: the host may run the step again, and
/// nothing was decided or committed. `warn` hears of each try that failed.
pub fn load_retrying<T>(
    policy: sluice_retry::Policy,
    ident: &TableIdent,
    context: &str,
    mut load: impl FnMut() -> std::result::Result<T, LoadError>,
    warn: impl Fn(&str),
) -> std::result::Result<T, SinkError> {
    policy
        .run(
            |_| load(),
            |e| matches!(e, LoadError::Catalog(_)),
            |e, attempt, wait| {
                if let LoadError::Catalog(e) = e {
                    warn(&format!(
                        "{context}: loading table {ident} failed (try {attempt}): {}; trying again in {} ms",
                        catalog_message(e),
                        wait.as_millis()
                    ));
                }
            },
        )
        .map_err(|failed| match failed.error {
            LoadError::Catalog(e) => error::retryable(format!(
                "{context}: loading table {ident} failed {} times, the last with: {}",
                failed.attempts,
                catalog_message(&e)
            )),
            other => other.into_sink_error(ident),
        })
}

/// The REST spec's CreateTableRequest, as far as Sluice fills it.
#[derive(Serialize)]
#[serde(rename_all = "kebab-case")]
struct CreateTableRequest<'a> {
    name: &'a str,
    schema: &'a iceberg::spec::Schema,
    #[serde(skip_serializing_if = "Option::is_none")]
    partition_spec: Option<&'a iceberg::spec::UnboundPartitionSpec>,
    properties: HashMap<String, String>,
}

/// The table properties Sluice sets on a table it creates (#42): besides
/// who created it, a metadata log bounded to the Java library's 100
/// entries, and the files dropped from it deleted by the commit that drops
/// them (the host's SQL catalog does it; a REST catalog's server does), so
/// a job committing for weeks does not pile up a metadata file per commit.
pub fn created_properties() -> HashMap<String, String> {
    HashMap::from([
        ("created-by".to_string(), format!("sluice iceberg sink {}", env!("CARGO_PKG_VERSION"))),
        ("write.metadata.previous-versions-max".to_string(), "100".to_string()),
        ("write.metadata.delete-after-commit.enabled".to_string(), "true".to_string()),
    ])
}

/// Creates the table in format version `format_version`; `conflict`
/// (another job created it first) is passed on. A version other than 2
/// (iceberg's default) travels as the REST spec's reserved table property
/// `format-version`, as Java's catalogs send it.
pub fn create_table(
    ident: &TableIdent,
    schema: &iceberg::spec::Schema,
    spec: Option<&iceberg::spec::UnboundPartitionSpec>,
    format_version: u8,
) -> std::result::Result<Table, LoadError> {
    let mut properties = created_properties();
    if format_version != 2 {
        properties.insert("format-version".to_string(), format_version.to_string());
    }
    let request = CreateTableRequest { name: ident.name(), schema, partition_spec: spec, properties };
    let json = serde_json::to_string(&request)
        .map_err(|e| LoadError::Invalid(format!("encoding the create-table request: {e}")))?;
    match cat::create_table(&wit_ident(ident), &json) {
        Ok(loaded) => build_table(ident, loaded),
        Err(e) => Err(LoadError::Catalog(e)),
    }
}

/// Fails with a config error when the plugin may not reach the table's files.
pub fn check_writable(table: &Table) -> std::result::Result<(), SinkError> {
    let location = table.metadata().location();
    match fio::exists(location) {
        Ok(_) => Ok(()),
        Err(e) => Err(sluice_guest_sdk::files::to_sink_error(&format!("table location {location}"), e)),
    }
}

/// A `Catalog` for exactly one commit attempt of iceberg's `Transaction`:
/// `load_table` returns the table this attempt already checked (so the
/// transaction builds on it and does not rebase), and `update_table` sends
/// the requirements and updates to the host once.
#[derive(Debug)]
pub struct PinnedCatalog {
    table: Table,
    verdict: Mutex<Option<std::result::Result<(), cat::CatalogError>>>,
}

impl PinnedCatalog {
    pub fn new(table: Table) -> Self {
        Self { table, verdict: Mutex::new(None) }
    }

    /// What the host answered to the commit, if it was asked.
    pub fn verdict(&self) -> Option<std::result::Result<(), cat::CatalogError>> {
        self.verdict.lock().ok().and_then(|mut v| v.take())
    }

    fn record(&self, verdict: std::result::Result<(), cat::CatalogError>) {
        if let Ok(mut v) = self.verdict.lock() {
            *v = Some(verdict);
        }
    }
}

fn unsupported(what: &str) -> Error {
    Error::new(ErrorKind::FeatureUnsupported, format!("the sink's catalog does not {what}"))
}

#[async_trait]
impl Catalog for PinnedCatalog {
    async fn list_namespaces(&self, _parent: Option<&NamespaceIdent>) -> Result<Vec<NamespaceIdent>> {
        Err(unsupported("list namespaces"))
    }
    async fn create_namespace(
        &self,
        _namespace: &NamespaceIdent,
        _properties: HashMap<String, String>,
    ) -> Result<Namespace> {
        Err(unsupported("create namespaces"))
    }
    async fn get_namespace(&self, _namespace: &NamespaceIdent) -> Result<Namespace> {
        Err(unsupported("read namespaces"))
    }
    async fn namespace_exists(&self, _namespace: &NamespaceIdent) -> Result<bool> {
        Err(unsupported("read namespaces"))
    }
    async fn update_namespace(&self, _namespace: &NamespaceIdent, _properties: HashMap<String, String>) -> Result<()> {
        Err(unsupported("update namespaces"))
    }
    async fn drop_namespace(&self, _namespace: &NamespaceIdent) -> Result<()> {
        Err(unsupported("drop namespaces"))
    }
    async fn list_tables(&self, _namespace: &NamespaceIdent) -> Result<Vec<TableIdent>> {
        Err(unsupported("list tables"))
    }
    async fn create_table(&self, _namespace: &NamespaceIdent, _creation: TableCreation) -> Result<Table> {
        Err(unsupported("create tables inside a commit"))
    }
    async fn load_table(&self, table: &TableIdent) -> Result<Table> {
        if table != self.table.identifier() {
            return Err(unsupported("load other tables"));
        }
        Ok(self.table.clone())
    }
    async fn drop_table(&self, _table: &TableIdent) -> Result<()> {
        Err(unsupported("drop tables"))
    }
    async fn purge_table(&self, _table: &TableIdent) -> Result<()> {
        Err(unsupported("purge tables"))
    }
    async fn table_exists(&self, table: &TableIdent) -> Result<bool> {
        Ok(table == self.table.identifier())
    }
    async fn rename_table(&self, _src: &TableIdent, _dest: &TableIdent) -> Result<()> {
        Err(unsupported("rename tables"))
    }
    async fn register_table(&self, _table: &TableIdent, _metadata_location: String) -> Result<Table> {
        Err(unsupported("register tables"))
    }
    async fn update_table(&self, mut commit: TableCommit) -> Result<Table> {
        let ident = commit.identifier().clone();
        let requirements = serde_json::to_string(&commit.take_requirements())
            .map_err(|e| Error::new(ErrorKind::Unexpected, format!("encoding commit requirements: {e}")))?;
        let updates = serde_json::to_string(&commit.take_updates())
            .map_err(|e| Error::new(ErrorKind::Unexpected, format!("encoding commit updates: {e}")))?;
        match cat::commit_table(&wit_ident(&ident), &requirements, &updates) {
            Ok(loaded) => {
                self.record(Ok(()));
                build_table(&ident, loaded).map_err(|e| {
                    Error::new(ErrorKind::Unexpected, format!("committed, but the new metadata is unreadable: {e:?}"))
                })
            }
            Err(e) => {
                let message = catalog_message(&e);
                self.record(Err(e));
                // Not retryable: the committer decides what happens next.
                Err(Error::new(ErrorKind::CatalogCommitConflicts, message).with_retryable(false))
            }
        }
    }
}

/// Commits `updates` to `ident` guarded by `requirements`, outside a
/// snapshot transaction (schema changes). The host applies them atomically
/// or answers `conflict`.
pub fn commit_updates(
    ident: &TableIdent,
    requirements: &[iceberg::TableRequirement],
    updates: &[iceberg::TableUpdate],
) -> std::result::Result<(), cat::CatalogError> {
    let requirements = serde_json::to_string(requirements)
        .map_err(|e| cat::CatalogError::Other(format!("encoding commit requirements: {e}")))?;
    let updates = serde_json::to_string(updates)
        .map_err(|e| cat::CatalogError::Other(format!("encoding commit updates: {e}")))?;
    cat::commit_table(&wit_ident(ident), &requirements, &updates).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    const FAST: sluice_retry::Policy = sluice_retry::Policy {
        attempts: 3,
        initial: std::time::Duration::from_millis(1),
        max: std::time::Duration::from_millis(2),
    };

    /// A catalog that fails to answer is tried again, and still failing
    /// after the last try is `retryable` naming the table; a missing or
    /// invalid table is not tried again.
    #[test]
    fn loads_are_retried_only_while_the_catalog_fails_to_answer() {
        let ident = TableIdent::from_strs(["db", "daily"]).unwrap();
        let mut tries = 0;
        let warned = std::cell::RefCell::new(Vec::new());
        let warn = |m: &str| warned.borrow_mut().push(m.to_string());
        let loaded = load_retrying(
            FAST,
            &ident,
            "planning",
            || {
                tries += 1;
                if tries < 3 { Err(LoadError::Catalog(cat::CatalogError::Other("503".into()))) } else { Ok(tries) }
            },
            warn,
        );
        assert_eq!(loaded.unwrap(), 3);
        assert_eq!(warned.borrow().len(), 2, "{warned:?}");
        assert!(warned.borrow()[0].contains("db.daily") && warned.borrow()[0].contains("503"), "{warned:?}");
        let mut tries = 0;
        let failed = load_retrying(
            FAST,
            &ident,
            "planning",
            || -> std::result::Result<(), LoadError> {
                tries += 1;
                Err(LoadError::Catalog(cat::CatalogError::Other("connection reset".into())))
            },
            warn,
        );
        let Err(SinkError::Retryable(m)) = failed else { panic!("{failed:?}") };
        assert!(m.contains("db.daily") && m.contains("3 times") && m.contains("connection reset"), "{m}");
        assert_eq!(tries, 3);
        let mut tries = 0;
        let missing = load_retrying(
            FAST,
            &ident,
            "planning",
            || -> std::result::Result<(), LoadError> {
                tries += 1;
                Err(LoadError::NotFound("no such table".into()))
            },
            warn,
        );
        assert!(matches!(missing, Err(SinkError::Config(_))), "{missing:?}");
        assert_eq!(tries, 1);
    }
}
