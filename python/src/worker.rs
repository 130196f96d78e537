//! `Worker`: one writer of a job in a process of its own (a Ray actor).
//!
//! Invariant: a worker reads only its own split of the source and answers
//! each round with the report the coordinator decodes; every call runs with
//! the GIL released.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use sluice_engine::EngineError;
use sluice_engine::pool::{self, WriterSetup};

use crate::errors::{lock, to_py};
use crate::host::Host;
use crate::job::Job;

/// One writer of a job in a process of its own (a Ray actor): it reads its
/// own split of the job's source and writes it through its own plugin
/// instance, one round per checkpoint.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Worker {
    inner: Mutex<pool::Worker>,
    subtask: u32,
}

#[pymethods]
impl Worker {
    /// `setup` is what the coordinator handed the pool's `open`.
    #[new]
    fn new(py: Python<'_>, job: &Job, host: &Host, setup: Vec<u8>) -> PyResult<Self> {
        let (job, host) = (job.job.clone(), host.host.clone());
        py.detach(move || {
            let setup = WriterSetup::decode(&setup)?;
            let subtask = setup.subtask;
            let worker = pool::Worker::open(&job, &host, setup)?;
            Ok::<_, EngineError>(Self { inner: Mutex::new(worker), subtask })
        })
        .map_err(to_py)
    }

    #[getter]
    fn subtask(&self) -> u32 {
        self.subtask
    }

    /// Runs round `checkpoint`; its report, for the coordinator.
    fn round<'py>(&self, py: Python<'py>, checkpoint: u64) -> PyResult<Bound<'py, PyBytes>> {
        let report = py
            .detach(|| lock(&self.inner).map(|mut w| w.round(checkpoint).and_then(|r| r.encode())))?
            .map_err(to_py)?;
        Ok(PyBytes::new(py, &report))
    }

    fn apply(&self, py: Python<'_>, changes: Vec<u8>) -> PyResult<()> {
        py.detach(|| {
            lock(&self.inner).map(|mut w| pool::decode_changes(&changes).and_then(|changes| w.apply(&changes)))
        })?
        .map_err(to_py)
    }

    fn abort_prepare(&self, py: Python<'_>, checkpoint: u64) -> PyResult<()> {
        py.detach(|| lock(&self.inner).map(|mut w| w.abort_prepare(checkpoint)))?.map_err(to_py)
    }

    /// Closes the writer; the largest linear memory its instance had, in bytes.
    fn close(&self, py: Python<'_>) -> PyResult<u64> {
        py.detach(|| lock(&self.inner).map(|mut w| w.close()))?.map_err(to_py)
    }
}
