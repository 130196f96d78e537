//! The plugins' own unit tests: `guest/` is a workspace of its own (it
//! builds for wasm32-wasip2), so `cargo test --workspace` at the root does
//! not reach them. They run natively here, in a target directory of their
//! own under the test build's, through the same nested cargo as `build.rs`.

use std::path::Path;

use sluice_tests::nested_cargo::nested_cargo;

#[test]
fn the_plugins_unit_tests_pass() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lives in the workspace");
    let target = Path::new(env!("SLUICE_TEST_TARGET_DIR")).join("guests-native");
    let mut cmd = nested_cargo(root, &["test", "--manifest-path", "guest/Cargo.toml", "--workspace", "--target-dir"]);
    cmd.arg(&target);
    let out = cmd.output().expect("running cargo test on the plugins' workspace");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the plugins' unit tests failed:\n{stdout}\n{stderr}");
    // The run reached the tests (not, say, an empty workspace).
    let passed: u32 = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|rest| rest.split(' ').next()?.parse::<u32>().ok())
        .sum();
    assert!(passed >= 5, "only {passed} plugin unit tests ran:\n{stdout}");
}
