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
use crate::bindings::{CommitOutcome, PluginInfo};

/// `impl From<bindings::<version>::SinkError> for Failure`: the versions'
/// error enums are alike, but distinct types.
macro_rules! failure_from {
    ($version:ident) => {
        impl From<crate::bindings::$version::SinkError> for super::Failure {
            fn from(e: crate::bindings::$version::SinkError) -> Self {
                use crate::bindings::$version::SinkError;
                use crate::plugin::SinkErrorKind;
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
        Pre::V0_2(pre) => Box::new(v0_2::Adapter(pre.instantiate(store)?)),
        Pre::V0_1(pre) => Box::new(v0_1::Adapter(pre.instantiate(store)?)),
    })
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

    fn validate(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
    ) -> Result<(), PluginError>;

    fn open_writer(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
        restored: Option<&[u8]>,
    ) -> Result<ResourceAny, PluginError>;

    fn write(&self, guest: &mut Guest<'_>, h: ResourceAny, table: &str, batch: &[u8]) -> Result<(), PluginError>;

    fn prepare_commit(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Option<Vec<u8>>, PluginError>;

    fn snapshot_state(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Vec<u8>, PluginError>;

    fn apply_changes(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError>;

    fn abort_prepare(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<(), PluginError>;

    fn close(&self, guest: &mut Guest<'_>, h: ResourceAny) -> Result<(), PluginError>;

    fn open_committer(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
    ) -> Result<ResourceAny, PluginError>;

    fn evolve(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError>;

    fn combine(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, infos: &[&[u8]]) -> Result<Vec<u8>, PluginError>;

    fn commit(
        &self,
        guest: &mut Guest<'_>,
        h: ResourceAny,
        c: u64,
        combined: &[u8],
    ) -> Result<CommitOutcome, PluginError>;

    fn abort(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<(), PluginError>;
}
