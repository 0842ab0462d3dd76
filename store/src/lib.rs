//! Snapshots in object storage: a sandbox that outlives the host it ran on.
//!
//! A snapshot (state file, memory file, working set) is *published* to an object store
//! ([`publish`]) and *opened* from one on any host ([`cache::ChunkCache::open_snapshot`])
//! without downloading its memory first: the memory file exists locally as a sparse file
//! with its real header, and its pages are fetched in aligned chunks, one range read each,
//! the first time something reads them.
//!
//! * [`location`]: where the store is (`s3://bucket/prefix`, `gs://…`, `az://…`,
//!   `file:///dir`, `memory://`), behind the `object_store` crate's one interface.
//! * [`manifest`]: the small JSON document per snapshot that names its objects, their
//!   checksums and, for a diff, the snapshot below it. Untrusted: validated on read.
//! * [`publish`]: uploads a snapshot's objects (content-addressed, immutable, skipped when
//!   already there), then its manifest, which commits it.
//! * [`cache`]: the local chunk cache (bounded, least-recently-used eviction, kept across
//!   restarts, every chunk verified before it is used) and the fetcher that fills it.
//! * [`fetcher`]: the fetcher's service on a Unix socket, and [`fetcher::FetchClient`], the
//!   VM process's side: a VM process never opens a network socket; it asks the fetcher and
//!   reads the cache files read-only.
//!
//! * [`s3server`]: a real S3-compatible server on loopback for tests and benchmarks.
//!
//! The layout of the store is documented in `snapshot/FORMAT.md` ("Snapshots in object
//! storage").

pub mod cache;
pub mod fetcher;
pub mod location;
pub mod manifest;
pub mod publish;
pub mod s3server;
pub mod sweep;

use std::path::PathBuf;

pub use location::Store;
pub use manifest::Manifest;

/// The one error type of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store URL or an option is not usable.
    #[error("object store {url}: {reason}")]
    Config {
        /// The URL given.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A request to the store failed (after its retries).
    #[error("object store: {op} {key}: {source}")]
    Store {
        /// What was being done.
        op: &'static str,
        /// The object's key.
        key: String,
        /// The store client's error.
        #[source]
        source: object_store::Error,
    },
    /// The store did not answer within the time allowed.
    #[error("object store: {op} {key}: no answer within {secs} s")]
    Timeout {
        /// What was being done.
        op: &'static str,
        /// The object's key.
        key: String,
        /// The limit.
        secs: u64,
    },
    /// An object is not in the store.
    #[error("object store: {key} does not exist")]
    Missing {
        /// The object's key.
        key: String,
    },
    /// An object's bytes do not match the checksum its manifest gives.
    #[error(
        "object {key}: {what} fails its checksum (sha256 {computed}, manifest says {expected})"
    )]
    Checksum {
        /// The object's key.
        key: String,
        /// Which part (the object, or chunk N).
        what: String,
        /// Checksum of the bytes read.
        computed: String,
        /// Checksum the manifest gives.
        expected: String,
    },
    /// A manifest (or an object it names) is malformed.
    #[error("snapshot manifest {key}: {reason}")]
    BadManifest {
        /// The manifest's key.
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A local file could not be read or written.
    #[error("{path}: {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A disk layer file could not be used.
    #[error("disk layer {}: {source}", path.display())]
    Disk {
        /// The layer concerned.
        path: PathBuf,
        /// The disk crate's error.
        #[source]
        source: disk::Error,
    },
    /// A snapshot file failed its own checks.
    #[error("{0}")]
    Snapshot(#[from] snapshot::Error),
    /// The local cache cannot take more without evicting what running VMs use.
    #[error("local chunk cache is full: {needed} more bytes needed, {held} of its {limit}-byte limit held by snapshots in use")]
    CacheFull {
        /// Bytes to add.
        needed: u64,
        /// Bytes that cannot be evicted.
        held: u64,
        /// The limit.
        limit: u64,
    },
    /// An object is larger than what is allowed for it (a manifest over
    /// [`manifest::MAX_MANIFEST_BYTES`], an object over its manifest's size or
    /// [`manifest::MAX_SMALL_OBJECT`]): refused before it is read whole.
    #[error("object store: {key} is {size} bytes, more than the {limit} allowed for it")]
    TooLarge {
        /// The object's key.
        key: String,
        /// Its size (as the store reports it, or as far as it was read).
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// The fetcher's protocol was violated, or the fetcher answered with an error.
    #[error("fetcher: {0}")]
    Fetcher(String),
    /// Objects a snapshot needs are not in the store, or not whole: found by the check a
    /// restore makes before it starts ([`cache::ChunkCache::check_store`]), so that it
    /// fails at once rather than when the VM first reads what is gone.
    #[error("snapshot {snapshot} cannot be restored: {}", missing.join("; "))]
    Incomplete {
        /// The snapshot opened (the top of its chain).
        snapshot: String,
        /// What is wrong, one entry per object (its full key, and how).
        missing: Vec<String>,
    },
    /// An error met by a fetch shared with other waiters (concurrent misses of one
    /// chunk), passed on as its message.
    #[error("{0}")]
    Shared(String),
    /// An argument is not valid.
    #[error("invalid argument: {0}")]
    InvalidInput(String),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn store(op: &'static str, key: &str, source: object_store::Error) -> Self {
        match source {
            object_store::Error::NotFound { .. } => Error::Missing {
                key: key.to_string(),
            },
            source => Error::Store {
                op,
                key: key.to_string(),
                source,
            },
        }
    }
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// The SHA-256 of `bytes`, as lower-case hex.
pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(bytes))
}
