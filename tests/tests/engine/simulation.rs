//! The simulation (#38, point 6): seeded faults at every I/O boundary, in
//! the manner of TigerBeetle's VOPR and FoundationDB's simulation.
//!
//! Each seed chooses, by a small PRNG of its own: the sink (Iceberg on a
//! local warehouse with the SQLite catalog, or the files sink), the
//! parallelism, a small generator source, the rates of the seeded faults
//! under the state directory and under every plugin `file-io` operation
//! ([`Sim`]: fail before, reply lost, stale listing), and per run a crash
//! point and catalog commit faults. The job is run in this process, run
//! after run, each failed run resumed by the next, until one succeeds; after
//! a few failing runs the faults are turned off, so the job must finish.
//! Some Iceberg seeds also let a second job write the same table, kill it
//! right after it persisted a checkpoint, and run orphan cleanup as the
//! first job with a zero retention and without protecting the second,
//! before the second resumes (break B of #38).
//!
//! What every seed checks (a failure is a finding, printed with the seed
//! and the command that replays it):
//! - after every run, what a reader sees is whole and exactly once (no id
//!   twice), and no row a reader saw before is gone (nothing committed is
//!   lost);
//! - no snapshot of the Iceberg table names a missing data or delete file,
//!   and a full scan succeeds;
//! - no run ends in a halt, a reused key or a refusal only an operator can
//!   clear (a pending checkpoint whose files are gone);
//! - once the job finishes, every row of each job is visible exactly once,
//!   with the generator's values.
//!
//! Seeds: `SLUICE_SIM_SEED` (the first, default 0) and `SLUICE_SIM_SEEDS`
//! (how many, default [`DEFAULT_SEEDS`]), split over two test functions so
//! that the harness runs them on two threads. The state directory is driven
//! by one thread, so its faults replay exactly; with two writers, their
//! file-io operations interleave as the threads run, so those replay as far
//! as the order does.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::engine::maintain::{MaintainOptions, maintain};
use sluice::engine::memory_state::MemoryDir;
use sluice::engine::{CrashPoint, EngineError, Fault, Faults, RunOptions};
use sluice::fault::{CatalogFaults, CommitFault, Sim};
use sluice_tests::{TestJob, assert_exactly_once_range, host, ids, read_visible};

/// Seeds a plain `cargo test` runs (CI).
const DEFAULT_SEEDS: u64 = 1000;
/// Failing runs with faults before the faults are turned off.
const MAX_FAULTY_RUNS: u32 = 4;
/// The table the Iceberg seeds write.
const TABLE: &str = "db.t";
/// The second writer's ids start here (the first job's are below).
const B_FIRST_ID: u64 = 1_000_000;

/// splitmix64: the stream of numbers a seed's choices are drawn from.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with `percent` in 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
}

/// What one seed chose.
#[derive(Debug, Clone)]
struct Plan {
    seed: u64,
    iceberg: bool,
    parallelism: u32,
    rows: u64,
    every_rows: u64,
    batch_rows: u64,
    /// The Sim's chances per million operations.
    fail_before: u32,
    lose_reply: u32,
    stale: u32,
    /// Failing runs with faults before they are turned off.
    faulty_runs: u32,
    /// A second job on the same table, and orphan cleanup beside it.
    second: Option<Second>,
    /// The state directory is the engine's memory backend (shared by the
    /// seed's runs, behind the same faults) instead of a local folder.
    memory_state: bool,
}

#[derive(Debug, Clone)]
struct Second {
    rows: u64,
    /// B stops dead right after persisting this checkpoint.
    crash_at: u64,
    /// After which of A's runs B is started.
    after_run: u32,
}

impl Plan {
    fn new(seed: u64, rng: &mut Rng) -> Self {
        // The files sink is cheaper; Iceberg is the target of the breaks.
        let iceberg = rng.chance(25);
        let parallelism = if rng.chance(35) { 2 } else { 1 };
        let rows = rng.range(20, 60);
        let every_rows = rng.range(5, 15);
        let batch_rows = rng.range(2, every_rows);
        let second = (iceberg && rng.chance(25)).then(|| Second {
            rows: 20,
            crash_at: rng.range(1, 4),
            after_run: rng.range(1, 2) as u32,
        });
        Self {
            seed,
            iceberg,
            parallelism,
            rows,
            every_rows,
            batch_rows,
            fail_before: rng.range(0, 30_000) as u32,
            lose_reply: rng.range(0, 30_000) as u32,
            stale: rng.range(0, 60_000) as u32,
            faulty_runs: rng.range(1, u64::from(MAX_FAULTY_RUNS)) as u32,
            // Every fourth seed keeps its state in memory (not beside a
            // second writer, whose orphan cleanup reads A's state from disk);
            // decided from the seed, so the other draws stay as they were.
            memory_state: second.is_none() && seed % 4 == 1,
            second,
        }
    }

    /// About how many checkpoints a whole run takes.
    fn checkpoints(&self) -> u64 {
        let per_subtask = self.rows.div_ceil(u64::from(self.parallelism));
        per_subtask.div_ceil(self.every_rows).max(1)
    }

    /// The crash of one faulty run, if it has one.
    fn crash(&self, rng: &mut Rng, run: u32) -> Option<Fault> {
        if !rng.chance(55) {
            return None;
        }
        let point = CrashPoint::ROUND[rng.range(0, 5) as usize];
        // Checkpoint ids go on across runs; a crash past the end never fires.
        let checkpoint = rng.range(1, self.checkpoints() + u64::from(run));
        let subtask = rng.range(0, u64::from(self.parallelism) - 1) as u32;
        Some(Fault { point, checkpoint, subtask })
    }

    /// The catalog faults of one faulty run (Iceberg only).
    fn catalog(&self, rng: &mut Rng) -> CatalogFaults {
        if !self.iceberg || !rng.chance(40) {
            return CatalogFaults::default();
        }
        let kind = match rng.range(0, 2) {
            0 => CommitFault::LoseReply,
            1 => CommitFault::Conflict,
            _ => CommitFault::CrashAfterApply,
        };
        CatalogFaults { faults: vec![(rng.range(1, 4), kind)], ..CatalogFaults::default() }
    }
}

/// A failing seed's account: what went wrong, and how to see it again.
struct Finding {
    what: String,
}

/// How a seed went, for the shard's tallies.
#[derive(Default)]
struct Tally {
    seeds: u64,
    iceberg: u64,
    runs: u64,
    failed_runs: u64,
    faults_fired: u64,
    orphan_passes: u64,
}

/// What a reader of the target sees.
struct Seen {
    /// Every visible id, in no particular order (duplicates kept).
    ids: Vec<i64>,
    /// Files a snapshot names that are not on disk, with the snapshot.
    missing: Vec<String>,
}

fn local_path(location: &str) -> PathBuf {
    PathBuf::from(location.strip_prefix("file://").unwrap_or(location))
}

/// The Iceberg table as a reader sees it: every live file of every
/// snapshot checked on disk, then a full scan of the current one.
fn read_table(warehouse: &Path) -> Result<Seen, String> {
    use futures::TryStreamExt;
    if !warehouse.join("catalog.db").exists() {
        return Ok(Seen { ids: Vec::new(), missing: Vec::new() });
    }
    let catalog = sluice_tests::catalog(warehouse);
    let ident = iceberg::TableIdent::from_strs(TABLE.split('.')).map_err(|e| e.to_string())?;
    let table = match catalog.load(&ident) {
        Ok(t) => t,
        Err(e) if e.to_string().contains("not found") || e.to_string().contains("NotFound") => {
            return Ok(Seen { ids: Vec::new(), missing: Vec::new() });
        }
        Err(e) => return Err(format!("loading {TABLE}: {e}")),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut missing = Vec::new();
        for snapshot in table.metadata().snapshots() {
            let list = table
                .manifest_list_reader(snapshot)
                .load()
                .await
                .map_err(|e| format!("snapshot {}: manifest list: {e}", snapshot.snapshot_id()))?;
            for manifest in list.entries() {
                let manifest = manifest
                    .load_manifest(table.file_io())
                    .await
                    .map_err(|e| format!("snapshot {}: manifest: {e}", snapshot.snapshot_id()))?;
                for entry in manifest.entries() {
                    if !entry.is_alive() {
                        continue;
                    }
                    let path = entry.file_path();
                    if !local_path(path).exists() {
                        missing.push(format!("snapshot {} names {path}", snapshot.snapshot_id()));
                    }
                }
            }
        }
        if !missing.is_empty() {
            return Ok(Seen { ids: Vec::new(), missing });
        }
        let batches: Vec<arrow_array::RecordBatch> = table
            .scan()
            .select(["id"])
            .build()
            .map_err(|e| format!("scan: {e}"))?
            .to_arrow()
            .await
            .map_err(|e| format!("full scan: {e}"))?
            .try_collect()
            .await
            .map_err(|e| format!("full scan: {e}"))?;
        Ok(Seen { ids: batches.iter().flat_map(ids).collect(), missing })
    })
}

/// What the files sink shows readers.
fn read_files(out: &Path) -> Result<Seen, String> {
    std::panic::catch_unwind(|| read_visible(out))
        .map(|batch| Seen { ids: ids(&batch), missing: Vec::new() })
        .map_err(|_| format!("reading the visible files under {} failed", out.display()))
}

/// One seed's world: the jobs, the faults, and what was seen so far.
struct World {
    plan: Plan,
    rng: Rng,
    sim: Arc<Sim>,
    _root: tempfile::TempDir,
    warehouse: PathBuf,
    a: TestJob,
    /// The state directory of a memory seed.
    memory: Option<MemoryDir>,
    /// Ids a reader has seen: they must stay visible.
    seen: BTreeSet<i64>,
    log: Vec<String>,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed ^ 0x5eed_51a1_ce00_0038);
        let plan = Plan::new(seed, &mut rng);
        Self::with_plan(plan, rng)
    }

    fn with_plan(plan: Plan, rng: Rng) -> Self {
        let seed = plan.seed;
        let sim = Arc::new(Sim::new(seed, plan.fail_before, plan.lose_reply, plan.stale));
        let root = tempfile::tempdir().expect("temp dir");
        let warehouse = root.path().join("warehouse");
        std::fs::create_dir_all(&warehouse).expect("warehouse");
        let id = format!("sim-a-{seed}");
        let a = if plan.iceberg {
            TestJob::iceberg(&id, &warehouse, TABLE, plan.rows, 0, plan.parallelism, plan.every_rows)
        } else {
            TestJob::files(&id, plan.rows, plan.parallelism, plan.every_rows)
        };
        let memory = plan.memory_state.then(|| MemoryDir::new(&id));
        Self { plan, rng, sim, _root: root, warehouse, a, memory, seen: BTreeSet::new(), log: Vec::new() }
    }

    fn sets(&self) -> Vec<String> {
        vec![format!("source.batch_rows={}", self.plan.batch_rows)]
    }

    fn finding(&self, what: impl Into<String>) -> Finding {
        let seed = self.plan.seed;
        Finding {
            what: format!(
                "seed {seed}: {}\n  plan: {:?}\n  runs:\n    {}\n  faults fired: {:?}\n  replay: SLUICE_SIM_SEED={seed} \
                 SLUICE_SIM_SEEDS=1 cargo test -p sluice-tests --test engine simulation:: -- --nocapture",
                what.into(),
                self.plan,
                self.log.join("\n    "),
                self.sim.fired()
            ),
        }
    }

    /// What a reader sees now: whole, exactly once, nothing seen before gone.
    fn check_visible(&mut self, after: &str) -> Result<(), Finding> {
        let seen = if self.plan.iceberg { read_table(&self.warehouse) } else { read_files(&self.a.out()) };
        let seen = seen.map_err(|e| self.finding(format!("after {after}, a reader fails: {e}")))?;
        if !seen.missing.is_empty() {
            return Err(self.finding(format!("after {after}, the table names missing files: {:?}", seen.missing)));
        }
        let mut now = BTreeSet::new();
        let mut twice = Vec::new();
        for id in &seen.ids {
            if !now.insert(*id) {
                twice.push(*id);
            }
        }
        if !twice.is_empty() {
            return Err(self.finding(format!("after {after}, ids visible twice: {twice:?}")));
        }
        let lost: Vec<i64> = self.seen.difference(&now).copied().take(20).collect();
        if !lost.is_empty() {
            return Err(
                self.finding(format!("after {after}, ids seen before are gone (committed rows lost): {lost:?}"))
            );
        }
        self.seen = now;
        Ok(())
    }

    /// An error a real operator would have to act on: a halt, a reused
    /// key, a plugin's fatal answer (a pending checkpoint refused because
    /// its files are gone, for one), a record to restore from a backup.
    fn needs_an_operator(e: &EngineError) -> bool {
        let text = e.to_string();
        matches!(e, EngineError::Halted { .. } | EngineError::KeyReused { .. })
            || text.contains("failed (fatal)")
            || text.contains("--drop-pending")
            || text.contains("from a backup")
    }

    /// Runs job A until a run succeeds; B's scenario after its chosen run.
    fn drive(&mut self, tally: &mut Tally) -> Result<(), Finding> {
        let mut run = 0;
        let mut failures = 0;
        let mut second_done = self.plan.second.is_none();
        loop {
            run += 1;
            let faulty = failures < self.plan.faulty_runs;
            self.sim.set_enabled(faulty);
            let (crash, catalog) = if faulty {
                (self.plan.crash(&mut self.rng, run), self.plan.catalog(&mut self.rng))
            } else {
                (None, CatalogFaults::default())
            };
            let faults = Faults { sim: Some(self.sim.clone()), crash, catalog: catalog.clone() };
            let sets = self.sets();
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let started = Instant::now();
            let opts = RunOptions { faults, memory_state: self.memory.clone(), ..RunOptions::default() };
            let result = self.a.run_opts(&sets, opts);
            tally.runs += 1;
            let what = match &result {
                Ok(s) => format!("ok, resumed from {:?}, recovered {:?}", s.resumed_from, s.recovered),
                Err(e) => format!("failed: {e}"),
            };
            self.log.push(format!(
                "run {run} ({}; crash {:?}; catalog {:?}; {} ms): {what}",
                if faulty { "faults on" } else { "faults off" },
                crash.map(|f| format!("{} c{} s{}", f.point, f.checkpoint, f.subtask)),
                catalog.faults,
                started.elapsed().as_millis()
            ));
            self.check_visible(&format!("run {run}"))?;
            let done = match result {
                Ok(_) => true,
                Err(e) => {
                    tally.failed_runs += 1;
                    if Self::needs_an_operator(&e) {
                        return Err(self.finding(format!("run {run} ended in a halt or refusal: {e}")));
                    }
                    if !faulty {
                        return Err(self.finding(format!("run {run}, without faults, failed: {e}")));
                    }
                    failures += 1;
                    false
                }
            };
            if !second_done && (done || self.plan.second.as_ref().is_some_and(|s| s.after_run <= run)) {
                second_done = true;
                self.second_writer(tally)?;
            }
            if done {
                return self.check_end();
            }
        }
    }

    /// Job B writes the same table and dies right after persisting a
    /// checkpoint; orphan cleanup runs as A (zero retention, B not
    /// protected); then B resumes and finishes.
    fn second_writer(&mut self, tally: &mut Tally) -> Result<(), Finding> {
        let Some(second) = self.plan.second.clone() else { return Ok(()) };
        self.sim.set_enabled(false);
        let b = TestJob::iceberg(
            &format!("sim-b-{}", self.plan.seed),
            &self.warehouse,
            TABLE,
            second.rows,
            B_FIRST_ID,
            1,
            5,
        );
        let sets = ["source.batch_rows=5"];
        let crash = Fault { point: CrashPoint::AfterPersist, checkpoint: second.crash_at, subtask: 0 };
        let killed = b.run_opts(
            &sets,
            RunOptions { faults: Faults { crash: Some(crash), ..Faults::default() }, ..RunOptions::default() },
        );
        self.log.push(format!(
            "B: killed after persisting checkpoint {}: {:?}",
            second.crash_at,
            killed.as_ref().err().map(ToString::to_string)
        ));
        match killed {
            Err(e) if e.is_injected_crash() => {}
            other => {
                return Err(self.finding(format!(
                    "B was to stop after persisting checkpoint {}, but: {:?}",
                    second.crash_at,
                    other.map(|s| s.to_string())
                )));
            }
        }
        let loaded = self.a.load(&self.sets().iter().map(String::as_str).collect::<Vec<_>>());
        let loaded = loaded.map_err(|e| self.finding(format!("loading A for maintenance: {e}")))?;
        let opts = MaintainOptions {
            compact: false,
            remove_orphans_older_than: Some(Duration::ZERO),
            timeout: Duration::from_secs(600),
            ..MaintainOptions::default()
        };
        let report = maintain(&loaded, host(), &opts);
        tally.orphan_passes += 1;
        self.log.push(format!(
            "orphan cleanup as A, B not protected: {}",
            match &report {
                Ok(r) => r.to_string().replace('\n', " | "),
                Err(e) => format!("refused: {e}"),
            }
        ));
        self.check_visible("orphan cleanup")?;
        let resumed = b.run_opts(&sets, RunOptions::default());
        self.log.push(format!(
            "B resumed: {:?}",
            resumed.as_ref().map(|s| s.recovered.clone()).map_err(ToString::to_string)
        ));
        if let Err(e) = resumed {
            return Err(self.finding(format!("B, resumed without faults, failed: {e}")));
        }
        self.check_visible("B resumed")?;
        let b_ids: Vec<i64> = self.seen.iter().copied().filter(|i| *i >= B_FIRST_ID as i64).collect();
        let expected: Vec<i64> = (B_FIRST_ID as i64..(B_FIRST_ID + second.rows) as i64).collect();
        if b_ids != expected {
            return Err(self.finding(format!("B's rows are not each once: {b_ids:?}")));
        }
        Ok(())
    }

    /// The job finished: every row of A once, with the generator's values.
    fn check_end(&mut self) -> Result<(), Finding> {
        if let Some(memory) = &self.memory {
            // The runs kept their state in memory, not in the job's folder.
            if self.a.state().exists() || memory.records().is_empty() {
                return Err(self.finding(format!(
                    "a memory seed's state went elsewhere: {} exists: {}, records in memory: {:?}",
                    self.a.state().display(),
                    self.a.state().exists(),
                    memory.records()
                )));
            }
        }
        let a_ids: Vec<i64> = self.seen.iter().copied().filter(|i| *i < B_FIRST_ID as i64).collect();
        let expected: Vec<i64> = (0..self.plan.rows as i64).collect();
        if a_ids != expected {
            let lost: Vec<i64> = expected.iter().filter(|i| !self.seen.contains(i)).copied().collect();
            return Err(self.finding(format!("the job finished, but lost ids {lost:?} (visible: {a_ids:?})")));
        }
        // Values too (a panic here is caught by `simulate` as a finding).
        let visible = if self.plan.iceberg {
            let rows = sluice_tests::read_iceberg(&self.warehouse, TABLE).rows;
            let of_a: arrow_array::BooleanArray = ids(&rows).iter().map(|i| Some(*i < B_FIRST_ID as i64)).collect();
            arrow_select::filter::filter_record_batch(&rows, &of_a).expect("filter")
        } else {
            read_visible(&self.a.out())
        };
        assert_exactly_once_range(&visible, 0, self.plan.rows);
        Ok(())
    }
}

/// Runs one seed; a finding if it breaks an invariant (or panics).
fn simulate(seed: u64, tally: &mut Tally) -> Result<(), String> {
    let mut world = World::new(seed);
    tally.seeds += 1;
    tally.iceberg += u64::from(world.plan.iceberg);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut local = Tally::default();
        let r = world.drive(&mut local).map_err(|f| f.what);
        (r, local)
    }));
    tally.faults_fired += world.sim.fired().len() as u64;
    if std::env::var_os("SLUICE_SIM_VERBOSE").is_some() {
        eprintln!("seed {seed}: {:?}\n    {}", world.plan, world.log.join("\n    "));
    }
    match outcome {
        Ok((r, local)) => {
            tally.runs += local.runs;
            tally.failed_runs += local.failed_runs;
            tally.orphan_passes += local.orphan_passes;
            r
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(world.finding(format!("panicked: {message}")).what)
        }
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a whole number")),
        Err(_) => default,
    }
}

/// The seeds of shard `shard` of two: every other seed of the range.
fn shard(shard: u64) {
    let first = env_u64("SLUICE_SIM_SEED", 0);
    let count = env_u64("SLUICE_SIM_SEEDS", DEFAULT_SEEDS);
    let started = Instant::now();
    let mut tally = Tally::default();
    let mut findings = Vec::new();
    for i in (shard..count).step_by(2) {
        let seed = first + i;
        if let Err(f) = simulate(seed, &mut tally) {
            eprintln!("FINDING {f}");
            findings.push(f);
        }
    }
    eprintln!(
        "simulation shard {shard}: {} seeds ({} Iceberg), {} runs ({} failed), {} faults fired, {} orphan passes \
         beside a killed job, {} findings, in {:.1} s",
        tally.seeds,
        tally.iceberg,
        tally.runs,
        tally.failed_runs,
        tally.faults_fired,
        tally.orphan_passes,
        findings.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(findings.is_empty(), "{} seed(s) broke an invariant:\n\n{}", findings.len(), findings.join("\n\n"));
    // The simulation is no check unless it injects faults and fails runs.
    if tally.seeds >= 100 {
        assert!(tally.faults_fired > tally.seeds, "too few faults fired: {}", tally.faults_fired);
        assert!(tally.failed_runs > tally.seeds / 4, "too few runs failed: {}", tally.failed_runs);
        assert!(tally.orphan_passes > 0, "no seed ran orphan cleanup beside a killed job");
    }
}

#[test]
fn simulation_even_seeds() {
    shard(0);
}

#[test]
fn simulation_odd_seeds() {
    shard(1);
}

/// The checks themselves see what they look for: a data file a snapshot
/// names, removed, is reported missing; a visible checkpoint of the files
/// sink, removed, is reported as rows lost.
#[test]
fn the_checks_see_a_missing_file_and_lost_rows() {
    for iceberg in [true, false] {
        let plan = Plan {
            seed: u64::MAX,
            iceberg,
            parallelism: 1,
            rows: 20,
            every_rows: 5,
            batch_rows: 5,
            fail_before: 0,
            lose_reply: 0,
            stale: 0,
            faulty_runs: 0,
            second: None,
            memory_state: false,
        };
        let mut world = World::with_plan(plan, Rng(1));
        let mut tally = Tally::default();
        if let Err(f) = world.drive(&mut tally) {
            panic!("{}", f.what);
        }
        let (dir, what) = if iceberg {
            (world.warehouse.join("db/t/data"), "the table names missing files")
        } else {
            (world.a.out(), "ids seen before are gone")
        };
        let mut entries: Vec<PathBuf> = std::fs::read_dir(&dir).expect("listing").flatten().map(|e| e.path()).collect();
        entries.sort();
        let victim = entries.iter().find(|p| if iceberg { p.is_file() } else { p.is_dir() }).expect("a file");
        if iceberg {
            std::fs::remove_file(victim).expect("removing a data file");
        } else {
            std::fs::remove_dir_all(victim).expect("removing a checkpoint");
        }
        let found = world.check_visible("the removal").err().map(|f| f.what).unwrap_or_default();
        assert!(found.contains(what), "iceberg={iceberg}: the removal of {} went unseen: {found:?}", victim.display());
    }
}
