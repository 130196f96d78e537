//! Many tables per sink and schema changes during a run (contract 0.2),
//! through the files sink: a generator of three tables, one of which appears
//! late, whose rows change shape halfway (`qty` widened, `tag` added). Every
//! table holds every row exactly once, old rows with null in `tag`, also
//! after a crash at any step, barriers included.

use sluice::bindings::CommitOutcome;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice::source::generator::Generator;
use sluice_tests::TestJob;
use sluice_tests::tables::{TABLES, assert_table, read_files_table, sets};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
const EVERY: u64 = 500;

fn job(id: &str) -> TestJob {
    TestJob::files(id, ROWS, PARALLELISM, EVERY)
}

fn run(job: &TestJob, fault: Option<Fault>) -> Result<sluice::engine::RunSummary, EngineError> {
    let sets = sets(ROWS);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    job.run_with(&sets, fault)
}

fn assert_all_tables(job: &TestJob) {
    let target = Generator::evolved_schema();
    for (t, table) in TABLES.iter().enumerate() {
        let visible = read_files_table(&job.out().join(table), &target);
        assert_table(&visible, ROWS, t);
    }
}

#[test]
fn three_tables_and_a_schema_change_land_exactly_once() {
    let job = job("tables");
    let summary = run(&job, None).expect("runs");
    assert_eq!(summary.rows_total, ROWS);
    assert_all_tables(&job);
    // One barrier gathers the new table and every table's change: 4 rounds
    // of 500 rows per subtask, plus the round the barrier cut short.
    assert_eq!(summary.checkpoints_this_run, 5, "{summary}");
    // Files keep the shape they were written in: the first checkpoint's
    // `orders` files have no `tag`, the last one's do, with `qty` widened.
    let mut dirs: Vec<_> =
        std::fs::read_dir(job.out().join("orders")).expect("orders").flatten().map(|e| e.path()).collect();
    dirs.sort();
    let schema_of = |dir: &std::path::Path| {
        let file = std::fs::read_dir(dir).expect("dir").flatten().next().expect("a file").path();
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(file).expect("open"),
        )
        .expect("parquet");
        reader.schema().clone()
    };
    let (first, last) = (schema_of(&dirs[0]), schema_of(&dirs[dirs.len() - 1]));
    assert!(first.field_with_name("tag").is_err(), "{first:?}");
    assert_eq!(last.field_with_name("qty").expect("qty").data_type(), &arrow_schema::DataType::Int64);
    assert!(last.field_with_name("tag").is_ok(), "{last:?}");
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let job = job(&format!("tables-{point}-{checkpoint}"));
    let fault = Fault { point, checkpoint, subtask: 1 };
    let err = run(&job, Some(fault)).expect_err("the injected crash stops the run");
    assert!(err.is_injected_crash(), "expected the injected crash, got: {err}");
    let summary = run(&job, None).expect("the recovery run completes");
    assert_eq!(summary.rows_total, ROWS);
    assert_all_tables(&job);
    for (c, outcome) in &summary.recovered {
        assert!(matches!(outcome, CommitOutcome::Committed | CommitOutcome::AlreadyCommitted), "{c}: {outcome:?}");
    }
}

// Checkpoint 1 ends at the barrier where `events` appears and the rows of
// subtask 2 change shape (the reading ahead gathers every table's change
// into that one barrier). The files sink's `evolve` has no side effect, so
// `DuringEvolve` is crashed in the Iceberg tests.
sluice_tests::crash_tests! {
    after_write_at_barrier: CrashPoint::AfterWrite, 1;
    after_write: CrashPoint::AfterWrite, 3;
    after_prepare_commit_at_barrier: CrashPoint::AfterPrepareCommit, 1;
    after_snapshot_state: CrashPoint::AfterSnapshotState, 2;
    after_persist_at_barrier: CrashPoint::AfterPersist, 1;
    after_persist: CrashPoint::AfterPersist, 3;
    during_commit_at_barrier: CrashPoint::DuringCommit, 1;
    during_commit: CrashPoint::DuringCommit, 4;
    after_commit_at_barrier: CrashPoint::AfterCommit, 1;
    after_evolve: CrashPoint::AfterEvolve, 1;
}

/// A source that narrows a type (or drops a column) after sending the wider
/// shape is refused, naming the table and the column; the rows before the
/// change are committed, none after it, and a rerun stops at the same place.
#[test]
fn a_narrowed_type_is_refused_naming_table_and_column() {
    use std::sync::Arc;

    use arrow_array::{Int32Array, Int64Array, RecordBatch};
    use arrow_schema::{DataType, Field, Schema};

    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("input/orders");
    std::fs::create_dir_all(&input).expect("input");
    let write = |name: &str, qty_type: DataType, ids: Vec<i64>| {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("qty", qty_type.clone(), false),
        ]));
        let qty: arrow_array::ArrayRef = match qty_type {
            DataType::Int64 => Arc::new(Int64Array::from(ids.clone())),
            _ => Arc::new(Int32Array::from(ids.iter().map(|i| *i as i32).collect::<Vec<_>>())),
        };
        let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int64Array::from(ids)), qty]).expect("batch");
        let file = std::fs::File::create(input.join(name)).expect("file");
        let mut w = parquet::arrow::ArrowWriter::try_new(file, schema, None).expect("writer");
        w.write(&batch).expect("write");
        w.close().expect("close");
    };
    write("1.parquet", DataType::Int64, vec![1, 2]);
    write("2.parquet", DataType::Int32, vec![3]);
    let toml = format!(
        r#"[job]
id = "narrow"
state_dir = "state"
[source]
kind = "file"
path = "input"
[sink]
id = "out"
plugin = "{}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#,
        sluice_tests::FILES_PLUGIN
    );
    let job = TestJob { dir, toml };
    for _ in 0..2 {
        let err = job.run(None).expect_err("the narrowed column is refused").to_string();
        assert!(err.contains("\"orders\"") && err.contains("narrows column `qty` from Int64 to Int32"), "{err}");
    }
    let landed = sluice_tests::count_visible(&job.out().join("orders"));
    assert_eq!(landed, 2, "the rows before the change land, none after it");
}

mod iceberg {
    use super::*;
    use sluice_tests::{python, read_iceberg_as};

    fn job(id: &str, warehouse: &std::path::Path) -> TestJob {
        TestJob::iceberg(id, warehouse, "lake.{table}", ROWS, 0, PARALLELISM, EVERY)
    }

    fn assert_iceberg_tables(warehouse: &std::path::Path) {
        let catalog = sluice_tests::catalog(warehouse);
        let target = Generator::evolved_schema();
        for (t, table) in TABLES.iter().enumerate() {
            let read = read_iceberg_as(&catalog, &format!("lake.{table}"), &target);
            assert_table(&read.rows, ROWS, t);
            read.assert_no_checkpoint_twice();
        }
    }

    /// Three Iceberg tables, `events` created when it appears, every schema
    /// evolved with new field ids; PyIceberg reads each with its evolved
    /// schema, every row once, and null in `tag` for the rows written before.
    #[test]
    fn iceberg_tables_evolve_and_pyiceberg_reads_them() {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let job = job("ice-tables", warehouse.path());
        run(&job, None).expect("runs");
        assert_iceberg_tables(warehouse.path());

        let out = python(
            "import sys, json\n\
             from pyiceberg.catalog.sql import SqlCatalog\n\
             w, k = sys.argv[1], int(sys.argv[2])\n\
             cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
             out = {}\n\
             for name in ['orders', 'users', 'events']:\n\
             \x20   t = cat.load_table(f'lake.{name}')\n\
             \x20   a = t.scan().to_arrow()\n\
             \x20   ids, tags = a.column('id').to_pylist(), a.column('tag').to_pylist()\n\
             \x20   out[name] = {\n\
             \x20       'rows': len(ids), 'distinct': len(set(ids)), 'sum': sum(ids),\n\
             \x20       'old_tags': sum(1 for i, g in zip(ids, tags) if i < k and g is not None),\n\
             \x20       'new_tags': sum(1 for i, g in zip(ids, tags) if i >= k and g is not None),\n\
             \x20       'schema': [f.name + ':' + str(f.type) for f in a.schema],\n\
             \x20       'field_ids': [f.field_id for f in t.schema().fields],\n\
             \x20   }\n\
             print(json.dumps(out))",
            &[&warehouse.path().display().to_string(), &(ROWS / 2).to_string()],
        )
        .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        for (t, table) in TABLES.iter().enumerate() {
            let expected = sluice_tests::tables::expected(ROWS, t);
            let ids = sluice_tests::ids(&expected);
            let got = &v[table];
            assert_eq!(got["rows"], ids.len(), "{table}: {got}");
            assert_eq!(got["distinct"], ids.len(), "{table}: {got}");
            assert_eq!(got["sum"], ids.iter().sum::<i64>(), "{table}: {got}");
            assert_eq!(got["old_tags"], 0, "{table}: rows from before the change read null in `tag`: {got}");
            let new_tags = ids.iter().filter(|i| **i >= (ROWS / 2) as i64 && *i % 3 != 0).count();
            assert_eq!(got["new_tags"], new_tags, "{table}: {got}");
            let schema: Vec<String> = serde_json::from_value(got["schema"].clone()).expect("schema");
            assert!(schema.contains(&"qty:int64".to_string()), "{table}: {schema:?}");
            assert!(schema.iter().any(|f| f.starts_with("tag:") && f.contains("string")), "{table}: {schema:?}");
            let field_ids: Vec<i64> = serde_json::from_value(got["field_ids"].clone()).expect("field ids");
            let mut unique = field_ids.clone();
            unique.dedup();
            assert_eq!(unique.len(), 9, "the new column has a field id of its own: {field_ids:?}");
        }
    }

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let job = job(&format!("ice-tables-{point}-{checkpoint}"), warehouse.path());
        let fault = Fault { point, checkpoint, subtask: 1 };
        let err = run(&job, Some(fault)).expect_err("the injected crash stops the run");
        assert!(err.is_injected_crash(), "expected the injected crash, got: {err}");
        run(&job, None).expect("the recovery run completes");
        assert_iceberg_tables(warehouse.path());
    }

    // Checkpoint 1 is the barrier: its commit touches two tables, then
    // `evolve` creates `events` and alters all three.
    sluice_tests::crash_tests! {
        ice_during_commit_of_two_tables: CrashPoint::DuringCommit, 1;
        ice_during_evolve: CrashPoint::DuringEvolve, 1;
        ice_after_evolve: CrashPoint::AfterEvolve, 1;
        ice_after_persist: CrashPoint::AfterPersist, 3;
        ice_during_commit: CrashPoint::DuringCommit, 3;
    }
}

mod bigquery {
    use super::*;
    use sluice_bigquery_double::{BigQueryDouble, EtagMode, RestFault};
    use sluice_tests::bigquery_rows_evolved;

    const PATTERN: &str = "projects/p/datasets/lake/tables/{table}";

    fn table(name: &str) -> String {
        PATTERN.replace("{table}", name)
    }

    fn job(id: &str, d: &BigQueryDouble) -> (TestJob, String) {
        let job = TestJob::bigquery(id, &d.address(), PATTERN, ROWS, PARALLELISM, EVERY);
        (job, format!("sink.http.bigquery.address={:?}", d.rest_address()))
    }

    fn run_bq(job: &TestJob, http: &str, fault: Option<Fault>) -> Result<sluice::engine::RunSummary, EngineError> {
        let mut sets = sets(ROWS);
        sets.push(http.to_string());
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        job.run_with(&sets, fault)
    }

    fn assert_bigquery_tables(d: &BigQueryDouble) {
        for (t, name) in TABLES.iter().enumerate() {
            let visible = bigquery_rows_evolved(&d.visible_rows(&table(name)));
            assert_table(&visible, ROWS, t);
            // The table took the new column through tables.patch.
            let schema = d.table_schema(&table(name)).expect("the table exists");
            let tag = schema.fields.iter().find(|f| f.name == "tag").expect("`tag` was added");
            assert_eq!(tag.mode, sluice_bigquery_double::proto::table_field_schema::Mode::Nullable as i32);
        }
    }

    /// The sink creates the tables through the BigQuery API (`events` when it
    /// appears), patches each schema once, and moves its writers to new
    /// streams for the new shape; every row lands once, old rows without `tag`.
    #[test]
    fn bigquery_tables_are_created_and_evolved_through_the_api() {
        let d = BigQueryDouble::start().expect("double");
        let (job, http) = job("bq-tables", &d);
        run_bq(&job, &http, None).expect("runs");
        assert_bigquery_tables(&d);
        // One creation per table, and the dataset's claim (`guest/bigquery/src/claim.rs`).
        assert_eq!(d.rest_calls("tables.insert"), 4, "one creation per table and one claim");
        assert!(d.table_schema("projects/p/datasets/lake/tables/_sluice_claim_9_bq-tables_bq").is_some());
        // `orders` and `users` are created in the old shape and patched once;
        // `events` is created at the barrier that also brings the new shape
        // (subtask 2 starts past the change), so it is born evolved.
        assert_eq!(d.rest_calls("tables.patch"), 2, "one schema change per table created before the change");
    }

    /// Both readings of `If-Match` (honoured or ignored), a lost reply to a
    /// patch, and a crash at the barrier: still every row once.
    #[test]
    fn evolution_survives_lost_replies_and_either_etag_reading() {
        for (mode, point) in [(EtagMode::Honour, CrashPoint::AfterEvolve), (EtagMode::Ignore, CrashPoint::DuringEvolve)]
        {
            let d = BigQueryDouble::start().expect("double");
            d.etag_mode(mode);
            d.inject_rest("tables.patch", 1, RestFault::ApplyThenFail);
            d.inject_rest("tables.insert", 2, RestFault::FailBeforeApply);
            d.inject_rest("tables.insert", 3, RestFault::ApplyThenFail);
            let (job, http) = job(&format!("bq-tables-{point}"), &d);
            let fault = Fault { point, checkpoint: 1, subtask: 0 };
            let err = run_bq(&job, &http, Some(fault)).expect_err("crash");
            assert!(err.is_injected_crash(), "{mode:?}: {err}");
            run_bq(&job, &http, None).unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            assert_bigquery_tables(&d);
        }
    }
}

/// `examples/lakehouse.toml`: a folder of CSV exports with three tables and
/// a schema change, into the local Iceberg warehouse, read back by PyIceberg.
mod lakehouse {
    use std::path::{Path, PathBuf};

    use sluice_tests::{ICEBERG_PLUGIN, TestJob, python, rerun_to_end, run_and_kill, run_example};

    fn examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
    }

    /// What PyIceberg reads of each table: rows, distinct keys, smallest
    /// and largest key, and orders' `coupon` values before and after the change.
    fn assert_lakehouse(warehouse: &Path) {
        let out = python(
            "import sys, json\n\
             from pyiceberg.catalog.sql import SqlCatalog\n\
             w = sys.argv[1]\n\
             cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
             out = {}\n\
             for name, key in [('customers', 'customer_id'), ('orders', 'order_id'), ('payments', 'payment_id')]:\n\
             \x20   a = cat.load_table(f'lake.{name}').scan().to_arrow()\n\
             \x20   keys = a.column(key).to_pylist()\n\
             \x20   out[name] = {'rows': len(keys), 'distinct': len(set(keys)), 'min': min(keys), 'max': max(keys),\n\
             \x20                 'columns': a.schema.names}\n\
             \x20   if name == 'orders':\n\
             \x20       c = a.column('coupon').to_pylist()\n\
             \x20       out[name]['old_coupons'] = sum(1 for k, v in zip(keys, c) if k <= 2000 and v is not None)\n\
             \x20       out[name]['new_coupons'] = sum(1 for k, v in zip(keys, c) if k > 2000 and v is not None)\n\
             print(json.dumps(out))",
            &[&warehouse.display().to_string()],
        )
        .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        for (table, rows) in [("customers", 400), ("orders", 3000), ("payments", 1600)] {
            let t = &v[table];
            assert_eq!(
                (&t["rows"], &t["distinct"], &t["min"], &t["max"]),
                (&rows.into(), &rows.into(), &1.into(), &rows.into()),
                "{table}: {t}"
            );
        }
        let orders = &v["orders"];
        assert!(orders["columns"].as_array().expect("columns").iter().any(|c| c == "coupon"), "{orders}");
        assert_eq!(orders["old_coupons"], 0, "orders from before the change read null: {orders}");
        assert_eq!(orders["new_coupons"], 666, "{orders}");
    }

    #[test]
    fn lakehouse_example_lands_three_tables_and_the_new_column() {
        let dir = tempfile::tempdir().expect("dir");
        let wh = dir.path().join("warehouse");
        let sets = [
            format!("sink.plugin={ICEBERG_PLUGIN}"),
            format!("job.state_dir={}", dir.path().join("state").display()),
            format!("sink.catalog.database={}", wh.join("catalog.db").display()),
            format!("sink.catalog.warehouse={}", wh.display()),
        ];
        let (code, stdout, err) = run_example("lakehouse.toml", &sets, dir.path());
        assert_eq!(code, 0, "{err}");
        assert!(stdout.contains("job lakehouse-demo finished: 5000 rows"), "{stdout}");
        assert!(err.contains("table lake.orders: schema evolved"), "{err}");
        assert_lakehouse(&wh);
    }

    fn data_files(dir: &Path) -> u64 {
        let mut n = 0;
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.is_dir() {
                n += data_files(&p);
            } else if p.extension().is_some_and(|e| e == "parquet") {
                n += 1;
            }
        }
        n
    }

    /// The lakehouse job, slowed down and SIGKILLed twice mid-way, then run
    /// to its end: every table holds every row once.
    #[test]
    fn sigkill_the_lakehouse_job_twice_then_rerun() {
        let dir = tempfile::tempdir().expect("dir");
        let text = std::fs::read_to_string(examples().join("lakehouse.toml")).expect("example");
        let data = examples().join("data/lakehouse").canonicalize().expect("data");
        let toml = text
            .replace("path = \"data/lakehouse\"", &format!("path = \"{}\"\nrate = 1500.0", data.display()))
            .replace("every_rows = 500", "every_rows = 150")
            .replace("state_dir = \"../out/state/lakehouse-demo\"", "state_dir = \"state\"")
            .replace("../out/warehouse", "warehouse")
            .replace(
                "plugin = \"${SLUICE_PLUGIN_DIR:-../target/guests/wasm32-wasip2/release}/sluice_sink_iceberg.wasm\"",
                &format!("plugin = \"{ICEBERG_PLUGIN}\""),
            );
        let job = TestJob { dir, toml };
        job.load(&[]).expect("valid job");
        let wh = job.dir.path().join("warehouse");
        run_and_kill(&job, || data_files(&wh), 4);
        let first = data_files(&wh);
        run_and_kill(&job, || data_files(&wh), first + 6);
        let stdout = rerun_to_end(&job, &[]);
        assert!(stdout.contains("5000 rows in total") && stdout.contains("attempt 3"), "{stdout}");
        assert_lakehouse(&wh);
    }

    /// Copies the lakehouse data with line 500 of `orders-2024-02.csv`
    /// holding `x7` for `qty` (it holds an integer).
    fn lakehouse_with_a_bad_qty(dir: &Path) -> PathBuf {
        let data = dir.join("lakehouse");
        for table in ["customers", "orders", "payments"] {
            std::fs::create_dir_all(data.join(table)).expect("folder");
            for entry in std::fs::read_dir(examples().join("data/lakehouse").join(table)).expect("data").flatten() {
                std::fs::copy(entry.path(), data.join(table).join(entry.file_name())).expect("copy");
            }
        }
        let file = data.join("orders/orders-2024-02.csv");
        let text = std::fs::read_to_string(&file).expect("orders");
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        let mut fields: Vec<&str> = lines[499].split(',').collect();
        assert!(fields[2].parse::<i64>().is_ok(), "line 500 of the example: {}", lines[499]);
        fields[2] = "x7";
        lines[499] = fields.join(",");
        std::fs::write(&file, lines.join("\n") + "\n").expect("write");
        data
    }

    /// One bad value in a later file of a table is named where it is (the
    /// file, the line, the column, the value and the type), not reported
    /// as a schema change; what was committed before stays committed.
    #[test]
    fn a_bad_csv_value_is_named_by_file_line_and_column() {
        let dir = tempfile::tempdir().expect("dir");
        let data = lakehouse_with_a_bad_qty(dir.path());
        let wh = dir.path().join("warehouse");
        let sets = [
            format!("sink.plugin={ICEBERG_PLUGIN}"),
            format!("job.state_dir={}", dir.path().join("state").display()),
            format!("sink.catalog.database={}", wh.join("catalog.db").display()),
            format!("sink.catalog.warehouse={}", wh.display()),
            format!("source.path={}", data.display()),
        ];
        let (code, _, err) = run_example("lakehouse.toml", &sets, dir.path());
        assert_ne!(code, 0, "{err}");
        assert!(
            err.contains("orders-2024-02.csv")
                && err.contains("line 500: column `qty` holds \"x7\", which is not a valid Int64"),
            "{err}"
        );
        assert!(!err.contains("changes column qty"), "{err}");
    }

    /// The same input with `job.bad_rows = "dead-letter"`: every good row
    /// lands once, compared by value with the CSV files, and the bad record
    /// is in `lake.dead_letters` with its position, its text and the reason.
    #[test]
    fn a_bad_csv_value_goes_to_the_dead_letter_table() {
        let dir = tempfile::tempdir().expect("dir");
        let data = lakehouse_with_a_bad_qty(dir.path());
        let wh = dir.path().join("warehouse");
        let sets = [
            format!("sink.plugin={ICEBERG_PLUGIN}"),
            format!("job.state_dir={}", dir.path().join("state").display()),
            format!("sink.catalog.database={}", wh.join("catalog.db").display()),
            format!("sink.catalog.warehouse={}", wh.display()),
            format!("source.path={}", data.display()),
            "job.bad_rows=dead-letter".to_string(),
            "job.dead_letter.table=dead_letters".to_string(),
        ];
        let (code, stdout, err) = run_example("lakehouse.toml", &sets, dir.path());
        assert_eq!(code, 0, "{err}");
        assert!(stdout.contains("4999 rows in total") && stdout.contains("1 bad rows as dead letters"), "{stdout}");
        // What the CSV files hold: order id -> qty, and the bad record's text.
        let mut want = std::collections::BTreeMap::new();
        let mut bad_line = String::new();
        for file in ["orders-2024-01.csv", "orders-2024-02.csv", "orders-2024-03.csv"] {
            let text = std::fs::read_to_string(data.join("orders").join(file)).expect("orders");
            for (i, line) in text.lines().enumerate().skip(1) {
                let f: Vec<&str> = line.split(',').collect();
                match f[2].parse::<i64>() {
                    Ok(qty) => drop(want.insert(f[0].parse::<i64>().expect("id"), qty)),
                    Err(_) => {
                        assert_eq!((file, i + 1), ("orders-2024-02.csv", 500));
                        bad_line = line.to_string();
                    }
                }
            }
        }
        let out = python(
            "import sys, json\n\
             from pyiceberg.catalog.sql import SqlCatalog\n\
             w = sys.argv[1]\n\
             cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
             o = cat.load_table('lake.orders').scan().to_arrow()\n\
             d = cat.load_table('lake.dead_letters').scan().to_arrow()\n\
             print(json.dumps({'orders': list(zip(o.column('order_id').to_pylist(), o.column('qty').to_pylist())),\n\
             \x20                 'letters': d.to_pylist()}))",
            &[&wh.display().to_string()],
        )
        .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
        let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
        let mut orders: Vec<(i64, i64)> = serde_json::from_value(v["orders"].clone()).expect("orders");
        orders.sort_unstable();
        assert_eq!(orders, want.into_iter().collect::<Vec<_>>(), "every good order once, by value");
        let letters = v["letters"].as_array().expect("letters");
        assert_eq!(letters.len(), 1, "{letters:?}");
        let l = &letters[0];
        assert_eq!(l["raw"], bad_line.as_str(), "{l}");
        assert_eq!(l["source_position"], "orders/orders-2024-02.csv line 500", "{l}");
        assert_eq!(l["target_table"], "orders", "{l}");
        assert_eq!(l["job"], "lakehouse-demo", "{l}");
        let reason = l["reason"].as_str().expect("reason");
        assert!(reason.contains("column `qty` holds \"x7\", which is not a valid Int64"), "{reason}");
        assert!(l["checkpoint"].as_i64().is_some_and(|c| c >= 1) && l["incarnation"].is_string(), "{l}");
    }
}
