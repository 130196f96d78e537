//! Storage credentials a REST catalog vends with a table: asked for with
//! `X-Iceberg-Access-Delegation: vended-credentials` (the REST catalog
//! spec's `loadTable` header), returned in the `LoadTableResult`'s `config`
//! as `s3.access-key-id`, `s3.secret-access-key`, `s3.session-token` and
//! `s3.session-token-expires-at-ms` (the keys of Iceberg's `S3FileIO` and
//! PyIceberg).
//!
//! Invariants:
//! - the credentials stay in the host: the plugin's `file-io` calls on a
//!   table's location are signed with the credentials vended for that
//!   table (the deepest table location covering the object), and the
//!   catalog's own metadata I/O with those of the `FileIO` of the table it
//!   loaded; an object no vended table covers is reached with the job's
//!   `[sink.s3]` settings;
//! - credentials with an expiry are replaced before they expire: once less
//!   than half their lifetime (at most [`REFRESH_AHEAD_MAX`]) remains, the
//!   table is loaded again and the new ones are used from the next request
//!   on. A reload that fails leaves the old ones in use, so a request may
//!   then be refused; a `file-io` request the store refuses (403: revoked,
//!   or expired early) loads the table again and is sent once more with
//!   what it then comes with (a refused request was not applied, so this
//!   is safe for conditional writes too); refused again, it is `denied`,
//!   and the plugin stops the job resumably, as on any refused write;
//! - an upload already started keeps the credentials it started with.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use iceberg::table::Table;
use iceberg::{Catalog, TableIdent};
use sluice_store::{ObjectStore, S3Credentials};

use super::file_io_store::{StoreConfig, open_store, parse_plugin_location};
use crate::location::Location;

/// The header value that asks a REST catalog for vended credentials.
pub(crate) const ACCESS_DELEGATION_HEADER: &str = "header.X-Iceberg-Access-Delegation";
pub(crate) const VENDED_CREDENTIALS: &str = "vended-credentials";

/// Refresh at most this long before the expiry (long-lived credentials).
pub(crate) const REFRESH_AHEAD_MAX: Duration = Duration::from_secs(300);

const LOAD: &str = "sluice:connector/iceberg-catalog.load-table (refreshing vended storage credentials)";

/// S3 credentials with their expiry, from a table's storage `config`.
#[derive(Clone, Debug)]
pub(crate) struct VendedS3 {
    pub credentials: S3Credentials,
    pub expires_at: Option<SystemTime>,
}

/// The vended S3 credentials in `props` (a `LoadTableResult`'s `config`
/// merged into a `FileIO`'s properties), if there are any.
pub(crate) fn s3_credentials(props: &HashMap<String, String>) -> Option<VendedS3> {
    let access_key_id = props.get("s3.access-key-id")?.clone();
    let secret_access_key = props.get("s3.secret-access-key")?.clone();
    let session_token = props.get("s3.session-token").cloned();
    let expires_at = props
        .get("s3.session-token-expires-at-ms")
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    Some(VendedS3 { credentials: S3Credentials { access_key_id, secret_access_key, session_token }, expires_at })
}

/// `base` with `vended`'s keys for S3.
pub(crate) fn with_credentials(base: &StoreConfig, vended: &VendedS3) -> StoreConfig {
    let mut config = base.clone();
    config.s3.credentials = Some(vended.credentials.clone());
    config
}

struct VendedTable {
    ident: TableIdent,
    /// The table's location.
    root: Location,
    store: ObjectStore,
    /// When these were received and when they expire.
    received: SystemTime,
    expires_at: Option<SystemTime>,
}

impl VendedTable {
    /// Whether it is time to load the table again.
    fn due(&self, now: SystemTime) -> bool {
        let Some(expires_at) = self.expires_at else { return false };
        let lifetime = expires_at.duration_since(self.received).unwrap_or_default();
        let ahead = (lifetime / 2).min(REFRESH_AHEAD_MAX);
        now + ahead >= expires_at
    }
}

/// The credentials vended for each table this run loaded, shared by the
/// catalog (which records them) and the `file-io` grants (which use them).
pub(crate) struct Vended {
    base: StoreConfig,
    tables: Mutex<Vec<VendedTable>>,
    /// Loads a table again; set once the catalog exists.
    catalog: OnceLock<Weak<dyn Catalog>>,
    /// How many times credentials were received (for reports and tests).
    received: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Vended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vended").finish_non_exhaustive()
    }
}

impl Vended {
    pub(crate) fn new(base: StoreConfig) -> Self {
        Self {
            base,
            tables: Mutex::default(),
            catalog: OnceLock::new(),
            received: std::sync::atomic::AtomicU64::new(0),
        }
    }

    pub(crate) fn set_catalog(&self, catalog: Weak<dyn Catalog>) {
        let _ = self.catalog.set(catalog);
    }

    /// How many times a table came with credentials.
    pub fn received(&self) -> u64 {
        self.received.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Keeps the credentials `table` came with, if any, for its location.
    pub(crate) fn record(&self, table: &Table) {
        let Some(vended) = s3_credentials(table.file_io().config().props()) else { return };
        let Ok(root) = parse_plugin_location(table.metadata().location()) else {
            tracing::warn!(table = %table.identifier(), location = table.metadata().location(),
                "vended credentials for a table whose location is not an object-store location: ignored");
            return;
        };
        let store = match open_store(&root, &with_credentials(&self.base, &vended)) {
            Ok(store) => store,
            Err(e) => {
                tracing::warn!(table = %table.identifier(), "cannot use the vended credentials: {e}");
                return;
            }
        };
        self.received.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let entry = VendedTable {
            ident: table.identifier().clone(),
            root,
            store,
            received: SystemTime::now(),
            expires_at: vended.expires_at,
        };
        let mut tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        tables.retain(|t| t.ident != entry.ident);
        tables.push(entry);
    }

    /// The deepest vended table covering `location`: its identifier, store, and whether it is due.
    fn lookup(&self, location: &Location) -> Option<(TableIdent, ObjectStore, bool)> {
        let tables = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        let now = SystemTime::now();
        tables
            .iter()
            .filter(|t| location.is_within(&t.root))
            .max_by_key(|t| t.root.to_string().len())
            .map(|t| (t.ident.clone(), t.store.clone(), t.due(now)))
    }

    /// The store to reach `location` with: the one of the table covering
    /// it, its credentials refreshed first when they are due; `None` when
    /// no vended table covers it. Blocks (it is called by `file-io`, outside
    /// the runtime).
    pub(crate) fn store_for(&self, location: &Location) -> Option<ObjectStore> {
        let (ident, store, due) = self.lookup(location)?;
        if !due {
            return Some(store);
        }
        self.reload(&ident);
        self.lookup(location).map(|(_, store, _)| store)
    }

    /// The store for `location` with credentials loaded anew, whether or not
    /// they were due: for a request the store refused with the current ones
    /// (revoked, or expired early); `None` when no vended table covers it.
    pub(crate) fn refreshed_store_for(&self, location: &Location) -> Option<ObjectStore> {
        let (ident, _, _) = self.lookup(location)?;
        self.reload(&ident);
        self.lookup(location).map(|(_, store, _)| store)
    }

    /// Loads `ident` again; the catalog records what it comes with. A
    /// failure leaves the old credentials in use (logged).
    fn reload(&self, ident: &TableIdent) {
        let Some(catalog) = self.catalog.get().and_then(Weak::upgrade) else { return };
        match super::block_on(LOAD, catalog.load_table(ident)) {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(table = %ident, "reloading the table for new storage credentials failed: {e}"),
            Err(late) => tracing::warn!(table = %ident, "reloading the table for new storage credentials: {late}"),
        }
    }
}
