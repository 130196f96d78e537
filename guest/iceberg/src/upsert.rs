//! `mode = "upsert"`: what a writer tells the committer about the keys a
//! checkpoint changed.
//!
//! Invariants:
//! - a writer remembers, for every change-stream row it was given, the
//!   row's canonical key ([`crate::keys`]), its source position `(hi, lo)`
//!   and, for an upsert, the data file and row position the row was written
//!   at (read from the file writer after the write, never guessed);
//! - at `prepare-commit` the log collapses per key to the change with the
//!   highest position; every other row of the key this writer wrote in the
//!   checkpoint is *superseded*, and becomes a position delete against the
//!   writer's own new file;
//! - the collapsed changes travel in the commit info (one base64 blob per
//!   writer and table, [`encode`]), so they are exactly as durable as the
//!   data files the checkpoint names, and a recovered commit sees the same
//!   changes; when two writers' blobs change one key, the higher position
//!   wins and the loser's row is superseded too ([`merge`]).

use std::collections::HashMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

/// Where a checkpoint's position-delete files are written, below the
/// table's `data/` folder: `sluice-deletes/<incarnation key>/c<c>/`. Orphan
/// cleanup never removes a file under the folder of a pending checkpoint.
pub(crate) const DELETES_DIR: &str = "sluice-deletes";

/// The folder (relative to the table's `data/`) of checkpoint `c`'s delete files.
pub(crate) fn deletes_folder(incarnation_key: &str, c: u64) -> String {
    format!("{DELETES_DIR}/{incarnation_key}/c{c}/")
}

/// A source position `(hi, lo)`.
pub(crate) type Seq = (u64, u64);

/// One change as a writer logged it.
#[derive(Debug, Clone)]
struct Logged {
    key: Box<[u8]>,
    seq: Seq,
    /// The data file (index into [`WriterLog::files`]) and row position of
    /// an upsert; `None` for a delete.
    at: Option<(u32, u64)>,
}

/// The changes one writer was given for one table since its last prepare.
#[derive(Debug, Default)]
pub(crate) struct WriterLog {
    files: Vec<String>,
    file_ids: HashMap<String, u32>,
    changes: Vec<Logged>,
}

impl WriterLog {
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    pub(crate) fn delete(&mut self, key: Vec<u8>, seq: Seq) {
        self.changes.push(Logged { key: key.into_boxed_slice(), seq, at: None });
    }

    /// Rows written to `path` at positions `first`, `first + 1`, ...
    pub(crate) fn rows(&mut self, path: &str, first: u64, rows: impl IntoIterator<Item = (Vec<u8>, Seq)>) {
        let id = match self.file_ids.get(path) {
            Some(id) => *id,
            None => {
                let id = self.files.len() as u32;
                self.files.push(path.to_string());
                self.file_ids.insert(path.to_string(), id);
                id
            }
        };
        for (i, (key, seq)) in rows.into_iter().enumerate() {
            self.changes.push(Logged { key: key.into_boxed_slice(), seq, at: Some((id, first + i as u64)) });
        }
    }

    /// The files rows were logged at (to check them against the closed files).
    pub(crate) fn files(&self) -> &[String] {
        &self.files
    }

    /// The most rows logged at each file (its highest position + 1).
    pub(crate) fn rows_per_file(&self) -> Vec<u64> {
        let mut most = vec![0u64; self.files.len()];
        for (file, pos) in self.changes.iter().filter_map(|c| c.at) {
            let m = &mut most[file as usize];
            *m = (*m).max(pos + 1);
        }
        most
    }

    /// Collapses the log per key and encodes it ([`encode`]); empties the log.
    pub(crate) fn take(&mut self) -> Option<String> {
        if self.changes.is_empty() {
            return None;
        }
        let log = std::mem::take(self);
        let mut last: HashMap<&[u8], usize> = HashMap::with_capacity(log.changes.len());
        let mut superseded = Vec::new();
        for (i, change) in log.changes.iter().enumerate() {
            if let Some(before) = last.insert(&change.key, i) {
                let (older, newer) = if log.changes[before].seq <= change.seq { (before, i) } else { (i, before) };
                last.insert(&change.key, newer);
                if let Some(at) = log.changes[older].at {
                    superseded.push(at);
                }
            }
        }
        let mut finals: Vec<usize> = last.into_values().collect();
        finals.sort_unstable();
        let mut out = Blob::new(&log.files);
        for i in finals {
            let c = &log.changes[i];
            out.change(&c.key, c.seq, c.at);
        }
        for at in superseded {
            out.superseded(at);
        }
        Some(out.finish())
    }
}

/// The blob: version byte 1; `u32` file count, each `u32` length + UTF-8
/// path; then records until the end: kind `0` row / `1` delete (`u32` key
/// length, key, `u64` hi, `u64` lo, and for a row `u32` file, `u64` pos) or
/// `2` superseded (`u32` file, `u64` pos). All big-endian.
struct Blob(Vec<u8>);

impl Blob {
    fn new(files: &[String]) -> Self {
        let mut b = vec![1u8];
        b.extend_from_slice(&(files.len() as u32).to_be_bytes());
        for f in files {
            b.extend_from_slice(&(f.len() as u32).to_be_bytes());
            b.extend_from_slice(f.as_bytes());
        }
        Self(b)
    }

    fn change(&mut self, key: &[u8], seq: Seq, at: Option<(u32, u64)>) {
        self.0.push(if at.is_some() { 0 } else { 1 });
        self.0.extend_from_slice(&(key.len() as u32).to_be_bytes());
        self.0.extend_from_slice(key);
        self.0.extend_from_slice(&seq.0.to_be_bytes());
        self.0.extend_from_slice(&seq.1.to_be_bytes());
        if let Some((file, pos)) = at {
            self.0.extend_from_slice(&file.to_be_bytes());
            self.0.extend_from_slice(&pos.to_be_bytes());
        }
    }

    fn superseded(&mut self, (file, pos): (u32, u64)) {
        self.0.push(2);
        self.0.extend_from_slice(&file.to_be_bytes());
        self.0.extend_from_slice(&pos.to_be_bytes());
    }

    fn finish(self) -> String {
        STANDARD.encode(self.0)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("it ends early".to_string());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
}

/// What a key ends as after a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Final {
    /// Its row is at this data file and position.
    Row(String, u64),
    Deleted,
}

/// Every writer's changes of one table in one checkpoint, merged.
#[derive(Debug, Default)]
pub(crate) struct Merged {
    pub(crate) finals: HashMap<Box<[u8]>, (Seq, Final)>,
    /// Rows the checkpoint wrote and a later change of their key replaced.
    pub(crate) superseded: Vec<(String, u64)>,
}

/// Decodes and merges the blobs of one table; the higher position wins a
/// key two writers changed.
pub(crate) fn merge(blobs: &[String]) -> Result<Merged, String> {
    let mut merged = Merged::default();
    for text in blobs {
        let bytes = STANDARD.decode(text).map_err(|e| format!("the key changes are not base64: {e}"))?;
        let mut r = Reader(&bytes);
        if r.take(1)? != [1] {
            return Err("the key changes are of an unknown version".to_string());
        }
        let n = r.u32()? as usize;
        let mut files = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let len = r.u32()? as usize;
            files.push(String::from_utf8(r.take(len)?.to_vec()).map_err(|e| e.to_string())?);
        }
        let file = |i: u32| files.get(i as usize).cloned().ok_or_else(|| format!("file {i} is not named"));
        while !r.0.is_empty() {
            let kind = r.take(1)?[0];
            if kind == 2 {
                let (f, pos) = (r.u32()?, r.u64()?);
                merged.superseded.push((file(f)?, pos));
                continue;
            }
            let len = r.u32()? as usize;
            let key: Box<[u8]> = r.take(len)?.into();
            let seq = (r.u64()?, r.u64()?);
            let end = match kind {
                0 => {
                    let (f, pos) = (r.u32()?, r.u64()?);
                    Final::Row(file(f)?, pos)
                }
                1 => Final::Deleted,
                k => return Err(format!("unknown record kind {k}")),
            };
            match merged.finals.get_mut(&key) {
                Some(held) if held.0 >= seq => {
                    if let Final::Row(f, p) = end {
                        merged.superseded.push((f, p));
                    }
                }
                Some(held) => {
                    let old = std::mem::replace(held, (seq, end));
                    if let Final::Row(f, p) = old.1 {
                        merged.superseded.push((f, p));
                    }
                }
                None => {
                    merged.finals.insert(key, (seq, end));
                }
            }
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: u8) -> Vec<u8> {
        vec![k]
    }

    /// The same key several times in one checkpoint collapses to its last
    /// change; its earlier rows are superseded.
    #[test]
    fn a_writers_log_collapses_per_key_to_the_last_change() {
        let mut log = WriterLog::default();
        log.rows("f1", 0, [(key(1), (0, 1)), (key(2), (0, 2)), (key(1), (0, 3))]);
        log.delete(key(2), (0, 4));
        log.rows("f2", 0, [(key(2), (1, 1))]);
        log.delete(key(3), (1, 2));
        assert_eq!(log.rows_per_file(), vec![3, 1]);
        let blob = log.take().unwrap();
        assert!(log.is_empty() && log.take().is_none());
        let m = merge(&[blob]).unwrap();
        assert_eq!(m.finals[&key(1)[..]], ((0, 3), Final::Row("f1".into(), 2)));
        assert_eq!(m.finals[&key(2)[..]], ((1, 1), Final::Row("f2".into(), 0)));
        assert_eq!(m.finals[&key(3)[..]], ((1, 2), Final::Deleted));
        let mut s = m.superseded.clone();
        s.sort();
        assert_eq!(s, vec![("f1".to_string(), 0), ("f1".to_string(), 1)]);
    }

    /// Two writers changed one key: the higher position wins, and the
    /// loser's row is superseded.
    #[test]
    fn across_writers_the_higher_position_wins() {
        let mut a = WriterLog::default();
        a.rows("a", 0, [(key(1), (0, 5))]);
        let mut b = WriterLog::default();
        b.rows("b", 0, [(key(1), (0, 9))]);
        b.delete(key(2), (0, 1));
        let mut c = WriterLog::default();
        c.rows("c", 0, [(key(2), (0, 0))]);
        let m = merge(&[a.take().unwrap(), b.take().unwrap(), c.take().unwrap()]).unwrap();
        assert_eq!(m.finals[&key(1)[..]].1, Final::Row("b".into(), 0));
        assert_eq!(m.finals[&key(2)[..]].1, Final::Deleted);
        let mut s = m.superseded.clone();
        s.sort();
        assert_eq!(s, vec![("a".to_string(), 0), ("c".to_string(), 0)]);
        assert!(merge(&["AQ==".to_string()]).is_err());
    }
}
