//! The engine on local things only: plugins, the local file system, SQLite
//! catalogs, in-process doubles and the `sluice` binary (no broker, no
//! cloud server but `maintenance`'s one S3-state check, on the process's
//! shared moto: `sluice_tests::harness::moto`).
//!
//! Each module was a test binary of its own; together they link once. What
//! they share in one process: the plugin host (`sluice_tests::host`) and
//! the compiled-component cache, as the CLI shares them in one run.

mod changes;
mod checkpoint_files;
mod cli;
mod columnar;
mod committer_state;
mod contention;
mod contract;
mod dead_letters;
mod dead_letters_operator;
mod files_overwrite;
mod guest_units;
mod iceberg;
mod incarnation;
mod interop;
mod landing;
mod lifecycle;
mod locations;
mod maintenance;
mod memory;
mod metrics;
mod overwrite;
mod plugin_test;
mod race;
mod sandbox;
mod simulation;
mod sources;
mod tables;
mod upsert;
mod upsert_v3;
