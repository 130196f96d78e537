//! The files sink's committer: per table per checkpoint, one atomic
//! directory rename (a local disk) or one exclusively created commit
//! marker (an object store), each only once this incarnation holds the
//! output's claim (`layout::claim`).
//!
//! Invariants:
//! - a table whose marker or directory exists already is left alone and not
//!   checked, so a re-commit answers `already-committed`;
//! - before any table of a checkpoint is published, every file it names in
//!   each table not visible yet is checked (one `stat` each: there, whole,
//!   the size its writer wrote where that was recorded); a missing one
//!   refuses the commit with a `fatal` error naming the files and the
//!   checkpoint, which stays pending, so no marker ever names a missing file
//!   and no directory is published without one of its files;
//! - `abort` deletes staged files only of a checkpoint the host knows was
//!   never persisted;
//! - in `mode = "overwrite-partitions"` a table is published by creating
//!   the next version of its log instead (see `versions`); a version that
//!   holds the checkpoint already is found through its `committed` map, and
//!   every file is checked the same way before any table is published;
//! - a checkpoint is published only in the mode it was prepared in: one
//!   with a table prepared in the other mode than the job's `mode` now is
//!   refused whole, and the layout check of `open` runs again right before
//!   publishing, so a table directory never gets both layouts.

use serde::{Deserialize, Serialize};
use sluice_guest_sdk::Committer;
use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{CommitOutcome, GuestCommitter, SinkContext, SinkError, Table, TableChange, error, log};

use std::cell::RefCell;
use std::rc::Rc;

use crate::versions::{self, Plan};
use crate::writer::{CommitInfo, StagedFile};
use crate::{Config, Publish, layout};

/// Everything needed to publish one checkpoint; persisted by the host.
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    staging_dir: String,
    /// One entry per table the checkpoint touched.
    #[serde(default)]
    tables: Vec<TableCommit>,
    /// A checkpoint prepared by the files sink for contract 0.1 (one table):
    /// its visible directory and files, staged right in `staging_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    visible_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    files: Vec<StagedFile>,
}

/// One table's part of a checkpoint: one rename, or one marker, makes it
/// visible.
#[derive(Debug, Serialize, Deserialize)]
struct TableCommit {
    table: String,
    /// Where the files are: staging (renamed from), or on an object store
    /// the folder of the data objects (where they stay).
    staging_dir: String,
    /// The directory the rename makes, or the commit marker's location.
    visible_dir: String,
    files: Vec<StagedFile>,
    /// Published by a commit marker (an object store), decided when the
    /// checkpoint was combined and persisted with it, so a recovery
    /// publishes the way the run that prepared it would have.
    #[serde(default, skip_serializing_if = "is_false")]
    marker: bool,
    /// Overwrite mode: published as the next version of the table's log
    /// (`staging_dir` is then the table's directory, which file names are
    /// relative to), and what the checkpoint replaces, decided by
    /// `combine` and persisted with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    log: Option<Plan>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The format name every commit marker carries.
pub const MARKER_FORMAT: &str = "sluice-files-commit/1";

/// A commit marker: the one object that makes checkpoint `checkpoint` of
/// `table` visible on an object store. Readers list the markers of a
/// table's folder (`<job>.<sink>.<incarnation>.c<10 digits>.json`) and read
/// exactly the data objects they name; nothing else counts.
#[derive(Debug, Serialize, Deserialize)]
pub struct Marker {
    /// [`MARKER_FORMAT`].
    pub format: String,
    pub job: String,
    pub sink: String,
    pub incarnation: String,
    pub checkpoint: u64,
    /// `""` for the single table.
    pub table: String,
    /// Rows over all files.
    pub rows: u64,
    pub files: Vec<MarkerFile>,
}

/// One data object a marker names.
#[derive(Debug, Serialize, Deserialize)]
pub struct MarkerFile {
    /// Its full location (`s3://bucket/.../part-0000-000000.parquet`).
    pub location: String,
    pub rows: u64,
    /// Its size in bytes, as the writer wrote it and the commit found it.
    pub bytes: u64,
}

pub struct FilesCommitter {
    cfg: Config,
    ctx: SinkContext,
    /// This committer has seen the output's claim held by its incarnation
    /// (claims are never moved, so once is enough).
    claimed: std::cell::Cell<bool>,
    /// The overwrite state (empty in append mode), shared with the
    /// `committer-state` export.
    state: Rc<RefCell<versions::State>>,
    /// Each table's partitioning, as of `open` or its last `evolve`
    /// (recorded in every version, see `versions`).
    specs: RefCell<std::collections::BTreeMap<String, Vec<versions::PartitionColumn>>>,
}

fn decode(combined: &[u8]) -> Result<Combined, SinkError> {
    serde_json::from_slice(combined).map_err(|e| error::fatal(format!("combined commit is not valid: {e}")))
}

/// One table's part of a checkpoint as `commit` sees it (the 0.1 form too).
struct Part<'a> {
    table: &'a str,
    staging_dir: &'a str,
    visible_dir: &'a str,
    files: &'a [StagedFile],
    marker: bool,
}

impl Part<'_> {
    /// How a message names the part's table.
    fn label(&self) -> String {
        if self.table.is_empty() { String::new() } else { format!("table {}: ", self.table) }
    }
}

impl FilesCommitter {
    /// Whether `part` of checkpoint `c` is visible already: its commit marker
    /// or its directory exists (an earlier attempt of this very commit, or a
    /// rerun), so nothing of it is to be checked or added.
    fn visible(&self, c: u64, part: &Part) -> Result<bool, SinkError> {
        let what = if part.marker { "checking the commit marker" } else { "checking the visible directory" };
        files::exists(part.visible_dir).map_err(|e| files::to_sink_error(&format!("checkpoint {c}: {what}"), e))
    }

    /// Every file `part` of checkpoint `c` names, as the marker names it,
    /// found by one `stat` each (one HEAD on an object store: a checkpoint
    /// names few files, while a listing of the folder would grow with
    /// everything written there). Adds to `problems` each file that is
    /// missing or not the size its writer wrote.
    fn check_files(&self, c: u64, part: &Part, problems: &mut Vec<String>) -> Result<Vec<MarkerFile>, SinkError> {
        let kind = if part.marker { "data object" } else { "staged file" };
        let mut named = Vec::with_capacity(part.files.len());
        for file in part.files {
            let location = join(part.staging_dir, &file.name);
            let status = match files::stat(&location) {
                Ok(status) => status,
                Err(sluice_guest_sdk::IoError::NotFound(_)) => {
                    problems.push(format!("{}{kind} {location} is missing", part.label()));
                    continue;
                }
                Err(e) => return Err(files::to_sink_error(&format!("checkpoint {c}: checking {kind} {location}"), e)),
            };
            if status.is_dir {
                problems.push(format!("{}{kind} {location} is a directory", part.label()));
                continue;
            }
            if let Some(wrote) = file.bytes
                && wrote != status.size
            {
                problems.push(format!(
                    "{}{kind} {location} holds {} bytes, and its writer wrote {wrote}",
                    part.label(),
                    status.size
                ));
                continue;
            }
            named.push(MarkerFile { location, rows: file.rows, bytes: status.size });
        }
        Ok(named)
    }

    /// Makes `part` of checkpoint `c` visible on an object store by creating
    /// its commit marker exclusively, naming `named` (every data object of
    /// it, checked whole). `Ok(false)`: an earlier attempt of this very
    /// commit created the marker first, so nothing is added.
    fn publish_marker(&self, c: u64, part: &Part, named: Vec<MarkerFile>) -> Result<bool, SinkError> {
        let marker = part.visible_dir;
        let rows: u64 = part.files.iter().map(|f| f.rows).sum();
        let doc = Marker {
            format: MARKER_FORMAT.to_string(),
            job: self.ctx.job_id.clone(),
            sink: self.ctx.sink_id.clone(),
            incarnation: self.ctx.incarnation.clone(),
            checkpoint: c,
            table: part.table.to_string(),
            rows,
            files: named,
        };
        let bytes = serde_json::to_vec_pretty(&doc).map_err(|e| error::fatal(format!("encoding the marker: {e}")))?;
        match files::write_file(marker, &bytes, false) {
            Ok(()) => {
                log::info(&format!(
                    "checkpoint {c}: published {} file(s), {rows} row(s) by {marker}",
                    part.files.len()
                ));
                Ok(true)
            }
            // An earlier attempt of this very commit got there first.
            Err(sluice_guest_sdk::IoError::AlreadyExists(_)) => Ok(false),
            Err(e) => Err(files::to_sink_error(&format!("checkpoint {c}: creating the commit marker"), e)),
        }
    }

    /// Makes `part` of checkpoint `c` (its files checked) visible with one
    /// rename of its staged directory. `Ok(false)`: an earlier attempt of
    /// this very commit renamed it first.
    fn publish(&self, c: u64, part: &Part) -> Result<bool, SinkError> {
        let io = |what: &str, e| files::to_sink_error(&format!("checkpoint {c}: {what}"), e);
        let visible = part.visible_dir;
        if let Some((parent, _)) = visible.rsplit_once('/') {
            files::create_dir_all(parent).map_err(|e| io("creating the table directory", e))?;
        }
        match files::rename(part.staging_dir, visible) {
            Ok(()) => {
                let rows: u64 = part.files.iter().map(|f| f.rows).sum();
                log::info(&format!(
                    "checkpoint {c}: published {} file(s), {rows} row(s) in {visible}",
                    part.files.len()
                ));
                Ok(true)
            }
            // Someone (an earlier attempt of this very commit) got there first.
            Err(sluice_guest_sdk::IoError::AlreadyExists(_)) => Ok(false),
            Err(e) => Err(io("publishing", e)),
        }
    }
}

impl GuestCommitter for FilesCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, tables: Vec<Table>) -> Result<Committer, SinkError> {
        let cfg = Config::parse(options)?;
        let names: Vec<String> = tables.iter().map(|t| t.name.clone()).collect();
        for name in &names {
            layout::check_table_name(name)?;
        }
        layout::refuse_mixed_layouts(&cfg, &names)?;
        layout::refuse_other_incarnations(&cfg, &ctx, &names)?;
        layout::refuse_if_claimed(&cfg, &ctx)?;
        files::create_dir_all(&cfg.path)
            .map_err(|e| files::to_sink_error(&format!("creating output directory {}", cfg.path), e))?;
        let state = Rc::new(RefCell::new(versions::State::default()));
        let specs =
            tables.iter().map(|t| Ok((t.name.clone(), versions::spec(&cfg, t)?))).collect::<Result<_, SinkError>>()?;
        if cfg.overwrite {
            versions::see(&cfg, &ctx, &state, &specs)?;
        }
        versions::open(cfg.overwrite, state.clone());
        let specs = RefCell::new(specs);
        Ok(Committer::new(FilesCommitter { cfg, ctx, claimed: std::cell::Cell::new(false), state, specs }))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        // Each checkpoint's files carry their own schema: a new table or an
        // evolved one needs nothing in the output before its rows come.
        for change in &changes {
            crate::writer::table_writer(&self.cfg, &change.table)?;
        }
        let added: Vec<String> = changes.iter().map(|c| c.table.name.clone()).collect();
        layout::refuse_mixed_layouts(&self.cfg, &added)?;
        let specs = changes
            .iter()
            .map(|c| Ok((c.table.name.clone(), versions::spec(&self.cfg, &c.table)?)))
            .collect::<Result<std::collections::BTreeMap<_, _>, SinkError>>()?;
        // A table added mid-run gets its base (and its partitioning checked)
        // now, as those of `open` did; a known table keeps its base.
        if self.cfg.overwrite {
            versions::see(&self.cfg, &self.ctx, &self.state, &specs)?;
        }
        self.specs.borrow_mut().extend(specs);
        Ok(())
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut staging_dir: Option<String> = None;
        let mut tables: Vec<TableCommit> = Vec::new();
        for bytes in infos {
            let info: CommitInfo = serde_json::from_slice(&bytes)
                .map_err(|e| error::fatal(format!("commit info of checkpoint {c} is not valid: {e}")))?;
            match &staging_dir {
                Some(dir) if dir != &info.dir => {
                    return Err(error::fatal(format!(
                        "writers of checkpoint {c} staged into different directories: {dir} and {}",
                        info.dir
                    )));
                }
                _ => staging_dir = Some(info.dir.clone()),
            }
            for part in info.tables {
                match tables.iter_mut().find(|t| t.table == part.table) {
                    Some(t) => t.files.extend(part.files),
                    None if self.cfg.overwrite => tables.push(TableCommit {
                        staging_dir: layout::table_path(&self.cfg, &part.table),
                        visible_dir: layout::log_dir(&self.cfg, &part.table),
                        table: part.table,
                        files: part.files,
                        marker: false,
                        log: Some(Plan::default()),
                    }),
                    None => {
                        let marker = self.cfg.publish != Publish::Rename;
                        let (staging_dir, visible_dir) = if marker {
                            (
                                layout::data_dir(&info.dir, &part.table),
                                layout::marker(&self.cfg, &self.ctx, &part.table, c),
                            )
                        } else {
                            (
                                layout::table_staging_dir(&info.dir, &part.table),
                                layout::visible_dir(&self.cfg, &self.ctx, &part.table, c),
                            )
                        };
                        tables.push(TableCommit {
                            staging_dir,
                            visible_dir,
                            table: part.table,
                            files: part.files,
                            marker,
                            log: None,
                        })
                    }
                }
            }
        }
        let staging_dir = staging_dir.ok_or_else(|| error::fatal(format!("checkpoint {c} has no commit infos")))?;
        // Every earlier checkpoint of the incarnation is committed (or the
        // run failed) when `combine(c)` runs, so the state is final for it.
        let state = self.state.borrow();
        for table in tables.iter_mut() {
            if let Some(plan) = table.log.as_mut() {
                *plan = versions::plan(state.tables.get(&table.table), &table.files, self.cfg.replaces(&table.table));
                plan.partition_by = self.specs.borrow().get(&table.table).cloned();
            }
        }
        drop(state);
        let combined = Combined { staging_dir, tables, visible_dir: None, files: Vec::new() };
        serde_json::to_vec(&combined).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined = decode(&combined)?;
        self.refuse_other_mode(c, &combined)?;
        // Nothing is published under another incarnation's claim.
        if !self.claimed.get() {
            layout::claim(&self.cfg, &self.ctx)?;
            self.claimed.set(true);
        }
        let mut parts: Vec<Part> = Vec::with_capacity(combined.tables.len() + 1);
        if let Some(visible) = &combined.visible_dir {
            parts.push(Part {
                table: "",
                staging_dir: &combined.staging_dir,
                visible_dir: visible,
                files: &combined.files,
                marker: false,
            });
        }
        parts.extend(combined.tables.iter().filter(|t| t.log.is_none()).map(|t| Part {
            table: &t.table,
            staging_dir: &t.staging_dir,
            visible_dir: &t.visible_dir,
            files: &t.files,
            marker: t.marker,
        }));
        // A table visible already is left alone, unchecked (its files may
        // have moved on since); every other table's files are checked before
        // any table is published, so a missing file leaves the checkpoint
        // whole where it is not visible yet.
        let mut todo = Vec::with_capacity(parts.len());
        let mut problems = Vec::new();
        for part in parts {
            if self.visible(c, &part)? {
                continue;
            }
            let named = self.check_files(c, &part, &mut problems)?;
            todo.push((part, named));
        }
        let mut logged = Vec::new();
        // Tables of `c` whose log holds it (an earlier attempt of this
        // commit), then each table committed here: for a refusal's message.
        let mut done: Vec<String> = Vec::new();
        for t in combined.tables.iter() {
            let Some(plan) = &t.log else { continue };
            if self.log_holds(c, &t.table)? {
                versions::commit(&self.cfg, &self.ctx, &self.state, &t.table, c, plan, &t.files, &done)?;
                done.push(show_table(&t.table));
                continue;
            }
            let part = Part {
                table: &t.table,
                staging_dir: &t.staging_dir,
                visible_dir: &t.visible_dir,
                files: &t.files,
                marker: true,
            };
            self.check_files(c, &part, &mut problems)?;
            logged.push((t, plan));
        }
        if !problems.is_empty() {
            let consequence = if !logged.is_empty() {
                "create a log version naming files that no reader can read"
            } else if todo.iter().any(|(p, _)| p.marker) {
                "publish a commit marker naming files that no reader can read"
            } else {
                "publish the checkpoint without those files' rows"
            };
            return Err(files::refuse_missing(c, consequence, &problems));
        }
        // The layout check of `open`, again right before publishing: a
        // table may have gained the other layout since (another job).
        let publishing: Vec<String> =
            todo.iter().map(|(p, _)| p.table.to_string()).chain(logged.iter().map(|(t, _)| t.table.clone())).collect();
        layout::refuse_mixed_layouts(&self.cfg, &publishing)?;
        // Every logged table is checked before any version is created, so a
        // conflict in one table commits nothing of the checkpoint (unless
        // another writer changes a partition between the check and the
        // version, which `versions::commit` finds and names).
        for (t, plan) in &logged {
            versions::check(&self.cfg, &self.ctx, &self.state, &t.table, c, plan, &done)?;
        }
        let mut published = false;
        for (part, named) in todo {
            published |= if part.marker { self.publish_marker(c, &part, named)? } else { self.publish(c, &part)? };
        }
        for (t, plan) in logged {
            published |= versions::commit(&self.cfg, &self.ctx, &self.state, &t.table, c, plan, &t.files, &done)?;
            done.push(show_table(&t.table));
        }
        Ok(if published { CommitOutcome::Committed } else { CommitOutcome::AlreadyCommitted })
    }

    /// Deletes what checkpoint `c` staged (the staging directory, or the
    /// data objects of tables with no marker). Precondition, which the host
    /// guarantees: the checkpoint's record is definitely not persisted (its
    /// write was answered "not done"), so no run can ever commit it; never
    /// called when the persist's outcome is unknown, since a recovery would
    /// then commit it and find its files gone.
    fn abort(&self, c: u64, combined: Vec<u8>) -> Result<(), SinkError> {
        let combined = decode(&combined)?;
        if combined.tables.iter().any(|t| t.log.is_some()) {
            return self.abort_logged(c, &combined);
        }
        if combined.tables.iter().any(|t| t.marker) {
            return self.abort_markers(c, &combined);
        }
        match files::delete(&combined.staging_dir) {
            Ok(()) => Ok(()),
            Err(sluice_guest_sdk::IoError::NotFound(_)) => Ok(()),
            Err(e) => Err(files::to_sink_error("removing aborted checkpoint", e)),
        }
    }
}

impl FilesCommitter {
    /// Refuses (`config`) checkpoint `c` when a table of it was prepared in
    /// the other mode than the job's `mode` now (the mode changed while it
    /// was pending): publishing it would put both layouts in one table
    /// directory. Nothing is published; with the mode it was prepared in,
    /// the checkpoint commits as it would have.
    fn refuse_other_mode(&self, c: u64, combined: &Combined) -> Result<(), SinkError> {
        let mode = |overwrite: bool| if overwrite { "overwrite-partitions" } else { "append" };
        let legacy = combined.visible_dir.as_ref().map(|_| ("(the single table)".to_string(), false));
        let tables = combined.tables.iter().map(|t| {
            let name = if t.table.is_empty() { "(the single table)".to_string() } else { t.table.clone() };
            (name, t.log.is_some())
        });
        let other: Vec<String> =
            tables.chain(legacy).filter(|(_, logged)| *logged != self.cfg.overwrite).map(|(name, _)| name).collect();
        if other.is_empty() {
            return Ok(());
        }
        Err(error::config(format!(
            "[sink.options] mode = {:?}, but pending checkpoint {c} was prepared with mode = {:?} for table(s) {}; \
             publishing it would mix both layouts in one table directory, so nothing of it was published. Set mode \
             back to {:?} until the pending checkpoint is committed (run the job once more), or drop it (`sluice \
             state --drop-pending`)",
            mode(self.cfg.overwrite),
            mode(!self.cfg.overwrite),
            other.join(", "),
            mode(!self.cfg.overwrite)
        )))
    }

    /// Whether the newest version of `table`'s log holds checkpoint `c` of
    /// this incarnation already (then its files are not checked again:
    /// they may have moved on since, as a visible directory's may).
    fn log_holds(&self, c: u64, table: &str) -> Result<bool, SinkError> {
        let latest = versions::Log { cfg: &self.cfg, table }.latest()?;
        let key = sluice_guest_sdk::incarnation::key(&self.ctx);
        Ok(latest.and_then(|v| v.committed.get(&key).copied()).is_some_and(|done| done >= c))
    }

    /// Removes the data files of an overwrite checkpoint that was never
    /// persisted (the precondition of `abort`): no version can name them,
    /// since only a persisted checkpoint is ever committed.
    fn abort_logged(&self, c: u64, combined: &Combined) -> Result<(), SinkError> {
        for table in combined.tables.iter().filter(|t| t.log.is_some()) {
            for file in &table.files {
                let location = join(&table.staging_dir, &file.name);
                match files::delete(&location) {
                    Ok(()) | Err(sluice_guest_sdk::IoError::NotFound(_)) => {}
                    Err(e) => {
                        return Err(files::to_sink_error(&format!("aborting checkpoint {c}: removing {location}"), e));
                    }
                }
            }
        }
        Ok(())
    }

    /// Removes the data objects of a checkpoint that was never persisted
    /// (the precondition of `abort`); a table whose marker exists is
    /// committed, and keeps them.
    fn abort_markers(&self, c: u64, combined: &Combined) -> Result<(), SinkError> {
        let io = |what: &str, e| files::to_sink_error(&format!("aborting checkpoint {c}: {what}"), e);
        for table in combined.tables.iter().filter(|t| t.marker) {
            if files::exists(&table.visible_dir).map_err(|e| io("checking the commit marker", e))? {
                continue;
            }
            for file in &table.files {
                let location = join(&table.staging_dir, &file.name);
                match files::delete(&location) {
                    Ok(()) | Err(sluice_guest_sdk::IoError::NotFound(_)) => {}
                    Err(e) => return Err(io(&format!("removing {location}"), e)),
                }
            }
        }
        Ok(())
    }
}

/// How a message names a table (`""`: the single table).
fn show_table(table: &str) -> String {
    if table.is_empty() { "the single table".to_string() } else { format!("table {table}") }
}

/// What a combined commit will make visible, one line per table.
pub fn describe(combined: &[u8]) -> Vec<String> {
    let Ok(combined) = decode(combined) else { return vec!["(not a files-sink commit)".to_string()] };
    let line = |table: &str, files: &[StagedFile], visible: &str| {
        let rows: u64 = files.iter().map(|f| f.rows).sum();
        let name = if table.is_empty() { String::new() } else { format!("table {table}: ") };
        format!("{name}{} file(s), {rows} rows -> {visible}", files.len())
    };
    let mut lines: Vec<String> = combined
        .tables
        .iter()
        .map(|t| match &t.log {
            Some(plan) => {
                let names = |set: &std::collections::BTreeSet<String>| {
                    set.iter().map(|p| versions::show(p)).collect::<Vec<_>>().join(", ")
                };
                let added: std::collections::BTreeSet<String> =
                    plan.touched.difference(&plan.replace).cloned().collect();
                format!(
                    "{} (next log version; replaces [{}], adds to [{}])",
                    line(&t.table, &t.files, &t.visible_dir),
                    names(&plan.replace),
                    names(&added)
                )
            }
            None => line(&t.table, &t.files, &t.visible_dir),
        })
        .collect();
    if let Some(visible) = &combined.visible_dir {
        lines.push(line("", &combined.files, visible));
    }
    lines
}
