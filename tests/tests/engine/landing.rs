//! The engine's landing (`sluice::engine::landing`, which
//! `sluice.ray.Datasink` drives): parts written by writers elsewhere,
//! committed as a job's one checkpoint, through the files sink.
//! - a crash between persist and commit leaves nothing visible and the
//!   commit pending; the next landing finishes it once and is refused;
//! - a state directory lands one dataset: a later landing is refused and
//!   changes nothing;
//! - a landing whose first commit of its own checkpoint finds the key taken
//!   (a state directory started with another's incarnation) fails and halts
//!   its state directory.

use std::sync::Arc;

use sluice::config::EngineConfig;
use sluice::engine::landing::{Landing, Part};
use sluice::engine::{CrashPoint, EngineError, Fault, Faults, RunOptions};
use sluice::plugin::{SinkCtx, SourceTable, WriterInstance};
use sluice::progress::ProgressMode;
use sluice::source::generator::Generator;
use sluice_tests::{TestJob, assert_exactly_once, host, read_visible};

fn schema() -> Vec<u8> {
    sluice::ipc::encode_schema(&Generator::schema_ref()).expect("schema")
}

/// One write task: a writer of the landing's context writes generator rows
/// `first..first + rows` and prepares checkpoint 1.
fn write_part(job: &EngineConfig, landing: &Landing, subtask: u32, first: u64, rows: u64) -> Part {
    let plugin = host().load(&job.spec.sink.plugin).expect("plugin");
    let (grants, limits) = sluice::engine::grants_and_limits(job).expect("grants");
    // The files sink stages a checkpoint's parts under one attempt.
    let ctx = SinkCtx { subtask, ..landing.writer_ctx() };
    let options = plugin.options_for(job.sink_options(), &ctx);
    let tables = [SourceTable { name: String::new(), schema: schema() }];
    let inst = plugin.instantiate("writer", &grants, limits).expect("instance");
    let mut writer = WriterInstance::open(inst, &ctx, &options, &tables, None).expect("writer opens");
    let batch = sluice::ipc::encode_batch(&Generator::batch_for(first, first + rows)).expect("batch");
    writer.write("", &batch).expect("write");
    let info = writer.prepare_commit(1).expect("prepare");
    writer.close().expect("close");
    Part { info, rows }
}

fn quiet() -> RunOptions {
    RunOptions::new(ProgressMode::Quiet, false)
}

fn land(job: &Arc<EngineConfig>, opts: &RunOptions) -> Result<(), EngineError> {
    let mut landing = Landing::open(job.clone(), host(), opts)?;
    landing.open_committer(&schema())?;
    let parts = [write_part(job, &landing, 0, 0, 3_000), write_part(job, &landing, 1, 3_000, 2_000)];
    let summary = landing.land(&parts, &schema())?;
    assert_eq!(summary.rows, 5_000);
    Ok(())
}

#[test]
fn a_crash_between_persist_and_commit_is_finished_once_by_the_next_landing() {
    let job = TestJob::files("landing-crash", 1, 1, 1_000);
    let loaded = Arc::new(job.load(&[]).expect("job file"));
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    let crash = RunOptions { faults: Faults { crash: Some(fault), ..Faults::default() }, ..quiet() };
    let e = land(&loaded, &crash).expect_err("the landing crashes after persist");
    assert!(e.is_injected_crash(), "{e}");
    assert_eq!(read_visible(&job.out()).num_rows(), 0, "rows visible before the commit");

    match Landing::open(loaded.clone(), host(), &quiet()) {
        Err(EngineError::AlreadyLanded { finished: 1, checkpoint: 1, .. }) => {}
        Err(e) => panic!("the next landing did not finish the pending commit: {e}"),
        Ok(_) => panic!("the next landing was not refused"),
    }
    assert_exactly_once(&read_visible(&job.out()), 5_000);

    // Landed: refused again, nothing finished, nothing changes.
    match Landing::open(loaded.clone(), host(), &quiet()) {
        Err(e @ EngineError::AlreadyLanded { finished: 0, .. }) => {
            assert!(e.to_string().contains("already landed a dataset"), "{e}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a landed state directory landed again"),
    }
    assert_exactly_once(&read_visible(&job.out()), 5_000);
}

#[test]
fn a_landing_that_finds_its_key_taken_halts_its_state_directory() {
    let job = TestJob::files("landing-reuse", 1, 1, 1_000);
    let loaded = Arc::new(job.load(&[]).expect("job file"));
    land(&loaded, &quiet()).expect("the first landing");
    assert_exactly_once(&read_visible(&job.out()), 5_000);

    // A new state directory given the first one's incarnation (copied by
    // hand): its checkpoint 1 has the first one's key.
    let again = job.dir.path().join("state-copy");
    std::fs::create_dir_all(&again).expect("state dir");
    std::fs::copy(job.state().join("incarnation"), again.join("incarnation")).expect("copy incarnation");
    let set = format!("job.state_dir={}", again.display());
    let copied = Arc::new(job.load(&[set.as_str()]).expect("job file"));
    match land(&copied, &quiet()) {
        Err(EngineError::KeyReused { checkpoint: 1, .. }) => {}
        Err(e) => panic!("expected the key-reuse halt: {e}"),
        Ok(()) => panic!("a landing under a taken key succeeded"),
    }
    assert_exactly_once(&read_visible(&job.out()), 5_000);
    match Landing::open(copied, host(), &quiet()) {
        Err(EngineError::Halted { .. }) => {}
        Err(e) => panic!("expected the halted state directory to be refused: {e}"),
        Ok(_) => panic!("a halted state directory was opened"),
    }
}

/// The landing's own commit may be crashed right after its first side
/// effect (`Committer::commit` arms `DuringCommit` for `Commit::Own`, which
/// the landing did not before issue #22): the next landing commits the
/// recovered checkpoint (`Commit::Recovered`, so an `already-committed`
/// answer is not taken for a reused key), once, and is refused.
#[test]
fn a_crash_during_the_landings_commit_is_finished_once_by_the_next_landing() {
    let job = TestJob::files("landing-during-commit", 1, 1, 1_000);
    let loaded = Arc::new(job.load(&[]).expect("job file"));
    let fault = Fault { point: CrashPoint::DuringCommit, checkpoint: 1, subtask: 0 };
    let crash = RunOptions { faults: Faults { crash: Some(fault), ..Faults::default() }, ..quiet() };
    let e = land(&loaded, &crash).expect_err("the landing crashes during its commit");
    assert!(matches!(e, EngineError::InjectedCrash(_)), "{e}");
    assert!(e.to_string().contains("during-commit of checkpoint 1"), "{e}");
    // The claim is the commit's first side effect: nothing is published yet.
    assert_eq!(read_visible(&job.out()).num_rows(), 0, "rows visible before the commit finished");

    match Landing::open(loaded.clone(), host(), &quiet()) {
        Err(EngineError::AlreadyLanded { finished: 1, checkpoint: 1, .. }) => {}
        Err(e) => panic!("the next landing did not finish the interrupted commit: {e}"),
        Ok(_) => panic!("the next landing was not refused"),
    }
    assert_exactly_once(&read_visible(&job.out()), 5_000);
}

/// A chaos job: every `commit` answers `already-committed` and fails unless
/// the record of its checkpoint is already in the state directory.
fn chaos_job(id: &str) -> (TestJob, Arc<EngineConfig>) {
    let job = TestJob::chaos(id, 1, 1, 1_000, "already-committed", "commit");
    let loaded = Arc::new(job.load(&[]).expect("job file"));
    (job, loaded)
}

/// A landing's own first commit that answers `already-committed` halts the
/// state directory; the same answer to a recovered commit (an earlier
/// landing's, crashed after persisting) is the idempotent re-commit, and the
/// landing is refused as already landed, not halted. The chaos committer
/// also proves the record was durable before each commit.
#[test]
fn already_committed_is_key_reuse_for_the_landings_own_commit_only() {
    let (_job, own) = chaos_job("landing-chaos-own");
    match land(&own, &quiet()) {
        Err(EngineError::KeyReused { checkpoint: 1, .. }) => {}
        Err(e) => panic!("expected the key-reuse halt: {e}"),
        Ok(()) => panic!("an already-committed first commit counted as delivered"),
    }
    assert!(matches!(Landing::open(own, host(), &quiet()), Err(EngineError::Halted { .. })));

    let (_job, recovered) = chaos_job("landing-chaos-recovered");
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    let crash = RunOptions { faults: Faults { crash: Some(fault), ..Faults::default() }, ..quiet() };
    assert!(land(&recovered, &crash).expect_err("crash after persist").is_injected_crash());
    match Landing::open(recovered.clone(), host(), &quiet()) {
        Err(EngineError::AlreadyLanded { finished: 1, checkpoint: 1, .. }) => {}
        Err(e) => panic!("a recovered commit answering already-committed was not finished: {e}"),
        Ok(_) => panic!("the next landing was not refused"),
    }
    match Landing::open(recovered, host(), &quiet()) {
        Err(EngineError::AlreadyLanded { finished: 0, .. }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a landed state directory landed again"),
    }
}

/// An Iceberg landing whose catalog misbehaves, driven through the
/// landing's retries (`Committer::commit`, job.commit).
fn iceberg_landing(id: &str, warehouse: &std::path::Path, sets: &[&str]) -> (TestJob, Arc<EngineConfig>) {
    let job = TestJob::iceberg(id, warehouse, "db.landed", 1, 0, 1, 1_000);
    let loaded = Arc::new(job.load(sets).expect("job file"));
    (job, loaded)
}

fn with_catalog_faults(faults: Vec<(u64, sluice::fault::CommitFault)>) -> RunOptions {
    let catalog = sluice::fault::CatalogFaults { faults, ..Default::default() };
    RunOptions { faults: Faults { catalog, ..Faults::default() }, ..quiet() }
}

/// A lost reply to the landing's first commit is retried; the retry finds
/// the snapshot and answers `already-committed`, which on a second attempt
/// is the landing's own commit arriving, not a reused key.
#[test]
fn a_lost_commit_reply_is_retried_and_not_taken_for_key_reuse() {
    use sluice::fault::CommitFault;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let (_job, loaded) = iceberg_landing("landing-lost-reply", warehouse.path(), &["job.commit.initial_backoff_ms=1"]);
    let opts = with_catalog_faults(vec![(1, CommitFault::LoseReply)]);
    let mut landing = Landing::open(loaded.clone(), host(), &opts).expect("opens");
    landing.open_committer(&schema()).expect("committer");
    let parts = [write_part(&loaded, &landing, 0, 0, 3_000), write_part(&loaded, &landing, 1, 3_000, 2_000)];
    let summary = landing.land(&parts, &schema()).expect("the landing retries the lost reply");
    assert_eq!(summary.outcome, Some(sluice::bindings::CommitOutcome::AlreadyCommitted), "{summary:?}");
    drop(landing);
    let table = sluice_tests::read_iceberg(warehouse.path(), "db.landed");
    sluice_tests::assert_exactly_once_range(&table.rows, 0, 5_000);
    table.assert_no_checkpoint_twice();
}

/// Every attempt conflicts: the landing stops with `CommitExhausted`, its
/// checkpoint pending; the next landing commits it once and is refused.
#[test]
fn exhausted_commit_attempts_leave_the_landing_pending_for_the_next_one() {
    use sluice::fault::CommitFault;
    let warehouse = tempfile::tempdir().expect("warehouse");
    let sets = ["job.commit.max_attempts=3", "job.commit.initial_backoff_ms=1"];
    let (_job, loaded) = iceberg_landing("landing-exhausted", warehouse.path(), &sets);
    let opts = with_catalog_faults((1..=20).map(|n| (n, CommitFault::Conflict)).collect());
    match land(&loaded, &opts) {
        Err(e @ EngineError::CommitExhausted { checkpoint: 1, attempts: 3, .. }) => {
            assert!(e.to_string().contains("stays pending"), "{e}");
        }
        Err(e) => panic!("expected the exhausted commit: {e}"),
        Ok(()) => panic!("a commit that always conflicts landed"),
    }
    assert!(sluice_tests::read_iceberg(warehouse.path(), "db.landed").commits.is_empty(), "nothing may be committed");
    match Landing::open(loaded.clone(), host(), &quiet()) {
        Err(EngineError::AlreadyLanded { finished: 1, checkpoint: 1, .. }) => {}
        Err(e) => panic!("the next landing did not finish the pending commit: {e}"),
        Ok(_) => panic!("the next landing was not refused"),
    }
    let table = sluice_tests::read_iceberg(warehouse.path(), "db.landed");
    sluice_tests::assert_exactly_once_range(&table.rows, 0, 5_000);
    table.assert_no_checkpoint_twice();
}

/// The log lines written while a test runs `f` on this thread.
fn logged<R>(f: impl FnOnce() -> R) -> (R, String) {
    use tracing_subscriber::util::SubscriberInitExt;
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("log buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
    let result = {
        let _guard = subscriber.set_default();
        f()
    };
    let text = String::from_utf8_lossy(&captured.0.lock().expect("log buffer")).into_owned();
    (result, text)
}

/// A crash a landing never reaches (a subtask's point, one after its
/// commit, or another checkpoint than 1) is said to be ignored: since
/// `Faults::from_env` takes every point for the Ray suite's landing, a test
/// asking for one would otherwise see a landing that silently never crashes
/// (before issue #22 anything but `after-persist` was warned about).
#[test]
fn a_crash_a_landing_never_reaches_is_warned_about() {
    for (n, (point, checkpoint)) in
        [(CrashPoint::AfterCommit, 1), (CrashPoint::AfterWrite, 1), (CrashPoint::AfterPersist, 2)]
            .into_iter()
            .enumerate()
    {
        let job = TestJob::files(&format!("landing-unreached-{n}"), 1, 1, 1_000);
        let loaded = Arc::new(job.load(&[]).expect("job file"));
        let fault = Fault { point, checkpoint, subtask: 0 };
        let opts = RunOptions { faults: Faults { crash: Some(fault), ..Faults::default() }, ..quiet() };
        let (landed, log) = logged(|| land(&loaded, &opts));
        landed.unwrap_or_else(|e| panic!("{point} of checkpoint {checkpoint}: {e}"));
        assert!(
            log.contains("a landing never reaches") && log.contains(&point.to_string()),
            "{point} of checkpoint {checkpoint} was ignored silently: {log}"
        );
        assert_exactly_once(&read_visible(&job.out()), 5_000);
    }
    // The points a landing does reach are not warned about.
    let job = TestJob::files("landing-reached", 1, 1, 1_000);
    let loaded = Arc::new(job.load(&[]).expect("job file"));
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 1, subtask: 0 };
    let opts = RunOptions { faults: Faults { crash: Some(fault), ..Faults::default() }, ..quiet() };
    let (landed, log) = logged(|| land(&loaded, &opts));
    assert!(landed.expect_err("crashes").is_injected_crash());
    assert!(!log.contains("never reaches"), "{log}");
}
