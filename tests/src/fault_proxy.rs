//! A fault-injecting HTTP/1.1 reverse proxy for tests: it listens on
//! `127.0.0.1:0` and forwards every request to one upstream server (moto's
//! S3, see [`crate::store_servers`]), except where a [`Rule`] says to fail
//! it, to lose its reply, or to delay it. A job reaches S3 through it by
//! its own endpoint setting (`--set job.s3.endpoint=<proxy>`), so each test
//! has a proxy of its own while every test shares one moto.
//!
//! The requests the rules are written against are S3's REST API in path
//! style (`http://<endpoint>/<bucket>/<key>`), as the host's store client
//! (opendal) sends them:
//! - ListObjectsV2: `GET /<bucket>?list-type=2&prefix=<prefix>&…`
//!   (https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html);
//! - PutObject: `PUT /<bucket>/<key>`, an exclusive create with
//!   `If-None-Match: *`, a compare-and-swap with `If-Match: <etag>`
//!   (https://docs.aws.amazon.com/AmazonS3/latest/API/API_PutObject.html);
//! - an error is an XML `<Error>` document with its status, e.g. `500
//!   InternalError` (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html).
//!
//! Paths and queries are matched percent-decoded (`prefix=a/b/`, not
//! `prefix=a%2Fb%2F`).
//!
//! Invariants:
//! - a request no rule picks reaches the upstream unchanged (method,
//!   target, headers, body), and its reply reaches the client unchanged but
//!   for the framing (the proxy sends `Content-Length`, the upstream gets
//!   `Connection: close`);
//! - a rule fires on the `nth` request it matches (counted only once it is
//!   armed: at once, or after a request matching its `after`), then on the
//!   `times - 1` matching requests that follow, and never again;
//! - at most one rule acts on a request (the first in order that fires);
//! - every firing is recorded ([`FaultProxy::fired`]) as soon as it is
//!   decided (before a delay or the forwarding), and completed with what the
//!   upstream answered when the request was forwarded, so a test can assert
//!   that its fault really happened, or wait for a delayed request to be held;
//! - rules may be changed while the proxy runs; a request already past its
//!   decision is not affected;
//! - the proxy listens on the loopback address only and stops when dropped
//!   (its listener and every client connection are shut).

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// Which requests a rule applies to: every part given must match.
#[derive(Debug, Clone, Default)]
pub struct Match {
    method: Option<String>,
    path: Vec<String>,
    query: Vec<String>,
}

impl Match {
    /// Requests of `method` (`GET`, `PUT`, …).
    pub fn method(method: &str) -> Self {
        Self { method: Some(method.to_ascii_uppercase()), ..Self::default() }
    }

    /// Requests of any method.
    pub fn any() -> Self {
        Self::default()
    }

    /// … whose decoded path contains `part`.
    pub fn path(mut self, part: &str) -> Self {
        self.path.push(part.to_string());
        self
    }

    /// … whose decoded query contains `part`.
    pub fn query(mut self, part: &str) -> Self {
        self.query.push(part.to_string());
        self
    }

    /// A ListObjectsV2 of `bucket` whose prefix starts with `prefix` and
    /// contains each of `parts`.
    pub fn list(bucket: &str, prefix: &str, parts: &[&str]) -> Self {
        let mut m =
            Self::method("GET").path(&format!("/{bucket}")).query("list-type=2").query(&format!("prefix={prefix}"));
        for p in parts {
            m = m.query(p);
        }
        m
    }

    /// A PutObject in `bucket` whose key contains `key_part`.
    pub fn put(bucket: &str, key_part: &str) -> Self {
        Self::method("PUT").path(&format!("/{bucket}/")).path(key_part)
    }

    fn matches(&self, req: &Seen) -> bool {
        self.method.as_ref().is_none_or(|m| *m == req.method)
            && self.path.iter().all(|p| req.path.contains(p.as_str()))
            && self.query.iter().all(|q| req.query.contains(q.as_str()))
    }
}

/// What a rule does to the request it fires on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Answer this status (an S3 error document) without forwarding: the
    /// request failed before it happened.
    Status(u16),
    /// Forward it (the upstream applies it), then close the client's
    /// connection without a reply: the request happened, its reply was lost.
    DropReplyAfterForward,
    /// Forward it (the upstream applies it), then answer this status in
    /// place of the upstream's reply: the request happened, the client hears
    /// that it failed.
    StatusAfterForward(u16),
    /// Wait this long, then forward it.
    Delay(Duration),
}

/// A fault: `action` on the `nth` request matching `when` (1 is the first),
/// counted once armed, and on the `times - 1` after it.
#[derive(Debug, Clone)]
pub struct Rule {
    pub name: String,
    pub when: Match,
    /// Counting starts with the first request after one matching this
    /// (received by the proxy); none: at once.
    pub after: Option<Match>,
    pub nth: u32,
    pub times: u32,
    pub action: Action,
}

impl Rule {
    /// `action` on the first request matching `when`.
    pub fn new(name: &str, when: Match, action: Action) -> Self {
        Self { name: name.to_string(), when, after: None, nth: 1, times: 1, action }
    }

    /// On the `n`th matching request instead of the first.
    pub fn nth(mut self, n: u32) -> Self {
        self.nth = n.max(1);
        self
    }

    /// On `n` matching requests in a row.
    pub fn times(mut self, n: u32) -> Self {
        self.times = n;
        self
    }

    /// Counting only requests that come after one matching `m`.
    pub fn after(mut self, m: Match) -> Self {
        self.after = Some(m);
        self
    }
}

/// A request the proxy received, decoded; with what its client was answered.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// Percent-decoded path, e.g. `/state/job/lease`.
    pub path: String,
    /// Percent-decoded query, without the `?`.
    pub query: String,
    /// The status the client got; none when it got no reply.
    pub answered: Option<u16>,
}

/// A rule that fired.
#[derive(Debug, Clone)]
pub struct Fired {
    pub rule: String,
    pub method: String,
    pub path: String,
    pub query: String,
    pub action: Action,
    /// What the upstream answered, when the request was forwarded.
    pub upstream: Option<u16>,
}

#[derive(Debug)]
struct Armed {
    rule: Rule,
    armed: bool,
    matched: u32,
    fired: u32,
}

#[derive(Debug, Default)]
struct Shared {
    rules: Mutex<Vec<Armed>>,
    fired: Mutex<Vec<Fired>>,
    seen: Mutex<Vec<Seen>>,
    /// Open client connections by number, to shut them when the proxy stops.
    clients: Mutex<Vec<(u64, TcpStream)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Shared {
    /// The action for `req` (the first rule that fires on it), and arms
    /// the rules whose `after` it matches, for the requests after it.
    fn decide(&self, req: &Seen) -> Option<(String, Action)> {
        let mut rules = lock(&self.rules);
        let mut decided = None;
        for r in rules.iter_mut() {
            if !r.armed || r.fired >= r.rule.times || !r.rule.when.matches(req) {
                continue;
            }
            r.matched += 1;
            if r.matched >= r.rule.nth && decided.is_none() {
                r.fired += 1;
                decided = Some((r.rule.name.clone(), r.rule.action));
            }
        }
        for r in rules.iter_mut() {
            if !r.armed && r.rule.after.as_ref().is_some_and(|a| a.matches(req)) {
                r.armed = true;
            }
        }
        decided
    }
}

/// A running proxy; stopped on drop.
pub struct FaultProxy {
    /// `http://127.0.0.1:<port>`
    pub endpoint: String,
    port: u16,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

impl FaultProxy {
    /// Starts a proxy in front of `upstream` (`http://host:port`).
    pub fn start(upstream: &str) -> FaultProxy {
        let upstream = upstream.strip_prefix("http://").unwrap_or(upstream).trim_end_matches('/').to_string();
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("binding the fault proxy on 127.0.0.1");
        let port = listener.local_addr().expect("the proxy's address").port();
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::spawn(move || {
                for (n, stream) in (0u64..).zip(listener.incoming()) {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if let Ok(copy) = stream.try_clone() {
                        lock(&shared.clients).push((n, copy));
                    }
                    let (shared, upstream) = (shared.clone(), upstream.clone());
                    std::thread::spawn(move || {
                        if let Ok(copy) = stream.try_clone() {
                            serve(stream, &upstream, &shared);
                            // Ends the connection for the client too (the
                            // copy kept for `Drop` would hold it open).
                            let _ = copy.shutdown(Shutdown::Both);
                        }
                        lock(&shared.clients).retain(|(k, _)| *k != n);
                    });
                }
            })
        };
        FaultProxy { endpoint: format!("http://127.0.0.1:{port}"), port, shared, stop, accept: Some(accept) }
    }

    /// Replaces every rule (their counts start over).
    pub fn set_rules(&self, rules: Vec<Rule>) {
        let armed =
            rules.into_iter().map(|rule| Armed { armed: rule.after.is_none(), rule, matched: 0, fired: 0 }).collect();
        *lock(&self.shared.rules) = armed;
    }

    /// Adds `rule` after the others.
    pub fn add_rule(&self, rule: Rule) {
        lock(&self.shared.rules).push(Armed { armed: rule.after.is_none(), rule, matched: 0, fired: 0 });
    }

    /// Removes every rule: from now on everything goes through.
    pub fn clear_rules(&self) {
        lock(&self.shared.rules).clear();
    }

    /// Every firing so far, in order.
    pub fn fired(&self) -> Vec<Fired> {
        lock(&self.shared.fired).clone()
    }

    /// The firings of the rule named `rule`.
    pub fn fired_of(&self, rule: &str) -> Vec<Fired> {
        self.fired().into_iter().filter(|f| f.rule == rule).collect()
    }

    /// Every request answered so far (or whose reply was lost), in that order.
    pub fn requests(&self) -> Vec<Seen> {
        lock(&self.shared.seen).clone()
    }

    /// The requests so far, one line each (`METHOD path?query -> status`),
    /// for failure messages.
    pub fn request_log(&self) -> String {
        self.requests()
            .iter()
            .map(|r| {
                let answered = r.answered.map_or("no reply".to_string(), |s| s.to_string());
                format!("{} {}?{} -> {answered}", r.method, r.path, r.query)
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        for (_, c) in lock(&self.shared.clients).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

/// One HTTP message's head and body.
struct Message {
    /// The request line or the status line.
    start: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Message {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

/// Serves one client connection: its requests one after another (HTTP/1.1
/// keep-alive), until it closes, a request cannot be read, or a reply is lost
/// on purpose.
fn serve(client: TcpStream, upstream: &str, shared: &Shared) {
    let Ok(mut writer) = client.try_clone() else { return };
    let mut reader = BufReader::new(client);
    while let Ok(Some(head)) = read_head(&mut reader) {
        let (start, headers) = head;
        let mut parts = start.split(' ');
        let method = parts.next().unwrap_or_default().to_ascii_uppercase();
        let target = parts.next().unwrap_or_default().to_string();
        // The client waits for this before it sends the body.
        if headers.iter().any(|(n, v)| n.eq_ignore_ascii_case("expect") && v.eq_ignore_ascii_case("100-continue"))
            && writer.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").is_err()
        {
            return;
        }
        let mut request = Message { start, headers, body: Vec::new() };
        let Ok(body) = read_body(&mut reader, &request, false) else { return };
        request.body = body;
        let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
        let mut seen =
            Seen { method: method.clone(), path: percent_decode(path), query: percent_decode(query), answered: None };
        let decision = shared.decide(&seen);
        // A firing is on record from its decision on (a test may wait for a
        // delayed request to be held); what the upstream answered is added
        // once known.
        let firing = decision.as_ref().map(|(rule, action)| {
            let mut fired = lock(&shared.fired);
            fired.push(Fired {
                rule: rule.clone(),
                method: seen.method.clone(),
                path: seen.path.clone(),
                query: seen.query.clone(),
                action: *action,
                upstream: None,
            });
            fired.len() - 1
        });
        let record = |seen: &Seen, upstream_status: Option<u16>| {
            if let Some(i) = firing
                && let Some(f) = lock(&shared.fired).get_mut(i)
            {
                f.upstream = upstream_status;
            }
            lock(&shared.seen).push(seen.clone());
        };
        let action = decision.as_ref().map(|(_, a)| *a);
        if let Some(Action::Status(status)) = action {
            seen.answered = Some(status);
            record(&seen, None);
            if write_error(&mut writer, &method, status).is_err() || closes(&request) {
                return;
            }
            continue;
        }
        if let Some(Action::Delay(d)) = action {
            std::thread::sleep(d);
        }
        let reply = forward(upstream, &request, &method);
        let upstream_status = reply.as_ref().ok().map(|r| status_of(&r.start));
        match (action, reply) {
            (Some(Action::DropReplyAfterForward), _) => {
                record(&seen, upstream_status);
                let _ = writer.shutdown(Shutdown::Both);
                return;
            }
            (Some(Action::StatusAfterForward(status)), _) => {
                seen.answered = Some(status);
                record(&seen, upstream_status);
                if write_error(&mut writer, &method, status).is_err() {
                    return;
                }
            }
            (_, Ok(reply)) => {
                seen.answered = upstream_status;
                record(&seen, upstream_status);
                if write_reply(&mut writer, &method, &reply).is_err() {
                    return;
                }
            }
            (_, Err(e)) => {
                // The upstream is unreachable: as a gateway would answer.
                seen.answered = Some(502);
                record(&seen, None);
                let body = format!("fault proxy: upstream {upstream}: {e}");
                let reply = format!(
                    "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                if writer.write_all(reply.as_bytes()).is_err() {
                    return;
                }
            }
        }
        if closes(&request) {
            return;
        }
    }
}

/// Whether the client asked to close the connection after this request.
fn closes(request: &Message) -> bool {
    request.header("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"))
}

/// A start line and its headers.
type Head = (String, Vec<(String, String)>);

/// Reads a start line and headers; `None` at a clean end of the stream.
fn read_head(reader: &mut impl BufRead) -> std::io::Result<Option<Head>> {
    let mut start = String::new();
    if reader.read_line(&mut start)? == 0 {
        return Ok(None);
    }
    let start = start.trim_end().to_string();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "headers cut off"));
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            headers.push((name.trim().to_string(), value.trim().to_string()));
        }
    }
    Ok(Some((start, headers)))
}

/// Reads the body `head` announces: chunked, by length, or (a response
/// without either, `to_eof`) up to the end of the stream.
fn read_body(reader: &mut impl BufRead, head: &Message, to_eof: bool) -> std::io::Result<Vec<u8>> {
    let mut body = Vec::new();
    if head.header("transfer-encoding").is_some_and(|t| t.to_ascii_lowercase().contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size)?;
            let size = size.trim().split(';').next().unwrap_or_default();
            let n = usize::from_str_radix(size, 16)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad chunk size"))?;
            if n == 0 {
                // Trailers, up to the empty line.
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                        break;
                    }
                }
                return Ok(body);
            }
            let at = body.len();
            body.resize(at + n, 0);
            reader.read_exact(&mut body[at..])?;
            let mut crlf = [0u8; 2];
            reader.read_exact(&mut crlf)?;
        }
    }
    if let Some(len) = head.header("content-length") {
        let n: usize =
            len.parse().map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "bad content-length"))?;
        body.resize(n, 0);
        reader.read_exact(&mut body)?;
    } else if to_eof {
        reader.read_to_end(&mut body)?;
    }
    Ok(body)
}

/// Headers that belong to one connection, never forwarded.
fn hop_by_hop(name: &str) -> bool {
    ["connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "te", "upgrade"]
        .iter()
        .any(|h| name.eq_ignore_ascii_case(h))
}

/// Sends `request` to the upstream on a connection of its own, and reads
/// its whole reply.
fn forward(upstream: &str, request: &Message, method: &str) -> std::io::Result<Message> {
    let mut conn = TcpStream::connect(upstream)?;
    conn.set_read_timeout(Some(Duration::from_secs(120)))?;
    let mut head = format!("{}\r\n", request.start);
    for (name, value) in &request.headers {
        if !hop_by_hop(name) && !name.eq_ignore_ascii_case("content-length") {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
    }
    let had_body = request.header("content-length").is_some() || request.header("transfer-encoding").is_some();
    if had_body || !request.body.is_empty() {
        head.push_str(&format!("Content-Length: {}\r\n", request.body.len()));
    }
    head.push_str("Connection: close\r\n\r\n");
    conn.write_all(head.as_bytes())?;
    conn.write_all(&request.body)?;
    conn.flush()?;
    let mut reader = BufReader::new(conn);
    loop {
        let (start, headers) = read_head(&mut reader)?
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "no reply from the upstream"))?;
        let mut reply = Message { start, headers, body: Vec::new() };
        let status = status_of(&reply.start);
        if (100..200).contains(&status) {
            continue;
        }
        if method != "HEAD" && status != 204 && status != 304 {
            reply.body = read_body(&mut reader, &reply, true)?;
        }
        return Ok(reply);
    }
}

fn status_of(start: &str) -> u16 {
    start.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// Writes the upstream's `reply` to the client, framed by length.
fn write_reply(writer: &mut impl Write, method: &str, reply: &Message) -> std::io::Result<()> {
    let status = status_of(&reply.start);
    let reason = reply.start.splitn(3, ' ').nth(2).unwrap_or("");
    let mut head = format!("HTTP/1.1 {status} {reason}\r\n");
    // A reply without a body (to a HEAD, or a 204/304) keeps its own length header.
    let bodiless = method == "HEAD" || status == 204 || status == 304;
    for (name, value) in &reply.headers {
        if hop_by_hop(name) || (!bodiless && name.eq_ignore_ascii_case("content-length")) {
            continue;
        }
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if !bodiless {
        head.push_str(&format!("Content-Length: {}\r\n", reply.body.len()));
    }
    head.push_str("\r\n");
    writer.write_all(head.as_bytes())?;
    writer.write_all(&reply.body)?;
    writer.flush()
}

/// Answers `status` as S3 does: an XML `<Error>` document.
fn write_error(writer: &mut impl Write, method: &str, status: u16) -> std::io::Result<()> {
    let (reason, code, message) = match status {
        500 => ("Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
        503 => ("Service Unavailable", "SlowDown", "Please reduce your request rate."),
        _ => ("Error", "InternalError", "Injected by the fault proxy."),
    };
    let body = format!(
        r#"<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"#
    );
    let mut reply = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nx-amz-request-id: fault-proxy\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        reply.extend_from_slice(body.as_bytes());
    }
    writer.write_all(&reply)?;
    writer.flush()
}

/// `%XX` decoded (invalid escapes kept as they are).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    /// A tiny upstream that answers every request `200` with a body naming
    /// its method and target, and counts them.
    fn upstream() -> (String, Arc<Mutex<Vec<String>>>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).expect("bind");
        let addr = format!("http://{}", listener.local_addr().expect("addr"));
        let got = Arc::new(Mutex::new(Vec::new()));
        let log = got.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || {
                    let mut w = stream.try_clone().expect("clone");
                    let mut r = BufReader::new(stream);
                    let Ok(Some((start, headers))) = read_head(&mut r) else { return };
                    let m = Message { start, headers, body: Vec::new() };
                    let body = read_body(&mut r, &m, false).expect("body");
                    lock(&log).push(format!("{} {}", m.start, String::from_utf8_lossy(&body)));
                    let reply = format!("seen {}", m.start);
                    let _ = write!(w, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{reply}", reply.len());
                });
            }
        });
        (addr, got)
    }

    fn send(proxy: &FaultProxy, method: &str, target: &str, body: &str) -> std::io::Result<String> {
        let mut conn = TcpStream::connect(proxy.endpoint.trim_start_matches("http://"))?;
        write!(
            conn,
            "{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut out = String::new();
        conn.read_to_string(&mut out)?;
        Ok(out)
    }

    #[test]
    fn rules_fail_before_lose_after_and_count_once_armed() {
        let (addr, got) = upstream();
        let proxy = FaultProxy::start(&addr);
        proxy.set_rules(vec![
            Rule::new("list after put", Match::list("b", "p/", &["checkpoints"]), Action::Status(500))
                .after(Match::put("b", "chk-3")),
            Rule::new("lose 2nd put", Match::put("b", "chk-"), Action::DropReplyAfterForward).nth(2),
        ]);
        let list = "/b?list-type=2&prefix=p%2Fcheckpoints%2F";
        assert!(send(&proxy, "GET", list, "").expect("list").starts_with("HTTP/1.1 200"), "not armed yet");
        assert!(send(&proxy, "PUT", "/b/p/chk-1", "one").expect("put").starts_with("HTTP/1.1 200"));
        assert_eq!(send(&proxy, "PUT", "/b/p/chk-2", "two").expect("put"), "", "the reply was lost");
        assert!(send(&proxy, "PUT", "/b/p/chk-3", "three").expect("put").starts_with("HTTP/1.1 200"));
        let failed = send(&proxy, "GET", list, "").expect("list");
        assert!(failed.starts_with("HTTP/1.1 500") && failed.contains("<Code>InternalError</Code>"), "{failed}");
        assert!(send(&proxy, "GET", list, "").expect("list").starts_with("HTTP/1.1 200"), "it fired once");
        let fired = proxy.fired();
        assert_eq!(fired.len(), 2, "{fired:?}");
        assert_eq!((fired[0].rule.as_str(), fired[0].upstream), ("lose 2nd put", Some(200)));
        assert_eq!((fired[1].rule.as_str(), fired[1].upstream), ("list after put", None));
        assert_eq!(fired[1].query, "list-type=2&prefix=p/checkpoints/");
        let got = lock(&got).clone();
        // The lost reply's request reached the upstream; the failed list did not.
        assert!(got.iter().any(|g| g.starts_with("PUT /b/p/chk-2 ") && g.ends_with("two")), "{got:?}");
        assert_eq!(got.iter().filter(|g| g.starts_with("GET ")).count(), 2, "{got:?}");
    }
}
