//! On-disk cache of compiled components, keyed by content.
//!
//! Invariants:
//! - the key is the SHA-256 of the component bytes together with the engine's
//!   compatibility hash (wasmtime version and `Config`), so a changed plugin
//!   or a different host never picks up a stale artifact;
//! - an artifact is written to a temporary file and renamed into place, under
//!   a lock, so concurrent runs compile once and never read half a file;
//! - an artifact that fails to load is recompiled and replaced, never fatal;
//! - a compilation leaves no memory behind: the artifact is made as bytes,
//!   stored, and loaded back from its file, and what the compiler freed is
//!   returned to the system before the job starts.

use std::fs::{self, File};
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

use crate::PluginError;

/// Where a loaded component came from.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadedFrom {
    /// Deserialized from the cache: compilation skipped.
    Cache(PathBuf),
    /// Compiled now; stored in the cache when one is configured.
    Compiled { seconds: f64, cached_at: Option<PathBuf> },
}

/// Feeds `Hash` output into SHA-256 (a stable hasher, unlike `DefaultHasher`).
struct ShaHasher(Sha256);

impl Hasher for ShaHasher {
    fn finish(&self) -> u64 {
        0
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

#[derive(Debug, Clone)]
pub struct ComponentCache {
    dir: Option<PathBuf>,
}

impl ComponentCache {
    pub fn new(dir: Option<PathBuf>) -> Self {
        Self { dir }
    }

    /// `$SLUICE_CACHE_DIR`, else `$XDG_CACHE_HOME/sluice/components`, else
    /// `~/.cache/sluice/components`.
    pub fn default_dir() -> Option<PathBuf> {
        if let Some(dir) = std::env::var_os("SLUICE_CACHE_DIR").filter(|d| !d.is_empty()) {
            return Some(PathBuf::from(dir));
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
        Some(base.join("sluice").join("components"))
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// Content key of `bytes` for `engine`.
    pub fn key(engine: &Engine, bytes: &[u8]) -> String {
        let mut hasher = ShaHasher(Sha256::new());
        hasher.write(bytes);
        engine.precompile_compatibility_hash().hash(&mut hasher);
        format!("{:x}", hasher.0.finalize())
    }

    /// Loads the component at `path`, from the cache when possible.
    pub fn load(&self, engine: &Engine, path: &Path) -> Result<(Component, LoadedFrom), PluginError> {
        let bytes = fs::read(path).map_err(|source| PluginError::Read { path: path.to_path_buf(), source })?;
        let Some(dir) = &self.dir else {
            let (component, seconds) = compile(engine, path, &bytes)?;
            return_freed_memory();
            return Ok((component, LoadedFrom::Compiled { seconds, cached_at: None }));
        };
        let cache_err = |p: &Path| {
            let p = p.to_path_buf();
            move |source| PluginError::Cache { path: p, source }
        };
        fs::create_dir_all(dir).map_err(cache_err(dir))?;
        let key = Self::key(engine, &bytes);
        let artifact = dir.join(format!("{key}.cwasm"));
        if let Some(component) = try_deserialize(engine, &artifact) {
            return Ok((component, LoadedFrom::Cache(artifact)));
        }
        // Compile under a lock so that concurrent runs compile only once.
        let lock_path = dir.join(format!("{key}.lock"));
        let lock = File::create(&lock_path).map_err(cache_err(&lock_path))?;
        lock.lock().map_err(cache_err(&lock_path))?;
        if let Some(component) = try_deserialize(engine, &artifact) {
            return Ok((component, LoadedFrom::Cache(artifact)));
        }
        // Compiled to the artifact's bytes, stored, and the component then
        // loaded from the file like any cached one: the compiler's memory is
        // given back before the job starts (see `return_freed_memory`).
        let (serialized, seconds) = precompile(engine, path, &bytes)?;
        drop(bytes);
        let tmp = dir.join(format!(".{key}.tmp-{}", std::process::id()));
        let written = File::create(&tmp)
            .and_then(|mut f| f.write_all(&serialized).and_then(|()| f.sync_all()))
            .and_then(|()| fs::rename(&tmp, &artifact));
        let loaded_just_now = |e: String| PluginError::Invalid {
            path: path.to_path_buf(),
            message: format!("cannot load the component compiled just now: {e}"),
        };
        let (component, cached_at) = match written {
            Ok(()) => {
                drop(serialized);
                return_freed_memory();
                match try_deserialize(engine, &artifact) {
                    Some(component) => (component, Some(artifact)),
                    None => {
                        // Stored but not loadable from its file (a cache on a
                        // `noexec` mount, say): its bytes load from memory.
                        let stored = fs::read(&artifact).map_err(cache_err(&artifact))?;
                        // SAFETY: the file is this engine's own output, written
                        // just now under the lock.
                        let loaded = unsafe { Component::deserialize(engine, &stored) };
                        drop(stored);
                        return_freed_memory();
                        (loaded.map_err(|e| loaded_just_now(format!("{e:#}")))?, None)
                    }
                }
            }
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                tracing::warn!(cache = %dir.display(), error = %e, "could not store the compiled plugin in the cache");
                // SAFETY: `serialized` is this engine's own output, made just now.
                let loaded = unsafe { Component::deserialize(engine, &serialized) };
                drop(serialized);
                return_freed_memory();
                (loaded.map_err(|e| loaded_just_now(format!("{e:#}")))?, None)
            }
        };
        Ok((component, LoadedFrom::Compiled { seconds, cached_at }))
    }
}

/// Megabytes of WebAssembly one core compiles per second (Cranelift,
/// measured on the 2-core development machine): only for the estimate shown
/// while compiling.
const COMPILE_MB_PER_CORE_SEC: f64 = 1.4;

/// Compiles `bytes` into a component in memory (no cache).
fn compile(engine: &Engine, path: &Path, bytes: &[u8]) -> Result<(Component, f64), PluginError> {
    compiling(path, bytes, || Component::new(engine, bytes))
}

/// Compiles `bytes` into the bytes of a cache artifact.
fn precompile(engine: &Engine, path: &Path, bytes: &[u8]) -> Result<(Vec<u8>, f64), PluginError> {
    compiling(path, bytes, || engine.precompile_component(bytes))
}

/// Runs `work`, the compilation of the plugin at `path`, with its notice and
/// progress ticker.
fn compiling<T>(
    path: &Path,
    bytes: &[u8],
    work: impl FnOnce() -> wasmtime::Result<T>,
) -> Result<(T, f64), PluginError> {
    let start = Instant::now();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mb = bytes.len() as f64 / 1e6;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let estimate = (mb / (COMPILE_MB_PER_CORE_SEC * cores)).max(1.0);
    tracing::info!(
        plugin = %path.display(),
        size_mb = format!("{mb:.1}"),
        "compiling the plugin for this machine, about {estimate:.0} s; this happens once, later runs load it from the cache"
    );
    let ticker = sluice_core::progress::Ticker::start(move |elapsed| {
        let done = (elapsed.as_secs_f64() / estimate * 100.0).min(99.0);
        format!(
            "compiling {name} ({mb:.1} MB) for this machine, once: {:.0} s, about {done:.0} %",
            elapsed.as_secs_f64()
        )
    });
    let out = work().map_err(|e| PluginError::Invalid { path: path.to_path_buf(), message: format!("{e:#}") })?;
    drop(ticker);
    Ok((out, start.elapsed().as_secs_f64()))
}

/// Hands the memory the compiler freed back to the system.
///
/// Cranelift compiles on rayon's threads, and glibc keeps what each thread
/// freed in that thread's arena, where the job's own threads never reuse
/// it: a first run of the README's main job peaked at 617 MB against 297 MB
/// once the plugin was cached, and at 405 MB (the compiler's own peak) with
/// this trim (2026-12-06, `/usr/bin/time`). Other allocators need nothing.
fn return_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: glibc's `malloc_trim` takes no pointer and only returns
        // free pages of its own arenas to the kernel.
        unsafe {
            malloc_trim(0);
        }
    }
}

fn try_deserialize(engine: &Engine, artifact: &Path) -> Option<Component> {
    if !artifact.is_file() {
        return None;
    }
    // SAFETY: `deserialize_file` trusts its input to be wasmtime's own output.
    // The artifact is one this cache wrote (temporary file, then rename) under
    // a name that binds it to the source bytes and to this engine's
    // configuration; the cache directory is the user's own. wasmtime also
    // checks the artifact's header against the engine and refuses a mismatch.
    match unsafe { Component::deserialize_file(engine, artifact) } {
        Ok(component) => Some(component),
        Err(e) => {
            tracing::warn!(artifact = %artifact.display(), error = %e, "ignoring unusable cached component; recompiling");
            None
        }
    }
}
