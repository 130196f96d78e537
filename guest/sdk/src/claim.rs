//! The target's claim: which incarnation of a job's sink may land rows in a
//! target (a files sink's output directory, an Iceberg table, a BigQuery
//! dataset).
//!
//! Two fresh state directories started at once both begin a new incarnation,
//! and neither finds the other's checkpoints when it opens. So a check made
//! once at open is no guard; the claim is:
//! - a target is claimed by at most one incarnation of a job and sink, and
//!   the claim is taken by an atomic step of the target itself (an exclusive
//!   create, or the same atomic commit that publishes the data), never by a
//!   read followed by a write;
//! - an incarnation makes nothing visible in a target whose claim another
//!   incarnation holds; it fails with a `config` error naming the holder and
//!   the ways on ([`refused`]);
//! - a claim is never released or moved, so holding it once means holding it
//!   at every later commit;
//! - an incarnation started with `sluice run --new-incarnation` lands beside
//!   the others on purpose ([`Mode::Beside`]): it neither takes nor checks
//!   claims.
//!
//! The host hands the mode as the option [`OPTION`] to a plugin that
//! declares it ([`option_spec`]); a plugin that does not declare it gets
//! none, and the host says that it cannot keep two fresh runs apart.

use crate::options::Options;
use crate::{IoError, OptionSpec, SinkContext, SinkError, error, files, option_spec as spec};

/// The host's option carrying the claim mode (`exclusive` or `beside`).
pub const OPTION: &str = "sluice.claim";

/// How this incarnation treats the target's claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Take the claim when it is free, go on when this incarnation holds it,
    /// refuse when another holds it.
    Exclusive,
    /// Started with `--new-incarnation`: land beside the other incarnations.
    Beside,
}

/// The spec a plugin declares in `describe()` to be handed the mode.
pub fn option_spec() -> OptionSpec {
    spec(
        OPTION,
        "set by the host, not the job file: `exclusive` (the incarnation must hold the target's claim) or \
         `beside` (started with --new-incarnation)",
        false,
        Some("exclusive"),
    )
}

impl Mode {
    /// The mode in `opts` (parsed with [`option_spec`] among the specs).
    pub fn from_options(opts: &Options) -> Result<Self, SinkError> {
        match opts.get(OPTION).unwrap_or("exclusive") {
            "exclusive" => Ok(Mode::Exclusive),
            "beside" => Ok(Mode::Beside),
            other => Err(error::config(format!("option `{OPTION}` = {other:?}: expected `exclusive` or `beside`"))),
        }
    }
}

/// What the holder found in a target means for this incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Nobody holds the target: take the claim in the step that publishes.
    Free,
    /// This incarnation holds it (or lands beside): go on.
    Ours,
    /// Another incarnation holds it.
    Theirs(String),
}

/// Judges `holder`, the incarnation that holds the target's claim, if any.
pub fn judge(ctx: &SinkContext, mode: Mode, holder: Option<&str>) -> Verdict {
    match (mode, holder) {
        (Mode::Beside, _) => Verdict::Ours,
        (Mode::Exclusive, None) => Verdict::Free,
        (Mode::Exclusive, Some(h)) if h == ctx.incarnation => Verdict::Ours,
        (Mode::Exclusive, Some(h)) => Verdict::Theirs(h.to_string()),
    }
}

/// The error of an incarnation that finds `target` claimed by `holder`.
pub fn refused(ctx: &SinkContext, target: &str, holder: &str) -> SinkError {
    error::config(format!(
        "job `{}` sink `{}`: {target} is claimed by incarnation {holder} of this job, which took the claim at \
         its first commit there; only it lands rows there. This run belongs to incarnation {} and has made none \
         of its rows visible there. To go on with incarnation {holder}, point job.state_dir at its state \
         directory. To land the source again beside it, start over in a new job.state_dir with `sluice run \
         --new-incarnation`",
        ctx.job_id, ctx.sink_id, ctx.incarnation,
    ))
}

/// The error of an incarnation that finds `target` unclaimed but holding
/// checkpoints of another incarnation (`other`), none of its own: its claim
/// was removed, or it predates claims. Taking it would land the source twice.
pub fn refused_unclaimed(ctx: &SinkContext, target: &str, other: &str) -> SinkError {
    error::config(format!(
        "job `{}` sink `{}`: {target} holds committed checkpoints of {other} of this job but no claim, and none \
         of this run's incarnation {}: taking the claim now would land the source a second time. To go on with \
         that incarnation, point job.state_dir at its state directory. To land the source again beside it, start \
         over in a new job.state_dir with `sluice run --new-incarnation`",
        ctx.job_id, ctx.sink_id, ctx.incarnation,
    ))
}

/// [`judge`], with another holder turned into [`refused`]: `Ok(true)` when
/// the claim is free (to be taken), `Ok(false)` when it is ours.
pub fn check(ctx: &SinkContext, mode: Mode, target: &str, holder: Option<&str>) -> Result<bool, SinkError> {
    match judge(ctx, mode, holder) {
        Verdict::Free => Ok(true),
        Verdict::Ours => Ok(false),
        Verdict::Theirs(h) => Err(refused(ctx, target, &h)),
    }
}

/// What a claim file holds.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ClaimFile {
    job: String,
    sink: String,
    incarnation: String,
}

/// The largest claim file read (they hold a few ids).
const CLAIM_FILE_BYTES: u64 = 64 << 10;

/// The incarnation named by the claim file at `location`, if there is one.
pub fn file_holder(location: &str) -> Result<Option<String>, SinkError> {
    match files::read(location, 0, CLAIM_FILE_BYTES) {
        Ok(bytes) => {
            let claim: ClaimFile = serde_json::from_slice(&bytes).map_err(|e| {
                error::fatal(format!(
                    "claim file {location} is not valid ({e}); it names the incarnation of this job that may land \
                     here, so Sluice will not guess: restore it, or remove it only if no incarnation of this job \
                     landed rows here"
                ))
            })?;
            Ok(Some(claim.incarnation))
        }
        Err(IoError::NotFound(_)) => Ok(None),
        Err(e) => Err(files::to_sink_error(&format!("reading claim file {location}"), e)),
    }
}

/// Makes sure this incarnation may publish in `target`, whose claim is the
/// file at `location`: goes on when it holds the claim (or lands beside),
/// takes a free claim with an exclusive create, and refuses when another
/// incarnation holds it, or took it first in a race.
pub fn take_file(ctx: &SinkContext, mode: Mode, target: &str, location: &str) -> Result<(), SinkError> {
    if !check(ctx, mode, target, file_holder(location)?.as_deref())? {
        return Ok(());
    }
    let claim = ClaimFile { job: ctx.job_id.clone(), sink: ctx.sink_id.clone(), incarnation: ctx.incarnation.clone() };
    let bytes = serde_json::to_vec(&claim).map_err(|e| error::fatal(format!("encoding the claim: {e}")))?;
    if let Some((parent, _)) = location.rsplit_once('/') {
        files::create_dir_all(parent).map_err(|e| files::to_sink_error(&format!("creating {parent}"), e))?;
    }
    match files::write_file(location, &bytes, false) {
        Ok(()) => {
            crate::log::info(&format!("incarnation {} claimed {target} ({location})", ctx.incarnation));
            Ok(())
        }
        // Another incarnation created it between the read and the create.
        Err(IoError::AlreadyExists(_)) => match file_holder(location)? {
            Some(holder) => check(ctx, mode, target, Some(&holder)).map(|_| ()),
            None => Err(error::retryable(format!("claim file {location} was created and removed meanwhile"))),
        },
        Err(e) => Err(files::to_sink_error(&format!("creating claim file {location}"), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(incarnation: &str) -> SinkContext {
        SinkContext {
            job_id: "j".into(),
            sink_id: "s".into(),
            incarnation: incarnation.into(),
            refuse_other_incarnations: false,
            subtask: 0,
            parallelism: 1,
            attempt: 1,
        }
    }

    #[test]
    fn only_the_holder_goes_on_and_beside_ignores_claims() {
        let ours = ctx("aaa");
        assert_eq!(judge(&ours, Mode::Exclusive, None), Verdict::Free);
        assert_eq!(judge(&ours, Mode::Exclusive, Some("aaa")), Verdict::Ours);
        assert_eq!(judge(&ours, Mode::Exclusive, Some("bbb")), Verdict::Theirs("bbb".into()));
        assert_eq!(judge(&ours, Mode::Beside, Some("bbb")), Verdict::Ours);
        assert_eq!(judge(&ours, Mode::Beside, None), Verdict::Ours);
        let SinkError::Config(message) = check(&ours, Mode::Exclusive, "table t", Some("bbb")).unwrap_err() else {
            panic!("a config error")
        };
        for part in ["table t is claimed by incarnation bbb", "incarnation aaa ", "--new-incarnation", "job.state_dir"]
        {
            assert!(message.contains(part), "{part:?} in {message}");
        }
    }

    #[test]
    fn the_mode_is_parsed_strictly() {
        let parse = |v: Option<&str>| {
            let raw = v.map(|v| vec![(OPTION.to_string(), v.to_string())]).unwrap_or_default();
            Mode::from_options(&Options::parse(raw, &[option_spec()])?)
        };
        assert_eq!(parse(None).ok(), Some(Mode::Exclusive));
        assert_eq!(parse(Some("beside")).ok(), Some(Mode::Beside));
        assert!(parse(Some("Beside")).is_err());
    }
}
