//! Progress reporting: a status line on a terminal, log lines otherwise.
//!
//! On a terminal a thread redraws one status line (rows, rows/s, last
//! committed checkpoint) twice a second; log lines erase it before printing
//! (see [`StatusAwareStderr`]) and it is redrawn on the next tick.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
    /// When the run started (before the plugin was loaded).
    start: Instant,
    /// When the subtasks started reading.
    data_start: OnceLock<Instant>,
    /// When the first rows were written.
    first_write: OnceLock<Instant>,
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
        Arc::new(Self {
            start: Instant::now(),
            data_start: OnceLock::new(),
            first_write: OnceLock::new(),
            rows: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            mode,
        })
    }

    /// The subtasks start reading now.
    pub fn data_started(&self) {
        let _ = self.data_start.set(Instant::now());
    }

    /// `n` rows were written to a writer.
    pub fn add_rows(&self, n: u64) {
        let _ = self.first_write.set(Instant::now());
        self.rows.fetch_add(n, Ordering::Relaxed);
    }

    /// From the start of the run to the first rows written, if any were.
    pub fn first_write(&self) -> Option<Duration> {
        self.first_write.get().map(|t| t.duration_since(self.start))
    }

    pub fn rows(&self) -> u64 {
        self.rows.load(Ordering::Relaxed)
    }

    /// Time since the run started moving rows (since it started, before that).
    pub fn elapsed(&self) -> std::time::Duration {
        self.data_start.get().unwrap_or(&self.start).elapsed()
    }

    pub fn rows_per_sec(&self) -> f64 {
        let secs = self.elapsed().as_secs_f64();
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

/// The process's peak resident memory (`VmHWM`), where the system says it.
pub fn peak_memory() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A line on a terminal's stderr, redrawn four times a second until dropped,
/// for a long step without other output (compiling a plugin). Nothing when
/// stderr is not a terminal.
pub struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Shows `line(elapsed)` until the ticker is dropped.
    pub fn start(line: impl Fn(Duration) -> String + Send + 'static) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        if !std::io::stderr().is_terminal() {
            return Self { stop, thread: None };
        }
        let flag = stop.clone();
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("sluice-ticker".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    {
                        let _guard = STDERR_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                        let mut err = std::io::stderr().lock();
                        let _ = write!(err, "\r\x1b[2K{}", line(started.elapsed()));
                        let _ = err.flush();
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                let _guard = STDERR_LOCK.lock().unwrap_or_else(|p| p.into_inner());
                let _ = write!(std::io::stderr(), "\r\x1b[2K");
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
