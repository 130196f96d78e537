//! `sluice plugin test`, the conformance suite, run through the CLI against
//! the files, Iceberg, BigQuery (the double) and Python sinks (each must pass
//! every case, and file trees are left as they were found), and against a target whose reader sees
//! uncommitted rows (which must fail).

use std::path::Path;

use sluice_tests::{FILES_PLUGIN, ICEBERG_PLUGIN, python_interpreter, python_jsonl_plugin, run_cli};

fn plugin_test(plugin: &str, job: &Path, extra: &[&str]) -> (i32, String, String) {
    let job = job.display().to_string();
    let mut args = vec!["plugin", "test", plugin, "--job", job.as_str(), "--rows", "1800"];
    args.extend(extra);
    run_cli(&args, Path::new(&job).parent().unwrap_or(Path::new(".")))
}

/// A job file around `sink`: the suite replaces its job and source anyway.
fn scratch_job(sink: &str) -> String {
    format!("[job]\nid = \"scratch\"\n[source]\nkind = \"generator\"\nrows = 1\n{sink}")
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("writing the job file");
    path
}

const FILE_SINK: &str = r#"[sink]
id = "out"
plugin = "replaced-by-the-suite.wasm"
[sink.options]
path = "out/data"
[sink.grants]
locations = ["out"]
"#;

fn assert_all_passed(code: i32, stdout: &str, stderr: &str) {
    assert_eq!(code, 0, "the suite failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all 12 cases passed"), "{stdout}");
    for case in ["crash after prepare-commit", "nothing visible before commit", "abort-prepare and abort"] {
        assert!(stdout.lines().any(|l| l.contains(case) && l.contains("| pass |")), "{case}: {stdout}");
    }
}

#[test]
fn the_files_sink_passes_and_the_tree_is_left_clean() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir_all(dir.path().join("out/data")).expect("dir");
    std::fs::write(dir.path().join("out/data/keep.txt"), "not the suite's").expect("file");
    let job = write(dir.path(), "job.toml", &scratch_job(FILE_SINK));
    let (code, stdout, stderr) = plugin_test(FILES_PLUGIN, &job, &[]);
    assert_all_passed(code, &stdout, &stderr);
    let left: Vec<String> = std::fs::read_dir(dir.path().join("out/data"))
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(left, ["keep.txt"], "the suite left its checkpoints behind or removed what was there");
}

#[test]
fn a_plugin_built_for_contract_0_1_passes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(dir.path(), "job.toml", &scratch_job(FILE_SINK));
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/sluice_sink_files_0.1.wasm");
    let (code, stdout, stderr) = plugin_test(&fixture.display().to_string(), &job, &[]);
    assert_all_passed(code, &stdout, &stderr);
    assert!(stdout.contains("(contract 0.1.0)"), "{stdout}");
    assert!(stdout.contains("not applicable: contract 0.1 has no schema changes"), "{stdout}");
}

#[test]
fn the_iceberg_sink_passes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(
        dir.path(),
        "job.toml",
        &scratch_job(
            r#"[sink]
id = "lake"
plugin = "replaced-by-the-suite.wasm"
[sink.options]
table = "scratch.events"
[sink.catalog]
database = "warehouse/catalog.db"
warehouse = "warehouse"
"#,
        ),
    );
    let (code, stdout, stderr) = plugin_test(ICEBERG_PLUGIN, &job, &[]);
    assert_all_passed(code, &stdout, &stderr);
    // The suite created the table, so it drops it again.
    assert!(stdout.contains("dropped the table scratch.events"), "{stdout}");
    let catalog = sluice_tests::catalog(&dir.path().join("warehouse"));
    let ident = iceberg::TableIdent::from_strs(["scratch", "events"]).expect("ident");
    assert!(catalog.load(&ident).is_err(), "the scratch table is still in the catalog");
}

/// The verify command's Python: prints the ids DuckDB reads from the JSON
/// Lines under `out/data` (and, with `staging`, also the staged ones, as a
/// reader that sees uncommitted rows would). DuckDB's progress bar is off:
/// on a busy machine it would print in front of the ids.
fn duckdb_ids(staging: bool) -> String {
    let globs =
        if staging { "['out/data/**/*.jsonl', 'out/data.staging/**/*.jsonl']" } else { "['out/data/**/*.jsonl']" };
    format!(
        "{} -c \"import duckdb, glob; duckdb.execute('SET enable_progress_bar = false'); \
         f = [p for g in {globs} for p in glob.glob(g, recursive=True)]; \
         print(' '.join(str(r[0]) for r in duckdb.sql(f'select id from read_json_auto({{f!r}})').fetchall()) if f else '')\"",
        python_interpreter().display()
    )
}

#[test]
fn the_python_sink_passes_with_a_verify_command() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(dir.path(), "job.toml", &scratch_job(FILE_SINK));
    let cmd = duckdb_ids(false);
    let (code, stdout, stderr) = plugin_test(python_jsonl_plugin(), &job, &["--verify-cmd", &cmd]);
    assert_all_passed(code, &stdout, &stderr);
}

/// The built-in checker reads Parquet: a sink writing JSON Lines under
/// `path` is told so once, and asked for `--verify-cmd`, instead of failing
/// every case with "0 rows visible".
#[test]
fn a_target_of_another_format_asks_for_a_verify_command() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(dir.path(), "job.toml", &scratch_job(FILE_SINK));
    let (code, stdout, stderr) = plugin_test(python_jsonl_plugin(), &job, &[]);
    assert_eq!(code, 2, "{stdout}{stderr}");
    for part in ["holds files", "but no Parquet file", "--verify-cmd"] {
        assert!(stderr.contains(part), "{part:?}: {stderr}");
    }
    assert!(!stdout.contains("| FAIL |"), "no case is failed for the checker's sake: {stdout}");
}

#[test]
fn a_target_that_shows_uncommitted_rows_fails() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(dir.path(), "job.toml", &scratch_job(FILE_SINK));
    let cmd = duckdb_ids(true);
    let (code, stdout, _) = plugin_test(python_jsonl_plugin(), &job, &["--verify-cmd", &cmd]);
    assert_ne!(code, 0, "{stdout}");
    for case in ["nothing visible before commit", "crash after prepare-commit"] {
        assert!(stdout.lines().any(|l| l.contains(case) && l.contains("| FAIL |")), "{case}: {stdout}");
    }
}

#[test]
fn a_sink_without_a_checker_is_told_to_pass_a_verify_command() {
    let dir = tempfile::tempdir().expect("temp dir");
    let job =
        write(dir.path(), "job.toml", &scratch_job(&FILE_SINK.replace("path = \"out/data\"", "folder = \"out/data\"")));
    let (code, _, stderr) = plugin_test(FILES_PLUGIN, &job, &[]);
    assert_ne!(code, 0);
    assert!(stderr.contains("--verify-cmd"), "{stderr}");
}

#[test]
fn the_bigquery_sink_passes_against_the_double() {
    use sluice_bigquery_double::{BigQueryDouble, generator_schema};
    const TABLE: &str = "projects/p/datasets/d/tables/scratch";
    let double = BigQueryDouble::start().expect("the BigQuery double starts");
    double.create_table(TABLE, generator_schema());
    let dir = tempfile::tempdir().expect("temp dir");
    let job = write(
        dir.path(),
        "job.toml",
        &scratch_job(&format!(
            r#"[sink]
id = "bq"
plugin = "replaced-by-the-suite.wasm"
[sink.options]
table = "{TABLE}"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{}"
[sink.http.bigquery]
address = "{}"
"#,
            double.address(),
            double.rest_address()
        )),
    );
    // What readers see, through the API's tabledata.list (the double's REST side).
    let cmd = format!(
        "{} -c \"import json, urllib.request; r = json.load(urllib.request.urlopen('{}/bigquery/v2/{TABLE}/data')); \
         print(' '.join(row['f'][0]['v'] for row in r.get('rows', [])))\"",
        python_interpreter().display(),
        double.rest_address()
    );
    let (code, stdout, stderr) = plugin_test(sluice_tests::BIGQUERY_PLUGIN, &job, &["--verify-cmd", &cmd]);
    assert_all_passed(code, &stdout, &stderr);
}
