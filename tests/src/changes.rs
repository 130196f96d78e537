//! Change streams for the upsert tests (issue 41): JSON-lines change files
//! (`op` the change column, `id` the key, `name` and `v` the row), the
//! model a stream must end in, and the rows three readers see.
//!
//! Invariants: the model applies changes in file and line order, an
//! operation spelled `delete` or `d` (any case, any surrounding spaces)
//! deletes its key and every other spelling upserts it; every read of a
//! table goes through PyIceberg and DuckDB's `iceberg_scan`, which must
//! agree, or the read panics naming both counts.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;

use crate::{DUCKDB_ICEBERG, ICEBERG_PLUGIN, TestJob, python};

/// A row as the readers give it: `(id, name, v)`.
pub type Row = (i64, String, i64);

/// One change as a file spells it: `(op, id, v)`; the row's name is `n<id>-<v>`.
pub type Change = (&'static str, i64, i64);

/// Whether `op` (as a file spells it) deletes its key.
pub fn is_delete(op: &str) -> bool {
    matches!(op.trim().to_ascii_lowercase().as_str(), "delete" | "d")
}

/// A change-stream job over `in/*.jsonl` of its folder (`op` the change
/// column, `id` the key) into `table` of `warehouse` in upsert mode, with
/// `source` and `sink` lines added to `[source]` and `[sink.options]`.
pub fn upsert_job(
    id: &str,
    warehouse: &Path,
    table: &str,
    parallelism: u32,
    every_rows: u64,
    source: &str,
    sink: &str,
) -> TestJob {
    let dir = tempfile::tempdir().expect("dir");
    std::fs::create_dir_all(dir.path().join("in")).expect("in/");
    let warehouse = warehouse.display();
    let toml = format!(
        r#"[job]
id = "{id}"
parallelism = {parallelism}
state_dir = "state"
[job.checkpoint]
every_rows = {every_rows}
[source]
kind = "file"
path = "in"
change_column = "op"
key = ["id"]
{source}
[sink]
id = "lake"
plugin = "{ICEBERG_PLUGIN}"
[sink.options]
table = "{table}"
mode = "upsert"
{sink}
[sink.catalog]
database = "{warehouse}/catalog.db"
warehouse = "{warehouse}"
[sink.sandbox]
memory_mb = 512
"#
    );
    TestJob { dir, toml }
}

/// Writes `files` as `in/00N.jsonl` of `job`'s folder, in name order.
pub fn write_changes<S: AsRef<str>>(job: &TestJob, files: &[Vec<(S, i64, i64)>]) {
    for (n, lines) in files.iter().enumerate() {
        let text: String = lines
            .iter()
            .map(|(op, id, v)| {
                let row = serde_json::json!({"op": op.as_ref(), "id": id, "name": format!("n{id}-{v}"), "v": v});
                format!("{row}\n")
            })
            .collect();
        std::fs::write(job.dir.path().join("in").join(format!("{n:03}.jsonl")), text).expect("jsonl");
    }
}

/// The model: every key in its last state, applied in file and line order.
pub fn model<S: AsRef<str>>(files: &[Vec<(S, i64, i64)>]) -> Vec<Row> {
    let mut keys: BTreeMap<i64, Row> = BTreeMap::new();
    for (op, id, v) in files.iter().flatten() {
        if is_delete(op.as_ref()) {
            keys.remove(id);
        } else {
            keys.insert(*id, (*id, format!("n{id}-{v}"), *v));
        }
    }
    keys.into_values().collect()
}

/// Every row of `table`, sorted, as PyIceberg reads it; panics when
/// DuckDB's `iceberg_scan` reads anything else, or (with `version`) the
/// table is of another format version. Empty before the table has a
/// snapshot.
pub fn read_rows(warehouse: &Path, table: &str, version: Option<u8>) -> Vec<Row> {
    let script = format!(
        "{DUCKDB_ICEBERG}\n\
         import sys, json\n\
         from pyiceberg.catalog.sql import SqlCatalog\n\
         w, name, version = sys.argv[1], sys.argv[2], int(sys.argv[3])\n\
         t = SqlCatalog('sluice', uri=f'sqlite:///{{w}}/catalog.db', warehouse=f'file://{{w}}').load_table(name)\n\
         assert version == 0 or t.format_version == version, f'format version {{t.format_version}}'\n\
         if t.current_snapshot() is None:\n\
         \x20   print('[]'); sys.exit(0)\n\
         a = t.scan(selected_fields=('id', 'name', 'v')).to_arrow()\n\
         py = sorted([i, n, v] for i, n, v in zip(a.column('id').to_pylist(), a.column('name').to_pylist(), a.column('v').to_pylist()))\n\
         con = _duckdb.connect()\n\
         con.execute('SET enable_progress_bar = false')\n\
         for ext in ('avro', 'iceberg'):\n\
         \x20   con.load_extension(_duckdb_extension(ext))\n\
         path = t.metadata_location.removeprefix('file://')\n\
         dd = sorted([i, n, v] for i, n, v in con.execute('select id, name, v from iceberg_scan(?)', [path]).fetchall())\n\
         if py != dd:\n\
         \x20   sys.exit(f'PyIceberg reads {{len(py)}} rows, DuckDB {{len(dd)}} ({{t.metadata_location}}): {{py}} / {{dd}}')\n\
         print(json.dumps(py))"
    );
    let version = version.unwrap_or(0).to_string();
    let out = python(&script, &[&warehouse.display().to_string(), table, &version])
        .unwrap_or_else(|e| panic!("reading {table} with PyIceberg and DuckDB: {e}"));
    serde_json::from_str(out.trim()).expect("rows as JSON")
}

/// The rows of `table` as the host's iceberg-rust reader reads them,
/// sorted; panics when a checkpoint was committed twice.
pub fn native_rows(warehouse: &Path, table: &str) -> Vec<Row> {
    use arrow_schema::{DataType, Field, Schema};
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("v", DataType::Int64, true),
    ]));
    let table = crate::read_iceberg_as(&crate::catalog(warehouse), table, &schema);
    table.assert_no_checkpoint_twice();
    let b = &table.rows;
    let ids = b.column(0).as_primitive::<Int64Type>();
    let names = b.column(1).as_string::<i32>();
    let vs = b.column(2).as_primitive::<Int64Type>();
    let mut out: Vec<Row> =
        (0..b.num_rows()).map(|i| (ids.value(i), names.value(i).to_string(), vs.value(i))).collect();
    out.sort();
    out
}

/// No key holds two rows: nothing was applied twice.
pub fn assert_each_key_once(rows: &[Row]) {
    let mut ids: Vec<i64> = rows.iter().map(|r| r.0).collect();
    ids.dedup();
    assert_eq!(ids.len(), rows.len(), "a key holds two rows: {rows:?}");
}

/// Every row of a table mid-run is a state its key had at some point of
/// the stream (a deleted row never comes back from before its delete
/// unless the stream inserted it again, and no row is invented).
pub fn assert_states_of_the_stream<S: AsRef<str>>(rows: &[Row], files: &[Vec<(S, i64, i64)>]) {
    for (id, name, v) in rows {
        let seen = files.iter().flatten().any(|(op, i, w)| i == id && w == v && !is_delete(op.as_ref()));
        assert!(seen && *name == format!("n{id}-{v}"), "row {id}/{name}/{v} is no state of key {id}");
    }
}
