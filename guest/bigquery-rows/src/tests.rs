//! Round trips through prost-reflect: what the encoder writes is what a
//! protobuf decoder reading the writer schema sees.

use std::sync::Arc;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::{
    ArrayRef, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Decimal256Array, Float64Array, Int32Array,
    Int64Array, RecordBatch, StringArray, StructArray, TimestampMicrosecondArray, TimestampMillisecondArray,
};
use arrow_buffer::i256;
use arrow_schema::{DataType, Field, Schema, TimeUnit};
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, Value};
use prost_types::{FileDescriptorProto, FileDescriptorSet};

use super::*;

fn all_types() -> (Arc<Schema>, RecordBatch) {
    let point = Fields::from(vec![Field::new("x", DataType::Int64, false), Field::new("label", DataType::Utf8, true)]);
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("qty", DataType::Int32, true),
        Field::new("price", DataType::Float64, false),
        Field::new("amount", DataType::Decimal128(18, 2), false),
        Field::new("big", DataType::Decimal256(60, 20), false),
        Field::new("ok", DataType::Boolean, false),
        Field::new("name", DataType::Utf8, false),
        Field::new("raw", DataType::Binary, false),
        Field::new("day", DataType::Date32, false),
        Field::new("civil", DataType::Timestamp(TimeUnit::Microsecond, None), false),
        Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false),
        Field::new("tags", DataType::List(Arc::new(Field::new("item", DataType::Int64, true))), true),
        Field::new("point", DataType::Struct(point.clone()), true),
    ]));
    let mut tags = ListBuilder::new(Int64Builder::new());
    tags.values().append_value(1);
    tags.values().append_value(2);
    tags.append(true);
    tags.append(false);
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(vec![7, -8])),
        Arc::new(Int32Array::from(vec![Some(3), None])),
        Arc::new(Float64Array::from(vec![1.5, -0.25])),
        Arc::new(Decimal128Array::from(vec![12345, -5]).with_precision_and_scale(18, 2).unwrap()),
        Arc::new(
            Decimal256Array::from(vec![i256::from_i128(1), i256::from_i128(-123_456_789_012_345_678_901_234_567)])
                .with_precision_and_scale(60, 20)
                .unwrap(),
        ),
        Arc::new(BooleanArray::from(vec![true, false])),
        Arc::new(StringArray::from(vec!["ä", ""])),
        Arc::new(BinaryArray::from(vec![&b"\x00\x01"[..], &b""[..]])),
        Arc::new(Date32Array::from(vec![19_723, -1])),
        Arc::new(TimestampMicrosecondArray::from(vec![1_704_067_200_000_001, -1])),
        Arc::new(TimestampMicrosecondArray::from(vec![1_704_067_200_000_000, 0]).with_timezone("UTC")),
        Arc::new(tags.finish()),
        Arc::new(StructArray::new(
            point,
            vec![Arc::new(Int64Array::from(vec![10, 20])), Arc::new(StringArray::from(vec![Some("p"), None]))],
            Some(vec![true, false].into()),
        )),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).unwrap();
    (schema, batch)
}

fn decode(enc: &RowEncoder, rows: &[Vec<u8>]) -> Vec<DynamicMessage> {
    let desc = enc.writer_schema().proto_descriptor.unwrap();
    let set = FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("w.proto".into()),
            message_type: vec![desc],
            ..Default::default()
        }],
    };
    let pool = DescriptorPool::decode(set.encode_to_vec().as_slice()).unwrap();
    let md = pool.get_message_by_name(ROW_MESSAGE).unwrap();
    rows.iter().map(|r| DynamicMessage::decode(md.clone(), r.as_slice()).unwrap()).collect()
}

fn get(m: &DynamicMessage, name: &str) -> Option<Value> {
    m.get_field_by_name(name).filter(|_| m.has_field_by_name(name)).map(|v| v.into_owned())
}

#[test]
fn every_supported_type_round_trips_through_the_writer_schema() {
    let (schema, batch) = all_types();
    let table = RowEncoder::table_schema(&schema).unwrap();
    let enc = RowEncoder::new(schema, Some(&table)).unwrap();
    let mut rows = Vec::new();
    enc.encode(&batch, &mut rows).unwrap();
    let msgs = decode(&enc, &rows);
    let (a, b) = (&msgs[0], &msgs[1]);
    assert_eq!(get(a, "id"), Some(Value::I64(7)));
    assert_eq!(get(b, "id"), Some(Value::I64(-8)));
    assert_eq!(get(a, "qty"), Some(Value::I64(3)));
    assert_eq!(get(b, "qty"), None, "a null is an absent field");
    assert_eq!(get(b, "price"), Some(Value::F64(-0.25)));
    assert_eq!(get(a, "amount"), Some(Value::String("123.45".into())));
    assert_eq!(get(b, "amount"), Some(Value::String("-0.05".into())));
    assert_eq!(get(a, "big"), Some(Value::String("0.00000000000000000001".into())));
    assert_eq!(get(b, "big"), Some(Value::String("-1234567.89012345678901234567".into())));
    assert_eq!(get(a, "ok"), Some(Value::Bool(true)));
    assert_eq!(get(a, "name"), Some(Value::String("ä".into())));
    assert_eq!(get(a, "raw"), Some(Value::Bytes(vec![0, 1].into())));
    assert_eq!(get(a, "day"), Some(Value::I32(19_723)));
    assert_eq!(get(b, "day"), Some(Value::I32(-1)));
    assert_eq!(get(a, "civil"), Some(Value::String("2024-01-01 00:00:00.000001".into())));
    assert_eq!(get(b, "civil"), Some(Value::String("1969-12-31 23:59:59.999999".into())));
    assert_eq!(get(a, "ts"), Some(Value::I64(1_704_067_200_000_000)));
    assert_eq!(get(a, "tags"), Some(Value::List(vec![Value::I64(1), Value::I64(2)])));
    assert_eq!(get(b, "tags"), None, "a null list is an empty REPEATED field");
    let Some(Value::Message(p)) = get(a, "point") else { panic!("point is a message") };
    assert_eq!(get(&p, "x"), Some(Value::I64(10)));
    assert_eq!(get(&p, "label"), Some(Value::String("p".into())));
    assert_eq!(get(b, "point"), None);
}

#[test]
fn table_schema_maps_types_and_modes() {
    let (schema, _) = all_types();
    let t = RowEncoder::table_schema(&schema).unwrap();
    let ty = |n: &str| {
        let f = t.fields.iter().find(|f| f.name == n).unwrap();
        (Type::try_from(f.r#type).unwrap(), Mode::try_from(f.mode).unwrap())
    };
    assert_eq!(ty("id"), (Type::Int64, Mode::Required));
    assert_eq!(ty("qty"), (Type::Int64, Mode::Nullable));
    assert_eq!(ty("amount").0, Type::Numeric);
    assert_eq!(ty("big").0, Type::Bignumeric);
    assert_eq!(ty("civil").0, Type::Datetime);
    assert_eq!(ty("ts").0, Type::Timestamp);
    assert_eq!(ty("tags"), (Type::Int64, Mode::Repeated));
    assert_eq!(ty("point").0, Type::Struct);
}

#[test]
fn mismatches_name_the_column() {
    let (schema, _) = all_types();
    let mut table = RowEncoder::table_schema(&schema).unwrap();
    table.fields[6].r#type = Type::Int64 as i32; // name: STRING -> INT64
    let e = RowEncoder::new(schema.clone(), Some(&table)).unwrap_err();
    assert!(matches!(&e, SchemaError::Mismatch { column, .. } if column == "name"), "{e}");

    let mut table = RowEncoder::table_schema(&schema).unwrap();
    table.fields.retain(|f| f.name != "raw");
    let e = RowEncoder::new(schema.clone(), Some(&table)).unwrap_err();
    assert!(matches!(&e, SchemaError::NotInTable { column, .. } if column == "raw"), "{e}");

    let mut table = RowEncoder::table_schema(&schema).unwrap();
    table.fields[1].mode = Mode::Required as i32; // qty is nullable
    let e = RowEncoder::new(schema.clone(), Some(&table)).unwrap_err();
    assert_eq!(e, SchemaError::NullableIntoRequired { column: "qty".into() });

    let mut table = RowEncoder::table_schema(&schema).unwrap();
    table.fields.push(TableFieldSchema {
        name: "extra".into(),
        r#type: Type::String as i32,
        mode: Mode::Required as i32,
        ..Default::default()
    });
    let e = RowEncoder::new(schema.clone(), Some(&table)).unwrap_err();
    assert_eq!(e, SchemaError::MissingRequired { column: "extra".into() });

    let nested = Arc::new(Schema::new(vec![Field::new("u", DataType::UInt64, false)]));
    let e = RowEncoder::new(nested, None).unwrap_err();
    assert!(e.to_string().contains("column `u`"), "{e}");
}

#[test]
fn split_keeps_every_request_under_the_limit() {
    let rows: Vec<Vec<u8>> = (0..100).map(|i| vec![0u8; 100 + i]).collect();
    let runs = split_by_size(&rows, 1000);
    assert_eq!(runs.first().map(|r| r.start), Some(0));
    assert_eq!(runs.last().map(|r| r.end), Some(100));
    for w in runs.windows(2) {
        assert_eq!(w[0].end, w[1].start);
    }
    for r in &runs {
        let size: usize = rows[r.clone()].iter().map(|x| x.len() + 1 + prost::length_delimiter_len(x.len())).sum();
        assert!(size <= 1000 || r.len() == 1, "{r:?} has {size} bytes");
    }
}

#[test]
fn json_schemas_as_bq_prints_them_parse() {
    let t = parse_table_schema(
        r#"[{"name":"id","type":"INTEGER","mode":"REQUIRED"},{"name":"p","type":"RECORD","mode":"REPEATED","fields":[{"name":"x","type":"FLOAT"}]}]"#,
    )
    .unwrap();
    assert_eq!(t.fields[0].r#type, Type::Int64 as i32);
    assert_eq!(t.fields[0].mode, Mode::Required as i32);
    assert_eq!(t.fields[1].mode, Mode::Repeated as i32);
    assert_eq!(t.fields[1].fields[0].r#type, Type::Double as i32);
    assert_eq!(t.fields[1].fields[0].mode, Mode::Nullable as i32);
    assert!(parse_table_schema(r#"[{"name":"a","type":"DECIMAL"}]"#).unwrap_err().contains("column `a`"));
}

/// Every column the per-batch readers take, nullable, with a null in row 1.
fn nullable_fast_types() -> (Arc<Schema>, RecordBatch) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("qty", DataType::Int32, true),
        Field::new("price", DataType::Float64, true),
        Field::new("ok", DataType::Boolean, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("raw", DataType::Binary, true),
        Field::new("day", DataType::Date32, true),
        Field::new("ts", DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())), true),
        Field::new("amount", DataType::Decimal128(38, 2), true),
    ]));
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(vec![Some(-1), None, Some(i64::MAX)])),
        Arc::new(Int32Array::from(vec![Some(-7), None, Some(9)])),
        Arc::new(Float64Array::from(vec![Some(0.5), None, Some(-2.0)])),
        Arc::new(BooleanArray::from(vec![Some(false), None, Some(true)])),
        Arc::new(StringArray::from(vec![Some("a"), None, Some("ü")])),
        Arc::new(BinaryArray::from(vec![Some(&b"\x00"[..]), None, Some(&b"xy"[..])])),
        Arc::new(Date32Array::from(vec![Some(-3), None, Some(20_000)])),
        Arc::new(TimestampMillisecondArray::from(vec![Some(-1), None, Some(1_704_067_200_123)]).with_timezone("UTC")),
        Arc::new(
            Decimal128Array::from(vec![Some(1), None, Some(i128::from(i64::MAX) * 1000)])
                .with_precision_and_scale(38, 2)
                .unwrap(),
        ),
    ];
    let batch = RecordBatch::try_new(schema.clone(), cols).unwrap();
    (schema, batch)
}

#[test]
fn per_batch_readers_give_the_bytes_of_the_general_path() {
    for (schema, batch) in [all_types(), nullable_fast_types()] {
        let table = RowEncoder::table_schema(&schema).unwrap();
        let enc = RowEncoder::new(schema, Some(&table)).unwrap();
        // A slice reads at an offset into the column buffers.
        for b in [batch.clone(), batch.slice(1, batch.num_rows() - 1)] {
            let mut fast = Vec::new();
            enc.encode(&b, &mut fast).unwrap();
            let cols: Vec<&ArrayRef> = b.columns().iter().collect();
            let general: Vec<Vec<u8>> = (0..b.num_rows())
                .map(|row| {
                    let mut buf = Vec::new();
                    encode_row(&enc.plans, &cols, row, &mut buf, &mut Vec::new());
                    buf
                })
                .collect();
            assert_eq!(fast, general);
        }
    }
    // A row of nulls only is a message with no fields; the others have some.
    let (schema, batch) = nullable_fast_types();
    let table = RowEncoder::table_schema(&schema).unwrap();
    let mut rows = Vec::new();
    RowEncoder::new(schema, Some(&table)).unwrap().encode(&batch, &mut rows).unwrap();
    assert_eq!(rows.iter().map(Vec::is_empty).collect::<Vec<_>>(), [false, true, false]);
}
