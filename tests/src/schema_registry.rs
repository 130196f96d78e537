//! A Confluent Schema Registry double, on 127.0.0.1, serving the part of
//! its REST API that Kafka producers and Sluice use, as documented at
//! <https://docs.confluent.io/platform/current/schema-registry/develop/api.html>:
//!
//! - `POST /subjects/{subject}/versions` with `{"schema": "<schema JSON as
//!   a string>"}` (and optionally `"schemaType": "AVRO"`) registers the
//!   schema under the subject and answers `{"id": N}`. Ids are global: a
//!   schema registered before (under any subject) keeps its id, and one
//!   already in the subject makes no new version. A schema that is not
//!   JSON is `422` `{"error_code": 42201, "message": "Invalid schema"}`;
//!   another `schemaType` than AVRO is `422` error code 42201 too (the
//!   double keeps Avro only);
//! - `GET /schemas/ids/{id}` answers `{"schema": "<schema string>"}`, or
//!   `404` `{"error_code": 40403, "message": "Schema not found"}`;
//! - `GET /subjects/{subject}/versions/latest` (or `/versions/{n}`)
//!   answers `{"subject", "version", "id", "schema"}`, or `404` with
//!   `{"error_code": 40401, "message": "Subject not found"}` (no such
//!   subject) or `{"error_code": 40402, "message": "Version not found"}`.
//!
//! Answers carry `Content-Type: application/vnd.schemaregistry.v1+json`.
//! The double counts the GETs of each id, so a test can see that a client
//! caches what it fetched.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// The registry's media type.
pub const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

#[derive(Default)]
struct Registry {
    /// id → (schema text, parsed): ids from 1.
    schemas: Vec<(String, Value)>,
    /// subject → the ids of its versions, version 1 first.
    subjects: BTreeMap<String, Vec<u32>>,
    /// id → GETs of `/schemas/ids/{id}`.
    id_gets: BTreeMap<u32, u64>,
}

fn lock(m: &Mutex<Registry>) -> MutexGuard<'_, Registry> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Registry {
    fn register(&mut self, subject: &str, text: &str, parsed: Value) -> u32 {
        let id = match self.schemas.iter().position(|(_, v)| *v == parsed) {
            Some(i) => i as u32 + 1,
            None => {
                self.schemas.push((text.to_string(), parsed));
                self.schemas.len() as u32
            }
        };
        let versions = self.subjects.entry(subject.to_string()).or_default();
        if !versions.contains(&id) {
            versions.push(id);
        }
        id
    }
}

fn answer(status: StatusCode, body: Value) -> Response {
    (status, [(header::CONTENT_TYPE, CONTENT_TYPE)], body.to_string()).into_response()
}

fn error(status: StatusCode, code: u32, message: &str) -> Response {
    answer(status, json!({"error_code": code, "message": message}))
}

async fn register(
    State(reg): State<Arc<Mutex<Registry>>>,
    Path(subject): Path<String>,
    Json(body): Json<Value>,
) -> Response {
    let Some(text) = body.get("schema").and_then(Value::as_str) else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, 42201, "Invalid schema");
    };
    if body.get("schemaType").and_then(Value::as_str).is_some_and(|t| t != "AVRO") {
        return error(StatusCode::UNPROCESSABLE_ENTITY, 42201, "Invalid schema");
    }
    let Ok(parsed) = serde_json::from_str::<Value>(text) else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, 42201, "Invalid schema");
    };
    let id = lock(&reg).register(&subject, text, parsed);
    answer(StatusCode::OK, json!({"id": id}))
}

async fn by_id(State(reg): State<Arc<Mutex<Registry>>>, Path(id): Path<u32>) -> Response {
    let mut reg = lock(&reg);
    *reg.id_gets.entry(id).or_default() += 1;
    match id.checked_sub(1).and_then(|i| reg.schemas.get(i as usize)) {
        Some((text, _)) => answer(StatusCode::OK, json!({"schema": text})),
        None => error(StatusCode::NOT_FOUND, 40403, "Schema not found"),
    }
}

async fn version(
    State(reg): State<Arc<Mutex<Registry>>>,
    Path((subject, version)): Path<(String, String)>,
) -> Response {
    let reg = lock(&reg);
    let Some(versions) = reg.subjects.get(&subject) else {
        return error(StatusCode::NOT_FOUND, 40401, "Subject not found");
    };
    let n = match version.as_str() {
        "latest" | "-1" => versions.len(),
        v => match v.parse::<usize>() {
            Ok(n) if (1..=versions.len()).contains(&n) => n,
            _ => return error(StatusCode::NOT_FOUND, 40402, "Version not found"),
        },
    };
    let id = versions[n - 1];
    let text = &reg.schemas[id as usize - 1].0;
    answer(StatusCode::OK, json!({"subject": subject, "version": n, "id": id, "schema": text}))
}

/// The registry, serving until dropped.
pub struct SchemaRegistry {
    registry: Arc<Mutex<Registry>>,
    addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SchemaRegistry {
    /// Starts on a free port.
    pub fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let registry = Arc::new(Mutex::new(Registry::default()));
        let app = axum::Router::new()
            .route("/subjects/{subject}/versions", post(register))
            .route("/subjects/{subject}/versions/{version}", get(version))
            .route("/schemas/ids/{id}", get(by_id))
            .with_state(registry.clone());
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
        Ok(Self { registry, addr, shutdown: Some(tx), thread: Some(thread) })
    }

    /// `http://127.0.0.1:PORT`, a job's `schema_registry`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Registers `schema` under `subject` as a producer's serializer does
    /// (without HTTP); its id.
    pub fn register(&self, subject: &str, schema: &str) -> u32 {
        let parsed: Value = serde_json::from_str(schema).expect("an Avro schema is JSON");
        lock(&self.registry).register(subject, schema, parsed)
    }

    /// GETs of `/schemas/ids/{id}` so far.
    pub fn gets_of(&self, id: u32) -> u64 {
        lock(&self.registry).id_gets.get(&id).copied().unwrap_or(0)
    }
}

impl Drop for SchemaRegistry {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Avro binary encoding, by the specification
/// (<https://avro.apache.org/docs/1.11.1/specification/#binary-encoding>),
/// for test messages: written here rather than by an Avro crate, so that
/// the host's decoder is checked against an encoder it shares no code with.
pub mod avro {
    /// A `long` (or `int`): zig-zag, then a variable-length base-128 integer.
    pub fn long(out: &mut Vec<u8>, n: i64) {
        let mut z = ((n << 1) ^ (n >> 63)) as u64;
        while z >= 0x80 {
            out.push((z as u8 & 0x7f) | 0x80);
            z >>= 7;
        }
        out.push(z as u8);
    }

    /// A `string` (or `bytes`): its length, then its bytes.
    pub fn string(out: &mut Vec<u8>, s: &str) {
        long(out, s.len() as i64);
        out.extend_from_slice(s.as_bytes());
    }

    /// A `double`: 8 bytes, little-endian.
    pub fn double(out: &mut Vec<u8>, d: f64) {
        out.extend_from_slice(&d.to_le_bytes());
    }

    /// The Confluent wire format: magic byte 0, the schema id (4 bytes,
    /// big-endian), the datum.
    pub fn framed(id: u32, datum: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&id.to_be_bytes());
        out.extend_from_slice(datum);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_global_and_versions_per_subject() {
        let mut r = Registry::default();
        let a = json!({"type": "string"});
        let b = json!({"type": "long"});
        assert_eq!(r.register("x-value", "a", a.clone()), 1);
        assert_eq!(r.register("x-value", "a", a.clone()), 1);
        assert_eq!(r.register("y-value", "a", a), 1);
        assert_eq!(r.register("x-value", "b", b), 2);
        assert_eq!(r.subjects["x-value"], vec![1, 2]);
        assert_eq!(r.subjects["y-value"], vec![1]);
    }
}
