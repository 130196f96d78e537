//! Error kinds: what a caller may do about an error, read from its type,
//! never from its text.
//!
//! Invariants:
//! - every error type a Sluice crate returns says its [`ErrorKind`] through
//!   [`Kind`]; retry, halt and exit-code decisions read the kind;
//! - [`ErrorKind::Unknown`] is never treated as "not done": a write whose
//!   outcome is unknown is decided later from what is durable, never aborted
//!   or deleted (see the engine's checkpoint store);
//! - [`chain`] prints an error with each cause once, outermost first.

use std::fmt;

/// What a caller may do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The job file, a flag or the environment is wrong; fix it and rerun.
    Config,
    /// Input data cannot be landed as it is (a bad row, a schema the table
    /// refuses); with dead letters it may be set aside.
    InvalidData,
    /// Transient: the same step may succeed when tried again.
    Retryable,
    /// Someone else changed the target first (a commit conflict, a lost
    /// lease); try again from the new state, or stop if fenced.
    Conflict,
    /// Whether the step took effect is unknown (a lost reply, a timeout);
    /// decide from what is durable, never undo.
    Unknown,
    /// Stopped on purpose and resumable: a halt, a limit passed, a refusal
    /// that keeps everything committed.
    Stopped,
    /// Cannot go on; the message names the cause.
    Fatal,
}

impl ErrorKind {
    /// The kind's name as logs and metrics print it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Config => "config",
            ErrorKind::InvalidData => "invalid-data",
            ErrorKind::Retryable => "retryable",
            ErrorKind::Conflict => "conflict",
            ErrorKind::Unknown => "unknown-outcome",
            ErrorKind::Stopped => "stopped",
            ErrorKind::Fatal => "fatal",
        }
    }

    /// Whether trying the same step again may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(self, ErrorKind::Retryable | ErrorKind::Conflict)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error that knows its kind.
pub trait Kind {
    fn kind(&self) -> ErrorKind;
}

/// `e` and its causes, outermost first, joined by `: `. A cause whose text
/// the message already holds is left out (many errors print their source
/// themselves; reqwest's and hyper's do not).
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("middle: inner")]
    struct Middle(#[source] Inner);

    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner;

    #[test]
    fn chain_prints_each_cause_once() {
        assert_eq!(chain(&Outer(Middle(Inner))), "outer: middle: inner");
        assert_eq!(chain(&Inner), "inner");
    }

    #[test]
    fn only_conflicts_and_transients_are_retried() {
        assert!(ErrorKind::Retryable.is_retryable());
        assert!(ErrorKind::Conflict.is_retryable());
        assert!(!ErrorKind::Unknown.is_retryable());
        assert!(!ErrorKind::Config.is_retryable());
        assert_eq!(ErrorKind::Unknown.to_string(), "unknown-outcome");
    }
}
