//! `Sink`: a job's plugin with the grants and limits the job gives it, which
//! opens [`Writer`]s and [`Committer`]s from a sink context (a Python dict).
//!
//! Invariant: an instance opens with the options `sluice run` would give it:
//! the job's, the caller's over them, and the host's own the plugin takes.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use sluice_engine as engine;
use sluice_engine::capability::Granted;
use sluice_engine::plugin::{CommitterInstance, Limits, Plugin, SinkCtx, SourceTable, WriterInstance};

use crate::committer::Committer;
use crate::errors::{SluiceError, to_py};
use crate::host::{Host, describe};
use crate::job::Job;
use crate::writer::Writer;

/// A sink context from a Python dict (`job_id`, `sink_id`, `incarnation`,
/// `subtask`, `parallelism`, and optionally `attempt` and
/// `refuse_other_incarnations`).
pub(crate) fn sink_ctx(d: &Bound<'_, PyDict>) -> PyResult<SinkCtx> {
    fn get<'py, T: for<'a> FromPyObject<'a, 'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
        match d.get_item(key)? {
            Some(v) => Ok(Some(v.extract::<T>().map_err(Into::into)?)),
            None => Ok(None),
        }
    }
    let required = |key: &str| SluiceError::new_err(format!("sink context: `{key}` is required"));
    Ok(SinkCtx {
        job_id: get(d, "job_id")?.ok_or_else(|| required("job_id"))?,
        sink_id: get(d, "sink_id")?.ok_or_else(|| required("sink_id"))?,
        incarnation: get(d, "incarnation")?.ok_or_else(|| required("incarnation"))?,
        refuse_other_incarnations: get(d, "refuse_other_incarnations")?.unwrap_or(false),
        beside: get(d, "beside")?.unwrap_or(false),
        subtask: get(d, "subtask")?.ok_or_else(|| required("subtask"))?,
        parallelism: get(d, "parallelism")?.ok_or_else(|| required("parallelism"))?,
        attempt: get(d, "attempt")?.unwrap_or(0),
        dead_letter_table: get(d, "dead_letter_table")?,
        incarnation_created_ms: get(d, "incarnation_created_ms")?.unwrap_or(0),
    })
}

/// `[(name, schema)]`, each schema an Arrow IPC stream without batches.
pub(crate) fn source_tables(tables: Vec<(String, Vec<u8>)>) -> Vec<SourceTable> {
    tables.into_iter().map(|(name, schema)| SourceTable { name, schema }).collect()
}

/// A job's sink: its plugin, loaded, with the grants and sandbox limits
/// the job's `[sink]` section gives it.
#[pyclass(frozen, module = "sluice._native")]
pub(crate) struct Sink {
    plugin: Plugin,
    grants: Granted,
    limits: Limits,
    job_options: Vec<(String, String)>,
}

#[pymethods]
impl Sink {
    #[new]
    fn new(py: Python<'_>, job: &Job, host: &Host) -> PyResult<Self> {
        let (job, host) = (job.job.clone(), host.host.clone());
        py.detach(move || {
            let plugin = host.load(&job.spec.sink.plugin).map_err(to_py)?;
            let (grants, limits) = engine::grants_and_limits(&job).map_err(to_py)?;
            Ok(Self { plugin, grants, limits, job_options: job.sink_options() })
        })
    }

    /// What the plugin says of itself.
    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        describe(py, &self.plugin)
    }

    /// The options an instance with `ctx` opens with: the job's, with
    /// `options` over them, plus the host's own that the plugin takes.
    fn options(
        &self,
        ctx: &Bound<'_, PyDict>,
        options: Option<Vec<(String, String)>>,
    ) -> PyResult<Vec<(String, String)>> {
        let ctx = sink_ctx(ctx)?;
        Ok(self.options_for(&ctx, options))
    }

    /// Opens a writer. `tables` is `[(name, schema_ipc)]` (`""` names a
    /// single-table source); `restored` is a state `snapshot_state` returned.
    #[pyo3(signature = (ctx, tables, restored = None, options = None))]
    fn open_writer(
        &self,
        py: Python<'_>,
        ctx: &Bound<'_, PyDict>,
        tables: Vec<(String, Vec<u8>)>,
        restored: Option<Vec<u8>>,
        options: Option<Vec<(String, String)>>,
    ) -> PyResult<Writer> {
        let ctx = sink_ctx(ctx)?;
        let options = self.options_for(&ctx, options);
        let schemas = tables
            .iter()
            .map(|(name, schema)| {
                let schema = sluice_engine::ipc::decode_schema(schema).map_err(|e| {
                    SluiceError::new_err(format!("table {name:?}: its schema is not an Arrow IPC schema: {e}"))
                })?;
                Ok((name.clone(), schema))
            })
            .collect::<PyResult<_>>()?;
        let tables = source_tables(tables);
        let name = format!("writer[{}]", ctx.subtask);
        let writer = py
            .detach(|| {
                let inst = self.plugin.instantiate(&name, &self.grants, self.limits)?;
                WriterInstance::open(inst, &ctx, &options, &tables, restored.as_deref())
            })
            .map_err(to_py)?;
        Ok(Writer::new(writer, schemas))
    }

    /// Opens the committer (the one fan-in of a job).
    #[pyo3(signature = (ctx, tables, options = None))]
    fn open_committer(
        &self,
        py: Python<'_>,
        ctx: &Bound<'_, PyDict>,
        tables: Vec<(String, Vec<u8>)>,
        options: Option<Vec<(String, String)>>,
    ) -> PyResult<Committer> {
        let ctx = sink_ctx(ctx)?;
        let options = self.options_for(&ctx, options);
        let tables = source_tables(tables);
        let committer = py
            .detach(|| {
                let inst = self.plugin.instantiate("committer", &self.grants, self.limits)?;
                CommitterInstance::open(inst, &ctx, &options, &tables)
            })
            .map_err(to_py)?;
        Ok(Committer::new(committer))
    }
}

impl Sink {
    fn options_for(&self, ctx: &SinkCtx, options: Option<Vec<(String, String)>>) -> Vec<(String, String)> {
        let mut merged = self.job_options.clone();
        for (k, v) in options.unwrap_or_default() {
            merged.retain(|(key, _)| key != &k);
            merged.push((k, v));
        }
        self.plugin.options_for(merged, ctx)
    }
}
