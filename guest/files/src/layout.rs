//! Where the files sink puts things. One place, so writer and committer agree.

use sluice_guest_sdk::SinkContext;
use sluice_guest_sdk::files::join;

use crate::Config;

/// Root of everything this job's sink stages.
pub fn staging_root(cfg: &Config, ctx: &SinkContext) -> String {
    join(&cfg.staging, &format!("{}.{}", ctx.job_id, ctx.sink_id))
}

pub fn attempt_dir(cfg: &Config, ctx: &SinkContext, attempt: u32) -> String {
    join(&staging_root(cfg, ctx), &format!("attempt-{attempt}"))
}

/// Where a writer streams its open files.
pub fn inprogress_dir(cfg: &Config, ctx: &SinkContext) -> String {
    join(&attempt_dir(cfg, ctx, ctx.attempt), "inprogress")
}

/// Where a checkpoint's finished files wait for the commit.
pub fn checkpoint_staging_dir(cfg: &Config, ctx: &SinkContext, c: u64) -> String {
    join(&attempt_dir(cfg, ctx, ctx.attempt), &format!("c{c:010}"))
}

/// The visible directory of checkpoint `c`: derived from job, sink and `c`
/// only, never from the attempt, so a re-commit finds it.
pub fn visible_dir(cfg: &Config, ctx: &SinkContext, c: u64) -> String {
    join(&cfg.path, &format!("{}.{}.c{c:010}", ctx.job_id, ctx.sink_id))
}

pub fn file_name(subtask: u32, seq: u64) -> String {
    format!("part-{subtask:04}-{seq:06}.parquet")
}

pub fn subtask_prefix(subtask: u32) -> String {
    format!("part-{subtask:04}-")
}
