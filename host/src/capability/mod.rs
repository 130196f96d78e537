//! Capabilities the host grants a plugin instance, one module each.
//!
//! Invariant: a plugin reaches nothing the job file does not name. There are
//! no WASI preopens, no sockets, no environment and no arguments; storage goes
//! through `file_io`, confined to the granted locations.

pub mod fault;
pub mod file_io;
pub mod log;
