//! The guest memory file: a small header, then the guest memory image at a page-aligned
//! offset, sparse (zero pages are holes).
//!
//! * A **full** memory file holds every non-zero page of guest memory at its image offset.
//! * A **diff** memory file holds only the pages that were dirty since its base (the KVM
//!   dirty-log bitmap), and a bitmap of those pages in its header, since a dirty page that
//!   became zero is a hole like an absent one. Restoring is base, then each diff on top
//!   ([`MemoryChain`]).
//!
//! The memory image is the concatenation of the guest regions in ascending guest-address
//! order; its length is the guest memory size. Layout (integers little-endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `CLADEMEM` |
//! | 8 | 4 | format version (1) |
//! | 12 | 4 | kind: 1 full, 2 diff |
//! | 16 | 16 | snapshot id (same as the state file's) |
//! | 32 | 16 | base id (zero for full) |
//! | 48 | 8 | memory size in bytes |
//! | 56 | 4 | page size (4096) |
//! | 60 | 4 | region count R |
//! | 64 | 8 | data offset D (page-aligned) |
//! | 72 | 8 | bitmap words W (0 for full, ceil(pages/64) for diff) |
//! | 80 | 40 | reserved, zero |
//! | 120 | 4 | CRC-32 of the region table and bitmap |
//! | 124 | 4 | CRC-32 of bytes 0..124 |
//! | 128 | 24·R | regions: guest address, size, offset in the image (u64 each) |
//! | … | 8·W | page bitmap (diff) |
//! | D | size | memory image |
//!
//! The file is exactly D + size bytes long. The memory image is not checksummed (a resume
//! must not read all of it); the header and tables are.

use std::fs::File;
use std::io::Read;
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::bitmap::{words_for, PageBitmap};
use crate::bytes::{id_at, le_u32, le_u64};
use crate::fetch::{coalesce, Fetcher};
use crate::fsutil::{data_extents, is_zero, AtomicFile};
use crate::state_file;
use crate::{Error, FileType, Result, SnapshotId, SnapshotKind, PAGE_SIZE, PAGE_SIZE_U64};

/// Magic bytes at offset 0.
pub const MAGIC: [u8; 8] = *b"CLADEMEM";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Length of the fixed header.
pub const FIXED_HEADER_LEN: usize = 128;
/// Length of one region table entry.
pub const REGION_ENTRY_LEN: usize = 24;
/// Most regions a memory file may describe.
pub const MAX_REGIONS: u32 = 256;
/// Largest guest memory a memory file may describe (1 TiB).
pub const MAX_MEM_SIZE: u64 = 1 << 40;
/// Longest diff chain (base included) [`MemoryChain`] accepts.
pub const MAX_CHAIN_LEN: usize = 64;

const FILE: FileType = FileType::Memory;
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

/// One region as recorded in a memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    /// Guest-physical address.
    pub guest_addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in the memory image.
    pub offset: u64,
}

/// A parsed, verified memory file header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryHeader {
    /// Format version.
    pub version: u32,
    /// Full or diff.
    pub kind: SnapshotKind,
    /// Snapshot id.
    pub id: SnapshotId,
    /// Base id of a diff.
    pub base: Option<SnapshotId>,
    /// Guest memory size (image length) in bytes.
    pub mem_size: u64,
    /// File offset of the memory image (page-aligned): map the image at this offset.
    pub data_offset: u64,
    /// The regions, in image order.
    pub regions: Vec<RegionInfo>,
}

impl MemoryHeader {
    /// Number of pages in the image.
    pub fn pages(&self) -> u64 {
        self.mem_size / PAGE_SIZE_U64
    }
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

/// Whether [`MemoryFile::read_into`] writes zeros for holes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoleFill {
    /// The destination is already zero (fresh anonymous mapping or memfd): holes are
    /// skipped, which is what makes a mostly-empty image fast to load.
    AssumeZeroed,
    /// Write zeros over holes.
    Zero,
}

fn data_offset_for(region_count: u64, bitmap_words: u64) -> u64 {
    let meta = FIXED_HEADER_LEN as u64 + REGION_ENTRY_LEN as u64 * region_count + 8 * bitmap_words;
    meta.div_ceil(PAGE_SIZE_U64) * PAGE_SIZE_U64
}

/// Check a region table: page-aligned, non-empty, ascending and non-overlapping guest
/// ranges, contiguous image offsets from 0. Returns the total size.
fn validate_regions(regions: &[RegionInfo]) -> std::result::Result<u64, String> {
    let mut total = 0u64;
    let mut prev_end = 0u64;
    for (i, r) in regions.iter().enumerate() {
        if r.size == 0
            || !r.size.is_multiple_of(PAGE_SIZE_U64)
            || !r.guest_addr.is_multiple_of(PAGE_SIZE_U64)
        {
            return Err(format!(
                "region {i} ({:#x}+{:#x}) is empty or not page-aligned",
                r.guest_addr, r.size
            ));
        }
        let end = r
            .guest_addr
            .checked_add(r.size)
            .ok_or_else(|| format!("region {i} wraps the address space"))?;
        if i > 0 && r.guest_addr < prev_end {
            return Err(format!("region {i} overlaps or precedes region {}", i - 1));
        }
        if r.offset != total {
            return Err(format!(
                "region {i} image offset {:#x}, expected {total:#x}",
                r.offset
            ));
        }
        total = total
            .checked_add(r.size)
            .filter(|&t| t <= MAX_MEM_SIZE)
            .ok_or_else(|| format!("regions exceed {MAX_MEM_SIZE} bytes"))?;
        prev_end = end;
    }
    Ok(total)
}

fn encode_meta(h: &MemoryHeader, bitmap: Option<&PageBitmap>) -> Vec<u8> {
    let words = bitmap.map_or(&[][..], |b| b.words());
    let mut tables = Vec::with_capacity(h.regions.len() * REGION_ENTRY_LEN + words.len() * 8);
    for r in &h.regions {
        tables.extend_from_slice(&r.guest_addr.to_le_bytes());
        tables.extend_from_slice(&r.size.to_le_bytes());
        tables.extend_from_slice(&r.offset.to_le_bytes());
    }
    for w in words {
        tables.extend_from_slice(&w.to_le_bytes());
    }
    let mut out = vec![0u8; FIXED_HEADER_LEN];
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&h.kind.to_raw().to_le_bytes());
    out[16..32].copy_from_slice(&h.id.0);
    out[32..48].copy_from_slice(&h.base.unwrap_or(SnapshotId::NONE).0);
    out[48..56].copy_from_slice(&h.mem_size.to_le_bytes());
    out[56..60].copy_from_slice(&(PAGE_SIZE as u32).to_le_bytes());
    out[60..64].copy_from_slice(&(h.regions.len() as u32).to_le_bytes());
    out[64..72].copy_from_slice(&h.data_offset.to_le_bytes());
    out[72..80].copy_from_slice(&(words.len() as u64).to_le_bytes());
    out[120..124].copy_from_slice(&crc32fast::hash(&tables).to_le_bytes());
    let crc = crc32fast::hash(&out[..124]);
    out[124..128].copy_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&tables);
    out
}

/// Write a full memory file: every non-zero page of `regions` at its image offset, zero
/// pages left as holes. Crash-safe like [`state_file::write`].
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

/// An opened, verified memory file.
#[derive(Debug)]
pub struct MemoryFile {
    file: File,
    path: PathBuf,
    header: MemoryHeader,
    /// Pages contained (diff); `None` for a full file (all pages).
    present: Option<PageBitmap>,
    /// Pages that are not holes in the file (may hold non-zero data).
    data: PageBitmap,
    /// For a lazily filled file: makes a range present before it is read.
    fetch: Option<Fetcher>,
}

impl MemoryFile {
    /// Open and verify the memory file at `path` (header, tables and file length).
    pub fn open(path: &Path) -> Result<MemoryFile> {
        Self::open_inner(path, None)
    }

    /// Open a lazily filled memory file (see [`crate::fetch`]): `path` holds the real
    /// header and tables and is exactly as long as the memory file; its image is filled
    /// by `fetch` as it is read. `data` says which pages hold data (the rest are zero
    /// pages): the sparse file cannot tell a zero page from one not fetched yet.
    pub fn open_fetched(path: &Path, data: PageBitmap, fetch: Fetcher) -> Result<MemoryFile> {
        Self::open_inner(path, Some((data, fetch)))
    }

    fn open_inner(path: &Path, fetched: Option<(PageBitmap, Fetcher)>) -> Result<MemoryFile> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io("stat", path, e))?
            .len();
        let mut head = Vec::with_capacity(FIXED_HEADER_LEN);
        (&file)
            .take(FIXED_HEADER_LEN as u64)
            .read_to_end(&mut head)
            .map_err(|e| Error::io("read header", path, e))?;
        let (header, bitmap_words) = parse_fixed(&head)?;
        // Bounded: region count <= MAX_REGIONS and bitmap words derived from a capped size.
        let tables_len = header.regions.capacity() * REGION_ENTRY_LEN + bitmap_words as usize * 8;
        let needed = header.data_offset + header.mem_size;
        if file_len < needed {
            return Err(Error::Truncated {
                file: FILE,
                needed,
                found: file_len,
            });
        }
        if file_len > needed {
            return Err(Error::corrupt(
                FILE,
                format!("{} bytes after the memory image", file_len - needed),
            ));
        }
        let mut tables = vec![0u8; tables_len];
        file.read_exact_at(&mut tables, FIXED_HEADER_LEN as u64)
            .map_err(|e| Error::io("read tables", path, e))?;
        let (header, present) = parse_tables(header, bitmap_words, &head, &tables)?;

        let pages = header.pages();
        let (data, fetch) = match fetched {
            Some((data, fetch)) => {
                if data.len() != pages {
                    return Err(Error::corrupt(
                        FILE,
                        format!("data map of {} pages for a {pages}-page image", data.len()),
                    ));
                }
                if let Some(p) = &present {
                    if data.runs().any(|(s, n)| (s..s + n).any(|i| !p.get(i))) {
                        return Err(Error::corrupt(
                            FILE,
                            "data map names pages the diff does not contain",
                        ));
                    }
                }
                (data, Some(fetch))
            }
            None => {
                let mut data = PageBitmap::new(pages);
                let extents = data_extents(
                    &file,
                    header.data_offset,
                    header.data_offset + header.mem_size,
                )
                .map_err(|e| Error::io("seek data", path, e))?;
                for (o, l) in extents {
                    let s = (o - header.data_offset) / PAGE_SIZE_U64;
                    let e = (o - header.data_offset + l).div_ceil(PAGE_SIZE_U64);
                    data.set_range(s, e - s);
                }
                (data, None)
            }
        };
        tracing::debug!(
            path = %path.display(),
            id = %header.id,
            kind = %header.kind,
            mem_size = header.mem_size,
            data_pages = data.count_ones(),
            "opened snapshot memory file"
        );
        Ok(MemoryFile {
            file,
            path: path.to_path_buf(),
            header,
            present,
            data,
            fetch,
        })
    }

    /// The verified header.
    pub fn header(&self) -> &MemoryHeader {
        &self.header
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The open file (for `MAP_PRIVATE` of the image at [`MemoryHeader::data_offset`]).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Pages a diff contains; `None` for a full file (which contains every page).
    pub fn present_pages(&self) -> Option<&PageBitmap> {
        self.present.as_ref()
    }

    /// Pages that are not holes in the file.
    pub fn data_pages(&self) -> &PageBitmap {
        &self.data
    }

    /// Check that this memory file belongs to the snapshot whose state header is `state`
    /// (same id, kind and memory size).
    pub fn check_state(&self, state: &state_file::Header) -> Result<()> {
        let m = &state.meta;
        if m.id != self.header.id {
            return Err(Error::IdMismatch {
                file: FILE,
                expected: m.id,
                found: self.header.id,
            });
        }
        if m.kind != self.header.kind {
            return Err(Error::WrongKind {
                expected: m.kind,
                found: self.header.kind,
            });
        }
        if m.mem_size != self.header.mem_size {
            return Err(Error::GeometryMismatch(format!(
                "state file says {:#x} bytes of guest memory, memory file {} holds {:#x}",
                m.mem_size,
                self.path.display(),
                self.header.mem_size
            )));
        }
        Ok(())
    }

    fn check_dst(&self, dst: &[u8]) -> Result<()> {
        if dst.len() as u64 != self.header.mem_size {
            return Err(Error::GeometryMismatch(format!(
                "destination is {:#x} bytes, memory image {:#x}",
                dst.len(),
                self.header.mem_size
            )));
        }
        Ok(())
    }

    fn read_run(&self, dst: &mut [u8], first_page: u64) -> Result<()> {
        let offset = self.header.data_offset + first_page * PAGE_SIZE_U64;
        if let Some(f) = &self.fetch {
            f.0.ensure(offset, dst.len() as u64)
                .map_err(|reason| Error::Fetch {
                    path: self.path.clone(),
                    offset,
                    end: offset + dst.len() as u64,
                    reason,
                })?;
        }
        self.file
            .read_exact_at(dst, offset)
            .map_err(|e| Error::io("read memory image", &self.path, e))
    }

    /// Whether this file is filled lazily (see [`crate::fetch`]).
    pub fn is_fetched(&self) -> bool {
        self.fetch.is_some()
    }

    /// Load a full memory image into `dst` (exactly the memory size), reading only the
    /// data extents of the file. Returns the bytes read.
    pub fn read_into(&self, dst: &mut [u8], fill: HoleFill) -> Result<u64> {
        if self.header.kind != SnapshotKind::Full {
            return Err(Error::WrongKind {
                expected: SnapshotKind::Full,
                found: self.header.kind,
            });
        }
        self.check_dst(dst)?;
        let mut read = 0u64;
        let mut pos = 0u64;
        for (s, n) in self.data.runs() {
            if fill == HoleFill::Zero {
                dst[(pos * PAGE_SIZE_U64) as usize..(s * PAGE_SIZE_U64) as usize].fill(0);
            }
            let range = (s * PAGE_SIZE_U64) as usize..((s + n) * PAGE_SIZE_U64) as usize;
            self.read_run(&mut dst[range], s)?;
            read += n * PAGE_SIZE_U64;
            pos = s + n;
        }
        if fill == HoleFill::Zero {
            dst[(pos * PAGE_SIZE_U64) as usize..].fill(0);
        }
        Ok(read)
    }

    /// Write the pages of a diff over `dst` (the base image). Returns the bytes written.
    pub fn overlay_into(&self, dst: &mut [u8]) -> Result<u64> {
        let present = self.present.as_ref().ok_or(Error::WrongKind {
            expected: SnapshotKind::Diff,
            found: SnapshotKind::Full,
        })?;
        self.check_dst(dst)?;
        let mut written = 0u64;
        for (s, n) in present.runs() {
            let range = (s * PAGE_SIZE_U64) as usize..((s + n) * PAGE_SIZE_U64) as usize;
            self.read_run(&mut dst[range], s)?;
            written += n * PAGE_SIZE_U64;
        }
        Ok(written)
    }
}

/// Parse and verify the fixed header; the region vector is allocated with its (capped)
/// capacity but left empty.
fn parse_fixed(h: &[u8]) -> Result<(MemoryHeader, u64)> {
    let n = h.len().min(MAGIC.len());
    if h[..n] != MAGIC[..n] {
        return Err(Error::NotASnapshot { file: FILE });
    }
    let truncated = || Error::Truncated {
        file: FILE,
        needed: FIXED_HEADER_LEN as u64,
        found: h.len() as u64,
    };
    if h.len() < 12 {
        return Err(truncated());
    }
    let version = le_u32(h, 8);
    if version != FORMAT_VERSION {
        return Err(Error::UnsupportedVersion {
            file: FILE,
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if h.len() < FIXED_HEADER_LEN {
        return Err(truncated());
    }
    let stored = le_u32(h, 124);
    let computed = crc32fast::hash(&h[..124]);
    if stored != computed {
        return Err(Error::ChecksumMismatch {
            file: FILE,
            section: "header",
            stored,
            computed,
        });
    }
    let raw_kind = le_u32(h, 12);
    let kind = SnapshotKind::from_raw(raw_kind)
        .ok_or_else(|| Error::corrupt(FILE, format!("unknown kind {raw_kind}")))?;
    let id = id_at(h, 16);
    let base = id_at(h, 32);
    let mem_size = le_u64(h, 48);
    let page_size = le_u32(h, 56);
    let region_count = le_u32(h, 60);
    let data_offset = le_u64(h, 64);
    let bitmap_words = le_u64(h, 72);
    if h[80..120].iter().any(|&b| b != 0) {
        return Err(Error::corrupt(FILE, "reserved header bytes are not zero"));
    }
    if id.is_none() {
        return Err(Error::corrupt(FILE, "snapshot id is zero"));
    }
    match kind {
        SnapshotKind::Full if !base.is_none() => {
            return Err(Error::corrupt(FILE, "full memory file with a base id"))
        }
        SnapshotKind::Diff if base.is_none() || base == id => {
            return Err(Error::corrupt(
                FILE,
                "diff memory file without a valid base id",
            ))
        }
        _ => {}
    }
    if page_size as usize != PAGE_SIZE {
        return Err(Error::corrupt(
            FILE,
            format!("page size {page_size}, this build uses {PAGE_SIZE}"),
        ));
    }
    if mem_size > MAX_MEM_SIZE {
        return Err(Error::TooLarge {
            file: FILE,
            what: "memory size",
            found: mem_size,
            limit: MAX_MEM_SIZE,
        });
    }
    if !mem_size.is_multiple_of(PAGE_SIZE_U64) {
        return Err(Error::corrupt(FILE, "memory size is not page-aligned"));
    }
    if region_count > MAX_REGIONS {
        return Err(Error::TooLarge {
            file: FILE,
            what: "region count",
            found: u64::from(region_count),
            limit: u64::from(MAX_REGIONS),
        });
    }
    let expected_words = match kind {
        SnapshotKind::Full => 0,
        SnapshotKind::Diff => words_for(mem_size / PAGE_SIZE_U64),
    };
    if bitmap_words != expected_words {
        return Err(Error::corrupt(
            FILE,
            format!("bitmap of {bitmap_words} words, expected {expected_words}"),
        ));
    }
    let expected_offset = data_offset_for(u64::from(region_count), bitmap_words);
    if data_offset != expected_offset {
        return Err(Error::corrupt(
            FILE,
            format!("data offset {data_offset:#x}, expected {expected_offset:#x}"),
        ));
    }
    Ok((
        MemoryHeader {
            version,
            kind,
            id,
            base: (!base.is_none()).then_some(base),
            mem_size,
            data_offset,
            regions: Vec::with_capacity(region_count as usize),
        },
        bitmap_words,
    ))
}

fn parse_tables(
    mut header: MemoryHeader,
    bitmap_words: u64,
    head: &[u8],
    tables: &[u8],
) -> Result<(MemoryHeader, Option<PageBitmap>)> {
    let stored = le_u32(head, 120);
    let computed = crc32fast::hash(tables);
    if stored != computed {
        return Err(Error::ChecksumMismatch {
            file: FILE,
            section: "region table and bitmap",
            stored,
            computed,
        });
    }
    let count = header.regions.capacity();
    for i in 0..count {
        let o = i * REGION_ENTRY_LEN;
        header.regions.push(RegionInfo {
            guest_addr: le_u64(tables, o),
            size: le_u64(tables, o + 8),
            offset: le_u64(tables, o + 16),
        });
    }
    let total = validate_regions(&header.regions).map_err(|r| Error::corrupt(FILE, r))?;
    if total != header.mem_size {
        return Err(Error::corrupt(
            FILE,
            format!(
                "regions add up to {total:#x} bytes, header says {:#x}",
                header.mem_size
            ),
        ));
    }
    let present = if bitmap_words > 0 || header.kind == SnapshotKind::Diff {
        let base = count * REGION_ENTRY_LEN;
        let words: Vec<u64> = (0..bitmap_words as usize)
            .map(|i| le_u64(tables, base + i * 8))
            .collect();
        let pages = header.pages();
        let bm = PageBitmap::from_words(words.clone(), pages)
            .ok_or_else(|| Error::corrupt(FILE, "bitmap too short"))?;
        if bm.words() != &words[..] {
            return Err(Error::corrupt(FILE, "bitmap has bits past the last page"));
        }
        Some(bm)
    } else {
        None
    };
    Ok((header, present))
}

/// Where a page of a [`MemoryChain`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageLocation {
    /// A zero page (a hole in the file that owns it).
    Zero,
    /// `PAGE_SIZE` bytes at `offset` of layer `layer`'s file.
    File {
        /// Index into [`MemoryChain::layers`].
        layer: usize,
        /// Byte offset in that file.
        offset: u64,
    },
}

/// A full memory file and the diffs on top of it, verified to form one chain with one
/// geometry. Restoring reads the base, then each diff over it.
#[derive(Debug)]
pub struct MemoryChain {
    layers: Vec<MemoryFile>,
    /// For chains longer than one: the layer that owns each page.
    owner: Option<Vec<u8>>,
}

impl MemoryChain {
    /// Verify `layers` (base first): the first is full, each next one is a diff whose base
    /// is the one before it, and all have the same regions.
    pub fn new(layers: Vec<MemoryFile>) -> Result<MemoryChain> {
        let first = layers
            .first()
            .ok_or_else(|| Error::InvalidInput("empty memory file chain".into()))?;
        if let Some(base) = first.header.base {
            return Err(Error::MissingBase { base });
        }
        if layers.len() > MAX_CHAIN_LEN {
            return Err(Error::InvalidInput(format!(
                "diff chain of {} files, at most {MAX_CHAIN_LEN} supported",
                layers.len()
            )));
        }
        for pair in layers.windows(2) {
            let (prev, cur) = (&pair[0].header, &pair[1].header);
            match cur.base {
                None => {
                    return Err(Error::InvalidInput(format!(
                        "full memory file {} given on top of {}",
                        pair[1].path.display(),
                        pair[0].path.display()
                    )))
                }
                Some(b) if b != prev.id => {
                    return Err(Error::BaseMismatch {
                        diff: cur.id,
                        expected: b,
                        found: prev.id,
                    })
                }
                Some(_) => {}
            }
            if cur.regions != prev.regions {
                return Err(Error::GeometryMismatch(format!(
                    "{} has regions {:?}, its base {} has {:?}",
                    pair[1].path.display(),
                    cur.regions,
                    pair[0].path.display(),
                    prev.regions
                )));
            }
        }
        let owner = (layers.len() > 1).then(|| {
            let mut owner = vec![0u8; first.header.pages() as usize];
            for (i, l) in layers.iter().enumerate().skip(1) {
                if let Some(p) = &l.present {
                    for (s, n) in p.runs() {
                        owner[s as usize..(s + n) as usize].fill(i as u8);
                    }
                }
            }
            owner
        });
        Ok(MemoryChain { layers, owner })
    }

    /// Open the files at `paths` (base first) and verify them as a chain.
    pub fn open(paths: &[&Path]) -> Result<MemoryChain> {
        let layers = paths
            .iter()
            .map(|p| MemoryFile::open(p))
            .collect::<Result<Vec<_>>>()?;
        MemoryChain::new(layers)
    }

    /// The files, base first.
    pub fn layers(&self) -> &[MemoryFile] {
        &self.layers
    }

    /// The newest file (whose id is the snapshot's).
    pub fn top(&self) -> &MemoryFile {
        // `new` guarantees at least one layer.
        &self.layers[self.layers.len() - 1]
    }

    /// Guest memory size.
    pub fn mem_size(&self) -> u64 {
        self.layers[0].header.mem_size
    }

    /// Number of pages.
    pub fn pages(&self) -> u64 {
        self.layers[0].header.pages()
    }

    /// The regions (same in every layer).
    pub fn regions(&self) -> &[RegionInfo] {
        &self.layers[0].header.regions
    }

    /// Check the chain against the snapshot's state header (the top layer must be that
    /// snapshot's memory file).
    pub fn check_state(&self, state: &state_file::Header) -> Result<()> {
        self.top().check_state(state)
    }

    /// Which layer owns `page` and whether it is a zero page. Panics never: pages past
    /// the end are reported as [`PageLocation::Zero`].
    pub fn locate(&self, page: u64) -> PageLocation {
        if page >= self.pages() {
            return PageLocation::Zero;
        }
        let layer = self.owner.as_ref().map_or(0, |o| o[page as usize] as usize);
        let f = &self.layers[layer];
        if f.data.get(page) {
            PageLocation::File {
                layer,
                offset: f.header.data_offset + page * PAGE_SIZE_U64,
            }
        } else {
            PageLocation::Zero
        }
    }

    /// Read `buf.len() / PAGE_SIZE` pages starting at `first_page` from the layers that
    /// own them. `buf` must be a whole number of pages inside the image.
    pub fn read_pages(&self, first_page: u64, buf: &mut [u8]) -> Result<()> {
        let n = (buf.len() / PAGE_SIZE) as u64;
        if !buf.len().is_multiple_of(PAGE_SIZE)
            || first_page.checked_add(n).is_none_or(|e| e > self.pages())
        {
            return Err(Error::InvalidInput(format!(
                "read of {} bytes at page {first_page} outside the {}-page image",
                buf.len(),
                self.pages()
            )));
        }
        let owner_of = |p: u64| self.owner.as_ref().map_or(0, |o| o[p as usize]);
        let mut i = 0u64;
        while i < n {
            let layer = owner_of(first_page + i);
            let mut j = i + 1;
            while j < n && owner_of(first_page + j) == layer {
                j += 1;
            }
            let dst = &mut buf[(i * PAGE_SIZE_U64) as usize..(j * PAGE_SIZE_U64) as usize];
            self.layers[layer as usize].read_run(dst, first_page + i)?;
            i = j;
        }
        Ok(())
    }

    /// Tell the fetchers of lazily filled layers that `pages` will be read soon, so that
    /// they fetch them in parallel (see [`crate::fetch::ChunkFetch::prefetch`]); nothing
    /// for layers on local disk.
    pub fn prefetch_pages(&self, pages: &[u64]) {
        if self.layers.iter().all(|l| l.fetch.is_none()) {
            return;
        }
        let mut per_layer: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.layers.len()];
        for &p in pages {
            if let PageLocation::File { layer, offset } = self.locate(p) {
                per_layer[layer].push((offset, PAGE_SIZE_U64));
            }
        }
        for (l, mut ranges) in self.layers.iter().zip(per_layer) {
            if let (Some(f), false) = (&l.fetch, ranges.is_empty()) {
                coalesce(&mut ranges);
                f.0.prefetch(&ranges);
            }
        }
    }

    /// Tell the fetchers of lazily filled layers that every data page will be read (an
    /// eager restore, or filling what a guest never touched): they fetch in parallel.
    pub fn prefetch_all(&self) {
        for l in &self.layers {
            if let Some(f) = &l.fetch {
                let d = l.header.data_offset;
                let ranges: Vec<(u64, u64)> = l
                    .data
                    .runs()
                    .map(|(s, n)| (d + s * PAGE_SIZE_U64, n * PAGE_SIZE_U64))
                    .collect();
                f.0.prefetch(&ranges);
            }
        }
    }

    /// Eagerly restore the whole chain into `dst` (the `copy` backend): the base's data
    /// extents, then each diff's pages. Everything is verified before `dst` is touched.
    pub fn restore_into(&self, dst: &mut [u8], fill: HoleFill) -> Result<u64> {
        self.prefetch_all();
        let mut n = self.layers[0].read_into(dst, fill)?;
        n += self.overlay_diffs_into(dst)?;
        Ok(n)
    }

    /// Write only the diff layers over `dst`, which already holds the base image (the
    /// `file` backend maps the base file `MAP_PRIVATE` and then calls this).
    pub fn overlay_diffs_into(&self, dst: &mut [u8]) -> Result<u64> {
        let mut n = 0;
        for l in &self.layers[1..] {
            n += l.overlay_into(dst)?;
        }
        Ok(n)
    }
}
