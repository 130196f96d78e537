//! A job's state directory on an object store (`job.state_dir =
//! "s3://bucket/prefix"` or `"gs://bucket/prefix"`), behind
//! [`super::checkpoint::CheckpointStore`].
//!
//! Layout under the prefix: `lease`, and the state of each holding epoch in
//! `epoch-<e>/`: `checkpoints/chk-<c>-<seq>.json` (the records), `attempt`,
//! `incarnation` and `halted` (small state files).
//!
//! Invariants:
//! - a record is one object, created exclusively (`If-None-Match: *` on S3,
//!   `ifGenerationMatch=0` on GCS) and never overwritten: re-persisting checkpoint `c` (its pending commits
//!   settled) creates `chk-<c>-<seq+1>`, and the highest sequence of the
//!   highest checkpoint is the newest record. An exclusive create that finds
//!   its object taken means another run writes here: this run stops;
//! - a small state file is replaced only by compare-and-swap on the version
//!   it was read with (created exclusively when absent). The version is the
//!   store's token (`sluice-store`): the ETag on S3 (`If-Match`), the
//!   generation on GCS (`ifGenerationMatch`); "ETag" below means that token;
//! - one run at a time holds the state directory, by a lease object: taken
//!   by exclusive create, or by compare-and-swap over a lease that expired
//!   (released, or watched unrenewed for its whole length on this run's
//!   monotonic clock: another host's wall clock is never trusted); renewed
//!   by compare-and-swap every third of its length by a background thread
//!   and before every write and commit, where the renewal must be confirmed
//!   (a transient failure is retried, never let pass: a holder whose clock
//!   did not count a suspend would otherwise commit a record written after
//!   a takeover copied its folder; nor is a renewal answered a lease or
//!   more after it was sent: the lease is lost). A run that sees the lease renewed
//!   while it waits refuses, naming the holder; a run whose
//!   compare-and-swap fails (on a lease it did not write itself: one whose
//!   renewal landed with its reply lost renews over it), or that could not
//!   renew within the lease, has lost it and writes nothing more;
//! - **fencing:** a check before a write is not part of the write, so a
//!   holder paused (SIGSTOP, a long GC, a frozen VM) between its last
//!   renewal and its write may land that write after another run took the
//!   lease over. So each taking of the lease starts a new epoch (the
//!   lease's `epoch`, raised by the very compare-and-swap that takes it),
//!   and a run writes only under its own `epoch-<e>/`. The lease's
//!   `current` names the epoch whose folder holds the state: a run that
//!   takes over copies the state of `current` into its own folder, and only
//!   then swaps `current` to its epoch (by the renewal's compare-and-swap).
//!   What a former holder writes or deletes after that copy lands in a
//!   folder nobody reads again; what it wrote before is a true record of
//!   what it did (persist before commit), taken over as if it came before
//!   the takeover. Every instant of a folder holds a whole newest record (a
//!   record is created before the ones it supersedes are removed), and a
//!   copy that finds a listed object gone starts over. A commit a former
//!   holder lands after the takeover (frozen between its last check and the
//!   commit) is of a record the new holder copied: the same combined commit
//!   under the same idempotence key, so whichever comes second finds it
//!   committed. A record written after the copy is never committed by the
//!   former holder: its check before the commit finds the lease lost (last
//!   renewed longer ago than the lease, by a clock that counted the freeze,
//!   or its compare-and-swap failing on the takeover's);
//! - a finished copy is marked by a `copied` object created last in the new
//!   folder: without a lease naming `current` (deleted by hand), the state
//!   is the highest folder so marked, never a partial copy left by a run
//!   killed mid-takeover;
//! - the swap of `current` must land before the old folder is removed or
//!   anything is written in the new one: a transient failure there is tried
//!   again until the lease would lapse, then the run stops (the old folder
//!   stays, still current). A renewal finding the lease object gone (deleted
//!   by hand) has lost it: any run may create it at once;
//! - a run that ends releases its lease (expired at once, `current` kept) so
//!   the next run need not wait; a killed one leaves it to expire;
//! - credentials and endpoint come from the job's `[job.s3]` / `[job.gcs]`,
//!   else the platform's standard environment, through `sluice-store`: on
//!   S3 the AWS one (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//!   ...); on GCS Application Default Credentials, or, with
//!   `STORAGE_EMULATOR_HOST` set, that emulator, unsigned, as Google's
//!   client libraries do.
//!
//! Every request goes through [`super::objects::Objects`] (one request,
//! sent and waited for) and every reading of time through its `Clock`:
//! production sends them to `sluice_store` on the real clock; the unit
//! tests (`lease_tests.rs`) run this same lease in-process on a bucket in
//! memory with injected faults and a simulated clock.
//!
//! The engine is synchronous here: the store's futures run on the host's
//! one I/O runtime (`sluice_core::runtime`), and callers wait on a channel, so this works whether
//! or not the caller is inside another tokio runtime. That runtime is one
//! for the process and is never shut down: an HTTP client pools connections
//! whose tasks live on the runtime that opened them, and a runtime dropped
//! with a state directory broke the requests of the next one in the same
//! process while they shared opendal's process-wide client ("dispatch task
//! is gone", or a write cut off after it was sent). Each store has a client
//! of its own now (`sluice-store`); one runtime keeps it so whatever else
//! shares a connection.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sluice_store::{ObjectStore, StoreError, StoreOptions};

use super::checkpoint::{CheckpointError, StateBackend, StateFile, now_ms};
use super::objects::{Clock, Objects, RealClock};
use crate::location::Scheme;

const LEASE_KEY: &str = "lease";
const RECORDS: &str = "checkpoints";
/// Created in an epoch's folder once the state taken over is wholly copied
/// in: without a lease to name `current`, only such a folder is the state
/// (a takeover killed mid-copy leaves a partial folder of a newer epoch).
const COPIED: &str = "copied";

/// The lease object's contents.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct LeaseDoc {
    /// Which run holds it: `pid <n> on <host> (<token>)`.
    holder: String,
    lease_ms: u64,
    /// Milliseconds since the Unix epoch; 0 once released.
    expires_at_ms: u64,
    /// Raised by each taking of the lease: its holder writes only under
    /// `epoch-<epoch>/`.
    #[serde(default)]
    epoch: u64,
    /// The epoch whose folder holds the state; absent in a lease written by
    /// hand, when the newest folder does.
    #[serde(default)]
    current: Option<u64>,
}

/// What a run knows of the lease it holds.
#[derive(Debug)]
struct HeldState {
    etag: String,
    /// When the last successful renewal was sent.
    renewed: Instant,
    /// Why the lease is lost, once it is.
    lost: Option<String>,
    /// The epoch whose folder holds the state (this run's own, once it
    /// copied the state it took over).
    current: u64,
}

#[derive(Debug)]
struct Held {
    key: String,
    url: String,
    holder: String,
    lease: Duration,
    /// This run's epoch.
    epoch: u64,
    /// The clock the lease's age is measured by.
    clock: Arc<dyn Clock>,
    state: Mutex<HeldState>,
}

impl Held {
    fn doc(&self, expires_at_ms: u64, current: u64) -> LeaseDoc {
        LeaseDoc {
            holder: self.holder.clone(),
            lease_ms: self.lease.as_millis() as u64,
            expires_at_ms,
            epoch: self.epoch,
            current: Some(current),
        }
    }
}

/// A state directory on an object store, with its lease when opened to write.
#[derive(Debug)]
pub(super) struct ObjectState {
    store: Arc<dyn Objects>,
    clock: Arc<dyn Clock>,
    /// `s3://bucket/prefix`
    url: String,
    prefix: String,
    /// The key of the folder of the epoch that holds the state.
    base: String,
    held: Option<Arc<Held>>,
    renewer: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
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

/// How often a takeover's copy of the state starts over when an object it
/// listed is gone before it is read (a former holder superseding a record).
const COPY_TRIES: usize = 8;

/// `epoch-<e>`
fn epoch_name(e: u64) -> String {
    format!("epoch-{e:06}")
}

fn parse_epoch_name(name: &str) -> Option<u64> {
    name.strip_prefix("epoch-")?.parse().ok()
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
        stores: &StoreOptions,
    ) -> Result<Self, CheckpointError> {
        let url = if prefix.is_empty() { format!("{scheme}{bucket}") } else { format!("{scheme}{bucket}/{prefix}") };
        let store = ObjectStore::of(scheme, bucket, stores)?;
        Self::open_on(Arc::new(store), Arc::new(RealClock), url, prefix, lease, true)
    }

    /// [`Self::open`] on `store`, by `clock`; `renewer`: whether a thread
    /// renews the lease in the background (always, but in tests, which
    /// renew by hand to keep the order of events theirs).
    fn open_on(
        store: Arc<dyn Objects>,
        clock: Arc<dyn Clock>,
        url: String,
        prefix: &str,
        lease: Option<Duration>,
        renewer: bool,
    ) -> Result<Self, CheckpointError> {
        let mut state =
            Self { store, clock, url, prefix: prefix.to_string(), base: String::new(), held: None, renewer: None };
        match lease {
            Some(lease) => state.take_lease(lease, renewer)?,
            None => {
                // A read-only view: the folder the lease names, else the newest.
                let current = match state.read_lease()? {
                    Some((doc, _)) => doc.current,
                    None => None,
                };
                let current = match current {
                    Some(c) => c,
                    None => state.newest_whole_epoch()?,
                };
                state.base = state.root_key(&epoch_name(current));
            }
        }
        Ok(state)
    }

    /// The key of `name` directly under the prefix.
    fn root_key(&self, name: &str) -> String {
        if self.prefix.is_empty() { name.to_string() } else { format!("{}/{name}", self.prefix) }
    }

    /// The key of `name` in the folder that holds the state.
    fn key(&self, name: &str) -> String {
        format!("{}/{name}", self.base)
    }

    /// The lease object and its ETag, if there is one.
    fn read_lease(&self) -> Result<Option<(LeaseDoc, String)>, CheckpointError> {
        let key = self.root_key(LEASE_KEY);
        let url = self.store.url(&key);
        match self.store.read_versioned(&key)? {
            Ok(v) => serde_json::from_slice(&v.bytes)
                .map(|doc| Some((doc, v.etag)))
                .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(url), source }),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Every epoch with a folder under the prefix, highest first.
    fn epochs(&self) -> Result<Vec<u64>, CheckpointError> {
        let names = self.store.list_level(&self.prefix)??;
        let mut epochs: Vec<u64> = names.iter().filter_map(|n| parse_epoch_name(n)).collect();
        epochs.sort_unstable_by(|a, b| b.cmp(a));
        Ok(epochs)
    }

    /// The highest epoch with a folder under the prefix (0 when none): the
    /// next epoch is above it.
    fn newest_epoch(&self) -> Result<u64, CheckpointError> {
        Ok(self.epochs()?.first().copied().unwrap_or(0))
    }

    /// The state's folder when no lease names it: the highest epoch whose
    /// folder a takeover finished copying (its `copied` marker), never a
    /// partial copy left by a run killed mid-takeover; when no folder has a
    /// marker (written before markers were), the highest.
    fn newest_whole_epoch(&self) -> Result<u64, CheckpointError> {
        let epochs = self.epochs()?;
        for &e in &epochs {
            let key = format!("{}/{COPIED}", self.root_key(&epoch_name(e)));
            match self.store.stat(&key)? {
                Ok(_) => return Ok(e),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(epochs.first().copied().unwrap_or(0))
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

    /// Nothing is stored under the prefix yet.
    pub(super) fn is_empty(&self) -> Result<bool, CheckpointError> {
        Ok(self.store.list(&self.prefix)??.is_empty())
    }

    pub(super) fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        let key = self.key(file.name());
        match self.store.read(&key)? {
            Ok(bytes) => Ok(Some(bytes.to_vec())),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Replaces `file` by compare-and-swap on the ETag it is read with
    /// (creates it exclusively when absent).
    pub(super) fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        let key = self.key(file.name());
        let bytes = Bytes::from(bytes);
        let written = match self.store.read_versioned(&key)? {
            Ok(v) => self.store.replace_if(&key, bytes, &v.etag)?.map(drop),
            Err(StoreError::NotFound { .. }) => self.store.create_exclusive(&key, bytes)?.map(drop),
            Err(e) => Err(e),
        };
        written.map_err(|e| match e {
            StoreError::Conflict { url, .. } | StoreError::AlreadyExists { url } => CheckpointError::LeaseLost {
                url: self.url.clone(),
                reason: format!("{url} was written by another run meanwhile"),
            },
            e => e.into(),
        })
    }

    /// Every record's `(checkpoint, sequence)`, newest first.
    fn records(&self) -> Result<Vec<(u64, u64)>, CheckpointError> {
        let listed = self.store.list(&self.key(RECORDS))??;
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
        let bytes = self.store.read(&key)??;
        Ok((PathBuf::from(url), bytes.to_vec()))
    }

    /// Creates the next record of checkpoint `c`, exclusively; then removes
    /// the ones it supersedes.
    ///
    /// Outcomes: a failure to list or a refusal before the request is sent
    /// (no credentials, access denied, a bad key) wrote nothing; any other
    /// failure of the create (a 5xx, a timeout, a reply lost) may have
    /// stored it, and is an unknown outcome. An exclusive create that finds
    /// the object there is read back: the very bytes mean an earlier try
    /// of this same create was stored (its reply was lost, and the store
    /// client tried again), so the record is durable; other bytes mean
    /// another run writes here, and this run stops without releasing
    /// anything (the other run's record may not name this one's files, but
    /// orphan cleanup, not this run, decides that).
    pub(super) fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        // A test may freeze the process here, between the persist's lease
        // check and the record's write.
        crate::fault::pause_here(crate::fault::PausePoint::BeforeRecord, c);
        let older: Vec<u64> = self.records()?.into_iter().filter(|&(rc, _)| rc == c).map(|(_, s)| s).collect();
        let seq = older.first().map_or(0, |s| s + 1);
        let key = self.key(&format!("{RECORDS}/{}", record_name(c, seq)));
        let url = self.store.url(&key);
        let body = Bytes::from(bytes);
        let created = self.store.create_exclusive(&key, body.clone()).map_err(|e| e.unknown(&url))?;
        match created {
            Ok(_) => {}
            Err(StoreError::AlreadyExists { .. }) => {
                let found = self.store.read(&key).map_err(|e| e.unknown(&url))?;
                match found {
                    Ok(found) if found == body => {
                        tracing::info!(url = %url, "the checkpoint record was stored by an earlier try of this write");
                    }
                    Ok(_) => {
                        return Err(CheckpointError::LeaseLost {
                            url: self.url.clone(),
                            reason: format!("{url} was created by another run"),
                        }
                        .unknown(&url));
                    }
                    Err(e) => return Err(CheckpointError::from(e).unknown(&url)),
                }
            }
            Err(
                e @ (StoreError::Denied { .. }
                | StoreError::Config { .. }
                | StoreError::NoCredentials { .. }
                | StoreError::InvalidKey { .. }
                | StoreError::Unsupported { .. }),
            ) => return Err(e.into()),
            Err(e) => return Err(CheckpointError::from(e).unknown(&url)),
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
        let url = self.store.url(&key);
        match self.store.delete(&key) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(url = %url, error = %e, "could not prune old checkpoint record"),
            Err(e) => tracing::warn!(url = %url, error = %e, "could not prune old checkpoint record"),
        }
    }

    /// Takes the lease: creates it, or takes over one that expired; refuses
    /// while another run renews it. Then starts renewing it, and moves the
    /// state into this run's epoch folder (see the fencing invariant).
    fn take_lease(&mut self, lease: Duration, renewer: bool) -> Result<(), CheckpointError> {
        let key = self.root_key(LEASE_KEY);
        let lease_url = self.store.url(&key);
        let token = getrandom::u32().unwrap_or(0);
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|h| h.trim().to_string()))
            .unwrap_or_else(|| "?".to_string());
        let holder = format!("pid {} on {host} ({token:08x})", std::process::id());
        let lease_ms = lease.as_millis() as u64;
        let clock = self.clock.clone();
        let doc = |epoch: u64, current: u64| {
            serde_json::to_vec(&LeaseDoc {
                holder: holder.clone(),
                lease_ms,
                expires_at_ms: clock.now_ms() + lease_ms,
                epoch,
                current: Some(current),
            })
            .map(Bytes::from)
            .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(&lease_url), source })
        };
        let poll = (lease / 10).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let started = self.clock.now();
        // The other run's lease as first seen: its ETag, and when it expires
        // by this run's clock if it stays unrenewed.
        let mut watched: Option<(String, Instant)> = None;
        let mut previous: Option<String> = None;
        let (etag, renewed, epoch, current) = loop {
            let sent = self.clock.now();
            let theirs = match self.read_lease()? {
                None => {
                    // No lease yet (or removed by hand): the next epoch
                    // after every folder there is, taking over the newest
                    // whole one.
                    let newest = self.newest_epoch()?;
                    let whole = self.newest_whole_epoch()?;
                    let ours = doc(newest + 1, whole)?;
                    match self.store.create_exclusive(&key, ours)? {
                        Ok(etag) => break (etag.ok_or_else(|| no_etag(&lease_url))?, sent, newest + 1, whole),
                        Err(StoreError::AlreadyExists { .. } | StoreError::Contended { .. }) => {
                            self.clock.sleep(poll);
                            continue;
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Some(theirs) => theirs,
            };
            let (doc_theirs, their_etag) = theirs;
            // Another host's wall clock is not this one's: the holder's
            // `expires_at_ms` means nothing here but "released" (0). A live
            // lease has expired only once this run watched it unrenewed for
            // its whole length, on its own monotonic clock.
            let expired = doc_theirs.expires_at_ms == 0
                || match &watched {
                    None => {
                        let left = Duration::from_millis(doc_theirs.lease_ms);
                        watched = Some((their_etag.clone(), self.clock.now() + left));
                        false
                    }
                    Some((etag, deadline)) if *etag == their_etag => self.clock.now() >= *deadline,
                    Some(_) => {
                        return Err(CheckpointError::Leased {
                            url: self.url.clone(),
                            holder: doc_theirs.holder,
                            expires: when(doc_theirs.expires_at_ms),
                        });
                    }
                };
            if !expired {
                self.clock.sleep(poll);
                continue;
            }
            // The swap that takes the lease also raises the epoch, so no two
            // holders ever share one.
            let newest = self.newest_epoch()?;
            let epoch = doc_theirs.epoch.max(newest) + 1;
            let current = match doc_theirs.current {
                Some(c) => c,
                None => self.newest_whole_epoch()?,
            };
            let ours = doc(epoch, current)?;
            match self.store.replace_if(&key, ours, &their_etag)? {
                Ok(etag) => {
                    if doc_theirs.expires_at_ms != 0 {
                        previous = Some(doc_theirs.holder);
                    }
                    break (etag.ok_or_else(|| no_etag(&lease_url))?, sent, epoch, current);
                }
                // Someone wrote it meanwhile: look again, afresh.
                Err(StoreError::Conflict { .. } | StoreError::Contended { .. }) => watched = None,
                Err(e) => return Err(e.into()),
            }
        };
        match &previous {
            Some(previous) => tracing::info!(
                state_dir = %self.url,
                previous = %previous,
                waited_ms = self.clock.now().saturating_duration_since(started).as_millis() as u64,
                "took over the state directory's lease after it expired unrenewed (the run holding it had stopped)"
            ),
            None => tracing::debug!(state_dir = %self.url, holder = %holder, epoch, "took the state directory's lease"),
        }
        let held = Arc::new(Held {
            key,
            url: self.url.clone(),
            holder,
            lease,
            epoch,
            clock: self.clock.clone(),
            state: Mutex::new(HeldState { etag, renewed, lost: None, current }),
        });
        if renewer {
            self.start_renewer(&held)?;
        }
        self.held = Some(held.clone());
        self.base = self.root_key(&epoch_name(epoch));
        if current != epoch {
            self.move_state(&held, current, epoch)?;
        }
        Ok(())
    }

    /// Starts the thread that renews the lease every third of its length
    /// until this state directory is dropped, or the lease is lost.
    fn start_renewer(&mut self, held: &Arc<Held>) -> Result<(), CheckpointError> {
        let (stop, stopped) = mpsc::channel::<()>();
        let renewing = held.clone();
        let store = self.store.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-lease".into())
            .spawn(move || {
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(renewing.lease / 3) {
                    if let Err(e) = renew(&renewing, store.as_ref()) {
                        tracing::warn!(error = %e, "could not renew the state directory's lease");
                        if lost(&renewing) {
                            return;
                        }
                    }
                }
            })
            .map_err(|source| CheckpointError::Io { path: PathBuf::from(&self.url), source })?;
        self.renewer = Some((stop, thread));
        Ok(())
    }

    /// Copies the state of epoch `from` into this run's folder, then makes
    /// it current (by the lease's compare-and-swap), then removes the old
    /// folder, best effort: what a former holder writes there later is never
    /// read.
    fn move_state(&self, held: &Held, from: u64, to: u64) -> Result<(), CheckpointError> {
        let from_dir = self.root_key(&epoch_name(from));
        let to_dir = self.root_key(&epoch_name(to));
        let mut copied = None;
        for _ in 0..COPY_TRIES {
            if let Some(n) = self.copy_folder(&from_dir, &to_dir)? {
                copied = Some(n);
                break;
            }
        }
        let Some(copied) = copied else {
            return Err(CheckpointError::LeaseLost {
                url: self.url.clone(),
                reason: format!(
                    "the state in {} kept changing while it was taken over ({COPY_TRIES} tries): another run still writes there",
                    self.store.url(&from_dir)
                ),
            });
        };
        {
            let mut state = held.state.lock().map_err(|_| poisoned(held))?;
            state.current = to;
        }
        if let Err(e) = self.swap_current(held) {
            // The lease still names `from` (as far as this run knows).
            if let Ok(mut state) = held.state.lock() {
                state.current = from;
            }
            return Err(e);
        }
        tracing::debug!(state_dir = %self.url, from, to, objects = copied, "moved the state into this run's epoch");
        match self.store.list(&from_dir)? {
            Ok(listed) => {
                for o in listed {
                    self.delete_key(o.key);
                }
            }
            Err(e) => tracing::warn!(
                folder = %self.store.url(&from_dir),
                error = %e,
                "could not list the former epoch's folder to remove it (it is never read again)"
            ),
        }
        Ok(())
    }

    /// One try at copying every object under `from` to the same name under
    /// `to` (cleared first: only this run writes there). `None` when a
    /// listed object was gone before it was read.
    fn copy_folder(&self, from: &str, to: &str) -> Result<Option<usize>, CheckpointError> {
        for o in self.store.list(to)?? {
            self.store.delete(&o.key)??;
        }
        let listed = self.store.list(from)??;
        for o in &listed {
            let Some(rel) = o.key.strip_prefix(from).and_then(|r| r.strip_prefix('/')) else { continue };
            if rel == COPIED {
                continue;
            }
            let bytes = match self.store.read(&o.key)? {
                Ok(bytes) => bytes,
                Err(StoreError::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            self.store.create_exclusive(&format!("{to}/{rel}"), bytes)??;
        }
        self.store.create_exclusive(&format!("{to}/{COPIED}"), Bytes::from_static(b""))??;
        Ok(Some(listed.len()))
    }

    /// Makes the lease name this run's folder as `current`: a renewal that
    /// must land. As in [`Self::check_held`], a transient failure is not
    /// let pass: until the swap landed, the lease names the old folder, and
    /// removing that folder, or writing state only this run's folder holds,
    /// would lose it to the next run (or to `sluice state`) if this run
    /// then stopped. Tried again until the lease would lapse; a swap whose
    /// reply was lost fails its retry by compare-and-swap, which loses the
    /// lease (the old folder stays).
    fn swap_current(&self, held: &Held) -> Result<(), CheckpointError> {
        self.renew_confirmed(held, "be made to name this run's state")
    }

    /// Renews the lease now, confirmed by the store; an error once it is
    /// lost. A transient failure proves nothing either way, so it is tried
    /// again (until two thirds of the lease since the last confirmed
    /// renewal, then the run stops, resumable): what follows this check (a
    /// record, a commit) must come after a renewal the store confirmed, and
    /// so before any takeover copies this run's folder.
    pub(super) fn check_held(&self) -> Result<(), CheckpointError> {
        match &self.held {
            Some(held) => self.renew_confirmed(held, "be renewed"),
            None => Ok(()),
        }
    }

    /// Renews the lease until the store confirms it: a transient failure
    /// is tried again until two thirds of the lease since the last
    /// confirmed renewal (then the lease is taken for lost, `what` it could
    /// not in time); a compare-and-swap that fails loses it at once.
    fn renew_confirmed(&self, held: &Held, what: &str) -> Result<(), CheckpointError> {
        let poll = (held.lease / 10).clamp(Duration::from_millis(50), Duration::from_millis(500));
        loop {
            match renew(held, self.store.as_ref()) {
                Ok(()) => return Ok(()),
                Err(e) if lost(held) => return Err(e),
                Err(e) => {
                    let renewed = held.state.lock().map_err(|_| poisoned(held))?.renewed;
                    if self.clock.now().saturating_duration_since(renewed) + poll >= held.lease * 2 / 3 {
                        return Err(CheckpointError::LeaseLost {
                            url: held.url.clone(),
                            reason: format!("it could not {what} in time: {e}"),
                        });
                    }
                    tracing::warn!(error = %e, "the state directory's lease could not {what}; trying again");
                    self.clock.sleep(poll);
                }
            }
        }
    }
}

impl StateBackend for ObjectState {
    fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        ObjectState::read_file(self, file)
    }

    fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        ObjectState::write_file(self, file, bytes)
    }

    fn file_path(&self, file: StateFile) -> PathBuf {
        PathBuf::from(self.file_url(file))
    }

    fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        ObjectState::ids(self)
    }

    fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        ObjectState::read_record(self, c)
    }

    fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        ObjectState::write_record(self, c, bytes)
    }

    fn delete_record(&self, c: u64) {
        ObjectState::delete_record(self, c)
    }

    fn check_held(&self) -> Result<(), CheckpointError> {
        ObjectState::check_held(self)
    }

    fn dir(&self) -> PathBuf {
        PathBuf::from(self.url())
    }

    fn records_dir(&self) -> PathBuf {
        PathBuf::from(self.records_url())
    }

    fn record_path(&self, c: u64) -> PathBuf {
        PathBuf::from(self.record_url(c))
    }
}

fn poisoned(held: &Held) -> CheckpointError {
    CheckpointError::LeaseLost { url: held.url.clone(), reason: "its renewal panicked".into() }
}

fn lost(held: &Held) -> bool {
    held.state.lock().map_or(true, |s| s.lost.is_some())
}

/// Renews `held` by compare-and-swap; a failed swap loses it for good, and so
/// does a renewal later than the lease, or one answered a lease or more
/// after it was sent. A swap that fails on a lease this
/// very run wrote last (its holder and epoch: an earlier renewal landed,
/// its reply lost) is no other run's: its version is adopted and the
/// renewal sent again, once.
fn renew(held: &Held, store: &dyn Objects) -> Result<(), CheckpointError> {
    let mut state = held.state.lock().map_err(|_| poisoned(held))?;
    let lost = |reason: String| CheckpointError::LeaseLost { url: held.url.clone(), reason };
    if let Some(reason) = &state.lost {
        return Err(lost(reason.clone()));
    }
    let age = held.clock.now().saturating_duration_since(state.renewed);
    if age >= held.lease {
        let reason = format!("it was last renewed {:.1}s ago, longer than the lease", age.as_secs_f64());
        state.lost = Some(reason.clone());
        return Err(lost(reason));
    }
    let mut adopted = false;
    loop {
        let doc = held.doc(held.clock.now_ms() + held.lease.as_millis() as u64, state.current);
        let bytes = serde_json::to_vec(&doc)
            .map(Bytes::from)
            .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(store.url(&held.key)), source })?;
        let sent = held.clock.now();
        match store.replace_if(&held.key, bytes, &state.etag)? {
            Ok(Some(etag)) => {
                state.etag = etag;
                // A renewal stored at once but answered a lease or more
                // after it was sent (this run paused meanwhile) proves
                // nothing about now: another run may have watched it
                // unrenewed for a whole lease and taken it over since.
                let answered = held.clock.now().saturating_duration_since(sent);
                if answered >= held.lease {
                    let reason = format!(
                        "its renewal was answered {:.1}s after it was sent, longer than the lease: another run may have taken it over meanwhile",
                        answered.as_secs_f64()
                    );
                    state.lost = Some(reason.clone());
                    return Err(lost(reason));
                }
                state.renewed = sent;
                return Ok(());
            }
            Ok(None) => return Err(no_etag(&store.url(&held.key))),
            Err(StoreError::Conflict { url, .. }) => {
                let found = store.read_versioned(&held.key).ok().and_then(|r| r.ok());
                let now = found.and_then(|v| serde_json::from_slice::<LeaseDoc>(&v.bytes).ok().map(|d| (v.etag, d)));
                match now {
                    // Only this run writes its holder (a token of its own):
                    // the lease is as this run left it, under a version whose
                    // reply was lost. `renewed` stays that of the last
                    // confirmed renewal.
                    Some((etag, d)) if !adopted && d.holder == held.holder && d.epoch == held.epoch => {
                        tracing::info!(lease = %url, "a renewal of the lease landed though its reply was lost; renewing again over it");
                        state.etag = etag;
                        adopted = true;
                    }
                    now => {
                        let now_held = now.map_or_else(|| "someone else".to_string(), |(_, d)| d.holder);
                        let reason = format!("its compare-and-swap on {url} failed: {now_held} holds it now");
                        state.lost = Some(reason.clone());
                        return Err(lost(reason));
                    }
                }
            }
            // The lease object was deleted (S3 answers a conditional write of a
            // missing object 404): any run may create it now, at once.
            Err(StoreError::NotFound { url }) => {
                let reason = format!("{url} was deleted: another run may take it at once");
                state.lost = Some(reason.clone());
                return Err(lost(reason));
            }
            Err(e) => return Err(e.into()),
        }
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
            let doc = held.doc(0, state.current);
            if let Ok(bytes) = serde_json::to_vec(&doc) {
                match self.store.replace_if(&held.key, Bytes::from(bytes), &state.etag) {
                    Ok(Ok(_)) => tracing::debug!(state_dir = %held.url, "released the state directory's lease"),
                    Ok(Err(e)) => tracing::warn!(error = %e, "could not release the state directory's lease"),
                    Err(e) => tracing::warn!(error = %e, "could not release the state directory's lease"),
                }
            }
        }
    }
}

/// Who holds the object-store state directory at `bucket`/`prefix` now,
/// read without taking or changing anything (for `sluice maintain`): the
/// holder of its lease while that lease is neither released nor expired,
/// else `None` (no lease object: no run ever held it, or it was deleted).
///
/// Another host's wall clock is not this one's, and this check must fail
/// closed: a lease not released counts as live until one further lease
/// length past its `expires_at_ms` by this clock (a run that renews keeps
/// it at least two thirds of a length ahead). A lease that cannot be read
/// or parsed is an error, never "not held".
pub(super) fn lease_holder(
    scheme: Scheme,
    bucket: &str,
    prefix: &str,
    stores: &StoreOptions,
) -> Result<Option<String>, CheckpointError> {
    let store = ObjectStore::of(scheme, bucket, stores)?;
    let key = if prefix.is_empty() { LEASE_KEY.to_string() } else { format!("{prefix}/{LEASE_KEY}") };
    let url = store.url(&key);
    let bytes = match Objects::read(&store, &key)? {
        Ok(bytes) => bytes,
        Err(StoreError::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let doc: LeaseDoc = serde_json::from_slice(&bytes)
        .map_err(|source| CheckpointError::StateFile { path: PathBuf::from(&url), source })?;
    if doc.expires_at_ms == 0 || now_ms() >= doc.expires_at_ms.saturating_add(doc.lease_ms) {
        return Ok(None);
    }
    Ok(Some(format!("{} holds its lease {url} (until {} unless renewed)", doc.holder, when(doc.expires_at_ms))))
}

#[cfg(test)]
#[path = "lease_tests.rs"]
mod tests;
