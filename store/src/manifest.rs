//! The manifest of a published snapshot: a small JSON document that names its objects.
//!
//! Stored at `snapshots/<snapshot id>.json` under the store's prefix; written last, so a
//! snapshot whose manifest exists has every object it names. Objects live at
//! `objects/<sha256>` and are immutable: their key is their content's SHA-256, so two
//! snapshots (or templates) with the same bytes share one object.
//!
//! The memory file is published as three parts: its header and tables (`memory.head`,
//! the first D bytes of the file), and its data pages packed end to end in image order
//! (`memory.data`: holes are not uploaded), with `memory.runs` giving which image pages
//! those are. The packed data is read in chunks of `memory.chunk_size` bytes, each with
//! its own SHA-256 in `memory.chunks`, so a reader verifies every range it fetches.
//!
//! A snapshot with a disk also names its disk's layer files (`disk`): the frozen layer
//! the snapshot saved and every layer below it, top first, each one whole object named by
//! its content. The layers are immutable (frozen), so the same base layer under many
//! snapshots is one object; a host opening the snapshot downloads each layer once and
//! links them again by their layer ids (`cache`).
//!
//! A manifest is untrusted input like every snapshot file: [`Manifest::parse`] bounds its
//! size and checks every field before anything is fetched.

use serde::{Deserialize, Serialize};
use snapshot::{SnapshotId, SnapshotKind, PAGE_SIZE_U64};

use crate::{Error, Result};

/// The `format` field of every manifest.
pub const FORMAT: &str = "clade-snapshot";
/// The manifest version this build writes and reads.
pub const VERSION: u32 = 1;
/// Largest manifest accepted.
pub const MAX_MANIFEST_BYTES: usize = 16 << 20;
/// Smallest and largest chunk size.
pub const MIN_CHUNK: u64 = 64 << 10;
/// See [`MIN_CHUNK`].
pub const MAX_CHUNK: u64 = 64 << 20;
/// The chunk size [`crate::publish`] uses unless told otherwise. Measured on the native
/// tier against the test S3 server (`clade bench restore --store s3 --chunk-kib N`, a
/// 156 KiB working set in 96 MiB of data): 128 KiB chunks fetched 201 KiB on a cold
/// restore, 256 KiB 301 KiB, 2 MiB 2 MiB (one range read of 2 MiB there: ~10 ms).
pub const DEFAULT_CHUNK: u64 = 128 << 10;
/// Largest whole object fetched in one request (state file, memory head, working set).
pub const MAX_SMALL_OBJECT: u64 = 256 << 20;
/// Largest disk layer object: a layer of the largest virtual size the disk format allows
/// (2^24 blocks of 2 MiB) with its header and table.
pub const MAX_DISK_LAYER: u64 = (1 << 45) + (1 << 28);
/// Largest object written into the manifest itself.
pub const MAX_INLINE: u64 = 64 << 10;

/// One immutable object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectRef {
    /// SHA-256 of the content, lower-case hex; the key is `objects/<sha256>`.
    pub sha256: String,
    /// Length in bytes.
    pub size: u64,
    /// The content itself (base64), for an object of at most [`MAX_INLINE`] bytes: it is
    /// then not stored apart, and opening the snapshot costs no request for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inline: Option<String>,
    /// The key, when the object is named by a unique id rather than by its content:
    /// `data/<snapshot id>-<order>` for memory data, whose checksums are computed while
    /// it uploads (a name by content would need a pass over the data first), and
    /// `lead/<snapshot id>` for the lead object, whose key a reader derives from the id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ObjectRef {
    /// The object's key relative to the store's prefix.
    pub fn key(&self) -> String {
        self.name
            .clone()
            .unwrap_or_else(|| object_key(&self.sha256))
    }
}

/// The key of a snapshot's memory data packed in the order `runs`:
/// `data/<snapshot id>-<first 16 hex digits of the SHA-256 of the runs>`. The order depends
/// on the working set recorded when it was published, which a later restore may record
/// anew: a snapshot published again in another order is another object, never one whose
/// bytes no longer match the chunk checksums of the manifest naming it.
pub fn data_key(id: SnapshotId, runs: &[[u64; 2]]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for r in runs {
        h.update(r[0].to_le_bytes());
        h.update(r[1].to_le_bytes());
    }
    format!("data/{id}-{}", &crate::hex(&h.finalize())[..16])
}

/// The key of a snapshot's lead object: `lead/<snapshot id>`, a copy of the first
/// chunks of its memory data (those holding the recorded working set). A host opening the
/// snapshot asks for it together with the manifest, whose key it can also derive from the
/// id alone, so a cold open costs one round trip to the store rather than two.
pub fn lead_key(id: SnapshotId) -> String {
    format!("lead/{id}")
}

/// Whether `name` is a memory data object's name: `data/<snapshot id>` (older manifests)
/// or `data/<snapshot id>-<16 hex digits>`.
fn is_data_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("data/") else {
        return false;
    };
    match rest.split_once('-') {
        None => parse_id(rest).is_some(),
        Some((id, order)) => {
            parse_id(id).is_some()
                && order.len() == 16
                && order
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        }
    }
}

/// The key of the object with this SHA-256.
pub fn object_key(sha256: &str) -> String {
    format!("objects/{sha256}")
}

/// The key of a snapshot's manifest.
pub fn manifest_key(id: SnapshotId) -> String {
    format!("snapshots/{id}.json")
}

/// The memory file, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryObjects {
    /// The file's first `head.size` bytes (header, region table, diff bitmap): the data
    /// offset D.
    pub head: ObjectRef,
    /// The data pages, packed in image order.
    pub data: ObjectRef,
    /// `[first page, page count]` of each run of data pages, disjoint, in the order
    /// their bytes follow each other in `data`: the recorded working set first (in the
    /// order it was touched), then the other data pages in image order, so a restore
    /// fetches its working set in the first chunks and little else.
    pub runs: Vec<[u64; 2]>,
    /// Bytes per chunk of `data` (a page multiple).
    pub chunk_size: u64,
    /// SHA-256 of each chunk of `data` (the last may be short).
    pub chunks: Vec<String>,
    /// Bytes at the start of `data` that hold the recorded working set (0: none): a
    /// host opening the snapshot fetches the chunks holding them at once.
    #[serde(default)]
    pub working_set_bytes: u64,
    /// The lead object ([`lead_key`]): the first `lead.size` bytes of `data`, which are
    /// the chunks holding the working set, whole. Absent without a working set (and in
    /// manifests older builds wrote). A reader checks each of its chunks against
    /// `chunks` and, on any mismatch, ignores it and reads `data` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lead: Option<ObjectRef>,
}

/// One layer file of a snapshot's disk, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskLayer {
    /// The layer's id from its header (32 lower-case hex digits): how its child names it,
    /// and the name of its file in a cache (`layers/<id>.cdsk`).
    pub id: String,
    /// The layer file, whole (`objects/<sha256>`; never inline or named).
    pub object: ObjectRef,
    /// The SHA-256 of each chunk of the layer file, so that a host reads it lazily, chunk
    /// by chunk (absent in manifests older builds wrote: such a layer is downloaded whole).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunks: Option<LayerChunks>,
}

/// A layer file's chunk checksums: `table` is an object holding the 32-byte SHA-256 of
/// each `chunk_size` piece of the file, end to end (the last piece may be short).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerChunks {
    /// Bytes per chunk (a multiple of 64 KiB, 64 KiB to 64 MiB).
    pub chunk_size: u64,
    /// The checksums (`objects/<sha256>`; never inline or named).
    pub table: ObjectRef,
}

/// Bytes per chunk of a disk layer read lazily.
pub const LAYER_CHUNK: u64 = 512 << 10;

impl LayerChunks {
    /// Number of chunks of a layer file of `size` bytes.
    pub fn count(&self, size: u64) -> u64 {
        size.div_ceil(self.chunk_size)
    }
}

/// A snapshot's disk, as published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskObjects {
    /// The disk was read-only (restored VMs share the top layer read-only; otherwise each
    /// gets its own overlay on it).
    pub read_only: bool,
    /// The layer chain, top first: the frozen layer the snapshot saved, then its parent,
    /// and so on down to the base. At most [`disk::MAX_CHAIN_DEPTH`] layers.
    pub layers: Vec<DiskLayer>,
}

/// Parses a disk layer id written as 32 hex digits (never all zeros).
pub fn parse_layer_id(s: &str) -> Option<disk::LayerId> {
    if s.len() != 32
        || !s
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    {
        return None;
    }
    let mut b = [0u8; 16];
    for (i, out) in b.iter_mut().enumerate() {
        *out = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    (b != [0u8; 16]).then_some(b)
}

/// A published snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always [`FORMAT`].
    pub format: String,
    /// Always [`VERSION`].
    pub version: u32,
    /// The snapshot's id (its state and memory files carry it).
    pub id: String,
    /// `full` or `diff`.
    pub kind: String,
    /// For a diff: the id of the snapshot below it, published before it.
    pub base: Option<String>,
    /// Guest memory size in bytes.
    pub mem_size: u64,
    /// The state file.
    pub state: ObjectRef,
    /// The memory file.
    pub memory: MemoryObjects,
    /// The working-set file, if the snapshot had one.
    pub working_set: Option<ObjectRef>,
    /// The snapshot's disk, if it had one (absent in manifests of snapshots without one,
    /// and in those older builds wrote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk: Option<DiskObjects>,
}

fn parse_id(s: &str) -> Option<SnapshotId> {
    if s.len() != 32 {
        return None;
    }
    let mut b = [0u8; 16];
    for (i, out) in b.iter_mut().enumerate() {
        *out = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    let id = SnapshotId(b);
    (!id.is_none()).then_some(id)
}

/// Parses a snapshot id written as 32 hex digits.
pub fn parse_snapshot_id(s: &str) -> Result<SnapshotId> {
    parse_id(s)
        .ok_or_else(|| Error::InvalidInput(format!("{s:?} is not a snapshot id (32 hex digits)")))
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

impl Manifest {
    /// The manifest at `key` (relative to the store's prefix) in `store`, parsed: one
    /// over [`MAX_MANIFEST_BYTES`] is [`Error::TooLarge`] without being read.
    pub async fn fetch(store: &crate::Store, key: &str) -> Result<Manifest> {
        let bytes = store.get_max(key, MAX_MANIFEST_BYTES as u64).await?;
        Manifest::parse(&store.key(key), &bytes)
    }

    /// Parses and validates a manifest read from `key`.
    pub fn parse(key: &str, bytes: &[u8]) -> Result<Manifest> {
        let bad = |reason: String| Error::BadManifest {
            key: key.to_string(),
            reason,
        };
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(bad(format!(
                "{} bytes, more than the {MAX_MANIFEST_BYTES}-byte limit",
                bytes.len()
            )));
        }
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        m.validate().map_err(bad)?;
        Ok(m)
    }

    /// The snapshot's id.
    pub fn snapshot_id(&self) -> SnapshotId {
        // `validate` checked it.
        parse_id(&self.id).unwrap_or(SnapshotId::NONE)
    }

    /// The base snapshot's id, for a diff.
    pub fn base_id(&self) -> Option<SnapshotId> {
        self.base.as_deref().and_then(parse_id)
    }

    /// Full or diff.
    pub fn snapshot_kind(&self) -> SnapshotKind {
        if self.kind == "diff" {
            SnapshotKind::Diff
        } else {
            SnapshotKind::Full
        }
    }

    /// Image pages.
    pub fn pages(&self) -> u64 {
        self.mem_size / PAGE_SIZE_U64
    }

    /// Every object the manifest names (for deleting and reference counting).
    pub fn objects(&self) -> Vec<&ObjectRef> {
        let mut v = vec![&self.state, &self.memory.head, &self.memory.data];
        v.extend(self.memory.lead.as_ref());
        v.extend(self.working_set.as_ref());
        if let Some(d) = &self.disk {
            for l in &d.layers {
                v.push(&l.object);
                v.extend(l.chunks.as_ref().map(|c| &c.table));
            }
        }
        v
    }

    /// The chunk `i`'s byte range in the packed data.
    pub fn chunk_range(&self, i: u64) -> (u64, u64) {
        let c = self.memory.chunk_size;
        let start = i * c;
        (start, (start + c).min(self.memory.data.size))
    }

    /// Number of chunks of the packed data.
    pub fn chunk_count(&self) -> u64 {
        self.memory.data.size.div_ceil(self.memory.chunk_size)
    }

    /// The chunks holding the recorded working set: `0..n`.
    pub fn working_set_chunks(&self) -> u64 {
        self.memory
            .working_set_bytes
            .div_ceil(self.memory.chunk_size)
    }

    /// Bytes of the lead object of this manifest's snapshot: the working set's chunks,
    /// whole (0 without a working set).
    pub fn lead_size(&self) -> u64 {
        match self.working_set_chunks() {
            0 => 0,
            n => self.chunk_range(n - 1).1,
        }
    }

    fn validate(&self) -> std::result::Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format {:?}, expected {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!(
                "version {}, this build reads version {VERSION}",
                self.version
            ));
        }
        if parse_id(&self.id).is_none() {
            return Err(format!("id {:?} is not a snapshot id", self.id));
        }
        match (self.kind.as_str(), &self.base) {
            ("full", None) => {}
            ("diff", Some(b)) if parse_id(b).is_some() && *b != self.id => {}
            ("full", Some(_)) => return Err("a full snapshot with a base".into()),
            ("diff", _) => return Err("a diff snapshot without a valid base".into()),
            (k, _) => return Err(format!("unknown kind {k:?}")),
        }
        if self.mem_size == 0
            || !self.mem_size.is_multiple_of(PAGE_SIZE_U64)
            || self.mem_size > snapshot::memory_file::MAX_MEM_SIZE
        {
            return Err(format!("memory size {} is not valid", self.mem_size));
        }
        for o in self.objects() {
            if !is_sha256(&o.sha256) {
                return Err(format!("object checksum {:?} is not a SHA-256", o.sha256));
            }
            if o.inline.is_some() && o.size > MAX_INLINE {
                return Err(format!("an inline object of {} bytes", o.size));
            }
            if let Some(n) = &o.name {
                if !is_data_name(n)
                    && !self
                        .memory
                        .lead
                        .as_ref()
                        .is_some_and(|l| std::ptr::eq(l, o))
                {
                    return Err(format!("object name {n:?} is not data/<snapshot id>"));
                }
            }
        }
        if self.memory.data.inline.is_some() {
            return Err("memory data inline".into());
        }
        if let Some(l) = &self.memory.lead {
            let want = lead_key(self.snapshot_id());
            if l.name.as_deref() != Some(want.as_str()) || l.inline.is_some() {
                return Err(format!("the lead object is not {want}"));
            }
            if l.size == 0 || l.size != self.lead_size() {
                return Err(format!(
                    "a lead object of {} bytes for {} bytes of working set in chunks of {}",
                    l.size, self.memory.working_set_bytes, self.memory.chunk_size
                ));
            }
        }
        for (what, o) in [
            ("state", Some(&self.state)),
            ("memory head", Some(&self.memory.head)),
            ("working set", self.working_set.as_ref()),
        ] {
            if let Some(o) = o {
                if o.size > MAX_SMALL_OBJECT {
                    return Err(format!("{what} object of {} bytes", o.size));
                }
            }
        }
        let m = &self.memory;
        if m.head.size < snapshot::memory_file::FIXED_HEADER_LEN as u64
            || !m.head.size.is_multiple_of(PAGE_SIZE_U64)
        {
            return Err(format!("memory head of {} bytes", m.head.size));
        }
        if m.chunk_size < MIN_CHUNK
            || m.chunk_size > MAX_CHUNK
            || !m.chunk_size.is_multiple_of(PAGE_SIZE_U64)
        {
            return Err(format!("chunk size {}", m.chunk_size));
        }
        let pages = self.pages();
        let mut total = 0u64;
        for &[first, n] in &m.runs {
            if n == 0 || first.checked_add(n).is_none_or(|e| e > pages) {
                return Err(format!("data run [{first}, {n}] out of range"));
            }
            total += n;
        }
        let mut sorted = m.runs.clone();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0][0] + w[0][1] > w[1][0]) {
            return Err(format!("data runs {:?} and {:?} overlap", w[0], w[1]));
        }
        if total * PAGE_SIZE_U64 != m.data.size {
            return Err(format!(
                "runs hold {total} pages, data object is {} bytes",
                m.data.size
            ));
        }
        if m.chunks.len() as u64 != m.data.size.div_ceil(m.chunk_size) {
            return Err(format!(
                "{} chunk checksums for {} bytes in chunks of {}",
                m.chunks.len(),
                m.data.size,
                m.chunk_size
            ));
        }
        if m.working_set_bytes > m.data.size {
            return Err(format!(
                "working set of {} bytes in {} bytes of data",
                m.working_set_bytes, m.data.size
            ));
        }
        if let Some(c) = m.chunks.iter().find(|c| !is_sha256(c)) {
            return Err(format!("chunk checksum {c:?} is not a SHA-256"));
        }
        if let Some(d) = &self.disk {
            validate_disk(d)?;
        }
        Ok(())
    }

    /// Serialised, as stored.
    pub fn to_bytes(&self) -> Vec<u8> {
        // Serialising plain strings and integers cannot fail. Compact: a cold open waits
        // for every byte of it.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

fn validate_disk(d: &DiskObjects) -> std::result::Result<(), String> {
    if d.layers.is_empty() || d.layers.len() > disk::MAX_CHAIN_DEPTH {
        return Err(format!(
            "a disk of {} layers (1 to {})",
            d.layers.len(),
            disk::MAX_CHAIN_DEPTH
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for l in &d.layers {
        if parse_layer_id(&l.id).is_none() {
            return Err(format!("disk layer id {:?} is not 32 hex digits", l.id));
        }
        if !seen.insert(l.id.as_str()) {
            return Err(format!("disk layer {} twice in the chain", l.id));
        }
        let o = &l.object;
        if o.inline.is_some() || o.name.is_some() {
            return Err(format!("disk layer {} is not a plain object", l.id));
        }
        if o.size < disk::HEADER_SIZE || o.size > MAX_DISK_LAYER {
            return Err(format!("disk layer {} of {} bytes", l.id, o.size));
        }
        if let Some(c) = &l.chunks {
            let t = &c.table;
            if c.chunk_size < MIN_CHUNK
                || c.chunk_size > MAX_CHUNK
                || !c.chunk_size.is_multiple_of(MIN_CHUNK)
                || c.chunk_size < 2 * disk::HEADER_SIZE
            {
                return Err(format!("disk layer {}: chunk size {}", l.id, c.chunk_size));
            }
            if t.inline.is_some() || t.name.is_some() || !is_sha256(&t.sha256) {
                return Err(format!(
                    "disk layer {}: chunk table is not a plain object",
                    l.id
                ));
            }
            if t.size != 32 * c.count(o.size) || t.size > MAX_SMALL_OBJECT {
                return Err(format!(
                    "disk layer {}: a chunk table of {} bytes for {} chunks",
                    l.id,
                    t.size,
                    c.count(o.size)
                ));
            }
        }
    }
    Ok(())
}

/// Where a run of packed data lands in the memory file: `len` bytes of the packed data
/// at `packed` go to file offset `file`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Offset in the packed data.
    pub packed: u64,
    /// Offset in the local memory file.
    pub file: u64,
    /// Bytes.
    pub len: u64,
}

/// Where a snapshot's data pages are: what a reader of its memory file needs of the
/// manifest (the fetcher hands it to VM processes, which need not read the manifest's
/// chunk checksums).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Guest memory size.
    pub mem_size: u64,
    /// The memory file's data offset (the head's size).
    pub head_size: u64,
    /// Bytes per chunk of packed data.
    pub chunk_size: u64,
    /// The data runs, in packed order.
    pub runs: Vec<[u64; 2]>,
}

impl Layout {
    /// A manifest's layout.
    pub fn of(m: &Manifest) -> Layout {
        Layout {
            mem_size: m.mem_size,
            head_size: m.memory.head.size,
            chunk_size: m.memory.chunk_size,
            runs: m.memory.runs.clone(),
        }
    }

    /// Checks what a reader relies on (from another process: not trusted blindly).
    pub fn check(&self) -> Result<()> {
        let pages = self.mem_size / PAGE_SIZE_U64;
        let bad = self.mem_size > snapshot::memory_file::MAX_MEM_SIZE
            || self.chunk_size < PAGE_SIZE_U64
            || self
                .runs
                .iter()
                .any(|&[f, n]| n == 0 || f.checked_add(n).is_none_or(|e| e > pages));
        if bad {
            return Err(Error::Fetcher("the fetcher gave an invalid layout".into()));
        }
        Ok(())
    }

    /// Image pages.
    pub fn pages(&self) -> u64 {
        self.mem_size / PAGE_SIZE_U64
    }

    /// The data pages as a bitmap.
    pub fn data_bitmap(&self) -> snapshot::bitmap::PageBitmap {
        let mut b = snapshot::bitmap::PageBitmap::new(self.pages());
        for &[s, n] in &self.runs {
            b.set_range(s, n);
        }
        b
    }
}

/// The runs of a manifest as placements (packed offset → file offset), sorted by file
/// offset.
pub fn placements(m: &Manifest) -> Vec<Placement> {
    layout_placements(&Layout::of(m))
}

/// A layout's runs as placements, sorted by file offset.
pub fn layout_placements(l: &Layout) -> Vec<Placement> {
    let d = l.head_size;
    let mut packed = 0;
    let mut v: Vec<Placement> = l
        .runs
        .iter()
        .map(|&[first, n]| {
            let p = Placement {
                packed,
                file: d + first * PAGE_SIZE_U64,
                len: n * PAGE_SIZE_U64,
            };
            packed += p.len;
            p
        })
        .collect();
    v.sort_unstable_by_key(|p| p.file);
    v
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Manifest {
        let z = "0".repeat(64);
        Manifest {
            format: FORMAT.into(),
            version: VERSION,
            id: "0123456789abcdef0123456789abcdef".into(),
            kind: "full".into(),
            base: None,
            mem_size: 1 << 20,
            state: ObjectRef {
                sha256: z.clone(),
                size: 10,
                inline: None,
                name: None,
            },
            memory: MemoryObjects {
                head: ObjectRef {
                    sha256: z.clone(),
                    size: 4096,
                    inline: None,
                    name: None,
                },
                data: ObjectRef {
                    sha256: z.clone(),
                    size: 3 * 4096,
                    inline: None,
                    name: Some("data/0123456789abcdef0123456789abcdef".into()),
                },
                runs: vec![[0, 1], [10, 2]],
                chunk_size: MIN_CHUNK,
                chunks: vec![z],
                working_set_bytes: 4096,
                lead: None,
            },
            working_set: None,
            disk: None,
        }
    }

    #[test]
    fn a_lead_object_must_be_the_working_sets_chunks_under_its_key() {
        let mut m = sample();
        let lead = |size: u64, name: &str| ObjectRef {
            sha256: "1".repeat(64),
            size,
            inline: None,
            name: Some(name.into()),
        };
        let key = lead_key(m.snapshot_id());
        // One chunk of MIN_CHUNK holds the 4096-byte working set; the data is 3 pages.
        m.memory.lead = Some(lead(3 * 4096, &key));
        let back = Manifest::parse("k", &m.to_bytes()).unwrap();
        assert_eq!(back, m);
        assert!(back.objects().iter().any(|o| o.key() == key));
        for bad in [
            lead(4096, &key),
            lead(3 * 4096, "lead/00000000000000000000000000000001"),
            lead(3 * 4096, "data/0123456789abcdef0123456789abcdef"),
        ] {
            m.memory.lead = Some(bad.clone());
            assert!(
                Manifest::parse("k", &m.to_bytes()).is_err(),
                "{bad:?} accepted"
            );
        }
        // No working set, no lead.
        m.memory.working_set_bytes = 0;
        m.memory.lead = Some(lead(3 * 4096, &key));
        assert!(Manifest::parse("k", &m.to_bytes()).is_err());
        // Another object may not take the lead's name.
        m.memory.working_set_bytes = 4096;
        m.memory.lead = None;
        m.state.name = Some(key);
        assert!(Manifest::parse("k", &m.to_bytes()).is_err());
    }

    pub(crate) fn sample_disk() -> DiskObjects {
        let layer = |id: &str, sha: char| DiskLayer {
            id: id.repeat(16),
            object: ObjectRef {
                sha256: sha.to_string().repeat(64),
                size: 1 << 20,
                inline: None,
                name: None,
            },
            chunks: None,
        };
        DiskObjects {
            read_only: false,
            layers: vec![layer("a1", 'a'), layer("b2", 'b')],
        }
    }

    #[test]
    fn a_disk_round_trips_and_old_manifests_have_none() {
        let mut m = sample();
        m.disk = Some(sample_disk());
        let back = Manifest::parse("k", &m.to_bytes()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.objects().len(), 5);
        // A manifest written before disks were published: no `disk` field at all.
        let old = sample().to_bytes();
        assert!(!String::from_utf8_lossy(&old).contains("disk"));
        assert_eq!(Manifest::parse("k", &old).unwrap().disk, None);
    }

    #[test]
    fn bad_disks_are_refused() {
        type Edit = Box<dyn Fn(&mut DiskObjects)>;
        let cases: Vec<Edit> = vec![
            Box::new(|d| d.layers.clear()),
            Box::new(|d| d.layers[0].id = "a1".into()),
            Box::new(|d| d.layers[0].id = "0".repeat(32)),
            Box::new(|d| d.layers[0].id = "A1".repeat(16)),
            Box::new(|d| d.layers[0].id = "../".repeat(11)[..32].to_string()),
            Box::new(|d| d.layers[1].id = d.layers[0].id.clone()),
            Box::new(|d| d.layers[0].object.sha256 = "../x".into()),
            Box::new(|d| d.layers[0].object.size = 10),
            Box::new(|d| d.layers[0].object.size = u64::MAX),
            Box::new(|d| d.layers[0].object.inline = Some(String::new())),
            Box::new(|d| d.layers[0].object.name = Some("data/x".into())),
            Box::new(|d| {
                let l = d.layers[0].clone();
                d.layers = (0..=disk::MAX_CHAIN_DEPTH)
                    .map(|i| DiskLayer {
                        id: format!("{:032x}", i + 1),
                        ..l.clone()
                    })
                    .collect();
            }),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut m = sample();
            let mut d = sample_disk();
            f(&mut d);
            m.disk = Some(d);
            assert!(
                matches!(
                    Manifest::parse("k", &m.to_bytes()),
                    Err(Error::BadManifest { .. })
                ),
                "case {i} accepted"
            );
        }
    }

    #[test]
    fn runs_in_working_set_order_place_by_file_offset() {
        let mut m = sample();
        m.memory.runs = vec![[10, 2], [0, 1]];
        let back = Manifest::parse("k", &m.to_bytes()).unwrap();
        let p = placements(&back);
        assert_eq!(
            p[0],
            Placement {
                packed: 8192,
                file: 4096,
                len: 4096
            }
        );
        assert_eq!(
            p[1],
            Placement {
                packed: 0,
                file: 4096 + 10 * 4096,
                len: 8192
            }
        );
        assert_eq!(chunks_for(&p, 4096, 4096 + 10 * 4096, 4096), vec![0]);
        assert_eq!(chunks_for(&p, 4096, 4096, 4096), vec![2]);
        // A range over both runs: the chunks ascending, each once.
        assert_eq!(chunks_for(&p, 4096, 0, 1 << 20), vec![0, 1, 2]);
    }

    #[test]
    fn valid_manifest_round_trips() {
        let m = sample();
        let back = Manifest::parse("k", &m.to_bytes()).unwrap();
        assert_eq!(back, m);
        assert_eq!(back.chunk_count(), 1);
        let p = placements(&back);
        assert_eq!(
            p[1],
            Placement {
                packed: 4096,
                file: 4096 + 10 * 4096,
                len: 8192
            }
        );
    }

    #[test]
    fn bad_manifests_are_refused() {
        type Edit = Box<dyn Fn(&mut Manifest)>;
        let cases: Vec<Edit> = vec![
            Box::new(|m| m.format = "x".into()),
            Box::new(|m| m.version = 2),
            Box::new(|m| m.id = "zz".into()),
            Box::new(|m| m.kind = "diff".into()),
            Box::new(|m| m.base = Some(m.id.clone())),
            Box::new(|m| m.mem_size = 4095),
            Box::new(|m| m.memory.runs = vec![[10, 2], [11, 1]]),
            Box::new(|m| m.memory.runs = vec![[0, 1], [255, 2]]),
            Box::new(|m| m.memory.runs.push([20, 1])),
            Box::new(|m| m.memory.chunk_size = 4096),
            Box::new(|m| m.memory.chunks.push("0".repeat(64))),
            Box::new(|m| m.memory.chunks[0] = "../../etc".into()),
            Box::new(|m| m.state.sha256 = "../x".into()),
            Box::new(|m| m.memory.head.size = 100),
            Box::new(|m| m.state.size = u64::MAX),
            Box::new(|m| m.memory.working_set_bytes = 1 << 20),
            Box::new(|m| m.memory.data.inline = Some(String::new())),
            Box::new(|m| m.memory.data.name = Some("../../etc/passwd".into())),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut m = sample();
            f(&mut m);
            assert!(
                matches!(
                    Manifest::parse("k", &m.to_bytes()),
                    Err(Error::BadManifest { .. })
                ),
                "case {i} accepted"
            );
        }
        assert!(Manifest::parse("k", b"{").is_err());
        assert!(Manifest::parse("k", &vec![b' '; MAX_MANIFEST_BYTES + 1]).is_err());
    }

    #[test]
    fn snapshot_ids_parse() {
        assert!(parse_snapshot_id("00000000000000000000000000000000").is_err());
        assert!(parse_snapshot_id("xyz").is_err());
        let id = SnapshotId::random();
        assert_eq!(parse_snapshot_id(&id.to_string()).unwrap(), id);
    }
}

/// The chunks of the packed data that hold bytes `offset..offset + len` of the local
/// memory file (`placements` from [`placements`]), as an ascending list without
/// duplicates. Ranges in holes (zero pages) need no chunk.
pub fn chunks_for(placements: &[Placement], chunk_size: u64, offset: u64, len: u64) -> Vec<u64> {
    let end = offset.saturating_add(len);
    let mut out: Vec<u64> = Vec::new();
    // The first placement that ends after `offset`.
    let first = placements.partition_point(|p| p.file + p.len <= offset);
    for p in &placements[first..] {
        if p.file >= end {
            break;
        }
        let s = offset.max(p.file);
        let e = end.min(p.file + p.len);
        let ps = p.packed + (s - p.file);
        let pe = p.packed + (e - p.file);
        out.extend(ps / chunk_size..pe.div_ceil(chunk_size));
    }
    // Runs are packed in working-set order, not file order: chunks come in any order.
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn chunks_for_maps_file_ranges_to_packed_chunks() {
        // Pages 0..16 and 100..132 hold data; chunks of 16 pages.
        let p = vec![
            Placement {
                packed: 0,
                file: 4096,
                len: 16 * 4096,
            },
            Placement {
                packed: 16 * 4096,
                file: 4096 + 100 * 4096,
                len: 32 * 4096,
            },
        ];
        let c = 16 * 4096;
        assert_eq!(chunks_for(&p, c, 4096, 4096), vec![0]);
        assert_eq!(chunks_for(&p, c, 0, 4096), Vec::<u64>::new());
        assert_eq!(chunks_for(&p, c, 4096 + 50 * 4096, 4096), Vec::<u64>::new());
        assert_eq!(chunks_for(&p, c, 4096 + 100 * 4096, 4096), vec![1]);
        assert_eq!(chunks_for(&p, c, 4096 + 131 * 4096, 4096), vec![2]);
        assert_eq!(chunks_for(&p, c, 0, 1 << 30), vec![0, 1, 2]);
        assert_eq!(chunks_for(&p, c, u64::MAX - 5, 100), Vec::<u64>::new());
    }
}
