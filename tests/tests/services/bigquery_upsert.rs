//! The BigQuery sink with `mode = "upsert"` against the test double (real
//! gRPC and REST over loopback), which applies change data capture as
//! Google documents it (`tests/bigquery-double/src/cdc.rs`). The plugin is
//! driven directly, a writer and the committer as the engine drives them,
//! with change-stream batches the test builds (the table's columns, then
//! `_sluice_op`, `_sluice_seq_hi`, `_sluice_seq_lo`) and the reserved
//! option `sluice.key`: updates and deletes of rows from earlier
//! checkpoints, lost replies, a crash at every step of a checkpoint and a
//! rerun, against a model the test computes, key by key. What is refused:
//! a table keyed otherwise (or not at all), and upsert without a key.
//!
//! Then end to end: the file source's change streams (`change_column`,
//! `key`, JSON-lines files with every spelling of an operation) at
//! parallelism 2 through the engine, with the engine's crash points in a
//! checkpoint that updates and deletes earlier rows, and the real `sluice
//! run` process SIGKILLed twice mid-run and run again.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray, UInt8Array, UInt64Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use sluice::engine;
use sluice::plugin::{CommitterInstance, SinkCtx, SourceTable, WriterInstance};
use sluice_bigquery_double::proto::TableSchema;
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::{BigQueryDouble, EqualSequence, Fault as BqFault, Rpc, column};
use sluice_tests::{TestJob, host};

const TABLE: &str = "projects/p/datasets/d/tables/customers";
const KEYS: i64 = 40;
const CHECKPOINTS: u64 = 4;
const PER_CHECKPOINT: u64 = 60;

/// The table's columns (no reserved column): `id` is the key.
fn table_schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
    ]))
}

/// One change: key, delete?, values, source position.
#[derive(Debug, Clone)]
struct Change {
    id: i64,
    delete: bool,
    name: Option<String>,
    v: Option<i64>,
    seq: (u64, u64),
}

/// The change stream: checkpoint `c` (1-based) holds `PER_CHECKPOINT`
/// changes from "file" `c - 1`, lines 1.. (as the file source numbers
/// them). Keys repeat across checkpoints; every 5th change is a delete, so
/// keys are updated, deleted and inserted again.
fn stream() -> Vec<Vec<Change>> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (1..=CHECKPOINTS)
        .map(|c| {
            (1..=PER_CHECKPOINT)
                .map(|line| {
                    let r = next();
                    let id = (r % KEYS as u64) as i64;
                    let delete = (r >> 20).is_multiple_of(5);
                    Change {
                        id,
                        delete,
                        name: (!delete).then(|| format!("n{c}-{line}")),
                        v: (!delete && !(r >> 30).is_multiple_of(7)).then_some((r >> 40) as i64 % 1000),
                        seq: (c - 1, line),
                    }
                })
                .collect()
        })
        .collect()
}

type Model = BTreeMap<i64, (Option<String>, Option<i64>)>;

/// What the table holds after `changes` in order.
fn model(changes: &[Vec<Change>]) -> Model {
    let mut m = Model::new();
    for c in changes.iter().flatten() {
        if c.delete {
            m.remove(&c.id);
        } else {
            m.insert(c.id, (c.name.clone(), c.v));
        }
    }
    m
}

/// A change-stream batch of `changes`.
fn batch(changes: &[Change]) -> Vec<u8> {
    let mut fields: Vec<Field> = table_schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    fields.push(Field::new("_sluice_op", DataType::UInt8, false));
    fields.push(Field::new("_sluice_seq_hi", DataType::UInt64, false));
    fields.push(Field::new("_sluice_seq_lo", DataType::UInt64, false));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from_iter_values(changes.iter().map(|c| c.id))),
        Arc::new(changes.iter().map(|c| c.name.clone()).collect::<StringArray>()),
        Arc::new(changes.iter().map(|c| c.v).collect::<Int64Array>()),
        Arc::new(UInt8Array::from_iter_values(changes.iter().map(|c| u8::from(c.delete)))),
        Arc::new(UInt64Array::from_iter_values(changes.iter().map(|c| c.seq.0))),
        Arc::new(UInt64Array::from_iter_values(changes.iter().map(|c| c.seq.1))),
    ];
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("change batch");
    sluice::ipc::encode_batch(&batch).expect("ipc")
}

/// What readers of the table see, key by key.
fn table_state(d: &BigQueryDouble) -> Model {
    let mut m = Model::new();
    for row in d.visible_rows(TABLE) {
        let id = row.get("id").and_then(|v| v.as_i64()).expect("every row has an id");
        let name = row.get("name").and_then(|v| v.as_str()).map(str::to_string);
        let v = row.get("v").and_then(|v| v.as_i64());
        assert!(m.insert(id, (name, v)).is_none(), "key {id} is visible twice");
    }
    m
}

fn assert_model(d: &BigQueryDouble, changes: &[Vec<Change>]) {
    let want = model(changes);
    let got = table_state(d);
    for id in 0..KEYS {
        assert_eq!(got.get(&id), want.get(&id), "key {id}");
    }
    assert_eq!(got, want);
}

/// A job file of the sink (the source is never run: the test drives the
/// plugin), with `mode = "upsert"` and the REST endpoint granted.
fn job(id: &str, d: &BigQueryDouble, extra: &str) -> TestJob {
    let mut job = TestJob::bigquery(id, &d.address(), TABLE, 1, 1, 1);
    job.toml = job.toml.replacen("[sink.options]\n", &format!("[sink.options]\nmode = \"upsert\"\n{extra}"), 1);
    job.toml.push_str(&format!("[sink.http.bigquery]\naddress = {:?}\n", d.rest_address()));
    job
}

/// One incarnation's run of the plugin, as the engine drives it.
struct Run {
    writer: WriterInstance,
    committer: CommitterInstance,
}

/// Opens a committer (restored with `committer_state`) and a writer
/// (restored with `writer_state`) of incarnation `incarnation`, handing
/// the plugin `sluice.key` when `key` is given.
fn open(
    job: &TestJob,
    incarnation: &str,
    key: Option<&str>,
    writer_state: Option<&[u8]>,
    committer_state: Option<&[u8]>,
) -> Result<Run, String> {
    open_as(job, ctx_of(job, incarnation, 1_000_000), key, writer_state, committer_state)
}

/// The sink context of a run of `job` as incarnation `incarnation`, made at
/// `created_ms`, that takes its table's claim.
fn ctx_of(job: &TestJob, incarnation: &str, created_ms: u64) -> SinkCtx {
    let loaded = job.load(&[]).expect("job file");
    SinkCtx {
        job_id: loaded.spec.job.id.clone(),
        sink_id: loaded.spec.sink.id.clone(),
        incarnation: incarnation.to_string(),
        refuse_other_incarnations: true,
        beside: false,
        subtask: 0,
        parallelism: 1,
        attempt: 1,
        dead_letter_table: None,
        incarnation_created_ms: created_ms,
    }
}

/// [`open`] with the sink context `ctx`.
fn open_as(
    job: &TestJob,
    ctx: SinkCtx,
    key: Option<&str>,
    writer_state: Option<&[u8]>,
    committer_state: Option<&[u8]>,
) -> Result<Run, String> {
    let loaded = job.load(&[]).expect("job file");
    let plugin = host().load(&loaded.spec.sink.plugin).expect("plugin");
    let (grants, limits) = engine::grants_and_limits(&loaded).expect("grants");
    let mut options = plugin.options_for(loaded.sink_options(), &ctx);
    if let Some(key) = key {
        options.push(("sluice.key".to_string(), key.to_string()));
    }
    let schema = sluice::ipc::encode_schema(&table_schema()).expect("schema");
    let tables = vec![SourceTable { name: String::new(), schema }];
    let inst = plugin.instantiate("committer", &grants, limits).expect("instance");
    let mut committer = CommitterInstance::open(inst, &ctx, &options, &tables).map_err(|e| e.to_string())?;
    committer.restore_state(committer_state).map_err(|e| e.to_string())?;
    let inst = plugin.instantiate("writer", &grants, limits).expect("instance");
    let writer = WriterInstance::open(inst, &ctx, &options, &tables, writer_state).map_err(|e| e.to_string())?;
    Ok(Run { writer, committer })
}

/// What the engine keeps of a checkpoint: the states and the combined commit.
#[derive(Default, Clone)]
struct Record {
    writer: Option<Vec<u8>>,
    committer: Option<Vec<u8>>,
}

/// Where a run stops within a checkpoint (the engine's crash points).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopAfter {
    Write,
    PrepareCommit,
    /// The record is persisted (states, combined commit), not committed.
    Persist,
    Commit,
}

/// Writes checkpoints `from..=to` of `changes`, committing each, and
/// returns the last persisted record; at checkpoint `stop.1` stops at
/// `stop.0` (the run "crashes": its instances are dropped). A batch of a
/// checkpoint goes in two writes. The record's `pending` is a combined
/// commit persisted but not committed.
fn run(
    run: &mut Run,
    changes: &[Vec<Change>],
    from: u64,
    stop: Option<(StopAfter, u64)>,
) -> (Record, Option<(u64, Vec<u8>)>) {
    let mut record = Record::default();
    for c in from..=CHECKPOINTS {
        let part = &changes[(c - 1) as usize];
        let (a, b) = part.split_at(part.len() / 3);
        run.writer.write("", &batch(a)).expect("write");
        run.writer.write("", &batch(b)).expect("write");
        if stop == Some((StopAfter::Write, c)) {
            return (record, None);
        }
        let info = run.writer.prepare_commit(c).expect("prepare-commit");
        if stop == Some((StopAfter::PrepareCommit, c)) {
            return (record, None);
        }
        let writer_state = run.writer.snapshot_state(c).expect("writer state");
        let infos: Vec<Vec<u8>> = info.into_iter().collect();
        let combined = run.committer.combine(c, &infos).expect("combine");
        let committer_state = run.committer.snapshot_state(c).expect("committer state");
        record = Record { writer: Some(writer_state), committer: committer_state };
        if stop == Some((StopAfter::Persist, c)) {
            return (record, Some((c, combined)));
        }
        run.committer.commit(c, &combined).expect("commit");
        if stop == Some((StopAfter::Commit, c)) {
            return (record, None);
        }
    }
    (record, None)
}

fn double() -> BigQueryDouble {
    BigQueryDouble::start().expect("starting the BigQuery double")
}

#[test]
fn changes_across_checkpoints_end_in_the_models_state() {
    let d = double();
    let job = job("bq-upsert", &d, "max_staleness = \"15m\"\n");
    let changes = stream();
    let mut r = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
    // The committer created the table with the key and the staleness.
    assert_eq!(d.primary_key(TABLE), Some(vec!["id".to_string()]));
    assert_eq!(d.max_staleness(TABLE).as_deref(), Some("0-0 0 0:15:0"));
    let schema = d.table_schema(TABLE).expect("table");
    let mode = |name: &str| schema.fields.iter().find(|f| f.name == name).map(|f| f.mode);
    assert_eq!(mode("id"), Some(Mode::Required as i32), "the key keeps its mode");
    assert_eq!(mode("name"), Some(Mode::Nullable as i32));
    run(&mut r, &changes, 1, None);
    assert_model(&d, &changes);
    let model = model(&changes);
    assert!(model.len() > 5 && model.len() < KEYS as usize, "the stream deletes some keys and keeps others");
    // Every change went through the default stream, once: no write stream
    // was created, and none of them was ignored.
    assert_eq!(d.stats().streams_created, 0);
    assert_eq!(d.stats().changes_received, CHECKPOINTS * PER_CHECKPOINT);
    assert_eq!(d.stats().changes_applied, CHECKPOINTS * PER_CHECKPOINT);
    // Deleted keys stay deleted and remember the delete's number.
    let keyed = d.keyed_rows(TABLE);
    let deleted = keyed.values().filter(|a| a.row.is_none()).count();
    assert!(deleted > 0 && deleted == keyed.len() - model.len(), "{deleted} deleted of {} keys", keyed.len());
    r.writer.close().expect("close");
}

/// A crash at every step of a checkpoint that updates and deletes rows of
/// earlier checkpoints, then the recovery as the engine does it: the
/// pending checkpoint committed again (if any), and the source replayed
/// from the last persisted record. The changes the crashed run sent again
/// are ignored by their sequence numbers; the table ends in the model's state.
#[test]
fn a_crash_at_every_step_then_a_replay_ends_in_the_models_state() {
    let changes = stream();
    for equal in EqualSequence::ALL {
        for stop in [StopAfter::Write, StopAfter::PrepareCommit, StopAfter::Persist, StopAfter::Commit] {
            for at in [1, 3] {
                let d = double();
                d.answer_equal_sequence(equal);
                let job = job(&format!("bq-upsert-crash-{at}"), &d, "");
                let mut first = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
                let (record, pending) = run(&mut first, &changes, 1, Some((stop, at)));
                drop(first);
                let persisted = match (stop, &pending) {
                    (StopAfter::Persist | StopAfter::Commit, _) => at,
                    _ => at - 1,
                };
                let mut second = open(
                    &job,
                    "iiiiiiiiiiii",
                    Some(r#"["id"]"#),
                    record.writer.as_deref(),
                    record.committer.as_deref(),
                )
                .expect("reopens");
                if let Some((c, combined)) = &pending {
                    second.committer.commit(*c, combined).expect("the pending checkpoint commits again");
                }
                run(&mut second, &changes, persisted + 1, None);
                assert_model(&d, &changes);
                let stats = d.stats();
                assert!(stats.changes_received >= CHECKPOINTS * PER_CHECKPOINT, "{equal:?} {stop:?} {at}: {stats:?}");
                if stop == StopAfter::Write && equal == EqualSequence::Ignore {
                    // The changes the crashed run sent were sent again, and ignored.
                    assert!(stats.changes_applied < stats.changes_received, "{stop:?} {at}: {stats:?}");
                }
            }
        }
    }
}

/// The same change stream sent again from the start (a rerun, as a new
/// incarnation beside the first) leaves the table as it was.
#[test]
fn a_rerun_of_the_same_change_stream_leaves_the_same_table() {
    for equal in EqualSequence::ALL {
        let d = double();
        d.answer_equal_sequence(equal);
        let changes = stream();
        let job = job("bq-upsert-rerun", &d, "");
        let mut first = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
        run(&mut first, &changes, 1, None);
        drop(first);
        let before = table_state(&d);
        let applied = d.stats().changes_applied;
        // A rerun lands beside the first incarnation (`--new-incarnation`).
        let mut again = open_beside(&job, Some(r#"["id"]"#)).expect("opens beside");
        run(&mut again, &changes, 1, None);
        assert_model(&d, &changes);
        assert_eq!(table_state(&d), before, "{equal:?}: the rerun changed what the table holds");
        // A later incarnation numbers its changes higher (its start comes
        // first in every number), so BigQuery applies them again, in order,
        // and the table ends where the first run left it.
        assert!(d.stats().changes_applied > applied, "{equal:?}: the rerun's changes were applied again");
    }
}

/// A later incarnation over NEW input, whose source positions start again
/// from the first file (a fresh state directory over another folder), is
/// applied, not taken for older changes: its numbers begin with when the
/// incarnation began. Every key ends as the first stream and then the
/// second leave it.
#[test]
fn a_later_incarnation_over_new_input_is_applied_though_its_positions_start_again() {
    for equal in EqualSequence::ALL {
        let d = double();
        d.answer_equal_sequence(equal);
        let first = stream();
        let job = job("bq-upsert-new-input", &d, "");
        let mut r = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
        run(&mut r, &first, 1, None);
        drop(r);
        // New input at the same positions: other names and values.
        let second: Vec<Vec<Change>> = first
            .iter()
            .map(|cp| {
                cp.iter()
                    .map(|c| Change {
                        name: c.name.as_ref().map(|n| format!("second-{n}")),
                        v: c.v.map(|v| v + 1),
                        ..c.clone()
                    })
                    .collect()
            })
            .collect();
        let mut again = open_beside(&job, Some(r#"["id"]"#)).expect("opens beside");
        run(&mut again, &second, 1, None);
        let both: Vec<Vec<Change>> = first.iter().chain(second.iter()).cloned().collect();
        assert_model(&d, &both);
        assert_ne!(model(&both), model(&first), "the second stream changes what the table holds");
    }
}

/// A run of `job` as another, later incarnation beside the first
/// (`--new-incarnation`: it neither takes nor checks the claim).
fn open_beside(job: &TestJob, key: Option<&str>) -> Result<Run, String> {
    // A later incarnation than `open`'s.
    let ctx = SinkCtx { refuse_other_incarnations: false, beside: true, ..ctx_of(job, "rrrrrrrrrrrr", 2_000_000) };
    open_as(job, ctx, key, None, None)
}

/// Lost replies, connections broken before a request, and in-band
/// failures: every change whose outcome is unknown is sent again, and the
/// table still ends in the model's state.
#[test]
fn lost_and_failed_appends_are_sent_again_harmlessly() {
    let d = double();
    d.inject(Rpc::Append, 2, BqFault::ApplyThenDropReply);
    d.inject(Rpc::Append, 4, BqFault::Unavailable);
    d.inject(Rpc::Append, 5, BqFault::FailBeforeApply);
    d.inject(Rpc::Append, 7, BqFault::ApplyThenDropReply);
    let changes = stream();
    let job = job("bq-upsert-lost", &d, "");
    let mut r = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
    run(&mut r, &changes, 1, None);
    assert_model(&d, &changes);
    assert!(d.stats().changes_received > CHECKPOINTS * PER_CHECKPOINT, "requests were sent again");
}

fn keyed_schema() -> TableSchema {
    TableSchema {
        fields: vec![
            column("id", Type::Int64, Mode::Required),
            column("name", Type::String, Mode::Nullable),
            column("v", Type::Int64, Mode::Nullable),
        ],
    }
}

#[test]
fn a_table_keyed_otherwise_or_not_at_all_is_refused_before_writing() {
    for (key, has) in [(vec!["name"], "has the primary key [name]"), (vec![], "has no primary key")] {
        let d = double();
        d.create_keyed_table(TABLE, keyed_schema(), &key, None);
        let job = job("bq-upsert-wrong-key", &d, "");
        let e = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).err().expect("refused");
        assert!(e.contains(TABLE) && e.contains(has) && e.contains("change key is [id]"), "{e}");
        assert!(e.contains("nothing was written"), "{e}");
        assert_eq!(d.visible_count(TABLE), 0);
        assert_eq!(d.stats().append_requests, 0, "nothing was sent");
        assert_eq!(d.primary_key(TABLE), Some(key.iter().map(|k| k.to_string()).collect()), "the table is as it was");
    }
}

#[test]
fn upsert_without_a_change_key_is_refused_naming_the_source_key() {
    let d = double();
    let job = job("bq-upsert-no-key", &d, "");
    let e = open(&job, "iiiiiiiiiiii", None, None, None).err().expect("refused");
    assert!(e.contains("mode = \"upsert\"") && e.contains("[source] key"), "{e}");
    assert!(d.tables().is_empty(), "no table was created: {:?}", d.tables());
    // An own key must equal the source's.
    let job = job_with_key(&d);
    let e = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).err().expect("refused");
    assert!(e.contains("[sink.options] key") && e.contains("[source] key"), "{e}");
}

fn job_with_key(d: &BigQueryDouble) -> TestJob {
    job("bq-upsert-own-key", d, "key = \"name\"\n")
}

/// An existing keyed table takes the changes, and keeps its rows of other keys.
#[test]
fn an_existing_keyed_table_takes_the_changes() {
    let d = double();
    d.create_keyed_table(TABLE, keyed_schema(), &["id"], Some("0-0 0 0:10:0"));
    let changes = stream();
    let job = job("bq-upsert-existing", &d, "key = \"id\"\n");
    let mut r = open(&job, "iiiiiiiiiiii", Some(r#"["id"]"#), None, None).expect("opens");
    run(&mut r, &changes, 1, None);
    assert_model(&d, &changes);
    assert_eq!(d.max_staleness(TABLE).as_deref(), Some("0-0 0 0:10:0"), "left as it was");
}

// End to end: the file source's change streams (`[source] change_column`,
// `key`) through the engine into the double, at parallelism 2.

/// A change-stream job over `in/*.jsonl` (`op` the change column, `id` the
/// key) into `TABLE`, in upsert mode, as an operator writes it.
fn file_job(id: &str, d: &BigQueryDouble, every_rows: u64) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = 2
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
batch_rows = 7
change_column = "op"
key = ["id"]
[sink]
id = "bq"
plugin = "{plugin}"
[sink.options]
table = "{TABLE}"
mode = "upsert"
key = "id"
max_staleness = "10m"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{grpc}"
[sink.http.bigquery]
address = "{rest}"
[sink.sandbox]
memory_mb = 512
"#,
        plugin = sluice_tests::BIGQUERY_PLUGIN,
        grpc = d.address(),
        rest = d.rest_address(),
    );
    TestJob { dir, toml }
}

/// One line of a file: `(op as the file spells it, id, v)`.
type Line = (&'static str, i64, i64);

/// `files` files of `lines` lines: updates of keys from earlier files,
/// deletes, re-inserts, every spelling of an operation.
fn file_stream(files: usize, lines: usize, keys: i64) -> Vec<Vec<Line>> {
    const UPSERTS: [&str; 8] = ["insert", "update", "c", "r", "u", "UPDATE", " u ", "Insert"];
    const DELETES: [&str; 3] = ["delete", "d", "D"];
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..files)
        .map(|_| {
            (0..lines)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let id = (state % keys as u64) as i64;
                    let v = (state >> 24) as i64 % 10_000;
                    if (state >> 16).is_multiple_of(4) {
                        (DELETES[(state >> 40) as usize % DELETES.len()], id, v)
                    } else {
                        (UPSERTS[(state >> 40) as usize % UPSERTS.len()], id, v)
                    }
                })
                .collect()
        })
        .collect()
}

fn write_files(job: &TestJob, files: &[Vec<Line>]) {
    for (n, lines) in files.iter().enumerate() {
        let text: String = lines
            .iter()
            .map(|(op, id, v)| {
                format!("{}\n", serde_json::json!({"op": op, "id": id, "name": format!("n{id}-{v}"), "v": v}))
            })
            .collect();
        std::fs::write(job.dir.path().join("in").join(format!("{n:03}.jsonl")), text).expect("jsonl");
    }
}

/// Every key in its last state, files in name order, lines in order.
fn file_model(files: &[Vec<Line>]) -> Model {
    let mut m = Model::new();
    for (op, id, v) in files.iter().flatten() {
        if matches!(op.trim().to_ascii_lowercase().as_str(), "delete" | "d") {
            m.remove(id);
        } else {
            m.insert(*id, (Some(format!("n{id}-{v}")), Some(*v)));
        }
    }
    m
}

fn assert_file_model(d: &BigQueryDouble, files: &[Vec<Line>]) {
    let want = file_model(files);
    let got = table_state(d);
    for id in want.keys().chain(got.keys()) {
        assert_eq!(got.get(id), want.get(id), "key {id}");
    }
}

#[test]
fn a_change_stream_from_files_lands_each_key_in_its_last_state() {
    let d = double();
    let files = file_stream(4, 40, 25);
    let job = file_job("bq-upsert-files", &d, 10);
    write_files(&job, &files);
    let summary = job.run(None).expect("run");
    assert_eq!(summary.rows_total, 160);
    assert_file_model(&d, &files);
    assert_eq!(d.primary_key(TABLE), Some(vec!["id".to_string()]));
    assert_eq!(d.max_staleness(TABLE).as_deref(), Some("0-0 0 0:10:0"));
    let schema = d.table_schema(TABLE).expect("table");
    let names: Vec<&str> = schema.fields.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["id", "name", "v"], "the change column and the reserved ones never land");
    assert_eq!(d.stats().changes_received, 160, "every change sent once");
    // Run again: nothing new to read, nothing changes.
    let before = d.keyed_rows(TABLE);
    job.run(None).expect("second run");
    assert_eq!(d.keyed_rows(TABLE), before);
}

/// The engine's crash points in a checkpoint that updates and deletes rows
/// of earlier ones, then a resume: every key ends in its last state.
#[test]
fn the_job_crashed_at_every_step_of_a_checkpoint_then_resumed_ends_in_the_models_state() {
    use sluice::engine::{CrashPoint, Fault};
    let files = file_stream(4, 30, 20);
    for point in [
        CrashPoint::AfterWrite,
        CrashPoint::AfterPrepareCommit,
        CrashPoint::AfterSnapshotState,
        CrashPoint::AfterPersist,
        CrashPoint::DuringCommit,
        CrashPoint::AfterCommit,
    ] {
        let d = double();
        let job = file_job(&format!("bq-upsert-crash-{point}"), &d, 12);
        write_files(&job, &files);
        let crashed = job.run(Some(Fault { point, checkpoint: 3, subtask: 1 }));
        // `during-commit` strikes after a commit's first gRPC call; an
        // upsert commit makes none (the changes were applied at write, the
        // claim is REST), so that point may pass without a crash.
        assert!(crashed.is_err() || point == CrashPoint::DuringCommit, "{point}: the run did not crash");
        job.run(None).unwrap_or_else(|e| panic!("{point}: resume: {e}"));
        assert_file_model(&d, &files);
    }
}

/// The real `sluice run` process SIGKILLed twice mid-run, then run to the
/// end: every key ends in its last state.
#[test]
fn the_job_killed_mid_run_then_rerun_ends_in_the_models_state() {
    let d = double();
    let files = file_stream(12, 1000, 500);
    let job = file_job("bq-upsert-sigkill", &d, 500);
    write_files(&job, &files);
    job.load(&[]).expect("valid job");
    let received = || d.stats().changes_received;
    sluice_tests::run_and_kill(&job, received, 1500);
    let first = received();
    sluice_tests::run_and_kill(&job, received, first + 3000);
    sluice_tests::rerun_to_end(&job, &[]);
    assert_file_model(&d, &files);
    assert!(d.stats().changes_received >= 12_000);
}
