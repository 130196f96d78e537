//! Host bindings of every contract version this host serves, one module per
//! version, each generated from its frozen WIT folder (`wit/<version>/`).
//!
//! A plugin is linked against all of them at once: the interface names
//! differ by version (`sluice:connector/file-io@0.1.0`, `...@0.2.0`), and
//! wasmtime matches semver only within a version (0.1.x), never across. The
//! capabilities implement the newest version; the older versions' host
//! traits delegate to it (`capability::v0_1`). `plugin` finds out which
//! version a component exports.
//!
//! Everything is synchronous: each plugin instance runs on its own thread,
//! so a guest blocked in a host call never stalls another guest.

/// The versions this host serves, newest first.
pub const SUPPORTED: &[&str] = &["0.2.4", "0.2.3", "0.2.2", "0.2.1", "0.2.0", "0.1.0"];

/// `sluice:connector@0.2.4`: many tables per sink, schema evolution, the
/// incarnation in the context, the `codec` capability (0.2.0), the
/// `columnar` capability (0.2.1), `file-io.list-tree` with the optional
/// `maintenance` export (0.2.2), the optional `committer-state` export
/// (0.2.3), and `columnar`'s `project-input` and `write-input` (0.2.4). A
/// 0.2.0 to 0.2.3 plugin links against it unchanged:
/// wasmtime matches `@0.2.0` imports and exports to `@0.2.4` (semver within
/// 0.2), and each minor version only added imports such a plugin never asks
/// for, and exports the host looks for separately ([`v0_2_maintenance`],
/// [`v0_2_state`]).
pub mod v0_2 {
    wasmtime::component::bindgen!({
        path: "../../wit/0.2",
        world: "sink-plugin",
        imports: {
            // Operations with a side effect may inject a crash in tests (see
            // `crate::fault`); an injected crash is a trap.
            "sluice:connector/file-io": trappable,
            "sluice:connector/iceberg-catalog": trappable,
            "sluice:connector/grpc": trappable,
            "sluice:connector/columnar": trappable,
            default: tracing,
        },
        // Calls into the plugin borrow their arguments: a batch is not copied
        // on the host side before it is copied into the guest.
        ownership: Borrowing { duplicate_if_necessary: true },
        with: {
            "sluice:connector/file-io.output-file": crate::file_io::OutputFileHandle,
            "sluice:connector/grpc.bidi-stream": crate::grpc::BidiStream,
            "sluice:connector/columnar.parquet-writer": crate::columnar::ParquetWriterHandle,
        },
    });

    pub use self::sluice::connector::types::{ChangeKind, Table, TableChange};
    pub use exports::sluice::connector::sink::{CommitOutcome, PluginInfo, SinkContext, SinkError};
}

/// The `maintenance` export of 0.2.2, bound on its own world (`maintainer`)
/// so that a component without it still links as a `sink-plugin`. Its
/// imports are 0.2's, served by the same linker.
pub mod v0_2_maintenance {
    wasmtime::component::bindgen!({
        path: "../../wit/0.2",
        world: "maintainer",
        with: {
            "sluice:connector/log": super::v0_2::sluice::connector::log,
            "sluice:connector/file-io": super::v0_2::sluice::connector::file_io,
            "sluice:connector/iceberg-catalog": super::v0_2::sluice::connector::iceberg_catalog,
            "sluice:connector/grpc": super::v0_2::sluice::connector::grpc,
            "sluice:connector/codec": super::v0_2::sluice::connector::codec,
            "sluice:connector/columnar": super::v0_2::sluice::connector::columnar,
        },
    });

    pub use exports::sluice::connector::maintenance::{
        Compaction, Expiry, Orphans, Request, SinkContext, SinkError, TableReport,
    };
}

/// The `committer-state` export of 0.2.3, bound on its own world
/// (`committer-state-holder`) so that a component without it still links.
/// Unlike `maintenance`, it is called in the committer's own instance (it
/// reads that committer's memory): the host loads it from the same
/// instance as the `sink` export.
pub mod v0_2_state {
    wasmtime::component::bindgen!({
        path: "../../wit/0.2",
        world: "committer-state-holder",
        with: {
            "sluice:connector/log": super::v0_2::sluice::connector::log,
            "sluice:connector/file-io": super::v0_2::sluice::connector::file_io,
            "sluice:connector/iceberg-catalog": super::v0_2::sluice::connector::iceberg_catalog,
            "sluice:connector/grpc": super::v0_2::sluice::connector::grpc,
            "sluice:connector/codec": super::v0_2::sluice::connector::codec,
            "sluice:connector/columnar": super::v0_2::sluice::connector::columnar,
        },
    });

    pub use exports::sluice::connector::committer_state::SinkError;
}

/// `sluice:connector@0.1.0`, as released: one table, a fixed schema.
pub mod v0_1 {
    wasmtime::component::bindgen!({
        path: "../../wit/0.1",
        world: "sink-plugin",
        imports: {
            "sluice:connector/file-io": trappable,
            "sluice:connector/iceberg-catalog": trappable,
            "sluice:connector/grpc": trappable,
            default: tracing,
        },
        ownership: Borrowing { duplicate_if_necessary: true },
        with: {
            "sluice:connector/file-io.output-file": crate::file_io::OutputFileHandle,
            "sluice:connector/grpc.bidi-stream": crate::grpc::BidiStream,
        },
    });

    pub use exports::sluice::connector::sink::{CommitOutcome, PluginInfo, SinkContext, SinkError};
}

pub use v0_2::{CommitOutcome, PluginInfo};
