//! The guest's async runtime: one current-thread tokio runtime per instance.
//!
//! A component instance is single-threaded and every export call runs to
//! completion, so each call blocks on its future here; host imports are
//! synchronous, so the futures never wait on anything but themselves.

use std::future::Future;
use std::sync::OnceLock;

static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

fn runtime() -> &'static tokio::runtime::Runtime {
    RUNTIME.get_or_init(|| {
        // Building a current-thread runtime only fails when the OS refuses a
        // resource; inside a component there is none it could refuse.
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap_or_else(|e| panic!("cannot build the guest's tokio runtime: {e}"))
    })
}

/// Runs a future to completion on the instance's runtime.
pub fn block_on<F: Future>(future: F) -> F::Output {
    runtime().block_on(future)
}

/// The runtime as iceberg wants it for its tables.
pub fn iceberg_runtime() -> iceberg::Runtime {
    iceberg::Runtime::new(runtime())
}
