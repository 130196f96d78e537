//! Inside a plugin: the host's `codec` capability does the work, natively.

use std::io;

use crate::bindings::sluice::connector::codec::{self, Algorithm};

pub struct Compress(i32);

impl Compress {
    pub fn new(level: i32) -> io::Result<Self> {
        Ok(Self(level))
    }

    /// `data` as one frame. (The host's frames carry no checksum; readers
    /// need none.)
    pub fn compress(&mut self, data: &[u8], _checksum: bool) -> io::Result<Vec<u8>> {
        codec::compress(Algorithm::Zstd, self.0, data).map_err(io::Error::other)
    }
}

pub struct Decompress;

impl Decompress {
    pub fn new() -> io::Result<Self> {
        Ok(Self)
    }

    pub fn decompress(&mut self, data: &[u8], capacity: usize) -> io::Result<Vec<u8>> {
        codec::decompress(Algorithm::Zstd, data, capacity as u64).map_err(io::Error::other)
    }

    pub fn decompress_all(&mut self, data: &[u8], limit: usize) -> io::Result<Vec<u8>> {
        self.decompress(data, limit)
    }
}
