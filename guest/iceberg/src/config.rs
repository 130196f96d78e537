//! The sink's options, parsed once and checked before anything is written.

use std::str::FromStr;

use iceberg::spec::Transform;
use iceberg::{NamespaceIdent, TableIdent};
use sluice_guest_sdk::options::Options;
use sluice_guest_sdk::{OptionSpec, SinkError, claim, error, option_spec};

use crate::filter::OverwriteFilter;

pub fn option_specs() -> Vec<OptionSpec> {
    vec![
        option_spec(
            "table",
            "the table, as `namespace.name` (nested namespaces: `a.b.name`); for a source of several tables, a pattern with `{table}`, e.g. `lake.{table}`. A source table named in full (such as the job's dead-letter table `lake.dead_letters`) lands there itself: beside a plain name when it is dotted, beside a pattern when it already has the pattern's form (`lake.dead_letters` for `lake.{table}`, not `lake.lake.dead_letters`)",
            true,
            None,
        ),
        option_spec(
            "create_table",
            "create the table from the source schema (and `partition_by`) when it does not exist",
            false,
            Some("true"),
        ),
        option_spec(
            "partition_by",
            "partition fields for a table Sluice creates, e.g. `day(ts), identity(region)`; transforms: identity, year, month, day, hour, bucket[N], truncate[W]. An existing table must already have this spec",
            false,
            None,
        ),
        option_spec(
            "target_file_mb",
            "roll to a new data file once the current one reaches this many MiB",
            false,
            Some("128"),
        ),
        option_spec("compression", "Parquet compression codec: `zstd`, `snappy` or `none`", false, Some("zstd")),
        option_spec(
            "buffer_mb",
            "each writer's memory budget for rows encoded but not yet written out: row groups are cut so that all the files a writer holds open stay within it, whatever the checkpoint interval",
            false,
            Some("64"),
        ),
        option_spec(
            "mode",
            "`append` adds the rows to the table; `overwrite-partitions` makes the rows a run lands replace every \
             partition they touch (the first checkpoint of an incarnation that touches a partition replaces it, later \
             ones add to it; an unpartitioned table is replaced whole), in one `overwrite` snapshot per checkpoint, \
             refused when another writer added rows to or deleted rows from such a partition since the run began; \
             `upsert`, for a change stream (`[source] key`), makes each change insert, replace or delete its key's \
             row: one snapshot per checkpoint with the new rows and position deletes (deletion vectors on format \
             version 3) for the rows they replace",
            false,
            Some("append"),
        ),
        option_spec(
            "overwrite_filter",
            "only with mode = \"overwrite-partitions\": the rows the run replaces, as an Iceberg predicate in the \
             subset PyIceberg's string filters accept (comparisons, `in`, `is null`, `and`/`or`/`not` on columns, e.g. \
             `day >= '2024-01-01' and day < '2024-02-01'`). Every row matching it is replaced by what the run lands \
             (a day in it without input rows ends empty); an input row outside it is refused. Its columns must be \
             sources of the table's partition fields, since whole data files are replaced",
            false,
            None,
        ),
        option_spec(
            "allow_empty_overwrite",
            "with `overwrite_filter`: let an input that is entirely empty delete every row matching the filter \
             (otherwise refused, so an upstream outage cannot wipe the filter's range)",
            false,
            Some("false"),
        ),
        option_spec(
            DEAD_LETTER_TABLE,
            "set by the host, not the job file: the job's dead-letter table, which always takes appends",
            false,
            None,
        ),
        option_spec(
            "key",
            "only with mode = \"upsert\": the change key, one column or a comma list (`id` or `tenant, id`); \
             optional, since the source's `[source] key` is the key, and when given it must name the same columns",
            false,
            None,
        ),
        option_spec(
            "key_index_max_mb",
            "only with mode = \"upsert\": the most memory the committer's key index (key -> data file and row) of \
             one table may take, in MiB; a table with more keys is refused naming this option",
            false,
            Some("1024"),
        ),
        option_spec(
            "format_version",
            "the Iceberg format version of a table Sluice creates: `2` or `3`. On a version-3 table mode = \"upsert\" \
             deletes rows with deletion vectors (Puffin), which PyIceberg 0.12 and DuckDB read and iceberg-rust 0.10 \
             does not; version 2 (position-delete files) is read by all three. An existing table keeps its version",
            false,
            Some("2"),
        ),
        option_spec(
            "keep_snapshots",
            "how many of the newest snapshots of a table the job keeps: once a commit leaves the table with 50 more (or \
             `keep_snapshots` more, when that is fewer), \
             the older ones are expired in the same call (their files no remaining snapshot names are deleted), so \
             the table's metadata stays small however long the job runs. What makes commits exactly-once (the \
             table's `sluice.committed.*` properties) does not depend on snapshots. `0` keeps every snapshot \
             (expire them with `sluice maintain`)",
            false,
            Some("200"),
        ),
        sluice_guest_sdk::changes::key_option_spec(),
        claim::option_spec(),
    ]
}

pub use sluice_guest_sdk::reserved::DEAD_LETTER_TABLE;

/// How the rows of a run meet the rows a table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Added to them.
    Append,
    /// They replace every partition they touch (dynamic partition overwrite).
    OverwritePartitions,
    /// A change stream: each row replaces or deletes the table's row of its
    /// key (see [`crate::upsert`]).
    Upsert,
}

/// One partition field as the user wrote it.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionField {
    pub column: String,
    pub transform: Transform,
}

#[derive(Debug, Clone)]
pub struct Config {
    /// `ns.name`, or a pattern with `{table}` for a source of several tables.
    pub table: String,
    pub create_table: bool,
    pub partition_by: Option<Vec<PartitionField>>,
    pub target_file_bytes: usize,
    /// Each writer's budget for buffered row groups.
    pub buffer_bytes: usize,
    pub compression: parquet::basic::Compression,
    /// How this incarnation treats the tables' claims.
    pub claim: claim::Mode,
    pub mode: Mode,
    /// The job's dead-letter table as the source names it (always appended to).
    pub dead_letter_table: Option<String>,
    /// `overwrite_filter`: the explicit scope of an overwrite (only with
    /// [`Mode::OverwritePartitions`]).
    pub overwrite_filter: Option<OverwriteFilter>,
    /// `allow_empty_overwrite`: an entirely empty input may delete the
    /// filter's rows.
    pub allow_empty_overwrite: bool,
    /// The change stream's key columns (`sluice.key`, from `[source] key`):
    /// set exactly when the source is a change stream.
    pub key: Option<Vec<String>>,
    /// `key_index_max_mb` in bytes.
    pub key_index_max_bytes: usize,
    /// `format_version`: the Iceberg format version (2 or 3) of a table
    /// Sluice creates.
    pub format_version: u8,
    /// `keep_snapshots`: 0 keeps every snapshot.
    pub keep_snapshots: u32,
}

impl Config {
    pub fn parse(raw: Vec<(String, String)>) -> Result<Self, SinkError> {
        let opts = Options::parse(raw, &option_specs())?;
        let table = opts.required("table")?.trim().to_string();
        // The pattern must make a valid name for some table.
        parse_table(&table.replace("{table}", "t"))?;
        let create_table = opts.flag("create_table")?;
        let partition_by = opts.get("partition_by").map(parse_partition_by).transpose()?;
        let target_mb: usize = opts.parsed("target_file_mb")?.unwrap_or(128);
        if target_mb == 0 {
            return Err(error::config("option `target_file_mb` must be at least 1"));
        }
        let compression = match opts.required("compression")? {
            "zstd" => parquet::basic::Compression::ZSTD(parquet::basic::ZstdLevel::default()),
            "snappy" => parquet::basic::Compression::SNAPPY,
            "none" => parquet::basic::Compression::UNCOMPRESSED,
            other => {
                return Err(error::config(format!(
                    "option `compression` = {other:?} is not supported; use `zstd`, `snappy` or `none`"
                )));
            }
        };
        let buffer_mb: usize = opts.parsed("buffer_mb")?.unwrap_or(64);
        if buffer_mb == 0 {
            return Err(error::config("option `buffer_mb` must be at least 1"));
        }
        let mode = match opts.required("mode")? {
            "append" => Mode::Append,
            "overwrite-partitions" => Mode::OverwritePartitions,
            "upsert" => Mode::Upsert,
            other => {
                return Err(error::config(format!(
                    "[sink.options] mode = {other:?} is not a mode of the Iceberg sink; use \"append\" (the default), \
                     \"overwrite-partitions\" or \"upsert\""
                )));
            }
        };
        let dead_letter_table = opts.get(DEAD_LETTER_TABLE).map(str::to_string);
        let overwrite_filter = opts
            .get("overwrite_filter")
            .map(|text| OverwriteFilter::parse(text).map_err(|e| error::config(format!("[sink.options] {e}"))))
            .transpose()?;
        if overwrite_filter.is_some() && mode != Mode::OverwritePartitions {
            return Err(error::config(
                "[sink.options] overwrite_filter is set but mode is \"append\"; a filter scopes an overwrite, so set \
                 [sink.options] mode = \"overwrite-partitions\" or drop overwrite_filter",
            ));
        }
        if overwrite_filter.is_some() && table.contains("{table}") {
            // The end of the input is told only when its last round prepared
            // nothing (`committer-state.finish`), so a table of a pattern that
            // got no rows while others did would keep its old rows inside the
            // filter, unreported. Refused until that can be decided per table.
            return Err(error::config(format!(
                "[sink.options] overwrite_filter is set with table = {table:?}, a pattern for a source of several \
                 tables; a filter replaces everything it matches, and a table of the pattern without input rows would \
                 keep its old rows unnoticed. Give each table its own job (a plain `table`) with its filter, or drop \
                 overwrite_filter to replace exactly the partitions the rows touch"
            )));
        }
        let allow_empty_overwrite = opts.flag("allow_empty_overwrite")?;
        if allow_empty_overwrite && overwrite_filter.is_none() {
            return Err(error::config(
                "[sink.options] allow_empty_overwrite = true needs [sink.options] overwrite_filter (with mode = \
                 \"overwrite-partitions\"): without a filter an empty input replaces nothing",
            ));
        }
        let key = parse_change_key(&opts, mode)?;
        let index_mb: usize = opts.parsed("key_index_max_mb")?.unwrap_or(1024);
        if index_mb == 0 {
            return Err(error::config("[sink.options] key_index_max_mb must be at least 1"));
        }
        let format_version = match opts.required("format_version")?.trim() {
            "2" => 2,
            "3" => 3,
            other => {
                return Err(error::config(format!(
                    "[sink.options] format_version = {other:?} is not a format version Sluice creates tables in; use 2 \
                     (the default) or 3"
                )));
            }
        };
        let keep_snapshots: u32 = opts.parsed("keep_snapshots")?.unwrap_or(200);
        Ok(Self {
            keep_snapshots,
            key,
            key_index_max_bytes: index_mb.saturating_mul(1024 * 1024),
            format_version,
            table,
            mode,
            dead_letter_table,
            overwrite_filter,
            allow_empty_overwrite,
            create_table,
            partition_by,
            target_file_bytes: target_mb * 1024 * 1024,
            buffer_bytes: buffer_mb * 1024 * 1024,
            compression,
            claim: claim::Mode::from_options(&opts)?,
        })
    }

    /// Whether the rows of source table `table` replace the partitions they
    /// touch: in overwrite mode, except the job's dead-letter table.
    pub fn upserts(&self, table: &str) -> bool {
        self.mode == Mode::Upsert && self.dead_letter_table.as_deref() != Some(table)
    }

    /// Whether the rows of source table `table` replace the partitions they
    /// touch: in overwrite mode, except the job's dead-letter table.
    pub fn overwrites(&self, table: &str) -> bool {
        self.mode == Mode::OverwritePartitions && self.dead_letter_table.as_deref() != Some(table)
    }

    /// The filter scoping the overwrite of source table `table`, if any
    /// (never for the job's dead-letter table).
    pub fn filter_for(&self, table: &str) -> Option<&OverwriteFilter> {
        self.overwrite_filter.as_ref().filter(|_| self.overwrites(table))
    }

    /// The Iceberg table a source table lands in.
    pub fn ident(&self, table: &str) -> Result<TableIdent, SinkError> {
        match (self.table.contains("{table}"), table.is_empty()) {
            // A name the pattern could have made is the table itself (the
            // job's dead letters, `[job.dead_letter] table = "lake.dead_letters"`
            // beside `lake.{table}`); the host names it so too.
            (true, false) if in_pattern_form(&self.table, table) => parse_table(table),
            (true, false) => parse_table(&self.table.replace("{table}", table)),
            (false, true) => parse_table(&self.table),
            // A named table beside a single one, named in full (the job's
            // dead letters, `[job.dead_letter] table = "ns.bad_orders"`).
            (false, false) if table.contains('.') => parse_table(table),
            (true, true) => Err(error::config(format!(
                "option `table` = {:?} is a pattern for several tables, but the source has one unnamed table; \
                 name the table, e.g. `ns.events`",
                self.table
            ))),
            (false, false) => Err(error::config(format!(
                "option `table` = {:?} names one table, but the source delivers table {table:?}: \
                 write a pattern with `{{table}}`, e.g. `lake.{{table}}`",
                self.table
            ))),
        }
    }
}

/// Whether `table` is what `pattern` (with one `{table}`) makes of some
/// name: its text before `{table}`, a name, then its text after.
fn in_pattern_form(pattern: &str, table: &str) -> bool {
    let Some((before, after)) = pattern.split_once("{table}") else { return false };
    !after.contains("{table}")
        && table.len() > before.len() + after.len()
        && table.starts_with(before)
        && table.ends_with(after)
}

/// The change key: `sluice.key` (the source's `[source] key`), checked
/// against the mode and against the sink's own `key` when given.
fn parse_change_key(opts: &Options, mode: Mode) -> Result<Option<Vec<String>>, SinkError> {
    use sluice_guest_sdk::changes::{KEY_OPTION, parse_key};
    let source = opts.get(KEY_OPTION).map(parse_key).transpose()?;
    let own: Option<Vec<String>> = match opts.get("key").map(str::trim) {
        None => None,
        Some(text) if text.starts_with('[') => Some(serde_json::from_str(text).map_err(|e| {
            error::config(format!("[sink.options] key = {text:?} is not a column name, a comma list or a list: {e}"))
        })?),
        Some(text) => Some(text.split(',').map(|c| c.trim().to_string()).collect()),
    };
    if let Some(own) = &own
        && (own.is_empty() || own.iter().any(String::is_empty))
    {
        return Err(error::config("[sink.options] key names no column; write e.g. key = \"id\""));
    }
    match (mode, source) {
        (Mode::Upsert, None) => Err(error::config(
            "[sink.options] mode = \"upsert\" needs a change stream: set [source] key (the key columns) and, when \
             the rows carry their operation, [source] change_column",
        )),
        (Mode::Upsert, Some(source)) => match own {
            Some(own) if own != source => Err(error::config(format!(
                "[sink.options] key = {own:?} differs from [source] key = {source:?}; the change key is the \
                 source's, so drop [sink.options] key or make both name the same columns"
            ))),
            _ => Ok(Some(source)),
        },
        (_, Some(source)) => Err(error::config(format!(
            "the source is a change stream ([source] key = {source:?}), and the Iceberg sink applies one only with \
             [sink.options] mode = \"upsert\""
        ))),
        (_, None) if own.is_some() => Err(error::config(
            "[sink.options] key is set but mode is not \"upsert\"; a key is for change streams, so set \
             [sink.options] mode = \"upsert\" (with [source] key) or drop key",
        )),
        (_, None) => Ok(None),
    }
}

fn parse_table(raw: &str) -> Result<TableIdent, SinkError> {
    let parts: Vec<&str> = raw.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.trim().is_empty()) {
        return Err(error::config(format!(
            "option `table` = {raw:?} must be `namespace.name` (e.g. `analytics.events`)"
        )));
    }
    let (name, namespace) = parts.split_last().ok_or_else(|| error::config("option `table` is empty"))?;
    let namespace = NamespaceIdent::from_strs(namespace.iter().map(|p| p.trim()))
        .map_err(|e| error::config(format!("option `table` = {raw:?}: {e}")))?;
    Ok(TableIdent::new(namespace, name.trim().to_string()))
}

/// Parses `day(ts), identity(region), bucket[16](id)`.
pub fn parse_partition_by(raw: &str) -> Result<Vec<PartitionField>, SinkError> {
    let bad = |item: &str, why: &str| {
        error::config(format!(
            "option `partition_by`: {item:?} {why}; write e.g. `day(ts), identity(region), bucket[16](id)`"
        ))
    };
    let mut fields = Vec::new();
    for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let open = item.find('(').ok_or_else(|| bad(item, "has no `(column)`"))?;
        let column = item[open + 1..].strip_suffix(')').ok_or_else(|| bad(item, "does not end with `)`"))?.trim();
        if column.is_empty() {
            return Err(bad(item, "names no column"));
        }
        // Iceberg's own names: identity, year, month, day, hour, bucket[N], truncate[W].
        let transform = match Transform::from_str(item[..open].trim()) {
            Ok(Transform::Unknown) | Err(_) => return Err(bad(item, "uses an unknown transform")),
            Ok(t) => t,
        };
        if matches!(transform, Transform::Bucket(0) | Transform::Truncate(0)) {
            return Err(bad(item, "needs a positive number in `[...]`"));
        }
        fields.push(PartitionField { column: column.to_string(), transform });
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_partition_fields() {
        let fields = parse_partition_by("day(ts), identity(region), bucket[16](id)").unwrap();
        assert_eq!(
            fields,
            vec![
                PartitionField { column: "ts".into(), transform: Transform::Day },
                PartitionField { column: "region".into(), transform: Transform::Identity },
                PartitionField { column: "id".into(), transform: Transform::Bucket(16) },
            ]
        );
        assert!(parse_partition_by("week(ts)").is_err());
        assert!(parse_partition_by("day ts").is_err());
        assert!(parse_partition_by("bucket[0](id)").is_err());
    }

    #[test]
    fn parses_the_format_version() {
        let cfg = |extra: &[(&str, &str)]| {
            let mut raw = vec![("table".to_string(), "lake.t".to_string())];
            raw.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            Config::parse(raw)
        };
        assert_eq!(cfg(&[]).unwrap().format_version, 2);
        assert_eq!(cfg(&[("format_version", "3")]).unwrap().format_version, 3);
        for bad in ["1", "4", "v3"] {
            let Err(SinkError::Config(m)) = cfg(&[("format_version", bad)]) else { panic!("{bad} is refused") };
            assert!(m.contains("[sink.options] format_version") && m.contains(bad), "{m}");
        }
    }

    #[test]
    fn parses_the_mode() {
        let cfg = |extra: &[(&str, &str)]| {
            let mut raw = vec![("table".to_string(), "lake.t".to_string())];
            raw.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            Config::parse(raw)
        };
        assert_eq!(cfg(&[]).unwrap().mode, Mode::Append);
        let over = cfg(&[("mode", "overwrite-partitions"), (DEAD_LETTER_TABLE, "lake.dead")]).unwrap();
        assert!(over.overwrites("") && !over.overwrites("lake.dead"));
        let Err(SinkError::Config(m)) = cfg(&[("mode", "replace")]) else { panic!("replace is no mode") };
        assert!(m.contains("[sink.options] mode") && m.contains("overwrite-partitions"), "{m}");
    }

    /// Upsert needs the source's key; the sink's own `key` must name the
    /// same columns; a change stream needs upsert.
    #[test]
    fn parses_the_upsert_key() {
        let cfg = |extra: &[(&str, &str)]| {
            let mut raw = vec![("table".to_string(), "lake.t".to_string())];
            raw.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            Config::parse(raw)
        };
        let key = (sluice_guest_sdk::changes::KEY_OPTION, r#"["tenant","id"]"#);
        let ok = cfg(&[("mode", "upsert"), key]).unwrap();
        assert_eq!(ok.key, Some(vec!["tenant".to_string(), "id".to_string()]));
        assert!(
            ok.upserts("")
                && !cfg(&[("mode", "upsert"), key, (DEAD_LETTER_TABLE, "lake.d")]).unwrap().upserts("lake.d")
        );
        assert!(cfg(&[("mode", "upsert"), key, ("key", "tenant, id")]).is_ok());
        assert!(cfg(&[("mode", "upsert"), key, ("key", r#"["tenant","id"]"#)]).is_ok());
        let Err(SinkError::Config(m)) = cfg(&[("mode", "upsert")]) else { panic!("upsert without a key") };
        assert!(m.contains("[source] key") && m.contains("upsert"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[("mode", "upsert"), key, ("key", "id")]) else {
            panic!("a sink key that differs")
        };
        assert!(m.contains("[sink.options] key") && m.contains("[source] key"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[key]) else { panic!("a change stream in append mode") };
        assert!(m.contains("change stream") && m.contains("upsert"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[("key", "id")]) else { panic!("a key in append mode") };
        assert!(m.contains("[sink.options] key") && m.contains("upsert"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[("mode", "upsert"), key, ("key_index_max_mb", "0")]) else {
            panic!("a zero bound")
        };
        assert!(m.contains("key_index_max_mb"), "{m}");
    }

    #[test]
    fn parses_the_overwrite_filter() {
        let cfg = |extra: &[(&str, &str)]| {
            let mut raw = vec![("table".to_string(), "lake.t".to_string())];
            raw.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            Config::parse(raw)
        };
        let filter = [("mode", "overwrite-partitions"), ("overwrite_filter", "day >= '2024-01-01'")];
        let ok = cfg(&filter).unwrap();
        assert_eq!(ok.filter_for("").map(OverwriteFilter::source), Some("day >= '2024-01-01'"));
        assert!(!ok.allow_empty_overwrite);
        assert!(cfg(&[filter[0], filter[1], ("allow_empty_overwrite", "true")]).unwrap().allow_empty_overwrite);
        let Err(SinkError::Config(m)) = cfg(&[filter[1]]) else { panic!("a filter in append mode") };
        assert!(m.contains("overwrite_filter") && m.contains("mode"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[filter[0], ("overwrite_filter", "day >>= 1")]) else {
            panic!("a filter that does not parse")
        };
        assert!(m.contains("overwrite_filter") && m.contains("character"), "{m}");
        let Err(SinkError::Config(m)) = cfg(&[filter[0], ("allow_empty_overwrite", "true")]) else {
            panic!("allow_empty_overwrite without a filter")
        };
        assert!(m.contains("allow_empty_overwrite") && m.contains("overwrite_filter"), "{m}");
    }

    #[test]
    fn parses_table_names() {
        let t = parse_table("a.b.events").unwrap();
        assert_eq!(t.name(), "events");
        assert_eq!(t.namespace().clone().inner(), vec!["a".to_string(), "b".to_string()]);
        assert!(parse_table("events").is_err());
        assert!(parse_table("a..b").is_err());
    }

    /// A plain `table` takes the source's unnamed table and a named one
    /// given in full (the dead letters), and refuses any other named table.
    #[test]
    fn a_plain_table_takes_a_dotted_table_beside_it() {
        let cfg = |table: &str| Config::parse(vec![("table".to_string(), table.to_string())]).unwrap();
        let plain = cfg("lake.orders");
        assert_eq!(plain.ident("").unwrap().name(), "orders");
        let beside = plain.ident("lake.orders_dead").unwrap();
        assert_eq!((beside.namespace().clone().inner(), beside.name()), (vec!["lake".to_string()], "orders_dead"));
        assert!(plain.ident("customers").is_err());
        let pattern = cfg("lake.{table}");
        assert_eq!(pattern.ident("customers").unwrap().name(), "customers");
        assert!(pattern.ident("").is_err());
    }

    /// Beside a pattern, a name in the pattern's form is taken in full (the
    /// dead letters, `lake.dead_letters`), and any other name goes through
    /// the pattern, dotted or not.
    #[test]
    fn a_pattern_takes_a_name_in_its_form_as_it_is() {
        let pattern = Config::parse(vec![("table".to_string(), "lake.{table}".to_string())]).unwrap();
        let full = |t: &str| {
            let ident = pattern.ident(t).unwrap();
            format!("{}.{}", ident.namespace().clone().inner().join("."), ident.name())
        };
        assert_eq!(full("lake.dead_letters"), "lake.dead_letters");
        assert_eq!(full("dead_letters"), "lake.dead_letters");
        assert_eq!(full("orders.v1"), "lake.orders.v1");
        assert_eq!(full("lake"), "lake.lake");
        assert!(in_pattern_form("a.{table}_raw", "a.b_raw"));
        assert!(!in_pattern_form("a.{table}_raw", "a._raw"));
        assert!(!in_pattern_form("a.b", "a.b"));
    }

    /// A filter with a table pattern is refused: a table of the pattern
    /// without input rows would keep its old rows inside the filter.
    #[test]
    fn a_filter_with_a_table_pattern_is_refused() {
        let raw =
            [("table", "lake.{table}"), ("mode", "overwrite-partitions"), ("overwrite_filter", "day = '2024-01-01'")];
        let Err(SinkError::Config(m)) =
            Config::parse(raw.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
        else {
            panic!("a filter with a pattern")
        };
        assert!(m.contains("overwrite_filter") && m.contains("lake.{table}") && m.contains("its own job"), "{m}");
        let dynamic = [raw[0], raw[1]];
        assert!(Config::parse(dynamic.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()).is_ok());
    }
}
