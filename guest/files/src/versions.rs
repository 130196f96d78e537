//! `mode = "overwrite-partitions"`: each table is published through a
//! version log, `<T>/_sluice_log/` (`<T>`: the table's directory).
//!
//! - `<T>/_sluice_log/<version:020>.json` ([`Version`]), created
//!   **exclusively**, is the whole live table: for each partition its part
//!   list. The newest version is the table; nothing else is output.
//! - `<T>/_sluice_log/parts/….json` ([`PartList`]): the files of one
//!   partition as of one version, written before the version that names
//!   it, never changed once a version names it. A partition no commit
//!   touches keeps its list from version to version.
//! - `<T>/_sluice_log/_latest`: the newest version's number, a hint written
//!   after each commit; it may lag, never leads, and is never trusted alone
//!   (the version it names must exist, else the folder is listed; the next
//!   numbers are probed).
//!
//! Invariants:
//! - within one incarnation, the first checkpoint that touches a partition
//!   replaces it and later ones add to it: which partitions the incarnation
//!   replaced is the committer state ([`State`]), persisted by the host in
//!   every checkpoint record; the decision for checkpoint `c` ([`Plan`]) is
//!   taken by `combine(c)` and persisted with `c`, so a recovered commit
//!   makes the same decision;
//! - the state holds only what commits answered `committed` or
//!   `already-committed` (`replaced`); the history found by validation
//!   (`foreign`, `checked_through`) is fact about the log, kept whatever the
//!   commit's outcome;
//! - a version carries `committed`, the newest checkpoint of every
//!   incarnation that committed to the table (carried forward from its
//!   parent), so a repeated commit of `c` (a lost reply, a recovery) finds
//!   itself and adds nothing;
//! - before a version is created, every version since the incarnation's
//!   base (or since it was checked last) is validated: another writer's
//!   version that changed a partition this checkpoint touches is a `fatal`
//!   error naming the partition and the writer, never silently dropped or
//!   kept. Exactly the versions up to the parent are validated, and the
//!   new version can only be created as the parent's successor, so the
//!   check and the commit are one atomic step, as Iceberg's pinned head is;
//! - every table of a checkpoint is checked ([`check`]) before a version
//!   of any is created, so a conflict found then commits nothing of it; a
//!   conflict that appears between the check and a table's version leaves
//!   the tables before it committed, and the refusal says which (tables
//!   commit independently);
//! - every version records the table's partitioning ([`PartitionColumn`]s:
//!   `partition_by`'s columns and types); an open (or a table added by
//!   `evolve`) and a commit whose partitioning differs from the newest
//!   version's are refused (`config`), since the head's partitions would
//!   stay live beside the new ones;
//! - `already-exists` on the version means another writer took that number
//!   first: the log is read again, validated again, and the commit tried
//!   again; writers of disjoint partitions all land.
//!
//! Simpler than the design note's map in two places, on purpose:
//! - part-list names carry the version they were made for, the incarnation
//!   and the checkpoint, and their content follows from the parent version
//!   and the persisted plan alone, so a retry rewrites the same bytes under
//!   the same name; they need no exclusive create;
//! - old versions and replaced files are never deleted (no maintenance
//!   touches this layout), so nothing a version or a pending checkpoint
//!   names can disappear.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{IoError, SinkContext, SinkError, error, incarnation, log};

use crate::writer::StagedFile;
use crate::{Config, layout, partition};

/// [`Version::format`].
pub const FORMAT: &str = "sluice-files-log/1";
/// [`PartList::format`].
pub const PARTS_FORMAT: &str = "sluice-files-parts/1";
/// How often one commit call reads the log again after losing a version
/// number to another writer, before it answers `retryable` to the host.
const RACES: u32 = 16;

/// Who created a version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Writer {
    pub job: String,
    pub sink: String,
    pub incarnation: String,
    pub checkpoint: u64,
}

/// One live partition of a version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LivePartition {
    /// Its path, `col=value/…` (`""`: the unpartitioned table).
    pub partition: String,
    /// Its values by column, unescaped.
    pub values: BTreeMap<String, String>,
    /// Its part list, relative to the table's directory.
    pub list: String,
    pub files: u64,
    pub rows: u64,
}

/// `<T>/_sluice_log/<version:020>.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Version {
    /// [`FORMAT`].
    pub format: String,
    pub version: u64,
    pub parent: Option<u64>,
    pub writer: Writer,
    /// The partitions this version replaced or added to.
    pub changed: Vec<String>,
    /// Of those, the ones it replaced.
    pub replaced: Vec<String>,
    /// The live table, by partition path.
    pub partitions: Vec<LivePartition>,
    /// `job.sink.incarnation` → its newest checkpoint in this table.
    pub committed: BTreeMap<String, u64>,
    /// How the table is partitioned (`partition_by`'s columns and their
    /// types); every version carries it, and a commit or an open whose
    /// partitioning differs is refused. `None`: written before it was
    /// recorded, so not checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_by: Option<Vec<PartitionColumn>>,
}

/// One column of a table's `partition_by`, with its Arrow type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionColumn {
    pub column: String,
    #[serde(rename = "type")]
    pub data_type: String,
}

/// The partitioning of `table` under `cfg` (columns checked).
pub fn spec(cfg: &Config, table: &sluice_guest_sdk::Table) -> Result<Vec<PartitionColumn>, SinkError> {
    let schema = sluice_guest_sdk::ipc::decode_schema(&table.schema)?;
    let columns = cfg.partition_by_for(&table.name);
    let indices = partition::indices(&table.name, &schema, columns)?;
    Ok(indices
        .into_iter()
        .zip(columns)
        .map(|(i, column)| PartitionColumn {
            column: column.clone(),
            data_type: schema.field(i).data_type().to_string(),
        })
        .collect())
}

/// How a message shows a partitioning.
fn show_spec(spec: &[PartitionColumn]) -> String {
    if spec.is_empty() {
        return "nothing (unpartitioned)".to_string();
    }
    spec.iter().map(|c| format!("{} ({})", c.column, c.data_type)).collect::<Vec<_>>().join(", ")
}

/// Refuses (`config`) a partitioning `ours` that differs from the one the
/// newest version `head` of `label`'s log records: the head's partitions
/// stay live, so readers would read the old partitions beside the new.
fn refuse_other_partitioning(label: &str, head: &Version, ours: &[PartitionColumn]) -> Result<(), SinkError> {
    match &head.partition_by {
        Some(theirs) if theirs.as_slice() != ours => Err(error::config(format!(
            "[sink.options] partition_by: {label} is partitioned by {} (log version {}), and this job partitions \
             it by {}; an overwrite replaces only the partitions it touches, so the old partitions would stay live \
             beside the new ones and readers would read their rows twice. Keep partition_by as the table has it, \
             or write the new partitioning to a new path",
            show_spec(theirs),
            head.version,
            show_spec(ours)
        ))),
        _ => Ok(()),
    }
}

/// One file of a part list.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListedFile {
    /// Relative to the table's directory.
    pub path: String,
    pub rows: u64,
    pub bytes: u64,
}

/// `<T>/_sluice_log/parts/….json`: the files of one partition.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartList {
    /// [`PARTS_FORMAT`].
    pub format: String,
    pub partition: String,
    pub files: Vec<ListedFile>,
}

/// Another writer's change found in a partition since the incarnation's base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Foreign {
    pub partition: String,
    pub writer: String,
}

/// What the incarnation knows of one table's log.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableState {
    /// The newest version when the incarnation first saw the table (0: none).
    pub base: u64,
    /// Versions up to this one are validated (`None`: only to `base`).
    #[serde(default)]
    pub checked_through: Option<u64>,
    /// Partitions this incarnation replaced.
    #[serde(default)]
    pub replaced: BTreeSet<String>,
    /// Partitions other writers changed since `base`.
    #[serde(default)]
    pub foreign: Vec<Foreign>,
}

/// The committer state of an overwrite job, by table name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    #[serde(default)]
    pub tables: BTreeMap<String, TableState>,
}

/// What checkpoint `c` does to one table, decided by `combine(c)`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Partitions `c` replaces (touched first by this incarnation).
    pub replace: BTreeSet<String>,
    /// Every partition `c` adds files to.
    pub touched: BTreeSet<String>,
    /// The job's dead-letter table: only ever added to, so other writers'
    /// additions never conflict with it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub append_only: bool,
    /// The table's partitioning the checkpoint's files were written with
    /// (`None`: unknown to the committer, not checked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition_by: Option<Vec<PartitionColumn>>,
}

/// The plan of a checkpoint writing `files`, given `state`; `replaces`:
/// whether the table's partitions may be replaced at all.
pub fn plan(state: Option<&TableState>, files: &[StagedFile], replaces: bool) -> Plan {
    let touched: BTreeSet<String> = files.iter().map(|f| f.partition.clone()).collect();
    let replace =
        touched.iter().filter(|p| replaces && state.is_none_or(|s| !s.replaced.contains(*p))).cloned().collect();
    Plan { replace, touched, append_only: !replaces, partition_by: None }
}

thread_local! {
    /// The state of the committer opened in this instance (the host opens
    /// one committer per instance), for `committer-state`.
    static OPEN: RefCell<Option<(bool, Rc<RefCell<State>>)>> = const { RefCell::new(None) };
}

/// Makes `state` the one `committer-state` serves (`overwrite`: whether it
/// is kept at all).
pub fn open(overwrite: bool, state: Rc<RefCell<State>>) {
    OPEN.with(|open| *open.borrow_mut() = Some((overwrite, state)));
}

fn open_state() -> Result<(bool, Rc<RefCell<State>>), SinkError> {
    OPEN.with(|open| open.borrow().clone()).ok_or_else(|| error::fatal("committer-state called before committer.open"))
}

/// `committer-state.restore`: the state of the newest record of this
/// incarnation replaces what `open` saw (the bases it froze win).
pub fn restore_state(bytes: Option<Vec<u8>>) -> Result<(), SinkError> {
    let (overwrite, state) = open_state()?;
    let Some(bytes) = bytes.filter(|b| !b.is_empty() && overwrite) else { return Ok(()) };
    let restored: State = serde_json::from_slice(&bytes)
        .map_err(|e| error::fatal(format!("the restored committer state of the files sink is not valid: {e}")))?;
    state.borrow_mut().tables.extend(restored.tables);
    Ok(())
}

/// `committer-state.snapshot`: the overwrite state (nothing in append mode).
pub fn snapshot_state() -> Result<Vec<u8>, SinkError> {
    let (overwrite, state) = open_state()?;
    if !overwrite {
        return Ok(Vec::new());
    }
    serde_json::to_vec(&*state.borrow()).map_err(|e| error::fatal(format!("encoding the committer state: {e}")))
}

/// An I/O failure on the log: a missing grant is `config`; anything else
/// may be a lost reply (the write may have happened), so `retryable`: the
/// retry reads the log and settles it.
fn io_error(context: &str, e: IoError) -> SinkError {
    match e {
        IoError::Denied(_) => files::to_sink_error(context, e),
        e => error::retryable(format!("{context}: {}", files::describe(&e))),
    }
}

/// Reads and decodes the JSON file at `location`; `None` when it is missing.
fn read_json<T: DeserializeOwned>(location: &str) -> Result<Option<T>, SinkError> {
    let size = match files::stat(location) {
        Ok(status) => status.size,
        Err(IoError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(io_error(&format!("reading {location}"), e)),
    };
    let bytes = match files::read(location, 0, size) {
        Ok(bytes) => bytes,
        Err(IoError::NotFound(_)) => return Ok(None),
        Err(e) => return Err(io_error(&format!("reading {location}"), e)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| error::fatal(format!("{location} is not a valid files-sink log file: {e}")))
}

/// One table's log.
pub struct Log<'a> {
    pub cfg: &'a Config,
    pub table: &'a str,
}

impl Log<'_> {
    fn dir(&self) -> String {
        layout::log_dir(self.cfg, self.table)
    }

    fn label(&self) -> String {
        if self.table.is_empty() {
            format!("the output {}", self.cfg.path)
        } else {
            format!("table {} ({})", self.table, layout::table_path(self.cfg, self.table))
        }
    }

    pub fn version_location(&self, n: u64) -> String {
        join(&self.dir(), &format!("{n:020}.json"))
    }

    fn hint_location(&self) -> String {
        join(&self.dir(), "_latest")
    }

    /// Version `n`, `None` when it does not exist.
    fn read(&self, n: u64) -> Result<Option<Version>, SinkError> {
        let version: Option<Version> = read_json(&self.version_location(n))?;
        if let Some(v) = &version
            && (v.format != FORMAT || v.version != n)
        {
            return Err(error::fatal(format!(
                "{}: log version {n} has format {:?} and number {}; this build reads {FORMAT}",
                self.label(),
                v.format,
                v.version
            )));
        }
        Ok(version)
    }

    /// Where to start probing for the newest version: the hint when the
    /// version it names exists, or else the highest number the log folder
    /// lists (0: no version). A hint naming a missing version (written by
    /// hand, or left from a log replaced outside Sluice) is not trusted.
    fn start(&self) -> Result<u64, SinkError> {
        let hint = self.hint_location();
        match files::read(&hint, 0, 64) {
            Ok(bytes) => {
                if let Some(n) = std::str::from_utf8(&bytes).ok().and_then(|s| s.trim().parse::<u64>().ok()) {
                    let named = self.version_location(n);
                    match files::exists(&named) {
                        Ok(true) => return Ok(n),
                        Ok(false) => log::warn(&format!(
                            "{}: {hint} names version {n}, which does not exist; finding the newest version by \
                             listing {}",
                            self.label(),
                            self.dir()
                        )),
                        Err(e) => return Err(io_error(&format!("probing {named}"), e)),
                    }
                }
            }
            Err(IoError::NotFound(_)) => {}
            Err(e) => return Err(io_error(&format!("reading {hint}"), e)),
        }
        let names = match files::list_dir(&self.dir()) {
            Ok(names) => names,
            Err(IoError::NotFound(_)) => return Ok(0),
            Err(e) => return Err(io_error(&format!("listing {}", self.dir()), e)),
        };
        Ok(names
            .iter()
            .filter_map(|n| n.strip_suffix(".json"))
            .filter(|n| n.len() == 20)
            .filter_map(|n| n.parse::<u64>().ok())
            .max()
            .unwrap_or(0))
    }

    /// The newest version: from [`Log::start`], probed upward until the
    /// next number is missing. `None`: the table has no version yet.
    pub fn latest(&self) -> Result<Option<Version>, SinkError> {
        let mut n = self.start()?;
        loop {
            let next = self.version_location(n + 1);
            match files::exists(&next) {
                Ok(true) => n += 1,
                Ok(false) => break,
                Err(e) => return Err(io_error(&format!("probing {next}"), e)),
            }
        }
        if n == 0 {
            return Ok(None);
        }
        match self.read(n)? {
            Some(v) => Ok(Some(v)),
            None => Err(error::fatal(format!(
                "{}: log version {n} is gone ({}); versions are never deleted by Sluice, so the log was changed \
                 outside it",
                self.label(),
                self.version_location(n)
            ))),
        }
    }

    /// The part list `list` (relative to the table's directory) names.
    fn part_list(&self, list: &str) -> Result<PartList, SinkError> {
        let location = join(&layout::table_path(self.cfg, self.table), list);
        read_json(&location)?.ok_or_else(|| {
            error::fatal(format!("{}: part list {location}, which the newest version names, is missing", self.label()))
        })
    }

    /// Validates the versions after `state`'s checked point up to `head`
    /// for a checkpoint touching `touched`: records what other writers
    /// changed, moves `checked_through` to `head`, and refuses (`fatal`)
    /// when a touched partition was changed by another writer.
    fn validate(
        &self,
        ctx: &SinkContext,
        head: Option<&Version>,
        state: &mut TableState,
        touched: &BTreeSet<String>,
        done: &[String],
    ) -> Result<(), SinkError> {
        let from = state.checked_through.unwrap_or(state.base);
        let to = head.map_or(0, |h| h.version);
        if to < from {
            return Err(error::fatal(format!(
                "{}: the log's newest version is {to}, but this incarnation already saw version {from}; versions are \
                 never deleted by Sluice, so the log was changed outside it",
                self.label()
            )));
        }
        for n in from + 1..=to {
            let read;
            let version = match head {
                Some(h) if h.version == n => h,
                _ => {
                    read = self.read(n)?.ok_or_else(|| {
                        error::fatal(format!("{}: log version {n} is missing below version {to}", self.label()))
                    })?;
                    &read
                }
            };
            let w = &version.writer;
            if w.job == ctx.job_id && w.sink == ctx.sink_id && w.incarnation == ctx.incarnation {
                continue;
            }
            let writer = format!(
                "job {:?} sink {:?} incarnation {} checkpoint {} (log version {n})",
                w.job, w.sink, w.incarnation, w.checkpoint
            );
            for partition in &version.changed {
                if !state.foreign.iter().any(|f| &f.partition == partition) {
                    state.foreign.push(Foreign { partition: partition.clone(), writer: writer.clone() });
                }
            }
        }
        state.checked_through = Some(to);
        let conflicts: Vec<String> = state
            .foreign
            .iter()
            .filter(|f| touched.contains(&f.partition))
            .map(|f| format!("partition {} by {}", show(&f.partition), f.writer))
            .collect();
        if conflicts.is_empty() {
            return Ok(());
        }
        let committed = if done.is_empty() {
            "Nothing of this checkpoint was committed".to_string()
        } else {
            format!(
                "The tables of a checkpoint commit independently: its part in {} is committed, and nothing of it in \
                 this table",
                done.join(", ")
            )
        };
        Err(error::fatal(format!(
            "{}: another writer changed {} that this overwrite job (job {:?}, sink {:?}, incarnation {}) replaces \
             since it began: {}. {committed}, and the other writer's rows are kept. Wait for the other writer to \
             finish and rerun this backfill as a new incarnation (a fresh state directory and `--new-incarnation`), \
             or drop this pending checkpoint (`sluice state --drop-pending`)",
            self.label(),
            if conflicts.len() == 1 { "a partition" } else { "partitions" },
            ctx.job_id,
            ctx.sink_id,
            ctx.incarnation,
            conflicts.join("; ")
        )))
    }
}

/// How a message names a partition path.
pub fn show(partition: &str) -> String {
    if partition.is_empty() { "(the whole unpartitioned table)".to_string() } else { partition.to_string() }
}

/// Checks, before any table of checkpoint `c` is committed, that the
/// newest version of `table`'s log lets `plan` commit: the same
/// partitioning and no other writer's change to a partition it replaces
/// (what [`commit`] checks again as it creates the version). `done`: the
/// tables of `c` committed already, for the message.
pub fn check(
    cfg: &Config,
    ctx: &SinkContext,
    state: &RefCell<State>,
    table: &str,
    c: u64,
    plan: &Plan,
    done: &[String],
) -> Result<(), SinkError> {
    let log = Log { cfg, table };
    let head = log.latest()?;
    let key = incarnation::key(ctx);
    if head.as_ref().and_then(|h| h.committed.get(&key)).is_some_and(|&held| held >= c) {
        return Ok(());
    }
    if let (Some(h), Some(ours)) = (&head, &plan.partition_by) {
        refuse_other_partitioning(&log.label(), h, ours)?;
    }
    let mut state = state.borrow_mut();
    let base = head.as_ref().map_or(0, |h| h.version);
    let tstate = state.tables.entry(table.to_string()).or_insert_with(|| TableState { base, ..Default::default() });
    let guarded = if plan.append_only { BTreeSet::new() } else { plan.touched.clone() };
    log.validate(ctx, head.as_ref(), tstate, &guarded, done)
}

/// Commits checkpoint `c` of one table: `files` (named relative to the
/// table's directory, checked whole by the caller) under `plan`.
/// `Ok(false)`: the log already holds `c` of this incarnation. `done`: the
/// tables of `c` committed already, for a refusal's message.
#[allow(clippy::too_many_arguments)]
pub fn commit(
    cfg: &Config,
    ctx: &SinkContext,
    state: &RefCell<State>,
    table: &str,
    c: u64,
    plan: &Plan,
    files: &[StagedFile],
    done: &[String],
) -> Result<bool, SinkError> {
    let log = Log { cfg, table };
    let key = incarnation::key(ctx);
    let table_dir = layout::table_path(cfg, table);
    for _ in 0..RACES {
        let head = log.latest()?;
        if head.as_ref().and_then(|h| h.committed.get(&key)).is_some_and(|&done| done >= c) {
            fold(state, table, plan, None);
            return Ok(false);
        }
        if let (Some(h), Some(ours)) = (&head, &plan.partition_by) {
            refuse_other_partitioning(&log.label(), h, ours)?;
        }
        {
            let mut state = state.borrow_mut();
            let base = head.as_ref().map_or(0, |h| h.version);
            let tstate =
                state.tables.entry(table.to_string()).or_insert_with(|| TableState { base, ..Default::default() });
            let guarded = if plan.append_only { BTreeSet::new() } else { plan.touched.clone() };
            log.validate(ctx, head.as_ref(), tstate, &guarded, done)?;
        }
        let n = head.as_ref().map_or(0, |h| h.version) + 1;
        let mut live: BTreeMap<String, LivePartition> = head
            .as_ref()
            .map(|h| h.partitions.iter().map(|p| (p.partition.clone(), p.clone())).collect())
            .unwrap_or_default();
        for (i, partition) in plan.touched.iter().enumerate() {
            let mut listed = match live.get(partition) {
                Some(old) if !plan.replace.contains(partition) => log.part_list(&old.list)?.files,
                _ => Vec::new(),
            };
            listed.extend(files.iter().filter(|f| &f.partition == partition).map(|f| ListedFile {
                path: f.name.clone(),
                rows: f.rows,
                bytes: f.bytes.unwrap_or(0),
            }));
            // Named for the version it is made for, this incarnation and
            // `c`: a retry of the same step writes the same bytes here.
            let list = format!("{}/parts/{n:020}.{key}.c{c:010}.{i:06}.json", layout::LOG_DIR);
            let doc = PartList { format: PARTS_FORMAT.to_string(), partition: partition.clone(), files: listed };
            let bytes =
                serde_json::to_vec_pretty(&doc).map_err(|e| error::fatal(format!("encoding a part list: {e}")))?;
            let location = join(&table_dir, &list);
            files::write_file(&location, &bytes, true)
                .map_err(|e| io_error(&format!("checkpoint {c}: writing part list {location}"), e))?;
            let rows = doc.files.iter().map(|f| f.rows).sum();
            let count = doc.files.len() as u64;
            live.insert(
                partition.clone(),
                LivePartition {
                    partition: partition.clone(),
                    values: partition::values(partition),
                    list,
                    files: count,
                    rows,
                },
            );
        }
        let mut committed = head.as_ref().map(|h| h.committed.clone()).unwrap_or_default();
        committed.insert(key.clone(), c);
        let version = Version {
            format: FORMAT.to_string(),
            version: n,
            parent: head.as_ref().map(|h| h.version),
            writer: Writer {
                job: ctx.job_id.clone(),
                sink: ctx.sink_id.clone(),
                incarnation: ctx.incarnation.clone(),
                checkpoint: c,
            },
            changed: plan.touched.iter().cloned().collect(),
            replaced: plan.replace.iter().cloned().collect(),
            partitions: live.into_values().collect(),
            committed,
            partition_by: plan.partition_by.clone().or_else(|| head.as_ref().and_then(|h| h.partition_by.clone())),
        };
        let bytes =
            serde_json::to_vec_pretty(&version).map_err(|e| error::fatal(format!("encoding a version: {e}")))?;
        let location = log.version_location(n);
        match files::write_file(&location, &bytes, false) {
            Ok(()) => {
                let rows: u64 = files.iter().map(|f| f.rows).sum();
                log::info(&format!(
                    "checkpoint {c}: {}: version {n} replaces {} and adds to {} partition(s): {} file(s), {rows} row(s)",
                    log.label(),
                    plan.replace.len(),
                    plan.touched.len() - plan.replace.len(),
                    files.len()
                ));
                // Only a hint: a reader (and the next commit) probes past it.
                if let Err(e) = files::write_file(&log.hint_location(), n.to_string().as_bytes(), true) {
                    log::warn(&format!("could not update {}: {}", log.hint_location(), files::describe(&e)));
                }
                fold(state, table, plan, Some(n));
                return Ok(true);
            }
            Err(IoError::AlreadyExists(_)) => {
                log::info(&format!(
                    "checkpoint {c}: {}: another writer created log version {n} first; reading the log again",
                    log.label()
                ));
            }
            Err(e) => return Err(io_error(&format!("checkpoint {c}: creating log version {location}"), e)),
        }
    }
    Err(error::retryable(format!(
        "checkpoint {c}: {}: other writers created {RACES} log versions first in a row; trying again",
        log.label()
    )))
}

/// Folds a committed plan into `state`: its partitions are replaced, and
/// (`ours`) the version it created is validated history.
fn fold(state: &RefCell<State>, table: &str, plan: &Plan, ours: Option<u64>) {
    let mut state = state.borrow_mut();
    let tstate = state.tables.entry(table.to_string()).or_default();
    tstate.replaced.extend(plan.replace.iter().cloned());
    if let Some(n) = ours {
        tstate.checked_through = Some(n);
    }
}

/// The incarnations of this job and sink whose checkpoints the newest
/// version of `table`'s log holds.
pub fn incarnations(cfg: &Config, ctx: &SinkContext, table: &str) -> Result<Vec<String>, SinkError> {
    let prefix = format!("{}.{}.", ctx.job_id, ctx.sink_id);
    let latest = Log { cfg, table }.latest()?;
    Ok(latest
        .map(|v| v.committed.into_keys().filter_map(|k| k.strip_prefix(&prefix).map(str::to_string)).collect())
        .unwrap_or_default())
}

/// Notes each table's newest version as the incarnation's base (kept when
/// a restored state has one), and says when an earlier incarnation of this
/// job landed there: a rerun replaces the partitions it touches.
/// Refuses (`config`) a table whose newest version records another
/// partitioning than `specs` gives it.
pub fn see(
    cfg: &Config,
    ctx: &SinkContext,
    state: &RefCell<State>,
    specs: &BTreeMap<String, Vec<PartitionColumn>>,
) -> Result<(), SinkError> {
    let prefix = format!("{}.{}.", ctx.job_id, ctx.sink_id);
    for (table, spec) in specs {
        let log = Log { cfg, table };
        let latest = log.latest()?;
        if let Some(head) = &latest {
            refuse_other_partitioning(&log.label(), head, spec)?;
        }
        let base = latest.as_ref().map_or(0, |v| v.version);
        state.borrow_mut().tables.entry(table.clone()).or_insert_with(|| TableState { base, ..Default::default() });
        let others: Vec<&str> = latest
            .iter()
            .flat_map(|v| v.committed.keys())
            .filter_map(|k| k.strip_prefix(&prefix))
            .filter(|inc| *inc != ctx.incarnation)
            .collect();
        if !others.is_empty() {
            log::info(&format!(
                "incarnation {} replaces the partitions it touches in {}; incarnation(s) {} of job {:?} landed there \
                 before",
                ctx.incarnation,
                log.label(),
                others.join(", "),
                ctx.job_id
            ));
        }
    }
    Ok(())
}
