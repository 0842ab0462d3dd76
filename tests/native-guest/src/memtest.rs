//! Guest-memory steps for snapshot tests: fill a range with a pattern, checksum it, or keep
//! rewriting it.
//!
//! The range starts at [`FILL_BASE`] (64 MiB, above everything the VMM and this image
//! place) and must end inside the RAM the e820 map in the zero page reports below 4 GiB
//! (the identity map the VMM sets up covers 4 GiB).

use core::ptr::{read_volatile, write_volatile};
use core::sync::atomic::{AtomicU64, Ordering};

/// First byte of the range the steps work on.
pub const FILL_BASE: u64 = 64 << 20;

/// Mailbox words the host writes (fork tests): slot `n` at `MBOX_BASE + 8 * n`, in the
/// page below [`FILL_BASE`] (nothing else uses it).
pub const MBOX_BASE: u64 = FILL_BASE - 4096;
const MBOX_SLOTS: u64 = 512;
/// The value the last `mbox` step read.
static MBOX_SEED: AtomicU64 = AtomicU64::new(0);

/// Waits until mailbox slot `n` is non-zero; returns it and keeps it as the seed of
/// `memfill:mbox:MIB`.
pub fn mbox_wait(n: u64) -> Result<u64, &'static str> {
    if n >= MBOX_SLOTS {
        return Err("mailbox slot out of range");
    }
    loop {
        // SAFETY: the mailbox page is RAM (below FILL_BASE), identity-mapped.
        let v = unsafe { read_volatile((MBOX_BASE + 8 * n) as *const u64) };
        if v != 0 {
            MBOX_SEED.store(v, Ordering::Relaxed);
            return Ok(v);
        }
        core::hint::spin_loop();
    }
}

/// The seed the last `mbox` step read.
pub fn mbox_seed() -> u64 {
    MBOX_SEED.load(Ordering::Relaxed)
}

/// End of usable RAM below 4 GiB, from the e820 map.
static RAM_END: AtomicU64 = AtomicU64::new(0);
/// Largest range filled so far, in bytes (what `memsum` covers).
static FILLED: AtomicU64 = AtomicU64::new(0);

/// boot_params offsets: e820 entry count (u8) and table (20-byte entries).
const E820_ENTRIES: u64 = 0x1e8;
const E820_TABLE: u64 = 0x2d0;
const E820_MAX: u64 = 128;
const E820_RAM: u32 = 1;

/// Reads the e820 map the VMM put in the zero page.
///
/// # Safety
/// `boot_params` must be 0 or the address of a readable zero page.
pub unsafe fn init(boot_params: u64) {
    if boot_params == 0 {
        return;
    }
    let n = u64::from(read_volatile((boot_params + E820_ENTRIES) as *const u8)).min(E820_MAX);
    let mut end = 0;
    for i in 0..n {
        let e = boot_params + E820_TABLE + i * 20;
        let addr = read_volatile(e as *const u64);
        let size = read_volatile((e + 8) as *const u64);
        let kind = read_volatile((e + 16) as *const u32);
        let top = addr.saturating_add(size);
        if kind == E820_RAM && addr <= FILL_BASE && top > end && top <= 1 << 32 {
            end = top;
        }
    }
    RAM_END.store(end, Ordering::Relaxed);
}

fn check(bytes: u64) -> Result<(), &'static str> {
    let end = RAM_END.load(Ordering::Relaxed);
    if bytes == 0 || FILL_BASE.checked_add(bytes).is_none_or(|e| e > end) {
        return Err("range past the end of RAM");
    }
    Ok(())
}

fn pattern(seed: u64, addr: u64) -> u64 {
    (addr ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

/// Writes the pattern for `seed` over `mib` MiB from [`FILL_BASE`].
pub fn fill(seed: u64, mib: u64) -> Result<(), &'static str> {
    let bytes = mib << 20;
    check(bytes)?;
    let mut a = FILL_BASE;
    while a < FILL_BASE + bytes {
        // SAFETY: inside RAM (checked) and identity-mapped; nothing else lives there.
        unsafe { write_volatile(a as *mut u64, pattern(seed, a)) };
        a += 8;
    }
    FILLED.fetch_max(bytes, Ordering::Relaxed);
    Ok(())
}

/// An FNV-1a-style hash over the words of the largest range filled so far; `(MiB
/// covered, hash)`.
pub fn sum() -> (u64, u64) {
    let bytes = FILLED.load(Ordering::Relaxed);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut a = FILL_BASE;
    while a < FILL_BASE + bytes {
        // SAFETY: filled before, so inside RAM.
        h ^= unsafe { read_volatile(a as *const u64) };
        h = h.wrapping_mul(0x100_0000_01b3);
        h ^= h >> 32;
        a += 8;
    }
    (bytes >> 20, h)
}

/// Rewrites `mib` MiB from [`FILL_BASE`] forever, one word per page per pass (every page
/// is dirtied on each pass): a guest that keeps dirtying memory, for snapshot benchmarks.
pub fn churn(mib: u64) -> Result<(), &'static str> {
    let bytes = mib << 20;
    check(bytes)?;
    FILLED.fetch_max(bytes, Ordering::Relaxed);
    let mut pass = 0u64;
    loop {
        pass += 1;
        let mut a = FILL_BASE;
        while a < FILL_BASE + bytes {
            // SAFETY: inside RAM (checked).
            unsafe { write_volatile(a as *mut u64, pass) };
            a += 4096;
        }
    }
}
