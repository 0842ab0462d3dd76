//! Publishing a snapshot: its objects, then its manifest.
//!
//! Every object is named by its content's SHA-256 and uploaded only if the store does not
//! have it yet; the manifest goes last, with a conditional write, so a snapshot is either
//! published whole or not at all, and publishing the same snapshot twice is harmless. The
//! memory file's data pages are read twice: once to checksum them (the object's name and
//! each chunk's checksum), once to upload them in parallel parts.
//!
//! A snapshot's disk is published as its layer files, whole, one object each (see
//! [`publish_disk`]): every layer must be frozen, since only then can its bytes not change
//! between the checksum, the upload and a restore on another host.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use snapshot::bitmap::PageBitmap;
use snapshot::memory_file::MemoryFile;
use snapshot::working_set::WorkingSet;
use snapshot::{state_file, SnapshotId, SnapshotKind, PAGE_SIZE_U64};

use crate::manifest::{self, DiskObjects, Manifest, MemoryObjects, ObjectRef, DEFAULT_CHUNK};
use crate::sweep::touch;
pub use crate::sweep::{delete, delete_all, DeleteReport};
use crate::{hex, sha256_hex, Error, Result, Store};

/// The files of one snapshot.
#[derive(Debug, Clone)]
pub struct SnapshotFiles {
    /// The state file.
    pub state: PathBuf,
    /// The memory file.
    pub memory: PathBuf,
    /// The working-set file, if there is one (absent or unusable: not published).
    pub working_set: Option<PathBuf>,
    /// The snapshot's disk, if it has one.
    pub disk: Option<SnapshotDisk>,
}

/// The disk of a snapshot, as its saved state records it.
#[derive(Debug, Clone)]
pub struct SnapshotDisk {
    /// The frozen top layer of the disk's chain (the layer the snapshot saved).
    pub layer: PathBuf,
    /// The disk was read-only.
    pub read_only: bool,
}

/// How to publish.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// Chunk size of the packed memory data (a page multiple within the manifest's limits).
    pub chunk_size: u64,
    /// Size of one part of a multipart upload.
    pub part_size: usize,
    /// Parts uploaded at once.
    pub concurrency: usize,
    /// Where to count the memory data as it is published, for a progress display.
    pub progress: Option<Arc<Progress>>,
}

/// How far a publish is: bytes of memory data known to publish (`total`, growing as each
/// snapshot of a chain is opened) and those uploaded or found already in the store.
#[derive(Debug, Default)]
pub struct Progress {
    done: AtomicU64,
    total: AtomicU64,
}

impl Progress {
    /// (done, total) bytes.
    pub fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }

    fn add_total(p: &Option<Arc<Progress>>, n: u64) {
        if let Some(p) = p {
            p.total.fetch_add(n, Ordering::Relaxed);
        }
    }

    fn add_done(p: &Option<Arc<Progress>>, n: u64) {
        if let Some(p) = p {
            p.done.fetch_add(n, Ordering::Relaxed);
        }
    }
}

impl Default for PublishOptions {
    fn default() -> Self {
        PublishOptions {
            chunk_size: DEFAULT_CHUNK,
            part_size: 16 << 20,
            concurrency: 8,
            progress: None,
        }
    }
}

/// What [`publish`] did.
#[derive(Debug, Clone)]
pub struct PublishReport {
    /// The snapshot published.
    pub id: SnapshotId,
    /// Objects uploaded.
    pub objects_uploaded: u64,
    /// Objects the store already had.
    pub objects_reused: u64,
    /// Bytes uploaded (objects and manifest).
    pub bytes_uploaded: u64,
    /// Bytes of packed memory data (uploaded or not).
    pub data_bytes: u64,
    /// Bytes of disk layer files (uploaded or not).
    pub disk_bytes: u64,
    /// Time checksumming.
    pub checksum_time: Duration,
    /// Time uploading.
    pub upload_time: Duration,
}

/// Publishes the snapshot in `files`; a diff's base must have been published before.
/// Returns its manifest and what was uploaded. An object it reused that a concurrent
/// delete removed before the manifest was written is uploaded again (a second try).
pub async fn publish(
    store: &Store,
    files: &SnapshotFiles,
    options: &PublishOptions,
) -> Result<(Manifest, PublishReport)> {
    if let Some(r) = publish_once(store, files, options).await? {
        return Ok(r);
    }
    publish_once(store, files, options).await?.ok_or_else(|| {
        Error::InvalidInput(
            "objects of this snapshot were deleted while it was published, twice".into(),
        )
    })
}

/// One try of [`publish`]: `None` if an object it names vanished before its manifest was
/// written (see [`crate::sweep`]).
async fn publish_once(
    store: &Store,
    files: &SnapshotFiles,
    options: &PublishOptions,
) -> Result<Option<(Manifest, PublishReport)>> {
    if options.chunk_size < manifest::MIN_CHUNK
        || options.chunk_size > manifest::MAX_CHUNK
        || !options.chunk_size.is_multiple_of(PAGE_SIZE_U64)
    {
        return Err(Error::InvalidInput(format!(
            "chunk size {} (a page multiple from {} to {})",
            options.chunk_size,
            manifest::MIN_CHUNK,
            manifest::MAX_CHUNK
        )));
    }
    let t0 = Instant::now();
    let header = state_file::read_header(&files.state)?;
    let meta = header.meta;
    let state_bytes = read_all(&files.state)?;
    let mem = MemoryFile::open(&files.memory)?;
    mem.check_state(&header)?;
    let base = match meta.kind {
        SnapshotKind::Full => None,
        SnapshotKind::Diff => {
            let base = meta
                .base
                .ok_or_else(|| Error::InvalidInput("a diff snapshot without a base id".into()))?;
            if store.size(&manifest::manifest_key(base)).await?.is_none() {
                return Err(Error::InvalidInput(format!(
                    "diff snapshot {} needs its base {base} published first",
                    meta.id
                )));
            }
            Some(base.to_string())
        }
    };
    let d = mem.header().data_offset;
    let mut head = vec![0u8; d as usize];
    mem.file()
        .read_exact_at(&mut head, 0)
        .map_err(|e| Error::io("read memory head", &files.memory, e))?;
    let (working_set, ws_pages) = match &files.working_set {
        Some(p) => match WorkingSet::load(p, meta.id, mem.header().pages()) {
            Ok(ws) => (Some(read_all(p)?), ws.pages),
            Err(e) => {
                tracing::warn!(path = %p.display(), error = %e, "working set not published");
                (None, Vec::new())
            }
        },
        None => (None, Vec::new()),
    };
    let (runs, ws_runs) = packed_order(mem.data_pages(), &ws_pages);
    let working_set_bytes = runs[..ws_runs].iter().map(|r| r[1]).sum::<u64>() * PAGE_SIZE_U64;
    let data_size = runs.iter().map(|r| r[1]).sum::<u64>() * PAGE_SIZE_U64;
    let data_key = manifest::data_key(meta.id, &runs);
    Progress::add_total(&options.progress, data_size);

    let t1 = Instant::now();
    let mut report = PublishReport {
        id: meta.id,
        objects_uploaded: 0,
        objects_reused: 0,
        bytes_uploaded: 0,
        data_bytes: data_size,
        disk_bytes: 0,
        checksum_time: t0.elapsed(),
        upload_time: Duration::ZERO,
    };
    let state = put_small(store, Bytes::from(state_bytes), &mut report).await?;
    let head = put_small(store, Bytes::from(head), &mut report).await?;
    let working_set = match working_set {
        Some(ws) => Some(put_small(store, Bytes::from(ws), &mut report).await?),
        None => None,
    };
    // Checksummed while it uploads; published before (the same snapshot in the same
    // order again): only read.
    let (data_sha, chunks) = if store.size(&data_key).await? == Some(data_size) {
        touch(store, &data_key).await?;
        report.objects_reused += 1;
        let t = Instant::now();
        let mut h = ChunkHasher::new(options.chunk_size);
        for_each_piece(&mem, &runs, d, options.chunk_size, |b| {
            h.update(b);
            Ok(())
        })?;
        report.checksum_time += t.elapsed();
        Progress::add_done(&options.progress, data_size);
        h.finish()
    } else {
        let r = upload_data(store, &mem, &runs, d, &data_key, data_size, options).await?;
        report.objects_uploaded += 1;
        report.bytes_uploaded += data_size;
        r
    };
    let disk = match &files.disk {
        Some(d) => Some(publish_disk(store, d, base.as_deref(), options, &mut report).await?),
        None => None,
    };
    let data = ObjectRef {
        sha256: data_sha,
        size: data_size,
        inline: None,
        name: Some(data_key),
    };
    let mut m = Manifest {
        format: manifest::FORMAT.into(),
        version: manifest::VERSION,
        id: meta.id.to_string(),
        kind: meta.kind.to_string(),
        base,
        mem_size: meta.mem_size,
        state,
        memory: MemoryObjects {
            head,
            data,
            runs,
            chunk_size: options.chunk_size,
            chunks,
            working_set_bytes,
            lead: None,
        },
        working_set,
        disk,
    };
    // The lead object: the working set's chunks again, under a key a reader derives from
    // the id, so that it asks for them together with the manifest. Overwritten by a
    // publish retried before its manifest was written (the order may have changed
    // since); a reader checks it against the manifest's chunk checksums and ignores a
    // copy that does not match, so it never has to be right, only fast.
    let key = manifest::manifest_key(meta.id);
    let lead_size = m.lead_size();
    if lead_size > 0 && store.size(&key).await?.is_none() {
        let lead = packed_prefix(&mem, &m.memory.runs, d, lead_size)?;
        let lead = Bytes::from(lead);
        let r = ObjectRef {
            sha256: sha256_hex(&lead),
            size: lead_size,
            inline: None,
            name: Some(manifest::lead_key(meta.id)),
        };
        store.put(&r.key(), lead).await?;
        report.objects_uploaded += 1;
        report.bytes_uploaded += lead_size;
        m.memory.lead = Some(r);
    }
    if !crate::sweep::still_whole(store, &m).await? {
        return Ok(None);
    }
    let bytes = m.to_bytes();
    report.bytes_uploaded += bytes.len() as u64;
    if !store.put_if_absent(&key, Bytes::from(bytes)).await? {
        let existing = Manifest::fetch(store, &key).await?;
        // A second publish of the same snapshot names the same memory and state; only
        // the working set may differ (recorded later). The first manifest stays.
        let layer_ids = |m: &Manifest| {
            m.disk.as_ref().map(|d| {
                (
                    d.read_only,
                    d.layers.iter().map(|l| l.id.clone()).collect::<Vec<_>>(),
                )
            })
        };
        let memory = |m: &Manifest| MemoryObjects {
            lead: None,
            ..m.memory.clone()
        };
        if existing.state != m.state
            || memory(&existing) != memory(&m)
            || layer_ids(&existing) != layer_ids(&m)
        {
            return Err(Error::BadManifest {
                key: store.key(&key),
                reason: "a different snapshot with this id is already published".into(),
            });
        }
    }
    report.upload_time = t1.elapsed();
    tracing::info!(id = %meta.id, uploaded = report.bytes_uploaded,
        reused = report.objects_reused, "snapshot published");
    Ok(Some((m, report)))
}

/// Publishes the layer chain of a snapshot's disk: each layer file whole as
/// `objects/<sha256>`, uploaded unless the store has it. A layer the base snapshot's
/// manifest (`base`, already published) lists with the same id and size is not read again:
/// frozen layers never change, so its object is this layer's too.
async fn publish_disk(
    store: &Store,
    d: &SnapshotDisk,
    base: Option<&str>,
    options: &PublishOptions,
    report: &mut PublishReport,
) -> Result<DiskObjects> {
    let top = d.layer.clone();
    let chain = tokio::task::spawn_blocking(move || disk::ops::info(&top))
        .await
        .map_err(|e| Error::Fetcher(format!("disk info task: {e}")))?
        .map_err(|e| Error::Disk {
            path: d.layer.clone(),
            source: e,
        })?;
    if let Some(l) = chain.iter().find(|l| !l.header.frozen()) {
        return Err(Error::InvalidInput(format!(
            "disk layer {} is not frozen: only frozen layers can be published (freeze it \
             with `clade disk freeze` while no VM uses it)",
            l.path.display()
        )));
    }
    let mut known: Vec<manifest::DiskLayer> = Vec::new();
    if let Some(base) = base {
        let key = manifest::manifest_key(manifest::parse_snapshot_id(base)?);
        let bm = Manifest::fetch(store, &key).await?;
        known.extend(bm.disk.into_iter().flat_map(|d| d.layers));
    }
    let mut layers = Vec::with_capacity(chain.len());
    for l in &chain {
        let id = disk::id_hex(&l.header.layer_id);
        report.disk_bytes += l.file_len;
        if let Some(k) = known
            .iter()
            .find(|k| k.id == id && k.object.size == l.file_len)
        {
            touch_layer(store, k).await?;
            report.objects_reused += 1;
            layers.push(k.clone());
            continue;
        }
        // A layer this host's cache has from the store (read lazily: the file may be
        // partly holes): what the store has is its entry, never the file's hash.
        if let Some(k) = crate::cache::cached_layer_entry(&l.path, &id)? {
            touch_layer(store, &k).await?;
            report.objects_reused += 1;
            layers.push(k);
            continue;
        }
        let t = Instant::now();
        let path = l.path.clone();
        let (sha256, size, digests) =
            tokio::task::spawn_blocking(move || hash_file(&path, manifest::LAYER_CHUNK))
                .await
                .map_err(|e| Error::Fetcher(format!("checksum task: {e}")))??;
        report.checksum_time += t.elapsed();
        let object = ObjectRef {
            sha256,
            size,
            inline: None,
            name: None,
        };
        let table = Bytes::from(digests);
        let chunks = manifest::LayerChunks {
            chunk_size: manifest::LAYER_CHUNK,
            table: ObjectRef {
                sha256: sha256_hex(&table),
                size: table.len() as u64,
                inline: None,
                name: None,
            },
        };
        if store.size(&chunks.table.key()).await? != Some(chunks.table.size) {
            report.bytes_uploaded += chunks.table.size;
            report.objects_uploaded += 1;
            store.put(&chunks.table.key(), table).await?;
        } else {
            touch(store, &chunks.table.key()).await?;
        }
        if store.size(&object.key()).await? == Some(size) {
            touch(store, &object.key()).await?;
            report.objects_reused += 1;
        } else {
            upload_file(store, &l.path, &object, options).await?;
            report.objects_uploaded += 1;
            report.bytes_uploaded += size;
        }
        tracing::debug!(layer = %id, path = %l.path.display(), size, "disk layer published");
        layers.push(manifest::DiskLayer {
            id,
            object,
            chunks: Some(chunks),
        });
    }
    Ok(DiskObjects {
        read_only: d.read_only,
        layers,
    })
}

/// Touches a reused layer's objects (see [`crate::sweep`]).
async fn touch_layer(store: &Store, l: &manifest::DiskLayer) -> Result<()> {
    touch(store, &l.object.key()).await?;
    if let Some(c) = &l.chunks {
        touch(store, &c.table.key()).await?;
    }
    Ok(())
}

/// Size of the pieces a file is read in (checksum, upload).
const FILE_PIECE: usize = 8 << 20;

/// SHA-256 and length of a file, read piece by piece.
/// SHA-256 and length of a file, and the 32-byte SHA-256 of each `chunk`-byte piece of it
/// end to end (`chunk` divides the read size).
fn hash_file(path: &Path, chunk: u64) -> Result<(String, u64, Vec<u8>)> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut h = Sha256::new();
    let mut piece = Sha256::new();
    let mut in_piece = 0u64;
    let mut digests = Vec::new();
    let mut buf = vec![0u8; FILE_PIECE];
    let mut total = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let take = ((chunk - in_piece) as usize).min(rest.len());
            piece.update(&rest[..take]);
            in_piece += take as u64;
            rest = &rest[take..];
            if in_piece == chunk {
                digests.extend_from_slice(&std::mem::take(&mut piece).finalize());
                in_piece = 0;
            }
        }
        total += n as u64;
    }
    if in_piece > 0 {
        digests.extend_from_slice(&piece.finalize());
    }
    Ok((hex(&h.finalize()), total, digests))
}

/// Uploads the file at `path` as `object` (parts of `options.part_size`, at most
/// `options.concurrency` in flight), checking that what was sent is what was checksummed.
async fn upload_file(
    store: &Store,
    path: &Path,
    object: &ObjectRef,
    options: &PublishOptions,
) -> Result<()> {
    let key = object.key();
    let changed = || {
        Error::InvalidInput(format!(
            "{}: the file changed while it was published",
            path.display()
        ))
    };
    if object.size <= options.part_size as u64 {
        let bytes = read_all_bounded(path, options.part_size as u64)?;
        if bytes.len() as u64 != object.size || sha256_hex(&bytes) != object.sha256 {
            return Err(changed());
        }
        return store.put(&key, Bytes::from(bytes)).await;
    }
    let p = path.to_path_buf();
    let piece = options.part_size;
    let read = move |send: &mut dyn FnMut(Vec<u8>) -> Result<()>| {
        use std::io::Read;
        let mut f = std::fs::File::open(&p).map_err(|e| Error::io("open", &p, e))?;
        let mut h = Sha256::new();
        let mut total = 0u64;
        loop {
            let mut buf = vec![0u8; piece];
            let mut fill = 0;
            while fill < piece {
                let n = f
                    .read(&mut buf[fill..])
                    .map_err(|e| Error::io("read", &p, e))?;
                if n == 0 {
                    break;
                }
                fill += n;
            }
            if fill == 0 {
                return Ok((hex(&h.finalize()), total));
            }
            buf.truncate(fill);
            h.update(&buf);
            total += fill as u64;
            send(buf)?;
        }
    };
    let want = (object.sha256.clone(), object.size);
    upload_pieces(store, &key, options, read, |got| {
        if *got == want {
            Ok(())
        } else {
            Err(changed())
        }
    })
    .await
    .map(|_| ())
}

/// Uploads as object `key`, in parts of `options.part_size` (`options.concurrency` at
/// once), the pieces `read` sends. `read` runs on a blocking thread (reading and
/// checksumming a local file while earlier parts upload); what it returns (its checksums)
/// is returned once the upload is finished. The upload is aborted, the object never
/// written, if `read` fails or `check` (given what `read` returned) refuses it.
async fn upload_pieces<T: Send + 'static>(
    store: &Store,
    key: &str,
    options: &PublishOptions,
    read: impl FnOnce(&mut dyn FnMut(Vec<u8>) -> Result<()>) -> Result<T> + Send + 'static,
    check: impl FnOnce(&T) -> Result<()>,
) -> Result<T> {
    let upload = store.put_multipart(key).await?;
    let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, options.part_size);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>>>(2);
    let reader = tokio::task::spawn_blocking(move || {
        let mut send = |b: Vec<u8>| {
            tx.blocking_send(Ok(b))
                .map_err(|_| Error::Fetcher("upload ended".into()))
        };
        match read(&mut send) {
            Ok(v) => Some(v),
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                None
            }
        }
    });
    let mut part_failed = false;
    let mut sent = 0u64;
    while let Some(piece) = rx.recv().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                let _ = w.abort().await;
                return Err(e);
            }
        };
        let timeout = store.timeout();
        let room = tokio::time::timeout(timeout, w.wait_for_capacity(options.concurrency)).await;
        match room {
            Ok(Ok(())) => {}
            // The failed part's error comes from `finish` below.
            Ok(Err(_)) => {
                part_failed = true;
                break;
            }
            Err(_) => {
                let _ = w.abort().await;
                return Err(Error::Timeout {
                    op: "upload part of",
                    key: store.key(key),
                    secs: timeout.as_secs(),
                });
            }
        }
        sent += piece.len() as u64;
        w.write(&piece);
    }
    // The reader stops at its next piece (it must not wait on a full channel).
    drop(rx);
    let got = reader.await.ok().flatten();
    let got = match got {
        Some(v) if !part_failed => v,
        _ if part_failed => {
            // `finish` reports the part that failed.
            let e = w.finish().await.err();
            return Err(match e {
                Some(e) => Error::store("upload", &store.key(key), e),
                None => Error::Fetcher(format!("upload of {} failed", store.key(key))),
            });
        }
        _ => {
            let _ = w.abort().await;
            return Err(Error::Fetcher(format!(
                "upload of {} stopped after {sent} bytes",
                store.key(key)
            )));
        }
    };
    // Before the object exists: a content-named object must hold that content.
    if let Err(e) = check(&got) {
        let _ = w.abort().await;
        return Err(e);
    }
    let timeout = store.timeout() * 4;
    match tokio::time::timeout(timeout, w.finish()).await {
        Ok(r) => r
            .map(|_| got)
            .map_err(|e| Error::store("upload", &store.key(key), e)),
        Err(_) => Err(Error::Timeout {
            op: "finish upload of",
            key: store.key(key),
            secs: timeout.as_secs(),
        }),
    }
}

fn read_all_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut v = Vec::new();
    f.take(limit + 1)
        .read_to_end(&mut v)
        .map_err(|e| Error::io("read", path, e))?;
    Ok(v)
}

/// The order data pages are packed in: the working set's data pages first, in the order
/// they were touched (consecutive pages as one run), then every other data page in image
/// order. Returns the runs and how many of them are the working set's.
fn packed_order(data: &PageBitmap, working_set: &[u64]) -> (Vec<[u64; 2]>, usize) {
    let mut taken = PageBitmap::new(data.len());
    let mut runs: Vec<[u64; 2]> = Vec::new();
    for &p in working_set {
        if p >= data.len() || !data.get(p) || taken.get(p) {
            continue;
        }
        taken.set(p);
        match runs.last_mut() {
            Some([first, n]) if *first + *n == p => *n += 1,
            _ => runs.push([p, 1]),
        }
    }
    let ws_runs = runs.len();
    for (s, n) in data.runs() {
        let mut p = s;
        while p < s + n {
            if taken.get(p) {
                p += 1;
                continue;
            }
            let start = p;
            while p < s + n && !taken.get(p) {
                p += 1;
            }
            runs.push([start, p - start]);
        }
    }
    (runs, ws_runs)
}

fn read_all(path: &Path) -> Result<Vec<u8>> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    if len > manifest::MAX_SMALL_OBJECT {
        return Err(Error::InvalidInput(format!(
            "{}: {len} bytes, more than a snapshot file may have",
            path.display()
        )));
    }
    std::fs::read(path).map_err(|e| Error::io("read", path, e))
}

async fn put_small(store: &Store, bytes: Bytes, report: &mut PublishReport) -> Result<ObjectRef> {
    use base64::Engine;
    let mut r = ObjectRef {
        sha256: sha256_hex(&bytes),
        size: bytes.len() as u64,
        inline: None,
        name: None,
    };
    if r.size <= manifest::MAX_INLINE {
        r.inline = Some(base64::engine::general_purpose::STANDARD.encode(&bytes));
        return Ok(r);
    }
    if store.size(&r.key()).await? == Some(r.size) {
        touch(store, &r.key()).await?;
        report.objects_reused += 1;
    } else {
        report.bytes_uploaded += r.size;
        report.objects_uploaded += 1;
        store.put(&r.key(), bytes).await?;
    }
    Ok(r)
}

/// The first `len` bytes of the packed data.
fn packed_prefix(
    mem: &MemoryFile,
    runs: &[[u64; 2]],
    data_offset: u64,
    len: u64,
) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(len as usize);
    for &[first, n] in runs {
        let left = len - out.len() as u64;
        if left == 0 {
            break;
        }
        let take = (n * PAGE_SIZE_U64).min(left) as usize;
        let at = out.len();
        out.resize(at + take, 0);
        mem.file()
            .read_exact_at(&mut out[at..], data_offset + first * PAGE_SIZE_U64)
            .map_err(|e| Error::io("read memory image", mem.path(), e))?;
    }
    if out.len() as u64 != len {
        return Err(Error::InvalidInput(format!(
            "{}: {} bytes of data, {len} expected",
            mem.path().display(),
            out.len()
        )));
    }
    Ok(out)
}

/// Reads the packed data in pieces of at most `piece` bytes, in order, giving each to `f`.
fn for_each_piece(
    mem: &MemoryFile,
    runs: &[[u64; 2]],
    data_offset: u64,
    piece: u64,
    mut f: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; piece as usize];
    let mut fill = 0usize;
    for &[first, n] in runs {
        let mut off = data_offset + first * PAGE_SIZE_U64;
        let mut left = n * PAGE_SIZE_U64;
        while left > 0 {
            let take = left.min((piece as usize - fill) as u64) as usize;
            mem.file()
                .read_exact_at(&mut buf[fill..fill + take], off)
                .map_err(|e| Error::io("read memory image", mem.path(), e))?;
            fill += take;
            off += take as u64;
            left -= take as u64;
            if fill == piece as usize {
                f(&buf)?;
                fill = 0;
            }
        }
    }
    if fill > 0 {
        f(&buf[..fill])?;
    }
    Ok(())
}

/// SHA-256 of each chunk and of the whole, fed piece by piece.
struct ChunkHasher {
    chunk: u64,
    cur: Sha256,
    filled: u64,
    whole: Sha256,
    chunks: Vec<String>,
}

impl ChunkHasher {
    fn new(chunk: u64) -> ChunkHasher {
        ChunkHasher {
            chunk,
            cur: Sha256::new(),
            filled: 0,
            whole: Sha256::new(),
            chunks: Vec::new(),
        }
    }

    fn update(&mut self, mut b: &[u8]) {
        self.whole.update(b);
        while !b.is_empty() {
            let take = ((self.chunk - self.filled) as usize).min(b.len());
            self.cur.update(&b[..take]);
            self.filled += take as u64;
            b = &b[take..];
            if self.filled == self.chunk {
                let done = std::mem::take(&mut self.cur);
                self.chunks.push(hex(&done.finalize()));
                self.filled = 0;
            }
        }
    }

    fn finish(mut self) -> (String, Vec<String>) {
        if self.filled > 0 {
            self.chunks.push(hex(&self.cur.finalize()));
        }
        (hex(&self.whole.finalize()), self.chunks)
    }
}

/// Uploads the packed data as `key`, checksumming it as it goes (on the reading thread,
/// while earlier parts upload). Returns the whole data's and each chunk's SHA-256.
async fn upload_data(
    store: &Store,
    mem: &MemoryFile,
    runs: &[[u64; 2]],
    d: u64,
    key: &str,
    size: u64,
    options: &PublishOptions,
) -> Result<(String, Vec<String>)> {
    if size <= options.part_size as u64 {
        let mut all = Vec::with_capacity(size as usize);
        let mut h = ChunkHasher::new(options.chunk_size);
        for_each_piece(mem, runs, d, options.part_size as u64, |b| {
            h.update(b);
            all.extend_from_slice(b);
            Ok(())
        })?;
        store.put(key, Bytes::from(all)).await?;
        Progress::add_done(&options.progress, size);
        return Ok(h.finish());
    }
    let mem_path = mem.path().to_path_buf();
    let runs = runs.to_vec();
    let (part, chunk) = (options.part_size as u64, options.chunk_size);
    let progress = options.progress.clone();
    let read = move |send: &mut dyn FnMut(Vec<u8>) -> Result<()>| {
        let mem = MemoryFile::open(&mem_path)?;
        let mut h = ChunkHasher::new(chunk);
        let mut read = 0u64;
        for_each_piece(&mem, &runs, d, part, |b| {
            h.update(b);
            read += b.len() as u64;
            send(b.to_vec())?;
            // Handed to the upload (at most two pieces queued ahead of it).
            Progress::add_done(&progress, b.len() as u64);
            Ok(())
        })?;
        Ok((h.finish(), read))
    };
    let path = mem.path().to_path_buf();
    let (sums, _) = upload_pieces(store, key, options, read, |(_, read)| {
        if *read == size {
            Ok(())
        } else {
            Err(Error::InvalidInput(format!(
                "{}: {read} bytes of data pages, {size} expected",
                path.display()
            )))
        }
    })
    .await?;
    Ok(sums)
}

/// Uploads `data` as object `rel` the way [`publish`] uploads memory data (parts of
/// `options.part_size`, `options.concurrency` at once): the raw throughput a publish is
/// compared with.
pub async fn upload_bytes(
    store: &Store,
    rel: &str,
    data: Bytes,
    options: &PublishOptions,
) -> Result<()> {
    if data.len() <= options.part_size {
        return store.put(rel, data).await;
    }
    let upload = store.put_multipart(rel).await?;
    let mut w = object_store::WriteMultipart::new_with_chunk_size(upload, options.part_size);
    for piece in data.chunks(options.part_size) {
        if w.wait_for_capacity(options.concurrency).await.is_err() {
            break;
        }
        w.write(piece);
    }
    w.finish()
        .await
        .map(|_| ())
        .map_err(|e| Error::store("upload", &store.key(rel), e))
}

/// The files of the snapshot in directory `dir` and of the chain below it, base first
/// (each with its own frozen disk layer): what [`publish_chain`] publishes.
pub fn chain_files(dir: &Path) -> Result<Vec<SnapshotFiles>> {
    let open = |d: &Path| {
        vmm::PreparedSnapshot::open(d, vmm::CpuCheck::default())
            .map_err(|e| Error::InvalidInput(format!("{}: {e}", d.display())))
    };
    let top = open(dir)?;
    let mut out = Vec::new();
    for d in top.chain_dirs() {
        out.push(snapshot_files(d, open(d)?.disk()));
    }
    out.push(snapshot_files(dir, top.disk()));
    Ok(out)
}

/// The files of the snapshot in `dir`, whose saved disk is `disk`.
pub fn snapshot_files(dir: &Path, disk: Option<&vmm::SavedDisk>) -> SnapshotFiles {
    let ws = dir.join(vmm::WORKING_SET_FILE);
    SnapshotFiles {
        state: dir.join(vmm::STATE_FILE),
        memory: dir.join(vmm::MEMORY_FILE),
        working_set: ws.exists().then_some(ws),
        disk: disk.map(|d| SnapshotDisk {
            layer: d.layer.clone(),
            read_only: d.read_only,
        }),
    }
}

/// Publishes a snapshot and the chain below it (`chain`: base first, the snapshot last),
/// skipping the snapshots the store has already. Returns the snapshot's manifest and
/// what this call uploaded.
pub async fn publish_chain(
    store: &Store,
    chain: &[SnapshotFiles],
    options: &PublishOptions,
) -> Result<(Manifest, ChainReport)> {
    let mut report = ChainReport::default();
    let mut top = None;
    for files in chain {
        let id = state_file::read_header(&files.state)?.meta.id;
        let key = manifest::manifest_key(id);
        if store.size(&key).await?.is_some() {
            top = Some(Manifest::fetch(store, &key).await?);
            report.already_published.push(id);
            continue;
        }
        let (m, r) = publish(store, files, options).await?;
        report.bytes_uploaded += r.bytes_uploaded;
        report.published.push(id);
        top = Some(m);
    }
    let top = top.ok_or_else(|| Error::InvalidInput("an empty snapshot chain".into()))?;
    Ok((top, report))
}

/// What [`publish_chain`] did.
#[derive(Debug, Clone, Default)]
pub struct ChainReport {
    /// Snapshots published now, base first.
    pub published: Vec<SnapshotId>,
    /// Snapshots the store had already.
    pub already_published: Vec<SnapshotId>,
    /// Bytes uploaded.
    pub bytes_uploaded: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_working_set_is_packed_first() {
        let mut data = PageBitmap::new(32);
        data.set_range(0, 4);
        data.set_range(10, 6);
        // 20 is not a data page (a zero page: nothing to fetch); 11 twice.
        let (order, ws_runs) = packed_order(&data, &[12, 13, 2, 20, 11, 11, 14]);
        assert_eq!(ws_runs, 4);
        assert_eq!(
            order,
            vec![
                [12, 2],
                [2, 1],
                [11, 1],
                [14, 1],
                [0, 2],
                [3, 1],
                [10, 1],
                [15, 1]
            ]
        );
        let total: u64 = order.iter().map(|r| r[1]).sum();
        assert_eq!(total, data.count_ones());
    }
}

#[cfg(test)]
mod hasher_tests {
    use super::*;

    #[test]
    fn chunk_hashes_do_not_depend_on_how_the_data_is_cut() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let mut a = ChunkHasher::new(4096);
        a.update(&data);
        let mut b = ChunkHasher::new(4096);
        for piece in data.chunks(1000) {
            b.update(piece);
        }
        let (wa, ca) = a.finish();
        let (wb, cb) = b.finish();
        assert_eq!((&wa, &ca), (&wb, &cb));
        assert_eq!(ca.len(), 3);
        assert_eq!(ca[2], hex(&Sha256::digest(&data[8192..])));
        assert_eq!(wa, hex(&Sha256::digest(&data)));
    }
}
