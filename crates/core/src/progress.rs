//! Progress reporting: a status line on a terminal, log lines otherwise.
//!
//! Invariants:
//! - on a terminal, indicatif draws the status line (rows, rows/s, last
//!   committed checkpoint) and redraws it twice a second; every bar is in
//!   one [`MultiProgress`], and log lines written through [`log_writer`]
//!   suspend it, so they print above the bars, never through them;
//! - anywhere else (a pipe, a file) no bar exists and log lines are written
//!   to stderr as they are formatted, nothing added.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressState, ProgressStyle};
use tracing_indicatif::IndicatifWriter;
use tracing_indicatif::writer::Stderr;

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

/// The bars on stderr: drawn when it is a terminal, hidden otherwise.
fn bars() -> &'static MultiProgress {
    static BARS: OnceLock<MultiProgress> = OnceLock::new();
    BARS.get_or_init(MultiProgress::new)
}

/// A `tracing` writer for stderr that lifts the bars off the terminal while
/// a log line is written and draws them again below it.
pub fn log_writer() -> IndicatifWriter<Stderr> {
    IndicatifWriter::new(bars().clone())
}

/// A bar of [`bars`] showing `line` and redrawn every `every` until
/// [`stop`] clears it; `None` when indicatif refuses the template.
fn start_bar(
    every: Duration,
    line: impl Fn(&ProgressState, &mut dyn std::fmt::Write) + Send + Sync + Clone + 'static,
) -> Option<ProgressBar> {
    let style = ProgressStyle::with_template("{line}").ok()?.with_key("line", line);
    let bar = bars().add(ProgressBar::no_length().with_style(style));
    bar.enable_steady_tick(every);
    Some(bar)
}

/// Clears a bar of [`start_bar`] and takes it out of [`bars`].
fn stop(bar: Option<ProgressBar>) {
    if let Some(bar) = bar {
        bar.finish_and_clear();
        bars().remove(&bar);
    }
}

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
    /// What the source says of itself (a Kafka source's lag per topic).
    source_note: std::sync::Mutex<Option<String>>,
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
            source_note: std::sync::Mutex::new(None),
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

    /// What the source says of itself now (a Kafka source's lag), shown on
    /// the status line and logged with each commit.
    pub fn set_source_note(&self, note: Option<String>) {
        if let Ok(mut n) = self.source_note.lock() {
            *n = note;
        }
    }

    pub fn source_note(&self) -> Option<String> {
        self.source_note.lock().ok().and_then(|n| n.clone())
    }

    /// Records a committed checkpoint and, in plain mode, logs it.
    pub fn committed(&self, c: u64, total_rows: u64) {
        self.committed.store(c + 1, Ordering::Relaxed);
        if self.mode == ProgressMode::Plain {
            let rows_per_sec = format!("{:.0}", self.rows_per_sec());
            match self.source_note() {
                Some(source) => tracing::info!(
                    checkpoint = c,
                    rows_total = total_rows,
                    rows_per_sec,
                    source = %source,
                    "checkpoint committed"
                ),
                None => tracing::info!(checkpoint = c, rows_total = total_rows, rows_per_sec, "checkpoint committed"),
            }
        }
    }

    fn status(&self) -> String {
        let committed = match self.committed.load(Ordering::Relaxed) {
            0 => "none yet".to_string(),
            c => (c - 1).to_string(),
        };
        let line = format!(
            "{} rows · {:.0} rows/s · last committed checkpoint: {committed}",
            self.rows(),
            self.rows_per_sec()
        );
        match self.source_note() {
            Some(note) => format!("{line} · {note}"),
            None => line,
        }
    }

    /// Starts the status line when showing one; stops when the guard drops.
    pub fn start_status_line(self: &Arc<Self>) -> StatusLine {
        if self.mode != ProgressMode::Auto {
            return StatusLine { bar: None };
        }
        let progress = self.clone();
        let bar = start_bar(Duration::from_millis(500), move |_: &ProgressState, w: &mut dyn std::fmt::Write| {
            let _ = w.write_str(&progress.status());
        });
        StatusLine { bar }
    }
}

/// Stops the status line when dropped.
pub struct StatusLine {
    bar: Option<ProgressBar>,
}

impl Drop for StatusLine {
    fn drop(&mut self) {
        stop(self.bar.take());
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
    bar: Option<ProgressBar>,
}

impl Ticker {
    /// Shows `line(elapsed)` until the ticker is dropped.
    pub fn start(line: impl Fn(Duration) -> String + Send + 'static) -> Self {
        if !std::io::stderr().is_terminal() {
            return Self { bar: None };
        }
        // indicatif shares the line between threads; the mutex makes any
        // `Send` closure do.
        let line = Arc::new(Mutex::new(line));
        let bar = start_bar(Duration::from_millis(250), move |state: &ProgressState, w: &mut dyn std::fmt::Write| {
            let text = line.lock().map(|line| line(state.elapsed())).unwrap_or_default();
            let _ = w.write_str(&text);
        });
        Self { bar }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        stop(self.bar.take());
    }
}
