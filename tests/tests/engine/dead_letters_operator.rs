//! Dead letters against what an operator does between runs and what the
//! data does to inference: a dead-letter table renamed or dead letters
//! turned off on resume (refused), a dropped pending checkpoint (its dead
//! letters leave every count), `job.max_bad_rows` as a share of the job, a
//! JSON file whose first record is the odd one out (refused), a sink that
//! rejects every row (stopped at once by a count), and the metric after a
//! recovery (counted once).

use std::path::Path;

use arrow_array::RecordBatch;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice_bigquery_double::BigQueryDouble;
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::proto::{TableFieldSchema, TableSchema};
use sluice_tests::{FILES_PLUGIN, TestJob, read_parquet_tree};

/// A files job reading `in` (single table) with dead letters in
/// `dead_letters`; `extra` goes into `[job]`.
fn files_job(id: &str, every_rows: u64, extra: &str) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in");
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = 1
state_dir = "state"
bad_rows = "dead-letter"
{extra}
[job.checkpoint]
every_rows = {every_rows}
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 64
[sink]
id = "out"
plugin = "{FILES_PLUGIN}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#
    );
    TestJob { dir, toml }
}

/// `id,qty` CSV with ids `ids`; `bad(id)` gives a qty that is not an integer.
fn write_csv(dir: &Path, name: &str, ids: std::ops::Range<u64>, bad: impl Fn(u64) -> bool) {
    let mut text = String::from("id,qty\n");
    for id in ids {
        if bad(id) {
            text.push_str(&format!("{id},x{id}\n"));
        } else {
            text.push_str(&format!("{id},{}\n", id % 7));
        }
    }
    std::fs::write(dir.join("in").join(name), text).expect("csv");
}

fn rows_of(dir: &Path) -> Option<RecordBatch> {
    let has = std::fs::read_dir(dir).map(|d| d.flatten().any(|e| e.path().is_dir())).unwrap_or(false);
    has.then(|| read_parquet_tree(dir))
}

fn letters_in(job: &TestJob, table: &str) -> usize {
    rows_of(&job.out().join(table)).map_or(0, |b| b.num_rows())
}

/// Main-table rows: the checkpoint directories of `out/files` only (the
/// dead-letter table's folder sits beside them for a single-table source).
fn main_rows(job: &TestJob) -> usize {
    let out = job.out();
    let mut n = 0;
    let Ok(entries) = std::fs::read_dir(&out) else { return 0 };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if e.path().is_dir() && name.contains(".c0") {
            for f in std::fs::read_dir(e.path()).expect("cp").flatten() {
                if f.path().extension().is_some_and(|x| x == "parquet") {
                    let file = std::fs::File::open(f.path()).expect("open");
                    let r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
                        .expect("pq")
                        .build()
                        .expect("reader");
                    for b in r {
                        n += b.expect("batch").num_rows();
                    }
                }
            }
        }
    }
    n
}

/// JSON lines: the first record that gives `qty` a value decides its kind,
/// so a file whose first record is the odd one out would set aside every
/// other record. It is refused instead, naming the first record set aside,
/// and nothing of it lands.
#[test]
fn a_json_file_whose_first_record_is_the_odd_one_out_is_refused() {
    let job = files_job("dl-json-first", 200, "");
    let mut text = String::from("{\"id\": 0, \"qty\": \"oops\"}\n");
    for id in 1..500u64 {
        text.push_str(&format!("{{\"id\": {id}, \"qty\": {}}}\n", id % 7));
    }
    std::fs::write(job.dir.path().join("in/part-0.jsonl"), text).expect("jsonl");
    let err = job.run(None).expect_err("refused").to_string();
    assert!(err.contains("part-0.jsonl") && err.contains("499 of its 500 records do not fit"), "{err}");
    assert!(err.contains("line 2: field `qty`"), "the first record set aside is named: {err}");
    assert_eq!(main_rows(&job), 0);
    assert_eq!(letters_in(&job, "dead_letters"), 0);
}

/// `job.max_bad_rows` as a fraction is a share of the records read over
/// the job: one bad record alone in the last checkpoint (1 in 401) passes
/// a 1% limit; 3% of a job's records do not.
#[test]
fn a_share_of_bad_rows_is_judged_over_the_job() {
    let job = files_job("dl-share-ok", 200, "max_bad_rows = 0.01");
    // The first file types `qty`.
    write_csv(job.dir.path(), "part-0.csv", 0..200, |_| false);
    write_csv(job.dir.path(), "part-1.csv", 200..401, |id| id == 400);
    let summary = job.run(None).unwrap_or_else(|e| panic!("one bad record in 401 is under 1%: {e}"));
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 1)), "{summary}");
    assert_eq!((main_rows(&job), letters_in(&job, "dead_letters")), (400, 1));

    let job = files_job("dl-share-over", 200, "max_bad_rows = 0.01");
    write_csv(job.dir.path(), "part-0.csv", 0..200, |_| false);
    write_csv(job.dir.path(), "part-1.csv", 200..1400, |id| id % 33 == 0);
    let err = job.run(None).expect_err("3% is over 1%").to_string();
    assert!(err.contains("records read over the job") && err.contains("a share of 0.01"), "{err}");
    // It stopped once the job had read enough records to judge a share.
    let landed = main_rows(&job) + letters_in(&job, "dead_letters");
    assert!(landed < 1400 && landed >= sluice::engine::MIN_RECORDS_FOR_A_SHARE as usize - 200, "{landed}: {err}");
}

/// A resume into another dead-letter table, or without dead letters, is
/// refused before anything is written, naming the key and the recorded
/// table; the same job with its table goes on to the end, exactly once.
#[test]
fn a_resume_that_renames_the_dead_letter_table_or_turns_it_off_is_refused() {
    let job = files_job("dl-keep-table", 200, "");
    write_csv(job.dir.path(), "part-0.csv", 0..200, |_| false);
    write_csv(job.dir.path(), "part-1.csv", 200..1000, |id| id == 300 || id == 700);
    let fault = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    assert_eq!(letters_in(&job, "dead_letters"), 1, "record 300 landed as a dead letter");
    let rows_before = main_rows(&job);

    let err = job.run_with(&["job.dead_letter.table=dl2"], None).expect_err("renamed").to_string();
    assert!(err.contains("job.dead_letter.table") && err.contains("\"dead_letters\", not \"dl2\""), "{err}");
    let off = TestJob {
        dir: tempfile::tempdir().expect("dir"),
        toml: job
            .toml
            .replace("bad_rows = \"dead-letter\"\n", "")
            .replace("[job.dead_letter]\ntable = \"dead_letters\"\n", "")
            .replace("state_dir = \"state\"", &format!("state_dir = \"{}\"", job.state().display()))
            .replace("path = \"in\"", &format!("path = \"{}\"", job.dir.path().join("in").display()))
            .replace("path = \"out/files\"", &format!("path = \"{}\"", job.out().display()))
            .replace("locations = [\"out\"]", &format!("locations = [\"{}\"]", job.dir.path().join("out").display())),
    };
    let err = off.run(None).expect_err("dead letters off").to_string();
    assert!(err.contains("job.bad_rows") && err.contains("table \"dead_letters\""), "{err}");
    assert_eq!((main_rows(&job), letters_in(&job, "dead_letters")), (rows_before, 1), "nothing written");
    assert!(!job.out().join("dl2").exists());

    let summary = job.run(None).expect("the same job resumes");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 2)), "{summary}");
    assert_eq!((main_rows(&job), letters_in(&job, "dead_letters")), (998, 2));
}

/// `sluice state --drop-pending`: the dropped checkpoint's dead letters
/// never land, and they leave every count: `job.max_bad_rows` (a count
/// over the job), the summary and `sluice state`.
#[test]
fn a_dropped_checkpoints_dead_letters_leave_every_count() {
    let job = files_job("dl-drop", 200, "max_bad_rows = 1");
    write_csv(job.dir.path(), "part-0.csv", 0..200, |_| false);
    write_csv(job.dir.path(), "part-1.csv", 200..1000, |id| id == 300 || id == 700);
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    let loaded = job.load(&[]).expect("job");
    let state = sluice::engine::state::inspect(&loaded).expect("state").to_string();
    assert!(state.contains("1 records that did not convert") && state.contains("1 of them in pending"), "{state}");
    let dropped = sluice::engine::state::drop_pending(&loaded, 2).expect("drop");
    assert_eq!(dropped.bad, 1);
    let summary = job.run(None).unwrap_or_else(|e| panic!("one dead letter is within the limit: {e}"));
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 1)), "{summary}");
    assert_eq!(letters_in(&job, "dead_letters"), 1, "record 700 only: checkpoint 2 was given up");
    let state = sluice::engine::state::inspect(&loaded).expect("state").to_string();
    assert!(state.contains("bad rows:     1 records"), "{state}");
}

fn bq_field(name: &str, ty: Type, max_length: i64) -> TableFieldSchema {
    TableFieldSchema {
        name: name.into(),
        r#type: ty as i32,
        mode: Mode::Nullable as i32,
        max_length,
        ..Default::default()
    }
}

fn bq_double() -> (BigQueryDouble, &'static str, &'static str) {
    let d = BigQueryDouble::start().expect("double");
    let orders = "projects/p/datasets/d/tables/orders";
    let letters = "projects/p/datasets/d/tables/dead_letters";
    // Every name the source has is longer than the column allows.
    d.create_table(
        orders,
        TableSchema { fields: vec![bq_field("id", Type::Int64, 0), bq_field("name", Type::String, 1)] },
    );
    let text = |n: &str| bq_field(n, Type::String, 0);
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
                bq_field("checkpoint", Type::Int64, 0),
            ],
        },
    );
    (d, orders, letters)
}

fn bq_job(id: &str, d: &BigQueryDouble, rows: u64, extra: &str) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("in/orders");
    std::fs::create_dir_all(&input).expect("input");
    let text: String =
        std::iter::once("id,name\n".to_string()).chain((0..rows).map(|id| format!("{id},toolong\n"))).collect();
    std::fs::write(input.join("part-0.csv"), text).expect("csv");
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = 1
state_dir = "state"
bad_rows = "dead-letter"
{extra}
[job.checkpoint]
every_rows = 100000
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 10
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
    TestJob { dir, toml }
}

/// A sink that rejects every row (one column narrower than all the data):
/// with `max_bad_rows = 5` the run started again to set the first
/// rejected request's rows aside stops before it reads on, since they
/// alone pass the limit; nothing lands. With no limit, every row lands as
/// a dead letter, once.
#[test]
fn a_sink_that_rejects_every_row_is_stopped_by_a_count_at_once() {
    let (d, orders, letters) = bq_double();
    let job = bq_job("dl-bq-limit", &d, 300, "max_bad_rows = 5");
    let err = job.run(None).expect_err("too many");
    assert!(matches!(err, EngineError::TooManyBadRows(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("the sink rejected ") && text.contains("(5 over the job)"), "{text}");
    assert!(text.contains("part-0.csv record 1,"), "the rejected records are named: {text}");
    let runs = sluice::engine::state::inspect(&job.load(&[]).expect("job")).expect("state").runs;
    assert!(runs <= 2, "one run, and the one started again that stopped: {runs}");
    assert_eq!((d.visible_count(orders), d.visible_count(letters)), (0, 0));

    let (d, orders, letters) = bq_double();
    let job = bq_job("dl-bq-all", &d, 40, "");
    let summary = job.run(None).expect("every row a dead letter");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 40)), "{summary}");
    assert_eq!((d.visible_count(orders), d.visible_count(letters)), (0, 40));
}

/// `sluice_bad_rows_total` after a recovery: a checkpoint persisted by a
/// run that crashed before its commit is committed by the next run, which
/// counts it from its record; checkpoints committed before the crash are
/// not counted again (one registry over both runs).
#[test]
fn a_recovered_checkpoints_dead_letters_are_counted_once() {
    let job = files_job("dl-metric", 200, "");
    write_csv(job.dir.path(), "part-0.csv", 0..200, |_| false);
    write_csv(job.dir.path(), "part-1.csv", 200..1000, |id| id == 300 || id == 700);
    let metrics = sluice::metrics::Metrics::new();
    let opts = |fault: Option<Fault>| sluice::engine::RunOptions {
        metrics: metrics.clone(),
        faults: sluice::engine::Faults { crash: fault, ..Default::default() },
        ..Default::default()
    };
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run_opts(&[], opts(Some(fault))).expect_err("crash").is_injected_crash());
    job.run_opts(&[], opts(None)).expect("recovers");
    assert_eq!(letters_in(&job, "dead_letters"), 2, "both dead letters landed");
    let text = metrics.prometheus_text();
    assert!(text.contains("sluice_bad_rows_total{job=\"dl-metric\",table=\"\"} 2\n"), "{text}");
    assert!(text.contains("sluice_rows_total{job=\"dl-metric\",table=\"\"} 998\n"), "{text}");
}
