//! Snapshots that remove files as well as add them (compaction's `replace`,
//! and the `overwrite` and `delete` of a partition overwrite), built from
//! iceberg-rust's public manifest and manifest-list writers: iceberg-rust
//! 0.10 has only `fast_append` (its `transaction::snapshot` producer is
//! crate-private), so this module builds them the way it builds an append.
//!
//! Invariants of [`build_snapshot`]:
//! - the new snapshot's live files are exactly the head's live files, less
//!   those whose location is in `gone`, plus `added`; every location in
//!   `gone` must be live in the head (compared exactly as the manifests spell
//!   it), or nothing is built;
//! - a manifest that holds no live file of `gone` is kept as it is; the live
//!   entries of the others are rewritten into one new manifest per
//!   (partition spec, content): data manifests and delete manifests each
//!   keep their content, a removed file becomes a `deleted` entry and every
//!   other one an `existing` entry, both keeping the snapshot and sequence
//!   numbers that added the file (so a delete file in a removed partition
//!   goes as well, as Java's `MergingSnapshotProducer.dropPartition` drops it);
//! - the added files go into new manifests of their own partition spec and
//!   content, never of the default spec by assumption;
//! - the commit asserts the table's uuid and that `main` is still the head
//!   (that `main` does not exist when there is no head), so a commit built
//!   on a head that moved is refused as a whole and never rebased; the
//!   table properties given are set by the same atomic commit;
//! - the summary's `added-*`/`deleted-*`/`removed-*` counts are those of the
//!   files actually added and removed, and its `total-*` counts are the
//!   head's carried on (a total the head does not have stays absent);
//! - manifests are merged as Java's merging snapshot producers merge them
//!   ([`MergePolicy`]: `commit.manifest-merge.enabled`,
//!   `commit.manifest.min-count-to-merge`, `commit.manifest.target-size-bytes`
//!   and their defaults): once a (spec, content) group counts that many
//!   manifests, its kept manifests under the target size are rewritten into
//!   as few as the target allows, every live entry an `existing` one with
//!   the snapshot and sequence numbers that added its file, so a long run of
//!   appends keeps its manifest list short and the live files are unchanged.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use iceberg::spec::{
    DataContentType, DataFile, FormatVersion, MAIN_BRANCH, ManifestEntryRef, ManifestFile, ManifestListWriter,
    ManifestWriter, ManifestWriterBuilder, Operation, PartitionSpecRef, Snapshot, SnapshotReference, SnapshotRetention,
    SnapshotSummaryCollector, Summary, TableMetadata,
};
use iceberg::table::Table;
use iceberg::{TableRequirement, TableUpdate};
use sluice_guest_sdk::{SinkError, error, log};

use crate::runtime::block_on;
use crate::writer::iceberg_error;

/// A manifest of a snapshot with its entries (inherited values filled in),
/// or only its line of the manifest list ([`listed`]: `loaded` is false and
/// `entries` empty until a merge reads them).
pub(crate) struct LoadedManifest {
    pub(crate) file: ManifestFile,
    pub(crate) entries: Vec<ManifestEntryRef>,
    pub(crate) loaded: bool,
}

/// The manifests of `snapshot` as its manifest list names them, none read:
/// what an append needs, whose cost must not grow with the table's files.
pub(crate) fn listed(table: &Table, snapshot: &Arc<Snapshot>) -> Result<Vec<LoadedManifest>, SinkError> {
    block_on(async {
        let list = table.manifest_list_reader(snapshot).load().await?;
        Ok::<_, iceberg::Error>(
            list.consume_entries()
                .into_iter()
                .map(|file| LoadedManifest { file, entries: Vec::new(), loaded: false })
                .collect(),
        )
    })
    .map_err(|e| iceberg_error(&format!("reading the manifest list of table {}", table.identifier()), e))
}

/// The manifests of `snapshot`, each read once.
pub(crate) fn manifests_of(table: &Table, snapshot: &Arc<Snapshot>) -> Result<Vec<LoadedManifest>, SinkError> {
    manifests_cached(table, snapshot, &mut HashMap::new())
}

/// Manifests are immutable: `cache` keeps the entries of those read
/// before, by path, so that a retry on a newer head reads only the
/// manifests appended since.
pub(crate) fn manifests_cached(
    table: &Table,
    snapshot: &Arc<Snapshot>,
    cache: &mut HashMap<String, Vec<ManifestEntryRef>>,
) -> Result<Vec<LoadedManifest>, SinkError> {
    block_on(async {
        let list = table.manifest_list_reader(snapshot).load().await?;
        let mut out = Vec::new();
        for file in list.consume_entries() {
            let entries = match cache.get(&file.manifest_path) {
                Some(entries) => entries.clone(),
                None => {
                    let (entries, _) = file.load_manifest(table.file_io()).await?.into_parts();
                    cache.insert(file.manifest_path.clone(), entries.clone());
                    entries
                }
            };
            out.push(LoadedManifest { file, entries, loaded: true });
        }
        Ok::<_, iceberg::Error>(out)
    })
    .map_err(|e| iceberg_error(&format!("reading the manifests of table {}", table.identifier()), e))
}

/// A snapshot ready to commit: its id, and the requirements and updates
/// that commit it (for `host_io::commit_updates`).
#[derive(Debug)]
pub(crate) struct Built {
    pub(crate) snapshot_id: i64,
    pub(crate) requirements: Vec<TableRequirement>,
    pub(crate) updates: Vec<TableUpdate>,
}

/// Manifests of one (partition spec, content) are written together: `true`
/// is delete files. Data sorts before deletes.
type ManifestKey = (i32, bool);

fn is_deletes(file: &DataFile) -> bool {
    file.content_type() != DataContentType::Data
}

/// Table properties of manifest merging, named and defaulted as in Java's
/// `TableProperties` (the Iceberg spec leaves merging to writers).
pub(crate) const MERGE_ENABLED: &str = "commit.manifest-merge.enabled";
pub(crate) const MERGE_MIN_COUNT: &str = "commit.manifest.min-count-to-merge";
pub(crate) const MERGE_TARGET_BYTES: &str = "commit.manifest.target-size-bytes";

/// The most manifests one snapshot merges: a table with a long backlog
/// (written without merging) drains it over several commits, each well
/// inside a call's deadline and memory.
const MAX_MERGED_MANIFESTS: usize = 200;

/// When and how far a snapshot merges the manifests it keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MergePolicy {
    /// A (spec, content) group with at least this many manifests is merged.
    pub(crate) min_count: usize,
    /// Manifests at or above this length stay as they are; merged ones are
    /// packed up to it.
    pub(crate) target_bytes: i64,
}

impl MergePolicy {
    /// The table's policy: `None` when `commit.manifest-merge.enabled` is
    /// anything but `true`. A count or size that does not parse is the
    /// default (100 manifests, 8 MiB).
    pub(crate) fn of(metadata: &TableMetadata) -> Option<Self> {
        let get = |key: &str| metadata.properties().get(key).map(|v| v.trim());
        // As Java's `Boolean.parseBoolean`: anything but `true` is false.
        if get(MERGE_ENABLED).is_some_and(|v| !v.eq_ignore_ascii_case("true")) {
            return None;
        }
        let min_count = get(MERGE_MIN_COUNT).and_then(|v| v.parse::<usize>().ok()).unwrap_or(100).max(2);
        let target_bytes =
            get(MERGE_TARGET_BYTES).and_then(|v| v.parse::<i64>().ok()).filter(|v| *v > 0).unwrap_or(8 << 20);
        Some(Self { min_count, target_bytes })
    }

    /// Which of a group's kept manifests (their lengths, in list order) to
    /// merge, as bins of indexes: none while the group (`count` manifests
    /// in the new snapshot, written ones included) is under `min_count`;
    /// otherwise the manifests under the target size, packed in order into
    /// bins of at most the target, each bin of two or more merged into one.
    pub(crate) fn bins(&self, count: usize, lengths: &[i64]) -> Vec<Vec<usize>> {
        if count < self.min_count {
            return Vec::new();
        }
        let mut bins: Vec<Vec<usize>> = Vec::new();
        let mut current: Vec<usize> = Vec::new();
        let mut size = 0i64;
        for (i, &length) in lengths.iter().enumerate() {
            if length >= self.target_bytes {
                continue;
            }
            if !current.is_empty() && size.saturating_add(length) > self.target_bytes {
                bins.push(std::mem::take(&mut current));
                size = 0;
            }
            current.push(i);
            size = size.saturating_add(length);
        }
        bins.push(current);
        bins.retain(|b| b.len() >= 2);
        bins
    }
}

/// Builds, on `head` (the table's current snapshot, `None` when it has
/// none) whose manifests are `manifests`, a snapshot that removes every
/// live data and delete file whose location is in `gone` and adds `added`
/// (each with the id of the partition spec it was written for), writing its
/// manifests and manifest list. `summary` gives the operation and the
/// caller's summary properties; the file counts and totals are computed
/// here (and win over the caller's keys, as in Java's `SnapshotProducer`).
/// `properties` are table properties set by the same commit (none: no
/// `set-properties` update). Nothing is committed: the caller sends
/// [`Built::requirements`] and [`Built::updates`], and may add requirements.
///
/// Refused (nothing written): a location in `gone` that is not live in
/// `manifests`; an `append` that removes or a `delete` that adds; a spec id
/// the table does not have; a delete file in a format-version-1 table.
pub(crate) fn build_snapshot(
    table: &Table,
    head: Option<&Snapshot>,
    manifests: &[LoadedManifest],
    gone: &HashSet<&str>,
    added: &[(i32, DataFile)],
    summary: Summary,
    properties: HashMap<String, String>,
) -> Result<Built, SinkError> {
    let metadata = table.metadata();
    let ident = table.identifier();
    match summary.operation {
        Operation::Append if !gone.is_empty() => {
            return Err(error::fatal(format!("table {ident}: an append snapshot cannot remove files")));
        }
        Operation::Delete if !added.is_empty() => {
            return Err(error::fatal(format!("table {ident}: a delete snapshot cannot add files")));
        }
        _ => {}
    }
    if metadata.properties().contains_key("encryption.key-id") {
        return Err(error::config(format!(
            "table {ident} is encrypted (`encryption.key-id`); the Iceberg sink writes no encrypted manifests or \
             data files, so nothing was committed"
        )));
    }
    if !gone.is_empty() && manifests.iter().any(|m| !m.loaded) {
        return Err(error::fatal(format!(
            "table {ident}: a snapshot that removes files was asked for on manifests not read; nothing was committed"
        )));
    }
    let live: HashSet<&str> =
        manifests.iter().flat_map(|m| m.entries.iter()).filter(|e| e.is_alive()).map(|e| e.file_path()).collect();
    let mut missing: Vec<&str> = gone.iter().copied().filter(|f| !live.contains(f)).collect();
    if !missing.is_empty() {
        missing.sort_unstable();
        return Err(error::fatal(format!(
            "table {ident}: the snapshot would remove file(s) not live in {}: {}; nothing was committed",
            head.map_or_else(|| "the empty table".to_string(), |h| format!("snapshot {}", h.snapshot_id())),
            missing.join(", ")
        )));
    }
    let snapshot_id = new_snapshot_id(metadata);
    let commit = uuid::Uuid::new_v4();
    let version = metadata.format_version();
    let schema = metadata.current_schema().clone();
    let meta_dir = format!("{}/metadata", metadata.location().trim_end_matches('/'));
    let next_seq = metadata.next_sequence_number();
    let fail = |e: iceberg::Error| iceberg_error(&format!("building a snapshot of table {ident}"), e);
    let spec_of = |spec_id: i32, what: &str| -> Result<PartitionSpecRef, SinkError> {
        metadata
            .partition_spec_by_id(spec_id)
            .cloned()
            .ok_or_else(|| error::fatal(format!("table {ident} has no partition spec {spec_id}, which {what} names")))
    };
    let mut counter = 0u32;
    let mut writer_for = |(spec_id, deletes): ManifestKey, what: &str| -> Result<ManifestWriter, SinkError> {
        counter += 1;
        let path = format!("{meta_dir}/{commit}-c{counter}.avro");
        let spec = spec_of(spec_id, what)?;
        let output = table.file_io().new_output(path).map_err(fail)?;
        let b = ManifestWriterBuilder::new(output, Some(snapshot_id), schema.clone(), spec.as_ref().clone());
        Ok(match (version, deletes) {
            (FormatVersion::V1, false) => b.build_v1(),
            (FormatVersion::V1, true) => {
                return Err(error::fatal(format!(
                    "table {ident} is of format version 1, which has no delete files ({what})"
                )));
            }
            (FormatVersion::V2, false) => b.build_v2_data(),
            (FormatVersion::V2, true) => b.build_v2_deletes(),
            (FormatVersion::V3, false) => b.build_v3_data(),
            (FormatVersion::V3, true) => b.build_v3_deletes(),
        })
    };
    // The files removed, with the spec of the manifest that named them.
    let mut removed: Vec<(i32, DataFile)> = Vec::new();
    let mut out: Vec<ManifestFile> = Vec::new();
    // The live entries of every manifest that names a removed file go into
    // one new manifest per (spec, content) (entries keep the snapshot and
    // sequence numbers that added them), so an attempt writes a few
    // manifests however many small ones it rewrites.
    let mut merged: BTreeMap<ManifestKey, ManifestWriter> = BTreeMap::new();
    // The manifests kept as they are, by group, in list order.
    let mut kept: BTreeMap<ManifestKey, Vec<&LoadedManifest>> = BTreeMap::new();
    let key_of = |m: &LoadedManifest| -> ManifestKey {
        (m.file.partition_spec_id, m.file.content == iceberg::spec::ManifestContentType::Deletes)
    };
    for m in manifests {
        let touches = m.entries.iter().any(|e| e.is_alive() && gone.contains(e.file_path()));
        if !touches {
            kept.entry(key_of(m)).or_default().push(m);
            continue;
        }
        let key = key_of(m);
        let writer = match merged.entry(key) {
            std::collections::btree_map::Entry::Occupied(w) => w.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(writer_for(key, &format!("manifest {}", m.file.manifest_path))?)
            }
        };
        for entry in &m.entries {
            if !entry.is_alive() {
                // Deleted entries belong to the snapshot that deleted them.
                continue;
            }
            let seq = entry.sequence_number().unwrap_or(0);
            let file_seq = entry.file_sequence_number.or(Some(seq));
            let file = entry.data_file().clone();
            if gone.contains(entry.file_path()) {
                removed.push((m.file.partition_spec_id, file.clone()));
                writer.add_delete_file(file, seq, file_seq).map_err(fail)?;
            } else {
                let added_by = entry.snapshot_id().unwrap_or(m.file.added_snapshot_id);
                writer.add_existing_file(file, added_by, seq, file_seq).map_err(fail)?;
            }
        }
    }
    let mut fresh: BTreeMap<ManifestKey, ManifestWriter> = BTreeMap::new();
    for (spec_id, file) in added {
        let key = (*spec_id, is_deletes(file));
        let writer = match fresh.entry(key) {
            std::collections::btree_map::Entry::Occupied(w) => w.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(writer_for(key, &format!("new file {}", file.file_path()))?)
            }
        };
        writer.add_file(file.clone(), -1).map_err(fail)?;
    }
    // Merging: each group's kept manifests, counted with those this
    // snapshot writes for the group, oldest first, at most
    // [`MAX_MERGED_MANIFESTS`] of them (a backlog drains over several
    // commits). Not the data manifests of a format-version-3 table: their
    // entries would need their inherited `first_row_id` written out, which
    // iceberg-rust 0.10's reader does not fill in, or the rows would get
    // new row ids. A bin that cannot be merged (a manifest that cannot be
    // read, or rewritten under the table's current schema) stays as it is:
    // merging is an optimisation, never a reason to fail the commit.
    let policy = MergePolicy::of(metadata);
    let mut budget = MAX_MERGED_MANIFESTS;
    for (key, group) in &kept {
        let mut in_bin = vec![false; group.len()];
        let lineage = version == FormatVersion::V3 && !key.1;
        if let Some(policy) = policy.filter(|_| !lineage) {
            let count = group.len() + usize::from(merged.contains_key(key)) + usize::from(fresh.contains_key(key));
            let mut order: Vec<usize> = (0..group.len()).collect();
            order.sort_by_key(|&i| group[i].file.sequence_number);
            let lengths: Vec<i64> = order.iter().map(|&i| group[i].file.manifest_length).collect();
            for bin in policy.bins(count, &lengths) {
                let members: Vec<usize> = bin.iter().map(|&b| order[b]).take(budget).collect();
                if members.len() < 2 {
                    break;
                }
                let mut merge_bin = || -> Result<ManifestFile, SinkError> {
                    let mut writer = writer_for(*key, "merged manifests")?;
                    for &i in &members {
                        let m = group[i];
                        let read;
                        let entries = if m.loaded {
                            &m.entries
                        } else {
                            read = block_on(m.file.load_manifest(table.file_io())).map_err(fail)?.into_parts().0;
                            &read
                        };
                        for entry in entries.iter().filter(|e| e.is_alive()) {
                            let seq = match (entry.sequence_number(), version) {
                                (Some(seq), _) => seq,
                                (None, FormatVersion::V1) => 0,
                                (None, _) => {
                                    return Err(error::fatal(format!(
                                        "manifest {} has an entry without a sequence number ({})",
                                        m.file.manifest_path,
                                        entry.file_path()
                                    )));
                                }
                            };
                            let file_seq = entry.file_sequence_number.or(Some(seq));
                            let added_by = entry.snapshot_id().unwrap_or(m.file.added_snapshot_id);
                            writer
                                .add_existing_file(entry.data_file().clone(), added_by, seq, file_seq)
                                .map_err(fail)?;
                        }
                    }
                    block_on(writer.write_manifest_file()).map_err(fail)
                };
                match merge_bin() {
                    Ok(file) => {
                        out.push(file);
                        budget -= members.len();
                        for &i in &members {
                            in_bin[i] = true;
                        }
                    }
                    Err(e) => {
                        let why = match e {
                            SinkError::Config(m)
                            | SinkError::InvalidData(m)
                            | SinkError::Retryable(m)
                            | SinkError::Fatal(m) => m,
                        };
                        log::warn(&format!(
                            "table {ident}: {} small manifests were left unmerged, this commit goes on without \
                             merging them: {why}",
                            members.len()
                        ));
                    }
                }
            }
        }
        out.extend(group.iter().zip(&in_bin).filter(|(_, done)| !**done).map(|(m, _)| m.file.clone()));
    }
    block_on(async {
        for writer in merged.into_values().chain(fresh.into_values()) {
            out.push(writer.write_manifest_file().await?);
        }
        Ok::<_, iceberg::Error>(())
    })
    .map_err(fail)?;
    let parent = head.map(Snapshot::snapshot_id);
    let list_path = format!("{meta_dir}/snap-{snapshot_id}-0-{commit}.avro");
    let first_row_id = metadata.next_row_id();
    let next_row_id = block_on(async {
        let output = table.file_io().new_output(list_path.clone())?.writer().await?;
        let mut list = match version {
            FormatVersion::V1 => ManifestListWriter::v1(output, snapshot_id, parent),
            FormatVersion::V2 => ManifestListWriter::v2(output, snapshot_id, parent, next_seq),
            FormatVersion::V3 => ManifestListWriter::v3(output, snapshot_id, parent, next_seq, Some(first_row_id)),
        };
        list.add_manifests(out.into_iter())?;
        let next = list.next_row_id();
        list.close().await?;
        Ok::<_, iceberg::Error>(next)
    })
    .map_err(fail)?;
    let summary = summarize(metadata, &ident.to_string(), head, &removed, added, summary)?;
    let snapshot = Snapshot::builder()
        .with_manifest_list(list_path)
        .with_snapshot_id(snapshot_id)
        .with_parent_snapshot_id(parent)
        .with_sequence_number(next_seq)
        .with_summary(summary)
        .with_schema_id(metadata.current_schema_id())
        .with_timestamp_ms(head.map_or(now_ms(), |h| now_ms().max(h.timestamp_ms() + 1)));
    let snapshot = match next_row_id {
        Some(next) => snapshot.with_row_range(first_row_id, next - first_row_id).build(),
        None => snapshot.build(),
    };
    let mut updates = vec![
        TableUpdate::AddSnapshot { snapshot },
        TableUpdate::SetSnapshotRef {
            ref_name: MAIN_BRANCH.to_string(),
            reference: SnapshotReference::new(snapshot_id, SnapshotRetention::branch(None, None, None)),
        },
    ];
    if !properties.is_empty() {
        updates.push(TableUpdate::SetProperties { updates: properties });
    }
    let requirements = vec![
        TableRequirement::UuidMatch { uuid: metadata.uuid() },
        // `None`: `main` must not exist (the REST spec's assert-ref-snapshot-id).
        TableRequirement::RefSnapshotIdMatch { r#ref: MAIN_BRANCH.to_string(), snapshot_id: parent },
    ];
    Ok(Built { snapshot_id, requirements, updates })
}

/// The summary of a snapshot on `head` that removed `removed` and added
/// `added` (each with its spec id): the caller's `summary` (operation and
/// properties), the counts of what changed, and the table's totals carried
/// on from the head.
///
/// iceberg-rust computes totals in `update_snapshot_summaries`, which is
/// crate-private and refuses `replace`; so they are carried here.
fn summarize(
    metadata: &TableMetadata,
    table: &str,
    head: Option<&Snapshot>,
    removed: &[(i32, DataFile)],
    added: &[(i32, DataFile)],
    summary: Summary,
) -> Result<Summary, SinkError> {
    let schema = metadata.current_schema().clone();
    let spec = |spec_id: i32| {
        metadata.partition_spec_by_id(spec_id).cloned().ok_or_else(|| {
            error::fatal(format!("table {table} has no partition spec {spec_id}, which a file of the snapshot names"))
        })
    };
    let mut collector = SnapshotSummaryCollector::default();
    for (spec_id, file) in added {
        collector.add_file(file, schema.clone(), spec(*spec_id)?);
    }
    for (spec_id, file) in removed {
        collector.remove_file(file, schema.clone(), spec(*spec_id)?);
    }
    let mut properties = summary.additional_properties;
    properties.extend(collector.build());
    // (added, removed) of one measure over the files of `content`.
    let measure = |keep: fn(DataContentType) -> bool, f: fn(&DataFile) -> u64| {
        let sum = |files: &[(i32, DataFile)]| -> u64 {
            files.iter().filter(|(_, d)| keep(d.content_type())).map(|(_, d)| f(d)).sum()
        };
        (sum(added), sum(removed))
    };
    let data = |c: DataContentType| c == DataContentType::Data;
    let deletes = |c: DataContentType| c != DataContentType::Data;
    let positions = |c: DataContentType| c == DataContentType::PositionDeletes;
    let equalities = |c: DataContentType| c == DataContentType::EqualityDeletes;
    let any = |_: DataContentType| true;
    let one = |_: &DataFile| -> u64 { 1 };
    let totals = [
        ("total-records", measure(data, DataFile::record_count)),
        ("total-files-size", measure(any, DataFile::file_size_in_bytes)),
        ("total-data-files", measure(data, one)),
        ("total-delete-files", measure(deletes, one)),
        ("total-position-deletes", measure(positions, DataFile::record_count)),
        ("total-equality-deletes", measure(equalities, DataFile::record_count)),
    ];
    let previous = head.map(|h| &h.summary().additional_properties);
    for (key, (plus, minus)) in totals {
        let value = match previous {
            None => Some(plus.saturating_sub(minus).to_string()),
            // Unchanged: carried as the head has it.
            Some(previous) if plus == 0 && minus == 0 => previous.get(key).cloned(),
            Some(previous) => previous
                .get(key)
                .and_then(|v| v.parse::<u64>().ok())
                .map(|before| before.saturating_add(plus).saturating_sub(minus).to_string()),
        };
        if let Some(value) = value {
            properties.insert(key.to_string(), value);
        }
    }
    Ok(Summary { operation: summary.operation, additional_properties: properties })
}

/// A snapshot id no snapshot of the table has (positive, random).
fn new_snapshot_id(metadata: &TableMetadata) -> i64 {
    loop {
        let (a, b) = uuid::Uuid::new_v4().as_u64_pair();
        let id = ((a ^ b) & (i64::MAX as u64)) as i64;
        if id != 0 && metadata.snapshot_by_id(id).is_none() {
            return id;
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    //! Snapshots built here and committed to in-memory table metadata (the
    //! updates applied as a catalog applies them), then read back through
    //! iceberg-rust's own manifest readers.

    use iceberg::TableIdent;
    use iceberg::io::FileIO;
    use iceberg::spec::{
        DataFileBuilder, DataFileFormat, Literal, ManifestContentType, ManifestStatus, NestedField, PrimitiveType,
        Schema, SortOrder, Struct, TableMetadataBuilder, Transform, Type, UnboundPartitionSpec,
    };

    use super::*;
    use crate::runtime::iceberg_runtime;

    fn schema() -> Schema {
        Schema::builder()
            .with_fields(vec![
                NestedField::required(1, "id", Type::Primitive(PrimitiveType::Long)).into(),
                NestedField::required(2, "day", Type::Primitive(PrimitiveType::Int)).into(),
            ])
            .build()
            .unwrap()
    }

    fn table_of(metadata: TableMetadata, io: FileIO) -> Table {
        Table::builder()
            .file_io(io)
            .metadata(metadata)
            .identifier(TableIdent::from_strs(["ns", "t"]).unwrap())
            .metadata_location("memory://wh/t/metadata/v.metadata.json")
            .runtime(iceberg_runtime())
            .build()
            .unwrap()
    }

    /// A table partitioned by `day` (spec 0), which also has spec 1,
    /// `bucket(4, id)`, that is not the default (not in format version 1,
    /// where a later spec must keep the earlier one's fields).
    fn table(version: FormatVersion) -> Table {
        let by_day =
            UnboundPartitionSpec::builder().add_partition_field(2, "day", Transform::Identity).unwrap().build();
        let by_bucket =
            UnboundPartitionSpec::builder().add_partition_field(1, "id_bucket", Transform::Bucket(4)).unwrap().build();
        let mut builder = TableMetadataBuilder::new(
            schema(),
            by_day,
            SortOrder::unsorted_order(),
            "memory://wh/t".to_string(),
            version,
            HashMap::new(),
        )
        .unwrap();
        if version != FormatVersion::V1 {
            builder = builder.add_partition_spec(by_bucket).unwrap();
        }
        let metadata = builder.build().unwrap().metadata;
        assert_eq!(metadata.default_partition_spec_id(), 0);
        assert_eq!(metadata.partition_spec_by_id(1).is_some(), version != FormatVersion::V1);
        table_of(metadata, FileIO::new_with_memory())
    }

    fn file(name: &str, content: DataContentType, spec_id: i32, part: i32, rows: u64, bytes: u64) -> DataFile {
        DataFileBuilder::default()
            .content(content)
            .file_path(format!("memory://wh/t/data/{name}.parquet"))
            .file_format(DataFileFormat::Parquet)
            .partition(Struct::from_iter([Some(Literal::int(part))]))
            .partition_spec_id(spec_id)
            .record_count(rows)
            .file_size_in_bytes(bytes)
            .build()
            .unwrap()
    }

    fn data(name: &str, day: i32, rows: u64) -> DataFile {
        file(name, DataContentType::Data, 0, day, rows, rows * 10)
    }

    fn summary(operation: Operation, props: &[(&str, &str)]) -> Summary {
        Summary {
            operation,
            additional_properties: props.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    /// The table after a catalog applied `built` (its requirements checked first).
    fn commit(table: &Table, built: Built) -> Table {
        for requirement in &built.requirements {
            requirement.check(Some(table.metadata())).unwrap();
        }
        let mut builder = table.metadata().clone().into_builder(table.metadata_location().map(str::to_string));
        for update in built.updates {
            builder = update.apply(builder).unwrap();
        }
        let metadata = builder.build().unwrap().metadata;
        assert_eq!(metadata.current_snapshot_id(), Some(built.snapshot_id));
        table_of(metadata, table.file_io().clone())
    }

    fn head(table: &Table) -> Arc<Snapshot> {
        table.metadata().current_snapshot().cloned().unwrap()
    }

    /// (file name, status, manifest content, manifest spec) of every entry of the head.
    fn entries(table: &Table) -> Vec<(String, ManifestStatus, ManifestContentType, i32)> {
        let mut out: Vec<_> = manifests_of(table, &head(table))
            .unwrap()
            .iter()
            .flat_map(|m| {
                m.entries.iter().map(|e| {
                    let name = e.file_path().rsplit('/').next().unwrap().trim_end_matches(".parquet").to_string();
                    (name, e.status(), m.file.content, m.file.partition_spec_id)
                })
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn append(table: &Table, added: &[(i32, DataFile)]) -> Table {
        append_on(table, added, manifests_of)
    }

    /// Appends `added` on the head, whose manifests `read` gives.
    fn append_on(
        table: &Table,
        added: &[(i32, DataFile)],
        read: fn(&Table, &Arc<Snapshot>) -> Result<Vec<LoadedManifest>, SinkError>,
    ) -> Table {
        let current = table.metadata().current_snapshot().cloned();
        let manifests = match &current {
            Some(h) => read(table, h).unwrap(),
            None => Vec::new(),
        };
        let built = build_snapshot(
            table,
            current.as_deref(),
            &manifests,
            &HashSet::new(),
            added,
            summary(Operation::Append, &[]),
            HashMap::new(),
        )
        .unwrap();
        commit(table, built)
    }

    fn prop<'a>(snapshot: &'a Snapshot, key: &str) -> Option<&'a str> {
        snapshot.summary().additional_properties.get(key).map(String::as_str)
    }

    /// `table` with its properties extended by `props`.
    fn with_properties(table: &Table, props: &[(&str, &str)]) -> Table {
        let builder = table.metadata().clone().into_builder(table.metadata_location().map(str::to_string));
        let updates = props.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let metadata = builder.set_properties(updates).unwrap().build().unwrap().metadata;
        table_of(metadata, table.file_io().clone())
    }

    /// Appends through the path the committer takes: the head's manifests
    /// listed, not read.
    fn append_listed(table: &Table, added: &[(i32, DataFile)]) -> Table {
        append_on(table, added, |table, head| {
            let manifests = listed(table, head)?;
            assert!(manifests.iter().all(|m| !m.loaded && m.entries.is_empty()));
            Ok(manifests)
        })
    }

    #[test]
    fn the_merge_policy_follows_the_table_properties_and_packs_small_manifests() {
        let t = table(FormatVersion::V2);
        assert_eq!(MergePolicy::of(t.metadata()), Some(MergePolicy { min_count: 100, target_bytes: 8 << 20 }));
        let off = with_properties(&t, &[(MERGE_ENABLED, "false")]);
        assert_eq!(MergePolicy::of(off.metadata()), None);
        let set = with_properties(&t, &[(MERGE_MIN_COUNT, "3"), (MERGE_TARGET_BYTES, "100")]);
        let policy = MergePolicy::of(set.metadata()).unwrap();
        assert_eq!(policy, MergePolicy { min_count: 3, target_bytes: 100 });
        // Under the count: nothing merges.
        assert!(policy.bins(2, &[10, 10]).is_empty());
        // Big ones stay; small ones pack up to the target; a bin of one stays.
        assert_eq!(policy.bins(6, &[10, 200, 50, 30, 40, 90]), vec![vec![0, 2, 3]]);
        assert!(policy.bins(4, &[60, 60, 60, 60]).is_empty(), "no two fit the target together");
        assert_eq!(policy.bins(4, &[40, 40, 40, 40]), vec![vec![0, 1], vec![2, 3]]);
    }

    /// Appends one file at a time to a table that merges once it has three
    /// manifests: the manifest list stays short, every file stays live with
    /// the snapshot and sequence number that added it, and the totals hold.
    /// A format-version-3 table's data manifests are not merged (their rows'
    /// ids would change).
    #[test]
    fn appends_merge_small_manifests_and_keep_every_file_as_it_was_added() {
        for version in [FormatVersion::V1, FormatVersion::V2, FormatVersion::V3] {
            let mut t = with_properties(&table(version), &[(MERGE_MIN_COUNT, "3")]);
            let mut added_by: Vec<(String, i64, Option<i64>)> = Vec::new();
            for i in 0..10 {
                let name = format!("f{i:02}");
                t = append_listed(&t, &[(0, data(&name, i % 2, 1 + i as u64))]);
                let h = head(&t);
                let seq = (version != FormatVersion::V1).then(|| h.sequence_number());
                added_by.push((format!("memory://wh/t/data/{name}.parquet"), h.snapshot_id(), seq));
                let manifests = manifests_of(&t, &h).unwrap();
                let most = if version == FormatVersion::V3 { i as usize + 1 } else { 3 };
                assert!(manifests.len() <= most, "{version:?} after {} appends: {} manifests", i + 1, manifests.len());
                let mut live: Vec<(String, i64, Option<i64>)> = manifests
                    .iter()
                    .flat_map(|m| m.entries.iter())
                    .filter(|e| e.is_alive())
                    .map(|e| {
                        let seq = (version != FormatVersion::V1).then(|| e.sequence_number().unwrap());
                        (e.file_path().to_string(), e.snapshot_id().unwrap(), seq)
                    })
                    .collect();
                live.sort();
                assert_eq!(live, added_by, "{version:?} after {} appends", i + 1);
                assert_eq!(prop(&h, "total-data-files"), Some((i + 1).to_string().as_str()));
                let rows: u64 = (0..=i as u64).map(|k| k + 1).sum();
                assert_eq!(prop(&h, "total-records"), Some(rows.to_string().as_str()));
            }
            // With merging off, every append keeps its own manifest.
            let mut t = with_properties(&table(version), &[(MERGE_ENABLED, "false")]);
            for i in 0..5 {
                t = append_listed(&t, &[(0, data(&format!("g{i}"), 1, 1))]);
            }
            assert_eq!(manifests_of(&t, &head(&t)).unwrap().len(), 5, "{version:?}");
        }
    }

    #[test]
    fn an_overwrite_removes_data_and_delete_files_and_adds_files_of_their_own_spec() {
        use ManifestContentType::{Data, Deletes};
        use ManifestStatus::{Added, Deleted, Existing};
        let empty = table(FormatVersion::V2);
        let (a, b, e) = (data("a", 1, 3), data("b", 2, 4), data("e", 3, 5));
        let pd = file("pd", DataContentType::PositionDeletes, 0, 1, 2, 7);
        // The first snapshot: no head, so `main` must not exist yet.
        let built = build_snapshot(
            &empty,
            None,
            &[],
            &HashSet::new(),
            &[(0, a.clone()), (0, b.clone()), (0, pd.clone())],
            summary(Operation::Append, &[]),
            HashMap::from([("sluice.committed.j.s.i".to_string(), "1".to_string())]),
        )
        .unwrap();
        assert!(
            built
                .requirements
                .contains(&TableRequirement::RefSnapshotIdMatch { r#ref: MAIN_BRANCH.to_string(), snapshot_id: None })
        );
        assert!(matches!(built.updates.last(), Some(TableUpdate::SetProperties { .. })));
        let first = commit(&empty, built);
        let s1 = head(&first);
        assert_eq!(prop(&s1, "total-data-files"), Some("2"));
        assert_eq!(prop(&s1, "total-delete-files"), Some("1"));
        assert_eq!(prop(&s1, "total-records"), Some("7"));
        assert_eq!(prop(&s1, "total-position-deletes"), Some("2"));
        assert_eq!(prop(&s1, "total-files-size"), Some("77"));
        let second = append(&first, &[(0, e.clone())]);
        let kept: Vec<String> =
            manifests_of(&second, &head(&second)).unwrap().iter().map(|m| m.file.manifest_path.clone()).collect();

        let (c, d) = (data("c", 1, 6), file("d", DataContentType::Data, 1, 2, 1, 10));
        let before = head(&second);
        let manifests = manifests_of(&second, &before).unwrap();
        let gone: HashSet<&str> = [a.file_path(), pd.file_path()].into();
        let built = build_snapshot(
            &second,
            Some(&before),
            &manifests,
            &gone,
            &[(0, c.clone()), (1, d.clone())],
            summary(Operation::Overwrite, &[("replace-partitions", "true")]),
            HashMap::from([("sluice.committed.j.s.i".to_string(), "3".to_string())]),
        )
        .unwrap();
        // Built on `before`: a table whose head moved refuses it.
        let other = append(&second, &[(0, data("x", 9, 1))]);
        assert!(built.requirements.iter().any(|r| r.check(Some(other.metadata())).is_err()));
        let third = commit(&second, built);
        assert_eq!(third.metadata().properties().get("sluice.committed.j.s.i").map(String::as_str), Some("3"));
        assert_eq!(
            entries(&third),
            [
                ("a".to_string(), Deleted, Data, 0),
                ("b".to_string(), Existing, Data, 0),
                ("c".to_string(), Added, Data, 0),
                ("d".to_string(), Added, Data, 1),
                ("e".to_string(), Added, Data, 0),
                ("pd".to_string(), Deleted, Deletes, 0),
            ]
        );
        // The manifest without a removed file is the same file; `b` keeps
        // the snapshot and sequence number that added it.
        let now = manifests_of(&third, &head(&third)).unwrap();
        assert!(now.iter().any(|m| kept.contains(&m.file.manifest_path) && m.entries[0].file_path() == e.file_path()));
        let b_entry = now.iter().flat_map(|m| m.entries.iter()).find(|x| x.file_path() == b.file_path()).unwrap();
        assert_eq!(b_entry.snapshot_id(), Some(s1.snapshot_id()));
        assert_eq!(b_entry.sequence_number(), Some(s1.sequence_number()));
        let s3 = head(&third);
        assert_eq!(s3.summary().operation, Operation::Overwrite);
        assert_eq!(s3.parent_snapshot_id(), Some(before.snapshot_id()));
        for (key, value) in [
            ("replace-partitions", "true"),
            ("added-data-files", "2"),
            ("added-records", "7"),
            ("deleted-data-files", "1"),
            ("deleted-records", "3"),
            ("removed-delete-files", "1"),
            ("removed-position-delete-files", "1"),
            ("removed-position-deletes", "2"),
            ("removed-files-size", "37"),
            ("total-data-files", "4"),
            ("total-delete-files", "0"),
            ("total-position-deletes", "0"),
            ("total-records", "16"),
        ] {
            assert_eq!(prop(&s3, key), Some(value), "{key}");
        }
    }

    #[test]
    fn a_delete_adds_nothing_and_refusals_write_nothing() {
        let first = append(&table(FormatVersion::V2), &[(0, data("a", 1, 3)), (0, data("b", 2, 4))]);
        let before = head(&first);
        let manifests = manifests_of(&first, &before).unwrap();
        let b = "memory://wh/t/data/b.parquet";
        let build = |gone: &[&'static str], added: &[(i32, DataFile)], operation| {
            let gone: HashSet<&str> = gone.iter().copied().collect();
            build_snapshot(&first, Some(&before), &manifests, &gone, added, summary(operation, &[]), HashMap::new())
        };
        let deleted = commit(&first, build(&[b], &[], Operation::Delete).unwrap());
        let s = head(&deleted);
        assert_eq!(s.summary().operation, Operation::Delete);
        assert!(s.summary().additional_properties.keys().all(|k| !k.starts_with("added-")));
        assert_eq!(prop(&s, "deleted-data-files"), Some("1"));
        assert_eq!(prop(&s, "deleted-records"), Some("4"));
        assert_eq!(prop(&s, "total-data-files"), Some("1"));
        assert_eq!(prop(&s, "total-records"), Some("3"));
        // One data manifest, rewritten; no empty manifest for new files.
        assert_eq!(manifests_of(&deleted, &s).unwrap().len(), 1);

        let not_live = build(&["memory://wh/t/data/zzz.parquet"], &[], Operation::Overwrite).unwrap_err();
        assert!(format!("{not_live:?}").contains("zzz.parquet"), "{not_live:?}");
        assert!(build(&[b], &[], Operation::Append).is_err());
        assert!(build(&[], &[(0, data("c", 1, 1))], Operation::Delete).is_err());
        assert!(build(&[], &[(7, data("c", 1, 1))], Operation::Append).is_err());
    }

    #[test]
    fn every_format_version_replaces_and_v3_assigns_row_ids() {
        for version in [FormatVersion::V1, FormatVersion::V2, FormatVersion::V3] {
            let first = append(&table(version), &[(0, data("a", 1, 3)), (0, data("b", 1, 4))]);
            let before = head(&first);
            let manifests = manifests_of(&first, &before).unwrap();
            let gone: HashSet<&str> = ["memory://wh/t/data/a.parquet", "memory://wh/t/data/b.parquet"].into();
            let built = build_snapshot(
                &first,
                Some(&before),
                &manifests,
                &gone,
                &[(0, data("ab", 1, 7))],
                summary(Operation::Replace, &[("sluice.maintenance", "compaction")]),
                HashMap::new(),
            )
            .unwrap();
            assert!(!built.updates.iter().any(|u| matches!(u, TableUpdate::SetProperties { .. })));
            let replaced = commit(&first, built);
            let s = head(&replaced);
            assert_eq!(s.summary().operation, Operation::Replace, "{version}");
            assert_eq!(prop(&s, "sluice.maintenance"), Some("compaction"));
            assert_eq!(prop(&s, "total-records"), Some("7"), "{version}");
            assert_eq!(prop(&s, "total-data-files"), Some("1"), "{version}");
            let live: Vec<String> =
                entries(&replaced).into_iter().filter(|e| e.1 != ManifestStatus::Deleted).map(|e| e.0).collect();
            assert_eq!(live, ["ab"], "{version}");
            match version {
                FormatVersion::V3 => {
                    assert_eq!(before.first_row_id(), Some(0));
                    assert_eq!(s.first_row_id(), Some(7));
                    assert_eq!(replaced.metadata().next_row_id(), 14);
                }
                _ => assert_eq!(s.first_row_id(), None),
            }
            // No delete files in a format-version-1 table.
            let pd = file("pd", DataContentType::PositionDeletes, 0, 1, 1, 1);
            let deletes = build_snapshot(
                &replaced,
                Some(&s),
                &manifests_of(&replaced, &s).unwrap(),
                &HashSet::new(),
                &[(0, pd)],
                summary(Operation::Append, &[]),
                HashMap::new(),
            );
            assert_eq!(deletes.is_err(), version == FormatVersion::V1, "{version}");
        }
    }

    #[test]
    fn totals_are_carried_from_the_head_and_absent_ones_stay_absent() {
        let metadata = table(FormatVersion::V2).metadata().clone();
        let head = |props: &[(&str, &str)]| {
            Snapshot::builder()
                .with_snapshot_id(1)
                .with_sequence_number(1)
                .with_timestamp_ms(1)
                .with_manifest_list("memory://wh/t/metadata/snap-1.avro")
                .with_schema_id(0)
                .with_summary(summary(Operation::Append, props))
                .build()
        };
        let (a, b) = ((0, data("a", 1, 3)), (0, data("b", 1, 5)));
        let old = head(&[("total-records", "10"), ("total-data-files", "2"), ("total-delete-files", "x")]);
        let (removed, added) = (std::slice::from_ref(&a), std::slice::from_ref(&b));
        let s = summarize(&metadata, "ns.t", Some(&old), removed, added, summary(Operation::Overwrite, &[])).unwrap();
        let get = |k: &str| s.additional_properties.get(k).map(String::as_str);
        assert_eq!(get("total-records"), Some("12"));
        assert_eq!(get("total-data-files"), Some("2"));
        // Unchanged: carried as the head spelled it; absent: stays absent.
        assert_eq!(get("total-delete-files"), Some("x"));
        assert_eq!(get("total-files-size"), None);
        assert_eq!(get("changed-partition-count"), Some("1"));
        // Computed counts win over a caller's key of the same name.
        let s = summarize(&metadata, "ns.t", None, &[], &[b], summary(Operation::Append, &[("added-records", "99")]))
            .unwrap();
        assert_eq!(s.additional_properties.get("added-records").map(String::as_str), Some("5"));
        assert_eq!(s.additional_properties.get("total-delete-files").map(String::as_str), Some("0"));
    }
}
