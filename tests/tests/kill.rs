//! SIGKILL the real `sluice run` process mid-job, twice, and run it again:
//! the final output is the source, exactly once (files and BigQuery sinks).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_tests::{
    TestJob, assert_exactly_once, assert_exactly_once_range, bigquery_rows, cache_dir, ids, read_visible, sluice_bin,
};

const ROWS: u64 = 40_000;

fn committed_dirs(job: &TestJob) -> u64 {
    std::fs::read_dir(job.out()).map(|d| d.count() as u64).unwrap_or(0)
}

fn sluice_run(job: &TestJob) -> Command {
    let mut cmd = Command::new(sluice_bin());
    cmd.args(["run", "job.toml", "--progress", "plain"])
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir());
    cmd
}

/// Starts `sluice run` and SIGKILLs it once `progress()` reaches `at_least`.
fn run_and_kill(job: &TestJob, progress: impl Fn() -> u64, at_least: u64) {
    let mut child = sluice_run(job).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("starting sluice");
    let start = Instant::now();
    while progress() < at_least {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("sluice ended ({status}) before it could be killed; slow the source down");
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("reaping sluice");
    assert!(!status.success(), "killed process reported success");
}

/// Runs the job to its end; returns what it printed.
fn rerun_to_end(job: &TestJob) -> String {
    let out = sluice_run(job).output().expect("running sluice");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn assert_no_duplicates(sorted_ids: Vec<i64>) {
    let mut dedup = sorted_ids.clone();
    dedup.dedup();
    assert_eq!(sorted_ids, dedup, "duplicates visible after SIGKILL");
}

/// Slow enough to be killed mid-way: about 4 s for the whole job.
fn slowed(mut job: TestJob) -> TestJob {
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job.load(&[]).expect("valid job");
    job
}

#[test]
fn sigkill_mid_job_then_rerun() {
    let job = slowed(TestJob::files("sigkill", ROWS, 2, 1000));

    run_and_kill(&job, || committed_dirs(&job), 3);
    let first = committed_dirs(&job);
    assert_no_duplicates(ids(&read_visible(&job.out())));

    run_and_kill(&job, || committed_dirs(&job), first + 4);

    let stdout = rerun_to_end(&job);
    assert!(stdout.contains(&format!("{ROWS} rows in total")) && stdout.contains("attempt 3"), "{stdout}");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
}

/// The same against the BigQuery sink: the real process is killed twice while
/// it appends and flushes over gRPC; the rerun leaves every row visible once.
#[test]
fn sigkill_mid_bigquery_job_then_rerun() {
    use sluice_bigquery_double::{BigQueryDouble, generator_schema};
    let table = "projects/p/datasets/d/tables/killed";
    let double = BigQueryDouble::start().expect("double");
    double.create_table(table, generator_schema());
    let job = slowed(TestJob::bigquery("sigkill-bq", &double.address(), table, ROWS, 2, 1000));
    let visible = || double.visible_count(table);

    run_and_kill(&job, visible, 4000);
    assert_no_duplicates(ids(&bigquery_rows(&double.visible_rows(table))));
    run_and_kill(&job, visible, visible() + 6000);

    rerun_to_end(&job);
    assert_exactly_once_range(&bigquery_rows(&double.visible_rows(table)), 0, ROWS);
}
