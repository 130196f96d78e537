//! Arrow IPC stream decoding for batches that cross the component boundary.
//!
//! Invariants:
//! - the batches read the bytes the host handed over in place (no copy of
//!   the column data, except a buffer Arrow finds misaligned);
//! - the batches are not validated again: the contract has the host send only
//!   valid streams (each encoded from an in-memory Arrow batch, or checked as
//!   Arrow's readers check, as the Python package checks a user's own IPC
//!   bytes). The structure is still checked (a stream cut short, a message
//!   that is not a batch); the values (UTF-8, offsets) are the host's word.
//!   Checking them again was a fifth of an Iceberg writer's time and a
//!   tenth of a BigQuery writer's. A host that broke its word would harm
//!   only this sandbox's output, never the host;
//! - a stream cut short is an error, not fewer rows.

use crate::SinkError;
use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::reader::{StreamDecoder, StreamReader};
use arrow_schema::SchemaRef;

/// Decodes an Arrow IPC stream into its schema and record batches.
///
/// Takes the bytes by value: the batches' columns are slices of them.
pub fn decode(bytes: Vec<u8>) -> Result<(SchemaRef, Vec<RecordBatch>), SinkError> {
    let corrupt = |e| SinkError::InvalidData(format!("batch holds a corrupt Arrow record batch: {e}"));
    let mut buffer = Buffer::from_vec(bytes);
    // SAFETY: the values of a batch from the host are valid Arrow data (see
    // the module's invariants): the host encoded them from an in-memory
    // batch or validated them. Whatever reads them runs inside the sandbox.
    let mut decoder = unsafe { StreamDecoder::new().with_skip_validation(true) };
    let mut batches = Vec::new();
    // `decode` consumes the buffer until a batch is complete or nothing is left.
    while !buffer.is_empty() {
        if let Some(batch) = decoder.decode(&mut buffer).map_err(corrupt)? {
            batches.push(batch);
        }
    }
    decoder.finish().map_err(|e| SinkError::InvalidData(format!("batch is not a whole Arrow IPC stream: {e}")))?;
    let schema = decoder
        .schema()
        .ok_or_else(|| SinkError::InvalidData("batch is not a valid Arrow IPC stream: it has no schema".into()))?;
    Ok((schema, batches))
}

/// Decodes a schema-only Arrow IPC stream.
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef, SinkError> {
    let reader = StreamReader::try_new(bytes, None)
        .map_err(|e| SinkError::Config(format!("schema is not a valid Arrow IPC stream: {e}")))?;
    Ok(reader.schema())
}
