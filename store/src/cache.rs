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

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use snapshot::bitmap::PageBitmap;
use snapshot::fetch::{ChunkFetch, Fetcher};
use snapshot::memory_file::MemoryFile;
use snapshot::{state_file, SnapshotId};

use crate::manifest::{self, chunks_for, placements, Manifest, Placement};
use crate::{sha256_hex, Error, Result, Store};

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

/// Size of the range reads a disk layer is downloaded with.
const LAYER_PIECE: u64 = 8 << 20;
/// Range reads of one layer download in flight at once.
const LAYER_READS: usize = 4;

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

/// The disk layers of a cache that are read lazily (see the [module documentation](self)).
#[derive(Default)]
struct LazyLayers {
    open: HashMap<String, Arc<LazyLayer>>,
    inflight: HashMap<(String, u64), ChunkFuture>,
}

/// A disk layer file filled chunk by chunk.
struct LazyLayer {
    id: String,
    path: PathBuf,
    file: File,
    present: File,
    entry: manifest::DiskLayer,
    chunk_size: u64,
    digests: Vec<[u8; 32]>,
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

/// A [`ChunkFetch`] that does nothing: for validating a memory file's header only.
struct NoFetch;
impl ChunkFetch for NoFetch {
    fn ensure(&self, _: u64, _: u64) -> std::result::Result<(), String> {
        Err("not fetched".into())
    }
    fn prefetch(&self, _: &[(u64, u64)]) {}
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
            Some(top) => self.open_disk(&top.manifest).await?,
            None => None,
        };
        chain.reverse();
        Ok(OpenedSnapshot {
            layers: chain,
            disk,
        })
    }

    /// Materializes the disk layers of the snapshot with manifest `m` (see the [module
    /// documentation](self)), base first, so that each child is linked to a parent in
    /// place.
    async fn open_disk(&self, m: &Manifest) -> Result<Option<CachedDisk>> {
        let Some(d) = &m.disk else {
            return Ok(None);
        };
        let dir = self.root.join(LAYERS_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        let mkey = self.store.key(&manifest::manifest_key(m.snapshot_id()));
        for (i, l) in d.layers.iter().enumerate().rev() {
            let parent = d.layers.get(i + 1).map(|p| p.id.as_str());
            let lock = {
                let mut locks = self.layer_locks.lock().unwrap_or_else(|p| p.into_inner());
                Arc::clone(locks.entry(l.id.clone()).or_default())
            };
            let _held = lock.lock().await;
            self.materialize_layer(&dir, &mkey, l, parent).await?;
        }
        let top = d.layers.first().ok_or_else(|| Error::BadManifest {
            key: mkey.clone(),
            reason: "a disk without layers".into(),
        })?;
        Ok(Some(CachedDisk {
            layer: dir.join(layer_file(&top.id)),
            read_only: d.read_only,
        }))
    }

    /// Makes `layers/<id>.cdsk` the layer `l`, linked to `parent` (the id of the layer
    /// below it in the manifest), unless it is there already.
    async fn materialize_layer(
        &self,
        dir: &Path,
        mkey: &str,
        l: &manifest::DiskLayer,
        parent: Option<&str>,
    ) -> Result<()> {
        let path = dir.join(layer_file(&l.id));
        if path.exists() {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let tmp = dir.join(format!(
            ".{}-{}-{}.tmp",
            l.id,
            std::process::id(),
            SnapshotId::random()
        ));
        let r = async {
            let present = match &l.chunks {
                Some(c) => Some(self.download_layer_head(&tmp, l, c).await?),
                None => {
                    self.download_layer(&tmp, l).await?;
                    None
                }
            };
            let (tmp2, dir2, mkey2) = (tmp.clone(), dir.to_path_buf(), mkey.to_string());
            let (id, parent) = (l.id.clone(), parent.map(str::to_string));
            tokio::task::spawn_blocking(move || link_layer(&tmp2, &dir2, &mkey2, &id, parent))
                .await
                .map_err(|e| Error::Fetcher(format!("link task: {e}")))??;
            if let Some((present, digests)) = present {
                // The layer's chunk state beside it, before the layer itself is there.
                let side = |ext: &str| sidecar(&path, ext);
                let entry = serde_json::to_vec(l).unwrap_or_default();
                for (p, b) in [
                    (side("json"), &entry[..]),
                    (side("chunks"), &digests[..]),
                    (disk::remote::present_path(&path), &present[..]),
                ] {
                    std::fs::write(&p, b).map_err(|e| Error::io("write", &p, e))?;
                }
            }
            std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename into place", &path, e))?;
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| Error::io("fsync", dir, e))
        }
        .await;
        if let Err(e) = r {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        tracing::info!(layer = %l.id, bytes = l.object.size, ms = t0.elapsed().as_millis() as u64,
            "disk layer downloaded into the cache");
        Ok(())
    }

    /// Downloads layer object `l` into the new file `tmp` (range reads, each bounded in
    /// time like every store call), checks its SHA-256 and syncs it.
    async fn download_layer(&self, tmp: &Path, l: &manifest::DiskLayer) -> Result<()> {
        use futures::StreamExt;
        use sha2::Digest;
        use tokio::io::{AsyncSeekExt, AsyncWriteExt};
        let key = l.object.key();
        let size = l.object.size;
        let mut f = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .await
            .map_err(|e| Error::io("create", tmp, e))?;
        let mut h = sha2::Sha256::new();
        let key_ref = &key;
        let mut pieces = futures::stream::iter(0..size.div_ceil(LAYER_PIECE))
            .map(|i| async move {
                let (s, e) = (i * LAYER_PIECE, ((i + 1) * LAYER_PIECE).min(size));
                let _slot = self
                    .fetch_slots
                    .acquire()
                    .await
                    .map_err(|_| Error::Fetcher("the cache is closing".into()))?;
                let b = self.store.get_range(key_ref, s, e).await?;
                self.requests.fetch_add(1, Ordering::Relaxed);
                self.bytes_fetched
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                Ok::<_, Error>((s, b))
            })
            .buffered(LAYER_READS);
        while let Some(piece) = pieces.next().await {
            let (s, b) = piece?;
            h.update(&b);
            // Zero pieces stay holes (a layer's table and unused space are sparse).
            if b.iter().any(|&x| x != 0) {
                f.seek(std::io::SeekFrom::Start(s))
                    .await
                    .map_err(|e| Error::io("seek", tmp, e))?;
                f.write_all(&b)
                    .await
                    .map_err(|e| Error::io("write", tmp, e))?;
            }
        }
        let got = crate::hex(&h.finalize());
        if got != l.object.sha256 {
            return Err(Error::Checksum {
                key: self.store.key(&key),
                what: format!("disk layer {}", l.id),
                computed: got,
                expected: l.object.sha256.clone(),
            });
        }
        f.set_len(size)
            .await
            .map_err(|e| Error::io("size", tmp, e))?;
        f.sync_all().await.map_err(|e| Error::io("fsync", tmp, e))
    }

    /// Starts a lazily read layer file in the new file `tmp`: its chunk checksums, and
    /// the chunks holding its header slots and allocation table (all a disk opening it
    /// reads before its data), each verified; the rest of the file is a hole. Returns the
    /// presence map (one byte per chunk) and the checksums, as stored beside the layer.
    async fn download_layer_head(
        &self,
        tmp: &Path,
        l: &manifest::DiskLayer,
        c: &manifest::LayerChunks,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let table = self.get_object(&c.table).await?;
        let digests = digests_of(&table);
        let size = l.object.size;
        let first = self.fetch_layer_chunk(l, c.chunk_size, &digests, 0).await?;
        let head_len = (disk::HEADER_SLOTS as usize * disk::HEADER_SIZE as usize).min(first.len());
        let (h, _) = disk::decode_slots(tmp, &first[..head_len]).map_err(|e| Error::Disk {
            path: tmp.to_path_buf(),
            source: e,
        })?;
        let table_end = h.table_offset.saturating_add(h.table_bytes());
        if table_end > size {
            return Err(Error::BadManifest {
                key: self.store.key(&l.object.key()),
                reason: format!("disk layer {}: its table ends past the object", l.id),
            });
        }
        let mut want: Vec<u64> = Vec::new();
        if h.table_bytes() > 0 {
            want.extend(h.table_offset / c.chunk_size..=(table_end - 1) / c.chunk_size);
        }
        want.retain(|&i| i != 0);
        let rest =
            futures::future::try_join_all(
                want.iter().map(|&i| {
                    let d = &digests;
                    async move {
                        Ok::<_, Error>((i, self.fetch_layer_chunk(l, c.chunk_size, d, i).await?))
                    }
                }),
            )
            .await?;
        let (tmp, chunk_size, count) = (tmp.to_path_buf(), c.chunk_size, digests.len());
        let present = blocking(move || -> Result<Vec<u8>> {
            let mut present = vec![0u8; count];
            let f = File::options()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .map_err(|e| Error::io("create", &tmp, e))?;
            f.set_len(size).map_err(|e| Error::io("size", &tmp, e))?;
            for (i, b) in std::iter::once((0, first)).chain(rest) {
                f.write_all_at(&b, i * chunk_size)
                    .map_err(|e| Error::io("write", &tmp, e))?;
                present[i as usize] = 1;
            }
            f.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
            Ok(present)
        })
        .await??;
        Ok((present, table.to_vec()))
    }

    /// Chunk `i` of disk layer `l`'s object, fetched with one range read and verified.
    async fn fetch_layer_chunk(
        &self,
        l: &manifest::DiskLayer,
        chunk_size: u64,
        digests: &[[u8; 32]],
        i: u64,
    ) -> Result<Bytes> {
        let key = l.object.key();
        let (s, e) = (i * chunk_size, ((i + 1) * chunk_size).min(l.object.size));
        let want = digests.get(i as usize).ok_or_else(|| Error::BadManifest {
            key: self.store.key(&key),
            reason: format!("disk layer {}: no checksum for chunk {i}", l.id),
        })?;
        let _slot = self
            .fetch_slots
            .acquire()
            .await
            .map_err(|_| Error::Fetcher("the cache is closing".into()))?;
        let b = self.store.get_range(&key, s, e).await?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_fetched
            .fetch_add(b.len() as u64, Ordering::Relaxed);
        let got = sha256_hex(&b);
        if got != crate::hex(want) {
            return Err(Error::Checksum {
                key: self.store.key(&key),
                what: format!("disk layer {} chunk {i} (bytes {s}..{e})", l.id),
                computed: got,
                expected: crate::hex(want),
            });
        }
        Ok(b)
    }

    /// The lazily read layer `id` of this cache, opened for filling.
    fn lazy_layer(&self, id: &str) -> Result<Arc<LazyLayer>> {
        if manifest::parse_layer_id(id).is_none() {
            return Err(Error::InvalidInput(format!(
                "{id:?} is not a disk layer id"
            )));
        }
        if let Some(l) = self
            .lazy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .open
            .get(id)
        {
            return Ok(Arc::clone(l));
        }
        let path = self.root.join(LAYERS_DIR).join(layer_file(id));
        let rw = |p: &Path| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|e| Error::io("open", p, e))
        };
        let file = rw(&path)?;
        let ppath = disk::remote::present_path(&path);
        let present = rw(&ppath)?;
        let entry = cached_layer_entry(&path, id)?.ok_or_else(|| {
            Error::Fetcher(format!("{}: not a layer read lazily", path.display()))
        })?;
        let chunks = entry.chunks.clone().ok_or_else(|| {
            Error::Fetcher(format!(
                "{}: its entry has no chunk checksums",
                path.display()
            ))
        })?;
        let cpath = sidecar(&path, "chunks");
        let table = std::fs::read(&cpath).map_err(|e| Error::io("read", &cpath, e))?;
        if sha256_hex(&table) != chunks.table.sha256
            || table.len() as u64 != 32 * chunks.count(entry.object.size)
        {
            return Err(Error::Fetcher(format!(
                "{}: does not match its entry",
                cpath.display()
            )));
        }
        let l = Arc::new(LazyLayer {
            id: id.to_string(),
            path,
            file,
            present,
            chunk_size: chunks.chunk_size,
            digests: digests_of(&table),
            entry,
        });
        let mut lazy = self.lazy.lock().unwrap_or_else(|p| p.into_inner());
        Ok(Arc::clone(lazy.open.entry(id.to_string()).or_insert(l)))
    }

    /// Makes bytes `offset..offset + len` of lazily read disk layer `id` present in its
    /// file (fetching the chunks that are not; concurrent misses of one chunk share one
    /// fetch). Layer files are not counted against the cache's limit.
    pub async fn ensure_layer(self: &Arc<Self>, id: &str, offset: u64, len: u64) -> Result<()> {
        let l = self.lazy_layer(id)?;
        let size = l.entry.object.size;
        if len == 0 || offset >= size {
            return Ok(());
        }
        let end = offset.saturating_add(len).min(size);
        let (first, last) = (offset / l.chunk_size, (end - 1) / l.chunk_size);
        let mut flags = vec![0u8; (last - first + 1) as usize];
        l.present
            .read_exact_at(&mut flags, first)
            .map_err(|e| Error::io("read", disk::remote::present_path(&l.path), e))?;
        let futs: Vec<ChunkFuture> = (first..=last)
            .filter(|&c| flags[(c - first) as usize] != 1)
            .map(|c| {
                let mut lazy = self.lazy.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(f) = lazy.inflight.get(&(l.id.clone(), c)) {
                    return f.clone();
                }
                let this = Arc::clone(self);
                let l2 = Arc::clone(&l);
                let fut: BoxFuture<'static, std::result::Result<(), String>> = async move {
                    let r = this
                        .fill_layer_chunk(&l2, c)
                        .await
                        .map_err(|e| e.to_string());
                    this.lazy
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .inflight
                        .remove(&(l2.id.clone(), c));
                    r
                }
                .boxed();
                let shared = fut.shared();
                lazy.inflight.insert((l.id.clone(), c), shared.clone());
                shared
            })
            .collect();
        for r in futures::future::join_all(futs).await {
            r.map_err(Error::Fetcher)?;
        }
        Ok(())
    }

    /// Fetches every chunk of lazily read disk layer `id` not there yet, then removes its
    /// presence map: the file is an ordinary layer file from then on (what the store has
    /// of it, its entry, stays beside it for publishing). A layer that is not read lazily
    /// (whole already) is left as it is.
    pub async fn complete_layer(self: &Arc<Self>, id: &str) -> Result<()> {
        if manifest::parse_layer_id(id).is_none() {
            return Err(Error::InvalidInput(format!(
                "{id:?} is not a disk layer id"
            )));
        }
        let path = self.root.join(LAYERS_DIR).join(layer_file(id));
        if !disk::remote::is_filled_on_demand(&path) {
            return Ok(());
        }
        let l = self.lazy_layer(id)?;
        self.ensure_layer(id, 0, l.entry.object.size).await?;
        let mut flags = vec![0u8; l.digests.len()];
        l.present
            .read_exact_at(&mut flags, 0)
            .map_err(|e| Error::io("read", disk::remote::present_path(&l.path), e))?;
        if flags.iter().any(|&f| f != 1) {
            return Err(Error::Fetcher(format!(
                "{}: chunks still missing",
                path.display()
            )));
        }
        let p = disk::remote::present_path(&path);
        std::fs::remove_file(&p).map_err(|e| Error::io("remove", &p, e))?;
        self.lazy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .open
            .remove(id);
        tracing::info!(layer = %id, "disk layer complete in the cache");
        Ok(())
    }

    /// Fetches chunk `c` of a lazily read layer into its file: written and synced, then
    /// marked present.
    async fn fill_layer_chunk(&self, l: &Arc<LazyLayer>, c: u64) -> Result<()> {
        let mut flag = [0u8; 1];
        let ppath = || disk::remote::present_path(&l.path);
        l.present
            .read_exact_at(&mut flag, c)
            .map_err(|e| Error::io("read", ppath(), e))?;
        if flag[0] == 1 {
            return Ok(());
        }
        let b = self
            .fetch_layer_chunk(&l.entry, l.chunk_size, &l.digests, c)
            .await?;
        let l2 = Arc::clone(l);
        blocking(move || -> Result<()> {
            l2.file
                .write_all_at(&b, c * l2.chunk_size)
                .map_err(|e| Error::io("write", &l2.path, e))?;
            l2.file
                .sync_data()
                .map_err(|e| Error::io("fsync", &l2.path, e))?;
            l2.present
                .write_all_at(&[1], c)
                .map_err(|e| Error::io("write", disk::remote::present_path(&l2.path), e))
        })
        .await??;
        self.chunks_fetched.fetch_add(1, Ordering::Relaxed);
        Ok(())
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
        Ok(layer)
    }

    /// Verifies the chunks a previous run marked present; a bad one is dropped (fetched
    /// again when needed).
    fn verify_present(&self, l: &CachedLayer) -> Result<()> {
        let present: Vec<u64> = {
            let inner = lock(&self.inner);
            inner.ticks.get(&l.id).map_or(Vec::new(), |t| {
                (0..t.len() as u64)
                    .filter(|&c| t[c as usize] != 0)
                    .collect()
            })
        };
        for c in present {
            let (s, e) = l.manifest.chunk_range(c);
            let mut buf = vec![0u8; (e - s) as usize];
            for p in &l.placements {
                let (ps, pe) = (p.packed.max(s), (p.packed + p.len).min(e));
                if ps >= pe {
                    continue;
                }
                let off = p.file + (ps - p.packed);
                l.mem
                    .read_exact_at(&mut buf[(ps - s) as usize..(pe - s) as usize], off)
                    .map_err(|e| Error::io("read", l.dir.join(MEMORY_FILE), e))?;
            }
            if sha256_hex(&buf) != l.manifest.memory.chunks[c as usize] {
                tracing::warn!(snapshot = %l.id, chunk = c, "cached chunk fails its checksum: dropped");
                let mut inner = lock(&self.inner);
                self.evict_locked(&mut inner, l, c);
            }
        }
        Ok(())
    }

    async fn get_object(&self, o: &manifest::ObjectRef) -> Result<Bytes> {
        let key = o.key();
        let b = match &o.inline {
            Some(text) => {
                use base64::Engine;
                Bytes::from(
                    base64::engine::general_purpose::STANDARD
                        .decode(text)
                        .map_err(|e| Error::BadManifest {
                            key: self.store.key(&key),
                            reason: format!("inline object: {e}"),
                        })?,
                )
            }
            None => {
                // No more than the manifest says it is.
                let b = self.store.get_max(&key, o.size).await?;
                self.requests.fetch_add(1, Ordering::Relaxed);
                self.bytes_fetched
                    .fetch_add(b.len() as u64, Ordering::Relaxed);
                b
            }
        };
        let got = sha256_hex(&b);
        if b.len() as u64 != o.size || got != o.sha256 {
            return Err(Error::Checksum {
                key: self.store.key(&key),
                what: format!("the object ({} bytes, manifest says {})", b.len(), o.size),
                computed: got,
                expected: o.sha256.clone(),
            });
        }
        Ok(b)
    }

    /// Fetches snapshot `id`'s manifest, small objects and lead object (its working set's
    /// chunks) into a new cache directory: one round trip to the store when the lead
    /// object is good, whose key, like the manifest's, follows from the id.
    async fn download(self: &Arc<Self>, id: SnapshotId) -> Result<()> {
        let t0 = std::time::Instant::now();
        let key = manifest::manifest_key(id);
        let lead_key = manifest::lead_key(id);
        // The new directory's files are created while the store answers.
        let tmp = self.root.join("snapshots").join(format!(
            ".{id}-{}-{}",
            std::process::id(),
            SnapshotId::random()
        ));
        let prep = {
            let tmp = tmp.clone();
            tokio::task::spawn_blocking(move || NewDir::create(&tmp))
        };
        let fetched = self.fetch_opening(id, &key, &lead_key).await;
        let files = prep
            .await
            .map_err(|e| Error::Fetcher(format!("download task: {e}")))
            .and_then(|r| r);
        let r = match (fetched, files) {
            (Ok(f), Ok(files)) => self.write_opening(id, &tmp, files, f).await,
            (Err(e), _) | (_, Err(e)) => Err(e),
        };
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        let (m, early_bytes, written) = r?;
        let written_us = t0.elapsed().as_micros() as u64;
        // Reserved for chunks that did not pass.
        self.unreserve(early_bytes - written);
        let dir = self.snapshot_dir(id);
        let ours = match std::fs::rename(&tmp, &dir) {
            Ok(()) => true,
            Err(_) if dir.join(PRESENT_FILE).exists() => {
                // Another download of the same snapshot finished first.
                let _ = std::fs::remove_dir_all(&tmp);
                false
            }
            Err(e) => {
                self.unreserve(written);
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(Error::io("rename into place", &dir, e));
            }
        };
        let counted = if ours { written } else { 0 };
        if !ours {
            self.unreserve(written);
        }
        if !self.load_dir(id, &dir, Some(m), counted)? {
            self.unreserve(counted);
        }
        let loaded_us = t0.elapsed().as_micros() as u64;
        lock(&self.inner).verified.insert(id, true);
        // Chunks of the working set the lead object did not bring: from the data object.
        let missing = {
            let inner = lock(&self.inner);
            let ws = inner
                .layers
                .get(&id)
                .map_or(0, |l| l.manifest.working_set_chunks());
            inner.ticks.get(&id).map_or(Vec::new(), |t| {
                (0..ws)
                    .filter(|&c| t.get(c as usize) == Some(&0))
                    .collect::<Vec<u64>>()
            })
        };
        if !missing.is_empty() {
            let layer = lock(&self.inner).layers.get(&id).cloned();
            if let Some(layer) = layer {
                let futs: Vec<ChunkFuture> = missing
                    .into_iter()
                    .filter_map(|c| self.chunk_future(&layer, c))
                    .collect();
                for r in futures::future::join_all(futs).await {
                    r.map_err(Error::Fetcher)?;
                }
            }
        }
        tracing::debug!(snapshot = %id, written_us, loaded_us,
            total_us = t0.elapsed().as_micros() as u64, "snapshot opened into the cache");
        Ok(())
    }

    /// What opening snapshot `id` needs from the store: its manifest and lead object at
    /// once, then any object too large for the manifest.
    async fn fetch_opening(&self, id: SnapshotId, key: &str, lead_key: &str) -> Result<Opening> {
        let (mbytes, lead) = futures::join!(
            self.store.get_max(key, manifest::MAX_MANIFEST_BYTES as u64),
            self.store.get(lead_key)
        );
        self.requests.fetch_add(2, Ordering::Relaxed);
        let mbytes = mbytes?;
        let lead = match lead {
            Ok(b) => Some(b),
            Err(Error::Missing { .. }) => None,
            Err(e) => {
                // Only an accelerator: the chunks are read from the data object instead,
                // where a store that fails fails the open.
                tracing::debug!(snapshot = %id, error = %e, "lead object not read");
                None
            }
        };
        let lead_len = lead.as_ref().map_or(0, |b| b.len() as u64);
        self.bytes_fetched
            .fetch_add(mbytes.len() as u64 + lead_len, Ordering::Relaxed);
        let m = Manifest::parse(&self.store.key(key), &mbytes)?;
        if m.snapshot_id() != id {
            return Err(Error::BadManifest {
                key: self.store.key(key),
                reason: format!("names snapshot {}", m.id),
            });
        }
        // The lead object's chunks, if it is the one the manifest names (each is checked
        // against its checksum as it is written).
        let lead = lead.filter(|b| {
            let ok = m
                .memory
                .lead
                .as_ref()
                .is_some_and(|l| l.size == b.len() as u64);
            if !ok {
                tracing::warn!(snapshot = %id, bytes = b.len(),
                    "lead object does not match the manifest: ignored");
            }
            ok
        });
        let early: Vec<(u64, Bytes)> = match &lead {
            Some(b) => (0..m.working_set_chunks())
                .map(|c| {
                    let (s, e) = m.chunk_range(c);
                    (c, b.slice(s as usize..e as usize))
                })
                .collect(),
            None => Vec::new(),
        };
        // Objects too large for the manifest, if any: a second round trip.
        let ws_fut = async {
            match &m.working_set {
                Some(o) => self.get_object(o).await.map(Some),
                None => Ok(None),
            }
        };
        let (state, head, ws) = futures::try_join!(
            self.get_object(&m.state),
            self.get_object(&m.memory.head),
            ws_fut,
        )?;
        Ok(Opening {
            mbytes,
            m,
            state,
            head,
            ws,
            early,
        })
    }

    /// Writes what [`ChunkCache::fetch_opening`] fetched into the new directory `tmp`
    /// (its files created by [`NewDir::create`]), checking it against the manifest, with
    /// the lead object's chunks that pass their checksums marked present. Returns the
    /// manifest, the bytes reserved for chunks and the bytes of those written.
    async fn write_opening(
        &self,
        id: SnapshotId,
        tmp: &Path,
        files: NewDir,
        o: Opening,
    ) -> Result<(Manifest, u64, u64)> {
        let early_bytes: u64 = o.early.iter().map(|(_, b)| b.len() as u64).sum();
        self.reserve(early_bytes)?;
        let m2 = o.m.clone();
        let tmp2 = tmp.to_path_buf();
        let r = blocking(move || -> Result<u64> {
            let m2 = &o.m;
            let w = |f: &File, name: &str, b: &[u8]| {
                f.write_all_at(b, 0)
                    .map_err(|e| Error::io("write", tmp2.join(name), e))
            };
            w(&files.manifest, MANIFEST_FILE, &o.mbytes)?;
            w(&files.state, STATE_FILE, &o.state)?;
            let h = state_file::read_header(&tmp2.join(STATE_FILE))?;
            if h.meta.id != id
                || h.meta.mem_size != m2.mem_size
                || h.meta.kind != m2.snapshot_kind()
            {
                return Err(Error::BadManifest {
                    key: id.to_string(),
                    reason: "state file does not match the manifest (id, kind or size)".into(),
                });
            }
            if let Some(ws) = &o.ws {
                let p = tmp2.join(WORKING_SET_FILE);
                std::fs::write(&p, ws).map_err(|e| Error::io("write", p, e))?;
            }
            let mp = tmp2.join(MEMORY_FILE);
            let f = &files.memory;
            f.write_all_at(&o.head, 0)
                .map_err(|e| Error::io("write", &mp, e))?;
            f.set_len(m2.memory.head.size + m2.mem_size)
                .map_err(|e| Error::io("size", &mp, e))?;
            // The header and tables must describe what the manifest says.
            let mf = MemoryFile::open_fetched(&mp, data_bitmap(m2), Fetcher(Arc::new(NoFetch)))?;
            mf.check_state(&h)?;
            if mf.header().data_offset != m2.memory.head.size {
                return Err(Error::BadManifest {
                    key: id.to_string(),
                    reason: "memory head size is not the file's data offset".into(),
                });
            }
            drop(mf);
            // The lead object's chunks that pass their checksums are in the directory
            // from the start.
            let mut present = vec![0u8; m2.chunk_count() as usize];
            let mut written = 0;
            let places = placements(m2);
            for (c, bytes) in &o.early {
                if sha256_hex(bytes) != m2.memory.chunks[*c as usize] {
                    tracing::warn!(snapshot = %id, chunk = c,
                        "lead object chunk fails its checksum: read from the data object");
                    continue;
                }
                write_chunk(f, &places, m2.chunk_range(*c), bytes)
                    .map_err(|e| Error::io("write chunk", &mp, e))?;
                present[*c as usize] = 1;
                written += bytes.len() as u64;
            }
            w(&files.present, PRESENT_FILE, &present)?;
            Ok(written)
        })
        .await
        .and_then(|r| r);
        match r {
            Ok(written) => Ok((m2, early_bytes, written)),
            Err(e) => {
                self.unreserve(early_bytes);
                Err(e)
            }
        }
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

    /// Takes a lease on layers (held by a connected VM process): their chunks are never
    /// evicted while it is held.
    pub fn lease(&self, ids: &[SnapshotId]) {
        let mut inner = lock(&self.inner);
        for id in ids {
            *inner.leases.entry(*id).or_default() += 1;
        }
    }

    /// Gives back leases taken with [`ChunkCache::lease`].
    pub fn release(&self, ids: &[SnapshotId]) {
        let mut inner = lock(&self.inner);
        for id in ids {
            if let Some(n) = inner.leases.get_mut(id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    inner.leases.remove(id);
                }
            }
        }
    }

    /// Makes bytes `offset..offset + len` of snapshot `id`'s memory file present.
    pub async fn ensure(self: &Arc<Self>, id: SnapshotId, offset: u64, len: u64) -> Result<()> {
        let layer = lock(&self.inner)
            .layers
            .get(&id)
            .cloned()
            .ok_or_else(|| Error::Fetcher(format!("snapshot {id} is not open")))?;
        let chunks = chunks_for(
            &layer.placements,
            layer.manifest.memory.chunk_size,
            offset,
            len,
        );
        let futs: Vec<ChunkFuture> = chunks
            .into_iter()
            .filter_map(|c| self.chunk_future(&layer, c))
            .collect();
        for r in futures::future::join_all(futs).await {
            r.map_err(Error::Fetcher)?;
        }
        Ok(())
    }

    /// The future that makes chunk `c` present, shared with concurrent misses; `None`
    /// if it is present already.
    fn chunk_future(self: &Arc<Self>, layer: &Arc<CachedLayer>, c: u64) -> Option<ChunkFuture> {
        let mut inner = lock(&self.inner);
        inner.tick += 1;
        let tick = inner.tick;
        let t = inner.ticks.get_mut(&layer.id)?.get_mut(c as usize)?;
        if *t != 0 {
            *t = tick;
            return None;
        }
        if let Some(f) = inner.inflight.get(&(layer.id, c)) {
            return Some(f.clone());
        }
        let this = Arc::clone(self);
        let l = Arc::clone(layer);
        let fut: BoxFuture<'static, std::result::Result<(), String>> = async move {
            let r = this.fetch_chunk(&l, c).await.map_err(|e| e.to_string());
            lock(&this.inner).inflight.remove(&(l.id, c));
            r
        }
        .boxed();
        let shared = fut.shared();
        inner.inflight.insert((layer.id, c), shared.clone());
        Some(shared)
    }

    async fn fetch_chunk(self: &Arc<Self>, l: &Arc<CachedLayer>, c: u64) -> Result<()> {
        let bytes = self.fetch_chunk_bytes(&l.manifest, c).await?;
        self.install_chunk(l, c, bytes).await
    }

    /// Chunk `c` of a snapshot's memory data, fetched and verified.
    async fn fetch_chunk_bytes(&self, m: &Manifest, c: u64) -> Result<Bytes> {
        let (s, e) = m.chunk_range(c);
        let key = m.memory.data.key();
        let _slot = self
            .fetch_slots
            .acquire()
            .await
            .map_err(|_| Error::Fetcher("the cache is closing".into()))?;
        let bytes = self.store.get_range(&key, s, e).await?;
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.bytes_fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        let got = sha256_hex(&bytes);
        let expected = &m.memory.chunks[c as usize];
        if &got != expected {
            return Err(Error::Checksum {
                key: self.store.key(&key),
                what: format!("chunk {c} (bytes {s}..{e})"),
                computed: got,
                expected: expected.clone(),
            });
        }
        Ok(bytes)
    }

    /// Writes a verified chunk into the cache (making room first), unless it is there.
    async fn install_chunk(
        self: &Arc<Self>,
        l: &Arc<CachedLayer>,
        c: u64,
        bytes: Bytes,
    ) -> Result<()> {
        let present = lock(&self.inner)
            .ticks
            .get(&l.id)
            .and_then(|t| t.get(c as usize))
            .is_some_and(|&t| t != 0);
        if present {
            return Ok(());
        }
        self.reserve(bytes.len() as u64)?;
        let this = Arc::clone(self);
        let l2 = Arc::clone(l);
        tokio::task::spawn_blocking(move || this.store_chunk(&l2, c, &bytes))
            .await
            .map_err(|e| Error::Fetcher(format!("write task: {e}")))??;
        self.chunks_fetched.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Writes a verified chunk into the memory file, then marks it present.
    fn store_chunk(&self, l: &CachedLayer, c: u64, bytes: &[u8]) -> Result<()> {
        write_chunk(&l.mem, &l.placements, l.manifest.chunk_range(c), bytes)
            .map_err(|e| Error::io("write chunk", l.dir.join(MEMORY_FILE), e))?;
        l.present
            .write_all_at(&[1], c)
            .map_err(|e| Error::io("write", l.dir.join(PRESENT_FILE), e))?;
        let mut inner = lock(&self.inner);
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(t) = inner
            .ticks
            .get_mut(&l.id)
            .and_then(|t| t.get_mut(c as usize))
        {
            *t = tick;
        }
        Ok(())
    }

    /// Gives back `n` bytes [`ChunkCache::reserve`] counted and nothing used.
    fn unreserve(&self, n: u64) {
        let mut inner = lock(&self.inner);
        inner.used = inner.used.saturating_sub(n);
    }

    /// Makes room for `n` more bytes (evicting) and counts them as used.
    fn reserve(&self, n: u64) -> Result<()> {
        let mut inner = lock(&self.inner);
        while inner.used + n > self.limit {
            // The least recently used present chunk of a layer nobody leases.
            let mut best: Option<(u64, SnapshotId, u64)> = None;
            for (id, ticks) in &inner.ticks {
                if inner.leases.get(id).copied().unwrap_or(0) > 0 {
                    continue;
                }
                for (c, &t) in ticks.iter().enumerate() {
                    if t != 0 && best.is_none_or(|(bt, _, _)| t < bt) {
                        best = Some((t, *id, c as u64));
                    }
                }
            }
            let Some((_, id, c)) = best else {
                return Err(Error::CacheFull {
                    needed: n,
                    held: inner.used,
                    limit: self.limit,
                });
            };
            let Some(layer) = inner.layers.get(&id).cloned() else {
                break;
            };
            self.evict_locked(&mut inner, &layer, c);
        }
        inner.used += n;
        Ok(())
    }

    fn evict_locked(&self, inner: &mut Inner, l: &CachedLayer, c: u64) {
        let Some(t) = inner
            .ticks
            .get_mut(&l.id)
            .and_then(|t| t.get_mut(c as usize))
        else {
            return;
        };
        if *t == 0 {
            return;
        }
        *t = 0;
        // Absent first, then the bytes go: a reader never sees "present" over a hole.
        let _ = l.present.write_all_at(&[0], c);
        let (s, e) = l.manifest.chunk_range(c);
        for p in &l.placements {
            let (ps, pe) = (p.packed.max(s), (p.packed + p.len).min(e));
            if ps < pe {
                punch_hole(&l.mem, p.file + (ps - p.packed), pe - ps);
            }
        }
        inner.used = inner.used.saturating_sub(e - s);
        self.chunks_evicted.fetch_add(1, Ordering::Relaxed);
    }
}

/// What [`ChunkCache::fetch_opening`] brings from the store.
struct Opening {
    mbytes: Bytes,
    m: Manifest,
    state: Bytes,
    head: Bytes,
    ws: Option<Bytes>,
    /// The working set's chunks from the lead object, not checked yet.
    early: Vec<(u64, Bytes)>,
}

/// A new snapshot directory's files, created before their content is known.
struct NewDir {
    manifest: File,
    state: File,
    memory: File,
    present: File,
}

impl NewDir {
    fn create(dir: &Path) -> Result<NewDir> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let new = |name: &str| {
            let p = dir.join(name);
            OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&p)
                .map_err(|e| Error::io("create", p, e))
        };
        Ok(NewDir {
            manifest: new(MANIFEST_FILE)?,
            state: new(STATE_FILE)?,
            memory: new(MEMORY_FILE)?,
            present: new(PRESENT_FILE)?,
        })
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

/// Writes the bytes of the chunk at `range` of the packed data to the memory file `f`,
/// at the file offsets of its pages.
fn write_chunk(
    f: &File,
    places: &[Placement],
    (s, e): (u64, u64),
    bytes: &[u8],
) -> std::io::Result<()> {
    for p in places {
        let (ps, pe) = (p.packed.max(s), (p.packed + p.len).min(e));
        if ps >= pe {
            continue;
        }
        f.write_all_at(
            &bytes[(ps - s) as usize..(pe - s) as usize],
            p.file + (ps - p.packed),
        )?;
    }
    Ok(())
}

/// A file beside layer file `layer`: `<layer file name>.<ext>`.
fn sidecar(layer: &Path, ext: &str) -> PathBuf {
    let mut name = layer.file_name().unwrap_or_default().to_os_string();
    name.push(".");
    name.push(ext);
    layer.with_file_name(name)
}

/// 32-byte checksums stored end to end.
fn digests_of(table: &[u8]) -> Vec<[u8; 32]> {
    table
        .chunks_exact(32)
        .map(|d| {
            let mut a = [0u8; 32];
            a.copy_from_slice(d);
            a
        })
        .collect()
}

/// The store's entry of a disk layer file a cache read lazily (`Some`: the file at
/// `layer` is one, its entry kept beside it, even once complete: its header was relinked
/// here, so its bytes are no longer the object's), checked to be layer `id`. A layer
/// file filled on demand whose entry is missing or unreadable is an error: its bytes are
/// not all there, so it cannot be hashed or uploaded as it is.
pub fn cached_layer_entry(layer: &Path, id: &str) -> Result<Option<manifest::DiskLayer>> {
    let p = sidecar(layer, "json");
    if !disk::remote::is_filled_on_demand(layer) && !p.exists() {
        return Ok(None);
    }
    let bad = |why: String| {
        Error::InvalidInput(format!(
            "{}: a disk layer read lazily from a store, {why}",
            layer.display()
        ))
    };
    let b = std::fs::read(&p).map_err(|e| bad(format!("and its entry {}: {e}", p.display())))?;
    let e: manifest::DiskLayer =
        serde_json::from_slice(&b).map_err(|e| bad(format!("and its entry is bad: {e}")))?;
    if e.id != id {
        return Err(bad(format!("whose entry names layer {}", e.id)));
    }
    Ok(Some(e))
}

/// The file name of disk layer `id` (hex) in [`LAYERS_DIR`].
pub fn layer_file(id: &str) -> String {
    format!("{id}.cdsk")
}

/// Checks that the downloaded layer at `tmp` is layer `id` with the parent the manifest
/// gives (`parent`, whose file is in `dir` already), and records that file as its parent.
fn link_layer(tmp: &Path, dir: &Path, mkey: &str, id: &str, parent: Option<String>) -> Result<()> {
    let derr = |source| Error::Disk {
        path: tmp.to_path_buf(),
        source,
    };
    let bad = |reason: String| Error::BadManifest {
        key: mkey.to_string(),
        reason: format!("disk layer {id}: {reason}"),
    };
    let h = disk::Layer::open(tmp, false)
        .map_err(derr)?
        .header()
        .clone();
    if disk::id_hex(&h.layer_id) != id {
        return Err(bad(format!(
            "the object is layer {}",
            disk::id_hex(&h.layer_id)
        )));
    }
    if !h.frozen() {
        return Err(bad("the object is not a frozen layer".into()));
    }
    match (h.parent.map(|p| disk::id_hex(&p.id)), parent) {
        (None, None) => Ok(()),
        (Some(recorded), Some(listed)) if recorded == listed => {
            disk::ops::set_parent_path(tmp, &dir.join(layer_file(&listed))).map_err(derr)
        }
        (recorded, listed) => Err(bad(format!(
            "its parent is {}, the manifest lists {} below it",
            recorded.as_deref().unwrap_or("none"),
            listed.as_deref().unwrap_or("none")
        ))),
    }
}

fn punch_hole(f: &File, offset: u64, len: u64) {
    use nix::fcntl::{fallocate, FallocateFlags};
    let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    if let Err(e) = fallocate(f.as_raw_fd(), flags, offset as i64, len as i64) {
        tracing::warn!(error = %e, "punching an evicted chunk's pages");
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
