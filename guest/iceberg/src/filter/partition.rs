//! The filter projected onto a partition spec, and evaluated over a data
//! file's partition tuple.
//!
//! iceberg-rust 0.10 has `InclusiveProjection`, `StrictProjection` and
//! `ExpressionEvaluator`, but all are `pub(crate)`; what it exports is the
//! per-transform `Transform::project` / `Transform::strict_project`. So the
//! walk over `and`/`or` (the same one iceberg's visitors do) and the small
//! three-valued evaluator below are ours.
//!
//! Invariants:
//! - a leaf is projected through every partition field derived from its
//!   column; inclusive projections are and-ed, strict ones or-ed (a row
//!   matching any strict projection matches the leaf). A leaf no field
//!   projects becomes `AlwaysTrue` (inclusive: any file may match) or
//!   `AlwaysFalse` (strict: no file is known to match only);
//! - the predicate walked has no `Not` (binding rewrote it away); one is an
//!   error, never a guess;
//! - evaluation is Kleene's: a null partition value makes a comparison
//!   unknown, and only `true` counts.

use std::cmp::Ordering;
use std::collections::HashMap;

use iceberg::expr::{BoundPredicate, Predicate, PredicateOperator};
use iceberg::spec::{Literal, PartitionSpec, PrimitiveLiteral, Struct, Transform};

use super::{BoundFilter, FilterError};

/// Where a data file's partition lies with respect to the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Placement {
    /// Every row the partition can hold matches the filter (strict
    /// projection true): the file is replaced as a whole.
    Inside,
    /// No row of the partition can match (inclusive projection not true):
    /// the file is kept.
    Outside,
    /// Some rows may match and some may not: replacing it would need row
    /// deletes.
    Straddles,
}

/// A filter projected onto one partition spec.
#[derive(Debug, Clone)]
pub(crate) struct PartitionFilter {
    spec_id: i32,
    source: String,
    table: String,
    inclusive: Predicate,
    strict: Predicate,
    /// Partition field name → its position in the partition tuple.
    positions: HashMap<String, usize>,
}

impl PartitionFilter {
    pub(super) fn new(filter: &BoundFilter, spec: &PartitionSpec) -> Result<Self, FilterError> {
        let inclusive = project(filter, spec, filter.predicate(), false)?;
        let strict = project(filter, spec, filter.predicate(), true)?;
        let positions = spec.fields().iter().enumerate().map(|(i, f)| (f.name.clone(), i)).collect();
        Ok(Self {
            spec_id: spec.spec_id(),
            source: filter.source.clone(),
            table: filter.table.clone(),
            inclusive,
            strict,
            positions,
        })
    }

    /// The spec this projection is for; a partition tuple of another spec
    /// cannot be classified with it.
    pub(crate) fn spec_id(&self) -> i32 {
        self.spec_id
    }

    /// The inclusive projection: true for a partition that may hold a
    /// matching row.
    pub(crate) fn inclusive(&self) -> &Predicate {
        &self.inclusive
    }

    /// The strict projection: true for a partition all of whose rows match.
    pub(crate) fn strict(&self) -> &Predicate {
        &self.strict
    }

    /// Classifies a data file's partition tuple (of this spec).
    pub(crate) fn classify(&self, partition: &Struct) -> Result<Placement, FilterError> {
        if self.eval(&self.strict, partition)? == Some(true) {
            Ok(Placement::Inside)
        } else if self.eval(&self.inclusive, partition)? == Some(true) {
            Ok(Placement::Straddles)
        } else {
            Ok(Placement::Outside)
        }
    }

    fn problem(&self, problem: String) -> FilterError {
        FilterError::Evaluation { filter: self.source.clone(), table: self.table.clone(), problem }
    }

    fn value<'a>(&self, name: &str, partition: &'a Struct) -> Result<Option<&'a PrimitiveLiteral>, FilterError> {
        let Some(&pos) = self.positions.get(name) else {
            return Err(
                self.problem(format!("the projection names partition field {name}, which spec {} lacks", self.spec_id))
            );
        };
        match partition.fields().get(pos) {
            Some(None) => Ok(None),
            Some(Some(Literal::Primitive(p))) => Ok(Some(p)),
            Some(Some(other)) => {
                Err(self.problem(format!("partition field {name} holds {other:?}, which is not a primitive value")))
            }
            None => Err(self.problem(format!(
                "a partition tuple of {} values does not fit spec {} ({} fields)",
                partition.fields().len(),
                self.spec_id,
                self.positions.len()
            ))),
        }
    }

    fn compare(
        &self,
        name: &str,
        value: &PrimitiveLiteral,
        literal: &PrimitiveLiteral,
    ) -> Result<Ordering, FilterError> {
        use PrimitiveLiteral as L;
        let ordering = match (value, literal) {
            (L::Boolean(a), L::Boolean(b)) => a.partial_cmp(b),
            (L::Int(a), L::Int(b)) => a.partial_cmp(b),
            (L::Long(a), L::Long(b)) => a.partial_cmp(b),
            (L::Float(a), L::Float(b)) => a.partial_cmp(b),
            (L::Double(a), L::Double(b)) => a.partial_cmp(b),
            (L::String(a), L::String(b)) => a.partial_cmp(b),
            (L::Binary(a), L::Binary(b)) => a.partial_cmp(b),
            (L::Int128(a), L::Int128(b)) => a.partial_cmp(b),
            (L::UInt128(a), L::UInt128(b)) => a.partial_cmp(b),
            _ => None,
        };
        ordering.ok_or_else(|| {
            self.problem(format!("partition field {name} holds {value:?}, which cannot be compared with {literal:?}"))
        })
    }

    /// Three-valued: `None` is unknown.
    fn eval(&self, predicate: &Predicate, partition: &Struct) -> Result<Option<bool>, FilterError> {
        Ok(match predicate {
            Predicate::AlwaysTrue => Some(true),
            Predicate::AlwaysFalse => Some(false),
            Predicate::And(e) => {
                let [l, r] = e.inputs();
                match (self.eval(l, partition)?, self.eval(r, partition)?) {
                    (Some(false), _) | (_, Some(false)) => Some(false),
                    (Some(true), Some(true)) => Some(true),
                    _ => None,
                }
            }
            Predicate::Or(e) => {
                let [l, r] = e.inputs();
                match (self.eval(l, partition)?, self.eval(r, partition)?) {
                    (Some(true), _) | (_, Some(true)) => Some(true),
                    (Some(false), Some(false)) => Some(false),
                    _ => None,
                }
            }
            Predicate::Not(e) => {
                let [inner] = e.inputs();
                self.eval(inner, partition)?.map(|v| !v)
            }
            Predicate::Unary(e) => {
                let value = self.value(e.term().name(), partition)?;
                match e.op() {
                    PredicateOperator::IsNull => Some(value.is_none()),
                    PredicateOperator::NotNull => Some(value.is_some()),
                    PredicateOperator::IsNan => value.map(PrimitiveLiteral::is_nan),
                    PredicateOperator::NotNan => value.map(|v| !v.is_nan()),
                    op => return Err(self.problem(format!("unexpected unary operator {op}"))),
                }
            }
            Predicate::Binary(e) => {
                let name = e.term().name();
                let Some(value) = self.value(name, partition)? else { return Ok(None) };
                let literal = e.literal().literal();
                match e.op() {
                    PredicateOperator::StartsWith | PredicateOperator::NotStartsWith => {
                        let (PrimitiveLiteral::String(v), PrimitiveLiteral::String(prefix)) = (value, literal) else {
                            return Err(self.problem(format!(
                                "partition field {name} holds {value:?}, which cannot start with {literal:?}"
                            )));
                        };
                        Some(v.starts_with(prefix.as_str()) == (e.op() == PredicateOperator::StartsWith))
                    }
                    op => {
                        let ord = self.compare(name, value, literal)?;
                        Some(match op {
                            PredicateOperator::LessThan => ord.is_lt(),
                            PredicateOperator::LessThanOrEq => ord.is_le(),
                            PredicateOperator::GreaterThan => ord.is_gt(),
                            PredicateOperator::GreaterThanOrEq => ord.is_ge(),
                            PredicateOperator::Eq => ord.is_eq(),
                            PredicateOperator::NotEq => ord.is_ne(),
                            op => return Err(self.problem(format!("unexpected binary operator {op}"))),
                        })
                    }
                }
            }
            Predicate::Set(e) => {
                let name = e.term().name();
                let Some(value) = self.value(name, partition)? else { return Ok(None) };
                let mut found = false;
                for d in e.literals() {
                    if self.compare(name, value, d.literal())?.is_eq() {
                        found = true;
                        break;
                    }
                }
                match e.op() {
                    PredicateOperator::In => Some(found),
                    PredicateOperator::NotIn => Some(!found),
                    op => return Err(self.problem(format!("unexpected set operator {op}"))),
                }
            }
        })
    }
}

/// Projects a not-free bound predicate onto `spec`.
fn project(
    filter: &BoundFilter,
    spec: &PartitionSpec,
    predicate: &BoundPredicate,
    strict: bool,
) -> Result<Predicate, FilterError> {
    let leaf_field = match predicate {
        BoundPredicate::AlwaysTrue => return Ok(Predicate::AlwaysTrue),
        BoundPredicate::AlwaysFalse => return Ok(Predicate::AlwaysFalse),
        BoundPredicate::And(e) => {
            let [l, r] = e.inputs();
            return Ok(project(filter, spec, l, strict)?.and(project(filter, spec, r, strict)?));
        }
        BoundPredicate::Or(e) => {
            let [l, r] = e.inputs();
            return Ok(project(filter, spec, l, strict)?.or(project(filter, spec, r, strict)?));
        }
        BoundPredicate::Not(_) => {
            return Err(filter.evaluation("a 'not' was left after binding; it cannot be projected".into()));
        }
        BoundPredicate::Unary(e) => e.term().field().id,
        BoundPredicate::Binary(e) => e.term().field().id,
        BoundPredicate::Set(e) => e.term().field().id,
    };
    let mut projected: Option<Predicate> = None;
    for field in spec.fields().iter().filter(|f| f.source_id == leaf_field) {
        if truncates_a_non_ascii_prefix(field.transform, predicate) {
            // iceberg-rust 0.10.1's `Transform::project` for `truncate[W]`
            // compares a `starts with` prefix's length in bytes with W
            // (`adjust_operator`), while truncating strings counts
            // characters: a 2-byte 'é' prefix under truncate[2] projects to
            // `= 'é'`, which misses partitions 'éa', 'éb'. No projection from
            // this field is the safe answer: the partition then straddles
            // (refused) instead of being wrongly kept or replaced.
            continue;
        }
        let part = if strict {
            field.transform.strict_project(&field.name, predicate)
        } else {
            field.transform.project(&field.name, predicate)
        }
        .map_err(|e| filter.iceberg(&format!("projecting it onto partition field {}", field.name), e))?;
        if let Some(part) = part {
            projected = Some(match projected {
                None => part,
                Some(acc) if strict => acc.or(part),
                Some(acc) => acc.and(part),
            });
        }
    }
    Ok(projected.unwrap_or(if strict { Predicate::AlwaysFalse } else { Predicate::AlwaysTrue }))
}

/// Whether `predicate` is a `starts with` (or its negation) on a string with
/// a character outside ASCII, projected through a `truncate` transform.
fn truncates_a_non_ascii_prefix(transform: Transform, predicate: &BoundPredicate) -> bool {
    let BoundPredicate::Binary(e) = predicate else { return false };
    matches!(transform, Transform::Truncate(_))
        && matches!(e.op(), PredicateOperator::StartsWith | PredicateOperator::NotStartsWith)
        && matches!(e.literal().literal(), PrimitiveLiteral::String(s) if !s.is_ascii())
}
