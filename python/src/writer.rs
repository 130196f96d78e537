//! `Writer`: one plugin writer instance, driven from Python.
//!
//! Invariant: every call runs with the GIL released, and a batch crosses into
//! the plugin whole, as Arrow IPC; a closed writer refuses further calls.

use std::collections::BTreeMap;
use std::sync::Mutex;

use arrow_schema::SchemaRef;

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use sluice_engine::plugin::WriterInstance;

use crate::errors::{SluiceError, lock, to_py};

/// A writer: takes Arrow IPC batches, prepares a checkpoint's commit and
/// snapshots its state.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Writer {
    inner: Mutex<Option<WriterInstance>>,
    /// The schema of each table the writer was opened with, by name.
    tables: BTreeMap<String, SchemaRef>,
}

impl Writer {
    pub(crate) fn new(writer: WriterInstance, tables: BTreeMap<String, SchemaRef>) -> Self {
        Self { inner: Mutex::new(Some(writer)), tables }
    }

    /// What the host promises a plugin of every batch: a valid stream, in
    /// the schema of a table the writer knows.
    fn check(&self, table: &str, bytes: &[u8]) -> PyResult<()> {
        let schema = sluice_engine::ipc::validate_stream(bytes)
            .map_err(|e| SluiceError::new_err(format!("batch is not a valid Arrow IPC stream: {e}")))?;
        let Some(expected) = self.tables.get(table) else {
            let known: Vec<&str> = self.tables.keys().map(String::as_str).collect();
            return Err(SluiceError::new_err(format!(
                "batch of table {table:?}: the writer was opened with the tables {known:?}"
            )));
        };
        match sluice_engine::ipc::schema_mismatch(&schema, expected) {
            None => Ok(()),
            Some(why) => {
                Err(SluiceError::new_err(format!("batch of table {table:?} is not in the table's schema: {why}")))
            }
        }
    }

    fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut WriterInstance) -> R + Send) -> PyResult<R> {
        py.detach(|| {
            let mut guard = lock(&self.inner)?;
            let writer = guard.as_mut().ok_or_else(|| SluiceError::new_err("the writer is closed"))?;
            Ok(f(writer))
        })
    }
}

#[pymethods]
impl Writer {
    /// Writes one batch of `table` (`""` for a single-table sink): a pyarrow
    /// `RecordBatch`, or the bytes of an Arrow IPC stream
    /// (`sluice.ipc_batch`). Either way the batch crosses into the plugin
    /// whole, as Arrow IPC.
    #[pyo3(signature = (batch, table = String::new()))]
    fn write(&self, py: Python<'_>, batch: &Bound<'_, PyAny>, table: String) -> PyResult<()> {
        let encoded;
        let bytes: &[u8] = match batch.cast::<PyBytes>() {
            Ok(b) => b.as_bytes(),
            Err(_) => {
                encoded = py.import("sluice")?.getattr("ipc_batch")?.call1((batch,))?;
                encoded.cast::<PyBytes>().map_err(PyErr::from)?.as_bytes()
            }
        };
        // The bytes are read in place while the GIL is released: the caller
        // (or `encoded`) keeps them alive for the call. The host hands a
        // plugin only valid streams in the table's schema (the contract's
        // promise), so a user's own bytes are checked first.
        self.with(py, |w| {
            self.check(&table, bytes)?;
            w.write(&table, bytes).map_err(to_py)
        })?
    }

    /// Closes what the writer wrote since the last checkpoint; the commit
    /// info for the committer, or `None` when it wrote nothing.
    fn prepare_commit<'py>(&self, py: Python<'py>, checkpoint: u64) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let info = self.with(py, |w| w.prepare_commit(checkpoint))?.map_err(to_py)?;
        Ok(info.map(|b| PyBytes::new(py, &b)))
    }

    fn snapshot_state<'py>(&self, py: Python<'py>, checkpoint: u64) -> PyResult<Bound<'py, PyBytes>> {
        let state = self.with(py, |w| w.snapshot_state(checkpoint))?.map_err(to_py)?;
        Ok(PyBytes::new(py, &state))
    }

    /// Releases what `prepare_commit(checkpoint)` prepared (the checkpoint
    /// will never be committed).
    fn abort_prepare(&self, py: Python<'_>, checkpoint: u64) -> PyResult<()> {
        self.with(py, |w| w.abort_prepare(checkpoint))?.map_err(to_py)
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| {
            let mut guard = lock(&self.inner)?;
            match guard.take() {
                Some(mut w) => w.close().map_err(to_py),
                None => Ok(()),
            }
        })
    }
}
