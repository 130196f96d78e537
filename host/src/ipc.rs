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
/// promises of every batch it hands a plugin.
pub fn validate_stream(bytes: &[u8]) -> Result<(), ArrowError> {
    let mut buffer = arrow_buffer::Buffer::from(bytes);
    let mut decoder = arrow_ipc::reader::StreamDecoder::new();
    while !buffer.is_empty() {
        decoder.decode(&mut buffer)?;
    }
    decoder.finish()?;
    if decoder.schema().is_none() {
        return Err(ArrowError::IpcError("the stream has no schema".into()));
    }
    Ok(())
}

/// The batches of a whole IPC stream, decoded in place (their columns are
/// slices of `bytes`) and validated as Arrow's readers validate: the bytes
/// may come from a plugin, which the host never trusts.
pub fn decode_batches(bytes: Vec<u8>) -> Result<Vec<RecordBatch>, ArrowError> {
    let mut buffer = arrow_buffer::Buffer::from_vec(bytes);
    let mut decoder = arrow_ipc::reader::StreamDecoder::new();
    let mut batches = Vec::new();
    while !buffer.is_empty() {
        if let Some(batch) = decoder.decode(&mut buffer)? {
            batches.push(batch);
        }
    }
    decoder.finish()?;
    Ok(batches)
}
