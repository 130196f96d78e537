//! What a run reports when it ends ([`RunSummary`]), and how it reads.
//!
//! Invariant: a summary only reports; it is built from what the coordinator
//! counted, and nothing here decides anything of the protocol.

use std::time::Duration;

use crate::bindings::CommitOutcome;

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    pub job_id: String,
    /// The incarnation of the job's state directory.
    pub incarnation: String,
    /// This run started the incarnation (its state directory was new).
    pub new_incarnation: bool,
    pub attempt: u32,
    /// Checkpoint the run resumed after, if any.
    pub resumed_from: Option<u64>,
    /// Pending checkpoints committed again on start, with their outcome.
    pub recovered: Vec<(u64, CommitOutcome)>,
    pub rows_this_run: u64,
    pub rows_total: u64,
    pub checkpoints_this_run: u64,
    pub last_committed: Option<u64>,
    pub elapsed: Duration,
    /// Time spent moving rows (from the first read to the end), without
    /// loading the plugin and recovering.
    pub data_elapsed: Duration,
    /// From the start of the run to the first rows written (plugin loaded,
    /// recovered, writers opened): the start-up cost a user waits through.
    pub first_write: Option<Duration>,
    /// The process's peak resident memory so far (Linux), in bytes.
    pub peak_memory: Option<u64>,
    /// The largest linear memory a writer instance had (its sandbox limit
    /// is `sink.sandbox.memory_mb`), in bytes.
    pub writer_memory: Option<u64>,
    /// The most host memory the capabilities held for one writer instance
    /// at once (its budget is `sink.sandbox.host_memory_mb`): open Parquet
    /// writers of the `columnar` capability, uploads, reads; in bytes.
    pub writer_host_memory: Option<u64>,
    /// `commit-table` calls and conflicts the catalog saw (Iceberg sinks).
    pub catalog_commits: u64,
    pub catalog_conflicts: u64,
    /// The job had already finished before this run; nothing was read.
    pub already_complete: bool,
    /// The run stopped on request after this checkpoint (persisted and
    /// committed), and where the source stood then.
    pub stopped: Option<(u64, Option<String>)>,
    /// What the source said of itself at the end (a Kafka source's lag).
    pub source_note: Option<String>,
    /// With dead letters: their table, and how many records landed there
    /// over the job, up to the run's last checkpoint.
    pub dead_letters: Option<(String, u64)>,
}

impl std::fmt::Display for RunSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secs = self.elapsed.as_secs_f64();
        let data_secs = self.data_elapsed.as_secs_f64();
        let rate = if data_secs > 0.0 { self.rows_this_run as f64 / data_secs } else { 0.0 };
        let committed = self.last_committed.map_or("none".to_string(), |c| c.to_string());
        if self.already_complete {
            return write!(
                f,
                "job {} was already complete: {} rows delivered, last committed checkpoint {committed}{}, incarnation {}",
                self.job_id,
                self.rows_total,
                if self.recovered.is_empty() {
                    String::new()
                } else {
                    format!(", {} pending commit(s) finished now", self.recovered.len())
                },
                self.incarnation,
            );
        }
        if let Some((c, at)) = &self.stopped {
            write!(
                f,
                "job {} stopped on request after checkpoint {c}, which is committed; the next run resumes there{}. ",
                self.job_id,
                at.as_ref().map_or(String::new(), |at| format!(" ({at})")),
            )?;
        }
        write!(
            f,
            "job {} {}: {} rows in {secs:.1}s ({rate:.0} rows/s over {data_secs:.1}s of data movement), {} checkpoint(s), last committed checkpoint {committed}, {} rows in total{}, attempt {}, incarnation {}{}",
            self.job_id,
            if self.stopped.is_some() { "ran" } else { "finished" },
            self.rows_this_run,
            self.checkpoints_this_run,
            self.rows_total,
            self.resumed_from.map_or(String::new(), |c| format!(", resumed after checkpoint {c}")),
            self.attempt,
            self.incarnation,
            if self.new_incarnation { " (new)" } else { "" },
        )?;
        if let Some(bytes) = self.peak_memory {
            write!(f, ", peak memory {} MB", bytes / (1024 * 1024))?;
        }
        if let Some(note) = &self.source_note {
            write!(f, ", source {note}")?;
        }
        if let Some((table, bad)) = &self.dead_letters {
            write!(f, ", {bad} bad rows as dead letters in table {table:?}")?;
        }
        Ok(())
    }
}
