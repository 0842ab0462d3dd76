//! The chunks of cached memory files: fetched on a miss (concurrent misses of one chunk
//! share one fetch), verified, written at their pages' offsets and only then marked
//! present; the cache's byte limit, kept by evicting the least recently used chunks of
//! snapshots nobody leases; and the leases themselves. Separate because it is the cache's
//! hot path and its only accounting.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt};
use snapshot::SnapshotId;

use super::{lock, CachedLayer, ChunkCache, ChunkFuture, Inner, MEMORY_FILE, PRESENT_FILE};
use crate::manifest::{chunks_for, Manifest, Placement};
use crate::{sha256_hex, Error, Result};

impl ChunkCache {
    /// Verifies the chunks a previous run marked present; a bad one is dropped (fetched
    /// again when needed).
    pub(super) fn verify_present(&self, l: &CachedLayer) -> Result<()> {
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
            r.map_err(Error::Shared)?;
        }
        Ok(())
    }

    /// The future that makes chunk `c` present, shared with concurrent misses; `None`
    /// if it is present already.
    pub(super) fn chunk_future(
        self: &Arc<Self>,
        layer: &Arc<CachedLayer>,
        c: u64,
    ) -> Option<ChunkFuture> {
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
    pub(super) fn unreserve(&self, n: u64) {
        let mut inner = lock(&self.inner);
        inner.used = inner.used.saturating_sub(n);
    }

    /// Makes room for `n` more bytes (evicting) and counts them as used.
    pub(super) fn reserve(&self, n: u64) -> Result<()> {
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

/// Writes the bytes of the chunk at `range` of the packed data to the memory file `f`,
/// at the file offsets of its pages.
pub(super) fn write_chunk(
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

fn punch_hole(f: &File, offset: u64, len: u64) {
    use nix::fcntl::{fallocate, FallocateFlags};
    let flags = FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE;
    if let Err(e) = fallocate(f.as_raw_fd(), flags, offset as i64, len as i64) {
        tracing::warn!(error = %e, "punching an evicted chunk's pages");
    }
}
