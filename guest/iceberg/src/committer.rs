//! The fan-in committer: all writers' files of checkpoint `c` → one snapshot.
//!
//! The commit loop (seed 002's safe retry):
//! 1. reload the table;
//! 2. if the snapshot ancestry of `main` already holds this job, sink and
//!    checkpoint, stop: `already-committed` (or `committed`, when this very
//!    call applied it and only the reply was lost);
//! 3. otherwise build a fast-append snapshot on exactly that table and commit
//!    it with its `assert-ref-snapshot-id` requirement;
//! 4. on `conflict`, back off (exponential, full jitter) and go to 1;
//! 5. on `unknown-outcome`, go to 1 at once: step 2 decides;
//! 6. after `commit_attempts` attempts, fail with a clear error; the engine
//!    keeps `c` pending and the next run commits it.

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
use crate::{SUMMARY_CHECKPOINT, SUMMARY_JOB, SUMMARY_SINK};

/// Every writer's files of one checkpoint.
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    spec_id: i32,
    files: Vec<String>,
}

pub struct IcebergCommitter {
    cfg: Config,
    ctx: SinkContext,
}

/// Whether the ancestry of the table's current snapshot holds checkpoint `c`
/// of this job and sink.
fn holds_checkpoint(metadata: &TableMetadata, ctx: &SinkContext, c: u64) -> bool {
    let checkpoint = c.to_string();
    let mut next = metadata.current_snapshot_id();
    while let Some(id) = next {
        let Some(snapshot) = metadata.snapshot_by_id(id) else { break };
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_JOB) == Some(&ctx.job_id)
            && props.get(SUMMARY_SINK) == Some(&ctx.sink_id)
            && props.get(SUMMARY_CHECKPOINT) == Some(&checkpoint)
        {
            return true;
        }
        next = snapshot.parent_snapshot_id();
    }
    false
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

/// Full-jitter exponential back-off before attempt `attempt + 1`.
fn back_off(cfg: &Config, attempt: u32) {
    let cap = cfg.commit_backoff_ms.saturating_mul(1u64 << attempt.min(20)).min(cfg.commit_max_backoff_ms);
    if cap == 0 {
        return;
    }
    let random = getrandom::u64().unwrap_or(u64::from(attempt) * 7919);
    std::thread::sleep(std::time::Duration::from_millis(random % (cap + 1)));
}

enum Attempt {
    Committed,
    Conflict(String),
    UnknownOutcome(String),
}

impl IcebergCommitter {
    fn attempt(&self, table: &Table, c: u64, combined: &Combined) -> Result<Attempt, SinkError> {
        let files = decode_files(table, combined)?;
        let properties = HashMap::from([
            (SUMMARY_JOB.to_string(), self.ctx.job_id.clone()),
            (SUMMARY_SINK.to_string(), self.ctx.sink_id.clone()),
            (SUMMARY_CHECKPOINT.to_string(), c.to_string()),
        ]);
        let tx = Transaction::new(table);
        // The duplicate check would read every manifest; the ancestry check
        // above is what makes the commit idempotent.
        let action =
            tx.fast_append().with_check_duplicate(false).add_data_files(files).set_snapshot_properties(properties);
        let tx = action.apply(tx).map_err(|e| iceberg_error("building the snapshot", e))?;
        let catalog = PinnedCatalog::new(table.clone());
        let result = block_on(tx.commit(&catalog));
        match (result, catalog.verdict()) {
            (Ok(_), _) | (Err(_), Some(Ok(()))) => Ok(Attempt::Committed),
            (Err(_), Some(Err(CatalogError::Conflict(m)))) => Ok(Attempt::Conflict(m)),
            (Err(_), Some(Err(CatalogError::UnknownOutcome(m)))) => Ok(Attempt::UnknownOutcome(m)),
            (Err(_), Some(Err(e @ CatalogError::NotFound(_)))) => Err(error::config(format!(
                "committing checkpoint {c} to table {}: {}",
                self.cfg.table,
                catalog_message(&e)
            ))),
            (Err(_), Some(Err(e @ CatalogError::Other(_)))) => Err(error::retryable(format!(
                "committing checkpoint {c} to table {}: {}",
                self.cfg.table,
                catalog_message(&e)
            ))),
            // Failed before the catalog was asked (writing manifests): nothing was committed.
            (Err(e), None) => Err(iceberg_error(&format!("preparing the snapshot of checkpoint {c}"), e)),
        }
    }
}

impl GuestCommitter for IcebergCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, schema: Vec<u8>) -> Result<Committer, SinkError> {
        let cfg = Config::parse(options)?;
        let source = ipc::decode_schema(&schema)?;
        ensure_table(&cfg, &source)?;
        Ok(Committer::new(IcebergCommitter { cfg, ctx }))
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut combined: Option<Combined> = None;
        for bytes in infos {
            let info: CommitInfo = serde_json::from_slice(&bytes)
                .map_err(|e| error::fatal(format!("commit info of checkpoint {c} is not valid: {e}")))?;
            match &mut combined {
                None => combined = Some(Combined { spec_id: info.spec_id, files: info.files }),
                Some(all) if all.spec_id == info.spec_id => all.files.extend(info.files),
                Some(all) => {
                    return Err(error::fatal(format!(
                        "writers of checkpoint {c} used different partition specs ({} and {}); the table's spec changed during the run",
                        all.spec_id, info.spec_id
                    )));
                }
            }
        }
        let combined = combined.unwrap_or(Combined { spec_id: 0, files: Vec::new() });
        serde_json::to_vec(&combined).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined: Combined = serde_json::from_slice(&combined)
            .map_err(|e| error::fatal(format!("combined commit of checkpoint {c} is not valid: {e}")))?;
        // Set once this call may have applied the snapshot itself.
        let mut maybe_applied = false;
        let mut conflicts = 0u32;
        let mut last = String::new();
        for attempt in 1..=self.cfg.commit_attempts {
            let table =
                block_on(host_io::load_table(&self.cfg.table)).map_err(|e| e.into_sink_error(&self.cfg.table))?;
            if holds_checkpoint(table.metadata(), &self.ctx, c) {
                return Ok(if maybe_applied { CommitOutcome::Committed } else { CommitOutcome::AlreadyCommitted });
            }
            if combined.files.is_empty() {
                // An empty checkpoint commits nothing.
                return Ok(CommitOutcome::Committed);
            }
            match self.attempt(&table, c, &combined)? {
                Attempt::Committed => {
                    log::debug(&format!(
                        "checkpoint {c}: snapshot committed to {} after {attempt} attempt(s), {conflicts} conflict(s)",
                        self.cfg.table
                    ));
                    return Ok(CommitOutcome::Committed);
                }
                Attempt::Conflict(m) => {
                    conflicts += 1;
                    last = format!("conflict: {m}");
                    back_off(&self.cfg, attempt);
                }
                Attempt::UnknownOutcome(m) => {
                    maybe_applied = true;
                    last = format!("outcome unknown: {m}");
                    log::warn(&format!("checkpoint {c}: commit outcome unknown ({m}); reloading the table to check"));
                }
            }
        }
        // The last attempt may have been applied without us knowing: check once more.
        let table = block_on(host_io::load_table(&self.cfg.table)).map_err(|e| e.into_sink_error(&self.cfg.table))?;
        if holds_checkpoint(table.metadata(), &self.ctx, c) {
            return Ok(if maybe_applied { CommitOutcome::Committed } else { CommitOutcome::AlreadyCommitted });
        }
        Err(error::fatal(format!(
            "checkpoint {c} of job {} could not be committed to table {} after {} attempts ({conflicts} conflicts; last: {last}); it stays pending and the next run commits it",
            self.ctx.job_id, self.cfg.table, self.cfg.commit_attempts
        )))
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
