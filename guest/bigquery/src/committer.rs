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
//!
//! The committer keeps a state (contract 0.2.3 `committer-state`,
//! [`overwrite::State`]): in overwrite mode, the targets this incarnation
//! stages rows for and the overwrite marker it holds on each; in append
//! mode, whether it landed a checkpoint. Staging tables are made (or found,
//! and their expiration pushed forward) at `restore`, once the state says
//! which ones this incarnation made before, never at `open`.
//! - an incarnation that landed checkpoints in append mode is refused in
//!   overwrite mode (its first copy would delete rows it delivered), by its
//!   state or by a pending checkpoint whose streams are on the target
//!   itself; and a checkpoint staged in overwrite mode is refused in append
//!   mode (its rows would stay in the staging table), as is an append run
//!   of an incarnation whose state names staged targets;
//! - before any copy of checkpoint `c`, every target it replaces partitions
//!   of is checked to be still this incarnation's (its newest overwrite
//!   marker, [`overwrite::Marker`], taken by the first commit that copies);
//!   otherwise nothing of `c` is copied. After the copies of a target it is
//!   checked again: a newer incarnation that took it over meanwhile fails
//!   the commit loudly, naming the partitions.
//!
//! With `mode = "upsert"` the writers' changes went through the tables'
//! default streams and are applied when `commit` is called; a commit takes
//! the datasets' claims and notes in the state that this incarnation
//! upserts ([`crate::upsert`] says why nothing more). An incarnation that
//! upserted is refused in another mode, and one that appended or staged is
//! refused in upsert mode, by its state or by a pending checkpoint of the
//! other kind, before anything is written.

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    FlushRowsRequest, FlushRowsResponse,
};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{CommitOutcome, GuestCommitter, SinkContext, SinkError, Table, TableChange, error, log};

use std::cell::RefCell;
use std::rc::Rc;

use crate::claim::Claims;
use crate::config::{Config, WriteMode};
use crate::overwrite::{self, Marker, Partitioning, State};
use crate::rpc::{self, FlushFailure};
use crate::tables;
use crate::writer::{CommitInfo, Flush, Upserted};

/// Every stream of checkpoint `c` to flush (the same shape as contract
/// 0.1's, whose flushes name no table).
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    flushes: Vec<Flush>,
    /// With `mode = "upsert"`: the changes checkpoint `c` applied, per
    /// writer and table ([`crate::upsert`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    upserts: Vec<Upserted>,
}

pub struct BigQueryCommitter {
    cfg: Config,
    ctx: SinkContext,
    claims: Claims,
    /// The paths of every table the committer was told of (open, evolve).
    known: std::cell::RefCell<std::collections::BTreeSet<String>>,
    /// What the committer shares with the `committer-state` export.
    shared: Rc<Shared>,
}

/// The committer's state and the tables whose staging waits for it.
pub(crate) struct Shared {
    cfg: Config,
    ctx: SinkContext,
    state: RefCell<State>,
    /// The tables of `open` whose staging tables are prepared at `restore`,
    /// when the state is known; `None` once restored.
    unstaged: RefCell<Option<Vec<Table>>>,
}

thread_local! {
    /// The committer opened in this instance (the host opens one committer
    /// per instance), for `committer-state`.
    static OPEN: RefCell<Option<Rc<Shared>>> = const { RefCell::new(None) };
}

fn open_shared() -> Result<Rc<Shared>, SinkError> {
    OPEN.with(|open| open.borrow().clone()).ok_or_else(|| error::fatal("committer-state called before committer.open"))
}

/// `committer-state.restore`: takes the state of the newest record of the
/// incarnation, refuses a switch from append to overwrite or from
/// overwrite (staged targets) to append, then prepares
/// the staging tables of the tables `open` was given.
pub(crate) fn restore_state(bytes: Option<Vec<u8>>) -> Result<(), SinkError> {
    let shared = open_shared()?;
    if let Some(bytes) = bytes.filter(|b| !b.is_empty()) {
        let restored: State = serde_json::from_slice(&bytes).map_err(|e| {
            error::fatal(format!("the restored committer state of the BigQuery sink is not valid: {e}"))
        })?;
        *shared.state.borrow_mut() = restored;
    }
    let unstaged = shared.unstaged.borrow_mut().take().unwrap_or_default();
    if shared.cfg.mode == WriteMode::OverwritePartitions && shared.state.borrow().appended {
        let targets: Vec<String> = unstaged
            .iter()
            .filter(|t| shared.cfg.overwrites(&t.name))
            .filter_map(|t| shared.cfg.table_path(&t.name).ok())
            .collect();
        return Err(switched_to_overwrite(&targets.join(", ")));
    }
    if shared.cfg.mode == WriteMode::Append {
        let staged: Vec<String> = shared.state.borrow().staged.keys().cloned().collect();
        if !staged.is_empty() {
            return Err(switched_to_append(&staged.join(", ")));
        }
    }
    let targets = || -> String {
        let paths: Vec<String> = unstaged.iter().filter_map(|t| shared.cfg.table_path(&t.name).ok()).collect();
        paths.join(", ")
    };
    let (upserted, appended, staged) = {
        let state = shared.state.borrow();
        (state.upserted, state.appended, !state.staged.is_empty())
    };
    if shared.cfg.mode != WriteMode::Upsert && upserted {
        return Err(switched_from_upsert(&shared.cfg, &targets()));
    }
    if shared.cfg.mode == WriteMode::Upsert && (appended || staged) {
        return Err(switched_to_upsert(if staged { "overwrite-partitions" } else { "append" }, &targets()));
    }
    for table in &unstaged {
        stage(&shared, table)?;
    }
    Ok(())
}

/// `committer-state.snapshot`: the state (empty, so none, until there is something to keep).
pub(crate) fn snapshot_state() -> Result<Vec<u8>, SinkError> {
    let shared = open_shared()?;
    let state = shared.state.borrow();
    if state.is_empty() {
        return Ok(Vec::new());
    }
    serde_json::to_vec(&*state).map_err(|e| error::fatal(format!("encoding the committer state: {e}")))
}

fn switched_to_overwrite(tables: &str) -> SinkError {
    error::config(format!(
        "[sink.options] mode = \"overwrite-partitions\": this incarnation already landed checkpoints in table(s) \
         {tables} without overwrite, and replacing the partitions they touched would delete rows already delivered; \
         nothing was copied. Finish it in the mode it started with, or land the backfill again as a new incarnation \
         (a fresh job.state_dir and --new-incarnation), which replaces every partition it touches"
    ))
}

fn switched_to_append(tables: &str) -> SinkError {
    error::config(format!(
        "[sink.options] mode = \"append\": this incarnation began with mode = \"overwrite-partitions\" and staged \
         rows for table(s) {tables}; appending now would add rows to partitions its copies replace (or replaced), \
         so nothing was written. Finish it with mode = \"overwrite-partitions\", or land the data again as a new \
         incarnation (a fresh job.state_dir and --new-incarnation)"
    ))
}

fn switched_from_upsert(cfg: &Config, tables: &str) -> SinkError {
    let mode = match cfg.mode {
        WriteMode::OverwritePartitions => "overwrite-partitions",
        _ => "append",
    };
    error::config(format!(
        "[sink.options] mode = \"{mode}\": this incarnation began with mode = \"upsert\" and applied changes to \
         table(s) {tables} by primary key; landing rows in another mode now would mix plain rows into tables kept \
         by key, so nothing was written. Finish it with mode = \"upsert\", or land the data again as a new \
         incarnation (a fresh job.state_dir and --new-incarnation)"
    ))
}

fn switched_to_upsert(began: &str, tables: &str) -> SinkError {
    error::config(format!(
        "[sink.options] mode = \"upsert\": this incarnation began with mode = \"{began}\" and landed rows in \
         table(s) {tables} that no primary key keeps; applying changes by key now would leave those rows beside \
         them, so nothing was written. Finish it in the mode it started with, or land the changes as a new \
         incarnation (a fresh job.state_dir and --new-incarnation) into a table with a primary key"
    ))
}

/// Makes the staging table of `table` (when its rows overwrite partitions).
fn stage(shared: &Shared, table: &Table) -> Result<(), SinkError> {
    if !shared.cfg.overwrites(&table.name) {
        return Ok(());
    }
    let target = shared.cfg.table_path(&table.name)?;
    let arrow = sluice_guest_sdk::ipc::decode_schema(&table.schema)?;
    overwrite::prepare_staging(&shared.cfg, &shared.ctx, &target, &arrow, &shared.state)
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
        // The tables the job starts with: created, or evolved to take the
        // rows; their staging tables wait for the state (`restore`).
        for table in &tables {
            prepare(&cfg, table)?;
        }
        let known = std::cell::RefCell::new(known);
        let shared = Rc::new(Shared {
            cfg: cfg.clone(),
            ctx: ctx.clone(),
            state: RefCell::new(State::default()),
            unstaged: RefCell::new(Some(tables)),
        });
        OPEN.with(|open| *open.borrow_mut() = Some(shared.clone()));
        Ok(sluice_guest_sdk::Committer::new(BigQueryCommitter { cfg, ctx, claims, known, shared }))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        for change in &changes {
            let path = self.cfg.table_path(&change.table.name)?;
            self.claims.check(&self.cfg, &self.ctx, &path)?;
            self.known.borrow_mut().insert(path);
            prepare(&self.cfg, &change.table)?;
            let mut unstaged = self.shared.unstaged.borrow_mut();
            match unstaged.as_mut() {
                // Not restored yet: staged with the others at `restore`.
                Some(waiting) => waiting.push(change.table.clone()),
                None => {
                    drop(unstaged);
                    stage(&self.shared, &change.table)?;
                }
            }
        }
        Ok(())
    }

    fn combine(&self, _c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let (mut flushes, mut upserts) = (Vec::with_capacity(infos.len()), Vec::new());
        for raw in &infos {
            let info: CommitInfo =
                serde_json::from_slice(raw).map_err(|e| error::fatal(format!("commit info is not valid: {e}")))?;
            flushes.extend(info.flushes);
            upserts.extend(info.upserts);
        }
        serde_json::to_vec(&Combined { flushes, upserts })
            .map_err(|e| error::fatal(format!("cannot encode the commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined = decode(&combined)?;
        self.check_mode(c, &combined)?;
        // Every dataset the job knows first, in name order (so two racing runs
        // meet on the same first one): nothing is flushed where another
        // incarnation holds the claim.
        let mut paths = self.known.borrow().clone();
        paths.extend(combined.flushes.iter().map(|f| f.stream.clone()));
        paths.extend(combined.upserts.iter().map(|u| u.stream.clone()));
        for path in &paths {
            self.claims.take(&self.cfg, &self.ctx, path)?;
        }
        for info in &combined.flushes {
            self.flush(c, info)?;
        }
        // Then the partitions the checkpoint touched, in order, each from
        // the staging table that now holds every committed row of it; but
        // first, every target must still be this incarnation's to overwrite
        // (no newer incarnation began to overwrite it), or nothing is copied.
        let replaced = replacements(&self.cfg, &combined)?;
        let mut by_target: std::collections::BTreeMap<&String, Vec<String>> = std::collections::BTreeMap::new();
        for (target, d) in &replaced {
            by_target.entry(target).or_default().push(d.clone());
        }
        let mut held = std::collections::BTreeMap::new();
        for target in by_target.keys() {
            let known = self.shared.state.borrow().staged.get(target.as_str()).copied().flatten();
            let generation = Marker::new(&self.cfg, &self.ctx, target).hold(known)?;
            self.shared.state.borrow_mut().staged.insert((*target).clone(), Some(generation));
            held.insert(*target, generation);
        }
        for (target, partitions) in &by_target {
            let marker = Marker::new(&self.cfg, &self.ctx, target);
            let mine = held.get(target).copied().unwrap_or_default();
            let stage = overwrite::staging_path(&self.ctx, target);
            let copied = partitions
                .iter()
                .try_for_each(|d| overwrite::replace_partition(&self.cfg, &self.ctx, c, target, &stage, d));
            // A newer incarnation that took the target over while these
            // copies ran deleted the staging table (the copies after it
            // failed with notFound); one it raced may have landed over its
            // partitions: either way this fails loudly, naming them.
            match marker.newer(mine) {
                Ok(Some((g, by))) => return Err(marker.overtaken_late(c, mine, g, &by, partitions)),
                Ok(None) => copied?,
                Err(e) => {
                    copied?;
                    return Err(e);
                }
            }
        }
        if self.cfg.mode == WriteMode::Append && !combined.flushes.is_empty() {
            self.shared.state.borrow_mut().appended = true;
        }
        // The changes were applied when the writers' appends were
        // acknowledged; the checkpoint only names them.
        if !combined.upserts.is_empty() {
            self.shared.state.borrow_mut().upserted = true;
        }
        Ok(CommitOutcome::Committed)
    }

    fn abort(&self, _c: u64, _combined: Vec<u8>) -> Result<(), SinkError> {
        // Unflushed rows never become visible; BUFFERED streams need no cleanup.
        Ok(())
    }
}

impl BigQueryCommitter {
    /// Refuses a checkpoint prepared in the other mode: in overwrite mode
    /// one whose rows were streamed into the target itself (an append
    /// checkpoint of this incarnation: copying over the partitions it
    /// touched would delete them), in append mode one whose rows sit in a
    /// staging table (flushing them there would never reach the target).
    fn check_mode(&self, c: u64, combined: &Combined) -> Result<(), SinkError> {
        if let Some(u) = combined.upserts.iter().find(|u| !self.cfg.upserts(&u.table)) {
            let target = self.cfg.table_path(&u.table)?;
            return Err(switched_from_upsert(&self.cfg, &format!("{target} (checkpoint {c})")));
        }
        if let Some(f) = combined.flushes.iter().find(|f| self.cfg.upserts(&f.table)) {
            let target = self.cfg.table_path(&f.table)?;
            let began = if f.stream.contains("/tables/_sluice_stage_") { "overwrite-partitions" } else { "append" };
            return Err(switched_to_upsert(began, &format!("{target} (checkpoint {c}, stream {})", f.stream)));
        }
        for f in &combined.flushes {
            let target = self.cfg.table_path(&f.table)?;
            let staged = f.stream.contains("/tables/_sluice_stage_");
            if self.cfg.overwrites(&f.table) && !staged {
                return Err(switched_to_overwrite(&format!("{target} (checkpoint {c}, stream {})", f.stream)));
            }
            if !self.cfg.overwrites(&f.table) && staged {
                return Err(error::config(format!(
                    "[sink.options] mode = \"append\": checkpoint {c} of this incarnation was prepared with mode = \
                     \"overwrite-partitions\" (its rows for table {target} are staged in stream {}), and appending \
                     would leave them in the staging table; nothing was flushed. Finish the incarnation with mode = \
                     \"overwrite-partitions\"",
                    f.stream
                )));
            }
        }
        Ok(())
    }
}

/// Makes the table of `source` take its rows; when its rows overwrite
/// partitions, first checks that the target is partitioned by a column
/// (before creating or changing anything). Its staging table is made by
/// [`stage`].
fn prepare(cfg: &Config, source: &Table) -> Result<(), SinkError> {
    if !cfg.overwrites(&source.name) {
        return tables::prepare(cfg, source);
    }
    let target = cfg.table_path(&source.name)?;
    Partitioning::read(cfg, &target)?;
    tables::prepare(cfg, source)
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
        .chain(combined.upserts.iter().map(|u| {
            let table = cfg.and_then(|cfg| cfg.table_path(&u.table).ok()).unwrap_or_else(|| format!("{:?}", u.table));
            format!(
                "table {table}: {} change(s) applied through {} (CDC, _CHANGE_SEQUENCE_NUMBER through {})",
                u.changes, u.stream, u.through
            )
        }))
        .chain(cfg.and_then(|cfg| replacements(cfg, &combined).ok()).into_iter().flatten().map(|(target, d)| {
            format!("table {target}: partition {d} replaced (WRITE_TRUNCATE) by the staged rows of the incarnation")
        }))
        .collect()
}
