//! The `wasi:http` capability (outgoing requests), served by
//! wasmtime-wasi-http, confined to the endpoints the job file names
//! (`[sink.http.<name>]`).
//!
//! Invariants:
//! - a plugin addresses an endpoint by name: `http://<name>/path`. The host
//!   sends the request to the address the job maps the name to (its scheme,
//!   authority and path prefix), and any other authority is denied; a plugin
//!   reaches no other host, whatever URL it builds;
//! - credentials (a bearer token from an environment variable or a file) are
//!   added by the host as the `authorization` header; a plugin may not set
//!   that header itself, and the token never crosses into the guest;
//! - with `auth = "google"` the host adds Google's Application Default
//!   Credentials ([`super::google_auth`]) the same way. A `401` answer
//!   renews the token; the request's body has streamed from the plugin and
//!   the host keeps no copy to send again, so the plugin gets `503` (which
//!   it retries, as it retries the service's own 503) with a Google-style
//!   error body saying so. A request refused for its credentials was not
//!   applied, so sending it again is safe. A token refused again once
//!   renewed is answered `401`, as the service sent it;
//! - `https` addresses use TLS (wasmtime-wasi-http's rustls with the web
//!   PKI roots);
//! - no request waits forever: connect and first-byte timeouts apply when
//!   the plugin sets none, and none is longer than what the plugin call
//!   under way has left (its waits themselves are `wasi:io/poll`, bounded
//!   by the call's deadline in `plugin::wasi_bounded`);
//! - an instance has at most `sink.sandbox.max_http_requests` requests in
//!   flight (sent, response headers not yet in); one more fails with an
//!   `internal-error` naming the setting. Bodies stream through
//!   wasmtime-wasi-http's bounded buffers (one 1 MiB chunk each way).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use http::header::{AUTHORIZATION, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use thiserror::Error;
use wasmtime::component::Linker;
use wasmtime_wasi_http::p2::bindings::LinkOptions;
use wasmtime_wasi_http::p2::bindings::sync::http as wasi_http;
use wasmtime_wasi_http::{
    DEFAULT_FORBIDDEN_HEADERS, ForbiddenHeaderFilter, RequestOptions, WasiBody, WasiHttp, WasiHttpCtx, WasiHttpCtxView,
    WasiHttpHooks,
};

use super::CapabilityHost;
use super::google_auth::{GoogleAuthError, GoogleToken};
use super::limits::{CallDeadline, HandleCap};
use super::syncs::Syncs;
use crate::config::EndpointConfig;

/// Longest a request waits for a connection or its first reply byte when
/// the plugin sets no timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// An endpoint that cannot be set up, named by its key in `[sink.http]`.
#[derive(Debug, Error)]
pub enum HttpSetupError {
    #[error("sink.http.{name}.address: {reason}")]
    Address { name: String, reason: String },
    #[error("sink.http.{name}: the token is not a valid header value")]
    TokenValue { name: String },
    #[error(transparent)]
    Google(#[from] GoogleAuthError),
}

/// `Debug` prints the token as `Sensitive` (the header value is marked so).
#[derive(Clone, Debug)]
struct GrantedEndpoint {
    scheme: Scheme,
    authority: Authority,
    /// Prefix of every path (the address's own path, without a trailing `/`).
    base_path: String,
    authorization: Option<HeaderValue>,
    /// `auth = "google"`: the token is fetched (and renewed) per request.
    google: Option<Arc<GoogleToken>>,
    connect_timeout: Duration,
}

/// The HTTP endpoints one plugin may call, shared by its instances.
#[derive(Default)]
pub struct HttpGrant {
    endpoints: BTreeMap<String, GrantedEndpoint>,
}

impl std::fmt::Debug for HttpGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints the credentials.
        f.debug_struct("HttpGrant").field("endpoints", &self.describe()).finish()
    }
}

impl HttpGrant {
    /// The job's endpoints (validated by `sluice_job::load`).
    pub fn open(configs: &BTreeMap<String, EndpointConfig>) -> Result<Self, HttpSetupError> {
        let mut endpoints = BTreeMap::new();
        for (name, config) in configs {
            let bad = |reason: String| HttpSetupError::Address { name: name.clone(), reason };
            let uri: Uri = config.address.parse().map_err(|e| bad(format!("{:?}: {e}", config.address)))?;
            let scheme = uri.scheme().cloned().ok_or_else(|| bad("has no scheme".into()))?;
            let authority = uri.authority().cloned().ok_or_else(|| bad("has no host".into()))?;
            let authorization = match &config.token {
                None => None,
                Some(token) => {
                    let mut value = HeaderValue::try_from(format!("Bearer {}", token.expose()))
                        .map_err(|_| HttpSetupError::TokenValue { name: name.clone() })?;
                    value.set_sensitive(true);
                    Some(value)
                }
            };
            endpoints.insert(
                name.clone(),
                GrantedEndpoint {
                    scheme,
                    authority,
                    base_path: uri.path().trim_end_matches('/').to_string(),
                    authorization,
                    google: if config.google_auth {
                        Some(Arc::new(GoogleToken::open(&format!("sink.http.{name}"))?))
                    } else {
                        None
                    },
                    connect_timeout: config.connect_timeout,
                },
            );
        }
        Ok(Self { endpoints })
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// `http: bigquery → http://127.0.0.1:9060 (bearer token)`.
    pub fn describe(&self) -> String {
        let list: Vec<String> = self
            .endpoints
            .iter()
            .map(|(name, e)| {
                let auth = if e.google.is_some() {
                    " (Google credentials)"
                } else if e.authorization.is_some() {
                    " (bearer token)"
                } else {
                    ""
                };
                format!("{name} → {}://{}{}{auth}", e.scheme, e.authority, e.base_path)
            })
            .collect();
        format!("http: {}", list.join(", "))
    }

    /// Where a request the plugin addressed to `uri` really goes, or why not.
    fn route(&self, uri: &Uri) -> Result<(Uri, &GrantedEndpoint), String> {
        let name = uri.host().unwrap_or_default();
        let Some(endpoint) = self.endpoints.get(name) else {
            let known: Vec<&str> = self.endpoints.keys().map(String::as_str).collect();
            return Err(format!(
                "HTTP endpoint `{name}` is not granted: the job file's [sink.http] names {}",
                if known.is_empty() { "no endpoint".to_string() } else { known.join(", ") }
            ));
        };
        if uri.port().is_some() {
            return Err(format!("HTTP endpoint `{name}`: address it by name alone, without a port"));
        }
        let path = uri.path_and_query().map_or("/", PathAndQuery::as_str);
        let target = Uri::builder()
            .scheme(endpoint.scheme.clone())
            .authority(endpoint.authority.clone())
            .path_and_query(format!("{}{path}", endpoint.base_path))
            .build()
            .map_err(|e| format!("HTTP endpoint `{name}`: cannot build the request URI: {e}"))?;
        Ok((target, endpoint))
    }
}

/// The per-instance state of the capability.
pub struct HttpCtx {
    ctx: WasiHttpCtx,
    hooks: Hooks,
}

impl HttpCtx {
    pub fn new(grant: Arc<HttpGrant>, max_requests: u32, syncs: Arc<Syncs>) -> Self {
        let requests = HandleCap::new(max_requests, "HTTP requests in flight", "sink.sandbox.max_http_requests");
        Self { ctx: WasiHttpCtx::new(), hooks: Hooks { grant, requests, syncs } }
    }
}

/// wasmtime-wasi-http's hooks: every request is routed through the grant
/// and counted against the instance's cap.
struct Hooks {
    grant: Arc<HttpGrant>,
    requests: HandleCap,
    /// The instance's deferred syncs, settled before a request goes out.
    syncs: Arc<Syncs>,
}

type ResponseFuture = Box<
    dyn Future<
            Output = Result<
                (http::Response<WasiBody>, Box<dyn Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>),
                wasmtime_wasi_http::Error,
            >,
        > + Send,
>;

impl WasiHttpHooks for Hooks {
    fn forbidden_header_filter(&mut self) -> ForbiddenHeaderFilter {
        // The host owns the credentials: a plugin may not send its own.
        Arc::new(|name: &HeaderName| *name == AUTHORIZATION || DEFAULT_FORBIDDEN_HEADERS.contains(name))
    }

    fn send_request(
        &mut self,
        mut request: http::Request<WasiBody>,
        options: Option<RequestOptions>,
        fut: Box<dyn Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> ResponseFuture {
        _ = fut;
        let routed = self.grant.route(request.uri()).map(|(uri, e)| (uri, e.clone()));
        // Called on the plugin call's thread: its deadline bounds the request.
        // The request's own timeouts end a little after it, so that a plugin
        // blocked waiting is stopped by the deadline itself (in
        // `plugin::wasi_bounded`, naming the import) rather than by a timeout
        // racing it, and a request the plugin left behind still ends soon.
        const GRACE: Duration = Duration::from_secs(1);
        let left = CallDeadline::remaining();
        let bound = move |t: Duration| left.map_or(t, |left| t.min(left + GRACE));
        let slot = self.requests.take();
        // Nothing goes out before the files the call finished are durable.
        let settled = self.syncs.settle();
        Box::new(async move {
            if let Err(failed) = settled {
                tracing::error!("{failed}");
                return Err(wasmtime_wasi_http::Error::InternalError(Some(failed.to_string())));
            }
            use http_body_util::BodyExt;
            // Held until the response headers are in (or the request fails).
            let _slot = match slot {
                Ok(slot) => slot,
                Err(too_many) => {
                    tracing::warn!("{too_many}");
                    return Err(wasmtime_wasi_http::Error::InternalError(Some(too_many.to_string())));
                }
            };
            let (uri, endpoint) = match routed {
                Ok(r) => r,
                Err(why) => {
                    tracing::warn!("{why}");
                    return Err(wasmtime_wasi_http::Error::HttpRequestDenied);
                }
            };
            if let Ok(host) = HeaderValue::from_str(endpoint.authority.as_str()) {
                request.headers_mut().insert(http::header::HOST, host);
            }
            let mut authorization = endpoint.authorization.clone();
            if let Some(google) = &endpoint.google {
                let bearer = google.bearer().await.map_err(|e| {
                    tracing::warn!("{e}");
                    wasmtime_wasi_http::Error::InternalError(Some(e.to_string()))
                })?;
                let mut value = HeaderValue::try_from(bearer).map_err(|_| {
                    wasmtime_wasi_http::Error::InternalError(Some("the Google token is not a header value".into()))
                })?;
                value.set_sensitive(true);
                authorization = Some(value);
            }
            if let Some(auth) = &authorization {
                request.headers_mut().insert(AUTHORIZATION, auth.clone());
            }
            *request.uri_mut() = uri;
            let mut options = options.unwrap_or_default();
            options.connect_timeout = Some(bound(options.connect_timeout.unwrap_or(endpoint.connect_timeout)));
            options.first_byte_timeout = Some(bound(options.first_byte_timeout.unwrap_or(DEFAULT_TIMEOUT)));
            options.between_bytes_timeout = Some(bound(options.between_bytes_timeout.unwrap_or(DEFAULT_TIMEOUT)));
            let (response, io) = wasmtime_wasi_http::default_send_request(request, Some(options)).await?;
            if response.status() == http::StatusCode::UNAUTHORIZED
                && let Some(google) = &endpoint.google
                && let Some(refused) = authorization.as_ref().and_then(|v| v.to_str().ok())
            {
                match google.renew(refused).await {
                    Ok(true) => return Ok(token_renewed(endpoint.authority.as_str())),
                    Ok(false) => {}
                    Err(e) => tracing::warn!("{e}"),
                }
            }
            Ok((response.map(BodyExt::boxed_unsync), Box::new(io) as Box<dyn Future<Output = _> + Send>))
        })
    }
}

/// The answer to a request refused `401` whose token the host renewed:
/// `503`, in the error shape of Google's APIs, for the plugin to retry.
fn token_renewed(
    authority: &str,
) -> (http::Response<WasiBody>, Box<dyn Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>) {
    use http_body_util::BodyExt;
    let message =
        format!("{authority} refused the Google token (HTTP 401); the host renewed it: send the request again");
    let body = serde_json::json!({"error": {"code": 503, "message": message, "status": "UNAVAILABLE"}}).to_string();
    let mut response = http::Response::new(
        http_body_util::Full::new(bytes::Bytes::from(body)).map_err(|never| match never {}).boxed_unsync(),
    );
    *response.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
    response
        .headers_mut()
        .insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json; charset=UTF-8"));
    (response, Box::new(async { Ok(()) }))
}

fn view<T: CapabilityHost>(data: &mut T) -> WasiHttpCtxView<'_> {
    let (caps, table) = data.capabilities();
    WasiHttpCtxView { ctx: &mut caps.http.ctx, table, hooks: &mut caps.http.hooks }
}

/// Links `wasi:http/outgoing-handler` and `wasi:http/types` (their
/// `wasi:io` resources come from wasmtime-wasi, linked beside).
pub fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    let options = LinkOptions::default();
    wasi_http::outgoing_handler::add_to_linker::<T, WasiHttp>(linker, view::<T>)?;
    wasi_http::types::add_to_linker::<T, WasiHttp>(linker, &options.into(), view::<T>)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(address: &str) -> HttpGrant {
        let config = EndpointConfig {
            address: address.to_string(),
            tls: address.starts_with("https"),
            token: None,
            google_auth: false,
            connect_timeout: Duration::from_secs(1),
        };
        HttpGrant::open(&BTreeMap::from([("bigquery".to_string(), config)])).expect("valid endpoint")
    }

    #[test]
    fn routes_granted_names_to_their_address() {
        let g = grant("http://127.0.0.1:9050/base/");
        let (uri, _) = g.route(&"http://bigquery/bigquery/v2/projects/p".parse().expect("uri")).expect("granted");
        assert_eq!(uri.to_string(), "http://127.0.0.1:9050/base/bigquery/v2/projects/p");
    }

    #[test]
    fn denies_other_hosts_and_ports() {
        let g = grant("https://bigquery.googleapis.com");
        let denied = g.route(&"http://example.com/x".parse().expect("uri")).expect_err("not granted");
        assert!(denied.contains("`example.com` is not granted") && denied.contains("bigquery"), "{denied}");
        assert!(g.route(&"http://bigquery:8080/x".parse().expect("uri")).is_err());
    }
}
