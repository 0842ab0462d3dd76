//! A memory file's header and tables ([`MemoryHeader`], [`RegionInfo`]): encoded when a
//! file is written, parsed and verified when one is opened (the layout is in the
//! [module documentation](super)). Everything read here is untrusted: every field is
//! checked, every length capped, before anything is allocated by it.

use super::{
    FILE, FIXED_HEADER_LEN, FORMAT_VERSION, MAGIC, MAX_MEM_SIZE, MAX_REGIONS, REGION_ENTRY_LEN,
};
use crate::bitmap::{words_for, PageBitmap};
use crate::bytes::{id_at, le_u32, le_u64};
use crate::{Error, Result, SnapshotId, SnapshotKind, PAGE_SIZE, PAGE_SIZE_U64};

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

pub(super) fn data_offset_for(region_count: u64, bitmap_words: u64) -> u64 {
    let meta = FIXED_HEADER_LEN as u64 + REGION_ENTRY_LEN as u64 * region_count + 8 * bitmap_words;
    meta.div_ceil(PAGE_SIZE_U64) * PAGE_SIZE_U64
}

/// Check a region table: page-aligned, non-empty, ascending and non-overlapping guest
/// ranges, contiguous image offsets from 0. Returns the total size.
pub(super) fn validate_regions(regions: &[RegionInfo]) -> std::result::Result<u64, String> {
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

pub(super) fn encode_meta(h: &MemoryHeader, bitmap: Option<&PageBitmap>) -> Vec<u8> {
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

/// Parse and verify the fixed header; the region vector is allocated with its (capped)
/// capacity but left empty.
pub(super) fn parse_fixed(h: &[u8]) -> Result<(MemoryHeader, u64)> {
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

pub(super) fn parse_tables(
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
