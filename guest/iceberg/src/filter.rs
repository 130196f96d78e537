//! `overwrite_filter`: the Iceberg sink's explicit overwrite scope (issue 40,
//! point 2), an expression in the subset of PyIceberg's string filters
//! (`pyiceberg/expressions/parser.py`).
//!
//! The pieces, in the order a job uses them:
//! - [`OverwriteFilter::parse`]: the text, by a hand-written recursive
//!   descent parser (`parse.rs`). iceberg-rust 0.10 has no string predicate
//!   parser (its `expr` module holds only `accessor`, `predicate`, `term` and
//!   the crate-private visitors), hence our own.
//! - [`OverwriteFilter::bind`]: to a table's schema (`bind.rs`). String
//!   literals take the type of the column they are compared with; the result
//!   is an `iceberg::expr::BoundPredicate` without `not` (pushed down by
//!   `Predicate::rewrite_not`).
//! - [`BoundFilter::check_partitioned_by`]: every column the filter names is
//!   the source of a partition field, because Sluice replaces whole data files.
//! - [`BoundFilter::project`] and [`PartitionFilter::classify`]: the inclusive
//!   and strict projections onto a partition spec (`partition.rs`, through the
//!   public `Transform::project` / `Transform::strict_project`), evaluated over a
//!   data file's partition tuple. iceberg's own projection visitors and
//!   `ExpressionEvaluator` are `pub(crate)`, so the small walker and evaluator
//!   are ours.
//! - [`BoundFilter::first_row_outside`]: the row check over a converted Arrow
//!   batch, with arrow's comparison and Kleene kernels (`rows.rs`).
//!
//! Invariants:
//! - one truth table everywhere: a comparison with a null value is unknown,
//!   `and`/`or` are Kleene's, and only `true` matches. A row whose filter value
//!   is unknown is outside the filter (the row check refuses it), and a
//!   partition whose projected value is unknown holds no matching row;
//! - a partition is [`Placement::Inside`] only when the strict projection is
//!   true (every row of it matches), [`Placement::Outside`] only when the
//!   inclusive projection is not true (no row of it can match); anything else
//!   straddles, and is never deleted as a whole;
//! - every error names the cause: the character position for syntax, the
//!   column and literal for binding, the column and table for the partition
//!   check.
//!
//! Used by `config.rs` (parse), the writer (bind, partition check, row
//! check) and the overwrite committer (`overwrite.rs`: bind, projections).
//! A few accessors serve only the tests and error texts, hence the
//! `dead_code` allowance.
#![allow(dead_code)]

mod bind;
mod parse;
mod partition;
mod rows;

use std::fmt;

use iceberg::expr::BoundPredicate;
use iceberg::spec::SchemaRef;

pub(crate) use partition::{PartitionFilter, Placement};
#[allow(unused_imports)]
pub(crate) use rows::RowOutside;

/// What can go wrong with an `overwrite_filter`, each naming its cause.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FilterError {
    /// The text does not follow the grammar. `offset` is the byte offset,
    /// `character` the 1-based character number shown to the user.
    #[error("overwrite_filter: at character {character}: expected {expected}, found {found}")]
    Syntax { offset: usize, character: usize, expected: String, found: String },
    /// The text follows the grammar but asks for something Sluice does not do.
    #[error("overwrite_filter: at character {character}: {problem}")]
    Unsupported { offset: usize, character: usize, problem: String },
    /// The filter names a column the table does not have.
    #[error("overwrite_filter names column {column}, which table {table} does not have{hint}")]
    UnknownColumn { column: String, table: String, hint: String },
    /// A literal cannot be a value of the column it is compared with.
    #[error("overwrite_filter: {literal} does not fit column {column} of table {table}, which is {ty}: {reason}")]
    Literal { column: String, table: String, literal: String, ty: String, reason: String },
    /// The filter names a column that no partition field is derived from.
    #[error(
        "overwrite_filter names column {column}, which table {table} is not partitioned by; \
         Sluice replaces whole data files, so partition the table by the filter's columns"
    )]
    NotPartitioned { column: String, table: String },
    /// iceberg refused to bind or project the filter.
    #[error("overwrite_filter `{filter}` on table {table}: {context}: {source}")]
    Iceberg {
        filter: String,
        table: String,
        context: String,
        #[source]
        source: Box<iceberg::Error>,
    },
    /// A partition tuple or a batch does not have the shape the filter was
    /// bound to.
    #[error("overwrite_filter `{filter}` on table {table}: {problem}")]
    Evaluation { filter: String, table: String, problem: String },
    /// An Arrow kernel failed during the row check.
    #[error("overwrite_filter `{filter}` on table {table}: checking rows: {source}")]
    Arrow {
        filter: String,
        table: String,
        #[source]
        source: arrow_schema::ArrowError,
    },
}

impl FilterError {
    /// As the contract's error: what the user wrote or chose is `config`;
    /// a failure evaluating a filter that bound is `fatal`.
    pub(crate) fn into_sink_error(self) -> sluice_guest_sdk::SinkError {
        use sluice_guest_sdk::error;
        match self {
            Self::Syntax { .. }
            | Self::Unsupported { .. }
            | Self::UnknownColumn { .. }
            | Self::Literal { .. }
            | Self::NotPartitioned { .. } => error::config(format!("[sink.options] {self}")),
            Self::Iceberg { .. } | Self::Evaluation { .. } | Self::Arrow { .. } => error::fatal(self.to_string()),
        }
    }
}

/// A parsed `overwrite_filter`, not yet tied to a table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OverwriteFilter {
    source: String,
    expr: parse::Expr,
}

impl OverwriteFilter {
    /// Parses `text` (the option's value).
    pub(crate) fn parse(text: &str) -> Result<Self, FilterError> {
        Ok(Self { source: text.to_owned(), expr: parse::parse(text)? })
    }

    /// The text as the user wrote it.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// The columns the filter names, each once, in order of appearance.
    pub(crate) fn columns(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        self.expr.visit_columns(&mut |c| {
            if !out.contains(&c) {
                out.push(c);
            }
        });
        out
    }

    /// Binds the filter to the schema of table `table` (named in errors).
    /// Column names are case-sensitive and top-level.
    pub(crate) fn bind(&self, schema: &SchemaRef, table: &str) -> Result<BoundFilter, FilterError> {
        bind::bind(self, schema, table)
    }
}

impl fmt::Display for OverwriteFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// A filter bound to one table's schema.
#[derive(Debug, Clone)]
pub(crate) struct BoundFilter {
    source: String,
    table: String,
    /// Without `Not` nodes.
    predicate: BoundPredicate,
    /// (name, field id) of each column the filter names, in order of appearance.
    columns: Vec<(String, i32)>,
}

impl BoundFilter {
    /// The filter's text.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// The table it is bound to.
    pub(crate) fn table(&self) -> &str {
        &self.table
    }

    /// The bound predicate, with `not` pushed down to the leaves.
    pub(crate) fn predicate(&self) -> &BoundPredicate {
        &self.predicate
    }

    /// The names of the columns the filter names, in order of appearance.
    pub(crate) fn columns(&self) -> impl Iterator<Item = &str> {
        self.columns.iter().map(|(name, _)| name.as_str())
    }

    fn evaluation(&self, problem: String) -> FilterError {
        FilterError::Evaluation { filter: self.source.clone(), table: self.table.clone(), problem }
    }

    fn iceberg(&self, context: &str, source: iceberg::Error) -> FilterError {
        FilterError::Iceberg {
            filter: self.source.clone(),
            table: self.table.clone(),
            context: context.into(),
            source: Box::new(source),
        }
    }
}

/// `offset` (a byte offset into `text`) as a 1-based character number.
fn character_at(text: &str, offset: usize) -> usize {
    text.get(..offset).map_or(offset, |before| before.chars().count()) + 1
}

#[cfg(test)]
mod tests;
