//! The generated job-file reference (`docs/src/reference/job-file.md`,
//! #39 point 6) cannot drift from the code, nor the examples from it.
//!
//! - the page is rebuilt from the config types' schema and the built sink
//!   plugins' own `describe` answers (`sluice::job::reference`), and must
//!   equal the committed page byte for byte; `SLUICE_BLESS=1` rewrites it;
//! - every key and table has a doc comment;
//! - every key an example job file (`examples/*.toml`) sets is one the
//!   reference lists for that job's source kind and plugin.
//!
//! Invariants: the page holds no path, time or build-dependent order, so
//! the same code gives the same page on any machine.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use sluice::job::reference::{self, OptionDoc, PluginDoc, Reference};
use sluice_tests::{BIGQUERY_PLUGIN, FILES_PLUGIN, ICEBERG_PLUGIN, host};

/// The built-in sink plugins the page documents (the test-only chaos
/// plugin and the example Python plugin are not built-in).
const PLUGINS: [&str; 3] = [FILES_PLUGIN, ICEBERG_PLUGIN, BIGQUERY_PLUGIN];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// What each built-in plugin's `describe` says of its options, the
/// host's own (`sluice.`) left out, as `sluice plugin inspect` does.
fn plugin_docs() -> Vec<PluginDoc> {
    PLUGINS
        .iter()
        .map(|path| {
            let plugin = host().load(Path::new(path)).unwrap_or_else(|e| panic!("loading {path}: {e}"));
            let info = plugin.info().unwrap_or_else(|| panic!("{path} answers no describe"));
            PluginDoc {
                name: info.name.clone(),
                description: info.description.clone(),
                options: info
                    .options
                    .iter()
                    .filter(|o| !sluice::plugin::reserved::is_reserved(&o.name))
                    .map(|o| OptionDoc {
                        name: o.name.clone(),
                        description: o.description.clone(),
                        required: o.required,
                        default: o.default_value.clone(),
                    })
                    .collect(),
            }
        })
        .collect()
}

fn build() -> Reference {
    let reference = reference::reference(&plugin_docs());
    assert!(
        reference.undocumented().is_empty(),
        "these keys or tables have no doc comment in their config type (or plugin option description); \
         write one there: {:?}",
        reference.undocumented()
    );
    reference
}

#[test]
fn the_job_file_reference_is_current() {
    let reference = build();
    let page = reference.markdown();
    assert_eq!(reference.plugins().len(), PLUGINS.len(), "one section per built-in plugin");
    let path = repo().join(reference::PAGE);
    if std::env::var_os("SLUICE_BLESS").is_some() {
        std::fs::write(&path, &page).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != page {
        let line = committed
            .lines()
            .zip(page.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(page.lines().count()));
        let shown = |text: &str| text.lines().nth(line).unwrap_or("(end of page)").to_string();
        panic!(
            "{} is stale: it differs from what the code generates from line {}:\n  committed: {}\n  generated: {}\n\
             Regenerate it with `{}` and commit it.",
            reference::PAGE,
            line + 1,
            shown(&committed),
            shown(&page),
            reference::REGENERATE
        );
    }
}

/// The key paths a job file sets: `sink.grpc.bigquery.address`,
/// `source.columns[].type` for each entry of an array of tables.
fn key_paths(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
    for (key, value) in table {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match value {
            toml::Value::Table(inner) => key_paths(&path, inner, out),
            toml::Value::Array(items) if !items.is_empty() && items.iter().all(toml::Value::is_table) => {
                for item in items {
                    if let toml::Value::Table(inner) = item {
                        key_paths(&format!("{path}[]"), inner, out);
                    }
                }
            }
            _ => out.push(path),
        }
    }
}

/// Whether a key the reference lists (`sink.grpc.<name>.address`) covers
/// a path a job file sets (`sink.grpc.bigquery.address`).
fn covers(listed: &str, path: &str) -> bool {
    let (listed, path): (Vec<&str>, Vec<&str>) = (listed.split('.').collect(), path.split('.').collect());
    listed.len() == path.len() && listed.iter().zip(&path).all(|(l, p)| *l == "<name>" || l == p)
}

/// The keys of `job` that the reference does not list for its source kind
/// and plugin; plugin options are checked only for a plugin it documents.
fn unlisted(reference: &Reference, job: &toml::Table) -> (Vec<String>, usize) {
    let kind = job.get("source").and_then(|s| s.get("kind")).and_then(toml::Value::as_str);
    let plugin = job
        .get("sink")
        .and_then(|s| s.get("plugin"))
        .and_then(toml::Value::as_str)
        .and_then(|p| Path::new(p).file_stem()?.to_str()?.strip_prefix("sluice_sink_").map(str::to_string));
    let documented = plugin.as_ref().is_some_and(|p| reference.plugins().contains(p));
    let listed: BTreeSet<String> = reference.keys(kind, plugin.as_deref().filter(|_| documented));
    let mut paths = Vec::new();
    key_paths("", job, &mut paths);
    let checked = paths.len();
    let mut missing: Vec<String> = paths
        .into_iter()
        .filter(|p| documented || !p.starts_with("sink.options."))
        .filter(|p| !listed.iter().any(|l| covers(l, p)))
        .collect();
    missing.sort();
    (missing, checked)
}

#[test]
fn example_job_files_use_only_keys_the_reference_lists() {
    let reference = build();
    let dir = repo().join("examples");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "examples/*.toml: found only {files:?}");
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        let job: toml::Table = text.parse().unwrap_or_else(|e| panic!("{} is not TOML: {e}", file.display()));
        let (missing, checked) = unlisted(&reference, &job);
        assert!(checked >= 5, "{}: only {checked} keys found", file.display());
        problems.extend(missing.into_iter().map(|k| format!("{}: {k}", file.display())));
    }
    assert!(problems.is_empty(), "keys the job-file reference does not list:\n{}", problems.join("\n"));

    // The check finds what it is for: a misspelt key, a key of another
    // source kind, an option the plugin does not declare.
    let job: toml::Table = r#"
        [job]
        id = "x"
        paralelism = 2
        [source]
        kind = "generator"
        rows = 1
        brokers = ["b:9092"]
        [sink]
        plugin = "plugins/sluice_sink_files.wasm"
        [sink.options]
        path = "out"
        no_such_option = "1"
        [sink.grpc.api]
        address = "http://127.0.0.1:1"
    "#
    .parse()
    .expect("TOML");
    let (missing, _) = unlisted(&reference, &job);
    assert_eq!(missing, ["job.paralelism", "sink.options.no_such_option", "source.brokers"]);
}
