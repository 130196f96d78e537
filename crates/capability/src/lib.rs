//! Capabilities the host grants a plugin instance, one module each.
//!
//! Invariant: a plugin reaches nothing the job file does not name. There are
//! no WASI preopens, no sockets, no environment and no arguments; storage goes
//! through `file_io`, confined to the granted locations, tables through
//! `catalog`, the one catalog the job configures, and remote services through
//! `grpc` and `http` (`wasi:http`), to the endpoint names the job maps to
//! addresses.
//!
//! Each capability is a room of its own, the way wasmtime-wasi builds
//! `wasi:clocks` or `wasi:filesystem`. Its module owns:
//! - the grant a run's instances share (built from the job file);
//! - the per-instance state, `XCtx`, kept in [`InstanceCaps`];
//! - a view, `XView<'a>`: the state with the store's `ResourceTable` and the
//!   [`Effects`] hook. The WIT interface's `Host` trait is implemented on the
//!   view, never on the store's data type;
//! - a marker type implementing wasmtime's `HasData` with that view, and
//!   `add_to_linker`, which links the interface through it.
//!
//! A capability knows neither `plugin/` nor the store's data type: the store
//! data only implements [`CapabilityHost`]. To add a capability:
//! 1. write its WIT interface and map its resources in `crate::bindings`;
//! 2. write its module here (grant, `XCtx`, `XView`, `Host` impl, `add_to_linker`)
//!    and give [`InstanceCaps`] its `XCtx`;
//! 3. add its one line to [`add_to_linker`] below.
//!
//! The capabilities implement the newest contract version. An older
//! version's interfaces, still served for the plugins built against it, are
//! linked by `v0_1`, whose host traits convert and delegate to the newest.

pub mod bindings;
pub mod catalog;
pub mod catalog_auth;
mod catalog_faults;
mod catalog_rest;
pub mod catalog_storage;
mod catalog_vended;
pub mod codec;
pub mod columnar;
pub mod config;
pub mod file_io;
mod file_io_store;
pub mod google_auth;
pub mod grpc;
pub mod http;
pub mod limits;
pub mod log;
pub mod syncs;
mod v0_1;

use std::sync::Arc;

use wasmtime::component::{Linker, ResourceTable};

use crate::fault::Faults;
use crate::syncs::Syncs;
// The shared pieces, under the names the modules use.
use catalog::{CatalogCtx, CatalogGrant, CatalogSetupError};
use config::GrantsConfig;
use file_io::{FileGrants, FileIoCtx, GrantError};
use grpc::{GrpcCtx, GrpcGrant, GrpcSetupError};
use http::{HttpCtx, HttpGrant, HttpSetupError};
use limits::{HandleCap, HostLimits, HostMemory};
pub use log::InstanceTag;
use log::{LogCtx, SharedLogBudget};
pub(crate) use sluice_core::{fault, ipc, location};

/// Everything one plugin may use in a run, shared by its instances.
#[derive(Debug, Clone)]
pub struct Granted {
    pub files: Arc<FileGrants>,
    pub catalog: Option<Arc<CatalogGrant>>,
    pub grpc: Arc<GrpcGrant>,
    pub http: Arc<HttpGrant>,
}

/// Why a job's grants cannot be opened: the job file names the key.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("job file: key `sink.catalog`: {0}")]
    Catalog(#[from] CatalogSetupError),
    #[error("job file: {0}")]
    Grpc(#[from] GrpcSetupError),
    #[error("job file: {0}")]
    Http(#[from] HttpSetupError),
    #[error("job file: key `sink.grants`: {0}")]
    Files(#[from] GrantError),
}

impl Granted {
    /// What a run grants its plugin instances: each capability turns its
    /// part of `config` into its grant. `faults` are a test's (none in a
    /// released build).
    pub fn open(config: &GrantsConfig, faults: &Faults) -> Result<Self, SetupError> {
        let mut locations = config.locations.clone();
        let catalog = match &config.catalog {
            None => None,
            Some(catalog) => {
                // The tables' files live in the warehouse: the plugin writes them.
                // A local warehouse is its path; a store's, its URL (`s3://bucket/prefix`).
                locations.push(catalog.warehouse().to_string());
                Some(Arc::new(CatalogGrant::for_config(catalog, &config.stores)?.with_faults(faults)))
            }
        };
        let mut files = FileGrants::with_stores(&config.base_dir, &locations, &config.read_locations, &config.stores)?
            .with_faults(faults);
        if let Some(vended) = catalog.as_ref().and_then(|c| c.vended()) {
            files.use_vended(&vended);
        }
        let grpc = GrpcGrant::open(&config.endpoints)?;
        let http = HttpGrant::open(&config.http_endpoints)?;
        Ok(Self { files: Arc::new(files), catalog, grpc: Arc::new(grpc), http: Arc::new(http) })
    }

    /// Nothing at all: for calls that need no capability (`describe`).
    pub fn none() -> Result<Self, file_io::GrantError> {
        Ok(Self {
            files: Arc::new(FileGrants::new(std::path::Path::new("/"), &[], &[])?),
            catalog: None,
            grpc: Arc::default(),
            http: Arc::default(),
        })
    }

    /// Human-readable list of what is granted.
    pub fn describe(&self) -> String {
        let mut parts = vec![self.files.describe()];
        if let Some(c) = &self.catalog {
            parts.push(c.describe());
        }
        if !self.grpc.is_empty() {
            parts.push(self.grpc.describe());
        }
        if !self.http.is_empty() {
            parts.push(self.http.describe());
        }
        parts.join("; ")
    }

    /// The capabilities of one instance, named by `tag`, within `limits`.
    pub fn for_instance(&self, tag: InstanceTag, limits: &HostLimits) -> InstanceCaps {
        let memory = HostMemory::new(limits.host_memory_mb);
        let syncs = Arc::new(Syncs::default());
        InstanceCaps {
            log: LogCtx { tag, budget: SharedLogBudget::new(limits.log_bytes_per_call, limits.log_bytes_per_sec) },
            file_io: FileIoCtx {
                grants: self.files.clone(),
                open: HandleCap::new(limits.max_open_files, "output files open", "sink.sandbox.max_open_files"),
                memory: memory.clone(),
                syncs: syncs.clone(),
            },
            catalog: CatalogCtx { catalog: self.catalog.clone(), syncs: syncs.clone() },
            grpc: GrpcCtx {
                grpc: self.grpc.clone(),
                calls: HandleCap::new(limits.max_grpc_streams, "gRPC calls in flight", "sink.sandbox.max_grpc_streams"),
                memory: memory.clone(),
                channels: Default::default(),
                syncs: syncs.clone(),
            },
            http: HttpCtx::new(self.http.clone(), limits.max_http_requests, syncs),
            memory,
            effects: Effects::default(),
            columnar: columnar::ColumnarInput::default(),
        }
    }
}

/// The per-instance state of every capability, kept in the store's data.
pub struct InstanceCaps {
    /// Host memory the capabilities hold for the instance.
    pub memory: Arc<HostMemory>,
    pub log: LogCtx,
    pub file_io: FileIoCtx,
    pub catalog: CatalogCtx,
    pub grpc: GrpcCtx,
    pub http: HttpCtx,
    pub effects: Effects,
    /// What `columnar.project-input` asked and the input of the `write`
    /// call in progress.
    pub columnar: columnar::ColumnarInput,
}

/// The store data of an instance that capabilities are linked into.
pub trait CapabilityHost: Send + 'static {
    /// The instance's capabilities and its resource table.
    fn capabilities(&mut self) -> (&mut InstanceCaps, &mut ResourceTable);
}

/// Links every capability into `linker`, in every contract version the
/// host serves: one line per capability (older versions delegate to the
/// newest, in `v0_1`).
pub fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    log::add_to_linker(linker)?;
    file_io::add_to_linker(linker)?;
    catalog::add_to_linker(linker)?;
    grpc::add_to_linker(linker)?;
    codec::add_to_linker(linker)?;
    columnar::add_to_linker(linker)?;
    http::add_to_linker(linker)?;
    v0_1::add_to_linker(linker)
}

/// Told by a capability right after an operation had an effect outside the
/// sandbox (a file written, renamed or deleted, a catalog commit, a gRPC
/// call). A test may crash the plugin call there (feature `fault-injection`).
#[derive(Debug, Default)]
pub struct Effects {
    pub(crate) fault: crate::fault::SideEffectFault,
}

impl Effects {
    /// Arms (or disarms) the crash after the next side effect (only with
    /// the `fault-injection` feature; a no-op without it).
    pub fn arm_crash_after_side_effect(&mut self, armed: bool) {
        self.fault.arm(armed);
    }

    pub(crate) fn done(&mut self) -> wasmtime::Result<()> {
        self.fault.after_side_effect().map_err(wasmtime::Error::new)
    }
}

/// Awaits `fut` on the I/O runtime, no later than the deadline of the
/// plugin call under way (see [`limits`]).
pub(crate) fn block_on<F: Future>(import: &'static str, fut: F) -> Result<F::Output, limits::HostDeadline> {
    limits::block_on(runtime().handle(), import, fut)
}

/// The host's runtime for capability I/O (catalog, gRPC): the process's one
/// I/O runtime ([`sluice_core::runtime`]); plugin calls block on it from
/// their own threads, which are never runtime threads.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    match sluice_core::runtime::io() {
        Ok(runtime) => runtime,
        // Without its I/O threads the host can do nothing; there is no
        // caller that could go on.
        Err(e) => panic!("{e}"),
    }
}
