//! `CheckpointStore`: a job's state directory, in the CLI's format.
//!
//! Invariants:
//! - Python reads records here but never writes one; only the engine
//!   (`run`, `Landing`) does;
//! - a state directory is a location as `job.state_dir` takes it: a local
//!   path, `s3://bucket/prefix` or `gs://bucket/prefix` (held by a lease
//!   there); a scheme the
//!   engine does not serve is refused, never taken for a relative path.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;

use sluice_engine::checkpoint::{CheckpointStore as Store, Incarnation};
use sluice_engine::config::STATE_DIR_SERVED;
use sluice_engine::location::Location;

use crate::errors::{SluiceError, to_py};
use crate::job::Job;

/// A job's durable checkpoint store (its state directory), in the format
/// `sluice run` writes. Records are JSON documents, read here and written
/// only by the engine (`run`, `Landing`).
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct CheckpointStore {
    store: Store,
}

#[pymethods]
impl CheckpointStore {
    /// Opens and holds the state directory of `job_id`: a local path
    /// (relative to the working directory), locked, or `s3://bucket/prefix`
    /// or `gs://bucket/prefix`,
    /// under a lease of `lease_secs`.
    #[new]
    #[pyo3(signature = (state_dir, job_id, retain = 3, lease_secs = 30.0))]
    fn new(py: Python<'_>, state_dir: PathBuf, job_id: String, retain: usize, lease_secs: f64) -> PyResult<Self> {
        let text = state_dir
            .to_str()
            .ok_or_else(|| SluiceError::new_err(format!("state directory {}: not UTF-8", state_dir.display())))?;
        let cwd = std::env::current_dir()
            .map_err(|e| SluiceError::new_err(format!("state directory {text}: no working directory: {e}")))?;
        let location = Location::parse(text, &cwd, STATE_DIR_SERVED)
            .map_err(|e| SluiceError::new_err(format!("state directory {text}: {e}")))?;
        // The range `job.lease_secs` takes: no conversion below can fail.
        let lease = sluice_engine::config::seconds(lease_secs, sluice_engine::config::LEASE_SECS)
            .map_err(|m| SluiceError::new_err(format!("lease_secs = {lease_secs}: {m}")))?;
        let store =
            py.detach(|| Store::open_at(&location, &job_id, retain, lease, &Default::default())).map_err(to_py)?;
        Ok(Self { store })
    }

    /// Opens and holds the state directory of `job`, as `sluice run` does
    /// (its `job.state_dir`, retention and lease).
    #[staticmethod]
    fn for_job(py: Python<'_>, job: &Job) -> PyResult<Self> {
        let job = job.job.clone();
        let spec = &job.spec;
        let lease = Duration::from_secs_f64(spec.job.lease_secs);
        let store = py
            .detach(|| Store::open_at(&job.state, &spec.job.id, spec.job.checkpoint.retain, lease, &job.state_stores))
            .map_err(to_py)?;
        Ok(Self { store })
    }

    /// The newest record, as JSON, or `None` in a new state directory.
    fn latest(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let record = py.detach(|| self.store.latest()).map_err(to_py)?;
        record.map(|r| serde_json::to_string(&r).map_err(|e| SluiceError::new_err(e.to_string()))).transpose()
    }

    /// The incarnation id of the state directory, if it has one.
    fn incarnation(&self) -> PyResult<Option<String>> {
        Ok(self.store.incarnation().map_err(to_py)?.map(|i| i.id))
    }

    /// Gives a new state directory a new incarnation id and returns it.
    fn start_incarnation(&self) -> PyResult<String> {
        let incarnation = Incarnation::generate().map_err(to_py)?;
        self.store.set_incarnation(&incarnation).map_err(to_py)?;
        Ok(incarnation.id)
    }

    /// Counts a new run and returns its attempt number.
    fn next_attempt(&self) -> PyResult<u32> {
        self.store.next_attempt().map_err(to_py)
    }

    /// Why the state directory is halted, if it is.
    fn halted(&self) -> PyResult<Option<String>> {
        Ok(self.store.halted().map_err(to_py)?.map(|h| h.reason))
    }

    fn halt(&self, reason: &str) -> PyResult<()> {
        self.store.halt(reason).map_err(to_py)
    }
}
