//! What a plugin instance may make the host spend on its behalf: time
//! blocked in host calls, host memory held by capabilities, log volume, and
//! handles (output files, gRPC streams, HTTP requests). Each is a budget of
//! one instance, set in the job's `[sink.sandbox]`.
//!
//! Invariants:
//! - a plugin call runs synchronously on the thread that makes it (wasmtime
//!   without async), and so do the host imports it calls: the deadline of the
//!   call under way on a thread is that thread's [`CallDeadline`], set by the
//!   call and cleared when it returns;
//! - every host import that can block waits at most until that deadline,
//!   whatever timeout the plugin passes; past it the import returns a
//!   [`HostDeadline`] trap naming itself, and the call fails as one that ran
//!   past its deadline;
//! - host memory a capability holds for an instance is reserved from the
//!   instance's [`HostMemory`] before it is allocated, and released when the
//!   plugin takes it (or it is dropped); a reservation that does not fit is
//!   refused with an error naming `sink.sandbox.host_memory_mb`.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use thiserror::Error;

/// Host-side limits of one plugin instance (`[sink.sandbox]`, beside the
/// call deadline and the linear-memory cap).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostLimits {
    /// Host memory the capabilities may hold for the instance at once.
    pub host_memory_mb: u64,
    /// Log bytes (the `log` capability and stdout/stderr lines) per call.
    pub log_bytes_per_call: u64,
    /// Log bytes per second.
    pub log_bytes_per_sec: u64,
    /// `output-file`s open at once.
    pub max_open_files: u32,
    /// gRPC calls in flight at once: open `bidi-stream`s (each one channel
    /// of requests and one of replies) plus the unary call under way.
    pub max_grpc_streams: u32,
    /// `wasi:http` requests in flight at once (sent, reply not yet in).
    pub max_http_requests: u32,
}

pub const DEFAULT_HOST_MEMORY_MB: u64 = 1024;
pub const DEFAULT_LOG_BYTES_PER_CALL: u64 = 1 << 20;
pub const DEFAULT_LOG_BYTES_PER_SEC: u64 = 1 << 20;
pub const DEFAULT_MAX_OPEN_FILES: u32 = 256;
pub const DEFAULT_MAX_GRPC_STREAMS: u32 = 64;
pub const DEFAULT_MAX_HTTP_REQUESTS: u32 = 64;

impl Default for HostLimits {
    fn default() -> Self {
        Self {
            host_memory_mb: DEFAULT_HOST_MEMORY_MB,
            log_bytes_per_call: DEFAULT_LOG_BYTES_PER_CALL,
            log_bytes_per_sec: DEFAULT_LOG_BYTES_PER_SEC,
            max_open_files: DEFAULT_MAX_OPEN_FILES,
            max_grpc_streams: DEFAULT_MAX_GRPC_STREAMS,
            max_http_requests: DEFAULT_MAX_HTTP_REQUESTS,
        }
    }
}

impl HostLimits {
    pub fn host_memory_bytes(&self) -> u64 {
        self.host_memory_mb.saturating_mul(1 << 20)
    }
}

thread_local! {
    static DEADLINE: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// The deadline of the plugin call under way on this thread; restores the
/// previous one (normally none) when dropped.
pub struct CallDeadline {
    previous: Option<(Instant, Duration)>,
}

impl CallDeadline {
    /// Starts a call that may take `timeout` from now.
    pub fn enter(timeout: Duration) -> Self {
        let deadline = Instant::now().checked_add(timeout).unwrap_or_else(far_future);
        let previous = DEADLINE.with(|d| d.replace(Some((deadline, timeout))));
        Self { previous }
    }

    /// When the call under way on this thread must end, if one is.
    pub fn current() -> Option<Instant> {
        DEADLINE.with(|d| d.get()).map(|(at, _)| at)
    }

    /// The whole deadline of the call under way (for messages).
    pub fn timeout() -> Option<Duration> {
        DEADLINE.with(|d| d.get()).map(|(_, t)| t)
    }

    /// How long the call under way may still take (`None`: no call, no bound).
    pub fn remaining() -> Option<Duration> {
        Self::current().map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// `timeout`, shortened to what the call under way has left.
    pub fn bound(timeout: Duration) -> Duration {
        match Self::remaining() {
            Some(left) => timeout.min(left),
            None => timeout,
        }
    }

    /// Fails when the call under way is already past its deadline.
    pub fn check(import: &'static str) -> Result<(), HostDeadline> {
        match Self::remaining() {
            Some(left) if left.is_zero() => Err(HostDeadline { import }),
            _ => Ok(()),
        }
    }
}

impl Drop for CallDeadline {
    fn drop(&mut self) {
        DEADLINE.with(|d| d.set(self.previous));
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600)
}

/// The call's deadline passed while the plugin was blocked in `import`. As
/// the error of a host import it traps the call; `plugin::sandbox` reports
/// it as a missed deadline.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("the call deadline passed while the plugin was blocked in the host import `{import}`")]
pub struct HostDeadline {
    pub import: &'static str,
}

/// Awaits `fut` on `handle` (a runtime), giving up at the deadline of the
/// call under way: `fut` is dropped then, which cancels what it was doing.
pub fn block_on<F: Future>(
    handle: &tokio::runtime::Handle,
    import: &'static str,
    fut: F,
) -> Result<F::Output, HostDeadline> {
    match CallDeadline::current() {
        None => Ok(handle.block_on(fut)),
        Some(at) => {
            let at = tokio::time::Instant::from_std(at);
            handle.block_on(async move { tokio::time::timeout_at(at, fut).await }).map_err(|_| HostDeadline { import })
        }
    }
}

/// Host memory one instance's capabilities hold, against its budget.
#[derive(Debug)]
pub struct HostMemory {
    limit: u64,
    limit_mb: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

/// Host memory would exceed the instance's budget.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error(
    "{what} needs {needed} bytes of host memory, more than the {free} left of the instance's budget of {limit_mb} MiB (sink.sandbox.host_memory_mb)"
)]
pub struct OverBudget {
    pub what: String,
    pub needed: u64,
    pub free: u64,
    pub limit_mb: u64,
}

impl HostMemory {
    pub fn new(limit_mb: u64) -> Arc<Self> {
        Arc::new(Self {
            limit: limit_mb.saturating_mul(1 << 20),
            limit_mb,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// The whole budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn limit_mb(&self) -> u64 {
        self.limit_mb
    }

    /// Bytes not held now.
    pub fn free(&self) -> u64 {
        self.limit.saturating_sub(self.used.load(Ordering::Relaxed))
    }

    /// The most held at once so far.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// The error for `needed` bytes of `what` that do not fit.
    pub fn over(&self, what: impl Into<String>, needed: u64) -> OverBudget {
        OverBudget { what: what.into(), needed, free: self.free(), limit_mb: self.limit_mb }
    }

    /// Reserves `bytes` for `what`, released when the reservation drops.
    pub fn reserve(self: &Arc<Self>, what: &str, bytes: u64) -> Result<Reservation, OverBudget> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.saturating_add(bytes);
            if next > self.limit {
                return Err(self.over(what, bytes));
            }
            match self.used.compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return Ok(Reservation { memory: self.clone(), bytes });
                }
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes held against an instance's [`HostMemory`] until dropped.
#[derive(Debug)]
pub struct Reservation {
    memory: Arc<HostMemory>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.memory.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// A count of live handles of one kind against a cap (clones share it).
#[derive(Debug, Clone)]
pub struct HandleCap {
    open: Arc<AtomicUsize>,
    max: usize,
    /// `output files`, named in the refusal.
    what: &'static str,
    /// `sink.sandbox.max_open_files`.
    setting: &'static str,
}

/// One handle counted by a [`HandleCap`] until dropped.
#[derive(Debug)]
pub struct HandleSlot {
    open: Arc<AtomicUsize>,
}

impl Drop for HandleSlot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// More handles than the cap allows.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("too many {what} at once: the limit is {setting} = {max}")]
pub struct TooMany {
    pub what: &'static str,
    pub max: usize,
    pub setting: &'static str,
}

impl HandleCap {
    pub fn new(max: u32, what: &'static str, setting: &'static str) -> Self {
        Self { open: Arc::default(), max: max as usize, what, setting }
    }

    /// Takes a slot, or refuses when all are taken.
    pub fn take(&self) -> Result<HandleSlot, TooMany> {
        let mut open = self.open.load(Ordering::Relaxed);
        loop {
            if open >= self.max {
                return Err(TooMany { what: self.what, max: self.max, setting: self.setting });
            }
            match self.open.compare_exchange_weak(open, open + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(HandleSlot { open: self.open.clone() }),
                Err(now) => open = now,
            }
        }
    }

    /// Handles held now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_fit_the_budget_and_are_released() {
        let memory = HostMemory::new(1);
        let a = memory.reserve("a", 600 << 10).expect("fits");
        let err = memory.reserve("b", 600 << 10).expect_err("does not fit");
        assert!(err.to_string().contains("sink.sandbox.host_memory_mb"), "{err}");
        drop(a);
        let _b = memory.reserve("b", 600 << 10).expect("fits once a is released");
        assert_eq!(memory.peak(), 600 << 10);
    }

    #[test]
    fn handle_caps_refuse_beyond_the_limit() {
        let cap = HandleCap::new(2, "output files open", "sink.sandbox.max_open_files");
        let one = cap.take().expect("1");
        let _two = cap.take().expect("2");
        let err = cap.take().expect_err("3");
        assert!(err.to_string().contains("sink.sandbox.max_open_files = 2"), "{err}");
        drop(one);
        assert!(cap.take().is_ok());
    }

    #[test]
    fn the_deadline_bounds_timeouts_and_waits() {
        assert_eq!(CallDeadline::remaining(), None);
        // Multi-threaded, as the host's runtimes are: a current-thread
        // runtime's handle cannot drive timers from `Handle::block_on`.
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_time().build().expect("runtime");
        {
            let _call = CallDeadline::enter(Duration::from_millis(50));
            assert!(CallDeadline::bound(Duration::from_secs(600)) <= Duration::from_millis(50));
            let start = Instant::now();
            // The timer is made inside the runtime, as every capability's is.
            let sleep = async { tokio::time::sleep(Duration::from_secs(30)).await };
            let err = block_on(rt.handle(), "test.sleep", sleep).expect_err("the deadline stops the wait");
            assert_eq!(err.import, "test.sleep");
            assert!(start.elapsed() < Duration::from_secs(5));
            assert!(CallDeadline::check("test.after").is_err());
        }
        assert_eq!(CallDeadline::remaining(), None);
    }
}
