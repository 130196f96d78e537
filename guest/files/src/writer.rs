//! The files sink's writer: streams each table's rows into Parquet files,
//! under staging on a local disk, or as data objects under their final
//! names on an object store (see the crate's doc).
//!
//! The host encodes the Parquet (the `columnar` capability): the batches the
//! engine hands over go on to it as they came, never decoded here, and the
//! host refuses any batch whose schema is not the table's.

use std::cell::RefCell;
use std::collections::BTreeMap;

use arrow_schema::SchemaRef;
use parquet::arrow::ArrowSchemaConverter;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::columnar::{self, ParquetFile, WriterOptions};
use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, Table, TableChange, error, ipc, log};

use crate::{Config, Publish, layout};

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
    pub name: String,
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
    open: Option<OpenFile>,
    /// Finished files in `inprogress/<table>/` not yet handed to a checkpoint.
    finished: Vec<StagedFile>,
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

/// A table the engine announced: its name checked, its schema decoded.
pub fn table_writer(table: &Table) -> Result<(String, TableWriter), SinkError> {
    layout::check_table_name(&table.name)?;
    let schema = ipc::decode_schema(&table.schema)?;
    check_schema(&table.name, &schema)?;
    Ok((table.name.clone(), TableWriter { schema, open: None, finished: Vec::new() }))
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
    fn next_name(&mut self, table: &str) -> Result<(String, String), SinkError> {
        const MAX_SKIPPED: u32 = 10_000;
        for _ in 0..MAX_SKIPPED {
            let name = layout::file_name(self.ctx.subtask, self.seq);
            self.seq += 1;
            let location = self.inprogress(table, &name);
            if self.cfg.publish == Publish::Rename {
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

    fn start_file(&mut self, table: &str) -> Result<(), SinkError> {
        let (name, location) = self.next_name(table)?;
        // Exclusive everywhere but on GCS, which cannot stream an exclusive
        // create; there the name was found free just now, and only this
        // subtask of this attempt ever writes it.
        let overwrite = self.cfg.publish == Publish::Marker { exclusive_data: false };
        let props = self.props.clone();
        let t = self.table_mut(table)?;
        let file = ParquetFile::create(&location, t.schema.clone(), &props, overwrite)
            .map_err(|e| columnar::to_sink_error(&format!("creating {location}"), e))?;
        t.open = Some(OpenFile { file, name, rows: 0 });
        Ok(())
    }

    fn finish_file(&mut self, table: &str) -> Result<(), SinkError> {
        let Some(file) = self.table_mut(table)?.open.take() else { return Ok(()) };
        let location = self.inprogress(table, &file.name);
        let closed = file.file.close().map_err(|e| columnar::to_sink_error(&format!("closing {location}"), e))?;
        if file.rows == 0 {
            // Only empty batches came: no file for them.
            return files::delete(&location).map_err(|e| files::to_sink_error(&format!("removing {location}"), e));
        }
        let bytes = (self.cfg.publish != Publish::Rename).then_some(closed.size);
        self.table_mut(table)?.finished.push(StagedFile { name: file.name, rows: file.rows, bytes });
        Ok(())
    }

    fn finish_all(&mut self) -> Result<(), SinkError> {
        let names: Vec<String> = self.tables.keys().cloned().collect();
        for table in names {
            self.finish_file(&table)?;
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
        if self.cfg.publish != Publish::Rename {
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
            let Ok(tables) = files::list_dir(&inprogress) else { continue };
            for table in tables {
                let dir = join(&inprogress, &table);
                let Ok(names) = files::list_dir(&dir) else { continue };
                for name in names.iter().filter(|n| n.starts_with(&prefix)) {
                    let location = join(&dir, name);
                    if let Err(e) = files::delete(&location) {
                        log::warn(&format!("could not remove stale file {location}: {}", files::describe(&e)));
                    }
                }
            }
        }
    }
}

impl GuestWriter for FilesWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<Table>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Config::parse(options)?;
        let tables = tables.iter().map(table_writer).collect::<Result<BTreeMap<_, _>, _>>()?;
        let state: State = sluice_guest_sdk::restored_state(restored_state)?.unwrap_or_default();
        let mut props = columnar::options(cfg.compression, None);
        props.created_by = Some(format!("sluice files sink {}", env!("CARGO_PKG_VERSION")));
        let inner = Inner { cfg, ctx, props, tables, seq: 0, state, prepared: BTreeMap::new() };
        inner.clean_earlier_attempts();
        Ok(sluice_guest_sdk::Writer::new(FilesWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        if inner.table_mut(&table)?.open.is_none() {
            inner.start_file(&table)?;
        }
        let target = inner.cfg.target_file_bytes;
        let file = inner.table_mut(&table)?.open.as_mut().ok_or_else(|| error::fatal("no open file"))?;
        let location = file.file.location().to_string();
        let status = file.file.write_ipc(&rows).map_err(|e| {
            columnar::to_sink_error(&format!("encoding rows of table {table:?} as Parquet ({location})"), e)
        })?;
        file.rows = status.rows;
        if status.written_bytes + status.open_bytes >= target {
            inner.finish_file(&table)?;
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
            Publish::Marker { .. } => layout::attempt_dir(&inner.cfg, &inner.ctx, inner.ctx.attempt),
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
            let (name, writer) = table_writer(&change.table)?;
            // Files of the old shape are finished (a barrier follows a
            // prepare, so none is open) and wait for the next checkpoint.
            if inner.tables.contains_key(&name) {
                inner.finish_file(&name)?;
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
        if inner.cfg.publish != Publish::Rename {
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
            let Ok(names) = files::list_dir(&table_dir) else { continue };
            for name in names.iter().filter(|n| n.starts_with(&prefix)) {
                let location = join(&table_dir, name);
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
            if let Some(file) = inner.table_mut(&table)?.open.take() {
                let location = inner.inprogress(&table, &file.name);
                drop(file);
                // On an object store the unfinished upload was just dropped,
                // which aborts it: nothing is there to remove.
                if inner.cfg.publish != Publish::Rename {
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
