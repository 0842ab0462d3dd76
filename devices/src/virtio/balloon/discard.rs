//! Giving guest memory back to the host: the [`Discard`] seam between the balloon device and
//! whoever owns the mapping, its `madvise` implementation ([`MadviseDiscard`]), and the
//! record of what was discarded ([`DiscardLog`]) that lets a snapshot or fork skip those
//! pages.
//!
//! The device only decides *which* guest-physical ranges are free (after checking them);
//! what giving them back means depends on how the memory is mapped, which is the VMM's
//! business. [`MadviseDiscard`] covers the mappings Clade makes, by the region's mmap flags:
//! - `MAP_SHARED` (a memfd holding the memory image): `MADV_REMOVE` punches a hole in the
//!   file, so the pages read back as zero, leave the page cache, and a snapshot reading the
//!   memfd skips them (`SEEK_DATA`);
//! - `MAP_PRIVATE` (anonymous memory, or a copy-on-write mapping of a snapshot file or of a
//!   frozen fork image): `MADV_DONTNEED` drops the private pages; they read back as zero
//!   (anonymous; a page server serves them as zero after `UFFD_EVENT_REMOVE`) or as the
//!   file's content (copy-on-write of a file), which a guest that freed them never reads
//!   as meaningful.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MmapRegion};

use crate::{Error, GuestMemory, Result};

/// Page size the balloon works in (virtio balloon PFNs are 4 KiB pages).
pub const PAGE: u64 = 4096;

/// Gives the host memory behind a range of guest RAM back to the host.
pub trait Discard: Send + Sync {
    /// Discards `len` bytes of guest memory `mem` at `addr`. The caller has checked the
    /// range: page-aligned, non-empty and inside guest RAM (it may span regions).
    fn discard(&self, mem: &GuestMemory, addr: GuestAddress, len: u64) -> Result<()>;
}

/// Pages discarded since the last [`DiscardLog::take`], one bitmap per guest memory region
/// (in region order; bit `i` of a bitmap is the region's page `i`, the layout of KVM's dirty
/// log), so that a snapshot or fork can leave out pages nobody rewrote since.
#[derive(Debug)]
pub struct DiscardLog {
    /// (guest start, length, bitmap words) per region.
    regions: Vec<(u64, u64, Vec<AtomicU64>)>,
}

impl DiscardLog {
    /// An empty log for guest RAM laid out as `ranges` (guest address, length), in order.
    pub fn new(ranges: &[(u64, u64)]) -> Self {
        let regions = ranges
            .iter()
            .map(|&(start, len)| {
                let words = len.div_ceil(PAGE).div_ceil(64);
                (start, len, (0..words).map(|_| AtomicU64::new(0)).collect())
            })
            .collect();
        Self { regions }
    }

    /// A log for the regions of `mem`.
    pub fn for_memory(mem: &GuestMemory) -> Self {
        let ranges: Vec<(u64, u64)> = mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
        Self::new(&ranges)
    }

    /// Records that the pages of `addr..addr + len` were discarded (parts outside every
    /// region are ignored).
    pub fn mark(&self, addr: u64, len: u64) {
        let end = addr.saturating_add(len);
        for (start, rlen, words) in &self.regions {
            let rend = start + rlen;
            let (a, e) = (addr.max(*start), end.min(rend));
            if a >= e {
                continue;
            }
            let (first, last) = ((a - start) / PAGE, (e - start).div_ceil(PAGE));
            for page in first..last {
                if let Some(w) = words.get((page / 64) as usize) {
                    w.fetch_or(1 << (page % 64), Ordering::Relaxed);
                }
            }
        }
    }

    /// The pages discarded since the last call, one bitmap per region, and clears them.
    pub fn take(&self) -> Vec<Vec<u64>> {
        self.regions
            .iter()
            .map(|(_, _, w)| w.iter().map(|w| w.swap(0, Ordering::Relaxed)).collect())
            .collect()
    }

    /// Pages discarded since the last [`DiscardLog::take`] (not cleared).
    pub fn pages(&self) -> u64 {
        self.regions
            .iter()
            .flat_map(|(_, _, w)| w.iter())
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }
}

/// Discards with `madvise`, by each region's mapping (see the module documentation), and
/// records what it discarded in an optional [`DiscardLog`].
#[derive(Debug, Default, Clone)]
pub struct MadviseDiscard {
    log: Option<Arc<DiscardLog>>,
}

impl MadviseDiscard {
    /// Discards without recording.
    pub fn new() -> Self {
        Self::default()
    }

    /// Discards and records each discarded range in `log`.
    pub fn with_log(log: Arc<DiscardLog>) -> Self {
        Self { log: Some(log) }
    }
}

/// `madvise(addr, len, advice)` on host memory.
///
/// # Safety
/// `addr..addr + len` must be guest memory this process maps, whose contents nobody
/// relies on any more (the guest freed it): afterwards it reads as zero or as the file
/// behind it.
unsafe fn madvise(addr: *mut u8, len: usize, advice: i32) -> std::io::Result<()> {
    // SAFETY: the caller's promise; madvise only changes what backs the pages, it never
    // unmaps them, so every reference into the mapping stays valid.
    let r = unsafe { libc::madvise(addr.cast(), len, advice) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Discard for MadviseDiscard {
    fn discard(&self, mem: &GuestMemory, addr: GuestAddress, len: u64) -> Result<()> {
        let end = addr
            .0
            .checked_add(len)
            .ok_or_else(|| Error::Virtio(format!("discard of {len:#x} at {addr:#x?} wraps")))?;
        let mut at = addr.0;
        while at < end {
            let region = mem
                .find_region(GuestAddress(at))
                .ok_or_else(|| Error::Virtio(format!("discard at {at:#x}: not guest memory")))?;
            let off = at - region.start_addr().0;
            let n = (region.len() - off).min(end - at);
            let mmap: &MmapRegion<_> = region;
            let advice = if mmap.flags() & libc::MAP_SHARED != 0 {
                libc::MADV_REMOVE
            } else {
                libc::MADV_DONTNEED
            };
            let host = mmap.as_ptr().wrapping_add(off as usize);
            // SAFETY: `off + n` is inside this region's mapping; the guest freed the pages
            // (the balloon device's caller checked the range is page-aligned guest RAM).
            let r = unsafe { madvise(host, n as usize, advice) };
            if let Err(e) = r {
                if advice != libc::MADV_REMOVE {
                    return Err(Error::Virtio(format!("madvise at {at:#x}+{n:#x}: {e}")));
                }
                // Refused: a file that cannot punch holes, or memory the VMM has since
                // mapped private over the same addresses (a fork froze the memfd for its
                // children, whose memory the kernel then refuses to punch: EACCES). Drop
                // the pages from this mapping only.
                // SAFETY: as above.
                unsafe { madvise(host, n as usize, libc::MADV_DONTNEED) }
                    .map_err(|e| Error::Virtio(format!("madvise at {at:#x}+{n:#x}: {e}")))?;
            }
            if let Some(log) = &self.log {
                log.mark(at, n);
            }
            at += n;
        }
        Ok(())
    }
}
