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
//!   `already-committed` ([`State::fold`]); the history found by validation
//!   (`foreign`, `checked_through`) is fact about the table and is kept
//!   whatever the commit's outcome;
//! - before every commit attempt the history of the table from the
//!   incarnation's base (or from where it was checked last) to exactly the
//!   head the commit pins is validated as Java's `validateAddedDataFiles`
//!   does: data added by another writer's `append` or `overwrite` snapshot to
//!   a partition the checkpoint touches is a `fatal` error naming the
//!   partition and the writer, never silently dropped or kept; a history
//!   that does not reach back to the base (expired) is refused the same way;
//! - a partition is `(spec id, the partition's values rendered by their
//!   transforms)`: an unpartitioned table is one partition, so the first
//!   checkpoint of an incarnation replaces the whole table.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use iceberg::spec::{DataContentType, DataFile, ManifestContentType, ManifestStatus, Operation, Snapshot, Struct};
use iceberg::table::Table;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{SinkContext, SinkError, error};

use crate::runtime::block_on;
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

/// Another writer's data found in a partition since the incarnation's base.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Foreign {
    pub(crate) partition: PartKey,
    /// Who added it, as its snapshot's summary tells.
    pub(crate) writer: String,
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
    /// Partitions other writers added data to since `base`.
    #[serde(default)]
    pub(crate) foreign: Vec<Foreign>,
}

/// The committer state of an overwrite job, per table ident (`ns.name`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    #[serde(default)]
    pub(crate) tables: BTreeMap<String, TableState>,
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

    /// Folds a committed plan in: its partitions are replaced.
    pub(crate) fn fold(&mut self, ident: &str, plan: &Plan) {
        if let Some(t) = self.tables.get_mut(ident) {
            t.replaced.extend(plan.replace.iter().cloned());
        }
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
}

/// The plan of a checkpoint touching `touched`, given `state`.
pub(crate) fn plan(state: Option<&TableState>, touched: BTreeSet<PartKey>) -> Plan {
    let replace =
        touched.iter().filter(|p| state.is_none_or(|s| !s.replaced.contains(*p))).cloned().collect::<BTreeSet<_>>();
    Plan { replace, touched }
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
/// commit pins) for a checkpoint touching `touched`: records in `state`
/// every partition another writer added data to, moves `checked_through`
/// to `head`, and refuses (`fatal`) when a touched partition has such data.
/// Each snapshot is read once per incarnation run: what it added is kept in
/// `foreign`, and the next walk stops at `head`.
pub(crate) fn validate(
    table: &Table,
    ctx: &SinkContext,
    head: Option<&Snapshot>,
    state: &mut TableState,
    touched: &BTreeSet<PartKey>,
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
    for snapshot in history.iter().rev() {
        let op = &snapshot.summary().operation;
        if ours(snapshot, ctx) || !matches!(op, Operation::Append | Operation::Overwrite) {
            continue;
        }
        let added = added_partitions(table, snapshot)?;
        let writer = writer_of(snapshot);
        for partition in added {
            if !state.foreign.iter().any(|f| f.partition == partition) {
                state.foreign.push(Foreign { partition, writer: writer.clone() });
            }
        }
    }
    if let Some(head) = head {
        state.checked_through = Some(head.snapshot_id());
    }
    let conflicts: Vec<&Foreign> = state.foreign.iter().filter(|f| touched.contains(&f.partition)).collect();
    if conflicts.is_empty() {
        return Ok(());
    }
    let found: Vec<String> = conflicts.iter().map(|f| format!("partition {} by {}", f.partition, f.writer)).collect();
    Err(error::fatal(format!(
        "table {ident}: another writer added rows to {} that this overwrite job (job {:?}, sink {:?}, incarnation {}) \
         replaces: {}. Nothing of this checkpoint was committed, and the other writer's rows are kept. Wait for the \
         other writer to finish and rerun this backfill as a new incarnation (a fresh state directory and \
         `--new-incarnation`), or drop this pending checkpoint (`sluice state --drop-pending`)",
        if conflicts.len() == 1 { "a partition" } else { "partitions" },
        ctx.job_id,
        ctx.sink_id,
        ctx.incarnation,
        found.join("; ")
    )))
}

fn unknown_history(ident: &str, stop: Option<i64>) -> SinkError {
    let since = stop.map_or_else(|| "its first snapshot".to_string(), |s| format!("snapshot {s}"));
    error::fatal(format!(
        "table {ident}: cannot tell whether another writer added rows to a partition this overwrite job replaces: \
         the table's history no longer reaches back to {since}, where this incarnation's checks start (expired or \
         rolled back). Nothing was committed; rerun the backfill as a new incarnation (a fresh state directory and \
         `--new-incarnation`), and keep snapshot expiry behind running overwrite jobs"
    ))
}

/// The partitions of the data files `snapshot` added (`added` entries of
/// the data manifests it wrote).
fn added_partitions(table: &Table, snapshot: &std::sync::Arc<Snapshot>) -> Result<Vec<PartKey>, SinkError> {
    let id = snapshot.snapshot_id();
    let entries = block_on(async {
        let list = table.manifest_list_reader(snapshot).load().await?;
        let mut out = Vec::new();
        for file in list.consume_entries() {
            if file.added_snapshot_id != id
                || file.content != ManifestContentType::Data
                || file.added_files_count == Some(0)
            {
                continue;
            }
            let (entries, _) = file.load_manifest(table.file_io()).await?.into_parts();
            // A manifest holds files of its own spec.
            out.extend(entries.into_iter().map(|e| (file.partition_spec_id, e)));
        }
        Ok::<_, iceberg::Error>(out)
    })
    .map_err(|e| iceberg_error(&format!("reading the history of table {}", table.identifier()), e))?;
    let mut parts = BTreeSet::new();
    for (spec, entry) in entries {
        if entry.status() != ManifestStatus::Added
            || entry.snapshot_id().is_some_and(|s| s != id)
            || entry.data_file().content_type() != DataContentType::Data
        {
            continue;
        }
        let file = entry.data_file();
        parts.insert(part_key(table, spec, file.partition())?);
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
        state.fold("ns.t", &first);
        let later = plan(state.tables.get("ns.t"), [key("2024-01-02"), key("2024-01-03")].into());
        assert_eq!(later.replace, [key("2024-01-03")].into());
        assert_eq!(later.touched.len(), 2);
        // A second sight keeps the first base.
        state.see("ns.t", Some(9));
        assert_eq!(state.tables["ns.t"].base, Some(7));
    }

    #[test]
    fn the_state_round_trips_as_json() {
        let mut state = State::default();
        state.see("ns.t", None);
        state.fold("ns.t", &plan(None, [key("2024-01-01")].into()));
        if let Some(t) = state.tables.get_mut("ns.t") {
            t.foreign.push(Foreign { partition: key("2024-01-09"), writer: "snapshot 3 (append)".into() });
        }
        let bytes = serde_json::to_vec(&state).unwrap();
        assert_eq!(serde_json::from_slice::<State>(&bytes).unwrap(), state);
        assert_eq!(key("2024-01-05").to_string(), "day=2024-01-05");
        assert_eq!(PartKey { spec: 0, fields: vec![] }.to_string(), "the whole (unpartitioned) table");
    }
}
