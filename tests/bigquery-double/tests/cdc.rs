//! The double's change data capture through tonic's generated client over
//! loopback, as "Stream table updates with change data capture"
//! (https://cloud.google.com/bigquery/docs/change-data-capture) documents
//! it: UPSERT and DELETE by primary key on the `_default` stream, ordered by
//! `_CHANGE_SEQUENCE_NUMBER`; refused on a table without a primary key, on
//! another stream, and for a change type other than UPSERT and DELETE.

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type as ProtoType};
use prost_types::{DescriptorProto, FieldDescriptorProto};
use sluice_bigquery_double::proto::append_rows_request::{ProtoData, Rows};
use sluice_bigquery_double::proto::append_rows_response::Response as Reply;
use sluice_bigquery_double::proto::big_query_write_client::BigQueryWriteClient;
use sluice_bigquery_double::proto::table_field_schema::{Mode, Type};
use sluice_bigquery_double::proto::write_stream::Type as StreamType;
use sluice_bigquery_double::proto::{
    AppendRowsRequest, AppendRowsResponse, CreateWriteStreamRequest, ProtoRows, ProtoSchema, TableSchema, WriteStream,
};
use sluice_bigquery_double::{BigQueryDouble, EqualSequence, column};
use tonic::Code;
use tonic::transport::Channel;

const KEYED: &str = "projects/p/datasets/d/tables/keyed";
const PLAIN: &str = "projects/p/datasets/d/tables/plain";

#[derive(Clone, PartialEq, prost::Message)]
struct Change {
    #[prost(int64, optional, tag = "1")]
    id: Option<i64>,
    #[prost(int64, optional, tag = "2")]
    v: Option<i64>,
    #[prost(string, optional, tag = "3")]
    change_type: Option<String>,
    #[prost(string, optional, tag = "4")]
    sequence: Option<String>,
}

fn descriptor() -> ProtoSchema {
    let field = |name: &str, n: i32, t: ProtoType| FieldDescriptorProto {
        name: Some(name.into()),
        number: Some(n),
        label: Some(Label::Optional as i32),
        r#type: Some(t as i32),
        ..Default::default()
    };
    let fields = vec![
        field("id", 1, ProtoType::Int64),
        field("v", 2, ProtoType::Int64),
        field("_CHANGE_TYPE", 3, ProtoType::String),
        field("_CHANGE_SEQUENCE_NUMBER", 4, ProtoType::String),
    ];
    ProtoSchema {
        proto_descriptor: Some(DescriptorProto { name: Some("change".into()), field: fields, ..Default::default() }),
    }
}

fn schema() -> TableSchema {
    TableSchema { fields: vec![column("id", Type::Int64, Mode::Required), column("v", Type::Int64, Mode::Nullable)] }
}

struct Api {
    rt: tokio::runtime::Runtime,
    client: BigQueryWriteClient<Channel>,
    double: BigQueryDouble,
}

impl Api {
    fn new() -> Self {
        let double = BigQueryDouble::start().expect("double");
        double.create_keyed_table(KEYED, schema(), &["id"], Some("0-0 0 0:15:0"));
        double.create_table(PLAIN, schema());
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

    /// Sends one request of `changes` `(id, v, type, sequence)` to `stream`.
    fn send(&mut self, stream: &str, changes: &[(i64, Option<i64>, &str, &str)]) -> AppendRowsResponse {
        let rows = changes
            .iter()
            .map(|(id, v, t, s)| {
                Change { id: Some(*id), v: *v, change_type: Some(t.to_string()), sequence: Some(s.to_string()) }
                    .encode_to_vec()
            })
            .collect();
        let req = AppendRowsRequest {
            write_stream: stream.into(),
            rows: Some(Rows::ProtoRows(ProtoData {
                writer_schema: Some(descriptor()),
                rows: Some(ProtoRows { serialized_rows: rows }),
            })),
            ..Default::default()
        };
        self.rt.block_on(async {
            let mut replies =
                self.client.append_rows(tokio_stream::iter(vec![req])).await.expect("append").into_inner();
            replies.message().await.expect("reply").expect("a reply")
        })
    }

    /// `(id, v)` of every row readers see, by id.
    fn rows(&self, table: &str) -> Vec<(i64, Option<i64>)> {
        let mut rows: Vec<(i64, Option<i64>)> = self
            .double
            .visible_rows(table)
            .iter()
            .map(|r| (r["id"].as_i64().expect("id"), r.get("v").and_then(|v| v.as_i64())))
            .collect();
        rows.sort();
        rows
    }
}

fn ok(reply: &AppendRowsResponse) {
    assert!(matches!(reply.response, Some(Reply::AppendResult(_))), "{reply:?}");
}

fn refused(reply: &AppendRowsResponse) -> String {
    match &reply.response {
        Some(Reply::Error(s)) => {
            assert_eq!(Code::from_i32(s.code), Code::InvalidArgument, "{s:?}");
            let rows: Vec<String> = reply.row_errors.iter().map(|e| e.message.clone()).collect();
            format!("{} {}", s.message, rows.join("; "))
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn upserts_and_deletes_apply_per_key_in_sequence_order() {
    for equal in EqualSequence::ALL {
        let mut api = Api::new();
        api.double.answer_equal_sequence(equal);
        let default = format!("{KEYED}/streams/_default");
        ok(&api.send(&default, &[(1, Some(10), "UPSERT", "0/1"), (2, Some(20), "UPSERT", "0/2")]));
        ok(&api.send(&default, &[(1, Some(11), "UPSERT", "0/3"), (2, None, "DELETE", "0/4")]));
        // Late and repeated changes: lower numbers are ignored, also after a
        // delete; an equal number as the double is told.
        ok(&api.send(&default, &[(1, Some(99), "UPSERT", "0/2"), (2, Some(99), "UPSERT", "0/3")]));
        ok(&api.send(&default, &[(1, Some(12), "UPSERT", "0/3")]));
        // A higher first section wins over any second one.
        ok(&api.send(&default, &[(3, Some(30), "UPSERT", "1/0"), (3, Some(31), "UPSERT", "0/FFFF")]));
        let one = if equal == EqualSequence::Apply { 12 } else { 11 };
        assert_eq!(api.rows(KEYED), vec![(1, Some(one)), (3, Some(30))], "{equal:?}");
        assert_eq!(api.double.primary_key(KEYED), Some(vec!["id".to_string()]));
        assert_eq!(api.double.max_staleness(KEYED).as_deref(), Some("0-0 0 0:15:0"));
    }
}

#[test]
fn changes_are_refused_where_the_page_does_not_allow_them() {
    let mut api = Api::new();
    // A table without a primary key.
    let e = refused(&api.send(&format!("{PLAIN}/streams/_default"), &[(1, Some(1), "UPSERT", "0/1")]));
    assert!(e.contains("primary key"), "{e}");
    // A stream other than `_default`.
    let req = CreateWriteStreamRequest {
        parent: KEYED.into(),
        write_stream: Some(WriteStream { r#type: StreamType::Committed as i32, ..Default::default() }),
    };
    let committed = api.rt.block_on(api.client.create_write_stream(req)).expect("create").into_inner().name;
    let e = refused(&api.send(&committed, &[(1, Some(1), "UPSERT", "0/1")]));
    assert!(e.contains("_default"), "{e}");
    // Another change type, a malformed number: row errors, nothing applied.
    let default = format!("{KEYED}/streams/_default");
    let e = refused(&api.send(&default, &[(1, Some(1), "UPSERT", "0/1"), (2, Some(2), "INSERT", "0/2")]));
    assert!(e.contains("only UPSERT and DELETE"), "{e}");
    let e = refused(&api.send(&default, &[(1, Some(1), "UPSERT", "0/G")]));
    assert!(e.contains("hexadecimal"), "{e}");
    assert!(api.rows(KEYED).is_empty(), "a refused request applies nothing");
    assert!(api.rows(PLAIN).is_empty());
}
