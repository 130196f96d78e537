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

/// How many files a refusal to commit names before it counts the rest.
const NAMED_FILES: usize = 10;

/// Refuses the commit of checkpoint `c` because files it names are missing or
/// not as their writers wrote them: `problems` says why, one entry per file,
/// each naming its location (and its table); `consequence` is what committing
/// it anyway would do (e.g. "make a snapshot name files no reader can read").
///
/// `fatal`, on purpose: `retryable` would have the host retry a commit that
/// cannot succeed, and `invalid-data` is about rows; a fatal error stops the
/// run, and the host keeps the checkpoint pending (never drops it), so the
/// operator decides: restore the files, or give the checkpoint up.
pub fn refuse_missing(c: u64, consequence: &str, problems: &[String]) -> SinkError {
    let mut named = problems.iter().take(NAMED_FILES).cloned().collect::<Vec<_>>().join("; ");
    if problems.len() > NAMED_FILES {
        named.push_str(&format!("; and {} more", problems.len() - NAMED_FILES));
    }
    SinkError::Fatal(format!(
        "checkpoint {c} cannot be committed: {} file(s) it names are missing or not as written: {named}. \
         Committing it would {consequence}, so nothing of it was committed \
         where it was not already, and it stays pending. If the files were removed outside Sluice (a manual \
         delete, a bucket lifecycle rule, orphan cleanup run without --protect for this job), put them back \
         and run again; or give up checkpoint {c}'s rows with `sluice state <job file> --drop-pending {c}` \
         and run again",
        problems.len()
    ))
}

/// Joins a location and a relative name with exactly one `/`.
pub fn join(base: &str, name: &str) -> String {
    format!("{}/{}", base.trim_end_matches('/'), name.trim_start_matches('/'))
}

/// A `std::io::Write` over an `output-file`, buffering so that each
/// boundary crossing carries a large chunk (up to 1 MiB). The buffer grows
/// with what is written and is released after each flush, and a large write
/// (a whole Parquet row group) goes straight through, so a writer holding
/// many files open holds little memory for them.
pub struct OutputWriter {
    file: Option<OutputFile>,
    /// `Some(overwrite)` until the host file is created (deferred writers).
    deferred: Option<bool>,
    location: String,
    buf: Vec<u8>,
    written: u64,
}

const CHUNK: usize = 1 << 20;
/// Writes this large cross at once, without a copy into the buffer.
const DIRECT: usize = 64 << 10;

impl OutputWriter {
    /// Creates the file now.
    pub fn create(location: &str, overwrite: bool) -> Result<Self, IoError> {
        let file = OutputFile::create(location, overwrite)?;
        Ok(Self { file: Some(file), deferred: None, location: location.to_string(), buf: Vec::new(), written: 0 })
    }

    /// Creates the file only when the first chunk is flushed (or at
    /// `finish`), so a writer holding many small files open holds no host
    /// file handles for them.
    pub fn deferred(location: &str, overwrite: bool) -> Self {
        Self { file: None, deferred: Some(overwrite), location: location.to_string(), buf: Vec::new(), written: 0 }
    }

    fn open_if_deferred(&mut self) -> Result<(), IoError> {
        if let Some(overwrite) = self.deferred.take() {
            self.file = Some(OutputFile::create(&self.location, overwrite)?);
        }
        Ok(())
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
        self.open_if_deferred()?;
        let file =
            self.file.as_ref().ok_or_else(|| IoError::Other(format!("{} is already finished", self.location)))?;
        file.write(&self.buf)?;
        if self.buf.capacity() > DIRECT {
            self.buf = Vec::new();
        } else {
            self.buf.clear();
        }
        Ok(())
    }

    /// Flushes, syncs and closes the file.
    pub fn finish(mut self) -> Result<(), IoError> {
        self.open_if_deferred()?;
        self.flush_buf()?;
        match self.file.take() {
            Some(file) => file.finish(),
            None => Ok(()),
        }
    }
}

impl std::io::Write for OutputWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.written += data.len() as u64;
        if self.buf.is_empty() && data.len() >= DIRECT {
            let mut direct = || -> Result<(), IoError> {
                self.open_if_deferred()?;
                let location = &self.location;
                let file =
                    self.file.as_ref().ok_or_else(|| IoError::Other(format!("{location} is already finished")))?;
                file.write(data)
            };
            direct().map_err(|e| std::io::Error::other(describe(&e)))?;
            return Ok(data.len());
        }
        self.buf.extend_from_slice(data);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_fatal_and_names_the_checkpoint_the_files_and_the_way_out() {
        let problems: Vec<String> = (0..12).map(|i| format!("table t: data file f{i:02}.parquet is missing")).collect();
        let SinkError::Fatal(message) = refuse_missing(7, "make a snapshot name them", &problems) else {
            panic!("a refusal must be fatal: the host neither retries it nor drops the checkpoint");
        };
        for part in [
            "checkpoint 7 cannot be committed",
            "12 file(s)",
            "table t: data file f00.parquet is missing",
            "f09.parquet",
            "; and 2 more",
            "Committing it would make a snapshot name them",
            "stays pending",
            "sluice state <job file> --drop-pending 7",
        ] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        assert!(!message.contains("f10.parquet"), "only the first ten are named: {message}");
        let SinkError::Fatal(one) = refuse_missing(3, "x", &problems[..1]) else { panic!("fatal") };
        assert!(one.contains("1 file(s)") && !one.contains("more"), "{one}");
    }
}
