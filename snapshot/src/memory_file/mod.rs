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
//!
//! This file opens and reads one memory file ([`MemoryFile`]); `header.rs` encodes and
//! verifies the header and tables, `write.rs` writes memory files, `chain.rs` reads
//! through a full file and its diffs ([`MemoryChain`]).

mod chain;
mod header;
mod write;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::bitmap::PageBitmap;
use crate::fetch::Fetcher;
use crate::fsutil::data_extents;
use crate::state_file;
use crate::{Error, FileType, Result, SnapshotKind, PAGE_SIZE_U64};

pub use chain::{MemoryChain, PageLocation};
use header::{parse_fixed, parse_tables};
pub use header::{MemoryHeader, RegionInfo};
pub use write::{
    write_diff, write_diff_pending, write_full, write_full_pending, GuestRegion, PendingMemoryFile,
    RegionData, WriteStats,
};

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

/// Whether [`MemoryFile::read_into`] writes zeros for holes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoleFill {
    /// The destination is already zero (fresh anonymous mapping or memfd): holes are
    /// skipped, which is what makes a mostly-empty image fast to load.
    AssumeZeroed,
    /// Write zeros over holes.
    Zero,
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
