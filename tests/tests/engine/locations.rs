//! Locations the host cannot serve are refused by the real `sluice` binary,
//! by `check` and by `run`, before anything is written: no state directory,
//! no local folder named after the URL's scheme.

use std::path::Path;

use sluice_tests::{ICEBERG_PLUGIN, run_cli};

/// Every entry under `dir`, at any depth, relative to it.
fn tree(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            out.push(path.strip_prefix(dir).unwrap_or(&path).display().to_string());
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Runs `sluice <command> examples/iceberg.toml` with `sets`, as the issue
/// does from the repository root, but on a copy of the example in a scratch
/// directory (so that a run that is not refused writes there, not into the
/// checkout); asserts exit code 1, that the output holds every one of
/// `expected`, and that nothing was written: no state directory, no SQLite
/// file, no folder named after the URL's scheme.
fn assert_refused(command: &str, sets: &[&str], expected: &[&str]) {
    let root = tempfile::tempdir().expect("temp dir");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/iceberg.toml");
    std::fs::create_dir(root.path().join("examples")).expect("mkdir");
    std::fs::copy(&example, root.path().join("examples/iceberg.toml")).expect("copy the example");
    let plugin = format!("sink.plugin={ICEBERG_PLUGIN}");
    let mut args = vec![command, "examples/iceberg.toml", "--set", plugin.as_str()];
    for s in sets {
        args.extend(["--set", s]);
    }
    let (code, out, err) = run_cli(&args, root.path());
    let all = format!("{out}{err}");
    assert_eq!(code, 1, "{args:?} must fail:\n{all}");
    for part in expected {
        assert!(all.contains(part), "{part:?} in:\n{all}");
    }
    assert!(!all.contains("panicked"), "{all}");
    assert_eq!(tree(root.path()), ["examples", "examples/iceberg.toml"], "{command} {sets:?} wrote something");
}

#[test]
fn an_unknown_scheme_is_refused_naming_the_key_and_what_is_served() {
    for command in ["run", "check"] {
        for (key, value) in [
            ("job.state_dir", "s4://x"),
            ("sink.catalog.warehouse", "s4://x"),
            ("sink.catalog.database", "s4://x/catalog.db"),
            ("sink.grants.locations", "[\"s4://x\"]"),
        ] {
            let set = format!("{key}={value}");
            let shown_key = if key == "sink.grants.locations" { "sink.grants.locations[0]" } else { key };
            assert_refused(
                command,
                &[set.as_str()],
                &[
                    &format!("key `{shown_key}`"),
                    "\"s4://x",
                    "s4:// is not a scheme Sluice knows (known: file://, s3://, gs://)",
                    "served here: local paths and file:// URLs",
                ],
            );
        }
    }
}

#[test]
fn a_malformed_store_url_is_refused() {
    assert_refused("check", &["job.state_dir=s3:///no-bucket"], &["key `job.state_dir`", "a bucket name is required"]);
    assert_refused(
        "check",
        &["sink.catalog.warehouse=file://relative/wh"],
        &["key `sink.catalog.warehouse`", "must name an absolute path"],
    );
    // A prefix segment with whitespace at its edge (here an NBSP), which the
    // store layer would trim and so reach another prefix: refused.
    assert_refused(
        "check",
        &["job.state_dir=gs://lake/\u{a0}state"],
        &["key `job.state_dir`", "starts or ends with whitespace"],
    );
}

/// The issue's own command with one slash missing (`s3:/lake/state`), or
/// none (`s3:lake`), or an unknown scheme (`s4:x`): refused naming the key,
/// never a local folder named `s3:` beside the job file.
#[test]
fn a_scheme_without_slashes_is_refused_not_taken_for_a_local_path() {
    for command in ["run", "check"] {
        for (key, value, suggested) in [
            ("job.state_dir", "s3:/lake/state", "s3://lake/state"),
            ("job.state_dir", "s3:lake", "s3://lake"),
            ("sink.catalog.warehouse", "s3:/lake/warehouse", "s3://lake/warehouse"),
            ("sink.catalog.warehouse", "s4:x", "s4://x"),
            ("sink.catalog.database", "gs:/lake/catalog.db", "gs://lake/catalog.db"),
        ] {
            let set = format!("{key}={value}");
            assert_refused(
                command,
                &[set.as_str()],
                &[
                    &format!("key `{key}`"),
                    &format!("starts with the URL scheme `{}:` but lacks `//`", &value[..2]),
                    &format!("write {suggested:?}"),
                    &format!("or \"./{value}\" for a local path"),
                ],
            );
        }
    }
}
