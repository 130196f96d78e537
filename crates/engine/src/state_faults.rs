//! The state directory behind seeded faults ([`crate::fault::Sim`]), for
//! the simulation: any [`StateBackend`], local or on an object store, seen
//! through a layer that makes an operation fail before it happens, happen
//! with its reply lost, or (a listing for pruning) answer stale.
//!
//! Invariants:
//! - only a build with the `fault-injection` feature has this layer; a
//!   released build opens its state directory as it is;
//! - a lost reply is reported the way the backend reports one of its own:
//!   a record written with its reply lost is an unknown outcome
//!   ([`CheckpointError::outcome_unknown`]), never a "not written";
//! - the faults never reach the reads a run resumes from: a state
//!   directory's listing must be current (local disks, S3 and GCS list
//!   strongly consistently), so a stale listing is simulated only where
//!   the protocol tolerates one, the listing that prunes old records.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use super::checkpoint::{CheckpointError, StateBackend, StateFile};
use crate::fault::{Sim, SimFault};

/// A backend behind seeded faults.
#[derive(Debug)]
pub(super) struct FaultyState {
    inner: Box<dyn StateBackend>,
    sim: Arc<Sim>,
    /// The last pruning listing, answered again when a listing is stale.
    listed: Mutex<Option<Vec<u64>>>,
}

impl FaultyState {
    pub(super) fn new(inner: Box<dyn StateBackend>, sim: Arc<Sim>) -> Self {
        Self { inner, sim, listed: Mutex::new(None) }
    }

    fn injected(&self, op: &str, path: PathBuf) -> CheckpointError {
        CheckpointError::Io {
            path,
            source: std::io::Error::other(format!("simulated fault of {op} (seed {})", self.sim.seed())),
        }
    }
}

impl StateBackend for FaultyState {
    fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        match self.sim.decide("state.read-file", file.name()) {
            SimFault::FailBefore | SimFault::LoseReply => Err(self.injected("read-file", self.file_path(file))),
            SimFault::Pass | SimFault::Stale => self.inner.read_file(file),
        }
    }

    fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        let path = self.file_path(file);
        match self.sim.decide("state.write-file", file.name()) {
            SimFault::FailBefore => Err(self.injected("write-file", path)),
            SimFault::LoseReply => {
                self.inner.write_file(file, bytes)?;
                Err(self.injected("write-file (reply lost)", path.clone()).unknown(path))
            }
            SimFault::Pass | SimFault::Stale => self.inner.write_file(file, bytes),
        }
    }

    fn file_path(&self, file: StateFile) -> PathBuf {
        self.inner.file_path(file)
    }

    fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        match self.sim.decide("state.list", "checkpoints") {
            SimFault::FailBefore | SimFault::LoseReply => Err(self.injected("list", self.records_dir())),
            SimFault::Pass | SimFault::Stale => self.inner.ids(),
        }
    }

    fn ids_to_prune(&self) -> Result<Vec<u64>, CheckpointError> {
        match self.sim.decide("state.list-to-prune", "checkpoints") {
            SimFault::FailBefore | SimFault::LoseReply => Err(self.injected("list", self.records_dir())),
            SimFault::Stale => {
                let before = self.listed.lock().ok().and_then(|l| l.clone());
                match before {
                    Some(ids) => Ok(ids),
                    None => self.inner.ids_to_prune(),
                }
            }
            SimFault::Pass => {
                let ids = self.inner.ids_to_prune()?;
                if let Ok(mut listed) = self.listed.lock() {
                    *listed = Some(ids.clone());
                }
                Ok(ids)
            }
        }
    }

    fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        match self.sim.decide("state.read-record", "record") {
            SimFault::FailBefore | SimFault::LoseReply => Err(self.injected("read-record", self.record_path(c))),
            SimFault::Pass | SimFault::Stale => self.inner.read_record(c),
        }
    }

    fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        let path = self.record_path(c);
        match self.sim.decide("state.write-record", &format!("checkpoint {c}")) {
            SimFault::FailBefore => Err(self.injected("write-record", path)),
            SimFault::LoseReply => {
                self.inner.write_record(c, bytes)?;
                Err(self.injected("write-record (reply lost)", path.clone()).unknown(path))
            }
            SimFault::Pass | SimFault::Stale => self.inner.write_record(c, bytes),
        }
    }

    fn delete_record(&self, c: u64) {
        match self.sim.decide("state.delete-record", &format!("checkpoint {c}")) {
            SimFault::FailBefore => {
                tracing::warn!(checkpoint = c, "could not prune old checkpoint record (simulated)");
            }
            SimFault::LoseReply => {
                self.inner.delete_record(c);
                tracing::warn!(checkpoint = c, "could not prune old checkpoint record (simulated lost reply)");
            }
            SimFault::Pass | SimFault::Stale => self.inner.delete_record(c),
        }
    }

    fn check_held(&self) -> Result<(), CheckpointError> {
        self.inner.check_held()
    }

    fn dir(&self) -> PathBuf {
        self.inner.dir()
    }

    fn records_dir(&self) -> PathBuf {
        self.inner.records_dir()
    }

    fn record_path(&self, c: u64) -> PathBuf {
        self.inner.record_path(c)
    }
}
