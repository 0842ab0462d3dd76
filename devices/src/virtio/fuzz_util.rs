//! Helpers of the bounded fuzz tests (test builds only): a seeded PRNG, the input count from
//! the environment, and a check that a device wrote guest memory only where the guest let
//! it (pages recorded in the guest memory's dirty bitmap, which every device write goes
//! through).

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion, MmapRegion};

use crate::GuestMemory;

/// xorshift64*: deterministic pseudo-random numbers (the same generator as the other fuzz
/// tests of the workspace). Shared borrows suffice, so `rng.pick(&[a, rng.next()])` works.
pub(crate) struct Rng(std::cell::Cell<u64>);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(std::cell::Cell::new(seed | 1))
    }
    pub(crate) fn next(&self) -> u64 {
        let mut x = self.0.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn chance(&self, percent: u64) -> bool {
        self.below(100) < percent
    }
    /// One of `items`.
    pub(crate) fn pick<T: Copy>(&self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// Inputs per fuzz test: `CLADE_FUZZ_ROUNDS` if set (every fuzz test of the workspace reads
/// it), else `default` (sized for a few seconds in CI).
pub(crate) fn rounds(default: usize) -> usize {
    std::env::var("CLADE_FUZZ_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const PAGE: u64 = 4096;

/// Forgets the writes so far (the test's own setup).
pub(crate) fn clear_dirty(mem: &GuestMemory) {
    for region in mem.iter() {
        let mmap: &MmapRegion<_> = region;
        mmap.bitmap().reset();
    }
}

/// Guest pages written since [`clear_dirty`], as guest addresses.
pub(crate) fn dirty_pages(mem: &GuestMemory) -> Vec<u64> {
    let mut out = Vec::new();
    for region in mem.iter() {
        let base = region.start_addr().0;
        let mmap: &MmapRegion<_> = region;
        for (w, word) in mmap.bitmap().get_and_reset().into_iter().enumerate() {
            for bit in 0..64 {
                if word & (1 << bit) != 0 {
                    out.push(base + (w as u64 * 64 + bit) * PAGE);
                }
            }
        }
    }
    out
}

/// Byte ranges `(addr, len)` the device may write: every device-writable descriptor that
/// can be parsed at any byte offset of `areas` (descriptor tables, indirect tables), so a
/// device following any next pointer or indirect table built there stays inside them. Only
/// the first `clip` bytes of a descriptor count (what the device can put in one buffer),
/// plus, with `last_byte`, its last byte (virtio-blk's status byte): a guest's 4 GiB
/// buffer must not excuse a write anywhere.
pub(crate) fn writable_ranges(
    mem: &GuestMemory,
    areas: &[(u64, u64)],
    clip: u64,
    last_byte: bool,
) -> Vec<(u64, u64)> {
    use vm_memory::Bytes;
    let mut out = Vec::new();
    for &(start, len) in areas {
        let mut b = vec![0u8; len as usize + 16];
        let _ = mem.read_slice(&mut b[..len as usize], GuestAddress(start));
        for off in 0..len as usize {
            let d = &b[off..off + 16];
            let flags = u16::from_le_bytes([d[12], d[13]]);
            if flags & virtio_bindings::virtio_ring::VRING_DESC_F_WRITE as u16 == 0 {
                continue;
            }
            let addr = u64::from_le_bytes(d[0..8].try_into().unwrap_or([0; 8]));
            let n = u32::from_le_bytes(d[8..12].try_into().unwrap_or([0; 4]));
            if n > 0 {
                out.push((addr, u64::from(n).min(clip)));
                if last_byte {
                    out.push((addr.saturating_add(u64::from(n) - 1), 1));
                }
            }
        }
    }
    out
}

/// Asserts every dirty page since [`clear_dirty`] overlaps one of `allowed` (byte ranges);
/// returns how many pages were checked.
pub(crate) fn assert_writes_within(mem: &GuestMemory, allowed: &[(u64, u64)], what: &str) -> usize {
    let pages = dirty_pages(mem);
    for &page in &pages {
        let ok = allowed.iter().any(|&(a, n)| {
            let end = a.saturating_add(n);
            a < page + PAGE && end > page
        });
        assert!(ok, "{what}: the device wrote guest page {page:#x}, which no writable buffer or used ring covers");
    }
    pages.len()
}
