//! One adapter per contract version: the calls an instance makes, each sent
//! to its version's export, converted on the way in and out.
//!
//! Invariants:
//! - an instance's adapter is chosen once, when it is instantiated, from the
//!   version its component was linked against (`Pre`); no call asks again;
//! - each version's conversions (errors, outcomes, info, sink context,
//!   tables, changes) live in that version's file, and only there;
//! - what a version cannot express (0.1: several tables, schema changes) is
//!   refused as [`PluginError::Unsupported`] before the guest is entered,
//!   never approximated;
//! - every guest call goes through [`Guest::call`], under the instance's
//!   deadline, and a plugin's error reaches it as a [`Failure`] of the
//!   host's own kinds, the same for every version.

use wasmtime::Store;
use wasmtime::component::ResourceAny;

use super::host_state::HostState;
use super::instance::Guest;
use super::{PluginError, Pre, SinkCtx, SinkErrorKind, SourceTable, TableChange};
use sluice_capability::bindings::{CommitOutcome, PluginInfo};

/// `impl From<bindings::<version>::SinkError> for Failure`: the versions'
/// error enums are alike, but distinct types.
macro_rules! failure_from {
    ($version:ident) => {
        impl From<sluice_capability::bindings::$version::SinkError> for super::Failure {
            fn from(e: sluice_capability::bindings::$version::SinkError) -> Self {
                use crate::SinkErrorKind;
                use sluice_capability::bindings::$version::SinkError;
                let (kind, message) = match e {
                    SinkError::Config(m) => (SinkErrorKind::Config, m),
                    SinkError::InvalidData(m) => (SinkErrorKind::InvalidData, m),
                    SinkError::Retryable(m) => (SinkErrorKind::Retryable, m),
                    SinkError::Fatal(m) => (SinkErrorKind::Fatal, m),
                };
                super::Failure { kind, message }
            }
        }
    };
}

/// The calls whose shape is the same in every contract version, written
/// once: each expands inside a version's `impl Adapter`, where `self.0` is
/// that version's bindings.
macro_rules! same_calls {
    () => {
        fn prepare_commit(
            &self,
            guest: &mut Guest<'_>,
            h: ResourceAny,
            c: u64,
        ) -> Result<Option<Vec<u8>>, PluginError> {
            guest.call("prepare-commit", |s| self.0.sluice_connector_sink().writer().call_prepare_commit(s, h, c))
        }

        fn snapshot_state(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Vec<u8>, PluginError> {
            guest.call("snapshot-state", |s| self.0.sluice_connector_sink().writer().call_snapshot_state(s, h, c))
        }

        fn abort_prepare(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<(), PluginError> {
            guest.call("abort-prepare", |s| self.0.sluice_connector_sink().writer().call_abort_prepare(s, h, c))
        }

        fn close(&self, guest: &mut Guest<'_>, h: ResourceAny) -> Result<(), PluginError> {
            guest.call("close", |s| self.0.sluice_connector_sink().writer().call_close(s, h))
        }

        fn combine(
            &self,
            guest: &mut Guest<'_>,
            h: ResourceAny,
            c: u64,
            infos: &[&[u8]],
        ) -> Result<Vec<u8>, PluginError> {
            guest.call("combine", |s| self.0.sluice_connector_sink().committer().call_combine(s, h, c, infos))
        }

        fn abort(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<(), PluginError> {
            guest.call("abort", |s| self.0.sluice_connector_sink().committer().call_abort(s, h, c, combined))
        }
    };
}

mod v0_1;
mod v0_2;

/// A plugin error as the plugin gave it, whatever its version.
pub(super) struct Failure {
    pub(super) kind: SinkErrorKind,
    pub(super) message: String,
}

/// The component's bindings of the version it implements, instantiated in
/// `store`.
pub(super) fn instantiate(pre: &Pre, store: &mut Store<HostState>) -> wasmtime::Result<Box<dyn Adapter>> {
    Ok(match pre {
        Pre::V0_2 { instance_pre, sink, state } => {
            // One instance serves both exports: `committer-state` reads the
            // memory of the committer that `sink` opened.
            let instance = instance_pre.instantiate(&mut *store)?;
            let bindings = sink.load(&mut *store, &instance)?;
            let state = state.as_ref().map(|s| s.load(&mut *store, &instance)).transpose()?;
            Box::new(v0_2::Adapter(bindings, state))
        }
        Pre::V0_1(pre) => Box::new(v0_1::Adapter(pre.instantiate(store)?)),
    })
}

/// What an instance opens (or validates) with: who it is, its options
/// and the tables it takes.
pub(super) struct Opening<'a> {
    pub ctx: &'a SinkCtx,
    pub options: &'a [(&'a str, &'a str)],
    pub tables: &'a [SourceTable],
}

/// The calls of the newest contract, in the host's types; each version
/// serves them with its own export, or refuses what it cannot express.
/// `h` is the instance's writer or committer resource, `c` a checkpoint.
pub(super) trait Adapter: Send + Sync {
    fn describe(&self, guest: &mut Guest<'_>) -> Result<PluginInfo, PluginError>;

    /// `None` when the version has no such call.
    fn describe_commit(
        &self,
        guest: &mut Guest<'_>,
        options: &[(&str, &str)],
        combined: &[u8],
    ) -> Result<Option<Vec<String>>, PluginError>;

    fn validate(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<(), PluginError>;

    fn open_writer(
        &self,
        guest: &mut Guest<'_>,
        open: &Opening<'_>,
        restored: Option<&[u8]>,
    ) -> Result<ResourceAny, PluginError>;

    fn write(&self, guest: &mut Guest<'_>, h: ResourceAny, table: &str, batch: &[u8]) -> Result<(), PluginError>;

    fn prepare_commit(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Option<Vec<u8>>, PluginError>;

    fn snapshot_state(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Vec<u8>, PluginError>;

    fn apply_changes(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError>;

    fn abort_prepare(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<(), PluginError>;

    fn close(&self, guest: &mut Guest<'_>, h: ResourceAny) -> Result<(), PluginError>;

    fn open_committer(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<ResourceAny, PluginError>;

    fn evolve(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError>;

    fn combine(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, infos: &[&[u8]]) -> Result<Vec<u8>, PluginError>;

    fn commit(&self, g: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError>;

    fn abort(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<(), PluginError>;

    /// Whether the instance exports `committer-state` (0.2.3).
    fn keeps_state(&self) -> bool {
        false
    }

    /// `committer-state.restore`; nothing for a plugin without the export.
    fn restore_state(&self, _guest: &mut Guest<'_>, _state: Option<&[u8]>) -> Result<(), PluginError> {
        Ok(())
    }

    /// `committer-state.snapshot`; `None` for a plugin without the export.
    fn snapshot_committer_state(&self, _guest: &mut Guest<'_>, _c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        Ok(None)
    }

    /// `committer-state.finish`; `None` (nothing to commit) for a plugin
    /// without the export.
    fn finish(&self, _guest: &mut Guest<'_>, _c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        Ok(None)
    }
}
