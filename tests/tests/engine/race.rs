//! Two (here three) fresh runs of one job started at once: each opens its
//! own new state directory, so each starts a new incarnation and none finds
//! another's checkpoints when it opens. The target's claim, taken in an
//! atomic step of the target, lets exactly one of them land; the others
//! stop before any of their rows is visible, naming the holder. Runs are
//! real `sluice` processes, against each sink: files, Iceberg on SQLite and
//! on the REST catalog double, and the BigQuery double.

use std::path::Path;
use std::process::{Output, Stdio};

use sluice::bindings::CommitOutcome;
use sluice::engine;
use sluice::plugin::{CommitterInstance, SinkCtx, SourceTable, WriterInstance};
use sluice::source::generator::Generator;
use sluice_bigquery_double::{BigQueryDouble, generator_schema};
use sluice_tests::rest_catalog::RestCatalogDouble;
use sluice_tests::{
    TestJob, assert_exactly_once_range, bigquery_rows, host, read_iceberg, read_iceberg_rest, read_visible, sluice_run,
};

const ROWS: u64 = 6000;
const PARALLELISM: u32 = 2;
const EVERY: u64 = 500;
/// Rows per second over all subtasks: the runs overlap for about a second,
/// so every one of them has opened before the first commit.
const RATE: &str = "source.rate=6000";
const RUNS: usize = 3;

/// The incarnation id kept in a state directory, if it has one.
fn incarnation(state_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(state_dir.join("incarnation")).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    value["id"].as_str().map(str::to_string)
}

/// Starts `RUNS` runs of `job` at once, each in its own fresh state
/// directory `race-<n>`, and waits for all of them.
fn race(job: &TestJob, extra: &[String]) -> Vec<Output> {
    std::fs::write(job.path(), &job.toml).expect("writing the job file");
    let children: Vec<_> = (0..RUNS)
        .map(|n| {
            let mut sets = vec![RATE.to_string(), format!("job.state_dir=race-{n}")];
            sets.extend_from_slice(extra);
            sluice_run(job, &sets).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("starting sluice")
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().expect("reaping sluice")).collect()
}

/// Exactly one run succeeded; every other one failed with a refusal naming
/// the winner's incarnation. Returns the winner's incarnation.
fn one_winner(job: &TestJob, outputs: &[Output]) -> String {
    let text = |o: &Output| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    let winners: Vec<usize> = (0..outputs.len()).filter(|&n| outputs[n].status.success()).collect();
    let all: Vec<String> = outputs.iter().map(text).collect();
    assert_eq!(winners.len(), 1, "exactly one of the runs lands:\n{}", all.join("\n----\n"));
    let winner = winners[0];
    let holder = incarnation(&job.dir.path().join(format!("race-{winner}"))).expect("the winner has an incarnation");
    for (n, out) in all.iter().enumerate().filter(|(n, _)| *n != winner) {
        assert_eq!(outputs[n].status.code(), Some(1), "run {n}: {out}");
        let claimed = out.contains(&format!("is claimed by incarnation {holder}"));
        let found = out.contains("already holds committed checkpoints") && out.contains(&holder);
        assert!(claimed || found, "run {n} names the incarnation holding the target ({holder}):\n{out}");
        assert!(
            out.contains("--new-incarnation") && out.contains("job.state_dir"),
            "run {n} says how to go on:\n{out}"
        );
        assert!(!out.contains("rows in total"), "run {n} reports nothing delivered:\n{out}");
    }
    holder
}

#[test]
fn files_three_fresh_runs_at_once_land_the_source_once() {
    let job = TestJob::files("race-files", ROWS, PARALLELISM, EVERY);
    let outputs = race(&job, &[]);
    let holder = one_winner(&job, &outputs);
    assert_exactly_once_range(&read_visible(&job.out()), 0, ROWS);
    for entry in std::fs::read_dir(job.out()).expect("output").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("_sluice_claim") {
            continue;
        }
        assert!(name.contains(&holder), "only the holder's checkpoints are visible, found {name}");
    }
    let claim = std::fs::read_to_string(job.out().join("_sluice_claim.race-files.out.json")).expect("the claim file");
    assert!(claim.contains(&holder), "the claim names the holder: {claim}");
    // A later fresh run is refused; `sluice check` refuses a loser's state directory as `run` does.
    let (code, _, err) = sluice_tests::run_cli(
        &["run", "job.toml", "--progress", "quiet", "--set", "job.state_dir=race-late"],
        job.dir.path(),
    );
    assert_eq!(code, 1, "{err}");
    let loser = (0..RUNS).find(|&n| !outputs[n].status.success()).expect("a loser");
    let (code, out, err) =
        sluice_tests::run_cli(&["check", "job.toml", "--set", &format!("job.state_dir=race-{loser}")], job.dir.path());
    assert_ne!(code, 0, "{out}{err}");
    assert!(format!("{out}{err}").contains(&format!("is claimed by incarnation {holder}")), "{out}{err}");
}

#[test]
fn iceberg_three_fresh_runs_at_once_land_the_source_once() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("race-ice", warehouse.path(), "db.events", ROWS, 0, PARALLELISM, EVERY);
    let outputs = race(&job, &[]);
    let holder = one_winner(&job, &outputs);
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert_holder_only(&table, "race-ice", "lake", &holder);
}

#[test]
fn iceberg_rest_three_fresh_runs_at_once_land_the_source_once() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    let mut job = TestJob::iceberg("race-rest", warehouse.path(), "db.events", ROWS, 0, PARALLELISM, EVERY);
    let sql = format!("database = \"{}/catalog.db\"", warehouse.path().display());
    job.toml = job.toml.replace(&sql, &format!("kind = \"rest\"\nuri = \"{}\"", rest.uri()));
    let outputs = race(&job, &[]);
    let holder = one_winner(&job, &outputs);
    let table = read_iceberg_rest(&rest.uri(), warehouse.path(), "db.events");
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert_holder_only(&table, "race-rest", "lake", &holder);
}

/// Every snapshot of the table was committed by incarnation `holder`, whose
/// claim the table holds.
fn assert_holder_only(table: &sluice_tests::IcebergTable, job: &str, sink: &str, holder: &str) {
    let metadata = table.table.metadata();
    assert!(metadata.snapshots().next().is_some(), "the table has snapshots");
    for snapshot in metadata.snapshots() {
        let by = snapshot.summary().additional_properties.get("sluice.incarnation");
        assert_eq!(by.map(String::as_str), Some(holder), "snapshot {} of another incarnation", snapshot.snapshot_id());
    }
    let claim = metadata.properties().get(&format!("sluice.claim.{job}.{sink}"));
    assert_eq!(claim.map(String::as_str), Some(holder), "the table's claim names the holder");
}

#[test]
fn bigquery_three_fresh_runs_at_once_land_the_source_once() {
    const TABLE: &str = "projects/p/datasets/d/tables/events";
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    let mut job = TestJob::bigquery("race-bq", &d.address(), TABLE, ROWS, PARALLELISM, EVERY);
    job.toml.push_str(&format!("[sink.http.bigquery]\naddress = {:?}\n", d.rest_address()));
    let outputs = race(&job, &[]);
    one_winner(&job, &outputs);
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    // The claim is a marker table in the dataset (`guest/bigquery/src/claim.rs`).
    assert!(d.table_schema("projects/p/datasets/d/tables/_sluice_claim_7_race-bq_bq").is_some());
}

/// One incarnation of `job`, driven directly: a writer and the committer.
struct Incarnation {
    writer: WriterInstance,
    committer: CommitterInstance,
}

/// Opens incarnation `id` of `job` as a fresh state directory's first run
/// would (refusing others' checkpoints), and writes rows `first..first+rows`
/// into checkpoint 1, prepared and combined but not committed.
fn open_and_prepare(job: &TestJob, id: &str, first: u64, rows: u64) -> (Incarnation, Vec<u8>) {
    open_and_prepare_tables(job, id, &[""], &[""], first, rows)
}

/// [`open_and_prepare`] for a source of `known` tables, of which checkpoint
/// 1 writes `written` (each table the same rows).
fn open_and_prepare_tables(
    job: &TestJob,
    id: &str,
    known: &[&str],
    written: &[&str],
    first: u64,
    rows: u64,
) -> (Incarnation, Vec<u8>) {
    let loaded = job.load(&[]).expect("job file");
    let plugin = host().load(&loaded.spec.sink.plugin).expect("plugin");
    let (grants, limits) = engine::grants_and_limits(&loaded).expect("grants");
    let ctx = SinkCtx {
        job_id: loaded.spec.job.id.clone(),
        sink_id: loaded.spec.sink.id.clone(),
        incarnation: id.to_string(),
        refuse_other_incarnations: true,
        beside: false,
        subtask: 0,
        parallelism: 1,
        attempt: 1,
        dead_letter_table: None,
        incarnation_created_ms: 0,
    };
    let options = plugin.options_for(loaded.sink_options(), &ctx);
    let schema = sluice::ipc::encode_schema(&Generator::schema_ref()).expect("schema");
    let tables: Vec<SourceTable> =
        known.iter().map(|t| SourceTable { name: t.to_string(), schema: schema.clone() }).collect();
    let inst = plugin.instantiate("committer", &grants, limits).expect("instance");
    let mut committer = CommitterInstance::open(inst, &ctx, &options, &tables).expect("committer opens: no claim yet");
    let inst = plugin.instantiate("writer", &grants, limits).expect("instance");
    let mut writer = WriterInstance::open(inst, &ctx, &options, &tables, None).expect("writer opens");
    let batch = sluice::ipc::encode_batch(&Generator::batch_for(first, first + rows)).expect("batch");
    for table in written {
        writer.write(table, &batch).expect("write");
    }
    let info = writer.prepare_commit(1).expect("prepare").expect("rows prepared");
    writer.snapshot_state(1).expect("state");
    let combined = committer.combine(1, &[info]).expect("combine");
    (Incarnation { writer, committer }, combined)
}

/// Two incarnations open (neither finds the other: nothing is committed
/// yet), then `a` commits and `b` tries: the guard holds at commit time.
/// Returns `b`'s refusal.
fn interleave(job: &TestJob) -> String {
    let (mut a, combined_a) = open_and_prepare(job, "aaaaaaaaaaaa", 0, 1000);
    let (mut b, combined_b) = open_and_prepare(job, "bbbbbbbbbbbb", 0, 1000);
    assert_eq!(a.committer.commit(1, &combined_a).expect("a commits"), CommitOutcome::Committed);
    let refusal = b.committer.commit(1, &combined_b).expect_err("b is refused at its commit").to_string();
    assert!(refusal.contains("is claimed by incarnation aaaaaaaaaaaa"), "{refusal}");
    assert!(refusal.contains("incarnation bbbbbbbbbbbb") && refusal.contains("--new-incarnation"), "{refusal}");
    // Asked again (the engine's retry, or the next run), b is refused again.
    assert!(b.committer.commit(1, &combined_b).is_err());
    // a commits again idempotently (BigQuery's re-flush answers OK, so its sink says `committed`).
    a.committer.commit(1, &combined_a).expect("a commits again");
    a.writer.close().expect("close");
    b.writer.close().expect("close");
    refusal
}

#[test]
fn files_a_claim_taken_after_open_stops_the_other_commit() {
    let job = TestJob::files("interleave-files", 1000, 1, 1000);
    interleave(&job);
    assert_exactly_once_range(&read_visible(&job.out()), 0, 1000);
}

/// A claim removed by hand does not let a loser land the source again: the
/// output holds another incarnation's checkpoints and none of its own.
#[test]
fn files_a_removed_claim_is_not_taken_over_another_incarnations_rows() {
    let job = TestJob::files("unclaimed-files", 1000, 1, 1000);
    let (mut a, combined_a) = open_and_prepare(&job, "aaaaaaaaaaaa", 0, 1000);
    let (mut b, combined_b) = open_and_prepare(&job, "bbbbbbbbbbbb", 0, 1000);
    a.committer.commit(1, &combined_a).expect("a commits");
    std::fs::remove_file(job.out().join("_sluice_claim.unclaimed-files.out.json")).expect("the claim is removed");
    let refusal = b.committer.commit(1, &combined_b).expect_err("b is refused").to_string();
    assert!(refusal.contains("holds committed checkpoints of incarnation aaaaaaaaaaaa"), "{refusal}");
    assert!(refusal.contains("but no claim"), "{refusal}");
    // The holder itself takes its claim back and goes on.
    a.committer.commit(1, &combined_a).expect("a commits again");
    a.writer.close().expect("close");
    b.writer.close().expect("close");
    assert_exactly_once_range(&read_visible(&job.out()), 0, 1000);
}

/// Two incarnations of a job of two tables whose first checkpoints touch
/// different tables: the anchor claim of the namespace makes the first to
/// commit the holder of both, and the other lands nothing in either.
#[test]
fn iceberg_racing_incarnations_of_several_tables_never_split_them() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("interleave-many", warehouse.path(), "db.{table}", 1000, 0, 1, 1000);
    let (mut a, combined_a) = open_and_prepare_tables(&job, "aaaaaaaaaaaa", &["a", "b"], &["b"], 0, 1000);
    let (mut b, combined_b) = open_and_prepare_tables(&job, "bbbbbbbbbbbb", &["a", "b"], &["a", "b"], 0, 1000);
    a.committer.commit(1, &combined_a).expect("a commits table b");
    let refusal = b.committer.commit(1, &combined_b).expect_err("b is refused").to_string();
    assert!(refusal.contains("claimed by incarnation aaaaaaaaaaaa"), "{refusal}");
    a.writer.close().expect("close");
    b.writer.close().expect("close");
    let table_a = read_iceberg(warehouse.path(), "db.a");
    assert_eq!(table_a.rows.num_rows(), 0, "nothing of b landed in table a");
    let table_b = read_iceberg(warehouse.path(), "db.b");
    assert_exactly_once_range(&table_b.rows, 0, 1000);
    assert_holder_only(&table_b, "interleave-many", "lake", "aaaaaaaaaaaa");
}

#[test]
fn iceberg_a_claim_taken_after_open_stops_the_other_commit() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let job = TestJob::iceberg("interleave-ice", warehouse.path(), "db.events", 1000, 0, 1, 1000);
    interleave(&job);
    let table = read_iceberg(warehouse.path(), "db.events");
    assert_exactly_once_range(&table.rows, 0, 1000);
    assert_holder_only(&table, "interleave-ice", "lake", "aaaaaaaaaaaa");
}

#[test]
fn bigquery_a_claim_taken_after_open_stops_the_other_commit() {
    const TABLE: &str = "projects/p/datasets/d/tables/events";
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    let mut job = TestJob::bigquery("interleave-bq", &d.address(), TABLE, 1000, 1, 1000);
    job.toml.push_str(&format!("[sink.http.bigquery]\naddress = {:?}\n", d.rest_address()));
    interleave(&job);
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, 1000);
}

#[test]
fn iceberg_rest_a_claim_taken_after_open_stops_the_other_commit() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let rest = RestCatalogDouble::start(warehouse.path()).expect("REST catalog");
    let mut job = TestJob::iceberg("interleave-rest", warehouse.path(), "db.events", 1000, 0, 1, 1000);
    let sql = format!("database = \"{}/catalog.db\"", warehouse.path().display());
    job.toml = job.toml.replace(&sql, &format!("kind = \"rest\"\nuri = \"{}\"", rest.uri()));
    interleave(&job);
    let table = read_iceberg_rest(&rest.uri(), warehouse.path(), "db.events");
    assert_exactly_once_range(&table.rows, 0, 1000);
    assert_holder_only(&table, "interleave-rest", "lake", "aaaaaaaaaaaa");
}
