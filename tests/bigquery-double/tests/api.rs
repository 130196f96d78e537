//! The double answers as the Storage Write API documents, through tonic's
//! generated client over loopback: strict offsets with `StorageError`
//! details, inclusive and cumulative FlushRows, stream types and their
//! visibility, finalize, schema checks and the request size limit.

use googleapis_tonic_google_rpc::google::rpc::Status as RpcStatus;
use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type as ProtoType};
use prost_types::{DescriptorProto, FieldDescriptorProto};
use sluice_bigquery_double::proto::append_rows_request::{ProtoData, Rows};
use sluice_bigquery_double::proto::append_rows_response::Response as Reply;
use sluice_bigquery_double::proto::big_query_write_client::BigQueryWriteClient;
use sluice_bigquery_double::proto::storage_error::StorageErrorCode;
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::proto::write_stream::Type as StreamType;
use sluice_bigquery_double::proto::{
    AppendRowsRequest, AppendRowsResponse, BatchCommitWriteStreamsRequest, CreateWriteStreamRequest,
    FinalizeWriteStreamRequest, FlushRowsRequest, GetWriteStreamRequest, ProtoRows, ProtoSchema, StorageError,
    TableSchema, WriteStream, WriteStreamView,
};
use sluice_bigquery_double::{BigQueryDouble, column};
use tonic::Code;
use tonic::transport::Channel;

const TABLE: &str = "projects/p/datasets/d/tables/t";

#[derive(Clone, PartialEq, prost::Message)]
struct Row {
    #[prost(int64, optional, tag = "1")]
    id: Option<i64>,
    #[prost(string, optional, tag = "2")]
    extra: Option<String>,
}

fn descriptor(with_extra: bool) -> ProtoSchema {
    let field = |name: &str, n: i32, t: ProtoType| FieldDescriptorProto {
        name: Some(name.into()),
        number: Some(n),
        label: Some(Label::Optional as i32),
        r#type: Some(t as i32),
        ..Default::default()
    };
    let mut fields = vec![field("id", 1, ProtoType::Int64)];
    if with_extra {
        fields.push(field("extra", 2, ProtoType::String));
    }
    ProtoSchema {
        proto_descriptor: Some(DescriptorProto { name: Some("row".into()), field: fields, ..Default::default() }),
    }
}

struct Api {
    rt: tokio::runtime::Runtime,
    client: BigQueryWriteClient<Channel>,
    double: BigQueryDouble,
}

impl Api {
    fn new() -> Self {
        let double = BigQueryDouble::start().expect("double");
        double.create_table(TABLE, TableSchema { fields: vec![column("id", Type::Int64, Mode::Required)] });
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let client = rt.block_on(async {
            let channel = tonic::transport::Endpoint::from_shared(double.address())
                .expect("uri")
                .connect()
                .await
                .expect("connect");
            BigQueryWriteClient::new(channel)
        });
        Self { rt, client, double }
    }

    fn create(&mut self, kind: StreamType) -> String {
        self.create_on(TABLE, kind)
    }

    fn create_on(&mut self, table: &str, kind: StreamType) -> String {
        let req = CreateWriteStreamRequest {
            parent: table.into(),
            write_stream: Some(WriteStream { r#type: kind as i32, ..Default::default() }),
        };
        self.rt.block_on(self.client.create_write_stream(req)).expect("create").into_inner().name
    }

    /// Sends `reqs` on one connection; one reply per request.
    fn append_requests(&mut self, reqs: Vec<AppendRowsRequest>) -> Vec<AppendRowsResponse> {
        let n = reqs.len();
        self.rt.block_on(async {
            let mut replies = self.client.append_rows(tokio_stream::iter(reqs)).await.expect("append").into_inner();
            let mut out = Vec::new();
            for _ in 0..n {
                out.push(replies.message().await.expect("reply").expect("a reply per request"));
            }
            out
        })
    }

    /// Sends one AppendRows request per `(offset, ids)` on one connection.
    fn append(&mut self, stream: &str, requests: &[(Option<i64>, Vec<i64>)], extra: bool) -> Vec<AppendRowsResponse> {
        let reqs: Vec<AppendRowsRequest> = requests
            .iter()
            .map(|(offset, ids)| AppendRowsRequest {
                write_stream: stream.into(),
                offset: *offset,
                rows: Some(Rows::ProtoRows(ProtoData {
                    writer_schema: Some(descriptor(extra)),
                    rows: Some(ProtoRows {
                        serialized_rows: ids
                            .iter()
                            .map(|id| Row { id: Some(*id), extra: extra.then(|| "x".into()) }.encode_to_vec())
                            .collect(),
                    }),
                })),
                ..Default::default()
            })
            .collect();
        self.append_requests(reqs)
    }

    fn flush(&mut self, stream: &str, offset: i64) -> Result<i64, tonic::Status> {
        let req = FlushRowsRequest { write_stream: stream.into(), offset: Some(offset) };
        self.rt.block_on(self.client.flush_rows(req)).map(|r| r.into_inner().offset)
    }

    fn visible(&self) -> Vec<i64> {
        let mut ids: Vec<i64> = self.double.visible_rows(TABLE).iter().map(|r| r["id"].as_i64().expect("id")).collect();
        ids.sort();
        ids
    }
}

fn storage_code(status: &RpcStatus) -> Option<StorageErrorCode> {
    status
        .details
        .iter()
        .find(|d| d.type_url.ends_with("StorageError"))
        .and_then(|d| StorageError::decode(d.value.as_slice()).ok())
        .and_then(|e| StorageErrorCode::try_from(e.code).ok())
}

fn in_band(reply: &AppendRowsResponse) -> (Code, Option<StorageErrorCode>) {
    match &reply.response {
        Some(Reply::Error(s)) => (Code::from_i32(s.code), storage_code(s)),
        other => panic!("expected an in-band error, got {other:?}"),
    }
}

#[test]
fn offsets_are_strict_and_errors_carry_storage_error_details() {
    let mut api = Api::new();
    let s = api.create(StreamType::Buffered);
    let replies =
        api.append(&s, &[(Some(0), vec![1, 2]), (Some(0), vec![1, 2]), (Some(5), vec![3]), (Some(2), vec![3])], false);
    assert!(matches!(replies[0].response, Some(Reply::AppendResult(ref r)) if r.offset == Some(0)));
    assert_eq!(in_band(&replies[1]), (Code::AlreadyExists, Some(StorageErrorCode::OffsetAlreadyExists)));
    assert_eq!(in_band(&replies[2]), (Code::OutOfRange, Some(StorageErrorCode::OffsetOutOfRange)));
    assert!(
        matches!(replies[3].response, Some(Reply::AppendResult(ref r)) if r.offset == Some(2)),
        "the connection survives in-band errors"
    );
}

#[test]
fn buffered_rows_become_visible_by_inclusive_cumulative_flushes() {
    let mut api = Api::new();
    let s = api.create(StreamType::Buffered);
    api.append(&s, &[(Some(0), vec![10, 11, 12, 13])], false);
    assert!(api.visible().is_empty(), "BUFFERED rows are invisible before a flush");
    assert_eq!(api.flush(&s, 1).ok(), Some(1));
    assert_eq!(api.visible(), vec![10, 11], "flush is inclusive");
    assert_eq!(api.flush(&s, 0).ok(), Some(0), "flushing an already flushed offset succeeds");
    assert_eq!(api.visible(), vec![10, 11], "and changes nothing");
    assert_eq!(api.flush(&s, 3).ok(), Some(3));
    assert_eq!(api.visible(), vec![10, 11, 12, 13]);
    let e = api.flush(&s, 4).expect_err("beyond the end");
    assert_eq!(e.code(), Code::OutOfRange);
    let details = RpcStatus::decode(e.details()).expect("grpc-status-details-bin is a google.rpc.Status");
    assert_eq!(storage_code(&details), Some(StorageErrorCode::OffsetOutOfRange));
}

/// A flush at or below the flushed offset changes nothing, and is answered
/// in whichever of the three ways the double is set to; a flush beyond the
/// end shares `OFFSET_OUT_OF_RANGE` with the third and differs in words.
#[test]
fn a_repeated_flush_is_answered_each_way_a_service_may() {
    use sluice_bigquery_double::Reflush;
    for answer in Reflush::ALL {
        let mut api = Api::new();
        api.double.answer_reflush(answer);
        let s = api.create(StreamType::Buffered);
        api.append(&s, &[(Some(0), vec![10, 11, 12])], false);
        assert_eq!(api.flush(&s, 1).ok(), Some(1), "{answer:?}: a first flush");
        let again = api.flush(&s, 1);
        let below = api.flush(&s, 0);
        for result in [again, below] {
            match (answer, result) {
                (Reflush::Ok, Ok(_)) => {}
                (Reflush::AlreadyExists, Err(e)) => {
                    assert_eq!(e.code(), Code::AlreadyExists);
                    let details = RpcStatus::decode(e.details()).expect("details");
                    assert_eq!(storage_code(&details), Some(StorageErrorCode::OffsetAlreadyExists));
                }
                (Reflush::OutOfRange, Err(e)) => {
                    assert_eq!(e.code(), Code::OutOfRange);
                    assert!(e.message().contains("already flushed; next expected > 1"), "{}", e.message());
                    let details = RpcStatus::decode(e.details()).expect("details");
                    assert_eq!(storage_code(&details), Some(StorageErrorCode::OffsetOutOfRange));
                }
                (answer, other) => panic!("{answer:?}: unexpected {other:?}"),
            }
        }
        assert_eq!(api.visible(), vec![10, 11], "{answer:?}: a repeated flush changes nothing");
        let beyond = api.flush(&s, 3).expect_err("beyond the end");
        assert!(beyond.message().contains("is beyond the end of the stream"), "{}", beyond.message());
        assert_eq!(api.flush(&s, 2).ok(), Some(2), "{answer:?}: flushing further still works");
    }
}

/// Deleted and (when so set) finalized streams refuse a flush, naming why.
#[test]
fn deleted_and_finalized_streams_refuse_flushes() {
    let mut api = Api::new();
    let s = api.create(StreamType::Buffered);
    api.append(&s, &[(Some(0), vec![1, 2])], false);
    api.double.refuse_flush_when_finalized();
    assert!(api.double.finalize_stream(&s));
    let e = api.flush(&s, 1).expect_err("finalized");
    assert_eq!(e.code(), Code::FailedPrecondition);
    let details = RpcStatus::decode(e.details()).expect("details");
    assert_eq!(storage_code(&details), Some(StorageErrorCode::StreamFinalized));
    assert!(api.double.delete_stream(&s));
    let e = api.flush(&s, 1).expect_err("deleted");
    assert_eq!(e.code(), Code::NotFound);
    let details = RpcStatus::decode(e.details()).expect("details");
    assert_eq!(storage_code(&details), Some(StorageErrorCode::StreamNotFound));
}

#[test]
fn committed_pending_and_finalized_streams_follow_their_types() {
    let mut api = Api::new();
    let committed = api.create(StreamType::Committed);
    api.append(&committed, &[(None, vec![1])], false);
    assert_eq!(api.visible(), vec![1], "COMMITTED rows are visible at once");
    let e = api.flush(&committed, 0).expect_err("flush needs BUFFERED");
    assert_eq!(e.code(), Code::InvalidArgument);

    let pending = api.create(StreamType::Pending);
    api.append(&pending, &[(Some(0), vec![2])], false);
    let commit = |api: &mut Api| {
        let req = BatchCommitWriteStreamsRequest { parent: TABLE.into(), write_streams: vec![pending.clone()] };
        api.rt.block_on(api.client.batch_commit_write_streams(req)).expect("batch commit").into_inner()
    };
    let early = commit(&mut api);
    assert_eq!(early.stream_errors.len(), 1, "a PENDING stream must be finalized first");
    assert_eq!(api.visible(), vec![1]);
    let fin = api.rt.block_on(api.client.finalize_write_stream(FinalizeWriteStreamRequest { name: pending.clone() }));
    assert_eq!(fin.expect("finalize").into_inner().row_count, 1);
    let replies = api.append(&pending, &[(Some(1), vec![3])], false);
    assert_eq!(in_band(&replies[0]).1, Some(StorageErrorCode::StreamFinalized));
    assert!(commit(&mut api).stream_errors.is_empty());
    assert_eq!(api.visible(), vec![1, 2]);
}

#[test]
fn schemas_tables_and_the_size_limit_are_checked() {
    let mut api = Api::new();
    let full = api.rt.block_on(api.client.get_write_stream(GetWriteStreamRequest {
        name: format!("{TABLE}/streams/_default"),
        view: WriteStreamView::Full as i32,
    }));
    assert_eq!(full.expect("get").into_inner().table_schema.map(|s| s.fields.len()), Some(1));
    let missing = api.rt.block_on(api.client.get_write_stream(GetWriteStreamRequest {
        name: "projects/p/datasets/d/tables/nope/streams/_default".into(),
        view: WriteStreamView::Full as i32,
    }));
    let e = missing.expect_err("no such table");
    assert_eq!(e.code(), Code::NotFound);
    assert_eq!(storage_code(&RpcStatus::decode(e.details()).expect("details")), Some(StorageErrorCode::TableNotFound));

    let s = api.create(StreamType::Buffered);
    let replies = api.append(&s, &[(Some(0), vec![1])], true);
    assert_eq!(in_band(&replies[0]), (Code::InvalidArgument, Some(StorageErrorCode::SchemaMismatchExtraFields)));

    let big: Vec<i64> = (0..2_000_000).collect(); // about 12 MB
    let replies = api.append(&s, &[(Some(0), big)], false);
    assert_eq!(in_band(&replies[0]).0, Code::InvalidArgument, "requests over 10 MB are refused");
    assert_eq!(api.double.stats().rows_appended, 0);
}

/// `arrow_rows`: the writer schema is read from the first request, the
/// record batches with it; types are checked against the table, REQUIRED
/// columns per row; the rows read back like proto rows.
#[test]
fn arrow_rows_are_read_with_the_connections_writer_schema() {
    use std::sync::Arc;

    use arrow_array::{Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};
    use sluice_bigquery_double::proto::append_rows_request::ArrowData;
    use sluice_bigquery_double::proto::{ArrowRecordBatch, ArrowSchema};

    let ipc = |schema: &Arc<Schema>, batch: Option<&RecordBatch>| -> (Vec<u8>, Vec<u8>) {
        let mut w = arrow_ipc::writer::StreamWriter::try_new(Vec::new(), schema).expect("writer");
        if let Some(b) = batch {
            w.write(b).expect("write");
        }
        let bytes = w.into_inner().expect("bytes");
        // A stream is the schema message, then the batch messages: split them.
        let schema_len = {
            let mut w = arrow_ipc::writer::StreamWriter::try_new(Vec::new(), schema).expect("writer");
            w.flush().expect("flush");
            w.get_ref().len()
        };
        (bytes[..schema_len].to_vec(), bytes[schema_len..].to_vec())
    };
    let mut api = Api::new();
    let table = TableSchema {
        fields: vec![column("id", Type::Int64, Mode::Required), column("extra", Type::String, Mode::Nullable)],
    };
    api.double.create_table("projects/p/datasets/d/tables/a", table);
    let stream = api.create_on("projects/p/datasets/d/tables/a", StreamType::Committed);
    let good = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("extra", DataType::Utf8, true),
    ]));
    let batch = RecordBatch::try_new(
        good.clone(),
        vec![Arc::new(Int64Array::from(vec![1, 2])), Arc::new(StringArray::from(vec![Some("a"), None]))],
    )
    .expect("batch");
    let (schema_bytes, batch_bytes) = ipc(&good, Some(&batch));
    let request = |schema: Option<&[u8]>, rows: &[u8], offset: i64| AppendRowsRequest {
        write_stream: stream.clone(),
        offset: Some(offset),
        rows: Some(Rows::ArrowRows(ArrowData {
            writer_schema: schema.map(|s| ArrowSchema { serialized_schema: s.to_vec() }),
            rows: Some(ArrowRecordBatch { serialized_record_batch: rows.to_vec(), ..Default::default() }),
        })),
        ..Default::default()
    };
    // The second request carries no schema: the connection's first one reads it.
    let replies =
        api.append_requests(vec![request(Some(&schema_bytes), &batch_bytes, 0), request(None, &batch_bytes, 2)]);
    assert!(replies.iter().all(|r| matches!(r.response, Some(Reply::AppendResult(_)))), "{replies:?}");
    let rows = api.double.visible_rows("projects/p/datasets/d/tables/a");
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0].get("id"), Some(&serde_json::json!(1)));
    assert_eq!(rows[0].get("extra"), Some(&serde_json::json!("a")));
    assert_eq!(rows[1].get("extra"), None, "a null reads as absent");

    // Int32 where the table has INT64: refused, naming the field.
    let narrow = Arc::new(Schema::new(vec![Field::new("id", DataType::Int32, false)]));
    let (narrow_schema, _) = ipc(&narrow, None);
    let replies = api.append_requests(vec![request(Some(&narrow_schema), &batch_bytes, 4)]);
    let Some(Reply::Error(status)) = &replies[0].response else { panic!("{replies:?}") };
    assert_eq!(status.code, Code::InvalidArgument as i32);
    assert!(status.message.contains("Field id: Arrow type Int32 cannot land in a INT64 column"), "{}", status.message);

    // A null in the REQUIRED column is a row error; nothing of the request lands.
    let nullable = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, true)]));
    let with_null =
        RecordBatch::try_new(nullable.clone(), vec![Arc::new(Int64Array::from(vec![Some(5), None]))]).expect("batch");
    let (s, b) = ipc(&nullable, Some(&with_null));
    let replies = api.append_requests(vec![request(Some(&s), &b, 4)]);
    assert_eq!(replies[0].row_errors.len(), 1, "{replies:?}");
    assert_eq!(replies[0].row_errors[0].index, 1);
    assert_eq!(api.double.visible_rows("projects/p/datasets/d/tables/a").len(), 4);
}
