//! The `columnar` capability (contract 0.2.1): Parquet encoded by the host.
//!
//! - The Iceberg plugin's data files, encoded by the host, are byte for byte
//!   the files iceberg-rust's own `ParquetWriter` writes for the same rows
//!   and properties, and the manifest describes them with the same
//!   statistics iceberg-rust computes (value, null and NaN counts, column
//!   sizes, lower and upper bounds, split offsets).
//! - What the host holds for a writer's open files counts against the
//!   instance's `sink.sandbox.host_memory_mb` (a budget too small stops the
//!   job, naming it, before anything is committed), and the plugin keeps it
//!   within `buffer_mb` however many partitions are open.
//! - Plain appends are encoded from the host's own batch (0.2.4,
//!   `project-input` and `write-input`): the same bytes as above, each
//!   partition's rows in its own files, and a table the plugin reads no
//!   column of lands whole.

use std::collections::HashMap;
use std::sync::Arc;

use iceberg::io::FileIO;
use iceberg::spec::{DataFile, Datum};
use iceberg::writer::file_writer::{FileWriter, FileWriterBuilder, ParquetWriterBuilder};
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use sluice::source::generator::Generator;
use sluice_tests::harness::block;
use sluice_tests::{TestJob, assert_exactly_once_range, catalog, read_iceberg};

const TABLE: &str = "db.events";

/// Every data file of the table's current snapshot.
fn data_files(table: &iceberg::table::Table) -> Vec<DataFile> {
    block(async {
        let snapshot = table.metadata().current_snapshot().expect("a snapshot");
        let list = table.manifest_list_reader(snapshot).load().await.expect("manifest list");
        let mut files = Vec::new();
        for manifest in list.entries() {
            let manifest = manifest.load_manifest(table.file_io()).await.expect("manifest");
            files.extend(manifest.entries().iter().map(|e| e.data_file().clone()));
        }
        files
    })
}

fn local_path(location: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(location.strip_prefix("file://").unwrap_or(location))
}

fn sorted<V: Clone>(m: &HashMap<i32, V>) -> Vec<(i32, V)> {
    let mut v: Vec<(i32, V)> = m.iter().map(|(k, v)| (*k, v.clone())).collect();
    v.sort_by_key(|(k, _)| *k);
    v
}

#[test]
fn host_encoded_files_are_iceberg_rusts_own_files_with_the_same_statistics() {
    const ROWS: u64 = 30_000;
    const BATCH: u64 = 700;
    let dir = tempfile::tempdir().expect("temp dir");
    // One writer, one checkpoint: one data file of ROWS rows, in batches of 700.
    let job = TestJob::iceberg("columnar", dir.path(), TABLE, ROWS, 0, 1, ROWS);
    let summary = job.run(None).expect("the job runs");
    assert_eq!(summary.rows_total, ROWS);
    let table = read_iceberg(dir.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    let files = data_files(&table.table);
    assert_eq!(files.len(), 1, "{files:?}");
    let sluice = &files[0];
    let sluice_bytes = std::fs::read(local_path(sluice.file_path())).expect("the Sluice data file");
    let reader = SerializedFileReader::new(bytes::Bytes::from(sluice_bytes.clone())).expect("a Parquet file");
    let created_by = reader.metadata().file_metadata().created_by().expect("created_by").to_string();
    assert!(created_by.starts_with("sluice iceberg sink"), "{created_by}");

    // iceberg-rust's own writer, natively, with the plugin's properties.
    let schema = table.table.metadata().current_schema().clone();
    let arrow = Arc::new(iceberg::arrow::schema_to_arrow_schema(&schema).expect("arrow schema"));
    let props = WriterProperties::builder()
        .set_compression(parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::default()))
        .set_max_row_group_bytes(Some(64 * 1024 * 1024 / 6))
        .set_created_by(created_by)
        .build();
    let native_path = dir.path().join("native.parquet");
    let native_path_str = native_path.to_str().expect("utf-8").to_string();
    let native: DataFile = block(async {
        let file_io = FileIO::new_with_fs();
        let output = file_io.new_output(&native_path_str).expect("output");
        let mut writer = ParquetWriterBuilder::new(props, schema.clone()).build(output).await.expect("writer");
        let mut at = 0;
        while at < ROWS {
            let end = ROWS.min(at + BATCH);
            let batch = sluice_bench::conform(&Generator::batch_for(at, end), &arrow).expect("conform");
            writer.write(&batch).await.expect("native write");
            at = end;
        }
        let mut builders = writer.close().await.expect("native close");
        assert_eq!(builders.len(), 1);
        builders.remove(0).partition_spec_id(0).build().expect("data file")
    });
    let native_bytes = std::fs::read(&native_path).expect("the native file");
    assert_eq!(sluice_bytes.len(), native_bytes.len(), "the same size");
    assert!(sluice_bytes == native_bytes, "the host's file is byte for byte iceberg-rust's");

    assert_eq!(sluice.record_count(), native.record_count());
    assert_eq!(sluice.file_size_in_bytes(), native.file_size_in_bytes());
    assert_eq!(sorted(sluice.column_sizes()), sorted(native.column_sizes()), "column sizes");
    assert_eq!(sorted(sluice.value_counts()), sorted(native.value_counts()), "value counts");
    assert_eq!(sorted(sluice.null_value_counts()), sorted(native.null_value_counts()), "null counts");
    assert_eq!(sorted(sluice.nan_value_counts()), sorted(native.nan_value_counts()), "NaN counts");
    let bounds = |m: &HashMap<i32, Datum>| sorted(m).into_iter().map(|(k, d)| (k, d.to_string())).collect::<Vec<_>>();
    assert_eq!(bounds(sluice.lower_bounds()), bounds(native.lower_bounds()), "lower bounds");
    assert_eq!(bounds(sluice.upper_bounds()), bounds(native.upper_bounds()), "upper bounds");
    assert_eq!(sluice.split_offsets(), native.split_offsets(), "split offsets");
    // Every column has statistics: the comparison compared something.
    assert_eq!(sluice.value_counts().len(), schema.as_struct().fields().len());
    assert!(sluice.lower_bounds().len() >= 7, "{:?}", sluice.lower_bounds());
    assert!(sluice.nan_value_counts().len() == 1, "the one double column: {:?}", sluice.nan_value_counts());
}

#[test]
fn host_memory_held_for_open_files_counts_against_the_sandbox_budget() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A row group is cut at buffer_mb / 6 = 170 MiB; 16 MiB (the smallest
    // budget) cannot hold what 1,200,000 rows grow it to (600,000 held 15.9 MB).
    let job = TestJob::iceberg("columnar-budget", dir.path(), TABLE, 1_200_000, 0, 1, 1_200_000);
    let sets = ["sink.sandbox.host_memory_mb=16", "sink.options.buffer_mb=\"1024\""];
    let err = job.run_with(&sets, None).expect_err("16 MiB cannot hold the row group");
    let message = err.to_string();
    assert!(message.contains("sink.sandbox.host_memory_mb"), "{message}");
    assert!(message.contains("Parquet writer of"), "{message}");
    let table = catalog(dir.path())
        .load(&iceberg::TableIdent::from_strs(["db", "events"]).expect("ident"))
        .expect("the table was created");
    assert!(table.metadata().current_snapshot().is_none(), "nothing was committed");
}

/// The most host memory held for the writer of a run with 16 partitions
/// open at once and `buffer_mb`.
fn host_peak_with_16_partitions(dir: &std::path::Path, buffer_mb: u64, rows: u64) -> u64 {
    let job = TestJob::iceberg(&format!("columnar-partitions-{buffer_mb}"), dir, TABLE, rows, 0, 1, rows);
    let partition_by = "sink.options.partition_by=\"bucket[16](id)\"";
    let buffer = format!("sink.options.buffer_mb=\"{buffer_mb}\"");
    let summary = job.run_with(&[partition_by, &buffer], None).expect("the job runs");
    assert_eq!(summary.rows_total, rows);
    summary.writer_host_memory.expect("the host's peak for the writer")
}

#[test]
fn buffer_mb_bounds_what_the_host_holds_for_many_open_partitions() {
    const ROWS: u64 = 120_000;
    // Unbounded (a budget the rows never reach), the 16 open files' row
    // groups grow to over 30 MiB at once (measured: 35.7 MB)...
    let unbounded = tempfile::tempdir().expect("temp dir");
    let natural = host_peak_with_16_partitions(unbounded.path(), 1024, ROWS);
    assert!(natural > 24 << 20, "the rows make the host hold {natural} bytes when nothing cuts them");
    // ... and with buffer_mb = 16 the plugin cuts row groups, largest first,
    // so the host holds at most that for the writer (measured 13.3 MB when
    // the plugin let the host hold 3/4 of the budget; it lets it hold 1/2).
    let dir = tempfile::tempdir().expect("temp dir");
    let held = host_peak_with_16_partitions(dir.path(), 16, ROWS);
    assert!(held <= 16 << 20, "the host held {held} bytes for one writer, more than buffer_mb = 16 MiB");
    let table = read_iceberg(dir.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert!(data_files(&table.table).len() >= 16, "one file per partition at least");
}

/// A writer's Parquet files take a file handle only from their first bytes
/// on (a row group written out, or `close`): 64 partitions open at once
/// land with `max_open_files = 16`, as they did when plugins encoded.
#[test]
fn more_open_partitions_than_open_files_land() {
    const ROWS: u64 = 20_000;
    let dir = tempfile::tempdir().expect("temp dir");
    let job = TestJob::iceberg("columnar-handles", dir.path(), TABLE, ROWS, 0, 1, ROWS);
    let sets = ["sink.options.partition_by=\"bucket[64](id)\"", "sink.sandbox.max_open_files=16"];
    let summary = job.run_with(&sets, None).expect("the job runs");
    assert_eq!(summary.rows_total, ROWS);
    let table = read_iceberg(dir.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    assert!(data_files(&table.table).len() >= 64, "one file per partition");
}

/// Plain appends are written from the host's input (contract 0.2.4): the
/// plugin reads only the columns partition values come from (and the float
/// ones), and names each partition's rows in the host's batch. Every data
/// file holds exactly the rows of its partition, with the generator's
/// values (batches of 700 rows straddle the partitions of 1,000 ids).
#[test]
fn partitioned_rows_named_in_the_hosts_batch_land_in_their_partition() {
    const ROWS: u64 = 20_000;
    const WIDTH: i64 = 1000;
    let dir = tempfile::tempdir().expect("temp dir");
    let job = TestJob::iceberg("columnar-input", dir.path(), TABLE, ROWS, 0, 2, 3_000);
    let summary = job.run_with(&["sink.options.partition_by=\"truncate[1000](id)\""], None).expect("the job runs");
    assert_eq!(summary.rows_total, ROWS);
    let table = read_iceberg(dir.path(), TABLE);
    assert_exactly_once_range(&table.rows, 0, ROWS);
    let files = data_files(&table.table);
    assert!(files.len() >= (ROWS as i64 / WIDTH) as usize, "{}", files.len());
    let mut rows = 0;
    for file in &files {
        let Some(Some(iceberg::spec::Literal::Primitive(iceberg::spec::PrimitiveLiteral::Long(start)))) =
            file.partition().fields().first().cloned()
        else {
            panic!("a truncate(id) partition value: {:?}", file.partition())
        };
        let bytes = std::fs::read(local_path(file.file_path())).expect("a data file");
        let reader = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(bytes::Bytes::from(bytes))
            .expect("a Parquet file")
            .build()
            .expect("a reader");
        for batch in reader {
            let batch = batch.expect("a batch");
            let ids = batch
                .column_by_name("id")
                .and_then(|c| c.as_any().downcast_ref::<arrow_array::Int64Array>().cloned())
                .expect("the id column");
            for id in ids.values() {
                assert!((start..start + WIDTH).contains(id), "id {id} in the file of partition {start}");
            }
            rows += batch.num_rows() as u64;
        }
    }
    assert_eq!(rows, ROWS, "the files hold every row once");
}

/// A table of which the plugin reads no column (unpartitioned, no floats)
/// still lands whole: the batches that cross carry only their row counts.
#[test]
fn a_table_the_writer_reads_no_column_of_lands_from_the_hosts_input() {
    const ROWS: i64 = 5_000;
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("in");
    std::fs::create_dir_all(&input).expect("input folder");
    let mut csv = String::from("id,name\n");
    for id in 0..ROWS {
        csv.push_str(&format!("{id},name-{id}\n"));
    }
    std::fs::write(input.join("a.csv"), csv).expect("csv");
    let wh = dir.path().join("warehouse");
    let toml = format!(
        r#"[job]
id = "no-columns"
parallelism = 1
state_dir = "{state}"
[job.checkpoint]
every_rows = 1500
[source]
kind = "file"
path = "{input}"
batch_rows = 700
[sink]
id = "lake"
plugin = "{plugin}"
[sink.options]
table = "{TABLE}"
[sink.catalog]
database = "{wh}/catalog.db"
warehouse = "{wh}"
"#,
        state = dir.path().join("state").display(),
        input = input.display(),
        plugin = sluice_tests::ICEBERG_PLUGIN,
        wh = wh.display(),
    );
    let job = TestJob { dir, toml };
    let summary = job.run(None).expect("the job runs");
    assert_eq!(summary.rows_total, ROWS as u64);
    let schema = Arc::new(arrow_schema::Schema::new(vec![
        arrow_schema::Field::new("id", arrow_schema::DataType::Int64, true),
        arrow_schema::Field::new("name", arrow_schema::DataType::Utf8, true),
    ]));
    let table = sluice_tests::read_iceberg_as(&catalog(&wh), TABLE, &schema);
    let ids = sluice_tests::ids(&table.rows);
    assert_eq!(ids, (0..ROWS).collect::<Vec<_>>());
    let names = table.rows.column(1).as_any().downcast_ref::<arrow_array::StringArray>().expect("names");
    for (i, name) in names.iter().enumerate() {
        assert_eq!(name, Some(format!("name-{i}").as_str()));
    }
    assert!(data_files(&table.table).len() >= 4, "a file per checkpoint");
}
