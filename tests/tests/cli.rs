//! The `sluice` binary: inspect, check, run, the compiled-plugin cache, and
//! clear errors for bad job files.

use sluice_tests::{FILES_PLUGIN, TestJob, assert_exactly_once, read_visible, run_cli, run_example};

#[test]
fn plugin_inspect_shows_world_options_and_imports() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = run_cli(&["plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("contract:    sluice:connector@0.2.2"), "{out}");
    assert!(out.contains("world:       sluice:connector/sink-plugin@0.2.2"), "{out}");
    assert!(out.contains("plugin:      files 0.1.0"), "{out}");
    assert!(out.contains("path") && out.contains("required"), "{out}");
    assert!(out.contains("sluice:connector/file-io@0.2.2"), "{out}");
    assert!(out.contains("sluice:connector/sink@0.2.2"), "{out}");
}

#[test]
fn second_start_skips_compilation() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cache = dir.path().join("cache");
    let cache = cache.to_str().expect("utf-8 path");
    let (code, _, first) = run_cli(&["--cache-dir", cache, "plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{first}");
    assert!(first.contains("compiled plugin"), "{first}");
    let (code, _, second) = run_cli(&["--cache-dir", cache, "plugin", "inspect", FILES_PLUGIN], dir.path());
    assert_eq!(code, 0, "{second}");
    assert!(second.contains("loaded precompiled plugin from the cache (compilation skipped)"), "{second}");
    assert!(!second.contains("INFO compiled plugin"), "{second}");
}

#[test]
fn check_accepts_a_good_job() {
    let job = TestJob::files("check-ok", 100, 2, 50);
    job.load(&[]).expect("valid");
    let (code, out, err) = run_cli(&["check", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("ok: plugin files 0.1.0"), "{out}");
    assert!(out.contains("the plugin accepts the options and the source schema"), "{out}");
    assert!(out.contains("job check-ok is ready to run"), "{out}");
    assert!(!job.out().exists() || std::fs::read_dir(job.out()).expect("dir").next().is_none(), "check moved data");
}

/// Each broken job file gives exit code 1 and one clear line naming the key.
#[test]
fn bad_job_files_name_the_offending_key() {
    let job = TestJob::files("bad", 100, 2, 50);
    job.load(&[]).expect("valid to start with");
    let cases: &[(&[&str], &str)] = &[
        (&["--set", "sink.options.pth=x"], "key `sink.options.pth`: plugin 'files' has no such option"),
        (&["--set", "job.parallelism=0"], "key `job.parallelism`: must be between 1 and 1024"),
        (&["--set", "job.parallelism=\"two\""], "key `job.parallelism`"),
        (&["--set", "sink.plugin=nope.wasm"], "key `sink.plugin`: no plugin file at"),
        (&["--set", "source.kind=pulsar"], "pulsar"),
        (&["--set", "sink.options.compression=lz5"], "option `compression` = \"lz5\" is not supported"),
        (&["--set", "job.checkpont.every_rows=5"], "checkpont"),
    ];
    for (sets, expected) in cases {
        let mut args = vec!["check", "job.toml"];
        args.extend_from_slice(sets);
        let (code, out, err) = run_cli(&args, job.dir.path());
        let all = format!("{out}{err}");
        assert_eq!(code, 1, "{sets:?}: {all}");
        assert!(all.contains(expected), "{sets:?}: expected {expected:?} in:\n{all}");
        assert!(!all.contains("panicked"), "{all}");
    }
    std::fs::write(job.dir.path().join("broken.toml"), "[job\nid = 1\n").expect("write");
    let (code, _, err) = run_cli(&["run", "broken.toml"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("broken.toml is not valid TOML") && err.contains("line 1"), "{err}");
    let (code, _, err) = run_cli(&["run", "missing.toml"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("cannot read job file missing.toml"), "{err}");
}

/// `examples/files.toml`, as the README runs it, redirected into a temp dir.
#[test]
fn example_job_runs_to_an_exact_result() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("files");
    let sets = [
        format!("sink.plugin={FILES_PLUGIN}"),
        format!("job.state_dir={}", dir.path().join("state").display()),
        format!("sink.options.path={}", out.display()),
        format!("sink.grants.locations=[\"{}\"]", dir.path().display()),
    ];
    let (code, stdout, err) = run_example("files.toml", &sets, dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("job files-demo finished: 200000 rows"), "{stdout}");
    assert!(err.contains("checkpoint committed"), "plain progress logs each commit:\n{err}");
    assert_exactly_once(&read_visible(&out), 200_000);
}

/// `sluice state` shows the incarnation, what is committed and what each
/// pending checkpoint will commit; `--drop-pending` drops one on request and
/// says so, and only then does the next run skip it.
#[test]
fn state_shows_pending_checkpoints_and_drops_one_on_request() {
    use sluice::engine::{CrashPoint, Fault};
    let job = TestJob::files("state-cli", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());

    let (code, out, err) = run_cli(&["state", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "{err}");
    for part in [
        "job:          state-cli (sink out)",
        "incarnation:  ",
        "last record:  checkpoint 2",
        "committed:    up to checkpoint 1",
        "pending:      1 checkpoint(s)",
        "checkpoint 2: 1000 rows; commits:",
        // The plugin's own description of what the commit makes visible.
        "2 file(s), 1000 rows -> out/files/state-cli.out.",
    ] {
        assert!(out.contains(part), "{part:?} in:\n{out}");
    }

    let (code, _, err) = run_cli(&["state", "job.toml", "--drop-pending", "9"], job.dir.path());
    assert_eq!(code, 1);
    assert!(err.contains("checkpoint 9 is not pending (pending: 2)"), "{err}");

    let (code, out, err) = run_cli(&["state", "job.toml", "--drop-pending", "2"], job.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("dropped pending checkpoint 2 of job state-cli (1000 rows)"), "{out}");
    assert!(out.contains("pending:      none") && out.contains("dropped:      checkpoint 2 (1000 rows)"), "{out}");

    let summary = job.run(None).expect("the job goes on");
    assert!(summary.recovered.is_empty(), "the dropped checkpoint is not committed: {summary:?}");
    let visible = sluice_tests::ids(&read_visible(&job.out()));
    let expected: Vec<i64> = (0..3000).filter(|id| !(500..1000).contains(&(id % 1500))).collect();
    assert_eq!(visible, expected, "every row but the dropped checkpoint's, once");
}
