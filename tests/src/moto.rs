//! A real S3 server for tests: moto's server (PyPI `moto[server]`, pinned in
//! `tests/requirements.txt`), started on 127.0.0.1 at a port the operating
//! system picks, from the tests' Python.
//!
//! Invariants:
//! - it listens on the loopback address only, and nothing but the test that
//!   started it talks to it;
//! - it stops when its [`Moto`] is dropped, and also when the test process
//!   dies: it lives only as long as its standard input is open;
//! - a missing moto fails the test loudly, saying how to install it: a test
//!   that needs the server never skips.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

/// Starts moto's threaded server at port 0, creates the buckets named in
/// its arguments, prints the port it got, and serves until its standard
/// input closes.
const SERVE: &str = r#"
import sys
import boto3
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
port = server.get_host_and_port()[1]
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name=sys.argv[1],
                  aws_access_key_id=sys.argv[2], aws_secret_access_key=sys.argv[3])
for bucket in sys.argv[4:]:
    s3.create_bucket(Bucket=bucket)
print("PORT", port, flush=True)
sys.stdin.read()
server.stop()
"#;

/// How to get moto when it is missing.
pub const INSTALL_HINT: &str = "install the tests' Python packages: \
    `python3 -m pip install -r tests/requirements.txt` (moto[server]) into the python3 first on PATH \
    (.ci/run does this in /var/tmp/sluice-venv)";

/// The region and keys the server is set up with (moto checks no signature).
pub const REGION: &str = "us-east-1";
pub const ACCESS_KEY_ID: &str = "sluice-test";
pub const SECRET_ACCESS_KEY: &str = "sluice-test-secret";

/// A running moto server; stopped on drop.
pub struct Moto {
    child: Child,
    stdin: Option<ChildStdin>,
    /// `http://127.0.0.1:<port>`
    pub endpoint: String,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Moto {
    /// Starts a server holding the empty `buckets`. Panics, naming the fix,
    /// when moto is not installed or the server does not come up.
    pub fn start(buckets: &[&str]) -> Moto {
        let python = crate::python_interpreter();
        let check = Command::new(python).args(["-c", "import moto.server, flask, boto3"]).output();
        match check {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "moto's S3 server is not installed for {}: {}\n{INSTALL_HINT}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(e) => panic!("cannot run {}: {e}\n{INSTALL_HINT}", python.display()),
        }
        let dir = tempfile::tempdir().expect("temp dir for moto's log");
        let log = dir.path().join("moto.log");
        let log_file = std::fs::File::create(&log).expect("moto's log file");
        let mut child = Command::new(python)
            .args(["-c", SERVE, REGION, ACCESS_KEY_ID, SECRET_ACCESS_KEY])
            .args(buckets)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("starting moto's server with {}: {e}", python.display()));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("moto's stdout");
        let mut line = String::new();
        let read = BufReader::new(stdout).read_line(&mut line);
        let port = line.strip_prefix("PORT ").and_then(|p| p.trim().parse::<u16>().ok());
        let Some(port) = port else {
            let _ = child.kill();
            let _ = child.wait();
            let mut text = String::new();
            let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut text));
            panic!("moto's server did not start (read {read:?}, first line {line:?}):\n{text}\n{INSTALL_HINT}");
        };
        Moto { child, stdin, endpoint: format!("http://127.0.0.1:{port}"), log, _dir: dir }
    }

    /// What the server logged so far (one line a request), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        // Closing stdin ends the server; kill it if it does not go.
        drop(self.stdin.take());
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
