//! `job.bad_rows = "dead-letter"`: a CSV record that does not convert lands
//! in the dead-letter table with its checkpoint, exactly once, through every
//! crash of the protocol; `job.max_bad_rows` stops a job before the
//! checkpoint that passed it. The real process is SIGKILLed with dead
//! letters on, too.

use std::collections::BTreeMap;
use std::path::Path;

use arrow_array::{Array, Int64Array, RecordBatch, StringArray};
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::{
    FILES_PLUGIN, ICEBERG_PLUGIN, TestJob, python, read_parquet_tree, rerun_to_end, run_and_kill, run_cli,
};

/// Records per input file, and files.
const PER_FILE: u64 = 500;
const FILES: u64 = 4;

/// Whether record `id` holds a bad `qty`.
fn is_bad(id: u64) -> bool {
    id >= PER_FILE && id % 97 == 5
}

/// Writes the input under `dir/in` (in a folder `table` when given):
/// `FILES` CSV files of `id,qty,note`, ids from 0, some `qty` not integers.
/// Returns the source position of each bad record, by id.
fn write_input(dir: &Path, table: Option<&str>) -> BTreeMap<u64, String> {
    let folder = match table {
        Some(t) => dir.join("in").join(t),
        None => dir.join("in"),
    };
    std::fs::create_dir_all(&folder).expect("input folder");
    let mut bad = BTreeMap::new();
    for f in 0..FILES {
        let name = format!("part-{f}.csv");
        let mut text = String::from("id,qty,note\n");
        for j in 0..PER_FILE {
            let id = f * PER_FILE + j;
            let qty = if is_bad(id) { format!("q{id}") } else { (id % 7).to_string() };
            text.push_str(&format!("{id},{qty},\"note, {id}\"\n"));
            if is_bad(id) {
                let shown = table.map_or(name.clone(), |t| format!("{t}/{name}"));
                // Line 1 is the header.
                bad.insert(id, format!("{shown} line {}", j + 2));
            }
        }
        std::fs::write(folder.join(&name), text).expect("input file");
    }
    bad
}

fn job_toml(id: &str, sink: &str, extra: &str) -> String {
    format!(
        r#"[job]
id = "{id}"
parallelism = 2
state_dir = "state"
bad_rows = "dead-letter"
{extra}
[job.checkpoint]
every_rows = 200
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 64
{sink}"#
    )
}

fn files_job(id: &str, extra: &str) -> (TestJob, BTreeMap<u64, String>) {
    let dir = tempfile::tempdir().expect("dir");
    let bad = write_input(dir.path(), None);
    let sink = format!(
        r#"[sink]
id = "out"
plugin = "{FILES_PLUGIN}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#
    );
    (TestJob { dir, toml: job_toml(id, &sink, extra) }, bad)
}

fn ints(b: &RecordBatch, name: &str) -> Vec<i64> {
    let col = b.column_by_name(name).unwrap_or_else(|| panic!("column {name}"));
    let a = col.as_any().downcast_ref::<Int64Array>().expect("int64");
    (0..a.len()).map(|i| a.value(i)).collect()
}

fn texts(b: &RecordBatch, name: &str) -> Vec<String> {
    let col = b.column_by_name(name).unwrap_or_else(|| panic!("column {name}"));
    let a = col.as_any().downcast_ref::<StringArray>().expect("utf8");
    (0..a.len()).map(|i| a.value(i).to_string()).collect()
}

/// A dead letter as read back: its position, its record and the reason.
type Letter = (String, String, String);

/// The good rows are every good record once, by id and value, and the dead
/// letters every bad record once, by position and text.
fn assert_landed(rows: &[(i64, i64)], letters: &[Letter], bad: &BTreeMap<u64, String>) {
    let expected: Vec<(i64, i64)> =
        (0..FILES * PER_FILE).filter(|id| !is_bad(*id)).map(|id| (id as i64, (id % 7) as i64)).collect();
    let mut got = rows.to_vec();
    got.sort_unstable();
    assert_eq!(got.len(), expected.len(), "good rows landed (each once)");
    assert_eq!(got, expected, "good rows by value");
    let mut got: Vec<(String, String)> = letters.iter().map(|(p, r, _)| (p.clone(), r.clone())).collect();
    got.sort();
    let mut want: Vec<(String, String)> =
        bad.iter().map(|(id, p)| (p.clone(), format!("{id},q{id},\"note, {id}\""))).collect();
    want.sort();
    assert_eq!(got, want, "dead letters by position and record, each once");
    for (position, _, reason) in letters {
        assert!(reason.contains("column `qty` holds") && reason.contains("Int64"), "{position}: {reason}");
    }
}

/// What a files job landed: (id, qty) rows and (position, raw, reason) letters.
fn files_landed(job: &TestJob) -> (Vec<(i64, i64)>, Vec<Letter>) {
    let out = job.dir.path().join("out/files");
    let rows = read_parquet_tree(&out);
    let rows = ints(&rows, "id").into_iter().zip(ints(&rows, "qty")).collect();
    let letters = read_parquet_tree(&out.join("dead_letters"));
    let positions = texts(&letters, "source_position");
    let raw = texts(&letters, "raw");
    let reasons = texts(&letters, "reason");
    assert!(texts(&letters, "target_table").iter().all(String::is_empty), "a single-table source's table is \"\"");
    assert!(texts(&letters, "job").iter().all(|j| j == job_id(job)), "the job is named");
    assert!(ints(&letters, "checkpoint").iter().all(|c| *c >= 1));
    let letters = positions.into_iter().zip(raw).zip(reasons).map(|((p, r), why)| (p, r, why)).collect();
    (rows, letters)
}

fn job_id(job: &TestJob) -> &str {
    job.toml.lines().find_map(|l| l.strip_prefix("id = \"")).and_then(|l| l.strip_suffix('"')).unwrap_or("")
}

#[test]
fn dead_letters_land_once_with_the_good_rows() {
    let (job, bad) = files_job("dl-files", "");
    let summary = job.run(None).expect("runs");
    assert_eq!(summary.rows_total, FILES * PER_FILE - bad.len() as u64, "{summary}");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), bad.len() as u64)), "{summary}");
    assert!(summary.to_string().contains(&format!("{} bad rows as dead letters", bad.len())), "{summary}");
    let (rows, letters) = files_landed(&job);
    assert_landed(&rows, &letters, &bad);
    // A rerun of the finished job adds nothing.
    assert!(job.run(None).expect("rerun").already_complete);
    let (rows2, letters2) = files_landed(&job);
    assert_eq!((rows2.len(), letters2.len()), (rows.len(), letters.len()));
}

/// A crash at every step of checkpoint 2, then a recovery run: nothing
/// lost, nothing doubled, good rows and dead letters alike.
#[test]
fn crash_matrix_with_dead_letters_files_sink() {
    for point in CrashPoint::ROUND {
        let (job, bad) = files_job(&format!("dl-crash-{point}"), "");
        let fault = Fault { point, checkpoint: 2, subtask: 0 };
        let err = job.run(Some(fault)).expect_err("the injected crash");
        assert!(err.is_injected_crash(), "{point}: {err}");
        job.run(None).unwrap_or_else(|e| panic!("{point}: recovery: {e}"));
        let (rows, letters) = files_landed(&job);
        assert_landed(&rows, &letters, &bad);
    }
}

/// The Iceberg sink's section: `lake.{table}` in a SQLite catalog at `wh`.
fn iceberg_sink(wh: &Path) -> String {
    format!(
        r#"[sink]
id = "lake"
plugin = "{ICEBERG_PLUGIN}"
[sink.options]
table = "lake.{{table}}"
[sink.catalog]
database = "{wh}/catalog.db"
warehouse = "{wh}"
[sink.sandbox]
memory_mb = 512
"#,
        wh = wh.display()
    )
}

/// What an Iceberg job landed in `lake.orders` and `lake.dead_letters`,
/// read back by PyIceberg: (id, qty) rows and (position, raw, reason)
/// letters. Asserts that every letter names the table it was meant for,
/// and that no table holds a snapshot of one checkpoint twice.
fn iceberg_landed(wh: &Path) -> (Vec<(i64, i64)>, Vec<Letter>) {
    let out = python(
        "import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         ot, dt = cat.load_table('lake.orders'), cat.load_table('lake.dead_letters')\n\
         o, d = ot.scan().to_arrow(), dt.scan().to_arrow()\n\
         commits = lambda t: [[s.summary['sluice.job-id'], s.summary['sluice.checkpoint-id']] for s in t.snapshots()]\n\
         print(json.dumps({'rows': list(zip(o.column('id').to_pylist(), o.column('qty').to_pylist())),\n\
         \x20                 'letters': [list(t) for t in zip(*[d.column(c).to_pylist() for c in\n\
         \x20                     ['source_position', 'raw', 'reason', 'target_table']])],\n\
         \x20                 'commits': [commits(ot), commits(dt)]}))",
        &[&wh.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json");
    let rows: Vec<(i64, i64)> = serde_json::from_value(v["rows"].clone()).expect("rows");
    let letters: Vec<(String, String, String, String)> = serde_json::from_value(v["letters"].clone()).expect("letters");
    assert!(letters.iter().all(|l| l.3 == "orders"), "the table they were meant for: {letters:?}");
    let commits: Vec<Vec<(String, String)>> = serde_json::from_value(v["commits"].clone()).expect("commits");
    for table in commits {
        let mut seen = std::collections::BTreeSet::new();
        assert!(table.iter().all(|c| seen.insert(c.clone())), "a checkpoint committed twice: {table:?}");
    }
    (rows, letters.into_iter().map(|(p, r, why, _)| (p, r, why)).collect())
}

/// The same matrix into Iceberg tables (a tree source, `lake.{table}`),
/// read back by PyIceberg.
#[test]
fn crash_matrix_with_dead_letters_iceberg_sink() {
    for point in CrashPoint::ROUND {
        let dir = tempfile::tempdir().expect("dir");
        let bad = write_input(dir.path(), Some("orders"));
        let wh = dir.path().join("warehouse");
        let job = TestJob { dir, toml: job_toml(&format!("dl-ice-{point}"), &iceberg_sink(&wh), "") };
        let fault = Fault { point, checkpoint: 2, subtask: 0 };
        let err = job.run(Some(fault)).expect_err("the injected crash");
        assert!(err.is_injected_crash(), "{point}: {err}");
        job.run(None).unwrap_or_else(|e| panic!("{point}: recovery: {e}"));
        let (rows, letters) = iceberg_landed(&wh);
        assert_landed(&rows, &letters, &bad);
    }
}

/// Slows `job` so that a real process can be killed mid-way: about 300
/// records a second over both writers, a checkpoint about every batch.
fn slowed(mut job: TestJob) -> TestJob {
    job.toml = job
        .toml
        .replace("every_rows = 200", "every_rows = 64")
        .replace("batch_rows = 64", "batch_rows = 64\nrate = 300.0");
    job.load(&[]).expect("valid job");
    job
}

/// Checkpoints of the single table the files sink has made visible (the
/// dead letters are in a folder of their own).
fn visible_checkpoints(job: &TestJob) -> u64 {
    std::fs::read_dir(job.out())
        .map(|d| d.flatten().filter(|e| e.path().is_dir() && e.file_name() != "dead_letters").count() as u64)
        .unwrap_or(0)
}

/// After the last run: the summary and `sluice state` count every bad
/// record once, over all the runs.
fn assert_counted(job: &TestJob, stdout: &str, bad: usize) {
    assert!(stdout.contains(&format!("{bad} bad rows as dead letters")), "{stdout}");
    let (code, state, err) = run_cli(&["state", "job.toml"], job.dir.path());
    assert_eq!(code, 0, "{err}");
    assert!(state.contains(&format!("bad rows:     {bad} records that did not convert")), "{state}");
}

/// The real `sluice run` is SIGKILLed twice while it writes good rows and
/// dead letters, then run to its end: every good record once, every bad
/// one once as a dead letter, counted once.
#[test]
fn sigkill_twice_with_dead_letters_files_sink() {
    let (job, bad) = files_job("dl-kill-files", "");
    let job = slowed(job);
    run_and_kill(&job, || visible_checkpoints(&job), 2);
    let first = visible_checkpoints(&job);
    let mut seen = ints(&read_parquet_tree(&job.out()), "id");
    seen.sort_unstable();
    let before = seen.len();
    seen.dedup();
    assert_eq!(seen.len(), before, "a good row twice after a SIGKILL");
    run_and_kill(&job, || visible_checkpoints(&job), first + 2);
    let stdout = rerun_to_end(&job, &[]);
    assert!(stdout.contains("attempt 3"), "{stdout}");
    let (rows, letters) = files_landed(&job);
    assert_landed(&rows, &letters, &bad);
    assert_counted(&job, &stdout, bad.len());
}

/// Snapshots of `lake.orders` so far: its metadata files, one per commit
/// and one for its creation.
fn orders_versions(wh: &Path) -> u64 {
    std::fs::read_dir(wh.join("lake/orders/metadata"))
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".metadata.json")).count() as u64)
        .unwrap_or(0)
}

/// The same kills into Iceberg tables, read back by PyIceberg.
#[test]
fn sigkill_twice_with_dead_letters_iceberg_sink() {
    let dir = tempfile::tempdir().expect("dir");
    let bad = write_input(dir.path(), Some("orders"));
    let wh = dir.path().join("warehouse");
    let job = slowed(TestJob { dir, toml: job_toml("dl-kill-ice", &iceberg_sink(&wh), "") });
    run_and_kill(&job, || orders_versions(&wh), 3);
    let first = orders_versions(&wh);
    run_and_kill(&job, || orders_versions(&wh), first + 2);
    let stdout = rerun_to_end(&job, &[]);
    assert!(stdout.contains("attempt 3"), "{stdout}");
    let (rows, letters) = iceberg_landed(&wh);
    assert_landed(&rows, &letters, &bad);
    assert_counted(&job, &stdout, bad.len());
}

/// JSON lines: a record that does not fit lands as a dead letter, once,
/// through a crash during the commit of checkpoint 2.
#[test]
fn json_lines_dead_letters_land_once_through_a_crash() {
    let (job, _) = files_job("dl-json", "");
    let input = job.dir.path().join("in");
    std::fs::remove_dir_all(&input).expect("csv input");
    std::fs::create_dir_all(&input).expect("input");
    let mut want = BTreeMap::new();
    for f in 0..FILES {
        let mut text = String::new();
        for j in 0..PER_FILE {
            let id = f * PER_FILE + j;
            if is_bad(id) {
                text.push_str(&format!("{{\"id\": {id}, \"qty\": \"q{id}\"}}\n"));
                want.insert(format!("part-{f}.jsonl line {}", j + 1), format!("{{\"id\": {id}, \"qty\": \"q{id}\"}}"));
            } else {
                text.push_str(&format!("{{\"id\": {id}, \"qty\": {}}}\n", id % 7));
            }
        }
        std::fs::write(input.join(format!("part-{f}.jsonl")), text).expect("input file");
    }
    let fault = Fault { point: CrashPoint::DuringCommit, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
    let summary = job.run(None).expect("recovers");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), want.len() as u64)), "{summary}");
    let out = job.dir.path().join("out/files");
    let rows = read_parquet_tree(&out);
    let mut ids = ints(&rows, "id");
    ids.sort_unstable();
    let expected: Vec<i64> = (0..FILES * PER_FILE).filter(|id| !is_bad(*id)).map(|id| id as i64).collect();
    assert_eq!(ids, expected, "every good record once");
    let letters = read_parquet_tree(&out.join("dead_letters"));
    let got: BTreeMap<String, String> =
        texts(&letters, "source_position").into_iter().zip(texts(&letters, "raw")).collect();
    assert_eq!(letters.num_rows(), want.len(), "each dead letter once");
    assert_eq!(got, want);
}

/// A count over the job: the checkpoint that passes it is not committed,
/// the error says how many and shows a sample; earlier ones stay.
#[test]
fn max_bad_rows_stops_the_job_before_the_checkpoint_that_passed_it() {
    let (job, _) = files_job("dl-max", "max_bad_rows = 8");
    let err = job.run(None).expect_err("too many bad rows").to_string();
    assert!(err.contains("more than job.max_bad_rows allows (8 over the job)"), "{err}");
    assert!(err.contains("line ") && err.contains("column `qty` holds"), "a sample: {err}");
    let (rows, letters) = files_landed(&job);
    assert!(letters.len() <= 8, "{} dead letters committed", letters.len());
    assert!(rows.len() < (FILES * PER_FILE) as usize);
    // The same job with room for all of them resumes and finishes.
    let summary = job.run_with(&["job.max_bad_rows=1000"], None).expect("resumes");
    assert!(summary.resumed_from.is_some() || summary.recovered.is_empty(), "{summary}");

    // A share of the records read over the job: 1 in 97 is over 0.5%.
    let (job, _) = files_job("dl-fraction", "max_bad_rows = 0.005");
    let err = job.run(None).expect_err("too large a share").to_string();
    assert!(err.contains("a share of 0.005 of the records read over the job"), "{err}");
}

/// What a user can cause is refused before anything runs, naming the key.
#[test]
fn dead_letter_settings_are_checked() {
    let (job, _) = files_job("dl-config", "");
    for (sets, says) in [
        (&["job.bad_rows=fail"][..], "job.dead_letter"),
        (&["job.max_bad_rows=-1"][..], "job.max_bad_rows"),
        (&["job.max_bad_rows=1.5"][..], "job.max_bad_rows"),
        (&["job.dead_letter.table=\" \""][..], "job.dead_letter.table"),
    ] {
        let err = job.load(sets).expect_err("refused").to_string();
        assert!(err.contains(says), "{sets:?}: {err}");
    }
    let err = job.load(&["job.bad_rows=skip"]).expect_err("unknown mode").to_string();
    assert!(err.contains("bad_rows"), "{err}");
}

/// A dotted dead-letter table is named in full: beside the Iceberg pattern
/// `lake.{table}`, `lake.dead_letters` lands in `lake.dead_letters` (not
/// `lake.lake.dead_letters`), the table the run's summary names; read back
/// by PyIceberg. A dotted name the pattern would nest is refused at load.
#[test]
fn a_dotted_dead_letter_table_lands_where_the_summary_says() {
    let dir = tempfile::tempdir().expect("dir");
    let bad = write_input(dir.path(), Some("orders"));
    let wh = dir.path().join("warehouse");
    let job = TestJob { dir, toml: job_toml("dl-dotted", &iceberg_sink(&wh), "") };
    let sets = ["job.dead_letter.table=\"lake.dead_letters\""];
    let summary = job.run_with(&sets, None).expect("runs");
    assert_eq!(summary.dead_letters, Some(("lake.dead_letters".to_string(), bad.len() as u64)), "{summary}");
    assert!(summary.to_string().contains("dead letters in table \"lake.dead_letters\""), "{summary}");
    let (rows, letters) = iceberg_landed(&wh);
    assert_landed(&rows, &letters, &bad);
    let tables = python(
        "import sys\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w = sys.argv[1]\n\
         cat = SqlCatalog('sluice', uri=f'sqlite:///{w}/catalog.db', warehouse=f'file://{w}')\n\
         print(sorted('.'.join(t) for t in cat.list_tables('lake')))\n\
         print(cat.table_exists('lake.lake.dead_letters'))",
        &[&wh.display().to_string()],
    )
    .unwrap_or_else(|e| panic!("PyIceberg failed (CI installs it in its venv): {e}"));
    assert_eq!(tables.trim(), "['lake.dead_letters', 'lake.orders']\nFalse", "no lake.lake.dead_letters");
    // A rerun finds the job complete under the same name.
    assert!(job.run_with(&sets, None).expect("rerun").already_complete);

    let err = job.load(&["job.dead_letter.table=\"other.dead_letters\""]).expect_err("refused").to_string();
    assert!(
        err.contains("key `job.dead_letter.table`")
            && err.contains("\"lake.other.dead_letters\"")
            && err.contains("\"lake.<name>\""),
        "{err}"
    );
}
