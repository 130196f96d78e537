//! Finished files synced off the plugin's thread, so that the disk's wait
//! for one file overlaps the encoding of the next.
//!
//! Invariants:
//! - a file handed to [`Syncs::defer`] is complete (its last bytes written)
//!   and stays open, with its directory, until it and its directory are
//!   synced: a rename or a removal of its name in between cannot make the
//!   sync miss it. At most [`QUEUED`] files wait at once (the plugin's
//!   thread waits for room), so the descriptors held stay bounded;
//! - [`Syncs::settle`] returns only when every file deferred before it is
//!   durable, and fails when any of them could not be synced. The failure
//!   sticks until the instance ends: Linux may drop a file's dirty pages
//!   after a failed `fsync`, so a later success would prove nothing. If the
//!   sync thread itself stops, everything it held counts as failed, so a
//!   settle never waits for a thread that is gone;
//! - the host settles an instance's syncs before anything outside the
//!   sandbox can learn of those files: at the end of each plugin call, and
//!   before every capability operation that can name them durably or to
//!   another party (a catalog change, a gRPC call or message, an HTTP
//!   request, a rename, a whole-file write, an `output-file` finished). So a
//!   deferred file is durable by the time the call that finished it returns,
//!   and before anything the call does can refer to it. (Not covered: bytes
//!   of an HTTP request body streamed after the request was sent. No plugin
//!   names its files that way; the end of the call still settles.)

use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use thiserror::Error;

/// A deferred file that could not be made durable.
#[derive(Debug, Clone, Error)]
#[error("{location}: syncing the finished file to disk failed, so it is not durable: {message}")]
pub struct SyncFailed {
    pub location: String,
    pub message: String,
}

/// At most this many finished files wait for their sync (each holds two
/// descriptors); one more waits for room, which bounds the descriptors
/// held whatever `sink.sandbox.max_open_files` allows.
const QUEUED: usize = 32;

/// One finished file: its name (for errors), its handle and its directory's.
struct Job {
    location: String,
    file: cap_std::fs::File,
    dir: cap_std::fs::File,
}

#[derive(Default)]
struct Progress {
    deferred: u64,
    synced: u64,
    failed: Option<SyncFailed>,
}

#[derive(Default)]
struct Shared {
    progress: Mutex<Progress>,
    moved: Condvar,
}

impl Shared {
    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one file done, remembering the first failure (recorded
    /// before the file counts as done, and logged after, so that nothing
    /// between can lose it).
    fn done(&self, result: Result<(), SyncFailed>) {
        let mut p = self.progress();
        if let Err(e) = &result {
            p.failed.get_or_insert(e.clone());
        }
        p.synced = (p.synced + 1).min(p.deferred);
        drop(p);
        self.moved.notify_all();
        if let Err(e) = result {
            tracing::error!("{e}");
        }
    }
}

/// What the sync thread leaves behind if it stops with files still queued
/// (a panic in a logging layer, say): they count as failed.
struct Stopped(Arc<Shared>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        // Whatever the counts say: the file being synced when it stopped
        // may already count as done.
        let mut p = self.0.progress();
        p.synced = p.deferred;
        p.failed.get_or_insert(SyncFailed {
            location: "finished files".into(),
            message: "the thread syncing them stopped".into(),
        });
        drop(p);
        self.0.moved.notify_all();
    }
}

/// Test builds: how syncs are slowed or failed (`SLUICE_TEST_SYNC`).
#[derive(Clone, Copy, Default)]
struct Injected {
    delay: Duration,
    fail: bool,
}

/// One instance's deferred syncs, done in order by a thread of their own,
/// started at the first deferred file.
pub struct Syncs {
    shared: Arc<Shared>,
    tx: Mutex<Option<SyncSender<Job>>>,
    injected: Injected,
}

impl Default for Syncs {
    fn default() -> Self {
        Self { shared: Arc::default(), tx: Mutex::new(None), injected: Injected::from_env() }
    }
}

impl std::fmt::Debug for Syncs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.shared.progress();
        f.debug_struct("Syncs").field("deferred", &p.deferred).field("synced", &p.synced).finish()
    }
}

impl Syncs {
    /// Test builds: syncs that each take `delay`, and fail when `fail`.
    #[cfg(feature = "fault-injection")]
    pub fn injected(delay: Duration, fail: bool) -> Self {
        Self { injected: Injected { delay, fail }, ..Self::default() }
    }

    /// Hands a finished `file` (and its directory `dir`) to the sync thread.
    /// When the thread cannot be started, syncs them here instead.
    pub(crate) fn defer(
        &self,
        location: &str,
        file: cap_std::fs::File,
        dir: cap_std::fs::File,
    ) -> Result<(), SyncFailed> {
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        if tx.is_none() {
            *tx = self.start();
        }
        let job = Job { location: location.to_string(), file, dir };
        let Some(sender) = tx.as_ref() else { return self.inline(&job) };
        tracing::debug!(location, "deferred the sync of a finished file");
        self.shared.progress().deferred += 1;
        if let Err(returned) = sender.send(job) {
            // The thread is gone (and counted what it held as failed); this
            // file comes back, and is synced here.
            let mut p = self.shared.progress();
            p.deferred -= 1;
            p.synced = p.synced.min(p.deferred);
            drop(p);
            *tx = None;
            return self.inline(&returned.0);
        }
        Ok(())
    }

    /// Syncs `job` on the caller's thread; a failure sticks as a deferred one does.
    fn inline(&self, job: &Job) -> Result<(), SyncFailed> {
        let result = sync(job, self.injected);
        if let Err(e) = &result {
            self.shared.progress().failed.get_or_insert(e.clone());
        }
        result
    }

    fn start(&self) -> Option<SyncSender<Job>> {
        let (tx, rx) = sync_channel::<Job>(QUEUED);
        let shared = self.shared.clone();
        let injected = self.injected;
        let spawned = std::thread::Builder::new().name("sluice-sync".into()).spawn(move || {
            let _stopped = Stopped(shared.clone());
            for job in rx {
                let result = sync(&job, injected);
                drop(job);
                shared.done(result);
            }
        });
        match spawned {
            Ok(_) => Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "could not start a thread to sync finished files; they are synced as they finish");
                None
            }
        }
    }

    /// Waits until every file deferred so far is durable.
    pub fn settle(&self) -> Result<(), SyncFailed> {
        let mut p = self.shared.progress();
        while p.synced < p.deferred {
            p = self.shared.moved.wait(p).unwrap_or_else(|p| p.into_inner());
        }
        match &p.failed {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// How many deferred files are not synced yet.
    pub fn pending(&self) -> u64 {
        let p = self.shared.progress();
        p.deferred.saturating_sub(p.synced)
    }

    /// Settles before an operation that could tell the world of a deferred
    /// file: a file that could not be synced traps the call, so that the
    /// operation never happens.
    pub(crate) fn before_publishing(&self) -> wasmtime::Result<()> {
        self.settle().map_err(wasmtime::Error::new)
    }
}

fn sync(job: &Job, injected: Injected) -> Result<(), SyncFailed> {
    let failed = |e: std::io::Error| SyncFailed { location: job.location.clone(), message: e.to_string() };
    if !injected.delay.is_zero() {
        std::thread::sleep(injected.delay);
    }
    if injected.fail {
        return Err(SyncFailed { location: job.location.clone(), message: "injected I/O error (a test's)".into() });
    }
    job.file.sync_all().map_err(failed)?;
    job.dir.sync_all().map_err(failed)?;
    tracing::debug!(location = %job.location, "synced a finished file");
    Ok(())
}

impl Injected {
    /// Test builds: `SLUICE_TEST_SYNC=<ms>[:fail]` delays every sync by
    /// `ms` (so that a missing wait for them shows) and, with `fail`, fails
    /// each as a disk error would. Nothing otherwise.
    fn from_env() -> Self {
        #[cfg(feature = "fault-injection")]
        {
            static ASKED: std::sync::OnceLock<Injected> = std::sync::OnceLock::new();
            *ASKED.get_or_init(|| {
                let text = std::env::var("SLUICE_TEST_SYNC").unwrap_or_default();
                let mut parts = text.split(':');
                let ms = parts.next().and_then(|m| m.parse().ok()).unwrap_or(0);
                Injected { delay: Duration::from_millis(ms), fail: parts.next() == Some("fail") }
            })
        }
        #[cfg(not(feature = "fault-injection"))]
        Injected::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cap_std::ambient_authority;
    use std::io::Write;

    #[test]
    fn settling_waits_for_every_deferred_file() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let root = cap_std::fs::Dir::open_ambient_dir(tmp.path(), ambient_authority()).expect("dir");
        let syncs = Syncs::default();
        for name in ["a.bin", "b.bin", "c.bin"] {
            let mut file = root.create(name).expect("create");
            file.write_all(name.as_bytes()).expect("write");
            syncs.defer(name, file, root.open(".").expect("open the directory")).expect("deferred");
        }
        syncs.settle().expect("settled");
        let p = syncs.shared.progress.lock().expect("progress");
        assert_eq!((p.deferred, p.synced), (3, 3));
        assert!(p.failed.is_none());
    }

    #[test]
    fn settling_with_nothing_deferred_starts_no_thread() {
        let syncs = Syncs::default();
        syncs.settle().expect("settled");
        assert!(syncs.tx.lock().expect("sender").is_none());
    }
}
