//! The sink's options (`[sink.options]`).

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::TableSchema;
use std::time::Duration;

use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{OptionSpec, SinkError, changes, claim, error, option_spec};
use sluice_retry::Policy;

pub(crate) fn option_specs() -> Vec<OptionSpec> {
    vec![
        option_spec(
            "table",
            "Destination table: projects/PROJECT/datasets/DATASET/tables/TABLE; for a source of several tables, a pattern with `{table}`, e.g. projects/p/datasets/lake/tables/{table}",
            true,
            None,
        ),
        option_spec(
            "endpoint",
            "Name of the gRPC endpoint in the job's [sink.grpc] that serves the Storage Write API",
            false,
            Some("bigquery"),
        ),
        option_spec(
            "rest_endpoint",
            "Name of the HTTP endpoint in the job's [sink.http] that serves the BigQuery API (tables.get/insert/patch, and jobs.insert/get with `mode = \"overwrite-partitions\"`), used to create tables, evolve their schemas and replace partitions",
            false,
            Some("bigquery"),
        ),
        option_spec(
            "create_table",
            "Create a missing table from the rows' schema (through `rest_endpoint`)",
            false,
            Some("true"),
        ),
        option_spec(
            "max_request_bytes",
            "Largest AppendRows request to send; batches are split to stay under it (the API's limit is 10 MB)",
            false,
            Some("9000000"),
        ),
        option_spec(
            "max_inflight",
            "AppendRows requests a writer keeps in flight on its connection before waiting for a reply",
            false,
            Some("4"),
        ),
        option_spec(
            "table_schema",
            "The table's schema as BigQuery JSON (`bq show --schema`), used when the write stream does not return it",
            false,
            None,
        ),
        option_spec(
            "format",
            "How rows cross to the API: `arrow` (arrow_rows: the batches as Arrow IPC) or `proto` (ProtoRows, for services that take no Arrow); `mode = \"upsert\"` always sends proto, the only format change data capture takes",
            false,
            Some("arrow"),
        ),
        option_spec("rpc_timeout_ms", "How long to wait for a reply to one request", false, Some("60000")),
        option_spec(
            "attempts",
            "Tries of one append or stream creation on transient errors (UNAVAILABLE, INTERNAL, timeouts); commits are retried by the engine (job.commit)",
            false,
            Some("6"),
        ),
        option_spec(
            "backoff_ms",
            "First wait between tries; doubles each time (up to 10 s), with jitter",
            false,
            Some("100"),
        ),
        option_spec(
            "mode",
            "`append` (every row is added), `overwrite-partitions`: the rows a run lands replace every partition of a column time-partitioned table they touch, exactly once (staged, then copied with WRITE_TRUNCATE per partition); partitions the run does not touch keep their rows; or `upsert`: a change stream ([source] key) lands through BigQuery's change data capture, each change an UPSERT or DELETE by primary key on the table's default stream, ordered by a sequence number from the source position, effectively once",
            false,
            Some("append"),
        ),
        option_spec(
            "key",
            "With `mode = \"upsert\"`: the table's primary key, e.g. `id` or `id,day`; optional, and if given it must equal the source's change key ([source] key)",
            false,
            None,
        ),
        option_spec(
            "max_staleness",
            "With `mode = \"upsert\"`: the `max_staleness` of a table the sink creates (how stale a query's answer may be, so BigQuery may apply changes in the background), as a duration like `15m`, `1h30m` or `2d` (units s, m, h, d), or a BigQuery INTERVAL in its canonical form `Y-M D H:M:S`; absent: none (queries apply every change first)",
            false,
            None,
        ),
        sluice_guest_sdk::changes::key_option_spec(),
        option_spec(
            INCARNATION_CREATED_MS,
            "set by the host, not the job file: when the job's incarnation began (ms since the Unix epoch), the first section of every `_CHANGE_SEQUENCE_NUMBER`",
            false,
            None,
        ),
        option_spec(
            DEAD_LETTER_TABLE,
            "set by the host, not the job file: the job's dead-letter table, which always takes appends",
            false,
            None,
        ),
        claim::option_spec(),
    ]
}

pub use sluice_guest_sdk::reserved::{DEAD_LETTER_TABLE, INCARNATION_CREATED_MS};

/// The API's own limit on one AppendRows request.
const API_LIMIT: u64 = 10 * 1024 * 1024;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// `projects/P/datasets/D/tables/T`, or a pattern with `{table}`.
    pub table: String,
    pub endpoint: String,
    pub rest_endpoint: String,
    pub create_table: bool,
    pub max_request_bytes: usize,
    pub max_inflight: usize,
    pub table_schema: Option<TableSchema>,
    pub rpc_timeout_ms: u32,
    pub attempts: u32,
    pub backoff_ms: u64,
    /// How this incarnation treats the datasets' claims.
    pub claim: claim::Mode,
    pub format: RowFormat,
    pub mode: WriteMode,
    /// The change stream's key columns (reserved option `sluice.key`), when
    /// the source is a change stream; then `mode` is `upsert`.
    pub key: Option<Vec<String>>,
    /// `max_staleness` as the table resource's `maxStaleness` (an INTERVAL
    /// in BigQuery's canonical text, `Y-M D H:M:S`).
    pub max_staleness: Option<String>,
    /// When the incarnation began (reserved option `sluice.incarnation-created-ms`;
    /// 0 when the host does not say): the first section of every
    /// `_CHANGE_SEQUENCE_NUMBER` (see [`crate::upsert`]).
    pub incarnation_created_ms: u64,
    /// The job's dead-letter table as the source names it (reserved option
    /// `sluice.dead-letter-table`): always append.
    pub dead_letter_table: Option<String>,
}

/// What the rows a run lands do to the table (option `mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteMode {
    /// Every row is added.
    Append,
    /// The rows replace each partition they touch (see [`crate::overwrite`]).
    OverwritePartitions,
    /// Each row is a change applied by primary key (see [`crate::upsert`]).
    Upsert,
}

/// How rows cross to the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowFormat {
    /// `proto_rows`: rows encoded as protobuf messages of a writer schema.
    Proto,
    /// `arrow_rows`: the batches themselves, as Arrow IPC.
    Arrow,
}

impl Config {
    pub fn parse(raw: Vec<(String, String)>) -> Result<Self, SinkError> {
        let o = Options::parse(raw, &option_specs())?;
        let table = o.required("table")?.trim().to_string();
        check_table_path(&table.replace("{table}", "t"), &table)?;
        let max_request_bytes: u64 = o.parsed("max_request_bytes")?.unwrap_or(9_000_000);
        if !(1024..=API_LIMIT - 64 * 1024).contains(&max_request_bytes) {
            return Err(error::config(format!(
                "option `max_request_bytes` = {max_request_bytes} must be between 1024 and {} (the API rejects requests over 10 MB)",
                API_LIMIT - 64 * 1024
            )));
        }
        let attempts: u32 = o.parsed("attempts")?.unwrap_or(6);
        if attempts == 0 {
            return Err(error::config("option `attempts` must be at least 1"));
        }
        let max_inflight: usize = o.parsed("max_inflight")?.unwrap_or(4);
        if !(1..=64).contains(&max_inflight) {
            return Err(error::config(format!("option `max_inflight` = {max_inflight} must be between 1 and 64")));
        }
        let table_schema = match o.get("table_schema") {
            None => None,
            Some(json) => Some(
                sluice_bigquery_rows::parse_table_schema(json)
                    .map_err(|e| error::config(format!("option `table_schema`: {e}")))?,
            ),
        };
        let format = match o.required("format")? {
            "proto" => RowFormat::Proto,
            "arrow" => RowFormat::Arrow,
            other => {
                return Err(error::config(format!("option `format` = {other:?} must be `proto` or `arrow`")));
            }
        };
        let mode = match o.required("mode")? {
            "append" => WriteMode::Append,
            "overwrite-partitions" => WriteMode::OverwritePartitions,
            "upsert" => WriteMode::Upsert,
            other => {
                return Err(error::config(format!(
                    "option `mode` = {other:?} must be `append`, `overwrite-partitions` or `upsert`"
                )));
            }
        };
        let key = o.get(changes::KEY_OPTION).map(changes::parse_key).transpose()?;
        match (mode, &key) {
            (WriteMode::Upsert, None) => {
                return Err(error::config(
                    "[sink.options] mode = \"upsert\" needs a change stream: set [source] key (the change key \
                     columns, e.g. key = [\"id\"]); the source delivers plain rows",
                ));
            }
            (WriteMode::Append | WriteMode::OverwritePartitions, Some(k)) => {
                return Err(error::config(format!(
                    "the source is a change stream ([source] key = {k:?}), which [sink.options] mode = {:?} cannot \
                     land (deletes and updates are no rows to add); set mode = \"upsert\"",
                    o.required("mode")?
                )));
            }
            _ => {}
        }
        if let Some(own) = o.get("key") {
            let own = parse_key_option(own)?;
            match &key {
                Some(k) if *k == own => {}
                Some(k) => {
                    return Err(error::config(format!(
                        "[sink.options] key = {own:?} differs from the source's change key [source] key = {k:?}; \
                         leave it out or make them equal"
                    )));
                }
                None => {
                    return Err(error::config(format!(
                        "[sink.options] key = {own:?} is only for mode = \"upsert\" over a change stream ([source] key)"
                    )));
                }
            }
        }
        let max_staleness = match o.get("max_staleness") {
            None => None,
            Some(_) if mode != WriteMode::Upsert => {
                return Err(error::config("[sink.options] max_staleness is only for mode = \"upsert\""));
            }
            Some(text) => Some(
                interval(text)
                    .map_err(|why| error::config(format!("[sink.options] max_staleness = {text:?}: {why}")))?,
            ),
        };
        let incarnation_created_ms = match o.get(INCARNATION_CREATED_MS) {
            None => 0,
            Some(v) => v.trim().parse::<u64>().map_err(|e| {
                error::config(format!("option `{INCARNATION_CREATED_MS}` = {v:?} is not a number of milliseconds: {e}"))
            })?,
        };
        Ok(Self {
            key,
            max_staleness,
            incarnation_created_ms,
            dead_letter_table: o.get(DEAD_LETTER_TABLE).map(str::to_string),
            mode,
            format,
            table_schema,
            max_inflight,
            table,
            endpoint: o.required("endpoint")?.to_string(),
            rest_endpoint: o.required("rest_endpoint")?.to_string(),
            create_table: o.flag("create_table")?,
            max_request_bytes: max_request_bytes as usize,
            rpc_timeout_ms: o.parsed("rpc_timeout_ms")?.unwrap_or(60_000),
            attempts,
            backoff_ms: o.parsed("backoff_ms")?.unwrap_or(100),
            claim: claim::Mode::from_options(&o)?,
        })
    }

    /// Whether rows of the source's `table` overwrite partitions: in
    /// `overwrite-partitions` mode, every table but the dead-letter table.
    pub fn overwrites(&self, table: &str) -> bool {
        self.mode == WriteMode::OverwritePartitions && self.dead_letter_table.as_deref() != Some(table)
    }

    /// Whether rows of the source's `table` are changes applied by key: in
    /// `upsert` mode, every table but the dead-letter table.
    pub fn upserts(&self, table: &str) -> bool {
        self.mode == WriteMode::Upsert && self.dead_letter_table.as_deref() != Some(table)
    }

    /// How appends and stream creations are retried on transient failures.
    pub fn retry(&self) -> Policy {
        Policy {
            attempts: self.attempts,
            initial: Duration::from_millis(self.backoff_ms),
            max: Duration::from_secs(10),
        }
    }

    /// The BigQuery table a source table lands in.
    pub fn table_path(&self, table: &str) -> Result<String, SinkError> {
        match (self.table.contains("{table}"), table.is_empty()) {
            // A path the pattern could have made is the table itself (the
            // job's dead letters named in full beside the pattern).
            (true, false) if in_pattern_form(&self.table, table) => {
                check_table_path(table, table)?;
                Ok(table.to_string())
            }
            (true, false) => {
                let valid = table.chars().all(|c| c.is_alphanumeric() || c == '_' || c == '-');
                if !valid {
                    return Err(error::config(format!(
                        "the source's table {table:?} cannot be a BigQuery table id (letters, digits, `_` and `-` only)"
                    )));
                }
                Ok(self.table.replace("{table}", table))
            }
            (false, true) => Ok(self.table.clone()),
            // A named table beside a single one, named in full (the job's
            // dead letters: `[job.dead_letter] table = "projects/p/datasets/d/tables/bad"`).
            (false, false) if table.starts_with("projects/") && table.contains("/tables/") => Ok(table.to_string()),
            (true, true) => Err(error::config(format!(
                "option `table` = {:?} is a pattern for several tables, but the source has one unnamed table",
                self.table
            ))),
            (false, false) => Err(error::config(format!(
                "option `table` = {:?} names one table, but the source delivers table {table:?}: write a pattern \
                 with `{{table}}`, e.g. projects/p/datasets/lake/tables/{{table}}",
                self.table
            ))),
        }
    }
}

/// The `_default` stream of `table`, used to read the table's schema.
pub fn default_stream(table: &str) -> String {
    format!("{table}/streams/_default")
}

/// Whether `table` is what `pattern` (with one `{table}`) makes of some
/// name: its text before `{table}`, a name, then its text after.
fn in_pattern_form(pattern: &str, table: &str) -> bool {
    let Some((before, after)) = pattern.split_once("{table}") else { return false };
    !after.contains("{table}")
        && table.len() > before.len() + after.len()
        && table.starts_with(before)
        && table.ends_with(after)
}

fn check_table_path(path: &str, raw: &str) -> Result<(), SinkError> {
    let parts: Vec<&str> = path.split('/').collect();
    let shaped = parts.len() == 6
        && parts[0] == "projects"
        && parts[2] == "datasets"
        && parts[4] == "tables"
        && [parts[1], parts[3], parts[5]].iter().all(|p| !p.is_empty());
    if shaped {
        Ok(())
    } else {
        Err(error::config(format!(
            "option `table` = {raw:?} must look like projects/PROJECT/datasets/DATASET/tables/TABLE"
        )))
    }
}

/// `[sink.options] key`: one column, a comma-separated list, or a JSON array.
fn parse_key_option(text: &str) -> Result<Vec<String>, SinkError> {
    let key: Vec<String> = if text.trim_start().starts_with('[') {
        serde_json::from_str(text)
            .map_err(|e| error::config(format!("[sink.options] key = {text:?} is not a JSON array of names: {e}")))?
    } else {
        text.split(',').map(|k| k.trim().to_string()).collect()
    };
    if key.is_empty() || key.iter().any(String::is_empty) {
        return Err(error::config(format!("[sink.options] key = {text:?} names no column")));
    }
    Ok(key)
}

/// A `max_staleness` as BigQuery's canonical INTERVAL text (`Y-M D H:M:S`,
/// what the table resource's `maxStaleness` holds): a duration of units
/// `d`, `h`, `m`, `s` (`15m`, `1h30m`), or that text itself. Hand-rolled:
/// the plugin needs these few lines, not a time crate in its component.
pub(crate) fn interval(text: &str) -> Result<String, String> {
    let t = text.trim();
    if t.contains(' ') {
        let parts: Vec<&str> = t.split(' ').collect();
        let digits = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
        let ym: Vec<&str> = parts.first().map(|p| p.split('-').collect()).unwrap_or_default();
        let hms: Vec<&str> = parts.get(2).map(|p| p.split(':').collect()).unwrap_or_default();
        if parts.len() == 3
            && ym.len() == 2
            && ym.iter().all(|p| digits(p))
            && digits(parts[1])
            && hms.len() == 3
            && hms.iter().all(|p| digits(p))
        {
            return Ok(t.to_string());
        }
        return Err("not an INTERVAL of the form Y-M D H:M:S (e.g. 0-0 0 0:15:0)".into());
    }
    let (mut secs, mut number, mut any) = (0_u64, String::new(), false);
    for c in t.chars() {
        if c.is_ascii_digit() {
            number.push(c);
            continue;
        }
        let unit = match c {
            'd' => 86_400,
            'h' => 3_600,
            'm' => 60,
            's' => 1,
            _ => return Err(format!("unit {c:?}: expected d, h, m or s (e.g. 15m, 1h30m)")),
        };
        let n: u64 = number.parse().map_err(|_| format!("no number before {c:?} (e.g. 15m, 1h30m)"))?;
        secs = n.checked_mul(unit).and_then(|v| secs.checked_add(v)).ok_or("too large")?;
        number.clear();
        any = true;
    }
    if !number.is_empty() || !any {
        return Err("a duration needs a unit after each number: d, h, m or s (e.g. 15m, 1h30m)".into());
    }
    let (d, rest) = (secs / 86_400, secs % 86_400);
    Ok(format!("0-0 {d} {}:{}:{}", rest / 3_600, rest % 3_600 / 60, rest % 60))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_staleness_becomes_an_interval() {
        assert_eq!(interval("15m").unwrap(), "0-0 0 0:15:0");
        assert_eq!(interval("1h30m").unwrap(), "0-0 0 1:30:0");
        assert_eq!(interval("2d").unwrap(), "0-0 2 0:0:0");
        assert_eq!(interval("0-0 0 0:10:0").unwrap(), "0-0 0 0:10:0");
        for bad in ["", "15", "15x", "m", "1 2", "0-0 0 0:10"] {
            assert!(interval(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_key_option_takes_names_lists_and_json() {
        assert_eq!(parse_key_option("id").unwrap(), vec!["id"]);
        assert_eq!(parse_key_option("id, day").unwrap(), vec!["id", "day"]);
        assert_eq!(parse_key_option(r#"["id","day"]"#).unwrap(), vec!["id", "day"]);
        assert!(parse_key_option("id,").is_err());
    }
}
