//! The metrics server: `GET /metrics` (the Prometheus text format, or
//! OpenMetrics when the scrape asks for it) and `GET /healthz` (200 while
//! the job commits within its maximum commit age, 503 with the reason in
//! the body otherwise), over plain HTTP/1.1 on one thread.
//!
//! Invariants:
//! - the server only reads the registry; a slow or broken client costs at
//!   most the read timeout and never reaches the engine;
//! - every answer closes its connection; a request is read up to 8 KiB;
//! - the address is bound before the run starts, so a taken or bad address
//!   fails the run before anything is written; dropping the server stops
//!   its thread.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Metrics;

/// How long a client may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of a request read (its line and headers).
const MAX_REQUEST: u64 = 8 * 1024;

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen for metrics on {addr} ({key}): {source}")]
    Bind {
        addr: SocketAddr,
        key: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the metrics server thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// A running metrics server; dropping it stops it.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` (port 0: any free port; [`MetricsServer::addr`]
    /// tells which) and serves `metrics`. `key` names where the address
    /// came from, for the error.
    pub fn start(addr: SocketAddr, key: &str, metrics: Metrics) -> Result<Self, ServeError> {
        let bind_error = |source| ServeError::Bind { addr, key: key.to_string(), source };
        let listener = TcpListener::bind(addr).map_err(bind_error)?;
        let bound = listener.local_addr().map_err(bind_error)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new()
            .name("sluice-metrics".into())
            .spawn(move || serve(&listener, &metrics, &stopping))
            .map_err(ServeError::Thread)?;
        Ok(Self { addr: bound, stop, thread: Some(thread) })
    }

    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept; a failed connect means it is not waiting.
        let wake = match self.addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => SocketAddr::from(([127, 0, 0, 1], a.port())),
            SocketAddr::V6(a) if a.ip().is_unspecified() => SocketAddr::from(([0u16, 0, 0, 0, 0, 0, 0, 1], a.port())),
            other => other,
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(listener: &TcpListener, metrics: &Metrics, stop: &AtomicBool) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match conn {
            Ok(stream) => {
                if let Err(e) = answer(stream, metrics) {
                    tracing::debug!(error = %e, "a metrics request failed");
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "accepting a metrics connection failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// The request's method, path and whether it accepts OpenMetrics.
fn read_request(stream: &TcpStream) -> std::io::Result<(String, String, bool)> {
    let mut reader = BufReader::new(stream.take(MAX_REQUEST));
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("");
    let path = target.split('?').next().unwrap_or("").to_string();
    let mut openmetrics = false;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.trim().eq_ignore_ascii_case("accept")
            && value.contains("application/openmetrics-text")
        {
            openmetrics = true;
        }
    }
    Ok((method, path, openmetrics))
}

fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    let (method, path, openmetrics) = read_request(&stream)?;
    let head = method == "HEAD";
    let (status, content_type, body) = match (method.as_str(), path.as_str()) {
        ("GET" | "HEAD", "/metrics") if openmetrics => ("200 OK", OPENMETRICS, metrics.openmetrics_text()),
        ("GET" | "HEAD", "/metrics") => ("200 OK", PROMETHEUS_TEXT, metrics.prometheus_text()),
        ("GET" | "HEAD", "/healthz") => match metrics.verdict() {
            Ok(ok) => ("200 OK", "text/plain; charset=utf-8", ok),
            Err(why) => ("503 Service Unavailable", "text/plain; charset=utf-8", why),
        },
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain; charset=utf-8", "try /metrics or /healthz\n".into()),
        _ => ("405 Method Not Allowed", "text/plain; charset=utf-8", "GET only\n".into()),
    };
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head {
        out.extend_from_slice(body.as_bytes());
    }
    stream.write_all(&out)?;
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).expect("connect");
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").expect("send");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    }

    #[test]
    fn serves_metrics_and_health_on_a_free_port() {
        let metrics = Metrics::new();
        metrics.start_run("j", Duration::from_secs(60), 64 << 20);
        let server =
            MetricsServer::start(SocketAddr::from(([127, 0, 0, 1], 0)), "--metrics-addr", metrics).expect("start");
        assert_ne!(server.addr().port(), 0);
        let scraped = get(server.addr(), "/metrics");
        assert!(scraped.starts_with("HTTP/1.1 200 OK\r\n"), "{scraped}");
        assert!(scraped.contains("sluice_writer_memory_limit_bytes 67108864"), "{scraped}");
        assert!(get(server.addr(), "/healthz").starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(get(server.addr(), "/nope").starts_with("HTTP/1.1 404"));
        let taken = MetricsServer::start(server.addr(), "job.metrics_addr", Metrics::new()).err().expect("taken");
        assert!(taken.to_string().contains("job.metrics_addr"), "{taken}");
    }
}
