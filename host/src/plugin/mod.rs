//! Loading sink plugins and calling them inside the sandbox.
//!
//! Invariants:
//! - one plugin instance per `Store`: a writer per subtask and one committer,
//!   so a trap retires exactly one instance;
//! - every call runs under an epoch deadline and a memory cap; a trapped
//!   instance is never entered again;
//! - an instance gets only what the job grants (see `capability`); WASI gives
//!   it clocks, randomness and captured stdout/stderr, nothing else.

pub mod cache;
pub mod host_state;
pub mod reserved;
pub mod sandbox;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use wasmtime::component::{Component, Linker, ResourceAny, ResourceTable};
use wasmtime::{Config, Engine, Store};
use wasmtime_wasi::WasiCtx;

use crate::bindings::{self, CommitOutcome, PluginInfo, SinkError, SinkPlugin, SinkPluginPre};
use crate::capability::file_io::FileGrants;
use crate::capability::{self, Granted, InstanceTag};
pub use cache::{ComponentCache, LoadedFrom};
use host_state::HostState;
use sandbox::{EpochTicker, GuestOutput, MemoryCap, TrapCause};

/// The world every plugin of contract 0.1 implements.
pub const WORLD: &str = "sluice:connector/sink-plugin@0.1.0";

/// The kind of error a plugin reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkErrorKind {
    Config,
    InvalidData,
    Retryable,
    Fatal,
}

impl std::fmt::Display for SinkErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SinkErrorKind::Config => "configuration error",
            SinkErrorKind::InvalidData => "invalid data",
            SinkErrorKind::Retryable => "retryable error",
            SinkErrorKind::Fatal => "error",
        })
    }
}

fn split(e: SinkError) -> (SinkErrorKind, String) {
    match e {
        SinkError::Config(m) => (SinkErrorKind::Config, m),
        SinkError::InvalidData(m) => (SinkErrorKind::InvalidData, m),
        SinkError::Retryable(m) => (SinkErrorKind::Retryable, m),
        SinkError::Fatal(m) => (SinkErrorKind::Fatal, m),
    }
}

#[derive(Debug, Error)]
pub enum PluginError {
    #[error("cannot read plugin {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a loadable WebAssembly component: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("plugin {path} does not implement the {WORLD} world: {message}")]
    Incompatible { path: PathBuf, message: String },
    #[error("component cache {path}: {source}")]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot set up the plugin sandbox: {0}")]
    Setup(String),
    #[error("plugin '{plugin}' {instance}.{call} failed ({kind}): {message}")]
    Sink { plugin: Arc<str>, instance: Arc<str>, call: &'static str, kind: SinkErrorKind, message: String },
    #[error("plugin '{plugin}' {instance}.{call} {cause}")]
    Trap { plugin: Arc<str>, instance: Arc<str>, call: &'static str, cause: TrapCause },
    #[error("plugin '{plugin}' {instance}.{call}: the instance is unusable after an earlier trap ({cause})")]
    Dead { plugin: Arc<str>, instance: Arc<str>, call: &'static str, cause: TrapCause },
}

impl PluginError {
    /// The plugin's own error kind, when it answered with one.
    pub fn sink_kind(&self) -> Option<SinkErrorKind> {
        match self {
            PluginError::Sink { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// Whether this is a crash injected by a test (always false without
    /// the `fault-injection` feature).
    pub fn is_injected_crash(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return matches!(self, PluginError::Trap { cause: TrapCause::Injected, .. });
        #[cfg(not(feature = "fault-injection"))]
        false
    }
}

/// Who an instance is (the WIT `sink-context`, owned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkCtx {
    pub job_id: String,
    pub sink_id: String,
    pub subtask: u32,
    pub parallelism: u32,
    pub attempt: u32,
}

impl SinkCtx {
    fn wit(&self) -> bindings::SinkContext<'_> {
        bindings::SinkContext {
            job_id: &self.job_id,
            sink_id: &self.sink_id,
            subtask: self.subtask,
            parallelism: self.parallelism,
            attempt: self.attempt,
        }
    }
}

fn borrowed(options: &[(String, String)]) -> Vec<(&str, &str)> {
    options.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Sandbox settings of one instance.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub call_timeout: Duration,
    pub memory_mb: u64,
}

/// The wasmtime engine, its linker and the component cache. One per process.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<HostState>,
    cache: ComponentCache,
    _ticker: EpochTicker,
}

impl PluginHost {
    pub fn new(cache_dir: Option<PathBuf>) -> Result<Self, PluginError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.wasm_component_model(true);
        let engine = Engine::new(&config).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        let mut linker = Linker::<HostState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        capability::add_to_linker(&mut linker).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        let ticker = EpochTicker::start(&engine).map_err(|e| PluginError::Setup(format!("epoch thread: {e}")))?;
        Ok(Self { engine, linker, cache: ComponentCache::new(cache_dir), _ticker: ticker })
    }

    pub fn cache(&self) -> &ComponentCache {
        &self.cache
    }

    /// Loads a plugin (compiled or from the cache) and asks it to describe itself.
    pub fn load(&self, path: &Path) -> Result<Plugin, PluginError> {
        let (component, loaded_from) = self.cache.load(&self.engine, path)?;
        match &loaded_from {
            LoadedFrom::Cache(artifact) => tracing::info!(
                plugin = %path.display(),
                artifact = %artifact.display(),
                "loaded precompiled plugin from the cache (compilation skipped)"
            ),
            LoadedFrom::Compiled { seconds, cached_at } => tracing::info!(
                plugin = %path.display(),
                seconds = format!("{seconds:.1}"),
                cached_at = cached_at.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "(no cache)".into()),
                "compiled plugin"
            ),
        }
        let instance_pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::Incompatible { path: path.to_path_buf(), message: format!("{e:#}") })?;
        let pre = SinkPluginPre::new(instance_pre)
            .map_err(|e| PluginError::Incompatible { path: path.to_path_buf(), message: format!("{e:#}") })?;
        let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut plugin = Plugin {
            path: path.to_path_buf(),
            name: Arc::from(file_name.as_str()),
            info: None,
            engine: self.engine.clone(),
            component,
            pre,
            loaded_from,
        };
        let limits = Limits { call_timeout: Duration::from_secs(30), memory_mb: 256 };
        let no_grants = Granted {
            files: Arc::new(FileGrants::new(Path::new("/"), &[], &[]).map_err(|e| PluginError::Setup(e.to_string()))?),
            catalog: None,
            grpc: Arc::default(),
        };
        let mut probe = plugin.instantiate("describe", &no_grants, limits)?;
        let info = probe.describe()?;
        plugin.name = Arc::from(info.name.as_str());
        plugin.info = Some(info);
        Ok(plugin)
    }
}

/// A loaded plugin, ready to be instantiated many times (~tens of µs each).
#[derive(Clone)]
pub struct Plugin {
    pub path: PathBuf,
    /// The name from `describe` (the file name until then).
    pub name: Arc<str>,
    info: Option<PluginInfo>,
    engine: Engine,
    component: Component,
    pre: SinkPluginPre<HostState>,
    pub loaded_from: LoadedFrom,
}

impl Plugin {
    /// What `describe` returned.
    pub fn info(&self) -> Option<&PluginInfo> {
        self.info.as_ref()
    }

    /// Names of the component's imports (the capabilities it links against).
    pub fn imports(&self) -> Vec<String> {
        let ty = self.component.component_type();
        ty.imports(&self.engine).map(|(name, _)| name.to_string()).collect()
    }

    /// Names of the component's exports.
    pub fn exports(&self) -> Vec<String> {
        let ty = self.component.component_type();
        ty.exports(&self.engine).map(|(name, _)| name.to_string()).collect()
    }

    /// Creates a fresh instance in its own store.
    pub fn instantiate(&self, instance: &str, grants: &Granted, limits: Limits) -> Result<Instance, PluginError> {
        let tag = InstanceTag { plugin: self.name.clone(), instance: Arc::from(instance) };
        let stdout = GuestOutput::new(tag.clone(), "stdout");
        let stderr = GuestOutput::new(tag.clone(), "stderr");
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout).stderr(stderr.clone());
        let state = HostState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limits: MemoryCap::new(limits.memory_mb),
            caps: grants.for_instance(tag.clone()),
            stderr,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(sandbox::ticks(limits.call_timeout));
        let bindings = self.pre.instantiate(&mut store).map_err(|e| {
            let output = store.data().stderr.tail();
            PluginError::Trap {
                plugin: tag.plugin.clone(),
                instance: tag.instance.clone(),
                call: "instantiate",
                cause: sandbox::classify(
                    &e,
                    limits.call_timeout,
                    limits.memory_mb,
                    store.data().limits.exceeded(),
                    &output,
                ),
            }
        })?;
        Ok(Instance { store, bindings, tag, limits, dead: None })
    }
}

/// One plugin instance in its own store.
pub struct Instance {
    store: Store<HostState>,
    bindings: SinkPlugin,
    tag: InstanceTag,
    limits: Limits,
    dead: Option<TrapCause>,
}

impl Instance {
    /// Runs one guest call under the deadline, turning traps and plugin
    /// errors into [`PluginError`]s that name the call.
    fn call<R>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&SinkPlugin, &mut Store<HostState>) -> wasmtime::Result<Result<R, SinkError>>,
    ) -> Result<R, PluginError> {
        if let Some(cause) = &self.dead {
            return Err(PluginError::Dead {
                plugin: self.tag.plugin.clone(),
                instance: self.tag.instance.clone(),
                call,
                cause: cause.clone(),
            });
        }
        self.store.set_epoch_deadline(sandbox::ticks(self.limits.call_timeout));
        match f(&self.bindings, &mut self.store) {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => {
                let (kind, message) = split(e);
                Err(PluginError::Sink {
                    plugin: self.tag.plugin.clone(),
                    instance: self.tag.instance.clone(),
                    call,
                    kind,
                    message,
                })
            }
            Err(trap) => {
                let output = self.store.data().stderr.tail();
                let exceeded = self.store.data().limits.exceeded();
                let cause =
                    sandbox::classify(&trap, self.limits.call_timeout, self.limits.memory_mb, exceeded, &output);
                tracing::debug!(plugin = &*self.tag.plugin, instance = &*self.tag.instance, call, error = ?trap, "plugin trapped");
                self.dead = Some(cause.clone());
                Err(PluginError::Trap {
                    plugin: self.tag.plugin.clone(),
                    instance: self.tag.instance.clone(),
                    call,
                    cause,
                })
            }
        }
    }

    pub fn describe(&mut self) -> Result<PluginInfo, PluginError> {
        self.call("describe", |b, s| b.sluice_connector_sink().call_describe(s).map(Ok))
    }

    pub fn validate(&mut self, options: &[(String, String)], schema: &[u8]) -> Result<(), PluginError> {
        let options = borrowed(options);
        self.call("validate", |b, s| b.sluice_connector_sink().call_validate(s, &options, schema))
    }

    /// Arms the test-only crash after the next side effect of a call.
    #[cfg(feature = "fault-injection")]
    pub fn arm_crash_after_side_effect(&mut self, armed: bool) {
        self.store.data_mut().caps.effects.fault.arm(armed);
    }

    pub fn tag(&self) -> &InstanceTag {
        &self.tag
    }
}

/// A writer resource inside its instance.
pub struct WriterInstance {
    inst: Instance,
    handle: ResourceAny,
}

impl WriterInstance {
    pub fn open(
        mut inst: Instance,
        ctx: &SinkCtx,
        options: &[(String, String)],
        schema: &[u8],
        restored: Option<&[u8]>,
    ) -> Result<Self, PluginError> {
        let options = borrowed(options);
        let handle = inst.call("open", |b, s| {
            b.sluice_connector_sink().writer().call_open(s, ctx.wit(), &options, schema, restored)
        })?;
        Ok(Self { inst, handle })
    }

    pub fn write(&mut self, batch: &[u8]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("write", |b, s| b.sluice_connector_sink().writer().call_write(s, h, batch))
    }

    pub fn prepare_commit(&mut self, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        let h = self.handle;
        self.inst.call("prepare-commit", |b, s| b.sluice_connector_sink().writer().call_prepare_commit(s, h, c))
    }

    pub fn snapshot_state(&mut self, c: u64) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        self.inst.call("snapshot-state", |b, s| b.sluice_connector_sink().writer().call_snapshot_state(s, h, c))
    }

    pub fn abort_prepare(&mut self, c: u64) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("abort-prepare", |b, s| b.sluice_connector_sink().writer().call_abort_prepare(s, h, c))
    }

    pub fn close(&mut self) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("close", |b, s| b.sluice_connector_sink().writer().call_close(s, h))
    }
}

/// The committer resource inside its instance.
pub struct CommitterInstance {
    inst: Instance,
    handle: ResourceAny,
}

impl CommitterInstance {
    pub fn open(
        mut inst: Instance,
        ctx: &SinkCtx,
        options: &[(String, String)],
        schema: &[u8],
    ) -> Result<Self, PluginError> {
        let options = borrowed(options);
        let handle =
            inst.call("open", |b, s| b.sluice_connector_sink().committer().call_open(s, ctx.wit(), &options, schema))?;
        Ok(Self { inst, handle })
    }

    pub fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        let infos: Vec<&[u8]> = infos.iter().map(Vec::as_slice).collect();
        self.inst.call("combine", |b, s| b.sluice_connector_sink().committer().call_combine(s, h, c, &infos))
    }

    pub fn commit(&mut self, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError> {
        let h = self.handle;
        self.inst.call("commit", |b, s| b.sluice_connector_sink().committer().call_commit(s, h, c, combined))
    }

    pub fn abort(&mut self, c: u64, combined: &[u8]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("abort", |b, s| b.sluice_connector_sink().committer().call_abort(s, h, c, combined))
    }

    pub fn instance_mut(&mut self) -> &mut Instance {
        &mut self.inst
    }
}
