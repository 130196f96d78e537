//! `chaos`: a test-only sink plugin.
//!
//! It lands no data. It journals every call it receives (one file per
//! instance, each line stamped with the wall clock) so the runner can check
//! the lifecycle order, and it misbehaves on request so the runner can check
//! the sandbox: a trap, a panic, an endless loop, a memory bomb, or an attempt
//! to reach files outside its grants.
//!
//! Options: `journal` (directory location), `misbehave`
//! (`none|trap|panic|loop|memory-bomb|escape|already-committed|finish-commits`,
//! `already-committed` answering every `commit` `already-committed`, as a
//! plugin whose keys collide with an earlier incarnation's would, and
//! `finish-commits` (with `at = "commit"`) asking for a commit of no rows at
//! the end of an input whose last round had none; or one of the host-limit
//! probes: `sleep` (a WASI sleep of an hour), `exit` (`exit(0)`),
//! `file-io-probe` (file-io under `target`, see `file_io_probe`),
//! `grpc-hang` and `http-hang` (a call to the granted endpoint `hang`, which
//! never answers, with the largest timeout), `grpc-streams`, `http-requests`
//! and `open-files` (opening until refused), `log-flood` (64 MiB of log
//! lines, then success), `codec-levels` (zstd at 21,000 distinct levels,
//! then success), `decompress-bomb` (a 256 MiB zstd bomb asked back with no
//! useful limit)), `at` (the call to misbehave
//! in: `open|write|prepare-commit|commit`), `target` (a location outside the
//! grants, for `escape`), `state_dir` (the job's state directory: `commit(c)`
//! fails unless the record of `c` is already on disk).
//!
//! Its committer keeps state (contract 0.2.3's `committer-state`): the
//! checkpoints it committed and their rows, journalled on `restore` and
//! `snapshot`, so the runner can check that the state outlives crashes and
//! never holds a checkpoint that was not committed.
//!
//! Change streams: it declares `sluice.key`. Given a key, its writers take
//! each batch apart (`changes::split`) and carry the checkpoint's changes in
//! their commit info; the committer applies a checkpoint's changes once, in
//! the order the writers wrote them, to its state: per table and key the
//! row the last change left (a delete removes it), and the log of every
//! change applied (`[table, key, op, hi, lo]`). Values are their Arrow
//! display text (null as null), a key the JSON array of its values. So the
//! state in the newest record is what the job landed, to compare with a
//! model. With a key, every `open`, `apply-changes` and `evolve` journals
//! the tables' columns too (`tables name:[a,b]`). Without a key, commit
//! infos stay a row count and the journal is as it was.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_guest_sdk::bindings::sluice::connector::codec::{self, Algorithm};
use sluice_guest_sdk::bindings::sluice::connector::file_io::OutputFile;
use sluice_guest_sdk::bindings::sluice::connector::grpc::{self, BidiStream, GrpcError};
use sluice_guest_sdk::bindings::sluice::connector::log::{Level, log};

use sluice_guest_sdk::files::{self, join};
use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{
    CommitOutcome, Committer, Guest, GuestCommitter, GuestCommitterState, GuestWriter, OptionSpec, PluginInfo,
    SinkContext, SinkError, Table, TableChange, Writer, error, ipc, option_spec,
};

/// `name:[a,b]` of each table, for the journal.
fn tables_text(tables: &[Table]) -> String {
    let parts: Vec<String> = tables
        .iter()
        .map(|t| match ipc::decode_schema(&t.schema) {
            Ok(schema) => {
                let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                format!("{}:[{}]", t.name, names.join(","))
            }
            Err(_) => format!("{}:?", t.name),
        })
        .collect();
    parts.join(" ")
}

/// One change a writer took from a batch.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Change {
    table: String,
    key: String,
    op: u8,
    hi: u64,
    lo: u64,
    /// Column name to value (display text; `None` for null).
    row: Row,
}

/// A commit info (and a combined one) of a change stream.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct ChangeInfo {
    rows: u64,
    changes: Vec<Change>,
    /// Rows of batches that are no changes (dead letters): table, row.
    #[serde(default)]
    plain: Vec<(String, Row)>,
}

/// Column name to value (display text; `None` for null).
type Row = std::collections::BTreeMap<String, Option<String>>;

/// The rows of `batch` as text.
fn rows_of(batch: &arrow_array::RecordBatch) -> Result<Vec<Row>, SinkError> {
    use arrow_array::Array;
    let schema = batch.schema();
    let mut out = Vec::with_capacity(batch.num_rows());
    for i in 0..batch.num_rows() {
        let mut row = Row::new();
        for (field, col) in schema.fields().iter().zip(batch.columns()) {
            let value = if col.is_null(i) {
                None
            } else {
                Some(
                    arrow_cast::display::array_value_to_string(col.as_ref(), i)
                        .map_err(|e| error::fatal(format!("chaos: rendering a value: {e}")))?,
                )
            };
            row.insert(field.name().clone(), value);
        }
        out.push(row);
    }
    Ok(out)
}

/// The changes in `batch` of `table`, keyed by `key`.
fn changes_of(table: &str, key: &[String], batch: &arrow_array::RecordBatch) -> Result<Vec<Change>, SinkError> {
    let split = sluice_guest_sdk::changes::split(batch)?;
    let mut out = Vec::with_capacity(split.rows.num_rows());
    for (i, row) in rows_of(&split.rows)?.into_iter().enumerate() {
        let key_values: Vec<Option<String>> = key
            .iter()
            .map(|k| row.get(k).cloned().ok_or_else(|| error::invalid_data(format!("chaos: no key column `{k}`"))))
            .collect::<Result<_, _>>()?;
        let key = serde_json::to_string(&key_values).map_err(|e| error::fatal(e.to_string()))?;
        let (hi, lo) = split.seqs[i];
        out.push(Change { table: table.to_string(), key, op: split.ops[i], hi, lo, row });
    }
    Ok(out)
}

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
            "none, trap, panic, loop, memory-bomb, escape, already-committed, finish-commits, or a host-limit probe \
             (sleep, exit, grpc-hang, http-hang, grpc-streams, http-requests, open-files, log-flood, \
             codec-levels, decompress-bomb)",
            false,
            Some("none"),
        ),
        option_spec("at", "open, write, prepare-commit or commit", false, Some("write")),
        option_spec("target", "a location outside the grants (for escape)", false, None),
        option_spec("state_dir", "the job's state directory, to check persist-before-commit", false, None),
        option_spec("key", "the change key as a sink option takes it (only read by the host's fallback)", false, None),
        sluice_guest_sdk::changes::key_option_spec(),
    ]
}

struct Cfg {
    journal: Option<String>,
    misbehave: String,
    at: String,
    target: Option<String>,
    state_dir: Option<String>,
    /// A change stream's key columns (`sluice.key`).
    key: Option<Vec<String>>,
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
            key: o.get(sluice_guest_sdk::changes::KEY_OPTION).map(sluice_guest_sdk::changes::parse_key).transpose()?,
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
            "file-io-probe" => self.file_io_probe(),
            "already-committed" | "finish-commits" => Ok(()),
            "sleep" => {
                std::thread::sleep(Duration::from_secs(3600));
                Err(error::fatal("chaos: woke up after an hour"))
            }
            // WASI 0.2's `exit` carries success or failure only (status 0 or 1).
            "exit" => std::process::exit(0),
            "grpc-hang" => match grpc::unary("hang", "/chaos.Hang/Forever", &[], u32::MAX) {
                Ok(_) => Err(error::fatal("chaos: the hanging endpoint answered")),
                Err(e) => Err(error::fatal(format!("chaos: grpc-hang returned: {}", grpc_text(&e)))),
            },
            "http-hang" => {
                let pending = http_get("hang").map_err(error::fatal)?;
                pending.subscribe().block();
                Err(error::fatal("chaos: the hanging endpoint answered"))
            }
            "http-requests" => {
                let mut pending = Vec::new();
                for _ in 0..10_000 {
                    pending.push(http_get("hang").map_err(error::fatal)?);
                }
                // The newest is beyond any sane cap: it fails at once.
                let last = pending.pop().ok_or_else(|| error::fatal("no request"))?;
                last.subscribe().block();
                match last.get() {
                    Some(Ok(Err(e))) => Err(error::fatal(format!("chaos: request refused: {e:?}"))),
                    _ => Err(error::fatal("chaos: 10000 requests in flight")),
                }
            }
            "grpc-streams" => {
                let mut streams = Vec::new();
                for _ in 0..100_000 {
                    match BidiStream::open("hang", "/chaos.Hang/Stream") {
                        Ok(s) => streams.push(s),
                        Err(e) => {
                            return Err(error::fatal(format!(
                                "chaos: stream {} refused: {}",
                                streams.len() + 1,
                                grpc_text(&e)
                            )));
                        }
                    }
                }
                Err(error::fatal("chaos: 100000 streams open"))
            }
            "open-files" => {
                let dir = self.journal.clone().ok_or_else(|| error::config("open-files needs `journal`"))?;
                let mut open = Vec::new();
                for i in 0..100_000 {
                    match OutputFile::create(&join(&dir, &format!("open-{i}.bin")), true) {
                        Ok(f) => open.push(f),
                        Err(e) => {
                            return Err(error::fatal(format!(
                                "chaos: output file {} refused: {}",
                                i + 1,
                                files::describe(&e)
                            )));
                        }
                    }
                }
                Err(error::fatal("chaos: 100000 output files open"))
            }
            "log-flood" => {
                let line = "x".repeat(1023);
                for _ in 0..(64 << 10) {
                    log(Level::Info, &line);
                }
                Ok(())
            }
            "codec-levels" => {
                let data: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
                // Beyond zstd's range (clamped to 22), then 20,000 distinct
                // fast levels (a context each, were they all kept).
                for level in (23..1023).chain((1..=20_000).map(|l| -l)) {
                    codec::compress(Algorithm::Zstd, level, &data)
                        .map_err(|e| error::fatal(format!("chaos: compress at {level}: {e}")))?;
                }
                Ok(())
            }
            "decompress-bomb" => {
                // 256 MiB of zeros compress to a few KiB.
                let zeros = vec![0u8; 16 << 20];
                let mut bomb = Vec::new();
                // A fast level: a high one's context would take more host
                // memory than the refusal this probes.
                let frame = codec::compress(Algorithm::Zstd, 1, &zeros).map_err(error::fatal)?;
                for _ in 0..16 {
                    bomb.extend_from_slice(&frame);
                }
                drop(zeros);
                match codec::decompress(Algorithm::Zstd, &bomb, u64::MAX) {
                    Ok(out) => Err(error::fatal(format!("chaos: the bomb went off: {} bytes", out.len()))),
                    Err(e) => Err(error::fatal(format!("chaos: decompress refused: {e}"))),
                }
            }
            other => Err(error::config(format!("unknown misbehaviour {other:?}"))),
        }
    }

    fn misbehave_is(&self, misbehave: &str, at: &str) -> bool {
        self.misbehave == misbehave && self.at == at
    }

    /// Drives `file-io` under the granted location `target` (an object
    /// store, in `tests/tests/file_io_s3.rs`) and fails, listing every
    /// answer that was not the expected one, unless all were: exclusive
    /// creates, a streamed output file, reads, a list, the refused rename
    /// and a sibling prefix outside the grant.
    fn file_io_probe(&self) -> Result<(), SinkError> {
        use sluice_guest_sdk::bindings::sluice::connector::file_io::{self as fio, IoError};
        let target = self.target.clone().ok_or_else(|| error::config("file-io-probe needs option `target`"))?;
        let mut wrong = Vec::new();
        let a = join(&target, "probe/a.txt");
        let big = join(&target, "probe/big.bin");
        if let Err(e) = fio::write_file(&a, b"first", false) {
            wrong.push(format!("first create: {}", files::describe(&e)));
        }
        match fio::write_file(&a, b"second", false) {
            Err(IoError::AlreadyExists(_)) => {}
            other => wrong.push(format!("second create answered {other:?}")),
        }
        let streamed = (|| {
            let out = OutputFile::create(&big, false)?;
            let chunk = vec![7u8; 1 << 20];
            for _ in 0..10 {
                out.write(&chunk)?;
            }
            out.finish()
        })();
        if let Err(e) = streamed {
            wrong.push(format!("output-file: {}", files::describe(&e)));
        }
        match fio::read(&a, 1, 3) {
            Ok(bytes) if bytes == b"irs" => {}
            other => wrong.push(format!("read answered {other:?}")),
        }
        match fio::stat(&big) {
            Ok(s) if s.size == 10 << 20 && !s.is_dir => {}
            other => wrong.push(format!("stat answered {other:?}")),
        }
        match fio::list_dir(&join(&target, "probe")) {
            Ok(names) if names == ["a.txt", "big.bin"] => {}
            other => wrong.push(format!("list-dir answered {other:?}")),
        }
        match fio::rename(&a, &join(&target, "probe/moved.txt")) {
            Err(IoError::Other(m)) if m.contains("cannot rename on an object store") => {}
            other => wrong.push(format!("rename answered {other:?}")),
        }
        let sibling = format!("{}-other/x", target.trim_end_matches('/'));
        match fio::write_file(&sibling, b"x", true) {
            Err(IoError::Denied(_)) => {}
            other => wrong.push(format!("a write to {sibling} answered {other:?}")),
        }
        if wrong.is_empty() { Ok(()) } else { Err(error::fatal(format!("file-io-probe: {}", wrong.join("; ")))) }
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

fn grpc_text(e: &GrpcError) -> String {
    match e {
        GrpcError::Denied(m) => format!("denied: {m}"),
        GrpcError::Status(s) => format!("status {}: {}", s.code, s.message),
    }
}

/// Sends `GET http://<endpoint>/` with the largest timeouts a plugin can ask
/// for, and returns the pending response.
fn http_get(endpoint: &str) -> Result<wasip2::http::types::FutureIncomingResponse, String> {
    use wasip2::http::types::{Fields, Method, OutgoingRequest, RequestOptions, Scheme};
    let request = OutgoingRequest::new(Fields::new());
    request.set_method(&Method::Get).map_err(|()| "bad method".to_string())?;
    request.set_scheme(Some(&Scheme::Http)).map_err(|()| "bad scheme".to_string())?;
    request.set_authority(Some(endpoint)).map_err(|()| "bad endpoint".to_string())?;
    request.set_path_with_query(Some("/")).map_err(|()| "bad path".to_string())?;
    let options = RequestOptions::new();
    let _ = options.set_connect_timeout(Some(u64::MAX));
    let _ = options.set_first_byte_timeout(Some(u64::MAX));
    let _ = options.set_between_bytes_timeout(Some(u64::MAX));
    wasip2::http::outgoing_handler::handle(request, Some(options)).map_err(|e| format!("handle: {e:?}"))
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
    /// A change stream: the changes written since the last prepare-commit.
    changes: RefCell<Vec<Change>>,
    /// A change stream: rows of other batches (dead letters) since then.
    plain: RefCell<Vec<(String, Row)>>,
}

struct ChaosCommitter {
    inner: Rc<CommitterInner>,
}

struct CommitterInner {
    cfg: Cfg,
    journal: RefCell<Journal>,
    /// The committer's state (contract 0.2.3's `committer-state`): each
    /// checkpoint this incarnation committed, once, oldest first, and the
    /// rows they carried. The host persists it in every record and hands it
    /// back on resume, so it outlives crashes.
    state: RefCell<Committed>,
}

#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Committed {
    checkpoints: Vec<u64>,
    rows: u64,
    /// A change stream: per table and key, the row its last change left.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    landed: std::collections::BTreeMap<String, std::collections::BTreeMap<String, Change>>,
    /// A change stream: every change applied, in order: `[table, key, op, hi, lo]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    log: Vec<(String, String, u8, u64, u64)>,
    /// A change stream: rows of batches that were no changes (dead letters), by table.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    appended: std::collections::BTreeMap<String, Vec<Row>>,
}

thread_local! {
    /// The committer opened in this instance: the `committer-state`
    /// functions act on it (the host opens one committer per instance).
    static OPEN: RefCell<Option<Rc<CommitterInner>>> = const { RefCell::new(None) };
}

fn open_committer() -> Result<Rc<CommitterInner>, SinkError> {
    OPEN.with(|open| open.borrow().clone()).ok_or_else(|| error::fatal("committer-state called before committer.open"))
}

impl GuestCommitterState for Chaos {
    fn restore(state: Option<Vec<u8>>) -> Result<(), SinkError> {
        let inner = open_committer()?;
        let restored: Committed = match &state {
            Some(bytes) => serde_json::from_slice(bytes)
                .map_err(|e| error::fatal(format!("restored committer state is not valid: {e}")))?,
            None => Committed::default(),
        };
        inner.journal.borrow_mut().note(format!(
            "restore {} checkpoints={:?} rows={}",
            if state.is_some() { "some" } else { "none" },
            restored.checkpoints,
            restored.rows
        ))?;
        *inner.state.borrow_mut() = restored;
        Ok(())
    }

    fn snapshot(c: u64) -> Result<Vec<u8>, SinkError> {
        let inner = open_committer()?;
        let state = inner.state.borrow();
        inner.journal.borrow_mut().note(format!("state-snapshot {c} checkpoints={:?}", state.checkpoints))?;
        serde_json::to_vec(&*state).map_err(|e| error::fatal(format!("encoding the committer state: {e}")))
    }

    fn finish(c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let inner = open_committer()?;
        inner.journal.borrow_mut().note(format!("finish {c}"))?;
        // `misbehave = "finish-commits"`: the end of an empty input calls
        // for a commit of no rows.
        Ok(inner.cfg.misbehave_is("finish-commits", "commit").then(|| b"0".to_vec()))
    }
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
        tables: Vec<Table>,
        restored: Option<Vec<u8>>,
    ) -> Result<Writer, SinkError> {
        let cfg = Cfg::parse(options)?;
        let mut journal = Journal::new(&cfg, &format!("a{}-writer{}", ctx.attempt, ctx.subtask));
        let restored = restored.map(|r| String::from_utf8_lossy(&r).into_owned()).unwrap_or_else(|| "none".into());
        journal.note(format!("open restored={restored}"))?;
        if cfg.key.is_some() {
            journal.note(format!("tables {}", tables_text(&tables)))?;
        }
        cfg.maybe_misbehave("open")?;
        Ok(Writer::new(ChaosWriter {
            cfg,
            journal: RefCell::new(journal),
            rows: RefCell::new(0),
            changes: RefCell::default(),
            plain: RefCell::default(),
        }))
    }

    fn write(&self, table: String, rows: Vec<u8>) -> Result<(), SinkError> {
        let (_, batches) = ipc::decode(rows)?;
        let n: usize = batches.iter().map(|b| b.num_rows()).sum();
        if let Some(key) = &self.cfg.key {
            for batch in &batches {
                let schema = batch.schema();
                if schema.fields().last().is_some_and(|f| f.name() == sluice_guest_sdk::changes::SEQ_LO) {
                    self.changes.borrow_mut().extend(changes_of(&table, key, batch)?);
                } else {
                    self.plain.borrow_mut().extend(rows_of(batch)?.into_iter().map(|r| (table.clone(), r)));
                }
            }
        }
        *self.rows.borrow_mut() += n as u64;
        let line = if table.is_empty() { format!("write rows={n}") } else { format!("write table={table} rows={n}") };
        self.journal.borrow_mut().note(line)?;
        self.cfg.maybe_misbehave("write")
    }

    fn prepare_commit(&self, c: u64) -> Result<Option<Vec<u8>>, SinkError> {
        let rows = std::mem::take(&mut *self.rows.borrow_mut());
        self.journal.borrow_mut().note(format!("prepare-commit {c} rows={rows}"))?;
        self.cfg.maybe_misbehave("prepare-commit")?;
        if self.cfg.key.is_some() {
            let changes = std::mem::take(&mut *self.changes.borrow_mut());
            let plain = std::mem::take(&mut *self.plain.borrow_mut());
            let info =
                serde_json::to_vec(&ChangeInfo { rows, changes, plain }).map_err(|e| error::fatal(e.to_string()))?;
            return Ok((rows > 0).then_some(info));
        }
        Ok((rows > 0).then(|| format!("{rows}").into_bytes()))
    }

    fn snapshot_state(&self, c: u64) -> Result<Vec<u8>, SinkError> {
        self.journal.borrow_mut().note(format!("snapshot-state {c}"))?;
        Ok(format!("c{c}").into_bytes())
    }

    fn apply_changes(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("apply-changes {}", changes_text(&changes)))?;
        if self.cfg.key.is_none() {
            return Ok(());
        }
        let tables: Vec<Table> = changes.into_iter().map(|c| c.table).collect();
        self.journal.borrow_mut().note(format!("tables {}", tables_text(&tables)))
    }

    fn abort_prepare(&self, c: u64) -> Result<(), SinkError> {
        self.journal.borrow_mut().note(format!("abort-prepare {c}"))
    }

    fn close(&self) -> Result<(), SinkError> {
        self.journal.borrow_mut().note("close".into())
    }
}

impl GuestCommitter for ChaosCommitter {
    fn open(ctx: SinkContext, options: Vec<(String, String)>, tables: Vec<Table>) -> Result<Committer, SinkError> {
        let cfg = Cfg::parse(options)?;
        let mut journal = Journal::new(&cfg, &format!("a{}-committer", ctx.attempt));
        journal.note("open".into())?;
        if cfg.key.is_some() {
            journal.note(format!("tables {}", tables_text(&tables)))?;
        }
        let inner = Rc::new(CommitterInner { cfg, journal: RefCell::new(journal), state: RefCell::default() });
        OPEN.with(|open| *open.borrow_mut() = Some(inner.clone()));
        Ok(Committer::new(ChaosCommitter { inner }))
    }

    fn combine(&self, c: u64, infos: Vec<Vec<u8>>) -> Result<Vec<u8>, SinkError> {
        if self.inner.cfg.key.is_some() {
            let mut all = ChangeInfo::default();
            for info in &infos {
                let one: ChangeInfo = serde_json::from_slice(info)
                    .map_err(|e| error::fatal(format!("chaos: a change info is not valid: {e}")))?;
                all.rows += one.rows;
                all.changes.extend(one.changes);
                all.plain.extend(one.plain);
            }
            self.inner.journal.borrow_mut().note(format!("combine {c} infos={} rows={}", infos.len(), all.rows))?;
            return serde_json::to_vec(&all).map_err(|e| error::fatal(e.to_string()));
        }
        let rows: u64 = infos.iter().filter_map(|i| String::from_utf8_lossy(i).parse::<u64>().ok()).sum();
        self.inner.journal.borrow_mut().note(format!("combine {c} infos={} rows={rows}", infos.len()))?;
        Ok(format!("{rows}").into_bytes())
    }

    fn commit(&self, c: u64, combined: Vec<u8>) -> Result<CommitOutcome, SinkError> {
        let inner = &self.inner;
        if let Some(dir) = &inner.cfg.state_dir {
            let record = join(dir, &format!("checkpoints/chk-{c:020}.json"));
            if !files::exists(&record).map_err(|e| files::to_sink_error("state_dir", e))? {
                return Err(error::fatal(format!("commit({c}) called before its record {record} was persisted")));
            }
        }
        inner.cfg.maybe_misbehave("commit")?;
        let changes = match inner.cfg.key {
            Some(_) => Some(
                serde_json::from_slice::<ChangeInfo>(&combined)
                    .map_err(|e| error::fatal(format!("chaos: the combined changes are not valid: {e}")))?,
            ),
            None => None,
        };
        let rows = match &changes {
            Some(info) => info.rows,
            None => String::from_utf8_lossy(&combined).parse::<u64>().unwrap_or(0),
        };
        let mut state = inner.state.borrow_mut();
        // A checkpoint committed before a crash comes again on resume, after
        // a record whose state was taken before its commit: folded once.
        let already = state.checkpoints.contains(&c) || inner.cfg.misbehave_is("already-committed", "commit");
        if !state.checkpoints.contains(&c) {
            state.checkpoints.push(c);
            state.rows += rows;
            let (changes, plain) = match changes {
                Some(info) => (info.changes, info.plain),
                None => (Vec::new(), Vec::new()),
            };
            for (table, row) in plain {
                state.appended.entry(table).or_default().push(row);
            }
            for change in changes {
                state.log.push((change.table.clone(), change.key.clone(), change.op, change.hi, change.lo));
                let table = state.landed.entry(change.table.clone()).or_default();
                if change.op == sluice_guest_sdk::changes::DELETE {
                    table.remove(&change.key);
                } else {
                    table.insert(change.key.clone(), change);
                }
            }
        }
        drop(state);
        inner.journal.borrow_mut().note(format!("commit {c} rows={rows}"))?;
        Ok(if already { CommitOutcome::AlreadyCommitted } else { CommitOutcome::Committed })
    }

    fn abort(&self, c: u64, _combined: Vec<u8>) -> Result<(), SinkError> {
        self.inner.journal.borrow_mut().note(format!("abort {c}"))
    }

    fn evolve(&self, changes: Vec<TableChange>) -> Result<(), SinkError> {
        self.inner.journal.borrow_mut().note(format!("evolve {}", changes_text(&changes)))?;
        if self.inner.cfg.key.is_none() {
            return Ok(());
        }
        let tables: Vec<Table> = changes.into_iter().map(|c| c.table).collect();
        self.inner.journal.borrow_mut().note(format!("tables {}", tables_text(&tables)))
    }
}

sluice_guest_sdk::export_plugin!(Chaos, keeps_state);
