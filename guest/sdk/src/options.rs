//! Typed access to the job's `[sink.options]`, with errors that name the option.

use crate::{OptionSpec, SinkError};

/// The options handed to `validate` and `open`, checked against a plugin's specs.
#[derive(Debug, Clone)]
pub struct Options {
    values: Vec<(String, String)>,
}

impl Options {
    /// Checks `values` against `specs`: unknown keys and missing required keys
    /// are `config` errors naming the key.
    pub fn parse(values: Vec<(String, String)>, specs: &[OptionSpec]) -> Result<Self, SinkError> {
        for (key, _) in &values {
            if !specs.iter().any(|s| &s.name == key) {
                let known: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
                return Err(SinkError::Config(format!(
                    "unknown option `{key}`; this plugin takes: {}",
                    known.join(", ")
                )));
            }
        }
        let mut resolved = values;
        for spec in specs {
            if resolved.iter().any(|(k, _)| k == &spec.name) {
                continue;
            }
            match &spec.default_value {
                Some(default) => resolved.push((spec.name.clone(), default.clone())),
                None if spec.required => {
                    return Err(SinkError::Config(format!(
                        "missing required option `{}`: {}",
                        spec.name, spec.description
                    )));
                }
                None => {}
            }
        }
        Ok(Self { values: resolved })
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// The value of a required option (validated by [`Options::parse`]).
    pub fn required(&self, key: &str) -> Result<&str, SinkError> {
        self.get(key).ok_or_else(|| SinkError::Config(format!("missing required option `{key}`")))
    }

    /// Parses an option with `FromStr`, naming the option and value on failure.
    pub fn parsed<T>(&self, key: &str) -> Result<Option<T>, SinkError>
    where
        T: std::str::FromStr,
        T::Err: std::fmt::Display,
    {
        match self.get(key) {
            None => Ok(None),
            Some(raw) => raw
                .trim()
                .parse::<T>()
                .map(Some)
                .map_err(|e| SinkError::Config(format!("option `{key}` = {raw:?} is not valid: {e}"))),
        }
    }

    /// A boolean option (`true`/`false`).
    pub fn flag(&self, key: &str) -> Result<bool, SinkError> {
        Ok(self.parsed::<bool>(key)?.unwrap_or(false))
    }
}
