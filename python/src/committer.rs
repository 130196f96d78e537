//! `Committer`: the plugin's committer instance, opened from Python only so
//! that the target takes a schema (opening it creates or evolves the
//! tables, idempotently).
//!
//! Invariant: it exposes no `combine`, `commit` or `abort`. There is one
//! protocol: every commit from Python or Ray goes through the engine's
//! coordinator (`Landing`, `run_on`), which persists a record before it
//! commits and releases files only on a definite "not persisted". A raw
//! commit or abort here would bypass both.

use std::sync::Mutex;

use pyo3::prelude::*;

use sluice_engine::plugin::CommitterInstance;

/// An open committer: the target has taken the schemas it was opened with.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Committer {
    _inner: Mutex<CommitterInstance>,
}

impl Committer {
    pub(crate) fn new(committer: CommitterInstance) -> Self {
        Self { _inner: Mutex::new(committer) }
    }
}
