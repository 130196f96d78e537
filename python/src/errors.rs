//! The Python exceptions and how engine errors become them.
//!
//! Invariant: every error reaching Python is a `SluiceError` (or a subclass)
//! whose message is the one `sluice` prints; a lost writer is a `WriterLost`
//! and a plugin's `retryable` answer a `Retryable`.

use std::sync::{Mutex, MutexGuard};

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use sluice_engine::EngineError;
use sluice_engine::kinds::{ErrorKind, Kind};
use sluice_engine::plugin::PluginError;

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

/// The message `sluice` prints for an error (`sluice_core::chain`, which
/// the CLI prints its errors with): the error and each of its causes, joined
/// by `: `, each said once.
pub(crate) fn message(e: impl std::error::Error + Send + Sync + 'static) -> String {
    sluice_core::chain(&e)
}

pub(crate) fn to_py(e: impl std::error::Error + Send + Sync + 'static) -> PyErr {
    let dynamic = &e as &dyn std::error::Error;
    let engine = dynamic.downcast_ref::<EngineError>();
    let is_lost = engine.is_some_and(|e| matches!(e, EngineError::WriterLost { .. } | EngineError::WritersLost { .. }));
    let plugin = dynamic.downcast_ref::<PluginError>().or(match engine {
        Some(EngineError::Plugin(p)) => Some(p),
        _ => None,
    });
    // Read from the error's kind, never its text (sluice_core::error).
    let retryable = plugin.is_some_and(|p| p.kind() == ErrorKind::Retryable);
    let text = message(e);
    if is_lost {
        WriterLost::new_err(text)
    } else if retryable {
        Retryable::new_err(text)
    } else {
        SluiceError::new_err(text)
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> PyResult<MutexGuard<'_, T>> {
    m.lock().map_err(|_| SluiceError::new_err("internal error: a previous call panicked while holding this object"))
}
