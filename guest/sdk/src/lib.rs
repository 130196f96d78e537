//! Shared helpers for Sluice sink plugins (WebAssembly components).
//!
//! Invariants:
//! - The contract is the WIT package in `wit/0.2/` (`sluice:connector@0.2.4`);
//!   [`bindings`] is generated from it and is the only way a plugin talks to
//!   the host. Every plugin built with this crate exports `maintenance` and
//!   `committer-state` (world `stateful-sink-plugin`): one that keeps no
//!   tables answers `maintain` with a `config` error, and one whose
//!   committer keeps no state has an empty one ([`export_plugin!`]).
//! - Rows cross the boundary only as Arrow IPC streams ([`ipc`]).
//! - Helpers never panic on input: every failure becomes a [`SinkError`] whose
//!   message names the cause.

pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/0.2",
        world: "stateful-sink-plugin",
        pub_export_macro: true,
        export_macro_name: "export_sink",
        default_bindings_module: "sluice_guest_sdk::bindings",
        generate_all,
    });
}

pub mod changes;
pub mod claim;
pub mod columnar;
pub mod files;
pub mod incarnation;
pub mod ipc;
pub mod log;
pub mod options;
pub mod reserved;

pub use bindings::exports::sluice::connector::committer_state::Guest as GuestCommitterState;
pub use bindings::exports::sluice::connector::maintenance::{
    Compaction, Expiry, Guest as GuestMaintenance, Orphans, Request as MaintainRequest, TableReport,
};
pub use bindings::exports::sluice::connector::sink::{Committer, Guest, GuestCommitter, GuestWriter, Writer};
pub use bindings::sluice::connector::file_io::IoError;
pub use bindings::sluice::connector::types::{
    ChangeKind, CommitOutcome, OptionSpec, PluginInfo, SinkContext, SinkError, Table, TableChange,
};

/// Exports a plugin type as the component's `sink` interface, its
/// `maintenance` interface and its `committer-state` interface (0.2.3).
/// `maintains`: the type implements [`GuestMaintenance`] itself, otherwise
/// `maintain` answers that it keeps no tables. `keeps_state`: the type
/// implements [`GuestCommitterState`] itself, otherwise its committer keeps
/// no state (nothing to restore, an empty state, nothing to commit at the
/// end of an empty input).
///
/// ```ignore
/// sluice_guest_sdk::export_plugin!(MyPlugin);
/// sluice_guest_sdk::export_plugin!(MyTablePlugin, maintains);
/// sluice_guest_sdk::export_plugin!(MyOverwritingPlugin, maintains, keeps_state);
/// ```
#[macro_export]
macro_rules! export_plugin {
    ($ty:ident) => {
        $crate::export_plugin!(@no_maintenance $ty);
        $crate::export_plugin!(@no_state $ty);
        $crate::bindings::export_sink!($ty with_types_in $crate::bindings);
    };
    ($ty:ident, maintains) => {
        $crate::export_plugin!(@no_state $ty);
        $crate::bindings::export_sink!($ty with_types_in $crate::bindings);
    };
    ($ty:ident, keeps_state) => {
        $crate::export_plugin!(@no_maintenance $ty);
        $crate::bindings::export_sink!($ty with_types_in $crate::bindings);
    };
    ($ty:ident, maintains, keeps_state) => {
        $crate::bindings::export_sink!($ty with_types_in $crate::bindings);
    };
    (@no_maintenance $ty:ident) => {
        impl $crate::GuestMaintenance for $ty {
            fn maintain(
                _ctx: $crate::SinkContext,
                _options: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                _request: $crate::MaintainRequest,
            ) -> ::std::result::Result<::std::vec::Vec<$crate::TableReport>, $crate::SinkError> {
                ::std::result::Result::Err($crate::SinkError::Config(::std::format!(
                    "the {} plugin keeps no tables to maintain",
                    <$ty as $crate::Guest>::describe().name
                )))
            }
        }
    };
    (@no_state $ty:ident) => {
        impl $crate::GuestCommitterState for $ty {
            fn restore(_state: ::std::option::Option<::std::vec::Vec<u8>>) -> ::std::result::Result<(), $crate::SinkError> {
                ::std::result::Result::Ok(())
            }
            fn snapshot(_c: u64) -> ::std::result::Result<::std::vec::Vec<u8>, $crate::SinkError> {
                ::std::result::Result::Ok(::std::vec::Vec::new())
            }
            fn finish(
                _c: u64,
            ) -> ::std::result::Result<::std::option::Option<::std::vec::Vec<u8>>, $crate::SinkError> {
                ::std::result::Result::Ok(::std::option::Option::None)
            }
        }
    };
}

/// Shorthand constructors for [`SinkError`].
pub mod error {
    use super::SinkError;

    pub fn config(msg: impl Into<String>) -> SinkError {
        SinkError::Config(msg.into())
    }
    pub fn invalid_data(msg: impl Into<String>) -> SinkError {
        SinkError::InvalidData(msg.into())
    }
    pub fn retryable(msg: impl Into<String>) -> SinkError {
        SinkError::Retryable(msg.into())
    }
    pub fn fatal(msg: impl Into<String>) -> SinkError {
        SinkError::Fatal(msg.into())
    }
}

/// Decodes the JSON writer state handed back to `writer.open` on restore.
pub fn restored_state<T: serde::de::DeserializeOwned>(state: Option<Vec<u8>>) -> Result<Option<T>, SinkError> {
    state
        .map(|bytes| serde_json::from_slice(&bytes))
        .transpose()
        .map_err(|e| SinkError::Fatal(format!("restored writer state is not valid: {e}")))
}

/// Builds an [`OptionSpec`] in one line.
pub fn option_spec(name: &str, description: &str, required: bool, default: Option<&str>) -> OptionSpec {
    OptionSpec {
        name: name.to_string(),
        description: description.to_string(),
        required,
        default_value: default.map(str::to_string),
    }
}
