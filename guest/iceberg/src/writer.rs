//! Writers: each source table's rows → Parquet data files of its Iceberg
//! table, through iceberg's writer stack.
//!
//! Invariants:
//! - data files are named `<job>.<sink>.<incarnation>-s<subtask>-a<attempt>-w<seq>-<n>.parquet`:
//!   unique per job, sink, incarnation, subtask, run attempt and writer
//!   generation, so a restarted run (or a job started over in a fresh state
//!   directory) never overwrites or reuses a file of an earlier one;
//! - `prepare-commit(c)` closes every table's open files and reports them;
//!   it makes nothing visible (only the committer's snapshots do);
//! - after a schema change the table is reloaded, so files of the new shape
//!   are written with the evolved schema's field ids;
//! - the rows are encoded as Parquet by the host (the `columnar`
//!   capability, [`crate::host_parquet`]), under iceberg's own rolling,
//!   data-file and fan-out writers;
//! - memory stays within `buffer_mb` per writer whatever the checkpoint
//!   interval: the host keeps a row group in memory until it is cut, so row
//!   groups are cut at the budget shared by the files the writer holds open
//!   (one per partition it has met), and what the host holds for them all
//!   is kept within [`HOST_SHARE`] of the budget;
//! - `close` reports nothing: rows no checkpoint covers stay invisible (their
//!   files are orphans that table maintenance may remove);
//! - with `overwrite_filter`, every converted batch is checked against the
//!   filter before any of it is written: a row outside it is `invalid-data`
//!   named with the contract's phrase (`row N of this writer's input for
//!   table "T"`, `N` counting the rows given for `T` since it was opened or
//!   changed), so the host names its file and line. So is a row inside the
//!   filter whose partition is not wholly inside it (a filter that cuts a
//!   partition): its file would straddle the filter, and no later run could
//!   replace that partition as a whole;
//! - a table written by plain appends (no `overwrite_filter`, no upserts)
//!   is written from the host's input: the writer asks the host for the
//!   columns it reads itself (those partition values come from and the
//!   float columns whose NaNs the manifest counts, [`input_schema`]),
//!   splits those, and names each file's rows by their number in the
//!   host's batch (`columnar.write-input`, contract 0.2.4), which the host
//!   takes and converts to the table's schema as [`BatchConverter`] does.
//!   The other columns never cross the boundary.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};

use std::sync::Arc;

use arrow_array::{RecordBatch, UInt32Array};
use arrow_schema::{DataType, Field, FieldRef, Schema as ArrowSchema, SchemaRef};
use iceberg::TableIdent;
use iceberg::arrow::{PartitionValueCalculator, RecordBatchPartitionSplitter};
use iceberg::spec::{
    DataFile, DataFileFormat, NestedField, NestedFieldRef, PartitionKey, PartitionSpec, PartitionSpecRef,
    PrimitiveType, Schema, Struct, StructType, Type, serialize_data_file_to_json,
};
use iceberg::table::Table;
use iceberg::writer::CurrentFileStatus;
use iceberg::writer::base_writer::data_file_writer::{DataFileWriter, DataFileWriterBuilder};
use iceberg::writer::file_writer::location_generator::{DefaultFileNameGenerator, DefaultLocationGenerator};
use iceberg::writer::file_writer::rolling_writer::RollingFileWriterBuilder;
use iceberg::writer::partitioning::PartitioningWriter;
use iceberg::writer::partitioning::fanout_writer::FanoutWriter;
use iceberg::writer::{IcebergWriter as _, IcebergWriterBuilder};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::{
    GuestWriter, SinkContext, SinkError, Table as SourceTable, TableChange, columnar, error, incarnation, ipc,
};

use crate::config::Config;
use crate::filter::{BoundFilter, FilterError, PartitionFilter, Placement};
use crate::host_io::{self, LoadError};
use crate::host_parquet::{HostParquetWriterBuilder, INPUT_ROW, SharedHostFiles};
use crate::runtime::block_on;
use crate::schema::{self, BatchConverter};
use crate::upsert::WriterLog;

/// Row groups are never cut smaller than this (tiny row groups cost more
/// in metadata and scans than they save in memory).
const MIN_ROW_GROUP_BYTES: usize = 256 * 1024;

/// The part of `buffer_mb` the host may hold for a writer's open files (the
/// row groups it is encoding, as the host counts them); the rest is the
/// plugin's own (the batch being converted and split, and its IPC copy on
/// the way out) and what the host's count leaves out (each open column's
/// encoder and compressor state). At 3/4, four writers at `buffer_mb = 64`
/// with 30 open partitions each peaked at 335 MB of process memory, over
/// the 282-300 MB of the same job before the host encoded; at 1/2, see
/// docs/src/performance.md (issue 42, 2026-12-06).
pub(crate) const HOST_SHARE: (u64, u64) = (1, 2);

/// The `columnar` capability's name for a Parquet codec.
fn host_compression(c: parquet::basic::Compression) -> (columnar::Compression, Option<i32>) {
    use parquet::basic::Compression as C;
    match c {
        C::UNCOMPRESSED => (columnar::Compression::Uncompressed, None),
        C::SNAPPY => (columnar::Compression::Snappy, None),
        C::ZSTD(level) => (columnar::Compression::Zstd, Some(level.compression_level())),
        C::GZIP(level) => (columnar::Compression::Gzip, Some(level.compression_level() as i32)),
        C::BROTLI(level) => (columnar::Compression::Brotli, Some(level.compression_level() as i32)),
        C::LZ4 | C::LZ4_RAW | C::LZO => (columnar::Compression::Lz4Raw, None),
    }
}

type FileBuilder = DataFileWriterBuilder<HostParquetWriterBuilder, DefaultLocationGenerator, DefaultFileNameGenerator>;
type UnpartitionedWriter = DataFileWriter<HostParquetWriterBuilder, DefaultLocationGenerator, DefaultFileNameGenerator>;

enum OpenFiles {
    Unpartitioned(Box<UnpartitionedWriter>),
    Partitioned(Box<FanoutWriter<FileBuilder>>),
    /// Upsert mode: one writer per partition (`None`: unpartitioned), kept
    /// here so each row's file and position can be read after its write.
    Keyed(Box<FileBuilder>, HashMap<Option<Struct>, UnpartitionedWriter>),
}

/// Upsert mode: the key columns and what this writer was given.
struct UpsertTable {
    /// The key columns' indices in a converted batch, and their names.
    columns: Vec<usize>,
    names: Vec<String>,
    /// The partition value of each row (`None`: unpartitioned).
    partitions: Option<(PartitionValueCalculator, StructType, PartitionSpecRef)>,
    log: WriterLog,
}

/// What a writer reports for one checkpoint: per table, its data files as
/// Iceberg's data-file JSON for the partition spec they were written with.
#[derive(Debug, Serialize, Deserialize)]
pub struct CommitInfo {
    pub tables: Vec<TableFiles>,
}

/// One table's data files of a checkpoint.
#[derive(Debug, Serialize, Deserialize)]
pub struct TableFiles {
    /// The source's name for the table (`""` for a single-table source).
    pub table: String,
    pub spec_id: i32,
    pub files: Vec<String>,
    /// Upsert mode: each writer's key changes ([`crate::upsert`]), one
    /// blob per writer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// Last checkpoint this writer prepared.
    checkpoint: Option<u64>,
}

/// One source table's Iceberg table, as this writer writes it.
struct TableWriter {
    table: Table,
    converter: BatchConverter,
    splitter: Option<RecordBatchPartitionSplitter>,
    open: Option<OpenFiles>,
    /// The most partitions one checkpoint's rows of this table spread over.
    partitions: usize,
    /// `overwrite_filter`, bound to the table: every row must match it.
    filter: Option<BoundFilter>,
    /// The filter projected onto the table's default spec: every partition
    /// the rows fall in must lie wholly inside the filter.
    placement: Option<PartitionFilter>,
    /// Rows given for this table since it was opened or changed (the
    /// contract's row numbering).
    rows: u64,
    /// Upsert mode (not for the dead-letter table).
    upsert: Option<UpsertTable>,
    /// Written from the host's input: `converter` and `splitter` work on
    /// the columns the writer reads ([`input_schema`]), and each batch ends
    /// with [`INPUT_ROW`].
    input: bool,
}

struct Inner {
    cfg: Config,
    ctx: SinkContext,
    tables: BTreeMap<String, TableWriter>,
    /// Writer generation: one per set of files.
    seq: u64,
    /// Files of prepared checkpoints, for `abort-prepare`.
    prepared: BTreeMap<u64, Vec<String>>,
    state: State,
    /// The data files open now, which the host encodes, and what it holds for them.
    files: SharedHostFiles,
}

pub struct IcebergWriter {
    inner: RefCell<Inner>,
}

pub(crate) fn iceberg_error(context: &str, e: iceberg::Error) -> SinkError {
    let message = format!("{context}: {e}");
    if message.contains("[sink.grants]") { error::config(message) } else { error::fatal(message) }
}

/// Loads the table, creating it from the source schema when it is missing
/// and the options allow it. Safe when several instances (or jobs) race.
pub(crate) fn ensure_table(
    cfg: &Config,
    ident: &TableIdent,
    source: &arrow_schema::Schema,
) -> Result<Table, SinkError> {
    block_on(async {
        match host_io::load_table(ident).await {
            Ok(table) => Ok(table),
            Err(LoadError::NotFound(m)) if !cfg.create_table => {
                Err(error::config(format!("table {ident} does not exist and option `create_table` is false: {m}")))
            }
            Err(LoadError::NotFound(_)) => {
                let schema = schema::creation_schema(source)?;
                let spec = cfg.partition_by.as_deref().map(|f| schema::creation_spec(f, &schema)).transpose()?;
                match host_io::create_table(ident, &schema, spec.as_ref(), cfg.format_version) {
                    Ok(table) => {
                        sluice_guest_sdk::log::info(&format!("created table {ident}"));
                        Ok(table)
                    }
                    // Someone else created it first: use theirs (checked by the caller).
                    Err(LoadError::Catalog(
                        sluice_guest_sdk::bindings::sluice::connector::iceberg_catalog::CatalogError::Conflict(_),
                    )) => host_io::load_table(ident).await.map_err(|e| e.into_sink_error(ident)),
                    Err(e) => Err(e.into_sink_error(ident)),
                }
            }
            Err(e) => Err(e.into_sink_error(ident)),
        }
    })
}

/// Loads the table a source table lands in and checks that its rows fit.
fn table_writer(cfg: &Config, source: &SourceTable) -> Result<TableWriter, SinkError> {
    let ident = cfg.ident(&source.name)?;
    let arrow = ipc::decode_schema(&source.schema)?;
    let table = block_on(host_io::load_table(&ident)).map_err(|e| e.into_sink_error(&ident))?;
    let filter = cfg.filter_for(&source.name).map(|f| crate::overwrite::bind_filter(f, &table)).transpose()?;
    let placement = filter
        .as_ref()
        .map(|f| f.project(table.metadata().default_partition_spec()))
        .transpose()
        .map_err(FilterError::into_sink_error)?;
    let upsert = match (&cfg.key, cfg.upserts(&source.name)) {
        (Some(key), true) => Some(upsert_table(&table, key)?),
        _ => None,
    };
    let input = filter.is_none() && placement.is_none() && upsert.is_none();
    let (mut writer, read) = prepare_table_writer(cfg, table, &arrow, input)?;
    writer.filter = filter;
    writer.placement = placement;
    writer.upsert = upsert;
    columnar::project_input(&source.name, read.as_deref());
    Ok(writer)
}

/// The columns of `schema` a plain-append writer reads itself: those a
/// partition field of `spec` takes its value from, and those holding floats
/// (the manifest counts their NaNs). Top-level columns, whole; the schema
/// of just those, and their names.
fn input_schema(schema: &Schema, spec: &PartitionSpec) -> Result<(iceberg::spec::SchemaRef, Vec<String>), SinkError> {
    fn ids(field: &NestedField, out: &mut Vec<i32>) {
        out.push(field.id);
        match field.field_type.as_ref() {
            Type::Struct(s) => s.fields().iter().for_each(|f| ids(f, out)),
            Type::List(l) => ids(&l.element_field, out),
            Type::Map(m) => {
                ids(&m.key_field, out);
                ids(&m.value_field, out);
            }
            Type::Primitive(_) => {}
        }
    }
    fn floats(t: &Type) -> bool {
        match t {
            Type::Primitive(p) => matches!(p, PrimitiveType::Float | PrimitiveType::Double),
            Type::Struct(s) => s.fields().iter().any(|f| floats(&f.field_type)),
            Type::List(l) => floats(&l.element_field.field_type),
            Type::Map(m) => floats(&m.key_field.field_type) || floats(&m.value_field.field_type),
        }
    }
    let sources: Vec<i32> = spec.fields().iter().map(|f| f.source_id).collect();
    let read: Vec<NestedFieldRef> = schema
        .as_struct()
        .fields()
        .iter()
        .filter(|f| {
            let mut within = Vec::new();
            ids(f, &mut within);
            floats(&f.field_type) || within.iter().any(|id| sources.contains(id))
        })
        .cloned()
        .collect();
    let names = read.iter().map(|f| f.name.clone()).collect();
    let projected = Schema::builder()
        .with_schema_id(schema.schema_id())
        .with_fields(read)
        .build()
        .map_err(|e| iceberg_error("projecting the table schema onto the columns the writer reads", e))?;
    Ok((Arc::new(projected), names))
}

/// `batch` with [`INPUT_ROW`] last: each row's number in the host's batch.
fn with_input_rows(batch: RecordBatch) -> Result<RecordBatch, SinkError> {
    let n = u32::try_from(batch.num_rows())
        .map_err(|_| error::invalid_data(format!("a batch of {} rows, more than 2^32", batch.num_rows())))?;
    let mut fields: Vec<FieldRef> = batch.schema().fields().iter().cloned().collect();
    fields.push(Arc::new(Field::new(INPUT_ROW, DataType::UInt32, false)));
    let mut columns = batch.columns().to_vec();
    columns.push(Arc::new(UInt32Array::from_iter_values(0..n)));
    RecordBatch::try_new(Arc::new(ArrowSchema::new(fields)), columns)
        .map_err(|e| error::fatal(format!("numbering the input's rows: {e}")))
}

/// Refuses a table upsert mode cannot write (format version, key columns)
/// and readies the key columns and partition values of its rows.
fn upsert_table(table: &Table, key: &[String]) -> Result<UpsertTable, SinkError> {
    let ident = table.identifier().to_string();
    crate::committer::check_upsert_table(table)?;
    let schema = table.metadata().current_schema().clone();
    let found = crate::keys::key_columns(&ident, &schema, key)?;
    let fields = schema.as_struct().fields();
    let columns = found
        .ids
        .iter()
        .map(|id| {
            fields.iter().position(|f| f.id == *id).ok_or_else(|| {
                error::config(format!(
                    "[source] key: a key column of table {ident} is nested; a key column must be a top-level column"
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let spec = table.metadata().default_partition_spec().clone();
    let partitions = if spec.is_unpartitioned() {
        None
    } else {
        let calc = PartitionValueCalculator::try_new(&spec, &schema)
            .map_err(|e| iceberg_error("preparing the partition values", e))?;
        let ty = spec.partition_type(&schema).map_err(|e| iceberg_error("reading the partition spec", e))?;
        Some((calc, ty, spec))
    };
    Ok(UpsertTable { columns, names: found.names, partitions, log: WriterLog::default() })
}

/// A writer of `table` for rows of `arrow`; with `input`, one that reads
/// only [`input_schema`]'s columns, whose names come with it (the rest
/// stay with the host).
fn prepare_table_writer(
    cfg: &Config,
    table: Table,
    arrow: &SchemaRef,
    input: bool,
) -> Result<(TableWriter, Option<Vec<String>>), SinkError> {
    let table_schema = table.metadata().current_schema().clone();
    schema::check_compatible(arrow, &table_schema)?;
    schema::check_partitioning(cfg, &table)?;
    host_io::check_writable(&table)?;
    let spec = table.metadata().default_partition_spec().clone();
    let (schema, read) = if input {
        let (schema, names) = input_schema(&table_schema, &spec)?;
        (schema, Some(names))
    } else {
        (table_schema, None)
    };
    let splitter = if spec.is_unpartitioned() {
        None
    } else {
        Some(
            RecordBatchPartitionSplitter::try_new_with_computed_values(schema.clone(), spec)
                .map_err(|e| iceberg_error("preparing the partition splitter", e))?,
        )
    };
    let converter = BatchConverter::new(&schema)?;
    let writer = TableWriter {
        table,
        converter,
        splitter,
        open: None,
        partitions: 1,
        filter: None,
        placement: None,
        rows: 0,
        upsert: None,
        input,
    };
    Ok((writer, read))
}

/// Parquet settings for a writer whose rows spread over `partitions` open
/// files (see [`Inner::props`]); compaction writes with them too.
pub(crate) fn parquet_options(cfg: &Config, partitions: usize) -> columnar::WriterOptions {
    let share = (cfg.buffer_bytes / 6 / partitions.max(1)).max(MIN_ROW_GROUP_BYTES);
    let (compression, level) = host_compression(cfg.compression);
    let mut options = columnar::options(compression, level);
    options.max_row_group_bytes = Some(share as u64);
    options.created_by = Some(format!("sluice iceberg sink {}", env!("CARGO_PKG_VERSION")));
    options
}

impl Inner {
    fn table_mut(&mut self, table: &str) -> Result<&mut TableWriter, SinkError> {
        self.tables.get_mut(table).ok_or_else(|| {
            error::invalid_data(format!("rows of table {table:?}, which the engine has not announced to this writer"))
        })
    }

    /// Parquet settings for files of a table whose rows spread over
    /// `partitions` open files: each file's row groups are cut at its share
    /// of the writer's buffer (the same rule as before the host encoded, so
    /// files keep their row-group sizes). A file holds about four times its
    /// row group at the peak (measured: the encoded columns, the buffer
    /// Parquet writes them out of, dictionaries and page state); beside that
    /// rule, [`HOST_SHARE`] bounds what the host holds for all open files.
    fn props(&self, partitions: usize) -> columnar::WriterOptions {
        parquet_options(&self.cfg, partitions)
    }

    /// Cuts row groups of the open files until the host holds at most
    /// their share of `buffer_mb` for them.
    fn keep_within_budget(&mut self) -> Result<(), SinkError> {
        let budget = (self.cfg.buffer_bytes as u64) * HOST_SHARE.0 / HOST_SHARE.1;
        self.files.lock().keep_within(budget).map_err(error::fatal)
    }

    fn start_files(&mut self, table: &str) -> Result<OpenFiles, SinkError> {
        self.seq += 1;
        let prefix =
            format!("{}-s{}-a{}-w{}", incarnation::key(&self.ctx), self.ctx.subtask, self.ctx.attempt, self.seq);
        let partitions = self.table_mut(table)?.partitions;
        let (props, target, files) = (self.props(partitions), self.cfg.target_file_bytes, self.files.clone());
        let t = self.table_mut(table)?;
        let metadata = t.table.metadata();
        let names = DefaultFileNameGenerator::new(prefix, None, DataFileFormat::Parquet);
        let locations =
            DefaultLocationGenerator::new(metadata).map_err(|e| iceberg_error("choosing data file locations", e))?;
        let mut parquet = HostParquetWriterBuilder::new(props, metadata.current_schema().clone(), files)
            .map_err(|e| iceberg_error("preparing the Parquet writer", e))?;
        if t.input {
            parquet = parquet.for_input();
        }
        let rolling = RollingFileWriterBuilder::new(parquet, target, t.table.file_io().clone(), locations, names);
        let builder = DataFileWriterBuilder::new(rolling);
        if t.upsert.is_some() {
            Ok(OpenFiles::Keyed(Box::new(builder), HashMap::new()))
        } else if t.splitter.is_some() {
            Ok(OpenFiles::Partitioned(Box::new(FanoutWriter::new(builder))))
        } else {
            let writer = block_on(builder.build(None)).map_err(|e| iceberg_error("opening a data file writer", e))?;
            Ok(OpenFiles::Unpartitioned(Box::new(writer)))
        }
    }

    /// Upsert mode: writes the upsert rows of a change batch, logging each
    /// row's key, position in the source, and data file and row, and logs
    /// the deletes.
    fn write_changes(&mut self, table: &str, batch: &arrow_array::RecordBatch) -> Result<(), SinkError> {
        let changes = sluice_guest_sdk::changes::split(batch)?;
        let t = self.table_mut(table)?;
        let rows = t.converter.convert(&changes.rows)?;
        let first_row = t.rows;
        t.rows += rows.num_rows() as u64;
        let Some(up) = t.upsert.as_mut() else { return Err(error::fatal("upsert state missing")) };
        let keys = crate::keys::encode(&rows, &up.columns, &up.names).map_err(|m| {
            error::invalid_data(format!(
                "a row of this writer's input for table \"{table}\" (rows from {}): {m}",
                first_row + 1
            ))
        })?;
        let mut keys: Vec<Option<Vec<u8>>> = keys.into_iter().map(Some).collect();
        // The upsert rows of each partition, in order.
        let mut groups: Vec<(Option<Struct>, Vec<u32>)> = Vec::new();
        let mut group_of: HashMap<Option<Struct>, usize> = HashMap::new();
        let values = match &up.partitions {
            Some((calc, ty, _)) => {
                let array = calc.calculate(&rows).map_err(|e| iceberg_error("computing partition values", e))?;
                let literals = iceberg::arrow::arrow_struct_to_literal(&array, ty)
                    .map_err(|e| iceberg_error("computing partition values", e))?;
                Some(literals)
            }
            None => None,
        };
        for (i, op) in changes.ops.iter().enumerate() {
            if *op == sluice_guest_sdk::changes::DELETE {
                if let Some(key) = keys[i].take() {
                    up.log.delete(key, changes.seqs[i]);
                }
                continue;
            }
            let part = match &values {
                Some(v) => match v.get(i).cloned().flatten() {
                    Some(iceberg::spec::Literal::Struct(s)) => Some(s),
                    _ => {
                        return Err(error::fatal(format!(
                            "row {i} of a batch of table {table:?} has no partition value"
                        )));
                    }
                },
                None => None,
            };
            let at = *group_of.entry(part.clone()).or_insert_with(|| {
                groups.push((part, Vec::new()));
                groups.len() - 1
            });
            groups[at].1.push(i as u32);
        }
        t.partitions = t.partitions.max(groups.len());
        if groups.is_empty() {
            return Ok(());
        }
        let mut open = match self.table_mut(table)?.open.take() {
            Some(open) => open,
            None => self.start_files(table)?,
        };
        let t = self.table_mut(table)?;
        let result = (|| {
            let OpenFiles::Keyed(builder, writers) = &mut open else {
                return Err(error::fatal("upsert rows for a writer that is not keyed"));
            };
            let Some(up) = t.upsert.as_mut() else { return Err(error::fatal("upsert state missing")) };
            for (part, idx) in groups {
                let indices = arrow_array::UInt32Array::from(idx.clone());
                let rows = arrow_select::take::take_record_batch(&rows, &indices)
                    .map_err(|e| error::fatal(format!("taking the upsert rows apart: {e}")))?;
                let writer = match writers.entry(part.clone()) {
                    std::collections::hash_map::Entry::Occupied(w) => w.into_mut(),
                    std::collections::hash_map::Entry::Vacant(v) => {
                        let key = match (&part, &up.partitions) {
                            (Some(p), Some((_, _, spec))) => Some(PartitionKey::new(
                                spec.as_ref().clone(),
                                t.table.metadata().current_schema().clone(),
                                p.clone(),
                            )),
                            _ => None,
                        };
                        let w =
                            block_on(builder.build(key)).map_err(|e| iceberg_error("opening a data file writer", e))?;
                        v.insert(w)
                    }
                };
                let n = rows.num_rows() as u64;
                block_on(writer.write(rows))
                    .map_err(|e| iceberg_error(&format!("writing a data file of table {}", t.table.identifier()), e))?;
                // Read from the writer after the write: the file the rows
                // went to (the rolling writer never splits one write) and
                // how many rows it holds now.
                let path = writer.current_file_path();
                let after = writer.current_row_num() as u64;
                let first = after.checked_sub(n).ok_or_else(|| {
                    error::fatal(format!("the data file writer of {path} counts {after} rows after a write of {n}"))
                })?;
                let logged = idx.iter().map(|i| {
                    let i = *i as usize;
                    (keys[i].take().unwrap_or_default(), changes.seqs[i])
                });
                up.log.rows(&path, first, logged);
            }
            Ok(())
        })();
        t.open = Some(open);
        result?;
        self.keep_within_budget()
    }

    fn write_batch(&mut self, table: &str, batch: &arrow_array::RecordBatch) -> Result<(), SinkError> {
        if self.table_mut(table)?.upsert.is_some() {
            return self.write_changes(table, batch);
        }
        let t = self.table_mut(table)?;
        let batch = t.converter.convert(batch)?;
        let batch = if t.input { with_input_rows(batch)? } else { batch };
        if let Some(filter) = &t.filter
            && let Some(outside) = filter.first_row_outside(&batch).map_err(|e| e.into_sink_error())?
        {
            return Err(error::invalid_data(format!(
                "row {} of this writer's input for table \"{table}\": {outside} is outside overwrite_filter `{}` of \
                 table {}, so this run may not replace its rows; widen [sink.options] overwrite_filter or leave the row \
                 out of the input",
                t.rows + outside.row as u64,
                filter.source(),
                t.table.identifier()
            )));
        }
        // Split first: how many partitions the rows meet sizes the row groups.
        let parts = match &t.splitter {
            Some(splitter) => {
                let parts = splitter.split(&batch).map_err(|e| iceberg_error("splitting rows by partition", e))?;
                if let Some(placement) = &t.placement {
                    check_partitions_inside(table, t, splitter, placement, &batch, &parts)?;
                }
                t.partitions = t.partitions.max(parts.len());
                Some(parts)
            }
            None => None,
        };
        t.rows += batch.num_rows() as u64;
        let mut open = match self.table_mut(table)?.open.take() {
            Some(open) => open,
            None => self.start_files(table)?,
        };
        let t = self.table_mut(table)?;
        let result = block_on(async {
            match (&mut open, parts) {
                (OpenFiles::Unpartitioned(w), _) => w.write(batch).await,
                (OpenFiles::Partitioned(w), Some(parts)) => {
                    for (key, part) in parts {
                        w.write(key, part).await?;
                    }
                    Ok(())
                }
                (OpenFiles::Partitioned(_), None) => {
                    Err(iceberg::Error::new(iceberg::ErrorKind::Unexpected, "partitioned writer without a splitter"))
                }
                (OpenFiles::Keyed(..), _) => {
                    Err(iceberg::Error::new(iceberg::ErrorKind::Unexpected, "plain rows for a keyed writer"))
                }
            }
        });
        t.open = Some(open);
        result.map_err(|e| match e.kind() {
            // The host found the rows unfit for the table as it converted
            // them (a value that does not cast, a null in a required
            // column): the same answer as this plugin's own conversion.
            iceberg::ErrorKind::DataInvalid if t.input && e.message().contains(columnar::UNFIT) => {
                error::invalid_data(format!("rows of table {}: {}", t.table.identifier(), e.message()))
            }
            _ => iceberg_error(&format!("writing a data file of table {}", t.table.identifier()), e),
        })?;
        self.keep_within_budget()
    }

    /// Closes `table`'s open files: its data files, as JSON, and their paths.
    fn close_files(&mut self, table: &str) -> Result<Option<(TableFiles, Vec<String>)>, SinkError> {
        let t = self.table_mut(table)?;
        let files: Vec<DataFile> = match t.open.take() {
            None => Vec::new(),
            Some(open) => block_on(async {
                match open {
                    OpenFiles::Unpartitioned(mut w) => w.close().await,
                    OpenFiles::Partitioned(w) => w.close().await,
                    OpenFiles::Keyed(_, writers) => {
                        let mut all = Vec::new();
                        for (_, mut w) in writers {
                            all.extend(w.close().await?);
                        }
                        Ok(all)
                    }
                }
            })
            .map_err(|e| iceberg_error("finishing data files", e))?,
        };
        let changes: Vec<String> = match t.upsert.as_mut() {
            Some(up) => {
                check_logged_rows(&up.log, &files)?;
                up.log.take().into_iter().collect()
            }
            None => Vec::new(),
        };
        if files.is_empty() && changes.is_empty() {
            return Ok(None);
        }
        let metadata = t.table.metadata();
        let partition_type = metadata.default_partition_type().clone();
        let format_version = metadata.format_version();
        let spec_id = metadata.default_partition_spec_id();
        let mut paths = Vec::with_capacity(files.len());
        let mut encoded = Vec::with_capacity(files.len());
        for file in files {
            paths.push(file.file_path().to_string());
            encoded.push(
                serialize_data_file_to_json(file, &partition_type, format_version)
                    .map_err(|e| iceberg_error("encoding a data file", e))?,
            );
        }
        Ok(Some((TableFiles { table: table.to_string(), spec_id, files: encoded, changes }, paths)))
    }
}

impl GuestWriter for IcebergWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<SourceTable>,
        restored_state: Option<Vec<u8>>,
    ) -> Result<sluice_guest_sdk::Writer, SinkError> {
        let cfg = Config::parse(options)?;
        let state: State = sluice_guest_sdk::restored_state(restored_state)?.unwrap_or_default();
        let mut writers = BTreeMap::new();
        for table in &tables {
            writers.insert(table.name.clone(), table_writer(&cfg, table)?);
        }
        let inner = Inner {
            cfg,
            ctx,
            tables: writers,
            seq: 0,
            prepared: BTreeMap::new(),
            state,
            files: SharedHostFiles::default(),
        };
        Ok(sluice_guest_sdk::Writer::new(IcebergWriter { inner: RefCell::new(inner) }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        let (_, batches) = ipc::decode(rows)?;
        // Rows written from the host's input are numbered within the one
        // batch the host holds for the call.
        if batches.len() > 1 && inner.tables.get(&table).is_some_and(|t| t.input) {
            return Err(error::fatal(format!(
                "the host sent {} batches of table {table:?} in one call; a writer that reads the host's input \
                 takes one",
                batches.len()
            )));
        }
        for batch in batches.iter().filter(|b| b.num_rows() > 0) {
            inner.write_batch(&table, batch)?;
        }
        Ok(())
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let mut inner = self.inner.borrow_mut();
        inner.state.checkpoint = Some(c);
        let mut tables = Vec::new();
        let mut paths = Vec::new();
        let names: Vec<String> = inner.tables.keys().cloned().collect();
        for table in names {
            if let Some((files, mut table_paths)) = inner.close_files(&table)? {
                tables.push(files);
                paths.append(&mut table_paths);
            }
        }
        if tables.is_empty() {
            return Ok(None);
        }
        inner.prepared.insert(c, paths);
        // Only the newest prepared checkpoints can still be aborted.
        while inner.prepared.len() > 4 {
            inner.prepared.pop_first();
        }
        serde_json::to_vec(&CommitInfo { tables })
            .map(Some)
            .map_err(|e| error::fatal(format!("encoding the commit info: {e}")))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        let inner = self.inner.borrow();
        let state = State { checkpoint: Some(c.max(inner.state.checkpoint.unwrap_or(0))) };
        serde_json::to_vec(&state).map_err(|e| error::fatal(format!("encoding writer state: {e}")))
    }

    fn apply_changes(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        for change in &changes {
            // The barrier followed a prepare: nothing of the old shape is open.
            let writer = table_writer(&inner.cfg, &change.table)?;
            inner.tables.insert(change.table.name.clone(), writer);
        }
        Ok(())
    }

    /// Deletes the data files this writer prepared for checkpoint `c`.
    /// Precondition, which the host guarantees: the checkpoint's record is
    /// definitely not persisted (never combined, or its write was answered
    /// "not done"), so no commit can ever name these files; the host never
    /// calls it when the persist's outcome is unknown, since a recovery
    /// would then commit a snapshot naming them.
    fn abort_prepare(&self, c: u64) -> Result<(), SinkError> {
        let mut inner = self.inner.borrow_mut();
        if let Some(paths) = inner.prepared.remove(&c) {
            for path in paths {
                // Best effort: an orphan file is invisible and harmless.
                let _ = sluice_guest_sdk::files::delete(&path);
            }
        }
        Ok(())
    }

    fn close(&self) -> Result<(), SinkError> {
        // Dropping the open writers publishes nothing; their partial files
        // are invisible orphans.
        for t in self.inner.borrow_mut().tables.values_mut() {
            t.open = None;
        }
        Ok(())
    }
}

/// Every row the upsert log places must be in a file just closed, within
/// the rows that file holds: a position that is not is never handed on.
fn check_logged_rows(log: &WriterLog, files: &[DataFile]) -> Result<(), SinkError> {
    let counts: HashMap<&str, u64> = files.iter().map(|f| (f.file_path(), f.record_count())).collect();
    for (path, rows) in log.files().iter().zip(log.rows_per_file()) {
        match counts.get(path.as_str()) {
            Some(held) if *held >= rows => {}
            Some(held) => {
                return Err(error::fatal(format!(
                    "data file {path} holds {held} rows, and this writer placed {rows} rows in it; nothing of the \
                     checkpoint was handed on"
                )));
            }
            None => {
                return Err(error::fatal(format!(
                    "this writer placed rows in {path}, which is not among the data files it closed"
                )));
            }
        }
    }
    Ok(())
}

/// Refuses the batch when one of its partitions lies only partly inside
/// `overwrite_filter` (the row check passed, so its rows match, but the
/// partition's file would straddle the filter): the error names the first
/// such row with the contract's phrase.
fn check_partitions_inside(
    table: &str,
    t: &TableWriter,
    splitter: &RecordBatchPartitionSplitter,
    placement: &PartitionFilter,
    batch: &arrow_array::RecordBatch,
    parts: &[(iceberg::spec::PartitionKey, arrow_array::RecordBatch)],
) -> Result<(), SinkError> {
    for (key, _) in parts {
        if placement.classify(key.data()).map_err(FilterError::into_sink_error)? == Placement::Inside {
            continue;
        }
        // Only on the way to an error: find the first row of that partition
        // one row at a time (the splitter does not give row positions back).
        let mut row = 0;
        for i in 0..batch.num_rows() {
            let one =
                splitter.split(&batch.slice(i, 1)).map_err(|e| iceberg_error("splitting rows by partition", e))?;
            if one.first().is_some_and(|(k, _)| k.data() == key.data()) {
                row = i;
                break;
            }
        }
        let filter = t.filter.as_ref().map_or("", |f| f.source());
        return Err(error::invalid_data(format!(
            "row {} of this writer's input for table \"{table}\": its partition {} of table {} lies only partly inside \
             overwrite_filter `{filter}`, so its file would straddle the filter and no run could replace that partition \
             as a whole (Sluice replaces whole data files); make the filter cover whole partitions of the table's spec, \
             or leave the row out of the input",
            t.rows + row as u64,
            key.to_path(),
            t.table.identifier()
        )));
    }
    Ok(())
}
