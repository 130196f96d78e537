//! The [`ErrorKind`] of every error the host's modules return: what a
//! caller may do about it, so that retry, halt and exit decisions read a
//! kind and never an error's text.
//!
//! Invariants:
//! - only a plugin's own `retryable` answer is [`ErrorKind::Retryable`]: the
//!   host retries nothing else on its own;
//! - a checkpoint write whose outcome is unknown is [`ErrorKind::Unknown`],
//!   never a failure (see `engine::checkpoint`);
//! - a user's mistake in the job file, a flag or the target is
//!   [`ErrorKind::Config`].
//!
//! The impls sit together here while the host is being split into crates;
//! each moves beside its type when that type's crate is cut out (the
//! sources' is in `sluice-source`, the plugins' in `sluice-plugin`).

pub use sluice_core::error::{ErrorKind, Kind};

use crate::EngineError;
use crate::checkpoint::CheckpointError;
use crate::config::JobError;

impl Kind for JobError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::Config
    }
}

impl Kind for CheckpointError {
    fn kind(&self) -> ErrorKind {
        match self {
            CheckpointError::Unknown { .. } => ErrorKind::Unknown,
            CheckpointError::Locked { .. } | CheckpointError::Leased { .. } | CheckpointError::LeaseLost { .. } => {
                ErrorKind::Conflict
            }
            CheckpointError::NotADirectory { .. } | CheckpointError::WrongJob { .. } => ErrorKind::Config,
            CheckpointError::Io { .. }
            | CheckpointError::Store(_)
            | CheckpointError::Corrupt { .. }
            | CheckpointError::Encode { .. }
            | CheckpointError::StateFile { .. } => ErrorKind::Fatal,
        }
    }
}

impl Kind for EngineError {
    fn kind(&self) -> ErrorKind {
        use EngineError as E;
        match self {
            E::Job(e) => e.kind(),
            E::Plugin(e) => e.kind(),
            E::Checkpoint(e) => e.kind(),
            E::Source(e) => e.kind(),
            E::SchemaRefused(_) | E::SinkRejected(_) => ErrorKind::InvalidData,
            E::Grants(_)
            | E::SingleTablePlugin { .. }
            | E::ParallelismChanged { .. }
            | E::SourceChanged { .. }
            | E::SinkChanged { .. }
            | E::IncarnationNotFresh { .. }
            | E::AlreadyLanded { .. }
            | E::NotPending { .. }
            | E::Maintain(_) => ErrorKind::Config,
            E::CommitExhausted { .. } | E::Halted { .. } | E::TooManyBadRows(_) => ErrorKind::Stopped,
            E::InjectedCrash(_)
            | E::KeyReused { .. }
            | E::SubtaskLost(_)
            | E::MaintenanceThread(_)
            | E::WriterLost { .. }
            | E::WritersLost { .. }
            | E::Remote { .. }
            | E::Pool { .. }
            | E::Wire { .. }
            | E::Thread(_)
            | E::Ipc(_) => ErrorKind::Fatal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::{PluginError, SinkErrorKind};

    #[test]
    fn only_a_plugins_retryable_answer_is_retryable() {
        let sink = |kind| {
            EngineError::Plugin(PluginError::Sink {
                plugin: "p".into(),
                instance: "writer 0".into(),
                call: "commit",
                kind,
                message: "m".into(),
            })
        };
        assert_eq!(sink(SinkErrorKind::Retryable).kind(), ErrorKind::Retryable);
        assert_eq!(sink(SinkErrorKind::Config).kind(), ErrorKind::Config);
        assert_eq!(sink(SinkErrorKind::InvalidData).kind(), ErrorKind::InvalidData);
        assert_eq!(EngineError::SubtaskLost(1).kind(), ErrorKind::Fatal);
        let unknown = CheckpointError::Unknown {
            path: "x".into(),
            source: Box::new(CheckpointError::Locked { path: "x".into() }),
        };
        assert_eq!(EngineError::Checkpoint(unknown).kind(), ErrorKind::Unknown);
    }
}
