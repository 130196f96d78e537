//! What parquet and apache-avro take from `zstd::zstd_safe`, without C: the
//! content size from a frame header (RFC 8878, 3.1.1.1) and the input
//! buffer size zstd recommends.

/// The frame header does not hold what was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentSizeError;

impl std::fmt::Display for ContentSizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("not a zstd frame header")
    }
}

impl std::error::Error for ContentSizeError {}

const MAGIC: u32 = 0xFD2F_B528;

/// The decompressed size a frame header records: `Ok(None)` when it does
/// not record one.
pub fn get_frame_content_size(src: &[u8]) -> Result<Option<u64>, ContentSizeError> {
    let magic = src.get(0..4).ok_or(ContentSizeError)?;
    if u32::from_le_bytes([magic[0], magic[1], magic[2], magic[3]]) != MAGIC {
        return Err(ContentSizeError);
    }
    let descriptor = *src.get(4).ok_or(ContentSizeError)?;
    let fcs_flag = descriptor >> 6;
    let single_segment = descriptor & 0x20 != 0;
    let dict_id_bytes = [0usize, 1, 2, 4][usize::from(descriptor & 0x03)];
    let window_bytes = usize::from(!single_segment);
    let fcs_bytes = match (fcs_flag, single_segment) {
        (0, false) => return Ok(None),
        (0, true) => 1,
        (1, _) => 2,
        (2, _) => 4,
        _ => 8,
    };
    let start = 5 + window_bytes + dict_id_bytes;
    let field = src.get(start..start + fcs_bytes).ok_or(ContentSizeError)?;
    let mut value = 0u64;
    for (i, b) in field.iter().enumerate() {
        value |= u64::from(*b) << (8 * i);
    }
    Ok(Some(if fcs_bytes == 2 { value + 256 } else { value }))
}

/// A decompression context, as far as its sizes are asked.
pub struct DCtx;

impl DCtx {
    /// `ZSTD_DStreamInSize()`: a block and its header.
    pub fn in_size() -> usize {
        (1 << 17) + 3
    }

    /// `ZSTD_DStreamOutSize()`: a block.
    pub fn out_size() -> usize {
        1 << 17
    }
}
