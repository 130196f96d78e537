//! The AWS side of the environment that opendal 0.57 does not read, or
//! reads without saying what it tried: the region of the active profile in
//! the shared config file, and a check of the default credential chain
//! that names every source it asked.
//!
//! Invariants:
//! - the region is, in order: the job's (`S3Options::region`),
//!   `AWS_REGION`, `AWS_DEFAULT_REGION`, then `region` of the profile
//!   `AWS_PROFILE` (default `default`) in `AWS_CONFIG_FILE` (default
//!   `~/.aws/config`), whose sections are `[default]` and `[profile NAME]`
//!   (<https://docs.aws.amazon.com/cli/latest/userguide/cli-configure-files.html>).
//!   opendal reads only the first three; a region found nowhere is an error
//!   naming all four, before any request;
//! - [`check_credentials`] asks the providers of reqsign's default chain,
//!   the one opendal signs with, in its order (environment, profile, SSO,
//!   web identity, credential process, container, instance metadata), and
//!   reports each one's answer when none gives a credential. It never
//!   prints a secret; it sends no request to the store;
//! - the instance-metadata and container endpoints get a short timeout
//!   here (AWS's SDKs use 1 s for IMDS), so a machine without them fails
//!   the check in seconds instead of waiting for TCP to give up.

use std::time::Duration;

use reqsign_aws_v4::{
    AssumeRoleWithWebIdentityCredentialProvider, ECSCredentialProvider, EnvCredentialProvider,
    IMDSv2CredentialProvider, ProcessCredentialProvider, ProfileCredentialProvider, SSOCredentialProvider,
};
use reqsign_core::{Context, Env, OsEnv, ProvideCredential};
use reqsign_file_read_tokio::TokioFileRead;

use super::S3Options;

/// What the error of a request that found no credential to sign with says
/// (the chain was asked at that request; [`check_credentials`] says what
/// each source answered).
pub const CHAIN_HINT: &str = "the AWS default chain gave none. It tried the environment (AWS_ACCESS_KEY_ID and \
    AWS_SECRET_ACCESS_KEY), the profile AWS_PROFILE (default `default`) in the shared files \
    AWS_SHARED_CREDENTIALS_FILE and AWS_CONFIG_FILE (~/.aws/credentials, ~/.aws/config), web identity \
    (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN), the container endpoint and instance metadata (IMDSv2). Set \
    AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile with keys (`aws configure`)";

/// Where a region came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionSource {
    /// The job's own `region`.
    Options,
    /// An environment variable (`AWS_REGION`, `AWS_DEFAULT_REGION`).
    Env(&'static str),
    /// `region` of a profile in the shared config file.
    Profile { profile: String, file: String },
}

/// The signing region for `options`, and where it was found; `Err` says
/// everything that was tried.
pub fn region(options: &S3Options) -> Result<(String, RegionSource), String> {
    region_in(options, &OsEnv)
}

fn region_in(options: &S3Options, env: &dyn Env) -> Result<(String, RegionSource), String> {
    if let Some(region) = options.region.as_deref().filter(|r| !r.trim().is_empty()) {
        return Ok((region.to_string(), RegionSource::Options));
    }
    for var in ["AWS_REGION", "AWS_DEFAULT_REGION"] {
        if let Some(region) = env.var(var).filter(|r| !r.trim().is_empty()) {
            return Ok((region.trim().to_string(), RegionSource::Env(var)));
        }
    }
    let profile = active_profile(env);
    let file = config_file(env);
    let text = std::fs::read_to_string(&file);
    if let Ok(text) = &text
        && let Some(region) = profile_region(text, &profile)
    {
        return Ok((region, RegionSource::Profile { profile, file }));
    }
    let found = match &text {
        Ok(_) => "which has no `region` for it".to_string(),
        Err(e) => format!("which cannot be read: {e}"),
    };
    Err(format!(
        "no AWS region: tried the job's `region` (none), AWS_REGION and AWS_DEFAULT_REGION (not set), and the \
         profile {profile:?} (AWS_PROFILE) in the shared config file {file} (AWS_CONFIG_FILE), {found}. Set one \
         of them, for example AWS_REGION=us-east-1, or `region = \"us-east-1\"` in the job's [*.s3] table"
    ))
}

/// `AWS_PROFILE`, else `default`.
fn active_profile(env: &dyn Env) -> String {
    env.var("AWS_PROFILE").filter(|p| !p.trim().is_empty()).unwrap_or_else(|| "default".to_string())
}

/// `~/` at the start of `path` as the home directory.
fn expand_home(env: &dyn Env, path: String) -> String {
    match (path.strip_prefix("~/"), env.home_dir()) {
        (Some(rest), Some(home)) => home.join(rest).display().to_string(),
        _ => path,
    }
}

/// `AWS_CONFIG_FILE`, else `~/.aws/config`.
fn config_file(env: &dyn Env) -> String {
    expand_home(env, env.var("AWS_CONFIG_FILE").unwrap_or_else(|| "~/.aws/config".to_string()))
}

/// `AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`.
fn credentials_file(env: &dyn Env) -> String {
    expand_home(env, env.var("AWS_SHARED_CREDENTIALS_FILE").unwrap_or_else(|| "~/.aws/credentials".to_string()))
}

/// `region` of `profile` in the text of a shared config file: the section
/// `[default]` for `default` (`[profile default]` too), else `[profile NAME]`.
/// Parsed with the INI reader reqsign reads the same files with.
fn profile_region(text: &str, profile: &str) -> Option<String> {
    let ini = ini::Ini::load_from_str(text).ok()?;
    let named = format!("profile {profile}");
    let sections: &[&str] = if profile == "default" { &["default", "profile default"] } else { &[&named] };
    sections.iter().find_map(|name| {
        let region = ini.section(Some(*name))?.get("region")?.trim();
        (!region.is_empty()).then(|| region.to_string())
    })
}

/// The answer of one provider of the chain, for the message.
fn answer<T>(result: reqsign_core::Result<Option<T>>, none: &str) -> Result<(), String> {
    match result {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(none.to_string()),
        Err(e) => Err(describe(&e)),
    }
}

/// An error and its sources, one after the other.
fn describe(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let shown = s.to_string();
        if !text.contains(&shown) {
            text = format!("{text}: {shown}");
        }
        source = s.source();
    }
    text
}

/// Whether the AWS default chain yields a credential for `options` (static
/// keys in `options` always do). `Err` names every source it asked and
/// what each answered, and says what to do.
pub async fn check_credentials(options: &S3Options) -> Result<(), String> {
    if options.credentials.is_some() {
        return Ok(());
    }
    super::ensure_tls_provider();
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let ctx = Context::new()
        .with_file_read(TokioFileRead)
        .with_http_send(opendal::raw::HttpClient::with(client))
        .with_env(OsEnv);
    let env = OsEnv;
    let set = |var: &str| env.var(var).is_some_and(|v| !v.is_empty());
    let mut tried = Vec::new();

    // The order of reqsign's `DefaultCredentialProvider`.
    let keys = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY";
    match answer(EnvCredentialProvider::new().provide_credential(&ctx).await, "not set") {
        Ok(()) => return Ok(()),
        Err(why) => tried.push(format!("the environment ({keys}): {why}")),
    }
    let profile = active_profile(&env);
    let mut in_profile = Vec::new();
    match answer(ProfileCredentialProvider::new().provide_credential(&ctx).await, "no keys for it") {
        Ok(()) => return Ok(()),
        Err(why) => in_profile.push(why),
    }
    match answer(SSOCredentialProvider::new().provide_credential(&ctx).await, "") {
        Ok(()) => return Ok(()),
        Err(why) if !why.is_empty() => in_profile.push(format!("its SSO settings: {why}")),
        Err(_) => {}
    }
    match answer(ProcessCredentialProvider::new().provide_credential(&ctx).await, "") {
        Ok(()) => return Ok(()),
        Err(why) if !why.is_empty() => in_profile.push(format!("its credential_process: {why}")),
        Err(_) => {}
    }
    tried.push(format!(
        "the profile {profile:?} (AWS_PROFILE) in the shared files {} (AWS_SHARED_CREDENTIALS_FILE) and {} \
         (AWS_CONFIG_FILE): {}",
        credentials_file(&env),
        config_file(&env),
        in_profile.join("; ")
    ));
    let web = match (set("AWS_WEB_IDENTITY_TOKEN_FILE"), set("AWS_ROLE_ARN")) {
        (false, false) => "not set",
        (true, false) => "AWS_ROLE_ARN is not set",
        (false, true) => "AWS_WEB_IDENTITY_TOKEN_FILE is not set",
        (true, true) => "no credential",
    };
    match answer(AssumeRoleWithWebIdentityCredentialProvider::new().provide_credential(&ctx).await, web) {
        Ok(()) => return Ok(()),
        Err(why) => tried.push(format!("web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN): {why}")),
    }
    match answer(ECSCredentialProvider::new().provide_credential(&ctx).await, "not set") {
        Ok(()) => return Ok(()),
        Err(why) => tried.push(format!(
            "the container endpoint (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or AWS_CONTAINER_CREDENTIALS_FULL_URI): {why}"
        )),
    }
    let imds_endpoint =
        env.var("AWS_EC2_METADATA_SERVICE_ENDPOINT").unwrap_or_else(|| "http://169.254.169.254".to_string());
    let imds = format!("instance metadata (IMDSv2 at {imds_endpoint}, AWS_EC2_METADATA_SERVICE_ENDPOINT)");
    match answer(
        IMDSv2CredentialProvider::new().provide_credential(&ctx).await,
        "turned off (AWS_EC2_METADATA_DISABLED=true)",
    ) {
        Ok(()) => return Ok(()),
        Err(why) => tried.push(format!("{imds}: {why}")),
    }
    Err(format!(
        "no AWS credentials: tried {}. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a \
         profile with keys (`aws configure`), or run where web identity or instance metadata serves a role; or \
         name the variables holding the keys in the job's [*.s3] access_key_id_env and secret_access_key_env",
        tried.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::PathBuf;

    #[derive(Debug)]
    struct FakeEnv(HashMap<String, String>, PathBuf);

    impl Env for FakeEnv {
        fn var(&self, key: &str) -> Option<String> {
            self.0.get(key).cloned()
        }
        fn vars(&self) -> HashMap<String, String> {
            self.0.clone()
        }
        fn home_dir(&self) -> Option<PathBuf> {
            Some(self.1.clone())
        }
    }

    fn env(dir: &std::path::Path, vars: &[(&str, &str)]) -> FakeEnv {
        FakeEnv(vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), dir.to_path_buf())
    }

    const CONFIG: &str = "# shared config\n[default]\nregion = eu-west-1\n\n[profile lake]\nregion=ap-south-1 \n\
                          s3 =\n  region = ignored\n[profile bare]\noutput = json\n";

    #[test]
    fn the_profile_region_is_read_from_its_section() {
        assert_eq!(profile_region(CONFIG, "default").as_deref(), Some("eu-west-1"));
        assert_eq!(profile_region(CONFIG, "lake").as_deref(), Some("ap-south-1"));
        assert_eq!(profile_region(CONFIG, "bare"), None);
        assert_eq!(profile_region(CONFIG, "missing"), None);
        assert_eq!(profile_region("[profile default]\nregion = us-west-2\n", "default").as_deref(), Some("us-west-2"));
        // A credentials-file style section is not a config profile.
        assert_eq!(profile_region("[lake]\nregion = us-west-2\n", "lake"), None);
    }

    #[test]
    fn the_region_comes_from_options_then_the_environment_then_the_profile() {
        let dir = tempfile_dir();
        let config = dir.join("config");
        std::fs::write(&config, CONFIG).expect("config");
        let path = config.display().to_string();
        let job = S3Options { region: Some("us-east-2".into()), ..S3Options::default() };
        let e = env(&dir, &[("AWS_REGION", "sa-east-1"), ("AWS_CONFIG_FILE", &path)]);
        assert_eq!(region_in(&job, &e), Ok(("us-east-2".into(), RegionSource::Options)));
        let none = S3Options::default();
        assert_eq!(region_in(&none, &e), Ok(("sa-east-1".into(), RegionSource::Env("AWS_REGION"))));
        let e = env(&dir, &[("AWS_DEFAULT_REGION", "ca-central-1"), ("AWS_CONFIG_FILE", &path)]);
        assert_eq!(region_in(&none, &e), Ok(("ca-central-1".into(), RegionSource::Env("AWS_DEFAULT_REGION"))));
        let e = env(&dir, &[("AWS_PROFILE", "lake"), ("AWS_CONFIG_FILE", &path)]);
        let profile = RegionSource::Profile { profile: "lake".into(), file: path.clone() };
        assert_eq!(region_in(&none, &e), Ok(("ap-south-1".into(), profile)));
        // `~/.aws/config` by default.
        std::fs::create_dir_all(dir.join(".aws")).expect("mkdir");
        std::fs::write(dir.join(".aws/config"), CONFIG).expect("config");
        let e = env(&dir, &[]);
        let home = dir.join(".aws/config").display().to_string();
        let default = RegionSource::Profile { profile: "default".into(), file: home };
        assert_eq!(region_in(&none, &e), Ok(("eu-west-1".into(), default)));

        let e = env(&dir, &[("AWS_PROFILE", "bare"), ("AWS_CONFIG_FILE", &path)]);
        let err = region_in(&none, &e).expect_err("no region");
        assert!(err.starts_with("no AWS region: tried the job's `region` (none), AWS_REGION and AWS_DEFAULT_REGION"));
        assert!(err.contains(&format!("the profile \"bare\" (AWS_PROFILE) in the shared config file {path}")), "{err}");
        assert!(err.contains("which has no `region` for it"), "{err}");
        let missing = dir.join("missing").display().to_string();
        let e = env(&dir, &[("AWS_CONFIG_FILE", &missing)]);
        let err = region_in(&none, &e).expect_err("no region");
        assert!(err.contains(&format!("{missing} (AWS_CONFIG_FILE), which cannot be read")), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A fresh directory under the system's temporary one.
    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "sluice-store-aws-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }
}
