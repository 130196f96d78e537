//! Capabilities the host grants a plugin instance, one module each.
//!
//! Invariant: a plugin reaches nothing the job file does not name. There are
//! no WASI preopens, no sockets, no environment and no arguments; storage goes
//! through `file_io`, confined to the granted locations, and tables through
//! `catalog`, the one catalog the job configures.

pub mod catalog;
pub mod fault;
pub mod file_io;
pub mod log;

use std::sync::Arc;

use catalog::CatalogGrant;
use file_io::FileGrants;

/// Everything one plugin may use in a run, shared by its instances.
#[derive(Debug, Clone)]
pub struct Granted {
    pub files: Arc<FileGrants>,
    pub catalog: Option<Arc<CatalogGrant>>,
}

impl Granted {
    /// Human-readable list of what is granted.
    pub fn describe(&self) -> String {
        match &self.catalog {
            Some(c) => format!("{}; {}", self.files.describe(), c.describe()),
            None => self.files.describe(),
        }
    }
}
