//! The `file-io` capability: file access confined to granted locations.
//!
//! Invariants:
//! - a location is resolved lexically (`.`/`..` folded, relative locations
//!   taken from the job file's directory) and must then lie inside a grant;
//!   anything else is `denied` before the filesystem is touched;
//! - inside a grant every operation goes through a `cap_std::fs::Dir` opened
//!   on the grant's root, so a symbolic link cannot lead out of it either;
//! - writes under a read-only grant are `denied`, and so is a write whose
//!   target is a symbolic link leading out of the grant;
//! - an instance holds at most `sink.sandbox.max_open_files` output files
//!   (each holds two descriptors until dropped); every operation checks the
//!   call's deadline before it starts (local-file operations run to their
//!   end once started);
//! - `write-file` and `rename` never replace an existing entry, and both are
//!   durable when they return (data and directory entries synced);
//! - a rename across filesystems (EXDEV) is `other` with the words
//!   "different filesystems", which plugins match on (the WIT is frozen).
//!
//! The run's [`FileGrants`] are shared by its instances; each instance sees
//! them through a [`FileIoView`], which the WIT interface is linked through.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cap_std::ambient_authority;
use cap_std::fs::{Dir, OpenOptions};
use thiserror::Error;
use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

use super::limits::{CallDeadline, HandleCap, HandleSlot};
use super::{CapabilityHost, Effects};
use crate::bindings::v0_2::sluice::connector::file_io::{self as wit, FileStatus, Host, HostOutputFile, IoError};
use crate::job::normalize;

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

/// The locations one plugin may use; built once per run, shared by instances.
pub struct FileGrants {
    base_dir: PathBuf,
    local: Vec<LocalGrant>,
}

impl std::fmt::Debug for FileGrants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileGrants").field("granted", &self.describe()).finish()
    }
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
        // EXDEV: the contract's `other`, in words a plugin can recognise.
        std::io::ErrorKind::CrossesDevices => IoError::Other(format!(
            "{location}: the two locations are on different filesystems, and a rename cannot cross them ({e})"
        )),
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

impl FileGrants {
    /// Sets up the grants of a job. Read-write local grants are created when
    /// missing; read-only ones must exist.
    pub fn new(base_dir: &Path, read_write: &[String], read_only: &[String]) -> Result<Self, GrantError> {
        let mut grants = Self { base_dir: base_dir.to_path_buf(), local: Vec::new() };
        for (list, writable) in [(read_write, true), (read_only, false)] {
            for location in list {
                grants.add(location, writable)?;
            }
        }
        Ok(grants)
    }

    fn add(&mut self, location: &str, writable: bool) -> Result<(), GrantError> {
        let invalid = |message: String| GrantError::Invalid { location: location.to_string(), message };
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
                return Err(format!("{location:?} uses a scheme this host does not serve (file://)"));
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
        let parts: Vec<String> = self
            .local
            .iter()
            .map(|g| format!("{} ({})", g.spelled.display(), if g.writable { "read-write" } else { "read-only" }))
            .collect();
        if parts.is_empty() { "nothing".to_string() } else { parts.join(", ") }
    }

    fn denied_outside(&self, location: &str) -> IoError {
        IoError::Denied(format!("{location} is outside the granted locations (granted: {})", self.describe()))
    }

    /// The grant a location lies in, and its path relative to the grant's root.
    fn resolve(&self, location: &str, write: bool) -> Result<(&LocalGrant, PathBuf), IoError> {
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
        Ok((grant, rel))
    }

    pub fn exists(&self, location: &str) -> Result<bool, IoError> {
        let (grant, rel) = self.resolve(location, false)?;
        grant.dir.try_exists(rel_or_dot(&rel)).map_err(|e| io_error(location, e))
    }

    pub fn stat(&self, location: &str) -> Result<FileStatus, IoError> {
        let (grant, rel) = self.resolve(location, false)?;
        let meta = grant.dir.metadata(rel_or_dot(&rel)).map_err(|e| io_error(location, e))?;
        Ok(FileStatus { size: if meta.is_dir() { 0 } else { meta.len() }, is_dir: meta.is_dir() })
    }

    pub fn read(&self, location: &str, offset: u64, length: u64) -> Result<Vec<u8>, IoError> {
        let length = usize::try_from(length).map_err(|e| other(location, e))?;
        let (grant, rel) = self.resolve(location, false)?;
        let mut file = grant.dir.open(&rel).map_err(|e| io_error(location, e))?;
        file.seek(SeekFrom::Start(offset)).map_err(|e| io_error(location, e))?;
        let mut buf = Vec::with_capacity(length.min(64 << 20));
        file.take(length as u64).read_to_end(&mut buf).map_err(|e| io_error(location, e))?;
        Ok(buf)
    }

    pub fn list_dir(&self, location: &str) -> Result<Vec<String>, IoError> {
        let (grant, rel) = self.resolve(location, false)?;
        let mut names = Vec::new();
        for entry in grant.dir.read_dir(rel_or_dot(&rel)).map_err(|e| io_error(location, e))? {
            let entry = entry.map_err(|e| io_error(location, e))?;
            names.push(entry.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    pub fn create_dir_all(&self, location: &str) -> Result<(), IoError> {
        let (grant, rel) = self.resolve(location, true)?;
        if rel.as_os_str().is_empty() {
            return Ok(());
        }
        grant.dir.create_dir_all(&rel).map_err(|e| io_error(location, e))?;
        sync_parent(&grant.dir, &rel).map_err(|e| io_error(location, e))
    }

    pub fn write_file(&self, location: &str, contents: &[u8], overwrite: bool) -> Result<(), IoError> {
        let (grant, rel) = self.resolve(location, true)?;
        let name = rel.file_name().ok_or_else(|| IoError::Denied(format!("{location} names no file")))?;
        refuse_link_out(grant, &rel, location)?;
        if let Some(parent) = rel.parent().filter(|p| !p.as_os_str().is_empty()) {
            grant.dir.create_dir_all(parent).map_err(|e| io_error(location, e))?;
        }
        // Write a temporary sibling and move it into place, so that a
        // reader never sees a partial file under the final name.
        let tmp = rel.with_file_name(format!(".{}.tmp-{}-{}", name.to_string_lossy(), std::process::id(), unique()));
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

    pub fn rename(&self, from: &str, to: &str) -> Result<(), IoError> {
        let (g1, r1) = self.resolve(from, true)?;
        let (g2, r2) = self.resolve(to, true)?;
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

    pub fn delete(&self, location: &str) -> Result<(), IoError> {
        let (grant, rel) = self.resolve(location, true)?;
        if rel.as_os_str().is_empty() {
            return Err(IoError::Denied(format!("cannot delete the granted root {location}")));
        }
        let meta = grant.dir.symlink_metadata(&rel).map_err(|e| io_error(location, e))?;
        if meta.is_dir() { grant.dir.remove_dir_all(&rel) } else { grant.dir.remove_file(&rel) }
            .map_err(|e| io_error(location, e))?;
        sync_parent(&grant.dir, &rel).map_err(|e| io_error(location, e))
    }

    fn create_output(&self, location: &str, overwrite: bool) -> Result<OutputFileHandle, IoError> {
        let (grant, rel) = self.resolve(location, true)?;
        if rel.file_name().is_none() {
            return Err(IoError::Denied(format!("{location} names no file")));
        }
        refuse_link_out(grant, &rel, location)?;
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
        let dir = grant.dir.try_clone().map_err(|e| io_error(location, e))?;
        Ok(OutputFileHandle { location: location.to_string(), file: Some(file), dir, rel, slot: None })
    }
}

/// `denied` when `rel` is a symbolic link that cannot be followed inside
/// the grant (cap-std refuses to leave its root): writing there would write
/// outside the grant, or fail as if the file existed.
fn refuse_link_out(grant: &LocalGrant, rel: &Path, location: &str) -> Result<(), IoError> {
    let Ok(meta) = grant.dir.symlink_metadata(rel) else { return Ok(()) };
    if !meta.file_type().is_symlink() {
        return Ok(());
    }
    match grant.dir.canonicalize(rel) {
        Ok(_) => Ok(()),
        // Dangling, but inside the grant.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(IoError::Denied(format!(
            "{location} is a symbolic link leading outside the granted locations (granted: {}): {e}",
            grant.spelled.display()
        ))),
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// An `output-file` resource held in the instance's resource table.
pub struct OutputFileHandle {
    location: String,
    /// `None` once finished.
    file: Option<cap_std::fs::File>,
    /// The grant's root and the file's path in it (to sync its directory).
    dir: Dir,
    rel: PathBuf,
    /// Counts the handle against `sink.sandbox.max_open_files` until dropped.
    slot: Option<HandleSlot>,
}

impl OutputFileHandle {
    fn write(&mut self, data: &[u8]) -> Result<(), IoError> {
        match &mut self.file {
            Some(f) => f.write_all(data).map_err(|e| io_error(&self.location, e)),
            None => Err(other(&self.location, "already finished")),
        }
    }

    fn finish(&mut self) -> Result<(), IoError> {
        let f = self.file.take().ok_or_else(|| other(&self.location, "already finished"))?;
        f.sync_all().map_err(|e| io_error(&self.location, e))?;
        drop(f);
        sync_parent(&self.dir, &self.rel).map_err(|e| io_error(&self.location, e))
    }
}

/// One instance's file access: the run's grants, and its open output files.
pub struct FileIoCtx {
    pub grants: Arc<FileGrants>,
    pub open: HandleCap,
}

/// Traps when the call is past its deadline before `op` starts.
fn started(op: &'static str) -> wasmtime::Result<()> {
    CallDeadline::check(op).map_err(wasmtime::Error::new)
}

/// What the `file-io` interface is linked through: the instance's grants,
/// its resource table (output files) and its side-effect hook.
pub struct FileIoView<'a> {
    pub ctx: &'a FileIoCtx,
    pub table: &'a mut ResourceTable,
    pub effects: &'a mut Effects,
}

/// The `file-io` capability for wasmtime's linker ([`HasData`]).
pub struct FileIo;

impl HasData for FileIo {
    type Data<'a> = FileIoView<'a>;
}

/// The view of a store's data.
pub(super) fn view<T: CapabilityHost>(t: &mut T) -> FileIoView<'_> {
    let (caps, table) = t.capabilities();
    FileIoView { ctx: &caps.file_io, table, effects: &mut caps.effects }
}

/// Links `file-io` into a linker whose store data grants capabilities.
pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, FileIo>(linker, view::<T>)
}

impl Host for FileIoView<'_> {
    fn exists(&mut self, location: String) -> wasmtime::Result<Result<bool, IoError>> {
        started("sluice:connector/file-io.exists")?;
        Ok(self.ctx.grants.exists(&location))
    }

    fn stat(&mut self, location: String) -> wasmtime::Result<Result<FileStatus, IoError>> {
        started("sluice:connector/file-io.stat")?;
        Ok(self.ctx.grants.stat(&location))
    }

    fn read(&mut self, location: String, offset: u64, length: u64) -> wasmtime::Result<Result<Vec<u8>, IoError>> {
        started("sluice:connector/file-io.read")?;
        Ok(self.ctx.grants.read(&location, offset, length))
    }

    fn list_dir(&mut self, location: String) -> wasmtime::Result<Result<Vec<String>, IoError>> {
        started("sluice:connector/file-io.list-dir")?;
        Ok(self.ctx.grants.list_dir(&location))
    }

    fn create_dir_all(&mut self, location: String) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.create-dir-all")?;
        Ok(self.ctx.grants.create_dir_all(&location))
    }

    fn write_file(
        &mut self,
        location: String,
        contents: Vec<u8>,
        overwrite: bool,
    ) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.write-file")?;
        let result = self.ctx.grants.write_file(&location, &contents, overwrite);
        if result.is_ok() {
            self.effects.done()?;
        }
        Ok(result)
    }

    fn rename(&mut self, from: String, to: String) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.rename")?;
        let result = self.ctx.grants.rename(&from, &to);
        if result.is_ok() {
            self.effects.done()?;
        }
        Ok(result)
    }

    fn delete(&mut self, location: String) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.delete")?;
        let result = self.ctx.grants.delete(&location);
        if result.is_ok() {
            self.effects.done()?;
        }
        Ok(result)
    }
}

impl HostOutputFile for FileIoView<'_> {
    fn create(
        &mut self,
        location: String,
        overwrite: bool,
    ) -> wasmtime::Result<Result<Resource<OutputFileHandle>, IoError>> {
        started("sluice:connector/file-io.[static]output-file.create")?;
        let slot = match self.ctx.open.take() {
            Ok(slot) => slot,
            Err(too_many) => return Ok(Err(IoError::Other(format!("{location}: {too_many}")))),
        };
        match self.ctx.grants.create_output(&location, overwrite) {
            Ok(mut handle) => {
                handle.slot = Some(slot);
                Ok(Ok(self.table.push(handle)?))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn write(&mut self, this: Resource<OutputFileHandle>, contents: Vec<u8>) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.[method]output-file.write")?;
        Ok(self.table.get_mut(&this)?.write(&contents))
    }

    fn finish(&mut self, this: Resource<OutputFileHandle>) -> wasmtime::Result<Result<(), IoError>> {
        started("sluice:connector/file-io.[method]output-file.finish")?;
        let result = self.table.get_mut(&this)?.finish();
        if result.is_ok() {
            self.effects.done()?;
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
        FileGrants::new(base, &rw, &ro).unwrap()
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
        assert!(matches!(g.read("memory://wh/x", 0, 1), Err(IoError::Denied(_))));
        // A symlink inside the grant cannot lead out of it.
        std::os::unix::fs::symlink(dir.path().join("secret"), dir.path().join("out/link")).unwrap();
        assert!(g.read("out/link", 0, 1).is_err());
        // Nor can a write through it: refused as denied, not as existing.
        for overwrite in [false, true] {
            let err = g.write_file("out/link", b"x", overwrite).unwrap_err();
            assert!(matches!(&err, IoError::Denied(m) if m.contains("symbolic link leading outside")), "{err:?}");
            let err = g.create_output("out/link", overwrite).err().expect("refused");
            assert!(matches!(&err, IoError::Denied(_)), "{err:?}");
        }
        assert_eq!(std::fs::read(dir.path().join("secret")).unwrap(), b"s");
        // A link that stays inside the grant is an ordinary existing entry.
        std::os::unix::fs::symlink("a/b.txt", dir.path().join("out/inside")).unwrap();
        assert!(matches!(g.write_file("out/inside", b"x", false), Err(IoError::AlreadyExists(_))));
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
}
