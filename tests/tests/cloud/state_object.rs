//! `job.state_dir` in a bucket: the checks that hold the same on every
//! object store, written once and run on each backend ([`Backend`]) by
//! [`backend_tests!`] in `state_s3` (moto) and `state_gcs`
//! (fake-gcs-server). A job lands every row once and resumes after a crash;
//! records are objects created once, never overwritten; one run at a time
//! holds the state directory by a lease object swapped on its version (S3's
//! ETag, GCS's generation): a second live run refuses, the run after a
//! SIGKILL takes the lease over once it expired, a holder whose
//! compare-and-swap fails stops, a lease renewed by a holder with a lagging
//! clock is not taken over, a frozen holder that wakes after a takeover
//! changes nothing (frozen at a random point by SIGSTOP, and at the points
//! right after its lease check, before a commit or a record, by its own
//! `SLUICE_TEST_PAUSE`), and a lease deleted after an interrupted takeover
//! does not adopt the partial copy.
//!
//! The host reaches the servers through the process's environment
//! (`sluice_tests::harness`), inherited by the `sluice run` processes a test
//! starts.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice::engine::checkpoint::CheckpointError;
use sluice::engine::{CrashPoint, EngineError, Fault};
use sluice_store::{GcsOptions, ObjectStore, StoreError};
use sluice_tests::harness::{block, buckets, gcs, moto};
use sluice_tests::{TestJob, assert_exactly_once, ids, read_visible, run_cli, sluice_run};

/// The bucket of the state directories, on each server.
pub(crate) const BUCKET: &str = buckets::STATE;

/// An object store the state directory can be on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Backend {
    /// moto's S3 server.
    S3,
    /// fake-gcs-server.
    Gcs,
}

impl Backend {
    /// The scheme of its locations.
    pub(crate) fn scheme(self) -> &'static str {
        match self {
            Backend::S3 => "s3",
            Backend::Gcs => "gs",
        }
    }

    /// Its short name in job ids and table prefixes: `s3`, `gcs`.
    pub(crate) fn short(self) -> &'static str {
        match self {
            Backend::S3 => "s3",
            Backend::Gcs => "gcs",
        }
    }

    /// Its name in messages.
    fn name(self) -> &'static str {
        match self {
            Backend::S3 => "S3",
            Backend::Gcs => "GCS",
        }
    }

    /// The id of a job of this backend's tests: `s3-<what>`, `gcs-<what>`.
    pub(crate) fn job(self, what: &str) -> String {
        format!("{}-{what}", self.short())
    }

    /// The bucket of the state directories, as the test sees it (not
    /// through the host).
    pub(crate) fn bucket(self) -> ObjectStore {
        self.store(BUCKET)
    }

    /// Bucket `bucket` of the server, as the test sees it.
    pub(crate) fn store(self, bucket: &str) -> ObjectStore {
        match self {
            Backend::S3 => ObjectStore::s3(bucket, &moto().s3_options()).expect("bucket"),
            Backend::Gcs => {
                let options = GcsOptions { endpoint: Some(gcs().endpoint.clone()), anonymous: true };
                ObjectStore::gcs(bucket, &options).expect("bucket")
            }
        }
    }

    /// Starts the server (once per process) and points the environment at
    /// it; returns its endpoint.
    pub(crate) fn start(self) -> String {
        match self {
            Backend::S3 => moto().endpoint.clone(),
            Backend::Gcs => gcs().endpoint.clone(),
        }
    }

    /// Keys under `prefix`, relative to it.
    pub(crate) fn keys(self, prefix: &str) -> Vec<String> {
        let listed = block(self.bucket().list(prefix)).expect("list");
        listed.into_iter().map(|o| o.key.strip_prefix(&format!("{prefix}/")).unwrap_or(&o.key).to_string()).collect()
    }

    /// `--set`s that put the job's state in the bucket under `prefix`, with
    /// `lease_secs` (the server started, the environment pointing at it).
    pub(crate) fn on(self, prefix: &str, lease_secs: &str) -> Vec<String> {
        self.start();
        vec![format!("job.state_dir={}://{BUCKET}/{prefix}", self.scheme()), format!("job.lease_secs={lease_secs}")]
    }
}

/// One `#[test]` per `test_name => body` pair, calling `state_object::body`
/// on `backend`.
macro_rules! backend_tests {
    ($backend:expr; $($name:ident => $body:ident,)*) => {$(
        #[test]
        fn $name() {
            crate::state_object::$body($backend);
        }
    )*};
}
pub(crate) use backend_tests;

pub(crate) fn refs(sets: &[String]) -> Vec<&str> {
    sets.iter().map(String::as_str).collect()
}

/// Slow enough to be caught mid-way: about 4 s for 40 000 rows.
fn slowed(mut job: TestJob) -> TestJob {
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job
}

/// The checkpoint directories the files sink committed in the job's output
/// (`<job>.<sink>.<incarnation>.c<10 digits>`): not the output's claim
/// file, nor the temporary file of a write under way. A run frozen while it
/// took the claim leaves `._sluice_claim.<job>.<sink>.json.tmp-<pid>-0`
/// there until it wakes and removes it; counted, it made a woken run that
/// committed nothing look as if it had changed the output.
pub(crate) fn committed_dirs(job: &TestJob) -> usize {
    let Ok(entries) = std::fs::read_dir(job.out()) else { return 0 };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()) && is_checkpoint_dir(&e.file_name().to_string_lossy()))
        .count()
}

/// `….c<10 digits>`: the name of a committed checkpoint's directory.
fn is_checkpoint_dir(name: &str) -> bool {
    name.rsplit_once('.')
        .is_some_and(|(_, c)| c.len() == 11 && c.starts_with('c') && c.bytes().skip(1).all(|b| b.is_ascii_digit()))
}

/// Spawns `command` (a `sluice run`; its stdout dropped, its stderr kept
/// for the panic) and waits until `reached` holds of it; panics, naming
/// `what` and the run's stderr, if it ended first or `within` passed.
pub(crate) fn spawn_until(
    mut command: Command,
    what: &str,
    within: Duration,
    reached: impl Fn(&Child) -> bool,
) -> Child {
    let mut child = command.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting sluice");
    let start = Instant::now();
    while !reached(&child) {
        if let Ok(Some(status)) = child.try_wait() {
            let out = child.wait_with_output().expect("reaping sluice");
            panic!("sluice ended ({status}) before {what}:\n{}", String::from_utf8_lossy(&out.stderr));
        }
        assert!(start.elapsed() < within, "not {what} within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// Starts `sluice run` with `sets` and waits until it committed `dirs`
/// checkpoints (so it holds the lease and renews it).
fn start_and_wait(job: &TestJob, sets: &[String], dirs: usize) -> Child {
    std::fs::write(job.path(), &job.toml).expect("job file");
    let what = format!("{dirs} checkpoints were committed");
    spawn_until(sluice_run(job, sets), &what, Duration::from_secs(120), |_| committed_dirs(job) >= dirs)
}

pub(crate) fn a_job_with_its_state_in_a_bucket_resumes_after_a_crash_and_lands_every_row_once(b: Backend) {
    let prefix = "crash/state";
    let sets = b.on(prefix, "30");
    let job = TestJob::files(&b.job("crash"), 3100, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let after_crash = b.keys(prefix);
    // The first run took epoch 1 and writes only in its folder.
    assert!(
        after_crash.contains(&"epoch-000001/checkpoints/chk-00000000000000000002-000000.json".to_string()),
        "{after_crash:?}"
    );
    for file in ["epoch-000001/incarnation", "epoch-000001/attempt", "lease"] {
        assert!(after_crash.contains(&file.to_string()), "{file} in {after_crash:?}");
    }

    // `sluice state` reads the state in the bucket while no run holds it.
    let mut args = vec!["state", "job.toml"];
    for s in &sets {
        args.extend(["--set", s.as_str()]);
    }
    let (code, out, err) = run_cli(&args, job.dir.path());
    assert_eq!(code, 0, "{err}");
    for part in
        [format!("{}://{BUCKET}/{prefix}", b.scheme()), "last record:  checkpoint 2".into(), "runs:         1".into()]
    {
        assert!(out.contains(&part), "{part:?} in:\n{out}");
    }

    let summary = job.run_with(&refs(&sets), None).expect("resumes");
    assert_eq!(summary.attempt, 2, "{summary:?}");
    assert_exactly_once(&read_visible(&job.out()), 3100);
    assert!(!job.dir.path().join(".sluice").exists() && !job.state().exists(), "state went to {} only", b.name());

    let at_end = b.keys(prefix);
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
        serde_json::from_slice(&block(b.bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_eq!(lease["expires_at_ms"], 0, "a run that ended released its lease: {lease}");
    assert_eq!((lease["epoch"].as_u64(), lease["current"].as_u64()), (Some(2), Some(2)), "{lease}");
}

pub(crate) fn a_second_live_run_refuses_while_the_first_holds_the_lease(b: Backend) {
    let prefix = "two-runs/state";
    let sets = b.on(prefix, "2");
    let job = slowed(TestJob::files(&b.job("two"), 40_000, 2, 1000));
    let mut first = start_and_wait(&job, &sets, 1);
    let err = job.run_with(&refs(&sets), None).expect_err("the second run refuses");
    assert!(matches!(&err, EngineError::Checkpoint(CheckpointError::Leased { .. })), "{err}");
    let message = err.to_string();
    for part in [
        format!("state directory {}://{BUCKET}/{prefix} is in use by another sluice run", b.scheme()),
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

pub(crate) fn after_a_sigkill_the_next_run_takes_the_lease_over_once_it_expired(b: Backend) {
    let prefix = "sigkill/state";
    let sets = b.on(prefix, "3");
    let job = slowed(TestJob::files(&b.job("kill"), 40_000, 2, 1000));
    let mut first = start_and_wait(&job, &sets, 2);
    first.kill().expect("SIGKILL");
    assert!(!first.wait().expect("reaped").success());
    let killed_at = Instant::now();
    let lease: serde_json::Value =
        serde_json::from_slice(&block(b.bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
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

pub(crate) fn a_holder_whose_compare_and_swap_fails_stops_before_its_next_write(b: Backend) {
    let prefix = "stolen/state";
    let sets = b.on(prefix, "2");
    let job = slowed(TestJob::files(&b.job("stolen"), 40_000, 2, 1000));
    let first = start_and_wait(&job, &sets, 1);
    // Another holder writes the lease (as a run taking it over would): the
    // holder's next compare-and-swap on its version (S3's ETag, GCS's
    // generation) fails.
    let key = format!("{prefix}/lease");
    let store = b.bucket();
    // The holder renews every third of its lease: a renewal between this
    // read and this write makes the write conflict. The thief, like a run
    // taking over, reads again and retries.
    let mut tries = 0;
    loop {
        let current = block(store.read_versioned(&key)).expect("lease");
        let expires =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() + 1500;
        let thief = serde_json::json!({"holder": "the thief", "lease_ms": 1500, "expires_at_ms": expires as u64});
        match block(store.replace_if(&key, Bytes::from(thief.to_string()), &current.etag)) {
            Ok(_) => break,
            Err(StoreError::Conflict { .. }) if tries < 20 => tries += 1,
            Err(e) => panic!("replace the lease (try {tries}): {e}"),
        }
    }
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
pub(crate) fn a_lease_renewed_by_a_holder_with_a_lagging_clock_is_not_taken_over(b: Backend) {
    let prefix = "skew/state";
    let sets = b.on(prefix, "2");
    let job = TestJob::files(&b.job("skew"), 600, 2, 300);
    let key = format!("{prefix}/lease");
    let store = b.bucket();
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
    let first = block(store.create_exclusive(&key, doc(skewed_now()))).expect("create the lease").expect("version");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let renewing = {
        let (stop, store, key) = (stop.clone(), store.clone(), key.clone());
        std::thread::spawn(move || {
            let mut version = first;
            let mut renewals = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(lease_ms / 3));
                match block(store.replace_if(&key, doc(skewed_now()), &version)) {
                    Ok(Some(e)) => {
                        version = e;
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
pub(crate) fn a_frozen_holder_that_wakes_after_a_takeover_changes_nothing(b: Backend) {
    let prefix = "frozen/state";
    let sets = b.on(prefix, "2");
    let job = slowed(TestJob::files(&b.job("frozen"), 40_000, 2, 1000));
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
        serde_json::from_slice(&block(b.bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_eq!((lease["epoch"].as_u64(), lease["current"].as_u64()), (Some(2), Some(2)), "{lease}");

    // The frozen run's write in flight lands late, in its own epoch's folder:
    // a record newer than any, which no run may read.
    let late = format!("{prefix}/epoch-000001/checkpoints/chk-{:020}-000000.json", 999);
    block(b.bucket().create_exclusive(&late, Bytes::from_static(b"{ not a record"))).expect("late write");

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

/// Whether `child` is stopped by a signal (state `T` in `/proc/<pid>/stat`).
fn stopped(child: &Child) -> bool {
    std::fs::read_to_string(format!("/proc/{}/stat", child.id()))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| rest.starts_with('T')))
        .unwrap_or(false)
}

/// Starts `sluice run` with `sets`, asked to freeze itself (SIGSTOP, every
/// thread, the lease's renewer too) at `pause` (`SLUICE_TEST_PAUSE`, a test
/// build's fault injection), and waits until it is stopped there.
fn start_and_freeze(job: &TestJob, sets: &[String], pause: &str) -> Child {
    std::fs::write(job.path(), &job.toml).expect("job file");
    let mut command = sluice_run(job, sets);
    command.env("SLUICE_TEST_PAUSE", pause);
    spawn_until(command, &format!("it froze at {pause}"), Duration::from_secs(120), stopped)
}

/// Fencing, deterministically: a holder frozen at `pause`, right after its
/// last check that it holds the lease (before the plugin's commit of a
/// checkpoint whose record the run that takes over copies, or before the
/// record of a checkpoint is written, so that it lands in the old epoch's
/// folder that no run reads), wakes after another run took the lease over
/// and finished the job. It changes nothing: what it commits then is the
/// very checkpoint the other run committed from the same record (found
/// committed), or nothing (its lease is lost before the commit); no row is
/// visible twice, nothing is halted, and a rerun has nothing to land.
fn a_holder_frozen_after_its_lease_check_changes_nothing(b: Backend, what: &str, pause: &str) {
    let prefix = format!("{what}/state");
    let sets = b.on(&prefix, "2");
    // 3 checkpoints of 2 × 1000 rows.
    let job = TestJob::files(&b.job(what), 6000, 2, 1000);
    let frozen = start_and_freeze(&job, &sets, pause);
    let frozen_at = Instant::now();

    let out = sluice_run(&job, &sets).output().expect("next run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("took over the state directory's lease after it expired"), "{stderr}");
    assert!(frozen_at.elapsed() >= Duration::from_secs(2), "it waited for the lease to expire");
    assert!(stderr.contains("published"), "the sink says what it publishes: {stderr}");
    assert_exactly_once(&read_visible(&job.out()), 6000);
    assert_eq!(committed_dirs(&job), 3, "the run that took over committed every checkpoint");
    let lease: serde_json::Value =
        serde_json::from_slice(&block(b.bucket().read(&format!("{prefix}/lease"))).expect("lease")).expect("json");
    assert_eq!((lease["epoch"].as_u64(), lease["current"].as_u64()), (Some(2), Some(2)), "{lease}");

    signal(&frozen, "-CONT");
    let out = frozen.wait_with_output().expect("frozen run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the woken run must stop: {stderr}");
    let (_, woken) = stderr.split_once("SLUICE_TEST_PAUSE: continued").unwrap_or_else(|| panic!("it woke: {stderr}"));
    assert!(woken.contains("no longer holds its lease"), "{woken}");
    assert!(!woken.contains("published"), "the woken run made nothing visible: {woken}");
    assert!(!woken.contains("halted"), "the woken run halts nothing: {woken}");
    assert_eq!(committed_dirs(&job), 3, "the woken run committed nothing");
    assert_exactly_once(&read_visible(&job.out()), 6000);

    let summary = job.run_with(&refs(&sets), None).expect("rerun");
    assert_eq!(summary.attempt, 3, "{summary:?}");
    assert_exactly_once(&read_visible(&job.out()), 6000);
    assert_eq!(committed_dirs(&job), 3, "the rerun had nothing to land");
}

/// Frozen before the commit of checkpoint 1, whose commit takes the
/// output's claim first: the run that took over takes the claim and commits
/// checkpoint 1 from the copied record.
pub(crate) fn a_holder_frozen_before_its_first_commit_changes_nothing(b: Backend) {
    a_holder_frozen_after_its_lease_check_changes_nothing(b, "frozen-commit-1", "before-commit:1");
}

/// Frozen before the commit of checkpoint 2 (its record persisted, the claim
/// taken): the run that took over commits checkpoint 2 from that record.
pub(crate) fn a_holder_frozen_before_a_commit_changes_nothing(b: Backend) {
    a_holder_frozen_after_its_lease_check_changes_nothing(b, "frozen-commit-2", "before-commit:2");
}

/// Frozen before the record of checkpoint 2 is written: the run that took
/// over resumes from checkpoint 1 and prepares its own checkpoint 2; the
/// woken run's record lands in its old epoch's folder, and its lease is lost
/// before it commits.
pub(crate) fn a_holder_frozen_before_its_record_lands_changes_nothing(b: Backend) {
    a_holder_frozen_after_its_lease_check_changes_nothing(b, "frozen-record-2", "before-record:2");
}

/// A run killed in the middle of its takeover copy leaves a partial folder
/// of a newer epoch (here only `attempt`, the first object in key order);
/// the lease still names the old folder as `current`. An operator then
/// deletes the lease object to get on without waiting for it to expire. The
/// next run must not take that partial folder for the state (it holds no
/// record and no incarnation: the job would start over and land every row
/// again): it resumes from the last folder a run completed.
pub(crate) fn a_lease_deleted_after_an_interrupted_takeover_does_not_adopt_the_partial_copy(b: Backend) {
    let prefix = "partial/state";
    let sets = b.on(prefix, "2");
    let job = TestJob::files(&b.job("partial"), 3100, 2, 500);
    let crash = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run_with(&refs(&sets), Some(crash)).expect_err("crash").is_injected_crash());
    let store = b.bucket();
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
