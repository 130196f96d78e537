//! How a sink's `table` pattern names the tables it lands.

/// Whether `table` is what `pattern` (a sink's `table` option with one
/// `{table}`) makes of some name: the Iceberg plugin lands such a name as
/// it is (`guest/iceberg/src/config.rs`, the same rule).
pub fn in_pattern_form(pattern: &str, table: &str) -> bool {
    let Some((before, after)) = pattern.split_once("{table}") else { return false };
    !after.contains("{table}")
        && table.len() > before.len() + after.len()
        && table.starts_with(before)
        && table.ends_with(after)
}
