//! A sink written in Python (`guest/python-jsonl`, built with
//! componentize-py) lands rows exactly once, with their values, as DuckDB
//! reads the JSON Lines. (It also passes the whole conformance suite, a
//! crash at every protocol step included: `tests/tests/plugin_test.rs`.)

use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::{TestJob, python};

const ROWS: u64 = 3000;
const PARALLELISM: u32 = 2;
/// Per subtask: 1500 rows in rounds of 500 → checkpoints 1..=3 hold rows.
const EVERY: u64 = 500;

/// Every visible id (sorted) and the number of rows, as DuckDB reads them.
fn visible_ids(job: &TestJob) -> Vec<i64> {
    let out = job.dir.path().join("out/jsonl");
    if !out.exists() {
        return Vec::new();
    }
    let text = python(
        "import sys, json, glob, duckdb\n\
         files = glob.glob(sys.argv[1] + '/**/*.jsonl', recursive=True)\n\
         rows = duckdb.sql(f\"select id from read_json_auto({files!r}) order by id\").fetchall() if files else []\n\
         print(json.dumps([r[0] for r in rows]))",
        &[&out.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("duckdb could not read the JSON Lines: {e}"));
    serde_json::from_str(text.trim()).expect("a JSON list of ids")
}

fn assert_every_id_once(job: &TestJob, rows: u64) {
    let ids = visible_ids(job);
    let expected: Vec<i64> = (0..rows as i64).collect();
    assert_eq!(ids.len(), expected.len(), "visible rows");
    assert_eq!(ids, expected, "every id exactly once");
}

#[test]
fn python_sink_replays_batched_differently_and_values_survive() {
    let job = TestJob::python_jsonl("py-rebatch", ROWS, PARALLELISM, EVERY);
    let first = Fault { point: CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(first)).expect_err("crash").is_injected_crash());
    let second = Fault { point: CrashPoint::DuringCommit, checkpoint: 3, subtask: 0 };
    assert!(job.run_with(&["source.batch_rows=333"], Some(second)).expect_err("crash").is_injected_crash());
    let summary = job.run_with(&["source.batch_rows=1001"], None).expect("completes");
    assert_eq!(summary.recovered, vec![(3, CommitOutcome::AlreadyCommitted)]);
    assert_every_id_once(&job, ROWS);

    // Values, not just ids: the row the generator makes for id 7, as DuckDB
    // reads it (decimals as exact text, dates, UTC timestamps, nulls).
    let out = job.dir.path().join("out/jsonl").display().to_string();
    let row = python(
        "import sys, json, glob, duckdb\n\
         files = glob.glob(sys.argv[1] + '/**/*.jsonl', recursive=True)\n\
         r = duckdb.sql(f\"select id, qty, price, amount, name, note, cast(day as varchar), epoch_us(ts) from read_json_auto({files!r}) where id in (3, 7) order by id\").fetchall()\n\
         print(json.dumps(r))",
        &[&out],
    )
    .expect("duckdb reads the rows");
    let rows: serde_json::Value = serde_json::from_str(row.trim()).expect("json");
    let batch = sluice::source::generator::Generator::batch_for(0, 8);
    let expected = |i: usize| -> serde_json::Value {
        use arrow_array::Array;
        use arrow_array::cast::AsArray;
        use arrow_array::types::{Date32Type, Decimal128Type, Float64Type, Int32Type, TimestampMicrosecondType};
        let amount = batch.column(3).as_primitive::<Decimal128Type>();
        let note = batch.column(5).as_string::<i32>();
        let day = batch.column(6).as_primitive::<Date32Type>().value_as_date(i).expect("date");
        serde_json::json!([
            i,
            batch.column(1).as_primitive::<Int32Type>().value(i),
            batch.column(2).as_primitive::<Float64Type>().value(i),
            amount.value_as_string(i),
            batch.column(4).as_string::<i32>().value(i),
            if note.is_null(i) { serde_json::Value::Null } else { note.value(i).into() },
            day.to_string(),
            batch.column(7).as_primitive::<TimestampMicrosecondType>().value(i),
        ])
    };
    // id 3 has a null note (the generator nulls every 7th from 3).
    assert_eq!(rows, serde_json::json!([expected(3), expected(7)]));
}

#[test]
fn python_sink_refuses_another_incarnations_output() {
    let job = TestJob::python_jsonl("py-incarnation", 1000, 1, 500);
    job.run(None).expect("first run");
    // The same job with a fresh state directory must not land anything.
    let err = job.run_with(&["job.state_dir=state-fresh"], None).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("already holds committed checkpoints"), "{message}");
    assert!(message.contains("--new-incarnation"), "{message}");
    assert_every_id_once(&job, 1000);
}

/// `format = "parquet"`: the Python sink hands each batch, as the engine
/// encoded it, to a Parquet file the host encodes (`columnar`); a crash
/// after a persisted checkpoint is recovered, and DuckDB reads every id
/// once with its values.
#[test]
fn python_sink_lands_parquet_through_the_host_that_duckdb_reads() {
    let job = TestJob::python_jsonl("py-parquet", ROWS, PARALLELISM, EVERY);
    let parquet = "sink.options.format=\"parquet\"";
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&[parquet], Some(crash)).expect_err("crash").is_injected_crash());
    let summary = job.run_with(&[parquet], None).expect("completes");
    assert_eq!(summary.rows_total, ROWS);
    let out = job.dir.path().join("out/jsonl").display().to_string();
    let text = python(
        "import sys, json, glob, duckdb\n\
         files = glob.glob(sys.argv[1] + '/**/*.parquet', recursive=True)\n\
         assert files and not glob.glob(sys.argv[1] + '/**/*.jsonl', recursive=True), files\n\
         ids = [r[0] for r in duckdb.sql(f\"select id from read_parquet({files!r}) order by id\").fetchall()]\n\
         r = duckdb.sql(f\"select id, qty, price, cast(amount as varchar), name, note, cast(day as varchar), epoch_us(ts) from read_parquet({files!r}) where id = 3\").fetchall()\n\
         print(json.dumps({'ids': ids, 'row': [list(x) for x in r], 'files': len(files)}))",
        &[&out],
    )
    .unwrap_or_else(|e| panic!("duckdb could not read the Parquet files: {e}"));
    let got: serde_json::Value = serde_json::from_str(text.trim()).expect("json");
    let ids: Vec<i64> = serde_json::from_value(got["ids"].clone()).expect("ids");
    assert_eq!(ids, (0..ROWS as i64).collect::<Vec<_>>(), "every id exactly once");
    // id 3 as the generator makes it (its note is null).
    let batch = sluice::source::generator::Generator::batch_for(3, 4);
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Decimal128Type, Float64Type, Int32Type, TimestampMicrosecondType};
    let day = batch.column(6).as_primitive::<arrow_array::types::Date32Type>().value_as_date(0).expect("date");
    let expected = serde_json::json!([[
        3,
        batch.column(1).as_primitive::<Int32Type>().value(0),
        batch.column(2).as_primitive::<Float64Type>().value(0),
        batch.column(3).as_primitive::<Decimal128Type>().value_as_string(0),
        batch.column(4).as_string::<i32>().value(0),
        serde_json::Value::Null,
        day.to_string(),
        batch.column(7).as_primitive::<TimestampMicrosecondType>().value(0),
    ]]);
    assert_eq!(got["row"], expected);
}
