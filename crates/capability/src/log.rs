//! The `log` capability: plugin log lines become host `tracing` events tagged
//! with the plugin's name and the instance. Always granted.
//!
//! Invariant: an instance's log lines (these and its stdout/stderr lines)
//! share one [`LogBudget`]: at most `log_bytes_per_call` bytes in a call and
//! `log_bytes_per_sec` in any second. Lines beyond are dropped, and the call
//! ends with one notice saying how many were.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmtime::component::{HasData, Linker};

use super::CapabilityHost;
use crate::bindings::v0_2::sluice::connector::log::{self as wit, Host, Level};
use crate::bindings::v0_2::sluice::connector::types;

/// Names an instance in logs and errors: `files` / `writer[2]`.
#[derive(Debug, Clone)]
pub struct InstanceTag {
    pub plugin: Arc<str>,
    pub instance: Arc<str>,
}

/// One instance's log: who it is, and its budget.
pub struct LogCtx {
    pub tag: InstanceTag,
    pub budget: SharedLogBudget,
}

/// The log budget of one instance, shared by its `log` capability and its
/// captured stdout/stderr.
#[derive(Clone, Debug)]
pub struct SharedLogBudget(Arc<Mutex<LogBudget>>);

#[derive(Debug)]
struct LogBudget {
    per_call: u64,
    per_sec: u64,
    call_bytes: u64,
    window_start: Instant,
    window_bytes: u64,
    dropped_lines: u64,
    dropped_bytes: u64,
    /// The setting that dropped the first line of the call.
    reason: Option<(&'static str, u64)>,
}

/// Lines a call dropped, for its one notice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub lines: u64,
    pub bytes: u64,
    pub setting: &'static str,
    pub limit: u64,
}

impl SharedLogBudget {
    pub fn new(per_call: u64, per_sec: u64) -> Self {
        Self(Arc::new(Mutex::new(LogBudget {
            per_call,
            per_sec,
            call_bytes: 0,
            window_start: Instant::now(),
            window_bytes: 0,
            dropped_lines: 0,
            dropped_bytes: 0,
            reason: None,
        })))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogBudget> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a line of `bytes` may be logged now (it is counted if so,
    /// and counted as dropped if not).
    pub fn admit(&self, bytes: usize) -> bool {
        let bytes = bytes as u64;
        let mut b = self.lock();
        let now = Instant::now();
        if now.duration_since(b.window_start) >= Duration::from_secs(1) {
            b.window_start = now;
            b.window_bytes = 0;
        }
        let over = if b.call_bytes.saturating_add(bytes) > b.per_call {
            Some(("sink.sandbox.log_bytes_per_call", b.per_call))
        } else if b.window_bytes.saturating_add(bytes) > b.per_sec {
            Some(("sink.sandbox.log_bytes_per_sec", b.per_sec))
        } else {
            None
        };
        match over {
            None => {
                b.call_bytes += bytes;
                b.window_bytes += bytes;
                true
            }
            Some(reason) => {
                b.dropped_lines += 1;
                b.dropped_bytes = b.dropped_bytes.saturating_add(bytes);
                b.reason.get_or_insert(reason);
                false
            }
        }
    }

    /// A new call starts: its own per-call allowance.
    pub fn begin_call(&self) {
        self.lock().call_bytes = 0;
    }

    /// What the call dropped, once (the count starts again).
    pub fn take_dropped(&self) -> Option<Dropped> {
        let mut b = self.lock();
        let (setting, limit) = b.reason.take()?;
        let dropped = Dropped { lines: b.dropped_lines, bytes: b.dropped_bytes, setting, limit };
        b.dropped_lines = 0;
        b.dropped_bytes = 0;
        Some(dropped)
    }
}

/// What the `log` interface is linked through.
pub struct LogView<'a> {
    pub ctx: &'a LogCtx,
}

/// The `log` capability for wasmtime's linker.
pub struct Log;

impl HasData for Log {
    type Data<'a> = LogView<'a>;
}

/// The contract's shared `types` interface: no functions, nothing to hold.
pub(super) struct Types;

impl HasData for Types {
    type Data<'a> = ();
}

impl types::Host for () {}

/// The view of a store's data.
pub(super) fn view<T: CapabilityHost>(t: &mut T) -> LogView<'_> {
    LogView { ctx: &t.capabilities().0.log }
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    types::add_to_linker::<T, Types>(linker, |_| ())?;
    wit::add_to_linker::<T, Log>(linker, view::<T>)
}

impl LogView<'_> {
    /// Records a plugin's line in the host log.
    pub(super) fn record(&self, level: Level, message: &str) {
        if !self.ctx.budget.admit(message.len()) {
            return;
        }
        let plugin = &*self.ctx.tag.plugin;
        let instance = &*self.ctx.tag.instance;
        match level {
            Level::Trace => tracing::trace!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Debug => tracing::debug!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Info => tracing::info!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Warn => tracing::warn!(target: "sluice::plugin", plugin, instance, "{message}"),
            Level::Error => tracing::error!(target: "sluice::plugin", plugin, instance, "{message}"),
        }
    }
}

/// The one notice of a call that dropped log lines.
pub fn notice_dropped(tag: &InstanceTag, call: &str, dropped: &Dropped) {
    tracing::warn!(
        target: "sluice::plugin",
        plugin = &*tag.plugin,
        instance = &*tag.instance,
        "{}.{call}: dropped {} log line(s) ({} bytes) beyond {} = {} bytes",
        tag.instance,
        dropped.lines,
        dropped.bytes,
        dropped.setting,
        dropped.limit
    );
}

impl Host for LogView<'_> {
    fn log(&mut self, level: Level, message: String) {
        self.record(level, &message);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_beyond_the_budget_are_dropped_and_counted_once() {
        let budget = SharedLogBudget::new(100, 1000);
        assert!(budget.admit(60));
        assert!(!budget.admit(60));
        assert!(!budget.admit(50));
        assert!(budget.admit(40));
        let dropped = budget.take_dropped().expect("two dropped");
        assert_eq!((dropped.lines, dropped.bytes, dropped.setting), (2, 110, "sink.sandbox.log_bytes_per_call"));
        assert_eq!(budget.take_dropped(), None);
        budget.begin_call();
        assert!(budget.admit(100));
        let per_sec = SharedLogBudget::new(1000, 100);
        assert!(per_sec.admit(100));
        assert!(!per_sec.admit(1));
        assert_eq!(per_sec.take_dropped().map(|d| d.setting), Some("sink.sandbox.log_bytes_per_sec"));
    }
}
