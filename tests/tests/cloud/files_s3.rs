//! The files sink and the file source on object stores, against moto's S3
//! server and fake-gcs-server on 127.0.0.1 (`sluice_tests::store_servers`).
//!
//! - The files sink on `s3://` and `gs://`: data objects written once under
//!   unique names, one commit marker per table and checkpoint created
//!   exclusively; every row read back exactly once (by id and value) by two
//!   readers that follow the markers: `sluice_tests::files_store` through
//!   sluice-store, and pyarrow's own S3 filesystem.
//! - A crash at every step of the checkpoint protocol (the crash matrix's
//!   points, in-process), a SIGKILL of the `sluice` binary, a crash in the
//!   middle of a multi-table commit, and reruns: no row lost or doubled.
//! - The file source reading `s3://bucket/prefix` (one table of CSV files,
//!   and a tree of Parquet tables) into a local files sink, refusing a
//!   resume whose input changed.
//!
//! The host reaches the servers through the standard environment
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`; `STORAGE_EMULATOR_HOST` for GCS), set once for
//! this process and inherited by the `sluice` processes it starts.

use std::path::Path;
use std::time::{Duration, Instant};

use arrow_array::{Array, Int64Array, RecordBatch};
use bytes::Bytes;
use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice::source::generator::Generator;
use sluice_store::{GcsOptions, ObjectStore};
use sluice_tests::files_store::{self, read_committed, unnamed};
use sluice_tests::harness::{self, block, buckets};
use sluice_tests::store_servers::{ACCESS_KEY_ID, SECRET_ACCESS_KEY};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_parquet_tree, run_cli, sluice_run, sort_by_id, tables};

const BUCKET: &str = buckets::FILES;

/// The process's moto and fake-gcs-server (`sluice_tests::harness`), and
/// the environment pointing the host at them.
fn servers() {
    harness::moto();
    harness::gcs();
}

/// The S3 bucket, as the test sees it (not through the host).
fn s3() -> ObjectStore {
    ObjectStore::s3(BUCKET, &harness::moto().s3_options()).expect("bucket")
}

/// The GCS bucket, as the test sees it.
fn gcs() -> ObjectStore {
    ObjectStore::gcs(BUCKET, &GcsOptions::emulator(&harness::gcs().endpoint)).expect("bucket")
}

/// Keys under `prefix`, relative to it.
fn keys(store: &ObjectStore, prefix: &str) -> Vec<String> {
    let listed = block(store.list(prefix)).expect("list");
    listed.into_iter().map(|o| o.key.strip_prefix(&format!("{prefix}/")).unwrap_or(&o.key).to_string()).collect()
}

/// A generator → files job landing in `<scheme>://lake/<prefix>/files`
/// (granted `<scheme>://lake/<prefix>`), its state directory local.
fn files_job(scheme: &str, prefix: &str, rows: u64, parallelism: u32, every: u64) -> TestJob {
    servers();
    let id = prefix.replace('/', "-");
    let mut job = TestJob::files(&id, rows, parallelism, every);
    let root = format!("{scheme}://{BUCKET}/{prefix}");
    job.toml = job
        .toml
        .replace(r#"path = "out/files""#, &format!(r#"path = "{root}/files""#))
        .replace(r#"locations = ["out"]"#, &format!(r#"locations = ["{root}"]"#));
    assert!(job.toml.contains(&root), "{}", job.toml);
    job
}

/// Reads the output back with pyarrow's own S3 filesystem, following the
/// commit markers as the README tells readers to; writes the rows to
/// `out.parquet` in a scratch folder and reads them from there.
fn pyarrow_readback(prefix: &str) -> RecordBatch {
    const SCRIPT: &str = r#"
import json, re, sys
import pyarrow as pa, pyarrow.fs as pafs, pyarrow.parquet as pq
endpoint, key, secret, bucket, path, out = sys.argv[1:7]
fs = pafs.S3FileSystem(endpoint_override=endpoint.split("://", 1)[1], scheme="http", region="us-east-1",
                       access_key=key, secret_key=secret)
marker = re.compile(r"\.c[0-9]{10}\.json$")
tables = []
for info in sorted(fs.get_file_info(pafs.FileSelector(f"{bucket}/{path}")), key=lambda i: i.path):
    if info.type != pafs.FileType.File or not marker.search(info.base_name):
        continue
    with fs.open_input_stream(info.path) as f:
        m = json.load(f)
    assert m["format"] == "sluice-files-commit/1", m
    for file in m["files"]:
        tables.append(pq.read_table(file["location"].removeprefix("s3://"), filesystem=fs))
pq.write_table(pa.concat_tables(tables), out)
print(len(tables))
"#;
    let scratch = tempfile::tempdir().expect("scratch");
    let out = scratch.path().join("out.parquet");
    let path = format!("{prefix}/files");
    let args = [
        harness::moto().endpoint.as_str(),
        ACCESS_KEY_ID,
        SECRET_ACCESS_KEY,
        BUCKET,
        path.as_str(),
        out.to_str().expect("utf-8"),
    ];
    let printed = sluice_tests::python(SCRIPT, &args).unwrap_or_else(|e| panic!("pyarrow readback failed:\n{e}"));
    assert!(printed.trim().parse::<usize>().expect("a count") > 0, "pyarrow read no data object");
    let file = std::fs::File::open(&out).expect("out.parquet");
    let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
        .expect("parquet")
        .build()
        .expect("reader");
    let batches: Vec<RecordBatch> = reader.map(|b| b.expect("batch")).collect();
    let all = arrow_select::concat::concat_batches(&batches[0].schema(), &batches).expect("concat");
    sort_by_id(&all)
}

fn refs(sets: &[String]) -> Vec<&str> {
    sets.iter().map(String::as_str).collect()
}

/// The whole path on S3: `sluice check` proves a marker can be created (and
/// leaves nothing), a run lands every row once by markers, two independent
/// readers agree, and a rerun of the finished job adds nothing.
#[test]
fn the_files_sink_lands_on_s3_exactly_once_and_pyarrow_reads_it_back() {
    let prefix = "whole";
    let job = files_job("s3", prefix, 6000, 3, 500);
    let store = s3();
    std::fs::write(job.path(), &job.toml).expect("job file");
    let (code, out, err) = run_cli(&["check", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "sluice check:\n{out}{err}");
    assert!(keys(&store, prefix).is_empty(), "check leaves nothing behind: {:?}", keys(&store, prefix));

    let summary = job.run(None).expect("runs");
    assert_eq!(summary.rows_total, 6000);
    let path = format!("{prefix}/files");
    assert_exactly_once(&read_committed(&store, &path), 6000);
    assert_exactly_once(&pyarrow_readback(prefix), 6000);

    let all = keys(&store, &path);
    let key = format!("{}.out.{}", summary.job_id, summary.incarnation);
    let markers: Vec<&String> = all.iter().filter(|k| files_store::is_marker(k)).collect();
    let expected: Vec<String> = (1..=4).map(|c| format!("{key}.c{c:010}.json")).collect();
    assert_eq!(markers, expected.iter().collect::<Vec<_>>(), "one marker per checkpoint with rows: {all:?}");
    assert!(all.contains(&format!("_sluice_claim.{}.out.json", summary.job_id)), "{all:?}");
    assert!(
        all.iter()
            .all(|k| files_store::is_marker(k) || k.starts_with("_sluice_claim.") || k.starts_with("_sluice_data/")),
        "nothing else under the output: {all:?}"
    );
    assert!(unnamed(&store, &path).is_empty(), "a clean run leaves no unnamed data object");
    assert!(keys(&store, &format!("{prefix}/files.staging")).is_empty(), "nothing is staged on an object store");

    let again = job.run(None).expect("reruns");
    assert!(again.already_complete, "{again}");
    assert_eq!(keys(&store, &path), all, "a rerun of the finished job changes nothing");
}

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
/// Per subtask: 2000 rows in rounds of 500 → checkpoints 1..=4 hold rows, 5 is empty.
const EVERY: u64 = 500;

/// The crash matrix's check (`sluice_tests::crash_and_recover`) on S3:
/// whatever the crash left committed is whole checkpoints, and recovery ends
/// with every row committed exactly once, having finished exactly what the
/// crash interrupted.
fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let prefix = format!("crash/{point}-{checkpoint}");
    let path = format!("{prefix}/files");
    let job = files_job("s3", &prefix, ROWS, PARALLELISM, EVERY);
    let store = s3();
    let restored = sluice_conformance::crash_and_restore(&sluice_conformance::CrashCheck {
        fault: Fault { point, checkpoint, subtask: 1 },
        first_id: 0,
        rows: ROWS,
        run: &|fault| job.run(fault),
        visible: &|| Ok(ids(&read_committed(&store, &path))),
        may_not_happen: false,
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_exactly_once(&read_committed(&store, &path), ROWS);
    let recovered = restored.summary.recovered.clone();
    match point {
        CrashPoint::AfterPersist => assert_eq!(recovered, vec![(checkpoint, CommitOutcome::Committed)]),
        // The first commit's first side effect is the claim: recovery publishes.
        CrashPoint::DuringCommit if checkpoint == 1 => {
            assert_eq!(recovered, vec![(checkpoint, CommitOutcome::Committed)])
        }
        CrashPoint::DuringCommit | CrashPoint::AfterCommit => {
            assert_eq!(recovered, vec![(checkpoint, CommitOutcome::AlreadyCommitted)])
        }
        _ if checkpoint == 1 => assert!(recovered.is_empty(), "{recovered:?}"),
        _ => assert_eq!(recovered, vec![(checkpoint - 1, CommitOutcome::AlreadyCommitted)]),
    }
    // Subtask 1 finished its data objects of `checkpoint` and then died:
    // they are there, and no marker names them, so no reader counts them.
    if matches!(point, CrashPoint::AfterPrepareCommit | CrashPoint::AfterSnapshotState) {
        let left = unnamed(&store, &path);
        assert!(!left.is_empty(), "the crashed attempt's data objects are left unnamed");
        assert!(left.iter().all(|k| k.contains("/attempt-1/")), "{left:?}");
    }
}

sluice_tests::crash_tests! {
    after_write_first: CrashPoint::AfterWrite, 1;
    after_write_middle: CrashPoint::AfterWrite, 3;
    after_prepare_commit_first: CrashPoint::AfterPrepareCommit, 1;
    after_prepare_commit_middle: CrashPoint::AfterPrepareCommit, 3;
    after_snapshot_state_first: CrashPoint::AfterSnapshotState, 1;
    after_snapshot_state_middle: CrashPoint::AfterSnapshotState, 3;
    after_persist_first: CrashPoint::AfterPersist, 1;
    after_persist_middle: CrashPoint::AfterPersist, 3;
    after_persist_last: CrashPoint::AfterPersist, 4;
    during_commit_first: CrashPoint::DuringCommit, 1;
    during_commit_middle: CrashPoint::DuringCommit, 3;
    during_commit_last: CrashPoint::DuringCommit, 4;
    after_commit_first: CrashPoint::AfterCommit, 1;
    after_commit_middle: CrashPoint::AfterCommit, 3;
    after_commit_last: CrashPoint::AfterCommit, 4;
}

/// Two crashes in a row, the second during the recovery run, and a replay
/// that batches rows differently than the run that crashed.
#[test]
fn repeated_crashes_and_a_rebatched_replay_land_every_row_once() {
    let prefix = "crash-twice";
    let job = files_job("s3", prefix, ROWS, PARALLELISM, EVERY);
    let first = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(first)).expect_err("crash").is_injected_crash());
    let second = Fault { point: CrashPoint::DuringCommit, checkpoint: 3, subtask: 0 };
    assert!(job.run_with(&["source.batch_rows=333"], Some(second)).expect_err("crash").is_injected_crash());
    let summary = job.run_with(&["source.batch_rows=1001"], None).expect("completes");
    assert_eq!(summary.attempt, 3);
    assert_eq!(summary.recovered, vec![(3, CommitOutcome::AlreadyCommitted)]);
    assert_exactly_once(&read_committed(&s3(), &format!("{prefix}/files")), ROWS);
}

/// Three tables, one met late, all evolving halfway; a crash right after
/// the first marker of checkpoint 2 (the other tables' not yet made): the
/// recovery makes the rest, table by table, and every table holds its rows
/// once. The state directory is on S3 too, so the job shares no disk.
#[test]
fn a_crash_between_two_tables_markers_is_finished_table_by_table() {
    let prefix = "tables";
    let rows = 4000;
    let job = files_job("s3", prefix, rows, 2, 400);
    let mut sets = tables::sets(rows);
    sets.push(format!("job.state_dir=s3://{BUCKET}/{prefix}/state"));
    let crash = Fault { point: CrashPoint::DuringCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let store = s3();
    let path = format!("{prefix}/files");
    let marked =
        |table: &str| keys(&store, &format!("{path}/{table}")).iter().filter(|k| k.contains(".c0000000002.")).count();
    let made: usize = tables::TABLES.iter().map(|t| marked(t)).sum();
    assert_eq!(made, 1, "the crash came right after the first marker of checkpoint 2");

    let summary = job.run_with(&refs(&sets), None).expect("recovers");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::Committed)], "the recovery made the other markers");
    let target = Generator::evolved_schema();
    for (t, table) in tables::TABLES.iter().enumerate() {
        let visible = files_store::read_committed_table(&store, &path, table, &target);
        tables::assert_table(&visible, rows, t);
    }
}

/// A real crash: the `sluice` binary is SIGKILLed mid-run (some checkpoints
/// committed, some data objects written and named by nothing), and the
/// next run ends with every row once.
#[test]
fn a_sigkilled_run_on_s3_is_finished_by_the_next_one() {
    let prefix = "killed";
    let mut job = files_job("s3", prefix, 40_000, 2, 2000);
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    std::fs::write(job.path(), &job.toml).expect("job file");
    let store = s3();
    let path = format!("{prefix}/files");
    let mut child = sluice_run(&job, &[])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("sluice");
    let start = Instant::now();
    while keys(&store, &path).iter().filter(|k| files_store::is_marker(k)).count() < 2 {
        assert!(child.try_wait().expect("wait").is_none(), "sluice ended before it could be killed");
        assert!(start.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    assert!(!child.wait().expect("reap").success());
    let before = ids(&read_committed(&store, &path));
    let mut dedup = before.clone();
    dedup.dedup();
    assert_eq!(before, dedup, "no row committed twice at the kill");
    assert!(before.len() < 40_000, "killed before the end");

    sluice_tests::rerun_to_end(&job, &[]);
    assert_exactly_once(&read_committed(&store, &path), 40_000);
}

/// `staging_path` has no meaning on an object store and is refused,
/// naming why, before anything is written; so is staging on an object store
/// for a local output.
#[test]
fn staging_paths_that_cannot_work_are_refused() {
    let job = files_job("s3", "refused", 100, 1, 100);
    let err =
        job.run_with(&[&format!("sink.options.staging_path=s3://{BUCKET}/refused/stage")], None).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("option `staging_path`") && message.contains("commit marker"), "{message}");
    assert!(keys(&s3(), "refused").is_empty(), "nothing was written");

    let local = TestJob::files("local-staging", 100, 1, 100);
    let sets = [
        format!("sink.options.staging_path=s3://{BUCKET}/refused/stage"),
        format!(r#"sink.grants.locations=["out", "s3://{BUCKET}/refused"]"#),
    ];
    servers();
    let err = local.run_with(&refs(&sets), None).expect_err("refused").to_string();
    assert!(err.contains("nothing can be renamed out of an object store"), "{err}");
}

/// The files sink on GCS (fake-gcs-server): markers created with
/// `ifGenerationMatch=0`, data objects streamed under names checked free;
/// a crash after a checkpoint was persisted is committed once by the
/// recovery, and every row is read back once.
#[test]
fn the_files_sink_lands_on_gcs_exactly_once_across_a_crash() {
    let prefix = "gcs";
    let job = files_job("gs", prefix, ROWS, PARALLELISM, EVERY);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let store = gcs();
    let path = format!("{prefix}/files");
    assert_eq!(ids(&read_committed(&store, &path)).len(), 1500, "checkpoint 1 only");
    let summary = job.run(None).expect("recovers");
    assert_eq!(summary.recovered, vec![(2, CommitOutcome::Committed)]);
    assert_exactly_once(&read_committed(&store, &path), ROWS);
    let again = job.run(None).expect("reruns");
    assert!(again.already_complete, "{again}");
    assert_exactly_once(&read_committed(&store, &path), ROWS);
}

/// CSV text with rows `id,v` for `ids`, `v = id * 3`.
fn csv_rows(ids: std::ops::Range<i64>) -> Vec<u8> {
    let text: String = std::iter::once("id,v\n".to_string()).chain(ids.map(|i| format!("{i},{}\n", i * 3))).collect();
    text.into_bytes()
}

/// `in/<name>` on S3 under `prefix`, rows `id,v` for `ids`.
fn put_csv(prefix: &str, name: &str, ids: std::ops::Range<i64>) {
    put(&format!("{prefix}/in/{name}"), csv_rows(ids));
}

fn put(key: &str, bytes: Vec<u8>) {
    put_in(&s3(), key, bytes);
}

/// Replaces `key` in `store` with `bytes`.
fn put_in(store: &ObjectStore, key: &str, bytes: Vec<u8>) {
    block(async {
        let _ = store.delete(key).await;
        store.create_exclusive(key, Bytes::from(bytes)).await.expect("put");
    });
}

/// A file source job reading `s3://lake/<prefix>/in` into a local files sink.
fn source_job(prefix: &str, parallelism: u32, every_rows: u64, batch_rows: u64) -> TestJob {
    source_job_on("s3", prefix, parallelism, every_rows, batch_rows)
}

/// A file source job reading `<scheme>://lake/<prefix>/in` into a local files sink.
fn source_job_on(scheme: &str, prefix: &str, parallelism: u32, every_rows: u64, batch_rows: u64) -> TestJob {
    servers();
    let dir = tempfile::tempdir().expect("dir");
    let plugin = sluice_tests::FILES_PLUGIN;
    let toml = format!(
        r#"[job]
id = "{}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "{scheme}://{BUCKET}/{prefix}/in"
batch_rows = {batch_rows}
[sink]
id = "out"
plugin = "{plugin}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#,
        prefix.replace('/', "-")
    );
    TestJob { dir, toml }
}

/// `(id, v)` of every row under `dir` (a files-sink output or table folder), sorted.
fn landed_in(dir: &Path) -> Vec<(i64, i64)> {
    let rows = sort_by_id(&read_parquet_tree(dir));
    let col = |name: &str| {
        rows.column_by_name(name).expect(name).as_any().downcast_ref::<Int64Array>().expect("int64").clone()
    };
    let (id, v) = (col("id"), col("v"));
    (0..rows.num_rows()).map(|k| (id.value(k), v.value(k))).collect()
}

fn expected(ids: std::ops::Range<i64>) -> Vec<(i64, i64)> {
    ids.map(|i| (i, i * 3)).collect()
}

/// The file source on S3 keeps the local source's identity rules: after a
/// stop mid-way, an object added that sorts first is refused by name, so is
/// a consumed object rewritten in place (same size, new ETag); with the
/// input as it was, the resume lands every row once, and an object added
/// that sorts after is read once.
#[test]
fn the_file_source_reads_s3_and_refuses_a_changed_input_on_resume() {
    let prefix = "source/csv";
    let job = source_job(prefix, 1, 1000, 250);
    put_csv(prefix, "b.csv", 0..3000);
    put_csv(prefix, "c.csv", 3000..6000);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("stopped mid-run").is_injected_crash());
    assert_eq!(landed_in(&job.out()), expected(0..2000));

    let url = format!("s3://{BUCKET}/{prefix}/in");
    put_csv(prefix, "a.csv", 10_000..13_000);
    let err = job.run(None).expect_err("the new first object is refused");
    assert!(matches!(err, EngineError::SourceChanged { checkpoint: 2, .. }), "{err}");
    let message = err.to_string();
    for part in [format!("{url}/a.csv is new and sorts before"), format!("{url}/b.csv"), "append-only".into()] {
        assert!(message.contains(&part), "{part:?} in: {message}");
    }
    block(s3().delete(&format!("{prefix}/in/a.csv"))).expect("rm");

    // Rewritten in place: same size, other content, so only the ETag tells.
    let original = block(s3().read(&format!("{prefix}/in/b.csv"))).expect("read");
    let mut changed = original.to_vec();
    let at = changed.len() - 3;
    changed[at] = if changed[at] == b'7' { b'8' } else { b'7' };
    put(&format!("{prefix}/in/b.csv"), changed);
    let err = job.run(None).expect_err("a rewritten object is refused").to_string();
    assert!(err.contains(&format!("{url}/b.csv was modified (its ETag changed")), "{err}");
    put(&format!("{prefix}/in/b.csv"), original.to_vec());

    put_csv(prefix, "d.csv", 6000..7000);
    let summary = job.run(None).expect("the input as it was resumes");
    assert_eq!(summary.rows_total, 7000);
    assert_eq!(landed_in(&job.out()), expected(0..7000));
}

/// `<prefix>/<table>/*.parquet` on S3: one table per folder, Parquet read
/// by ranged GETs, two subtasks; each table lands its rows once.
#[test]
fn the_file_source_reads_a_tree_of_parquet_tables_from_s3() {
    let prefix = "source/tree";
    for (table, parts) in [("orders", 0..3), ("users", 3..5)] {
        for k in parts {
            let ids: Vec<i64> = (k * 1000..(k + 1) * 1000).collect();
            let v: Vec<i64> = ids.iter().map(|i| i * 3).collect();
            let batch = RecordBatch::try_from_iter([
                ("id", std::sync::Arc::new(Int64Array::from(ids)) as arrow_array::ArrayRef),
                ("v", std::sync::Arc::new(Int64Array::from(v)) as arrow_array::ArrayRef),
            ])
            .expect("batch");
            let mut bytes = Vec::new();
            let props =
                parquet::file::properties::WriterProperties::builder().set_max_row_group_row_count(Some(300)).build();
            let mut writer =
                parquet::arrow::ArrowWriter::try_new(&mut bytes, batch.schema(), Some(props)).expect("writer");
            writer.write(&batch).expect("write");
            writer.close().expect("close");
            put(&format!("{prefix}/in/{table}/part-{k}.parquet"), bytes);
        }
    }
    // Not data: another format's file, and an object deeper in a table folder.
    put(&format!("{prefix}/in/orders/_SUCCESS"), Vec::new());
    put(&format!("{prefix}/in/orders/old/part-9.parquet"), b"not parquet".to_vec());
    let job = source_job(prefix, 2, 700, 256);
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.rows_total, 5000);
    assert_eq!(landed_in(&job.out().join("orders")), expected(0..3000));
    assert_eq!(landed_in(&job.out().join("users")), expected(3000..5000));
    let again = job.run(None).expect("reruns");
    assert!(again.already_complete, "{again}");
}

/// The file source on GCS (fake-gcs-server): a folder of CSV objects, read
/// by two subtasks into a local files sink, every row once.
#[test]
fn the_file_source_reads_gcs() {
    let prefix = "source/gcs";
    servers();
    let store = gcs();
    for (k, name) in ["a.csv", "b.csv", "c.csv"].iter().enumerate() {
        let k = k as i64;
        put_in(&store, &format!("{prefix}/in/{name}"), csv_rows(k * 1000..(k + 1) * 1000));
    }
    let job = source_job_on("gs", prefix, 2, 500, 200);
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.rows_total, 3000);
    assert_eq!(landed_in(&job.out()), expected(0..3000));
}

/// A pending checkpoint naming data objects that are gone or replaced
/// (removed or rewritten outside Sluice after the record was persisted) is
/// never published: every run refuses it, before any marker is made, with
/// an error naming each such object, the checkpoint and the way out, and
/// leaves it pending. Once the operator drops it, the job goes on and only
/// that checkpoint's rows are missing.
#[test]
fn a_pending_checkpoint_naming_a_missing_data_object_makes_no_marker() {
    let prefix = "missing-object";
    let path = format!("{prefix}/files");
    let job = files_job("s3", prefix, ROWS, PARALLELISM, EVERY);
    let store = s3();
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let loaded = job.load(&[]).expect("the job loads");
    let state = sluice::engine::state::inspect(&loaded).expect("state");
    let pending = &state.latest.as_ref().expect("a checkpoint record").pending;
    assert_eq!(pending.iter().map(|p| p.checkpoint).collect::<Vec<_>>(), vec![2]);
    let combined: serde_json::Value = serde_json::from_slice(&pending[0].combined.0).expect("JSON");
    let table = &combined["tables"][0];
    let dir = table["staging_dir"].as_str().expect("staging_dir");
    let objects: Vec<String> = table["files"]
        .as_array()
        .expect("files")
        .iter()
        .map(|f| format!("{dir}/{}", f["name"].as_str().expect("name")))
        .collect();
    assert!(objects.len() >= PARALLELISM as usize, "{objects:?}");
    let key = |location: &str| location.strip_prefix(&format!("s3://{BUCKET}/")).expect("in the bucket").to_string();
    let (gone, replaced) = (&objects[0], &objects[1]);
    block(store.delete(&key(gone))).expect("removing a data object");
    put_in(&store, &key(replaced), b"not the data object its writer wrote".to_vec());
    let before = ids(&read_committed(&store, &path));
    let markers_of_2 = || keys(&store, &path).iter().filter(|k| k.contains(".c0000000002.")).count();
    assert_eq!(markers_of_2(), 0);

    for _ in 0..2 {
        let err = job.run(None).expect_err("the checkpoint is refused");
        assert!(!err.is_injected_crash(), "{err}");
        let err = err.to_string();
        for part in [
            "checkpoint 2 cannot be committed",
            "2 file(s)",
            &format!("data object {gone} is missing"),
            &format!("data object {replaced} holds 36 bytes, and its writer wrote"),
            "--drop-pending 2",
        ] {
            assert!(err.contains(part), "{part:?} in {err}");
        }
        assert_eq!(markers_of_2(), 0, "no marker of checkpoint 2 may be made");
        assert_eq!(ids(&read_committed(&store, &path)), before);
    }

    sluice::engine::state::drop_pending(&loaded, 2).expect("the operator drops checkpoint 2");
    let summary = job.run(None).expect("the job goes on");
    assert!(summary.recovered.is_empty(), "{summary:?}");
    // Checkpoint 2 held rows 500..1000 of each writer's 2000.
    let lost = |id: i64| (500..1000).contains(&(id % 2000));
    let expected: Vec<i64> = (0..ROWS as i64).filter(|id| !lost(*id)).collect();
    assert_eq!(ids(&read_committed(&store, &path)), expected, "every row but the dropped checkpoint's, once");
}
