//! `sluice maintain`: table maintenance of a job's sink (compaction,
//! snapshot expiry, orphan cleanup), done by the plugin's `maintenance`
//! export (contract 0.2.2) in an instance of its own, under the job's
//! grants.
//!
//! Invariants:
//! - the host knows nothing of the target's format: it only says what to do
//!   and which checkpoints are pending; the plugin keeps exactly-once;
//! - orphan cleanup is handed every pending checkpoint of this job and of
//!   every job the operator names (`--protect`), read after the plugin is
//!   loaded and right before the call, so no file a persisted but not yet
//!   committed checkpoint of theirs names is ever removed;
//! - a job the table names but this command cannot see (neither this job
//!   nor a `--protect`ed one) may have a pending checkpoint whose files look
//!   orphaned: while any table of the pass names one, orphan cleanup keeps
//!   every file younger than [`ORPHAN_FLOOR`] (3 days, the default
//!   `older_than` of the Java library's `remove_orphan_files`), and the
//!   report and the log name those jobs. Only `--force` lowers the floor,
//!   with a warning that names the risk;
//! - how the names are learnt: the contract's request has no place for
//!   "which jobs are protected" or a floor, and its `protected` list holds
//!   combined commits, so neither is smuggled into it. The host asks first:
//!   a dry run of orphan cleanup alone with a cutoff of `i64::MIN` (which
//!   can remove nothing) answers, per table, a note naming the table's
//!   other writers: the Iceberg plugin's `sluice.committed.*` watermarks
//!   and `sluice.claim.*` claims, and the writers whose names its
//!   unreferenced data files carry (`<job>.<sink>[.<incarnation>]-s…`), so
//!   a job with a pending checkpoint that never committed to the table is
//!   named too. The host then chooses the retention and runs the pass. A
//!   table whose report names no writers that way counts as naming one it
//!   cannot see (fails closed). The first pass is skipped when the
//!   retention asked for is at least the floor. A writer is named with its
//!   incarnation (`<job>.<sink>.<incarnation>`): only the incarnations the
//!   given state directories hold are seen, so another incarnation of the
//!   same job (or a `--protect` job file pointing at the wrong state
//!   directory) keeps the floor. The cutoff is fixed before the first pass
//!   lists anything, so a writer whose files land between the passes keeps
//!   them. Files of other tools carry no such name;
//! - a short retention (below [`MIN_RUNNING_ORPHAN_AGE`]) is refused while
//!   a run holds this job's or a protected job's state directory: its
//!   lock, or a live lease on an object store. A state directory whose
//!   holder cannot be read refuses too;
//! - the state directories are only read, never locked or changed, so a
//!   running job is not disturbed;
//! - a running job's passes ([`Background`]) run beside its checkpoints,
//!   never in their way: a failed pass is logged and counted, and the job
//!   goes on; a crash in one leaves the table as the last commit left it
//!   (a compaction is one replace snapshot, all or nothing).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::mpsc;
use std::time::Duration;

use super::EngineError;
use super::checkpoint::{CheckpointError, CheckpointStore, now_ms};
use crate::capability::Granted;
use crate::config::{EngineConfig, MIN_RUNNING_ORPHAN_AGE};
use crate::fault::Faults;
use crate::metrics::Metrics;
use crate::plugin::{Limits, MaintainRequest, MaintainerInstance, Plugin, PluginHost, SinkCtx};

/// Orphan cleanup keeps every file younger than this while a table names
/// a job whose state it cannot see (see the module doc).
pub const ORPHAN_FLOOR: Duration = Duration::from_secs(3 * 24 * 3600);

/// The plugin's note that names a table's other writers, followed by a JSON
/// list of `<job>.<sink>` (the Iceberg plugin's `maintenance.rs`).
const WRITERS_NOTE: &str = "other writers named by the table (job.sink): ";

/// What to do (see `sluice maintain --help`).
#[derive(Debug, Clone, Default)]
pub struct MaintainOptions {
    /// The source's names of the tables; none: those the job's last
    /// checkpoint knows (or the job's single table).
    pub tables: Vec<String>,
    pub compact: bool,
    pub target_file_bytes: u64,
    pub expire_older_than: Option<Duration>,
    pub keep_last: Option<u32>,
    pub remove_orphans_older_than: Option<Duration>,
    /// Other jobs whose pending checkpoints orphan cleanup must spare.
    pub protect: Vec<EngineConfig>,
    /// Remove orphans younger than [`ORPHAN_FLOOR`] even while a table
    /// names jobs whose state this cannot see (their pending files may go).
    pub force: bool,
    pub dry_run: bool,
    /// How long the plugin's call may take.
    pub timeout: Duration,
    /// Faults a test injects (catalog commits; none in a released build).
    pub faults: Faults,
}

/// What was done to one table.
#[derive(Debug, Clone)]
pub struct TableMaintained {
    pub target: String,
    pub files_compacted: u64,
    pub files_written: u64,
    pub rows_rewritten: u64,
    pub snapshots_expired: u64,
    pub files_removed: Vec<String>,
    pub notes: Vec<String>,
}

/// What `sluice maintain` did (or, in a dry run, would do).
#[derive(Debug, Clone)]
pub struct MaintainReport {
    pub dry_run: bool,
    pub tables: Vec<TableMaintained>,
}

impl fmt::Display for MaintainReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let removed = if self.dry_run { "would remove" } else { "removed" };
        for t in &self.tables {
            writeln!(
                f,
                "table {}: compacted {} file(s) into {} ({} rows), expired {} snapshot(s), {removed} {} file(s)",
                t.target,
                t.files_compacted,
                t.files_written,
                t.rows_rewritten,
                t.snapshots_expired,
                t.files_removed.len()
            )?;
            if self.dry_run {
                for file in &t.files_removed {
                    writeln!(f, "  would remove {file}")?;
                }
            }
            for note in &t.notes {
                writeln!(f, "  note: {note}")?;
            }
        }
        Ok(())
    }
}

/// The combined commits of `job`'s pending checkpoints, for its own sink.
fn pending_of(job: &EngineConfig) -> Result<Vec<Vec<u8>>, CheckpointError> {
    let Some(store) = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)? else {
        return Ok(Vec::new());
    };
    Ok(store.latest()?.map(|r| r.pending.into_iter().map(|p| p.combined.0).collect()).unwrap_or_default())
}

/// The tables of `job`'s newest checkpoint record (none before its first).
fn known_tables(store: &CheckpointStore) -> Result<Vec<String>, CheckpointError> {
    let latest = store.latest()?;
    Ok(latest.iter().flat_map(|r| r.tables.iter().map(|t| t.name.clone())).collect())
}

/// `asked`, else the `known` tables, else the source's single table.
fn tables_to_maintain(asked: &[String], known: Vec<String>) -> Vec<String> {
    if !asked.is_empty() {
        asked.to_vec()
    } else if !known.is_empty() {
        known
    } else {
        vec![String::new()]
    }
}

fn cutoff(age: Duration) -> i64 {
    let now = i64::try_from(now_ms()).unwrap_or(i64::MAX);
    now.saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX))
}

/// Refuses a plugin without the `maintenance` export, before anything runs.
pub(super) fn require_maintenance(plugin: &Plugin) -> Result<(), EngineError> {
    if plugin.maintains() {
        return Ok(());
    }
    Err(plugin.no_maintenance().into())
}

/// Refuses, before a run writes anything, a job whose `[sink.maintenance]`
/// its plugin cannot serve: one without the export, or one that answers an
/// empty request with an error (a plugin that keeps no tables).
pub(super) fn probe(job: &EngineConfig, plugin: &Plugin) -> Result<(), EngineError> {
    require_maintenance(plugin)?;
    let grants = Granted::open(&job.grants(), &Faults::default())?;
    let ctx = SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: "probe".to_string(),
        refuse_other_incarnations: false,
        beside: false,
        subtask: 0,
        parallelism: 1,
        attempt: 0,
        dead_letter_table: None,
        incarnation_created_ms: 0,
    };
    let mut maintainer = Maintainer::open(plugin, &grants, Limits::of(&job.spec.sink.sandbox), ctx, job)?;
    maintainer.pass(&MaintainRequest::default()).map(drop)
}

/// What one pass does, before its cutoffs are taken (at the pass's start).
#[derive(Debug, Clone)]
struct Plan {
    target_file_bytes: Option<u64>,
    expire_older_than: Option<Duration>,
    keep_last: Option<u32>,
    remove_orphans_older_than: Option<Duration>,
    /// Orphan retention below [`ORPHAN_FLOOR`] beside jobs not seen.
    force: bool,
    dry_run: bool,
}

impl Plan {
    /// The request for `tables` now, removing orphans older than
    /// `orphan_age` and protecting `protected` (read right before, when
    /// orphan cleanup is asked).
    fn request(
        &self,
        tables: Vec<String>,
        orphan_cutoff: Option<i64>,
        protected: impl FnOnce() -> Result<Vec<Vec<u8>>, EngineError>,
    ) -> Result<MaintainRequest, EngineError> {
        let mut request = MaintainRequest {
            tables,
            target_file_bytes: self.target_file_bytes,
            expiry: (self.expire_older_than.is_some() || self.keep_last.is_some()).then(|| {
                // `keep_last` alone keeps the newest N whatever their age.
                let older = self.expire_older_than.map_or_else(|| cutoff(Duration::ZERO), cutoff);
                (Some(older), self.keep_last)
            }),
            orphans_older_than_ms: orphan_cutoff,
            protected: Vec::new(),
            dry_run: self.dry_run,
        };
        if request.orphans_older_than_ms.is_some() {
            request.protected = protected()?;
        }
        Ok(request)
    }
}

/// A plugin instance's `maintenance` export, opened for one job.
struct Maintainer {
    instance: MaintainerInstance,
    ctx: SinkCtx,
    options: Vec<(String, String)>,
}

impl Maintainer {
    fn open(
        plugin: &Plugin,
        grants: &Granted,
        limits: Limits,
        ctx: SinkCtx,
        job: &EngineConfig,
    ) -> Result<Self, EngineError> {
        let options = super::setup::plugin_options(plugin, job, &ctx);
        let instance = plugin.instantiate_maintainer("maintainer", grants, limits)?;
        Ok(Self { instance, ctx, options })
    }

    fn pass(&mut self, request: &MaintainRequest) -> Result<MaintainReport, EngineError> {
        let reports = self.instance.maintain(&self.ctx, &self.options, request)?;
        Ok(MaintainReport {
            dry_run: request.dry_run,
            tables: reports
                .into_iter()
                .map(|r| TableMaintained {
                    target: r.target,
                    files_compacted: r.files_compacted,
                    files_written: r.files_written,
                    rows_rewritten: r.rows_rewritten,
                    snapshots_expired: r.snapshots_expired,
                    files_removed: r.files_removed,
                    notes: r.notes,
                })
                .collect(),
        })
    }
}

/// The least orphan retention beside a run of `job`: the files of its
/// round under way are named by no checkpoint until the round is
/// persisted, which may take 3 checkpoint intervals and the commit
/// retries of the checkpoint before it (at least
/// [`MIN_RUNNING_ORPHAN_AGE`]). A job whose checkpoints end only by rows
/// has no interval to go by: [`MIN_RUNNING_ORPHAN_AGE`] (such rounds are
/// short while rows flow; a quiet streaming source can hold one longer,
/// which the README says).
fn least_beside(job: &EngineConfig) -> Duration {
    let Some(interval) = job.spec.job.checkpoint.interval_secs.and_then(|s| Duration::try_from_secs_f64(s).ok()) else {
        return MIN_RUNNING_ORPHAN_AGE;
    };
    let commit = &job.spec.job.commit;
    let retries = Duration::from_millis(commit.max_backoff_ms.saturating_mul(u64::from(commit.max_attempts)));
    MIN_RUNNING_ORPHAN_AGE.max(interval.saturating_mul(3).saturating_add(retries)).min(ORPHAN_FLOOR)
}

/// Runs the maintenance `opts` asks for on `job`'s sink tables.
pub fn maintain(job: &EngineConfig, host: &PluginHost, opts: &MaintainOptions) -> Result<MaintainReport, EngineError> {
    let plugin = super::setup::load_plugin(job, host)?;
    require_maintenance(&plugin)?;
    if let Some(age) = opts.remove_orphans_older_than
        && age < ORPHAN_FLOOR
    {
        // Beside a running writer only age protects the files of its round
        // under way: a short retention is for tables no job writes now.
        for running in std::iter::once(job).chain(&opts.protect) {
            let least = least_beside(running);
            if age >= least {
                continue;
            }
            let least = humantime::format_duration(least);
            let holder = CheckpointStore::run_holds(&running.state, &running.state_stores).map_err(|e| {
                EngineError::OrphanAgeUnchecked {
                    age: humantime::format_duration(age).to_string(),
                    job: running.spec.job.id.clone(),
                    state_dir: running.state.to_string(),
                    least: least.to_string(),
                    source: Box::new(e),
                }
            })?;
            if let Some(holder) = holder {
                return Err(EngineError::OrphanAgeTooShort {
                    age: humantime::format_duration(age).to_string(),
                    job: running.spec.job.id.clone(),
                    holder,
                    least: least.to_string(),
                });
            }
        }
    }
    let store = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)?;
    let (incarnation, attempt, known) = match &store {
        Some(store) => (store.incarnation()?.map(|i| i.id), store.attempts()?, known_tables(store)?),
        None => (None, 0, Vec::new()),
    };
    let grants = Granted::open(&job.grants(), &opts.faults)?;
    let mut limits = Limits::of(&job.spec.sink.sandbox);
    limits.call_timeout = opts.timeout;
    let ctx = SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: incarnation.unwrap_or_else(|| "maintenance".to_string()),
        refuse_other_incarnations: false,
        beside: false,
        subtask: 0,
        parallelism: 1,
        attempt: attempt.saturating_add(1),
        dead_letter_table: None,
        incarnation_created_ms: 0,
    };
    let mut maintainer = Maintainer::open(&plugin, &grants, limits, ctx, job)?;
    let plan = Plan {
        target_file_bytes: opts.compact.then_some(opts.target_file_bytes),
        expire_older_than: opts.expire_older_than,
        keep_last: opts.keep_last,
        remove_orphans_older_than: opts.remove_orphans_older_than,
        force: opts.force,
        dry_run: opts.dry_run,
    };
    run_pass(&mut maintainer, &plan, tables_to_maintain(&opts.tables, known), job, &opts.protect)
}

/// How a table names `job`'s writers: `<job>.<sink>.<incarnation>`, with
/// the incarnation its state directory holds, and `<job>.<sink>` (a claim,
/// or files written before incarnations). Another incarnation of the same
/// job (`--new-incarnation`, another state directory) is another writer,
/// whose pending checkpoints this command cannot read: never seen here.
fn writer_keys(job: &EngineConfig) -> Result<Vec<String>, EngineError> {
    let short = format!("{}.{}", job.spec.job.id, job.spec.sink.id);
    let store = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)?;
    let incarnation = match &store {
        Some(store) => store.incarnation()?.map(|i| i.id),
        None => None,
    };
    Ok(incarnation.map(|i| format!("{short}.{i}")).into_iter().chain(std::iter::once(short)).collect())
}

/// The writers a table's notes name by the plugin's [`WRITERS_NOTE`],
/// taken out of them; `None` when they name none that way (or not readably).
fn take_writers(notes: &mut Vec<String>) -> Option<Vec<String>> {
    let mut named: Option<Vec<String>> = None;
    let mut unreadable = false;
    notes.retain(|note| {
        let Some(list) = note.strip_prefix(WRITERS_NOTE) else { return true };
        match serde_json::from_str::<Vec<String>>(list) {
            Ok(list) => named.get_or_insert_with(Vec::new).extend(list),
            Err(_) => unreadable = true,
        }
        false
    });
    if unreadable { None } else { named }
}

/// Per table (the target's name) that names jobs not `seen`: those jobs,
/// or `None` when its report does not say which jobs write it.
type Unseen = BTreeMap<String, Option<Vec<String>>>;

/// The [`Unseen`] of `report`, whose writer notes are taken out.
fn unseen_in(report: &mut MaintainReport, seen: &BTreeSet<String>) -> Unseen {
    let mut out = Unseen::new();
    for t in &mut report.tables {
        match take_writers(&mut t.notes) {
            Some(named) => {
                let others: BTreeSet<String> = named.into_iter().filter(|w| !seen.contains(w)).collect();
                if !others.is_empty() {
                    out.insert(t.target.clone(), Some(others.into_iter().collect()));
                }
            }
            None => {
                out.insert(t.target.clone(), None);
            }
        }
    }
    out
}

fn jobs_of(named: &Option<Vec<String>>) -> String {
    match named {
        Some(jobs) => format!("{} (job.sink)", jobs.join(", ")),
        None => "jobs its plugin does not name".to_string(),
    }
}

fn describe(unseen: &Unseen) -> String {
    let tables: Vec<String> = unseen.iter().map(|(t, named)| format!("table {t}: {}", jobs_of(named))).collect();
    tables.join("; ")
}

/// One pass over `tables`, protecting the pending checkpoints of `job` and
/// `protect`. When the orphan retention asked for is below
/// [`ORPHAN_FLOOR`], a first pass learns which jobs the tables name, and
/// the floor is kept while one of them is not seen (unless forced).
fn run_pass(
    maintainer: &mut Maintainer,
    plan: &Plan,
    tables: Vec<String>,
    job: &EngineConfig,
    protect: &[EngineConfig],
) -> Result<MaintainReport, EngineError> {
    let mut seen = BTreeSet::new();
    for j in std::iter::once(job).chain(protect) {
        seen.extend(writer_keys(j)?);
    }
    let asked = plan.remove_orphans_older_than;
    let mut age = asked;
    // The cutoff is fixed before the first pass lists anything: a file
    // written after that listing (a writer it could not name yet) is
    // younger than the cutoff, so the second pass keeps it.
    let started = i64::try_from(now_ms()).unwrap_or(i64::MAX);
    let cutoff_of = |age: Duration| started.saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
    let mut before = Unseen::new();
    if let Some(asked) = asked
        && asked < ORPHAN_FLOOR
    {
        let names = MaintainRequest {
            tables: tables.clone(),
            target_file_bytes: None,
            expiry: None,
            orphans_older_than_ms: Some(i64::MIN),
            protected: Vec::new(),
            dry_run: true,
        };
        before = unseen_in(&mut maintainer.pass(&names)?, &seen);
        if !before.is_empty() {
            let (asked_, floor) = (humantime::format_duration(asked), humantime::format_duration(ORPHAN_FLOOR));
            if plan.force {
                tracing::warn!(
                    job = %job.spec.job.id,
                    unseen = %describe(&before),
                    "--force: orphan cleanup removes files down to {asked_}, below the floor of {floor}, though the \
                     tables name jobs whose state it cannot see: a file a pending checkpoint of theirs names may be \
                     removed, and its recovery then refuses that checkpoint (its rows are lost unless the files come back)"
                );
            } else {
                age = Some(ORPHAN_FLOOR);
                tracing::warn!(
                    job = %job.spec.job.id,
                    unseen = %describe(&before),
                    "orphan cleanup keeps every file younger than {floor} (not {asked_}): the tables name jobs whose \
                     state it cannot see; give their job files with --protect"
                );
            }
        }
    }
    let request = plan.request(tables, age.map(cutoff_of), || {
        let mut protected = pending_of(job)?;
        for other in protect {
            protected.extend(pending_of(other)?);
        }
        Ok(protected)
    })?;
    let mut report = maintainer.pass(&request)?;
    if let (Some(asked), Some(age)) = (asked, age) {
        let after = unseen_in(&mut report, &seen);
        annotate(&mut report, asked, age, plan.force, &before, &after, &job.spec.job.id);
    }
    Ok(report)
}

/// Tells, per table, which jobs orphan cleanup could not see and what
/// retention it used (`age`, for `asked`).
fn annotate(
    report: &mut MaintainReport,
    asked: Duration,
    age: Duration,
    force: bool,
    before: &Unseen,
    after: &Unseen,
    job: &str,
) {
    let (asked_, floor) = (humantime::format_duration(asked), humantime::format_duration(ORPHAN_FLOOR));
    let floored = age > asked;
    for t in &mut report.tables {
        let Some(named) = after.get(&t.target).or_else(|| before.get(&t.target)) else {
            if floored {
                t.notes.push(format!(
                    "orphan cleanup kept every file younger than {floor} here too, not only those younger than \
                     {asked_}: one cutoff serves every table of the pass, and another table names jobs whose \
                     state this command cannot see"
                ));
            }
            continue;
        };
        let jobs = jobs_of(named);
        let note = if floored {
            format!(
                "orphan cleanup kept every file younger than {floor} (the floor), not only those younger than \
                 {asked_}: the table names {jobs}, whose state this command cannot see, and a pending checkpoint \
                 of theirs may name files that look orphaned. Give their job files with --protect to use the \
                 shorter retention (--force lowers the floor at the risk of their pending files)"
            )
        } else if asked >= ORPHAN_FLOOR {
            format!(
                "the table names {jobs}, whose state this command cannot see: only files older than {asked_} \
                 (at least the floor of {floor}) were considered"
            )
        } else if force {
            format!(
                "--force: orphan cleanup went down to {asked_}, below the floor of {floor}, though the table \
                 names {jobs}, whose state this command cannot see: files a pending checkpoint of theirs names \
                 may be gone, and its recovery then refuses that checkpoint (its rows lost unless the files come back)"
            )
        } else {
            // Named only by the second look: a first commit landed between the two.
            tracing::warn!(%job, table = %t.target, unseen = %jobs, "a job first committed to the table during orphan cleanup");
            format!(
                "the table names {jobs} only since this pass began (a first commit meanwhile), whose state this \
                 command cannot see: files younger than {floor} of a pending checkpoint of theirs may have been \
                 removed; give their job files with --protect next time"
            )
        };
        t.notes.push(note);
    }
}

/// A running job's maintenance (`[sink.maintenance]`): a pass every
/// `every` on a thread of its own, in a plugin instance of its own, so that
/// no checkpoint's commit ever waits for it. The target's own concurrency
/// control orders the two: a compaction commit asserts the head it read
/// and that every file it replaces is still live, and a checkpoint's
/// append that meets the replace retries as after any conflict.
pub(super) struct Background {
    stop: Option<mpsc::Sender<()>>,
    /// Disconnected once the thread has ended (its sender dropped).
    ended: mpsc::Receiver<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How long the end of a run waits for a pass under way before it lets the
/// pass go on alone (a pass commits whole or not at all, so a run, or a
/// process, that ends under it loses nothing).
const SETTLE: Duration = Duration::from_secs(30);

impl Background {
    /// Starts the passes, the first one `every` from now. The instance is
    /// opened here, so that a plugin that cannot maintain is refused before
    /// the run writes anything.
    pub(super) fn start(
        job: &EngineConfig,
        plugin: &Plugin,
        grants: &Granted,
        ctx: SinkCtx,
        metrics: Metrics,
    ) -> Result<Option<Self>, EngineError> {
        let Some(m) = job.maintenance.clone() else { return Ok(None) };
        require_maintenance(plugin)?;
        let mut limits = Limits::of(&job.spec.sink.sandbox);
        limits.call_timeout = m.timeout;
        // The jobs to protect were loaded with the job (a wrong path was
        // refused then); each pass reads their state anew.
        let protect = m.protect.clone();
        let opened = Maintainer::open(plugin, grants, limits, ctx.clone(), job)?;
        let plan = Plan {
            target_file_bytes: Some(m.target_file_bytes),
            expire_older_than: m.expire_older_than,
            keep_last: m.keep_last,
            remove_orphans_older_than: m.remove_orphans_older_than,
            force: false,
            dry_run: false,
        };
        let (stop, stopped) = mpsc::channel::<()>();
        let (alive, ended) = mpsc::channel::<()>();
        let (job, plugin, grants) = (job.clone(), plugin.clone(), grants.clone());
        let thread = std::thread::Builder::new()
            .name("sluice-maintenance".to_string())
            .spawn(move || {
                let _alive = alive;
                let mut maintainer = Some(opened);
                // A stop request, or the run gone: no further pass.
                while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(m.every) {
                    let instance = match maintainer.take() {
                        Some(open) => Ok(open),
                        None => Maintainer::open(&plugin, &grants, limits, ctx.clone(), &job),
                    };
                    let result = instance.and_then(|mut open| {
                        let done = background_pass(&job, &protect, &plan, &mut open);
                        // A failed instance may be dead (a trap): the next pass opens a new one.
                        if done.is_ok() {
                            maintainer = Some(open);
                        }
                        done
                    });
                    let job_id = &job.spec.job.id;
                    match result {
                        Ok(report) => {
                            let compacted: u64 = report.tables.iter().map(|t| t.files_compacted).sum();
                            metrics.maintained(job_id, Some(compacted));
                            tracing::info!(job = %job_id, report = %report.to_string().trim_end(), "maintenance pass done");
                        }
                        Err(e) => {
                            metrics.maintained(job_id, None);
                            tracing::warn!(job = %job_id, error = %e, "maintenance pass failed; the job goes on, and the next pass tries again");
                        }
                    }
                }
            })
            .map_err(EngineError::MaintenanceThread)?;
        Ok(Some(Self { stop: Some(stop), ended, thread: Some(thread) }))
    }
}

/// One pass of a running job: its current tables, and (for orphan cleanup)
/// its and the `protect`ed jobs' pending checkpoints read right before,
/// with the same floor as `sluice maintain` (never forced).
fn background_pass(
    job: &EngineConfig,
    protect: &[EngineConfig],
    plan: &Plan,
    maintainer: &mut Maintainer,
) -> Result<MaintainReport, EngineError> {
    let store = CheckpointStore::inspect_at(&job.state, &job.spec.job.id, &job.state_stores)?;
    let known = match &store {
        Some(store) => known_tables(store)?,
        None => Vec::new(),
    };
    run_pass(maintainer, plan, tables_to_maintain(&[], known), job, protect)
}

impl Drop for Background {
    /// Asks for no further pass and waits up to [`SETTLE`] for the one under
    /// way; a longer one goes on alone (and ends with the process).
    fn drop(&mut self) {
        drop(self.stop.take());
        let Some(thread) = self.thread.take() else { return };
        if let Err(mpsc::RecvTimeoutError::Timeout) = self.ended.recv_timeout(SETTLE) {
            tracing::warn!(
                "a maintenance pass is still running; the run ends without waiting for it \
                 (a pass commits whole or not at all)"
            );
            return;
        }
        if thread.join().is_err() {
            tracing::error!("the maintenance thread panicked");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(target: &str, notes: &[&str]) -> TableMaintained {
        TableMaintained {
            target: target.to_string(),
            files_compacted: 0,
            files_written: 0,
            rows_rewritten: 0,
            snapshots_expired: 0,
            files_removed: Vec::new(),
            notes: notes.iter().map(|n| n.to_string()).collect(),
        }
    }

    #[test]
    fn writers_a_table_names_are_read_from_the_plugins_note_and_seen_ones_dropped() {
        let named = format!("{WRITERS_NOTE}[\"a.lake\",\"b.lake\"]");
        let none = format!("{WRITERS_NOTE}[]");
        let garbled = format!("{WRITERS_NOTE}b.lake");
        let mut report = MaintainReport {
            dry_run: true,
            tables: vec![
                table("db.named", &["other", &named]),
                table("db.none", &[&none]),
                table("db.silent", &["the plugin said nothing of writers"]),
                table("db.garbled", &[&garbled]),
            ],
        };
        let seen = BTreeSet::from(["a.lake".to_string()]);
        let unseen = unseen_in(&mut report, &seen);
        assert_eq!(unseen.get("db.named"), Some(&Some(vec!["b.lake".to_string()])));
        assert!(!unseen.contains_key("db.none"));
        // What does not say which jobs write it is not taken for "none".
        assert_eq!(unseen.get("db.silent"), Some(&None));
        assert_eq!(unseen.get("db.garbled"), Some(&None));
        // The plugin's notes are taken out; the others stay.
        assert_eq!(report.tables[0].notes, ["other"]);
        assert!(report.tables[1].notes.is_empty());
        assert!(describe(&unseen).contains("table db.named: b.lake (job.sink)"));
    }
}
