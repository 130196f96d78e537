//! The files sink's output is plain Parquet: pyarrow and DuckDB read the same
//! rows Sluice wrote, and never see staged files.

use sluice_tests::{TestJob, assert_exactly_once, python, read_visible};

const ROWS: u64 = 5000;

fn expected_ids() -> Vec<i64> {
    (0..ROWS as i64).collect()
}

#[test]
fn pyarrow_and_duckdb_read_the_output() {
    let job = TestJob::files("interop", ROWS, 3, 900);
    // A crash leaves staged files behind; readers must not see them.
    let crash =
        sluice::engine::Fault { point: sluice::engine::CrashPoint::AfterSnapshotState, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    job.run(None).expect("runs");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
    let out = job.out().display().to_string();

    let pyarrow = python(
        "import sys, json, pyarrow.dataset as ds\n\
         t = ds.dataset(sys.argv[1], format='parquet').to_table()\n\
         print(json.dumps({'ids': sorted(t.column('id').to_pylist()), 'schema': [f.name + ':' + str(f.type) for f in t.schema]}))",
        &[&out],
    )
    .unwrap_or_else(|e| panic!("pyarrow failed (CI installs it: pip install pyarrow duckdb): {e}"));
    let v: serde_json::Value = serde_json::from_str(pyarrow.trim()).expect("json");
    let ids: Vec<i64> = serde_json::from_value(v["ids"].clone()).expect("ids");
    assert_eq!(ids, expected_ids());
    let schema: Vec<String> = serde_json::from_value(v["schema"].clone()).expect("schema");
    assert_eq!(
        schema,
        [
            "id:int64",
            "qty:int32",
            "price:double",
            "amount:decimal128(18, 2)",
            "name:string",
            "note:string",
            "day:date32[day]",
            "ts:timestamp[us, tz=UTC]"
        ]
    );

    let duckdb = python(
        "import sys, json, duckdb\n\
         rows = duckdb.sql(f\"select id from read_parquet('{sys.argv[1]}/**/*.parquet') order by id\").fetchall()\n\
         print(json.dumps([r[0] for r in rows]))",
        &[&out],
    )
    .unwrap_or_else(|e| panic!("duckdb failed (CI installs it: pip install duckdb): {e}"));
    let ids: Vec<i64> = serde_json::from_str(duckdb.trim()).expect("json");
    assert_eq!(ids, expected_ids(), "DuckDB sees other rows than were committed");
}
