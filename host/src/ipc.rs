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
