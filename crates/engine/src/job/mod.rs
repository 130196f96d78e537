//! The job file: TOML, overridden by `--set key=value`, with `${VAR}` and
//! `${VAR:-default}` taken from the environment, then validated.
//!
//! Invariants:
//! - every error names the offending key (`job.parallelism`, `sink.plugin`, ...)
//!   and the file;
//! - relative paths are resolved against the job file's directory, so a job
//!   behaves the same from any working directory;
//! - every location (state dir, warehouse, catalog database, source path,
//!   grants, plugin and token files) is parsed by [`crate::location`]: a URL
//!   whose scheme the key does not serve is refused here, naming the key,
//!   before anything is written, and is never taken for a relative path;
//! - after [`Job::load`] the job is valid in full: every path is absolute,
//!   every value in range, the catalog and the endpoints are resolved (their
//!   tokens read), so the engine never checks a job key again.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use thiserror::Error;

/// The Kafka source's configuration (it lives with the source).
pub use crate::source::kafka::config as kafka;
pub mod reference;

use crate::location::{Location, Scheme, Served};
use sluice_store::StoreOptions;

/// What `job.state_dir` serves besides local paths.
pub const STATE_DIR_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
/// What `sink.catalog.warehouse` serves besides local paths: the host's
/// catalog writes the table metadata there through `sluice-store`
/// (`capability/catalog_storage.rs`), the plugin its data and manifest files
/// through `file-io`, as exclusive streaming uploads (on GCS a claimed key
/// and a resumable upload, see `sluice-store`'s `gcs.rs`).
const SQL_WAREHOUSE_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
/// The file source reads objects through `sluice-store` (`source::object`).
const SOURCE_PATH_SERVED: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };

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

/// The job file as read: `[source]` is deserialized on its own
/// ([`source_spec`]), so that an error inside it names its full key.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawJobSpec {
    job: JobSection,
    source: toml::Value,
    sink: SinkSpec,
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
    #[schemars(with = "Option<reference::CountOrFraction>")]
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
    #[schemars(with = "Option<reference::ShortDuration>")]
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
    #[schemars(with = "reference::PluginOptions")]
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
    #[schemars(with = "reference::LongDuration")]
    pub compact_every: toml::Value,
    /// Compaction's target file size, in MB (1 to 4095).
    #[serde(default = "default_target_file_mb")]
    pub target_file_mb: u64,
    /// Expire snapshots older than this, but for the newest `keep_last`
    /// (with neither set, none expire).
    #[serde(default)]
    #[schemars(with = "Option<reference::LongDuration>")]
    pub expire_older_than: Option<toml::Value>,
    /// Keep at least the newest this many snapshots (at least 1); without
    /// `expire_older_than`, every older one expires.
    #[serde(default)]
    pub keep_last: Option<u32>,
    /// Remove files no snapshot or pending checkpoint names, older than
    /// this (at least an hour in a running job, whose writers are writing
    /// files no checkpoint names yet).
    #[serde(default)]
    #[schemars(with = "Option<reference::LongDuration>")]
    pub remove_orphans_older_than: Option<toml::Value>,
    /// The longest one pass may take. Default: 1h.
    #[serde(default)]
    #[schemars(with = "Option<reference::LongDuration>")]
    pub timeout: Option<toml::Value>,
    /// Other jobs writing the same tables (their job files, relative to
    /// this one): orphan cleanup spares their pending checkpoints' files too.
    #[serde(default)]
    pub protect: Vec<PathBuf>,
}

fn default_target_file_mb() -> u64 {
    128
}

/// `[sink.maintenance]`, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContinuousMaintenance {
    pub every: Duration,
    pub target_file_bytes: u64,
    pub expire_older_than: Option<Duration>,
    pub keep_last: Option<u32>,
    pub remove_orphans_older_than: Option<Duration>,
    pub timeout: Duration,
    /// Job files whose pending checkpoints orphan cleanup spares (resolved).
    pub protect: Vec<PathBuf>,
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

/// A loaded job, valid in full.
#[derive(Debug, Clone)]
pub struct Job {
    pub spec: JobSpec,
    /// The job file.
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

impl Job {
    /// Reads, overrides, interpolates, parses and validates a job file.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self, JobError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| JobError::Read { path: path.to_path_buf(), source })?;
        Self::from_str(&text, path, overrides)
    }

    /// Like [`Job::load`] for a file's text (`path` names it and anchors paths).
    pub fn from_str(text: &str, path: &Path, overrides: &[String]) -> Result<Self, JobError> {
        let mut table: toml::Table =
            text.parse().map_err(|source| JobError::Syntax { path: path.to_path_buf(), source })?;
        for arg in overrides {
            apply_override(&mut table, arg)?;
        }
        interpolate_env(&mut table, "", path)?;
        let raw: RawJobSpec = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let key = e.path().to_string();
            JobError::Invalid {
                path: path.to_path_buf(),
                key: if key == "." { "(top level)".to_string() } else { key },
                message: hint_integer(e.into_inner().to_string()),
            }
        })?;
        let source = source_spec(raw.source).map_err(|(key, message)| JobError::Invalid {
            path: path.to_path_buf(),
            key,
            message,
        })?;
        let spec = JobSpec { job: raw.job, source, sink: raw.sink };
        let base_dir = absolute(path.parent().unwrap_or(Path::new("."))).map_err(|e| JobError::Invalid {
            path: path.to_path_buf(),
            key: "(job file)".into(),
            message: e,
        })?;
        let mut job = Job {
            state_dir: PathBuf::new(),
            state: Location::Local(PathBuf::new()),
            state_stores: StoreOptions::default(),
            source_stores: StoreOptions::default(),
            sink_stores: StoreOptions::default(),
            spec,
            path: path.to_path_buf(),
            base_dir,
            catalog: None,
            endpoints: BTreeMap::new(),
            http_endpoints: BTreeMap::new(),
            kafka: None,
            metrics_addr: None,
            max_commit_age: Duration::ZERO,
            maintenance: None,
            dead_letters: None,
        };
        job.validate()?;
        Ok(job)
    }

    pub(crate) fn invalid(&self, key: &str, message: impl Into<String>) -> JobError {
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

    /// Checks the job in named steps, each resolving what it checks.
    fn validate(&mut self) -> Result<(), JobError> {
        self.check_job_section()?;
        self.check_metrics()?;
        self.check_source()?;
        self.check_dead_letters()?;
        self.check_plugin()?;
        self.check_sandbox()?;
        self.check_maintenance()?;
        self.check_sink_options()?;
        self.check_grants()?;
        self.resolve_state_dir()?;
        self.state_stores = self.store_options("job", &self.spec.job.s3, &self.spec.job.gcs)?;
        // A generator reads no store: `[source.s3]` there is an unknown key.
        self.source_stores = match &self.spec.source {
            SourceSpec::File { s3, gcs, .. } => self.store_options("source", s3, gcs)?,
            SourceSpec::Generator { .. } | SourceSpec::Kafka(_) => StoreOptions::default(),
        };
        self.sink_stores = self.store_options("sink", &self.spec.sink.s3, &self.spec.sink.gcs)?;
        self.catalog = self.spec.sink.catalog.as_ref().map(|c| self.catalog_config(c)).transpose()?;
        self.resolve_endpoints()
    }

    /// `[job]`: the ids, the parallelism, the checkpoint trigger and the commit retries.
    fn check_job_section(&self) -> Result<(), JobError> {
        check_id(&self.spec.job.id).map_err(|m| self.invalid("job.id", m))?;
        check_id(&self.spec.sink.id).map_err(|m| self.invalid("sink.id", m))?;
        if self.spec.job.parallelism == 0 || self.spec.job.parallelism > 1024 {
            return Err(self.invalid("job.parallelism", "must be between 1 and 1024"));
        }
        let ck = &self.spec.job.checkpoint;
        if ck.every_rows == Some(0) {
            return Err(self.invalid("job.checkpoint.every_rows", "must be at least 1"));
        }
        if let Some(s) = ck.interval_secs {
            seconds(s, INTERVAL_SECS).map_err(|m| self.invalid("job.checkpoint.interval_secs", m))?;
        }
        if ck.retain == 0 {
            return Err(self.invalid("job.checkpoint.retain", "must be at least 1"));
        }
        seconds(self.spec.job.lease_secs, LEASE_SECS).map_err(|m| self.invalid("job.lease_secs", m))?;
        let commit = &self.spec.job.commit;
        if commit.max_attempts == 0 {
            return Err(self.invalid("job.commit.max_attempts", "must be at least 1"));
        }
        for (key, ms) in [
            ("job.commit.initial_backoff_ms", commit.initial_backoff_ms),
            ("job.commit.max_backoff_ms", commit.max_backoff_ms),
        ] {
            if ms > MAX_WAIT_MS {
                return Err(self.invalid(key, format!("must be at most {MAX_WAIT_MS} (an hour), got {ms}")));
            }
        }
        Ok(())
    }

    /// `job.bad_rows`, `[job.dead_letter]` and `job.max_bad_rows`: dead
    /// letters are refused where no record can turn into one (Parquet
    /// files, whose values carry their types), so that nobody counts on
    /// them there.
    fn check_dead_letters(&mut self) -> Result<(), JobError> {
        use crate::source::BadRows;
        let job = &self.spec.job;
        match (job.bad_rows, &job.dead_letter) {
            (BadRows::Fail, None) => {
                if job.max_bad_rows.is_some() {
                    return Err(self.invalid(
                        "job.max_bad_rows",
                        "limits dead letters; with job.bad_rows = \"fail\" (the default) the first bad row stops the job",
                    ));
                }
                return Ok(());
            }
            (BadRows::Fail, Some(_)) => {
                return Err(self.invalid(
                    "job.dead_letter",
                    "is used only with job.bad_rows = \"dead-letter\"; set that too, or remove [job.dead_letter]",
                ));
            }
            (BadRows::DeadLetter, None) => {
                return Err(self.invalid(
                    "job.bad_rows",
                    "\"dead-letter\" needs a table: add [job.dead_letter] with table = \"...\"",
                ));
            }
            (BadRows::DeadLetter, Some(_)) => {}
        }
        let table = job.dead_letter.as_ref().map(|d| d.table.clone()).unwrap_or_default();
        if table.trim().is_empty() || table.trim() != table {
            return Err(self.invalid("job.dead_letter.table", format!("{table:?} is not a table name")));
        }
        // A dotted name is a table named in full (`namespace.table`), which
        // the sink lands as it is. Beside a sink `table` pattern it must be
        // in the pattern's form (`lake.dead_letters` beside `lake.{table}`),
        // or the sink would nest it in the pattern (`lake.other.dl`) while
        // every message names it as written.
        if table.contains('.')
            && let Some((_, pattern)) = self.sink_options().into_iter().find(|(k, _)| k == "table")
            && let Some((before, after)) = pattern.split_once("{table}")
            && !in_pattern_form(&pattern, &table)
        {
            return Err(self.invalid(
                "job.dead_letter.table",
                format!(
                    "{table:?} is a table named in full (namespace.table), but the sink's table pattern \
                     sink.options.table = {pattern:?} would land it in {:?}; name it {:?} to land it as \
                     written, or give a plain name such as \"dead_letters\" (which lands in {:?})",
                    pattern.replace("{table}", &table),
                    format!("{before}<name>{after}"),
                    pattern.replace("{table}", "dead_letters"),
                ),
            ));
        }
        match &self.spec.source {
            SourceSpec::File { format, path, .. } => {
                let format = format.or_else(|| FileFormat::from_path(path));
                if format == Some(FileFormat::Parquet) {
                    return Err(self.invalid(
                        "job.bad_rows",
                        "Parquet values carry their types, so no Parquet record turns into a dead letter; use \"fail\"",
                    ));
                }
            }
            SourceSpec::Generator { tables, .. } => {
                if tables.iter().any(|t| self.land_together(t, &table)) {
                    return Err(self.invalid(
                        "job.dead_letter.table",
                        format!("{table:?} is a table of the source; give dead letters a table of their own"),
                    ));
                }
            }
            // A topic pattern is matched against the table when the source opens.
            SourceSpec::Kafka(spec) => {
                if spec.topics.contains(&table) {
                    return Err(self.invalid(
                        "job.dead_letter.table",
                        format!("{table:?} is a topic the source reads; give dead letters a table of their own"),
                    ));
                }
            }
        }
        let max = match &job.max_bad_rows {
            None => None,
            Some(toml::Value::Integer(n)) if *n >= 0 => Some(MaxBadRows::Count(*n as u64)),
            Some(toml::Value::Float(x)) if x.is_finite() && *x > 0.0 && *x < 1.0 => Some(MaxBadRows::Fraction(*x)),
            Some(other) => {
                return Err(self.invalid(
                    "job.max_bad_rows",
                    format!(
                        "{other} is neither a count of rows (an integer, 0 or more) nor a fraction of a checkpoint's rows (between 0 and 1, such as 0.01)"
                    ),
                ));
            }
        };
        self.dead_letters = Some(DeadLetters { table, max });
        Ok(())
    }

    /// `job.metrics_addr` and `job.health.max_commit_age`.
    fn check_metrics(&mut self) -> Result<(), JobError> {
        const ADDR: &str = "job.metrics_addr";
        if let Some(text) = &self.spec.job.metrics_addr {
            let addr = text.trim().parse::<SocketAddr>().map_err(|_| {
                self.invalid(ADDR, format!("{text:?} is not an address to listen on, such as \"127.0.0.1:9464\""))
            })?;
            self.metrics_addr = Some(addr);
        }
        const AGE: &str = "job.health.max_commit_age";
        self.max_commit_age = match &self.spec.job.health.max_commit_age {
            Some(value) => parse_duration(value).map_err(|m| self.invalid(AGE, m))?,
            None => match self.checkpoint_trigger().1 {
                Some(interval) => interval.saturating_mul(3),
                None => seconds_within(DEFAULT_INTERVAL_SECS * 3.0, INTERVAL_SECS),
            },
        };
        Ok(())
    }

    /// `[source]`; a file source's path becomes absolute.
    fn check_source(&mut self) -> Result<(), JobError> {
        match &self.spec.source {
            SourceSpec::Generator { rows, first_id, rate, batch_rows, tables, new_table_at, .. } => {
                // Ids are stored as Int64: the last one must fit.
                let last = first_id.checked_add(rows.saturating_sub(1)).filter(|&id| id <= MAX_GENERATOR_ID);
                if last.is_none() && *rows > 0 {
                    let key = if *first_id > MAX_GENERATOR_ID { "source.first_id" } else { "source.rows" };
                    return Err(self.invalid(
                        key,
                        format!(
                            "source.first_id = {first_id} with source.rows = {rows} gives ids past \
                             {MAX_GENERATOR_ID} (i64::MAX), the largest id the Int64 `id` column holds"
                        ),
                    ));
                }
                let mut names = std::collections::BTreeSet::new();
                for t in tables {
                    if t.is_empty() || !names.insert(t.as_str()) {
                        return Err(
                            self.invalid("source.tables", format!("{t:?}: table names must be unique and not empty"))
                        );
                    }
                }
                if new_table_at.is_some() && tables.len() < 2 {
                    return Err(
                        self.invalid("source.new_table_at", "needs at least two `tables` (the last one appears late)")
                    );
                }
                self.check_rate_and_batch(*rate, *batch_rows)
            }
            SourceSpec::File { path, batch_rows, format, rate, .. } => {
                self.check_rate_and_batch(*rate, *batch_rows)?;
                let text = path
                    .to_str()
                    .ok_or_else(|| self.invalid("source.path", format!("{} is not UTF-8", path.display())))?;
                // An object store is listed when the source opens (`sluice
                // check` opens it too); here only the URL is judged.
                let resolved = match self.location("source.path", text, SOURCE_PATH_SERVED)? {
                    Location::Local(resolved) => resolved,
                    store => {
                        if let SourceSpec::File { path, .. } = &mut self.spec.source {
                            *path = PathBuf::from(store.to_string());
                        }
                        return Ok(());
                    }
                };
                if !resolved.exists() {
                    return Err(self.invalid("source.path", format!("{} does not exist", resolved.display())));
                }
                if resolved.is_file() && format.is_none() && FileFormat::from_path(&resolved).is_none() {
                    return Err(self.invalid(
                        "source.format",
                        format!(
                            "cannot tell the format of {} from its extension; set csv, json or parquet",
                            resolved.display()
                        ),
                    ));
                }
                if let SourceSpec::File { path, .. } = &mut self.spec.source {
                    *path = resolved;
                }
                Ok(())
            }
            SourceSpec::Kafka(spec) => {
                let spec = spec.clone();
                self.kafka = Some(spec.resolve(self)?);
                Ok(())
            }
        }
    }

    fn check_rate_and_batch(&self, rate: Option<f64>, batch_rows: usize) -> Result<(), JobError> {
        let (min, max) = RATE;
        if let Some(r) = rate
            && !(r.is_finite() && min <= r && r <= max)
        {
            return Err(self.invalid(
                "source.rate",
                format!("must be between {} and {} rows per second, got {}", show(min), show(max), show(r)),
            ));
        }
        if batch_rows == 0 || batch_rows > MAX_BATCH_ROWS {
            return Err(
                self.invalid("source.batch_rows", format!("must be between 1 and {MAX_BATCH_ROWS}, got {batch_rows}"))
            );
        }
        Ok(())
    }

    /// Whether the source runs until stopped (a Kafka source that is not `bounded`).
    pub fn unbounded(&self) -> bool {
        self.kafka.as_ref().is_some_and(|k| !k.bounded)
    }

    /// `sink.plugin` must be a file; it becomes absolute.
    fn check_plugin(&mut self) -> Result<(), JobError> {
        let plugin = self.local_path("sink.plugin", &self.spec.sink.plugin)?;
        if !plugin.is_file() {
            return Err(self.invalid(
                "sink.plugin",
                format!("no plugin file at {} (build the plugins with `cargo build-plugins`)", plugin.display()),
            ));
        }
        self.spec.sink.plugin = plugin;
        Ok(())
    }

    /// `[sink.sandbox]`: every limit in range.
    fn check_sandbox(&self) -> Result<(), JobError> {
        let sb = &self.spec.sink.sandbox;
        seconds(sb.call_timeout_secs, CALL_TIMEOUT_SECS)
            .map_err(|m| self.invalid("sink.sandbox.call_timeout_secs", m))?;
        if sb.memory_mb < 16 {
            return Err(self.invalid("sink.sandbox.memory_mb", "must be at least 16"));
        }
        if sb.memory_mb > MAX_MEMORY_MB {
            return Err(self.invalid(
                "sink.sandbox.memory_mb",
                format!(
                    "{} is more than a plugin instance can use: a 32-bit WebAssembly instance addresses at most \
                     {MAX_MEMORY_MB} MB; set at most {MAX_MEMORY_MB}",
                    sb.memory_mb
                ),
            ));
        }
        if sb.host_memory_mb < 16 {
            return Err(self.invalid("sink.sandbox.host_memory_mb", "must be at least 16"));
        }
        for (key, value) in [
            ("sink.sandbox.log_bytes_per_call", sb.log_bytes_per_call),
            ("sink.sandbox.log_bytes_per_sec", sb.log_bytes_per_sec),
            ("sink.sandbox.max_open_files", u64::from(sb.max_open_files)),
            ("sink.sandbox.max_grpc_streams", u64::from(sb.max_grpc_streams)),
            ("sink.sandbox.max_http_requests", u64::from(sb.max_http_requests)),
        ] {
            if value == 0 {
                return Err(self.invalid(key, "must be at least 1"));
            }
        }
        Ok(())
    }

    /// `[sink.maintenance]`: every duration parses, and orphan cleanup
    /// beside running writers keeps at least [`MIN_RUNNING_ORPHAN_AGE`].
    fn check_maintenance(&mut self) -> Result<(), JobError> {
        let Some(spec) = &self.spec.sink.maintenance else { return Ok(()) };
        let key = |k: &str| format!("sink.maintenance.{k}");
        let duration = |k: &str, v: &toml::Value| parse_long_duration(v).map_err(|m| self.invalid(&key(k), m));
        let every = duration("compact_every", &spec.compact_every)?;
        // The plugin is 32-bit: its rolling writer counts bytes in a `usize`.
        if spec.target_file_mb == 0 || spec.target_file_mb > 4095 {
            return Err(self.invalid(&key("target_file_mb"), "must be between 1 and 4095"));
        }
        let expire_older_than =
            spec.expire_older_than.as_ref().map(|v| duration("expire_older_than", v)).transpose()?;
        if spec.keep_last == Some(0) {
            return Err(self.invalid(&key("keep_last"), "must be at least 1 (the current snapshot is always kept)"));
        }
        let orphans =
            spec.remove_orphans_older_than.as_ref().map(|v| duration("remove_orphans_older_than", v)).transpose()?;
        let timeout = spec.timeout.as_ref().map(|v| duration("timeout", v)).transpose()?;
        if let Some(age) = orphans {
            // Unnamed files live as long as a checkpoint round (its files
            // are named once it is persisted) or a compaction pass (until
            // its replace commits): the retention must outlast both.
            let (_, interval) = self.checkpoint_trigger();
            let Some(interval) = interval else {
                return Err(self.invalid(
                    &key("remove_orphans_older_than"),
                    "needs job.checkpoint.interval_secs: with rows alone a checkpoint round may last any time, \
                     and the files of the round under way are named by no checkpoint yet, so only their age \
                     protects them",
                ));
            };
            let pass = timeout.unwrap_or(Duration::from_secs(3600));
            let least = MIN_RUNNING_ORPHAN_AGE.max(interval.saturating_mul(3)).max(pass);
            if age < least {
                return Err(self.invalid(
                    &key("remove_orphans_older_than"),
                    format!(
                        "{} is too short beside running writers: the files of the round under way, and of a \
                         compaction not yet committed, are named by no checkpoint or snapshot yet, so only their \
                         age protects them; use at least {} (1h, 3 checkpoint intervals and the maintenance \
                         timeout), or `sluice maintain --remove-orphans-older-than` while no job writes",
                        humantime::format_duration(age),
                        humantime::format_duration(least)
                    ),
                ));
            }
        }
        self.maintenance = Some(ContinuousMaintenance {
            every,
            target_file_bytes: spec.target_file_mb * 1024 * 1024,
            expire_older_than,
            keep_last: spec.keep_last,
            remove_orphans_older_than: orphans,
            timeout: timeout.unwrap_or(Duration::from_secs(3600)),
            protect: spec.protect.iter().map(|p| self.resolve(p)).collect(),
        });
        Ok(())
    }

    /// `[sink.options]`: plain values only (the plugin receives strings).
    fn check_sink_options(&self) -> Result<(), JobError> {
        for (key, value) in &self.spec.sink.options {
            if matches!(value, toml::Value::Table(_)) {
                return Err(self.invalid(&format!("sink.options.{key}"), "must be a plain value, not a table"));
            }
        }
        Ok(())
    }

    /// `[sink.grants]`: every location parses and is served (local paths,
    /// `s3://` and `gs://`); the file-io capability resolves them again as
    /// it sets them up.
    fn check_grants(&self) -> Result<(), JobError> {
        const GRANTS: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };
        let g = &self.spec.sink.grants;
        for (list, name) in [(&g.locations, "locations"), (&g.read_locations, "read_locations")] {
            for (i, location) in list.iter().enumerate() {
                self.location(&format!("sink.grants.{name}[{i}]"), location, GRANTS)?;
            }
        }
        Ok(())
    }

    /// `[<part>.s3]` and `[<part>.gcs]`, their keys read from the environment.
    fn store_options(&self, part: &str, s3: &S3Spec, gcs: &GcsSpec) -> Result<StoreOptions, JobError> {
        let endpoint = |key: &str, value: &Option<String>| -> Result<Option<String>, JobError> {
            let Some(v) = value else { return Ok(None) };
            let rest = v.strip_prefix("https://").or_else(|| v.strip_prefix("http://"));
            match rest {
                Some(host) if !host.is_empty() && !host.starts_with('/') && v.trim() == v => Ok(Some(v.clone())),
                _ => Err(self.invalid(key, format!("{v:?} is not an http:// or https:// URL"))),
            }
        };
        let secret = |key: &str, var: &str| -> Result<String, JobError> {
            match std::env::var(var) {
                Ok(v) if !v.trim().is_empty() => Ok(v),
                _ => {
                    Err(self.invalid(key, format!("names the environment variable {var}, which is not set (or empty)")))
                }
            }
        };
        let credentials = match (&s3.access_key_id_env, &s3.secret_access_key_env) {
            (None, None) => {
                if s3.session_token_env.is_some() {
                    return Err(self.invalid(
                        &format!("{part}.s3.session_token_env"),
                        "goes with access_key_id_env and secret_access_key_env",
                    ));
                }
                None
            }
            (Some(id), Some(secret_var)) => Some(sluice_store::S3Credentials {
                access_key_id: secret(&format!("{part}.s3.access_key_id_env"), id)?,
                secret_access_key: secret(&format!("{part}.s3.secret_access_key_env"), secret_var)?,
                session_token: s3
                    .session_token_env
                    .as_ref()
                    .map(|v| secret(&format!("{part}.s3.session_token_env"), v))
                    .transpose()?,
            }),
            _ => {
                return Err(self.invalid(
                    &format!("{part}.s3"),
                    "access_key_id_env and secret_access_key_env go together (or leave both out for the AWS chain)",
                ));
            }
        };
        if let Some(region) = &s3.region
            && (region.is_empty() || !region.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        {
            return Err(self.invalid(&format!("{part}.s3.region"), format!("{region:?} is not a region name")));
        }
        let gcs_endpoint = endpoint(&format!("{part}.gcs.endpoint"), &gcs.endpoint)?;
        if gcs.anonymous && gcs_endpoint.is_none() {
            return Err(self.invalid(
                &format!("{part}.gcs.anonymous"),
                "sends requests unsigned, which only an emulator takes: set an endpoint too",
            ));
        }
        Ok(StoreOptions {
            s3: sluice_store::S3Options {
                region: s3.region.clone(),
                endpoint: endpoint(&format!("{part}.s3.endpoint"), &s3.endpoint)?,
                credentials,
                virtual_host_style: s3.virtual_host_style,
            },
            // No endpoint named: Google's, or the emulator `STORAGE_EMULATOR_HOST` names.
            gcs: match gcs_endpoint {
                Some(endpoint) => sluice_store::GcsOptions { endpoint: Some(endpoint), anonymous: gcs.anonymous },
                None => sluice_store::GcsOptions::from_env(),
            },
        })
    }

    /// `job.state_dir`, or `.sluice/<id>` next to the job file.
    /// S3 and GCS are served: records are exclusive creates, the run's lease
    /// a compare-and-swap on the object's version (S3's ETag, GCS's
    /// generation); see `engine/object_state.rs`.
    fn resolve_state_dir(&mut self) -> Result<(), JobError> {
        const KEY: &str = "job.state_dir";
        self.state = match &self.spec.job.state_dir {
            Some(dir) => {
                let text = dir.to_str().ok_or_else(|| self.invalid(KEY, format!("{} is not UTF-8", dir.display())))?;
                Location::parse(text, &self.base_dir, STATE_DIR_SERVED).map_err(|e| self.invalid(KEY, e.to_string()))?
            }
            None => Location::Local(self.base_dir.join(".sluice").join(&self.spec.job.id)),
        };
        self.state_dir = match &self.state {
            Location::Local(path) => path.clone(),
            store => PathBuf::from(store.to_string()),
        };
        Ok(())
    }

    /// `[sink.grpc.*]` and `[sink.http.*]`, their tokens read.
    fn resolve_endpoints(&mut self) -> Result<(), JobError> {
        let mut endpoints = BTreeMap::new();
        for (name, spec) in &self.spec.sink.grpc {
            endpoints.insert(name.clone(), self.endpoint_config("grpc", name, spec)?);
        }
        self.endpoints = endpoints;
        let mut http = BTreeMap::new();
        for (name, spec) in &self.spec.sink.http {
            http.insert(name.clone(), self.endpoint_config("http", name, spec)?);
        }
        self.http_endpoints = http;
        Ok(())
    }

    /// The location `raw` given for `key`, refused unless `served` lists its kind.
    fn location(&self, key: &str, raw: &str, served: Served) -> Result<Location, JobError> {
        Location::parse(raw, &self.base_dir, served).map_err(|e| self.invalid(key, e.to_string()))
    }

    /// The absolute local path given for `key`, which serves local paths only:
    /// a URL of any other scheme is refused, never taken for a relative path.
    pub(crate) fn local_path(&self, key: &str, raw: &Path) -> Result<PathBuf, JobError> {
        let text = raw.to_str().ok_or_else(|| self.invalid(key, format!("{} is not UTF-8", raw.display())))?;
        let location = self.location(key, text, Served::LOCAL)?;
        location.into_local().ok_or_else(|| self.invalid(key, format!("{text:?} is not a local path")))
    }

    /// A secret from the environment variable `var`; `key` names the job key.
    fn token_from_env(&self, key: &str, var: &str) -> Result<Secret, JobError> {
        match std::env::var(var) {
            Ok(v) if !v.trim().is_empty() => Ok(Secret::new(v.trim())),
            Ok(_) => Err(self.invalid(key, format!("the environment variable {var} is empty"))),
            Err(_) => Err(self.invalid(key, format!("the environment variable {var} is not set"))),
        }
    }

    fn catalog_config(&self, spec: &CatalogSpec) -> Result<CatalogConfig, JobError> {
        const WAREHOUSE: &str = "sink.catalog.warehouse";
        let name = spec.name.clone();
        let text = spec
            .warehouse
            .to_str()
            .ok_or_else(|| self.invalid(WAREHOUSE, format!("{} is not UTF-8", spec.warehouse.display())))?;
        // Both kinds serve the same stores: the plugin writes the data files through `file-io`.
        let warehouse = Location::parse(text, &self.base_dir, SQL_WAREHOUSE_SERVED)
            .map_err(|e| self.invalid(WAREHOUSE, e.to_string()))?;
        match spec.kind {
            CatalogKind::Sql => {
                let rest_only = [
                    ("uri", spec.uri.is_some()),
                    ("token_env", spec.token_env.is_some()),
                    ("credential_env", spec.credential_env.is_some()),
                    ("credential_file", spec.credential_file.is_some()),
                    ("oauth2_server_uri", spec.oauth2_server_uri.is_some()),
                    ("scope", spec.scope.is_some()),
                ];
                if let Some((key, _)) = rest_only.iter().find(|(_, given)| *given) {
                    return Err(self.invalid(
                        &format!("sink.catalog.{key}"),
                        format!("kind = \"sql\" takes no `{key}` (that is the REST catalog's)"),
                    ));
                }
                let Some(database) = &spec.database else {
                    return Err(self.invalid("sink.catalog.database", "kind = \"sql\" needs the SQLite file"));
                };
                let database = self.local_path("sink.catalog.database", database)?;
                Ok(CatalogConfig::Sql { name, database, warehouse })
            }
            CatalogKind::Rest => {
                if spec.database.is_some() {
                    return Err(self.invalid(
                        "sink.catalog.database",
                        "kind = \"rest\" takes no `database` (that is the SQLite catalog's file)",
                    ));
                }
                let Some(uri) = &spec.uri else {
                    return Err(self.invalid("sink.catalog.uri", "kind = \"rest\" needs the catalog's base URI"));
                };
                if !(uri.starts_with("http://") || uri.starts_with("https://")) {
                    return Err(self.invalid("sink.catalog.uri", format!("{uri:?} is not an http:// or https:// URI")));
                }
                let auth = self.rest_auth(spec, uri)?;
                Ok(CatalogConfig::Rest { name, uri: uri.clone(), warehouse, auth })
            }
        }
    }

    /// The REST catalog's credentials: none, a static token, or OAuth2
    /// client credentials read from an environment variable or a file.
    fn rest_auth(&self, spec: &CatalogSpec, uri: &str) -> Result<Option<RestAuth>, JobError> {
        // Keys that contradict each other are refused before any is read.
        if spec.credential_env.is_some() && spec.credential_file.is_some() {
            return Err(
                self.invalid("sink.catalog.credential_env", "set at most one of credential_env and credential_file")
            );
        }
        if (spec.credential_env.is_some() || spec.credential_file.is_some()) && spec.token_env.is_some() {
            return Err(self.invalid(
                "sink.catalog.token_env",
                "OAuth2 client credentials obtain and refresh their own tokens: remove `token_env` (a static \
                 token), or remove credential_env/credential_file to send the static token",
            ));
        }
        let (credential, credential_source) = match (&spec.credential_env, &spec.credential_file) {
            (Some(var), _) => {
                let key = "sink.catalog.credential_env";
                (self.token_from_env(key, var)?, format!("the environment variable {var} ({key})"))
            }
            (None, Some(file)) => {
                let key = "sink.catalog.credential_file";
                let path = self.local_path(key, file)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| self.invalid(key, format!("cannot read {}: {e}", path.display())))?;
                if text.trim().is_empty() {
                    return Err(self.invalid(key, format!("{} is empty", path.display())));
                }
                (Secret::new(text.trim()), format!("the file {} ({key})", path.display()))
            }
            (None, None) => {
                for (key, given) in
                    [("oauth2_server_uri", spec.oauth2_server_uri.is_some()), ("scope", spec.scope.is_some())]
                {
                    if given {
                        return Err(self.invalid(
                            &format!("sink.catalog.{key}"),
                            "applies to OAuth2 client credentials only: set credential_env or credential_file too",
                        ));
                    }
                }
                let token = spec
                    .token_env
                    .as_deref()
                    .map(|var| self.token_from_env("sink.catalog.token_env", var))
                    .transpose()?;
                return Ok(token.map(RestAuth::Token));
            }
        };
        let server_uri = match &spec.oauth2_server_uri {
            Some(u) if u.starts_with("http://") || u.starts_with("https://") => u.clone(),
            Some(u) => {
                return Err(
                    self.invalid("sink.catalog.oauth2_server_uri", format!("{u:?} is not an http:// or https:// URI"))
                );
            }
            None => format!("{}/v1/oauth/tokens", uri.trim_end_matches('/')),
        };
        let scope = spec.scope.clone().unwrap_or_else(|| DEFAULT_OAUTH2_SCOPE.to_string());
        Ok(Some(RestAuth::OAuth2(OAuth2Config { credential, credential_source, server_uri, scope })))
    }

    /// `[sink.<section>.<name>]` (`grpc` or `http`), resolved.
    fn endpoint_config(&self, section: &str, name: &str, spec: &EndpointSpec) -> Result<EndpointConfig, JobError> {
        let key = |k: &str| format!("sink.{section}.{name}.{k}");
        let address: tonic::transport::Uri = spec
            .address
            .parse()
            .map_err(|e| self.invalid(&key("address"), format!("{:?} is not a valid URI: {e}", spec.address)))?;
        let tls = match address.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(
                    self.invalid(&key("address"), format!("{:?} must start with http:// or https://", spec.address))
                );
            }
        };
        if spec.auth.is_some() && (spec.token_env.is_some() || spec.token_file.is_some()) {
            let given = if spec.token_env.is_some() { "token_env" } else { "token_file" };
            return Err(self.invalid(
                &key("auth"),
                format!(
                    "auth = \"google\" obtains and refreshes its own tokens: remove `{given}` (a static token), \
                     or remove `auth` to send the static token"
                ),
            ));
        }
        let token = match (&spec.token_env, &spec.token_file) {
            (Some(_), Some(_)) => {
                return Err(self.invalid(&key("token_env"), "set at most one of token_env and token_file"));
            }
            (None, None) => None,
            (Some(var), None) => Some(self.token_from_env(&key("token_env"), var)?),
            (None, Some(file)) => {
                let path = self.local_path(&key("token_file"), file)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| self.invalid(&key("token_file"), format!("cannot read {}: {e}", path.display())))?;
                if text.trim().is_empty() {
                    return Err(self.invalid(&key("token_file"), format!("{} is empty", path.display())));
                }
                Some(Secret::new(text.trim()))
            }
        };
        if !(1..=MAX_WAIT_MS).contains(&spec.connect_timeout_ms) {
            return Err(self.invalid(
                &key("connect_timeout_ms"),
                format!("must be between 1 and {MAX_WAIT_MS} (an hour), got {}", spec.connect_timeout_ms),
            ));
        }
        if let Some(t) = &token
            && !t.expose().bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(self.invalid(&key("token_env"), "the token holds characters a header value cannot"));
        }
        Ok(EndpointConfig {
            address: spec.address.clone(),
            tls,
            token,
            google_auth: spec.auth == Some(EndpointAuth::Google),
            connect_timeout: Duration::from_millis(spec.connect_timeout_ms),
        })
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

/// `[source]`, with any error named by its full key (`source.rows`): the
/// table's `kind` picks the variant, and the rest is deserialized as that
/// variant's fields, their path tracked.
fn source_spec(value: toml::Value) -> Result<SourceSpec, (String, String)> {
    const KINDS: &str = "\"generator\", \"file\" or \"kafka\"";
    let toml::Value::Table(mut fields) = value else {
        return Err(("source".into(), format!("must be a table ([source]), not {}", value.type_str())));
    };
    let kind = match fields.remove("kind") {
        Some(toml::Value::String(kind)) => kind,
        Some(other) => return Err(("source.kind".into(), format!("{other} is not a kind of source; use {KINDS}"))),
        None => return Err(("source.kind".into(), format!("is missing: set {KINDS}"))),
    };
    let tagged = toml::Table::from_iter([(kind, toml::Value::Table(fields))]);
    serde_path_to_error::deserialize(toml::Value::Table(tagged)).map_err(|e| {
        // The first segment is the variant (the kind); the rest is the key in `[source]`.
        let mut key = "source".to_string();
        for segment in e.path().iter().skip(1) {
            match segment {
                serde_path_to_error::Segment::Seq { index } => key.push_str(&format!("[{index}]")),
                other => key.push_str(&format!(".{other}")),
            }
        }
        let message = e.into_inner().to_string();
        if key == "source" && message.starts_with("unknown variant") {
            key = "source.kind".into();
        }
        (key, hint_integer(message))
    })
}

/// A deserializing error's `message` on one line (the key is named
/// apart: toml's "in `key`" lines are dropped), with a hint when it is
/// about an integer written past what a TOML integer holds (such a `--set`
/// value is read as a string).
fn hint_integer(message: String) -> String {
    let message = message
        .lines()
        .map(str::trim)
        .filter(|l| !(l.is_empty() || l.starts_with("in `") && l.ends_with('`')))
        .collect::<Vec<_>>()
        .join(" ");
    let digits = message
        .strip_prefix("invalid type: string \"")
        .and_then(|rest| rest.split_once('"'))
        .is_some_and(|(text, _)| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()));
    if digits { format!("{message} (a job file's integers go up to {}, i64::MAX)", i64::MAX) } else { message }
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

impl Job {
    /// Whether the source's `table` lands where the dead letters do: the
    /// same name, or the same table once the sink's `table` pattern maps
    /// both (`t1` and `db.t1` beside `db.{table}`).
    pub fn lands_with_dead_letters(&self, table: &str) -> bool {
        self.dead_letters.as_ref().is_some_and(|dl| self.land_together(table, &dl.table))
    }

    /// Whether source tables `a` and `b` land in the same sink table.
    fn land_together(&self, a: &str, b: &str) -> bool {
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

fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > 64 {
        return Err("must be 1 to 64 characters long".to_string());
    }
    if !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
        return Err(format!("{id:?} may only hold ASCII letters, digits, `-` and `_`"));
    }
    Ok(())
}

/// Applies one `key.path=value` override. The value is read as a TOML value
/// (`4`, `true`, `"x"`, `[1, 2]`) and taken as a plain string otherwise.
fn apply_override(table: &mut toml::Table, arg: &str) -> Result<(), JobError> {
    let err = |message: &str| JobError::Override { arg: arg.to_string(), message: message.to_string() };
    let (key, raw) = arg.split_once('=').ok_or_else(|| err("expected key=value"))?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(err("the key must be a dotted path such as sink.options.path"));
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t.remove("v").unwrap_or_else(|| toml::Value::String(raw.to_string())),
        Err(_) => toml::Value::String(raw.to_string()),
    };
    let parts: Vec<&str> = key.split('.').collect();
    let (last, parents) = parts.split_last().ok_or_else(|| err("empty key"))?;
    let mut cur = table;
    for part in parents {
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        cur = match entry {
            toml::Value::Table(t) => t,
            _ => return Err(err(&format!("`{part}` is not a table in the job file"))),
        };
    }
    cur.insert(last.to_string(), value);
    Ok(())
}

/// Replaces `${NAME}` and `${NAME:-default}` in every string value.
fn interpolate_env(table: &mut toml::Table, prefix: &str, path: &Path) -> Result<(), JobError> {
    for (key, value) in table.iter_mut() {
        let full = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        interpolate_value(value, &full, path)?;
    }
    Ok(())
}

fn interpolate_value(value: &mut toml::Value, key: &str, path: &Path) -> Result<(), JobError> {
    match value {
        toml::Value::String(s) => {
            *s = expand(s).map_err(|message| JobError::Invalid {
                path: path.to_path_buf(),
                key: key.to_string(),
                message,
            })?;
        }
        toml::Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                interpolate_value(item, &format!("{key}[{i}]"), path)?;
            }
        }
        toml::Value::Table(t) => interpolate_env(t, key, path)?,
        _ => {}
    }
    Ok(())
}

fn expand(s: &str) -> Result<String, String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or_else(|| format!("unclosed `${{` in {s:?}"))?;
        let expr = &after[..end];
        let (name, default) = match expr.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (expr, None),
        };
        match (std::env::var(name), default) {
            (Ok(v), _) if !v.is_empty() => out.push_str(&v),
            (_, Some(d)) => out.push_str(d),
            (Ok(v), None) => out.push_str(&v),
            (Err(_), None) => {
                return Err(format!(
                    "environment variable {name} is not set (write ${{{name}:-default}} for a default)"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Makes a path absolute against the current directory, lexically.
pub fn absolute(p: &Path) -> Result<PathBuf, String> {
    let p = if p.as_os_str().is_empty() { Path::new(".") } else { p };
    std::path::absolute(p).map(|a| normalize(&a)).map_err(|e| format!("cannot make {} absolute: {e}", p.display()))
}

/// Removes `.` and resolves `..` lexically (no filesystem access).
pub use sluice_core::location::normalize;

impl crate::source::kafka::config::Resolver for Job {
    type Error = JobError;

    fn invalid(&self, key: &str, message: String) -> JobError {
        Job::invalid(self, key, message)
    }

    fn read_file(&self, key: &str, path: &Path) -> Result<String, JobError> {
        let file = self.local_path(key, path)?;
        std::fs::read_to_string(&file).map_err(|e| self.invalid(key, format!("cannot read {}: {e}", file.display())))
    }

    fn sink_catalog(&self) -> bool {
        self.spec.sink.catalog.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str, sets: &[&str]) -> Result<Job, JobError> {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.wasm"), b"x").unwrap();
        let path = dir.path().join("job.toml");
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        Job::from_str(text, &path, &sets)
    }

    const MINIMAL: &str = r#"
        [job]
        id = "j1"
        [source]
        kind = "generator"
        rows = 10
        [sink]
        plugin = "p.wasm"
    "#;

    /// [`MINIMAL`] with a Kafka source whose `[source]` keys are `keys`.
    fn kafka_source(keys: &str) -> String {
        MINIMAL.replace("kind = \"generator\"\n        rows = 10", &format!("kind = \"kafka\"\n{keys}"))
    }

    const KAFKA: &str = r#"
        brokers = ["127.0.0.1:9092"]
        topics = ["orders"]
        format = "json"
        columns = [{ name = "id", type = "long", nullable = false }, { name = "amount", type = "decimal(12,2)" }]
    "#;

    #[test]
    fn a_kafka_source_resolves_its_columns_topic_and_table_pattern() {
        let text = kafka_source(KAFKA)
            .replace("plugin = \"p.wasm\"", "plugin = \"p.wasm\"\n[sink.options]\ntable = \"lake.{topic}\"");
        let job = load(&text, &[]).unwrap_or_else(|e| panic!("{e}"));
        let kafka = job.kafka.as_ref().expect("resolved");
        assert_eq!(kafka.single_topic(), Some("orders"));
        assert!(job.unbounded());
        assert_eq!(job.sink_options(), vec![("table".to_string(), "lake.orders".to_string())]);
        let job = load(&text, &["source.bounded=true"]).unwrap_or_else(|e| panic!("{e}"));
        assert!(!job.unbounded());
    }

    #[test]
    fn a_kafka_source_refuses_what_it_cannot_serve_by_key() {
        let refused = |keys: &str, key: &str, words: &str| {
            let e = load(&kafka_source(keys), &[]).expect_err(keys).to_string();
            assert!(e.contains(key) && e.contains(words), "{keys}: {e}");
        };
        refused(&KAFKA.replace("\"long\"", "\"varchar\""), "source.columns[0]", "not a column type");
        refused(&KAFKA.replace("topics = [\"orders\"]", "topics = [\"a/b\"]"), "source.topics", "a topic name");
        refused(&format!("{KAFKA}\nstart = \"timestamp\""), "source.start_timestamp_ms", "needs");
        refused(
            &format!("{KAFKA}\n[source.properties]\n\"sasl.password\" = \"x\""),
            "source.properties.sasl.password",
            "security",
        );
        refused(
            &format!("{KAFKA}\n[source.properties]\n\"group.id\" = \"x\""),
            "source.properties.group.id",
            "set by Sluice",
        );
        refused(
            &format!(
                "{KAFKA}\n[source.security]\nprotocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-512\"\nusername = \"u\"\npassword_env = \"SLUICE_TEST_UNSET_PASSWORD\""
            ),
            "source.security.password_env",
            "SLUICE_TEST_UNSET_PASSWORD",
        );
        refused(&KAFKA.replace("format = \"json\"", "format = \"raw\""), "source.format", "fixed columns");
        refused(&format!("{KAFKA}\ntopic_pattern = \"o.*\""), "source.topic_pattern", "either topics or topic_pattern");
        // JSON without columns: only with a catalog whose tables give them,
        // and only for listed topics.
        let no_columns = KAFKA.replace(
            "columns = [{ name = \"id\", type = \"long\", nullable = false }, { name = \"amount\", type = \"decimal(12,2)\" }]",
            "",
        );
        assert!(!no_columns.contains("columns"), "{no_columns}");
        refused(&no_columns, "source.columns", "or a [sink.catalog] whose target table gives them");
        let with_catalog = |keys: &str| {
            kafka_source(keys).replace(
                "plugin = \"p.wasm\"",
                "plugin = \"p.wasm\"\n[sink.catalog]\ndatabase = \"wh/c.db\"\nwarehouse = \"wh\"",
            )
        };
        let job = load(&with_catalog(&no_columns), &[]).unwrap_or_else(|e| panic!("{e}"));
        let kafka = job.kafka.as_ref().expect("resolved");
        assert!(matches!(kafka.decoding, kafka::Decoding::JsonOfTable), "{:?}", kafka.decoding);
        let pattern = no_columns.replace("topics = [\"orders\"]", "topic_pattern = \"o.*\"");
        let e = load(&with_catalog(&pattern), &[]).expect_err("a pattern without columns").to_string();
        assert!(e.contains("source.columns") && e.contains("need listed topics"), "{e}");
        let registry = r#"
        brokers = ["127.0.0.1:9092"]
        topic_pattern = "orders.*"
        format = "avro"
        schema_registry = "http://127.0.0.1:8081"
    "#;
        refused(registry, "source.avro_schema", "with topic_pattern, give avro_schema");
        let listed = registry.replace("topic_pattern = \"orders.*\"", "topics = [\"orders\"]");
        refused(&listed.replace("http://", "ftp://"), "source.schema_registry", "not an http(s) URL");
    }

    /// [`MINIMAL`] with a file source at `path`.
    fn file_source(path: &str) -> String {
        let job = MINIMAL
            .replace("kind = \"generator\"\n        rows = 10", &format!("kind = \"file\"\n        path = \"{path}\""));
        assert!(job.contains(path), "{job}");
        job
    }

    #[test]
    fn minimal_job_gets_defaults() {
        let job = load(MINIMAL, &[]).unwrap();
        assert_eq!(job.spec.job.parallelism, 1);
        assert_eq!(job.spec.sink.id, "sink");
        assert!(job.state_dir.ends_with(".sluice/j1"));
        assert!(job.spec.sink.plugin.is_absolute());
        assert_eq!(job.checkpoint_trigger(), (None, Some(Duration::from_secs(10))));
    }

    #[test]
    fn metrics_address_and_health_age_are_parsed_strictly() {
        let job = load(MINIMAL, &[]).unwrap();
        assert_eq!(job.metrics_addr, None);
        assert_eq!(job.max_commit_age, Duration::from_secs(30), "three default intervals");
        let job = load(MINIMAL, &["job.checkpoint.interval_secs=2"]).unwrap();
        assert_eq!(job.max_commit_age, Duration::from_secs(6));
        let with = MINIMAL.replace(
            "id = \"j1\"",
            "id = \"j1\"\nmetrics_addr = \"127.0.0.1:0\"\n[job.health]\nmax_commit_age = \"1.5m\"",
        );
        let job = load(&with, &[]).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(job.metrics_addr, Some("127.0.0.1:0".parse().unwrap()));
        assert_eq!(job.max_commit_age, Duration::from_secs(90));
        for (set, key) in [
            ("job.metrics_addr=\"localhost\"", "job.metrics_addr"),
            ("job.metrics_addr=\"127.0.0.1:99999\"", "job.metrics_addr"),
            ("job.health.max_commit_age=\"10 parsecs\"", "job.health.max_commit_age"),
            ("job.health.max_commit_age=0", "job.health.max_commit_age"),
            ("job.health.max_age=\"1s\"", "max_age"),
        ] {
            let err = load(MINIMAL, &[set]).expect_err(set).to_string();
            assert!(err.contains(key), "{set}: {err}");
        }
        for (text, ms) in [("500ms", 500), ("2s", 2000), ("1h", 3_600_000), ("3", 3000)] {
            assert_eq!(parse_duration(&toml::Value::String(text.into())), Ok(Duration::from_millis(ms)), "{text}");
        }
        assert_eq!(parse_duration(&toml::Value::Integer(4)), Ok(Duration::from_secs(4)));
    }

    #[test]
    fn set_overrides_any_key() {
        let job = load(MINIMAL, &["job.parallelism=3", "sink.options.path=out dir", "source.rows=5"]).unwrap();
        assert_eq!(job.spec.job.parallelism, 3);
        assert_eq!(job.sink_options(), vec![("path".to_string(), "out dir".to_string())]);
        assert!(matches!(job.spec.source, SourceSpec::Generator { rows: 5, .. }));
    }

    #[test]
    fn errors_name_the_key() {
        let err = load(MINIMAL, &["job.parallelism=\"two\""]).unwrap_err().to_string();
        assert!(err.contains("key `job.parallelism`"), "{err}");
        let err = load(MINIMAL, &["job.paralelism=2"]).unwrap_err().to_string();
        assert!(err.contains("paralelism"), "{err}");
        let err = load(MINIMAL, &["job.parallelism=0"]).unwrap_err().to_string();
        assert!(err.contains("key `job.parallelism`: must be between 1 and 1024"), "{err}");
        let err = load(MINIMAL, &["sink.plugin=missing.wasm"]).unwrap_err().to_string();
        assert!(err.contains("key `sink.plugin`: no plugin file at"), "{err}");
        let err = load(MINIMAL, &["source.kind=pulsar"]).unwrap_err().to_string();
        assert!(err.contains("source") && err.contains("pulsar"), "{err}");
        let err = load("[job\nid=1", &[]).unwrap_err().to_string();
        assert!(err.contains("not valid TOML"), "{err}");
        let err = load(MINIMAL, &["novalue"]).unwrap_err().to_string();
        assert!(err.contains("expected key=value"), "{err}");
        // Catalog latency is a test fault (feature `fault-injection`), not a job key.
        let err =
            load(MINIMAL, &["sink.catalog.warehouse=wh", "sink.catalog.commit_delay_ms=5"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `commit_delay_ms`"), "{err}");
    }

    /// Every duration and rate is bounded at load, naming the full key,
    /// and an error inside `[source]` names its key in it.
    #[test]
    fn out_of_range_values_name_the_full_key() {
        for (set, says) in [
            (
                "job.checkpoint.interval_secs=1e300",
                "key `job.checkpoint.interval_secs`: must be between 0.001 and 604800 seconds, got 1e300",
            ),
            ("job.checkpoint.interval_secs=1e-9", "key `job.checkpoint.interval_secs`: must be between"),
            ("job.checkpoint.interval_secs=nan", "key `job.checkpoint.interval_secs`: must be between"),
            ("sink.sandbox.call_timeout_secs=1e300", "key `sink.sandbox.call_timeout_secs`: must be between 0.01"),
            ("job.lease_secs=0.1", "key `job.lease_secs`: must be between 0.3 and 3600 seconds, got 0.1"),
            ("source.rate=1e-300", "key `source.rate`: must be between 0.001 and 1e12 rows per second, got 1e-300"),
            ("source.rate=-1", "key `source.rate`"),
            ("source.batch_rows=100000000", "key `source.batch_rows`: must be between 1 and 10000000"),
            ("job.commit.max_backoff_ms=3600001", "key `job.commit.max_backoff_ms`: must be at most 3600000"),
            ("source.rows=18446744073709551616", "key `source.rows`: invalid type: string"),
            ("source.first_id=\"x\"", "key `source.first_id`: invalid type: string"),
            ("source.evolve_at=-1", "key `source.evolve_at`"),
            ("source.kind=3", "key `source.kind`"),
            ("source.kind=pulsar", "key `source.kind`: unknown variant `pulsar`"),
            ("source.rowz=3", "key `source.rowz`: unknown field `rowz`"),
            ("job.health.max_commit_age=\"1e300s\"", "key `job.health.max_commit_age`"),
        ] {
            let err = load(MINIMAL, &[set]).unwrap_err().to_string();
            assert!(err.contains(says), "{set}: {err}");
        }
        let err = load(MINIMAL, &["source.rows=18446744073709551616"]).unwrap_err().to_string();
        assert!(err.contains("i64::MAX"), "{err}");
        let job = load(MINIMAL, &["job.checkpoint.interval_secs=0.001", "source.rate=0.001"]).unwrap();
        assert_eq!(job.checkpoint_trigger().1, Some(Duration::from_millis(1)));
        let err = load(MINIMAL, &["sink.maintenance.compact_every=\"1000000years\""]).unwrap_err().to_string();
        assert!(err.contains("key `sink.maintenance.compact_every`") && err.contains("100 years"), "{err}");
    }

    /// Generator ids are Int64: `first_id + rows - 1` up to `i64::MAX`.
    #[test]
    fn generator_ids_past_i64_max_are_refused() {
        let err = load(MINIMAL, &["source.first_id=9223372036854775800", "source.rows=100"]).unwrap_err().to_string();
        assert!(
            err.contains("key `source.rows`")
                && err.contains("source.first_id = 9223372036854775800 with source.rows = 100 gives ids past"),
            "{err}"
        );
        load(MINIMAL, &["source.first_id=9223372036854775707", "source.rows=100"]).expect("the last id is i64::MAX");
        load(MINIMAL, &["source.first_id=9223372036854775807", "source.rows=0"]).expect("no ids at all");
    }

    /// A dotted dead-letter table beside a sink `table` pattern must be in
    /// the pattern's form, which the sink lands as written.
    #[test]
    fn a_dotted_dead_letter_table_must_fit_the_sink_pattern() {
        let load_dl = |table: &str| {
            let sets = [
                "job.bad_rows=\"dead-letter\"".to_string(),
                format!("job.dead_letter.table=\"{table}\""),
                "source.tables=[\"a\", \"b\"]".to_string(),
                "sink.options.table=\"lake.{table}\"".to_string(),
            ];
            load(MINIMAL, &sets.iter().map(String::as_str).collect::<Vec<_>>())
        };
        assert_eq!(load_dl("lake.dead_letters").unwrap().dead_letters.unwrap().table, "lake.dead_letters");
        assert_eq!(load_dl("dead_letters").unwrap().dead_letters.unwrap().table, "dead_letters");
        let err = load_dl("other.dl").unwrap_err().to_string();
        assert!(
            err.contains("key `job.dead_letter.table`")
                && err.contains("would land it in \"lake.other.dl\"")
                && err.contains("name it \"lake.<name>\""),
            "{err}"
        );
        assert!(in_pattern_form("lake.{table}", "lake.x") && !in_pattern_form("lake.{table}", "lake."));
        // `lake.a` lands where the source's table `a` does: refused.
        let err = load_dl("lake.a").unwrap_err().to_string();
        assert!(err.contains("key `job.dead_letter.table`") && err.contains("table of the source"), "{err}");
    }

    /// The file source's `path` serves object stores: the URL is kept
    /// (normalized), never taken for a relative path, and an unknown scheme
    /// is refused naming the key.
    #[test]
    fn a_file_source_path_may_be_an_object_store() {
        let file = file_source;
        for (given, kept) in [("s3://lake/in/", "s3://lake/in"), ("GS://lake/a/b", "gs://lake/a/b")] {
            let job = load(&file(given), &[]).unwrap();
            let SourceSpec::File { path, .. } = &job.spec.source else { panic!("a file source") };
            assert_eq!(path, &PathBuf::from(kept));
        }
        let err = load(&file("s4://lake/in"), &[]).unwrap_err().to_string();
        assert!(err.contains("key `source.path`") && err.contains("s4:// is not a scheme Sluice knows"), "{err}");
        assert!(err.contains("served here: local paths and file:// URLs, s3://, gs://"), "{err}");
    }

    /// `[source.s3]` and `[source.gcs]` are read as `[sink.s3]` and
    /// `[sink.gcs]` are, into `source_stores` alone: the state directory and
    /// the sink keep the environment's.
    #[test]
    fn a_file_source_reaches_its_store_by_its_own_settings() {
        // Any variable set in the test's environment will do: only its name is in the job.
        let path_var = std::env::var("PATH").expect("PATH is set");
        let sets = [
            "source.s3.region=eu-west-1",
            "source.s3.endpoint=http://127.0.0.1:9000",
            "source.s3.virtual_host_style=true",
            "source.s3.access_key_id_env=PATH",
            "source.s3.secret_access_key_env=PATH",
            "source.gcs.endpoint=http://127.0.0.1:4443",
            "source.gcs.anonymous=true",
        ];
        let job = load(&file_source("s3://lake/in"), &sets).unwrap();
        let s3 = &job.source_stores.s3;
        assert_eq!(s3.region.as_deref(), Some("eu-west-1"));
        assert_eq!(s3.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert!(s3.virtual_host_style);
        let keys = s3.credentials.as_ref().expect("static keys");
        assert_eq!((keys.access_key_id.as_str(), keys.secret_access_key.as_str()), (&*path_var, &*path_var));
        assert!(keys.session_token.is_none());
        let gcs = &job.source_stores.gcs;
        assert_eq!((gcs.endpoint.as_deref(), gcs.anonymous), (Some("http://127.0.0.1:4443"), true));
        for other in [&job.state_stores, &job.sink_stores] {
            assert!(other.s3.endpoint.is_none() && other.s3.region.is_none() && other.s3.credentials.is_none());
            assert!(!other.s3.virtual_host_style && !other.gcs.anonymous);
        }
        // Without the tables: the environment's, as for the sink and the state directory.
        let job = load(&file_source("s3://lake/in"), &[]).unwrap();
        assert!(job.source_stores.s3.endpoint.is_none() && job.source_stores.s3.credentials.is_none());
    }

    /// Every `[source.s3]`/`[source.gcs]` value that cannot work is refused
    /// naming its key, as the sink's are; a generator, which reads no store,
    /// takes no such table; a local file source takes it unused, as a local
    /// state directory takes `[job.s3]` and local grants `[sink.s3]`.
    #[test]
    fn source_store_settings_are_refused_naming_the_key() {
        let on_s3 = file_source("s3://lake/in");
        for (sets, key, says) in [
            (&["source.s3.endpoint=minio.lan:9000"][..], "source.s3.endpoint", "is not an http:// or https:// URL"),
            (&["source.s3.region=eu west"], "source.s3.region", "is not a region name"),
            (
                &["source.s3.access_key_id_env=PATH"],
                "source.s3",
                "access_key_id_env and secret_access_key_env go together",
            ),
            (&["source.s3.session_token_env=PATH"], "source.s3.session_token_env", "goes with access_key_id_env"),
            (
                &["source.s3.access_key_id_env=SLUICE_TEST_SURELY_UNSET", "source.s3.secret_access_key_env=PATH"],
                "source.s3.access_key_id_env",
                "names the environment variable SLUICE_TEST_SURELY_UNSET, which is not set",
            ),
            (&["source.gcs.endpoint=ftp://x"], "source.gcs.endpoint", "is not an http:// or https:// URL"),
            (&["source.gcs.anonymous=true"], "source.gcs.anonymous", "set an endpoint too"),
        ] {
            let err = load(&on_s3, sets).unwrap_err().to_string();
            assert!(err.contains(&format!("key `{key}`: ")) && err.contains(says), "{sets:?}: {err}");
        }
        // A secret is named by variable, never written inline.
        let err = load(&on_s3, &["source.s3.secret_access_key=oops"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `secret_access_key`"), "{err}");
        let err = load(MINIMAL, &["source.s3.region=eu-west-1"]).unwrap_err().to_string();
        assert!(err.contains("unknown field `s3`"), "{err}");
        let job = load(&file_source("."), &["source.s3.region=eu-west-1"]).unwrap();
        assert_eq!(job.source_stores.s3.region.as_deref(), Some("eu-west-1"));
    }

    #[test]
    fn a_warehouse_may_be_on_s3_or_gcs_but_not_elsewhere() {
        let sql = "sink.catalog.database=c.db";
        let rest = ["sink.catalog.kind=rest", "sink.catalog.uri=http://127.0.0.1:9"];
        for (scheme, url) in [(Scheme::S3, "s3://lake/wh/"), (Scheme::Gs, "gs://lake/wh")] {
            let warehouse = format!("sink.catalog.warehouse={url}");
            let expected = Location::ObjectStore { scheme, bucket: "lake".into(), prefix: "wh".into() };
            let job = load(MINIMAL, &[sql, &warehouse]).unwrap();
            assert_eq!(job.catalog.as_ref().map(CatalogConfig::warehouse), Some(expected.clone()));
            let job = load(MINIMAL, &[rest[0], rest[1], &warehouse]).unwrap();
            assert_eq!(job.catalog.as_ref().map(CatalogConfig::warehouse), Some(expected));
        }
        let err = load(MINIMAL, &[sql, "sink.catalog.warehouse=abfss://c@a.dfs.core.windows.net/wh"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("key `sink.catalog.warehouse`") && err.contains("abfss://"), "{err}");
    }

    #[test]
    fn env_interpolation_with_default() {
        let job = load(MINIMAL, &["sink.options.path=${SLUICE_TEST_SURELY_UNSET:-fallback}/x"]).unwrap();
        assert_eq!(job.sink_options()[0].1, "fallback/x");
        let err = load(MINIMAL, &["sink.options.path=${SLUICE_TEST_SURELY_UNSET}"]).unwrap_err().to_string();
        assert!(err.contains("sink.options.path") && err.contains("SLUICE_TEST_SURELY_UNSET"), "{err}");
    }

    #[test]
    fn normalize_resolves_dots() {
        assert_eq!(normalize(Path::new("/a/b/../c/./d")), PathBuf::from("/a/c/d"));
        assert_eq!(normalize(Path::new("/a/../../etc")), PathBuf::from("/etc"));
    }
}
