//! `generator`: deterministic rows with a unique `id`.
//!
//! Row `id` is the same on every run: its values are a pure function of the
//! id (see [`Generator::rows_for`]), so tests can rebuild the expected rows.
//! Subtask `s` of `p` owns the contiguous ids `[s*n/p, (s+1)*n/p)`.
//!
//! For tests and benchmarks of many tables and schema changes:
//! - `tables = ["a", "b", ...]`: row `id` lands in table `id % n`;
//! - `evolve_at = K`: rows with `id >= K` have the evolved shape ([`Generator::evolved_schema`]:
//!   `qty` widened from Int32 to Int64, a nullable `tag` column added);
//! - `new_table_at = K`: the last table appears at id `K`; before it, its
//!   share lands in the first table. It is not among the tables known at
//!   start, so the engine meets it as a new table.
//!
//! Its identity ([`Params`]) is what decides which rows exist: `rows`,
//! `first_id`, `tables`, `evolve_at` and `new_table_at`. `rate` and
//! `batch_rows` only pace and cut them (a position names its chunk's end),
//! so they may change between runs.
//!
//! Invariants: a batch never straddles `evolve_at` or `new_table_at`, and
//! holds rows of one table; a position inside a chunk of ids names the
//! chunk and how many of its tables' batches were delivered, so a restore
//! regenerates the same chunk and goes on after them; every id is at most
//! [`MAX_ID`] (`i64::MAX`, the `id` column is Int64): the job refuses
//! `first_id` and `rows` that pass it when it loads, and a reader refuses
//! them too.

use std::collections::VecDeque;
use std::sync::Arc;

use arrow_array::builder::{
    Date32Builder, Decimal128Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, BooleanArray, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{SourceChange, SourceError, SourceReader, TableBatch};

/// 2024-01-01 as days since the Unix epoch.
const BASE_DAY: i32 = 19_723;
/// 2024-01-01T00:00:00Z in microseconds.
const BASE_TS_US: i64 = 1_704_067_200_000_000;
/// Days the `day` column cycles through.
pub const DAYS: u64 = 30;
/// The largest id: the `id` column is Int64.
pub const MAX_ID: u64 = i64::MAX as u64;

/// Id `i` as the `id` column holds it. Ids come from a reader (which
/// refuses any past [`MAX_ID`]) or from a caller's range.
fn id_value(i: u64) -> i64 {
    i64::try_from(i).unwrap_or_else(|_| unreachable!("id {i} is past i64::MAX; readers refuse such ranges"))
}

/// How the generator spreads rows over tables and changes their shape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shape {
    /// Table names; empty: one unnamed table.
    pub tables: Vec<String>,
    /// Rows with `id >= evolve_at` have the evolved schema.
    pub evolve_at: Option<u64>,
    /// The last table receives rows only from this id on.
    pub new_table_at: Option<u64>,
}

impl Shape {
    /// The table (index) row `id` lands in.
    pub fn table_of(&self, id: u64) -> usize {
        let n = self.tables.len().max(1);
        let t = (id % n as u64) as usize;
        match self.new_table_at {
            Some(k) if n > 1 && t == n - 1 && id < k => 0,
            _ => t,
        }
    }

    /// The table's name (`""` for the one unnamed table).
    pub fn table_name(&self, index: usize) -> &str {
        self.tables.get(index).map_or("", String::as_str)
    }

    pub fn evolved(&self, id: u64) -> bool {
        self.evolve_at.is_some_and(|k| id >= k)
    }
}

/// The generator's parameters that decide which rows exist (its identity
/// in a checkpoint record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Params {
    pub rows: u64,
    pub first_id: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tables: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evolve_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_table_at: Option<u64>,
}

impl Params {
    /// Refuses `self` (the job now) where it differs from `recorded`, naming
    /// every key that changed.
    pub fn check(&self, recorded: &Params) -> Result<(), SourceChange> {
        let opt = |v: Option<u64>| v.map_or("unset".to_string(), |v| v.to_string());
        let mut changed = Vec::new();
        if self.rows != recorded.rows {
            changed.push(format!("source.rows was {}, now {}", recorded.rows, self.rows));
        }
        if self.first_id != recorded.first_id {
            changed.push(format!("source.first_id was {}, now {}", recorded.first_id, self.first_id));
        }
        if self.tables != recorded.tables {
            changed.push(format!("source.tables was {:?}, now {:?}", recorded.tables, self.tables));
        }
        if self.evolve_at != recorded.evolve_at {
            changed.push(format!("source.evolve_at was {}, now {}", opt(recorded.evolve_at), opt(self.evolve_at)));
        }
        if self.new_table_at != recorded.new_table_at {
            changed.push(format!(
                "source.new_table_at was {}, now {}",
                opt(recorded.new_table_at),
                opt(self.new_table_at)
            ));
        }
        if changed.is_empty() {
            return Ok(());
        }
        Err(SourceChange(format!(
            "the generator's parameters changed ({}), so the recorded positions point into other rows",
            changed.join("; ")
        )))
    }
}

pub struct Generator {
    rows: u64,
    first_id: u64,
    rate: Option<f64>,
    batch_rows: usize,
    parallelism: u32,
    shape: Shape,
}

fn mix(id: u64) -> u64 {
    // splitmix64: a cheap, well-spread pure function of the id.
    let mut z = id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Generator {
    pub fn new(rows: u64, rate: Option<f64>, batch_rows: usize, parallelism: u32) -> Self {
        Self { rows, first_id: 0, rate, batch_rows, parallelism, shape: Shape::default() }
    }

    /// Spreads rows over tables and changes their shape (see the module doc).
    pub fn with_shape(mut self, shape: Shape) -> Self {
        self.shape = shape;
        self
    }

    /// Starts the ids at `first_id` instead of 0.
    pub fn starting_at(mut self, first_id: u64) -> Self {
        self.first_id = first_id;
        self
    }

    pub fn schema_ref() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("qty", DataType::Int32, false),
            Field::new("price", DataType::Float64, false),
            Field::new("amount", DataType::Decimal128(18, 2), false),
            Field::new("name", DataType::Utf8, false),
            Field::new("note", DataType::Utf8, true),
            Field::new("day", DataType::Date32, false),
            Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), false),
        ]))
    }

    /// The rows' schema after `evolve_at`: `qty` widened to Int64, and a
    /// nullable `tag` column at the end.
    pub fn evolved_schema() -> SchemaRef {
        let base = Self::schema_ref();
        let mut fields: Vec<Field> = base
            .fields()
            .iter()
            .map(|f| if f.name() == "qty" { Field::new("qty", DataType::Int64, false) } else { f.as_ref().clone() })
            .collect();
        fields.push(Field::new("tag", DataType::Utf8, true));
        Arc::new(Schema::new(fields))
    }

    /// The tables known at start, with the schema of their first rows: every
    /// table but one that appears at `new_table_at`.
    pub fn tables(&self) -> Vec<(String, SchemaRef)> {
        let first_evolved = self.shape.evolved(self.first_id);
        let schema = if first_evolved { Self::evolved_schema() } else { Self::schema_ref() };
        if self.shape.tables.is_empty() {
            return vec![(String::new(), schema)];
        }
        let late = self.shape.new_table_at.is_some() && self.shape.tables.len() > 1;
        let known = if late { self.shape.tables.len() - 1 } else { self.shape.tables.len() };
        self.shape.tables[..known].iter().map(|t| (t.clone(), schema.clone())).collect()
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The parameters that decide which rows exist.
    pub fn params(&self) -> Params {
        Params {
            rows: self.rows,
            first_id: self.first_id,
            tables: self.shape.tables.clone(),
            evolve_at: self.shape.evolve_at,
            new_table_at: self.shape.new_table_at,
        }
    }
    pub fn rows(&self) -> u64 {
        self.rows
    }
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
    pub fn batch_rows(&self) -> usize {
        self.batch_rows
    }

    /// The ids subtask `s` owns (saturating at `u64::MAX`: a reader
    /// refuses ids past [`MAX_ID`]).
    pub fn range(&self, subtask: u32) -> (u64, u64) {
        let p = u128::from(self.parallelism.max(1));
        let n = u128::from(self.rows);
        let s = u128::from(subtask).min(p);
        // `s * n / p <= n`, which is a u64.
        let at = |k: u128| self.first_id.saturating_add(u64::try_from(k * n / p).unwrap_or(u64::MAX));
        (at(s), at(s + 1))
    }

    /// The rows with ids `start..end` in the base shape, exactly as every
    /// run produces them.
    pub fn batch_for(start: u64, end: u64) -> RecordBatch {
        let n = (end - start) as usize;
        let mut id = Int64Builder::with_capacity(n);
        let mut qty = Int32Builder::with_capacity(n);
        let mut price = Float64Builder::with_capacity(n);
        let mut amount = Decimal128Builder::with_capacity(n);
        let mut name = StringBuilder::with_capacity(n, n * 16);
        let mut note = StringBuilder::with_capacity(n, n * 4);
        let mut day = Date32Builder::with_capacity(n);
        let mut ts = TimestampMicrosecondBuilder::with_capacity(n);
        for i in start..end {
            let h = mix(i);
            id.append_value(id_value(i));
            qty.append_value((h % 1000) as i32);
            price.append_value((h % 1_000_000) as f64 / 100.0);
            amount.append_value(((h >> 20) % 10_000_000_000) as i128 - 5_000_000_000);
            name.append_value(format!("name-{i}-{}", h % 97));
            if i % 7 == 3 {
                note.append_null();
            } else {
                note.append_value(["alpha", "beta", "gamma", "delta"][(h % 4) as usize]);
            }
            day.append_value(BASE_DAY + (i % DAYS) as i32);
            ts.append_value(BASE_TS_US + (i % DAYS) as i64 * 86_400_000_000 + ((h >> 8) % 86_400_000_000) as i64);
        }
        let columns: Vec<ArrayRef> = vec![
            Arc::new(id.finish()),
            Arc::new(qty.finish()),
            Arc::new(price.finish()),
            // Precision and scale are constants within range: this cannot fail.
            Arc::new(amount.finish().with_precision_and_scale(18, 2).unwrap_or_else(|_| unreachable!())),
            Arc::new(name.finish()),
            Arc::new(note.finish()),
            Arc::new(day.finish()),
            Arc::new(ts.finish().with_timezone("UTC")),
        ];
        // The columns match the schema by construction.
        RecordBatch::try_new(Self::schema_ref(), columns).unwrap_or_else(|e| unreachable!("generator schema: {e}"))
    }

    /// The evolved shape of `batch_for(start, end)`: `qty` as Int64 and a
    /// `tag` (null for every third id).
    pub fn evolved_batch_for(start: u64, end: u64) -> RecordBatch {
        let base = Self::batch_for(start, end);
        let mut columns: Vec<ArrayRef> = base.columns().to_vec();
        // Int32 → Int64 cannot fail.
        columns[1] = arrow_cast::cast(&columns[1], &DataType::Int64).unwrap_or_else(|e| unreachable!("{e}"));
        let mut tag = StringBuilder::with_capacity((end - start) as usize, (end - start) as usize * 3);
        for i in start..end {
            if i % 3 == 0 { tag.append_null() } else { tag.append_value(format!("t{}", mix(i) % 5)) }
        }
        columns.push(Arc::new(tag.finish()));
        RecordBatch::try_new(Self::evolved_schema(), columns).unwrap_or_else(|e| unreachable!("evolved schema: {e}"))
    }

    /// The rows with ids `start..end` that land in table `table`, in their
    /// shape (`start..end` never straddles `evolve_at`).
    pub fn rows_for(shape: &Shape, start: u64, end: u64, table: usize) -> RecordBatch {
        let all = if shape.evolved(start) { Self::evolved_batch_for(start, end) } else { Self::batch_for(start, end) };
        if shape.tables.len() <= 1 {
            return all;
        }
        let keep: BooleanArray = (start..end).map(|i| Some(shape.table_of(i) == table)).collect();
        // The mask has the batch's length by construction.
        arrow_select::filter::filter_record_batch(&all, &keep).unwrap_or_else(|e| unreachable!("{e}"))
    }

    pub fn reader(&self, subtask: u32, position: Option<&serde_json::Value>) -> Result<GeneratorReader, SourceError> {
        if self.rows > 0 && self.first_id.checked_add(self.rows - 1).is_none_or(|last| last > MAX_ID) {
            return Err(SourceError::Config {
                key: "source.first_id".into(),
                message: format!(
                    "source.first_id = {} with source.rows = {} gives ids past {MAX_ID} (i64::MAX), the largest \
                     id the Int64 `id` column holds",
                    self.first_id, self.rows
                ),
            });
        }
        let (start, end) = self.range(subtask);
        let bad = |p: &serde_json::Value, message: String| SourceError::Position { position: p.to_string(), message };
        let mut reader = GeneratorReader { shape: self.shape.clone(), next: start, start, end, chunk: None };
        let Some(p) = position else { return Ok(reader) };
        let emitted =
            p.get("emitted").and_then(|v| v.as_u64()).ok_or_else(|| bad(p, "expected {\"emitted\": n}".into()))?;
        if emitted > end - start {
            return Err(bad(p, format!("subtask {subtask} owns only {} rows (did source.rows change?)", end - start)));
        }
        reader.next = start + emitted;
        if let (Some(chunk_end), Some(delivered)) =
            (p.get("chunk_end").and_then(|v| v.as_u64()), p.get("delivered").and_then(|v| v.as_u64()))
        {
            if chunk_end > end - start || chunk_end < emitted {
                return Err(bad(p, format!("the chunk ends outside subtask {subtask}'s rows")));
            }
            reader.open_chunk(start + chunk_end);
            if let Some(chunk) = &mut reader.chunk {
                for _ in 0..delivered {
                    chunk.batches.pop_front();
                }
                chunk.delivered = delivered;
            }
        }
        Ok(reader)
    }
}

/// The ids being delivered, split by table.
struct Chunk {
    /// The chunk's ids end here (exclusive); they start at the reader's `next`.
    end: u64,
    batches: VecDeque<TableBatch>,
    /// Batches of the chunk already delivered.
    delivered: u64,
}

pub struct GeneratorReader {
    shape: Shape,
    /// The first id not yet delivered whole (the chunk's start, while one is open).
    next: u64,
    start: u64,
    end: u64,
    chunk: Option<Chunk>,
}

impl GeneratorReader {
    fn open_chunk(&mut self, stop: u64) {
        let tables = self.shape.tables.len().max(1);
        let batches: VecDeque<TableBatch> = (0..tables)
            .map(|t| {
                TableBatch::new(
                    self.shape.table_name(t).to_string(),
                    Generator::rows_for(&self.shape, self.next, stop, t),
                )
            })
            .filter(|b| b.batch.num_rows() > 0)
            .collect();
        self.chunk = Some(Chunk { end: stop, batches, delivered: 0 });
    }
}

impl SourceReader for GeneratorReader {
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<TableBatch>, SourceError> {
        loop {
            if let Some(chunk) = &mut self.chunk {
                if let Some(batch) = chunk.batches.pop_front() {
                    chunk.delivered += 1;
                    return Ok(Some(batch));
                }
                self.next = chunk.end;
                self.chunk = None;
            }
            if self.next >= self.end || max_rows == 0 {
                return Ok(None);
            }
            let mut stop = self.end.min(self.next + max_rows as u64);
            // A chunk never straddles a change of shape.
            for k in [self.shape.evolve_at, self.shape.new_table_at].into_iter().flatten() {
                if self.next < k && k < stop {
                    stop = k;
                }
            }
            self.open_chunk(stop);
        }
    }

    fn position(&self) -> serde_json::Value {
        match &self.chunk {
            Some(c) if !c.batches.is_empty() => json!({
                "emitted": self.next - self.start,
                "chunk_end": c.end - self.start,
                "delivered": c.delivered,
            }),
            Some(c) => json!({ "emitted": c.end - self.start }),
            None => json!({ "emitted": self.next - self.start }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int64Array;

    #[test]
    fn ids_past_the_column_are_a_config_error_naming_the_key() {
        use sluice_core::error::{ErrorKind, Kind};
        let e = Generator::new(100, None, 10, 1)
            .starting_at(MAX_ID - 10)
            .reader(0, None)
            .err()
            .unwrap_or_else(|| panic!("a reader"));
        assert_eq!(e.kind(), ErrorKind::Config, "{e}");
        assert!(e.to_string().contains("key `source.first_id`") && e.to_string().contains("gives ids past"), "{e}");
    }

    #[test]
    fn split_covers_every_id_once_and_resumes() {
        let g = Generator::new(10, None, 3, 3);
        let mut ids = Vec::new();
        for s in 0..3 {
            let mut r = g.reader(s, None).unwrap();
            let first = r.next_batch(2).unwrap().unwrap();
            let pos = r.position();
            let mut r2 = g.reader(s, Some(&pos)).unwrap();
            for b in std::iter::once(first).chain(std::iter::from_fn(|| r2.next_batch(3).unwrap())) {
                assert_eq!(b.table, "");
                let col = b.batch.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                ids.extend(col.values().iter().copied());
            }
        }
        assert_eq!(ids, (0..10).collect::<Vec<i64>>());
    }

    /// Every id lands once, in its table and shape, however a subtask is
    /// stopped and restored (even between the tables' batches of a chunk).
    #[test]
    fn tables_and_shape_changes_resume_exactly() {
        let shape =
            Shape { tables: vec!["a".into(), "b".into(), "c".into()], evolve_at: Some(11), new_table_at: Some(7) };
        let g = Generator::new(20, None, 4, 2).with_shape(shape.clone());
        assert_eq!(g.tables().iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        let mut seen: Vec<(String, i64, bool)> = Vec::new();
        for s in 0..2 {
            let mut r = g.reader(s, None).unwrap();
            loop {
                // Stop and restore after every batch.
                let pos = r.position();
                r = g.reader(s, Some(&pos)).unwrap();
                let Some(b) = r.next_batch(4).unwrap() else { break };
                let evolved = b.batch.schema().field_with_name("tag").is_ok();
                let col = b.batch.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                for id in col.values().iter() {
                    seen.push((b.table.clone(), *id, evolved));
                }
            }
        }
        seen.sort_by_key(|(_, id, _)| *id);
        assert_eq!(seen.iter().map(|(_, id, _)| *id).collect::<Vec<_>>(), (0..20).collect::<Vec<i64>>());
        for (table, id, evolved) in &seen {
            let id = *id as u64;
            assert_eq!(table, shape.table_name(shape.table_of(id)), "id {id}");
            assert_eq!(*evolved, id >= 11, "id {id}");
        }
        assert!(seen.iter().all(|(t, id, _)| t != "c" || *id >= 7));
        assert!(seen.iter().any(|(t, _, _)| t == "c"));
    }

    #[test]
    fn a_change_of_the_rows_is_named_and_pacing_is_not() {
        let g = Generator::new(1_000_000, None, 100, 2);
        assert_eq!(g.params().check(&g.params()), Ok(()));
        let paced = Generator::new(1_000_000, Some(5.0), 7, 2);
        assert_eq!(paced.params().check(&g.params()), Ok(()), "rate and batch_rows do not change the rows");
        let more = Generator::new(2_000_000, None, 100, 2).starting_at(5);
        let err = more.params().check(&g.params()).unwrap_err().to_string();
        assert!(err.contains("source.rows was 1000000, now 2000000"), "{err}");
        assert!(err.contains("source.first_id was 0, now 5"), "{err}");
        let shaped = Generator::new(1_000_000, None, 100, 2).with_shape(Shape {
            tables: vec!["a".into()],
            evolve_at: Some(9),
            new_table_at: None,
        });
        let err = shaped.params().check(&g.params()).unwrap_err().to_string();
        assert!(
            err.contains("source.tables was [], now [\"a\"]") && err.contains("evolve_at was unset, now 9"),
            "{err}"
        );
    }

    /// Ids up to `i64::MAX` are delivered as they are; a range past it is
    /// refused by the reader (the job refuses it when it loads, too).
    #[test]
    fn ids_end_at_i64_max() {
        let g = Generator::new(100, None, 64, 2).starting_at(MAX_ID - 99);
        let mut last = Vec::new();
        for s in 0..2 {
            let mut r = g.reader(s, None).unwrap();
            while let Some(b) = r.next_batch(64).unwrap() {
                let col = b.batch.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                last.extend(col.values().iter().copied());
            }
        }
        assert_eq!(last.len(), 100);
        assert_eq!(last.iter().max(), Some(&i64::MAX));
        assert!(last.iter().all(|id| *id > 0), "no id wrapped");
        for first in [MAX_ID - 98, MAX_ID + 1, u64::MAX] {
            let e = Generator::new(100, None, 64, 2).starting_at(first).reader(1, None).err().expect("refused");
            assert!(e.to_string().contains("gives ids past 9223372036854775807"), "{e}");
        }
    }

    #[test]
    fn rows_are_a_function_of_the_id() {
        assert_eq!(Generator::batch_for(5, 9), Generator::batch_for(5, 9));
        let whole = Generator::batch_for(0, 10);
        assert_eq!(whole.slice(4, 3), Generator::batch_for(4, 7));
    }
}
