//! Real SIGKILLs of a `sluice run` process at a chosen moment of its run,
//! for the kill tests (`tests/tests/processes/`).
//!
//! Invariant: the kill is timed from a log line the run writes once it has
//! opened the state directory and settled its incarnation ([`STARTED`]),
//! not from the process's start, so a slow start on a busy machine does not
//! turn every kill into one during start-up.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::{TestJob, sluice_run};

/// What became of a run killed a while after it started writing.
pub struct Killed {
    /// Whether it was killed (otherwise it ended first, successfully).
    pub killed: bool,
    /// Everything it logged.
    pub stderr: String,
}

/// The log lines one of which every run writes once it has opened the
/// state directory and settled its incarnation, before it writes rows.
pub const STARTED: &[&str] = &["resuming from checkpoint record", "starting job from the beginning"];

/// Starts `sluice run` of `job` with `extra` arguments, and SIGKILLs it
/// `after` once it logged one of `markers`, unless it ended before; panics
/// when it failed, or did not log a marker within 2 minutes.
pub fn run_kill_after(job: &TestJob, extra: &[&str], markers: &[&str], after: Duration) -> Killed {
    let mut cmd = sluice_run(job, &[]);
    cmd.args(extra).env("RUST_LOG", "info").stdout(Stdio::null()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("starting sluice");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    let markers: Vec<String> = markers.iter().map(ToString::to_string).collect();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if markers.iter().any(|m| line.contains(m.as_str())) {
                let _ = tx.send(());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let started = Instant::now();
    let mut deadline = None;
    let mut killed = false;
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        if deadline.is_none() && rx.try_recv().is_ok() {
            deadline = Some(Instant::now() + after);
        }
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("sluice did not start writing within 2 minutes");
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            child.kill().expect("SIGKILL");
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let status = child.wait().expect("reaping sluice");
    let stderr = reader.join().expect("stderr reader");
    assert!(killed || status.success(), "sluice failed:\n{stderr}");
    Killed { killed, stderr }
}
