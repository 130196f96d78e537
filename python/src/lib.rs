//! `sluice._native`: Sluice's engine as a Python extension module.
//!
//! What a driver needs, and nothing it must re-implement:
//! - [`job::Job`]: a job file, parsed as `sluice run` parses it;
//! - [`host::Host`]: the WebAssembly engine and its compiled-component cache;
//! - [`sink::Sink`]: a job's plugin with the grants and limits the job gives it,
//!   which opens [`writer::Writer`]s and [`committer::Committer`]s from a sink context;
//! - [`store::CheckpointStore`]: the durable store, in the CLI's format, to read
//!   (records are written by the engine only);
//! - [`landing::Landing`]: a dataset written by writers anywhere (Ray Data
//!   write tasks), persisted and committed as a job's one checkpoint;
//! - [`worker::Worker`] and [`coordinator::run`]: one writer of a job, and the coordinator that
//!   drives writers living anywhere (the Ray runner's actors) through a
//!   Python pool object.
//!
//! This file only registers the module's exceptions, classes and functions;
//! each lives in a module of its own.
//!
//! Invariants:
//! - every call into a plugin, the store or the coordinator runs with the
//!   GIL released; the coordinator takes it back only to call the pool;
//! - rows cross into a plugin as whole Arrow IPC batches, never row by row;
//! - every error is a `SluiceError` whose message is the one `sluice` prints
//!   (formatted as the CLI formats it, with its causes); a writer that its pool
//!   reports lost is a `WriterLost`, so a runner can tell a lost machine
//!   (recover and replay) from a job error (stop and say why).

use pyo3::prelude::*;

mod committer;
mod coordinator;
mod errors;
mod host;
mod job;
mod landing;
mod logging;
mod sink;
mod store;
mod worker;
mod writer;

use errors::{Retryable, SluiceError, WriterLost};

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SluiceError", m.py().get_type::<SluiceError>())?;
    m.add("WriterLost", m.py().get_type::<WriterLost>())?;
    m.add("Retryable", m.py().get_type::<Retryable>())?;
    m.add_class::<job::Job>()?;
    m.add_class::<host::Host>()?;
    m.add_class::<sink::Sink>()?;
    m.add_class::<writer::Writer>()?;
    m.add_class::<committer::Committer>()?;
    m.add_class::<store::CheckpointStore>()?;
    m.add_class::<worker::Worker>()?;
    m.add_class::<landing::Landing>()?;
    m.add_function(wrap_pyfunction!(coordinator::run, m)?)?;
    m.add_function(wrap_pyfunction!(logging::init_logging, m)?)?;
    Ok(())
}
