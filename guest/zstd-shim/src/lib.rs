//! A stand-in for the [zstd](https://docs.rs/zstd) crate: the part of its API
//! that parquet, apache-avro and iceberg call (`bulk::Compressor`,
//! `bulk::Decompressor`, `Encoder`, `Decoder`, `stream::decode_all`, and from
//! `zstd_safe` `get_frame_content_size` and `DCtx::in_size`), put in place of
//! the real crate by `[patch.crates-io]` in the workspace manifest.
//!
//! The host's workspace puts it in place of the real crate too (where
//! parquet, apache-avro and iceberg call the same API, and the `codec`
//! capability only `zstd_safe`), for one difference: [`bulk::Decompressor`]
//! makes its context at its first use.
//!
//! Why (plugins): the real crate compiles libzstd (C) with clang and wasi-libc for a
//! plugin, and runs it as wasm at a fraction of native speed. Here:
//! - inside a plugin (`target_family = "wasm"`) every buffer is compressed
//!   and decompressed by the host's `codec` capability
//!   (`sluice:connector/codec`), natively; no C is built for the sandbox;
//! - everywhere else (the host, tests, benchmarks) it is libzstd through
//!   `zstd-safe`, as in the real crate.
//!
//! Invariants:
//! - the output is standard zstd frames: any zstd reader (PyIceberg, DuckDB)
//!   reads them;
//! - the streaming types buffer a whole stream and (de)compress it at once.
//!   Their users hand them one Parquet page, Avro block or Puffin blob at a
//!   time, so nothing streams far;
//! - a decompression never yields more than its caller allows
//!   (`Decompressor::decompress`'s capacity; 1 GiB for whole streams).

use std::io::{self, Read, Write};
use std::marker::PhantomData;

#[cfg(target_family = "wasm")]
#[path = "host.rs"]
mod backend;
#[cfg(not(target_family = "wasm"))]
#[path = "native.rs"]
mod backend;

#[cfg(target_family = "wasm")]
pub mod zstd_safe;

#[cfg(target_family = "wasm")]
mod bindings {
    // Only the `codec` interface of the plugin contract.
    wit_bindgen::generate!({
        inline: "package sluice:zstd-shim; world shim { import sluice:connector/codec@0.2.4; }",
        path: "../../wit/0.2",
        world: "sluice:zstd-shim/shim",
        generate_all,
    });
}
#[cfg(not(target_family = "wasm"))]
pub use zstd_safe;

/// The most a whole stream may decompress to.
const STREAM_LIMIT: usize = 1 << 30;

/// The default compression level of the real crate.
pub const DEFAULT_COMPRESSION_LEVEL: i32 = 3;

/// One-shot compression and decompression of whole buffers.
pub mod bulk {
    use super::*;

    /// Compresses buffers at one level, reusing its context.
    pub struct Compressor<'a> {
        ctx: backend::Compress,
        _dictionary: PhantomData<&'a ()>,
    }

    impl Compressor<'static> {
        pub fn new(level: i32) -> io::Result<Self> {
            Ok(Self { ctx: backend::Compress::new(level)?, _dictionary: PhantomData })
        }
    }

    impl Compressor<'_> {
        /// `data` as one zstd frame.
        pub fn compress(&mut self, data: &[u8]) -> io::Result<Vec<u8>> {
            self.ctx.compress(data, false)
        }
    }

    /// Decompresses buffers, reusing its context, which it makes at its
    /// first use: parquet's writer makes a codec, decompressor included,
    /// for every column of every open row group and never decompresses.
    /// With libzstd's context at about 95 KB, that was 88 MB of the host's
    /// peak in `iceberg-bench --only costs` (120 open files; 2026-12-06,
    /// heaptrack), where the real crate makes it at once.
    pub struct Decompressor<'a> {
        ctx: Option<backend::Decompress>,
        _dictionary: PhantomData<&'a ()>,
    }

    impl Decompressor<'static> {
        pub fn new() -> io::Result<Self> {
            Ok(Self { ctx: None, _dictionary: PhantomData })
        }
    }

    impl Decompressor<'_> {
        /// The frames of `data`, which must decompress to at most `capacity` bytes.
        pub fn decompress(&mut self, data: &[u8], capacity: usize) -> io::Result<Vec<u8>> {
            let ctx = match &mut self.ctx {
                Some(ctx) => ctx,
                None => self.ctx.insert(backend::Decompress::new()?),
            };
            ctx.decompress(data, capacity)
        }
    }

    /// `data` as one zstd frame at `level`.
    pub fn compress(data: &[u8], level: i32) -> io::Result<Vec<u8>> {
        Compressor::new(level)?.compress(data)
    }

    /// The frames of `data`, at most `capacity` bytes of them.
    pub fn decompress(data: &[u8], capacity: usize) -> io::Result<Vec<u8>> {
        Decompressor::new()?.decompress(data, capacity)
    }
}

/// The streaming API, over whole buffers.
pub mod stream {
    use super::*;

    /// Compresses what is written to it into `W` when finished.
    pub struct Encoder<'a, W: Write> {
        writer: Option<W>,
        level: i32,
        checksum: bool,
        buffer: Vec<u8>,
        _dictionary: PhantomData<&'a ()>,
    }

    impl<W: Write> Encoder<'static, W> {
        pub fn new(writer: W, level: i32) -> io::Result<Self> {
            Ok(Self { writer: Some(writer), level, checksum: false, buffer: Vec::new(), _dictionary: PhantomData })
        }
    }

    impl<W: Write> Encoder<'_, W> {
        /// Adds a checksum to the frame.
        pub fn include_checksum(&mut self, include: bool) -> io::Result<()> {
            self.checksum = include;
            Ok(())
        }

        /// The frame records the size it was given when it is finished.
        pub fn set_pledged_src_size(&mut self, size: Option<u64>) -> io::Result<()> {
            if let Some(size) = size {
                self.buffer.reserve(usize::try_from(size).unwrap_or(0).min(STREAM_LIMIT));
            }
            Ok(())
        }

        /// Compresses everything written and hands back the writer.
        pub fn finish(mut self) -> io::Result<W> {
            let compressed = backend::Compress::new(self.level)?.compress(&self.buffer, self.checksum)?;
            let mut writer = self.writer.take().ok_or_else(|| io::Error::other("the encoder was finished already"))?;
            writer.write_all(&compressed)?;
            Ok(writer)
        }
    }

    impl<W: Write> Write for Encoder<'_, W> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.buffer.extend_from_slice(buf);
            Ok(buf.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Reads the decompressed bytes of everything `R` holds.
    pub struct Decoder<'a, R: Read> {
        reader: Option<R>,
        out: io::Cursor<Vec<u8>>,
        _dictionary: PhantomData<&'a ()>,
    }

    impl<R: Read> Decoder<'static, R> {
        pub fn new(reader: R) -> io::Result<Self> {
            Ok(Self { reader: Some(reader), out: io::Cursor::new(Vec::new()), _dictionary: PhantomData })
        }
    }

    impl<R: Read> Read for Decoder<'_, R> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if let Some(mut reader) = self.reader.take() {
                let mut input = Vec::new();
                reader.read_to_end(&mut input)?;
                self.out = io::Cursor::new(backend::Decompress::new()?.decompress_all(&input, STREAM_LIMIT)?);
            }
            self.out.read(buf)
        }
    }

    /// Everything `source` holds, decompressed.
    pub fn decode_all<R: Read>(mut source: R) -> io::Result<Vec<u8>> {
        let mut input = Vec::new();
        source.read_to_end(&mut input)?;
        backend::Decompress::new()?.decompress_all(&input, STREAM_LIMIT)
    }

    /// Everything `source` holds, as one zstd frame at `level`.
    pub fn encode_all<R: Read>(mut source: R, level: i32) -> io::Result<Vec<u8>> {
        let mut input = Vec::new();
        source.read_to_end(&mut input)?;
        backend::Compress::new(level)?.compress(&input, false)
    }

    pub mod read {
        pub use super::Decoder;
    }

    pub mod write {
        pub use super::Encoder;
    }
}

pub use stream::{Decoder, Encoder, decode_all, encode_all};

/// Sluice's addition to the crate's API: the frames of `data`, refusing more
/// than `limit` bytes out (natively with an error of kind
/// [`io::ErrorKind::FileTooLarge`], having written at most one byte past the
/// limit). The host's `codec` capability decodes plugins' data with it.
pub fn decode_all_within(data: &[u8], limit: usize) -> io::Result<Vec<u8>> {
    backend::Decompress::new()?.decompress_all(data, limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        (0..200_000u32).flat_map(|i| (i % 253).to_le_bytes()).collect()
    }

    #[test]
    fn bulk_and_stream_round_trip_as_standard_frames() {
        let data = sample();
        let packed = bulk::compress(&data, 3).expect("compress");
        assert!(packed.len() < data.len() / 4);
        assert_eq!(zstd_safe::get_frame_content_size(&packed).ok().flatten(), Some(data.len() as u64));
        assert_eq!(bulk::decompress(&packed, data.len()).expect("decompress"), data);
        assert!(bulk::decompress(&packed, data.len() - 1).is_err(), "more than the capacity is refused");
        let mut reused = bulk::Decompressor::new().expect("decompressor");
        for _ in 0..2 {
            assert_eq!(reused.decompress(&packed, data.len()).expect("decompress again"), data);
        }

        let mut encoder = Encoder::new(Vec::new(), 5).expect("encoder");
        encoder.include_checksum(true).expect("checksum");
        encoder.set_pledged_src_size(Some(data.len() as u64)).expect("pledge");
        encoder.write_all(&data[..1000]).expect("write");
        encoder.write_all(&data[1000..]).expect("write");
        let framed = encoder.finish().expect("finish");
        // Two frames back to back decode as their concatenation.
        let mut two = framed.clone();
        two.extend_from_slice(&packed);
        let mut out = Vec::new();
        Decoder::new(&two[..]).expect("decoder").read_to_end(&mut out).expect("read");
        assert_eq!(out.len(), data.len() * 2);
        assert_eq!(decode_all(&framed[..]).expect("decode"), data);
        assert!(decode_all(&framed[..framed.len() - 3]).is_err(), "a truncated frame is an error");
    }

    #[test]
    fn whole_streams_decode_up_to_their_limit_and_no_further() {
        let data = vec![3u8; 600_000];
        let packed = bulk::compress(&data, 3).expect("compress");
        assert_eq!(decode_all_within(&packed, data.len()).expect("exactly the limit"), data);
        for limit in [0, 1, 131_072, 131_073, data.len() - 1] {
            let err = decode_all_within(&packed, limit).expect_err("over the limit");
            assert_eq!(err.kind(), io::ErrorKind::FileTooLarge, "{err}");
            assert!(err.to_string().contains(&format!("more than {limit} bytes")), "{err}");
        }
        let mut two = packed.clone();
        two.extend_from_slice(&packed);
        assert_eq!(decode_all_within(&two, usize::MAX).expect("concatenated frames").len(), 2 * data.len());
        let err = decode_all_within(&packed[..packed.len() - 4], usize::MAX).expect_err("a truncated frame");
        assert_ne!(err.kind(), io::ErrorKind::FileTooLarge, "{err}");
        let empty = bulk::compress(&[], 3).expect("compress nothing");
        assert!(decode_all_within(&empty, 0).expect("nothing, within nothing").is_empty());
    }
}

/// The frame-header reader the plugin build uses, checked against libzstd's.
#[cfg(all(test, not(target_family = "wasm")))]
#[path = "zstd_safe.rs"]
mod header;

#[cfg(all(test, not(target_family = "wasm")))]
mod header_tests {
    #[test]
    fn the_header_reader_agrees_with_libzstd() {
        for size in [0usize, 1, 255, 256, 300, 65_791, 65_792, 70_000, 5_000_000] {
            let data = vec![7u8; size];
            for level in [1, 3] {
                let frame = crate::bulk::compress(&data, level).expect("compress");
                assert_eq!(
                    super::header::get_frame_content_size(&frame).ok(),
                    zstd_safe::get_frame_content_size(&frame).ok(),
                    "size {size}"
                );
            }
        }
        let mut streamed = crate::Encoder::new(Vec::new(), 3).expect("encoder");
        std::io::Write::write_all(&mut streamed, b"no pledged size").expect("write");
        let frame = streamed.finish().expect("finish");
        assert_eq!(super::header::get_frame_content_size(&frame).ok(), zstd_safe::get_frame_content_size(&frame).ok());
        assert!(super::header::get_frame_content_size(b"not zstd").is_err());
        assert_eq!(super::header::DCtx::in_size(), zstd_safe::DCtx::in_size());
        assert_eq!(super::header::DCtx::out_size(), zstd_safe::DCtx::out_size());
    }
}
