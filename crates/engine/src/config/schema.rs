//! Schema-only types: how the job-file reference shows fields the job
//! file keeps as `toml::Value` (a duration, a count or a fraction, the
//! plugin's options). They change nothing in how a job file is read.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

/// The schema's own key for a type shown in words instead of a JSON type.
pub const X_TYPE: &str = "x-type";

/// Schema of `job.max_bad_rows` (a `toml::Value` in the job file).
pub struct CountOrFraction;

impl JsonSchema for CountOrFraction {
    fn schema_name() -> Cow<'static, str> {
        "CountOrFraction".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": ["integer", "number"],
            X_TYPE: "integer (a count of rows, 0 or more) or number between 0 and 1 (a fraction)",
        })
    }
}

/// Schema of a duration read by `job::parse_duration` (a `toml::Value`
/// in the job file): positive and at most a week.
pub struct ShortDuration;

impl JsonSchema for ShortDuration {
    fn schema_name() -> Cow<'static, str> {
        "ShortDuration".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": ["string", "number"],
            X_TYPE: "duration: a string such as \"500ms\", \"90s\", \"5m\" or \"1h\", or a number of seconds (at most a week)",
        })
    }
}

/// Schema of a duration read by `job::parse_long_duration` (a
/// `toml::Value` in the job file): positive and at most 100 years.
pub struct LongDuration;

impl JsonSchema for LongDuration {
    fn schema_name() -> Cow<'static, str> {
        "LongDuration".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": ["string", "number"],
            X_TYPE: "duration: a string such as \"90s\", \"10m\", \"1h\" or \"7days\", or a number of seconds",
        })
    }
}

/// Schema of `[sink.options]` (a `toml::Table` in the job file): plain
/// values, handed to the plugin as strings; which keys the plugin takes
/// is its own `describe` answer, rendered apart.
pub struct PluginOptions;

impl JsonSchema for PluginOptions {
    fn schema_name() -> Cow<'static, str> {
        "PluginOptions".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "type": "object",
            "additionalProperties": {"type": ["string", "number", "boolean"]},
            X_TYPE: "table of plain values (strings, numbers, booleans); the keys are the plugin's own, see below",
        })
    }
}
