//! Contract 0.1, frozen: one unnamed table with a fixed schema, no
//! `describe-commit`. The incarnation the 0.2 sink context carries reaches
//! a 0.1 plugin as a reserved option (`Plugin::options_for`). Several or
//! named tables and table changes are refused, before the guest is entered.

use wasmtime::component::ResourceAny;

use super::{Failure, Opening};
use crate::instance::Guest;
use crate::{ContractVersion, PluginError, SinkCtx, SourceTable, TableChange};
use sluice_capability::bindings::{CommitOutcome, PluginInfo, v0_1, v0_2};

failure_from!(v0_1);

/// The bindings of a 0.1 instance.
pub(super) struct Adapter(pub(super) v0_1::SinkPlugin);

fn context(ctx: &SinkCtx) -> v0_1::SinkContext<'_> {
    v0_1::SinkContext {
        job_id: &ctx.job_id,
        sink_id: &ctx.sink_id,
        subtask: ctx.subtask,
        parallelism: ctx.parallelism,
        attempt: ctx.attempt,
    }
}

fn info(i: v0_1::PluginInfo) -> PluginInfo {
    PluginInfo {
        name: i.name,
        version: i.version,
        description: i.description,
        options: i
            .options
            .into_iter()
            .map(|o| v0_2::sluice::connector::types::OptionSpec {
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

fn outcome(o: v0_1::CommitOutcome) -> CommitOutcome {
    match o {
        v0_1::CommitOutcome::Committed => CommitOutcome::Committed,
        v0_1::CommitOutcome::AlreadyCommitted => CommitOutcome::AlreadyCommitted,
    }
}

fn refuse(guest: &Guest<'_>, what: &str) -> PluginError {
    guest.unsupported(ContractVersion::V0_1, what)
}

/// The schema of the one table a 0.1 plugin can take.
fn single_table<'t>(guest: &Guest<'_>, tables: &'t [SourceTable]) -> Result<&'t [u8], PluginError> {
    match tables {
        [only] if only.name.is_empty() => Ok(&only.schema),
        _ => Err(refuse(guest, "take several tables or a named table")),
    }
}

impl super::Adapter for Adapter {
    same_calls!();

    fn describe(&self, guest: &mut Guest<'_>) -> Result<PluginInfo, PluginError> {
        guest.call("describe", |s| self.0.sluice_connector_sink().call_describe(s).map(|i| Ok::<_, Failure>(info(i))))
    }

    fn describe_commit(
        &self,
        guest: &mut Guest<'_>,
        _options: &[(&str, &str)],
        _combined: &[u8],
    ) -> Result<Option<Vec<String>>, PluginError> {
        // No such call in 0.1: answered without entering the guest, though
        // a dead instance still says so.
        guest.call("describe-commit", |_| Ok(Ok::<_, Failure>(None)))
    }

    fn validate(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<(), PluginError> {
        let options = open.options;
        let schema = single_table(guest, open.tables)?;
        guest.call("validate", |s| self.0.sluice_connector_sink().call_validate(s, options, schema))
    }

    fn open_writer(
        &self,
        guest: &mut Guest<'_>,
        open: &Opening<'_>,
        restored: Option<&[u8]>,
    ) -> Result<ResourceAny, PluginError> {
        let (ctx, options) = (open.ctx, open.options);
        let schema = single_table(guest, open.tables)?;
        guest.call("open", |s| {
            self.0.sluice_connector_sink().writer().call_open(s, context(ctx), options, schema, restored)
        })
    }

    fn write(&self, guest: &mut Guest<'_>, h: ResourceAny, table: &str, batch: &[u8]) -> Result<(), PluginError> {
        if !table.is_empty() {
            return Err(refuse(guest, "take rows of a named table"));
        }
        guest.call("write", |s| self.0.sluice_connector_sink().writer().call_write(s, h, batch))
    }

    fn apply_changes(&self, guest: &mut Guest<'_>, _h: ResourceAny, _: &[TableChange]) -> Result<(), PluginError> {
        Err(refuse(guest, "follow a new table or a schema change"))
    }

    fn open_committer(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<ResourceAny, PluginError> {
        let (ctx, options) = (open.ctx, open.options);
        let schema = single_table(guest, open.tables)?;
        guest.call("open", |s| self.0.sluice_connector_sink().committer().call_open(s, context(ctx), options, schema))
    }

    fn evolve(&self, guest: &mut Guest<'_>, _h: ResourceAny, _: &[TableChange]) -> Result<(), PluginError> {
        Err(refuse(guest, "create a table or change a schema"))
    }

    fn commit(&self, g: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError> {
        g.call("commit", |s| {
            self.0.sluice_connector_sink().committer().call_commit(s, h, c, combined).map(|r| r.map(outcome))
        })
    }
}
