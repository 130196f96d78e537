//! The Iceberg sink with a REST catalog that requires OAuth2 client
//! credentials (`credential_env` / `credential_file`), against the REST
//! double (`tests/src/rest_catalog.rs`) acting as its own token service:
//! its tokens live 2.5 s, and every catalog route answers 401 to a token it
//! did not issue or that expired, as the REST spec says. The host obtains
//! tokens at `/v1/oauth/tokens` (or `oauth2_server_uri`), refreshes them
//! ahead of `expires_in`, and on a refusal refreshes once and retries.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use sluice::config::{DEFAULT_OAUTH2_SCOPE, OAuth2Config, RestAuth, Secret};
use sluice_tests::rest_catalog::{OAuthClient, RestCatalogDouble};
use sluice_tests::{TestJob, assert_exactly_once_range, cache_dir, read_iceberg_rest_with, sluice_bin, sluice_run};

const TABLE: &str = "db.events";
const CLIENT_ID: &str = "sluice-writer";
const SECRET: &str = "s3cr3t-Zq9";
/// The variable the job names in `credential_env`.
const VAR: &str = "SLUICE_TEST_REST_CREDENTIAL";
/// How long the double's tokens live: several refreshes in a run.
const LIFETIME: Duration = Duration::from_millis(2500);

fn double(warehouse: &Path, lifetime: Duration) -> RestCatalogDouble {
    let client = OAuthClient { client_id: CLIENT_ID.into(), secret: SECRET.into(), lifetime };
    RestCatalogDouble::start_with_oauth(warehouse, client).expect("starting the REST double")
}

/// A generator → Iceberg job whose catalog is the REST catalog at `uri`,
/// with `auth` (TOML lines) in `[sink.catalog]`.
fn job(id: &str, uri: &str, warehouse: &Path, rows: u64, parallelism: u32, every: u64, auth: &str) -> TestJob {
    let mut job = TestJob::iceberg(id, warehouse, TABLE, rows, 0, parallelism, every);
    let sql = format!("database = \"{}/catalog.db\"", warehouse.display());
    assert!(job.toml.contains(&sql), "the Iceberg job names its SQLite catalog");
    job.toml = job.toml.replace(&sql, &format!("kind = \"rest\"\nuri = \"{uri}\"\n{auth}"));
    job
}

/// The credentials as the host's reader takes them.
fn oauth(uri: &str) -> RestAuth {
    RestAuth::OAuth2(OAuth2Config {
        credential: Secret::new(format!("{CLIENT_ID}:{SECRET}")),
        credential_source: "the test".into(),
        server_uri: format!("{uri}/v1/oauth/tokens"),
        scope: DEFAULT_OAUTH2_SCOPE.into(),
    })
}

/// `sluice <args>` in the job's directory with `VAR` set to `credential`
/// (or unset).
fn sluice(job: &TestJob, args: &[&str], credential: Option<&str>) -> Output {
    std::fs::write(job.path(), &job.toml).expect("writing the job file");
    let mut cmd = Command::new(sluice_bin());
    cmd.args(args)
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .env("NO_COLOR", "1")
        .env_remove(VAR)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(c) = credential {
        cmd.env(VAR, c);
    }
    cmd.output().expect("running sluice")
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// A run of over 20 s with tokens living 2.5 s (`expires_in: 2`): the host
/// refreshes each ahead of its expiry, the catalog refuses no request, and
/// every row lands once, read back through the catalog by the host's
/// reader and by PyIceberg's own OAuth2 client.
#[test]
fn tokens_that_expire_every_few_seconds_are_refreshed_through_a_long_run() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = double(warehouse.path(), LIFETIME);
    const ROWS: u64 = 22_000;
    let mut job =
        job("rest-oauth-long", &rest.uri(), warehouse.path(), ROWS, 2, 500, &format!("credential_env = \"{VAR}\""));
    // 1000 rows/s over both subtasks: 22 s, a checkpoint about every second.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    let mut cmd = sluice_run(&job, &[]);
    std::fs::write(job.path(), &job.toml).expect("writing the job file");
    cmd.env(VAR, format!("{CLIENT_ID}:{SECRET}")).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let out = cmd.output().expect("running sluice");
    let took = start.elapsed();
    let log = text(&out);
    assert!(out.status.success(), "the run succeeds:\n{log}");
    assert!(took >= Duration::from_secs(20), "the run lasted {took:?}, not long enough for refreshes");
    let stats = rest.auth_stats();
    eprintln!("{took:?}: {stats:?}, {:?} commits", rest.commits());
    assert_eq!(stats.unauthorized, 0, "no request was refused for a missing or expired token: {stats:?}\n{log}");
    assert_eq!(stats.token_refusals, 0, "{stats:?}");
    // At least one token per lifetime over the run (the host refreshes at
    // half of `expires_in`, so about twice as many).
    let least = (took.as_millis() / LIFETIME.as_millis()) as u64;
    assert!(stats.issued_spec >= least, "{} tokens issued in {took:?}, expected at least {least}", stats.issued_spec);
    let (commits, _) = rest.commits();
    assert!(commits >= 20, "checkpoints committed through the run: {commits}");
    assert!(stats.authorized > commits, "loads and commits all carried tokens: {stats:?}");

    let table = read_iceberg_rest_with(&rest.uri(), warehouse.path(), TABLE, Some(&oauth(&rest.uri())));
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();

    let out = sluice_tests::python(
        "import sys, json\n\
         from pyiceberg.catalog.rest import RestCatalog\n\
         t = RestCatalog('sluice', uri=sys.argv[1], credential=sys.argv[2]).load_table('db.events')\n\
         ids = sorted(t.scan().to_arrow().column('id').to_pylist())\n\
         print(json.dumps({'n': len(ids), 'distinct': len(set(ids)), 'min': ids[0], 'max': ids[-1]}))",
        &[&rest.uri(), &format!("{CLIENT_ID}:{SECRET}")],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it): {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    assert_eq!(v, serde_json::json!({"n": ROWS, "distinct": ROWS, "min": 0, "max": ROWS - 1}));
    assert_eq!(rest.auth_stats().unauthorized, 0, "PyIceberg's requests carried its token too");
}

/// Tokens revoked mid-run are refused with 401: the host obtains a new
/// token and makes the refused call once more (a commit included: a 401
/// was not applied), and every checkpoint lands once.
#[test]
fn a_token_refused_mid_run_is_refreshed_and_the_call_retried() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = double(warehouse.path(), Duration::from_secs(3600));
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("credential");
    std::fs::write(&file, format!("{CLIENT_ID}:{SECRET}\n")).expect("credential file");
    const ROWS: u64 = 8_000;
    let auth = format!("credential_file = \"{}\"", file.display());
    let mut job = job("rest-oauth-revoked", &rest.uri(), warehouse.path(), ROWS, 2, 500, &auth);
    // 1000 rows/s: 8 s, 8 checkpoints; revoked twice on the way.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    let run = std::thread::scope(|s| {
        s.spawn(|| {
            for at in [1, 4] {
                let start = Instant::now();
                while rest.commits().0 < at && start.elapsed() < Duration::from_secs(120) {
                    std::thread::sleep(Duration::from_millis(10));
                }
                rest.revoke_all();
            }
        });
        job.run(None)
    });
    run.expect("the run succeeds");
    let stats = rest.auth_stats();
    assert!(stats.unauthorized >= 2, "revoked tokens were refused: {stats:?}");
    assert!(stats.issued_spec >= 3, "a token was obtained after each revocation: {stats:?}");
    let table = read_iceberg_rest_with(&rest.uri(), warehouse.path(), TABLE, Some(&oauth(&rest.uri())));
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
}

/// The token service goes down mid-run: the host keeps its token while it
/// is valid, then the run stops, having committed only whole checkpoints.
/// Once the service is back, the next run resumes, and every row lands
/// once, no checkpoint twice.
#[test]
fn a_token_service_down_mid_run_stops_the_job_resumably() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = double(warehouse.path(), LIFETIME);
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("credential");
    std::fs::write(&file, format!("{CLIENT_ID}:{SECRET}")).expect("credential file");
    const ROWS: u64 = 8_000;
    let auth = format!("credential_file = \"{}\"", file.display());
    let mut job = job("rest-oauth-down", &rest.uri(), warehouse.path(), ROWS, 2, 500, &auth);
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    let sets = ["job.commit.max_attempts=3", "job.commit.initial_backoff_ms=50"];
    let first = std::thread::scope(|s| {
        s.spawn(|| {
            let start = Instant::now();
            while rest.commits().0 < 2 && start.elapsed() < Duration::from_secs(120) {
                std::thread::sleep(Duration::from_millis(10));
            }
            rest.tokens_down(true);
        });
        job.run_with(&sets, None)
    });
    let err = first.expect_err("the run stops once its token expired").to_string();
    eprintln!("the first run: {err}");
    assert!(err.contains("cannot obtain an OAuth2 token") && err.contains("503"), "{err}");
    let (before, _) = rest.commits();
    assert!(before >= 2, "{before} commits before the token service went down");
    rest.tokens_down(false);
    job.run_with(&sets, None).expect("the next run resumes");
    let table = read_iceberg_rest_with(&rest.uri(), warehouse.path(), TABLE, Some(&oauth(&rest.uri())));
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert_eq!(rest.auth_stats().unauthorized, 0, "no request went out with an expired token");
}

/// `oauth2_server_uri` names another token endpoint (an identity
/// provider's): tokens come from there, none from the catalog's own.
#[test]
fn oauth2_server_uri_names_the_token_endpoint() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = double(warehouse.path(), LIFETIME);
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("credential");
    std::fs::write(&file, format!("{CLIENT_ID}:{SECRET}")).expect("credential file");
    let auth = format!(
        "credential_file = \"{}\"\noauth2_server_uri = \"{}/idp/token\"\nscope = \"catalog\"",
        file.display(),
        rest.uri()
    );
    let job = job("rest-oauth-idp", &rest.uri(), warehouse.path(), 3_000, 2, 500, &auth);
    job.run(None).expect("the run succeeds");
    let stats = rest.auth_stats();
    assert!(stats.issued_idp >= 1, "{stats:?}");
    assert_eq!(stats.issued_spec, 0, "no token from /v1/oauth/tokens: {stats:?}");
    assert_eq!(stats.unauthorized, 0, "{stats:?}");
    let table = read_iceberg_rest_with(&rest.uri(), warehouse.path(), TABLE, Some(&oauth(&rest.uri())));
    assert_exactly_once_range(&table.rows, 0, 3_000);
}

/// A credential that cannot be used stops `sluice check` and `sluice run`
/// before anything is written, naming the token endpoint, where the
/// credential was read and what to do.
#[test]
fn a_credential_that_cannot_be_used_stops_check_and_run_before_anything_is_written() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = double(warehouse.path(), LIFETIME);
    let endpoint = format!("{}/v1/oauth/tokens", rest.uri());
    let source = format!("the environment variable {VAR} (sink.catalog.credential_env)");
    let job =
        job("rest-oauth-bad", &rest.uri(), warehouse.path(), 1_000, 1, 500, &format!("credential_env = \"{VAR}\""));
    let wrong = format!("{CLIENT_ID}:not-the-secret");
    for command in ["check", "run"] {
        let out = sluice(&job, &[command, "job.toml"], Some(&wrong));
        let log = text(&out);
        assert!(!out.status.success(), "{command} fails:\n{log}");
        for part in [
            "key `sink.catalog`",
            &format!("cannot obtain an OAuth2 token from {endpoint} with the client credential in {source}"),
            "401 Unauthorized: invalid_client: unknown client or wrong secret",
            &format!("check the client id and secret in {source}"),
        ] {
            assert!(log.contains(part), "{command}: the error names {part:?}:\n{log}");
        }
        assert!(!log.contains("not-the-secret"), "the secret is never printed:\n{log}");
        eprintln!("sluice {command} with a wrong secret:\n{log}");
    }
    assert!(rest.auth_stats().token_refusals >= 2);

    // The variable is not set: refused at load, naming the key.
    for command in ["check", "run"] {
        let out = sluice(&job, &[command, "job.toml"], None);
        let log = text(&out);
        assert!(!out.status.success(), "{command} fails:\n{log}");
        let part = format!("key `sink.catalog.credential_env`: the environment variable {VAR} is not set");
        assert!(log.contains(&part), "{command}: the error names {part:?}:\n{log}");
    }

    // The token endpoint is down.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("binding a port");
    let down = format!("http://{}/oauth/token", closed.local_addr().expect("its address"));
    drop(closed);
    let good = format!("{CLIENT_ID}:{SECRET}");
    let out =
        sluice(&job, &["run", "job.toml", "--set", &format!("sink.catalog.oauth2_server_uri={down}")], Some(&good));
    let log = text(&out);
    assert!(!out.status.success(), "the run fails:\n{log}");
    for part in [
        &format!(
            "cannot obtain an OAuth2 token from {down} with the client credential in {source}: the request failed"
        ),
        "check that the token endpoint is reachable (sink.catalog.oauth2_server_uri",
    ] {
        assert!(log.contains(part), "the error names {part:?}:\n{log}");
    }

    // A scope the service does not grant.
    let out = sluice(&job, &["check", "job.toml", "--set", "sink.catalog.scope=admin"], Some(&good));
    let log = text(&out);
    assert!(!out.status.success(), "check fails:\n{log}");
    assert!(log.contains("400 Bad Request: invalid_scope") && log.contains("check sink.catalog.scope"), "{log}");

    // Nothing reached the catalog: no namespace, table or commit.
    assert_eq!(rest.commits(), (0, 0));
    assert_eq!(rest.auth_stats().authorized, 0, "no catalog request was made");
    assert!(std::fs::read_dir(warehouse.path()).expect("warehouse").next().is_none(), "nothing was written");
}

/// Keys that contradict each other are refused at load, naming the key.
#[test]
fn contradictory_catalog_credentials_are_refused_at_load() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = job("rest-oauth-keys", "http://127.0.0.1:9", warehouse.path(), 100, 1, 100, "");
    let cases: &[(&[&str], &str)] = &[
        (
            &["sink.catalog.credential_env=SOME_VAR", "sink.catalog.token_env=OTHER_VAR"],
            "key `sink.catalog.token_env`: OAuth2 client credentials obtain and refresh their own tokens",
        ),
        (
            &["sink.catalog.credential_env=SOME_VAR", "sink.catalog.credential_file=cred.txt"],
            "key `sink.catalog.credential_env`: set at most one of credential_env and credential_file",
        ),
        (&["sink.catalog.scope=catalog"], "key `sink.catalog.scope`: applies to OAuth2 client credentials only"),
        (
            &["sink.catalog.oauth2_server_uri=http://idp/token"],
            "key `sink.catalog.oauth2_server_uri`: applies to OAuth2 client credentials only",
        ),
        (&["sink.catalog.credential_file=missing.txt"], "key `sink.catalog.credential_file`: cannot read"),
    ];
    for (sets, expected) in cases {
        let err = job.load(sets).expect_err("refused").to_string();
        assert!(err.contains(expected), "{sets:?}: expected {expected:?} in {err}");
    }
    let dir = job.dir.path();
    std::fs::write(dir.join("cred.txt"), "id:secret\n").expect("credential file");
    let loaded = job
        .load(&["sink.catalog.credential_file=cred.txt", "sink.catalog.oauth2_server_uri=https://idp.example/token"])
        .expect("loads");
    match &loaded.catalog {
        Some(sluice::config::CatalogConfig::Rest { auth: Some(RestAuth::OAuth2(o)), .. }) => {
            assert_eq!(o.credential.expose(), "id:secret");
            assert_eq!(o.server_uri, "https://idp.example/token");
            assert_eq!(o.scope, "catalog");
            assert!(o.credential_source.contains("cred.txt (sink.catalog.credential_file)"), "{}", o.credential_source);
            assert!(!format!("{loaded:?}").contains("id:secret"), "Debug never shows the credential");
        }
        other => panic!("not OAuth2 credentials: {other:?}"),
    }
    let loaded = job.load(&["sink.catalog.credential_file=cred.txt"]).expect("loads");
    match &loaded.catalog {
        Some(sluice::config::CatalogConfig::Rest { auth: Some(RestAuth::OAuth2(o)), .. }) => {
            assert_eq!(o.server_uri, "http://127.0.0.1:9/v1/oauth/tokens", "the spec's endpoint by default");
        }
        other => panic!("not OAuth2 credentials: {other:?}"),
    }
}
