//! `job.state_dir` on S3 (moto's server on 127.0.0.1): the checks every
//! object store must pass (`state_object`, run here on S3), and those only
//! moto can show: a takeover whose swap of `current` is throttled, a record
//! corrupted in the bucket, a halted state directory. The host reaches moto
//! through the standard AWS environment (`AWS_ENDPOINT_URL`, `AWS_REGION`,
//! `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`), set once for this process
//! (`sluice_tests::harness::moto`) and inherited by the `sluice run`
//! processes it starts.

use bytes::Bytes;
use sluice::engine::checkpoint::CheckpointError;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice_store::ObjectStore;
use sluice_tests::harness::{block, moto};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_visible, run_cli};

use crate::state_object::{BUCKET, Backend, backend_tests, refs};

backend_tests! { Backend::S3;
    a_job_with_its_state_on_s3_resumes_after_a_crash_and_lands_every_row_once =>
        a_job_with_its_state_in_a_bucket_resumes_after_a_crash_and_lands_every_row_once,
    a_second_live_run_refuses_while_the_first_holds_the_lease => a_second_live_run_refuses_while_the_first_holds_the_lease,
    after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired =>
        after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired,
    a_holder_whose_compare_and_swap_fails_stops_before_its_next_write =>
        a_holder_whose_compare_and_swap_fails_stops_before_its_next_write,
    a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over =>
        a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over,
    a_frozen_holder_that_wakes_after_a_takeover_changes_nothing => a_frozen_holder_that_wakes_after_a_takeover_changes_nothing,
    a_holder_frozen_before_its_first_commit_changes_nothing => a_holder_frozen_before_its_first_commit_changes_nothing,
    a_holder_frozen_before_a_commit_changes_nothing => a_holder_frozen_before_a_commit_changes_nothing,
    a_holder_frozen_before_its_record_lands_changes_nothing => a_holder_frozen_before_its_record_lands_changes_nothing,
    a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy =>
        a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy,
}

/// The bucket, as the test sees it (not through the host).
fn bucket() -> ObjectStore {
    Backend::S3.bucket()
}

/// Keys under `prefix`, relative to it.
fn keys(prefix: &str) -> Vec<String> {
    Backend::S3.keys(prefix)
}

/// `--set`s that put the job's state on S3 under `prefix`, with `lease_secs`.
fn on_s3(prefix: &str, lease_secs: &str) -> Vec<String> {
    Backend::S3.on(prefix, lease_secs)
}

/// A takeover's swap of `current` that fails transiently (the store
/// throttles the lease's writes, `503 SlowDown`) has not landed: the lease
/// still names the old folder. The run must not then remove the old folder
/// (or write state only its own folder holds): if it stopped before a later
/// renewal landed, the next run would copy the old, emptied folder and
/// start the job over, landing every row again. It stops instead, and the
/// next run resumes.
#[test]
fn a_takeover_whose_swap_of_current_fails_transiently_keeps_the_old_state() {
    let prefix = "swap/state";
    let sets = on_s3(prefix, "2");
    let job = TestJob::files("s3-swap", 3100, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());

    // The next run's first write of the lease (its taking) lands; every
    // later one is throttled: the swap, the renewals, the release.
    let lease = format!("/{BUCKET}/{prefix}/lease");
    moto().fail_requests("PUT", &lease, 1, 10_000);
    let second = job.run_with(&refs(&sets), None);
    moto().fail_requests("PUT", &lease, 0, 0);
    let err = second.expect_err("a run that could not make the lease name its state stops");
    assert!(matches!(&err, EngineError::Checkpoint(CheckpointError::LeaseLost { .. })), "{err}");
    let after = keys(prefix);
    assert!(
        after.contains(&"epoch-000001/checkpoints/chk-00000000000000000002-000000.json".to_string()),
        "the state the lease names is still there: {after:?}"
    );

    // The run after it waits out the lease, resumes from the first run's state, and lands every row once.
    let summary = job.run_with(&refs(&sets), None).expect("resumes");
    assert_exactly_once(&read_visible(&job.out()), 3100);
    assert_eq!(summary.attempt, 2, "it resumed the first run's state: {summary:?}");
}

/// Checksums work on S3 as on disk: a record corrupted in the bucket (one
/// byte of its body changed, its length and header kept) is refused on
/// resume, by `sluice check` and by a run, naming the record; nothing
/// lands and the corrupt bytes are left as they are, for the operator.
#[test]
fn a_record_corrupted_in_the_bucket_is_refused_on_resume_naming_it() {
    let prefix = "corrupt/state";
    let sets = on_s3(prefix, "30");
    let job = TestJob::files("s3-corrupt", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let name = "chk-00000000000000000002-000000.json";
    let key = format!("{prefix}/epoch-000001/checkpoints/{name}");
    let store = bucket();
    let versioned = block(store.read_versioned(&key)).expect("the newest record is in the bucket");
    let mut bytes = versioned.bytes.to_vec();
    let body = bytes.iter().position(|&b| b == b'\n').expect("a header line") + 1;
    let at = body + bytes[body..].windows(10).position(|w| w == b"s3-corrupt").expect("the job id in the body");
    bytes[at] = b'S';
    block(store.replace_if(&key, Bytes::from(bytes.clone()), &versioned.etag)).expect("corrupt the record");
    let visible = ids(&read_visible(&job.out()));

    let mut args = vec!["check", "job.toml"];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let (code, out, err) = run_cli(&args, job.dir.path());
    let all = format!("{out}{err}");
    assert_ne!(code, 0, "check refuses:\n{all}");
    assert!(all.contains(&format!("{name} is corrupt (checksum mismatch)")), "check names the record:\n{all}");

    for _ in 0..2 {
        let err = job.run_with(&refs(&sets), None).expect_err("a corrupt record stops the run");
        let message = err.to_string();
        assert!(
            matches!(&err, EngineError::Checkpoint(CheckpointError::Corrupt { .. })),
            "a corrupt record, not another error: {message}"
        );
        for part in [
            format!("s3://{BUCKET}/{prefix}/"),
            format!("{name} is corrupt (checksum mismatch)"),
            "refusing to resume".to_string(),
        ] {
            assert!(message.contains(&part), "{part:?} in: {message}");
        }
        assert_eq!(ids(&read_visible(&job.out())), visible, "nothing landed");
    }
    // The record is kept byte for byte (a takeover copies it into its epoch).
    let kept: Vec<String> = keys(prefix).into_iter().filter(|k| k.ends_with(name)).collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let now = block(store.read(&format!("{prefix}/{}", kept[0]))).expect("the record");
    assert_eq!(now.as_ref(), bytes.as_slice(), "the corrupt record was neither repaired nor removed");
}

/// Halts work on S3 as on disk: a plugin that answers `already-committed`
/// for the first commit of its own checkpoint halts the state directory in
/// the bucket, and from then on `sluice check` and every run refuse it,
/// through the engine and through the real binary.
#[test]
fn a_halted_state_dir_on_s3_refuses_to_run() {
    let prefix = "halt/state";
    let sets = on_s3(prefix, "30");
    let mut job = TestJob::chaos("s3-halt", 1000, 2, 250, "already-committed", "commit");
    // Its persist-before-commit check reads a local state directory: there is none here.
    job.toml = job.toml.replace("state_dir = \"state\"\n", "");
    let err = job.run_with(&refs(&sets), None).expect_err("a reused key stops the run");
    assert!(matches!(err, EngineError::KeyReused { checkpoint: 1, .. }), "{err}");
    let halted: Vec<String> = keys(prefix).into_iter().filter(|k| k.ends_with("/halted")).collect();
    assert_eq!(halted, ["epoch-000001/halted"], "the halt is an object in the run's epoch");
    assert!(!job.dir.path().join(".sluice").exists(), "no local state directory");

    let err = job.run_with(&refs(&sets), None).expect_err("halted");
    assert!(matches!(err, EngineError::Halted { .. }), "{err}");
    assert!(err.to_string().contains(&format!("s3://{BUCKET}/{prefix} is halted and is not resumed")), "{err}");

    let (code, out, err) = run_cli(&[&["run", "job.toml"][..], &refs(&set_args(&sets))].concat(), job.dir.path());
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("is halted and is not resumed"), "{err}");
    let (code, out, err) = run_cli(&[&["check", "job.toml"][..], &refs(&set_args(&sets))].concat(), job.dir.path());
    assert_ne!(code, 0, "{out}{err}");
    assert!(format!("{out}{err}").contains("the state directory is halted"), "{out}{err}");
    let (code, out, err) = run_cli(&[&["state", "job.toml"][..], &refs(&set_args(&sets))].concat(), job.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("HALTED:"), "{out}");
    // Still halted, and in the bucket only.
    assert!(keys(prefix).iter().any(|k| k.ends_with("/halted")), "{:?}", keys(prefix));
}

/// `--set` arguments for `sets`.
fn set_args(sets: &[String]) -> Vec<String> {
    sets.iter().flat_map(|s| ["--set".to_string(), s.clone()]).collect()
}
