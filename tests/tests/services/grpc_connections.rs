//! Each plugin instance reaches an endpoint over its own gRPC connection
//! (`host/src/capability/grpc.rs`): under broken connections, replies lost
//! and connections cut mid-stream every row still lands once, reopened
//! streams reuse their instance's connection, and no connection outlives
//! the run. (From a hostile review of the per-instance connections.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_bigquery_double::{BigQueryDouble, Fault as BqFault, Rpc, generator_schema};
use sluice_tests::{TestJob, assert_exactly_once_range, bigquery_rows};

const TABLE: &str = "projects/p/datasets/d/tables/events";

/// Waits (up to 20 s: connections close as the instances drop, later on a
/// loaded machine) until no connection to `port` is established; how many are.
fn settled(port: u16) -> usize {
    let began = Instant::now();
    loop {
        let open = connections_to(port);
        if open == 0 || began.elapsed() > Duration::from_secs(20) {
            return open;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Client-side TCP connections of this process to `port` that are established.
fn connections_to(port: u16) -> usize {
    let mut n = 0;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            if cols.len() < 4 {
                continue;
            }
            let rem_port = cols[2].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if rem_port == Some(port) && cols[3] == "01" {
                n += 1;
            }
        }
    }
    n
}

/// Broken connections (replies lost, UNAVAILABLE mid-stream, a flush reply
/// lost): every row once; the streams reopened reuse the instance's
/// connection rather than make one per reopen; and nothing stays connected
/// once the job ended.
#[test]
fn broken_connections_recover_once_and_leak_no_connection() {
    const ROWS: u64 = 6000;
    const P: u32 = 3;
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    for n in [2, 4, 6, 8, 10, 12] {
        d.inject(Rpc::Append, n, if n % 4 == 0 { BqFault::Unavailable } else { BqFault::ApplyThenDropReply });
    }
    d.inject(Rpc::FlushRows, 2, BqFault::ApplyThenDropReply);
    d.inject(Rpc::CreateWriteStream, 2, BqFault::Unavailable);
    let job = TestJob::bigquery("hostile-faults", &d.address(), TABLE, ROWS, P, 500);
    let summary = job.run_with(&["job.commit.initial_backoff_ms=1"], None).expect("the run recovers");
    assert_eq!(summary.rows_total, ROWS);
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    let peers = d.append_peers();
    let distinct: std::collections::BTreeSet<_> = peers.iter().collect();
    eprintln!("{} AppendRows calls over {} connections: {peers:?}", peers.len(), distinct.len());
    // Reopened streams reuse their instance's connection.
    assert!(distinct.len() < peers.len(), "every reopened stream made a connection: {peers:?}");
    let open = settled(d.socket_addr().port());
    assert_eq!(open, 0, "the run left {open} connections open");
}

/// Many instances over a run of many checkpoints: how many connections.
#[test]
fn many_writers_and_checkpoints_open_one_connection_per_writer_and_close_them() {
    const ROWS: u64 = 8000;
    const P: u32 = 8;
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    let port = d.socket_addr().port();
    let job = TestJob::bigquery("hostile-many", &d.address(), TABLE, ROWS, P, 100);
    let max = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (max, stop) = (max.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                max.fetch_max(connections_to(port), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        })
    };
    let summary = job.run(None).expect("run");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    watcher.join().unwrap();
    assert_eq!(summary.rows_total, ROWS);
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
    let open = settled(port);
    let peak = max.load(std::sync::atomic::Ordering::Relaxed);
    let distinct: std::collections::BTreeSet<_> = d.append_peers().into_iter().collect();
    eprintln!("peak {peak} connections, {} distinct AppendRows peers, {open} still open", distinct.len());
    assert_eq!(open, 0, "the run left {open} connections open");
    assert!(peak <= P as usize + 2, "{peak} connections at once for {P} writers");
}

/// A loopback TCP proxy whose connections can all be cut at once (each side
/// shut down), as a server or a middlebox dropping connections mid-stream.
struct CuttingProxy {
    addr: std::net::SocketAddr,
    conns: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
}

impl CuttingProxy {
    fn start(to: std::net::SocketAddr) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let conns: Arc<std::sync::Mutex<Vec<std::net::TcpStream>>> = Default::default();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (c, a) = (conns.clone(), accepted.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = std::net::TcpStream::connect(to) else { continue };
                a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                c.lock().unwrap().extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                for (mut from, mut into) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server.try_clone().unwrap(), client.try_clone().unwrap()),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut into);
                        let _ = into.shutdown(std::net::Shutdown::Both);
                        let _ = from.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Self { addr, conns, accepted }
    }

    fn cut(&self) -> usize {
        let mut conns = self.conns.lock().unwrap();
        for s in conns.iter() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let n = conns.len() / 2;
        conns.clear();
        n
    }
}

/// Every connection cut, again and again, while three writers append and
/// the committer flushes: the run (or its rerun) lands every row once.
#[test]
fn connections_cut_mid_stream_lose_and_duplicate_nothing() {
    const ROWS: u64 = 6000;
    let d = BigQueryDouble::start().expect("double");
    d.create_table(TABLE, generator_schema());
    let proxy = CuttingProxy::start(d.socket_addr());
    // A slow source: the run lasts long enough to be cut several times.
    let mut job = TestJob::bigquery("hostile-cut", &format!("http://{}", proxy.addr), TABLE, ROWS, 3, 250);
    job.toml = job.toml.replace("batch_rows = 700", "batch_rows = 700\nrate = 4000.0");
    job.load(&[]).expect("valid job");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cutter = {
        let stop = stop.clone();
        let conns = proxy.conns.clone();
        std::thread::spawn(move || {
            let mut cuts = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(150));
                let mut c = conns.lock().unwrap();
                if !c.is_empty() {
                    for s in c.iter() {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                    c.clear();
                    cuts += 1;
                }
            }
            cuts
        })
    };
    let mut runs = Vec::new();
    for _ in 0..4 {
        let r = job.run_with(&["job.commit.initial_backoff_ms=1"], None);
        let done = r.is_ok();
        runs.push(r.map(|s| s.rows_total).map_err(|e| e.to_string()));
        if done {
            break;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let cuts = cutter.join().unwrap();
    let _ = proxy.cut();
    eprintln!(
        "cuts: {cuts}; connections through the proxy: {}; runs: {runs:#?}",
        proxy.accepted.load(std::sync::atomic::Ordering::SeqCst)
    );
    assert!(cuts > 0, "no connection was cut: the run was too quick");
    assert!(runs.last().is_some_and(|r| r.is_ok()), "no run finished: {runs:?}");
    assert_exactly_once_range(&bigquery_rows(&d.visible_rows(TABLE)), 0, ROWS);
}
