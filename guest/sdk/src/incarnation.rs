//! The job incarnation, from the options the host hands a plugin that
//! declares them (the host's `plugin::reserved` documents the contract).
//!
//! A state directory's first run makes a random incarnation id. A plugin
//! that keys everything it writes with `(job, sink, incarnation,
//! checkpoint)` never takes a checkpoint of an earlier incarnation (a job
//! started over in a fresh state directory) for its own. On the first run of
//! a fresh state directory the host also asks the plugin to refuse a target
//! that already holds another incarnation's checkpoints of this job and sink.

use crate::options::Options;
use crate::{OptionSpec, SinkContext, SinkError, error, option_spec};

/// The incarnation id of the job's state directory.
pub const INCARNATION: &str = "sluice.incarnation";
/// `refuse` or `accept` another incarnation's checkpoints in the target.
pub const OTHER_INCARNATIONS: &str = "sluice.other-incarnations";

/// The spec a plugin adds to its own to receive the incarnation id.
pub fn id_spec() -> OptionSpec {
    option_spec(INCARNATION, "set by the host: the incarnation id of the job's state directory", false, None)
}

/// The spec a plugin adds when it can check its target for checkpoints of
/// other incarnations.
pub fn check_spec() -> OptionSpec {
    option_spec(
        OTHER_INCARNATIONS,
        "set by the host: `refuse` when a fresh state directory must not meet another incarnation's checkpoints",
        false,
        None,
    )
}

/// This run's incarnation, as the host handed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Incarnation {
    /// `None` when the host passed none (a host older than incarnations):
    /// the plugin then keys by job, sink and checkpoint alone.
    pub id: Option<String>,
    /// Stop before writing when the target holds checkpoints of this job and
    /// sink from another incarnation.
    pub refuse_others: bool,
}

impl Incarnation {
    pub fn from_options(opts: &Options) -> Result<Self, SinkError> {
        let id = match opts.get(INCARNATION) {
            None => None,
            Some(id) if !id.is_empty() && id.len() <= 64 && id.chars().all(|c| c.is_ascii_alphanumeric()) => {
                Some(id.to_string())
            }
            Some(other) => {
                return Err(error::config(format!("option `{INCARNATION}` = {other:?} is not an incarnation id")));
            }
        };
        let refuse_others = match opts.get(OTHER_INCARNATIONS) {
            None | Some("accept") => false,
            Some("refuse") => true,
            Some(other) => {
                return Err(error::config(format!(
                    "option `{OTHER_INCARNATIONS}` = {other:?} must be `refuse` or `accept`"
                )));
            }
        };
        Ok(Self { id, refuse_others })
    }

    /// `job.sink` or `job.sink.incarnation`: a prefix for names that must be
    /// unique per incarnation. Job and sink ids hold no `.`, so the parts
    /// never run together.
    pub fn key(&self, ctx: &SinkContext) -> String {
        match &self.id {
            Some(id) => format!("{}.{}.{id}", ctx.job_id, ctx.sink_id),
            None => format!("{}.{}", ctx.job_id, ctx.sink_id),
        }
    }

    /// The error that stops a fresh state directory's first run when the
    /// target already holds `what` of another incarnation (`found`; `None`:
    /// written before incarnations existed).
    pub fn refuse(&self, ctx: &SinkContext, target: &str, what: &str, found: Option<&str>) -> SinkError {
        let earlier = match found {
            Some(id) => format!("incarnation {id}"),
            None => "an incarnation from before incarnation ids".to_string(),
        };
        error::config(format!(
            "job `{}` sink `{}`: {target} already holds {what} of {earlier} of this job, and this run starts \
             incarnation {} in a fresh state directory. To go on with that job, point job.state_dir at its state \
             directory. To land the source again beside what is there, run `sluice run --new-incarnation`",
            ctx.job_id,
            ctx.sink_id,
            self.id.as_deref().unwrap_or("(none)"),
        ))
    }
}
