//! An EC2 instance metadata service double (IMDSv2), on 127.0.0.1, serving
//! an instance role's security credentials, as AWS documents them:
//!
//! - <https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html>
//!   ("Use the Instance Metadata Service to access instance metadata"): a
//!   session starts with `PUT /latest/api/token` carrying
//!   `X-aws-ec2-metadata-token-ttl-seconds` (1 to 21600), answered with the
//!   token as text; a request without a valid TTL is `400 Bad Request`.
//!   Every `GET` then carries the token in `X-aws-ec2-metadata-token`; with
//!   IMDSv2 required, a missing, unknown or expired token is
//!   `401 Unauthorized`;
//! - <https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-security-credentials.html>
//!   ("Retrieve security credentials from instance metadata"):
//!   `GET /latest/meta-data/iam/security-credentials/` answers the role's
//!   name, and `GET /latest/meta-data/iam/security-credentials/<role>`
//!   `{"Code": "Success", "LastUpdated", "Type": "AWS-HMAC", "AccessKeyId",
//!   "SecretAccessKey", "Token", "Expiration"}` with times as
//!   `YYYY-MM-DDTHH:MM:SSZ`. AWS makes new credentials available before the
//!   old ones expire; this double hands out a new set, with an access key
//!   id of its own, at every request, so each set the host uses can be told
//!   apart in the store's request log.
//!
//! Invariants:
//! - a set's `Expiration` is its issue time plus the server's `lifetime`,
//!   rounded down to the second: a client never thinks a set lives longer
//!   than the server says;
//! - every set issued is recorded with its expiry ([`ImdsServer::issued`]);
//! - only the routes above are served; anything else is `404 Not Found`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use serde_json::json;

/// One set of credentials the double issued.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedSet {
    pub access_key_id: String,
    /// Its `Expiration`, in milliseconds since the Unix epoch (whole seconds).
    pub expires_at_ms: u64,
}

#[derive(Default)]
struct Stats {
    sessions: usize,
    /// Requests refused for a missing, unknown or expired session token.
    unauthorized: u64,
    issued: Vec<IssuedSet>,
}

struct Shared {
    role: String,
    lifetime: Duration,
    /// Session token → when it expires.
    sessions: Mutex<HashMap<String, Instant>>,
    stats: Mutex<Stats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `YYYY-MM-DDTHH:MM:SSZ` of `secs` since the Unix epoch (Howard Hinnant's
/// civil-from-days).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rest = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The instance metadata service, serving until dropped.
pub struct ImdsServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ImdsServer {
    /// Starts on a free port, for an instance whose role is `role`; each
    /// set of credentials says it expires `lifetime` after it was issued.
    pub fn start(role: &str, lifetime: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared =
            Arc::new(Shared { role: role.to_string(), lifetime, sessions: Mutex::default(), stats: Mutex::default() });
        let app = axum::Router::new()
            .route("/latest/api/token", put(session_token))
            .route("/latest/meta-data/iam/security-credentials/", get(role_name))
            .route("/latest/meta-data/iam/security-credentials/{role}", get(role_credentials))
            .with_state(shared.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = rx.await;
                    })
                    .await;
            });
        });
        Ok(Self { shared, addr, shutdown: Some(tx), thread: Some(thread) })
    }

    /// `http://127.0.0.1:PORT`: the value of `AWS_EC2_METADATA_SERVICE_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every set of credentials issued so far, in order.
    pub fn issued(&self) -> Vec<IssuedSet> {
        lock(&self.shared.stats).issued.clone()
    }

    /// Session tokens handed out so far (`PUT /latest/api/token`).
    pub fn sessions(&self) -> usize {
        lock(&self.shared.stats).sessions
    }

    /// Requests refused `401` for their session token.
    pub fn unauthorized(&self) -> u64 {
        lock(&self.shared.stats).unauthorized
    }
}

impl Drop for ImdsServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn text(status: StatusCode, body: impl Into<String>) -> Response {
    (status, [("content-type", "text/plain")], body.into()).into_response()
}

/// `PUT /latest/api/token`: a session token living the TTL asked for.
async fn session_token(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let ttl = headers
        .get("x-aws-ec2-metadata-token-ttl-seconds")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ttl| (1..=21_600).contains(ttl));
    let Some(ttl) = ttl else { return text(StatusCode::BAD_REQUEST, "") };
    let token = format!("imds-double-session-{:x}", rand::random::<u64>());
    lock(&shared.sessions).insert(token.clone(), Instant::now() + Duration::from_secs(ttl));
    lock(&shared.stats).sessions += 1;
    text(StatusCode::OK, token)
}

/// Whether `headers` carry a session token issued here and not expired;
/// counts a refusal.
fn authorized(shared: &Shared, headers: &HeaderMap) -> bool {
    let token = headers.get("x-aws-ec2-metadata-token").and_then(|v| v.to_str().ok());
    let ok = token.is_some_and(|t| lock(&shared.sessions).get(t).is_some_and(|expires| Instant::now() < *expires));
    if !ok {
        lock(&shared.stats).unauthorized += 1;
    }
    ok
}

/// `GET /latest/meta-data/iam/security-credentials/`: the role's name.
async fn role_name(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if !authorized(&shared, &headers) {
        return text(StatusCode::UNAUTHORIZED, "");
    }
    text(StatusCode::OK, shared.role.clone())
}

/// `GET /latest/meta-data/iam/security-credentials/<role>`: a new set.
async fn role_credentials(State(shared): State<Arc<Shared>>, Path(role): Path<String>, headers: HeaderMap) -> Response {
    if !authorized(&shared, &headers) {
        return text(StatusCode::UNAUTHORIZED, "");
    }
    if role != shared.role {
        return text(StatusCode::NOT_FOUND, "");
    }
    let now = now_secs();
    let expires = (SystemTime::now() + shared.lifetime).duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut stats = lock(&shared.stats);
    let access_key_id = format!("ASIAIMDSDOUBLE{:06}", stats.issued.len() + 1);
    stats.issued.push(IssuedSet { access_key_id: access_key_id.clone(), expires_at_ms: expires * 1000 });
    drop(stats);
    let body = json!({
        "Code": "Success",
        "LastUpdated": rfc3339(now),
        "Type": "AWS-HMAC",
        "AccessKeyId": access_key_id,
        "SecretAccessKey": format!("imds-double-secret-{:x}", rand::random::<u64>()),
        "Token": format!("imds-double-token-{:x}", rand::random::<u64>()),
        "Expiration": rfc3339(expires),
    });
    (StatusCode::OK, [("content-type", "text/plain")], body.to_string()).into_response()
}

#[cfg(test)]
mod tests {
    #[test]
    fn times_are_written_as_aws_writes_them() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(1_494_947_394), "2017-05-16T15:09:54Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
