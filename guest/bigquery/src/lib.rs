//! `bigquery`: a Sluice sink that lands rows in BigQuery tables through the
//! Storage Write API, exactly once.
//!
//! - Each writer owns a BUFFERED write stream per table and appends with
//!   explicit offsets (see [`writer`]); rows are `arrow_rows` (or
//!   `ProtoRows`) checked against the table's schema.
//! - At a checkpoint a writer hands over `(table, stream, last offset)` for
//!   every stream that took rows; the committer makes the checkpoint visible
//!   with `FlushRows` on each (see [`committer`]).
//! - With `mode = "upsert"` a change stream lands through BigQuery's change
//!   data capture on each table's default stream, effectively once (see
//!   [`upsert`]).
//! - New tables are created and schemas evolved through the BigQuery API's
//!   table methods, at the engine's barriers, before any row of the new
//!   shape is appended (see [`tables`]).
//!
//! The plugin reaches the services only through the host's `grpc` and
//! `wasi:http` capabilities, by endpoint name; the addresses and the
//! credentials stay in the host.

mod claim;
mod committer;
mod config;
mod overwrite;
mod rest;
mod rpc;
mod tables;
mod upsert;
mod writer;

use sluice_guest_sdk::{Guest, PluginInfo, SinkContext, SinkError, Table};

pub struct BigQuerySink;

impl Guest for BigQuerySink {
    type Writer = writer::BigQueryWriter;
    type Committer = committer::BigQueryCommitter;

    fn describe() -> PluginInfo {
        PluginInfo {
            name: "bigquery".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            description: "Lands rows in a BigQuery table through the Storage Write API: BUFFERED streams, explicit offsets, FlushRows per checkpoint, exactly once".to_string(),
            options: config::option_specs(),
            multi_table: true,
            capabilities: vec![
                "grpc: the Storage Write API endpoint named by option `endpoint`".to_string(),
                "http: the BigQuery API endpoint named by option `rest_endpoint`, to create tables and evolve schemas"
                    .to_string(),
            ],
        }
    }

    fn describe_commit(options: Vec<(String, String)>, combined: Vec<u8>) -> Vec<String> {
        committer::describe(config::Config::parse(options).ok().as_ref(), &combined)
    }

    /// Reads each table's schema from its `_default` stream (GetWriteStream,
    /// view FULL), which writes nothing, and checks the rows against it.
    fn validate(ctx: SinkContext, options: Vec<(String, String)>, tables: Vec<Table>) -> Result<(), SinkError> {
        let cfg = config::Config::parse(options)?;
        let claims = claim::Claims::default();
        for table in &tables {
            tables::check(&cfg, table)?;
            if cfg.overwrites(&table.name) {
                overwrite::Partitioning::read(&cfg, &cfg.table_path(&table.name)?)?;
            }
            // What `committer.open` would refuse, `sluice check` refuses too.
            claims.check(&cfg, &ctx, &cfg.table_path(&table.name)?)?;
        }
        Ok(())
    }
}

/// The committer's state: in overwrite mode the targets this incarnation
/// stages rows for and the overwrite marker it holds on each, in append
/// mode whether it landed a checkpoint, in upsert mode whether it applied
/// changes (see [`committer`]).
impl sluice_guest_sdk::GuestCommitterState for BigQuerySink {
    fn restore(state: Option<Vec<u8>>) -> Result<(), SinkError> {
        committer::restore_state(state)
    }

    fn snapshot(_c: u64) -> Result<Vec<u8>, SinkError> {
        committer::snapshot_state()
    }

    /// An empty input replaces nothing (no `overwrite_filter` here).
    fn finish(_c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        Ok(None)
    }
}

sluice_guest_sdk::export_plugin!(BigQuerySink, keeps_state);
