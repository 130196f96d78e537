//! Builds the plugin components the tests run (`wasm32-wasip2`, release), the
//! way wasmtime's `test-programs` does, so that `cargo test` alone works on a
//! fresh clone. Their paths reach the tests as `SLUICE_PLUGIN_*` variables.
//!
//! The components go to `<target-dir>/guests`, a target directory of their
//! own: a nested cargo must not wait on the lock of the outer build's
//! directory. The sinks are the plugins' workspace (`guest/Cargo.toml`, built
//! as `cargo build-plugins` builds it); the test-only chaos plugin is built
//! from this workspace.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

#[path = "src/nested_cargo.rs"]
mod nested_cargo;

/// (package, library name) of every component the tests need.
const PLUGINS: &[(&str, &str)] = &[
    ("sluice-sink-files", "sluice_sink_files"),
    ("sluice-sink-iceberg", "sluice_sink_iceberg"),
    ("sluice-sink-bigquery", "sluice_sink_bigquery"),
    ("sluice-test-chaos", "sluice_test_chaos"),
];

/// Builds `packages` of the workspace at `root/manifest` for wasm32-wasip2
/// into `target_dir`, from the repository root `root` (where
/// .cargo/config.toml holds the guests' settings).
fn build(root: &Path, manifest: &str, packages: &[&str], target_dir: &Path) {
    let mut cmd = nested_cargo::nested_cargo(
        root,
        &["build", "--release", "--target", "wasm32-wasip2", "--manifest-path", manifest],
    );
    cmd.arg("--target-dir").arg(target_dir);
    for package in packages {
        cmd.args(["-p", package]);
    }
    let status = cmd.status().expect("running cargo to build the plugin components");
    if !status.success() {
        panic!(
            "building the plugin components of {} failed ({status}); is the target installed? \
             `rustup target add wasm32-wasip2` (rust-toolchain.toml asks rustup for it)",
            manifest
        );
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().expect("tests/ lives in the workspace").to_path_buf();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // OUT_DIR is <target-dir>/<profile>/build/<pkg>-<hash>/out.
    let target_dir = out_dir.ancestors().nth(4).expect("OUT_DIR has the usual shape").to_path_buf();
    let guest_dir = target_dir.join("guests");
    // Where the tests may make their Python environment (see `python`).
    println!("cargo:rustc-env=SLUICE_TEST_TARGET_DIR={}", target_dir.display());

    build(
        &workspace,
        "guest/Cargo.toml",
        &["sluice-sink-files", "sluice-sink-iceberg", "sluice-sink-bigquery"],
        &guest_dir,
    );
    build(&workspace, "Cargo.toml", &["sluice-test-chaos"], &guest_dir);

    let mut deps = BTreeSet::new();
    for (package, lib) in PLUGINS {
        let wasm = guest_dir.join("wasm32-wasip2").join("release").join(format!("{lib}.wasm"));
        assert!(wasm.is_file(), "{package} did not produce {}", wasm.display());
        let var = format!("SLUICE_PLUGIN_{}", lib.trim_start_matches("sluice_").to_uppercase());
        println!("cargo:rustc-env={var}={}", wasm.display());
        read_deps(&wasm, &mut deps);
    }
    for dep in deps {
        println!("cargo:rerun-if-changed={dep}");
    }
    println!("cargo:rerun-if-changed={}", workspace.join("Cargo.lock").display());
    println!("cargo:rerun-if-changed={}", workspace.join("guest/Cargo.lock").display());
    println!("cargo:rerun-if-changed={}", workspace.join("wit").display());
}

/// Adds the source files a component was built from (its `.d` file).
fn read_deps(artifact: &Path, deps: &mut BTreeSet<String>) {
    let Ok(contents) = std::fs::read_to_string(artifact.with_extension("d")) else { return };
    for line in contents.lines() {
        let Some((_, files)) = line.split_once(": ") else { continue };
        let mut parts = files.split_whitespace();
        while let Some(part) = parts.next() {
            let mut file = part.to_string();
            while file.ends_with('\\') {
                file.pop();
                file.push(' ');
                file.push_str(parts.next().unwrap_or_default());
            }
            deps.insert(file);
        }
    }
}
