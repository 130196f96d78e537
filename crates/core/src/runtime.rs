//! The host's one runtime for I/O: the capabilities (catalog, gRPC, HTTP,
//! object-store file I/O), the sources' object stores and the state
//! directory's store all run their futures here.
//!
//! Invariants:
//! - one runtime per process, started on first use and never shut down: an
//!   HTTP client pools connections whose tasks live on the runtime that
//!   opened them, and a runtime dropped with one user broke the requests of
//!   the next one in the same process;
//! - callers that wait for a future do so from their own threads (plugin
//!   calls, subtasks, the coordinator), never from a runtime thread, so a
//!   blocked caller never starves the runtime.

use std::future::Future;
use std::sync::{OnceLock, mpsc};

/// The worker threads of the I/O runtime: its work is waiting on sockets.
const WORKERS: usize = 2;

/// The process's I/O runtime, started on first use; an error when the
/// operating system refused its threads.
pub fn io() -> std::io::Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(WORKERS)
                .thread_name("sluice-io")
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start the host's I/O runtime: {e}"))
        })
        .as_ref()
        .map_err(|e| std::io::Error::other(e.clone()))
}

/// Why [`wait`] has no answer.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("{0}")]
    Start(#[from] std::io::Error),
    #[error("the host's I/O runtime stopped before the request finished")]
    Stopped,
}

/// Runs `fut` on the I/O runtime and waits for its output on this thread,
/// which must not be a runtime thread (see the module doc).
pub fn wait<T: Send + 'static>(fut: impl Future<Output = T> + Send + 'static) -> Result<T, RuntimeError> {
    let (tx, rx) = mpsc::sync_channel(1);
    io()?.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().map_err(|_| RuntimeError::Stopped)
}

#[cfg(test)]
mod tests {
    #[test]
    fn wait_returns_the_futures_output_from_a_plain_thread() {
        assert_eq!(super::wait(async { 7 }).expect("answered"), 7);
    }
}
