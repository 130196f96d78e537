//! Contract versions side by side: plugins built for `sluice:connector@0.1.0`
//! and `@0.2.0` (the committed fixtures, `tests/fixtures/sluice_sink_files_0.1.wasm`
//! and `_0.2.wasm`, the latter encoding Parquet in wasm) run unchanged on a
//! host whose newest contract is 0.2.4, pass the crash matrix, and hand
//! their state over to today's build (which encodes through `columnar`);
//! components of no served version are refused with the versions the host
//! serves.

use std::path::{Path, PathBuf};

use sluice::engine::{CrashPoint, Fault};
use sluice::plugin::PluginError;
use sluice_tests::{TestJob, assert_exactly_once, host, read_visible, run_cli};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 3;
const EVERY: u64 = 500;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.1.wasm")
}

fn fixture_str() -> String {
    fixture().to_str().expect("utf-8 path").to_string()
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let job = TestJob::files_with(&fixture_str(), &format!("v01-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
    sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
}

sluice_tests::crash_tests! {
    v01_after_write: CrashPoint::AfterWrite, 3;
    v01_after_prepare_commit_first: CrashPoint::AfterPrepareCommit, 1;
    v01_after_prepare_commit: CrashPoint::AfterPrepareCommit, 3;
    v01_after_snapshot_state: CrashPoint::AfterSnapshotState, 3;
    v01_after_persist_first: CrashPoint::AfterPersist, 1;
    v01_after_persist: CrashPoint::AfterPersist, 3;
    v01_after_persist_last: CrashPoint::AfterPersist, 4;
    v01_during_commit: CrashPoint::DuringCommit, 3;
    v01_during_commit_last: CrashPoint::DuringCommit, 4;
    v01_after_commit: CrashPoint::AfterCommit, 3;
    v01_after_commit_last: CrashPoint::AfterCommit, 4;
}

#[test]
fn the_fixture_is_a_0_1_plugin() {
    let plugin = host().load(&fixture()).expect("the 0.1 fixture loads");
    assert_eq!(plugin.version().to_string(), "0.1.0");
    let dir = tempfile::tempdir().expect("temp dir");
    let (code, out, err) = run_cli(&["plugin", "inspect", &fixture_str()], dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("contract:    sluice:connector@0.1.0"), "{out}");
    assert!(out.contains("world:       sluice:connector/sink-plugin@0.1.0"), "{out}");
    assert!(out.contains("plugin:      files"), "{out}");
}

/// The operator's upgrade: a job that ran on the 0.1 build, crashed with a
/// checkpoint pending, is resumed with the plugin rebuilt for 0.2. The new
/// build commits the old build's pending checkpoint and goes on.
#[test]
fn a_0_1_state_resumes_on_the_0_2_build() {
    let job = TestJob::files_with(&fixture_str(), "upgrade", ROWS, PARALLELISM, EVERY);
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 3, subtask: 1 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    let upgraded = format!("sink.plugin={}", sluice_tests::FILES_PLUGIN);
    let summary = job.run_with(&[&upgraded], None).expect("the 0.2 build resumes the 0.1 state");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
    assert_eq!(summary.recovered.len(), 1, "{summary}");
}

fn write_component(dir: &Path, name: &str, wat: &str) -> PathBuf {
    let bytes = wat::parse_str(wat).expect("valid WAT");
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("writing the component");
    path
}

#[test]
fn a_component_of_no_served_version_names_the_served_ones() {
    let dir = tempfile::tempdir().expect("temp dir");
    let future = write_component(
        dir.path(),
        "future.wasm",
        r#"(component
            (instance $sink)
            (export "sluice:connector/sink@0.3.0" (instance $sink)))"#,
    );
    let Err(err) = host().load(&future) else { panic!("0.3 is not served") };
    assert!(matches!(err, PluginError::Incompatible { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("0.2.4, 0.2.3, 0.2.2, 0.2.1, 0.2.0, 0.1.0"), "{message}");
    assert!(message.contains("sluice:connector/sink@0.3.0"), "{message}");

    let module = write_component(dir.path(), "module.wasm", "(module)");
    let Err(err) = host().load(&module) else { panic!("a core module is no component") };
    assert!(matches!(err, PluginError::Invalid { .. }), "{err:?}");
}

/// A 0.1 plugin cannot take named tables: the job stops before anything is
/// written, naming the contract and what to do.
#[test]
fn a_0_1_plugin_is_refused_for_many_tables_before_anything_is_written() {
    let job = TestJob::files_with(&fixture_str(), "v01-tables", 600, 1, 100);
    let err = job.run_with(&["source.tables=[\"a\", \"b\"]"], None).expect_err("refused").to_string();
    assert!(
        err.contains("implements contract 0.1.0, which cannot take several tables; rebuild it for contract 0.2.4"),
        "{err}"
    );
    assert!(!job.out().exists(), "nothing was written");
}

/// An upgrade: a job of the fixture `plugin` crashes after persisting
/// checkpoint 3, and today's files sink commits that pending checkpoint and
/// finishes the job, every row once.
fn resumes_on_todays_build(plugin: &str, id: &str) {
    let job = TestJob::files_with(plugin, id, ROWS, PARALLELISM, EVERY);
    let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 3, subtask: 1 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    let upgraded = format!("sink.plugin={}", sluice_tests::FILES_PLUGIN);
    let summary = job.run_with(&[&upgraded], None).expect("today's build resumes the fixture's state");
    assert_exactly_once(&read_visible(&job.out()), ROWS);
    assert_eq!(summary.recovered.len(), 1, "{summary}");
}

/// The files sink as built for 0.2.0, before `columnar` (0.2.1) existed.
mod v0_2_0 {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.2.wasm")
    }

    fn fixture_str() -> String {
        fixture().to_str().expect("utf-8 path").to_string()
    }

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let job = TestJob::files_with(&fixture_str(), &format!("v020-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
        sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
    }

    sluice_tests::crash_tests! {
        v020_after_write: CrashPoint::AfterWrite, 3;
        v020_after_prepare_commit: CrashPoint::AfterPrepareCommit, 3;
        v020_after_persist: CrashPoint::AfterPersist, 3;
        v020_during_commit: CrashPoint::DuringCommit, 3;
        v020_after_commit_last: CrashPoint::AfterCommit, 4;
    }

    #[test]
    fn the_fixture_is_a_0_2_0_plugin_without_columnar() {
        let plugin = host().load(&fixture()).expect("the 0.2.0 fixture loads on the 0.2.4 host");
        assert_eq!(plugin.contract(), "0.2.0");
        assert!(!plugin.imports().iter().any(|i| i.contains("columnar")), "{:?}", plugin.imports());
        assert!(!plugin.maintains(), "a 0.2.0 plugin has no `maintenance` export");
        let today = host().load(Path::new(sluice_tests::FILES_PLUGIN)).expect("today's build");
        assert_eq!(today.contract(), "0.2.4");
        assert!(today.imports().iter().any(|i| i == "sluice:connector/columnar@0.2.4"), "{:?}", today.imports());
        assert!(today.maintains(), "plugins of the author kit export `maintenance`");
        let dir = tempfile::tempdir().expect("temp dir");
        let (code, out, err) = run_cli(&["plugin", "inspect", &fixture_str()], dir.path());
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("contract:    sluice:connector@0.2.0"), "{out}");
    }

    /// The upgrade from 0.2.0 to 0.2.1: a pending checkpoint of the 0.2.0
    /// build (Parquet encoded in wasm) is committed by today's build, which
    /// goes on encoding through the host.
    #[test]
    fn a_0_2_0_state_resumes_on_todays_build() {
        let job = TestJob::files_with(&fixture_str(), "upgrade-020", ROWS, PARALLELISM, EVERY);
        let fault = Fault { point: CrashPoint::AfterPersist, checkpoint: 3, subtask: 1 };
        assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
        let upgraded = format!("sink.plugin={}", sluice_tests::FILES_PLUGIN);
        let summary = job.run_with(&[&upgraded], None).expect("today's build resumes the 0.2.0 state");
        assert_exactly_once(&read_visible(&job.out()), ROWS);
        assert_eq!(summary.recovered.len(), 1, "{summary}");
    }
}

/// The files sink as built for 0.2.1, before the optional `maintenance`
/// export (0.2.2) existed.
mod v0_2_1 {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.2.1.wasm")
    }

    fn fixture_str() -> String {
        fixture().to_str().expect("utf-8 path").to_string()
    }

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let job = TestJob::files_with(&fixture_str(), &format!("v021-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
        sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
    }

    sluice_tests::crash_tests! {
        v021_after_prepare_commit: CrashPoint::AfterPrepareCommit, 3;
        v021_after_persist: CrashPoint::AfterPersist, 3;
        v021_during_commit: CrashPoint::DuringCommit, 3;
    }

    #[test]
    fn the_fixture_is_a_0_2_1_plugin_without_maintenance() {
        let plugin = host().load(&fixture()).expect("the 0.2.1 fixture loads on the 0.2.4 host");
        assert_eq!(plugin.contract(), "0.2.1");
        assert!(plugin.imports().iter().any(|i| i == "sluice:connector/columnar@0.2.1"), "{:?}", plugin.imports());
        assert!(!plugin.maintains(), "a 0.2.1 plugin has no `maintenance` export");
    }

    /// `sluice maintain` and `[sink.maintenance]` refuse it by name, and the
    /// job with `[sink.maintenance]` writes nothing.
    #[test]
    fn maintenance_is_refused_naming_the_contract() {
        let job = TestJob::files_with(&fixture_str(), "v021-maintain", 100, 1, 50);
        std::fs::write(job.path(), &job.toml).expect("job file");
        let path = job.path().display().to_string();
        let (code, _, err) = run_cli(&["maintain", &path], job.dir.path());
        assert_ne!(code, 0);
        assert!(err.contains("implements contract 0.2.1, which cannot maintain tables"), "{err}");
        let job = TestJob { toml: job.toml + "[sink.maintenance]\ncompact_every = \"1m\"\n", dir: job.dir };
        let e = job.run(None).expect_err("refused");
        assert!(e.to_string().contains("which cannot maintain tables"), "{e}");
        assert!(!job.state().exists(), "the refused job wrote its state directory");
        assert!(!job.out().exists(), "the refused job wrote output");
    }
}

/// The files sink as built for 0.2.2, before the optional `committer-state`
/// export (0.2.3) existed.
mod v0_2_2 {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.2.2.wasm")
    }

    fn fixture_str() -> String {
        fixture().to_str().expect("utf-8 path").to_string()
    }

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let job = TestJob::files_with(&fixture_str(), &format!("v022-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
        sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
    }

    sluice_tests::crash_tests! {
        v022_after_prepare_commit: CrashPoint::AfterPrepareCommit, 3;
        v022_after_persist: CrashPoint::AfterPersist, 3;
        v022_during_commit: CrashPoint::DuringCommit, 3;
        v022_after_commit_last: CrashPoint::AfterCommit, 4;
    }

    #[test]
    fn the_fixture_is_a_0_2_2_plugin_that_maintains_without_committer_state() {
        let plugin = host().load(&fixture()).expect("the 0.2.2 fixture loads on the 0.2.4 host");
        assert_eq!(plugin.contract(), "0.2.2");
        assert!(plugin.maintains(), "a 0.2.2 plugin of the author kit exports `maintenance`");
        assert!(!plugin.keeps_committer_state(), "a 0.2.2 plugin has no `committer-state` export");
        assert!(!plugin.exports().iter().any(|e| e.contains("committer-state")), "{:?}", plugin.exports());
        let today = host().load(Path::new(sluice_tests::FILES_PLUGIN)).expect("today's build");
        assert_eq!(today.contract(), "0.2.4");
        assert!(today.keeps_committer_state(), "plugins of the author kit export `committer-state`");
        // A 0.2.2 plugin's records carry no committer state.
        let job = TestJob::files_with(&fixture_str(), "v022-records", 600, 1, 200);
        job.run(None).expect("runs");
        let records = job.state().join("checkpoints");
        for entry in std::fs::read_dir(&records).expect("records") {
            let text = std::fs::read_to_string(entry.expect("entry").path()).expect("record");
            assert!(!text.contains("committer_state"), "{text}");
        }
    }

    /// The upgrade from 0.2.2 to 0.2.3: a pending checkpoint of the 0.2.2
    /// build (whose record has no committer state) is committed by today's
    /// build, which starts its committer with none.
    #[test]
    fn a_0_2_2_state_resumes_on_todays_build() {
        resumes_on_todays_build(&fixture_str(), "upgrade-022");
    }
}

/// The files sink as built for 0.2.3, before `columnar`'s `project-input`
/// and `write-input` (0.2.4) existed: it hands every batch back to the host
/// as IPC, which the host still takes.
mod v0_2_3 {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.2.3.wasm")
    }

    fn fixture_str() -> String {
        fixture().to_str().expect("utf-8 path").to_string()
    }

    fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
        let job = TestJob::files_with(&fixture_str(), &format!("v023-{point}-{checkpoint}"), ROWS, PARALLELISM, EVERY);
        sluice_tests::crash_and_recover(&job, ROWS, point, checkpoint);
    }

    sluice_tests::crash_tests! {
        v023_after_persist: CrashPoint::AfterPersist, 3;
        v023_during_commit: CrashPoint::DuringCommit, 3;
    }

    #[test]
    fn the_fixture_is_a_0_2_3_plugin_on_the_0_2_4_host() {
        let plugin = host().load(&fixture()).expect("the 0.2.3 fixture loads on the 0.2.4 host");
        assert_eq!(plugin.contract(), "0.2.3");
        assert!(plugin.imports().iter().any(|i| i == "sluice:connector/columnar@0.2.3"), "{:?}", plugin.imports());
        assert!(plugin.keeps_committer_state(), "a 0.2.3 plugin of the author kit exports `committer-state`");
    }

    /// The upgrade from 0.2.3 to 0.2.4: a pending checkpoint of the 0.2.3
    /// build is committed by today's build.
    #[test]
    fn a_0_2_3_state_resumes_on_todays_build() {
        resumes_on_todays_build(&fixture_str(), "upgrade-023");
    }
}
