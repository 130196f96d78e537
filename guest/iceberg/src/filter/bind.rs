//! Binding a parsed filter to a table schema: each literal becomes a `Datum`
//! of exactly its column's type, then iceberg binds the predicate.
//!
//! Invariants:
//! - columns are top-level and case-sensitive; an unknown one is an error
//!   naming it and the table (with the case-insensitive match as a hint);
//! - a literal that is not a value of its column's type is an error naming
//!   the column, the literal and the type, never a silent cast: a decimal
//!   literal with more places than the column's scale, an integer out of the
//!   column's range, a date that does not exist are all refused;
//! - string literals are read by the column's type: `'YYYY-MM-DD'` for a date,
//!   ISO 8601 for a timestamp (a bare date is midnight; for `timestamptz` an
//!   offset may be given, and none means UTC), and the text itself for ints,
//!   longs, decimals, booleans and UUIDs;
//! - the bound predicate has no `Not` node (`Predicate::rewrite_not`).

use iceberg::expr::{Bind, Predicate, Reference};
use iceberg::spec::{Datum, PrimitiveLiteral, PrimitiveType, SchemaRef, Type};

use super::parse::{CmpOp, Column, Expr, Lit, LitValue};
use super::{BoundFilter, FilterError, OverwriteFilter, PartitionFilter};

pub(super) fn bind(filter: &OverwriteFilter, schema: &SchemaRef, table: &str) -> Result<BoundFilter, FilterError> {
    let mut cx = Binder { schema, table, columns: Vec::new() };
    let predicate = cx.predicate(&filter.expr)?.rewrite_not();
    let bound = predicate.bind(schema.clone(), true).map_err(|source| FilterError::Iceberg {
        filter: filter.source.clone(),
        table: table.into(),
        context: "binding it to the table's schema".into(),
        source: Box::new(source),
    })?;
    Ok(BoundFilter { source: filter.source.clone(), table: table.into(), predicate: bound, columns: cx.columns })
}

struct Binder<'a> {
    schema: &'a SchemaRef,
    table: &'a str,
    columns: Vec<(String, i32)>,
}

impl Binder<'_> {
    /// The walk over `and`/`or`/`not`; its frame stays small (leaves are
    /// built in [`Self::leaf`]), since a filter may be a long chain.
    fn predicate(&mut self, expr: &Expr) -> Result<Predicate, FilterError> {
        Ok(match expr {
            Expr::And(l, r) => self.predicate(l)?.and(self.predicate(r)?),
            Expr::Or(l, r) => self.predicate(l)?.or(self.predicate(r)?),
            Expr::Not(e) => !self.predicate(e)?,
            leaf => self.leaf(leaf)?,
        })
    }

    #[inline(never)]
    fn leaf(&mut self, expr: &Expr) -> Result<Predicate, FilterError> {
        Ok(match expr {
            Expr::Always(true) => Predicate::AlwaysTrue,
            Expr::Always(false) => Predicate::AlwaysFalse,
            // not leaves: never passed here, and correct if they were
            Expr::And(..) | Expr::Or(..) | Expr::Not(_) => self.predicate(expr)?,
            Expr::Compare { column, op, literal } => {
                let ty = self.column_type(column)?;
                let datum = self.datum(column, &ty, literal)?;
                let r = Reference::new(&column.name);
                match op {
                    CmpOp::Lt => r.less_than(datum),
                    CmpOp::LtEq => r.less_than_or_equal_to(datum),
                    CmpOp::Gt => r.greater_than(datum),
                    CmpOp::GtEq => r.greater_than_or_equal_to(datum),
                    CmpOp::Eq => r.equal_to(datum),
                    CmpOp::NotEq => r.not_equal_to(datum),
                }
            }
            Expr::In { column, negated, literals } => {
                let ty = self.column_type(column)?;
                let datums = literals.iter().map(|l| self.datum(column, &ty, l)).collect::<Result<Vec<_>, _>>()?;
                let r = Reference::new(&column.name);
                if *negated { r.is_not_in(datums) } else { r.is_in(datums) }
            }
            Expr::Null { column, negated } => {
                self.column_type(column)?;
                let r = Reference::new(&column.name);
                if *negated { r.is_not_null() } else { r.is_null() }
            }
            Expr::Nan { column, negated } => {
                let ty = self.column_type(column)?;
                if !matches!(ty, PrimitiveType::Float | PrimitiveType::Double) {
                    return Err(FilterError::Literal {
                        column: column.name.clone(),
                        table: self.table.into(),
                        literal: "is nan".into(),
                        ty: ty.to_string(),
                        reason: "only float and double columns can be NaN".into(),
                    });
                }
                let r = Reference::new(&column.name);
                if *negated { r.is_not_nan() } else { r.is_nan() }
            }
            Expr::StartsWith { column, negated, prefix, .. } => {
                let ty = self.column_type(column)?;
                if ty != PrimitiveType::String {
                    return Err(FilterError::Literal {
                        column: column.name.clone(),
                        table: self.table.into(),
                        literal: format!("like '{}%'", prefix.replace('\'', "''")),
                        ty: ty.to_string(),
                        reason: "like applies to string columns only".into(),
                    });
                }
                let r = Reference::new(&column.name);
                let datum = Datum::string(prefix);
                if *negated { r.not_starts_with(datum) } else { r.starts_with(datum) }
            }
        })
    }

    /// The type of a top-level primitive column, recording it as named.
    fn column_type(&mut self, column: &Column) -> Result<PrimitiveType, FilterError> {
        let Some(field) = self.schema.as_struct().field_by_name(&column.name) else {
            let hint = self
                .schema
                .as_struct()
                .fields()
                .iter()
                .find(|f| f.name.eq_ignore_ascii_case(&column.name))
                .map(|f| format!(" (it has {}; column names are case-sensitive)", f.name))
                .unwrap_or_default();
            return Err(FilterError::UnknownColumn { column: column.name.clone(), table: self.table.into(), hint });
        };
        let Type::Primitive(ty) = field.field_type.as_ref() else {
            return Err(FilterError::Literal {
                column: column.name.clone(),
                table: self.table.into(),
                literal: "a comparison".into(),
                ty: field.field_type.to_string(),
                reason: "a filter compares primitive columns only".into(),
            });
        };
        if !self.columns.iter().any(|(n, _)| *n == column.name) {
            self.columns.push((column.name.clone(), field.id));
        }
        Ok(ty.clone())
    }

    fn datum(&self, column: &Column, ty: &PrimitiveType, lit: &Lit) -> Result<Datum, FilterError> {
        datum_for(ty, &lit.value).map_err(|reason| FilterError::Literal {
            column: column.name.clone(),
            table: self.table.into(),
            literal: shown(&lit.value),
            ty: ty.to_string(),
            reason,
        })
    }
}

/// A literal as the user wrote it (strings re-quoted).
fn shown(value: &LitValue) -> String {
    match value {
        LitValue::Str(s) => format!("'{}'", s.replace('\'', "''")),
        LitValue::Int(s) | LitValue::Dec(s) => s.clone(),
        LitValue::Bool(b) => b.to_string(),
    }
}

/// `value` as a datum of type `ty`, or why it is not one.
fn datum_for(ty: &PrimitiveType, value: &LitValue) -> Result<Datum, String> {
    use PrimitiveType as P;
    let text = match value {
        LitValue::Bool(b) => {
            return match ty {
                P::Boolean => Ok(Datum::bool(*b)),
                _ => Err("a boolean is not a value of this type".into()),
            };
        }
        LitValue::Int(s) | LitValue::Dec(s) | LitValue::Str(s) => s.as_str(),
    };
    let is_number = matches!(value, LitValue::Int(_) | LitValue::Dec(_));
    match ty {
        P::Boolean if is_number => Err("a number is not a boolean; write true or false".into()),
        P::Boolean => match text {
            "true" => Ok(Datum::bool(true)),
            "false" => Ok(Datum::bool(false)),
            _ => Err("a boolean is true or false".into()),
        },
        P::Int => text.parse::<i32>().map(Datum::int).map_err(|e| format!("not an int: {e}")),
        P::Long => text.parse::<i64>().map(Datum::long).map_err(|e| format!("not a long: {e}")),
        P::Float => match text.parse::<f32>() {
            Ok(v) if v.is_finite() || !is_number => Ok(Datum::float(v)),
            Ok(_) => Err("out of the float range".into()),
            Err(e) => Err(format!("not a float: {e}")),
        },
        P::Double => match text.parse::<f64>() {
            Ok(v) if v.is_finite() || !is_number => Ok(Datum::double(v)),
            Ok(_) => Err("out of the double range".into()),
            Err(e) => Err(format!("not a double: {e}")),
        },
        P::Decimal { precision, scale } => decimal(text, *precision, *scale),
        _ if is_number => Err(format!("a number is not a {ty}; quote the value")),
        P::String => Ok(Datum::string(text)),
        P::Date => Datum::date_from_str(text).map_err(|_| "not a date of the form 'YYYY-MM-DD'".into()),
        P::Time => Datum::time_from_str(text).map_err(|_| "not a time of the form 'HH:MM:SS[.ffffff]'".into()),
        P::Timestamp => timestamp(text),
        P::Timestamptz => Datum::timestamptz_from_str(text).or_else(|_| {
            // No offset given: the wall-clock time in UTC.
            let local = timestamp(text)?;
            match local.literal() {
                PrimitiveLiteral::Long(micros) => Ok(Datum::timestamptz_micros(*micros)),
                _ => Err("not a timestamp".to_string()),
            }
        }),
        P::Uuid => Datum::uuid_from_str(text).map_err(|_| "not a UUID".into()),
        P::TimestampNs | P::TimestamptzNs | P::Fixed(_) | P::Binary => {
            Err("overwrite_filter does not compare columns of this type".into())
        }
    }
}

/// A `timestamp` from `YYYY-MM-DDTHH:MM:SS[.f]` (or a space for the `T`),
/// or from a bare date (midnight).
fn timestamp(text: &str) -> Result<Datum, String> {
    const FORM: &str = "not a timestamp of the form 'YYYY-MM-DDTHH:MM:SS[.ffffff]' or 'YYYY-MM-DD'";
    if let Ok(d) = Datum::timestamp_from_str(text) {
        return Ok(d);
    }
    let with_t = if text.len() > 10 && text.as_bytes().get(10) == Some(&b' ') {
        format!("{}T{}", &text[..10], &text[11..])
    } else if text.len() == 10 {
        format!("{text}T00:00:00")
    } else {
        return Err(FORM.into());
    };
    Datum::timestamp_from_str(&with_t).map_err(|_| FORM.into())
}

/// A decimal of exactly `scale` places: extra places must be zeros, missing
/// ones are padded (so `1.5` fits `decimal(9, 2)` as `1.50`). iceberg's
/// `Datum::to` refuses to rescale, so the digits are aligned here, as text;
/// iceberg then checks the precision.
fn decimal(text: &str, precision: u32, scale: u32) -> Result<Datum, String> {
    let (sign, digits) = match text.as_bytes().first() {
        Some(b'-') => ("-", &text[1..]),
        Some(b'+') => ("", &text[1..]),
        _ => ("", text),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if (int.is_empty() && frac.is_empty()) || !int.bytes().chain(frac.bytes()).all(|b| b.is_ascii_digit()) {
        return Err("not a decimal number".into());
    }
    let scale = scale as usize;
    let (kept, dropped) = frac.split_at(frac.len().min(scale));
    if dropped.bytes().any(|b| b != b'0') {
        return Err(format!("it has more than {scale} decimal places"));
    }
    let int = if int.is_empty() { "0" } else { int };
    let aligned = if scale == 0 { format!("{sign}{int}") } else { format!("{sign}{int}.{kept:0<scale$}") };
    let datum = Datum::decimal_from_str(&aligned).map_err(|e| format!("not a decimal number: {e}"))?;
    datum
        .to(&Type::Primitive(PrimitiveType::Decimal { precision, scale: scale as u32 }))
        .map_err(|_| format!("it has more than {precision} digits"))
}

impl BoundFilter {
    /// Refuses a filter that names a column no (non-void) partition field of
    /// `spec` is derived from.
    pub(crate) fn check_partitioned_by(&self, spec: &iceberg::spec::PartitionSpec) -> Result<(), FilterError> {
        for (name, id) in &self.columns {
            let partitioned =
                spec.fields().iter().any(|f| f.source_id == *id && f.transform != iceberg::spec::Transform::Void);
            if !partitioned {
                return Err(FilterError::NotPartitioned { column: name.clone(), table: self.table.clone() });
            }
        }
        Ok(())
    }

    /// The inclusive and strict projections of the filter onto `spec`.
    pub(crate) fn project(&self, spec: &iceberg::spec::PartitionSpec) -> Result<PartitionFilter, FilterError> {
        PartitionFilter::new(self, spec)
    }
}
