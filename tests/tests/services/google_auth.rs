//! `auth = "google"`: the BigQuery plugin against the BigQuery double, with
//! Application Default Credentials from each of their sources, all served
//! by the token double (`tests/src/token_server.rs`) on 127.0.0.1, whose
//! tokens expire after 2.5 s:
//! - the metadata server (found through `GCE_METADATA_HOST`);
//! - a service-account key file named by `GOOGLE_APPLICATION_CREDENTIALS`:
//!   the host's JWT-bearer grant at the file's `token_uri`, each assertion
//!   verified by the double against the TEST-ONLY key's public half;
//! - an authorized-user file, there or as gcloud's ADC file (under
//!   `CLOUDSDK_CONFIG`, or `~/.config/gcloud`): the refresh-token grant.
//!
//! The BigQuery double refuses expired and unknown tokens as the real
//! service does (gRPC `UNAUTHENTICATED`). Each run is a `sluice` process,
//! so that its environment is its own, and nothing in it points past
//! 127.0.0.1: `GCE_METADATA_HOST` always names a server of the test (the
//! token double, whose metadata endpoint counts what it is asked, or a
//! closed port), `HOME` is a temporary directory, and proxies are unset.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_bigquery_double::{BigQueryDouble, Rpc, generator_schema};
use sluice_tests::token_server::{
    CLOUD_PLATFORM, Grant, JWT_BEARER, TEST_ONLY_PRIVATE_KEY_PEM, TokenServer, public_key_der,
};
use sluice_tests::{TestJob, assert_exactly_once_range, bigquery_rows, cache_dir, sluice_bin};

const TABLE: &str = "projects/p/datasets/d/tables/events";
/// How long the token double's tokens live: several renewals in a run.
const TOKEN_LIFETIME: Duration = Duration::from_millis(2500);
const SERVICE_ACCOUNT: &str = "sluice-writer@sluice-test.iam.gserviceaccount.com";
const CLIENT_ID: &str = "764086051850-test.apps.googleusercontent.com";
const CLIENT_SECRET: &str = "d-FL95Q19q7MQmFpd7hHD0Ty";
const REFRESH_TOKEN: &str = "1//0test-refresh-token";

fn double() -> BigQueryDouble {
    let d = BigQueryDouble::start().expect("starting the BigQuery double");
    d.create_table(TABLE, generator_schema());
    d
}

/// A BigQuery job whose gRPC and HTTP endpoints take Google credentials.
fn google_job(id: &str, d: &BigQueryDouble, rows: u64, parallelism: u32, every: u64) -> TestJob {
    let mut job = TestJob::bigquery(id, &d.address(), TABLE, rows, parallelism, every);
    job.toml = job.toml.replace("[sink.grpc.bigquery]\n", "[sink.grpc.bigquery]\nauth = \"google\"\n");
    job.toml.push_str(&format!("[sink.http.bigquery]\naddress = \"{}\"\nauth = \"google\"\n", d.rest_address()));
    assert!(job.toml.contains("auth = \"google\"\naddress"), "the gRPC endpoint takes auth:\n{}", job.toml);
    job
}

/// 1000 rows/s over both subtasks.
fn paced(mut job: TestJob) -> TestJob {
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    job
}

/// The ADC environment of one `sluice` process.
struct Adc {
    /// `GOOGLE_APPLICATION_CREDENTIALS`, if set.
    file: Option<PathBuf>,
    /// `CLOUDSDK_CONFIG`, if set.
    cloudsdk_config: Option<PathBuf>,
    /// `HOME`: a directory of the test (gcloud's ADC file there only if the
    /// test puts one).
    home: PathBuf,
    /// `GCE_METADATA_HOST`: always a server of the test on 127.0.0.1.
    metadata_host: String,
}

impl Adc {
    /// The metadata server at `host`, nothing else.
    fn metadata(job: &TestJob, host: &str) -> Self {
        Self { file: None, cloudsdk_config: None, home: job.dir.path().to_path_buf(), metadata_host: host.to_string() }
    }

    /// The file `file` named by `GOOGLE_APPLICATION_CREDENTIALS`, with the
    /// token double as the metadata server, to see that it is never asked.
    fn file(job: &TestJob, file: &Path, tokens: &TokenServer) -> Self {
        Self { file: Some(file.to_path_buf()), ..Self::metadata(job, &tokens.host()) }
    }
}

/// `sluice <args>` in the job's directory, with the environment `adc`.
fn sluice(job: &TestJob, args: &[&str], adc: &Adc) -> (Output, Duration) {
    std::fs::write(job.path(), &job.toml).expect("writing the job file");
    let mut cmd = Command::new(sluice_bin());
    cmd.args(args)
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .env("NO_COLOR", "1")
        .env_remove("GOOGLE_APPLICATION_CREDENTIALS")
        .env_remove("CLOUDSDK_CONFIG")
        .env_remove("GOOGLE_CLOUD_QUOTA_PROJECT")
        .env("HOME", &adc.home)
        .env("GCE_METADATA_HOST", &adc.metadata_host)
        // Token requests go straight to 127.0.0.1, never through a proxy.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for proxy in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
        cmd.env_remove(proxy);
    }
    if let Some(file) = &adc.file {
        cmd.env("GOOGLE_APPLICATION_CREDENTIALS", file);
    }
    if let Some(dir) = &adc.cloudsdk_config {
        cmd.env("CLOUDSDK_CONFIG", dir);
    }
    let start = Instant::now();
    let out = cmd.output().expect("running sluice");
    (out, start.elapsed())
}

fn run(job: &TestJob, adc: &Adc) -> (Output, Duration) {
    sluice(job, &["run", "job.toml", "--progress", "plain"], adc)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs()
}

/// The token double with the test's service account (and the TEST-ONLY
/// key's public half) and authorized user registered.
fn token_double(lifetime: Duration) -> TokenServer {
    let tokens = TokenServer::start(lifetime).expect("starting the token double");
    tokens.add_service_account(SERVICE_ACCOUNT, public_key_der(TEST_ONLY_PRIVATE_KEY_PEM));
    tokens.add_authorized_user(CLIENT_ID, CLIENT_SECRET, REFRESH_TOKEN);
    tokens
}

/// A run of over 20 s with `adc`, tokens living 2.5 s: the host renews them
/// ahead of their expiry, no call is refused, every row lands once, and the
/// token double issued at least one token per lifetime by `grant`.
fn long_run(id: &str, tokens: &TokenServer, grant: Grant, adc: impl FnOnce(&TestJob) -> Adc) {
    let d = double();
    d.require_valid_token(tokens.validator());
    const ROWS: u64 = 22_000;
    let job = paced(google_job(id, &d, ROWS, 2, 1_000));
    let adc = adc(&job);
    let (out, took) = run(&job, &adc);
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert!(took >= Duration::from_secs(20), "the run lasted {took:?}, not long enough for renewals");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    assert_eq!(d.unauthenticated(), 0, "no call was refused for an expired token:\n{log}");
    // At least one token per lifetime over the run (more: each run's
    // grants open their own credentials).
    let least = (took.as_millis() / TOKEN_LIFETIME.as_millis()) as usize;
    let issued = tokens.issued_by(grant);
    assert!(issued >= least, "{issued} tokens issued by {grant:?} in {took:?}, expected at least {least}");
    assert_eq!(tokens.issued(), issued, "every token came from {grant:?}");
    assert_eq!(tokens.refused(), 0, "every metadata request carried Metadata-Flavor: Google");
    assert_eq!(tokens.oauth_refusals(), Vec::<String>::new(), "the token endpoint refused nothing");
    assert!(d.calls(Rpc::FlushRows) >= 11, "checkpoints ran through the run: {}", d.calls(Rpc::FlushRows));
}

/// The metadata server's tokens, renewed through a run of over 20 s.
#[test]
fn tokens_that_expire_every_few_seconds_are_renewed_for_a_long_run() {
    let tokens = token_double(TOKEN_LIFETIME);
    long_run("bq-google", &tokens, Grant::Metadata, |job| Adc::metadata(job, &tokens.host()));
}

/// A service-account key file: the host signs a JWT assertion with the key
/// and exchanges it at the file's `token_uri` for each token, through a
/// run of over 20 s. Every assertion the double accepted (its signature
/// verified against the key's public half) carries the claims Google's
/// documentation asks for.
#[test]
fn a_service_account_key_file_is_exchanged_at_its_token_uri_through_a_long_run() {
    let tokens = token_double(TOKEN_LIFETIME);
    let keys = tempfile::tempdir().expect("key dir");
    let key_file = tokens.service_account_file(keys.path(), SERVICE_ACCOUNT);
    let before = unix_now();
    long_run("bq-sa", &tokens, Grant::JwtBearer, |job| Adc::file(job, &key_file, &tokens));
    let after = unix_now();
    let assertions = tokens.assertions();
    assert_eq!(assertions.len(), tokens.issued_by(Grant::JwtBearer), "one assertion per token");
    for a in &assertions {
        assert_eq!(a.iss, SERVICE_ACCOUNT, "{a:?}");
        assert_eq!(a.aud, tokens.token_uri(), "aud is the token endpoint: {a:?}");
        assert_eq!(a.scope, CLOUD_PLATFORM, "{a:?}");
        assert_eq!(a.kid.as_deref(), Some("test-only-key-1"), "kid is the file's private_key_id: {a:?}");
        assert!(before <= a.iat && a.iat <= after, "iat is the time of signing: {a:?}");
        assert_eq!(a.exp - a.iat, 3600, "an assertion claims Google's longest life, an hour: {a:?}");
    }
}

/// An authorized-user file (`gcloud auth application-default login`'s
/// kind) named by `GOOGLE_APPLICATION_CREDENTIALS`: its refresh token is
/// exchanged at its `token_uri` for each token, through a run of over 20 s.
#[test]
fn an_authorized_user_file_is_refreshed_at_its_token_uri_through_a_long_run() {
    let tokens = token_double(TOKEN_LIFETIME);
    let dir = tempfile::tempdir().expect("file dir");
    let file = dir.path().join("user.json");
    tokens.authorized_user_file(&file, CLIENT_ID, CLIENT_SECRET, REFRESH_TOKEN);
    long_run("bq-user", &tokens, Grant::RefreshToken, |job| Adc::file(job, &file, &tokens));
}

/// gcloud's ADC file: `$CLOUDSDK_CONFIG/application_default_credentials.json`
/// when `CLOUDSDK_CONFIG` is set (where gcloud writes it; `HOME`'s is then
/// not read), else `~/.config/gcloud/application_default_credentials.json`.
#[test]
fn gclouds_adc_file_is_found_under_cloudsdk_config_or_home() {
    let tokens = token_double(TOKEN_LIFETIME);
    const ROWS: u64 = 3_000;
    const ADC_FILE: &str = "application_default_credentials.json";

    // CLOUDSDK_CONFIG's file is used; HOME's (a revoked refresh token) is not.
    let d = double();
    d.require_valid_token(tokens.validator());
    let job = paced(google_job("bq-cloudsdk", &d, ROWS, 2, 500));
    let config = tempfile::tempdir().expect("CLOUDSDK_CONFIG");
    tokens.authorized_user_file(&config.path().join(ADC_FILE), CLIENT_ID, CLIENT_SECRET, REFRESH_TOKEN);
    let home = tempfile::tempdir().expect("HOME");
    tokens.authorized_user_file(
        &home.path().join(".config/gcloud").join(ADC_FILE),
        CLIENT_ID,
        CLIENT_SECRET,
        "1//revoked",
    );
    let adc = Adc {
        file: None,
        cloudsdk_config: Some(config.path().to_path_buf()),
        home: home.path().to_path_buf(),
        metadata_host: tokens.host(),
    };
    let (out, _) = run(&job, &adc);
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    assert!(tokens.issued_by(Grant::RefreshToken) >= 1, "tokens came from the refresh-token grant");
    assert_eq!(tokens.oauth_refusals(), Vec::<String>::new(), "HOME's revoked token was never sent");
    assert_eq!(tokens.issued_by(Grant::Metadata), 0, "the metadata server was never asked");

    // No CLOUDSDK_CONFIG: HOME's file.
    let d = double();
    d.require_valid_token(tokens.validator());
    let job = paced(google_job("bq-home-adc", &d, ROWS, 2, 500));
    let home = tempfile::tempdir().expect("HOME");
    tokens.authorized_user_file(
        &home.path().join(".config/gcloud").join(ADC_FILE),
        CLIENT_ID,
        CLIENT_SECRET,
        REFRESH_TOKEN,
    );
    let before = tokens.issued_by(Grant::RefreshToken);
    let adc = Adc { home: home.path().to_path_buf(), ..Adc::metadata(&job, &tokens.host()) };
    let (out, _) = run(&job, &adc);
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    assert!(tokens.issued_by(Grant::RefreshToken) > before, "tokens came from HOME's authorized-user file");
    assert_eq!(tokens.issued_by(Grant::Metadata), 0, "the metadata server was never asked");
    assert_eq!(d.unauthenticated(), 0);
}

/// Tokens revoked mid-run are refused as UNAUTHENTICATED: the host renews
/// the token (from the metadata server, or by a new JWT-bearer exchange),
/// sends a refused unary call once more and answers a refused stream
/// UNAVAILABLE, which the plugin retries; every row lands once.
#[test]
fn a_token_refused_mid_run_is_renewed_and_the_call_retried() {
    for grant in [Grant::Metadata, Grant::JwtBearer] {
        let tokens = token_double(Duration::from_secs(3600));
        let d = double();
        d.require_valid_token(tokens.validator());
        const ROWS: u64 = 8_000;
        // 1000 rows/s: 8 s, 16 checkpoints; revoked twice on the way.
        let job = paced(google_job("bq-revoked", &d, ROWS, 2, 500));
        let keys = tempfile::tempdir().expect("key dir");
        let adc = match grant {
            Grant::JwtBearer => Adc::file(&job, &tokens.service_account_file(keys.path(), SERVICE_ACCOUNT), &tokens),
            _ => Adc::metadata(&job, &tokens.host()),
        };
        let (out, _) = std::thread::scope(|s| {
            s.spawn(|| {
                // Once checkpoints are under way, twice, a few checkpoints apart.
                for at in [1, 5] {
                    let start = Instant::now();
                    while d.calls(Rpc::FlushRows) < at && start.elapsed() < Duration::from_secs(120) {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    tokens.revoke_all();
                }
            });
            run(&job, &adc)
        });
        let log = text(&out);
        assert!(out.status.success(), "{grant:?}: the run succeeds:\n{log}");
        assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
        assert!(d.unauthenticated() > 0, "{grant:?}: revoked tokens were refused");
        assert!(tokens.issued_by(grant) >= 3, "{grant:?}: renewed after each revocation: {}", tokens.issued_by(grant));
        assert_eq!(tokens.issued(), tokens.issued_by(grant), "{grant:?}: every token came from it");
    }
}

/// The double refuses what a token service did not issue, as BigQuery does.
#[test]
fn the_double_refuses_a_token_the_token_service_did_not_issue() {
    let tokens = TokenServer::start(TOKEN_LIFETIME).expect("starting the token double");
    let d = double();
    d.require_valid_token(tokens.validator());
    let job = TestJob::bigquery("bq-forged", &d.address(), TABLE, 100, 1, 100);
    let forged = job.dir.path().join("token.txt");
    std::fs::write(&forged, "ya29.forged\n").expect("token file");
    let err = job
        .run_with(&[&format!("sink.grpc.bigquery.token_file={}", forged.display())], None)
        .expect_err("a forged token is refused")
        .to_string();
    assert!(err.contains("UNAUTHENTICATED"), "{err}");
    assert!(d.unauthenticated() > 0);
    assert_eq!(d.visible_count(TABLE), 0);
}

/// `POST /token` on the token double, form-encoded, over plain HTTP/1.1:
/// the status and body.
fn post_token(tokens: &TokenServer, form: &[(&str, &str)]) -> (u16, String) {
    use std::io::{Read as _, Write as _};
    let encode = |s: &str| s.replace('%', "%25").replace(':', "%3A").replace('+', "%2B").replace('/', "%2F");
    let body: Vec<String> = form.iter().map(|(k, v)| format!("{k}={}", encode(v))).collect();
    let body = body.join("&");
    let mut stream = std::net::TcpStream::connect(tokens.host()).expect("connecting to the token double");
    let request = format!(
        "POST /token HTTP/1.1\r\nHost: {}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: \
         {}\r\nConnection: close\r\n\r\n{body}",
        tokens.host(),
        body.len()
    );
    stream.write_all(request.as_bytes()).expect("sending");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reading");
    let status = reply.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("a status line");
    let body = reply.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// The token double's JWT-bearer grant checks what Google's does: a
/// signature by the registered key over the very header and claims sent,
/// `aud`, the assertion's lifetime, the account and the scope.
#[test]
fn the_token_double_verifies_jwt_assertions() {
    use base64::Engine as _;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    let tokens = token_double(TOKEN_LIFETIME);
    let der = {
        let body: String = TEST_ONLY_PRIVATE_KEY_PEM.lines().filter(|l| !l.starts_with("-----")).collect();
        STANDARD.decode(body).expect("PEM body")
    };
    let key = ring::signature::RsaKeyPair::from_pkcs8(&der).expect("the TEST-ONLY key");
    let b64 = |v: serde_json::Value| URL_SAFE_NO_PAD.encode(v.to_string());
    let sign = |input: &str| {
        let mut signature = vec![0; key.public().modulus_len()];
        key.sign(
            &ring::signature::RSA_PKCS1_SHA256,
            &ring::rand::SystemRandom::new(),
            input.as_bytes(),
            &mut signature,
        )
        .expect("signing");
        URL_SAFE_NO_PAD.encode(signature)
    };
    let header = b64(serde_json::json!({"alg": "RS256", "typ": "JWT"}));
    let now = unix_now();
    let claims = |iss: &str, aud: &str, scope: &str, iat: u64, exp: u64| {
        b64(serde_json::json!({"iss": iss, "aud": aud, "scope": scope, "iat": iat, "exp": exp}))
    };
    let signed = |claims: &str| format!("{header}.{claims}.{}", sign(&format!("{header}.{claims}")));
    let good = claims(SERVICE_ACCOUNT, &tokens.token_uri(), CLOUD_PLATFORM, now, now + 3600);
    let ask = |assertion: &str| post_token(&tokens, &[("grant_type", JWT_BEARER), ("assertion", assertion)]);

    let (status, body) = ask(&signed(&good));
    assert_eq!(status, 200, "{body}");
    let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(reply["token_type"], "Bearer");
    assert_eq!(reply["expires_in"], 2, "2.5 s, rounded down");
    assert!((tokens.validator())(reply["access_token"].as_str().expect("a token")));

    // Claims changed after signing: the signature no longer holds.
    let other_scope =
        claims(SERVICE_ACCOUNT, &tokens.token_uri(), "https://www.googleapis.com/auth/admin", now, now + 3600);
    let tampered = format!("{header}.{other_scope}.{}", sign(&format!("{header}.{good}")));
    for (assertion, status, error) in [
        (tampered, 400, "invalid_grant: Invalid JWT Signature."),
        (
            signed(&claims(SERVICE_ACCOUNT, "https://oauth2.googleapis.com/token", CLOUD_PLATFORM, now, now + 3600)),
            400,
            "invalid_grant: Invalid JWT: Failed audience check",
        ),
        (
            signed(&claims(SERVICE_ACCOUNT, &tokens.token_uri(), CLOUD_PLATFORM, now, now + 7200)),
            400,
            "invalid_grant: Invalid JWT: Token must be a short-lived token (60 minutes)",
        ),
        (
            signed(&claims(SERVICE_ACCOUNT, &tokens.token_uri(), CLOUD_PLATFORM, now - 7200, now - 3600)),
            400,
            "invalid_grant: Invalid JWT: Token must be a short-lived token",
        ),
        (
            signed(&claims(
                "nobody@sluice-test.iam.gserviceaccount.com",
                &tokens.token_uri(),
                CLOUD_PLATFORM,
                now,
                now + 3600,
            )),
            400,
            "invalid_grant: Invalid grant: account not found",
        ),
        (signed(&claims(SERVICE_ACCOUNT, &tokens.token_uri(), "", now, now + 3600)), 400, "invalid_scope"),
        ("not-a-jwt".to_string(), 400, "invalid_grant: Invalid JWT"),
    ] {
        let (got, body) = ask(&assertion);
        assert_eq!(got, status, "{error}: {body}");
        let reply: serde_json::Value = serde_json::from_str(&body).expect("an OAuth error");
        let said =
            format!("{}: {}", reply["error"].as_str().unwrap_or(""), reply["error_description"].as_str().unwrap_or(""));
        assert!(said.starts_with(error), "expected {error:?}, got {said:?}");
    }
    assert_eq!(tokens.issued_by(Grant::JwtBearer), 1, "only the good assertion got a token");

    // The refresh-token grant: a known user, a wrong secret, a revoked token.
    let refresh = |secret: &str, token: &str| {
        post_token(
            &tokens,
            &[
                ("grant_type", "refresh_token"),
                ("client_id", CLIENT_ID),
                ("client_secret", secret),
                ("refresh_token", token),
            ],
        )
    };
    assert_eq!(refresh(CLIENT_SECRET, REFRESH_TOKEN).0, 200);
    let (status, body) = refresh("wrong", REFRESH_TOKEN);
    assert!(status == 401 && body.contains("invalid_client"), "{status} {body}");
    let (status, body) = refresh(CLIENT_SECRET, "1//revoked");
    assert!(status == 400 && body.contains("Token has been expired or revoked."), "{status} {body}");
    let (status, body) = post_token(&tokens, &[("grant_type", "password")]);
    assert!(status == 400 && body.contains("unsupported_grant_type"), "{status} {body}");
}

/// Both `sluice check` and `sluice run` fail with `adc` before anything is
/// written, and say each of `parts`.
fn refused_before_anything_is_written(
    what: &str,
    job: &TestJob,
    d: &BigQueryDouble,
    adc: &Adc,
    parts: &[&str],
) -> String {
    let mut last = String::new();
    for command in ["check", "run"] {
        let args: &[&str] =
            if command == "run" { &["run", "job.toml", "--progress", "plain"] } else { &["check", "job.toml"] };
        let (out, took) = sluice(job, args, adc);
        let log = text(&out);
        assert!(!out.status.success(), "{what}: {command} fails:\n{log}");
        for part in ["sink.grpc.bigquery.auth: Application Default Credentials: "].iter().chain(parts) {
            assert!(log.contains(part), "{what}: {command}: the error names {part:?}:\n{log}");
        }
        for secret in [CLIENT_SECRET, REFRESH_TOKEN, "1//revoked", "PRIVATE KEY"] {
            assert!(!log.contains(secret), "{what}: {command}: a secret is printed:\n{log}");
        }
        assert!(took < Duration::from_secs(40), "{what}: {command} fails within the first token's timeout: {took:?}");
        eprintln!("{what}, sluice {command}:\n{log}");
        last = log;
    }
    assert_eq!(d.calls(Rpc::CreateWriteStream), 0, "{what}: no stream was created");
    assert_eq!(d.calls(Rpc::Append), 0, "{what}: nothing was appended");
    assert_eq!(d.visible_count(TABLE), 0, "{what}: nothing is visible");
    last
}

/// Credentials that cannot be obtained stop `sluice check` and `sluice run`
/// before anything is written, naming the source tried (the file, the
/// token endpoint, the metadata server) and what to do; the metadata
/// server is never asked instead.
#[test]
fn credentials_that_cannot_be_obtained_stop_check_and_run_before_anything_is_written() {
    let tokens = token_double(TOKEN_LIFETIME);
    let d = double();
    let job = google_job("bq-bad-adc", &d, 1_000, 1, 500);
    let dir = tempfile::tempdir().expect("file dir");

    let missing = dir.path().join("missing.json");
    refused_before_anything_is_written(
        "a missing file",
        &job,
        &d,
        &Adc::file(&job, &missing, &tokens),
        &[
            &format!(
                "the file {} (GOOGLE_APPLICATION_CREDENTIALS): cannot read the file: No such file",
                missing.display()
            ),
            "point GOOGLE_APPLICATION_CREDENTIALS at a readable service-account key file",
        ],
    );

    let malformed = dir.path().join("malformed.json");
    std::fs::write(&malformed, "{\"type\": \"service_account\", ").expect("writing");
    refused_before_anything_is_written(
        "malformed JSON",
        &job,
        &d,
        &Adc::file(&job, &malformed, &tokens),
        &[
            &format!(
                "the file {} (GOOGLE_APPLICATION_CREDENTIALS): the file is not JSON: EOF while parsing",
                malformed.display()
            ),
            "point GOOGLE_APPLICATION_CREDENTIALS at a readable service-account key file",
        ],
    );

    // A key of an account the token endpoint does not know (deleted).
    let keys = tempfile::tempdir().expect("key dir");
    let unknown = tokens.service_account_file(keys.path(), "deleted@sluice-test.iam.gserviceaccount.com");
    refused_before_anything_is_written(
        "a service account the token endpoint refuses",
        &job,
        &d,
        &Adc::file(&job, &unknown, &tokens),
        &[
            &format!("the file {} (GOOGLE_APPLICATION_CREDENTIALS)", unknown.display()),
            &format!(
                "the token endpoint {} refused the service account deleted@sluice-test.iam.gserviceaccount.com's \
                 JWT assertion: 400 Bad Request: invalid_grant: Invalid grant: account not found",
                tokens.token_uri()
            ),
            "create a new key (`gcloud iam service-accounts keys create --iam-account \
             deleted@sluice-test.iam.gserviceaccount.com`) and point GOOGLE_APPLICATION_CREDENTIALS at it",
        ],
    );

    // A refresh token that was revoked.
    let revoked = dir.path().join("revoked-user.json");
    tokens.authorized_user_file(&revoked, CLIENT_ID, CLIENT_SECRET, "1//revoked");
    refused_before_anything_is_written(
        "a revoked refresh token",
        &job,
        &d,
        &Adc::file(&job, &revoked, &tokens),
        &[
            &format!("the file {} (GOOGLE_APPLICATION_CREDENTIALS)", revoked.display()),
            &format!(
                "the token endpoint {} refused the authorized user of OAuth client {CLIENT_ID}'s refresh token: 400 \
                 Bad Request: invalid_grant: Token has been expired or revoked.",
                tokens.token_uri()
            ),
            "the refresh token has expired or was revoked: run `gcloud auth application-default login` again",
        ],
    );

    // The same revoked file as gcloud's ADC file.
    let config = tempfile::tempdir().expect("CLOUDSDK_CONFIG");
    let adc_file = config.path().join("application_default_credentials.json");
    tokens.authorized_user_file(&adc_file, CLIENT_ID, CLIENT_SECRET, "1//revoked");
    let adc = Adc { cloudsdk_config: Some(config.path().to_path_buf()), ..Adc::metadata(&job, &tokens.host()) };
    refused_before_anything_is_written(
        "a revoked refresh token in gcloud's ADC file",
        &job,
        &d,
        &adc,
        &[
            &format!("gcloud's ADC file {}", adc_file.display()),
            "Token has been expired or revoked.",
            "run `gcloud auth application-default login` again",
        ],
    );

    assert_eq!(tokens.issued(), 0, "no token was issued");
    assert_eq!(tokens.issued_by(Grant::Metadata), 0, "the metadata server was never asked instead");
    assert_eq!(tokens.refused(), 0);
}

/// No metadata server: the run stops before anything is written, naming the
/// source it tried and what to do.
#[test]
fn an_unreachable_metadata_server_stops_check_and_run_before_anything_is_written() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    let host = closed.local_addr().expect("its address").to_string();
    drop(closed);
    let d = double();
    let job = google_job("bq-no-mds", &d, 1_000, 1, 500);
    refused_before_anything_is_written(
        "no metadata server",
        &job,
        &d,
        &Adc::metadata(&job, &host),
        &[
            &format!("the metadata server http://{host}/computeMetadata/v1/instance/service-accounts/default/token"),
            "set GOOGLE_APPLICATION_CREDENTIALS",
            "gcloud auth application-default login",
        ],
    );
}

/// `auth` and a static token together are refused at load, naming the key.
#[test]
fn auth_and_a_static_token_together_are_refused_at_load() {
    let d = double();
    let job = google_job("bq-both", &d, 100, 1, 100);
    for (set, given) in [
        ("sink.grpc.bigquery.token_env=SOME_VAR", "token_env"),
        ("sink.http.bigquery.token_file=token.txt", "token_file"),
    ] {
        let err = job.load(&[set]).expect_err("both are refused").to_string();
        let section = if given == "token_env" { "grpc" } else { "http" };
        assert!(err.contains(&format!("key `sink.{section}.bigquery.auth`")), "{err}");
        assert!(err.contains(&format!("remove `{given}`")), "{err}");
    }
    // Either one alone loads.
    let job = job.load(&[]).expect("auth alone loads");
    assert!(job.endpoints["bigquery"].google_auth && job.endpoints["bigquery"].token.is_none());
    assert!(job.http_endpoints["bigquery"].google_auth);
}
