//! libzstd through zstd-safe, for everything that is not a plugin.

use std::io;

use zstd_safe::{CCtx, CParameter, DCtx, InBuffer, OutBuffer};

fn error(code: usize) -> io::Error {
    io::Error::other(zstd_safe::get_error_name(code))
}

pub struct Compress(CCtx<'static>);

impl Compress {
    pub fn new(level: i32) -> io::Result<Self> {
        let mut ctx = CCtx::try_create().ok_or_else(|| io::Error::other("cannot allocate a zstd context"))?;
        ctx.set_parameter(CParameter::CompressionLevel(level)).map_err(error)?;
        Ok(Self(ctx))
    }

    /// `data` as one frame, which records its size.
    pub fn compress(&mut self, data: &[u8], checksum: bool) -> io::Result<Vec<u8>> {
        self.0.set_parameter(CParameter::ChecksumFlag(checksum)).map_err(error)?;
        let mut out = Vec::with_capacity(zstd_safe::compress_bound(data.len()));
        if let Err(code) = self.0.compress2(&mut out, data) {
            // A failed frame leaves the context mid-frame, where setting a
            // parameter fails: the next call starts afresh.
            let _ = self.0.reset(zstd_safe::ResetDirective::SessionOnly);
            return Err(error(code));
        }
        Ok(out)
    }
}

pub struct Decompress(DCtx<'static>);

impl Decompress {
    pub fn new() -> io::Result<Self> {
        DCtx::try_create().map(Self).ok_or_else(|| io::Error::other("cannot allocate a zstd context"))
    }

    /// The frames of `data`, at most `capacity` bytes of them.
    pub fn decompress(&mut self, data: &[u8], capacity: usize) -> io::Result<Vec<u8>> {
        let mut out = Vec::with_capacity(capacity);
        self.0.decompress(&mut out, data).map_err(error)?;
        Ok(out)
    }

    /// The frames of `data`, whatever their sizes say, up to `limit` bytes:
    /// each call may write only into a window that ends one byte past the
    /// limit, and more than the limit is an error of kind `FileTooLarge`.
    pub fn decompress_all(&mut self, data: &[u8], limit: usize) -> io::Result<Vec<u8>> {
        let too_large =
            || io::Error::new(io::ErrorKind::FileTooLarge, format!("the data decompresses to more than {limit} bytes"));
        let stop_at = limit.saturating_add(1);
        let mut out: Vec<u8> = Vec::new();
        let mut input = InBuffer::around(data);
        loop {
            let pos = out.len();
            if pos > limit {
                return Err(too_large());
            }
            let window = DCtx::out_size().min(stop_at - pos);
            out.resize(pos + window, 0);
            let (hint, produced) = {
                let mut output = OutBuffer::around(&mut out[pos..]);
                let hint = self.0.decompress_stream(&mut output, &mut input).map_err(error)?;
                (hint, output.pos())
            };
            out.truncate(pos + produced);
            if out.len() > limit {
                return Err(too_large());
            }
            let consumed = input.pos() == data.len();
            if consumed && hint == 0 {
                return Ok(out);
            }
            if consumed && produced < window {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the zstd frame is incomplete"));
            }
        }
    }
}
