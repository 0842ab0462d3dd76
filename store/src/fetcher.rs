//! The fetcher: the one process that reaches the store on behalf of VM processes.
//!
//! A VM process never opens a network socket (its system-call filter allows only Unix
//! sockets). To restore a published snapshot it connects to a fetcher's Unix socket
//! ([`FetchClient::connect`]), asks it to open the snapshot (the fetcher downloads the
//! manifests, state files and memory headers into its [`ChunkCache`]), and opens the
//! cache's memory files read-only with a [`ChunkFetch`] per layer. A read of a chunk the
//! cache already holds costs one `pread` of the presence map; a miss asks the fetcher and
//! waits, bounded, for its answer.
//!
//! Wire protocol: each message is a 4-byte little-endian length, then that many bytes of
//! JSON ([`Request`] one way, [`Response`] the other), one answer per request, in order.
//! A connection holds a lease on every snapshot it opened until it closes.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use snapshot::fetch::{ChunkFetch, Fetcher};
use snapshot::memory_file::MemoryFile;
use snapshot::SnapshotId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cache::{self, CacheStats, ChunkCache};
use crate::manifest::{self, chunks_for, layout_placements, Layout, Placement};
use crate::{Error, Result};

/// Largest message accepted either way.
pub const MAX_FRAME: usize = 8 << 20;

/// A request to the fetcher.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Make a snapshot and its bases available; lease them for this connection.
    Open {
        /// The snapshot (32 hex digits).
        id: String,
        /// Also check that the store has every object the snapshot may read from it
        /// later ([`ChunkCache::open_snapshot_checked`]); absent: no.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        check: bool,
    },
    /// Make bytes of an open snapshot's memory file present.
    Ensure {
        /// The layer.
        id: String,
        /// First byte.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Start fetching ranges of an open snapshot's memory file; answered at once.
    Prefetch {
        /// The layer.
        id: String,
        /// `[offset, len]` pairs.
        ranges: Vec<[u64; 2]>,
    },
    /// Make bytes of a disk layer file that is read lazily present (`layers/<id>.cdsk`).
    EnsureLayer {
        /// The disk layer (32 hex digits).
        layer: String,
        /// First byte of the file.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Fetch every chunk of a disk layer file that is read lazily, then make it an
    /// ordinary layer file (its presence map removed): for what needs the whole file (a
    /// VM process that forks starts children that open it anew).
    CompleteLayer {
        /// The disk layer (32 hex digits).
        layer: String,
    },
    /// The cache's counters.
    Stats,
}

/// The fetcher's answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Response {
    /// Whether the request succeeded.
    pub ok: bool,
    /// Why not.
    #[serde(default)]
    pub error: Option<String>,
    /// For `open`: the layers, base first: id, cache directory, layout.
    #[serde(default)]
    pub layers: Vec<(String, PathBuf, Layout)>,
    /// For `stats`.
    #[serde(default)]
    pub stats: Option<CacheStats>,
    /// For `open` of a snapshot with a disk: its top layer in the fetcher's cache (absent
    /// from fetchers of older builds, and for snapshots without a disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<RemoteDisk>,
}

/// The disk of a snapshot opened through a fetcher: the layer files are in the fetcher's
/// cache (`layers/`), complete and linked to each other; a VM's overlay goes on `layer`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteDisk {
    /// The top layer's file (absolute).
    pub layer: PathBuf,
    /// The disk was read-only.
    pub read_only: bool,
}

impl Response {
    fn err(e: impl std::fmt::Display) -> Response {
        Response {
            ok: false,
            error: Some(e.to_string()),
            ..Default::default()
        }
    }
}

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {n} bytes"),
        ));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

/// Serves fetch requests on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::UnixListener, cache: Arc<ChunkCache>) {
    loop {
        match listener.accept().await {
            Ok((s, _)) => {
                tokio::spawn(connection(s, Arc::clone(&cache)));
            }
            Err(e) => {
                tracing::warn!(error = %e, "fetcher accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn connection(mut s: tokio::net::UnixStream, cache: Arc<ChunkCache>) {
    let mut leased: Vec<SnapshotId> = Vec::new();
    loop {
        let frame = match read_frame(&mut s).await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "fetcher connection");
                break;
            }
        };
        let resp = match serde_json::from_slice::<Request>(&frame) {
            Ok(req) => handle(&cache, req, &mut leased).await,
            Err(e) => Response::err(format!("bad request: {e}")),
        };
        let body = serde_json::to_vec(&resp).unwrap_or_default();
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        if s.write_all(&out).await.is_err() {
            break;
        }
    }
    cache.release(&leased);
}

fn opened(leased: &[SnapshotId], id: &str) -> std::result::Result<SnapshotId, String> {
    let id = manifest::parse_snapshot_id(id).map_err(|e| e.to_string())?;
    if leased.contains(&id) {
        Ok(id)
    } else {
        Err(format!("snapshot {id} was not opened on this connection"))
    }
}

async fn handle(cache: &Arc<ChunkCache>, req: Request, leased: &mut Vec<SnapshotId>) -> Response {
    match req {
        Request::Open { id, check } => {
            let id = match manifest::parse_snapshot_id(&id) {
                Ok(id) => id,
                Err(e) => return Response::err(e),
            };
            let opened = if check {
                cache.open_snapshot_checked(id).await
            } else {
                cache.open_snapshot(id).await
            };
            match opened {
                Ok(opened) => {
                    let chain = opened.layers;
                    let ids: Vec<SnapshotId> = chain.iter().map(|l| l.id()).collect();
                    cache.lease(&ids);
                    leased.extend(&ids);
                    Response {
                        ok: true,
                        layers: chain
                            .iter()
                            .map(|l| {
                                (
                                    l.id().to_string(),
                                    l.dir().to_path_buf(),
                                    Layout::of(l.manifest()),
                                )
                            })
                            .collect(),
                        disk: opened.disk.map(|d| RemoteDisk {
                            layer: std::path::absolute(&d.layer).unwrap_or(d.layer),
                            read_only: d.read_only,
                        }),
                        ..Default::default()
                    }
                }
                Err(e) => Response::err(e),
            }
        }
        Request::Ensure { id, offset, len } => {
            let id = match opened(leased, &id) {
                Ok(id) => id,
                Err(e) => return Response::err(e),
            };
            match cache.ensure(id, offset, len).await {
                Ok(()) => Response {
                    ok: true,
                    ..Default::default()
                },
                Err(e) => Response::err(e),
            }
        }
        Request::Prefetch { id, ranges } => {
            let id = match opened(leased, &id) {
                Ok(id) => id,
                Err(e) => return Response::err(e),
            };
            for [o, l] in ranges {
                let c = Arc::clone(cache);
                tokio::spawn(async move {
                    if let Err(e) = c.ensure(id, o, l).await {
                        tracing::warn!(snapshot = %id, error = %e, "prefetch");
                    }
                });
            }
            Response {
                ok: true,
                ..Default::default()
            }
        }
        Request::EnsureLayer { layer, offset, len } => {
            match cache.ensure_layer(&layer, offset, len).await {
                Ok(()) => Response {
                    ok: true,
                    ..Default::default()
                },
                Err(e) => Response::err(e),
            }
        }
        Request::CompleteLayer { layer } => match cache.complete_layer(&layer).await {
            Ok(()) => Response {
                ok: true,
                ..Default::default()
            },
            Err(e) => Response::err(e),
        },
        Request::Stats => Response {
            ok: true,
            stats: Some(cache.stats()),
            ..Default::default()
        },
    }
}

/// A fetcher running on a thread of its own (tests, benchmarks, embedding): a tokio
/// runtime serving one socket. Stopped when dropped.
pub struct FetcherThread {
    socket: PathBuf,
    cache: Arc<ChunkCache>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FetcherThread {
    /// Serves `cache` on a new Unix socket at `socket`.
    pub fn start(socket: &Path, cache: Arc<ChunkCache>) -> Result<FetcherThread> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("clade-fetcher")
            .enable_all()
            .build()
            .map_err(|e| Error::io("start the fetcher runtime", socket, e))?;
        let _ = std::fs::remove_file(socket);
        let listener = {
            let _g = rt.enter();
            tokio::net::UnixListener::bind(socket).map_err(|e| Error::io("bind", socket, e))?
        };
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let c = Arc::clone(&cache);
        let thread = std::thread::Builder::new()
            .name("clade-fetcher".into())
            .spawn(move || {
                rt.block_on(async move {
                    // On a worker, whose tasks spawned for connections then start on it
                    // without waking another thread.
                    let server = tokio::spawn(serve(listener, c));
                    let _ = rx.await;
                    server.abort();
                });
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .map_err(|e| Error::io("spawn the fetcher thread", socket, e))?;
        Ok(FetcherThread {
            socket: socket.to_path_buf(),
            cache,
            stop: Some(tx),
            thread: Some(thread),
        })
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Its cache.
    pub fn cache(&self) -> &Arc<ChunkCache> {
        &self.cache
    }
}

impl Drop for FetcherThread {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// A VM process's connection to a fetcher (see the [module documentation](self)).
pub struct FetchClient {
    socket: PathBuf,
    /// The connected socket, used through `read(2)`/`write(2)` (a `File`): the threads
    /// that fault pages in are confined to those calls, not `sendto`/`recvfrom`, which
    /// `UnixStream` uses. `None` once a message was cut short (the stream is out of step).
    conn: Mutex<Option<File>>,
}

impl std::fmt::Debug for FetchClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchClient")
            .field("socket", &self.socket)
            .finish()
    }
}

impl FetchClient {
    /// Connects to the fetcher at `socket`; every answer must come within `timeout`.
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Arc<FetchClient>> {
        let s = UnixStream::connect(socket)
            .map_err(|e| Error::io("connect to the fetcher", socket, e))?;
        s.set_read_timeout(Some(timeout))
            .and_then(|_| s.set_write_timeout(Some(timeout)))
            .map_err(|e| Error::io("set timeouts", socket, e))?;
        Ok(Arc::new(FetchClient {
            socket: socket.to_path_buf(),
            conn: Mutex::new(Some(File::from(std::os::fd::OwnedFd::from(s)))),
        }))
    }

    fn call(&self, req: &Request) -> Result<Response> {
        let fail = |what: String| Error::Fetcher(format!("{}: {what}", self.socket.display()));
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let s = guard
            .as_mut()
            .ok_or_else(|| fail("connection lost earlier".into()))?;
        let body = serde_json::to_vec(req).map_err(|e| fail(e.to_string()))?;
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&body);
        let r = (|| -> std::io::Result<Vec<u8>> {
            s.write_all(&out)?;
            let mut len = [0u8; 4];
            s.read_exact(&mut len)?;
            let n = u32::from_le_bytes(len) as usize;
            if n > MAX_FRAME {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("answer of {n} bytes"),
                ));
            }
            let mut buf = vec![0u8; n];
            s.read_exact(&mut buf)?;
            Ok(buf)
        })();
        let buf = match r {
            Ok(b) => b,
            Err(e) => {
                *guard = None;
                let what = if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) {
                    "no answer in time".to_string()
                } else {
                    e.to_string()
                };
                return Err(fail(what));
            }
        };
        let resp: Response = serde_json::from_slice(&buf).map_err(|e| {
            *guard = None;
            fail(format!("bad answer: {e}"))
        })?;
        if resp.ok {
            Ok(resp)
        } else {
            Err(Error::Fetcher(
                resp.error.unwrap_or_else(|| "failed".into()),
            ))
        }
    }

    /// Makes the lazily read disk layer `layer` (hex id) of the fetcher's cache whole: an
    /// ordinary layer file from then on.
    pub fn complete_layer(&self, layer: &str) -> Result<()> {
        self.call(&Request::CompleteLayer {
            layer: layer.to_string(),
        })
        .map(|_| ())
    }

    /// The fetcher's cache counters.
    pub fn stats(&self) -> Result<CacheStats> {
        self.call(&Request::Stats)?
            .stats
            .ok_or_else(|| Error::Fetcher("no stats in the answer".into()))
    }

    /// Opens published snapshot `id` through the fetcher.
    pub fn open(self: &Arc<Self>, id: SnapshotId) -> Result<RemoteSnapshot> {
        self.open_with(id, false)
    }

    /// Opens published snapshot `id` through the fetcher, which checks first that the
    /// store has every object the snapshot may read from it later (an error naming each
    /// one it lacks): what a host does before it starts a VM on the snapshot.
    pub fn open_checked(self: &Arc<Self>, id: SnapshotId) -> Result<RemoteSnapshot> {
        self.open_with(id, true)
    }

    fn open_with(self: &Arc<Self>, id: SnapshotId, check: bool) -> Result<RemoteSnapshot> {
        let resp = self.call(&Request::Open {
            id: id.to_string(),
            check,
        })?;
        let mut layers = Vec::with_capacity(resp.layers.len());
        for (lid, dir, layout) in resp.layers {
            let lid = manifest::parse_snapshot_id(&lid)?;
            layout.check()?;
            let ppath = dir.join(cache::PRESENT_FILE);
            let present = File::open(&ppath).map_err(|e| Error::io("open", &ppath, e))?;
            let fetch = Arc::new(LayerFetch {
                client: Arc::clone(self),
                id: lid,
                placements: layout_placements(&layout),
                chunk_size: layout.chunk_size,
                present,
            });
            layers.push(RemoteLayer {
                id: lid,
                dir,
                layout,
                fetch,
            });
        }
        if layers.last().map(|l| l.id) != Some(id) {
            return Err(Error::Fetcher(format!(
                "open of {id} answered another chain"
            )));
        }
        if let Some(d) = resp.disk.as_ref().filter(|d| !d.layer.is_absolute()) {
            return Err(Error::Fetcher(format!(
                "open of {id} answered a relative disk layer path {}",
                d.layer.display()
            )));
        }
        Ok(RemoteSnapshot {
            layers,
            disk: resp.disk,
        })
    }
}

/// A published snapshot opened through a fetcher.
#[derive(Debug)]
pub struct RemoteSnapshot {
    /// Its layers, base first; the last is the snapshot itself.
    pub layers: Vec<RemoteLayer>,
    /// Its disk, if it has one: where the VM's disk is now, in place of the path its
    /// saved state records (`vmm::PreparedSnapshot::relocate_disk`).
    pub disk: Option<RemoteDisk>,
}

impl RemoteSnapshot {
    /// The snapshot's own cache directory (state file, working set).
    pub fn dir(&self) -> &Path {
        // `open` checked there is at least one layer.
        &self.layers[self.layers.len() - 1].dir
    }

    /// The memory files of the chain, base first, filled through the fetcher.
    pub fn memory_files(&self) -> Result<Vec<MemoryFile>> {
        self.layers.iter().map(RemoteLayer::memory_file).collect()
    }

    /// The memory files with each layer's cache directory, base first: what a VMM
    /// restores the snapshot from (`vmm::PreparedSnapshot::open_with_layers`).
    pub fn memory_layers(&self) -> Result<Vec<(PathBuf, MemoryFile)>> {
        self.layers
            .iter()
            .map(|l| Ok((l.dir.clone(), l.memory_file()?)))
            .collect()
    }

    /// Bytes of the recorded working set's data pages (0 without one).
    pub fn working_set_pages(&self) -> Result<u64> {
        let top = &self.layers[self.layers.len() - 1];
        let p = top.dir.join(cache::WORKING_SET_FILE);
        if !p.exists() {
            return Ok(0);
        }
        let ws = snapshot::working_set::WorkingSet::load(&p, top.id, top.layout.pages())?;
        Ok(ws.pages.len() as u64)
    }
}

/// One layer of a [`RemoteSnapshot`].
pub struct RemoteLayer {
    /// The snapshot this layer is.
    pub id: SnapshotId,
    /// Its cache directory.
    pub dir: PathBuf,
    /// Where its data pages are.
    pub layout: Layout,
    fetch: Arc<LayerFetch>,
}

impl std::fmt::Debug for RemoteLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteLayer")
            .field("id", &self.id)
            .field("dir", &self.dir)
            .finish()
    }
}

impl RemoteLayer {
    /// Its memory file, filled through the fetcher.
    pub fn memory_file(&self) -> Result<MemoryFile> {
        Ok(MemoryFile::open_fetched(
            &self.dir.join(cache::MEMORY_FILE),
            self.layout.data_bitmap(),
            Fetcher(self.fetch.clone()),
        )?)
    }
}

struct LayerFetch {
    client: Arc<FetchClient>,
    id: SnapshotId,
    placements: Vec<Placement>,
    chunk_size: u64,
    present: File,
}

impl LayerFetch {
    fn all_present(&self, chunks: &[u64]) -> bool {
        let (Some(&first), Some(&last)) = (chunks.first(), chunks.last()) else {
            return true;
        };
        let mut buf = vec![0u8; (last - first + 1) as usize];
        match self.present.read_exact_at(&mut buf, first) {
            Ok(()) => chunks.iter().all(|&c| buf[(c - first) as usize] == 1),
            Err(_) => false,
        }
    }
}

impl ChunkFetch for LayerFetch {
    fn ensure(&self, offset: u64, len: u64) -> std::result::Result<(), String> {
        let chunks = chunks_for(&self.placements, self.chunk_size, offset, len);
        if self.all_present(&chunks) {
            return Ok(());
        }
        self.client
            .call(&Request::Ensure {
                id: self.id.to_string(),
                offset,
                len,
            })
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn prefetch(&self, ranges: &[(u64, u64)]) {
        let missing: Vec<[u64; 2]> = ranges
            .iter()
            .filter(|&&(o, l)| {
                !self.all_present(&chunks_for(&self.placements, self.chunk_size, o, l))
            })
            .map(|&(o, l)| [o, l])
            .collect();
        if missing.is_empty() {
            return;
        }
        if let Err(e) = self.client.call(&Request::Prefetch {
            id: self.id.to_string(),
            ranges: missing,
        }) {
            tracing::warn!(snapshot = %self.id, error = %e, "prefetch request");
        }
    }
}

/// The disk layers a fetcher reads lazily, as a VM process reads them: a layer file in a
/// fetcher's cache (`layers/<id>.cdsk` with its presence map beside it) is filled through
/// the fetcher this client is connected to.
#[derive(Debug)]
pub struct FetcherLayers {
    client: Arc<FetchClient>,
}

impl FetcherLayers {
    /// The layers `client`'s fetcher fills.
    pub fn sources(client: Arc<FetchClient>) -> disk::remote::Sources {
        disk::remote::Sources(Arc::new(FetcherLayers { client }))
    }
}

impl disk::remote::LayerSources for FetcherLayers {
    fn source(
        &self,
        path: &Path,
        id: &disk::LayerId,
    ) -> Option<Arc<dyn disk::remote::BlockSource>> {
        let id = disk::id_hex(id);
        if path.file_name()?.to_str()? != cache::layer_file(&id) {
            return None;
        }
        let entry = match cache::cached_layer_entry(path, &id) {
            Ok(Some(e)) => e,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(layer = %path.display(), error = %e, "no source for a disk layer");
                return None;
            }
        };
        let chunk_size = entry.chunks.as_ref()?.chunk_size;
        let ppath = disk::remote::present_path(path);
        let present = File::open(&ppath).ok()?;
        Some(Arc::new(FetchedLayer {
            client: Arc::clone(&self.client),
            path: path.to_path_buf(),
            id,
            size: entry.object.size,
            chunk_size,
            present,
        }))
    }
}

/// One lazily read disk layer file, filled through the fetcher.
#[derive(Debug)]
struct FetchedLayer {
    client: Arc<FetchClient>,
    path: PathBuf,
    id: String,
    size: u64,
    chunk_size: u64,
    present: File,
}

impl FetchedLayer {
    fn all_present(&self, offset: u64, len: u64) -> std::result::Result<bool, String> {
        let end = offset.saturating_add(len).min(self.size);
        if len == 0 || offset >= end {
            return Ok(true);
        }
        let (first, last) = (offset / self.chunk_size, (end - 1) / self.chunk_size);
        let mut flags = vec![0u8; (last - first + 1) as usize];
        self.present
            .read_exact_at(&mut flags, first)
            .map_err(|e| format!("{}: {e}", disk::remote::present_path(&self.path).display()))?;
        Ok(flags.iter().all(|&f| f == 1))
    }
}

impl disk::remote::BlockSource for FetchedLayer {
    fn ensure(&self, offset: u64, len: u64) -> std::result::Result<(), String> {
        if self.all_present(offset, len)? {
            return Ok(());
        }
        self.client
            .call(&Request::EnsureLayer {
                layer: self.id.clone(),
                offset,
                len,
            })
            .map_err(|e| e.to_string())?;
        // The fetcher filled its cache's file: it must be this one.
        if !self.all_present(offset, len)? {
            return Err(format!(
                "the fetcher at {} filled layer {} in another cache than {}",
                self.client.socket.display(),
                self.id,
                self.path.display()
            ));
        }
        Ok(())
    }
}
