//! The AWS credential chain and region, as the real `sluice` binary finds
//! them, with `job.state_dir` on S3 (moto's server on 127.0.0.1):
//!
//! - a profile alone (`AWS_PROFILE`, the shared credentials and config
//!   files, no key in the environment) gives both the keys and the region;
//! - no credential anywhere (no keys, no profile, no web identity, instance
//!   metadata off or unreachable), or no region, stops `sluice check` and
//!   `sluice run` before anything is written, naming every source tried and
//!   what to do;
//! - instance metadata (IMDSv2, the double in `tests/src/imds.rs` found at
//!   `AWS_EC2_METADATA_SERVICE_ENDPOINT`) serves credentials that the host
//!   replaces every few seconds through a run of over 20 s, with exact rows.
//!
//! Every `sluice` process here gets an AWS environment of the test's own
//! making: every AWS variable of this process removed, `HOME` a temporary
//! directory (so no `~/.aws` is read) and no proxy, so nothing goes past
//! 127.0.0.1. Moto checks no signature, so what signed a request is read
//! from moto's request recorder: the `Authorization` header names the
//! access key id and the region (`Credential=<id>/<date>/<region>/s3/...`),
//! `X-Amz-Date` when it was signed.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use sluice_store::ObjectStore;
use sluice_tests::harness::block;
use sluice_tests::imds::ImdsServer;
use sluice_tests::store_servers::Moto;
use sluice_tests::{TestJob, assert_exactly_once, cache_dir, read_visible, sluice_bin, sluice_run};

const BUCKET: &str = "state";

/// Every variable the AWS chain, opendal or reqwest read, removed from a
/// `sluice` process before the test sets its own.
const CLEARED: [&str; 23] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_EC2_METADATA_SERVICE_ENDPOINT",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_S3_ENDPOINT",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
];

/// `cmd` with the AWS environment `vars` only (see the module doc), `HOME`
/// set to `home`.
fn aws_env<'a>(cmd: &'a mut Command, home: &Path, vars: &[(&str, String)]) -> &'a mut Command {
    for var in CLEARED.iter().chain(&["https_proxy", "all_proxy"]) {
        cmd.env_remove(var);
    }
    cmd.env("HOME", home).env("NO_PROXY", "*");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

/// `sluice <command> job.toml` with `sets`, in the job's directory.
fn sluice(job: &TestJob, command: &str, sets: &[String]) -> Command {
    if command == "run" {
        return sluice_run(job, sets);
    }
    let mut cmd = Command::new(sluice_bin());
    cmd.args([command, "job.toml"])
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .env("NO_COLOR", "1");
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The bucket, as the test sees it (its own keys, not the host's).
fn keys(moto: &Moto, prefix: &str) -> Vec<String> {
    let store = ObjectStore::s3(BUCKET, &moto.s3_options()).expect("bucket");
    block(store.list(prefix)).expect("list").into_iter().map(|o| o.key).collect()
}

/// A recorded request's header `name`.
fn header<'a>(request: &'a serde_json::Value, name: &str) -> &'a str {
    request["headers"]
        .as_object()
        .and_then(|h| h.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)))
        .and_then(|(_, v)| v.as_str())
        .unwrap_or_default()
}

/// The access key id and the region of an `Authorization` header
/// (`AWS4-HMAC-SHA256 Credential=<id>/<date>/<region>/s3/aws4_request, ...`).
fn credential_scope(authorization: &str) -> Option<(String, String)> {
    let scope = authorization.split("Credential=").nth(1)?.split(',').next()?;
    let mut parts = scope.split('/');
    let id = parts.next()?.to_string();
    let _date = parts.next()?;
    Some((id, parts.next()?.to_string()))
}

/// Seconds since the Unix epoch of an `X-Amz-Date` (`YYYYMMDDTHHMMSSZ`).
fn amz_date_secs(d: &str) -> Option<i64> {
    let n = |r: std::ops::Range<usize>| d.get(r).and_then(|s| s.parse::<i64>().ok());
    let (y, m, day) = (n(0..4)?, n(4..6)?, n(6..8)?);
    let (hh, mm, ss) = (n(9..11)?, n(11..13)?, n(13..15)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss)
}

/// The requests moto recorded for objects under `prefix` of the bucket.
fn recorded_under(moto: &Moto, prefix: &str) -> Vec<serde_json::Value> {
    let path = format!("/{BUCKET}/{prefix}");
    moto.recorded()
        .into_iter()
        .filter(|r| {
            let url = r["url"].as_str().unwrap_or_default();
            url.contains(&path) || url.contains(&format!("prefix={}", prefix.replace('/', "%2F")))
        })
        .collect()
}

/// `--set`s that put the job's state on S3 under `prefix`.
fn on_s3(prefix: &str) -> Vec<String> {
    vec![format!("job.state_dir=s3://{BUCKET}/{prefix}"), "job.lease_secs=10".to_string()]
}

/// A port nothing listens on (bound, then closed).
fn dead_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// The only credentials and the only region are in a profile: `AWS_PROFILE`
/// names it, its keys are in the shared credentials file, its region in the
/// shared config file. The run lands every row once, and every request for
/// its state was signed with the profile's key, in the profile's region.
#[test]
fn a_profile_alone_gives_the_keys_and_the_region() {
    let moto = Moto::start_recording(&[BUCKET]);
    let home = tempfile::tempdir().expect("home");
    let aws = tempfile::tempdir().expect("aws files");
    let credentials = aws.path().join("credentials");
    let config = aws.path().join("config");
    std::fs::write(
        &credentials,
        "[default]\naws_access_key_id = NOT-THIS-ONE\naws_secret_access_key = nope\n\n\
         [lake]\naws_access_key_id = PROFILEKEYLAKE01\naws_secret_access_key = profile-secret\n",
    )
    .expect("credentials file");
    std::fs::write(&config, "[default]\nregion = ap-south-1\n\n[profile lake]\nregion = eu-west-3\noutput = json\n")
        .expect("config file");
    let env = vec![
        ("AWS_PROFILE", "lake".to_string()),
        ("AWS_SHARED_CREDENTIALS_FILE", credentials.display().to_string()),
        ("AWS_CONFIG_FILE", config.display().to_string()),
        ("AWS_ENDPOINT_URL", moto.endpoint.clone()),
        ("AWS_EC2_METADATA_DISABLED", "true".to_string()),
    ];

    let prefix = "profile/state";
    let job = TestJob::files("aws-profile", 3100, 2, 500);
    std::fs::write(job.path(), &job.toml).expect("job file");
    let sets = on_s3(prefix);
    let out = aws_env(&mut sluice(&job, "check", &sets), home.path(), &env).output().expect("check");
    assert!(out.status.success(), "check passes with the profile:\n{}", text(&out));
    let out = aws_env(&mut sluice(&job, "run", &sets), home.path(), &env).output().expect("run");
    assert!(out.status.success(), "the run lands with the profile:\n{}", text(&out));
    assert_exactly_once(&read_visible(&job.out()), 3100);
    assert!(!job.dir.path().join(".sluice").exists(), "no local state");

    // Read before the test lists the bucket with its own key.
    let requests = recorded_under(&moto, prefix);
    assert!(requests.len() > 10, "the state's requests were recorded: {}", requests.len());
    for r in &requests {
        let scope = credential_scope(header(r, "Authorization"));
        assert_eq!(
            scope,
            Some(("PROFILEKEYLAKE01".to_string(), "eu-west-3".to_string())),
            "{} {} was signed with the profile's key in its region",
            r["method"],
            r["url"]
        );
    }
    let state = keys(&moto, prefix);
    assert!(state.iter().any(|k| k.contains("/checkpoints/")), "records in the bucket: {state:?}");
}

/// Runs `sluice check` and `sluice run` with `env` and `sets`; both must fail
/// with every one of `parts` in what they print, and leave `prefix` of the
/// bucket empty and no local state directory.
fn refused_before_anything_is_written(
    what: &str,
    moto: &Moto,
    prefix: &str,
    env: &[(&str, String)],
    parts: &[&str],
) -> String {
    let home = tempfile::tempdir().expect("home");
    let job = TestJob::files(&format!("aws-none-{}", prefix.replace('/', "-")), 1000, 1, 500);
    std::fs::write(job.path(), &job.toml).expect("job file");
    let sets = on_s3(prefix);
    let mut last = String::new();
    for command in ["check", "run"] {
        let mut cmd = sluice(&job, command, &sets);
        aws_env(&mut cmd, home.path(), env);
        let start = Instant::now();
        let out = cmd.output().expect("sluice");
        let took = start.elapsed();
        let log = text(&out);
        assert!(!out.status.success(), "{what}: {command} fails:\n{log}");
        for part in parts.iter().chain(&["key `job.state_dir`", &format!("s3://{BUCKET}/{prefix}")]) {
            assert!(log.contains(part), "{what}: {command}: the error names {part:?}:\n{log}");
        }
        assert!(!log.contains("panicked"), "{log}");
        assert!(took < Duration::from_secs(30), "{what}: {command} fails quickly: {took:?}");
        eprintln!("{what}, sluice {command}:\n{log}");
        last = log;
    }
    assert_eq!(keys(moto, prefix), Vec::<String>::new(), "{what}: nothing was written to the bucket");
    assert!(!job.dir.path().join(".sluice").exists(), "{what}: no local state");
    assert!(!job.out().exists() || read_visible(&job.out()).num_rows() == 0, "{what}: nothing landed");
    last
}

/// No credential anywhere in the chain stops `check` and `run` before
/// anything is written, naming each source tried (the environment, the
/// profile and its files, web identity, the container endpoint, instance
/// metadata, turned off or unreachable) and what to do; no region does too.
#[test]
fn no_credential_and_no_region_stop_check_and_run_before_anything_is_written() {
    let moto = Moto::start(&[BUCKET]);
    let aws = tempfile::tempdir().expect("aws files");
    let credentials = aws.path().join("credentials");
    let config = aws.path().join("config");
    let base = vec![
        ("AWS_SHARED_CREDENTIALS_FILE", credentials.display().to_string()),
        ("AWS_CONFIG_FILE", config.display().to_string()),
        ("AWS_ENDPOINT_URL", moto.endpoint.clone()),
        ("AWS_REGION", "us-east-1".to_string()),
    ];
    let tried = |profile: &str| {
        vec![
            "no AWS credentials: tried the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY): not set".to_string(),
            format!(
                "the profile {profile:?} (AWS_PROFILE) in the shared files {} (AWS_SHARED_CREDENTIALS_FILE) and {} \
                 (AWS_CONFIG_FILE)",
                credentials.display(),
                config.display()
            ),
            "web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN): not set".to_string(),
            "the container endpoint (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or AWS_CONTAINER_CREDENTIALS_FULL_URI): not set"
                .to_string(),
            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile with keys".to_string(),
        ]
    };

    // Instance metadata turned off; no files at all.
    let mut env = base.clone();
    env.push(("AWS_EC2_METADATA_DISABLED", "true".to_string()));
    let mut parts = tried("default");
    parts.push("instance metadata (IMDSv2 at http://169.254.169.254, AWS_EC2_METADATA_SERVICE_ENDPOINT): turned off (AWS_EC2_METADATA_DISABLED=true)".to_string());
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    refused_before_anything_is_written("IMDS off", &moto, "none/off", &env, &refs);

    // Instance metadata unreachable; a profile named that has no keys.
    std::fs::write(&credentials, "[other]\naws_access_key_id = A\naws_secret_access_key = B\n").expect("credentials");
    std::fs::write(&config, "[profile lake]\noutput = json\n").expect("config");
    let imds = format!("http://127.0.0.1:{}", dead_port());
    let mut env = base.clone();
    env.push(("AWS_PROFILE", "lake".to_string()));
    env.push(("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.clone()));
    let mut parts = tried("lake");
    parts.push(format!(
        "instance metadata (IMDSv2 at {imds}, AWS_EC2_METADATA_SERVICE_ENDPOINT): failed to connect to IMDS"
    ));
    parts.push("(AWS_CONFIG_FILE): no keys for it".to_string());
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    refused_before_anything_is_written("IMDS unreachable", &moto, "none/unreachable", &env, &refs);

    // Web identity half set: the missing half is named.
    let mut env = base.clone();
    env.push(("AWS_EC2_METADATA_DISABLED", "true".to_string()));
    env.push(("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/lake".to_string()));
    let parts = ["web identity (AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN): AWS_WEB_IDENTITY_TOKEN_FILE is not set"];
    refused_before_anything_is_written("web identity half set", &moto, "none/web", &env, &parts);

    // Keys but no region: not in the job, the environment or the profile.
    let mut env: Vec<(&str, String)> = base.iter().filter(|(k, _)| *k != "AWS_REGION").cloned().collect();
    env.push(("AWS_ACCESS_KEY_ID", "sluice-test".to_string()));
    env.push(("AWS_SECRET_ACCESS_KEY", "sluice-test-secret".to_string()));
    env.push(("AWS_PROFILE", "lake".to_string()));
    let no_region = format!(
        "no AWS region: tried the job's `region` (none), AWS_REGION and AWS_DEFAULT_REGION (not set), and the profile \
         \"lake\" (AWS_PROFILE) in the shared config file {} (AWS_CONFIG_FILE), which has no `region` for it",
        config.display()
    );
    refused_before_anything_is_written(
        "no region",
        &moto,
        "none/region",
        &env,
        &[&no_region, "for example AWS_REGION=us-east-1"],
    );
}

/// How long each set of instance credentials says it lives: reqsign (the
/// signer opendal uses) refreshes a credential once less than 120 s of it
/// is left, and signs with none that has less than 10 s; so a set that says
/// it expires 122.5 s after its issue must be replaced after 2.5 s.
const IMDS_LIFETIME: Duration = Duration::from_millis(122_500);
/// reqsign's refresh margin (`reqsign-aws-core` 3.2 `Credential::is_valid`).
const REFRESH_AHEAD: Duration = Duration::from_secs(120);

/// Instance metadata is the only source of credentials; a run of over 20 s
/// with its state on S3 signs every request with a set the double issued,
/// each before it was due for replacement, with many successive sets, and
/// every row lands once.
#[test]
fn instance_metadata_credentials_are_replaced_through_a_long_run() {
    let moto = Moto::start_recording(&[BUCKET]);
    let imds = ImdsServer::start("sluice-writer", IMDS_LIFETIME).expect("IMDS double");
    let home = tempfile::tempdir().expect("home");
    let env = vec![
        ("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint()),
        ("AWS_ENDPOINT_URL", moto.endpoint.clone()),
        ("AWS_REGION", "us-east-1".to_string()),
        ("AWS_SHARED_CREDENTIALS_FILE", home.path().join("none").display().to_string()),
        ("AWS_CONFIG_FILE", home.path().join("none").display().to_string()),
    ];
    const ROWS: u64 = 22_000;
    let prefix = "imds/state";
    let mut job = TestJob::files("aws-imds", ROWS, 2, 500);
    // 1000 rows/s over both subtasks: 22 s, a checkpoint about every second.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    std::fs::write(job.path(), &job.toml).expect("job file");
    let mut run = sluice(&job, "run", &on_s3(prefix));
    aws_env(&mut run, home.path(), &env);
    let start = Instant::now();
    let out = run.output().expect("run");
    let took = start.elapsed();
    assert!(out.status.success(), "{}", text(&out));
    assert!(took >= Duration::from_secs(20), "the run lasted {took:?}, not long enough for refreshes");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
    assert!(!job.dir.path().join(".sluice").exists(), "no local state");

    let issued = imds.issued();
    let window = IMDS_LIFETIME - REFRESH_AHEAD;
    let least = (took.as_millis() / window.as_millis()) as usize / 2;
    assert!(issued.len() >= least, "{} sets issued in {took:?}, expected at least {least}", issued.len());
    assert_eq!(imds.unauthorized(), 0, "every metadata request carried a live session token");
    assert!(imds.sessions() >= 1, "IMDSv2: a session token was asked for");

    let mut used = std::collections::BTreeSet::new();
    let requests = recorded_under(&moto, prefix);
    for r in &requests {
        let (key, region) = credential_scope(header(r, "Authorization"))
            .unwrap_or_else(|| panic!("{} {} is not signed", r["method"], r["url"]));
        assert_eq!(region, "us-east-1");
        let signed = amz_date_secs(header(r, "X-Amz-Date")).unwrap_or_else(|| panic!("no X-Amz-Date on {}", r["url"]));
        let set = issued
            .iter()
            .find(|s| s.access_key_id == key)
            .unwrap_or_else(|| panic!("{} {} was signed with {key:?}, not an instance key", r["method"], r["url"]));
        // Signed while more than the refresh margin of the set was left
        // (X-Amz-Date has whole seconds, rounded down).
        assert!(
            signed * 1000 <= set.expires_at_ms as i64 - REFRESH_AHEAD.as_millis() as i64,
            "{} {} was signed at {signed} s with {key}, due for replacement before {} ms",
            r["method"],
            r["url"],
            set.expires_at_ms - REFRESH_AHEAD.as_millis() as u64
        );
        used.insert(key);
    }
    assert!(requests.len() > 50, "the state's requests went through moto: {}", requests.len());
    assert!(used.len() >= 5, "requests were signed with several successive sets: {used:?}");
    eprintln!("{took:?}: {} sets issued, {} used for {} requests", issued.len(), used.len(), requests.len());
}
