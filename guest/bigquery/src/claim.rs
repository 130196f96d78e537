//! The claims of the datasets the sink lands in (the SDK's `claim` module
//! says what a claim is). A dataset's claim is a marker table,
//! `_sluice_claim_<len>_<job>_<sink>` (the length of the job id keeps the
//! name unique for every pair of ids), created with `tables.insert`; its
//! label `sluice-incarnation` names the one incarnation of the job's sink
//! that may flush streams into the dataset's tables.
//!
//! Why a marker table and not a label set with `tables.patch` and
//! `If-Match`: the API reference documents that `tables.insert` answers 409
//! for a table that exists, which makes the insert an exclusive create; it
//! does not say that `tables.patch` honours `If-Match`, and where it is
//! ignored two incarnations would each set their label and both go on. (The
//! test double answers `If-Match` both ways; the claim holds under each.)
//!
//! Invariants:
//! - no stream is flushed into a dataset before this incarnation was seen
//!   to hold the dataset's claim; a marker naming another incarnation stops
//!   the commit before its first flush;
//! - an insert whose answer was lost is settled by reading the marker back;
//! - a claim needs the sink's REST endpoint (`rest_endpoint`). Where the job
//!   grants none, claims cannot be taken and the committer says so; write
//!   streams still never repeat, but two fresh runs of the job started at
//!   once then land the source twice.

use std::cell::RefCell;
use std::collections::HashSet;

use serde_json::json;
use sluice_guest_sdk::{SinkContext, SinkError, claim, error, log};

use crate::config::Config;
use crate::rest::{RestError, RestTable, Tables};

/// The marker table's label naming the incarnation that holds the claim.
const LABEL: &str = "sluice-incarnation";

/// The datasets whose claim this committer has seen held by its incarnation.
#[derive(Default)]
pub(crate) struct Claims {
    held: RefCell<HashSet<String>>,
    /// Claims cannot be taken (no REST endpoint granted); said once.
    unavailable: RefCell<Option<String>>,
}

/// `projects/P/datasets/D` of a table or stream path
/// (`projects/P/datasets/D/tables/T[/streams/S]`).
fn dataset_of(path: &str) -> Result<String, SinkError> {
    match path.split('/').collect::<Vec<_>>().as_slice() {
        ["projects", p, "datasets", d, "tables", _, ..] if !p.is_empty() && !d.is_empty() => {
            Ok(format!("projects/{p}/datasets/{d}"))
        }
        _ => Err(error::fatal(format!("{path:?} is not a table path projects/P/datasets/D/tables/T"))),
    }
}

/// The marker table of this job's sink in `dataset`.
fn marker(dataset: &str, ctx: &SinkContext) -> String {
    format!("{dataset}/tables/_sluice_claim_{}_{}_{}", ctx.job_id.len(), ctx.job_id, ctx.sink_id)
}

fn holder(marker: &str, table: &RestTable) -> Result<String, SinkError> {
    table.labels.get(LABEL).and_then(|v| v.as_str()).map(str::to_string).ok_or_else(|| {
        error::fatal(format!(
            "table {marker} has no label `{LABEL}`: Sluice keeps the claim of this job's sink there, so it will not \
             guess which incarnation may land in the dataset. Remove the table only if no incarnation of this job \
             landed rows in the dataset"
        ))
    })
}

impl Claims {
    fn tables<'a>(cfg: &'a Config) -> Tables<'a> {
        crate::tables::api(cfg)
    }

    /// The holder of `dataset`'s claim, or `Ok(None)` when it is free;
    /// `Err(None)` when claims cannot be read (no REST endpoint granted).
    fn read(&self, cfg: &Config, marker: &str) -> Result<Option<String>, Option<SinkError>> {
        match Self::tables(cfg).get(marker) {
            Ok(None) => Ok(None),
            Ok(Some(table)) => {
                if let Some(at) = &table.expires {
                    // A dataset's default table expiration applies to the marker too.
                    log::warn(&format!(
                        "the claim {marker} expires (expirationTime {at} ms): once it is gone, another incarnation \
                         of this job could claim the dataset; remove the table's expiration (`bq update \
                         --expiration 0`)"
                    ));
                }
                holder(marker, &table).map(Some).map_err(Some)
            }
            Err(RestError::Denied(why)) => {
                self.say_unavailable(&why);
                Err(None)
            }
            Err(e) if e.is_transient() => {
                Err(Some(error::retryable(format!("reading the claim of the dataset ({marker}): {e}"))))
            }
            Err(e) => Err(Some(error::config(format!("reading the claim of the dataset ({marker}): {e}")))),
        }
    }

    fn say_unavailable(&self, why: &str) {
        let mut said = self.unavailable.borrow_mut();
        if said.is_none() {
            log::warn(&format!(
                "cannot claim the BigQuery datasets for this incarnation ({why}); grant the BigQuery API endpoint \
                 (`rest_endpoint`) so that two runs of this job started at once in fresh state directories cannot \
                 both land the source"
            ));
            *said = Some(why.to_string());
        }
    }

    /// Refuses, before anything is written, a table whose dataset another
    /// incarnation holds.
    pub fn check(&self, cfg: &Config, ctx: &SinkContext, table: &str) -> Result<(), SinkError> {
        let dataset = dataset_of(table)?;
        if cfg.claim == claim::Mode::Beside || self.held.borrow().contains(&dataset) {
            return Ok(());
        }
        let marker = marker(&dataset, ctx);
        match self.read(cfg, &marker) {
            Ok(found) => {
                if !claim::check(ctx, cfg.claim, &format!("dataset {dataset}"), found.as_deref())? {
                    self.held.borrow_mut().insert(dataset);
                }
                Ok(())
            }
            Err(None) => Ok(()),
            Err(Some(e)) => Err(e),
        }
    }

    /// Makes sure this incarnation holds the claim of `table`'s (a table's
    /// or a stream's path) dataset
    /// before a stream is flushed into it: takes a free claim with an
    /// exclusive `tables.insert`, and refuses one another incarnation holds.
    pub fn take(&self, cfg: &Config, ctx: &SinkContext, table: &str) -> Result<(), SinkError> {
        let dataset = dataset_of(table)?;
        if cfg.claim == claim::Mode::Beside || self.held.borrow().contains(&dataset) {
            return Ok(());
        }
        let target = format!("dataset {dataset}");
        let marker = marker(&dataset, ctx);
        let found = match self.read(cfg, &marker) {
            Ok(found) => found,
            Err(None) => return Ok(()),
            Err(Some(e)) => return Err(e),
        };
        if claim::check(ctx, cfg.claim, &target, found.as_deref())? {
            let description = format!(
                "Sluice: the claim of job `{}` sink `{}` on this dataset. Incarnation {} of the job lands rows here; \
                 other incarnations refuse to. Keep this table while the job's tables are written",
                ctx.job_id, ctx.sink_id, ctx.incarnation
            );
            let labels = json!({ LABEL: ctx.incarnation });
            match Self::tables(cfg).insert_marker(&marker, &description, &labels) {
                Ok(true) => log::info(&format!("incarnation {} claimed {target} ({marker})", ctx.incarnation)),
                // Another incarnation, or this one's earlier unanswered try.
                Ok(false) => {}
                Err(RestError::Denied(why)) => {
                    self.say_unavailable(&why);
                    return Ok(());
                }
                // Maybe applied: reading the marker back settles it.
                Err(e) if e.is_transient() => log::warn(&format!("claiming {target}: {e}; reading the claim back")),
                Err(e) => return Err(error::config(format!("claiming {target} ({marker}): {e}"))),
            }
            let found = match self.read(cfg, &marker) {
                Ok(Some(found)) => found,
                Ok(None) => {
                    return Err(error::retryable(format!("claiming {target}: the claim ({marker}) is not there yet")));
                }
                Err(None) => return Ok(()),
                Err(Some(e)) => return Err(e),
            };
            claim::check(ctx, cfg.claim, &target, Some(&found))?;
        }
        self.held.borrow_mut().insert(dataset);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_unique_per_job_and_sink() {
        let ctx = |job: &str, sink: &str| SinkContext {
            job_id: job.into(),
            sink_id: sink.into(),
            incarnation: "i".into(),
            refuse_other_incarnations: false,
            subtask: 0,
            parallelism: 1,
            attempt: 1,
        };
        let d = dataset_of("projects/p/datasets/d/tables/t").expect("a table path");
        assert_eq!(d, "projects/p/datasets/d");
        assert_ne!(marker(&d, &ctx("a_b", "c")), marker(&d, &ctx("a", "b_c")));
        assert_eq!(marker(&d, &ctx("a", "b")), "projects/p/datasets/d/tables/_sluice_claim_1_a_b");
        assert!(dataset_of("projects/p/tables/t").is_err());
        assert_eq!(dataset_of("projects/p/datasets/d/tables/t/streams/s").ok(), Some(d));
    }
}
