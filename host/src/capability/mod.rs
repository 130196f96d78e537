//! Capabilities the host grants a plugin instance, one module each.
//!
//! Invariant: a plugin reaches nothing the job file does not name. There are
//! no WASI preopens, no sockets, no environment and no arguments; storage goes
//! through `file_io`, confined to the granted locations, tables through
//! `catalog`, the one catalog the job configures, and remote services through
//! `grpc`, to the endpoint names the job maps to addresses.

pub mod catalog;
#[cfg(feature = "fault-injection")]
mod catalog_faults;
mod catalog_rest;
pub mod file_io;
pub mod grpc;
pub mod log;

use std::sync::{Arc, OnceLock};

use catalog::CatalogGrant;
use file_io::FileGrants;
use grpc::GrpcGrant;

/// Everything one plugin may use in a run, shared by its instances.
#[derive(Debug, Clone)]
pub struct Granted {
    pub files: Arc<FileGrants>,
    pub catalog: Option<Arc<CatalogGrant>>,
    pub grpc: Arc<GrpcGrant>,
}

impl Granted {
    /// Human-readable list of what is granted.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.files.describe()];
        if let Some(c) = &self.catalog {
            parts.push(c.describe());
        }
        if !self.grpc.is_empty() {
            parts.push(self.grpc.describe());
        }
        parts.join("; ")
    }
}

/// The host's runtime for capability I/O (catalog, gRPC); plugin calls block
/// on it from their own threads, which are never runtime threads.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("sluice-io")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("cannot start the host I/O runtime: {e}"))
    })
}
