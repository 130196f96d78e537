//! A state directory held in memory, for tests: the checkpoint store's own
//! logic ([`CheckpointStore`]) over no disk and no object store, so that it
//! can be tested in-process, and behind the seeded faults of
//! `super::state_faults` (`CheckpointStore::in_memory(..).with_faults(..)`).
//!
//! Invariants:
//! - a record is kept as an object store keeps it: one entry per write,
//!   keyed by checkpoint and sequence, created and never overwritten;
//!   re-persisting a checkpoint adds its next sequence, and the highest
//!   sequence of a checkpoint is its record;
//! - a write is whole or absent, and durable the moment it returns: every
//!   later store over the same [`MemoryDir`] reads it, as a restarted
//!   process reads its disk. The backend itself never fails a write; the
//!   failures a test wants come from the fault layer wrapped around it;
//! - one store holds a [`MemoryDir`] at a time: another open is refused as
//!   [`CheckpointError::Locked`] until the holder is dropped (as the
//!   kernel's lock, or the lease, would refuse it);
//! - only test builds and builds with `fault-injection` have this backend.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

#[cfg(doc)]
use super::checkpoint::CheckpointStore;
use super::checkpoint::{CheckpointError, StateBackend, StateFile};

/// What a memory state directory holds.
#[derive(Debug, Default)]
struct Contents {
    /// The small state files, by name.
    files: BTreeMap<&'static str, Vec<u8>>,
    /// The records, by checkpoint and sequence.
    records: BTreeMap<(u64, u64), Vec<u8>>,
    /// A store holds the directory.
    held: bool,
}

/// The durable contents of a memory state directory: what outlives the
/// stores opened on it. Clones share the contents.
#[derive(Debug, Clone)]
pub struct MemoryDir {
    name: String,
    contents: Arc<Mutex<Contents>>,
}

impl MemoryDir {
    /// An empty state directory, named `memory://<name>` in messages.
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), contents: Arc::default() }
    }

    /// The contents. Every change to them is a single insert or removal, so
    /// they are whole even after a panic elsewhere poisoned the lock.
    fn contents(&self) -> MutexGuard<'_, Contents> {
        self.contents.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn url(&self) -> PathBuf {
        PathBuf::from(format!("memory://{}", self.name))
    }

    fn records_dir(&self) -> PathBuf {
        self.url().join("checkpoints")
    }

    fn record_path(&self, c: u64, seq: u64) -> PathBuf {
        self.records_dir().join(format!("chk-{c:020}-{seq:06}.json"))
    }

    /// Every record kept, as `(checkpoint, sequence)`, newest first.
    pub fn records(&self) -> Vec<(u64, u64)> {
        self.contents().records.keys().rev().copied().collect()
    }

    /// Changes the bytes of the newest record of checkpoint `c` in place, as
    /// a bad disk or a hand edit would. `false` when there is none.
    pub fn tamper(&self, c: u64, change: impl FnOnce(&mut Vec<u8>)) -> bool {
        let mut contents = self.contents();
        match contents.records.range_mut((c, 0)..=(c, u64::MAX)).next_back() {
            Some((_, bytes)) => {
                change(bytes);
                true
            }
            None => false,
        }
    }
}

/// A held memory state directory: the [`StateBackend`] of
/// `CheckpointStore::in_memory`. Dropping it releases the directory.
#[derive(Debug)]
pub(super) struct MemoryState {
    dir: MemoryDir,
}

impl MemoryState {
    /// Holds `dir`, refused while another store holds it.
    pub(super) fn open(dir: &MemoryDir) -> Result<Self, CheckpointError> {
        let mut contents = dir.contents();
        if contents.held {
            return Err(CheckpointError::Locked { path: dir.url() });
        }
        contents.held = true;
        Ok(Self { dir: dir.clone() })
    }

    /// The newest sequence of checkpoint `c`, if it has a record.
    fn newest_seq(contents: &Contents, c: u64) -> Option<u64> {
        contents.records.range((c, 0)..=(c, u64::MAX)).next_back().map(|(&(_, seq), _)| seq)
    }
}

impl Drop for MemoryState {
    fn drop(&mut self) {
        self.dir.contents().held = false;
    }
}

impl StateBackend for MemoryState {
    fn read_file(&self, file: StateFile) -> Result<Option<Vec<u8>>, CheckpointError> {
        Ok(self.dir.contents().files.get(file.name()).cloned())
    }

    fn write_file(&self, file: StateFile, bytes: Vec<u8>) -> Result<(), CheckpointError> {
        self.dir.contents().files.insert(file.name(), bytes);
        Ok(())
    }

    fn file_path(&self, file: StateFile) -> PathBuf {
        self.dir.url().join(file.name())
    }

    fn ids(&self) -> Result<Vec<u64>, CheckpointError> {
        let mut ids: Vec<u64> = self.dir.contents().records.keys().map(|&(c, _)| c).collect();
        ids.dedup();
        ids.reverse();
        Ok(ids)
    }

    fn read_record(&self, c: u64) -> Result<(PathBuf, Vec<u8>), CheckpointError> {
        let contents = self.dir.contents();
        let newest = contents.records.range((c, 0)..=(c, u64::MAX)).next_back();
        match newest {
            Some((&(_, seq), bytes)) => Ok((self.dir.record_path(c, seq), bytes.clone())),
            None => Err(CheckpointError::Io {
                path: self.dir.record_path(c, 0),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no record of this checkpoint"),
            }),
        }
    }

    fn write_record(&self, c: u64, bytes: Vec<u8>) -> Result<PathBuf, CheckpointError> {
        let mut contents = self.dir.contents();
        let seq = Self::newest_seq(&contents, c).map_or(0, |s| s.saturating_add(1));
        // Created, never overwritten: the sequence is new.
        contents.records.insert((c, seq), bytes);
        Ok(self.dir.record_path(c, seq))
    }

    fn delete_record(&self, c: u64) {
        self.dir.contents().records.retain(|&(rc, _), _| rc != c);
    }

    fn check_held(&self) -> Result<(), CheckpointError> {
        // Held until this value is dropped.
        Ok(())
    }

    fn dir(&self) -> PathBuf {
        self.dir.url()
    }

    fn records_dir(&self) -> PathBuf {
        self.dir.records_dir()
    }

    fn record_path(&self, c: u64) -> PathBuf {
        let seq = Self::newest_seq(&self.dir.contents(), c).map_or(0, |s| s.saturating_add(1));
        self.dir.record_path(c, seq)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::checkpoint::{Blob, CheckpointRecord, CheckpointStore, PendingCommit, SubtaskRecord, TableRecord};
    use crate::metrics::Tally;

    /// The record of checkpoint `c`: two subtasks at positions that grow
    /// with `c`, and every checkpoint from `first_pending` on pending.
    fn record(c: u64, first_pending: u64) -> CheckpointRecord {
        let subtasks = (0..2u64)
            .map(|s| SubtaskRecord {
                position: serde_json::json!({"emitted": c * 10 + s}),
                writer_state: Blob(vec![s as u8, c as u8, 255]),
                rows: c * 10 + s,
                finished: false,
                seen: BTreeMap::from([("orders".to_string(), None)]),
                bad_rows: s,
            })
            .collect();
        let pending = (first_pending..=c)
            .map(|p| PendingCommit {
                checkpoint: p,
                combined: Blob(format!("files of {p}").into_bytes()),
                rows: 20,
                tables: BTreeMap::from([("orders".to_string(), Tally { rows: 20, bytes: 320, bad: 1 })]),
            })
            .collect();
        CheckpointRecord {
            job_id: "j".into(),
            sink_id: "s".into(),
            checkpoint: c,
            attempt: 1,
            parallelism: 2,
            subtasks,
            pending,
            last_committed: first_pending.checked_sub(1).filter(|&l| l > 0),
            dropped: Vec::new(),
            tables: vec![TableRecord { name: "orders".into(), schema: Blob(vec![1, 2, 3]) }],
            source: None,
            dead_letters: None,
            committer_state: None,
            created_at_ms: 1_000 + c,
        }
    }

    #[test]
    fn memory_persist_then_restore_after_a_reopen() {
        let dir = MemoryDir::new("j");
        let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
        assert_eq!(store.latest().unwrap(), None);
        assert_eq!(store.next_attempt().unwrap(), 1);
        for c in 1..=3 {
            let path = store.persist(&record(c, 1)).unwrap();
            assert_eq!(path, PathBuf::from(format!("memory://j/checkpoints/chk-{c:020}-000000.json")));
        }
        drop(store);

        // A new run reads what is durable: the newest record, whole.
        let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
        let restored = store.latest().unwrap().expect("a record was persisted");
        assert_eq!(restored, record(3, 1));
        assert_eq!(restored.subtasks[1].position, serde_json::json!({"emitted": 31}));
        assert_eq!(restored.subtasks[0].writer_state, Blob(vec![0, 3, 255]));
        assert_eq!(restored.pending.iter().map(|p| p.checkpoint).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(restored.pending[2].combined, Blob(b"files of 3".to_vec()));
        assert_eq!(restored.committed_rows(), 1);
        // Two records retained, the oldest pruned.
        assert_eq!(dir.records(), [(3, 0), (2, 0)]);
        assert_eq!(store.next_attempt().unwrap(), 2);
    }

    #[test]
    fn memory_marking_committed_writes_a_new_record_and_prunes() {
        let dir = MemoryDir::new("j");
        let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
        store.persist(&record(1, 1)).unwrap();
        store.persist(&record(2, 1)).unwrap();
        // The commits of 1 and 2 succeeded: the record says so, as the
        // coordinator's settling does (the newest, nothing pending).
        let mut settled = store.latest().unwrap().unwrap();
        settled.pending.clear();
        settled.last_committed = Some(2);
        store.persist(&settled).unwrap();
        // The first record of 2 is not overwritten; the newer one wins.
        assert_eq!(dir.records(), [(2, 1), (2, 0), (1, 0)]);
        let read = store.latest().unwrap().unwrap();
        assert!(read.pending.is_empty(), "{read:?}");
        assert_eq!(read.last_committed, Some(2));
        assert_eq!(read.committed_rows(), read.total_rows());
        // The next checkpoint prunes beyond the two newest.
        store.persist(&record(3, 3)).unwrap();
        assert_eq!(dir.records(), [(3, 0), (2, 1), (2, 0)]);
        drop(store);
        let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
        let read = store.latest().unwrap().unwrap();
        assert_eq!(read.last_committed, Some(2));
        assert_eq!(read.pending.iter().map(|p| p.checkpoint).collect::<Vec<_>>(), [3]);
    }

    #[test]
    fn memory_corrupt_record_is_refused_naming_it() {
        let dir = MemoryDir::new("j");
        let store = CheckpointStore::in_memory(&dir, "j", 3).unwrap();
        store.persist(&record(1, 1)).unwrap();
        store.persist(&record(2, 1)).unwrap();
        assert!(dir.tamper(2, |bytes| {
            let last = bytes.len() - 3;
            bytes[last] ^= 0x20;
        }));
        let err = store.latest().unwrap_err();
        assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(&format!("memory://j/checkpoints/chk-{:020}-000000.json", 2)), "{msg}");
        assert!(msg.contains("corrupt (checksum mismatch)") && msg.contains("(checkpoint 1)"), "{msg}");
        assert!(dir.tamper(2, |bytes| bytes.truncate(bytes.len() / 2)));
        let msg = store.latest().unwrap_err().to_string();
        assert!(msg.contains("truncated"), "{msg}");
        // Nothing older is substituted, and nothing was removed.
        assert_eq!(dir.records(), [(2, 0), (1, 0)]);
    }

    #[test]
    fn memory_record_of_another_job_is_refused() {
        let dir = MemoryDir::new("j");
        CheckpointStore::in_memory(&dir, "j", 3).unwrap().persist(&record(1, 1)).unwrap();
        let err = CheckpointStore::in_memory(&dir, "other", 3).unwrap().latest().unwrap_err();
        assert!(matches!(err, CheckpointError::WrongJob { .. }), "{err}");
        assert!(err.to_string().contains("belongs to job \"j\", not \"other\""), "{err}");
    }

    #[test]
    fn memory_one_store_holds_the_directory_at_a_time() {
        let dir = MemoryDir::new("j");
        let first = CheckpointStore::in_memory(&dir, "j", 3).unwrap();
        let err = CheckpointStore::in_memory(&dir, "j", 3).unwrap_err();
        assert!(matches!(err, CheckpointError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("memory://j is in use by another sluice run"), "{err}");
        drop(first);
        assert!(CheckpointStore::in_memory(&dir, "j", 3).is_ok());
    }

    #[test]
    fn memory_halt_is_durable_across_a_reopen() {
        let dir = MemoryDir::new("j");
        let store = CheckpointStore::in_memory(&dir, "j", 3).unwrap();
        store.persist(&record(1, 1)).unwrap();
        assert_eq!(store.halted().unwrap(), None);
        store.halt("checkpoint 1 was found committed by another incarnation").unwrap();
        drop(store);
        let store = CheckpointStore::in_memory(&dir, "j", 3).unwrap();
        let halt = store.halted().unwrap().expect("the halt marker is durable");
        assert_eq!(halt.reason, "checkpoint 1 was found committed by another incarnation");
        assert_eq!(store.halt_path(), PathBuf::from("memory://j/halted"));
        // Halting touches no record.
        assert_eq!(store.latest().unwrap(), Some(record(1, 1)));
    }

    #[cfg(feature = "fault-injection")]
    mod faults {
        use std::sync::Arc;

        use super::*;
        use crate::fault::{Faults, Sim};

        fn faulty(dir: &MemoryDir, sim: &Arc<Sim>) -> CheckpointStore {
            let faults = Faults { sim: Some(sim.clone()), ..Faults::default() };
            CheckpointStore::in_memory(dir, "j", 2).unwrap().with_faults(&faults)
        }

        #[test]
        fn memory_a_write_failed_before_it_was_sent_is_not_written() {
            let dir = MemoryDir::new("j");
            // Every operation fails before it happens.
            let sim = Arc::new(Sim::new(7, 1_000_000, 0, 0));
            let store = faulty(&dir, &sim);
            let err = store.persist(&record(1, 1)).unwrap_err();
            assert!(!err.outcome_unknown(), "refused before it was sent: a definite not written: {err}");
            let msg = err.to_string();
            assert!(msg.contains("simulated fault of write-record"), "{msg}");
            assert!(!msg.contains("unknown"), "{msg}");
            assert!(sim.fired().iter().any(|f| f.starts_with("state.write-record#1 FailBefore")), "{:?}", sim.fired());
            drop(store);
            // Not there, now or for a later run.
            assert!(dir.records().is_empty());
            assert_eq!(CheckpointStore::in_memory(&dir, "j", 2).unwrap().latest().unwrap(), None);
        }

        #[test]
        fn memory_a_write_with_its_reply_lost_is_unknown_and_a_reopen_finds_it() {
            let dir = MemoryDir::new("j");
            let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
            store.persist(&record(1, 1)).unwrap();
            drop(store);
            // Every operation happens, and its caller hears an error.
            let sim = Arc::new(Sim::new(7, 0, 1_000_000, 0));
            let store = faulty(&dir, &sim);
            let err = store.persist(&record(2, 1)).unwrap_err();
            assert!(err.outcome_unknown(), "a lost reply proves nothing: {err}");
            assert!(err.to_string().contains("whether this write took effect is unknown"), "{err}");
            assert!(sim.fired().iter().any(|f| f.starts_with("state.write-record#1 LoseReply")), "{:?}", sim.fired());
            drop(store);
            // The next run decides from what is durable: the record is there.
            let store = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
            assert_eq!(store.latest().unwrap(), Some(record(2, 1)));
        }

        /// Over many seeds with every kind of fault: after each persist, the
        /// newest durable record is the newest one the store answered `Ok`
        /// or an unknown outcome for (here a lost reply always took effect),
        /// and never one it answered "not written" for.
        #[test]
        fn memory_seeded_faults_never_lose_a_durable_record_nor_invent_one() {
            let mut outcomes = [0u32; 3];
            for seed in 0..64 {
                let dir = MemoryDir::new("j");
                let sim = Arc::new(Sim::new(seed, 250_000, 250_000, 250_000));
                let store = faulty(&dir, &sim);
                let mut durable = None;
                for c in 1..=12 {
                    let result = store.persist(&record(c, 1));
                    match &result {
                        Ok(_) => {
                            outcomes[0] += 1;
                            durable = Some(c);
                        }
                        Err(e) if e.outcome_unknown() => {
                            outcomes[1] += 1;
                            durable = Some(c);
                        }
                        Err(_) => outcomes[2] += 1,
                    }
                    sim.set_enabled(false);
                    let newest = store.latest().unwrap().map(|r| r.checkpoint);
                    assert_eq!(newest, durable, "seed {seed}, checkpoint {c}: {result:?}; {:?}", sim.fired());
                    sim.set_enabled(true);
                }
                drop(store);
                let reopened = CheckpointStore::in_memory(&dir, "j", 2).unwrap();
                assert_eq!(reopened.latest().unwrap().map(|r| r.checkpoint), durable, "seed {seed}");
            }
            // The seeds reached every outcome.
            assert!(outcomes.iter().all(|&n| n > 0), "{outcomes:?}");
        }
    }
}
