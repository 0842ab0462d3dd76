//! Leaving pages the balloon gave back out of snapshots and forks.
//!
//! The dirty log says which pages changed since the last snapshot; a page the guest wrote
//! and then freed (and reported, so the balloon discarded it) is in it, yet what it holds
//! now is nothing the guest needs: zero, or the file or frozen layer under a private
//! mapping. Copying it into a diff snapshot or a fork layer would cost as much as a page
//! the guest uses. So a page that is both dirty and discarded is left out, unless the guest
//! touched it again after the discard: `/proc/self/pagemap` tells. A page that is not in
//! this process's page tables (neither present nor swapped) reads as what lies under the
//! mapping; so does, in a private mapping, a present page of the file under it (not a
//! private copy: the guest only read it since). Leaving such a page out of a diff or a fork
//! layer makes it read as the layer below, which is as good for a free page. Any other page
//! (a private copy, a page of a shared mapping) may hold what the guest wrote after the
//! discard and is kept. If the page table cannot be read, every page is kept.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::vstate::memory::{HostRange, PAGE};

/// pagemap: the page is present in RAM.
const PM_PRESENT: u64 = 1 << 63;
/// pagemap: the page is swapped out.
const PM_SWAPPED: u64 = 1 << 62;
/// pagemap: a page of a file (or shared anonymous memory), not a private anonymous one.
const PM_FILE: u64 = 1 << 61;

/// Whether each of `n` pages from host address `addr` may hold something written since it
/// was discarded (see the module documentation; `private`: the mapping is `MAP_PRIVATE`).
fn written_pages(
    pagemap: &File,
    addr: usize,
    n: usize,
    private: bool,
) -> std::io::Result<Vec<bool>> {
    let mut buf = vec![0u8; n * 8];
    pagemap.read_exact_at(&mut buf, (addr as u64 / PAGE) * 8)?;
    Ok(buf
        .chunks_exact(8)
        .map(|e| {
            let v = u64::from_le_bytes(e.try_into().unwrap_or([0xff; 8]));
            let file_page = v & PM_PRESENT != 0 && v & PM_FILE != 0;
            v & (PM_PRESENT | PM_SWAPPED) != 0 && !(private && file_page)
        })
        .collect())
}

/// Clears from `dirty` (and from `carry`, a forked VM's pages written since its last
/// freeze, when not empty) every page of `discarded` that is not mapped again since (see
/// the module documentation; `private`: guest memory is mapped `MAP_PRIVATE`). All are
/// bitmaps per range of `ranges`, in the KVM dirty-log layout. Returns how many dirty pages
/// were left out.
pub(super) fn leave_out_discarded(
    ranges: &[HostRange],
    private: bool,
    discarded: &[Vec<u64>],
    dirty: &mut [Vec<u64>],
    carry: &mut [Vec<u64>],
) -> u64 {
    if discarded.iter().flatten().all(|&w| w == 0) {
        return 0;
    }
    let pagemap = match File::open("/proc/self/pagemap") {
        Ok(f) => f,
        Err(e) => {
            tracing::debug!("balloon: /proc/self/pagemap: {e}; discarded pages are copied");
            return 0;
        }
    };
    let mut left_out = 0;
    for (i, (r, disc)) in ranges.iter().zip(discarded).enumerate() {
        for (w, &d) in disc.iter().enumerate() {
            let in_dirty = dirty.get(i).and_then(|v| v.get(w)).copied().unwrap_or(0);
            let in_carry = carry.get(i).and_then(|v| v.get(w)).copied().unwrap_or(0);
            let candidates = d & (in_dirty | in_carry);
            if candidates == 0 {
                continue;
            }
            let first = w * 64;
            let n = 64.min((r.len / PAGE as usize).saturating_sub(first));
            let host = r.host_addr + first * PAGE as usize;
            let mapped = match written_pages(&pagemap, host, n, private) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!("balloon: reading pagemap: {e}; discarded pages are copied");
                    return left_out;
                }
            };
            let mut gone = 0u64;
            for (b, &m) in mapped.iter().enumerate() {
                if candidates & (1 << b) != 0 && !m {
                    gone |= 1 << b;
                }
            }
            if let Some(x) = dirty.get_mut(i).and_then(|v| v.get_mut(w)) {
                left_out += u64::from((*x & gone).count_ones());
                *x &= !gone;
            }
            if let Some(x) = carry.get_mut(i).and_then(|v| v.get_mut(w)) {
                *x &= !gone;
            }
        }
    }
    left_out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::memory::{GuestRam, Reservation};
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn dirty_pages_discarded_and_not_touched_again_are_left_out() {
        let ram = GuestRam::anonymous(Reservation::new(16 << 20).unwrap()).unwrap();
        for p in 0..8u64 {
            ram.mem.write_obj(p + 1, GuestAddress(p * PAGE)).unwrap();
        }
        // Pages 2 and 3 discarded; page 3 written again afterwards.
        // SAFETY: the test's own memory, nothing else uses it.
        let r = unsafe {
            libc::madvise(
                (ram.image_addr() + 2 * PAGE as usize) as *mut _,
                2 * PAGE as usize,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(r, 0);
        ram.mem.write_obj(9u64, GuestAddress(3 * PAGE)).unwrap();
        let words = (16 << 20) / PAGE as usize / 64;
        let mut dirty = vec![vec![0u64; words]];
        dirty[0][0] = 0xff;
        let mut carry = vec![vec![0u64; words]];
        carry[0][0] = 0b1_0100;
        let mut discarded = vec![vec![0u64; words]];
        discarded[0][0] = 0b1100 | 1 << 4;
        let n = leave_out_discarded(ram.ranges(), true, &discarded, &mut dirty, &mut carry);
        // Page 4 was discarded per the log but is still mapped (nothing discarded it
        // really): kept, as a page written after its discard would be.
        assert_eq!(n, 1);
        assert_eq!(dirty[0][0], 0xff & !0b100);
        assert_eq!(carry[0][0], 0b1_0000);
        // Nothing discarded: nothing changes.
        let none = vec![vec![0u64; words]];
        assert_eq!(
            leave_out_discarded(ram.ranges(), true, &none, &mut dirty, &mut carry),
            0
        );
    }
}
