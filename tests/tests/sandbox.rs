//! A plugin that traps, panics, loops, hoards memory or reaches for files it
//! was not granted ends the job with an error naming the plugin, the call and
//! the cause. The host survives and keeps running other jobs.

use std::time::{Duration, Instant};

use sluice::engine::EngineError;
use sluice::plugin::PluginError;
use sluice::plugin::sandbox::TrapCause;
use sluice_tests::{TestJob, assert_exactly_once, read_visible};

fn run_failing(misbehave: &str, at: &str) -> EngineError {
    let job = TestJob::chaos(&format!("sandbox-{misbehave}-{at}"), 1000, 2, 250, misbehave, at);
    job.run(None).expect_err("the misbehaving plugin fails the job")
}

fn failure(misbehave: &str, at: &str) -> String {
    run_failing(misbehave, at).to_string()
}

/// The trap's cause, as the host classified it.
fn trap_cause(err: &EngineError) -> &TrapCause {
    match err {
        EngineError::Plugin(PluginError::Trap { cause, .. }) => cause,
        other => panic!("expected a trap, got: {other}"),
    }
}

#[test]
fn trap_names_plugin_and_call() {
    let msg = failure("trap", "write");
    assert!(msg.contains("plugin 'chaos' writer[") && msg.contains("].write trapped"), "{msg}");
}

#[test]
fn panic_is_quoted() {
    let err = run_failing("panic", "prepare-commit");
    assert!(matches!(trap_cause(&err), TrapCause::Panic(_)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(".prepare-commit panicked"), "{msg}");
    assert!(msg.contains("chaos: deliberate panic in prepare-commit"), "{msg}");
}

#[test]
fn endless_loop_hits_the_deadline() {
    let start = Instant::now();
    let err = run_failing("loop", "write");
    assert_eq!(trap_cause(&err), &TrapCause::Deadline(Duration::from_secs(2)), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(".write did not return within its call deadline of 2.0s"), "{msg}");
    assert!(start.elapsed() < Duration::from_secs(60), "the deadline took {:?}", start.elapsed());
}

#[test]
fn memory_bomb_hits_the_cap() {
    let err = run_failing("memory-bomb", "write");
    assert_eq!(trap_cause(&err), &TrapCause::Memory(64), "{err}");
    assert!(err.to_string().contains("more than its memory limit of 64 MiB"), "{err}");
}

#[test]
fn trap_in_commit_names_the_committer() {
    let msg = failure("trap", "commit");
    assert!(msg.contains("plugin 'chaos' committer.commit trapped"), "{msg}");
}

#[test]
fn files_outside_the_grants_are_unreachable() {
    let outside = tempfile::tempdir().expect("temp dir");
    let secret = outside.path().join("secret.txt");
    std::fs::write(&secret, "top secret").expect("write secret");
    let job = TestJob::chaos("sandbox-escape", 1000, 1, 250, "escape", "write");
    let target = format!("target={}", secret.display());
    let err = job.run_with(&[&format!("sink.options.{target}")], None).expect_err("escape fails").to_string();
    assert!(err.contains("all escapes refused"), "{err}");
    assert!(err.contains("file-io read: access denied") && err.contains("is outside the granted locations"), "{err}");
    assert!(err.contains("file-io write: access denied"), "{err}");
    assert!(!outside.path().join("secret.txt.pwned").exists());
    assert!(!outside.path().join("secret.txt.pwned-wasi").exists());
    // A relative escape through `..` is refused the same way.
    let err =
        job.run_with(&["sink.options.target=journal/../../../../etc/passwd"], None).expect_err("fails").to_string();
    assert!(err.contains("all escapes refused"), "{err}");
}

/// After trapped, looping and exploding plugins, the same engine still runs
/// a job to an exact result.
#[test]
fn host_survives_misbehaving_plugins() {
    for (m, at) in [("trap", "open"), ("loop", "prepare-commit"), ("memory-bomb", "commit")] {
        let msg = failure(m, at);
        assert!(msg.contains("plugin 'chaos'"), "{msg}");
    }
    let job = TestJob::files("after-chaos", 3000, 2, 700);
    job.run(None).expect("a good job still runs");
    assert_exactly_once(&read_visible(&job.out()), 3000);
}
