//! Contract 0.2, the newest: every call is served as it is, the host's
//! types borrowed into the bindings' own.

use wasmtime::component::ResourceAny;

use super::{Failure, Opening};
use crate::instance::Guest;
use crate::{ChangeKind, PluginError, SinkCtx, SourceTable, TableChange};
use sluice_capability::bindings::{CommitOutcome, PluginInfo, v0_2, v0_2_state};

failure_from!(v0_2);
failure_from!(v0_2_state);

/// The bindings of a 0.2 instance: its `sink` export, and its
/// `committer-state` export (0.2.3) when it has one, both of one instance.
pub(super) struct Adapter(pub(super) v0_2::SinkPlugin, pub(super) Option<v0_2_state::CommitterStateHolder>);

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
    same_calls!();

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

    fn validate(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<(), PluginError> {
        let (ctx, options) = (open.ctx, open.options);
        let tables = self::tables(open.tables);
        guest.call("validate", |s| self.0.sluice_connector_sink().call_validate(s, context(ctx), options, &tables))
    }

    fn open_writer(
        &self,
        guest: &mut Guest<'_>,
        open: &Opening<'_>,
        restored: Option<&[u8]>,
    ) -> Result<ResourceAny, PluginError> {
        let (ctx, options) = (open.ctx, open.options);
        let tables = self::tables(open.tables);
        guest.call("open", |s| {
            self.0.sluice_connector_sink().writer().call_open(s, context(ctx), options, &tables, restored)
        })
    }

    fn write(&self, guest: &mut Guest<'_>, h: ResourceAny, table: &str, batch: &[u8]) -> Result<(), PluginError> {
        guest.call("write", |s| self.0.sluice_connector_sink().writer().call_write(s, h, table, batch))
    }

    fn apply_changes(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError> {
        let changes = self::changes(changes);
        guest.call("apply-changes", |s| self.0.sluice_connector_sink().writer().call_apply_changes(s, h, &changes))
    }

    fn open_committer(&self, guest: &mut Guest<'_>, open: &Opening<'_>) -> Result<ResourceAny, PluginError> {
        let (ctx, options) = (open.ctx, open.options);
        let tables = self::tables(open.tables);
        guest.call("open", |s| self.0.sluice_connector_sink().committer().call_open(s, context(ctx), options, &tables))
    }

    fn evolve(&self, guest: &mut Guest<'_>, h: ResourceAny, changes: &[TableChange]) -> Result<(), PluginError> {
        let changes = self::changes(changes);
        guest.call("evolve", |s| self.0.sluice_connector_sink().committer().call_evolve(s, h, &changes))
    }

    fn commit(&self, g: &mut Guest<'_>, h: ResourceAny, c: u64, combined: &[u8]) -> Result<CommitOutcome, PluginError> {
        g.call("commit", |s| self.0.sluice_connector_sink().committer().call_commit(s, h, c, combined))
    }

    fn keeps_state(&self) -> bool {
        self.1.is_some()
    }

    fn restore_state(&self, guest: &mut Guest<'_>, state: Option<&[u8]>) -> Result<(), PluginError> {
        let Some(holder) = &self.1 else { return Ok(()) };
        guest.call("committer-state.restore", |s| holder.sluice_connector_committer_state().call_restore(s, state))
    }

    fn snapshot_committer_state(&self, guest: &mut Guest<'_>, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        let Some(holder) = &self.1 else { return Ok(None) };
        guest
            .call("committer-state.snapshot", |s| holder.sluice_connector_committer_state().call_snapshot(s, c))
            .map(Some)
    }

    fn finish(&self, guest: &mut Guest<'_>, c: u64) -> Result<Option<Vec<u8>>, PluginError> {
        let Some(holder) = &self.1 else { return Ok(None) };
        guest.call("committer-state.finish", |s| holder.sluice_connector_committer_state().call_finish(s, c))
    }
}
