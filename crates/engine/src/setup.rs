//! The steps a run and a landing take before their first checkpoint, and
//! `sluice check` takes without moving data: the job's options against the
//! plugin's, the tables against the plugin, the state directory opened
//! unhalted, the newest record against the job, and the incarnation.
//!
//! Invariants:
//! - nothing here writes to the target;
//! - a new incarnation is only generated here, and persisted by the caller
//!   once its committer accepted it.

use super::EngineError;
use super::RunOptions;
use super::checkpoint::{CheckpointRecord, CheckpointStore, Incarnation};
use super::tables::TableSet;
use crate::bindings::PluginInfo;
use crate::capability::Granted;
use crate::config::{CatalogConfig, EngineConfig, JobError, SourceSpec};
use crate::fault::Faults;
use crate::location::{Location, Scheme, Served};
use crate::plugin::{ContractVersion, Limits, Plugin, PluginError, PluginHost, SinkCtx, reserved};
use crate::source::Source;
use sluice_store::S3Options;

/// What a run of `job` grants its plugin instances, and their limits: for
/// tools that drive a plugin directly (the conformance suite).
pub fn grants_and_limits(job: &EngineConfig) -> Result<(Granted, Limits), EngineError> {
    Ok((Granted::open(&job.grants(), &Faults::default())?, Limits::of(&job.spec.sink.sandbox)))
}

/// Loads the job's plugin and refuses options it does not take (the first
/// such error): before the state directory is touched, so a job that
/// cannot start leaves it as it was.
pub(super) fn load_plugin(job: &EngineConfig, host: &PluginHost) -> Result<Plugin, EngineError> {
    let plugin = host.load(&job.spec.sink.plugin)?;
    if let Some(info) = plugin.info()
        && let Some(e) = check_options(job, info).into_iter().next()
    {
        return Err(e.into());
    }
    Ok(plugin)
}

/// Host-side check of the options against what the plugin declares.
pub(super) fn check_options(job: &EngineConfig, info: &PluginInfo) -> Vec<JobError> {
    let mut errors = Vec::new();
    let options = job.sink_options();
    let known: Vec<&str> =
        info.options.iter().map(|o| o.name.as_str()).filter(|name| !reserved::is_reserved(name)).collect();
    for (key, _) in &options {
        if reserved::is_reserved(key) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{key}"),
                message: format!("options starting with `{}` are the host's own; remove it", reserved::PREFIX),
            });
        } else if !known.contains(&key.as_str()) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{key}"),
                message: format!("plugin '{}' has no such option (it takes: {})", info.name, known.join(", ")),
            });
        }
    }
    if job.spec.source.change_key().is_some() && !info.options.iter().any(|o| o.name == reserved::KEY) {
        errors.push(JobError::Invalid {
            path: job.path.clone(),
            key: "source.key".to_string(),
            message: format!(
                "sink plugin '{}' does not take change streams ([source] key / change_column): it does not declare \
                 `{}`, so it would append every change as a row; land changes with a plugin that takes them, or \
                 remove source.key and source.change_column",
                info.name,
                reserved::KEY
            ),
        });
    }
    for spec in info.options.iter().filter(|o| o.required && o.default_value.is_none()) {
        if !reserved::is_reserved(&spec.name) && !options.iter().any(|(k, _)| k == &spec.name) {
            errors.push(JobError::Invalid {
                path: job.path.clone(),
                key: format!("sink.options.{}", spec.name),
                message: format!("required by plugin '{}': {}", info.name, spec.description),
            });
        }
    }
    errors
}

/// The options every instance of the job's plugin opens with: the job's,
/// the host's own the plugin declares ([`Plugin::options_for`]), and a
/// change stream's key ([`reserved::KEY`]).
pub(super) fn plugin_options(plugin: &Plugin, job: &EngineConfig, ctx: &SinkCtx) -> Vec<(String, String)> {
    let mut options = plugin.options_for(job.sink_options(), ctx);
    if let Some(key) = job.spec.source.change_key()
        && plugin.declares(reserved::KEY)
    {
        options.push((reserved::KEY.to_string(), serde_json::Value::from(key.to_vec()).to_string()));
    }
    options
}

/// Who an instance is: writer `subtask`, or the committer (0), of
/// `incarnation`; `refuse_others` on a fresh state directory's first run.
pub(super) fn sink_ctx(
    job: &EngineConfig,
    incarnation: &Incarnation,
    refuse_others: bool,
    subtask: u32,
    attempt: u32,
) -> SinkCtx {
    SinkCtx {
        job_id: job.spec.job.id.clone(),
        sink_id: job.spec.sink.id.clone(),
        incarnation: incarnation.id.clone(),
        refuse_other_incarnations: refuse_others,
        beside: incarnation.beside,
        subtask,
        parallelism: job.spec.job.parallelism,
        attempt,
        dead_letter_table: job.dead_letters.as_ref().map(|d| d.table.clone()),
        incarnation_created_ms: incarnation.created_at_ms,
    }
}

/// Refuses a plugin that takes one table for a source of named tables.
pub(super) fn check_tables(plugin: &Plugin, source: &Source, tables: &TableSet) -> Result<(), EngineError> {
    if plugin.multi_table() || !(source.is_multi_table() || tables.is_named()) {
        return Ok(());
    }
    if plugin.version() == ContractVersion::V0_1 {
        return Err(PluginError::Unsupported {
            plugin: plugin.name.clone(),
            version: plugin.version(),
            what: "take several tables".to_string(),
        }
        .into());
    }
    Err(EngineError::SingleTablePlugin { plugin: plugin.name.to_string(), described: source.describe() })
}

/// Refuses a newest record that another job shape made: another
/// parallelism, another source, another sink.
pub(super) fn check_restored(job: &EngineConfig, source: &Source, r: &CheckpointRecord) -> Result<(), EngineError> {
    let spec = &job.spec;
    if r.parallelism != spec.job.parallelism {
        return Err(EngineError::ParallelismChanged {
            checkpoint: r.checkpoint,
            recorded: r.parallelism,
            now: spec.job.parallelism,
        });
    }
    if let Err(change) = source.check_identity(r.source.as_ref()) {
        return Err(EngineError::SourceChanged { checkpoint: r.checkpoint, what: change.0 });
    }
    if r.sink_id != spec.sink.id {
        return Err(EngineError::SinkChanged {
            checkpoint: r.checkpoint,
            recorded: r.sink_id.clone(),
            now: spec.sink.id.clone(),
        });
    }
    // Dead letters may be turned on for a job that ran without them, never
    // off or into another table.
    if let Some(was) = &r.dead_letters {
        match &job.dead_letters {
            Some(now) if now.table == *was => {}
            Some(now) => {
                return Err(EngineError::Job(job.invalid(
                    "job.dead_letter.table",
                    format!(
                        "checkpoint {c} of this state directory set its bad records aside in table {was:?}, not \
                         {now:?}: keep {was:?}, so that the dead letters and their counts stay in one table, or \
                         start a new job.state_dir",
                        c = r.checkpoint,
                        now = now.table
                    ),
                )));
            }
            None => {
                return Err(EngineError::Job(job.invalid(
                    "job.bad_rows",
                    format!(
                        "checkpoint {c} of this state directory was taken with job.bad_rows = \"dead-letter\" (table \
                         {was:?}): without it, the records it set aside would be read again and stop the job; keep \
                         job.bad_rows = \"dead-letter\" with [job.dead_letter] table = {was:?}, or start a new \
                         job.state_dir",
                        c = r.checkpoint
                    ),
                )));
            }
        }
    }
    Ok(())
}

/// Opens and holds the job's state directory (locked on disk, leased on an
/// object store for job.lease_secs).
pub(super) fn open_state(job: &EngineConfig) -> Result<CheckpointStore, EngineError> {
    let spec = &job.spec;
    let lease = std::time::Duration::from_secs_f64(spec.job.lease_secs);
    Ok(CheckpointStore::open_at(&job.state, &spec.job.id, spec.job.checkpoint.retain, lease, &job.state_stores)?)
}

/// Opens and holds the job's state directory, refusing one that is halted,
/// and a job whose S3 parts cannot sign a request ([`check_cloud_access`]):
/// before the state directory is touched.
pub(super) fn open_unhalted(job: &EngineConfig) -> Result<CheckpointStore, EngineError> {
    check_cloud_access(job)?;
    refuse_halted(job, open_state(job)?)
}

/// The state directory a run holds: the job's, or a test's in memory
/// ([`RunOptions::memory_state`]), behind the faults the test armed.
pub(super) fn open_run_state(job: &EngineConfig, opts: &RunOptions) -> Result<CheckpointStore, EngineError> {
    #[cfg(feature = "fault-injection")]
    if let Some(dir) = &opts.memory_state {
        let store = CheckpointStore::in_memory(dir, &job.spec.job.id, job.spec.job.checkpoint.retain)?;
        return Ok(refuse_halted(job, store)?.with_faults(&opts.faults));
    }
    Ok(open_unhalted(job)?.with_faults(&opts.faults))
}

/// `store`, unless a run halted it (an operator must look first).
fn refuse_halted(job: &EngineConfig, store: CheckpointStore) -> Result<CheckpointStore, EngineError> {
    let spec = &job.spec;
    match store.halted()? {
        Some(halt) => {
            Err(EngineError::Halted { job: spec.job.id.clone(), state_dir: job.state_dir.clone(), reason: halt.reason })
        }
        None => Ok(store),
    }
}

/// The parts of `job` on S3 that the host signs with the AWS chain (or
/// the part's own keys): the job key that names each, its URL, and how
/// its part reaches S3. A REST catalog's warehouse is left out, and the
/// grants within it: the catalog may vend the credentials for its tables.
fn s3_parts(job: &EngineConfig) -> Vec<(String, String, &S3Options)> {
    let all = Served { stores: &Scheme::ALL };
    let on_s3 = |raw: &str| match Location::parse(raw, &job.base_dir, all) {
        Ok(location @ Location::ObjectStore { scheme: Scheme::S3, .. }) => Some(location),
        _ => None,
    };
    let mut parts = Vec::new();
    if matches!(job.state, Location::ObjectStore { scheme: Scheme::S3, .. }) {
        parts.push(("job.state_dir".to_string(), job.state.to_string(), &job.state_stores.s3));
    }
    if let SourceSpec::File { path, .. } = &job.spec.source
        && let Some(location) = path.to_str().and_then(on_s3)
    {
        parts.push(("source.path".to_string(), location.to_string(), &job.source_stores.s3));
    }
    let vended_root = match &job.catalog {
        Some(CatalogConfig::Sql { warehouse, .. }) => {
            if matches!(warehouse, Location::ObjectStore { scheme: Scheme::S3, .. }) {
                parts.push(("sink.catalog.warehouse".to_string(), warehouse.to_string(), &job.sink_stores.s3));
            }
            None
        }
        Some(CatalogConfig::Rest { warehouse, .. }) => Some(warehouse),
        None => None,
    };
    let grants = &job.spec.sink.grants;
    for (name, list) in [("locations", &grants.locations), ("read_locations", &grants.read_locations)] {
        for (i, raw) in list.iter().enumerate() {
            if let Some(location) = on_s3(raw)
                && !vended_root.is_some_and(|root| location.is_within(root))
            {
                parts.push((format!("sink.grants.{name}[{i}]"), location.to_string(), &job.sink_stores.s3));
            }
        }
    }
    parts
}

/// Refuses a job a part of which is on S3 but has no signing region, or
/// gets no credential from the AWS chain, naming the part's key, every
/// source tried and what to do ([`sluice_store::aws`]). Asks each part's
/// settings once; sends nothing to any bucket.
pub(super) fn check_cloud_access(job: &EngineConfig) -> Result<(), EngineError> {
    let mut checked: Vec<&S3Options> = Vec::new();
    for (key, url, options) in s3_parts(job) {
        let refuse = |message: String| JobError::Invalid { path: job.path.clone(), key: key.clone(), message };
        if checked.iter().any(|o| std::ptr::eq(*o, options)) {
            continue;
        }
        checked.push(options);
        sluice_store::aws::region(options).map_err(|why| refuse(format!("{url}: {why}")))?;
        let owned = options.clone();
        match sluice_core::runtime::wait(async move { sluice_store::aws::check_credentials(&owned).await }) {
            Ok(Ok(())) => {}
            Ok(Err(why)) => return Err(refuse(format!("{url}: {why}")).into()),
            Err(e) => {
                return Err(refuse(format!("{url}: asking the AWS chain: {e}")).into());
            }
        }
    }
    Ok(())
}

/// The incarnation this run belongs to, and whether the run starts it.
///
/// - A state directory with an incarnation resumes it (`--new-incarnation`
///   is refused there: it would start over in a directory holding state).
/// - A state directory of an earlier version (records, no incarnation)
///   adopts one now; its pending commits keep the keys they were made with.
/// - A new state directory gets a new id, persisted only once the committer
///   accepted it.
pub(super) fn settle_incarnation(
    job: &EngineConfig,
    store: &CheckpointStore,
    restored: Option<&CheckpointRecord>,
    opts: &RunOptions,
) -> Result<(Incarnation, bool), EngineError> {
    let existing = store.incarnation()?;
    if opts.new_incarnation && (existing.is_some() || restored.is_some()) {
        return Err(EngineError::IncarnationNotFresh {
            job: job.spec.job.id.clone(),
            state_dir: job.state_dir.clone(),
            incarnation: existing.map_or_else(|| "(from an earlier version)".to_string(), |i| i.id),
            checkpoint: restored.map_or(String::new(), |r| format!(" (last checkpoint {})", r.checkpoint)),
        });
    }
    match existing {
        Some(incarnation) => Ok((incarnation, false)),
        None if restored.is_some() => {
            // From before incarnations, and so before claims: it keeps landing as it did then.
            let incarnation = Incarnation { beside: true, ..Incarnation::generate()? };
            store.set_incarnation(&incarnation)?;
            tracing::info!(incarnation = %incarnation.id, "the state directory predates incarnations; adopted one");
            Ok((incarnation, false))
        }
        // `--new-incarnation` lands beside the job's other incarnations, so it leaves the target's claim alone.
        None => Ok((Incarnation { beside: opts.new_incarnation, ..Incarnation::generate()? }, true)),
    }
}

/// Says when a plugin cannot keep incarnations apart (it does not declare
/// the host's options), so an operator knows what protects the job.
pub(super) fn warn_about_incarnation_support(
    job: &EngineConfig,
    plugin: &Plugin,
    incarnation: &Incarnation,
    refuse_others: bool,
) {
    let (keys, checks) = plugin.incarnation_support();
    if !keys {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin does not take `{}`: the keys it writes cannot tell incarnation {} of job {} from another; \
             the engine still stops the job if a commit of this run finds its key already taken",
            reserved::INCARNATION,
            incarnation.id,
            job.spec.job.id
        );
    }
    if !plugin.takes_claims() && !incarnation.beside {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin does not take `{}`: it cannot claim its target for incarnation {} of job {}, so another \
             fresh state directory of this job run at the same time could land the source a second time",
            reserved::CLAIM,
            incarnation.id,
            job.spec.job.id
        );
    }
    if refuse_others && !checks {
        tracing::warn!(
            plugin = %plugin.name,
            "the plugin cannot tell whether its target already holds rows of an earlier incarnation of job {}; \
             this new state directory lands the source as incarnation {}",
            job.spec.job.id,
            incarnation.id
        );
    }
}
