//! The KVM system fd and the VM fd: capabilities, in-kernel irqchip and PIT, memory slots,
//! and detection of this machine kind's PVM hypervisor.

use std::ffi::CString;
use std::path::Path;

use kvm_bindings::{
    kvm_msr_entry, kvm_pit_config, kvm_userspace_memory_region, Msrs, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};

use crate::arch::msrs::{MSR_PVM_VIF, PVM_VIF_HOST_WRITE};
use crate::error::{Error, Result};
use crate::vstate::memory::HostRange;

/// Default KVM device node.
pub const KVM_PATH: &str = "/dev/kvm";
/// Address of the 3-page TSS region KVM needs on Intel, just below the BIOS area at 4 GiB.
const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

/// Opens KVM, turning the usual failures into errors a user can act on.
pub fn open(path: &Path) -> Result<Kvm> {
    let cpath = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::Config("KVM path contains a NUL byte".into()))?;
    let kvm = Kvm::new_with_path(&cpath).map_err(|e| match e.errno() {
        libc::ENOENT | libc::ENODEV | libc::ENXIO => Error::KvmMissing {
            path: path.to_path_buf(),
        },
        libc::EACCES | libc::EPERM => Error::KvmPermission {
            path: path.to_path_buf(),
        },
        _ => Error::KvmOpen {
            path: path.to_path_buf(),
            source: std::io::Error::from_raw_os_error(e.errno()),
        },
    })?;
    if kvm.get_api_version() != 12 {
        return Err(Error::KvmCapability("API version 12"));
    }
    for (cap, name) in [
        (Cap::Irqchip, "an in-kernel irqchip"),
        (Cap::UserMemory, "user memory slots"),
        (Cap::SetTssAddr, "KVM_SET_TSS_ADDR"),
        (Cap::Pit2, "an in-kernel PIT"),
        (Cap::Irqfd, "irqfd"),
        (Cap::ExtCpuid, "KVM_GET_SUPPORTED_CPUID"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(Error::KvmCapability(name));
        }
    }
    Ok(kvm)
}

/// Most vCPUs a VM may have on this host.
pub fn max_vcpus(kvm: &Kvm) -> u32 {
    // xAPIC ids are 8 bits and 0xff is broadcast.
    kvm.get_max_vcpus().min(254) as u32
}

/// Creates an empty VM.
pub fn create_vm(kvm: &Kvm) -> Result<VmFd> {
    let vm = kvm.create_vm().map_err(Error::kvm("KVM_CREATE_VM"))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(Error::kvm("KVM_SET_TSS_ADDR"))?;
    Ok(vm)
}

/// Adds the in-kernel irqchip (PIC, IOAPIC, LAPICs) and PIT. Call it after the memory slots
/// are set: on this project's PVM hosts a memory slot added after the irqchip costs ~4-7 ms
/// instead of ~0.2-0.3 ms (measured with 256 MiB and 1 GiB), and one added after the vCPUs
/// ~7 ms. (The irqchip itself then takes ~3 ms: whichever comes second pays. That is why a
/// restore takes a pre-built VM shell whose slots point at reserved address space, and maps
/// the snapshot's memory over it: see `vstate::shell`.)
pub fn create_irqchip(vm: &VmFd) -> Result<()> {
    vm.create_irq_chip()
        .map_err(Error::kvm("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(Error::kvm("KVM_CREATE_PIT2"))?;
    Ok(())
}

/// Registers each host range as KVM memory slot `i` (its index), with dirty page logging
/// when `dirty_log` is set.
pub fn set_memory_slots(vm: &VmFd, ranges: &[HostRange], dirty_log: bool) -> Result<()> {
    for (slot, range) in ranges.iter().enumerate() {
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            flags: if dirty_log {
                KVM_MEM_LOG_DIRTY_PAGES
            } else {
                0
            },
            guest_phys_addr: range.guest_addr,
            memory_size: range.len as u64,
            userspace_addr: range.host_addr as u64,
        };
        // SAFETY: the range is address space this process reserved or mapped for guest
        // memory and keeps (reserved, then mapped) for at least as long as the VM fd (see
        // `Vm` field order). KVM only follows it through the page tables, so memory mapped
        // over it later with MAP_FIXED is what the guest sees.
        unsafe { vm.set_user_memory_region(r) }
            .map_err(Error::kvm("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

/// Fetches and clears KVM's dirty page log of each memory slot (one bitmap per range).
pub fn take_dirty_log(vm: &VmFd, ranges: &[HostRange]) -> Result<Vec<Vec<u64>>> {
    ranges
        .iter()
        .enumerate()
        .map(|(slot, r)| {
            vm.get_dirty_log(slot as u32, r.len)
                .map_err(Error::kvm("KVM_GET_DIRTY_LOG"))
        })
        .collect()
}

/// Tries to register `cell_gpa` as vCPU's virtual-interrupt-flag cell. Succeeds (true) only on
/// the PVM hypervisor this project's machines run; elsewhere the MSR does not exist and KVM
/// writes 0 MSRs (or, with `ignore_msrs`, ignores the write, which the read-back catches).
pub fn register_pvm_vif(vcpu: &VcpuFd, cell_gpa: u64) -> Result<bool> {
    let value = cell_gpa | PVM_VIF_HOST_WRITE;
    let msrs = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_PVM_VIF,
        data: value,
        ..Default::default()
    }])
    .map_err(|e| Error::Boot(format!("building MSR list: {e:?}")))?;
    let written = vcpu.set_msrs(&msrs).map_err(Error::kvm("KVM_SET_MSRS"))?;
    if written != 1 {
        return Ok(false);
    }
    let mut read = Msrs::from_entries(&[kvm_msr_entry {
        index: MSR_PVM_VIF,
        ..Default::default()
    }])
    .map_err(|e| Error::Boot(format!("building MSR list: {e:?}")))?;
    let n = vcpu
        .get_msrs(&mut read)
        .map_err(Error::kvm("KVM_GET_MSRS"))?;
    let back = read.as_slice()[0].data;
    Ok(n == 1 && back & !PVM_VIF_HOST_WRITE == cell_gpa)
}
