//! The row check: the first row of a converted batch that the filter does not
//! match, found with arrow's kernels (`arrow-ord` comparisons against a
//! one-value `Scalar`, `arrow-string` starts-with, `arrow-arith` Kleene
//! `and`/`or`/`not`).
//!
//! Invariants:
//! - the batch carries the table's Arrow schema (what `schema.rs` converts to),
//!   so the filter's columns are found by their top-level names;
//! - each literal is built as an array of its Iceberg type and cast to the
//!   column's exact Arrow type (string flavours, the timestamp's zone label),
//!   so the kernels compare like with like;
//! - a row is outside when the filter is false **or unknown** (null) for it,
//!   the same truth table the partition evaluator uses.

use std::fmt;
use std::sync::Arc;

use arrow_arith::boolean::{and_kleene, is_not_null, is_null, not, or_kleene};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type};
use arrow_array::{
    Array, ArrayRef, BooleanArray, Date32Array, Decimal128Array, FixedSizeBinaryArray, Float32Array, Float64Array,
    Int32Array, Int64Array, RecordBatch, Scalar, StringArray, Time64MicrosecondArray, TimestampMicrosecondArray,
};
use arrow_cast::display::{ArrayFormatter, FormatOptions};
use arrow_schema::{ArrowError, DataType};
use iceberg::expr::{BoundPredicate, PredicateOperator};
use iceberg::spec::{Datum, PrimitiveLiteral, PrimitiveType};

use super::{BoundFilter, FilterError};

/// The first row a batch holds outside the filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RowOutside {
    /// 0-based index of the row in the batch.
    pub(crate) row: usize,
    /// (column, rendered value) of each column the filter names; a null
    /// renders as `null`.
    pub(crate) values: Vec<(String, String)>,
}

impl fmt::Display for RowOutside {
    /// `day = 2024-02-03, region = eu`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (column, value)) in self.values.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{column} = {value}")?;
        }
        Ok(())
    }
}

impl BoundFilter {
    /// The first row of `batch` for which the filter is false or null, with
    /// the values of the filter's columns; `None` when every row matches.
    pub(crate) fn first_row_outside(&self, batch: &RecordBatch) -> Result<Option<RowOutside>, FilterError> {
        let matches = self.eval_batch(&self.predicate, batch)?;
        let Some(row) = matches.iter().position(|m| m != Some(true)) else { return Ok(None) };
        let options = FormatOptions::default().with_null("null");
        let mut values = Vec::new();
        for name in self.columns() {
            let column = self.column(batch, name)?;
            let formatter = ArrayFormatter::try_new(column.as_ref(), &options).map_err(|e| self.arrow(e))?;
            values.push((name.to_owned(), formatter.value(row).to_string()));
        }
        Ok(Some(RowOutside { row, values }))
    }

    fn arrow(&self, source: ArrowError) -> FilterError {
        FilterError::Arrow { filter: self.source.clone(), table: self.table.clone(), source }
    }

    fn column<'b>(&self, batch: &'b RecordBatch, name: &str) -> Result<&'b ArrayRef, FilterError> {
        batch.column_by_name(name).ok_or_else(|| self.evaluation(format!("the batch to check has no column {name}")))
    }

    fn eval_batch(&self, predicate: &BoundPredicate, batch: &RecordBatch) -> Result<BooleanArray, FilterError> {
        let rows = batch.num_rows();
        match predicate {
            BoundPredicate::AlwaysTrue => Ok(BooleanArray::from(vec![true; rows])),
            BoundPredicate::AlwaysFalse => Ok(BooleanArray::from(vec![false; rows])),
            BoundPredicate::And(e) => {
                let [l, r] = e.inputs();
                and_kleene(&self.eval_batch(l, batch)?, &self.eval_batch(r, batch)?).map_err(|e| self.arrow(e))
            }
            BoundPredicate::Or(e) => {
                let [l, r] = e.inputs();
                or_kleene(&self.eval_batch(l, batch)?, &self.eval_batch(r, batch)?).map_err(|e| self.arrow(e))
            }
            BoundPredicate::Not(e) => {
                let [inner] = e.inputs();
                not(&self.eval_batch(inner, batch)?).map_err(|e| self.arrow(e))
            }
            BoundPredicate::Unary(e) => {
                let column = self.column(batch, &e.term().field().name)?;
                match e.op() {
                    PredicateOperator::IsNull => is_null(column.as_ref()),
                    PredicateOperator::NotNull => is_not_null(column.as_ref()),
                    PredicateOperator::IsNan => self.nan(column)?.map_or_else(|| Ok(all(rows, false)), Ok),
                    PredicateOperator::NotNan => match self.nan(column)? {
                        Some(nan) => not(&nan),
                        None => Ok(all(rows, true)),
                    },
                    op => return Err(self.evaluation(format!("unexpected unary operator {op}"))),
                }
                .map_err(|e| self.arrow(e))
            }
            BoundPredicate::Binary(e) => {
                let field = e.term().field();
                let column = self.column(batch, &field.name)?;
                let scalar = self.scalar(e.literal(), column.data_type())?;
                match e.op() {
                    PredicateOperator::LessThan => arrow_ord::cmp::lt(column, &scalar),
                    PredicateOperator::LessThanOrEq => arrow_ord::cmp::lt_eq(column, &scalar),
                    PredicateOperator::GreaterThan => arrow_ord::cmp::gt(column, &scalar),
                    PredicateOperator::GreaterThanOrEq => arrow_ord::cmp::gt_eq(column, &scalar),
                    PredicateOperator::Eq => arrow_ord::cmp::eq(column, &scalar),
                    PredicateOperator::NotEq => arrow_ord::cmp::neq(column, &scalar),
                    PredicateOperator::StartsWith => arrow_string::like::starts_with(column, &scalar),
                    PredicateOperator::NotStartsWith => {
                        arrow_string::like::starts_with(column, &scalar).and_then(|m| not(&m))
                    }
                    op => return Err(self.evaluation(format!("unexpected binary operator {op}"))),
                }
                .map_err(|e| self.arrow(e))
            }
            BoundPredicate::Set(e) => {
                let field = e.term().field();
                let column = self.column(batch, &field.name)?;
                let negated = match e.op() {
                    PredicateOperator::In => false,
                    PredicateOperator::NotIn => true,
                    op => return Err(self.evaluation(format!("unexpected set operator {op}"))),
                };
                let mut acc = all(rows, negated);
                for literal in e.literals() {
                    let scalar = self.scalar(literal, column.data_type())?;
                    acc = if negated {
                        arrow_ord::cmp::neq(column, &scalar).and_then(|m| and_kleene(&acc, &m))
                    } else {
                        arrow_ord::cmp::eq(column, &scalar).and_then(|m| or_kleene(&acc, &m))
                    }
                    .map_err(|e| self.arrow(e))?;
                }
                Ok(acc)
            }
        }
    }

    /// Which values are NaN (nulls stay null); `None` for a column that
    /// cannot hold NaN.
    fn nan(&self, column: &ArrayRef) -> Result<Option<BooleanArray>, FilterError> {
        Ok(match column.data_type() {
            DataType::Float32 => Some(BooleanArray::from_unary(column.as_primitive::<Float32Type>(), f32::is_nan)),
            DataType::Float64 => Some(BooleanArray::from_unary(column.as_primitive::<Float64Type>(), f64::is_nan)),
            _ => None,
        })
    }

    /// `datum` as a one-value scalar of the column's Arrow type.
    fn scalar(&self, datum: &Datum, column: &DataType) -> Result<Scalar<ArrayRef>, FilterError> {
        use PrimitiveLiteral as L;
        use PrimitiveType as P;
        let unsupported = || self.evaluation(format!("cannot compare a column of Arrow type {column} with {datum}"));
        let array: ArrayRef = match (datum.data_type(), datum.literal()) {
            (P::Boolean, L::Boolean(v)) => Arc::new(BooleanArray::from(vec![*v])),
            (P::Int, L::Int(v)) => Arc::new(Int32Array::from(vec![*v])),
            (P::Long, L::Long(v)) => Arc::new(Int64Array::from(vec![*v])),
            (P::Float, L::Float(v)) => Arc::new(Float32Array::from(vec![v.0])),
            (P::Double, L::Double(v)) => Arc::new(Float64Array::from(vec![v.0])),
            (P::Date, L::Int(v)) => Arc::new(Date32Array::from(vec![*v])),
            (P::Time, L::Long(v)) => Arc::new(Time64MicrosecondArray::from(vec![*v])),
            (P::Timestamp, L::Long(v)) => Arc::new(TimestampMicrosecondArray::from(vec![*v])),
            (P::Timestamptz, L::Long(v)) => {
                Arc::new(TimestampMicrosecondArray::from(vec![*v]).with_timezone_opt(timezone(column)))
            }
            (P::String, L::String(v)) => Arc::new(StringArray::from(vec![v.as_str()])),
            (P::Uuid, L::UInt128(v)) => Arc::new(
                FixedSizeBinaryArray::try_from_iter(std::iter::once(v.to_be_bytes())).map_err(|e| self.arrow(e))?,
            ),
            (P::Decimal { precision, scale }, L::Int128(v)) => {
                let precision = u8::try_from(*precision).map_err(|_| unsupported())?;
                let scale = i8::try_from(*scale).map_err(|_| unsupported())?;
                Arc::new(
                    Decimal128Array::from(vec![*v])
                        .with_precision_and_scale(precision, scale)
                        .map_err(|e| self.arrow(e))?,
                )
            }
            _ => return Err(unsupported()),
        };
        let array = if array.data_type() == column {
            array
        } else {
            arrow_cast::cast(&array, column).map_err(|e| self.arrow(e))?
        };
        Ok(Scalar::new(array))
    }
}

fn all(rows: usize, value: bool) -> BooleanArray {
    BooleanArray::from(vec![value; rows])
}

fn timezone(column: &DataType) -> Option<Arc<str>> {
    match column {
        DataType::Timestamp(_, tz) => tz.clone(),
        _ => Some("+00:00".into()),
    }
}
