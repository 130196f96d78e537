//! `sluice-store`'s own GCS requests (exclusive create, compare-and-swap,
//! versioned read: `store/src/gcs.rs`) signed with Application Default
//! Credentials, here the metadata server's token endpoint (the token double,
//! `tests/src/token_server.rs`, found through `GCE_METADATA_HOST`), against
//! fake-gcs-server. fake-gcs-server checks no token, so what this shows is
//! that the requests are signed through the ADC chain (a token is fetched,
//! with `Metadata-Flavor: Google`, and cached) and that a chain with no
//! source fails naming what it tried; the double's tokens outlive reqsign's
//! refresh margin (120 s; it refuses tokens of under 10 s), so one serves
//! the whole test.
//!
//! One test in this binary: it sets the process's environment (`HOME`
//! without gcloud's ADC file, no `GOOGLE_APPLICATION_CREDENTIALS`), which a
//! store reads when it is built.

use std::time::Duration;

use bytes::Bytes;
use sluice_store::{GcsOptions, ObjectStore, StoreError};
use sluice_tests::store_servers::FakeGcs;
use sluice_tests::token_server::TokenServer;

fn signed(server: &FakeGcs) -> ObjectStore {
    let options = GcsOptions { endpoint: Some(server.endpoint.clone()), anonymous: false };
    ObjectStore::gcs("lake", &options).expect("a GCS store on fake-gcs-server")
}

#[test]
fn gcs_requests_are_signed_with_application_default_credentials() {
    let tokens = TokenServer::start(Duration::from_secs(3600)).expect("starting the token double");
    let server = FakeGcs::start(&["lake"]);
    let home = tempfile::tempdir().expect("an empty HOME");
    // A port nothing listens on, for the chain with no source.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr");
    // SAFETY: the only test of this binary, before it starts any thread of its own.
    unsafe {
        std::env::remove_var("GOOGLE_APPLICATION_CREDENTIALS");
        std::env::set_var("HOME", home.path());
        std::env::set_var("GCE_METADATA_HOST", tokens.host());
    }
    let gcs = signed(&server);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let first = gcs.create_exclusive("lease", Bytes::from_static(b"a")).await.expect("create").expect("gen");
        let read = gcs.read_versioned("lease").await.expect("read");
        assert_eq!(read.etag, first);
        gcs.replace_if("lease", Bytes::from_static(b"b"), &first).await.expect("swap");
        let err = gcs.replace_if("lease", Bytes::from_static(b"c"), &first).await.expect_err("stale");
        assert!(matches!(err, StoreError::Conflict { .. }), "{err:?}");
    });
    assert_eq!(tokens.issued(), 1, "one token, fetched from the metadata server and cached for every request");
    assert_eq!(tokens.refused(), 0, "the token request carried Metadata-Flavor: Google");

    // No source of credentials at all: the request is not sent, and the
    // error says what was tried and what to do.
    // SAFETY: as above; the runtime's work is done.
    unsafe { std::env::set_var("GCE_METADATA_HOST", closed.to_string()) };
    let unsigned = signed(&server);
    let err = rt.block_on(unsigned.create_exclusive("other", Bytes::from_static(b"x"))).expect_err("no credentials");
    let message = err.to_string();
    for part in ["gs://lake/other", "no Google access token", "GOOGLE_APPLICATION_CREDENTIALS", "GCE_METADATA_HOST"] {
        assert!(message.contains(part), "{part:?} in: {message}");
    }
    assert!(matches!(err, StoreError::Denied { .. }), "{err:?}");
    assert!(matches!(rt.block_on(gcs.read("other")), Err(StoreError::NotFound { .. })), "nothing was written");
}
