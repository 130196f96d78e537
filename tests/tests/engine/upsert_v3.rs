//! The Iceberg sink's `mode = "upsert"` on a table it creates with
//! `format_version = 3` (issue 41, point 3): deletes are deletion vectors
//! (Puffin `deletion-vector-v1` blobs), at most one live per data file, a
//! data file deleted from in two checkpoints getting one vector that
//! merges both and replaces the first.
//!
//! Readers: PyIceberg 0.12 and DuckDB 1.5.5's `iceberg_scan` read
//! deletion vectors; both read every table back and must agree with each
//! other and, key by key, with the model the test computes. iceberg-rust
//! 0.10's Arrow reader does not read them (it reads every delete file as
//! Parquet), so the host's reader is no third reader on a v3 table; on the
//! v2 table of `an_existing_table_keeps_its_format_version` it is.

use std::path::Path;

use iceberg::spec::{DataContentType, DataFileFormat, FormatVersion};
use sluice::engine::{CrashPoint, Fault};
use sluice_tests::TestJob;
use sluice_tests::changes::{
    self, Change, Row, assert_each_key_once, assert_states_of_the_stream, model, native_rows,
    write_changes as write_stream,
};

const TABLE: &str = "crm.accounts";

/// A change-stream job over `in/*.jsonl` (`op` the change column, `id`
/// the key) into `TABLE` of `warehouse`, in upsert mode, creating the
/// table in format version `version`.
fn job(id: &str, warehouse: &Path, parallelism: u32, every_rows: u64, version: u8) -> TestJob {
    changes::upsert_job(
        id,
        warehouse,
        TABLE,
        parallelism,
        every_rows,
        "batch_rows = 3",
        &format!("format_version = {version}"),
    )
}

/// Three files in name order. The first inserts 16 keys (at 4 rows a
/// checkpoint, 4 data files at parallelism 1); the second updates and
/// deletes a key of each of them (a vector per data file); the third
/// changes other keys of the same data files and key 1 again, whose row
/// the second file moved into a data file of its own: vectors merged, and
/// a key updated twice in different checkpoints.
fn stream() -> Vec<Vec<Change>> {
    vec![
        (1..=16).map(|i| ("insert", i, 1)).collect(),
        vec![
            ("update", 1, 2),
            ("delete", 6, 0),
            ("u", 11, 2),
            ("d", 16, 0),
            ("insert", 17, 1),
            ("update", 2, 2),
            ("update", 7, 2),
            ("delete", 12, 0),
        ],
        vec![
            ("update", 1, 3),
            ("update", 3, 3),
            ("delete", 8, 0),
            ("update", 9, 3),
            ("delete", 13, 0),
            ("u", 14, 3),
            ("insert", 6, 3),
            ("d", 17, 0),
            ("update", 2, 3),
            ("delete", 4, 0),
        ],
    ]
}

/// Every row, sorted, as PyIceberg reads it; panics when DuckDB's
/// `iceberg_scan` reads anything else, or the table is not of `version`.
fn rows(warehouse: &Path, version: u8) -> Vec<Row> {
    changes::read_rows(warehouse, TABLE, Some(version))
}

fn load(warehouse: &Path) -> Option<iceberg::table::Table> {
    sluice_tests::catalog(warehouse).load(&iceberg::TableIdent::from_strs(TABLE.split('.')).expect("name")).ok()
}

/// Checks the live delete files of the v3 table: every one a deletion
/// vector (Puffin, position deletes, naming a live data file, with its
/// blob's offset and size), at most one per data file, the blob where its
/// entry says (the spec's magic after the 4-byte length). Gives how many
/// are live and how many snapshots of job `id` removed one (a merge).
fn vectors(warehouse: &Path, id: &str) -> (usize, usize) {
    let table = load(warehouse).expect("the table");
    let metadata = table.metadata();
    assert_eq!(metadata.format_version(), FormatVersion::V3);
    let Some(head) = metadata.current_snapshot() else { return (0, 0) };
    let (mut data, mut deletes) = (Vec::new(), Vec::new());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let list = table.manifest_list_reader(head).load().await.expect("manifest list");
        for m in list.entries() {
            let manifest = m.load_manifest(table.file_io()).await.expect("manifest");
            for e in manifest.entries().iter().filter(|e| e.is_alive()) {
                match e.data_file().content_type() {
                    DataContentType::Data => data.push(e.data_file().file_path().to_string()),
                    _ => deletes.push(e.data_file().clone()),
                }
            }
        }
    });
    let mut targets = std::collections::BTreeSet::new();
    for d in &deletes {
        assert_eq!((d.content_type(), d.file_format()), (DataContentType::PositionDeletes, DataFileFormat::Puffin));
        let (Some(offset), Some(size)) = (d.content_offset(), d.content_size_in_bytes()) else {
            panic!("vector {} has no content_offset/content_size_in_bytes", d.file_path())
        };
        let bytes = std::fs::read(d.file_path().trim_start_matches("file://")).expect("the Puffin file");
        assert_eq!(&bytes[..4], b"PFA1");
        let blob = &bytes[offset as usize..(offset + size) as usize];
        assert_eq!(&blob[4..8], [0xD1, 0xD3, 0x39, 0x64], "the blob of {}", d.file_path());
        let target = d.referenced_data_file().expect("a vector names its data file");
        assert!(data.contains(&target), "vector {} of a data file not live", d.file_path());
        assert!(targets.insert(target.clone()), "two live vectors of {target}");
    }
    let mut merges = 0;
    let mut next = metadata.current_snapshot_id();
    while let Some(s) = next.and_then(|s| metadata.snapshot_by_id(s)) {
        let props = &s.summary().additional_properties;
        let removed = props.get("removed-delete-files").and_then(|n| n.parse::<u64>().ok()).unwrap_or(0);
        if props.get("sluice.job-id").map(String::as_str) == Some(id) && removed > 0 {
            merges += 1;
        }
        next = s.parent_snapshot_id();
    }
    (deletes.len(), merges)
}

/// Every key ends in its last state as PyIceberg and DuckDB read it, at
/// parallelism 1 and 2; the deletes are deletion vectors, one per data
/// file, and checkpoints merged vectors; a rerun changes nothing.
#[test]
fn deletion_vectors_land_each_key_in_its_last_state() {
    for parallelism in [1, 2] {
        let warehouse = tempfile::tempdir().expect("warehouse");
        let files = stream();
        let id = format!("dv{parallelism}");
        let run = job(&id, warehouse.path(), parallelism, 4, 3);
        write_stream(&run, &files);
        run.run(None).expect("the upsert run");
        let got = rows(warehouse.path(), 3);
        assert_each_key_once(&got);
        assert_eq!(got, model(&files), "parallelism {parallelism}");
        let (live, merges) = vectors(warehouse.path(), &id);
        assert!(live > 0, "no deletion vector is live");
        assert!(merges > 0, "no checkpoint merged a deletion vector (parallelism {parallelism})");
        run.run(None).expect("the rerun");
        assert_eq!(rows(warehouse.path(), 3), model(&files));
        assert_eq!(vectors(warehouse.path(), &id), (live, merges));
    }
}

/// An existing table keeps its version: a v2 table a job created stays v2
/// (position-delete files, read by iceberg-rust as well) when a later job
/// asks for 3.
#[test]
fn an_existing_table_keeps_its_format_version() {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let first = job("v2", warehouse.path(), 1, 100, 2);
    write_stream(&first, &files[..1]);
    first.run(None).expect("the v2 run");
    let run = job("v3", warehouse.path(), 1, 4, 3);
    write_stream(&run, &files);
    run.run(None).expect("the run asking for v3");
    assert_eq!(load(warehouse.path()).expect("the table").metadata().format_version(), FormatVersion::V2);
    let got = rows(warehouse.path(), 2);
    assert_eq!(got, model(&files));
    assert_eq!(native_rows(warehouse.path(), TABLE), got);
}

fn crash_then_recover(point: CrashPoint, checkpoint: u64) {
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let id = format!("crash-{point}-{checkpoint}");
    let run = job(&id, warehouse.path(), 1, 4, 3);
    write_stream(&run, &files);
    let err = run.run(Some(Fault { point, checkpoint, subtask: 0 })).expect_err("the crash");
    assert!(err.is_injected_crash(), "{err}");
    if load(warehouse.path()).is_some_and(|t| t.metadata().current_snapshot().is_some()) {
        let mid = rows(warehouse.path(), 3);
        assert_each_key_once(&mid);
        assert_states_of_the_stream(&mid, &files);
        vectors(warehouse.path(), "");
    }
    run.run(None).expect("the recovery run");
    let got = rows(warehouse.path(), 3);
    assert_each_key_once(&got);
    assert_eq!(got, model(&files));
    let (_, merges) = vectors(warehouse.path(), &id);
    assert!(merges > 0, "no checkpoint merged a deletion vector");
}

// 34 changes, 4 per checkpoint: 1 to 4 insert, 5 and 6 write the first
// vectors of those data files, 7 to 9 merge into them.
sluice_tests::crash_tests! {
    crash_after_prepare_commit: CrashPoint::AfterPrepareCommit, 5;
    crash_after_persist: CrashPoint::AfterPersist, 6;
    crash_during_commit: CrashPoint::DuringCommit, 7;
    crash_after_commit: CrashPoint::AfterCommit, 8;
    crash_after_persist_merge: CrashPoint::AfterPersist, 9;
}

/// Catalog faults on commits that write and merge vectors: a lost reply
/// (applied) is settled by the watermark, not applied again; a conflict is
/// retried on the new head with vectors planned anew from it (the vector
/// it would have replaced read again); a crash right after the catalog
/// applied a commit is recovered as already committed.
#[test]
fn lost_replies_conflicts_and_a_crash_after_apply_merge_each_vector_once() {
    use sluice::engine::RunOptions;
    use sluice::fault::{CatalogFaults, CommitFault, Faults};
    let warehouse = tempfile::tempdir().expect("warehouse");
    let files = stream();
    let run = job("faulty", warehouse.path(), 1, 4, 3);
    write_stream(&run, &files);
    // Catalog commit calls: c1..c4 insert, c5 on write and merge vectors.
    let faults = vec![
        (5, CommitFault::LoseReply),
        (6, CommitFault::Conflict),
        (8, CommitFault::Conflict),
        (9, CommitFault::LoseReply),
        (10, CommitFault::CrashAfterApply),
    ];
    let catalog = CatalogFaults { faults, ..CatalogFaults::default() };
    let opts = RunOptions { faults: Faults { catalog, ..Faults::default() }, ..RunOptions::default() };
    let err = run.run_opts(&[], opts).expect_err("the crash after apply");
    assert!(err.is_injected_crash(), "{err}");
    let mid = rows(warehouse.path(), 3);
    assert_each_key_once(&mid);
    assert_states_of_the_stream(&mid, &files);
    vectors(warehouse.path(), "faulty");
    run.run(None).expect("the recovery run");
    assert_eq!(rows(warehouse.path(), 3), model(&files));
    let (_, merges) = vectors(warehouse.path(), "faulty");
    assert!(merges > 0, "no checkpoint merged a deletion vector");
}
