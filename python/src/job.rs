//! `Job`: a job file, parsed as `sluice run` parses it.
//!
//! Invariant: a `Job` keeps the text, path and overrides it was parsed from,
//! so another process parses the very same job (`Job.from_text`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use sluice_engine::config::EngineConfig;

use crate::errors::{SluiceError, to_py};

/// A job file, parsed and checked as `sluice run` does.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Job {
    pub(crate) job: Arc<EngineConfig>,
    text: String,
    path: PathBuf,
    overrides: Vec<String>,
}

impl Job {
    fn parse(text: String, path: PathBuf, overrides: Vec<String>) -> PyResult<Self> {
        let job = sluice_job::from_str(&text, &path, &overrides).map_err(to_py)?;
        Ok(Self { job: Arc::new(job), text, path, overrides })
    }
}

#[pymethods]
impl Job {
    /// Reads a job file; `overrides` are `KEY=VALUE` like `sluice run --set`.
    #[staticmethod]
    #[pyo3(signature = (path, overrides = Vec::new()))]
    fn load(path: PathBuf, overrides: Vec<String>) -> PyResult<Self> {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| SluiceError::new_err(format!("cannot read job file {}: {e}", path.display())))?;
        Self::parse(text, path, overrides)
    }

    /// A job from its text; `path` names it and anchors its relative paths.
    #[staticmethod]
    #[pyo3(signature = (text, path, overrides = Vec::new()))]
    fn from_text(text: String, path: PathBuf, overrides: Vec<String>) -> PyResult<Self> {
        Self::parse(text, path, overrides)
    }

    #[getter]
    fn id(&self) -> String {
        self.job.spec.job.id.clone()
    }

    #[getter]
    fn sink_id(&self) -> String {
        self.job.spec.sink.id.clone()
    }

    #[getter]
    fn parallelism(&self) -> u32 {
        self.job.spec.job.parallelism
    }

    #[getter]
    fn state_dir(&self) -> PathBuf {
        self.job.state_dir.clone()
    }

    #[getter]
    fn retain(&self) -> usize {
        self.job.spec.job.checkpoint.retain
    }

    /// The job file's text, path and overrides: what another process needs
    /// to parse the same job (`Job.from_text`).
    #[getter]
    fn text(&self) -> String {
        self.text.clone()
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    #[getter]
    fn overrides(&self) -> Vec<String> {
        self.overrides.clone()
    }

    fn __repr__(&self) -> String {
        format!("Job(id={:?}, path={:?})", self.job.spec.job.id, self.path.display().to_string())
    }
}
