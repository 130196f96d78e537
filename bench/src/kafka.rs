//! A real Kafka broker for the tests and the benchmark: tansu (crates.io `tansu`, Apache-2.0, a
//! broker that speaks the Kafka protocol), pinned to 0.6.0 with its
//! `dynostore` feature and its in-memory storage, installed by `tests/run`
//! (`cargo install tansu --version 0.6.0 --locked --features dynostore`).
//! Test data is produced and topics are made with rdkafka, a standard client.
//!
//! Invariants:
//! - the broker listens on 127.0.0.1 only, at a port picked free for it, and
//!   dies with its handle (and with the test process: it is killed on drop,
//!   and started in the test's process group);
//! - a missing broker binary fails the test loudly, saying how to install
//!   it: a test that needs Kafka never skips;
//! - the tests never rely on tansu 0.6's ListOffsets answer for the latest
//!   offset, which is the base offset of the last batch, not the end (see
//!   the Kafka source's bounded mode, which reads on until caught up).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

const INSTALL_HINT: &str = "the Kafka tests need the tansu broker: `cargo install tansu --version 0.6.0 --locked \
     --features dynostore --root /var/tmp/sluice-tools/tansu-0.6.0` (what tests/run does), or set SLUICE_TANSU to its path";

/// Where the tansu binary is: `SLUICE_TANSU`, else where `tests/run` installs
/// it, else `tansu` on PATH.
fn tansu_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("SLUICE_TANSU") {
        return PathBuf::from(p);
    }
    let installed = PathBuf::from("/var/tmp/sluice-tools/tansu-0.6.0/bin/tansu");
    if installed.is_file() {
        return installed;
    }
    PathBuf::from("tansu")
}

/// Runs an admin request to its end.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime").block_on(f)
}

fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    l.local_addr().expect("local address").port()
}

/// A running broker.
pub struct Broker {
    child: Child,
    pub port: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Broker {
    pub fn start() -> Self {
        Self::start_as("tansu_cluster")
    }

    /// A broker of the cluster `cluster_id` (tansu's default is `tansu_cluster`).
    pub fn start_as(cluster_id: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("tansu.log");
        let port = free_port();
        let url = format!("tcp://127.0.0.1:{port}");
        let logfile = std::fs::File::create(&log).expect("broker log");
        let child = Command::new(tansu_bin())
            .args([
                "broker",
                "--cluster-id",
                cluster_id,
                "--storage-engine",
                "memory://tansu/",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(logfile.try_clone().expect("log"))
            .stderr(logfile)
            .spawn()
            .unwrap_or_else(|e| panic!("starting tansu ({}): {e}; {INSTALL_HINT}", tansu_bin().display()));
        let broker = Self { child, port, log, _dir: dir };
        broker.wait_ready();
        broker
    }

    fn wait_ready(&self) {
        let start = Instant::now();
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "tansu did not listen within 30 s: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn bootstrap(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap());
        c
    }

    fn admin(&self) -> AdminClient<DefaultClientContext> {
        self.config().create().expect("admin client")
    }

    /// Makes `topic` with `partitions` partitions.
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        let admin = self.admin();
        let results = block_on(admin.create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        ))
        .expect("create_topics");
        for r in results {
            r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e:?}"));
        }
    }

    pub fn producer(&self) -> BaseProducer {
        self.config().set("linger.ms", "5").create().expect("producer")
    }

    /// Produces `messages` (partition, key, value) to `topic` and waits
    /// until the broker acknowledged all of them.
    pub fn produce(&self, topic: &str, messages: &[(i32, String, Vec<u8>)]) {
        let producer = self.producer();
        for (p, key, value) in messages {
            let mut record = BaseRecord::to(topic).partition(*p).key(key.as_bytes()).payload(value.as_slice());
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((e, r)) => {
                        // The local queue is full: serve deliveries, then again.
                        assert!(
                            matches!(
                                e,
                                rdkafka::error::KafkaError::MessageProduction(
                                    rdkafka::types::RDKafkaErrorCode::QueueFull
                                )
                            ),
                            "producing to {topic}: {e}"
                        );
                        producer.poll(Duration::from_millis(10));
                        record = r;
                    }
                }
            }
            producer.poll(Duration::ZERO);
        }
        producer.flush(Duration::from_secs(30)).unwrap_or_else(|e| panic!("flushing to {topic}: {e}"));
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The JSON message of order `id`, and its partition among `partitions`.
pub fn order(id: i64, partitions: i32) -> (i32, String, Vec<u8>) {
    let value = serde_json::json!({ "id": id, "name": format!("order-{id}"), "amount": id as f64 * 0.25 });
    ((id % i64::from(partitions)) as i32, format!("k{id}"), value.to_string().into_bytes())
}

/// Orders `from..to`.
pub fn orders(from: i64, to: i64, partitions: i32) -> Vec<(i32, String, Vec<u8>)> {
    (from..to).map(|id| order(id, partitions)).collect()
}

/// The `[source]` columns of [`order`] messages.
pub const ORDER_COLUMNS: &str = r#"columns = [
  { name = "id", type = "long", nullable = false },
  { name = "name", type = "string" },
  { name = "amount", type = "double" },
]"#;
