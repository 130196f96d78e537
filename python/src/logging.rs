//! `init_logging`: the engine's logs to stderr, as `sluice` prints them.
//!
//! Invariant: the first call installs the subscriber; later calls change nothing.

use pyo3::prelude::*;

/// Logs of the engine to stderr, as `sluice` prints them (`RUST_LOG`
/// filters; default `level`).
#[pyfunction]
#[pyo3(signature = (level = "info"))]
pub(crate) fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_target(false).with_ansi(false).try_init();
}
