//! The Iceberg sink's `mode = "overwrite-partitions"` (issue 40, dynamic
//! mode): the rows a run lands replace every day they touch, exactly once,
//! across checkpoints, crashes, reruns, concurrent jobs on other days, and
//! a foreign writer in a day being replaced (refused, naming both).
//!
//! Every table is read back by PyIceberg and by DuckDB's `iceberg_scan`,
//! which must agree, and compared by day, id and value.

use std::collections::BTreeMap;
use std::path::Path;

use sluice::engine::{CrashPoint, Fault, RunOptions};
use sluice_tests::{DUCKDB_ICEBERG, ICEBERG_PLUGIN, TestJob, python};

const TABLE: &str = "db.daily";

/// A CSV file-source job (files under its `in/`) into `TABLE` of
/// `warehouse`, partitioned by `identity(day)`, in `mode`.
fn job(id: &str, warehouse: &Path, mode: &str, every_rows: u64) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
    let warehouse = warehouse.display();
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = 1
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
batch_rows = 5
[sink]
id = "lake"
plugin = "{ICEBERG_PLUGIN}"
[sink.options]
table = "{TABLE}"
partition_by = "identity(day)"
mode = "{mode}"
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#
    );
    TestJob { dir, toml }
}

/// A row: `(id, day, v)`.
type Row = (i64, String, i64);

/// `rows` for `ids` of day `2024-01-<day>`, with value `v`.
fn day_rows(day: u32, ids: std::ops::Range<i64>, v: i64) -> Vec<Row> {
    ids.map(|i| (i, format!("2024-01-{day:02}"), v)).collect()
}

/// Writes `rows` as `in/<name>` (`id,day,v`).
fn write_csv(job: &TestJob, name: &str, rows: &[Row]) {
    let text: String = std::iter::once("id,day,v\n".to_string())
        .chain(rows.iter().map(|(i, d, v)| format!("{i},{d},{v}\n")))
        .collect();
    std::fs::write(job.dir.path().join("in").join(name), text).expect("csv");
}

/// Every row of the table by day (`(id, v)` sorted), as PyIceberg reads it;
/// panics when DuckDB's `iceberg_scan` reads anything else.
fn by_day(warehouse: &Path) -> BTreeMap<String, Vec<(i64, i64)>> {
    by_day_of(warehouse, TABLE)
}

/// [`by_day`] of table `table`.
fn by_day_of(warehouse: &Path, table: &str) -> BTreeMap<String, Vec<(i64, i64)>> {
    let script = format!(
        "{DUCKDB_ICEBERG}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table(name)\n\
         a = t.scan(selected_fields=('id', 'day', 'v')).to_arrow()\n\
         py = sorted([str(d), i, v] for i, d, v in zip(a.column('id').to_pylist(), a.column('day').to_pylist(), a.column('v').to_pylist()))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted([str(d), i, v] for i, d, v in con.execute('select id, day, v from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}}: {{py}} / {{dd}}')\n\
         print(json.dumps(py))"
    );
    let out = python(&script, &[&warehouse.display().to_string(), table])
        .unwrap_or_else(|e| panic!("reading {table} with PyIceberg and DuckDB: {e}"));
    let rows: Vec<(String, i64, i64)> = serde_json::from_str(out.trim()).expect("rows as JSON");
    let mut days: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (day, id, v) in rows {
        days.entry(day).or_default().push((id, v));
    }
    days
}

/// `rows` by day, as [`by_day`] reads them.
fn expected(rows: &[Row]) -> BTreeMap<String, Vec<(i64, i64)>> {
    let mut days: BTreeMap<String, Vec<(i64, i64)>> = BTreeMap::new();
    for (id, day, v) in rows {
        days.entry(day.clone()).or_default().push((*id, *v));
    }
    for rows in days.values_mut() {
        rows.sort_unstable();
    }
    days
}

/// The table's snapshots of job `id`, oldest first: (checkpoint, operation,
/// replace-partitions).
fn snapshots_of(warehouse: &Path, id: &str) -> Vec<(u64, String, bool)> {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    let metadata = table.metadata();
    let mut out = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|id| metadata.snapshot_by_id(id)) {
        let props = &s.summary().additional_properties;
        if props.get("sluice.job-id").map(String::as_str) == Some(id) {
            let c = props.get("sluice.checkpoint-id").and_then(|c| c.parse().ok()).unwrap_or(0);
            let op = s.summary().operation.as_str().to_string();
            out.push((c, op, props.get("replace-partitions").is_some_and(|v| v == "true")));
        }
        next = s.parent_snapshot_id();
    }
    out.reverse();
    out
}

/// Days 1..=3, ten rows each, value 1, appended by job `base`.
fn baseline(warehouse: &Path) -> Vec<Row> {
    let rows: Vec<Row> = (1..=3).flat_map(|d| day_rows(d, (d as i64 * 100)..(d as i64 * 100 + 10), 1)).collect();
    let base = job("base", warehouse, "append", 1000);
    write_csv(&base, "a.csv", &rows);
    base.run(None).expect("the append run");
    assert_eq!(by_day(warehouse), expected(&rows));
    rows
}

/// The rows of `rows` whose day is not one of `days`.
fn except_days(rows: &[Row], days: &[u32]) -> Vec<Row> {
    let days: Vec<String> = days.iter().map(|d| format!("2024-01-{d:02}")).collect();
    rows.iter().filter(|(_, d, _)| !days.contains(d)).cloned().collect()
}

/// Days 2 and 3 appended, then overwritten with other rows and values: day
/// 1 keeps its rows, days 2 and 3 hold exactly the new ones, in one
/// `overwrite` snapshot.
#[test]
fn an_overwrite_replaces_the_days_it_touches_and_keeps_the_others() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let new: Vec<Row> = [day_rows(2, 1000..1004, 2), day_rows(3, 2000..2003, 3)].concat();
    let over = job("backfill", warehouse.path(), "overwrite-partitions", 1000);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the overwrite run");
    let want = expected(&[except_days(&old, &[2, 3]), new].concat());
    assert_eq!(by_day(warehouse.path()), want);
    assert_eq!(snapshots_of(warehouse.path(), "backfill"), vec![(1, "overwrite".to_string(), true)]);
}

/// A day spread over several checkpoints ends with exactly that day's rows:
/// the first checkpoint touching it replaces it, later ones add.
#[test]
fn a_day_spread_over_checkpoints_ends_with_exactly_its_rows() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Checkpoints of 5 rows: day 2 in 1..=3, day 3 from 3 on.
    let new: Vec<Row> = [day_rows(2, 1000..1012, 2), day_rows(3, 2000..2013, 3)].concat();
    let over = job("spread", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the overwrite run");
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
    let snapshots = snapshots_of(warehouse.path(), "spread");
    assert!(snapshots.len() >= 3, "{snapshots:?}");
    // The first checkpoint replaces day 2; the one where day 3 begins replaces it.
    assert!(snapshots[0].2, "{snapshots:?}");
    assert_eq!(snapshots.iter().filter(|s| s.2).count(), 2, "{snapshots:?}");
    assert!(snapshots.iter().filter(|s| !s.2).all(|s| s.1 == "append"), "{snapshots:?}");
}

/// Each day of `now` is wholly old (as `old` has it), or new rows only, each
/// once (a day of the run still landing may be partly there).
fn assert_never_mixed(now: &BTreeMap<String, Vec<(i64, i64)>>, old: &[Row], new: &[Row]) {
    let (old, new) = (expected(old), expected(new));
    for (day, rows) in now {
        let mut dedup = rows.clone();
        dedup.dedup();
        assert_eq!(&dedup, rows, "day {day} holds a row twice");
        let wholly_old = old.get(day) == Some(rows);
        let only_new = new.get(day).is_some_and(|n| rows.iter().all(|r| n.contains(r)));
        assert!(wholly_old || only_new, "day {day} mixes old and new rows: {rows:?}");
    }
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Days 2, 3 and 4 (4 is new), over checkpoints of 5 rows.
    let new: Vec<Row> = [day_rows(2, 1000..1007, 2), day_rows(3, 2000..2008, 3), day_rows(4, 3000..3006, 4)].concat();
    let over = job(&format!("crash-{point}-{checkpoint}"), warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    let err = over.run(Some(Fault { point, checkpoint, subtask: 0 })).expect_err("the crash");
    assert!(err.is_injected_crash(), "{err}");
    assert_never_mixed(&by_day(warehouse.path()), &old, &new);
    over.run(None).expect("the recovery run");
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
}

sluice_tests::crash_tests! {
    crash_after_write: CrashPoint::AfterWrite, 2;
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 1;
    crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    crash_after_persist_first: CrashPoint::AfterPersist, 1;
    crash_after_persist: CrashPoint::AfterPersist, 2;
    crash_during_commit: CrashPoint::DuringCommit, 3;
    crash_after_commit_first: CrashPoint::AfterCommit, 1;
    crash_after_commit_middle: CrashPoint::AfterCommit, 2;
    crash_after_commit_last: CrashPoint::AfterCommit, 5;
}

/// The same backfill rerun as a new incarnation (a fresh state directory,
/// `--new-incarnation`) leaves the table as the first run did.
#[test]
fn a_rerun_as_a_new_incarnation_leaves_the_table_as_the_first_run_did() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let new: Vec<Row> = [day_rows(2, 1000..1008, 2), day_rows(3, 2000..2009, 3)].concat();
    let first = job("rerun", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&first, "a.csv", &new);
    first.run(None).expect("the first run");
    let after_first = by_day(warehouse.path());
    assert_eq!(after_first, expected(&[except_days(&old, &[2, 3]), new.clone()].concat()));
    // Without the flag, a fresh state directory is refused (the first run's checkpoints are there).
    let refused = job("rerun", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&refused, "a.csv", &new);
    let err = refused.run(None).expect_err("a fresh state directory without --new-incarnation");
    assert!(err.to_string().contains("--new-incarnation"), "{err}");
    assert!(err.to_string().contains("overwrite-partitions that rerun replaces every partition"), "{err}");
    assert_eq!(by_day(warehouse.path()), after_first);
    let again = job("rerun", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&again, "a.csv", &new);
    again.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert_eq!(by_day(warehouse.path()), after_first);
}

/// Two overwrite jobs at once on disjoint days both land, whatever their
/// commits' order (a conflict on the head is retried and re-validated).
#[test]
fn two_jobs_at_once_on_disjoint_days_both_land() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let a_rows: Vec<Row> = [day_rows(1, 5000..5011, 5), day_rows(2, 6000..6012, 6)].concat();
    let b_rows: Vec<Row> = [day_rows(3, 7000..7013, 7), day_rows(4, 8000..8009, 8)].concat();
    let a = job("window-a", warehouse.path(), "overwrite-partitions", 5);
    let b = job("window-b", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&a, "a.csv", &a_rows);
    write_csv(&b, "a.csv", &b_rows);
    let sets = ["job.commit.max_attempts=50", "job.commit.max_backoff_ms=200"];
    std::thread::scope(|scope| {
        let ha = scope.spawn(|| a.run_with(&sets, None));
        let hb = scope.spawn(|| b.run_with(&sets, None));
        ha.join().expect("thread a").expect("window a");
        hb.join().expect("thread b").expect("window b");
    });
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[1, 2, 3]), a_rows, b_rows].concat()));
}

/// Another writer appends to a day this run is replacing, between two of
/// its checkpoints: the run's next commit touching that day is refused as
/// `fatal`, naming the partition and the writer; the other writer's rows
/// stay and nothing of the refused checkpoint is visible.
#[test]
fn a_foreign_append_into_a_replaced_day_is_refused_naming_it() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Day 2 over checkpoints 1..=3.
    let new: Vec<Row> = day_rows(2, 1000..1015, 2);
    let over = job("replacer", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("stopped after checkpoint 1").is_injected_crash());
    let foreign: Vec<Row> = day_rows(2, 9000..9002, 9);
    let other = job("intruder", warehouse.path(), "append", 1000);
    write_csv(&other, "a.csv", &foreign);
    other.run(None).expect("the foreign append");
    let before = by_day(warehouse.path());
    let err = over.run(None).expect_err("the next commit into day 2 is refused");
    let message = err.to_string();
    for part in ["db.daily", "day=2024-01-02", "\"intruder\"", "another writer", "--new-incarnation"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), before, "nothing changes after the refusal");
    assert!(before["2024-01-02"].contains(&(9000, 9)), "the other writer's rows are kept: {before:?}");
    assert_eq!(before["2024-01-01"], expected(&old)["2024-01-01"]);
}

/// An unknown `mode` is a config error naming the option and the modes.
#[test]
fn an_unknown_mode_is_refused_naming_the_option() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let bad = job("bad-mode", warehouse.path(), "replace", 1000);
    write_csv(&bad, "a.csv", &day_rows(1, 0..3, 1));
    let message = bad.run(None).expect_err("refused").to_string();
    assert!(message.contains("[sink.options] mode") && message.contains("overwrite-partitions"), "{message}");
}

/// [`job`] unpartitioned, setting bad records aside in `db.dead`.
fn unpartitioned_with_dead_letters(id: &str, warehouse: &Path, mode: &str) -> TestJob {
    let mut job = job(id, warehouse, mode, 1000);
    job.toml = job
        .toml
        .replace("partition_by = \"identity(day)\"\n", "")
        .replace("state_dir = \"state\"\n", "state_dir = \"state\"\nbad_rows = \"dead-letter\"\n");
    job.toml.push_str("[job.dead_letter]\ntable = \"db.dead\"\n");
    job
}

/// The `source_position` of every row of `db.dead`, sorted, as PyIceberg reads them.
fn dead_letters(warehouse: &Path) -> Vec<String> {
    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table('db.dead')\n\
         print(json.dumps(sorted(t.scan().to_arrow().column('source_position').to_pylist())))",
        &[&warehouse.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("reading db.dead with PyIceberg: {e}"));
    serde_json::from_str(out.trim()).expect("positions as JSON")
}

/// An unpartitioned table is one partition: the first checkpoint of an
/// overwrite replaces it whole. The job's dead-letter table beside it is
/// appended to, never replaced: the letters of both runs stay.
#[test]
fn an_unpartitioned_table_is_replaced_whole_and_the_dead_letters_are_appended() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let first = unpartitioned_with_dead_letters("first", warehouse.path(), "append");
    let old: Vec<Row> = [day_rows(1, 0..10, 1), day_rows(2, 10..20, 1)].concat();
    write_csv(&first, "a.csv", &old);
    std::fs::write(first.dir.path().join("in/b.csv"), "id,day,v\n20,2024-01-02,1\n21,2024-01-02,oops\n").expect("csv");
    first.run(None).expect("the append run");
    let with_20 = [old, day_rows(2, 20..21, 1)].concat();
    assert_eq!(by_day(warehouse.path()), expected(&with_20));
    let letters = dead_letters(warehouse.path());
    assert!(letters.len() == 1 && letters[0].contains("b.csv line 3"), "{letters:?}");

    let second = unpartitioned_with_dead_letters("second", warehouse.path(), "overwrite-partitions");
    let new: Vec<Row> = day_rows(3, 100..104, 3);
    write_csv(&second, "a.csv", &new);
    std::fs::write(second.dir.path().join("in/b.csv"), "id,day,v\n104,2024-01-03,3\n105,2024-01-03,bad\n")
        .expect("csv");
    second.run(None).expect("the overwrite run");
    assert_eq!(by_day(warehouse.path()), expected(&[new, day_rows(3, 104..105, 3)].concat()));
    let letters = dead_letters(warehouse.path());
    assert_eq!(letters.len(), 2, "both runs' dead letters stay: {letters:?}");
    assert_eq!(snapshots_of(warehouse.path(), "second")[0].1, "overwrite");
}

/// Catalog faults on the overwrite commits: a lost reply (applied) is
/// settled by the watermark, not re-applied (the partition it replaced is
/// not replaced again); a conflict is retried on the new head; a crash
/// right after the catalog applied a commit is recovered as already
/// committed. Every checkpoint lands once and the days end exact.
#[test]
fn lost_replies_conflicts_and_a_crash_after_apply_land_each_checkpoint_once() {
    use sluice::fault::{CatalogFaults, CommitFault, Faults};
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let new: Vec<Row> = [day_rows(2, 1000..1012, 2), day_rows(3, 2000..2013, 3)].concat();
    let over = job("faulty", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    // Catalog commit calls: 1 is c1 (reply lost), 2 and 3 are c2 (a
    // conflict, then the retry), 4 is c3 (reply lost), 5 is c4 (crash after apply).
    let faults = vec![
        (1, CommitFault::LoseReply),
        (2, CommitFault::Conflict),
        (4, CommitFault::LoseReply),
        (5, CommitFault::CrashAfterApply),
    ];
    let catalog = CatalogFaults { faults, ..CatalogFaults::default() };
    let opts = RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() };
    let err = over.run_opts(&[], opts).expect_err("the crash after apply");
    assert!(err.is_injected_crash(), "{err}");
    assert_never_mixed(&by_day(warehouse.path()), &old, &new);
    over.run(None).expect("the recovery run");
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
    let snapshots = snapshots_of(warehouse.path(), "faulty");
    let mut checkpoints: Vec<u64> = snapshots.iter().map(|s| s.0).collect();
    checkpoints.dedup();
    assert_eq!(checkpoints.len(), snapshots.len(), "a checkpoint committed twice: {snapshots:?}");
    assert_eq!(snapshots.iter().filter(|s| s.2).count(), 2, "each day replaced once: {snapshots:?}");
}

/// An incarnation that landed checkpoints in append mode is not resumed in
/// overwrite mode: its first overwrite would replace the days those
/// checkpoints delivered. It is refused, naming the way out, and the table
/// keeps every row.
#[test]
fn switching_an_incarnation_from_append_to_overwrite_is_refused() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Days 2 and 3 appended again in checkpoints of 5 rows; stopped after
    // checkpoint 2 is committed.
    let more: Vec<Row> = [day_rows(2, 1000..1008, 2), day_rows(3, 2000..2008, 3)].concat();
    let run = job("switch", warehouse.path(), "append", 5);
    write_csv(&run, "a.csv", &more);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("the crash").is_injected_crash());
    let before = by_day(warehouse.path());
    let err = run
        .run_with(&["sink.options.mode=overwrite-partitions"], None)
        .expect_err("the switch to overwrite is refused")
        .to_string();
    assert!(
        err.contains("already landed checkpoints") && err.contains(TABLE) && err.contains("--new-incarnation"),
        "{err}"
    );
    assert_eq!(by_day(warehouse.path()), before, "the refused run changed the table");
    // Finished in the mode it started with, every row is there once.
    run.run(None).expect("the append run resumes");
    assert_eq!(by_day(warehouse.path()), expected(&[old, more].concat()));
}

/// The other way: an incarnation that replaced partitions is not resumed in
/// append mode, which would append to the days the rest of its input
/// reaches for the first time and leave them doubled. Refused by name;
/// finished in overwrite mode, every day is exact.
#[test]
fn switching_an_incarnation_from_overwrite_to_append_is_refused() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let new: Vec<Row> = [day_rows(2, 1000..1008, 2), day_rows(3, 2000..2008, 3)].concat();
    let run = job("switch-back", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&run, "a.csv", &new);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(run.run(Some(crash)).expect_err("the crash").is_injected_crash());
    let before = by_day(warehouse.path());
    let err =
        run.run_with(&["sink.options.mode=append"], None).expect_err("the switch to append is refused").to_string();
    assert!(
        err.contains("began with mode = \"overwrite-partitions\"")
            && err.contains(TABLE)
            && err.contains("--new-incarnation"),
        "{err}"
    );
    assert_eq!(by_day(warehouse.path()), before, "the refused run changed the table");
    run.run(None).expect("the overwrite run resumes");
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
}

/// Snapshot expiry between two runs of one overwrite incarnation, down to
/// the head alone, leaves the resumed run able to tell the table's history:
/// the check of other writers starts from the incarnation's own last
/// snapshot, so it never needs one that expired. Every day ends exact.
#[test]
fn expiry_between_runs_of_an_overwrite_leaves_the_resume_exact() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Five checkpoints of 5 rows; stopped after checkpoint 3 is committed.
    let new: Vec<Row> = [day_rows(2, 1000..1007, 2), day_rows(3, 2000..2008, 3), day_rows(4, 3000..3006, 4)].concat();
    let over = job("expire", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 3, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("the crash").is_injected_crash());
    let path = over.path().display().to_string();
    let (code, out, err) =
        sluice_tests::run_cli(&["maintain", &path, "--no-compact", "--keep-last", "1"], over.dir.path());
    assert_eq!(code, 0, "sluice maintain failed:\n{out}\n{err}");
    assert!(out.contains("expired"), "{out}");
    over.run(None).expect("the resume after expiry");
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
}

// `overwrite_filter` (issue 40, point 2): the explicit scope.

/// The filter the tests below replace with: days 2 to 4 of January.
const DAYS_2_TO_4: &str = "day >= '2024-01-02' and day <= '2024-01-04'";

/// [`job`] in overwrite-partitions with `overwrite_filter = filter` and
/// `extra` lines of `[sink.options]`.
fn filter_job(id: &str, warehouse: &Path, filter: &str, extra: &str, every_rows: u64) -> TestJob {
    let mut job = job(id, warehouse, "overwrite-partitions", every_rows);
    job.toml = job.toml.replace(
        "mode = \"overwrite-partitions\"\n",
        &format!("mode = \"overwrite-partitions\"\noverwrite_filter = \"{filter}\"\n{extra}"),
    );
    job
}

/// The snapshots of job `id` (oldest first) as (checkpoint, operation,
/// the `sluice.overwrite` summary key).
fn filter_snapshots(warehouse: &Path, id: &str) -> Vec<(u64, String, Option<String>)> {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    let metadata = table.metadata();
    let mut out = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|id| metadata.snapshot_by_id(id)) {
        let props = &s.summary().additional_properties;
        if props.get("sluice.job-id").map(String::as_str) == Some(id) {
            let c = props.get("sluice.checkpoint-id").and_then(|c| c.parse().ok()).unwrap_or(0);
            out.push((c, s.summary().operation.as_str().to_string(), props.get("sluice.overwrite").cloned()));
        }
        next = s.parent_snapshot_id();
    }
    out.reverse();
    out
}

/// Every Parquet file under `dir`, recursively.
fn parquet_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("reading a directory").map(|e| e.expect("an entry").path()) {
        if entry.is_dir() {
            out.extend(parquet_files(&entry));
        } else if entry.extension().is_some_and(|e| e == "parquet") {
            out.push(entry);
        }
    }
    out.sort();
    out
}

/// The filter's days are replaced by what the run lands: day 2 holds
/// exactly the new rows (over several checkpoints), day 3 (in the filter,
/// no input rows) ends empty, day 4 (in the filter, not in the table)
/// holds its new rows, day 1 (outside) keeps its rows. The first
/// checkpoint is one `overwrite` snapshot, the later ones appends.
#[test]
fn a_filter_replaces_its_days_and_empties_those_without_rows() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let new: Vec<Row> = [day_rows(2, 1000..1012, 2), day_rows(4, 3000..3004, 4)].concat();
    let over = filter_job("filtered", warehouse.path(), DAYS_2_TO_4, "", 5);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the filter run");
    let now = by_day(warehouse.path());
    assert_eq!(now, expected(&[except_days(&old, &[2, 3]), new].concat()));
    assert!(!now.contains_key("2024-01-03"), "day 3 is in the filter and has no input rows: {now:?}");
    let snapshots = filter_snapshots(warehouse.path(), "filtered");
    assert!(snapshots.len() >= 3, "{snapshots:?}");
    assert_eq!((snapshots[0].1.as_str(), snapshots[0].2.as_deref()), ("overwrite", Some("filter")), "{snapshots:?}");
    assert!(snapshots[1..].iter().all(|s| s.1 == "append" && s.2.is_none()), "{snapshots:?}");
}

/// A row of the input outside the filter is refused by its file and line
/// and its value, and nothing of the run is committed.
#[test]
fn a_row_outside_the_filter_is_refused_by_name_and_the_table_is_unchanged() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Line 5 of a.csv (after the header and three rows) is day 5.
    let new: Vec<Row> = [day_rows(2, 1000..1003, 2), day_rows(5, 4000..4001, 5), day_rows(2, 1003..1006, 2)].concat();
    let over = filter_job("outside", warehouse.path(), DAYS_2_TO_4, "", 1000);
    write_csv(&over, "a.csv", &new);
    let message = over.run(None).expect_err("the day-5 row is refused").to_string();
    for part in ["a.csv line 5", "2024-01-05", "outside overwrite_filter", DAYS_2_TO_4, "db.daily"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), expected(&old), "the refused run changed the table");
    assert!(filter_snapshots(warehouse.path(), "outside").is_empty());
}

/// A filter on a column the table is not partitioned by is refused before
/// any data file is written, naming the column and the table; so is a
/// filter in append mode, naming both keys.
#[test]
fn a_filter_on_an_unpartitioned_column_is_refused_before_writing() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let files_before = parquet_files(warehouse.path());
    let over = filter_job("by-value", warehouse.path(), "v = 1", "", 1000);
    write_csv(&over, "a.csv", &day_rows(2, 1000..1003, 1));
    let message = over.run(None).expect_err("a filter on v is refused").to_string();
    for part in ["overwrite_filter names column v", "db.daily", "not partitioned by"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(parquet_files(warehouse.path()), files_before, "a data file was written");
    assert_eq!(by_day(warehouse.path()), expected(&old));

    let mut append = filter_job("append-filter", warehouse.path(), DAYS_2_TO_4, "", 1000);
    append.toml = append.toml.replace("mode = \"overwrite-partitions\"", "mode = \"append\"");
    write_csv(&append, "a.csv", &day_rows(2, 1000..1003, 1));
    let message = append.run(None).expect_err("a filter in append mode is refused").to_string();
    assert!(message.contains("overwrite_filter") && message.contains("mode"), "{message}");
    assert_eq!(parquet_files(warehouse.path()), files_before, "a data file was written");
}

/// Writes `in/<name>` as a Parquet file of `id`, `day` and `v` with no rows.
fn write_empty_parquet(job: &TestJob, name: &str) {
    let path = job.dir.path().join("in").join(name);
    python(
        "import sys, pyarrow as pa, pyarrow.parquet as pq\n\
         pq.write_table(pa.table({'id': pa.array([], pa.int64()), 'day': pa.array([], pa.date32()), \
         'v': pa.array([], pa.int64())}), sys.argv[1])",
        &[&path.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("writing an empty Parquet file: {e}"));
}

/// An entirely empty input with a filter is refused without
/// `allow_empty_overwrite`, naming the job, table, filter and what it would
/// delete, and the table is unchanged; with it, the same job empties the
/// filter's days in one `delete` snapshot, once: a rerun changes nothing.
#[test]
fn an_empty_input_is_refused_unless_allowed_and_then_empties_the_filter_once() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let over = filter_job("empty", warehouse.path(), DAYS_2_TO_4, "", 1000);
    write_empty_parquet(&over, "a.parquet");
    let message = over.run(None).expect_err("an empty input is refused").to_string();
    for part in [
        "\"empty\"",
        "entirely empty",
        DAYS_2_TO_4,
        "db.daily",
        "2 data file(s) holding 20 row(s)",
        "allow_empty_overwrite",
    ] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), expected(&old), "the refused run changed the table");
    assert!(filter_snapshots(warehouse.path(), "empty").is_empty());
    // The same job with the option lands the end of the input.
    over.run_with(&["sink.options.allow_empty_overwrite=true"], None).expect("the allowed empty run");
    assert_eq!(by_day(warehouse.path()), expected(&except_days(&old, &[2, 3])));
    let once = vec![(1, "delete".to_string(), Some("filter".to_string()))];
    assert_eq!(filter_snapshots(warehouse.path(), "empty"), once);
    over.run_with(&["sink.options.allow_empty_overwrite=true"], None).expect("the rerun of a finished job");
    assert_eq!(filter_snapshots(warehouse.path(), "empty"), once);
}

/// The allowed empty input's one commit, crashed at `point`: the recovery
/// lands it once (the days emptied by one `delete` snapshot).
fn empty_input_crash_then_recover(point: CrashPoint) {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let over =
        filter_job(&format!("empty-{point}"), warehouse.path(), DAYS_2_TO_4, "allow_empty_overwrite = true\n", 1000);
    write_empty_parquet(&over, "a.parquet");
    let err = over.run(Some(Fault { point, checkpoint: 1, subtask: 0 })).expect_err("the crash");
    assert!(err.is_injected_crash(), "{err}");
    let now = by_day(warehouse.path());
    assert!(now == expected(&old) || now == expected(&except_days(&old, &[2, 3])), "half emptied: {now:?}");
    over.run(None).expect("the recovery run");
    assert_eq!(by_day(warehouse.path()), expected(&except_days(&old, &[2, 3])));
    let once = vec![(1, "delete".to_string(), Some("filter".to_string()))];
    assert_eq!(filter_snapshots(warehouse.path(), &format!("empty-{point}")), once);
}

#[test]
fn an_allowed_empty_input_crashed_after_persist_empties_the_filter_once() {
    empty_input_crash_then_recover(CrashPoint::AfterPersist);
}

#[test]
fn an_allowed_empty_input_crashed_during_its_commit_empties_the_filter_once() {
    empty_input_crash_then_recover(CrashPoint::DuringCommit);
}

#[test]
fn an_allowed_empty_input_crashed_after_its_commit_empties_the_filter_once() {
    empty_input_crash_then_recover(CrashPoint::AfterCommit);
}

/// A filter run crashed at a point of its checkpoints and resumed ends
/// exact: the filter is replaced once (a resume after its first commit
/// does not replace again, so no row of it is lost or doubled).
mod filter_crash {
    use super::*;

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let old = baseline(warehouse.path());
        // Day 2 over checkpoints 1 and 2, day 4 over 2 and 3; day 3 ends empty.
        let new: Vec<Row> = [day_rows(2, 1000..1007, 2), day_rows(4, 3000..3006, 4)].concat();
        let id = format!("filter-crash-{point}-{checkpoint}");
        let over = filter_job(&id, warehouse.path(), DAYS_2_TO_4, "", 5);
        write_csv(&over, "a.csv", &new);
        let err = over.run(Some(Fault { point, checkpoint, subtask: 0 })).expect_err("the crash");
        assert!(err.is_injected_crash(), "{err}");
        assert_never_mixed(&by_day(warehouse.path()), &old, &new);
        over.run(None).expect("the recovery run");
        assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
        let snapshots = filter_snapshots(warehouse.path(), &id);
        assert_eq!(snapshots.iter().filter(|s| s.2.is_some()).count(), 1, "the filter replaced once: {snapshots:?}");
    }

    sluice_tests::crash_tests! {
        filter_crash_after_persist_first: CrashPoint::AfterPersist, 1;
        filter_crash_during_commit_first: CrashPoint::DuringCommit, 1;
        filter_crash_after_commit_first: CrashPoint::AfterCommit, 1;
        filter_crash_after_snapshot_state: CrashPoint::AfterSnapshotState, 2;
        filter_crash_after_commit_middle: CrashPoint::AfterCommit, 2;
    }
}

/// Evolves the partition spec of `TABLE` with PyIceberg (adds
/// `identity(v)`), then appends two rows of day 3 under the new spec, so
/// the table holds live files of two specs.
fn evolve_spec_and_append(warehouse: &Path) -> Vec<Row> {
    python(
        "import sys, datetime\n\
         import pyarrow as pa\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         with t.update_spec() as u:\n\
         \x20   u.add_identity('v')\n\
         rows = [{'id': 9000 + i, 'day': datetime.date(2024, 1, 3), 'v': 9} for i in range(2)]\n\
         t.append(pa.Table.from_pylist(rows, schema=t.schema().as_arrow()))\n\
         assert t.spec().spec_id == 1, t.spec()",
        &[&warehouse.display().to_string(), TABLE],
    )
    .unwrap_or_else(|e| panic!("evolving the spec of {TABLE} with PyIceberg: {e}"));
    day_rows(3, 9000..9002, 9)
}

/// After partition-spec evolution the table holds live files of two specs:
/// a dynamic overwrite, which keys partitions by spec, is refused before
/// writing, naming the table and both specs (else day 2's older-spec files
/// would survive its replace). A filter, which places each file by its own
/// spec, replaces the days of both specs exactly.
#[test]
fn after_spec_evolution_a_dynamic_overwrite_is_refused_and_a_filter_replaces_across_specs() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    let evolved = evolve_spec_and_append(warehouse.path());
    let all_old = [old.clone(), evolved].concat();
    assert_eq!(by_day(warehouse.path()), expected(&all_old));
    let files_before = parquet_files(warehouse.path());
    // The table's spec is no longer `identity(day)`: the jobs leave partition_by out.
    let unpinned = |mut job: TestJob| {
        job.toml = job.toml.replace("partition_by = \"identity(day)\"\n", "");
        job
    };
    let new: Vec<Row> = day_rows(2, 1000..1004, 2);
    let dynamic = unpinned(job("evolved", warehouse.path(), "overwrite-partitions", 1000));
    write_csv(&dynamic, "a.csv", &new);
    let message = dynamic.run(None).expect_err("two live specs are refused").to_string();
    for part in ["db.daily", "spec 0 (identity(day))", "spec 1 (identity(day), identity(v))", "overwrite_filter"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(parquet_files(warehouse.path()), files_before, "a data file was written");
    assert_eq!(by_day(warehouse.path()), expected(&all_old));

    let filtered = unpinned(filter_job("evolved-filter", warehouse.path(), DAYS_2_TO_4, "", 1000));
    write_csv(&filtered, "a.csv", &new);
    filtered.run(None).expect("the filter run");
    // Day 3 (files of both specs) is in the filter without input rows: empty.
    assert_eq!(by_day(warehouse.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
}

/// A live file straddling the filter (the month partition of a table
/// partitioned by `month(day)`, which a filter on days 2 to 4 cuts) is
/// refused before any data file is written, naming the file's partition and
/// the filter: Sluice replaces whole files, never rows inside them.
#[test]
fn a_file_straddling_the_filter_is_refused_before_writing() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let by_month = |mut job: TestJob| {
        job.toml = job.toml.replace("identity(day)", "month(day)");
        job
    };
    let old: Vec<Row> = [day_rows(1, 0..5, 1), day_rows(20, 5..10, 1)].concat();
    let base = by_month(job("base-month", warehouse.path(), "append", 1000));
    write_csv(&base, "a.csv", &old);
    base.run(None).expect("the append run");
    let files_before = parquet_files(warehouse.path());
    let over = by_month(filter_job("straddle", warehouse.path(), DAYS_2_TO_4, "", 1000));
    write_csv(&over, "a.csv", &day_rows(2, 1000..1003, 2));
    let message = over.run(None).expect_err("the January file straddles the filter").to_string();
    for part in ["db.daily", "2024-01", "both sides of overwrite_filter", DAYS_2_TO_4] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(parquet_files(warehouse.path()), files_before, "a data file was written");
    assert_eq!(by_day(warehouse.path()), expected(&old));
}

/// A row inside the filter whose partition the filter cuts (January, of a
/// table partitioned by `month(day)`, under a filter on days 2 to 4) is
/// refused by its file and line even when no live file straddles yet: its
/// own file would, and no later run could then replace that month whole.
/// Nothing of the run is committed.
#[test]
fn a_row_in_a_partition_the_filter_cuts_is_refused_by_name() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let by_month = |mut job: TestJob| {
        job.toml = job.toml.replace("identity(day)", "month(day)");
        job
    };
    // The table holds only March, outside the filter: nothing straddles yet.
    let old: Vec<Row> = (0..5).map(|i| (i, "2024-03-01".to_string(), 1)).collect();
    let base = by_month(job("base-cut", warehouse.path(), "append", 1000));
    write_csv(&base, "a.csv", &old);
    base.run(None).expect("the append run");
    let over = by_month(filter_job("cut", warehouse.path(), DAYS_2_TO_4, "", 1000));
    write_csv(&over, "a.csv", &day_rows(2, 1000..1003, 2));
    let message = over.run(None).expect_err("January is cut by the filter").to_string();
    for part in ["a.csv line 2", "db.daily", "2024-01", "only partly inside", DAYS_2_TO_4] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), expected(&old));
    assert!(filter_snapshots(warehouse.path(), "cut").is_empty());
}

/// With a filter, the conflict check covers the whole filter, not only the
/// days the run's rows touch: another writer appending to day 3 (in the
/// filter, no input rows) after the filter's first commit makes the run's
/// next commit fail, naming the partition, the writer and the filter; the
/// other writer's rows are kept and nothing of the refused checkpoint is
/// visible.
#[test]
fn a_foreign_append_anywhere_in_the_filter_is_refused_naming_it() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    baseline(warehouse.path());
    // Day 2 over checkpoints 1..=3.
    let over = filter_job("filter-guard", warehouse.path(), DAYS_2_TO_4, "", 5);
    write_csv(&over, "a.csv", &day_rows(2, 1000..1015, 2));
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("stopped after checkpoint 1").is_injected_crash());
    let other = job("intruder", warehouse.path(), "append", 1000);
    write_csv(&other, "a.csv", &day_rows(3, 9000..9002, 9));
    other.run(None).expect("the foreign append");
    let before = by_day(warehouse.path());
    let message = over.run(None).expect_err("the next commit is refused").to_string();
    for part in ["db.daily", "day=2024-01-03", "\"intruder\"", "another writer", DAYS_2_TO_4] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), before, "nothing changes after the refusal");
    assert_eq!(before["2024-01-03"], vec![(9000, 9), (9001, 9)], "the other writer's rows are kept");
}

/// Another writer deletes a day this run has replaced, between two of its
/// checkpoints (PyIceberg's `delete` of a whole day: a `delete` snapshot
/// removing the run's data file): the run's next commit adding to that day
/// is refused as `fatal`, naming the table, the partition and the other
/// writer's snapshot, as Java's `validateDeletedDataFiles` would; nothing of
/// the refused checkpoint is visible.
#[test]
fn a_foreign_delete_in_a_replaced_day_is_refused_naming_it() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = baseline(warehouse.path());
    // Day 2 over checkpoints 1..=3.
    let over = job("deleted-under", warehouse.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &day_rows(2, 1000..1015, 2));
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("stopped after checkpoint 1").is_injected_crash());
    let deleted = python(
        "import sys\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         t.delete(\"day == '2024-01-02'\")\n\
         s = t.current_snapshot()\n\
         print(s.snapshot_id, s.summary.operation.value)",
        &[&warehouse.path().display().to_string(), TABLE],
    )
    .unwrap_or_else(|e| panic!("deleting day 2 with PyIceberg: {e}"));
    let (snapshot, operation) = deleted.trim().split_once(' ').expect("snapshot id and operation");
    assert_eq!(operation, "delete", "PyIceberg dropped the whole day's file");
    let before = by_day(warehouse.path());
    assert!(!before.contains_key("2024-01-02"), "{before:?}");
    let message = over.run(None).expect_err("the next commit into day 2 is refused").to_string();
    for part in ["db.daily", "day=2024-01-02", snapshot, "deleted", "another writer", "--new-incarnation"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(warehouse.path()), before, "nothing changes after the refusal");
    assert_eq!(before["2024-01-01"], expected(&old)["2024-01-01"]);
}

/// [`job`] over a tree of two source tables, `a` and `b` (`in/a/`,
/// `in/b/`), into `db.a` and `db.b`, with two subtasks: `a` is read by
/// subtask 0 and `b` by subtask 1 (fnv1a64 of the name, modulo 2), so every
/// checkpoint of `every_rows` rows a subtask touches both tables.
fn two_table_job(id: &str, warehouse: &Path, every_rows: u64) -> TestJob {
    let mut job = job(id, warehouse, "overwrite-partitions", every_rows);
    job.toml = job
        .toml
        .replace(&format!("table = \"{TABLE}\""), "table = \"db.{table}\"")
        .replace("parallelism = 1", "parallelism = 2");
    for t in ["a", "b"] {
        std::fs::create_dir_all(job.dir.path().join("in").join(t)).expect("table folder");
    }
    job
}

/// A pending checkpoint committed to one table and not to another, then
/// dropped by the operator (`sluice state --drop-pending`), keeps what it
/// delivered: its record's committer state is the one before it, so the
/// committer finds the checkpoint in the table's history and folds the day
/// it replaced in; the next checkpoint adds to that day instead of
/// replacing it again (which would delete the dropped checkpoint's rows).
#[test]
fn a_dropped_checkpoint_committed_in_one_table_keeps_the_day_it_replaced() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let csv = |rows: &[Row]| -> String {
        std::iter::once("id,day,v\n".to_string()).chain(rows.iter().map(|(i, d, v)| format!("{i},{d},{v}\n"))).collect()
    };
    // Old rows of day 2 in db.a and of day 5 in db.b, replaced by the run.
    let mut base = two_table_job("base-two", warehouse.path(), 1000);
    base.toml = base.toml.replace("overwrite-partitions", "append");
    std::fs::write(base.dir.path().join("in/a/1.csv"), csv(&day_rows(2, 9000..9002, 9))).expect("csv");
    std::fs::write(base.dir.path().join("in/b/1.csv"), csv(&day_rows(5, 9100..9101, 9))).expect("csv");
    base.run(None).expect("the append run");
    // db.a: day 1 in checkpoint 1, day 2 first in checkpoint 2, then in 3;
    // db.b: day 5 in checkpoints 1 and 2, day 6 in 3.
    let a_rows: Vec<Row> = [day_rows(1, 1000..1005, 1), day_rows(2, 2000..2010, 2)].concat();
    let b_rows: Vec<Row> = [day_rows(5, 5000..5010, 5), day_rows(6, 6000..6005, 6)].concat();
    let over = two_table_job("dropped", warehouse.path(), 5);
    std::fs::write(over.dir.path().join("in/a/1.csv"), csv(&a_rows)).expect("csv");
    std::fs::write(over.dir.path().join("in/b/1.csv"), csv(&b_rows)).expect("csv");
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("stopped after checkpoint 1").is_injected_crash());
    // Another writer appends to day 5 of db.b: checkpoint 2 is committed to
    // db.a (the first table in name order), and refused in db.b.
    let mut other = job("intruder", warehouse.path(), "append", 1000);
    other.toml = other.toml.replace(&format!("table = \"{TABLE}\""), "table = \"db.b\"");
    let foreign = day_rows(5, 9200..9202, 9);
    write_csv(&other, "a.csv", &foreign);
    other.run(None).expect("the foreign append");
    let message = over.run(None).expect_err("checkpoint 2 is refused in db.b").to_string();
    assert!(message.contains("db.b") && message.contains("day=2024-01-05"), "{message}");
    assert_eq!(by_day_of(warehouse.path(), "db.a"), expected(&a_rows[..10]), "checkpoint 2 replaced day 2 in db.a");
    // The operator drops checkpoint 2, as the refusal offers.
    let loaded = over.load(&[]).expect("job");
    sluice::engine::state::drop_pending(&loaded, 2).expect("drop");
    over.run(None).expect("resumes after the drop");
    // Day 2 holds checkpoint 2's rows and checkpoint 3's, each once.
    assert_eq!(by_day_of(warehouse.path(), "db.a"), expected(&a_rows));
    // db.b lost checkpoint 2's rows (the operator dropped them); day 5
    // holds checkpoint 1's and the other writer's, day 6 checkpoint 3's.
    assert_eq!(by_day_of(warehouse.path(), "db.b"), expected(&[&b_rows[..5], &foreign, &b_rows[10..]].concat()));
}

/// A catalog that fails to answer when `combine` loads the table to plan a
/// checkpoint (the first two loads after checkpoint 1's commit answer 503,
/// through a fault proxy in front of the REST catalog double) is tried
/// again with backoff, and the run lands every row once: a transient
/// catalog error at combine does not stop the run.
#[test]
fn a_catalog_failing_to_answer_when_a_checkpoint_is_planned_is_tried_again() {
    use futures::TryStreamExt;
    use sluice_tests::fault_proxy::{Action, FaultProxy, Match, Rule};
    use sluice_tests::rest_catalog::RestCatalogDouble;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    let proxy = FaultProxy::start(&rest.uri());
    let mut over = job("flaky-catalog", warehouse.path(), "overwrite-partitions", 5);
    let sql = format!("database = \"{}/catalog.db\"", warehouse.path().display());
    assert!(over.toml.contains(&sql), "the job names its SQLite catalog");
    over.toml = over.toml.replace(&sql, &format!("kind = \"rest\"\nuri = \"{}\"", proxy.endpoint));
    let new: Vec<Row> = [day_rows(2, 1000..1007, 2), day_rows(3, 2000..2008, 3)].concat();
    write_csv(&over, "a.csv", &new);
    // REST spec: `GET /v1/namespaces/{ns}/tables/{table}` is loadTable,
    // `POST` to the same path updateTable (the commit).
    let table_path = "/v1/namespaces/db/tables/daily";
    let rule = Rule::new("load-503", Match::method("GET").path(table_path), Action::Status(503))
        .after(Match::method("POST").path(table_path))
        .times(2);
    proxy.add_rule(rule);
    over.run(None).expect("the run goes on through the failed loads");
    assert_eq!(proxy.fired_of("load-503").len(), 2, "{}", proxy.request_log());
    let catalog = sluice::capability::catalog::CatalogGrant::open_rest("sluice", &rest.uri(), warehouse.path(), None)
        .expect("opening the REST catalog");
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = catalog.load(&ident).expect("loading the table");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let batches: Vec<arrow_array::RecordBatch> = rt.block_on(async {
        let scan = table.scan().select(["id", "v"]).build().expect("scan");
        scan.to_arrow().await.expect("scan to arrow").try_collect().await.expect("reading the table")
    });
    let mut rows: Vec<(i64, i64)> = Vec::new();
    for b in &batches {
        let col = |name: &str| {
            b.column_by_name(name)
                .and_then(|c| c.as_any().downcast_ref::<arrow_array::Int64Array>())
                .unwrap_or_else(|| panic!("column {name} as int64"))
                .clone()
        };
        let (ids, vs) = (col("id"), col("v"));
        rows.extend(ids.values().iter().copied().zip(vs.values().iter().copied()));
    }
    rows.sort_unstable();
    let mut want: Vec<(i64, i64)> = new.iter().map(|(i, _, v)| (*i, *v)).collect();
    want.sort_unstable();
    assert_eq!(rows, want, "every row once");
}
