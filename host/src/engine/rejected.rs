//! Rows a sink rejects, named where they are in the source.
//!
//! The contract's `invalid-data` message names a rejected row with the
//! phrase `row N of this writer's input for table "T"`, `N` counting from 0
//! the rows the writer was given for `T` since it opened or since `T` last
//! changed (`apply-changes`). The subtask counts the same rows, so it can
//! follow each such phrase with the row's file and line. A message without
//! the phrase is left as it is; nothing here decides anything.

/// The phrase after `row N`.
const PHRASE: &str = " of this writer's input for table ";

/// `message` with ` (in the source: ...)` after each row it names that
/// `locate(table, row)` finds.
pub fn name_rows(message: &str, locate: impl Fn(&str, u64) -> Option<String>) -> String {
    let mut out = String::with_capacity(message.len() + 64);
    let mut rest = message;
    while let Some(i) = rest.find(PHRASE) {
        let (head, tail) = rest.split_at(i);
        let after = &tail[PHRASE.len()..];
        let digits = head.len() - head.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        let named = (|| {
            let row: u64 = head[head.len() - digits..].parse().ok()?;
            if !head[..head.len() - digits].ends_with("row ") {
                return None;
            }
            let quoted = after.strip_prefix('"')?;
            let end = quoted.find('"')?;
            Some((row, &quoted[..end], end + 2))
        })();
        out.push_str(head);
        match named {
            Some((row, table, len)) => {
                out.push_str(&tail[..PHRASE.len() + len]);
                if let Some(at) = locate(table, row) {
                    out.push_str(&format!(" (in the source: {at})"));
                }
                rest = &after[len..];
            }
            None => {
                out.push_str(PHRASE);
                rest = after;
            }
        }
    }
    out.push_str(rest);
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
}
