//! How a part of a job reaches its object store, as the job file says it
//! (`[job.s3]`, `[source.gcs]`, `[sink.s3]`, ...): the store owns this
//! configuration; the job loader turns it into [`crate::StoreOptions`].

use serde::Deserialize;

/// How one part of a job (`[job.s3]`: its state directory; `[source.s3]`:
/// the file source's input; `[sink.s3]`: the sink's grants and warehouse)
/// reaches S3. Every key left out comes from the AWS environment
/// (`AWS_REGION`, `AWS_ENDPOINT_URL`, the default credential chain).
/// Secrets are named by environment variable, never written inline. A
/// part that is not on S3 leaves its table unused.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct S3Spec {
    /// The signing region, e.g. `eu-west-1`.
    pub region: Option<String>,
    /// `https://…` or, for an S3-compatible server on a LAN (MinIO, Ceph),
    /// `http://…`.
    pub endpoint: Option<String>,
    /// `https://<bucket>.<endpoint>/…` instead of the path style
    /// `https://<endpoint>/<bucket>/…` (the default, which every
    /// S3-compatible server answers).
    #[serde(default)]
    pub virtual_host_style: bool,
    /// The environment variable holding a static access key id; with
    /// `secret_access_key_env` (both or neither).
    pub access_key_id_env: Option<String>,
    /// The environment variable holding the static secret access key;
    /// with `access_key_id_env`.
    pub secret_access_key_env: Option<String>,
    /// The environment variable holding a session token, with the static
    /// keys (optional).
    pub session_token_env: Option<String>,
}

/// How one part of a job reaches Google Cloud Storage (`[job.gcs]`,
/// `[source.gcs]`, `[sink.gcs]`). Credentials are Application Default
/// Credentials.
#[derive(Debug, Clone, Default, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GcsSpec {
    /// Another endpoint than Google's, e.g. an emulator on `http://127.0.0.1:4443`.
    pub endpoint: Option<String>,
    /// Send requests unsigned: only with an `endpoint` (an emulator), never to Google.
    #[serde(default)]
    pub anonymous: bool,
}
