//! Locations: every place a job file names (a warehouse, a state directory,
//! a grant, a source directory) is parsed here, once, into a [`Location`].
//!
//! Invariants:
//! - a string with a URL scheme (`xyz://...`, `file://` included) is always
//!   parsed as a URL and never taken for a relative path, so `s3://lake/wh`
//!   can never become a local folder named `s3:`;
//! - a string that starts with a URL scheme and `:` but not `://`
//!   (`s3:/lake/state`, `s3:lake`, `foo:bar`) is refused, never taken for a
//!   relative path: one missing slash must not bring back a local folder
//!   named `s3:`. A local name with such a colon is written `./s3:x`. A
//!   one-letter head (`C:\data`) is a drive letter, not a scheme, and stays a
//!   path;
//! - any other string without `://` is a local path, resolved against the
//!   job file's directory and normalized lexically (`.` and `..` folded, no
//!   filesystem access);
//! - an object-store location has a valid bucket and a prefix of plain
//!   segments (no empty, `.` or `..` segment, no `?`, `#` or `\`), without a
//!   leading or trailing `/`, so two spellings of one place compare equal and
//!   grants can be compared segment by segment;
//! - a job key accepts the schemes listed in its [`Served`] and refuses the
//!   others with an error naming the key, the value and what is served there,
//!   before anything is written.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// `p` with `.` and `..` folded lexically (no filesystem access); `..`
/// above the root stays at the root.
pub fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for comp in p.components() {
        match comp {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// The object stores Sluice knows by URL scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scheme {
    /// Amazon S3 and S3-compatible stores: `s3://bucket/prefix`.
    S3,
    /// Google Cloud Storage: `gs://bucket/prefix`.
    Gs,
}

impl Scheme {
    pub const ALL: [Scheme; 2] = [Scheme::S3, Scheme::Gs];

    pub fn as_str(self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Gs => "gs",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://", self.as_str())
    }
}

/// A parsed location.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Location {
    /// An absolute, normalized local path (from a path or a `file://` URL).
    Local(PathBuf),
    /// An object-store location: `prefix` is empty for the bucket's root.
    ObjectStore { scheme: Scheme, bucket: String, prefix: String },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(path) => write!(f, "{}", path.display()),
            Location::ObjectStore { scheme, bucket, prefix } if prefix.is_empty() => write!(f, "{scheme}{bucket}"),
            Location::ObjectStore { scheme, bucket, prefix } => write!(f, "{scheme}{bucket}/{prefix}"),
        }
    }
}

/// A location that could not be parsed, or is not served where it was given.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LocationError {
    #[error("{value:?}: {message}")]
    Malformed { value: String, message: String },
    #[error("{value:?}: {scheme}:// is not a scheme Sluice knows (known: {known}); served here: {served}")]
    UnknownScheme { value: String, scheme: String, known: String, served: Served },
    #[error("{value:?}: {scheme} locations are not served here yet; served here: {served}")]
    NotServed { value: String, scheme: Scheme, served: Served },
    #[error(
        "{value:?}: starts with the URL scheme `{scheme}:` but lacks `//`, so it is neither a URL nor taken for a \
         local path; write {suggested:?} for an object store (served here: {served}), or \"./{value}\" for a local \
         path whose name holds `:`"
    )]
    SchemeWithoutSlashes { value: String, scheme: String, suggested: String, served: Served },
}

/// Which kinds of location a job key accepts: local paths (and `file://`
/// URLs) always, object stores as their backends land.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub stores: &'static [Scheme],
}

impl Served {
    /// Local paths and `file://` URLs only.
    pub const LOCAL: Served = Served { stores: &[] };

    pub fn serves(&self, scheme: Scheme) -> bool {
        self.stores.contains(&scheme)
    }
}

impl fmt::Display for Served {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("local paths and file:// URLs")?;
        for s in self.stores {
            write!(f, ", {s}")?;
        }
        Ok(())
    }
}

/// The URL scheme of `raw`, if it has one: ASCII letters first, then
/// letters, digits, `+`, `-` or `.`, then `://`.
fn url_scheme(raw: &str) -> Option<&str> {
    let (scheme, _) = raw.split_once("://")?;
    is_scheme_name(scheme).then_some(scheme)
}

/// Whether `name` is spelled as a URL scheme: an ASCII letter, then letters,
/// digits, `+`, `-` or `.`.
fn is_scheme_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The scheme of `raw` when it reads as a URL missing its `//`
/// (`s3:/lake`, `s3:lake`, `foo:bar`): a scheme of two characters or more
/// (one letter is a Windows drive), then `:`.
fn scheme_without_slashes(raw: &str) -> Option<(&str, &str)> {
    let (scheme, rest) = raw.split_once(':')?;
    (scheme.len() >= 2 && is_scheme_name(scheme)).then_some((scheme, rest))
}

impl Location {
    /// Parses `raw` (as given for a job key), resolving a relative local path
    /// against `base_dir`, and refuses what `served` does not list.
    pub fn parse(raw: &str, base_dir: &Path, served: Served) -> Result<Location, LocationError> {
        let malformed = |message: &str| LocationError::Malformed { value: raw.to_string(), message: message.into() };
        if raw.trim().is_empty() {
            return Err(malformed("empty location"));
        }
        let Some(scheme) = url_scheme(raw) else {
            if raw.contains("://") {
                return Err(malformed("`://` follows something that is not a URL scheme"));
            }
            if let Some((scheme, rest)) = scheme_without_slashes(raw) {
                let lower = scheme.to_ascii_lowercase();
                let rest = rest.trim_start_matches('/');
                let suggested = if lower == "file" { format!("file:///{rest}") } else { format!("{lower}://{rest}") };
                return Err(LocationError::SchemeWithoutSlashes {
                    value: raw.to_string(),
                    scheme: scheme.to_string(),
                    suggested,
                    served,
                });
            }
            return Ok(Location::Local(normalize(&base_dir.join(raw))));
        };
        let rest = &raw[scheme.len() + 3..];
        let lower = scheme.to_ascii_lowercase();
        if lower == "file" {
            return parse_file_url(rest).map(Location::Local).map_err(|m| malformed(&m));
        }
        let Some(store) = Scheme::from_name(&lower) else {
            let known: Vec<String> = Scheme::ALL.iter().map(|s| s.to_string()).collect();
            return Err(LocationError::UnknownScheme {
                value: raw.to_string(),
                scheme: scheme.to_string(),
                known: format!("file://, {}", known.join(", ")),
                served,
            });
        };
        let location = parse_object_url(store, rest).map_err(|m| malformed(&m))?;
        if !served.serves(store) {
            return Err(LocationError::NotServed { value: raw.to_string(), scheme: store, served });
        }
        Ok(location)
    }

    /// The local path, for keys that serve local paths only.
    pub fn into_local(self) -> Option<PathBuf> {
        match self {
            Location::Local(path) => Some(path),
            Location::ObjectStore { .. } => None,
        }
    }

    /// Whether `self` is `other` or lies under it, comparing whole segments
    /// (`s3://lake/wh` covers `s3://lake/wh/t` but not `s3://lake/wh-other`).
    pub fn is_within(&self, other: &Location) -> bool {
        match (self, other) {
            (Location::Local(a), Location::Local(b)) => a.starts_with(b),
            (
                Location::ObjectStore { scheme: sa, bucket: ba, prefix: pa },
                Location::ObjectStore { scheme: sb, bucket: bb, prefix: pb },
            ) => {
                sa == sb
                    && ba == bb
                    && (pb.is_empty() || pa == pb || pa.strip_prefix(pb.as_str()).is_some_and(|r| r.starts_with('/')))
            }
            _ => false,
        }
    }
}

/// `file:///abs/path` (or `file://localhost/abs/path`): the path, normalized.
fn parse_file_url(rest: &str) -> Result<PathBuf, String> {
    let path = rest.strip_prefix("localhost").unwrap_or(rest);
    if !path.starts_with('/') {
        return Err("a file:// URL must name an absolute path (file:///abs/path)".into());
    }
    if path.contains(['?', '#']) {
        return Err("a file:// URL takes no query or fragment".into());
    }
    Ok(normalize(Path::new(path)))
}

/// `bucket[/prefix]` of an object-store URL.
fn parse_object_url(scheme: Scheme, rest: &str) -> Result<Location, String> {
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    check_bucket(bucket).map_err(|m| format!("bucket {bucket:?}: {m}"))?;
    if prefix.contains(['?', '#', '\\']) {
        return Err(format!("the object key prefix {prefix:?} holds `?`, `#` or `\\`"));
    }
    let prefix = prefix.strip_suffix('/').unwrap_or(prefix);
    if !prefix.is_empty() && prefix.split('/').any(|seg| seg.is_empty() || seg == "." || seg == "..") {
        return Err(format!("the object key prefix {prefix:?} has an empty, `.` or `..` segment"));
    }
    // The object-store layer would trim such whitespace and reach another prefix.
    if prefix.split('/').any(|seg| seg.starts_with(char::is_whitespace) || seg.ends_with(char::is_whitespace))
        || prefix.chars().any(char::is_control)
    {
        return Err(format!(
            "the object key prefix {prefix:?} has a segment that starts or ends with whitespace, or a control character"
        ));
    }
    Ok(Location::ObjectStore { scheme, bucket: bucket.to_string(), prefix: prefix.to_string() })
}

/// A bucket name both S3 and GCS accept: 3 to 63 lowercase letters, digits,
/// `-`, `_` (GCS) or `.`, starting and ending with a letter or digit.
fn check_bucket(bucket: &str) -> Result<(), &'static str> {
    if bucket.is_empty() {
        return Err("a bucket name is required (scheme://bucket/prefix)");
    }
    if !(3..=63).contains(&bucket.len()) {
        return Err("must be 3 to 63 characters long");
    }
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !bucket.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'))
        || !edge_ok(bucket.chars().next())
        || !edge_ok(bucket.chars().last())
    {
        return Err(
            "may hold only lowercase letters, digits, `-`, `_` and `.`, and must start and end with a letter or digit",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "/jobs/a";
    const S3: Served = Served { stores: &[Scheme::S3, Scheme::Gs] };

    fn parse(raw: &str, served: Served) -> Result<Location, LocationError> {
        Location::parse(raw, Path::new(BASE), served)
    }

    fn store(scheme: Scheme, bucket: &str, prefix: &str) -> Location {
        Location::ObjectStore { scheme, bucket: bucket.into(), prefix: prefix.into() }
    }

    #[test]
    fn paths_are_local_and_resolved() {
        assert_eq!(parse("out/x", Served::LOCAL), Ok(Location::Local("/jobs/a/out/x".into())));
        assert_eq!(parse("../b/./c", Served::LOCAL), Ok(Location::Local("/jobs/b/c".into())));
        assert_eq!(parse("/abs", Served::LOCAL), Ok(Location::Local("/abs".into())));
        assert_eq!(parse("file:///abs/../x", Served::LOCAL), Ok(Location::Local("/x".into())));
        assert_eq!(parse("FILE://localhost/x", Served::LOCAL), Ok(Location::Local("/x".into())));
        // Odd names without a scheme stay paths: a drive letter, a colon
        // after a `/`, and a colon name written from `./`.
        assert_eq!(parse(r"C:\data", Served::LOCAL), Ok(Location::Local(r"/jobs/a/C:\data".into())));
        assert_eq!(parse("out/s3:x", Served::LOCAL), Ok(Location::Local("/jobs/a/out/s3:x".into())));
        assert_eq!(parse("./s3:x", Served::LOCAL), Ok(Location::Local("/jobs/a/s3:x".into())));
        assert_eq!(parse("./s3:/lake/state", S3), Ok(Location::Local("/jobs/a/s3:/lake/state".into())));
        assert!(parse("file://relative", Served::LOCAL).is_err());
        assert!(parse("  ", Served::LOCAL).is_err());
        assert!(parse("1x://y", Served::LOCAL).is_err());
    }

    #[test]
    fn store_urls_are_normalized() {
        assert_eq!(parse("s3://lake/wh/", S3), Ok(store(Scheme::S3, "lake", "wh")));
        assert_eq!(parse("S3://lake", S3), Ok(store(Scheme::S3, "lake", "")));
        assert_eq!(parse("gs://my_bkt/a/b", S3), Ok(store(Scheme::Gs, "my_bkt", "a/b")));
        assert_eq!(store(Scheme::S3, "lake", "wh").to_string(), "s3://lake/wh");
        for bad in ["s3://", "s3:///x", "s3://Lake/x", "s3://ab", "s3://lake/a//b", "s3://lake/a/../b", "s3://lake/a?x"]
        {
            assert!(matches!(parse(bad, S3), Err(LocationError::Malformed { .. })), "{bad}");
        }
        // Whitespace the store layer would trim (an NBSP pasted from a
        // document too), and control characters.
        for bad in ["gs://lake/ state", "gs://lake/state /x", "s3://lake/wh\u{a0}", "s3://lake/a\tb", "gs://lake/a\nb"]
        {
            assert!(matches!(parse(bad, S3), Err(LocationError::Malformed { .. })), "{bad:?}");
        }
        assert_eq!(parse("s3://lake/a b/c", S3), Ok(store(Scheme::S3, "lake", "a b/c")), "inner spaces are names");
    }

    #[test]
    fn unserved_and_unknown_schemes_are_refused() {
        let err = parse("s3://lake/state", Served::LOCAL).unwrap_err().to_string();
        assert_eq!(
            err,
            "\"s3://lake/state\": s3:// locations are not served here yet; served here: local paths and file:// URLs"
        );
        let err = parse("s4://x", S3).unwrap_err().to_string();
        assert!(err.contains("s4:// is not a scheme Sluice knows (known: file://, s3://, gs://)"), "{err}");
        assert!(err.contains("served here: local paths and file:// URLs, s3://, gs://"), "{err}");
        assert!(matches!(parse("memory://wh", S3), Err(LocationError::UnknownScheme { .. })));
    }

    #[test]
    fn a_scheme_without_slashes_is_refused_not_taken_for_a_path() {
        for (raw, scheme, suggested) in [
            ("s3:/lake/state", "s3", "s3://lake/state"),
            ("s3:lake", "s3", "s3://lake"),
            ("S3:lake/wh", "S3", "s3://lake/wh"),
            ("gs:/lake", "gs", "gs://lake"),
            ("s4:/lake", "s4", "s4://lake"),
            ("foo:bar", "foo", "foo://bar"),
            ("file:/abs", "file", "file:///abs"),
            ("s3:", "s3", "s3://"),
        ] {
            for served in [Served::LOCAL, S3] {
                let err = parse(raw, served).unwrap_err();
                assert_eq!(
                    err,
                    LocationError::SchemeWithoutSlashes {
                        value: raw.into(),
                        scheme: scheme.into(),
                        suggested: suggested.into(),
                        served
                    },
                    "{raw}"
                );
            }
        }
        let err = parse("s3:/lake/state", S3).unwrap_err().to_string();
        assert_eq!(
            err,
            "\"s3:/lake/state\": starts with the URL scheme `s3:` but lacks `//`, so it is neither a URL nor taken for \
             a local path; write \"s3://lake/state\" for an object store (served here: local paths and file:// URLs, \
             s3://, gs://), or \"./s3:/lake/state\" for a local path whose name holds `:`"
        );
    }

    #[test]
    fn within_compares_whole_segments() {
        let wh = store(Scheme::S3, "lake", "wh");
        assert!(store(Scheme::S3, "lake", "wh/t").is_within(&wh));
        assert!(wh.is_within(&wh));
        assert!(!store(Scheme::S3, "lake", "wh-other").is_within(&wh));
        assert!(!store(Scheme::Gs, "lake", "wh/t").is_within(&wh));
        assert!(!store(Scheme::S3, "lake2", "wh/t").is_within(&wh));
        assert!(store(Scheme::S3, "lake", "x").is_within(&store(Scheme::S3, "lake", "")));
        assert!(Location::Local("/a/b".into()).is_within(&Location::Local("/a".into())));
        assert!(!Location::Local("/ab".into()).is_within(&Location::Local("/a".into())));
    }
}
