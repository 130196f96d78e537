//! The committer: makes a checkpoint visible with `FlushRows` on every
//! writer's stream.
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
//! streams, so a crash between two flushes shows part of a checkpoint until
//! the recovery flushes the rest. Readers never see a row twice.

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    FlushRowsRequest, FlushRowsResponse,
};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{CommitOutcome, GuestCommitter, SinkContext, SinkError, error, log};

use crate::config::Config;
use crate::rpc::{self, FlushFailure};
use crate::writer::CommitInfo;

#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    flushes: Vec<CommitInfo>,
}

pub struct BigQueryCommitter {
    cfg: Config,
}

fn decode(combined: &[u8]) -> Result<Combined, SinkError> {
    serde_json::from_slice(combined).map_err(|e| error::fatal(format!("combined commit is not valid: {e}")))
}

impl BigQueryCommitter {
    fn flush(&self, c: u64, info: &CommitInfo) -> Result<(), SinkError> {
        let req = FlushRowsRequest { write_stream: info.stream.clone(), offset: Some(info.offset) };
        let way_out = format!(
            "The checkpoint stays pending and every run stops here until it is settled: if its rows are visible in \
             {table}, or you give them up, drop it with `sluice state JOB.toml --drop-pending {c}` and run the job \
             again (`sluice state JOB.toml` shows what it holds)",
            table = self.cfg.table
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
        _ctx: SinkContext,
        options: Vec<(String, String)>,
        _schema: Vec<u8>,
    ) -> Result<sluice_guest_sdk::Committer, SinkError> {
        Ok(sluice_guest_sdk::Committer::new(BigQueryCommitter { cfg: Config::parse(options)? }))
    }

    fn combine(&self, _c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut flushes = Vec::with_capacity(infos.len());
        for raw in &infos {
            let info: CommitInfo =
                serde_json::from_slice(raw).map_err(|e| error::fatal(format!("commit info is not valid: {e}")))?;
            flushes.push(info);
        }
        serde_json::to_vec(&Combined { flushes }).map_err(|e| error::fatal(format!("cannot encode the commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined = decode(&combined)?;
        for info in &combined.flushes {
            self.flush(c, info)?;
        }
        Ok(CommitOutcome::Committed)
    }

    fn abort(&self, _c: u64, _combined: Vec<u8>) -> Result<(), SinkError> {
        // Unflushed rows never become visible; BUFFERED streams need no cleanup.
        Ok(())
    }
}
