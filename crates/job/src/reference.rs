//! The job-file reference (`docs/src/reference/job-file.md`), generated
//! from the config types themselves: their serde attributes and doc
//! comments, read through the JSON Schema that `schemars` derives beside
//! `Deserialize`, and from the sink plugins' own `describe` answers.
//!
//! Invariants:
//! - the page is a function of the types and the plugins' answers alone:
//!   no file path, no time, no order that depends on a build (keys are
//!   sorted by name, plugins by name, a plugin's options kept in the order
//!   it declares them);
//! - every key the job file takes is listed with its full dotted path
//!   (`sink.catalog.warehouse`), its type, its default (or "required") and
//!   its doc comment; a key or table without a doc comment is reported
//!   ([`Reference::undocumented`]), never silently printed bare;
//! - nothing here changes how a job file is read: the schema-only types
//!   below describe fields the job file keeps as `toml::Value`.

use std::collections::BTreeSet;

use serde_json::{Map, Value};
use sluice_engine::config::JobSpec;
pub use sluice_engine::config::schema::{CountOrFraction, LongDuration, PluginOptions, ShortDuration, X_TYPE};

/// The command that rewrites the page (the test that compares it says so too).
pub const REGENERATE: &str = "SLUICE_BLESS=1 cargo test -p sluice-tests --test reference";

/// Where the page lives, from the repository root.
pub const PAGE: &str = "docs/src/reference/job-file.md";

/// What a sink plugin says of its options (`describe`), as the page shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginDoc {
    /// The plugin's short name (`files`, `iceberg`).
    pub name: String,
    pub description: String,
    /// In the order the plugin declares them; the host's own (`sluice.`) left out.
    pub options: Vec<OptionDoc>,
}

/// One option a plugin declares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionDoc {
    pub name: String,
    pub description: String,
    pub required: bool,
    pub default: Option<String>,
}

/// Which job files a table applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum When {
    /// Every job file.
    Always,
    /// Jobs whose `source.kind` is this.
    SourceKind(String),
    /// Jobs whose sink plugin is this one.
    Plugin(String),
}

/// One key of a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// The full dotted path: `sink.catalog.warehouse`, `sink.grpc.<name>.address`,
    /// `source.columns[].type`.
    pub path: String,
    pub ty: String,
    /// `required`, a default as TOML (`` `8192` ``), or `—` (unset).
    pub default: String,
    pub about: String,
}

/// One table of the job file (`[job.checkpoint]`), or one kind of `[source]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    /// The heading, e.g. `` `[job.checkpoint]` ``.
    pub heading: String,
    /// Nesting depth: 0 for `[job]`, `[source]`, `[sink]`.
    pub depth: usize,
    pub when: When,
    pub about: String,
    pub keys: Vec<Key>,
}

/// The whole reference.
#[derive(Debug, Clone)]
pub struct Reference {
    pub sections: Vec<Section>,
    undocumented: Vec<String>,
}

/// The job file's JSON Schema, derived from [`JobSpec`].
pub fn schema() -> Value {
    schemars::schema_for!(JobSpec).to_value()
}

/// The reference for the job file's types and these plugins.
pub fn reference(plugins: &[PluginDoc]) -> Reference {
    let schema = schema();
    let mut walk = Walk { root: &schema, sections: Vec::new(), undocumented: Vec::new() };
    walk.top();
    let mut plugins: Vec<&PluginDoc> = plugins.iter().collect();
    plugins.sort_by(|a, b| a.name.cmp(&b.name));
    for plugin in plugins {
        walk.plugin(plugin);
    }
    Reference { sections: walk.sections, undocumented: walk.undocumented }
}

impl Reference {
    /// Keys and tables that have no doc comment, by path: each is a doc
    /// comment to write in the type.
    pub fn undocumented(&self) -> &[String] {
        &self.undocumented
    }

    /// Every key path a job with this source kind and plugin may set.
    pub fn keys(&self, source_kind: Option<&str>, plugin: Option<&str>) -> BTreeSet<String> {
        self.sections
            .iter()
            .filter(|s| match &s.when {
                When::Always => true,
                When::SourceKind(kind) => Some(kind.as_str()) == source_kind,
                When::Plugin(name) => Some(name.as_str()) == plugin,
            })
            .flat_map(|s| s.keys.iter().map(|k| k.path.clone()))
            .collect()
    }

    /// The names of the plugins whose options the reference lists.
    pub fn plugins(&self) -> BTreeSet<String> {
        self.sections
            .iter()
            .filter_map(|s| match &s.when {
                When::Plugin(name) => Some(name.clone()),
                _ => None,
            })
            .collect()
    }

    /// The page, in Markdown.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        out.push_str("# The job file\n\n");
        out.push_str(&format!(
            "<!-- Generated: do not edit. Regenerate with `{REGENERATE}`. -->\n\n\
             This page is generated from the code, so that it cannot drift: every key below, its type, \
             its default and its description come from the job file's configuration types (their serde \
             attributes and doc comments, read through the JSON Schema that `schemars` derives beside \
             `Deserialize`), and the plugins' options from the built-in sink plugins' own `describe` \
             answers. To change a description, change the doc comment in the code, then regenerate the \
             page with `{REGENERATE}`; that test fails while this page is stale. Keys are listed with \
             their full dotted path, as error messages name them; `<name>` stands for a name the job \
             file chooses, and `[]` for each entry of an array of tables.\n\n"
        ));
        out.push_str(
            "A default of \"required\" means the job file must set the key; \"—\" means the key is \
             unset unless given (its description says what that means).\n",
        );
        for section in &self.sections {
            let hashes = "#".repeat((section.depth + 2).min(6));
            out.push_str(&format!("\n{hashes} {}\n\n", section.heading));
            if !section.about.is_empty() {
                out.push_str(&section.about);
                out.push_str("\n\n");
            }
            if section.keys.is_empty() {
                continue;
            }
            out.push_str("| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n");
            for key in &section.keys {
                out.push_str(&format!(
                    "| `{}` | {} | {} | {} |\n",
                    key.path,
                    cell(&key.ty),
                    cell(&key.default),
                    cell(&key.about)
                ));
            }
        }
        out
    }
}

/// A table cell: one line, pipes escaped.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', "<br>")
}

struct Walk<'a> {
    root: &'a Value,
    sections: Vec<Section>,
    undocumented: Vec<String>,
}

/// A property's schema with its `$ref` and `Option` unwrapped.
struct Resolved<'a> {
    /// The field's own doc comment.
    field_doc: String,
    /// The type's doc comment (from its definition), when it has one.
    type_doc: String,
    /// The type's schema.
    schema: &'a Map<String, Value>,
    /// The field's default, if the schema states one.
    default: Option<&'a Value>,
    /// `Option<T>`: may be left out, with no value.
    nullable: bool,
}

impl<'a> Walk<'a> {
    fn definition(&self, reference: &str) -> Option<&'a Map<String, Value>> {
        let name = reference.strip_prefix("#/$defs/")?;
        self.root.get("$defs")?.get(name)?.as_object()
    }

    /// Follows `$ref` and `anyOf [T, null]` from a property's schema.
    fn resolve(&self, property: &'a Value) -> Resolved<'a> {
        static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
        let empty = EMPTY.get_or_init(Map::new);
        let Some(object) = property.as_object() else {
            return Resolved {
                field_doc: String::new(),
                type_doc: String::new(),
                schema: empty,
                default: None,
                nullable: false,
            };
        };
        let field_doc = text(object.get("description"));
        let default = object.get("default").filter(|d| !d.is_null());
        let mut nullable = false;
        let mut schema = object;
        if let Some(Value::Array(any)) = object.get("anyOf") {
            let non_null: Vec<&Value> =
                any.iter().filter(|s| s.get("type").and_then(Value::as_str) != Some("null")).collect();
            if non_null.len() + 1 == any.len()
                && let [only] = non_null[..]
                && let Some(inner) = only.as_object()
            {
                nullable = true;
                schema = inner;
            }
        }
        if let Some(Value::Array(types)) = schema.get("type")
            && types.iter().any(|t| t == "null")
        {
            nullable = true;
        }
        let mut type_doc = String::new();
        if let Some(target) = schema.get("$ref").and_then(Value::as_str).and_then(|r| self.definition(r)) {
            type_doc = text(target.get("description"));
            schema = target;
        }
        Resolved { field_doc, type_doc, schema, default, nullable }
    }

    /// `[job]`, `[source]` and `[sink]`.
    fn top(&mut self) {
        let Some(root) = self.root.as_object() else { return };
        let required = required(root);
        for (name, property) in sorted(root) {
            let r = self.resolve(property);
            let about = tidy(&join(&[&r.field_doc, &r.type_doc]));
            if about.is_empty() {
                self.undocumented.push(format!("[{name}]"));
            }
            let optional = !required.contains(name) || r.nullable;
            self.table(name, &format!("`[{name}]`"), 0, When::Always, &about, r.schema, optional);
        }
    }

    /// One table: its plain keys, then its tables.
    #[allow(clippy::too_many_arguments)]
    fn table(
        &mut self,
        path: &str,
        heading: &str,
        depth: usize,
        when: When,
        about: &str,
        schema: &'a Map<String, Value>,
        optional: bool,
    ) {
        if let Some(Value::Array(variants)) = schema.get("oneOf")
            && let Some(tag) = tag_of(variants)
        {
            self.tagged(path, heading, depth, about, variants, &tag);
            return;
        }
        let index = self.sections.len();
        let mut about = about.to_string();
        if optional {
            about = join(&[&about, "*The whole table may be left out.*"]);
        }
        self.sections.push(Section {
            heading: heading.to_string(),
            depth,
            when: when.clone(),
            about,
            keys: Vec::new(),
        });
        let keys = self.members(path, depth, &when, schema, &[]);
        self.sections[index].keys = keys;
    }

    /// The keys of a table's schema at `path`; its tables become sections
    /// after it. Properties named in `skip` are left out (a variant's tag).
    fn members(
        &mut self,
        path: &str,
        depth: usize,
        when: &When,
        schema: &'a Map<String, Value>,
        skip: &[&str],
    ) -> Vec<Key> {
        let required = required(schema);
        let mut keys = Vec::new();
        let mut tables = Vec::new();
        for (name, property) in sorted(schema) {
            if skip.contains(&name.as_str()) {
                continue;
            }
            let key = format!("{path}.{name}");
            let r = self.resolve(property);
            let about = join(&[&r.field_doc, &r.type_doc]);
            match shape(r.schema, self) {
                Shape::Table(inner) => tables.push((
                    key.clone(),
                    format!("`[{key}]`"),
                    about,
                    inner,
                    r.nullable || !required.contains(name),
                )),
                Shape::Map(inner, doc) => {
                    let about = join(&[&about, &doc, "*One table per name, each optional.*"]);
                    tables.push((format!("{key}.<name>"), format!("`[{key}.<name>]`"), about, inner, false))
                }
                Shape::Array(inner, doc) => {
                    let about = join(&[
                        &about,
                        &doc,
                        "*An array of tables: zero or more entries, as `[[...]]` tables or inline.*",
                    ]);
                    tables.push((format!("{key}[]"), format!("`[[{key}]]`"), about, inner, false))
                }
                Shape::Leaf => {
                    let default = match r.default {
                        Some(value) => format!("`{}`", toml_literal(value)),
                        None if required.contains(name) && !r.nullable => "required".to_string(),
                        None => "—".to_string(),
                    };
                    let mut about = if r.field_doc.is_empty() { r.type_doc.clone() } else { r.field_doc.clone() };
                    let values = self.value_docs(r.schema, &about);
                    if !values.is_empty() {
                        about = join(&[&about, &values]);
                    }
                    if about.is_empty() {
                        self.undocumented.push(key.clone());
                    }
                    keys.push(Key { path: key, ty: self.type_name(r.schema), default, about: tidy(&about) });
                }
            }
        }
        for (key, heading, about, inner, optional) in tables {
            if about.is_empty() {
                self.undocumented.push(format!("[{key}]"));
            }
            self.table(&key, &heading, depth + 1, when.clone(), &tidy(&about), inner, optional);
        }
        keys
    }

    /// `[source]`: its tag (`kind`), then one section per kind.
    fn tagged(&mut self, path: &str, heading: &str, depth: usize, about: &str, variants: &'a [Value], tag: &str) {
        let values: Vec<String> = variants.iter().filter_map(|v| tag_value(v, tag)).collect();
        let tag_key = Key {
            path: format!("{path}.{tag}"),
            ty: values.iter().map(|v| format!("`\"{v}\"`")).collect::<Vec<_>>().join(" or "),
            default: "required".to_string(),
            about: format!("Which kind of {path}: each kind takes the keys of its own table below."),
        };
        self.sections.push(Section {
            heading: heading.to_string(),
            depth,
            when: When::Always,
            about: tidy(about),
            keys: vec![tag_key],
        });
        for variant in variants {
            let (Some(value), Some(schema)) = (tag_value(variant, tag), variant.as_object()) else { continue };
            let about = text(schema.get("description"));
            if about.is_empty() {
                self.undocumented.push(format!("[{path}] {tag} = {value:?}"));
            }
            let when = When::SourceKind(value.clone());
            let index = self.sections.len();
            self.sections.push(Section {
                heading: format!("`[{path}]` with `{tag} = \"{value}\"`"),
                depth: depth + 1,
                when: when.clone(),
                about: tidy(&about),
                keys: Vec::new(),
            });
            let keys = self.members(path, depth + 1, &when, schema, &[tag]);
            self.sections[index].keys = keys;
        }
    }

    /// `[sink.options]` of one plugin, from its `describe`.
    fn plugin(&mut self, plugin: &PluginDoc) {
        let keys = plugin
            .options
            .iter()
            .map(|o| {
                let key = format!("sink.options.{}", o.name);
                if o.description.trim().is_empty() {
                    self.undocumented.push(format!("{key} (plugin {})", plugin.name));
                }
                let default = match (&o.default, o.required) {
                    (Some(d), _) => format!("`{}`", toml_literal(&Value::String(d.clone()))),
                    (None, true) => "required".to_string(),
                    (None, false) => "—".to_string(),
                };
                Key { path: key, ty: "string".to_string(), default, about: tidy(&o.description) }
            })
            .collect();
        let about = format!(
            "{}\n\nThe options the `{}` plugin declares (its `describe` answer, as `sluice plugin inspect` \
             prints it). Values are handed to the plugin as strings; the host refuses an option the plugin \
             does not declare, and a required one left out.",
            tidy(&plugin.description),
            plugin.name
        );
        self.sections.push(Section {
            heading: format!("`[sink.options]` of the `{}` plugin", plugin.name),
            depth: 1,
            when: When::Plugin(plugin.name.clone()),
            about,
            keys,
        });
    }

    /// A type in words: `integer`, `"fail" or "dead-letter"`, `array of strings`.
    fn type_name(&self, schema: &Map<String, Value>) -> String {
        if let Some(words) = schema.get(X_TYPE).and_then(Value::as_str) {
            return words.to_string();
        }
        if let Some(target) = schema.get("$ref").and_then(Value::as_str).and_then(|r| self.definition(r)) {
            return self.type_name(target);
        }
        if let Some(value) = schema.get("const") {
            return format!("`{}`", toml_literal(value));
        }
        if let Some(Value::Array(values)) = schema.get("enum") {
            return values.iter().map(|v| format!("`{}`", toml_literal(v))).collect::<Vec<_>>().join(" or ");
        }
        for combined in ["oneOf", "anyOf"] {
            if let Some(Value::Array(options)) = schema.get(combined) {
                return options
                    .iter()
                    .filter_map(Value::as_object)
                    .filter(|o| o.get("type").and_then(Value::as_str) != Some("null"))
                    .map(|o| self.type_name(o))
                    .collect::<Vec<_>>()
                    .join(" or ");
            }
        }
        let types: Vec<&str> = match schema.get("type") {
            Some(Value::String(t)) => vec![t.as_str()],
            Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect(),
            _ => Vec::new(),
        };
        let named: Vec<String> = types
            .iter()
            .map(|t| match *t {
                "array" => {
                    let items = schema.get("items").and_then(Value::as_object).map(|i| self.type_name(i));
                    format!("array of {}", plural(&items.unwrap_or_else(|| "values".to_string())))
                }
                "object" => {
                    let values =
                        schema.get("additionalProperties").and_then(Value::as_object).map(|i| self.type_name(i));
                    format!("table of {}", plural(&values.unwrap_or_else(|| "values".to_string())))
                }
                other => other.to_string(),
            })
            .collect();
        if named.is_empty() { "any value".to_string() } else { named.join(" or ") }
    }

    /// For an enum whose values have doc comments: each value and its
    /// doc, unless the key's own doc already names every value.
    fn value_docs(&self, schema: &Map<String, Value>, about: &str) -> String {
        let Some(Value::Array(variants)) = schema.get("oneOf") else { return String::new() };
        let named = |v: &Value| {
            v.as_str().is_some_and(|v| about.contains(&format!("`{v}`")) || about.contains(&format!("\"{v}\"")))
        };
        if variants.iter().filter_map(|v| v.get("const")).all(named) {
            return String::new();
        }
        let lines: Vec<String> = variants
            .iter()
            .filter_map(|v| {
                let value = v.get("const")?;
                let doc = text(v.get("description"));
                (!doc.is_empty()).then(|| format!("`{}`: {}", toml_literal(value), tidy(&doc)))
            })
            .collect();
        lines.join("\n\n")
    }
}

/// What a property is in the job file.
enum Shape<'a> {
    /// A table of named keys (a struct).
    Table(&'a Map<String, Value>),
    /// Tables by a name the job file chooses (`[sink.grpc.<name>]`), with the value type's doc.
    Map(&'a Map<String, Value>, String),
    /// An array of tables (`[[source.columns]]`), with the item type's doc.
    Array(&'a Map<String, Value>, String),
    /// A plain value (or a table of plain values).
    Leaf,
}

fn shape<'a>(schema: &'a Map<String, Value>, walk: &Walk<'a>) -> Shape<'a> {
    if schema.contains_key(X_TYPE) {
        return Shape::Leaf;
    }
    if schema.contains_key("properties")
        || schema.get("oneOf").and_then(Value::as_array).and_then(|v| tag_of(v)).is_some()
    {
        return Shape::Table(schema);
    }
    let structured = |inner: Option<&'a Value>| -> Option<(&'a Map<String, Value>, String)> {
        let r = walk.resolve(inner?);
        r.schema.contains_key("properties").then_some((r.schema, r.type_doc))
    };
    if let Some((inner, doc)) = structured(schema.get("additionalProperties")) {
        return Shape::Map(inner, doc);
    }
    if schema.get("type").and_then(Value::as_str) == Some("array")
        && let Some((inner, doc)) = structured(schema.get("items"))
    {
        return Shape::Array(inner, doc);
    }
    Shape::Leaf
}

/// The property every variant of a `oneOf` fixes with a `const` (`kind`).
fn tag_of(variants: &[Value]) -> Option<String> {
    let first = variants.first()?.get("properties")?.as_object()?;
    first
        .iter()
        .filter(|(_, p)| p.get("const").is_some_and(Value::is_string))
        .map(|(name, _)| name.clone())
        .find(|name| variants.iter().all(|v| tag_value(v, name).is_some()))
}

fn tag_value(variant: &Value, tag: &str) -> Option<String> {
    variant.get("properties")?.get(tag)?.get("const")?.as_str().map(str::to_string)
}

fn required(schema: &Map<String, Value>) -> BTreeSet<String> {
    match schema.get("required") {
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).map(str::to_string).collect(),
        _ => BTreeSet::new(),
    }
}

/// A schema's properties: the required ones in the order the type
/// declares them (the schema's `required` list), then the others sorted
/// by name, whatever order the map keeps.
fn sorted(schema: &Map<String, Value>) -> Vec<(&String, &Value)> {
    let required: Vec<&str> = match schema.get("required") {
        Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let properties = schema.get("properties");
    let mut all: Vec<(&String, &Value)> =
        properties.and_then(Value::as_object).map(|m| m.iter().collect()).unwrap_or_default();
    let rank = |name: &str| required.iter().position(|r| *r == name).unwrap_or(required.len());
    all.sort_by(|a, b| (rank(a.0), a.0).cmp(&(rank(b.0), b.0)));
    all
}

fn text(value: Option<&Value>) -> String {
    value.and_then(Value::as_str).unwrap_or_default().trim().to_string()
}

/// Non-empty parts, as paragraphs.
fn join(parts: &[&str]) -> String {
    parts.iter().map(|p| p.trim()).filter(|p| !p.is_empty()).collect::<Vec<_>>().join("\n\n")
}

/// A doc comment as the page shows it: each paragraph on one line
/// (paragraphs apart by a blank line), rustdoc links (`` [`X`] ``) as
/// plain code.
fn tidy(doc: &str) -> String {
    let mut paragraphs = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in doc.lines().map(str::trim) {
        if line.is_empty() {
            if !current.is_empty() {
                paragraphs.push(current.join(" "));
                current.clear();
            }
        } else {
            current.push(line);
        }
    }
    if !current.is_empty() {
        paragraphs.push(current.join(" "));
    }
    unlink(&paragraphs.join("\n\n"))
}

/// `` [`X`] `` not followed by `(` or `[` becomes `` `X` ``.
fn unlink(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("[`") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("`]") else { break };
        let inner = &after[..end];
        let tail = &after[end + 2..];
        out.push_str(&rest[..start]);
        if inner.contains('`') || tail.starts_with('(') || tail.starts_with('[') {
            out.push_str(&rest[start..start + 2 + end + 2]);
        } else {
            out.push('`');
            out.push_str(inner);
            out.push('`');
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// `string` → `strings`; a phrase is left as it is.
fn plural(name: &str) -> String {
    match name {
        "string" | "integer" | "number" | "boolean" => format!("{name}s"),
        other => other.to_string(),
    }
}

/// A JSON value as TOML writes it.
fn toml_literal(value: &Value) -> String {
    match value {
        Value::String(s) => serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\"")),
        Value::Array(items) => format!("[{}]", items.iter().map(toml_literal).collect::<Vec<_>>().join(", ")),
        Value::Object(map) if map.is_empty() => "{}".to_string(),
        Value::Object(map) => format!(
            "{{ {} }}",
            map.iter().map(|(k, v)| format!("{k} = {}", toml_literal(v))).collect::<Vec<_>>().join(", ")
        ),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_and_table_has_a_doc_comment() {
        let reference = reference(&[]);
        assert!(reference.undocumented().is_empty(), "write doc comments for: {:?}", reference.undocumented());
    }

    #[test]
    fn keys_carry_their_full_path_type_and_default() {
        let reference = reference(&[]);
        let page = reference.markdown();
        assert!(page.contains(REGENERATE), "the header names the regenerate command");
        for line in [
            "| `job.parallelism` | integer | `1` |",
            "## `[source]`",
            "### `[source]` with `kind = \"kafka\"`",
            "### `[sink.grpc.<name>]`",
            "#### `[[source.columns]]`",
        ] {
            assert!(page.contains(line), "{line:?} missing from:\n{page}");
        }
        let find = |path: &str| {
            reference
                .sections
                .iter()
                .flat_map(|s| &s.keys)
                .find(|k| k.path == path)
                .cloned()
                .unwrap_or_else(|| panic!("no key {path}"))
        };
        assert_eq!(find("job.parallelism").default, "`1`");
        assert_eq!(find("job.id").default, "required");
        assert_eq!(find("sink.catalog.warehouse").default, "required");
        assert_eq!(find("sink.catalog.name").default, "`\"sluice\"`");
        assert_eq!(find("job.bad_rows").ty, "`\"fail\"` or `\"dead-letter\"`");
        assert!(find("job.health.max_commit_age").ty.starts_with("duration"));
        assert!(find("sink.grpc.<name>.address").about.contains("https://"));
        assert!(find("source.columns[].type").about.contains("decimal(P,S)"));
        let file = reference.keys(Some("file"), None);
        assert!(file.contains("source.path") && !file.contains("source.brokers"), "{file:?}");
    }

    #[test]
    fn rustdoc_links_become_code() {
        assert_eq!(unlink("see [`kafka::KafkaSpec`] and [`x`](y)"), "see `kafka::KafkaSpec` and [`x`](y)");
    }
}
