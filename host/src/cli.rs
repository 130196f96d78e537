//! The `sluice` command line. The only place where errors become `anyhow`.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use tracing_subscriber::EnvFilter;

use crate::bindings::PluginInfo;
use crate::config::EngineConfig;
use crate::engine::{self, RunOptions};
use crate::job;
use crate::metrics::{Metrics, MetricsServer};
use crate::plugin::{ComponentCache, PluginHost, reserved};
use crate::progress::{ProgressMode, log_writer};

#[derive(Debug, Parser)]
#[command(name = "sluice", version, about = "Lands data exactly once through sandboxed WebAssembly sink plugins")]
pub struct Cli {
    /// More log output (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// Only warnings and errors.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    quiet: bool,
    /// Directory of the compiled-plugin cache [default: $SLUICE_CACHE_DIR or ~/.cache/sluice/components].
    #[arg(long, global = true, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs a job to the end of its source, resuming from its last checkpoint.
    Run {
        /// The job file (TOML).
        job: PathBuf,
        /// Overrides a key of the job file, e.g. --set job.parallelism=4.
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// How to show progress.
        #[arg(long, value_enum, default_value_t = ProgressArg::Auto)]
        progress: ProgressArg,
        /// Start a new incarnation of the job in a fresh state directory even
        /// when the target already holds checkpoints of an earlier one. The
        /// source is landed again beside them; nothing earlier is replaced.
        #[arg(long)]
        new_incarnation: bool,
        /// A streaming source reads up to the end offsets seen at start,
        /// then the run ends (as `source.bounded = true`).
        #[arg(long)]
        until_end: bool,
        /// Serve `/metrics` (Prometheus text) and `/healthz` on this address
        /// during the run, e.g. 127.0.0.1:9464 (port 0: any free port);
        /// overrides `job.metrics_addr`.
        #[arg(long, value_name = "HOST:PORT")]
        metrics_addr: Option<SocketAddr>,
        /// Write the address the metrics server listens on to this file
        /// (once bound: the port chosen for port 0).
        #[arg(long, value_name = "FILE")]
        metrics_addr_file: Option<PathBuf>,
    },
    /// Shows a job's state directory: incarnation, last committed checkpoint
    /// and the pending checkpoints with what they will commit.
    State {
        job: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// Drops pending checkpoint N for good, after you decided its commit
        /// will never be made (its rows are visible already, or given up). The
        /// next run does not commit it. Never done automatically.
        #[arg(long, value_name = "N")]
        drop_pending: Option<u64>,
    },
    /// Keeps the job's sink tables healthy: compacts small files, expires
    /// old snapshots and removes orphan files, through the plugin (which
    /// must export `maintenance`). Safe beside running jobs.
    Maintain {
        job: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
        /// A table as the source names it (repeatable); default: the
        /// tables of the job's last checkpoint.
        #[arg(long = "table", value_name = "NAME")]
        tables: Vec<String>,
        /// Skip compaction.
        #[arg(long)]
        no_compact: bool,
        /// Compaction rewrites files below this size into files near it.
        #[arg(long, value_name = "MB", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=4095))]
        target_file_mb: u64,
        /// Expire snapshots older than this (e.g. 7d, 12h, 30m).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg)]
        expire_older_than: Option<std::time::Duration>,
        /// Keep at least the newest N snapshots when expiring.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        keep_last: Option<u32>,
        /// Remove files under the tables' locations that nothing references
        /// and that are older than this. Off unless asked. While a table
        /// names a job (its commits or claim) that is neither this job nor
        /// given with --protect, files younger than 3 days are kept anyway,
        /// and the report names that job.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg)]
        remove_orphans_older_than: Option<std::time::Duration>,
        /// Another job (its job file) whose pending checkpoints' files orphan
        /// cleanup must spare (repeatable); this job's always are.
        #[arg(long, value_name = "JOB.toml")]
        protect: Vec<PathBuf>,
        /// Use --remove-orphans-older-than below the 3-day floor even though
        /// a table names jobs whose state this command cannot see. RISK: a
        /// pending checkpoint of such a job names files that look orphaned;
        /// once removed, its recovery refuses to commit it (naming the missing
        /// files), and its rows are lost unless the files come back. Only when
        /// you know they have nothing pending; giving their job files with
        /// --protect is the safe way.
        #[arg(long)]
        force: bool,
        /// List what would be done; change nothing.
        #[arg(long)]
        dry_run: bool,
        /// How long the plugin may take for all of it.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration_arg, default_value = "1h")]
        timeout: std::time::Duration,
    },
    /// Validates a job file, the plugin's options and the grants without moving data.
    Check {
        job: PathBuf,
        #[arg(long = "set", value_name = "KEY=VALUE")]
        sets: Vec<String>,
    },
    /// Works with plugin components.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Debug, Subcommand)]
enum PluginCommand {
    /// Shows a plugin's world, version, options and the capabilities it imports.
    Inspect { file: PathBuf },
    /// Proves a sink plugin exactly once against a scratch target:
    /// `sluice plugin test PLUGIN.wasm --job JOB.toml [--verify-cmd CMD]`.
    /// Runs `sluice-plugin-test` from beside this binary (build it with
    /// `cargo build --release -p sluice-conformance`), which holds the crash
    /// machinery this binary never carries.
    Test {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ProgressArg {
    /// A status line on a terminal, log lines otherwise.
    Auto,
    /// Log lines.
    Plain,
    /// Nothing but warnings, errors and the summary.
    Quiet,
}

fn init_logging(verbose: u8, quiet: bool) {
    let default = match (quiet, verbose) {
        (true, _) => "warn",
        (false, 0) => "info",
        (false, 1) => "debug",
        (false, _) => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(log_writer())
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .try_init();
}

/// Entry point of the `sluice` binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose, cli.quiet);
    match execute(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", render(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes joined by `: `, each said once: a cause whose
/// text the message already quotes (an error that prints its source) is not
/// repeated after it.
pub fn render(e: &anyhow::Error) -> String {
    sluice_core::chain(e.as_ref())
}

fn host(cache_dir: Option<PathBuf>) -> anyhow::Result<PluginHost> {
    let dir = cache_dir.or_else(ComponentCache::default_dir);
    PluginHost::new(dir).context("starting the WebAssembly engine")
}

fn execute(cli: Cli) -> anyhow::Result<ExitCode> {
    let cache_dir = cli.cache_dir;
    match cli.command {
        Command::Run { job, mut sets, progress, new_incarnation, until_end, metrics_addr, metrics_addr_file } => {
            if until_end {
                sets.push("source.bounded=true".to_string());
            }
            let serve = Serve { addr: metrics_addr, addr_file: metrics_addr_file };
            run_job(&job, &sets, cache_dir, progress_mode(cli.quiet, progress), new_incarnation, &serve)
        }
        Command::State { job, sets, drop_pending } => show_state(&job, &sets, cache_dir, drop_pending),
        Command::Check { job, sets } => check_job(&job, &sets, cache_dir),
        Command::Maintain {
            job,
            sets,
            tables,
            no_compact,
            target_file_mb,
            expire_older_than,
            keep_last,
            remove_orphans_older_than,
            protect,
            force,
            dry_run,
            timeout,
        } => {
            let job = job::load(&job, &sets)?;
            let protect = protect.iter().map(|p| job::load(p, &[])).collect::<Result<Vec<_>, _>>()?;
            let opts = engine::maintain::MaintainOptions {
                tables,
                compact: !no_compact,
                target_file_bytes: target_file_mb.saturating_mul(1024 * 1024),
                expire_older_than,
                keep_last,
                remove_orphans_older_than,
                protect,
                force,
                dry_run,
                timeout,
                faults: Default::default(),
            };
            let host = host(cache_dir)?;
            let report = engine::maintain::maintain(&job, &host, &opts)?;
            print!("{report}");
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin { command: PluginCommand::Test { args } } => test_plugin(&args, cache_dir),
        Command::Plugin { command: PluginCommand::Inspect { file } } => inspect_plugin(&file, cache_dir),
    }
}

/// A duration such as `10m`, `7d`, `1h 30m` or `500ms` (humantime's syntax).
fn parse_duration_arg(raw: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(raw).map_err(|e| format!("{raw:?} is not a duration such as 7d, 12h, 30m or 0s: {e}"))
}

/// `--quiet` wins over `--progress`.
fn progress_mode(quiet: bool, progress: ProgressArg) -> ProgressMode {
    match (quiet, progress) {
        (true, _) | (_, ProgressArg::Quiet) => ProgressMode::Quiet,
        (_, ProgressArg::Plain) => ProgressMode::Plain,
        (_, ProgressArg::Auto) => ProgressMode::Auto,
    }
}

/// Where `sluice run` serves its metrics, as the command line says.
struct Serve {
    addr: Option<SocketAddr>,
    addr_file: Option<PathBuf>,
}

/// `sluice run`: the run's summary on stdout.
fn run_job(
    job: &Path,
    sets: &[String],
    cache_dir: Option<PathBuf>,
    progress: ProgressMode,
    new_incarnation: bool,
    serve: &Serve,
) -> anyhow::Result<ExitCode> {
    let job = job::load(job, sets)?;
    let options = RunOptions::new(progress, new_incarnation);
    // Bound before anything is written: a taken address fails the run here.
    let _server = serve_metrics(&job, serve, &options.metrics)?;
    let host = host(cache_dir)?;
    stop_on_signals(&options.stop, job.unbounded())?;
    let summary = engine::run(&job, &host, &options)?;
    println!("{summary}");
    Ok(ExitCode::SUCCESS)
}

/// Starts the metrics server when `--metrics-addr` or `job.metrics_addr`
/// asks for one, and writes its address where `--metrics-addr-file` says.
fn serve_metrics(job: &EngineConfig, serve: &Serve, metrics: &Metrics) -> anyhow::Result<Option<MetricsServer>> {
    let (addr, key) = match (serve.addr, job.metrics_addr) {
        (Some(addr), _) => (addr, "--metrics-addr"),
        (None, Some(addr)) => (addr, "job.metrics_addr"),
        (None, None) => {
            if serve.addr_file.is_some() {
                anyhow::bail!("--metrics-addr-file needs --metrics-addr or job.metrics_addr");
            }
            return Ok(None);
        }
    };
    let server = MetricsServer::start(addr, key, metrics.clone())?;
    let bound = server.addr();
    tracing::info!(addr = %bound, "serving metrics on http://{bound}/metrics and health on http://{bound}/healthz");
    if let Some(file) = &serve.addr_file {
        // Written whole, then renamed: a reader never sees half an address.
        let partial = file.with_extension("partial");
        std::fs::write(&partial, format!("{bound}\n"))
            .and_then(|()| std::fs::rename(&partial, file))
            .with_context(|| format!("--metrics-addr-file: writing {}", file.display()))?;
    }
    Ok(Some(server))
}

/// SIGTERM or SIGINT stops the run cleanly: the running round ends with a
/// checkpoint that is persisted and committed, and the run exits 0. A second
/// signal stops the process at once (exit 130); what was persisted is safe,
/// and the next run resumes from it.
fn stop_on_signals(stop: &engine::Stop, unbounded: bool) -> anyhow::Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]).context("cannot watch for SIGTERM")?;
    let stop = stop.clone();
    std::thread::Builder::new()
        .name("sluice-signals".into())
        .spawn(move || {
            let mut seen = 0;
            for signal in signals.forever() {
                seen += 1;
                if seen == 1 {
                    tracing::warn!(
                        signal,
                        "stopping: the running checkpoint ends now and is committed; a second signal stops at once"
                    );
                    stop.request();
                } else {
                    tracing::error!(signal, "stopped at once; the next run resumes from the last persisted checkpoint");
                    std::process::exit(130);
                }
            }
        })
        .context("cannot start the signal thread")?;
    if unbounded {
        tracing::info!("the source is unbounded: the run goes on until stopped (SIGTERM or Ctrl-C)");
    }
    Ok(())
}

/// `sluice state`: drops a pending checkpoint when asked, then shows the
/// state directory (its pending commits as the plugin describes them, when
/// it can).
fn show_state(
    job: &Path,
    sets: &[String],
    cache_dir: Option<PathBuf>,
    drop_pending: Option<u64>,
) -> anyhow::Result<ExitCode> {
    let job = job::load(job, sets)?;
    if let Some(c) = drop_pending {
        let dropped = engine::state::drop_pending(&job, c)?;
        println!(
            "dropped pending checkpoint {} of job {} ({} rows): the next run will not commit it",
            dropped.checkpoint, job.spec.job.id, dropped.rows
        );
    }
    let mut report = engine::state::inspect(&job)?;
    let host = host(cache_dir)?;
    if let Err(why) = report.describe_with(&job, &host) {
        tracing::warn!("the plugin cannot describe the pending commits ({why}); showing them as stored");
    }
    print!("{report}");
    Ok(ExitCode::SUCCESS)
}

/// `sluice check`: each check passed and each problem, then the verdict;
/// fails when there is a problem.
fn check_job(job: &Path, sets: &[String], cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let job = job::load(job, sets)?;
    let host = host(cache_dir)?;
    let report = engine::check(&job, &host);
    for line in &report.passed {
        println!("ok: {line}");
    }
    for problem in &report.problems {
        println!("error: {problem}");
    }
    if report.problems.is_empty() {
        println!("job {} is ready to run", job.spec.job.id);
        Ok(ExitCode::SUCCESS)
    } else {
        println!("job {}: {} problem(s)", job.spec.job.id, report.problems.len());
        Ok(ExitCode::FAILURE)
    }
}

/// `sluice plugin test`: runs `sluice-plugin-test` from beside this binary
/// and exits as it does.
fn test_plugin(args: &[String], cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let exe = std::env::current_exe().context("finding the sluice binary")?;
    let runner = exe.with_file_name("sluice-plugin-test");
    if !runner.exists() {
        anyhow::bail!(
            "the conformance runner {} is not built: run `cargo build --release -p sluice-conformance` \
             (it is a binary of its own so that the crash machinery never ships in sluice)",
            runner.display()
        );
    }
    let mut cmd = std::process::Command::new(&runner);
    cmd.args(args);
    if let Some(dir) = cache_dir {
        cmd.env("SLUICE_CACHE_DIR", dir);
    }
    let status = cmd.status().with_context(|| format!("running {}", runner.display()))?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}

/// `sluice plugin inspect`: the plugin's contract, what it says of itself,
/// and its imports and exports.
fn inspect_plugin(file: &Path, cache_dir: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let host = host(cache_dir)?;
    let plugin = host.load(file)?;
    println!("file:        {}", plugin.path.display());
    let contract = plugin.contract();
    println!("contract:    sluice:connector@{contract}");
    println!("world:       sluice:connector/sink-plugin@{contract}");
    if let Some(info) = plugin.info() {
        print_info(info);
    }
    println!("imports:");
    for name in plugin.imports() {
        println!("  {name}");
    }
    println!("exports:");
    for name in plugin.exports() {
        println!("  {name}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What a plugin says of itself: name, tables, its options (the host's own
/// named apart) and the capabilities it needs.
fn print_info(info: &PluginInfo) {
    println!("plugin:      {} {}", info.name, info.version);
    println!("description: {}", info.description);
    println!(
        "tables:      {}",
        if info.multi_table { "many (named tables, schema changes during a run)" } else { "one" }
    );
    println!("options:");
    for o in info.options.iter().filter(|o| !reserved::is_reserved(&o.name)) {
        let req = if o.required { "required" } else { "optional" };
        let default = o.default_value.as_ref().map(|d| format!(" [default: {d}]")).unwrap_or_default();
        println!("  {:<16} {req}{default}  {}", o.name, o.description);
    }
    let host_options: Vec<&str> =
        info.options.iter().map(|o| o.name.as_str()).filter(|n| reserved::is_reserved(n)).collect();
    if !host_options.is_empty() {
        println!("from the host: {}", host_options.join(", "));
    }
    println!("needs:");
    for c in &info.capabilities {
        println!("  {c}");
    }
}

#[cfg(test)]
mod tests {
    use super::render;

    #[test]
    fn a_cause_the_message_quotes_is_said_once() {
        let full = std::io::Error::from_raw_os_error(28);
        let e = crate::engine::checkpoint::CheckpointError::Io { path: "/state".into(), source: full };
        let text = render(&anyhow::Error::new(e));
        assert_eq!(text.matches("os error 28").count(), 1, "{text}");
        let missing = std::io::Error::from_raw_os_error(2);
        let shown = missing.to_string();
        let wrapped = anyhow::Error::new(missing).context("reading job.toml");
        assert_eq!(render(&wrapped), format!("reading job.toml: {shown}"), "a cause not quoted is appended");
    }
}
