//! The object-store requests an object-store state directory
//! ([`super::object_state`]) sends, and the clock its lease keeps time by,
//! each behind a small trait: production runs them on
//! [`sluice_store::ObjectStore`] and the real clock; tests run the same
//! lease and records in-process on a bucket in memory with injected faults
//! and a simulated clock (`super::objects_memory`).
//!
//! Invariants:
//! - every method of [`Objects`] is one request, sent and waited for. The
//!   outer `Err` of an [`Answer`] means no answer came back (the process's
//!   I/O runtime stopped; in tests, a reply lost): whether the request took
//!   effect is unknown. The inner result is the store's answer, with
//!   `sluice_store`'s meanings: an exclusive create, a compare-and-swap on
//!   a version token that never repeats, and no retry of its own;
//! - the implementation for [`ObjectStore`] forwards each call unchanged
//!   and waits for it on the host's one I/O runtime
//!   (`sluice_core::runtime`), as the state directory did before this
//!   trait: it adds no behaviour;
//! - [`Clock`] is the lease's monotonic clock (`now`), its waits (`sleep`)
//!   and the wall clock it writes into the lease (`now_ms`); production
//!   uses [`RealClock`] only.

use std::fmt::Debug;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_store::{ObjectInfo, ObjectStore, StoreError, Versioned};

use super::checkpoint::{CheckpointError, now_ms};

/// A request's outcome: `Err` when no answer came back (unknown whether
/// it took effect), else the store's answer.
pub(crate) type Answer<T> = Result<Result<T, StoreError>, CheckpointError>;

/// The requests of a state directory on an object store: those of
/// [`ObjectStore`] it uses, with the same meanings.
pub(crate) trait Objects: Send + Sync + Debug {
    /// `s3://bucket/key` (sends nothing).
    fn url(&self, key: &str) -> String;
    /// [`ObjectStore::create_exclusive`]
    fn create_exclusive(&self, key: &str, bytes: Bytes) -> Answer<Option<String>>;
    /// [`ObjectStore::replace_if`]
    fn replace_if(&self, key: &str, bytes: Bytes, etag: &str) -> Answer<Option<String>>;
    /// [`ObjectStore::read`]
    fn read(&self, key: &str) -> Answer<Bytes>;
    /// [`ObjectStore::read_versioned`]
    fn read_versioned(&self, key: &str) -> Answer<Versioned>;
    /// [`ObjectStore::stat`]
    fn stat(&self, key: &str) -> Answer<ObjectInfo>;
    /// [`ObjectStore::list`]
    fn list(&self, prefix: &str) -> Answer<Vec<ObjectInfo>>;
    /// [`ObjectStore::list_level`]
    fn list_level(&self, prefix: &str) -> Answer<Vec<String>>;
    /// [`ObjectStore::delete`]
    fn delete(&self, key: &str) -> Answer<()>;
}

/// Runs `fut` on the host's one I/O runtime and waits for it from this
/// thread (see `super::object_state`'s module doc for why one runtime).
pub(crate) fn block<T: Send + 'static>(fut: impl Future<Output = T> + Send + 'static) -> Result<T, CheckpointError> {
    sluice_core::runtime::wait(fut).map_err(|e| CheckpointError::Io {
        path: PathBuf::from("(object-store runtime)"),
        source: std::io::Error::other(e.to_string()),
    })
}

impl Objects for ObjectStore {
    fn url(&self, key: &str) -> String {
        ObjectStore::url(self, key)
    }

    fn create_exclusive(&self, key: &str, bytes: Bytes) -> Answer<Option<String>> {
        let (store, key) = (self.clone(), key.to_string());
        block(async move { store.create_exclusive(&key, bytes).await })
    }

    fn replace_if(&self, key: &str, bytes: Bytes, etag: &str) -> Answer<Option<String>> {
        let (store, key, etag) = (self.clone(), key.to_string(), etag.to_string());
        block(async move { store.replace_if(&key, bytes, &etag).await })
    }

    fn read(&self, key: &str) -> Answer<Bytes> {
        let (store, key) = (self.clone(), key.to_string());
        block(async move { store.read(&key).await })
    }

    fn read_versioned(&self, key: &str) -> Answer<Versioned> {
        let (store, key) = (self.clone(), key.to_string());
        block(async move { store.read_versioned(&key).await })
    }

    fn stat(&self, key: &str) -> Answer<ObjectInfo> {
        let (store, key) = (self.clone(), key.to_string());
        block(async move { store.stat(&key).await })
    }

    fn list(&self, prefix: &str) -> Answer<Vec<ObjectInfo>> {
        let (store, prefix) = (self.clone(), prefix.to_string());
        block(async move { store.list(&prefix).await })
    }

    fn list_level(&self, prefix: &str) -> Answer<Vec<String>> {
        let (store, prefix) = (self.clone(), prefix.to_string());
        block(async move { store.list_level(&prefix).await })
    }

    fn delete(&self, key: &str) -> Answer<()> {
        let (store, key) = (self.clone(), key.to_string());
        block(async move { store.delete(&key).await })
    }
}

/// The clocks the lease keeps time by.
pub(crate) trait Clock: Send + Sync + Debug {
    /// This process's monotonic clock: the only one a lease's age is
    /// measured by.
    fn now(&self) -> Instant;
    /// Milliseconds since the Unix epoch, written into the lease for
    /// people and `sluice maintain` to read.
    fn now_ms(&self) -> u64;
    /// Waits `d` (between polls and retries).
    fn sleep(&self, d: Duration);
}

/// The real clocks: [`Instant`], [`now_ms`] and [`std::thread::sleep`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RealClock;

impl Clock for RealClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn now_ms(&self) -> u64 {
        now_ms()
    }

    fn sleep(&self, d: Duration) {
        std::thread::sleep(d);
    }
}
