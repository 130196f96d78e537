//! One plugin instance in its own store, and the calls into it, for every
//! contract version: a call goes to the version's own export, converted on
//! the way in and out. What a 0.1 plugin cannot express (several tables,
//! schema changes) is refused as [`PluginError::Unsupported`].

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::{ResourceAny, ResourceTable};
use wasmtime_wasi::WasiCtx;

use super::host_state::HostState;
use super::sandbox::{self, GuestOutput, MemoryCap, TrapCause};
use super::{
    ChangeKind, ContractVersion, Limits, Plugin, PluginError, Pre, SinkCtx, SinkErrorKind, SourceTable, TableChange,
};
use crate::bindings::{CommitOutcome, PluginInfo, v0_1, v0_2};
use crate::capability::limits::CallDeadline;
use crate::capability::{Granted, InstanceTag};

/// A plugin error as the plugin gave it, whatever its version.
type Failure = (SinkErrorKind, String);

fn failure_v0_2(e: v0_2::SinkError) -> Failure {
    match e {
        v0_2::SinkError::Config(m) => (SinkErrorKind::Config, m),
        v0_2::SinkError::InvalidData(m) => (SinkErrorKind::InvalidData, m),
        v0_2::SinkError::Retryable(m) => (SinkErrorKind::Retryable, m),
        v0_2::SinkError::Fatal(m) => (SinkErrorKind::Fatal, m),
    }
}

fn failure_v0_1(e: v0_1::SinkError) -> Failure {
    match e {
        v0_1::SinkError::Config(m) => (SinkErrorKind::Config, m),
        v0_1::SinkError::InvalidData(m) => (SinkErrorKind::InvalidData, m),
        v0_1::SinkError::Retryable(m) => (SinkErrorKind::Retryable, m),
        v0_1::SinkError::Fatal(m) => (SinkErrorKind::Fatal, m),
    }
}

fn outcome_v0_1(o: v0_1::CommitOutcome) -> CommitOutcome {
    match o {
        v0_1::CommitOutcome::Committed => CommitOutcome::Committed,
        v0_1::CommitOutcome::AlreadyCommitted => CommitOutcome::AlreadyCommitted,
    }
}

fn info_v0_1(i: v0_1::PluginInfo) -> PluginInfo {
    PluginInfo {
        name: i.name,
        version: i.version,
        description: i.description,
        options: i
            .options
            .into_iter()
            .map(|o| crate::bindings::v0_2::sluice::connector::types::OptionSpec {
                name: o.name,
                description: o.description,
                required: o.required,
                default_value: o.default_value,
            })
            .collect(),
        capabilities: i.capabilities,
        multi_table: false,
    }
}

impl SinkCtx {
    fn v0_2(&self) -> v0_2::SinkContext<'_> {
        v0_2::SinkContext {
            job_id: &self.job_id,
            sink_id: &self.sink_id,
            incarnation: &self.incarnation,
            refuse_other_incarnations: self.refuse_other_incarnations,
            subtask: self.subtask,
            parallelism: self.parallelism,
            attempt: self.attempt,
        }
    }

    fn v0_1(&self) -> v0_1::SinkContext<'_> {
        v0_1::SinkContext {
            job_id: &self.job_id,
            sink_id: &self.sink_id,
            subtask: self.subtask,
            parallelism: self.parallelism,
            attempt: self.attempt,
        }
    }
}

fn tables_v0_2(tables: &[SourceTable]) -> Vec<v0_2::Table<'_>> {
    tables.iter().map(|t| v0_2::Table { name: &t.name, schema: &t.schema }).collect()
}

fn changes_v0_2(changes: &[TableChange]) -> Vec<v0_2::TableChange<'_>> {
    changes
        .iter()
        .map(|c| v0_2::TableChange {
            kind: match c.kind {
                ChangeKind::NewTable => v0_2::ChangeKind::NewTable,
                ChangeKind::Evolved => v0_2::ChangeKind::Evolved,
            },
            table: v0_2::Table { name: &c.table.name, schema: &c.table.schema },
        })
        .collect()
}

fn borrowed(options: &[(String, String)]) -> Vec<(&str, &str)> {
    options.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// A component's bindings, of the version it implements.
enum Bindings {
    V0_2(v0_2::SinkPlugin),
    V0_1(v0_1::SinkPlugin),
}

impl Plugin {
    /// Creates a fresh instance in its own store.
    pub fn instantiate(&self, instance: &str, grants: &Granted, limits: Limits) -> Result<Instance, PluginError> {
        let tag = InstanceTag { plugin: self.name.clone(), instance: Arc::from(instance) };
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
        // Instantiation runs the component's start code: the same deadline.
        let _deadline = CallDeadline::enter(limits.call_timeout);
        let instantiated = match &self.pre {
            Pre::V0_2(pre) => pre.instantiate(&mut store).map(Bindings::V0_2),
            Pre::V0_1(pre) => pre.instantiate(&mut store).map(Bindings::V0_1),
        };
        let bindings = instantiated.map_err(|e| {
            let output = store.data().stderr.tail();
            let exceeded = store.data().limits.exceeded();
            PluginError::Trap {
                plugin: tag.plugin.clone(),
                instance: tag.instance.clone(),
                call: "instantiate",
                cause: sandbox::classify(&e, limits.call_timeout, limits.memory_mb, exceeded, &output),
            }
        })?;
        Ok(Instance { store, bindings, tag, limits, dead: None })
    }
}

/// One plugin instance in its own store.
pub struct Instance {
    store: Store<HostState>,
    bindings: Bindings,
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
        f: impl FnOnce(&Bindings, &mut Store<HostState>) -> wasmtime::Result<Result<R, Failure>>,
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
            let result = f(&self.bindings, &mut self.store);
            if let Some(dropped) = log.take_dropped() {
                crate::capability::log::notice_dropped(&self.tag, call, &dropped);
            }
            result
        };
        match result {
            Ok(Ok(r)) => Ok(r),
            Ok(Err((kind, message))) => Err(PluginError::Sink {
                plugin: self.tag.plugin.clone(),
                instance: self.tag.instance.clone(),
                call,
                kind,
                message,
            }),
            Err(trap) => {
                let output = self.store.data().stderr.tail();
                let exceeded = self.store.data().limits.exceeded();
                let cause =
                    sandbox::classify(&trap, self.limits.call_timeout, self.limits.memory_mb, exceeded, &output);
                tracing::debug!(plugin = &*self.tag.plugin, instance = &*self.tag.instance, call, error = ?trap, "plugin trapped");
                self.dead = Some(cause.clone());
                if let TrapCause::Exit(status) = cause {
                    return Err(PluginError::Exited {
                        plugin: self.tag.plugin.clone(),
                        instance: self.tag.instance.clone(),
                        call,
                        status,
                    });
                }
                Err(PluginError::Trap {
                    plugin: self.tag.plugin.clone(),
                    instance: self.tag.instance.clone(),
                    call,
                    cause,
                })
            }
        }
    }

    fn version(&self) -> ContractVersion {
        match self.bindings {
            Bindings::V0_2(_) => ContractVersion::V0_2,
            Bindings::V0_1(_) => ContractVersion::V0_1,
        }
    }

    fn unsupported(&self, what: &str) -> PluginError {
        PluginError::Unsupported { plugin: self.tag.plugin.clone(), version: self.version(), what: what.to_string() }
    }

    /// The schema of the one table a 0.1 plugin can take.
    fn single_table<'t>(&self, tables: &'t [SourceTable]) -> Result<&'t [u8], PluginError> {
        match tables {
            [only] if only.name.is_empty() => Ok(&only.schema),
            _ => Err(self.unsupported("take several tables or a named table")),
        }
    }

    pub fn describe(&mut self) -> Result<PluginInfo, PluginError> {
        self.call("describe", |b, s| match b {
            Bindings::V0_2(p) => p.sluice_connector_sink().call_describe(s).map(Ok),
            Bindings::V0_1(p) => p.sluice_connector_sink().call_describe(s).map(|i| Ok(info_v0_1(i))),
        })
    }

    /// What `combined` will make visible, in the plugin's words; `None` for
    /// a plugin whose contract has no such call.
    pub fn describe_commit(
        &mut self,
        options: &[(String, String)],
        combined: &[u8],
    ) -> Result<Option<Vec<String>>, PluginError> {
        let options = borrowed(options);
        self.call("describe-commit", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().call_describe_commit(s, &options, combined).map(|lines| Ok(Some(lines)))
            }
            Bindings::V0_1(_) => Ok(Ok(None)),
        })
    }

    pub fn validate(
        &mut self,
        ctx: &SinkCtx,
        options: &[(String, String)],
        tables: &[SourceTable],
    ) -> Result<(), PluginError> {
        let options = borrowed(options);
        match &self.bindings {
            Bindings::V0_2(_) => {
                let tables = tables_v0_2(tables);
                self.call("validate", |b, s| match b {
                    Bindings::V0_2(p) => p
                        .sluice_connector_sink()
                        .call_validate(s, ctx.v0_2(), &options, &tables)
                        .map(|r| r.map_err(failure_v0_2)),
                    Bindings::V0_1(_) => unreachable_version(),
                })
            }
            Bindings::V0_1(_) => {
                let schema = self.single_table(tables)?;
                self.call("validate", |b, s| match b {
                    Bindings::V0_1(p) => {
                        p.sluice_connector_sink().call_validate(s, &options, schema).map(|r| r.map_err(failure_v0_1))
                    }
                    Bindings::V0_2(_) => unreachable_version(),
                })
            }
        }
    }

    /// Arms the test-only crash after the next side effect of a call (does
    /// nothing without the `fault-injection` feature).
    pub fn arm_crash_after_side_effect(&mut self, armed: bool) {
        self.store.data_mut().caps.effects.fault.arm(armed);
    }

    pub fn tag(&self) -> &InstanceTag {
        &self.tag
    }
}

/// A call reached the other version's arm: the bindings never change after
/// instantiation, so this cannot happen; it is reported, not panicked on.
fn unreachable_version<R>() -> wasmtime::Result<Result<R, Failure>> {
    Ok(Err((SinkErrorKind::Fatal, "internal error: a call crossed contract versions".to_string())))
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
        let handle = match inst.version() {
            ContractVersion::V0_2 => {
                let tables = tables_v0_2(tables);
                inst.call("open", |b, s| match b {
                    Bindings::V0_2(p) => p
                        .sluice_connector_sink()
                        .writer()
                        .call_open(s, ctx.v0_2(), &options, &tables, restored)
                        .map(|r| r.map_err(failure_v0_2)),
                    Bindings::V0_1(_) => unreachable_version(),
                })?
            }
            ContractVersion::V0_1 => {
                let schema = inst.single_table(tables)?.to_vec();
                inst.call("open", |b, s| match b {
                    Bindings::V0_1(p) => p
                        .sluice_connector_sink()
                        .writer()
                        .call_open(s, ctx.v0_1(), &options, &schema, restored)
                        .map(|r| r.map_err(failure_v0_1)),
                    Bindings::V0_2(_) => unreachable_version(),
                })?
            }
        };
        Ok(Self { inst, handle })
    }

    pub fn write(&mut self, table: &str, batch: &[u8]) -> Result<(), PluginError> {
        let h = self.handle;
        if self.inst.version() == ContractVersion::V0_1 && !table.is_empty() {
            return Err(self.inst.unsupported("take rows of a named table"));
        }
        self.inst.call("write", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().writer().call_write(s, h, table, batch).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().writer().call_write(s, h, batch).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    pub fn prepare_commit(&mut self, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        let h = self.handle;
        self.inst.call("prepare-commit", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().writer().call_prepare_commit(s, h, c).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().writer().call_prepare_commit(s, h, c).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    pub fn snapshot_state(&mut self, c: u64) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        self.inst.call("snapshot-state", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().writer().call_snapshot_state(s, h, c).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().writer().call_snapshot_state(s, h, c).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    pub fn apply_changes(&mut self, changes: &[TableChange]) -> Result<(), PluginError> {
        let h = self.handle;
        if self.inst.version() == ContractVersion::V0_1 {
            return Err(self.inst.unsupported("follow a new table or a schema change"));
        }
        let changes = changes_v0_2(changes);
        self.inst.call("apply-changes", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().writer().call_apply_changes(s, h, &changes).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(_) => unreachable_version(),
        })
    }

    pub fn abort_prepare(&mut self, c: u64) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("abort-prepare", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().writer().call_abort_prepare(s, h, c).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().writer().call_abort_prepare(s, h, c).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    /// The largest linear memory this writer's instance has had, in bytes.
    pub fn memory_peak(&self) -> u64 {
        self.inst.store.data().limits.peak() as u64
    }

    pub fn close(&mut self) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("close", |b, s| match b {
            Bindings::V0_2(p) => p.sluice_connector_sink().writer().call_close(s, h).map(|r| r.map_err(failure_v0_2)),
            Bindings::V0_1(p) => p.sluice_connector_sink().writer().call_close(s, h).map(|r| r.map_err(failure_v0_1)),
        })
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
        let handle = match inst.version() {
            ContractVersion::V0_2 => {
                let tables = tables_v0_2(tables);
                inst.call("open", |b, s| match b {
                    Bindings::V0_2(p) => p
                        .sluice_connector_sink()
                        .committer()
                        .call_open(s, ctx.v0_2(), &options, &tables)
                        .map(|r| r.map_err(failure_v0_2)),
                    Bindings::V0_1(_) => unreachable_version(),
                })?
            }
            ContractVersion::V0_1 => {
                let schema = inst.single_table(tables)?.to_vec();
                inst.call("open", |b, s| match b {
                    Bindings::V0_1(p) => p
                        .sluice_connector_sink()
                        .committer()
                        .call_open(s, ctx.v0_1(), &options, &schema)
                        .map(|r| r.map_err(failure_v0_1)),
                    Bindings::V0_2(_) => unreachable_version(),
                })?
            }
        };
        Ok(Self { inst, handle })
    }

    pub fn evolve(&mut self, changes: &[TableChange]) -> Result<(), PluginError> {
        let h = self.handle;
        if self.inst.version() == ContractVersion::V0_1 {
            return Err(self.inst.unsupported("create a table or change a schema"));
        }
        let changes = changes_v0_2(changes);
        self.inst.call("evolve", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().committer().call_evolve(s, h, &changes).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(_) => unreachable_version(),
        })
    }

    pub fn combine(&mut self, c: u64, infos: &[Vec<u8>]) -> Result<Vec<u8>, PluginError> {
        let h = self.handle;
        let infos: Vec<&[u8]> = infos.iter().map(Vec::as_slice).collect();
        self.inst.call("combine", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().committer().call_combine(s, h, c, &infos).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().committer().call_combine(s, h, c, &infos).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    pub fn commit(&mut self, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError> {
        let h = self.handle;
        self.inst.call("commit", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().committer().call_commit(s, h, c, combined).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => p
                .sluice_connector_sink()
                .committer()
                .call_commit(s, h, c, combined)
                .map(|r| r.map(outcome_v0_1).map_err(failure_v0_1)),
        })
    }

    pub fn abort(&mut self, c: u64, combined: &[u8]) -> Result<(), PluginError> {
        let h = self.handle;
        self.inst.call("abort", |b, s| match b {
            Bindings::V0_2(p) => {
                p.sluice_connector_sink().committer().call_abort(s, h, c, combined).map(|r| r.map_err(failure_v0_2))
            }
            Bindings::V0_1(p) => {
                p.sluice_connector_sink().committer().call_abort(s, h, c, combined).map(|r| r.map_err(failure_v0_1))
            }
        })
    }

    pub fn instance_mut(&mut self) -> &mut Instance {
        &mut self.inst
    }
}
