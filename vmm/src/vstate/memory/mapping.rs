//! The raw mappings under guest memory: `mmap`/`munmap` with errors that say what failed,
//! address space reserved on a 2 MiB boundary, and the populated mappings a freeze moves
//! out of the guest's range ([`Retired`]) to be torn down later, a step at a time, off the
//! paused VM's path. Apart from `mod.rs` so that the system calls that make, replace or
//! move mappings, with their safety contracts, are in one place.

use crate::error::{Error, Result};

/// `mmap` with an error naming what failed.
///
/// # Safety
/// With `MAP_FIXED`, `addr..addr + len` must be a range this process owns and holds no
/// references into (it is replaced).
pub(super) unsafe fn mmap(
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

pub(super) fn munmap(addr: usize, len: usize) {
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
///
/// [`GuestRam::map_frozen`]: super::GuestRam::map_frozen
pub(super) const RESERVE_ALIGN: usize = 2 << 20;

/// `len` bytes of fresh private anonymous address space (`prot`: its access), starting on
/// a [`RESERVE_ALIGN`] boundary.
pub(super) fn reserve_aligned(len: usize, prot: i32, what: &str) -> Result<usize> {
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
///
/// [`GuestRam::map_frozen`]: super::GuestRam::map_frozen
#[derive(Debug)]
pub struct Retired {
    pub(super) addr: usize,
    pub(super) len: usize,
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
pub(super) fn zap_gradually(addr: usize, len: usize) {
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
    pub(super) unsafe fn restore_to(self, addr: usize) {
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
pub(super) unsafe fn retire(addr: usize, len: usize) -> Option<Retired> {
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
