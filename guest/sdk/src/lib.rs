//! Shared helpers for Sluice sink plugins (WebAssembly components).
//!
//! Invariants:
//! - The contract is the WIT package in `wit/0.2/` (`sluice:connector@0.2.1`);
//!   [`bindings`] is generated from it and is the only way a plugin talks to
//!   the host.
//! - Rows cross the boundary only as Arrow IPC streams ([`ipc`]).
//! - Helpers never panic on input: every failure becomes a [`SinkError`] whose
//!   message names the cause.

pub mod bindings {
    wit_bindgen::generate!({
        path: "../../wit/0.2",
        world: "sink-plugin",
        pub_export_macro: true,
        export_macro_name: "export_sink",
        default_bindings_module: "sluice_guest_sdk::bindings",
        generate_all,
    });
}

pub mod claim;
pub mod columnar;
pub mod files;
pub mod incarnation;
pub mod ipc;
pub mod log;
pub mod options;

pub use bindings::exports::sluice::connector::sink::{Committer, Guest, GuestCommitter, GuestWriter, Writer};
pub use bindings::sluice::connector::file_io::IoError;
pub use bindings::sluice::connector::types::{
    ChangeKind, CommitOutcome, OptionSpec, PluginInfo, SinkContext, SinkError, Table, TableChange,
};

/// Exports a plugin type as the component's `sink` interface.
///
/// ```ignore
/// sluice_guest_sdk::export_plugin!(MyPlugin);
/// ```
#[macro_export]
macro_rules! export_plugin {
    ($ty:ident) => {
        $crate::bindings::export_sink!($ty with_types_in $crate::bindings);
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
