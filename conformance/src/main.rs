//! `sluice-plugin-test PLUGIN.wasm --job JOB.toml [--verify-cmd CMD]`: the
//! conformance suite (see the library). `sluice plugin test` runs this
//! binary. Prints one line per case and exits non-zero on any failure.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use sluice_conformance::{CASES, Checker, Suite, clean_up, run_cases};

#[derive(Parser)]
#[command(name = "sluice plugin test", about = "Proves a sink plugin exactly once against its target")]
struct Args {
    /// The plugin component to test.
    plugin: PathBuf,
    /// A job file whose [sink] section (options, grants, catalog,
    /// endpoints) points at a scratch target; its source is replaced by
    /// generated rows.
    #[arg(long)]
    job: PathBuf,
    /// A shell command printing the ids visible in the target, for targets
    /// the suite cannot read itself (it reads Parquet file trees and
    /// Iceberg tables).
    #[arg(long)]
    verify_cmd: Option<String>,
    /// Rows per case.
    #[arg(long, default_value_t = 3000)]
    rows: u64,
    /// Directory of the compiled-plugin cache.
    #[arg(long, env = "SLUICE_CACHE_DIR")]
    cache_dir: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let cache = args
        .cache_dir
        .clone()
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sluice/components")));
    let suite = match Suite::new(&args.plugin, &args.job, args.verify_cmd.clone(), args.rows, cache) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(2);
        }
    };
    let checker = match suite.checker() {
        Checker::ParquetTree(dir) => format!("Parquet files under {}", dir.display()),
        Checker::Iceberg { table } => format!("Iceberg table {table}"),
        Checker::Command(cmd) => format!("`{cmd}`"),
    };
    println!(
        "testing {} with the sink of {}; visible rows read from {checker}\n",
        args.plugin.display(),
        args.job.display()
    );
    let created = suite.iceberg_table_missing();
    let terminal = std::io::stderr().is_terminal();
    let results = run_cases(&suite, |k, name| {
        if terminal {
            eprint!("\r\x1b[2K[{}/{}] {name} ...", k + 1, CASES.len());
        }
    });
    if terminal {
        eprint!("\r\x1b[2K");
    }
    let cleaned = clean_up(&suite, created);
    let results = match results {
        Ok(results) => results,
        Err(e) => {
            if let Some(line) = cleaned {
                println!("{line}");
            }
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    println!("| case | result | time | detail |\n|---|---|---:|---|");
    for r in &results {
        println!(
            "| {} | {} | {:.1} s | {} |",
            r.name,
            if r.passed { "pass" } else { "FAIL" },
            r.elapsed.as_secs_f64(),
            r.detail.replace('|', "/")
        );
    }
    let failed = results.iter().filter(|r| !r.passed).count();
    println!();
    if let Some(line) = cleaned {
        println!("{line}");
    }
    if failed == 0 {
        println!("all {} cases passed", results.len());
        ExitCode::SUCCESS
    } else {
        println!("{failed} of {} cases failed", results.len());
        ExitCode::FAILURE
    }
}
