//! Partitioned tables and copy jobs, over real HTTP (and the Storage Write
//! API over gRPC for streamed rows), as the BigQuery API documents them:
//! `timePartitioning` on tables.insert/get, copies with partition
//! decorators on both sides, WRITE_TRUNCATE / WRITE_APPEND / WRITE_EMPTY,
//! the decorator check, 409 `duplicate` for a job id seen before, and the
//! injected job faults. References are in the double's `jobs` and
//! `partition` modules.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use arrow_array::{Date32Array, Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type as ProtoType};
use prost_types::{DescriptorProto, FieldDescriptorProto};
use serde_json::{Value, json};
use sluice_bigquery_double::proto::append_rows_request::{ProtoData, Rows};
use sluice_bigquery_double::proto::append_rows_response::Response as Reply;
use sluice_bigquery_double::proto::big_query_write_client::BigQueryWriteClient;
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::proto::write_stream::Type as StreamType;
use sluice_bigquery_double::proto::{
    AppendRowsRequest, CreateWriteStreamRequest, ProtoRows, ProtoSchema, TableSchema, WriteStream,
};
use sluice_bigquery_double::{BigQueryDouble, JobFault, JobState, PartitionType, RestFault, TimePartitioning, column};

const TARGET: &str = "projects/p/datasets/d/tables/target";
const STAGE: &str = "projects/p/datasets/d/tables/stage";
/// 2024-01-01 .. 2024-01-03 as days since the epoch.
const JAN1: i32 = 19723;
const JAN2: i32 = 19724;
const JAN3: i32 = 19725;

fn schema() -> TableSchema {
    TableSchema {
        fields: vec![
            column("id", Type::Int64, Mode::Required),
            column("day", Type::Date, Mode::Required),
            column("v", Type::String, Mode::Nullable),
        ],
    }
}

fn by_day() -> TimePartitioning {
    TimePartitioning::new(PartitionType::Day, "day")
}

/// Rows `(id, day, v)` as an Arrow batch.
fn batch(rows: &[(i64, i32, &str)]) -> RecordBatch {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("day", DataType::Date32, false),
        Field::new("v", DataType::Utf8, true),
    ]));
    RecordBatch::try_new(
        schema,
        vec![
            Arc::new(Int64Array::from(rows.iter().map(|r| r.0).collect::<Vec<_>>())),
            Arc::new(Date32Array::from(rows.iter().map(|r| r.1).collect::<Vec<_>>())),
            Arc::new(StringArray::from(rows.iter().map(|r| Some(r.2)).collect::<Vec<_>>())),
        ],
    )
    .unwrap()
}

/// One HTTP/1.1 exchange on a fresh connection, read to its end. Written
/// by hand (a few lines over `std::net`) so the double's crate needs no
/// HTTP client dependency for its tests.
fn http(double: &BigQueryDouble, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let address = double.rest_address();
    let host = address.strip_prefix("http://").unwrap();
    let mut conn = TcpStream::connect(host).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        conn,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn table_ref(table: &str) -> Value {
    json!({ "projectId": "p", "datasetId": "d", "tableId": table })
}

fn copy_job(id: &str, source: &str, destination: &str, write: &str) -> Value {
    json!({
        "jobReference": { "projectId": "p", "jobId": id },
        "configuration": { "copy": {
            "sourceTable": table_ref(source),
            "destinationTable": table_ref(destination),
            "writeDisposition": write,
            "createDisposition": "CREATE_NEVER",
        }},
    })
}

fn insert_job(double: &BigQueryDouble, job: Value) -> (u16, Value) {
    http(double, "POST", "/bigquery/v2/projects/p/jobs", Some(job))
}

fn get_job(double: &BigQueryDouble, id: &str) -> (u16, Value) {
    http(double, "GET", &format!("/bigquery/v2/projects/p/jobs/{id}"), None)
}

/// `(id, day, v)` of every row `tabledata.list` answers, sorted.
fn listed(double: &BigQueryDouble, table: &str) -> Vec<(i64, String, String)> {
    let (status, body) = http(double, "GET", &format!("/bigquery/v2/projects/p/datasets/d/tables/{table}/data"), None);
    assert_eq!(status, 200, "{body}");
    let mut rows: Vec<(i64, String, String)> = body["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let cell = |i: usize| r["f"][i]["v"].as_str().unwrap_or("").to_string();
            (cell(0).parse().unwrap(), cell(1), cell(2))
        })
        .collect();
    rows.sort();
    assert_eq!(body["totalRows"], json!(rows.len().to_string()));
    rows
}

fn row(id: i64, day: i32, v: &str) -> (i64, String, String) {
    (id, day.to_string(), v.to_string())
}

fn counts(double: &BigQueryDouble, table: &str) -> Vec<(String, u64)> {
    double.partition_counts(table).unwrap().into_iter().collect()
}

/// A day-partitioned target with rows in three days, and a day-partitioned
/// staging table.
fn setup() -> BigQueryDouble {
    let double = BigQueryDouble::start().unwrap();
    double.create_partitioned_table(TARGET, schema(), by_day()).unwrap();
    double.create_partitioned_table(STAGE, schema(), by_day()).unwrap();
    double.load_rows(TARGET, batch(&[(1, JAN1, "old"), (2, JAN2, "old"), (3, JAN2, "old"), (4, JAN3, "old")])).unwrap();
    double
}

#[derive(Clone, PartialEq, prost::Message)]
struct ProtoRow {
    #[prost(int64, optional, tag = "1")]
    id: Option<i64>,
    #[prost(int32, optional, tag = "2")]
    day: Option<i32>,
    #[prost(string, optional, tag = "3")]
    v: Option<String>,
}

/// Appends rows through a COMMITTED write stream, visible at once.
fn stream_rows(double: &BigQueryDouble, table: &str, rows: &[(i64, i32, &str)]) {
    let field = |name: &str, n: i32, t: ProtoType| FieldDescriptorProto {
        name: Some(name.into()),
        number: Some(n),
        label: Some(Label::Optional as i32),
        r#type: Some(t as i32),
        ..Default::default()
    };
    let descriptor = DescriptorProto {
        name: Some("row".into()),
        field: vec![
            field("id", 1, ProtoType::Int64),
            field("day", 2, ProtoType::Int32),
            field("v", 3, ProtoType::String),
        ],
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(double.address()).unwrap().connect().await.unwrap();
        let mut client = BigQueryWriteClient::new(channel);
        let stream = client
            .create_write_stream(CreateWriteStreamRequest {
                parent: table.into(),
                write_stream: Some(WriteStream { r#type: StreamType::Committed as i32, ..Default::default() }),
            })
            .await
            .unwrap()
            .into_inner()
            .name;
        let request = AppendRowsRequest {
            write_stream: stream,
            rows: Some(Rows::ProtoRows(ProtoData {
                writer_schema: Some(ProtoSchema { proto_descriptor: Some(descriptor) }),
                rows: Some(ProtoRows {
                    serialized_rows: rows
                        .iter()
                        .map(|(id, day, v)| {
                            ProtoRow { id: Some(*id), day: Some(*day), v: Some(v.to_string()) }.encode_to_vec()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        };
        let mut replies = client.append_rows(tokio_stream::iter(vec![request])).await.unwrap().into_inner();
        let reply = replies.message().await.unwrap().unwrap();
        assert!(matches!(reply.response, Some(Reply::AppendResult(_))), "{reply:?}");
    });
}

#[test]
fn tables_insert_and_get_carry_time_partitioning() {
    let double = BigQueryDouble::start().unwrap();
    let fields = json!([
        { "name": "id", "type": "INTEGER", "mode": "REQUIRED" },
        { "name": "day", "type": "DATE", "mode": "REQUIRED" },
    ]);
    let table = |id: &str, partitioning: Value| {
        json!({
            "tableReference": { "projectId": "p", "datasetId": "d", "tableId": id },
            "schema": { "fields": fields },
            "timePartitioning": partitioning,
        })
    };
    let path = "/bigquery/v2/projects/p/datasets/d/tables";
    let (status, body) = http(
        &double,
        "POST",
        path,
        Some(table("t", json!({ "type": "DAY", "field": "day", "expirationMs": "5184000000" }))),
    );
    assert_eq!(status, 200, "{body}");
    let expected = json!({ "type": "DAY", "field": "day", "expirationMs": "5184000000" });
    assert_eq!(body["timePartitioning"], expected);
    let (status, body) = http(&double, "GET", &format!("{path}/t"), None);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["timePartitioning"], expected, "tables.get returns the partitioning");
    let kept = double.time_partitioning("projects/p/datasets/d/tables/t").unwrap();
    assert_eq!((kept.kind, kept.field.as_str(), kept.expiration_ms), (PartitionType::Day, "day", Some(5_184_000_000)));

    // Ingestion-time partitioning, a DATE column by HOUR and a column that
    // cannot partition are refused, each naming why.
    for (id, partitioning, why) in [
        ("a", json!({ "type": "DAY" }), "not supported by this double"),
        ("b", json!({ "type": "HOUR", "field": "day" }), "HOUR partitioning is not supported for the DATE field day"),
        ("c", json!({ "type": "DAY", "field": "id" }), "TIMESTAMP, DATE or DATETIME: id is INT64"),
        ("d", json!({ "type": "WEEK", "field": "day" }), "Invalid timePartitioning.type \"WEEK\""),
    ] {
        let (status, body) = http(&double, "POST", path, Some(table(id, partitioning)));
        assert_eq!(status, 400, "{body}");
        assert_eq!(body["error"]["errors"][0]["reason"], "invalid");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(why), "{message}");
        assert_eq!(http(&double, "GET", &format!("{path}/{id}"), None).0, 404, "a refused table is not created");
    }
    // An unpartitioned table has no timePartitioning.
    let (status, body) = http(
        &double,
        "POST",
        path,
        Some(json!({ "tableReference": { "tableId": "plain" }, "schema": { "fields": fields } })),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.get("timePartitioning").is_none(), "{body}");
}

/// WRITE_TRUNCATE to `target$D` from `stage$D` replaces that day's rows,
/// streamed ones included, and leaves every other day as it was.
#[test]
fn write_truncate_replaces_only_the_decorated_partition() {
    let double = setup();
    // Rows streamed into the target count as its rows too.
    stream_rows(&double, TARGET, &[(5, JAN2, "streamed"), (6, JAN3, "streamed")]);
    double.load_rows(STAGE, batch(&[(20, JAN2, "new"), (21, JAN2, "new")])).unwrap();
    stream_rows(&double, STAGE, &[(22, JAN2, "new"), (30, JAN3, "not copied")]);
    assert_eq!(counts(&double, TARGET), vec![("20240101".into(), 1), ("20240102".into(), 3), ("20240103".into(), 2)]);

    let (status, body) = insert_job(&double, copy_job("j1", "stage$20240102", "target$20240102", "WRITE_TRUNCATE"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"]["state"], "DONE", "{body}");
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(body["jobReference"]["jobId"], "j1");
    assert_eq!(body["configuration"]["copy"]["writeDisposition"], "WRITE_TRUNCATE");
    assert_eq!(
        listed(&double, "target"),
        vec![
            row(1, JAN1, "old"),
            row(4, JAN3, "old"),
            row(6, JAN3, "streamed"),
            row(20, JAN2, "new"),
            row(21, JAN2, "new"),
            row(22, JAN2, "new"),
        ]
    );
    assert_eq!(counts(&double, STAGE), vec![("20240102".into(), 3), ("20240103".into(), 1)], "the source is unchanged");

    // The target's write stream still takes appends; new rows are visible after the copy's.
    stream_rows(&double, TARGET, &[(7, JAN2, "later")]);
    assert_eq!(double.visible_count(TARGET), 7);
    assert_eq!(double.visible_rows(TARGET).last().and_then(|r| r["id"].as_i64()), Some(7));

    // Copying an empty partition empties the destination's.
    let (_, body) = insert_job(&double, copy_job("j2", "stage$20240101", "target$20240101", "WRITE_TRUNCATE"));
    assert_eq!(body["status"]["state"], "DONE", "{body}");
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(counts(&double, TARGET), vec![("20240102".into(), 4), ("20240103".into(), 2)]);
}

/// WRITE_APPEND adds to the partition; WRITE_EMPTY refuses a partition
/// with rows (`duplicate`) and fills an empty one.
#[test]
fn write_append_adds_and_write_empty_needs_an_empty_partition() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new"), (30, JAN3, "new")])).unwrap();
    let (_, body) = insert_job(&double, copy_job("a", "stage$20240102", "target$20240102", "WRITE_APPEND"));
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(counts(&double, TARGET), vec![("20240101".into(), 1), ("20240102".into(), 3), ("20240103".into(), 1)]);

    let (_, body) = insert_job(&double, copy_job("e1", "stage$20240103", "target$20240103", "WRITE_EMPTY"));
    assert_eq!(body["status"]["state"], "DONE");
    assert_eq!(body["status"]["errorResult"]["reason"], "duplicate", "{body}");
    assert_eq!(body["status"]["errors"][0]["reason"], "duplicate", "{body}");
    assert_eq!(counts(&double, TARGET)[2], ("20240103".into(), 1), "nothing applied");

    double.create_partitioned_table("projects/p/datasets/d/tables/empty", schema(), by_day()).unwrap();
    let (_, body) = insert_job(&double, copy_job("e2", "stage$20240103", "empty$20240103", "WRITE_EMPTY"));
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(listed(&double, "empty"), vec![row(30, JAN3, "new")]);
}

/// Rows that do not lie in the destination decorator's partition fail the
/// whole job (DONE, `invalid`), and nothing of it is applied.
#[test]
fn a_decorator_that_does_not_match_the_rows_fails_the_job() {
    let double = setup();
    let before = listed(&double, "target");
    double.load_rows(STAGE, batch(&[(20, JAN2, "new"), (30, JAN3, "new")])).unwrap();
    // The whole staging table (two days) into one day.
    let (status, body) = insert_job(&double, copy_job("m1", "stage", "target$20240102", "WRITE_TRUNCATE"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"]["state"], "DONE");
    assert_eq!(body["status"]["errorResult"]["reason"], "invalid", "{body}");
    let message = body["status"]["errorResult"]["message"].as_str().unwrap();
    assert!(
        message.contains("rather than destination partition 20240102") && message.contains("20240103"),
        "{message}"
    );
    // One day into another day's decorator.
    let (_, body) = insert_job(&double, copy_job("m2", "stage$20240103", "target$20240102", "WRITE_TRUNCATE"));
    assert_eq!(body["status"]["errorResult"]["reason"], "invalid", "{body}");
    // A decorator that is not a day.
    let (_, body) = insert_job(&double, copy_job("m3", "stage$20240102", "target$2024010", "WRITE_TRUNCATE"));
    assert_eq!(body["status"]["errorResult"]["reason"], "invalid", "{body}");
    assert!(body["status"]["errorResult"]["message"].as_str().unwrap().contains("Invalid partition decorator"));
    assert_eq!(listed(&double, "target"), before, "a failed job applies nothing");
    let (_, body) = get_job(&double, "m1");
    assert_eq!(body["status"]["errorResult"]["reason"], "invalid", "jobs.get tells the same: {body}");

    // CREATE_NEVER with no destination: notFound in the job result.
    let (_, body) = insert_job(&double, copy_job("m4", "stage$20240102", "nope$20240102", "WRITE_TRUNCATE"));
    assert_eq!(body["status"]["errorResult"]["reason"], "notFound", "{body}");
    // Only copy jobs are served.
    let (status, body) = insert_job(
        &double,
        json!({ "jobReference": { "jobId": "q" }, "configuration": { "query": { "query": "SELECT 1" } } }),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("not supported by this double"), "{body}");
    assert_eq!(get_job(&double, "q").0, 404, "a refused insert keeps no job");
}

/// CREATE_IF_NEEDED makes the destination with the source's schema and
/// partitioning.
#[test]
fn create_if_needed_takes_the_sources_schema_and_partitioning() {
    let double = setup();
    let mut job = copy_job("c", "target$20240102", "copy$20240102", "WRITE_TRUNCATE");
    job["configuration"]["copy"]["createDisposition"] = json!("CREATE_IF_NEEDED");
    let (_, body) = insert_job(&double, job);
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    let (status, table) = http(&double, "GET", "/bigquery/v2/projects/p/datasets/d/tables/copy", None);
    assert_eq!(status, 200);
    assert_eq!(table["timePartitioning"], json!({ "type": "DAY", "field": "day" }));
    assert_eq!(listed(&double, "copy"), vec![row(2, JAN2, "old"), row(3, JAN2, "old")]);
}

/// A job id seen before is refused with 409 `duplicate`, in the API's
/// error shape, and the first job's effect is not applied twice.
#[test]
fn a_repeated_job_id_is_refused_and_not_applied_twice() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    let job = copy_job("dup", "stage$20240102", "target$20240102", "WRITE_APPEND");
    let (status, _) = insert_job(&double, job.clone());
    assert_eq!(status, 200);
    let after_first = listed(&double, "target");
    let (status, body) = insert_job(&double, job);
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], 409);
    assert_eq!(body["error"]["status"], "ALREADY_EXISTS");
    assert_eq!(body["error"]["errors"][0]["reason"], "duplicate");
    assert_eq!(body["error"]["message"], "Already Exists: Job p:US.dup");
    assert_eq!(listed(&double, "target"), after_first, "applied once");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 3));
    let (status, body) = get_job(&double, "nope");
    assert_eq!(status, 404);
    assert_eq!(body["error"]["errors"][0]["reason"], "notFound");
}

/// A lost reply: the job ran; the retry is refused 409; jobs.get says DONE.
#[test]
fn a_job_whose_reply_is_lost_has_run_and_jobs_get_says_so() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    double.inject_job(1, JobFault::ApplyThenDropReply);
    let job = copy_job("lost", "stage$20240102", "target$20240102", "WRITE_TRUNCATE");
    let (status, body) = insert_job(&double, job.clone());
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["errors"][0]["reason"], "backendError");
    assert_eq!(insert_job(&double, job).0, 409, "the retry finds the job");
    let (status, body) = get_job(&double, "lost");
    assert_eq!(status, 200);
    assert_eq!(body["status"]["state"], "DONE", "{body}");
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(counts(&double, TARGET), vec![("20240101".into(), 1), ("20240102".into(), 1), ("20240103".into(), 1)]);
    assert_eq!(double.rest_calls("jobs.insert"), 2);
    assert_eq!(double.job("p", "lost").map(|j| j.state), Some(JobState::Done));
}

/// A failure before the job exists leaves no job: the same id may be inserted again.
#[test]
fn a_job_refused_before_it_exists_can_be_inserted_again() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    double.inject_job(1, JobFault::FailBeforeApply);
    let job = copy_job("again", "stage$20240102", "target$20240102", "WRITE_TRUNCATE");
    assert_eq!(insert_job(&double, job.clone()).0, 503);
    assert_eq!(get_job(&double, "again").0, 404, "no job was created");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 2), "nothing applied");
    let (status, body) = insert_job(&double, job);
    assert_eq!(status, 200, "{body}");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 1));
}

/// A job that ends with `backendError` applied nothing and keeps its id; a
/// new id runs it.
#[test]
fn a_job_done_with_backend_error_applies_nothing() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    double.inject_job(1, JobFault::DoneWithBackendError);
    let (status, body) = insert_job(&double, copy_job("b_0", "stage$20240102", "target$20240102", "WRITE_TRUNCATE"));
    assert_eq!(status, 200, "{body}");
    let (_, body) = get_job(&double, "b_0");
    assert_eq!(body["status"]["state"], "DONE");
    assert_eq!(body["status"]["errorResult"]["reason"], "backendError", "{body}");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 2), "nothing applied");
    let retry = copy_job("b_0", "stage$20240102", "target$20240102", "WRITE_TRUNCATE");
    assert_eq!(insert_job(&double, retry).0, 409, "the id is taken");
    let (_, body) = insert_job(&double, copy_job("b_1", "stage$20240102", "target$20240102", "WRITE_TRUNCATE"));
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 1));
}

/// A job held RUNNING for n polls applies nothing until the poll that ends it, and only once.
#[test]
fn a_running_job_applies_at_the_poll_that_ends_it() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    double.inject_job(1, JobFault::RunningFor(2));
    let (status, body) = insert_job(&double, copy_job("slow", "stage$20240102", "target$20240102", "WRITE_APPEND"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"]["state"], "RUNNING");
    for poll in 1..=2 {
        let (_, body) = get_job(&double, "slow");
        assert_eq!(body["status"]["state"], "RUNNING", "poll {poll}");
        assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 2), "poll {poll}: not applied yet");
    }
    // A poll whose reply is lost still counts.
    double.inject_rest("jobs.get", 3, RestFault::ApplyThenFail);
    assert_eq!(get_job(&double, "slow").0, 503);
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 3), "applied at the third poll");
    let (_, body) = get_job(&double, "slow");
    assert_eq!(body["status"]["state"], "DONE");
    assert!(body["status"].get("errorResult").is_none(), "{body}");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 3), "applied once");
}

/// `expirationTime` is taken by tables.insert, returned by tables.get and
/// moved by a tables.patch that carries it alone, which leaves the schema
/// and the rows as they are
/// (https://cloud.google.com/bigquery/docs/reference/rest/v2/tables#Table.FIELDS.expiration_time,
/// …/tables/patch "only replaces fields that are provided").
#[test]
fn expiration_time_is_kept_and_moved_by_a_patch() {
    let double = setup();
    let path = "/bigquery/v2/projects/p/datasets/d/tables";
    let fields = json!([{ "name": "id", "type": "INTEGER", "mode": "REQUIRED" }]);
    let body = json!({
        "tableReference": { "projectId": "p", "datasetId": "d", "tableId": "soon" },
        "schema": { "fields": fields },
        "expirationTime": "1700000000000",
    });
    let (status, reply) = http(&double, "POST", path, Some(body));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["expirationTime"], "1700000000000");
    let (_, got) = http(&double, "GET", &format!("{path}/soon"), None);
    assert_eq!(got["expirationTime"], "1700000000000");
    let (status, patched) =
        http(&double, "PATCH", &format!("{path}/soon"), Some(json!({ "expirationTime": "1800000000000" })));
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["expirationTime"], "1800000000000");
    assert_eq!(patched["schema"]["fields"][0]["name"], "id", "the schema is left as it was");
    assert_ne!(patched["etag"], got["etag"], "a change moves the etag");
    assert_eq!(double.expiration_time("projects/p/datasets/d/tables/soon"), Some(1_800_000_000_000));
    let (status, bad) = http(&double, "PATCH", &format!("{path}/soon"), Some(json!({ "expirationTime": "soon" })));
    assert_eq!(status, 400, "{bad}");
    // A table without one never expires and has none in its resource.
    let (_, target) = http(&double, "GET", &format!("{path}/target"), None);
    assert!(target.get("expirationTime").is_none(), "{target}");
    // Deleted (or expired): gone, with its rows.
    assert!(double.delete_table("projects/p/datasets/d/tables/soon"));
    assert_eq!(http(&double, "GET", &format!("{path}/soon"), None).0, 404);
}

/// A job that ends with a rate or quota limit applied nothing, and its id is taken.
#[test]
fn a_job_done_with_a_quota_error_applies_nothing() {
    let double = setup();
    double.load_rows(STAGE, batch(&[(20, JAN2, "new")])).unwrap();
    double.inject_job(1, JobFault::DoneWithError("quotaExceeded"));
    let (status, body) = insert_job(&double, copy_job("q_0", "stage$20240102", "target$20240102", "WRITE_TRUNCATE"));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"]["errorResult"]["reason"], "quotaExceeded", "{body}");
    assert_eq!(counts(&double, TARGET)[1], ("20240102".into(), 2), "nothing applied");
    assert_eq!(insert_job(&double, copy_job("q_0", "stage$20240102", "target$20240102", "WRITE_TRUNCATE")).0, 409);
}

/// `datasets.get` answers the location and default expirations a test set
/// (a dataset no test set is in `US` with none), and `tables.insert`
/// applies them to what a request leaves out: a partitioned table inherits
/// `defaultPartitionExpirationMs` as `timePartitioning.expirationMs` and no
/// table expiration; an explicit `expirationMs` wins; an unpartitioned
/// table without `expirationTime` expires `defaultTableExpirationMs` after
/// it is made, one with it keeps its own. `tables.delete` removes a table
/// (then 404).
#[test]
fn datasets_answer_their_defaults_and_tables_insert_applies_them() {
    let double = BigQueryDouble::start().unwrap();
    let (status, plain) = http(&double, "GET", "/bigquery/v2/projects/p/datasets/other", None);
    assert_eq!(status, 200, "{plain}");
    assert_eq!(plain["location"], "US");
    assert!(plain.get("defaultPartitionExpirationMs").is_none() && plain.get("defaultTableExpirationMs").is_none());
    double.set_dataset(
        "projects/p/datasets/d",
        sluice_bigquery_double::Dataset {
            location: "europe-west1".into(),
            default_table_expiration_ms: Some(3_600_000),
            default_partition_expiration_ms: Some(86_400_000),
        },
    );
    let (status, ds) = http(&double, "GET", "/bigquery/v2/projects/p/datasets/d", None);
    assert_eq!(status, 200, "{ds}");
    assert_eq!(ds["location"], "europe-west1");
    assert_eq!(ds["defaultTableExpirationMs"], "3600000");
    assert_eq!(ds["defaultPartitionExpirationMs"], "86400000");
    let fields = json!([{ "name": "id", "type": "INTEGER" }, { "name": "day", "type": "DATE" }]);
    let insert = |id: &str, extra: Value| {
        let mut body = json!({ "tableReference": table_ref(id), "schema": { "fields": fields } });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        http(&double, "POST", "/bigquery/v2/projects/p/datasets/d/tables", Some(body))
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    let (status, inherited) = insert("inherits", json!({ "timePartitioning": { "type": "DAY", "field": "day" } }));
    assert_eq!(status, 200, "{inherited}");
    assert_eq!(inherited["timePartitioning"]["expirationMs"], "86400000");
    assert!(inherited.get("expirationTime").is_none(), "{inherited}");
    let (_, explicit) =
        insert("explicit", json!({ "timePartitioning": { "type": "DAY", "field": "day", "expirationMs": "5" } }));
    assert_eq!(explicit["timePartitioning"]["expirationMs"], "5");
    let (_, plain_table) = insert("plain", json!({}));
    let at: i64 = plain_table["expirationTime"].as_str().unwrap().parse().unwrap();
    assert!(at >= now + 3_600_000 && at < now + 3_600_000 + 60_000, "{at} vs {now}");
    let (_, own) = insert("own", json!({ "expirationTime": "99999999999999" }));
    assert_eq!(own["expirationTime"], "99999999999999");
    let (status, _) = http(&double, "DELETE", "/bigquery/v2/projects/p/datasets/d/tables/own", None);
    assert_eq!(status, 200);
    let (status, _) = http(&double, "GET", "/bigquery/v2/projects/p/datasets/d/tables/own", None);
    assert_eq!(status, 404);
    let (status, _) = http(&double, "DELETE", "/bigquery/v2/projects/p/datasets/d/tables/own", None);
    assert_eq!(status, 404);
}

/// A job runs where its destination's dataset is when the client names no
/// location, and `jobs.get` finds a job in a single region only with its
/// location; a job in the `US` multi-region is found without it.
#[test]
fn jobs_get_needs_the_location_of_a_single_region_job() {
    let double = setup();
    double.set_dataset(
        "projects/p/datasets/d",
        sluice_bigquery_double::Dataset { location: "europe-west1".into(), ..Default::default() },
    );
    let (status, job) = insert_job(&double, copy_job("in_region", "stage", "target", "WRITE_APPEND"));
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["jobReference"]["location"], "europe-west1");
    assert_eq!(get_job(&double, "in_region").0, 404, "without its location");
    let (status, _) = http(&double, "GET", "/bigquery/v2/projects/p/jobs/in_region?location=us-east1", None);
    assert_eq!(status, 404, "in another location");
    let (status, got) = http(&double, "GET", "/bigquery/v2/projects/p/jobs/in_region?location=europe-west1", None);
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["status"]["state"], "DONE");
    let mut us = copy_job("in_us", "stage", "target", "WRITE_APPEND");
    us["jobReference"]["location"] = json!("US");
    assert_eq!(insert_job(&double, us).0, 200);
    assert_eq!(get_job(&double, "in_us").0, 200, "a multi-region job is found without its location");
}

/// `tables.list` pages through a dataset's tables by id (`maxResults`,
/// `nextPageToken`, left out on the last page), with their labels, and
/// lists no table of another dataset.
#[test]
fn tables_list_pages_by_id_with_labels() {
    let double = setup();
    for i in 0..5 {
        assert!(double.create_labelled_table(&format!("projects/p/datasets/d/tables/m_{i}"), &[("k", "v")]));
    }
    double.create_table("projects/p/datasets/other/tables/elsewhere", schema());
    let mut ids = Vec::new();
    let mut token: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut path = "/bigquery/v2/projects/p/datasets/d/tables?maxResults=3".to_string();
        if let Some(t) = &token {
            path.push_str(&format!("&pageToken={t}"));
        }
        let (status, page) = http(&double, "GET", &path, None);
        assert_eq!(status, 200, "{page}");
        assert_eq!(page["totalItems"], 7);
        pages += 1;
        for t in page["tables"].as_array().unwrap() {
            let id = t["tableReference"]["tableId"].as_str().unwrap().to_string();
            if id.starts_with("m_") {
                assert_eq!(t["labels"]["k"], "v", "{t}");
            }
            ids.push(id);
        }
        match page.get("nextPageToken").and_then(Value::as_str) {
            Some(t) => token = Some(t.to_string()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(ids, ["m_0", "m_1", "m_2", "m_3", "m_4", "stage", "target"]);
}
