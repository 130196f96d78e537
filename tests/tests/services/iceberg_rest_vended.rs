//! An Iceberg REST catalog whose warehouse is on S3 (moto's server on
//! 127.0.0.1) and which vends the storage credentials: the host asks for
//! them (`X-Iceberg-Access-Delegation: vended-credentials`), signs the
//! plugin's `file-io` requests for the table's files and its own reads of
//! the table with them, and loads the table again for new ones before they
//! expire.
//!
//! Moto checks no signature, so expiry is made observable: every vended
//! set has an access key id of its own (the REST double records each with
//! its expiry), and moto's recorder logs each request's `Authorization`
//! (which names the access key id) and `X-Amz-Date` (when it was signed).

use std::time::{Duration, Instant};

use sluice::capability::catalog::CatalogGrant;
use sluice_tests::harness::VendingLake;
use sluice_tests::store_servers::Moto;
use sluice_tests::{assert_exactly_once_range, read_iceberg_from};

const BUCKET: &str = "lake";
const TABLE: &str = "db.events";
const LIFETIME: Duration = Duration::from_millis(2500);

/// Seconds since the Unix epoch of an `X-Amz-Date` (`YYYYMMDDTHHMMSSZ`).
fn amz_date_secs(d: &str) -> Option<i64> {
    let n = |r: std::ops::Range<usize>| d.get(r).and_then(|s| s.parse::<i64>().ok());
    let (y, m, day) = (n(0..4)?, n(4..6)?, n(6..8)?);
    let (hh, mm, ss) = (n(9..11)?, n(11..13)?, n(13..15)?);
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + hh * 3600 + mm * 60 + ss)
}

/// The access key id an `Authorization` header names (`AWS4-HMAC-SHA256 Credential=<id>/…`).
fn access_key_id(authorization: &str) -> Option<&str> {
    authorization.split("Credential=").nth(1)?.split('/').next()
}

#[test]
fn vended_credentials_sign_the_tables_files_and_are_refreshed_through_a_long_run() {
    let moto = Moto::start_recording(&[BUCKET]);
    // The job's `[sink.s3]` default (the AWS environment) reaches moto with
    // the test's own key, which must sign none of the table's files.
    let lake = VendingLake::start(&moto, BUCKET, LIFETIME);
    let (rest, stores, root) = (&lake.rest, &lake.stores, &lake.root);

    const ROWS: u64 = 22_000;
    let scratch = tempfile::tempdir().expect("scratch");
    let mut job = lake.job("rest-vended", scratch.path(), TABLE, ROWS);
    // 1000 rows/s over both subtasks: 22 s, a checkpoint about every second.
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 100\nrate = 1000.0");
    let start = Instant::now();
    job.run(None).expect("run");
    let took = start.elapsed();
    assert!(took >= Duration::from_secs(20), "the run lasted {took:?}, not long enough for refreshes");

    let vended = rest.vended();
    let least = (took.as_millis() / LIFETIME.as_millis()) as usize;
    assert!(vended.len() >= least, "{} sets vended in {took:?}, expected at least {least}", vended.len());

    // Every request for the table's files the plugin wrote or read: signed
    // with a vended set that had not expired when it was signed.
    let mut used = std::collections::BTreeSet::new();
    let mut checked = 0;
    for r in moto.recorded() {
        let url = r["url"].as_str().unwrap_or_default();
        if !url.contains("/lake/wh/db/events/") || url.contains(".metadata.json") {
            continue; // the double's own metadata writes and reads
        }
        let headers = &r["headers"];
        let header = |name: &str| {
            headers
                .as_object()
                .and_then(|h| h.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)))
                .and_then(|(_, v)| v.as_str())
                .unwrap_or_default()
        };
        let key = access_key_id(header("Authorization")).unwrap_or_default().to_string();
        let signed = amz_date_secs(header("X-Amz-Date")).unwrap_or_else(|| panic!("no X-Amz-Date on {url}"));
        let set = vended
            .iter()
            .find(|v| v.access_key_id == key)
            .unwrap_or_else(|| panic!("{} {url} was signed with {key:?}, not a vended key", r["method"]));
        // X-Amz-Date has whole seconds: signed at most 1 s past the expiry's second.
        assert!(
            signed * 1000 <= set.expires_at_ms as i64,
            "{} {url} was signed at {signed} s with {key}, which expired at {} ms",
            r["method"],
            set.expires_at_ms
        );
        used.insert(key);
        checked += 1;
    }
    assert!(checked > 50, "the table's files were written through moto: {checked} requests");
    assert!(used.len() >= 5, "requests were signed with several successive sets: {used:?}");
    let newest = vended.last().map(|v| v.access_key_id.clone()).unwrap_or_default();
    eprintln!("{took:?}: {} sets vended, {} used for {checked} requests; newest {newest}", vended.len(), used.len());

    // The host's reader, through the catalog: rows exactly once.
    let catalog = CatalogGrant::open_rest_at("sluice", &rest.uri(), root, None, stores).expect("catalog");
    let table = read_iceberg_from(&catalog, TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    table.assert_no_checkpoint_twice();
    assert!(catalog.vended_credentials_received() >= 1, "the reader's load came with vended credentials");
}
