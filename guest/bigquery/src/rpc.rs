//! Storage Write API calls over the host's `grpc` capability, and the reading
//! of their errors.
//!
//! An error is judged by the gRPC status code **and** the `StorageError` in
//! the status details (`google.rpc.Status.details`), never by a client
//! library's exception type: `ALREADY_EXISTS` or `OFFSET_ALREADY_EXISTS`
//! means the rows at that offset are already in the stream; `OUT_OF_RANGE`
//! or `OFFSET_OUT_OF_RANGE` means the writer and the stream disagree.

use googleapis_tonic_google_cloud_bigquery_storage_v1::google::cloud::bigquery::storage::v1::{
    StorageError, storage_error::StorageErrorCode,
};
use googleapis_tonic_google_rpc::google::rpc::{Code, Status as RpcStatus};
use prost::Message;
use sluice_guest_sdk::bindings::sluice::connector::grpc::{self, GrpcError};

pub(crate) const SERVICE: &str = "/google.cloud.bigquery.storage.v1.BigQueryWrite/";

/// gRPC status codes this sink acts on.
pub(crate) mod code {
    pub const CANCELLED: u32 = 1;
    pub const UNKNOWN: u32 = 2;
    pub const DEADLINE_EXCEEDED: u32 = 4;
    pub const NOT_FOUND: u32 = 5;
    pub const ALREADY_EXISTS: u32 = 6;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const ABORTED: u32 = 10;
    pub const OUT_OF_RANGE: u32 = 11;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
}

/// What a failed call means for the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The rows at this offset are already in the stream.
    AlreadyExists(String),
    /// The offset is past the end of the stream: state and stream disagree.
    OutOfRange(String),
    /// Transient: the same request may be sent again.
    Transient(String),
    /// Anything else (bad request, missing table, denied, ...).
    Permanent(String),
}

impl Failure {
    pub fn message(&self) -> &str {
        match self {
            Self::AlreadyExists(m) | Self::OutOfRange(m) | Self::Transient(m) | Self::Permanent(m) => m,
        }
    }
}

/// The name of a gRPC status code (`google.rpc.Code`), e.g. `OUT_OF_RANGE`.
fn code_name(code: u32) -> &'static str {
    i32::try_from(code).ok().and_then(|c| Code::try_from(c).ok()).map_or("UNRECOGNIZED", |c| c.as_str_name())
}

/// The `StorageError` among a status's details, if any.
pub(crate) fn storage_error(status: &RpcStatus) -> Option<StorageError> {
    status
        .details
        .iter()
        .find(|d| d.type_url.ends_with("google.cloud.bigquery.storage.v1.StorageError"))
        .and_then(|d| StorageError::decode(d.value.as_slice()).ok())
}

/// Classifies a status by its code and its `StorageError` detail.
pub(crate) fn classify(code: u32, message: &str, detail: Option<&StorageError>) -> Failure {
    let storage = detail.and_then(|s| StorageErrorCode::try_from(s.code).ok());
    let text = match (storage, detail) {
        (Some(c), Some(d)) if c != StorageErrorCode::Unspecified => {
            format!(
                "{} ({}{}): {message}",
                code_name(code),
                c.as_str_name(),
                if d.entity.is_empty() { String::new() } else { format!(" on {}", d.entity) }
            )
        }
        _ => format!("{}: {message}", code_name(code)),
    };
    if code == code::ALREADY_EXISTS || storage == Some(StorageErrorCode::OffsetAlreadyExists) {
        return Failure::AlreadyExists(text);
    }
    if code == code::OUT_OF_RANGE || storage == Some(StorageErrorCode::OffsetOutOfRange) {
        return Failure::OutOfRange(text);
    }
    match code {
        code::UNAVAILABLE
        | code::INTERNAL
        | code::DEADLINE_EXCEEDED
        | code::RESOURCE_EXHAUSTED
        | code::ABORTED
        | code::UNKNOWN
        | code::CANCELLED => Failure::Transient(text),
        _ => Failure::Permanent(text),
    }
}

/// What a failed FlushRows means for the checkpoint being committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FlushFailure {
    /// The stream is flushed at or past the offset already. Services answer
    /// this differently (the reference is silent): `ALREADY_EXISTS` or an
    /// `OFFSET_ALREADY_EXISTS` detail (Apache Beam's reading), or
    /// `OUT_OF_RANGE` worded "already flushed".
    AlreadyFlushed(String),
    /// The offset lies beyond the end of the stream ("Offset N is beyond the
    /// end of the stream"): the checkpoint names rows the stream lacks.
    BeyondEnd(String),
    /// The stream is gone (`NOT_FOUND`, `STREAM_NOT_FOUND`) or refuses
    /// flushes (`STREAM_FINALIZED`).
    StreamGone(String),
    /// Transient: the flush may be tried again.
    Transient(String),
    Permanent(String),
}

/// Whether a message says the offset was flushed before.
fn says_already_flushed(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("already flushed") || m.contains("already been flushed")
}

/// Classifies a failed FlushRows: the `StorageError` detail first, then the
/// status code, and for an out-of-range offset the message, the only thing
/// that tells "already flushed" from "beyond the end" where both carry
/// `OUT_OF_RANGE` / `OFFSET_OUT_OF_RANGE`.
pub(crate) fn classify_flush(e: GrpcError) -> FlushFailure {
    let s = match e {
        GrpcError::Denied(m) => return FlushFailure::Permanent(format!("denied by the host: {m}")),
        GrpcError::Status(s) => s,
    };
    let rpc = RpcStatus::decode(s.details.as_slice()).ok();
    let detail = rpc.as_ref().and_then(storage_error);
    let storage = detail.as_ref().and_then(|d| StorageErrorCode::try_from(d.code).ok());
    let text = match (storage, &detail) {
        (Some(c), Some(_)) if c != StorageErrorCode::Unspecified => {
            format!("{} ({}): {}", code_name(s.code), c.as_str_name(), s.message)
        }
        _ => format!("{}: {}", code_name(s.code), s.message),
    };
    match storage {
        Some(StorageErrorCode::OffsetAlreadyExists) => return FlushFailure::AlreadyFlushed(text),
        Some(StorageErrorCode::StreamNotFound | StorageErrorCode::StreamFinalized) => {
            return FlushFailure::StreamGone(text);
        }
        Some(StorageErrorCode::OffsetOutOfRange) => {
            return if says_already_flushed(&s.message) {
                FlushFailure::AlreadyFlushed(text)
            } else {
                FlushFailure::BeyondEnd(text)
            };
        }
        _ => {}
    }
    match s.code {
        code::ALREADY_EXISTS => FlushFailure::AlreadyFlushed(text),
        code::OUT_OF_RANGE if says_already_flushed(&s.message) => FlushFailure::AlreadyFlushed(text),
        code::OUT_OF_RANGE => FlushFailure::BeyondEnd(text),
        code::NOT_FOUND => FlushFailure::StreamGone(text),
        _ => match classify(s.code, &s.message, detail.as_ref()) {
            Failure::Transient(_) => FlushFailure::Transient(text),
            _ => FlushFailure::Permanent(text),
        },
    }
}

/// Classifies a failed host call.
pub(crate) fn from_grpc(e: GrpcError) -> Failure {
    match e {
        GrpcError::Denied(m) => Failure::Permanent(format!("denied by the host: {m}")),
        GrpcError::Status(s) => {
            let rpc = RpcStatus::decode(s.details.as_slice()).ok();
            let detail = rpc.as_ref().and_then(storage_error);
            classify(s.code, &s.message, detail.as_ref())
        }
    }
}

/// Classifies an in-band `google.rpc.Status` (AppendRowsResponse.error).
pub(crate) fn from_rpc_status(s: &RpcStatus) -> Failure {
    classify(s.code as u32, &s.message, storage_error(s).as_ref())
}

/// A unary call with prost messages, returning the host's error as it came.
pub(crate) fn unary_raw<Req: Message, Resp: Message + Default>(
    endpoint: &str,
    method: &str,
    request: &Req,
    timeout_ms: u32,
) -> Result<Resp, GrpcError> {
    let bytes = grpc::unary(endpoint, &format!("{SERVICE}{method}"), &request.encode_to_vec(), timeout_ms)?;
    Resp::decode(bytes.as_slice()).map_err(|e| {
        GrpcError::Status(grpc::Status {
            code: code::INTERNAL,
            message: format!("{method}: the reply is not a valid message: {e}"),
            details: Vec::new(),
        })
    })
}

/// A unary call with prost messages.
pub(crate) fn unary<Req: Message, Resp: Message + Default>(
    endpoint: &str,
    method: &str,
    request: &Req,
    timeout_ms: u32,
) -> Result<Resp, Failure> {
    let bytes = grpc::unary(endpoint, &format!("{SERVICE}{method}"), &request.encode_to_vec(), timeout_ms)
        .map_err(from_grpc)?;
    Resp::decode(bytes.as_slice())
        .map_err(|e| Failure::Permanent(format!("{method}: the reply is not a valid message: {e}")))
}
