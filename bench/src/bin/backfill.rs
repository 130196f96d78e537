//! Seed 002's backfill, measured (issue 40, point 7): a queue of W × K
//! windows of days worked through by W tasks at once (the write-up's
//! `max_active_tis_per_dag = W` over its mapped windows), each day
//! overwritten, into one day-partitioned Iceberg table (SQLite catalog,
//! local warehouse). Task k takes windows k, k + W, k + 2W, … in turn.
//! Three strategies:
//!
//! - **PyIceberg**: the write-up's own code (`bench/backfill/pyiceberg_window.py`),
//!   W Python processes at once, each looping over its K windows, one
//!   `table.overwrite(rows, overwrite_filter="order_date = '<day>'")` per
//!   day, its retry loop on top of PyIceberg's own; a day whose attempts run
//!   out gives up the rest of its window, and the task goes on with its next;
//! - **Sluice, W jobs**: W task slots at once, each running one `sluice run`
//!   per window in turn (a job per window, as the write-up has a task
//!   instance per window) in `mode = "overwrite-partitions"`, a checkpoint
//!   (one snapshot) per day; a failed job loses its window only;
//! - **Sluice, 1 job**: one `sluice run` with W writers over every window.
//!
//! Invariants: every strategy starts from a table pre-filled with OLD rows
//! for every day (a Sluice append job, not timed), gets the same new rows
//! from the same CSV files, and is judged by reading the table back with
//! PyIceberg: a day counts as replaced only when it holds exactly its new
//! rows, so a lost window shows as old rows left. Wall time and the
//! children's CPU time cover the strategy's own processes only.
//!
//! `cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin backfill`

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use sluice_bench::{children_cpu, civil, today, workspace};

/// The table every strategy writes.
const TABLE: &str = "bench.orders";

#[derive(Parser)]
struct Args {
    /// Task counts W to compare (W tasks at once).
    #[arg(long, value_delimiter = ',', default_values_t = [4u32, 8])]
    writers: Vec<u32>,
    /// Windows each task takes in turn (K): W × K windows in all.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    windows_per_task: u32,
    /// Days per window.
    #[arg(long, default_value_t = 5)]
    days_per_window: u32,
    /// New rows per day (the old rows are half as many).
    #[arg(long, default_value_t = 200)]
    rows_per_day: u64,
    /// Repetitions per (strategy, W); the table shows means.
    #[arg(long, default_value_t = 1)]
    reps: usize,
    /// The write-up's attempts per day, on top of PyIceberg's own retries.
    #[arg(long, default_value_t = 4)]
    max_attempts: u32,
    /// Seed of the PyIceberg tasks' backoff jitter (task k uses seed + k).
    #[arg(long, default_value_t = 2)]
    seed: u64,
    /// A python3 with pyiceberg 0.12 and pyarrow (tests/requirements.txt).
    #[arg(long, default_value = "python3")]
    python: String,
    /// The `sluice` binary; by default the one beside this benchmark's.
    #[arg(long)]
    sluice: Option<PathBuf>,
    /// The Iceberg sink component; by default `cargo build-plugins`'s.
    #[arg(long)]
    plugin: Option<PathBuf>,
    /// Where to write the report (markdown).
    #[arg(long, default_value = "docs/src/performance/backfill.md")]
    out: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Strategy {
    PyIceberg,
    SluiceJobs,
    SluiceOneJob,
}

impl Strategy {
    const ALL: [Strategy; 3] = [Strategy::PyIceberg, Strategy::SluiceJobs, Strategy::SluiceOneJob];

    fn name(self) -> &'static str {
        match self {
            Strategy::PyIceberg => "PyIceberg, W tasks",
            Strategy::SluiceJobs => "Sluice, W jobs",
            Strategy::SluiceOneJob => "Sluice, 1 job × W writers",
        }
    }
}

/// What the benchmark runs with: the tools and the rows.
struct Setup {
    python: String,
    script: PathBuf,
    sluice: PathBuf,
    plugin: PathBuf,
    cache: PathBuf,
    rows_per_day: u64,
    days_per_window: u32,
    windows_per_task: u32,
    max_attempts: u32,
    seed: u64,
}

/// The outcome of one run of one strategy.
struct Outcome {
    /// Catalog commits that landed (PyIceberg: days a task replaced; Sluice: checkpoints committed).
    commits: u64,
    conflicts: u64,
    windows_lost: u32,
    /// Windows in all (W × K).
    windows: u32,
    days_replaced: u32,
    days: u32,
    /// Days that still hold an old row.
    days_with_old_rows: u32,
    wall: Duration,
    cpu: Duration,
    rows: u64,
    correct: bool,
    /// The first error a task or job stopped with, if any.
    error: Option<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = workspace();
    let sluice = sluice_bench::sluice_binary(args.sluice.as_deref())?;
    let plugin = sluice_bench::iceberg_plugin(args.plugin.as_deref())?;
    let setup = Setup {
        python: args.python.clone(),
        script: root.join("bench/backfill/pyiceberg_window.py"),
        sluice,
        plugin,
        cache: root.join("target/bench-component-cache"),
        rows_per_day: args.rows_per_day,
        days_per_window: args.days_per_window,
        windows_per_task: args.windows_per_task,
        max_attempts: args.max_attempts,
        seed: args.seed,
    };
    let started = Instant::now();
    let mut cells: Vec<(Strategy, u32, Vec<Outcome>)> = Vec::new();
    for &w in &args.writers {
        for strategy in Strategy::ALL {
            let mut runs = Vec::new();
            for rep in 0..args.reps {
                let dir = tempfile::tempdir()?;
                let o = run_once(&setup, strategy, w, dir.path())?;
                eprintln!(
                    "W={w} {:<26} rep {}: {:.1}s, {:.2} CPU-s, {} commits, {} conflicts, {} of {} windows lost, {}/{} days replaced, \
                     {} with old rows, correct: {}{}",
                    strategy.name(),
                    rep + 1,
                    o.wall.as_secs_f64(),
                    o.cpu.as_secs_f64(),
                    o.commits,
                    o.conflicts,
                    o.windows_lost,
                    o.windows,
                    o.days_replaced,
                    o.days,
                    o.days_with_old_rows,
                    o.correct,
                    o.error.as_deref().map(|e| format!(" (first error: {e})")).unwrap_or_default()
                );
                runs.push(o);
            }
            cells.push((strategy, w, runs));
        }
    }
    let table = markdown(&cells);
    println!("{table}");
    let errors = first_errors(&cells);
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, document(&args, &table, &errors, started.elapsed()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// Day `d` of the backfill (day 0 is 2024-01-01).
fn day(d: u32) -> String {
    // 2024-01-01 is day 19,723 since 1970-01-01.
    civil(19_723 + i64::from(d))
}

/// `(order_id, amount_cents)` of the new rows of day `d`.
fn new_rows(d: u32, rows: u64) -> Vec<(i64, i64)> {
    let d = i64::from(d);
    (0..rows as i64).map(|i| (d * 1_000_000 + i, 1 + (d * 31 + i * 17) % 99_999)).collect()
}

/// `(order_id, amount_cents)` of the old rows of day `d`: other ids, value 0.
fn old_rows(d: u32, rows: u64) -> Vec<(i64, i64)> {
    let d = i64::from(d);
    (0..(rows / 2).max(1) as i64).map(|i| (d * 1_000_000 + 500_000 + i, 0)).collect()
}

fn write_csv(path: &Path, days: &[(String, Vec<(i64, i64)>)]) -> Result<()> {
    let mut text = String::from("order_id,order_date,customer_id,amount_cents\n");
    for (day, rows) in days {
        for (id, v) in rows {
            writeln!(text, "{id},{day},{},{v}", id % 400)?;
        }
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// A Sluice job file into `TABLE` of `warehouse`, reading `input`.
fn job_toml(
    s: &Setup,
    id: &str,
    parallelism: u32,
    every_rows: u64,
    input: &Path,
    warehouse: &Path,
    mode: &str,
) -> String {
    format!(
        r#"[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state-{id}"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "{input}"
[sink]
id = "orders"
plugin = "{plugin}"
[sink.options]
table = "{TABLE}"
partition_by = "identity(order_date)"
mode = "{mode}"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#,
        input = input.display(),
        plugin = s.plugin.display(),
        warehouse = warehouse.display(),
    )
}

/// Starts `sluice run <dir>/<id>.toml`, its output in `<dir>/<id>.out|.err`.
fn spawn_sluice(s: &Setup, dir: &Path, id: &str, toml: &str) -> Result<Child> {
    let job = dir.join(format!("{id}.toml"));
    std::fs::write(&job, toml)?;
    Command::new(&s.sluice)
        .arg("run")
        .arg(&job)
        .args(["--progress", "plain"])
        .current_dir(dir)
        .env("SLUICE_CACHE_DIR", &s.cache)
        .env("NO_COLOR", "1")
        .stdout(std::fs::File::create(dir.join(format!("{id}.out")))?)
        .stderr(std::fs::File::create(dir.join(format!("{id}.err")))?)
        .spawn()
        .with_context(|| format!("starting {}", s.sluice.display()))
}

/// The conflicts a Sluice job's log reports: each commit attempt the host
/// retried because another writer committed first.
fn sluice_conflicts(log: &str) -> u64 {
    // tracing's plain format quotes the label: `reason="conflict"`.
    let conflict = |l: &str| l.contains("reason=\"conflict\"") || l.contains("reason=conflict ");
    log.lines().filter(|l| l.contains("commit failed; retrying") && conflict(l)).count() as u64
}

/// The last line of a failed job's log (its error).
fn last_line(log: &str) -> String {
    log.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string()
}

/// Every row of `TABLE` as PyIceberg reads it, by day: `(order_id, amount_cents)` sorted.
fn read_back(s: &Setup, warehouse: &Path) -> Result<BTreeMap<String, Vec<(i64, i64)>>> {
    let out = Command::new(&s.python)
        .arg(&s.script)
        .arg("read")
        .arg(warehouse)
        .arg(TABLE)
        .output()
        .with_context(|| format!("running {}", s.python))?;
    ensure!(out.status.success(), "reading {TABLE} back with PyIceberg: {}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<(String, i64, i64)> = serde_json::from_slice(&out.stdout).context("PyIceberg's rows as JSON")?;
    let mut days: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (day, id, v) in rows {
        days.entry(day).or_default().push((id, v));
    }
    days.values_mut().for_each(|r| r.sort_unstable());
    Ok(days)
}

/// Runs `strategy` with `w` tasks in `dir`: writes the inputs, pre-fills
/// the table with old rows, runs the strategy (timed) and reads the table back.
fn run_once(s: &Setup, strategy: Strategy, w: u32, dir: &Path) -> Result<Outcome> {
    let warehouse = dir.join("warehouse");
    std::fs::create_dir_all(&warehouse)?;
    let windows = w * s.windows_per_task;
    let days = windows * s.days_per_window;
    // The windows task k takes in turn: k, k + W, k + 2W, …
    let task_windows = |k: u32| (0..s.windows_per_task).map(move |i| k + i * w);
    // Inputs: one CSV a day, under the window's folder and under all/.
    let all = dir.join("all");
    std::fs::create_dir_all(&all)?;
    let mut expected = BTreeMap::new();
    for j in 0..windows {
        let window = dir.join(format!("new/w{j}"));
        std::fs::create_dir_all(&window)?;
        for d in j * s.days_per_window..(j + 1) * s.days_per_window {
            let rows = new_rows(d, s.rows_per_day);
            let file = format!("orders-{}.csv", day(d));
            write_csv(&window.join(&file), &[(day(d), rows.clone())])?;
            std::fs::copy(window.join(&file), all.join(&file))?;
            expected.insert(day(d), rows);
        }
    }
    let old_dir = dir.join("old");
    std::fs::create_dir_all(&old_dir)?;
    let old: Vec<(String, Vec<(i64, i64)>)> = (0..days).map(|d| (day(d), old_rows(d, s.rows_per_day))).collect();
    write_csv(&old_dir.join("old.csv"), &old)?;
    let old_total: u64 = old.iter().map(|(_, r)| r.len() as u64).sum();

    // The pre-fill, not timed: every day holds old rows only.
    let prefill = job_toml(s, "prefill", 1, old_total, &old_dir, &warehouse, "append");
    let status = spawn_sluice(s, dir, "prefill", &prefill)?.wait()?;
    if !status.success() {
        bail!("the pre-fill failed: {}", std::fs::read_to_string(dir.join("prefill.err")).unwrap_or_default());
    }
    let before = read_back(s, &warehouse)?;
    ensure!(before.len() == days as usize, "the pre-fill left {} days, not {days}", before.len());

    let cpu = children_cpu();
    let started = Instant::now();
    let mut conflicts = 0;
    let mut commits = 0;
    let mut error = None;
    match strategy {
        Strategy::PyIceberg => {
            let children = (0..w)
                .map(|k| {
                    Command::new(&s.python)
                        .arg(&s.script)
                        .arg("write")
                        .arg(&warehouse)
                        .arg(TABLE)
                        .arg(s.max_attempts.to_string())
                        .arg((s.seed + u64::from(k)).to_string())
                        .args(task_windows(k).map(|j| dir.join(format!("new/w{j}"))))
                        .stdout(Stdio::piped())
                        .stderr(std::fs::File::create(dir.join(format!("py-{k}.err")))?)
                        .spawn()
                        .with_context(|| format!("starting {}", s.python))
                })
                .collect::<Result<Vec<_>>>()?;
            for (k, child) in children.into_iter().enumerate() {
                let out = child.wait_with_output()?;
                let text = String::from_utf8_lossy(&out.stdout);
                match serde_json::from_str::<serde_json::Value>(text.trim()) {
                    Ok(v) => {
                        conflicts += v["conflicts"].as_u64().unwrap_or(0);
                        commits += v["replaced"].as_array().map_or(0, |d| d.len() as u64);
                        if let Some(e) = v["errors"].as_array().and_then(|e| e.first()).and_then(|e| e.as_str()) {
                            error.get_or_insert_with(|| format!("task {k}: {e}"));
                        }
                    }
                    Err(_) => {
                        let err = std::fs::read_to_string(dir.join(format!("py-{k}.err"))).unwrap_or_default();
                        error.get_or_insert_with(|| format!("task {k}: {}", last_line(&err)));
                    }
                }
            }
        }
        Strategy::SluiceJobs => {
            // W task slots at once; each runs its windows' jobs one after another.
            let slots: Vec<Vec<(String, bool)>> = std::thread::scope(|scope| {
                let handles: Vec<_> = (0..w)
                    .map(|k| {
                        let warehouse = &warehouse;
                        scope.spawn(move || -> Result<Vec<(String, bool)>> {
                            let mut ran = Vec::new();
                            for j in task_windows(k) {
                                let id = format!("window-{j}");
                                let input = dir.join(format!("new/w{j}"));
                                let toml =
                                    job_toml(s, &id, 1, s.rows_per_day, &input, warehouse, "overwrite-partitions");
                                let status = spawn_sluice(s, dir, &id, &toml)?.wait()?;
                                ran.push((id, status.success()));
                            }
                            Ok(ran)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a task slot's thread panicked"))))
                    .collect::<Result<Vec<_>>>()
            })?;
            for (id, success) in slots.into_iter().flatten() {
                let log = std::fs::read_to_string(dir.join(format!("{id}.err"))).unwrap_or_default();
                conflicts += sluice_conflicts(&log);
                commits += log.lines().filter(|l| l.contains("checkpoint committed")).count() as u64;
                if !success {
                    error.get_or_insert_with(|| format!("job {id}: {}", last_line(&log)));
                }
            }
        }
        Strategy::SluiceOneJob => {
            let id = "all-windows";
            let toml = job_toml(s, id, w, s.rows_per_day, &all, &warehouse, "overwrite-partitions");
            let status = spawn_sluice(s, dir, id, &toml)?.wait()?;
            let log = std::fs::read_to_string(dir.join(format!("{id}.err"))).unwrap_or_default();
            conflicts += sluice_conflicts(&log);
            commits += log.lines().filter(|l| l.contains("checkpoint committed")).count() as u64;
            if !status.success() {
                error.get_or_insert_with(|| format!("job {id}: {}", last_line(&log)));
            }
        }
    }
    let wall = started.elapsed();
    let cpu = children_cpu().saturating_sub(cpu);

    let after = read_back(s, &warehouse)?;
    let replaced = |d: u32| after.get(&day(d)) == expected.get(&day(d));
    let days_replaced = (0..days).filter(|&d| replaced(d)).count() as u32;
    let windows_lost = (0..windows)
        .filter(|j| (j * s.days_per_window..(j + 1) * s.days_per_window).any(|d| !replaced(d)))
        .count() as u32;
    let days_with_old_rows = after.values().filter(|rows| rows.iter().any(|(id, _)| id % 1_000_000 >= 500_000)).count();
    let correct = after == expected;
    Ok(Outcome {
        commits,
        conflicts,
        windows_lost,
        windows,
        days_replaced,
        days,
        days_with_old_rows: days_with_old_rows as u32,
        wall,
        cpu,
        rows: u64::from(days) * s.rows_per_day,
        correct,
        error,
    })
}

fn mean(runs: &[Outcome], f: impl Fn(&Outcome) -> f64) -> f64 {
    if runs.is_empty() { 0.0 } else { runs.iter().map(f).sum::<f64>() / runs.len() as f64 }
}

/// The results as a markdown table (means over the repetitions).
fn markdown(cells: &[(Strategy, u32, Vec<Outcome>)]) -> String {
    let mut out = String::from(
        "| strategy | W | commits | conflicts | windows lost (each rep) | days replaced | days with old rows | wall (s) \
         | CPU-s (children) | rows per CPU-s | final table correct |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
    );
    for (strategy, w, runs) in cells {
        let days = runs.first().map_or(0, |o| o.days);
        let windows = runs.first().map_or(0, |o| o.windows);
        let each = runs.iter().map(|o| o.windows_lost.to_string()).collect::<Vec<_>>().join(", ");
        let correct = runs.iter().filter(|o| o.correct).count();
        let cpu = mean(runs, |o| o.cpu.as_secs_f64());
        let rows = runs.first().map_or(0, |o| o.rows) as f64;
        let per_cpu = if cpu > 0.0 { format!("{:.0}", rows / cpu) } else { "–".to_string() };
        let _ = writeln!(
            out,
            "| {} | {w} | {:.1} | {:.1} | {:.1} of {windows} ({each}) | {:.1}/{days} | {:.1} | {:.1} | {cpu:.2} | {per_cpu} | {} |",
            strategy.name(),
            mean(runs, |o| o.commits as f64),
            mean(runs, |o| o.conflicts as f64),
            mean(runs, |o| f64::from(o.windows_lost)),
            mean(runs, |o| f64::from(o.days_replaced)),
            mean(runs, |o| f64::from(o.days_with_old_rows)),
            mean(runs, |o| o.wall.as_secs_f64()),
            if runs.len() == 1 {
                if correct == 1 { "yes".to_string() } else { "**no**".to_string() }
            } else {
                format!("{correct} of {}", runs.len())
            },
        );
    }
    out
}

/// The first error each (strategy, W) stopped a task or job with, as bullets.
fn first_errors(cells: &[(Strategy, u32, Vec<Outcome>)]) -> String {
    let mut out = String::new();
    for (strategy, w, runs) in cells {
        if let Some(e) = runs.iter().find_map(|o| o.error.as_deref()) {
            let e: String = e.chars().take(300).collect();
            let _ = writeln!(out, "- {}, W = {w}: `{}`", strategy.name(), e.replace('`', "'"));
        }
    }
    if out.is_empty() { "- none: every task and job ran to its end.\n".to_string() } else { out }
}

/// The markdown report: the command that reproduces it, the setup, the
/// table, what differs between the strategies.
fn document(args: &Args, table: &str, errors: &str, took: Duration) -> String {
    let date = today();
    let command = format!(
        "cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin backfill -- --writers {} --windows-per-task {} --days-per-window {} --rows-per-day {} --reps {} --max-attempts {} --seed {}",
        args.writers.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        args.windows_per_task,
        args.days_per_window,
        args.rows_per_day,
        args.reps,
        args.max_attempts,
        args.seed
    );
    format!(
        "# Seed 002's backfill, measured {date}\n\n\
         Produced on {date} by:\n\n```sh\n{command}\n```\n\n\
         The write-up's own pipeline (issue 40, point 7): a queue of W × {k} windows of {dpw} days each, worked \
         through by W tasks at once (the write-up's `extract_window.partial(max_active_tis_per_dag=W)\
         .expand(window=windows)`), each day overwritten, into one Iceberg table partitioned by day \
         (`identity(order_date)` on a date column), a SQLite catalog and a local warehouse. Task k takes windows k, \
         k + W, k + 2W, … in turn, {k} each ({cover}). {rpd} new rows a day. \
         Before each strategy the table is pre-filled (by a Sluice append job, not timed) with old rows for every \
         day, half as many, with other ids, so a lost window shows as old rows left. The final table is read back \
         with PyIceberg: a day counts as replaced only when it holds exactly its new rows (by id and value). Means \
         over {reps} repetition(s); the whole run took {took:.0} s on the 2-core development machine while other \
         builds ran on it, so the wall times are noisy.\n\n\
         - **PyIceberg, W tasks**: W Python processes at once (PyIceberg 0.12, `bench/backfill/pyiceberg_window.py`), \
         each taking its {k} windows in turn and running the write-up's code: per day \
         `table.overwrite(rows, overwrite_filter=\"order_date = '<day>'\")`, the table reloaded on every attempt, only \
         `CommitFailedException` retried, full-jitter backoff (0.3 s · 2^n, at most 10 s), {attempts} attempts on top \
         of PyIceberg's own 4 retries. A day whose attempts run out fails its window's task: the rest of that window \
         is given up, and the process goes on with its next window, as the next mapped task instance would.\n\
         - **Sluice, W jobs**: W task slots at once, each running one `sluice run` (release build) per window, its \
         {k} windows one after another: a job per window, as the write-up has a task instance per window. Each job \
         is `mode = \"overwrite-partitions\"` with one writer and a checkpoint, so one `overwrite` snapshot, per day; \
         the host retries a conflicting commit up to 20 times (`job.commit` defaults). A failed job would lose its \
         window only.\n\
         - **Sluice, 1 job × W writers**: one `sluice run` with W writers over every window's files, a checkpoint every \
         {rpd} rows per writer: one snapshot per checkpoint, each holding several days.\n\n\
         {table}\n\
         Commits: catalog commits that landed (PyIceberg: the days its tasks replaced; Sluice: checkpoints \
         committed, the pre-fill's left out). Conflicts: for PyIceberg, each `CommitFailedException` the write-up's \
         loop caught plus each retry PyIceberg logged; for Sluice, each commit attempt the host retried because \
         another writer committed first. Windows lost: windows with a day that does not hold exactly its new rows, \
         the mean and then each repetition's count. CPU-s: user and system time of the strategy's processes \
         (`/proc/self/stat`'s cutime and cstime, in 10 ms clock ticks), so start-up (a Python interpreter and its \
         imports, a `sluice` process loading the precompiled plugin) counts; rows per CPU-s: new rows over it.\n\n\
         First error per strategy and W:\n\n{errors}\n\
         ## What differs\n\n\
         - The rows, days, windows and input files are the same for all three; PyIceberg and the W Sluice jobs \
         commit once per day. PyIceberg's overwrite of a day commits a delete and an append snapshot in one catalog \
         commit; Sluice's is one `overwrite` snapshot. The one Sluice job commits once per checkpoint of all its \
         writers, several days at a time, and its writers take the files by a hash of their names, not by window.\n\
         - Attempts per day: PyIceberg up to {attempts} × 5 (its own 4 retries each), Sluice up to 20.\n\
         - The table is partitioned by `identity(order_date)` for all three strategies, not `day(order_date)`: \
         PyIceberg 0.12 writes to a `day()` transform only with the optional `pyiceberg-core` package. Each day is \
         one partition either way.\n",
        k = args.windows_per_task,
        cover = args
            .writers
            .iter()
            .map(|w| {
                let windows = w * args.windows_per_task;
                format!("W = {w}: {windows} windows, {} days", windows * args.days_per_window)
            })
            .collect::<Vec<_>>()
            .join("; "),
        dpw = args.days_per_window,
        rpd = args.rows_per_day,
        reps = args.reps,
        took = took.as_secs_f64(),
        attempts = args.max_attempts,
    )
}
