//! Change streams: what a source tells a sink about each row when the job
//! lands changes (upserts and deletes) rather than appends.
//!
//! Invariants (the contract side is in `docs/src/plugins/contract.md`,
//! "Change streams"):
//! - a change-stream batch carries, after the table's own columns, exactly
//!   [`OP`], [`SEQ_HI`] and [`SEQ_LO`], non-null, in that order; the
//!   schemas the host hands a plugin as `table` records never carry them;
//! - `(hi, lo)` is the change's source position: strictly increasing per
//!   key in the order the changes apply, and the same for the same change
//!   when a run replays it;
//! - the key columns are given to the plugin in the reserved option
//!   [`KEY_OPTION`], as a JSON array of column names.

/// The operation column: [`Op::Upsert`] or [`Op::Delete`] as a `UInt8`.
pub const OP: &str = "_sluice_op";
/// The major part of the change's source position (`UInt64`).
pub const SEQ_HI: &str = "_sluice_seq_hi";
/// The minor part of the change's source position (`UInt64`).
pub const SEQ_LO: &str = "_sluice_seq_lo";
/// The reserved sink option naming the key columns (a JSON array).
pub const KEY_OPTION: &str = "sluice.key";

/// Whether `name` is one of the columns a change stream appends.
pub fn is_change_column(name: &str) -> bool {
    name == OP || name == SEQ_HI || name == SEQ_LO
}

/// What a change does to its key's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Insert the row, or replace the key's row (insert, update, a
    /// snapshot read).
    Upsert = 0,
    /// Remove the key's row.
    Delete = 1,
}

impl Op {
    /// Reads an operation as a change column or Debezium's `op` spells it:
    /// `insert`, `update`, `delete`, or Debezium's `c`, `r`, `u`, `d`, in
    /// any case, surrounding whitespace ignored. `None` for anything else.
    pub fn parse(value: &str) -> Option<Op> {
        let v = value.trim();
        const UPSERT: [&str; 5] = ["insert", "update", "c", "r", "u"];
        const DELETE: [&str; 2] = ["delete", "d"];
        if UPSERT.iter().any(|w| v.eq_ignore_ascii_case(w)) {
            Some(Op::Upsert)
        } else if DELETE.iter().any(|w| v.eq_ignore_ascii_case(w)) {
            Some(Op::Delete)
        } else {
            None
        }
    }

    /// The value of the [`OP`] column.
    pub fn code(self) -> u8 {
        self as u8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_parse_in_both_spellings_and_any_case() {
        for v in ["insert", "UPDATE", " c ", "R", "u"] {
            assert_eq!(Op::parse(v), Some(Op::Upsert), "{v}");
        }
        for v in ["delete", "D", " Delete"] {
            assert_eq!(Op::parse(v), Some(Op::Delete), "{v}");
        }
        for v in ["", "upsert", "x", "del", "t"] {
            assert_eq!(Op::parse(v), None, "{v}");
        }
        assert_eq!(Op::Delete.code(), 1);
        assert!(is_change_column(OP) && is_change_column(SEQ_LO) && !is_change_column("id"));
    }
}
