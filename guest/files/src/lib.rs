//! `files`: the reference Sluice sink. Lands Parquet files exactly once.
//!
//! Two ways to publish, chosen by where `path` lies ([`Publish`]):
//!
//! **A local directory** (a path or `file://`), by rename:
//! - a writer streams each table's rows into
//!   `<staging>/<key>/attempt-<a>/inprogress/<table>/part-<subtask>-<seq>.parquet`,
//!   where `<key>` is `<job>.<sink>.<incarnation>` (see `layout`);
//! - `prepare-commit(c)` closes the open files and moves the writer's finished
//!   files into `<staging>/<key>/attempt-<a>/c<c>/<table>/` (still invisible);
//! - the committer makes checkpoint `c` visible with **one** atomic directory
//!   rename per table, to `<path>/<key>.c<c>/` (the single table) or
//!   `<path>/<table>/<key>.c<c>/`.
//!
//! **An object store** (`s3://`, `gs://`), which has no atomic rename, by a
//! commit marker:
//! - a writer streams each data object once, under its final name
//!   `<path>/_sluice_data/<key>/attempt-<a>/<table>/part-<subtask>-<seq>.parquet`
//!   (an exclusive create on S3; GCS cannot stream one, so there the name
//!   is unique by construction and checked free before the upload starts),
//!   and nothing moves it afterwards;
//! - the committer makes checkpoint `c` of a table visible by creating
//!   **one** marker object exclusively (`If-None-Match: *` /
//!   `ifGenerationMatch=0`): `<path>/<key>.c<c>.json` (the single table) or
//!   `<path>/<table>/<key>.c<c>.json`, naming every data object of the
//!   checkpoint with its rows and bytes ([`committer::Marker`]);
//! - readers follow the markers: **a data object counts only if a marker
//!   names it**; objects under `_sluice_data/` that no marker names are a
//!   crashed attempt's leftovers, never output.
//!
//! **`mode = "overwrite-partitions"`** (local or object store), by a
//! version log: data files are written once under the table's
//! `_sluice_data/`, and each commit of a table creates the next version
//! `<table dir>/_sluice_log/<version:020>.json` exclusively, which names
//! the live part list of every partition (see `versions`); the rows a run
//! lands replace the partitions they touch. Readers follow the newest
//! version; nothing else under the table counts.
//!
//! `partition_by` (identity columns) puts each partition's files under
//! Hive-style `col=value/` folders, in every mode (see `partition`).
//!
//! Invariants (every way):
//! - nothing under `<path>` becomes committed output except by those renames,
//!   marker creates or version creates, so a reader sees whole checkpoints
//!   or nothing;
//! - a table directory holds one layout: append's directories or markers,
//!   or an overwrite log, never both (`layout::refuse_mixed_layouts`);
//! - a checkpoint is committed table by table, and a table whose directory
//!   or marker is visible already (or whose log's newest version holds the
//!   checkpoint) is left alone, so a re-commit after a
//!   crash between two tables finishes the rest, and a rerun of a committed
//!   checkpoint adds nothing;
//! - each checkpoint's files carry their own schema, so a table whose schema
//!   evolves needs nothing changed in the output;
//! - the visible directory or marker name is derived from job, sink,
//!   incarnation and checkpoint only, so a repeated commit finds it and
//!   answers `already-committed`, and a job started over in a fresh state
//!   directory (a new incarnation) never finds an earlier incarnation's;
//! - a fresh state directory's first run refuses a `<path>` that holds
//!   another incarnation's checkpoints of this job and sink, before writing;
//! - `<path>/_sluice_claim.<job>.<sink>.json` names the one incarnation that may
//!   publish there: created exclusively before its first publish, never
//!   replaced, and checked by every committer (see `layout::claim`), so two
//!   fresh runs started at once never both publish;
//! - staging and data names carry the run attempt, so a restarted run never
//!   mixes its files with what a crashed run left behind, and a data object
//!   named by a persisted checkpoint is never written again or deleted;
//! - `close` publishes nothing: rows no checkpoint covers stay unpublished.

mod committer;
mod layout;
mod partition;
mod versions;
mod writer;

use sluice_guest_sdk::columnar::Compression;
use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{
    Guest, OptionSpec, PluginInfo, SinkContext, SinkError, Table, claim, error, files, option_spec,
};

pub(crate) const NAME: &str = "files";

pub(crate) fn option_specs() -> Vec<OptionSpec> {
    vec![
        option_spec(
            "path",
            "location of the output: a local directory (each committed checkpoint becomes one sub-directory of \
             Parquet files) or `s3://bucket/prefix` / `gs://bucket/prefix` (each committed checkpoint becomes one \
             commit-marker object naming its Parquet objects)",
            true,
            None,
        ),
        option_spec(
            "staging_path",
            "local output only: location where uncommitted files are staged; must be on the same filesystem as `path` and outside it, so that no reader globbing `path` sees staged files (default: `<path>.staging`)",
            false,
            None,
        ),
        option_spec(
            "target_file_mb",
            "roll to a new Parquet file once the current one reaches this many MiB",
            false,
            Some("128"),
        ),
        option_spec("compression", "Parquet compression codec: `snappy`, `zstd` or `none`", false, Some("snappy")),
        option_spec(
            "partition_by",
            "identity columns to partition by, e.g. `day` or `region, day`: each partition's files go under Hive-style \
             `col=value/` directories (dates and timestamps in ISO 8601); default: unpartitioned",
            false,
            None,
        ),
        option_spec(
            "mode",
            "`append` (every checkpoint adds files) or `overwrite-partitions` (the rows a run lands replace every \
             partition they touch; the table is then published through a version log, `<table>/_sluice_log/`, that \
             readers must follow: see \"Reading an overwrite table\" in the files sink's docs)",
            false,
            Some("append"),
        ),
        option_spec(
            DEAD_LETTER_TABLE,
            "set by the host, not the job file: the job's dead-letter table, which is never partitioned and always \
             takes appends",
            false,
            None,
        ),
        claim::option_spec(),
    ]
}

/// How a checkpoint is made visible, decided by the scheme of `path` (so it
/// needs nothing of the host beyond `file-io`, and works on every host that
/// serves object-store grants).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Publish {
    /// A local directory: one atomic directory rename per table.
    Rename,
    /// An object store, which has no atomic rename: one commit-marker object
    /// per table, created exclusively. `exclusive_data`: whether data objects
    /// can be streamed with an exclusive create (S3 can; opendal's GCS
    /// uploads in parts carry no precondition, see docs/contract.md).
    Marker { exclusive_data: bool },
    /// `mode = "overwrite-partitions"`, local or object store: data files
    /// are written once under the table's `_sluice_data/`, and each commit
    /// of a table creates the next version of its log exclusively (see
    /// `versions`). `exclusive_data` as for `Marker`.
    Log { exclusive_data: bool },
}

impl Publish {
    /// The way to publish at `location`: `s3://` and `gs://` (any case) are
    /// object stores; anything else is local (the host refuses other schemes).
    pub fn of(location: &str) -> Publish {
        match location.split_once("://").map(|(scheme, _)| scheme.to_ascii_lowercase()) {
            Some(scheme) if scheme == "s3" => Publish::Marker { exclusive_data: true },
            Some(scheme) if scheme == "gs" => Publish::Marker { exclusive_data: false },
            _ => Publish::Rename,
        }
    }

    /// Whether data files are written where they stay (not staged and renamed).
    pub fn in_place(self) -> bool {
        self != Publish::Rename
    }

    /// Whether a data file can be streamed with an exclusive create.
    pub fn exclusive_data(self) -> bool {
        match self {
            Publish::Rename => true,
            Publish::Marker { exclusive_data } | Publish::Log { exclusive_data } => exclusive_data,
        }
    }
}

pub(crate) use sluice_guest_sdk::reserved::DEAD_LETTER_TABLE;

/// Where data objects live under `path` on an object store.
pub(crate) const DATA_DIR: &str = "_sluice_data";

/// Options of the sink, parsed once.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub path: String,
    /// Local output: the staging directory. Object stores: `<path>/_sluice_data`,
    /// where data objects are written once under their final names.
    pub staging: String,
    pub publish: Publish,
    pub target_file_bytes: u64,
    /// Encoded by the host (the `columnar` capability).
    pub compression: Compression,
    /// How this incarnation treats the output's claim.
    pub claim: claim::Mode,
    /// `partition_by`: identity columns, in order (empty: unpartitioned).
    pub partition_by: Vec<String>,
    /// `mode = "overwrite-partitions"` (then `publish` is [`Publish::Log`]).
    pub overwrite: bool,
    /// The job's dead-letter table: unpartitioned, and only ever added to
    /// (in overwrite mode it is published through a log all the same, so
    /// the output holds one layout, but no commit replaces anything in it).
    pub dead_letter_table: Option<String>,
}

impl Config {
    /// The `partition_by` columns of `table` (none for the dead-letter table,
    /// whose rows have the dead-letter schema).
    pub fn partition_by_for(&self, table: &str) -> &[String] {
        if self.dead_letter_table.as_deref() == Some(table) { &[] } else { &self.partition_by }
    }

    /// Whether commits may replace partitions of `table`.
    pub fn replaces(&self, table: &str) -> bool {
        self.overwrite && self.dead_letter_table.as_deref() != Some(table)
    }
}

impl Config {
    pub fn parse(raw: Vec<(String, String)>) -> Result<Self, SinkError> {
        let opts = Options::parse(raw, &option_specs())?;
        let path = opts.required("path")?.trim_end_matches('/').to_string();
        if path.is_empty() {
            return Err(error::config("option `path` must not be empty"));
        }
        let overwrite = match opts.get("mode").unwrap_or("append") {
            "append" => false,
            "overwrite-partitions" => true,
            other => {
                return Err(error::config(format!(
                    "[sink.options] mode = {other:?} is not a mode of the files sink; use \"append\" (the default) or \
                     \"overwrite-partitions\""
                )));
            }
        };
        let partition_by = match opts.get("partition_by") {
            Some(raw) => partition::parse(raw)?,
            None => Vec::new(),
        };
        if !partition_by.is_empty() && matches!(Publish::of(&path), Publish::Marker { exclusive_data: false }) {
            // The host's non-exclusive GCS uploads go through opendal 0.57,
            // which percent-encodes the object name twice (`=` is stored as
            // `%3D`), so a `col=value/` folder does not hold what a commit
            // names. Refused before writing until the host encodes once.
            return Err(error::config(format!(
                "option `partition_by` is not served on GCS yet ({path}): the `col=value/` folders are not stored \
                 under the names written (the upload encodes `=` twice), so commits could not find their files; \
                 write unpartitioned on GCS, or partitioned to s3:// or a local path"
            )));
        }
        let publish = match Publish::of(&path) {
            Publish::Marker { exclusive_data } if overwrite => Publish::Log { exclusive_data },
            Publish::Rename if overwrite => Publish::Log { exclusive_data: true },
            publish => publish,
        };
        let given = opts.get("staging_path").map(|s| s.trim_end_matches('/').to_string());
        let staging = match (publish, given) {
            (Publish::Log { .. }, Some(staging)) => {
                return Err(error::config(format!(
                    "option `staging_path` ({staging}) does not apply with [sink.options] mode = \
                     \"overwrite-partitions\": each data file is written once under the table's `{DATA_DIR}/` in \
                     `{path}` and a commit creates the next version of the table's log, so nothing is staged or \
                     renamed; remove the option"
                )));
            }
            (Publish::Log { .. }, None) => files::join(&path, DATA_DIR),
            (Publish::Marker { .. }, Some(staging)) => {
                return Err(error::config(format!(
                    "option `staging_path` ({staging}) is for a local `path` only: on an object store ({path}) the \
                     files sink writes each data object once under `{path}/{DATA_DIR}/` and publishes a checkpoint \
                     by creating a commit marker, so nothing is staged or renamed; remove the option"
                )));
            }
            (Publish::Marker { .. }, None) => files::join(&path, DATA_DIR),
            (Publish::Rename, Some(staging)) if Publish::of(&staging) != Publish::Rename => {
                return Err(error::config(format!(
                    "option `staging_path` ({staging}) is on an object store and option `path` ({path}) is local: \
                     a commit renames from staging into the output, and nothing can be renamed out of an object \
                     store; stage beside the output (the default, `<path>.staging`), or put `path` on the object \
                     store too"
                )));
            }
            (Publish::Rename, Some(staging)) => staging,
            (Publish::Rename, None) => format!("{path}.staging"),
        };
        let target_mb: u64 = opts.parsed("target_file_mb")?.unwrap_or(128);
        if target_mb == 0 {
            return Err(error::config("option `target_file_mb` must be at least 1"));
        }
        let compression = match opts.required("compression")? {
            "snappy" => Compression::Snappy,
            "zstd" => Compression::Zstd,
            "none" => Compression::Uncompressed,
            other => {
                return Err(error::config(format!(
                    "option `compression` = {other:?} is not supported; use `snappy`, `zstd` or `none`"
                )));
            }
        };
        let claim = claim::Mode::from_options(&opts)?;
        let dead_letter_table = opts.get(DEAD_LETTER_TABLE).map(str::to_string);
        Ok(Self {
            path,
            staging,
            publish,
            target_file_bytes: target_mb * 1024 * 1024,
            compression,
            claim,
            partition_by,
            overwrite,
            dead_letter_table,
        })
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
            description: "Lands rows as Parquet files; each checkpoint becomes visible as one directory (or, on an object store, one commit marker), atomically and exactly once".to_string(),
            options: option_specs(),
            capabilities: vec![
                "file-io: read-write on `path` and, for a local `path`, on `staging_path` (same filesystem)".to_string(),
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
            writer::table_writer(&cfg, table)?;
        }
        let checked: &[(&str, &String)] = match cfg.publish {
            Publish::Rename => &[("path", &cfg.path), ("staging_path", &cfg.staging)],
            Publish::Marker { .. } | Publish::Log { .. } => &[("path", &cfg.path)],
        };
        for (what, location) in checked {
            files::exists(location).map_err(|e| files::to_sink_error(&format!("option `{what}` ({location})"), e))?;
        }
        // What `committer.open` would refuse, `sluice check` refuses too.
        layout::refuse_if_claimed(&cfg, &ctx)?;
        let names: Vec<String> = tables.iter().map(|t| t.name.clone()).collect();
        layout::refuse_mixed_layouts(&cfg, &names)?;
        match cfg.publish {
            Publish::Rename => probe_rename(&ctx, &cfg),
            Publish::Marker { .. } | Publish::Log { .. } => probe_create(&ctx, &cfg),
        }
    }
}

/// The probe's name: it starts with a dot, so no reader of `*.parquet` (nor
/// a marker-following reader) ever takes it for data.
fn probe_name(ctx: &SinkContext) -> String {
    format!(".sluice-probe-{}.{}", ctx.job_id, ctx.sink_id)
}

/// Proves on an object store that a commit can create its marker: a small
/// object is created exclusively under `path` (in overwrite mode, twice:
/// the second create must be refused as `already-exists`) and deleted. Missing
/// credentials, a missing bucket or a read-only grant are refused here, by
/// `sluice check`, instead of at the first commit.
fn probe_create(ctx: &SinkContext, cfg: &Config) -> Result<(), SinkError> {
    let probe = files::join(&cfg.path, &probe_name(ctx));
    let io = |what: &str, e| files::to_sink_error(&format!("checking that commits can create markers: {what}"), e);
    let create = || files::write_file(&probe, b"sluice create probe\n", false);
    match create() {
        Ok(()) => {}
        // A probe left by an interrupted check.
        Err(sluice_guest_sdk::IoError::AlreadyExists(_)) => {
            files::delete(&probe).map_err(|e| io("removing an old probe", e))?;
            create().map_err(|e| io(&format!("creating {probe}"), e))?;
        }
        Err(e) => return Err(io(&format!("creating {probe}"), e)),
    }
    // Overwrite mode's log takes each version number by an exclusive create
    // and relies on a taken number being refused: a store that lets a
    // second exclusive create replace the first would let two writers both
    // take one version, and one's commit would vanish.
    let exclusive = if cfg.overwrite {
        match create() {
            Err(sluice_guest_sdk::IoError::AlreadyExists(_)) => Ok(()),
            Ok(()) => Err(error::config(format!(
                "[sink.options] mode = \"overwrite-partitions\": the store at option `path` ({}) let an exclusive \
                 create of {probe} succeed over an object that was there (a second `If-None-Match: *` / \
                 `ifGenerationMatch=0` create was not refused), so it cannot guard the table's version log: two \
                 writers could both take one version and one's commit would be lost. Use a store that enforces \
                 conditional creates",
                cfg.path
            ))),
            Err(e) => Err(io(&format!("creating {probe} a second time, to see it refused"), e)),
        }
    } else {
        Ok(())
    };
    if let Err(e) = files::delete(&probe) {
        sluice_guest_sdk::log::warn(&format!("could not remove the create probe {probe}: {}", files::describe(&e)));
    }
    exclusive
}

/// Proves that a commit's rename from staging into the output can work: a
/// small file is written in `staging_path`, renamed into `path` and deleted.
/// A staging directory on another filesystem than the output is refused
/// here, by `sluice check`, instead of at the first commit.
fn probe_rename(ctx: &SinkContext, cfg: &Config) -> Result<(), SinkError> {
    let name = probe_name(ctx);
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

impl sluice_guest_sdk::GuestCommitterState for FilesSink {
    fn restore(state: Option<Vec<u8>>) -> Result<(), SinkError> {
        versions::restore_state(state)
    }

    fn snapshot(_c: u64) -> Result<Vec<u8>, SinkError> {
        versions::snapshot_state()
    }

    /// Without a filter an empty input replaces nothing.
    fn finish(_c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        Ok(None)
    }
}

sluice_guest_sdk::export_plugin!(FilesSink, keeps_state);

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(options: &[(&str, &str)]) -> Result<Config, SinkError> {
        Config::parse(options.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    #[test]
    fn the_scheme_of_path_decides_how_to_publish() {
        assert_eq!(Publish::of("out/files"), Publish::Rename);
        assert_eq!(Publish::of("file:///data/out"), Publish::Rename);
        assert_eq!(Publish::of("s3://lake/out"), Publish::Marker { exclusive_data: true });
        assert_eq!(Publish::of("S3://lake/out"), Publish::Marker { exclusive_data: true });
        assert_eq!(Publish::of("gs://lake/out"), Publish::Marker { exclusive_data: false });
    }

    /// GCS with `partition_by` is refused before writing (the host's upload
    /// encodes `=` twice); S3 and local paths take it.
    #[test]
    fn partition_by_on_gcs_is_refused_before_writing() {
        let Err(SinkError::Config(message)) = parse(&[("path", "gs://lake/out"), ("partition_by", "day")]) else {
            panic!("refused")
        };
        assert!(message.contains("option `partition_by`") && message.contains("gs://lake/out"), "{message}");
        assert!(parse(&[("path", "s3://lake/out"), ("partition_by", "day")]).is_ok());
        assert!(parse(&[("path", "out/files"), ("partition_by", "day")]).is_ok());
    }

    #[test]
    fn object_store_output_stages_nothing_and_refuses_a_staging_path() {
        let cfg = parse(&[("path", "s3://lake/out/")]).expect("parses");
        assert_eq!((cfg.path.as_str(), cfg.staging.as_str()), ("s3://lake/out", "s3://lake/out/_sluice_data"));
        let local = parse(&[("path", "out/files")]).expect("parses");
        assert_eq!((local.staging.as_str(), local.publish), ("out/files.staging", Publish::Rename));

        let Err(SinkError::Config(message)) = parse(&[("path", "gs://lake/out"), ("staging_path", "gs://lake/st")])
        else {
            panic!("refused")
        };
        assert!(message.contains("option `staging_path`") && message.contains("commit marker"), "{message}");
        let Err(SinkError::Config(message)) = parse(&[("path", "out"), ("staging_path", "s3://lake/st")]) else {
            panic!("refused")
        };
        assert!(message.contains("nothing can be renamed out of an object store"), "{message}");
    }
}
