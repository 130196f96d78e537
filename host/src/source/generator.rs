//! `generator`: deterministic rows with a unique `id`.
//!
//! Row `id` is the same on every run: its values are a pure function of the
//! id (see [`Generator::batch_for`]), so tests can rebuild the expected rows.
//! Subtask `s` of `p` owns the contiguous ids `[s*n/p, (s+1)*n/p)`.

use std::sync::Arc;

use arrow_array::builder::{
    Date32Builder, Decimal128Builder, Float64Builder, Int32Builder, Int64Builder, StringBuilder,
    TimestampMicrosecondBuilder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde_json::json;

use super::{SourceError, SourceReader};

/// 2024-01-01 as days since the Unix epoch.
const BASE_DAY: i32 = 19_723;
/// 2024-01-01T00:00:00Z in microseconds.
const BASE_TS_US: i64 = 1_704_067_200_000_000;
/// Days the `day` column cycles through.
pub const DAYS: u64 = 30;

pub struct Generator {
    rows: u64,
    first_id: u64,
    rate: Option<f64>,
    batch_rows: usize,
    parallelism: u32,
    schema: SchemaRef,
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
        Self { rows, first_id: 0, rate, batch_rows, parallelism, schema: Self::schema_ref() }
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

    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
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

    /// The ids subtask `s` owns.
    pub fn range(&self, subtask: u32) -> (u64, u64) {
        let p = u128::from(self.parallelism.max(1));
        let n = u128::from(self.rows);
        let s = u128::from(subtask);
        (self.first_id + (s * n / p) as u64, self.first_id + ((s + 1) * n / p) as u64)
    }

    /// The rows with ids `start..end`, exactly as every run produces them.
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
            id.append_value(i as i64);
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

    pub fn reader(&self, subtask: u32, position: Option<&serde_json::Value>) -> Result<GeneratorReader, SourceError> {
        let (start, end) = self.range(subtask);
        let emitted = match position {
            None => 0,
            Some(p) => p.get("emitted").and_then(|v| v.as_u64()).ok_or_else(|| SourceError::Position {
                position: p.to_string(),
                message: "expected {\"emitted\": n}".into(),
            })?,
        };
        if emitted > end - start {
            return Err(SourceError::Position {
                position: emitted.to_string(),
                message: format!("subtask {subtask} owns only {} rows (did source.rows change?)", end - start),
            });
        }
        Ok(GeneratorReader { next: start + emitted, start, end })
    }
}

pub struct GeneratorReader {
    next: u64,
    start: u64,
    end: u64,
}

impl SourceReader for GeneratorReader {
    fn next_batch(&mut self, max_rows: usize) -> Result<Option<RecordBatch>, SourceError> {
        if self.next >= self.end || max_rows == 0 {
            return Ok(None);
        }
        let stop = self.end.min(self.next + max_rows as u64);
        let batch = Generator::batch_for(self.next, stop);
        self.next = stop;
        Ok(Some(batch))
    }

    fn position(&self) -> serde_json::Value {
        json!({ "emitted": self.next - self.start })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Int64Array;

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
                let col = b.column(0).as_any().downcast_ref::<Int64Array>().unwrap();
                ids.extend(col.values().iter().copied());
            }
        }
        assert_eq!(ids, (0..10).collect::<Vec<i64>>());
    }

    #[test]
    fn rows_are_a_function_of_the_id() {
        assert_eq!(Generator::batch_for(5, 9), Generator::batch_for(5, 9));
        let whole = Generator::batch_for(0, 10);
        assert_eq!(whole.slice(4, 3), Generator::batch_for(4, 7));
    }
}
