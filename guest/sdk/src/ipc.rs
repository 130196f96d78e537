//! Arrow IPC stream decoding for batches that cross the component boundary.

use crate::SinkError;
use arrow_array::RecordBatch;
use arrow_ipc::reader::StreamReader;
use arrow_schema::SchemaRef;

/// Decodes an Arrow IPC stream into its schema and record batches.
pub fn decode(bytes: &[u8]) -> Result<(SchemaRef, Vec<RecordBatch>), SinkError> {
    let reader = StreamReader::try_new(bytes, None)
        .map_err(|e| SinkError::InvalidData(format!("batch is not a valid Arrow IPC stream: {e}")))?;
    let schema = reader.schema();
    let batches = reader
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| SinkError::InvalidData(format!("batch holds a corrupt Arrow record batch: {e}")))?;
    Ok((schema, batches))
}

/// Decodes a schema-only Arrow IPC stream.
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef, SinkError> {
    let reader = StreamReader::try_new(bytes, None)
        .map_err(|e| SinkError::Config(format!("schema is not a valid Arrow IPC stream: {e}")))?;
    Ok(reader.schema())
}
