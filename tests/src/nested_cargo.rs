//! A cargo run nested inside the test build (shared by `build.rs`, which
//! includes this file, and the tests).
//!
//! Invariants:
//! - the outer build's flags and wrappers (clippy, coverage) and its target
//!   directory never reach a nested run of [`nested_cargo`]; the caller
//!   names the target directory, one of its own, so the nested cargo does
//!   not wait on the outer build's lock;
//! - no nested cargo (this one, the `sluice` binary's build, maturin's)
//!   sees the variables cargo sets for the process it runs (a test, a build
//!   script): [`clear_outer_cargo_env`]. Build scripts that declare them
//!   with `rerun-if-env-changed` (ring's declares `CARGO_MANIFEST_DIR` and
//!   `CARGO_PKG_*`) would otherwise be rerun whenever a test's nested build
//!   and the top-level `cargo test` alternate, and everything above them
//!   rebuilt each time (ring, rustls, reqwest, opendal, iceberg, the host).

use std::path::Path;
use std::process::Command;

/// `cargo <args>` in `root`, with the outer build's settings removed.
pub fn nested_cargo(root: &Path, args: &[&str]) -> Command {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root).args(args);
    for var in
        ["CARGO_ENCODED_RUSTFLAGS", "RUSTFLAGS", "RUSTC_WORKSPACE_WRAPPER", "CARGO_TARGET_DIR", "CARGO_BUILD_TARGET"]
    {
        cmd.env_remove(var);
    }
    clear_outer_cargo_env(&mut cmd);
    cmd
}

/// Removes from `cmd`'s environment what cargo sets for the process it
/// runs, as the Cargo book lists them ("Environment variables Cargo sets
/// for crates" and "… for build scripts",
/// <https://doc.rust-lang.org/cargo/reference/environment-variables.html>):
/// the package's `CARGO_PKG_*`, `CARGO_MANIFEST_*`, `CARGO_CRATE_NAME`,
/// `CARGO_BIN_NAME`, `CARGO_PRIMARY_PACKAGE`, `CARGO_TARGET_TMPDIR`,
/// `CARGO_RUSTC_CURRENT_DIR`, `OUT_DIR`, and a build script's
/// `CARGO_CFG_*`, `CARGO_FEATURE_*`, `TARGET`, `HOST`, `NUM_JOBS`,
/// `OPT_LEVEL`, `DEBUG`, `PROFILE`. What the user set for cargo itself
/// (`CARGO_HOME`, `CARGO_TARGET_DIR`, `CARGO_INCREMENTAL`, …), `CARGO` and
/// `RUSTC` (the running cargo and its compiler) stay.
pub fn clear_outer_cargo_env(cmd: &mut Command) {
    const EXACT: [&str; 15] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
        "TARGET",
        "HOST",
        "NUM_JOBS",
        "OPT_LEVEL",
        "DEBUG",
        "PROFILE",
    ];
    const PREFIXES: [&str; 3] = ["CARGO_PKG_", "CARGO_CFG_", "CARGO_FEATURE_"];
    for (name, _) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if EXACT.contains(&name) || PREFIXES.iter().any(|p| name.starts_with(p)) {
            cmd.env_remove(name);
        }
    }
}
