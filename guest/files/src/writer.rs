//! The files sink's writer: streams rows into Parquet files under staging.

use std::cell::RefCell;

use arrow_schema::SchemaRef;
use parquet::arrow::{ArrowSchemaConverter, ArrowWriter};
use parquet::file::properties::WriterProperties;
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::files::{self, OutputWriter, join};
use sluice_guest_sdk::{GuestWriter, SinkContext, SinkError, error, ipc, log};

use crate::{Config, layout};

/// What a writer hands the committer for one checkpoint.
#[derive(Debug, Serialize, Deserialize)]
pub struct CommitInfo {
    /// Staging directory of the checkpoint (shared by all writers of one attempt).
    pub dir: String,
    pub files: Vec<StagedFile>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StagedFile {
    pub name: String,
    pub rows: u64,
}

/// Persisted with every checkpoint. Positions only: the files sink keeps no
/// external offsets, so this records progress for diagnostics.
#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    checkpoint: u64,
    files_committed_so_far: u64,
}

struct OpenFile {
    writer: ArrowWriter<OutputWriter>,
    name: String,
    rows: u64,
}

struct Inner {
    cfg: Config,
    ctx: SinkContext,
    schema: SchemaRef,
    props: WriterProperties,
    open: Option<OpenFile>,
    /// Finished files in `inprogress/` not yet handed to a checkpoint.
    finished: Vec<StagedFile>,
    seq: u64,
    state: State,
}

pub struct FilesWriter {
    inner: RefCell<Inner>,
}

/// Rejects schemas Parquet cannot store, naming the column.
pub fn check_schema(schema: &SchemaRef) -> Result<(), SinkError> {
    ArrowSchemaConverter::new()
        .convert(schema)
        .map(|_| ())
        .map_err(|e| error::config(format!("the rows' schema cannot be written as Parquet: {e}")))
}

impl Inner {
    fn inprogress(&self, name: &str) -> String {
        join(&layout::inprogress_dir(&self.cfg, &self.ctx), name)
    }

    fn start_file(&mut self) -> Result<(), SinkError> {
        let name = layout::file_name(self.ctx.subtask, self.seq);
        self.seq += 1;
        let location = self.inprogress(&name);
        let out = OutputWriter::create(&location, false)
            .map_err(|e| files::to_sink_error(&format!("creating {location}"), e))?;
        let writer = ArrowWriter::try_new(out, self.schema.clone(), Some(self.props.clone()))
            .map_err(|e| error::fatal(format!("starting Parquet file {location}: {e}")))?;
        self.open = Some(OpenFile { writer, name, rows: 0 });
        Ok(())
    }

    fn finish_file(&mut self) -> Result<(), SinkError> {
        if let Some(file) = self.open.take() {
            let location = self.inprogress(&file.name);
            let out = file
                .writer
                .into_inner()
                .map_err(|e| error::fatal(format!("finishing Parquet file {location}: {e}")))?;
            out.finish().map_err(|e| files::to_sink_error(&format!("closing {location}"), e))?;
            self.finished.push(StagedFile { name: file.name, rows: file.rows });
        }
        Ok(())
    }

    /// Deletes in-progress files this subtask left behind in earlier attempts.
    /// They belong to no checkpoint, so nothing can ever need them.
    fn clean_earlier_attempts(&self) {
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
            let dir = join(&layout::attempt_dir(&self.cfg, &self.ctx, attempt), "inprogress");
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

impl GuestWriter for FilesWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        schema: Vec<u8>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Config::parse(options)?;
        let schema = ipc::decode_schema(&schema)?;
        check_schema(&schema)?;
        let state: State = sluice_guest_sdk::restored_state(restored_state)?.unwrap_or_default();
        let props = WriterProperties::builder()
            .set_compression(cfg.compression)
            .set_created_by(format!("sluice files sink {}", env!("CARGO_PKG_VERSION")))
            .build();
        let inner = Inner { cfg, ctx, schema, props, open: None, finished: Vec::new(), seq: 0, state };
        inner.clean_earlier_attempts();
        Ok(sluice_guest_sdk::Writer::new(FilesWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let (schema, batches) = ipc::decode(&rows)?;
        if schema.fields() != inner.schema.fields() {
            return Err(error::invalid_data(format!(
                "batch schema {schema:?} differs from the schema the writer was opened with {:?}",
                inner.schema
            )));
        }
        for batch in batches {
            if batch.num_rows() == 0 {
                continue;
            }
            if inner.open.is_none() {
                inner.start_file()?;
            }
            let target = inner.cfg.target_file_bytes;
            let file = inner.open.as_mut().ok_or_else(|| error::fatal("no open file"))?;
            file.writer.write(&batch).map_err(|e| error::invalid_data(format!("encoding rows as Parquet: {e}")))?;
            file.rows += batch.num_rows() as u64;
            let size = file.writer.bytes_written() as u64 + file.writer.in_progress_size() as u64;
            if size >= target {
                inner.finish_file()?;
            }
        }
        Ok(())
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.finish_file()?;
        if inner.finished.is_empty() {
            return Ok(None);
        }
        let dir = layout::checkpoint_staging_dir(&inner.cfg, &inner.ctx, c);
        files::create_dir_all(&dir).map_err(|e| files::to_sink_error(&format!("creating {dir}"), e))?;
        let staged = std::mem::take(&mut inner.finished);
        for file in &staged {
            let from = inner.inprogress(&file.name);
            let to = join(&dir, &file.name);
            files::rename(&from, &to).map_err(|e| files::to_sink_error(&format!("staging {from} as {to}"), e))?;
        }
        inner.state.files_committed_so_far += staged.len() as u64;
        let info = CommitInfo { dir, files: staged };
        serde_json::to_vec(&info).map(Some).map_err(|e| error::fatal(format!("encoding commit info: {e}")))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.state.checkpoint = c;
        serde_json::to_vec(&inner.state).map_err(|e| error::fatal(format!("encoding writer state: {e}")))
    }

    fn abort_prepare(&self, c: u64) -> Result<(), SinkError> {
        let inner = self.inner.borrow();
        let dir = layout::checkpoint_staging_dir(&inner.cfg, &inner.ctx, c);
        let prefix = layout::subtask_prefix(inner.ctx.subtask);
        let names = match files::list_dir(&dir) {
            Ok(names) => names,
            Err(_) => return Ok(()),
        };
        for name in names.iter().filter(|n| n.starts_with(&prefix)) {
            let location = join(&dir, name);
            files::delete(&location).map_err(|e| files::to_sink_error(&format!("removing {location}"), e))?;
        }
        Ok(())
    }

    fn close(&self) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        // Publish nothing: an open file holds rows no checkpoint covers.
        if let Some(file) = inner.open.take() {
            let location = inner.inprogress(&file.name);
            drop(file);
            if let Err(e) = files::delete(&location) {
                log::warn(&format!("could not remove uncommitted file {location}: {}", files::describe(&e)));
            }
        }
        Ok(())
    }
}
