//! `sluice check`: validates a job without moving data.
//!
//! Invariant: a check refuses what a run would refuse, by the same steps
//! (`engine::setup`), and writes nothing: not to the target, not to the
//! state directory.

use super::EngineError;
use super::checkpoint::{CheckpointRecord, Incarnation};
use super::setup::{check_options, check_tables, sink_ctx};
use super::tables::TableSet;
use crate::capability::Granted;
use crate::config::EngineConfig;
use crate::fault::Faults;
use crate::plugin::{Limits, Plugin, PluginHost};
use crate::source::Source;

/// Result of `sluice check`.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// What was checked and found fine.
    pub passed: Vec<String>,
    /// One line per problem, each naming its cause.
    pub problems: Vec<String>,
}

/// Validates a job without moving data: plugin, options, grants, source, the
/// state directory, and the plugin's own `validate` against the source
/// schema (which, for a new state directory, also looks for checkpoints of
/// another incarnation in the target).
pub fn check(job: &EngineConfig, host: &PluginHost) -> CheckReport {
    let mut report = CheckReport::default();
    let plugin = match host.load(&job.spec.sink.plugin) {
        Ok(p) => p,
        Err(e) => {
            report.problems.push(e.to_string());
            return report;
        }
    };
    report.options(job, &plugin);
    if let Err(e) = super::setup::check_cloud_access(job) {
        // What the state and the rest would say next is this again.
        report.problems.push(e.to_string());
        return report;
    }
    let (identity, latest) = report.state(job);
    let grants = report.grants(job);
    let source = report.source(job, latest.as_ref());
    if let (Some(grants), Some(source)) = (grants, source)
        && report.problems.is_empty()
    {
        report.validate(job, &plugin, &grants, &source, identity);
    }
    report
}

impl CheckReport {
    /// The job's sink options against those the plugin declares.
    fn options(&mut self, job: &EngineConfig, plugin: &Plugin) {
        let Some(info) = plugin.info() else { return };
        self.passed.push(format!("plugin {} {} ({})", info.name, info.version, plugin.path.display()));
        let option_errors = check_options(job, info);
        if option_errors.is_empty() {
            self.passed.push(format!("{} sink option(s) known to the plugin", job.sink_options().len()));
        }
        self.problems.extend(option_errors.iter().map(ToString::to_string));
    }

    /// The state directory, read without locking or changing it: its
    /// incarnation (if any) and its newest record.
    fn state(&mut self, job: &EngineConfig) -> (Option<Incarnation>, Option<CheckpointRecord>) {
        match super::state::inspect(job) {
            Ok(state) => {
                self.passed.push(format!("state: {}", state.one_line()));
                if let Some(halt) = &state.halted {
                    self.problems.push(format!("the state directory is halted: {}", halt.reason));
                }
                (state.incarnation, state.latest)
            }
            Err(e) => {
                self.problems.push(e.to_string());
                (None, None)
            }
        }
    }

    fn grants(&mut self, job: &EngineConfig) -> Option<Granted> {
        match Granted::open(&job.grants(), &Faults::default()) {
            Ok(g) => {
                self.passed.push(format!("grants: {}", g.describe()));
                Some(g)
            }
            Err(e) => {
                self.problems.push(e.to_string());
                None
            }
        }
    }

    /// The source, and whether it is the one the newest record describes.
    fn source(&mut self, job: &EngineConfig, latest: Option<&CheckpointRecord>) -> Option<Source> {
        match Source::of_config(&job.source_config()) {
            Ok(s) => {
                self.passed.push(format!("source: {}", s.describe()));
                if let Some(r) = latest
                    && let Err(change) = s.check_identity(r.source.as_ref())
                {
                    self.problems
                        .push(EngineError::SourceChanged { checkpoint: r.checkpoint, what: change.0 }.to_string());
                }
                Some(s)
            }
            Err(e) => {
                self.problems.push(e.to_string());
                None
            }
        }
    }

    /// The plugin's own `validate` against the source's tables, as the
    /// run's committer would open.
    fn validate(
        &mut self,
        job: &EngineConfig,
        plugin: &Plugin,
        grants: &Granted,
        source: &Source,
        known: Option<Incarnation>,
    ) {
        // A new state directory: the first run would refuse another incarnation's checkpoints.
        let (incarnation, refuse) = match known {
            Some(known) => (known, false),
            None => match Incarnation::generate() {
                Ok(i) => (i, true),
                Err(e) => {
                    self.problems.push(e.to_string());
                    return;
                }
            },
        };
        let ctx = sink_ctx(job, &incarnation, refuse, 0, 0);
        let options = super::setup::plugin_options(plugin, job, &ctx);
        let result = source
            .tables()
            .map_err(EngineError::from)
            .map(TableSet::new)
            .and_then(|known| check_tables(plugin, source, &known).map(|()| known))
            .and_then(|known| Ok(known.source_tables()?))
            .and_then(|tables| {
                let mut inst = plugin.instantiate("check", grants, Limits::of(&job.spec.sink.sandbox))?;
                inst.validate(&ctx, &options, &tables).map_err(EngineError::from)
            });
        match result {
            Ok(()) => self.passed.push("the plugin accepts the options and the source schema".to_string()),
            Err(e) => self.problems.push(e.to_string()),
        }
    }
}
