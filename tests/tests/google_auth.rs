//! `auth = "google"`: the BigQuery plugin against the BigQuery double, with
//! Application Default Credentials from the metadata server's token
//! endpoint (the token double, `tests/src/token_server.rs`, found through
//! `GCE_METADATA_HOST`), whose tokens expire after 2.5 s. The double refuses
//! expired and unknown tokens as the real service does. Each run is a
//! `sluice run` process, so that its environment (`GCE_METADATA_HOST`, no
//! `GOOGLE_APPLICATION_CREDENTIALS`, a `HOME` without gcloud's ADC file) is
//! its own.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sluice_bigquery_double::{BigQueryDouble, Rpc, generator_schema};
use sluice_tests::token_server::TokenServer;
use sluice_tests::{TestJob, assert_exactly_once_range, bigquery_rows, sluice_run};

const TABLE: &str = "projects/p/datasets/d/tables/events";
/// How long the token double's tokens live: several renewals in a run.
const TOKEN_LIFETIME: Duration = Duration::from_millis(2500);

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

/// `sluice run` with ADC resolving to the metadata server at `metadata_host`.
fn run(job: &TestJob, metadata_host: &str) -> (Output, Duration) {
    std::fs::write(job.path(), &job.toml).expect("writing the job file");
    let mut cmd: Command = sluice_run(job, &[]);
    cmd.env("GCE_METADATA_HOST", metadata_host)
        .env_remove("GOOGLE_APPLICATION_CREDENTIALS")
        .env_remove("GOOGLE_CLOUD_QUOTA_PROJECT")
        // No gcloud ADC file here: ADC falls back to the metadata server.
        .env("HOME", job.dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().expect("running sluice");
    (out, start.elapsed())
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A run of over 20 s with tokens living 2.5 s: the host renews them ahead
/// of their expiry, no call is refused, and every row lands once.
#[test]
fn tokens_that_expire_every_few_seconds_are_renewed_for_a_long_run() {
    let tokens = TokenServer::start(TOKEN_LIFETIME).expect("starting the token double");
    let d = double();
    d.require_valid_token(tokens.validator());
    const ROWS: u64 = 22_000;
    let mut job = google_job("bq-google", &d, ROWS, 2, 1_000);
    // 1000 rows/s over both subtasks: 22 s.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    let (out, took) = run(&job, &tokens.host());
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert!(took >= Duration::from_secs(20), "the run lasted {took:?}, not long enough for renewals");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    assert_eq!(d.unauthenticated(), 0, "no call was refused for an expired token:\n{log}");
    // At least one token per lifetime over the run (more: each run's
    // grants open their own credentials).
    let least = (took.as_millis() / TOKEN_LIFETIME.as_millis()) as usize;
    assert!(tokens.issued() >= least, "{} tokens issued in {took:?}, expected at least {least}", tokens.issued());
    assert_eq!(tokens.refused(), 0, "every token request carried Metadata-Flavor: Google");
    assert!(d.calls(Rpc::FlushRows) >= 11, "checkpoints ran through the run: {}", d.calls(Rpc::FlushRows));
}

/// Tokens revoked mid-run are refused as UNAUTHENTICATED: the host renews
/// the token, sends a refused unary call once more and answers a refused
/// stream UNAVAILABLE, which the plugin retries; every row lands once.
#[test]
fn a_token_refused_mid_run_is_renewed_and_the_call_retried() {
    let tokens = TokenServer::start(Duration::from_secs(3600)).expect("starting the token double");
    let d = double();
    d.require_valid_token(tokens.validator());
    const ROWS: u64 = 8_000;
    let mut job = google_job("bq-revoked", &d, ROWS, 2, 500);
    // 1000 rows/s: 8 s, 16 checkpoints; revoked twice on the way.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
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
        run(&job, &tokens.host())
    });
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    assert!(d.unauthenticated() > 0, "revoked tokens were refused");
    assert!(tokens.issued() >= 3, "tokens were renewed after each revocation: {}", tokens.issued());
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

/// No metadata server: the run stops before anything is written, naming the
/// source it tried and what to do.
#[test]
fn an_unreachable_metadata_server_stops_the_run_before_anything_is_written() {
    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    let host = closed.local_addr().expect("its address").to_string();
    drop(closed);
    let d = double();
    let job = google_job("bq-no-mds", &d, 1_000, 1, 500);
    let (out, took) = run(&job, &host);
    let log = text(&out);
    assert!(!out.status.success(), "the run fails:\n{log}");
    for part in [
        "sink.grpc.bigquery.auth",
        "Application Default Credentials",
        &format!("the metadata server http://{host}/computeMetadata/v1/instance/service-accounts/default/token"),
        "set GOOGLE_APPLICATION_CREDENTIALS",
        "gcloud auth application-default login",
    ] {
        assert!(log.contains(part), "the error names {part:?}:\n{log}");
    }
    assert!(took < Duration::from_secs(40), "it fails within the first token's timeout: {took:?}");
    assert_eq!(d.calls(Rpc::CreateWriteStream), 0, "no stream was created");
    assert_eq!(d.calls(Rpc::Append), 0, "nothing was appended");
    assert_eq!(d.visible_count(TABLE), 0);
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
