//! Where the writers of a run live: threads of this process (`sluice run`),
//! or other processes and machines (Ray actors, driven through the Python
//! package). The coordinator speaks to them only through [`WriterPool`].
//!
//! Invariants:
//! - a pool moves commands and reports, nothing else: every protocol
//!   decision (what is persisted, committed, aborted) stays in the
//!   coordinator, so a run on many machines keeps the guarantees of a run
//!   in one process;
//! - a remote writer is a [`Worker`] built from the same job file and the
//!   [`WriterSetup`] the coordinator made, so it reads the same split of the
//!   source and opens the same writer a local subtask would;
//! - what crosses a process boundary ([`WriterSetup`], a round's report, a
//!   barrier's changes) is a versioned JSON document whose binary parts are
//!   base64, like the checkpoint record.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::EngineError;
use super::checkpoint::{Blob, SubtaskRecord};
use super::subtask::{Command, Reply, RoundReport, Subtask, SubtaskHandle, SubtaskSetup};
use super::tables::{Change, SchemaRefusal, TableSet};
pub use super::writer::{WriterEnv, WriterSetup};
use crate::capability::Granted;
use crate::config::EngineConfig;
use crate::fault::Faults;
use crate::ipc;
use crate::metrics::Tally;
use crate::plugin::{ChangeKind, PluginHost};
use crate::progress::{Progress, ProgressMode};
use crate::source::Source;

/// The writers of a run.
pub trait WriterPool {
    /// Opens one writer per setup and waits until every one is open.
    fn open(&mut self, env: Arc<WriterEnv>, setups: Vec<WriterSetup>) -> Result<(), EngineError>;
    /// Starts round `c` on every writer.
    fn start_round(&mut self, c: u64) -> Result<(), EngineError>;
    /// Waits for every writer's report of round `c`, in subtask order.
    fn gather(&mut self, c: u64) -> Vec<Result<RoundReport, EngineError>>;
    /// Best effort: the named writers release what `prepare-commit(c)` prepared.
    fn abort_prepare(&mut self, c: u64, subtasks: &[u32]);
    /// Every writer applies the changes the target took.
    fn apply(&mut self, changes: &[Change]) -> Result<(), EngineError>;
    /// Closes every writer; the largest linear memory a writer instance had.
    fn close(&mut self) -> Result<u64, EngineError>;
    /// After [`WriterPool::close`]: the most host memory held for one
    /// writer instance at once, where the pool can tell.
    fn host_memory_peak(&self) -> Option<u64> {
        None
    }
    /// How many writers are open.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Writers on threads of this process.
#[derive(Default)]
pub struct LocalPool {
    subtasks: Vec<SubtaskHandle>,
    host_peak: Option<u64>,
}

impl WriterPool for LocalPool {
    fn open(&mut self, env: Arc<WriterEnv>, setups: Vec<WriterSetup>) -> Result<(), EngineError> {
        for setup in setups {
            self.subtasks.push(SubtaskHandle::spawn(SubtaskSetup {
                env: env.clone(),
                subtask: setup.subtask,
                ctx: setup.ctx,
                tables: TableSet::from_records(&setup.tables)?,
                restored: setup.restored,
            })?);
        }
        let mut open_error = None;
        for handle in &self.subtasks {
            if let Err(e) = handle.recv() {
                open_error.get_or_insert(e);
            }
        }
        match open_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn start_round(&mut self, c: u64) -> Result<(), EngineError> {
        for handle in &self.subtasks {
            handle.send(Command::Round(c))?;
        }
        Ok(())
    }

    fn gather(&mut self, c: u64) -> Vec<Result<RoundReport, EngineError>> {
        self.subtasks
            .iter()
            .map(|handle| match handle.recv() {
                Ok(Reply::Round(report)) if report.c == c => Ok(*report),
                Ok(_) => Err(EngineError::SubtaskLost(handle.subtask)),
                Err(e) => Err(e),
            })
            .collect()
    }

    fn abort_prepare(&mut self, c: u64, subtasks: &[u32]) {
        for handle in self.subtasks.iter().filter(|h| subtasks.contains(&h.subtask)) {
            if handle.send(Command::AbortPrepare(c)).is_ok() {
                let _ = handle.recv();
            }
        }
    }

    fn apply(&mut self, changes: &[Change]) -> Result<(), EngineError> {
        for handle in &self.subtasks {
            handle.send(Command::Apply(changes.to_vec()))?;
        }
        for handle in &self.subtasks {
            handle.recv()?;
        }
        Ok(())
    }

    fn close(&mut self) -> Result<u64, EngineError> {
        for handle in &self.subtasks {
            handle.send(Command::Close)?;
        }
        let mut peak = 0;
        for handle in &self.subtasks {
            if let Reply::Closed(p, host) = handle.recv()? {
                peak = peak.max(p);
                self.host_peak = Some(self.host_peak.unwrap_or(0).max(host));
            }
        }
        Ok(peak)
    }

    fn host_memory_peak(&self) -> Option<u64> {
        self.host_peak
    }

    fn len(&self) -> usize {
        self.subtasks.len()
    }
}

/// The version of the documents below; a peer of another version is refused.
const WIRE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Envelope<T> {
    sluice_wire: u32,
    #[serde(flatten)]
    body: T,
}

/// A change as it crosses a process boundary.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ChangeWire {
    kind: ChangeKind,
    table: String,
    /// The schema after the change, as an Arrow IPC stream without batches.
    schema: Blob,
}

#[derive(Serialize, Deserialize)]
struct ReportWire {
    c: u64,
    info: Option<Blob>,
    record: SubtaskRecord,
    rows: u64,
    /// Rows and bytes per table (absent from an older peer: none).
    #[serde(default)]
    tables: BTreeMap<String, Tally>,
    #[serde(default)]
    memory: u64,
    #[serde(default)]
    prepare_secs: f64,
    changes: Vec<ChangeWire>,
    refusal: Option<SchemaRefusal>,
    #[serde(default)]
    bad_sample: Vec<(String, crate::source::BadRow)>,
}

#[derive(Serialize, Deserialize)]
struct ChangesWire {
    changes: Vec<ChangeWire>,
}

fn encode<T: Serialize>(what: &str, body: T) -> Result<Vec<u8>, EngineError> {
    serde_json::to_vec(&Envelope { sluice_wire: WIRE_VERSION, body })
        .map_err(|e| EngineError::Wire { what: what.to_string(), message: e.to_string() })
}

fn decode<T: for<'de> Deserialize<'de>>(what: &str, bytes: &[u8]) -> Result<T, EngineError> {
    let wire = |message: String| EngineError::Wire { what: what.to_string(), message };
    let envelope: Envelope<T> = serde_json::from_slice(bytes).map_err(|e| wire(e.to_string()))?;
    if envelope.sluice_wire != WIRE_VERSION {
        return Err(EngineError::WireVersion {
            what: what.to_string(),
            peer: envelope.sluice_wire,
            ours: WIRE_VERSION,
        });
    }
    Ok(envelope.body)
}

fn changes_to_wire(changes: &[Change]) -> Result<Vec<ChangeWire>, EngineError> {
    changes
        .iter()
        .map(|c| Ok(ChangeWire { kind: c.kind, table: c.table.clone(), schema: Blob(ipc::encode_schema(&c.schema)?) }))
        .collect()
}

fn changes_from_wire(changes: Vec<ChangeWire>) -> Result<Vec<Change>, EngineError> {
    changes
        .into_iter()
        .map(|c| Ok(Change { kind: c.kind, table: c.table, schema: ipc::decode_schema(&c.schema.0)? }))
        .collect()
}

impl WriterSetup {
    pub fn encode(&self) -> Result<Vec<u8>, EngineError> {
        encode("a writer setup", self)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, EngineError> {
        decode("a writer setup", bytes)
    }
}

impl RoundReport {
    /// The report as it crosses a process boundary.
    pub fn encode(&self) -> Result<Vec<u8>, EngineError> {
        encode(
            "a round report",
            ReportWire {
                c: self.c,
                info: self.info.clone().map(Blob),
                record: self.record.clone(),
                rows: self.rows,
                tables: self.tables.clone(),
                memory: self.memory,
                prepare_secs: self.prepare.as_secs_f64(),
                changes: changes_to_wire(&self.changes)?,
                refusal: self.refusal.clone(),
                bad_sample: self.bad_sample.clone(),
            },
        )
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, EngineError> {
        let w: ReportWire = decode("a round report", bytes)?;
        Ok(RoundReport {
            c: w.c,
            info: w.info.map(|b| b.0),
            record: w.record,
            rows: w.rows,
            tables: w.tables,
            memory: w.memory,
            prepare: Duration::try_from_secs_f64(w.prepare_secs).unwrap_or_default(),
            changes: changes_from_wire(w.changes)?,
            refusal: w.refusal,
            bad_sample: w.bad_sample,
        })
    }
}

/// A barrier's changes as they cross a process boundary.
pub fn encode_changes(changes: &[Change]) -> Result<Vec<u8>, EngineError> {
    encode("a barrier's changes", ChangesWire { changes: changes_to_wire(changes)? })
}

pub fn decode_changes(bytes: &[u8]) -> Result<Vec<Change>, EngineError> {
    let w: ChangesWire = decode("a barrier's changes", bytes)?;
    changes_from_wire(w.changes)
}

/// One writer in a process of its own (a Ray actor): the same subtask a
/// local pool runs on a thread, called directly.
pub struct Worker {
    subtask: Subtask,
}

impl Worker {
    /// Opens the writer `setup` describes, for `job` (parsed from the same
    /// job file the coordinator runs), loading the plugin through `host`.
    pub fn open(job: &EngineConfig, host: &PluginHost, setup: WriterSetup) -> Result<Self, EngineError> {
        let plugin = host.load(&job.spec.sink.plugin)?;
        let grants = Granted::open(&job.grants(), &Faults::default())?;
        let options = super::setup::plugin_options(&plugin, job, &setup.ctx);
        let source = Arc::new(Source::of_config(&job.source_config())?);
        let progress = Progress::new(ProgressMode::Quiet);
        let env = WriterEnv::for_job(job, plugin, grants, options, source, Faults::default(), progress);
        let subtask = Subtask::open(SubtaskSetup {
            env: Arc::new(env),
            subtask: setup.subtask,
            ctx: setup.ctx,
            tables: TableSet::from_records(&setup.tables)?,
            restored: setup.restored,
        })?;
        Ok(Self { subtask })
    }

    pub fn subtask(&self) -> u32 {
        self.subtask.id()
    }

    /// Round `c`: reads this writer's split up to the checkpoint trigger,
    /// writes, prepares and snapshots.
    pub fn round(&mut self, c: u64) -> Result<RoundReport, EngineError> {
        self.subtask.round(c)
    }

    pub fn apply(&mut self, changes: &[Change]) -> Result<(), EngineError> {
        self.subtask.apply(changes)
    }

    /// Releases what `prepare-commit(c)` prepared.
    pub fn abort_prepare(&mut self, c: u64) -> Result<(), EngineError> {
        Ok(self.subtask.abort_prepare(c)?)
    }

    /// Closes the writer; the largest linear memory its instance had (a
    /// Ray worker reports that one only).
    pub fn close(&mut self) -> Result<u64, EngineError> {
        self.subtask.close().map(|(linear, _host)| linear)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinds::{ErrorKind, Kind};

    #[test]
    fn a_peer_of_another_wire_version_is_a_config_error_and_garbage_is_fatal() {
        let e = decode_changes(br#"{"sluice_wire":2,"changes":[]}"#).err().unwrap_or_else(|| panic!("decoded"));
        assert!(matches!(e, EngineError::WireVersion { peer: 2, ours: WIRE_VERSION, .. }), "{e}");
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains("a barrier's changes") && e.to_string().contains("wire version 2"), "{e}");
        let e = decode_changes(b"not json").err().unwrap_or_else(|| panic!("decoded"));
        assert_eq!(e.kind(), ErrorKind::Fatal, "{e}");
        let same = encode_changes(&[]).and_then(|b| decode_changes(&b)).map(|c| c.len());
        assert_eq!(same.ok(), Some(0));
    }
}
