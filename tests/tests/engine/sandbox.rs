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

/// A write through a symbolic link in the grant that leads out of it is
/// `denied` (it was refused as `already-exists`, which hid the escape).
#[test]
fn write_through_a_symlink_out_of_the_grant_is_denied() {
    let outside = tempfile::tempdir().expect("temp dir");
    let job = TestJob::chaos("sandbox-symlink", 1000, 1, 250, "escape", "write");
    std::fs::create_dir_all(job.dir.path().join("journal")).expect("journal dir");
    let link = job.dir.path().join("journal/link.pwned");
    std::os::unix::fs::symlink(outside.path().join("stolen"), &link).expect("symlink");
    let err = job.run_with(&["sink.options.target=journal/link"], None).expect_err("escape fails").to_string();
    assert!(err.contains("all escapes refused"), "{err}");
    assert!(err.contains("file-io write: access denied") && err.contains("symbolic link leading outside"), "{err}");
    assert!(!outside.path().join("stolen").exists());
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

// ---------------------------------------------------------------------------
// What a plugin makes the host spend: one test per limit of `[sink.sandbox]`.
// Each runs the real `sluice` binary as a child process, so that it can
// measure the host's peak memory (VmHWM) and wall time from outside, and
// asserts the error names the limit, the peak stays under the documented
// bound, and the run ends in time.
// ---------------------------------------------------------------------------

mod host_limits {
    use std::io::Read;
    use std::net::TcpListener;
    use std::process::Stdio;
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    use sluice_tests::{TestJob, sluice_run};

    /// Parallelism of every probe job.
    const PARALLELISM: u64 = 2;
    /// `[sink.sandbox]` of the probes (the chaos job's own `memory_mb = 64`).
    const MEMORY_MB: u64 = 64;
    const HOST_MEMORY_MB: u64 = 64;
    /// The documented bound (README, sandbox section): the host's peak RSS
    /// stays under what it needs to run a job at all plus, per instance,
    /// `memory_mb + host_memory_mb`.
    fn bound_kib() -> u64 {
        baseline_kib() + PARALLELISM * (MEMORY_MB + HOST_MEMORY_MB) * 1024
    }
    /// A probe must end within this (its calls have a 2 s deadline).
    const IN_TIME: Duration = Duration::from_secs(45);

    /// What one child `sluice run` did.
    struct ChildRun {
        ok: bool,
        stderr: String,
        elapsed: Duration,
        peak_kib: u64,
    }

    fn vm_hwm_kib(pid: u32) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// Runs the job in a child `sluice`, sampling its peak memory until it
    /// ends (killed, and the test failed, if it outlasts twice [`IN_TIME`]).
    fn run_child(job: &TestJob, sets: &[String]) -> ChildRun {
        std::fs::write(job.path(), &job.toml).expect("writing job file");
        // Builds the binary, if need be, before the clock starts.
        let mut cmd = sluice_run(job, sets);
        let start = Instant::now();
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting sluice");
        let pid = child.id();
        let mut pipe = child.stderr.take().expect("stderr");
        let reader = std::thread::spawn(move || {
            let mut text = Vec::new();
            let _ = pipe.read_to_end(&mut text);
            String::from_utf8_lossy(&text).into_owned()
        });
        let mut peak_kib = 0;
        let status = loop {
            if let Some(kib) = vm_hwm_kib(pid) {
                peak_kib = peak_kib.max(kib);
            }
            if let Some(status) = child.try_wait().expect("waiting for sluice") {
                break status;
            }
            if start.elapsed() > 2 * IN_TIME {
                let _ = child.kill();
                let _ = child.wait();
                panic!("sluice still ran after {:?}", start.elapsed());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let elapsed = start.elapsed();
        let stderr = reader.join().expect("stderr reader");
        ChildRun { ok: status.success(), stderr, elapsed, peak_kib }
    }

    /// The peak memory of the same job with a well-behaved plugin.
    fn baseline_kib() -> u64 {
        static BASELINE: OnceLock<u64> = OnceLock::new();
        *BASELINE.get_or_init(|| {
            let job = probe("baseline", "none", None);
            let run = run_child(&job, &[]);
            assert!(run.ok, "the baseline job fails: {}", run.stderr);
            run.peak_kib
        })
    }

    /// Accepts connections and never answers (kept open until the test ends).
    fn hanging_server() -> u16 {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("address").port();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            for conn in listener.incoming().flatten() {
                held.push(conn);
            }
        });
        port
    }

    /// A chaos job misbehaving as `misbehave` in `write`, with small host
    /// limits and, when `port` is given, gRPC and HTTP endpoints `hang`.
    fn probe(name: &str, misbehave: &str, port: Option<u16>) -> TestJob {
        let mut job = TestJob::chaos(&format!("limit-{name}"), 1000, PARALLELISM as u32, 250, misbehave, "write");
        // The chaos job's last table is [sink.sandbox].
        job.toml.push_str(&format!(
            "host_memory_mb = {HOST_MEMORY_MB}\nlog_bytes_per_call = 262144\nlog_bytes_per_sec = 524288\n\
             max_open_files = 16\nmax_grpc_streams = 8\nmax_http_requests = 4\n"
        ));
        if let Some(port) = port {
            job.toml.push_str(&format!(
                "[sink.grpc.hang]\naddress = \"http://127.0.0.1:{port}\"\n[sink.http.hang]\naddress = \"http://127.0.0.1:{port}\"\n"
            ));
        }
        job
    }

    /// Runs a probe that must fail; checks time and memory, returns stderr.
    fn fails_within_bounds(job: &TestJob) -> String {
        let run = run_child(job, &[]);
        assert!(!run.ok, "the probe succeeded: {}", run.stderr);
        within_bounds(&run);
        run.stderr
    }

    fn within_bounds(run: &ChildRun) {
        eprintln!("run took {:?}, peak {} MiB (bound {} MiB)", run.elapsed, run.peak_kib / 1024, bound_kib() / 1024);
        assert!(run.elapsed < IN_TIME, "the run took {:?}: {}", run.elapsed, run.stderr);
        let bound = bound_kib();
        assert!(
            run.peak_kib < bound,
            "the host's peak memory {} MiB is above the bound {} MiB",
            run.peak_kib / 1024,
            bound / 1024
        );
    }

    /// A WASI sleep inside `write` is stopped at the call deadline, which
    /// names the import; the job resumes afterwards.
    #[test]
    fn wasi_sleep_ends_at_the_call_deadline() {
        let job = probe("sleep", "sleep", None);
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains(".write did not return within its call deadline of 2.0s"), "{stderr}");
        assert!(stderr.contains("blocked in the host import `wasi:io/poll."), "{stderr}");
        // Resumable as after any plugin failure.
        let again = run_child(&job, &["sink.options.misbehave=none".to_string()]);
        assert!(again.ok, "the resumed job fails: {}", again.stderr);
    }

    #[test]
    fn grpc_call_ends_at_the_call_deadline() {
        let job = probe("grpc-hang", "grpc-hang", Some(hanging_server()));
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains(".write did not return within its call deadline of 2.0s"), "{stderr}");
        assert!(stderr.contains("blocked in the host import `sluice:connector/grpc.unary`"), "{stderr}");
    }

    #[test]
    fn http_request_ends_at_the_call_deadline() {
        let job = probe("http-hang", "http-hang", Some(hanging_server()));
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains(".write did not return within its call deadline of 2.0s"), "{stderr}");
        assert!(stderr.contains("blocked in the host import `wasi:io/poll."), "{stderr}");
    }

    #[test]
    fn http_requests_in_flight_are_capped() {
        let job = probe("http-requests", "http-requests", Some(hanging_server()));
        let stderr = fails_within_bounds(&job);
        assert!(
            stderr
                .contains("too many HTTP requests in flight at once: the limit is sink.sandbox.max_http_requests = 4"),
            "{stderr}"
        );
    }

    #[test]
    fn grpc_streams_are_capped() {
        let job = probe("grpc-streams", "grpc-streams", Some(hanging_server()));
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains("stream 9 refused"), "{stderr}");
        assert!(
            stderr.contains("too many gRPC calls in flight at once: the limit is sink.sandbox.max_grpc_streams = 8"),
            "{stderr}"
        );
    }

    #[test]
    fn open_output_files_are_capped() {
        let job = probe("open-files", "open-files", None);
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains("output file 17 refused"), "{stderr}");
        assert!(
            stderr.contains("too many output files open at once: the limit is sink.sandbox.max_open_files = 16"),
            "{stderr}"
        );
    }

    /// 64 MiB of log lines per writer: all but the call's allowance are
    /// dropped, with one notice saying how many.
    #[test]
    fn log_lines_beyond_the_budget_are_dropped_with_one_notice() {
        let job = probe("log-flood", "log-flood", None);
        let run = run_child(&job, &[]);
        assert!(run.ok, "{}", run.stderr);
        within_bounds(&run);
        let notices: Vec<&str> = run.stderr.lines().filter(|l| l.contains("log line(s)")).collect();
        assert!(!notices.is_empty(), "no notice: {}", &run.stderr[..run.stderr.len().min(2000)]);
        // A call's first flood meets the per-call cap; one soon after meets
        // the per-second cap first.
        assert!(
            notices.iter().any(|n| n.contains("beyond sink.sandbox.log_bytes_per_call = 262144 bytes")),
            "{notices:?}"
        );
        for notice in &notices {
            assert!(
                notice.contains("beyond sink.sandbox.log_bytes_per_call = 262144 bytes")
                    || notice.contains("beyond sink.sandbox.log_bytes_per_sec = 524288 bytes"),
                "{notice}"
            );
            let dropped: u64 = notice
                .split("dropped ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no count in {notice}"));
            assert!(dropped > 60_000, "{notice}");
        }
        // The floods were a first write per writer of 64 MiB each; what
        // reached the log is the allowance, not the flood.
        assert!(run.stderr.len() < 4 << 20, "{} bytes of log", run.stderr.len());
    }

    /// 21,000 distinct zstd levels per call: clamped, and the contexts kept
    /// bounded (one per level took the host to 2.4 GB).
    #[test]
    fn codec_levels_are_clamped_and_contexts_bounded() {
        let job = probe("codec-levels", "codec-levels", None);
        // 21,000 compressions take longer than the probes' 2 s deadline.
        // One write per writer (200 rows in batches of 100) is the probe.
        let sets = ["sink.sandbox.call_timeout_secs=30".to_string(), "source.rows=200".to_string()];
        let run = run_child(&job, &sets);
        assert!(run.ok, "{}", run.stderr);
        within_bounds(&run);
    }

    /// A decompression asked with no useful limit is refused before any
    /// work, naming the budget.
    #[test]
    fn decompress_above_the_host_memory_budget_is_refused() {
        let job = probe("decompress-bomb", "decompress-bomb", None);
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains("chaos: decompress refused"), "{stderr}");
        assert!(
            stderr.contains("above the instance's host-memory budget of 64 MiB (sink.sandbox.host_memory_mb)"),
            "{stderr}"
        );
    }

    #[test]
    fn exit_is_reported_with_its_status() {
        let job = probe("exit", "exit", None);
        let stderr = fails_within_bounds(&job);
        assert!(stderr.contains("plugin 'chaos' exited with status 0 during writer["), "{stderr}");
        assert!(stderr.contains("].write"), "{stderr}");
        assert!(!stderr.contains("trapped: error while executing"), "{stderr}");
    }
}
