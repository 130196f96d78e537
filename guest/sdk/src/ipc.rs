//! Arrow IPC stream decoding for batches that cross the component boundary.
//!
//! Invariants:
//! - the batches read the bytes the host handed over in place (no copy of
//!   the column data, except a buffer Arrow finds misaligned);
//! - the values are not validated again: the contract has the host send only
//!   valid streams (each encoded from Arrow data it holds, or validated as
//!   Arrow's readers validate, as the Python package does with a user's own
//!   bytes). The structure is still checked: the framing of every message,
//!   its flatbuffer, its kind and order (the schema first, once). A host
//!   that broke its word would harm only this sandbox's output, never the
//!   host;
//! - a stream cut short, or bytes after its end-of-stream marker, is an
//!   error, not fewer rows.

use crate::SinkError;
use arrow_array::RecordBatch;
use arrow_buffer::Buffer;
use arrow_ipc::reader::{FileDecoder, StreamReader};
use arrow_ipc::{Block, MessageHeader};
use arrow_schema::SchemaRef;

/// The first four bytes of a message's length prefix (since Arrow 0.15).
const CONTINUATION: u32 = 0xFFFF_FFFF;

fn corrupt(what: impl std::fmt::Display) -> SinkError {
    SinkError::InvalidData(format!("batch is not a valid Arrow IPC stream: {what}"))
}

/// Decodes an Arrow IPC stream into its schema and record batches.
///
/// Takes the bytes by value: the batches' columns are slices of them.
///
/// Why the messages are framed here rather than by arrow-ipc's
/// `StreamDecoder`: in arrow-ipc 58 its `with_skip_validation` reaches only
/// dictionary batches, so every record batch was validated again (UTF-8 and
/// offsets of every string: 6 % of a BigQuery writer's CPU). `FileDecoder`
/// honours the flag and decodes one message from a buffer in place; this
/// walks the stream's messages (each `[0xFFFFFFFF][metadata length]
/// [flatbuffer Message][body]`, the layout both formats share) and hands
/// each to it.
pub fn decode(bytes: Vec<u8>) -> Result<(SchemaRef, Vec<RecordBatch>), SinkError> {
    let buffer = Buffer::from_vec(bytes);
    let all = buffer.as_slice();
    let mut decoder: Option<(SchemaRef, FileDecoder)> = None;
    let mut batches = Vec::new();
    let mut at = 0usize;
    while at < all.len() {
        let rest = &all[at..];
        let word = |i: usize| -> Result<u32, SinkError> {
            let b = rest.get(i..i + 4).ok_or_else(|| corrupt("the stream is cut short inside a message's length"))?;
            Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let (prefix, meta_len) = match word(0)? {
            CONTINUATION => (8usize, word(4)?),
            legacy => (4usize, legacy),
        };
        if meta_len == 0 {
            // The end-of-stream marker: nothing may follow it.
            if at + prefix != all.len() {
                return Err(corrupt("bytes follow the end-of-stream marker"));
            }
            break;
        }
        let meta_end = usize::try_from(meta_len)
            .ok()
            .filter(|n| *n <= i32::MAX as usize)
            .and_then(|n| prefix.checked_add(n))
            .filter(|end| *end <= rest.len())
            .ok_or_else(|| corrupt("the stream is cut short inside a message's metadata"))?;
        let message = arrow_ipc::root_as_message(&rest[prefix..meta_end]).map_err(|e| corrupt(format!("{e:?}")))?;
        let body = usize::try_from(message.bodyLength()).map_err(|_| corrupt("a message's body length is negative"))?;
        let end = meta_end
            .checked_add(body)
            .filter(|end| *end <= rest.len())
            .ok_or_else(|| corrupt("the stream is cut short inside a message's body"))?;
        // `meta_end` fits an i32 (checked above); the body an i64.
        let block = Block::new(0, meta_end as i32, body as i64);
        let data = buffer.slice_with_length(at, end);
        match (message.header_type(), &mut decoder) {
            (MessageHeader::Schema, None) => {
                let fb = message.header_as_schema().ok_or_else(|| corrupt("a schema message holds no schema"))?;
                let schema = std::sync::Arc::new(arrow_ipc::convert::fb_to_schema(fb));
                // SAFETY: the host sends only valid Arrow data (see the
                // module's invariants); whatever reads it stays in the sandbox.
                let file = unsafe { FileDecoder::new(schema.clone(), message.version()).with_skip_validation(true) };
                decoder = Some((schema, file));
            }
            (MessageHeader::Schema, Some(_)) => return Err(corrupt("a second schema message")),
            (MessageHeader::DictionaryBatch, Some((_, file))) => {
                file.read_dictionary(&block, &data).map_err(corrupt)?;
            }
            (MessageHeader::RecordBatch, Some((_, file))) => {
                if let Some(batch) = file.read_record_batch(&block, &data).map_err(corrupt)? {
                    batches.push(batch);
                }
            }
            (MessageHeader::DictionaryBatch | MessageHeader::RecordBatch, None) => {
                return Err(corrupt("a batch comes before the schema"));
            }
            (MessageHeader::NONE, _) => {}
            (other, _) => return Err(corrupt(format!("unexpected message {other:?}"))),
        }
        at += end;
    }
    let (schema, _) = decoder.ok_or_else(|| corrupt("it has no schema"))?;
    Ok((schema, batches))
}

/// Decodes a schema-only Arrow IPC stream.
pub fn decode_schema(bytes: &[u8]) -> Result<SchemaRef, SinkError> {
    let reader = StreamReader::try_new(bytes, None)
        .map_err(|e| SinkError::Config(format!("schema is not a valid Arrow IPC stream: {e}")))?;
    Ok(reader.schema())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, DictionaryArray, Int64Array, StringArray, types::Int32Type};
    use std::sync::Arc;

    fn stream(batches: &[RecordBatch]) -> Vec<u8> {
        let mut w = arrow_ipc::writer::StreamWriter::try_new(Vec::new(), &batches[0].schema()).unwrap();
        for b in batches {
            w.write(b).unwrap();
        }
        w.finish().unwrap();
        w.into_inner().unwrap()
    }

    fn sample(from: i64) -> RecordBatch {
        let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(from..from + 3));
        let names: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None, Some("ccc")]));
        let kinds: ArrayRef = Arc::new(DictionaryArray::<Int32Type>::from_iter(["x", "y", "x"]));
        RecordBatch::try_from_iter([("id", ids), ("name", names), ("kind", kinds)]).unwrap()
    }

    #[test]
    fn decodes_what_arrow_writes_batch_for_batch() {
        let batches = [sample(0), sample(3)];
        let (schema, got) = decode(stream(&batches)).unwrap();
        assert_eq!(schema, batches[0].schema());
        assert_eq!(got, batches);
    }

    #[test]
    fn structure_is_still_checked() {
        let bytes = stream(&[sample(0)]);
        for cut in [1, 6, 20, bytes.len() / 2, bytes.len() - 9] {
            let err = decode(bytes[..cut].to_vec()).unwrap_err();
            assert!(err.to_string().contains("not a valid Arrow IPC stream"), "{cut}: {err}");
        }
        let mut trailing = bytes.clone();
        trailing.extend_from_slice(&bytes);
        assert!(decode(trailing).unwrap_err().to_string().contains("follow the end-of-stream"));
        assert!(decode(b"not arrow at all".to_vec()).is_err());
        assert!(decode(Vec::new()).unwrap_err().to_string().contains("no schema"));
        // Without its end-of-stream marker the stream still holds whole batches.
        let (_, got) = decode(bytes[..bytes.len() - 8].to_vec()).unwrap();
        assert_eq!(got, [sample(0)]);
    }
}
