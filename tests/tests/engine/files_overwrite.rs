//! The files sink's `partition_by` and `mode = "overwrite-partitions"`
//! (issue 40, point 4): the rows a run lands replace every day they touch,
//! exactly once, across checkpoints, crashes, reruns and concurrent jobs on
//! other days; a concurrent writer in a day being replaced is refused,
//! naming both; a table directory never mixes append and overwrite layouts.
//!
//! Every table is read back by a reader that follows the documented
//! contract (docs/src/sinks/files.md, "Reading an overwrite table"): the
//! newest version of `_sluice_log/`, its part lists, the files they name,
//! and nothing else ([`read_log`]); on local disk also by the DuckDB
//! snippet of that page, taken from the page itself ([`duckdb_by_day`]).
//! Both compare by day, id and value.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use arrow_array::{Array, Int64Array, RecordBatch};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use bytes::Bytes;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde::Deserialize;
use sluice::engine::{CrashPoint, Fault, RunOptions};
use sluice_store::{GcsOptions, ObjectStore, StoreError};
use sluice_tests::harness::{self, block, buckets};
use sluice_tests::{FILES_PLUGIN, TestJob, python};

/// A CSV file-source job (files under its `in/`) into the files sink at
/// `path` (granted `grant`), partitioned by `day`, in `mode`.
fn job_at(id: &str, path: &str, grant: &str, mode: &str, every_rows: u64) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
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
id = "out"
plugin = "{FILES_PLUGIN}"
[sink.options]
path = "{path}"
partition_by = "day"
mode = "{mode}"
target_file_mb = 1
[sink.grants]
locations = ["{grant}"]
"#
    );
    TestJob { dir, toml }
}

/// [`job_at`] on local disk: the table is `<lake>/daily`.
fn job(id: &str, lake: &Path, mode: &str, every_rows: u64) -> TestJob {
    let path = table_dir(lake);
    job_at(id, &path.display().to_string(), &lake.display().to_string(), mode, every_rows)
}

fn table_dir(lake: &Path) -> PathBuf {
    lake.join("daily")
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

type ByDay = BTreeMap<String, Vec<(i64, i64)>>;

/// `rows` by day, `(id, v)` sorted.
fn expected(rows: &[Row]) -> ByDay {
    let mut days = ByDay::new();
    for (id, day, v) in rows {
        days.entry(day.clone()).or_default().push((*id, *v));
    }
    for rows in days.values_mut() {
        rows.sort_unstable();
    }
    days
}

/// The rows of `rows` whose day is not one of `days`.
fn except_days(rows: &[Row], days: &[u32]) -> Vec<Row> {
    let days: Vec<String> = days.iter().map(|d| format!("2024-01-{d:02}")).collect();
    rows.iter().filter(|(_, d, _)| !days.contains(d)).cloned().collect()
}

/// Where a table's files are, for [`read_log`]: paths relative to the
/// table's directory.
trait Store {
    /// The file's bytes, `None` when it does not exist.
    fn get(&self, rel: &str) -> Option<Bytes>;
    /// The names directly in the folder `rel`.
    fn list(&self, rel: &str) -> Vec<String>;
}

struct Local(PathBuf);

impl Store for Local {
    fn get(&self, rel: &str) -> Option<Bytes> {
        match std::fs::read(self.0.join(rel)) {
            Ok(bytes) => Some(Bytes::from(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => panic!("reading {rel}: {e}"),
        }
    }

    fn list(&self, rel: &str) -> Vec<String> {
        match std::fs::read_dir(self.0.join(rel)) {
            Ok(entries) => entries.map(|e| e.expect("entry").file_name().to_string_lossy().into_owned()).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => panic!("listing {rel}: {e}"),
        }
    }
}

/// A table on S3: the bucket and the table's key prefix.
struct Bucket(ObjectStore, String);

impl Store for Bucket {
    fn get(&self, rel: &str) -> Option<Bytes> {
        let key = format!("{}/{rel}", self.1);
        match block(self.0.read(&key)) {
            Ok(bytes) => Some(bytes),
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => panic!("reading {}: {e}", self.0.url(&key)),
        }
    }

    fn list(&self, rel: &str) -> Vec<String> {
        block(self.0.list_level(&format!("{}/{rel}", self.1))).expect("listing")
    }
}

/// A version of the log, as the docs describe it (the fields a reader needs).
#[derive(Debug, Deserialize)]
struct Version {
    format: String,
    version: u64,
    writer: Writer,
    replaced: Vec<String>,
    partitions: Vec<LivePartition>,
    /// The table's partitioning (columns and types), in every version.
    #[serde(default)]
    partition_by: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct Writer {
    job: String,
}

#[derive(Debug, Deserialize)]
struct LivePartition {
    partition: String,
    values: BTreeMap<String, String>,
    list: String,
    rows: u64,
}

#[derive(Debug, Deserialize)]
struct PartList {
    files: Vec<ListedFile>,
}

#[derive(Debug, Deserialize)]
struct ListedFile {
    path: String,
    rows: u64,
    bytes: u64,
}

fn version_name(n: u64) -> String {
    format!("_sluice_log/{n:020}.json")
}

/// The newest version's number by the contract: `_sluice_log/_latest` (or,
/// without it, the highest `<n>.json` listed), then probing upward until
/// `<n+1>.json` is missing. 0: no version.
fn newest(store: &dyn Store) -> u64 {
    let hint = store.get("_sluice_log/_latest").and_then(|b| String::from_utf8_lossy(&b).trim().parse::<u64>().ok());
    let mut n = hint.unwrap_or_else(|| {
        store.list("_sluice_log").iter().filter_map(|n| n.strip_suffix(".json")?.parse::<u64>().ok()).max().unwrap_or(0)
    });
    while store.get(&version_name(n + 1)).is_some() {
        n += 1;
    }
    n
}

fn version(store: &dyn Store, n: u64) -> Version {
    let bytes = store.get(&version_name(n)).unwrap_or_else(|| panic!("version {n} is missing"));
    let v: Version = serde_json::from_slice(&bytes).expect("a version");
    assert_eq!((v.format.as_str(), v.version), ("sluice-files-log/1", n));
    v
}

/// Renders a column's value as text (the `day` column is a date or a string).
fn text(array: &dyn Array, row: usize) -> String {
    ArrayFormatter::try_new(array, &FormatOptions::default()).expect("formatter").value(row).to_string()
}

/// The table by day, read by the documented contract: the newest version,
/// each partition's list, each file it names (checked: there, of the
/// recorded size and rows, its rows all of the partition's day). Nothing
/// else under the table counts.
fn read_log(store: &dyn Store) -> ByDay {
    let n = newest(store);
    let mut days = ByDay::new();
    if n == 0 {
        return days;
    }
    for part in version(store, n).partitions {
        let list: PartList = serde_json::from_slice(&store.get(&part.list).expect("part list")).expect("a part list");
        let day = part.values.get("day").cloned().expect("a day value");
        assert_eq!(part.partition, format!("day={day}"));
        assert_eq!(part.rows, list.files.iter().map(|f| f.rows).sum::<u64>(), "{part:?}");
        for file in list.files {
            let bytes = store.get(&file.path).unwrap_or_else(|| panic!("{} is missing", file.path));
            assert_eq!(bytes.len() as u64, file.bytes, "{}", file.path);
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).expect("parquet").build().expect("reader");
            let mut rows = 0;
            for batch in reader {
                let batch: RecordBatch = batch.expect("batch");
                let ids = batch.column_by_name("id").expect("id");
                let ids = ids.as_any().downcast_ref::<Int64Array>().expect("id is int64");
                let vs = batch.column_by_name("v").expect("v");
                let vs = vs.as_any().downcast_ref::<Int64Array>().expect("v is int64");
                let in_day = batch.column_by_name("day").expect("day");
                for r in 0..batch.num_rows() {
                    assert_eq!(text(in_day.as_ref(), r), day, "{} holds a row of another day", file.path);
                    days.entry(day.clone()).or_default().push((ids.value(r), vs.value(r)));
                }
                rows += batch.num_rows() as u64;
            }
            assert_eq!(rows, file.rows, "{}", file.path);
        }
    }
    for rows in days.values_mut() {
        rows.sort_unstable();
    }
    days
}

/// The local table `lake/daily` by [`read_log`], checked against the
/// DuckDB snippet of the docs (which must read the same rows).
fn by_day(lake: &Path) -> ByDay {
    let days = read_log(&Local(table_dir(lake)));
    if !days.is_empty() {
        assert_eq!(duckdb_by_day(&table_dir(lake)), days, "DuckDB reads the table otherwise");
    }
    days
}

/// The SQL of "Reading an overwrite table" in docs/src/sinks/files.md.
fn documented_sql() -> String {
    let page = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/src/sinks/files.md");
    let page = std::fs::read_to_string(&page).expect("the files sink's page");
    let section = page.split("## Reading an overwrite table").nth(1).expect("the section");
    let sql = section.split("```sql\n").nth(1).and_then(|s| s.split("```").next()).expect("its sql block");
    assert!(sql.contains("'out/orders'"), "the snippet names its table as out/orders: {sql}");
    sql.to_string()
}

/// Runs the documented DuckDB snippet on table directory `dir`.
fn duckdb_by_day(dir: &Path) -> ByDay {
    let sql = documented_sql().replace("'out/orders'", &format!("'{}'", dir.display()));
    let script = "import sys, json, duckdb\n\
         con = duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         stmts = [s for s in sys.argv[1].split(';') if s.strip()]\n\
         for s in stmts[:-1]:\n\
         \x20   con.execute(s)\n\
         rows = con.execute(stmts[-1]).fetchall()\n\
         print(json.dumps([[str(d), i, v] for i, d, v in rows]))";
    let query = format!("{sql};");
    let wrapped = query.replace("SELECT * FROM read_parquet", "SELECT id, day, v FROM read_parquet");
    let out = python(script, &[&wrapped]).unwrap_or_else(|e| panic!("the documented DuckDB snippet: {e}"));
    let rows: Vec<(String, i64, i64)> = serde_json::from_str(out.trim()).expect("rows as JSON");
    let mut days = ByDay::new();
    for (day, id, v) in rows {
        days.entry(day).or_default().push((id, v));
    }
    for rows in days.values_mut() {
        rows.sort_unstable();
    }
    days
}

/// The versions job `id` created, oldest first: the partitions each replaced.
fn versions_of(lake: &Path, id: &str) -> Vec<Vec<String>> {
    let store = Local(table_dir(lake));
    (1..=newest(&store)).map(|n| version(&store, n)).filter(|v| v.writer.job == id).map(|v| v.replaced).collect()
}

/// Days 1..=3, ten rows each, value 1, landed by job `base` (overwrite).
fn baseline(lake: &Path) -> Vec<Row> {
    let rows: Vec<Row> = (1..=3).flat_map(|d| day_rows(d, (d as i64 * 100)..(d as i64 * 100 + 10), 1)).collect();
    let base = job("base", lake, "overwrite-partitions", 1000);
    write_csv(&base, "a.csv", &rows);
    base.run(None).expect("the baseline run");
    assert_eq!(by_day(lake), expected(&rows));
    rows
}

/// Days 2 and 3 overwritten with other rows and values: day 1 keeps its
/// rows, days 2 and 3 hold exactly the new ones, in one version.
#[test]
fn an_overwrite_replaces_the_days_it_touches_and_keeps_the_others() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    let new: Vec<Row> = [day_rows(2, 1000..1004, 2), day_rows(3, 2000..2003, 3)].concat();
    let over = job("backfill", lake.path(), "overwrite-partitions", 1000);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the overwrite run");
    assert_eq!(by_day(lake.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
    assert_eq!(versions_of(lake.path(), "backfill"), vec![vec!["day=2024-01-02", "day=2024-01-03"]]);
    // The replaced files are still on disk (nothing deletes them), but no
    // version names them: a glob of the directory would read them.
    let parquet_files = walk(&table_dir(lake.path())).into_iter().filter(|p| p.ends_with(".parquet")).count();
    assert!(parquet_files > 3, "{parquet_files}");
}

/// Every file under `dir`, relative to it.
fn walk(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                todo.push(path);
            } else {
                out.push(path.strip_prefix(dir).expect("under dir").display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// A day spread over several checkpoints ends with exactly that day's rows:
/// the first checkpoint touching it replaces it, later ones add.
#[test]
fn a_day_spread_over_checkpoints_ends_with_exactly_its_rows() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    // Checkpoints of 5 rows: day 2 in 1..=3, day 3 from 3 on.
    let new: Vec<Row> = [day_rows(2, 1000..1012, 2), day_rows(3, 2000..2013, 3)].concat();
    let over = job("spread", lake.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the overwrite run");
    assert_eq!(by_day(lake.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
    let versions = versions_of(lake.path(), "spread");
    assert!(versions.len() >= 3, "{versions:?}");
    assert_eq!(versions[0], vec!["day=2024-01-02"], "{versions:?}");
    let replaced: Vec<&String> = versions.iter().flatten().collect();
    assert_eq!(replaced, vec!["day=2024-01-02", "day=2024-01-03"], "each day replaced once: {versions:?}");
}

/// Each day of `now` is wholly old (as `old` has it), or new rows only,
/// each once (a day of the run still landing may be partly there).
fn assert_never_mixed(now: &ByDay, old: &[Row], new: &[Row]) {
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
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    // Days 2, 3 and 4 (4 is new), over checkpoints of 5 rows: day 2 in
    // 1..=3 and day 3 in 3..=4, so a crash at 2 or 3 resumes in the middle
    // of a day replaced before it (only the restored committer state says so).
    let new: Vec<Row> = [day_rows(2, 1000..1012, 2), day_rows(3, 2000..2008, 3), day_rows(4, 3000..3006, 4)].concat();
    let over = job(&format!("crash-{point}-{checkpoint}"), lake.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    let err = over.run(Some(Fault { point, checkpoint, subtask: 0 })).expect_err("the crash");
    assert!(err.is_injected_crash(), "{err}");
    assert_never_mixed(&by_day(lake.path()), &old, &new);
    over.run(None).expect("the recovery run");
    assert_eq!(by_day(lake.path()), expected(&[except_days(&old, &[2, 3]), new].concat()));
    let replaced: Vec<String> =
        versions_of(lake.path(), over_id(point, checkpoint).as_str()).into_iter().flatten().collect();
    assert_eq!(replaced, vec!["day=2024-01-02", "day=2024-01-03", "day=2024-01-04"], "each day replaced once");
}

fn over_id(point: CrashPoint, checkpoint: u64) -> String {
    format!("crash-{point}-{checkpoint}")
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
/// `--new-incarnation`) leaves the table as the first run did; without the
/// flag a fresh state directory is refused, naming the way.
#[test]
fn a_rerun_as_a_new_incarnation_leaves_the_table_as_the_first_run_did() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    let new: Vec<Row> = [day_rows(2, 1000..1008, 2), day_rows(3, 2000..2009, 3)].concat();
    let first = job("rerun", lake.path(), "overwrite-partitions", 5);
    write_csv(&first, "a.csv", &new);
    first.run(None).expect("the first run");
    let after_first = by_day(lake.path());
    assert_eq!(after_first, expected(&[except_days(&old, &[2, 3]), new.clone()].concat()));
    let refused = job("rerun", lake.path(), "overwrite-partitions", 5);
    write_csv(&refused, "a.csv", &new);
    let err = refused.run(None).expect_err("a fresh state directory without --new-incarnation").to_string();
    assert!(err.contains("--new-incarnation") && err.contains("replaces every partition it touches"), "{err}");
    assert_eq!(by_day(lake.path()), after_first);
    let again = job("rerun", lake.path(), "overwrite-partitions", 5);
    write_csv(&again, "a.csv", &new);
    again.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert_eq!(by_day(lake.path()), after_first);
}

/// Two overwrite jobs at once on disjoint days both land, whatever the
/// order of their versions (a lost version number is read again and
/// validated again).
#[test]
fn two_jobs_at_once_on_disjoint_days_both_land() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    let a_rows: Vec<Row> = [day_rows(1, 5000..5011, 5), day_rows(2, 6000..6012, 6)].concat();
    let b_rows: Vec<Row> = [day_rows(3, 7000..7013, 7), day_rows(4, 8000..8009, 8)].concat();
    let a = job("window-a", lake.path(), "overwrite-partitions", 5);
    let b = job("window-b", lake.path(), "overwrite-partitions", 5);
    write_csv(&a, "a.csv", &a_rows);
    write_csv(&b, "a.csv", &b_rows);
    let sets = ["job.commit.max_attempts=50", "job.commit.max_backoff_ms=200"];
    std::thread::scope(|scope| {
        let ha = scope.spawn(|| a.run_with(&sets, None));
        let hb = scope.spawn(|| b.run_with(&sets, None));
        ha.join().expect("thread a").expect("window a");
        hb.join().expect("thread b").expect("window b");
    });
    assert_eq!(by_day(lake.path()), expected(&[except_days(&old, &[1, 2, 3]), a_rows, b_rows].concat()));
}

/// Another job overwrites a day this run is replacing, between two of its
/// checkpoints: the run's next commit touching that day is refused as
/// `fatal`, naming the partition and the writer; the other writer's rows
/// stay and nothing of the refused checkpoint is visible.
#[test]
fn a_concurrent_writer_in_a_replaced_day_is_refused_naming_it() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    let new: Vec<Row> = day_rows(2, 1000..1015, 2);
    let over = job("replacer", lake.path(), "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 1, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("stopped after checkpoint 1").is_injected_crash());
    let foreign: Vec<Row> = day_rows(2, 9000..9002, 9);
    let other = job("intruder", lake.path(), "overwrite-partitions", 1000);
    write_csv(&other, "a.csv", &foreign);
    other.run(None).expect("the other writer");
    let before = by_day(lake.path());
    let message = over.run(None).expect_err("the next commit into day 2 is refused").to_string();
    for part in ["daily", "day=2024-01-02", "\"intruder\"", "another writer", "--new-incarnation"] {
        assert!(message.contains(part), "{part:?} missing from: {message}");
    }
    assert_eq!(by_day(lake.path()), before, "nothing changes after the refusal");
    assert_eq!(before["2024-01-02"], expected(&foreign)["2024-01-02"], "the other writer's rows are kept");
    assert_eq!(before["2024-01-01"], expected(&old)["2024-01-01"]);
}

/// A table directory holds one layout: overwrite on a table with append
/// checkpoints, and append on a table with a version log, are refused with
/// a config error naming the mode and the table, before anything lands.
#[test]
fn a_table_never_mixes_append_and_overwrite_layouts() {
    let lake = tempfile::tempdir().expect("lake");
    let appended = job("appender", lake.path(), "append", 1000);
    write_csv(&appended, "a.csv", &day_rows(1, 0..3, 1));
    appended.run(None).expect("the append run");
    let before = walk(&table_dir(lake.path()));
    let over = job("overwriter", lake.path(), "overwrite-partitions", 1000);
    write_csv(&over, "a.csv", &day_rows(1, 10..13, 2));
    let err = over.run(None).expect_err("overwrite onto an append table").to_string();
    assert!(
        err.contains("mode = \"overwrite-partitions\"") && err.contains("append mode") && err.contains("daily"),
        "{err}"
    );
    assert_eq!(walk(&table_dir(lake.path())), before, "nothing landed");

    let other = tempfile::tempdir().expect("lake");
    baseline(other.path());
    let after = by_day(other.path());
    let app = job("late-appender", other.path(), "append", 1000);
    write_csv(&app, "a.csv", &day_rows(1, 20..23, 3));
    let err = app.run(None).expect_err("append onto an overwrite table").to_string();
    assert!(err.contains("mode = \"append\"") && err.contains("_sluice_log") && err.contains("daily"), "{err}");
    assert_eq!(by_day(other.path()), after, "nothing landed");
}

/// `partition_by` in append mode: each checkpoint's directory holds one
/// `day=<date>/` folder per day, whose files hold exactly that day's rows.
#[test]
fn append_with_partition_by_writes_hive_style_folders() {
    let lake = tempfile::tempdir().expect("lake");
    let rows: Vec<Row> = [day_rows(1, 0..7, 1), day_rows(2, 7..13, 2), day_rows(3, 13..16, 3)].concat();
    let app = job("hive", lake.path(), "append", 5);
    write_csv(&app, "a.csv", &rows);
    app.run(None).expect("the append run");
    let dir = table_dir(lake.path());
    let mut got = ByDay::new();
    let files = walk(&dir);
    assert!(!files.is_empty());
    for rel in files.iter().filter(|f| f.ends_with(".parquet")) {
        // <job>.<sink>.<incarnation>.c<10 digits>/day=<date>/part-….parquet
        let segments: Vec<&str> = rel.split('/').collect();
        assert_eq!(segments.len(), 3, "{rel}");
        assert!(segments[0].starts_with("hive.out.") && segments[0].contains(".c"), "{rel}");
        let day = segments[1].strip_prefix("day=").unwrap_or_else(|| panic!("{rel} is not in a day= folder"));
        let bytes = Bytes::from(std::fs::read(dir.join(rel)).expect("file"));
        for batch in ParquetRecordBatchReaderBuilder::try_new(bytes).expect("parquet").build().expect("reader") {
            let batch = batch.expect("batch");
            let ids = batch.column_by_name("id").expect("id");
            let ids = ids.as_any().downcast_ref::<Int64Array>().expect("int64");
            let vs = batch.column_by_name("v").expect("v");
            let vs = vs.as_any().downcast_ref::<Int64Array>().expect("int64");
            let days = batch.column_by_name("day").expect("day");
            for r in 0..batch.num_rows() {
                assert_eq!(text(days.as_ref(), r), day, "{rel}");
                got.entry(day.to_string()).or_default().push((ids.value(r), vs.value(r)));
            }
        }
    }
    for rows in got.values_mut() {
        rows.sort_unstable();
    }
    assert_eq!(got, expected(&rows));
    assert!(!dir.join("_sluice_log").exists(), "append writes no log");
}

/// On an object store: a baseline, then an overwrite of two days crashed
/// during its commit of checkpoint 3 and resumed; the table, read by the
/// contract through the store's API, holds day 1 untouched and days 2 and
/// 3 exactly.
fn overwrite_on_a_store_is_exact_after_a_crash(scheme: &str, store: ObjectStore) {
    let bucket = buckets::FILES;
    let prefix = format!("files-overwrite-{scheme}-{}", std::process::id());
    let root = format!("{scheme}://{bucket}/{prefix}");
    let path = format!("{root}/daily");
    let old: Vec<Row> = (1..=3).flat_map(|d| day_rows(d, (d as i64 * 100)..(d as i64 * 100 + 10), 1)).collect();
    let base = job_at(&format!("{scheme}-base"), &path, &root, "overwrite-partitions", 1000);
    write_csv(&base, "a.csv", &old);
    base.run(None).expect("the baseline run");
    let store = Bucket(store, format!("{prefix}/daily"));
    assert_eq!(read_log(&store), expected(&old));

    let new: Vec<Row> = [day_rows(2, 1000..1008, 2), day_rows(3, 2000..2009, 3)].concat();
    let over = job_at(&format!("{scheme}-backfill"), &path, &root, "overwrite-partitions", 5);
    write_csv(&over, "a.csv", &new);
    // Day 3 spans checkpoints 2..=4: the resume continues it.
    let crash = Fault { point: CrashPoint::DuringCommit, checkpoint: 3, subtask: 0 };
    assert!(over.run(Some(crash)).expect_err("the crash").is_injected_crash());
    assert_never_mixed(&read_log(&store), &old, &new);
    over.run(None).expect("the recovery run");
    assert_eq!(read_log(&store), expected(&[except_days(&old, &[2, 3]), new].concat()));
}

/// [`overwrite_on_a_store_is_exact_after_a_crash`] on S3 (moto): versions
/// are exclusive creates (`If-None-Match: *`).
#[test]
fn an_overwrite_on_s3_is_exact_after_a_crash() {
    let store = ObjectStore::s3(buckets::FILES, &harness::moto().s3_options()).expect("bucket");
    overwrite_on_a_store_is_exact_after_a_crash("s3", store);
}

/// [`overwrite_on_a_store_is_exact_after_a_crash`] on GCS
/// (fake-gcs-server): versions are exclusive creates
/// (`ifGenerationMatch=0`), data objects unique names checked free.
///
/// Ignored: a data object streamed to `…/attempt-1/day=2024-01-01/…` is
/// stored as `…/day%3D2024-01-01/…`, so the commit's `stat` finds it
/// missing and refuses the checkpoint (nothing is published). The cause is
/// opendal 0.57, which the host streams non-exclusive GCS objects through
/// (store/src/lib.rs `ObjectStore::writer`): `GcsWriter::write_once`
/// (opendal-service-gcs 0.57 writer.rs) encodes the name with
/// opendal-core's `percent_encode_path` (`=` → `%3D`, `/` kept) and
/// `GcsCore::gcs_insert_object_request` (core.rs) encodes it again with
/// the GCS set (`%` → `%25`, `/` → `%2F`), so `name=` carries `%253D`, which
/// a server decodes once to `%3D` (fake-gcs-server: fakestorage/upload.go
/// reads `name` with Go's `URL.Query()`; the GCS JSON API decodes query
/// parameters once too, https://cloud.google.com/storage/docs/request-endpoints#encoding).
/// So real GCS is expected to do the same for any name with a character
/// opendal-core encodes (`=`, `:`, space, …). The fix belongs in the store
/// layer (send such uploads through its own JSON upload, as exclusive ones
/// already are, or an opendal with the double encoding fixed), not here.
#[test]
#[ignore = "opendal 0.57 double-encodes a streamed GCS object's name (`=` stored as %3D); see the doc comment"]
fn an_overwrite_on_gcs_is_exact_after_a_crash() {
    let store = ObjectStore::gcs(buckets::FILES, &GcsOptions::emulator(&harness::gcs().endpoint)).expect("bucket");
    overwrite_on_a_store_is_exact_after_a_crash("gs", store);
}

/// [`job`] setting bad records aside in the table `dead`, which the files
/// sink writes under `<path>/dead/` (beside the single table's log).
fn with_dead_letters(id: &str, lake: &Path) -> TestJob {
    let mut job = job(id, lake, "overwrite-partitions", 1000);
    job.toml = job.toml.replace("state_dir = \"state\"\n", "state_dir = \"state\"\nbad_rows = \"dead-letter\"\n");
    job.toml.push_str("[job.dead_letter]\ntable = \"dead\"\n");
    job
}

/// The `source_position` of every row the newest version of the log of
/// table directory `dir` names (an unpartitioned table), sorted.
fn dead_letters(dir: &Path) -> Vec<String> {
    let store = Local(dir.to_path_buf());
    let n = newest(&store);
    let mut out = Vec::new();
    for part in version(&store, n).partitions {
        assert_eq!(part.partition, "", "the dead-letter table is not partitioned");
        let list: PartList = serde_json::from_slice(&store.get(&part.list).expect("list")).expect("a part list");
        for file in list.files {
            let bytes = store.get(&file.path).expect("file");
            for batch in ParquetRecordBatchReaderBuilder::try_new(bytes).expect("parquet").build().expect("reader") {
                let batch = batch.expect("batch");
                let at = batch.column_by_name("source_position").expect("source_position");
                out.extend((0..batch.num_rows()).map(|r| text(at.as_ref(), r)));
            }
        }
    }
    out.sort();
    out
}

/// With dead letters on, the dead-letter table beside a partitioned
/// overwrite table is unpartitioned and only added to: the letters of two
/// runs stay, while the data table's day is replaced.
#[test]
fn the_dead_letter_table_is_unpartitioned_and_appended_to() {
    let lake = tempfile::tempdir().expect("lake");
    let first = with_dead_letters("first", lake.path());
    write_csv(&first, "a.csv", &day_rows(1, 0..4, 1));
    std::fs::write(first.dir.path().join("in/b.csv"), "id,day,v\n4,2024-01-01,1\n5,2024-01-01,oops\n").expect("csv");
    first.run(None).expect("the first run");
    let letters = dead_letters(&table_dir(lake.path()).join("dead"));
    assert!(letters.len() == 1 && letters[0].contains("b.csv line 3"), "{letters:?}");

    let second = with_dead_letters("second", lake.path());
    write_csv(&second, "a.csv", &day_rows(1, 10..13, 2));
    std::fs::write(second.dir.path().join("in/b.csv"), "id,day,v\n13,2024-01-01,2\n14,2024-01-01,bad\n").expect("csv");
    second.run(None).expect("the second run");
    assert_eq!(by_day(lake.path()), expected(&day_rows(1, 10..14, 2)), "day 1 replaced by the second run");
    assert_eq!(dead_letters(&table_dir(lake.path()).join("dead")).len(), 2, "both runs' dead letters stay");
}

/// Changing `partition_by` of an overwrite table is refused at open, naming
/// both partitionings, before anything lands: the head's partitions would
/// stay live beside the new ones (the unpartitioned table beside `day=…`),
/// so readers would read rows twice.
#[test]
fn changing_partition_by_of_an_overwrite_table_is_refused_naming_both() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    let mut other = job("repartitioner", lake.path(), "overwrite-partitions", 1000);
    other.toml = other.toml.replace("partition_by = \"day\"\n", "");
    write_csv(&other, "a.csv", &day_rows(1, 50..53, 5));
    let err = other.run(None).expect_err("an unpartitioned overwrite of a day-partitioned table").to_string();
    for part in ["partition_by", "daily", "partitioned by day (", "nothing (unpartitioned)"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert_eq!(by_day(lake.path()), expected(&old), "nothing landed");
    assert!(version(&Local(table_dir(lake.path())), 1).partition_by.is_some(), "each version records it");
}

/// A job stopped with a checkpoint pending in append mode and resumed in
/// overwrite mode: the commit of the pending checkpoint is refused as a
/// config error naming both modes, and nothing lands in either layout.
#[test]
fn a_mode_switch_with_a_pending_checkpoint_is_refused_at_commit() {
    let lake = tempfile::tempdir().expect("lake");
    let mut switched = job("switcher", lake.path(), "append", 1000);
    write_csv(&switched, "a.csv", &day_rows(1, 0..3, 1));
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    assert!(switched.run(Some(crash)).expect_err("stopped with checkpoint 1 pending").is_injected_crash());
    let before = walk(&table_dir(lake.path()));
    switched.toml = switched.toml.replace("mode = \"append\"", "mode = \"overwrite-partitions\"");
    let err = switched.run(None).expect_err("the pending append checkpoint under overwrite").to_string();
    for part in ["mode = \"overwrite-partitions\"", "pending checkpoint 1", "mode = \"append\"", "--drop-pending"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    assert_eq!(walk(&table_dir(lake.path())), before, "nothing landed");
}

/// [`job`] over a tree of CSV folders, one per table of `tables` (each
/// holding `rows`), landing in `<lake>/daily/<table>/`.
fn two_table_job(id: &str, lake: &Path, tables: &[&str], rows: &[Row]) -> TestJob {
    let t = job(id, lake, "overwrite-partitions", 1000);
    for table in tables {
        std::fs::create_dir_all(t.dir.path().join("in").join(table)).expect("table folder");
        write_csv(&t, &format!("{table}/1.csv"), rows);
    }
    t
}

/// A checkpoint of tables `a` and `b` pending when another writer
/// overwrites its day in `b` only: its commit is refused naming `b`'s day
/// and the writer, and creates no version in `a` either (every table is
/// checked before any version is created), so "nothing of this checkpoint
/// was committed" is true.
#[test]
fn a_conflict_in_one_table_commits_no_table_of_the_checkpoint() {
    let lake = tempfile::tempdir().expect("lake");
    let ours = two_table_job("both", lake.path(), &["a", "b"], &day_rows(2, 0..3, 1));
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    assert!(ours.run(Some(crash)).expect_err("stopped with checkpoint 1 pending").is_injected_crash());
    let other = two_table_job("intruder", lake.path(), &["b"], &day_rows(2, 90..92, 9));
    other.run(None).expect("the other writer");
    let err = ours.run(None).expect_err("the pending checkpoint conflicts in b").to_string();
    for part in ["table b", "day=2024-01-02", "\"intruder\"", "Nothing of this checkpoint was committed"] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    let a = Local(table_dir(lake.path()).join("a"));
    assert_eq!(newest(&a), 0, "no version of table a was created");
}

/// A `_latest` hint naming a version that does not exist (above the real
/// newest) is not trusted: the newest version is found by listing, and the
/// next overwrite lands as the next version.
#[test]
fn a_hint_above_the_newest_version_falls_back_to_listing() {
    let lake = tempfile::tempdir().expect("lake");
    let old = baseline(lake.path());
    std::fs::write(table_dir(lake.path()).join("_sluice_log/_latest"), "99").expect("a wrong hint");
    let new = day_rows(2, 1000..1003, 2);
    let over = job("after-hint", lake.path(), "overwrite-partitions", 1000);
    write_csv(&over, "a.csv", &new);
    over.run(None).expect("the overwrite after a wrong hint");
    assert!(table_dir(lake.path()).join(version_name(2)).exists(), "the next version is 2");
    assert_eq!(by_day(lake.path()), expected(&[except_days(&old, &[2]), new].concat()));
}

/// `sluice check` of an overwrite job refuses a store that does not refuse
/// a second exclusive create (here moto behind a proxy that answers the
/// second `If-None-Match: *` PUT of the probe with `200 OK`, as a store
/// ignoring the precondition would; PutObject:
/// https://docs.aws.amazon.com/AmazonS3/latest/API/API_PutObject.html).
#[test]
fn check_refuses_a_store_that_does_not_enforce_exclusive_create() {
    use sluice_tests::fault_proxy::{Action, FaultProxy, Match, Rule};
    let moto = harness::moto();
    let proxy = FaultProxy::start(&moto.endpoint);
    let bucket = buckets::FILES;
    let root = format!("s3://{bucket}/files-probe-{}", std::process::id());
    let path = format!("{root}/daily");
    let over = job_at("probe", &path, &root, "overwrite-partitions", 1000);
    write_csv(&over, "a.csv", &day_rows(1, 0..3, 1));
    let endpoint = format!("sink.s3.endpoint=\"{}\"", proxy.endpoint);
    let loaded = over.load(&[&endpoint]).expect("job file");
    let report = sluice::engine::check(&loaded, sluice_tests::host());
    assert!(report.problems.is_empty(), "moto enforces it: {:?}", report.problems);
    let rule =
        Rule::new("ignore-if-none-match", Match::put(bucket, ".sluice-probe"), Action::StatusAfterForward(200)).nth(2);
    proxy.add_rule(rule);
    let report = sluice::engine::check(&loaded, sluice_tests::host());
    let problems = report.problems.join("\n");
    assert_eq!(proxy.fired_of("ignore-if-none-match").len(), 1, "{}", proxy.request_log());
    for part in ["mode = \"overwrite-partitions\"", "exclusive", "version log", &path] {
        assert!(problems.contains(part), "{part:?} missing from: {problems}");
    }
}
