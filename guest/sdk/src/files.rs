//! Convenience wrappers over the `file-io` capability.

use crate::SinkError;
use crate::bindings::sluice::connector::file_io::{self, IoError, OutputFile};

/// Renders an `io-error` for a message.
pub fn describe(err: &IoError) -> String {
    match err {
        IoError::Denied(m) => format!("access denied: {m}"),
        IoError::NotFound(m) => format!("not found: {m}"),
        IoError::AlreadyExists(m) => format!("already exists: {m}"),
        IoError::Other(m) => m.clone(),
    }
}

/// Maps an `io-error` to a sink error: a denied location is a configuration
/// problem (the grant is missing); the rest is fatal.
pub fn to_sink_error(context: &str, err: IoError) -> SinkError {
    match &err {
        IoError::Denied(_) => {
            SinkError::Config(format!("{context}: {}; grant the location in [sink.grants] locations", describe(&err)))
        }
        _ => SinkError::Fatal(format!("{context}: {}", describe(&err))),
    }
}

/// Joins a location and a relative name with exactly one `/`.
pub fn join(base: &str, name: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), name.trim_start_matches('/'))
}

/// A `std::io::Write` over an `output-file`, buffering so that each
/// boundary crossing carries a large chunk.
pub struct OutputWriter {
    file: Option<OutputFile>,
    location: String,
    buf: Vec<u8>,
    written: u64,
}

const CHUNK: usize = 1 << 20;

impl OutputWriter {
    pub fn create(location: &str, overwrite: bool) -> Result<Self, IoError> {
        let file = OutputFile::create(location, overwrite)?;
        Ok(Self { file: Some(file), location: location.to_string(), buf: Vec::with_capacity(CHUNK), written: 0 })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    /// Bytes accepted so far.
    pub fn written(&self) -> u64 {
        self.written
    }

    fn flush_buf(&mut self) -> Result<(), IoError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let file =
            self.file.as_ref().ok_or_else(|| IoError::Other(format!("{} is already finished", self.location)))?;
        file.write(&self.buf)?;
        self.buf.clear();
        Ok(())
    }

    /// Flushes, syncs and closes the file.
    pub fn finish(mut self) -> Result<(), IoError> {
        self.flush_buf()?;
        match self.file.take() {
            Some(file) => file.finish(),
            None => Ok(()),
        }
    }
}

impl std::io::Write for OutputWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        self.written += data.len() as u64;
        if self.buf.len() >= CHUNK {
            self.flush_buf().map_err(|e| std::io::Error::other(describe(&e)))?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.flush_buf().map_err(|e| std::io::Error::other(describe(&e)))
    }
}

pub use file_io::{create_dir_all, delete, exists, list_dir, read, rename, stat, write_file};
