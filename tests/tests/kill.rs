//! SIGKILL the real `sluice run` process mid-job, twice, and run it again:
//! the final output is the source, exactly once (files and BigQuery sinks).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sluice_tests::{TestJob, assert_exactly_once, cache_dir, ids, read_visible, sluice_bin};

const ROWS: u64 = 40_000;

fn committed_dirs(job: &TestJob) -> usize {
    std::fs::read_dir(job.out()).map(|d| d.count()).unwrap_or(0)
}

/// Starts `sluice run` and SIGKILLs it once `at_least` checkpoints are visible.
fn run_and_kill(job: &TestJob, at_least: usize) {
    let mut child = Command::new(sluice_bin())
        .args(["run", "job.toml", "--progress", "plain"])
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting sluice");
    let start = Instant::now();
    while committed_dirs(job) < at_least {
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

#[test]
fn sigkill_mid_job_then_rerun() {
    let mut job = TestJob::files("sigkill", ROWS, 2, 1000);
    // Slow enough to be killed mid-way: about 4 s for the whole job.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job.load(&[]).expect("valid job");

    run_and_kill(&job, 3);
    let first = committed_dirs(&job);
    let partial = ids(&read_visible(&job.out()));
    let mut sorted = partial.clone();
    sorted.dedup();
    assert_eq!(partial, sorted, "duplicates visible after SIGKILL");

    run_and_kill(&job, first + 4);

    let out = Command::new(sluice_bin())
        .args(["run", "job.toml", "--progress", "plain"])
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .output()
        .expect("running sluice");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
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
    let mut job = TestJob::bigquery("sigkill-bq", &double.address(), table, ROWS, 2, 1000);
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job.load(&[]).expect("valid job");

    let run_and_kill = |at_least: u64| {
        let mut child = Command::new(sluice_bin())
            .args(["run", "job.toml", "--progress", "plain"])
            .current_dir(job.dir.path())
            .env("SLUICE_CACHE_DIR", cache_dir())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting sluice");
        let start = Instant::now();
        while double.visible_count(table) < at_least {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("sluice ended ({status}) before it could be killed; slow the source down");
            }
            assert!(start.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
            std::thread::sleep(Duration::from_millis(20));
        }
        child.kill().expect("SIGKILL");
        assert!(!child.wait().expect("reaping sluice").success(), "killed process reported success");
    };
    run_and_kill(4000);
    let partial = ids(&sluice_tests::bigquery_rows(&double.visible_rows(table)));
    let mut sorted = partial.clone();
    sorted.dedup();
    assert_eq!(partial, sorted, "duplicates visible after SIGKILL");
    run_and_kill(double.visible_count(table) + 6000);

    let out = Command::new(sluice_bin())
        .args(["run", "job.toml", "--progress", "plain"])
        .current_dir(job.dir.path())
        .env("SLUICE_CACHE_DIR", cache_dir())
        .output()
        .expect("running sluice");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    sluice_tests::assert_exactly_once_range(&sluice_tests::bigquery_rows(&double.visible_rows(table)), 0, ROWS);
}
