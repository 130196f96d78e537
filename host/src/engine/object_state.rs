//! A job's state directory on an object store (`job.state_dir =
//! "s3://bucket/prefix"`), behind [`super::checkpoint::CheckpointStore`].
//!
//! Layout under the prefix: `checkpoints/chk-<c>-<seq>.json` (the records),
//! `attempt`, `incarnation`, `halted` (small state files) and `lease`.
//!
//! Invariants:
//! - a record is one object, created exclusively (`If-None-Match: *`) and
//!   never overwritten: re-persisting checkpoint `c` (its pending commits
//!   settled) creates `chk-<c>-<seq+1>`, and the highest sequence of the
//!   highest checkpoint is the newest record. An exclusive create that finds
//!   its object taken means another run writes here: this run stops;
//! - a small state file is replaced only by compare-and-swap on the ETag it
//!   was read with (created exclusively when absent);
//! - one run at a time holds the state directory, by a lease object: taken
//!   by exclusive create, or by compare-and-swap over a lease that expired
//!   (released, or watched unrenewed for its whole length on this run's
//!   monotonic clock: another host's wall clock is never trusted); renewed by compare-and-swap every third of its length by a
//!   background thread and before every write and commit. A run that sees
//!   the lease renewed while it waits refuses, naming the holder; a run
//!   whose compare-and-swap fails, or that could not renew within the lease,
//!   has lost it and writes nothing more;
//! - a run that ends releases its lease (expired at once) so the next run
//!   need not wait; a killed one leaves it to expire;
//! - credentials and endpoint come from the standard AWS environment
//!   (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`, ...), through
//!   `sluice-store`.
//!
//! The engine is synchronous here: the store's futures run on a runtime of
//! this module's own, and callers wait on a channel, so this works whether
//! or not the caller is inside another tokio runtime.

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sluice_store::{ObjectStore, S3Options, StoreError};
use tokio::runtime::Handle;

use super::checkpoint::{CheckpointError, StateFile, now_ms};
use crate::location::Scheme;

const LEASE_KEY: &str = "lease";
const RECORDS: &str = "checkpoints";

/// The lease object's contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseDoc {
    /// Which run holds it: `pid <n> on <host> (<token>)`.
    holder: String,
    lease_ms: u64,
    /// Milliseconds since the Unix epoch; 0 once released.
    expires_at_ms: u64,
}

/// What a run knows of the lease it holds.
#[derive(Debug)]
struct HeldState {
    etag: String,
    /// When the last successful renewal was sent.
    renewed: Instant,
    /// Why the lease is lost, once it is.
    lost: Option<String>,
}

#[derive(Debug)]
struct Held {
    key: String,
    url: String,
    holder: String,
    lease: Duration,
    state: Mutex<HeldState>,
}

/// A state directory on an object store, with its lease when opened to write.
#[derive(Debug)]
pub(super) struct ObjectState {
    store: ObjectStore,
    /// `s3://bucket/prefix`
    url: String,
    prefix: String,
    runtime: Option<tokio::runtime::Runtime>,
    handle: Handle,
    held: Option<Arc<Held>>,
    renewer: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

/// Runs `fut` on `handle`'s runtime and waits for it from this thread.
fn block<T: Send + 'static>(
    handle: &Handle,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T, CheckpointError> {
    let (tx, rx) = mpsc::sync_channel(1);
    handle.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().map_err(|_| CheckpointError::Io {
        path: PathBuf::from("(object-store runtime)"),
        source: std::io::Error::other("the runtime of the state directory's store stopped"),
    })
}

fn when(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64).map_or_else(|| format!("{ms} ms"), |t| t.to_rfc3339())
}

fn no_etag(url: &str) -> CheckpointError {
    CheckpointError::Store(StoreError::Config {
        url: url.to_string(),
        message: "the store sent no ETag, which the state directory's compare-and-swap needs".into(),
    })
}

/// `chk-<c>-<seq>.json`
fn record_name(c: u64, seq: u64) -> String {
    format!("chk-{c:020}-{seq:06}.json")
}

fn parse_record_name(name: &str) -> Option<(u64, u64)> {
    let (c, seq) = name.strip_prefix("chk-")?.strip_suffix(".json")?.split_once('-')?;
    Some((c.parse().ok()?, seq.parse().ok()?))
}

impl ObjectState {
    /// Opens the state directory at `bucket`/`prefix`; with `lease`, takes
    /// the lease (waiting out a lease nobody renews) and keeps renewing it.
    pub(super) fn open(
        scheme: Scheme,
        bucket: &str,
        prefix: &str,
        lease: Option<Duration>,
    ) -> Result<Self, CheckpointError> {
        let url = if prefix.is_empty() { format!("{scheme}{bucket}") } else { format!("{scheme}{bucket}/{prefix}") };
        let store = match scheme {
            Scheme::S3 => ObjectStore::s3(bucket, &S3Options::default())?,
            // job.rs refuses it: there is no compare-and-swap for a lease on GCS.
            Scheme::Gs => {
                return Err(CheckpointError::Store(StoreError::Config {
                    url,
                    message: "a state directory on GCS is not served (no conditional replace for the lease)".into(),
                }));
            }
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("sluice-state")
            .enable_all()
            .build()
            .map_err(|source| CheckpointError::Io { path: PathBuf::from(&url), source })?;
        let handle = runtime.handle().clone();
        let mut state =
            Self { store, url, prefix: prefix.to_string(), runtime: Some(runtime), handle, held: None, renewer: None };
        if let Some(lease) = lease {
            state.take_lease(lease)?;
        }
        Ok(state)
    }

    fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() { name.to_string() } else { format!("{}/{name}", self.prefix) }
    }

    pub(super) fn url(&self) -> &str {
        &self.url
    }

    pub(super) fn file_url(&self, file: StateFile) -> String {
        self.store.url(&self.key(file.name()))
    }

    pub(super) fn records_url(&self) -> String {
        self.store.url(&self.key(RECORDS))
    }

    /// Where the records of checkpoint `c` go (`chk-<c>-*.json`).
    pub(super) fn record_url(&self, c: u64) -> String {
        format!("{}/chk-{c:020}-*.json", self.records_url())
    }

    fn run<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T, CheckpointError> {
        block(&self.handle, fut)
    }

    /// Nothing is stored under the prefix yet.
    pub(super) fn is_empty(&self) -> Result<bool, CheckpointError> {
        let store = self.store.clone();
        let prefix = self.prefix.clone();
        Ok(self.run(async move { store.list(&prefix).await })??.is_empty())
    }

    pub(super) fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        let store = self.store.clone();
        let key = self.key(file.name());
        match self.run(async move { store.read(&key).await })? {
            Ok(bytes) => Ok(Some(bytes.to_vec())),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Replaces `file` by compare-and-swap on the ETag it is read with
    /// (creates it exclusively when absent).
    pub(super) fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        let store = self.store.clone();
        let key = self.key(file.name());
        let bytes = Bytes::from(bytes);
        self.run(async move {
            match store.read_versioned(&key).await {
                Ok(v) => store.replace_if(&key, bytes, &v.etag).await.map(drop),
                Err(StoreError::NotFound { .. }) => store.create_exclusive(&key, bytes).await.map(drop),
                Err(e) => Err(e),
            }
        })?
        .map_err(|e| match e {
            StoreError::Conflict { url, .. } | StoreError::AlreadyExists { url } => CheckpointError::LeaseLost {
                url: self.url.clone(),
                reason: format!("{url} was written by another run meanwhile"),
            },
            e => e.into(),
        })
    }

    /// Every record's `(checkpoint, sequence)`, newest first.
    fn records(&self) -> Result<Vec<(u64, u64)>, CheckpointError> {
        let store = self.store.clone();
        let dir = self.key(RECORDS);
        let listed = self.run(async move { store.list(&dir).await })??;
        let mut out: Vec<(u64, u64)> =
            listed.iter().filter_map(|o| o.key.rsplit('/').next().and_then(parse_record_name)).collect();
        out.sort_unstable_by(|a, b| b.cmp(a));
        Ok(out)
    }

    /// Checkpoint ids present, newest first.
    pub(super) fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        let mut ids: Vec<u64> = self.records()?.into_iter().map(|(c, _)| c).collect();
        ids.dedup();
        Ok(ids)
    }

    /// The newest record of checkpoint `c`.
    pub(super) fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        let seq = self.records()?.into_iter().find(|&(rc, _)| rc == c).map_or(0, |(_, s)| s);
        let key = self.key(&format!("{RECORDS}/{}", record_name(c, seq)));
        let url = self.store.url(&key);
        let store = self.store.clone();
        let bytes = self.run(async move { store.read(&key).await })??;
        Ok((PathBuf::from(url), bytes.to_vec()))
    }

    /// Creates the next record of checkpoint `c`, exclusively; then removes
    /// the ones it supersedes.
    pub(super) fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        let older: Vec<u64> = self.records()?.into_iter().filter(|&(rc, _)| rc == c).map(|(_, s)| s).collect();
        let seq = older.first().map_or(0, |s| s + 1);
        let key = self.key(&format!("{RECORDS}/{}", record_name(c, seq)));
        let url = self.store.url(&key);
        let store = self.store.clone();
        let created = self.run(async move { store.create_exclusive(&key, Bytes::from(bytes)).await })?;
        match created {
            Ok(_) => {}
            Err(StoreError::AlreadyExists { url }) => {
                return Err(CheckpointError::LeaseLost {
                    url: self.url.clone(),
                    reason: format!("{url} was created by another run"),
                });
            }
            Err(e) => return Err(e.into()),
        }
        for s in older {
            self.delete_key(self.key(&format!("{RECORDS}/{}", record_name(c, s))));
        }
        Ok(PathBuf::from(url))
    }

    /// Removes every record of checkpoint `c` (retention), best effort.
    pub(super) fn delete_record(&self, c: u64) {
        match self.records() {
            Ok(records) => {
                for (_, s) in records.into_iter().filter(|&(rc, _)| rc == c) {
                    self.delete_key(self.key(&format!("{RECORDS}/{}", record_name(c, s))));
                }
            }
            Err(e) => tracing::warn!(error = %e, "could not list old checkpoint records to prune"),
        }
    }

    fn delete_key(&self, key: String) {
        let store = self.store.clone();
        let url = self.store.url(&key);
        match self.run(async move { store.delete(&key).await }) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(url = %url, error = %e, "could not prune old checkpoint record"),
            Err(e) => tracing::warn!(url = %url, error = %e, "could not prune old checkpoint record"),
        }
    }

    /// Takes the lease: creates it, or takes over one that expired; refuses
    /// while another run renews it. Then starts renewing it.
    fn take_lease(&mut self, lease: Duration) -> Result<(), CheckpointError> {
        let key = self.key(LEASE_KEY);
        let lease_url = self.store.url(&key);
        let token = getrandom::u32().unwrap_or(0);
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_string()))
            .unwrap_or_else(|| "?".to_string());
        let holder = format!("pid {} on {host} ({token:08x})", std::process::id());
        let lease_ms = lease.as_millis() as u64;
        let doc = |expires_at_ms| {
            serde_json::to_vec(&LeaseDoc { holder: holder.clone(), lease_ms, expires_at_ms }).map(Bytes::from)
        };
        let poll = (lease / 10).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let started = Instant::now();
        // The other run's lease as first seen: its ETag, and when it expires
        // by this run's clock if it stays unrenewed.
        let mut watched: Option<(String, Instant)> = None;
        let mut previous: Option<String> = None;
        let etag = loop {
            let store = self.store.clone();
            let k = key.clone();
            let sent = Instant::now();
            let ours = doc(now_ms() + lease_ms)
                .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(&lease_url), source })?;
            let read = self.run(async move { store.read_versioned(&k).await })?;
            let theirs = match read {
                Err(StoreError::NotFound { .. }) => {
                    let store = self.store.clone();
                    let k = key.clone();
                    match self.run(async move { store.create_exclusive(&k, ours).await })? {
                        Ok(etag) => break (etag.ok_or_else(|| no_etag(&lease_url))?, sent),
                        Err(StoreError::AlreadyExists { .. } | StoreError::Contended { .. }) => {
                            std::thread::sleep(poll);
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => return Err(e.into()),
                Ok(v) => v,
            };
            let doc: LeaseDoc = serde_json::from_slice(&theirs.bytes)
                .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(&lease_url), source })?;
            // Another host's wall clock is not this one's: the holder's
            // `expires_at_ms` means nothing here but "released" (0). A live
            // lease has expired only once this run watched it unrenewed for
            // its whole length, on its own monotonic clock.
            let expired = doc.expires_at_ms == 0
                || match &watched {
                    None => {
                        let left = Duration::from_millis(doc.lease_ms);
                        watched = Some((theirs.etag.clone(), Instant::now() + left));
                        false
                    }
                    Some((etag, deadline)) if *etag == theirs.etag => Instant::now() >= *deadline,
                    Some(_) => {
                        return Err(CheckpointError::Leased {
                            url: self.url.clone(),
                            holder: doc.holder,
                            expires: when(doc.expires_at_ms),
                        });
                    }
                };
            if !expired {
                std::thread::sleep(poll);
                continue;
            }
            let store = self.store.clone();
            let k = key.clone();
            let etag = theirs.etag.clone();
            match self.run(async move { store.replace_if(&k, ours, &etag).await })? {
                Ok(etag) => {
                    if doc.expires_at_ms != 0 {
                        previous = Some(doc.holder);
                    }
                    break (etag.ok_or_else(|| no_etag(&lease_url))?, sent);
                }
                // Someone wrote it meanwhile: look again, afresh.
                Err(StoreError::Conflict { .. } | StoreError::Contended { .. }) => watched = None,
                Err(e) => return Err(e.into()),
            }
        };
        let (etag, renewed) = etag;
        match previous {
            Some(previous) => tracing::info!(
                state_dir = %self.url,
                previous = %previous,
                waited_ms = started.elapsed().as_millis() as u64,
                "took over the state directory's lease after it expired unrenewed (the run holding it had stopped)"
            ),
            None => tracing::debug!(state_dir = %self.url, holder = %holder, "took the state directory's lease"),
        }
        let held = Arc::new(Held {
            key,
            url: self.url.clone(),
            holder,
            lease,
            state: Mutex::new(HeldState { etag, renewed, lost: None }),
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let renewing = held.clone();
        let store = self.store.clone();
        let handle = self.handle.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-lease".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(renewing.lease / 3) {
                    if let Err(e) = renew(&renewing, &store, &handle) {
                        tracing::warn!(error = %e, "could not renew the state directory's lease");
                        if lost(&renewing) {
                            return;
                        }
                    }
                }
            })
            .map_err(|source| CheckpointError::Io { path: PathBuf::from(&self.url), source })?;
        self.held = Some(held);
        self.renewer = Some((stop, thread));
        Ok(())
    }

    /// Renews the lease now; an error once it is lost.
    pub(super) fn check_held(&self) -> Result<(), CheckpointError> {
        let Some(held) = &self.held else { return Ok(()) };
        match renew(held, &self.store, &self.handle) {
            Ok(()) => Ok(()),
            Err(e) if lost(held) => Err(e),
            Err(e) => {
                // A transient failure: the lease still holds for a while.
                let state = held.state.lock().map_err(|_| poisoned(held))?;
                if state.renewed.elapsed() < held.lease * 2 / 3 {
                    tracing::warn!(error = %e, "could not renew the state directory's lease; it still holds");
                    Ok(())
                } else {
                    Err(CheckpointError::LeaseLost {
                        url: held.url.clone(),
                        reason: format!("it could not be renewed in time: {e}"),
                    })
                }
            }
        }
    }
}

fn poisoned(held: &Held) -> CheckpointError {
    CheckpointError::LeaseLost { url: held.url.clone(), reason: "its renewal panicked".into() }
}

fn lost(held: &Held) -> bool {
    held.state.lock().map_or(true, |s| s.lost.is_some())
}

/// Renews `held` by compare-and-swap; a failed swap loses it for good, and so
/// does a renewal later than the lease.
fn renew(held: &Held, store: &ObjectStore, handle: &Handle) -> Result<(), CheckpointError> {
    let mut state = held.state.lock().map_err(|_| poisoned(held))?;
    let lost = |reason: String| CheckpointError::LeaseLost { url: held.url.clone(), reason };
    if let Some(reason) = &state.lost {
        return Err(lost(reason.clone()));
    }
    if state.renewed.elapsed() >= held.lease {
        let reason =
            format!("it was last renewed {:.1}s ago, longer than the lease", state.renewed.elapsed().as_secs_f64());
        state.lost = Some(reason.clone());
        return Err(lost(reason));
    }
    let lease_ms = held.lease.as_millis() as u64;
    let doc = LeaseDoc { holder: held.holder.clone(), lease_ms, expires_at_ms: now_ms() + lease_ms };
    let bytes = serde_json::to_vec(&doc)
        .map(Bytes::from)
        .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(store.url(&held.key)), source })?;
    let sent = Instant::now();
    let (s, key, etag) = (store.clone(), held.key.clone(), state.etag.clone());
    match block(handle, async move { s.replace_if(&key, bytes, &etag).await })? {
        Ok(Some(etag)) => {
            state.etag = etag;
            state.renewed = sent;
            Ok(())
        }
        Ok(None) => Err(no_etag(&store.url(&held.key))),
        Err(StoreError::Conflict { url, .. }) => {
            let (s, key) = (store.clone(), held.key.clone());
            let now_held = block(handle, async move { s.read(&key).await })
                .ok()
                .and_then(|r| r.ok())
                .and_then(|b| serde_json::from_slice::<LeaseDoc>(&b).ok())
                .map_or_else(|| "someone else".to_string(), |d| d.holder);
            let reason = format!("its compare-and-swap on {url} failed: {now_held} holds it now");
            state.lost = Some(reason.clone());
            Err(lost(reason))
        }
        Err(e) => Err(e.into()),
    }
}

impl Drop for ObjectState {
    fn drop(&mut self) {
        if let Some((stop, thread)) = self.renewer.take() {
            drop(stop);
            let _ = thread.join();
        }
        // Release the lease (expired at once) unless it was lost.
        if let Some(held) = self.held.take()
            && let Ok(state) = held.state.lock()
            && state.lost.is_none()
        {
            let doc =
                LeaseDoc { holder: held.holder.clone(), lease_ms: held.lease.as_millis() as u64, expires_at_ms: 0 };
            if let Ok(bytes) = serde_json::to_vec(&doc) {
                let (s, key, etag) = (self.store.clone(), held.key.clone(), state.etag.clone());
                match block(&self.handle, async move { s.replace_if(&key, Bytes::from(bytes), &etag).await }) {
                    Ok(Ok(_)) => tracing::debug!(state_dir = %held.url, "released the state directory's lease"),
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not release the state directory's lease"),
                    Err(e) => tracing::warn!(error = %e, "could not release the state directory's lease"),
                }
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}
