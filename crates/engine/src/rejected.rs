//! Rows a sink rejects, named where they are in the source.
//!
//! The contract's `invalid-data` message names a rejected row with the
//! phrase `row N of this writer's input for table "T"`, `N` counting from 0
//! the rows the writer was given for `T` since it opened or since `T` last
//! changed (`apply-changes`). The subtask counts the same rows, so it can
//! follow each such phrase with the row's file and line, and, with dead
//! letters, tell which records to read again as dead letters. A message
//! without the phrase is left as it is.

/// The phrase after `row N`.
const PHRASE: &str = " of this writer's input for table ";

/// How many named rows a message shows.
const SHOWN: usize = 5;

/// A row a sink named: its table, its index in the writer's input for
/// that table, and the reason (the text after the phrase, up to the next
/// named row).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named {
    pub table: String,
    pub row: u64,
    pub reason: String,
}

/// Where a named row is in a message: its phrase from `start` (the `row`)
/// to `end` (after the table's closing quote).
struct Found {
    start: usize,
    end: usize,
    row: u64,
    table: String,
}

fn scan(message: &str) -> Vec<Found> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(i) = message[from..].find(PHRASE).map(|i| from + i) {
        let head = &message[..i];
        let after = &message[i + PHRASE.len()..];
        let digits = head.len() - head.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let start = head.len() - digits;
        let parsed = (|| {
            let row: u64 = head[start..].parse().ok()?;
            let before = head[..start].strip_suffix("row ")?;
            let quoted = after.strip_prefix('"')?;
            let end = quoted.find('"')?;
            Some(Found { start: before.len(), end: i + PHRASE.len() + end + 2, row, table: quoted[..end].to_string() })
        })();
        found.extend(parsed);
        from = i + PHRASE.len();
    }
    found
}

/// Every row `message` names.
pub fn named_rows(message: &str) -> Vec<Named> {
    let found = scan(message);
    let mut out = Vec::with_capacity(found.len());
    for (n, f) in found.iter().enumerate() {
        let stop = found.get(n + 1).map_or(message.len(), |next| next.start);
        let text = message[f.end..stop].trim_end_matches([';', ' ']);
        // `(row 3 of the request): why` or `: why`.
        let text = match text.strip_prefix(" (").and_then(|t| t.split_once("): ")) {
            Some((_, why)) => why,
            None => text.trim_start_matches([':', ' ']),
        };
        out.push(Named { table: f.table.clone(), row: f.row, reason: text.to_string() });
    }
    out
}

/// `message` with ` (in the source: ...)` after each row it names that
/// `locate(table, row)` finds, cut after the first few named rows.
pub fn name_rows(message: &str, locate: impl Fn(&str, u64) -> Option<String>) -> String {
    let found = scan(message);
    let mut out = String::with_capacity(message.len().min(4096) + 64);
    let mut at = 0;
    for (n, f) in found.iter().enumerate() {
        if n == SHOWN {
            out.push_str(&message[at..f.start]);
            out.push_str(&format!("and {} more rows", found.len() - SHOWN));
            return out;
        }
        out.push_str(&message[at..f.end]);
        if let Some(place) = locate(&f.table, f.row) {
            out.push_str(&format!(" (in the source: {place})"));
        }
        at = f.end;
    }
    out.push_str(&message[at..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_named_row_is_followed_by_its_place_in_the_source() {
        let message = "BigQuery rejected 2 rows: row 7 of this writer's input for table \"orders\": too long; \
                       row 9 of this writer's input for table \"orders\": bad; row x of this writer's input for table";
        let named = name_rows(message, |table, row| (table == "orders" && row == 7).then(|| "a.csv line 9".into()));
        assert_eq!(
            named,
            "BigQuery rejected 2 rows: row 7 of this writer's input for table \"orders\" (in the source: a.csv line 9): \
             too long; row 9 of this writer's input for table \"orders\": bad; row x of this writer's input for table"
        );
        assert_eq!(name_rows("no rows named", |_, _| Some("x".into())), "no rows named");
    }

    #[test]
    fn every_named_row_is_found_with_its_reason() {
        let message = "BigQuery rejected 2 row(s): row 7 of this writer's input for table \"orders\" (row 1 of the \
                       request): too long; row 19 of this writer's input for table \"\": bad value; and 3 more rows";
        let named = named_rows(message);
        assert_eq!(
            named,
            vec![
                Named { table: "orders".into(), row: 7, reason: "too long".into() },
                Named { table: "".into(), row: 19, reason: "bad value; and 3 more rows".into() },
            ]
        );
        assert!(named_rows("row x of this writer's input for table").is_empty());
    }

    #[test]
    fn a_long_list_is_cut_after_a_few_rows() {
        let message: String =
            (0..8).map(|r| format!("row {r} of this writer's input for table \"t\": bad; ")).collect();
        let named = name_rows(&message, |_, r| Some(format!("a.csv line {}", r + 2)));
        assert!(named.starts_with("row 0 of this writer's input for table \"t\" (in the source: a.csv line 2): bad; "));
        assert!(named.ends_with("(in the source: a.csv line 6): bad; and 3 more rows"), "{named}");
        assert_eq!(named_rows(&message).len(), 8);
    }
}
