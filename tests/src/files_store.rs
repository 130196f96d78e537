//! Reads what the files sink committed on an object store, by the rule its
//! docs give readers (`guest/files/src/lib.rs`, README "Landing in the
//! cloud"): a table's committed checkpoints are its commit markers
//! `<table dir>/<job>.<sink>.<incarnation>.c<10 digits>.json`, each naming
//! its data objects; **a data object counts only if a marker names it**.
//!
//! Invariants: every object a marker names must exist with the size the
//! marker records (else the reader panics, naming it); data objects no
//! marker names are reported apart ([`Committed::unnamed`]), never read as
//! rows.

use std::collections::BTreeSet;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use serde::Deserialize;
use sluice_store::ObjectStore;

/// A commit marker, as the files sink writes it (`committer::Marker`).
#[derive(Debug, Clone, Deserialize)]
pub struct Marker {
    pub format: String,
    pub job: String,
    pub sink: String,
    pub incarnation: String,
    pub checkpoint: u64,
    pub table: String,
    pub rows: u64,
    pub files: Vec<MarkerFile>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct MarkerFile {
    pub location: String,
    pub rows: u64,
    pub bytes: u64,
}

/// What a table's directory on the store holds.
#[derive(Debug)]
pub struct Committed {
    /// Its markers, by name order.
    pub markers: Vec<Marker>,
    /// The rows of every data object the markers name, in marker order.
    pub batches: Vec<RecordBatch>,
    /// Data objects under `<path>/_sluice_data/` that no marker of any table
    /// names: leftovers of crashed attempts, not output.
    pub unnamed: Vec<String>,
}

fn block<T>(fut: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(fut)
}

/// Whether `name` is a commit marker's name.
pub fn is_marker(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".json") else { return false };
    let Some((_, checkpoint)) = stem.rsplit_once('.') else { return false };
    checkpoint.len() == 11 && checkpoint.starts_with('c') && checkpoint[1..].bytes().all(|b| b.is_ascii_digit())
}

/// The markers directly in the folder `dir` (a key prefix).
fn markers_in(store: &ObjectStore, dir: &str) -> Vec<Marker> {
    let names = block(store.list_level(dir)).unwrap_or_else(|e| panic!("listing {}: {e}", store.url(dir)));
    names
        .iter()
        .filter(|n| is_marker(n))
        .map(|n| {
            let key = format!("{dir}/{n}");
            let bytes = block(store.read(&key)).unwrap_or_else(|e| panic!("reading marker {}: {e}", store.url(&key)));
            let marker: Marker = serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("marker {} is not valid: {e}", store.url(&key)));
            assert_eq!(marker.format, "sluice-files-commit/1", "{}", store.url(&key));
            marker
        })
        .collect()
}

/// The key of a location in `store`'s bucket.
fn key_of<'a>(store: &ObjectStore, location: &'a str) -> &'a str {
    let root = format!("{}/", store.url(""));
    location.strip_prefix(root.as_str()).unwrap_or_else(|| panic!("{location} is not in {root}"))
}

/// What the files sink committed for the table whose directory is
/// `table_dir` (a key prefix: `<path>` for the single table, or
/// `<path>/<table>`), with `path` its output's prefix.
pub fn committed(store: &ObjectStore, path: &str, table_dir: &str) -> Committed {
    let markers = markers_in(store, table_dir);
    let mut batches = Vec::new();
    for marker in &markers {
        assert_eq!(marker.rows, marker.files.iter().map(|f| f.rows).sum::<u64>(), "{marker:?}");
        for file in &marker.files {
            let key = key_of(store, &file.location);
            let bytes = block(store.read(key)).unwrap_or_else(|e| panic!("a marker names {}: {e}", file.location));
            assert_eq!(bytes.len() as u64, file.bytes, "{} has the size its marker records", file.location);
            let reader = ParquetRecordBatchReaderBuilder::try_new(bytes).expect("parquet").build().expect("reader");
            let mut rows = 0;
            for b in reader {
                let b = b.expect("batch");
                rows += b.num_rows() as u64;
                batches.push(b);
            }
            assert_eq!(rows, file.rows, "{} holds the rows its marker records", file.location);
        }
    }
    let unnamed = unnamed(store, path);
    Committed { markers, batches, unnamed }
}

/// Data objects under `<path>/_sluice_data/` that no marker (of the single
/// table or of any table folder under `path`) names.
pub fn unnamed(store: &ObjectStore, path: &str) -> Vec<String> {
    let mut named = BTreeSet::new();
    let mut dirs = vec![path.to_string()];
    for name in block(store.list_level(path)).expect("list") {
        if !name.starts_with(['_', '.']) && !is_marker(&name) {
            dirs.push(format!("{path}/{name}"));
        }
    }
    for dir in dirs {
        for marker in markers_in(store, &dir) {
            named.extend(marker.files.iter().map(|f| key_of(store, &f.location).to_string()));
        }
    }
    let data = block(store.list(&format!("{path}/_sluice_data"))).expect("list data");
    data.into_iter().map(|o| o.key).filter(|k| !named.contains(k)).collect()
}

/// Every committed row of a single-table output, in the generator's schema,
/// sorted by id.
pub fn read_committed(store: &ObjectStore, path: &str) -> RecordBatch {
    let committed = committed(store, path, path);
    let schema = sluice::source::generator::Generator::schema_ref();
    crate::sort_by_id(&arrow_select::concat::concat_batches(&schema, &committed.batches).expect("concat"))
}

/// Every committed row of table `table` of a multi-table output, conformed
/// to `target`, sorted by id.
pub fn read_committed_table(store: &ObjectStore, path: &str, table: &str, target: &SchemaRef) -> RecordBatch {
    let committed = committed(store, path, &format!("{path}/{table}"));
    let conformed: Vec<RecordBatch> = committed
        .batches
        .iter()
        .map(|b| sluice::engine::tables::conform(b, target).expect("an older shape conforms"))
        .collect();
    crate::sort_by_id(&arrow_select::concat::concat_batches(target, &conformed).expect("concat"))
}
