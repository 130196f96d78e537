//! `file`: JSON lines, CSV or Parquet, read with the arrow crates.
//!
//! Files are sorted by path and dealt out round-robin: file `i` belongs to
//! subtask `i % parallelism`. A subtask's position is `{file, row}`: the index
//! among its own files and the rows already delivered from that file.
//! The schema is read (Parquet) or inferred from the first 1000 records of the
//! first file (CSV, JSON), which gives the same answer on every run.

use std::fs::File;
use std::io::{BufReader, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::{ArrowError, SchemaRef};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde_json::json;

use super::{SourceError, SourceReader};
use crate::job::FileFormat;

const INFER_RECORDS: usize = 1000;

type BatchIter = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>> + Send>;

pub struct FileSource {
    files: Vec<PathBuf>,
    format: FileFormat,
    schema: SchemaRef,
    batch_rows: usize,
    csv_header: bool,
    parallelism: u32,
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> SourceError {
    SourceError::File { path: path.display().to_string(), message: e.to_string() }
}

impl FileSource {
    pub fn open(
        path: &Path,
        format: Option<FileFormat>,
        batch_rows: usize,
        csv_header: bool,
        parallelism: u32,
    ) -> Result<Self, SourceError> {
        let mut files = Vec::new();
        if path.is_dir() {
            for entry in std::fs::read_dir(path).map_err(|e| file_err(path, e))? {
                let p = entry.map_err(|e| file_err(path, e))?.path();
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
        } else {
            files.push(path.to_path_buf());
        }
        let first = files.first().ok_or_else(|| file_err(path, "holds no csv, json or parquet files"))?.clone();
        let format = match format.or_else(|| FileFormat::from_path(&first)) {
            Some(f) => f,
            None => return Err(file_err(&first, "cannot tell the format from the extension; set source.format")),
        };
        if let Some(odd) = files.iter().find(|p| FileFormat::from_path(p).is_some_and(|f| f != format)) {
            return Err(file_err(odd, "has a different format than the other files; keep one format per source"));
        }
        let schema = infer_schema(&first, format, csv_header)?;
        if format == FileFormat::Parquet {
            for other in &files[1..] {
                let s = infer_schema(other, format, csv_header)?;
                if s.fields() != schema.fields() {
                    return Err(file_err(other, format!("schema differs from {}'s", first.display())));
                }
            }
        }
        Ok(Self { files, format, schema, batch_rows, csv_header, parallelism })
    }

    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    pub fn batch_rows(&self) -> usize {
        self.batch_rows
    }

    pub fn describe(&self) -> String {
        format!("{} {:?} file(s)", self.files.len(), self.format).to_lowercase()
    }

    pub fn reader(&self, subtask: u32, position: Option<&serde_json::Value>) -> Result<FileReader, SourceError> {
        let p = self.parallelism.max(1) as usize;
        let mine: Vec<PathBuf> =
            self.files.iter().enumerate().filter(|(i, _)| i % p == subtask as usize).map(|(_, f)| f.clone()).collect();
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
            schema: self.schema.clone(),
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
    files: Vec<PathBuf>,
    format: FileFormat,
    schema: SchemaRef,
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
        let path = &self.files[self.file_idx];
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
                file.seek(SeekFrom::Start(0)).map_err(|e| file_err(path, e))?;
                Box::new(
                    arrow_csv::ReaderBuilder::new(self.schema.clone())
                        .with_header(self.csv_header)
                        .with_batch_size(self.batch_rows)
                        .build(file)
                        .map_err(|e| file_err(path, e))?,
                )
            }
            FileFormat::Json => Box::new(
                arrow_json::ReaderBuilder::new(self.schema.clone())
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
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<RecordBatch>, SourceError> {
        loop {
            if let Some(batch) = self.pending.take() {
                let out = if batch.num_rows() > max_rows {
                    self.pending = Some(batch.slice(max_rows, batch.num_rows() - max_rows));
                    batch.slice(0, max_rows)
                } else {
                    batch
                };
                self.row_in_file += out.num_rows() as u64;
                return Ok(Some(out));
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
                    let path = &self.files[self.file_idx];
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
            let col = b.column_by_name("id").unwrap();
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

    fn ids_n(reader: &mut FileReader, max: usize, batches: usize) -> Vec<i64> {
        let mut out = Vec::new();
        for _ in 0..batches {
            let b = reader.next_batch(max).unwrap().unwrap();
            let col = b.column_by_name("id").unwrap();
            out.extend(col.as_any().downcast_ref::<Int64Array>().unwrap().values().iter().copied());
        }
        out
    }
}
