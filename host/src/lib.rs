//! Sluice: lands data exactly once through sandboxed WebAssembly sink plugins.
//!
//! The crate is read top-down: [`cli`] parses the command line, [`job`] the
//! job file; [`engine`] runs the checkpoint protocol over [`source`]s and
//! [`plugin`] instances, which reach the outside world only through the
//! [`capability`] modules the job grants them. The engine reports into
//! [`metrics`], which the CLI serves.

pub mod cli;

pub use sluice_capability::{self as capability, bindings};
pub use sluice_core::{fault, ipc, location, progress};
pub use sluice_engine::{self as engine, config, kinds, metrics};
pub use sluice_job as job;
pub use sluice_plugin as plugin;
pub use sluice_source as source;
