//! Where an image's blobs are read from: an OCI image layout directory, or an archive (an
//! OCI archive or a `docker save` one) read in place: its members are indexed once and
//! each blob read from its offset, nothing extracted.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use crate::config::ImageDefaults;
use crate::error::{Error, Result};

/// Largest JSON document read (index, manifest, config): they are kilobytes.
const MAX_JSON: u64 = 8 << 20;

/// One layer of an image, bottom first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// `sha256:<hex>` of the blob as stored (compressed or not).
    pub digest: String,
    /// Its media type ("" for a `docker save` layer, which has none).
    pub media_type: String,
    /// Its size as stored, bytes (0 when unknown).
    pub size: u64,
}

enum Store {
    /// An OCI layout directory.
    Dir(PathBuf),
    /// An archive: member path → (offset of the data, size).
    Archive {
        path: PathBuf,
        members: HashMap<String, (u64, u64)>,
    },
}

/// An image: its layers and config, and a way to read its blobs.
pub struct Source {
    store: Store,
    /// What was opened (for messages).
    name: String,
    layers: Vec<Layer>,
    /// `sha256:<hex>` of each layer's uncompressed tar (the config's `rootfs.diff_ids`).
    diff_ids: Vec<String>,
    defaults: ImageDefaults,
}

/// `docker save`'s manifest.json entry.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    layers: Vec<String>,
}

impl Source {
    /// Opens `path`: an OCI layout directory (with `oci-layout` and `index.json`), or an
    /// archive (tar) holding one or a `docker save` manifest.json. An index with several
    /// manifests is resolved to linux/amd64.
    pub fn open(path: &Path) -> Result<Source> {
        let meta = std::fs::metadata(path).map_err(|e| Error::io("opening", path, e))?;
        let store = if meta.is_dir() {
            Store::Dir(path.to_path_buf())
        } else {
            Store::Archive {
                path: path.to_path_buf(),
                members: index_archive(path)?,
            }
        };
        let mut src = Source {
            store,
            name: path.display().to_string(),
            layers: Vec::new(),
            diff_ids: Vec::new(),
            defaults: ImageDefaults::default(),
        };
        if src.has("index.json") {
            src.read_oci()?;
        } else if src.has("manifest.json") {
            src.read_docker()?;
        } else {
            return Err(Error::NotAnImage(format!(
                "{}: neither an OCI image layout (index.json) nor a docker save archive \
                 (manifest.json)",
                src.name
            )));
        }
        Ok(src)
    }

    /// The layers, bottom first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// What the image config says a container of it gets by default.
    pub fn defaults(&self) -> &ImageDefaults {
        &self.defaults
    }

    /// The uncompressed digest the config gives layer `i`, if it gives one.
    pub fn diff_id(&self, i: usize) -> Option<&str> {
        self.diff_ids.get(i).map(String::as_str)
    }

    fn has(&self, member: &str) -> bool {
        match &self.store {
            Store::Dir(d) => d.join(member).is_file(),
            Store::Archive { members, .. } => members.contains_key(member),
        }
    }

    /// A member of the layout or archive, by its path there.
    fn member(&self, member: &str) -> Result<(Box<dyn Read>, u64)> {
        match &self.store {
            Store::Dir(d) => {
                let p = d.join(member);
                let f = File::open(&p).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => {
                        Error::BadBlob(format!("{}: {member} is missing", self.name))
                    }
                    _ => Error::io("opening", &p, e),
                })?;
                let len = f.metadata().map_err(|e| Error::io("reading", &p, e))?.len();
                Ok((Box::new(BufReader::new(f)), len))
            }
            Store::Archive { path, members } => {
                let &(off, len) = members
                    .get(member)
                    .ok_or_else(|| Error::BadBlob(format!("{}: {member} is missing", self.name)))?;
                let mut f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
                f.seek(SeekFrom::Start(off))
                    .map_err(|e| Error::io("reading", path, e))?;
                Ok((Box::new(BufReader::new(f).take(len)), len))
            }
        }
    }

    fn json<T: serde::de::DeserializeOwned>(&self, member: &str) -> Result<T> {
        let (r, len) = self.member(member)?;
        if len > MAX_JSON {
            return Err(Error::NotAnImage(format!(
                "{}: {member} is {len} bytes, not a manifest",
                self.name
            )));
        }
        let mut text = Vec::new();
        r.take(MAX_JSON)
            .read_to_end(&mut text)
            .map_err(|e| Error::io("reading", PathBuf::from(&self.name).join(member), e))?;
        serde_json::from_slice(&text)
            .map_err(|e| Error::NotAnImage(format!("{}: {member}: {e}", self.name)))
    }

    /// A blob's reader that checks its SHA-256 against `digest` when read to the end.
    pub fn blob(&self, digest: &str) -> Result<CheckedReader> {
        let hex = sha256_hex_of(digest).ok_or_else(|| {
            Error::BadBlob(format!("{}: digest {digest:?} is not sha256", self.name))
        })?;
        let (r, len) = self.member(&format!("blobs/sha256/{hex}"))?;
        Ok(CheckedReader::new(r, digest.to_string(), Some(len)))
    }

    /// A blob read whole and checked.
    fn blob_json<T: serde::de::DeserializeOwned>(&self, digest: &str) -> Result<T> {
        let mut r = self.blob(digest)?;
        let mut text = Vec::new();
        (&mut r)
            .take(MAX_JSON + 1)
            .read_to_end(&mut text)
            .map_err(|e| Error::BadBlob(format!("{}: blob {digest}: {e}", self.name)))?;
        if text.len() as u64 > MAX_JSON {
            return Err(Error::NotAnImage(format!(
                "{}: blob {digest} is too large",
                self.name
            )));
        }
        r.finish()?;
        serde_json::from_slice(&text)
            .map_err(|e| Error::NotAnImage(format!("{}: blob {digest}: {e}", self.name)))
    }

    fn read_oci(&mut self) -> Result<()> {
        let index: ImageIndex = self.json("index.json")?;
        let mut manifest_digest = pick_manifest(&index, &self.name)?;
        // An index may point at another index (multi-platform images).
        let mut depth = 0;
        let manifest: ImageManifest = loop {
            let v: serde_json::Value = self.blob_json(&manifest_digest)?;
            if v.get("manifests").is_some() {
                depth += 1;
                if depth > 4 {
                    return Err(Error::NotAnImage(format!(
                        "{}: indexes nested too deep",
                        self.name
                    )));
                }
                let inner: ImageIndex = serde_json::from_value(v).map_err(|e| {
                    Error::NotAnImage(format!("{}: {manifest_digest}: {e}", self.name))
                })?;
                manifest_digest = pick_manifest(&inner, &self.name)?;
                continue;
            }
            break serde_json::from_value(v).map_err(|e| {
                Error::NotAnImage(format!("{}: {manifest_digest}: {e}", self.name))
            })?;
        };
        let config: ImageConfiguration = self.blob_json(manifest.config().digest().as_ref())?;
        self.layers = manifest
            .layers()
            .iter()
            .map(|l| Layer {
                digest: l.digest().to_string(),
                media_type: l.media_type().to_string(),
                size: l.size(),
            })
            .collect();
        self.finish_config(&config)
    }

    fn read_docker(&mut self) -> Result<()> {
        let entries: Vec<DockerEntry> = self.json("manifest.json")?;
        let [entry] = &entries[..] else {
            return Err(Error::NotAnImage(format!(
                "{}: manifest.json lists {} images (one expected)",
                self.name,
                entries.len()
            )));
        };
        // Members are named by path in the archive; their digests are checked as their
        // content is read (`docker save` names blobs by digest since Docker 25; older
        // versions use <id>/layer.tar, checked against the config's diff_ids instead).
        let (r, _) = self.member(&entry.config)?;
        let config = ImageConfiguration::from_reader(r.take(MAX_JSON))
            .map_err(|e| Error::NotAnImage(format!("{}: {}: {e}", self.name, entry.config)))?;
        self.layers = entry
            .layers
            .iter()
            .map(|p| Layer {
                digest: format!("path:{p}"),
                media_type: String::new(),
                size: 0,
            })
            .collect();
        self.finish_config(&config)
    }

    fn finish_config(&mut self, config: &ImageConfiguration) -> Result<()> {
        self.diff_ids = config.rootfs().diff_ids().to_vec();
        if self.diff_ids.len() != self.layers.len() {
            return Err(Error::NotAnImage(format!(
                "{}: {} layers but {} diff_ids in the config",
                self.name,
                self.layers.len(),
                self.diff_ids.len()
            )));
        }
        self.defaults = ImageDefaults::from_config(config);
        Ok(())
    }

    /// Layer `i`'s uncompressed tar stream; its digest (and its uncompressed digest against
    /// the config's diff_id) are checked by [`CheckedReader::finish`]. The stored bytes it
    /// reads are added to `read` as it goes.
    pub(crate) fn layer_tar(
        &self,
        i: usize,
        read: Option<Arc<AtomicU64>>,
    ) -> Result<(LayerStream, String)> {
        let layer = &self.layers[i];
        let stored: CheckedReader = match layer.digest.strip_prefix("path:") {
            Some(p) => {
                let (r, len) = self.member(p)?;
                CheckedReader::unchecked(r, Some(len))
            }
            None => self.blob(&layer.digest)?,
        };
        let diff_id = self.diff_ids[i].clone();
        Ok((
            LayerStream::new(stored, diff_id, read)?,
            layer.digest.clone(),
        ))
    }
}

/// The manifest an index names for linux/amd64 (or its only one).
fn pick_manifest(index: &ImageIndex, name: &str) -> Result<String> {
    let m = index.manifests();
    let chosen = if m.len() == 1 {
        m.first()
    } else {
        m.iter().find(|d| {
            d.platform().as_ref().is_some_and(|p| {
                p.os().to_string() == "linux" && p.architecture().to_string() == "amd64"
            })
        })
    };
    chosen
        .map(|d| d.digest().to_string())
        .ok_or_else(|| Error::NotAnImage(format!("{name}: no linux/amd64 image in the index")))
}

/// The hex of a `sha256:<64 lowercase hex>` digest; None for anything else (so that a
/// digest can never name a path).
pub(crate) fn sha256_hex_of(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))).then_some(hex)
}

/// Member paths of a tar archive with their data's offset and size. A path is kept as
/// written, less a leading `./`; one with `..` is refused (an archive is untrusted).
fn index_archive(path: &Path) -> Result<HashMap<String, (u64, u64)>> {
    let f = File::open(path).map_err(|e| Error::io("opening", path, e))?;
    let mut a = tar::Archive::new(crate::tarlimit::TarLimit::new(BufReader::new(f)));
    let mut out = HashMap::new();
    let bad = |e: std::io::Error| {
        Error::NotAnImage(format!(
            "{}: not a readable tar archive: {e}",
            path.display()
        ))
    };
    for entry in a.entries().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let p = entry.path().map_err(bad)?.into_owned();
        if p.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(Error::NotAnImage(format!(
                "{}: member {} escapes the archive",
                path.display(),
                p.display()
            )));
        }
        let name = p.to_string_lossy().trim_start_matches("./").to_string();
        out.insert(name, (entry.raw_file_position(), entry.size()));
    }
    if out.is_empty() {
        return Err(Error::NotAnImage(format!(
            "{}: an empty archive",
            path.display()
        )));
    }
    Ok(out)
}

/// A reader that hashes what it reads; [`Self::finish`] checks the digest and length.
pub struct CheckedReader {
    inner: Box<dyn Read>,
    hasher: Sha256,
    digest: Option<String>,
    expected_len: Option<u64>,
    read: u64,
}

impl CheckedReader {
    fn new(inner: Box<dyn Read>, digest: String, expected_len: Option<u64>) -> Self {
        CheckedReader {
            inner,
            hasher: Sha256::new(),
            digest: Some(digest),
            expected_len,
            read: 0,
        }
    }

    fn unchecked(inner: Box<dyn Read>, expected_len: Option<u64>) -> Self {
        CheckedReader {
            digest: None,
            ..Self::new(inner, String::new(), expected_len)
        }
    }

    /// Reads what is left, then checks length and digest.
    pub fn finish(mut self) -> Result<()> {
        std::io::copy(&mut self, &mut std::io::sink()).map_err(|e| {
            Error::BadBlob(format!(
                "reading {}: {e}",
                self.digest.as_deref().unwrap_or("a layer")
            ))
        })?;
        if let Some(len) = self.expected_len {
            if self.read != len {
                return Err(Error::BadBlob(format!(
                    "blob {}: {} bytes read, {len} expected",
                    self.digest.as_deref().unwrap_or(""),
                    self.read
                )));
            }
        }
        if let Some(d) = &self.digest {
            let got = format!("sha256:{:x}", self.hasher.clone().finalize());
            if &got != d {
                return Err(Error::BadBlob(format!(
                    "blob {d} is corrupt: its content is {got}"
                )));
            }
        }
        Ok(())
    }
}

impl Read for CheckedReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

/// A layer's tar stream: the stored blob, decompressed when it is gzip, hashed again
/// uncompressed for its diff_id.
pub(crate) struct LayerStream {
    inner: Box<dyn Read>,
    hasher: Sha256,
    diff_id: String,
    stored: Option<std::rc::Rc<std::cell::RefCell<Option<CheckedReader>>>>,
}

/// The stored blob shared between the decoder (reading it) and the final check; what
/// is read of it is added to the counter, when there is one.
struct Shared(
    std::rc::Rc<std::cell::RefCell<Option<CheckedReader>>>,
    Option<Arc<AtomicU64>>,
);

impl Read for Shared {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = match self.0.borrow_mut().as_mut() {
            Some(r) => r.read(buf)?,
            None => 0,
        };
        if let Some(c) = &self.1 {
            c.fetch_add(n as u64, Ordering::Relaxed);
        }
        Ok(n)
    }
}

impl LayerStream {
    fn new(
        mut stored: CheckedReader,
        diff_id: String,
        read: Option<Arc<AtomicU64>>,
    ) -> Result<LayerStream> {
        let mut magic = [0u8; 4];
        let mut got = 0;
        while got < magic.len() {
            match stored.read(&mut magic[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) => return Err(Error::BadBlob(format!("reading a layer: {e}"))),
            }
        }
        let head = magic[..got].to_vec();
        if let Some(c) = &read {
            c.fetch_add(got as u64, Ordering::Relaxed);
        }
        let cell = std::rc::Rc::new(std::cell::RefCell::new(Some(stored)));
        let raw = std::io::Cursor::new(head.clone()).chain(Shared(cell.clone(), read));
        let inner: Box<dyn Read> =
            match head.as_slice() {
                [0x1f, 0x8b, ..] => Box::new(flate2::read::GzDecoder::new(raw)),
                [0x28, 0xb5, 0x2f, 0xfd] => return Err(Error::BadBlob(
                    "a zstd-compressed layer: not supported yet (gzip and uncompressed layers are)"
                        .into(),
                )),
                _ => Box::new(raw),
            };
        Ok(LayerStream {
            inner,
            hasher: Sha256::new(),
            diff_id,
            stored: Some(cell),
        })
    }

    /// Reads what is left; checks the uncompressed digest, then the stored blob's.
    pub(crate) fn finish(mut self) -> Result<()> {
        std::io::copy(&mut self, &mut std::io::sink())
            .map_err(|e| Error::BadBlob(format!("reading a layer: {e}")))?;
        let got = format!("sha256:{:x}", self.hasher.clone().finalize());
        if got != self.diff_id {
            return Err(Error::BadBlob(format!(
                "a layer's content is {got}, the image config says {}",
                self.diff_id
            )));
        }
        let stored = self.stored.take().and_then(|c| c.borrow_mut().take());
        match stored {
            Some(s) => s.finish(),
            None => Ok(()),
        }
    }
}

impl Read for LayerStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}
