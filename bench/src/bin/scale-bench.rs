//! Cost against the size of the work (issue 42, point 4): how a commit's
//! time grows with the table's age, and how throughput grows with writers.
//!
//! Invariants: every figure is a ratio to a baseline measured in the same
//! run (the early commits of the same job; one writer), beside the absolute
//! numbers; the job is `sluice run`, the real binary, as a user runs it.
//!
//! - **Commits against age.** The README's job shape as the issue measured
//!   it (one writer, a checkpoint every 500 rows, unpartitioned, no
//!   `[sink.maintenance]`, the sink's defaults) for `--checkpoints`
//!   checkpoints (3,000; 10,000 with `--long`). The engine logs each
//!   commit's time (`commit done`, at debug); the mean over windows of the
//!   job's checkpoints is compared with the mean over checkpoints 100-300
//!   (goal: at most 2× for the last 200). The newest `metadata.json` is
//!   measured at the end (goal: under 512 KB), with the snapshots and the
//!   head's manifests the table holds.
//! - **The other sinks** (point 5): the same job shape against the files
//!   sink (a local folder, commit markers) and the BigQuery sink (the
//!   Storage Write API double on loopback, a pending stream finalized and
//!   committed per checkpoint), `--other-checkpoints` checkpoints each: their
//!   commit times over the last 200 checkpoints against checkpoints
//!   100-300, so a commit that lists or re-reads what earlier ones left
//!   shows as a growing ratio.
//! - **Memory against the work** (point 4): the peak memory of the
//!   process (the run summary's) for one writer with 1, 30 and 365 open
//!   partitions (`bucket[N](id)`), and with 1, 10 and 100 tables in one
//!   job (`source.tables`, `table = "demo.{table}"`), each against the
//!   first of its row.
//! - **Writers.** The same generator, `--writer-rows` rows in checkpoints of
//!   100,000 rows per writer, at 1, 2, 4 and 8 writers: rows per second
//!   and per CPU-second, each against one writer (on 2 cores the slope past
//!   2 should stay flat, not fall).
//!
//! `cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin scale-bench`

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use sluice_bench::{children_cpu, today};

#[derive(Parser)]
struct Args {
    /// Checkpoints of the commit section's job.
    #[arg(long, default_value_t = 3000)]
    checkpoints: u64,
    /// 10,000 checkpoints instead of `--checkpoints`.
    #[arg(long)]
    long: bool,
    /// Rows per checkpoint of the commit section's job.
    #[arg(long, default_value_t = 500)]
    rows_per_checkpoint: u64,
    /// Checkpoints of the files and BigQuery jobs (0 skips them).
    #[arg(long, default_value_t = 3000)]
    other_checkpoints: u64,
    /// Rows of each run of the writers section.
    #[arg(long, default_value_t = 2_000_000)]
    writer_rows: u64,
    /// Runs one section (`commits`, `others`, `writers` or `memory`) and
    /// prints it, without writing the report.
    #[arg(long)]
    only: Option<String>,
    /// Rows of each run of the memory section (0 skips it).
    #[arg(long, default_value_t = 2_000_000)]
    memory_rows: u64,
    /// Runs of each writer count in the writers section (the median is shown).
    #[arg(long, default_value_t = 3)]
    writer_reps: u32,
    /// Writer counts of the writers section.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8])]
    writers: Vec<u32>,
    /// The `sluice` binary; by default the one beside this benchmark's.
    #[arg(long)]
    sluice: Option<PathBuf>,
    /// Where to write the report (markdown).
    #[arg(long, default_value = "docs/src/performance/scale.md")]
    out: PathBuf,
}

struct Setup {
    sluice: PathBuf,
    plugin: PathBuf,
    cache: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let s = Setup {
        sluice: sluice_bench::sluice_binary(args.sluice.as_deref())?,
        plugin: sluice_bench::iceberg_plugin(None)?,
        cache: sluice_bench::workspace().join("target/bench-component-cache"),
    };
    let checkpoints = if args.long { 10_000 } else { args.checkpoints };
    ensure!(checkpoints >= 400, "--checkpoints: at least 400, for the windows the ratios compare");
    let started = Instant::now();
    // Compile the plugin into the cache outside any measured run.
    let warm = tempfile::tempdir()?;
    run(&s, warm.path(), &job(&s, warm.path(), 1, 1000, 1000), &[])?;
    if let Some(only) = &args.only {
        let section = match only.as_str() {
            "commits" => commit_section(&s, &args, checkpoints)?,
            "others" => other_sinks_section(&s, &args)?,
            "writers" => writer_section(&s, &args)?,
            "memory" => memory_section(&s, &args)?,
            other => bail!("--only {other}: one of commits, others, writers, memory"),
        };
        println!("{section}");
        return Ok(());
    }

    let mut commits = commit_section(&s, &args, checkpoints)?;
    println!("{commits}");
    if args.other_checkpoints > 0 {
        let others = other_sinks_section(&s, &args)?;
        println!("{others}");
        commits.push('\n');
        commits.push_str(&others);
    }
    let mut writers = writer_section(&s, &args)?;
    println!("{writers}");
    if args.memory_rows > 0 {
        let memory = memory_section(&s, &args)?;
        println!("{memory}");
        writers.push('\n');
        writers.push_str(&memory);
    }
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, document(&args, checkpoints, &commits, &writers, started.elapsed()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// A generator → Iceberg job with the sink's defaults (unpartitioned, no
/// maintenance), in `dir`.
fn job(s: &Setup, dir: &Path, parallelism: u32, every_rows: u64, rows: u64) -> String {
    let warehouse = dir.join("warehouse");
    let sink = format!(
        r#"[sink]
id = "events"
plugin = "{plugin}"
[sink.options]
table = "demo.events"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 1024
"#,
        plugin = s.plugin.display(),
        warehouse = warehouse.display(),
    );
    generator_job(parallelism, every_rows, rows, &sink)
}

/// A generator job into `sink` (a `[sink]` section), with the generator's
/// default batches (8,192 rows) and first id (0).
fn generator_job(parallelism: u32, every_rows: u64, rows: u64, sink: &str) -> String {
    sluice_bench::generator_job_toml("scale", parallelism, every_rows, rows, 0, 8192, sink)
}

/// One `sluice run` of `toml` in `dir` with `env`; its stderr.
fn run(s: &Setup, dir: &Path, toml: &str, env: &[(&str, &str)]) -> Result<String> {
    let path = dir.join("job.toml");
    std::fs::write(&path, toml)?;
    let err = dir.join("run.err");
    let out = Command::new(&s.sluice)
        .arg("run")
        .arg(&path)
        .args(["--progress", "plain"])
        .current_dir(dir)
        .env("SLUICE_CACHE_DIR", &s.cache)
        .env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(dir.join("run.out"))?)
        .stderr(std::fs::File::create(&err)?)
        .status()
        .with_context(|| format!("starting {}", s.sluice.display()))?;
    let stderr = std::fs::read_to_string(&err).unwrap_or_default();
    if !out.success() {
        bail!("sluice run failed: {}", stderr.lines().rev().take(5).collect::<Vec<_>>().join(" | "));
    }
    Ok(stderr)
}

/// `(checkpoint, µs)` of every `commit done` line.
fn commit_times(stderr: &str) -> Vec<(u64, u64)> {
    let field = |line: &str, key: &str| -> Option<u64> {
        let at = line.find(key)? + key.len();
        line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
    };
    stderr
        .lines()
        .filter(|l| l.contains("commit done"))
        .filter_map(|l| Some((field(l, "checkpoint=")?, field(l, "commit_us=")?)))
        .collect()
}

/// Mean commit time (ms) over checkpoints `from..to`.
fn mean_ms(times: &[(u64, u64)], from: u64, to: u64) -> Option<f64> {
    let inside: Vec<u64> = times.iter().filter(|(c, _)| (from..to).contains(c)).map(|(_, us)| *us).collect();
    (!inside.is_empty()).then(|| inside.iter().sum::<u64>() as f64 / inside.len() as f64 / 1000.0)
}

fn commit_section(s: &Setup, args: &Args, checkpoints: u64) -> Result<String> {
    let dir = tempfile::tempdir()?;
    let rows = checkpoints * args.rows_per_checkpoint;
    let toml = job(s, dir.path(), 1, args.rows_per_checkpoint, rows);
    let cpu = children_cpu();
    let wall = Instant::now();
    let stderr = run(s, dir.path(), &toml, &[("RUST_LOG", "warn,sluice_engine::coordinator=debug")])?;
    let (wall, cpu) = (wall.elapsed(), children_cpu().saturating_sub(cpu));
    let times = commit_times(&stderr);
    ensure!(
        times.len() as u64 >= checkpoints,
        "the run logged {} commits of {checkpoints} checkpoints: is `commit done` still logged at debug?",
        times.len()
    );
    let mut t = format!(
        "### Commits as the table ages: {checkpoints} checkpoints of {} rows, one writer, unpartitioned, the sink's \
         defaults\n\n",
        args.rows_per_checkpoint
    );
    t.push_str(&windows_table(&times, checkpoints)?);
    let table = read_table(dir.path())?;
    t.push_str(&share_table(&stderr, &times, checkpoints, table.data_files)?);
    t.push_str(&format!(
        "\nAt the end: the newest `metadata.json` is {:.0} KB (goal: under 512 KB), the table keeps {} snapshots and \
         its head names {} manifests; {} metadata files are left in its folder. The run took {:.0} s, {:.0} CPU-s \
         ({:.0} rows/s).\n",
        table.metadata_bytes as f64 / 1024.0,
        table.snapshots,
        table.manifests,
        table.metadata_files,
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        rows as f64 / wall.as_secs_f64().max(1e-9),
    ));
    Ok(t)
}

/// The mean and median commit time over windows of a job's checkpoints,
/// each against checkpoints 100-300 (the goal, on the mean: at most 2× for
/// the last 200). The median beside it shows whether a ratio is the trend
/// or a few slow commits (a sub-millisecond commit's mean moves with one
/// disk hiccup).
fn windows_table(times: &[(u64, u64)], checkpoints: u64) -> Result<String> {
    let base = mean_ms(times, 100, 300).context("no commits in 100-300")?;
    let base_median = median_ms(times, 100, 300).context("no commits in 100-300")?;
    let mut windows = vec![(1, 100), (100, 300), (500, 600), (1000, 1100)];
    if checkpoints >= 2600 {
        windows.push((2400, 2500));
    }
    windows.push((checkpoints - 200, checkpoints));
    let mut t = "| checkpoints | mean commit time | × checkpoints 100-300 | median | × (medians) | goal |\n\
                 |---|---:|---:|---:|---:|---|\n"
        .to_string();
    for (from, to) in windows {
        let (Some(ms), Some(median)) = (mean_ms(times, from, to), median_ms(times, from, to)) else { continue };
        let goal = if to == checkpoints { "≤ 2× (mean)" } else { "" };
        t.push_str(&format!(
            "| {from}-{} | {ms:.1} ms | {:.2}× | {median:.1} ms | {:.2}× | {goal} |\n",
            to - 1,
            ms / base,
            median / base_median
        ));
    }
    Ok(t)
}

/// The commit's share of each checkpoint (the coordinator's time from one
/// `checkpoint done` to the next, commit included) against how many data
/// files the table holds by then. One writer, nothing compacted: a
/// checkpoint adds one file, so checkpoint `c` commits into a table of `c`
/// files (checked against the files the table holds at the end).
fn share_table(stderr: &str, times: &[(u64, u64)], checkpoints: u64, files_at_end: usize) -> Result<String> {
    ensure!(
        files_at_end as u64 == checkpoints,
        "the table holds {files_at_end} data files after {checkpoints} checkpoints: not one file per checkpoint"
    );
    let done = checkpoint_ends(stderr);
    let commit: std::collections::BTreeMap<u64, u64> = times.iter().copied().collect();
    let mut t = "\n| checkpoints | data files in the table | mean checkpoint time | of it, the commit |\n\
                 |---|---:|---:|---:|\n"
        .to_string();
    let mut windows = vec![(2, 100), (100, 300)];
    if checkpoints >= 1100 {
        windows.push((1000, 1100));
    }
    if checkpoints >= 3000 {
        windows.push((2900, 3000));
    }
    if checkpoints > 3000 {
        windows.push((checkpoints - 100, checkpoints));
    }
    for (from, to) in windows {
        let (mut total, mut committing, mut n) = (0u64, 0u64, 0u64);
        for c in from..to {
            let (Some(end), Some(before), Some(us)) = (done.get(&c), done.get(&(c - 1)), commit.get(&c)) else {
                continue;
            };
            total += end.saturating_sub(*before);
            committing += us;
            n += 1;
        }
        ensure!(n > 0, "no checkpoint in {from}-{} was timed", to - 1);
        t.push_str(&format!(
            "| {from}-{} | {}-{} | {:.1} ms | {:.0} % |\n",
            to - 1,
            from,
            to - 1,
            total as f64 / n as f64 / 1000.0,
            100.0 * committing as f64 / total.max(1) as f64
        ));
    }
    Ok(t)
}

/// When each `checkpoint done` line was logged, in µs of its day (the log's
/// RFC 3339 timestamp); a run that passes midnight loses those pairs only.
fn checkpoint_ends(stderr: &str) -> std::collections::BTreeMap<u64, u64> {
    let micros = |stamp: &str| -> Option<u64> {
        let time = stamp.split('T').nth(1)?.trim_end_matches('Z');
        let mut parts = time.split(':');
        let (h, m, sec): (u64, u64, f64) =
            (parts.next()?.parse().ok()?, parts.next()?.parse().ok()?, parts.next()?.parse().ok()?);
        Some((h * 3600 + m * 60) * 1_000_000 + (sec * 1e6) as u64)
    };
    stderr
        .lines()
        .filter(|l| l.contains("checkpoint done"))
        .filter_map(|l| {
            let at = l.find("checkpoint=")? + "checkpoint=".len();
            let c = l[at..].split(|ch: char| !ch.is_ascii_digit()).next()?.parse().ok()?;
            Some((c, micros(l.split_whitespace().next()?)?))
        })
        .collect()
}

/// Median commit time (ms) over checkpoints `from..to`.
fn median_ms(times: &[(u64, u64)], from: u64, to: u64) -> Option<f64> {
    let mut inside: Vec<u64> = times.iter().filter(|(c, _)| (from..to).contains(c)).map(|(_, us)| *us).collect();
    inside.sort_unstable();
    inside.get(inside.len() / 2).map(|us| *us as f64 / 1000.0)
}

/// The files and BigQuery sinks under the commit section's job shape.
fn other_sinks_section(s: &Setup, args: &Args) -> Result<String> {
    let checkpoints = args.other_checkpoints;
    ensure!(checkpoints >= 400, "--other-checkpoints: at least 400, for the windows the ratios compare");
    let rows = checkpoints * args.rows_per_checkpoint;
    let mut t = String::new();

    let files = sluice_bench::plugin("sluice_sink_files.wasm")?;
    let dir = tempfile::tempdir()?;
    let sink = format!(
        "[sink]\nid = \"events\"\nplugin = \"{}\"\n[sink.options]\npath = \"out\"\n[sink.grants]\nlocations = [\"out\", \"out.staging\"]\n",
        files.display()
    );
    let times = timed_commits(s, dir.path(), &generator_job(1, args.rows_per_checkpoint, rows, &sink), checkpoints)?;
    let entries = std::fs::read_dir(dir.path().join("out")).map(|d| d.count()).unwrap_or(0);
    t.push_str(&format!(
        "### The files sink: {checkpoints} checkpoints of {} rows, one writer, a local folder\n\n{}\n\
         At the end the output folder holds {entries} entries (a folder per checkpoint and the claim); a commit \
         checks its own checkpoint's folder and files, one `stat` each, and lists none of the others. On an \
         object store a commit writes one marker and checks its own files the same way.\n\n",
        args.rows_per_checkpoint,
        windows_table(&times, checkpoints)?
    ));

    let bigquery = sluice_bench::plugin("sluice_sink_bigquery.wasm")?;
    let double = sluice_bigquery_double::BigQueryDouble::start()?;
    let table = "projects/bench/datasets/d/tables/events";
    double.create_table(table, sluice_bigquery_double::generator_schema());
    let dir = tempfile::tempdir()?;
    let sink = format!(
        "[sink]\nid = \"events\"\nplugin = \"{}\"\n[sink.options]\ntable = \"{table}\"\n[sink.grpc.bigquery]\naddress = \"{}\"\n",
        bigquery.display(),
        double.address()
    );
    let times = timed_commits(s, dir.path(), &generator_job(1, args.rows_per_checkpoint, rows, &sink), checkpoints)?;
    ensure!(double.visible_count(table) == rows, "BigQuery landed {} rows of {rows}", double.visible_count(table));
    t.push_str(&format!(
        "### The BigQuery sink: {checkpoints} checkpoints of {} rows, one writer, the Storage Write API double on \
         loopback (one pending stream finalized and committed per checkpoint)\n\n{}\n\
         The double's table holds all {rows} rows at the end.\n",
        args.rows_per_checkpoint,
        windows_table(&times, checkpoints)?
    ));
    Ok(t)
}

/// Runs `toml` in `dir` and returns its commits' times.
fn timed_commits(s: &Setup, dir: &Path, toml: &str, checkpoints: u64) -> Result<Vec<(u64, u64)>> {
    let stderr = run(s, dir, toml, &[("RUST_LOG", "warn,sluice_engine::coordinator=debug")])?;
    let times = commit_times(&stderr);
    ensure!(times.len() as u64 >= checkpoints, "the run logged {} commits of {checkpoints} checkpoints", times.len());
    Ok(times)
}

struct TableFacts {
    metadata_bytes: u64,
    /// Data files the current snapshot holds.
    data_files: usize,
    metadata_files: usize,
    snapshots: usize,
    manifests: usize,
}

/// What the job's table holds, read through iceberg-rust's SQL catalog.
fn read_table(dir: &Path) -> Result<TableFacts> {
    let warehouse = dir.join("warehouse");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let catalog = sluice_bench::sql_catalog(&warehouse).await?;
        let ident = iceberg::TableIdent::from_strs(["demo", "events"])?;
        let table = iceberg::Catalog::load_table(&catalog, &ident).await?;
        let location = table.metadata_location().context("no metadata location")?;
        let local = location.trim_start_matches("file://");
        let metadata_bytes = std::fs::metadata(local).with_context(|| local.to_string())?.len();
        let folder = Path::new(local).parent().context("metadata folder")?;
        let metadata_files = std::fs::read_dir(folder)?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".metadata.json"))
            .count();
        let metadata = table.metadata();
        let head = metadata.current_snapshot().context("no snapshot")?;
        let data_files = head
            .summary()
            .additional_properties
            .get("total-data-files")
            .and_then(|n| n.parse().ok())
            .context("the head snapshot's summary has no total-data-files")?;
        let manifests = table.manifest_list_reader(head).load().await?.entries().len();
        Ok(TableFacts {
            metadata_bytes,
            data_files,
            metadata_files,
            snapshots: metadata.snapshots().count(),
            manifests,
        })
    })
}

fn writer_section(s: &Setup, args: &Args) -> Result<String> {
    // Each count runs `--writer-reps` times, the counts taking turns; the
    // table shows the medians (one run's noise here is about ±10 %, as large
    // as the slope it judges).
    let mut runs: Vec<(u32, Vec<Duration>, Vec<Duration>)> =
        args.writers.iter().map(|n| (*n, Vec::new(), Vec::new())).collect();
    for _ in 0..args.writer_reps.max(1) {
        for (n, walls, cpus) in runs.iter_mut() {
            let dir = tempfile::tempdir()?;
            let every = 100_000u64.min(args.writer_rows / u64::from((*n).max(1))).max(1);
            let toml = job(s, dir.path(), *n, every, args.writer_rows);
            let cpu = children_cpu();
            let wall = Instant::now();
            run(s, dir.path(), &toml, &[])?;
            walls.push(wall.elapsed());
            cpus.push(children_cpu().saturating_sub(cpu));
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let measured: Vec<(u32, Duration, Duration)> =
        runs.iter_mut().map(|(n, walls, cpus)| (*n, median(walls), median(cpus))).collect();
    let rate = |d: &Duration| args.writer_rows as f64 / d.as_secs_f64().max(1e-9);
    let Some((_, wall1, cpu1)) = measured.first().copied() else { bail!("--writers: none given") };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    // The goal past as many writers as cores: throughput stays flat, never
    // under what as many writers as cores reached.
    let at_cores = measured.iter().find(|(n, _, _)| *n == cores).map(|(_, wall, _)| rate(wall));
    let mut t = format!(
        "### Writers: {} rows, checkpoints of 100,000 rows per writer, unpartitioned ({cores} cores), median of {} runs taking turns\n\n\
         | writers | rows/s | × {} writer(s) | rows/CPU-s | × {} writer(s) | goal |\n|---:|---:|---:|---:|---:|---|\n",
        args.writer_rows,
        args.writer_reps.max(1),
        measured[0].0,
        measured[0].0,
    );
    for (n, wall, cpu) in &measured {
        let goal = match at_cores {
            Some(base) if *n > cores => {
                let verdict = if rate(wall) >= base { "met" } else { "**not met**" };
                format!("≥ {cores} writers' rows/s (flat past {cores} cores): {verdict}")
            }
            _ => String::new(),
        };
        t.push_str(&format!(
            "| {n} | {:.0} | {:.2}× | {:.0} | {:.2}× | {goal} |\n",
            rate(wall),
            rate(wall) / rate(&wall1),
            rate(cpu),
            rate(cpu) / rate(&cpu1),
        ));
    }
    Ok(t)
}

/// The peak memory (MB) the run summary in `dir/run.out` states.
fn summary_peak_mb(dir: &Path) -> Result<u64> {
    let out = std::fs::read_to_string(dir.join("run.out"))?;
    let at = out.rfind("peak memory ").context("the run summary states no peak memory")? + "peak memory ".len();
    out[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap_or("").parse().context("the summary's peak memory")
}

/// Peak memory against open partitions and tables, one writer each.
fn memory_section(s: &Setup, args: &Args) -> Result<String> {
    let rows = args.memory_rows;
    let every = 100_000u64.min(rows).max(1);
    let run_with = |options: &str, tables: Option<u64>| -> Result<(u64, Duration)> {
        let dir = tempfile::tempdir()?;
        let mut toml = job(s, dir.path(), 1, every, rows);
        if let Some(n) = tables {
            let names: Vec<String> = (0..n).map(|i| format!("\"t{i}\"")).collect();
            toml = toml
                .replace("kind = \"generator\"\n", &format!("kind = \"generator\"\ntables = [{}]\n", names.join(", ")));
            toml = toml.replace("table = \"demo.events\"", "table = \"demo.{table}\"");
        }
        toml = toml.replace("[sink.options]\n", &format!("[sink.options]\n{options}"));
        // 365 open partitions are more open files than the sandbox's default.
        toml = toml.replace("[sink.sandbox]\n", "[sink.sandbox]\nmax_open_files = 1024\n");
        let wall = Instant::now();
        run(s, dir.path(), &toml, &[])?;
        Ok((summary_peak_mb(dir.path())?, wall.elapsed()))
    };
    let mut t = format!(
        "### Memory against the work: {rows} rows, one writer, checkpoints of {every} rows, `buffer_mb` at its \
         default (64), `max_open_files = 1024`\n\n| open at once | peak memory of the process | × the first | rows/s |\n|---|---:|---:|---:|\n"
    );
    let mut row = |label: String, (peak, wall): (u64, Duration), first: &mut Option<u64>| {
        let base = *first.get_or_insert(peak);
        t.push_str(&format!(
            "| {label} | {peak} MB | {:.2}× | {:.0} |\n",
            peak as f64 / base.max(1) as f64,
            rows as f64 / wall.as_secs_f64().max(1e-9)
        ));
    };
    let mut first = None;
    for n in [1u64, 30, 365] {
        let measured = run_with(&format!("partition_by = \"bucket[{n}](id)\"\n"), None)?;
        row(format!("{n} partition(s)"), measured, &mut first);
    }
    let mut first = None;
    for n in [1u64, 10, 100] {
        let measured = run_with("", Some(n))?;
        row(format!("{n} table(s), unpartitioned"), measured, &mut first);
    }
    Ok(t)
}

fn document(args: &Args, checkpoints: u64, commits: &str, writers: &str, took: Duration) -> String {
    let date = today();
    let flag = if args.long { "--long".to_string() } else { format!("--checkpoints {checkpoints}") };
    format!(
        "# Cost against the size of the work, measured {date}\n\n\
         Produced on {date} by:\n\n```sh\n\
         cargo build-plugins && cargo build --release -p sluice && cargo run --release -p sluice-bench --bin \
         scale-bench -- {flag} --rows-per-checkpoint {rpc} --writer-rows {wr}\n```\n\n\
         The real `sluice` binary on the 2-core development machine, a local warehouse and a SQLite catalog; the \
         whole run took {took:.0} s. Each figure is compared with a baseline of the same run. Commit times are the \
         engine's own (`commit done` at debug level: the plugin's `commit` call, the host's retries included).\n\n\
         {commits}\n{writers}",
        rpc = args.rows_per_checkpoint,
        wr = args.writer_rows,
        took = took.as_secs_f64(),
    )
}
