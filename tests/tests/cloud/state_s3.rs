//! `job.state_dir` on S3 (moto's server on 127.0.0.1): a job lands every
//! row once and resumes after a crash; records are objects created once,
//! never overwritten; one run at a time holds the state directory by a
//! lease object: a second live run refuses, the run after a SIGKILL takes
//! the lease over once it expired, and a holder whose compare-and-swap fails
//! stops. The host reaches moto through the standard AWS environment
//! (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`), set once for this process and inherited by the
//! `sluice run` processes it starts.

use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice::engine::checkpoint::CheckpointError;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice_store::ObjectStore;
use sluice_tests::harness::{block, buckets, moto};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_visible, run_cli, sluice_run};

const BUCKET: &str = buckets::STATE;

/// The bucket, as the test sees it (not through the host).
fn bucket() -> ObjectStore {
    ObjectStore::s3(BUCKET, &moto().s3_options()).expect("bucket")
}

/// Keys under `prefix`, relative to it.
fn keys(prefix: &str) -> Vec<String> {
    let listed = block(bucket().list(prefix)).expect("list");
    listed.into_iter().map(|o| o.key.strip_prefix(&format!("{prefix}/")).unwrap_or(&o.key).to_string()).collect()
}

/// `--set`s that put the job's state on S3 under `prefix`, with `lease_secs`.
fn on_s3(prefix: &str, lease_secs: &str) -> Vec<String> {
    moto();
    vec![format!("job.state_dir=s3://{BUCKET}/{prefix}"), format!("job.lease_secs={lease_secs}")]
}

fn refs(sets: &[String]) -> Vec<&str> {
    sets.iter().map(String::as_str).collect()
}

/// Slow enough to be caught mid-way: about 4 s for 40 000 rows.
fn slowed(mut job: TestJob) -> TestJob {
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job
}

fn committed_dirs(job: &TestJob) -> usize {
    std::fs::read_dir(job.out()).map(|d| d.count()).unwrap_or(0)
}

/// Starts `sluice run` with `sets` and waits until it committed `dirs`
/// checkpoints (so it holds the lease and renews it).
fn start_and_wait(job: &TestJob, sets: &[String], dirs: usize) -> Child {
    std::fs::write(job.path(), &job.toml).expect("job file");
    let mut child = sluice_run(job, sets).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("sluice");
    let start = Instant::now();
    while committed_dirs(job) < dirs {
        if let Ok(Some(status)) = child.try_wait() {
            let out = child.wait_with_output().expect("reaping sluice");
            panic!("sluice ended ({status}) too early:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        assert!(start.elapsed() < Duration::from_secs(120), "no progress within 2 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_job_with_its_state_on_s3_resumes_after_a_crash_and_lands_every_row_once() {
    let prefix = "crash/state";
    let sets = on_s3(prefix, "30");
    let job = TestJob::files("s3-crash", 3100, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let after_crash = keys(prefix);
    // The first run took epoch 1 and writes only in its folder.
    assert!(
        after_crash.contains(&"epoch-000001/checkpoints/chk-00000000000000000002-000000.json".to_string()),
        "{after_crash:?}"
    );
    for file in ["epoch-000001/incarnation", "epoch-000001/attempt", "lease"] {
        assert!(after_crash.contains(&file.to_string()), "{file} in {after_crash:?}");
    }

    // `sluice state` reads the state on S3 while no run holds it.
    let mut args = vec!["state", "job.toml"];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 0, "{err}");
    for part in [format!("s3://{BUCKET}/{prefix}"), "last record:  checkpoint 2".into(), "runs:         1".into()] {
        assert!(out.contains(&part), "{part:?} in:\n{out}");
    }

    let summary = job.run_with(&refs(&sets), None).expect("resumes");
    assert_eq!(summary.attempt, 2, "{summary:?}");
    assert_exactly_once(&read_visible(&job.out()), 3100);
    assert!(!job.dir.path().join(".sluice").exists() && !job.state().exists(), "state went to S3 only");

    let at_end = keys(prefix);
    // The resumed run took epoch 2, copied the state in, and left no other folder.
    assert!(at_end.iter().all(|k| k == "lease" || k.starts_with("epoch-000002/")), "{at_end:?}");
    // The finished run re-persisted its last checkpoint with nothing pending:
    // as a new object beside the one it supersedes (removed after), never over it.
    let records: Vec<&String> = at_end.iter().filter(|k| k.starts_with("epoch-000002/checkpoints/")).collect();
    assert!(
        records.iter().any(|k| k.ends_with("-000001.json")),
        "the settled record took the next sequence number: {records:?}"
    );
    assert!(records.len() <= 3, "retention keeps 3 checkpoints: {records:?}");
    let lease: serde_json::Value =
        serde_json::from_slice(&block(bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_eq!(lease["expires_at_ms"], 0, "a run that ended released its lease: {lease}");
    assert_eq!((lease["epoch"].as_u64(), lease["current"].as_u64()), (Some(2), Some(2)), "{lease}");
}

#[test]
fn a_second_live_run_refuses_while_the_first_holds_the_lease() {
    let prefix = "two-runs/state";
    let sets = on_s3(prefix, "2");
    let job = slowed(TestJob::files("s3-two", 40_000, 2, 1000));
    let mut first = start_and_wait(&job, &sets, 1);
    let err = job.run_with(&refs(&sets), None).expect_err("the second run refuses");
    assert!(matches!(&err, EngineError::Checkpoint(CheckpointError::Leased { .. })), "{err}");
    let message = err.to_string();
    for part in [
        format!("state directory s3://{BUCKET}/{prefix} is in use by another sluice run"),
        format!("pid {} on", first.id()),
        "holds its lease".into(),
    ] {
        assert!(message.contains(&part), "{part:?} in: {message}");
    }
    assert!(first.try_wait().expect("status").is_none(), "the first run goes on undisturbed");
    let out = first.wait_with_output().expect("first run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_exactly_once(&read_visible(&job.out()), 40_000);
}

#[test]
fn after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired() {
    let prefix = "sigkill/state";
    let sets = on_s3(prefix, "3");
    let job = slowed(TestJob::files("s3-kill", 40_000, 2, 1000));
    let mut first = start_and_wait(&job, &sets, 2);
    first.kill().expect("SIGKILL");
    assert!(!first.wait().expect("reaped").success());
    let killed_at = Instant::now();
    let lease: serde_json::Value =
        serde_json::from_slice(&block(bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_ne!(lease["expires_at_ms"], 0, "a killed run cannot release its lease: {lease}");

    let out = sluice_run(&job, &sets).output().expect("next run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("took over the state directory's lease after it expired"), "{stderr}");
    assert!(stderr.contains("waited_ms="), "it logs how long it waited: {stderr}");
    assert!(stderr.contains(&format!("pid {} on", first.id())), "it names the run it took over from: {stderr}");
    assert!(killed_at.elapsed() >= Duration::from_secs(2), "it waited for the lease to expire");
    assert_exactly_once(&read_visible(&job.out()), 40_000);
}

#[test]
fn a_holder_whose_compare_and_swap_fails_stops_before_its_next_write() {
    let prefix = "stolen/state";
    let sets = on_s3(prefix, "2");
    let job = slowed(TestJob::files("s3-stolen", 40_000, 2, 1000));
    let first = start_and_wait(&job, &sets, 1);
    // Another holder writes the lease (as a run taking it over would): the
    // holder's next compare-and-swap on its ETag fails.
    let key = format!("{prefix}/lease");
    let store = bucket();
    let current = block(store.read_versioned(&key)).expect("lease");
    let expires = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() + 1500;
    let thief = serde_json::json!({"holder": "the thief", "lease_ms": 1500, "expires_at_ms": expires as u64});
    block(store.replace_if(&key, Bytes::from(thief.to_string()), &current.etag)).expect("replace the lease");
    let stolen_at = committed_dirs(&job);

    let out = first.wait_with_output().expect("first run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the holder must stop: {stderr}");
    for part in ["no longer holds its lease", "compare-and-swap", "the thief holds it now"] {
        assert!(stderr.contains(part), "{part:?} in:\n{stderr}");
    }
    assert!(committed_dirs(&job) <= stolen_at + 1, "it committed at most the checkpoint under way");
    assert!(ids(&read_visible(&job.out())).len() < 40_000, "it stopped before the end of the job");

    // The thief never renews: the next run takes over once it expired and finishes the job.
    let out = sluice_run(&job, &sets).output().expect("next run");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_exactly_once(&read_visible(&job.out()), 40_000);
}

/// A live holder whose wall clock lags this machine's by more than its lease
/// (clocks of two hosts are not in step): its lease object says
/// `expires_at_ms` in this machine's past, yet it renews it by
/// compare-and-swap every third of its length. The run that comes second
/// must judge the lease by watching it change (its own monotonic clock),
/// not by comparing another host's wall-clock stamp to its own: it refuses.
#[test]
fn a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over() {
    let prefix = "skew/state";
    let sets = on_s3(prefix, "2");
    let job = TestJob::files("s3-skew", 600, 2, 300);
    let key = format!("{prefix}/lease");
    let store = bucket();
    let lease_ms: u64 = 2000;
    // The holder's clock runs 5 s behind this machine's.
    let skewed_now = || {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis();
        now as u64 - 5000
    };
    let doc = move |at: u64| {
        Bytes::from(
            serde_json::json!({"holder": "the lagging holder", "lease_ms": lease_ms, "expires_at_ms": at + lease_ms})
                .to_string(),
        )
    };
    let first = block(store.create_exclusive(&key, doc(skewed_now()))).expect("create the lease").expect("etag");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let renewing = {
        let (stop, store, key) = (stop.clone(), store.clone(), key.clone());
        std::thread::spawn(move || {
            let mut etag = first;
            let mut renewals = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(lease_ms / 3));
                match block(store.replace_if(&key, doc(skewed_now()), &etag)) {
                    Ok(Some(e)) => {
                        etag = e;
                        renewals += 1;
                    }
                    // The lease was taken from under the holder.
                    _ => return Err(renewals),
                }
            }
            Ok(renewals)
        })
    };
    let result = job.run_with(&refs(&sets), None);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let renewed = renewing.join().expect("renewer");
    let err = result.expect_err("the second run refuses a lease its holder renews");
    assert!(matches!(&err, EngineError::Checkpoint(CheckpointError::Leased { .. })), "{err}");
    assert!(err.to_string().contains("the lagging holder"), "{err}");
    assert!(matches!(renewed, Ok(n) if n >= 1), "the holder kept its lease: {renewed:?}");
    assert_eq!(committed_dirs(&job), 0, "nothing landed while another run held the state directory");
}

fn signal(child: &Child, sig: &str) {
    let status = std::process::Command::new("kill").args([sig, &child.id().to_string()]).status().expect("kill");
    assert!(status.success(), "kill {sig}");
}

/// Fencing. A holder frozen (SIGSTOP) past its lease comes back after
/// another run took the lease over and finished the job. Whatever the frozen
/// run then does must change nothing: it stops before another commit, and
/// what it writes in its own epoch's folder (here also a record it could
/// have had in flight, written by the test as it would) is never read
/// again: the next run resumes from the state of the run that took over.
#[test]
fn a_frozen_holder_that_wakes_after_a_takeover_changes_nothing() {
    let prefix = "frozen/state";
    let sets = on_s3(prefix, "2");
    let job = slowed(TestJob::files("s3-frozen", 40_000, 2, 1000));
    let frozen = start_and_wait(&job, &sets, 1);
    signal(&frozen, "-STOP");
    let frozen_at = Instant::now();

    // The next run waits out the lease, takes it over and finishes the job.
    let out = sluice_run(&job, &sets).output().expect("next run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("took over the state directory's lease after it expired"), "{stderr}");
    assert!(frozen_at.elapsed() >= Duration::from_secs(2), "it waited for the lease to expire");
    assert_exactly_once(&read_visible(&job.out()), 40_000);
    let landed = committed_dirs(&job);
    let lease: serde_json::Value =
        serde_json::from_slice(&block(bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_eq!((lease["epoch"].as_u64(), lease["current"].as_u64()), (Some(2), Some(2)), "{lease}");

    // The frozen run's write in flight lands late, in its own epoch's folder:
    // a record newer than any, which no run may read.
    let late = format!("{prefix}/epoch-000001/checkpoints/chk-{:020}-000000.json", 999);
    block(bucket().create_exclusive(&late, Bytes::from_static(b"{ not a record"))).expect("late write");

    // The frozen run wakes: its next renewal finds the lease taken, and it
    // stops without committing anything more.
    signal(&frozen, "-CONT");
    let out = frozen.wait_with_output().expect("frozen run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the woken run must stop: {stderr}");
    assert!(stderr.contains("no longer holds its lease"), "{stderr}");
    assert_eq!(committed_dirs(&job), landed, "the woken run committed nothing");
    assert_exactly_once(&read_visible(&job.out()), 40_000);

    // A rerun resumes from the state of the run that took over: the late
    // record is never read (it would not even parse), and nothing lands twice.
    let summary = job.run_with(&refs(&sets), None).expect("rerun");
    assert_eq!(summary.attempt, 3, "{summary:?}");
    assert_exactly_once(&read_visible(&job.out()), 40_000);
    assert_eq!(committed_dirs(&job), landed, "the rerun had nothing to land");
}

/// A run killed in the middle of its takeover copy leaves a partial folder
/// of a newer epoch (here only `attempt`, the first object in key order);
/// the lease still names the old folder as `current`. An operator then
/// deletes the lease object to get on without waiting for it to expire. The
/// next run must not take that partial folder for the state (it holds no
/// record and no incarnation: the job would start over and land every row
/// again): it resumes from the last folder a run completed.
#[test]
fn a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy() {
    let prefix = "partial/state";
    let sets = on_s3(prefix, "2");
    let job = TestJob::files("s3-partial", 3100, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let store = bucket();
    let landed = committed_dirs(&job);
    assert!(landed >= 2, "the first run committed checkpoints");

    // A run took epoch 2 over epoch 1 and was killed after copying `attempt`.
    let key = format!("{prefix}/lease");
    let lease = block(store.read_versioned(&key)).expect("lease");
    let mut doc: serde_json::Value = serde_json::from_slice(&lease.bytes).expect("json");
    assert_eq!((doc["epoch"].as_u64(), doc["current"].as_u64()), (Some(1), Some(1)), "{doc}");
    doc["epoch"] = 2.into();
    doc["holder"] = "the run killed mid-copy".into();
    block(store.replace_if(&key, Bytes::from(doc.to_string()), &lease.etag)).expect("the killed run's lease");
    let attempt = block(store.read(&format!("{prefix}/epoch-000001/attempt"))).expect("attempt");
    block(store.create_exclusive(&format!("{prefix}/epoch-000002/attempt"), attempt)).expect("partial copy");

    // The operator removes the lease by hand.
    block(store.delete(&key)).expect("delete the lease");

    let summary = job.run_with(&refs(&sets), None).expect("resumes");
    assert_exactly_once(&read_visible(&job.out()), 3100);
    assert_eq!(summary.attempt, 2, "it resumed the first run's state: {summary:?}");
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
