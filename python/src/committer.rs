//! `Committer`: the plugin's committer instance, driven from Python.
//!
//! Invariant: every call runs with the GIL released; a commit the target
//! already holds answers `"already-committed"`, never commits twice.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use sluice::bindings::CommitOutcome;
use sluice::plugin::CommitterInstance;

use crate::errors::{lock, to_py};

/// The committer: combines the writers' commit infos and commits them,
/// idempotently.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Committer {
    inner: Mutex<CommitterInstance>,
}

impl Committer {
    pub(crate) fn new(committer: CommitterInstance) -> Self {
        Self { inner: Mutex::new(committer) }
    }
}

#[pymethods]
impl Committer {
    fn combine<'py>(&self, py: Python<'py>, checkpoint: u64, infos: Vec<Vec<u8>>) -> PyResult<Bound<'py, PyBytes>> {
        let combined = py.detach(|| lock(&self.inner).map(|mut c| c.combine(checkpoint, &infos)))?.map_err(to_py)?;
        Ok(PyBytes::new(py, &combined))
    }

    /// Commits a combined checkpoint: `"committed"`, or `"already-committed"`
    /// when its idempotence key is in the target already. Raises `Retryable`
    /// when the plugin asks for the commit to be made again.
    fn commit(&self, py: Python<'_>, checkpoint: u64, combined: Vec<u8>) -> PyResult<&'static str> {
        let outcome = py.detach(|| lock(&self.inner).map(|mut c| c.commit(checkpoint, &combined)))?.map_err(to_py)?;
        Ok(match outcome {
            CommitOutcome::Committed => "committed",
            CommitOutcome::AlreadyCommitted => "already-committed",
        })
    }

    fn abort(&self, py: Python<'_>, checkpoint: u64, combined: Vec<u8>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).map(|mut c| c.abort(checkpoint, &combined)))?.map_err(to_py)
    }
}
