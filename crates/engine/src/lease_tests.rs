//! The object-store state directory's lease, in-process: [`ObjectState`]
//! over a bucket in memory with real conditional writes and injected
//! faults, on a simulated clock (`crate::objects_memory`). No background
//! renewer thread runs here: a test renews by hand ([`ObjectState::tick`],
//! what that thread does every third of the lease), or from the clock's
//! sleep hook, so that every run's events are in the test's order.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_core::error::{ErrorKind, Kind};

use super::*;
use crate::objects_memory::{Fault, MemBucket, MemObjects, Op, Seeded, SimClock};

const LEASE: Duration = Duration::from_secs(30);
const PREFIX: &str = "state/j";
const LEASE_KEY_OF_J: &str = "state/j/lease";

impl ObjectState {
    /// What the background renewer does each third of the lease: one
    /// renewal, unless a renewal of this run is under way (that thread
    /// would wait for it). `None` when nothing is held, or one is under way.
    fn tick(&self) -> Option<Result<(), CheckpointError>> {
        let held = self.held.as_ref()?;
        drop(held.state.try_lock().ok()?);
        Some(renew(held, self.store.as_ref()))
    }

    fn epoch(&self) -> Option<u64> {
        self.held.as_ref().map(|h| h.epoch)
    }

    fn holder(&self) -> String {
        self.held.as_ref().map(|h| h.holder.clone()).unwrap_or_default()
    }

    fn is_lost(&self) -> bool {
        self.held.as_ref().is_some_and(|h| lost(h))
    }
}

fn open_as(objects: MemObjects, clock: &SimClock, lease: Option<Duration>) -> Result<ObjectState, CheckpointError> {
    let url = objects.url(PREFIX);
    ObjectState::open_on(Arc::new(objects), Arc::new(clock.clone()), url, PREFIX, lease, false)
}

/// Run `actor` taking the lease of the bucket's state directory.
fn open(bucket: &MemBucket, actor: &str, clock: &SimClock) -> Result<ObjectState, CheckpointError> {
    open_as(bucket.client(actor, clock), clock, Some(LEASE))
}

/// A read-only view (as `sluice state`), without faults of its own.
fn view(bucket: &MemBucket) -> ObjectState {
    let clock = SimClock::new();
    open_as(bucket.client("view", &clock), &clock, None).expect("a view opens")
}

/// The lease object as stored, and its version.
fn lease_doc(bucket: &MemBucket) -> (LeaseDoc, u64) {
    let (bytes, version) = bucket.get(LEASE_KEY_OF_J).expect("a lease object");
    (serde_json::from_slice(&bytes).expect("a lease document"), version)
}

/// The newest record of every checkpoint the state holds, as a view reads it.
fn records(bucket: &MemBucket) -> BTreeMap<u64, Vec<u8>> {
    let view = view(bucket);
    view.ids().expect("listed").into_iter().map(|c| (c, view.read_record(c).expect("read").1)).collect()
}

/// The keys `actor` created or replaced (never a delete), lease aside.
fn written_by(bucket: &MemBucket, actor: &str) -> BTreeSet<String> {
    bucket
        .log()
        .into_iter()
        .filter(|e| e.actor == actor && e.applied && matches!(e.op, Op::CreateExclusive | Op::ReplaceIf))
        .map(|e| e.key)
        .filter(|k| k != LEASE_KEY_OF_J)
        .collect()
}

fn assert_lease_lost(err: &CheckpointError, reason: &str) {
    assert!(matches!(err, CheckpointError::LeaseLost { .. }), "{err}");
    assert_eq!(err.kind(), ErrorKind::Conflict, "{err}");
    assert!(!err.outcome_unknown(), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("mem://bucket/state/j: this run no longer holds its lease"), "{msg}");
    assert!(msg.contains(reason), "{msg}");
}

#[test]
fn a_lease_is_taken_on_an_empty_state_directory() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    assert_eq!(a.epoch(), Some(1));
    let (doc, _) = lease_doc(&bucket);
    assert_eq!(doc.holder, a.holder());
    assert!(doc.holder.starts_with(&format!("pid {} on ", std::process::id())), "{}", doc.holder);
    assert_eq!((doc.epoch, doc.current, doc.lease_ms), (1, Some(1), 30_000));
    assert_eq!(doc.expires_at_ms, clock.now_ms() + 30_000);
    // Taken without waiting; the (empty) state moved into epoch 1, marked whole.
    assert_eq!(clock.elapsed(), Duration::ZERO);
    assert_eq!(bucket.keys(), ["state/j/epoch-000001/copied", "state/j/lease"]);

    a.check_held().unwrap();
    let path = a.write_record(1, b"record 1".to_vec()).unwrap();
    assert_eq!(path, PathBuf::from(format!("mem://bucket/state/j/epoch-000001/checkpoints/chk-{:020}-000000.json", 1)));
    assert_eq!(records(&bucket), BTreeMap::from([(1, b"record 1".to_vec())]));

    // A run that ends releases its lease (expired at once, current kept):
    // the next takes it at once, in the next epoch, with the state.
    drop(a);
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.expires_at_ms, doc.epoch, doc.current), (0, 1, Some(1)));
    let b = open(&bucket, "b", &clock).unwrap();
    assert_eq!(b.epoch(), Some(2));
    assert_eq!(clock.elapsed(), Duration::ZERO);
    assert_eq!(b.read_record(1).unwrap().1, b"record 1");
    assert_eq!(lease_doc(&bucket).0.current, Some(2));
}

#[test]
fn a_second_run_is_refused_while_the_lease_is_renewed() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = Arc::new(open(&bucket, "a", &clock).unwrap());
    // A's renewer: every third of the lease, while B waits.
    let renewing = a.clone();
    let ticks = clock.clone();
    let mut next = LEASE / 3;
    clock.on_sleep(move || {
        if ticks.elapsed() >= next {
            next += LEASE / 3;
            assert!(matches!(renewing.tick(), Some(Ok(()))));
        }
    });
    let err = open(&bucket, "b", &clock).unwrap_err();
    clock.no_hook();
    assert!(matches!(err, CheckpointError::Leased { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("mem://bucket/state/j is in use by another sluice run of this job: {}", a.holder())));
    assert!(msg.contains("renewed while this run waited"), "{msg}");
    // Refused at the first renewal it saw, well within the lease.
    assert!(clock.elapsed() >= LEASE / 3 && clock.elapsed() < LEASE / 2, "{:?}", clock.elapsed());
    // B changed nothing; A still holds, in its epoch, and may write.
    assert!(bucket.log().iter().all(|e| e.actor != "b" || !e.applied), "{:?}", bucket.log());
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.holder, doc.epoch), (a.holder(), 1));
    a.check_held().unwrap();
    a.write_record(1, b"a".to_vec()).unwrap();
}

#[test]
fn a_lease_left_unrenewed_is_taken_over_in_a_new_epoch_and_its_holder_fenced() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    for c in 1..=2 {
        a.check_held().unwrap();
        a.write_record(c, format!("a {c}").into_bytes()).unwrap();
    }
    // A stops renewing (killed, or frozen with a clock that counts it).
    let b = open(&bucket, "b", &clock).unwrap();
    assert!(clock.elapsed() >= LEASE, "B waited out a whole lease: {:?}", clock.elapsed());
    assert_eq!(b.epoch(), Some(2));
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.holder.as_str(), doc.epoch, doc.current), (b.holder().as_str(), 2, Some(2)));
    // The state moved, whole, into B's epoch; A's records are B's now.
    let state = records(&bucket);
    assert_eq!(state, BTreeMap::from([(1, b"a 1".to_vec()), (2, b"a 2".to_vec())]));
    assert!(bucket.get("state/j/epoch-000002/copied").is_some());

    // A's next check before a write or a commit is fenced: resumable, and
    // it changes nothing.
    let keys = bucket.keys();
    let err = a.check_held().unwrap_err();
    assert_lease_lost(&err, "longer than the lease");
    assert!(a.is_lost());
    assert_eq!(bucket.keys(), keys);
    let err = a.check_held().unwrap_err();
    assert_lease_lost(&err, "longer than the lease");
    // Lost, A never releases B's lease on its way out.
    drop(a);
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.holder.as_str(), doc.epoch), (b.holder().as_str(), 2));
    assert_ne!(doc.expires_at_ms, 0);
    b.check_held().unwrap();
    assert_eq!(records(&bucket), state);
}

#[test]
fn a_frozen_holder_waking_after_a_takeover_writes_nothing_under_the_new_epoch() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let clock_a = clock.process();
    let a = open(&bucket, "a", &clock_a).unwrap();
    a.check_held().unwrap();
    a.write_record(1, b"a 1".to_vec()).unwrap();
    // A passed its check before the write of checkpoint 2, and froze there,
    // its clock not counting the freeze (a suspended VM).
    a.check_held().unwrap();
    clock_a.stop_counting();
    let b = open(&bucket, "b", &clock).unwrap();
    assert!(clock.elapsed() >= LEASE);
    assert_eq!(b.epoch(), Some(2));
    b.check_held().unwrap();
    b.write_record(2, b"b 2".to_vec()).unwrap();
    let state = records(&bucket);
    assert_eq!(state, BTreeMap::from([(1, b"a 1".to_vec()), (2, b"b 2".to_vec())]));

    clock_a.count_again();
    assert_eq!(clock_a.elapsed(), Duration::ZERO);
    // A wakes and writes what it was about to: into its own epoch's folder,
    // which nobody reads any more; then prunes, there too.
    a.write_record(2, b"a 2".to_vec()).unwrap();
    a.write_record(3, b"a 3".to_vec()).unwrap();
    a.delete_record(1);
    // Its next check fails on B's compare-and-swap, though its own clock
    // says the lease is fresh.
    let err = a.check_held().unwrap_err();
    assert_lease_lost(&err, &format!("{} holds it now", b.holder()));
    assert_eq!(records(&bucket), state);
    assert!(written_by(&bucket, "a").iter().all(|k| k.starts_with("state/j/epoch-000001/")), "{:?}", bucket.log());
    assert!(written_by(&bucket, "a").contains(&format!("state/j/epoch-000001/checkpoints/chk-{:020}-000000.json", 3)));
    assert!(bucket.log().iter().all(|e| e.actor != "a" || !e.key.starts_with("state/j/epoch-000002")));
    drop(a);
    assert_eq!(lease_doc(&bucket).0.holder, b.holder());
}

#[test]
fn a_renewal_whose_reply_was_lost_keeps_the_lease() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    let (_, before) = lease_doc(&bucket);
    clock.advance(LEASE / 3);
    bucket.script(Op::ReplaceIf, "lease", Fault::LoseReply);
    // The check renews (stored, reply lost), tries again, finds its own
    // lease under the version it never heard of, adopts it and renews.
    a.check_held().unwrap();
    assert_eq!(bucket.scripted_left(), 0);
    let (doc, after) = lease_doc(&bucket);
    assert_eq!((doc.holder, doc.epoch), (a.holder(), 1));
    assert!(after > before + 1, "renewed twice: {before} -> {after}");
    assert!(!a.is_lost());
    // The background renewer likewise: its lost reply fails that one tick,
    // and the next adopts.
    bucket.script(Op::ReplaceIf, "lease", Fault::LoseReply);
    clock.advance(LEASE / 3);
    assert!(matches!(a.tick(), Some(Err(_))));
    assert!(!a.is_lost());
    clock.advance(LEASE / 3);
    assert!(matches!(a.tick(), Some(Ok(()))));
    a.check_held().unwrap();
    a.write_record(1, b"a 1".to_vec()).unwrap();
    // A lost reply to the adopting renewal too: the check tries again.
    bucket.script(Op::ReplaceIf, "lease", Fault::LoseReply);
    bucket.script(Op::ReplaceIf, "lease", Fault::LoseReply);
    a.check_held().unwrap();
    assert_eq!(lease_doc(&bucket).0.holder, a.holder());
}

#[test]
fn a_renewal_failing_transiently_is_retried_and_never_let_pass_past_two_thirds_of_the_lease() {
    let poll = Duration::from_millis(500);
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    // Three refusals: tried again each poll, then confirmed.
    clock.advance(LEASE / 3);
    for _ in 0..3 {
        bucket.script(Op::ReplaceIf, "lease", Fault::Refuse);
    }
    a.check_held().unwrap();
    assert_eq!(clock.elapsed(), LEASE / 3 + 3 * poll);
    let renewed_at = clock.elapsed();

    // Refused every time: the check fails once two thirds of the lease
    // since the last confirmed renewal would pass, and never passes.
    for _ in 0..1_000 {
        bucket.script(Op::ReplaceIf, "lease", Fault::Refuse);
    }
    let err = a.check_held().unwrap_err();
    assert_lease_lost(&err, "it could not be renewed in time");
    assert!(err.to_string().contains("simulated fault: ReplaceIf refused before it was sent"), "{err}");
    let waited = clock.elapsed() - renewed_at;
    assert!(waited < LEASE * 2 / 3 && waited + poll >= LEASE * 2 / 3, "{waited:?}");

    // Each renewal stored with its reply lost (the lease kept fresh, never
    // confirmed) fails the same way: an unknown outcome is no confirmation.
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    for _ in 0..1_000 {
        bucket.script(Op::ReplaceIf, "lease", Fault::LoseReply);
    }
    let err = a.check_held().unwrap_err();
    assert_lease_lost(&err, "it could not be renewed in time");
    assert!(clock.elapsed() < LEASE * 2 / 3, "{:?}", clock.elapsed());
    assert_eq!(lease_doc(&bucket).0.holder, a.holder());

    // The swap of `current` after a takeover is such a renewal: refused
    // until two thirds of the lease, the takeover fails, the old folder
    // stays current and whole, and the next run takes the state from it.
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    a.write_record(1, b"a 1".to_vec()).unwrap();
    drop(a);
    // B's take is a swap, then the copy, then the swap of `current`.
    bucket.script(Op::ReplaceIf, "lease", Fault::Refuse);
    let err = open(&bucket, "b", &clock).unwrap_err();
    assert!(err.to_string().contains("simulated fault"), "{err}");
    let taken = clock.elapsed();
    bucket.script(Op::ReplaceIf, "lease", Fault::Slow(Duration::ZERO));
    for _ in 0..1_000 {
        bucket.script(Op::ReplaceIf, "lease", Fault::Refuse);
    }
    let err = open(&bucket, "c", &clock).unwrap_err();
    assert_lease_lost(&err, "it could not be made to name this run's state in time");
    assert!(clock.elapsed() - taken < LEASE * 2 / 3);
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.epoch, doc.current), (2, Some(1)));
    assert_eq!(records(&bucket), BTreeMap::from([(1, b"a 1".to_vec())]));
}

#[test]
fn a_renewal_answered_later_than_the_lease_does_not_pass_the_check() {
    let bucket = MemBucket::new("bucket");
    let clock = SimClock::new();
    let a = open(&bucket, "a", &clock).unwrap();
    a.write_record(1, b"a 1".to_vec()).unwrap();
    // A's renewal is stored at once, but A hears of it only after a whole
    // lease and more (frozen right after sending it, its clock counting
    // the freeze). Meanwhile B watched the lease unrenewed and took over.
    clock.advance(LEASE / 3);
    bucket.script(Op::ReplaceIf, "lease", Fault::Slow(LEASE + LEASE / 3));
    let took_over = Arc::new(Mutex::new(None));
    let (slot, b_bucket, b_clock) = (took_over.clone(), bucket.clone(), clock.clone());
    let once = AtomicBool::new(false);
    clock.on_sleep(move || {
        if !once.swap(true, Ordering::SeqCst) {
            *slot.lock().unwrap() = Some(open(&b_bucket, "b", &b_clock).unwrap());
        }
    });
    let checked = a.check_held();
    clock.no_hook();
    let b = took_over.lock().unwrap().take().expect("B took over during A's renewal");
    let (doc, _) = lease_doc(&bucket);
    assert_eq!((doc.holder.as_str(), doc.epoch), (b.holder().as_str(), 2));
    // The check cannot have come before the takeover: it fails, resumable.
    let err = checked.unwrap_err();
    assert_lease_lost(&err, "longer than the lease");
    assert!(a.check_held().is_err());
    b.check_held().unwrap();
}

/// Every confirmation of a lease in a simulation (a take, a check, a
/// background renewal): when, by whom, in which epoch.
type Passes = Arc<Mutex<Vec<(Duration, String, u64)>>>;

/// Records that `run` just had its lease confirmed, after checking that
/// at this moment the lease names it, and that no newer epoch was
/// confirmed before: at most one run holds the lease at any moment.
fn confirmed(bucket: &MemBucket, passes: &Passes, seed: u64, run: &str, state: &ObjectState, at: Duration) {
    let epoch = state.epoch().expect("held");
    let (doc, _) = lease_doc(bucket);
    assert_eq!(
        (doc.holder.as_str(), doc.epoch),
        (state.holder().as_str(), epoch),
        "seed {seed} at {at:?}: {run} had its lease confirmed while the lease names another"
    );
    let mut passes = passes.lock().unwrap();
    if let Some((when, by, newest)) = passes.iter().max_by_key(|p| p.2) {
        assert!(
            epoch >= *newest,
            "seed {seed} at {at:?}: {run} (epoch {epoch}) passed after {by} (epoch {newest}) at {when:?}"
        );
    }
    passes.push((at, run.to_string(), epoch));
}

/// One run of the seeded simulation.
struct Run {
    name: String,
    state: ObjectState,
    /// When its background renewer renews next, by the simulated clock.
    next_tick: Mutex<Duration>,
    /// Paused: neither it nor its renewer does anything.
    frozen: AtomicBool,
    /// Its own clock (which may not count a pause).
    clock: SimClock,
}

#[test]
fn mixed_faults_never_let_two_runs_pass_a_check_at_once() {
    // Over all seeds: checks passed, checks refused (fenced: by another
    // run's lease), runs that took the lease.
    let (mut passed, mut refused, mut took, mut fenced) = (0, 0, 0, 0);
    for seed in 0..64u64 {
        let bucket = MemBucket::new("bucket");
        let clock = SimClock::new();
        bucket.seed(Some(Seeded { seed, refuse: 40_000, lose_reply: 40_000, slow: 40_000, max_slow: LEASE / 2 }));
        let runs: Arc<Mutex<Vec<Arc<Run>>>> = Arc::default();
        let passes: Passes = Arc::default();
        let ticking = runs.clone();
        let ticks = clock.clone();
        let (renewals, ticked) = (passes.clone(), bucket.clone());
        clock.on_sleep(move || {
            let now = ticks.elapsed();
            let live: Vec<Arc<Run>> = ticking.lock().unwrap().clone();
            for run in live.iter().filter(|r| !r.frozen.load(Ordering::SeqCst)) {
                let mut next = run.next_tick.lock().unwrap();
                if now >= *next {
                    *next = now + LEASE / 3;
                    drop(next);
                    if let Some(Ok(())) = run.state.tick() {
                        confirmed(&ticked, &renewals, seed, &run.name, &run.state, now);
                    }
                }
            }
        });
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut roll = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut opened = 0;
        for step in 0..80 {
            let live: Vec<Arc<Run>> = runs.lock().unwrap().clone();
            let pick = |i: u64| live.get(i as usize % live.len().max(1)).cloned();
            match roll(6) {
                0 if live.len() < 2 => {
                    opened += 1;
                    let name = format!("r{opened}");
                    let own = clock.process();
                    if let Ok(state) = open(&bucket, &name, &own) {
                        took += 1;
                        confirmed(&bucket, &passes, seed, &name, &state, clock.elapsed());
                        let next_tick = Mutex::new(clock.elapsed() + LEASE / 3);
                        runs.lock().unwrap().push(Arc::new(Run {
                            name,
                            state,
                            next_tick,
                            frozen: AtomicBool::new(false),
                            clock: own,
                        }));
                    }
                }
                1 | 2 => {
                    let Some(run) = pick(roll(8)) else { continue };
                    if run.frozen.load(Ordering::SeqCst) {
                        continue;
                    }
                    if let Err(e) = run.state.check_held() {
                        refused += 1;
                        // Fenced by another run's lease (not by its age).
                        if e.to_string().contains("holds it now") {
                            fenced += 1;
                        }
                    } else {
                        passed += 1;
                        confirmed(&bucket, &passes, seed, &run.name, &run.state, clock.elapsed());
                        let _ = run.state.write_record(step, format!("{} {step}", run.name).into_bytes());
                    }
                }
                3 => {
                    // A pause, which its clock counts or not (a suspended VM).
                    if let Some(run) = pick(roll(8)) {
                        if run.frozen.fetch_xor(true, Ordering::SeqCst) {
                            run.clock.count_again();
                        } else if roll(2) == 0 {
                            run.clock.stop_counting();
                        }
                    }
                }
                4 => clock.sleep(Duration::from_millis(roll(LEASE.as_millis() as u64 / 2))),
                _ => {
                    if roll(3) == 0 && !live.is_empty() {
                        let i = roll(live.len() as u64) as usize;
                        let mut all = runs.lock().unwrap();
                        let name = live[i].name.clone();
                        all.retain(|r| r.name != name);
                    }
                }
            }
        }
        clock.no_hook();
        runs.lock().unwrap().clear();
        // No two runs ever wrote in one epoch's folder.
        let mut writers: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for e in bucket.log().into_iter().filter(|e| e.applied && matches!(e.op, Op::CreateExclusive | Op::ReplaceIf)) {
            if let Some(folder) = e.key.strip_prefix("state/j/").and_then(|k| k.split('/').next())
                && folder.starts_with("epoch-")
            {
                writers.entry(folder.to_string()).or_default().insert(e.actor);
            }
        }
        for (folder, actors) in &writers {
            assert!(actors.len() == 1, "seed {seed}: {folder} written by {actors:?}");
        }
        // Without faults, a next run takes the state (at most a lease later).
        bucket.seed(None);
        let last = open(&bucket, "last", &clock).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        last.check_held().unwrap();
    }
    eprintln!("{passed} passed, {refused} refused ({fenced} fenced), {took} took the lease");
    // The seeds did reach what they are to test.
    assert!(passed > 100 && refused > 20 && took > 64, "{passed} passed, {refused} refused, {took} took the lease");
}
