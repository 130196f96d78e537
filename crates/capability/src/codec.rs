//! The `codec` capability: compression with the host's native codecs (zstd,
//! snappy, gzip). Pure compute on whole buffers: nothing outside the sandbox
//! is touched, so it is always granted.
//!
//! Invariants:
//! - a decompression never yields more than the caller's `max-size`, nor
//!   more than [`MAX_OUTPUT`], nor more than the instance's host-memory
//!   budget has free; a `max-size` above the whole budget is refused before
//!   any work, so a malicious or corrupt buffer cannot make the host
//!   allocate without bound;
//! - a compression's output is reserved from the budget before it is made;
//! - levels are clamped to the codec's range, and zstd contexts are kept per
//!   thread for the [`CONTEXTS`] most recently used levels and reused: a
//!   plugin compresses one Parquet page per call, and a fresh context per
//!   page would cost more than the page, but a plugin cycling through levels
//!   cannot make the host keep a context for each.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::sync::Arc;

use wasmtime::component::{HasData, Linker};

use super::CapabilityHost;
use super::limits::HostMemory;
use crate::bindings::v0_2::sluice::connector::codec::{self as wit, Algorithm, Host};

/// What the `codec` interface is linked through: the instance's host-memory
/// budget.
pub struct CodecView {
    memory: Arc<HostMemory>,
}

/// The `codec` capability for wasmtime's linker.
pub struct Codec;

impl HasData for Codec {
    type Data<'a> = CodecView;
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, Codec>(linker, |t| CodecView { memory: t.capabilities().0.memory.clone() })
}

/// The most one decompression may yield, whatever the plugin asks (a
/// plugin's whole memory is capped well below it).
pub const MAX_OUTPUT: u64 = 1 << 30;

/// zstd contexts kept per thread (one per level, most recently used first).
pub const CONTEXTS: usize = 4;

thread_local! {
    static ZSTD_COMPRESSORS: RefCell<Vec<(i32, zstd::bulk::Compressor<'static>)>> = const { RefCell::new(Vec::new()) };
}

/// `level` inside zstd's range.
pub fn zstd_level(level: i32) -> i32 {
    level.clamp(zstd::zstd_safe::min_c_level(), zstd::zstd_safe::max_c_level())
}

fn zstd_compress(data: &[u8], level: i32) -> Result<Vec<u8>, String> {
    let level = zstd_level(level);
    ZSTD_COMPRESSORS.with(|cache| {
        let mut cache = cache.borrow_mut();
        match cache.iter().position(|(l, _)| *l == level) {
            Some(0) => {}
            Some(i) => {
                let hit = cache.remove(i);
                cache.insert(0, hit);
            }
            None => {
                let compressor = zstd::bulk::Compressor::new(level).map_err(|e| format!("zstd level {level}: {e}"))?;
                cache.truncate(CONTEXTS - 1);
                cache.insert(0, (level, compressor));
            }
        }
        let (_, compressor) = cache.first_mut().ok_or_else(|| "zstd: no context".to_string())?;
        compressor.compress(data).map_err(|e| format!("zstd compression failed: {e}"))
    })
}

/// The number of zstd contexts this thread holds (for tests).
pub fn zstd_contexts() -> usize {
    ZSTD_COMPRESSORS.with(|cache| cache.borrow().len())
}

/// The most `algorithm` can make of `len` bytes.
fn compress_bound(algorithm: Algorithm, len: usize) -> u64 {
    let len = len as u64;
    match algorithm {
        Algorithm::Zstd => len + len / 255 + 1024,
        Algorithm::Snappy => 32 + len + len / 6,
        Algorithm::Gzip => len + len / 1000 + 1024,
    }
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
        // Sluice's zstd stand-in (guest/zstd-shim, this workspace's `zstd`)
        // writes at most one byte past the limit.
        Algorithm::Zstd => zstd::decode_all_within(data, limit).map_err(|e| match e.kind() {
            std::io::ErrorKind::FileTooLarge => too_large(),
            _ => format!("zstd: {e}"),
        }),
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

/// Decompresses `data` within `memory`: a `max_size` above the whole budget
/// is refused before any work; the output may not exceed what is free.
pub fn decompress_within(
    memory: &Arc<HostMemory>,
    algorithm: Algorithm,
    data: &[u8],
    max_size: u64,
) -> Result<Vec<u8>, String> {
    let max_size = max_size.min(MAX_OUTPUT);
    if max_size > memory.limit() {
        return Err(format!(
            "decompress refused: its max-size of {max_size} bytes is above the instance's host-memory budget of {} MiB (sink.sandbox.host_memory_mb); ask for what the data can decompress to",
            memory.limit_mb()
        ));
    }
    let free = memory.free();
    let out = decompress(algorithm, data, max_size.min(free)).map_err(|e| {
        if free < max_size && e.contains("decompresses to more than") {
            memory.over("the decompressed data", free.saturating_add(1)).to_string()
        } else {
            e
        }
    })?;
    // Held until the answer is copied into the plugin.
    let _held = memory.reserve("the decompressed data", out.len() as u64).map_err(|e| e.to_string())?;
    Ok(out)
}

impl Host for CodecView {
    fn compress(&mut self, algorithm: Algorithm, level: i32, data: Vec<u8>) -> Result<Vec<u8>, String> {
        let _held = self
            .memory
            .reserve("the compressed output", compress_bound(algorithm, data.len()))
            .map_err(|e| e.to_string())?;
        compress(algorithm, level, &data)
    }

    fn decompress(&mut self, algorithm: Algorithm, data: Vec<u8>, max_size: u64) -> Result<Vec<u8>, String> {
        decompress_within(&self.memory, algorithm, &data, max_size)
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

    #[test]
    fn zstd_never_yields_past_what_it_may() {
        let data = vec![0u8; 8 << 20];
        let packed = compress(Algorithm::Zstd, 3, &data).unwrap();
        for max in [0u64, 1000, 128 << 10, 1 << 20, (8 << 20) - 1] {
            let err = decompress(Algorithm::Zstd, &packed, max).unwrap_err();
            assert!(err.contains(&format!("more than the {max} bytes allowed")), "{err}");
        }
        assert_eq!(decompress(Algorithm::Zstd, &packed, 8 << 20).unwrap().len(), 8 << 20);
        let mut two = packed.clone();
        two.extend_from_slice(&packed);
        assert_eq!(decompress(Algorithm::Zstd, &two, MAX_OUTPUT).unwrap().len(), 16 << 20, "concatenated frames");
        let err = decompress(Algorithm::Zstd, &packed[..packed.len() - 4], MAX_OUTPUT).unwrap_err();
        assert!(err.starts_with("zstd: ") && !err.contains("more than"), "a truncated frame: {err}");
    }

    #[test]
    fn levels_are_clamped_and_contexts_bounded() {
        assert_eq!(zstd_level(1000), 22);
        assert_eq!(zstd_level(i32::MIN), zstd::zstd_safe::min_c_level());
        let data = vec![7u8; 10_000];
        for level in -500..500 {
            let packed = compress(Algorithm::Zstd, level, &data).expect("compresses");
            assert!(packed.len() < data.len());
        }
        assert!(zstd_contexts() <= CONTEXTS, "{} contexts", zstd_contexts());
    }

    #[test]
    fn decompress_above_the_budget_is_refused_before_any_work() {
        let memory = HostMemory::new(1);
        let data = vec![0u8; 4 << 20];
        let packed = compress(Algorithm::Zstd, 3, &data).unwrap();
        let err = decompress_within(&memory, Algorithm::Zstd, b"not even zstd", u64::MAX).unwrap_err();
        assert!(err.contains("above the instance's host-memory budget of 1 MiB"), "{err}");
        let err = decompress_within(&memory, Algorithm::Zstd, &packed, 1 << 20).unwrap_err();
        assert!(err.contains("more than the 1048576 bytes allowed"), "{err}");
        let small = compress(Algorithm::Zstd, 3, &data[..1000]).unwrap();
        assert_eq!(decompress_within(&memory, Algorithm::Zstd, &small, 1 << 20).unwrap().len(), 1000);
    }
}
