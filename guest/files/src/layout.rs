//! Where the files sink puts things. One place, so writer and committer agree.
//!
//! A local `path` ([`Publish::Rename`]):
//! - visible: `<path>/<key>.c<c>/` for the single table `""`, and
//!   `<path>/<table>/<key>.c<c>/` for a named table;
//! - staging: `<staging>/<key>/attempt-<a>/inprogress/<table>/` while files
//!   are written, `<staging>/<key>/attempt-<a>/c<c>/<table>/` once prepared.
//!
//! An object-store `path` ([`Publish::Marker`]):
//! - data objects, written once where they stay:
//!   `<path>/_sluice_data/<key>/attempt-<a>/<table>/part-<subtask>-<seq>.parquet`;
//! - commit markers: `<path>/<key>.c<c>.json` for the single table, and
//!   `<path>/<table>/<key>.c<c>.json` for a named table.
//!
//! `mode = "overwrite-partitions"` ([`Publish::Log`]), local or object
//! store, everything under the table's directory `<T>` (`<path>` for the
//! single table, `<path>/<table>` for a named one):
//! - data files, written once where they stay:
//!   `<T>/_sluice_data/<key>/attempt-<a>/<col=val>/part-<subtask>-<seq>.parquet`;
//! - the version log `<T>/_sluice_log/` (see `versions`).
//!
//! With `partition_by`, each file's name (relative to its table's staging
//! or data folder) starts with its partition's path (`day=2024-01-05/`).
//!
//! Where `<key>` is `<job>.<sink>.<incarnation>` and `<table>` is `_` for
//! the single table (in staging and data names).
//!
//! A table directory holds one layout: append's checkpoint directories or
//! markers, or an overwrite log, never both ([`refuse_mixed_layouts`]).

use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{SinkContext, SinkError, claim, error, incarnation};

use crate::{Config, DATA_DIR, Publish};

/// Checks that a table name can name a directory.
pub fn check_table_name(table: &str) -> Result<(), SinkError> {
    let ok = table.is_empty()
        || (table != "_"
            && !table.starts_with('.')
            && table.len() <= 200
            && table.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')));
    if ok {
        Ok(())
    } else {
        Err(error::config(format!(
            "table name {table:?} cannot name a directory: use letters, digits, `_`, `-` and `.`"
        )))
    }
}

/// The directory part a table takes in staging.
fn table_dir(table: &str) -> &str {
    if table.is_empty() { "_" } else { table }
}

/// Root of everything this incarnation of the job's sink stages.
pub fn staging_root(cfg: &Config, ctx: &SinkContext) -> String {
    join(&cfg.staging, &incarnation::key(ctx))
}

pub fn attempt_dir(cfg: &Config, ctx: &SinkContext, attempt: u32) -> String {
    join(&staging_root(cfg, ctx), &format!("attempt-{attempt}"))
}

/// Where a writer streams the open files of `table`: staging's `inprogress`
/// on a local disk; on an object store the table's data folder of this
/// attempt, where the objects stay.
///
/// In overwrite mode the table's directory: there a file's name carries its
/// data folder ([`data_name`]), so that the log can name it relative to the
/// table.
pub fn inprogress_dir(cfg: &Config, ctx: &SinkContext, table: &str) -> String {
    match cfg.publish {
        Publish::Rename => join(&join(&attempt_dir(cfg, ctx, ctx.attempt), "inprogress"), table_dir(table)),
        Publish::Marker { .. } => data_dir(&attempt_dir(cfg, ctx, ctx.attempt), table),
        Publish::Log { .. } => table_path(cfg, table),
    }
}

/// The name of data file `seq` of `subtask` in `partition` (a path, `""`
/// when unpartitioned), relative to [`inprogress_dir`].
pub fn data_name(cfg: &Config, ctx: &SinkContext, partition: &str, seq: u64) -> String {
    let file = file_name(ctx.subtask, seq);
    let file = if partition.is_empty() { file } else { format!("{partition}/{file}") };
    match cfg.publish {
        Publish::Rename | Publish::Marker { .. } => file,
        Publish::Log { .. } => {
            format!("{DATA_DIR}/{}/attempt-{}/{file}", incarnation::key(ctx), ctx.attempt)
        }
    }
}

/// The folder of a table's overwrite log.
pub const LOG_DIR: &str = "_sluice_log";

/// `<T>/_sluice_log`.
pub fn log_dir(cfg: &Config, table: &str) -> String {
    join(&table_path(cfg, table), LOG_DIR)
}

/// Whether `name` is an append checkpoint's visible directory or commit
/// marker (`<anything>.c<10 digits>` or that with `.json`), of any job.
fn is_append_checkpoint(name: &str) -> bool {
    let name = name.strip_suffix(".json").unwrap_or(name);
    let Some((_, checkpoint)) = name.rsplit_once('.') else { return false };
    checkpoint.len() == 11 && checkpoint.starts_with('c') && checkpoint[1..].bytes().all(|b| b.is_ascii_digit())
}

/// Refuses a table directory that holds the other mode's layout: in
/// overwrite mode one with append checkpoints (directories or markers),
/// which no version names and a log-following reader would lose; in append
/// mode one with an overwrite log, whose readers would never see appended
/// checkpoints. Either way a reader of one layout misreads the other, so
/// nothing is written.
pub fn refuse_mixed_layouts(cfg: &Config, tables: &[String]) -> Result<(), SinkError> {
    for table in tables {
        let dir = table_path(cfg, table);
        let label = if table.is_empty() { "the output".to_string() } else { format!("table {table}") };
        if cfg.overwrite {
            let names = match files::list_dir(&dir) {
                Ok(names) => names,
                Err(sluice_guest_sdk::IoError::NotFound(_)) => continue,
                Err(e) => return Err(files::to_sink_error(&format!("listing {dir}"), e)),
            };
            if let Some(name) = names.iter().find(|n| is_append_checkpoint(n)) {
                return Err(error::config(format!(
                    "[sink.options] mode = \"overwrite-partitions\": {label} ({dir}) holds checkpoints landed in \
                     append mode (e.g. {name}); a table directory cannot mix layouts, because a reader following \
                     the overwrite log would not see them. Write the overwrite to a new `path` (or table), or keep \
                     mode = \"append\" here"
                )));
            }
        } else {
            let log = join(&dir, LOG_DIR);
            if files::exists(&log).map_err(|e| files::to_sink_error(&format!("checking {log}"), e))? {
                return Err(error::config(format!(
                    "[sink.options] mode = \"append\": {label} ({dir}) is an overwrite table (it has a version log, \
                     {log}); a table directory cannot mix layouts, because readers of it follow the log and would \
                     never see appended checkpoints. Set mode = \"overwrite-partitions\" to land into it, or write \
                     to a new `path` (or table)"
                )));
            }
        }
    }
    Ok(())
}

/// Object stores: the folder of `table`'s data objects in an attempt's
/// folder (`attempt_dir`).
pub fn data_dir(attempt_dir: &str, table: &str) -> String {
    join(attempt_dir, table_dir(table))
}

/// Where a checkpoint's finished files wait for the commit.
pub fn checkpoint_staging_dir(cfg: &Config, ctx: &SinkContext, c: u64) -> String {
    join(&attempt_dir(cfg, ctx, ctx.attempt), &format!("c{c:010}"))
}

/// Where a checkpoint's finished files of `table` wait for the commit.
pub fn table_staging_dir(checkpoint_dir: &str, table: &str) -> String {
    join(checkpoint_dir, table_dir(table))
}

/// The directory holding `table`'s visible checkpoints.
pub fn table_path(cfg: &Config, table: &str) -> String {
    if table.is_empty() { cfg.path.clone() } else { join(&cfg.path, table) }
}

/// The visible directory of checkpoint `c` of `table`: derived from job,
/// sink, incarnation, table and `c` only, never from the attempt, so a
/// re-commit finds it.
pub fn visible_dir(cfg: &Config, ctx: &SinkContext, table: &str, c: u64) -> String {
    join(&table_path(cfg, table), &format!("{}.c{c:010}", incarnation::key(ctx)))
}

/// Object stores: the commit marker of checkpoint `c` of `table`, derived
/// like [`visible_dir`] from job, sink, incarnation, table and `c` only.
pub fn marker(cfg: &Config, ctx: &SinkContext, table: &str, c: u64) -> String {
    join(&table_path(cfg, table), &format!("{}.c{c:010}.json", incarnation::key(ctx)))
}

/// The incarnation a visible directory or commit marker name belongs to,
/// when it is one of this job and sink: `Some(Some(id))`, or `Some(None)`
/// for a directory written before incarnations (`<job>.<sink>.c<c>`).
fn incarnation_of<'a>(ctx: &SinkContext, name: &'a str) -> Option<Option<&'a str>> {
    let name = name.strip_suffix(".json").unwrap_or(name);
    let rest = name.strip_prefix(&format!("{}.{}.", ctx.job_id, ctx.sink_id))?;
    let is_checkpoint = |s: &str| s.len() == 11 && s.starts_with('c') && s[1..].bytes().all(|b| b.is_ascii_digit());
    if is_checkpoint(rest) {
        return Some(None);
    }
    let (id, checkpoint) = rest.split_once('.')?;
    is_checkpoint(checkpoint).then_some(Some(id))
}

/// Stops a fresh state directory's first run when a table's directory holds
/// a committed checkpoint of this job and sink from another incarnation.
pub fn refuse_other_incarnations(cfg: &Config, ctx: &SinkContext, tables: &[String]) -> Result<(), SinkError> {
    if !ctx.refuse_other_incarnations {
        return Ok(());
    }
    if cfg.overwrite {
        for table in tables {
            let found = crate::versions::incarnations(cfg, ctx, table)?;
            if let Some(other) = found.iter().find(|inc| **inc != ctx.incarnation) {
                let dir = log_dir(cfg, table);
                let err = incarnation::refuse(ctx, &dir, "committed checkpoints", Some(other));
                let SinkError::Config(message) = err else { return Err(err) };
                return Err(error::config(format!(
                    "{message}; in mode overwrite-partitions that rerun replaces every partition it touches"
                )));
            }
        }
        return Ok(());
    }
    for table in tables {
        let dir = table_path(cfg, table);
        let names = match files::list_dir(&dir) {
            Ok(names) => names,
            Err(sluice_guest_sdk::IoError::NotFound(_)) => continue,
            Err(e) => return Err(files::to_sink_error(&format!("listing {dir}"), e)),
        };
        for name in &names {
            if let Some(found) = incarnation_of(ctx, name)
                && found != Some(ctx.incarnation.as_str())
            {
                let what = format!("committed checkpoints (e.g. {name})");
                return Err(incarnation::refuse(ctx, &dir, &what, found));
            }
        }
    }
    Ok(())
}

/// The output's claim file: `<path>/_sluice_claim.<job>.<sink>.json`, naming
/// the one incarnation of this job's sink that may publish under `<path>`
/// (the leading `_` keeps Hadoop-style readers from taking it for data, and
/// the `.json` keeps it out of a `**/*.parquet` glob, whatever the sink id).
pub fn claim_location(cfg: &Config, ctx: &SinkContext) -> String {
    join(&cfg.path, &format!("_sluice_claim.{}.{}.json", ctx.job_id, ctx.sink_id))
}

/// Refuses an output whose claim another incarnation holds (a check before
/// anything is written; the claim itself is taken by [`claim`]).
pub fn refuse_if_claimed(cfg: &Config, ctx: &SinkContext) -> Result<(), SinkError> {
    let holder = claim::file_holder(&claim_location(cfg, ctx))?;
    claim::check(ctx, cfg.claim, &cfg.path, holder.as_deref()).map(|_| ())
}

/// Takes the output's claim for this incarnation (an exclusive create),
/// or finds it held already; refuses when another incarnation holds it, and
/// refuses a free claim where another incarnation's checkpoints are visible
/// and none of this one's (its claim was removed, or it predates claims).
pub fn claim(cfg: &Config, ctx: &SinkContext) -> Result<(), SinkError> {
    let location = claim_location(cfg, ctx);
    if cfg.claim == claim::Mode::Exclusive && claim::file_holder(&location)?.is_none() {
        let (ours, other) = committed_incarnations(cfg, ctx)?;
        if let (false, Some(other)) = (ours, other) {
            let other = other
                .map_or("an incarnation from before incarnation ids".to_string(), |id| format!("incarnation {id}"));
            return Err(claim::refused_unclaimed(ctx, &cfg.path, &other));
        }
    }
    claim::take_file(ctx, cfg.claim, &cfg.path, &location)
}

/// Whether `<path>` (and its tables' directories) holds committed
/// checkpoints of this incarnation, and another incarnation whose it holds.
fn committed_incarnations(cfg: &Config, ctx: &SinkContext) -> Result<(bool, Option<Option<String>>), SinkError> {
    let list = |dir: &str| match files::list_dir(dir) {
        Ok(names) => Ok(names),
        Err(sluice_guest_sdk::IoError::NotFound(_)) => Ok(Vec::new()),
        Err(e) => Err(files::to_sink_error(&format!("listing {dir}"), e)),
    };
    let (mut ours, mut other) = (false, None);
    let top = list(&cfg.path)?;
    let mut dirs = vec![(cfg.path.clone(), top.clone())];
    for name in top.iter().filter(|n| incarnation_of(ctx, n).is_none() && !n.starts_with(['_', '.'])) {
        let dir = join(&cfg.path, name);
        // A table's directory; a file fails to list and holds no checkpoint.
        if let Ok(names) = files::list_dir(&dir) {
            dirs.push((dir, names));
        }
    }
    if cfg.overwrite {
        // Overwrite tables: the newest version's `committed` map says whose
        // checkpoints are live.
        for (dir, names) in &dirs {
            if !names.iter().any(|n| n == LOG_DIR) {
                continue;
            }
            let table = if dir == &cfg.path { String::new() } else { dir.rsplit('/').next().unwrap_or("").to_string() };
            for id in crate::versions::incarnations(cfg, ctx, &table)? {
                if id == ctx.incarnation {
                    ours = true;
                } else {
                    other = other.or(Some(Some(id)));
                }
            }
        }
        return Ok((ours, other));
    }
    for (_, names) in &dirs {
        for name in names {
            match incarnation_of(ctx, name) {
                Some(Some(id)) if id == ctx.incarnation => ours = true,
                Some(found) => other = other.or(Some(found.map(str::to_string))),
                None => {}
            }
        }
    }
    Ok((ours, other))
}

pub fn file_name(subtask: u32, seq: u64) -> String {
    format!("part-{subtask:04}-{seq:06}.parquet")
}

pub fn subtask_prefix(subtask: u32) -> String {
    format!("part-{subtask:04}-")
}
