//! Where the files sink puts things. One place, so writer and committer agree.

use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{SinkContext, SinkError};

use crate::Config;

/// Root of everything this incarnation of the job's sink stages.
pub fn staging_root(cfg: &Config, ctx: &SinkContext) -> String {
    join(&cfg.staging, &cfg.incarnation.key(ctx))
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

/// The visible directory of checkpoint `c`: derived from job, sink,
/// incarnation and `c` only, never from the attempt, so a re-commit finds it.
pub fn visible_dir(cfg: &Config, ctx: &SinkContext, c: u64) -> String {
    join(&cfg.path, &format!("{}.c{c:010}", cfg.incarnation.key(ctx)))
}

/// The incarnation a visible directory name belongs to, when it is one of
/// this job and sink: `Some(Some(id))`, or `Some(None)` for a directory
/// written before incarnations (`<job>.<sink>.c<c>`).
fn incarnation_of<'a>(ctx: &SinkContext, name: &'a str) -> Option<Option<&'a str>> {
    let rest = name.strip_prefix(&format!("{}.{}.", ctx.job_id, ctx.sink_id))?;
    let is_checkpoint = |s: &str| s.len() == 11 && s.starts_with('c') && s[1..].bytes().all(|b| b.is_ascii_digit());
    if is_checkpoint(rest) {
        return Some(None);
    }
    let (id, checkpoint) = rest.split_once('.')?;
    is_checkpoint(checkpoint).then_some(Some(id))
}

/// Stops a fresh state directory's first run when `path` holds a committed
/// checkpoint of this job and sink from another incarnation.
pub fn refuse_other_incarnations(cfg: &Config, ctx: &SinkContext) -> Result<(), SinkError> {
    if !cfg.incarnation.refuse_others {
        return Ok(());
    }
    let names = match files::list_dir(&cfg.path) {
        Ok(names) => names,
        Err(sluice_guest_sdk::IoError::NotFound(_)) => return Ok(()),
        Err(e) => return Err(files::to_sink_error(&format!("listing {}", cfg.path), e)),
    };
    let ours = cfg.incarnation.id.as_deref();
    for name in &names {
        if let Some(found) = incarnation_of(ctx, name)
            && found != ours
        {
            let what = format!("committed checkpoints (e.g. {name})");
            return Err(cfg.incarnation.refuse(ctx, &cfg.path, &what, found));
        }
    }
    Ok(())
}

pub fn file_name(subtask: u32, seq: u64) -> String {
    format!("part-{subtask:04}-{seq:06}.parquet")
}

pub fn subtask_prefix(subtask: u32) -> String {
    format!("part-{subtask:04}-")
}
