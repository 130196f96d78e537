//! `CheckpointStore`: a job's state directory, in the CLI's format.
//!
//! Invariant: Python reads records here but never writes one; only the
//! engine (`run`, `Landing`) does.

use std::path::PathBuf;

use pyo3::prelude::*;

use sluice::engine::checkpoint::{CheckpointStore as Store, Incarnation};

use crate::errors::{SluiceError, to_py};

/// A job's durable checkpoint store (its state directory), in the format
/// `sluice run` writes. Records are JSON documents, read here and written
/// only by the engine (`run`, `Landing`).
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct CheckpointStore {
    store: Store,
}

#[pymethods]
impl CheckpointStore {
    /// Opens and locks the state directory of `job_id`.
    #[new]
    #[pyo3(signature = (state_dir, job_id, retain = 3))]
    fn new(state_dir: PathBuf, job_id: String, retain: usize) -> PyResult<Self> {
        Ok(Self { store: Store::open(&state_dir, &job_id, retain).map_err(to_py)? })
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
