//! The [`ErrorKind`] of every error the host's modules return: what a
//! caller may do about it, so that retry, halt and exit decisions read a
//! kind and never an error's text.
//!
//! Invariants:
//! - the host's own retries (a commit, a schema change) retry only what a
//!   plugin answered `retryable`; a source error may be
//!   [`ErrorKind::Retryable`] too (a broker or a schema registry that may
//!   answer later), which stops the run resumable and tells a runner a
//!   rerun may succeed, but the host does not retry the read itself;
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
            | E::OrphanAgeTooShort { .. }
            | E::WireVersion { .. } => ErrorKind::Config,
            // Refused for what could not be read: the read's own kind.
            E::OrphanAgeUnchecked { source, .. } => source.kind(),
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

    #[test]
    fn a_refused_orphan_retention_says_whose_fault_it_is() {
        let too_short = EngineError::OrphanAgeTooShort {
            age: "1h".into(),
            job: "j".into(),
            holder: "run r".into(),
            least: "4m".into(),
        };
        assert_eq!(too_short.kind(), ErrorKind::Config);
        assert!(too_short.to_string().starts_with("--remove-orphans-older-than 1h is too short while job \"j\""));
        // Unread: the read's own kind (here another run's lock, a conflict).
        let unchecked = EngineError::OrphanAgeUnchecked {
            age: "1h".into(),
            job: "j".into(),
            state_dir: "/s".into(),
            least: "4m".into(),
            source: Box::new(CheckpointError::Locked { path: "/s/LOCK".into() }),
        };
        assert_eq!(unchecked.kind(), ErrorKind::Conflict);
        assert!(std::error::Error::source(&unchecked).is_some());
    }

    #[test]
    fn too_many_bad_rows_stops_naming_the_count_the_limit_and_the_key() {
        use crate::config::MaxBadRows;
        use crate::{BadRowLimit, BadRowsPassed};
        let limit = |passed| BadRowLimit {
            job: "j".into(),
            limit: MaxBadRows::Count(8),
            dead_letter_table: "dl".into(),
            passed,
        };
        let at = limit(BadRowsPassed::Checkpoint {
            checkpoint: 3,
            bad: 9,
            read: 2000,
            in_checkpoint: 2,
            sample: "a.csv line 5".into(),
        });
        assert_eq!((at.count(), BadRowLimit::KEY), (9, "job.max_bad_rows"));
        let e = EngineError::TooManyBadRows(Box::new(at));
        assert_eq!(e.kind(), ErrorKind::Stopped);
        assert_eq!(
            e.to_string(),
            "job j: 9 bad rows of 2000 records read over the job (2 in checkpoint 3), more than job.max_bad_rows \
             allows (8 over the job); nothing of checkpoint 3 was committed (earlier checkpoints stay committed, and \
             their dead letters are in table \"dl\"). First bad rows of checkpoint 3: a.csv line 5"
        );
        let rejected = limit(BadRowsPassed::Rejected {
            rejected: 4,
            before: 6,
            after: None,
            sample: vec!["a.csv record 2".into(), "a.csv record 9".into()],
        });
        assert_eq!(rejected.count(), 10);
        let text = rejected.to_string();
        assert!(text.contains("the sink rejected 4 rows as invalid data after the start"), "{text}");
        assert!(text.contains("with the 6 before them") && text.contains("Rejected: a.csv record 2, a.csv record 9"));
    }
}
