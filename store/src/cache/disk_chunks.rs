//! The disk layers read lazily (see the [cache documentation](super)): opened for
//! filling, their chunks fetched when a VM process first reads them (each verified against
//! its checksum, written and synced, then marked present; concurrent misses of one chunk
//! share one fetch), and a layer made whole. Separate from [`super::disk_layers`], which
//! brings a layer into the cache in the first place.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};

use super::disk_layers::{digests_of, sidecar};
use super::{blocking, cached_layer_entry, layer_file, ChunkCache, ChunkFuture, LAYERS_DIR};
use crate::manifest;
use crate::{sha256_hex, Error, Result};

/// The disk layers of a cache that are read lazily (see the [cache documentation](super)).
#[derive(Default)]
pub(super) struct LazyLayers {
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

impl ChunkCache {
    /// Chunk `i` of disk layer `l`'s object, fetched with one range read and verified.
    pub(super) async fn fetch_layer_chunk(
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
}
