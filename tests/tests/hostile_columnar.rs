//! Hostile review of the `columnar` capability (contract 0.2.1; its
//! `project-input` and `write-input`, 0.2.4, at the end).
//!
//! These tests drive the host's `parquet-writer` implementation exactly as
//! wasmtime does for a plugin's call: through the generated
//! `HostParquetWriter` trait on a `ColumnarView` built from an instance's
//! `FileIoCtx` (grants, `max_open_files`, `host_memory_mb`), with bytes and
//! options a hostile plugin chooses. A counting global allocator measures
//! what the host really allocates, against what it reserves.

use std::alloc::{GlobalAlloc, Layout, System};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use arrow_array::{ArrayRef, DictionaryArray, Int32Array, RecordBatch, StringArray, types::Int32Type};
use arrow_schema::{DataType, Field, Schema};
use sluice::bindings::v0_2::sluice::connector::columnar::{
    ColumnarError, Compression, HostParquetWriter, InputRows, Statistics, WriterOptions,
};
use sluice::capability::Effects;
use sluice::capability::columnar::{ColumnarInput, ColumnarView, ParquetWriterHandle};
use sluice::capability::file_io::{FileGrants, FileIoCtx, FileIoView};
use sluice::capability::limits::{CallDeadline, HandleCap, HostMemory};
use sluice::capability::syncs::Syncs;
use wasmtime::component::{Resource, ResourceTable};

// ---------------------------------------------------------------- allocator

struct Counting;
static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = CURRENT.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        CURRENT.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                let now = CURRENT.fetch_add(new - l.size(), Ordering::Relaxed) + new - l.size();
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                CURRENT.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Tests measuring memory must not overlap (one allocator for the binary).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn reset_peak() -> usize {
    let now = CURRENT.load(Ordering::Relaxed);
    PEAK.store(now, Ordering::Relaxed);
    now
}

const MB: usize = 1 << 20;

// ---------------------------------------------------------------- harness

/// One plugin instance's view of the host: its grants and limits.
struct Instance {
    ctx: FileIoCtx,
    table: ResourceTable,
    effects: Effects,
    /// What the engine holds for a `writer.write` call in progress.
    input: ColumnarInput,
    dir: tempfile::TempDir,
}

impl Instance {
    fn new(host_memory_mb: u64, max_open_files: u32) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        std::fs::create_dir_all(dir.path().join("out")).unwrap();
        std::fs::create_dir_all(dir.path().join("ro")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        let grants = FileGrants::new(dir.path(), &["out".to_string()], &["ro".to_string()]).expect("grants");
        let ctx = FileIoCtx {
            grants: Arc::new(grants),
            open: HandleCap::new(max_open_files, "output files open", "sink.sandbox.max_open_files"),
            memory: HostMemory::new(host_memory_mb),
            syncs: Default::default(),
        };
        Self { ctx, table: ResourceTable::new(), effects: Effects::default(), input: ColumnarInput::default(), dir }
    }

    fn view(&mut self) -> ColumnarView<'_> {
        ColumnarView { file_io: &self.ctx, table: &mut self.table, effects: &mut self.effects, input: &mut self.input }
    }

    fn create(
        &mut self,
        location: &str,
        schema: &[u8],
        options: &WriterOptions,
        overwrite: bool,
    ) -> Result<u32, ColumnarError> {
        let r =
            HostParquetWriter::create(&mut self.view(), location.into(), schema.to_vec(), options.clone(), overwrite)
                .expect("no trap");
        r.map(|res| res.rep())
    }

    fn write(
        &mut self,
        w: u32,
        ipc: Vec<u8>,
    ) -> Result<sluice::bindings::v0_2::sluice::connector::columnar::WriterStatus, ColumnarError> {
        HostParquetWriter::write(&mut self.view(), Resource::<ParquetWriterHandle>::new_borrow(w), ipc)
            .expect("no trap")
    }

    fn write_input(
        &mut self,
        w: u32,
        rows: InputRows,
    ) -> Result<sluice::bindings::v0_2::sluice::connector::columnar::WriterStatus, ColumnarError> {
        HostParquetWriter::write_input(&mut self.view(), Resource::<ParquetWriterHandle>::new_borrow(w), rows)
            .expect("no trap")
    }

    fn flush(
        &mut self,
        w: u32,
    ) -> Result<sluice::bindings::v0_2::sluice::connector::columnar::WriterStatus, ColumnarError> {
        HostParquetWriter::flush(&mut self.view(), Resource::<ParquetWriterHandle>::new_borrow(w)).expect("no trap")
    }

    fn status(&mut self, w: u32) -> sluice::bindings::v0_2::sluice::connector::columnar::WriterStatus {
        HostParquetWriter::status(&mut self.view(), Resource::<ParquetWriterHandle>::new_borrow(w)).expect("no trap")
    }

    fn close(
        &mut self,
        w: u32,
    ) -> Result<sluice::bindings::v0_2::sluice::connector::columnar::ClosedFile, ColumnarError> {
        HostParquetWriter::close(&mut self.view(), Resource::<ParquetWriterHandle>::new_borrow(w)).expect("no trap")
    }

    /// `file-io.rename`, as the plugin's call reaches it (a trap is `Err`).
    fn rename(&mut self, from: &str, to: &str) -> wasmtime::Result<()> {
        use sluice::bindings::v0_2::sluice::connector::file_io::Host;
        let mut view = FileIoView { ctx: &self.ctx, table: &mut self.table, effects: &mut self.effects };
        view.rename(from.into(), to.into())?.map_err(|e| wasmtime::Error::msg(format!("{e:?}")))
    }

    fn drop_writer(&mut self, w: u32) {
        HostParquetWriter::drop(&mut self.view(), Resource::<ParquetWriterHandle>::new_own(w)).expect("no trap")
    }
}

fn options() -> WriterOptions {
    WriterOptions {
        compression: Compression::Uncompressed,
        compression_level: None,
        dictionary: false,
        statistics: Statistics::Chunk,
        max_row_group_rows: None,
        max_row_group_bytes: None,
        data_page_size_bytes: None,
        data_page_row_limit: None,
        dictionary_page_size_bytes: None,
        write_batch_size: None,
        statistics_truncate_length: None,
        columns: Vec::new(),
        key_value_metadata: Vec::new(),
        created_by: None,
    }
}

fn string_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, false)]))
}

fn ipc_of(batches: &[RecordBatch]) -> Vec<u8> {
    let mut w = arrow_ipc_writer(&batches[0].schema());
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
    w.into_inner().unwrap()
}

fn arrow_ipc_writer(schema: &Schema) -> arrow_ipc_stream::StreamWriter<Vec<u8>> {
    arrow_ipc_stream::StreamWriter::try_new(Vec::new(), schema).unwrap()
}

// arrow-ipc is a dependency of the host; reached through the tests' own
// dependency (added in Cargo.toml).
use arrow_ipc::writer as arrow_ipc_stream;

/// A batch of `rows` distinct strings of `len` bytes each.
fn strings(rows: usize, len: usize, seed: usize) -> RecordBatch {
    let values: Vec<String> = (0..rows)
        .map(|i| {
            let k = format!("{seed}-{i}");
            format!("{}{k}", "0".repeat(len.saturating_sub(k.len())))
        })
        .collect();
    RecordBatch::try_new(string_schema(), vec![Arc::new(StringArray::from(values)) as ArrayRef]).unwrap()
}

fn silently<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let r = catch_unwind(AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    r
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

// ---------------------------------------------------------------- 2. host robustness

/// Tries `f` on every single-byte corruption of `good` (each byte set to a
/// few telling values it does not hold): how many were tried, and the
/// panics `f` caught (`silently`), named by byte and value.
fn panics_over_corruptions(
    good: &[u8],
    mut f: impl FnMut(usize, u8, Vec<u8>) -> std::thread::Result<()>,
) -> (usize, Vec<String>) {
    let mut panics = Vec::new();
    let mut n = 0;
    for at in 0..good.len() {
        for v in [0x00u8, 0x01, 0x07, 0x7f, 0xff] {
            if good[at] == v {
                continue;
            }
            let mut bad = good.to_vec();
            bad[at] = v;
            n += 1;
            if let Err(p) = f(at, v, bad) {
                panics.push(format!("byte {at} = {v:#04x}: {}", panic_message(&*p)));
            }
        }
    }
    (n, panics)
}

/// Every single-byte corruption of a valid schema stream, handed to
/// `parquet-writer.create`, must be answered (`invalid`), never panic the host.
#[test]
fn malformed_schema_bytes_in_create_never_panic_the_host() {
    let _g = serial();
    let schema = Schema::new(vec![
        Field::new("i", DataType::Int32, true),
        Field::new("t", DataType::Timestamp(arrow_schema::TimeUnit::Microsecond, Some("UTC".into())), true),
        Field::new("l", DataType::List(Arc::new(Field::new("item", DataType::Float64, true))), true),
        Field::new("d", DataType::Decimal128(10, 2), true),
    ]);
    let bytes = sluice::ipc::encode_schema(&schema).unwrap();
    let mut inst = Instance::new(64, 16);
    let (n, panics) = panics_over_corruptions(&bytes, |at, v, bad| {
        let loc = format!("out/f-{at}-{v}.parquet");
        silently(|| {
            if let Ok(w) = inst.create(&loc, &bad, &options(), false) {
                inst.drop_writer(w);
            }
        })
    });
    assert!(
        panics.is_empty(),
        "{} of {n} corrupted schemas panicked the host in parquet-writer.create, e.g.: {:#?}",
        panics.len(),
        &panics[..panics.len().min(5)]
    );
}

/// The same for the batches handed to `write`.
#[test]
fn malformed_batch_bytes_in_write_never_panic_the_host() {
    let _g = serial();
    let schema =
        Arc::new(Schema::new(vec![Field::new("i", DataType::Int32, true), Field::new("s", DataType::Utf8, true)]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int32Array::from(vec![Some(1), None, Some(3)])) as ArrayRef,
            Arc::new(StringArray::from(vec![Some("a"), Some("bb"), None])),
        ],
    )
    .unwrap();
    let good = sluice::ipc::encode_batch(&batch).unwrap();
    let schema_ipc = sluice::ipc::encode_schema(&schema).unwrap();
    let mut inst = Instance::new(64, 16);
    let w = inst.create("out/w.parquet", &schema_ipc, &options(), false).expect("create");
    let (n, panics) = panics_over_corruptions(&good, |_, _, bad| silently(|| drop(inst.write(w, bad))));
    assert!(
        panics.is_empty(),
        "{} of {n} corrupted batch streams panicked the host in parquet-writer.write, e.g.: {:#?}",
        panics.len(),
        &panics[..panics.len().min(5)]
    );
}

/// Misuse of a writer is a clear `invalid`, and a dropped writer leaves no
/// complete-looking file.
#[test]
fn writer_misuse_is_a_clear_error_and_drop_leaves_no_complete_file() {
    let _g = serial();
    let mut inst = Instance::new(64, 16);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let w = inst.create("out/a.parquet", &schema_ipc, &options(), false).expect("create");
    // Zero-row batch and a schema-only stream are fine.
    let empty = RecordBatch::new_empty(string_schema());
    inst.write(w, sluice::ipc::encode_batch(&empty).unwrap()).expect("a zero-row batch");
    inst.write(w, schema_ipc.clone()).expect("a stream without batches");
    // Another nullability, or other field metadata: refused.
    let nullable = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, true)]));
    let b = RecordBatch::try_new(nullable, vec![Arc::new(StringArray::from(vec!["x"])) as ArrayRef]).unwrap();
    assert!(matches!(inst.write(w, sluice::ipc::encode_batch(&b).unwrap()), Err(ColumnarError::Invalid(_))));
    let meta = Arc::new(Schema::new(vec![
        Field::new("s", DataType::Utf8, false)
            .with_metadata([("PARQUET:field_id".to_string(), "9".to_string())].into()),
    ]));
    let b = RecordBatch::try_new(meta, vec![Arc::new(StringArray::from(vec!["x"])) as ArrayRef]).unwrap();
    assert!(matches!(inst.write(w, sluice::ipc::encode_batch(&b).unwrap()), Err(ColumnarError::Invalid(_))));
    // Garbage.
    assert!(matches!(inst.write(w, b"not arrow".to_vec()), Err(ColumnarError::Invalid(_))));
    inst.write(w, sluice::ipc::encode_batch(&strings(10, 8, 0)).unwrap()).expect("write");
    let closed = inst.close(w).expect("close");
    assert!(closed.size > 0);
    for (what, r) in [
        ("close twice", inst.close(w).map(|_| ())),
        ("write after close", inst.write(w, sluice::ipc::encode_batch(&strings(1, 8, 0)).unwrap()).map(|_| ())),
        ("flush after close", inst.flush(w).map(|_| ())),
    ] {
        match r {
            Err(ColumnarError::Invalid(m)) => assert!(m.contains("closed"), "{what}: {m}"),
            other => panic!("{what}: {other:?}"),
        }
    }
    let s = inst.status(w);
    assert_eq!(s.rows, 0);
    inst.drop_writer(w);
    // A writer dropped mid-row-group: no footer, not a readable Parquet file.
    let w = inst.create("out/b.parquet", &schema_ipc, &options(), false).expect("create");
    inst.write(w, sluice::ipc::encode_batch(&strings(1000, 8, 1)).unwrap()).expect("write");
    inst.flush(w).expect("flush");
    inst.write(w, sluice::ipc::encode_batch(&strings(1000, 8, 2)).unwrap()).expect("write");
    inst.drop_writer(w);
    let bytes = std::fs::read(inst.dir.path().join("out/b.parquet")).unwrap();
    assert!(!bytes.ends_with(b"PAR1") || bytes.len() <= 4, "a dropped writer left a complete-looking file");
    assert!(
        parquet::file::reader::SerializedFileReader::new(bytes::Bytes::from(bytes)).is_err(),
        "the partial file reads as Parquet"
    );
    // Exclusive create: the same location again is already-exists, when
    // the file is made (at its first bytes: here, close).
    let again = inst.create("out/a.parquet", &schema_ipc, &options(), false).expect("the grant allows it");
    assert!(matches!(
        inst.close(again),
        Err(ColumnarError::Io(sluice::bindings::v0_2::sluice::connector::file_io::IoError::AlreadyExists(_)))
    ));
}

// ---------------------------------------------------------------- 1. sandbox

/// `parquet-writer.create` refuses every location `file-io`'s output file
/// refuses, and writes nothing outside the grants.
#[test]
fn create_refuses_what_output_file_refuses_and_never_writes_outside() {
    let _g = serial();
    let mut inst = Instance::new(64, 64);
    let base = inst.dir.path().to_path_buf();
    std::os::unix::fs::symlink(base.join("outside"), base.join("out/link")).unwrap();
    std::os::unix::fs::symlink(base.join("outside/f.parquet"), base.join("out/filelink.parquet")).unwrap();
    std::fs::write(base.join("out/exists.parquet"), b"x").unwrap();
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let abs_outside = format!("{}/outside/abs.parquet", base.display());
    let url_outside = format!("file://{}/outside/url.parquet", base.display());
    let url_inside = format!("file://{}/out/url.parquet", base.display());
    let locations = [
        "../escape.parquet",
        "out/../outside/dotdot.parquet",
        "out/../../escape2.parquet",
        abs_outside.as_str(),
        url_outside.as_str(),
        url_inside.as_str(),
        "file://relative.parquet",
        "out/link/through-dir-link.parquet",
        "out/filelink.parquet",
        "ro/readonly.parquet",
        "ro",
        "out",
        "out/",
        "out/.",
        "",
        " out/space.parquet",
        "out/tab\t.parquet",
        "out/nl\n.parquet",
        "out/nul\0.parquet",
        "s3://bucket/x.parquet",
        "gs://bucket/x.parquet",
        "http://127.0.0.1:1/x.parquet",
        "out/exists.parquet",
        "/etc/sluice-hostile.parquet",
    ];
    let mut mismatches = Vec::new();
    for loc in locations {
        let plain = inst.ctx.grants.create_output(loc, false).map(|_| ());
        // Remove what the output file made, so the writer meets the same state.
        let made_by_plain = plain.is_ok();
        if made_by_plain {
            let _ = std::fs::remove_file(base.join(loc.trim_start_matches(&format!("file://{}/", base.display()))));
        }
        let col = match silently(|| inst.create(loc, &schema_ipc, &options(), false)) {
            Ok(r) => r,
            Err(p) => {
                mismatches.push(format!("{loc:?}: the host panicked: {}", panic_message(&*p)));
                continue;
            }
        };
        // The grant is judged at create; the file is made at its first
        // bytes (a row group written out, or close): a refusal may come
        // from either, before anything is written.
        let col = match col {
            Ok(w) => {
                let done = inst.close(w);
                inst.drop_writer(w);
                done.map(|_| 0u32)
            }
            Err(e) => Err(e),
        };
        let kind = |e: &sluice::bindings::v0_2::sluice::connector::file_io::IoError| {
            format!("{e:?}").split('(').next().unwrap().to_string()
        };
        let same = match (&plain, &col) {
            (Ok(()), Ok(_)) => true,
            (Err(a), Err(ColumnarError::Io(b))) => kind(a) == kind(b),
            _ => false,
        };
        if !same {
            mismatches.push(format!("{loc:?}: output-file {plain:?}, parquet-writer {col:?}"));
        }
    }
    let outside: Vec<_> = walk(&base.join("outside"));
    assert!(outside.is_empty(), "files written outside the grants: {outside:?}");
    assert!(!base.parent().unwrap().join("escape.parquet").exists());
    assert!(!std::path::Path::new("/etc/sluice-hostile.parquet").exists());
    assert!(mismatches.is_empty(), "{mismatches:#?}");
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
        }
    }
    out
}

/// Writers count against `max_open_files` together with output files.
#[test]
fn writers_are_capped_by_max_open_files() {
    let _g = serial();
    let mut inst = Instance::new(64, 3);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    // A writer holds a file (and a slot) from its first bytes on: here,
    // its first row group written out (more than the encoder's 8 KiB buffer).
    let mut open = Vec::new();
    for i in 0..3 {
        let w = inst.create(&format!("out/{i}.parquet"), &schema_ipc, &options(), false).expect("create");
        inst.write(w, sluice::ipc::encode_batch(&strings(4000, 16, i)).unwrap()).expect("write");
        inst.flush(w).expect("within the cap");
        open.push(w);
    }
    let fourth = inst.create("out/3.parquet", &schema_ipc, &options(), false).expect("no file yet, no slot");
    inst.write(fourth, sluice::ipc::encode_batch(&strings(4000, 16, 3)).unwrap()).expect("write");
    match inst.flush(fourth) {
        Err(ColumnarError::Io(e)) => assert!(format!("{e:?}").contains("sink.sandbox.max_open_files"), "{e:?}"),
        other => panic!("a fourth file: {other:?}"),
    }
    assert!(!inst.dir.path().join("out/3.parquet").exists(), "the refused writer made its file");
    inst.drop_writer(fourth);
    let w = open.pop().unwrap();
    inst.close(w).expect("close");
    inst.drop_writer(w);
    let fifth = inst.create("out/4.parquet", &schema_ipc, &options(), false).expect("create");
    inst.write(fifth, sluice::ipc::encode_batch(&strings(4000, 16, 4)).unwrap()).expect("write");
    inst.flush(fifth).expect("a slot is free again");
}

// ---------------------------------------------------------------- 3. budgets

/// A dictionary array whose one 1 MiB value every row points at is about
/// 1 MiB of IPC; with Parquet dictionaries off, the encoder writes the value
/// once per row. The host reserves "the writer now + the IPC size" before
/// encoding, so what it really allocates must stay near that, or the batch
/// must be refused before it is encoded.
#[test]
fn a_dictionary_batch_cannot_make_the_host_allocate_past_host_memory_mb() {
    let _g = serial();
    const BUDGET_MB: u64 = 16;
    let mut inst = Instance::new(BUDGET_MB, 16);
    let dict_type = DataType::Dictionary(Box::new(DataType::Int32), Box::new(DataType::Utf8));
    let schema = Arc::new(Schema::new(vec![Field::new("s", dict_type, false)]));
    let big = "x".repeat(MB);
    let keys = Int32Array::from(vec![0; 1024]);
    let array = DictionaryArray::<Int32Type>::try_new(keys, Arc::new(StringArray::from(vec![big.as_str()]))).unwrap();
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(array) as ArrayRef]).unwrap();
    let ipc = sluice::ipc::encode_batch(&batch).unwrap();
    let ipc_len = ipc.len();
    let mut opts = options();
    opts.dictionary = false;
    // Refused at create: dictionary (and view) arrays could expand past
    // the IPC size the budget reserves by.
    let created = inst.create("out/dict.parquet", &sluice::ipc::encode_schema(&schema).unwrap(), &opts, false);
    let w = match created {
        Err(ColumnarError::Invalid(m)) => {
            assert!(m.contains("plain arrays"), "{m}");
            return;
        }
        other => other.expect("create"),
    };
    let before = reset_peak();
    let result = inst.write(w, ipc);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    eprintln!(
        "IPC {ipc_len} bytes; host peak allocation during write {peak} bytes; answer {:?}",
        result.as_ref().map(|s| s.memory_bytes)
    );
    assert!(
        peak <= 2 * (BUDGET_MB as usize) * MB,
        "a {ipc_len}-byte write made the host allocate {} MiB with host_memory_mb = {BUDGET_MB} (answer: {:?})",
        peak / MB,
        result.map(|s| s.memory_bytes)
    );
}

/// What the host keeps for a writer's finished row groups (their metadata,
/// with statistics the plugin asked not to truncate) until `close` is never
/// counted: `memory-bytes` reads 0 after each flush while the host holds
/// ever more.
#[test]
fn row_group_metadata_held_until_close_counts_against_host_memory_mb() {
    let _g = serial();
    const BUDGET_MB: u64 = 16;
    let mut inst = Instance::new(BUDGET_MB, 16);
    let mut opts = options();
    opts.statistics = Statistics::Chunk;
    opts.statistics_truncate_length = Some(u64::MAX);
    opts.max_row_group_rows = Some(1);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let w = inst.create("out/meta.parquet", &schema_ipc, &opts, false).expect("create");
    let before = CURRENT.load(Ordering::Relaxed);
    let mut refused = None;
    for i in 0..160 {
        // One distinct 256 KiB value per row group.
        let ipc = sluice::ipc::encode_batch(&strings(1, 256 << 10, i)).unwrap();
        if let Err(e) = inst.write(w, ipc) {
            refused = Some(e);
            break;
        }
        if let Err(e) = inst.flush(w) {
            refused = Some(e);
            break;
        }
    }
    let held = CURRENT.load(Ordering::Relaxed).saturating_sub(before);
    let status = inst.status(w);
    eprintln!(
        "host holds {held} bytes for the writer; it reports memory-bytes {}; refused: {refused:?}",
        status.memory_bytes
    );
    assert!(
        refused.is_some() || held <= 2 * (BUDGET_MB as usize) * MB,
        "the host holds {} MiB for one open writer ({} row groups) with host_memory_mb = {BUDGET_MB}, \
         and reports memory-bytes = {}",
        held / MB,
        status.row_groups,
        status.memory_bytes
    );
    inst.drop_writer(w);
}

/// A `write` refused with `limit` keeps the writer "as it was" (the host's
/// own comment), so a plugin may cut the row group and send the call again.
/// With several batches in one IPC stream, the batches before the refused
/// one have been encoded already: sending the call again duplicates them.
#[test]
fn a_write_refused_for_the_budget_keeps_none_of_its_batches() {
    let _g = serial();
    let mut inst = Instance::new(4, 16);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let w = inst.create("out/partial.parquet", &schema_ipc, &options(), false).expect("create");
    let batches: Vec<RecordBatch> = (0..12).map(|i| strings(200, 1000, i)).collect();
    let ipc = ipc_of(&batches);
    let before = inst.status(w);
    let result = inst.write(w, ipc);
    let after = inst.status(w);
    eprintln!("answer {result:?}; rows before {}, after {}", before.rows, after.rows);
    match result {
        Err(ColumnarError::Limit(m)) => {
            assert!(m.contains("sink.sandbox.host_memory_mb"), "{m}");
            assert_eq!(
                after.rows,
                before.rows,
                "the refused write left {} of its 2400 rows in the writer: a retry after `flush` writes them twice",
                after.rows - before.rows
            );
        }
        Ok(s) => panic!("expected the budget to refuse part of the call (status {s:?})"),
        Err(e) => panic!("{e:?}"),
    }
}

/// `call_timeout_secs`: the deadline is checked before each batch only, so
/// one expensive batch (brotli 11) runs far past it.
#[test]
#[ignore = "open (issue #24 note): a single page compression cannot be interrupted; the deadline is checked between batches and between writes only"]
fn one_expensive_batch_runs_far_past_the_call_deadline() {
    let _g = serial();
    let mut inst = Instance::new(1024, 16);
    let mut opts = options();
    opts.compression = Compression::Brotli;
    opts.compression_level = Some(11);
    opts.data_page_size_bytes = Some(64 << 20);
    opts.write_batch_size = Some(1 << 20);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let w = inst.create("out/slow.parquet", &schema_ipc, &opts, false).expect("create");
    // ~4 MiB of low-redundancy strings in one batch.
    let values: Vec<String> = (0..4 * 1024)
        .map(|i: u64| {
            let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            (0..64)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    format!("{:016x}", x)
                })
                .collect()
        })
        .collect();
    let batch = RecordBatch::try_new(string_schema(), vec![Arc::new(StringArray::from(values)) as ArrayRef]).unwrap();
    let ipc = sluice::ipc::encode_batch(&batch).unwrap();
    let timeout = Duration::from_secs(1);
    let started = Instant::now();
    let result = {
        let _deadline = CallDeadline::enter(timeout);
        let r = HostParquetWriter::write(&mut inst.view(), Resource::<ParquetWriterHandle>::new_borrow(w), ipc)
            .map(|r| r.map(|_| ()));
        let r2 = HostParquetWriter::flush(&mut inst.view(), Resource::<ParquetWriterHandle>::new_borrow(w))
            .map(|r| r.map(|_| ()));
        (format!("{r:?}"), format!("{r2:?}"))
    };
    let took = started.elapsed();
    eprintln!("write + flush took {took:?} with a {timeout:?} deadline: {result:?}");
    assert!(took < timeout * 5, "one call ran {took:?} against call_timeout_secs = {timeout:?}");
}

/// Bloom filters are allocated when a row group starts (about 1 MiB a
/// column at the default NDV), inside the first `write`, after the host
/// reserved only "now + the IPC size" (a few bytes for a one-row batch).
/// The host then finds the writer over budget and answers `limit`, but the
/// writer keeps the memory with no reservation left: the instance's budget
/// reads free while the host holds hundreds of MiB.
#[test]
fn bloom_filters_make_the_host_hold_memory_the_budget_no_longer_counts() {
    let _g = serial();
    const BUDGET_MB: u64 = 16;
    const COLUMNS: usize = 200;
    let mut inst = Instance::new(BUDGET_MB, 16);
    let fields: Vec<Field> = (0..COLUMNS).map(|i| Field::new(format!("c{i}"), DataType::Int32, false)).collect();
    let schema = Arc::new(Schema::new(fields));
    let mut opts = options();
    opts.columns = (0..COLUMNS)
        .map(|i| sluice::bindings::v0_2::sluice::connector::columnar::ColumnOptions {
            path: format!("c{i}"),
            dictionary: None,
            compression: None,
            statistics: None,
            bloom_filter: Some(true),
        })
        .collect();
    let w =
        inst.create("out/bloom.parquet", &sluice::ipc::encode_schema(&schema).unwrap(), &opts, false).expect("create");
    let columns: Vec<ArrayRef> = (0..COLUMNS).map(|_| Arc::new(Int32Array::from(vec![1])) as ArrayRef).collect();
    let batch = RecordBatch::try_new(schema, columns).unwrap();
    let ipc = sluice::ipc::encode_batch(&batch).unwrap();
    let before = reset_peak();
    let result = inst.write(w, ipc);
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let held = CURRENT.load(Ordering::Relaxed).saturating_sub(before);
    let free = inst.ctx.memory.free();
    eprintln!(
        "answer {:?}; host peak during the call {} MiB, still held {} MiB; budget free {} MiB of {BUDGET_MB}",
        result.as_ref().map(|s| s.memory_bytes),
        peak / MB,
        held / MB,
        free >> 20
    );
    let reserved = inst.ctx.memory.limit() - free;
    assert!(
        (held as u64) <= reserved + (BUDGET_MB << 20),
        "after a one-row write ({:?}) the host holds {} MiB for the writer but reserves {} MiB of host_memory_mb = {BUDGET_MB}",
        result.map(|s| s.memory_bytes),
        held / MB,
        reserved >> 20
    );
}

/// A closed file's sync runs off the plugin's thread; a rename (which could
/// publish the file under its final name) waits for it, and a file that
/// could not be synced stops the rename: the call traps, nothing moves.
#[test]
fn a_rename_waits_for_the_closed_files_sync_and_a_failed_sync_stops_it() {
    let _g = serial();
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    for fail in [false, true] {
        let mut inst = Instance::new(64, 16);
        inst.ctx.syncs = Arc::new(Syncs::injected(Duration::from_millis(300), fail));
        let w = inst.create("out/staged.parquet", &schema_ipc, &options(), false).expect("create");
        inst.write(w, sluice::ipc::encode_batch(&strings(100, 8, 0)).unwrap()).expect("write");
        inst.close(w).expect("close");
        // Still pending 300 ms later than a sync on the writer's thread would be.
        assert_eq!(inst.ctx.syncs.pending(), 1, "close waited for the sync");
        let renamed = inst.rename("out/staged.parquet", "out/final.parquet");
        assert_eq!(inst.ctx.syncs.pending(), 0, "the rename went ahead of the sync");
        let landed = inst.dir.path().join("out/final.parquet").exists();
        if fail {
            let e = renamed.expect_err("a rename after a failed sync");
            assert!(format!("{e:#}").contains("syncing the finished file to disk failed"), "{e:#}");
            assert!(!landed, "the unsynced file was published");
            assert!(inst.ctx.syncs.settle().is_err(), "a failed sync must stick");
        } else {
            renamed.expect("rename");
            assert!(landed);
        }
    }
}

/// `write-input` (0.2.4) reads only the batch held for the call in
/// progress, rows named in increasing order within it, and reserves what
/// the rows hold before encoding them: a plugin cannot reach another
/// call's rows, make the host copy a row many times, or pass the budget.
#[test]
fn write_input_reads_only_the_held_batch_in_order_and_within_the_budget() {
    let _g = serial();
    let mut inst = Instance::new(4, 16);
    let schema_ipc = sluice::ipc::encode_schema(&string_schema()).unwrap();
    let w = inst.create("out/input.parquet", &schema_ipc, &options(), false).expect("create");
    let invalid = |r: Result<_, ColumnarError>, what: &str| match r {
        Err(ColumnarError::Invalid(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("expected `invalid` naming {what:?}: {other:?}"),
    };
    invalid(inst.write_input(w, InputRows::Range((0, 1))), "outside a `write` call");

    inst.input.hold(strings(1000, 100, 0));
    invalid(inst.write_input(w, InputRows::Rows(vec![7; 1000])), "increasing order");
    invalid(inst.write_input(w, InputRows::Rows(vec![5, 4])), "increasing order");
    invalid(inst.write_input(w, InputRows::Rows(vec![999, 1000])), "past the input's 1000 rows");
    invalid(inst.write_input(w, InputRows::Range((900, 101))), "past the input's 1000 rows");
    assert_eq!(inst.status(w).rows, 0, "nothing refused was encoded");
    assert_eq!(inst.write_input(w, InputRows::Range((0, 500))).expect("a range").rows, 500);
    assert_eq!(inst.write_input(w, InputRows::Rows(vec![500, 700, 999])).expect("rows").rows, 503);
    inst.input.release();
    invalid(inst.write_input(w, InputRows::Range((0, 1))), "outside a `write` call");

    // 12 MB of rows against a 4 MB budget: refused before they are encoded.
    inst.input.hold(strings(12_000, 1000, 1));
    match inst.write_input(w, InputRows::Range((0, 12_000))) {
        Err(ColumnarError::Limit(m)) => assert!(m.contains("sink.sandbox.host_memory_mb"), "{m}"),
        other => panic!("expected the budget to refuse the rows: {other:?}"),
    }
    inst.input.release();

    // A batch that does not fit the writer's schema (a null in its
    // non-nullable column) is refused as the rows' fault, every time.
    let w2 = inst.create("out/input2.parquet", &schema_ipc, &options(), false).expect("create");
    let nullable = Arc::new(Schema::new(vec![Field::new("s", DataType::Utf8, true)]));
    let with_null =
        RecordBatch::try_new(nullable, vec![Arc::new(StringArray::from(vec![Some("a"), None])) as ArrayRef]).unwrap();
    inst.input.hold(with_null);
    for rows in [InputRows::Range((0, 1)), InputRows::Range((1, 1))] {
        invalid(inst.write_input(w2, rows), sluice::capability::columnar::UNFIT);
    }
    assert_eq!(inst.status(w2).rows, 0);
}
