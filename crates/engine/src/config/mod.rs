//! The engine's configuration: [`EngineConfig`], the job's sections as the
//! engine, its source, its sandbox and its capabilities use them, and the
//! types of the job file's sections (`[job]`, `[sink]`, ...) with their doc
//! comments, from which the job-file reference is generated.
//!
//! Invariants:
//! - an [`EngineConfig`] is valid in full: whoever assembles it (the
//!   `sluice-job` crate, from a job file) has checked every key, made every
//!   path absolute and resolved the catalog, the endpoints and the stores,
//!   so the engine never checks a job key again;
//! - an error about a key still names it in full (`sink.catalog.warehouse`)
//!   and the file it came from ([`EngineConfig::invalid`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

/// The Kafka source's configuration (it lives with the source).
pub use crate::source::kafka::config as kafka;
pub mod schema;

use crate::location::{Location, Scheme, Served};
use sluice_store::StoreOptions;

/// What `job.state_dir` serves besides local paths.
pub const STATE_DIR_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
/// A job file that could not be used.
#[derive(Debug, Error)]
pub enum JobError {
    #[error("cannot read job file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("job file {path} is not valid TOML: {source}")]
    Syntax {
        path: PathBuf,
        #[source]
        source: toml::de::Error,
    },
    #[error("job file {path}: key `{key}`: {message}")]
    Invalid { path: PathBuf, key: String, message: String },
    #[error("--set {arg:?}: {message}")]
    Override { arg: String, message: String },
}

/// The whole job file.
#[derive(Debug, Clone, schemars::JsonSchema)]
pub struct JobSpec {
    /// What the job is called, how many subtasks it runs, where its state
    /// lives, when it checkpoints and how it retries commits.
    pub job: JobSection,
    pub source: SourceSpec,
    /// Where rows land: the sink plugin, its options, and what it may
    /// touch and call.
    pub sink: SinkSpec,
}

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Stable name of the job; names checkpoints and idempotence keys.
    pub id: String,
    /// Number of source readers and sink writers (1 to 1024).
    #[serde(default = "default_parallelism")]
    pub parallelism: u32,
    /// Where checkpoints live: a local directory (relative to the job
    /// file), `s3://bucket/prefix` or `gs://bucket/prefix`.
    /// Default: `.sluice/<id>` next to the job file.
    pub state_dir: Option<PathBuf>,
    /// How long a run's hold on an object-store state directory lasts
    /// unless renewed (the run renews it every third of this); a run killed
    /// without releasing it blocks the next one at most this long. In
    /// seconds (0.3 to 3600).
    #[serde(default = "default_lease_secs")]
    pub lease_secs: f64,
    /// How a state directory on S3 is reached.
    #[serde(default)]
    pub s3: S3Spec,
    /// How a state directory on Google Cloud Storage is reached.
    #[serde(default)]
    pub gcs: GcsSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    #[serde(default)]
    pub commit: CommitSpec,
    /// Where `sluice run` serves `/metrics` and `/healthz`, e.g.
    /// `"127.0.0.1:9464"` (`--metrics-addr` overrides); no server when absent.
    #[serde(default)]
    pub metrics_addr: Option<String>,
    #[serde(default)]
    pub health: HealthSpec,
    /// What a source record that does not convert to its table's types
    /// does: `"fail"` (the default) stops the job, naming it;
    /// `"dead-letter"` lands it in `[job.dead_letter]`'s table instead.
    #[serde(default)]
    pub bad_rows: crate::source::BadRows,
    #[serde(default)]
    pub dead_letter: Option<DeadLetterSpec>,
    /// With dead letters: the most bad rows the job takes, a count over
    /// the job (every run), such as `100`, or a fraction of the records
    /// read over the job (bad ones included), such as `0.01`, judged once
    /// the job has read 1000 records (and at the source's end). Past it
    /// the job stops before the checkpoint that went past is committed.
    /// Default: no limit.
    #[serde(default)]
    #[schemars(with = "Option<schema::CountOrFraction>")]
    pub max_bad_rows: Option<toml::Value>,
}

/// `[job.dead_letter]`: where rows that do not convert land, with
/// `job.bad_rows = "dead-letter"` (required then, refused otherwise).
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterSpec {
    /// The table, written by the job's sink beside the others (named as
    /// the sink names a source table of that name).
    pub table: String,
}

/// Dead letters, resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetters {
    pub table: String,
    pub max: Option<MaxBadRows>,
}

/// `job.max_bad_rows`, parsed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MaxBadRows {
    /// Bad rows over the whole job.
    Count(u64),
    /// Bad rows per record read over the job (bad ones included), judged
    /// once the job has read `engine::MIN_RECORDS_FOR_A_SHARE` records.
    Fraction(f64),
}

impl std::fmt::Display for MaxBadRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MaxBadRows::Count(n) => write!(f, "{n} over the job"),
            MaxBadRows::Fraction(x) => write!(f, "a share of {x} of the records read over the job"),
        }
    }
}

/// `[job.health]`: when `/healthz` calls the job unhealthy.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthSpec {
    /// The longest time without a commit that is healthy: a duration such
    /// as `"90s"`, `"500ms"`, `"5m"` or `"1h"`, or a number of seconds.
    /// Default: three checkpoint intervals (30 s when checkpoints are by
    /// rows only).
    #[serde(default)]
    #[schemars(with = "Option<schema::ShortDuration>")]
    pub max_commit_age: Option<toml::Value>,
}

/// `[job.checkpoint]`: a checkpoint ends after `every_rows` rows per
/// subtask or `interval_secs` seconds, whichever comes first; with
/// neither set, every 10 seconds.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// End a checkpoint after this many rows per subtask (deterministic; at least 1).
    pub every_rows: Option<u64>,
    /// End a checkpoint after this many seconds (a millisecond to a week).
    pub interval_secs: Option<f64>,
    /// How many checkpoint records to keep in the state directory (at least 1).
    #[serde(default = "default_retain")]
    pub retain: usize,
}

impl Default for CheckpointSpec {
    fn default() -> Self {
        Self { every_rows: None, interval_secs: None, retain: default_retain() }
    }
}

/// How the host retries a commit the plugin answers `retryable` (a conflict,
/// an unknown outcome, a transient failure). The host alone retries commits:
/// a plugin's `commit` makes one attempt and says whether another may follow.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CommitSpec {
    /// Attempts of one commit when the plugin answers `retryable`.
    #[serde(default = "default_commit_attempts")]
    pub max_attempts: u32,
    /// The wait before the first retry, in milliseconds; each later wait
    /// doubles, up to `max_backoff_ms`, plus a random jitter of up to the
    /// same again (at most an hour).
    #[serde(default = "default_initial_backoff_ms")]
    pub initial_backoff_ms: u64,
    /// The longest wait between two attempts, in milliseconds, before
    /// jitter (at most an hour).
    #[serde(default = "default_max_backoff_ms")]
    pub max_backoff_ms: u64,
}

impl Default for CommitSpec {
    fn default() -> Self {
        Self {
            max_attempts: default_commit_attempts(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
        }
    }
}

pub use crate::source::config::{FileFormat, SourceSpec};

#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SinkSpec {
    /// Name of the sink within the job.
    #[serde(default = "default_sink_id")]
    pub id: String,
    /// The plugin component (`.wasm`), a local file relative to the job file.
    pub plugin: PathBuf,
    /// The plugin's own options, handed to it as strings; which it takes
    /// is its own answer (see the plugins' tables below).
    #[serde(default)]
    #[schemars(with = "schema::PluginOptions")]
    pub options: toml::Table,
    /// What the plugin may read and write besides its catalog's warehouse.
    #[serde(default)]
    pub grants: Grants,
    /// The Iceberg catalog the plugin may use (`iceberg-catalog` capability).
    #[serde(default)]
    pub catalog: Option<CatalogSpec>,
    /// gRPC endpoints the plugin may call, by name (`grpc` capability):
    /// `[sink.grpc.bigquery] address = "https://bigquerystorage.googleapis.com"`.
    #[serde(default)]
    pub grpc: BTreeMap<String, EndpointSpec>,
    /// HTTP endpoints the plugin may call, by name (`wasi:http`; the plugin
    /// sends to `http://<name>/...`): `[sink.http.bigquery] address =
    /// "https://bigquery.googleapis.com"`.
    #[serde(default)]
    pub http: BTreeMap<String, EndpointSpec>,
    #[serde(default)]
    pub sandbox: SandboxSpec,
    /// How the sink's grants and warehouse on S3 are reached.
    #[serde(default)]
    pub s3: S3Spec,
    /// How the sink's grants and warehouse on Google Cloud Storage are reached.
    #[serde(default)]
    pub gcs: GcsSpec,
    /// Table maintenance the running job does beside its checkpoints.
    #[serde(default)]
    pub maintenance: Option<MaintenanceSpec>,
}

/// A running job compacts its sink tables every
/// `compact_every`, and, when asked, expires snapshots and removes orphan
/// files in the same pass (as `sluice maintain` does). Durations are
/// strings such as `"10m"`, `"1h"`, `"7days"`, or a number of seconds.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MaintenanceSpec {
    /// How often a maintenance pass starts.
    #[schemars(with = "schema::LongDuration")]
    pub compact_every: toml::Value,
    /// Compaction's target file size, in MB (1 to 4095).
    #[serde(default = "default_target_file_mb")]
    pub target_file_mb: u64,
    /// Expire snapshots older than this, but for the newest `keep_last`
    /// (with neither set, none expire).
    #[serde(default)]
    #[schemars(with = "Option<schema::LongDuration>")]
    pub expire_older_than: Option<toml::Value>,
    /// Keep at least the newest this many snapshots (at least 1); without
    /// `expire_older_than`, every older one expires.
    #[serde(default)]
    pub keep_last: Option<u32>,
    /// Remove files no snapshot or pending checkpoint names, older than
    /// this (at least an hour in a running job, whose writers are writing
    /// files no checkpoint names yet).
    #[serde(default)]
    #[schemars(with = "Option<schema::LongDuration>")]
    pub remove_orphans_older_than: Option<toml::Value>,
    /// The longest one pass may take. Default: 1h.
    #[serde(default)]
    #[schemars(with = "Option<schema::LongDuration>")]
    pub timeout: Option<toml::Value>,
    /// Other jobs writing the same tables (their job files, relative to
    /// this one): orphan cleanup spares their pending checkpoints' files too.
    /// They are loaded with this job, which is refused if one cannot be.
    #[serde(default)]
    pub protect: Vec<PathBuf>,
}

fn default_target_file_mb() -> u64 {
    128
}

/// `[sink.maintenance]`, resolved.
#[derive(Debug, Clone)]
pub struct ContinuousMaintenance {
    pub every: Duration,
    pub target_file_bytes: u64,
    pub expire_older_than: Option<Duration>,
    pub keep_last: Option<u32>,
    pub remove_orphans_older_than: Option<Duration>,
    pub timeout: Duration,
    /// The jobs whose pending checkpoints orphan cleanup spares, loaded
    /// from the job files `protect` names (their own `protect` lists are
    /// not loaded: only their state directories are read).
    pub protect: Vec<EngineConfig>,
}

/// The shortest orphan retention a running job may use: its writers'
/// files of the round under way are named by no checkpoint yet, and only
/// their age keeps them from being taken for orphans.
pub const MIN_RUNNING_ORPHAN_AGE: Duration = Duration::from_secs(3600);

/// A maintenance duration: a humantime string (`"90s"`, `"10m"`, `"7days"`)
/// or a number of seconds; positive.
pub fn parse_long_duration(value: &toml::Value) -> Result<Duration, String> {
    let d = match value {
        toml::Value::Integer(n) if *n > 0 => Duration::from_secs(*n as u64),
        toml::Value::Float(f) if f.is_finite() && *f > 0.0 => {
            Duration::try_from_secs_f64(*f).map_err(|_| format!("{f} seconds is too long a duration"))?
        }
        toml::Value::String(s) => humantime::parse_duration(s.trim())
            .map_err(|e| format!("{s:?} is not a duration such as \"10m\", \"1h\" or \"7days\" ({e})"))?,
        other => return Err(format!("{other} is not a positive duration such as \"10m\", \"1h\" or \"7days\"")),
    };
    if d.is_zero() {
        return Err(format!("{value} must be a positive duration"));
    }
    if d > Duration::from_secs(MAX_LONG_SECS) {
        return Err(format!("{value} is longer than 100 years"));
    }
    Ok(d)
}

pub use sluice_store::spec::{GcsSpec, S3Spec};

/// Which Iceberg catalog a sink gets (for a plugin that writes Iceberg
/// tables). Its warehouse is granted to the
/// plugin's `file-io` read-write, since the tables' files live there.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CatalogSpec {
    /// `sql`: iceberg-rust's `SqlCatalog` on a SQLite file (the embedded
    /// default; PyIceberg's `SqlCatalog` reads the same file). `rest`: an
    /// Iceberg REST catalog at `uri`.
    #[serde(default)]
    pub kind: CatalogKind,
    /// Catalog name, as readers must name it too (PyIceberg's `SqlCatalog(name, ...)`).
    #[serde(default = "default_catalog_name")]
    pub name: String,
    /// The SQLite database file (`kind = "sql"`).
    #[serde(default)]
    pub database: Option<PathBuf>,
    /// The REST catalog's base URI, e.g. `http://localhost:8181` (`kind = "rest"`).
    #[serde(default)]
    pub uri: Option<String>,
    /// Environment variable holding a bearer token for the REST catalog.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Environment variable holding the REST catalog's OAuth2 client
    /// credential, `client_id:secret` (or a bare secret), exchanged for
    /// tokens that the host refreshes.
    #[serde(default)]
    pub credential_env: Option<String>,
    /// File holding that credential (relative to the job file).
    #[serde(default)]
    pub credential_file: Option<PathBuf>,
    /// The OAuth2 token endpoint. Default: the REST spec's `<uri>/v1/oauth/tokens`.
    #[serde(default)]
    pub oauth2_server_uri: Option<String>,
    /// The scope asked for with the credential. Default: `catalog`.
    #[serde(default)]
    pub scope: Option<String>,
    /// Where new tables are placed (for `rest`: the warehouse asked of the
    /// catalog); granted to the plugin read-write. A local directory
    /// (relative to the job file); for `sql` also `s3://bucket/prefix` or
    /// `gs://bucket/prefix`.
    pub warehouse: PathBuf,
}

/// The kind of an Iceberg catalog.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CatalogKind {
    /// iceberg-rust's `SqlCatalog` on a SQLite file (`database`).
    #[default]
    Sql,
    /// An Iceberg REST catalog at `uri`.
    Rest,
}

fn default_catalog_name() -> String {
    "sluice".to_string()
}

/// One endpoint (gRPC or HTTP) a plugin may call by name. Its credentials
/// stay in the host: the plugin never sees them.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// `http://host:port` (plaintext) or `https://host[:port]` (TLS, system roots).
    pub address: String,
    /// Environment variable holding a bearer token (sent as `authorization: Bearer ...`).
    #[serde(default)]
    pub token_env: Option<String>,
    /// File holding a bearer token (relative to the job file).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Credentials the host obtains and refreshes itself: `"google"` is
    /// Google's Application Default Credentials. Excludes `token_env` and
    /// `token_file`.
    #[serde(default)]
    pub auth: Option<EndpointAuth>,
    /// How long to wait for a connection, in milliseconds (at most an hour).
    #[serde(default = "default_connect_timeout_ms")]
    pub connect_timeout_ms: u64,
}

/// `auth` of an endpoint: credentials that refresh, held by the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EndpointAuth {
    /// Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`,
    /// gcloud's ADC file, the metadata server).
    Google,
}

fn default_connect_timeout_ms() -> u64 {
    5_000
}

/// What the plugin may touch. Nothing else is reachable.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Grants {
    /// Locations the plugin may read and write (directories, `s3://bucket/prefix`, `gs://bucket/prefix`).
    #[serde(default)]
    pub locations: Vec<String>,
    /// Locations the plugin may only read.
    #[serde(default)]
    pub read_locations: Vec<String>,
}

pub use crate::plugin::config::{CALL_TIMEOUT_SECS, MAX_MEMORY_MB, SandboxSpec};

fn default_parallelism() -> u32 {
    1
}
fn default_lease_secs() -> f64 {
    30.0
}

fn default_retain() -> usize {
    3
}
fn default_commit_attempts() -> u32 {
    20
}
fn default_initial_backoff_ms() -> u64 {
    100
}
fn default_max_backoff_ms() -> u64 {
    5_000
}
fn default_sink_id() -> String {
    "sink".to_string()
}

/// Default checkpoint interval when the job sets no trigger.
pub const DEFAULT_INTERVAL_SECS: f64 = 10.0;

/// The range of `job.checkpoint.interval_secs`: a millisecond to a week.
/// A round reads at least one batch however short its interval is (see
/// `engine::subtask`), so a short interval costs checkpoints, never rows.
pub const INTERVAL_SECS: (f64, f64) = (0.001, WEEK_SECS);
/// The range of `job.lease_secs`.
pub const LEASE_SECS: (f64, f64) = (0.3, 3600.0);
/// The range of `source.rate`, rows per second over all subtasks: one row
/// in 1000 s to 10^12 rows a second. A rate-limited subtask wakes to a
/// stop request within `engine::subtask::STOP_POLL` whatever the rate.
pub const RATE: (f64, f64) = (0.001, 1e12);
/// The most rows of one batch (`source.batch_rows`).
pub const MAX_BATCH_ROWS: usize = 10_000_000;
/// The longest wait the job file takes in milliseconds (commit backoffs,
/// connection timeouts): an hour.
pub const MAX_WAIT_MS: u64 = 3_600_000;
/// The longest maintenance duration (`[sink.maintenance]`): 100 years.
pub const MAX_LONG_SECS: u64 = 100 * 365 * 86_400;
/// The largest generator id: ids are stored as Int64.
pub const MAX_GENERATOR_ID: u64 = i64::MAX as u64;
const WEEK_SECS: f64 = 7.0 * 86_400.0;

pub use sluice_core::duration::{seconds, seconds_within, show};

pub use crate::capability::config::{
    CatalogConfig, DEFAULT_OAUTH2_SCOPE, EndpointConfig, OAuth2Config, RestAuth, Secret,
};

/// A job's configuration, valid in full.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub spec: JobSpec,
    /// The job file, named in messages.
    pub path: PathBuf,
    /// Its directory: the base of every relative path and location.
    pub base_dir: PathBuf,
    /// The state directory as shown in messages: the absolute local path,
    /// or the store URL (`s3://bucket/prefix`) of an object-store one.
    pub state_dir: PathBuf,
    /// Where the state directory is: what the checkpoint store opens.
    pub state: Location,
    /// How the state directory's store is reached (`[job.s3]`, `[job.gcs]`).
    pub state_stores: StoreOptions,
    /// How the file source's input store is reached (`[source.s3]`,
    /// `[source.gcs]`; the environment's for a generator).
    pub source_stores: StoreOptions,
    /// How the sink's grants' stores are reached (`[sink.s3]`, `[sink.gcs]`).
    pub sink_stores: StoreOptions,
    /// The sink's catalog, if the job configures one.
    pub catalog: Option<CatalogConfig>,
    /// The gRPC endpoints the plugin may call, by name.
    pub endpoints: BTreeMap<String, EndpointConfig>,
    /// The HTTP endpoints the plugin may call, by name.
    pub http_endpoints: BTreeMap<String, EndpointConfig>,
    /// A Kafka source, resolved (secrets read, schema decided).
    pub kafka: Option<kafka::KafkaConfig>,
    /// `job.metrics_addr`, parsed.
    pub metrics_addr: Option<SocketAddr>,
    /// `job.health.max_commit_age`, or its default.
    pub max_commit_age: Duration,
    /// `[sink.maintenance]`, resolved.
    pub maintenance: Option<ContinuousMaintenance>,
    /// `job.bad_rows = "dead-letter"` with its table and limit.
    pub dead_letters: Option<DeadLetters>,
}

impl EngineConfig {
    /// An error about `key` of the job file.
    pub fn invalid(&self, key: &str, message: impl Into<String>) -> JobError {
        JobError::Invalid { path: self.path.clone(), key: key.to_string(), message: message.into() }
    }

    /// Resolves a path of the job file against its directory.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        normalize(&self.base_dir.join(p))
    }

    /// The source as a run opens it, for `source::Source::of_config`.
    pub fn source_config(&self) -> crate::source::SourceConfig {
        crate::source::SourceConfig {
            spec: self.spec.source.clone(),
            parallelism: self.spec.job.parallelism,
            stores: self.source_stores.clone(),
            kafka: self.kafka.clone(),
            dead_letter_table: self.dead_letters.as_ref().map(|d| d.table.clone()),
            target: crate::source::TargetTables {
                catalog: self.catalog.clone(),
                stores: self.sink_stores.clone(),
                table_pattern: self.sink_options().into_iter().find_map(|(k, v)| (k == "table").then_some(v)),
            },
        }
    }

    /// What the job grants its plugin, for `capability::Granted::open`.
    pub fn grants(&self) -> crate::capability::config::GrantsConfig {
        crate::capability::config::GrantsConfig {
            base_dir: self.base_dir.clone(),
            locations: self.spec.sink.grants.locations.clone(),
            read_locations: self.spec.sink.grants.read_locations.clone(),
            catalog: self.catalog.clone(),
            stores: self.sink_stores.clone(),
            endpoints: self.endpoints.clone(),
            http_endpoints: self.http_endpoints.clone(),
        }
    }

    /// Whether the source runs until stopped (a Kafka source that is not `bounded`).
    pub fn unbounded(&self) -> bool {
        self.kafka.as_ref().is_some_and(|k| !k.bounded)
    }

    /// The sink options as the plugin receives them: strings, sorted by key.
    pub fn sink_options(&self) -> Vec<(String, String)> {
        self.spec
            .sink
            .options
            .iter()
            .map(|(k, v)| {
                let rendered = match v {
                    toml::Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), self.topic_pattern(rendered))
            })
            .collect()
    }

    /// `{topic}` in a sink option, for a Kafka source: the topic of a source
    /// of one topic (its one table), else `{table}` (each topic is a table).
    fn topic_pattern(&self, value: String) -> String {
        match &self.kafka {
            Some(k) if value.contains("{topic}") => match k.single_topic() {
                Some(topic) => value.replace("{topic}", topic),
                None => value.replace("{topic}", "{table}"),
            },
            _ => value,
        }
    }

    /// How a checkpoint round ends: after `every_rows` rows per subtask, after
    /// `interval`, or the default interval when neither is set.
    pub fn checkpoint_trigger(&self) -> (Option<u64>, Option<Duration>) {
        let ck = &self.spec.job.checkpoint;
        let interval = match (ck.every_rows, ck.interval_secs) {
            (None, None) => Some(DEFAULT_INTERVAL_SECS),
            (_, s) => s,
        };
        (ck.every_rows, interval.map(|s| seconds_within(s, INTERVAL_SECS)))
    }
}

/// A duration of the job file: `"90s"`, `"1.5s"`, `"500ms"`, `"5m"`,
/// `"1h"`, or a number of seconds; positive and at most a week.
pub fn parse_duration(value: &toml::Value) -> Result<Duration, String> {
    let secs = match value {
        toml::Value::Integer(n) => *n as f64,
        toml::Value::Float(f) => *f,
        toml::Value::String(s) => {
            let t = s.trim();
            let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
            let (number, unit) = t.split_at(split);
            let n: f64 = number.parse().map_err(|_| format!("{s:?} is not a duration such as \"90s\" or \"5m\""))?;
            let scale = match unit.trim() {
                "ms" => 0.001,
                "s" | "" => 1.0,
                "m" | "min" => 60.0,
                "h" => 3600.0,
                other => return Err(format!("{s:?}: unknown unit {other:?} (ms, s, m or h)")),
            };
            n * scale
        }
        other => return Err(format!("{other} is not a duration such as \"90s\" or \"5m\"")),
    };
    if !(secs.is_finite() && secs > 0.0 && secs <= WEEK_SECS) {
        return Err(format!("{value} must be a positive duration of at most a week"));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{value}: {e}"))
}

impl EngineConfig {
    /// Whether the source's `table` lands where the dead letters do: the
    /// same name, or the same table once the sink's `table` pattern maps
    /// both (`t1` and `db.t1` beside `db.{table}`).
    pub fn lands_with_dead_letters(&self, table: &str) -> bool {
        self.dead_letters.as_ref().is_some_and(|dl| self.land_together(table, &dl.table))
    }

    /// Whether source tables `a` and `b` land in the same sink table.
    pub fn land_together(&self, a: &str, b: &str) -> bool {
        if a == b {
            return true;
        }
        let Some((_, pattern)) = self.sink_options().into_iter().find(|(k, _)| k == "table") else { return false };
        if !pattern.contains("{table}") {
            return false;
        }
        let lands = |t: &str| if in_pattern_form(&pattern, t) { t.to_string() } else { pattern.replace("{table}", t) };
        lands(a) == lands(b)
    }
}

pub use sluice_core::naming::in_pattern_form;

/// Makes a path absolute against the current directory, lexically.
pub fn absolute(p: &Path) -> Result<PathBuf, String> {
    let p = if p.as_os_str().is_empty() { Path::new(".") } else { p };
    std::path::absolute(p).map(|a| normalize(&a)).map_err(|e| format!("cannot make {} absolute: {e}", p.display()))
}

/// Removes `.` and resolves `..` lexically (no filesystem access).
pub use sluice_core::location::normalize;
