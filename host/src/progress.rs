//! Progress reporting: a status line on a terminal, log lines otherwise.
//!
//! On a terminal a thread redraws one status line (rows, rows/s, last
//! committed checkpoint) twice a second; log lines erase it before printing
//! (see [`StatusAwareStderr`]) and it is redrawn on the next tick.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How to show progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProgressMode {
    /// A status line when stderr is a terminal, log lines otherwise.
    #[default]
    Auto,
    /// Log lines only.
    Plain,
    /// Nothing beyond warnings and errors.
    Quiet,
}

static STATUS_ACTIVE: AtomicBool = AtomicBool::new(false);
static STDERR_LOCK: Mutex<()> = Mutex::new(());

/// Counters shared by the engine's threads.
#[derive(Debug)]
pub struct Progress {
    start: Instant,
    rows: AtomicU64,
    /// Last committed checkpoint + 1 (0: none yet).
    committed: AtomicU64,
    pub(crate) mode: ProgressMode,
}

impl Progress {
    pub fn new(mode: ProgressMode) -> Arc<Self> {
        let mode = match mode {
            ProgressMode::Auto if std::io::stderr().is_terminal() => ProgressMode::Auto,
            ProgressMode::Auto => ProgressMode::Plain,
            m => m,
        };
        Arc::new(Self { start: Instant::now(), rows: AtomicU64::new(0), committed: AtomicU64::new(0), mode })
    }

    pub fn add_rows(&self, n: u64) {
        self.rows.fetch_add(n, Ordering::Relaxed);
    }

    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Time since the run started moving rows.
    pub fn elapsed(&self) -> std::time::Duration {
        self.start.elapsed()
    }

    pub fn rows_per_sec(&self) -> f64 {
        let secs = self.start.elapsed().as_secs_f64();
        if secs > 0.0 { self.rows() as f64 / secs } else { 0.0 }
    }

    /// Records a committed checkpoint and, in plain mode, logs it.
    pub fn committed(&self, c: u64, total_rows: u64) {
        self.committed.store(c + 1, Ordering::Relaxed);
        if self.mode == ProgressMode::Plain {
            tracing::info!(
                checkpoint = c,
                rows_total = total_rows,
                rows_per_sec = format!("{:.0}", self.rows_per_sec()),
                "checkpoint committed"
            );
        }
    }

    fn status(&self) -> String {
        let committed = match self.committed.load(Ordering::Relaxed) {
            0 => "none yet".to_string(),
            c => (c - 1).to_string(),
        };
        format!("{} rows · {:.0} rows/s · last committed checkpoint: {committed}", self.rows(), self.rows_per_sec())
    }

    /// Starts the status line when showing one; stops when the guard drops.
    pub fn start_status_line(self: &Arc<Self>) -> StatusLine {
        if self.mode != ProgressMode::Auto {
            return StatusLine { stop: Arc::new(AtomicBool::new(true)), thread: None };
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let progress = self.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-progress".into())
            .spawn(move || {
                STATUS_ACTIVE.store(true, Ordering::Relaxed);
                while !flag.load(Ordering::Relaxed) {
                    {
                        let _guard = STDERR_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                        let mut err = std::io::stderr().lock();
                        let _ = write!(err, "\r\x1b[2K{}", progress.status());
                        let _ = err.flush();
                    }
                    std::thread::sleep(Duration::from_millis(500));
                }
                let _guard = STDERR_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                let _ = write!(std::io::stderr(), "\r\x1b[2K");
                STATUS_ACTIVE.store(false, Ordering::Relaxed);
            })
            .ok();
        StatusLine { stop, thread }
    }
}

/// Stops the status line when dropped.
pub struct StatusLine {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Drop for StatusLine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A `tracing` writer for stderr that erases the status line first.
pub struct StatusAwareStderr;

impl Write for StatusAwareStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _guard = STDERR_LOCK.lock().unwrap_or_else(|p| p.into_inner());
        let mut err = std::io::stderr().lock();
        if STATUS_ACTIVE.load(Ordering::Relaxed) {
            err.write_all(b"\r\x1b[2K")?;
        }
        err.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for StatusAwareStderr {
    type Writer = StatusAwareStderr;
    fn make_writer(&'a self) -> Self::Writer {
        StatusAwareStderr
    }
}
