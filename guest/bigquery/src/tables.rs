//! The sink's tables: checked, created and evolved before any row of a new
//! table or a new shape is appended.
//!
//! Invariants:
//! - a table's schema is read through the Storage Write API
//!   (`GetWriteStream` on its `_default` stream, view FULL), so a job whose
//!   tables exist and fit needs only its gRPC grant;
//! - creating a table (`create_table`) and evolving a schema go through the
//!   BigQuery API's `tables.insert` / `tables.patch` ([`crate::rest`]);
//!   both are idempotent: an existing table that takes the rows is left
//!   alone, so a replay after a crash changes nothing;
//! - with `mode = "upsert"` the table's primary key is checked first (and a
//!   missing table created with it), see [`crate::upsert`];
//! - a change BigQuery cannot make (a column dropped or narrowed, a REQUIRED
//!   column added) is a `config` error naming the table and the column, and
//!   nothing is changed.

use std::sync::Arc;

use arrow_schema::Schema;
use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    GetWriteStreamRequest, TableSchema, WriteStream, WriteStreamView,
};
use sluice_bigquery_rows::RowEncoder;
use sluice_bigquery_rows::evolve::{self, EvolveError};
use sluice_guest_sdk::{SinkError, Table, error, ipc, log};

use crate::config::{self, Config};
use crate::rest::{RestError, Tables};
use crate::rpc;
use crate::upsert;

/// The schema of `path` as the Storage Write API reports it; `Err(why)`
/// (the service's words) when the table does not exist.
pub(crate) fn read_schema(cfg: &Config, path: &str) -> Result<Result<TableSchema, String>, SinkError> {
    let req = GetWriteStreamRequest { name: config::default_stream(path), view: WriteStreamView::Full as i32 };
    match rpc::unary::<_, WriteStream>(&cfg.endpoint, "GetWriteStream", &req, cfg.rpc_timeout_ms) {
        Ok(ws) => match ws.table_schema.or_else(|| cfg.table_schema.clone()) {
            Some(schema) => Ok(Ok(schema)),
            None => Err(error::config(format!(
                "the service returned no schema for table {path}; give it as option `table_schema`"
            ))),
        },
        Err(f) if f.message().starts_with("NOT_FOUND") => Ok(Err(f.message().to_string())),
        Err(f @ rpc::Failure::Transient(_)) => Err(error::retryable(format!(
            "reading table {path}: the Storage Write API is unreachable ({})",
            f.message()
        ))),
        Err(f) => Err(error::config(format!("cannot read table {path}: {}", f.message()))),
    }
}

fn refused(path: &str, e: EvolveError) -> SinkError {
    error::config(format!("table {path}: {e}; the table is left as it is"))
}

/// [`evolve::evolve`], with a type change reported the way the row encoder
/// words it (the Arrow type and the column's BigQuery type).
fn evolved(path: &str, schema: &TableSchema, arrow: &Arc<Schema>) -> Result<Option<TableSchema>, SinkError> {
    match evolve::evolve(schema, arrow) {
        Ok(e) => Ok(e),
        Err(e @ EvolveError::TypeChange { .. }) => match RowEncoder::new(arrow.clone(), Some(schema)) {
            Err(why) => Err(error::config(format!(
                "{path}: {why}; BigQuery cannot change a column's type in place, so the table is left as it is"
            ))),
            Ok(_) => Err(refused(path, e)),
        },
        Err(e) => Err(refused(path, e)),
    }
}

fn missing(path: &str, why: &str) -> SinkError {
    error::config(format!("table {path} does not exist ({why}) and option `create_table` is false"))
}

/// A failed table call, after `context` (what was done, to which table).
fn rest_error(context: &str, e: RestError) -> SinkError {
    match e {
        RestError::Denied(m) => error::config(format!("{context}: {m}")),
        e if e.is_transient() => error::retryable(format!("{context}: {e}")),
        e => error::fatal(format!("{context}: {e}")),
    }
}

/// Checks, without writing, that rows of `source` can land: the table
/// exists and takes them (after an allowed evolution), or may be created.
pub(crate) fn check(cfg: &Config, source: &Table) -> Result<(), SinkError> {
    let path = cfg.table_path(&source.name)?;
    let arrow = ipc::decode_schema(&source.schema)?;
    if let (true, Some(key)) = (cfg.upserts(&source.name), &cfg.key) {
        upsert::check_columns(&path, &arrow, key)?;
        if !upsert::check_key(cfg, &path, key)? {
            if !cfg.create_table {
                return Err(missing(&path, "tables.get answered 404"));
            }
            return upsert::check_creation(&path, &arrow, key);
        }
    }
    match read_schema(cfg, &path)? {
        Ok(schema) => {
            let target = evolved(&path, &schema, &arrow)?.unwrap_or(schema);
            RowEncoder::new(arrow, Some(&target)).map_err(|e| error::config(format!("{path}: {e}")))?;
            Ok(())
        }
        Err(why) if !cfg.create_table => Err(missing(&path, &why)),
        Err(why) => {
            evolve::creation_schema(&arrow).map_err(|e| error::config(format!("{path}: {e}")))?;
            // Creating it will need the HTTP grant: ask now, while nothing is written.
            let context = format!("table {path} does not exist ({why}); creating it needs the BigQuery API");
            tables(cfg).get(&path).map_err(|e| rest_error(&context, e))?;
            Ok(())
        }
    }
}

pub(crate) fn api(cfg: &Config) -> Tables<'_> {
    tables(cfg)
}

fn tables(cfg: &Config) -> Tables<'_> {
    Tables { endpoint: &cfg.rest_endpoint, timeout_ms: cfg.rpc_timeout_ms, retry: cfg.retry() }
}

/// Makes the table of `source` take its rows: created when missing (and
/// allowed), its schema evolved when the rows have more or relaxed columns.
pub(crate) fn prepare(cfg: &Config, source: &Table) -> Result<(), SinkError> {
    let path = cfg.table_path(&source.name)?;
    let arrow = ipc::decode_schema(&source.schema)?;
    if let (true, Some(key)) = (cfg.upserts(&source.name), &cfg.key) {
        // The primary key first: a table keyed otherwise is refused before
        // anything (its schema included) changes.
        upsert::check_columns(&path, &arrow, key)?;
        if !upsert::check_key(cfg, &path, key)? {
            if !cfg.create_table {
                return Err(missing(&path, "tables.get answered 404"));
            }
            if !upsert::create(cfg, &path, &arrow, key, "tables.get answered 404")? {
                // Someone else created it first: it must have the key too.
                upsert::check_key(cfg, &path, key)?;
                return evolve_table(cfg, &path, &arrow);
            }
            return Ok(());
        }
    }
    match read_schema(cfg, &path)? {
        Ok(schema) => match evolved(&path, &schema, &arrow)? {
            None => Ok(()),
            Some(_) => evolve_table(cfg, &path, &arrow),
        },
        Err(why) if !cfg.create_table => Err(missing(&path, &why)),
        Err(why) => create_table(cfg, &path, &arrow, &why),
    }
}

fn create_table(cfg: &Config, path: &str, arrow: &Schema, why: &str) -> Result<(), SinkError> {
    let schema = evolve::creation_schema(arrow).map_err(|e| error::config(format!("{path}: {e}")))?;
    let context = format!("table {path} does not exist ({why}); creating it");
    let fields = evolve::to_rest_fields(&schema);
    // A transient failure is tried again here; an insert that did land
    // answers 409 the next time, which reads the table instead.
    let created = cfg
        .retry()
        .run(
            |_| tables(cfg).insert(path, &fields),
            RestError::is_transient,
            |e, _, _| log::warn(&format!("{context}: {e}; retrying")),
        )
        .map_err(|failed| rest_error(&context, failed.error))?;
    if created {
        log::info(&format!("created table {path}"));
        Ok(())
    } else {
        // Someone else created it first: make sure theirs takes the rows.
        evolve_table(cfg, path, arrow)
    }
}

/// Reads the table through the REST API and patches its schema until it
/// takes rows of `arrow`.
pub(crate) fn evolve_table(cfg: &Config, path: &str, arrow: &Schema) -> Result<(), SinkError> {
    let api = tables(cfg);
    let mut last = String::new();
    for attempt in 1..=cfg.attempts {
        let table = match api.get(path).map_err(|e| rest_error(&format!("reading table {path}"), e))? {
            Some(t) => t,
            None => return Err(error::config(format!("table {path} disappeared while its schema was evolved"))),
        };
        let current = evolve::from_rest_fields(&table.fields)
            .map_err(|e| error::fatal(format!("table {path}: the API returned a schema Sluice cannot read: {e}")))?;
        let Some(evolved) = evolve::evolve(&current, arrow).map_err(|e| refused(path, e))? else {
            return Ok(());
        };
        match api.patch_schema(path, &evolve::to_rest_fields(&evolved), table.etag.as_deref()) {
            Ok(()) => {
                log::info(&format!("table {path}: schema evolved to {} column(s)", evolved.fields.len()));
                return Ok(());
            }
            Err(RestError::Denied(m)) => return Err(error::config(format!("evolving table {path}: {m}"))),
            // A 412 (the etag moved), a refusal because another writer
            // changed the schema meanwhile, or a transient failure: read the
            // table again and decide afresh.
            Err(e) => {
                log::warn(&format!("evolving table {path} (attempt {attempt}): {e}; reading it again"));
                last = e.to_string();
                if let Some(wait) = cfg.retry().delay(attempt) {
                    std::thread::sleep(wait);
                }
            }
        }
    }
    Err(error::retryable(format!("evolving table {path} failed {} times, last: {last}", cfg.attempts)))
}
