//! What every Sluice crate shares, and nothing that drives them: this crate
//! imports no other Sluice crate.
//!
//! - [`location`]: every place a job names, parsed once;
//! - [`changes`]: what a change stream adds to each batch (upserts and
//!   deletes);
//! - [`duration`]: the job file's durations in seconds, range-checked;
//! - [`error`]: the kinds every error is sorted into, and the one way an
//!   error is printed with its causes;
//! - [`runtime`]: the one tokio runtime all host I/O runs on;
//! - [`ipc`]: Arrow IPC framing of batches;
//! - [`naming`]: how a sink's `table` pattern names a table;
//! - [`progress`]: the status line on a terminal, log lines elsewhere;
//! - [`fault`]: test-only fault injection, empty without the
//!   `fault-injection` feature.

pub mod changes;
pub mod duration;
pub mod error;
pub mod fault;
pub mod ipc;
pub mod location;
pub mod naming;
pub mod progress;
pub mod runtime;

pub use error::{ErrorKind, chain};
