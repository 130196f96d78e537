//! `[sink.sandbox]`: the limits of one plugin instance. The plugin host
//! owns this configuration; the job loader deserializes and range-checks
//! it, and the generated job-file reference reads its doc comments.

use std::time::Duration;

use serde::Deserialize;
use sluice_capability::limits::{self, HostLimits};
use sluice_core::duration::seconds_within;

const WEEK_SECS: f64 = 7.0 * 86_400.0;

/// `[sink.sandbox]`: the limits of one plugin instance.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxSpec {
    /// Wall-clock limit of one plugin call, in seconds (10 ms to a week).
    #[serde(default = "default_call_timeout")]
    pub call_timeout_secs: f64,
    /// Linear-memory cap of one plugin instance, in MB (16 to 4096).
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// Host memory the capabilities may hold for one instance at once
    /// (codec output, queued gRPC messages); a `decompress` whose
    /// `max-size` is above it is refused.
    #[serde(default = "default_host_memory_mb")]
    pub host_memory_mb: u64,
    /// Log bytes one call may write (`log` and stdout/stderr lines); lines
    /// beyond are dropped, with one notice.
    #[serde(default = "default_log_bytes_per_call")]
    pub log_bytes_per_call: u64,
    /// Log bytes one instance may write per second; lines beyond are dropped.
    #[serde(default = "default_log_bytes_per_sec")]
    pub log_bytes_per_sec: u64,
    /// Output files one instance may hold open.
    #[serde(default = "default_max_open_files")]
    pub max_open_files: u32,
    /// gRPC calls one instance may have in flight (open streams and the unary call).
    #[serde(default = "default_max_grpc_streams")]
    pub max_grpc_streams: u32,
    /// HTTP requests one instance may have in flight.
    #[serde(default = "default_max_http_requests")]
    pub max_http_requests: u32,
}

impl Default for SandboxSpec {
    fn default() -> Self {
        Self {
            call_timeout_secs: default_call_timeout(),
            memory_mb: default_memory_mb(),
            host_memory_mb: default_host_memory_mb(),
            log_bytes_per_call: default_log_bytes_per_call(),
            log_bytes_per_sec: default_log_bytes_per_sec(),
            max_open_files: default_max_open_files(),
            max_grpc_streams: default_max_grpc_streams(),
            max_http_requests: default_max_http_requests(),
        }
    }
}

impl SandboxSpec {
    /// `call_timeout_secs` as a duration (checked at load against
    /// [`CALL_TIMEOUT_SECS`]).
    pub fn call_timeout(&self) -> Duration {
        seconds_within(self.call_timeout_secs, CALL_TIMEOUT_SECS)
    }

    /// What one instance may make the host spend.
    pub fn host_limits(&self) -> HostLimits {
        HostLimits {
            host_memory_mb: self.host_memory_mb,
            log_bytes_per_call: self.log_bytes_per_call,
            log_bytes_per_sec: self.log_bytes_per_sec,
            max_open_files: self.max_open_files,
            max_grpc_streams: self.max_grpc_streams,
            max_http_requests: self.max_http_requests,
        }
    }
}

fn default_host_memory_mb() -> u64 {
    limits::DEFAULT_HOST_MEMORY_MB
}
fn default_log_bytes_per_call() -> u64 {
    limits::DEFAULT_LOG_BYTES_PER_CALL
}
fn default_log_bytes_per_sec() -> u64 {
    limits::DEFAULT_LOG_BYTES_PER_SEC
}
fn default_max_open_files() -> u32 {
    limits::DEFAULT_MAX_OPEN_FILES
}
fn default_max_grpc_streams() -> u32 {
    limits::DEFAULT_MAX_GRPC_STREAMS
}
fn default_max_http_requests() -> u32 {
    limits::DEFAULT_MAX_HTTP_REQUESTS
}

fn default_call_timeout() -> f64 {
    300.0
}

/// The most linear memory a 32-bit WebAssembly instance can address (4 GiB).
pub const MAX_MEMORY_MB: u64 = 4096;

fn default_memory_mb() -> u64 {
    2048
}

/// The range of `sink.sandbox.call_timeout_secs`: 10 ms to a week.
pub const CALL_TIMEOUT_SECS: (f64, f64) = (0.01, WEEK_SECS);
