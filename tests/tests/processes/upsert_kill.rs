//! The Iceberg sink's `mode = "upsert"` under the real `sluice` process
//! (issue 41, point 5): a change stream (several files of updates, deletes
//! and re-inserts of earlier keys) SIGKILLed at seeded random moments and
//! run again until it ends; then a change stream killed and resumed while
//! `sluice maintain` compacts the same table in a loop beside it (each
//! compaction applying the position deletes the job commits).
//!
//! Invariants checked:
//! - at the end, the table holds every key in its last state, once, as
//!   PyIceberg and DuckDB's `iceberg_scan` read it (they must agree), and
//!   no checkpoint was committed twice;
//! - at every read in between (after a kill, after a maintenance run), no
//!   key holds two rows, every row is a state its key had in the stream,
//!   and no key's row is older than one an earlier read saw (a change
//!   applied is never undone: nothing deleted comes back, nothing twice).
//!
//! Every change carries a value unique in the stream (its line number), so
//! a row names the change that made it. `SLUICE_UPSERT_KILL_SEED` repeats
//! a stream and its kill times.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_tests::changes::{self, Row};
use sluice_tests::kill::{STARTED, run_kill_after};
use sluice_tests::{TestJob, cache_dir, python, rerun_to_end, run_cli, sluice_run};

const TABLE: &str = "crm.accounts";

/// One change: `(delete, id, v)`; `v` is unique in the stream.
type Change = (bool, i64, i64);

fn seed() -> u64 {
    let seed = std::env::var("SLUICE_UPSERT_KILL_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    });
    eprintln!("upsert kill seed: {seed} (SLUICE_UPSERT_KILL_SEED={seed} repeats the stream and the kill times)");
    seed
}

/// `files` files of `lines` changes: the first inserts `keys` keys, the
/// others update live keys (half), delete them (a fifth), insert deleted
/// keys again and insert new keys.
fn stream(rng: &mut StdRng, keys: i64, files: usize, lines: usize) -> Vec<Vec<Change>> {
    let mut live: Vec<i64> = Vec::new();
    let mut dead: Vec<i64> = Vec::new();
    let mut next_id = 0i64;
    let mut v = 0i64;
    let mut out = Vec::new();
    for f in 0..files {
        let mut file = Vec::with_capacity(lines);
        for _ in 0..lines {
            v += 1;
            let roll = rng.random_range(0..100);
            let change = if (f == 0 && next_id < keys) || live.is_empty() || (roll >= 85 && dead.is_empty()) {
                live.push(next_id);
                next_id += 1;
                (false, next_id - 1, v)
            } else if roll < 50 {
                (false, live[rng.random_range(0..live.len())], v)
            } else if roll < 70 {
                let id = live.swap_remove(rng.random_range(0..live.len()));
                dead.push(id);
                (true, id, v)
            } else if roll < 85 && !dead.is_empty() {
                let id = dead.swap_remove(rng.random_range(0..dead.len()));
                live.push(id);
                (false, id, v)
            } else {
                live.push(next_id);
                next_id += 1;
                (false, next_id - 1, v)
            };
            file.push(change);
        }
        out.push(file);
    }
    out
}

/// The change stream job: `in/*.jsonl` (`op` the change column, `id` the
/// key) into `TABLE` of `warehouse` in upsert mode, checkpoints every
/// `every_rows` rows per writer, a source of `rate` rows per second.
fn job(id: &str, warehouse: &Path, parallelism: u32, every_rows: u64, rate: u32) -> TestJob {
    let source = format!("batch_rows = 20\nrate = {rate}.0");
    let job = changes::upsert_job(id, warehouse, TABLE, parallelism, every_rows, &source, "key = \"id\"");
    job.load(&[]).expect("a valid job");
    job
}

/// The stream as the files spell it: deletes spell their op three ways,
/// upserts four.
fn spelled(files: &[Vec<Change>]) -> Vec<Vec<(&'static str, i64, i64)>> {
    files
        .iter()
        .map(|lines| {
            lines
                .iter()
                .map(|&(delete, id, v)| {
                    let op = match (delete, v % 4) {
                        (true, 0) => "d",
                        (true, 1) => "Delete",
                        (true, _) => "delete",
                        (false, 0) => "insert",
                        (false, 1) => "u",
                        (false, 2) => "update",
                        (false, _) => "c",
                    };
                    (op, id, v)
                })
                .collect()
        })
        .collect()
}

/// Writes the stream as `in/00N.jsonl`.
fn write_stream(job: &TestJob, files: &[Vec<Change>]) {
    changes::write_changes(job, &spelled(files));
}

/// Every key in its last state.
fn model(files: &[Vec<Change>]) -> Vec<Row> {
    changes::model(&spelled(files))
}

/// Every row of the table, sorted, as PyIceberg reads it; panics when
/// DuckDB's `iceberg_scan` reads anything else. Empty before the table has
/// a snapshot.
fn rows(warehouse: &Path) -> Vec<Row> {
    changes::read_rows(warehouse, TABLE, None)
}

/// Checks a read taken mid-run: each key once, each row a state its key
/// had (the upsert of line `v`), and no key's row older than the row an
/// earlier read saw (`seen`: key → `v`), which this read then updates.
fn assert_mid_run(now: &[Row], files: &[Vec<Change>], seen: &mut BTreeMap<i64, i64>, at: &str) {
    let upserts: BTreeMap<i64, i64> = files.iter().flatten().filter(|c| !c.0).map(|(_, id, v)| (*v, *id)).collect();
    let mut ids: Vec<i64> = now.iter().map(|r| r.0).collect();
    ids.dedup();
    assert_eq!(ids.len(), now.len(), "{at}: a key holds two rows");
    for (id, name, v) in now {
        assert!(
            upserts.get(v) == Some(id) && *name == format!("n{id}-{v}"),
            "{at}: row {id}/{name}/{v} is no state of key {id}"
        );
        if let Some(before) = seen.get(id) {
            assert!(v >= before, "{at}: key {id} went back from the change of line {before} to that of line {v}");
        }
        seen.insert(*id, *v);
    }
}

/// Asserts that no checkpoint of job `id` was committed twice (same
/// incarnation and checkpoint in two snapshots of the current ancestry).
fn assert_no_checkpoint_twice(warehouse: &Path, id: &str) {
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).expect("table name");
    let table = sluice_tests::catalog(warehouse).load(&ident).expect("loading the table");
    let metadata = table.metadata();
    let mut seen = std::collections::BTreeSet::new();
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|id| metadata.snapshot_by_id(id)) {
        let props = &s.summary().additional_properties;
        if props.get("sluice.job-id").map(String::as_str) == Some(id) {
            let key = (props.get("sluice.incarnation").cloned(), props.get("sluice.checkpoint-id").cloned());
            assert!(seen.insert(key.clone()), "checkpoint {key:?} of job {id} was committed twice");
        }
        next = s.parent_snapshot_id();
    }
}

/// How many files `sluice maintain` reported compacting (`compacted N file(s)`).
fn compacted_files(stdout: &str) -> u64 {
    stdout
        .split("compacted ")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
        .sum()
}

/// A change stream of 6 files at parallelism 2, SIGKILLed at seeded random
/// moments three times and run again until it ends: every read between
/// kills is a state the stream passed through, key by key, and the end is
/// the model.
#[test]
fn a_killed_change_stream_resumes_to_each_keys_last_state() {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed());
    let warehouse = tempfile::tempdir().expect("warehouse");
    // 2,400 changes at 600 rows/s per writer (each writer reads every
    // file and keeps its keys), a checkpoint every 60 of its rows: about
    // four seconds of commits, most of them replacing and deleting rows of
    // earlier checkpoints.
    let files = stream(&mut rng, 150, 6, 400);
    let run = job("cdc-kill", warehouse.path(), 2, 60, 600);
    write_stream(&run, &files);
    let mut seen = BTreeMap::new();
    let mut kills = 0;
    while kills < 3 {
        let life = Duration::from_millis(rng.random_range(300..1200));
        let killed = run_kill_after(&run, &[], STARTED, life);
        eprintln!(
            "run killed {life:?} after start: {} checkpoint(s) committed",
            killed.stderr.matches("checkpoint committed").count()
        );
        if !killed.killed {
            break;
        }
        kills += 1;
        assert_mid_run(&rows(warehouse.path()), &files, &mut seen, &format!("after kill {kills} ({life:?})"));
    }
    assert!(kills >= 2, "the stream ended before its second kill; it needs more rows");
    let out = rerun_to_end(&run, &["source.rate=100000000.0".to_string()]);
    assert!(out.contains("finished") || out.contains("already complete"), "{out}");
    let got = rows(warehouse.path());
    assert_mid_run(&got, &files, &mut seen, "at the end");
    assert_eq!(got, model(&files), "after {kills} kills");
    assert_no_checkpoint_twice(warehouse.path(), "cdc-kill");
    eprintln!("killed change stream: {kills} kills, {:.0}s", started.elapsed().as_secs_f64());
}

/// `sluice maintain` compacting the table in a loop while a change stream
/// lands on it, killed once mid-run and resumed: every compaction applies
/// the deletes committed before it (or gives up when the job deleted rows
/// of the files it rewrote meanwhile), no read between two maintenance
/// runs sees a key twice or going back, and the end is the model. A last
/// compaction after the job drops every delete file.
#[test]
fn compaction_beside_a_killed_change_stream_keeps_each_key_exact() {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed());
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream(&mut rng, 100, 5, 300);
    // 1,500 changes at 100 rows/s, a checkpoint every 300 rows (3 s):
    // about fifteen seconds of upsert commits across the kill. Nearly every
    // checkpoint deletes rows of every file (its updates hit keys all over
    // the table), so a compaction commits only when it reads and rewrites
    // between two of them: the exactly-once rule, not a flaw of the test.
    // A checkpoint every 1.25 s left a loaded 2-core machine no window for
    // one in a whole run (CI, 2026-12-06).
    let run = job("cdc-compacted", warehouse.path(), 1, 300, 100);
    write_stream(&run, &files);
    // `sluice maintain` runs on a job file of its own naming the same table
    // (the running job's state directory is its own). A first run before
    // the job (the table does not exist yet) has the plugin compiled and
    // cached, so the runs beside the job are quick.
    let maint = job("maint", warehouse.path(), 1, 250, 200);
    let maint_file = maint.path().display().to_string();
    let (code, _, err) = run_cli(&["maintain", &maint_file, "--target-file-mb", "1"], maint.dir.path());
    assert_eq!(code, 0, "{err}");

    let done = AtomicBool::new(false);
    let (killed, (runs, compacted, seen)) = std::thread::scope(|scope| {
        let running = scope.spawn(|| {
            // After the first checkpoint or two.
            let life = Duration::from_millis(rng.random_range(3500..7000));
            let killed = run_kill_after(&run, &[], STARTED, life);
            eprintln!("change stream killed {life:?} after start: {}", killed.killed);
            let out = sluice_run(&run, &[]).output().expect("running sluice");
            done.store(true, Ordering::Relaxed);
            assert!(out.status.success(), "the resumed job failed:\n{}", String::from_utf8_lossy(&out.stderr));
            killed.killed
        });
        let mut seen = BTreeMap::new();
        let (mut runs, mut compacted) = (0u32, 0u64);
        while !done.load(Ordering::Relaxed) {
            let out = Command::new(sluice_tests::sluice_bin())
                .args(["maintain", &maint_file, "--target-file-mb", "1"])
                .current_dir(maint.dir.path())
                .env("SLUICE_CACHE_DIR", cache_dir())
                .env("NO_COLOR", "1")
                .output()
                .expect("running sluice maintain");
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            // A run may give up after many conflicts with the job's commits: it then changed nothing.
            assert!(out.status.success() || stderr.contains("conflicted"), "sluice maintain failed:\n{stderr}");
            runs += 1;
            compacted += compacted_files(&stdout);
            eprintln!("maintain run {runs} at {:.1}s: {}", started.elapsed().as_secs_f64(), stdout.trim());
            assert_mid_run(&rows(warehouse.path()), &files, &mut seen, &format!("after maintain run {runs}"));
        }
        (running.join().expect("the job's thread"), (runs, compacted, seen))
    });
    eprintln!(
        "compaction beside a change stream: {runs} maintain runs compacted {compacted} file(s), killed: {killed}"
    );
    assert!(runs >= 2, "the job ended before maintenance ran twice");
    assert!(compacted > 0, "no maintain run compacted anything while the job ran ({runs} runs)");
    let mut seen = seen;
    let got = rows(warehouse.path());
    assert_mid_run(&got, &files, &mut seen, "at the end");
    assert_eq!(got, model(&files), "after the job");
    assert_no_checkpoint_twice(warehouse.path(), "cdc-compacted");
    // A last compaction after the job applies every delete left, or finds
    // that a maintain run which ended after the job's last commit already
    // did (a tests/run of 2026-12-06 saw that): either way no delete file
    // stays live, and the rows are as they were.
    let (code, out, err) = run_cli(&["maintain", &maint_file, "--target-file-mb", "1"], maint.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("table {TABLE}:")), "{out}");
    assert_eq!(rows(warehouse.path()), model(&files), "after the last compaction");
    let live_deletes = python(
        "import sys\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         print(t.inspect.delete_files().num_rows)",
        &[&warehouse.path().display().to_string(), TABLE],
    )
    .expect("pyiceberg");
    assert_eq!(live_deletes.trim(), "0", "delete files stayed live after the last compaction");
    eprintln!("compaction beside a killed change stream: {:.0}s", started.elapsed().as_secs_f64());
}
