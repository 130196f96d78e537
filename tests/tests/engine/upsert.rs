//! The Iceberg sink's `mode = "upsert"` (issue 41): a change stream over
//! several JSON-lines files (inserts, updates of rows from earlier
//! checkpoints, deletes, re-inserts, one key several times in a row) lands
//! each key in its last state, exactly once, with v2 position deletes,
//! across parallelism 2, crashes at every step of a checkpoint, catalog
//! faults, and another writer appending between checkpoints.
//!
//! Every table is read back by PyIceberg and by DuckDB's `iceberg_scan`,
//! which must agree, and by the host's iceberg-rust reader, and compared
//! key by key with the model the test computes from the same lines.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use sluice::engine::{CrashPoint, Fault, RunOptions};
use sluice_tests::changes::{
    self, Change, Row, assert_each_key_once, assert_states_of_the_stream, model, write_changes as write_stream,
};
use sluice_tests::{DUCKDB_ICEBERG, ICEBERG_PLUGIN, TestJob, python};

const TABLE: &str = "crm.customers";

/// A change-stream job over `in/*.jsonl` (`op` the change column, `id`
/// the key) into `TABLE` of `warehouse`, in upsert mode.
fn job(id: &str, warehouse: &Path, parallelism: u32, every_rows: u64) -> TestJob {
    changes::upsert_job(id, warehouse, TABLE, parallelism, every_rows, "batch_rows = 3", "key = \"id\"")
}

/// The change stream, three files in name order. Updates reach rows of
/// earlier files (earlier checkpoints), keys are deleted and inserted
/// again, and a key changes several times within a few lines; every
/// spelling of an operation appears.
fn stream() -> Vec<Vec<Change>> {
    vec![
        (1..=12).map(|i| ("insert", i, 1)).collect(),
        vec![
            ("update", 1, 2),
            ("u", 2, 2),
            ("UPDATE", 3, 2),
            ("update", 4, 2),
            ("delete", 5, 0),
            ("d", 6, 0),
            ("c", 13, 1),
            ("insert", 14, 1),
            ("update", 7, 2),
            ("update", 7, 3),
            ("Delete", 7, 0),
            ("insert", 7, 4),
        ],
        vec![
            ("insert", 5, 4),
            ("delete", 1, 0),
            ("update", 2, 5),
            ("delete", 13, 0),
            ("c", 15, 1),
            ("u", 15, 6),
            ("d", 15, 0),
            ("r", 6, 7),
            (" u ", 8, 2),
            ("c", 16, 1),
            ("D", 9, 0),
            ("update", 3, 8),
            ("update", 16, 2),
            ("update", 16, 3),
        ],
    ]
}

/// Every row of the table, sorted, as PyIceberg reads it; panics when
/// DuckDB's `iceberg_scan` or iceberg-rust reads anything else.
fn rows(warehouse: &Path) -> Vec<Row> {
    let py = changes::read_rows(warehouse, TABLE, None);
    assert_eq!(changes::native_rows(warehouse, TABLE), py, "iceberg-rust and PyIceberg read different rows");
    py
}

/// The table's snapshots of job `id`: (checkpoint, operation, delete files added).
fn snapshots_of(warehouse: &Path, id: &str) -> Vec<(u64, String, u64)> {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    let metadata = table.metadata();
    let mut out = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|id| metadata.snapshot_by_id(id)) {
        let props = &s.summary().additional_properties;
        if props.get("sluice.job-id").map(String::as_str) == Some(id) {
            let c = props.get("sluice.checkpoint-id").and_then(|c| c.parse().ok()).unwrap_or(0);
            let deletes = props.get("added-delete-files").and_then(|n| n.parse().ok()).unwrap_or(0);
            out.push((c, s.summary().operation.as_str().to_string(), deletes));
        }
        next = s.parent_snapshot_id();
    }
    out.reverse();
    out
}

/// At parallelism 2, with checkpoints every few rows, every key ends in
/// its last state; the checkpoints that replaced or deleted rows committed
/// one `overwrite` snapshot each, with position-delete files.
#[test]
fn a_change_stream_lands_each_key_in_its_last_state() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("cdc", warehouse.path(), 2, 4);
    write_stream(&run, &files);
    run.run(None).expect("the upsert run");
    let got = rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, model(&files));
    let snapshots = snapshots_of(warehouse.path(), "cdc");
    assert!(snapshots.len() >= 3, "several checkpoints: {snapshots:?}");
    assert!(
        snapshots.iter().any(|(_, op, deletes)| op == "overwrite" && *deletes > 0),
        "no snapshot carried position deletes: {snapshots:?}"
    );
    // A second run finds nothing new: the table is as it was.
    run.run(None).expect("the rerun");
    assert_eq!(rows(warehouse.path()), model(&files));
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job(&format!("crash-{point}-{checkpoint}"), warehouse.path(), 1, 4);
    write_stream(&run, &files);
    let err = run.run(Some(Fault { point, checkpoint, subtask: 0 })).expect_err("the crash");
    assert!(err.is_injected_crash(), "{err}");
    if sluice_tests::catalog(warehouse.path())
        .load(&iceberg::TableIdent::from_strs(TABLE.split('.')).expect("name"))
        .is_ok_and(|t| t.metadata().current_snapshot().is_some())
    {
        let mid = rows(warehouse.path());
        assert_each_key_once(&mid);
        assert_states_of_the_stream(&mid, &files);
    }
    run.run(None).expect("the recovery run");
    let got = rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, model(&files));
}

// 38 changes, 4 per checkpoint: checkpoint 4 is the first to update rows
// of earlier checkpoints, 5 deletes some, 7 to 10 re-insert and delete.
sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 5;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 4;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 6;
    crash_after_persist_first: CrashPoint::AfterPersist, 1;
    crash_after_persist: CrashPoint::AfterPersist, 5;
    crash_during_commit: CrashPoint::DuringCommit, 7;
    crash_after_commit_first: CrashPoint::AfterCommit, 1;
    crash_after_commit_middle: CrashPoint::AfterCommit, 5;
    crash_after_commit_late: CrashPoint::AfterCommit, 8;
}

/// Catalog faults on the upsert commits: a lost reply (applied) is settled
/// by the watermark, not re-applied; a conflict is retried on the new head
/// with new position deletes; a crash right after the catalog applied a
/// commit is recovered as already committed.
#[test]
fn lost_replies_conflicts_and_a_crash_after_apply_apply_each_change_once() {
    use sluice::fault::{CatalogFaults, CommitFault, Faults};
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("faulty", warehouse.path(), 1, 4);
    write_stream(&run, &files);
    // Catalog commit calls (the first creates nothing: the table is created
    // at open): c1..c3 insert, c4 on replace and delete rows.
    let faults = vec![
        (2, CommitFault::LoseReply),
        (4, CommitFault::Conflict),
        (6, CommitFault::LoseReply),
        (8, CommitFault::CrashAfterApply),
    ];
    let catalog = CatalogFaults { faults, ..CatalogFaults::default() };
    let opts = RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() };
    let err = run.run_opts(&[], opts).expect_err("the crash after apply");
    assert!(err.is_injected_crash(), "{err}");
    let mid = rows(warehouse.path());
    assert_each_key_once(&mid);
    assert_states_of_the_stream(&mid, &files);
    run.run(None).expect("the recovery run");
    assert_eq!(rows(warehouse.path()), model(&files));
    let snapshots = snapshots_of(warehouse.path(), "faulty");
    let mut checkpoints: Vec<u64> = snapshots.iter().map(|s| s.0).collect();
    checkpoints.dedup();
    assert_eq!(checkpoints.len(), snapshots.len(), "a checkpoint committed twice: {snapshots:?}");
}

/// Another job appends to the table between two checkpoints of the
/// upsert job, one of its rows with a key the stream changes later: the
/// next commit conflicts or builds on the new head, its key index reads
/// the other writer's file, and the later change replaces both rows of
/// that key. The other writer's other rows stay.
#[test]
fn another_writers_append_between_checkpoints_is_indexed_and_kept() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("cdc", warehouse.path(), 1, 4);
    write_stream(&run, &files);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 3, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("stopped after checkpoint 3").is_injected_crash());
    // The other writer: plain appends (no change stream).
    let other = {
        let dir = tempfile::tempdir().expect("dir");
        std::fs::create_dir_all(dir.path().join("in")).expect("in/");
        let text = "id,name,v\n100,n100-1,1\n3,n3-99,99\n101,n101-1,1\n";
        std::fs::write(dir.path().join("in/a.csv"), text).expect("csv");
        let w = warehouse.path().display();
        let toml = format!(
            "[job]\nid = \"other\"\nstate_dir = \"state\"\n[source]\nkind = \"file\"\npath = \"in\"\n[sink]\nid = \
             \"lake\"\nplugin = \"{ICEBERG_PLUGIN}\"\n[sink.options]\ntable = \"{TABLE}\"\n[sink.catalog]\ndatabase = \
             \"{w}/catalog.db\"\nwarehouse = \"{w}\"\n"
        );
        TestJob { dir, toml }
    };
    other.run(None).expect("the other writer's append");
    let between = rows(warehouse.path());
    assert!(between.contains(&(3, "n3-99".to_string(), 99)) && between.contains(&(3, "n3-1".to_string(), 1)));
    run.run(None).expect("the rest of the stream");
    let mut want = model(&files);
    want.push((100, "n100-1".to_string(), 1));
    want.push((101, "n101-1".to_string(), 1));
    want.sort();
    let got = rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, want);
}

/// Upsert without a change stream is refused before anything is written,
/// naming `[source] key`.
#[test]
fn upsert_without_a_source_key_is_refused_naming_it() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let run = job("nokey", warehouse.path(), 1, 4);
    let toml = run.toml.replace("change_column = \"op\"\nkey = [\"id\"]\n", "").replace("key = \"id\"\n", "");
    let run = TestJob { dir: run.dir, toml };
    std::fs::write(run.dir.path().join("in/000.jsonl"), "{\"id\": 1, \"name\": \"a\", \"v\": 1}\n").expect("jsonl");
    let err = run.run(None).expect_err("refused").to_string();
    assert!(err.contains("[source] key") && err.contains("upsert"), "{err}");
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("name");
    assert!(
        sluice_tests::catalog(warehouse.path())
            .load(&ident)
            .map_or(true, |t| t.metadata().current_snapshot().is_none()),
        "nothing is written"
    );
}

// ------------------------------------------- partitions, compaction, expiry

/// One change of a row with a region: `(op, id, region, v)`.
type Placed = (&'static str, i64, &'static str, i64);

/// [`job`] with the table partitioned by `identity(region)`.
fn partitioned_job(id: &str, warehouse: &Path, every_rows: u64) -> TestJob {
    let run = job(id, warehouse, 1, every_rows);
    let toml = run.toml.replace("key = \"id\"\n", "key = \"id\"\npartition_by = \"identity(region)\"\n");
    assert!(toml.contains("partition_by"), "the job is partitioned");
    TestJob { dir: run.dir, toml }
}

/// A stream whose updates move keys between regions (partitions), within a
/// checkpoint and across them, deletes keys and inserts them again
/// elsewhere; the last file follows a compaction in the test.
fn moving_stream() -> Vec<Vec<Placed>> {
    let region = |i: i64| ["eu", "us", "ap"][(i % 3) as usize];
    vec![
        (1..=9).map(|i| ("insert", i, region(i), 1)).collect(),
        vec![
            ("update", 1, "eu", 2),
            ("update", 2, "ap", 2),
            ("delete", 3, "", 0),
            ("update", 4, "eu", 2),
            ("insert", 10, "ap", 1),
            ("update", 5, "ap", 2),
            ("update", 1, "ap", 3),
            ("update", 7, "us", 2),
        ],
        vec![
            ("delete", 1, "", 0),
            ("insert", 3, "eu", 5),
            ("update", 2, "eu", 6),
            ("update", 6, "us", 2),
            ("delete", 10, "", 0),
            ("insert", 11, "us", 1),
            ("update", 4, "ap", 3),
        ],
        vec![
            ("update", 2, "us", 7),
            ("delete", 4, "", 0),
            ("insert", 1, "ap", 8),
            ("update", 8, "eu", 2),
            ("update", 3, "us", 6),
        ],
    ]
}

/// Writes `files` as `in/00N.jsonl`, numbered from `first`.
fn write_placed(job: &TestJob, first: usize, files: &[Vec<Placed>]) {
    for (n, lines) in files.iter().enumerate() {
        let text: String = lines
            .iter()
            .map(|(op, id, region, v)| {
                let row = serde_json::json!({"op": op, "id": id, "region": region, "v": v});
                format!("{row}\n")
            })
            .collect();
        std::fs::write(job.dir.path().join("in").join(format!("{:03}.jsonl", first + n)), text).expect("jsonl");
    }
}

/// The model of a placed stream: `(id, region, v)` of every live key.
fn placed_model(files: &[Vec<Placed>]) -> Vec<Row> {
    let mut keys: BTreeMap<i64, Row> = BTreeMap::new();
    for (op, id, region, v) in files.iter().flatten() {
        if *op == "delete" {
            keys.remove(id);
        } else {
            keys.insert(*id, (*id, region.to_string(), *v));
        }
    }
    keys.into_values().collect()
}

/// Every `(id, region, v)` of the table, sorted, as PyIceberg reads it;
/// panics when DuckDB's `iceberg_scan` or iceberg-rust reads anything else.
fn placed_rows(warehouse: &Path) -> Vec<Row> {
    read3(warehouse, "region", true)
}

/// Every `(id, <second>, v)` of the table, sorted, as PyIceberg reads it;
/// panics when DuckDB's `iceberg_scan` reads anything else, and when
/// `native`, when iceberg-rust does (its 0.10 reader has no deletion
/// vectors: not for format-version-3 tables).
fn read3(warehouse: &Path, second: &str, native: bool) -> Vec<Row> {
    let script = format!(
        "{DUCKDB_ICEBERG}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table(name)\n\
         c = sys.argv[3]\n\
         a = t.scan(selected_fields=('id', c, 'v')).to_arrow()\n\
         py = sorted([i, r, v] for i, r, v in zip(a.column('id').to_pylist(), a.column(c).to_pylist(), a.column('v').to_pylist()))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted([i, r, v] for i, r, v in con.execute(f'select id, {{c}}, v from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}}: {{py}} / {{dd}}')\n\
         print(json.dumps(py))"
    );
    let out = python(&script, &[&warehouse.display().to_string(), TABLE, second])
        .unwrap_or_else(|e| panic!("reading {TABLE} with PyIceberg and DuckDB: {e}"));
    let py: Vec<Row> = serde_json::from_str(out.trim()).expect("rows as JSON");
    if !native {
        return py;
    }
    use arrow_schema::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new(second, DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
    ]));
    let table = sluice_tests::read_iceberg_as(&sluice_tests::catalog(warehouse), TABLE, &schema);
    table.assert_no_checkpoint_twice();
    let b = &table.rows;
    let (ids, regions, vs) = (
        b.column(0).as_primitive::<Int64Type>(),
        b.column(1).as_string::<i32>(),
        b.column(2).as_primitive::<Int64Type>(),
    );
    let mut native: Vec<Row> =
        (0..b.num_rows()).map(|i| (ids.value(i), regions.value(i).to_string(), vs.value(i))).collect();
    native.sort();
    assert_eq!(native, py, "iceberg-rust and PyIceberg read different rows");
    py
}

/// The live data files and the live delete files of the table, as
/// PyIceberg's `inspect` lists them (paths without `file://`), sorted.
fn live_files(warehouse: &Path) -> (Vec<String>, Vec<String>) {
    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         paths = lambda a: sorted(p.removeprefix('file://') for p in a.column('file_path').to_pylist())\n\
         print(json.dumps([paths(t.inspect.data_files()), paths(t.inspect.delete_files())]))",
        &[&warehouse.display().to_string(), TABLE],
    )
    .unwrap_or_else(|e| panic!("listing the files of {TABLE} with PyIceberg: {e}"));
    serde_json::from_str(out.trim()).expect("files as JSON")
}

/// Every Parquet file under `warehouse`: (data files, position-delete
/// files), each sorted; the upsert committer writes its delete files under
/// `sluice-deletes/`.
fn parquet_on_disk(warehouse: &Path) -> (Vec<String>, Vec<String>) {
    let (mut data, mut deletes) = (Vec::new(), Vec::new());
    let mut pending = vec![warehouse.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                let name = path.display().to_string();
                if name.contains("/sluice-deletes/") { deletes.push(name) } else { data.push(name) }
            }
        }
    }
    data.sort();
    deletes.sort();
    (data, deletes)
}

/// `sluice maintain` of `job`'s table in this process: compaction when
/// `compact`, expiry keeping the last `keep_last` snapshots when given,
/// and orphan cleanup of anything unreferenced when `orphans`.
fn maintain(
    job: &TestJob,
    compact: bool,
    keep_last: Option<u32>,
    orphans: bool,
) -> sluice::engine::maintain::MaintainReport {
    use sluice::engine::maintain::MaintainOptions;
    let loaded = job.load(&[]).expect("the job loads");
    let opts = MaintainOptions {
        compact,
        target_file_bytes: 128 * 1024 * 1024,
        keep_last,
        remove_orphans_older_than: orphans.then_some(std::time::Duration::ZERO),
        timeout: std::time::Duration::from_secs(600),
        ..MaintainOptions::default()
    };
    sluice::engine::maintain::maintain(&loaded, sluice_tests::host(), &opts).expect("sluice maintain")
}

/// Compaction's snapshots of the table (operation `replace`).
fn replaces(warehouse: &Path) -> usize {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    table.metadata().snapshots().filter(|s| s.summary().operation.as_str() == "replace").count()
}

/// A partitioned upsert table (`identity(region)`): updates move keys to
/// other partitions (within a checkpoint and across them), deletes and
/// re-inserts land elsewhere; the old partition's row is deleted by a
/// delete file of that partition. Then a compaction applies the deletes in
/// every partition (identity columns written plain) and more changes land
/// on the compacted files. Every read agrees with the model key by key.
#[test]
fn updates_that_move_keys_between_partitions_land_once() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = moving_stream();
    let run = partitioned_job("moving", warehouse.path(), 4);
    write_placed(&run, 0, &files);
    // Stopped after checkpoint 5 (of 8), in the third file: a later run
    // (after the compaction) lands the rest. The file source reads a
    // folder once: files added after a finished run are not read.
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 5, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("stopped after checkpoint 5").is_injected_crash());
    let before = placed_rows(warehouse.path());
    assert_each_key_once(&before);
    // 4 changes a checkpoint: the first 20 changes are in.
    let first_20: Vec<Placed> = files.iter().flatten().take(20).copied().collect();
    assert_eq!(before, placed_model(&[first_20]));
    // Key 2 moved from ap to eu, key 4 from us to eu.
    assert!(before.contains(&(2, "eu".into(), 6)) && before.contains(&(4, "eu".into(), 2)), "{before:?}");
    let (_, deletes) = live_files(warehouse.path());
    assert!(!deletes.is_empty(), "updates across partitions wrote no delete files");

    let report = maintain(&run, true, None, false);
    let t = &report.tables[0];
    assert!(t.files_compacted > 0, "{report}");
    assert_eq!(placed_rows(warehouse.path()), before, "after the compaction");
    let (_, deletes) = live_files(warehouse.path());
    assert!(deletes.is_empty(), "the compaction left delete files live: {deletes:?} ({report})");

    let summary = run.run(None).expect("the changes after the compaction");
    assert!(summary.rows_this_run > 0, "{summary}");
    let got = placed_rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, placed_model(&files));
}

/// Compaction of an upsert table applies the deletes: deleted rows stay
/// deleted, updated rows hold their last values, every data file a delete
/// pointed at is rewritten and every delete file leaves the live set; the
/// changes of a later run (updates and deletes of rows now in the
/// compacted files, through a key index that lost its files to the
/// compaction) land right. Then expiry removes the delete and data files
/// only expired snapshots held and keeps the live ones, and orphan cleanup
/// keeps every live file: what is on disk is exactly what is live.
#[test]
fn compaction_applies_the_deletes_and_expiry_removes_the_dropped_delete_files() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("compacted", warehouse.path(), 1, 4);
    write_stream(&run, &files);
    // Stopped after checkpoint 6, the end of the second file (4 changes a
    // checkpoint): a later run, after the compaction, lands the third.
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 6, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("stopped after checkpoint 6").is_injected_crash());
    let before = rows(warehouse.path());
    assert_eq!(before, model(&files[..2]));
    let (data_before, deletes_before) = live_files(warehouse.path());
    assert!(!deletes_before.is_empty(), "no delete files to apply");

    let report = maintain(&run, true, None, false);
    let t = &report.tables[0];
    assert_eq!(t.files_compacted as usize, data_before.len(), "{report}");
    assert_eq!(t.rows_rewritten as usize, before.len(), "{report}");
    assert_eq!(replaces(warehouse.path()), 1);
    let got = rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, before, "the compaction changed what readers see");
    let (data_after, deletes_after) = live_files(warehouse.path());
    assert!(deletes_after.is_empty(), "delete files stayed live: {deletes_after:?}");
    assert!(data_after.iter().all(|f| !data_before.contains(f)), "{data_after:?}");
    // Nothing left to apply: a second compaction has nothing to do.
    assert_eq!(maintain(&run, true, None, false).tables[0].files_compacted, 0);

    let summary = run.run(None).expect("the last file, after the compaction");
    assert!(summary.rows_this_run > 0, "{summary}");
    let got = rows(warehouse.path());
    assert_each_key_once(&got);
    assert_eq!(got, model(&files));
    let (live_data, live_deletes) = live_files(warehouse.path());
    assert!(!live_deletes.is_empty(), "the last file's updates wrote no delete files");

    // Expiry down to the last snapshot: the delete files the compaction
    // dropped go from disk, the live ones stay, and so for data files.
    let report = maintain(&run, false, Some(1), false);
    assert!(report.tables[0].snapshots_expired > 0, "{report}");
    let removed = &report.tables[0].files_removed;
    assert!(deletes_before.iter().all(|d| removed.iter().any(|r| r.ends_with(d.as_str()))), "{report}");
    let (data_on_disk, deletes_on_disk) = parquet_on_disk(warehouse.path());
    assert_eq!(deletes_on_disk, live_deletes, "after the expiry");
    assert!(live_data.iter().all(|f| data_on_disk.contains(f)), "a live data file went: {data_on_disk:?}");
    assert!(data_before.iter().all(|f| !data_on_disk.contains(f)), "a compacted data file stayed: {data_on_disk:?}");
    assert_eq!(rows(warehouse.path()), model(&files), "after the expiry");
    // Orphan cleanup of everything unreferenced (the crashed run's files
    // of its pending checkpoint 7) removes no live file.
    maintain(&run, false, None, true);
    assert_eq!(parquet_on_disk(warehouse.path()), (live_data, live_deletes));
    assert_eq!(rows(warehouse.path()), model(&files), "after orphan cleanup");
}

/// On a format-version-3 table the deletes are deletion vectors (Puffin):
/// compaction applies them too, every vector leaves the live set, and the
/// changes after it land right; PyIceberg and DuckDB agree with the model
/// throughout (iceberg-rust 0.10 reads no deletion vectors).
#[test]
fn compaction_applies_deletion_vectors_on_a_v3_table() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("compacted-v3", warehouse.path(), 1, 4);
    let run = TestJob { toml: run.toml.replace("key = \"id\"\n", "key = \"id\"\nformat_version = 3\n"), dir: run.dir };
    write_stream(&run, &files);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 6, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("stopped after checkpoint 6").is_injected_crash());
    let before = read3(warehouse.path(), "name", false);
    assert_eq!(before, model(&files[..2]));
    let (data_before, vectors) = live_files(warehouse.path());
    assert!(!vectors.is_empty() && vectors.iter().all(|v| v.ends_with(".puffin")), "{vectors:?}");

    let report = maintain(&run, true, None, false);
    assert_eq!(report.tables[0].files_compacted as usize, data_before.len(), "{report}");
    assert_eq!(read3(warehouse.path(), "name", false), before, "the compaction changed what readers see");
    let (_, vectors) = live_files(warehouse.path());
    assert!(vectors.is_empty(), "deletion vectors stayed live: {vectors:?}");

    let summary = run.run(None).expect("the last file, after the compaction");
    assert!(summary.rows_this_run > 0, "{summary}");
    let got = read3(warehouse.path(), "name", false);
    assert_each_key_once(&got);
    assert_eq!(got, model(&files));
}
