//! The data of one plugin instance's `Store`.

use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::capability::catalog::CatalogGrant;
use crate::capability::file_io::FileIo;
use crate::capability::grpc::GrpcGrant;
use crate::plugin::sandbox::GuestOutput;

/// Names an instance in logs and errors: `files` / `writer[2]`.
#[derive(Debug, Clone)]
pub struct InstanceTag {
    pub plugin: Arc<str>,
    pub instance: Arc<str>,
}

pub struct HostState {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    pub(crate) limits: crate::plugin::sandbox::MemoryCap,
    pub(crate) tag: InstanceTag,
    pub(crate) file_io: FileIo,
    pub(crate) catalog: Option<Arc<CatalogGrant>>,
    pub(crate) grpc: Arc<GrpcGrant>,
    #[cfg(feature = "fault-injection")]
    pub(crate) fault: crate::fault::SideEffectFault,
    pub(crate) stderr: GuestOutput,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl HostState {
    /// Called by a capability right after an operation had an effect outside
    /// the sandbox. A test may crash the call here (feature `fault-injection`).
    pub(crate) fn side_effect_done(&mut self) -> wasmtime::Result<()> {
        #[cfg(feature = "fault-injection")]
        self.fault.after_side_effect()?;
        Ok(())
    }
}
