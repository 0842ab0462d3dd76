//! A shell's first vCPU run, made while the shell is built instead of on a restore's path.
//!
//! KVM does work on a vCPU's first `KVM_RUN` that does not depend on the guest: the VM's
//! first run starts its huge-page recovery thread, and the vCPU's first entry fills its
//! MMU caches (dozens of zeroed pages for shadow pages and their bookkeeping). Measured
//! with `perf` on this project's hosts during `clade bench restore`: ~30 us and ~90 us of
//! the restored vCPU's first run, before the guest's own first page faults. Done here,
//! both are paid by the pool that builds shells in the background.
//!
//! The warm-up guest is one page of code in real mode: an `out` to port 0x10 (an exit to
//! user space, which this code takes), in a loop. Real mode, not long mode: with paging on,
//! a host without two-dimensional paging (PVM here, or `ept=0`) would build shadow pages
//! for the warm-up's page tables and keep trusting them after the snapshot's memory is put
//! behind those guest addresses from user space, which KVM does not see; without paging
//! its MMU only maps guest-physical addresses directly, and those entries go with the
//! pages. The vCPU's registers and run state are put back afterwards and the first 2 MiB
//! of the shell's address space are dropped again (`MADV_DONTNEED`), so the shell keeps
//! the promise of [`Reservation`]: no page present (a `uffd` restore relies on it).

use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::error::{Error, Result};
use crate::vstate::memory::Reservation;

/// Where the warm-up's code lives (guest-physical; the code segment's base, IP 0).
const CODE: u64 = 0x13000;
/// `1: out 0x10, al; jmp 1b`: the run ends at the `out` however often it is resumed.
/// (PVM lets a guest write port 0x80, the I/O delay port, without an exit: not that one.)
const PROGRAM: [u8; 4] = [0xe6, 0x10, 0xeb, 0xfc];
/// The port of the program's `out`.
const PORT: u16 = 0x10;
/// Dropped after the runs: the code page and anything near it the hypervisor touched.
const REACH: usize = 2 << 20;

/// Runs each vCPU of a shell once (see the [module documentation](self)); returns how many
/// runs ended at the program's `out` (0 for memory too small to hold the program). A vCPU
/// whose run does not end there is logged (its registers are put back all the same, and
/// restores and boots set every register they need); an error means the shell's memory
/// could not be put back.
pub(crate) fn warm_up(res: &Reservation, vcpus: &mut [VcpuFd]) -> Result<usize> {
    let Some(low) = res.ranges().first() else {
        return Ok(0);
    };
    if low.guest_addr != 0 || low.len < REACH {
        return Ok(0);
    }
    let base = low.host_addr;
    // SAFETY: CODE + PROGRAM.len() lies in the reservation's first range (checked above:
    // it spans at least REACH bytes from guest address 0), which this process mapped
    // readable and writable and nothing else refers into while a shell is built.
    unsafe {
        std::ptr::copy_nonoverlapping(
            PROGRAM.as_ptr(),
            (base + CODE as usize) as *mut u8,
            PROGRAM.len(),
        )
    };
    let mut warmed = 0;
    for (i, vcpu) in vcpus.iter_mut().enumerate() {
        match run_once(vcpu) {
            Ok(()) => warmed += 1,
            Err(e) => tracing::debug!("VM shell: vCPU {i} warm-up: {e}"),
        }
    }
    // SAFETY: the range is the reservation's first REACH bytes (checked above), private
    // anonymous memory of this process; dropping its pages returns it to untouched.
    if unsafe { libc::madvise(base as *mut libc::c_void, REACH, libc::MADV_DONTNEED) } != 0 {
        return Err(Error::Io {
            context: "dropping a VM shell's warm-up pages",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(warmed)
}

/// One vCPU's run: real mode at [`CODE`], until its `out`; then the I/O completed (a run
/// with `immediate_exit`, so nothing of it is left for the guest's first real run) and the
/// registers and run state put back.
fn run_once(vcpu: &mut VcpuFd) -> Result<()> {
    let sregs = vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    let regs = vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
    // A vCPU other than the first waits for its INIT and SIPI (a run would block until
    // then): runnable for the warm-up, waiting again after it.
    let mp_state = vcpu
        .get_mp_state()
        .map_err(Error::kvm("KVM_GET_MP_STATE"))?;
    vcpu.set_mp_state(kvm_bindings::kvm_mp_state {
        mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
    })
    .map_err(Error::kvm("KVM_SET_MP_STATE"))?;
    let mut real = sregs;
    real.cr0 &= !0x8000_0001; // PG and PE off: real mode (a new vCPU's already).
    real.cs.base = CODE;
    real.cs.selector = (CODE >> 4) as u16;
    vcpu.set_sregs(&real).map_err(Error::kvm("KVM_SET_SREGS"))?;
    let mut r = regs;
    r.rip = 0;
    r.rflags = 0x2;
    vcpu.set_regs(&r).map_err(Error::kvm("KVM_SET_REGS"))?;
    let exit = match vcpu.run() {
        Ok(VcpuExit::IoOut(PORT, _)) => Ok(()),
        Ok(other) => Err(Error::Boot(format!("warm-up run ended with {other:?}"))),
        Err(e) => Err(Error::Boot(format!("warm-up run: {e}"))),
    };
    vcpu.set_kvm_immediate_exit(1);
    let completed = vcpu.run().map(|_| ()).err();
    vcpu.set_kvm_immediate_exit(0);
    vcpu.set_sregs(&sregs)
        .map_err(Error::kvm("KVM_SET_SREGS"))?;
    vcpu.set_regs(&regs).map_err(Error::kvm("KVM_SET_REGS"))?;
    vcpu.set_mp_state(mp_state)
        .map_err(Error::kvm("KVM_SET_MP_STATE"))?;
    exit?;
    match completed {
        Some(e) if e.errno() == libc::EINTR => Ok(()),
        Some(e) => Err(Error::Boot(format!("completing the warm-up's I/O: {e}"))),
        None => Err(Error::Boot("the warm-up's second run did not stop".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vstate::shell::{Shell, ShellMemory, ShellSpec};

    /// Pages of `len` bytes from `addr` that are present in this process's page tables.
    fn resident(addr: usize, len: usize) -> usize {
        let mut v = vec![0u8; len.div_ceil(4096)];
        // SAFETY: `addr..addr + len` is a mapping this test owns; mincore only reads the
        // page tables and writes one byte per page into `v`, which is that long.
        let r = unsafe { libc::mincore(addr as *mut libc::c_void, len, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn every_vcpu_runs_once_and_the_memory_is_left_untouched() {
        let spec = ShellSpec {
            kvm_device: crate::vstate::kvm::KVM_PATH.into(),
            mem_bytes: 64 << 20,
            vcpus: 2,
            dirty_log: false,
        };
        let Ok(mut shell) = Shell::create(&spec) else {
            eprintln!("skipped: no usable /dev/kvm");
            return;
        };
        let ShellMemory::Reserved(res) = &shell.memory else {
            panic!("a new shell's memory is only reserved");
        };
        let low = res.ranges()[0].host_addr;
        // Shell::create ran the warm-up already; nothing of it stayed.
        assert_eq!(resident(low, 64 << 20), 0);
        let before: Vec<_> = shell
            .vcpus
            .iter()
            .map(|v| (v.get_regs().unwrap(), v.get_sregs().unwrap()))
            .collect();
        // Run again, to count the runs that reached the `out`.
        assert_eq!(warm_up(res, &mut shell.vcpus).unwrap(), 2);
        assert_eq!(resident(low, 64 << 20), 0, "the warm-up left pages behind");
        for (v, (regs, sregs)) in shell.vcpus.iter().zip(before) {
            assert_eq!(v.get_regs().unwrap().rip, regs.rip);
            assert_eq!(v.get_regs().unwrap().rflags, regs.rflags);
            let s = v.get_sregs().unwrap();
            assert_eq!(
                (s.cr0, s.cr3, s.cr4, s.efer),
                (sregs.cr0, sregs.cr3, sregs.cr4, sregs.efer)
            );
        }
        // The second vCPU waits for its INIT and SIPI again, as a new one does.
        assert_eq!(
            shell.vcpus[1].get_mp_state().unwrap().mp_state,
            kvm_bindings::KVM_MP_STATE_UNINITIALIZED
        );
    }
}
