//! `iceberg`: a Sluice sink that lands rows in an Apache Iceberg table,
//! exactly once, with one snapshot per checkpoint.
//!
//! - Writers write Parquet data files through the `iceberg` crate's writer
//!   stack (fan-out per partition, rolling files). File names carry job,
//!   sink, incarnation, subtask, run attempt and a per-writer sequence, so no
//!   restart ever reuses a name. A writer's commit info is the list of its
//!   data files; nothing is visible until the committer commits.
//! - The committer fans in every writer's files of checkpoint `c` and
//!   commits them as **one** snapshot whose summary carries
//!   `sluice.job-id`, `sluice.sink-id`, `sluice.incarnation` and
//!   `sluice.checkpoint-id`, and which moves the table property
//!   `sluice.committed.<job>.<sink>.<incarnation>` to `c` in the same commit.
//!
//! Invariants:
//! - a commit is decided by the table itself: before every attempt the table
//!   is reloaded, and when its watermark for this job, sink and incarnation is
//!   at or past `c` the answer is `already-committed` (snapshot expiry cannot
//!   erase it);
//! - a fresh state directory's first run refuses a table that holds another
//!   incarnation's checkpoints of this job and sink, before writing;
//! - a commit carries an `assert-ref-snapshot-id` requirement on the snapshot
//!   it was built on; the host applies it or answers `conflict` and never
//!   rebases it, and iceberg-rust's own retry is never used (errors reaching
//!   it are not retryable);
//! - after `unknown-outcome` nothing is re-applied before the reload has
//!   checked the ancestry.

mod committer;
mod config;
mod deletion_vectors;
mod filter;
mod host_io;
mod host_parquet;
mod key_index;
mod keys;
mod maintenance;
mod overwrite;
mod position_deletes;
mod runtime;
mod schema;
mod snapshot;
mod upsert;
mod writer;

use sluice_guest_sdk::{Guest, PluginInfo, SinkContext, SinkError, Table, ipc};

pub(crate) const NAME: &str = "iceberg";

/// Snapshot summary keys that identify what a snapshot committed.
pub(crate) const SUMMARY_JOB: &str = "sluice.job-id";
pub(crate) const SUMMARY_SINK: &str = "sluice.sink-id";
pub(crate) const SUMMARY_CHECKPOINT: &str = "sluice.checkpoint-id";
pub(crate) const SUMMARY_INCARNATION: &str = "sluice.incarnation";

pub struct IcebergSink;

impl Guest for IcebergSink {
    type Writer = writer::IcebergWriter;
    type Committer = committer::IcebergCommitter;

    fn describe() -> PluginInfo {
        PluginInfo {
            name: NAME.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            description: "Lands rows in an Apache Iceberg table: one snapshot per checkpoint, exactly once, safe beside other writers".to_string(),
            options: config::option_specs(),
            multi_table: true,
            capabilities: vec![
                "iceberg-catalog: the catalog configured in [sink.catalog]".to_string(),
                "file-io: read-write on the table's location in the warehouse".to_string(),
            ],
        }
    }

    fn describe_commit(options: Vec<(String, String)>, combined: Vec<u8>) -> Vec<String> {
        committer::describe(config::Config::parse(options).ok().as_ref(), &combined)
    }

    fn validate(ctx: SinkContext, options: Vec<(String, String)>, tables: Vec<Table>) -> Result<(), SinkError> {
        let cfg = config::Config::parse(options)?;
        for source in &tables {
            validate_table(&cfg, &ctx, source)?;
        }
        Ok(())
    }
}

/// Whether rows of `source` can land in their table: it exists and takes
/// them (possibly after an allowed evolution), or it may be created.
fn validate_table(cfg: &config::Config, ctx: &SinkContext, source: &Table) -> Result<(), SinkError> {
    let ident = cfg.ident(&source.name)?;
    let arrow = ipc::decode_schema(&source.schema)?;
    runtime::block_on(async {
        match host_io::load_table(&ident).await {
            Ok(table) => {
                // Fails on anything narrower; a wider source is evolved at open.
                schema::evolved_schema(&table, &arrow)?;
                schema::check_partitioning(cfg, &table)?;
                if let (true, Some(key)) = (cfg.upserts(&source.name), &cfg.key) {
                    committer::check_upsert_table(&table)?;
                    keys::key_columns(&ident.to_string(), table.metadata().current_schema(), key)?;
                }
                if let Some(filter) = cfg.filter_for(&source.name) {
                    overwrite::bind_filter(filter, &table)?;
                }
                // What `committer.open` would refuse, `sluice check` refuses too.
                committer::refuse_claimed(ctx, cfg.claim, &ident, &table)?;
                host_io::check_writable(&table)
            }
            Err(host_io::LoadError::NotFound(_)) if cfg.create_table => {
                // The table will be created from the source schema; make sure it can be.
                let created = schema::creation_schema(&arrow)?;
                if let (true, Some(key)) = (cfg.upserts(&source.name), &cfg.key) {
                    keys::key_columns(&ident.to_string(), &created, key)?;
                }
                if let Some(fields) = &cfg.partition_by {
                    schema::creation_spec(fields, &created)?;
                }
                Ok(())
            }
            Err(host_io::LoadError::NotFound(m)) => Err(sluice_guest_sdk::error::config(format!(
                "table {ident} does not exist and option `create_table` is false: {m}"
            ))),
            Err(e) => Err(e.into_sink_error(&ident)),
        }
    })
}

impl sluice_guest_sdk::GuestMaintenance for IcebergSink {
    fn maintain(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        request: sluice_guest_sdk::MaintainRequest,
    ) -> Result<Vec<sluice_guest_sdk::TableReport>, SinkError> {
        maintenance::maintain(ctx, options, request)
    }
}

impl sluice_guest_sdk::GuestCommitterState for IcebergSink {
    fn restore(state: Option<Vec<u8>>) -> Result<(), SinkError> {
        committer::restore_state(state)
    }

    fn snapshot(_c: u64) -> Result<Vec<u8>, SinkError> {
        committer::snapshot_state()
    }

    /// Without a filter, an empty input replaces nothing (as PyIceberg's
    /// `dynamic_partition_overwrite` of an empty frame does); with one, see
    /// [`committer::finish_state`].
    fn finish(c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        committer::finish_state(c)
    }
}

sluice_guest_sdk::export_plugin!(IcebergSink, maintains, keeps_state);
