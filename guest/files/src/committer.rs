//! The files sink's committer: one atomic directory rename per checkpoint.

use serde::{Deserialize, Serialize};
use sluice_guest_sdk::Committer;
use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::{CommitOutcome, GuestCommitter, SinkContext, SinkError, error, log};

use crate::writer::{CommitInfo, StagedFile};
use crate::{Config, layout};

/// Everything needed to publish one checkpoint; persisted by the host.
#[derive(Debug, Serialize, Deserialize)]
struct Combined {
    staging_dir: String,
    visible_dir: String,
    files: Vec<StagedFile>,
}

pub struct FilesCommitter {
    cfg: Config,
    ctx: SinkContext,
}

fn decode(combined: &[u8]) -> Result<Combined, SinkError> {
    serde_json::from_slice(combined).map_err(|e| error::fatal(format!("combined commit is not valid: {e}")))
}

impl GuestCommitter for FilesCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, _schema: Vec<u8>) -> Result<Committer, SinkError> {
        let cfg = Config::parse(options)?;
        layout::refuse_other_incarnations(&cfg, &ctx)?;
        files::create_dir_all(&cfg.path)
            .map_err(|e| files::to_sink_error(&format!("creating output directory {}", cfg.path), e))?;
        Ok(Committer::new(FilesCommitter { cfg, ctx }))
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let mut staging_dir: Option<String> = None;
        let mut all = Vec::new();
        for bytes in infos {
            let info: CommitInfo = serde_json::from_slice(&bytes)
                .map_err(|e| error::fatal(format!("commit info of checkpoint {c} is not valid: {e}")))?;
            match &staging_dir {
                Some(dir) if dir != &info.dir => {
                    return Err(error::fatal(format!(
                        "writers of checkpoint {c} staged into different directories: {dir} and {}",
                        info.dir
                    )));
                }
                _ => staging_dir = Some(info.dir),
            }
            all.extend(info.files);
        }
        let staging_dir = staging_dir.ok_or_else(|| error::fatal(format!("checkpoint {c} has no commit infos")))?;
        let combined = Combined { staging_dir, visible_dir: layout::visible_dir(&self.cfg, &self.ctx, c), files: all };
        serde_json::to_vec(&combined).map_err(|e| error::fatal(format!("encoding combined commit: {e}")))
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let combined = decode(&combined)?;
        let io = |what: &str, e| files::to_sink_error(&format!("checkpoint {c}: {what}"), e);
        if files::exists(&combined.visible_dir).map_err(|e| io("checking the visible directory", e))? {
            return Ok(CommitOutcome::AlreadyCommitted);
        }
        for file in &combined.files {
            let location = join(&combined.staging_dir, &file.name);
            if !files::exists(&location).map_err(|e| io("checking staged files", e))? {
                return Err(error::fatal(format!(
                    "checkpoint {c} cannot be committed: staged file {location} is missing \
                     (was the staging directory changed outside Sluice?)"
                )));
            }
        }
        match files::rename(&combined.staging_dir, &combined.visible_dir) {
            Ok(()) => {
                let rows: u64 = combined.files.iter().map(|f| f.rows).sum();
                log::info(&format!(
                    "checkpoint {c}: published {} file(s), {rows} row(s) in {}",
                    combined.files.len(),
                    combined.visible_dir
                ));
                Ok(CommitOutcome::Committed)
            }
            // Someone (an earlier attempt of this very commit) got there first.
            Err(sluice_guest_sdk::IoError::AlreadyExists(_)) => Ok(CommitOutcome::AlreadyCommitted),
            Err(e) => Err(io("publishing", e)),
        }
    }

    fn abort(&self, _c: u64, combined: Vec<u8>) -> Result<(), SinkError> {
        let combined = decode(&combined)?;
        match files::delete(&combined.staging_dir) {
            Ok(()) => Ok(()),
            Err(sluice_guest_sdk::IoError::NotFound(_)) => Ok(()),
            Err(e) => Err(files::to_sink_error("removing aborted checkpoint", e)),
        }
    }
}
