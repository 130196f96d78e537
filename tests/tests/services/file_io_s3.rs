//! The `file-io` capability on an S3 grant, against moto's S3 server on
//! 127.0.0.1 (`sluice_tests::store_servers`), through the host's in-process
//! API (`sluice::capability::file_io::FileGrants`, the same code the WIT
//! interface calls): exclusive creates, streaming multipart uploads, ranged
//! reads, one-level lists, stat, delete, the refused rename, and locations
//! outside the grant refused before any request reaches the server. And
//! once through a real plugin: the `sluice` binary runs the chaos plugin's
//! `file-io-probe` against an `s3://` grant, with the credentials, region
//! and endpoint only in the host process's environment (the AWS chain).
//! And each part's own settings (`[sink.s3]`, `[job.s3]`, `[source.s3]`)
//! reaching moto while that environment points nowhere.

use sluice::bindings::v0_2::sluice::connector::file_io::IoError;
use sluice::capability::file_io::{FileGrants, StoreConfig};
use sluice::source::generator::Generator;
use sluice_store::{ObjectStore, S3Credentials, S3Options};
use sluice_tests::harness::block;
use sluice_tests::store_servers::{self as moto, Moto};
use sluice_tests::{TestJob, sluice_run};

fn s3_options(server: &Moto) -> S3Options {
    S3Options {
        region: Some(moto::REGION.to_string()),
        endpoint: Some(server.endpoint.clone()),
        credentials: Some(S3Credentials {
            access_key_id: moto::ACCESS_KEY_ID.to_string(),
            secret_access_key: moto::SECRET_ACCESS_KEY.to_string(),
            session_token: None,
        }),
        virtual_host_style: false,
    }
}

fn grants(server: &Moto, rw: &[&str], ro: &[&str]) -> FileGrants {
    let stores = StoreConfig { s3: s3_options(server), gcs: Default::default() };
    let rw: Vec<String> = rw.iter().map(|s| s.to_string()).collect();
    let ro: Vec<String> = ro.iter().map(|s| s.to_string()).collect();
    let base = tempfile::tempdir().expect("base dir");
    FileGrants::with_stores(base.path(), &rw, &ro, &stores).expect("S3 grants")
}

#[test]
fn whole_files_are_created_exclusively_read_listed_and_deleted() {
    let server = Moto::start(&["lake"]);
    let g = grants(&server, &["s3://lake/wh"], &[]);

    g.write_file("s3://lake/wh/t/a.parquet", b"first", false).expect("first create");
    let err = g.write_file("s3://lake/wh/t/a.parquet", b"second", false).expect_err("taken");
    assert!(matches!(&err, IoError::AlreadyExists(u) if u == "s3://lake/wh/t/a.parquet"), "{err:?}");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 0, 100).expect("read"), b"first", "the first stays");
    g.write_file("s3://lake/wh/t/a.parquet", b"replaced", true).expect("overwrite");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 2, 3).expect("ranged read"), b"pla");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 6, 100).expect("read to the end"), b"ed");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 100, 5).expect("read past the end"), b"");

    g.write_file("s3://lake/wh/t/b", b"bb", false).expect("create");
    g.write_file("s3://lake/wh/t/sub/c", b"ccc", false).expect("create");
    g.write_file("s3://lake/wh/t-other/d", b"d", false).expect("create");
    g.create_dir_all("s3://lake/wh/t/empty").expect("a folder needs no request");
    assert_eq!(g.list_dir("s3://lake/wh/t").expect("list"), vec!["a.parquet", "b", "sub"], "one level, not t-other");
    assert_eq!(g.list_dir("s3://lake/wh").expect("list root"), vec!["t", "t-other"]);
    assert!(matches!(g.list_dir("s3://lake/wh/nothing"), Err(IoError::NotFound(_))));

    let file = g.stat("s3://lake/wh/t/b").expect("stat a file");
    assert_eq!((file.size, file.is_dir), (2, false));
    let dir = g.stat("s3://lake/wh/t/sub").expect("stat a folder");
    assert_eq!((dir.size, dir.is_dir), (0, true));
    assert!(matches!(g.stat("s3://lake/wh/t/missing"), Err(IoError::NotFound(_))));
    assert!(g.exists("s3://lake/wh/t/sub").expect("exists"));
    assert!(g.exists("s3://lake/wh").expect("the root exists"));
    assert!(!g.exists("s3://lake/wh/t/su").expect("a prefix of a name is not a folder"));

    let err = g.rename("s3://lake/wh/t/b", "s3://lake/wh/t/b2").expect_err("no rename on S3");
    assert!(matches!(&err, IoError::Other(m) if m.contains("cannot rename on an object store")), "{err:?}");
    assert!(g.exists("s3://lake/wh/t/b").expect("exists"), "the refused rename changed nothing");

    g.delete("s3://lake/wh/t/b").expect("delete a file");
    assert!(matches!(g.delete("s3://lake/wh/t/b"), Err(IoError::NotFound(_))));
    g.delete("s3://lake/wh/t").expect("delete a folder");
    assert!(!g.exists("s3://lake/wh/t").expect("exists"));
    assert_eq!(g.list_dir("s3://lake/wh").expect("list root"), vec!["t-other"], "t-other is not inside t");
}

#[test]
fn output_files_stream_a_multipart_upload_created_exclusively() {
    let server = Moto::start(&["lake"]);
    let g = grants(&server, &["s3://lake/wh"], &[]);
    // 20 MiB in 1 MiB writes: three parts of 8 MiB at most.
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut out = g.create_output("s3://lake/wh/big.bin", false).expect("create");
    for _ in 0..20 {
        out.write(chunk.clone()).expect("write");
    }
    assert!(!g.exists("s3://lake/wh/big.bin").expect("exists"), "nothing is visible before finish");
    out.finish().expect("finish");
    assert_eq!(g.stat("s3://lake/wh/big.bin").expect("stat").size, 20 << 20);
    let tail = g.read("s3://lake/wh/big.bin", (20 << 20) - 3, 10).expect("read the tail");
    assert_eq!(tail, chunk[chunk.len() - 3..]);
    let log = server.log();
    assert!(log.contains("uploadId="), "a multipart upload: {log}");

    // A second exclusive create of the same key: refused, the first stays.
    let mut again = g.create_output("s3://lake/wh/big.bin", false).expect("create");
    let result = again.write(b"small".to_vec()).and_then(|()| again.finish());
    assert!(matches!(&result, Err(IoError::AlreadyExists(u)) if u == "s3://lake/wh/big.bin"), "{result:?}");
    assert_eq!(g.stat("s3://lake/wh/big.bin").expect("stat").size, 20 << 20);

    // Overwriting is allowed when asked for.
    let mut replace = g.create_output("s3://lake/wh/big.bin", true).expect("create");
    replace.write(b"small".to_vec()).expect("write");
    replace.finish().expect("finish");
    assert_eq!(g.read("s3://lake/wh/big.bin", 0, 100).expect("read"), b"small");

    // Dropped unfinished: never visible.
    let mut dropped = g.create_output("s3://lake/wh/partial.bin", false).expect("create");
    dropped.write(chunk.clone()).expect("write");
    drop(dropped);
    assert!(matches!(g.stat("s3://lake/wh/partial.bin"), Err(IoError::NotFound(_))));
}

#[test]
fn locations_outside_the_grant_never_reach_the_server() {
    let server = Moto::start(&["lake", "other"]);
    let g = grants(&server, &["s3://lake/wh"], &["s3://lake/ro"]);
    g.write_file("s3://lake/wh/inside", b"x", false).expect("inside");
    for location in [
        "s3://lake/wh-other/escape",
        "s3://other/wh/escape",
        "s3://lake/wh/../escape",
        "s3://lake/wh/%2e%2e/escape",
        "s3://lake/wh%2Fescape",
        "gs://lake/wh/escape",
    ] {
        let err = g.write_file(location, b"x", true).expect_err("outside");
        assert!(matches!(&err, IoError::Denied(_)), "{location}: {err:?}");
        assert!(matches!(g.read(location, 0, 1), Err(IoError::Denied(_))), "{location}");
    }
    let err = g.write_file("s3://lake/ro/x", b"x", false).expect_err("read-only");
    assert!(matches!(&err, IoError::Denied(m) if m.contains("read-only")), "{err:?}");
    let log = server.log();
    assert!(log.contains("/lake/wh/inside"), "the server logs each request: {log}");
    assert!(!log.contains("escape") && !log.contains("/lake/ro/x"), "a refused location was sent: {log}");
}

#[test]
fn a_plugin_drives_file_io_on_s3_through_the_host() {
    let server = Moto::start(&["lake"]);
    let job = TestJob::chaos("fileio-s3", 20, 1, 10, "file-io-probe", "open");
    let set_refs = [
        "sink.options.target=s3://lake/wh",
        r#"sink.grants.locations=["journal", "s3://lake/wh"]"#,
        "sink.sandbox.call_timeout_secs=120",
    ];
    // Writes job.toml; the s3:// grant passes the job's checks.
    job.load(&set_refs).expect("the job loads with an s3:// grant");
    let sets: Vec<String> = set_refs.map(String::from).to_vec();
    let no_files = job.dir.path().join("no-aws-files");
    let out = sluice_run(&job, &sets)
        .env("AWS_ENDPOINT_URL", &server.endpoint)
        .env("AWS_REGION", moto::REGION)
        .env("AWS_ACCESS_KEY_ID", moto::ACCESS_KEY_ID)
        .env("AWS_SECRET_ACCESS_KEY", moto::SECRET_ACCESS_KEY)
        .env("AWS_CONFIG_FILE", &no_files)
        .env("AWS_SHARED_CREDENTIALS_FILE", &no_files)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .output()
        .expect("running sluice");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the probe found wrong answers, or the run failed:\n{stderr}");

    // What the plugin wrote is in the bucket, as it wrote it.
    let s3 = ObjectStore::s3("lake", &s3_options(&server)).expect("store");
    block(async {
        assert_eq!(s3.read("wh/probe/a.txt").await.expect("a.txt"), &b"first"[..], "the exclusive create held");
        assert_eq!(s3.stat("wh/probe/big.bin").await.expect("big.bin").size, 10 << 20);
        let keys: Vec<String> = s3.list("").await.expect("list").into_iter().map(|o| o.key).collect();
        assert_eq!(keys, ["wh/probe/a.txt", "wh/probe/big.bin"], "no rename and no write outside the grant");
    });
}

/// Runs `sluice run` with the AWS environment pointing nowhere: its
/// `AWS_ENDPOINT_URL` at a port nothing listens on, no `AWS_*` key, no
/// config files; and, `with_keys`, the job's own key variables set.
fn run_without_aws_env(job: &TestJob, sets: &[String], with_keys: bool) -> std::process::Output {
    let no_files = job.dir.path().join("no-aws-files");
    let mut cmd = sluice_run(job, sets);
    for var in ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_PROFILE"] {
        cmd.env_remove(var);
    }
    cmd.env("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        .env("AWS_CONFIG_FILE", &no_files)
        .env("AWS_SHARED_CREDENTIALS_FILE", &no_files)
        .env("AWS_EC2_METADATA_DISABLED", "true");
    if with_keys {
        cmd.env("LAKE_KEY_ID", moto::ACCESS_KEY_ID).env("LAKE_SECRET", moto::SECRET_ACCESS_KEY);
    }
    cmd.output().expect("running sluice")
}

/// `--set`s for `[<part>.s3]` pointing at `server`, with keys named by the
/// variables `LAKE_KEY_ID` and `LAKE_SECRET`.
fn own_s3(part: &str, server: &Moto) -> Vec<String> {
    vec![
        format!("{part}.s3.endpoint=\"{}\"", server.endpoint),
        format!("{part}.s3.region={}", moto::REGION),
        format!("{part}.s3.access_key_id_env=LAKE_KEY_ID"),
        format!("{part}.s3.secret_access_key_env=LAKE_SECRET"),
    ]
}

/// `[sink.s3]` reaches the sink's grant without the AWS environment: only
/// the job's own settings can have reached moto.
#[test]
fn the_sinks_own_s3_settings_win_over_the_aws_environment() {
    let server = Moto::start(&["lake"]);
    let job = TestJob::chaos("fileio-s3-own", 20, 1, 10, "file-io-probe", "open");
    let mut sets: Vec<String> = [
        "sink.options.target=s3://lake/wh",
        r#"sink.grants.locations=["journal", "s3://lake/wh"]"#,
        "sink.sandbox.call_timeout_secs=120",
    ]
    .map(String::from)
    .to_vec();
    sets.extend(own_s3("sink", &server));
    std::fs::write(job.path(), &job.toml).expect("job file");

    // A key variable that is not set is refused by name, before anything is written.
    let out = run_without_aws_env(&job, &sets, false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("sink.s3.access_key_id_env") && stderr.contains("LAKE_KEY_ID, which is not set"),
        "{stderr}"
    );
    // An inline secret is not a key the job file takes.
    let mut inline = sets.clone();
    inline.push("sink.s3.secret_access_key=oops".into());
    let out = run_without_aws_env(&job, &inline, true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("unknown field `secret_access_key`"), "{stderr}");

    let out = run_without_aws_env(&job, &sets, true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the probe found wrong answers, or the run failed:\n{stderr}");
    let lake = ObjectStore::s3("lake", &s3_options(&server)).expect("store");
    let read = block(lake.read("wh/probe/a.txt")).expect("a.txt");
    assert_eq!(read, &b"first"[..], "the plugin wrote through the sink's own settings");
}

/// `[job.s3]` reaches the state directory without the AWS environment.
#[test]
fn the_state_directorys_own_s3_settings_win_over_the_aws_environment() {
    let server = Moto::start(&["state"]);
    let job = TestJob::files("state-s3-own", 2_000, 2, 500);
    let mut sets = vec!["job.state_dir=s3://state/own".to_string()];
    sets.extend(own_s3("job", &server));
    std::fs::write(job.path(), &job.toml).expect("job file");
    let out = run_without_aws_env(&job, &sets, true);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    sluice_tests::assert_exactly_once(&sluice_tests::read_visible(&job.out()), 2_000);
    let state = ObjectStore::s3("state", &s3_options(&server)).expect("store");
    let keys: Vec<String> = block(state.list("own")).expect("list").into_iter().map(|o| o.key).collect();
    assert!(keys.contains(&"own/lease".to_string()), "the state directory is on S3: {keys:?}");
    assert!(keys.iter().any(|k| k.contains("/checkpoints/chk-")), "{keys:?}");
    assert!(!job.state().exists(), "nothing went to a local state directory");
}

/// Parquet bytes of the generator's rows `first..end`.
fn generator_parquet(first: u64, end: u64) -> Vec<u8> {
    let batch = Generator::batch_for(first, end);
    let mut bytes = Vec::new();
    let mut writer = parquet::arrow::ArrowWriter::try_new(&mut bytes, batch.schema(), None).expect("writer");
    writer.write(&batch).expect("write");
    writer.close().expect("close");
    bytes
}

/// `[source.s3]` reaches the file source's input without the AWS
/// environment: the source on `s3://exports/events` (three Parquet objects of
/// the generator's rows) lands every row once in a local files sink, and
/// without those settings the run stops before reading, naming the source.
#[test]
fn the_sources_own_s3_settings_win_over_the_aws_environment() {
    const ROWS: u64 = 3_000;
    let server = Moto::start(&["exports"]);
    let input = ObjectStore::s3("exports", &s3_options(&server)).expect("store");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    for k in 0..3 {
        let bytes = generator_parquet(k * 1000, (k + 1) * 1000);
        rt.block_on(input.create_exclusive(&format!("events/part-{k}.parquet"), bytes.into())).expect("put");
    }
    let dir = tempfile::tempdir().expect("dir");
    let plugin = sluice_tests::FILES_PLUGIN;
    let toml = format!(
        r#"[job]
id = "source-s3-own"
parallelism = 2
state_dir = "state"
[job.checkpoint]
every_rows = 500
[source]
kind = "file"
path = "s3://exports/events"
batch_rows = 200
[sink]
id = "out"
plugin = "{plugin}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#
    );
    let job = TestJob { dir, toml };
    std::fs::write(job.path(), &job.toml).expect("job file");

    // Without `[source.s3]` the source is sought where the environment points: nowhere.
    let out = run_without_aws_env(&job, &[], true);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("source file s3://exports/events"), "the error names the source: {stderr}");
    assert_eq!(sluice_tests::read_visible(&job.out()).num_rows(), 0, "nothing landed");

    let sets = own_s3("source", &server);
    // A key variable that is not set is refused by name, before anything is read.
    let out = run_without_aws_env(&job, &sets, false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("source.s3.access_key_id_env") && stderr.contains("LAKE_KEY_ID, which is not set"),
        "{stderr}"
    );

    let out = run_without_aws_env(&job, &sets, true);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    sluice_tests::assert_exactly_once(&sluice_tests::read_visible(&job.out()), ROWS);
    assert!(server.log().contains("/exports/events"), "the rows came from moto: {}", server.log());
}
