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
//! - equality delete files are refused (their rows cannot be placed);
//! - memory is bounded by `key_index_max_mb`: the estimate
//!   ([`BYTES_PER_KEY`] plus the key's bytes per key) past it is a `config`
//!   error naming the option and the table, before anything is committed.

use std::collections::{HashMap, HashSet};

use iceberg::spec::{DataContentType, DataFile, Struct};
use iceberg::table::Table;
use sluice_guest_sdk::{SinkError, error, log};

use crate::keys::{self, KeyColumns};
use crate::position_deletes;
use crate::snapshot::LoadedManifest;
use crate::upsert::{Final, Merged};

/// What one key costs beyond its bytes (hash-table slot with its control
/// byte at the table's load factor, the boxed key's pointer and length, the
/// location, and the allocation's rounding), estimated for 64-bit; the guest
/// is 32-bit, where it is less.
pub(crate) const BYTES_PER_KEY: usize = 72;

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

pub(crate) struct KeyIndex {
    table: String,
    key: KeyColumns,
    max_bytes: usize,
    /// The snapshot described (`Some(None)`: the table had none); `None`
    /// until built.
    base: Option<Option<i64>>,
    files: Vec<Option<FileMeta>>,
    file_ids: HashMap<String, u32>,
    deletes: HashSet<String>,
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
            deletes: HashSet::new(),
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
        let rebuild = self.base.is_none() || self.deletes.iter().any(|d| !live_deletes.contains(d.as_str()));
        if rebuild {
            if self.base.is_some() {
                log::info(&format!(
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
        for file in deletes.iter().filter(|d| !self.deletes.contains(d.file_path())) {
            for (path, pos) in position_deletes::read(table.file_io(), file)? {
                if let Some(id) = self.file_ids.get(&path) {
                    dropped.insert((*id, pos));
                }
            }
        }
        if !dropped.is_empty() {
            self.drop_where(|at| dropped.contains(at));
        }
        self.deletes = live_deletes.into_iter().map(str::to_string).collect();
        self.base = Some(head);
        if rebuild || read > 0 {
            log::info(&format!(
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
    /// `added` (with their spec), its delete files `deletes`, and the key
    /// changes `merged` whose earlier rows those delete files delete.
    pub(crate) fn committed(
        &mut self,
        snapshot: i64,
        added: &[(i32, DataFile)],
        merged: &Merged,
    ) -> Result<(), SinkError> {
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
                    self.deletes.insert(file.file_path().to_string());
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
