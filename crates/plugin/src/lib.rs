//! Loading sink plugins and calling them inside the sandbox.
//!
//! Invariants:
//! - one plugin instance per `Store`: a writer per subtask and one committer,
//!   so a trap retires exactly one instance;
//! - every call runs under an epoch deadline and a memory cap, and the same
//!   deadline bounds every host import it blocks in; a trapped instance is
//!   never entered again;
//! - what an instance makes the host spend (host memory, log volume, open
//!   files, gRPC and HTTP calls in flight) is capped per instance
//!   (`capability::limits`);
//! - an instance gets only what the job grants (see `capability`); WASI gives
//!   it clocks, randomness and captured stdout/stderr, nothing else;
//! - a plugin speaks one contract version, found from its exports when it
//!   loads (newest first); every version in `bindings::SUPPORTED` is served,
//!   and a call a plugin's version cannot express is refused, never guessed.

mod adapter;
pub mod cache;
pub mod config;
pub mod host_state;
mod instance;
pub mod reserved;
pub mod sandbox;
mod wasi_bounded;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use wasmtime::component::{Component, Linker};
use wasmtime::{Config, Engine};

pub use cache::{ComponentCache, LoadedFrom};
use host_state::HostState;
pub use instance::{CommitterInstance, Instance, MaintainRequest, MaintainerInstance, WriterInstance};
use sandbox::{EpochTicker, TrapCause};
use sluice_capability::bindings::{self, PluginInfo, v0_1, v0_2, v0_2_maintenance, v0_2_state};
use sluice_capability::limits::HostLimits;
use sluice_capability::{self as capability, Granted};

/// The contract version a plugin implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ContractVersion {
    V0_1,
    V0_2,
}

impl std::fmt::Display for ContractVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ContractVersion::V0_1 => "0.1.0",
            ContractVersion::V0_2 => "0.2.4",
        })
    }
}

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
    #[error(
        "plugin {path} does not implement a contract version this host serves ({supported}): {message}",
        supported = supported_versions()
    )]
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
    #[error("plugin '{plugin}' exited with status {status} during {instance}.{call}")]
    Exited { plugin: Arc<str>, instance: Arc<str>, call: &'static str, status: i32 },
    #[error("plugin '{plugin}' {instance}.{call}: the instance is unusable after an earlier trap ({cause})")]
    Dead { plugin: Arc<str>, instance: Arc<str>, call: &'static str, cause: TrapCause },
    #[error(
        "plugin '{plugin}' implements contract {version}, which cannot {what}; rebuild it for contract {newest}",
        newest = bindings::SUPPORTED[0]
    )]
    Unsupported { plugin: Arc<str>, version: ContractVersion, what: String },
    /// Maintenance asked of a plugin built before its `maintenance` export
    /// (contract 0.2.2): the message names the plugin's exact contract.
    #[error(
        "plugin '{plugin}' implements contract {contract}, which cannot maintain tables (it has no `maintenance` export); rebuild it for contract {newest}",
        newest = bindings::SUPPORTED[0]
    )]
    NoMaintenance { plugin: Arc<str>, contract: String },
    /// A batch could not be made into what crosses into the plugin.
    #[error("cannot hand a batch of table {table:?} to plugin '{plugin}': {message}")]
    Batch { plugin: Arc<str>, table: String, message: String },
}

/// `0.2.1, 0.2.0, 0.1.0`.
fn supported_versions() -> String {
    bindings::SUPPORTED.join(", ")
}

impl sluice_core::error::Kind for PluginError {
    fn kind(&self) -> sluice_core::ErrorKind {
        use sluice_core::ErrorKind;
        match self.sink_kind() {
            Some(SinkErrorKind::Config) => ErrorKind::Config,
            Some(SinkErrorKind::InvalidData) => ErrorKind::InvalidData,
            Some(SinkErrorKind::Retryable) => ErrorKind::Retryable,
            Some(SinkErrorKind::Fatal) => ErrorKind::Fatal,
            None => match self {
                PluginError::Read { .. }
                | PluginError::Invalid { .. }
                | PluginError::Incompatible { .. }
                | PluginError::Unsupported { .. } => ErrorKind::Config,
                _ => ErrorKind::Fatal,
            },
        }
    }
}

impl PluginError {
    /// The plugin's own error kind, when it answered with one.
    pub fn sink_kind(&self) -> Option<SinkErrorKind> {
        match self {
            PluginError::Sink { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The crash a test injected into the call, if this is one (never
    /// without the `fault-injection` feature).
    pub fn injected(&self) -> Option<sluice_core::fault::Injected> {
        match self {
            PluginError::Trap { cause: TrapCause::Injected(injected), .. } => Some(*injected),
            _ => None,
        }
    }

    /// Whether this is a crash injected by a test.
    pub fn is_injected_crash(&self) -> bool {
        self.injected().is_some()
    }
}

/// Who an instance is (the WIT `sink-context`, owned).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SinkCtx {
    pub job_id: String,
    pub sink_id: String,
    /// The incarnation of the job's state directory.
    pub incarnation: String,
    /// The committer must refuse another incarnation's checkpoints in the target.
    pub refuse_other_incarnations: bool,
    /// The incarnation lands beside the others (`--new-incarnation`) and
    /// leaves the target's claim alone ([`reserved::CLAIM`]). Host-side
    /// only: plugins get it as an option.
    #[serde(default)]
    pub beside: bool,
    pub subtask: u32,
    pub parallelism: u32,
    pub attempt: u32,
    /// The job's dead-letter table ([`reserved::DEAD_LETTER_TABLE`]).
    /// Host-side only: plugins get it as an option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_table: Option<String>,
    /// When the incarnation began (ms since the Unix epoch; 0: unknown)
    /// ([`reserved::INCARNATION_CREATED_MS`]). Host-side only: plugins get
    /// it as an option.
    #[serde(default)]
    pub incarnation_created_ms: u64,
}

/// A table of the job's source, as plugins are told of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTable {
    /// `""` for a single-table source.
    pub name: String,
    /// Its schema, as an Arrow IPC stream with only the schema message.
    pub schema: Vec<u8>,
}

/// How a table changes at a checkpoint barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ChangeKind {
    NewTable,
    Evolved,
}

/// A table as it is after a change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableChange {
    pub kind: ChangeKind,
    pub table: SourceTable,
}

/// Sandbox settings of one instance.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub call_timeout: Duration,
    pub memory_mb: u64,
    /// What the instance may make the host spend.
    pub host: HostLimits,
}

impl Limits {
    /// The limits a job's `[sink.sandbox]` sets.
    pub fn of(sandbox: &config::SandboxSpec) -> Self {
        Self { call_timeout: sandbox.call_timeout(), memory_mb: sandbox.memory_mb, host: sandbox.host_limits() }
    }
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
        // `SLUICE_WASM_PROFILER=perfmap`: plugin code shows by name in `perf`
        // (for finding where a plugin spends its time; off otherwise).
        if std::env::var("SLUICE_WASM_PROFILER").is_ok_and(|v| v == "perfmap") {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        let engine = Engine::new(&config).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        let mut linker = Linker::<HostState>::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        // WASI's waits, bounded by each call's deadline, over wasmtime-wasi's own.
        wasi_bounded::add_to_linker(&mut linker).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        capability::add_to_linker(&mut linker).map_err(|e| PluginError::Setup(format!("{e:#}")))?;
        let ticker = EpochTicker::start(&engine).map_err(|e| PluginError::Setup(format!("epoch thread: {e}")))?;
        Ok(Self { engine, linker, cache: ComponentCache::new(cache_dir), _ticker: ticker })
    }

    pub fn cache(&self) -> &ComponentCache {
        &self.cache
    }

    /// Loads a plugin (compiled or from the cache), finds its contract
    /// version and asks it to describe itself.
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
        let incompatible = |message: String| PluginError::Incompatible { path: path.to_path_buf(), message };
        let instance_pre = self.linker.instantiate_pre(&component).map_err(|e| incompatible(format!("{e:#}")))?;
        // Newest first, as Spin finds the world a component targets.
        // A 0.2.2 plugin may export `maintenance` beside `sink`, and a
        // 0.2.3 plugin `committer-state`.
        let maintainer = v0_2_maintenance::MaintainerPre::new(instance_pre.clone()).ok();
        let pre = match v0_2::SinkPluginIndices::new(&instance_pre) {
            Ok(sink) => Pre::V0_2 {
                state: v0_2_state::CommitterStateHolderIndices::new(&instance_pre).ok(),
                instance_pre,
                sink,
            },
            Err(newest) => match v0_1::SinkPluginPre::new(instance_pre) {
                Ok(pre) => Pre::V0_1(pre),
                Err(_) => {
                    let exports: Vec<String> =
                        component.component_type().exports(&self.engine).map(|(name, _)| name.to_string()).collect();
                    return Err(incompatible(format!(
                        "it exports {} ({newest:#})",
                        if exports.is_empty() { "nothing".to_string() } else { exports.join(", ") }
                    )));
                }
            },
        };
        let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let mut plugin = Plugin {
            path: path.to_path_buf(),
            name: Arc::from(file_name.as_str()),
            info: None,
            engine: self.engine.clone(),
            component,
            pre,
            maintainer,
            loaded_from,
        };
        let limits = Limits { call_timeout: Duration::from_secs(30), memory_mb: 256, host: HostLimits::default() };
        let no_grants = Granted::none().map_err(|e| PluginError::Setup(e.to_string()))?;
        let mut probe = plugin.instantiate("describe", &no_grants, limits)?;
        let info = probe.describe()?;
        plugin.name = Arc::from(info.name.as_str());
        plugin.info = Some(info);
        Ok(plugin)
    }
}

/// A component linked and typechecked against one contract version.
#[derive(Clone)]
enum Pre {
    V0_2 {
        instance_pre: wasmtime::component::InstancePre<HostState>,
        sink: v0_2::SinkPluginIndices,
        /// The `committer-state` export (0.2.3), when the plugin has one:
        /// loaded from the same instance as `sink`.
        state: Option<v0_2_state::CommitterStateHolderIndices>,
    },
    V0_1(v0_1::SinkPluginPre<HostState>),
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
    pre: Pre,
    /// The `maintenance` export, when the plugin has one.
    maintainer: Option<v0_2_maintenance::MaintainerPre<HostState>>,
    pub loaded_from: LoadedFrom,
}

impl Plugin {
    /// What `describe` returned.
    pub fn info(&self) -> Option<&PluginInfo> {
        self.info.as_ref()
    }

    /// The contract version the plugin implements.
    pub fn version(&self) -> ContractVersion {
        match self.pre {
            Pre::V0_2 { .. } => ContractVersion::V0_2,
            Pre::V0_1(_) => ContractVersion::V0_1,
        }
    }

    /// Whether the plugin's committer keeps state across checkpoints (the
    /// `committer-state` export of 0.2.3), which the host persists in every
    /// checkpoint record.
    pub fn keeps_committer_state(&self) -> bool {
        matches!(self.pre, Pre::V0_2 { state: Some(_), .. })
    }

    /// Whether the plugin writes several tables and follows schema changes.
    pub fn multi_table(&self) -> bool {
        self.info.as_ref().is_some_and(|i| i.multi_table)
    }

    /// The exact contract version the plugin was built for (`0.2.0` for a
    /// plugin of 0.2.0 served by this 0.2.1 host), from its `sink` export.
    pub fn contract(&self) -> String {
        self.exports()
            .iter()
            .find_map(|name| name.strip_prefix("sluice:connector/sink@").map(str::to_string))
            .unwrap_or_else(|| self.version().to_string())
    }

    /// The refusal for maintenance asked of a plugin without the export.
    pub fn no_maintenance(&self) -> PluginError {
        PluginError::NoMaintenance { plugin: self.name.clone(), contract: self.contract() }
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

    /// Whether the plugin declares the option `name`.
    pub fn declares(&self, name: &str) -> bool {
        self.info.as_ref().is_some_and(|i| i.options.iter().any(|o| o.name == name))
    }

    /// The options every instance opens with: the job's, plus the host's
    /// own that the plugin declares (see [`reserved`]): for a 0.1 plugin
    /// those 0.2 carries in the sink context, and for both the claim mode.
    pub fn options_for(&self, job_options: Vec<(String, String)>, ctx: &SinkCtx) -> Vec<(String, String)> {
        let mut options = job_options;
        if self.version() == ContractVersion::V0_1 {
            if self.declares(reserved::INCARNATION) {
                options.push((reserved::INCARNATION.to_string(), ctx.incarnation.clone()));
            }
            if self.declares(reserved::OTHER_INCARNATIONS) {
                let policy = if ctx.refuse_other_incarnations { "refuse" } else { "accept" };
                options.push((reserved::OTHER_INCARNATIONS.to_string(), policy.to_string()));
            }
        }
        if self.declares(reserved::CLAIM) {
            let mode = if ctx.beside { "beside" } else { "exclusive" };
            options.push((reserved::CLAIM.to_string(), mode.to_string()));
        }
        if let Some(table) = &ctx.dead_letter_table
            && self.declares(reserved::DEAD_LETTER_TABLE)
        {
            options.push((reserved::DEAD_LETTER_TABLE.to_string(), table.clone()));
        }
        if ctx.incarnation_created_ms > 0 && self.declares(reserved::INCARNATION_CREATED_MS) {
            options.push((reserved::INCARNATION_CREATED_MS.to_string(), ctx.incarnation_created_ms.to_string()));
        }
        options
    }

    /// Whether the plugin takes the target's claim ([`reserved::CLAIM`]), so
    /// two fresh runs of a job started at once cannot both land.
    pub fn takes_claims(&self) -> bool {
        self.declares(reserved::CLAIM)
    }

    /// Whether the plugin can keep this incarnation's keys apart from
    /// another's, and whether it can look for another's in the target.
    pub fn incarnation_support(&self) -> (bool, bool) {
        match self.version() {
            ContractVersion::V0_2 => (true, true),
            ContractVersion::V0_1 => {
                (self.declares(reserved::INCARNATION), self.declares(reserved::OTHER_INCARNATIONS))
            }
        }
    }
}
