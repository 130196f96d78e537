//! The `file-io` capability: file access confined to granted locations.
//!
//! Invariants:
//! - a location is resolved lexically (`.`/`..` folded, relative locations
//!   taken from the job file's directory) and must then lie inside a grant;
//!   anything else is `denied` before the filesystem is touched;
//! - inside a grant every operation goes through a `cap_std::fs::Dir` opened
//!   on the grant's root, so a symbolic link cannot lead out of it either;
//! - writes under a read-only grant are `denied`;
//! - `write-file` and `rename` never replace an existing entry, and both are
//!   durable when they return (data and directory entries synced);
//! - `memory://` grants live in a store shared by the instances of one run,
//!   for tests that must not touch the disk.

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, OpenOptions};
use thiserror::Error;
use wasmtime::component::Resource;

use crate::job::normalize;
use crate::plugin::bindings::sluice::connector::file_io::{FileStatus, Host, HostOutputFile, IoError};
use crate::plugin::host_state::HostState;

const MEMORY_SCHEME: &str = "memory://";

/// A grant that cannot be set up (named in the job's `[sink.grants]`).
#[derive(Debug, Error)]
pub enum GrantError {
    #[error("grant {location:?}: {message}")]
    Invalid { location: String, message: String },
}

struct LocalGrant {
    /// Absolute, normalized root as the job spells it.
    spelled: PathBuf,
    /// The root with symbolic links resolved.
    canonical: PathBuf,
    dir: Dir,
    writable: bool,
}

/// In-memory files of `memory://` grants, shared by the instances of a run.
#[derive(Debug, Default)]
pub struct MemoryStore {
    files: Mutex<BTreeMap<String, Vec<u8>>>,
}

struct MemoryGrant {
    /// `name` of `memory://name`.
    prefix: String,
    writable: bool,
}

/// The locations one plugin may use; built once per run, shared by instances.
pub struct FileGrants {
    base_dir: PathBuf,
    local: Vec<LocalGrant>,
    memory: Vec<MemoryGrant>,
    store: Arc<MemoryStore>,
}

impl std::fmt::Debug for FileGrants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileGrants").field("granted", &self.describe()).finish()
    }
}

enum Resolved<'a> {
    Local { grant: &'a LocalGrant, rel: PathBuf },
    Memory { key: String },
}

fn other(location: &str, e: impl std::fmt::Display) -> IoError {
    IoError::Other(format!("{location}: {e}"))
}

fn io_error(location: &str, e: std::io::Error) -> IoError {
    match e.kind() {
        std::io::ErrorKind::NotFound => IoError::NotFound(location.to_string()),
        std::io::ErrorKind::AlreadyExists => IoError::AlreadyExists(location.to_string()),
        // cap-std reports an escape attempt (e.g. through a symlink) as PermissionDenied.
        std::io::ErrorKind::PermissionDenied => {
            IoError::Denied(format!("{location}: the operating system or the sandbox refused access ({e})"))
        }
        _ => other(location, e),
    }
}

/// `.` for the root itself, as cap-std wants it.
fn rel_or_dot(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() { Path::new(".") } else { rel }
}

/// Syncs a directory so that entries created, renamed or removed in it are
/// durable. (cap-std opens `Dir`s with `O_PATH`, which cannot be synced, so
/// the directory is opened for reading instead.)
fn sync_dir(dir: &Dir, rel: &Path) -> std::io::Result<()> {
    dir.open(rel_or_dot(rel))?.sync_all()
}

fn sync_parent(dir: &Dir, rel: &Path) -> std::io::Result<()> {
    sync_dir(dir, rel.parent().unwrap_or(Path::new("")))
}

fn normalize_memory(rest: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in rest.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

impl FileGrants {
    /// Sets up the grants of a job. Read-write local grants are created when
    /// missing; read-only ones must exist.
    pub fn new(
        base_dir: &Path,
        read_write: &[String],
        read_only: &[String],
        store: Arc<MemoryStore>,
    ) -> Result<Self, GrantError> {
        let mut grants = Self { base_dir: base_dir.to_path_buf(), local: Vec::new(), memory: Vec::new(), store };
        for (list, writable) in [(read_write, true), (read_only, false)] {
            for location in list {
                grants.add(location, writable)?;
            }
        }
        Ok(grants)
    }

    fn add(&mut self, location: &str, writable: bool) -> Result<(), GrantError> {
        let invalid = |message: String| GrantError::Invalid { location: location.to_string(), message };
        if let Some(rest) = location.strip_prefix(MEMORY_SCHEME) {
            let prefix = normalize_memory(rest);
            if prefix.is_empty() {
                return Err(invalid("a memory grant needs a name: memory://name".to_string()));
            }
            self.memory.push(MemoryGrant { prefix, writable });
            return Ok(());
        }
        let spelled = self.local_path(location).map_err(invalid)?;
        if writable {
            std::fs::create_dir_all(&spelled)
                .map_err(|e| invalid(format!("cannot create {}: {e}", spelled.display())))?;
        }
        let canonical = std::fs::canonicalize(&spelled)
            .map_err(|e| invalid(format!("{} is not accessible: {e}", spelled.display())))?;
        if !canonical.is_dir() {
            return Err(invalid(format!("{} is not a directory", spelled.display())));
        }
        let dir = Dir::open_ambient_dir(&canonical, ambient_authority())
            .map_err(|e| invalid(format!("cannot open {}: {e}", canonical.display())))?;
        self.local.push(LocalGrant { spelled, canonical, dir, writable });
        Ok(())
    }

    /// Absolute, normalized path of a local location.
    fn local_path(&self, location: &str) -> Result<PathBuf, String> {
        let raw = match location.strip_prefix("file://") {
            Some(rest) if rest.starts_with('/') => rest,
            Some(_) => return Err(format!("{location:?} is not an absolute file:// URI")),
            None if location.contains("://") => {
                return Err(format!("{location:?} uses a scheme this host does not serve (file://, memory://)"));
            }
            None => location,
        };
        if raw.is_empty() {
            return Err("empty location".to_string());
        }
        Ok(normalize(&self.base_dir.join(raw)))
    }

    /// Human-readable list of what is granted.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self
            .local
            .iter()
            .map(|g| format!("{} ({})", g.spelled.display(), if g.writable { "read-write" } else { "read-only" }))
            .collect();
        parts.extend(
            self.memory
                .iter()
                .map(|g| format!("memory://{} ({})", g.prefix, if g.writable { "read-write" } else { "read-only" })),
        );
        if parts.is_empty() { "nothing".to_string() } else { parts.join(", ") }
    }

    fn denied_outside(&self, location: &str) -> IoError {
        IoError::Denied(format!("{location} is outside the granted locations (granted: {})", self.describe()))
    }

    fn resolve(&self, location: &str, write: bool) -> Result<Resolved<'_>, IoError> {
        if let Some(rest) = location.strip_prefix(MEMORY_SCHEME) {
            let key = normalize_memory(rest);
            let grant = self
                .memory
                .iter()
                .find(|g| key == g.prefix || key.starts_with(&format!("{}/", g.prefix)))
                .ok_or_else(|| self.denied_outside(location))?;
            if write && !grant.writable {
                return Err(IoError::Denied(format!("{location} lies in a read-only grant")));
            }
            return Ok(Resolved::Memory { key });
        }
        let path = self.local_path(location).map_err(IoError::Denied)?;
        let mut best: Option<(&LocalGrant, PathBuf)> = None;
        for grant in &self.local {
            for root in [&grant.spelled, &grant.canonical] {
                if let Ok(rel) = path.strip_prefix(root) {
                    let better = best.as_ref().is_none_or(|(_, r)| rel.components().count() < r.components().count());
                    if better {
                        best = Some((grant, rel.to_path_buf()));
                    }
                }
            }
        }
        let (grant, rel) = best.ok_or_else(|| self.denied_outside(location))?;
        if write && !grant.writable {
            return Err(IoError::Denied(format!("{location} lies in the read-only grant {}", grant.spelled.display())));
        }
        Ok(Resolved::Local { grant, rel })
    }

    pub fn exists(&self, location: &str) -> Result<bool, IoError> {
        match self.resolve(location, false)? {
            Resolved::Local { grant, rel } => grant.dir.try_exists(rel_or_dot(&rel)).map_err(|e| io_error(location, e)),
            Resolved::Memory { key } => Ok(self.store.exists(&key)),
        }
    }

    pub fn stat(&self, location: &str) -> Result<FileStatus, IoError> {
        match self.resolve(location, false)? {
            Resolved::Local { grant, rel } => {
                let meta = grant.dir.metadata(rel_or_dot(&rel)).map_err(|e| io_error(location, e))?;
                Ok(FileStatus { size: if meta.is_dir() { 0 } else { meta.len() }, is_dir: meta.is_dir() })
            }
            Resolved::Memory { key } => self.store.stat(&key).ok_or_else(|| IoError::NotFound(location.to_string())),
        }
    }

    pub fn read(&self, location: &str, offset: u64, length: u64) -> Result<Vec<u8>, IoError> {
        let length = usize::try_from(length).map_err(|e| other(location, e))?;
        match self.resolve(location, false)? {
            Resolved::Local { grant, rel } => {
                let mut file = grant.dir.open(&rel).map_err(|e| io_error(location, e))?;
                file.seek(SeekFrom::Start(offset)).map_err(|e| io_error(location, e))?;
                let mut buf = Vec::with_capacity(length.min(64 << 20));
                file.take(length as u64).read_to_end(&mut buf).map_err(|e| io_error(location, e))?;
                Ok(buf)
            }
            Resolved::Memory { key } => {
                self.store.read(&key, offset, length).ok_or_else(|| IoError::NotFound(location.to_string()))
            }
        }
    }

    pub fn list_dir(&self, location: &str) -> Result<Vec<String>, IoError> {
        match self.resolve(location, false)? {
            Resolved::Local { grant, rel } => {
                let mut names = Vec::new();
                for entry in grant.dir.read_dir(rel_or_dot(&rel)).map_err(|e| io_error(location, e))? {
                    let entry = entry.map_err(|e| io_error(location, e))?;
                    names.push(entry.file_name().to_string_lossy().into_owned());
                }
                names.sort();
                Ok(names)
            }
            Resolved::Memory { key } => self.store.list(&key).ok_or_else(|| IoError::NotFound(location.to_string())),
        }
    }

    pub fn create_dir_all(&self, location: &str) -> Result<(), IoError> {
        match self.resolve(location, true)? {
            Resolved::Local { grant, rel } => {
                if rel.as_os_str().is_empty() {
                    return Ok(());
                }
                grant.dir.create_dir_all(&rel).map_err(|e| io_error(location, e))?;
                sync_parent(&grant.dir, &rel).map_err(|e| io_error(location, e))
            }
            Resolved::Memory { .. } => Ok(()),
        }
    }

    pub fn write_file(&self, location: &str, contents: &[u8], overwrite: bool) -> Result<(), IoError> {
        match self.resolve(location, true)? {
            Resolved::Local { grant, rel } => {
                let name = rel.file_name().ok_or_else(|| IoError::Denied(format!("{location} names no file")))?;
                if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
                    grant.dir.create_dir_all(parent).map_err(|e| io_error(location, e))?;
                }
                // Write a temporary sibling and move it into place, so that a
                // reader never sees a partial file under the final name.
                let tmp =
                    rel.with_file_name(format!(".{}.tmp-{}-{}", name.to_string_lossy(), std::process::id(), unique()));
                let result = (|| {
                    let mut f = grant.dir.create(&tmp)?;
                    f.write_all(contents)?;
                    f.sync_all()?;
                    if overwrite {
                        grant.dir.rename(&tmp, &grant.dir, &rel)
                    } else {
                        // A hard link fails when the target exists: an atomic create-new.
                        grant.dir.hard_link(&tmp, &grant.dir, &rel)?;
                        grant.dir.remove_file(&tmp)
                    }
                })();
                if result.is_err() {
                    let _ = grant.dir.remove_file(&tmp);
                }
                result.map_err(|e| io_error(location, e))?;
                sync_parent(&grant.dir, &rel).map_err(|e| io_error(location, e))
            }
            Resolved::Memory { key } => self.store.put(&key, contents.to_vec(), overwrite, location),
        }
    }

    pub fn rename(&self, from: &str, to: &str) -> Result<(), IoError> {
        let src = self.resolve(from, true)?;
        let dst = self.resolve(to, true)?;
        match (src, dst) {
            (Resolved::Local { grant: g1, rel: r1 }, Resolved::Local { grant: g2, rel: r2 }) => {
                if r1.as_os_str().is_empty() || r2.as_os_str().is_empty() {
                    return Err(IoError::Denied(format!("cannot rename a granted root ({from} -> {to})")));
                }
                // Checked first: POSIX rename would silently replace a file.
                // One committer per sink means no other writer races us here.
                if g2.dir.try_exists(&r2).map_err(|e| io_error(to, e))? {
                    return Err(IoError::AlreadyExists(to.to_string()));
                }
                g1.dir.rename(&r1, &g2.dir, &r2).map_err(|e| io_error(&format!("{from} -> {to}"), e))?;
                sync_parent(&g2.dir, &r2).map_err(|e| io_error(to, e))?;
                sync_parent(&g1.dir, &r1).map_err(|e| io_error(from, e))
            }
            (Resolved::Memory { key: k1 }, Resolved::Memory { key: k2 }) => self.store.rename(&k1, &k2, from, to),
            _ => Err(IoError::Denied(format!("cannot rename between a memory and a local location ({from} -> {to})"))),
        }
    }

    pub fn delete(&self, location: &str) -> Result<(), IoError> {
        match self.resolve(location, true)? {
            Resolved::Local { grant, rel } => {
                if rel.as_os_str().is_empty() {
                    return Err(IoError::Denied(format!("cannot delete the granted root {location}")));
                }
                let meta = grant.dir.symlink_metadata(&rel).map_err(|e| io_error(location, e))?;
                if meta.is_dir() { grant.dir.remove_dir_all(&rel) } else { grant.dir.remove_file(&rel) }
                    .map_err(|e| io_error(location, e))?;
                sync_parent(&grant.dir, &rel).map_err(|e| io_error(location, e))
            }
            Resolved::Memory { key } => self.store.delete(&key).ok_or_else(|| IoError::NotFound(location.to_string())),
        }
    }

    fn create_output(&self, location: &str, overwrite: bool) -> Result<OutputFileHandle, IoError> {
        match self.resolve(location, true)? {
            Resolved::Local { grant, rel } => {
                if rel.file_name().is_none() {
                    return Err(IoError::Denied(format!("{location} names no file")));
                }
                if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
                    grant.dir.create_dir_all(parent).map_err(|e| io_error(location, e))?;
                }
                let mut opts = OpenOptions::new();
                opts.write(true);
                if overwrite {
                    opts.create(true).truncate(true);
                } else {
                    opts.create_new(true);
                }
                let file = grant.dir.open_with(&rel, &opts).map_err(|e| io_error(location, e))?;
                let parent = grant.dir.try_clone().map_err(|e| io_error(location, e))?;
                Ok(OutputFileHandle {
                    location: location.to_string(),
                    target: OutputTarget::Local { file: Some(file), dir: parent, rel },
                })
            }
            Resolved::Memory { key } => {
                if !overwrite && self.store.exists(&key) {
                    return Err(IoError::AlreadyExists(location.to_string()));
                }
                Ok(OutputFileHandle {
                    location: location.to_string(),
                    target: OutputTarget::Memory { key, buf: Vec::new(), overwrite, store: self.store.clone() },
                })
            }
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl MemoryStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<u8>>> {
        // A poisoned lock only means another instance panicked mid-operation;
        // the map itself is always consistent (single inserts and removes).
        self.files.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn is_under(key: &str, dir: &str) -> bool {
        key.len() > dir.len() && key.starts_with(dir) && key.as_bytes()[dir.len()] == b'/'
    }

    fn exists(&self, key: &str) -> bool {
        let files = self.lock();
        files.contains_key(key) || files.keys().any(|k| Self::is_under(k, key))
    }

    fn stat(&self, key: &str) -> Option<FileStatus> {
        let files = self.lock();
        match files.get(key) {
            Some(data) => Some(FileStatus { size: data.len() as u64, is_dir: false }),
            None if files.keys().any(|k| Self::is_under(k, key)) => Some(FileStatus { size: 0, is_dir: true }),
            None => None,
        }
    }

    fn read(&self, key: &str, offset: u64, length: usize) -> Option<Vec<u8>> {
        let files = self.lock();
        let data = files.get(key)?;
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(data.len());
        let end = start.saturating_add(length).min(data.len());
        Some(data[start..end].to_vec())
    }

    fn list(&self, key: &str) -> Option<Vec<String>> {
        let files = self.lock();
        let mut names: Vec<String> = files
            .keys()
            .filter(|k| Self::is_under(k, key))
            .filter_map(|k| k[key.len() + 1..].split('/').next().map(str::to_string))
            .collect();
        names.dedup();
        if names.is_empty() { None } else { Some(names) }
    }

    fn put(&self, key: &str, data: Vec<u8>, overwrite: bool, location: &str) -> Result<(), IoError> {
        let mut files = self.lock();
        if !overwrite && files.contains_key(key) {
            return Err(IoError::AlreadyExists(location.to_string()));
        }
        files.insert(key.to_string(), data);
        Ok(())
    }

    fn rename(&self, from: &str, to: &str, from_loc: &str, to_loc: &str) -> Result<(), IoError> {
        let mut files = self.lock();
        if files.contains_key(to) || files.keys().any(|k| Self::is_under(k, to)) {
            return Err(IoError::AlreadyExists(to_loc.to_string()));
        }
        let moving: Vec<String> =
            files.keys().filter(|k| k.as_str() == from || Self::is_under(k, from)).cloned().collect();
        if moving.is_empty() {
            return Err(IoError::NotFound(from_loc.to_string()));
        }
        for key in moving {
            if let Some(data) = files.remove(&key) {
                files.insert(format!("{to}{}", &key[from.len()..]), data);
            }
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Option<()> {
        let mut files = self.lock();
        let doomed: Vec<String> =
            files.keys().filter(|k| k.as_str() == key || Self::is_under(k, key)).cloned().collect();
        if doomed.is_empty() {
            return None;
        }
        for k in doomed {
            files.remove(&k);
        }
        Some(())
    }
}

/// An `output-file` resource held in the instance's resource table.
pub struct OutputFileHandle {
    location: String,
    target: OutputTarget,
}

enum OutputTarget {
    Local { file: Option<cap_std::fs::File>, dir: Dir, rel: PathBuf },
    Memory { key: String, buf: Vec<u8>, overwrite: bool, store: Arc<MemoryStore> },
}

impl OutputFileHandle {
    fn write(&mut self, data: &[u8]) -> Result<(), IoError> {
        match &mut self.target {
            OutputTarget::Local { file: Some(f), .. } => f.write_all(data).map_err(|e| io_error(&self.location, e)),
            OutputTarget::Local { file: None, .. } => Err(other(&self.location, "already finished")),
            OutputTarget::Memory { buf, .. } => {
                buf.extend_from_slice(data);
                Ok(())
            }
        }
    }

    fn finish(&mut self) -> Result<(), IoError> {
        match &mut self.target {
            OutputTarget::Local { file, dir, rel } => {
                let f = file.take().ok_or_else(|| other(&self.location, "already finished"))?;
                f.sync_all().map_err(|e| io_error(&self.location, e))?;
                drop(f);
                sync_parent(dir, rel).map_err(|e| io_error(&self.location, e))
            }
            OutputTarget::Memory { key, buf, overwrite, store } => {
                store.put(key, std::mem::take(buf), *overwrite, &self.location)
            }
        }
    }
}

/// Per-instance view of the grants.
pub struct FileIo {
    pub grants: Arc<FileGrants>,
}

impl Host for HostState {
    fn exists(&mut self, location: String) -> wasmtime::Result<Result<bool, IoError>> {
        Ok(self.file_io.grants.exists(&location))
    }

    fn stat(&mut self, location: String) -> wasmtime::Result<Result<FileStatus, IoError>> {
        Ok(self.file_io.grants.stat(&location))
    }

    fn read(&mut self, location: String, offset: u64, length: u64) -> wasmtime::Result<Result<Vec<u8>, IoError>> {
        Ok(self.file_io.grants.read(&location, offset, length))
    }

    fn list_dir(&mut self, location: String) -> wasmtime::Result<Result<Vec<String>, IoError>> {
        Ok(self.file_io.grants.list_dir(&location))
    }

    fn create_dir_all(&mut self, location: String) -> wasmtime::Result<Result<(), IoError>> {
        Ok(self.file_io.grants.create_dir_all(&location))
    }

    fn write_file(
        &mut self,
        location: String,
        contents: Vec<u8>,
        overwrite: bool,
    ) -> wasmtime::Result<Result<(), IoError>> {
        let result = self.file_io.grants.write_file(&location, &contents, overwrite);
        if result.is_ok() {
            self.side_effect_done()?;
        }
        Ok(result)
    }

    fn rename(&mut self, from: String, to: String) -> wasmtime::Result<Result<(), IoError>> {
        let result = self.file_io.grants.rename(&from, &to);
        if result.is_ok() {
            self.side_effect_done()?;
        }
        Ok(result)
    }

    fn delete(&mut self, location: String) -> wasmtime::Result<Result<(), IoError>> {
        let result = self.file_io.grants.delete(&location);
        if result.is_ok() {
            self.side_effect_done()?;
        }
        Ok(result)
    }
}

impl HostOutputFile for HostState {
    fn create(
        &mut self,
        location: String,
        overwrite: bool,
    ) -> wasmtime::Result<Result<Resource<OutputFileHandle>, IoError>> {
        match self.file_io.grants.create_output(&location, overwrite) {
            Ok(handle) => Ok(Ok(self.table.push(handle)?)),
            Err(e) => Ok(Err(e)),
        }
    }

    fn write(&mut self, this: Resource<OutputFileHandle>, contents: Vec<u8>) -> wasmtime::Result<Result<(), IoError>> {
        Ok(self.table.get_mut(&this)?.write(&contents))
    }

    fn finish(&mut self, this: Resource<OutputFileHandle>) -> wasmtime::Result<Result<(), IoError>> {
        let result = self.table.get_mut(&this)?.finish();
        if result.is_ok() {
            self.side_effect_done()?;
        }
        Ok(result)
    }

    fn drop(&mut self, this: Resource<OutputFileHandle>) -> wasmtime::Result<()> {
        self.table.delete(this)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grants(base: &Path, rw: &[&str], ro: &[&str]) -> FileGrants {
        let rw: Vec<String> = rw.iter().map(|s| s.to_string()).collect();
        let ro: Vec<String> = ro.iter().map(|s| s.to_string()).collect();
        FileGrants::new(base, &rw, &ro, Arc::default()).unwrap()
    }

    #[test]
    fn confines_to_grants() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("ro")).unwrap();
        std::fs::write(dir.path().join("secret"), b"s").unwrap();
        let g = grants(dir.path(), &["out"], &["ro"]);
        g.write_file("out/a/b.txt", b"hello", false).unwrap();
        assert_eq!(g.read("out/a/b.txt", 1, 3).unwrap(), b"ell");
        let abs = format!("file://{}/out/a/b.txt", dir.path().display());
        assert_eq!(g.read(&abs, 0, 100).unwrap(), b"hello");
        assert!(matches!(g.write_file("out/a/b.txt", b"x", false), Err(IoError::AlreadyExists(_))));
        assert!(matches!(g.read("secret", 0, 1), Err(IoError::Denied(_))));
        assert!(matches!(g.read("out/../secret", 0, 1), Err(IoError::Denied(_))));
        assert!(matches!(g.read("/etc/passwd", 0, 1), Err(IoError::Denied(_))));
        assert!(matches!(g.write_file("ro/x", b"x", false), Err(IoError::Denied(_))));
        assert!(matches!(g.read("s3://bucket/x", 0, 1), Err(IoError::Denied(_))));
        // A symlink inside the grant cannot lead out of it.
        std::os::unix::fs::symlink(dir.path().join("secret"), dir.path().join("out/link")).unwrap();
        assert!(g.read("out/link", 0, 1).is_err());
    }

    #[test]
    fn rename_never_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path(), &["out"], &[]);
        g.write_file("out/s/f", b"1", false).unwrap();
        g.write_file("out/t/f", b"2", false).unwrap();
        assert!(matches!(g.rename("out/s", "out/t"), Err(IoError::AlreadyExists(_))));
        g.rename("out/s", "out/u").unwrap();
        assert_eq!(g.list_dir("out").unwrap(), vec!["t", "u"]);
        assert!(matches!(g.rename("out/s", "out/v"), Err(IoError::NotFound(_))));
        g.delete("out/u").unwrap();
        assert!(!g.exists("out/u").unwrap());
    }

    #[test]
    fn memory_store_behaves_like_a_directory_tree() {
        let dir = tempfile::tempdir().unwrap();
        let g = grants(dir.path(), &["memory://wh"], &[]);
        g.write_file("memory://wh/t/a.parquet", b"abc", false).unwrap();
        assert!(g.exists("memory://wh/t").unwrap());
        assert_eq!(g.list_dir("memory://wh").unwrap(), vec!["t"]);
        assert_eq!(g.stat("memory://wh/t/a.parquet").unwrap().size, 3);
        g.rename("memory://wh/t", "memory://wh/u").unwrap();
        assert_eq!(g.read("memory://wh/u/a.parquet", 1, 10).unwrap(), b"bc");
        assert!(matches!(g.read("memory://other/x", 0, 1), Err(IoError::Denied(_))));
    }
}
