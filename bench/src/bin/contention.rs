//! Seed 002's commit-contention study: strategies A0, A, A-fixed, B, C and
//! D (Sluice) side by side on a real Iceberg table. Writes the markdown table
//! and the chart to `docs/src/performance/contention.md` and `docs/src/performance/contention.png`.
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin contention`

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use sluice_bench::contention::{Config, Strategy, run_once};
use sluice_bench::report::{Cell, chart, markdown};
use sluice_bench::{plugin, workspace};
use sluice_engine::plugin::PluginHost;

#[derive(Parser)]
struct Args {
    /// Writer counts W to compare.
    #[arg(long, value_delimiter = ',', default_values_t = [4u32, 12])]
    writers: Vec<u32>,
    /// Windows K per writer (each covers 30 day-partitions).
    #[arg(long, default_value_t = 2)]
    windows: u32,
    /// Rows per day-partition per writer per window.
    #[arg(long, default_value_t = 20)]
    rows_per_partition: u64,
    /// Repetitions per (strategy, W).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Commit attempts before a strategy gives a commit up.
    #[arg(long, default_value_t = 8)]
    max_attempts: u32,
    /// Injected catalog commit latency in milliseconds (a stand-in for a remote catalog).
    #[arg(long, default_value_t = 5)]
    delay_ms: u64,
    /// Seed of the backoff jitter.
    #[arg(long, default_value_t = 2)]
    seed: u64,
    /// Where to write the report (markdown); the chart goes next to it as .png.
    #[arg(long, default_value = "docs/src/performance/contention.md")]
    out: std::path::PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let wasm = plugin("sluice_sink_iceberg.wasm")?;
    let host = PluginHost::new(Some(workspace().join("target/bench-component-cache")))?;
    host.load(&wasm)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let started = std::time::Instant::now();
    let cells = measure(&args, &rt, &host, &wasm)?;
    let table = markdown(&cells);
    println!("{table}");
    let duplicated: u64 = cells.iter().map(Cell::duplicated).sum();
    let check = if duplicated == 0 {
        "Check: no strategy duplicated a row.".to_string()
    } else {
        format!("Check FAILED: {duplicated} duplicated rows (see the table).")
    };
    println!("{check}");

    let png = args.out.with_extension("png");
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let chart_line = draw_chart(&cells, &args.writers, &png);
    let reading = reading(&args, &cells);
    let parts = Report { table, check, chart_line, reading, took: started.elapsed(), date: today() };
    std::fs::write(&args.out, document(&args, &parts))?;
    eprintln!("wrote {} and {}", args.out.display(), png.display());
    anyhow::ensure!(duplicated == 0, "a strategy duplicated rows");
    Ok(())
}

/// Runs every strategy `args.reps` times for each writer count, logging each run.
fn measure(args: &Args, rt: &tokio::runtime::Runtime, host: &PluginHost, wasm: &Path) -> Result<Vec<Cell>> {
    let mut cells = Vec::new();
    for &writers in &args.writers {
        for strategy in Strategy::ALL {
            let cfg = Config {
                writers,
                windows: args.windows,
                rows_per_partition: args.rows_per_partition,
                max_attempts: args.max_attempts,
                backoff_base: Duration::from_millis(10),
                backoff_cap: Duration::from_millis(500),
                commit_delay: Duration::from_millis(args.delay_ms),
                seed: args.seed,
            };
            let mut runs = Vec::new();
            for rep in 0..args.reps {
                let dir = tempfile::tempdir()?;
                let outcome = run_once(rt, host, wasm, strategy, &cfg, dir.path())?;
                eprintln!(
                    "W={writers} {:<10} rep {}: {:.2}s, {} attempts, {} conflicts, {} lost, {}/{} rows, {} duplicated",
                    strategy.name(),
                    rep + 1,
                    outcome.wall.as_secs_f64(),
                    outcome.attempts,
                    outcome.conflicts,
                    outcome.lost_windows,
                    outcome.rows_landed,
                    outcome.rows_expected,
                    outcome.duplicated_rows
                );
                runs.push(outcome);
            }
            cells.push(Cell { strategy, writers, runs });
        }
    }
    Ok(cells)
}

/// Draws the chart to `png`; the report's line that shows it, or says why not.
fn draw_chart(cells: &[Cell], writers: &[u32], png: &Path) -> String {
    match chart(cells, writers, png) {
        Ok(()) => format!(
            "![wall time and lost windows per strategy]({})",
            png.file_name().map_or(String::new(), |n| n.to_string_lossy().into_owned())
        ),
        Err(e) => format!("(chart not drawn: {e})"),
    }
}

/// The report's "Reading" bullets: C against D for each W, and how the
/// retrying strategies change from the fewest writers to the most.
fn reading(args: &Args, cells: &[Cell]) -> String {
    let wall_of =
        |s: Strategy, w: u32| cells.iter().find(|c| c.strategy == s && c.writers == w).map_or(0.0, Cell::wall_mean);
    let mut reading = String::new();
    for &w in &args.writers {
        let (c, d) = (wall_of(Strategy::C, w), wall_of(Strategy::D, w));
        if d > 0.0 {
            reading.push_str(&format!(
                "- W = {w}: serialised commits (C) take {:.1}× the time of Sluice's fan-in (D).\n",
                c / d
            ));
        }
    }
    if let (Some(lo), Some(hi)) = (args.writers.first(), args.writers.last())
        && lo != hi
    {
        for s in [Strategy::A0, Strategy::A, Strategy::AFixed] {
            let lost = |w: u32| cells.iter().find(|c| c.strategy == s && c.writers == w).map_or(0.0, Cell::lost_mean);
            reading.push_str(&format!(
                "- {}: W {lo} → {hi} changes wall time {:.2}s → {:.2}s and windows lost {:.1} → {:.1}.\n",
                s.name(),
                wall_of(s, *lo),
                wall_of(s, *hi),
                lost(*lo),
                lost(*hi)
            ));
        }
    }
    reading
}

/// The measured parts of the report.
struct Report {
    table: String,
    check: String,
    chart_line: String,
    reading: String,
    /// How long the measuring and the chart took.
    took: Duration,
    /// The day it was measured (UTC, `YYYY-MM-DD`): the docs date every figure.
    date: String,
}

/// Today's date in UTC as `YYYY-MM-DD` (Howard Hinnant's civil-from-days).
fn today() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0) + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The markdown report: the command that reproduces it, the setup, the
/// measured parts and seed 002's numbers to compare with.
fn document(args: &Args, r: &Report) -> String {
    let command = format!(
        "cargo build-plugins && cargo run --release -p sluice-bench --bin contention -- --writers {} --windows {} --rows-per-partition {} --reps {} --max-attempts {} --delay-ms {} --seed {}",
        args.writers.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        args.windows,
        args.rows_per_partition,
        args.reps,
        args.max_attempts,
        args.delay_ms,
        args.seed
    );
    let legend: String = Strategy::ALL.iter().map(|s| format!("- **{}**: {}\n", s.name(), s.describe())).collect();
    format!(
        "# Commit contention: seed 002's strategies, measured {date}\n\n\
         Produced on {date} by:\n\n```sh\n{command}\n```\n\n\
         One real Iceberg table (iceberg-rust `SqlCatalog` on SQLite, local warehouse) partitioned by `day(day)`; \
         W writers × K = {windows} windows × 30 day-partitions × {rpp} rows; catalog commit latency raised by {delay} ms; \
         at most {attempts} commit attempts; mean ± standard deviation over {reps} repetitions; the run took {took:.0} s.\n\n\
         {legend}\n{table}\n{check}\n\n{chart_line}\n\n## Reading\n\n{reading}\nSeed 002 reported, with 4 writers on a remote catalog: retrying with no sleep failed 236 times against 94 with backoff, \
         backoff still lost 3.3 windows on average, serialising took 401 s → 1164 s (2.9× slower than fan-in), the fan-in \
         committer was fastest with zero conflicts, and going from 4 to 12 writers took 401 s → 773 s with failures rising \
         from 3.3 to 69.7; full jitter and fixed backoff were roughly a tie.\n",
        table = r.table,
        check = r.check,
        chart_line = r.chart_line,
        reading = r.reading,
        windows = args.windows,
        rpp = args.rows_per_partition,
        delay = args.delay_ms,
        attempts = args.max_attempts,
        reps = args.reps,
        took = r.took.as_secs_f64(),
        date = r.date,
    )
}
