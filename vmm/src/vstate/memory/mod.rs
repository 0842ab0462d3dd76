//! Guest memory: address space reserved first (so KVM memory slots can point at it before
//! there is any memory), then filled with one of four kinds of mapping.
//!
//! The guest RAM ranges (around the MMIO gap) are laid out back to back in one *memory
//! image*: range `i` starts at image offset `sum(len of ranges < i)`. The image is what a
//! snapshot memory file holds and what the mappings below are made of.
//!
//! | backing | mapping | used by | next snapshot reads |
//! |---|---|---|---|
//! | [`Backing::Memfd`] | `MAP_SHARED` of a memfd holding the image | boot, `copy` restore | the memfd (holes skipped) |
//! | [`Backing::Anonymous`] | private anonymous | `uffd` restore (page server fills it) | the mapping |
//! | [`Backing::FilePrivate`] | `MAP_PRIVATE` of the snapshot memory file | `file` restore | the mapping |
//! | [`Backing::Forked`] | `MAP_PRIVATE` of a frozen image's layers | after a fork or a copy-on-write snapshot; fork children | a copy-on-write snapshot: the image's layers; paused: the mapping |
//!
//! Freezing ([`GuestRam::image_now`], then [`GuestRam::map_frozen`]) turns any of the first three
//! into the fourth in place, at the same addresses; the old mapping's teardown is moved off
//! the caller's pause ([`Retired`]). A VM with a spare shell instead moves onto a new
//! mapping of the frozen image ([`GuestRam::image_now`], [`GuestRam::forked`]) and leaves
//! this one whole, to be released later ([`GuestRam::release_gradually`]).
//! Writes the VMM makes through [`GuestMemory`] (devices) are recorded in per-region dirty
//! bitmaps ([`GuestRam::take_vmm_dirty`]), the complement of KVM's dirty log.
//!
//! This file makes guest memory and maps it ([`Reservation`], [`GuestRam`]);
//! `frozen.rs` has frozen images and freezing, `mapping.rs` the raw system calls and the
//! teardown of retired mappings.

mod frozen;
mod mapping;

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegion;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestRegionMmap};

pub use devices::GuestMemory;

pub use frozen::{FrozenImage, MAX_FROZEN_LAYERS};
pub use mapping::Retired;
pub(crate) use mapping::TEARDOWN_GRACE;
use mapping::{mmap, munmap, reserve_aligned, zap_gradually};

use crate::arch::layout::ram_ranges;
use crate::error::{Error, Result};

/// One guest RAM range in host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRange {
    /// Host virtual address.
    pub host_addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Guest-physical address.
    pub guest_addr: u64,
    /// Offset in the memory image.
    pub image_offset: u64,
}

/// Total RAM of the host, in MiB, from /proc/meminfo.
pub fn host_mem_mib() -> Result<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").map_err(|source| Error::Io {
        context: "reading /proc/meminfo",
        source,
    })?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib / 1024)
        .ok_or_else(|| Error::Memory("no MemTotal in /proc/meminfo".into()))
}

/// Address space for guest RAM: one contiguous area holding the memory image, carved into
/// the guest RAM ranges (range `i` at `base + image_offset`). Memory slots can be
/// registered on it before the memory itself exists; [`GuestRam`] later maps memory over
/// it, or, for private anonymous memory, takes it as it is.
///
/// It is private anonymous memory, readable and writable, that nothing has touched: no
/// page is present and no page table exists (only the KVM memory slots registered on it
/// know its address before a [`GuestRam`] takes it, and no vCPU runs before then).
/// Mapping anything over a range that a KVM memory slot covers makes KVM walk the slot
/// page by page (~25 us per 256 MiB measured here, the same for `mprotect`), so the `uffd`
/// restore, whose memory is private anonymous memory with no page present, makes no
/// mapping call at all ([`GuestRam::anonymous`]).
#[derive(Debug)]
pub struct Reservation {
    base: usize,
    len: usize,
    ranges: Vec<HostRange>,
}

impl Reservation {
    /// Reserves address space for `mem_bytes` of guest RAM.
    pub fn new(mem_bytes: u64) -> Result<Reservation> {
        let len = usize::try_from(mem_bytes)
            .map_err(|_| Error::Memory(format!("{mem_bytes} bytes do not fit this host")))?;
        let base = reserve_aligned(len, PROT_RW, "reserving guest address space")?;
        let mut ranges = Vec::new();
        let mut image_offset = 0u64;
        for (guest_addr, size) in ram_ranges(mem_bytes) {
            ranges.push(HostRange {
                host_addr: base + image_offset as usize,
                len: size as usize,
                guest_addr,
                image_offset,
            });
            image_offset += size;
        }
        Ok(Reservation { base, len, ranges })
    }

    /// The guest RAM ranges inside the area, in guest address order.
    pub fn ranges(&self) -> &[HostRange] {
        &self.ranges
    }

    /// Guest RAM size.
    pub fn mem_bytes(&self) -> u64 {
        self.len as u64
    }

    fn disarm(mut self) -> (usize, usize, Vec<HostRange>) {
        let out = (self.base, self.len, std::mem::take(&mut self.ranges));
        self.len = 0;
        out
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.len > 0 {
            munmap(self.base, self.len);
        }
    }
}

/// What guest memory is made of (see the [module documentation](self)).
#[derive(Debug)]
pub enum Backing {
    /// A memfd holding the image, mapped shared.
    Memfd(File),
    /// Private anonymous memory.
    Anonymous,
    /// A private mapping of a snapshot memory file.
    FilePrivate,
    /// Private (copy-on-write) mappings of a frozen fork image: the VM forked, or was
    /// forked from, a VM whose memory this was.
    Forked(Arc<FrozenImage>),
}

/// Page size of guest memory mappings.
pub const PAGE: u64 = 4096;

/// Guest RAM. Unmapped when dropped: drop it after everything that uses it (vCPUs,
/// devices, the KVM VM).
pub struct GuestRam {
    /// The guest memory, with a dirty bitmap per region for the VMM's own writes.
    pub mem: GuestMemory,
    backing: Backing,
    base: usize,
    len: usize,
    ranges: Vec<HostRange>,
    /// See [`GuestRam::take_retired`].
    retired: Option<Retired>,
}

impl std::fmt::Debug for GuestRam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestRam")
            .field("backing", &self.backing)
            .field("ranges", &self.ranges)
            .finish()
    }
}

const PROT_RW: i32 = libc::PROT_READ | libc::PROT_WRITE;

fn memfd(name: &str, size: u64) -> Result<File> {
    let cname = CString::new(name).map_err(|e| Error::Memory(e.to_string()))?;
    // SAFETY: memfd_create takes a valid NUL-terminated name and flags; it returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::Memory(format!(
            "memfd_create: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` was just returned by memfd_create and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| Error::Memory(format!("sizing memfd to {size} bytes: {e}")))?;
    Ok(file)
}

impl GuestRam {
    /// Maps memory over the whole reservation with `map(base, len)` (which must use
    /// `MAP_FIXED` at exactly that range, with `flags`, or do nothing when the reservation
    /// as it is has `flags`) and builds the guest memory on it.
    fn map_over(
        res: Reservation,
        backing: Backing,
        flags: i32,
        map: impl FnOnce(usize, usize) -> Result<()>,
    ) -> Result<GuestRam> {
        // On error the reservation (with whatever was mapped over it) is unmapped.
        map(res.base, res.len)?;
        let mut regions = Vec::with_capacity(res.ranges().len());
        for r in res.ranges() {
            // SAFETY: `r` lies inside the live PROT_RW mapping just made with `flags`, owned
            // by the GuestRam built below until it is dropped; the region does not unmap it.
            let mmap = unsafe {
                MmapRegion::<AtomicBitmap>::build_raw(r.host_addr as *mut u8, r.len, PROT_RW, flags)
            }
            .map_err(|e| Error::Memory(format!("guest region at {:#x}: {e}", r.guest_addr)))?;
            let region =
                GuestRegionMmap::new(mmap, GuestAddress(r.guest_addr)).ok_or_else(|| {
                    Error::Memory(format!("guest region at {:#x} wraps", r.guest_addr))
                })?;
            regions.push(region);
        }
        let mem = GuestMemory::from_regions(regions).map_err(|e| Error::Memory(e.to_string()))?;
        let (base, len, ranges) = res.disarm();
        Ok(GuestRam {
            mem,
            backing,
            base,
            len,
            ranges,
            retired: None,
        })
    }

    /// Fresh, zeroed memory: a memfd mapped shared over `res` (boot, `copy` resume). Pages
    /// are allocated by the host on first touch.
    pub fn memfd(res: Reservation) -> Result<GuestRam> {
        let file = memfd("clade-guest-ram", res.mem_bytes())?;
        let fd = file.as_raw_fd();
        let flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
        Self::map_over(res, Backing::Memfd(file), flags, |base, len| {
            // SAFETY: the reserved range is ours and nothing refers into it.
            unsafe {
                mmap(
                    base,
                    len,
                    PROT_RW,
                    flags | libc::MAP_FIXED,
                    fd,
                    0,
                    "mapping guest memory",
                )
            }
            .map(|_| ())
        })
    }

    /// Private anonymous memory with no page present (the `uffd` backend registers it with
    /// a page server before anything touches it): the reservation itself, as it is.
    pub fn anonymous(res: Reservation) -> Result<GuestRam> {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        Self::map_over(res, Backing::Anonymous, flags, |_, _| Ok(()))
    }

    /// A private (copy-on-write) mapping of the memory image stored in `file` from byte
    /// `data_offset` (page-aligned), over `res` (the `file` backend).
    pub fn file_private(res: Reservation, file: &File, data_offset: u64) -> Result<GuestRam> {
        let fd = file.as_raw_fd();
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        Self::map_over(res, Backing::FilePrivate, flags, |base, len| {
            // SAFETY: the reserved range is ours and nothing refers into it.
            unsafe {
                mmap(
                    base,
                    len,
                    PROT_RW,
                    flags | libc::MAP_FIXED,
                    fd,
                    data_offset,
                    "mapping the snapshot memory file",
                )
            }
            .map(|_| ())
        })
    }

    /// Memory of a VM forked from `image`: its layers mapped private over `res`.
    pub fn forked(res: Reservation, image: Arc<FrozenImage>) -> Result<GuestRam> {
        if image.mem_bytes != res.mem_bytes() {
            return Err(Error::Memory(format!(
                "a frozen image of {} bytes for {} bytes of guest memory",
                image.mem_bytes,
                res.mem_bytes()
            )));
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        let img = Arc::clone(&image);
        Self::map_over(res, Backing::Forked(image), flags, move |base, _| {
            // SAFETY: the reserved range is ours and nothing refers into it.
            unsafe { img.map_at(base) }
        })
    }

    /// Gives the address range back as a [`Reservation`], with fresh, untouched private
    /// anonymous memory mapped over it (what was mapped there is dropped). For memory
    /// mapped into a shell ahead of a fork that no longer needs it. On error the range is
    /// unmapped, as when dropped.
    pub(crate) fn into_reservation(mut self) -> Result<Reservation> {
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        // SAFETY: the range is this memory's own mapping, and it is consumed here: its guest
        // memory regions go with it and nothing else refers into the range.
        unsafe {
            mmap(
                self.base,
                self.len,
                PROT_RW,
                flags | libc::MAP_FIXED,
                -1,
                0,
                "replacing guest memory with reserved address space",
            )
        }?;
        let reservation = Reservation {
            base: self.base,
            len: self.len,
            ranges: std::mem::take(&mut self.ranges),
        };
        self.len = 0;
        Ok(reservation)
    }

    /// Drops this memory a few MiB at a time before unmapping it (see [`zap_gradually`]):
    /// for a mapping a VM moved away from, torn down while the VM runs on.
    pub fn release_gradually(self) {
        zap_gradually(self.base, self.len);
        drop(self);
    }

    /// The old mapping the last [`GuestRam::map_frozen`] moved out of the guest's range, still
    /// to be unmapped (see [`Retired`]).
    pub fn take_retired(&mut self) -> Option<Retired> {
        self.retired.take()
    }

    /// What the memory is made of.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// The host ranges, in guest address order (image order).
    pub fn ranges(&self) -> &[HostRange] {
        &self.ranges
    }

    /// Guest RAM size in bytes.
    pub fn mem_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len as u64).sum()
    }

    /// Host address of the memory image (all ranges, back to back).
    pub fn image_addr(&self) -> usize {
        self.base
    }

    /// The whole memory image, mutable (restoring a snapshot into memory nothing else uses
    /// yet).
    ///
    /// # Safety
    /// Nothing else may access guest memory while the slice lives: no vCPU runs, no device
    /// works, and no other slice of it exists.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn image_mut(&self) -> &mut [u8] {
        // SAFETY: a live PROT_RW mapping of `len` bytes owned by self; exclusivity is the
        // caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.base as *mut u8, self.len) }
    }

    /// Range `i` of the memory image (writing a snapshot).
    ///
    /// # Safety
    /// Nothing may write guest memory while the slice lives (vCPUs and devices paused).
    pub unsafe fn range_slice(&self, i: usize) -> &[u8] {
        let r = &self.ranges[i];
        // SAFETY: inside the live mapping owned by self; no writer exists while the slice
        // lives (the caller's promise).
        unsafe { std::slice::from_raw_parts(r.host_addr as *const u8, r.len) }
    }

    /// The pages the VMM itself wrote through [`GuestRam::mem`] since the last call, one
    /// bitmap per range (KVM dirty-log layout), and clears them.
    pub fn take_vmm_dirty(&self) -> Vec<Vec<u64>> {
        self.mem
            .iter()
            .map(|region| {
                let mmap: &MmapRegion<AtomicBitmap> = region;
                mmap.bitmap().get_and_reset()
            })
            .collect()
    }

    /// Forgets the VMM's writes so far (after restoring a snapshot into this memory).
    pub fn clear_vmm_dirty(&self) {
        for region in self.mem.iter() {
            let mmap: &MmapRegion<AtomicBitmap> = region;
            mmap.bitmap().reset();
        }
    }
}

impl Drop for GuestRam {
    fn drop(&mut self) {
        // Zero once `into_reservation` handed the range on.
        if self.len > 0 {
            munmap(self.base, self.len);
        }
    }
}

/// Creates `mem_bytes` of fresh memfd-backed guest RAM (tests; the VMM reserves first so
/// that memory slots exist before the memory).
#[cfg(test)]
pub fn create(mem_bytes: u64) -> Result<GuestRam> {
    GuestRam::memfd(Reservation::new(mem_bytes)?)
}

/// PSS in KiB of this process's mappings inside `start..end`.
pub fn pss_kib(start: usize, end: usize) -> Result<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").map_err(|source| Error::Io {
        context: "reading /proc/self/smaps",
        source,
    })?;
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a >= start && b <= end;
                continue;
            }
        }
        if inside {
            if let Some(v) = line.strip_prefix("Pss:") {
                total += v
                    .trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .unwrap_or(0);
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::frozen::dirty_runs;
    use super::mapping::RESERVE_ALIGN;
    use super::*;

    /// Freezes `ram` in place, as a VM without a spare shell does.
    fn freeze(ram: &mut GuestRam, dirty: Option<&[Vec<u64>]>) -> Result<Arc<FrozenImage>> {
        let (image, changed) = ram.image_now(dirty)?;
        if !changed {
            return Ok(image);
        }
        ram.map_frozen(image)
    }
    use vm_memory::Bytes;

    #[test]
    fn memory_is_shared_with_the_memfd() {
        let ram = create(64 << 20).unwrap();
        ram.mem
            .write_obj(0x1234_5678u32, GuestAddress(0x1000))
            .unwrap();
        let mut b = [0u8; 4];
        let Backing::Memfd(f) = ram.backing() else {
            panic!("memfd expected")
        };
        f.read_exact_at(&mut b, 0x1000).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0x1234_5678);
        assert_eq!(ram.mem.num_regions(), 1);
    }

    #[test]
    fn vmm_writes_are_tracked_per_page() {
        let ram = create(64 << 20).unwrap();
        ram.mem.write_obj(1u8, GuestAddress(0x3000)).unwrap();
        ram.mem
            .write_slice(&[1; 8192], GuestAddress(0x10000))
            .unwrap();
        let dirty = ram.take_vmm_dirty();
        assert_eq!(dirty.len(), 1);
        assert_eq!(dirty[0][0], (1 << 3) | (1 << 16) | (1 << 17));
        assert!(ram.take_vmm_dirty()[0].iter().all(|&w| w == 0), "reset");
    }

    #[test]
    fn ranges_split_around_the_mmio_gap_with_contiguous_image_offsets() {
        let res = Reservation::new(4 << 30).unwrap();
        let r = res.ranges();
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].guest_addr, r[0].image_offset), (0, 0));
        assert_eq!(r[1].guest_addr, 1 << 32);
        assert_eq!(r[1].image_offset, r[0].len as u64);
        assert_eq!(
            r[1].host_addr,
            r[0].host_addr + r[0].len,
            "one contiguous image"
        );
        let ram = GuestRam::anonymous(res).unwrap();
        assert_eq!(ram.mem_bytes(), 4 << 30);
        ram.mem.write_obj(7u8, GuestAddress((1 << 32) + 5)).unwrap();
        // SAFETY: nothing else uses this memory.
        assert_eq!(unsafe { ram.range_slice(1) }[5], 7);
        // SAFETY: as above.
        assert_eq!(unsafe { ram.image_mut() }[r_len(&ram) + 5], 7);
    }

    fn r_len(ram: &GuestRam) -> usize {
        ram.ranges()[0].len
    }

    #[test]
    fn anonymous_memory_taken_from_a_reservation_holds_no_page() {
        // The `uffd` restore registers it with a page server, which only fills pages that
        // are not there: a page present from the start would never be served.
        let ram = GuestRam::anonymous(Reservation::new(64 << 20).unwrap()).unwrap();
        let start = ram.image_addr();
        assert_eq!(pss_kib(start, start + (64 << 20)).unwrap(), 0);
        ram.mem.write_obj(1u8, GuestAddress(4096)).unwrap();
        assert!(pss_kib(start, start + (64 << 20)).unwrap() >= 4);
    }

    #[test]
    fn file_backing_is_copy_on_write() {
        let dir = std::env::temp_dir().join(format!("clade-mem-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("img");
        let f = File::create(&path).unwrap();
        f.set_len(4096 + (16 << 20)).unwrap();
        f.write_all_at(b"hello", 4096 + 0x2000).unwrap();
        drop(f);
        let f = File::open(&path).unwrap();
        let ram = GuestRam::file_private(Reservation::new(16 << 20).unwrap(), &f, 4096).unwrap();
        let mut b = [0u8; 5];
        ram.mem.read_slice(&mut b, GuestAddress(0x2000)).unwrap();
        assert_eq!(&b, b"hello");
        ram.mem.write_slice(b"HELLO", GuestAddress(0x2000)).unwrap();
        drop(ram);
        let mut b = [0u8; 5];
        File::open(&path)
            .unwrap()
            .read_exact_at(&mut b, 4096 + 0x2000)
            .unwrap();
        assert_eq!(&b, b"hello", "the file is never written");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn read_u64(ram: &GuestRam, addr: u64) -> u64 {
        ram.mem.read_obj(GuestAddress(addr)).unwrap()
    }

    #[test]
    fn frozen_memory_is_shared_copy_on_write_across_generations() {
        let mut parent = create(64 << 20).unwrap();
        parent.mem.write_obj(1u64, GuestAddress(0x1000)).unwrap();
        parent.mem.write_obj(2u64, GuestAddress(0x5000)).unwrap();
        let g1 = freeze(&mut parent, None).unwrap();
        assert_eq!((g1.layers(), g1.mappings()), (1, 1));
        assert_eq!(
            read_u64(&parent, 0x1000),
            1,
            "same contents after the remap"
        );
        let child = GuestRam::forked(Reservation::new(64 << 20).unwrap(), g1.clone()).unwrap();
        assert_eq!(read_u64(&child, 0x1000), 1);
        // Writes on either side stay on that side.
        parent.take_vmm_dirty();
        parent.mem.write_obj(10u64, GuestAddress(0x1000)).unwrap();
        child.mem.write_obj(20u64, GuestAddress(0x5000)).unwrap();
        assert_eq!(read_u64(&parent, 0x5000), 2);
        assert_eq!(read_u64(&child, 0x1000), 1);
        let mut b = [0u8; 8];
        g1.parts()
            .next()
            .unwrap()
            .0
            .read_exact_at(&mut b, 0x1000)
            .unwrap();
        assert_eq!(
            u64::from_le_bytes(b),
            1,
            "the frozen memfd is never written"
        );

        // Second generation: the parent's write becomes a layer.
        let dirty = parent.take_vmm_dirty();
        let g2 = freeze(&mut parent, Some(&dirty)).unwrap();
        assert_eq!((g2.layers(), g2.mappings()), (2, 2));
        let child2 = GuestRam::forked(Reservation::new(64 << 20).unwrap(), g2).unwrap();
        assert_eq!(read_u64(&child2, 0x1000), 10);
        assert_eq!(read_u64(&child2, 0x5000), 2);
        parent.mem.write_obj(11u64, GuestAddress(0x1000)).unwrap();
        assert_eq!(read_u64(&child2, 0x1000), 10);
        assert_eq!(read_u64(&parent, 0x1000), 11);
        // Nothing written since: the same image again.
        let mut c = child;
        let none = vec![vec![0u64; (64 << 20) / 4096 / 64]];
        let g = freeze(&mut c, Some(&none)).unwrap();
        assert!(Arc::ptr_eq(&g, &g1));
        assert!(
            freeze(&mut c, None).is_err(),
            "a forked VM needs its dirty pages"
        );
    }

    #[test]
    fn freezing_moves_the_populated_mapping_aside_instead_of_tearing_it_down() {
        let mut ram = create(64 << 20).unwrap();
        assert_eq!(ram.image_addr() % RESERVE_ALIGN, 0);
        let filled = 16usize << 20;
        for off in (0..filled as u64).step_by(PAGE as usize) {
            ram.mem.write_obj(off ^ 0x5a, GuestAddress(off)).unwrap();
        }
        let (base, len) = (ram.image_addr(), ram.len);
        assert!(pss_kib(base, base + len).unwrap() >= (filled as u64 >> 10));
        freeze(&mut ram, None).unwrap();
        let retired = ram
            .take_retired()
            .expect("mremap(MREMAP_DONTUNMAP) moved the mapping");
        assert_eq!(retired.addr % RESERVE_ALIGN, 0);
        // The filled pages' page tables moved with the old mapping; the guest's range
        // starts empty (each page faults in again from the frozen memfd).
        assert!(
            pss_kib(retired.addr, retired.addr + retired.len).unwrap() >= (filled as u64 >> 10)
        );
        assert_eq!(pss_kib(base, base + len).unwrap(), 0);
        assert!(ram.take_retired().is_none());
        zap_gradually(retired.addr, retired.len);
        assert_eq!(
            pss_kib(retired.addr, retired.addr + retired.len).unwrap(),
            0
        );
        drop(retired);
        for off in (0..filled as u64).step_by(PAGE as usize) {
            assert_eq!(read_u64(&ram, off), off ^ 0x5a);
        }
    }

    #[test]
    fn dirty_runs_merge_neighbours_and_follow_image_offsets() {
        let ranges = [
            HostRange {
                host_addr: 0,
                len: 128 * 4096,
                guest_addr: 0,
                image_offset: 0,
            },
            HostRange {
                host_addr: 0,
                len: 64 * 4096,
                guest_addr: 1 << 32,
                image_offset: 128 * 4096,
            },
        ];
        let dirty = vec![vec![0b1110, 1 << 63], vec![1]];
        assert_eq!(
            dirty_runs(&ranges, &dirty),
            vec![(4096, 3 * 4096), (127 * 4096, 2 * 4096)]
        );
    }

    #[test]
    fn host_memory_is_known() {
        assert!(host_mem_mib().unwrap() > 0);
    }
}
