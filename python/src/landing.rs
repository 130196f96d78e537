//! `Landing`: a dataset written by writers elsewhere (Ray Data write tasks)
//! committed as a job's one checkpoint by the engine
//! (`sluice_engine::landing`).
//!
//! Invariant: Python hands the landing commit infos and row counts only;
//! the record, its persistence, the incarnation, the commit's retries and
//! the key-reuse halt are the engine's.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use sluice_engine::bindings::CommitOutcome;
use sluice_engine::landing::{self, Part};
use sluice_engine::progress::ProgressMode;
use sluice_engine::{Faults, RunOptions};

use crate::errors::{SluiceError, lock, to_py};
use crate::host::Host;
use crate::job::Job;

/// A landing of one dataset through a job's sink (`sluice.ray.Datasink`).
///
/// Opening it locks the job's state directory and settles its incarnation;
/// a state directory that already landed a dataset gets what its record
/// left pending committed, and the landing is refused (`SluiceError`).
/// Writers open with `context()` (each setting its own `subtask`); their
/// `prepare_commit(1)` answers go to `land`, which persists the checkpoint
/// and only then commits it.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Landing {
    inner: Mutex<Option<landing::Landing>>,
}

impl Landing {
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut landing::Landing) -> Result<R, sluice_engine::EngineError> + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            let mut guard = lock(&self.inner)?;
            let landing = guard.as_mut().ok_or_else(|| SluiceError::new_err("the landing is closed"))?;
            f(landing).map_err(to_py)
        })
    }
}

#[pymethods]
impl Landing {
    /// `new_incarnation`: the state directory is new and lands beside the
    /// job's other incarnations on purpose (`sluice run --new-incarnation`).
    #[new]
    #[pyo3(signature = (job, host, new_incarnation = false))]
    fn new(py: Python<'_>, job: &Job, host: &Host, new_incarnation: bool) -> PyResult<Self> {
        let (job, host) = (job.job.clone(), host.host.clone());
        // A test build may be asked for a crash (`SLUICE_TEST_CRASH`); a released one never.
        let opts = RunOptions { faults: Faults::from_env(), ..RunOptions::new(ProgressMode::Quiet, new_incarnation) };
        let landing = py.detach(move || landing::Landing::open(job, &host, &opts)).map_err(to_py)?;
        Ok(Self { inner: Mutex::new(Some(landing)) })
    }

    /// The sink context writers open with, as `Sink.open_writer` takes it;
    /// each writer sets its own `subtask`.
    fn context<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ctx = self.with(py, |l| Ok(l.writer_ctx()))?;
        let d = PyDict::new(py);
        d.set_item("job_id", ctx.job_id)?;
        d.set_item("sink_id", ctx.sink_id)?;
        d.set_item("incarnation", ctx.incarnation)?;
        d.set_item("refuse_other_incarnations", ctx.refuse_other_incarnations)?;
        d.set_item("beside", ctx.beside)?;
        d.set_item("subtask", ctx.subtask)?;
        d.set_item("parallelism", ctx.parallelism)?;
        d.set_item("attempt", ctx.attempt)?;
        Ok(d)
    }

    /// Opens the committer for the dataset's schema (Arrow IPC, no
    /// batches): a sink that creates its table does so before any writer
    /// opens. `land` opens it when this was not called.
    fn open_committer(&self, py: Python<'_>, schema: Vec<u8>) -> PyResult<()> {
        self.with(py, |l| l.open_committer(&schema))
    }

    /// Lands the parts, each `(commit_info or None, rows)`, as checkpoint 1:
    /// combined, persisted, then committed. Returns a summary dict whose
    /// `outcome` is `"committed"`, `"already-committed"` or `None` (nothing
    /// to commit).
    fn land<'py>(
        &self,
        py: Python<'py>,
        parts: Vec<(Option<Vec<u8>>, u64)>,
        schema: Vec<u8>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let parts: Vec<Part> = parts.into_iter().map(|(info, rows)| Part { info, rows }).collect();
        let summary = self.with(py, |l| l.land(&parts, &schema))?;
        let d = PyDict::new(py);
        d.set_item("job_id", summary.job_id)?;
        d.set_item("incarnation", summary.incarnation)?;
        d.set_item("new_incarnation", summary.new_incarnation)?;
        d.set_item("attempt", summary.attempt)?;
        d.set_item("parts", summary.parts)?;
        d.set_item("rows", summary.rows)?;
        d.set_item(
            "outcome",
            summary.outcome.map(|o| match o {
                CommitOutcome::Committed => "committed",
                CommitOutcome::AlreadyCommitted => "already-committed",
            }),
        )?;
        Ok(d)
    }

    /// Releases the state directory (also when the landing is dropped).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| lock(&self.inner).map(|mut l| drop(l.take())))
    }
}
