//! The plugin conformance suite: proves a sink plugin exactly once against
//! its own target, with the grants of a user's job file.
//!
//! Each case runs the engine on a generator job built from the user's job:
//! its `[sink]` section (options, grants, catalog, endpoints, sandbox) with
//! the plugin under test, a job id of its own and a state directory in a
//! temporary folder. Each case's rows have an id range of their own, so one
//! reading of the target checks every case, whatever else it holds.
//!
//! Invariants:
//! - a case passes only on what became visible, read back from the target
//!   (Parquet file trees and Iceberg tables natively, anything else through
//!   the user's `--verify-cmd`), never on what the plugin answered;
//! - the suite writes only through the plugin and the job's grants, and
//!   when it ends removes what it made in file trees (entries named after
//!   its job ids) and an Iceberg table it created (with its files); a table
//!   that existed before keeps the suite's snapshots: point the job at a
//!   scratch target;
//! - a crash is the engine's own (`fault-injection`): it stops at once
//!   without any cleanup call, as a killed process would.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sluice_engine::bindings::CommitOutcome;
use sluice_engine::config::EngineConfig;
use sluice_engine::plugin::{PluginHost, SinkCtx, SourceTable, WriterInstance};
use sluice_engine::progress::ProgressMode;
use sluice_engine::source::generator::Generator;
use sluice_engine::{self as engine, CrashPoint, EngineError, Fault, RunOptions, RunSummary};

/// Why the suite cannot run at all (as opposed to a failing case).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("reading the job file {path}: {source}")]
    ReadJob { path: PathBuf, source: std::io::Error },
    #[error("the job file {path} is not valid TOML: {source}")]
    ParseJob { path: PathBuf, source: toml::de::Error },
    #[error("the job file {path} has no [sink] section")]
    NoSink { path: PathBuf },
    #[error(
        "no built-in checker fits this sink (it reads Parquet file trees under option `path`, and Iceberg tables named by option `table` with a [sink.catalog]): pass --verify-cmd, a command that prints the visible ids"
    )]
    NoChecker,
    #[error("making a temporary directory: {0}")]
    Temp(std::io::Error),
}

/// Why a case failed. The suite reports a case's error as its detail; one
/// kind ([`CaseError::NothingToRead`]) stops the whole suite, since every
/// later case would fail the same way for a reason that is not the plugin's.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    /// What became visible (or what the engine answered) is not what
    /// exactly-once requires.
    #[error("{0}")]
    Expected(String),
    /// A run of the engine failed where the case needed it to finish.
    #[error("{context}: {source}")]
    Run {
        context: String,
        #[source]
        source: Box<EngineError>,
    },
    #[error(transparent)]
    Engine(Box<EngineError>),
    #[error(transparent)]
    Plugin(Box<sluice_engine::plugin::PluginError>),
    #[error("the case's job: {0}")]
    Job(#[from] sluice_engine::config::JobError),
    #[error("writing the case's job: {0}")]
    JobText(#[from] toml::ser::Error),
    #[error("encoding rows: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("reading {path}: {source}")]
    Parquet {
        path: PathBuf,
        #[source]
        source: parquet::errors::ParquetError,
    },
    #[error("reading the Iceberg table: {0}")]
    Iceberg(#[from] iceberg::Error),
    #[error("the Iceberg table {table}: {message}")]
    Catalog { table: String, message: String },
    #[error("the target's `id` column: {0}")]
    IdColumn(String),
    #[error("--verify-cmd: {0}")]
    VerifyCmd(String),
    /// The built-in checker found files in the target, none of its format.
    #[error(
        "the built-in checker reads Parquet files, and {location} holds files ({example}, ...) but no Parquet file: \
         it cannot see what this plugin writes. Pass --verify-cmd, a command that prints the visible ids"
    )]
    NothingToRead { location: PathBuf, example: String },
}

fn expected(message: impl Into<String>) -> CaseError {
    CaseError::Expected(message.into())
}

/// The engine's errors are large; boxed, a case's `Result` stays small.
impl From<EngineError> for CaseError {
    fn from(e: EngineError) -> Self {
        CaseError::Engine(Box::new(e))
    }
}

impl From<sluice_engine::plugin::PluginError> for CaseError {
    fn from(e: sluice_engine::plugin::PluginError) -> Self {
        CaseError::Plugin(Box::new(e))
    }
}

/// A run that failed where the case needed it to finish.
fn run_failed(context: impl Into<String>) -> impl FnOnce(EngineError) -> CaseError {
    let context = context.into();
    move |source| CaseError::Run { context, source: Box::new(source) }
}

/// How the suite reads what became visible.
#[derive(Debug, Clone)]
pub enum Checker {
    /// Every `*.parquet` file under this directory, column `id`.
    ParquetTree(PathBuf),
    /// An Iceberg table of the job's catalog, column `id`.
    Iceberg { table: String },
    /// A shell command printing the visible ids (whitespace-separated).
    Command(String),
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub name: &'static str,
    pub passed: bool,
    pub elapsed: Duration,
    pub detail: String,
}

/// The suite's settings.
pub struct Suite {
    plugin: PathBuf,
    job_path: PathBuf,
    job: toml::Table,
    checker: Checker,
    rows: u64,
    /// Ids of case `k` start at `base + k * STRIDE`.
    base: u64,
    nonce: String,
    temp: tempfile::TempDir,
    host: PluginHost,
}

const STRIDE: u64 = 1_000_000;
const PARALLELISM: u64 = 2;

type CaseFn = fn(&Suite, u64) -> Result<String, CaseError>;

/// The cases, in the order they run.
pub const CASES: &[(&str, CaseFn)] = &[
    ("describe and validate answer", case_describe_validate),
    ("crash after a write, then restore", |s, k| s.crash_case(k, CrashPoint::AfterWrite)),
    ("crash after prepare-commit, then restore", |s, k| s.crash_case(k, CrashPoint::AfterPrepareCommit)),
    ("crash after snapshot-state, then restore", |s, k| s.crash_case(k, CrashPoint::AfterSnapshotState)),
    ("crash after the checkpoint is persisted, then restore", |s, k| s.crash_case(k, CrashPoint::AfterPersist)),
    ("commit reply lost after its side effect, then restore", |s, k| s.crash_case(k, CrashPoint::DuringCommit)),
    ("crash after commit: a second commit changes nothing", |s, k| s.crash_case(k, CrashPoint::AfterCommit)),
    ("crash inside evolve (a schema change), then restore", |s, k| s.evolve_case(k, CrashPoint::DuringEvolve)),
    ("crash after evolve, before the writers apply it, then restore", |s, k| s.evolve_case(k, CrashPoint::AfterEvolve)),
    ("a replay batched differently", case_rebatched_replay),
    ("nothing visible before commit", case_nothing_before_commit),
    ("abort-prepare and abort leave nothing visible", case_aborts),
];

impl Suite {
    /// Prepares the suite for `plugin` with the sink section of `job_path`.
    pub fn new(
        plugin: &Path,
        job_path: &Path,
        verify_cmd: Option<String>,
        rows: u64,
        cache_dir: Option<PathBuf>,
    ) -> Result<Self, anyhow::Error> {
        let text = std::fs::read_to_string(job_path)
            .map_err(|source| SetupError::ReadJob { path: job_path.to_path_buf(), source })?;
        let job: toml::Table =
            text.parse().map_err(|source| SetupError::ParseJob { path: job_path.to_path_buf(), source })?;
        let sink = job.get("sink").and_then(|s| s.as_table()).ok_or(SetupError::NoSink { path: job_path.into() })?;
        let options = sink.get("options").and_then(|o| o.as_table());
        let option = |name: &str| options.and_then(|o| o.get(name)).and_then(|v| v.as_str()).map(str::to_string);
        let base_dir = job_path.parent().unwrap_or(Path::new(".")).to_path_buf();
        let checker = match (verify_cmd, sink.get("catalog").is_some(), option("table"), option("path")) {
            (Some(cmd), ..) => Checker::Command(cmd),
            (None, true, Some(table), _) => Checker::Iceberg { table },
            (None, _, _, Some(path)) => Checker::ParquetTree(base_dir.join(path)),
            _ => return Err(SetupError::NoChecker.into()),
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let temp = tempfile::Builder::new().prefix("sluice-plugin-test-").tempdir().map_err(SetupError::Temp)?;
        Ok(Self {
            plugin: sluice_engine::config::absolute(plugin).map_err(anyhow::Error::msg)?,
            job_path: job_path.to_path_buf(),
            job,
            checker,
            rows: rows.max(PARALLELISM * 6),
            base: (now.as_secs() % 1_000_000) * 1_000 * STRIDE,
            nonce: format!("{:x}", now.as_millis() % 0xff_ffff),
            temp,
            host: PluginHost::new(cache_dir)?,
        })
    }

    pub fn checker(&self) -> &Checker {
        &self.checker
    }

    /// The job id of case `k`: it prefixes every name the sink makes.
    fn job_id(&self, k: u64) -> String {
        format!("conformance-{}-{k}", self.nonce)
    }

    fn first_id(&self, k: u64) -> u64 {
        self.base + k * STRIDE
    }

    /// The job of case `k`, with `batch_rows` rows per source batch.
    fn job(&self, k: u64, batch_rows: u64) -> Result<EngineConfig, CaseError> {
        self.job_with(k, batch_rows, None)
    }

    /// [`Suite::job`] whose rows change shape (`qty` widened, a column
    /// added) at id `evolve_at`.
    fn job_with(&self, k: u64, batch_rows: u64, evolve_at: Option<u64>) -> Result<EngineConfig, CaseError> {
        let mut table = self.job.clone();
        let every = self.rows / PARALLELISM / 3;
        let state = self.temp.path().join(format!("state-{k}"));
        let job: toml::Table = toml::toml! {
            parallelism = 2
            [checkpoint]
            every_rows = 0
        };
        let mut job = job;
        job.insert("id".into(), self.job_id(k).into());
        job.insert("state_dir".into(), state.display().to_string().into());
        if let Some(toml::Value::Table(c)) = job.get_mut("checkpoint") {
            c.insert("every_rows".into(), toml::Value::Integer(every as i64));
        }
        table.insert("job".into(), job.into());
        let mut source = toml::Table::new();
        source.insert("kind".into(), "generator".into());
        source.insert("rows".into(), toml::Value::Integer(self.rows as i64));
        source.insert("first_id".into(), toml::Value::Integer(self.first_id(k) as i64));
        source.insert("batch_rows".into(), toml::Value::Integer(batch_rows as i64));
        if let Some(at) = evolve_at {
            source.insert("evolve_at".into(), toml::Value::Integer(at as i64));
        }
        table.insert("source".into(), source.into());
        if let Some(toml::Value::Table(sink)) = table.get_mut("sink") {
            sink.insert("plugin".into(), self.plugin.display().to_string().into());
        }
        let text = toml::to_string(&table)?;
        Ok(sluice_job::from_str(&text, &self.job_path, &[])?)
    }

    fn run(&self, job: &EngineConfig, fault: Option<Fault>) -> Result<RunSummary, EngineError> {
        let mut opts = RunOptions::new(ProgressMode::Quiet, false);
        opts.faults.crash = fault;
        engine::run(job, &self.host, &opts)
    }

    /// The visible ids of case `k`, sorted.
    fn visible(&self, k: u64) -> Result<Vec<i64>, CaseError> {
        let (lo, hi) = (self.first_id(k) as i64, (self.first_id(k) + self.rows) as i64);
        let mut ids: Vec<i64> = self.read_all()?.into_iter().filter(|id| (lo..hi).contains(id)).collect();
        ids.sort_unstable();
        Ok(ids)
    }

    fn read_all(&self) -> Result<Vec<i64>, CaseError> {
        match &self.checker {
            Checker::ParquetTree(dir) => read_parquet_tree(dir),
            Checker::Iceberg { table } => self.read_iceberg(table),
            Checker::Command(cmd) => read_command(cmd),
        }
    }

    fn read_iceberg(&self, table: &str) -> Result<Vec<i64>, CaseError> {
        use futures::TryStreamExt;
        use sluice_engine::bindings::v0_2::sluice::connector::iceberg_catalog::CatalogError;
        let job = self.job(0, 700)?;
        let (grants, _) = engine::grants_and_limits(&job)?;
        let catalog = grants.catalog.ok_or_else(|| CaseError::Catalog {
            table: table.to_string(),
            message: "the job has no [sink.catalog]".into(),
        })?;
        let ident = iceberg::TableIdent::from_strs(table.split('.'))?;
        let table = match catalog.load(&ident) {
            Ok(t) => t,
            // Nothing was committed yet: the table is made by the first commit or `evolve`.
            Err(CatalogError::NotFound(_)) => return Ok(Vec::new()),
            Err(e) => return Err(CaseError::Catalog { table: ident.to_string(), message: format!("{e:?}") }),
        };
        let io = |e: std::io::Error| CaseError::Io { path: PathBuf::from("(runtime)"), source: e };
        let rt = tokio::runtime::Builder::new_current_thread().build().map_err(io)?;
        let batches: Vec<arrow_array::RecordBatch> = rt.block_on(async {
            let scan = table.scan().select(["id"]).build()?;
            let stream = scan.to_arrow().await?;
            stream.try_collect().await
        })?;
        let mut ids = Vec::new();
        for b in &batches {
            ids.extend(id_column(b)?);
        }
        Ok(ids)
    }

    /// Every id of case `k` visible exactly once.
    fn expect_exactly_once(&self, k: u64) -> Result<(), CaseError> {
        let ids = self.visible(k)?;
        let first = self.first_id(k) as i64;
        let all: Vec<i64> = (first..first + self.rows as i64).collect();
        if ids == all {
            return Ok(());
        }
        let mut seen = BTreeMap::new();
        for id in &ids {
            *seen.entry(*id).or_insert(0u32) += 1;
        }
        let twice = seen.iter().filter(|(_, n)| **n > 1).count();
        let missing = all.iter().filter(|id| !seen.contains_key(id)).count();
        Err(expected(format!(
            "{} rows visible of {}: {missing} missing, {twice} visible more than once",
            ids.len(),
            self.rows
        )))
    }

    fn expect_no_duplicates(&self, k: u64, when: &str) -> Result<usize, CaseError> {
        let ids = self.visible(k)?;
        let mut dedup = ids.clone();
        dedup.dedup();
        if dedup.len() != ids.len() {
            return Err(expected(format!("{} ids visible more than once {when}", ids.len() - dedup.len())));
        }
        Ok(ids.len())
    }

    fn crash_case(&self, k: u64, point: CrashPoint) -> Result<String, CaseError> {
        let job = self.job(k, 700)?;
        let first = self.first_id(k);
        let Restored { after_crash, summary, .. } = crash_and_restore(&CrashCheck {
            fault: Fault { point, checkpoint: 2, subtask: 1 },
            first_id: first,
            rows: self.rows,
            run: &|fault| self.run(&job, fault),
            visible: &|| self.read_all(),
            may_not_happen: false,
        })?;
        // Recovery commits checkpoint 2 again (the visible rows decide the
        // case; the answer is reported). A commit that completed should
        // answer already-committed, but a plugin whose service cannot tell
        // (BigQuery's FlushRows may answer a repeated flush with OK) answers
        // committed, and that is no loss as long as nothing shows twice.
        let mut answer = String::new();
        if point >= CrashPoint::AfterPersist {
            match summary.recovered.as_slice() {
                [(2, CommitOutcome::AlreadyCommitted)] => {
                    answer = ", the second commit answered already-committed".into()
                }
                [(2, CommitOutcome::Committed)] if point == CrashPoint::AfterCommit => {
                    answer = ", the second commit answered committed (the plugin could not tell it was done)".into()
                }
                [(2, CommitOutcome::Committed)] => answer = ", the restore committed it".into(),
                other => return Err(expected(format!("recovery committed {other:?}; expected checkpoint 2"))),
            }
        }
        Ok(format!("{after_crash} rows visible after the crash, all {} after the restore{answer}", self.rows))
    }
}

fn case_describe_validate(s: &Suite, _k: u64) -> Result<String, CaseError> {
    let plugin = s.host.load(&s.plugin)?;
    let job = s.job(0, 700)?;
    let report = engine::check(&job, &s.host);
    if !report.problems.is_empty() {
        return Err(expected(report.problems.join("; ")));
    }
    let version = plugin.info().map(|i| i.version.clone()).unwrap_or_default();
    Ok(format!("{} {version} (contract {})", plugin.name, plugin.version()))
}

fn case_rebatched_replay(s: &Suite, k: u64) -> Result<String, CaseError> {
    let first = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    match s.run(&s.job(k, 700)?, Some(first)) {
        Err(e) if e.is_injected_crash() => {}
        other => return Err(expected(format!("expected the first crash, got {other:?}"))),
    }
    let second = Fault { point: CrashPoint::DuringCommit, checkpoint: 3, subtask: 0 };
    match s.run(&s.job(k, 333)?, Some(second)) {
        Err(e) if e.is_injected_crash() => {}
        other => return Err(expected(format!("expected the second crash, got {other:?}"))),
    }
    s.expect_no_duplicates(k, "after two crashes")?;
    s.run(&s.job(k, 1001)?, None).map_err(run_failed("the last run"))?;
    s.expect_exactly_once(k)?;
    Ok("batches of 700, then 333, then 1001 rows".into())
}

fn case_nothing_before_commit(s: &Suite, k: u64) -> Result<String, CaseError> {
    let job = s.job(k, 700)?;
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    match s.run(&job, Some(fault)) {
        Err(e) if e.is_injected_crash() => {}
        other => return Err(expected(format!("expected the crash, got {other:?}"))),
    }
    let visible = s.visible(k)?;
    if !visible.is_empty() {
        return Err(expected(format!("{} rows visible although no checkpoint was committed", visible.len())));
    }
    s.run(&job, None).map_err(run_failed("the recovery run"))?;
    s.expect_exactly_once(k)?;
    Ok("0 rows visible with checkpoint 1 persisted but not committed".into())
}

impl Suite {
    /// The schema changes in the middle of writer 1's first round, so the
    /// barrier ends checkpoint 1 and the target evolves before checkpoint 2;
    /// the crash hits inside `committer.evolve` (after its first side
    /// effect) or right after it. Plugins of contract 0.1 take no changes.
    fn evolve_case(&self, k: u64, point: CrashPoint) -> Result<String, CaseError> {
        let plugin = self.host.load(&self.plugin)?;
        if plugin.version() == sluice_engine::plugin::ContractVersion::V0_1 {
            return Ok("not applicable: contract 0.1 has no schema changes".into());
        }
        let every = self.rows / PARALLELISM / 3;
        let at = self.first_id(k) + self.rows / PARALLELISM + every / 2;
        let job = self.job_with(k, 700, Some(at))?;
        let restored = crash_and_restore(&CrashCheck {
            fault: Fault { point, checkpoint: 1, subtask: 0 },
            first_id: self.first_id(k),
            rows: self.rows,
            run: &|fault| self.run(&job, fault),
            visible: &|| self.read_all(),
            may_not_happen: point == CrashPoint::DuringEvolve,
        })?;
        if !restored.crashed {
            return Ok(format!("evolve had no side effect to cut short; the run landed all {} rows once", self.rows));
        }
        Ok(format!(
            "rows change shape at id {at}; {} visible after the crash, all {} after the restore",
            restored.after_crash, self.rows
        ))
    }
}

/// One crash followed by a restore, as the suite and the engine's own
/// crash matrices run it.
pub struct CrashCheck<'a> {
    pub fault: Fault,
    /// The job's rows have ids `first_id..first_id + rows`.
    pub first_id: u64,
    pub rows: u64,
    /// Runs the job (with the fault, then without).
    pub run: &'a dyn Fn(Option<Fault>) -> Result<RunSummary, EngineError>,
    /// Every id visible in the target now (others than the job's are ignored).
    pub visible: &'a dyn Fn() -> Result<Vec<i64>, CaseError>,
    /// The crash may not come (a crash after a side effect of a call that
    /// has none): then the run must simply have landed every row once.
    pub may_not_happen: bool,
}

/// What a crash and its restore left.
pub struct Restored {
    /// Rows of the job visible right after the crash (each once).
    pub after_crash: usize,
    /// The restore run's summary (the run's own when the crash never came).
    pub summary: RunSummary,
    /// Whether the crash came.
    pub crashed: bool,
}

/// Runs the job into the injected crash, checks that no row shows twice,
/// runs it again, and checks that every row shows exactly once.
pub fn crash_and_restore(check: &CrashCheck<'_>) -> Result<Restored, CaseError> {
    let point = check.fault.point;
    let (lo, hi) = (check.first_id as i64, (check.first_id + check.rows) as i64);
    let uncrashed = match (check.run)(Some(check.fault)) {
        Err(e) if e.is_injected_crash() => None,
        Err(e) => return Err(run_failed(format!("the run before the crash at {point}"))(e)),
        Ok(summary) if check.may_not_happen => Some(summary),
        Ok(_) => return Err(expected(format!("the crash at {point} never happened (too few rows?)"))),
    };
    let visible = || -> Result<Vec<i64>, CaseError> {
        let mut ids: Vec<i64> = (check.visible)()?.into_iter().filter(|id| (lo..hi).contains(id)).collect();
        ids.sort_unstable();
        Ok(ids)
    };
    let ids = visible()?;
    if let Some(summary) = uncrashed {
        if ids != (lo..hi).collect::<Vec<_>>() {
            return Err(expected(format!(
                "the run without the crash left {} rows visible of {}",
                ids.len(),
                check.rows
            )));
        }
        return Ok(Restored { after_crash: ids.len(), summary, crashed: false });
    }
    let mut dedup = ids.clone();
    dedup.dedup();
    if dedup.len() != ids.len() {
        return Err(expected(format!(
            "{} rows visible more than once right after the crash at {point}",
            ids.len() - dedup.len()
        )));
    }
    let summary = (check.run)(None).map_err(run_failed(format!("the restore after the crash at {point}")))?;
    if summary.rows_total != check.rows {
        return Err(expected(format!("the restore reported {} rows in total, not {}", summary.rows_total, check.rows)));
    }
    let after = visible()?;
    if after != (lo..hi).collect::<Vec<_>>() {
        let mut dedup = after.clone();
        dedup.dedup();
        return Err(expected(format!(
            "after the restore {} rows are visible of {}: {} missing, {} more than once",
            after.len(),
            check.rows,
            check.rows as usize - dedup.len(),
            after.len() - dedup.len()
        )));
    }
    Ok(Restored { after_crash: ids.len(), summary, crashed: true })
}

/// Drives one writer and the committer directly: rows written and prepared,
/// then `abort-prepare`; rows prepared and combined, then `abort`. Neither
/// may leave a row visible.
fn case_aborts(s: &Suite, k: u64) -> Result<String, CaseError> {
    let job = s.job(k, 700)?;
    let plugin = s.host.load(&s.plugin)?;
    let (grants, limits) = engine::grants_and_limits(&job)?;
    let ctx = |subtask: u32| SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: format!("abort{}", s.nonce),
        refuse_other_incarnations: false,
        beside: false,
        subtask,
        parallelism: 1,
        attempt: 1,
        dead_letter_table: None,
        incarnation_created_ms: 0,
    };
    let schema = sluice_engine::ipc::encode_schema(&Generator::schema_ref())?;
    let tables = [SourceTable { name: String::new(), schema }];
    let options = plugin.options_for(job.sink_options(), &ctx(0));
    let first = s.first_id(k);
    let batch = |from: u64, to: u64| sluice_engine::ipc::encode_batch(&Generator::batch_for(from, to));

    let inst = plugin.instantiate("conformance-writer", &grants, limits)?;
    let mut writer = WriterInstance::open(inst, &ctx(0), &options, &tables, None)?;
    writer.write("", &batch(first, first + 500)?)?;
    let info1 = writer.prepare_commit(1)?;
    writer.snapshot_state(1)?;
    writer.abort_prepare(1)?;
    writer.write("", &batch(first + 500, first + 1000)?)?;
    let info2 = writer.prepare_commit(2)?.ok_or_else(|| expected("prepare-commit(2) reported no rows"))?;
    writer.snapshot_state(2)?;
    let inst = plugin.instantiate("conformance-committer", &grants, limits)?;
    let mut committer = sluice_engine::plugin::CommitterInstance::open(inst, &ctx(0), &options, &tables)?;
    let combined = committer.combine(2, &[info2])?;
    committer.abort(2, &combined)?;
    writer.close()?;
    let visible = s.visible(k)?;
    if !visible.is_empty() {
        return Err(expected(format!("{} rows visible after abort-prepare and abort", visible.len())));
    }
    Ok(format!(
        "prepare-commit(1) {} then abort-prepare; checkpoint 2 combined then aborted: 0 rows visible",
        if info1.is_some() { "prepared rows" } else { "prepared nothing" }
    ))
}

impl Suite {
    /// The catalog and the Iceberg table the suite checks, when it checks one.
    fn iceberg(
        &self,
    ) -> Option<(std::sync::Arc<sluice_engine::capability::catalog::CatalogGrant>, iceberg::TableIdent)> {
        let Checker::Iceberg { table } = &self.checker else { return None };
        let job = self.job(0, 700).ok()?;
        let (grants, _) = engine::grants_and_limits(&job).ok()?;
        Some((grants.catalog?, iceberg::TableIdent::from_strs(table.split('.')).ok()?))
    }

    /// Whether the Iceberg table the suite checks is missing before it runs
    /// (then the suite made it, and drops it at the end).
    pub fn iceberg_table_missing(&self) -> bool {
        self.iceberg().is_some_and(|(catalog, ident)| catalog.load(&ident).is_err())
    }
}

/// Removes what the suite made: entries named after its job ids in a file
/// tree, or the Iceberg table it created (`created`) with its files.
/// Returns a line saying what was removed.
pub fn clean_up(suite: &Suite, created: bool) -> Option<String> {
    if let Some((catalog, ident)) = suite.iceberg() {
        if !created {
            return Some(format!("{ident} existed before: it keeps the suite's snapshots"));
        }
        let location = catalog.load(&ident).ok().map(|t| t.metadata().location().to_string());
        if let Err(e) = catalog.drop_table(&ident) {
            return Some(format!("could not drop the table {ident} the suite created: {e}"));
        }
        let dir = location.map(|l| PathBuf::from(l.strip_prefix("file://").unwrap_or(&l)));
        if let Some(dir) = dir.filter(|d| d.is_dir()) {
            let _ = std::fs::remove_dir_all(&dir);
        }
        return Some(format!("dropped the table {ident} the suite created"));
    }
    let removed = clean_file_tree(suite);
    (removed > 0)
        .then(|| format!("removed the {removed} checkpoint directories and claims the cases left in the target"))
}

/// Removes what the suite's cases made visible or staged in a file tree:
/// entries whose names start with the suite's job ids, under the output
/// directory (and its tables' directories) and its `.staging` sibling.
fn clean_file_tree(suite: &Suite) -> usize {
    let Checker::ParquetTree(dir) = &suite.checker else { return 0 };
    let prefix = format!("conformance-{}-", suite.nonce);
    let staging = PathBuf::from(format!("{}.staging", dir.display()));
    let mut removed = 0;
    for root in [dir.clone(), staging] {
        let Ok(entries) = std::fs::read_dir(&root) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            // The cases' checkpoint directories, and the claims their sinks took (`_sluice_claim.<job>.<sink>.json`).
            let claim = name.strip_prefix("_sluice_claim.").is_some_and(|n| n.starts_with(&prefix));
            if name.starts_with(&prefix) || claim {
                let ok = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                removed += usize::from(ok.is_ok());
            }
        }
    }
    removed
}

/// Runs every case in order; `progress` hears each case start.
///
/// A case whose target the built-in checker cannot read
/// ([`CaseError::NothingToRead`]) stops the suite with that error: the
/// later cases would fail for the checker's sake, not the plugin's.
pub fn run_cases(suite: &Suite, mut progress: impl FnMut(usize, &str)) -> Result<Vec<CaseResult>, CaseError> {
    let mut results = Vec::new();
    for (k, (name, case)) in CASES.iter().enumerate() {
        progress(k, name);
        let started = Instant::now();
        let outcome = case(suite, k as u64 + 1);
        let detail = match outcome {
            Err(e @ CaseError::NothingToRead { .. }) => return Err(e),
            Err(e) => Err(e.to_string()),
            Ok(detail) => Ok(detail),
        };
        results.push(CaseResult {
            name,
            passed: detail.is_ok(),
            elapsed: started.elapsed(),
            detail: detail.unwrap_or_else(|e| e),
        });
    }
    Ok(results)
}

fn id_column(batch: &arrow_array::RecordBatch) -> Result<Vec<i64>, CaseError> {
    use arrow_array::Array;
    let column = batch.column_by_name("id").ok_or_else(|| CaseError::IdColumn("there is none".into()))?;
    let ids = column
        .as_any()
        .downcast_ref::<arrow_array::Int64Array>()
        .ok_or_else(|| CaseError::IdColumn(format!("it is {}, not Int64", column.data_type())))?;
    Ok(ids.iter().flatten().collect())
}

/// The ids of every Parquet file under `dir`. A tree that holds files but
/// none of them Parquet is [`CaseError::NothingToRead`]: the sink writes
/// another format, and the built-in checker would report every row missing.
fn read_parquet_tree(dir: &Path) -> Result<Vec<i64>, CaseError> {
    let mut ids = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    let (mut parquet_files, mut other) = (0usize, None::<PathBuf>);
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(CaseError::Io { path: d, source }),
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                parquet_files += 1;
                let parquet = |source| CaseError::Parquet { path: path.clone(), source };
                let file = std::fs::File::open(&path).map_err(|source| CaseError::Io { path: path.clone(), source })?;
                let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                    .and_then(|b| b.build())
                    .map_err(parquet)?;
                for batch in reader {
                    ids.extend(id_column(&batch?)?);
                }
            } else if !name.starts_with(['.', '_']) {
                // Hidden and `_` files (claims, markers) are no data of any format.
                other.get_or_insert(path);
            }
        }
    }
    match other {
        Some(file) if parquet_files == 0 => Err(CaseError::NothingToRead {
            location: dir.to_path_buf(),
            example: file.strip_prefix(dir).unwrap_or(&file).display().to_string(),
        }),
        _ => Ok(ids),
    }
}

fn read_command(cmd: &str) -> Result<Vec<i64>, CaseError> {
    let out = std::process::Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map_err(|e| CaseError::VerifyCmd(format!("could not start: {e}")))?;
    if !out.status.success() {
        return Err(CaseError::VerifyCmd(format!(
            "failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|w| w.parse::<i64>().map_err(|_| CaseError::VerifyCmd(format!("printed {w:?}, not an id"))))
        .collect()
}
