//! The `grpc` capability: unary and bidirectional-streaming gRPC calls to the
//! endpoints the job file names (`[sink.grpc.<name>]`), over tonic.
//!
//! Invariants:
//! - a plugin names an endpoint, never an address; a name the job file does
//!   not map is `denied`, and nothing else is reachable;
//! - credentials (a bearer token from an environment variable or a file,
//!   or Google's Application Default Credentials with `auth = "google"`,
//!   see [`super::google_auth`]) are read by the host and added as the
//!   `authorization` header; they never cross into the guest;
//! - with `auth = "google"`, a call refused as `UNAUTHENTICATED` renews the
//!   token. A unary call is then sent once more by the host: a call refused
//!   for its credentials was never applied, so any method may be sent
//!   again. A stream's messages are the plugin's (the host keeps none to
//!   replay), so a stream refused that way ends `UNAVAILABLE`, which the
//!   plugin retries (AppendRows with explicit offsets: a replayed offset
//!   answers ALREADY_EXISTS, so no row lands twice). A token refused again
//!   once renewed stays `UNAUTHENTICATED`;
//! - `https` addresses use TLS with the system roots;
//! - messages cross as raw protobuf bytes ([`RawCodec`]): the host never
//!   decodes them, so any protobuf API works without rebuilding the engine;
//! - every non-OK status reaches the guest with its code, message and the
//!   `grpc-status-details-bin` bytes (a serialized `google.rpc.Status`);
//! - no call blocks forever: unary calls and `receive` carry a deadline,
//!   and no wait outlasts the plugin call's own deadline (past it the wait
//!   is cancelled and the call traps, naming the import);
//! - each plugin instance reaches an endpoint over its own connection (an
//!   HTTP/2 connection, made at its first call): one connection's frames
//!   are read and written by one task on each side, so writers that shared
//!   one were paced by it (two BigQuery writers ran at 0.82–0.83× two
//!   native writers, each on its own connection; 0.93–0.96× apart);
//! - an instance has at most `sink.sandbox.max_grpc_streams` calls in
//!   flight (open streams plus the unary call under way), and the messages
//!   queued for it (requests not yet sent, replies not yet received) are
//!   held against its host-memory budget.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut};
use thiserror::Error;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Status};

use wasmtime::component::{HasData, Linker, Resource, ResourceTable};

use super::google_auth::{GoogleAuthError, GoogleToken};
use super::limits::{CallDeadline, HandleCap, HandleSlot, HostDeadline, HostMemory, Reservation};
use super::syncs::Syncs;
use super::{CapabilityHost, Effects};
use crate::bindings::v0_2::sluice::connector::grpc::{self as wit, GrpcError, Received};
use crate::config::EndpointConfig;

/// Largest message accepted from a server (BigQuery's own limit on a request
/// is 10 MB; replies are far smaller).
const MAX_MESSAGE: usize = 64 * 1024 * 1024;
/// Longest a single call may wait, whatever the plugin asks.
const MAX_TIMEOUT: Duration = Duration::from_secs(600);

/// An endpoint that cannot be set up, named by its key in `[sink.grpc]`.
#[derive(Debug, Error)]
pub enum GrpcSetupError {
    #[error("sink.grpc.{name}.address: {source}")]
    Address {
        name: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("sink.grpc.{name}: TLS setup failed: {source}")]
    Tls {
        name: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("sink.grpc.{name}: the token is not a valid header value")]
    TokenValue { name: String },
    #[error(transparent)]
    Google(#[from] GoogleAuthError),
}

struct GrantedEndpoint {
    address: String,
    /// How to connect; each instance makes its own connection from it.
    connect: Endpoint,
    authorization: Option<AsciiMetadataValue>,
    /// `auth = "google"`: the token is fetched (and renewed) per call.
    google: Option<Arc<GoogleToken>>,
}

/// The `authorization` value of a call to `endpoint` (`name`), if any.
async fn authorization(
    name: &str,
    endpoint_static: Option<&AsciiMetadataValue>,
    google: Option<&GoogleToken>,
) -> Result<Option<AsciiMetadataValue>, Status> {
    let Some(google) = google else { return Ok(endpoint_static.cloned()) };
    // A token service that fails mid-run may recover: the plugin retries.
    let bearer = google.bearer().await.map_err(|e| Status::unavailable(e.to_string()))?;
    let mut value: AsciiMetadataValue = MetadataValue::try_from(bearer)
        .map_err(|_| Status::unauthenticated(format!("endpoint `{name}`: the Google token is not a header value")))?;
    value.set_sensitive(true);
    Ok(Some(value))
}

/// After `refused` was refused as UNAUTHENTICATED: whether the token was
/// renewed (a new call may succeed).
async fn renewed(google: &GoogleToken, refused: Option<&AsciiMetadataValue>) -> bool {
    let Some(refused) = refused.and_then(|v| v.to_str().ok()) else { return false };
    match google.renew(refused).await {
        Ok(changed) => changed,
        Err(e) => {
            tracing::warn!("{e}");
            false
        }
    }
}

/// The endpoints one plugin may call, shared by its instances.
#[derive(Default)]
pub struct GrpcGrant {
    endpoints: BTreeMap<String, GrantedEndpoint>,
}

impl std::fmt::Debug for GrpcGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints the credentials.
        f.debug_struct("GrpcGrant").field("endpoints", &self.describe()).finish()
    }
}

impl GrpcGrant {
    /// Sets up the job's endpoints (validated by `sluice_job::load`). Nothing
    /// connects yet: each instance connects at its first call, so an
    /// unreachable address surfaces there, as UNAVAILABLE naming the endpoint.
    pub fn open(configs: &BTreeMap<String, EndpointConfig>) -> Result<Self, GrpcSetupError> {
        let mut endpoints = BTreeMap::new();
        for (name, config) in configs {
            let authorization = match &config.token {
                None => None,
                Some(token) => {
                    let mut value: AsciiMetadataValue =
                        MetadataValue::try_from(format!("Bearer {}", token.expose()))
                            .map_err(|_| GrpcSetupError::TokenValue { name: name.clone() })?;
                    value.set_sensitive(true);
                    Some(value)
                }
            };
            let mut endpoint = Endpoint::from_shared(config.address.clone())
                .map_err(|source| GrpcSetupError::Address { name: name.clone(), source })?
                .connect_timeout(config.connect_timeout)
                .tcp_nodelay(true);
            if config.tls {
                endpoint = endpoint
                    .tls_config(ClientTlsConfig::new().with_native_roots())
                    .map_err(|source| GrpcSetupError::Tls { name: name.clone(), source })?;
            }
            let google = if config.google_auth {
                Some(Arc::new(GoogleToken::open(&format!("sink.grpc.{name}"))?))
            } else {
                None
            };
            endpoints.insert(
                name.clone(),
                GrantedEndpoint { address: config.address.clone(), connect: endpoint, authorization, google },
            );
        }
        Ok(Self { endpoints })
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    /// `grpc: bigquery → http://127.0.0.1:9060 (bearer token)`.
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
                format!("{name} → {}{auth}", e.address)
            })
            .collect();
        format!("grpc: {}", list.join(", "))
    }

    fn endpoint(
        &self,
        name: &str,
        method: &str,
    ) -> Result<(&GrantedEndpoint, tonic::codegen::http::uri::PathAndQuery), GrpcError> {
        let Some(endpoint) = self.endpoints.get(name) else {
            let known: Vec<&str> = self.endpoints.keys().map(String::as_str).collect();
            return Err(GrpcError::Denied(format!(
                "endpoint `{name}` is not granted: the job file's [sink.grpc] names {}",
                if known.is_empty() { "no endpoint".to_string() } else { known.join(", ") }
            )));
        };
        let path = match tonic::codegen::http::uri::PathAndQuery::from_str(method) {
            Ok(p) if method.starts_with('/') && method.len() > 1 => p,
            _ => {
                return Err(GrpcError::Denied(format!(
                    "method {method:?} is not a gRPC method path like /package.Service/Method"
                )));
            }
        };
        Ok((endpoint, path))
    }

    /// One unary call, bounded by `timeout`, by the plugin call's deadline
    /// (`Err`: it passed) and by `memory` (the reply may not exceed it).
    pub fn unary(
        &self,
        name: &str,
        method: &str,
        request: Vec<u8>,
        timeout: Duration,
        memory: &Arc<HostMemory>,
        channels: &InstanceChannels,
    ) -> Result<Result<Vec<u8>, GrpcError>, HostDeadline> {
        let (endpoint, path) = match self.endpoint(name, method) {
            Ok(found) => found,
            Err(e) => return Ok(Err(e)),
        };
        let _held = match memory.reserve("the gRPC request", request.len() as u64) {
            Ok(held) => held,
            Err(over) => return Ok(Err(status(name, &endpoint.address, Status::resource_exhausted(over.to_string())))),
        };
        let timeout = timeout.min(MAX_TIMEOUT);
        let max_reply = MAX_MESSAGE.min(usize::try_from(memory.free()).unwrap_or(usize::MAX));
        let mut grpc = tonic::client::Grpc::new(channels.get(name, endpoint)).max_decoding_message_size(max_reply);
        let google = endpoint.google.as_deref();
        let call = async move {
            // Held for a second sending only where one may happen.
            let copy = google.map(|_| request.clone());
            let (first, auth) = unary_once(&mut grpc, name, endpoint, &path, request, timeout).await;
            match (first, google, copy) {
                (Err(s), Some(g), Some(copy)) if s.code() == Code::Unauthenticated => {
                    if !renewed(g, auth.as_ref()).await {
                        return Err(s);
                    }
                    // The refused call was not applied: send it once more,
                    // with the renewed token.
                    tracing::debug!("endpoint `{name}`: token refused; renewed, sending the call again");
                    unary_once(&mut grpc, name, endpoint, &path, copy, timeout).await.0
                }
                (result, _, _) => result,
            }
        };
        const UNARY: &str = "sluice:connector/grpc.unary";
        let result = super::block_on(UNARY, async {
            match tokio::time::timeout(timeout, call).await {
                Ok(r) => r,
                Err(_) => Err(Status::deadline_exceeded(format!("no reply within {} ms", timeout.as_millis()))),
            }
        })?;
        if result.is_err() {
            // A transport timeout racing the deadline is the deadline.
            CallDeadline::check(UNARY)?;
        }
        Ok(result.map(tonic::Response::into_inner).map_err(|s| status(name, &endpoint.address, s)))
    }

    /// Starts a bidirectional streaming call; the messages queued for it are
    /// held against `memory`.
    pub fn open_stream(
        &self,
        name: &str,
        method: &str,
        memory: &Arc<HostMemory>,
        channels: &InstanceChannels,
    ) -> Result<BidiStream, GrpcError> {
        use tokio_stream::StreamExt;
        let (endpoint, path) = self.endpoint(name, method)?;
        let (req_tx, req_rx) = mpsc::channel::<Queued>(8);
        let (resp_tx, resp_rx) = mpsc::channel::<Result<Queued, Status>>(64);
        let max_reply = MAX_MESSAGE.min(usize::try_from(memory.limit()).unwrap_or(usize::MAX));
        let mut grpc = tonic::client::Grpc::new(channels.get(name, endpoint)).max_decoding_message_size(max_reply);
        // A request's reservation ends when the call takes it from the queue.
        let requests = ReceiverStream::new(req_rx).map(|(message, _held)| message);
        let mut req = tonic::Request::new(requests);
        let memory = memory.clone();
        let fixed = endpoint.authorization.clone();
        let google = endpoint.google.clone();
        let endpoint_name = name.to_string();
        // The call runs on the host runtime; the guest talks to it through the
        // two queues. A server may withhold its response headers until it has
        // read a request, so the call must not be awaited before the first send.
        super::runtime().spawn(async move {
            let auth = match authorization(&endpoint_name, fixed.as_ref(), google.as_deref()).await {
                Ok(auth) => auth,
                Err(s) => {
                    let _ = resp_tx.send(Err(s)).await;
                    return;
                }
            };
            if let Some(auth) = &auth {
                req.metadata_mut().insert("authorization", auth.clone());
            }
            // A token refused and then renewed: the plugin opens the
            // stream again and resends (see the module's invariants).
            let refused = async |s: Status| -> Status {
                if s.code() != Code::Unauthenticated {
                    return s;
                }
                match &google {
                    Some(g) if renewed(g, auth.as_ref()).await => Status::unavailable(format!(
                        "endpoint `{endpoint_name}`: the Google token was refused ({}); the host renewed it: \
                         open the stream again",
                        s.message()
                    )),
                    _ => s,
                }
            };
            if let Err(e) = grpc.ready().await {
                let _ = resp_tx.send(Err(Status::unavailable(format!("endpoint not ready: {e}")))).await;
                return;
            }
            match grpc.streaming(req, path, RawCodec).await {
                Err(status) => {
                    let _ = resp_tx.send(Err(refused(status).await)).await;
                }
                Ok(response) => {
                    let mut messages = response.into_inner();
                    loop {
                        match messages.message().await {
                            Ok(Some(m)) => {
                                let held = match memory.reserve("a queued gRPC reply", m.len() as u64) {
                                    Ok(held) => held,
                                    Err(over) => {
                                        let _ = resp_tx.send(Err(Status::resource_exhausted(over.to_string()))).await;
                                        break;
                                    }
                                };
                                if resp_tx.send(Ok((m, held))).await.is_err() {
                                    break;
                                }
                            }
                            // Dropping `resp_tx` tells the guest the call ended with OK.
                            Ok(None) => break,
                            Err(status) => {
                                let _ = resp_tx.send(Err(refused(status).await)).await;
                                break;
                            }
                        }
                    }
                }
            }
        });
        Ok(BidiStream {
            endpoint: name.to_string(),
            address: endpoint.address.clone(),
            requests: Some(req_tx),
            replies: resp_rx,
            _slot: None,
        })
    }
}

/// One sending of a unary call, and the `authorization` it carried.
async fn unary_once(
    grpc: &mut tonic::client::Grpc<Channel>,
    name: &str,
    endpoint: &GrantedEndpoint,
    path: &tonic::codegen::http::uri::PathAndQuery,
    request: Vec<u8>,
    timeout: Duration,
) -> (Result<tonic::Response<Vec<u8>>, Status>, Option<AsciiMetadataValue>) {
    let auth = match authorization(name, endpoint.authorization.as_ref(), endpoint.google.as_deref()).await {
        Ok(auth) => auth,
        Err(s) => return (Err(s), None),
    };
    let mut req = tonic::Request::new(request);
    // The server is told the plugin's timeout; the call's own deadline
    // is the host's to enforce (in `unary`), so that its passing is told
    // apart from the server's or the transport's timeout.
    req.set_timeout(timeout);
    if let Some(auth) = &auth {
        req.metadata_mut().insert("authorization", auth.clone());
    }
    if let Err(e) = grpc.ready().await {
        return (Err(Status::unavailable(format!("endpoint not ready: {e}"))), auth);
    }
    (grpc.unary(req, path.clone(), RawCodec).await, auth)
}

fn status(endpoint: &str, address: &str, s: Status) -> GrpcError {
    let code = s.code();
    let mut message = s.message().to_string();
    // Transport errors keep their cause (refused, reset, DNS) in the source chain.
    let mut source = std::error::Error::source(&s);
    while let Some(e) = source {
        let text = e.to_string();
        if !message.contains(&text) {
            message = format!("{message}: {text}");
        }
        source = e.source();
    }
    if matches!(code, Code::Unavailable | Code::DeadlineExceeded | Code::Unknown) && !message.contains("endpoint `") {
        // Transport errors arrive without naming where they went.
        message = format!("endpoint `{endpoint}` ({address}): {message}");
    }
    GrpcError::Status(wit::Status { code: code as i32 as u32, message, details: s.details().to_vec() })
}

/// A message in a stream's queue, with the host memory it holds.
type Queued = (Vec<u8>, Reservation);

/// One streaming call of a plugin instance (the `bidi-stream` resource).
pub struct BidiStream {
    endpoint: String,
    address: String,
    requests: Option<mpsc::Sender<Queued>>,
    replies: mpsc::Receiver<Result<Queued, Status>>,
    /// Counts the stream against `sink.sandbox.max_grpc_streams` until dropped.
    _slot: Option<HandleSlot>,
}

impl BidiStream {
    fn send(&mut self, message: Vec<u8>, memory: &Arc<HostMemory>) -> Result<Result<(), GrpcError>, HostDeadline> {
        let Some(tx) = &self.requests else {
            return Ok(Err(status(
                &self.endpoint,
                &self.address,
                Status::failed_precondition("the stream has already ended"),
            )));
        };
        let held = match memory.reserve("a queued gRPC request", message.len() as u64) {
            Ok(held) => held,
            Err(over) => {
                return Ok(Err(status(&self.endpoint, &self.address, Status::resource_exhausted(over.to_string()))));
            }
        };
        // A free slot takes the message at once; only a full queue waits
        // (on the I/O runtime, no later than the call's deadline) for the
        // call to take one.
        let sent = match tx.try_send((message, held)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(queued)) => {
                super::block_on("sluice:connector/grpc.[method]bidi-stream.send", tx.send(queued))?.is_ok()
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        };
        if sent {
            return Ok(Ok(()));
        }
        // The call is over: report how it ended.
        self.requests = None;
        Ok(match self.replies.try_recv() {
            Ok(Err(s)) => Err(status(&self.endpoint, &self.address, s)),
            _ => Err(status(
                &self.endpoint,
                &self.address,
                Status::unavailable("the stream ended before the message was sent"),
            )),
        })
    }

    fn receive(&mut self, timeout: Duration) -> Result<Result<Received, GrpcError>, HostDeadline> {
        let timeout = timeout.min(MAX_TIMEOUT);
        // A reply already queued (or a poll that finds none) needs neither
        // the runtime nor a timer.
        let next = match self.replies.try_recv() {
            Ok(reply) => Some(reply),
            Err(mpsc::error::TryRecvError::Disconnected) => None,
            Err(mpsc::error::TryRecvError::Empty) if timeout.is_zero() => return Ok(Ok(Received::Pending)),
            Err(mpsc::error::TryRecvError::Empty) => {
                let replies = &mut self.replies;
                // The timer must be made inside the runtime.
                let wait = async move { tokio::time::timeout(timeout, replies.recv()).await };
                match super::block_on("sluice:connector/grpc.[method]bidi-stream.receive", wait)? {
                    Err(_) => return Ok(Ok(Received::Pending)),
                    Ok(next) => next,
                }
            }
        };
        Ok(match next {
            None => Ok(Received::Ended),
            // The reply's reservation ends as it moves into the plugin.
            Some(Ok((m, _held))) => Ok(Received::Message(m)),
            Some(Err(s)) => {
                self.requests = None;
                Err(status(&self.endpoint, &self.address, s))
            }
        })
    }
}

/// Passes message bytes through untouched: the plugin owns the encoding.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

fn no_grpc() -> GrpcError {
    GrpcError::Denied("this sink has no gRPC endpoints: name them in the job file's [sink.grpc.<name>]".to_string())
}

/// One instance's endpoints: the run's grant, its calls in flight and its
/// host-memory budget.
pub struct GrpcCtx {
    pub grpc: Arc<GrpcGrant>,
    pub calls: HandleCap,
    pub memory: Arc<HostMemory>,
    pub channels: InstanceChannels,
    /// The instance's deferred syncs, settled before any call goes out.
    pub syncs: Arc<Syncs>,
}

/// One instance's connections, one per endpoint it has called; a
/// connection that breaks reconnects on the next call (tonic's `Channel`).
#[derive(Default)]
pub struct InstanceChannels(std::sync::Mutex<BTreeMap<String, Channel>>);

impl InstanceChannels {
    fn get(&self, name: &str, endpoint: &GrantedEndpoint) -> Channel {
        // A poisoned lock still holds valid channels.
        let mut open = self.0.lock().unwrap_or_else(|p| p.into_inner());
        open.entry(name.to_string())
            .or_insert_with(|| {
                // `connect_lazy` spawns the channel's worker: it needs the runtime.
                let _guard = super::runtime().enter();
                endpoint.connect.connect_lazy()
            })
            .clone()
    }
}

fn too_many(e: super::limits::TooMany) -> GrpcError {
    GrpcError::Status(wit::Status {
        code: Code::ResourceExhausted as i32 as u32,
        message: e.to_string(),
        details: Vec::new(),
    })
}

/// What the `grpc` interface is linked through: the endpoints, the resource
/// table (streams) and the side-effect hook.
pub struct GrpcView<'a> {
    pub ctx: &'a GrpcCtx,
    pub table: &'a mut ResourceTable,
    pub effects: &'a mut Effects,
}

/// The `grpc` capability for wasmtime's linker.
pub struct Grpc;

impl HasData for Grpc {
    type Data<'a> = GrpcView<'a>;
}

/// The view of a store's data.
pub(super) fn view<T: CapabilityHost>(t: &mut T) -> GrpcView<'_> {
    let (caps, table) = t.capabilities();
    GrpcView { ctx: &caps.grpc, table, effects: &mut caps.effects }
}

pub(super) fn add_to_linker<T: CapabilityHost>(linker: &mut Linker<T>) -> wasmtime::Result<()> {
    wit::add_to_linker::<T, Grpc>(linker, view::<T>)
}

impl wit::Host for GrpcView<'_> {
    fn unary(
        &mut self,
        endpoint: String,
        method: String,
        request: Vec<u8>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Vec<u8>, GrpcError>> {
        if self.ctx.grpc.is_empty() {
            return Ok(Err(no_grpc()));
        }
        self.ctx.syncs.before_publishing()?;
        let _slot = match self.ctx.calls.take() {
            Ok(slot) => slot,
            Err(e) => return Ok(Err(too_many(e))),
        };
        let timeout = Duration::from_millis(u64::from(timeout_ms));
        let result = self.ctx.grpc.unary(&endpoint, &method, request, timeout, &self.ctx.memory, &self.ctx.channels)?;
        if result.is_ok() {
            // A crash "during commit" happens right after the call's effect.
            self.effects.done()?;
        }
        Ok(result)
    }
}

impl wit::HostBidiStream for GrpcView<'_> {
    fn open(&mut self, endpoint: String, method: String) -> wasmtime::Result<Result<Resource<BidiStream>, GrpcError>> {
        if self.ctx.grpc.is_empty() {
            return Ok(Err(no_grpc()));
        }
        self.ctx.syncs.before_publishing()?;
        let slot = match self.ctx.calls.take() {
            Ok(slot) => slot,
            Err(e) => return Ok(Err(too_many(e))),
        };
        match self.ctx.grpc.open_stream(&endpoint, &method, &self.ctx.memory, &self.ctx.channels) {
            Ok(mut stream) => {
                stream._slot = Some(slot);
                Ok(Ok(self.table.push(stream)?))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn send(&mut self, stream: Resource<BidiStream>, message: Vec<u8>) -> wasmtime::Result<Result<(), GrpcError>> {
        self.ctx.syncs.before_publishing()?;
        let memory = self.ctx.memory.clone();
        Ok(self.table.get_mut(&stream)?.send(message, &memory)?)
    }

    fn receive(
        &mut self,
        stream: Resource<BidiStream>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Received, GrpcError>> {
        Ok(self.table.get_mut(&stream)?.receive(Duration::from_millis(u64::from(timeout_ms)))?)
    }

    fn drop(&mut self, stream: Resource<BidiStream>) -> wasmtime::Result<()> {
        self.table.delete(stream)?;
        Ok(())
    }
}
