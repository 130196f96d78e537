//! One subtask: a source reader feeding one writer instance, on its own thread.
//!
//! Invariants:
//! - a round reads rows, writes them, then runs `prepare-commit(c)` and
//!   `snapshot-state(c)` in that order, and reports the source position taken
//!   right after the last row written, so position and writer state describe
//!   the same cut;
//! - a subtask never persists or commits anything; the coordinator does;
//! - on an injected crash the thread stops at once, without any cleanup call.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{EngineError, crash_point};
use crate::capability::Granted;
use crate::engine::checkpoint::SubtaskRecord;
use crate::ipc;
use crate::plugin::{Limits, Plugin, SinkCtx, SourceTable, WriterInstance};
use crate::progress::Progress;
use crate::source::{Source, SourceReader};

pub(crate) enum Command {
    Round(u64),
    AbortPrepare(u64),
    Close,
}

/// What a subtask hands the coordinator at the end of round `c`.
#[derive(Debug)]
pub(crate) struct RoundReport {
    pub c: u64,
    pub info: Option<Vec<u8>>,
    pub record: SubtaskRecord,
}

pub(crate) enum Reply {
    Opened,
    Round(RoundReport),
    Aborted,
    Closed,
}

/// Everything a subtask thread needs.
pub(crate) struct SubtaskSetup {
    pub subtask: u32,
    pub plugin: Plugin,
    pub grants: Granted,
    pub limits: Limits,
    pub ctx: SinkCtx,
    pub options: Vec<(String, String)>,
    /// The source's tables, with their current schemas.
    pub tables: Vec<SourceTable>,
    pub restored: Option<SubtaskRecord>,
    pub source: Arc<Source>,
    pub every_rows: Option<u64>,
    pub interval: Option<Duration>,
    #[cfg(feature = "fault-injection")]
    pub fault: Option<crate::fault::Fault>,
    pub progress: Arc<Progress>,
}

pub(crate) struct SubtaskHandle {
    pub subtask: u32,
    tx: Sender<Command>,
    rx: Receiver<Result<Reply, EngineError>>,
    thread: Option<JoinHandle<()>>,
}

impl SubtaskHandle {
    pub fn spawn(setup: SubtaskSetup) -> Result<Self, EngineError> {
        let (tx, cmd_rx) = channel();
        let (reply_tx, rx) = channel();
        let subtask = setup.subtask;
        let thread = std::thread::Builder::new()
            .name(format!("sluice-subtask-{subtask}"))
            .spawn(move || run(setup, cmd_rx, reply_tx))
            .map_err(EngineError::Thread)?;
        Ok(Self { subtask, tx, rx, thread: Some(thread) })
    }

    pub fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd).map_err(|_| EngineError::SubtaskLost(self.subtask))
    }

    pub fn recv(&self) -> Result<Reply, EngineError> {
        self.rx.recv().map_err(|_| EngineError::SubtaskLost(self.subtask))?
    }
}

impl Drop for SubtaskHandle {
    fn drop(&mut self) {
        // Closing the command channel ends the thread after its current call.
        let (dead_tx, _) = channel();
        drop(std::mem::replace(&mut self.tx, dead_tx));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Subtask {
    setup: SubtaskSetup,
    writer: WriterInstance,
    reader: Box<dyn SourceReader>,
    rows_total: u64,
    finished: bool,
    run_start: Instant,
    rows_this_run: u64,
    position: serde_json::Value,
}

fn run(setup: SubtaskSetup, commands: Receiver<Command>, replies: Sender<Result<Reply, EngineError>>) {
    let mut subtask = match Subtask::open(setup) {
        Ok(s) => {
            let _ = replies.send(Ok(Reply::Opened));
            s
        }
        Err(e) => {
            let _ = replies.send(Err(e));
            return;
        }
    };
    while let Ok(cmd) = commands.recv() {
        let reply = match cmd {
            Command::Round(c) => subtask.round(c).map(Reply::Round),
            Command::AbortPrepare(c) => {
                if let Err(e) = subtask.writer.abort_prepare(c) {
                    tracing::warn!(subtask = subtask.setup.subtask, checkpoint = c, error = %e, "abort-prepare failed");
                }
                Ok(Reply::Aborted)
            }
            Command::Close => {
                let r = subtask.writer.close().map(|()| Reply::Closed).map_err(EngineError::from);
                let _ = replies.send(r);
                return;
            }
        };
        let crashed = matches!(&reply, Err(e) if e.is_injected_crash());
        if replies.send(reply).is_err() || crashed {
            return;
        }
    }
}

impl Subtask {
    fn open(setup: SubtaskSetup) -> Result<Self, EngineError> {
        let instance = setup.plugin.instantiate(&format!("writer[{}]", setup.subtask), &setup.grants, setup.limits)?;
        let restored_state = setup.restored.as_ref().map(|r| r.writer_state.0.as_slice());
        let writer = WriterInstance::open(instance, &setup.ctx, &setup.options, &setup.tables, restored_state)?;
        let position = setup.restored.as_ref().map(|r| r.position.clone());
        let reader = setup.source.reader(setup.subtask, position.as_ref())?;
        let rows_total = setup.restored.as_ref().map_or(0, |r| r.rows);
        let finished = setup.restored.as_ref().is_some_and(|r| r.finished);
        let position = reader.position();
        Ok(Self { setup, writer, reader, rows_total, finished, run_start: Instant::now(), rows_this_run: 0, position })
    }

    /// Rows per batch: the source's preference, smaller when rate-limited so
    /// that a round can end on time.
    fn batch_rows(&self) -> usize {
        let preferred = self.setup.source.batch_rows();
        match self.rate() {
            Some(rate) => preferred.min(((rate / 10.0) as usize).max(1)),
            None => preferred,
        }
    }

    fn rate(&self) -> Option<f64> {
        self.setup.source.rate().map(|r| r / f64::from(self.setup.ctx.parallelism.max(1)))
    }

    fn round(&mut self, c: u64) -> Result<RoundReport, EngineError> {
        let deadline = self.setup.interval.map(|d| Instant::now() + d);
        let mut rows_in_round = 0u64;
        let mut wrote = false;
        while !self.finished {
            if self.setup.every_rows.is_some_and(|k| rows_in_round >= k) {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            let mut want = self.batch_rows() as u64;
            if let Some(k) = self.setup.every_rows {
                want = want.min(k - rows_in_round);
            }
            let Some(batch) = self.reader.next_batch(want as usize)? else {
                self.finished = true;
                break;
            };
            let n = batch.num_rows() as u64;
            let bytes = ipc::encode_batch(&batch)?;
            self.writer.write("", &bytes)?;
            rows_in_round += n;
            self.rows_total += n;
            self.rows_this_run += n;
            self.setup.progress.add_rows(n);
            if !wrote {
                wrote = true;
                crash_point!(self.setup.fault, AfterWrite, c, self.setup.subtask);
            }
            self.throttle(deadline);
        }
        // The cut: rows up to here belong to checkpoint `c`.
        self.position = self.reader.position();
        let info = self.writer.prepare_commit(c)?;
        crash_point!(self.setup.fault, AfterPrepareCommit, c, self.setup.subtask);
        let state = self.writer.snapshot_state(c)?;
        crash_point!(self.setup.fault, AfterSnapshotState, c, self.setup.subtask);
        Ok(RoundReport {
            c,
            info,
            record: SubtaskRecord {
                position: self.position.clone(),
                writer_state: crate::engine::checkpoint::Blob(state),
                rows: self.rows_total,
                finished: self.finished,
            },
        })
    }

    /// Sleeps as long as the rate limit demands, never past the round's end.
    fn throttle(&self, deadline: Option<Instant>) {
        let Some(rate) = self.rate() else { return };
        let due = self.run_start + Duration::from_secs_f64(self.rows_this_run as f64 / rate);
        let until = match deadline {
            Some(d) => due.min(d),
            None => due,
        };
        let now = Instant::now();
        if until > now {
            std::thread::sleep(until - now);
        }
    }
}
