//! Partition overwrite (`mode = "overwrite-partitions"`): the rows a run
//! lands replace every partition of a column time-partitioned table they
//! touch, exactly once.
//!
//! How (the design is `docs/src/sinks/bigquery.md`, "Partition overwrite"):
//! - writers stream into a **staging table** of the incarnation,
//!   `<dataset>._sluice_stage_<hash(job, sink, incarnation, table)>`, made
//!   by the committer with the target's schema and `timePartitioning`; each
//!   writer's commit info names the partitions its rows of the checkpoint
//!   fall in ([`partition_ids`]);
//! - the commit of checkpoint `c` flushes the staging streams, then copies
//!   each touched partition `stage$D → target$D` with `WRITE_TRUNCATE` and
//!   `CREATE_NEVER`, one job per partition, in order ([`replace_partition`]).
//!
//! Invariants:
//! - the staging table holds exactly the rows of the incarnation's
//!   committed checkpoints plus `c` (rows after a checkpoint are never
//!   flushed), so truncating `target$D` to `stage$D` makes the first
//!   checkpoint that touches `D` replace it and later ones add to it, with
//!   no state in the committer; a rerun (a new incarnation) has a new
//!   staging table and replaces again;
//! - a copy job's id is derived from (job, sink, incarnation, table, c, D)
//!   and an attempt index `k`, so a retried or recovered commit names the
//!   same job: BigQuery answers 409 `duplicate` for an id it has seen, and
//!   `jobs.get` tells how that job ended;
//! - an unanswered `jobs.insert` (a 5xx, a timeout) is an unknown outcome:
//!   it is settled by `jobs.get` of the same id, never by inserting another;
//!   every job names the location of the target's dataset (read once with
//!   `datasets.get`), and every `jobs.get` passes it, without which a job
//!   in a single region is not found;
//! - a job that ended with `errorResult` applied nothing (copy jobs are
//!   atomic); after a transient reason the next index is inserted, and
//!   recovery walks the indexes from 0 through `jobs.get`, so the sequence
//!   stays deterministic; any other reason fails the job naming the job id;
//! - the job's dead-letter table (reserved option `sluice.dead-letter-table`)
//!   stays append: it has no staging table and no copy jobs;
//! - a staging table the incarnation's committer state ([`State`]) says it
//!   made is never made again: one that expired or was deleted holds rows
//!   of committed checkpoints that are gone, and copying a new, emptier one
//!   would truncate their partitions, so the run stops naming it. Every
//!   open pushes the staging table's `expirationTime` forward. Its
//!   partitions get an explicit `timePartitioning.expirationMs` that no
//!   staged day reaches, and marker tables an explicit `expirationTime`
//!   pushed forward by every run, so no dataset default expiration
//!   applies to either;
//! - before any copy into a target, the incarnation checks that it still
//!   holds the newest overwrite marker of the target ([`Marker`]), taken at
//!   its first commit that copies: an incarnation a newer one (a rerun)
//!   overtook copies nothing. Taking a generation deletes the staging
//!   tables of the older holders, so their later copies fail with
//!   `notFound`; and the marker is checked again after the copies;
//! - a row whose partitioning column lies outside the range BigQuery
//!   partitions (1960-01-01 to 2159-12-31) is refused as invalid data,
//!   named with the contract's row phrase, before it is written: it would land in `__UNPARTITIONED__`, which no
//!   decorator replaces.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arrow_array::cast::AsArray;
use arrow_array::temporal_conversions::{as_datetime, date32_to_datetime, date64_to_datetime};
use arrow_array::types::{
    TimestampMicrosecondType, TimestampMillisecondType, TimestampNanosecondType, TimestampSecondType,
};
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, Schema, TimeUnit};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sluice_guest_sdk::{SinkContext, SinkError, error, log};

use crate::config::Config;
use crate::rest::{self, Inserted, Jobs, RestError};
use crate::tables;

/// The partition id of rows whose partitioning column is NULL.
const NULL_PARTITION: &str = "__NULL__";

/// How long a staging table lives after it is made (ms): a run must end
/// (or resume) within this time.
const STAGING_LIFETIME_MS: u64 = 30 * 24 * 3600 * 1000;

/// The staging table's `timePartitioning.expirationMs`: a partition
/// expires at its partition time plus this, so it must outlive the oldest
/// day BigQuery partitions (1960-01-01) by more than a run. Set explicitly,
/// because otherwise the dataset's `defaultPartitionExpirationMs` is
/// inherited ("If you set TimePartitioning.expirationMs explicitly when
/// creating a table, the defaultPartitionExpirationMs of the containing
/// dataset is ignored",
/// https://cloud.google.com/bigquery/docs/reference/rest/v2/datasets#Dataset.FIELDS.default_partition_expiration_ms),
/// and a default of days would expire a backfill's old days as soon as
/// they are staged, so a copy would truncate the target's day to nothing.
/// 500 years: every partition lives until after 2460.
const STAGING_PARTITION_EXPIRATION_MS: u64 = 500 * 366 * 24 * 3600 * 1000;

/// How long an overwrite marker lives after the run that last pushed its
/// expiration forward (ms). Set explicitly, so that no dataset default
/// (`defaultTableExpirationMs`) expires a marker: a lost generation would
/// restart the numbering and the overtake rule with it.
const MARKER_LIFETIME_MS: u64 = 10 * 366 * 24 * 3600 * 1000;

/// `errorResult.reason`s after which a job may be tried again under a new
/// id, after a wait (https://cloud.google.com/bigquery/docs/troubleshooting-errors):
/// `backendError` and `internalError` ("you can safely retry"), and the
/// rate and quota limits `rateLimitExceeded` and `quotaExceeded` ("retry
/// the operation after a few seconds. Use exponential backoff"; a daily
/// quota, such as the per-table job limits, clears only later: the commit
/// stays pending and is asked again, and nothing was applied).
const TRANSIENT_REASONS: [&str; 4] = ["backendError", "internalError", "rateLimitExceeded", "quotaExceeded"];

/// The days (since the epoch) BigQuery's time-unit column partitions
/// cover: 1960-01-01 up to 2160-01-01 exclusive; rows before 1960-01-01 or
/// after 2159-12-31 go to `__UNPARTITIONED__`
/// (https://cloud.google.com/bigquery/docs/partitioned-tables#date_timestamp_partitioned_tables).
const PARTITION_DAYS: std::ops::Range<i32> = -3653..69_396;

/// The committer state of an overwriting incarnation (contract 0.2.3
/// `committer-state`), persisted by the host with every checkpoint record.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    /// Every target this incarnation stages rows for, with the generation
    /// of the target's overwrite marker it holds ([`Marker`]). Its staging
    /// table was made before any checkpoint that names it was combined, so
    /// a record that may have committed rows through it names it here.
    /// The generation is `None` until the incarnation's first commit that
    /// copies into the target takes it: an incarnation that copied nothing
    /// (a rerun stopped before its first commit) supersedes no one.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub staged: BTreeMap<String, Option<u64>>,
    /// This incarnation landed checkpoints in `append` mode (kept in that
    /// mode, so a switch to overwrite can be refused).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub appended: bool,
    /// This incarnation landed checkpoints in `upsert` mode (kept, so a
    /// switch to another mode is refused: [`crate::upsert`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub upserted: bool,
}

impl State {
    pub fn is_empty(&self) -> bool {
        self.staged.is_empty() && !self.appended && !self.upserted
    }
}

/// The granularity of a table's time-unit partitioning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    Hour,
    Day,
    Month,
    Year,
}

/// A table's time-unit column partitioning: `timePartitioning {type, field}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Partitioning {
    pub unit: Unit,
    pub field: String,
}

fn sha_hex(parts: &[&str]) -> String {
    let mut h = Sha256::new();
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            h.update(b"|");
        }
        h.update(p.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The staging table of `target` for this incarnation, in the target's dataset.
pub(crate) fn staging_path(ctx: &SinkContext, target: &str) -> String {
    staging_path_of(ctx, &ctx.incarnation, target)
}

/// The staging table of `target` for `incarnation` of this job's sink.
fn staging_path_of(ctx: &SinkContext, incarnation: &str, target: &str) -> String {
    let (project, dataset, _) = rest::parts(target);
    let hash = sha_hex(&[&ctx.job_id, &ctx.sink_id, incarnation, target]);
    format!("projects/{project}/datasets/{dataset}/tables/_sluice_stage_{}", &hash[..24])
}

/// The id of the copy job that replaces partition `d` of `target` for
/// checkpoint `c`, attempt `k`.
pub(crate) fn job_id(ctx: &SinkContext, target: &str, c: u64, d: &str, k: u32) -> String {
    let hash = sha_hex(&[&ctx.job_id, &ctx.sink_id, &ctx.incarnation, target, &c.to_string(), d]);
    format!("sluice_{}_{k}", &hash[..40])
}

fn rest_failure(context: &str, e: RestError) -> SinkError {
    match e {
        RestError::Denied(m) => error::config(format!("{context}: {m}")),
        e if e.is_transient() => error::retryable(format!("{context}: {e}")),
        e => error::fatal(format!("{context}: {e}")),
    }
}

impl Partitioning {
    /// Reads `timePartitioning` of a table resource; a config error naming
    /// the table unless it is partitioned by a column.
    fn from_table(path: &str, tp: Option<&Value>) -> Result<Self, SinkError> {
        let refuse = |why: String| {
            error::config(format!(
                "option `mode` = \"overwrite-partitions\" needs table {path} to be partitioned by a DATE, TIMESTAMP \
                 or DATETIME column (timePartitioning with a `field`), but {why}; nothing was written"
            ))
        };
        let Some(tp) = tp else { return Err(refuse("it is not time-partitioned".into())) };
        let Some(field) = tp.get("field").and_then(Value::as_str).filter(|f| !f.is_empty()) else {
            return Err(refuse("it is partitioned by ingestion time (timePartitioning has no `field`)".into()));
        };
        let unit = match tp.get("type").and_then(Value::as_str) {
            Some("HOUR") => Unit::Hour,
            // The API's default type is DAY.
            Some("DAY") | None => Unit::Day,
            Some("MONTH") => Unit::Month,
            Some("YEAR") => Unit::Year,
            Some(other) => {
                return Err(refuse(format!("its partitioning type {other:?} is not HOUR, DAY, MONTH or YEAR")));
            }
        };
        Ok(Partitioning { unit, field: field.to_string() })
    }

    /// The partitioning of the target `path`, read with `tables.get`.
    pub fn read(cfg: &Config, path: &str) -> Result<Self, SinkError> {
        let context = format!("reading the partitioning of table {path}");
        let table = tables::api(cfg).get(path).map_err(|e| rest_failure(&context, e))?.ok_or_else(|| {
            error::config(format!("option `mode` = \"overwrite-partitions\": table {path} does not exist"))
        })?;
        Self::from_table(path, table.time_partitioning.as_ref())
    }

    /// The staging table's `timePartitioning`: the target's unit and
    /// field, and an explicit [`STAGING_PARTITION_EXPIRATION_MS`].
    fn staging_json(&self) -> Value {
        let unit = match self.unit {
            Unit::Hour => "HOUR",
            Unit::Day => "DAY",
            Unit::Month => "MONTH",
            Unit::Year => "YEAR",
        };
        json!({ "type": unit, "field": self.field, "expirationMs": STAGING_PARTITION_EXPIRATION_MS.to_string() })
    }

    fn format(&self) -> &'static str {
        match self.unit {
            Unit::Hour => "%Y%m%d%H",
            Unit::Day => "%Y%m%d",
            Unit::Month => "%Y%m",
            Unit::Year => "%Y",
        }
    }
}

/// The staging table's expiration, `STAGING_LIFETIME_MS` from now (ms
/// since the epoch).
fn staging_expiry() -> u64 {
    from_now(STAGING_LIFETIME_MS)
}

/// `ms` from now, in ms since the epoch.
fn from_now(ms: u64) -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0).saturating_add(ms)
}

/// The error of a staging table that the committer state says this
/// incarnation made and that is gone (expired or deleted).
fn staging_lost(ctx: &SinkContext, target: &str, stage: &str) -> SinkError {
    error::config(format!(
        "option `mode` = \"overwrite-partitions\": the staging table {stage} of table {target} is gone (it expired \
         or was deleted), but incarnation {} of this job staged rows in it, which its committed checkpoints copied \
         into {target} and its next copies would copy again. Making it again empty would truncate those partitions \
         of {target} to the rows staged from now on, so nothing was copied. Land the backfill again as a new \
         incarnation (a fresh job.state_dir and `sluice run --new-incarnation`), which replaces every partition it \
         touches",
        ctx.incarnation
    ))
}

/// Checks that `target` can be overwritten by partition and makes its
/// staging table (or, when it exists, pushes its expiration forward and
/// evolves its schema to take rows of `arrow`), then makes sure this
/// incarnation holds the newest overwrite marker of `target`, and records
/// both in `state`. Idempotent: a 409 on insert means it exists.
///
/// A staging table `state` names that is gone is refused, never made again
/// ([`staging_lost`]).
pub(crate) fn prepare_staging(
    cfg: &Config,
    ctx: &SinkContext,
    target: &str,
    arrow: &Schema,
    state: &RefCell<State>,
) -> Result<(), SinkError> {
    let api = tables::api(cfg);
    let context = format!("reading table {target}");
    let table = api.get(target).map_err(|e| rest_failure(&context, e))?.ok_or_else(|| {
        error::config(format!("option `mode` = \"overwrite-partitions\": table {target} does not exist"))
    })?;
    let partitioning = Partitioning::from_table(target, table.time_partitioning.as_ref())?;
    let stage = staging_path(ctx, target);
    let known = state.borrow().staged.get(target).copied();
    // An incarnation a newer one overtook is told so first: the newer one
    // deleted its staging table when it took the target over.
    if let Some(Some(mine)) = known {
        Marker::new(cfg, ctx, target).check(mine)?;
    }
    let context = format!("reading the staging table {stage} of {target}");
    let existing = api.get(&stage).map_err(|e| rest_failure(&context, e))?;
    let expires = staging_expiry();
    match existing {
        None if known.is_some() => return Err(staging_lost(ctx, target, &stage)),
        None => {
            let context = format!("creating the staging table {stage} of {target}");
            let created = cfg
                .retry()
                .run(
                    |_| api.insert_partitioned(&stage, &table.fields, &partitioning.staging_json(), expires),
                    RestError::is_transient,
                    |e, _, _| log::warn(&format!("{context}: {e}; retrying")),
                )
                .map_err(|failed| rest_failure(&context, failed.error))?;
            if created {
                log::info(&format!("overwrite-partitions: rows for {target} are staged in {stage}"));
            } else {
                // An earlier, unanswered insert of this run made it.
                tables::evolve_table(cfg, &stage, arrow)?;
            }
        }
        Some(_) => {
            // It exists (an earlier run of this incarnation): it must live
            // as long as the incarnation may still copy from it, and take
            // rows of the current shape.
            let context = format!("moving the expiration of the staging table {stage} of {target}");
            cfg.retry()
                .run(
                    |_| api.patch_expiration(&stage, expires),
                    RestError::is_transient,
                    |e, _, _| log::warn(&format!("{context}: {e}; retrying")),
                )
                .map_err(|failed| rest_failure(&context, failed.error))?;
            tables::evolve_table(cfg, &stage, arrow)?;
        }
    }
    // The overwrite marker is taken by the first commit that copies; the
    // ones taken so far live on.
    Marker::new(cfg, ctx, target).refresh()?;
    state.borrow_mut().staged.insert(target.to_string(), known.flatten());
    Ok(())
}

/// The overwrite markers of one target for this job's sink: marker tables
/// `_sluice_overwrite_<hash(job, sink, target)>_<g>` in the target's
/// dataset, generations `g = 0, 1, ...` (found with `tables.list`; a gap
/// is refused), each labelled with the
/// incarnation that took it when it began to stage rows for the target.
/// The newest generation is the incarnation whose copies may land; an
/// older one (resumed after a rerun overtook it) copies nothing.
///
/// Why marker tables, and not a label on the target set with `tables.patch`
/// and `If-Match`: `tables.insert` is documented to answer 409 for a table
/// that exists (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables/insert,
/// https://cloud.google.com/bigquery/docs/troubleshooting-errors, `duplicate`),
/// which makes taking generation `g + 1` an exclusive create: two
/// incarnations never both take it. The reference does not say that
/// `tables.patch` honours `If-Match`, and where it is ignored two
/// incarnations would both set their label (the same reasoning as the
/// dataset claim, [`crate::claim`]).
///
/// A copy job cannot be made conditional on another table, so the guard is
/// put where the copy writes from: an incarnation that takes a generation
/// deletes the staging tables of the incarnations that held the older ones
/// (the marker's label names them, so their staging tables can be named),
/// and any copy those still make fails with `notFound`, applying nothing
/// (copy jobs are atomic). The marker is taken at the first commit that
/// copies, not when the run starts, so a rerun stopped before it copied
/// anything supersedes no one. What is left: a copy job of the older
/// incarnation inserted before the delete may still land after the newer
/// one's copies; the older incarnation checks the marker again after its
/// copies and fails loudly, naming the partitions, when it sees that.
pub(crate) struct Marker<'a> {
    cfg: &'a Config,
    ctx: &'a SinkContext,
    target: &'a str,
}

/// The marker table's label naming the incarnation of a generation.
const MARKER_LABEL: &str = "sluice-incarnation";

impl<'a> Marker<'a> {
    pub fn new(cfg: &'a Config, ctx: &'a SinkContext, target: &'a str) -> Self {
        Marker { cfg, ctx, target }
    }

    fn path(&self, g: u64) -> String {
        let (project, dataset, _) = rest::parts(self.target);
        format!("projects/{project}/datasets/{dataset}/tables/{}{g}", self.prefix())
    }

    /// The table id prefix of this target's markers (before the generation).
    fn prefix(&self) -> String {
        let hash = sha_hex(&[&self.ctx.job_id, &self.ctx.sink_id, self.target]);
        format!("_sluice_overwrite_{}_", &hash[..24])
    }

    /// The generations from `from` on that are taken, in order, with their
    /// incarnations. They are found with `tables.list` (not by reading
    /// `0, 1, ...` until one is missing), and must run from 0 without a
    /// gap: a missing generation (expired, deleted) would let the
    /// numbering restart below a newer incarnation's, so it is refused.
    fn walk(&self, from: u64) -> Result<Vec<(u64, String)>, SinkError> {
        let (project, dataset, _) = rest::parts(self.target);
        let context = format!("listing the overwrite markers of {} in dataset {project}.{dataset}", self.target);
        let listed = tables::api(self.cfg).list(project, dataset).map_err(|e| rest_failure(&context, e))?;
        let prefix = self.prefix();
        let mut taken = Vec::new();
        for (id, labels) in listed {
            let Some(g) = id.strip_prefix(&prefix).and_then(|g| g.parse::<u64>().ok()) else { continue };
            let holder = labels.get(MARKER_LABEL).and_then(Value::as_str).ok_or_else(|| {
                error::fatal(format!(
                    "table {} has no label `{MARKER_LABEL}`: Sluice keeps there which incarnation of this job last \
                     began to overwrite partitions of {}, so it will not guess",
                    self.path(g),
                    self.target
                ))
            })?;
            taken.push((g, holder.to_string()));
        }
        taken.sort();
        for (want, (g, _)) in taken.iter().enumerate() {
            if *g != want as u64 {
                return Err(error::fatal(format!(
                    "the overwrite marker {} of table {} is missing (expired or deleted) while {} exists: which \
                     incarnation of job `{}` sink `{}` may overwrite its partitions can no longer be told, so nothing \
                     was copied. Make a table {} labelled `{MARKER_LABEL}` with the incarnation that held it (see the \
                     markers beside it), or move the target and its markers to a fresh table",
                    self.path(want as u64),
                    self.target,
                    self.path(*g),
                    self.ctx.job_id,
                    self.ctx.sink_id,
                    self.path(want as u64),
                )));
            }
        }
        Ok(taken.into_iter().filter(|(g, _)| *g >= from).collect())
    }

    fn overtaken(&self, mine: u64, newer: u64, by: &str) -> SinkError {
        error::config(format!(
            "option `mode` = \"overwrite-partitions\": incarnation {by} of job `{}` sink `{}` began to overwrite \
             partitions of table {} after this incarnation ({}) did (overwrite marker {}, after this incarnation's \
             {}): copying this incarnation's staged rows now would replace the newer run's partitions with older \
             ones, so nothing was copied. This incarnation is superseded: do not resume it. To land its source \
             again, start over as a new incarnation (a fresh job.state_dir and `sluice run --new-incarnation`), \
             which replaces every partition it touches",
            self.ctx.job_id,
            self.ctx.sink_id,
            self.target,
            self.ctx.incarnation,
            self.path(newer),
            self.path(mine),
        ))
    }

    /// Pushes the expiration of every taken generation forward (every run
    /// does, so markers outlive the job however long it runs).
    pub fn refresh(&self) -> Result<(), SinkError> {
        let api = tables::api(self.cfg);
        let expires = from_now(MARKER_LIFETIME_MS);
        for (g, _) in self.walk(0)? {
            let path = self.path(g);
            let context = format!("moving the expiration of the overwrite marker {path} of {}", self.target);
            self.cfg
                .retry()
                .run(
                    |_| api.patch_expiration(&path, expires),
                    RestError::is_transient,
                    |e, _, _| log::warn(&format!("{context}: {e}; retrying")),
                )
                .map_err(|failed| rest_failure(&context, failed.error))?;
        }
        Ok(())
    }

    /// Refuses when a generation after `mine` is taken by another incarnation.
    pub fn check(&self, mine: u64) -> Result<(), SinkError> {
        match self.newer(mine)? {
            Some((g, by)) => Err(self.overtaken(mine, g, &by)),
            None => Ok(()),
        }
    }

    /// The first generation after `mine` another incarnation took, with it.
    pub fn newer(&self, mine: u64) -> Result<Option<(u64, String)>, SinkError> {
        Ok(self.walk(mine + 1)?.into_iter().find(|(_, inc)| *inc != self.ctx.incarnation))
    }

    /// The error of a copy of checkpoint `c` into `partitions` that a newer
    /// incarnation (generation `newer`, by `by`) overtook while it ran.
    pub fn overtaken_late(&self, c: u64, mine: u64, newer: u64, by: &str, partitions: &[String]) -> SinkError {
        error::fatal(format!(
            "checkpoint {c}: while this incarnation ({}) copied partitions {} of table {}, incarnation {by} took \
             the table over (overwrite marker {}, after this incarnation's {}) and deleted this incarnation's \
             staging table. Any of these partitions may hold this older incarnation's rows over the newer run's: \
             land the backfill again as a new incarnation (a fresh job.state_dir and `sluice run \
             --new-incarnation`), which replaces every partition it touches; do not resume this incarnation",
            self.ctx.incarnation,
            partitions.join(", "),
            self.target,
            self.path(newer),
            self.path(mine),
        ))
    }

    /// Deletes the staging tables of the incarnations that took the
    /// generations before `mine`: a copy they still try fails with
    /// `notFound` and applies nothing. A table already gone is no failure.
    fn supersede(&self, taken: &[(u64, String)], mine: u64) -> Result<(), SinkError> {
        let api = tables::api(self.cfg);
        let older: BTreeSet<&String> =
            taken.iter().filter(|(g, inc)| *g < mine && *inc != self.ctx.incarnation).map(|(_, inc)| inc).collect();
        for inc in older {
            let stage = staging_path_of(self.ctx, inc, self.target);
            let context = format!(
                "deleting the staging table {stage} of the older incarnation {inc} of table {}, so that it copies \
                 nothing more",
                self.target
            );
            let deleted = self
                .cfg
                .retry()
                .run(|_| api.delete(&stage), RestError::is_transient, |e, _, _| log::warn(&format!("{context}: {e}")))
                .map_err(|failed| rest_failure(&context, failed.error))?;
            if deleted {
                log::info(&format!("overwrite-partitions: {context}: done"));
            }
        }
        Ok(())
    }

    /// The generation this incarnation holds (`known`, from its state, or
    /// found among the markers, or taken as the next one), after checking
    /// that no other incarnation took a later one.
    pub fn hold(&self, known: Option<u64>) -> Result<u64, SinkError> {
        if let Some(mine) = known {
            self.check(mine)?;
            return Ok(mine);
        }
        for attempt in 1..=self.cfg.attempts.max(1) {
            let taken = self.walk(0)?;
            let me = &self.ctx.incarnation;
            if let Some(mine) = taken.iter().rev().find(|(_, inc)| inc == me).map(|(g, _)| *g) {
                // Taken by an earlier run of this incarnation.
                if let Some((g, by)) = taken.iter().find(|(g, inc)| *g > mine && inc != me) {
                    return Err(self.overtaken(mine, *g, by));
                }
                self.supersede(&taken, mine)?;
                return Ok(mine);
            }
            let next = taken.last().map_or(0, |(g, _)| g + 1);
            let path = self.path(next);
            let description = format!(
                "Sluice: incarnation {me} of job `{}` sink `{}` began to overwrite partitions of {} as generation \
                 {next}; older generations copy nothing more into it. Keep this table while the job runs",
                self.ctx.job_id, self.ctx.sink_id, self.target
            );
            match tables::api(self.cfg).insert_marker_expiring(
                &path,
                &description,
                &json!({ MARKER_LABEL: me }),
                from_now(MARKER_LIFETIME_MS),
            ) {
                Ok(true) => {
                    log::info(&format!("overwrite-partitions: {} holds generation {next} of {}", me, self.target));
                    self.supersede(&taken, next)?;
                    return Ok(next);
                }
                // Taken meanwhile, or by this run's own unanswered try: read again.
                Ok(false) => {}
                Err(e) if e.is_transient() => {
                    log::warn(&format!("taking the overwrite marker {path}: {e}; reading the markers again"));
                    if let Some(wait) = self.cfg.retry().delay(attempt) {
                        std::thread::sleep(wait);
                    }
                }
                Err(e) => return Err(rest_failure(&format!("taking the overwrite marker {path}"), e)),
            }
        }
        Err(error::retryable(format!(
            "taking an overwrite marker of {}: the markers kept changing or could not be made",
            self.target
        )))
    }
}

/// The partition of every row of some batches, in row order.
#[derive(Debug, Default)]
pub(crate) struct RowPartitions {
    /// The distinct partition ids.
    ids: Vec<String>,
    /// Per row, its partition's index in `ids`.
    rows: Vec<usize>,
}

impl RowPartitions {
    /// The partition ids of rows `first..first + n`, in order, once each.
    pub fn of(&self, first: usize, n: usize) -> Vec<String> {
        let end = first.saturating_add(n).min(self.rows.len());
        let at: BTreeSet<usize> = self.rows.get(first..end).unwrap_or_default().iter().copied().collect();
        let mut out: Vec<String> = at.into_iter().filter_map(|i| self.ids.get(i).cloned()).collect();
        out.sort();
        out
    }

    fn push(&mut self, id: String) {
        let i = match self.ids.iter().position(|x| *x == id) {
            Some(i) => i,
            None => {
                self.ids.push(id);
                self.ids.len() - 1
            }
        };
        self.rows.push(i);
    }
}

/// The partition id (`20240105`, `__NULL__`) of every row of `batches`,
/// by the partitioning column. A row that cannot be partitioned is
/// `invalid-data` named with the contract's phrase (`row N of this
/// writer's input for table "T"`), `first_row` being the index of the
/// first row of `batches` among the rows given for `table` since it was
/// opened or changed, so the host names its file and line (and with dead
/// letters takes it).
pub(crate) fn row_partitions(
    p: &Partitioning,
    table: &str,
    first_row: u64,
    batches: &[RecordBatch],
) -> Result<RowPartitions, SinkError> {
    let mut n = first_row;
    let mut into = RowPartitions::default();
    let fmt = p.format();
    let (Some(lo), Some(hi)) = (date32_to_datetime(PARTITION_DAYS.start), date32_to_datetime(PARTITION_DAYS.end))
    else {
        return Err(error::fatal("the bounds of BigQuery's partitions cannot be represented"));
    };
    for batch in batches {
        let schema: Arc<Schema> = batch.schema();
        let Some((i, field)) =
            schema.fields().iter().enumerate().find(|(_, f)| f.name().eq_ignore_ascii_case(&p.field))
        else {
            return Err(error::config(format!(
                "table {table}: the rows have no column {:?}, which partitions the table",
                p.field
            )));
        };
        let column = batch.column(i);
        let base = n;
        n += column.len() as u64;
        for row in 0..column.len() {
            let at = base + row as u64;
            let bad = |v: i64| {
                error::invalid_data(format!(
                    "row {at} of this writer's input for table {table:?}: column {:?} value {v} is not a valid time",
                    p.field
                ))
            };
            if column.is_null(row) {
                into.push(NULL_PARTITION.to_string());
                continue;
            }
            let time = match field.data_type() {
                DataType::Date32 => {
                    let v = column.as_primitive::<arrow_array::types::Date32Type>().value(row);
                    date32_to_datetime(v).ok_or_else(|| bad(i64::from(v)))?
                }
                DataType::Date64 => {
                    let v = column.as_primitive::<arrow_array::types::Date64Type>().value(row);
                    date64_to_datetime(v).ok_or_else(|| bad(v))?
                }
                DataType::Timestamp(unit, _) => {
                    // Stored as UTC instants; BigQuery partitions TIMESTAMP by UTC.
                    let (v, t) = match unit {
                        TimeUnit::Second => {
                            let v = column.as_primitive::<TimestampSecondType>().value(row);
                            (v, as_datetime::<TimestampSecondType>(v))
                        }
                        TimeUnit::Millisecond => {
                            let v = column.as_primitive::<TimestampMillisecondType>().value(row);
                            (v, as_datetime::<TimestampMillisecondType>(v))
                        }
                        TimeUnit::Microsecond => {
                            let v = column.as_primitive::<TimestampMicrosecondType>().value(row);
                            (v, as_datetime::<TimestampMicrosecondType>(v))
                        }
                        TimeUnit::Nanosecond => {
                            let v = column.as_primitive::<TimestampNanosecondType>().value(row);
                            (v, as_datetime::<TimestampNanosecondType>(v))
                        }
                    };
                    t.ok_or_else(|| bad(v))?
                }
                other => {
                    return Err(error::config(format!(
                        "table {table}: column {:?} partitions the table but the rows hold it as {other}, \
                         not a date or a timestamp",
                        p.field
                    )));
                }
            };
            check_range(table, at, &p.field, &time, &lo, &hi)?;
            into.push(time.format(fmt).to_string());
        }
    }
    Ok(into)
}

/// Refuses a time outside the partitions BigQuery makes ([`PARTITION_DAYS`],
/// as arrow's own conversions of its bounds, `[lo, hi)`, so the plugin
/// needs no date crate of its own).
fn check_range<T: PartialOrd + std::fmt::Display>(
    table: &str,
    row: u64,
    column: &str,
    time: &T,
    lo: &T,
    hi: &T,
) -> Result<(), SinkError> {
    if time >= lo && time < hi {
        return Ok(());
    }
    Err(error::invalid_data(format!(
        "row {row} of this writer's input for table {table:?}: column {column:?} value {time} lies outside the range BigQuery partitions (1960-01-01 to \
         2159-12-31); such a row lands in partition __UNPARTITIONED__, which option `mode` = \
         \"overwrite-partitions\" cannot replace, so it was not written"
    )))
}

thread_local! {
    /// Dataset locations read so far, by `project/dataset` (an instance
    /// reads each once).
    static LOCATIONS: RefCell<BTreeMap<String, String>> = const { RefCell::new(BTreeMap::new()) };
}

/// The location of the target's dataset, where its copy jobs run: sent as
/// `jobReference.location` and passed to every `jobs.get`, which finds a
/// job in a single region only by its location ("You must specify the
/// location to run the job for the following scenarios: If the location
/// to run a job is not in the us or the eu multi-regional location; If the
/// job's location is in a single region",
/// https://cloud.google.com/bigquery/docs/reference/rest/v2/jobs/get).
fn dataset_location(cfg: &Config, project: &str, dataset: &str) -> Result<String, SinkError> {
    let key = format!("{project}/{dataset}");
    if let Some(known) = LOCATIONS.with(|l| l.borrow().get(&key).cloned()) {
        return Ok(known);
    }
    let context = format!("reading the location of dataset {project}.{dataset}");
    let location = tables::api(cfg)
        .dataset_location(project, dataset)
        .map_err(|e| rest_failure(&context, e))?
        .ok_or_else(|| error::config(format!("{context}: the dataset does not exist or names no location")))?;
    LOCATIONS.with(|l| l.borrow_mut().insert(key, location.clone()));
    Ok(location)
}

/// What `jobs.get` says of a job.
enum Outcome {
    /// DONE without `errorResult`: the partition was replaced.
    Done,
    /// DONE with a transient `errorResult`: nothing was applied; the next
    /// index may be tried.
    FailedTransient(String),
    /// PENDING or RUNNING.
    Running,
}

fn outcome(job_id: &str, job: &Value) -> Result<Outcome, SinkError> {
    let state = job.pointer("/status/state").and_then(Value::as_str).unwrap_or("");
    if state != "DONE" {
        return Ok(Outcome::Running);
    }
    let Some(err) = job.pointer("/status/errorResult").filter(|e| !e.is_null()) else {
        return Ok(Outcome::Done);
    };
    let reason = err.get("reason").and_then(Value::as_str).unwrap_or("");
    let message = err.get("message").and_then(Value::as_str).unwrap_or("");
    if TRANSIENT_REASONS.contains(&reason) {
        Ok(Outcome::FailedTransient(format!("{reason}: {message}")))
    } else {
        Err(error::fatal(format!("copy job {job_id} failed ({reason}: {message}); it applied nothing")))
    }
}

/// Replaces partition `d` of `target` with `stage$d` for checkpoint `c`,
/// exactly once however often it is called (see the module invariants).
pub(crate) fn replace_partition(
    cfg: &Config,
    ctx: &SinkContext,
    c: u64,
    target: &str,
    stage: &str,
    d: &str,
) -> Result<(), SinkError> {
    let (project, dataset, table) = rest::parts(target);
    let (_, _, stage_table) = rest::parts(stage);
    let jobs = Jobs { endpoint: &cfg.rest_endpoint, timeout_ms: cfg.rpc_timeout_ms };
    let location = dataset_location(cfg, project, dataset)?;
    // How many transient job failures (new indexes) and unknown outcomes one call absorbs.
    let budget = cfg.attempts.max(1);
    let (mut failures, mut unknown) = (0u32, 0u32);
    let mut k = 0u32;
    loop {
        let id = job_id(ctx, target, c, d, k);
        let body = json!({
            "jobReference": { "projectId": project, "jobId": id, "location": location },
            "configuration": { "copy": {
                "sourceTable": { "projectId": project, "datasetId": dataset, "tableId": format!("{stage_table}${d}") },
                "destinationTable": { "projectId": project, "datasetId": dataset, "tableId": format!("{table}${d}") },
                "writeDisposition": "WRITE_TRUNCATE",
                "createDisposition": "CREATE_NEVER",
            }},
        });
        let context = format!("checkpoint {c}: copy job {id} ({stage}${d} → {target}${d})");
        // Whether this call made the job (or may have: a lost reply), as
        // against one an earlier try or run made: only this call's
        // failures count against its budget, so a walk past the ids that
        // failed before always reaches a new one.
        let mut fresh = true;
        let job = match jobs.insert(project, &body) {
            Ok(Inserted::Created(job)) => job,
            // Ours from an earlier try or run, or the one a lost reply hid.
            Ok(Inserted::Duplicate) => match jobs.get(project, &id, Some(&location)) {
                Ok(Some(job)) => {
                    fresh = false;
                    job
                }
                Ok(None) => {
                    return Err(error::retryable(format!(
                        "{context}: jobs.insert answered 409 duplicate but jobs.get finds no such job"
                    )));
                }
                Err(e) => return Err(rest_failure(&context, e)),
            },
            Err(RestError::Denied(m)) => return Err(error::config(format!("{context}: {m}"))),
            // A definite refusal (400 invalid, 403, 404 dataset): no job was made.
            Err(e) if !e.is_transient() => return Err(error::fatal(format!("{context}: refused: {e}"))),
            Err(e) => {
                // An unknown outcome: the job may exist. Only jobs.get of this id settles it.
                log::warn(&format!("{context}: jobs.insert got no answer ({e}); asking jobs.get"));
                match jobs.get(project, &id, Some(&location)) {
                    Ok(Some(job)) => job,
                    Ok(None) => {
                        unknown += 1;
                        if unknown >= budget {
                            return Err(error::retryable(format!(
                                "{context}: jobs.insert failed {unknown} times: {e}"
                            )));
                        }
                        if let Some(wait) = cfg.retry().delay(unknown) {
                            std::thread::sleep(wait);
                        }
                        // Not created: insert the same id again.
                        continue;
                    }
                    Err(e) => return Err(rest_failure(&context, e)),
                }
            }
        };
        match wait_done(cfg, &jobs, project, &location, &id, job, &context)? {
            Outcome::Done => {
                log::info(&format!("checkpoint {c}: partition {target}${d} replaced by copy job {id}"));
                return Ok(());
            }
            Outcome::FailedTransient(why) => {
                log::warn(&format!("{context} failed and applied nothing ({why}); trying it as attempt {}", k + 1));
                if fresh {
                    failures += 1;
                    if failures >= budget {
                        return Err(error::retryable(format!(
                            "{context}: failed {failures} times in a row, last: {why}"
                        )));
                    }
                    // A rate limit or a backend error: wait before the next id.
                    if let Some(wait) = cfg.retry().delay(failures) {
                        std::thread::sleep(wait);
                    }
                }
                k += 1;
            }
            Outcome::Running => {
                return Err(error::retryable(format!("{context}: still running; its commit is asked again")));
            }
        }
    }
}

/// Polls `jobs.get` until the job is DONE, or gives up with `Running`
/// (the commit is retried and finds the same job by its id).
fn wait_done(
    cfg: &Config,
    jobs: &Jobs,
    project: &str,
    location: &str,
    id: &str,
    mut job: Value,
    context: &str,
) -> Result<Outcome, SinkError> {
    // Polls in all, at the retry policy's growing delays (some minutes with
    // the defaults); then the commit is asked again and finds the same job.
    const POLLS: u32 = 120;
    for poll in 1..=POLLS {
        match outcome(id, &job)? {
            Outcome::Running => {}
            done => return Ok(done),
        }
        let wait = cfg
            .retry()
            .delay(poll.min(cfg.attempts.saturating_sub(1)).max(1))
            .unwrap_or(Duration::from_millis(cfg.backoff_ms.max(10)));
        std::thread::sleep(wait);
        job = match jobs.get(project, id, Some(location)) {
            Ok(Some(job)) => job,
            // Not proof that it did not run (a job just made, or asked for
            // in the wrong location, may be answered 404): unknown, so the
            // commit is asked again, which finds the job by its id.
            Ok(None) => {
                return Err(error::retryable(format!(
                    "{context}: jobs.get answers 404 for a job that was made; whether it ran is unknown, and the \
                     commit is asked again"
                )));
            }
            Err(e) if e.is_transient() => continue,
            Err(e) => return Err(rest_failure(context, e)),
        };
    }
    Ok(Outcome::Running)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Date32Array, TimestampMicrosecondArray};
    use arrow_schema::Field;

    fn p(unit: Unit, field: &str) -> Partitioning {
        Partitioning { unit, field: field.into() }
    }

    #[test]
    fn partition_ids_follow_the_unit_and_the_column() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("Day", DataType::Date32, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false),
        ]));
        // 2024-01-01 is day 19723; 2024-02-29T23:30Z in µs.
        let ts = 1_709_249_400_000_000i64;
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Date32Array::from(vec![Some(19_723), None, Some(19_724)])),
                Arc::new(TimestampMicrosecondArray::from(vec![ts, ts, ts]).with_timezone("UTC")),
            ],
        )
        .unwrap();
        let ids = |part: Partitioning| row_partitions(&part, "t", 0, std::slice::from_ref(&batch)).unwrap().of(0, 3);
        assert_eq!(ids(p(Unit::Day, "day")), vec!["20240101", "20240102", "__NULL__"]);
        assert_eq!(ids(p(Unit::Hour, "ts")), vec!["2024022923"]);
        assert_eq!(ids(p(Unit::Month, "ts")), vec!["202402"]);
        assert_eq!(ids(p(Unit::Year, "ts")), vec!["2024"]);
        // A request's rows name only their own partitions.
        let days = row_partitions(&p(Unit::Day, "day"), "t", 0, std::slice::from_ref(&batch)).unwrap();
        assert_eq!(days.of(0, 1), vec!["20240101"]);
        assert_eq!(days.of(1, 2), vec!["20240102", "__NULL__"]);
        assert_eq!(days.of(2, 9), vec!["20240102"]);
        let err = row_partitions(&p(Unit::Day, "nope"), "t", 0, &[batch]).unwrap_err();
        assert!(format!("{err:?}").contains("nope"));
    }

    #[test]
    fn dates_outside_the_partitioned_range_are_refused_naming_column_and_value() {
        let schema = Arc::new(Schema::new(vec![Field::new("day", DataType::Date32, true)]));
        let batch =
            |days: Vec<i32>| RecordBatch::try_new(schema.clone(), vec![Arc::new(Date32Array::from(days))]).unwrap();
        // 1960-01-01 and 2159-12-31 are the first and last partitioned days.
        let edges = row_partitions(&p(Unit::Day, "day"), "t", 0, &[batch(vec![-3653, 69_395])]).unwrap();
        assert_eq!(edges.of(0, 2), vec!["19600101", "21591231"]);
        for (day, text) in [(-3654, "1959-12-31"), (69_396, "2160-01-01")] {
            // The second batch's second row: row 7 + 2 + 1 of the table's input.
            let batches = [batch(vec![19_723, 19_724]), batch(vec![19_723, day])];
            let err = row_partitions(&p(Unit::Year, "day"), "t", 7, &batches).unwrap_err();
            let SinkError::InvalidData(msg) = err else { panic!("not invalid data: {err:?}") };
            assert!(msg.starts_with("row 10 of this writer's input for table \"t\": "), "{msg}");
            assert!(msg.contains("column \"day\"") && msg.contains(text) && msg.contains("__UNPARTITIONED__"), "{msg}");
        }
    }

    #[test]
    fn an_empty_state_is_none_and_a_state_round_trips() {
        assert!(State::default().is_empty());
        assert_eq!(serde_json::to_string(&State::default()).unwrap(), "{}");
        let state = State {
            staged: BTreeMap::from([("projects/p/datasets/d/tables/t".into(), Some(2))]),
            appended: false,
            upserted: false,
        };
        assert!(!state.is_empty());
        let back: State = serde_json::from_slice(&serde_json::to_vec(&state).unwrap()).unwrap();
        assert_eq!(back, state);
        let appended: State = serde_json::from_str(r#"{"appended":true}"#).unwrap();
        assert!(appended.appended && !appended.is_empty());
    }

    #[test]
    fn an_unpartitioned_or_ingestion_time_table_is_refused_naming_it() {
        for tp in [None, Some(json!({"type": "DAY"}))] {
            let err = Partitioning::from_table("projects/p/datasets/d/tables/t", tp.as_ref()).unwrap_err();
            let text = format!("{err:?}");
            assert!(text.contains("projects/p/datasets/d/tables/t") && text.contains("overwrite-partitions"), "{text}");
        }
        let got = Partitioning::from_table("x", Some(&json!({"type": "MONTH", "field": "ts"}))).unwrap();
        assert_eq!(got, p(Unit::Month, "ts"));
    }

    #[test]
    fn job_ids_are_deterministic_valid_and_distinct() {
        let ctx = |inc: &str| SinkContext {
            job_id: "j".into(),
            sink_id: "s".into(),
            incarnation: inc.into(),
            refuse_other_incarnations: false,
            subtask: 0,
            parallelism: 1,
            attempt: 1,
        };
        let a = job_id(&ctx("i1"), "projects/p/datasets/d/tables/t", 3, "20240101", 0);
        assert_eq!(a, job_id(&ctx("i1"), "projects/p/datasets/d/tables/t", 3, "20240101", 0));
        assert!(a.starts_with("sluice_") && a.ends_with("_0") && a.len() == "sluice_".len() + 40 + 2);
        assert!(a.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'));
        assert_ne!(a, job_id(&ctx("i2"), "projects/p/datasets/d/tables/t", 3, "20240101", 0));
        assert_ne!(a, job_id(&ctx("i1"), "projects/p/datasets/d/tables/t", 4, "20240101", 0));
        assert_ne!(a, job_id(&ctx("i1"), "projects/p/datasets/d/tables/t", 3, "20240102", 0));
        let stage = staging_path(&ctx("i1"), "projects/p/datasets/d/tables/t");
        assert!(stage.starts_with("projects/p/datasets/d/tables/_sluice_stage_"), "{stage}");
        assert_ne!(stage, staging_path(&ctx("i2"), "projects/p/datasets/d/tables/t"));
    }
}
