//! Upserts, measured (issue 41, point 8): the same change stream landed by
//! PyIceberg's `table.upsert(df, join_cols=["id"])` and by a Sluice job in
//! `mode = "upsert"`, one commit per round on both sides.
//!
//! Invariants: both sides start from a table holding the same initial rows
//! (loaded untimed: PyIceberg appends them, Sluice lands them with a job of
//! their own) and get the same rounds of changes from the same Parquet
//! files (`bench/upsert/pyiceberg_upsert.py gen`: each round updates a share
//! of distinct existing ids and inserts new ones). Sluice's timed part is a
//! second job over a folder of the rounds: one writer, a checkpoint (one
//! snapshot) per round, its key index built from the table when it starts. Both tables are read back with
//! PyIceberg and must equal the model's digest, or the run fails. CPU
//! seconds count every thread: PyIceberg's per round from
//! `time.process_time()`, Sluice's from its process as this benchmark's
//! waited-for child.
//!
//! `cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin upsert-bench`

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use serde_json::Value;
use sluice_bench::{children_cpu, today, workspace};

const TABLE: &str = "bench.customers";

#[derive(Parser)]
struct Args {
    /// Rows in the table before the first round.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Rounds of changes (one commit each).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Changes per round.
    #[arg(long, default_value_t = 100_000)]
    changes: u64,
    /// Shares of each round that update existing ids (the rest insert).
    #[arg(long, value_delimiter = ',', default_values_t = [0.1, 0.5])]
    update_shares: Vec<f64>,
    /// Seed of the changes.
    #[arg(long, default_value_t = 41)]
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
    #[arg(long, default_value = "docs/src/performance/upsert.md")]
    out: PathBuf,
}

/// One side's timed rounds.
struct Side {
    wall: Duration,
    cpu: Duration,
    changes: u64,
    /// Peak resident memory of the Sluice run, as its summary states it.
    peak_mb: Option<u64>,
}

impl Side {
    fn per_sec(&self) -> f64 {
        self.changes as f64 / self.wall.as_secs_f64().max(1e-9)
    }
    fn per_cpu_sec(&self) -> f64 {
        self.changes as f64 / self.cpu.as_secs_f64().max(1e-9)
    }
}

struct Setup {
    python: String,
    script: PathBuf,
    sluice: PathBuf,
    plugin: PathBuf,
    cache: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = workspace();
    let sluice = sluice_bench::sluice_binary(args.sluice.as_deref())?;
    let plugin = sluice_bench::iceberg_plugin(args.plugin.as_deref())?;
    let s = Setup {
        python: args.python.clone(),
        script: root.join("bench/upsert/pyiceberg_upsert.py"),
        sluice,
        plugin,
        cache: root.join("target/bench-component-cache"),
    };
    let started = Instant::now();
    let mut lines = Vec::new();
    for &share in &args.update_shares {
        ensure!((0.0..=1.0).contains(&share), "--update-shares: {share} is not between 0 and 1");
        let dir = tempfile::tempdir()?;
        let model = python(
            &s,
            &[
                "gen",
                &dir.path().join("data").display().to_string(),
                &args.rows.to_string(),
                &args.rounds.to_string(),
                &args.changes.to_string(),
                &share.to_string(),
                &args.seed.to_string(),
            ],
        )?;
        let py = pyiceberg(&s, &args, dir.path(), &model)?;
        let sl = sluice_side(&s, &args, dir.path(), &model)?;
        eprintln!(
            "updates {:.0} %: PyIceberg {:.0} changes/s, {:.0}/CPU-s; Sluice {:.0} changes/s, {:.0}/CPU-s ({:.1}× per CPU-s), peak {} MB",
            share * 100.0,
            py.per_sec(),
            py.per_cpu_sec(),
            sl.per_sec(),
            sl.per_cpu_sec(),
            sl.per_cpu_sec() / py.per_cpu_sec(),
            sl.peak_mb.map_or_else(|| "?".to_string(), |m| m.to_string())
        );
        lines.push((share, py, sl));
    }
    let table = markdown(&lines);
    println!("{table}");
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, document(&args, &table, started.elapsed()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// Runs the Python side with `args`, and reads the JSON line it prints.
fn python(s: &Setup, args: &[&str]) -> Result<Value> {
    let out = Command::new(&s.python)
        .arg(&s.script)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", s.python))?;
    ensure!(out.status.success(), "{} {}: failed", s.script.display(), args.join(" "));
    serde_json::from_slice(&out.stdout).with_context(|| format!("{} {}: its JSON line", s.script.display(), args[0]))
}

fn check_digest(s: &Setup, warehouse: &Path, model: &Value, side: &str) -> Result<()> {
    let got = python(s, &["digest", &warehouse.display().to_string(), TABLE])?;
    if &got != model {
        bail!("{side} ended with {got}, not the model's {model}: the benchmark's result would be wrong");
    }
    Ok(())
}

fn pyiceberg(s: &Setup, args: &Args, dir: &Path, model: &Value) -> Result<Side> {
    let warehouse = dir.join("py-warehouse");
    std::fs::create_dir_all(&warehouse)?;
    let data = dir.join("data").display().to_string();
    let v = python(s, &["upsert", &warehouse.display().to_string(), TABLE, &data, &args.rounds.to_string()])?;
    let rounds = v["rounds"].as_array().context("PyIceberg's rounds")?;
    let sum = |k: &str| rounds.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).sum::<f64>();
    check_digest(s, &warehouse, model, "PyIceberg")?;
    Ok(Side {
        wall: Duration::from_secs_f64(sum("wall")),
        cpu: Duration::from_secs_f64(sum("cpu")),
        changes: sum("changes") as u64,
        peak_mb: None,
    })
}

/// Job `id` (state in `state-<id>`) upserting the files of `input`.
fn job_toml(s: &Setup, args: &Args, id: &str, input: &Path, warehouse: &Path) -> String {
    format!(
        r#"[job]
id = "{id}"
parallelism = 1
state_dir = "state-{id}"
[job.checkpoint]
every_rows = {every}
[source]
kind = "file"
path = "{input}"
key = ["id"]
[sink]
id = "customers"
plugin = "{plugin}"
[sink.options]
table = "{TABLE}"
mode = "upsert"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 2048
"#,
        every = args.changes,
        input = input.display(),
        plugin = s.plugin.display(),
        warehouse = warehouse.display(),
    )
}

/// One `sluice run` of the job; its stdout (the run summary) on success.
fn run_sluice(s: &Setup, dir: &Path, job: &Path, log: &str) -> Result<String> {
    let out = Command::new(&s.sluice)
        .arg("run")
        .arg(job)
        .args(["--progress", "plain"])
        .current_dir(dir)
        .env("SLUICE_CACHE_DIR", &s.cache)
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(dir.join(log))?)
        .output()
        .with_context(|| format!("starting {}", s.sluice.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let err = std::fs::read_to_string(dir.join(log)).unwrap_or_default();
        bail!("sluice run {} failed: {}", job.display(), err.lines().rev().take(5).collect::<Vec<_>>().join(" | "));
    }
    Ok(stdout)
}

fn sluice_side(s: &Setup, args: &Args, dir: &Path, model: &Value) -> Result<Side> {
    let warehouse = dir.join("sluice-warehouse");
    std::fs::create_dir_all(&warehouse)?;
    // The initial rows, not timed: a job of their own (a job that ended
    // stays ended; it reads no file added later).
    let load = dir.join("sluice-load");
    std::fs::create_dir_all(&load)?;
    std::fs::copy(dir.join("data/000-initial.parquet"), load.join("000-initial.parquet"))?;
    let load_job = dir.join("upsert-bench-load.toml");
    std::fs::write(&load_job, job_toml(s, args, "upsert-bench-load", &load, &warehouse))?;
    run_sluice(s, dir, &load_job, "load.err")?;
    // The rounds: the timed job, its key index built from the table.
    let rounds = dir.join("sluice-rounds");
    std::fs::create_dir_all(&rounds)?;
    for k in 1..=args.rounds {
        let name = format!("{k:03}-round.parquet");
        std::fs::copy(dir.join("data/rounds").join(&name), rounds.join(&name))?;
    }
    let job = dir.join("upsert-bench.toml");
    std::fs::write(&job, job_toml(s, args, "upsert-bench", &rounds, &warehouse))?;
    let cpu = children_cpu();
    let started = Instant::now();
    let summary = run_sluice(s, dir, &job, "rounds.err")?;
    let wall = started.elapsed();
    let cpu = children_cpu().saturating_sub(cpu);
    check_digest(s, &warehouse, model, "Sluice")?;
    Ok(Side { wall, cpu, changes: u64::from(args.rounds) * args.changes, peak_mb: peak_mb(&summary) })
}

/// `peak memory N MB` from a run summary.
fn peak_mb(summary: &str) -> Option<u64> {
    let at = summary.find("peak memory ")? + "peak memory ".len();
    summary[at..].split_whitespace().next()?.parse().ok()
}

fn markdown(lines: &[(f64, Side, Side)]) -> String {
    let mut t = String::from(
        "| updates | PyIceberg changes/s | PyIceberg changes/CPU-s | Sluice changes/s | Sluice changes/CPU-s | \
         Sluice ÷ PyIceberg per CPU-s (goal ≥ 10×) | Sluice peak memory |\n|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for (share, py, sl) in lines {
        t.push_str(&format!(
            "| {:.0} % | {:.0} | {:.0} | {:.0} | {:.0} | {:.1}× | {} |\n",
            share * 100.0,
            py.per_sec(),
            py.per_cpu_sec(),
            sl.per_sec(),
            sl.per_cpu_sec(),
            sl.per_cpu_sec() / py.per_cpu_sec(),
            sl.peak_mb.map_or_else(|| "?".to_string(), |m| format!("{m} MB")),
        ));
    }
    t
}

fn document(args: &Args, table: &str, took: Duration) -> String {
    let date = today();
    let shares = args.update_shares.iter().map(f64::to_string).collect::<Vec<_>>().join(",");
    format!(
        "# Upserts, measured {date}\n\n\
         Produced on {date} by:\n\n```sh\n\
         cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin upsert-bench -- \
         --rows {rows} --rounds {rounds} --changes {changes} --update-shares {shares} --seed {seed}\n```\n\n\
         A table of {rows} rows (`id`, `name`, `amount`, `score`), then {rounds} rounds of {changes} changes each: \
         a share of distinct existing ids updated, the rest new ids inserted (`bench/upsert/pyiceberg_upsert.py`). \
         One commit per round on both sides, one process each, a SQLite catalog and a local warehouse; the whole \
         run took {took:.0} s on the 2-core development machine.\n\n\
         - **PyIceberg 0.12**: `table.upsert(round, join_cols=[\"id\"])` per round, on a table its own `append` \
         loaded. Its CPU seconds are `time.process_time()` around each call (every thread of the process).\n\
         - **Sluice**: one job, `[source] key = [\"id\"]`, `mode = \"upsert\"`, one writer, a checkpoint every \
         {changes} rows: a job lands the initial rows (not timed), then a second job over a folder of the \
         rounds, timed: one snapshot per round with the new rows and position deletes for the rows they \
         replace. Its time covers the whole process: start, rebuilding the key index from the table, the \
         rounds. CPU seconds are the process's user and system time.\n\n\
         Both tables are read back with PyIceberg and equal the model's (row count and a digest of every row), or \
         the benchmark fails.\n\n{table}",
        rows = args.rows,
        rounds = args.rounds,
        changes = args.changes,
        seed = args.seed,
        took = took.as_secs_f64(),
    )
}
