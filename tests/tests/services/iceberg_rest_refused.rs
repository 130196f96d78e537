//! Vended storage credentials the store refuses before they say they
//! expire (revoked, or a session that ended early): the request is sent
//! again with new ones, and the job goes on.
//!
//! The REST catalog double's warehouse is on moto (127.0.0.1) and it vends
//! S3 keys that claim to live an hour, so nothing is due for a refresh.
//! Mid-run, moto's fault switch starts refusing the newest vended key, the
//! two ways S3 refuses credentials
//! (<https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html>):
//! `400 ExpiredToken` ("The provided token has expired.") and then, for the
//! next key, `403 AccessDenied`. The host must load the table again for new
//! credentials and send the refused request once more, so the run ends
//! with every row exactly once and no checkpoint twice.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use sluice::capability::catalog::CatalogGrant;
use sluice_tests::harness::VendingLake;
use sluice_tests::store_servers::Moto;
use sluice_tests::{assert_exactly_once_range, read_iceberg_from};

const BUCKET: &str = "lake";
const TABLE: &str = "db.events";

#[test]
fn refused_vended_credentials_are_replaced_and_the_request_sent_again() {
    let moto = Arc::new(Moto::start(&[BUCKET]));
    let lake = VendingLake::start(&moto, BUCKET, Duration::from_secs(3600));
    let (rest, stores, root) = (Arc::clone(&lake.rest), &lake.stores, &lake.root);

    const ROWS: u64 = 12_000;
    let scratch = tempfile::tempdir().expect("scratch");
    let mut job = lake.job("rest-refused", scratch.path(), TABLE, ROWS);
    // 2000 rows/s over both subtasks: about 6 s, several checkpoints a second.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 2000.0");

    // Once the run has used the vended keys a while, hold the newest (the
    // double vends it again on every load) and refuse it, until the store
    // has refused a request signed with it: so the host is sure to meet the
    // refusal, and its reload (the retry) gets a new key. Then the same for
    // the next key, the other way.
    let done = Arc::new(AtomicBool::new(false));
    let revoker = {
        let (moto, rest, done) = (Arc::clone(&moto), Arc::clone(&rest), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut revoked = Vec::new();
            for status in [400, 403] {
                std::thread::sleep(Duration::from_millis(1000));
                let start = Instant::now();
                let wait = |until: &mut dyn FnMut() -> bool| {
                    while !until() {
                        if done.load(Ordering::Relaxed) || start.elapsed() > Duration::from_secs(20) {
                            return false;
                        }
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    true
                };
                let before = moto.refused();
                let refused_since = {
                    let moto = Arc::clone(&moto);
                    move || moto.refused() > before
                };
                let mut held = None;
                if !wait(&mut || {
                    held = rest.hold_newest_until(refused_since.clone());
                    held.is_some()
                }) {
                    return revoked;
                }
                let Some(key) = held else { return revoked };
                moto.deny_key(&key.access_key_id, status);
                revoked.push(key.access_key_id);
                if !wait(&mut || moto.refused() > before) {
                    return revoked;
                }
            }
            revoked
        })
    };
    let run = job.run(None);
    done.store(true, Ordering::Relaxed);
    let revoked = revoker.join().expect("the revoking thread");
    let summary = run.expect("the run goes on with new credentials");
    assert_eq!(summary.rows_total, ROWS, "{summary:?}");
    assert_eq!(revoked.len(), 2, "both refusals were set up mid-run: {revoked:?}");
    let refused = moto.refused();
    assert!(refused >= 2, "requests signed with the revoked keys were refused: {refused}");
    let vended = rest.vended();
    assert!(vended.len() > 2, "new credentials were loaded after each refusal: {vended:?}");

    // Read back with a key that was never refused.
    let catalog = CatalogGrant::open_rest_at("sluice", &rest.uri(), root, None, stores).expect("catalog");
    let table = read_iceberg_from(&catalog, TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
}
