//! `sluice._native`: Sluice's engine as a Python extension module.
//!
//! What a driver needs, and nothing it must re-implement:
//! - [`Job`]: a job file, parsed as `sluice run` parses it;
//! - [`Host`]: the WebAssembly engine and its compiled-component cache;
//! - [`Sink`]: a job's plugin with the grants and limits the job gives it,
//!   which opens [`Writer`]s and [`Committer`]s from a sink context;
//! - [`CheckpointStore`]: the durable store, in the CLI's format, to read
//!   (records are written by the engine only);
//! - [`landing::Landing`]: a dataset written by writers anywhere (Ray Data
//!   write tasks), persisted and committed as a job's one checkpoint;
//! - [`Worker`] and [`run`]: one writer of a job, and the coordinator that
//!   drives writers living anywhere (the Ray runner's actors) through a
//!   Python pool object.
//!
//! Invariants:
//! - every call into a plugin, the store or the coordinator runs with the
//!   GIL released; the coordinator takes it back only to call the pool;
//! - rows cross into a plugin as whole Arrow IPC batches, never row by row;
//! - every error is a `SluiceError` whose message is the one `sluice` prints
//!   (formatted as the CLI formats it, through anyhow); a writer that its pool
//!   reports lost is a `WriterLost`, so a runner can tell a lost machine
//!   (recover and replay) from a job error (stop and say why).

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use sluice::bindings::CommitOutcome;
use sluice::capability::Granted;
use sluice::engine::checkpoint::{CheckpointStore as Store, Incarnation};
use sluice::engine::pool::{self, WriterEnv, WriterPool, WriterSetup};
use sluice::engine::tables::Change;
use sluice::engine::{self, EngineError, RoundReport, RunOptions};
use sluice::job::Job as JobFile;
use sluice::plugin::{
    CommitterInstance, ComponentCache, Limits, Plugin, PluginError, PluginHost, SinkCtx, SinkErrorKind, SourceTable,
    WriterInstance,
};
use sluice::progress::{Progress, ProgressMode};

mod landing;

create_exception!(_native, SluiceError, PyException, "An error of Sluice; its message is the one `sluice` prints.");
create_exception!(
    _native,
    WriterLost,
    SluiceError,
    "A writer's process or machine was lost; the job resumes from its last checkpoint."
);
create_exception!(
    _native,
    Retryable,
    SluiceError,
    "The plugin answered `retryable`: the same call may succeed when made again (Sluice's own runs retry commits with backoff)."
);

/// The message `sluice` prints for an error (`sluice::cli::render` of the
/// anyhow error its `?` makes): the error and each of its causes, joined by
/// `: `, each said once.
fn message(e: impl std::error::Error + Send + Sync + 'static) -> String {
    sluice::cli::render(&anyhow::Error::new(e))
}

fn to_py(e: impl std::error::Error + Send + Sync + 'static) -> PyErr {
    let dynamic = &e as &dyn std::error::Error;
    let engine = dynamic.downcast_ref::<EngineError>();
    let is_lost = engine.is_some_and(|e| matches!(e, EngineError::WriterLost { .. } | EngineError::WritersLost { .. }));
    let plugin = dynamic.downcast_ref::<PluginError>().or(match engine {
        Some(EngineError::Plugin(p)) => Some(p),
        _ => None,
    });
    let retryable = plugin.is_some_and(|p| p.sink_kind() == Some(SinkErrorKind::Retryable));
    let text = message(e);
    if is_lost {
        WriterLost::new_err(text)
    } else if retryable {
        Retryable::new_err(text)
    } else {
        SluiceError::new_err(text)
    }
}

fn lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock().map_err(|_| SluiceError::new_err("internal error: a previous call panicked while holding this object"))
}

/// A job file, parsed and checked as `sluice run` does.
#[pyclass(frozen, module = "sluice._native")]
struct Job {
    job: Arc<JobFile>,
    text: String,
    path: PathBuf,
    overrides: Vec<String>,
}

impl Job {
    fn parse(text: String, path: PathBuf, overrides: Vec<String>) -> PyResult<Self> {
        let job = JobFile::from_str(&text, &path, &overrides).map_err(to_py)?;
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

/// The WebAssembly engine and the compiled-component cache (default:
/// `$SLUICE_CACHE_DIR` or `~/.cache/sluice/components`, as for `sluice`).
#[pyclass(frozen, module = "sluice._native")]
struct Host {
    host: Arc<PluginHost>,
}

#[pymethods]
impl Host {
    #[new]
    #[pyo3(signature = (cache_dir = None))]
    fn new(py: Python<'_>, cache_dir: Option<PathBuf>) -> PyResult<Self> {
        let dir = cache_dir.or_else(ComponentCache::default_dir);
        let host = py.detach(|| PluginHost::new(dir)).map_err(to_py)?;
        Ok(Self { host: Arc::new(host) })
    }

    /// Loads a plugin (from the cache when it was compiled before) and
    /// returns what it says of itself.
    fn describe<'py>(&self, py: Python<'py>, plugin: PathBuf) -> PyResult<Bound<'py, PyDict>> {
        let host = self.host.clone();
        let plugin = py.detach(move || host.load(&plugin)).map_err(to_py)?;
        describe(py, &plugin)
    }
}

fn describe<'py>(py: Python<'py>, plugin: &Plugin) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("path", plugin.path.clone())?;
    d.set_item("contract", plugin.version().to_string())?;
    d.set_item("loaded_from_cache", matches!(plugin.loaded_from, sluice::plugin::LoadedFrom::Cache(_)))?;
    if let Some(info) = plugin.info() {
        d.set_item("name", info.name.clone())?;
        d.set_item("version", info.version.clone())?;
        d.set_item("description", info.description.clone())?;
        d.set_item("multi_table", info.multi_table)?;
        let options = PyList::empty(py);
        for o in &info.options {
            let od = PyDict::new(py);
            od.set_item("name", o.name.clone())?;
            od.set_item("description", o.description.clone())?;
            od.set_item("required", o.required)?;
            od.set_item("default", o.default_value.clone())?;
            options.append(od)?;
        }
        d.set_item("options", options)?;
    }
    Ok(d)
}

/// A sink context from a Python dict (`job_id`, `sink_id`, `incarnation`,
/// `subtask`, `parallelism`, and optionally `attempt` and
/// `refuse_other_incarnations`).
fn sink_ctx(d: &Bound<'_, PyDict>) -> PyResult<SinkCtx> {
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
    })
}

/// `[(name, schema)]`, each schema an Arrow IPC stream without batches.
fn source_tables(tables: Vec<(String, Vec<u8>)>) -> Vec<SourceTable> {
    tables.into_iter().map(|(name, schema)| SourceTable { name, schema }).collect()
}

/// A job's sink: its plugin, loaded, with the grants and sandbox limits
/// the job's `[sink]` section gives it.
#[pyclass(frozen, module = "sluice._native")]
struct Sink {
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
        let tables = source_tables(tables);
        let name = format!("writer[{}]", ctx.subtask);
        let writer = py
            .detach(|| {
                let inst = self.plugin.instantiate(&name, &self.grants, self.limits)?;
                WriterInstance::open(inst, &ctx, &options, &tables, restored.as_deref())
            })
            .map_err(to_py)?;
        Ok(Writer { inner: Mutex::new(Some(writer)) })
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
        Ok(Committer { inner: Mutex::new(committer) })
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

/// A writer: takes Arrow IPC batches, prepares a checkpoint's commit and
/// snapshots its state.
#[pyclass(frozen, module = "sluice._native")]
struct Writer {
    inner: Mutex<Option<WriterInstance>>,
}

impl Writer {
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
        // (or `encoded`) keeps them alive for the call.
        self.with(py, |w| w.write(&table, bytes))?.map_err(to_py)
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

/// The committer: combines the writers' commit infos and commits them,
/// idempotently.
#[pyclass(frozen, module = "sluice._native")]
struct Committer {
    inner: Mutex<CommitterInstance>,
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

/// A job's durable checkpoint store (its state directory), in the format
/// `sluice run` writes. Records are JSON documents, read here and written
/// only by the engine (`run`, `Landing`).
#[pyclass(frozen, module = "sluice._native")]
struct CheckpointStore {
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

/// One writer of a job in a process of its own (a Ray actor): it reads its
/// own split of the job's source and writes it through its own plugin
/// instance, one round per checkpoint.
#[pyclass(frozen, module = "sluice._native")]
struct Worker {
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

/// A [`WriterPool`] whose writers a Python object runs (the Ray runner).
///
/// The object has the methods `open(setups: list[bytes])`,
/// `start_round(c)`, `gather(c) -> list[bytes | BaseException]` (a report,
/// or why that writer failed; `WriterLost` for a lost one),
/// `abort_prepare(c, subtasks)`, `apply(changes: bytes)` and
/// `close() -> int`.
struct PyPool {
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
fn remote_error(py: Python<'_>, subtask: Option<u32>, e: &PyErr) -> EngineError {
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
fn clone_error(e: &EngineError) -> EngineError {
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
fn run<'py>(
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

/// Logs of the engine to stderr, as `sluice` prints them (`RUST_LOG`
/// filters; default `level`).
#[pyfunction]
#[pyo3(signature = (level = "info"))]
fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_ansi(false).try_init();
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SluiceError", m.py().get_type::<SluiceError>())?;
    m.add("WriterLost", m.py().get_type::<WriterLost>())?;
    m.add("Retryable", m.py().get_type::<Retryable>())?;
    m.add_class::<Job>()?;
    m.add_class::<Host>()?;
    m.add_class::<Sink>()?;
    m.add_class::<Writer>()?;
    m.add_class::<Committer>()?;
    m.add_class::<CheckpointStore>()?;
    m.add_class::<Worker>()?;
    m.add_class::<landing::Landing>()?;
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(init_logging, m)?)?;
    Ok(())
}
