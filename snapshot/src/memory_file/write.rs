//! Writing memory files: full ([`write_full`]) or diff ([`write_diff`]), from the guest's
//! mappings or its memfd ([`RegionData`]), zero pages left as holes; and a file written
//! but not yet committed ([`PendingMemoryFile`]), so that a VM can run again before the
//! fsync is paid.

use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::header::{data_offset_for, encode_meta, validate_regions};
use super::{MemoryHeader, RegionInfo, FORMAT_VERSION, MAX_REGIONS};
use crate::bitmap::{words_for, PageBitmap};
use crate::fsutil::{data_extents, is_zero, AtomicFile};
use crate::{Error, Result, SnapshotId, SnapshotKind, PAGE_SIZE, PAGE_SIZE_U64};

/// Pages processed per read/scan chunk when writing or prefetching.
const CHUNK_PAGES: u64 = 256;

/// Where a guest region's bytes come from when writing a memory file.
#[derive(Debug, Clone, Copy)]
pub enum RegionData<'a> {
    /// The region's host mapping (the VM must be paused).
    Slice(&'a [u8]),
    /// `len` bytes at `offset` of a file, typically the guest memfd. Holes in it
    /// (SEEK_HOLE) are skipped without being read.
    Fd {
        /// The file.
        fd: BorrowedFd<'a>,
        /// Offset of the region in it.
        offset: u64,
        /// Region length.
        len: u64,
    },
}

impl RegionData<'_> {
    fn len(&self) -> u64 {
        match self {
            RegionData::Slice(s) => s.len() as u64,
            RegionData::Fd { len, .. } => *len,
        }
    }
}

/// One guest memory region to write.
#[derive(Debug, Clone, Copy)]
pub struct GuestRegion<'a> {
    /// Guest-physical address of the region.
    pub guest_addr: u64,
    /// Its contents.
    pub data: RegionData<'a>,
}

/// What writing a memory file did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    /// Pages examined (all pages for full, dirty pages for diff; holes in an fd source are
    /// not examined).
    pub pages_scanned: u64,
    /// Non-zero pages written.
    pub pages_written: u64,
}

/// Write a full memory file: every non-zero page of `regions` at its image offset, zero
/// pages left as holes. Crash-safe like [`state_file::write`](crate::state_file::write).
pub fn write_full(
    path: &Path,
    id: SnapshotId,
    regions: &[GuestRegion<'_>],
) -> Result<(MemoryHeader, WriteStats)> {
    write_full_pending(path, id, regions)?.commit()
}

/// A memory file whose contents are written (to a temporary file next to its path) but
/// which is neither durable nor visible under its name until [`PendingMemoryFile::commit`].
/// Dropped without commit, it is removed. This lets a VMM copy guest memory while the VM is
/// paused, let the VM run again, and only then pay for the fsync.
pub struct PendingMemoryFile {
    out: AtomicFile,
    path: PathBuf,
    header: MemoryHeader,
    stats: WriteStats,
}

impl std::fmt::Debug for PendingMemoryFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingMemoryFile")
            .field("path", &self.path)
            .field("header", &self.header)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PendingMemoryFile {
    /// The header that was written.
    pub fn header(&self) -> &MemoryHeader {
        &self.header
    }

    /// What was written.
    pub fn stats(&self) -> WriteStats {
        self.stats
    }

    /// Overwrites the contents of a full memory file at image offset `offset` with `data`
    /// (page-aligned, inside guest memory), as given, zero pages included: a later layer
    /// of a memory image written over its base.
    pub fn overwrite(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        if self.header.kind != SnapshotKind::Full {
            return Err(Error::InvalidInput(
                "only a full memory file's contents can be overwritten".into(),
            ));
        }
        if !offset.is_multiple_of(PAGE_SIZE_U64)
            || !len.is_multiple_of(PAGE_SIZE_U64)
            || offset
                .checked_add(len)
                .is_none_or(|e| e > self.header.mem_size)
        {
            return Err(Error::InvalidInput(format!(
                "overwriting {len:#x} bytes at {offset:#x} of a {}-byte memory image",
                self.header.mem_size
            )));
        }
        let tmp = self.out.tmp_path().to_path_buf();
        self.out
            .file()
            .write_all_at(data, self.header.data_offset + offset)
            .map_err(|e| Error::io("write guest memory", &tmp, e))?;
        self.stats.pages_written += len / PAGE_SIZE_U64;
        Ok(())
    }

    /// fsync, rename into place, fsync the directory.
    pub fn commit(self) -> Result<(MemoryHeader, WriteStats)> {
        self.out.commit()?;
        tracing::debug!(
            path = %self.path.display(),
            id = %self.header.id,
            kind = %self.header.kind,
            pages_written = self.stats.pages_written,
            "committed snapshot memory file"
        );
        Ok((self.header, self.stats))
    }
}

/// [`write_full`] without the commit.
pub fn write_full_pending(
    path: &Path,
    id: SnapshotId,
    regions: &[GuestRegion<'_>],
) -> Result<PendingMemoryFile> {
    write_impl(path, id, None, regions, None)
}

/// [`write_diff`] without the commit.
pub fn write_diff_pending(
    path: &Path,
    id: SnapshotId,
    base: SnapshotId,
    regions: &[GuestRegion<'_>],
    dirty: &[&[u64]],
) -> Result<PendingMemoryFile> {
    if base.is_none() || base == id {
        return Err(Error::InvalidInput(
            "a diff memory file needs a non-zero base id other than its own".into(),
        ));
    }
    if dirty.len() != regions.len() {
        return Err(Error::InvalidInput(format!(
            "{} dirty bitmaps for {} regions",
            dirty.len(),
            regions.len()
        )));
    }
    write_impl(path, id, Some(base), regions, Some(dirty))
}

/// Write a diff memory file on top of `base`: only the pages set in `dirty` (one bitmap
/// per region, KVM_GET_DIRTY_LOG layout: `u64` words, bit per 4 KiB page).
pub fn write_diff(
    path: &Path,
    id: SnapshotId,
    base: SnapshotId,
    regions: &[GuestRegion<'_>],
    dirty: &[&[u64]],
) -> Result<(MemoryHeader, WriteStats)> {
    write_diff_pending(path, id, base, regions, dirty)?.commit()
}

fn write_impl(
    path: &Path,
    id: SnapshotId,
    base: Option<SnapshotId>,
    regions: &[GuestRegion<'_>],
    dirty: Option<&[&[u64]]>,
) -> Result<PendingMemoryFile> {
    if id.is_none() {
        return Err(Error::InvalidInput("snapshot id is zero".into()));
    }
    if regions.len() > MAX_REGIONS as usize {
        return Err(Error::InvalidInput(format!(
            "{} regions, at most {MAX_REGIONS} supported",
            regions.len()
        )));
    }
    let mut infos = Vec::with_capacity(regions.len());
    let mut offset = 0u64;
    for r in regions {
        infos.push(RegionInfo {
            guest_addr: r.guest_addr,
            size: r.data.len(),
            offset,
        });
        offset = offset.saturating_add(r.data.len());
    }
    let mem_size = validate_regions(&infos).map_err(Error::InvalidInput)?;
    let pages = mem_size / PAGE_SIZE_U64;

    // Global (image) bitmap of the pages this file contains, for a diff.
    let bitmap = match dirty {
        None => None,
        Some(dirty) => {
            let mut global = PageBitmap::new(pages);
            for (i, (info, words)) in infos.iter().zip(dirty).enumerate() {
                let region_pages = info.size / PAGE_SIZE_U64;
                let bm = PageBitmap::from_words(words.to_vec(), region_pages).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "dirty bitmap of region {i} has {} words, {} needed",
                        words.len(),
                        words_for(region_pages)
                    ))
                })?;
                let first = info.offset / PAGE_SIZE_U64;
                for (start, n) in bm.runs() {
                    global.set_range(first + start, n);
                }
            }
            Some(global)
        }
    };
    let header = MemoryHeader {
        version: FORMAT_VERSION,
        kind: if base.is_some() {
            SnapshotKind::Diff
        } else {
            SnapshotKind::Full
        },
        id,
        base,
        mem_size,
        data_offset: data_offset_for(
            infos.len() as u64,
            bitmap.as_ref().map_or(0, |b| b.words().len() as u64),
        ),
        regions: infos,
    };

    let out = AtomicFile::create(path)?;
    let tmp = out.tmp_path().to_path_buf();
    let f = out.file();
    f.write_all_at(&encode_meta(&header, bitmap.as_ref()), 0)
        .map_err(|e| Error::io("write header", &tmp, e))?;
    f.set_len(header.data_offset + mem_size)
        .map_err(|e| Error::io("set length", &tmp, e))?;

    let mut stats = WriteStats::default();
    let mut buf = Vec::new();
    for (region, info) in regions.iter().zip(&header.regions) {
        let region_pages = info.size / PAGE_SIZE_U64;
        let first = info.offset / PAGE_SIZE_U64;
        // The source: the slice, or a duplicate of the fd (for pread and SEEK_DATA).
        let src = match region.data {
            RegionData::Slice(s) => Src::Slice(s),
            RegionData::Fd { fd, offset, len } => Src::File {
                file: File::from(
                    fd.try_clone_to_owned()
                        .map_err(|e| Error::io("dup source fd", &tmp, e))?,
                ),
                offset,
                len,
            },
        };
        // Candidate page runs, relative to the region.
        let candidates: Vec<(u64, u64)> = match (&bitmap, &src) {
            (Some(bm), _) => {
                let mut v = Vec::new();
                let mut p = first;
                while let Some(s) = bm.next_set(p).filter(|&s| s < first + region_pages) {
                    let e = bm.next_clear(s).unwrap_or(pages).min(first + region_pages);
                    v.push((s - first, e - s));
                    p = e;
                }
                v
            }
            (None, Src::Slice(_)) => vec![(0, region_pages)],
            (
                None,
                &Src::File {
                    ref file,
                    offset,
                    len,
                },
            ) => data_extents(file, offset, offset + len)
                .map_err(|e| Error::io("seek data in source fd", &tmp, e))?
                .into_iter()
                .map(|(o, l)| {
                    let s = (o - offset) / PAGE_SIZE_U64;
                    let e = (o - offset + l).div_ceil(PAGE_SIZE_U64).min(region_pages);
                    (s, e - s)
                })
                .collect(),
        };
        for (run_start, run_len) in candidates {
            let mut p = run_start;
            while p < run_start + run_len {
                let n = CHUNK_PAGES.min(run_start + run_len - p);
                let bytes = (n * PAGE_SIZE_U64) as usize;
                let src: &[u8] = match src {
                    Src::Slice(s) => {
                        let o = (p * PAGE_SIZE_U64) as usize;
                        &s[o..o + bytes]
                    }
                    Src::File {
                        ref file, offset, ..
                    } => {
                        buf.resize(bytes, 0);
                        file.read_exact_at(&mut buf, offset + p * PAGE_SIZE_U64)
                            .map_err(|e| Error::io("read guest memory", &tmp, e))?;
                        &buf
                    }
                };
                stats.pages_scanned += n;
                // Write maximal runs of non-zero pages.
                let mut i = 0usize;
                while i < n as usize {
                    if is_zero(&src[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]) {
                        i += 1;
                        continue;
                    }
                    let s = i;
                    while i < n as usize && !is_zero(&src[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]) {
                        i += 1;
                    }
                    let file_off = header.data_offset + (first + p + s as u64) * PAGE_SIZE_U64;
                    f.write_all_at(&src[s * PAGE_SIZE..i * PAGE_SIZE], file_off)
                        .map_err(|e| Error::io("write page data", &tmp, e))?;
                    stats.pages_written += (i - s) as u64;
                }
                p += n;
            }
        }
    }
    tracing::debug!(
        path = %path.display(),
        id = %id,
        kind = %header.kind,
        mem_size,
        pages_scanned = stats.pages_scanned,
        pages_written = stats.pages_written,
        "wrote snapshot memory file (not yet committed)"
    );
    Ok(PendingMemoryFile {
        out,
        path: path.to_path_buf(),
        header,
        stats,
    })
}

enum Src<'a> {
    Slice(&'a [u8]),
    File { file: File, offset: u64, len: u64 },
}
