//! `file`: JSON lines, CSV or Parquet, read with the arrow crates.
//!
//! Three layouts:
//! - one file, or a directory of files: one table, `""`; files are sorted
//!   by path and dealt out round-robin: file `i` belongs to subtask `i % p`;
//! - a tree with one folder per table (`<path>/<table>/*`): the tables,
//!   sorted by name, are dealt out round-robin (table `j` belongs to subtask
//!   `j % p`), and a subtask reads each of its tables' files in name order,
//!   so a table's rows keep their order.
//!
//! A subtask's position is `{file, row}`: the index among its own files and
//! the rows already delivered from that file. Each file's schema is read
//! (Parquet) or inferred from its first 1000 records (CSV, JSON), which gives
//! the same answer on every run; schemas may change from one file to the
//! next (the engine evolves the table).

use std::fs::File;
use std::io::{BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::json;

use super::{SourceError, SourceReader, TableBatch};
use crate::job::FileFormat;

const INFER_RECORDS: usize = 1000;

type BatchIter = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>;

/// One table's files, in reading order.
struct TableFiles {
    name: String,
    files: Vec<PathBuf>,
    /// The schema of its first file.
    schema: SchemaRef,
}

pub struct FileSource {
    tables: Vec<TableFiles>,
    /// One folder per table.
    tree: bool,
    format: FileFormat,
    batch_rows: usize,
    csv_header: bool,
    parallelism: u32,
    rate: Option<f64>,
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

impl FileSource {
    pub fn open(
        path: &Path,
        format: Option<FileFormat>,
        batch_rows: usize,
        csv_header: bool,
        parallelism: u32,
    ) -> Result<Self, SourceError> {
        let mut layout: Vec<(String, Vec<PathBuf>)> = Vec::new();
        let mut tree = false;
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
                (false, _) => layout.push((String::new(), files)),
                (true, false) => {
                    tree = true;
                    for folder in folders {
                        let name = folder.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                        let files = data_files(&folder, format)?;
                        if files.is_empty() {
                            tracing::warn!(folder = %folder.display(), "the table folder holds no csv, json or parquet files; skipped");
                            continue;
                        }
                        layout.push((name, files));
                    }
                }
                (true, true) => {}
            }
        } else {
            layout.push((String::new(), vec![path.to_path_buf()]));
        }
        let first = layout
            .iter()
            .flat_map(|(_, f)| f.first())
            .next()
            .ok_or_else(|| file_err(path, "holds no csv, json or parquet files"))?
            .clone();
        let format = match format.or_else(|| FileFormat::from_path(&first)) {
            Some(f) => f,
            None => return Err(file_err(&first, "cannot tell the format from the extension; set source.format")),
        };
        if let Some(odd) =
            layout.iter().flat_map(|(_, f)| f).find(|p| FileFormat::from_path(p).is_some_and(|f| f != format))
        {
            return Err(file_err(odd, "has a different format than the other files; keep one format per source"));
        }
        let mut tables = Vec::with_capacity(layout.len());
        for (name, files) in layout {
            let schema = infer_schema(&files[0], format, csv_header)?;
            tables.push(TableFiles { name, files, schema });
        }
        Ok(Self { tables, tree, format, batch_rows, csv_header, parallelism, rate: None })
    }

    /// Limits the rows per second over all subtasks.
    pub fn with_rate(mut self, rate: Option<f64>) -> Self {
        self.rate = rate;
        self
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// The tables, with the schemas of their first files.
    pub fn tables(&self) -> Vec<(String, SchemaRef)> {
        self.tables.iter().map(|t| (t.name.clone(), t.schema.clone())).collect()
    }

    /// One folder per table.
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
    fn files_of(&self, subtask: u32) -> Vec<(String, PathBuf)> {
        let p = self.parallelism.max(1) as usize;
        let s = subtask as usize;
        if self.tree {
            self.tables
                .iter()
                .enumerate()
                .filter(|(j, _)| j % p == s)
                .flat_map(|(_, t)| t.files.iter().map(|f| (t.name.clone(), f.clone())))
                .collect()
        } else {
            self.tables
                .iter()
                .flat_map(|t| t.files.iter().map(|f| (t.name.clone(), f.clone())))
                .enumerate()
                .filter(|(i, _)| i % p == s)
                .map(|(_, f)| f)
                .collect()
        }
    }

    pub fn reader(&self, subtask: u32, position: Option<&serde_json::Value>) -> Result<FileReader, SourceError> {
        let mine = self.files_of(subtask);
        let (file_idx, row) = match position {
            None => (0, 0),
            Some(v) => {
                let f = v.get("file").and_then(|x| x.as_u64());
                let r = v.get("row").and_then(|x| x.as_u64());
                match (f, r) {
                    (Some(f), Some(r)) if f as usize <= mine.len() => (f as usize, r),
                    _ => {
                        return Err(SourceError::Position {
                            position: v.to_string(),
                            message: format!("subtask {subtask} has {} file(s) (did the input change?)", mine.len()),
                        });
                    }
                }
            }
        };
        Ok(FileReader {
            files: mine,
            format: self.format,
            batch_rows: self.batch_rows,
            csv_header: self.csv_header,
            file_idx,
            row_in_file: row,
            current: None,
            pending: None,
        })
    }
}

fn infer_schema(path: &Path, format: FileFormat, csv_header: bool) -> Result<SchemaRef, SourceError> {
    let file = File::open(path).map_err(|e| file_err(path, e))?;
    match format {
        FileFormat::Parquet => {
            let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| file_err(path, e))?;
            Ok(builder.schema().clone())
        }
        FileFormat::Csv => {
            let (schema, _) = arrow_csv::reader::Format::default()
                .with_header(csv_header)
                .infer_schema(file, Some(INFER_RECORDS))
                .map_err(|e| file_err(path, e))?;
            Ok(Arc::new(schema))
        }
        FileFormat::Json => {
            let (schema, _) =
                arrow_json::reader::infer_json_schema_from_seekable(BufReader::new(file), Some(INFER_RECORDS))
                    .map_err(|e| file_err(path, e))?;
            Ok(Arc::new(schema))
        }
    }
}

pub struct FileReader {
    /// This subtask's files, in reading order, with their tables.
    files: Vec<(String, PathBuf)>,
    format: FileFormat,
    batch_rows: usize,
    csv_header: bool,
    file_idx: usize,
    /// Rows of the current file already returned.
    row_in_file: u64,
    current: Option<BatchIter>,
    /// Rows read but not yet returned.
    pending: Option<RecordBatch>,
}

impl FileReader {
    /// Opens file `file_idx`, positioned after `skip` rows.
    fn open_current(&self, skip: u64) -> Result<BatchIter, SourceError> {
        let path = &self.files[self.file_idx].1;
        let mut file = File::open(path).map_err(|e| file_err(path, e))?;
        let iter: BatchIter = match self.format {
            FileFormat::Parquet => {
                let reader = ParquetRecordBatchReaderBuilder::try_new(file)
                    .map_err(|e| file_err(path, e))?
                    .with_batch_size(self.batch_rows)
                    .with_offset(usize::try_from(skip).map_err(|e| file_err(path, e))?)
                    .build()
                    .map_err(|e| file_err(path, e))?;
                return Ok(Box::new(reader));
            }
            FileFormat::Csv => {
                // Each file with its own schema: schemas may evolve file to file.
                let schema = infer_schema(path, self.format, self.csv_header)?;
                file.seek(SeekFrom::Start(0)).map_err(|e| file_err(path, e))?;
                Box::new(
                    arrow_csv::ReaderBuilder::new(schema)
                        .with_header(self.csv_header)
                        .with_batch_size(self.batch_rows)
                        .build(file)
                        .map_err(|e| file_err(path, e))?,
                )
            }
            FileFormat::Json => Box::new(
                arrow_json::ReaderBuilder::new(infer_schema(path, self.format, self.csv_header)?)
                    .with_batch_size(self.batch_rows)
                    .build(BufReader::new(file))
                    .map_err(|e| file_err(path, e))?,
            ),
        };
        Ok(Box::new(SkipRows { inner: iter, skip }))
    }
}

/// Drops the first `skip` rows of a batch stream (CSV and JSON cannot seek by row).
struct SkipRows {
    inner: BatchIter,
    skip: u64,
}

impl Iterator for SkipRows {
    type Item = Result<RecordBatch, ArrowError>;
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let batch = match self.inner.next()? {
                Ok(b) => b,
                Err(e) => return Some(Err(e)),
            };
            if self.skip == 0 {
                return Some(Ok(batch));
            }
            let n = batch.num_rows() as u64;
            if n <= self.skip {
                self.skip -= n;
                continue;
            }
            let s = self.skip as usize;
            self.skip = 0;
            return Some(Ok(batch.slice(s, batch.num_rows() - s)));
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
                self.row_in_file += out.num_rows() as u64;
                let table = self.files[self.file_idx].0.clone();
                return Ok(Some(TableBatch { table, batch: out }));
            }
            if max_rows == 0 || self.file_idx >= self.files.len() {
                return Ok(None);
            }
            if self.current.is_none() {
                self.current = Some(self.open_current(self.row_in_file)?);
            }
            let next = self.current.as_mut().and_then(|it| it.next());
            match next {
                Some(Ok(batch)) if batch.num_rows() == 0 => {}
                Some(Ok(batch)) => self.pending = Some(batch),
                Some(Err(e)) => {
                    let path = &self.files[self.file_idx].1;
                    return Err(file_err(path, format!("after row {}: {e}", self.row_in_file)));
                }
                None => {
                    self.current = None;
                    self.file_idx += 1;
                    self.row_in_file = 0;
                }
            }
        }
    }

    fn position(&self) -> serde_json::Value {
        json!({ "file": self.file_idx, "row": self.row_in_file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int64Array;

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

        let src = FileSource::open(&dir.path().join("a.csv"), None, 4, true, 1).unwrap();
        let mut r = src.reader(0, None).unwrap();
        let first: Vec<i64> = ids_n(&mut r, 3, 2);
        let pos = r.position();
        let mut r2 = src.reader(0, Some(&pos)).unwrap();
        let rest = ids(&mut r2, 5);
        assert_eq!([first, rest].concat(), (0..25).collect::<Vec<_>>());

        let src = FileSource::open(&dir.path().join("b.json"), None, 3, true, 1).unwrap();
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
        let src = FileSource::open(dir.path(), None, 2, true, 2).unwrap();
        assert!(src.is_tree());
        let names: Vec<String> = src.tables().into_iter().map(|(t, _)| t).collect();
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
