//! Change streams from files (#41): `[source] key` and `change_column`
//! through the real engine into the chaos plugin, whose committer keeps, per
//! key, the row the last committed change left and the log of every change
//! it applied (see `tests/plugins/chaos`). Each test writes its input files,
//! computes the model from them (files in name order, lines in order) and
//! compares what the newest checkpoint record's committer state holds.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;
use sluice::engine::checkpoint::CheckpointStore;
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::{CHAOS_PLUGIN, FILES_PLUGIN, TestJob};

/// A row as the chaos plugin keeps it: column to display text.
type Row = BTreeMap<String, Option<String>>;

/// One line of an input file: `(id, op, v)`; `id` or `op` may be absent.
#[derive(Clone)]
struct Line {
    id: Option<i64>,
    op: Option<String>,
    v: String,
}

/// What the job must land: per key (`["3"]`), the last upsert's row; and
/// per key, the changes in source order `(op, hi, lo)`.
struct Model {
    landed: BTreeMap<String, Row>,
    order: BTreeMap<String, Vec<(u8, u64, u64)>>,
}

fn key_of(id: i64) -> String {
    serde_json::to_string(&[Some(id.to_string())]).unwrap()
}

/// The model of `files` (in name order): an upsert replaces the key's row,
/// a delete removes it; a line without a valid op or key changes nothing.
fn model(files: &[(String, Vec<Line>)]) -> Model {
    let (mut landed, mut order) = (BTreeMap::new(), BTreeMap::<String, Vec<(u8, u64, u64)>>::new());
    for (hi, (_, lines)) in files.iter().enumerate() {
        for (i, line) in lines.iter().enumerate() {
            let Some(id) = line.id else { continue };
            let op = match line.op.as_deref().map(|o| o.trim().to_ascii_lowercase()) {
                Some(o) if ["insert", "update", "c", "r", "u"].contains(&o.as_str()) => 0,
                Some(o) if ["delete", "d"].contains(&o.as_str()) => 1,
                _ => continue,
            };
            let key = key_of(id);
            order.entry(key.clone()).or_default().push((op, hi as u64, i as u64 + 1));
            if op == 0 {
                let row: Row =
                    [("id".to_string(), Some(id.to_string())), ("v".to_string(), Some(line.v.clone()))].into();
                landed.insert(key, row);
            } else {
                landed.remove(&key);
            }
        }
    }
    Model { landed, order }
}

/// `files` changes over `keys` keys: inserts, updates in both spellings and
/// any case, deletes and re-inserts, spread over every file (a key's
/// changes cross files). Deterministic.
fn changes(files: usize, lines: usize, keys: i64) -> Vec<(String, Vec<Line>)> {
    let spellings = ["insert", "UPDATE", "u", " c ", "r", "Update"];
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut alive = std::collections::BTreeSet::new();
    (0..files)
        .map(|f| {
            let name = format!("part-{f:03}.jsonl");
            let lines = (0..lines)
                .map(|l| {
                    let id = (next() % keys as u64) as i64;
                    let op = if alive.contains(&id) && next() % 3 == 0 {
                        alive.remove(&id);
                        if next() % 2 == 0 { "delete" } else { "D" }
                    } else {
                        alive.insert(id);
                        spellings[(next() % spellings.len() as u64) as usize]
                    };
                    Line { id: Some(id), op: Some(op.to_string()), v: format!("f{f}-l{}", l + 1) }
                })
                .collect();
            (name, lines)
        })
        .collect()
}

fn write_files(dir: &Path, files: &[(String, Vec<Line>)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, lines) in files {
        let text: String = lines
            .iter()
            .map(|l| {
                let mut o = serde_json::Map::new();
                if let Some(id) = l.id {
                    o.insert("id".into(), Value::from(id));
                } else {
                    o.insert("id".into(), Value::Null);
                }
                o.insert("op".into(), l.op.clone().map_or(Value::Null, Value::from));
                o.insert("v".into(), Value::from(l.v.clone()));
                format!("{}\n", Value::Object(o))
            })
            .collect();
        std::fs::write(dir.join(name), text).unwrap();
    }
}

/// A file source of `in/` (JSON lines, keyed by `id`, ops in `op`) into the
/// chaos plugin; `source_extra` and `job_extra` add keys.
fn job(id: &str, parallelism: u32, every_rows: u64, source_extra: &str, job_extra: &str, plugin: &str) -> TestJob {
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
{job_extra}
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
format = "json"
batch_rows = 5
{source_extra}
[sink]
plugin = "{plugin}"
[sink.options]
journal = "journal"
state_dir = "state"
[sink.grants]
locations = ["journal", "out"]
read_locations = ["state"]
[sink.sandbox]
call_timeout_secs = 20
memory_mb = 128
"#
    );
    let job = TestJob { dir, toml };
    std::fs::create_dir_all(job.state()).unwrap();
    job
}

const KEYED: &str = "key = [\"id\"]\nchange_column = \"op\"";

/// The chaos committer's state in the newest record.
fn state(job: &TestJob) -> Value {
    let loaded = job.load(&[]).expect("job");
    let store = CheckpointStore::inspect(&job.state(), &loaded.spec.job.id).expect("state dir").expect("a state dir");
    let record = store.latest().expect("reading the newest record").expect("a checkpoint record");
    let state = record.committer_state.expect("a committer state");
    serde_json::from_slice(&state.0).expect("the chaos state is JSON")
}

/// Per key, the row landed (table `""`).
fn landed(state: &Value) -> BTreeMap<String, Row> {
    let table = state["landed"].get("").cloned().unwrap_or(Value::Object(Default::default()));
    table
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, change)| (k.clone(), serde_json::from_value(change["row"].clone()).unwrap()))
        .collect()
}

/// Per key, the changes committed, in the order they were applied.
fn applied(state: &Value) -> BTreeMap<String, Vec<(u8, u64, u64)>> {
    let mut out: BTreeMap<String, Vec<(u8, u64, u64)>> = BTreeMap::new();
    for entry in state["log"].as_array().cloned().unwrap_or_default() {
        let (_table, key, op, hi, lo): (String, String, u8, u64, u64) = serde_json::from_value(entry).unwrap();
        out.entry(key).or_default().push((op, hi, lo));
    }
    out
}

/// Every key's changes were applied once each, in source order, and the
/// landed rows are the model's.
fn assert_matches_model(job: &TestJob, m: &Model, context: &str) {
    let s = state(job);
    let applied = applied(&s);
    for (key, changes) in &applied {
        assert!(changes.windows(2).all(|w| (w[0].1, w[0].2) < (w[1].1, w[1].2)), "{context}: key {key}: {changes:?}");
    }
    assert_eq!(applied, m.order, "{context}: every change once, per key in source order");
    assert_eq!(landed(&s), m.landed, "{context}: the landed rows are the model's");
}

/// Inserts, updates, deletes and re-inserts across several files end in
/// the model's state, at parallelism 1 and 2, every key's changes applied
/// once each in source order; the change column and the reserved columns
/// reach no table schema the plugin is given.
#[test]
fn changes_across_files_land_as_the_model_at_parallelism_one_and_two() {
    let files = changes(5, 40, 17);
    let m = model(&files);
    assert!(m.order.values().any(|c| c.iter().filter(|(op, _, _)| *op == 1).count() >= 2), "deletes and re-inserts");
    for p in [1, 2] {
        let job = job(&format!("cdc-{p}"), p, 30, KEYED, "", CHAOS_PLUGIN);
        write_files(&job.dir.path().join("in"), &files);
        let summary = job.run(None).unwrap_or_else(|e| panic!("parallelism {p}: {e}"));
        assert!(summary.last_committed.is_some_and(|c| c >= 2), "several checkpoints: {summary:?}");
        assert_matches_model(&job, &m, &format!("parallelism {p}"));
        // Both writers got changes at parallelism 2: the keys were split.
        if p == 2 {
            for w in 0..2 {
                let journal = job.journal(&format!("a1-writer{w}"));
                assert!(journal.iter().any(|(_, e)| e.starts_with("write rows=") && e != "write rows=0"), "writer {w}");
            }
        }
        let mut tables = Vec::new();
        for entry in std::fs::read_dir(job.dir.path().join("journal")).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            tables.extend(text.lines().filter(|l| l.contains(" tables ")).map(str::to_string));
        }
        assert!(!tables.is_empty(), "the plugin journals its tables");
        for t in &tables {
            assert!(t.ends_with(" tables :[id,v]"), "a table schema with other columns: {t}");
        }
    }
}

/// A crash at every step of a checkpoint, then a resume: no change is
/// dropped or applied twice, and the order per key holds (parallelism 2).
#[test]
fn a_crash_and_resume_neither_drops_nor_repeats_a_change() {
    let files = changes(4, 30, 11);
    let m = model(&files);
    for point in CrashPoint::ALL {
        if matches!(point, CrashPoint::DuringEvolve | CrashPoint::AfterEvolve) {
            continue; // the table never evolves
        }
        let job = job(&format!("cdc-crash-{point}"), 2, 15, KEYED, "", CHAOS_PLUGIN);
        write_files(&job.dir.path().join("in"), &files);
        let fault = Fault { point, checkpoint: 2, subtask: 1 };
        let crashed = job.run(Some(fault)).expect_err("crash");
        assert!(crashed.is_injected_crash(), "{point}: {crashed}");
        job.run(None).unwrap_or_else(|e| panic!("{point}: the resume failed: {e}"));
        assert_matches_model(&job, &m, &format!("crash {point}"));
    }
}

/// Files with an unknown operation and a null key.
fn with_bad_lines() -> Vec<(String, Vec<Line>)> {
    let mut files = changes(3, 20, 7);
    files[1].1[4].op = Some("merge".into());
    files[2].1[9].id = None;
    files
}

/// With `job.bad_rows = "fail"` an unknown operation stops the job naming
/// the file, the record, the column and the value; with dead letters, the
/// unknown op and the null key are set aside exactly once (parallelism 2,
/// where both subtasks read every file) and every other change lands.
#[test]
fn unknown_operations_and_null_keys_are_bad_rows() {
    let files = with_bad_lines();
    let failing = job("cdc-bad-fail", 2, 15, KEYED, "", CHAOS_PLUGIN);
    write_files(&failing.dir.path().join("in"), &files);
    let err = failing.run(None).expect_err("the unknown op fails").to_string();
    assert!(
        err.contains("part-001.jsonl record 5")
            && err.contains("column `op` holds \"merge\", which is not an operation"),
        "{err}"
    );
    // The null key, alone.
    let mut null_key = changes(3, 20, 7);
    null_key[2].1[9].id = None;
    let failing = job("cdc-bad-key", 1, 15, KEYED, "", CHAOS_PLUGIN);
    write_files(&failing.dir.path().join("in"), &null_key);
    let err = failing.run(None).expect_err("the null key fails").to_string();
    assert!(err.contains("part-002.jsonl record 10") && err.contains("key column `id` is null"), "{err}");

    let dead = "bad_rows = \"dead-letter\"\n[job.dead_letter]\ntable = \"dead\"";
    for crash in [None, Some(Fault { point: CrashPoint::AfterPersist, checkpoint: 2, subtask: 0 })] {
        let job = job("cdc-bad-dl", 2, 15, KEYED, dead, CHAOS_PLUGIN);
        write_files(&job.dir.path().join("in"), &files);
        if let Some(fault) = crash {
            assert!(job.run(Some(fault)).expect_err("crash").is_injected_crash());
        }
        job.run(None).unwrap_or_else(|e| panic!("{e}"));
        let s = state(&job);
        let letters: Vec<Row> = serde_json::from_value(s["appended"]["dead"].clone()).expect("dead letters");
        let mut shown: Vec<(String, String)> =
            letters.iter().map(|r| (r["source_position"].clone().unwrap(), r["reason"].clone().unwrap())).collect();
        shown.sort();
        assert_eq!(shown.len(), 2, "each bad row once: {shown:?}");
        assert_eq!(shown[0].0, "part-001.jsonl record 5");
        assert!(shown[0].1.contains("\"merge\""), "{shown:?}");
        assert_eq!(shown[1], ("part-002.jsonl record 10".to_string(), "key column `id` is null".to_string()));
        assert!(letters[0]["raw"].as_deref().is_some_and(|r| r.contains("\"op\"")), "the record as read");
        assert_matches_model(&job, &model(&files), "dead letters");
    }
}

/// A change stream to a plugin that does not declare `sluice.key` (the
/// files sink) is refused before anything is written, naming the plugin;
/// `change_column` without a key is refused naming both keys; without
/// `[source] key` the sink's `key` option gives it.
#[test]
fn change_streams_are_refused_where_they_cannot_land_and_the_sink_key_is_the_fallback() {
    let files = changes(2, 10, 5);
    let mut refused = job("cdc-files", 1, 15, KEYED, "", FILES_PLUGIN);
    refused.toml = refused.toml.replace("journal = \"journal\"\nstate_dir = \"state\"", "path = \"out/files\"");
    write_files(&refused.dir.path().join("in"), &files);
    let err = refused.run(None).expect_err("refused").to_string();
    assert!(err.contains("sink plugin 'files' does not take change streams") && err.contains("source.key"), "{err}");
    assert!(!refused.dir.path().join("out").exists(), "nothing written");
    let loaded = refused.load(&[]).unwrap();
    if let Some(store) = CheckpointStore::inspect(&refused.state(), &loaded.spec.job.id).unwrap() {
        assert!(store.latest().unwrap().is_none(), "no checkpoint recorded");
    }

    let no_key = job("cdc-no-key", 1, 15, "change_column = \"op\"", "", CHAOS_PLUGIN);
    write_files(&no_key.dir.path().join("in"), &files);
    let err = no_key.load(&[]).map(|_| ()).expect_err("no key").to_string();
    assert!(err.contains("source.change_column") && err.contains("source.key"), "{err}");

    let fallback = job("cdc-fallback", 1, 15, "change_column = \"op\"", "", CHAOS_PLUGIN);
    write_files(&fallback.dir.path().join("in"), &files);
    fallback.run_with(&["sink.options.key=\"id\""], None).unwrap_or_else(|e| panic!("{e}"));
    let s = {
        let loaded = fallback.load(&["sink.options.key=\"id\""]).unwrap();
        let store = CheckpointStore::inspect(&fallback.state(), &loaded.spec.job.id).unwrap().unwrap();
        let record = store.latest().unwrap().unwrap();
        serde_json::from_slice::<Value>(&record.committer_state.unwrap().0).unwrap()
    };
    let m = model(&files);
    assert_eq!(applied(&s), m.order);
    assert_eq!(landed(&s), m.landed);
}
