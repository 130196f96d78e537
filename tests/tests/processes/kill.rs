//! SIGKILL the real `sluice run` process mid-job, twice, and run it again:
//! the final output is the source, exactly once (files and BigQuery sinks).

use sluice_bigquery_double::Reflush;
use sluice_tests::{
    TestJob, assert_exactly_once, assert_exactly_once_range, bigquery_rows, ids, read_visible, rerun_to_end,
    run_and_kill,
};

const ROWS: u64 = 40_000;

fn committed_dirs(job: &TestJob) -> u64 {
    std::fs::read_dir(job.out()).map(|d| d.count() as u64).unwrap_or(0)
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

    let stdout = rerun_to_end(&job, &[]);
    assert!(stdout.contains(&format!("{ROWS} rows in total")) && stdout.contains("attempt 3"), "{stdout}");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
}

/// The same against the BigQuery sink: the real process is killed twice while
/// it appends and flushes over gRPC; the rerun leaves every row visible once.
/// A restart flushes the last checkpoint again, so this runs once for each
/// way a service may answer a repeated flush.
fn sigkill_mid_bigquery_job_then_rerun(reflush: Reflush) {
    use sluice_bigquery_double::{BigQueryDouble, generator_schema};
    let table = "projects/p/datasets/d/tables/killed";
    let double = BigQueryDouble::start().expect("double");
    double.answer_reflush(reflush);
    double.create_table(table, generator_schema());
    let job = slowed(TestJob::bigquery("sigkill-bq", &double.address(), table, ROWS, 2, 1000));
    let visible = || double.visible_count(table);

    run_and_kill(&job, visible, 4000);
    assert_no_duplicates(ids(&bigquery_rows(&double.visible_rows(table))));
    run_and_kill(&job, visible, visible() + 6000);

    rerun_to_end(&job, &[]);
    assert_exactly_once_range(&bigquery_rows(&double.visible_rows(table)), 0, ROWS);
}

#[test]
fn sigkill_mid_bigquery_job_reflush_ok() {
    sigkill_mid_bigquery_job_then_rerun(Reflush::Ok);
}

#[test]
fn sigkill_mid_bigquery_job_reflush_already_exists() {
    sigkill_mid_bigquery_job_then_rerun(Reflush::AlreadyExists);
}

#[test]
fn sigkill_mid_bigquery_job_reflush_out_of_range() {
    sigkill_mid_bigquery_job_then_rerun(Reflush::OutOfRange);
}
