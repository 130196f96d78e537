//! One plugin instance in its own store, and the calls into it, for every
//! contract version.
//!
//! Invariants:
//! - the instance speaks through the adapter of its contract version,
//!   chosen once when it is instantiated (`plugin::adapter`), which converts
//!   each call and refuses what its version cannot express;
//! - every guest call goes through [`Guest::call`]: it refuses a dead
//!   instance, runs under the call's deadline, names the call in its error,
//!   and retires the instance on a trap.

use std::sync::Arc;

use arrow_array::RecordBatch;

use wasmtime::Store;
use wasmtime::component::{ResourceAny, ResourceTable};
use wasmtime_wasi::WasiCtx;

use super::adapter::{self, Adapter, Failure, Opening};
use super::host_state::HostState;
use super::sandbox::{self, GuestOutput, MemoryCap, TrapCause};
use super::{ContractVersion, Limits, Plugin, PluginError, SinkCtx, SinkErrorKind, SourceTable, TableChange};
use sluice_capability::bindings::{CommitOutcome, PluginInfo, v0_2_maintenance};
use sluice_capability::limits::CallDeadline;
use sluice_capability::{Granted, InstanceTag};

fn borrowed(options: &[(String, String)]) -> Vec<(&str, &str)> {
    options.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

impl Plugin {
    /// A fresh store for one instance, with its grants and limits.
    fn store(&self, tag: &InstanceTag, grants: &Granted, limits: &Limits) -> Store<HostState> {
        let caps = grants.for_instance(tag.clone(), &limits.host);
        let stdout = GuestOutput::new(tag.clone(), "stdout", caps.log.budget.clone());
        let stderr = GuestOutput::new(tag.clone(), "stderr", caps.log.budget.clone());
        let mut wasi = WasiCtx::builder();
        wasi.stdout(stdout).stderr(stderr.clone());
        let state = HostState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limits: MemoryCap::new(limits.memory_mb),
            caps,
            stderr,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.set_epoch_deadline(sandbox::ticks(limits.call_timeout));
        store
    }

    /// Creates a fresh instance in its own store.
    pub fn instantiate(&self, instance: &str, grants: &Granted, limits: Limits) -> Result<Instance, PluginError> {
        let tag = InstanceTag { plugin: self.name.clone(), instance: Arc::from(instance) };
        let mut store = self.store(&tag, grants, &limits);
        // Instantiation runs the component's start code: the same deadline.
        let _deadline = CallDeadline::enter(limits.call_timeout);
        let adapter =
            adapter::instantiate(&self.pre, &mut store).map_err(|e| instantiation_failed(&store, &tag, &limits, &e))?;
        Ok(Instance { store, adapter, tag, limits, dead: None })
    }

    /// Whether the plugin exports `maintenance` (contract 0.2.2).
    pub fn maintains(&self) -> bool {
        self.maintainer.is_some()
    }

    /// Creates a fresh instance of the plugin's `maintenance` export, in its
    /// own store; `Unsupported` when the plugin has none.
    pub fn instantiate_maintainer(
        &self,
        instance: &str,
        grants: &Granted,
        limits: Limits,
    ) -> Result<MaintainerInstance, PluginError> {
        let Some(pre) = &self.maintainer else {
            return Err(self.no_maintenance());
        };
        let tag = InstanceTag { plugin: self.name.clone(), instance: Arc::from(instance) };
        let mut store = self.store(&tag, grants, &limits);
        let _deadline = CallDeadline::enter(limits.call_timeout);
        let bindings = pre.instantiate(&mut store).map_err(|e| instantiation_failed(&store, &tag, &limits, &e))?;
        Ok(MaintainerInstance { store, bindings, tag, limits, dead: None })
    }
}

fn instantiation_failed(
    store: &Store<HostState>,
    tag: &InstanceTag,
    limits: &Limits,
    e: &wasmtime::Error,
) -> PluginError {
    let output = store.data().stderr.tail();
    let exceeded = store.data().limits.exceeded();
    PluginError::Trap {
        plugin: tag.plugin.clone(),
        instance: tag.instance.clone(),
        call: "instantiate",
        cause: sandbox::classify(e, limits.call_timeout, limits.memory_mb, exceeded, &output),
    }
}

/// An instance of a plugin's `maintenance` export, in its own store.
pub struct MaintainerInstance {
    store: Store<HostState>,
    bindings: v0_2_maintenance::Maintainer,
    tag: InstanceTag,
    limits: Limits,
    dead: Option<TrapCause>,
}

impl MaintainerInstance {
    /// Runs `maintenance.maintain` under the instance's deadline.
    pub fn maintain(
        &mut self,
        ctx: &SinkCtx,
        options: &[(String, String)],
        request: &MaintainRequest,
    ) -> Result<Vec<v0_2_maintenance::TableReport>, PluginError> {
        let options = options.to_vec();
        let wit_request = v0_2_maintenance::Request {
            tables: request.tables.clone(),
            compaction: request.target_file_bytes.map(|b| v0_2_maintenance::Compaction { target_file_bytes: b }),
            expiry: request
                .expiry
                .map(|(older_than_ms, keep_last)| v0_2_maintenance::Expiry { older_than_ms, keep_last }),
            orphans: request
                .orphans_older_than_ms
                .map(|older_than_ms| v0_2_maintenance::Orphans { older_than_ms, protected: request.protected.clone() }),
            dry_run: request.dry_run,
        };
        let context = v0_2_maintenance::SinkContext {
            job_id: ctx.job_id.clone(),
            sink_id: ctx.sink_id.clone(),
            incarnation: ctx.incarnation.clone(),
            refuse_other_incarnations: ctx.refuse_other_incarnations,
            subtask: ctx.subtask,
            parallelism: ctx.parallelism,
            attempt: ctx.attempt,
        };
        let bindings = &self.bindings;
        let mut guest = Guest { store: &mut self.store, tag: &self.tag, limits: &self.limits, dead: &mut self.dead };
        guest.call("maintain", |s| {
            bindings.sluice_connector_maintenance().call_maintain(s, &context, &options, &wit_request)
        })
    }
}

impl From<v0_2_maintenance::SinkError> for Failure {
    fn from(e: v0_2_maintenance::SinkError) -> Self {
        use v0_2_maintenance::SinkError;
        let (kind, message) = match e {
            SinkError::Config(m) => (SinkErrorKind::Config, m),
            SinkError::InvalidData(m) => (SinkErrorKind::InvalidData, m),
            SinkError::Retryable(m) => (SinkErrorKind::Retryable, m),
            SinkError::Fatal(m) => (SinkErrorKind::Fatal, m),
        };
        Failure { kind, message }
    }
}

/// What `maintenance.maintain` is asked to do (see the WIT's `request`).
#[derive(Debug, Clone, Default)]
pub struct MaintainRequest {
    pub tables: Vec<String>,
    /// Compaction to this target file size.
    pub target_file_bytes: Option<u64>,
    /// Expiry: snapshots older than (ms since the epoch), newest kept.
    pub expiry: Option<(Option<i64>, Option<u32>)>,
    /// Orphan cleanup of files older than (ms since the epoch) ...
    pub orphans_older_than_ms: Option<i64>,
    /// ... never touching what these combined commits name.
    pub protected: Vec<Vec<u8>>,
    pub dry_run: bool,
}

/// One plugin instance in its own store.
pub struct Instance {
    store: Store<HostState>,
    adapter: Box<dyn Adapter>,
    tag: InstanceTag,
    limits: Limits,
    dead: Option<TrapCause>,
}

impl Instance {
    /// Hands the adapter what it calls the guest through.
    fn with<R>(
        &mut self,
        f: impl FnOnce(&dyn Adapter, &mut Guest<'_>) -> Result<R, PluginError>,
    ) -> Result<R, PluginError> {
        let mut guest = Guest { store: &mut self.store, tag: &self.tag, limits: &self.limits, dead: &mut self.dead };
        f(&*self.adapter, &mut guest)
    }

    pub fn describe(&mut self) -> Result<PluginInfo, PluginError> {
        self.with(|a, g| a.describe(g))
    }

    /// What `combined` will make visible, in the plugin's words; `None` for
    /// a plugin whose contract has no such call.
    pub fn describe_commit(
        &mut self,
        options: &[(String, String)],
        combined: &[u8],
    ) -> Result<Option<Vec<String>>, PluginError> {
        let options = borrowed(options);
        self.with(|a, g| a.describe_commit(g, &options, combined))
    }

    pub fn validate(
        &mut self,
        ctx: &SinkCtx,
        options: &[(String, String)],
        tables: &[SourceTable],
    ) -> Result<(), PluginError> {
        let options = borrowed(options);
        self.with(|a, g| a.validate(g, &Opening { ctx, options: &options, tables }))
    }

    /// Arms the test-only crash after the next side effect of a call (does
    /// nothing without the `fault-injection` feature).
    pub fn arm_crash_after_side_effect(&mut self, armed: bool) {
        self.store.data_mut().caps.effects.arm_crash_after_side_effect(armed);
    }

    pub fn tag(&self) -> &InstanceTag {
        &self.tag
    }
}

/// What an adapter calls the guest through: the instance's store, who it is,
/// its limits and whether it has trapped.
pub(super) struct Guest<'i> {
    store: &'i mut Store<HostState>,
    tag: &'i InstanceTag,
    limits: &'i Limits,
    dead: &'i mut Option<TrapCause>,
}

impl Guest<'_> {
    /// Runs one guest call under the deadline, turning traps and plugin
    /// errors into [`PluginError`]s that name the call.
    pub(super) fn call<R, E: Into<Failure>>(
        &mut self,
        call: &'static str,
        f: impl FnOnce(&mut Store<HostState>) -> wasmtime::Result<Result<R, E>>,
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
        let result = {
            // Host imports the call blocks in end by the same deadline.
            let _deadline = CallDeadline::enter(self.limits.call_timeout);
            let log = self.store.data().caps.log.budget.clone();
            log.begin_call();
            let result = f(self.store);
            if let Some(dropped) = log.take_dropped() {
                sluice_capability::log::notice_dropped(self.tag, call, &dropped);
            }
            result
        };
        // What the call finished is durable before the call is answered
        // (`capability::syncs`): a file that cannot be synced fails it.
        let settled = self.store.data().caps.file_io.syncs.settle();
        match result {
            Ok(Ok(r)) => match settled {
                Ok(()) => Ok(r),
                Err(e) => Err(PluginError::Sink {
                    plugin: self.tag.plugin.clone(),
                    instance: self.tag.instance.clone(),
                    call,
                    kind: SinkErrorKind::Fatal,
                    message: e.to_string(),
                }),
            },
            Ok(Err(failure)) => {
                let Failure { mut kind, mut message } = failure.into();
                // A disk that lost a finished file outranks what the plugin
                // answered: no retry of the call can make that file durable.
                if let Err(e) = settled {
                    kind = SinkErrorKind::Fatal;
                    message = format!("{e} (and the plugin answered: {message})");
                }
                Err(PluginError::Sink {
                    plugin: self.tag.plugin.clone(),
                    instance: self.tag.instance.clone(),
                    call,
                    kind,
                    message,
                })
            }
            Err(trap) => Err(self.trapped(call, &trap)),
        }
    }

    /// Retires the instance after a trap in `call`.
    fn trapped(&mut self, call: &'static str, trap: &wasmtime::Error) -> PluginError {
        let output = self.store.data().stderr.tail();
        let exceeded = self.store.data().limits.exceeded();
        let cause = sandbox::classify(trap, self.limits.call_timeout, self.limits.memory_mb, exceeded, &output);
        tracing::debug!(plugin = &*self.tag.plugin, instance = &*self.tag.instance, call, error = ?trap, "plugin trapped");
        *self.dead = Some(cause.clone());
        if let TrapCause::Exit(status) = cause {
            return PluginError::Exited {
                plugin: self.tag.plugin.clone(),
                instance: self.tag.instance.clone(),
                call,
                status,
            };
        }
        PluginError::Trap { plugin: self.tag.plugin.clone(), instance: self.tag.instance.clone(), call, cause }
    }

    /// A refusal: contract `version` cannot `what`.
    pub(super) fn unsupported(&self, version: ContractVersion, what: &str) -> PluginError {
        PluginError::Unsupported { plugin: self.tag.plugin.clone(), version, what: what.to_string() }
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
        tables: &[SourceTable],
        restored: Option<&[u8]>,
    ) -> Result<Self, PluginError> {
        let options = borrowed(options);
        let handle = inst.with(|a, g| a.open_writer(g, &Opening { ctx, options: &options, tables }, restored))?;
        Ok(Self { inst, handle })
    }

    /// Hands the writer a batch of `table` as an Arrow IPC stream (the
    /// Python API's form). When the plugin asked for some of the table's
    /// columns only (`columnar.project-input`, 0.2.4), it is decoded here
    /// and handed over as [`Self::write_batch`] does.
    pub fn write(&mut self, table: &str, batch: &[u8]) -> Result<(), PluginError> {
        if self.inst.store.data().caps.columnar.projects(table) {
            let batches = sluice_core::ipc::decode_batches(batch.to_vec()).map_err(|e| self.batch_error(table, e))?;
            for batch in &batches {
                self.write_batch(table, batch)?;
            }
            return Ok(());
        }
        let h = self.handle;
        self.inst.with(|a, g| a.write(g, h, table, batch))
    }

    /// Hands the writer `batch` of `table`: the whole batch as Arrow IPC,
    /// or, when the plugin asked for some of the table's columns only, those
    /// columns, with the whole batch held for the call as the input
    /// `columnar.parquet-writer.write-input` encodes rows of (released when
    /// the call ends, however it ends). Returns the bytes that crossed.
    pub fn write_batch(&mut self, table: &str, batch: &RecordBatch) -> Result<u64, PluginError> {
        let projected =
            self.inst.store.data().caps.columnar.project(table, batch).map_err(|e| self.batch_error(table, e))?;
        let bytes = sluice_core::ipc::encode_batch(projected.as_ref().unwrap_or(batch))
            .map_err(|e| self.batch_error(table, e))?;
        let h = self.handle;
        if projected.is_some() {
            self.inst.store.data_mut().caps.columnar.hold(batch.clone());
        }
        let result = self.inst.with(|a, g| a.write(g, h, table, &bytes));
        self.inst.store.data_mut().caps.columnar.release();
        result.map(|()| bytes.len() as u64)
    }

    fn batch_error(&self, table: &str, e: impl std::fmt::Display) -> PluginError {
        PluginError::Batch { plugin: self.inst.tag.plugin.clone(), table: table.to_string(), message: e.to_string() }
    }

    pub fn prepare_commit(&mut self, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.prepare_commit(g, h, c))
    }

    pub fn snapshot_state(&mut self, c: u64) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.snapshot_state(g, h, c))
    }

    pub fn apply_changes(&mut self, changes: &[TableChange]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.apply_changes(g, h, changes))
    }

    pub fn abort_prepare(&mut self, c: u64) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.abort_prepare(g, h, c))
    }

    /// The largest linear memory this writer's instance has had, in bytes.
    pub fn memory_peak(&self) -> u64 {
        self.inst.store.data().limits.peak() as u64
    }

    /// The most host memory its capabilities held for this writer's
    /// instance at once (open Parquet writers, uploads, reads), in bytes.
    pub fn host_memory_peak(&self) -> u64 {
        self.inst.store.data().caps.memory.peak()
    }

    pub fn close(&mut self) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.close(g, h))
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
        tables: &[SourceTable],
    ) -> Result<Self, PluginError> {
        let options = borrowed(options);
        let handle = inst.with(|a, g| a.open_committer(g, &Opening { ctx, options: &options, tables }))?;
        Ok(Self { inst, handle })
    }

    pub fn evolve(&mut self, changes: &[TableChange]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.evolve(g, h, changes))
    }

    pub fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        let infos: Vec<&[u8]> = infos.iter().map(Vec::as_slice).collect();
        self.inst.with(|a, g| a.combine(g, h, c, &infos))
    }

    pub fn commit(&mut self, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError> {
        // A test may freeze the process here, between the caller's lease
        // check and the commit's effect.
        sluice_core::fault::pause_here(sluice_core::fault::PausePoint::BeforeCommit, c);
        let h = self.handle;
        self.inst.with(|a, g| a.commit(g, h, c, combined))
    }

    pub fn abort(&mut self, c: u64, combined: &[u8]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.with(|a, g| a.abort(g, h, c, combined))
    }

    /// Whether the committer keeps state across checkpoints (the plugin
    /// exports `committer-state`, 0.2.3).
    pub fn keeps_state(&self) -> bool {
        self.inst.adapter.keeps_state()
    }

    /// Hands the committer the state of the newest record of its
    /// incarnation (`None` on the incarnation's first run). Call it right
    /// after [`open`](Self::open), before any other call. Nothing for a
    /// committer that keeps no state.
    pub fn restore_state(&mut self, state: Option<&[u8]>) -> Result<(), PluginError> {
        self.inst.with(|a, g| a.restore_state(g, state))
    }

    /// The state to persist in the record of checkpoint `c`; `None` for a
    /// committer that keeps no state.
    pub fn snapshot_state(&mut self, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        self.inst.with(|a, g| a.snapshot_committer_state(g, c))
    }

    /// A bounded input ended with round `c`, in which no writer prepared
    /// anything: the combined commit the end of the input calls for, if
    /// any (always `None` for a committer that keeps no state).
    pub fn finish(&mut self, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        self.inst.with(|a, g| a.finish(g, c))
    }

    pub fn instance_mut(&mut self) -> &mut Instance {
        &mut self.inst
    }
}
