//! The files sink's writer: streams each table's rows into Parquet files,
//! under staging on a local disk, or as data objects under their final
//! names on an object store (see the crate's doc).
//!
//! The host encodes the Parquet (the `columnar` capability): the batches the
//! engine hands over go on to it as they came, never decoded here, and the
//! host refuses any batch whose schema is not the table's. With
//! `partition_by` a batch is decoded and split by partition first: each
//! partition of a table has its own open file, under its `col=value/`
//! folder, and each staged file records its partition.

use std::cell::RefCell;
use std::collections::BTreeMap;

use arrow_schema::SchemaRef;
use parquet::arrow::ArrowSchemaConverter;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::bindings::sluice::connector::file_io;
use sluice_guest_sdk::columnar::{self, ParquetFile, WriterOptions};
use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, Table, TableChange, error, ipc, log};

use crate::{Config, Publish, layout, partition};

/// What a writer hands the committer for one checkpoint.
#[derive(Debug, Serialize, Deserialize)]
pub struct CommitInfo {
    /// Staging directory of the checkpoint (shared by all writers of one attempt).
    pub dir: String,
    /// The files of every table the writer wrote.
    pub tables: Vec<TableFiles>,
}

/// One table's files of a checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TableFiles {
    pub table: String,
    pub files: Vec<StagedFile>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StagedFile {
    /// Relative to the table's staging or data folder (overwrite mode: to
    /// the table's directory); starts with the partition's path.
    pub name: String,
    /// The partition's path (`day=2024-01-05`), `""` when unpartitioned.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub partition: String,
    pub rows: u64,
    /// The file's size as written (object stores: the commit checks each
    /// data object against it; local files leave it out, as before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// Persisted with every checkpoint. Positions only: the files sink keeps no
/// external offsets, so this records progress for diagnostics.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    checkpoint: u64,
    files_committed_so_far: u64,
}

struct OpenFile {
    file: ParquetFile,
    name: String,
    rows: u64,
}

/// One table's files of this writer.
pub(crate) struct TableWriter {
    schema: SchemaRef,
    /// The `partition_by` columns' indices in `schema` (empty: unpartitioned).
    partition_cols: Vec<usize>,
    /// The open file of each partition (`""` when unpartitioned).
    open: BTreeMap<String, OpenFile>,
    /// Finished files in `inprogress/<table>/` not yet handed to a checkpoint.
    finished: Vec<StagedFile>,
    /// Rows of this table given to this writer since it opened or the table
    /// last changed (counted where they are split by partition), to name a
    /// refused row by the contract's phrase.
    input_rows: u64,
}

struct Inner {
    cfg: Config,
    ctx: SinkContext,
    props: WriterOptions,
    tables: BTreeMap<String, TableWriter>,
    seq: u64,
    state: State,
    /// Object stores: the data objects handed to each prepared checkpoint
    /// not known to be persisted yet, for `abort-prepare`.
    prepared: BTreeMap<u64, Vec<String>>,
}

pub struct FilesWriter {
    inner: RefCell<Inner>,
}

/// Rejects schemas Parquet cannot store, naming the table and column.
pub fn check_schema(table: &str, schema: &SchemaRef) -> Result<(), SinkError> {
    ArrowSchemaConverter::new()
        .convert(schema)
        .map(|_| ())
        .map_err(|e| error::config(format!("the rows of table {table:?} cannot be written as Parquet: {e}")))
}

/// A table the engine announced: its name checked, its schema decoded, its
/// partition columns found.
pub fn table_writer(cfg: &Config, table: &Table) -> Result<(String, TableWriter), SinkError> {
    layout::check_table_name(&table.name)?;
    let schema = ipc::decode_schema(&table.schema)?;
    check_schema(&table.name, &schema)?;
    let partition_cols = partition::indices(&table.name, &schema, cfg.partition_by_for(&table.name))?;
    Ok((
        table.name.clone(),
        TableWriter { schema, partition_cols, open: BTreeMap::new(), finished: Vec::new(), input_rows: 0 },
    ))
}

impl Inner {
    fn inprogress(&self, table: &str, name: &str) -> String {
        join(&layout::inprogress_dir(&self.cfg, &self.ctx, table), name)
    }

    fn table_mut(&mut self, table: &str) -> Result<&mut TableWriter, SinkError> {
        self.tables.get_mut(table).ok_or_else(|| {
            error::invalid_data(format!("rows of table {table:?}, which the engine has not announced to this writer"))
        })
    }

    /// The next file name of this subtask; on an object store one that is
    /// free: a writer opened again within one attempt (which the engine does
    /// not do, but a driver could) skips the names its earlier self took, so
    /// a data object is never written twice, even on GCS, where a streamed
    /// upload cannot be an exclusive create.
    fn next_name(&mut self, table: &str, partition: &str) -> Result<(String, String), SinkError> {
        const MAX_SKIPPED: u32 = 10_000;
        for _ in 0..MAX_SKIPPED {
            let name = layout::data_name(&self.cfg, &self.ctx, partition, self.seq);
            self.seq += 1;
            let location = self.inprogress(table, &name);
            if !self.cfg.publish.in_place() {
                return Ok((name, location));
            }
            let taken = files::exists(&location)
                .map_err(|e| files::to_sink_error(&format!("checking that {location} is free"), e))?;
            if !taken {
                return Ok((name, location));
            }
            log::warn(&format!("data object {location} exists already (an earlier writer of this attempt); skipped"));
        }
        Err(error::fatal(format!(
            "table {table:?}: {MAX_SKIPPED} data object names of subtask {} in attempt {} are taken already",
            self.ctx.subtask, self.ctx.attempt
        )))
    }

    fn start_file(&mut self, table: &str, partition: &str) -> Result<(), SinkError> {
        let (name, location) = self.next_name(table, partition)?;
        // Exclusive everywhere but on GCS, which cannot stream an exclusive
        // create; there the name was found free just now, and only this
        // subtask of this attempt ever writes it.
        let overwrite = !self.cfg.publish.exclusive_data();
        let props = self.props.clone();
        let t = self.table_mut(table)?;
        let file = ParquetFile::create(&location, t.schema.clone(), &props, overwrite)
            .map_err(|e| columnar::to_sink_error(&format!("creating {location}"), e))?;
        t.open.insert(partition.to_string(), OpenFile { file, name, rows: 0 });
        Ok(())
    }

    fn finish_file(&mut self, table: &str, partition: &str) -> Result<(), SinkError> {
        let Some(file) = self.table_mut(table)?.open.remove(partition) else { return Ok(()) };
        let location = self.inprogress(table, &file.name);
        let closed = file.file.close().map_err(|e| columnar::to_sink_error(&format!("closing {location}"), e))?;
        if file.rows == 0 {
            // Only empty batches came: no file for them.
            return files::delete(&location).map_err(|e| files::to_sink_error(&format!("removing {location}"), e));
        }
        let bytes = self.cfg.publish.in_place().then_some(closed.size);
        let staged = StagedFile { name: file.name, partition: partition.to_string(), rows: file.rows, bytes };
        self.table_mut(table)?.finished.push(staged);
        Ok(())
    }

    fn finish_all(&mut self) -> Result<(), SinkError> {
        let names: Vec<String> = self.tables.keys().cloned().collect();
        for table in names {
            let partitions: Vec<String> = self.table_mut(&table)?.open.keys().cloned().collect();
            for partition in partitions {
                self.finish_file(&table, &partition)?;
            }
        }
        Ok(())
    }

    /// Writes `batch` (rows of one partition of `table`) into that
    /// partition's open file, rolling it at the target size.
    fn write_partition(&mut self, table: &str, partition: &str, batch: Either<'_>) -> Result<(), SinkError> {
        if !self.table_mut(table)?.open.contains_key(partition) {
            self.start_file(table, partition)?;
        }
        let target = self.cfg.target_file_bytes;
        let file = self.table_mut(table)?.open.get_mut(partition).ok_or_else(|| error::fatal("no open file"))?;
        let location = file.file.location().to_string();
        let written = match batch {
            Either::Ipc(rows) => file.file.write_ipc(rows),
            Either::Batch(batch) => file.file.write(batch),
        };
        let status = written.map_err(|e| {
            columnar::to_sink_error(&format!("encoding rows of table {table:?} as Parquet ({location})"), e)
        })?;
        file.rows = status.rows;
        if status.written_bytes + status.open_bytes >= target {
            self.finish_file(table, partition)?;
        }
        Ok(())
    }

    /// Deletes in-progress files this subtask left behind in earlier attempts.
    /// They belong to no checkpoint, so nothing can ever need them.
    ///
    /// Not on an object store: there a finished data object of an earlier
    /// attempt may be named by a checkpoint (data objects never move), so
    /// telling leftovers apart would take every marker and every pending
    /// record; leftovers stay, and readers ignore them (no marker names them).
    fn clean_earlier_attempts(&self) {
        if self.cfg.publish.in_place() {
            return;
        }
        let root = layout::staging_root(&self.cfg, &self.ctx);
        let Ok(entries) = files::list_dir(&root) else { return };
        let prefix = layout::subtask_prefix(self.ctx.subtask);
        for entry in entries {
            let Some(attempt) = entry.strip_prefix("attempt-").and_then(|a| a.parse::<u32>().ok()) else {
                continue;
            };
            if attempt >= self.ctx.attempt {
                continue;
            }
            let inprogress = join(&layout::attempt_dir(&self.cfg, &self.ctx, attempt), "inprogress");
            // At any depth: partitioned tables keep files in `col=value/` folders.
            for location in subtask_files(&inprogress, &prefix) {
                if let Err(e) = files::delete(&location) {
                    log::warn(&format!("could not remove stale file {location}: {}", files::describe(&e)));
                }
            }
        }
    }
}

/// Rows for [`Inner::write_partition`]: as the engine sent them, or split.
enum Either<'a> {
    Ipc(&'a [u8]),
    Batch(&'a arrow_array::RecordBatch),
}

/// Every file at any depth under `dir` whose name starts with `prefix` (one
/// subtask's files); nothing when `dir` cannot be listed.
fn subtask_files(dir: &str, prefix: &str) -> Vec<String> {
    let Ok(entries) = file_io::list_tree(dir) else { return Vec::new() };
    entries
        .into_iter()
        .map(|e| e.location)
        .filter(|location| location.rsplit('/').next().is_some_and(|name| name.starts_with(prefix)))
        .collect()
}

impl GuestWriter for FilesWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<Table>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Config::parse(options)?;
        let tables = tables.iter().map(|t| table_writer(&cfg, t)).collect::<Result<BTreeMap<_, _>, _>>()?;
        let state: State = sluice_guest_sdk::restored_state(restored_state)?.unwrap_or_default();
        let mut props = columnar::options(cfg.compression, None);
        props.created_by = Some(format!("sluice files sink {}", env!("CARGO_PKG_VERSION")));
        let inner = Inner { cfg, ctx, props, tables, seq: 0, state, prepared: BTreeMap::new() };
        inner.clean_earlier_attempts();
        Ok(sluice_guest_sdk::Writer::new(FilesWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let cols = inner.table_mut(&table)?.partition_cols.clone();
        if cols.is_empty() {
            return inner.write_partition(&table, "", Either::Ipc(&rows));
        }
        let names = inner.cfg.partition_by_for(&table).to_vec();
        let (_, batches) = ipc::decode(rows)?;
        let object_store = Publish::of(&inner.cfg.path) != Publish::Rename;
        for batch in &batches {
            let first_row = inner.table_mut(&table)?.input_rows;
            let parts = partition::split(&table, batch, &cols, &names, object_store, first_row)?;
            inner.table_mut(&table)?.input_rows += batch.num_rows() as u64;
            for (partition, rows) in parts {
                inner.write_partition(&table, &partition, Either::Batch(&rows))?;
            }
        }
        Ok(())
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.finish_all()?;
        // A checkpoint prepared after `c - 1` means `c - 1` was persisted
        // (or aborted): it can no longer be aborted.
        inner.prepared.retain(|&p, _| p >= c);
        if inner.tables.values().all(|t| t.finished.is_empty()) {
            return Ok(None);
        }
        let dir = match inner.cfg.publish {
            Publish::Rename => layout::checkpoint_staging_dir(&inner.cfg, &inner.ctx, c),
            // Data objects stay where they were written: the attempt's folder.
            Publish::Marker { .. } | Publish::Log { .. } => {
                layout::attempt_dir(&inner.cfg, &inner.ctx, inner.ctx.attempt)
            }
        };
        let mut staged_tables = Vec::new();
        let mut handed = Vec::new();
        let names: Vec<String> = inner.tables.keys().cloned().collect();
        for table in names {
            let staged = std::mem::take(&mut inner.table_mut(&table)?.finished);
            if staged.is_empty() {
                continue;
            }
            if inner.cfg.publish == Publish::Rename {
                let table_dir = layout::table_staging_dir(&dir, &table);
                files::create_dir_all(&table_dir)
                    .map_err(|e| files::to_sink_error(&format!("creating {table_dir}"), e))?;
                for file in &staged {
                    let from = inner.inprogress(&table, &file.name);
                    let to = join(&table_dir, &file.name);
                    if !file.partition.is_empty() {
                        let dir = join(&table_dir, &file.partition);
                        files::create_dir_all(&dir).map_err(|e| files::to_sink_error(&format!("creating {dir}"), e))?;
                    }
                    files::rename(&from, &to)
                        .map_err(|e| files::to_sink_error(&format!("staging {from} as {to}"), e))?;
                }
            } else {
                handed.extend(staged.iter().map(|f| inner.inprogress(&table, &f.name)));
            }
            inner.state.files_committed_so_far += staged.len() as u64;
            staged_tables.push(TableFiles { table, files: staged });
        }
        if !handed.is_empty() {
            inner.prepared.insert(c, handed);
        }
        let info = CommitInfo { dir, tables: staged_tables };
        serde_json::to_vec(&info).map(Some).map_err(|e| error::fatal(format!("encoding commit info: {e}")))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.state.checkpoint = c;
        serde_json::to_vec(&inner.state).map_err(|e| error::fatal(format!("encoding writer state: {e}")))
    }

    fn apply_changes(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        for change in &changes {
            let (name, writer) = table_writer(&inner.cfg, &change.table)?;
            // Files of the old shape are finished (a barrier follows a
            // prepare, so none is open) and wait for the next checkpoint.
            if let Some(old) = inner.tables.get(&name) {
                let partitions: Vec<String> = old.open.keys().cloned().collect();
                for partition in partitions {
                    inner.finish_file(&name, &partition)?;
                }
            }
            let finished = inner.tables.remove(&name).map(|t| t.finished).unwrap_or_default();
            inner.tables.insert(name, TableWriter { finished, ..writer });
        }
        Ok(())
    }

    /// Deletes what this writer prepared for checkpoint `c`. Precondition,
    /// which the host guarantees: the checkpoint's record is definitely not
    /// persisted (never combined, or its write was answered "not done"), so
    /// no commit can ever name these files; the host never calls it when the
    /// persist's outcome is unknown, since a recovery would then commit the
    /// checkpoint and find its files gone.
    fn abort_prepare(&self, c: u64) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        if inner.cfg.publish.in_place() {
            // The checkpoint was never persisted, so no commit can name these.
            for location in inner.prepared.remove(&c).unwrap_or_default() {
                match files::delete(&location) {
                    Ok(()) | Err(sluice_guest_sdk::IoError::NotFound(_)) => {}
                    Err(e) => return Err(files::to_sink_error(&format!("removing {location}"), e)),
                }
            }
            return Ok(());
        }
        let dir = layout::checkpoint_staging_dir(&inner.cfg, &inner.ctx, c);
        let prefix = layout::subtask_prefix(inner.ctx.subtask);
        for table in inner.tables.keys() {
            let table_dir = layout::table_staging_dir(&dir, table);
            for location in subtask_files(&table_dir, &prefix) {
                files::delete(&location).map_err(|e| files::to_sink_error(&format!("removing {location}"), e))?;
            }
        }
        Ok(())
    }

    fn close(&self) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        // Publish nothing: an open file holds rows no checkpoint covers.
        let names: Vec<String> = inner.tables.keys().cloned().collect();
        for table in names {
            let open = std::mem::take(&mut inner.table_mut(&table)?.open);
            for file in open.into_values() {
                let location = inner.inprogress(&table, &file.name);
                drop(file);
                // On an object store the unfinished upload was just dropped,
                // which aborts it: nothing is there to remove. (A partial
                // local file in overwrite mode stays too: no version names
                // it, and readers follow the log.)
                if inner.cfg.publish.in_place() {
                    continue;
                }
                if let Err(e) = files::delete(&location) {
                    log::warn(&format!("could not remove uncommitted file {location}: {}", files::describe(&e)));
                }
            }
        }
        Ok(())
    }
}
