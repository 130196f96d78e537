//! A cargo run nested inside the test build (shared by `build.rs`, which
//! includes this file, and the tests).
//!
//! Invariant: the outer build's flags and wrappers (clippy, coverage) and its
//! target directory never reach the nested run; the caller names the target
//! directory, one of its own, so the nested cargo does not wait on the outer
//! build's lock.

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
    cmd
}
