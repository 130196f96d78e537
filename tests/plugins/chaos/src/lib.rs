//! `chaos`: a test-only sink plugin.
//!
//! It lands no data. It journals every call it receives (one file per
//! instance, each line stamped with the wall clock) so the runner can check
//! the lifecycle order, and it misbehaves on request so the runner can check
//! the sandbox: a trap, a panic, an endless loop, a memory bomb, or an attempt
//! to reach files outside its grants.
//!
//! Options: `journal` (directory location), `misbehave`
//! (`none|trap|panic|loop|memory-bomb|escape|already-committed`, the last
//! answering every `commit` `already-committed`, as a plugin whose keys
//! collide with an earlier incarnation's would), `at` (the call to misbehave
//! in: `open|write|prepare-commit|commit`), `target` (a location outside the
//! grants, for `escape`), `state_dir` (the job's state directory: `commit(c)`
//! fails unless the record of `c` is already on disk).

use std::cell::RefCell;
use std::time::{SystemTime, UNIX_EPOCH};

use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{
    CommitOutcome, Committer, Guest, GuestCommitter, GuestWriter, OptionSpec, PluginInfo, SinkContext, SinkError,
    Table, TableChange, Writer, error, ipc, option_spec,
};

/// `name:kind` of each change, for the journal.
fn changes_text(changes: &[TableChange]) -> String {
    let parts: Vec<String> = changes.iter().map(|c| format!("{}:{:?}", c.table.name, c.kind)).collect();
    parts.join(",")
}

fn specs() -> Vec<OptionSpec> {
    vec![
        option_spec("journal", "directory location for the call journals", false, None),
        option_spec(
            "misbehave",
            "none, trap, panic, loop, memory-bomb, escape or already-committed",
            false,
            Some("none"),
        ),
        option_spec("at", "open, write, prepare-commit or commit", false, Some("write")),
        option_spec("target", "a location outside the grants (for escape)", false, None),
        option_spec("state_dir", "the job's state directory, to check persist-before-commit", false, None),
    ]
}

struct Cfg {
    journal: Option<String>,
    misbehave: String,
    at: String,
    target: Option<String>,
    state_dir: Option<String>,
}

impl Cfg {
    fn parse(raw: Vec<(String, String)>) -> Result<Self, SinkError> {
        let o = Options::parse(raw, &specs())?;
        Ok(Self {
            journal: o.get("journal").map(str::to_string),
            misbehave: o.required("misbehave")?.to_string(),
            at: o.required("at")?.to_string(),
            target: o.get("target").map(str::to_string),
            state_dir: o.get("state_dir").map(str::to_string),
        })
    }

    /// Misbehaves if asked to in `call`.
    fn maybe_misbehave(&self, call: &str) -> Result<(), SinkError> {
        if self.at != call {
            return Ok(());
        }
        match self.misbehave.as_str() {
            "none" => Ok(()),
            "trap" => std::process::abort(),
            "panic" => panic!("chaos: deliberate panic in {call}"),
            "loop" => {
                let mut x: u64 = 1;
                loop {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            "memory-bomb" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    let mut chunk = vec![0u8; 64 << 20];
                    chunk[0] = 1;
                    hoard.push(std::hint::black_box(chunk));
                }
            }
            "escape" => self.escape(),
            "already-committed" => Ok(()),
            other => Err(error::config(format!("unknown misbehaviour {other:?}"))),
        }
    }

    fn misbehave_is(&self, misbehave: &str, at: &str) -> bool {
        self.misbehave == misbehave && self.at == at
    }

    /// Tries every way out of the sandbox; fails loudly if any works.
    fn escape(&self) -> Result<(), SinkError> {
        let target = self.target.clone().ok_or_else(|| error::config("escape needs option `target`"))?;
        let mut escaped = Vec::new();
        let mut refused = Vec::new();
        match files::read(&target, 0, 64) {
            Ok(_) => escaped.push("file-io read".to_string()),
            Err(e) => refused.push(format!("file-io read: {}", files::describe(&e))),
        }
        match files::write_file(&format!("{target}.pwned"), b"pwned", true) {
            Ok(()) => escaped.push("file-io write".to_string()),
            Err(e) => refused.push(format!("file-io write: {}", files::describe(&e))),
        }
        let plain = target.trim_start_matches("file://");
        match std::fs::read(plain) {
            Ok(_) => escaped.push("wasi read".to_string()),
            Err(e) => refused.push(format!("wasi read: {e}")),
        }
        match std::fs::write(format!("{plain}.pwned-wasi"), b"pwned") {
            Ok(()) => escaped.push("wasi write".to_string()),
            Err(e) => refused.push(format!("wasi write: {e}")),
        }
        if escaped.is_empty() {
            Err(error::fatal(format!("all escapes refused: {}", refused.join("; "))))
        } else {
            Err(error::fatal(format!("ESCAPED through {}", escaped.join(", "))))
        }
    }
}

/// The per-instance journal.
struct Journal {
    location: Option<String>,
    lines: Vec<String>,
}

impl Journal {
    fn new(cfg: &Cfg, who: &str) -> Self {
        Self { location: cfg.journal.as_ref().map(|j| join(j, &format!("{who}.log"))), lines: Vec::new() }
    }

    fn note(&mut self, entry: String) -> Result<(), SinkError> {
        let Some(location) = &self.location else { return Ok(()) };
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        self.lines.push(format!("{nanos} {entry}"));
        let mut text = self.lines.join("\n");
        text.push('\n');
        files::write_file(location, text.as_bytes(), true).map_err(|e| files::to_sink_error("journal", e))
    }
}

struct ChaosWriter {
    cfg: Cfg,
    journal: RefCell<Journal>,
    rows: RefCell<u64>,
}

struct ChaosCommitter {
    cfg: Cfg,
    journal: RefCell<Journal>,
    committed: RefCell<Vec<u64>>,
}

struct Chaos;

impl Guest for Chaos {
    type Writer = ChaosWriter;
    type Committer = ChaosCommitter;

    fn describe() -> PluginInfo {
        PluginInfo {
            name: "chaos".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: "test-only plugin: journals calls, misbehaves on request".into(),
            options: specs(),
            multi_table: true,
            capabilities: vec!["file-io: read-write on `journal`; read on `state_dir`".into()],
        }
    }

    fn describe_commit(_options: Vec<(String, String)>, combined: Vec<u8>) -> Vec<String> {
        vec![format!("{} row(s), landing nowhere", String::from_utf8_lossy(&combined))]
    }

    fn validate(_ctx: SinkContext, options: Vec<(String, String)>, _tables: Vec<Table>) -> Result<(), SinkError> {
        Cfg::parse(options).map(|_| ())
    }
}

impl GuestWriter for ChaosWriter {
    fn open(
        ctx: SinkContext,
        options: Vec<(String, String)>,
        _tables: Vec<Table>,
        restored: Option<Vec<u8>>,
    ) -> Result<Writer, SinkError> {
        let cfg = Cfg::parse(options)?;
        let mut journal = Journal::new(&cfg, &format!("a{}-writer{}", ctx.attempt, ctx.subtask));
        let restored = restored.map(|r| String::from_utf8_lossy(&r).into_owned()).unwrap_or_else(|| "none".into());
        journal.note(format!("open restored={restored}"))?;
        cfg.maybe_misbehave("open")?;
        Ok(Writer::new(ChaosWriter { cfg, journal: RefCell::new(journal), rows: RefCell::new(0) }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let (_, batches) = ipc::decode(rows)?;
        let n: usize = batches.iter().map(|b| b.num_rows()).sum();
        *self.rows.borrow_mut() += n as u64;
        let line = if table.is_empty() { format!("write rows={n}") } else { format!("write table={table} rows={n}") };
        self.journal.borrow_mut().note(line)?;
        self.cfg.maybe_misbehave("write")
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let rows = std::mem::take(&mut *self.rows.borrow_mut());
        self.journal.borrow_mut().note(format!("prepare-commit {c} rows={rows}"))?;
        self.cfg.maybe_misbehave("prepare-commit")?;
        Ok((rows > 0).then(|| format!("{rows}").into_bytes()))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        self.journal.borrow_mut().note(format!("snapshot-state {c}"))?;
        Ok(format!("c{c}").into_bytes())
    }

    fn apply_changes(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("apply-changes {}", changes_text(&changes)))
    }

    fn abort_prepare(&self, c: u64) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("abort-prepare {c}"))
    }

    fn close(&self) -> Result<(), SinkError> {
        self.journal.borrow_mut().note("close".into())
    }
}

impl GuestCommitter for ChaosCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, _tables: Vec<Table>) -> Result<Committer, SinkError> {
        let cfg = Cfg::parse(options)?;
        let mut journal = Journal::new(&cfg, &format!("a{}-committer", ctx.attempt));
        journal.note("open".into())?;
        Ok(Committer::new(ChaosCommitter { cfg, journal: RefCell::new(journal), committed: RefCell::new(Vec::new()) }))
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        let rows: u64 = infos.iter().filter_map(|i| String::from_utf8_lossy(i).parse::<u64>().ok()).sum();
        self.journal.borrow_mut().note(format!("combine {c} infos={} rows={rows}", infos.len()))?;
        Ok(format!("{rows}").into_bytes())
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        if let Some(dir) = &self.cfg.state_dir {
            let record = join(dir, &format!("checkpoints/chk-{c:020}.json"));
            if !files::exists(&record).map_err(|e| files::to_sink_error("state_dir", e))? {
                return Err(error::fatal(format!("commit({c}) called before its record {record} was persisted")));
            }
        }
        self.cfg.maybe_misbehave("commit")?;
        let already = self.committed.borrow().contains(&c) || self.cfg.misbehave_is("already-committed", "commit");
        self.committed.borrow_mut().push(c);
        self.journal.borrow_mut().note(format!("commit {c} rows={}", String::from_utf8_lossy(&combined)))?;
        Ok(if already { CommitOutcome::AlreadyCommitted } else { CommitOutcome::Committed })
    }

    fn abort(&self, c: u64, _combined: Vec<u8>) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("abort {c}"))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("evolve {}", changes_text(&changes)))
    }
}

sluice_guest_sdk::export_plugin!(Chaos);
