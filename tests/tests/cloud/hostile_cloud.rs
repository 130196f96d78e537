//! What a hostile review of the object-store paths found, kept as tests
//! (each failed before its fix):
//!
//! - the file source on S3 or GCS: an object replaced between two of its
//!   ranged GETs (same name, same size, other bytes) was read as a splice of
//!   both versions, exit 0. Every read is now pinned to the version listed
//!   (`If-Match` on S3, the generation on GCS), so the run stops naming the
//!   object and lands only rows of the listed version;
//! - a key segment that starts or ends with whitespace: opendal trims it,
//!   `sluice-store`'s own GCS requests did not, so one store wrote one
//!   object and read another (a `gs://lake/ state` state dir lost its
//!   records on resume). Such keys and locations are refused now;
//! - racing `sluice run`s on one S3 or GCS state directory (these held up):
//!   three started at once on fresh state, then two racing for the lease a
//!   SIGKILLed holder leaves to expire; every row lands once.

use std::path::Path;
use std::time::{Duration, Instant};

use arrow_array::{Array, Int64Array};
use bytes::Bytes;
use sluice_store::{GcsOptions, ObjectStore};
use sluice_tests::harness::{self, block, buckets};
use sluice_tests::{TestJob, read_parquet_tree, sort_by_id};

const BUCKET: &str = buckets::HOSTILE;

/// The process's moto and fake-gcs-server (`sluice_tests::harness`), and
/// the environment pointing the host at them.
fn servers() {
    harness::moto();
    harness::gcs();
}

fn store(scheme: &str) -> ObjectStore {
    match scheme {
        "s3" => ObjectStore::s3(BUCKET, &harness::moto().s3_options()).expect("bucket"),
        _ => ObjectStore::gcs(BUCKET, &GcsOptions::emulator(&harness::gcs().endpoint)).expect("bucket"),
    }
}

fn put_in(store: &ObjectStore, key: &str, bytes: Vec<u8>) {
    block(async {
        let _ = store.delete(key).await;
        store.create_exclusive(key, Bytes::from(bytes)).await.expect("put");
    });
}

/// CSV `id,v` with fixed-width fields (`v = id * 3`), so that two versions
/// with ids of the same width have the same size, line for line.
fn fixed_csv(ids: std::ops::Range<i64>) -> Vec<u8> {
    let mut text = String::from("id,v\n");
    for i in ids {
        text.push_str(&format!("{i:07},{:08}\n", i * 3));
    }
    text.into_bytes()
}

/// A file source job reading `<scheme>://<bucket>/<prefix>/in`, rate-limited so
/// that it is still reading its one object seconds after its first commit.
fn slow_source_job(scheme: &str, prefix: &str) -> TestJob {
    servers();
    let dir = tempfile::tempdir().expect("dir");
    let plugin = sluice_tests::FILES_PLUGIN;
    let toml = format!(
        r#"[job]
id = "{}"
parallelism = 1
state_dir = "state"
[job.checkpoint]
every_rows = 1000
[source]
kind = "file"
path = "{scheme}://{BUCKET}/{prefix}/in"
batch_rows = 250
rate = 10000.0
[sink]
id = "out"
plugin = "{plugin}"
[sink.options]
path = "out/files"
[sink.grants]
locations = ["out"]
"#,
        prefix.replace('/', "-")
    );
    TestJob { dir, toml }
}

fn landed_in(dir: &Path) -> Vec<(i64, i64)> {
    if !dir.exists() {
        return Vec::new();
    }
    let rows = sort_by_id(&read_parquet_tree(dir));
    if rows.num_rows() == 0 {
        return Vec::new();
    }
    let col = |name: &str| {
        rows.column_by_name(name).expect(name).as_any().downcast_ref::<Int64Array>().expect("int64").clone()
    };
    let (id, v) = (col("id"), col("v"));
    (0..rows.num_rows()).map(|k| (id.value(k), v.value(k))).collect()
}

fn expected(ids: std::ops::Range<i64>) -> Vec<(i64, i64)> {
    ids.map(|i| (i, i * 3)).collect()
}

/// The object is listed (ETag E1) and its first ranged GET (256 KiB) read;
/// after the first checkpoint landed, it is replaced by other rows of the
/// same size. The next GET reads the new version's bytes from where the
/// first stopped. What may happen: the run fails naming the object (the
/// listed version is gone), or it lands the listed version whole. What must
/// not: exit 0 with a splice of both.
fn replaced_while_read(scheme: &str) {
    let prefix = format!("hostile/replaced-{scheme}");
    let key = format!("{prefix}/in/a.csv");
    let store = store(scheme);
    let rows = 60_000i64;
    let v1 = fixed_csv(0..rows);
    let v2 = fixed_csv(1_000_000..1_000_000 + rows);
    assert_eq!(v1.len(), v2.len(), "same size, so only the ETag tells them apart");
    assert!(v1.len() > 512 << 10, "more than the first ranged GET");
    put_in(&store, &key, v1);
    let job = slow_source_job(scheme, &prefix);

    let result = std::thread::scope(|s| {
        let run = s.spawn(|| job.run(None));
        let start = Instant::now();
        // Wait for the first commit: the object was listed and is being read.
        while std::fs::read_dir(job.out()).map(|d| d.count()).unwrap_or(0) == 0 {
            assert!(!run.is_finished(), "the run ended before its first commit");
            assert!(start.elapsed() < Duration::from_secs(60), "no commit within a minute");
            std::thread::sleep(Duration::from_millis(10));
        }
        put_in(&store, &key, v2);
        run.join().expect("run thread")
    });

    let landed = landed_in(&job.out());
    match result {
        Err(e) => {
            let message = e.to_string();
            assert!(message.contains(&key) && message.contains("replaced since it was listed"), "{message}");
            // Loud is fine, as long as what landed is a prefix of the listed version.
            assert!(landed == expected(0..landed.len() as i64), "before failing ({e}) it landed only listed rows");
        }
        Ok(summary) => {
            let from_v1 = landed.iter().filter(|(id, _)| *id < rows).count();
            let from_v2 = landed.iter().filter(|(id, _)| *id >= 1_000_000).count();
            let chimeras: Vec<&(i64, i64)> = landed.iter().filter(|(id, v)| *v != id * 3).take(5).collect();
            assert!(
                landed == expected(0..rows),
                "the run reported success ({} rows) but landed {} rows of the listed version, {} of the version \
                 that replaced it, and rows of neither (id, v): {chimeras:?}",
                summary.rows_total,
                from_v1,
                from_v2,
            );
        }
    }
}

#[test]
fn an_s3_source_object_replaced_while_it_is_read_is_not_landed_as_a_splice() {
    replaced_while_read("s3");
}

#[test]
fn a_gcs_source_object_replaced_while_it_is_read_is_not_landed_as_a_splice() {
    replaced_while_read("gs");
}

// ---------------------------------------------------------------------------
// Keys whose first segment starts with whitespace.
//
// `Location::parse` accepts `gs://lake/ state` (a prefix segment may start
// with a space, or a no-break space pasted from a document), and
// `ObjectStore::check_key` accepts the key ` state/lease`. opendal trims
// whitespace from both ends of every path it is given (`normalize_path`), so
// its reads, stats, lists and deletes go to `state/...`, while on GCS the
// JSON API requests of `gcs.rs` (create_exclusive, replace_if,
// read_versioned, the claimed upload) name the key verbatim. One ObjectStore
// then writes one object and reads another.

/// A GCS key whose segment starts with whitespace is refused before any
/// request, so nothing is created where reads would not look, and the
/// object the trimmed key names is untouched.
#[test]
fn a_gcs_key_with_a_leading_space_is_refused_and_nothing_else_is_touched() {
    let store = store("gs");
    put_in(&store, "hc-space/a", b"someone else's object".to_vec());
    let err = block(store.create_exclusive(" hc-space/a", Bytes::from_static(b"mine"))).expect_err("refused");
    assert!(
        matches!(&err, sluice_store::StoreError::InvalidKey { .. }) && err.to_string().contains("whitespace"),
        "{err:?}"
    );
    assert!(block(store.read(" hc-space/a")).is_err(), "a read of the key is refused too");
    assert_eq!(block(store.read("hc-space/a")).expect("read").as_ref(), b"someone else's object");
}

/// The state directory `gs://<bucket>/ hc-state` is refused when the job
/// loads, naming the key, before anything is written.
#[test]
fn a_gcs_state_dir_whose_prefix_starts_with_a_space_is_refused() {
    servers();
    let job = sluice_tests::TestJob::files("hc-space-state", 3100, 2, 500);
    let state_dir = format!("job.state_dir=gs://{BUCKET}/ hc-state");
    let sets = [state_dir.as_str(), "job.lease_secs=30"];
    let err = job.run_with(&sets, None).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("job.state_dir") && message.contains("whitespace"), "{message}");
    let on_gcs: Vec<String> = block(store("gs").list("")).expect("list").into_iter().map(|o| o.key).collect();
    assert!(!on_gcs.iter().any(|k| k.contains("hc-state")), "nothing was written: {on_gcs:?}");
    assert!(!job.out().exists() || std::fs::read_dir(job.out()).map(|d| d.count()).unwrap_or(0) == 0);
}

// ---------------------------------------------------------------------------
// Racing runs on one object-store state directory (these held up).

fn state_sets(scheme: &str, prefix: &str, lease: &str) -> Vec<String> {
    servers();
    vec![format!("job.state_dir={scheme}://{BUCKET}/{prefix}"), format!("job.lease_secs={lease}")]
}

fn slowed(mut job: TestJob) -> TestJob {
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 10000.0");
    job
}

/// Waits for `children`; returns (successes, stderr of each failure).
fn reap(children: Vec<std::process::Child>) -> (usize, Vec<String>) {
    let mut ok = 0;
    let mut failed = Vec::new();
    for child in children {
        let out = child.wait_with_output().expect("reap");
        if out.status.success() {
            ok += 1;
        } else {
            failed.push(String::from_utf8_lossy(&out.stderr).to_string());
        }
    }
    (ok, failed)
}

fn spawn(job: &TestJob, sets: &[String]) -> std::process::Child {
    sluice_tests::sluice_run(job, sets)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("sluice")
}

/// Three `sluice run`s of one job started at the same instant on a fresh
/// state directory, then (after a SIGKILL of the one that got ahead) two
/// more racing for the expiring lease: every run that ends 0 is right, the
/// others refuse naming the lease, and every row lands once.
fn racing_runs(scheme: &str) {
    // One round per store: a round is about a minute of real runs.
    let round = 0;
    {
        let prefix = format!("hostile/race-{scheme}-{round}");
        let sets = state_sets(scheme, &prefix, "2");
        let job = slowed(TestJob::files(&format!("race-{scheme}-{round}"), 30_000, 2, 1000));
        std::fs::write(job.path(), &job.toml).expect("job file");
        let first: Vec<_> = (0..3).map(|_| spawn(&job, &sets)).collect();
        // Kill whichever is ahead once something committed.
        let start = Instant::now();
        while std::fs::read_dir(job.out()).map(|d| d.count()).unwrap_or(0) < 2 {
            assert!(start.elapsed() < Duration::from_secs(60), "no progress");
            std::thread::sleep(Duration::from_millis(10));
        }
        // The two that lost refuse within a renewal (a third of the lease).
        let mut running = first;
        let mut losers = Vec::new();
        while running.len() > 1 {
            assert!(start.elapsed() < Duration::from_secs(60), "the losers never refused");
            let mut still = Vec::new();
            for mut child in running {
                match child.try_wait().expect("status") {
                    Some(_) => losers.push(child),
                    None => still.push(child),
                }
            }
            running = still;
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut holder = running.pop().expect("one run holds the lease");
        holder.kill().expect("SIGKILL");
        let _ = holder.wait();
        let (ok, failed) = reap(losers);
        for err in &failed {
            assert!(err.contains("is in use by another sluice run"), "a refusal names the lease: {err}");
        }
        assert_eq!(ok, 0, "the runs that lost the first race refused");
        // Two more race for the lease the killed run leaves to expire.
        let (ok, failed) = reap(vec![spawn(&job, &sets), spawn(&job, &sets)]);
        assert!(ok >= 1, "one of them finishes the job: {failed:?}");
        for err in &failed {
            assert!(err.contains("is in use by another sluice run"), "a refusal names the lease: {err}");
        }
        sluice_tests::assert_exactly_once(&sluice_tests::read_visible(&job.out()), 30_000);
    }
}

#[test]
fn racing_runs_on_gcs_state_land_every_row_once() {
    racing_runs("gs");
}

#[test]
fn racing_runs_on_s3_state_land_every_row_once() {
    racing_runs("s3");
}
