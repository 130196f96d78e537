//! What an operator sees of a job's state directory (`sluice state`), and the
//! one change an operator may make to it: dropping a pending checkpoint.
//!
//! Invariants:
//! - showing the state never takes the directory's lock and never writes;
//! - a pending checkpoint is dropped only by the explicit command, never by
//!   the engine, and the drop is recorded in the record it rewrites.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::EngineError;
use super::checkpoint::{CheckpointRecord, CheckpointStore, DroppedCommit, Halt, Incarnation, now_ms};
use crate::config::EngineConfig;
use crate::plugin::{Limits, PluginHost};

/// A state directory as `sluice state` shows it.
#[derive(Debug)]
pub struct StateReport {
    pub job_id: String,
    pub sink_id: String,
    pub state_dir: PathBuf,
    /// The directory exists.
    pub exists: bool,
    pub incarnation: Option<Incarnation>,
    /// Runs started so far.
    pub runs: u32,
    pub halted: Option<Halt>,
    /// The newest checkpoint record.
    pub latest: Option<CheckpointRecord>,
    /// What each pending checkpoint will make visible, in the plugin's own
    /// words (see [`StateReport::describe_with`]).
    pub described: BTreeMap<u64, Vec<String>>,
}

/// Reads a job's state directory without locking or changing it.
pub fn inspect(job: &EngineConfig) -> Result<StateReport, EngineError> {
    let spec = &job.spec;
    let mut report = StateReport {
        job_id: spec.job.id.clone(),
        sink_id: spec.sink.id.clone(),
        state_dir: job.state_dir.clone(),
        exists: false,
        incarnation: None,
        runs: 0,
        halted: None,
        latest: None,
        described: BTreeMap::new(),
    };
    let Some(store) = CheckpointStore::inspect_at(&job.state, &spec.job.id, &job.state_stores)? else {
        return Ok(report);
    };
    report.exists = true;
    report.incarnation = store.incarnation()?;
    report.runs = store.attempts()?;
    report.halted = store.halted()?;
    report.latest = store.latest()?;
    Ok(report)
}

impl StateReport {
    /// Asks the job's plugin what each pending checkpoint will make visible
    /// (`describe-commit`, a pure call with no grants). A plugin that cannot
    /// be loaded, or one of contract 0.1, leaves the generic view; the reason
    /// is returned for the operator.
    pub fn describe_with(&mut self, job: &EngineConfig, host: &PluginHost) -> Result<(), String> {
        let Some(latest) = &self.latest else { return Ok(()) };
        if latest.pending.is_empty() {
            return Ok(());
        }
        let plugin = host.load(&job.spec.sink.plugin).map_err(|e| e.to_string())?;
        let limits = Limits::of(&job.spec.sink.sandbox);
        let no_grants = crate::capability::Granted::none().map_err(|e| e.to_string())?;
        let mut instance = plugin.instantiate("describe", &no_grants, limits).map_err(|e| e.to_string())?;
        for p in &latest.pending {
            if let Some(lines) =
                instance.describe_commit(&job.sink_options(), &p.combined.0).map_err(|e| e.to_string())?
            {
                self.described.insert(p.checkpoint, lines);
            }
        }
        Ok(())
    }
}

/// Drops pending checkpoint `checkpoint` from the newest record, after an
/// operator decided that its commit will never be made (its rows are
/// already visible, or they are given up). Takes the directory's lock, so
/// no run may hold it meanwhile.
pub fn drop_pending(job: &EngineConfig, checkpoint: u64) -> Result<DroppedCommit, EngineError> {
    let spec = &job.spec;
    let store = super::setup::open_state(job)?;
    let mut record = store.latest()?.ok_or_else(|| EngineError::NotPending {
        job: spec.job.id.clone(),
        checkpoint,
        pending: "none: the state directory holds no checkpoint".to_string(),
    })?;
    let Some(index) = record.pending.iter().position(|p| p.checkpoint == checkpoint) else {
        let pending: Vec<String> = record.pending.iter().map(|p| p.checkpoint.to_string()).collect();
        return Err(EngineError::NotPending {
            job: spec.job.id.clone(),
            checkpoint,
            pending: if pending.is_empty() { "none".to_string() } else { pending.join(", ") },
        });
    };
    let gone = record.pending.remove(index);
    let dropped = DroppedCommit { checkpoint, rows: gone.rows, bad: gone.bad_rows(), dropped_at_ms: now_ms() };
    record.dropped.push(dropped.clone());
    store.persist(&record)?;
    tracing::warn!(job = %spec.job.id, checkpoint, rows = gone.rows, "dropped a pending checkpoint on the operator's command");
    Ok(dropped)
}

/// A time as `2026-11-30 09:41:07 UTC`.
fn when(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(chrono::DateTime::from_timestamp_millis)
        .map_or_else(|| format!("{ms} ms after the epoch"), |t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
}

impl StateReport {
    /// One line for `sluice check`.
    pub fn one_line(&self) -> String {
        match (&self.incarnation, &self.latest) {
            (_, _) if !self.exists => {
                format!("{} is new: the first run starts a new incarnation", self.state_dir.display())
            }
            (None, None) => {
                format!("{}: no checkpoint yet; the next run starts a new incarnation", self.state_dir.display())
            }
            (inc, latest) => format!(
                "{}: incarnation {}, {}",
                self.state_dir.display(),
                inc.as_ref().map_or("(from an earlier version)", |i| i.id.as_str()),
                latest.as_ref().map_or("no checkpoint yet".to_string(), |r| format!(
                    "last checkpoint {}, {} pending",
                    r.checkpoint,
                    r.pending.len()
                )),
            ),
        }
    }
}

impl std::fmt::Display for StateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "job:          {} (sink {})", self.job_id, self.sink_id)?;
        writeln!(f, "state dir:    {}", self.state_dir.display())?;
        if !self.exists {
            return writeln!(f, "state:        none yet; the first run starts a new incarnation");
        }
        match &self.incarnation {
            Some(i) => writeln!(f, "incarnation:  {} (started {})", i.id, when(i.created_at_ms))?,
            None => writeln!(f, "incarnation:  none yet (the next run starts one)")?,
        }
        writeln!(f, "runs:         {}", self.runs)?;
        if let Some(h) = &self.halted {
            writeln!(f, "HALTED:       {} ({})", h.reason, when(h.halted_at_ms))?;
        }
        let Some(r) = &self.latest else {
            return writeln!(f, "checkpoints:  none yet");
        };
        writeln!(
            f,
            "last record:  checkpoint {} ({}), {} rows delivered to it, {}",
            r.checkpoint,
            when(r.created_at_ms),
            r.total_rows(),
            if r.finished() { "source finished" } else { "source not finished" }
        )?;
        if r.bad_rows() > 0 {
            let pending = match r.pending_bad_rows() {
                0 => String::new(),
                n => format!(" ({n} of them in pending checkpoints, landed once committed)"),
            };
            writeln!(
                f,
                "bad rows:     {} records that did not convert, set aside as dead letters up to checkpoint {}{pending}",
                r.bad_rows(),
                r.checkpoint
            )?;
        }
        match r.last_committed {
            Some(c) => writeln!(f, "committed:    up to checkpoint {c} (known when the record was written)")?,
            None => writeln!(f, "committed:    none known when the record was written")?,
        }
        writeln!(
            f,
            "in total:     {} rows of committed checkpoints (dropped ones excluded{})",
            r.committed_rows(),
            if r.pending.is_empty() { "" } else { "; pending ones count once committed" }
        )?;
        if r.pending.is_empty() {
            writeln!(f, "pending:      none")?;
        } else {
            writeln!(f, "pending:      {} checkpoint(s), committed first by the next run:", r.pending.len())?;
            for p in &r.pending {
                writeln!(f, "  checkpoint {}: {} rows; commits:", p.checkpoint, p.rows)?;
                let lines = match self.described.get(&p.checkpoint) {
                    Some(lines) => lines.clone(),
                    None => describe_commit(&p.combined.0),
                };
                for line in lines {
                    writeln!(f, "    {line}")?;
                }
            }
        }
        for d in &r.dropped {
            writeln!(f, "dropped:      checkpoint {} ({} rows) on {}", d.checkpoint, d.rows, when(d.dropped_at_ms))?;
        }
        Ok(())
    }
}

/// The longest value shown in full.
const SHOWN_CHARS: usize = 110;
/// The most list items shown.
const SHOWN_ITEMS: usize = 8;

/// What a combined commit will make visible, in lines. The bytes are the
/// plugin's own format; every Sluice sink writes JSON (tables or streams,
/// files), which is shown key by key; anything else is shown by its size.
pub fn describe_commit(combined: &[u8]) -> Vec<String> {
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice::<serde_json::Value>(combined) else {
        return vec![format!("{} bytes in the plugin's own format", combined.len())];
    };
    let mut lines = Vec::new();
    for (key, value) in map {
        match value {
            serde_json::Value::Array(items) => {
                lines.push(format!("{key}: {} item(s)", items.len()));
                for item in items.iter().take(SHOWN_ITEMS) {
                    lines.push(format!("  - {}", short(item)));
                }
                if items.len() > SHOWN_ITEMS {
                    lines.push(format!("  - ... and {} more", items.len() - SHOWN_ITEMS));
                }
            }
            other => lines.push(format!("{key}: {}", short(&other))),
        }
    }
    lines
}

fn short(value: &serde_json::Value) -> String {
    let text = match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if text.chars().count() <= SHOWN_CHARS {
        return text;
    }
    let head: String = text.chars().take(SHOWN_CHARS).collect();
    format!("{head}... ({} chars)", text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_are_described_key_by_key() {
        let json =
            br#"{"visible_dir":"out/x.c0000000003","flushes":[{"stream":"s1","offset":9},{"stream":"s2","offset":4}]}"#;
        let lines = describe_commit(json);
        let flushes = lines.iter().position(|l| l == "flushes: 2 item(s)").expect("the list is named");
        assert!(lines[flushes + 1].starts_with("  - {") && lines[flushes + 1].contains(r#""stream":"s1""#));
        assert!(lines[flushes + 2].contains(r#""stream":"s2""#) && lines[flushes + 2].contains(r#""offset":4"#));
        assert!(lines.contains(&"visible_dir: out/x.c0000000003".to_string()), "{lines:?}");
        assert_eq!(describe_commit(&[0, 1, 2]), vec!["3 bytes in the plugin's own format".to_string()]);
        let long = format!(r#"{{"files":[{:?}]}}"#, "x".repeat(500));
        assert!(describe_commit(long.as_bytes())[1].ends_with("... (500 chars)"));
    }
}
