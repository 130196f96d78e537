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

/// The Iceberg table Sluice wrote is read by PyIceberg (`SqlCatalog` on the
/// same SQLite file): rows, schema, partition spec and snapshot summaries;
/// and by DuckDB's `iceberg_scan`: the same rows.
#[test]
fn pyiceberg_reads_the_iceberg_table() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = sluice_tests::TestJob::iceberg("interop-ice", warehouse.path(), "analytics.orders", ROWS, 0, 3, 700);
    // A crash after a commit was applied, then recovery: PyIceberg must see each row once.
    let crash = sluice::engine::Fault { point: sluice::engine::CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(
        job.run_with(&["sink.options.partition_by=\"day(day)\""], Some(crash)).expect_err("crash").is_injected_crash()
    );
    job.run_with(&["sink.options.partition_by=\"day(day)\""], None).expect("runs");
    let dir = warehouse.path().display().to_string();

    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         t = cat.load_table('analytics.orders')\n\
         a = t.scan().to_arrow()\n\
         snaps = [dict(s.summary.additional_properties) for s in sorted(t.snapshots(), key=lambda s: s.sequence_number)]\n\
         print(json.dumps({\n\
           'ids': sorted(a.column('id').to_pylist()),\n\
           'schema': [f'{f.name}:{f.field_type}:{\"req\" if f.required else \"opt\"}' for f in t.schema().fields],\n\
           'spec': [f'{f.name}:{f.transform}' for f in t.spec().fields],\n\
           'snapshots': [[s.get('sluice.job-id'), s.get('sluice.sink-id'), s.get('sluice.checkpoint-id')] for s in snaps],\n\
           'amount_sum': str(sum(a.column('amount').to_pylist())),\n\
         }))",
        &[&dir],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it: pip install 'pyiceberg[sql-sqlite,pyarrow]'): {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let ids: Vec<i64> = serde_json::from_value(v["ids"].clone()).expect("ids");
    assert_eq!(ids, expected_ids(), "PyIceberg sees other rows than were committed");
    // DuckDB's own Iceberg reader, on the same partitioned table after the
    // crash and recovery, reads the same rows.
    assert_eq!(
        sluice_tests::readers_ids(warehouse.path(), "analytics.orders"),
        expected_ids(),
        "DuckDB's iceberg_scan"
    );
    let schema: Vec<String> = serde_json::from_value(v["schema"].clone()).expect("schema");
    assert_eq!(
        schema,
        [
            "id:long:req",
            "qty:int:req",
            "price:double:req",
            "amount:decimal(18, 2):req",
            "name:string:req",
            "note:string:opt",
            "day:date:req",
            "ts:timestamptz:req"
        ]
    );
    let spec: Vec<String> = serde_json::from_value(v["spec"].clone()).expect("spec");
    assert_eq!(spec, ["day_day:day"]);
    let snapshots: Vec<[String; 3]> = serde_json::from_value(v["snapshots"].clone()).expect("snapshots");
    // 5000 rows, 3 writers, 700 per writer per checkpoint: 3 non-empty checkpoints.
    let expected: Vec<[String; 3]> =
        (1..=3).map(|c| ["interop-ice".to_string(), "lake".to_string(), c.to_string()]).collect();
    assert_eq!(snapshots, expected);
    // Decimal values survive the trip: compare with the generator's own sum.
    let batch = sluice::source::generator::Generator::batch_for(0, ROWS);
    let amounts = batch
        .column_by_name("amount")
        .and_then(|c| c.as_any().downcast_ref::<arrow_array::Decimal128Array>().cloned())
        .expect("amount is decimal");
    let total: i128 = amounts.iter().flatten().sum();
    let expected_sum = format!("{}.{:02}", total / 100, (total % 100).abs());
    assert_eq!(v["amount_sum"].as_str(), Some(expected_sum.as_str()));
}
