//! Runs the BigQuery Storage Write API test double as a standalone server, so
//! `examples/bigquery.toml` can be tried without a cloud account.
//!
//! ```text
//! cargo run -p sluice-bigquery-double -- --listen 127.0.0.1:9060 --table projects/demo/datasets/sluice/tables/events
//! ```
//! The table gets the schema of Sluice's `generator` source. On Ctrl-C it
//! prints how many rows each table shows to readers.

use anyhow::Context;
use clap::Parser;
use sluice_bigquery_double::{BigQueryDouble, Reflush, generator_schema};

#[derive(Parser)]
#[command(about = "A local test double of the BigQuery Storage Write API (BigQueryWrite over gRPC)")]
struct Args {
    /// Address to listen on (loopback only, by default).
    #[arg(long, default_value = "127.0.0.1:9060")]
    listen: String,
    /// Tables to create, `projects/P/datasets/D/tables/T`, with the generator's schema.
    #[arg(long = "table", default_value = "projects/demo/datasets/sluice/tables/events")]
    tables: Vec<String>,
    /// How to answer a FlushRows at or below the flushed offset: ok,
    /// already-exists or out-of-range (services differ; see `Reflush`).
    #[arg(long, default_value = "ok")]
    reflush: Reflush,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let args = Args::parse();
    let double = BigQueryDouble::start_on(&args.listen).context("starting the BigQuery test double")?;
    double.answer_reflush(args.reflush);
    for table in &args.tables {
        double.create_table(table, generator_schema());
    }
    println!("BigQuery Storage Write test double listening on {}", double.address());
    println!("  table methods (REST, bigquery/v2) on {}", double.rest_address());
    for table in &args.tables {
        println!("  table {table}");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(tokio::signal::ctrl_c()).context("waiting for Ctrl-C")?;
    for table in &args.tables {
        println!(
            "{table}: {} visible rows, {} appended but not flushed",
            double.visible_count(table),
            double.invisible_count(table)
        );
    }
    Ok(())
}
