//! The `log` capability: plugin log lines become host `tracing` events tagged
//! with the plugin's name and the instance.

use crate::plugin::bindings::sluice::connector::log::{Host, Level};
use crate::plugin::host_state::HostState;

impl Host for HostState {
    fn log(&mut self, level: Level, message: String) {
        let plugin = &*self.tag.plugin;
        let instance = &*self.tag.instance;
        match level {
            Level::Trace => tracing::trace!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Debug => tracing::debug!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Info => tracing::info!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Warn => tracing::warn!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Error => tracing::error!(target: "sluice::plugin", plugin, instance, "{message}"),
        }
    }
}

impl crate::plugin::bindings::sluice::connector::types::Host for HostState {}
