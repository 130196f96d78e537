//! The committer's key index of one table in `mode = "upsert"`: key → the
//! data file(s) and row position(s) holding the key's live row.
//!
//! Invariants:
//! - the index describes exactly one snapshot, [`KeyIndex::base`]: every
//!   live row of every live data file of it, minus the positions its live
//!   position-delete files delete. It is a function of the live data and
//!   delete files alone (data files are immutable, so a position names one
//!   row forever), so advancing it to another snapshot compares live files:
//!   a data file gone drops its rows (a compaction adds them back through
//!   the files it adds, which are read), a data file come is read (key
//!   columns with positions), a delete file come drops the positions it
//!   names, and a delete file gone (its rows would come back) rebuilds the
//!   index from the table. No history needs to reach back to `base`;
//! - on a format-version-3 table a deletion vector gone is no reason to
//!   rebuild when its data file is gone too, or when a deletion vector come
//!   names its data file (at most one live vector per data file, and a
//!   writer that replaces one merges the old positions into the new one);
//!   the index's own commits forget the vectors they replace
//!   ([`KeyIndex::committed`]);
//! - equality delete files are refused (their rows cannot be placed);
//! - memory is bounded by `key_index_max_mb`: the estimate
//!   ([`BYTES_PER_KEY`] plus the key's bytes per key) past it is a `config`
//!   error naming the option and the table, before anything is committed.

use std::collections::{HashMap, HashSet};

use iceberg::spec::{DataContentType, DataFile, Struct};
use iceberg::table::Table;
use sluice_guest_sdk::{SinkError, error};

use crate::keys::{self, KeyColumns};
use crate::position_deletes;
use crate::snapshot::LoadedManifest;
use crate::upsert::{Final, Merged};

/// What one key costs beyond its bytes: the hash-table slot (boxed key
/// and location, 40 bytes on 64-bit) at the table's load factor after
/// growth, its control byte, and the key's allocation. Measured natively
/// (64-bit, the same map of 8-byte keys with one location each): 117 bytes
/// per key at 1 million keys, 109 at 4 million, so about 110 MB per million
/// keys; the 32-bit guest's pointers make it somewhat less.
pub(crate) const BYTES_PER_KEY: usize = 104;

/// A data file the index points into.
#[derive(Debug, Clone)]
pub(crate) struct FileMeta {
    pub(crate) path: String,
    pub(crate) spec_id: i32,
    pub(crate) partition: Struct,
}

#[derive(Debug, Clone)]
enum Locs {
    One(u32, u64),
    Many(Vec<(u32, u64)>),
}

impl Locs {
    fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        let (one, many) = match self {
            Locs::One(f, p) => (Some((*f, *p)), &[][..]),
            Locs::Many(v) => (None, &v[..]),
        };
        one.into_iter().chain(many.iter().copied())
    }

    fn push(&mut self, at: (u32, u64)) {
        match self {
            Locs::One(f, p) => *self = Locs::Many(vec![(*f, *p), at]),
            Locs::Many(v) => v.push(at),
        }
    }

    /// Keeps the locations `keep` accepts; `false` when none is left.
    fn retain(&mut self, keep: impl Fn(&(u32, u64)) -> bool) -> bool {
        match self {
            Locs::One(f, p) => keep(&(*f, *p)),
            Locs::Many(v) => {
                v.retain(keep);
                match v.as_slice() {
                    [] => false,
                    [one] => {
                        *self = Locs::One(one.0, one.1);
                        true
                    }
                    _ => true,
                }
            }
        }
    }
}

/// Logs `message` through the host (not in native unit tests, which have none).
fn note(message: &str) {
    #[cfg(not(test))]
    sluice_guest_sdk::log::info(message);
    #[cfg(test)]
    let _ = message;
}

pub(crate) struct KeyIndex {
    table: String,
    key: KeyColumns,
    max_bytes: usize,
    /// The snapshot described (`Some(None)`: the table had none); `None`
    /// until built.
    base: Option<Option<i64>>,
    files: Vec<Option<FileMeta>>,
    file_ids: HashMap<String, u32>,
    /// The live delete files read, each with the data file it is the
    /// deletion vector of (`None`: a Parquet position-delete file).
    deletes: HashMap<String, Option<String>>,
    keys: HashMap<Box<[u8]>, Locs>,
    bytes: usize,
}

impl KeyIndex {
    pub(crate) fn new(table: String, key: KeyColumns, max_bytes: usize) -> Self {
        Self {
            table,
            key,
            max_bytes,
            base: None,
            files: Vec::new(),
            file_ids: HashMap::new(),
            deletes: HashMap::new(),
            keys: HashMap::new(),
            bytes: 0,
        }
    }

    /// The snapshot the index describes (`None`: not built yet).
    #[cfg(test)]
    pub(crate) fn base(&self) -> Option<Option<i64>> {
        self.base
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    fn reset(&mut self) {
        let (table, key, max) = (std::mem::take(&mut self.table), self.key.clone(), self.max_bytes);
        *self = Self::new(table, key, max);
    }

    fn file_id(&mut self, meta: FileMeta) -> u32 {
        if let Some(id) = self.file_ids.get(&meta.path) {
            return *id;
        }
        let id = self.files.len() as u32;
        self.file_ids.insert(meta.path.clone(), id);
        self.files.push(Some(meta));
        id
    }

    fn insert(&mut self, key: Box<[u8]>, at: (u32, u64)) -> Result<(), SinkError> {
        match self.keys.get_mut(&key) {
            Some(locs) => locs.push(at),
            None => {
                self.bytes += key.len() + BYTES_PER_KEY;
                self.keys.insert(key, Locs::One(at.0, at.1));
            }
        }
        if self.bytes > self.max_bytes {
            return Err(error::config(format!(
                "table {}: the upsert key index holds {} keys, about {} MiB, past [sink.options] key_index_max_mb = \
                 {}; raise key_index_max_mb (about {} bytes per key plus the key's own bytes); nothing of the pending \
                 checkpoint was committed",
                self.table,
                self.keys.len(),
                self.bytes >> 20,
                self.max_bytes >> 20,
                BYTES_PER_KEY
            )));
        }
        Ok(())
    }

    /// Drops every location `gone` accepts.
    fn drop_where(&mut self, gone: impl Fn(&(u32, u64)) -> bool) {
        let mut freed = 0;
        self.keys.retain(|key, locs| {
            let kept = locs.retain(|at| !gone(at));
            if !kept {
                freed += key.len() + BYTES_PER_KEY;
            }
            kept
        });
        self.bytes -= freed;
    }

    /// The rows of `key`: each data file and position.
    pub(crate) fn rows_of(&self, key: &[u8]) -> Vec<(&FileMeta, u64)> {
        let Some(locs) = self.keys.get(key) else { return Vec::new() };
        locs.iter().filter_map(|(f, p)| self.files.get(f as usize).and_then(Option::as_ref).map(|m| (m, p))).collect()
    }

    /// Reads the keys of data file `file` (of spec `spec_id`) into the index.
    fn read_data_file(&mut self, table: &Table, spec_id: i32, file: &DataFile) -> Result<(), SinkError> {
        let metadata = table.metadata();
        let spec = metadata.partition_spec_by_id(spec_id).cloned();
        let id =
            self.file_id(FileMeta { path: file.file_path().to_string(), spec_id, partition: file.partition().clone() });
        let mut pos = 0u64;
        let ids = self.key.ids.clone();
        let names = self.key.names.clone();
        let columns: Vec<usize> = (0..ids.len()).collect();
        let path = file.file_path().to_string();
        let mut found = Vec::new();
        position_deletes::read_columns(table.file_io(), file, metadata.current_schema().clone(), ids, spec, |batch| {
            let keys = keys::encode(&batch, &columns, &names)
                .map_err(|m| error::fatal(format!("reading the keys of data file {path}: {m}")))?;
            for key in keys {
                found.push((key.into_boxed_slice(), pos));
                pos += 1;
            }
            Ok(())
        })?;
        if pos != file.record_count() {
            return Err(error::fatal(format!(
                "table {}: data file {path} holds {} rows, and {pos} were read back for the key index",
                self.table,
                file.record_count()
            )));
        }
        for (key, p) in found {
            self.insert(key, (id, p))?;
        }
        Ok(())
    }

    /// Makes the index describe `head` of `table`, whose manifests are
    /// `manifests`. On an error the index is emptied (read anew next time):
    /// half advanced, it would describe no snapshot.
    pub(crate) fn advance(
        &mut self,
        table: &Table,
        head: Option<i64>,
        manifests: &[LoadedManifest],
    ) -> Result<(), SinkError> {
        let result = self.advance_to(table, head, manifests);
        if result.is_err() {
            self.reset();
        }
        result
    }

    fn advance_to(&mut self, table: &Table, head: Option<i64>, manifests: &[LoadedManifest]) -> Result<(), SinkError> {
        if self.base == Some(head) {
            return Ok(());
        }
        let mut data: Vec<(i32, &DataFile)> = Vec::new();
        let mut deletes: Vec<&DataFile> = Vec::new();
        for m in manifests {
            for entry in m.entries.iter().filter(|e| e.is_alive()) {
                let file = entry.data_file();
                match file.content_type() {
                    DataContentType::Data => data.push((m.file.partition_spec_id, file)),
                    DataContentType::PositionDeletes => deletes.push(file),
                    DataContentType::EqualityDeletes => {
                        return Err(error::config(format!(
                            "table {} holds equality delete file {}, written by another writer; mode = \"upsert\" \
                             keeps a key index of row positions and cannot place the rows it deletes",
                            self.table,
                            file.file_path()
                        )));
                    }
                }
            }
        }
        let live_deletes: HashSet<&str> = deletes.iter().map(|d| d.file_path()).collect();
        let live_data_files: HashSet<&str> = data.iter().map(|(_, f)| f.file_path()).collect();
        // Data files a deletion vector not read yet applies to.
        let new_vectors: HashSet<String> = deletes
            .iter()
            .filter(|d| !self.deletes.contains_key(d.file_path()) && crate::deletion_vectors::is_vector(d))
            .filter_map(|d| d.referenced_data_file())
            .collect();
        let replaced = |vector_of: &Option<String>| {
            vector_of.as_ref().is_some_and(|f| !live_data_files.contains(f.as_str()) || new_vectors.contains(f))
        };
        let rebuild = self.base.is_none()
            || self.deletes.iter().any(|(d, vector_of)| !live_deletes.contains(d.as_str()) && !replaced(vector_of));
        if rebuild {
            if self.base.is_some() {
                note(&format!(
                    "table {}: a delete file went since the key index was read; reading it anew",
                    self.table
                ));
            }
            self.reset();
        }
        let live_data: HashSet<&str> = data.iter().map(|(_, f)| f.file_path()).collect();
        let gone: HashSet<u32> =
            self.file_ids.iter().filter(|(path, _)| !live_data.contains(path.as_str())).map(|(_, id)| *id).collect();
        if !gone.is_empty() {
            self.drop_where(|(f, _)| gone.contains(f));
            for id in &gone {
                if let Some(meta) = self.files.get_mut(*id as usize).and_then(Option::take) {
                    self.file_ids.remove(&meta.path);
                }
            }
        }
        let mut read = 0usize;
        for (spec_id, file) in data {
            if !self.file_ids.contains_key(file.file_path()) {
                self.read_data_file(table, spec_id, file)?;
                read += 1;
            }
        }
        let mut dropped: HashSet<(u32, u64)> = HashSet::new();
        for file in deletes.iter().filter(|d| !self.deletes.contains_key(d.file_path())) {
            for (path, pos) in position_deletes::read(table.file_io(), file)? {
                if let Some(id) = self.file_ids.get(&path) {
                    dropped.insert((*id, pos));
                }
            }
        }
        if !dropped.is_empty() {
            self.drop_where(|at| dropped.contains(at));
        }
        self.deletes = deletes
            .iter()
            .map(|d| {
                let vector_of = crate::deletion_vectors::is_vector(d).then(|| d.referenced_data_file()).flatten();
                (d.file_path().to_string(), vector_of)
            })
            .collect();
        self.base = Some(head);
        if rebuild || read > 0 {
            note(&format!(
                "table {}: the upsert key index describes snapshot {} ({} keys, about {} MiB; {read} data file(s) read)",
                self.table,
                head.map_or_else(|| "none".to_string(), |h| h.to_string()),
                self.keys.len(),
                self.bytes >> 20
            ));
        }
        Ok(())
    }

    /// After the commit of `snapshot` on the index's base: its data files
    /// `added` (with their spec), its delete files `deletes`, the deletion
    /// vectors it removed (`replaced`, each merged into one it added), and
    /// the key changes `merged` whose earlier rows those delete files delete.
    pub(crate) fn committed(
        &mut self,
        snapshot: i64,
        added: &[(i32, DataFile)],
        replaced: &[String],
        merged: &Merged,
    ) -> Result<(), SinkError> {
        for path in replaced {
            self.deletes.remove(path);
        }
        for (spec_id, file) in added {
            match file.content_type() {
                DataContentType::Data => {
                    self.file_id(FileMeta {
                        path: file.file_path().to_string(),
                        spec_id: *spec_id,
                        partition: file.partition().clone(),
                    });
                }
                _ => {
                    let vector_of =
                        crate::deletion_vectors::is_vector(file).then(|| file.referenced_data_file()).flatten();
                    self.deletes.insert(file.file_path().to_string(), vector_of);
                }
            }
        }
        for (key, (_, end)) in &merged.finals {
            if self.keys.remove(key).is_some() {
                self.bytes -= key.len() + BYTES_PER_KEY;
            }
            if let Final::Row(path, pos) = end {
                let id = self.file_ids.get(path).copied().ok_or_else(|| {
                    error::fatal(format!(
                        "table {}: the row of a changed key is in {path}, not a file of the commit",
                        self.table
                    ))
                })?;
                self.insert(key.clone(), (id, *pos))?;
            }
        }
        self.base = Some(Some(snapshot));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The index read from real Parquet data and position-delete files in
    //! an in-memory FileIO, committed to in-memory table metadata through
    //! [`crate::snapshot::build_snapshot`] as the committer commits.

    use std::collections::HashMap;
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use iceberg::TableIdent;
    use iceberg::io::FileIO;
    use iceberg::spec::{
        DataFileBuilder, DataFileFormat, NestedField, Operation, PrimitiveType, Schema, SortOrder, Summary,
        TableMetadata, TableMetadataBuilder, Type, UnboundPartitionSpec,
    };

    use super::*;
    use crate::runtime::iceberg_runtime;
    use crate::snapshot::{build_snapshot, manifests_of};

    fn schema() -> Schema {
        Schema::builder()
            .with_fields(vec![
                NestedField::required(1, "id", Type::Primitive(PrimitiveType::Long)).into(),
                NestedField::optional(2, "v", Type::Primitive(PrimitiveType::String)).into(),
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

    fn empty_table() -> Table {
        table_of_version(iceberg::spec::FormatVersion::V2)
    }

    fn table_of_version(version: iceberg::spec::FormatVersion) -> Table {
        let metadata = TableMetadataBuilder::new(
            schema(),
            UnboundPartitionSpec::builder().build(),
            SortOrder::unsorted_order(),
            "memory://wh/t".to_string(),
            version,
            HashMap::new(),
        )
        .unwrap()
        .build()
        .unwrap()
        .metadata;
        table_of(metadata, FileIO::new_with_memory())
    }

    /// Writes `batch` (in `schema`, with field ids) as Parquet at `path`.
    fn parquet(table: &Table, path: &str, schema: &Schema, columns: Vec<ArrayRef>) -> (u64, u64) {
        let arrow = Arc::new(iceberg::arrow::schema_to_arrow_schema(schema).unwrap());
        let batch = RecordBatch::try_new(arrow.clone(), columns).unwrap();
        let mut bytes = Vec::new();
        let mut w = parquet::arrow::ArrowWriter::try_new(&mut bytes, arrow, None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
        let size = bytes.len() as u64;
        crate::runtime::block_on(table.file_io().new_output(path).unwrap().write(bytes.into())).unwrap();
        (batch.num_rows() as u64, size)
    }

    fn data_file(table: &Table, name: &str, ids: &[i64]) -> DataFile {
        let path = format!("{}/data/{name}.parquet", table.metadata().location());
        let v: Vec<String> = ids.iter().map(|i| format!("{name}{i}")).collect();
        let (rows, size) = parquet(
            table,
            &path,
            &schema(),
            vec![Arc::new(Int64Array::from(ids.to_vec())), Arc::new(StringArray::from(v))],
        );
        DataFileBuilder::default()
            .content(DataContentType::Data)
            .file_path(path)
            .file_format(DataFileFormat::Parquet)
            .partition(Struct::empty())
            .partition_spec_id(0)
            .record_count(rows)
            .file_size_in_bytes(size)
            .build()
            .unwrap()
    }

    fn delete_file(table: &Table, name: &str, rows: &[(&str, i64)]) -> DataFile {
        let path = format!("memory://wh/t/data/{name}.parquet");
        let paths: Vec<String> = rows.iter().map(|(f, _)| format!("memory://wh/t/data/{f}.parquet")).collect();
        let pos: Vec<i64> = rows.iter().map(|(_, p)| *p).collect();
        let (n, size) = parquet(
            table,
            &path,
            &position_deletes::schema().unwrap(),
            vec![Arc::new(StringArray::from(paths)), Arc::new(Int64Array::from(pos))],
        );
        DataFileBuilder::default()
            .content(DataContentType::PositionDeletes)
            .file_path(path)
            .file_format(DataFileFormat::Parquet)
            .partition(Struct::empty())
            .partition_spec_id(0)
            .record_count(n)
            .file_size_in_bytes(size)
            .build()
            .unwrap()
    }

    /// Commits a snapshot adding `added` and removing `gone`, as a catalog
    /// applies it.
    fn commit(table: &Table, gone: &[&str], added: Vec<DataFile>) -> Table {
        let head = table.metadata().current_snapshot().cloned();
        let manifests = head.as_ref().map(|h| manifests_of(table, h).unwrap()).unwrap_or_default();
        let gone: std::collections::HashSet<&str> = gone.iter().copied().collect();
        let added: Vec<(i32, DataFile)> = added.into_iter().map(|f| (0, f)).collect();
        let op = if gone.is_empty() { Operation::Append } else { Operation::Overwrite };
        let summary = Summary { operation: op, additional_properties: HashMap::new() };
        let built = build_snapshot(table, head.as_deref(), &manifests, &gone, &added, summary, HashMap::new()).unwrap();
        let mut builder = table.metadata().clone().into_builder(table.metadata_location().map(str::to_string));
        for update in built.updates {
            builder = update.apply(builder).unwrap();
        }
        table_of(builder.build().unwrap().metadata, table.file_io().clone())
    }

    fn advance(index: &mut KeyIndex, table: &Table) {
        let head = table.metadata().current_snapshot().cloned();
        let manifests = head.as_ref().map(|h| manifests_of(table, h).unwrap()).unwrap_or_default();
        index.advance(table, head.map(|h| h.snapshot_id()), &manifests).unwrap();
    }

    fn key(id: i64) -> Vec<u8> {
        id.to_be_bytes().to_vec()
    }

    /// Each key's rows as (file name, position), sorted.
    fn rows(index: &KeyIndex, id: i64) -> Vec<(String, u64)> {
        let mut out: Vec<(String, u64)> = index
            .rows_of(&key(id))
            .into_iter()
            .map(|(m, p)| (m.path.rsplit('/').next().unwrap().trim_end_matches(".parquet").to_string(), p))
            .collect();
        out.sort();
        out
    }

    fn index() -> KeyIndex {
        let cols = crate::keys::key_columns("ns.t", &schema(), &["id".to_string()]).unwrap();
        KeyIndex::new("ns.t".into(), cols, 1 << 30)
    }

    #[test]
    fn the_index_follows_the_live_data_and_delete_files() {
        let t0 = empty_table();
        let mut idx = index();
        advance(&mut idx, &t0);
        assert_eq!((idx.base(), idx.len()), (Some(None), 0));
        // Another writer appends a, with key 2 twice.
        let t1 = commit(&t0, &[], vec![data_file(&t0, "a", &[1, 2, 3, 2])]);
        advance(&mut idx, &t1);
        assert_eq!(rows(&idx, 2), [("a".into(), 1), ("a".into(), 3)]);
        assert_eq!(idx.len(), 3);
        // Position deletes (another writer's): key 2's row 1 and key 3 go.
        let t2 = commit(&t1, &[], vec![delete_file(&t1, "d1", &[("a", 1), ("a", 2)]), data_file(&t1, "b", &[4])]);
        advance(&mut idx, &t2);
        assert_eq!(rows(&idx, 2), [("a".into(), 3)]);
        assert!(rows(&idx, 3).is_empty());
        assert_eq!(rows(&idx, 4), [("b".into(), 0)]);
        // A fresh index built from the same snapshot agrees.
        let mut fresh = index();
        advance(&mut fresh, &t2);
        for id in 0..6 {
            assert_eq!(rows(&fresh, id), rows(&idx, id), "key {id}");
        }
        // A compaction applied the deletes: a and d1 go, c holds 1 and 2.
        let t3 = commit(
            &t2,
            &["memory://wh/t/data/a.parquet", "memory://wh/t/data/d1.parquet"],
            vec![data_file(&t2, "c", &[1, 2])],
        );
        advance(&mut idx, &t3);
        assert_eq!(rows(&idx, 1), [("c".into(), 0)]);
        assert_eq!(rows(&idx, 2), [("c".into(), 1)]);
        assert_eq!(rows(&idx, 4), [("b".into(), 0)]);
        assert_eq!(idx.len(), 3);
        // A data file removed outright drops its keys.
        let t4 = commit(&t3, &["memory://wh/t/data/b.parquet"], vec![]);
        advance(&mut idx, &t4);
        assert!(rows(&idx, 4).is_empty());
        assert_eq!(idx.base(), Some(t4.metadata().current_snapshot_id()));
    }

    /// What a commit of the index's own changes leaves equals what reading
    /// that snapshot from the table gives.
    #[test]
    fn a_commit_updates_the_index_as_reading_the_table_would() {
        let t0 = empty_table();
        let t1 = commit(&t0, &[], vec![data_file(&t0, "a", &[1, 2, 3])]);
        let mut idx = index();
        advance(&mut idx, &t1);
        // Checkpoint: key 1 updated (new row n:0), key 2 deleted, key 5 inserted at n:2 after n:1 was superseded.
        let mut log = crate::upsert::WriterLog::default();
        log.rows("memory://wh/t/data/n.parquet", 0, [(key(1), (0, 1)), (key(5), (0, 2)), (key(5), (0, 4))]);
        log.delete(key(2), (0, 3));
        let merged = crate::upsert::merge(&[log.take().unwrap()]).unwrap();
        let mut dels: Vec<(&str, i64)> = Vec::new();
        for k in merged.finals.keys() {
            for (m, p) in idx.rows_of(k) {
                dels.push((if m.path.ends_with("a.parquet") { "a" } else { "?" }, p as i64));
            }
        }
        for (_, p) in &merged.superseded {
            dels.push(("n", *p as i64));
        }
        dels.sort();
        assert_eq!(dels, [("a", 0), ("a", 1), ("n", 1)]);
        let n = data_file(&t1, "n", &[1, 5, 5]);
        let d = delete_file(&t1, "d", &dels);
        let t2 = commit(&t1, &[], vec![n.clone(), d.clone()]);
        let snapshot = t2.metadata().current_snapshot_id().unwrap();
        idx.committed(snapshot, &[(0, n), (0, d)], &[], &merged).unwrap();
        let mut fresh = index();
        advance(&mut fresh, &t2);
        for id in 0..7 {
            assert_eq!(rows(&fresh, id), rows(&idx, id), "key {id}");
        }
        assert_eq!(rows(&idx, 1), [("n".into(), 0)]);
        assert!(rows(&idx, 2).is_empty());
        assert_eq!(rows(&idx, 5), [("n".into(), 2)]);
        // Advancing to the snapshot it already describes reads nothing.
        advance(&mut idx, &t2);
        assert_eq!(idx.len(), 3);
    }

    #[test]
    fn an_index_past_its_bound_is_refused_naming_the_option() {
        let t0 = empty_table();
        let t1 = commit(&t0, &[], vec![data_file(&t0, "a", &(0..100).collect::<Vec<_>>())]);
        let cols = crate::keys::key_columns("ns.t", &schema(), &["id".to_string()]).unwrap();
        let mut idx = KeyIndex::new("ns.t".into(), cols, 50 * BYTES_PER_KEY);
        let head = t1.metadata().current_snapshot().cloned().unwrap();
        let e = idx.advance(&t1, Some(head.snapshot_id()), &manifests_of(&t1, &head).unwrap()).unwrap_err();
        assert!(format!("{e:?}").contains("key_index_max_mb") && format!("{e:?}").contains("ns.t"), "{e:?}");
        assert_eq!(idx.base(), None);
    }

    /// Upsert takes format-version-2 tables (position-delete files) and 3
    /// (deletion vectors); v1 has no delete files and is refused by name.
    #[test]
    fn upsert_refuses_tables_of_format_version_1() {
        use iceberg::spec::FormatVersion;
        assert!(crate::committer::check_upsert_table(&table_of_version(FormatVersion::V2)).is_ok());
        assert!(crate::committer::check_upsert_table(&table_of_version(FormatVersion::V3)).is_ok());
        let Err(SinkError::Config(m)) = crate::committer::check_upsert_table(&table_of_version(FormatVersion::V1))
        else {
            panic!("v1 is refused")
        };
        assert!(m.contains("ns.t") && m.contains("no delete files") && m.contains("mode = \"upsert\""), "{m}");
    }

    /// Plans and writes the deletion vectors of `dels` (data file name,
    /// position) on `table`'s head as the committer does, and commits them
    /// with `added`; gives the new table, the vectors added and replaced.
    fn commit_vectors(
        table: &Table,
        dels: &[(&str, u64)],
        added: Vec<DataFile>,
    ) -> (Table, Vec<DataFile>, Vec<String>) {
        let head = table.metadata().current_snapshot().cloned();
        let manifests = head.as_ref().map(|h| manifests_of(table, h).unwrap()).unwrap_or_default();
        let mut positions: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        for (f, p) in dels {
            positions.entry(format!("{}/data/{f}.parquet", table.metadata().location())).or_default().push(*p);
        }
        let group = position_deletes::Group { spec_id: 0, partition: Struct::empty(), positions };
        let (vectors, replaced) = crate::deletion_vectors::plan(table, &manifests, vec![group]).unwrap();
        let folder = format!("{}/data/sluice-deletes/i/c1/", table.metadata().location());
        let written = crate::deletion_vectors::write(table, &folder, vectors).unwrap();
        let gone: Vec<&str> = replaced.iter().map(String::as_str).collect();
        let mut files = added;
        files.extend(written.iter().map(|(_, f)| f.clone()));
        let next = commit(table, &gone, files);
        (next, written.into_iter().map(|(_, f)| f).collect(), replaced)
    }

    /// On a format-version-3 table deletes are deletion vectors, at most
    /// one live per data file: a second delete of a data file merges the
    /// first vector's positions and removes it; the index follows them
    /// (another writer's, without a rebuild, and its own) and agrees with a
    /// fresh read.
    #[test]
    fn on_v3_deletion_vectors_merge_and_the_index_follows_them() {
        let t0 = table_of_version(iceberg::spec::FormatVersion::V3);
        let t1 = commit(&t0, &[], vec![data_file(&t0, "a", &[1, 2, 3, 4]), data_file(&t0, "b", &[5, 6])]);
        let mut idx = index();
        advance(&mut idx, &t1);
        assert_eq!(idx.len(), 6);
        // Another writer's vector: key 2 (a:1) goes.
        let (t2, first, replaced) = commit_vectors(&t1, &[("a", 1)], vec![]);
        assert!(replaced.is_empty());
        let [dv] = &first[..] else { panic!("one vector: {first:?}") };
        assert_eq!(dv.file_format(), DataFileFormat::Puffin);
        assert_eq!(dv.content_type(), DataContentType::PositionDeletes);
        assert_eq!(dv.referenced_data_file().as_deref(), Some("memory://wh/t/data/a.parquet"));
        assert_eq!((dv.record_count(), dv.content_offset()), (1, Some(4)));
        advance(&mut idx, &t2);
        assert!(rows(&idx, 2).is_empty());
        // A second vector of a: merged with the first (a:1 and a:3), which goes; b gets its own.
        let (t3, second, replaced) = commit_vectors(&t2, &[("a", 3), ("b", 0)], vec![]);
        assert_eq!(replaced, vec![dv.file_path().to_string()]);
        let of_a = second.iter().find(|f| f.referenced_data_file().as_deref() == Some("memory://wh/t/data/a.parquet"));
        let (_, positions) = crate::deletion_vectors::read(t3.file_io(), of_a.unwrap()).unwrap();
        assert_eq!(positions.iter().collect::<Vec<_>>(), [1, 3]);
        let live: Vec<DataFile> = {
            let head = t3.metadata().current_snapshot().cloned().unwrap();
            manifests_of(&t3, &head)
                .unwrap()
                .iter()
                .flat_map(|m| m.entries.iter().filter(|e| e.is_alive()).map(|e| e.data_file().clone()))
                .filter(|f| f.content_type() == DataContentType::PositionDeletes)
                .collect()
        };
        assert_eq!(live.len(), 2, "one live vector per data file: {live:?}");
        // The replaced vector goes and a new one names its data file: no rebuild, the same as a fresh read.
        advance(&mut idx, &t3);
        let mut fresh = index();
        advance(&mut fresh, &t3);
        for id in 0..8 {
            assert_eq!(rows(&fresh, id), rows(&idx, id), "key {id}");
        }
        assert_eq!(idx.len(), 3);
        assert!(rows(&idx, 4).is_empty() && rows(&idx, 5).is_empty());
        // The index's own commit: key 1 (a:0) replaced by n:0, merged into a's vector.
        let mut log = crate::upsert::WriterLog::default();
        log.rows("memory://wh/t/data/n.parquet", 0, [(key(1), (0, 1))]);
        let merged = crate::upsert::merge(&[log.take().unwrap()]).unwrap();
        let dels: Vec<(&str, u64)> = idx.rows_of(&key(1)).iter().map(|(_, p)| ("a", *p)).collect();
        assert_eq!(dels, [("a", 0)]);
        let n = data_file(&t3, "n", &[1]);
        let (t4, third, replaced) = commit_vectors(&t3, &dels, vec![n.clone()]);
        assert_eq!(replaced.len(), 1);
        let snapshot = t4.metadata().current_snapshot_id().unwrap();
        let mut added = vec![(0, n)];
        added.extend(third.into_iter().map(|f| (0, f)));
        idx.committed(snapshot, &added, &replaced, &merged).unwrap();
        let mut fresh = index();
        advance(&mut fresh, &t4);
        for id in 0..8 {
            assert_eq!(rows(&fresh, id), rows(&idx, id), "key {id}");
        }
        assert_eq!(rows(&idx, 1), [("n".into(), 0)]);
        // Its own replaced vector is forgotten: advancing to the same snapshot reads nothing anew.
        advance(&mut idx, &t4);
        assert_eq!(idx.len(), 3);
    }
}
