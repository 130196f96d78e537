//! The storage of the host's SQL catalog when its warehouse is on an object
//! store: iceberg's `Storage` and `StorageFactory` over `sluice-store`, so
//! the table metadata the catalog writes and the data files plugins write
//! through `file-io` go through one store crate and one credential path.
//!
//! Invariants:
//! - it touches only objects inside its warehouse: a location is judged as
//!   a plugin's `file-io` location is (no `%`, no control characters, no
//!   empty, `.` or `..` segment, no `?`, `#` or `\`) and must lie inside the
//!   warehouse, segment by segment, before any request is sent. So a
//!   plugin's commit (a `set-location` update, say) cannot make the host
//!   write metadata anywhere else;
//! - the store is reached exactly as `file-io` reaches it ([`StoreConfig`],
//!   by default the environment: the AWS chain with `AWS_REGION` and
//!   `AWS_ENDPOINT_URL`, or Google's ADC). The catalog's `s3.*`/`gcs.*`
//!   properties are ignored, except the S3 credentials a REST catalog
//!   vends with a table (`catalog_vended`), which sign that `FileIO`'s
//!   requests. Nothing secret is ever serialized: the
//!   serialized form (iceberg's `typetag`) is the warehouse URL alone, and a
//!   storage deserialized from it reaches the store from the environment;
//! - `write` and `writer` replace an existing object, as iceberg's
//!   `OutputFile` says they do (the catalog names every metadata file
//!   afresh, so in practice none is replaced); nothing is visible before a
//!   writer's `close`;
//! - nothing is retried here (`sluice-store`'s rule); an error names the
//!   object's URL and is `retryable` only when the store calls it temporary;
//! - ranged reads return exactly the bytes asked for, or an error.
//!
//! Why not `iceberg-storage-opendal`: it would be a second way to reach the
//! same buckets (its own S3 and GCS configuration from catalog properties,
//! its own credential loading and retry layer), and its `opendal-s3`
//! feature builds aws-lc-rs (a C build) into the host, whose TLS is ring.

use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use iceberg::io::{FileMetadata, FileRead, FileWrite, InputFile, OutputFile, Storage, StorageConfig, StorageFactory};
use iceberg::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};
use sluice_store::{DEFAULT_PART_SIZE, ObjectStore, ObjectWriter, StoreError};

use super::file_io_store::{StoreConfig, open_store, parse_plugin_location};
use crate::location::{Location, Scheme};

/// The serialized form of the storage and its factory: the warehouse alone.
#[derive(Serialize, Deserialize)]
struct Warehouse {
    warehouse: String,
}

/// A warehouse on an object store, as iceberg's `FileIO` uses it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(try_from = "Warehouse", into = "Warehouse")]
pub struct WarehouseStorage {
    /// `Location::ObjectStore`.
    root: Location,
    store: ObjectStore,
}

impl From<WarehouseStorage> for Warehouse {
    fn from(storage: WarehouseStorage) -> Self {
        Warehouse { warehouse: storage.root.to_string() }
    }
}

impl TryFrom<Warehouse> for WarehouseStorage {
    type Error = String;

    fn try_from(w: Warehouse) -> std::result::Result<Self, String> {
        let root = parse_plugin_location(&w.warehouse).map_err(|e| super::file_io::describe_io(&e))?;
        WarehouseStorage::open(root, &StoreConfig::default())
    }
}

impl WarehouseStorage {
    /// The storage of the warehouse `root` (an object-store location),
    /// reaching its bucket as `stores` says. Sends nothing.
    pub fn open(root: Location, stores: &StoreConfig) -> std::result::Result<Self, String> {
        let store = open_store(&root, stores)?;
        Ok(Self { root, store })
    }

    /// Lists one page under the warehouse: a missing bucket, an unreachable
    /// endpoint or refused credentials show here, before anything is written.
    pub async fn check_reachable(&self) -> std::result::Result<(), String> {
        self.store
            .has_children(self.root_prefix())
            .await
            .map(|_| ())
            .map_err(|e| format!("the warehouse's bucket cannot be listed: {e}"))
    }

    /// The warehouse's key prefix (`""`: the whole bucket).
    fn root_prefix(&self) -> &str {
        match &self.root {
            Location::ObjectStore { prefix, .. } => prefix,
            Location::Local(_) => "",
        }
    }

    /// The object key of `path`, judged (see the module doc). The warehouse
    /// root itself is a folder, never an object.
    fn key(&self, path: &str) -> Result<String> {
        let refuse = |why: String| {
            Error::new(ErrorKind::DataInvalid, format!("{path}: {why} (the catalog's warehouse is {})", self.root))
        };
        let location = parse_plugin_location(path).map_err(|e| refuse(super::file_io::describe_io(&e)))?;
        if !location.is_within(&self.root) {
            return Err(refuse("outside the warehouse".into()));
        }
        match location {
            Location::ObjectStore { prefix, .. } => Ok(prefix),
            Location::Local(_) => Err(refuse("not an object-store location".into())),
        }
    }

    /// The key of an object (not the warehouse's root).
    fn object_key(&self, path: &str) -> Result<String> {
        let key = self.key(path)?;
        if key == self.root_prefix() {
            return Err(Error::new(ErrorKind::DataInvalid, format!("{path} is the warehouse's root, not a file")));
        }
        Ok(key)
    }
}

/// iceberg's error for a failed store operation.
fn store_error(what: &str, e: StoreError) -> Error {
    let retryable = e.is_temporary();
    Error::new(ErrorKind::Unexpected, format!("the catalog's warehouse storage: {what}"))
        .with_retryable(retryable)
        .with_source(e)
}

#[async_trait]
#[typetag::serde(name = "SluiceWarehouseStorage")]
impl Storage for WarehouseStorage {
    async fn exists(&self, path: &str) -> Result<bool> {
        let key = self.key(path)?;
        if key == self.root_prefix() {
            return Ok(true);
        }
        match self.store.stat(&key).await {
            Ok(_) => Ok(true),
            // A folder exists when some object lies under it.
            Err(StoreError::NotFound { .. }) => {
                self.store.has_children(&key).await.map_err(|e| store_error("checking a folder", e))
            }
            Err(e) => Err(store_error("checking a file", e)),
        }
    }

    async fn metadata(&self, path: &str) -> Result<FileMetadata> {
        let key = self.object_key(path)?;
        let info = self.store.stat(&key).await.map_err(|e| store_error("reading a file's size", e))?;
        Ok(FileMetadata { size: info.size })
    }

    async fn read(&self, path: &str) -> Result<Bytes> {
        let key = self.object_key(path)?;
        self.store.read(&key).await.map_err(|e| store_error("reading a file", e))
    }

    async fn reader(&self, path: &str) -> Result<Box<dyn FileRead>> {
        let key = self.object_key(path)?;
        Ok(Box::new(WarehouseRead { store: self.store.clone(), key }))
    }

    async fn write(&self, path: &str, bs: Bytes) -> Result<()> {
        let key = self.object_key(path)?;
        let what = "writing a file";
        let mut writer = self.store.writer(&key, false, DEFAULT_PART_SIZE).await.map_err(|e| store_error(what, e))?;
        writer.write(bs).await.map_err(|e| store_error(what, e))?;
        writer.finish().await.map_err(|e| store_error(what, e))?;
        Ok(())
    }

    async fn writer(&self, path: &str) -> Result<Box<dyn FileWrite>> {
        let key = self.object_key(path)?;
        let writer = self
            .store
            .writer(&key, false, DEFAULT_PART_SIZE)
            .await
            .map_err(|e| store_error("starting an upload", e))?;
        Ok(Box::new(WarehouseWrite { writer: Some(writer) }))
    }

    async fn delete(&self, path: &str) -> Result<()> {
        let key = self.object_key(path)?;
        self.store.delete(&key).await.map_err(|e| store_error("deleting a file", e))
    }

    /// Every object under the folder `path`, one by one (not atomically);
    /// an object named `path` itself is left alone, as on disk.
    async fn delete_prefix(&self, path: &str) -> Result<()> {
        let key = self.key(path)?;
        let objects = self.store.list(&key).await.map_err(|e| store_error("listing a folder", e))?;
        for object in objects {
            self.store.delete(&object.key).await.map_err(|e| store_error("deleting a file", e))?;
        }
        Ok(())
    }

    async fn delete_stream(&self, mut paths: BoxStream<'static, String>) -> Result<()> {
        while let Some(path) = paths.next().await {
            self.delete(&path).await?;
        }
        Ok(())
    }

    fn new_input(&self, path: &str) -> Result<InputFile> {
        self.object_key(path)?;
        Ok(InputFile::new(Arc::new(self.clone()), path.to_string()))
    }

    fn new_output(&self, path: &str) -> Result<OutputFile> {
        self.object_key(path)?;
        Ok(OutputFile::new(Arc::new(self.clone()), path.to_string()))
    }
}

/// Ranged reads of one object.
struct WarehouseRead {
    store: ObjectStore,
    key: String,
}

#[async_trait]
impl FileRead for WarehouseRead {
    async fn read(&self, range: Range<u64>) -> Result<Bytes> {
        let wanted = range.end.saturating_sub(range.start);
        let bytes = self
            .store
            .read_range(&self.key, range.start, wanted)
            .await
            .map_err(|e| store_error("reading a file", e))?;
        if bytes.len() as u64 != wanted {
            return Err(Error::new(
                ErrorKind::DataInvalid,
                format!(
                    "{}: asked for bytes {}..{}, the store sent {} (the object is shorter)",
                    self.store.url(&self.key),
                    range.start,
                    range.end,
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }
}

/// A streaming upload; dropped unclosed, it never becomes visible.
struct WarehouseWrite {
    /// `None` once closed.
    writer: Option<ObjectWriter>,
}

#[async_trait]
impl FileWrite for WarehouseWrite {
    async fn write(&mut self, bs: Bytes) -> Result<()> {
        let writer = self
            .writer
            .as_mut()
            .ok_or_else(|| Error::new(ErrorKind::Unexpected, "writing to an upload that is already closed"))?;
        writer.write(bs).await.map_err(|e| store_error("uploading a part", e))
    }

    async fn close(&mut self) -> Result<()> {
        let writer = self.writer.take().ok_or_else(|| Error::new(ErrorKind::Unexpected, "closing an upload twice"))?;
        writer.finish().await.map_err(|e| store_error("completing an upload", e))?;
        Ok(())
    }
}

/// Hands the SQL catalog's `FileIO` its [`WarehouseStorage`] (one bucket,
/// already set up), whatever the catalog's properties say.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(try_from = "Warehouse", into = "Warehouse")]
pub struct WarehouseStorageFactory {
    storage: WarehouseStorage,
    /// How `storage` reaches its store, for a `FileIO` whose properties
    /// carry credentials a REST catalog vended (see `catalog_vended`).
    stores: StoreConfig,
}

impl WarehouseStorageFactory {
    /// The factory of `storage`, opened with `stores`.
    pub fn new(storage: WarehouseStorage, stores: &StoreConfig) -> Self {
        Self { storage, stores: stores.clone() }
    }
}

impl From<WarehouseStorageFactory> for Warehouse {
    fn from(factory: WarehouseStorageFactory) -> Self {
        factory.storage.into()
    }
}

impl TryFrom<Warehouse> for WarehouseStorageFactory {
    type Error = String;

    fn try_from(w: Warehouse) -> std::result::Result<Self, String> {
        Ok(Self { storage: w.try_into()?, stores: StoreConfig::default() })
    }
}

#[typetag::serde(name = "SluiceWarehouseStorageFactory")]
impl StorageFactory for WarehouseStorageFactory {
    /// The warehouse's storage; signed with the S3 credentials in
    /// `config` when a REST catalog vended some with the table.
    fn build(&self, config: &StorageConfig) -> Result<Arc<dyn Storage>> {
        match super::catalog_vended::s3_credentials(config.props()) {
            Some(vended) if matches!(&self.storage.root, Location::ObjectStore { scheme: Scheme::S3, .. }) => {
                let stores = super::catalog_vended::with_credentials(&self.stores, &vended);
                let storage = WarehouseStorage::open(self.storage.root.clone(), &stores)
                    .map_err(|e| Error::new(ErrorKind::DataInvalid, format!("the vended credentials: {e}")))?;
                Ok(Arc::new(storage))
            }
            _ => Ok(Arc::new(self.storage.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn storage() -> WarehouseStorage {
        let root = Location::ObjectStore { scheme: Scheme::S3, bucket: "lake".into(), prefix: "wh".into() };
        let stores = StoreConfig {
            s3: sluice_store::S3Options {
                region: Some("us-east-1".into()),
                // Nothing listens here: these tests must refuse before any request.
                endpoint: Some("http://127.0.0.1:9".into()),
                ..Default::default()
            },
            ..StoreConfig::default()
        };
        WarehouseStorage::open(root, &stores).expect("storage")
    }

    #[test]
    fn locations_outside_the_warehouse_are_refused_before_any_request() {
        let s = storage();
        assert_eq!(s.key("s3://lake/wh/db/t/metadata/1.json").expect("inside"), "wh/db/t/metadata/1.json");
        for outside in [
            "s3://lake/wh-other/x",
            "s3://other/wh/x",
            "gs://lake/wh/x",
            "s3://lake/wh/../x",
            "s3://lake/wh/%2e%2e/x",
            "s3://lake/wh//x",
            "/tmp/wh/x",
            "file:///tmp/x",
        ] {
            let err = s.key(outside).expect_err(outside);
            assert!(err.to_string().contains(outside), "{err}");
        }
        assert!(s.new_output("s3://lake/wh").is_err(), "the root is not a file");
        assert!(s.new_output("s3://lake/elsewhere/m.json").is_err());
    }

    #[test]
    fn serializes_as_the_warehouse_url_alone() {
        let factory = WarehouseStorageFactory::new(storage(), &StoreConfig::default());
        let json = serde_json::to_string(&factory).expect("serialize");
        assert_eq!(json, r#"{"warehouse":"s3://lake/wh"}"#);
        // Deserialized, it reaches the store from the environment (a GCS
        // bucket needs no region to be set up; nothing is sent).
        let gcs: WarehouseStorageFactory =
            serde_json::from_str(r#"{"warehouse":"gs://lake/wh/"}"#).expect("deserialize");
        let root = Location::ObjectStore { scheme: Scheme::Gs, bucket: "lake".into(), prefix: "wh".into() };
        assert_eq!(gcs.storage.root, root);
        let err =
            serde_json::from_str::<WarehouseStorageFactory>(r#"{"warehouse":"s3://lake/../x"}"#).expect_err("bad");
        assert!(err.to_string().contains("s3://lake/../x"), "{err}");
    }
}
