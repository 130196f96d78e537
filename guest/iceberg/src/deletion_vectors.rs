//! Format-version-3 deletion vectors (DVs): written for an upsert commit
//! on a format-version-3 table, and read back (ours and other writers')
//! for the key index and compaction.
//!
//! Invariants:
//! - a vector is the Puffin spec's `deletion-vector-v1` blob
//!   (<https://iceberg.apache.org/puffin-spec/#deletion-vector-v1-blob-type>):
//!   the combined length of magic and vector (4 bytes, big-endian), the
//!   magic `D1 D3 39 64`, the positions as a 64-bit Roaring bitmap in the
//!   portable format (the `roaring` crate's `RoaringTreemap` serialization:
//!   the number of 32-bit bitmaps as 8 bytes little-endian, then per bitmap
//!   in ascending key order its key as 4 bytes little-endian and the
//!   32-bit bitmap in the portable format), and the CRC-32 of magic and
//!   vector (4 bytes, big-endian); positions are below 2^63;
//! - one Puffin file holds exactly one vector, uncompressed, as blob 0 at
//!   offset 4 (iceberg's `PuffinWriter` writes the file magic, the blob,
//!   then the footer), with the blob metadata Java's `BaseDVFileWriter`
//!   writes: fields `[2147483545]` (the row position), snapshot id and
//!   sequence number -1 (inherited), properties `referenced-data-file`
//!   and `cardinality`. One vector per file lets a commit remove a vector by
//!   removing its file (snapshots remove files by location), and a reader
//!   that reads every blob of a Puffin file (PyIceberg 0.12) never meets
//!   another data file's vector;
//! - the delete-file entry is what the v3 table spec asks of a DV: content
//!   position deletes, format `puffin`, `record_count` the cardinality,
//!   `referenced_data_file` the data file, `content_offset` and
//!   `content_size_in_bytes` the blob's offset and length in the footer,
//!   and the data file's partition and spec;
//! - at most one live vector per data file: the committer merges the
//!   positions of a data file's live vector (and of live Parquet position
//!   deletes naming it) into the new vector and removes the old vector in
//!   the same snapshot.

use std::collections::HashMap;

use iceberg::io::FileIO;
use iceberg::puffin::{Blob, CompressionCodec, DELETION_VECTOR_V1, PuffinWriter};
use iceberg::spec::{DataContentType, DataFile, DataFileBuilder, DataFileFormat, Struct};
use iceberg::table::Table;
use roaring::RoaringTreemap;
use sluice_guest_sdk::{SinkError, error};

use crate::position_deletes::Group;
use crate::runtime::block_on;
use crate::snapshot::LoadedManifest;
use crate::writer::iceberg_error;

/// The spec's magic of a `deletion-vector-v1` blob.
pub(crate) const MAGIC: [u8; 4] = [0xD1, 0xD3, 0x39, 0x64];
/// The field id of the row position (`_pos`), which a DV blob names.
const ROW_POSITION_ID: i32 = 2147483545;
/// Where the one blob of a Puffin file Sluice writes starts: after the
/// file's magic `PFA1`.
const BLOB_OFFSET: u64 = 4;

/// Whether `file` is a deletion vector (a position-delete entry in Puffin).
pub(crate) fn is_vector(file: &DataFile) -> bool {
    file.content_type() == DataContentType::PositionDeletes && file.file_format() == DataFileFormat::Puffin
}

/// The `deletion-vector-v1` blob of `positions`.
pub(crate) fn serialize(positions: &RoaringTreemap) -> Result<Vec<u8>, String> {
    if positions.max().is_some_and(|p| p >= 1 << 63) {
        return Err("a deletion vector holds positions below 2^63 only".to_string());
    }
    let mut vector = Vec::with_capacity(positions.serialized_size() + 12);
    vector.extend_from_slice(&[0; 4]);
    vector.extend_from_slice(&MAGIC);
    positions.serialize_into(&mut vector).map_err(|e| format!("serializing a deletion vector: {e}"))?;
    let length = u32::try_from(vector.len() - 4).map_err(|_| "a deletion vector past 4 GiB".to_string())?;
    vector[..4].copy_from_slice(&length.to_be_bytes());
    let crc = crc32fast::hash(&vector[4..]);
    vector.extend_from_slice(&crc.to_be_bytes());
    Ok(vector)
}

/// The positions of a `deletion-vector-v1` blob; its length, magic and
/// CRC are checked.
pub(crate) fn deserialize(blob: &[u8]) -> Result<RoaringTreemap, String> {
    if blob.len() < 12 {
        return Err(format!("a deletion vector of {} bytes is too short", blob.len()));
    }
    let length = u32::from_be_bytes([blob[0], blob[1], blob[2], blob[3]]) as usize;
    if length + 8 != blob.len() {
        return Err(format!("a deletion vector of {} bytes says it holds {length} bytes", blob.len()));
    }
    let (body, crc) = blob[4..].split_at(length);
    if body[..4] != MAGIC {
        return Err(format!("a deletion vector begins with {:02X?}, not the magic D1 D3 39 64", &body[..4]));
    }
    let expected = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != expected {
        return Err("a deletion vector's CRC-32 does not match its bytes".to_string());
    }
    let mut bitmap = &body[4..];
    let positions = RoaringTreemap::deserialize_from(&mut bitmap)
        .map_err(|e| format!("reading a deletion vector's bitmap: {e}"))?;
    if !bitmap.is_empty() {
        return Err(format!("a deletion vector has {} bytes past its bitmap", bitmap.len()));
    }
    Ok(positions)
}

/// The deleted positions of one data file.
pub(crate) struct Vector {
    pub(crate) spec_id: i32,
    pub(crate) partition: Struct,
    pub(crate) data_file: String,
    pub(crate) positions: RoaringTreemap,
}

/// The vectors a commit on a format-version-3 table writes for the
/// deletes `groups` (data file → positions, by partition) on a head whose
/// manifests are `manifests`, and the live vectors they replace: a data
/// file's new vector holds its new positions, those of its live vector(s)
/// and those of live Parquet position-delete files that name it (a reader
/// may ignore those once a vector exists, as the v3 spec allows).
pub(crate) fn plan(
    table: &Table,
    manifests: &[LoadedManifest],
    groups: Vec<Group>,
) -> Result<(Vec<Vector>, Vec<String>), SinkError> {
    let mut vectors: HashMap<String, Vector> = HashMap::new();
    for group in groups {
        for (path, positions) in group.positions {
            let vector = vectors.entry(path.clone()).or_insert_with(|| Vector {
                spec_id: group.spec_id,
                partition: group.partition.clone(),
                data_file: path,
                positions: RoaringTreemap::new(),
            });
            vector.positions.extend(positions);
        }
    }
    let mut replaced = Vec::new();
    for m in manifests {
        for entry in m.entries.iter().filter(|e| e.is_alive()) {
            let file = entry.data_file();
            if file.content_type() != DataContentType::PositionDeletes {
                continue;
            }
            if is_vector(file) {
                let Some(target) = file.referenced_data_file() else { continue };
                if let Some(vector) = vectors.get_mut(&target) {
                    let (_, old) = read(table.file_io(), file)?;
                    vector.positions |= old;
                    replaced.push(file.file_path().to_string());
                }
                continue;
            }
            if file.referenced_data_file().is_some_and(|f| !vectors.contains_key(&f)) {
                continue;
            }
            for (path, pos) in crate::position_deletes::read(table.file_io(), file)? {
                if let Some(vector) = vectors.get_mut(&path) {
                    vector.positions.insert(pos);
                }
            }
        }
    }
    let mut vectors: Vec<Vector> = vectors.into_values().collect();
    vectors.sort_by(|a, b| a.data_file.cmp(&b.data_file));
    Ok((vectors, replaced))
}

/// Writes each vector as its own Puffin file, named
/// `<folder><n>-<uuid>.puffin` (`folder` ends in `/`), and describes each
/// as a delete file of its data file's partition. Empty vectors are skipped.
pub(crate) fn write(table: &Table, folder: &str, vectors: Vec<Vector>) -> Result<Vec<(i32, DataFile)>, SinkError> {
    let attempt = uuid::Uuid::new_v4().simple();
    let mut out = Vec::with_capacity(vectors.len());
    for (n, vector) in vectors.into_iter().enumerate() {
        if vector.positions.is_empty() {
            continue;
        }
        let location = format!("{folder}{n:05}-{attempt}.puffin");
        let blob = serialize(&vector.positions)
            .map_err(|m| error::fatal(format!("the deletion vector of {}: {m}", vector.data_file)))?;
        let length = blob.len() as u64;
        let cardinality = vector.positions.len();
        let file = block_on(async {
            let output = table.file_io().new_output(&location)?;
            let mut writer = PuffinWriter::new(
                &output,
                HashMap::from([(
                    iceberg::puffin::CREATED_BY_PROPERTY.to_string(),
                    format!("sluice iceberg sink {}", env!("CARGO_PKG_VERSION")),
                )]),
                false,
            )
            .await?;
            let properties = HashMap::from([
                ("referenced-data-file".to_string(), vector.data_file.clone()),
                ("cardinality".to_string(), cardinality.to_string()),
            ]);
            let blob = Blob::builder()
                .r#type(DELETION_VECTOR_V1.to_string())
                .fields(vec![ROW_POSITION_ID])
                .snapshot_id(-1)
                .sequence_number(-1)
                .data(blob)
                .properties(properties)
                .build();
            writer.add(blob, CompressionCodec::None).await?;
            writer.close().await?;
            let size = output.to_input_file().metadata().await?.size;
            let mut b = DataFileBuilder::default();
            b.content(DataContentType::PositionDeletes)
                .file_path(location.clone())
                .file_format(DataFileFormat::Puffin)
                .partition(vector.partition.clone())
                .partition_spec_id(vector.spec_id)
                .record_count(cardinality)
                .file_size_in_bytes(size)
                .referenced_data_file(Some(vector.data_file.clone()))
                .content_offset(Some(BLOB_OFFSET as i64))
                .content_size_in_bytes(Some(length as i64));
            b.build().map_err(|e| iceberg::Error::new(iceberg::ErrorKind::DataInvalid, e.to_string()))
        })
        .map_err(|e| iceberg_error(&format!("writing deletion vector {location}"), e))?;
        out.push((vector.spec_id, file));
    }
    Ok(out)
}

/// The data file deletion vector `file` applies to, and its positions
/// (read from the blob its entry's `content_offset` and
/// `content_size_in_bytes` point at).
pub(crate) fn read(io: &FileIO, file: &DataFile) -> Result<(String, RoaringTreemap), SinkError> {
    let path = file.file_path();
    let bad = |m: String| error::fatal(format!("deletion vector {path}: {m}"));
    let data_file = file.referenced_data_file().ok_or_else(|| bad("it names no referenced_data_file".into()))?;
    let (Some(offset), Some(length)) = (file.content_offset(), file.content_size_in_bytes()) else {
        return Err(bad("its entry has no content_offset and content_size_in_bytes".into()));
    };
    let (Ok(offset), Ok(length)) = (u64::try_from(offset), u64::try_from(length)) else {
        return Err(bad(format!("its entry's content_offset {offset} or content_size_in_bytes {length} is negative")));
    };
    let bytes = block_on(async {
        let reader = io.new_input(path)?.reader().await?;
        reader.read(offset..offset + length).await
    })
    .map_err(|e| iceberg_error(&format!("reading deletion vector {path}"), e))?;
    let positions = deserialize(&bytes).map_err(bad)?;
    if positions.len() != file.record_count() {
        return Err(bad(format!("it holds {} positions and its entry says {}", positions.len(), file.record_count())));
    }
    Ok((data_file, positions))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The spec's layout, byte by byte, for positions {1, 2, 3, 2^32 + 5}:
    /// two 32-bit bitmaps (keys 0 and 1), each in the portable format
    /// without runs (cookie 12346, container count, key and cardinality - 1
    /// per container, offsets, then the array container's u16 values).
    #[test]
    fn the_blob_has_the_specs_layout_and_round_trips() {
        let positions: RoaringTreemap = [1u64, 2, 3, (1 << 32) + 5].into_iter().collect();
        let blob = serialize(&positions).unwrap();
        let mut vector = Vec::new();
        vector.extend_from_slice(&2u64.to_le_bytes());
        // key 0: one array container (key 0, 3 values) at offset 16.
        vector.extend_from_slice(&0u32.to_le_bytes());
        vector.extend_from_slice(&12346u32.to_le_bytes());
        vector.extend_from_slice(&1u32.to_le_bytes());
        vector.extend_from_slice(&[0, 0, 2, 0]);
        vector.extend_from_slice(&16u32.to_le_bytes());
        vector.extend_from_slice(&[1, 0, 2, 0, 3, 0]);
        // key 1: one array container (key 0, 1 value) at offset 16.
        vector.extend_from_slice(&1u32.to_le_bytes());
        vector.extend_from_slice(&12346u32.to_le_bytes());
        vector.extend_from_slice(&1u32.to_le_bytes());
        vector.extend_from_slice(&[0, 0, 0, 0]);
        vector.extend_from_slice(&16u32.to_le_bytes());
        vector.extend_from_slice(&[5, 0]);
        let mut expected = Vec::new();
        expected.extend_from_slice(&((vector.len() + 4) as u32).to_be_bytes());
        expected.extend_from_slice(&[0xD1, 0xD3, 0x39, 0x64]);
        expected.extend_from_slice(&vector);
        let crc = crc32fast::hash(&expected[4..]);
        expected.extend_from_slice(&crc.to_be_bytes());
        assert_eq!(blob, expected);
        assert_eq!(deserialize(&blob).unwrap(), positions);
    }

    /// The CRC-32 is the standard (IEEE, zlib) one: the check value of
    /// "123456789" is 0xCBF43926.
    #[test]
    fn the_checksum_is_the_ieee_crc32() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn large_and_dense_vectors_round_trip() {
        let mut positions: RoaringTreemap = (0..100_000u64).step_by(3).collect();
        positions.insert_range(200_000..270_000);
        positions.insert(7 << 32);
        let blob = serialize(&positions).unwrap();
        assert_eq!(deserialize(&blob).unwrap(), positions);
        assert!(deserialize(&serialize(&RoaringTreemap::new()).unwrap()).unwrap().is_empty());
    }

    #[test]
    fn damaged_blobs_are_refused_naming_what() {
        let positions: RoaringTreemap = [4u64, 9].into_iter().collect();
        let blob = serialize(&positions).unwrap();
        let mut flipped = blob.clone();
        let last_bitmap_byte = flipped.len() - 5;
        flipped[last_bitmap_byte] ^= 1;
        assert!(deserialize(&flipped).unwrap_err().contains("CRC-32"));
        let mut magic = blob.clone();
        magic[4] = 0;
        assert!(deserialize(&magic).unwrap_err().contains("magic"));
        assert!(deserialize(&blob[..blob.len() - 1]).unwrap_err().contains("says it holds"));
        assert!(deserialize(&blob[..8]).unwrap_err().contains("too short"));
        let too_far: RoaringTreemap = [1u64 << 63].into_iter().collect();
        assert!(serialize(&too_far).unwrap_err().contains("2^63"));
    }
}
