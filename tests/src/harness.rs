//! Steps the integration test binaries share (`tests/tests/<group>/main.rs`,
//! each holding several of the former one-file test binaries as modules).
//!
//! Invariants:
//! - a test process has at most one moto server ([`moto`]) and one
//!   fake-gcs-server ([`gcs`]) that the host reaches through the standard
//!   environment; each is started on first use, and the process's
//!   environment (`AWS_ENDPOINT_URL`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_EC2_METADATA_DISABLED`;
//!   `STORAGE_EMULATOR_HOST`, no `GOOGLE_APPLICATION_CREDENTIALS`) is set
//!   once, before the accessor returns, and never changed after;
//! - every module that uses them has buckets of its own ([`buckets`]), so
//!   modules sharing a process never see each other's objects; moto's
//!   fault switch ([`Moto::fail_requests`]) is one rule per server, so in
//!   one binary at most one module may set it;
//! - a test that points the process's AWS environment at a server of its
//!   own (not the shared one) holds [`aws_env_lock`] while it runs (as a
//!   [`VendingLake`] does), and lives in a binary whose other tests never
//!   call [`moto`] nor read that environment.

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use iceberg::io::FileIOBuilder;
use sluice::capability::catalog_storage::{WarehouseStorage, WarehouseStorageFactory};
use sluice::capability::file_io::StoreConfig;
use sluice::location::{Location, Scheme};

use crate::TestJob;
use crate::rest_catalog::RestCatalogDouble;
use crate::store_servers::{ACCESS_KEY_ID, FakeGcs, Moto, REGION, SECRET_ACCESS_KEY};

/// The buckets of the shared servers, one set per test module.
pub mod buckets {
    /// `files_s3` (on both servers).
    pub const FILES: &str = "lake";
    /// `hostile_cloud` (on both servers).
    pub const HOSTILE: &str = "hostile";
    /// `iceberg_s3` and `iceberg_gcs` (each on its own server).
    pub const ICEBERG: &str = "iceberg-lake";
    /// `state_s3` and `state_gcs` (each on its own server).
    pub const STATE: &str = "state";
    /// `unknown_outcome_s3`.
    pub const OUTCOME: &str = "outcome-state";
    /// `maintenance`.
    pub const MAINTENANCE: &str = "maint-state";
    /// `kafka_s3`.
    pub const KAFKA: &str = "stream";

    /// Made on the shared moto server.
    pub const S3: &[&str] = &[FILES, HOSTILE, ICEBERG, STATE, OUTCOME, MAINTENANCE, KAFKA];
    /// Made on the shared fake-gcs-server.
    pub const GCS: &[&str] = &[FILES, HOSTILE, ICEBERG, STATE];
}

/// Runs `fut` to its end on a runtime of its own (the tests' synchronous
/// calls into `sluice-store` and the catalog).
pub fn block<T>(fut: impl Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(fut)
}

/// The process's moto server, holding [`buckets::S3`], with the AWS
/// environment pointing the host (and every process the test starts) at it.
pub fn moto() -> &'static Moto {
    static MOTO: OnceLock<Moto> = OnceLock::new();
    MOTO.get_or_init(|| {
        let moto = Moto::start(buckets::S3);
        // SAFETY: set once, inside the `OnceLock`'s initialiser: every test
        // that reaches S3 through the environment first waits here. Tests of
        // the same binary that do not never read these variables.
        unsafe {
            std::env::set_var("AWS_ENDPOINT_URL", &moto.endpoint);
            std::env::set_var("AWS_REGION", REGION);
            std::env::set_var("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID);
            std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY);
            std::env::set_var("AWS_EC2_METADATA_DISABLED", "true");
        }
        moto
    })
}

/// The process's fake-gcs-server, holding [`buckets::GCS`], with
/// `STORAGE_EMULATOR_HOST` pointing the host at it.
pub fn gcs() -> &'static FakeGcs {
    static GCS: OnceLock<FakeGcs> = OnceLock::new();
    GCS.get_or_init(|| {
        let server = FakeGcs::start(buckets::GCS);
        let host = server.endpoint.strip_prefix("http://").unwrap_or(&server.endpoint).to_string();
        // SAFETY: as in `moto`.
        unsafe {
            // `host:port`, as Google's libraries take it.
            std::env::set_var(sluice_store::STORAGE_EMULATOR_HOST, host);
            // Nothing may fall back to real credentials.
            std::env::remove_var("GOOGLE_APPLICATION_CREDENTIALS");
        }
        server
    })
}

/// Held by a test that sets the process's AWS environment to a server of
/// its own, for as long as it runs: such tests, once binaries of their
/// own, run one at a time. A test that failed while holding it does not
/// stop the next.
pub fn aws_env_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An Iceberg REST catalog double whose warehouse, `s3://<bucket>/wh`, is on
/// a moto server of the test's own, and which vends S3 credentials; the
/// process's AWS environment points at that server (with the test's own
/// key, which the double's credentials must win over) for as long as this
/// lives ([`aws_env_lock`]).
pub struct VendingLake {
    pub rest: Arc<RestCatalogDouble>,
    /// How the test itself reaches the server.
    pub stores: StoreConfig,
    /// The warehouse, `s3://<bucket>/wh`.
    pub root: Location,
    pub warehouse: String,
    _env: MutexGuard<'static, ()>,
}

impl VendingLake {
    /// Starts the double on `moto`'s `bucket`, vending credentials that say
    /// they live `lifetime`.
    pub fn start(moto: &Moto, bucket: &str, lifetime: Duration) -> VendingLake {
        let env = aws_env_lock();
        // SAFETY: the lock's holder is the only test of its binary that
        // reads the AWS environment (see the module doc).
        unsafe {
            std::env::set_var("AWS_ENDPOINT_URL", &moto.endpoint);
            std::env::set_var("AWS_REGION", REGION);
            std::env::set_var("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID);
            std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY);
        }
        let stores = StoreConfig { s3: moto.s3_options(), ..StoreConfig::default() };
        let root = Location::ObjectStore { scheme: Scheme::S3, bucket: bucket.into(), prefix: "wh".into() };
        let warehouse = format!("s3://{bucket}/wh");
        let storage = WarehouseStorage::open(root.clone(), &stores).expect("the double's warehouse storage");
        let file_io = FileIOBuilder::new(Arc::new(WarehouseStorageFactory::new(storage, &stores))).build();
        let rest = RestCatalogDouble::start_vending(&warehouse, file_io, lifetime).expect("REST catalog");
        VendingLake { rest: Arc::new(rest), stores, root, warehouse, _env: env }
    }

    /// An Iceberg job (see [`TestJob::iceberg`]) on this catalog, its
    /// local scratch in `scratch`.
    pub fn job(&self, id: &str, scratch: &Path, table: &str, rows: u64) -> TestJob {
        let mut job = TestJob::iceberg(id, scratch, table, rows, 0, 2, 500);
        let local = format!("database = \"{0}/catalog.db\"\nwarehouse = \"{0}\"", scratch.display());
        assert!(job.toml.contains(&local), "the Iceberg job names its SQLite catalog and warehouse");
        let rest = format!("kind = \"rest\"\nuri = \"{}\"\nwarehouse = \"{}\"", self.rest.uri(), self.warehouse);
        job.toml = job.toml.replace(&local, &rest);
        job
    }
}
