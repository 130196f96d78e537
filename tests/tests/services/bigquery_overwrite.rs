//! The BigQuery sink with `mode = "overwrite-partitions"` against the test
//! double (real gRPC and REST over loopback): a day-partitioned target
//! seeded with rows, then a job whose rows replace the days they touch,
//! through the crash matrix, lost and failed copy jobs (a backend error, a
//! quota), and a rerun as a new incarnation; and what is refused: a lost
//! staging table, an incarnation a rerun overtook, a switch from append,
//! a date outside the partitioned range. Every check reads the target
//! back: rows per partition (`partition_counts`) and the rows' ids and
//! values against the source.

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Decimal128Type, Int32Type};
use arrow_array::{ArrayRef, Date32Array, Decimal128Array, Int64Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema};
use sluice::engine::{CrashPoint, Fault, Faults, RunOptions, Stop};
use sluice::source::generator::Generator;
use sluice_bigquery_double::{BigQueryDouble, JobFault, PartitionType, TimePartitioning, generator_schema};
use sluice_tests::{TestJob, assert_exactly_once_range, bigquery_rows};

/// 1800 rows over 30 days (the generator puts id `i` on 2024-01-01 + i % 30):
/// 60 a day. Per writer 600 rows in rounds of 150: checkpoints 1..=4 hold
/// rows, and every day is spread over all four.
const ROWS: u64 = 1800;
const PARALLELISM: u32 = 3;
const EVERY: u64 = 150;
const LAST: u64 = 4;
const TABLE: &str = "projects/p/datasets/d/tables/orders";
/// 2023-12-31, 2024-01-01 and 2024-01-02 as days since the epoch.
const D1: i32 = 19_722;
/// Seeded rows: ids from here, `SEED_PER_DAY` on each of D1, D1+1, D1+2.
const SEED_FIRST: u64 = 1_000_000;
const SEED_PER_DAY: u64 = 20;

fn double() -> BigQueryDouble {
    let d = BigQueryDouble::start().expect("starting the BigQuery double");
    d.create_partitioned_table(TABLE, generator_schema(), TimePartitioning::new(PartitionType::Day, "day"))
        .expect("a day-partitioned table");
    d.load_rows(TABLE, seed_rows()).expect("seeding the table");
    assert_eq!(
        d.partition_counts(TABLE).expect("counts"),
        BTreeMap::from([
            ("20231231".to_string(), SEED_PER_DAY),
            ("20240101".to_string(), SEED_PER_DAY),
            ("20240102".to_string(), SEED_PER_DAY)
        ])
    );
    d
}

/// Generator rows with ids `SEED_FIRST..`, moved onto D1..D3.
fn seed_rows() -> RecordBatch {
    let n = 3 * SEED_PER_DAY;
    let base = Generator::batch_for(SEED_FIRST, SEED_FIRST + n);
    let days: Vec<i32> = (0..n).map(|i| D1 + (i / SEED_PER_DAY) as i32).collect();
    let mut columns: Vec<ArrayRef> = base.columns().to_vec();
    columns[6] = Arc::new(Date32Array::from(days));
    // The table's `qty` is INT64, which takes Arrow Int64 only.
    let qty = columns[1].as_primitive::<Int32Type>().values().iter().map(|v| i64::from(*v));
    columns[1] = Arc::new(Int64Array::from_iter_values(qty));
    // NUMERIC is Decimal128(38, 9): the same amounts at scale 9.
    let amount = columns[3].as_primitive::<Decimal128Type>().values().iter().map(|v| v * 10_000_000);
    let amount = Decimal128Array::from_iter_values(amount).with_precision_and_scale(38, 9).expect("NUMERIC");
    columns[3] = Arc::new(amount);
    let mut fields: Vec<Field> = base.schema().fields().iter().map(|f| f.as_ref().clone()).collect();
    fields[1] = Field::new("qty", DataType::Int64, false);
    fields[3] = Field::new("amount", DataType::Decimal128(38, 9), false);
    RecordBatch::try_new(Arc::new(Schema::new(fields)), columns).expect("seed batch")
}

fn job(id: &str, d: &BigQueryDouble) -> TestJob {
    let mut job = TestJob::bigquery(id, &d.address(), TABLE, ROWS, PARALLELISM, EVERY);
    job.toml = job.toml.replacen("[sink.options]\n", "[sink.options]\nmode = \"overwrite-partitions\"\n", 1);
    job.toml.push_str(&format!("[sink.http.bigquery]\naddress = {:?}\n", d.rest_address()));
    job
}

/// The target holds D1's seeded rows untouched, and every day the job
/// touched holds exactly the job's rows of that day (ids and values).
fn assert_replaced(d: &BigQueryDouble) {
    let mut expected: BTreeMap<String, u64> = (0..30)
        .map(|k| {
            let day = 20240101 + k;
            (day.to_string(), ROWS / 30)
        })
        .collect();
    expected.insert("20231231".to_string(), SEED_PER_DAY);
    assert_eq!(d.partition_counts(TABLE).expect("counts"), expected, "rows per day");
    let rows = d.visible_rows(TABLE);
    let id = |r: &serde_json::Map<String, serde_json::Value>| r.get("id").and_then(|v| v.as_i64()).expect("id");
    let (seeded, landed): (Vec<_>, Vec<_>) = rows.into_iter().partition(|r| id(r) >= SEED_FIRST as i64);
    // What is left of the seed is D1's rows, exactly (the first SEED_PER_DAY ids).
    let mut seeded: Vec<i64> = seeded.iter().map(id).collect();
    seeded.sort();
    let want: Vec<i64> = (SEED_FIRST as i64..(SEED_FIRST + SEED_PER_DAY) as i64).collect();
    assert_eq!(seeded, want, "D1 keeps its seeded rows; D2 and D3 lost theirs");
    // The job's rows, once each, with the source's values.
    assert_exactly_once_range(&bigquery_rows(&landed), 0, ROWS);
}

/// Every copy job the double ran, by id.
fn job_ids(d: &BigQueryDouble) -> Vec<String> {
    d.jobs().into_iter().map(|j| j.id).collect()
}

#[test]
fn overwrite_replaces_the_touched_days_and_keeps_the_others() {
    let d = double();
    let summary = job("bq-ow", &d).run(None).expect("run");
    assert_eq!(summary.rows_total, ROWS);
    assert_replaced(&d);
    // One copy job per day per checkpoint, each its first attempt, each applied.
    let ids = job_ids(&d);
    assert_eq!(ids.len(), 30 * LAST as usize, "{ids:?}");
    assert!(ids.iter().all(|id| id.starts_with("sluice_") && id.ends_with("_0")), "{ids:?}");
    assert!(d.jobs().iter().all(|j| j.error.is_none()));
    assert_eq!(d.rest_calls("jobs.insert"), 30 * LAST);
    // Each day was spread over every checkpoint: its first copy replaced the
    // seeded rows, the later ones added (the staging partition is cumulative).
    let day1 = |j: &sluice_bigquery_double::Job| {
        j.configuration.pointer("/copy/destinationTable/tableId").and_then(|v| v.as_str()) == Some("orders$20240101")
    };
    assert_eq!(d.jobs().iter().filter(|j| day1(j)).count(), LAST as usize);
    // Staged, not streamed into the target.
    let streams: Vec<String> = d.streams(TABLE).into_iter().filter(|s| !s.ends_with("/_default")).collect();
    assert!(streams.is_empty(), "no stream was opened on the target: {streams:?}");
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let d = double();
    let job = job(&format!("bq-ow-{point}-{checkpoint}"), &d);
    let fault = Fault { point, checkpoint, subtask: 1 };
    job.run(Some(fault)).expect_err("crash");
    let summary = job.run(None).expect("recovery");
    let recovered: Vec<u64> = summary.recovered.iter().map(|(c, _)| *c).collect();
    assert_eq!(recovered, vec![checkpoint], "recovery commits the pending checkpoint again");
    assert_replaced(&d);
    // A job asked again is found by its id: never two jobs for one (checkpoint, day).
    assert_eq!(job_ids(&d).len(), 30 * LAST as usize);
}

sluice_tests::crash_tests! {
    crash_after_persist_middle: CrashPoint::AfterPersist, 2;
    crash_after_persist_last: CrashPoint::AfterPersist, LAST;
    crash_during_commit_middle: CrashPoint::DuringCommit, 2;
    crash_during_commit_last: CrashPoint::DuringCommit, LAST;
    crash_after_commit_middle: CrashPoint::AfterCommit, 2;
    crash_after_commit_last: CrashPoint::AfterCommit, LAST;
}

/// A copy job applied whose insert reply was lost is found again by its
/// id (409, then jobs.get), not inserted under another.
#[test]
fn a_lost_copy_job_reply_is_settled_by_its_id_and_applies_once() {
    let d = double();
    d.inject_job(5, JobFault::ApplyThenDropReply);
    d.inject_job(40, JobFault::FailBeforeApply);
    job("bq-ow-lost", &d).run_with(&["job.commit.initial_backoff_ms=1"], None).expect("run");
    assert_replaced(&d);
    let ids = job_ids(&d);
    assert_eq!(ids.len(), 30 * LAST as usize, "{ids:?}");
    assert!(ids.iter().all(|id| id.ends_with("_0")), "{ids:?}");
    // The lost reply was settled by jobs.get alone (the job existed); the
    // insert refused before applying was found missing by jobs.get and
    // sent again under the same id.
    assert_eq!(d.rest_calls("jobs.insert"), 30 * LAST + 1);
    assert!(d.rest_calls("jobs.get") >= 2);
}

/// A copy job that ended with a transient `errorResult` applied nothing;
/// the same partition is copied by the next attempt, `_1`.
#[test]
fn a_copy_job_done_with_backend_error_continues_with_the_next_attempt() {
    let d = double();
    d.inject_job(3, JobFault::DoneWithBackendError);
    d.inject_job(50, JobFault::RunningFor(2));
    job("bq-ow-backend", &d).run(None).expect("run");
    assert_replaced(&d);
    let jobs = d.jobs();
    let failed: Vec<_> = jobs.iter().filter(|j| j.error.is_some()).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].error.as_ref().map(|e| e.reason.as_str()), Some("backendError"));
    let retried = failed[0].id.strip_suffix("_0").expect("the first attempt failed").to_string() + "_1";
    assert!(jobs.iter().any(|j| j.id == retried && j.error.is_none()), "{retried} ran: {:?}", job_ids(&d));
    assert_eq!(jobs.len(), 30 * LAST as usize + 1);
}

/// A rerun of the same backfill as a new incarnation (fresh state
/// directory) replaces the same days again and leaves the same table.
#[test]
fn a_rerun_as_a_new_incarnation_leaves_the_same_table() {
    let d = double();
    let job = job("bq-ow-rerun", &d);
    job.run(None).expect("first run");
    assert_replaced(&d);
    let before = d.visible_rows(TABLE).len();
    std::fs::remove_dir_all(job.state()).expect("a fresh state directory");
    let summary = job.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert!(summary.new_incarnation);
    assert_replaced(&d);
    assert_eq!(d.visible_rows(TABLE).len(), before);
    // Each run copied from its own staging table.
    let sources: std::collections::BTreeSet<String> = d
        .jobs()
        .iter()
        .filter_map(|j| j.configuration.pointer("/copy/sourceTable/tableId").and_then(|v| v.as_str()))
        .filter_map(|t| t.split_once('$').map(|(t, _)| t.to_string()))
        .collect();
    assert_eq!(sources.len(), 2, "{sources:?}");
}

/// A target that is not partitioned by a column is refused before any
/// row is written, naming the table and the option.
#[test]
fn an_unpartitioned_target_is_refused_before_writing() {
    let d = BigQueryDouble::start().expect("starting the BigQuery double");
    d.create_table(TABLE, generator_schema());
    let err = job("bq-ow-flat", &d).run(None).expect_err("refused").to_string();
    for part in [TABLE, "overwrite-partitions", "not time-partitioned"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert_eq!(d.stats().rows_appended, 0);
    assert_eq!(d.stats().streams_created, 0);
    assert!(d.jobs().is_empty());
}

/// With dead letters on, the dead-letter table (not partitioned, named to
/// the plugin by the reserved option `sluice.dead-letter-table`) is left
/// append: it is not refused for lacking partitions, and gets no staging
/// table and no copy job.
///
/// (Rows the service rejects cannot be shown here to replace no day: the
/// double's tables.get/insert do not carry a column's `maxLength`, its
/// only per-row rejection, so the staging table takes them.)
#[test]
fn the_dead_letter_table_stays_append() {
    use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
    use sluice_bigquery_double::proto::{TableFieldSchema, TableSchema};
    let d = BigQueryDouble::start().expect("double");
    let field = |name: &str, ty: Type, max_length: i64| TableFieldSchema {
        name: name.into(),
        r#type: ty as i32,
        mode: Mode::Nullable as i32,
        max_length,
        ..Default::default()
    };
    let orders = "projects/p/datasets/d/tables/orders";
    let letters = "projects/p/datasets/d/tables/dead_letters";
    let schema = TableSchema {
        fields: vec![field("id", Type::Int64, 0), field("name", Type::String, 9), field("day", Type::Date, 0)],
    };
    d.create_partitioned_table(orders, schema, TimePartitioning::new(PartitionType::Day, "day")).expect("orders");
    // Seeded: one row on each of 2024-01-01, -02 and -03.
    let seed_schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("day", DataType::Date32, true),
    ]));
    let seed = RecordBatch::try_new(
        seed_schema,
        vec![
            Arc::new(Int64Array::from(vec![9001, 9002, 9003])),
            Arc::new(arrow_array::StringArray::from(vec!["seed", "seed", "seed"])),
            Arc::new(Date32Array::from(vec![19_723, 19_724, 19_725])),
        ],
    )
    .expect("seed");
    d.load_rows(orders, seed).expect("seeding");
    let text = |n: &str| field(n, Type::String, 0);
    d.create_table(
        letters,
        TableSchema {
            fields: vec![
                text("raw"),
                text("source_position"),
                text("reason"),
                text("target_table"),
                text("job"),
                text("incarnation"),
                field("checkpoint", Type::Int64, 0),
            ],
        },
    );
    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("in/orders");
    std::fs::create_dir_all(&input).expect("input");
    let csv: String = std::iter::once("id,name,day\n".to_string())
        .chain((0..60u64).map(|id| format!("{id},ok,2024-01-01\n")))
        .collect();
    std::fs::write(input.join("part-0.csv"), csv).expect("csv");
    let toml = format!(
        r#"[job]
id = "bq-ow-dl"
parallelism = 1
state_dir = "state"
bad_rows = "dead-letter"
[job.checkpoint]
every_rows = 20
[job.dead_letter]
table = "dead_letters"
[source]
kind = "file"
path = "in"
batch_rows = 10
[sink]
id = "bq"
plugin = "{plugin}"
[sink.options]
table = "projects/p/datasets/d/tables/{{table}}"
mode = "overwrite-partitions"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{address}"
[sink.http.bigquery]
address = {rest:?}
[sink.sandbox]
memory_mb = 512
"#,
        plugin = sluice_tests::BIGQUERY_PLUGIN,
        address = d.address(),
        rest = d.rest_address(),
    );
    let job = TestJob { dir, toml };
    let summary = job.run(None).expect("the dead-letter table is not refused");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 0)), "{summary}");
    assert_eq!(
        d.partition_counts(orders).expect("counts"),
        BTreeMap::from([("20240101".to_string(), 60), ("20240102".to_string(), 1), ("20240103".to_string(), 1)]),
        "2024-01-01 replaced by the job's rows; -02 and -03 kept"
    );
    let id = |r: &serde_json::Map<String, serde_json::Value>| {
        r.get("id").and_then(|v| v.as_i64().or_else(|| v.as_str()?.parse().ok())).expect("id")
    };
    let mut ids: Vec<i64> = d.visible_rows(orders).iter().map(id).collect();
    ids.sort_unstable();
    let mut want: Vec<i64> = (0..60).collect();
    want.extend([9002, 9003]);
    assert_eq!(ids, want);
    assert!(d.jobs().iter().all(|j| {
        j.configuration.pointer("/copy/destinationTable/tableId").and_then(|v| v.as_str()) == Some("orders$20240101")
    }));
}

/// A schema change halfway (a widened `qty`, a new nullable `tag`) evolves
/// the target and the staging table alike, so later copies still fit; the
/// days end exact.
#[test]
fn a_schema_change_evolves_the_target_and_its_staging_table() {
    let d = double();
    let job = job("bq-ow-evolve", &d);
    job.run_with(&[&format!("source.evolve_at={}", ROWS / 2)], None).expect("run");
    assert_replaced(&d);
    let stage = d
        .jobs()
        .iter()
        .filter_map(|j| j.configuration.pointer("/copy/sourceTable/tableId").and_then(|v| v.as_str()))
        .filter_map(|t| t.split_once('$').map(|(t, _)| format!("projects/p/datasets/d/tables/{t}")))
        .next()
        .expect("a copy job");
    for table in [TABLE, stage.as_str()] {
        let schema = d.table_schema(table).unwrap_or_else(|| panic!("{table} exists"));
        assert!(schema.fields.iter().any(|f| f.name == "tag"), "{table} took `tag`: {schema:?}");
    }
    // The rows after the change carry `tag` in the target.
    let tagged = d.visible_rows(TABLE).iter().filter(|r| r.get("tag").is_some_and(|v| !v.is_null())).count();
    assert!(tagged > 0, "no row of the new shape landed");
}

/// The staging table of the target (the one `_sluice_stage_` table).
fn staging_table(d: &BigQueryDouble) -> String {
    let stages: Vec<String> = d.tables().into_iter().filter(|t| t.contains("/tables/_sluice_stage_")).collect();
    assert_eq!(stages.len(), 1, "{stages:?}");
    stages[0].clone()
}

/// Stops a run right after checkpoint 2 is committed: days hold the rows
/// of checkpoints 1 and 2.
fn crash_after_second(job: &TestJob) {
    let fault = Fault { point: CrashPoint::AfterCommit, checkpoint: 2, subtask: 1 };
    job.run(Some(fault)).expect_err("crash");
}

/// A staging table that expired (or was deleted) between two runs of one
/// incarnation is not made again empty: the next copies would truncate
/// each day to the rows staged since. The first run lands checkpoints 1
/// and 2 and crashes; a second run recovers checkpoint 2 and stops cleanly,
/// so the third has no pending checkpoint (whose lost stream would fail it
/// anyway). The third is refused naming the staging table, the target and
/// the way out, and copies nothing; a rerun as a new incarnation then
/// leaves the table exact.
#[test]
fn a_lost_staging_table_is_refused_not_made_again_empty() {
    let d = double();
    let job = job("bq-ow-lost-stage", &d);
    crash_after_second(&job);
    let stop = Stop::default();
    stop.request();
    let summary = job.run_opts(&[], RunOptions { stop, ..RunOptions::default() }).expect("a clean stop");
    assert!(summary.stopped.is_some(), "{summary}");
    assert!(d.visible_rows(TABLE).iter().any(|r| r.get("id").and_then(|v| v.as_i64()) < Some(SEED_FIRST as i64)));
    let stage = staging_table(&d);
    let before = d.partition_counts(TABLE).expect("counts");
    let jobs_before = d.jobs().len();
    assert!(d.delete_table(&stage), "the staging table existed");
    let err = job.run(None).expect_err("the resume is refused").to_string();
    for part in [stage.as_str(), TABLE, "is gone", "--new-incarnation"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert!(d.time_partitioning(&stage).is_none() && !d.tables().contains(&stage), "not made again");
    assert_eq!(d.partition_counts(TABLE).expect("counts"), before, "the refused run changed the target");
    assert_eq!(d.jobs().len(), jobs_before, "the refused run copied nothing");
    // The way out the error names: land it again as a new incarnation.
    std::fs::remove_dir_all(job.state()).expect("a fresh state directory");
    job.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert_replaced(&d);
}

/// Every run of an incarnation pushes its staging table's expiration
/// forward, so a long backfill's staging table does not expire under it.
#[test]
fn resuming_pushes_the_staging_tables_expiration_forward() {
    let d = double();
    let job = job("bq-ow-expiry", &d);
    crash_after_second(&job);
    let stage = staging_table(&d);
    let first = d.expiration_time(&stage).expect("the staging table expires");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64;
    assert!(first > now + 7 * 24 * 3600 * 1000, "{first} is days ahead of {now}");
    std::thread::sleep(std::time::Duration::from_millis(20));
    job.run(None).expect("recovery");
    let second = d.expiration_time(&stage).expect("still expires");
    assert!(second > first, "the resume moved the expiration: {first} → {second}");
    assert_replaced(&d);
}

/// An old incarnation resumed after a rerun (a newer incarnation overwrote
/// the same target) copies nothing: its staging holds part of the backfill
/// only, and would replace the rerun's days. It is refused naming the
/// target, the newer incarnation and the way out; the rerun's table stays.
#[test]
fn an_older_incarnation_resumed_after_a_rerun_copies_nothing() {
    let d = double();
    let old = job("bq-ow-overtaken", &d);
    crash_after_second(&old);
    // The rerun: same job, a fresh state directory, a new incarnation.
    let rerun = job("bq-ow-overtaken", &d);
    rerun.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert_replaced(&d);
    let rows = d.visible_rows(TABLE);
    let jobs_before = d.jobs().len();
    let err = old.run(None).expect_err("the old incarnation is refused").to_string();
    for part in [TABLE, "began to overwrite", "after this incarnation", "--new-incarnation"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert_eq!(d.jobs().len(), jobs_before, "the old incarnation copied nothing");
    assert_eq!(d.visible_rows(TABLE), rows, "the rerun's table is unchanged");
    assert_replaced(&d);
}

/// An incarnation that landed checkpoints in append mode and is resumed
/// with `mode = "overwrite-partitions"` is refused (its first copy would
/// delete rows it delivered), naming the way out; finished in append mode
/// every row is there once.
#[test]
fn switching_an_incarnation_from_append_to_overwrite_is_refused() {
    let d = double();
    let mut append = job("bq-switch", &d);
    append.toml = append.toml.replacen("mode = \"overwrite-partitions\"\n", "", 1);
    crash_after_second(&append);
    let before = d.partition_counts(TABLE).expect("counts");
    let err = append
        .run_with(&["sink.options.mode=overwrite-partitions"], None)
        .expect_err("the switch to overwrite is refused")
        .to_string();
    for part in ["already landed checkpoints", TABLE, "--new-incarnation"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert_eq!(d.partition_counts(TABLE).expect("counts"), before, "the refused run changed the table");
    assert!(d.jobs().is_empty(), "nothing was copied");
    append.run(None).expect("the append run resumes");
    let total: u64 = d.partition_counts(TABLE).expect("counts").values().sum();
    assert_eq!(total, ROWS + 3 * SEED_PER_DAY, "every row once, the seed kept");
}

/// A row dated outside the range BigQuery partitions (before 1960-01-01)
/// would land in `__UNPARTITIONED__`, which no copy replaces: it is refused
/// before it is written, naming the column and the value, and nothing is
/// copied.
#[test]
fn a_date_outside_the_partitioned_range_is_refused_naming_it() {
    use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
    use sluice_bigquery_double::proto::{TableFieldSchema, TableSchema};
    let d = BigQueryDouble::start().expect("double");
    let field = |name: &str, ty: Type| TableFieldSchema {
        name: name.into(),
        r#type: ty as i32,
        mode: Mode::Nullable as i32,
        ..Default::default()
    };
    let orders = "projects/p/datasets/d/tables/orders";
    let schema = TableSchema { fields: vec![field("id", Type::Int64), field("day", Type::Date)] };
    d.create_partitioned_table(orders, schema, TimePartitioning::new(PartitionType::Day, "day")).expect("orders");
    let dir = tempfile::tempdir().expect("dir");
    let input = dir.path().join("in/orders");
    std::fs::create_dir_all(&input).expect("input");
    std::fs::write(input.join("part-0.csv"), "id,day\n1,2024-01-01\n2,1959-12-31\n3,2024-01-02\n").expect("csv");
    let toml = format!(
        r#"[job]
id = "bq-ow-range"
parallelism = 1
state_dir = "state"
[source]
kind = "file"
path = "in"
[sink]
id = "bq"
plugin = "{plugin}"
[sink.options]
table = "projects/p/datasets/d/tables/{{table}}"
mode = "overwrite-partitions"
rpc_timeout_ms = 10000
backoff_ms = 10
[sink.grpc.bigquery]
address = "{address}"
[sink.http.bigquery]
address = {rest:?}
"#,
        plugin = sluice_tests::BIGQUERY_PLUGIN,
        address = d.address(),
        rest = d.rest_address(),
    );
    let job = TestJob { dir, toml };
    let err = job.run(None).expect_err("the row is refused").to_string();
    // Named with the contract's row phrase, so the host names file and line
    // (the header is line 1, the refused row line 3).
    for part in [
        "\"day\"",
        "1959-12-31",
        "__UNPARTITIONED__",
        "row 1 of this writer's input for table \"orders\"",
        "part-0.csv",
        "line 3",
    ] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert!(d.jobs().is_empty(), "nothing was copied: {:?}", job_ids(&d));
    assert!(d.visible_rows(orders).is_empty());
    // With dead letters on, the row becomes a dead letter and the others land.
    let text = |name: &str| field(name, Type::String);
    d.create_table(
        "projects/p/datasets/d/tables/dead_letters",
        TableSchema {
            fields: vec![
                text("raw"),
                text("source_position"),
                text("reason"),
                text("target_table"),
                text("job"),
                text("incarnation"),
                field("checkpoint", Type::Int64),
            ],
        },
    );
    let toml = job.toml.replacen("state_dir = \"state\"\n", "state_dir = \"state2\"\nbad_rows = \"dead-letter\"\n", 1)
        + "[job.dead_letter]\ntable = \"dead_letters\"\n";
    let lettered = TestJob { dir: job.dir, toml };
    let summary = lettered.run(None).expect("the row is a dead letter");
    assert_eq!(summary.dead_letters, Some(("dead_letters".to_string(), 1)), "{summary}");
    assert_eq!(
        d.partition_counts(orders).expect("counts"),
        BTreeMap::from([("20240101".to_string(), 1), ("20240102".to_string(), 1)])
    );
}

/// A copy job that ends with `quotaExceeded` (a per-table job quota)
/// applied nothing: after a wait the partition is copied by the next
/// attempt, `_1`, and the run ends exact instead of failing mid-commit.
#[test]
fn a_copy_job_done_with_quota_exceeded_waits_and_continues() {
    let d = double();
    d.inject_job(4, JobFault::DoneWithError("quotaExceeded"));
    job("bq-ow-quota", &d).run(None).expect("run");
    assert_replaced(&d);
    let jobs = d.jobs();
    let failed: Vec<_> = jobs.iter().filter(|j| j.error.is_some()).collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].error.as_ref().map(|e| e.reason.as_str()), Some("quotaExceeded"));
    let retried = failed[0].id.strip_suffix("_0").expect("the first attempt failed").to_string() + "_1";
    assert!(jobs.iter().any(|j| j.id == retried && j.error.is_none()), "{retried} ran: {:?}", job_ids(&d));
}

/// The one overwrite marker table of generation 0 of the target.
fn marker_0(d: &BigQueryDouble) -> String {
    let markers: Vec<String> = d.tables().into_iter().filter(|t| t.contains("/tables/_sluice_overwrite_")).collect();
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert!(markers[0].ends_with("_0"), "{markers:?}");
    markers[0].clone()
}

/// A rerun that takes the target over deletes the older incarnation's
/// staging table, so a copy the older one still makes fails with
/// `notFound` instead of landing its partial days over the rerun's.
#[test]
fn a_rerun_deletes_the_older_incarnations_staging_table() {
    let d = double();
    let old = job("bq-ow-supersede", &d);
    crash_after_second(&old);
    let old_stage = staging_table(&d);
    let rerun = job("bq-ow-supersede", &d);
    rerun.run_opts(&[], RunOptions { new_incarnation: true, ..RunOptions::default() }).expect("the rerun");
    assert_replaced(&d);
    let stages: Vec<String> = d.tables().into_iter().filter(|t| t.contains("/tables/_sluice_stage_")).collect();
    assert_eq!(stages.len(), 1, "only the rerun's staging table is left: {stages:?}");
    assert_ne!(stages[0], old_stage, "the older incarnation's staging table was deleted");
    assert_eq!(d.rest_calls("tables.delete"), 1);
    // The old incarnation, resumed, is refused as overtaken (not as a lost staging table).
    let err = old.run(None).expect_err("the old incarnation is refused").to_string();
    assert!(err.contains("began to overwrite") && !err.contains("is gone"), "{err}");
    assert_replaced(&d);
}

/// A rerun stopped before its first commit copied nothing, so it takes no
/// overwrite marker: the incarnation it would have replaced still finishes.
#[test]
fn a_rerun_stopped_before_copying_supersedes_no_one() {
    let d = double();
    let old = job("bq-ow-early-stop", &d);
    crash_after_second(&old);
    let rerun = job("bq-ow-early-stop", &d);
    let fault = Fault { point: CrashPoint::AfterWrite, checkpoint: 1, subtask: 0 };
    rerun
        .run_opts(
            &[],
            RunOptions {
                new_incarnation: true,
                faults: Faults { crash: Some(fault), ..Faults::default() },
                ..RunOptions::default()
            },
        )
        .expect_err("the rerun crashes before its first commit");
    assert!(!d.tables().iter().any(|t| t.contains("/tables/_sluice_overwrite_") && t.ends_with("_1")));
    old.run(None).expect("the first incarnation finishes");
    assert_replaced(&d);
}

/// A newer incarnation that takes the target over while an older one's
/// copy job runs (it checked the marker before) deletes the older staging
/// table: the copy fails with `notFound`, applies nothing, and the older
/// incarnation fails loudly naming the partitions, the table and the newer
/// incarnation; the target's day keeps its rows.
#[test]
fn an_overtake_while_copying_fails_the_copy_and_names_the_partitions() {
    let d = double();
    d.inject_job(1, JobFault::RunningFor(40));
    let old = job("bq-ow-race", &d);
    let before = d.partition_counts(TABLE).expect("counts");
    let newer = "the-newer-incarnation";
    let err = std::thread::scope(|scope| {
        let d2 = &d;
        let rival = scope.spawn(move || {
            // Wait for the first copy job to run, then act as a rerun that
            // takes generation 1 and deletes the older staging table.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
            while !d2.jobs().iter().any(|j| j.state == sluice_bigquery_double::JobState::Running) {
                assert!(std::time::Instant::now() < deadline, "no copy job ran");
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            let marker = marker_0(d2);
            let g1 = format!("{}_1", marker.strip_suffix("_0").expect("_0"));
            assert!(d2.create_labelled_table(&g1, &[("sluice-incarnation", newer)]));
            assert!(d2.delete_table(&staging_table(d2)));
        });
        let err = old.run(None).expect_err("the overtaken copy fails").to_string();
        rival.join().expect("the rival");
        err
    });
    for part in [TABLE, newer, "20240101", "took the table over", "--new-incarnation"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    let jobs = d.jobs();
    assert_eq!(jobs.len(), 1, "no copy after the overtaken one: {:?}", job_ids(&d));
    assert_eq!(jobs[0].error.as_ref().map(|e| e.reason.as_str()), Some("notFound"), "{:?}", jobs[0]);
    assert_eq!(d.partition_counts(TABLE).expect("counts"), before, "the failed copy applied nothing");
}

/// An incarnation that staged rows in overwrite mode is refused when it is
/// resumed with `mode = "append"`: its copies replaced days, and appending
/// now would add rows beside them.
#[test]
fn switching_an_incarnation_from_overwrite_to_append_is_refused() {
    let d = double();
    let job = job("bq-ow-to-append", &d);
    crash_after_second(&job);
    // A clean stop settles the pending checkpoint, so only the state tells.
    let stop = Stop::default();
    stop.request();
    job.run_opts(&[], RunOptions { stop, ..RunOptions::default() }).expect("a clean stop");
    let before = d.partition_counts(TABLE).expect("counts");
    let err = job.run_with(&["sink.options.mode=append"], None).expect_err("the switch is refused").to_string();
    for part in ["mode = \"append\"", "overwrite-partitions", TABLE, "--new-incarnation"] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert_eq!(d.partition_counts(TABLE).expect("counts"), before, "the refused run changed the table");
    job.run(None).expect("finished in overwrite mode");
    assert_replaced(&d);
}

/// A dataset whose default partition expiration is a day (and default
/// table expiration an hour) does not reach the tables the sink makes: the
/// staging table keeps every partition from 1960 on past the run (else a
/// staged 2024 day would be gone at once and its copy would truncate the
/// target's day), and the overwrite marker lives for years, not an hour.
#[test]
fn dataset_default_expirations_do_not_apply_to_staging_or_markers() {
    let d = double();
    d.set_dataset(
        "projects/p/datasets/d",
        sluice_bigquery_double::Dataset {
            location: "US".into(),
            default_table_expiration_ms: Some(3_600_000),
            default_partition_expiration_ms: Some(86_400_000),
        },
    );
    job("bq-ow-defaults", &d).run(None).expect("run");
    assert_replaced(&d);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis() as i64;
    let stage = staging_table(&d);
    let kept = d.time_partitioning(&stage).and_then(|tp| tp.expiration_ms).expect("an explicit expirationMs");
    // 1960-01-01 is -315619200000 ms; its partition must outlive the run by far.
    assert!(-315_619_200_000 + kept > now + 365 * 24 * 3600 * 1000, "partitions expire after {kept} ms");
    let marker = marker_0(&d);
    let expires = d.expiration_time(&marker).expect("the marker expires explicitly");
    assert!(expires > now + 5 * 365 * 24 * 3600 * 1000, "the marker expires at {expires}, now {now}");
}

/// In a dataset in a single region, a copy job whose insert reply was lost
/// is found again: every job names the dataset's location and every
/// `jobs.get` passes it (without it the job is not found, and the commit
/// could never settle).
#[test]
fn a_lost_copy_job_reply_in_a_single_region_is_settled_by_its_location() {
    let d = double();
    d.set_dataset(
        "projects/p/datasets/d",
        sluice_bigquery_double::Dataset { location: "europe-west1".into(), ..Default::default() },
    );
    d.inject_job(3, JobFault::ApplyThenDropReply);
    job("bq-ow-region", &d).run(None).expect("run");
    assert_replaced(&d);
    let jobs = d.jobs();
    assert_eq!(jobs.len(), 30 * LAST as usize, "one job per day per checkpoint: {:?}", job_ids(&d));
    assert!(
        jobs.iter().all(|j| j.location == "europe-west1"),
        "{:?}",
        jobs.iter().map(|j| &j.location).collect::<Vec<_>>()
    );
}

/// The overwrite markers are found by listing the dataset, and a gap in
/// their generations (one expired or was deleted) is refused before
/// anything is copied, naming the missing marker: walking 0, 1, ... would
/// stop at the gap and miss the newer incarnation beyond it.
#[test]
fn a_gap_in_the_overwrite_markers_is_refused() {
    let d = double();
    let old = job("bq-ow-gap", &d);
    crash_after_second(&old);
    let marker = marker_0(&d);
    let stem = marker.strip_suffix("_0").expect("_0").to_string();
    // Generation 2 by a newer incarnation, generation 1 gone.
    assert!(d.create_labelled_table(&format!("{stem}_2"), &[("sluice-incarnation", "a-newer-one")]));
    let before = d.partition_counts(TABLE).expect("counts");
    let jobs_before = d.jobs().len();
    let err = old.run(None).expect_err("the gap is refused").to_string();
    for part in [format!("{stem}_1").as_str(), "is missing", TABLE] {
        assert!(err.contains(part), "{part:?} in {err}");
    }
    assert_eq!(d.jobs().len(), jobs_before, "nothing was copied");
    assert_eq!(d.partition_counts(TABLE).expect("counts"), before);
    assert!(d.rest_calls("tables.list") > 0);
}
