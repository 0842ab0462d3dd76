//! Opening a snapshot into the cache: its manifest, state file, memory header, working set
//! and lead object (the working set's chunks) fetched from the store into a new directory,
//! checked against the manifest, and renamed into place. Separate from the rest of the
//! cache because it is the one path from the store to a snapshot directory.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use snapshot::fetch::{ChunkFetch, Fetcher};
use snapshot::memory_file::MemoryFile;
use snapshot::{state_file, SnapshotId};

use super::memory_chunks::write_chunk;
use super::{
    blocking, data_bitmap, lock, ChunkCache, MANIFEST_FILE, MEMORY_FILE, PRESENT_FILE, STATE_FILE,
    WORKING_SET_FILE,
};

use crate::manifest::{self, placements, Manifest};
use crate::{sha256_hex, Error, Result};

/// A [`ChunkFetch`] that does nothing: for validating a memory file's header only.
struct NoFetch;
impl ChunkFetch for NoFetch {
    fn ensure(&self, _: u64, _: u64) -> std::result::Result<(), String> {
        Err("not fetched".into())
    }
    fn prefetch(&self, _: &[(u64, u64)]) {}
}

impl ChunkCache {
    pub(super) async fn get_object(&self, o: &manifest::ObjectRef) -> Result<Bytes> {
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
    /// object is good, whose key, like the manifest's, follows from the id. Working-set
    /// chunks the lead object did not bring (it is missing, or one fails its checksum) are
    /// left to [`ChunkCache::layer`].
    pub(super) async fn download(self: &Arc<Self>, id: SnapshotId) -> Result<()> {
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
        // Its present chunks are those just checked as they were written. The working
        // set's chunks the lead object did not bring are not among them: they are fetched
        // by every open ([`ChunkCache::layer`]), not here, so an open that could not fetch
        // them fails again the next time rather than passing for done.
        lock(&self.inner).verified.insert(id, true);
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
