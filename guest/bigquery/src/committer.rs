//! The committer: makes a checkpoint visible with `FlushRows` on every
//! writer's stream.
//!
//! Invariants:
//! - FlushRows is inclusive and cumulative ("flushes up to any previously
//!   flushed offset ... to the offset specified"), so flushing a checkpoint
//!   again after a crash or a lost reply changes nothing: commit is
//!   idempotent;
//! - an already-flushed answer (`ALREADY_EXISTS` / `OFFSET_ALREADY_EXISTS`)
//!   is success;
//! - `OUT_OF_RANGE` means the checkpoint names rows the stream does not
//!   hold: the job fails loudly and the checkpoint stays pending;
//! - transient failures are retried here, then handed to the host as
//!   `retryable` (the checkpoint stays pending until a flush succeeds).
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
use crate::rpc::{self, Failure};
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
        let mut attempt = 0;
        loop {
            attempt += 1;
            let req = FlushRowsRequest { write_stream: info.stream.clone(), offset: Some(info.offset) };
            match rpc::unary::<_, FlushRowsResponse>(&self.cfg.endpoint, "FlushRows", &req, self.cfg.rpc_timeout_ms) {
                Ok(_) => return Ok(()),
                Err(Failure::AlreadyExists(m)) => {
                    log::info(&format!("checkpoint {c}: {} already flushed to {} ({m})", info.stream, info.offset));
                    return Ok(());
                }
                Err(Failure::OutOfRange(m)) => {
                    return Err(error::fatal(format!(
                        "checkpoint {c}: FlushRows({}, offset {}) is out of range ({m}): the checkpoint names rows the stream \
                         does not hold; the job stops and the checkpoint stays pending",
                        info.stream, info.offset
                    )));
                }
                Err(Failure::Transient(m)) if attempt < self.cfg.attempts => {
                    log::warn(&format!("checkpoint {c}: FlushRows on {} failed ({m}); retrying", info.stream));
                    rpc::backoff(self.cfg.backoff_ms, attempt + 1);
                }
                Err(Failure::Transient(m)) => {
                    return Err(error::retryable(format!(
                        "checkpoint {c}: FlushRows on {} failed {attempt} times, last: {m}",
                        info.stream
                    )));
                }
                Err(Failure::Permanent(m)) => {
                    return Err(error::fatal(format!("checkpoint {c}: FlushRows on {} failed: {m}", info.stream)));
                }
            }
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
