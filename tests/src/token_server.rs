//! A token service double: the token endpoint of the Compute Engine
//! metadata server, on 127.0.0.1, issuing tokens that expire after a few
//! seconds, so that a test of a minute sees many renewals.
//!
//! It follows Google's documentation:
//! - <https://cloud.google.com/compute/docs/metadata/querying-metadata>:
//!   every request must carry `Metadata-Flavor: Google`, else `403
//!   Forbidden`; replies carry `Metadata-Flavor: Google`; the server is
//!   found at `GCE_METADATA_HOST` by Google's client libraries;
//! - <https://cloud.google.com/compute/docs/access/authenticate-workloads#applications>:
//!   `GET /computeMetadata/v1/instance/service-accounts/default/token`
//!   (optionally `?scopes=a,b`) answers
//!   `{"access_token": "...", "expires_in": <seconds>, "token_type": "Bearer"}`.
//!
//! Invariants:
//! - every token is new (unique) and valid from its issue until `lifetime`
//!   after it; [`TokenServer::validator`] is the service's view of it, which
//!   the BigQuery double uses to refuse an expired or unknown token;
//! - `expires_in` is whole seconds rounded down, as a server counting its
//!   own clock reports it: a client never thinks a token lives longer than
//!   it does.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// Path of the default service account's token.
pub const TOKEN_PATH: &str = "/computeMetadata/v1/instance/service-accounts/default/token";

struct Shared {
    lifetime: Duration,
    /// Token → when it expires.
    issued: Mutex<HashMap<String, Instant>>,
    /// Requests refused for a missing `Metadata-Flavor: Google`.
    refused: Mutex<u64>,
}

impl Shared {
    fn issued(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.issued.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The metadata server's token endpoint, serving until dropped.
pub struct TokenServer {
    shared: Arc<Shared>,
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TokenServer {
    /// Starts on a free port; tokens live `lifetime`.
    pub fn start(lifetime: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared { lifetime, issued: Mutex::default(), refused: Mutex::default() });
        let app = axum::Router::new().route(TOKEN_PATH, get(token)).with_state(shared.clone());
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

    /// `127.0.0.1:PORT`, the value of `GCE_METADATA_HOST`.
    pub fn host(&self) -> String {
        self.addr.to_string()
    }

    /// The service's check of a token: issued here and not expired.
    pub fn validator(&self) -> impl Fn(&str) -> bool + Send + Sync + 'static {
        let shared = self.shared.clone();
        move |token: &str| shared.issued().get(token).is_some_and(|expires| Instant::now() < *expires)
    }

    /// Revokes every token issued so far (as when a service account's
    /// keys are rotated): the service refuses them from now on.
    pub fn revoke_all(&self) {
        let now = Instant::now();
        for expires in self.shared.issued().values_mut() {
            *expires = (*expires).min(now);
        }
    }

    /// Tokens issued so far.
    pub fn issued(&self) -> usize {
        self.shared.issued().len()
    }

    /// Requests refused for a missing `Metadata-Flavor: Google` header.
    pub fn refused(&self) -> u64 {
        *self.shared.refused.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn token(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let flavor = HeaderValue::from_static("Google");
    if headers.get("metadata-flavor") != Some(&flavor) {
        *shared.refused.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        // The documented answer to a request without the header.
        return (StatusCode::FORBIDDEN, "Missing required header: Metadata-Flavor").into_response();
    }
    let n = shared.issued().len();
    let access_token = format!("ya29.double-{n}-{:x}", rand::random::<u64>());
    let expires = Instant::now() + shared.lifetime;
    shared.issued().insert(access_token.clone(), expires);
    let body = serde_json::json!({
        "access_token": access_token,
        "expires_in": shared.lifetime.as_secs(),
        "token_type": "Bearer",
    });
    let mut response = axum::Json(body).into_response();
    response.headers_mut().insert("metadata-flavor", flavor);
    response
}
