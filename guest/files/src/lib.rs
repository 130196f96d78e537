//! `files`: the reference Sluice sink. Lands Parquet files exactly once.
//!
//! Layout (all through the `file-io` capability, inside the granted locations):
//! - a writer streams each table's rows into
//!   `<staging>/<key>/attempt-<a>/inprogress/<table>/part-<subtask>-<seq>.parquet`,
//!   where `<key>` is `<job>.<sink>.<incarnation>` (see `layout`);
//! - `prepare-commit(c)` closes the open files and moves the writer's finished
//!   files into `<staging>/<key>/attempt-<a>/c<c>/<table>/` (still invisible);
//! - the committer makes checkpoint `c` visible with **one** atomic directory
//!   rename per table, to `<path>/<key>.c<c>/` (the single table) or
//!   `<path>/<table>/<key>.c<c>/`.
//!
//! Invariants:
//! - nothing under `<path>` is ever written except by those renames, so a
//!   reader of a table's directory sees whole checkpoints or nothing;
//! - a checkpoint is committed table by table, and a table whose directory
//!   is visible already is left alone, so a re-commit after a crash between
//!   two renames finishes the rest;
//! - each checkpoint's files carry their own schema, so a table whose schema
//!   evolves needs nothing changed in the output;
//! - the visible directory name is derived from job, sink, incarnation and
//!   checkpoint only, so a repeated commit finds it and answers
//!   `already-committed`, and a job started over in a fresh state directory
//!   (a new incarnation) never finds an earlier incarnation's directory;
//! - a fresh state directory's first run refuses a `<path>` that holds
//!   another incarnation's checkpoints of this job and sink, before writing;
//! - `<path>/_sluice_claim.<job>.<sink>.json` names the one incarnation that may
//!   publish there: created exclusively before its first rename, never
//!   replaced, and checked by every committer (see `layout::claim`), so two
//!   fresh runs started at once never both publish;
//! - staging names carry the run attempt, so a restarted run never mixes its
//!   files with what a crashed run left behind;
//! - `close` publishes nothing: rows no checkpoint covers stay in staging.

mod committer;
mod layout;
mod writer;

use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{
    Guest, OptionSpec, PluginInfo, SinkContext, SinkError, Table, claim, error, files, option_spec,
};

pub(crate) const NAME: &str = "files";

pub(crate) fn option_specs() -> Vec<OptionSpec> {
    vec![
        option_spec(
            "path",
            "location of the visible output directory; each committed checkpoint becomes one sub-directory of Parquet files",
            true,
            None,
        ),
        option_spec(
            "staging_path",
            "location where uncommitted files are staged; must be on the same filesystem as `path` and outside it, so that no reader globbing `path` sees staged files (default: `<path>.staging`)",
            false,
            None,
        ),
        option_spec(
            "target_file_mb",
            "roll to a new Parquet file once the current one reaches this many MiB",
            false,
            Some("128"),
        ),
        option_spec("compression", "Parquet compression codec: `snappy` or `none`", false, Some("snappy")),
        claim::option_spec(),
    ]
}

/// Options of the sink, parsed once.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub path: String,
    pub staging: String,
    pub target_file_bytes: u64,
    pub compression: parquet::basic::Compression,
    /// How this incarnation treats the output's claim.
    pub claim: claim::Mode,
}

impl Config {
    pub fn parse(raw: Vec<(String, String)>) -> Result<Self, SinkError> {
        let opts = Options::parse(raw, &option_specs())?;
        let path = opts.required("path")?.trim_end_matches('/').to_string();
        if path.is_empty() {
            return Err(error::config("option `path` must not be empty"));
        }
        let staging = opts
            .get("staging_path")
            .map(|s| s.trim_end_matches('/').to_string())
            .unwrap_or_else(|| format!("{path}.staging"));
        let target_mb: u64 = opts.parsed("target_file_mb")?.unwrap_or(128);
        if target_mb == 0 {
            return Err(error::config("option `target_file_mb` must be at least 1"));
        }
        let compression = match opts.required("compression")? {
            "snappy" => parquet::basic::Compression::SNAPPY,
            "none" => parquet::basic::Compression::UNCOMPRESSED,
            other => {
                return Err(error::config(format!(
                    "option `compression` = {other:?} is not supported; use `snappy` or `none`"
                )));
            }
        };
        let claim = claim::Mode::from_options(&opts)?;
        Ok(Self { path, staging, target_file_bytes: target_mb * 1024 * 1024, compression, claim })
    }
}

pub struct FilesSink;

impl Guest for FilesSink {
    type Writer = writer::FilesWriter;
    type Committer = committer::FilesCommitter;

    fn describe() -> PluginInfo {
        PluginInfo {
            name: NAME.to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            description: "Lands rows as Parquet files; each checkpoint becomes visible as one directory, atomically and exactly once".to_string(),
            options: option_specs(),
            capabilities: vec![
                "file-io: read-write on `path` and on `staging_path` (same filesystem)".to_string(),
            ],
            multi_table: true,
        }
    }

    fn describe_commit(_options: Vec<(String, String)>, combined: Vec<u8>) -> Vec<String> {
        committer::describe(&combined)
    }

    fn validate(ctx: SinkContext, options: Vec<(String, String)>, tables: Vec<Table>) -> Result<(), SinkError> {
        let cfg = Config::parse(options)?;
        for table in &tables {
            writer::table_writer(table)?;
        }
        for (what, location) in [("path", &cfg.path), ("staging_path", &cfg.staging)] {
            files::exists(location).map_err(|e| files::to_sink_error(&format!("option `{what}` ({location})"), e))?;
        }
        // What `committer.open` would refuse, `sluice check` refuses too.
        layout::refuse_if_claimed(&cfg, &ctx)?;
        probe_rename(&ctx, &cfg)
    }
}

/// Proves that a commit's rename from staging into the output can work: a
/// small file is written in `staging_path`, renamed into `path` and deleted.
/// A staging directory on another filesystem than the output is refused
/// here, by `sluice check`, instead of at the first commit. The probe's name
/// starts with a dot, so no reader of `*.parquet` ever lists it.
fn probe_rename(ctx: &SinkContext, cfg: &Config) -> Result<(), SinkError> {
    let name = format!(".sluice-probe-{}.{}", ctx.job_id, ctx.sink_id);
    let (from, to) = (files::join(&cfg.staging, &name), files::join(&cfg.path, &name));
    let io = |what: &str, e| files::to_sink_error(&format!("checking that commits can rename: {what}"), e);
    for dir in [&cfg.staging, &cfg.path] {
        files::create_dir_all(dir).map_err(|e| io(&format!("creating {dir}"), e))?;
    }
    // A probe left by an interrupted check.
    if files::exists(&to).map_err(|e| io("looking for an old probe", e))? {
        files::delete(&to).map_err(|e| io("removing an old probe", e))?;
    }
    files::write_file(&from, b"sluice rename probe\n", true).map_err(|e| io("writing a probe in staging_path", e))?;
    let renamed = files::rename(&from, &to);
    let cleanup = if renamed.is_ok() { &to } else { &from };
    if let Err(e) = files::delete(cleanup) {
        sluice_guest_sdk::log::warn(&format!("could not remove the rename probe {cleanup}: {}", files::describe(&e)));
    }
    match renamed {
        Ok(()) => Ok(()),
        Err(e) => {
            let text = files::describe(&e);
            if text.contains(CROSS_DEVICE) {
                Err(error::config(format!(
                    "option `staging_path` ({}) is on another filesystem than option `path` ({}): each commit makes a \
                     checkpoint visible by renaming its directory from staging into the output, and a rename cannot \
                     cross filesystems; put staging_path on the filesystem of path (the default, `<path>.staging`, \
                     is beside it) [{text}]",
                    cfg.staging, cfg.path
                )))
            } else {
                Err(io(&format!("renaming {from} to {to}"), e))
            }
        }
    }
}

/// What the host's file-io says when a rename would cross filesystems.
const CROSS_DEVICE: &str = "different filesystems";

sluice_guest_sdk::export_plugin!(FilesSink);
