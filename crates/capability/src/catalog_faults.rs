//! Test faults and latency of catalog commits: a decorator around the commit
//! backend. The backend itself has no test branches; this layer decides, per
//! call, whether the commit reaches it. Without the `fault-injection`
//! feature [`wrap`] hands the backend back as it is.

use super::catalog::CommitBackend;
use crate::fault::Faults;

/// `backend`, behind the catalog faults and latency of `faults` if it has any.
#[cfg(feature = "fault-injection")]
pub(crate) fn wrap(backend: Box<dyn CommitBackend>, faults: &Faults) -> Box<dyn CommitBackend> {
    if faults.catalog.is_empty() {
        return backend;
    }
    Box::new(armed::FaultyCommits::new(backend, faults.catalog.clone()))
}

/// `backend` (no faults without the `fault-injection` feature).
#[cfg(not(feature = "fault-injection"))]
pub(crate) fn wrap(backend: Box<dyn CommitBackend>, _: &Faults) -> Box<dyn CommitBackend> {
    backend
}

#[cfg(feature = "fault-injection")]
mod armed {
    use std::sync::atomic::{AtomicU64, Ordering};

    use iceberg::TableIdent;

    use crate::bindings::v0_2::sluice::connector::iceberg_catalog::{CatalogError, LoadedTable};
    use crate::catalog::{CommitBackend, CommitError, TableCommit};
    use crate::fault::{CatalogFaults, CommitFault, Injected};

    pub(super) struct FaultyCommits {
        inner: Box<dyn CommitBackend>,
        faults: CatalogFaults,
        calls: AtomicU64,
    }

    impl FaultyCommits {
        pub(super) fn new(inner: Box<dyn CommitBackend>, faults: CatalogFaults) -> Self {
            Self { inner, faults, calls: AtomicU64::new(0) }
        }
    }

    impl CommitBackend for FaultyCommits {
        fn commit(&self, ident: &TableIdent, commit: TableCommit) -> Result<LoadedTable, CommitError> {
            let TableCommit { requirements, updates } = commit;
            let call = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.faults.latency.is_zero() {
                std::thread::sleep(self.faults.latency);
            }
            let fault = self.faults.faults.iter().find(|(n, _)| *n == call).map(|(_, f)| *f);
            if fault == Some(CommitFault::Conflict) {
                tracing::warn!(table = %ident, call, "injected fault: commit refused as a conflict");
                return Err(
                    CatalogError::Conflict("another writer committed first (injected fault)".to_string()).into()
                );
            }
            let applied = self.inner.commit(ident, TableCommit { requirements, updates })?;
            match fault {
                Some(CommitFault::LoseReply) => {
                    tracing::warn!(table = %ident, call, "injected fault: commit applied, reply dropped");
                    Err(CatalogError::UnknownOutcome("the catalog's reply was lost (injected fault)".to_string())
                        .into())
                }
                Some(CommitFault::CrashAfterApply) => {
                    tracing::warn!(table = %ident, call, "injected fault: crash right after the commit was applied");
                    Err(CommitError::InjectedCrash(Injected))
                }
                _ => Ok(applied),
            }
        }
    }
}
