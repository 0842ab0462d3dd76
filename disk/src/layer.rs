//! One layer file: its header and allocation table, validated when opened.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::header::{
    decode_slots, Header, LayerId, ParentRef, HEADER_SIZE, HEADER_SLOTS, VERSION_1,
};
use crate::{Error, Result};

/// An open layer file. The allocation table is held in memory: entry `i` is 0 when block `i`
/// is not in this layer, else the file offset of its data.
#[derive(Debug)]
pub struct Layer {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) header: Header,
    /// The header slot `header` was read from (the next rewrite goes to the other one).
    pub(crate) header_slot: usize,
    pub(crate) table: Vec<u64>,
    pub(crate) file_len: u64,
    pub(crate) writable: bool,
    /// Filled on demand (`remote`): its source, once the chain opening it found one.
    pub(crate) on_demand: bool,
    pub(crate) source: Option<std::sync::Arc<dyn crate::remote::BlockSource>>,
}

/// How long to wait for a conflicting lock to go away. A process that forks (to exec a helper)
/// briefly shares its open files with the child, locks included; a real second user holds the
/// lock for much longer than this.
const LOCK_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Takes an advisory lock (`flock`): exclusive for a writer, shared for readers, so two VMMs
/// never write one layer and nobody writes a layer others read.
pub(crate) fn lock(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    let deadline = std::time::Instant::now() + LOCK_GRACE;
    loop {
        // SAFETY: flock on a file descriptor this File owns; no memory is passed.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(Error::io(path, "flock")(e));
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::InUse(path.to_path_buf()));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Length of a regular file or a block device.
pub(crate) fn file_len(file: &File, path: &Path) -> Result<u64> {
    let mut f = file;
    f.seek(SeekFrom::End(0)).map_err(Error::io(path, "seek"))
}

/// Encodes table entries as stored (little-endian u64).
pub(crate) fn encode_entries(entries: &[u64]) -> Vec<u8> {
    let mut b = Vec::with_capacity(entries.len() * 8);
    for e in entries {
        b.extend_from_slice(&e.to_le_bytes());
    }
    b
}

impl Layer {
    /// Opens and validates a layer. `writable` opens it read-write with an exclusive lock
    /// and refuses a frozen layer; otherwise read-only with a shared lock.
    pub fn open(path: &Path, writable: bool) -> Result<Self> {
        Self::open_with(path, writable, false)
    }

    /// Opens a layer read-write with an exclusive lock, frozen or not, for a rewrite of
    /// its header only (never of its table or data: a frozen layer's content is fixed).
    pub(crate) fn open_for_header_rewrite(path: &Path) -> Result<Self> {
        Self::open_with(path, true, true)
    }

    fn open_with(path: &Path, writable: bool, allow_frozen: bool) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(writable)
            .open(path)
            .map_err(Error::io(path, "open"))?;
        let read_header = || -> Result<(u64, Header, usize)> {
            let len = file_len(&file, path)?;
            let mut head = vec![0u8; (HEADER_SLOTS * HEADER_SIZE).min(len) as usize];
            file.read_exact_at(&mut head, 0)
                .map_err(Error::io(path, "read header"))?;
            let (header, slot) = decode_slots(path, &head)?;
            Ok((len, header, slot))
        };
        if let Err(e) = lock(&file, path, writable) {
            // A frozen layer has readers: say why it cannot be written rather than "in use".
            if writable && !allow_frozen && matches!(read_header(), Ok((_, h, _)) if h.frozen()) {
                return Err(Error::Frozen(path.to_path_buf()));
            }
            return Err(e);
        }
        let (len, header, header_slot) = read_header()?;
        if writable && !allow_frozen && header.frozen() {
            return Err(Error::Frozen(path.to_path_buf()));
        }
        let corrupt = |what: String| Error::Corrupt {
            path: path.to_path_buf(),
            what,
        };
        let table_end = header.table_offset + header.table_bytes();
        if len < table_end {
            return Err(corrupt(format!(
                "truncated allocation table: the file has {len} bytes, the table ends at {table_end}"
            )));
        }
        let mut raw = vec![0u8; header.table_bytes() as usize];
        file.read_exact_at(&mut raw, header.table_offset)
            .map_err(Error::io(path, "read allocation table"))?;
        let table: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u64::from_le_bytes(a)
            })
            .collect();
        let bs = u64::from(header.block_size);
        let mut used = Vec::new();
        for (i, &off) in table.iter().enumerate() {
            if off == 0 {
                continue;
            }
            if off % bs != 0
                || off < header.data_offset
                || off.checked_add(bs).is_none_or(|e| e > len)
            {
                return Err(corrupt(format!(
                    "block {i} points at offset {off}, outside the data area \
                     ({}..{len} in {bs}-byte blocks)",
                    header.data_offset
                )));
            }
            used.push(off);
        }
        used.sort_unstable();
        if let Some(w) = used.windows(2).find(|w| w[0] == w[1]) {
            return Err(corrupt(format!(
                "two blocks share the data at offset {}",
                w[0]
            )));
        }
        let layer = Self {
            path: path.to_path_buf(),
            file,
            header,
            header_slot,
            table,
            file_len: len,
            writable,
            on_demand: !writable && crate::remote::is_filled_on_demand(path),
            source: None,
        };
        if layer.header.frozen() && layer.table_crc() != layer.header.table_crc {
            return Err(corrupt(format!(
                "frozen layer's allocation table checksum mismatch (stored {:#010x}, computed {:#010x})",
                layer.header.table_crc,
                layer.table_crc()
            )));
        }
        Ok(layer)
    }

    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Blocks stored in this layer.
    pub fn allocated_blocks(&self) -> u64 {
        self.table.iter().filter(|&&o| o != 0).count() as u64
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Where block `idx` is in this layer's file, if it is here.
    pub fn block_offset(&self, idx: u64) -> Option<u64> {
        self.table
            .get(usize::try_from(idx).ok()?)
            .copied()
            .filter(|&o| o != 0)
    }

    /// CRC-32 of the allocation table as it is (in memory, which equals the file after a
    /// flush).
    pub fn table_crc(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        for e in &self.table {
            h.update(&e.to_le_bytes());
        }
        h.finalize()
    }

    /// Reads `buf.len()` bytes of block `idx` starting `within` bytes into it; false if
    /// the block is not in this layer.
    pub(crate) fn read_block(&self, idx: u64, within: u64, buf: &mut [u8]) -> Result<bool> {
        let Some(off) = self.block_offset(idx) else {
            return Ok(false);
        };
        if self.on_demand {
            let unfilled = |what: String| Error::Unfilled {
                path: self.path.clone(),
                what,
            };
            let Some(src) = &self.source else {
                return Err(unfilled(
                    "its data is filled on demand by a fetcher (a `.present` marker beside it); \
                     open it through one"
                        .into(),
                ));
            };
            src.ensure(off + within, buf.len() as u64)
                .map_err(|e| unfilled(format!("block {idx} could not be fetched: {e}")))?;
        }
        self.file
            .read_exact_at(buf, off + within)
            .map_err(Error::io(&self.path, "read data block"))?;
        Ok(true)
    }

    /// Writes the header (after the caller changed it) and syncs. Version 2: into the slot
    /// not in use, with the next sequence number, so a torn write leaves the current header
    /// valid (everything the new header describes must be durable before this is called).
    /// Version 1 has one slot and is rewritten in place.
    pub(crate) fn write_header(&mut self) -> Result<()> {
        let slot = if self.header.version == VERSION_1 {
            0
        } else {
            self.header.sequence = self.header.sequence.wrapping_add(1);
            (self.header_slot + 1) % HEADER_SLOTS as usize
        };
        self.file
            .write_all_at(&self.header.encode(), slot as u64 * HEADER_SIZE)
            .map_err(Error::io(&self.path, "write header"))?;
        self.file
            .sync_data()
            .map_err(Error::io(&self.path, "fdatasync"))?;
        self.header_slot = slot;
        Ok(())
    }

    /// Marks this (flushed, writable) layer frozen: table checksum and flag in the header,
    /// synced; the layer stays open, read-only, with a shared lock.
    pub(crate) fn freeze_in_place(&mut self) -> Result<()> {
        if !self.writable {
            return Err(Error::Invalid(format!(
                "{}: freezing needs the layer open for writing",
                self.path.display()
            )));
        }
        let saved = self.header.clone();
        self.header.flags |= crate::FLAG_FROZEN;
        self.header.table_crc = self.table_crc();
        if let Err(e) = self.write_header() {
            self.header = saved;
            return Err(e);
        }
        self.writable = false;
        // Downgrade the exclusive lock: children may now share it.
        lock(&self.file, &self.path, false)
    }
}

// ---- creating layer files (used by `ops` and by `Disk::snapshot`) ----

/// A fresh random layer id (never all zeros, which means "no parent").
pub fn random_id() -> LayerId {
    let mut id = [0u8; 16];
    let from_urandom = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut id));
    if from_urandom.is_err() || id == [0; 16] {
        // Unique enough without a random source: time, pid and a counter, hashed.
        use std::hash::{BuildHasher, Hasher};
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        for (i, chunk) in id.chunks_mut(8).enumerate() {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(t);
            h.write_u32(std::process::id());
            h.write_u64(n);
            h.write_usize(i);
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
        id[0] |= 1;
    }
    id
}

/// How a child at `child` refers to its parent at `parent`: by file name when both are in
/// the same directory (the pair can then be moved together), else by absolute path.
pub(crate) fn stored_parent_path(parent: &Path, child: &Path) -> Result<PathBuf> {
    let parent_abs = parent
        .canonicalize()
        .map_err(Error::io(parent, "resolve path"))?;
    let child_dir = match child.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let child_dir = child_dir
        .canonicalize()
        .map_err(Error::io(&child_dir, "resolve directory"))?;
    match (parent_abs.parent(), parent_abs.file_name()) {
        (Some(d), Some(name)) if d == child_dir => Ok(PathBuf::from(name)),
        _ => Ok(parent_abs),
    }
}

/// The parent record for a child at `child` of the (frozen, or about to be frozen with
/// table checksum `table_crc`) layer at `parent` with header `header`.
pub(crate) fn parent_ref_for(
    parent: &Path,
    child: &Path,
    header: &Header,
    table_crc: u32,
) -> Result<ParentRef> {
    Ok(ParentRef {
        id: header.layer_id,
        virtual_size: header.virtual_size,
        table_crc,
        path: stored_parent_path(parent, child)?,
    })
}

/// Removes a half-written output file unless disarmed.
pub(crate) struct RemoveOnError<'a> {
    pub(crate) path: &'a Path,
    pub(crate) armed: bool,
}

impl Drop for RemoveOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

pub(crate) fn create_file(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(Error::io(path, "create"))
}

/// Writes a new empty layer file (header, zero table) at `path`, which must not exist.
pub(crate) fn write_new_layer(
    path: &Path,
    virtual_size: u64,
    block_size: u32,
    parent: Option<ParentRef>,
) -> Result<Header> {
    let header = Header::new(virtual_size, block_size, random_id(), parent)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    let file = create_file(path)?;
    let mut guard = RemoveOnError { path, armed: true };
    file.write_all_at(&header.encode(), 0)
        .map_err(Error::io(path, "write header"))?;
    // The table is a hole: all zeros, "no block here".
    file.set_len(header.data_offset)
        .map_err(Error::io(path, "size the table"))?;
    file.sync_all().map_err(Error::io(path, "fsync"))?;
    // The new name must be durable too: a layer that vanishes after a crash would orphan
    // whatever was written on it (a VM's disk, a snapshot's frozen layer).
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(Error::io(dir, "fsync the directory"))?;
    guard.armed = false;
    Ok(header)
}
