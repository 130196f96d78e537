//! What a writer is made of: [`WriterEnv`], shared by every writer of a
//! run, and [`WriterSetup`], one writer's own. The coordinator makes them, a
//! pool carries them (across processes, for a setup), a subtask runs with
//! them.
//!
//! Invariant: this module imports none of the modules that drive writers
//! (coordinator, pool, subtask), so they all import it and the engine's
//! imports point one way.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::checkpoint::{SubtaskRecord, TableRecord};
use crate::capability::Granted;
use crate::config::EngineConfig;
use crate::fault::Faults;
use crate::plugin::{Limits, Plugin, SinkCtx};
use crate::progress::Progress;
use crate::source::Source;

/// What every writer of a run shares; the coordinator holds it. A local
/// pool hands it to its threads; a remote writer rebuilds it from the job.
pub struct WriterEnv {
    pub plugin: Plugin,
    pub grants: Granted,
    pub limits: Limits,
    /// The options every instance opens with (the job's and the host's own).
    pub options: Vec<(String, String)>,
    pub source: Arc<Source>,
    pub every_rows: Option<u64>,
    pub interval: Option<Duration>,
    /// A test's faults (none in a released build).
    pub faults: Faults,
    pub progress: Arc<Progress>,
    /// The run was asked to stop: rounds end at once, with a checkpoint.
    pub stop: super::Stop,
    /// The dead-letter table, when bad rows are dead letters.
    pub dead_letters: Option<String>,
}

impl WriterEnv {
    /// The environment of `job`'s writers: its sandbox limits and its
    /// checkpoint trigger, with what the caller opened.
    pub fn for_job(
        job: &EngineConfig,
        plugin: Plugin,
        grants: Granted,
        options: Vec<(String, String)>,
        source: Arc<Source>,
        faults: Faults,
        progress: Arc<Progress>,
    ) -> Self {
        let (every_rows, interval) = job.checkpoint_trigger();
        Self {
            plugin,
            grants,
            limits: Limits::of(&job.spec.sink.sandbox),
            options,
            source,
            every_rows,
            interval,
            faults,
            progress,
            stop: super::Stop::default(),
            dead_letters: job.dead_letters.as_ref().map(|d| d.table.clone()),
        }
    }
}

/// What makes one writer: who it is, the tables it knows and what it
/// resumes from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WriterSetup {
    pub subtask: u32,
    pub ctx: SinkCtx,
    pub tables: Vec<TableRecord>,
    pub restored: Option<SubtaskRecord>,
}
