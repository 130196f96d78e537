//! Real-process checks of issue #38: an unknown outcome is never a failure,
//! and orphan cleanup never eats what a pending checkpoint will commit. The
//! real `sluice` binary runs an Iceberg job (local warehouse, SQLite
//! catalog) whose `job.state_dir` is on S3: moto's server on 127.0.0.1,
//! reached through a fault-injecting proxy ([`FaultProxy`]) where a test
//! needs a fault at the HTTP boundary.
//!
//! - a `500` on the ListObjectsV2 that follows checkpoint 3's record PUT
//!   (the record is durable; the listing is only for pruning);
//! - checkpoint 3's record PUT stored by moto, its reply lost (the proxy
//!   closes the connection instead of answering);
//! - `sluice maintain --remove-orphans-older-than 0s` again and again beside
//!   a running job whose state is on S3;
//! - `sluice maintain` run as job A, without `--protect`, while job B, which
//!   writes the same table, lies crashed with a persisted, uncommitted
//!   checkpoint; then B resumes.
//!
//! Each check ends with a full PyIceberg scan of the table (which fails with
//! `FileNotFoundError` if a snapshot names a removed file) and every id
//! exactly once; and with iceberg-rust's read, comparing values too.
//!
//! The proxy's record of what fired is asserted, so each fault is known to
//! have happened. The host reaches moto with the standard AWS environment
//! (`AWS_REGION`, keys; `AWS_ENDPOINT_URL` is moto itself), set once for
//! this process and inherited by the processes it starts; the state
//! directory's own endpoint (`job.s3.endpoint`) is the test's proxy.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sluice::engine::{CrashPoint, Fault};
use sluice_store::ObjectStore;
use sluice_tests::fault_proxy::{Action, FaultProxy, Match, Rule};
use sluice_tests::harness::{block, buckets, moto};
use sluice_tests::{TestJob, assert_exactly_once_range, cache_dir, python, read_iceberg, sluice_bin, sluice_run};

const BUCKET: &str = buckets::OUTCOME;
const TABLE: &str = "db.events";

/// Moto started and the `sluice` binary built (which may take minutes,
/// once): from here on a test's own time counts.
fn started() -> Instant {
    moto();
    sluice_bin();
    Instant::now()
}

/// Keys under `prefix`, relative to it, read straight from moto.
fn keys(prefix: &str) -> Vec<String> {
    let bucket = ObjectStore::s3(BUCKET, &moto().s3_options()).expect("bucket");
    let listed = block(bucket.list(prefix)).expect("list");
    listed.into_iter().map(|o| o.key.strip_prefix(&format!("{prefix}/")).unwrap_or(&o.key).to_string()).collect()
}

/// `--set`s that put the job's state on S3 under `prefix`, reached at
/// `endpoint` (a proxy, or moto itself), with a short lease.
fn state_on_s3(prefix: &str, endpoint: &str) -> Vec<String> {
    vec![
        format!("job.state_dir=s3://{BUCKET}/{prefix}"),
        "job.lease_secs=2".to_string(),
        format!("job.s3.endpoint={endpoint}"),
    ]
}

/// A generator → Iceberg job on `TABLE` in `warehouse`: `rows` rows from
/// `first_id`, two writers, a checkpoint every `every_rows` rows per writer,
/// at `rate` rows a second when given.
fn iceberg_job(id: &str, warehouse: &Path, rows: u64, first_id: u64, every_rows: u64, rate: Option<u64>) -> TestJob {
    let mut job = TestJob::iceberg(id, warehouse, TABLE, rows, first_id, 2, every_rows);
    if let Some(rate) = rate {
        job.toml = job.toml.replace("batch_rows = 700", &format!("batch_rows = 200\nrate = {rate}.0"));
    }
    std::fs::write(job.path(), &job.toml).expect("job file");
    job
}

/// The name of checkpoint `c`'s first record (see `engine/object_state.rs`).
fn record_name(c: u64) -> String {
    format!("chk-{c:020}-000000.json")
}

/// Runs `sluice run` to its end; returns (success, stderr).
fn run(job: &TestJob, sets: &[String]) -> (bool, String) {
    let out = sluice_run(job, sets).output().expect("running sluice");
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// A run that failed must have failed as the engine reports errors, not by
/// a panic.
fn assert_no_panic(stderr: &str) {
    assert!(!stderr.contains("panicked at"), "sluice panicked:\n{stderr}");
}

/// The ids of a full PyIceberg scan of `table`, and the data files its
/// snapshot names. A scan that cannot read a file fails the test with
/// PyIceberg's error (e.g. `FileNotFoundError`).
fn pyiceberg_scan(warehouse: &Path, table: &str) -> (Vec<i64>, Vec<String>) {
    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name = sys.argv[1], sys.argv[2]\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}').load_table(name)\n\
         a = t.scan().to_arrow()\n\
         files = [x.file.file_path.removeprefix('file://') for x in t.scan().plan_files()]\n\
         print(json.dumps({'ids': a.column('id').to_pylist(), 'files': files}))",
        &[&warehouse.display().to_string(), table],
    )
    .unwrap_or_else(|e| panic!("PyIceberg's full scan of {table} failed:\n{e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    (serde_json::from_value(v["ids"].clone()).expect("ids"), serde_json::from_value(v["files"].clone()).expect("files"))
}

/// Asserts that `ids` are exactly `first..first + rows`, each once.
fn assert_ids_once(ids: &[i64], first: u64, rows: u64) {
    let mut seen = std::collections::BTreeMap::<i64, u32>::new();
    for id in ids {
        *seen.entry(*id).or_default() += 1;
    }
    let (lo, hi) = (first as i64, (first + rows) as i64);
    let duplicated: Vec<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).take(10).collect();
    let lost: Vec<i64> = (lo..hi).filter(|id| !seen.contains_key(id)).take(10).collect();
    let foreign: Vec<i64> = seen.keys().filter(|id| **id < lo || **id >= hi).copied().take(10).collect();
    assert!(
        duplicated.is_empty() && lost.is_empty() && foreign.is_empty(),
        "PyIceberg: not exactly once: {} rows for {rows} source rows; duplicated ids {duplicated:?}, lost ids \
         {lost:?}, unknown ids {foreign:?}",
        ids.len()
    );
}

/// The end of every check: a full PyIceberg scan succeeds and holds every id
/// of `first..first + rows` once; iceberg-rust reads the same rows, with the
/// generator's values, and no checkpoint was committed twice.
fn assert_table_whole(warehouse: &Path, first: u64, rows: u64) {
    let (ids, _) = pyiceberg_scan(warehouse, TABLE);
    assert_ids_once(&ids, first, rows);
    let table = read_iceberg(warehouse, TABLE);
    table.assert_no_checkpoint_twice();
    assert_exactly_once_range(&table.rows, first, rows);
}

/// Parquet files under `dir`, recursively.
fn parquet_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "parquet") {
                out.push(path.display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// `sluice maintain <job> [sets] <args>` in the job's directory: (status
/// code, stdout, stderr).
fn maintain(job: &TestJob, sets: &[String], args: &[&str]) -> (i32, String, String) {
    let mut cmd = Command::new(sluice_bin());
    cmd.arg("maintain").arg(job.path()).args(args).current_dir(job.dir.path());
    for s in sets {
        cmd.args(["--set", s]);
    }
    let out = cmd.env("SLUICE_CACHE_DIR", cache_dir()).env("NO_COLOR", "1").output().expect("running sluice maintain");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Break A, first trigger: one `500` on the listing that follows checkpoint
/// 3's record PUT. The record is durable by then; the listing only finds
/// old records to prune, so its failure must not release checkpoint 3's
/// files. Whatever the first run does, the rerun exits 0 and the table is
/// whole.
#[test]
fn a_500_on_the_listing_after_a_record_put_loses_nothing() {
    let started = started();
    let moto = moto();
    let proxy = FaultProxy::start(&moto.endpoint);
    let warehouse = tempfile::tempdir().expect("warehouse");
    let prefix = "list500/state";
    let sets = state_on_s3(prefix, &proxy.endpoint);
    let job = iceberg_job("uo-list500", warehouse.path(), 6000, 0, 500, None);
    let put3 = Match::put(BUCKET, &format!("{prefix}/")).path(&format!("/checkpoints/{}", record_name(3)));
    proxy.set_rules(vec![
        Rule::new(
            "list after record 3",
            Match::list(BUCKET, &format!("{prefix}/"), &["/checkpoints"]),
            Action::Status(500),
        )
        .after(put3),
    ]);

    let (ok, stderr) = run(&job, &sets);
    let fired = proxy.fired_of("list after record 3");
    assert_eq!(fired.len(), 1, "the fault must happen once: {fired:?}\n{}\n{stderr}", proxy.request_log());
    assert!(fired[0].query.contains("/checkpoints"), "{fired:?}");
    assert_no_panic(&stderr);
    eprintln!("first run (500 on the listing after record 3): success={ok}\n{stderr}");
    proxy.clear_rules();

    let (ok, rerun) = run(&job, &sets);
    assert!(ok, "the rerun must exit 0:\n{rerun}");
    assert_table_whole(warehouse.path(), 0, 6000);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

/// Break A, second trigger: checkpoint 3's record PUT reaches moto and is
/// stored, but its reply is lost (the connection closes). The outcome is
/// unknown: nothing may be released; the next run decides from what the
/// bucket holds (the record is there, so it commits checkpoint 3).
#[test]
fn a_record_put_stored_with_its_reply_lost_loses_nothing() {
    let started = started();
    let moto = moto();
    let proxy = FaultProxy::start(&moto.endpoint);
    let warehouse = tempfile::tempdir().expect("warehouse");
    let prefix = "lostput/state";
    let sets = state_on_s3(prefix, &proxy.endpoint);
    let job = iceberg_job("uo-lostput", warehouse.path(), 6000, 0, 500, None);
    let put3 = Match::put(BUCKET, &format!("{prefix}/")).path(&format!("/checkpoints/{}", record_name(3)));
    proxy.set_rules(vec![Rule::new("record 3 reply lost", put3, Action::DropReplyAfterForward)]);

    let (ok, stderr) = run(&job, &sets);
    let fired = proxy.fired_of("record 3 reply lost");
    assert_eq!(fired.len(), 1, "the fault must happen once: {fired:?}\n{}\n{stderr}", proxy.request_log());
    assert!(
        matches!(fired[0].upstream, Some(200..=299)),
        "moto must have stored the record whose reply was lost: {fired:?}"
    );
    assert_no_panic(&stderr);
    eprintln!("first run (record 3's reply lost): success={ok}\n{stderr}");
    if !ok {
        // The stored record is still in the bucket for the next run to find.
        let held = keys(prefix);
        assert!(
            held.iter().any(|k| k.ends_with(&format!("/checkpoints/{}", record_name(3)))),
            "the record whose reply was lost is gone: {held:?}"
        );
    }
    proxy.clear_rules();

    let (ok, rerun) = run(&job, &sets);
    assert!(ok, "the rerun must exit 0:\n{rerun}");
    assert_table_whole(warehouse.path(), 0, 6000);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

/// A lease renewal (the one after checkpoint 2's record) reaches moto and
/// is stored, but its reply is lost. The next renewal's compare-and-swap
/// then meets this run's own lease under a version it never heard of: that
/// is no other run's, so the run renews over it and lands everything in
/// one go, instead of stopping as if it had lost its lease.
#[test]
fn a_lease_renewal_stored_with_its_reply_lost_keeps_the_lease() {
    let started = started();
    let moto = moto();
    let proxy = FaultProxy::start(&moto.endpoint);
    let warehouse = tempfile::tempdir().expect("warehouse");
    let prefix = "lostlease/state";
    let sets = state_on_s3(prefix, &proxy.endpoint);
    let job = iceberg_job("uo-lostlease", warehouse.path(), 6000, 0, 500, None);
    let put2 = Match::put(BUCKET, &format!("{prefix}/")).path(&format!("/checkpoints/{}", record_name(2)));
    let lease = Match::put(BUCKET, &format!("{prefix}/lease"));
    proxy.set_rules(vec![Rule::new("renewal reply lost", lease, Action::DropReplyAfterForward).after(put2)]);

    let (ok, stderr) = run(&job, &sets);
    let fired = proxy.fired_of("renewal reply lost");
    assert_eq!(fired.len(), 1, "the fault must happen once: {fired:?}\n{}\n{stderr}", proxy.request_log());
    assert!(
        matches!(fired[0].upstream, Some(200..=299)),
        "moto must have stored the renewal whose reply was lost: {fired:?}"
    );
    assert_no_panic(&stderr);
    assert!(ok, "a lost reply of its own renewal must not stop the run:\n{stderr}");
    assert_table_whole(warehouse.path(), 0, 6000);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

/// Break B.1: `sluice maintain --remove-orphans-older-than 0s` beside a run
/// whose state directory is on S3. The proxy holds checkpoint 2's record PUT
/// for a few seconds: the round's files are finished (prepared) and named by
/// no snapshot and no record yet, the window where orphan cleanup would
/// take them. Passes run inside that window, then again and again until the
/// run ends. Each pass must be refused (the run holds its lease), or must
/// leave the files of the round in progress; the run then exits 0 and the
/// table is whole.
#[test]
fn orphan_cleanup_beside_a_run_with_its_state_on_s3_keeps_the_round_in_progress() {
    let started = started();
    let moto = moto();
    let proxy = FaultProxy::start(&moto.endpoint);
    let warehouse = tempfile::tempdir().expect("warehouse");
    let prefix = "beside/state";
    let sets = state_on_s3(prefix, &proxy.endpoint);
    let hold = Duration::from_secs(8);
    let record2 = Match::put(BUCKET, &format!("{prefix}/")).path(&format!("/checkpoints/{}", record_name(2)));
    proxy.set_rules(vec![Rule::new("hold record 2", record2, Action::Delay(hold))]);
    // A checkpoint every 1000 rows per writer, at 2000 rows a second.
    let rows = 12_000;
    let job = iceberg_job("uo-beside", warehouse.path(), rows, 0, 1000, Some(2000));
    let mut run = Running(Some(
        sluice_run(&job, &sets).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("sluice run"),
    ));
    let child = run.0.as_mut().expect("the run");
    let waiting = Instant::now();
    while proxy.fired_of("hold record 2").is_empty() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice ended ({status}) before it persisted checkpoint 2\n{}", proxy.request_log());
        }
        assert!(waiting.elapsed() < Duration::from_secs(60), "no record of checkpoint 2 within a minute");
        std::thread::sleep(Duration::from_millis(10));
    }
    // Whether checkpoint 2's record PUT has reached moto yet.
    let record2_landed = || proxy.requests().iter().any(|r| r.method == "PUT" && r.path.contains(&record_name(2)));
    let mut inside_window = 0u32;
    let (mut refused, mut while_running) = (0u32, 0u32);
    // What each pass that was not refused printed: its report, or its error.
    let mut accepted = Vec::new();
    let mut failed = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while child.try_wait().expect("status").is_none() && Instant::now() < deadline {
        let (code, out, err) = maintain(&job, &sets, &["--no-compact", "--remove-orphans-older-than", "0s"]);
        inside_window += u32::from(!record2_landed());
        let still_running = child.try_wait().expect("status").is_none();
        while_running += u32::from(still_running);
        assert_no_panic(&err);
        if code == 0 {
            accepted.push(out);
        } else if err.contains("uo-beside") && err.contains("runs") {
            // Refused, naming the running job it protects.
            refused += 1;
        } else {
            failed.push(format!("{out}{err}"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = run.0.take().expect("the run").wait_with_output().expect("sluice run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let passes = format!(
        "{while_running} maintenance pass(es) started while the job ran, {inside_window} while checkpoint 2's record \
         was held: {refused} refused, {} accepted, {} failed otherwise\naccepted:\n{}\nfailed:\n{}",
        accepted.len(),
        failed.len(),
        accepted.join("\n"),
        failed.join("\n")
    );
    eprintln!("{passes}");
    assert!(
        inside_window >= 1,
        "no maintenance pass ended while checkpoint 2's record was held ({hold:?}); the machine is too slow"
    );
    let held = proxy.fired_of("hold record 2");
    assert!(held.len() == 1 && matches!(held[0].upstream, Some(200..=299)), "{held:?}");
    assert!(out.status.success(), "the job beside maintenance must exit 0:\n{stderr}\n{passes}");
    assert_table_whole(warehouse.path(), 0, rows);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}

/// A `sluice run` that is SIGKILLed if the test panics before reaping it.
struct Running(Option<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Break B.2: jobs A and B write one table. B crashes right after
/// persisting checkpoint 3 (the engine's `AfterPersist` crash point, in this
/// process): checkpoint 3's files are on disk, named by B's record only.
/// `sluice maintain A.toml --remove-orphans-older-than 0s` is run without
/// `--protect B.toml`. It must not remove B's pending files (the table names
/// B as a writer; B is not known to be finished), and B then resumes to
/// the end: the table is whole.
#[test]
fn orphan_cleanup_without_protect_spares_a_killed_writers_pending_checkpoint() {
    let started = started();
    let moto = moto();
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rows = 3000;
    let a = iceberg_job("uo-shared-a", warehouse.path(), rows, 0, 250, None);
    let b = iceberg_job("uo-shared-b", warehouse.path(), rows, rows, 250, None);
    let a_sets = state_on_s3("shared/a", &moto.endpoint);
    let b_sets = state_on_s3("shared/b", &moto.endpoint);

    let (ok, stderr) = run(&a, &a_sets);
    assert!(ok, "job A runs to its end:\n{stderr}");
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 3, subtask: 0 };
    let b_refs: Vec<&str> = b_sets.iter().map(String::as_str).collect();
    let err = b.run_with(&b_refs, Some(crash)).expect_err("B crashes after persisting checkpoint 3");
    assert!(err.is_injected_crash(), "{err}");

    // B's checkpoint 3: on disk, named by no snapshot.
    let (ids, live) = pyiceberg_scan(warehouse.path(), TABLE);
    // All of A, and B's checkpoints 1 and 2 (two writers × 250 rows each).
    assert_eq!(ids.len() as u64, rows + 1000, "visible before maintenance");
    let pending: Vec<String> = parquet_files(warehouse.path()).into_iter().filter(|f| !live.contains(f)).collect();
    assert!(!pending.is_empty(), "B's pending checkpoint has files on disk outside the table");
    let held = keys("shared/b");
    assert!(held.iter().any(|k| k.ends_with(&format!("/checkpoints/{}", record_name(3)))), "{held:?}");

    let (code, out, err) = maintain(&a, &a_sets, &["--remove-orphans-older-than", "0s"]);
    assert_no_panic(&err);
    eprintln!("sluice maintain A (no --protect): exit {code}\n{out}\n{err}");
    let removed: Vec<&String> = pending.iter().filter(|f| !Path::new(f.as_str()).exists()).collect();
    assert!(
        removed.is_empty(),
        "orphan cleanup run as A removed {} file(s) of B's pending checkpoint 3: {removed:?}\n{out}\n{err}",
        removed.len()
    );

    let (ok, stderr) = run(&b, &b_sets);
    assert!(ok, "B resumes to its end:\n{stderr}");
    assert_table_whole(warehouse.path(), 0, 2 * rows);
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
}
