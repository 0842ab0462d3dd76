//! A snapshot's disk layers in the cache's `layers/` directory (see the [cache
//! documentation](super)): each downloaded once, whole (a layer published without chunk
//! checksums) or as its header and table only (the rest read lazily, [`super::disk_chunks`]),
//! checked, linked to its parent's file in place, and renamed under its final name. Also
//! the names of the files kept beside a layer. Separate from the memory chunks: layer
//! files are not counted against the limit and never evicted.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use snapshot::SnapshotId;

use super::{blocking, CachedDisk, ChunkCache, LAYERS_DIR};
use crate::manifest::{self, Manifest};
use crate::{Error, Result};

/// Size of the range reads a disk layer is downloaded with.
const LAYER_PIECE: u64 = 8 << 20;
/// Range reads of one layer download in flight at once.
const LAYER_READS: usize = 4;

impl ChunkCache {
    /// Materializes the disk layers of the snapshot with manifest `m` (see the [cache
    /// documentation](super)), base first, so that each child is linked to a parent in
    /// place.
    pub(super) async fn open_disk(&self, m: &Manifest) -> Result<Option<CachedDisk>> {
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
}

/// A file beside layer file `layer`: `<layer file name>.<ext>`.
pub(super) fn sidecar(layer: &Path, ext: &str) -> PathBuf {
    let mut name = layer.file_name().unwrap_or_default().to_os_string();
    name.push(".");
    name.push(ext);
    layer.with_file_name(name)
}

/// 32-byte checksums stored end to end.
pub(super) fn digests_of(table: &[u8]) -> Vec<[u8; 32]> {
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
