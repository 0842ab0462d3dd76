//! A chain of layers as one virtual disk.

use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::layer::{encode_entries, Layer};
use crate::{Error, Result, MAX_CHAIN_DEPTH};

/// How to open a disk.
#[derive(Debug, Clone, Copy, Default)]
pub struct OpenOptions {
    /// Open the top layer read-only too (then it may be frozen).
    pub read_only: bool,
}

/// A virtual disk: `layers[0]` is the top (the only one ever written), each next one its
/// parent. Writes land in the top layer block by block (copy-on-write: a partial write to a
/// block that is not in the top first copies the block's current content up); reads take
/// each block from the first layer that has it, else zeros.
///
/// Durability: data written is in the top file at once, but new blocks become part of the
/// layer only when their table entries are committed, which [`Disk::flush`] does after an
/// `fdatasync` of the data (and again after the table). A crash before a flush loses the
/// writes since the previous flush and nothing else; blocks written but never committed
/// are trimmed off the file the next time it is opened for writing. Dropping a `Disk`
/// commits like a flush.
#[derive(Debug)]
pub struct Disk {
    layers: Vec<Layer>,
    read_only: bool,
    block_size: u64,
    virtual_size: u64,
    /// Top-layer table entries changed since the last commit.
    dirty: BTreeSet<u64>,
    /// Where the top layer's next new block goes.
    next_alloc: u64,
    size_limit: Option<u64>,
    scratch: Vec<u8>,
}

/// Where a parent recorded as `stored` in `child`'s header is: relative paths are relative
/// to the child's directory.
pub(crate) fn resolve_parent(child: &Path, stored: &Path) -> PathBuf {
    if stored.is_absolute() {
        return stored.to_path_buf();
    }
    match child.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.join(stored),
        _ => stored.to_path_buf(),
    }
}

/// Opens the parents of `top`, nearest first, checking each against what its child
/// recorded.
pub(crate) fn open_parents(top: &Layer) -> Result<Vec<Layer>> {
    let mut parents: Vec<Layer> = Vec::new();
    loop {
        let child = parents.last().unwrap_or(top);
        let Some(pref) = child.header.parent.clone() else {
            break;
        };
        if parents.len() + 1 >= MAX_CHAIN_DEPTH {
            return Err(Error::ChainTooDeep(top.path.clone()));
        }
        let path = resolve_parent(&child.path, &pref.path);
        let mismatch = |what: String| Error::ParentMismatch {
            child: child.path.clone(),
            parent: path.clone(),
            what,
        };
        let parent = match Layer::open(&path, false) {
            Ok(p) => p,
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Err(mismatch("the parent file does not exist".into()));
            }
            Err(e) => return Err(e),
        };
        if parent.header.layer_id != pref.id {
            return Err(mismatch(format!(
                "it is layer {}, the child was created on layer {}",
                crate::id_hex(&parent.header.layer_id),
                crate::id_hex(&pref.id)
            )));
        }
        if !parent.header.frozen() {
            return Err(mismatch(
                "it is not frozen (it may have changed since the child was created)".into(),
            ));
        }
        if parent.header.virtual_size != pref.virtual_size
            || parent.header.virtual_size != child.header.virtual_size
        {
            return Err(mismatch(format!(
                "its virtual size is {} bytes, the child records {} and has {}",
                parent.header.virtual_size, pref.virtual_size, child.header.virtual_size
            )));
        }
        if parent.header.block_size != child.header.block_size {
            return Err(mismatch(format!(
                "its block size is {}, the child's is {}",
                parent.header.block_size, child.header.block_size
            )));
        }
        if parent.header.table_crc != pref.table_crc {
            return Err(mismatch(format!(
                "its allocation table checksum is {:#010x}, the child records {:#010x}",
                parent.header.table_crc, pref.table_crc
            )));
        }
        parents.push(parent);
    }
    Ok(parents)
}

impl Disk {
    /// Opens the chain whose top layer is `path`.
    pub fn open(path: &Path, opts: OpenOptions) -> Result<Self> {
        Self::open_with_sources(path, opts, None)
    }

    /// Opens the chain whose top layer is `path`, the layers in it that are filled on
    /// demand ([`crate::remote`]) through their sources from `sources`; with `sources`,
    /// such a layer it has no source for is an error here, before any read (without,
    /// reading its data is).
    pub fn open_with_sources(
        path: &Path,
        opts: OpenOptions,
        sources: Option<&crate::remote::Sources>,
    ) -> Result<Self> {
        let mut top = Layer::open(path, !opts.read_only)?;
        let mut parents = open_parents(&top)?;
        for l in std::iter::once(&mut top).chain(parents.iter_mut()) {
            if !l.on_demand {
                continue;
            }
            let Some(sources) = sources else {
                // Reading its data is the error (see `Layer::read_block`).
                continue;
            };
            l.source = sources.0.source(&l.path, &l.header.layer_id);
            if l.source.is_none() {
                return Err(Error::Unfilled {
                    path: l.path.clone(),
                    what: "its data is filled on demand by a fetcher (a `.present` marker \
                           beside it), and none was given for it"
                        .into(),
                });
            }
        }
        let block_size = u64::from(top.header.block_size);
        let virtual_size = top.header.virtual_size;
        let mut disk = Self {
            next_alloc: top.header.data_offset,
            layers: std::iter::once(top).chain(parents).collect(),
            read_only: opts.read_only,
            block_size,
            virtual_size,
            dirty: BTreeSet::new(),
            size_limit: None,
            scratch: vec![0u8; block_size as usize],
        };
        if !opts.read_only {
            disk.trim_uncommitted()?;
        }
        tracing::debug!(
            "disk {}: {} layers, {} bytes, {}-byte blocks",
            path.display(),
            disk.layers.len(),
            virtual_size,
            block_size
        );
        Ok(disk)
    }

    /// Drops data blocks past the last committed one (left by a crash before a flush).
    fn trim_uncommitted(&mut self) -> Result<()> {
        let bs = self.block_size;
        let top = &mut self.layers[0];
        let end = top
            .table
            .iter()
            .copied()
            .max()
            .filter(|&o| o != 0)
            .map_or(top.header.data_offset, |o| o + bs);
        if top.file_len > end {
            tracing::info!(
                "disk {}: trimming {} bytes of uncommitted blocks",
                top.path.display(),
                top.file_len - end
            );
            top.file
                .set_len(end)
                .map_err(Error::io(&top.path, "truncate uncommitted blocks"))?;
            top.file_len = end;
        }
        self.next_alloc = end;
        Ok(())
    }

    /// Size of the virtual disk in bytes.
    pub fn virtual_size(&self) -> u64 {
        self.virtual_size
    }

    /// Bytes per block.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// True if writes are refused.
    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// The layers, top first.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    /// The top layer's path.
    pub fn path(&self) -> &Path {
        &self.layers[0].path
    }

    /// Caps the top layer file at `limit` bytes: a write that needs a new block past it
    /// fails with [`Error::NoSpace`] (a per-sandbox disk quota; also how tests run out of
    /// space). `None` removes the cap.
    pub fn set_size_limit(&mut self, limit: Option<u64>) {
        self.size_limit = limit;
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.virtual_size => Ok(()),
            _ => Err(Error::OutOfRange {
                offset,
                len,
                size: self.virtual_size,
            }),
        }
    }

    /// Fills `buf` with part of block `idx` from the first layer at or below `from` that has
    /// it, or zeros.
    fn read_from(&self, from: usize, idx: u64, within: u64, buf: &mut [u8]) -> Result<()> {
        for layer in &self.layers[from..] {
            if layer.read_block(idx, within, buf)? {
                return Ok(());
            }
        }
        buf.fill(0);
        Ok(())
    }

    /// True if no layer at or below `from` has block `idx` (it reads as zeros there).
    fn absent_from(&self, from: usize, idx: u64) -> bool {
        self.layers[from..]
            .iter()
            .all(|l| l.block_offset(idx).is_none())
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        self.check_range(offset, buf.len())?;
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let idx = pos / self.block_size;
            let within = pos % self.block_size;
            let n = ((self.block_size - within) as usize).min(buf.len() - done);
            self.read_from(0, idx, within, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at `offset` into the top layer.
    pub fn write_at(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if self.read_only {
            return Err(Error::ReadOnly(self.path().to_path_buf()));
        }
        self.check_range(offset, data.len())?;
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let idx = pos / self.block_size;
            let within = pos % self.block_size;
            let n = ((self.block_size - within) as usize).min(data.len() - done);
            self.write_block(idx, within, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    fn write_block(&mut self, idx: u64, within: u64, data: &[u8]) -> Result<()> {
        if let Some(off) = self.layers[0].block_offset(idx) {
            let top = &self.layers[0];
            return top
                .file
                .write_all_at(data, off + within)
                .map_err(Error::io(&top.path, "write data block"));
        }
        // Zeros over a block that reads as zeros anyway: nothing to store.
        if self.absent_from(0, idx) && data.iter().all(|&b| b == 0) {
            return Ok(());
        }
        let bs = self.block_size;
        let mut block = std::mem::take(&mut self.scratch);
        let result = (|| {
            if data.len() as u64 != bs {
                // Copy up: the block's current content from the parents, then the new data.
                self.read_from(1, idx, 0, &mut block)?;
            }
            block[within as usize..within as usize + data.len()].copy_from_slice(data);
            self.append_block(idx, &block)
        })();
        self.scratch = block;
        result
    }

    /// Stores a whole new block at the end of the top layer and points its (uncommitted)
    /// table entry at it.
    fn append_block(&mut self, idx: u64, block: &[u8]) -> Result<()> {
        let off = self.next_alloc;
        let end = off + self.block_size;
        let top = &mut self.layers[0];
        if let Some(limit) = self.size_limit {
            if end > limit {
                return Err(Error::NoSpace {
                    path: top.path.clone(),
                    limit,
                });
            }
        }
        if let Err(e) = top.file.write_all_at(block, off) {
            // Give back whatever part of the block was written; the table is unchanged.
            if let Err(t) = top.file.set_len(off) {
                tracing::warn!(
                    "disk {}: truncate after a failed write: {t}",
                    top.path.display()
                );
            }
            return Err(Error::io(&top.path, "write new data block")(e));
        }
        top.table[idx as usize] = off;
        top.file_len = top.file_len.max(end);
        self.dirty.insert(idx);
        self.next_alloc = end;
        Ok(())
    }

    /// Writes the dirty table entries (runs of consecutive entries in one write each).
    fn commit_table(&mut self) -> Result<()> {
        let top = &self.layers[0];
        let dirty: Vec<u64> = self.dirty.iter().copied().collect();
        let mut i = 0;
        while i < dirty.len() {
            let start = dirty[i];
            let mut end = start + 1;
            while i + 1 < dirty.len() && dirty[i + 1] == end {
                i += 1;
                end += 1;
            }
            i += 1;
            let bytes = encode_entries(&top.table[start as usize..end as usize]);
            top.file
                .write_all_at(&bytes, top.header.table_offset + start * 8)
                .map_err(Error::io(&top.path, "write allocation table"))?;
        }
        Ok(())
    }

    /// Makes everything written so far durable: `fdatasync` the data, commit the new
    /// blocks' table entries, `fdatasync` again. A no-op on a read-only disk.
    pub fn flush(&mut self) -> Result<()> {
        if self.read_only {
            return Ok(());
        }
        let sync = |l: &Layer| l.file.sync_data().map_err(Error::io(&l.path, "fdatasync"));
        sync(&self.layers[0])?;
        if !self.dirty.is_empty() {
            self.commit_table()?;
            sync(&self.layers[0])?;
            self.dirty.clear();
        }
        Ok(())
    }

    /// Freezes the current top layer (flushed, then immutable) and continues on a new empty
    /// overlay at `new_top` on top of it; returns the frozen layer's path. This is the
    /// parent's half of a fork: give each child its own overlay on the returned path with
    /// [`crate::ops::create`]. On error the disk is unchanged (and `new_top` not left behind).
    pub fn snapshot(&mut self, new_top: &Path) -> Result<PathBuf> {
        if self.read_only {
            return Err(Error::ReadOnly(self.path().to_path_buf()));
        }
        if self.layers.len() >= MAX_CHAIN_DEPTH {
            return Err(Error::ChainTooDeep(self.path().to_path_buf()));
        }
        self.flush()?;
        let frozen_path = self.layers[0].path.clone();
        let top = &self.layers[0];
        let pref =
            crate::layer::parent_ref_for(&frozen_path, new_top, &top.header, top.table_crc())?;
        crate::layer::write_new_layer(
            new_top,
            self.virtual_size,
            top.header.block_size,
            Some(pref),
        )?;
        if let Err(e) = self.layers[0].freeze_in_place() {
            let _ = std::fs::remove_file(new_top);
            return Err(e);
        }
        let overlay = match Layer::open(new_top, true) {
            Ok(l) => l,
            Err(e) => {
                // The old top is frozen now: the disk can only be read until reopened.
                self.read_only = true;
                return Err(e);
            }
        };
        self.next_alloc = overlay.header.data_offset;
        self.layers.insert(0, overlay);
        self.dirty.clear();
        tracing::info!(
            "disk: froze {}, continuing on {}",
            frozen_path.display(),
            new_top.display()
        );
        Ok(frozen_path)
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        if !self.read_only && !self.dirty.is_empty() {
            if let Err(e) = self.flush() {
                tracing::error!("disk {}: final flush: {e}", self.path().display());
            }
        }
    }
}
