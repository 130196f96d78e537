//! `run`: the engine's coordinator and committer in this process, driving
//! writers that a Python pool object runs anywhere (the Ray runner's actors).
//!
//! Invariant: the coordinator runs with the GIL released and takes it back
//! only to call the pool; a writer the pool reports lost is a
//! `WriterLost`, any other failure of it a remote or pool error.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use sluice_engine::pool::{self, WriterEnv, WriterPool, WriterSetup};
use sluice_engine::progress::{Progress, ProgressMode};
use sluice_engine::tables::Change;
use sluice_engine::{self as engine, EngineError, RoundReport, RunOptions};

use crate::errors::{WriterLost, to_py};
use crate::host::Host;
use crate::job::Job;

/// A [`WriterPool`] whose writers a Python object runs (the Ray runner).
///
/// The object has the methods `open(setups: list[bytes])`,
/// `start_round(c)`, `gather(c) -> list[bytes | BaseException]` (a report,
/// or why that writer failed; `WriterLost` for a lost one),
/// `abort_prepare(c, subtasks)`, `apply(changes: bytes)` and
/// `close() -> int`.
pub(crate) struct PyPool {
    pool: Py<PyAny>,
    writers: usize,
    progress: Option<Arc<Progress>>,
}

impl PyPool {
    fn call<A: for<'py> pyo3::call::PyCallArgs<'py>>(&self, method: &str, args: A) -> Result<Py<PyAny>, EngineError> {
        Python::attach(|py| self.pool.call_method1(py, method, args).map_err(|e| remote_error(py, None, &e)))
    }
}

/// A Python exception of the pool (about one writer, or about the pool
/// as a whole) as an engine error.
pub(crate) fn remote_error(py: Python<'_>, subtask: Option<u32>, e: &PyErr) -> EngineError {
    let message = e.value(py).to_string();
    match (e.is_instance_of::<WriterLost>(py), subtask) {
        (true, Some(subtask)) => EngineError::WriterLost { subtask, message },
        (true, None) => EngineError::WritersLost { message },
        (false, Some(subtask)) => EngineError::Remote { subtask, message },
        (false, None) => EngineError::Pool { message },
    }
}

impl WriterPool for PyPool {
    fn open(&mut self, env: Arc<WriterEnv>, setups: Vec<WriterSetup>) -> Result<(), EngineError> {
        self.writers = setups.len();
        self.progress = Some(env.progress.clone());
        let encoded = setups.iter().map(WriterSetup::encode).collect::<Result<Vec<_>, _>>()?;
        Python::attach(|py| {
            let list =
                PyList::new(py, encoded.iter().map(|b| PyBytes::new(py, b))).map_err(|e| remote_error(py, None, &e))?;
            self.pool.call_method1(py, "open", (list,)).map_err(|e| remote_error(py, None, &e))
        })?;
        Ok(())
    }

    fn start_round(&mut self, c: u64) -> Result<(), EngineError> {
        self.call("start_round", (c,)).map(|_| ())
    }

    fn gather(&mut self, c: u64) -> Vec<Result<RoundReport, EngineError>> {
        let results: Vec<Result<Vec<u8>, EngineError>> = Python::attach(|py| {
            let answers = match self.pool.call_method1(py, "gather", (c,)) {
                Ok(a) => a,
                Err(e) => {
                    let error = remote_error(py, None, &e);
                    return (0..self.writers).map(|_| Err(clone_error(&error))).collect();
                }
            };
            let answers = answers.bind(py);
            (0..self.writers)
                .map(|i| {
                    let item = answers.get_item(i).map_err(|e| remote_error(py, Some(i as u32), &e))?;
                    if let Ok(bytes) = item.cast::<PyBytes>() {
                        return Ok(bytes.as_bytes().to_vec());
                    }
                    let error = PyErr::from_value(item);
                    Err(remote_error(py, Some(i as u32), &error))
                })
                .collect()
        });
        results
            .into_iter()
            .map(|r| {
                let report = RoundReport::decode(&r?)?;
                if let Some(progress) = &self.progress {
                    progress.add_rows(report.rows);
                }
                Ok(report)
            })
            .collect()
    }

    fn abort_prepare(&mut self, c: u64, subtasks: &[u32]) {
        if let Err(e) = self.call("abort_prepare", (c, subtasks.to_vec())) {
            tracing::warn!(checkpoint = c, error = %e, "abort-prepare failed");
        }
    }

    fn apply(&mut self, changes: &[Change]) -> Result<(), EngineError> {
        let encoded = pool::encode_changes(changes)?;
        Python::attach(|py| {
            self.pool.call_method1(py, "apply", (PyBytes::new(py, &encoded),)).map_err(|e| remote_error(py, None, &e))
        })?;
        Ok(())
    }

    fn close(&mut self) -> Result<u64, EngineError> {
        let peak = self.call("close", ())?;
        Python::attach(|py| peak.extract::<u64>(py).map_err(|e| remote_error(py, None, &e)))
    }

    fn len(&self) -> usize {
        self.writers
    }
}

/// The same failure for every writer of a failed `gather`.
pub(crate) fn clone_error(e: &EngineError) -> EngineError {
    match e {
        EngineError::WriterLost { message, .. } | EngineError::WritersLost { message } => {
            EngineError::WritersLost { message: message.clone() }
        }
        other => EngineError::Pool { message: other.to_string() },
    }
}

/// Runs `job` to the end of its source, resuming from its last checkpoint,
/// with this process as the coordinator and committer and the writers in
/// `pool`. Returns the run's summary as a dict.
#[pyfunction]
#[pyo3(signature = (job, host, pool, new_incarnation = false, quiet = false))]
pub(crate) fn run<'py>(
    py: Python<'py>,
    job: &Job,
    host: &Host,
    pool: Py<PyAny>,
    new_incarnation: bool,
    quiet: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let (job_file, host) = (job.job.clone(), host.host.clone());
    let mut pool = PyPool { pool, writers: 0, progress: None };
    let progress = if quiet { ProgressMode::Quiet } else { ProgressMode::Plain };
    let summary = py
        .detach(move || engine::run_on(&job_file, &host, &RunOptions::new(progress, new_incarnation), &mut pool))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("text", summary.to_string())?;
    d.set_item("job_id", summary.job_id.clone())?;
    d.set_item("incarnation", summary.incarnation.clone())?;
    d.set_item("attempt", summary.attempt)?;
    d.set_item("resumed_from", summary.resumed_from)?;
    d.set_item("rows_this_run", summary.rows_this_run)?;
    d.set_item("rows_total", summary.rows_total)?;
    d.set_item("checkpoints_this_run", summary.checkpoints_this_run)?;
    d.set_item("last_committed", summary.last_committed)?;
    d.set_item("elapsed", summary.elapsed.as_secs_f64())?;
    d.set_item("data_elapsed", summary.data_elapsed.as_secs_f64())?;
    d.set_item("already_complete", summary.already_complete)?;
    Ok(d)
}
