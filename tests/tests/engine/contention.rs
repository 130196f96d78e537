//! A small configuration of the contention study (`bench`, seed 002): Sluice's
//! fan-in committer (strategy D) lands every window with zero conflicts and
//! zero loss, and the per-day retry strategy A never duplicates a row.

use std::path::Path;
use std::time::Duration;

use sluice_bench::contention::{Config, Strategy, run_once};
use sluice_tests::{ICEBERG_PLUGIN, host};

fn config() -> Config {
    Config {
        writers: 3,
        windows: 2,
        rows_per_partition: 4,
        max_attempts: 8,
        backoff_base: Duration::from_millis(5),
        backoff_cap: Duration::from_millis(100),
        commit_delay: Duration::from_millis(2),
        seed: 7,
    }
}

#[test]
fn fan_in_committer_has_no_conflicts_and_loses_nothing() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = tempfile::tempdir().expect("dir");
    let cfg = config();
    let d = run_once(&rt, host(), Path::new(ICEBERG_PLUGIN), Strategy::D, &cfg, dir.path()).expect("strategy D runs");
    assert_eq!(d.conflicts, 0, "{d:?}");
    assert_eq!(d.lost_windows, 0, "{d:?}");
    assert_eq!(d.attempts, u64::from(cfg.windows), "one commit per window: {d:?}");
    assert_eq!(d.rows_landed, cfg.expected_rows(), "{d:?}");
    assert_eq!(d.duplicated_rows, 0, "{d:?}");

    let dir = tempfile::tempdir().expect("dir");
    let a = run_once(&rt, host(), Path::new(ICEBERG_PLUGIN), Strategy::A, &cfg, dir.path()).expect("strategy A runs");
    assert_eq!(a.duplicated_rows, 0, "{a:?}");
    assert!(a.attempts >= u64::from(cfg.writers * cfg.windows) * 30, "A commits every day-partition: {a:?}");
    assert!(a.rows_landed <= cfg.expected_rows(), "{a:?}");
}
