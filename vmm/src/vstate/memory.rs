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

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use snapshot::memory_file::MemoryChain;
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegion;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestRegionMmap};

pub use devices::GuestMemory;

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

/// `mmap` with an error naming what failed.
///
/// # Safety
/// With `MAP_FIXED`, `addr..addr + len` must be a range this process owns and holds no
/// references into (it is replaced).
unsafe fn mmap(
    addr: usize,
    len: usize,
    prot: i32,
    flags: i32,
    fd: i32,
    offset: u64,
    what: &str,
) -> Result<usize> {
    let offset = libc::off_t::try_from(offset)
        .map_err(|_| Error::Memory(format!("{what}: offset {offset:#x} too large")))?;
    // SAFETY: the caller guarantees a fixed range is ours to replace; otherwise the kernel
    // picks a fresh range and nothing existing is affected.
    let p = unsafe { libc::mmap(addr as *mut libc::c_void, len, prot, flags, fd, offset) };
    if p == libc::MAP_FAILED {
        return Err(Error::Memory(format!(
            "{what}: mmap of {len} bytes: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(p as usize)
}

fn munmap(addr: usize, len: usize) {
    // SAFETY: only called on ranges this module mapped and owns, when nothing refers to
    // them any more.
    if unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
        tracing::warn!(
            "munmap {addr:#x}+{len:#x}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Alignment of reserved guest address space: a page-table page (PMD) covers 2 MiB, so
/// the kernel can move a whole one at a time ([`GuestRam::map_frozen`]) instead of page by
/// page.
const RESERVE_ALIGN: usize = 2 << 20;

/// `len` bytes of fresh private anonymous address space (`prot`: its access), starting on
/// a [`RESERVE_ALIGN`] boundary.
fn reserve_aligned(len: usize, prot: i32, what: &str) -> Result<usize> {
    let padded = len
        .checked_add(RESERVE_ALIGN)
        .ok_or_else(|| Error::Memory(format!("{what}: {len} bytes do not fit this host")))?;
    // SAFETY: not MAP_FIXED: a fresh range.
    let start = unsafe {
        mmap(
            0,
            padded,
            prot,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
            what,
        )
    }?;
    let base = start.next_multiple_of(RESERVE_ALIGN);
    // The padding before and after the aligned range is ours (just mapped) and unused.
    if base > start {
        munmap(start, base - start);
    }
    let tail = start + padded - (base + len);
    if tail > 0 {
        munmap(base + len, tail);
    }
    Ok(base)
}

/// A populated guest memory mapping taken out of the guest's address range by
/// [`GuestRam::map_frozen`] (its page tables moved here, not torn down): unmapping it costs
/// in proportion to the pages it held, so it happens off the paused VM's critical path,
/// in a thread of its own ([`Retired::unmap_in_background`]) or when dropped.
#[derive(Debug)]
pub struct Retired {
    addr: usize,
    len: usize,
}

impl Retired {
    /// Unmaps it in a short-lived thread at idle priority, after [`TEARDOWN_GRACE`] (or
    /// here, if no thread can be started).
    pub fn unmap_in_background(self) {
        let (addr, len) = (self.addr, self.len);
        std::mem::forget(self);
        let spawned = std::thread::Builder::new()
            .name("clade-unmap".into())
            .spawn(move || {
                crate::vstate::spare::run_at_idle_priority("unmapping a retired guest mapping");
                std::thread::sleep(TEARDOWN_GRACE);
                let t = std::time::Instant::now();
                zap_gradually(addr, len);
                munmap(addr, len);
                tracing::debug!(
                    "retired guest mapping of {len} bytes unmapped in {:?}",
                    t.elapsed()
                );
            });
        if let Err(e) = spawned {
            tracing::warn!("no thread to unmap a retired guest mapping ({e}): unmapping here");
            munmap(addr, len);
        }
    }
}

/// How long a mapping a VM moved away from is kept before its teardown starts: right
/// after a fork the children and the parent need every CPU for their first requests, and
/// the teardown (~0.1 ms per MiB the guest had touched) interrupts every VM of the process
/// and takes its address-space lock a step at a time, which even at idle priority delays
/// their page faults. It holds no guest memory meanwhile (the pages belong to the frozen
/// image), only page tables. Measured with `clade bench fork --mem 1G -n 100` (480 MiB
/// touched): starting at once, it took ~20% of the CPU time until the 100 children answered.
pub(crate) const TEARDOWN_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

/// Pages dropped per step by [`zap_gradually`].
const ZAP_STEP: usize = 4 << 20;

/// Drops the pages of `addr..addr + len` a few MiB at a time with `MADV_DONTNEED`, which
/// needs the address space lock only shared and only for one step: a single `munmap` of a
/// large populated mapping holds it for the whole teardown, and the running VM's page
/// faults (and every `mmap` of the process) queue behind it.
fn zap_gradually(addr: usize, len: usize) {
    let mut off = 0;
    while off < len {
        let n = ZAP_STEP.min(len - off);
        // SAFETY: a range of a retired mapping this module owns and nothing refers into;
        // MADV_DONTNEED only drops its pages (they are refaulted from the memfd if touched).
        if unsafe { libc::madvise((addr + off) as *mut libc::c_void, n, libc::MADV_DONTNEED) } != 0
        {
            return;
        }
        off += n;
        std::thread::yield_now();
    }
}

impl Retired {
    /// Moves the retired mapping back over `addr..addr + len` (undoing a freeze that failed
    /// after moving it aside).
    ///
    /// # Safety
    /// `addr..addr + len` must be the range it was moved from, owned by the caller with no
    /// references into it.
    unsafe fn restore_to(self, addr: usize) {
        let (from, len) = (self.addr, self.len);
        std::mem::forget(self);
        // SAFETY: both ranges are ours (the caller's promise for `addr`).
        if let Err(e) = unsafe { move_mapping(from, len, addr, 0) } {
            tracing::error!("putting guest memory back after a failed freeze: {e}");
            munmap(from, len);
        }
    }
}

impl Drop for Retired {
    fn drop(&mut self) {
        munmap(self.addr, self.len);
    }
}

/// Moves the mapping at `addr..addr + len` (2 MiB aligned) to fresh address space with
/// `mremap(MREMAP_DONTUNMAP)`: its page tables move (a 2 MiB table at a time), the range
/// keeps its (now empty) mapping of the same file, so nothing else can land there, and
/// whatever touched it next would fault the same pages in again. `None` when the kernel
/// cannot (before Linux 5.13, or a mapping it refuses): the caller then replaces the
/// mapping in place and pays the teardown itself.
///
/// # Safety
/// `addr..addr + len` must be one mapping this process owns; nothing may access it until
/// the caller maps over it.
unsafe fn retire(addr: usize, len: usize) -> Option<Retired> {
    let to = reserve_aligned(
        len,
        libc::PROT_NONE,
        "reserving address space for a retired mapping",
    )
    .ok()?;
    // SAFETY: `addr..addr + len` is the caller's mapping; `to..to + len` was just reserved
    // by us. The source range stays mapped (DONTUNMAP).
    if let Err(e) = unsafe { move_mapping(addr, len, to, libc::MREMAP_DONTUNMAP) } {
        tracing::debug!("mremap(MREMAP_DONTUNMAP) of guest memory: {e}; replacing it in place");
        munmap(to, len);
        return None;
    }
    Some(Retired { addr: to, len })
}

/// `mremap` of `from..from + len` onto `to..to + len` (replaced), with `extra` flags.
///
/// # Safety
/// Both ranges must be address space this process owns and holds no references into
/// (but what the caller remaps on purpose).
unsafe fn move_mapping(from: usize, len: usize, to: usize, extra: i32) -> std::io::Result<()> {
    // SAFETY: the caller's promise; MREMAP_FIXED replaces only `to..to + len`.
    let p = unsafe {
        libc::mremap(
            from as *mut libc::c_void,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED | extra,
            to as *mut libc::c_void,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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

/// One layer of a [`FrozenImage`]: a file nobody writes any more (a memfd, or a snapshot's
/// memory file), and the runs of the memory image it provides (image offset `o` is at file
/// offset `file_offset + o`).
#[derive(Debug)]
pub struct FrozenLayer {
    file: Arc<File>,
    /// Where the memory image starts in the file (page-aligned).
    file_offset: u64,
    /// `(image offset, length)`, page-aligned, sorted, not overlapping.
    runs: Vec<(u64, u64)>,
}

impl FrozenLayer {
    /// The layers of a snapshot's memory: the full file's whole image, then each diff's
    /// pages.
    fn of_snapshot(chain: &MemoryChain) -> Result<Vec<FrozenLayer>> {
        let mem = chain.mem_size();
        let mut layers = Vec::with_capacity(chain.layers().len());
        for f in chain.layers() {
            let runs = match f.present_pages() {
                None => vec![(0, mem)],
                Some(bm) => bm.runs().map(|(p, n)| (p * PAGE, n * PAGE)).collect(),
            };
            if runs.is_empty() {
                continue;
            }
            let file = f
                .file()
                .try_clone()
                .map_err(|e| Error::Memory(format!("duplicating a snapshot memory fd: {e}")))?;
            layers.push(FrozenLayer {
                file: Arc::new(file),
                file_offset: f.header().data_offset,
                runs,
            });
        }
        Ok(layers)
    }
}

/// A read-only view of a VM's memory image at the moment it was frozen (a fork, a
/// copy-on-write snapshot): layer 0 covers the whole image (a memfd, or the full memory
/// file of the snapshot the VM was restored from), each later layer the pages written
/// between two freezes (or a diff's pages). Every VM that runs on it maps the layers
/// `MAP_PRIVATE` in order, so pages stay shared (page cache of the files) until one of
/// them writes a page. Nothing writes the files: a snapshot's must stay as they are while
/// a VM maps them (as for the `file` backend).
#[derive(Debug)]
pub struct FrozenImage {
    layers: Vec<FrozenLayer>,
    mem_bytes: u64,
}

/// One layer of a [`FrozenImage`] as handed between processes: its file, where the image
/// starts in it, and its runs `(image offset, length)`.
pub type LayerParts = (File, u64, Vec<(u64, u64)>);

/// The layers [`GuestRam::restored_layers`] prepared ([`RestoredLayers::into_image`]).
#[derive(Debug)]
pub struct RestoredLayers(Vec<FrozenLayer>);

impl RestoredLayers {
    /// The frozen image of `mem_bytes` of guest memory these layers make.
    pub fn into_image(self, mem_bytes: u64) -> Arc<FrozenImage> {
        Arc::new(FrozenImage {
            layers: self.0,
            mem_bytes,
        })
    }
}

/// Most layers (fork generations with writes in between) a frozen image may have; each
/// adds mappings (one per run of written pages) to every VM that maps it.
pub const MAX_FROZEN_LAYERS: usize = 64;

impl FrozenImage {
    /// Layers, base first.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Mappings a VM on this image has (one per run per layer).
    pub fn mappings(&self) -> usize {
        self.layers.iter().map(|l| l.runs.len()).sum()
    }

    /// The layers' files, where the image starts in each, and their runs, base first
    /// (handing the image to another process, writing it to a snapshot).
    pub fn parts(&self) -> impl Iterator<Item = (&File, u64, &[(u64, u64)])> {
        self.layers
            .iter()
            .map(|l| (&*l.file, l.file_offset, &l.runs[..]))
    }

    /// An image from its parts (received from another process).
    pub fn from_parts(parts: Vec<LayerParts>, mem_bytes: u64) -> Result<Self> {
        let layers = parts
            .into_iter()
            .map(|(f, file_offset, runs)| FrozenLayer {
                file: Arc::new(f),
                file_offset,
                runs,
            })
            .collect::<Vec<_>>();
        if layers.len() > MAX_FROZEN_LAYERS {
            return Err(Error::Memory(format!(
                "a frozen image of {} layers (at most {MAX_FROZEN_LAYERS})",
                layers.len()
            )));
        }
        for l in &layers {
            if l.file_offset % PAGE != 0 {
                return Err(Error::Memory(format!(
                    "frozen image layer at file offset {:#x}: not page-aligned",
                    l.file_offset
                )));
            }
            for &(o, n) in &l.runs {
                if o % PAGE != 0 || n % PAGE != 0 || o.checked_add(n).is_none_or(|e| e > mem_bytes)
                {
                    return Err(Error::Memory(format!(
                        "frozen image run {o:#x}+{n:#x} outside a {mem_bytes}-byte image"
                    )));
                }
            }
        }
        if layers.first().map(|l| &l.runs[..]) != Some(&[(0, mem_bytes)][..]) {
            return Err(Error::Memory(
                "frozen image: the first layer must cover all of memory".into(),
            ));
        }
        Ok(FrozenImage { layers, mem_bytes })
    }

    /// A one-layer image with a private copy of all of this image's memory (a fork by full
    /// copy: the baseline a copy-on-write fork is measured against).
    pub fn deep_copy(&self) -> Result<FrozenImage> {
        use std::os::unix::fs::FileExt;
        let copy = memfd("clade-frozen-copy", self.mem_bytes)?;
        let mut buf = vec![0u8; 1 << 20];
        for l in &self.layers {
            for &(off, len) in &l.runs {
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(buf.len() as u64) as usize;
                    l.file
                        .read_exact_at(&mut buf[..n], l.file_offset + off + done)
                        .and_then(|()| copy.write_all_at(&buf[..n], off + done))
                        .map_err(|e| Error::Memory(format!("copying a frozen image: {e}")))?;
                    done += n as u64;
                }
            }
        }
        FrozenImage::from_parts(vec![(copy, 0, vec![(0, self.mem_bytes)])], self.mem_bytes)
    }

    /// Maps every layer, private, over `base..base + mem_bytes`.
    ///
    /// # Safety
    /// The range must be address space this process owns and holds no references into.
    unsafe fn map_at(&self, base: usize) -> Result<()> {
        for l in &self.layers {
            // SAFETY: the caller's promise; the runs lie inside the range (checked when
            // the image was built).
            unsafe { map_runs(base, l) }?;
        }
        Ok(())
    }
}

/// Maps `runs` of `file` private and fixed at `base + offset`.
///
/// # Safety
/// As for [`FrozenImage::map_at`].
unsafe fn map_runs(base: usize, layer: &FrozenLayer) -> Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE | libc::MAP_FIXED;
    for &(off, len) in &layer.runs {
        // SAFETY: the caller's promise.
        unsafe {
            mmap(
                base + off as usize,
                len as usize,
                PROT_RW,
                flags,
                layer.file.as_raw_fd(),
                layer.file_offset + off,
                "mapping a frozen fork image",
            )
        }?;
    }
    Ok(())
}

/// Runs of set bits in per-range dirty bitmaps, as `(image offset, length)`.
pub fn dirty_runs(ranges: &[HostRange], dirty: &[Vec<u64>]) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (r, bits) in ranges.iter().zip(dirty) {
        let pages = r.len as u64 / PAGE;
        for (wi, &w) in bits.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let p = wi as u64 * 64 + u64::from(w.trailing_zeros());
                w &= w - 1;
                if p >= pages {
                    break;
                }
                let off = r.image_offset + p * PAGE;
                match runs.last_mut() {
                    Some((o, n)) if *o + *n == off => *n += PAGE,
                    _ => runs.push((off, PAGE)),
                }
            }
        }
    }
    runs
}

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

    /// Freezing, first half: the frozen image of this memory as it is now, made without
    /// touching its mapping, and whether it differs from the image the memory runs on
    /// (false: nothing was written since the last freeze, the memory already is that
    /// image). Call with the vCPUs and devices paused. [`GuestRam::map_frozen`] then maps
    /// it in place, or the VM moves onto a new mapping of it (`Vm::move_onto`).
    ///
    /// - memfd memory (booted VM): the memfd becomes the frozen base. No page is copied.
    /// - memory forked before: the pages written since (`dirty`, KVM's log and the VMM's
    ///   writes, one bitmap per range) are copied into a new memfd, a new layer on top of
    ///   the previous frozen image. Costs in proportion to the pages written, not to memory.
    ///
    /// Memory restored from a snapshot (the `uffd` and `file` backends) freezes with
    /// [`GuestRam::restored_layers`] instead.
    pub fn image_now(&self, dirty: Option<&[Vec<u64>]>) -> Result<(Arc<FrozenImage>, bool)> {
        match &self.backing {
            Backing::Memfd(file) => {
                let file =
                    Arc::new(file.try_clone().map_err(|e| {
                        Error::Memory(format!("duplicating the guest memory fd: {e}"))
                    })?);
                let layers = vec![FrozenLayer {
                    file,
                    file_offset: 0,
                    runs: vec![(0, self.len as u64)],
                }];
                Ok((
                    Arc::new(FrozenImage {
                        layers,
                        mem_bytes: self.len as u64,
                    }),
                    true,
                ))
            }
            Backing::Forked(prev) => {
                let dirty = dirty.ok_or_else(|| {
                    Error::Memory(
                        "forking again needs the pages written since the last fork (dirty \
                         page tracking is off)"
                            .into(),
                    )
                })?;
                let runs = dirty_runs(&self.ranges, dirty);
                if runs.is_empty() {
                    return Ok((Arc::clone(prev), false));
                }
                if prev.layers.len() >= MAX_FROZEN_LAYERS {
                    return Err(Error::Memory(format!(
                        "this VM's memory has {} fork layers (at most {MAX_FROZEN_LAYERS}): \
                         snapshot it and restore with the copy backend to start a new line",
                        prev.layers.len()
                    )));
                }
                let mut layers: Vec<FrozenLayer> = prev
                    .layers
                    .iter()
                    .map(|l| FrozenLayer {
                        file: Arc::clone(&l.file),
                        file_offset: l.file_offset,
                        runs: l.runs.clone(),
                    })
                    .collect();
                layers.push(self.copy_to_layer(runs)?);
                Ok((
                    Arc::new(FrozenImage {
                        layers,
                        mem_bytes: self.len as u64,
                    }),
                    true,
                ))
            }
            Backing::Anonymous | Backing::FilePrivate => Err(Error::Memory(
                "memory restored from a snapshot freezes with the snapshot it came from".into(),
            )),
        }
    }

    /// The first half of freezing memory restored from a snapshot (the `uffd` and `file`
    /// backends), written only where `dirty` says since it matched the snapshot whose
    /// memory files are `chain`: the layers of its frozen image — those files (the full
    /// one, each diff's pages over it) and the written pages copied into a layer on top.
    /// Changes nothing: [`GuestRam::map_frozen`] then maps them. Call with the vCPUs and
    /// devices paused (a page server may still run: the written pages are present).
    pub fn restored_layers(
        &self,
        chain: &MemoryChain,
        dirty: &[Vec<u64>],
    ) -> Result<RestoredLayers> {
        if !matches!(self.backing, Backing::Anonymous | Backing::FilePrivate) {
            return Err(Error::Memory(
                "only memory restored from a snapshot freezes with the snapshot".into(),
            ));
        }
        if chain.mem_size() != self.len as u64 {
            return Err(Error::Memory(format!(
                "a snapshot of {} bytes for {} bytes of guest memory",
                chain.mem_size(),
                self.len
            )));
        }
        let mut layers = FrozenLayer::of_snapshot(chain)?;
        let runs = dirty_runs(&self.ranges, dirty);
        if !runs.is_empty() {
            layers.push(self.copy_to_layer(runs)?);
        }
        if layers.len() > MAX_FROZEN_LAYERS {
            return Err(Error::Memory(format!(
                "a snapshot chain of {} memory files with the pages written since makes \
                 {} layers (at most {MAX_FROZEN_LAYERS})",
                chain.layers().len(),
                layers.len()
            )));
        }
        Ok(RestoredLayers(layers))
    }

    /// Freezing in place, second half: makes `image` (from [`GuestRam::image_now`] or
    /// [`RestoredLayers::into_image`]) this memory, at the same addresses; the VM runs on
    /// it from now on, copy-on-write. Forked memory maps the image's top layer (the pages
    /// written since) over itself (its private copies are freed and shared from then on).
    /// Any other is mapped over whole, private (KVM's memory slots keep pointing at it;
    /// its MMU notifiers drop KVM's mappings of every touched page, the part of the cost
    /// that grows with what the guest touched); its old mapping is not torn down here: its
    /// page tables are moved aside ([`Retired`], unmapped later off the pause). Call paused; for
    /// memory restored from a snapshot, with the page server stopped (the pages it never
    /// installed were never written: they come from the files). On an error the memory is
    /// as before (without the pages a stopped page server never installed).
    pub fn map_frozen(&mut self, image: Arc<FrozenImage>) -> Result<Arc<FrozenImage>> {
        if let Backing::Forked(_) = self.backing {
            if let Some(layer) = image.layers.last() {
                // SAFETY: our own live mapping, which nothing writes while paused: the
                // written runs are replaced by mappings of their copies (same contents).
                unsafe { map_runs(self.base, layer) }?;
            }
            self.backing = Backing::Forked(Arc::clone(&image));
            return Ok(image);
        }
        self.remap_frozen(image)
    }

    /// Drops this memory a few MiB at a time before unmapping it (see [`zap_gradually`]):
    /// for a mapping a VM moved away from, torn down while the VM runs on.
    pub fn release_gradually(self) {
        zap_gradually(self.base, self.len);
        drop(self);
    }

    /// A new memfd layer holding `runs` of this memory as they are now.
    fn copy_to_layer(&self, runs: Vec<(u64, u64)>) -> Result<FrozenLayer> {
        let layer = memfd("clade-fork-layer", self.len as u64)?;
        for &(off, len) in &runs {
            // SAFETY: inside our live mapping; nothing writes it while paused.
            let data = unsafe {
                std::slice::from_raw_parts((self.base + off as usize) as *const u8, len as usize)
            };
            layer.write_all_at(data, off).map_err(|e| {
                Error::Memory(format!("copying written pages to a fork layer: {e}"))
            })?;
        }
        Ok(FrozenLayer {
            file: Arc::new(layer),
            file_offset: 0,
            runs,
        })
    }

    /// Makes `layers` the whole of this memory: the current mapping is moved aside (see
    /// [`Retired`]) and the layers are mapped private over the same addresses.
    fn remap_frozen(&mut self, image: Arc<FrozenImage>) -> Result<Arc<FrozenImage>> {
        // SAFETY: our own live mapping, which nothing accesses while paused; it is
        // mapped over right below.
        let retired = unsafe { retire(self.base, self.len) };
        // SAFETY: our own live mapping, replaced by a mapping of the same contents
        // (nothing writes guest memory while paused); references into it stay valid.
        // On an error (a partial mapping) the old contents are gone from the range: the
        // retired mapping is put back whole when there is one.
        if let Err(e) = unsafe { image.map_at(self.base) } {
            if let Some(r) = retired {
                // SAFETY: the retired mapping is ours and moves back over our own range.
                unsafe { r.restore_to(self.base) };
            }
            return Err(e);
        }
        self.backing = Backing::Forked(Arc::clone(&image));
        self.retired = retired;
        Ok(image)
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
