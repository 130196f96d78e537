//! One subtask: a source reader feeding one writer instance, on its own thread.
//!
//! Invariants:
//! - a round reads rows, writes them, then runs `prepare-commit(c)` and
//!   `snapshot-state(c)` in that order, and reports the source position taken
//!   right after the last row written, so position and writer state describe
//!   the same cut;
//! - a subtask never persists or commits anything; the coordinator does;
//! - a batch that needs the target changed first (a new table, a wider
//!   schema; see `engine::tables`) is held, and the round ends with the cut
//!   just before it: its rows belong to a later checkpoint, written after the
//!   coordinator applied the change (`Command::Apply`). Up to a batch's worth
//!   of rows after it are read ahead and held too, so that the changes of
//!   several tables arriving together cost one barrier, not one each;
//! - every batch a writer gets has its table's current schema;
//! - a round's interval ends it only once the round has read a batch (or
//!   found the source idle): however short the interval, every round moves
//!   rows, so a tiny `job.checkpoint.interval_secs` costs checkpoints, not
//!   progress. A rate-limited round's first read waits for the rate, not
//!   for the interval;
//! - a stop request (SIGTERM) ends the round at its next batch; a subtask
//!   that waits for its rate looks at the request at least every
//!   [`STOP_POLL`], so a rate-limited source stops within it at any rate;
//! - on an injected crash the thread stops at once, without any cleanup call.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arrow_schema::SchemaRef;

use super::EngineError;
use super::checkpoint::{Blob, SubtaskRecord};
use super::dead_letter;
use super::rejected;
use super::tables::{self, Change, Fit, SchemaRefusal, TableSet};
use super::writer::WriterEnv;
use crate::fault::CrashPoint;
use crate::ipc;
use crate::metrics::Tally;
use crate::plugin::{SinkCtx, WriterInstance};
use crate::source::{BadRow, Read, SourceReader, TableBatch};

pub(crate) enum Command {
    Round(u64),
    /// The sink evolved the target: the writer applies the changes, and the
    /// subtask takes the new schemas.
    Apply(Vec<Change>),
    AbortPrepare(u64),
    Close,
}

/// What a subtask hands the coordinator at the end of round `c`.
#[derive(Debug)]
pub struct RoundReport {
    pub c: u64,
    pub info: Option<Vec<u8>>,
    pub record: SubtaskRecord,
    /// Rows written in this round.
    pub rows: u64,
    /// Rows and bytes written in this round, per table, and the records of
    /// each that became dead letters.
    pub tables: BTreeMap<String, Tally>,
    /// The first few dead letters of this round, with their tables.
    pub bad_sample: Vec<(String, BadRow)>,
    /// The writer instance's linear memory at the round's end, in bytes.
    pub memory: u64,
    /// From the round's cut to this report: its `prepare-commit` and
    /// `snapshot-state` (the part of the checkpoint the coordinator does not see).
    pub prepare: Duration,
    /// The round ended at a barrier: the target must change first.
    pub changes: Vec<Change>,
    /// The round ended at a schema change that is refused.
    pub refusal: Option<SchemaRefusal>,
}

pub(crate) enum Reply {
    Opened,
    /// Boxed: a report is far larger than the other replies.
    Round(Box<RoundReport>),
    Applied,
    Aborted,
    /// The writer closed; the largest linear memory its instance had, and
    /// the most host memory its capabilities held for it.
    Closed(u64, u64),
}

/// Everything a subtask thread needs: what all writers share, and its own.
pub(crate) struct SubtaskSetup {
    pub env: Arc<WriterEnv>,
    pub subtask: u32,
    pub ctx: SinkCtx,
    /// The tables the writers know, with their current schemas.
    pub tables: TableSet,
    pub restored: Option<SubtaskRecord>,
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

/// How many dead letters a round report shows.
const BAD_SAMPLE: usize = 3;

/// The longest a rate-limited subtask sleeps before it looks at the stop
/// request again: the bound on how late a rate-limited source stops.
pub const STOP_POLL: Duration = Duration::from_millis(100);

/// What one table of a source batch writes.
struct Part {
    table: String,
    batch: arrow_array::RecordBatch,
    /// The shape the source sent, before any conforming to the table: what
    /// `seen` records, so that a later batch of the same shape is no change.
    sent: SchemaRef,
    /// Dead letters (not rows of the source's tables).
    letters: bool,
}

/// What a round wrote before its cut.
#[derive(Default)]
struct Filled {
    /// Rows written in this round.
    rows: u64,
    /// Rows and bytes per table.
    tables: BTreeMap<String, Tally>,
    /// The first few dead letters.
    bad_sample: Vec<(String, BadRow)>,
    wrote: bool,
    /// The barrier's changes, when the round ends at one.
    changes: Vec<Change>,
    /// The refused shape, when the round ends at one.
    refusal: Option<SchemaRefusal>,
    /// The cut when the round ends at a barrier: just before the held batch.
    cut: Option<serde_json::Value>,
}

/// The next input of a round.
enum Input {
    /// A batch, with the position before it.
    Batch(TableBatch, serde_json::Value),
    Idle,
    End,
}

pub(crate) struct Subtask {
    setup: SubtaskSetup,
    writer: WriterInstance,
    reader: Box<dyn SourceReader>,
    rows_total: u64,
    /// Dead letters over all runs.
    bad_total: u64,
    finished: bool,
    run_start: Instant,
    rows_this_run: u64,
    position: serde_json::Value,
    /// The shape this subtask's source sent last, per table.
    seen: BTreeMap<String, SchemaRef>,
    /// Batches read but held at a barrier, each with the position before it.
    held: VecDeque<(TableBatch, serde_json::Value)>,
    /// Rows the writer was given per table since it opened or the table
    /// last changed: how a sink counts the rows it names when it rejects
    /// them (the contract's `invalid-data`).
    input_rows: BTreeMap<String, u64>,
    /// The writes since the last `prepare-commit`, per table, to map such
    /// a row back to the source.
    spans: BTreeMap<String, Vec<Span>>,
}

/// One write call's rows, as the sink counts them and as the source has them.
struct Span {
    first: u64,
    rows: u64,
    origin: Option<crate::source::Origin>,
    before: serde_json::Value,
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
            Command::Round(c) => subtask.round(c).map(|r| Reply::Round(Box::new(r))),
            Command::Apply(changes) => subtask.apply(&changes).map(|()| Reply::Applied),
            Command::AbortPrepare(c) => {
                if let Err(e) = subtask.abort_prepare(c) {
                    tracing::warn!(subtask = subtask.setup.subtask, checkpoint = c, error = %e, "abort-prepare failed");
                }
                Ok(Reply::Aborted)
            }
            Command::Close => {
                let _ = replies.send(subtask.close().map(|(linear, host)| Reply::Closed(linear, host)));
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
    pub(crate) fn id(&self) -> u32 {
        self.setup.subtask
    }

    pub(crate) fn abort_prepare(&mut self, c: u64) -> Result<(), crate::plugin::PluginError> {
        self.writer.abort_prepare(c)
    }

    /// Closes the writer; the largest linear memory its instance had, and
    /// the most host memory held for it.
    pub(crate) fn close(&mut self) -> Result<(u64, u64), EngineError> {
        let peak = self.writer.memory_peak();
        self.writer.close()?;
        Ok((peak, self.writer.host_memory_peak()))
    }

    pub(crate) fn open(setup: SubtaskSetup) -> Result<Self, EngineError> {
        let instance =
            setup.env.plugin.instantiate(&format!("writer[{}]", setup.subtask), &setup.env.grants, setup.env.limits)?;
        let restored_state = setup.restored.as_ref().map(|r| r.writer_state.0.as_slice());
        let writer = WriterInstance::open(
            instance,
            &setup.ctx,
            &setup.env.options,
            &setup.tables.source_tables()?,
            restored_state,
        )?;
        let position = setup.restored.as_ref().map(|r| r.position.clone());
        let reader = setup.env.source.reader(setup.subtask, position.as_ref())?;
        let rows_total = setup.restored.as_ref().map_or(0, |r| r.rows);
        let bad_total = setup.restored.as_ref().map_or(0, |r| r.bad_rows);
        // A subtask that had read all it had asks its reader again: a file
        // source may have gained files after its position since.
        let finished = false;
        let mut seen = BTreeMap::new();
        for (table, shape) in setup.restored.iter().flat_map(|r| r.seen.iter()) {
            let schema = match shape {
                Some(blob) => Some(ipc::decode_schema(&blob.0)?),
                None => setup.tables.get(table).cloned(),
            };
            if let Some(schema) = schema {
                seen.insert(table.clone(), schema);
            }
        }
        let position = reader.position();
        Ok(Self {
            setup,
            writer,
            reader,
            rows_total,
            bad_total,
            finished,
            run_start: Instant::now(),
            rows_this_run: 0,
            position,
            seen,
            held: VecDeque::new(),
            input_rows: BTreeMap::new(),
            spans: BTreeMap::new(),
        })
    }

    /// The target took `changes`: the writer applies them, and batches of
    /// the changed tables are conformed to the new schemas from now on.
    pub(crate) fn apply(&mut self, changes: &[Change]) -> Result<(), EngineError> {
        self.writer.apply_changes(&tables::contract_changes(changes)?)?;
        self.setup.tables.apply(changes);
        for change in changes {
            self.input_rows.remove(&change.table);
            self.spans.remove(&change.table);
        }
        Ok(())
    }

    /// The shapes this subtask sent, as the record keeps them.
    fn seen_record(&self) -> Result<BTreeMap<String, Option<Blob>>, EngineError> {
        let mut out = BTreeMap::new();
        for (table, shape) in &self.seen {
            let same = self.setup.tables.get(table).is_some_and(|t| tables::same_shape(t, shape));
            out.insert(table.clone(), if same { None } else { Some(Blob(ipc::encode_schema(shape)?)) });
        }
        Ok(out)
    }

    /// Rows per batch: the source's preference, smaller when rate-limited so
    /// that a round can end on time.
    fn batch_rows(&self) -> usize {
        let preferred = self.setup.env.source.batch_rows();
        match self.rate() {
            Some(rate) => preferred.min(((rate / 10.0) as usize).max(1)),
            None => preferred,
        }
    }

    fn rate(&self) -> Option<f64> {
        self.setup.env.source.rate().map(|r| r / f64::from(self.setup.ctx.parallelism.max(1)))
    }

    /// Round `c`: reads and writes rows up to the checkpoint trigger (or a
    /// barrier), then prepares and snapshots the writer at that cut.
    pub(crate) fn round(&mut self, c: u64) -> Result<RoundReport, EngineError> {
        let filled = self.fill(c)?;
        // The cut: rows up to here belong to checkpoint `c`.
        self.position = match filled.cut.clone() {
            Some(cut) => cut,
            None => self.reader.position(),
        };
        self.end_round(c, filled)
    }

    /// Writes rows until the round's trigger, the end of the source, or a
    /// batch that needs the target changed first (held for a later round).
    fn fill(&mut self, c: u64) -> Result<Filled, EngineError> {
        let deadline = self.setup.env.interval.and_then(|d| Instant::now().checked_add(d));
        let mut filled = Filled::default();
        // Whether this round has read (a batch, or an idle source): only
        // then may its interval end it.
        let mut read = false;
        while !self.finished {
            if self.held.is_empty() && self.trigger_reached(filled.rows, deadline.filter(|_| read)) {
                break;
            }
            // The round's first read waits for the rate limit, past the
            // deadline if need be: a round that read nothing would end
            // empty, and the next one too.
            if !read && self.held.is_empty() && !self.throttle(None) {
                continue;
            }
            read = true;
            let (next, before) = match self.next_input(filled.rows)? {
                Input::Batch(next, before) => (next, before),
                // A streaming source has nothing now: the trigger decides.
                Input::Idle => continue,
                Input::End => {
                    self.finished = true;
                    break;
                }
            };
            let Some(parts) = self.fit(c, next.clone(), before.clone(), &mut filled)? else { break };
            for part in parts {
                self.seen.insert(part.table.clone(), part.sent.clone());
                let n = part.batch.num_rows() as u64;
                let first = self.input_rows.get(&part.table).copied().unwrap_or(0);
                let origin = if part.letters { None } else { next.origin.clone() };
                self.spans.entry(part.table.clone()).or_default().push(Span {
                    first,
                    rows: n,
                    origin,
                    before: before.clone(),
                });
                self.input_rows.insert(part.table.clone(), first + n);
                let bytes = self.writer.write_batch(&part.table, &part.batch).map_err(|e| self.name_rejected(e))?;
                let tally = filled.tables.entry(part.table.clone()).or_default();
                tally.rows += n;
                tally.bytes += bytes;
                if part.letters {
                    continue;
                }
                filled.rows += n;
                self.rows_total += n;
                self.rows_this_run += n;
                self.setup.env.progress.add_rows(n);
            }
            if !next.bad.is_empty() {
                let bad = next.bad.len() as u64;
                filled.tables.entry(next.table.clone()).or_default().bad += bad;
                self.bad_total += bad;
                let room = BAD_SAMPLE.saturating_sub(filled.bad_sample.len());
                filled.bad_sample.extend(next.bad.iter().take(room).map(|b| (next.table.clone(), b.clone())));
            }
            if !filled.wrote {
                filled.wrote = true;
                self.setup.env.faults.check(CrashPoint::AfterWrite, c, Some(self.setup.subtask))?;
            }
            self.throttle(deadline);
        }
        Ok(filled)
    }

    /// The round's trigger: `every_rows` written, or its interval passed,
    /// or the run was asked to stop.
    fn trigger_reached(&self, rows_in_round: u64, deadline: Option<Instant>) -> bool {
        self.setup.env.every_rows.is_some_and(|k| rows_in_round >= k)
            || deadline.is_some_and(|d| Instant::now() >= d)
            || self.setup.env.stop.requested()
    }

    /// The next batch, held first, else read, with the position before it.
    fn next_input(&mut self, rows_in_round: u64) -> Result<Input, EngineError> {
        if let Some((held, before)) = self.held.pop_front() {
            return Ok(Input::Batch(held, before));
        }
        let mut want = self.batch_rows() as u64;
        if let Some(k) = self.setup.env.every_rows {
            want = want.min(k - rows_in_round);
        }
        let before = self.reader.position();
        Ok(match self.reader.read(want as usize)? {
            Read::Batch(next) => Input::Batch(next, before),
            Read::Idle => Input::Idle,
            Read::End => Input::End,
        })
    }

    /// What `next` writes: its dead letters (first) and its rows, as their
    /// tables take them now. Bad rows that are not to be dead letters are
    /// an error (a source gives them only when asked to).
    fn parts(&self, c: u64, next: &TableBatch) -> Result<Vec<Part>, EngineError> {
        let mut parts = Vec::with_capacity(2);
        // A table that appears during the run (a topic a pattern matches)
        // may not be the dead letters'.
        if self.setup.env.dead_letters.as_ref() == Some(&next.table) {
            return Err(EngineError::Source(crate::source::SourceError::Config {
                key: "job.dead_letter.table".into(),
                message: format!(
                    "the source delivers rows of table {:?}, the dead-letter table: give dead letters a table of \
                     their own",
                    next.table
                ),
            }));
        }
        if let Some(first) = next.bad.first() {
            let Some(table) = &self.setup.env.dead_letters else {
                return Err(EngineError::Source(crate::source::SourceError::BadRow {
                    position: first.position.clone(),
                    reason: first.reason.clone(),
                }));
            };
            let from = dead_letter::Letterhead {
                job: self.setup.ctx.job_id.clone(),
                incarnation: self.setup.ctx.incarnation.clone(),
            };
            let batch = dead_letter::batch(&next.bad, &next.table, &from, c)?;
            parts.push(Part { table: table.clone(), sent: batch.schema(), batch, letters: true });
        }
        if next.batch.num_rows() > 0 || next.bad.is_empty() {
            parts.push(Part {
                table: next.table.clone(),
                batch: next.batch.clone(),
                // A change batch's reserved columns are no table's (`tables::fit`).
                sent: crate::source::changes::without_change_columns(&next.batch.schema()),
                letters: false,
            });
        }
        Ok(parts)
    }

    /// `next`'s parts as their tables take them now; `None` when one must
    /// wait for a barrier or is refused, in which case `next` is held whole
    /// (its dead letters and its rows stay in one checkpoint) and the round
    /// ends just before it.
    fn fit(
        &mut self,
        c: u64,
        next: TableBatch,
        before: serde_json::Value,
        filled: &mut Filled,
    ) -> Result<Option<Vec<Part>>, EngineError> {
        let mut fitted = Vec::new();
        let mut changes = Vec::new();
        for part in self.parts(c, &next)? {
            let schema = part.batch.schema();
            match tables::fit(&part.table, self.setup.tables.get(&part.table), self.seen.get(&part.table), &schema) {
                Ok(Fit::AsIs) => fitted.push(part),
                Ok(Fit::Conform(target)) => {
                    fitted.push(Part { batch: tables::conform(&part.batch, &target)?, ..part });
                }
                Ok(Fit::Barrier(change)) => {
                    tracing::info!(
                        subtask = self.setup.subtask,
                        table = %part.table,
                        change = ?change.kind,
                        "the source changed a table: checkpoint {c} ends here, and the sink evolves the target before the rows of the new shape"
                    );
                    changes.push(change);
                }
                Err(refused) => {
                    filled.refusal = Some(refused);
                    self.held.push_front((next, before.clone()));
                    filled.cut = Some(before);
                    return Ok(None);
                }
            }
        }
        if changes.is_empty() {
            return Ok(Some(fitted));
        }
        filled.changes.extend(changes);
        self.held.push_front((next, before.clone()));
        filled.cut = Some(before);
        self.read_ahead(&mut filled.changes)?;
        Ok(None)
    }

    /// `prepare-commit(c)` and `snapshot-state(c)` at the cut, and the report.
    fn end_round(&mut self, c: u64, filled: Filled) -> Result<RoundReport, EngineError> {
        let subtask = self.setup.subtask;
        let preparing = Instant::now();
        let info = self.writer.prepare_commit(c).map_err(|e| self.name_rejected(e))?;
        // Every row written so far is in the target: none can be rejected later.
        self.spans.clear();
        self.setup.env.faults.check(CrashPoint::AfterPrepareCommit, c, Some(subtask))?;
        let state = self.writer.snapshot_state(c)?;
        tracing::debug!(
            subtask,
            checkpoint = c,
            rows = filled.rows,
            prepare_ms = preparing.elapsed().as_millis() as u64,
            "round ended"
        );
        self.setup.env.faults.check(CrashPoint::AfterSnapshotState, c, Some(subtask))?;
        Ok(RoundReport {
            c,
            info,
            rows: filled.rows,
            tables: filled.tables,
            bad_sample: filled.bad_sample,
            memory: self.writer.memory_peak(),
            prepare: preparing.elapsed(),
            record: SubtaskRecord {
                position: self.position.clone(),
                writer_state: Blob(state),
                rows: self.rows_total,
                finished: self.finished && self.held.is_empty(),
                seen: self.seen_record()?,
                bad_rows: self.bad_total,
            },
            changes: filled.changes,
            refusal: filled.refusal,
        })
    }

    /// At a barrier: reads up to a batch's worth of rows more and holds
    /// them, adding the changes they need (judged as if `changes` were
    /// applied), so that tables changing together cost one barrier. Stops at
    /// a refused shape, which the next round meets again.
    fn read_ahead(&mut self, changes: &mut Vec<Change>) -> Result<(), EngineError> {
        let mut tables = self.setup.tables.clone();
        tables.apply(changes);
        let mut seen = self.seen.clone();
        for (b, _) in &self.held {
            seen.insert(b.table.clone(), b.batch.schema());
        }
        let budget = self.batch_rows();
        let mut rows: usize = self.held.iter().map(|(b, _)| b.batch.num_rows()).sum();
        while rows < budget {
            let before = self.reader.position();
            let Read::Batch(next) = self.reader.read(budget - rows)? else { break };
            let mut shapes = vec![(next.table.clone(), next.batch.schema())];
            if let (false, Some(table)) = (next.bad.is_empty(), &self.setup.env.dead_letters) {
                shapes.insert(0, (table.clone(), dead_letter::schema()));
            }
            rows += next.batch.num_rows() + next.bad.len();
            self.held.push_back((next, before));
            for (table, schema) in shapes {
                match tables::fit(&table, tables.get(&table), seen.get(&table), &schema) {
                    Ok(Fit::Barrier(change)) => {
                        tables.apply(std::slice::from_ref(&change));
                        changes.push(change);
                    }
                    Ok(_) => {}
                    Err(_) => return Ok(()),
                }
                seen.insert(table, schema);
            }
        }
        Ok(())
    }

    /// A sink's `invalid-data` answer with each row it names followed by
    /// where that row is in the source. With dead letters, when every row
    /// it names is a record of a file, [`EngineError::SinkRejected`]: the
    /// run goes on from its last checkpoint with them as dead letters.
    fn name_rejected(&self, e: crate::plugin::PluginError) -> EngineError {
        use crate::plugin::{PluginError, SinkErrorKind};
        match e {
            PluginError::Sink { plugin, instance, call, kind: SinkErrorKind::InvalidData, message } => {
                let rows = self.rejected_records(&message);
                let message = rejected::name_rows(&message, |table, row| self.locate(table, row));
                let e = PluginError::Sink { plugin, instance, call, kind: SinkErrorKind::InvalidData, message };
                match rows {
                    Some(rows) => {
                        EngineError::SinkRejected(Box::new(super::SinkRejected { message: e.to_string(), rows }))
                    }
                    None => e.into(),
                }
            }
            other => other.into(),
        }
    }

    /// The file records of every row `message` names, when dead letters
    /// are on and each is one (not a dead letter itself, nor a generator's).
    fn rejected_records(&self, message: &str) -> Option<BTreeMap<(String, u64), String>> {
        self.setup.env.dead_letters.as_ref()?;
        let named = rejected::named_rows(message);
        if named.is_empty() {
            return None;
        }
        let mut out = BTreeMap::new();
        for n in named {
            let span = self.spans.get(&n.table)?.iter().find(|s| s.first <= n.row && n.row < s.first + s.rows)?;
            let origin = span.origin.as_ref()?;
            out.insert((origin.file.clone(), origin.record(n.row - span.first)), n.reason);
        }
        Some(out)
    }

    /// Where row `row` of the writer's input for `table` is in the source.
    fn locate(&self, table: &str, row: u64) -> Option<String> {
        let span = self.spans.get(table)?.iter().find(|s| s.first <= row && row < s.first + s.rows)?;
        let k = row - span.first;
        Some(match &span.origin {
            Some(origin) => origin.describe(k),
            None => format!("row {k} of the batch read after source position {}", span.before),
        })
    }

    /// Sleeps as long as the rate limit demands, never past `deadline`,
    /// in slices of at most [`STOP_POLL`]; `false` when a stop request
    /// ended the sleep.
    fn throttle(&self, deadline: Option<Instant>) -> bool {
        let Some(rate) = self.rate() else { return true };
        // When the rows written so far are due at the rate. Past what an
        // `Instant` holds they are never due: only the deadline or a stop
        // ends the wait.
        let due = Duration::try_from_secs_f64(self.rows_this_run as f64 / rate)
            .ok()
            .and_then(|d| self.run_start.checked_add(d));
        let until = match (due, deadline) {
            (Some(due), Some(deadline)) => Some(due.min(deadline)),
            (due, None) => due,
            (None, deadline) => deadline,
        };
        loop {
            if self.setup.env.stop.requested() {
                return false;
            }
            let now = Instant::now();
            let nap = match until {
                Some(until) if until <= now => return true,
                Some(until) => (until - now).min(STOP_POLL),
                None => STOP_POLL,
            };
            std::thread::sleep(nap);
        }
    }
}
