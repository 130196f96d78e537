//! `mode = "overwrite-partitions"` (dynamic: no filter): the rows a run of
//! the job lands replace every partition they touch.
//!
//! Invariants:
//! - within one incarnation, the first checkpoint that touches a partition
//!   replaces it and later ones add to it; which partitions are replaced is
//!   the committer state ([`State`]), persisted by the host in every
//!   checkpoint record, and the decision for checkpoint `c` ([`Plan`]) is
//!   taken by `combine(c)` and persisted with `c`, so a recovered commit
//!   makes the same decision;
//! - the state holds only what commits answered `committed` or
//!   `already-committed` ([`State::fold`]), and the newest checkpoint
//!   folded per table; a table whose watermark is past that holds
//!   checkpoints of this incarnation that no commit answer folded (a pending
//!   checkpoint committed to this table, not to another, then dropped by the
//!   operator: the host never folds a dropped checkpoint in). Before
//!   `combine` plans a table (and before `finish`), [`catch_up`] folds in
//!   the partitions those checkpoints' snapshots added to, read from the
//!   table's history, or refuses when that history has expired; the plan,
//!   made after, is persisted with the checkpoint, so a retried or
//!   recovered commit makes the same decision. The history found by validation
//!   (`foreign`, `checked_through`) is fact about the table and is kept
//!   whatever the commit's outcome;
//! - before every commit attempt the history of the table from the
//!   incarnation's base (or from where it was checked last) to exactly the
//!   head the commit pins is validated as Java's `validateAddedDataFiles`,
//!   `validateDeletedDataFiles` and `validateNoNewDeleteFiles` do: data
//!   added by another writer's `append` or `overwrite` snapshot, data files
//!   it removed or delete files it added in a `delete` or `overwrite`
//!   snapshot, in a partition the checkpoint touches, is a `fatal` error
//!   naming the table, the partition and the writer's snapshot, never
//!   silently dropped or kept (a `replace`, a compaction, keeps every row and
//!   is never a conflict); a history that does not reach back to the base
//!   (expired) is refused the same way;
//! - a partition is `(spec id, the partition's values rendered by their
//!   transforms)`: an unpartitioned table is one partition, so the first
//!   checkpoint of an incarnation replaces the whole table;
//! - so partitions of two specs are never compared: a table holding live
//!   files under a spec other than its default one (after partition-spec
//!   evolution), or a checkpoint written under a spec that is no longer the
//!   default, is refused with a `config` error when the committer opens and
//!   at every commit ([`check_one_spec`]), since the older files of a
//!   replaced day would survive it and another writer's files under the
//!   other spec could not be checked. A filter places each file by its own
//!   spec, so it is not refused there.
//!
//! With `overwrite_filter` (explicit scope) instead:
//! - the incarnation's first commit to a table (its first checkpoint with
//!   rows, or the end of an entirely empty input when
//!   `allow_empty_overwrite` lets it) removes every live data and delete
//!   file whose partition lies wholly inside the filter, in the same one
//!   snapshot that adds its files; later ones add. Whether that first
//!   commit landed is [`TableState::filter_replaced`], folded in like a
//!   replaced partition, so a resume never replaces again;
//! - a live file whose partition straddles the filter (or cannot be placed,
//!   being of a spec the filter's columns do not partition) is refused with
//!   a `config` error before anything is committed: whole files are
//!   replaced, never rows inside them ([`scan_filter`]);
//! - validation uses the filter as the conflict detection filter, as Java's
//!   `BaseOverwriteFiles` does: another writer's data in any partition the
//!   filter may match conflicts;
//! - one incarnation keeps one scope: a resume with another filter, or
//!   switching between a filter and none, is refused ([`check_scope`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use iceberg::spec::{
    DataContentType, DataFile, ManifestContentType, ManifestFile, ManifestStatus, Operation, Snapshot, Struct,
};
use iceberg::table::Table;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{SinkContext, SinkError, error, log};

use crate::filter::{BoundFilter, FilterError, OverwriteFilter, PartitionFilter, Placement};
use crate::runtime::block_on;
use crate::snapshot::LoadedManifest;
use crate::writer::iceberg_error;
use crate::{SUMMARY_CHECKPOINT, SUMMARY_INCARNATION, SUMMARY_JOB, SUMMARY_SINK};

/// Summary key Java's `BaseReplacePartitions` sets (`SnapshotSummary.REPLACE_PARTITIONS_PROP`).
pub(crate) const REPLACE_PARTITIONS: &str = "replace-partitions";

/// One partition of a table: the partition spec and each partition field
/// as `name=value` (the value as its transform renders it, e.g.
/// `day=2024-01-05`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub(crate) struct PartKey {
    pub(crate) spec: i32,
    pub(crate) fields: Vec<String>,
}

impl fmt::Display for PartKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.fields.is_empty() {
            write!(f, "the whole (unpartitioned) table")
        } else {
            write!(f, "{}", self.fields.join("/"))
        }
    }
}

/// The partition of `file` (written for spec `spec_id`) in `table`.
pub(crate) fn part_key(table: &Table, spec_id: i32, partition: &Struct) -> Result<PartKey, SinkError> {
    let metadata = table.metadata();
    let spec = metadata.partition_spec_by_id(spec_id).ok_or_else(|| {
        error::fatal(format!("table {} has no partition spec {spec_id}, which a data file names", table.identifier()))
    })?;
    let types = spec
        .partition_type(metadata.current_schema())
        .map_err(|e| iceberg_error(&format!("reading partition spec {spec_id} of table {}", table.identifier()), e))?;
    let fields = spec
        .fields()
        .iter()
        .zip(types.fields())
        .enumerate()
        .map(|(i, (field, ty))| {
            let value = partition.fields().get(i).and_then(Option::as_ref);
            format!("{}={}", field.name, field.transform.to_human_string(&ty.field_type, value))
        })
        .collect();
    Ok(PartKey { spec: spec_id, fields })
}

/// The partitions `files` (of spec `spec_id`) fall in.
pub(crate) fn touched(table: &Table, spec_id: i32, files: &[DataFile]) -> Result<BTreeSet<PartKey>, SinkError> {
    files.iter().map(|f| part_key(table, spec_id, f.partition())).collect()
}

/// What another writer did to a partition.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Change {
    /// Added data files (an `append` or `overwrite` snapshot).
    #[default]
    AddedRows,
    /// Removed data files (a `delete` or `overwrite` snapshot).
    RemovedFiles,
    /// Added position or equality delete files (a `delete` or `overwrite`
    /// snapshot).
    AddedDeletes,
}

impl Change {
    fn describe(self) -> &'static str {
        match self {
            Change::AddedRows => "added rows to",
            Change::RemovedFiles => "deleted data files of",
            Change::AddedDeletes => "deleted rows (added delete files) in",
        }
    }
}

fn is_added_rows(c: &Change) -> bool {
    *c == Change::AddedRows
}

/// Another writer's change found in a partition since the incarnation's base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Foreign {
    pub(crate) partition: PartKey,
    /// Who changed it, as its snapshot's summary tells.
    pub(crate) writer: String,
    /// What they did (absent: added rows, as states before deletes were
    /// checked hold).
    #[serde(default, skip_serializing_if = "is_added_rows")]
    pub(crate) change: Change,
    /// With `overwrite_filter`: the partition may hold rows the filter
    /// matches (its inclusive projection is true).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) in_filter: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// What the incarnation knows of one table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TableState {
    /// The table's current snapshot when the incarnation first saw it
    /// (`None`: it had none); frozen in the first record.
    pub(crate) base: Option<i64>,
    /// The history up to this snapshot is validated (`None`: only to `base`).
    #[serde(default)]
    pub(crate) checked_through: Option<i64>,
    /// The partitions this incarnation has replaced.
    #[serde(default)]
    pub(crate) replaced: BTreeSet<PartKey>,
    /// Partitions other writers added data to, or deleted data from, since `base`.
    #[serde(default)]
    pub(crate) foreign: Vec<Foreign>,
    /// With `overwrite_filter`: the filter's rows were replaced (the
    /// incarnation's first commit to the table landed).
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) filter_replaced: bool,
    /// The filter they were replaced with, as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) filter: Option<String>,
    /// The newest checkpoint of this incarnation whose commit to the table
    /// is folded in (`None`: none, or a state from before this was kept).
    /// A watermark past it names checkpoints committed here that the state
    /// lacks: one the operator dropped after it was committed to this
    /// table and not to another ([`catch_up`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) folded: Option<u64>,
}

/// The committer state of an overwrite job, per table ident (`ns.name`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    #[serde(default)]
    pub(crate) tables: BTreeMap<String, TableState>,
    /// `Some("upsert")` in a record of an incarnation in `mode = "upsert"`
    /// (which keeps no other state), so a resume in another mode is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) mode: Option<String>,
    /// Tables where `committer.open` found checkpoints of this very
    /// incarnation (its watermark): never persisted, only to refuse an
    /// overwrite that restores no state after them (see `restore_state`).
    #[serde(skip)]
    pub(crate) committed_before: Vec<String>,
}

impl State {
    /// Notes `head` as the base of table `ident` unless the incarnation has one.
    pub(crate) fn see(&mut self, ident: &str, head: Option<i64>) {
        self.tables.entry(ident.to_string()).or_insert_with(|| TableState { base: head, ..TableState::default() });
    }

    /// Folds the committed plan of checkpoint `c` in: its partitions are
    /// replaced (and, for the filter's first commit, the filter's rows).
    pub(crate) fn fold(&mut self, ident: &str, c: u64, plan: &Plan) {
        if let Some(t) = self.tables.get_mut(ident) {
            t.folded = t.folded.max(Some(c));
            t.replaced.extend(plan.replace.iter().cloned());
            if plan.filter_first {
                t.filter_replaced = true;
                t.filter.clone_from(&plan.filter);
            }
        }
    }

    /// Whether the input has landed anything in any table yet (filter
    /// replaced, or a partition replaced).
    pub(crate) fn landed_any(&self) -> bool {
        self.tables.values().any(|t| t.filter_replaced || !t.replaced.is_empty())
    }
}

/// What checkpoint `c` does to one table, decided by `combine(c)`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Plan {
    /// Partitions `c` replaces (touched first by this incarnation).
    #[serde(default)]
    pub(crate) replace: BTreeSet<PartKey>,
    /// Every partition `c` adds files to.
    #[serde(default)]
    pub(crate) touched: BTreeSet<PartKey>,
    /// With `overwrite_filter`: the filter as written (its presence is the
    /// filter mode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) filter: Option<String>,
    /// With `overwrite_filter`: `c` is the incarnation's first commit to
    /// the table, which removes every live file inside the filter.
    #[serde(default, skip_serializing_if = "is_false")]
    pub(crate) filter_first: bool,
}

/// The plan of a checkpoint touching `touched`, given `state`.
pub(crate) fn plan(state: Option<&TableState>, touched: BTreeSet<PartKey>) -> Plan {
    let replace =
        touched.iter().filter(|p| state.is_none_or(|s| !s.replaced.contains(*p))).cloned().collect::<BTreeSet<_>>();
    Plan { replace, touched, ..Plan::default() }
}

/// The plan of a checkpoint of a filter overwrite touching `touched`.
pub(crate) fn filter_plan(state: Option<&TableState>, filter: &OverwriteFilter, touched: BTreeSet<PartKey>) -> Plan {
    Plan {
        replace: BTreeSet::new(),
        touched,
        filter: Some(filter.source().to_string()),
        filter_first: state.is_none_or(|s| !s.filter_replaced),
    }
}

/// Refuses a checkpoint of table `ident` whose scope (`filter`, as the job
/// file has it now) is not the one this incarnation has replaced with: a
/// resume may not switch between dynamic partitions and a filter, nor to
/// another filter, since the rows replaced so far would no longer be the
/// ones the job describes.
pub(crate) fn check_scope(ident: &str, state: Option<&TableState>, filter: Option<&str>) -> Result<(), SinkError> {
    let Some(state) = state else { return Ok(()) };
    let before = if state.filter_replaced {
        Some(state.filter.as_deref().unwrap_or("?"))
    } else if !state.replaced.is_empty() {
        None
    } else {
        // Nothing replaced yet: any scope is still the first.
        return Ok(());
    };
    if before == filter {
        return Ok(());
    }
    let shown = |f: Option<&str>| {
        f.map_or_else(|| "no overwrite_filter (dynamic partitions)".to_string(), |f| format!("overwrite_filter `{f}`"))
    };
    Err(error::config(format!(
        "table {ident}: this incarnation already replaced rows with {}, and the job now has {}; finish the run with \
         the option as it was, or land the backfill again as a new incarnation (a fresh job.state_dir and \
         --new-incarnation). Nothing was committed",
        shown(before),
        shown(filter)
    )))
}

/// `filter` bound to `table`'s current schema, refused (`config`) when it
/// names a column that no partition field of the table's default spec is
/// derived from.
pub(crate) fn bind_filter(filter: &OverwriteFilter, table: &Table) -> Result<BoundFilter, SinkError> {
    let ident = table.identifier().to_string();
    let metadata = table.metadata();
    let bound = filter.bind(metadata.current_schema(), &ident).map_err(FilterError::into_sink_error)?;
    bound.check_partitioned_by(metadata.default_partition_spec()).map_err(FilterError::into_sink_error)?;
    Ok(bound)
}

/// The filter projected onto each partition spec of a table, made once per spec.
pub(crate) struct Projections<'a> {
    table: &'a Table,
    filter: &'a BoundFilter,
    by_spec: HashMap<i32, PartitionFilter>,
}

impl<'a> Projections<'a> {
    pub(crate) fn new(table: &'a Table, filter: &'a BoundFilter) -> Self {
        Self { table, filter, by_spec: HashMap::new() }
    }

    /// Where a partition tuple of spec `spec` lies with respect to the filter.
    pub(crate) fn classify(&mut self, spec: i32, partition: &Struct) -> Result<Placement, SinkError> {
        if !self.by_spec.contains_key(&spec) {
            let Some(s) = self.table.metadata().partition_spec_by_id(spec) else {
                return Err(error::fatal(format!(
                    "table {} has no partition spec {spec}, which a data file names",
                    self.table.identifier()
                )));
            };
            let projected = self.filter.project(s).map_err(FilterError::into_sink_error)?;
            self.by_spec.insert(spec, projected);
        }
        match self.by_spec.get(&spec) {
            Some(p) => p.classify(partition).map_err(FilterError::into_sink_error),
            None => Err(error::fatal("a projection made just before is gone")),
        }
    }
}

/// What the filter's first commit removes from a head: every live data and
/// delete file wholly inside the filter.
pub(crate) struct FilterScan<'m> {
    pub(crate) gone: HashSet<&'m str>,
    /// Of `gone`, the data files and their rows.
    pub(crate) data_files: usize,
    pub(crate) rows: u64,
}

/// Scans the live files of `manifests` (a head of `table`) against `filter`:
/// the files inside it, or a `config` error naming the first files that
/// straddle it (Sluice replaces whole files, never rows inside them).
pub(crate) fn scan_filter<'m>(
    table: &Table,
    manifests: &'m [LoadedManifest],
    filter: &BoundFilter,
) -> Result<FilterScan<'m>, SinkError> {
    let mut projections = Projections::new(table, filter);
    let mut scan = FilterScan { gone: HashSet::new(), data_files: 0, rows: 0 };
    let mut straddling = Vec::new();
    for m in manifests {
        // A manifest holds files of its own spec.
        let spec = m.file.partition_spec_id;
        for entry in m.entries.iter().filter(|e| e.is_alive()) {
            let file = entry.data_file();
            match projections.classify(spec, file.partition())? {
                Placement::Inside => {
                    scan.gone.insert(entry.file_path());
                    if file.content_type() == DataContentType::Data {
                        scan.data_files += 1;
                        scan.rows += file.record_count();
                    }
                }
                Placement::Outside => {}
                Placement::Straddles => {
                    if straddling.len() < 3 {
                        let part = part_key(table, spec, file.partition())?;
                        straddling.push(format!("{} (partition spec {spec}, {part})", entry.file_path()));
                    }
                }
            }
        }
    }
    if straddling.is_empty() {
        return Ok(scan);
    }
    Err(error::config(format!(
        "table {}: data file(s) {} hold rows on both sides of overwrite_filter `{}` (or rows the table's partitions \
         cannot place on one side); Sluice replaces whole data files only, never rows inside them, so partition the \
         table by the filter's columns and write the filter on partition boundaries (e.g. whole days of a \
         day-partitioned column). Nothing was committed",
        table.identifier(),
        straddling.join(", "),
        filter.source()
    )))
}

/// The partition specs of the live files of the manifests `files` (a
/// manifest holds files of one spec; one whose counts say it has no added
/// or existing file holds none live, and one without counts is taken to).
pub(crate) fn live_specs<'a>(files: impl IntoIterator<Item = &'a ManifestFile>) -> BTreeSet<i32> {
    files
        .into_iter()
        .filter(|f| f.added_files_count.is_none_or(|n| n > 0) || f.existing_files_count.is_none_or(|n| n > 0))
        .map(|f| f.partition_spec_id)
        .collect()
}

/// `spec_id` of `table` as `spec 0 (identity(day))`.
fn describe_spec(table: &Table, spec_id: i32) -> String {
    let metadata = table.metadata();
    let Some(spec) = metadata.partition_spec_by_id(spec_id) else { return format!("spec {spec_id}") };
    if spec.is_unpartitioned() {
        return format!("spec {spec_id} (unpartitioned)");
    }
    let schema = metadata.current_schema();
    let fields: Vec<String> = spec
        .fields()
        .iter()
        .map(|f| format!("{}({})", f.transform, schema.name_by_field_id(f.source_id).unwrap_or("?")))
        .collect();
    format!("spec {spec_id} ({})", fields.join(", "))
}

/// Refuses (`config`) a dynamic overwrite of `table` whose live files are
/// of the partition specs `live`, or whose checkpoint files are of spec
/// `written` (when known), unless all are the table's default spec: the
/// partitions it replaces are values of one spec, and a file of another
/// could hold rows of a replaced partition unseen.
pub(crate) fn check_one_spec(table: &Table, live: &BTreeSet<i32>, written: Option<i32>) -> Result<(), SinkError> {
    let default = table.metadata().default_partition_spec_id();
    let mut others: BTreeSet<i32> = live.iter().copied().filter(|s| *s != default).collect();
    others.extend(written.filter(|s| *s != default));
    if others.is_empty() {
        return Ok(());
    }
    let others: Vec<String> = others.iter().map(|s| describe_spec(table, *s)).collect();
    Err(error::config(format!(
        "table {}: mode overwrite-partitions replaces the partitions its rows touch by the values of the table's \
         default partition spec, {}, but the table holds live data files of {} as well (its partition spec evolved). \
         Sluice does not compare partitions across specs: the older files of a replaced day would survive the \
         replace (doubling its rows), and another writer's files under the other spec could not be checked. \
         Rewrite the table's files under the default spec first (e.g. Spark's rewrite_data_files), or scope the \
         overwrite with [sink.options] overwrite_filter on columns every spec partitions, which places each file \
         by its own spec. Nothing was committed",
        table.identifier(),
        describe_spec(table, default),
        others.join(" and ")
    )))
}

/// What a commit must not meet in another writer's data since the base.
pub(crate) enum Scope<'a> {
    /// Any of these partitions (dynamic mode).
    Partitions(&'a BTreeSet<PartKey>),
    /// Any partition the filter may match.
    Filter(&'a BoundFilter),
}

/// Whether `snapshot` was committed by this job, sink and incarnation.
fn ours(snapshot: &Snapshot, ctx: &SinkContext) -> bool {
    let props = &snapshot.summary().additional_properties;
    props.get(SUMMARY_JOB) == Some(&ctx.job_id)
        && props.get(SUMMARY_SINK) == Some(&ctx.sink_id)
        && props.get(SUMMARY_INCARNATION) == Some(&ctx.incarnation)
}

/// Who committed `snapshot`, from its summary.
pub(crate) fn writer_of(snapshot: &Snapshot) -> String {
    let props = &snapshot.summary().additional_properties;
    let op = snapshot.summary().operation.as_str();
    match (props.get(SUMMARY_JOB), props.get(SUMMARY_SINK)) {
        (Some(job), Some(sink)) => format!(
            "sluice job {job:?} sink {sink:?} incarnation {} checkpoint {} (snapshot {}, {op})",
            props.get(SUMMARY_INCARNATION).map_or("(none)", String::as_str),
            props.get(SUMMARY_CHECKPOINT).map_or("?", String::as_str),
            snapshot.snapshot_id()
        ),
        _ => match props.get("engine-name") {
            Some(engine) => format!(
                "{engine}{} (snapshot {}, {op})",
                props.get("engine-version").map(|v| format!(" {v}")).unwrap_or_default(),
                snapshot.snapshot_id()
            ),
            None => {
                format!("snapshot {} ({op}, at {} ms since the epoch)", snapshot.snapshot_id(), snapshot.timestamp_ms())
            }
        },
    }
}

/// Validates the history of `table` down from `head` (the snapshot the
/// commit pins) for a checkpoint of `scope`: records in `state` every
/// partition another writer added data to, moves `checked_through` to
/// `head`, and refuses (`fatal`) when a partition in the scope has such data.
/// Each snapshot is read once per incarnation run: what it added is kept in
/// `foreign`, and the next walk stops at `head`.
pub(crate) fn validate(
    table: &Table,
    ctx: &SinkContext,
    head: Option<&Snapshot>,
    state: &mut TableState,
    scope: Scope<'_>,
) -> Result<(), SinkError> {
    let ident = table.identifier();
    let metadata = table.metadata();
    let stop = state.checked_through.or(state.base);
    // Newest first: the snapshots since `stop`.
    let mut history: Vec<&std::sync::Arc<Snapshot>> = Vec::new();
    let mut next = head.map(Snapshot::snapshot_id);
    loop {
        if next == stop {
            break;
        }
        let Some(id) = next else {
            // The chain ended before `stop`: expired, or rolled back.
            return Err(unknown_history(&ident.to_string(), stop));
        };
        let Some(snapshot) = metadata.snapshot_by_id(id) else {
            return Err(unknown_history(&ident.to_string(), stop));
        };
        history.push(snapshot);
        next = snapshot.parent_snapshot_id();
    }
    let filter = match scope {
        Scope::Filter(f) => Some(f),
        Scope::Partitions(_) => None,
    };
    let mut projections = filter.map(|f| Projections::new(table, f));
    for snapshot in history.iter().rev() {
        // Java's validateAddedDataFiles reads `append` and `overwrite`
        // snapshots, validateDeletedDataFiles and validateNoNewDeleteFiles
        // `overwrite` and `delete` ones. Unlike Java, a `replace` (a
        // compaction, which keeps every row) is never a conflict, so
        // `sluice maintain` can compact beside a running overwrite job.
        let (adds, deletes) = match &snapshot.summary().operation {
            Operation::Append => (true, false),
            Operation::Overwrite => (true, true),
            Operation::Delete => (false, true),
            Operation::Replace => (false, false),
        };
        if ours(snapshot, ctx) || !(adds || deletes) {
            continue;
        }
        let changed = changed_partitions(table, snapshot, adds, deletes, projections.as_mut())?;
        let writer = writer_of(snapshot);
        for ((partition, change), in_filter) in changed {
            match state.foreign.iter_mut().find(|f| f.partition == partition && f.change == change) {
                Some(found) => found.in_filter |= in_filter,
                None => state.foreign.push(Foreign { partition, writer: writer.clone(), in_filter, change }),
            }
        }
    }
    if let Some(head) = head {
        state.checked_through = Some(head.snapshot_id());
    }
    let conflicts: Vec<&Foreign> = state
        .foreign
        .iter()
        .filter(|f| match scope {
            Scope::Partitions(touched) => touched.contains(&f.partition),
            Scope::Filter(_) => f.in_filter,
        })
        .collect();
    if conflicts.is_empty() {
        return Ok(());
    }
    let found: Vec<String> =
        conflicts.iter().map(|f| format!("{} partition {} ({})", f.change.describe(), f.partition, f.writer)).collect();
    let scoped = match scope {
        Scope::Partitions(_) => String::new(),
        Scope::Filter(f) => format!(" (under overwrite_filter `{}`)", f.source()),
    };
    Err(error::fatal(format!(
        "table {ident}: another writer changed {} that this overwrite job (job {:?}, sink {:?}, incarnation {}) \
         replaces{scoped}: it {}. Nothing of this checkpoint was committed, and the other writer's changes are kept. Wait for the \
         other writer to finish and rerun this backfill as a new incarnation (a fresh state directory and \
         `--new-incarnation`), or drop this pending checkpoint (`sluice state --drop-pending`)",
        if conflicts.len() == 1 { "a partition" } else { "partitions" },
        ctx.job_id,
        ctx.sink_id,
        ctx.incarnation,
        found.join("; it ")
    )))
}

fn unknown_history(ident: &str, stop: Option<i64>) -> SinkError {
    let since = stop.map_or_else(|| "its first snapshot".to_string(), |s| format!("snapshot {s}"));
    error::fatal(format!(
        "table {ident}: cannot tell whether another writer changed a partition this overwrite job replaces: \
         the table's history no longer reaches back to {since}, where this incarnation's checks start (expired or \
         rolled back). Nothing was committed; rerun the backfill as a new incarnation (a fresh state directory and \
         `--new-incarnation`), and keep snapshot expiry behind running overwrite jobs"
    ))
}

/// Folds into `state` (of `table`) the checkpoints of this incarnation
/// that are committed to the table (its watermark is `watermark`) and not
/// folded in yet: in dynamic mode (`dynamic`) the partitions their
/// snapshots added files to, each replaced by the first checkpoint of the
/// incarnation that touched it; the filter's rows when one was the
/// filter's first commit. Nothing to do when the state has folded the
/// watermark. Refuses (`fatal`) when the table's history no longer reaches
/// back to them (expired), naming the table, the checkpoints and the way out.
pub(crate) fn catch_up(
    table: &Table,
    ctx: &SinkContext,
    state: &mut TableState,
    watermark: Option<u64>,
    dynamic: bool,
) -> Result<(), SinkError> {
    let Some(watermark) = watermark else { return Ok(()) };
    let folded = state.folded.unwrap_or(0);
    if watermark <= folded {
        return Ok(());
    }
    let ident = table.identifier().to_string();
    let metadata = table.metadata();
    // Newest first: this incarnation's snapshots of checkpoints past
    // `folded`, down to one at or before it, the base, where the conflict
    // check stopped (`checked_through`), or the table's first. A dropped
    // checkpoint's snapshot is always above `checked_through`: the state
    // restored was taken before its commit, so the walk never needs what
    // expiry may have removed below it.
    let mut found = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(id) = next {
        if Some(id) == state.base || (state.checked_through.is_some() && Some(id) == state.checked_through) {
            break;
        }
        let Some(snapshot) = metadata.snapshot_by_id(id) else {
            return Err(error::fatal(format!(
                "table {ident}: checkpoint(s) {}..={watermark} of incarnation {} are committed to this table but \
                 missing from the committer state this run restored (a pending checkpoint committed here and not to \
                 another table was dropped with `sluice state --drop-pending`), and the table's history no longer \
                 reaches back to them (snapshot {id} expired), so which partitions they replaced cannot be told, and \
                 replacing those partitions again would delete rows they delivered. Nothing was committed; land the \
                 backfill again as a new incarnation (a fresh job.state_dir and --new-incarnation)",
                folded + 1,
                ctx.incarnation
            )));
        };
        if ours(snapshot, ctx) {
            let c =
                snapshot.summary().additional_properties.get(SUMMARY_CHECKPOINT).and_then(|c| c.parse::<u64>().ok());
            match c {
                Some(c) if c <= folded => break,
                Some(c) => found.push((c, snapshot.clone())),
                None => {}
            }
        }
        next = snapshot.parent_snapshot_id();
    }
    let mut folded_in: Vec<String> = Vec::new();
    for (c, snapshot) in found.iter().rev() {
        let props = &snapshot.summary().additional_properties;
        if props.get("sluice.overwrite").map(String::as_str) == Some("filter") {
            state.filter_replaced = true;
            state.filter = props.get("sluice.overwrite-filter").cloned();
            folded_in.push(format!("checkpoint {c}: the rows of its overwrite_filter"));
        } else if dynamic {
            let parts: BTreeSet<PartKey> = changed_partitions(table, snapshot, true, false, None)?
                .into_iter()
                .map(|((partition, _), _)| partition)
                .collect();
            let names: Vec<String> = parts.iter().map(ToString::to_string).collect();
            folded_in.push(format!("checkpoint {c}: {}", names.join(", ")));
            state.replaced.extend(parts);
        }
    }
    log::warn(&format!(
        "table {ident}: checkpoint(s) {}..={watermark} of incarnation {} are committed to this table but missing from \
         the restored committer state (dropped after they were committed here); the partitions they replaced stay \
         replaced, and later checkpoints add to them: {}",
        folded + 1,
        ctx.incarnation,
        if folded_in.is_empty() { "none".to_string() } else { folded_in.join("; ") }
    ));
    state.folded = Some(watermark);
    Ok(())
}

/// A partition a snapshot changed, what it did there, and whether the
/// filter may match rows of it.
type Changed = ((PartKey, Change), bool);

/// The partitions `snapshot` changed, with what it did there and whether
/// the filter (when `projections` has one) may match rows of them: the
/// data files it added (`adds`: `added` entries of the data manifests it
/// wrote), and (`deletes`) the data files it removed (`deleted` entries of
/// those) and the delete files it added (`added` entries of the delete
/// manifests it wrote), as Java's `validationHistory` reads a snapshot.
fn changed_partitions(
    table: &Table,
    snapshot: &std::sync::Arc<Snapshot>,
    adds: bool,
    deletes: bool,
    mut projections: Option<&mut Projections<'_>>,
) -> Result<Vec<Changed>, SinkError> {
    let id = snapshot.snapshot_id();
    let wanted = |file: &ManifestFile| match file.content {
        ManifestContentType::Data => {
            (adds && file.added_files_count != Some(0)) || (deletes && file.deleted_files_count != Some(0))
        }
        ManifestContentType::Deletes => deletes && file.added_files_count != Some(0),
    };
    let entries = block_on(async {
        let list = table.manifest_list_reader(snapshot).load().await?;
        let mut out = Vec::new();
        for file in list.consume_entries() {
            if file.added_snapshot_id != id || !wanted(&file) {
                continue;
            }
            let (entries, _) = file.load_manifest(table.file_io()).await?.into_parts();
            // A manifest holds files of its own spec.
            out.extend(entries.into_iter().map(|e| (file.partition_spec_id, e)));
        }
        Ok::<_, iceberg::Error>(out)
    })
    .map_err(|e| iceberg_error(&format!("reading the history of table {}", table.identifier()), e))?;
    let mut parts: BTreeMap<(PartKey, Change), bool> = BTreeMap::new();
    for (spec, entry) in entries {
        if entry.snapshot_id().is_some_and(|s| s != id) {
            continue;
        }
        let data = entry.data_file().content_type() == DataContentType::Data;
        let change = match entry.status() {
            ManifestStatus::Added if data && adds => Change::AddedRows,
            ManifestStatus::Added if !data && deletes => Change::AddedDeletes,
            ManifestStatus::Deleted if data && deletes => Change::RemovedFiles,
            _ => continue,
        };
        let file = entry.data_file();
        let in_filter = match projections.as_deref_mut() {
            Some(p) => p.classify(spec, file.partition())? != Placement::Outside,
            None => false,
        };
        *parts.entry((part_key(table, spec, file.partition())?, change)).or_default() |= in_filter;
    }
    Ok(parts.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(day: &str) -> PartKey {
        PartKey { spec: 0, fields: vec![format!("day={day}")] }
    }

    #[test]
    fn the_first_touch_replaces_and_later_ones_add() {
        let touched: BTreeSet<PartKey> = [key("2024-01-01"), key("2024-01-02")].into();
        let first = plan(None, touched.clone());
        assert_eq!(first.replace, touched);
        let mut state = State::default();
        state.see("ns.t", Some(7));
        state.fold("ns.t", 1, &first);
        let later = plan(state.tables.get("ns.t"), [key("2024-01-02"), key("2024-01-03")].into());
        assert_eq!(later.replace, [key("2024-01-03")].into());
        assert_eq!(later.touched.len(), 2);
        // A second sight keeps the first base.
        state.see("ns.t", Some(9));
        assert_eq!(state.tables["ns.t"].base, Some(7));
    }

    /// The filter's first commit is the first plan until one lands; a
    /// landed one is folded in with its filter, and later plans add.
    #[test]
    fn the_filter_replaces_once_and_keeps_its_scope() {
        let filter = OverwriteFilter::parse("day >= '2024-01-02'").unwrap();
        let mut state = State::default();
        state.see("ns.t", Some(3));
        assert!(!state.landed_any());
        let first = filter_plan(state.tables.get("ns.t"), &filter, [key("2024-01-02")].into());
        assert!(first.filter_first && first.replace.is_empty());
        // Not landed yet: the next plan is still the first.
        assert!(filter_plan(state.tables.get("ns.t"), &filter, BTreeSet::new()).filter_first);
        state.fold("ns.t", 1, &first);
        assert!(state.landed_any());
        let t = &state.tables["ns.t"];
        assert_eq!((t.filter_replaced, t.filter.as_deref()), (true, Some("day >= '2024-01-02'")));
        assert!(!filter_plan(Some(t), &filter, [key("2024-01-03")].into()).filter_first);
        // The same scope passes; another filter, or none, is refused by name.
        check_scope("ns.t", Some(t), Some("day >= '2024-01-02'")).unwrap();
        let Err(SinkError::Config(m)) = check_scope("ns.t", Some(t), Some("day >= '2024-01-05'")) else {
            panic!("another filter")
        };
        assert!(m.contains("ns.t") && m.contains("2024-01-05") && m.contains("--new-incarnation"), "{m}");
        assert!(check_scope("ns.t", Some(t), None).is_err());
        // A dynamic incarnation may not take a filter; a fresh one may.
        let mut dynamic = State::default();
        dynamic.see("ns.t", None);
        check_scope("ns.t", dynamic.tables.get("ns.t"), Some("day = '2024-01-01'")).unwrap();
        dynamic.fold("ns.t", 1, &plan(None, [key("2024-01-01")].into()));
        assert!(check_scope("ns.t", dynamic.tables.get("ns.t"), Some("day = '2024-01-01'")).is_err());
        check_scope("ns.t", dynamic.tables.get("ns.t"), None).unwrap();
        // The state with the filter round-trips.
        let bytes = serde_json::to_vec(&state).unwrap();
        assert_eq!(serde_json::from_slice::<State>(&bytes).unwrap(), state);
    }

    #[test]
    fn the_state_round_trips_as_json() {
        let mut state = State::default();
        state.see("ns.t", None);
        state.fold("ns.t", 1, &plan(None, [key("2024-01-01")].into()));
        if let Some(t) = state.tables.get_mut("ns.t") {
            t.foreign.push(Foreign {
                partition: key("2024-01-09"),
                writer: "snapshot 3 (append)".into(),
                in_filter: false,
                change: Change::AddedRows,
            });
            t.foreign.push(Foreign {
                partition: key("2024-01-09"),
                writer: "snapshot 4 (delete)".into(),
                in_filter: false,
                change: Change::RemovedFiles,
            });
        }
        let bytes = serde_json::to_vec(&state).unwrap();
        assert_eq!(serde_json::from_slice::<State>(&bytes).unwrap(), state);
        assert_eq!(key("2024-01-05").to_string(), "day=2024-01-05");
        assert_eq!(PartKey { spec: 0, fields: vec![] }.to_string(), "the whole (unpartitioned) table");
    }
}
