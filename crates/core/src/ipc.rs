//! Arrow IPC stream encoding: the only form in which rows cross into a plugin.

use arrow_array::RecordBatch;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{ArrowError, Schema};

/// One batch as a complete IPC stream (schema, batch, end marker).
pub fn encode_batch(batch: &RecordBatch) -> Result<Vec<u8>, ArrowError> {
    let mut writer = StreamWriter::try_new(Vec::with_capacity(batch.get_array_memory_size() + 1024), &batch.schema())?;
    writer.write(batch)?;
    writer.finish()?;
    writer.into_inner()
}

/// A schema as an IPC stream without batches.
pub fn encode_schema(schema: &Schema) -> Result<Vec<u8>, ArrowError> {
    let mut writer = StreamWriter::try_new(Vec::new(), schema)?;
    writer.finish()?;
    writer.into_inner()
}

/// The schema of an IPC stream (as [`encode_schema`] writes it).
pub fn decode_schema(bytes: &[u8]) -> Result<arrow_schema::SchemaRef, ArrowError> {
    let reader = arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)?;
    Ok(reader.schema())
}

/// Checks that `bytes` are one whole IPC stream with a schema, whose batches
/// are valid Arrow data (as [`decode_batches`] checks them): what the host
/// promises of every batch it hands a plugin. Returns the stream's schema.
pub fn validate_stream(bytes: &[u8]) -> Result<arrow_schema::SchemaRef, ArrowError> {
    let (schema, _) = decode_stream(arrow_buffer::Buffer::from(bytes))?;
    schema.ok_or_else(|| ArrowError::IpcError("the stream has no schema".into()))
}

/// Why a batch's schema is not `table`'s: the columns a plugin reads by
/// position must be the table's, in its order and with its types.
pub fn schema_mismatch(batch: &Schema, table: &Schema) -> Option<String> {
    let names = |s: &Schema| s.fields().iter().map(|f| format!("{} {}", f.name(), f.data_type())).collect::<Vec<_>>();
    let same = batch.fields().len() == table.fields().len()
        && batch
            .fields()
            .iter()
            .zip(table.fields())
            .all(|(b, t)| b.name() == t.name() && b.data_type().equals_datatype(t.data_type()));
    (!same).then(|| {
        format!("its columns are [{}], the table's are [{}]", names(batch).join(", "), names(table).join(", "))
    })
}

/// The batches of a whole IPC stream, decoded in place (their columns are
/// slices of `bytes`) and validated as Arrow's readers validate: the bytes
/// may come from a plugin, which the host never trusts.
pub fn decode_batches(bytes: Vec<u8>) -> Result<Vec<RecordBatch>, ArrowError> {
    Ok(decode_stream(arrow_buffer::Buffer::from_vec(bytes))?.1)
}

/// The schema (if the stream has one) and the validated batches of a whole
/// IPC stream, decoded in place from `buffer`.
fn decode_stream(
    mut buffer: arrow_buffer::Buffer,
) -> Result<(Option<arrow_schema::SchemaRef>, Vec<RecordBatch>), ArrowError> {
    let mut decoder = arrow_ipc::reader::StreamDecoder::new();
    let mut batches = Vec::new();
    while !buffer.is_empty() {
        if let Some(batch) = decoder.decode(&mut buffer)? {
            batches.push(batch);
        }
    }
    decoder.finish()?;
    Ok((decoder.schema(), batches))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_schema::{DataType, Field};

    fn schema(fields: &[(&str, DataType)]) -> Schema {
        Schema::new(fields.iter().map(|(n, t)| Field::new(*n, t.clone(), true)).collect::<Vec<_>>())
    }

    #[test]
    fn a_batch_must_have_the_tables_columns_in_its_order() {
        let table = schema(&[("id", DataType::Int64), ("name", DataType::Utf8), ("note", DataType::Utf8)]);
        assert_eq!(schema_mismatch(&table, &table), None);
        // Nullability and field metadata are the plugin's business.
        let strict = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
            Field::new("note", DataType::Utf8, true),
        ]);
        assert_eq!(schema_mismatch(&strict, &table), None);
        // Same types, two columns exchanged: read by position, they would
        // land under each other's names.
        let swapped = schema(&[("id", DataType::Int64), ("note", DataType::Utf8), ("name", DataType::Utf8)]);
        let why = schema_mismatch(&swapped, &table).unwrap_or_default();
        assert!(
            why.contains("[id Int64, note Utf8, name Utf8]") && why.contains("[id Int64, name Utf8, note Utf8]"),
            "{why}"
        );
        assert!(schema_mismatch(&schema(&[("id", DataType::Int64)]), &table).is_some());
        let other_type = schema(&[("id", DataType::Int32), ("name", DataType::Utf8), ("note", DataType::Utf8)]);
        assert!(schema_mismatch(&other_type, &table).is_some());
    }

    #[test]
    fn validate_stream_answers_the_schema_and_refuses_bad_values() {
        use arrow_array::{ArrayRef, RecordBatch, StringArray};
        let names: ArrayRef = std::sync::Arc::new(StringArray::from(vec!["a", "b"]));
        let batch = RecordBatch::try_from_iter([("name", names)]).unwrap_or_else(|e| panic!("{e}"));
        let bytes = encode_batch(&batch).unwrap_or_else(|e| panic!("{e}"));
        let got = validate_stream(&bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got, batch.schema());
        // The second string's byte turned into one that is not UTF-8.
        let at = bytes.windows(2).rposition(|w| w == b"ab").unwrap_or_else(|| panic!("no string data"));
        let mut bad = bytes.clone();
        bad[at + 1] = 0xff;
        assert!(validate_stream(&bad).unwrap_err().to_string().to_lowercase().contains("utf"));
        assert!(validate_stream(&bytes[..bytes.len() / 2]).is_err());
        assert!(validate_stream(&[]).is_err());
    }
}
