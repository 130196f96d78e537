//! Contract 0.2, the newest: every call is served as it is, the host's
//! types borrowed into the bindings' own.

use wasmtime::component::ResourceAny;

use super::Failure;
use crate::bindings::{CommitOutcome, PluginInfo, v0_2};
use crate::plugin::instance::Guest;
use crate::plugin::{ChangeKind, PluginError, SinkCtx, SourceTable, TableChange};

failure_from!(v0_2);

/// The bindings of a 0.2 instance.
pub(super) struct Adapter(pub(super) v0_2::SinkPlugin);

fn context(ctx: &SinkCtx) -> v0_2::SinkContext<'_> {
    v0_2::SinkContext {
        job_id: &ctx.job_id,
        sink_id: &ctx.sink_id,
        incarnation: &ctx.incarnation,
        refuse_other_incarnations: ctx.refuse_other_incarnations,
        subtask: ctx.subtask,
        parallelism: ctx.parallelism,
        attempt: ctx.attempt,
    }
}

fn table(t: &SourceTable) -> v0_2::Table<'_> {
    v0_2::Table { name: &t.name, schema: &t.schema }
}

fn tables(tables: &[SourceTable]) -> Vec<v0_2::Table<'_>> {
    tables.iter().map(table).collect()
}

fn changes(changes: &[TableChange]) -> Vec<v0_2::TableChange<'_>> {
    changes
        .iter()
        .map(|c| v0_2::TableChange {
            kind: match c.kind {
                ChangeKind::NewTable => v0_2::ChangeKind::NewTable,
                ChangeKind::Evolved => v0_2::ChangeKind::Evolved,
            },
            table: table(&c.table),
        })
        .collect()
}

impl super::Adapter for Adapter {
    fn describe(&self, guest: &mut Guest<'_>) -> Result<PluginInfo, PluginError> {
        guest.call("describe", |s| self.0.sluice_connector_sink().call_describe(s).map(Ok::<_, Failure>))
    }

    fn describe_commit(
        &self,
        guest: &mut Guest<'_>,
        options: &[(&str, &str)],
        combined: &[u8],
    ) -> Result<Option<Vec<String>>, PluginError> {
        guest.call("describe-commit", |s| {
            self.0
                .sluice_connector_sink()
                .call_describe_commit(s, options, combined)
                .map(|lines| Ok::<_, Failure>(Some(lines)))
        })
    }

    fn validate(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
    ) -> Result<(), PluginError> {
        let tables = self::tables(tables);
        guest.call("validate", |s| self.0.sluice_connector_sink().call_validate(s, context(ctx), options, &tables))
    }

    fn open_writer(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
        restored: Option<&[u8]>,
    ) -> Result<ResourceAny, PluginError> {
        let tables = self::tables(tables);
        guest.call("open", |s| {
            self.0.sluice_connector_sink().writer().call_open(s, context(ctx), options, &tables, restored)
        })
    }

    fn write(&self, guest: &mut Guest<'_>, h: ResourceAny, table: &str, batch: &[u8]) -> Result<(), PluginError> {
        guest.call("write", |s| self.0.sluice_connector_sink().writer().call_write(s, h, table, batch))
    }

    fn prepare_commit(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        guest.call("prepare-commit", |s| self.0.sluice_connector_sink().writer().call_prepare_commit(s, h, c))
    }

    fn snapshot_state(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<Vec<u8>, PluginError> {
        guest.call("snapshot-state", |s| self.0.sluice_connector_sink().writer().call_snapshot_state(s, h, c))
    }

    fn apply_changes(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError> {
        let changes = self::changes(changes);
        guest.call("apply-changes", |s| self.0.sluice_connector_sink().writer().call_apply_changes(s, h, &changes))
    }

    fn abort_prepare(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64) -> Result<(), PluginError> {
        guest.call("abort-prepare", |s| self.0.sluice_connector_sink().writer().call_abort_prepare(s, h, c))
    }

    fn close(&self, guest: &mut Guest<'_>, h: ResourceAny) -> Result<(), PluginError> {
        guest.call("close", |s| self.0.sluice_connector_sink().writer().call_close(s, h))
    }

    fn open_committer(
        &self,
        guest: &mut Guest<'_>,
        ctx: &SinkCtx,
        options: &[(&str, &str)],
        tables: &[SourceTable],
    ) -> Result<ResourceAny, PluginError> {
        let tables = self::tables(tables);
        guest.call("open", |s| self.0.sluice_connector_sink().committer().call_open(s, context(ctx), options, &tables))
    }

    fn evolve(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError> {
        let changes = self::changes(changes);
        guest.call("evolve", |s| self.0.sluice_connector_sink().committer().call_evolve(s, h, &changes))
    }

    fn combine(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, infos: &[&[u8]]) -> Result<Vec<u8>, PluginError> {
        guest.call("combine", |s| self.0.sluice_connector_sink().committer().call_combine(s, h, c, infos))
    }

    fn commit(
        &self,
        guest: &mut Guest<'_>,
        h: ResourceAny,
        c: u64,
        combined: &[u8],
    ) -> Result<CommitOutcome, PluginError> {
        guest.call("commit", |s| self.0.sluice_connector_sink().committer().call_commit(s, h, c, combined))
    }

    fn abort(&self, guest: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<(), PluginError> {
        guest.call("abort", |s| self.0.sluice_connector_sink().committer().call_abort(s, h, c, combined))
    }
}
