//! The committer: makes a checkpoint visible with `FlushRows` on every
//! writer's stream of every table, and creates and evolves tables
//! ([`crate::tables`]) at the barriers the engine sets.
//!
//! Invariants:
//! - FlushRows is inclusive and cumulative ("flushes up to any previously
//!   flushed offset ... to the offset specified"), so flushing a checkpoint
//!   again after a crash or a lost reply changes nothing: commit is
//!   idempotent;
//! - a flush at or below the flushed offset counts as done however the
//!   service words it: OK, `ALREADY_EXISTS` (`OFFSET_ALREADY_EXISTS`), or
//!   `OUT_OF_RANGE` saying "already flushed" (see `rpc::classify_flush`).
//!   Recovery flushes the last checkpoint again after nearly every restart,
//!   so this is what keeps a restart from wedging;
//! - an offset beyond the end of the stream, or a stream that is gone
//!   (deleted, finalized), fails the job loudly, naming the checkpoint and
//!   the stream; the checkpoint stays pending until an operator drops it;
//! - a transient failure is answered `retryable`: the host owns the retries
//!   (job.commit) and calls `commit` again, which flushes every stream again.
//!
//! Streams are flushed one by one: BigQuery has no atomic flush across
//! streams (or tables), so a crash between two flushes shows part of a
//! checkpoint until the recovery flushes the rest, table by table. Readers
//! never see a row twice.
//!
//! BigQuery tables keep no record of the checkpoints that landed in them.
//! Write streams, the idempotence keys, are named by the service afresh for
//! every writer, so a checkpoint is never flushed twice; what keeps two
//! incarnations of one job (two fresh state directories started at once, or
//! one started over) from both landing the source is the dataset's claim
//! ([`crate::claim`]): checked at open, and taken before the first flush.
//!
//! With `mode = "overwrite-partitions"` the flushed streams belong to the
//! incarnation's staging tables, and after every flush of checkpoint `c`
//! each partition `c` touched is copied over the target's with a copy job
//! of a deterministic id ([`crate::overwrite`]): a commit asked again finds
//! its jobs by id, so no partition is replaced twice by one checkpoint, and
//! the final table is exact. Partitions are replaced one job at a time, so
//! a crash between two jobs shows some partitions new and some old until
//! the recovery commits `c` again. A target that is not partitioned by a
//! column is refused at open, before anything is written.

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    FlushRowsRequest, FlushRowsResponse,
};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{CommitOutcome, GuestCommitter, SinkContext, SinkError, Table, TableChange, error, log};

use crate::claim::Claims;
use crate::config::Config;
use crate::overwrite::{self, Partitioning};
use crate::rpc::{self, FlushFailure};
use crate::tables;
use crate::writer::{CommitInfo, Flush};

/// Every stream of checkpoint `c` to flush (the same shape as contract
/// 0.1's, whose flushes name no table).
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    flushes: Vec<Flush>,
}

pub struct BigQueryCommitter {
    cfg: Config,
    ctx: SinkContext,
    claims: Claims,
    /// The paths of every table the committer was told of (open, evolve).
    known: std::cell::RefCell<std::collections::BTreeSet<String>>,
}

fn decode(combined: &[u8]) -> Result<Combined, SinkError> {
    serde_json::from_slice(combined).map_err(|e| error::fatal(format!("combined commit is not valid: {e}")))
}

impl BigQueryCommitter {
    fn flush(&self, c: u64, info: &Flush) -> Result<(), SinkError> {
        let req = FlushRowsRequest { write_stream: info.stream.clone(), offset: Some(info.offset) };
        let table = self.cfg.table_path(&info.table).unwrap_or_else(|_| info.table.clone());
        let way_out = format!(
            "The checkpoint stays pending and every run stops here until it is settled: if its rows are visible in \
             {table}, or you give them up, drop it with `sluice state JOB.toml --drop-pending {c}` and run the job \
             again (`sluice state JOB.toml` shows what it holds)"
        );
        match rpc::unary_raw::<_, FlushRowsResponse>(&self.cfg.endpoint, "FlushRows", &req, self.cfg.rpc_timeout_ms) {
            Ok(_) => Ok(()),
            Err(e) => match rpc::classify_flush(e) {
                FlushFailure::AlreadyFlushed(m) => {
                    log::info(&format!("checkpoint {c}: {} already flushed to {} ({m})", info.stream, info.offset));
                    Ok(())
                }
                FlushFailure::BeyondEnd(m) => Err(error::fatal(format!(
                    "checkpoint {c}: FlushRows({}, offset {}) lies beyond the end of the stream ({m}): the checkpoint \
                     names rows the stream does not hold. {way_out}",
                    info.stream, info.offset
                ))),
                FlushFailure::StreamGone(m) => Err(error::fatal(format!(
                    "checkpoint {c}: stream {} can no longer be flushed ({m}); it was deleted or finalized, so Sluice \
                     cannot make the checkpoint's rows up to offset {} visible. {way_out}",
                    info.stream, info.offset
                ))),
                FlushFailure::Transient(m) => {
                    Err(error::retryable(format!("checkpoint {c}: FlushRows on {} failed: {m}", info.stream)))
                }
                FlushFailure::Permanent(m) => {
                    Err(error::fatal(format!("checkpoint {c}: FlushRows on {} failed: {m}", info.stream)))
                }
            },
        }
    }
}

impl GuestCommitter for BigQueryCommitter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<Table>,
    ) -> Result<sluice_guest_sdk::Committer, SinkError> {
        let cfg = Config::parse(options)?;
        let claims = Claims::default();
        // Another incarnation's dataset is refused before anything is written or changed.
        let mut known = std::collections::BTreeSet::new();
        for table in &tables {
            let path = cfg.table_path(&table.name)?;
            claims.check(&cfg, &ctx, &path)?;
            known.insert(path);
        }
        // The tables the job starts with: created, or evolved to take the rows.
        for table in &tables {
            prepare(&cfg, &ctx, table)?;
        }
        let known = std::cell::RefCell::new(known);
        Ok(sluice_guest_sdk::Committer::new(BigQueryCommitter { cfg, ctx, claims, known }))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        for change in &changes {
            let path = self.cfg.table_path(&change.table.name)?;
            self.claims.check(&self.cfg, &self.ctx, &path)?;
            self.known.borrow_mut().insert(path);
            prepare(&self.cfg, &self.ctx, &change.table)?;
        }
        Ok(())
    }

    fn combine(&self, _c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut flushes = Vec::with_capacity(infos.len());
        for raw in &infos {
            let info: CommitInfo =
                serde_json::from_slice(raw).map_err(|e| error::fatal(format!("commit info is not valid: {e}")))?;
            flushes.extend(info.flushes);
        }
        serde_json::to_vec(&Combined { flushes }).map_err(|e| error::fatal(format!("cannot encode the commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined = decode(&combined)?;
        // Every dataset the job knows first, in name order (so two racing runs
        // meet on the same first one): nothing is flushed where another
        // incarnation holds the claim.
        let mut paths = self.known.borrow().clone();
        paths.extend(combined.flushes.iter().map(|f| f.stream.clone()));
        for path in &paths {
            self.claims.take(&self.cfg, &self.ctx, path)?;
        }
        for info in &combined.flushes {
            self.flush(c, info)?;
        }
        // Then the partitions the checkpoint touched, in order, each from
        // the staging table that now holds every committed row of it.
        for (target, d) in replacements(&self.cfg, &combined)? {
            let stage = overwrite::staging_path(&self.ctx, &target);
            overwrite::replace_partition(&self.cfg, &self.ctx, c, &target, &stage, &d)?;
        }
        Ok(CommitOutcome::Committed)
    }

    fn abort(&self, _c: u64, _combined: Vec<u8>) -> Result<(), SinkError> {
        // Unflushed rows never become visible; BUFFERED streams need no cleanup.
        Ok(())
    }
}

/// Makes the table of `source` take its rows; when its rows overwrite
/// partitions, first checks that the target is partitioned by a column
/// (before creating or changing anything), then makes its staging table.
fn prepare(cfg: &Config, ctx: &SinkContext, source: &Table) -> Result<(), SinkError> {
    if !cfg.overwrites(&source.name) {
        return tables::prepare(cfg, source);
    }
    let target = cfg.table_path(&source.name)?;
    Partitioning::read(cfg, &target)?;
    tables::prepare(cfg, source)?;
    let arrow = sluice_guest_sdk::ipc::decode_schema(&source.schema)?;
    overwrite::prepare_staging(cfg, ctx, &target, &arrow)
}

/// The `(target, partition)` pairs a combined commit replaces, in order.
fn replacements(cfg: &Config, combined: &Combined) -> Result<std::collections::BTreeSet<(String, String)>, SinkError> {
    let mut out = std::collections::BTreeSet::new();
    for f in combined.flushes.iter().filter(|f| !f.partitions.is_empty()) {
        let target = cfg.table_path(&f.table)?;
        out.extend(f.partitions.iter().map(|d| (target.clone(), d.clone())));
    }
    Ok(out)
}

/// What a combined commit will make visible, one line per stream.
pub fn describe(cfg: Option<&Config>, combined: &[u8]) -> Vec<String> {
    let Ok(combined) = decode(combined) else {
        return vec!["(not a BigQuery-sink commit)".to_string()];
    };
    combined
        .flushes
        .iter()
        .map(|f| {
            let table = cfg.and_then(|cfg| cfg.table_path(&f.table).ok()).unwrap_or_else(|| format!("{:?}", f.table));
            format!(
                "table {table}: FlushRows({}, offset {}): rows up to offset {} of the stream",
                f.stream, f.offset, f.offset
            )
        })
        .chain(cfg.and_then(|cfg| replacements(cfg, &combined).ok()).into_iter().flatten().map(|(target, d)| {
            format!("table {target}: partition {d} replaced (WRITE_TRUNCATE) by the staged rows of the incarnation")
        }))
        .collect()
}
