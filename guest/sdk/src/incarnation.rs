//! The job incarnation, from the sink context.
//!
//! A state directory's first run makes a random incarnation id. A plugin
//! that keys everything it writes with `(job, sink, incarnation, checkpoint)`
//! never takes a checkpoint of an earlier incarnation (a job started over in
//! a fresh state directory, whose checkpoint ids start at 1 again) for its
//! own. On the first run of a fresh state directory the context also asks
//! the committer to refuse a target that already holds another incarnation's
//! checkpoints of this job and sink ([`SinkContext::refuse_other_incarnations`]).

use crate::{SinkContext, SinkError, error};

/// `job.sink.incarnation`: a prefix for names that must be unique per
/// incarnation. Job and sink ids hold no `.`, so the parts never run
/// together.
pub fn key(ctx: &SinkContext) -> String {
    if ctx.incarnation.is_empty() {
        format!("{}.{}", ctx.job_id, ctx.sink_id)
    } else {
        format!("{}.{}.{}", ctx.job_id, ctx.sink_id, ctx.incarnation)
    }
}

/// The error that stops a fresh state directory's first run when `target`
/// already holds `what` of another incarnation (`found`; `None`: written
/// before incarnations existed).
pub fn refuse(ctx: &SinkContext, target: &str, what: &str, found: Option<&str>) -> SinkError {
    let earlier = match found {
        Some(id) => format!("incarnation {id}"),
        None => "an incarnation from before incarnation ids".to_string(),
    };
    error::config(format!(
        "job `{}` sink `{}`: {target} already holds {what} of {earlier} of this job, and this run starts \
         incarnation {} in a fresh state directory. To go on with that job, point job.state_dir at its state \
         directory. To land the source again beside what is there, run `sluice run --new-incarnation`",
        ctx.job_id, ctx.sink_id, ctx.incarnation,
    ))
}
