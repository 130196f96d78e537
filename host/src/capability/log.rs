//! The `log` capability: plugin log lines become host `tracing` events tagged
//! with the plugin's name and the instance. Always granted.

use std::sync::Arc;

use wasmtime::component::{HasData, Linker};

use super::CapabilityHost;
use crate::bindings::v0_2::sluice::connector::log::{self as wit, Host, Level};
use crate::bindings::v0_2::sluice::connector::types;

/// Names an instance in logs and errors: `files` / `writer[2]`.
#[derive(Debug, Clone)]
pub struct InstanceTag {
    pub plugin: Arc<str>,
    pub instance: Arc<str>,
}

/// One instance's log: who it is.
pub struct LogCtx {
    pub tag: InstanceTag,
}

/// What the `log` interface is linked through.
pub struct LogView<'a> {
    pub ctx: &'a LogCtx,
}

/// The `log` capability for wasmtime's linker.
pub struct Log;

impl HasData for Log {
    type Data<'a> = LogView<'a>;
}

/// The contract's shared `types` interface: no functions, nothing to hold.
pub(super) struct Types;

impl HasData for Types {
    type Data<'a> = ();
}

impl types::Host for () {}

/// The view of a store's data.
pub(super) fn view<T: CapabilityHost>(t: &mut T) -> LogView<'_> {
    LogView { ctx: &t.capabilities().0.log }
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    types::add_to_linker::<T, Types>(linker, |_| ())?;
    wit::add_to_linker::<T, Log>(linker, view::<T>)
}

impl LogView<'_> {
    /// Records a plugin's line in the host log.
    pub(super) fn record(&self, level: Level, message: &str) {
        let plugin = &*self.ctx.tag.plugin;
        let instance = &*self.ctx.tag.instance;
        match level {
            Level::Trace => tracing::trace!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Debug => tracing::debug!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Info => tracing::info!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Warn => tracing::warn!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Error => tracing::error!(target: "sluice::plugin", plugin, instance, "{message}"),
        }
    }
}

impl Host for LogView<'_> {
    fn log(&mut self, level: Level, message: String) {
        self.record(level, &message);
    }
}
