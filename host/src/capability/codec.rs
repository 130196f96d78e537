//! The `codec` capability: compression with the host's native codecs (zstd,
//! snappy, gzip). Pure compute on whole buffers: nothing outside the sandbox
//! is touched, so it is always granted.
//!
//! Invariants:
//! - a decompression never yields more than the caller's `max-size`, nor
//!   more than [`MAX_OUTPUT`], so a malicious or corrupt buffer cannot make
//!   the host allocate without bound;
//! - zstd contexts are made once per thread and level and reused: a plugin
//!   compresses one Parquet page per call, and a fresh context per page
//!   would cost more than the page.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{Read, Write};

use wasmtime::component::{HasData, Linker};

use super::CapabilityHost;
use crate::bindings::v0_2::sluice::connector::codec::{self as wit, Algorithm, Host};

/// What the `codec` interface is linked through: it holds nothing.
pub struct CodecView;

/// The `codec` capability for wasmtime's linker.
pub struct Codec;

impl HasData for Codec {
    type Data<'a> = CodecView;
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, Codec>(linker, |_| CodecView)
}

/// The most one decompression may yield, whatever the plugin asks (a
/// plugin's whole memory is capped well below it).
pub const MAX_OUTPUT: u64 = 1 << 30;

thread_local! {
    static ZSTD_COMPRESSORS: RefCell<HashMap<i32, zstd::bulk::Compressor<'static>>> = RefCell::new(HashMap::new());
}

fn zstd_compress(data: &[u8], level: i32) -> Result<Vec<u8>, String> {
    ZSTD_COMPRESSORS.with(|cache| {
        let mut cache = cache.borrow_mut();
        let compressor = match cache.entry(level) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(zstd::bulk::Compressor::new(level).map_err(|e| format!("zstd level {level}: {e}"))?)
            }
        };
        compressor.compress(data).map_err(|e| format!("zstd compression failed: {e}"))
    })
}

/// Compresses `data` with `algorithm` at `level`.
pub fn compress(algorithm: Algorithm, level: i32, data: &[u8]) -> Result<Vec<u8>, String> {
    match algorithm {
        Algorithm::Zstd => zstd_compress(data, level),
        Algorithm::Snappy => {
            snap::raw::Encoder::new().compress_vec(data).map_err(|e| format!("snappy compression failed: {e}"))
        }
        Algorithm::Gzip => {
            let level = flate2::Compression::new(u32::try_from(level.clamp(0, 9)).unwrap_or(6));
            let mut encoder = flate2::write::GzEncoder::new(Vec::with_capacity(data.len() / 2), level);
            encoder.write_all(data).and_then(|()| encoder.finish()).map_err(|e| format!("gzip compression failed: {e}"))
        }
    }
}

/// Decompresses `data`, refusing output beyond `max_size` bytes.
pub fn decompress(algorithm: Algorithm, data: &[u8], max_size: u64) -> Result<Vec<u8>, String> {
    let limit = usize::try_from(max_size).unwrap_or(usize::MAX);
    let too_large = || format!("the data decompresses to more than the {max_size} bytes allowed");
    match algorithm {
        Algorithm::Zstd => {
            let mut out = Vec::new();
            let decoder = zstd::stream::read::Decoder::new(data).map_err(|e| format!("zstd: {e}"))?;
            decoder.take(max_size.saturating_add(1)).read_to_end(&mut out).map_err(|e| format!("zstd: {e}"))?;
            if out.len() > limit {
                return Err(too_large());
            }
            Ok(out)
        }
        Algorithm::Snappy => {
            let len = snap::raw::decompress_len(data).map_err(|e| format!("snappy: {e}"))?;
            if len > limit {
                return Err(too_large());
            }
            snap::raw::Decoder::new().decompress_vec(data).map_err(|e| format!("snappy: {e}"))
        }
        Algorithm::Gzip => {
            let mut out = Vec::new();
            flate2::read::MultiGzDecoder::new(data)
                .take(max_size.saturating_add(1))
                .read_to_end(&mut out)
                .map_err(|e| format!("gzip: {e}"))?;
            if out.len() > limit {
                return Err(too_large());
            }
            Ok(out)
        }
    }
}

impl Host for CodecView {
    fn compress(&mut self, algorithm: Algorithm, level: i32, data: Vec<u8>) -> Result<Vec<u8>, String> {
        compress(algorithm, level, &data)
    }

    fn decompress(&mut self, algorithm: Algorithm, data: Vec<u8>, max_size: u64) -> Result<Vec<u8>, String> {
        decompress(algorithm, &data, max_size.min(MAX_OUTPUT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_codec_round_trips_and_respects_the_size_limit() {
        let data: Vec<u8> = (0..100_000u32).flat_map(|i| (i % 251).to_le_bytes()).collect();
        for algorithm in [Algorithm::Zstd, Algorithm::Snappy, Algorithm::Gzip] {
            let packed = compress(algorithm, 3, &data).unwrap();
            assert!(packed.len() < data.len() / 2, "{algorithm:?} compresses");
            assert_eq!(decompress(algorithm, &packed, data.len() as u64).unwrap(), data);
            let err = decompress(algorithm, &packed, 1000).unwrap_err();
            assert!(err.contains("more than the 1000 bytes"), "{algorithm:?}: {err}");
            assert!(decompress(algorithm, b"not compressed at all", 1 << 20).is_err(), "{algorithm:?}");
        }
    }
}
