//! The fan-in committer: all writers' files of checkpoint `c` → one snapshot.
//!
//! One `commit` call makes one attempt (seed 002's safe retry, with the host
//! owning the retry loop and its backoff):
//! 1. reload the table;
//! 2. if the table's watermark for this job, sink and incarnation is at or
//!    past `c`, stop: `already-committed`;
//! 3. otherwise build a fast-append snapshot on exactly that table, setting
//!    the watermark to `c` in the same commit, and commit it with its
//!    `assert-ref-snapshot-id` requirement;
//! 4. a `conflict` (definitely not applied) or an `unknown-outcome` (maybe
//!    applied) is answered `retryable`: the host calls `commit` again, which
//!    starts at 1, so step 2 decides before anything is re-applied.
//!
//! The watermark is a table property, `sluice.committed.<job>.<sink>.<incarnation>`,
//! written by the same atomic commit as the snapshot. Unlike the snapshot
//! summaries, it survives snapshot expiry, so a late recovery never
//! re-applies a checkpoint whose snapshot was expired. Commits of a state
//! directory made before incarnations (no incarnation in the combined
//! commit) are still recognised by their snapshot summaries.

use std::collections::HashMap;

use iceberg::spec::{DataFile, TableMetadata, deserialize_data_file_from_json};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::bindings::sluice::connector::iceberg_catalog::CatalogError;
use sluice_guest_sdk::{CommitOutcome, Committer, GuestCommitter, SinkContext, SinkError, error, ipc, log};

use crate::config::Config;
use crate::host_io::{self, PinnedCatalog, catalog_message};
use crate::runtime::block_on;
use crate::writer::{CommitInfo, ensure_table, iceberg_error};
use crate::{SUMMARY_CHECKPOINT, SUMMARY_INCARNATION, SUMMARY_JOB, SUMMARY_SINK};

/// Every writer's files of one checkpoint.
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    spec_id: i32,
    files: Vec<String>,
    /// The incarnation the checkpoint belongs to (absent in commits made
    /// before incarnations).
    #[serde(default)]
    incarnation: Option<String>,
}

pub struct IcebergCommitter {
    cfg: Config,
    ctx: SinkContext,
}

/// Prefix of the watermark properties of a job's sink.
fn watermark_prefix(ctx: &SinkContext) -> String {
    format!("sluice.committed.{}.{}.", ctx.job_id, ctx.sink_id)
}

/// The table property holding the newest checkpoint committed by this
/// job, sink and incarnation.
fn watermark_key(ctx: &SinkContext, incarnation: &str) -> String {
    format!("{}{incarnation}", watermark_prefix(ctx))
}

/// Whether checkpoint `c` of this job and sink (of `incarnation`) is in the table.
fn holds_checkpoint(metadata: &TableMetadata, ctx: &SinkContext, incarnation: Option<&str>, c: u64) -> bool {
    match incarnation {
        Some(inc) => metadata
            .properties()
            .get(&watermark_key(ctx, inc))
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|committed| committed >= c),
        None => in_ancestry(metadata, ctx, c),
    }
}

/// Whether the ancestry of the current snapshot holds checkpoint `c` of this
/// job and sink, committed before incarnations (no incarnation in its summary).
fn in_ancestry(metadata: &TableMetadata, ctx: &SinkContext, c: u64) -> bool {
    let checkpoint = c.to_string();
    let mut next = metadata.current_snapshot_id();
    while let Some(id) = next {
        let Some(snapshot) = metadata.snapshot_by_id(id) else { break };
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_JOB) == Some(&ctx.job_id)
            && props.get(SUMMARY_SINK) == Some(&ctx.sink_id)
            && props.get(SUMMARY_CHECKPOINT) == Some(&checkpoint)
            && !props.contains_key(SUMMARY_INCARNATION)
        {
            return true;
        }
        next = snapshot.parent_snapshot_id();
    }
    false
}

/// Another incarnation of this job and sink that committed to the table, if
/// any: `Some(Some(id))` from a watermark, `Some(None)` from a snapshot
/// committed before incarnations.
fn other_incarnation(metadata: &TableMetadata, ctx: &SinkContext, ours: Option<&str>) -> Option<Option<String>> {
    let prefix = watermark_prefix(ctx);
    for key in metadata.properties().keys() {
        if let Some(id) = key.strip_prefix(&prefix)
            && Some(id) != ours
        {
            return Some(Some(id.to_string()));
        }
    }
    for snapshot in metadata.snapshots() {
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_JOB) == Some(&ctx.job_id) && props.get(SUMMARY_SINK) == Some(&ctx.sink_id) {
            let found = props.get(SUMMARY_INCARNATION).map(String::as_str);
            if found != ours {
                return Some(found.map(str::to_string));
            }
        }
    }
    None
}

fn decode_files(table: &Table, combined: &Combined) -> Result<Vec<DataFile>, SinkError> {
    let metadata = table.metadata();
    let schema = metadata.current_schema();
    let spec = metadata.partition_spec_by_id(combined.spec_id).ok_or_else(|| {
        error::fatal(format!(
            "table {} no longer has partition spec {} that the data files were written with",
            table.identifier(),
            combined.spec_id
        ))
    })?;
    let partition_type = spec.partition_type(schema).map_err(|e| iceberg_error("reading the partition spec", e))?;
    combined
        .files
        .iter()
        .map(|json| {
            deserialize_data_file_from_json(json, combined.spec_id, &partition_type, schema)
                .map_err(|e| iceberg_error("decoding a data file of the checkpoint", e))
        })
        .collect()
}

impl IcebergCommitter {
    /// Commits checkpoint `c` as one snapshot on `table`, moving the
    /// watermark in the same commit.
    fn attempt(&self, table: &Table, c: u64, combined: &Combined) -> Result<CommitOutcome, SinkError> {
        let files = decode_files(table, combined)?;
        let mut summary = HashMap::from([
            (SUMMARY_JOB.to_string(), self.ctx.job_id.clone()),
            (SUMMARY_SINK.to_string(), self.ctx.sink_id.clone()),
            (SUMMARY_CHECKPOINT.to_string(), c.to_string()),
        ]);
        let tx = Transaction::new(table);
        // The duplicate check would read every manifest; the watermark is
        // what makes the commit idempotent.
        let append = tx.fast_append().with_check_duplicate(false).add_data_files(files);
        let tx = match &combined.incarnation {
            Some(inc) => {
                summary.insert(SUMMARY_INCARNATION.to_string(), inc.clone());
                let tx = append.set_snapshot_properties(summary).apply(tx);
                let tx = tx.map_err(|e| iceberg_error("building the snapshot", e))?;
                tx.update_table_properties().set(watermark_key(&self.ctx, inc), c.to_string()).apply(tx)
            }
            None => append.set_snapshot_properties(summary).apply(tx),
        }
        .map_err(|e| iceberg_error("building the snapshot", e))?;
        let catalog = PinnedCatalog::new(table.clone());
        let result = block_on(tx.commit(&catalog));
        let context =
            |e: &CatalogError| format!("committing checkpoint {c} to table {}: {}", self.cfg.table, catalog_message(e));
        match (result, catalog.verdict()) {
            (Ok(_), _) | (Err(_), Some(Ok(()))) => {
                log::debug(&format!("checkpoint {c}: snapshot committed to {}", self.cfg.table));
                Ok(CommitOutcome::Committed)
            }
            // Definitely not applied: another writer committed first.
            (Err(_), Some(Err(e @ CatalogError::Conflict(_)))) => Err(error::retryable(context(&e))),
            // Maybe applied: the next attempt reloads the table and checks first.
            (Err(_), Some(Err(e @ CatalogError::UnknownOutcome(_)))) => {
                log::warn(&format!("{}; the next attempt checks the table before anything else", context(&e)));
                Err(error::retryable(context(&e)))
            }
            (Err(_), Some(Err(e @ CatalogError::NotFound(_)))) => Err(error::config(context(&e))),
            (Err(_), Some(Err(e @ CatalogError::Other(_)))) => Err(error::retryable(context(&e))),
            // Failed before the catalog was asked (writing manifests): nothing was committed.
            (Err(e), None) => Err(iceberg_error(&format!("preparing the snapshot of checkpoint {c}"), e)),
        }
    }
}

impl GuestCommitter for IcebergCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, schema: Vec<u8>) -> Result<Committer, SinkError> {
        let cfg = Config::parse(options)?;
        let source = ipc::decode_schema(&schema)?;
        if cfg.incarnation.refuse_others
            && let Ok(table) = block_on(host_io::load_table(&cfg.table))
            && let Some(found) = other_incarnation(table.metadata(), &ctx, cfg.incarnation.id.as_deref())
        {
            let target = format!("table {}", cfg.table);
            return Err(cfg.incarnation.refuse(&ctx, &target, "committed checkpoints", found.as_deref()));
        }
        ensure_table(&cfg, &source)?;
        Ok(Committer::new(IcebergCommitter { cfg, ctx }))
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let incarnation = self.cfg.incarnation.id.clone();
        let mut combined: Option<Combined> = None;
        for bytes in infos {
            let info: CommitInfo = serde_json::from_slice(&bytes)
                .map_err(|e| error::fatal(format!("commit info of checkpoint {c} is not valid: {e}")))?;
            match &mut combined {
                None => {
                    combined =
                        Some(Combined { spec_id: info.spec_id, files: info.files, incarnation: incarnation.clone() })
                }
                Some(all) if all.spec_id == info.spec_id => all.files.extend(info.files),
                Some(all) => {
                    return Err(error::fatal(format!(
                        "writers of checkpoint {c} used different partition specs ({} and {}); the table's spec changed during the run",
                        all.spec_id, info.spec_id
                    )));
                }
            }
        }
        let combined = combined.unwrap_or(Combined { spec_id: 0, files: Vec::new(), incarnation });
        serde_json::to_vec(&combined).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined: Combined = serde_json::from_slice(&combined)
            .map_err(|e| error::fatal(format!("combined commit of checkpoint {c} is not valid: {e}")))?;
        let table = block_on(host_io::load_table(&self.cfg.table)).map_err(|e| e.into_sink_error(&self.cfg.table))?;
        if holds_checkpoint(table.metadata(), &self.ctx, combined.incarnation.as_deref(), c) {
            return Ok(CommitOutcome::AlreadyCommitted);
        }
        if combined.files.is_empty() {
            // An empty checkpoint commits nothing.
            return Ok(CommitOutcome::Committed);
        }
        self.attempt(&table, c, &combined)
    }

    fn abort(&self, _c: u64, combined: Vec<u8>) -> Result<(), SinkError> {
        let Ok(combined) = serde_json::from_slice::<Combined>(&combined) else { return Ok(()) };
        let Ok(table) = block_on(host_io::load_table(&self.cfg.table)) else { return Ok(()) };
        if let Ok(files) = decode_files(&table, &combined) {
            for file in files {
                // Best effort: the files were never committed, so nobody reads them.
                let _ = sluice_guest_sdk::files::delete(file.file_path());
            }
        }
        Ok(())
    }
}
