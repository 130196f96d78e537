//! Sandbox limits: call deadlines (epochs), memory caps, guest output capture
//! and the translation of traps into messages a user can act on.
//!
//! Invariants:
//! - the epoch ticker runs on its own OS thread (a tokio task could be starved
//!   by a spinning guest), so every call's deadline fires;
//! - a trap never unwinds into the host: it becomes an error naming the
//!   plugin, the instance, the call and the cause, and the instance is
//!   retired (wasmtime forbids re-entering a trapped instance);
//! - the epoch deadline only fires while wasm runs; a call blocked in a host
//!   import is bounded by the same deadline there (`capability::limits`),
//!   and its trap names the import;
//! - a plugin's stdout/stderr lines count against its log budget.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use wasmtime::{Engine, ResourceLimiter, StoreLimits, StoreLimitsBuilder, Trap};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};

use sluice_capability::InstanceTag;
use sluice_capability::limits::HostDeadline;
use sluice_capability::log::SharedLogBudget;

/// Length of one epoch tick.
pub const TICK: Duration = Duration::from_millis(10);

/// Deadline in ticks for a call that may take `timeout`.
pub fn ticks(timeout: Duration) -> u64 {
    (timeout.as_nanos() / TICK.as_nanos()).max(1) as u64 + 1
}

/// Increments the engine's epoch every [`TICK`] until dropped.
pub struct EpochTicker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EpochTicker {
    pub fn start(engine: &Engine) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let engine = engine.clone();
        let flag = stop.clone();
        let thread = std::thread::Builder::new().name("sluice-epoch".into()).spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                std::thread::sleep(TICK);
                engine.increment_epoch();
            }
        })?;
        Ok(Self { stop, thread: Some(thread) })
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const TAIL_BYTES: usize = 8 * 1024;

/// A plugin's stdout/stderr: complete lines go to the host log, and the last
/// few KiB are kept so that a trap's message can quote a panic.
#[derive(Clone)]
pub struct GuestOutput {
    inner: Arc<Mutex<OutputInner>>,
}

struct OutputInner {
    tag: InstanceTag,
    stream: &'static str,
    line: Vec<u8>,
    tail: VecDeque<u8>,
    budget: SharedLogBudget,
}

impl GuestOutput {
    pub fn new(tag: InstanceTag, stream: &'static str, budget: SharedLogBudget) -> Self {
        Self {
            inner: Arc::new(Mutex::new(OutputInner { tag, stream, line: Vec::new(), tail: VecDeque::new(), budget })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, OutputInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last bytes the plugin wrote, as text.
    pub fn tail(&self) -> String {
        let inner = self.lock();
        let bytes: Vec<u8> = inner.tail.iter().copied().collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    fn push(&self, data: &[u8]) {
        let mut inner = self.lock();
        for &b in data {
            if inner.tail.len() == TAIL_BYTES {
                inner.tail.pop_front();
            }
            inner.tail.push_back(b);
            if b == b'\n' {
                let line = std::mem::take(&mut inner.line);
                if !inner.budget.admit(line.len() + 1) {
                    continue;
                }
                let text = String::from_utf8_lossy(&line);
                tracing::warn!(
                    target: "sluice::plugin",
                    plugin = &*inner.tag.plugin,
                    instance = &*inner.tag.instance,
                    "{}: {}",
                    inner.stream,
                    text.trim_end()
                );
            } else if inner.line.len() < TAIL_BYTES {
                inner.line.push(b);
            }
        }
    }
}

impl IsTerminal for GuestOutput {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for GuestOutput {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

impl tokio::io::AsyncWrite for GuestOutput {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The store's resource limiter: wasmtime's [`StoreLimits`] with a memory
/// cap, plus a flag raised when the plugin asked for more memory than the
/// cap allows. A trap is then classified by what happened, not by the text
/// of wasmtime's message.
pub struct MemoryCap {
    limits: StoreLimits,
    exceeded: bool,
    /// The largest linear memory granted so far, in bytes.
    peak: usize,
}

impl MemoryCap {
    pub fn new(memory_mb: u64) -> Self {
        let bytes = usize::try_from(memory_mb.saturating_mul(1024 * 1024)).unwrap_or(usize::MAX);
        Self {
            limits: StoreLimitsBuilder::new().memory_size(bytes).trap_on_grow_failure(true).build(),
            exceeded: false,
            peak: 0,
        }
    }

    /// The largest linear memory the instance has had (wasm memory never shrinks).
    pub fn peak(&self) -> usize {
        self.peak
    }

    /// Whether a memory growth was refused since the store was made.
    pub fn exceeded(&self) -> bool {
        self.exceeded
    }
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        let allowed = self.limits.memory_growing(current, desired, maximum);
        match allowed {
            Ok(true) => self.peak = self.peak.max(desired),
            _ => self.exceeded = true,
        }
        allowed
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.exceeded = true;
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(&mut self, current: usize, desired: usize, maximum: Option<usize>) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// Why a call trapped, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrapCause {
    /// The call ran past its deadline.
    Deadline(Duration),
    /// The call's deadline passed while it was blocked in a host import.
    DeadlineIn {
        timeout: Duration,
        import: &'static str,
    },
    /// The plugin called `exit` (WASI `wasi:cli/exit`) with this status.
    Exit(i32),
    /// The plugin tried to grow its memory past the cap.
    Memory(u64),
    /// The plugin panicked; the message is its own.
    Panic(String),
    /// A test injected a crash (never, without the `fault-injection` feature).
    Injected(sluice_core::fault::Injected),
    Other(String),
}

impl std::fmt::Display for TrapCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TrapCause::Deadline(d) => write!(
                f,
                "did not return within its call deadline of {:.1}s and was stopped (an endless loop? raise sink.sandbox.call_timeout_secs if it is just slow)",
                d.as_secs_f64()
            ),
            TrapCause::DeadlineIn { timeout, import } => write!(
                f,
                "did not return within its call deadline of {:.1}s and was stopped while blocked in the host import `{import}` (raise sink.sandbox.call_timeout_secs if what it waits for is just slow)",
                timeout.as_secs_f64()
            ),
            TrapCause::Exit(status) => write!(f, "exited with status {status}"),
            TrapCause::Memory(mb) => write!(
                f,
                "tried to use more than its memory limit of {mb} MiB and was stopped (raise sink.sandbox.memory_mb if the plugin needs more)"
            ),
            TrapCause::Panic(msg) => write!(f, "panicked: {msg}"),
            TrapCause::Injected(injected) => write!(f, "{injected}"),
            TrapCause::Other(msg) => write!(f, "trapped: {msg}"),
        }
    }
}

/// Classifies a trap: by the limiter's flag (memory), the trap code
/// (deadline, `unreachable`), and the guest's own output to quote a panic.
pub fn classify(
    err: &wasmtime::Error,
    timeout: Duration,
    memory_mb: u64,
    memory_exceeded: bool,
    output: &str,
) -> TrapCause {
    if let Some(injected) = err.downcast_ref::<sluice_core::fault::Injected>() {
        return TrapCause::Injected(*injected);
    }
    if memory_exceeded {
        return TrapCause::Memory(memory_mb);
    }
    if let Some(late) = err.downcast_ref::<HostDeadline>() {
        return TrapCause::DeadlineIn { timeout, import: late.import };
    }
    if let Some(exit) = err.downcast_ref::<wasmtime_wasi::I32Exit>() {
        return TrapCause::Exit(exit.0);
    }
    match err.downcast_ref::<Trap>() {
        Some(Trap::Interrupt) => return TrapCause::Deadline(timeout),
        // A Rust guest's panic prints its message, then aborts with `unreachable`.
        Some(Trap::UnreachableCodeReached) => {
            if let Some(start) = output.rfind("panicked at") {
                let msg: String = output[start..].lines().take(3).collect::<Vec<_>>().join(" ");
                return TrapCause::Panic(msg);
            }
        }
        _ => {}
    }
    let text = format!("{err:?}");
    let first = text.lines().next().unwrap_or("unknown trap").to_string();
    TrapCause::Other(first)
}
