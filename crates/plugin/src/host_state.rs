//! The data of one plugin instance's `Store`: WASI (clocks, randomness,
//! captured output), the resource table, the memory cap, and the
//! capabilities the run grants the instance with their per-instance budgets
//! (`capability::limits`). WASI's blocking imports are linked bounded by the
//! call's deadline (`plugin::wasi_bounded`).

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use crate::sandbox::{GuestOutput, MemoryCap};
use sluice_capability::{CapabilityHost, InstanceCaps};

pub struct HostState {
    pub(crate) wasi: WasiCtx,
    pub(crate) table: ResourceTable,
    pub(crate) limits: MemoryCap,
    pub(crate) caps: InstanceCaps,
    pub(crate) stderr: GuestOutput,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

impl CapabilityHost for HostState {
    fn capabilities(&mut self) -> (&mut InstanceCaps, &mut ResourceTable) {
        (&mut self.caps, &mut self.table)
    }
}
