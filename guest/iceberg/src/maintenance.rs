//! Table maintenance: compaction, snapshot expiry and orphan cleanup
//! (contract 0.2.2's `maintenance` export).
//!
//! Invariants:
//! - **Compaction** rewrites small live data files of one partition (of the
//!   default spec) into files near the target size and commits them as one
//!   `replace` snapshot. Every attempt reloads the table, checks that every
//!   file it replaces is still live in the head it builds on, and commits
//!   with an `assert-ref-snapshot-id` requirement on that head, so the check
//!   and the commit are one atomic step: a concurrent append makes it
//!   conflict and it is rebuilt on the new head (the new data files are
//!   kept, only manifests are written again), and a file a concurrent
//!   compaction replaced makes it give up, deleting only what it wrote.
//!   The rows are read back in the table's current schema, so files from
//!   before a schema evolution read the added columns as null, before and
//!   after; an identity-partitioned column, which iceberg's reader hands
//!   back run-end encoded from the file's partition value, is written in
//!   its plain type again ([`plain_columns`]).
//! - **Compaction applies position deletes**: a data file that live
//!   position-delete files or a deletion vector point at is rewritten
//!   whatever its size, read whole and without the rows they delete
//!   ([`without_deleted`], checked by count), and
//!   the `replace` snapshot also removes every delete file that points at
//!   no data file left live (one pointing at a file not rewritten stays).
//!   It commits only while no delete file added since the snapshot it read
//!   points at a data file it rewrites (Java's
//!   `validateNoNewDeletesForDataFiles`), checked on the very head the
//!   commit asserts; otherwise it reads that head anew ([`ROUNDS`] times at
//!   most). Tables with equality delete files are left alone (a rewritten
//!   row would get a newer sequence number than its delete, which would no
//!   longer apply to it).
//! - **Expiry** uses iceberg's own `expire_snapshots` action, which changes
//!   only the snapshot list, never the table properties, so every
//!   `sluice.committed.*` watermark (what makes `commit` idempotent) stays.
//!   Only files that the expired snapshots referenced and no remaining
//!   snapshot references are deleted, after the expiry committed.
//! - **Orphan cleanup** removes files under the table's location that no
//!   snapshot and no metadata file of the table references, that are older
//!   than the cutoff, and that no protected combined commit (a persisted
//!   checkpoint not yet committed) names, nor any file under the folder a
//!   pending upsert checkpoint writes its position-delete files to (its
//!   `deletes_folder`: they are written at commit time, so no list of them
//!   exists before). Delete files are referenced through the snapshots'
//!   manifests exactly as data files are, for expiry too: a delete file
//!   is removed once no remaining snapshot holds it live. When a live data file of the
//!   table cannot be found in the listing (the listing spells locations
//!   another way), nothing is removed.
//! - Only the host can see other jobs' state directories, and only the
//!   table names the jobs that write it: every table whose orphans are
//!   asked for gets one note [`WRITERS_NOTE`] followed by a JSON list of
//!   the `<job>.<sink>` of every other job its `sluice.committed.*`
//!   watermarks and `sluice.claim.*` claims name, and of every other writer
//!   whose name its unreferenced data files carry ([`writer_of`]: a job
//!   whose first checkpoint is pending has committed nothing the table
//!   could name) (`[]` when none, or when the table does not exist). The
//!   host reads that note to choose the retention
//!   (`host/src/engine/maintain.rs`: a job it cannot see keeps every file
//!   younger than a floor) and shows its own words instead. A cutoff of
//!   `i64::MIN` can remove nothing: that is the host's first pass, which
//!   asks only for the names.
//!
//! iceberg-rust 0.10 has no rewrite transaction: the `replace` snapshot is
//! built by [`crate::snapshot::build_snapshot`] from its public manifest and
//! manifest-list writers, the way its `fast_append` builds an append
//! (`transaction::snapshot`, which is crate-private).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{DataType, Schema};
use futures::TryStreamExt;
use iceberg::arrow::ArrowReaderBuilder;
use iceberg::scan::FileScanTask;
use iceberg::spec::{
    DataContentType, DataFile, DataFileFormat, ManifestContentType, Operation, PartitionKey, PartitionSpecRef,
    SchemaRef, Snapshot, Struct, Summary, TableMetadata,
};
use iceberg::table::Table;
use iceberg::transaction::{ApplyTransactionAction, Transaction};
use iceberg::writer::base_writer::data_file_writer::DataFileWriterBuilder;
use iceberg::writer::file_writer::location_generator::{DefaultFileNameGenerator, DefaultLocationGenerator};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::{IcebergWriter as _, IcebergWriterBuilder};
use iceberg::{TableIdent, TableRequirement};
use sluice_guest_sdk::bindings::sluice::connector::file_io as fio;
use sluice_guest_sdk::bindings::sluice::connector::iceberg_catalog::CatalogError;
use sluice_guest_sdk::{Expiry, MaintainRequest, Orphans, SinkContext, SinkError, TableReport, error, log};

use crate::config::Config;
use crate::host_io::{self, LoadError, PinnedCatalog, catalog_message};
use crate::host_parquet::{HostParquetWriterBuilder, SharedHostFiles};
use crate::runtime::{block_on, iceberg_runtime};
use crate::snapshot::{Built, LoadedManifest, build_snapshot, manifests_cached, manifests_of};
use crate::writer::{iceberg_error, parquet_options};

/// How many times a compaction or an expiry is rebuilt on a newer head
/// after a conflict before it gives up (leaving the table as it was).
const ATTEMPTS: u32 = 30;

/// Snapshot summary key marking a snapshot made by maintenance.
const SUMMARY_MAINTENANCE: &str = "sluice.maintenance";

/// The note naming the other writers of a table, followed by a JSON list
/// of `<job>.<sink>` (the host's `maintain.rs` reads it by this prefix).
const WRITERS_NOTE: &str = "other writers named by the table (job.sink): ";

pub fn maintain(
    ctx: SinkContext,
    options: Vec<(String, String)>,
    request: MaintainRequest,
) -> Result<Vec<TableReport>, SinkError> {
    let cfg = Config::parse(options)?;
    let mut seen = HashSet::new();
    let mut reports = Vec::new();
    // A step that fails stops neither the table's other steps nor the
    // other tables (each step leaves its table valid); the first failure
    // is the call's answer, with what the other steps did.
    let mut failed: Option<SinkError> = None;
    for name in &request.tables {
        let ident = cfg.ident(name)?;
        if !seen.insert(ident.to_string()) {
            continue;
        }
        let mut report = TableReport {
            target: ident.to_string(),
            files_compacted: 0,
            files_written: 0,
            rows_rewritten: 0,
            snapshots_expired: 0,
            files_removed: Vec::new(),
            notes: Vec::new(),
        };
        match block_on(host_io::load_table(&ident)) {
            Ok(_) => {}
            Err(LoadError::NotFound(_)) => {
                report.notes.push("the table does not exist (yet): nothing to do".to_string());
                if request.orphans.is_some() {
                    report.notes.push(writers_note(&[]));
                }
                reports.push(report);
                continue;
            }
            Err(e) => {
                failed.get_or_insert(e.into_sink_error(&ident));
                continue;
            }
        }
        if let Some(compaction) = &request.compaction
            && let Err(e) = compact(&cfg, &ctx, &ident, compaction.target_file_bytes, request.dry_run, &mut report)
        {
            failed.get_or_insert(e);
        }
        if let Some(expiry) = &request.expiry
            && let Err(e) =
                expire(&ident, &asked(expiry), request.dry_run, ATTEMPTS, &mut References::default(), &mut report)
        {
            failed.get_or_insert(e);
        }
        if let Some(orphans) = &request.orphans
            && let Err(e) = remove_orphans(&ident, orphans, request.dry_run, &mut report)
        {
            failed.get_or_insert(e);
        }
        reports.push(report);
    }
    match failed {
        None => Ok(reports),
        Some(e) => Err(with_done(e, &reports)),
    }
}

/// `e` with what the call's other steps did (they stay done).
fn with_done(e: SinkError, reports: &[TableReport]) -> SinkError {
    let sum = |f: fn(&TableReport) -> u64| reports.iter().map(f).sum::<u64>();
    let done = format!(
        " (the other steps ran: {} file(s) compacted, {} snapshot(s) expired, {} file(s) removed)",
        sum(|r| r.files_compacted),
        sum(|r| r.snapshots_expired),
        sum(|r| r.files_removed.len() as u64)
    );
    match e {
        SinkError::Config(m) => SinkError::Config(m + &done),
        SinkError::InvalidData(m) => SinkError::InvalidData(m + &done),
        SinkError::Retryable(m) => SinkError::Retryable(m + &done),
        SinkError::Fatal(m) => SinkError::Fatal(m + &done),
    }
}

fn load(ident: &TableIdent) -> Result<Table, SinkError> {
    block_on(host_io::load_table(ident)).map_err(|e| e.into_sink_error(ident))
}

/// Where a location points, spelled one way (`file://` dropped).
fn norm(location: &str) -> &str {
    location.strip_prefix("file://").unwrap_or(location)
}

// ---------------------------------------------------------------- compaction

/// A set of small files of one partition, rewritten together.
struct Bin {
    partition: Struct,
    files: Vec<DataFile>,
}

/// Groups the current snapshot's small live data files, and those that live
/// position deletes point at whatever their size, by partition and packs
/// them into bins of about `target` bytes; only bins of two or more files,
/// or holding a file with deletes (rewriting it drops them), are worth
/// rewriting.
fn plan_bins(
    table: &Table,
    manifests: &[LoadedManifest],
    target: u64,
    deletes: &LiveDeletes,
) -> (Vec<Bin>, Vec<String>) {
    let metadata = table.metadata();
    let spec_id = metadata.default_partition_spec_id();
    let mut notes = Vec::new();
    let mut by_partition: BTreeMap<String, (Struct, Vec<DataFile>)> = BTreeMap::new();
    let mut other_specs = 0usize;
    for m in manifests {
        for entry in &m.entries {
            if !entry.is_alive() || entry.content_type() != DataContentType::Data {
                continue;
            }
            let file = entry.data_file();
            let deleted = deletes.positions.contains_key(file.file_path());
            if file.file_format() != DataFileFormat::Parquet || (file.file_size_in_bytes() >= target && !deleted) {
                continue;
            }
            if m.file.partition_spec_id != spec_id {
                other_specs += 1;
                continue;
            }
            let key = format!("{:?}", file.partition());
            by_partition.entry(key).or_insert_with(|| (file.partition().clone(), Vec::new())).1.push(file.clone());
        }
    }
    if other_specs > 0 {
        notes.push(format!("{other_specs} small file(s) of an older partition spec were left as they are"));
    }
    let mut bins = Vec::new();
    for (_, (partition, mut files)) in by_partition {
        // Largest first, each into the first bin it fits (first-fit decreasing).
        files.sort_by_key(|f| std::cmp::Reverse(f.file_size_in_bytes()));
        let mut packed: Vec<(u64, Vec<DataFile>)> = Vec::new();
        for file in files {
            let size = file.file_size_in_bytes();
            match packed.iter_mut().find(|(sum, _)| sum + size <= target) {
                Some((sum, bin)) => {
                    *sum += size;
                    bin.push(file);
                }
                None => packed.push((size, vec![file])),
            }
        }
        for (_, files) in packed {
            if files.len() >= 2 || files.iter().any(|f| deletes.positions.contains_key(f.file_path())) {
                bins.push(Bin { partition: partition.clone(), files });
            }
        }
    }
    (bins, notes)
}

/// The first live equality delete file of a snapshot: such a table is not
/// compacted (a rewritten row gets a newer sequence number than an
/// equality delete, which then no longer applies to it).
fn equality_deletes(manifests: &[LoadedManifest]) -> Option<&str> {
    manifests
        .iter()
        .filter(|m| m.file.content == ManifestContentType::Deletes)
        .flat_map(|m| m.entries.iter())
        .find(|e| e.is_alive() && e.content_type() == DataContentType::EqualityDeletes)
        .map(|e| e.file_path())
}

/// The live position-delete files of one snapshot, read.
#[derive(Default)]
struct LiveDeletes {
    /// Each delete file (with the spec of its manifest) and the data files it points at.
    files: Vec<(i32, DataFile, HashSet<String>)>,
    /// Data file → the positions deleted in it.
    positions: HashMap<String, HashSet<u64>>,
}

impl LiveDeletes {
    /// Reads every live position-delete file of `manifests`: Parquet
    /// position deletes and format-version-3 deletion vectors (Puffin).
    fn read(table: &Table, manifests: &[LoadedManifest]) -> Result<Self, SinkError> {
        let mut out = Self::default();
        for m in manifests.iter().filter(|m| m.file.content == ManifestContentType::Deletes) {
            for entry in m.entries.iter().filter(|e| e.is_alive()) {
                let file = entry.data_file();
                if file.content_type() != DataContentType::PositionDeletes {
                    continue;
                }
                let mut targets = HashSet::new();
                if crate::deletion_vectors::is_vector(file) {
                    let (path, positions) = crate::deletion_vectors::read(table.file_io(), file)?;
                    out.positions.entry(path.clone()).or_default().extend(positions.iter());
                    targets.insert(path);
                } else {
                    for (path, pos) in crate::position_deletes::read(table.file_io(), file)? {
                        out.positions.entry(path.clone()).or_default().insert(pos);
                        targets.insert(path);
                    }
                }
                out.files.push((m.file.partition_spec_id, file.clone(), targets));
            }
        }
        Ok(out)
    }

    /// How many rows of `file` its deletes delete (positions past its end delete nothing).
    fn deleted_in(&self, file: &DataFile) -> u64 {
        self.positions
            .get(file.file_path())
            .map_or(0, |p| p.iter().filter(|pos| **pos < file.record_count()).count() as u64)
    }
}

/// The data files a position-delete file points at: the one it names in
/// `referenced_data_file` (always, for a deletion vector), else every
/// `file_path` it holds (read).
fn targets_of(table: &Table, file: &DataFile) -> Result<HashSet<String>, SinkError> {
    if let Some(one) = file.referenced_data_file() {
        return Ok(HashSet::from([one]));
    }
    Ok(crate::position_deletes::read(table.file_io(), file)?.into_iter().map(|(path, _)| path).collect())
}

/// Reads the rows of `bin` in the table's current schema and writes them as
/// new data files of its partition, near `target` bytes each.
fn rewrite(
    cfg: &Config,
    ctx: &SinkContext,
    table: &Table,
    bin: &Bin,
    target: u64,
    deletes: &LiveDeletes,
) -> Result<Vec<DataFile>, SinkError> {
    let metadata = table.metadata();
    let schema = metadata.current_schema().clone();
    let spec = metadata.default_partition_spec().clone();
    let field_ids: Vec<i32> = schema.as_struct().fields().iter().map(|f| f.id).collect();
    let prefix = format!(
        "compact-{}.{}-{}",
        sluice_guest_sdk::incarnation::key(ctx),
        ctx.attempt,
        uuid::Uuid::new_v4().simple()
    );
    let names = DefaultFileNameGenerator::new(prefix, None, DataFileFormat::Parquet);
    let locations =
        DefaultLocationGenerator::new(metadata).map_err(|e| iceberg_error("choosing data file locations", e))?;
    let files = SharedHostFiles::default();
    let parquet = HostParquetWriterBuilder::new(parquet_options(cfg, 1), schema.clone(), files.clone())
        .map_err(|e| iceberg_error("preparing the Parquet writer", e))?;
    // The guest is 32-bit: a target past `usize` is refused, never cut short.
    let target_bytes = usize::try_from(target)
        .map_err(|_| error::config(format!("a target file size of {target} bytes is too large (at most 4095 MiB)")))?;
    let rolling = RollingFileWriterBuilder::new(parquet, target_bytes, table.file_io().clone(), locations, names);
    let key = (!spec.is_unpartitioned())
        .then(|| PartitionKey::new(spec.as_ref().clone(), schema.clone(), bin.partition.clone()));
    let budget = (cfg.buffer_bytes as u64) * crate::writer::HOST_SHARE.0 / crate::writer::HOST_SHARE.1;
    // Each file is read alone, with no delete applied, so a row's position
    // is its ordinal, and the rows its live deletes name are left out here:
    // iceberg 0.10's reader applies Parquet position deletes but not
    // deletion vectors (its delete loader says "Del Vec (Not yet
    // Implemented)"), and one rule for both keeps them consistent.
    let written = block_on(async {
        let mut writer = DataFileWriterBuilder::new(rolling).build(key).await?;
        for file in &bin.files {
            let reader = ArrowReaderBuilder::new(table.file_io().clone(), iceberg_runtime())
                .with_data_file_concurrency_limit(1)
                .build();
            let task = scan_task(file, &schema, &field_ids, &spec);
            let mut stream = reader.read(Box::pin(futures::stream::iter([Ok(task)])))?.stream();
            let gone = deletes.positions.get(file.file_path());
            let mut pos = 0u64;
            while let Some(batch) = stream.try_next().await? {
                let rows = batch.num_rows() as u64;
                let kept = match gone {
                    Some(gone) => without_deleted(batch, pos, gone)?,
                    None => batch,
                };
                pos += rows;
                if kept.num_rows() > 0 {
                    writer.write(plain_columns(kept)?).await?;
                }
                files.lock().keep_within(budget).map_err(|m| iceberg::Error::new(iceberg::ErrorKind::Unexpected, m))?;
            }
            if pos != file.record_count() {
                return Err(iceberg::Error::new(
                    iceberg::ErrorKind::DataInvalid,
                    format!("data file {} holds {} rows, and {pos} were read", file.file_path(), file.record_count()),
                ));
            }
        }
        writer.close().await
    })
    .map_err(|e| iceberg_error(&format!("rewriting data files of table {}", table.identifier()), e))?;
    // Every row read is written but the deleted ones.
    let before: u64 = bin.files.iter().map(DataFile::record_count).sum();
    let deleted: u64 = bin.files.iter().map(|f| deletes.deleted_in(f)).sum();
    let after: u64 = written.iter().map(DataFile::record_count).sum();
    if before - deleted != after {
        delete_all(&written);
        return Err(error::fatal(format!(
            "compacting table {}: read {after} row(s) back from {} file(s) that hold {before}, {deleted} of them \
             deleted; nothing was committed",
            table.identifier(),
            bin.files.len()
        )));
    }
    Ok(written)
}

/// The task reading every column `field_ids` of `file` (of partition spec
/// `spec`) in `schema`, whole and with no delete applied.
fn scan_task(file: &DataFile, schema: &SchemaRef, field_ids: &[i32], spec: &PartitionSpecRef) -> FileScanTask {
    FileScanTask::builder()
        .with_file_size_in_bytes(file.file_size_in_bytes())
        .with_start(0)
        .with_length(file.file_size_in_bytes())
        .with_record_count(Some(file.record_count()))
        .with_data_file_path(file.file_path().to_string())
        .with_data_file_format(DataFileFormat::Parquet)
        .with_schema(schema.clone())
        .with_project_field_ids(field_ids.to_vec())
        .with_partition(Some(file.partition().clone()))
        .with_partition_spec(Some(spec.clone()))
        .with_case_sensitive(true)
        .build()
}

/// The rows of `batch` (whose first row is at position `first` of its
/// data file) whose positions are not in `gone`.
fn without_deleted(batch: RecordBatch, first: u64, gone: &HashSet<u64>) -> iceberg::Result<RecordBatch> {
    let keep: arrow_array::BooleanArray =
        (first..first + batch.num_rows() as u64).map(|p| Some(!gone.contains(&p))).collect();
    arrow_select::filter::filter_record_batch(&batch, &keep).map_err(|e| {
        iceberg::Error::new(iceberg::ErrorKind::Unexpected, format!("leaving deleted rows out of a batch: {e}"))
    })
}

/// `batch` with every run-end-encoded column cast to the type of its
/// values. iceberg's reader fills an identity-partitioned column from the
/// file's partition value as a run-end-encoded constant
/// (`arrow::record_batch_transformer`), but the table schema, and so the
/// Parquet writer, has the plain type: without this, no file of a table
/// partitioned by `identity(...)` could be compacted.
fn plain_columns(batch: RecordBatch) -> iceberg::Result<RecordBatch> {
    let schema = batch.schema();
    if !schema.fields().iter().any(|f| matches!(f.data_type(), DataType::RunEndEncoded(_, _))) {
        return Ok(batch);
    }
    let invalid = |e: arrow_schema::ArrowError| {
        iceberg::Error::new(iceberg::ErrorKind::DataInvalid, format!("decoding an identity-partitioned column: {e}"))
    };
    let mut fields = Vec::with_capacity(schema.fields().len());
    let mut columns = Vec::with_capacity(batch.num_columns());
    for (field, column) in schema.fields().iter().zip(batch.columns()) {
        if let DataType::RunEndEncoded(_, values) = field.data_type() {
            columns.push(arrow_cast::cast(column, values.data_type()).map_err(invalid)?);
            fields.push(Arc::new(field.as_ref().clone().with_data_type(values.data_type().clone())));
        } else {
            columns.push(column.clone());
            fields.push(field.clone());
        }
    }
    let plain = Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()));
    RecordBatch::try_new(plain, columns).map_err(invalid)
}

fn delete_all(files: &[DataFile]) {
    for file in files {
        // Best effort: never committed, so nobody reads them (and orphan cleanup would find them).
        let _ = fio::delete(file.file_path());
    }
}

/// How many times a compaction reads its files anew from a newer head,
/// after delete files pointing at files it rewrote were committed meanwhile.
const ROUNDS: u32 = 3;

fn compact(
    cfg: &Config,
    ctx: &SinkContext,
    ident: &TableIdent,
    target: u64,
    dry_run: bool,
    report: &mut TableReport,
) -> Result<(), SinkError> {
    for round in 0..ROUNDS {
        let table = load(ident)?;
        let Some(snapshot) = table.metadata().current_snapshot().cloned() else { return Ok(()) };
        let manifests = manifests_of(&table, &snapshot)?;
        if let Some(file) = equality_deletes(&manifests) {
            report.notes.push(format!("the table has equality delete file {file}: compaction left it alone"));
            return Ok(());
        }
        let deletes = LiveDeletes::read(&table, &manifests)?;
        let (bins, notes) = plan_bins(&table, &manifests, target, &deletes);
        if round == 0 {
            report.notes.extend(notes);
        }
        if bins.is_empty() {
            return Ok(());
        }
        if dry_run {
            let files: usize = bins.iter().map(|b| b.files.len()).sum();
            report.notes.push(format!("would compact {files} file(s) in {} group(s)", bins.len()));
            return Ok(());
        }
        let mut replaced = Vec::new();
        let mut written = Vec::new();
        for bin in &bins {
            match rewrite(cfg, ctx, &table, bin, target, &deletes) {
                Ok(files) => {
                    replaced.extend(bin.files.iter().cloned());
                    written.extend(files);
                }
                Err(e) => {
                    delete_all(&written);
                    return Err(e);
                }
            }
        }
        // The delete files that point at no data file left live: those of
        // rewritten files only (their rows are gone from the new files), and
        // any whose data files an earlier replace removed. One that still
        // points at a file not rewritten stays.
        let rewritten: HashSet<&str> = replaced.iter().map(DataFile::file_path).collect();
        let live_data: HashSet<&str> = manifests
            .iter()
            .flat_map(|m| m.entries.iter())
            .filter(|e| e.is_alive() && e.content_type() == DataContentType::Data)
            .map(|e| e.file_path())
            .collect();
        let dropped: Vec<&DataFile> = deletes
            .files
            .iter()
            .filter(|(_, _, targets)| {
                targets.iter().all(|t| rewritten.contains(t.as_str()) || !live_data.contains(t.as_str()))
            })
            .map(|(_, file, _)| file)
            .collect();
        let base = Base {
            data: &replaced,
            deletes: dropped.clone(),
            live_deletes: deletes.files.iter().map(|(_, f, _)| f.file_path().to_string()).collect(),
        };
        // Set once a commit attempt was sent whose outcome could not be
        // settled: the new files may then be in the table (a reply lost, a
        // REST commit that lands late), so they are never deleted here;
        // orphan cleanup removes them once no snapshot names them.
        let mut uncertain = false;
        let spec_id = table.metadata().default_partition_spec_id();
        match commit_replace(ident, &base, &written, spec_id, &mut uncertain) {
            Ok(Replaced::Committed) => {
                report.files_compacted += replaced.len() as u64;
                report.files_written += written.len() as u64;
                report.rows_rewritten += written.iter().map(DataFile::record_count).sum::<u64>();
                if !dropped.is_empty() {
                    report.notes.push(format!(
                        "applied and removed {} delete file(s) ({} deleted row(s) left out)",
                        dropped.len(),
                        replaced.iter().map(|f| deletes.deleted_in(f)).sum::<u64>()
                    ));
                }
                log::info(&format!(
                    "table {ident}: compacted {} data file(s) into {}, removing {} delete file(s)",
                    replaced.len(),
                    written.len(),
                    dropped.len()
                ));
                return Ok(());
            }
            Ok(Replaced::Stale) if !uncertain && round + 1 < ROUNDS => {
                delete_all(&written);
                log::info(&format!(
                    "table {ident}: rows the compaction rewrote were deleted meanwhile; reading them anew"
                ));
            }
            Ok(Replaced::Stale | Replaced::Gone) => {
                keep_or_delete(ident, &written, uncertain);
                report.notes.push(
                    "another writer replaced some of the files, deleted rows of them or changed the partition spec \
                     meanwhile: this compaction committed nothing"
                        .to_string(),
                );
                return Ok(());
            }
            Err(e) => {
                keep_or_delete(ident, &written, uncertain);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Deletes the files of a compaction that did not commit, unless an
/// attempt's outcome stayed unknown (then they are left to orphan cleanup,
/// which removes them only once no snapshot names them).
fn keep_or_delete(ident: &TableIdent, written: &[DataFile], uncertain: bool) {
    if uncertain {
        log::warn(&format!(
            "table {ident}: a compaction commit's outcome stayed unknown; its {} new file(s) are kept \
             (orphan cleanup removes them if no snapshot names them)",
            written.len()
        ));
    } else {
        delete_all(written);
    }
}

/// What a compaction read and replaces, as of the snapshot it read.
struct Base<'a> {
    /// The data files rewritten.
    data: &'a [DataFile],
    /// The delete files removed (they point at no data file left live).
    deletes: Vec<&'a DataFile>,
    /// Every live delete file of the snapshot read.
    live_deletes: HashSet<String>,
}

/// How [`commit_replace`] ended.
enum Replaced {
    Committed,
    /// Nothing committed: a file it replaces is no longer live, the table
    /// gained equality deletes, or its default spec changed.
    Gone,
    /// Nothing committed: a delete file committed since the base points at
    /// a rewritten data file (the new files would bring its rows back); a
    /// rewrite from the new head may commit.
    Stale,
}

/// Commits `base` → `written` as one `replace` snapshot, rebuilt on the
/// newest head after each conflict, and only while no delete file added
/// since the base points at a data file it rewrites (Java's
/// `validateNoNewDeletesForDataFiles`): every attempt reads the new delete
/// files of its head, and the head is asserted by the commit, so the check
/// and the commit are one atomic step. `uncertain` is set once an attempt
/// was sent whose outcome is unknown: only a snapshot of ours seen in the
/// table settles it (as committed).
fn commit_replace(
    ident: &TableIdent,
    base: &Base<'_>,
    written: &[DataFile],
    spec_id: i32,
    uncertain: &mut bool,
) -> Result<Replaced, SinkError> {
    let rewritten: HashSet<&str> = base.data.iter().map(DataFile::file_path).collect();
    let mut gone = rewritten.clone();
    gone.extend(base.deletes.iter().map(|f| f.file_path()));
    // Snapshots sent whose outcome is unknown: one of them may land late.
    let mut sent: Vec<i64> = Vec::new();
    let mut cache = HashMap::new();
    // Delete files of later heads known to point at no rewritten file.
    let mut checked: HashSet<String> = HashSet::new();
    let mut last = String::new();
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(50 * u64::from(attempt.min(10))));
        }
        let table = load(ident)?;
        if sent.iter().any(|id| table.metadata().snapshot_by_id(*id).is_some()) {
            return Ok(Replaced::Committed);
        }
        if table.metadata().default_partition_spec_id() != spec_id {
            return Ok(Replaced::Gone);
        }
        let Some(head) = table.metadata().current_snapshot().cloned() else { return Ok(Replaced::Gone) };
        let manifests = manifests_cached(&table, &head, &mut cache)?;
        if equality_deletes(&manifests).is_some() {
            return Ok(Replaced::Gone);
        }
        let live: HashSet<&str> =
            manifests.iter().flat_map(|m| m.entries.iter()).filter(|e| e.is_alive()).map(|e| e.file_path()).collect();
        if !gone.iter().all(|f| live.contains(f)) {
            return Ok(Replaced::Gone);
        }
        for m in manifests.iter().filter(|m| m.file.content == ManifestContentType::Deletes) {
            for entry in m.entries.iter().filter(|e| e.is_alive()) {
                let path = entry.file_path();
                if base.live_deletes.contains(path) || checked.contains(path) {
                    continue;
                }
                if targets_of(&table, entry.data_file())?.iter().any(|t| rewritten.contains(t.as_str())) {
                    return Ok(Replaced::Stale);
                }
                checked.insert(path.to_string());
            }
        }
        let added: Vec<(i32, DataFile)> = written.iter().map(|f| (spec_id, f.clone())).collect();
        let summary = Summary {
            operation: Operation::Replace,
            additional_properties: HashMap::from([(SUMMARY_MAINTENANCE.to_string(), "compaction".to_string())]),
        };
        let Built { snapshot_id: snapshot, mut requirements, updates } =
            build_snapshot(&table, Some(&head), &manifests, &gone, &added, summary, HashMap::new())?;
        // The partition spec the new files were written for, checked by the
        // catalog in the same atomic step as the head.
        requirements.push(TableRequirement::DefaultSpecIdMatch { default_spec_id: spec_id });
        match host_io::commit_updates(ident, &requirements, &updates) {
            Ok(()) => return Ok(Replaced::Committed),
            Err(CatalogError::Conflict(m)) => {
                last = m;
            }
            Err(CatalogError::UnknownOutcome(m)) => {
                *uncertain = true;
                sent.push(snapshot);
                // Settled by the table itself if our snapshot is there; if
                // not (or the table cannot be read now), the next attempt
                // looks again before it builds anew.
                if load(ident).is_ok_and(|now| now.metadata().snapshot_by_id(snapshot).is_some()) {
                    return Ok(Replaced::Committed);
                }
                last = m;
            }
            Err(e) => {
                // Not a conflict: the catalog may have applied it anyway.
                *uncertain = true;
                return Err(error::retryable(format!(
                    "committing the compaction of table {ident}: {}",
                    catalog_message(&e)
                )));
            }
        }
    }
    let outcome = if *uncertain {
        "an attempt's outcome is unknown, so its new files are kept for orphan cleanup"
    } else {
        "the table is as it was"
    };
    Err(error::retryable(format!(
        "committing the compaction of table {ident}: it conflicted {ATTEMPTS} times with other writers ({last}); {outcome}"
    )))
}

// -------------------------------------------------------------------- expiry

/// The files snapshots reference, read once per manifest: a manifest is
/// never changed once written, so its live data files are cached by its
/// location (a table of N snapshots shares most manifests between them).
/// The manifest lists are cached too (by location, the manifests each
/// names), for the committer's retention, which keeps one `References`
/// across its expiries and prunes it to what the table still references.
#[derive(Default)]
pub(crate) struct References {
    live_in: HashMap<String, Vec<String>>,
    lists: HashMap<String, Vec<String>>,
}

impl References {
    /// Every file `snapshots` reference: their manifest lists, their
    /// manifests and the files live in those, each distinct manifest read
    /// (and its files gathered) once however many snapshots name it.
    fn all_of<'a>(
        &mut self,
        table: &Table,
        snapshots: impl Iterator<Item = &'a Arc<Snapshot>>,
    ) -> Result<HashSet<String>, SinkError> {
        let context = || format!("reading the manifests of table {}", table.identifier());
        let mut out = HashSet::new();
        let mut manifests: HashSet<String> = HashSet::new();
        for snapshot in snapshots {
            let list_path = norm(snapshot.manifest_list()).to_string();
            if !self.lists.contains_key(&list_path) {
                let list =
                    block_on(table.manifest_list_reader(snapshot).load()).map_err(|e| iceberg_error(&context(), e))?;
                let mut paths = Vec::new();
                for file in list.consume_entries() {
                    paths.push(self.load_live(table, &file, &context)?);
                }
                self.lists.insert(list_path.clone(), paths);
            }
            if let Some(paths) = self.lists.get(&list_path) {
                manifests.extend(paths.iter().cloned());
            }
            out.insert(list_path);
        }
        for manifest in manifests {
            if let Some(live) = self.live_in.get(&manifest) {
                out.extend(live.iter().cloned());
            }
            out.insert(manifest);
        }
        Ok(out)
    }

    /// The path of manifest `file`, with the data files live in it read
    /// into `live_in` unless they are there already.
    fn load_live(
        &mut self,
        table: &Table,
        file: &iceberg::spec::ManifestFile,
        context: &dyn Fn() -> String,
    ) -> Result<String, SinkError> {
        let path = norm(&file.manifest_path).to_string();
        if !self.live_in.contains_key(&path) {
            let manifest = block_on(file.load_manifest(table.file_io())).map_err(|e| iceberg_error(&context(), e))?;
            let (entries, _) = manifest.into_parts();
            let live = entries.iter().filter(|e| e.is_alive()).map(|e| norm(e.file_path()).to_string()).collect();
            self.live_in.insert(path.clone(), live);
        }
        Ok(path)
    }

    /// Forgets every manifest list and manifest `table`'s snapshots do not
    /// name (they are never named again: a new snapshot names new lists).
    fn prune(&mut self, table: &Table) {
        let lists: HashSet<String> =
            table.metadata().snapshots().map(|s| norm(s.manifest_list()).to_string()).collect();
        self.lists.retain(|path, _| lists.contains(path));
        let manifests: HashSet<&String> = self.lists.values().flatten().collect();
        let keep: HashSet<String> = manifests.into_iter().cloned().collect();
        self.live_in.retain(|path, _| keep.contains(path));
    }

    /// Every file `snapshot` references: its manifest list, its manifests,
    /// and the data files live in it. A file a manifest marks deleted is
    /// not read through this snapshot; while it is live in a kept
    /// ancestor, that ancestor references it.
    fn of(&mut self, table: &Table, snapshot: &Arc<Snapshot>) -> Result<HashSet<String>, SinkError> {
        let mut out = HashSet::from([norm(snapshot.manifest_list()).to_string()]);
        let context = || format!("reading the manifests of table {}", table.identifier());
        let list = block_on(table.manifest_list_reader(snapshot).load()).map_err(|e| iceberg_error(&context(), e))?;
        for file in list.consume_entries() {
            let path = self.load_live(table, &file, &context)?;
            if let Some(live) = self.live_in.get(&path) {
                out.extend(live.iter().cloned());
            }
            out.insert(path);
        }
        Ok(out)
    }
}

/// What one expiry attempt asks iceberg's `expire_snapshots` for, chosen
/// on the table as that attempt loaded it.
pub(crate) struct Chosen {
    pub(crate) older_than_ms: Option<i64>,
    pub(crate) keep_last: Option<u32>,
    /// Snapshots expired by id, besides what the age and count select.
    pub(crate) ids: Vec<i64>,
}

/// The snapshots `expiry` (of `sluice maintain`) names.
fn asked(expiry: &Expiry) -> impl Fn(&Table) -> Option<Chosen> + '_ {
    |_| Some(Chosen { older_than_ms: expiry.older_than_ms, keep_last: expiry.keep_last, ids: Vec::new() })
}

/// Expires the snapshots `choose` picks on the loaded table (`None`:
/// nothing to expire), committing at most `attempts` times; deletes the
/// files only they referenced once the expiry is committed (found by
/// comparing the table before and after, so an unknown outcome is settled
/// too). An expiry that still conflicts at its last attempt changed
/// nothing, and that is not an error: the report notes it, and the
/// committer's retention, for one, tries again after its next commit.
pub(crate) fn expire(
    ident: &TableIdent,
    choose: &dyn Fn(&Table) -> Option<Chosen>,
    dry_run: bool,
    attempts: u32,
    refs: &mut References,
    report: &mut TableReport,
) -> Result<(), SinkError> {
    if dry_run {
        report.notes.push("a dry run expires no snapshots".to_string());
        return Ok(());
    }
    let mut last = String::new();
    for attempt in 0..attempts {
        if attempt > 0 {
            std::thread::sleep(std::time::Duration::from_millis(50 * u64::from(attempt.min(10))));
        }
        let before = load(ident)?;
        let Some(chosen) = choose(&before) else { return Ok(()) };
        let tx = Transaction::new(&before);
        let mut action = tx.expire_snapshots();
        if let Some(older) = chosen.older_than_ms {
            action = action.expire_older_than_ms(older);
        }
        if let Some(keep) = chosen.keep_last {
            action = action.retain_last(keep.max(1) as usize);
        }
        if !chosen.ids.is_empty() {
            action = action.expire_snapshot_ids(chosen.ids);
        }
        let tx = action.apply(tx).map_err(|e| iceberg_error("planning the snapshot expiry", e))?;
        let catalog = PinnedCatalog::new(before.clone());
        let result = block_on(tx.commit(&catalog));
        match (result, catalog.verdict()) {
            (Ok(_), _) | (Err(_), Some(Ok(()))) => {}
            (Err(e), None) => return Err(iceberg_error(&format!("expiring snapshots of table {ident}"), e)),
            (Err(_), Some(Err(CatalogError::Conflict(m) | CatalogError::UnknownOutcome(m)))) => {
                // An unknown outcome is settled below: the removed snapshots
                // are found by comparing the table before and after.
                last = m;
            }
            (Err(_), Some(Err(e))) => {
                return Err(error::retryable(format!("expiring snapshots of table {ident}: {}", catalog_message(&e))));
            }
        }
        let after = load(ident)?;
        let remaining: HashSet<i64> = after.metadata().snapshots().map(|s| s.snapshot_id()).collect();
        let removed: Vec<Arc<Snapshot>> =
            before.metadata().snapshots().filter(|s| !remaining.contains(&s.snapshot_id())).cloned().collect();
        if removed.is_empty() {
            if !last.is_empty() && attempt + 1 < attempts {
                continue;
            }
            if !last.is_empty() {
                report.notes.push(format!("the expiry conflicted with another commit and changed nothing ({last})"));
            }
            return Ok(());
        }
        // A file that cannot be read here was deleted by another expiry
        // running at the same time (a job's retention beside `sluice
        // maintain`): then nothing is deleted by this one, and what it would
        // have deleted is left to orphan cleanup.
        let both = refs
            .all_of(&before, removed.iter())
            .and_then(|c| Ok((c, refs.all_of(&after, after.metadata().snapshots())?)));
        let (mut candidates, kept) = match both {
            Ok(both) => both,
            Err(SinkError::Config(m) | SinkError::InvalidData(m) | SinkError::Retryable(m) | SinkError::Fatal(m)) => {
                report.snapshots_expired += removed.len() as u64;
                report.notes.push(format!(
                    "expired {} snapshot(s) but deleted none of their files, as another expiry was deleting them at \
                     the same time ({m}); orphan cleanup removes what is left",
                    removed.len()
                ));
                *refs = References::default();
                return Ok(());
            }
        };
        candidates.retain(|f| !kept.contains(f));
        refs.prune(&after);
        report.snapshots_expired += removed.len() as u64;
        let mut gone: Vec<String> = candidates.into_iter().collect();
        gone.sort();
        for location in gone {
            match fio::delete(&location) {
                Ok(()) | Err(fio::IoError::NotFound(_)) => report.files_removed.push(location),
                Err(e) => {
                    report.notes.push(format!("could not remove {location}: {}", sluice_guest_sdk::files::describe(&e)))
                }
            }
        }
        log::info(&format!("table {ident}: expired {} snapshot(s)", removed.len()));
        return Ok(());
    }
    Err(error::retryable(format!("expiring snapshots of table {ident}: it conflicted {attempts} times ({last})")))
}

// ------------------------------------------------------------------- orphans

/// The data files a combined commit of this plugin names. One this plugin
/// cannot read is an error, never "no files": orphan cleanup fails closed.
fn protected_files(combined: &[u8]) -> Result<Vec<String>, String> {
    let unreadable = || {
        format!(
            "a pending checkpoint's commit data ({} byte(s)) is not one this plugin writes, so the files it names \
             are unknown; orphan cleanup removed nothing (protect only jobs that write with the Iceberg plugin)",
            combined.len()
        )
    };
    let value = serde_json::from_slice::<serde_json::Value>(combined).map_err(|_| unreadable())?;
    if value.get("tables").is_none() && value.get("files").is_none() {
        return Err(unreadable());
    }
    let mut jsons: Vec<&serde_json::Value> = Vec::new();
    if let Some(tables) = value.get("tables").and_then(|t| t.as_array()) {
        for table in tables {
            jsons.extend(table.get("files").and_then(|f| f.as_array()).into_iter().flatten());
        }
    }
    jsons.extend(value.get("files").and_then(|f| f.as_array()).into_iter().flatten());
    jsons
        .into_iter()
        .map(|j| {
            j.as_str()
                .and_then(|s| serde_json::from_str::<serde_json::Value>(s).ok())
                .and_then(|v| v.get("file_path").and_then(|p| p.as_str()).map(|p| norm(p).to_string()))
                .ok_or_else(unreadable)
        })
        .collect()
}

/// The folder (below a table's `data/`) of the position-delete files of
/// a pending upsert checkpoint, as its combined commit names it.
fn deletes_folder(combined: &[u8]) -> Option<String> {
    let value = serde_json::from_slice::<serde_json::Value>(combined).ok()?;
    value.get("deletes_folder").and_then(|f| f.as_str()).map(str::to_string)
}

/// Every writer the table's properties name: `<job>.<sink>.<incarnation>`
/// of each watermark (`sluice.committed.<job>.<sink>.<incarnation>`) and
/// `<job>.<sink>` of each claim (`sluice.claim.<job>.<sink>`). This job's
/// own incarnation among them: the host, which alone can read the state
/// directories, tells which it has seen.
fn table_writers(metadata: &TableMetadata) -> Vec<String> {
    let keys = metadata.properties().keys();
    let watermarks = keys.clone().filter_map(|k| k.strip_prefix("sluice.committed."));
    let claims = keys.filter_map(|k| k.strip_prefix("sluice.claim."));
    let mut writers: Vec<String> = watermarks.chain(claims).map(str::to_string).collect();
    writers.sort();
    writers.dedup();
    writers
}

/// The writer of the data file at `location`, as its name says: the
/// writers name their files `<job>.<sink>.<incarnation>-s<n>-a<n>-w<n>-…`
/// (`<job>.<sink>-s…` before incarnations; job and sink ids hold no `.`).
/// Answers `<job>.<sink>.<incarnation>` (or `<job>.<sink>`); `None` for any
/// other name. The incarnation, 12 hex digits right before `-s<n>-a<n>-w<n>`,
/// anchors the parse, so a job or sink id that itself looks like
/// `-s3-a1-w2` cannot hide its writer.
fn writer_of(location: &str) -> Option<String> {
    let name = location.rsplit('/').next()?;
    let mut parts = name.splitn(3, '.');
    let (job, sink, rest) = (parts.next()?, parts.next()?, parts.next());
    if job.is_empty() {
        return None;
    }
    // `-s<digits>-a<digits>-w<digits>` at the start of `text`.
    let tagged = |text: &str| {
        let mut rest = text;
        for tag in ["-s", "-a", "-w"] {
            let Some(after) = rest.strip_prefix(tag) else { return false };
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            if digits == 0 {
                return false;
            }
            rest = &after[digits..];
        }
        true
    };
    if let Some(rest) = rest
        && rest.len() > 12
        && rest.as_bytes()[..12].iter().all(u8::is_ascii_hexdigit)
        && tagged(&rest[12..])
        && !sink.is_empty()
    {
        return Some(format!("{job}.{sink}.{}", &rest[..12]));
    }
    // Before incarnations: the last `-s<n>-a<n>-w<n>` in the sink part ends it.
    let at = (0..sink.len()).rev().find(|&i| sink.is_char_boundary(i) && tagged(&sink[i..]))?;
    (at > 0).then(|| format!("{job}.{}", &sink[..at]))
}

/// The files orphan cleanup may judge: those of the table's own `data/`
/// and `metadata/` folders, less every folder below them that is another
/// table (a table named `ns.t.x` lives inside `ns.t`'s folder by default,
/// and a claim file of namespace `ns.t` beside its folders): another
/// table's files are never this table's orphans, however old.
struct Owned {
    roots: [String; 2],
    /// Folders of other tables: where a `metadata/*.metadata.json` is.
    others: Vec<String>,
}

impl Owned {
    fn of(location: &str, listed: &[fio::TreeEntry]) -> Self {
        let location = norm(location).trim_end_matches('/');
        let own_metadata = format!("{location}/metadata/");
        let others = listed
            .iter()
            .map(|e| norm(&e.location))
            .filter(|l| l.ends_with(".metadata.json") && !l.starts_with(&own_metadata))
            .filter_map(|l| l.rsplit_once("/metadata/").map(|(table, _)| format!("{table}/")))
            .collect();
        Self { roots: [format!("{location}/data/"), own_metadata], others }
    }

    fn holds(&self, location: &str) -> bool {
        self.roots.iter().any(|r| location.starts_with(r.as_str()))
            && !self.others.iter().any(|o| location.starts_with(o.as_str()))
    }
}

/// The [`WRITERS_NOTE`] naming `writers`.
fn writers_note(writers: &[String]) -> String {
    format!("{WRITERS_NOTE}{}", serde_json::Value::from(writers.to_vec()))
}

fn remove_orphans(
    ident: &TableIdent,
    orphans: &Orphans,
    dry_run: bool,
    report: &mut TableReport,
) -> Result<(), SinkError> {
    let table = load(ident)?;
    let metadata = table.metadata();
    // A cutoff of i64::MIN removes nothing: only the writers are asked for.
    // The table is listed all the same: a job that has never committed here
    // is named by no property, only by the names of its files.
    let location = metadata.location().trim_end_matches('/').to_string();
    // Listed first: a file written after this cannot be removed.
    let listed = fio::list_tree(&location).map_err(|e| {
        error::config(format!("listing the files of table {ident}: {}", sluice_guest_sdk::files::describe(&e)))
    })?;
    // Reloaded after the listing: a commit made meanwhile protects its files.
    let table = load(ident)?;
    let metadata = table.metadata();
    let mut referenced: HashSet<String> = HashSet::new();
    if let Some(current) = table.metadata_location() {
        referenced.insert(norm(current).to_string());
    }
    for log in metadata.metadata_log() {
        referenced.insert(norm(&log.metadata_file).to_string());
    }
    for stats in metadata.statistics_iter() {
        referenced.insert(norm(&stats.statistics_path).to_string());
    }
    for stats in metadata.partition_statistics_iter() {
        referenced.insert(norm(&stats.statistics_path).to_string());
    }
    let mut refs = References::default();
    for snapshot in metadata.snapshots() {
        match refs.of(&table, snapshot) {
            Ok(files) => referenced.extend(files),
            // A running job's retention (or another maintain) may expire
            // the oldest snapshots, and delete their files, while they are
            // read here. A snapshot the table no longer has names nothing
            // anyone reads: its files are kept exactly when a snapshot
            // read here names them too. One the table still has is
            // missing a file: that is an error.
            Err(e) => {
                let now = load(ident)?;
                if now.metadata().snapshot_by_id(snapshot.snapshot_id()).is_some() {
                    return Err(e);
                }
            }
        }
    }
    // Upsert mode: the position-delete files of a pending checkpoint are
    // written at its commit, so its folder is protected as a whole.
    let mut protected_folders: Vec<String> = Vec::new();
    for combined in &orphans.protected {
        referenced.extend(protected_files(combined).map_err(|m| error::config(format!("table {ident}: {m}")))?);
        protected_folders.extend(deletes_folder(combined).map(|f| format!("{location}/data/{f}")));
    }
    // From the reload: a job whose first commit landed meanwhile is named;
    // and every writer whose unreferenced files are here (a pending
    // checkpoint of a job that never committed to this table).
    let mut writers = table_writers(metadata);
    writers.extend(
        listed.iter().filter(|e| !referenced.contains(norm(&e.location))).filter_map(|e| writer_of(&e.location)),
    );
    writers.sort();
    writers.dedup();
    report.notes.push(writers_note(&writers));
    if orphans.older_than_ms == i64::MIN {
        return Ok(());
    }
    let listed_names: HashSet<&str> = listed.iter().map(|e| norm(&e.location)).collect();
    if let Some(current) = metadata.current_snapshot() {
        let live = refs.of(&table, current)?;
        if let Some(missing) = live.iter().find(|f| !listed_names.contains(f.as_str())) {
            report.notes.push(format!(
                "orphan cleanup removed nothing: the live file {missing} is not among the files listed under {location}"
            ));
            return Ok(());
        }
    }
    let owned = Owned::of(&location, &listed);
    let mut candidates: Vec<&fio::TreeEntry> = listed
        .iter()
        .filter(|e| owned.holds(norm(&e.location)))
        .filter(|e| !referenced.contains(norm(&e.location)))
        .filter(|e| !protected_folders.iter().any(|f| norm(&e.location).starts_with(norm(f))))
        .filter(|e| e.modified_ms.is_some_and(|m| m < orphans.older_than_ms))
        .collect();
    candidates.sort_by(|a, b| a.location.cmp(&b.location));
    for entry in candidates {
        if dry_run {
            report.files_removed.push(entry.location.clone());
            continue;
        }
        match fio::delete(&entry.location) {
            Ok(()) | Err(fio::IoError::NotFound(_)) => report.files_removed.push(entry.location.clone()),
            Err(e) => report.notes.push(format!(
                "could not remove {}: {}",
                entry.location,
                sluice_guest_sdk::files::describe(&e)
            )),
        }
    }
    if !report.files_removed.is_empty() && !dry_run {
        log::info(&format!("table {ident}: removed {} file(s)", report.files_removed.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run-end-encoded column (how iceberg's reader fills an
    /// identity-partitioned one) comes back in its values' plain type,
    /// with the same rows and field metadata; other columns are untouched.
    #[test]
    fn identity_partition_columns_are_written_plain() {
        use arrow_array::types::Int32Type;
        use arrow_array::{Array, Date32Array, Int64Array, RunArray};
        use arrow_schema::Field;
        let meta: HashMap<String, String> = [("PARQUET:field_id".to_string(), "2".to_string())].into();
        let day = RunArray::<Int32Type>::try_new(
            &arrow_array::Int32Array::from(vec![3]),
            &Date32Array::from(vec![Some(19_724)]),
        )
        .unwrap();
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("day", day.data_type().clone(), true).with_metadata(meta.clone()),
        ]);
        let batch =
            RecordBatch::try_new(Arc::new(schema), vec![Arc::new(Int64Array::from(vec![1, 2, 3])), Arc::new(day)])
                .unwrap();
        let plain = plain_columns(batch).unwrap();
        let field = plain.schema().field(1).clone();
        assert_eq!((field.data_type(), field.is_nullable(), field.metadata()), (&DataType::Date32, true, &meta));
        let days = plain.column(1).as_any().downcast_ref::<Date32Array>().unwrap();
        assert_eq!(days.values().to_vec(), vec![19_724; 3]);
        assert_eq!(plain.column(0).as_ref(), &Int64Array::from(vec![1, 2, 3]) as &dyn Array);
    }

    /// A compaction reads a data file whole (a row's position is its
    /// ordinal) and leaves out the rows its live position deletes name, as
    /// read from a real delete file: the others stay, in order; a delete of
    /// another file or past the file's end deletes nothing of it.
    #[test]
    fn a_rewrite_reads_a_data_file_without_its_deleted_rows() {
        use arrow_array::cast::AsArray;
        use arrow_array::types::Int64Type;
        use arrow_array::{ArrayRef, Int64Array, StringArray};
        use iceberg::io::FileIO;
        use iceberg::spec::{DataFileBuilder, NestedField, PartitionSpec, PrimitiveType, Type};
        let io = FileIO::new_with_memory();
        let write = |path: &str, schema: &iceberg::spec::Schema, columns: Vec<ArrayRef>| -> (u64, u64) {
            let arrow = Arc::new(iceberg::arrow::schema_to_arrow_schema(schema).unwrap());
            let batch = RecordBatch::try_new(arrow.clone(), columns).unwrap();
            let mut bytes = Vec::new();
            let mut w = parquet::arrow::ArrowWriter::try_new(&mut bytes, arrow, None).unwrap();
            w.write(&batch).unwrap();
            w.close().unwrap();
            let size = bytes.len() as u64;
            block_on(io.new_output(path).unwrap().write(bytes.into())).unwrap();
            (batch.num_rows() as u64, size)
        };
        let file = |path: &str, content: DataContentType, (rows, size): (u64, u64)| {
            DataFileBuilder::default()
                .content(content)
                .file_path(path.to_string())
                .file_format(DataFileFormat::Parquet)
                .partition(Struct::empty())
                .partition_spec_id(0)
                .record_count(rows)
                .file_size_in_bytes(size)
                .build()
                .unwrap()
        };
        let schema = Arc::new(
            iceberg::spec::Schema::builder()
                .with_fields(vec![NestedField::required(1, "id", Type::Primitive(PrimitiveType::Long)).into()])
                .build()
                .unwrap(),
        );
        let a = "memory://wh/t/data/a.parquet";
        let data = file(
            a,
            DataContentType::Data,
            write(a, &schema, vec![Arc::new(Int64Array::from((10..16).collect::<Vec<i64>>()))]),
        );
        let d = "memory://wh/t/data/d.parquet";
        let rows = [(a, 1), (a, 3), (a, 9), ("memory://wh/t/data/b.parquet", 0)];
        let deleted = write(
            d,
            &crate::position_deletes::schema().unwrap(),
            vec![
                Arc::new(StringArray::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())),
                Arc::new(Int64Array::from(rows.iter().map(|r| r.1).collect::<Vec<i64>>())),
            ],
        );
        let delete_file = file(d, DataContentType::PositionDeletes, deleted);
        let mut deletes = LiveDeletes::default();
        for (path, pos) in rows {
            deletes.positions.entry(path.to_string()).or_default().insert(pos as u64);
        }
        let targets = rows.iter().map(|r| r.0.to_string()).collect();
        deletes.files.push((0, delete_file, targets));
        assert_eq!(deletes.deleted_in(&data), 2);
        let spec = Arc::new(PartitionSpec::unpartition_spec());
        let task = scan_task(&data, &schema, &[1], &spec);
        let gone = &deletes.positions[a];
        let ids: Vec<i64> = block_on(async {
            let reader = ArrowReaderBuilder::new(io.clone(), iceberg_runtime()).with_batch_size(4).build();
            let batches: Vec<RecordBatch> =
                reader.read(Box::pin(futures::stream::iter([Ok(task)])))?.stream().try_collect().await?;
            assert_eq!(batches.len(), 2, "two batches: positions carry across them");
            let mut pos = 0;
            let mut ids = Vec::new();
            for b in batches {
                let n = b.num_rows() as u64;
                ids.extend(without_deleted(b, pos, gone)?.column(0).as_primitive::<Int64Type>().values().to_vec());
                pos += n;
            }
            Ok::<_, iceberg::Error>(ids)
        })
        .unwrap();
        assert_eq!(ids, [10, 12, 14, 15]);
    }

    #[test]
    fn protected_files_come_from_both_commit_forms() {
        let file = serde_json::json!({"file_path": "file:///wh/t/data/a.parquet"}).to_string();
        let combined =
            serde_json::json!({"tables": [{"table": "t", "spec_id": 0, "files": [file.clone()]}], "files": [file]});
        let found = protected_files(combined.to_string().as_bytes()).unwrap();
        assert_eq!(found, vec!["/wh/t/data/a.parquet".to_string(), "/wh/t/data/a.parquet".to_string()]);
        let empty = serde_json::json!({"tables": []}).to_string();
        assert!(protected_files(empty.as_bytes()).unwrap().is_empty());
        // What this plugin cannot read protects nothing it knows of: refused.
        for bad in [&b"not json"[..], br#"{"offsets": [1]}"#, br#"{"files": [7]}"#] {
            assert!(protected_files(bad).unwrap_err().contains("orphan cleanup removed nothing"));
        }
    }

    #[test]
    fn only_the_tables_own_data_and_metadata_folders_hold_its_orphans() {
        let entry = |l: &str| fio::TreeEntry { location: l.to_string(), size: 1, modified_ms: Some(0) };
        let listed = [
            entry("/wh/db/x/data/a.parquet"),
            entry("/wh/db/x/metadata/00001-a.metadata.json"),
            entry("/wh/db/x/_sluice_claim.j.lake.json"),
            entry("/wh/db/x/dl/data/b.parquet"),
            entry("/wh/db/x/dl/metadata/00001-b.metadata.json"),
            entry("/wh/db/x/data/nested/metadata/00001-c.metadata.json"),
            entry("/wh/db/x/data/nested/data/c.parquet"),
        ];
        let owned = Owned::of("file:///wh/db/x/", &listed);
        let held: Vec<&str> = listed.iter().map(|e| e.location.as_str()).filter(|l| owned.holds(l)).collect();
        assert_eq!(held, ["/wh/db/x/data/a.parquet", "/wh/db/x/metadata/00001-a.metadata.json"]);
    }

    #[test]
    fn a_data_files_name_says_which_job_wrote_it() {
        let cases = [
            ("file:///wh/t/data/b-job.lake.0123456789ab-s0-a3-w12-00000.parquet", Some("b-job.lake.0123456789ab")),
            ("s3://w/t/data/day=2024-01-01/files-sink.out-s1-a1-w0-00001.parquet", Some("files-sink.out")),
            ("/wh/t/data/etl-s3-a1-w2.lake.0123456789ab-s0-a1-w0-0.parquet", Some("etl-s3-a1-w2.lake.0123456789ab")),
            ("/wh/t/data/etl.l-s3-a1-w2-s0-a1-w0-0.parquet", Some("etl.l-s3-a1-w2")),
            ("/wh/t/data/00000-0-5f2c.parquet", None),
            ("/wh/t/metadata/snap-1-1-abc.avro", None),
            ("/wh/t/data/a.b.not-an-incarnation-s0-a1-w0-0.parquet", None),
            ("/wh/t/data/-s0-a1-w0-0.parquet", None),
        ];
        for (location, writer) in cases {
            assert_eq!(writer_of(location).as_deref(), writer, "{location}");
        }
    }

    #[test]
    fn the_writers_note_is_its_prefix_and_a_json_list() {
        let note = writers_note(&["b.lake".to_string(), "c.x.lake".to_string()]);
        let list = note.strip_prefix(WRITERS_NOTE).expect("the prefix");
        let named: Vec<String> = serde_json::from_str(list).expect("a JSON list");
        assert_eq!(named, ["b.lake", "c.x.lake"]);
        assert_eq!(writers_note(&[]), format!("{WRITERS_NOTE}[]"));
    }
}
