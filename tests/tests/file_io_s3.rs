//! The `file-io` capability on an S3 grant, against moto's S3 server on
//! 127.0.0.1 (`sluice_tests::store_servers`), through the host's in-process
//! API (`sluice::capability::file_io::FileGrants`, the same code the WIT
//! interface calls): exclusive creates, streaming multipart uploads, ranged
//! reads, one-level lists, stat, delete, the refused rename, and locations
//! outside the grant refused before any request reaches the server.

use sluice::bindings::v0_2::sluice::connector::file_io::IoError;
use sluice::capability::file_io::{FileGrants, StoreConfig};
use sluice_store::{S3Credentials, S3Options};
use sluice_tests::store_servers::{self as moto, Moto};

fn grants(server: &Moto, rw: &[&str], ro: &[&str]) -> FileGrants {
    let stores = StoreConfig {
        s3: S3Options {
            region: Some(moto::REGION.to_string()),
            endpoint: Some(server.endpoint.clone()),
            credentials: Some(S3Credentials {
                access_key_id: moto::ACCESS_KEY_ID.to_string(),
                secret_access_key: moto::SECRET_ACCESS_KEY.to_string(),
                session_token: None,
            }),
        },
        gcs: Default::default(),
    };
    let rw: Vec<String> = rw.iter().map(|s| s.to_string()).collect();
    let ro: Vec<String> = ro.iter().map(|s| s.to_string()).collect();
    let base = tempfile::tempdir().expect("base dir");
    FileGrants::with_stores(base.path(), &rw, &ro, &stores).expect("S3 grants")
}

#[test]
fn whole_files_are_created_exclusively_read_listed_and_deleted() {
    let server = Moto::start(&["lake"]);
    let g = grants(&server, &["s3://lake/wh"], &[]);

    g.write_file("s3://lake/wh/t/a.parquet", b"first", false).expect("first create");
    let err = g.write_file("s3://lake/wh/t/a.parquet", b"second", false).expect_err("taken");
    assert!(matches!(&err, IoError::AlreadyExists(u) if u == "s3://lake/wh/t/a.parquet"), "{err:?}");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 0, 100).expect("read"), b"first", "the first stays");
    g.write_file("s3://lake/wh/t/a.parquet", b"replaced", true).expect("overwrite");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 2, 3).expect("ranged read"), b"pla");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 6, 100).expect("read to the end"), b"ed");
    assert_eq!(g.read("s3://lake/wh/t/a.parquet", 100, 5).expect("read past the end"), b"");

    g.write_file("s3://lake/wh/t/b", b"bb", false).expect("create");
    g.write_file("s3://lake/wh/t/sub/c", b"ccc", false).expect("create");
    g.write_file("s3://lake/wh/t-other/d", b"d", false).expect("create");
    g.create_dir_all("s3://lake/wh/t/empty").expect("a folder needs no request");
    assert_eq!(g.list_dir("s3://lake/wh/t").expect("list"), vec!["a.parquet", "b", "sub"], "one level, not t-other");
    assert_eq!(g.list_dir("s3://lake/wh").expect("list root"), vec!["t", "t-other"]);
    assert!(matches!(g.list_dir("s3://lake/wh/nothing"), Err(IoError::NotFound(_))));

    let file = g.stat("s3://lake/wh/t/b").expect("stat a file");
    assert_eq!((file.size, file.is_dir), (2, false));
    let dir = g.stat("s3://lake/wh/t/sub").expect("stat a folder");
    assert_eq!((dir.size, dir.is_dir), (0, true));
    assert!(matches!(g.stat("s3://lake/wh/t/missing"), Err(IoError::NotFound(_))));
    assert!(g.exists("s3://lake/wh/t/sub").expect("exists"));
    assert!(g.exists("s3://lake/wh").expect("the root exists"));
    assert!(!g.exists("s3://lake/wh/t/su").expect("a prefix of a name is not a folder"));

    let err = g.rename("s3://lake/wh/t/b", "s3://lake/wh/t/b2").expect_err("no rename on S3");
    assert!(matches!(&err, IoError::Other(m) if m.contains("cannot rename on an object store")), "{err:?}");
    assert!(g.exists("s3://lake/wh/t/b").expect("exists"), "the refused rename changed nothing");

    g.delete("s3://lake/wh/t/b").expect("delete a file");
    assert!(matches!(g.delete("s3://lake/wh/t/b"), Err(IoError::NotFound(_))));
    g.delete("s3://lake/wh/t").expect("delete a folder");
    assert!(!g.exists("s3://lake/wh/t").expect("exists"));
    assert_eq!(g.list_dir("s3://lake/wh").expect("list root"), vec!["t-other"], "t-other is not inside t");
}

#[test]
fn output_files_stream_a_multipart_upload_created_exclusively() {
    let server = Moto::start(&["lake"]);
    let g = grants(&server, &["s3://lake/wh"], &[]);
    // 20 MiB in 1 MiB writes: three parts of 8 MiB at most.
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut out = g.create_output("s3://lake/wh/big.bin", false).expect("create");
    for _ in 0..20 {
        out.write(chunk.clone()).expect("write");
    }
    assert!(!g.exists("s3://lake/wh/big.bin").expect("exists"), "nothing is visible before finish");
    out.finish().expect("finish");
    assert_eq!(g.stat("s3://lake/wh/big.bin").expect("stat").size, 20 << 20);
    let tail = g.read("s3://lake/wh/big.bin", (20 << 20) - 3, 10).expect("read the tail");
    assert_eq!(tail, chunk[chunk.len() - 3..]);
    let log = server.log();
    assert!(log.contains("uploadId="), "a multipart upload: {log}");

    // A second exclusive create of the same key: refused, the first stays.
    let mut again = g.create_output("s3://lake/wh/big.bin", false).expect("create");
    let result = again.write(b"small".to_vec()).and_then(|()| again.finish());
    assert!(matches!(&result, Err(IoError::AlreadyExists(u)) if u == "s3://lake/wh/big.bin"), "{result:?}");
    assert_eq!(g.stat("s3://lake/wh/big.bin").expect("stat").size, 20 << 20);

    // Overwriting is allowed when asked for.
    let mut replace = g.create_output("s3://lake/wh/big.bin", true).expect("create");
    replace.write(b"small".to_vec()).expect("write");
    replace.finish().expect("finish");
    assert_eq!(g.read("s3://lake/wh/big.bin", 0, 100).expect("read"), b"small");

    // Dropped unfinished: never visible.
    let mut dropped = g.create_output("s3://lake/wh/partial.bin", false).expect("create");
    dropped.write(chunk.clone()).expect("write");
    drop(dropped);
    assert!(matches!(g.stat("s3://lake/wh/partial.bin"), Err(IoError::NotFound(_))));
}

#[test]
fn locations_outside_the_grant_never_reach_the_server() {
    let server = Moto::start(&["lake", "other"]);
    let g = grants(&server, &["s3://lake/wh"], &["s3://lake/ro"]);
    g.write_file("s3://lake/wh/inside", b"x", false).expect("inside");
    for location in [
        "s3://lake/wh-other/escape",
        "s3://other/wh/escape",
        "s3://lake/wh/../escape",
        "s3://lake/wh/%2e%2e/escape",
        "s3://lake/wh%2Fescape",
        "gs://lake/wh/escape",
    ] {
        let err = g.write_file(location, b"x", true).expect_err("outside");
        assert!(matches!(&err, IoError::Denied(_)), "{location}: {err:?}");
        assert!(matches!(g.read(location, 0, 1), Err(IoError::Denied(_))), "{location}");
    }
    let err = g.write_file("s3://lake/ro/x", b"x", false).expect_err("read-only");
    assert!(matches!(&err, IoError::Denied(m) if m.contains("read-only")), "{err:?}");
    let log = server.log();
    assert!(log.contains("/lake/wh/inside"), "the server logs each request: {log}");
    assert!(!log.contains("escape") && !log.contains("/lake/ro/x"), "a refused location was sent: {log}");
}
