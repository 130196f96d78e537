//! Sources keep their identity across runs, JSON lines lose nothing, the
//! totals are true and the errors guide rightly (issue 20, points 2-5).
//!
//! Invariant of every test here: where rows land they are compared by id
//! and value with what the source holds, never by count alone.

use std::path::Path;

use arrow_array::{Array, Float64Array, Int64Array, RecordBatch, StringArray};
use sluice::engine::{self, CrashPoint, EngineError, Fault, state};
use sluice::source::generator::Generator;
use sluice_tests::{FILES_PLUGIN, TestJob, assert_exactly_once, read_parquet_tree, read_visible, sort_by_id};

/// A file source job reading `in/` into the files sink.
fn file_job(id: &str, parallelism: u32, every_rows: u64, batch_rows: u64) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
batch_rows = {batch_rows}
[sink]
id = "out"
plugin = "{FILES_PLUGIN}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#
    );
    TestJob { dir, toml }
}

/// `in/<name>` with rows `id,v` for `ids`, `v = id * 3`.
fn write_csv(job: &TestJob, name: &str, ids: std::ops::Range<i64>) {
    let text: String = std::iter::once("id,v\n".to_string()).chain(ids.map(|i| format!("{i},{}\n", i * 3))).collect();
    std::fs::write(job.dir.path().join("in").join(name), text).expect("csv");
}

/// `(id, v)` of every visible row, sorted by id.
fn landed(job: &TestJob) -> Vec<(i64, i64)> {
    let rows = sort_by_id(&read_parquet_tree(&job.out()));
    let id = rows.column_by_name("id").expect("id").as_any().downcast_ref::<Int64Array>().expect("int64").clone();
    let v = rows.column_by_name("v").expect("v").as_any().downcast_ref::<Int64Array>().expect("int64").clone();
    (0..rows.num_rows()).map(|k| (id.value(k), v.value(k))).collect()
}

/// The rows `ids` of files written by [`write_csv`].
fn expected(ids: std::ops::Range<i64>) -> Vec<(i64, i64)> {
    ids.map(|i| (i, i * 3)).collect()
}

fn crash_after_commit(checkpoint: u64) -> Option<Fault> {
    Some(Fault { point: CrashPoint::AfterCommit, checkpoint, subtask: 0 })
}

/// The adversarial case of the issue: `b.csv` and `c.csv` are read in part,
/// the job stops, an `a.csv` that sorts first is added, and the job is
/// resumed. The resume is refused naming `a.csv` and the way to start over;
/// with `a.csv` gone again the job goes on and lands every row once.
#[test]
fn a_file_that_sorts_before_the_position_is_refused_by_name() {
    let job = file_job("src-before", 1, 1000, 250);
    write_csv(&job, "b.csv", 0..3000);
    write_csv(&job, "c.csv", 3000..6000);
    let err = job.run(crash_after_commit(2)).expect_err("stopped mid-run");
    assert!(err.is_injected_crash(), "{err}");
    write_csv(&job, "a.csv", 10_000..13_000);

    let err = job.run(None).expect_err("the new first file is refused");
    assert!(matches!(err, EngineError::SourceChanged { checkpoint: 2, .. }), "{err}");
    let message = err.to_string();
    for part in ["in/a.csv is new and sorts before", "in/b.csv", "append-only", "job.state_dir", "--new-incarnation"] {
        assert!(message.contains(part), "{part:?} in: {message}");
    }
    assert_eq!(landed(&job), expected(0..2000), "nothing more landed");

    std::fs::remove_file(job.dir.path().join("in/a.csv")).expect("rm");
    let summary = job.run(None).expect("the input as it was resumes");
    assert_eq!(summary.rows_total, 6000);
    assert_eq!(landed(&job), expected(0..6000));
}

/// A consumed file that grows, shrinks or is rewritten is refused, naming
/// it; once it is back as it was (content and modification time) the job
/// resumes and lands every row once.
#[test]
fn a_consumed_file_that_changed_is_refused() {
    let job = file_job("src-changed", 1, 1000, 250);
    write_csv(&job, "b.csv", 0..3000);
    write_csv(&job, "c.csv", 3000..6000);
    assert!(job.run(crash_after_commit(2)).expect_err("stopped").is_injected_crash());

    let b = job.dir.path().join("in/b.csv");
    let original = std::fs::read(&b).expect("read");
    let mtime = std::fs::metadata(&b).expect("stat").modified().expect("mtime");
    let restore_mtime =
        || std::fs::File::options().write(true).open(&b).expect("open").set_modified(mtime).expect("mtime");
    let refused = |what: &str| {
        let err = job.run(None).expect_err("refused").to_string();
        assert!(err.contains(&format!("in/b.csv {what}")) && err.contains("--new-incarnation"), "{what}: {err}");
    };
    std::fs::write(&b, [original.clone(), b"99999,1\n".to_vec()].concat()).expect("grow");
    refused("grew from");
    std::fs::write(&b, &original[..original.len() / 2]).expect("shrink");
    refused("shrank from");
    let mut changed = original.clone();
    changed[10] = if changed[10] == b'7' { b'8' } else { b'7' };
    std::fs::write(&b, &changed).expect("rewrite");
    restore_mtime();
    // Same size, same modification time: a content change that only a hash
    // would see. Told apart here by a newer modification time.
    std::fs::File::options()
        .write(true)
        .open(&b)
        .expect("open")
        .set_modified(mtime + std::time::Duration::from_secs(1))
        .expect("mtime");
    refused("was modified");

    std::fs::write(&b, &original).expect("restore");
    restore_mtime();
    job.run(None).expect("the input as it was resumes");
    assert_eq!(landed(&job), expected(0..6000));
}

/// The folder is append-only: files added after the job stopped that sort
/// after everything read are read, each once, by the subtask its name
/// belongs to, with two subtasks.
#[test]
fn files_appended_after_the_position_are_read_exactly_once() {
    let job = file_job("src-append", 2, 500, 100);
    for k in 0..4 {
        write_csv(&job, &format!("part-{k:02}.csv"), k * 1000..k * 1000 + 1000);
    }
    assert!(job.run(crash_after_commit(2)).expect_err("stopped").is_injected_crash());
    write_csv(&job, "part-04.csv", 4000..5000);
    write_csv(&job, "part-05.csv", 5000..6000);
    let summary = job.run(None).expect("appended files are accepted");
    assert_eq!(summary.rows_total, 6000);
    assert_eq!(landed(&job), expected(0..6000));
    // Added once the job has finished: the job is complete, nothing is read.
    write_csv(&job, "part-06.csv", 6000..7000);
    let again = job.run(None).expect("complete");
    assert!(again.already_complete, "{again}");
    assert_eq!(landed(&job), expected(0..6000));
}

/// A resume with other generator parameters is refused like a parallelism
/// change, naming the key; the job as it was goes on and lands every row once.
#[test]
fn a_changed_generator_is_refused() {
    let job = TestJob::files("gen-changed", 4000, 2, 500);
    assert!(job.run(crash_after_commit(2)).expect_err("stopped").is_injected_crash());
    let err = job.run_with(&["source.rows=8000"], None).expect_err("refused");
    assert!(matches!(err, EngineError::SourceChanged { checkpoint: 2, .. }), "{err}");
    let message = err.to_string();
    assert!(message.contains("source.rows was 4000, now 8000") && message.contains("--new-incarnation"), "{message}");
    let err = job.run_with(&["source.first_id=7"], None).expect_err("refused").to_string();
    assert!(err.contains("source.first_id was 0, now 7"), "{err}");
    // Pacing does not change which rows exist.
    let summary = job.run_with(&["source.batch_rows=333"], None).expect("resumes");
    assert_eq!(summary.rows_total, 4000);
    assert_exactly_once(&read_visible(&job.out()), 4000);
}

/// JSON lines drifting after the first thousand records: a field first met
/// at record 1,500 lands as a column, and `1500.5` in a column of integers
/// lands as `1500.5` (the column is a double), never as `1500`.
#[test]
fn json_lines_drift_after_record_1500_lands_every_field_and_digit() {
    let job = file_job("src-jsonl", 1, 700, 256);
    let mut text = String::from("\u{feff}");
    for i in 0..3000 {
        if i == 1500 {
            text.push_str("{\"id\": 1500, \"v\": 1500.5, \"tag\": \"late\"}\n");
        } else if i > 1500 {
            text.push_str(&format!("{{\"id\": {i}, \"v\": {i}, \"tag\": \"t{i}\"}}\n"));
        } else {
            text.push_str(&format!("{{\"id\": {i}, \"v\": {i}}}\n"));
        }
    }
    std::fs::write(job.dir.path().join("in/events.jsonl"), text).expect("jsonl");
    let summary = job.run(None).expect("lands");
    assert_eq!(summary.rows_total, 3000);
    let rows: RecordBatch = sort_by_id(&read_parquet_tree(&job.out()));
    let id = rows.column_by_name("id").expect("id").as_any().downcast_ref::<Int64Array>().expect("int64").clone();
    let v = rows.column_by_name("v").expect("v").as_any().downcast_ref::<Float64Array>().expect("a double").clone();
    let tag = rows.column_by_name("tag").expect("tag").as_any().downcast_ref::<StringArray>().expect("utf8").clone();
    let got: Vec<(i64, f64, Option<String>)> = (0..rows.num_rows())
        .map(|k| (id.value(k), v.value(k), tag.is_valid(k).then(|| tag.value(k).to_string())))
        .collect();
    let want: Vec<(i64, f64, Option<String>)> = (0..3000)
        .map(|i| match i {
            1500 => (i, 1500.5, Some("late".to_string())),
            _ if i > 1500 => (i, i as f64, Some(format!("t{i}"))),
            _ => (i, i as f64, None),
        })
        .collect();
    assert_eq!(got, want);
}

/// A value that fits no column (a string among integers) stops the job
/// before anything lands, naming the file, the line, the field and the value.
#[test]
fn a_json_value_that_fits_no_column_is_refused_by_line() {
    let job = file_job("src-jsonl-bad", 1, 700, 256);
    let mut text: String = (0..1600).map(|i| format!("{{\"id\": {i}, \"v\": {i}}}\n")).collect();
    text.push_str("{\"id\": 1600, \"v\": \"n/a\"}\n");
    std::fs::write(job.dir.path().join("in/events.jsonl"), text).expect("jsonl");
    let err = job.run(None).expect_err("refused").to_string();
    for part in ["in/events.jsonl", "line 1601", "field `v`", "\"n/a\""] {
        assert!(err.contains(part), "{part:?} in: {err}");
    }
    assert!(!job.out().exists() || landed(&job).is_empty());
}

/// `rows in total` counts only rows of committed checkpoints: after a
/// pending checkpoint of 1,000 rows is dropped, the summary and `sluice
/// state` both say 2,000, which is what the target holds.
#[test]
fn totals_exclude_a_dropped_checkpoint() {
    let job = TestJob::files("totals-drop", 3000, 2, 500);
    let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 };
    assert!(job.run(Some(crash)).expect_err("crash").is_injected_crash());
    let loaded = job.load(&[]).expect("job");
    let dropped = state::drop_pending(&loaded, 2).expect("dropped");
    assert_eq!(dropped.rows, 1000);
    let summary = job.run(None).expect("goes on");
    let visible = sluice_tests::ids(&read_visible(&job.out()));
    assert_eq!(summary.rows_total, visible.len() as u64, "{summary}");
    assert_eq!(summary.rows_total, 2000, "{summary}");
    assert!(summary.to_string().contains("2000 rows in total"), "{summary}");
    let report = state::inspect(&loaded).expect("state").to_string();
    assert!(report.contains("in total:     2000 rows of committed checkpoints"), "{report}");
    assert!(report.contains("pending:      none"), "the last commit is recorded: {report}");
}

/// The newest record moved away after its checkpoint was committed: the
/// resume from the older record prepares that checkpoint again and the sink
/// answers already-committed. The message says which checkpoint, that its
/// rows would land twice and to restore the record from a backup; it does
/// not blame another job.
#[test]
fn a_missing_record_of_a_committed_checkpoint_is_named() {
    let job = TestJob::files("missing-record", 3000, 2, 500);
    assert!(job.run(crash_after_commit(2)).expect_err("crash").is_injected_crash());
    let checkpoints = job.state().join("checkpoints");
    let newest = checkpoints.join(format!("chk-{:020}.json", 2));
    std::fs::rename(&newest, job.dir.path().join("chk-2.moved")).expect("move the record away");
    let err = job.run(None).expect_err("refused");
    assert!(matches!(err, EngineError::KeyReused { checkpoint: 2, .. }), "{err}");
    let message = err.to_string();
    for part in [
        "this incarnation committed checkpoint 2 before",
        "the newest record was checkpoint 1",
        "would deliver the rows of checkpoint 2 twice",
        "Restore the record of checkpoint 2",
        "from a backup",
        "halted",
    ] {
        assert!(message.contains(part), "{part:?} in: {message}");
    }
    assert!(!message.contains("job.id"), "{message}");
    // What checkpoints 1 and 2 committed is there once; nothing of this run.
    let want = arrow_select::concat::concat_batches(
        &Generator::schema_ref(),
        &[Generator::batch_for(0, 1000), Generator::batch_for(1500, 2500)],
    )
    .expect("concat");
    assert_eq!(read_visible(&job.out()), want);
}

/// `sluice check` refuses a files-sink staging directory on another
/// filesystem than the output, saying why (here /dev/shm, a tmpfs).
#[test]
fn check_refuses_staging_on_another_filesystem() {
    use std::os::unix::fs::MetadataExt;
    let shm = Path::new("/dev/shm");
    let job = TestJob::files("cross-device", 1000, 1, 500);
    let other = match tempfile::tempdir_in(shm) {
        Ok(d) => d,
        Err(e) => {
            println!("skipped: no /dev/shm to put staging on another filesystem ({e})");
            return;
        }
    };
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
    if dev(other.path()) == dev(job.dir.path()) {
        println!("skipped: /dev/shm is on the filesystem of the test's directory");
        return;
    }
    let staging = other.path().join("staging");
    let staging_set = format!("sink.options.staging_path={}", staging.display());
    let grants = format!("sink.grants.locations=[\"out\", \"{}\"]", other.path().display());
    let loaded = job.load(&[&staging_set, &grants]).expect("job");
    let report = engine::check(&loaded, sluice_tests::host());
    let problems = report.problems.join("\n");
    assert!(problems.contains("is on another filesystem than option `path`"), "{problems}");
    assert!(problems.contains("a rename cannot cross filesystems"), "{problems}");
    // Beside the output (the default), the same check passes.
    let loaded = job.load(&[]).expect("job");
    let report = engine::check(&loaded, sluice_tests::host());
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

/// The small things: a state directory that is a file, a sandbox memory no
/// instance can use, and a plugin that cannot load, which must leave no
/// state directory behind and count no attempt.
#[test]
fn small_errors_say_what_is_wrong_and_change_nothing() {
    let job = TestJob::files("small", 1000, 1, 500);
    std::fs::write(job.dir.path().join("afile"), b"x").expect("file");
    let err = job.run_with(&["job.state_dir=afile"], None).expect_err("refused").to_string();
    assert!(err.contains("afile is not a directory"), "{err}");
    assert!(!err.contains("File exists"), "{err}");

    let err = job.load(&["sink.sandbox.memory_mb=100000000"]).expect_err("refused").to_string();
    assert!(err.contains("sink.sandbox.memory_mb") && err.contains("at most 4096"), "{err}");

    let bad = job.dir.path().join("broken.wasm");
    std::fs::write(&bad, b"not a component").expect("bad plugin");
    let set = format!("sink.plugin={}", bad.display());
    let err = job.run_with(&[&set], None).expect_err("cannot load");
    assert!(matches!(err, EngineError::Plugin(_)), "{err}");
    assert!(!job.state().exists(), "a plugin that cannot load leaves no state directory");
    job.run(None).expect("the job runs");
    let report = state::inspect(&job.load(&[]).expect("job")).expect("state");
    assert_eq!(report.runs, 1, "the failed start counted no attempt");
}

/// The file source's split rule, as `host/src/source/file.rs` documents it:
/// a file belongs to subtask `fnv1a64(name) % parallelism`.
fn owner(name: &str, parallelism: u64) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash % parallelism
}

/// A name of the form `<stem><n>.csv` that subtask `subtask` of 2 owns.
fn owned_by(stem: &str, subtask: u64) -> String {
    (0..).map(|n| format!("{stem}{n}.csv")).find(|name| owner(name, 2) == subtask).expect("a name")
}

/// A subtask that had read all its files (here: none) when the job stopped
/// still reads a file added since for it, once: the job had not finished.
#[test]
fn a_finished_subtask_reads_a_file_added_for_it() {
    let job = file_job("src-idle", 2, 250, 50);
    write_csv(&job, &owned_by("big", 0), 0..3000);
    assert!(job.run(crash_after_commit(2)).expect_err("stopped mid-run").is_injected_crash());
    write_csv(&job, &owned_by("late", 1), 5000..5100);
    let summary = job.run(None).expect("resumes");
    assert_eq!(summary.rows_total, 3100);
    let mut want = expected(0..3000);
    want.extend(expected(5000..5100));
    assert_eq!(landed(&job), want);
}

/// A file whose name is not UTF-8 is refused before anything is read: two
/// such names could read alike once made text.
#[test]
fn a_file_name_that_is_not_utf8_is_refused() {
    use std::os::unix::ffi::OsStrExt;
    let job = file_job("src-utf8", 1, 250, 50);
    write_csv(&job, "a.csv", 0..100);
    let bad = job.dir.path().join("in").join(std::ffi::OsStr::from_bytes(b"\xfe.csv"));
    std::fs::write(&bad, "id,v\n1,3\n").expect("csv");
    let err = job.run(None).expect_err("refused").to_string();
    assert!(err.contains("not valid UTF-8") && err.contains("rename it"), "{err}");
    assert!(!job.out().exists() || landed(&job).is_empty());
}

/// Nested numbers are checked by their path: an integer a double would
/// round inside an object or a list is refused as at the top level.
#[test]
fn a_nested_json_integer_a_double_would_round_is_refused() {
    for (name, lines) in [
        ("object", ["{\"id\": 1, \"o\": {\"x\": 9007199254740993}}", "{\"id\": 2, \"o\": {\"x\": 1.5}}"]),
        ("list", ["{\"id\": 1, \"l\": [9007199254740993]}", "{\"id\": 2, \"l\": [1.5]}"]),
    ] {
        let job = file_job(&format!("src-nested-{name}"), 1, 250, 50);
        std::fs::write(job.dir.path().join("in/events.jsonl"), lines.join("\n")).expect("jsonl");
        let err = job.run(None).expect_err("refused").to_string();
        assert!(err.contains("9007199254740993 would lose digits") && err.contains("line 1"), "{name}: {err}");
    }
    // Beyond 64 bits the JSON parser itself would round: the raw text is checked.
    for (name, number) in [("big", "18446744073709551616"), ("negative", "-9223372036854775809")] {
        let job = file_job(&format!("src-wide-{name}"), 1, 250, 50);
        let text = format!(
            "{{\"id\": 1, \"s\": \"-99999999999999999999 in a string is fine\"}}\n{{\"id\": 2, \"h\": {number}}}\n"
        );
        std::fs::write(job.dir.path().join("in/events.jsonl"), text).expect("jsonl");
        let err = job.run(None).expect_err("refused").to_string();
        assert!(err.contains(&format!("line 2: the integer {number} does not fit")), "{name}: {err}");
    }
}

/// A field no record of a file gives a value holds nothing: it is left out
/// of that file's schema, and a later file that gives it values adds it.
#[test]
fn a_json_field_null_in_a_whole_file_loses_nothing() {
    let job = file_job("src-nulls", 1, 250, 50);
    let first: String = (0..100).map(|i| format!("{{\"id\": {i}, \"v\": {}, \"n\": null}}\n", i * 3)).collect();
    let second: String = (100..200).map(|i| format!("{{\"id\": {i}, \"v\": {}, \"n\": {i}}}\n", i * 3)).collect();
    std::fs::write(job.dir.path().join("in/a.jsonl"), first).expect("jsonl");
    std::fs::write(job.dir.path().join("in/b.jsonl"), second).expect("jsonl");
    let summary = job.run(None).expect("lands");
    assert_eq!(summary.rows_total, 200);
    assert_eq!(landed(&job), expected(0..200));
}
