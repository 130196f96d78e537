//! A bucket in memory, for tests: the requests of an object-store state
//! directory (`super::objects::Objects`) with real conditional semantics
//! and injected faults, and a simulated clock, so that the lease (take,
//! renew, takeover, fencing) runs in-process, in an order a test decides.
//!
//! Invariants:
//! - a version token is never handed out twice: each write (create or
//!   replace) of any key takes the next number of the bucket's one counter,
//!   so a token read before a replace never matches after it, even if the
//!   same bytes are written back (a GCS generation; an S3 ETag of the same
//!   bytes would repeat, which the lease never relies on);
//! - `create_exclusive` writes only where no object is (else
//!   `AlreadyExists`); `replace_if` writes only over the version it names
//!   (else `Conflict`; a missing object is `NotFound`, as S3 answers); a
//!   request is applied whole under one lock, so two clients never
//!   interleave inside one;
//! - a fault is decided before the request is applied, by a script (the
//!   next request of that operation on a key containing a given text) or
//!   by a seed, and is one of: [`Fault::Refuse`], refused before it was
//!   sent, so nothing happened (a definite "not done":
//!   `StoreError::NoCredentials`); [`Fault::LoseReply`], applied, but no
//!   answer came back (the outer `Err` of an answer: unknown outcome); and
//!   [`Fault::Slow`], applied, answered only after the clock moved on (and
//!   whatever the clock's sleep hook runs meanwhile, e.g. another run's
//!   renewals or takeover, happened first);
//! - every request is logged with the client (actor) that sent it, its
//!   fault, and the simulated time, so a test can check who wrote where;
//! - [`SimClock`] only moves when told (`advance`, or a `sleep` of the code
//!   under test, which then runs its hook once, not re-entered): the
//!   events of a test are in one order, the same on every run.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use sluice_store::{ObjectInfo, StoreError, Versioned};

use super::checkpoint::CheckpointError;
use super::objects::{Answer, Clock, Objects};

/// A fault injected into one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Refused before it was sent: nothing happened.
    Refuse,
    /// Applied, but its reply was lost: the caller hears no answer.
    LoseReply,
    /// Applied, and answered this much later by the simulated clock.
    Slow(Duration),
}

/// The requests of [`super::objects::Objects`], to name in a script and a log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    CreateExclusive,
    ReplaceIf,
    Read,
    ReadVersioned,
    Stat,
    List,
    ListLevel,
    Delete,
}

impl Op {
    /// Whether the request may change the bucket.
    pub fn writes(self) -> bool {
        matches!(self, Op::CreateExclusive | Op::ReplaceIf | Op::Delete)
    }
}

/// One request, as the bucket saw it.
#[derive(Debug, Clone)]
pub struct Event {
    /// The client that sent it.
    pub actor: String,
    pub op: Op,
    pub key: String,
    pub fault: Option<Fault>,
    /// Whether it changed the bucket.
    pub applied: bool,
    /// The shared simulated time it was applied at, since the clock started.
    pub at: Duration,
}

/// A scripted fault: the next request of `op` on a key containing `key`.
#[derive(Debug, Clone)]
struct Scripted {
    op: Op,
    key: String,
    fault: Fault,
}

/// Faults decided by a seed: chances per million of each.
#[derive(Debug, Clone, Copy)]
pub struct Seeded {
    pub seed: u64,
    pub refuse: u32,
    pub lose_reply: u32,
    pub slow: u32,
    /// A slow reply comes up to this late.
    pub max_slow: Duration,
}

/// splitmix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[derive(Debug, Default)]
struct Contents {
    /// Each object's bytes and version.
    objects: BTreeMap<String, (Bytes, u64)>,
    /// The last version handed out.
    version: u64,
    script: Vec<Scripted>,
    seeded: Option<Seeded>,
    /// Requests decided by the seed so far.
    decided: u64,
    log: Vec<Event>,
}

impl Contents {
    fn fault(&mut self, op: Op, key: &str) -> Option<Fault> {
        if let Some(i) = self.script.iter().position(|s| s.op == op && key.contains(&s.key)) {
            return Some(self.script.remove(i).fault);
        }
        let seeded = self.seeded?;
        self.decided += 1;
        let roll = mix(seeded.seed ^ mix(self.decided));
        let chance = (roll % 1_000_000) as u32;
        if chance < seeded.refuse {
            Some(Fault::Refuse)
        } else if chance < seeded.refuse.saturating_add(seeded.lose_reply) {
            Some(Fault::LoseReply)
        } else if chance < seeded.refuse.saturating_add(seeded.lose_reply).saturating_add(seeded.slow) {
            let max = seeded.max_slow.as_millis().max(1) as u64;
            Some(Fault::Slow(Duration::from_millis(1 + (roll >> 32) % max)))
        } else {
            None
        }
    }
}

/// A bucket in memory. Clones share it.
#[derive(Clone)]
pub struct MemBucket {
    name: String,
    contents: Arc<Mutex<Contents>>,
}

impl fmt::Debug for MemBucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemBucket").field("name", &self.name).finish_non_exhaustive()
    }
}

impl MemBucket {
    /// An empty bucket, `mem://<name>` in messages.
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), contents: Arc::default() }
    }

    /// Every change is one insert or removal, whole even after a panic
    /// elsewhere poisoned the lock.
    fn contents(&self) -> MutexGuard<'_, Contents> {
        self.contents.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A client of this bucket named `actor` in the log, whose slow replies
    /// wait on `clock`.
    pub fn client(&self, actor: &str, clock: &SimClock) -> MemObjects {
        MemObjects { bucket: self.clone(), actor: actor.to_string(), clock: clock.clone() }
    }

    /// Injects `fault` into the next request of `op` on a key containing
    /// `key` (scripted faults come before seeded ones, in order).
    pub fn script(&self, op: Op, key: &str, fault: Fault) {
        self.contents().script.push(Scripted { op, key: key.to_string(), fault });
    }

    /// The scripted faults not used yet.
    pub fn scripted_left(&self) -> usize {
        self.contents().script.len()
    }

    /// Decides a fault for every request from now on by `seeded` (`None`: no more).
    pub fn seed(&self, seeded: Option<Seeded>) {
        self.contents().seeded = seeded;
    }

    /// The object at `key` and its version, read without any fault.
    pub fn get(&self, key: &str) -> Option<(Bytes, u64)> {
        self.contents().objects.get(key).cloned()
    }

    /// Every key, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.contents().objects.keys().cloned().collect()
    }

    /// Every request so far.
    pub fn log(&self) -> Vec<Event> {
        self.contents().log.clone()
    }

    /// `mem://name/key`
    pub fn url(&self, key: &str) -> String {
        if key.is_empty() { format!("mem://{}", self.name) } else { format!("mem://{}/{key}", self.name) }
    }
}

/// One client of a [`MemBucket`].
#[derive(Clone)]
pub struct MemObjects {
    bucket: MemBucket,
    actor: String,
    clock: SimClock,
}

impl fmt::Debug for MemObjects {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemObjects").field("bucket", &self.bucket.name).field("actor", &self.actor).finish()
    }
}

fn check_key(url: String, key: &str) -> Result<(), StoreError> {
    if key.is_empty() {
        return Err(StoreError::InvalidKey { url, message: "empty" });
    }
    if key.starts_with('/') || key.ends_with('/') {
        return Err(StoreError::InvalidKey { url, message: "it starts or ends with `/`" });
    }
    Ok(())
}

fn token(version: u64) -> String {
    format!("\"v{version}\"")
}

fn info(key: &str, bytes: &Bytes, version: u64) -> ObjectInfo {
    ObjectInfo { key: key.to_string(), size: bytes.len() as u64, etag: Some(token(version)), modified_ms: None }
}

impl MemObjects {
    /// Sends one request: decides its fault, applies `apply` unless refused,
    /// logs it, and answers as the fault says. `apply` answers whether it
    /// changed the bucket.
    fn request<T>(
        &self,
        op: Op,
        key: &str,
        apply: impl FnOnce(&mut Contents) -> (Result<T, StoreError>, bool),
    ) -> Answer<T> {
        let url = self.bucket.url(key);
        let (answer, fault) = {
            let mut contents = self.bucket.contents();
            let seed = contents.seeded.map(|s| s.seed);
            let fault = contents.fault(op, key);
            let (answer, applied) = match fault {
                Some(Fault::Refuse) => {
                    let message = format!(
                        "simulated fault: {op:?} refused before it was sent{}",
                        seed.map(|s| format!(" (seed {s})")).unwrap_or_default()
                    );
                    (Err(StoreError::NoCredentials { url: url.clone(), message }), false)
                }
                _ => apply(&mut contents),
            };
            let at = self.clock.shared();
            contents.log.push(Event { actor: self.actor.clone(), op, key: key.to_string(), fault, applied, at });
            (answer, fault)
        };
        match fault {
            Some(Fault::LoseReply) => Err(CheckpointError::Io {
                path: url.into(),
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("simulated fault: the reply to {op:?} was lost"),
                ),
            }),
            Some(Fault::Slow(d)) => {
                self.clock.sleep(d);
                Ok(answer)
            }
            Some(Fault::Refuse) | None => Ok(answer),
        }
    }

    /// The next version token's number.
    fn next_version(contents: &mut Contents) -> u64 {
        contents.version += 1;
        contents.version
    }
}

impl Objects for MemObjects {
    fn url(&self, key: &str) -> String {
        self.bucket.url(key)
    }

    fn create_exclusive(&self, key: &str, bytes: Bytes) -> Answer<Option<String>> {
        let url = self.bucket.url(key);
        self.request(Op::CreateExclusive, key, |c| {
            if let Err(e) = check_key(url.clone(), key) {
                return (Err(e), false);
            }
            if c.objects.contains_key(key) {
                return (Err(StoreError::AlreadyExists { url }), false);
            }
            let v = Self::next_version(c);
            c.objects.insert(key.to_string(), (bytes, v));
            (Ok(Some(token(v))), true)
        })
    }

    fn replace_if(&self, key: &str, bytes: Bytes, etag: &str) -> Answer<Option<String>> {
        let url = self.bucket.url(key);
        self.request(Op::ReplaceIf, key, |c| {
            if let Err(e) = check_key(url.clone(), key) {
                return (Err(e), false);
            }
            match c.objects.get(key) {
                None => (Err(StoreError::NotFound { url }), false),
                Some((_, v)) if token(*v) != etag => {
                    (Err(StoreError::Conflict { url, expected: etag.to_string() }), false)
                }
                Some(_) => {
                    let v = Self::next_version(c);
                    c.objects.insert(key.to_string(), (bytes, v));
                    (Ok(Some(token(v))), true)
                }
            }
        })
    }

    fn read(&self, key: &str) -> Answer<Bytes> {
        let url = self.bucket.url(key);
        self.request(Op::Read, key, |c| match check_key(url.clone(), key) {
            Err(e) => (Err(e), false),
            Ok(()) => (c.objects.get(key).map(|(b, _)| b.clone()).ok_or(StoreError::NotFound { url }), false),
        })
    }

    fn read_versioned(&self, key: &str) -> Answer<Versioned> {
        let url = self.bucket.url(key);
        self.request(Op::ReadVersioned, key, |c| match check_key(url.clone(), key) {
            Err(e) => (Err(e), false),
            Ok(()) => (
                c.objects
                    .get(key)
                    .map(|(b, v)| Versioned { bytes: b.clone(), etag: token(*v) })
                    .ok_or(StoreError::NotFound { url }),
                false,
            ),
        })
    }

    fn stat(&self, key: &str) -> Answer<ObjectInfo> {
        let url = self.bucket.url(key);
        self.request(Op::Stat, key, |c| match check_key(url.clone(), key) {
            Err(e) => (Err(e), false),
            Ok(()) => (c.objects.get(key).map(|(b, v)| info(key, b, *v)).ok_or(StoreError::NotFound { url }), false),
        })
    }

    fn list(&self, prefix: &str) -> Answer<Vec<ObjectInfo>> {
        let dir = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
        self.request(Op::List, prefix, |c| {
            let listed =
                c.objects.iter().filter(|(k, _)| k.starts_with(&dir)).map(|(k, (b, v))| info(k, b, *v)).collect();
            (Ok(listed), false)
        })
    }

    fn list_level(&self, prefix: &str) -> Answer<Vec<String>> {
        let dir = if prefix.is_empty() { String::new() } else { format!("{prefix}/") };
        self.request(Op::ListLevel, prefix, |c| {
            let mut names: Vec<String> = c
                .objects
                .keys()
                .filter_map(|k| k.strip_prefix(&dir))
                .filter_map(|rest| rest.split('/').next())
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect();
            names.sort();
            names.dedup();
            (Ok(names), false)
        })
    }

    fn delete(&self, key: &str) -> Answer<()> {
        let url = self.bucket.url(key);
        self.request(Op::Delete, key, |c| match check_key(url, key) {
            Err(e) => (Err(e), false),
            Ok(()) => {
                let removed = c.objects.remove(key).is_some();
                (Ok(()), removed)
            }
        })
    }
}

type Hook = Box<dyn FnMut() + Send>;

struct ClockInner {
    start: Instant,
    offset: Mutex<Duration>,
    /// Run after each `sleep` (not while it runs itself).
    hook: Mutex<Option<Hook>>,
}

/// What one process's clock missed of the simulated time.
#[derive(Debug, Default)]
struct Missed {
    /// In total, before the pause under way.
    before: Duration,
    /// When it stopped counting (by the shared time), while it does not.
    since: Option<Duration>,
}

/// A simulated clock: moves only when told. Clones share it; a
/// [`SimClock::process`] shares its time but may stop counting it.
#[derive(Clone)]
pub struct SimClock {
    inner: Arc<ClockInner>,
    missed: Arc<Mutex<Missed>>,
}

impl fmt::Debug for SimClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimClock").field("elapsed", &self.elapsed()).field("shared", &self.shared()).finish()
    }
}

impl Default for SimClock {
    fn default() -> Self {
        Self::new()
    }
}

/// The simulated wall clock's start: 2026-01-01T00:00:00Z.
const START_MS: u64 = 1_767_225_600_000;

impl SimClock {
    pub fn new() -> Self {
        Self {
            inner: Arc::new(ClockInner { start: Instant::now(), offset: Mutex::default(), hook: Mutex::default() }),
            missed: Arc::default(),
        }
    }

    /// The clock of one more process on the same time (and hook), counting
    /// it until [`SimClock::stop_counting`].
    pub fn process(&self) -> Self {
        Self { inner: self.inner.clone(), missed: Arc::default() }
    }

    /// The shared time since the clock started.
    pub fn shared(&self) -> Duration {
        *self.inner.offset.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// How far this clock moved since it started: the shared time, less
    /// what it did not count.
    pub fn elapsed(&self) -> Duration {
        let shared = self.shared();
        let missed = self.missed.lock().unwrap_or_else(PoisonError::into_inner);
        match missed.since {
            Some(since) => since.saturating_sub(missed.before),
            None => shared.saturating_sub(missed.before),
        }
    }

    /// This clock stops counting (a suspended machine's monotonic clock)
    /// until [`SimClock::count_again`].
    pub fn stop_counting(&self) {
        let shared = self.shared();
        let mut missed = self.missed.lock().unwrap_or_else(PoisonError::into_inner);
        missed.since.get_or_insert(shared);
    }

    /// This clock counts again, from where it stopped.
    pub fn count_again(&self) {
        let shared = self.shared();
        let mut missed = self.missed.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(since) = missed.since.take() {
            missed.before += shared.saturating_sub(since);
        }
    }

    /// Moves the clock on by `d` (runs no hook).
    pub fn advance(&self, d: Duration) {
        *self.inner.offset.lock().unwrap_or_else(PoisonError::into_inner) += d;
    }

    /// Runs `hook` after every `sleep` from now on: what other runs do
    /// while the code under test waits.
    pub fn on_sleep(&self, hook: impl FnMut() + Send + 'static) {
        *self.inner.hook.lock().unwrap_or_else(PoisonError::into_inner) = Some(Box::new(hook));
    }

    /// No hook any more.
    pub fn no_hook(&self) {
        *self.inner.hook.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl Clock for SimClock {
    fn now(&self) -> Instant {
        self.inner.start + self.elapsed()
    }

    fn now_ms(&self) -> u64 {
        START_MS + self.elapsed().as_millis() as u64
    }

    fn sleep(&self, d: Duration) {
        self.advance(d);
        // Taken out while it runs: a sleep inside it only moves the clock.
        let hook = self.inner.hook.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(mut hook) = hook {
            hook();
            let mut slot = self.inner.hook.lock().unwrap_or_else(PoisonError::into_inner);
            if slot.is_none() {
                *slot = Some(hook);
            }
        }
    }
}
