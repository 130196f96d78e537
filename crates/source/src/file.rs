//! `file`: JSON lines, CSV or Parquet, read with the arrow crates.
//!
//! Where: a local path, or an object store (`s3://bucket/prefix`,
//! `gs://bucket/prefix`, read through `sluice-store`, see `object`), with
//! the same layouts, split, positions and identity rules. On an object
//! store a "folder" is a key prefix, listed once when the source opens; the
//! identity records each object's ETag (content-derived on S3) where a
//! local file's records its modification time.
//!
//! Layouts:
//! - one file, or a directory of files: one table, `""`;
//! - a tree with one folder per table (`<path>/<table>/*`): a subtask reads
//!   each of its tables' files in name order, so a table's rows keep their
//!   order.
//!
//! The split over subtasks is a pure function of a name and the
//! parallelism: a file (a table, in a tree) belongs to subtask
//! `fnv1a64(name) % p`. So files added to the folder never move a file
//! that was there to another subtask, and each file is read by exactly one
//! subtask however the folder grows. A subtask reads its files in name
//! order (`<table>/<file>` in a tree, compared by path component).
//!
//! A change stream (`[source] key`, see `changes`) splits otherwise where
//! a key's changes could go to two subtasks: in one folder of files every
//! subtask reads every file in name order and keeps only the rows whose key
//! hashes to it (`changes::owner`, FNV-1a of the key values' canonical
//! bytes, `changes::KEY_HASH_SCHEME`, recorded in the checkpoint), so
//! each key's changes reach one subtask in source order; the rows that are
//! no change (an unknown operation, a missing or null key) and the records
//! that do not convert are handed out only by the subtask the file's name
//! belongs to (`owner`), so each is a bad row once. In a tree the split by
//! table already keeps a key on one subtask. A change's position is `(hi,
//! lo)`: the file's 0-based ordinal in its table's name-ordered listing, and
//! the record's line as errors name it (a CSV record's line; a JSON lines
//! or Parquet record's 1-based number). The ordinal is stable because the
//! folder is append-only (below): a file already read keeps every file
//! before it. Positions and identities are the same as without keys: they
//! name the file and count the records read of it, kept or not.
//!
//! A subtask's position names a file, never an index: `{"at": name, "row":
//! r}` (r rows of that file delivered) or `{"after": name}` (every file of
//! the subtask up to that name delivered; `null`: none). The checkpoint's
//! identity of the source lists each consumed file with its size and
//! modification time; a resume refuses a consumed file that is gone or
//! changed, and a new file that sorts before what its subtask already read
//! (the folder is append-only). New files that sort after are read.
//! Positions of earlier versions (`{"file": index, "row": r}`) resume with
//! the split by index they were made with, unchecked.
//!
//! Schemas: Parquet files carry theirs; CSV is inferred from its first 1000
//! records; JSON lines from every record of the file, so that a field that
//! appears late becomes a nullable column and a number with a fraction
//! makes the column a double, from the file's first row on. A value that
//! fits no column type (a string among numbers, an integer that a double
//! would round) is refused naming the file, the line, the field and the
//! value. A UTF-8 byte order mark at the start of a JSON lines file is
//! skipped. Error line numbers are the file's own (1 is its first line).
//!
//! Later files of a table (CSV and JSON lines) are read with the types its
//! first file gave it ([`Known`]): a column the first file has keeps that
//! type where reading the file's values as it loses nothing, and other
//! columns are inferred. So one bad value in a later file is an error
//! naming the file, the line, the column, the value and the type, never a
//! column silently turned into strings and then reported as a schema
//! change. A file's reading schema depends on itself and the table's first
//! file only, so it is the same in every run and every subtask, and files
//! appended later change no other file's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::reader::ChunkReader;
use serde_json::{Value, json};

use super::changes::{ChangeSpec, KEY_HASH_SCHEME, Share};
use super::object::{Bucket, ObjectFile};
use super::{BadRow, BadRows, FileIdentity, Origin, Rejected, SourceChange, SourceError, SourceReader, TableBatch};
use crate::config::FileFormat;
use sluice_core::location::{Location, Scheme, Served};
use sluice_store::{ObjectStore, StoreOptions as StoreConfig};

const INFER_RECORDS: usize = 1000;

/// What a file's reader hands out, in file order: rows, or one record that
/// did not convert (only when bad rows are dead letters).
enum Piece {
    Rows(RecordBatch),
    Bad(BadRow),
}

type BatchIter = Box<dyn Iterator<Item = Result<Piece, ArrowError>> + Send>;

/// The lines of a JSON lines file that do not fit its reading schema, with
/// the reason (kept only when bad rows are dead letters).
type BadLines = Arc<BTreeMap<u64, String>>;

/// Schemas inferred so far, by file (as [`At::shown`] names it): a JSON
/// file is read in full to infer its schema, so each file is inferred once
/// per run.
type SchemaCache = Arc<Mutex<HashMap<String, (SchemaRef, BadLines)>>>;

/// The schema each file of a table is read with (see the module's doc): a
/// table's first file with its own inferred schema; every later one with
/// its own columns, in its order, each column the first file has typed as
/// the first file types it (where that loses nothing: [`with_known_types`]).
/// Only the first file matters, so a file's reading schema is the same in
/// every run and every subtask, files appended later change no earlier
/// file's, and no file but the first and itself is ever inferred for it.
#[derive(Clone, Default)]
struct Known {
    /// Each table's first file, in reading order: (name, where).
    first: Arc<HashMap<String, (String, At)>>,
    /// Reading schemas, by file (as [`At::shown`] names it).
    reading: SchemaCache,
    /// Bad rows are dead letters: a JSON lines record that does not fit is
    /// left out of inference and kept aside ([`json::infer`]).
    keep_bad: bool,
}

impl Known {
    fn new(tables: &[TableFiles]) -> Self {
        let first = tables
            .iter()
            .filter_map(|t| t.files.first().map(|f| (t.name.clone(), (f.name.clone(), f.at.clone()))))
            .collect();
        Self { first: Arc::new(first), ..Self::default() }
    }

    /// The schema file `name` (at `at`) of `table` is read with.
    fn schema_of(
        &self,
        table: &str,
        name: &str,
        at: &At,
        format: FileFormat,
        csv_header: bool,
    ) -> Result<SchemaRef, SourceError> {
        Ok(self.reading_of(table, name, at, format, csv_header)?.0)
    }

    /// [`Known::schema_of`], with the file's bad JSON lines.
    fn reading_of(
        &self,
        table: &str,
        name: &str,
        at: &At,
        format: FileFormat,
        csv_header: bool,
    ) -> Result<(SchemaRef, BadLines), SourceError> {
        let known = match self.first.get(table) {
            // Parquet files carry their types: a different one is a real schema change.
            _ if format == FileFormat::Parquet => None,
            Some((first, first_at)) if first != name => {
                Some(cached_schema(&self.reading, first_at, format, csv_header, None, self.keep_bad)?.0)
            }
            _ => None,
        };
        cached_schema(&self.reading, at, format, csv_header, known.as_deref(), self.keep_bad)
    }
}

/// `inferred` (a later file's own schema) with each column the table's
/// `known` schema has typed as `known` types it, where reading the file's
/// values as that type loses nothing: text as text always; for CSV, a
/// known integer or boolean column (whose parsers refuse what does not fit:
/// `1.5` or `x7` as an integer, `yes` as a boolean) over text, a double or
/// an integer; for JSON lines any type of one value, since inference has
/// already refused a value of another kind ([`json::infer`]). Otherwise
/// (a date read from timestamps, an integer past 2^53 into a double, a
/// nested column, a column the first file held no value in) the file keeps
/// its own type and the table's schema rules decide.
fn with_known_types(inferred: &SchemaRef, known: &arrow_schema::Schema, format: FileFormat) -> SchemaRef {
    use arrow_schema::DataType as D;
    let lossless = |k: &D, f: &D| -> bool {
        if k == f || k.is_nested() || k == &D::Null {
            return false;
        }
        match (format, k) {
            (_, D::Utf8 | D::LargeUtf8) => true,
            (FileFormat::Csv, D::Int8 | D::Int16 | D::Int32 | D::Int64 | D::Boolean) => {
                matches!(f, D::Utf8 | D::LargeUtf8 | D::Null | D::Float64 | D::Int64)
            }
            (FileFormat::Json, _) => true,
            _ => false,
        }
    };
    let fields: Vec<arrow_schema::FieldRef> = inferred
        .fields()
        .iter()
        .map(|f| match known.field_with_name(f.name()) {
            Ok(k) if lossless(k.data_type(), f.data_type()) => {
                Arc::new(f.as_ref().clone().with_data_type(k.data_type().clone()))
            }
            _ => f.clone(),
        })
        .collect();
    Arc::new(arrow_schema::Schema::new_with_metadata(fields, inferred.metadata().clone()))
}

/// Where a data file is.
#[derive(Debug, Clone)]
enum At {
    Local(PathBuf),
    /// An object, with the size it was listed with.
    Object(ObjectFile),
}

impl At {
    /// The file as messages name it: its path, or its URL.
    fn shown(&self) -> String {
        match self {
            At::Local(path) => path.display().to_string(),
            At::Object(object) => object.url().to_string(),
        }
    }

    fn err(&self, e: impl std::fmt::Display) -> SourceError {
        SourceError::File { path: self.shown(), message: e.to_string() }
    }

    /// A buffered reader from the file's start.
    fn open(&self) -> Result<Box<dyn BufRead + Send>, SourceError> {
        match self {
            At::Local(path) => Ok(Box::new(std::io::BufReader::new(File::open(path).map_err(|e| file_err(path, e))?))),
            At::Object(object) => Ok(Box::new(object.reader(0))),
        }
    }
}

/// A data file as the source found it when it opened.
#[derive(Debug, Clone)]
struct DataFile {
    at: At,
    /// Relative to the source's root: `<file>`, or `<table>/<file>` in a tree.
    name: String,
    size: u64,
    /// Local files: modification time. Objects: 0 (their ETag is kept).
    mtime_ns: u64,
    /// Objects: the ETag they were listed with.
    etag: Option<String>,
}

impl DataFile {
    fn stat(path: PathBuf, name: String) -> Result<Self, SourceError> {
        let meta = std::fs::metadata(&path).map_err(|e| file_err(&path, e))?;
        let mtime_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Ok(Self { at: At::Local(path), name, size: meta.len(), mtime_ns, etag: None })
    }

    fn object(bucket: &Bucket, info: &sluice_store::ObjectInfo, name: String) -> Self {
        Self { at: At::Object(bucket.file(info)), name, size: info.size, mtime_ns: 0, etag: info.etag.clone() }
    }

    fn identity(&self) -> FileIdentity {
        FileIdentity { name: self.name.clone(), size: self.size, mtime_ns: self.mtime_ns, etag: self.etag.clone() }
    }
}

/// What a source's location holds: its files by table, before any is read.
struct Listing {
    /// The folder names are relative to (for an object store, its URL).
    root: PathBuf,
    /// One folder per table.
    tree: bool,
    tables: Vec<(String, Vec<DataFile>)>,
}

/// Whether a file named `name` is a data file of `format` (any data file
/// when no format is given).
fn is_data_file(name: &str, format: Option<FileFormat>) -> bool {
    match (format, FileFormat::from_path(Path::new(name))) {
        (Some(f), Some(g)) => f == g,
        (None, Some(_)) => true,
        _ => false,
    }
}

/// Lists an object-store location (`s3://bucket/prefix`): one object, or
/// the objects under the prefix (a table's files directly under it, or one
/// folder per table), as a local directory would be read.
fn list_objects(url: &str, format: Option<FileFormat>, stores: &StoreConfig) -> Result<Listing, SourceError> {
    let refused = |message: String| SourceError::File { path: url.to_string(), message };
    let location =
        Location::parse(url, Path::new("/"), Served { stores: &Scheme::ALL }).map_err(|e| refused(e.to_string()))?;
    let Location::ObjectStore { prefix, .. } = &location else {
        return Err(refused("not an object-store location".to_string()));
    };
    let bucket = Bucket::new(ObjectStore::open(&location, stores).map_err(|e| refused(e.to_string()))?);
    if !prefix.is_empty()
        && let Some(info) = bucket.stat(prefix)?
    {
        let (parent, name) = prefix.rsplit_once('/').unwrap_or(("", prefix.as_str()));
        let file = DataFile::object(&bucket, &info, name.to_string());
        return Ok(Listing {
            root: PathBuf::from(bucket.url(parent)),
            tree: false,
            tables: vec![(String::new(), vec![file])],
        });
    }
    let strip = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
    let (mut top, mut folders) = (Vec::new(), BTreeSet::new());
    let mut by_table: BTreeMap<String, Vec<DataFile>> = BTreeMap::new();
    // Sorted by key, so each table's files come in name order.
    for info in bucket.list(prefix)? {
        let Some(rel) = info.key.strip_prefix(&strip) else { continue };
        let parts: Vec<&str> = rel.split('/').collect();
        match parts.as_slice() {
            [file] if is_data_file(file, format) => top.push(DataFile::object(&bucket, &info, file.to_string())),
            [table, rest @ ..] if !rest.is_empty() && !table.starts_with('.') => {
                folders.insert(table.to_string());
                // A table's own files; objects deeper in it are not its rows.
                if let [file] = rest
                    && is_data_file(file, format)
                {
                    let name = format!("{table}/{file}");
                    by_table.entry(table.to_string()).or_default().push(DataFile::object(&bucket, &info, name));
                }
            }
            _ => {}
        }
    }
    let root = PathBuf::from(location.to_string());
    if !top.is_empty() && !folders.is_empty() {
        return Err(refused(
            "holds both data files and folders: keep one table's files under the prefix, or one folder per table"
                .to_string(),
        ));
    }
    if !top.is_empty() {
        return Ok(Listing { root, tree: false, tables: vec![(String::new(), top)] });
    }
    let mut tables = Vec::new();
    for folder in folders {
        match by_table.remove(&folder) {
            Some(files) => tables.push((folder, files)),
            None => {
                tracing::warn!(folder = %format!("{location}/{folder}"), "the table folder holds no csv, json or parquet files; skipped")
            }
        }
    }
    Ok(Listing { root, tree: !tables.is_empty(), tables })
}

/// Parquet batches of `reader` (a local file or an object), after `skip` rows.
fn parquet_batches<R: ChunkReader + 'static>(
    reader: R,
    at: &At,
    batch_rows: usize,
    skip: u64,
) -> Result<BatchIter, SourceError> {
    let builder = ParquetRecordBatchReaderBuilder::try_new(reader).map_err(|e| at.err(e))?;
    // Each row group's first row, so that an error names the row group and the row.
    let mut starts = Vec::new();
    let mut first = 0u64;
    for group in builder.metadata().row_groups() {
        starts.push(first);
        first += u64::try_from(group.num_rows()).unwrap_or(0);
    }
    let reader = builder
        .with_batch_size(batch_rows)
        .with_offset(usize::try_from(skip).map_err(|e| at.err(e))?)
        .build()
        .map_err(|e| at.err(e))?;
    let mut row = skip;
    Ok(Box::new(reader.map(move |r| match r {
        Ok(batch) => {
            row += batch.num_rows() as u64;
            Ok(Piece::Rows(batch))
        }
        Err(e) => {
            let group = starts.iter().rposition(|s| *s <= row).unwrap_or(0);
            let within = row - starts.get(group).copied().unwrap_or(0);
            Err(ArrowError::ParquetError(format!(
                "row group {group}, from its row {within} (row {row} of the file): {e}"
            )))
        }
    })))
}

/// Reading order of two names: by path component, as the folders are listed.
fn before(a: &str, b: &str) -> bool {
    Path::new(a) < Path::new(b)
}

/// The subtask a name belongs to: FNV-1a (64 bit) of its bytes, modulo the
/// parallelism. Stable across runs, platforms and versions.
fn owner(name: &str, parallelism: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % u64::from(parallelism.max(1))) as u32
}

/// One table's files, in reading order.
struct TableFiles {
    name: String,
    files: Vec<DataFile>,
}

pub struct FileSource {
    /// The folder names are relative to (for an object store, its URL,
    /// which `Path::join` extends with `/` as a URL is).
    root: PathBuf,
    tables: Vec<TableFiles>,
    /// One folder per table.
    tree: bool,
    format: FileFormat,
    batch_rows: usize,
    csv_header: bool,
    parallelism: u32,
    rate: Option<f64>,
    known: Known,
    bad_rows: BadRows,
    rejected: Rejected,
    /// A change stream (`[source] key`): its rows become changes ([`changes`]).
    changes: Option<ChangeSpec>,
}

/// Refuses a table's first-file `schema` with columns of Arrow's `Null`
/// type (CSV inference gives it to a column with no value in the records
/// it reads: every column of a file that is only a header).
fn untyped_columns(schema: &arrow_schema::Schema, table: &str, format: FileFormat) -> Result<(), String> {
    if format != FileFormat::Csv {
        return Ok(());
    }
    let untyped: Vec<&str> = schema
        .fields()
        .iter()
        .filter(|f| f.data_type() == &arrow_schema::DataType::Null)
        .map(|f| f.name().as_str())
        .collect();
    if untyped.is_empty() {
        return Ok(());
    }
    let table = if table.is_empty() { "the source's table".to_string() } else { format!("table {table:?}") };
    let why = if untyped.len() == schema.fields().len() {
        "holds no records (only a header), so no column has a type".to_string()
    } else {
        format!(
            "gives column(s) {} no value in the first {INFER_RECORDS} records, so they have no type",
            untyped.iter().map(|c| format!("`{c}`")).collect::<Vec<_>>().join(", ")
        )
    };
    Err(format!(
        "is the first file of {table} (its columns' types come from it) and {why}; put a file with values in \
         every column first (files are read in name order), or remove this one"
    ))
}

/// Refuses a change stream whose table's first file (`schema`, at `at`)
/// lacks a key column or the change column: every row would be a bad row.
fn check_change_columns(
    spec: &ChangeSpec,
    schema: &arrow_schema::Schema,
    table: &str,
    at: &At,
) -> Result<(), SourceError> {
    let lacks = |key: &str, column: &str| {
        let table = if table.is_empty() { String::new() } else { format!(" (table {table:?})") };
        let has: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        SourceError::Config {
            key: key.to_string(),
            message: format!(
                "names column `{column}`, which {}{table}, the first file read, does not have (it has: {})",
                at.shown(),
                has.join(", ")
            ),
        }
    };
    for column in &spec.key {
        let Ok(field) = schema.field_with_name(column) else { return Err(lacks("source.key", column)) };
        if let Err(why) = super::changes::check_key_type(field.data_type()) {
            let table = if table.is_empty() { String::new() } else { format!(" of table {table:?}") };
            return Err(SourceError::Config {
                key: "source.key".to_string(),
                message: format!(
                    "names column `{column}`{table} (typed by {}, the first file read), which {why}",
                    at.shown()
                ),
            });
        }
    }
    match &spec.column {
        Some(column) if schema.field_with_name(column).is_err() => Err(lacks("source.change_column", column)),
        _ => Ok(()),
    }
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> SourceError {
    SourceError::File { path: path.display().to_string(), message: e.to_string() }
}

/// The data files in `dir` (of `format`, when given), sorted by name.
fn data_files(dir: &Path, format: Option<FileFormat>) -> Result<Vec<PathBuf>, SourceError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| file_err(dir, e))? {
        let p = entry.map_err(|e| file_err(dir, e))?.path();
        let matches = match (format, FileFormat::from_path(&p)) {
            (Some(f), Some(g)) => f == g,
            (None, Some(_)) => true,
            _ => false,
        };
        if p.is_file() && matches {
            files.push(p);
        }
    }
    files.sort();
    Ok(files)
}

/// A file's name as checkpoints record it. A name that is not UTF-8 is
/// refused: two such names could read alike once made text, and a resume
/// would take one file for the other.
fn file_name(p: &Path) -> Result<String, SourceError> {
    match p.file_name() {
        None => Ok(String::new()),
        Some(n) => n.to_str().map(str::to_string).ok_or_else(|| {
            file_err(p, "its name is not valid UTF-8; Sluice records consumed files by name, so rename it")
        }),
    }
}

/// How a position is read: by name (this version), or by index into the
/// split of earlier versions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    ByName,
    LegacyIndex,
}

impl FileSource {
    /// The source at `path`: a local path, or an object-store URL
    /// (`s3://bucket/prefix`, `gs://bucket/prefix`), its store reached as
    /// `stores` says (`[source.s3]`, `[source.gcs]`). Lists and stats only.
    pub fn open(
        path: &Path,
        format: Option<FileFormat>,
        batch_rows: usize,
        csv_header: bool,
        parallelism: u32,
        stores: &StoreConfig,
    ) -> Result<Self, SourceError> {
        let listing = match path.to_str() {
            Some(url) if url.contains("://") => list_objects(url, format, stores)?,
            _ => Self::list_local(path, format)?,
        };
        let shown = path.display().to_string();
        let Listing { root, tree, tables: layout } = listing;
        let first = layout.iter().flat_map(|(_, f)| f.first()).next().ok_or_else(|| SourceError::File {
            path: shown.clone(),
            message: "holds no csv, json or parquet files".to_string(),
        })?;
        let format = match format.or_else(|| FileFormat::from_path(Path::new(&first.name))) {
            Some(f) => f,
            None => return Err(first.at.err("cannot tell the format from the extension; set source.format")),
        };
        if let Some(odd) = layout
            .iter()
            .flat_map(|(_, f)| f)
            .find(|f| FileFormat::from_path(Path::new(&f.name)).is_some_and(|f| f != format))
        {
            return Err(odd.at.err("has a different format than the other files; keep one format per source"));
        }
        let tables: Vec<TableFiles> = layout.into_iter().map(|(name, files)| TableFiles { name, files }).collect();
        let known = Known::new(&tables);
        Ok(Self {
            root,
            tables,
            tree,
            format,
            batch_rows,
            csv_header,
            parallelism,
            rate: None,
            known,
            bad_rows: BadRows::Fail,
            rejected: Rejected::default(),
            changes: None,
        })
    }

    /// Lists a local file or directory.
    fn list_local(path: &Path, format: Option<FileFormat>) -> Result<Listing, SourceError> {
        let mut layout: Vec<(String, Vec<(PathBuf, String)>)> = Vec::new();
        let mut tree = false;
        let root =
            if path.is_dir() { path.to_path_buf() } else { path.parent().unwrap_or(Path::new(".")).to_path_buf() };
        if path.is_dir() {
            let files = data_files(path, format)?;
            let mut folders: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| file_err(path, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir() && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
                .collect();
            folders.sort();
            match (files.is_empty(), folders.is_empty()) {
                (false, _) if !folders.is_empty() => {
                    return Err(file_err(
                        path,
                        "holds both data files and folders: keep one table's files in the directory, or one folder per table",
                    ));
                }
                (false, _) => {
                    let named = files.into_iter().map(|f| Ok((f.clone(), file_name(&f)?))).collect::<Result<_, _>>()?;
                    layout.push((String::new(), named))
                }
                (true, false) => {
                    tree = true;
                    for folder in folders {
                        let name = file_name(&folder)?;
                        let files = data_files(&folder, format)?;
                        if files.is_empty() {
                            tracing::warn!(folder = %folder.display(), "the table folder holds no csv, json or parquet files; skipped");
                            continue;
                        }
                        let named = files
                            .into_iter()
                            .map(|f| Ok((f.clone(), format!("{name}/{}", file_name(&f)?))))
                            .collect::<Result<_, SourceError>>()?;
                        layout.push((name, named));
                    }
                }
                (true, true) => {}
            }
        } else {
            layout.push((String::new(), vec![(path.to_path_buf(), file_name(path)?)]));
        }
        // Only listed and stat'ed here: nothing is read before a resume has
        // checked the files against its checkpoint (a changed file may no
        // longer parse).
        let mut tables = Vec::with_capacity(layout.len());
        for (name, files) in layout {
            let files = files.into_iter().map(|(p, n)| DataFile::stat(p, n)).collect::<Result<Vec<_>, _>>()?;
            tables.push((name, files));
        }
        Ok(Listing { root, tree, tables })
    }

    /// Limits the rows per second over all subtasks.
    /// What a record that does not convert does (`job.bad_rows`).
    pub fn with_bad_rows(mut self, bad_rows: BadRows) -> Self {
        self.bad_rows = bad_rows;
        self.known.keep_bad = bad_rows == BadRows::DeadLetter;
        self
    }

    /// Records a sink rejected: read again, they are dead letters.
    pub fn with_rejected(mut self, rejected: Rejected) -> Self {
        self.rejected = rejected;
        self
    }

    /// Makes the source a change stream (`None`: an append stream). The key
    /// names at least one column, and the change column is none of them.
    pub fn with_changes(mut self, changes: Option<ChangeSpec>) -> Result<Self, SourceError> {
        if let Some(spec) = &changes {
            let config = |key: &str, message: String| SourceError::Config { key: key.to_string(), message };
            if spec.key.is_empty() || spec.key.iter().any(String::is_empty) {
                return Err(config("source.key", "must name at least one column, and no empty name".to_string()));
            }
            if let Some(column) = &spec.column
                && spec.key.contains(column)
            {
                return Err(config(
                    "source.change_column",
                    format!("{column:?} is also a key column (source.key); the change column is consumed"),
                ));
            }
        }
        self.changes = changes;
        Ok(self)
    }

    /// The change key when the source is a change stream.
    pub fn change_key(&self) -> Option<&[String]> {
        self.changes.as_ref().map(|c| c.key.as_slice())
    }

    /// A change stream of one folder of files at parallelism > 1: every
    /// subtask reads every file and keeps the rows whose key hashes to it.
    fn hashes_keys(&self) -> bool {
        self.changes.is_some() && !self.tree && self.parallelism > 1
    }

    pub fn with_rate(mut self, rate: Option<f64>) -> Self {
        self.rate = rate;
        self
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The tables, with the schemas of their first files (read now, once).
    /// A first file that gives a column no type (a CSV header with no
    /// records under it, a column every record leaves empty) is refused,
    /// naming the file and the table: no table can take a column of no type.
    pub fn tables(&self) -> Result<Vec<(String, SchemaRef)>, SourceError> {
        self.tables
            .iter()
            .map(|t| {
                let first = &t.files[0];
                let schema = self.known.schema_of(&t.name, &first.name, &first.at, self.format, self.csv_header)?;
                untyped_columns(&schema, &t.name, self.format).map_err(|m| first.at.err(m))?;
                match &self.changes {
                    Some(spec) => {
                        check_change_columns(spec, &schema, &t.name, &first.at)?;
                        Ok((t.name.clone(), spec.table_schema(&schema)))
                    }
                    None => Ok((t.name.clone(), schema)),
                }
            })
            .collect()
    }

    /// One folder per table.
    pub fn format(&self) -> FileFormat {
        self.format
    }

    pub fn is_tree(&self) -> bool {
        self.tree
    }

    pub fn batch_rows(&self) -> usize {
        self.batch_rows
    }

    pub fn describe(&self) -> String {
        let files: usize = self.tables.iter().map(|t| t.files.len()).sum();
        let format = format!("{:?}", self.format).to_lowercase();
        if self.tree {
            let names: Vec<&str> = self.tables.iter().map(|t| t.name.as_str()).collect();
            format!("{files} {format} file(s) in {} table folder(s): {}", names.len(), names.join(", "))
        } else {
            format!("{files} {format} file(s)")
        }
    }

    /// The files subtask `subtask` reads, in order, with their tables.
    fn files_of(&self, subtask: u32, split: Split) -> Vec<(String, DataFile)> {
        let p = self.parallelism.max(1);
        let with_table = |t: &TableFiles, f: &DataFile| (t.name.clone(), f.clone());
        match (split, self.tree) {
            (Split::ByName, true) => self
                .tables
                .iter()
                .filter(|t| owner(&t.name, p) == subtask)
                .flat_map(|t| t.files.iter().map(move |f| with_table(t, f)))
                .collect(),
            // Every subtask reads every file, keeping its keys' rows.
            (Split::ByName, false) if self.changes.is_some() => {
                self.tables.iter().flat_map(|t| t.files.iter().map(move |f| with_table(t, f))).collect()
            }
            (Split::ByName, false) => self
                .tables
                .iter()
                .flat_map(|t| t.files.iter().filter(|f| owner(&f.name, p) == subtask).map(move |f| with_table(t, f)))
                .collect(),
            (Split::LegacyIndex, true) => self
                .tables
                .iter()
                .enumerate()
                .filter(|(j, _)| *j as u32 % p == subtask)
                .flat_map(|(_, t)| t.files.iter().map(move |f| with_table(t, f)))
                .collect(),
            (Split::LegacyIndex, false) => self
                .tables
                .iter()
                .flat_map(|t| t.files.iter().map(move |f| with_table(t, f)))
                .enumerate()
                .filter(|(i, _)| *i as u32 % p == subtask)
                .map(|(_, f)| f)
                .collect(),
        }
    }

    /// The name of the last file a position has consumed (in whole or in
    /// part): `Ok(None)` when none, `Err(())` for an index position of an
    /// earlier version.
    fn frontier(position: &Value) -> Result<Option<&str>, ()> {
        if let Some(at) = position.get("at").and_then(Value::as_str) {
            return Ok(Some(at));
        }
        match position.get("after") {
            Some(Value::String(after)) => Ok(Some(after)),
            Some(Value::Null) => Ok(None),
            _ => Err(()),
        }
    }

    /// The files each subtask consumed at `positions`, as they were when
    /// this run opened them; `None` for positions of an earlier version.
    pub fn identity(&self, positions: &[&Value]) -> Option<super::SourceIdentity> {
        let mut subtasks = Vec::with_capacity(positions.len());
        for (s, position) in positions.iter().enumerate() {
            let frontier = Self::frontier(position).ok()?;
            let consumed = match frontier {
                None => Vec::new(),
                Some(last) => self
                    .files_of(s as u32, Split::ByName)
                    .into_iter()
                    .filter(|(_, f)| !before(last, &f.name))
                    .map(|(_, f)| f.identity())
                    .collect(),
            };
            subtasks.push(consumed);
        }
        Some(super::SourceIdentity::File {
            subtasks,
            key: self.change_key().map(<[String]>::to_vec),
            key_hash: self.changes.as_ref().map(|_| KEY_HASH_SCHEME.to_string()),
        })
    }

    /// Refuses to resume when a file a subtask consumed is gone or changed,
    /// or a file new to the folder sorts before what its subtask read.
    /// A checkpoint of a change stream (`key`) resumes only as the same
    /// change stream, and one of an append stream only as an append stream:
    /// their splits and rows differ, so a position of one means other rows
    /// in the other. A change stream's checkpoint resumes only under the key
    /// hash scheme it recorded (`key_hash`, [`KEY_HASH_SCHEME`]): under
    /// another, a key could move to another subtask, whose position is
    /// elsewhere in the files, and its changes be skipped or applied out of
    /// order. One that recorded none (taken before schemes were kept) is
    /// refused too.
    pub fn check_identity(
        &self,
        recorded: &[Vec<FileIdentity>],
        key: Option<&[String]>,
        key_hash: Option<&str>,
    ) -> Result<(), SourceChange> {
        if key != self.change_key() {
            let shown = |k: Option<&[String]>| match k {
                Some(k) => format!("a change stream keyed by {k:?}"),
                None => "an append stream (no source.key)".to_string(),
            };
            return Err(SourceChange(format!(
                "the checkpoint was taken of {}, and the job now reads {}; start the job over in a fresh state \
                 directory, or set source.key back",
                shown(key),
                shown(self.change_key())
            )));
        }
        if key.is_some() && key_hash != Some(KEY_HASH_SCHEME) {
            let then = match key_hash {
                Some(scheme) => format!("by key hash scheme {scheme:?}"),
                None => "by a key hash scheme it did not record (an earlier version's)".to_string(),
            };
            return Err(SourceChange(format!(
                "the checkpoint was taken of a change stream whose keys went to subtasks {then}, and this version \
                 hashes keys by {KEY_HASH_SCHEME:?}: a key could move to another subtask, and its changes be \
                 skipped or applied out of order. Start the job over in a fresh job.state_dir with \
                 --new-incarnation"
            )));
        }
        let now: HashMap<&str, &DataFile> =
            self.tables.iter().flat_map(|t| t.files.iter()).map(|f| (f.name.as_str(), f)).collect();
        let shown = |name: &str| self.root.join(name).display().to_string();
        for consumed in recorded {
            for was in consumed {
                let problem = match now.get(was.name.as_str()) {
                    None => "is gone".to_string(),
                    Some(is) if is.size < was.size => format!("shrank from {} to {} bytes", was.size, is.size),
                    Some(is) if is.size != was.size => format!("grew from {} to {} bytes", was.size, is.size),
                    Some(is) if is.mtime_ns != was.mtime_ns => {
                        format!("was modified (its modification time changed, size {} bytes)", is.size)
                    }
                    Some(is) if was.etag.is_some() && is.etag != was.etag => format!(
                        "was modified (its ETag changed from {} to {}, size {} bytes)",
                        was.etag.as_deref().unwrap_or("none"),
                        is.etag.as_deref().unwrap_or("none"),
                        is.size
                    ),
                    Some(_) => continue,
                };
                return Err(SourceChange(format!(
                    "source file {} {problem} since it was read; the checkpoint's positions count rows of the file as it was",
                    shown(&was.name)
                )));
            }
        }
        for (s, consumed) in recorded.iter().enumerate() {
            let Some(last) = consumed.last() else { continue };
            let known: std::collections::HashSet<&str> = consumed.iter().map(|f| f.name.as_str()).collect();
            if let Some((_, new)) = self
                .files_of(s as u32, Split::ByName)
                .into_iter()
                .find(|(_, f)| !known.contains(f.name.as_str()) && before(&f.name, &last.name))
            {
                return Err(SourceChange(format!(
                    "source file {} is new and sorts before {}, which was already read; files are read in name \
                     order and the folder is append-only: a file added later must sort after every file already read",
                    shown(&new.name),
                    shown(&last.name)
                )));
            }
        }
        Ok(())
    }

    pub fn reader(&self, subtask: u32, position: Option<&Value>) -> Result<FileReader, SourceError> {
        let bad = |v: &Value, message: String| SourceError::Position { position: v.to_string(), message };
        let (split, file_idx, row, mine) = match position {
            None => (Split::ByName, 0, 0, self.files_of(subtask, Split::ByName)),
            Some(v) if v.get("file").is_some() => {
                // A position of an earlier version: an index into the split by index.
                let mine = self.files_of(subtask, Split::LegacyIndex);
                let f = v.get("file").and_then(Value::as_u64);
                let r = v.get("row").and_then(Value::as_u64);
                match (f, r) {
                    (Some(f), Some(r)) if f as usize <= mine.len() => (Split::LegacyIndex, f as usize, r, mine),
                    _ => {
                        return Err(bad(
                            v,
                            format!("subtask {subtask} has {} file(s) (did the input change?)", mine.len()),
                        ));
                    }
                }
            }
            Some(v) => {
                let mine = self.files_of(subtask, Split::ByName);
                match Self::frontier(v) {
                    Ok(Some(at)) if v.get("at").is_some() => {
                        let row = v.get("row").and_then(Value::as_u64).ok_or_else(|| bad(v, "no row".into()))?;
                        let idx = mine.iter().position(|(_, f)| f.name == at).ok_or_else(|| {
                            bad(v, format!("subtask {subtask} no longer has file {at} (was it removed?)"))
                        })?;
                        (Split::ByName, idx, row, mine)
                    }
                    Ok(Some(after)) => {
                        let idx = mine.iter().take_while(|(_, f)| !before(after, &f.name)).count();
                        (Split::ByName, idx, 0, mine)
                    }
                    Ok(None) => (Split::ByName, 0, 0, mine),
                    Err(()) => return Err(bad(v, "expected {\"at\": file, \"row\": n} or {\"after\": file}".into())),
                }
            }
        };
        // A file's ordinal in its table's listing: the major part of its changes' positions.
        let ordinals = mine
            .iter()
            .map(|(table, file)| {
                self.tables
                    .iter()
                    .find(|t| &t.name == table)
                    .and_then(|t| t.files.iter().position(|f| f.name == file.name))
                    .map_or(0, |i| i as u64)
            })
            .collect();
        Ok(FileReader {
            ordinals,
            changes: self.changes.clone(),
            share: self.hashes_keys().then_some((subtask, self.parallelism)),
            files: mine,
            split,
            format: self.format,
            batch_rows: self.batch_rows,
            csv_header: self.csv_header,
            known: self.known.clone(),
            bad_rows: self.bad_rows,
            rejected: self.rejected.clone(),
            file_idx,
            row_in_file: row,
            current: None,
            text: false,
            pending: None,
            pending_bad: Vec::new(),
            ended: false,
        })
    }
}

/// The schema `at` is read with, given the table's known schema before it
/// (none for a table's first file), inferred once per run.
fn cached_schema(
    cache: &SchemaCache,
    at: &At,
    format: FileFormat,
    csv_header: bool,
    known: Option<&arrow_schema::Schema>,
    keep_bad: bool,
) -> Result<(SchemaRef, BadLines), SourceError> {
    let key = at.shown();
    if let Some(read) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(read);
    }
    let read = infer_schema(at, format, csv_header, known, keep_bad)?;
    if let Ok(mut c) = cache.lock() {
        c.insert(key, read.clone());
    }
    Ok(read)
}

fn infer_schema(
    at: &At,
    format: FileFormat,
    csv_header: bool,
    known: Option<&arrow_schema::Schema>,
    keep_bad: bool,
) -> Result<(SchemaRef, BadLines), SourceError> {
    let none = BadLines::default;
    match format {
        FileFormat::Parquet => {
            let builder = match at {
                At::Local(path) => {
                    ParquetRecordBatchReaderBuilder::try_new(File::open(path).map_err(|e| file_err(path, e))?)
                        .map(|b| b.schema().clone())
                }
                At::Object(object) => {
                    ParquetRecordBatchReaderBuilder::try_new(object.clone()).map(|b| b.schema().clone())
                }
            };
            builder.map(|schema| (schema, none())).map_err(|e| at.err(e))
        }
        FileFormat::Csv => {
            let (schema, _) = arrow_csv::reader::Format::default()
                .with_header(csv_header)
                .infer_schema(at.open()?, Some(INFER_RECORDS))
                .map_err(|e| at.err(e))?;
            let schema = Arc::new(schema);
            let schema = match known {
                Some(known) => with_known_types(&schema, known, format),
                None => schema,
            };
            Ok((schema, none()))
        }
        FileFormat::Json => {
            let (schema, bad) = json::infer(&at.shown(), at.open()?, known, keep_bad)?;
            let schema = match known {
                Some(known) => with_known_types(&schema, known, format),
                None => schema,
            };
            Ok((schema, Arc::new(bad)))
        }
    }
}

/// CSV errors with the file's own line numbers: arrow-csv counts lines
/// from 0, so its "at line N" names the line before the one meant. A value
/// that does not parse as its column's type is told with the column's name
/// (arrow-csv gives its index) and the value cut short.
fn csv_error(e: ArrowError, schema: &SchemaRef) -> ArrowError {
    match e {
        ArrowError::ParseError(m) => {
            ArrowError::ParseError(bad_csv_value(&m, schema).unwrap_or_else(|| one_based_line(&m)))
        }
        ArrowError::CsvError(m) => ArrowError::CsvError(one_based_line(&m)),
        other => other,
    }
}

/// arrow-csv 58's "Error while parsing value 'x7' as type 'Int64' for
/// column 2 at line 499. Row data: '[..]'" told as "line 500: column `qty`
/// holds "x7", which is not a valid Int64 ...", or `None` for any other
/// message (shown as arrow-csv gave it).
fn bad_csv_value(message: &str, schema: &arrow_schema::Schema) -> Option<String> {
    let rest = message.strip_prefix("Error while parsing value '")?;
    let (head, _row) = rest.split_once(". Row data: '")?;
    let (head, line) = head.rsplit_once(" at line ")?;
    let line: u64 = line.parse().ok()?;
    let (head, column) = head.rsplit_once("' for column ")?;
    let column = schema.fields().get(column.parse::<usize>().ok()?)?.name();
    let (value, ty) = head.rsplit_once("' as type '")?;
    let shown = if value.chars().count() <= 60 {
        format!("{value:?}")
    } else {
        format!("{:?}...", value.chars().take(60).collect::<String>())
    };
    Some(format!("line {}: column `{column}` holds {shown}, which is not a valid {ty}, the column's type", line + 1))
}

fn one_based_line(message: &str) -> String {
    const AT: &str = " at line ";
    let Some(i) = message.find(AT) else { return message.to_string() };
    let start = i + AT.len();
    let digits: String = message[start..].chars().take_while(char::is_ascii_digit).collect();
    match digits.parse::<u64>() {
        Ok(n) => format!("{}{}{}", &message[..start], n + 1, &message[start + digits.len()..]),
        Err(_) => message.to_string(),
    }
}

pub struct FileReader {
    /// This subtask's files, in reading order, with their tables.
    files: Vec<(String, DataFile)>,
    /// Each file's ordinal in its table's listing (a change's `seq_hi`).
    ordinals: Vec<u64>,
    /// A change stream: rows become changes.
    changes: Option<ChangeSpec>,
    /// `(subtask, parallelism)` when this subtask keeps only its keys' rows.
    share: Option<(u32, u32)>,
    split: Split,
    format: FileFormat,
    batch_rows: usize,
    csv_header: bool,
    known: Known,
    bad_rows: BadRows,
    /// Records a sink rejected, handed out as bad rows.
    rejected: Rejected,
    file_idx: usize,
    /// Rows of the current file already returned (bad ones included).
    row_in_file: u64,
    current: Option<BatchIter>,
    /// `current` reads the file's values as text, each slice converted
    /// row by row where it must be ([`salvage_csv`]): a CSV file with a bad
    /// value, from the batch that held it on, when bad rows are dead letters.
    text: bool,
    /// Rows read but not yet returned (as text when `text`).
    pending: Option<RecordBatch>,
    /// Bad records read but not yet returned, all before `pending`.
    pending_bad: Vec<BadRow>,
    /// The current file has handed out everything.
    ended: bool,
}

impl FileReader {
    /// Opens file `file_idx`, positioned after `skip` rows.
    fn open_current(&self, skip: u64) -> Result<BatchIter, SourceError> {
        let (table, file) = &self.files[self.file_idx];
        let at = &file.at;
        let schema = self.known.schema_of(table, &file.name, at, self.format, self.csv_header)?;
        let iter: BatchIter = match self.format {
            FileFormat::Parquet => {
                return match at {
                    At::Local(path) => {
                        let file = File::open(path).map_err(|e| file_err(path, e))?;
                        parquet_batches(file, at, self.batch_rows, skip)
                    }
                    At::Object(object) => parquet_batches(object.clone(), at, self.batch_rows, skip),
                };
            }
            FileFormat::Csv => {
                // Each file with its reading schema: its own columns, those
                // the table knows with their known types.
                let reader = arrow_csv::ReaderBuilder::new(schema.clone())
                    .with_header(self.csv_header)
                    .with_batch_size(self.batch_rows)
                    .build_buffered(at.open()?)
                    .map_err(|e| at.err(e))?;
                Box::new(reader.map(move |r| r.map(Piece::Rows).map_err(|e| csv_error(e, &schema))))
            }
            FileFormat::Json => {
                let (_, bad) = self.known.reading_of(table, &file.name, at, self.format, self.csv_header)?;
                Box::new(
                    json::Batches::open(at.open()?, schema, self.batch_rows, &file.name, bad).map_err(|e| at.err(e))?,
                )
            }
        };
        Ok(Box::new(SkipRows { inner: iter, skip }))
    }

    /// Opens CSV file `file_idx` with every column read as text, after
    /// `skip` records: values that do not parse are left to [`salvage_csv`].
    fn open_text(&self, skip: u64) -> Result<BatchIter, SourceError> {
        let (_, file) = &self.files[self.file_idx];
        let at = &file.at;
        let schema = text_schema(&*self.reading_schema()?);
        let reader = arrow_csv::ReaderBuilder::new(schema.clone())
            .with_header(self.csv_header)
            .with_batch_size(self.batch_rows)
            .build_buffered(at.open()?)
            .map_err(|e| at.err(e))?;
        let iter: BatchIter = Box::new(reader.map(move |r| r.map(Piece::Rows).map_err(|e| csv_error(e, &schema))));
        Ok(Box::new(SkipRows { inner: iter, skip }))
    }

    /// `read` without the rows a sink rejected, which join its bad rows.
    fn drop_rejected(&self, mut read: TableBatch) -> Result<TableBatch, SourceError> {
        let Some(origin) = read.origin.as_mut() else { return Ok(read) };
        if self.rejected.is_empty() || read.batch.num_rows() == 0 {
            return Ok(read);
        }
        let at = &self.files[self.file_idx].1.at;
        let mut keep = Vec::with_capacity(read.batch.num_rows());
        let mut gone = Vec::new();
        let mut skipped = Vec::new();
        for k in 0..read.batch.num_rows() as u64 {
            // Mapped with the origin as read: a row dropped here shifts none before it.
            let record = origin.record(k);
            match self.rejected.get(&(origin.file.clone(), record)) {
                Some(reason) => {
                    keep.push(false);
                    gone.push(BadRow {
                        raw: render_row(&read.batch, k as usize, self.format).map_err(|e| at.err(e))?,
                        position: origin.describe(k),
                        reason: format!("the sink rejected it: {reason}"),
                    });
                    skipped.push(record - origin.first);
                }
                None => keep.push(true),
            }
        }
        origin.skipped.extend(skipped);
        if gone.is_empty() {
            return Ok(read);
        }
        origin.skipped.sort_unstable();
        read.batch = arrow_select::filter::filter_record_batch(&read.batch, &arrow_array::BooleanArray::from(keep))
            .map_err(|e| at.err(e))?;
        read.bad.extend(gone);
        Ok(read)
    }

    /// The bad records read, alone (no rows of the current file between them).
    fn bad_only(&mut self) -> Result<TableBatch, SourceError> {
        let bad = std::mem::take(&mut self.pending_bad);
        self.row_in_file += bad.len() as u64;
        let batch = RecordBatch::new_empty(self.reading_schema()?);
        self.to_changes(TableBatch { table: self.files[self.file_idx].0.clone(), batch, bad, origin: None })
    }

    /// `read` as changes when the source is a change stream ([`changes`]):
    /// the change column consumed, `seq` = (the file's ordinal, the record's
    /// line as errors name it: a CSV record's line, or the 1-based record of
    /// a JSON lines or Parquet file), the rows of other subtasks' keys left
    /// out and the rows that are no change bad rows (an error unless they are
    /// dead letters). With several subtasks reading the file, its bad rows
    /// are handed out by the subtask the file's name belongs to alone.
    fn to_changes(&self, mut read: TableBatch) -> Result<TableBatch, SourceError> {
        let Some(spec) = &self.changes else { return Ok(read) };
        let (_, file) = &self.files[self.file_idx];
        let hi = self.ordinals.get(self.file_idx).copied().unwrap_or(0);
        let share = self.share.map(|(subtask, parallelism)| Share {
            subtask,
            parallelism,
            reports_bad: owner(&file.name, parallelism) == subtask,
        });
        if share.is_some_and(|s| !s.reports_bad) {
            read.bad.clear();
        }
        let Some(origin) = read.origin.as_mut() else {
            if read.batch.num_rows() > 0 {
                return Err(SourceError::Internal(format!("{}: rows without their place in the file", file.name)));
            }
            read.batch = spec.apply(&read.batch, |_| (hi, 0), share).map_err(|e| file.at.err(e))?.batch;
            return Ok(read);
        };
        let records: Vec<u64> = (0..read.batch.num_rows() as u64).map(|k| origin.record(k)).collect();
        let line = |row: usize| records.get(row).map_or(0, |r| r + origin.line_offset.unwrap_or(1));
        let changes = spec.apply(&read.batch, |row| (hi, line(row)), share).map_err(|e| file.at.err(e))?;
        if let Some(first) = changes.bad.first()
            && self.bad_rows == BadRows::Fail
        {
            return Err(SourceError::BadRow {
                position: format!("{} ({})", origin.describe(first.row as u64), file.at.shown()),
                reason: first.reason.clone(),
            });
        }
        for bad in &changes.bad {
            read.bad.push(BadRow {
                raw: render_row(&read.batch, bad.row, self.format).map_err(|e| file.at.err(e))?,
                position: origin.describe(bad.row as u64),
                reason: bad.reason.clone(),
            });
        }
        let mut kept = changes.kept.iter().peekable();
        for (row, record) in records.iter().enumerate() {
            if kept.next_if_eq(&&row).is_none() {
                origin.skipped.push(record - origin.first);
            }
        }
        origin.skipped.sort_unstable();
        read.batch = changes.batch;
        Ok(read)
    }

    fn reading_schema(&self) -> Result<SchemaRef, SourceError> {
        let (table, file) = &self.files[self.file_idx];
        self.known.schema_of(table, &file.name, &file.at, self.format, self.csv_header)
    }

    /// The text rows `raw` (the current file's from row `first_row` on)
    /// converted to the file's reading schema: the rows that parse, and
    /// the others as bad rows.
    /// Also the offsets in `raw` of the bad rows.
    fn convert_text(
        &self,
        raw: &RecordBatch,
        first_row: u64,
    ) -> Result<(RecordBatch, Vec<BadRow>, Vec<u64>), SourceError> {
        let (_, file) = &self.files[self.file_idx];
        let schema = self.reading_schema()?;
        let (good, bad) = salvage_csv(raw, &schema).map_err(|e| file.at.err(format!("after row {first_row}: {e}")))?;
        // A record's line as errors in `fail` mode name it (the header is line 1).
        let first_line = first_row + 1 + u64::from(self.csv_header);
        let at = bad.iter().map(|(i, _, _)| *i as u64).collect();
        let bad = bad
            .into_iter()
            .map(|(i, raw, reason)| BadRow {
                raw,
                position: format!("{} line {}", file.name, first_line + i as u64),
                reason,
            })
            .collect();
        Ok((good, bad, at))
    }
}

/// Row `k` of `batch` as its file's format writes a record: a CSV line, or
/// a JSON object (JSON lines and Parquet).
fn render_row(batch: &RecordBatch, k: usize, format: FileFormat) -> Result<String, ArrowError> {
    let row = batch.slice(k, 1);
    let mut out = Vec::new();
    match format {
        FileFormat::Csv => arrow_csv::WriterBuilder::new().with_header(false).build(&mut out).write(&row)?,
        _ => {
            let mut w = arrow_json::LineDelimitedWriter::new(&mut out);
            w.write(&row)?;
            w.finish()?;
        }
    }
    Ok(String::from_utf8_lossy(&out).trim_end().to_string())
}

/// `schema` with every column text: how a CSV file with bad values is read
/// before its values are parsed.
fn text_schema(schema: &arrow_schema::Schema) -> SchemaRef {
    use arrow_schema::{DataType, Field};
    let fields: Vec<Field> = schema.fields().iter().map(|f| Field::new(f.name(), DataType::Utf8, true)).collect();
    Arc::new(arrow_schema::Schema::new(fields))
}

/// A stretch of text rows parsed: the rows that parse, and for each that
/// does not its index, its record as one CSV line and the reason.
type Salvaged = (RecordBatch, Vec<(usize, String, String)>);

/// Text rows (`raw`, every column Utf8, as [`text_schema`] reads them)
/// parsed as `schema`. The values are parsed by arrow-csv itself, from the
/// rows written back as CSV, so a value reads exactly as in a file without
/// bad rows; a failing stretch is halved until the bad records stand alone
/// (a slice with k bad rows costs about k·log(n) small parses beside one
/// of the whole slice).
fn salvage_csv(raw: &RecordBatch, schema: &SchemaRef) -> Result<Salvaged, ArrowError> {
    fn to_csv(rows: &RecordBatch) -> Result<Vec<u8>, ArrowError> {
        let mut out = Vec::new();
        arrow_csv::WriterBuilder::new().with_header(false).build(&mut out).write(rows)?;
        Ok(out)
    }
    fn parse(text: &[u8], schema: &SchemaRef, rows: usize) -> Result<Vec<RecordBatch>, ArrowError> {
        arrow_csv::ReaderBuilder::new(schema.clone())
            .with_header(false)
            .with_batch_size(rows.max(1))
            .build(std::io::Cursor::new(text))?
            .collect()
    }
    fn split(
        raw: &RecordBatch,
        offset: usize,
        schema: &SchemaRef,
        good: &mut Vec<RecordBatch>,
        bad: &mut Vec<(usize, String, String)>,
    ) -> Result<(), ArrowError> {
        let n = raw.num_rows();
        if n == 0 {
            return Ok(());
        }
        let text = to_csv(raw)?;
        match parse(&text, schema, n) {
            Ok(batches) => good.extend(batches),
            Err(e) if n == 1 => {
                let reason = match csv_error(e, schema) {
                    ArrowError::ParseError(m) | ArrowError::CsvError(m) => {
                        m.strip_prefix("line 1: ").map(str::to_string).unwrap_or(m)
                    }
                    other => other.to_string(),
                };
                let record = String::from_utf8_lossy(&text).trim_end_matches(['\r', '\n']).to_string();
                bad.push((offset, record, reason));
            }
            Err(_) => {
                let half = n / 2;
                split(&raw.slice(0, half), offset, schema, good, bad)?;
                split(&raw.slice(half, n - half), offset + half, schema, good, bad)?;
            }
        }
        Ok(())
    }
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    split(raw, 0, schema, &mut good, &mut bad)?;
    let good = arrow_select::concat::concat_batches(schema, &good)?;
    Ok((good, bad))
}

/// Drops the first `skip` rows of a batch stream (CSV and JSON cannot seek by row).
struct SkipRows {
    inner: BatchIter,
    skip: u64,
}

impl Iterator for SkipRows {
    type Item = Result<Piece, ArrowError>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let batch = match self.inner.next()? {
                Ok(Piece::Rows(b)) => b,
                // A bad record counts as one of the file's records.
                Ok(Piece::Bad(_)) if self.skip > 0 => {
                    self.skip -= 1;
                    continue;
                }
                other => return Some(other),
            };
            if self.skip == 0 {
                return Some(Ok(Piece::Rows(batch)));
            }
            let n = batch.num_rows() as u64;
            if n <= self.skip {
                self.skip -= n;
                continue;
            }
            let s = self.skip as usize;
            self.skip = 0;
            return Some(Ok(Piece::Rows(batch.slice(s, batch.num_rows() - s))));
        }
    }
}

impl SourceReader for FileReader {
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<TableBatch>, SourceError> {
        loop {
            if let Some(batch) = self.pending.take() {
                let out = if batch.num_rows() > max_rows {
                    self.pending = Some(batch.slice(max_rows, batch.num_rows() - max_rows));
                    batch.slice(0, max_rows)
                } else {
                    batch
                };
                let bad = std::mem::take(&mut self.pending_bad);
                let start = self.row_in_file;
                let first_row = start + bad.len() as u64;
                self.row_in_file = first_row + out.num_rows() as u64;
                let (table, file) = &self.files[self.file_idx];
                let mut origin = Origin {
                    file: file.name.clone(),
                    first: start,
                    skipped: (0..bad.len() as u64).collect(),
                    line_offset: match self.format {
                        FileFormat::Csv => Some(1 + u64::from(self.csv_header)),
                        _ => None,
                    },
                };
                let table = table.clone();
                let (batch, bad) = if self.text {
                    let (batch, more, at) = self.convert_text(&out, first_row)?;
                    origin.skipped.extend(at.into_iter().map(|i| bad.len() as u64 + i));
                    (batch, bad.into_iter().chain(more).collect())
                } else {
                    (out, bad)
                };
                let batch = self.to_changes(TableBatch { table, batch, bad, origin: Some(origin) })?;
                if self.share.is_some() && batch.batch.num_rows() == 0 && batch.bad.is_empty() {
                    // Only rows of other subtasks' keys: read on.
                    continue;
                }
                return self.drop_rejected(batch).map(Some);
            }
            if self.ended {
                self.ended = false;
                self.current = None;
                self.text = false;
                self.file_idx += 1;
                self.row_in_file = 0;
            }
            if max_rows == 0 || self.file_idx >= self.files.len() {
                return Ok(None);
            }
            if self.current.is_none() {
                self.current = Some(self.open_current(self.row_in_file)?);
            }
            let next = self.current.as_mut().and_then(|it| it.next());
            match next {
                Some(Ok(Piece::Rows(batch))) if batch.num_rows() == 0 => {}
                Some(Ok(Piece::Rows(batch))) => self.pending = Some(batch),
                Some(Ok(Piece::Bad(bad))) => {
                    self.pending_bad.push(bad);
                    if self.pending_bad.len() >= max_rows {
                        return self.bad_only().map(Some);
                    }
                }
                Some(Err(ArrowError::ParseError(_)))
                    if self.bad_rows == BadRows::DeadLetter && self.format == FileFormat::Csv && !self.text =>
                {
                    // A value did not parse: the rest of the file is read as
                    // text and parsed row by row where it must be.
                    self.text = true;
                    self.current = Some(self.open_text(self.row_in_file)?);
                }
                Some(Err(e)) => {
                    let at = &self.files[self.file_idx].1.at;
                    return Err(at.err(format!("after row {}: {e}", self.row_in_file)));
                }
                // The file's last bad records go out before the file is left.
                None if !self.pending_bad.is_empty() => {
                    self.ended = true;
                    return self.bad_only().map(Some);
                }
                None => self.ended = true,
            }
        }
    }

    fn position(&self) -> Value {
        if self.split == Split::LegacyIndex {
            return json!({ "file": self.file_idx, "row": self.row_in_file });
        }
        match self.files.get(self.file_idx) {
            Some((_, f)) if self.row_in_file > 0 => json!({ "at": f.name, "row": self.row_in_file }),
            _ => {
                let last = self.file_idx.checked_sub(1).and_then(|i| self.files.get(i)).map(|(_, f)| f.name.clone());
                json!({ "after": last })
            }
        }
    }
}

/// JSON lines: a line reader that knows its line numbers, whole-file
/// inference, and batches decoded by arrow-json.
mod json {
    use std::collections::HashMap;
    use std::io::BufRead;
    use std::sync::Arc;

    use arrow_array::RecordBatch;
    use arrow_json::reader::{Decoder, ReaderBuilder, infer_json_schema_from_iterator};
    use arrow_schema::{ArrowError, SchemaRef};
    use serde_json::Value;

    use super::{BTreeMap, SourceError};

    /// A sequential reader of one file (local or an object).
    pub(super) type Input = Box<dyn BufRead + Send>;

    fn file_err(shown: &str, message: impl std::fmt::Display) -> SourceError {
        SourceError::File { path: shown.to_string(), message: message.to_string() }
    }

    const BOM: &[u8] = b"\xEF\xBB\xBF";
    /// The largest integer every double holds exactly.
    const EXACT_IN_DOUBLE: u64 = 1 << 53;

    /// The non-blank lines of a file, each with its line number (from 1),
    /// a byte order mark at the start skipped.
    pub(super) struct Lines<R> {
        reader: R,
        line: u64,
        buf: Vec<u8>,
    }

    impl<R: BufRead> Lines<R> {
        pub(super) fn new(reader: R) -> Self {
            Self { reader, line: 0, buf: Vec::new() }
        }

        /// The next record's line number and bytes (with a final newline).
        pub(super) fn next_record(&mut self) -> std::io::Result<Option<(u64, &[u8])>> {
            loop {
                self.buf.clear();
                if self.reader.read_until(b'\n', &mut self.buf)? == 0 {
                    return Ok(None);
                }
                self.line += 1;
                if self.line == 1 && self.buf.starts_with(BOM) {
                    self.buf.drain(..BOM.len());
                }
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                if self.buf.last() != Some(&b'\n') {
                    self.buf.push(b'\n');
                }
                return Ok(Some((self.line, &self.buf)));
            }
        }
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Bool,
        Int,
        Float,
        Str,
        List,
        Object,
    }

    impl Kind {
        fn of(v: &Value) -> Option<Kind> {
            Some(match v {
                Value::Null => return None,
                Value::Bool(_) => Kind::Bool,
                Value::Number(n) if n.is_i64() || n.is_u64() => Kind::Int,
                Value::Number(_) => Kind::Float,
                Value::String(_) => Kind::Str,
                Value::Array(_) => Kind::List,
                Value::Object(_) => Kind::Object,
            })
        }

        fn name(self) -> &'static str {
            match self {
                Kind::Bool => "booleans",
                Kind::Int => "integers",
                Kind::Float => "numbers with fractions (a double column)",
                Kind::Str => "strings",
                Kind::List => "lists",
                Kind::Object => "objects",
            }
        }
    }

    /// What the records so far hold in one field.
    #[derive(Clone)]
    struct Seen {
        kind: Kind,
        /// The line that set `kind`.
        line: u64,
        /// An integer a double would round, and its line.
        inexact: Option<(u64, String)>,
        /// `kind` is the table's, from its earlier files: it does not widen.
        known: bool,
    }

    impl Seen {
        /// Where `kind` comes from, for messages.
        fn origin(&self) -> String {
            if self.known {
                "the table's earlier files".to_string()
            } else {
                format!("line {} and the records after it", self.line)
            }
        }
    }

    /// Seeds `fields` with the table's known column `name` of type `ty`
    /// (nested ones by their path, as [`check_value`] names them). A type
    /// no JSON value maps to is left out: the file's values decide it.
    fn seed(fields: &mut HashMap<String, Seen>, name: &str, ty: &arrow_schema::DataType) {
        use arrow_schema::DataType as D;
        let kind = match ty {
            D::Boolean => Kind::Bool,
            D::Int8 | D::Int16 | D::Int32 | D::Int64 | D::UInt8 | D::UInt16 | D::UInt32 | D::UInt64 => Kind::Int,
            D::Float16 | D::Float32 | D::Float64 => Kind::Float,
            D::Utf8 | D::LargeUtf8 | D::Utf8View => Kind::Str,
            D::List(item) | D::LargeList(item) => {
                seed(fields, &format!("{name}[]"), item.data_type());
                Kind::List
            }
            D::Struct(children) => {
                for child in children {
                    seed(fields, &format!("{name}.{}", child.name()), child.data_type());
                }
                Kind::Object
            }
            _ => return,
        };
        fields.insert(name.to_string(), Seen { kind, line: 0, inexact: None, known: true });
    }

    fn shown(v: &Value) -> String {
        let text = v.to_string();
        if text.chars().count() <= 60 { text } else { format!("{}...", text.chars().take(60).collect::<String>()) }
    }

    /// Checks one record's fields against what earlier records held, nested
    /// ones by their path (`o.x`, `l[]`): one kind per path, integers
    /// widening to doubles only while every integer stays exact.
    ///
    /// A record that fails changes nothing of `fields` (what its fields
    /// before the failing one changed is undone), so that with dead letters
    /// a bad record leaves no trace in the schema.
    fn check(
        fields: &mut HashMap<String, Seen>,
        line: u64,
        record: &serde_json::Map<String, Value>,
    ) -> Result<(), String> {
        let mut undo = Vec::new();
        let checked = record.iter().try_for_each(|(name, value)| check_value(fields, &mut undo, line, name, value));
        if checked.is_err() {
            for (name, before) in undo.into_iter().rev() {
                match before {
                    Some(seen) => drop(fields.insert(name, seen)),
                    None => drop(fields.remove(&name)),
                }
            }
        }
        checked
    }

    /// What a field was before a record changed it.
    type Undo = Vec<(String, Option<Seen>)>;

    fn check_value(
        fields: &mut HashMap<String, Seen>,
        undo: &mut Undo,
        line: u64,
        name: &str,
        value: &Value,
    ) -> Result<(), String> {
        match value {
            Value::Object(inner) => {
                for (field, v) in inner {
                    check_value(fields, undo, line, &format!("{name}.{field}"), v)?;
                }
            }
            Value::Array(items) => {
                let item = format!("{name}[]");
                for v in items {
                    check_value(fields, undo, line, &item, v)?;
                }
            }
            _ => {}
        }
        let Some(kind) = Kind::of(value) else { return Ok(()) };
        if let Value::Number(n) = value
            && n.as_i64().is_none()
            && let Some(u) = n.as_u64()
        {
            return Err(format!("line {line}: field `{name}` = {u} does not fit a 64-bit signed integer column"));
        }
        let big = match value {
            Value::Number(n) if n.as_i64().is_some_and(|i| i.unsigned_abs() > EXACT_IN_DOUBLE) => {
                Some((line, n.to_string()))
            }
            _ => None,
        };
        let Some(seen) = fields.get_mut(name) else {
            undo.push((name.to_string(), None));
            fields.insert(name.to_string(), Seen { kind, line, inexact: big, known: false });
            return Ok(());
        };
        let changes = (seen.inexact.is_none() && big.is_some()) || (seen.kind == Kind::Int && kind == Kind::Float);
        if changes {
            undo.push((name.to_string(), Some(seen.clone())));
        }
        if seen.inexact.is_none() {
            seen.inexact = big;
        }
        match (seen.kind, kind) {
            (a, b) if a == b => {}
            (Kind::Int, Kind::Float) if !seen.known => {
                seen.kind = Kind::Float;
                seen.line = line;
            }
            (Kind::Float, Kind::Int) => {}
            (was, _) => {
                return Err(format!(
                    "line {line}: field `{name}` = {} does not fit its column: {} hold {} there",
                    shown(value),
                    seen.origin(),
                    was.name()
                ));
            }
        }
        if seen.kind == Kind::Float
            && let Some((at, digits)) = &seen.inexact
        {
            let why = if seen.known {
                "the table's earlier files make the column a double".to_string()
            } else {
                format!("line {} holds a number with a fraction, so the column is a double", seen.line)
            };
            return Err(format!(
                "line {at}: field `{name}` = {digits} would lose digits: {why}, and a double cannot hold this integer exactly"
            ));
        }
        Ok(())
    }

    /// The first integer literal of a JSON record that fits no 64-bit
    /// integer. serde_json (without its arbitrary-precision feature) reads
    /// such a literal as a double and rounds it, so the raw text is looked
    /// at: numbers outside strings, without a fraction or an exponent.
    fn oversized_integer(record: &[u8]) -> Option<String> {
        let (mut in_string, mut escaped, mut i) = (false, false, 0);
        while i < record.len() {
            let b = record[i];
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                i += 1;
                continue;
            }
            if b == b'"' {
                in_string = true;
                i += 1;
                continue;
            }
            if b == b'-' || b.is_ascii_digit() {
                let start = i;
                i += 1;
                while i < record.len() && matches!(record[i], b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-') {
                    i += 1;
                }
                let token = String::from_utf8_lossy(&record[start..i]).into_owned();
                let integral = !token.contains(['.', 'e', 'E']);
                if integral && token.parse::<i64>().is_err() && token.parse::<u64>().is_err() {
                    return Some(token);
                }
                continue;
            }
            i += 1;
        }
        None
    }

    /// The schema without the fields no record of the file gave a value
    /// (Arrow's `Null` type, which no table can take): they hold nothing,
    /// so leaving them out loses nothing, and a later file that gives them
    /// values adds them as new columns.
    fn without_null_fields(fields: &arrow_schema::Fields) -> Vec<arrow_schema::FieldRef> {
        use arrow_schema::{DataType, Field};
        fields
            .iter()
            .filter_map(|f| match f.data_type() {
                DataType::Null => None,
                DataType::Struct(children) => {
                    let kept = without_null_fields(children);
                    (!kept.is_empty()).then(|| {
                        Arc::new(Field::new(f.name(), DataType::Struct(kept.into()), f.is_nullable()))
                            as arrow_schema::FieldRef
                    })
                }
                DataType::List(item) if matches!(item.data_type(), DataType::Null) => None,
                _ => Some(f.clone()),
            })
            .collect()
    }

    /// The schema of every record of the file: a field any record has is a
    /// (nullable) column, integers mixed with fractions make a double. A
    /// field the table already `known`s keeps its kind: a value of another
    /// kind is refused, naming its line.
    ///
    /// With `keep_bad` (dead letters), a record that would be refused is
    /// left out instead, and returned by its line with the reason: the first
    /// record that gives a field a value decides its kind. A file with more
    /// such records than others (and at least [`MOSTLY_BAD`]) is refused:
    /// its first records, not the rest, are likely the odd ones.
    /// Records set aside, at least, for a file that sets aside more than it
    /// keeps to be refused (see [`infer`]).
    pub(super) const MOSTLY_BAD: u64 = 10;

    pub(super) fn infer(
        path: &str,
        input: Input,
        known: Option<&arrow_schema::Schema>,
        keep_bad: bool,
    ) -> Result<(SchemaRef, BTreeMap<u64, String>), SourceError> {
        let mut lines = Lines::new(input);
        let mut fields: HashMap<String, Seen> = HashMap::new();
        for field in known.map(|k| k.fields().iter()).into_iter().flatten() {
            seed(&mut fields, field.name(), field.data_type());
        }
        let mut failure: Option<String> = None;
        let mut last_line = 0;
        let mut bad = BTreeMap::new();
        let mut good = 0u64;
        let records = std::iter::from_fn(|| {
            loop {
                let (line, bytes) = match lines.next_record() {
                    Ok(Some(next)) => next,
                    Ok(None) => return None,
                    Err(e) => {
                        failure = Some(e.to_string());
                        return None;
                    }
                };
                last_line = line;
                let judged = judge(&mut fields, line, bytes);
                match judged {
                    Ok(value) => {
                        good += 1;
                        return Some(Ok::<_, ArrowError>(value));
                    }
                    Err(reason) if keep_bad => drop(bad.insert(line, reason)),
                    Err(reason) => {
                        failure = Some(format!("line {line}: {reason}"));
                        return None;
                    }
                }
            }
        });
        let inferred = infer_json_schema_from_iterator(records);
        if let Some(message) = failure {
            return Err(file_err(path, message));
        }
        let schema = inferred.map_err(|e| file_err(path, format!("line {last_line}: {e}")))?;
        if bad.len() as u64 > good.max(MOSTLY_BAD - 1)
            && let Some((line, reason)) = bad.first_key_value()
        {
            return Err(file_err(
                path,
                format!(
                    "{} of its {} records do not fit the kinds {} gave the fields (the first, line {line}: {reason}); \
                     a file whose records mostly do not fit is refused rather than set aside as dead letters: \
                     the records that set the kinds may be the odd ones out",
                    bad.len(),
                    bad.len() as u64 + good,
                    if known.is_some() {
                        "the table's earlier files or its first records"
                    } else {
                        "its first records"
                    },
                ),
            ));
        }
        Ok((Arc::new(arrow_schema::Schema::new(without_null_fields(schema.fields()))), bad))
    }

    /// One record, parsed and checked against what the records before it
    /// held; why it does not fit otherwise (without its line).
    fn judge(fields: &mut HashMap<String, Seen>, line: u64, bytes: &[u8]) -> Result<Value, String> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        let Value::Object(record) = &value else {
            return Err(format!("expected one JSON object per line, found {}", shown(&value)));
        };
        if let Some(number) = oversized_integer(bytes) {
            return Err(format!(
                "the integer {number} does not fit a 64-bit integer column, and a double would round it"
            ));
        }
        check(fields, line, record)
            .map_err(|m| m.strip_prefix(&format!("line {line}: ")).map_or(m.clone(), str::to_string))?;
        Ok(value)
    }

    /// Batches of a JSON lines file decoded with its inferred schema.
    pub(super) struct Batches {
        lines: Lines<Input>,
        decoder: Decoder,
        batch_rows: usize,
        /// Line numbers of the records the decoder holds.
        first: u64,
        last: u64,
        done: bool,
        /// The file as dead letters name it.
        name: String,
        /// Lines inference left out ([`infer`] with `keep_bad`).
        bad: super::BadLines,
        /// A bad record met while the decoder held rows: handed out next.
        stashed: Option<super::BadRow>,
    }

    impl Batches {
        pub(super) fn open(
            input: Input,
            schema: SchemaRef,
            batch_rows: usize,
            name: &str,
            bad: super::BadLines,
        ) -> Result<Self, ArrowError> {
            let decoder = ReaderBuilder::new(schema)
                .with_batch_size(batch_rows.max(1))
                // Inference saw every field; the schema lacks only those no record gave a value
                // (`without_null_fields`), whose nulls the decoder passes over.
                .with_strict_mode(false)
                .build_decoder()?;
            Ok(Self {
                lines: Lines::new(input),
                decoder,
                batch_rows: batch_rows.max(1),
                first: 0,
                last: 0,
                done: false,
                name: name.to_string(),
                bad,
                stashed: None,
            })
        }

        fn flush_rows(&mut self) -> Option<Result<super::Piece, ArrowError>> {
            match self.flush() {
                Some(rows) => Some(rows.map(super::Piece::Rows)),
                None => self.stashed.take().map(|b| Ok(super::Piece::Bad(b))),
            }
        }

        fn at(&self, e: ArrowError) -> ArrowError {
            let lines = if self.first == self.last {
                format!("line {}", self.first)
            } else {
                format!("lines {}-{}", self.first, self.last)
            };
            ArrowError::JsonError(format!("{lines}: {e}"))
        }

        fn flush(&mut self) -> Option<Result<RecordBatch, ArrowError>> {
            match self.decoder.flush() {
                Ok(Some(batch)) => Some(Ok(batch)),
                Ok(None) => None,
                Err(e) => {
                    self.done = true;
                    Some(Err(self.at(e)))
                }
            }
        }
    }

    impl Iterator for Batches {
        type Item = Result<super::Piece, ArrowError>;

        fn next(&mut self) -> Option<Self::Item> {
            if let Some(bad) = self.stashed.take() {
                return Some(Ok(super::Piece::Bad(bad)));
            }
            if self.done {
                return None;
            }
            loop {
                if self.decoder.len() >= self.batch_rows {
                    return self.flush_rows();
                }
                let (line, bytes) = match self.lines.next_record() {
                    Ok(Some((line, bytes))) => (line, bytes.to_vec()),
                    Ok(None) => {
                        self.done = true;
                        return self.flush_rows();
                    }
                    Err(e) => {
                        self.done = true;
                        return Some(Err(ArrowError::JsonError(format!("after line {}: {e}", self.last))));
                    }
                };
                if let Some(reason) = self.bad.get(&line) {
                    // Left out of the schema: handed out as it is, after the rows before it.
                    let bad = super::BadRow {
                        raw: String::from_utf8_lossy(&bytes).trim_end().to_string(),
                        position: format!("{} line {line}", self.name),
                        reason: reason.clone(),
                    };
                    if self.decoder.is_empty() {
                        return Some(Ok(super::Piece::Bad(bad)));
                    }
                    self.stashed = Some(bad);
                    return self.flush_rows();
                }
                if self.decoder.is_empty() {
                    self.first = line;
                }
                self.last = line;
                let mut rest: &[u8] = &bytes;
                while !rest.is_empty() {
                    match self.decoder.decode(rest) {
                        Ok(0) => {
                            // The batch is full: hand it out, keep the rest.
                            match self.flush() {
                                Some(Ok(batch)) if !rest.iter().all(u8::is_ascii_whitespace) => {
                                    self.done = true;
                                    return Some(Err(ArrowError::JsonError(format!(
                                        "line {line}: more than one record on the line ({} rows held)",
                                        batch.num_rows()
                                    ))));
                                }
                                other => return other.map(|r| r.map(super::Piece::Rows)),
                            }
                        }
                        Ok(n) => rest = &rest[n..],
                        Err(e) => {
                            self.done = true;
                            return Some(Err(self.at(e)));
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Array, Int64Array};

    /// A local source, CSV with headers, its format from the extension.
    fn open_local(path: &Path, batch_rows: usize, parallelism: u32) -> Result<FileSource, SourceError> {
        FileSource::open(path, None, batch_rows, true, parallelism, &StoreConfig::default())
    }

    fn ids(reader: &mut dyn SourceReader, max: usize) -> Vec<i64> {
        let mut out = Vec::new();
        while let Some(b) = reader.next_batch(max).unwrap() {
            let col = b.batch.column_by_name("id").unwrap();
            out.extend(col.as_any().downcast_ref::<Int64Array>().unwrap().values().iter().copied());
        }
        out
    }

    #[test]
    fn csv_and_json_resume_mid_file() {
        let dir = tempfile::tempdir().unwrap();
        let csv: String =
            std::iter::once("id,name\n".to_string()).chain((0..25).map(|i| format!("{i},n{i}\n"))).collect();
        std::fs::write(dir.path().join("a.csv"), csv).unwrap();
        let json: String = (100..110).map(|i| format!("{{\"id\": {i}, \"name\": \"n{i}\"}}\n")).collect();
        std::fs::write(dir.path().join("b.json"), json).unwrap();

        let src = open_local(&dir.path().join("a.csv"), 4, 1).unwrap();
        let mut r = src.reader(0, None).unwrap();
        let first: Vec<i64> = ids_n(&mut r, 3, 2);
        let pos = r.position();
        let mut r2 = src.reader(0, Some(&pos)).unwrap();
        let rest = ids(&mut r2, 5);
        assert_eq!([first, rest].concat(), (0..25).collect::<Vec<_>>());

        let src = open_local(&dir.path().join("b.json"), 3, 1).unwrap();
        let mut r = src.reader(0, Some(&json!({"file": 0, "row": 7}))).unwrap();
        assert_eq!(ids(&mut r, 10), vec![107, 108, 109]);
    }

    /// One folder per table: tables dealt out by folder, files read in name
    /// order, each with its own schema.
    #[test]
    fn a_tree_of_table_folders_keeps_each_table_in_order() {
        let dir = tempfile::tempdir().unwrap();
        for (table, files) in [("orders", &["1.csv", "2.csv"][..]), ("users", &["1.csv"][..])] {
            std::fs::create_dir_all(dir.path().join(table)).unwrap();
            for (k, f) in files.iter().enumerate() {
                let extra = if k == 1 { ",tag" } else { "" };
                let mut text = format!("id,name{extra}\n");
                for i in 0..3 {
                    text.push_str(&format!("{},{table}{}\n", k * 10 + i, if k == 1 { ",x" } else { "" }));
                }
                std::fs::write(dir.path().join(table).join(f), text).unwrap();
            }
        }
        let src = open_local(dir.path(), 2, 2).unwrap();
        assert!(src.is_tree());
        let names: Vec<String> = src.tables().unwrap().into_iter().map(|(t, _)| t).collect();
        assert_eq!(names, ["orders", "users"]);
        let mut r = src.reader(0, None).unwrap();
        let mut seen = Vec::new();
        while let Some(b) = r.next_batch(2).unwrap() {
            assert_eq!(b.table, "orders");
            seen.push((b.batch.num_columns(), b.batch.num_rows()));
        }
        assert_eq!(seen, [(2, 2), (2, 1), (3, 2), (3, 1)]);
        let mut r = src.reader(1, None).unwrap();
        assert_eq!(r.next_batch(10).unwrap().unwrap().table, "users");
    }

    fn csv(dir: &Path, name: &str, ids: std::ops::Range<i64>) {
        let text: String =
            std::iter::once("id,v\n".to_string()).chain(ids.map(|i| format!("{i},{}\n", i * 2))).collect();
        std::fs::write(dir.join(name), text).unwrap();
    }

    /// Reads every subtask to its end from `positions` (none: the start);
    /// returns the ids and the positions at the end.
    fn read_all(src: &FileSource, positions: &[Option<Value>]) -> (Vec<i64>, Vec<Value>) {
        let mut out = Vec::new();
        let mut ends = Vec::new();
        for (s, pos) in positions.iter().enumerate() {
            let mut r = src.reader(s as u32, pos.as_ref()).unwrap();
            out.extend(ids(&mut r, 7));
            ends.push(r.position());
        }
        out.sort_unstable();
        (out, ends)
    }

    /// The split is a function of each file's own name: appending files never
    /// moves one that was there to another subtask, so every subtask's files
    /// before the append are a prefix of its files after it.
    #[test]
    fn appended_files_never_move_a_file_to_another_subtask() {
        let dir = tempfile::tempdir().unwrap();
        for k in 0..12 {
            csv(dir.path(), &format!("{k:02}.csv"), k * 10..k * 10 + 3);
        }
        let before: Vec<Vec<String>> = (0..3)
            .map(|s| {
                let src = open_local(dir.path(), 4, 3).unwrap();
                src.files_of(s, Split::ByName).into_iter().map(|(_, f)| f.name).collect()
            })
            .collect();
        assert!(before.iter().all(|f| !f.is_empty()), "12 files reach every one of 3 subtasks: {before:?}");
        for name in ["005.csv", "12.csv", "99.csv", "aa.csv"] {
            csv(dir.path(), name, 900..903);
        }
        let src = open_local(dir.path(), 4, 3).unwrap();
        let mut all = Vec::new();
        for (s, old) in before.iter().enumerate() {
            let now: Vec<String> = src.files_of(s as u32, Split::ByName).into_iter().map(|(_, f)| f.name).collect();
            let kept: Vec<&String> = now.iter().filter(|n| old.contains(n)).collect();
            assert_eq!(kept, old.iter().collect::<Vec<_>>(), "subtask {s} keeps its files, in order");
            all.extend(now);
        }
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 16, "every file belongs to exactly one subtask");
    }

    /// A resume checks the consumed files and refuses, naming the file, one
    /// that changed or a new one sorting before the position; a new file
    /// sorting after it is read, once.
    #[test]
    fn resume_refuses_a_changed_input_and_reads_appended_files() {
        let dir = tempfile::tempdir().unwrap();
        csv(dir.path(), "b.csv", 0..30);
        csv(dir.path(), "c.csv", 30..60);
        let src = open_local(dir.path(), 10, 1).unwrap();
        let mut r = src.reader(0, None).unwrap();
        let first = ids_n(&mut r, 10, 4);
        assert_eq!(first, (0..30).chain(30..40).collect::<Vec<_>>());
        let pos = r.position();
        assert_eq!(pos, json!({"at": "c.csv", "row": 10}));
        let identity = src.identity(&[&pos]).unwrap();
        let super::super::SourceIdentity::File { subtasks, .. } = &identity else { panic!("{identity:?}") };
        assert_eq!(subtasks[0].iter().map(|f| f.name.as_str()).collect::<Vec<_>>(), ["b.csv", "c.csv"]);

        // A file that sorts before the position.
        csv(dir.path(), "a.csv", 100..103);
        let now = open_local(dir.path(), 4, 1).unwrap();
        let err = now.check_identity(subtasks, None, None).unwrap_err().to_string();
        assert!(err.contains("a.csv is new and sorts before") && err.contains("c.csv"), "{err}");
        std::fs::remove_file(dir.path().join("a.csv")).unwrap();

        // A consumed file that grew, shrank, was touched or is gone.
        let c = dir.path().join("c.csv");
        let original = std::fs::read(&c).unwrap();
        let mtime = std::fs::metadata(&c).unwrap().modified().unwrap();
        std::fs::write(&c, [original.clone(), b"60,120\n".to_vec()].concat()).unwrap();
        let err = open_local(dir.path(), 4, 1).unwrap().check_identity(subtasks, None, None).unwrap_err();
        assert!(err.to_string().contains("c.csv grew from"), "{err}");
        std::fs::write(&c, &original[..original.len() - 6]).unwrap();
        let err = open_local(dir.path(), 4, 1).unwrap().check_identity(subtasks, None, None).unwrap_err();
        assert!(err.to_string().contains("c.csv shrank from"), "{err}");
        std::fs::write(&c, &original).unwrap();
        let touched = mtime + std::time::Duration::from_secs(5);
        File::options().write(true).open(&c).unwrap().set_modified(touched).unwrap();
        let err = open_local(dir.path(), 4, 1).unwrap().check_identity(subtasks, None, None).unwrap_err();
        assert!(err.to_string().contains("c.csv was modified"), "{err}");
        File::options().write(true).open(&c).unwrap().set_modified(mtime).unwrap();
        std::fs::rename(dir.path().join("b.csv"), dir.path().join("b.csv.bak")).unwrap();
        let err = open_local(dir.path(), 4, 1).unwrap().check_identity(subtasks, None, None).unwrap_err();
        assert!(err.to_string().contains("b.csv is gone"), "{err}");
        std::fs::rename(dir.path().join("b.csv.bak"), dir.path().join("b.csv")).unwrap();

        // Restored as it was, plus a file that sorts after: accepted, and read once.
        csv(dir.path(), "d.csv", 60..70);
        let now = open_local(dir.path(), 4, 1).unwrap();
        now.check_identity(subtasks, None, None).unwrap();
        let (rest, ends) = read_all(&now, &[Some(pos)]);
        assert_eq!([first, rest].concat(), (0..70).collect::<Vec<_>>());
        assert_eq!(ends, [json!({"after": "d.csv"})]);
    }

    /// Positions of earlier versions (an index into the split by index)
    /// resume with that split.
    #[test]
    fn index_positions_of_earlier_versions_resume_by_index() {
        let dir = tempfile::tempdir().unwrap();
        for (k, name) in ["a.csv", "b.csv", "c.csv", "d.csv"].iter().enumerate() {
            csv(dir.path(), name, k as i64 * 10..k as i64 * 10 + 10);
        }
        let src = open_local(dir.path(), 4, 2).unwrap();
        // By index, subtask 0 has a.csv and c.csv (read), subtask 1 b.csv and
        // d.csv (b.csv and 3 rows of d.csv read).
        let (ids, _) = read_all(&src, &[Some(json!({"file": 2, "row": 0})), Some(json!({"file": 1, "row": 3}))]);
        assert_eq!(ids, (33..40).collect::<Vec<_>>());
        assert!(src.identity(&[&json!({"file": 2, "row": 0}), &json!({"file": 1, "row": 3})]).is_none());
    }

    /// JSON lines: the schema covers every record (a field that appears at
    /// record 1,500 is a column, a fraction there makes the column a double),
    /// a byte order mark is skipped, and a value that fits no column is
    /// refused naming the file, the line, the field and the value.
    #[test]
    fn json_lines_keep_late_fields_and_every_digit() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::from("\u{feff}");
        for i in 0..2000 {
            match i {
                1500 => text.push_str("{\"id\": 1500, \"v\": 1500.5, \"tag\": \"late\"}\n"),
                _ => text.push_str(&format!("{{\"id\": {i}, \"v\": {i}}}\n")),
            }
            if i == 10 {
                text.push('\n');
            }
        }
        let path = dir.path().join("drift.jsonl");
        std::fs::write(&path, &text).unwrap();
        let src = open_local(&path, 256, 1).unwrap();
        let schema = src.tables().unwrap()[0].1.clone();
        assert_eq!(schema.field_with_name("v").unwrap().data_type(), &arrow_schema::DataType::Float64);
        assert!(schema.field_with_name("tag").unwrap().is_nullable());
        let mut r = src.reader(0, None).unwrap();
        let mut seen = Vec::new();
        while let Some(b) = r.next_batch(300).unwrap() {
            let id = b.batch.column_by_name("id").unwrap().as_any().downcast_ref::<Int64Array>().unwrap().clone();
            let v = b
                .batch
                .column_by_name("v")
                .unwrap()
                .as_any()
                .downcast_ref::<arrow_array::Float64Array>()
                .unwrap()
                .clone();
            let tag = b
                .batch
                .column_by_name("tag")
                .unwrap()
                .as_any()
                .downcast_ref::<arrow_array::StringArray>()
                .unwrap()
                .clone();
            for k in 0..b.batch.num_rows() {
                seen.push((id.value(k), v.value(k), tag.is_valid(k).then(|| tag.value(k).to_string())));
            }
        }
        let expected: Vec<(i64, f64, Option<String>)> = (0..2000)
            .map(|i| if i == 1500 { (i, 1500.5, Some("late".to_string())) } else { (i, i as f64, None) })
            .collect();
        assert_eq!(seen, expected);

        let bad = dir.path().join("bad.jsonl");
        let mut text: String = (0..1700).map(|i| format!("{{\"id\": {i}, \"v\": {i}}}\n")).collect();
        text.push_str("{\"id\": 1700, \"v\": \"abc\"}\n");
        std::fs::write(&bad, &text).unwrap();
        let err = open_local(&bad, 256, 1).unwrap().tables().unwrap_err().to_string();
        assert!(
            err.contains("bad.jsonl") && err.contains("line 1701") && err.contains("`v`") && err.contains("\"abc\""),
            "{err}"
        );

        let inexact = dir.path().join("inexact.jsonl");
        std::fs::write(&inexact, "{\"v\": 9007199254740993}\n{\"v\": 0.5}\n").unwrap();
        let err = open_local(&inexact, 256, 1).unwrap().tables().unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("9007199254740993") && err.contains("lose digits"), "{err}");
    }

    /// CSV errors name the file's own line (the header is line 1).
    #[test]
    fn csv_errors_name_the_files_own_line() {
        let dir = tempfile::tempdir().unwrap();
        let mut text: String =
            std::iter::once("id,v\n".to_string()).chain((0..1500).map(|i| format!("{i},{i}\n"))).collect();
        text.push_str("1500,1500.5\n");
        std::fs::write(dir.path().join("a.csv"), text).unwrap();
        let src = open_local(&dir.path().join("a.csv"), 100, 1).unwrap();
        let mut r = src.reader(0, None).unwrap();
        let err = loop {
            match r.next_batch(100) {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the fraction in an integer column is refused"),
                Err(e) => break e.to_string(),
            }
        };
        // Line 1 is the header, the record with id 1500 is line 1502.
        assert!(
            err.contains("a.csv") && err.contains("line 1502: column `v` holds \"1500.5\", which is not a valid Int64"),
            "{err}"
        );
    }

    /// Reads every batch of subtask 0, to the end or the first error.
    /// A change stream of one folder at parallelism 3: every subtask reads
    /// every file and keeps its keys' rows, so each change reaches exactly
    /// one subtask, every key one subtask, in source order, with `(hi, lo)` =
    /// (the file's ordinal, its CSV line); a resume from any position reads
    /// exactly the rest; the identity still refuses a new file that sorts
    /// before one already read.
    #[test]
    fn a_change_stream_splits_by_key_and_resumes_exactly() {
        use arrow_array::cast::AsArray;
        use arrow_array::types::{UInt8Type, UInt64Type};
        use sluice_core::changes::{OP, SEQ_HI, SEQ_LO};
        let dir = tempfile::tempdir().unwrap();
        for (f, name) in ["b.csv", "c.csv", "d.csv"].iter().enumerate() {
            let mut text = String::from("id,op,v\n");
            for i in 0..50 {
                let op = if (i + f) % 4 == 0 { "d" } else { "U" };
                text.push_str(&format!("{},{op},{f}-{i}\n", (i * 7 + f) % 13));
            }
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let spec = ChangeSpec { key: vec!["id".into()], column: Some("op".into()) };
        let src = open_local(dir.path(), 8, 3).unwrap().with_changes(Some(spec)).unwrap();
        let names: Vec<String> = src.tables().unwrap()[0].1.fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(names, vec!["id", "v"], "the change column is no table column");
        // (id, op, hi, lo) of every change a reader hands out, and its positions.
        type Read = (Vec<(i64, u8, u64, u64)>, Vec<Value>);
        let read = |subtask: u32, position: Option<&Value>, max: usize| -> Read {
            let mut r = src.reader(subtask, position).unwrap();
            let (mut out, mut positions) = (Vec::new(), Vec::new());
            while let Some(b) = r.next_batch(max).unwrap() {
                let schema = b.batch.schema();
                let n = schema.fields().len();
                assert_eq!(schema.field(n - 3).name(), OP);
                assert!(schema.field_with_name("op").is_err(), "the change column is consumed");
                let ids = b.batch.column_by_name("id").unwrap().as_primitive::<arrow_array::types::Int64Type>();
                let ops = b.batch.column_by_name(OP).unwrap().as_primitive::<UInt8Type>();
                let hi = b.batch.column_by_name(SEQ_HI).unwrap().as_primitive::<UInt64Type>();
                let lo = b.batch.column_by_name(SEQ_LO).unwrap().as_primitive::<UInt64Type>();
                for i in 0..b.batch.num_rows() {
                    out.push((ids.value(i), ops.value(i), hi.value(i), lo.value(i)));
                }
                positions.push(r.position());
            }
            (out, positions)
        };
        let mut all = Vec::new();
        let mut owner_of = std::collections::HashMap::new();
        for s in 0..3 {
            let (changes, positions) = read(s, None, 8);
            for (id, ..) in &changes {
                assert_eq!(*owner_of.entry(*id).or_insert(s), s, "key {id} on one subtask");
                // The subtask is the one key-hash-v1's bytes of the key name.
                let bytes = [&b"i"[..], &id.to_le_bytes()].concat();
                assert_eq!(super::super::changes::owner(super::super::changes::fnv1a64(bytes), 3), s, "key {id}");
            }
            assert!(changes.windows(2).all(|w| (w[0].2, w[0].3) < (w[1].2, w[1].3)), "source order");
            for at in &positions {
                let (rest, _) = read(s, Some(at), 5);
                assert_eq!(&changes[changes.len() - rest.len()..], rest.as_slice(), "after {at}");
            }
            all.extend(changes);
        }
        all.sort_by_key(|c| (c.2, c.3));
        let expected: Vec<(i64, u8, u64, u64)> = (0..3u64)
            .flat_map(|f| {
                (0..50u64).map(move |i| {
                    let op = u8::from((i + f) % 4 == 0);
                    (((i * 7 + f) % 13) as i64, op, f, i + 2)
                })
            })
            .collect();
        assert_eq!(all, expected, "every change once, seq = (file ordinal, line)");
        assert!(owner_of.values().collect::<std::collections::HashSet<_>>().len() > 1, "keys spread");
        // A new file that sorts before a file already read is refused.
        let (_, positions) = read(0, None, 8);
        let none = json!({ "after": null });
        let identity = src.identity(&[&positions[positions.len() / 2], &none, &none]).unwrap();
        std::fs::write(dir.path().join("a.csv"), "id,op,v\n1,u,x\n").unwrap();
        let grown = open_local(dir.path(), 8, 3)
            .unwrap()
            .with_changes(Some(ChangeSpec { key: vec!["id".into()], column: Some("op".into()) }))
            .unwrap();
        let crate::SourceIdentity::File { subtasks, key, key_hash } = identity else { panic!("a file identity") };
        assert_eq!(key.as_deref(), Some(&["id".to_string()][..]));
        assert_eq!(key_hash.as_deref(), Some(KEY_HASH_SCHEME));
        let err = grown.check_identity(&subtasks, key.as_deref(), key_hash.as_deref()).unwrap_err().0;
        assert!(err.contains("a.csv is new and sorts before"), "{err}");
        // Nor does it resume as an append stream, or an append stream's checkpoint as a change stream.
        let plain = open_local(dir.path(), 8, 3).unwrap();
        let err = plain.check_identity(&subtasks, key.as_deref(), key_hash.as_deref()).unwrap_err().0;
        assert!(err.contains("change stream keyed by [\"id\"]") && err.contains("an append stream"), "{err}");
        let err = grown.check_identity(&[], None, None).unwrap_err().0;
        assert!(err.contains("the checkpoint was taken of an append stream"), "{err}");
    }

    /// A change stream's checkpoint records the key hash scheme, and resumes
    /// only under it: another scheme, or none (a checkpoint taken before
    /// schemes were recorded), is refused naming the way out; the record
    /// round-trips through the checkpoint's JSON, and an append stream's
    /// records none.
    #[test]
    fn a_change_stream_resumes_only_under_the_key_hash_scheme_it_recorded() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{\"id\": 1, \"op\": \"u\"}\n{\"id\": 2, \"op\": \"d\"}\n").unwrap();
        let spec = ChangeSpec { key: vec!["id".into()], column: Some("op".into()) };
        let src = crate::Source::File(open_local(dir.path(), 8, 2).unwrap().with_changes(Some(spec)).unwrap());
        let mut r = src.reader(0, None).unwrap();
        while r.next_batch(8).unwrap().is_some() {}
        let (pos, none) = (r.position(), json!({ "after": null }));
        let identity = src.identity(&[&pos, &none]).unwrap();
        let text = serde_json::to_value(&identity).unwrap();
        assert_eq!(text["key_hash"], json!(KEY_HASH_SCHEME), "{text}");
        let back: crate::SourceIdentity = serde_json::from_value(text.clone()).unwrap();
        assert_eq!(back, identity);
        src.check_identity(Some(&back)).unwrap();
        // Another scheme, and none recorded.
        let mut other = text.clone();
        other["key_hash"] = json!("key-hash-v0");
        let err = src.check_identity(Some(&serde_json::from_value(other).unwrap())).unwrap_err().0;
        assert!(err.contains("\"key-hash-v0\"") && err.contains("--new-incarnation"), "{err}");
        let mut before = text;
        before.as_object_mut().unwrap().remove("key_hash");
        let err = src.check_identity(Some(&serde_json::from_value(before).unwrap())).unwrap_err().0;
        assert!(err.contains("did not record") && err.contains("fresh job.state_dir with --new-incarnation"), "{err}");
        // An append stream records no scheme, and resumes without one.
        let plain = crate::Source::File(open_local(dir.path(), 8, 2).unwrap());
        let identity = plain.identity(&[&none, &none]).unwrap();
        assert!(serde_json::to_value(&identity).unwrap().get("key_hash").is_none());
        plain.check_identity(Some(&identity)).unwrap();
    }

    /// A float key column is refused when the table's schema is known, as
    /// a config error naming source.key and the column.
    #[test]
    fn a_float_key_column_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{\"id\": 1, \"price\": 1.5, \"op\": \"u\"}\n").unwrap();
        let spec = ChangeSpec { key: vec!["id".into(), "price".into()], column: Some("op".into()) };
        let src = open_local(dir.path(), 8, 1).unwrap().with_changes(Some(spec)).unwrap();
        let err = src.tables().unwrap_err();
        assert!(matches!(err, SourceError::Config { ref key, .. } if key == "source.key"), "{err:?}");
        let err = err.to_string();
        assert!(err.contains("column `price`") && err.contains("Float64") && err.contains("a.jsonl"), "{err}");
        let spec = ChangeSpec { key: vec!["id".into()], column: Some("op".into()) };
        open_local(dir.path(), 8, 1).unwrap().with_changes(Some(spec)).unwrap().tables().unwrap();
    }

    fn read_to_error(src: &FileSource) -> (Vec<RecordBatch>, Option<String>) {
        let mut r = src.reader(0, None).unwrap();
        let mut batches = Vec::new();
        loop {
            match r.next_batch(100) {
                Ok(Some(b)) => batches.push(b.batch),
                Ok(None) => return (batches, None),
                Err(e) => return (batches, Some(e.to_string())),
            }
        }
    }

    /// A later file of a table is read with the types its earlier files
    /// gave the table: one bad value is an error naming the file, the line,
    /// the column, the value and the type, not a column of strings; a new
    /// column is still inferred.
    #[test]
    fn later_csv_files_are_read_with_the_tables_types() {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("orders");
        std::fs::create_dir_all(&table).unwrap();
        let rows = |n: usize, bad: Option<usize>, note: bool| -> String {
            let head = if note { "id,qty,note\n" } else { "id,qty\n" };
            std::iter::once(head.to_string())
                .chain((0..n).map(|i| {
                    // Line 1 is the header: record i is line i + 2.
                    let qty = if Some(i + 2) == bad { "x7".to_string() } else { (i % 9).to_string() };
                    if note { format!("{i},{qty},n{i}\n") } else { format!("{i},{qty}\n") }
                }))
                .collect()
        };
        std::fs::write(table.join("orders-2024-01.csv"), rows(20, None, false)).unwrap();
        std::fs::write(table.join("orders-2024-02.csv"), rows(700, Some(500), true)).unwrap();
        let src = open_local(dir.path(), 100, 1).unwrap();
        let known = src.tables().unwrap()[0].1.clone();
        assert_eq!(known.field_with_name("qty").unwrap().data_type(), &arrow_schema::DataType::Int64);
        let (batches, err) = read_to_error(&src);
        let err = err.expect("the bad value is refused");
        assert!(
            err.contains("orders-2024-02.csv")
                && err.contains("line 500: column `qty` holds \"x7\", which is not a valid Int64"),
            "{err}"
        );
        // Nothing of the bad file's batch holding line 500 was handed out.
        let good: usize = batches.iter().map(RecordBatch::num_rows).sum();
        assert!(good <= 20 + 498, "{good} rows handed out before the error");
        assert!(
            batches
                .iter()
                .all(|b| b.schema().field_with_name("qty").unwrap().data_type() == &arrow_schema::DataType::Int64)
        );

        // Without the bad value the later file keeps `qty` an integer and adds `note`.
        std::fs::write(table.join("orders-2024-02.csv"), rows(700, None, true)).unwrap();
        let src = open_local(dir.path(), 100, 1).unwrap();
        let (batches, err) = read_to_error(&src);
        assert_eq!(err, None);
        assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 720);
        let last = batches.last().unwrap().schema();
        assert_eq!(last.field_with_name("qty").unwrap().data_type(), &arrow_schema::DataType::Int64);
        assert_eq!(last.field_with_name("note").unwrap().data_type(), &arrow_schema::DataType::Utf8);
    }

    /// With dead letters, a value that does not parse leaves its record
    /// beside the batch (its text, its file and line, the reason) and every
    /// other record of the file is read as in a file without it, empty
    /// fields as nulls and quoted text as text; a resume from any position
    /// reads each record, good or bad, exactly once.
    #[test]
    fn dead_letter_csv_records_stand_beside_the_rows_and_resume_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("orders");
        std::fs::create_dir_all(&table).unwrap();
        std::fs::write(table.join("a.csv"), "id,qty,note\n0,1,x\n1,2,y\n").unwrap();
        let mut text = String::from("id,qty,note\n");
        for i in 0..700 {
            // Line 1 is the header: record i is line i + 2.
            let qty = match i + 2 {
                500 => "x7".to_string(),
                650 => "1.5".to_string(),
                600 => String::new(),
                _ => (i % 9).to_string(),
            };
            text.push_str(&format!("{i},{qty},\"n, {i}\"\n"));
        }
        std::fs::write(table.join("b.csv"), text).unwrap();
        let src = open_local(dir.path(), 100, 1).unwrap().with_bad_rows(BadRows::DeadLetter);
        let read = |position: Option<&Value>, max: usize| {
            let mut r = src.reader(0, position).unwrap();
            let (mut good, mut bad, mut positions) = (Vec::new(), Vec::new(), Vec::new());
            while let Some(b) = r.next_batch(max).unwrap() {
                let ids = b.batch.column_by_name("id").unwrap().as_any().downcast_ref::<Int64Array>().unwrap().clone();
                let qty = b.batch.column_by_name("qty").unwrap().as_any().downcast_ref::<Int64Array>().unwrap().clone();
                for i in 0..ids.len() {
                    good.push((ids.value(i), qty.is_null(i)));
                }
                bad.extend(b.bad);
                positions.push(r.position());
            }
            (good, bad, positions)
        };
        let (good, bad, positions) = read(None, 100);
        assert_eq!(good.len(), 2 + 698, "every good record once");
        assert_eq!(good.iter().filter(|(_, null)| *null).count(), 1, "the empty qty of line 600 is a null");
        let shown: Vec<(&str, &str)> = bad.iter().map(|b| (b.position.as_str(), b.raw.as_str())).collect();
        assert_eq!(
            shown,
            vec![("orders/b.csv line 500", "498,x7,\"n, 498\""), ("orders/b.csv line 650", "648,1.5,\"n, 648\"")]
        );
        assert!(bad[0].reason.contains("column `qty` holds \"x7\", which is not a valid Int64"), "{}", bad[0].reason);
        // A resume from every position reads the rest, good and bad, once.
        let mut read_before = (0, 0);
        let mut r = src.reader(0, None).unwrap();
        for at in &positions {
            let (rest, rest_bad, _) = read(Some(at), 37);
            assert_eq!(&good[good.len() - rest.len()..], rest.as_slice(), "rows after position {at}");
            assert_eq!(&bad[bad.len() - rest_bad.len()..], rest_bad.as_slice(), "bad rows after position {at}");
            let b = r.next_batch(100).unwrap().unwrap();
            read_before = (read_before.0 + b.batch.num_rows(), read_before.1 + b.bad.len());
            assert_eq!((read_before.0 + rest.len(), read_before.1 + rest_bad.len()), (good.len(), bad.len()));
        }
        // Without dead letters the same file stops at line 500.
        let (_, err) = read_to_error(&open_local(dir.path(), 100, 1).unwrap());
        assert!(err.is_some_and(|e| e.contains("line 500")));
    }

    /// JSON lines with dead letters: a record that does not fit (a string
    /// among integers, a line that is no JSON, a fraction in a later file's
    /// integer column) is left out of the schema and handed out as it is,
    /// with its line; a resume from any position reads each record once.
    #[test]
    fn dead_letter_json_lines_stand_beside_the_rows_and_resume_exactly_once() {
        let dir = tempfile::tempdir().unwrap();
        let table = dir.path().join("events");
        std::fs::create_dir_all(&table).unwrap();
        let mut first = String::new();
        for i in 0..300 {
            let line = match i {
                // Line i + 1.
                4 => format!("{{\"id\": {i}, \"v\": \"abc\"}}"),
                8 => "{not json".to_string(),
                // Its new field must not enter the schema: the record is bad.
                120 => format!("{{\"id\": {i}, \"w\": 1, \"v\": [1]}}"),
                _ => format!("{{\"id\": {i}, \"v\": {}}}", i % 5),
            };
            first.push_str(&line);
            first.push('\n');
        }
        std::fs::write(table.join("a.jsonl"), first).unwrap();
        let later: String = (300..400)
            .map(|i| {
                if i == 350 { format!("{{\"id\": {i}, \"v\": 1.5}}\n") } else { format!("{{\"id\": {i}, \"v\": 2}}\n") }
            })
            .collect();
        std::fs::write(table.join("b.jsonl"), later).unwrap();
        let src = open_local(dir.path(), 64, 1).unwrap().with_bad_rows(BadRows::DeadLetter);
        let schema = src.tables().unwrap()[0].1.clone();
        assert!(schema.field_with_name("w").is_err(), "a bad record adds no column: {schema:?}");
        assert_eq!(schema.field_with_name("v").unwrap().data_type(), &arrow_schema::DataType::Int64);
        let read = |position: Option<&Value>, max: usize| {
            let mut r = src.reader(0, position).unwrap();
            let (mut good, mut bad, mut positions) = (Vec::new(), Vec::new(), Vec::new());
            while let Some(b) = r.next_batch(max).unwrap() {
                let ids = b.batch.column_by_name("id").unwrap().as_any().downcast_ref::<Int64Array>().unwrap().clone();
                good.extend((0..ids.len()).map(|i| ids.value(i)));
                bad.extend(b.bad);
                positions.push(r.position());
            }
            (good, bad, positions)
        };
        let (good, bad, positions) = read(None, 50);
        assert_eq!(good.len(), 400 - 4, "every good record once");
        let shown: Vec<&str> = bad.iter().map(|b| b.position.as_str()).collect();
        assert_eq!(
            shown,
            vec!["events/a.jsonl line 5", "events/a.jsonl line 9", "events/a.jsonl line 121", "events/b.jsonl line 51"]
        );
        assert_eq!(bad[1].raw, "{not json");
        assert!(bad[0].reason.contains("field `v` = \"abc\" does not fit its column"), "{}", bad[0].reason);
        assert!(bad[3].reason.contains("earlier files"), "{}", bad[3].reason);
        for at in &positions {
            let (rest, rest_bad, _) = read(Some(at), 7);
            assert_eq!(&good[good.len() - rest.len()..], rest.as_slice(), "rows after {at}");
            assert_eq!(&bad[bad.len() - rest_bad.len()..], rest_bad.as_slice(), "bad rows after {at}");
        }
        let (_, err) = read_to_error(&open_local(dir.path(), 64, 1).unwrap());
        assert!(err.is_some_and(|e| e.contains("line 5")));
    }

    /// A Parquet file that fails to decode names the row group and the row.
    #[test]
    fn a_broken_parquet_row_group_is_named() {
        use parquet::arrow::ArrowWriter;
        use parquet::file::properties::WriterProperties;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.parquet");
        let schema = Arc::new(arrow_schema::Schema::new(vec![arrow_schema::Field::new(
            "id",
            arrow_schema::DataType::Int64,
            false,
        )]));
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(1000))
            .set_compression(parquet::basic::Compression::ZSTD(Default::default()))
            .set_dictionary_enabled(false)
            .build();
        let mut w = ArrowWriter::try_new(File::create(&path).unwrap(), schema.clone(), Some(props)).unwrap();
        let ids: Vec<i64> = (0..2000).map(|i| i * 7919 % 100_003).collect();
        w.write(&RecordBatch::try_new(schema, vec![Arc::new(Int64Array::from(ids))]).unwrap()).unwrap();
        let meta = w.close().unwrap();
        assert_eq!(meta.num_row_groups(), 2);
        // Garbles the middle of row group 1's compressed data page.
        let chunk = meta.row_group(1).column(0);
        let (start, len) = (chunk.data_page_offset() as usize, chunk.compressed_size() as usize);
        let mut bytes = std::fs::read(&path).unwrap();
        for b in &mut bytes[start + len / 3..start + len / 2] {
            *b = 0xA5;
        }
        std::fs::write(&path, bytes).unwrap();
        let src = open_local(&path, 250, 1).unwrap();
        let (batches, err) = read_to_error(&src);
        let err = err.expect("the broken row group fails");
        assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 1000, "row group 0 reads: {err}");
        assert!(
            err.contains("a.parquet") && err.contains("row group 1, from its row 0 (row 1000 of the file)"),
            "{err}"
        );
    }

    /// A known type is forced on a later file only where that loses
    /// nothing: a date column does not turn a later file's timestamps into
    /// dates, and a text column reads a later file's numbers as text.
    #[test]
    fn later_csv_files_keep_their_own_type_where_the_known_one_would_lose_values() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.csv"), "id,d,t\n1,2024-02-01,x\n").unwrap();
        std::fs::write(dir.path().join("b.csv"), "id,d,t\n2,2024-02-01T13:45:00,7\n").unwrap();
        let src = open_local(dir.path(), 100, 1).unwrap();
        let (batches, err) = read_to_error(&src);
        assert_eq!(err, None);
        let first = batches[0].schema();
        let later = batches[1].schema();
        assert_eq!(first.field_with_name("d").unwrap().data_type(), &arrow_schema::DataType::Date32);
        assert_ne!(later.field_with_name("d").unwrap().data_type(), &arrow_schema::DataType::Date32);
        assert_eq!(later.field_with_name("t").unwrap().data_type(), &arrow_schema::DataType::Utf8);
    }

    /// The same for JSON lines: a later file's value of another kind than
    /// the table's column is refused naming its line, and a table's integer
    /// column does not widen to a double in a later file (a fraction would
    /// otherwise be cut off by the integer column).
    #[test]
    fn later_json_files_are_read_with_the_tables_types() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.jsonl"), "{\"id\": 1, \"v\": 1}\n{\"id\": 2, \"v\": 2}\n").unwrap();
        let later = |bad: &str| -> String {
            (0..1200)
                .map(|i| {
                    if i == 1099 {
                        format!("{{\"id\": {i}, \"v\": {bad}}}\n")
                    } else {
                        format!("{{\"id\": {i}, \"v\": {i}}}\n")
                    }
                })
                .collect()
        };
        for (bad, expected) in [("\"abc\"", "integers"), ("1.5", "integers")] {
            std::fs::write(dir.path().join("b.jsonl"), later(bad)).unwrap();
            let src = open_local(dir.path(), 100, 1).unwrap();
            let (_, err) = read_to_error(&src);
            let err = err.expect("the value is refused");
            assert!(
                err.contains("b.jsonl")
                    && err.contains(&format!("line 1100: field `v` = {bad} does not fit its column"))
                    && err.contains(&format!("the table's earlier files hold {expected} there")),
                "{err}"
            );
        }
        std::fs::write(dir.path().join("b.jsonl"), later("7")).unwrap();
        let src = open_local(dir.path(), 100, 1).unwrap();
        let (batches, err) = read_to_error(&src);
        assert_eq!(err, None);
        assert_eq!(batches.iter().map(RecordBatch::num_rows).sum::<usize>(), 1202);
    }

    fn ids_n(reader: &mut FileReader, max: usize, batches: usize) -> Vec<i64> {
        let mut out = Vec::new();
        for _ in 0..batches {
            let b = reader.next_batch(max).unwrap().unwrap().batch;
            let col = b.column_by_name("id").unwrap();
            out.extend(col.as_any().downcast_ref::<Int64Array>().unwrap().values().iter().copied());
        }
        out
    }
}
