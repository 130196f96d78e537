//! The fan-in committer: all writers' files of checkpoint `c` → one snapshot
//! per table.
//!
//! One `commit` call makes one attempt per table (seed 002's safe retry,
//! with the host owning the retry loop and its backoff):
//! 1. reload the table;
//! 2. if the table's watermark for this job, sink and incarnation is at or
//!    past `c`, the table is done;
//! 3. otherwise every data and delete file the checkpoint names in it must
//!    exist, whole, as its writer wrote it (one `stat` each); this is checked
//!    for every table not done before any table is committed, and a missing
//!    file refuses the whole commit with a `fatal` error naming the files
//!    and the checkpoint, so no snapshot ever names a file that is gone and
//!    the checkpoint stays pending for the operator (step 2 comes first: a
//!    table holding `c` already is never checked, so files a later
//!    compaction removed cannot turn an `already-committed` into an error);
//! 4. build an append snapshot on exactly the table step 1 loaded
//!    ([`crate::snapshot::build_snapshot`], which merges small manifests as
//!    Java's merging append does), setting the watermark to `c` in the same
//!    commit, and commit it with its `assert-ref-snapshot-id` requirement;
//! 5. a `conflict` (definitely not applied) or an `unknown-outcome` (maybe
//!    applied) is answered `retryable`: the host calls `commit` again, which
//!    starts at 1 for every table, so step 2 decides before anything is
//!    re-applied, and tables done already stay done.
//!
//! `abort` deletes a checkpoint's data files; the host calls it only for a
//! checkpoint whose record is definitely not persisted, so no commit can
//! ever name them.
//!
//! The watermark is a table property, `sluice.committed.<job>.<sink>.<incarnation>`,
//! written by the same atomic commit as the snapshot. Unlike the snapshot
//! summaries, it survives snapshot expiry, so a late recovery never
//! re-applies a checkpoint whose snapshot was expired. Commits of a state
//! directory made before incarnations (no incarnation in the combined
//! commit) are still recognised by their snapshot summaries.
//!
//! The claim is a table property too, `sluice.claim.<job>.<sink>`, naming
//! the one incarnation of the job's sink that may commit to the table. It is
//! read on every reload, before every commit attempt; a free claim is set
//! by the same atomic commit as the first snapshot, whose
//! `assert-ref-snapshot-id` requirement makes two incarnations racing for
//! it conflict, so the loser reloads, finds the winner's claim and refuses
//! before any of its rows are visible. A checkpoint's tables are committed
//! in name order, after a check of every table's claim, so two runs of one
//! job meet on the same first table.
//!
//! In `mode = "overwrite-partitions"` (see [`crate::overwrite`] for its
//! invariants) step 4 differs: `combine(c)` has decided which partitions
//! `c` replaces; the history since the incarnation's base is validated on
//! exactly the head loaded in step 1, and the snapshot is one `overwrite`
//! that removes every live data and delete file of those partitions and adds
//! the checkpoint's files (an `append` when it replaces none), built by
//! [`crate::snapshot::build_snapshot`] with the watermark and claim in the
//! same commit, under the same `assert-ref-snapshot-id` requirement. The
//! job's dead-letter table is always appended to.
//!
//! With `overwrite_filter`, the incarnation's first checkpoint with rows in
//! a table removes every live file inside the filter instead, and later
//! ones add; validation takes the filter as its conflict detection filter.
//! The filter is checked against the table (its columns partition it, no
//! live file straddles it) when the committer opens and at every commit.
//! Without a filter, a table holding live files of a partition spec other
//! than its default one is refused the same way, at open and at every
//! commit (partitions of two specs are never compared).
//! When a bounded input was entirely empty, `committer-state.finish`
//! refuses (`config`, naming the job, tables, filter and what would go)
//! unless `allow_empty_overwrite`, with which it returns a commit that only
//! removes the filter's files: a `delete` snapshot carrying the watermark
//! and claim like any other, so it lands once across crashes.
//!
//! `evolve` creates new tables and evolves schemas with the REST spec's
//! `add-schema` and `set-current-schema` updates, guarded by
//! `assert-current-schema-id`; a table that already has the schema is left
//! alone, so a replay after a crash changes nothing.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::rc::Rc;

use iceberg::TableIdent;
use iceberg::spec::{
    DataContentType, DataFile, FormatVersion, Operation, Summary, TableMetadata, deserialize_data_file_from_json,
};
use iceberg::table::Table;
use iceberg::{TableRequirement, TableUpdate};
use serde::{Deserialize, Serialize};
use sluice_guest_sdk::bindings::sluice::connector::iceberg_catalog::CatalogError;
use sluice_guest_sdk::{
    ChangeKind, CommitOutcome, Committer, GuestCommitter, SinkContext, SinkError, Table as SourceTable, TableChange,
    claim, error, incarnation, ipc, log,
};

use crate::config::{Config, Mode};
use crate::host_io::{self, catalog_message};
use crate::key_index::KeyIndex;
use crate::overwrite::{self, Plan, State};
use crate::runtime::block_on;
use crate::schema;
use crate::snapshot::{Built, build_snapshot, listed, manifests_cached, manifests_of};
use crate::writer::{CommitInfo, TableFiles, ensure_table, iceberg_error};
use crate::{SUMMARY_CHECKPOINT, SUMMARY_INCARNATION, SUMMARY_JOB, SUMMARY_SINK};

/// The committer state's mark of an upsert incarnation.
const UPSERT_MODE: &str = "upsert";

/// Every writer's files of one checkpoint.
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    /// One entry per table the checkpoint touched.
    #[serde(default)]
    tables: Vec<TableFiles>,
    /// The incarnation the checkpoint belongs to (absent in commits made
    /// before incarnations).
    #[serde(default)]
    incarnation: Option<String>,
    /// A checkpoint prepared by the Iceberg sink for contract 0.1 (one
    /// table): its partition spec and files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spec_id: Option<i32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    files: Vec<String>,
    /// `mode = "overwrite-partitions"`: what the checkpoint does to each
    /// table (by source name), decided at combine. Absent in appends and in
    /// commits of builds before overwrite.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    overwrite: BTreeMap<String, Plan>,
    /// `mode = "upsert"`: the folder (below each table's `data/`) the
    /// checkpoint's position-delete files are written to, which orphan
    /// cleanup leaves alone while the checkpoint is pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    deletes_folder: Option<String>,
}

impl Combined {
    /// Every table's files, the 0.1 form as the single table `""`.
    fn parts(self) -> Vec<TableFiles> {
        let mut parts = self.tables;
        if let Some(spec_id) = self.spec_id {
            parts.push(TableFiles { table: String::new(), spec_id, files: self.files, changes: Vec::new() });
        }
        parts
    }
}

pub struct IcebergCommitter {
    cfg: Config,
    ctx: SinkContext,
    /// Tables whose claim this incarnation was seen to hold (claims are
    /// never moved, so a table in here needs no second look).
    claimed: RefCell<HashSet<String>>,
    /// Every source table the committer was told of (open, evolve).
    known: Rc<RefCell<BTreeSet<String>>>,
    /// Anchor claims (one per namespace directory) held by this incarnation.
    anchors: RefCell<HashSet<String>>,
    /// The overwrite state (empty in append mode), shared with the
    /// `committer-state` export through [`OPEN`].
    state: Rc<RefCell<State>>,
    /// Manifests of the head read before, by path (only the last head's).
    manifests: RefCell<HashMap<String, Vec<iceberg::spec::ManifestEntryRef>>>,
    /// Upsert mode: the key index of each table, by table ident.
    indexes: RefCell<HashMap<String, KeyIndex>>,
    /// A table with `gc.enabled = false` was noted (once per committer).
    gc_off_noted: std::cell::Cell<bool>,
    /// What the snapshots of each table reference, kept across the
    /// retention's expiries (manifests and their lists never change).
    expiry_refs: RefCell<HashMap<String, crate::maintenance::References>>,
}

/// What `committer-state` needs of the committer opened in this instance.
struct Opened {
    overwrites: bool,
    mode: Mode,
    state: Rc<RefCell<State>>,
    cfg: Config,
    ctx: SinkContext,
    known: Rc<RefCell<BTreeSet<String>>>,
}

thread_local! {
    /// The committer opened in this instance (the host opens one committer
    /// per instance), for `committer-state`.
    static OPEN: RefCell<Option<Rc<Opened>>> = const { RefCell::new(None) };
}

fn open_state() -> Result<Rc<Opened>, SinkError> {
    OPEN.with(|open| open.borrow().clone()).ok_or_else(|| error::fatal("committer-state called before committer.open"))
}

/// `committer-state.restore`: the state of the newest record of this
/// incarnation replaces what `open` saw (the bases it froze win).
pub(crate) fn restore_state(bytes: Option<Vec<u8>>) -> Result<(), SinkError> {
    let open = open_state()?;
    let state = &open.state;
    let upsert = open.mode == Mode::Upsert;
    let bytes = bytes.filter(|b| !b.is_empty());
    let recorded: Option<State> = bytes
        .as_deref()
        .map(serde_json::from_slice)
        .transpose()
        .map_err(|e| error::fatal(format!("the restored committer state of the Iceberg sink is not valid: {e}")))?;
    let was_upsert = recorded.as_ref().is_some_and(|s| s.mode.as_deref() == Some(UPSERT_MODE));
    let before = state.borrow().committed_before.clone();
    if upsert && !was_upsert && (!before.is_empty() || recorded.is_some()) {
        let tables =
            if before.is_empty() { "its tables".to_string() } else { format!("table(s) {}", before.join(", ")) };
        return Err(error::config(format!(
            "[sink.options] mode = \"upsert\": this incarnation already landed checkpoints in {tables} in another \
             mode (append or overwrite-partitions), and applying changes by key from here on would mix the two; \
             finish it in the mode it started with, or start a new incarnation (a fresh job.state_dir and \
             --new-incarnation) in upsert mode"
        )));
    }
    if !upsert && was_upsert {
        return Err(error::config(
            "[sink.options] mode: this incarnation began with mode = \"upsert\" and applies a change stream by key; \
             landing the rest of it in another mode would append its updates and deletes as rows; finish it with \
             mode = \"upsert\", or start a new incarnation (a fresh job.state_dir and --new-incarnation) in the mode \
             you want",
        ));
    }
    if upsert {
        return Ok(());
    }
    let Some(bytes) = bytes else {
        // An overwrite always records its state, so none after this
        // incarnation's own checkpoints means they were landed in append
        // mode (or by a build before overwrite): replacing the partitions
        // they touched now would delete rows already delivered.
        let before = &state.borrow().committed_before;
        if open.overwrites && !before.is_empty() {
            return Err(error::config(format!(
                "[sink.options] mode = \"overwrite-partitions\": this incarnation already landed checkpoints in \
                 table(s) {} without overwrite, and replacing the partitions they touched would delete rows already \
                 delivered; finish it in the mode it started with, or land the backfill again as a new incarnation \
                 (a fresh job.state_dir and --new-incarnation), which replaces every partition it touches",
                before.join(", ")
            )));
        }
        return Ok(());
    };
    let restored: State = serde_json::from_slice(&bytes)
        .map_err(|e| error::fatal(format!("the restored committer state of the Iceberg sink is not valid: {e}")))?;
    // A state is recorded only in overwrite mode (`snapshot_state`): one
    // naming tables, resumed in append mode, would append to the partitions
    // the rest of the input reaches for the first time instead of replacing
    // them, and leave those days doubled. (Its replaced set may still be
    // empty: a record taken before its first commit landed.)
    let replaced: Vec<&String> = restored.tables.keys().collect();
    if !open.overwrites && !replaced.is_empty() {
        return Err(error::config(format!(
            "[sink.options] mode = \"append\": this incarnation began with mode = \"overwrite-partitions\" on \
             table(s) {} and replaces partitions there, and appending the rest of its input would leave the partitions it has \
             not reached yet doubled; finish it with mode = \"overwrite-partitions\", or start a new incarnation \
             (a fresh job.state_dir and --new-incarnation) in the mode you want",
            replaced.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
        )));
    }
    state.borrow_mut().tables.extend(restored.tables);
    Ok(())
}

/// `committer-state.snapshot`: the overwrite state (nothing in append mode).
pub(crate) fn snapshot_state() -> Result<Vec<u8>, SinkError> {
    let open = open_state()?;
    if open.mode == Mode::Upsert {
        let marker = State { mode: Some(UPSERT_MODE.to_string()), ..State::default() };
        return serde_json::to_vec(&marker).map_err(|e| error::fatal(format!("encoding the committer state: {e}")));
    }
    if !open.overwrites {
        return Ok(Vec::new());
    }
    serde_json::to_vec(&*open.state.borrow()).map_err(|e| error::fatal(format!("encoding the committer state: {e}")))
}

/// `committer-state.finish(c)`: a bounded input ended with round `c`, where
/// no writer prepared anything. With `overwrite_filter`, an input that was
/// entirely empty (no table's filter replaced, no partition replaced, by
/// this incarnation) is refused unless `allow_empty_overwrite`; with it,
/// the answer is a commit that removes every live file inside the filter
/// of each table, one `delete` snapshot per table. Otherwise nothing.
pub(crate) fn finish_state(c: u64) -> Result<Option<Vec<u8>>, SinkError> {
    let open = open_state()?;
    let cfg = &open.cfg;
    let Some(filter) = cfg.overwrite_filter.as_ref().filter(|_| open.overwrites) else { return Ok(None) };
    // A filter's first commit that landed and was dropped after (see
    // `overwrite::catch_up`) has landed all the same.
    let names: Vec<String> = open.known.borrow().iter().filter(|n| cfg.filter_for(n).is_some()).cloned().collect();
    for name in &names {
        let ident = cfg.ident(name)?;
        // The host does not call `finish` again: a transient catalog error
        // here is tried again, as combine's loads are.
        let table = host_io::load_retrying(
            host_io::LOAD_RETRY,
            &ident,
            "the end of the input",
            || block_on(host_io::load_table(&ident)),
            log::warn,
        )?;
        if let Some(tstate) = open.state.borrow_mut().tables.get_mut(&ident.to_string()) {
            overwrite::catch_up(&table, &open.ctx, tstate, own_watermark(table.metadata(), &open.ctx), false)?;
        }
    }
    if open.state.borrow().landed_any() {
        // Rows landed in earlier checkpoints: the end adds nothing.
        return Ok(None);
    }
    let mut tables = Vec::new();
    let mut plans = BTreeMap::new();
    let mut found = Vec::new();
    for name in names {
        let ident = cfg.ident(&name)?;
        let table = block_on(host_io::load_table(&ident)).map_err(|e| e.into_sink_error(&ident))?;
        let bound = overwrite::bind_filter(filter, &table)?;
        let manifests = match table.metadata().current_snapshot() {
            Some(head) => manifests_of(&table, head)?,
            None => Vec::new(),
        };
        let scan = overwrite::scan_filter(&table, &manifests, &bound)?;
        found.push(format!("table {ident}: {} data file(s) holding {} row(s)", scan.data_files, scan.rows));
        tables.push(TableFiles {
            table: name.clone(),
            spec_id: table.metadata().default_partition_spec_id(),
            files: Vec::new(),
            changes: Vec::new(),
        });
        plans.insert(name, overwrite::filter_plan(None, filter, BTreeSet::new()));
    }
    if tables.is_empty() {
        return Ok(None);
    }
    if !cfg.allow_empty_overwrite {
        return Err(error::config(format!(
            "job {:?}: the input was entirely empty, and with [sink.options] overwrite_filter `{}` landing it would \
             delete every row matching the filter: {}. Nothing was committed. If that is meant (the range really has \
             no rows now), set [sink.options] allow_empty_overwrite = true; otherwise check the input upstream",
            open.ctx.job_id,
            filter.source(),
            found.join("; ")
        )));
    }
    log::warn(&format!(
        "job {:?}: the input was entirely empty; allow_empty_overwrite = true, so checkpoint {c} deletes every row \
         matching overwrite_filter `{}`: {}",
        open.ctx.job_id,
        filter.source(),
        found.join("; ")
    ));
    let combined = Combined {
        tables,
        incarnation: Some(open.ctx.incarnation.clone()),
        spec_id: None,
        files: Vec::new(),
        overwrite: plans,
        deletes_folder: None,
    };
    serde_json::to_vec(&combined).map(Some).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
}

/// The anchor claim of the namespace directory `table` lives in.
fn anchor_location(ctx: &SinkContext, table: &Table) -> Option<String> {
    let location = table.metadata().location().trim_end_matches('/');
    let (parent, _) = location.rsplit_once('/')?;
    Some(format!("{parent}/_sluice_claim.{}.{}.json", ctx.job_id, ctx.sink_id))
}

/// The newest checkpoint of this incarnation committed to the table (its
/// watermark).
fn own_watermark(metadata: &TableMetadata, ctx: &SinkContext) -> Option<u64> {
    metadata.properties().get(&watermark_key(ctx, &ctx.incarnation)).and_then(|v| v.parse::<u64>().ok())
}

/// Whether the table holds a committed checkpoint of this incarnation.
fn holds_own(metadata: &TableMetadata, ctx: &SinkContext) -> bool {
    metadata.properties().contains_key(&watermark_key(ctx, &ctx.incarnation))
}

/// The table property naming the incarnation that holds the table's claim
/// for this job and sink.
fn claim_key(ctx: &SinkContext) -> String {
    format!("sluice.claim.{}.{}", ctx.job_id, ctx.sink_id)
}

/// Prefix of the watermark properties of a job's sink.
fn watermark_prefix(ctx: &SinkContext) -> String {
    format!("sluice.committed.{}.{}.", ctx.job_id, ctx.sink_id)
}

/// The table property holding the newest checkpoint committed by this
/// job, sink and incarnation.
fn watermark_key(ctx: &SinkContext, incarnation: &str) -> String {
    format!("{}{incarnation}", watermark_prefix(ctx))
}

/// Whether checkpoint `c` of this job and sink (of `incarnation`) is in the table.
fn holds_checkpoint(metadata: &TableMetadata, ctx: &SinkContext, incarnation: Option<&str>, c: u64) -> bool {
    match incarnation {
        Some(inc) => metadata
            .properties()
            .get(&watermark_key(ctx, inc))
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|committed| committed >= c),
        None => in_ancestry(metadata, ctx, c),
    }
}

/// Whether the ancestry of the current snapshot holds checkpoint `c` of this
/// job and sink, committed before incarnations (no incarnation in its summary).
fn in_ancestry(metadata: &TableMetadata, ctx: &SinkContext, c: u64) -> bool {
    let checkpoint = c.to_string();
    let mut next = metadata.current_snapshot_id();
    while let Some(id) = next {
        let Some(snapshot) = metadata.snapshot_by_id(id) else { break };
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_JOB) == Some(&ctx.job_id)
            && props.get(SUMMARY_SINK) == Some(&ctx.sink_id)
            && props.get(SUMMARY_CHECKPOINT) == Some(&checkpoint)
            && !props.contains_key(SUMMARY_INCARNATION)
        {
            return true;
        }
        next = snapshot.parent_snapshot_id();
    }
    false
}

/// Another incarnation of this job and sink that committed to the table, if
/// any: `Some(Some(id))` from a watermark, `Some(None)` from a snapshot
/// committed before incarnations.
fn other_incarnation(metadata: &TableMetadata, ctx: &SinkContext) -> Option<Option<String>> {
    let ours = Some(ctx.incarnation.as_str());
    let prefix = watermark_prefix(ctx);
    for key in metadata.properties().keys() {
        if let Some(id) = key.strip_prefix(&prefix)
            && Some(id) != ours
        {
            return Some(Some(id.to_string()));
        }
    }
    for snapshot in metadata.snapshots() {
        let props = &snapshot.summary().additional_properties;
        if props.get(SUMMARY_JOB) == Some(&ctx.job_id) && props.get(SUMMARY_SINK) == Some(&ctx.sink_id) {
            let found = props.get(SUMMARY_INCARNATION).map(String::as_str);
            if found != ours {
                return Some(found.map(str::to_string));
            }
        }
    }
    None
}

/// Whether the claim of table `ident` (as `metadata` has it) is free for
/// this incarnation to take; refuses one another incarnation holds, and a
/// free one where another incarnation's checkpoints are and none of ours.
fn judge_table(
    ctx: &SinkContext,
    mode: claim::Mode,
    ident: &TableIdent,
    metadata: &TableMetadata,
) -> Result<bool, SinkError> {
    let holder = metadata.properties().get(&claim_key(ctx)).map(String::as_str);
    let target = format!("table {ident}");
    let free = claim::check(ctx, mode, &target, holder)?;
    if free
        && !holds_own(metadata, ctx)
        && let Some(other) = other_incarnation(metadata, ctx)
    {
        let other =
            other.map_or("an incarnation from before incarnation ids".to_string(), |id| format!("incarnation {id}"));
        return Err(claim::refused_unclaimed(ctx, &target, &other));
    }
    Ok(free)
}

/// Refuses, before anything is written, table `ident` when another
/// incarnation holds its claim or the anchor of its namespace directory.
pub(crate) fn refuse_claimed(
    ctx: &SinkContext,
    mode: claim::Mode,
    ident: &TableIdent,
    table: &Table,
) -> Result<(), SinkError> {
    if let Some(location) = anchor_location(ctx, table) {
        let holder = claim::file_holder(&location).or_else(|e| match e {
            SinkError::Config(m) if m.contains("access denied") => Ok(None),
            e => Err(e),
        })?;
        claim::check(ctx, mode, &format!("table {ident}"), holder.as_deref())?;
    }
    judge_table(ctx, mode, ident, table.metadata()).map(|_| ())
}

/// Refuses a table `mode = "upsert"` cannot write: one of format version
/// 1 (no delete files). Version 2 takes position-delete files, version 3
/// deletion vectors.
pub(crate) fn check_upsert_table(table: &Table) -> Result<(), SinkError> {
    let ident = table.identifier();
    match table.metadata().format_version() {
        FormatVersion::V2 | FormatVersion::V3 => Ok(()),
        FormatVersion::V1 => Err(error::config(format!(
            "table {ident} is of Iceberg format version 1, which has no delete files, so [sink.options] mode = \
             \"upsert\" cannot replace or delete its rows; upgrade it to format version 2 (table property \
             format-version = 2)"
        ))),
    }
}

fn decode_files(table: &Table, part: &TableFiles) -> Result<Vec<DataFile>, SinkError> {
    let metadata = table.metadata();
    let schema = metadata.current_schema();
    let spec = metadata.partition_spec_by_id(part.spec_id).ok_or_else(|| {
        error::fatal(format!(
            "table {} no longer has partition spec {} that the data files were written with",
            table.identifier(),
            part.spec_id
        ))
    })?;
    let partition_type = spec.partition_type(schema).map_err(|e| iceberg_error("reading the partition spec", e))?;
    part.files
        .iter()
        .map(|json| {
            deserialize_data_file_from_json(json, part.spec_id, &partition_type, schema)
                .map_err(|e| iceberg_error("decoding a data file of the checkpoint", e))
        })
        .collect()
}

/// Adds to `problems` why each of `files`, checkpoint files of table
/// `ident`, may not be named by a snapshot: missing, or not the size its
/// writer wrote (a reader reads the footer at that size).
///
/// One `stat` per file, which on an object store is one HEAD request, and not
/// one `list-tree` of the table's data directory: a checkpoint names few
/// files (about one per writer and partition), while the data directory
/// holds every file of the table's history, so its listing costs one request
/// per thousand files of the whole table (and all their names in this
/// plugin's memory), growing with the table, not with the checkpoint. The
/// HEADs cost as much as the writes that made the files, one each, and come
/// once per commit attempt.
fn check_files(ident: &TableIdent, files: &[DataFile], problems: &mut Vec<String>) -> Result<(), SinkError> {
    use sluice_guest_sdk::IoError;
    for file in files {
        let location = file.file_path();
        let kind = match file.content_type() {
            DataContentType::Data => "data file",
            DataContentType::PositionDeletes | DataContentType::EqualityDeletes => "delete file",
        };
        let written = file.file_size_in_bytes();
        match sluice_guest_sdk::files::stat(location) {
            Ok(status) if status.is_dir => {
                problems.push(format!("table {ident}: {kind} {location} is a directory"));
            }
            Ok(status) if status.size != written => problems.push(format!(
                "table {ident}: {kind} {location} holds {} bytes, and its writer wrote {written}",
                status.size
            )),
            Ok(_) => {}
            Err(IoError::NotFound(_)) => problems.push(format!("table {ident}: {kind} {location} is missing")),
            Err(e @ IoError::Denied(_)) => {
                return Err(sluice_guest_sdk::files::to_sink_error(&format!("checking {kind} {location}"), e));
            }
            // Not an answer about the file: the host retries the commit, which checks again.
            Err(e) => {
                return Err(error::retryable(format!(
                    "checking {kind} {location} of table {ident}: {}",
                    sluice_guest_sdk::files::describe(&e)
                )));
            }
        }
    }
    Ok(())
}

/// A table is left with this many snapshots more than `keep_snapshots`
/// (or `keep_snapshots` more, when that is fewer) before the older ones
/// are expired: one expiry per this many commits.
const RETENTION_SLACK: usize = 50;

/// The snapshots `keep_snapshots` = `keep` expires on `metadata` at
/// `now_ms`: the ancestors of `main` older than its newest `keep` (or the
/// table's own `history.expire.min-snapshots-to-keep`, if larger) and, when
/// the table sets `history.expire.max-snapshot-age-ms`, older than that
/// too. Never a snapshot another branch or tag reaches, nor one `main`
/// does not (a staged or rolled-back snapshot is the operator's, and
/// `sluice maintain` expires it by age).
fn retention(metadata: &TableMetadata, keep: u32, now_ms: i64) -> Vec<i64> {
    let property = |key: &str| metadata.properties().get(key).and_then(|v| v.trim().parse::<i64>().ok());
    let keep = property("history.expire.min-snapshots-to-keep")
        .and_then(|k| usize::try_from(k).ok())
        .map_or(keep as usize, |k| k.max(keep as usize));
    let cutoff = property("history.expire.max-snapshot-age-ms").map_or(i64::MAX, |age| now_ms.saturating_sub(age));
    let ancestry = |from: Option<i64>| {
        let mut out = Vec::new();
        let mut at = from;
        while let Some(id) = at {
            let Some(snapshot) = metadata.snapshot_by_id(id) else { break };
            out.push(snapshot.clone());
            at = snapshot.parent_snapshot_id();
        }
        out
    };
    let Some(heads) = other_ref_heads(metadata) else { return Vec::new() };
    let others: HashSet<i64> = heads.into_iter().flat_map(|h| ancestry(Some(h))).map(|s| s.snapshot_id()).collect();
    ancestry(metadata.current_snapshot_id())
        .iter()
        .skip(keep)
        .filter(|s| s.timestamp_ms() < cutoff && !others.contains(&s.snapshot_id()))
        .map(|s| s.snapshot_id())
        .collect()
}

/// The snapshots the table's refs other than `main` name, or `None` when
/// they cannot be told (then nothing is expired). iceberg-rust 0.10 has no
/// public accessor for a table's refs: they are read from the metadata's
/// JSON form, the spec's `refs` map.
fn other_ref_heads(metadata: &TableMetadata) -> Option<Vec<i64>> {
    let json = serde_json::to_value(metadata).ok()?;
    let Some(refs) = json.get("refs") else { return Some(Vec::new()) };
    let refs = refs.as_object()?;
    refs.iter()
        .filter(|(name, _)| name.as_str() != iceberg::spec::MAIN_BRANCH)
        .map(|(_, r)| r.get("snapshot-id").and_then(serde_json::Value::as_i64))
        .collect()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A catalog error on a table as a sink error: conflicts and unknown
/// outcomes may be retried (the next attempt reloads and checks first).
fn catalog_failure(context: String, e: CatalogError) -> SinkError {
    match e {
        CatalogError::NotFound(_) => error::config(format!("{context}: {}", catalog_message(&e))),
        CatalogError::UnknownOutcome(_) => {
            log::warn(&format!("{context}: {}; the next attempt checks the table first", catalog_message(&e)));
            error::retryable(format!("{context}: {}", catalog_message(&e)))
        }
        CatalogError::Conflict(_) | CatalogError::Other(_) => {
            error::retryable(format!("{context}: {}", catalog_message(&e)))
        }
    }
}

impl IcebergCommitter {
    /// After a commit on `before` (the table as the commit loaded it):
    /// once the table holds [`RETENTION_SLACK`] snapshots more than
    /// `keep_snapshots` (at most `keep_snapshots` more), expires the
    /// ancestors of `main` beyond the newest
    /// [`retention`] keeps, by id (one attempt; a conflict waits for the
    /// next commit). The checkpoint is committed whatever happens here: a
    /// failure is a warning.
    fn retain_snapshots(&self, ident: &TableIdent, before: &Table) {
        let keep = self.cfg.keep_snapshots;
        let count = before.metadata().snapshots().count() + 1;
        let slack = RETENTION_SLACK.min(keep as usize);
        if keep == 0 || count <= (keep as usize).saturating_add(slack) {
            return;
        }
        let gc = before.metadata().properties().get("gc.enabled").is_none_or(|v| !v.eq_ignore_ascii_case("false"));
        if !gc {
            if !self.gc_off_noted.replace(true) {
                log::info(&format!(
                    "table {ident} sets gc.enabled = false: its snapshots are not expired (`keep_snapshots` = {keep})"
                ));
            }
            return;
        }
        let choose = |table: &Table| {
            let ids = retention(table.metadata(), keep, now_ms());
            (!ids.is_empty()).then_some(crate::maintenance::Chosen {
                // Nothing by age: only the ids chosen.
                older_than_ms: Some(i64::MIN),
                keep_last: None,
                ids,
            })
        };
        let mut report = sluice_guest_sdk::TableReport {
            target: ident.to_string(),
            files_compacted: 0,
            files_written: 0,
            rows_rewritten: 0,
            snapshots_expired: 0,
            files_removed: Vec::new(),
            notes: Vec::new(),
        };
        let mut refs = self.expiry_refs.borrow_mut();
        let refs = refs.entry(ident.to_string()).or_default();
        match crate::maintenance::expire(ident, &choose, false, 1, refs, &mut report) {
            Ok(()) => {
                for note in &report.notes {
                    log::warn(&format!("table {ident}: keeping its newest {keep} snapshots: {note}"));
                }
            }
            Err(SinkError::Config(m) | SinkError::InvalidData(m) | SinkError::Retryable(m) | SinkError::Fatal(m)) => {
                log::warn(&format!(
                    "table {ident}: could not expire the snapshots beyond its newest {keep} (`keep_snapshots`): {m}; \
                     the next commit tries again"
                ));
            }
        }
    }

    fn load(&self, ident: &TableIdent) -> Result<Table, SinkError> {
        block_on(host_io::load_table(ident)).map_err(|e| e.into_sink_error(ident))
    }

    /// Loads table `ident` for a decision (`context`), trying again while
    /// the catalog fails to answer ([`host_io::load_retrying`]): a transient
    /// catalog error is `retryable`, never the end of the run.
    fn load_retrying(&self, ident: &TableIdent, context: &str) -> Result<Table, SinkError> {
        host_io::load_retrying(host_io::LOAD_RETRY, ident, context, || block_on(host_io::load_table(ident)), log::warn)
    }

    /// Checkpoint `c`'s files of one table, with the table as just loaded,
    /// when they are still to be committed; `None` when the table holds `c`
    /// already (decided before any file is looked at) or `c` has no files
    /// for it. Adds to `problems` each of the files that is not as written.
    fn to_commit(
        &self,
        c: u64,
        incarnation: Option<&str>,
        part: &TableFiles,
        plan: Option<&Plan>,
        problems: &mut Vec<String>,
    ) -> Result<Option<(TableIdent, Table, Vec<DataFile>)>, SinkError> {
        // The filter's first commit removes files even with none to add
        // (an entirely empty input, allowed).
        if part.files.is_empty() && part.changes.is_empty() && !plan.is_some_and(|p| p.filter_first) {
            return Ok(None);
        }
        let ident = self.cfg.ident(&part.table)?;
        let table = self.load(&ident)?;
        if holds_checkpoint(table.metadata(), &self.ctx, incarnation, c) {
            if let Some(plan) = plan {
                self.state.borrow_mut().fold(&ident.to_string(), c, plan);
            }
            return Ok(None);
        }
        let files = decode_files(&table, part)?;
        check_files(&ident, &files, problems)?;
        Ok(Some((ident, table, files)))
    }

    /// Commits checkpoint `c`'s `files` (written for partition spec
    /// `spec_id`) of table `ident` as one `append` snapshot on exactly the
    /// head of `table` (as [`Self::to_commit`] loaded and checked it),
    /// moving the watermark in the same commit. The head's manifests are
    /// only listed, not read, unless the table's merge policy merges them
    /// ([`crate::snapshot::MergePolicy`]): the cost of an append does not
    /// grow with the table's history.
    fn commit_table(
        &self,
        c: u64,
        incarnation: Option<&str>,
        ident: &TableIdent,
        table: &Table,
        spec_id: i32,
        files: Vec<DataFile>,
    ) -> Result<(), SinkError> {
        // Judged on the table as loaded; a claim taken since makes the commit conflict.
        let take_claim = self.judge_claim(ident, table.metadata())?;
        let mut summary = HashMap::from([
            (SUMMARY_JOB.to_string(), self.ctx.job_id.clone()),
            (SUMMARY_SINK.to_string(), self.ctx.sink_id.clone()),
            (SUMMARY_CHECKPOINT.to_string(), c.to_string()),
        ]);
        let mut properties = HashMap::new();
        if let Some(inc) = incarnation {
            summary.insert(SUMMARY_INCARNATION.to_string(), inc.to_string());
            properties.insert(watermark_key(&self.ctx, inc), c.to_string());
        }
        if take_claim {
            properties.insert(claim_key(&self.ctx), self.ctx.incarnation.clone());
        }
        let head = table.metadata().current_snapshot().cloned();
        let manifests = match &head {
            Some(h) => listed(table, h)?,
            None => Vec::new(),
        };
        let added: Vec<(i32, DataFile)> = files.into_iter().map(|f| (spec_id, f)).collect();
        let Built { requirements, updates, .. } = build_snapshot(
            table,
            head.as_deref(),
            &manifests,
            &HashSet::new(),
            &added,
            Summary { operation: Operation::Append, additional_properties: summary },
            properties,
        )?;
        match host_io::commit_updates(ident, &requirements, &updates) {
            Ok(()) => {
                log::debug(&format!("checkpoint {c}: snapshot committed to {ident}"));
                if take_claim {
                    log::info(&format!("incarnation {} claimed table {ident}", self.ctx.incarnation));
                    self.claimed.borrow_mut().insert(ident.to_string());
                }
                Ok(())
            }
            Err(e) => Err(catalog_failure(format!("committing checkpoint {c} to table {ident}"), e)),
        }
    }

    /// Commits checkpoint `c`'s `files` (of spec `spec_id`) of table `ident`
    /// as planned: validated on exactly the head of `table` (as
    /// [`Self::to_commit`] loaded and checked it), then one `overwrite`
    /// snapshot removing every live file of the partitions `plan` replaces
    /// (an `append` when it replaces none), moving the watermark in the same
    /// commit. Folds the plan into the state once committed.
    #[allow(clippy::too_many_arguments)]
    fn commit_overwrite(
        &self,
        c: u64,
        incarnation: &str,
        ident: &TableIdent,
        table: &Table,
        spec_id: i32,
        files: Vec<DataFile>,
        plan: &Plan,
    ) -> Result<(), SinkError> {
        let key = ident.to_string();
        let filter = self.plan_filter(c, ident, table, plan)?;
        let take_claim = self.judge_claim(ident, table.metadata())?;
        let head = table.metadata().current_snapshot().cloned();
        {
            let mut state = self.state.borrow_mut();
            // Every table is seen (open, evolve, combine) before its first
            // plan, and the record of a plan holds what combine saw.
            let Some(tstate) = state.tables.get_mut(&key) else {
                return Err(error::fatal(format!(
                    "checkpoint {c} overwrites table {ident}, but this incarnation's committer state has no base \
                     snapshot for it, so it cannot tell another writer's rows from those it replaces; nothing was \
                     committed"
                )));
            };
            let scope = match &filter {
                Some(f) => overwrite::Scope::Filter(f),
                None => overwrite::Scope::Partitions(&plan.touched),
            };
            overwrite::validate(table, &self.ctx, head.as_deref(), tstate, scope)?;
        }
        let manifests = match &head {
            Some(h) => {
                let mut cache = self.manifests.borrow_mut();
                let manifests = manifests_cached(table, h, &mut cache)?;
                // Keep only the head's: a later head shares most of them.
                let current: HashSet<&str> = manifests.iter().map(|m| m.file.manifest_path.as_str()).collect();
                cache.retain(|path, _| current.contains(path.as_str()));
                manifests
            }
            None => Vec::new(),
        };
        if filter.is_none() {
            overwrite::check_one_spec(table, &overwrite::live_specs(manifests.iter().map(|m| &m.file)), Some(spec_id))?;
        }
        let mut gone: HashSet<&str> = HashSet::new();
        if let (Some(f), true) = (&filter, plan.filter_first) {
            gone = overwrite::scan_filter(table, &manifests, f)?.gone;
        } else if !plan.replace.is_empty() {
            for m in &manifests {
                for entry in m.entries.iter().filter(|e| e.is_alive()) {
                    // A manifest holds files of its own spec.
                    let spec = m.file.partition_spec_id;
                    if plan.replace.contains(&overwrite::part_key(table, spec, entry.data_file().partition())?) {
                        gone.insert(entry.file_path());
                    }
                }
            }
        }
        let mut props = HashMap::from([
            (SUMMARY_JOB.to_string(), self.ctx.job_id.clone()),
            (SUMMARY_SINK.to_string(), self.ctx.sink_id.clone()),
            (SUMMARY_CHECKPOINT.to_string(), c.to_string()),
            (SUMMARY_INCARNATION.to_string(), incarnation.to_string()),
        ]);
        let operation = match &plan.filter {
            Some(text) if plan.filter_first => {
                props.insert("sluice.overwrite".to_string(), "filter".to_string());
                props.insert("sluice.overwrite-filter".to_string(), text.clone());
                if files.is_empty() { Operation::Delete } else { Operation::Overwrite }
            }
            _ if plan.replace.is_empty() => Operation::Append,
            _ => {
                props.insert(overwrite::REPLACE_PARTITIONS.to_string(), "true".to_string());
                props.insert("sluice.overwrite".to_string(), "partitions".to_string());
                Operation::Overwrite
            }
        };
        let mut properties = HashMap::from([(watermark_key(&self.ctx, incarnation), c.to_string())]);
        if take_claim {
            properties.insert(claim_key(&self.ctx), self.ctx.incarnation.clone());
        }
        let added: Vec<(i32, DataFile)> = files.into_iter().map(|f| (spec_id, f)).collect();
        let removed = gone.len();
        let Built { snapshot_id, requirements, updates } = build_snapshot(
            table,
            head.as_deref(),
            &manifests,
            &gone,
            &added,
            Summary { operation, additional_properties: props },
            properties,
        )?;
        match host_io::commit_updates(ident, &requirements, &updates) {
            Ok(()) => {
                if let (Some(text), true) = (&plan.filter, plan.filter_first) {
                    log::info(&format!(
                        "checkpoint {c}: table {ident}: replaced the rows of overwrite_filter `{text}`, removing \
                         {removed} file(s) and adding {}",
                        added.len()
                    ));
                } else if plan.replace.is_empty() {
                    log::debug(&format!("checkpoint {c}: snapshot committed to {ident}"));
                } else {
                    let names: Vec<String> = plan.replace.iter().map(ToString::to_string).collect();
                    log::info(&format!(
                        "checkpoint {c}: table {ident}: replaced {} partition(s) ({}), removing {removed} file(s) and adding {}",
                        plan.replace.len(),
                        names.join(", "),
                        added.len()
                    ));
                }
                if take_claim {
                    log::info(&format!("incarnation {} claimed table {ident}", self.ctx.incarnation));
                    self.claimed.borrow_mut().insert(key.clone());
                }
                let mut state = self.state.borrow_mut();
                state.fold(&key, c, plan);
                // Its parent is the head validated above, and it is ours:
                // the next walk starts from it, so expiry of the snapshots
                // before it (ours or anyone's) cannot break that walk. (A
                // commit found landed only after an unknown outcome keeps
                // the older mark: what came between is walked again.)
                if let Some(tstate) = state.tables.get_mut(&key) {
                    tstate.checked_through = Some(snapshot_id);
                }
                Ok(())
            }
            Err(e) => Err(catalog_failure(format!("committing checkpoint {c} to table {ident}"), e)),
        }
    }

    /// Commits checkpoint `c`'s `files` and key changes (`part.changes`) of
    /// table `ident` in upsert mode, on exactly the head of `table` (as
    /// [`Self::to_commit`] loaded and checked it): the key index is advanced
    /// to that head, every row of it that a changed key held and every row
    /// the checkpoint wrote and superseded is deleted by position-delete
    /// files written under `folder` (below the table's `data/`; on a
    /// format-version-3 table deletion vectors, one per data file, each
    /// merged with the data file's live vector, which the snapshot
    /// removes), and one snapshot adds the data and delete files and moves the watermark,
    /// under the requirement that the head has not moved. After a commit
    /// the index describes the new snapshot; after a failure it still
    /// describes the head it was advanced to, and the next attempt advances
    /// it to whatever head it loads.
    #[allow(clippy::too_many_arguments)]
    fn commit_upsert(
        &self,
        c: u64,
        incarnation: &str,
        folder: &str,
        ident: &TableIdent,
        table: &Table,
        part: &TableFiles,
        files: Vec<DataFile>,
    ) -> Result<(), SinkError> {
        check_upsert_table(table)?;
        let Some(key) = self.cfg.key.as_deref() else {
            return Err(error::config(format!(
                "checkpoint {c} upserts into table {ident}, and the job has no [source] key now; restore [source] key \
                 so the run can finish (nothing of checkpoint {c} is visible yet)"
            )));
        };
        let name = ident.to_string();
        let merged = crate::upsert::merge(&part.changes).map_err(|m| {
            error::fatal(format!(
                "checkpoint {c} of table {ident}: the key changes its writers recorded are not valid: {m}"
            ))
        })?;
        let take_claim = self.judge_claim(ident, table.metadata())?;
        let head = table.metadata().current_snapshot().cloned();
        let manifests = match &head {
            Some(h) => {
                let mut cache = self.manifests.borrow_mut();
                let manifests = manifests_cached(table, h, &mut cache)?;
                let current: HashSet<&str> = manifests.iter().map(|m| m.file.manifest_path.as_str()).collect();
                cache.retain(|path, _| current.contains(path.as_str()));
                manifests
            }
            None => Vec::new(),
        };
        let mut indexes = self.indexes.borrow_mut();
        if !indexes.contains_key(&name) {
            let columns = crate::keys::key_columns(&name, table.metadata().current_schema(), key)?;
            indexes.insert(name.clone(), KeyIndex::new(name.clone(), columns, self.cfg.key_index_max_bytes));
        }
        let Some(index) = indexes.get_mut(&name) else { return Err(error::fatal("key index missing")) };
        if let Err(e) = index.advance(table, head.as_ref().map(|h| h.snapshot_id()), &manifests) {
            // Half advanced: read anew next time.
            indexes.remove(&name);
            return Err(e);
        }
        let spec_id = part.spec_id;
        let own: HashMap<&str, &DataFile> = files.iter().map(|f| (f.file_path(), f)).collect();
        let mut groups: BTreeMap<(i32, String), crate::position_deletes::Group> = BTreeMap::new();
        let mut add = |spec: i32, partition: &iceberg::spec::Struct, path: &str, pos: u64| {
            groups
                .entry((spec, format!("{partition:?}")))
                .or_insert_with(|| crate::position_deletes::Group {
                    spec_id: spec,
                    partition: partition.clone(),
                    positions: BTreeMap::new(),
                })
                .positions
                .entry(path.to_string())
                .or_default()
                .push(pos);
        };
        let (mut replaced, mut deleted) = (0usize, 0usize);
        for (k, (_, end)) in &merged.finals {
            let rows = index.rows_of(k);
            match end {
                crate::upsert::Final::Row(path, _) if !own.contains_key(path.as_str()) => {
                    return Err(error::fatal(format!(
                        "checkpoint {c} of table {ident}: a changed key's row is in {path}, which the checkpoint does \
                         not name; nothing was committed"
                    )));
                }
                crate::upsert::Final::Row(..) => replaced += usize::from(!rows.is_empty()),
                crate::upsert::Final::Deleted => deleted += usize::from(!rows.is_empty()),
            }
            for (meta, pos) in rows {
                add(meta.spec_id, &meta.partition, &meta.path, pos);
            }
        }
        for (path, pos) in &merged.superseded {
            let Some(file) = own.get(path.as_str()) else {
                return Err(error::fatal(format!(
                    "checkpoint {c} of table {ident}: a superseded row is in {path}, which the checkpoint does not \
                     name; nothing was committed"
                )));
            };
            add(spec_id, file.partition(), path, *pos);
        }
        let location = table.metadata().location().trim_end_matches('/').to_string();
        let folder = format!("{location}/data/{folder}");
        // Format version 3: one deletion vector per data file, merged with
        // the live one, which the snapshot removes.
        let (delete_files, old_vectors) = if table.metadata().format_version() == FormatVersion::V3 {
            let (vectors, old) = crate::deletion_vectors::plan(table, &manifests, groups.into_values().collect())?;
            (crate::deletion_vectors::write(table, &folder, vectors)?, old)
        } else {
            let options = crate::writer::parquet_options(&self.cfg, 1);
            (crate::position_deletes::write(table, &folder, groups.into_values().collect(), options)?, Vec::new())
        };
        let gone: HashSet<&str> = old_vectors.iter().map(String::as_str).collect();
        let written: Vec<String> = delete_files.iter().map(|(_, f)| f.file_path().to_string()).collect();
        let mut added: Vec<(i32, DataFile)> = files.into_iter().map(|f| (spec_id, f)).collect();
        added.extend(delete_files);
        let props = HashMap::from([
            (SUMMARY_JOB.to_string(), self.ctx.job_id.clone()),
            (SUMMARY_SINK.to_string(), self.ctx.sink_id.clone()),
            (SUMMARY_CHECKPOINT.to_string(), c.to_string()),
            (SUMMARY_INCARNATION.to_string(), incarnation.to_string()),
            ("sluice.upsert".to_string(), "true".to_string()),
        ]);
        let operation = if written.is_empty() { Operation::Append } else { Operation::Overwrite };
        let mut properties = HashMap::from([(watermark_key(&self.ctx, incarnation), c.to_string())]);
        if take_claim {
            properties.insert(claim_key(&self.ctx), self.ctx.incarnation.clone());
        }
        let Built { snapshot_id, requirements, updates } = build_snapshot(
            table,
            head.as_deref(),
            &manifests,
            &gone,
            &added,
            Summary { operation, additional_properties: props },
            properties,
        )?;
        match host_io::commit_updates(ident, &requirements, &updates) {
            Ok(()) => {
                log::debug(&format!(
                    "checkpoint {c}: table {ident}: {} key(s) changed ({replaced} replaced, {deleted} deleted), {} \
                     delete file(s)",
                    merged.finals.len(),
                    written.len()
                ));
                if take_claim {
                    log::info(&format!("incarnation {} claimed table {ident}", self.ctx.incarnation));
                    self.claimed.borrow_mut().insert(name.clone());
                }
                if let Err(e) = index.committed(snapshot_id, &added, &old_vectors, &merged) {
                    log::warn(&format!("table {ident}: the key index is read anew at the next commit: {e:?}"));
                    indexes.remove(&name);
                }
                Ok(())
            }
            Err(e) => {
                if matches!(e, CatalogError::Conflict(_)) {
                    // Definitely not applied: no snapshot names them.
                    for path in &written {
                        let _ = sluice_guest_sdk::files::delete(path);
                    }
                }
                Err(catalog_failure(format!("committing checkpoint {c} to table {ident}"), e))
            }
        }
    }

    /// The job's `overwrite_filter` bound to `table`, for a commit whose
    /// plan has one (`None` in dynamic mode); refused when the plan was made
    /// with another filter than the job file has now.
    fn plan_filter(
        &self,
        c: u64,
        ident: &TableIdent,
        table: &Table,
        plan: &Plan,
    ) -> Result<Option<crate::filter::BoundFilter>, SinkError> {
        let Some(planned) = &plan.filter else { return Ok(None) };
        match &self.cfg.overwrite_filter {
            Some(f) if f.source() == planned => overwrite::bind_filter(f, table).map(Some),
            now => Err(error::config(format!(
                "checkpoint {c} of table {ident} is pending with overwrite_filter `{planned}`, and the job now has {}; \
                 restore [sink.options] overwrite_filter to `{planned}` so the run can finish (nothing of checkpoint \
                 {c} is visible yet)",
                now.as_ref().map_or_else(|| "none".to_string(), |f| format!("`{}`", f.source()))
            ))),
        }
    }

    /// Notes the current snapshot of table `ident` as the incarnation's base
    /// for it, unless it has one (overwrite mode).
    fn see_table(&self, name: &str) -> Result<(), SinkError> {
        if !self.cfg.overwrites(name) {
            return Ok(());
        }
        let ident = self.cfg.ident(name)?;
        let key = ident.to_string();
        if self.state.borrow().tables.contains_key(&key) {
            return Ok(());
        }
        let table = self.load(&ident)?;
        let head = table.metadata().current_snapshot_id();
        self.state.borrow_mut().see(&key, head);
        let before = match other_incarnation(table.metadata(), &self.ctx) {
            Some(Some(other)) => format!("; incarnation {other} of this job landed there before, and is replaced too"),
            Some(None) => "; an earlier run of this job landed there before, and is replaced too".to_string(),
            None => String::new(),
        };
        let Some(filter) = self.cfg.filter_for(name) else {
            // Before anything is written: one partition spec.
            if let Some(head) = table.metadata().current_snapshot() {
                let list = block_on(table.manifest_list_reader(head).load())
                    .map_err(|e| iceberg_error(&format!("reading the manifest list of table {ident}"), e))?;
                overwrite::check_one_spec(&table, &overwrite::live_specs(list.entries()), None)?;
            }
            log::info(&format!(
                "mode overwrite-partitions: incarnation {} of job {:?} replaces the partitions it touches in table \
                 {ident} (the first checkpoint touching a partition replaces it, later ones add); partitions it does \
                 not touch keep their rows{before}",
                self.ctx.incarnation, self.ctx.job_id
            ));
            return Ok(());
        };
        // Before anything is written: the filter's columns partition the
        // table, and no live file straddles it.
        let bound = overwrite::bind_filter(filter, &table)?;
        let manifests = match table.metadata().current_snapshot() {
            Some(head) => manifests_of(&table, head)?,
            None => Vec::new(),
        };
        let scan = overwrite::scan_filter(&table, &manifests, &bound)?;
        log::info(&format!(
            "mode overwrite-partitions: incarnation {} of job {:?} replaces every row of table {ident} matching \
             overwrite_filter `{}` (now {} data file(s), {} row(s)) with the rows it lands; rows outside the filter \
             are kept{before}",
            self.ctx.incarnation,
            self.ctx.job_id,
            filter.source(),
            scan.data_files,
            scan.rows
        ));
        Ok(())
    }

    /// Whether the claim of table `ident` (as `metadata` has it) is free and
    /// to be taken by the commit being built; refuses a table another
    /// incarnation holds.
    fn judge_claim(&self, ident: &TableIdent, metadata: &TableMetadata) -> Result<bool, SinkError> {
        let key = ident.to_string();
        if self.claimed.borrow().contains(&key) {
            return Ok(false);
        }
        let free = judge_table(&self.ctx, self.cfg.claim, ident, metadata)?;
        if !free && self.cfg.claim == claim::Mode::Exclusive {
            self.claimed.borrow_mut().insert(key);
        }
        Ok(free)
    }

    /// Refuses the commit of checkpoint `c` before anything of it is visible
    /// when another incarnation holds the claim of any table the committer
    /// knows, or the anchor of its namespace directory; takes the anchors
    /// this incarnation does not hold yet.
    fn check_claims(&self, parts: &[TableFiles]) -> Result<(), SinkError> {
        let mut names: BTreeSet<String> = self.known.borrow().clone();
        names.extend(parts.iter().filter(|p| !p.files.is_empty() || !p.changes.is_empty()).map(|p| p.table.clone()));
        let mut idents: Vec<TableIdent> = names.iter().map(|n| self.cfg.ident(n)).collect::<Result<_, _>>()?;
        idents.sort_by_key(|i| i.to_string());
        for ident in &idents {
            // A missing table fails its own commit, with its own message.
            let Ok(table) = block_on(host_io::load_table(ident)) else { continue };
            self.take_anchor(&table)?;
            if !self.claimed.borrow().contains(&ident.to_string()) {
                self.judge_claim(ident, table.metadata())?;
            }
        }
        Ok(())
    }

    /// Takes (or finds held) the anchor claim of `table`'s namespace directory.
    fn take_anchor(&self, table: &Table) -> Result<(), SinkError> {
        if self.cfg.claim == claim::Mode::Beside {
            return Ok(());
        }
        let Some(location) = anchor_location(&self.ctx, table) else { return Ok(()) };
        if self.anchors.borrow().contains(&location) {
            return Ok(());
        }
        let target = format!("the tables of {}", location.rsplit_once('/').map_or("", |(dir, _)| dir));
        match claim::take_file(&self.ctx, self.cfg.claim, &target, &location) {
            Ok(()) => {
                self.anchors.borrow_mut().insert(location);
                Ok(())
            }
            // Outside the grants: the table's own claim still guards it.
            Err(SinkError::Config(m)) if m.contains("access denied") => {
                log::warn(&format!("cannot take the anchor claim {location} ({m}); each table keeps its own claim"));
                self.anchors.borrow_mut().insert(location);
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Refuses, before anything is written, a table another incarnation
    /// holds, or whose namespace directory's anchor it holds.
    fn refuse_claimed(&self, ident: &TableIdent, table: &Table) -> Result<(), SinkError> {
        if !self.claimed.borrow().contains(&ident.to_string()) {
            refuse_claimed(&self.ctx, self.cfg.claim, ident, table)?;
        }
        Ok(())
    }

    /// Makes `table` take rows of `source`: created when missing, its schema
    /// evolved when the rows have more or wider columns.
    fn evolve_table(&self, source: &SourceTable) -> Result<(), SinkError> {
        let ident = self.cfg.ident(&source.name)?;
        let arrow = ipc::decode_schema(&source.schema)?;
        let table = ensure_table(&self.cfg, &ident, &arrow)?;
        // Another incarnation's table is not changed either.
        self.refuse_claimed(&ident, &table)?;
        let Some(evolved) = schema::evolved_schema(&table, &arrow)? else { return Ok(()) };
        let requirements =
            vec![TableRequirement::CurrentSchemaIdMatch { current_schema_id: table.metadata().current_schema_id() }];
        let updates =
            vec![TableUpdate::AddSchema { schema: evolved.clone() }, TableUpdate::SetCurrentSchema { schema_id: -1 }];
        match host_io::commit_updates(&ident, &requirements, &updates) {
            Ok(()) => {
                log::info(&format!(
                    "table {ident}: schema evolved to {} column(s)",
                    evolved.as_struct().fields().len()
                ));
                Ok(())
            }
            Err(e) => Err(catalog_failure(format!("evolving the schema of table {ident}"), e)),
        }
    }
}

impl GuestCommitter for IcebergCommitter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        tables: Vec<SourceTable>,
    ) -> Result<Committer, SinkError> {
        let cfg = Config::parse(options)?;
        let committer = IcebergCommitter {
            cfg,
            ctx,
            claimed: RefCell::new(HashSet::new()),
            known: Rc::new(RefCell::new(tables.iter().map(|t| t.name.clone()).collect())),
            anchors: RefCell::new(HashSet::new()),
            state: Rc::new(RefCell::new(State::default())),
            manifests: RefCell::new(HashMap::new()),
            indexes: RefCell::new(HashMap::new()),
            gc_off_noted: std::cell::Cell::new(false),
            expiry_refs: RefCell::new(HashMap::new()),
        };
        for table in &tables {
            let ident = committer.cfg.ident(&table.name)?;
            let Ok(existing) = block_on(host_io::load_table(&ident)) else { continue };
            if committer.ctx.refuse_other_incarnations
                && let Some(found) = other_incarnation(existing.metadata(), &committer.ctx)
            {
                let target = format!("table {ident}");
                let refused = incarnation::refuse(&committer.ctx, &target, "committed checkpoints", found.as_deref());
                return Err(match refused {
                    SinkError::Config(m) if committer.cfg.mode == crate::config::Mode::OverwritePartitions => {
                        error::config(format!(
                            "{m}. In mode overwrite-partitions that rerun replaces every partition it touches \
                             again (and keeps those it does not touch), so it leaves the table as a first run would"
                        ))
                    }
                    other => other,
                });
            }
            committer.refuse_claimed(&ident, &existing)?;
            if holds_own(existing.metadata(), &committer.ctx) {
                committer.state.borrow_mut().committed_before.push(ident.to_string());
            }
        }
        // The tables the job starts with: created, or evolved to take the
        // source's rows (a job may start on a table an older run made).
        for table in &tables {
            committer.evolve_table(table)?;
            committer.see_table(&table.name)?;
        }
        let opened = Opened {
            overwrites: committer.cfg.mode == crate::config::Mode::OverwritePartitions,
            mode: committer.cfg.mode,
            state: committer.state.clone(),
            cfg: committer.cfg.clone(),
            ctx: committer.ctx.clone(),
            known: committer.known.clone(),
        };
        OPEN.with(|open| *open.borrow_mut() = Some(Rc::new(opened)));
        Ok(Committer::new(committer))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        // A new table is created (when `create_table` allows it) and an
        // evolved one altered; both are no-ops when the target has it already.
        for change in &changes {
            self.known.borrow_mut().insert(change.table.name.clone());
            if change.kind == ChangeKind::NewTable {
                log::info(&format!("the source has a new table {:?}", change.table.name));
            }
            self.evolve_table(&change.table)?;
            self.see_table(&change.table.name)?;
        }
        Ok(())
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut tables: Vec<TableFiles> = Vec::new();
        for bytes in infos {
            let info: CommitInfo = serde_json::from_slice(&bytes)
                .map_err(|e| error::fatal(format!("commit info of checkpoint {c} is not valid: {e}")))?;
            for part in info.tables {
                match tables.iter_mut().find(|t| t.table == part.table) {
                    None => tables.push(part),
                    Some(all) if all.spec_id == part.spec_id || part.files.is_empty() => {
                        all.files.extend(part.files);
                        all.changes.extend(part.changes);
                    }
                    Some(all) if all.files.is_empty() => {
                        all.spec_id = part.spec_id;
                        all.files.extend(part.files);
                        all.changes.extend(part.changes);
                    }
                    Some(all) => {
                        return Err(error::fatal(format!(
                            "writers of checkpoint {c} used different partition specs ({} and {}) for table {:?}; its spec changed during the run",
                            all.spec_id, part.spec_id, part.table
                        )));
                    }
                }
            }
        }
        let mut plans = BTreeMap::new();
        for part in tables.iter().filter(|p| !p.files.is_empty() && self.cfg.overwrites(&p.table)) {
            self.see_table(&part.table)?;
            let ident = self.cfg.ident(&part.table)?;
            let table = self.load_retrying(&ident, &format!("planning checkpoint {c}"))?;
            let touched = overwrite::touched(&table, part.spec_id, &decode_files(&table, part)?)?;
            let filter = self.cfg.filter_for(&part.table);
            // Checkpoints committed here that no commit answer folded in
            // (dropped by the operator) count before this plan is made.
            if let Some(tstate) = self.state.borrow_mut().tables.get_mut(&ident.to_string()) {
                let watermark = own_watermark(table.metadata(), &self.ctx);
                overwrite::catch_up(&table, &self.ctx, tstate, watermark, filter.is_none())?;
            }
            let state = self.state.borrow();
            let tstate = state.tables.get(&ident.to_string());
            overwrite::check_scope(&ident.to_string(), tstate, filter.map(|f| f.source()))?;
            let plan = match filter {
                Some(f) => overwrite::filter_plan(tstate, f, touched),
                None => overwrite::plan(tstate, touched),
            };
            plans.insert(part.table.clone(), plan);
        }
        let upserts = tables.iter().any(|t| !t.changes.is_empty());
        let combined = Combined {
            tables,
            incarnation: Some(self.ctx.incarnation.clone()),
            spec_id: None,
            files: Vec::new(),
            overwrite: plans,
            deletes_folder: upserts.then(|| crate::upsert::deletes_folder(&incarnation::key(&self.ctx), c)),
        };
        serde_json::to_vec(&combined).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let mut combined: Combined = serde_json::from_slice(&combined)
            .map_err(|e| error::fatal(format!("combined commit of checkpoint {c} is not valid: {e}")))?;
        let incarnation = combined.incarnation.clone();
        let deletes_folder = combined.deletes_folder.take();
        let plans = std::mem::take(&mut combined.overwrite);
        let mut parts = combined.parts();
        parts.sort_by(|a, b| a.table.cmp(&b.table));
        self.check_claims(&parts)?;
        // A table where `c` is visible already is left alone, unchecked;
        // every other table's files are checked before any table is
        // committed, so a missing file leaves `c` whole where it is not.
        let mut todo = Vec::with_capacity(parts.len());
        let mut problems = Vec::new();
        for part in &parts {
            let plan = plans.get(&part.table);
            let found = self.to_commit(c, incarnation.as_deref(), part, plan, &mut problems)?;
            todo.extend(found.map(|(ident, table, files)| (ident, table, files, part, plan)));
        }
        if !problems.is_empty() {
            return Err(sluice_guest_sdk::files::refuse_missing(
                c,
                "make a snapshot name files that no reader can read",
                &problems,
            ));
        }
        let committed = !todo.is_empty();
        for (ident, table, files, part, plan) in todo {
            let spec_id = part.spec_id;
            if !part.changes.is_empty() {
                let (Some(inc), Some(folder)) = (incarnation.as_deref(), deletes_folder.as_deref()) else {
                    return Err(error::fatal(format!(
                        "checkpoint {c} upserts into table {ident} but names no incarnation or delete folder; it is \
                         not a commit of this build"
                    )));
                };
                self.commit_upsert(c, inc, folder, &ident, &table, part, files)?;
            } else {
                match (plan, incarnation.as_deref()) {
                    (Some(plan), Some(inc)) => self.commit_overwrite(c, inc, &ident, &table, spec_id, files, plan)?,
                    (Some(_), None) => {
                        return Err(error::fatal(format!(
                            "checkpoint {c} overwrites table {ident} but names no incarnation; it is not a commit of \
                             this build"
                        )));
                    }
                    (None, _) => self.commit_table(c, incarnation.as_deref(), &ident, &table, spec_id, files)?,
                }
            }
            // Only a commit that moved a watermark: a checkpoint of a state
            // directory made before incarnations is known by its snapshot.
            if incarnation.is_some() {
                self.retain_snapshots(&ident, &table);
            }
        }
        Ok(if committed { CommitOutcome::Committed } else { CommitOutcome::AlreadyCommitted })
    }

    /// Deletes the data files of checkpoint `c`. Precondition, which the host
    /// guarantees: the checkpoint's record is definitely not persisted (its
    /// write was answered "not done"), so no run can ever commit it; never
    /// called when the persist's outcome is unknown, since a recovery would
    /// then commit a snapshot naming these files.
    fn abort(&self, _c: u64, combined: Vec<u8>) -> Result<(), SinkError> {
        let Ok(combined) = serde_json::from_slice::<Combined>(&combined) else { return Ok(()) };
        for part in combined.parts() {
            let Ok(ident) = self.cfg.ident(&part.table) else { continue };
            let Ok(table) = block_on(host_io::load_table(&ident)) else { continue };
            if let Ok(files) = decode_files(&table, &part) {
                for file in files {
                    // Best effort: the files were never committed, so nobody reads them.
                    let _ = sluice_guest_sdk::files::delete(file.file_path());
                }
            }
        }
        Ok(())
    }
}

/// What a combined commit will make visible, one line per table.
pub fn describe(cfg: Option<&Config>, combined: &[u8]) -> Vec<String> {
    let Ok(combined) = serde_json::from_slice::<Combined>(combined) else {
        return vec!["(not an Iceberg-sink commit)".to_string()];
    };
    let plans = combined.overwrite.clone();
    combined
        .parts()
        .iter()
        .map(|part| {
            let target = cfg
                .and_then(|cfg| cfg.ident(&part.table).ok())
                .map_or_else(|| format!("{:?}", part.table), |i| i.to_string());
            match plans.get(&part.table) {
                Some(Plan { filter: Some(text), filter_first: true, .. }) => format!(
                    "table {target}: overwrite of every row matching overwrite_filter `{text}` with {} data file(s)",
                    part.files.len()
                ),
                Some(plan) if !plan.replace.is_empty() => {
                    let names: Vec<String> = plan.replace.iter().map(ToString::to_string).collect();
                    format!(
                        "table {target}: overwrite of {} partition(s) ({}) with {} data file(s)",
                        plan.replace.len(),
                        names.join(", "),
                        part.files.len()
                    )
                }
                Some(_) => format!(
                    "table {target}: one snapshot of {} data file(s) adding to partitions this incarnation replaced",
                    part.files.len()
                ),
                None => format!("table {target}: one snapshot of {} data file(s)", part.files.len()),
            }
        })
        .collect()
}
