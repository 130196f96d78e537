//! The BigQuery sink, exactly once, against the Storage Write API test double
//! (`tests/bigquery-double`, real gRPC over loopback): the crash matrix, lost
//! append and flush replies, a replay batched differently, OUT_OF_RANGE,
//! row errors, schema checks, credentials and parallel writers. The visible
//! rows are read back and compared with the source by id and value.

use sluice::engine::{CrashPoint, Fault};
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::proto::{TableFieldSchema, TableSchema};
use sluice_bigquery_double::{BigQueryDouble, Fault as BqFault, Reflush, Rpc, generator_schema};
use sluice_tests::{TestJob, assert_exactly_once_range, bigquery_rows, ids, run_cli, run_example};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
const EVERY: u64 = 500;
const TABLE: &str = "projects/p/datasets/d/tables/events";

fn double() -> BigQueryDouble {
    let d = BigQueryDouble::start().expect("starting the BigQuery double");
    d.create_table(TABLE, generator_schema());
    d
}

fn job(id: &str, d: &BigQueryDouble) -> TestJob {
    TestJob::bigquery(id, &d.address(), TABLE, ROWS, PARALLELISM, EVERY)
}

fn visible_ids(d: &BigQueryDouble) -> Vec<i64> {
    ids(&bigquery_rows(&d.visible_rows(TABLE)))
}

fn assert_no_duplicates(d: &BigQueryDouble) {
    let got = visible_ids(d);
    let mut dedup = got.clone();
    dedup.dedup();
    assert_eq!(got.len(), dedup.len(), "duplicated ids are visible");
}

fn assert_landed_once(d: &BigQueryDouble) {
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
}

#[test]
fn parallel_writers_land_every_row_once_each_on_its_own_stream() {
    let d = double();
    let job = job("bq-happy", &d);
    let summary = job.run(None).expect("run");
    assert_eq!(summary.rows_total, ROWS);
    assert_landed_once(&d);
    assert_eq!(d.stats().streams_created, u64::from(PARALLELISM), "one BUFFERED stream per writer");
    // Each writer appends over its own connection, as separate clients
    // would: one shared connection paced every writer by one task's framing.
    let peers = d.append_peers();
    let distinct: std::collections::BTreeSet<_> = peers.iter().collect();
    assert_eq!(peers.len(), PARALLELISM as usize, "one AppendRows call per writer: {peers:?}");
    assert_eq!(distinct.len(), PARALLELISM as usize, "the writers shared a connection: {peers:?}");
    assert_eq!(d.invisible_count(TABLE), 0, "every appended row was flushed");
    assert_eq!(d.stats().already_exists, 0);
    // One flush per writer per non-empty checkpoint.
    assert_eq!(d.calls(Rpc::FlushRows), 4 * u64::from(PARALLELISM));
}

/// The crash matrix runs once for each way a service may answer a repeated
/// flush: recovery flushes the checkpoint named in the last record again.
fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    for reflush in Reflush::ALL {
        crash_then_recover_with(point, checkpoint, reflush);
    }
}

fn crash_then_recover_with(point: CrashPoint, checkpoint: u64, reflush: Reflush) {
    let d = double();
    d.answer_reflush(reflush);
    let job = job(&format!("bq-{point}-{checkpoint}"), &d);
    // The check `sluice plugin test` runs; then what this sink promises beyond it.
    let restored = sluice_conformance::crash_and_restore(&sluice_conformance::CrashCheck {
        fault: Fault { point, checkpoint, subtask: 1 },
        first_id: 0,
        rows: ROWS,
        run: &|fault| job.run(fault),
        visible: &|| Ok(visible_ids(&d)),
        may_not_happen: false,
    })
    .unwrap_or_else(|e| panic!("{reflush:?}: {e}"));
    let summary = restored.summary;
    assert_landed_once(&d);
    assert_eq!(summary.rows_total, ROWS);
    let recovered: Vec<u64> = summary.recovered.iter().map(|(c, _)| *c).collect();
    match point {
        CrashPoint::AfterPersist | CrashPoint::DuringCommit | CrashPoint::AfterCommit => {
            assert_eq!(recovered, vec![checkpoint], "recovery re-flushes the pending checkpoint")
        }
        _ if checkpoint == 1 => assert!(recovered.is_empty(), "nothing was pending: {recovered:?}"),
        _ => assert_eq!(recovered, vec![checkpoint - 1]),
    }
    // Rows the crashed run appended after its last checkpoint stay invisible.
    if matches!(point, CrashPoint::AfterWrite | CrashPoint::AfterPrepareCommit | CrashPoint::AfterSnapshotState) {
        assert!(d.invisible_count(TABLE) > 0, "the crashed run's unflushed rows exist and stay invisible");
    }
}

sluice_tests::crash_tests! {
    crash_after_write_first: CrashPoint::AfterWrite, 1;
    crash_after_write: CrashPoint::AfterWrite, 3;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 2;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit: CrashPoint::AfterCommit, 4;
}

#[test]
fn lost_append_replies_are_counted_not_resent() {
    let d = double();
    // Applied but the reply lost, twice; refused before applying, twice; a slow reply.
    d.inject(Rpc::Append, 2, BqFault::ApplyThenDropReply);
    d.inject(Rpc::Append, 5, BqFault::Unavailable);
    d.inject(Rpc::Append, 9, BqFault::ApplyThenDropReply);
    d.inject(Rpc::Append, 12, BqFault::FailBeforeApply);
    d.inject(Rpc::Append, 15, BqFault::Delay(std::time::Duration::from_millis(300)));
    let job = job("bq-lost-append", &d);
    job.run(None).expect("the writers retry through lost replies");
    assert_landed_once(&d);
    // Each lost reply is answered ALREADY_EXISTS when its request is resent. (A
    // fault may land on a resend, which then fails differently: hence 1..=2.)
    let already = d.stats().already_exists;
    assert!((1..=2).contains(&already), "{already} ALREADY_EXISTS answers");
    assert_eq!(d.invisible_count(TABLE), 0);
}

/// A flush applied whose reply was lost is flushed again: that repeated
/// flush is answered each way a service may, and counts as done.
#[test]
fn lost_flush_replies_are_flushed_again_safely() {
    for reflush in Reflush::ALL {
        let d = double();
        d.answer_reflush(reflush);
        d.inject(Rpc::FlushRows, 1, BqFault::ApplyThenDropReply);
        d.inject(Rpc::FlushRows, 4, BqFault::Unavailable);
        d.inject(Rpc::FlushRows, 6, BqFault::Delay(std::time::Duration::from_millis(300)));
        let job = job("bq-lost-flush", &d);
        job.run_with(&["job.commit.initial_backoff_ms=1"], None).expect("the engine retries the commit");
        assert_landed_once(&d);
    }
}

/// A pending checkpoint whose stream is gone (deleted, or finalized where the
/// service refuses to flush a finalized stream) stops every run with an error
/// naming the checkpoint and the stream and the way out. Once an operator
/// drops it, the job goes on; only that checkpoint's rows are missing.
#[test]
fn a_pending_checkpoint_whose_stream_is_gone_waits_for_the_operator() {
    for finalized in [false, true] {
        let d = double();
        let job = job(&format!("bq-gone-{finalized}"), &d);
        let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
        job.run(Some(crash)).expect_err("crash");
        let loaded = job.load(&[]).expect("job");
        let before = sluice::engine::state::inspect(&loaded).expect("state");
        let pending = &before.latest.as_ref().expect("a record").pending;
        assert_eq!(pending.iter().map(|p| p.checkpoint).collect::<Vec<_>>(), vec![2]);
        let combined: serde_json::Value = serde_json::from_slice(&pending[0].combined.0).expect("JSON");
        let gone = combined["flushes"][0]["stream"].as_str().expect("a stream").to_string();
        assert!(before.to_string().contains(&gone), "`sluice state` shows the streams: {before}");
        if finalized {
            d.refuse_flush_when_finalized();
            assert!(d.finalize_stream(&gone));
        } else {
            assert!(d.delete_stream(&gone));
        }
        for _ in 0..2 {
            let err = job.run(None).expect_err("the stream is gone").to_string();
            for part in ["checkpoint 2: stream", gone.as_str(), "can no longer be flushed", "--drop-pending 2"] {
                assert!(err.contains(part), "{part:?} in {err}");
            }
        }
        sluice::engine::state::drop_pending(&loaded, 2).expect("dropped");
        let summary = job.run(None).expect("the job goes on");
        assert!(summary.recovered.is_empty(), "{summary:?}");
        // Checkpoint 2 held rows 500..1000 of each writer's 2000.
        let lost = |id: i64| (500..1000).contains(&(id % 2000));
        let visible = visible_ids(&d);
        let expected: Vec<i64> = (0..ROWS as i64).filter(|id| !lost(*id)).collect();
        assert_eq!(visible, expected, "every row but those of the dropped checkpoint, once");
    }
}

#[test]
fn a_replay_batched_differently_stays_exactly_once() {
    let d = double();
    let job = job("bq-rebatch", &d);
    let fault = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    job.run(Some(fault)).expect_err("crash");
    let before = d.stats().rows_appended;
    // The replay cuts the source into batches of 333 rows instead of 700 and
    // splits requests at 4 KB, so no request lines up with one before the crash.
    job.run_with(&["source.batch_rows=333", "sink.options.max_request_bytes=4096"], None).expect("recovery");
    assert_landed_once(&d);
    assert!(d.stats().rows_appended > before);
    assert!(d.invisible_count(TABLE) > 0, "rows appended after checkpoint 1 before the crash are never flushed");
}

#[test]
fn out_of_range_fails_the_job_loudly_with_nothing_duplicated() {
    let d = double();
    d.inject(Rpc::Append, 7, BqFault::OutOfRange);
    let job = job("bq-oor", &d);
    let err = job.run(None).expect_err("OUT_OF_RANGE stops the job").to_string();
    assert!(err.contains("out of range") && err.contains("OFFSET_OUT_OF_RANGE"), "{err}");
    assert_no_duplicates(&d);
    // What was committed stays; the next run lands the rest exactly once.
    job.run(None).expect("a later run resumes");
    assert_landed_once(&d);
}

#[test]
fn flush_out_of_range_fails_the_commit_and_keeps_it_pending() {
    let d = double();
    d.inject(Rpc::FlushRows, 2, BqFault::OutOfRange);
    let job = job("bq-flush-oor", &d);
    let err = job.run(None).expect_err("OUT_OF_RANGE on flush stops the job").to_string();
    assert!(err.contains("checkpoint 1: FlushRows(") && err.contains("lies beyond the end of the stream"), "{err}");
    assert!(err.contains("--drop-pending 1"), "the error says how to settle it: {err}");
    assert_no_duplicates(&d);
    let summary = job.run(None).expect("the next run re-flushes the pending checkpoint");
    assert!(!summary.recovered.is_empty());
    assert_landed_once(&d);
}

#[test]
fn a_row_the_api_rejects_fails_the_job_naming_the_row_and_reason() {
    let d = BigQueryDouble::start().expect("double");
    let mut schema = generator_schema();
    // Generator names are "name-<id>-<h % 97>": some rows break max_length 9.
    for f in &mut schema.fields {
        if f.name == "name" {
            f.max_length = 9;
        }
    }
    d.create_table(TABLE, schema);
    let job = TestJob::bigquery("bq-rowerr", &d.address(), TABLE, 2000, 1, 1000);
    let err = job.run(None).expect_err("row errors stop the job").to_string();
    assert!(err.contains("BigQuery rejected") && err.contains("max_length 9"), "{err}");
    assert!(err.contains("of this writer's input for table \"\" (in the source: row "), "mapped to the source: {err}");
    assert_eq!(d.visible_count(TABLE), 0, "nothing of the rejected request is visible");
}

/// A row the API rejects, read from a CSV file, is named by the sink's
/// count (`row N of this writer's input`) and by its file and line.
#[test]
fn a_rejected_row_is_named_by_its_file_and_line() {
    let d = BigQueryDouble::start().expect("double");
    let field = |name: &str, ty: Type, max_length: i64| TableFieldSchema {
        name: name.into(),
        r#type: ty as i32,
        mode: Mode::Nullable as i32,
        max_length,
        ..Default::default()
    };
    d.create_table(TABLE, TableSchema { fields: vec![field("id", Type::Int64, 0), field("name", Type::String, 9)] });
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("input");
    std::fs::write(dir.path().join("in/a.csv"), "id,name\n1,short\n").expect("a.csv");
    // Record k of b.csv is line k + 2; line 302's name is past max_length 9.
    let text: String = std::iter::once("id,name\n".to_string())
        .chain((0..500).map(|k| format!("{},{}\n", 100 + k, if k + 2 == 302 { "far-too-long-a-name" } else { "ok" })))
        .collect();
    std::fs::write(dir.path().join("in/b.csv"), text).expect("b.csv");
    let toml = format!(
        r#"[job]
id = "bq-rejected-line"
parallelism = 1
state_dir = "state"
[job.checkpoint]
every_rows = 10000
[source]
kind = "file"
path = "in"
batch_rows = 128
[sink]
id = "bq"
plugin = "{plugin}"
[sink.options]
table = "{TABLE}"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{address}"
[sink.sandbox]
memory_mb = 512
"#,
        plugin = sluice_tests::BIGQUERY_PLUGIN,
        address = d.address()
    );
    let job = TestJob { dir, toml };
    let err = job.run(None).expect_err("the rejected row stops the job").to_string();
    // a.csv gave 1 row, so b.csv's record 300 is the writer's row 301.
    assert!(
        err.contains("row 301 of this writer's input for table \"\"")
            && err.contains("(in the source: b.csv line 302)"),
        "{err}"
    );
    assert!(err.contains("max_length 9"), "the service's reason: {err}");
    assert_eq!(d.visible_count(TABLE), 0, "nothing of the job is visible");
}

/// With dead letters, the rows the API rejects land in the dead-letter
/// table instead, each once, and every other row lands once: the run goes
/// on from its last checkpoint with the rejected records read as dead
/// letters (nothing of the rejected round was flushed).
#[test]
fn rejected_rows_become_dead_letters_with_dead_letters_on() {
    let d = BigQueryDouble::start().expect("double");
    let field = |name: &str, ty: Type, max_length: i64| TableFieldSchema {
        name: name.into(),
        r#type: ty as i32,
        mode: Mode::Nullable as i32,
        max_length,
        ..Default::default()
    };
    let orders = "projects/p/datasets/d/tables/orders";
    let letters = "projects/p/datasets/d/tables/dead_letters";
    d.create_table(orders, TableSchema { fields: vec![field("id", Type::Int64, 0), field("name", Type::String, 9)] });
    let text = |n: &str| field(n, Type::String, 0);
    d.create_table(
        letters,
        TableSchema {
            fields: vec![
                text("raw"),
                text("source_position"),
                text("reason"),
                text("target_table"),
                text("job"),
                text("incarnation"),
                field("checkpoint", Type::Int64, 0),
            ],
        },
    );
    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("in/orders");
    std::fs::create_dir_all(&input).expect("input");
    let too_long = |id: u64| id % 150 == 7;
    for f in 0..3u64 {
        let text: String = std::iter::once("id,name\n".to_string())
            .chain((0..400).map(|k| {
                let id = f * 400 + k;
                format!("{id},{}\n", if too_long(id) { "far-too-long-a-name" } else { "ok" })
            }))
            .collect();
        std::fs::write(input.join(format!("part-{f}.csv")), text).expect("csv");
    }
    let toml = format!(
        r#"[job]
id = "bq-rejected-dl"
parallelism = 1
state_dir = "state"
bad_rows = "dead-letter"
[job.checkpoint]
every_rows = 250
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 100
[sink]
id = "bq"
plugin = "{plugin}"
[sink.options]
table = "projects/p/datasets/d/tables/{{table}}"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{address}"
[sink.sandbox]
memory_mb = 512
"#,
        plugin = sluice_tests::BIGQUERY_PLUGIN,
        address = d.address()
    );
    let job = TestJob { dir, toml };
    let summary = job.run(None).expect("the rejected rows become dead letters");
    let bad: Vec<u64> = (0..1200).filter(|id| too_long(*id)).collect();
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), bad.len() as u64)), "{summary}");
    let text_of = |r: &serde_json::Map<String, serde_json::Value>, k: &str| {
        r.get(k).and_then(|v| v.as_str()).map(str::to_string).unwrap_or_else(|| panic!("{k} in {r:?}"))
    };
    let mut ids: Vec<i64> = d
        .visible_rows(orders)
        .iter()
        .map(|r| r.get("id").and_then(|v| v.as_i64().or_else(|| v.as_str()?.parse().ok())).expect("id"))
        .collect();
    ids.sort_unstable();
    let want: Vec<i64> = (0..1200).filter(|id| !too_long(*id)).map(|id| id as i64).collect();
    assert_eq!(ids, want, "every accepted row once");
    let dead = d.visible_rows(letters);
    let mut got: Vec<(String, String)> =
        dead.iter().map(|r| (text_of(r, "source_position"), text_of(r, "raw"))).collect();
    got.sort();
    let mut expected: Vec<(String, String)> = bad
        .iter()
        .map(|id| (format!("orders/part-{}.csv line {}", id / 400, id % 400 + 2), format!("{id},far-too-long-a-name")))
        .collect();
    expected.sort();
    assert_eq!(got, expected, "each rejected record once, by position and text");
    let reasons: Vec<String> = dead.iter().map(|r| text_of(r, "reason")).collect();
    assert!(
        reasons.iter().all(|r| r.starts_with("the sink rejected it: ") && r.contains("max_length 9")),
        "{reasons:?}"
    );
}

#[test]
fn schema_mismatch_is_a_config_error_before_any_row() {
    let d = BigQueryDouble::start().expect("double");
    let mut schema = generator_schema();
    schema.fields[2].r#type = Type::String as i32; // price: FLOAT64 -> STRING
    d.create_table(TABLE, schema);
    let job = job("bq-mismatch", &d);
    let err = job.run(None).expect_err("mismatch").to_string();
    assert!(err.contains("column `price`") && err.contains("STRING"), "{err}");
    assert_eq!(d.stats().rows_appended, 0);
}

#[test]
fn nested_and_repeated_columns_match_the_table() {
    // The table holds a RECORD the generator lacks: NULLABLE, so the rows may omit it.
    let d = BigQueryDouble::start().expect("double");
    let mut schema = generator_schema();
    schema.fields.push(TableFieldSchema {
        name: "extra".into(),
        r#type: Type::Struct as i32,
        mode: Mode::Nullable as i32,
        fields: vec![TableFieldSchema {
            name: "x".into(),
            r#type: Type::Int64 as i32,
            mode: Mode::Repeated as i32,
            ..Default::default()
        }],
        ..Default::default()
    });
    d.create_table(TABLE, schema);
    let job = TestJob::bigquery("bq-extra", &d.address(), TABLE, 1000, 1, 500);
    job.run(None).expect("run");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, 1000);
}

#[test]
fn a_missing_table_and_an_unknown_endpoint_name_are_clear_errors() {
    let d = BigQueryDouble::start().expect("double");
    let missing = job("bq-missing", &d);
    let err = missing.run(None).expect_err("no table").to_string();
    assert!(err.contains(TABLE) && err.contains("NOT_FOUND"), "{err}");

    let d = double();
    let job = job("bq-denied", &d);
    let err = job.run_with(&["sink.options.endpoint=elsewhere"], None).expect_err("denied").to_string();
    assert!(err.contains("endpoint `elsewhere` is not granted") && err.contains("bigquery"), "{err}");
    assert_eq!(d.stats().rows_appended, 0);
}

#[test]
fn the_bearer_token_is_added_by_the_host() {
    let d = double();
    d.require_token("s3cret");
    let job = job("bq-token", &d);
    let err = job.run(None).expect_err("no token configured").to_string();
    assert!(err.contains("UNAUTHENTICATED"), "{err}");

    let token = job.dir.path().join("token.txt");
    std::fs::write(&token, "s3cret\n").expect("token file");
    job.run_with(&[&format!("sink.grpc.bigquery.token_file={}", token.display())], None).expect("token from a file");
    assert_landed_once(&d);
}

#[test]
fn table_schema_of_the_generator_is_what_the_double_serves() {
    // The double's generator table and the schema the encoder derives agree.
    let derived = sluice_bigquery_rows_schema();
    let served: TableSchema = generator_schema();
    let names = |s: &TableSchema| s.fields.iter().map(|f| (f.name.clone(), f.r#type, f.mode)).collect::<Vec<_>>();
    assert_eq!(names(&derived), names(&served));
}

fn sluice_bigquery_rows_schema() -> TableSchema {
    let mut s = sluice_bigquery_rows::RowEncoder::table_schema(&sluice::source::generator::Generator::schema_ref())
        .expect("generator schema maps");
    for f in &mut s.fields {
        f.precision = 0;
        f.scale = 0;
    }
    s
}

/// `sluice check` on a BigQuery job: an unreachable endpoint, a missing table
/// and a schema mismatch are one clear error line each; a good job passes.
#[test]
fn check_reports_each_problem_in_one_line() {
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    let mut wrong = generator_schema();
    wrong.fields[0].r#type = Type::String as i32; // id: INT64 -> STRING
    d.create_table("projects/p/datasets/d/tables/wrong", wrong);
    let job = job("bq-check", &d);
    job.load(&[]).expect("valid job file");
    let https = format!("sink.grpc.bigquery.address={}", d.address().replace("http://", "https://"));
    let cases: &[(&[&str], Option<&str>)] = &[
        (&[], None),
        (
            &["--set", "sink.grpc.bigquery.address=http://127.0.0.1:9"],
            Some("the Storage Write API is unreachable (UNAVAILABLE: endpoint `bigquery` (http://127.0.0.1:9)"),
        ),
        // https means TLS (rustls, system roots): the plaintext double fails the handshake.
        (&["--set", &https], Some("received corrupt message of type InvalidContentType")),
        (
            &["--set", "sink.grpc.bigquery.token_env=SLUICE_TEST_NO_SUCH_VAR"],
            Some("key `sink.grpc.bigquery.token_env`: the environment variable SLUICE_TEST_NO_SUCH_VAR is not set"),
        ),
        (
            &["--set", "sink.options.table=projects/p/datasets/d/tables/nope"],
            Some("table projects/p/datasets/d/tables/nope does not exist"),
        ),
        (
            &["--set", "sink.options.table=projects/p/datasets/d/tables/wrong"],
            Some("column `id`: Arrow type Int64 cannot land in the BigQuery column of type STRING"),
        ),
    ];
    for (sets, expected) in cases {
        let mut args = vec!["check", "job.toml"];
        args.extend_from_slice(sets);
        let (code, out, err) = run_cli(&args, job.dir.path());
        let all = format!("{out}{err}");
        match expected {
            None => {
                assert_eq!(code, 0, "{all}");
                assert!(out.contains("job bq-check is ready to run"), "{all}");
            }
            Some(expected) => {
                assert_eq!(code, 1, "{sets:?}: {all}");
                let errors: Vec<&str> = all.lines().filter(|l| l.starts_with("error:")).collect();
                assert_eq!(errors.len(), 1, "one error line: {all}");
                assert!(errors[0].contains(expected), "{sets:?}: expected {expected:?} in:\n{all}");
            }
        }
    }
    assert_eq!(d.stats().rows_appended, 0, "check writes nothing");
    assert_eq!(d.stats().streams_created, 0, "check creates no stream");
}

/// `examples/bigquery.toml`, as the README runs it, against the double.
#[test]
fn example_job_lands_every_row_once() {
    let d = BigQueryDouble::start().expect("double");
    let table = "projects/demo/datasets/sluice/tables/events";
    d.create_table(table, generator_schema());
    let dir = tempfile::tempdir().expect("temp dir");
    let sets = [
        format!("sink.plugin={}", sluice_tests::BIGQUERY_PLUGIN),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.grpc.bigquery.address={}", d.address()),
    ];
    let (code, stdout, err) = run_example("bigquery.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job bigquery-demo finished: 200000 rows"), "{stdout}");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(table)), 0, 200_000);
}

/// When the stream returns no table schema, the `table_schema` option (BigQuery
/// JSON, as `bq show --schema` prints it) is what the rows are checked against.
#[test]
fn the_table_schema_option_stands_in_for_a_stream_without_one() {
    let d = double();
    d.hide_table_schema();
    let schema = r#"[{"name":"id","type":"INTEGER","mode":"REQUIRED"},{"name":"qty","type":"INTEGER"},{"name":"price","type":"FLOAT"},{"name":"amount","type":"NUMERIC"},{"name":"name","type":"STRING"},{"name":"note","type":"STRING"},{"name":"day","type":"DATE"},{"name":"ts","type":"TIMESTAMP"}]"#;
    let job = TestJob::bigquery("bq-schema-opt", &d.address(), TABLE, 1000, 1, 500);
    let wrong = schema.replace(r#""name":"day","type":"DATE""#, r#""name":"day","type":"STRING""#);
    let err = job.run_with(&[&format!("sink.options.table_schema='{wrong}'")], None).expect_err("mismatch").to_string();
    assert!(err.contains("column `day`") && err.contains("STRING"), "{err}");
    job.run_with(&[&format!("sink.options.table_schema='{schema}'")], None).expect("run");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, 1000);
}

/// The `proto` row format (ProtoRows, for services that take no Arrow; the
/// rest of this suite runs the default, `arrow`): every row once and exactly
/// the source's values, through a crash, lost replies and a rebatched replay.
#[test]
fn proto_rows_land_every_row_once() {
    let proto = "sink.options.format=proto";
    let d = double();
    let first = job("bq-proto", &d);
    let summary = first.run_with(&[proto], None).expect("run");
    assert_eq!(summary.rows_total, ROWS);
    assert_landed_once(&d);

    let d = double();
    d.inject(Rpc::Append, 3, BqFault::ApplyThenDropReply);
    d.inject(Rpc::FlushRows, 2, BqFault::ApplyThenDropReply);
    let job = job("bq-proto-crash", &d);
    let fault = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 1 };
    job.run_with(&[proto], Some(fault)).expect_err("crash");
    // The replay is cut into other batches and requests of at most 16 KB.
    job.run_with(&[proto, "source.batch_rows=333", "sink.options.max_request_bytes=16384"], None).expect("recovers");
    assert_landed_once(&d);
    assert!(d.stats().already_exists >= 1, "the lost append reply was answered ALREADY_EXISTS on resend");
}

/// Proto rows are checked against the table like Arrow rows: a column the
/// table types differently is refused before any row, naming it.
#[test]
fn proto_rows_meet_the_same_schema_checks() {
    let d = BigQueryDouble::start().expect("double");
    let mut schema = generator_schema();
    schema.fields[2].r#type = Type::String as i32; // price: FLOAT64 -> STRING
    d.create_table(TABLE, schema);
    let job = job("bq-proto-mismatch", &d);
    let err = job.run_with(&["sink.options.format=proto"], None).expect_err("mismatch").to_string();
    assert!(err.contains("column `price`") && err.contains("STRING"), "{err}");
    assert_eq!(d.stats().rows_appended, 0);
}
