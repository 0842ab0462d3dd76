//! Offline operations on layer files: create, import, flatten, freeze, info, and moving a
//! parent ([`set_parent_path`]).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::chain::{open_parents, Disk, OpenOptions};
use crate::header::{Header, DEFAULT_BLOCK_SIZE, SECTOR_SIZE};
pub use crate::layer::random_id;
use crate::layer::{
    create_file, encode_entries, file_len, lock, parent_ref_for, stored_parent_path,
    write_new_layer, Layer, RemoveOnError,
};
use crate::{Error, Result};

/// What [`create`] makes.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    /// Virtual size in bytes; with a parent it must be the parent's (or `None`).
    pub virtual_size: Option<u64>,
    /// Block size; default [`DEFAULT_BLOCK_SIZE`], or the parent's.
    pub block_size: Option<u32>,
    /// Make an overlay on this frozen layer.
    pub parent: Option<PathBuf>,
}

/// Creates an empty overlay at `path` (which must not exist) on the frozen layer `parent`:
/// [`create`] with only a parent.
pub fn create_overlay(path: &Path, parent: &Path) -> Result<Header> {
    create(
        path,
        &CreateOptions {
            parent: Some(parent.to_path_buf()),
            ..CreateOptions::default()
        },
    )
}

/// Creates an empty layer at `path` (which must not exist): a blank disk, or with
/// `parent` an overlay on that frozen layer (its whole chain is opened and checked).
pub fn create(path: &Path, opts: &CreateOptions) -> Result<Header> {
    match &opts.parent {
        None => {
            let size = opts
                .virtual_size
                .ok_or_else(|| Error::Invalid("a new disk without a parent needs a size".into()))?;
            write_new_layer(
                path,
                size,
                opts.block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
                None,
            )
        }
        Some(parent_path) => {
            let parent = Layer::open(parent_path, false)?;
            open_parents(&parent)?;
            let h = parent.header();
            if !h.frozen() {
                return Err(Error::Invalid(format!(
                    "{}: only a frozen layer can be a parent (`clade disk freeze` it first, \
                     while no VM uses it)",
                    parent_path.display()
                )));
            }
            if let Some(s) = opts.virtual_size.filter(|&s| s != h.virtual_size) {
                return Err(Error::Invalid(format!(
                    "an overlay has its parent's size ({} bytes), not {s}",
                    h.virtual_size
                )));
            }
            if let Some(b) = opts.block_size.filter(|&b| b != h.block_size) {
                return Err(Error::Invalid(format!(
                    "an overlay has its parent's block size ({}), not {b}",
                    h.block_size
                )));
            }
            let pref = parent_ref_for(parent_path, path, h, h.table_crc)?;
            write_new_layer(path, h.virtual_size, h.block_size, Some(pref))
        }
    }
}

/// Freezes a layer that no process has open: afterwards it can be a parent and is never
/// written again.
pub fn freeze(path: &Path) -> Result<()> {
    let mut layer = Layer::open(path, true)?;
    open_parents(&layer)?;
    layer.freeze_in_place()
}

/// Records `parent` as where the parent of the layer at `layer` now is (its file was moved
/// or copied there): by file name when both are in one directory, else by absolute path.
/// Nothing else in the header changes (layer id, flags, table checksum, the parent's id,
/// size and checksum), so a frozen layer stays frozen and its children still match it.
///
/// Why: a layer chain copied to another host (a published snapshot's disk) has its files
/// under other names; each child must name its parent's new file. The layer must have a
/// parent, no process may have it open, and `parent` must open as the parent recorded
/// (same id, frozen, same size, block size and table checksum) with its own chain intact;
/// otherwise nothing is written. The rewrite is crash-safe like a freeze's (the header
/// slot not in use, then `fdatasync`; version 1 layers are rewritten in place).
pub fn set_parent_path(layer: &Path, parent: &Path) -> Result<()> {
    let mut l = Layer::open_for_header_rewrite(layer)?;
    let Some(pref) = l.header.parent.clone() else {
        return Err(Error::Invalid(format!(
            "{}: the layer has no parent to move",
            layer.display()
        )));
    };
    let stored = stored_parent_path(parent, layer)?;
    if stored.as_os_str().len() > crate::MAX_PARENT_PATH {
        return Err(Error::Invalid(format!(
            "{}: parent path {} is longer than {} bytes",
            layer.display(),
            stored.display(),
            crate::MAX_PARENT_PATH
        )));
    }
    let saved = l.header.clone();
    l.header.parent = Some(crate::ParentRef {
        path: stored.clone(),
        ..pref
    });
    // The whole chain below, as the new path finds it, must be the one recorded.
    if let Err(e) = open_parents(&l) {
        l.header = saved;
        return Err(e);
    }
    l.write_header()?;
    tracing::debug!(
        "{}: parent now recorded as {}",
        layer.display(),
        stored.display()
    );
    Ok(())
}

/// Block counts of an import or flatten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyStats {
    /// Blocks in the virtual disk.
    pub blocks: u64,
    /// Blocks stored in the output (the others are all zeros).
    pub stored: u64,
    /// Virtual size in bytes.
    pub virtual_size: u64,
}

/// Writes a standalone frozen layer at `out` from `read(offset, buf)` over a virtual disk of
/// `virtual_size` bytes, storing only non-zero blocks.
fn write_standalone(
    out: &Path,
    virtual_size: u64,
    block_size: u32,
    mut read: impl FnMut(u64, &mut [u8]) -> Result<()>,
) -> Result<CopyStats> {
    let mut header = Header::new(virtual_size, block_size, random_id(), None)
        .map_err(|e| Error::Invalid(format!("{}: {e}", out.display())))?;
    let file = create_file(out)?;
    let mut guard = RemoveOnError {
        path: out,
        armed: true,
    };
    let bs = u64::from(block_size);
    let mut table = vec![0u64; header.table_entries as usize];
    let mut buf = vec![0u8; block_size as usize];
    let mut next = header.data_offset;
    for (idx, entry) in table.iter_mut().enumerate() {
        let pos = idx as u64 * bs;
        let n = bs.min(virtual_size - pos) as usize;
        buf[n..].fill(0);
        read(pos, &mut buf[..n])?;
        if buf.iter().all(|&b| b == 0) {
            continue;
        }
        file.write_all_at(&buf, next)
            .map_err(Error::io(out, "write data block"))?;
        *entry = next;
        next += bs;
    }
    file.set_len(next)
        .map_err(Error::io(out, "size the file"))?;
    file.write_all_at(&encode_entries(&table), header.table_offset)
        .map_err(Error::io(out, "write allocation table"))?;
    let mut h = crc32fast::Hasher::new();
    h.update(&encode_entries(&table));
    header.table_crc = h.finalize();
    header.flags |= crate::FLAG_FROZEN;
    file.write_all_at(&header.encode(), 0)
        .map_err(Error::io(out, "write header"))?;
    file.sync_all().map_err(Error::io(out, "fsync"))?;
    guard.armed = false;
    Ok(CopyStats {
        blocks: header.table_entries,
        stored: table.iter().filter(|&&o| o != 0).count() as u64,
        virtual_size,
    })
}

/// Imports a raw disk image (a regular file or block device) as a new frozen base layer at
/// `out`. The virtual size is the raw size rounded up to a whole sector; all-zero blocks
/// are not stored.
pub fn import_raw(raw: &Path, out: &Path, block_size: Option<u32>) -> Result<CopyStats> {
    let f = File::open(raw).map_err(Error::io(raw, "open"))?;
    lock(&f, raw, false)?;
    let len = file_len(&f, raw)?;
    if len == 0 {
        return Err(Error::Invalid(format!("{}: empty image", raw.display())));
    }
    let mut magic = [0u8; 8];
    if f.read_exact_at(&mut magic, 0).is_ok() && magic == crate::MAGIC {
        return Err(Error::Invalid(format!(
            "{}: already a Clade disk layer (use it as a parent, or flatten it)",
            raw.display()
        )));
    }
    let virtual_size = len.div_ceil(SECTOR_SIZE) * SECTOR_SIZE;
    write_standalone(
        out,
        virtual_size,
        block_size.unwrap_or(DEFAULT_BLOCK_SIZE),
        |pos, buf| {
            let n = (len.saturating_sub(pos) as usize).min(buf.len());
            buf[n..].fill(0);
            f.read_exact_at(&mut buf[..n], pos)
                .map_err(Error::io(raw, "read"))
        },
    )
}

/// Output of [`flatten`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlattenFormat {
    /// A standalone frozen layer (no parent): a new base.
    Layer,
    /// A raw sparse image of the virtual disk.
    Raw,
}

/// Merges the chain whose top is `top` into one standalone image at `out` (which must not
/// exist) with the same logical content.
pub fn flatten(top: &Path, out: &Path, format: FlattenFormat) -> Result<CopyStats> {
    let disk = Disk::open(top, OpenOptions { read_only: true })?;
    let size = disk.virtual_size();
    match format {
        FlattenFormat::Layer => {
            write_standalone(out, size, disk.block_size() as u32, |pos, buf| {
                disk.read_at(pos, buf)
            })
        }
        FlattenFormat::Raw => {
            let file = create_file(out)?;
            let mut guard = RemoveOnError {
                path: out,
                armed: true,
            };
            file.set_len(size)
                .map_err(Error::io(out, "size the file"))?;
            let bs = disk.block_size();
            let mut buf = vec![0u8; bs as usize];
            let mut stored = 0;
            let blocks = size.div_ceil(bs);
            for idx in 0..blocks {
                let pos = idx * bs;
                let n = bs.min(size - pos) as usize;
                disk.read_at(pos, &mut buf[..n])?;
                if buf[..n].iter().any(|&b| b != 0) {
                    file.write_all_at(&buf[..n], pos)
                        .map_err(Error::io(out, "write"))?;
                    stored += 1;
                }
            }
            file.sync_all().map_err(Error::io(out, "fsync"))?;
            guard.armed = false;
            Ok(CopyStats {
                blocks,
                stored,
                virtual_size: size,
            })
        }
    }
}

/// One layer of a chain, as [`info`] reports it.
#[derive(Debug, Clone)]
pub struct LayerInfo {
    /// Where the layer was found.
    pub path: PathBuf,
    /// Its header.
    pub header: Header,
    /// Blocks stored in it.
    pub allocated_blocks: u64,
    /// File size in bytes.
    pub file_len: u64,
}

/// Opens (read-only, fully validated) the chain whose top is `path` and describes each
/// layer, top first.
pub fn info(path: &Path) -> Result<Vec<LayerInfo>> {
    let disk = Disk::open(path, OpenOptions { read_only: true })?;
    Ok(disk
        .layers()
        .iter()
        .map(|l| LayerInfo {
            path: l.path().to_path_buf(),
            header: l.header().clone(),
            allocated_blocks: l.allocated_blocks(),
            file_len: l.file_len(),
        })
        .collect())
}
