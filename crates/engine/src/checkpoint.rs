//! Durable checkpoint records and the job's state directory.
//!
//! Invariants:
//! - a record is written to a temporary file, synced, renamed into place and
//!   the directory synced, so after a crash either the whole new record or
//!   the previous one is there, never half of one;
//! - every record carries a SHA-256 of its body; a record that fails the check
//!   is refused loudly and never used, and an older one is never silently
//!   substituted for it (that could replay rows already committed);
//! - only one run holds a job's state directory at a time (an OS file lock,
//!   released by the kernel even on SIGKILL);
//! - the attempt counter is bumped durably before a run writes anything
//!   else (a run that cannot load its plugin or open its source never opens
//!   the state directory);
//! - a failed atomic write leaves no temporary file behind;
//! - a state directory belongs to one *incarnation* of its job, named by a
//!   random id made when the directory's first run starts (`incarnation`).
//!   Sinks key everything they write with it, so a job started over in a
//!   fresh state directory never mistakes an earlier incarnation's
//!   checkpoints for its own;
//! - a state directory marked `halted` is never resumed: the marker names a
//!   failure that resuming would turn into silent loss;
//! - a state directory on an object store (`s3://bucket/prefix`, see
//!   [`super::object_state`]) keeps these invariants with the store's
//!   conditional writes instead of renames and file locks: a record is one
//!   object, created exclusively and never overwritten (re-persisting a
//!   checkpoint writes its next sequence number; the newest wins), and the
//!   one-run-at-a-time lock is a lease object renewed by compare-and-swap.
//!   Which backend holds the state is this module's business alone.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::location::Location;

const MAGIC: &str = "sluice-checkpoint";
const FORMAT_VERSION: u32 = 1;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("state directory {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "state directory {path} is in use by another sluice run of this job (lock held); \
         wait for it to end or stop it"
    )]
    Locked { path: PathBuf },
    #[error(
        "state directory {url} is in use by another sluice run of this job: {holder} holds its lease, renewed \
         while this run waited, until {expires} unless renewed again; wait for it to end or stop it"
    )]
    Leased { url: String, holder: String, expires: String },
    #[error(
        "state directory {url}: this run no longer holds its lease ({reason}); it stops before writing anything \
         more. Another run may hold the state directory now (see job.lease_secs)"
    )]
    LeaseLost { url: String, reason: String },
    #[error("state directory: {0}")]
    Store(#[from] sluice_store::StoreError),
    #[error(
        "checkpoint record {path} is corrupt ({reason}); refusing to resume from it. \
         Nothing was changed. Restore the file from a backup. Moving it away resumes from the previous \
         record{older}, which is safe only if the checkpoint of this record was never committed to the \
         target: if it was, resuming would deliver its rows twice, and the next run finds it committed and \
         halts the state directory. `sluice state` shows what the previous record knew to be committed"
    )]
    Corrupt { path: PathBuf, reason: String, older: String },
    #[error(
        "state directory {state_dir}: {path} is not a directory (it is a file); set job.state_dir to a directory, \
         or move the file away"
    )]
    NotADirectory { path: PathBuf, state_dir: PathBuf },
    #[error("checkpoint record {path} belongs to job {found:?}, not {expected:?}")]
    WrongJob { path: PathBuf, found: String, expected: String },
    #[error("cannot encode checkpoint {checkpoint}: {source}")]
    Encode {
        checkpoint: u64,
        #[source]
        source: serde_json::Error,
    },
    #[error("state file {path} is not valid: {source}")]
    StateFile {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A write whose outcome is unknown: it may be durable, or become so.
    #[error(
        "{path}: whether this write took effect is unknown ({source}); nothing it covers was released. Run \
         the job again: the next run decides from what the state directory holds"
    )]
    Unknown {
        path: PathBuf,
        #[source]
        source: Box<CheckpointError>,
    },
}

impl CheckpointError {
    /// Whether the write that failed with this error may still have taken
    /// effect (or may yet): then nothing it covers may be released.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, CheckpointError::Unknown { .. })
    }

    /// This error, as the unknown outcome of a write to `path`.
    pub(super) fn unknown(self, path: impl Into<PathBuf>) -> Self {
        if self.outcome_unknown() {
            return self;
        }
        CheckpointError::Unknown { path: path.into(), source: Box::new(self) }
    }
}

/// Bytes stored as base64 in the JSON record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Blob(pub Vec<u8>);

impl Serialize for Blob {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(&self.0))
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD.decode(s.as_bytes()).map(Blob).map_err(serde::de::Error::custom)
    }
}

/// One subtask's part of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SubtaskRecord {
    /// Where the subtask's source resumes.
    pub position: serde_json::Value,
    /// What the plugin's `snapshot-state` returned.
    pub writer_state: Blob,
    /// Rows this subtask delivered up to this checkpoint, over all runs.
    pub rows: u64,
    /// The subtask's source is exhausted.
    pub finished: bool,
    /// The tables this subtask's source delivered rows of, with the shape
    /// it sent last when that differs from the table's (`None`: the
    /// table's own). A later narrower shape is refused against it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub seen: BTreeMap<String, Option<Blob>>,
    /// Records of this subtask's source that did not convert (dead
    /// letters), up to this checkpoint, over all runs.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bad_rows: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A combined commit persisted but not known to be committed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PendingCommit {
    pub checkpoint: u64,
    pub combined: Blob,
    /// Rows the checkpoint covers (0 in records of versions before it was kept).
    #[serde(default)]
    pub rows: u64,
    /// Its rows, bytes and dead letters per table, as the writers handed
    /// them over (none in records of versions before they were kept), so
    /// that a run that commits it counts it, and a drop takes its dead
    /// letters out of the job's count.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tables: BTreeMap<String, crate::metrics::Tally>,
}

impl PendingCommit {
    /// Records of the checkpoint that are dead letters.
    pub fn bad_rows(&self) -> u64 {
        self.tables.values().map(|t| t.bad).sum()
    }
}

/// A pending checkpoint an operator dropped (`sluice state --drop-pending`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DroppedCommit {
    pub checkpoint: u64,
    pub rows: u64,
    /// Its dead letters, given up with it (0 in records of versions before
    /// they were kept).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bad: u64,
    /// Milliseconds since the Unix epoch.
    pub dropped_at_ms: u64,
}

/// The identity of a state directory's job incarnation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Incarnation {
    /// 12 lowercase hex digits, random.
    pub id: String,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// Started with `sluice run --new-incarnation`: it lands beside the
    /// job's other incarnations on purpose, so it neither takes nor checks
    /// the target's claim (see the plugins' `sluice.claim` option). Always
    /// written; a record without it predates claims, and its incarnation may
    /// have been started either way, so it keeps landing as it did then:
    /// beside, without claims.
    #[serde(default = "predates_claims")]
    pub beside: bool,
}

impl Incarnation {
    /// A new incarnation with a random id.
    pub fn generate() -> Result<Self, CheckpointError> {
        let random = getrandom::u64().map_err(|e| CheckpointError::Io {
            path: PathBuf::from("(random source)"),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Self { id: format!("{:012x}", random & 0xffff_ffff_ffff), created_at_ms: now_ms(), beside: false })
    }
}

/// `beside` of an incarnation record written before claims existed.
fn predates_claims() -> bool {
    true
}

/// Why a state directory must not be resumed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Halt {
    pub reason: String,
    /// Milliseconds since the Unix epoch.
    pub halted_at_ms: u64,
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Everything needed to resume a job after checkpoint `checkpoint`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointRecord {
    pub job_id: String,
    pub sink_id: String,
    pub checkpoint: u64,
    /// Run attempt that wrote the record.
    pub attempt: u32,
    pub parallelism: u32,
    pub subtasks: Vec<SubtaskRecord>,
    /// Checkpoints (this one and earlier) whose commit is not known to have
    /// succeeded, oldest first. Re-committed first on restore.
    pub pending: Vec<PendingCommit>,
    /// Newest checkpoint known to be committed when the record was written.
    pub last_committed: Option<u64>,
    /// Pending checkpoints an operator dropped, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dropped: Vec<DroppedCommit>,
    /// The tables the writers knew at this checkpoint, with their schemas
    /// (Arrow IPC). Empty in records written before contract 0.2: the
    /// source's one table then.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<TableRecord>,
    /// What the source was when the checkpoint was taken (the generator's
    /// parameters, the files consumed); a resume from another source is
    /// refused. `None` in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<crate::source::SourceIdentity>,
    /// The dead-letter table (`job.dead_letter.table`) when the job set bad
    /// records aside: a resume without dead letters (which would read those
    /// records again and stop on them) or into another table (which would
    /// split them and their counts) is refused. `None` in records written
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letters: Option<String>,
    /// The committer's own state (contract 0.2.3's `committer-state`), as
    /// of every commit answered before the record was written: handed back
    /// to the committer when the job resumes. `None` for a plugin that
    /// keeps none, and in records written before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committer_state: Option<Blob>,
    /// Milliseconds since the Unix epoch.
    pub created_at_ms: u64,
}

/// A table and its schema as of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TableRecord {
    pub name: String,
    /// The schema, as an Arrow IPC stream without batches.
    pub schema: Blob,
}

impl CheckpointRecord {
    pub fn total_rows(&self) -> u64 {
        self.subtasks.iter().map(|s| s.rows).sum()
    }

    /// Dead letters up to this checkpoint, over all runs, less those of the
    /// checkpoints an operator dropped (their positions are passed, so they
    /// are never read again).
    pub fn bad_rows(&self) -> u64 {
        let dropped: u64 = self.dropped.iter().map(|d| d.bad).sum();
        self.subtasks.iter().map(|s| s.bad_rows).sum::<u64>().saturating_sub(dropped)
    }

    /// Dead letters of the pending checkpoints.
    pub fn pending_bad_rows(&self) -> u64 {
        self.pending.iter().map(PendingCommit::bad_rows).sum()
    }

    pub fn finished(&self) -> bool {
        self.subtasks.iter().all(|s| s.finished)
    }

    /// Rows of committed checkpoints, as far as the record knows: every row
    /// delivered, less those of the pending checkpoints and of the dropped
    /// ones.
    pub fn committed_rows(&self) -> u64 {
        let pending: u64 = self.pending.iter().map(|p| p.rows).sum();
        let dropped: u64 = self.dropped.iter().map(|d| d.rows).sum();
        self.total_rows().saturating_sub(pending).saturating_sub(dropped)
    }
}

/// A job's state directory, held (locked, or leased on an object store) for
/// the lifetime of this value. The coordinator and the landing see only
/// this; where the state lives is its [`StateBackend`]'s business.
#[derive(Debug)]
pub struct CheckpointStore {
    backend: Box<dyn StateBackend>,
    job_id: String,
    retain: usize,
}

/// Where a state directory lives: a local directory ([`LocalDir`]), an
/// object store ([`super::object_state::ObjectState`]), or, in tests,
/// memory (`super::memory_state`), any of them behind seeded faults
/// (`super::state_faults`).
///
/// Contract of every backend: [`StateBackend::write_record`] answers `Ok`
/// only once the record is durable, and an error for which
/// [`CheckpointError::outcome_unknown`] is false only when nothing of the
/// record can become durable later (the write was refused before it was
/// sent). Any other failure, a lost reply, a timeout, a failed step after
/// the durable one, is an unknown outcome.
pub(super) trait StateBackend: std::fmt::Debug + Send + Sync {
    fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError>;
    fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError>;
    /// Where `file` is, for messages.
    fn file_path(&self, file: StateFile) -> PathBuf;
    /// Checkpoint ids present, newest first.
    fn ids(&self) -> Result<Vec<u64>, CheckpointError>;
    /// Checkpoint ids present, newest first, for pruning old records only:
    /// a listing that lags (in a simulation) may answer here, never where
    /// the state is read.
    fn ids_to_prune(&self) -> Result<Vec<u64>, CheckpointError> {
        self.ids()
    }
    /// The newest record of checkpoint `c`: where it is and its bytes.
    fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError>;
    /// Writes a record of checkpoint `c`: on disk in place of the one
    /// there, on an object store as a new object (never overwritten).
    fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError>;
    /// Removes the records of checkpoint `c` (retention), best effort.
    fn delete_record(&self, c: u64);
    /// See [`CheckpointStore::check_held`].
    fn check_held(&self) -> Result<(), CheckpointError>;
    /// The local directory, or the store URL as a path, for messages.
    fn dir(&self) -> PathBuf;
    /// Where the records are, for messages.
    fn records_dir(&self) -> PathBuf;
    /// Where the record of checkpoint `c` is (or its records go).
    fn record_path(&self, c: u64) -> PathBuf;
}

/// A local state directory.
#[derive(Debug)]
struct LocalDir {
    dir: PathBuf,
    checkpoints: PathBuf,
    /// `None` for a read-only view ([`CheckpointStore::inspect`]).
    _lock: Option<File>,
}

/// A small state file of either backend.
#[derive(Debug, Clone, Copy)]
pub(super) enum StateFile {
    Attempt,
    Incarnation,
    Halted,
}

impl StateFile {
    pub(super) fn name(self) -> &'static str {
        match self {
            StateFile::Attempt => ATTEMPT_FILE,
            StateFile::Incarnation => INCARNATION_FILE,
            StateFile::Halted => HALT_FILE,
        }
    }
}

const ATTEMPT_FILE: &str = "attempt";
const INCARNATION_FILE: &str = "incarnation";
const HALT_FILE: &str = "halted";

fn json_bytes<T: Serialize>(path: &Path, value: &T) -> Result<Vec<u8>, CheckpointError> {
    let mut bytes = serde_json::to_vec_pretty(value)
        .map_err(|source| CheckpointError::StateFile { path: path.to_path_buf(), source })?;
    bytes.push(b'\n');
    Ok(bytes)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

fn file_name(c: u64) -> String {
    format!("chk-{c:020}.json")
}

fn parse_name(name: &str) -> Option<u64> {
    name.strip_prefix("chk-")?.strip_suffix(".json")?.parse().ok()
}

/// Writes `bytes` to `path` atomically and durably.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_atomic_telling(path, bytes)
}

/// [`write_atomic`], telling apart a failure before the rename (nothing
/// was written: the temporary file is removed) from one at or after it
/// (the new file may be in place, or be after a crash: an unknown outcome).
fn write_atomic_telling(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".tmp-{name}-{}", std::process::id()));
    let written = (|| {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(bytes).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))
    })();
    if let Err(e) = written {
        // A full disk, say: leave no half-written temporary file behind.
        if let Err(rm) = fs::remove_file(&tmp)
            && rm.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %tmp.display(), error = %rm, "could not remove a temporary file after a failed write");
        }
        return Err(e);
    }
    // rename(2) either happens or not, but on a network filesystem an error
    // may follow a rename that happened; and until the directory is synced
    // a crash may undo it. Either way the outcome is not known.
    if let Err(e) = fs::rename(&tmp, path) {
        if let Err(rm) = fs::remove_file(&tmp)
            && rm.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %tmp.display(), error = %rm, "could not remove a temporary file after a failed rename");
        }
        return Err(io(path)(e).unknown(path));
    }
    sync_dir(dir).map_err(|e| e.unknown(path))
}

/// Refuses a state directory path that runs through a file: the OS would
/// say only "File exists" or "Not a directory".
fn ensure_dir_path(dir: &Path) -> Result<(), CheckpointError> {
    for p in dir.ancestors() {
        match fs::metadata(p) {
            Ok(meta) if meta.is_dir() => return Ok(()),
            Ok(_) => {
                return Err(CheckpointError::NotADirectory { path: p.to_path_buf(), state_dir: dir.to_path_buf() });
            }
            Err(_) => continue,
        }
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

impl LocalDir {
    fn file(&self, file: StateFile) -> PathBuf {
        self.dir.join(file.name())
    }
}

impl StateBackend for LocalDir {
    fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        let path = self.file(file);
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io(&path)(e)),
        }
    }

    fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        write_atomic_telling(&self.file(file), &bytes)
    }

    fn file_path(&self, file: StateFile) -> PathBuf {
        self.file(file)
    }

    fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        let mut ids = Vec::new();
        if !self.checkpoints.is_dir() {
            return Ok(ids);
        }
        for entry in fs::read_dir(&self.checkpoints).map_err(io(&self.checkpoints))? {
            let entry = entry.map_err(io(&self.checkpoints))?;
            if let Some(c) = entry.file_name().to_str().and_then(parse_name) {
                ids.push(c);
            }
        }
        ids.sort_unstable_by(|a, b| b.cmp(a));
        Ok(ids)
    }

    fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        let path = self.checkpoints.join(file_name(c));
        let bytes = fs::read(&path).map_err(io(&path))?;
        Ok((path, bytes))
    }

    fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        let path = self.checkpoints.join(file_name(c));
        write_atomic_telling(&path, &bytes)?;
        Ok(path)
    }

    fn delete_record(&self, c: u64) {
        let p = self.checkpoints.join(file_name(c));
        if let Err(e) = fs::remove_file(&p) {
            tracing::warn!(path = %p.display(), error = %e, "could not prune old checkpoint record");
        }
    }

    fn check_held(&self) -> Result<(), CheckpointError> {
        // The lock is the kernel's, held until the process ends.
        Ok(())
    }

    fn dir(&self) -> PathBuf {
        self.dir.clone()
    }

    fn records_dir(&self) -> PathBuf {
        self.checkpoints.clone()
    }

    fn record_path(&self, c: u64) -> PathBuf {
        self.checkpoints.join(file_name(c))
    }
}

impl CheckpointStore {
    /// Which run holds the state directory at `location` now, if one does:
    /// a local one by its lock, an object-store one by a live lease (see
    /// `object_state::lease_holder`). Only read, never taken for longer
    /// than the look. What cannot be read is an error, never "not held".
    pub fn run_holds(
        location: &Location,
        stores: &sluice_store::StoreOptions,
    ) -> Result<Option<String>, CheckpointError> {
        let dir = match location {
            Location::Local(dir) => dir,
            Location::ObjectStore { scheme, bucket, prefix } => {
                return super::object_state::lease_holder(*scheme, bucket, prefix, stores);
            }
        };
        let path = dir.join("lock");
        let lock = match OpenOptions::new().write(true).open(&path) {
            Ok(lock) => lock,
            // No lock file: no run ever held it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        match lock.try_lock() {
            Ok(()) => Ok(None),
            Err(fs::TryLockError::WouldBlock) => Ok(Some(format!("a run holds its lock {}", path.display()))),
            Err(fs::TryLockError::Error(e)) => Err(io(&path)(e)),
        }
    }

    /// Opens (creating) and locks a job's local state directory.
    pub fn open(dir: &Path, job_id: &str, retain: usize) -> Result<Self, CheckpointError> {
        let checkpoints = dir.join("checkpoints");
        ensure_dir_path(&checkpoints)?;
        fs::create_dir_all(&checkpoints).map_err(io(&checkpoints))?;
        let lock_path = dir.join("lock");
        let lock =
            OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path).map_err(io(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(CheckpointError::Locked { path: dir.to_path_buf() }),
            Err(fs::TryLockError::Error(e)) => return Err(io(&lock_path)(e)),
        }
        let local = LocalDir { dir: dir.to_path_buf(), checkpoints, _lock: Some(lock) };
        Ok(Self { backend: Box::new(local), job_id: job_id.to_string(), retain })
    }

    /// Opens and holds the state directory at `location`: a local one
    /// locked, an object-store one under a lease of `lease` (taken over
    /// from a run that stopped renewing it, once it expired).
    pub fn open_at(
        location: &Location,
        job_id: &str,
        retain: usize,
        lease: std::time::Duration,
        stores: &sluice_store::StoreOptions,
    ) -> Result<Self, CheckpointError> {
        match location {
            Location::Local(dir) => Self::open(dir, job_id, retain),
            Location::ObjectStore { scheme, bucket, prefix } => {
                let state = super::object_state::ObjectState::open(*scheme, bucket, prefix, Some(lease), stores)?;
                Ok(Self { backend: Box::new(state), job_id: job_id.to_string(), retain })
            }
        }
    }

    /// A read-only view of a local state directory, without taking its lock
    /// (a run may hold it): for showing the state. `None` when the directory
    /// does not exist. Records are written atomically, so what it reads is whole.
    pub fn inspect(dir: &Path, job_id: &str) -> Result<Option<Self>, CheckpointError> {
        let checkpoints = dir.join("checkpoints");
        if !dir.is_dir() {
            return Ok(None);
        }
        let local = LocalDir { dir: dir.to_path_buf(), checkpoints, _lock: None };
        Ok(Some(Self { backend: Box::new(local), job_id: job_id.to_string(), retain: usize::MAX }))
    }

    /// [`CheckpointStore::inspect`] of the state directory at `location`,
    /// without its lock or lease. `None` when nothing is there yet.
    pub fn inspect_at(
        location: &Location,
        job_id: &str,
        stores: &sluice_store::StoreOptions,
    ) -> Result<Option<Self>, CheckpointError> {
        match location {
            Location::Local(dir) => Self::inspect(dir, job_id),
            Location::ObjectStore { scheme, bucket, prefix } => {
                let state = super::object_state::ObjectState::open(*scheme, bucket, prefix, None, stores)?;
                if state.is_empty()? {
                    return Ok(None);
                }
                Ok(Some(Self { backend: Box::new(state), job_id: job_id.to_string(), retain: usize::MAX }))
            }
        }
    }

    /// Opens and holds the state directory kept in `dir`, in memory (test
    /// builds only): the same protocol with no disk, for in-process tests,
    /// behind seeded faults with [`CheckpointStore::with_faults`].
    #[cfg(any(test, feature = "fault-injection"))]
    pub fn in_memory(
        dir: &super::memory_state::MemoryDir,
        job_id: &str,
        retain: usize,
    ) -> Result<Self, CheckpointError> {
        let state = super::memory_state::MemoryState::open(dir)?;
        Ok(Self { backend: Box::new(state), job_id: job_id.to_string(), retain })
    }

    /// This state directory behind the simulation's seeded faults, when
    /// `faults` has them (test builds only).
    pub fn with_faults(self, faults: &crate::fault::Faults) -> Self {
        #[cfg(feature = "fault-injection")]
        if let Some(sim) = &faults.sim {
            let backend = Box::new(super::state_faults::FaultyState::new(self.backend, sim.clone()));
            return Self { backend, ..self };
        }
        let _ = faults;
        self
    }

    /// Runs started in this state directory so far (without raising it).
    pub fn attempts(&self) -> Result<u32, CheckpointError> {
        let Some(bytes) = self.backend.read_file(StateFile::Attempt)? else { return Ok(0) };
        let corrupt = |reason: String| CheckpointError::Corrupt {
            path: self.backend.file_path(StateFile::Attempt),
            reason,
            older: String::new(),
        };
        let text = std::str::from_utf8(&bytes).map_err(|e| corrupt(format!("not text: {e}")))?;
        text.trim().parse::<u32>().map_err(|e| corrupt(format!("not a number: {e}")))
    }

    /// The local directory, or the store URL as a path, for messages.
    pub fn dir(&self) -> PathBuf {
        self.backend.dir()
    }

    fn read_state<T: serde::de::DeserializeOwned>(&self, file: StateFile) -> Result<Option<T>, CheckpointError> {
        let Some(bytes) = self.backend.read_file(file)? else { return Ok(None) };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| CheckpointError::StateFile { path: self.backend.file_path(file), source })
    }

    fn write_state<T: Serialize>(&self, file: StateFile, value: &T) -> Result<(), CheckpointError> {
        self.check_held()?;
        let bytes = json_bytes(&self.backend.file_path(file), value)?;
        self.backend.write_file(file, bytes)
    }

    /// The incarnation of this state directory, once one was adopted.
    pub fn incarnation(&self) -> Result<Option<Incarnation>, CheckpointError> {
        self.read_state(StateFile::Incarnation)
    }

    /// Adopts `incarnation` for this state directory, durably.
    pub fn set_incarnation(&self, incarnation: &Incarnation) -> Result<(), CheckpointError> {
        self.write_state(StateFile::Incarnation, incarnation)
    }

    /// Why this state directory must not be resumed, if it was halted.
    pub fn halted(&self) -> Result<Option<Halt>, CheckpointError> {
        self.read_state(StateFile::Halted)
    }

    /// Marks this state directory as never to be resumed, durably.
    pub fn halt(&self, reason: &str) -> Result<(), CheckpointError> {
        self.write_state(StateFile::Halted, &Halt { reason: reason.to_string(), halted_at_ms: now_ms() })
    }

    /// Where the halt marker is (whether or not it exists), for messages.
    pub fn halt_path(&self) -> PathBuf {
        self.backend.file_path(StateFile::Halted)
    }

    /// Raises and returns the run attempt (1 for the first run).
    pub fn next_attempt(&self) -> Result<u32, CheckpointError> {
        self.check_held()?;
        let next = self.attempts()?.saturating_add(1);
        self.backend.write_file(StateFile::Attempt, format!("{next}\n").into_bytes())?;
        Ok(next)
    }

    /// Fails once this run no longer holds its state directory (an
    /// object-store lease lost or expired), renewing the lease otherwise:
    /// called before every persist and every commit. A local directory's
    /// lock is held until the process ends.
    pub fn check_held(&self) -> Result<(), CheckpointError> {
        self.backend.check_held()
    }

    /// Checkpoint ids present, newest first.
    fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        self.backend.ids()
    }

    /// The newest record, verified. A corrupt newest record is an error.
    pub fn latest(&self) -> Result<Option<CheckpointRecord>, CheckpointError> {
        let ids = self.ids()?;
        let Some(&newest) = ids.first() else { return Ok(None) };
        let (path, bytes) = self.backend.read_record(newest)?;
        match decode(&bytes) {
            Ok(record) => {
                if record.job_id != self.job_id {
                    return Err(CheckpointError::WrongJob {
                        path,
                        found: record.job_id,
                        expected: self.job_id.clone(),
                    });
                }
                if record.checkpoint != newest {
                    return Err(CheckpointError::Corrupt {
                        path,
                        reason: format!("it holds checkpoint {} but is named {newest}", record.checkpoint),
                        older: older_hint(&ids),
                    });
                }
                Ok(Some(record))
            }
            Err(reason) => Err(CheckpointError::Corrupt { path, reason, older: older_hint(&ids) }),
        }
    }

    /// Persists a record atomically and durably, then prunes old ones.
    ///
    /// An error for which [`CheckpointError::outcome_unknown`] is false
    /// means the record was not written and never will be: only then may a
    /// caller release what it names. Once the record is durable, pruning
    /// only tidies: its failure is logged, never the checkpoint's.
    pub fn persist(&self, record: &CheckpointRecord) -> Result<PathBuf, CheckpointError> {
        self.check_held()?;
        let path = self.backend.write_record(record.checkpoint, encode(record)?)?;
        match self.backend.ids_to_prune() {
            Ok(ids) => {
                for old in ids.into_iter().skip(self.retain) {
                    self.backend.delete_record(old);
                }
            }
            Err(e) => {
                tracing::warn!(checkpoint = record.checkpoint, error = %e, "checkpoint persisted; could not list old records to prune them (the next persist tries again)");
            }
        }
        Ok(path)
    }

    /// Where the records are, for messages.
    pub fn records_dir(&self) -> PathBuf {
        self.backend.records_dir()
    }

    /// Path of the record of checkpoint `c` in a local state directory
    /// (whether or not it exists); on an object store, where its records go.
    pub fn record_path(&self, c: u64) -> PathBuf {
        self.backend.record_path(c)
    }
}

fn older_hint(ids: &[u64]) -> String {
    match ids.get(1) {
        Some(c) => format!(" (checkpoint {c})"),
        None => " (there is none: the job would start over)".to_string(),
    }
}

/// Header line, then the JSON body. The header holds the body's length and SHA-256.
pub fn encode(record: &CheckpointRecord) -> Result<Vec<u8>, CheckpointError> {
    let body = serde_json::to_vec_pretty(record)
        .map_err(|source| CheckpointError::Encode { checkpoint: record.checkpoint, source })?;
    let digest = format!("{:x}", Sha256::digest(&body));
    let mut out = format!("{MAGIC} v{FORMAT_VERSION} len={} sha256={digest}\n", body.len()).into_bytes();
    out.extend_from_slice(&body);
    Ok(out)
}

pub fn decode(bytes: &[u8]) -> Result<CheckpointRecord, String> {
    let nl = bytes.iter().position(|&b| b == b'\n').ok_or("no header line")?;
    let header = std::str::from_utf8(&bytes[..nl]).map_err(|_| "header is not text")?;
    let body = &bytes[nl + 1..];
    let mut parts = header.split(' ');
    if parts.next() != Some(MAGIC) {
        return Err("not a sluice checkpoint record".to_string());
    }
    let version = parts.next().and_then(|v| v.strip_prefix('v')).and_then(|v| v.parse::<u32>().ok());
    if version != Some(FORMAT_VERSION) {
        return Err(format!("unsupported record format {version:?}"));
    }
    let len = parts.next().and_then(|v| v.strip_prefix("len=")).and_then(|v| v.parse::<usize>().ok());
    let sum = parts.next().and_then(|v| v.strip_prefix("sha256="));
    let (Some(len), Some(sum)) = (len, sum) else { return Err("malformed header".to_string()) };
    if body.len() != len {
        return Err(format!("truncated: body has {} bytes, header says {len}", body.len()));
    }
    if format!("{:x}", Sha256::digest(body)) != sum {
        return Err("checksum mismatch".to_string());
    }
    serde_json::from_slice(body).map_err(|e| format!("body is not a valid record: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(c: u64) -> CheckpointRecord {
        CheckpointRecord {
            job_id: "j".into(),
            sink_id: "s".into(),
            checkpoint: c,
            attempt: 1,
            parallelism: 1,
            subtasks: vec![SubtaskRecord {
                position: serde_json::json!({"emitted": 5}),
                writer_state: Blob(vec![0, 1, 255]),
                rows: 5,
                finished: false,
                seen: BTreeMap::from([("orders".to_string(), None)]),
                bad_rows: 1,
            }],
            pending: vec![PendingCommit {
                checkpoint: c,
                combined: Blob(b"files".to_vec()),
                rows: 5,
                tables: BTreeMap::from([("orders".to_string(), crate::metrics::Tally { rows: 5, bytes: 80, bad: 1 })]),
            }],
            last_committed: None,
            dropped: Vec::new(),
            tables: vec![TableRecord { name: "orders".into(), schema: Blob(vec![1, 2]) }],
            source: None,
            dead_letters: Some("dead_letters".into()),
            committer_state: None,
            created_at_ms: 0,
        }
    }

    /// A local state directory whose pruning listing fails, the way an
    /// object store's LIST answered 500 right after a record's PUT.
    #[derive(Debug)]
    struct FailingPruneList(LocalDir);

    impl StateBackend for FailingPruneList {
        fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
            self.0.read_file(file)
        }
        fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
            self.0.write_file(file, bytes)
        }
        fn file_path(&self, file: StateFile) -> PathBuf {
            self.0.file_path(file)
        }
        fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
            self.0.ids()
        }
        fn ids_to_prune(&self) -> Result<Vec<u64>, CheckpointError> {
            Err(CheckpointError::Io { path: self.0.records_dir(), source: std::io::Error::other("list failed: 500") })
        }
        fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
            self.0.read_record(c)
        }
        fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
            self.0.write_record(c, bytes)
        }
        fn delete_record(&self, c: u64) {
            self.0.delete_record(c)
        }
        fn check_held(&self) -> Result<(), CheckpointError> {
            self.0.check_held()
        }
        fn dir(&self) -> PathBuf {
            self.0.dir()
        }
        fn records_dir(&self) -> PathBuf {
            self.0.records_dir()
        }
        fn record_path(&self, c: u64) -> PathBuf {
            self.0.record_path(c)
        }
    }

    fn local(dir: &Path) -> LocalDir {
        let checkpoints = dir.join("checkpoints");
        fs::create_dir_all(&checkpoints).unwrap();
        LocalDir { dir: dir.to_path_buf(), checkpoints, _lock: None }
    }

    #[test]
    fn a_failed_listing_after_a_durable_record_is_not_the_checkpoints_failure() {
        let dir = tempfile::tempdir().unwrap();
        let store =
            CheckpointStore { backend: Box::new(FailingPruneList(local(dir.path()))), job_id: "j".into(), retain: 1 };
        for c in 1..=3 {
            store.persist(&record(c)).expect("a record that is durable is persisted, whatever pruning meets");
        }
        assert_eq!(store.latest().unwrap(), Some(record(3)));
        // Nothing could be pruned: every record is still there.
        assert_eq!(store.ids().unwrap(), vec![3, 2, 1]);
    }

    #[test]
    fn a_failed_write_before_the_rename_is_a_definite_not_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), "j", 2).unwrap();
        // The temporary file cannot be created: the records folder is gone.
        fs::remove_dir_all(dir.path().join("checkpoints")).unwrap();
        let e = store.persist(&record(1)).unwrap_err();
        assert!(!e.outcome_unknown(), "nothing was written, and nothing can be later: {e}");
    }

    #[cfg(feature = "fault-injection")]
    #[test]
    fn a_record_written_with_its_reply_lost_is_an_unknown_outcome_and_durable() {
        use crate::fault::{Faults, Sim};
        let dir = tempfile::tempdir().unwrap();
        // Every operation happens, and its caller hears an error.
        let sim = std::sync::Arc::new(Sim::new(7, 0, 1_000_000, 0));
        let faults = Faults { sim: Some(sim.clone()), ..Faults::default() };
        let store = CheckpointStore::open(dir.path(), "j", 2).unwrap().with_faults(&faults);
        let e = store.persist(&record(1)).unwrap_err();
        assert!(e.outcome_unknown(), "a lost reply proves nothing: {e}");
        assert!(e.to_string().contains("whether this write took effect is unknown"), "{e}");
        sim.set_enabled(false);
        assert_eq!(store.latest().unwrap(), Some(record(1)), "the record is durable");
        assert!(sim.fired().iter().any(|f| f.starts_with("state.write-record#1 LoseReply")), "{:?}", sim.fired());
        // Failing before it is sent is a definite "not written".
        let sim = std::sync::Arc::new(Sim::new(7, 1_000_000, 0, 0));
        let faults = Faults { sim: Some(sim), ..Faults::default() };
        let other = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(other.path(), "j", 2).unwrap().with_faults(&faults);
        let e = store.persist(&record(1)).unwrap_err();
        assert!(!e.outcome_unknown(), "{e}");
        drop(store);
        assert!(CheckpointStore::open(other.path(), "j", 2).unwrap().latest().unwrap().is_none());
    }

    #[test]
    fn roundtrip_and_retention() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), "j", 2).unwrap();
        assert_eq!(store.latest().unwrap(), None);
        for c in 1..=4 {
            store.persist(&record(c)).unwrap();
        }
        assert_eq!(store.latest().unwrap(), Some(record(4)));
        assert_eq!(store.ids().unwrap(), vec![4, 3]);
        assert_eq!(store.next_attempt().unwrap(), 1);
        assert_eq!(store.next_attempt().unwrap(), 2);
    }

    #[test]
    fn corrupt_record_is_refused_loudly() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), "j", 3).unwrap();
        store.persist(&record(1)).unwrap();
        let path = store.persist(&record(2)).unwrap();
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x20;
        fs::write(&path, &bytes).unwrap();
        let err = store.latest().unwrap_err().to_string();
        assert!(err.contains("corrupt (checksum mismatch)") && err.contains("(checkpoint 1)"), "{err}");
        fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let err = store.latest().unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }

    #[test]
    fn incarnation_and_halt_markers_are_durable_files() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::open(dir.path(), "j", 3).unwrap();
        assert_eq!(store.incarnation().unwrap(), None);
        let inc = Incarnation::generate().unwrap();
        assert_eq!(inc.id.len(), 12);
        assert_ne!(inc, Incarnation::generate().unwrap());
        store.set_incarnation(&inc).unwrap();
        assert_eq!(store.incarnation().unwrap(), Some(inc));
        assert_eq!(store.halted().unwrap(), None);
        store.halt("because").unwrap();
        assert_eq!(store.halted().unwrap().map(|h| h.reason), Some("because".to_string()));
        fs::write(dir.path().join(INCARNATION_FILE), b"{").unwrap();
        assert!(matches!(store.incarnation(), Err(CheckpointError::StateFile { .. })));
        // A record from before claims may be of a --new-incarnation run: it keeps landing beside, without claims.
        fs::write(dir.path().join(INCARNATION_FILE), br#"{"id":"0123456789ab","created_at_ms":1}"#).unwrap();
        assert!(store.incarnation().unwrap().is_some_and(|i| i.beside));
        let written = serde_json::to_string(&Incarnation::generate().unwrap()).unwrap();
        assert!(written.contains(r#""beside":false"#), "{written}");
    }

    #[test]
    fn records_without_newer_fields_still_decode() {
        let mut old = serde_json::to_value(record(1)).unwrap();
        old.as_object_mut().unwrap().remove("dropped");
        old["pending"][0].as_object_mut().unwrap().remove("rows");
        let body = serde_json::to_vec(&old).unwrap();
        let digest = format!("{:x}", Sha256::digest(&body));
        let mut bytes = format!("{MAGIC} v{FORMAT_VERSION} len={} sha256={digest}\n", body.len()).into_bytes();
        bytes.extend_from_slice(&body);
        let decoded = decode(&bytes).unwrap();
        assert_eq!(decoded.pending[0].rows, 0);
        assert!(decoded.dropped.is_empty());
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // Renaming onto a directory that holds a file fails, after the
        // temporary file was written (as a full disk fails the write).
        let target = dir.path().join("chk-1.json");
        fs::create_dir(&target).unwrap();
        fs::write(target.join("x"), b"x").unwrap();
        assert!(write_atomic(&target, b"record").is_err());
        let left: Vec<String> =
            fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(left, ["chk-1.json"]);
    }

    #[test]
    fn a_state_directory_through_a_file_is_refused_as_not_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("state");
        fs::write(&file, b"x").unwrap();
        for path in [file.clone(), file.join("below")] {
            let err = CheckpointStore::open(&path, "j", 3).unwrap_err().to_string();
            assert!(err.contains(&format!("{} is not a directory", file.display())), "{err}");
            assert!(!err.contains("File exists") && !err.contains("os error"), "{err}");
        }
    }

    #[test]
    fn second_open_is_locked_out() {
        let dir = tempfile::tempdir().unwrap();
        let _first = CheckpointStore::open(dir.path(), "j", 3).unwrap();
        let err = CheckpointStore::open(dir.path(), "j", 3).unwrap_err();
        assert!(matches!(err, CheckpointError::Locked { .. }), "{err}");
    }
}
