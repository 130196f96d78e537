//! BigQuery sink throughput, measured in one run against the same in-process
//! Storage Write API test double (real gRPC over loopback):
//!
//! - the Sluice plugin, through the engine (checkpoints, FlushRows per
//!   checkpoint, the wasm boundary, the host's grpc capability);
//! - a native Rust writer doing the same protocol with tonic's generated
//!   client: the same rows (generated inside the timed loop, as Sluice's
//!   source does), the same encoder, one BUFFERED stream per writer, the
//!   same number of requests in flight per stream, FlushRows at the same
//!   checkpoints.
//!
//! Both share the test double, whose work (decoding and checking every row)
//! is part of both times.
//!
//! Each encoding is compared with the native writer using that encoding:
//! `format = "arrow"` (`arrow_rows`, the default: the batches cast to the
//! API's types and sent as Arrow IPC) and `format = "proto"` (ProtoRows).
//! The double checks Arrow rows column by column rather than row by row, so
//! the two encodings' figures are not comparable with each other as a
//! measure of the writers alone.
//!
//! `cargo build-plugins && cargo run --release -p sluice-bench --bin bigquery-bench`

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    AppendRowsRequest, CreateWriteStreamRequest, FlushRowsRequest, ProtoRows, WriteStream,
    append_rows_request::{ProtoData, Rows},
    append_rows_response::Response as AppendReply,
    big_query_write_client::BigQueryWriteClient,
    write_stream::Type as StreamType,
};
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    ArrowRecordBatch, append_rows_request::ArrowData,
};
use sluice_bench::{Measured, generator_job_toml, measure, plugin, print_ratio_table, run_quiet, write_job};
use sluice_bigquery_double::{BigQueryDouble, generator_schema};
use sluice_bigquery_rows::{ArrowEncoder, RowEncoder, split_by_size};
use sluice_engine::plugin::PluginHost;
use sluice_engine::source::generator::Generator;

#[derive(Parser)]
struct Args {
    /// Rows per measured run (`arrow_rows` moves 1,000,000 in about 0.2 s:
    /// fewer leaves the ratio to the machine's noise).
    #[arg(long, default_value_t = 4_000_000)]
    rows: u64,
    /// Rows per checkpoint, over all writers.
    #[arg(long, default_value_t = 1_000_000)]
    checkpoint_rows: u64,
    /// Repetitions of each path (the table shows the median).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Writer counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    writers: Vec<u32>,
    /// Row encodings to measure, in this order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "arrow,proto")]
    formats: Vec<Format>,
}

const BATCH_ROWS: u64 = 8192;
const MAX_REQUEST: usize = 9_000_000;
/// Requests in flight per stream, for both paths (the plugin's default).
const MAX_INFLIGHT: usize = 4;
const TABLE: &str = "projects/bench/datasets/d/tables/events";

fn run_plugin(
    host: &PluginHost,
    wasm: &Path,
    address: &str,
    args: &Args,
    writers: u32,
    format: Format,
) -> Result<Duration> {
    let dir = tempfile::tempdir()?;
    let sink = format!(
        r#"[sink]
plugin = "{wasm}"
[sink.options]
table = "{TABLE}"
format = "{format}"
max_request_bytes = {MAX_REQUEST}
max_inflight = {MAX_INFLIGHT}
[sink.grpc.bigquery]
address = "{address}"
[sink.sandbox]
memory_mb = 2048
"#,
        wasm = wasm.display(),
        format = format.option(),
    );
    let every = args.checkpoint_rows / u64::from(writers);
    let job = write_job(dir.path(), &generator_job_toml("bench", writers, every, args.rows, 0, BATCH_ROWS, &sink))?;
    let summary = run_quiet(&job, host)?;
    anyhow::ensure!(summary.rows_total == args.rows, "the plugin landed {} rows", summary.rows_total);
    Ok(summary.data_elapsed)
}

/// How rows travel in `AppendRows`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Format {
    Proto,
    Arrow,
}

impl Format {
    fn option(self) -> &'static str {
        match self {
            Format::Proto => "proto",
            Format::Arrow => "arrow",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Format::Proto => "ProtoRows",
            Format::Arrow => "arrow_rows",
        }
    }
}

/// The requests' row payloads for one batch, in order: `(rows, payload)`,
/// each under the request limit (as the plugin splits them).
fn encode_requests(
    format: Format,
    proto: &RowEncoder,
    arrow: &ArrowEncoder,
    batch: &arrow_array::RecordBatch,
) -> Result<Vec<(i64, Rows)>> {
    let mut out = Vec::new();
    match format {
        Format::Proto => {
            let mut rows = Vec::new();
            proto.encode(batch, &mut rows)?;
            let runs = split_by_size(&rows, MAX_REQUEST);
            let mut rows = rows.into_iter();
            for run in runs {
                let chunk: Vec<Vec<u8>> = rows.by_ref().take(run.len()).collect();
                let n = chunk.len() as i64;
                out.push((
                    n,
                    Rows::ProtoRows(ProtoData {
                        writer_schema: Some(proto.writer_schema()),
                        rows: Some(ProtoRows { serialized_rows: chunk }),
                    }),
                ));
            }
        }
        Format::Arrow => {
            let schema = arrow.writer_schema();
            let room = MAX_REQUEST.saturating_sub(schema.serialized_schema.len() + 1024);
            for (n, serialized_record_batch) in arrow.encode(batch, room)? {
                out.push((
                    n as i64,
                    Rows::ArrowRows(ArrowData {
                        writer_schema: Some(schema.clone()),
                        rows: Some(ArrowRecordBatch { serialized_record_batch, ..Default::default() }),
                    }),
                ));
            }
        }
    }
    Ok(out)
}

/// One native writer: ids `[first, end)`, a flush every `every` rows.
async fn native_writer(address: String, first: u64, end: u64, every: u64, format: Format) -> Result<()> {
    let channel = tonic::transport::Endpoint::from_shared(address)?.tcp_nodelay(true).connect().await?;
    let mut client = BigQueryWriteClient::new(channel).max_decoding_message_size(64 << 20);
    let stream = client
        .create_write_stream(CreateWriteStreamRequest {
            parent: TABLE.to_string(),
            write_stream: Some(WriteStream { r#type: StreamType::Buffered as i32, ..Default::default() }),
        })
        .await?
        .into_inner();
    let proto = RowEncoder::new(Generator::schema_ref(), stream.table_schema.as_ref())?;
    let arrow = ArrowEncoder::new(Generator::schema_ref(), stream.table_schema.as_ref())?;
    let (tx, rx) = tokio::sync::mpsc::channel::<AppendRowsRequest>(MAX_INFLIGHT);
    let mut replies = client.append_rows(tokio_stream::wrappers::ReceiverStream::new(rx)).await?.into_inner();
    let mut in_flight = 0usize;
    let mut offset: i64 = 0;
    let mut next = first;
    let mut since_flush = 0;
    while next < end {
        let stop = end.min(next + BATCH_ROWS);
        let batch = Generator::batch_for(next, stop);
        for (n, rows) in encode_requests(format, &proto, &arrow, &batch)? {
            // The same window as the plugin: at most MAX_INFLIGHT unacknowledged requests.
            while in_flight >= MAX_INFLIGHT {
                check(replies.message().await?)?;
                in_flight -= 1;
            }
            tx.send(AppendRowsRequest {
                write_stream: stream.name.clone(),
                offset: Some(offset),
                rows: Some(rows),
                ..Default::default()
            })
            .await?;
            in_flight += 1;
            offset += n;
        }
        since_flush += stop - next;
        next = stop;
        if since_flush >= every || next == end {
            while in_flight > 0 {
                check(replies.message().await?)?;
                in_flight -= 1;
            }
            client.flush_rows(FlushRowsRequest { write_stream: stream.name.clone(), offset: Some(offset - 1) }).await?;
            since_flush = 0;
        }
    }
    Ok(())
}

fn check(
    reply: Option<
        googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::AppendRowsResponse,
    >,
) -> Result<()> {
    match reply.context("the stream ended")?.response {
        Some(AppendReply::Error(e)) => bail!("append failed: {e:?}"),
        _ => Ok(()),
    }
}

fn run_native(
    rt: &tokio::runtime::Runtime,
    address: &str,
    args: &Args,
    writers: u32,
    format: Format,
) -> Result<Duration> {
    let started = Instant::now();
    rt.block_on(async {
        let p = u64::from(writers);
        let tasks: Vec<_> = (0..p)
            .map(|s| {
                let (first, end) = (s * args.rows / p, (s + 1) * args.rows / p);
                tokio::spawn(native_writer(address.to_string(), first, end, args.checkpoint_rows / p, format))
            })
            .collect();
        for t in tasks {
            t.await??;
        }
        anyhow::Ok(())
    })?;
    Ok(started.elapsed())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let wasm = plugin("sluice_sink_bigquery.wasm")?;
    let cache = sluice_bench::workspace().join("target/bench-component-cache");
    let host = PluginHost::new(Some(cache))?;
    host.load(&wasm)?; // compile (or load the cached compilation) before timing
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;

    for &w in &args.writers {
        for &format in &args.formats {
            let label = format.label();
            let mut native = Measured::new(format!("native tonic writer, {label}, {w} stream(s)"), args.rows);
            let mut plugin = Measured::new(format!("sluice bigquery plugin, {label}, {w} writer(s)"), args.rows);
            let mut bytes_per_row = 0.0;
            for rep in 0..args.reps {
                eprintln!("{w} writer(s), {label}: repetition {}/{}", rep + 1, args.reps);
                // A fresh double per run, so no run pays for another's stored rows.
                let d = BigQueryDouble::start()?;
                d.create_table(TABLE, generator_schema());
                measure(&mut native, || run_native(&rt, &d.address(), &args, w, format))?;
                let stats = d.stats();
                anyhow::ensure!(d.visible_count(TABLE) == args.rows, "native landed {} rows", d.visible_count(TABLE));
                bytes_per_row = stats.bytes_appended as f64 / stats.rows_appended.max(1) as f64;
                drop(d);
                let d = BigQueryDouble::start()?;
                d.create_table(TABLE, generator_schema());
                measure(&mut plugin, || run_plugin(&host, &wasm, &d.address(), &args, w, format))?;
                anyhow::ensure!(
                    d.visible_count(TABLE) == args.rows,
                    "the plugin landed {} rows",
                    d.visible_count(TABLE)
                );
            }
            let baseline = native.name.clone();
            let pair = [native, plugin];
            print_ratio_table(
                &format!(
                    "BigQuery sink, {label}, {w} writer(s): {} rows, {} rows per checkpoint, median of {}",
                    args.rows, args.checkpoint_rows, args.reps
                ),
                &pair,
                &baseline,
            );
            for m in &pair {
                println!("{}: {:.1} MB/s of request payload", m.name, m.rows_per_sec() * bytes_per_row / 1e6);
            }
            println!();
        }
    }
    Ok(())
}
