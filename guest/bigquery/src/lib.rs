//! `bigquery`: a Sluice sink that lands rows in a BigQuery table through the
//! Storage Write API, exactly once.
//!
//! - Each writer owns a BUFFERED write stream and appends with explicit
//!   offsets (see [`writer`]); rows are `ProtoRows` of a writer schema derived
//!   from the Arrow schema and checked against the table's schema.
//! - At a checkpoint a writer hands over `(stream, last offset)`; the
//!   committer makes the checkpoint visible with `FlushRows` (see
//!   [`committer`]).
//!
//! The plugin reaches the API only through the host's `grpc` capability, by
//! endpoint name; the address and the credentials stay in the host.

mod committer;
mod config;
mod rpc;
mod writer;

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    GetWriteStreamRequest, WriteStream, WriteStreamView,
};
use sluice_bigquery_rows::RowEncoder;
use sluice_guest_sdk::{Guest, PluginInfo, SinkError, error, ipc};

pub struct BigQuerySink;

impl Guest for BigQuerySink {
    type Writer = writer::BigQueryWriter;
    type Committer = committer::BigQueryCommitter;

    fn describe() -> PluginInfo {
        PluginInfo {
            name: "bigquery".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            description: "Lands rows in a BigQuery table through the Storage Write API: BUFFERED streams, explicit offsets, FlushRows per checkpoint, exactly once".to_string(),
            options: config::option_specs(),
            capabilities: vec!["grpc: the Storage Write API endpoint named by option `endpoint`".to_string()],
        }
    }

    /// Reads the table's schema from its `_default` stream (GetWriteStream,
    /// view FULL), which writes nothing, and checks the rows against it.
    fn validate(options: Vec<(String, String)>, schema: Vec<u8>) -> Result<(), SinkError> {
        let cfg = config::Config::parse(options)?;
        let arrow = ipc::decode_schema(&schema)?;
        let req = GetWriteStreamRequest { name: cfg.default_stream(), view: WriteStreamView::Full as i32 };
        let ws: WriteStream = rpc::unary(&cfg.endpoint, "GetWriteStream", &req, cfg.rpc_timeout_ms).map_err(|f| {
            let m = f.message();
            if m.starts_with("NOT_FOUND") {
                error::config(format!("table {} does not exist ({m})", cfg.table))
            } else if matches!(f, rpc::Failure::Transient(_)) {
                error::config(format!("the Storage Write API is unreachable ({m})"))
            } else {
                error::config(format!("cannot read table {}: {m}", cfg.table))
            }
        })?;
        let Some(table) = ws.table_schema.or(cfg.table_schema) else {
            return Err(error::config(format!("the service returned no schema for table {}", cfg.table)));
        };
        RowEncoder::new(arrow, Some(&table)).map_err(|e| error::config(format!("{}: {e}", cfg.table)))?;
        Ok(())
    }
}

sluice_guest_sdk::export_plugin!(BigQuerySink);
