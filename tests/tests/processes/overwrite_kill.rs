//! The Iceberg sink's `mode = "overwrite-partitions"` under the real
//! `sluice` process (issue 40, point 3): a backfill SIGKILLed at seeded
//! random moments and run again until it ends, the same backfill rerun as a
//! new incarnation and killed once, and an overwrite job with `sluice
//! maintain` compacting the same table in a loop beside it.
//!
//! Invariants checked:
//! - at the end, every day of the input holds exactly its new rows (id and
//!   value, each once, no old row left) and every other day exactly its old
//!   rows, read by PyIceberg and by DuckDB's `iceberg_scan`, which must
//!   agree;
//! - at every read in between (after a kill, after a maintenance run), no
//!   row is there twice and each day is either wholly old or holds new rows
//!   only, never a mix, and no new row seen before has gone. A day is not
//!   required to be wholly new mid-run: its rows may span several
//!   checkpoints, so by design it fills up over a run's snapshots (the
//!   first replaces the day, later ones add to it);
//! - a rerun as a new incarnation leaves the table as the first run did.
//!
//! `SLUICE_OVERWRITE_KILL_SEED` repeats a sequence of kill times.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_tests::kill::{STARTED, run_kill_after};
use sluice_tests::{DUCKDB_ICEBERG, ICEBERG_PLUGIN, TestJob, cache_dir, python, rerun_to_end, run_cli, sluice_run};

const TABLE: &str = "db.daily";
/// Days of the table before the backfill (2024-01-01 to 2024-01-06).
const OLD_DAYS: std::ops::RangeInclusive<u32> = 1..=6;
/// Days of the backfill's input: three replace old days, day 7 is new.
const NEW_DAYS: [u32; 4] = [2, 3, 4, 7];

/// A row: `(id, day, v)`.
type Row = (i64, String, i64);
/// A table as read back: each day's `(id, v)`, sorted.
type Days = BTreeMap<String, Vec<(i64, i64)>>;

fn seed() -> u64 {
    let seed = std::env::var("SLUICE_OVERWRITE_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    });
    eprintln!("overwrite kill seed: {seed} (SLUICE_OVERWRITE_KILL_SEED={seed} repeats the kill times)");
    seed
}

fn day(d: u32) -> String {
    format!("2024-01-{d:02}")
}

/// `per_day` old rows of every day of [`OLD_DAYS`], value 1.
fn old_rows(per_day: i64) -> Vec<Row> {
    OLD_DAYS.flat_map(|d| (0..per_day).map(move |i| (i64::from(d) * 100_000 + i, day(d), 1))).collect()
}

/// `per_day` new rows of every day of [`NEW_DAYS`], other ids than the old
/// rows' and the value `10 + day`.
fn new_rows(per_day: i64) -> Vec<Row> {
    NEW_DAYS
        .iter()
        .flat_map(|&d| (0..per_day).map(move |i| (i64::from(d) * 100_000 + 50_000 + i, day(d), 10 + i64::from(d))))
        .collect()
}

/// A CSV file-source job (files under its `in/`, one per day) into `TABLE`
/// of `warehouse`, partitioned by `identity(day)`, in `mode`, with
/// checkpoints every `every_rows` rows per writer and a source of `rate`
/// rows per second (unthrottled when `None`).
fn job(id: &str, warehouse: &Path, mode: &str, parallelism: u32, every_rows: u64, rate: Option<u32>) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
    let warehouse = warehouse.display();
    let rate = rate.map_or(String::new(), |r| format!("rate = {r}.0\n"));
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
batch_rows = 50
{rate}[sink]
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
    let job = TestJob { dir, toml };
    job.load(&[]).expect("a valid job");
    job
}

/// Writes `rows` as `in/day-<day>.csv` files (`id,day,v`), one per day.
fn write_input(job: &TestJob, rows: &[Row]) {
    let mut files: BTreeMap<&str, String> = BTreeMap::new();
    for (i, d, v) in rows {
        files.entry(d.as_str()).or_insert_with(|| "id,day,v\n".to_string()).push_str(&format!("{i},{d},{v}\n"));
    }
    for (d, text) in files {
        std::fs::write(job.dir.path().join("in").join(format!("day-{d}.csv")), text).expect("csv");
    }
}

/// Every row of the table by day, as PyIceberg reads it; panics when DuckDB's
/// `iceberg_scan` reads anything else.
fn by_day(warehouse: &Path) -> Days {
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
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}} ({{t.metadata_location}})')\n\
         print(json.dumps(py))"
    );
    let out = python(&script, &[&warehouse.display().to_string(), TABLE])
        .unwrap_or_else(|e| panic!("reading {TABLE} with PyIceberg and DuckDB: {e}"));
    let rows: Vec<(String, i64, i64)> = serde_json::from_str(out.trim()).expect("rows as JSON");
    let mut days = Days::new();
    for (d, id, v) in rows {
        days.entry(d).or_default().push((id, v));
    }
    days
}

/// `rows` by day, as [`by_day`] reads them.
fn expected(rows: &[Row]) -> Days {
    let mut days = Days::new();
    for (id, d, v) in rows {
        days.entry(d.clone()).or_default().push((*id, *v));
    }
    for rows in days.values_mut() {
        rows.sort_unstable();
    }
    days
}

/// What the backfill of `new` over `old` must leave: the days of `new` hold
/// exactly its rows, every other day exactly the rows of `old`.
fn after_backfill(old: &[Row], new: &[Row]) -> Days {
    let new_days: BTreeSet<&String> = new.iter().map(|(_, d, _)| d).collect();
    let kept: Vec<Row> = old.iter().filter(|(_, d, _)| !new_days.contains(d)).cloned().collect();
    expected(&[kept, new.to_vec()].concat())
}

/// Checks a read taken while the backfill of `new` over `old` may be under
/// way: no row twice; each day wholly as `old` has it, or new rows only
/// (the day may still be filling up: see the module's comment); and every
/// new row of `seen` (what earlier reads found) still there. Then adds this
/// read's new rows to `seen`.
fn assert_never_mixed(now: &Days, old: &Days, new: &Days, seen: &mut BTreeMap<String, BTreeSet<(i64, i64)>>, at: &str) {
    for (d, rows) in now {
        let distinct: BTreeSet<&(i64, i64)> = rows.iter().collect();
        assert_eq!(distinct.len(), rows.len(), "{at}: day {d} holds a row twice");
        let wholly_old = old.get(d) == Some(rows);
        let only_new = new.get(d).is_some_and(|n| rows.iter().all(|r| n.binary_search(r).is_ok()));
        assert!(wholly_old || only_new, "{at}: day {d} mixes old and new rows (or holds foreign ones): {rows:?}");
    }
    for (d, before) in seen.iter() {
        let rows = now.get(d).map(Vec::as_slice).unwrap_or_default();
        let lost: Vec<&(i64, i64)> = before.iter().filter(|r| rows.binary_search(r).is_err()).collect();
        assert!(lost.is_empty(), "{at}: day {d} lost new rows an earlier read saw: {lost:?}");
    }
    for (d, rows) in now {
        if new.get(d).is_some_and(|n| rows.iter().all(|r| n.binary_search(r).is_ok())) && old.get(d) != Some(rows) {
            seen.entry(d.clone()).or_default().extend(rows.iter().copied());
        }
    }
}

/// Snapshots of table `TABLE` committed by job `id` (any incarnation),
/// oldest first: `(incarnation, checkpoint, operation)`.
fn snapshots_of(warehouse: &Path, id: &str) -> Vec<(String, u64, String)> {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    let metadata = table.metadata();
    let mut out = Vec::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|id| metadata.snapshot_by_id(id)) {
        let props = &s.summary().additional_properties;
        if props.get("sluice.job-id").map(String::as_str) == Some(id) {
            let incarnation = props.get("sluice.incarnation").cloned().unwrap_or_default();
            let c = props.get("sluice.checkpoint-id").and_then(|c| c.parse().ok()).unwrap_or(0);
            out.push((incarnation, c, s.summary().operation.as_str().to_string()));
        }
        next = s.parent_snapshot_id();
    }
    out.reverse();
    out
}

/// Asserts that no checkpoint of an incarnation of job `id` was committed twice.
fn assert_no_checkpoint_twice(warehouse: &Path, id: &str) {
    let snapshots = snapshots_of(warehouse, id);
    let distinct: BTreeSet<(&String, u64)> = snapshots.iter().map(|(i, c, _)| (i, *c)).collect();
    assert_eq!(distinct.len(), snapshots.len(), "a checkpoint of job {id} was committed twice: {snapshots:?}");
}

/// The log line of a run that starts a new incarnation, once it is recorded.
const NEW_INCARNATION: &[&str] = &["started a new incarnation of the job"];

/// Runs the job to its end at full speed; returns what it printed.
fn finish(job: &TestJob) -> String {
    let out = rerun_to_end(job, &["source.rate=100000000.0".to_string()]);
    assert!(out.contains("finished") || out.contains("already complete"), "{out}");
    out
}

/// Appends `rows` with job `base` (append mode, small checkpoints, so each
/// day is several small files) and checks the table holds them.
fn baseline(warehouse: &Path, rows: &[Row], every_rows: u64) -> TestJob {
    let base = job("base", warehouse, "append", 1, every_rows, None);
    write_input(&base, rows);
    rerun_to_end(&base, &[]);
    assert_eq!(by_day(warehouse), expected(rows), "the baseline");
    base
}

/// A backfill of four days over six, SIGKILLed at seeded random moments and
/// run again until it ends; then the same backfill as a new incarnation (a
/// fresh state directory, `--new-incarnation`), killed once and run to its
/// end: the table is as after the first.
#[test]
fn killed_backfill_and_its_killed_rerun_replace_each_day_exactly_once() {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed());
    let warehouse = tempfile::tempdir().expect("warehouse");
    let old = old_rows(100);
    baseline(warehouse.path(), &old, 1000);
    // 4,000 rows at 1,600 rows/s over two writers (each reads two days,
    // 2.5 s), a checkpoint about every 0.25 s (so each day spans several):
    // two runs killed at most 1 s after they start cannot finish it.
    let new = new_rows(1000);
    let backfill = job("backfill", warehouse.path(), "overwrite-partitions", 2, 200, Some(1600));
    write_input(&backfill, &new);
    let (old_days, new_days, want) = (expected(&old), expected(&new), after_backfill(&old, &new));

    let mut seen = BTreeMap::new();
    let mut kills = 0;
    let mut replaced = 0;
    while kills < 3 {
        let life = Duration::from_millis(rng.random_range(200..1000));
        let run = run_kill_after(&backfill, &[], STARTED, life);
        replaced += run.stderr.matches("replaced ").count();
        eprintln!(
            "run killed {:?} after start: {} checkpoint(s) committed, {} replacing days",
            life,
            run.stderr.matches("checkpoint committed").count(),
            run.stderr.matches("replaced ").count()
        );
        if !run.killed {
            break;
        }
        kills += 1;
        let now = by_day(warehouse.path());
        assert_never_mixed(&now, &old_days, &new_days, &mut seen, &format!("after kill {kills} ({life:?})"));
    }
    eprintln!("backfill: {kills} kills, {replaced} commits replaced days before the last kill");
    assert!(kills >= 2, "the backfill ended before its second kill; it needs more rows");
    finish(&backfill);
    let after_first = by_day(warehouse.path());
    assert_eq!(after_first, want, "after the killed backfill");
    assert_no_checkpoint_twice(warehouse.path(), "backfill");

    // The same backfill again, as a new incarnation in a fresh state directory.
    let rerun = job("backfill", warehouse.path(), "overwrite-partitions", 2, 200, Some(1600));
    write_input(&rerun, &new);
    let life = Duration::from_millis(rng.random_range(300..1000));
    let run = run_kill_after(&rerun, &["--new-incarnation"], NEW_INCARNATION, life);
    assert!(run.killed, "the rerun ended before its kill; it needs more rows:\n{}", run.stderr);
    assert!(
        run.stderr.contains("landed there before, and is replaced too"),
        "the rerun says it replaces:\n{}",
        run.stderr
    );
    // Mid-rerun, a day is as the first run left it or partly replaced
    // again by the same rows: never doubled.
    let mut seen = BTreeMap::new();
    assert_never_mixed(&by_day(warehouse.path()), &after_first, &new_days, &mut seen, "after the rerun's kill");
    finish(&rerun);
    assert_eq!(by_day(warehouse.path()), after_first, "after the killed rerun");
    assert_no_checkpoint_twice(warehouse.path(), "backfill");
    let incarnations: BTreeSet<String> = snapshots_of(warehouse.path(), "backfill").into_iter().map(|s| s.0).collect();
    assert_eq!(incarnations.len(), 2, "two incarnations committed: {incarnations:?}");
    eprintln!("killed backfill and rerun: {:.0}s", started.elapsed().as_secs_f64());
}

/// `sluice maintain` (compaction) in a loop on the table while an overwrite
/// job replaces days of it: the job ends exact, and no read between two
/// maintenance runs finds a day mixing old and new rows, a row twice or a
/// row lost.
#[test]
fn compaction_beside_an_overwrite_job_keeps_each_day_old_or_new() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    // Old days of 2 small files each, so there is something to compact in
    // the days being replaced as well as in the others.
    let old = old_rows(100);
    let base = baseline(warehouse.path(), &old, 50);
    // 2,400 rows at 300 rows/s over two writers, a checkpoint about every
    // 0.3 s: about eight seconds of small appends and replaces.
    let new = new_rows(600);
    let backfill = job("compacted", warehouse.path(), "overwrite-partitions", 2, 50, Some(300));
    write_input(&backfill, &new);
    let (old_days, new_days) = (expected(&old), expected(&new));

    let done = AtomicBool::new(false);
    let started = Instant::now();
    let base_file = base.path().display().to_string();
    let (job_out, (runs, compacted)) = std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            let out = sluice_run(&backfill, &[]).output().expect("running sluice");
            done.store(true, Ordering::Relaxed);
            out
        });
        let mut seen = BTreeMap::new();
        let (mut runs, mut compacted) = (0u32, 0u64);
        while !done.load(Ordering::Relaxed) {
            let out = Command::new(sluice_tests::sluice_bin())
                .args(["maintain", &base_file, "--target-file-mb", "1"])
                .current_dir(base.dir.path())
                .env("SLUICE_CACHE_DIR", cache_dir())
                .env("NO_COLOR", "1")
                .output()
                .expect("running sluice maintain");
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            // A run may give up after many conflicts with the job's commits: it then changed nothing.
            assert!(out.status.success() || stderr.contains("conflicted"), "sluice maintain failed:\n{stderr}");
            runs += 1;
            compacted += compacted_files(&stdout);
            eprintln!(
                "maintain run {runs} ended {:.1}s into the job: {}",
                started.elapsed().as_secs_f64(),
                stdout.trim()
            );
            let now = by_day(warehouse.path());
            assert_never_mixed(&now, &old_days, &new_days, &mut seen, &format!("after maintain run {runs}"));
        }
        (running.join().expect("the job's thread"), (runs, compacted))
    });
    assert!(job_out.status.success(), "the overwrite job failed:\n{}", String::from_utf8_lossy(&job_out.stderr));
    eprintln!("compaction beside an overwrite: {runs} maintain runs compacted {compacted} file(s) while the job ran");
    assert!(compacted > 0, "no maintain run compacted anything while the job ran ({runs} runs)");
    let want = after_backfill(&old, &new);
    assert_eq!(by_day(warehouse.path()), want, "after the job");
    // A last compaction, after the job. The days the job replaced are
    // compacted by it, or were by a maintain run that ended after the job's
    // last commit (a tests/run of 2026-12-06 saw that): either way it ends
    // on its own and leaves the rows as they were.
    let (code, out, err) = run_cli(&["maintain", &base_file, "--target-file-mb", "1"], base.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("table db.daily:"), "{out}");
    assert_eq!(by_day(warehouse.path()), want, "after the last compaction");
    assert_no_checkpoint_twice(warehouse.path(), "compacted");
}

/// How many files `sluice maintain` reported compacting (`compacted N file(s)`).
fn compacted_files(stdout: &str) -> u64 {
    stdout
        .split("compacted ")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        .sum()
}
