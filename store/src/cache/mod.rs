//! The local chunk cache: published snapshots opened on this host, filled lazily.
//!
//! Layout under the cache root, one directory per snapshot (a diff and its bases each
//! have their own):
//!
//! ```text
//! snapshots/<id>/manifest.json   the manifest, as fetched (validated)
//! snapshots/<id>/state.snap      the state file (verified against the manifest)
//! snapshots/<id>/working_set.ws  the working set, if published
//! snapshots/<id>/memory.mem      the memory file: real header, sparse image
//! snapshots/<id>/memory.present  one byte per chunk of packed data: 1 = in memory.mem
//! ```
//!
//! A chunk is fetched with one range read, checked against its SHA-256, written into
//! `memory.mem` at the image offsets of its pages, and only then marked present; a VM
//! process reads `memory.present` to skip asking for chunks already there. Concurrent
//! misses of one chunk share one fetch. The cache is bounded: adding a chunk past the
//! limit evicts the least recently used chunks of snapshots no connected VM process has
//! open (their pages are punched out of `memory.mem`); if everything is in use it is an
//! error ([`Error::CacheFull`]), never an overwrite. The cache survives a restart: the
//! chunks marked present are verified again the first time a snapshot is opened after it.
//!
//! A snapshot with a disk also has its disk's layer files here, shared by every snapshot
//! whose chain holds them:
//!
//! ```text
//! layers/<layer id>.cdsk          one frozen layer file (its data possibly holes)
//! layers/<layer id>.cdsk.json     the manifest's entry of it
//! layers/<layer id>.cdsk.chunks   its chunk checksums (32 bytes each)
//! layers/<layer id>.cdsk.present  one byte per chunk: 1 = in the file (while read lazily)
//! ```
//!
//! A layer is read lazily: at open, the chunks holding its header and allocation table
//! are fetched (each checked against its checksum) into a temporary file in `layers/` as
//! long as the object, linked to its parent by the parent's file name (`<parent
//! id>.cdsk`, with [`disk::ops::set_parent_path`]: the path recorded on the publishing
//! host means nothing here), its entry, checksums and presence map written beside it,
//! synced, and only then renamed into place, so a layer file present under its final name
//! opens as the chain it was published as. Every other chunk is fetched when a VM process
//! first reads it ([`ChunkCache::ensure_layer`], asked through the fetcher by
//! [`crate::fetcher::FetcherLayers`]): written and synced, then marked present.
//! [`ChunkCache::complete_layer`] makes one whole. A layer published by an older build
//! (no chunk checksums) is downloaded whole. Layer files are not counted against the
//! chunk limit and are never evicted (a VM's overlay is stacked on them for as long as it
//! runs, which no lease outlives): removing them is left to whoever removes the cache.
//!
//! An open of a snapshot that is already cached is no different from a first one in what
//! it makes sure of: the chunks marked present are verified once per process, and the
//! working set's chunks are fetched by every open that finds them absent, so an open that
//! failed (a chunk failed its checksum, the store did not answer) fails again until the
//! store is whole, then succeeds. An open for a restore also checks that the store still
//! has every object the snapshot may read later ([`ChunkCache::open_snapshot_checked`]).
//!
//! The code is split by concern: this file has the cache's types, its opening of a chain
//! and the directories it keeps; `download.rs` fetches a snapshot's directory from the
//! store; `check.rs` checks that the store has what an opened snapshot still needs from
//! it; `memory_chunks.rs` fills memory files chunk by chunk within the limit (leases,
//! eviction); `disk_layers.rs` brings a snapshot's disk layers into `layers/`; and
//! `disk_chunks.rs` fills the disk layers read lazily.

mod check;
mod disk_chunks;
mod disk_layers;
mod download;
mod memory_chunks;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::{BoxFuture, Shared};
use snapshot::bitmap::PageBitmap;
use snapshot::SnapshotId;

use crate::manifest::{self, placements, Manifest, Placement};
use crate::{Error, Result, Store};

use disk_chunks::LazyLayers;
pub use disk_layers::{cached_layer_entry, layer_file};

/// File names inside a snapshot's cache directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The state file.
pub const STATE_FILE: &str = "state.snap";
/// The memory file.
pub const MEMORY_FILE: &str = "memory.mem";
/// The chunk presence map.
pub const PRESENT_FILE: &str = "memory.present";
/// The working set.
pub const WORKING_SET_FILE: &str = "working_set.ws";

/// The directory of disk layer files under the cache root.
pub const LAYERS_DIR: &str = "layers";

/// A snapshot opened in the cache ([`ChunkCache::open_snapshot`]).
#[derive(Debug)]
pub struct OpenedSnapshot {
    /// Its memory layers, base first; the last is the snapshot itself.
    pub layers: Vec<Arc<CachedLayer>>,
    /// Its disk, materialized under [`LAYERS_DIR`], if it has one.
    pub disk: Option<CachedDisk>,
}

/// A published snapshot's disk in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachedDisk {
    /// The top layer's file (`layers/<id>.cdsk`, absolute if the cache root is); its
    /// parents are beside it.
    pub layer: PathBuf,
    /// The disk was read-only.
    pub read_only: bool,
}

/// Counters of a cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CacheStats {
    /// Bytes fetched from the store (chunks and whole objects).
    pub bytes_fetched: u64,
    /// Requests made to the store.
    pub requests: u64,
    /// Chunks fetched.
    pub chunks_fetched: u64,
    /// Chunks evicted.
    pub chunks_evicted: u64,
    /// Bytes of chunks held now.
    pub bytes_held: u64,
}

/// One snapshot's cache directory, loaded.
#[derive(Debug)]
pub struct CachedLayer {
    pub(crate) id: SnapshotId,
    pub(crate) dir: PathBuf,
    pub(crate) manifest: Manifest,
    placements: Vec<Placement>,
    mem: File,
    present: File,
}

type ChunkFuture = Shared<BoxFuture<'static, std::result::Result<(), String>>>;

#[derive(Default)]
struct Inner {
    layers: HashMap<SnapshotId, Arc<CachedLayer>>,
    /// Per layer, per chunk: 0 absent, else the tick of its last use.
    ticks: HashMap<SnapshotId, Vec<u64>>,
    /// Layers whose present chunks were verified in this process.
    verified: HashMap<SnapshotId, bool>,
    leases: HashMap<SnapshotId, usize>,
    inflight: HashMap<(SnapshotId, u64), ChunkFuture>,
    used: u64,
    tick: u64,
}

/// The chunk cache of one host (see the [module documentation](self)).
pub struct ChunkCache {
    root: PathBuf,
    store: Store,
    limit: u64,
    inner: Mutex<Inner>,
    bytes_fetched: AtomicU64,
    requests: AtomicU64,
    chunks_fetched: AtomicU64,
    chunks_evicted: AtomicU64,
    scanned: AtomicBool,
    /// Range reads in flight at once (a prefetch of a whole image asks for every chunk).
    fetch_slots: tokio::sync::Semaphore,
    /// One download at a time per disk layer (by id).
    layer_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Disk layers read lazily, opened for filling (by id), and their chunks in flight.
    lazy: Mutex<LazyLayers>,
}

/// Most range reads one cache has in flight.
pub const MAX_CONCURRENT_FETCHES: usize = 16;

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("root", &self.root)
            .field("store", &self.store)
            .field("limit", &self.limit)
            .finish()
    }
}

fn lock(m: &Mutex<Inner>) -> std::sync::MutexGuard<'_, Inner> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The data pages of a manifest as a bitmap.
pub fn data_bitmap(m: &Manifest) -> PageBitmap {
    manifest::Layout::of(m).data_bitmap()
}

impl ChunkCache {
    /// A cache rooted at `root` (created if missing) for snapshots of `store`, holding at
    /// most `limit` bytes of chunks.
    pub fn new(root: &Path, store: Store, limit: u64) -> Result<Arc<ChunkCache>> {
        // Guest memory, CPU state and disk layers of every sandbox restored from the store:
        // private to the service's user (jailed VMs reach their files through the jail's
        // own mounts, not through this directory).
        vmm::host::private_dir(root).map_err(|e| Error::io("create cache directory", root, e))?;
        std::fs::create_dir_all(root.join("snapshots"))
            .map_err(|e| Error::io("create cache directory", root, e))?;
        let cache = Arc::new(ChunkCache {
            root: root.to_path_buf(),
            store,
            limit,
            inner: Mutex::new(Inner::default()),
            bytes_fetched: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            chunks_fetched: AtomicU64::new(0),
            chunks_evicted: AtomicU64::new(0),
            scanned: AtomicBool::new(false),
            fetch_slots: tokio::sync::Semaphore::new(MAX_CONCURRENT_FETCHES),
            layer_locks: Mutex::new(HashMap::new()),
            lazy: Mutex::default(),
        });
        cache.scan();
        Ok(cache)
    }

    /// The cache root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The store it fetches from.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            bytes_fetched: self.bytes_fetched.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            chunks_fetched: self.chunks_fetched.load(Ordering::Relaxed),
            chunks_evicted: self.chunks_evicted.load(Ordering::Relaxed),
            bytes_held: lock(&self.inner).used,
        }
    }

    fn snapshot_dir(&self, id: SnapshotId) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// Loads every snapshot directory a previous run left (their chunks count against
    /// the limit; they are verified when first opened).
    fn scan(&self) {
        if self.scanned.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Ok(rd) = std::fs::read_dir(self.root.join(LAYERS_DIR)) {
            for e in rd.flatten() {
                if e.file_name().to_str().is_some_and(|n| n.starts_with('.')) {
                    // A layer download a previous run did not finish.
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let Ok(rd) = std::fs::read_dir(self.root.join("snapshots")) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') {
                // A download a previous run did not finish.
                let _ = std::fs::remove_dir_all(e.path());
                continue;
            }
            let Ok(id) = manifest::parse_snapshot_id(name) else {
                continue;
            };
            match self.load_dir(id, &e.path(), None, 0) {
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(dir = %e.path().display(), error = %err,
                        "dropping an unusable cache directory");
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }

    /// Loads the cache directory of snapshot `id` (already complete on disk).
    /// `counted`: bytes of its present chunks already counted as used (reserved by the
    /// download that wrote them). Returns whether it was loaded now (not there before).
    fn load_dir(
        &self,
        id: SnapshotId,
        dir: &Path,
        parsed: Option<Manifest>,
        counted: u64,
    ) -> Result<bool> {
        let mpath = dir.join(MANIFEST_FILE);
        let m = match parsed {
            Some(m) => m,
            None => {
                let bytes = std::fs::read(&mpath).map_err(|e| Error::io("read", &mpath, e))?;
                Manifest::parse(&mpath.display().to_string(), &bytes)?
            }
        };
        if m.snapshot_id() != id {
            return Err(Error::BadManifest {
                key: mpath.display().to_string(),
                reason: format!("manifest of {}, directory of {id}", m.id),
            });
        }
        let open_rw = |name: &str| {
            let p = dir.join(name);
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .map_err(|e| Error::io("open", p, e))
        };
        let mem = open_rw(MEMORY_FILE)?;
        let present = open_rw(PRESENT_FILE)?;
        let n = m.chunk_count() as usize;
        let mut flags = vec![0u8; n];
        let got = present
            .read_at(&mut flags, 0)
            .map_err(|e| Error::io("read", dir.join(PRESENT_FILE), e))?;
        flags.truncate(got);
        flags.resize(n, 0);
        let mut ticks = vec![0u64; n];
        let mut used = 0;
        for (c, f) in flags.iter().enumerate() {
            if *f == 1 {
                ticks[c] = 1;
                let (s, e) = m.chunk_range(c as u64);
                used += e - s;
            }
        }
        let layer = Arc::new(CachedLayer {
            id,
            dir: dir.to_path_buf(),
            placements: placements(&m),
            manifest: m,
            mem,
            present,
        });
        let mut inner = lock(&self.inner);
        if inner.layers.contains_key(&id) {
            return Ok(false);
        }
        inner.layers.insert(id, layer);
        inner.ticks.insert(id, ticks);
        inner.used += used.saturating_sub(counted);
        Ok(true)
    }

    /// Makes snapshot `id` and every snapshot below it available locally (manifests,
    /// state files, memory headers; no memory data) and returns their directories, base
    /// first, with the snapshot's disk layers (their headers and tables; their data is read
    /// lazily).
    /// Leases nothing (see [`ChunkCache::lease`]).
    pub async fn open_snapshot(self: &Arc<Self>, id: SnapshotId) -> Result<OpenedSnapshot> {
        self.open_chain(id, false).await
    }

    /// [`ChunkCache::open_snapshot`], checking besides that the store still has every
    /// object the snapshot may read from it later ([`ChunkCache::check_store`], while its
    /// disk layers open): what a restore opens its snapshot with, so that it fails now,
    /// with an error naming what is gone, rather than when its VM first reads it.
    pub async fn open_snapshot_checked(self: &Arc<Self>, id: SnapshotId) -> Result<OpenedSnapshot> {
        self.open_chain(id, true).await
    }

    async fn open_chain(self: &Arc<Self>, id: SnapshotId, check: bool) -> Result<OpenedSnapshot> {
        let mut chain = Vec::new();
        let mut next = Some(id);
        while let Some(id) = next {
            if chain.len() >= snapshot::memory_file::MAX_CHAIN_LEN {
                return Err(Error::InvalidInput(format!(
                    "snapshot {id}: diff chain longer than {}",
                    snapshot::memory_file::MAX_CHAIN_LEN
                )));
            }
            let layer = self.layer(id).await?;
            next = layer.manifest.base_id();
            chain.push(layer);
        }
        let disk = match chain.first() {
            Some(top) if check => {
                // What to ask for is known before the disk layers open (their files change).
                let needed = self.needed_objects(&chain, &top.manifest);
                let (disk, ()) = futures::try_join!(
                    self.open_disk(&top.manifest),
                    self.check_objects(id, needed)
                )?;
                disk
            }
            Some(top) => self.open_disk(&top.manifest).await?,
            None => None,
        };
        chain.reverse();
        Ok(OpenedSnapshot {
            layers: chain,
            disk,
        })
    }

    async fn layer(self: &Arc<Self>, id: SnapshotId) -> Result<Arc<CachedLayer>> {
        let existing = lock(&self.inner).layers.get(&id).cloned();
        let layer = match existing {
            Some(l) => l,
            None => {
                self.download(id).await?;
                lock(&self.inner).layers.get(&id).cloned().ok_or_else(|| {
                    Error::Fetcher(format!("snapshot {id} vanished from the cache"))
                })?
            }
        };
        let verified = lock(&self.inner)
            .verified
            .get(&id)
            .copied()
            .unwrap_or(false);
        if !verified {
            let this = Arc::clone(self);
            let l = Arc::clone(&layer);
            tokio::task::spawn_blocking(move || this.verify_present(&l))
                .await
                .map_err(|e| Error::Fetcher(format!("verify task: {e}")))??;
            lock(&self.inner).verified.insert(id, true);
        }
        self.ensure_working_set(&layer).await?;
        Ok(layer)
    }

    /// Makes the chunks holding `layer`'s recorded working set present (a restore reads
    /// them first): fetched now if the download did not bring them (no good lead object),
    /// an earlier open could not fetch them, or they were evicted since. An open that
    /// fails here fails whole, and the next open of the snapshot tries again, as a first
    /// one would.
    async fn ensure_working_set(self: &Arc<Self>, layer: &Arc<CachedLayer>) -> Result<()> {
        let futs: Vec<ChunkFuture> = (0..layer.manifest.working_set_chunks())
            .filter_map(|c| self.chunk_future(layer, c))
            .collect();
        for r in futures::future::join_all(futs).await {
            r.map_err(Error::Shared)?;
        }
        Ok(())
    }

    /// Drops snapshot `id` from the cache (its directory and chunks), unless a connected
    /// VM process has it open. Returns whether it was cached.
    pub fn forget(&self, id: SnapshotId) -> Result<bool> {
        let mut inner = lock(&self.inner);
        if inner.leases.get(&id).copied().unwrap_or(0) > 0 {
            return Err(Error::InvalidInput(format!("snapshot {id} is in use")));
        }
        let Some(layer) = inner.layers.remove(&id) else {
            return Ok(false);
        };
        if let Some(ticks) = inner.ticks.remove(&id) {
            let held: u64 = (0..ticks.len() as u64)
                .filter(|&c| ticks[c as usize] != 0)
                .map(|c| {
                    let (s, e) = layer.manifest.chunk_range(c);
                    e - s
                })
                .sum();
            inner.used = inner.used.saturating_sub(held);
        }
        inner.verified.remove(&id);
        drop(inner);
        std::fs::remove_dir_all(&layer.dir).map_err(|e| Error::io("remove", &layer.dir, e))?;
        Ok(true)
    }
}

/// Runs blocking file work: in place on a multi-threaded runtime's worker (no hand-over
/// to another thread, which costs a wake-up), else on the blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    use tokio::runtime::{Handle, RuntimeFlavor};
    if Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread {
        Ok(tokio::task::block_in_place(f))
    } else {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| Error::Fetcher(format!("file task: {e}")))
    }
}

impl CachedLayer {
    /// The snapshot's id.
    pub fn id(&self) -> SnapshotId {
        self.id
    }

    /// Its cache directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
}
