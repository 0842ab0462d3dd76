//! Saving and restoring KVM's own state: each vCPU's registers and in-kernel LAPIC, and the
//! VM's in-kernel irqchip, PIT and clock.
//!
//! Order matters on restore (it follows Firecracker's `KvmVcpu::restore_state`):
//! CPUID first (later ioctls check features against it), then MP state, REGS (which clears
//! pending exceptions), SREGS (restores the APIC base MSR, so before the LAPIC), FPU/XSAVE,
//! XCRS, debug registers, LAPIC (before MSRs: the TSC-deadline MSR only restores onto a
//! configured LAPIC), MSRs, and VCPU_EVENTS last (they restore pending exceptions and
//! interrupts that the earlier ioctls may have cleared). Saving runs MP state first (reading
//! it may accept pending APIC events) and VCPU_EVENTS last.
//!
//! Everything here comes back from a snapshot file, so it is untrusted: KVM validates what
//! it is given (a bad value is an ioctl error, reported as such), and the lengths of the
//! variable parts (CPUID entries, MSRs) are checked before they are handed over.

use std::sync::OnceLock;

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
    kvm_xsave, CpuId, Msrs, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
    KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

use crate::arch::msrs::MSR_PVM_VIF;
use crate::error::{Error, Result};

/// `kvm_fpu` has no serde support in kvm-bindings: the same fields, serialisable.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FpuState {
    fpr: [[u8; 16]; 8],
    fcw: u16,
    fsw: u16,
    ftwx: u8,
    last_opcode: u16,
    last_ip: u64,
    last_dp: u64,
    xmm: [[u8; 16]; 16],
    mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        FpuState {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}

/// Everything KVM keeps about one vCPU.
#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    /// CPUID as the VMM set it on the vCPU.
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// Multiprocessing state (running, halted, waiting for SIPI, ...).
    pub mp_state: kvm_mp_state,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// x87/SSE state (used when the host has no XSAVE support).
    pub fpu: FpuState,
    /// Extended state, when KVM supports XSAVE.
    pub xsave: Option<kvm_xsave>,
    /// Extended control registers, when KVM supports them.
    pub xcrs: Option<kvm_xcrs>,
    /// Debug registers.
    pub debugregs: kvm_debugregs,
    /// In-kernel local APIC.
    pub lapic: kvm_lapic_state,
    /// Every MSR KVM lists that could be read (the PVM VIF cell is registered separately).
    pub msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions, interrupts, NMIs, SMI and shadow state.
    pub events: kvm_vcpu_events,
    /// TSC frequency, when KVM reports it.
    pub tsc_khz: Option<u32>,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("rip", &format_args!("{:#x}", self.regs.rip))
            .field("mp_state", &self.mp_state.mp_state)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
}

/// The VM-wide in-kernel devices and clock.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmKvmState {
    /// PIC master, PIC slave, IOAPIC.
    pub irqchips: Vec<kvm_irqchip>,
    /// The in-kernel PIT.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
}

impl std::fmt::Debug for VmKvmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VmKvmState")
            .field("clock", &self.clock.clock)
            .finish_non_exhaustive()
    }
}

const IRQCHIP_IDS: [u32; 3] = [
    KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
    KVM_IRQCHIP_IOAPIC,
];

/// Reads the irqchip, PIT and clock. The vCPUs must be paused.
pub fn save_vm(vm: &VmFd) -> Result<VmKvmState> {
    let mut irqchips = Vec::with_capacity(3);
    for id in IRQCHIP_IDS {
        let mut c = kvm_irqchip {
            chip_id: id,
            ..Default::default()
        };
        vm.get_irqchip(&mut c)
            .map_err(Error::kvm("KVM_GET_IRQCHIP"))?;
        irqchips.push(c);
    }
    let pit = vm.get_pit2().map_err(Error::kvm("KVM_GET_PIT2"))?;
    let clock = vm.get_clock().map_err(Error::kvm("KVM_GET_CLOCK"))?;
    Ok(VmKvmState {
        irqchips,
        pit,
        clock,
    })
}

/// Restores what [`save_vm`] read into a VM that has its irqchip and PIT.
pub fn restore_vm(vm: &VmFd, s: &VmKvmState) -> Result<()> {
    if s.irqchips.len() != IRQCHIP_IDS.len()
        || s.irqchips
            .iter()
            .zip(IRQCHIP_IDS)
            .any(|(c, id)| c.chip_id != id)
    {
        return Err(Error::Snapshot(
            "saved irqchip state is not PIC master, PIC slave, IOAPIC".into(),
        ));
    }
    vm.set_pit2(&s.pit).map_err(Error::kvm("KVM_SET_PIT2"))?;
    // Only the value: the flags KVM reported (TSC_STABLE, ...) are not inputs, and
    // KVM_CLOCK_REALTIME would make the guest's clock jump by the time spent on disk. The
    // guest agent sets the wall clock after a restore instead.
    let clock = kvm_clock_data {
        clock: s.clock.clock,
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(Error::kvm("KVM_SET_CLOCK"))?;
    for c in &s.irqchips {
        vm.set_irqchip(c).map_err(Error::kvm("KVM_SET_IRQCHIP"))?;
    }
    Ok(())
}

/// What this host's KVM can save, probed once per process.
#[derive(Debug, Clone)]
pub struct Capabilities {
    xsave: bool,
    xcrs: bool,
    tsc_control: bool,
    /// KVM_GET_MSR_INDEX_LIST minus the PVM VIF cell.
    msr_list: Vec<u32>,
}

impl Capabilities {
    /// Probes `kvm`.
    pub fn probe(kvm: &Kvm) -> Result<Capabilities> {
        let list = kvm
            .get_msr_index_list()
            .map_err(Error::kvm("KVM_GET_MSR_INDEX_LIST"))?;
        Ok(Capabilities {
            xsave: kvm.check_extension(Cap::Xsave),
            xcrs: kvm.check_extension(Cap::Xcrs),
            tsc_control: kvm.check_extension(Cap::TscControl)
                || kvm.check_extension(Cap::GetTscKhz),
            msr_list: list
                .as_slice()
                .iter()
                .copied()
                .filter(|&i| i != MSR_PVM_VIF)
                .collect(),
        })
    }
}

/// MSRs of `msr_list` that KVM_GET_MSRS actually returns on this host (learned from the
/// first vCPU saved; KVM lists some that cannot be read in every configuration).
static READABLE_MSRS: OnceLock<Vec<u32>> = OnceLock::new();

fn msrs_of(indices: &[u32]) -> Result<Msrs> {
    let entries: Vec<kvm_msr_entry> = indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    Msrs::from_entries(&entries).map_err(|e| Error::Snapshot(format!("MSR list: {e:?}")))
}

/// Reads every MSR in `indices` that KVM returns, skipping those it refuses.
fn read_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<(Vec<kvm_msr_entry>, Vec<u32>)> {
    let mut out = Vec::with_capacity(indices.len());
    let mut refused = Vec::new();
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let mut msrs = msrs_of(chunk)?;
        let n = vcpu
            .get_msrs(&mut msrs)
            .map_err(Error::kvm("KVM_GET_MSRS"))?;
        out.extend_from_slice(&msrs.as_slice()[..n]);
        if n < chunk.len() {
            // KVM stops at the first MSR it cannot read.
            refused.push(chunk[n]);
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    Ok((out, refused))
}

/// Reads a vCPU's complete state; `cpuid` is the CPUID the VMM set on it, which is what is
/// saved: KVM_GET_CPUID2 does not return it on every host (this project's PVM hypervisor
/// answers with the host's own CPUID). Run it on the vCPU's thread while it is parked,
/// after any pending I/O was completed (see `vcpu::VcpuHandle::submit`).
pub fn save_vcpu(
    vcpu: &VcpuFd,
    caps: &Capabilities,
    cpuid: Vec<kvm_cpuid_entry2>,
) -> Result<VcpuState> {
    let mp_state = vcpu
        .get_mp_state()
        .map_err(Error::kvm("KVM_GET_MP_STATE"))?;
    let regs = vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
    let sregs = vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    let fpu = FpuState::from(&vcpu.get_fpu().map_err(Error::kvm("KVM_GET_FPU"))?);
    let xsave = if caps.xsave {
        Some(vcpu.get_xsave().map_err(Error::kvm("KVM_GET_XSAVE"))?)
    } else {
        None
    };
    let xcrs = if caps.xcrs {
        Some(vcpu.get_xcrs().map_err(Error::kvm("KVM_GET_XCRS"))?)
    } else {
        None
    };
    let debugregs = vcpu
        .get_debug_regs()
        .map_err(Error::kvm("KVM_GET_DEBUGREGS"))?;
    let lapic = vcpu.get_lapic().map_err(Error::kvm("KVM_GET_LAPIC"))?;
    let tsc_khz = if caps.tsc_control {
        vcpu.get_tsc_khz().ok()
    } else {
        None
    };
    let msrs = match READABLE_MSRS.get() {
        Some(list) => {
            let (msrs, refused) = read_msrs(vcpu, list)?;
            if !refused.is_empty() {
                return Err(Error::Snapshot(format!(
                    "KVM no longer returns MSRs {refused:#x?} it returned before"
                )));
            }
            msrs
        }
        None => {
            let (msrs, refused) = read_msrs(vcpu, &caps.msr_list)?;
            if !refused.is_empty() {
                tracing::debug!("MSRs KVM lists but does not return here: {refused:#x?}");
            }
            let _ = READABLE_MSRS.set(msrs.iter().map(|m| m.index).collect());
            msrs
        }
    };
    let events = vcpu
        .get_vcpu_events()
        .map_err(Error::kvm("KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        cpuid,
        mp_state,
        regs,
        sregs,
        fpu,
        xsave,
        xcrs,
        debugregs,
        lapic,
        msrs,
        events,
        tsc_khz,
    })
}

/// Writes each saved vCPU state `saved[i]` into `vcpus[i]` (vCPUs that have not run, whose
/// CPUID is `cpuids[i]`: see [`restore_vcpu`]) and, for a machine saved under the PVM
/// hypervisor (`pvm_vif_base`), registers each vCPU's virtual-interrupt cell. Returns the
/// MSRs KVM refused (each logged; the rest were written). The one way saved vCPU state
/// goes into vCPUs: a VM built from saved state, and a VM moving onto a new KVM VM.
pub fn restore_vcpus(
    vcpus: &[VcpuFd],
    saved: &[VcpuState],
    cpuids: &[Vec<kvm_cpuid_entry2>],
    pvm_vif_base: Option<u64>,
) -> Result<Vec<u32>> {
    if vcpus.len() != saved.len() {
        return Err(Error::Snapshot(format!(
            "state for {} vCPUs, {} vCPUs to restore it into",
            saved.len(),
            vcpus.len()
        )));
    }
    let mut refused_msrs = Vec::new();
    for (i, (fd, s)) in vcpus.iter().zip(saved).enumerate() {
        let current = cpuids.get(i).map(|c| &c[..]);
        let refused = restore_vcpu(fd, s, current).map_err(|e| Error::Vcpu {
            index: i,
            reason: format!("restoring its state: {e}"),
        })?;
        if !refused.is_empty() {
            tracing::warn!("vcpu{i}: KVM refused to restore MSRs {refused:#x?}");
            refused_msrs.extend(refused);
        }
        if let Some(vif) = pvm_vif_base {
            // After SREGS, which resets the hypervisor's view of the cell.
            if !crate::vstate::kvm::register_pvm_vif(fd, vif + i as u64 * 0x1000)? {
                return Err(Error::UnsupportedHost(
                    "the state was saved under the PVM hypervisor and its guest needs the PVM \
                     virtual-interrupt cell, which this host's KVM lacks"
                        .into(),
                ));
            }
        }
    }
    Ok(refused_msrs)
}

/// Writes `s` into a vCPU that has not run yet, whose CPUID is `current` (skipped when the
/// saved one is the same). Returns the MSRs KVM refused (logged by the caller; the rest
/// were written).
pub fn restore_vcpu(
    vcpu: &VcpuFd,
    s: &VcpuState,
    current: Option<&[kvm_cpuid_entry2]>,
) -> Result<Vec<u32>> {
    if s.cpuid.is_empty() || s.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(Error::Snapshot(format!(
            "{} CPUID entries in the vCPU state",
            s.cpuid.len()
        )));
    }
    if s.msrs.len() > 4096 {
        return Err(Error::Snapshot(format!(
            "{} MSRs in the vCPU state",
            s.msrs.len()
        )));
    }
    if current != Some(&s.cpuid[..]) {
        tracing::debug!(
            "restoring CPUID ({} entries; {} set before)",
            s.cpuid.len(),
            current.map_or(0, <[_]>::len)
        );

        let cpuid =
            CpuId::from_entries(&s.cpuid).map_err(|e| Error::Snapshot(format!("CPUID: {e:?}")))?;
        vcpu.set_cpuid2(&cpuid)
            .map_err(Error::kvm("KVM_SET_CPUID2"))?;
    }
    if let Some(khz) = s.tsc_khz {
        if vcpu.get_tsc_khz().ok() != Some(khz) {
            if let Err(e) = vcpu.set_tsc_khz(khz) {
                tracing::warn!("cannot set the saved TSC frequency {khz} kHz: {e}");
            }
        }
    }
    vcpu.set_mp_state(s.mp_state)
        .map_err(Error::kvm("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&s.regs).map_err(Error::kvm("KVM_SET_REGS"))?;
    vcpu.set_sregs(&s.sregs)
        .map_err(Error::kvm("KVM_SET_SREGS"))?;
    match &s.xsave {
        // SAFETY: `x` is a complete `kvm_xsave` (4 KiB), which is all the legacy
        // KVM_SET_XSAVE ioctl reads; its contents are validated by KVM.
        Some(x) => unsafe { vcpu.set_xsave(x) }.map_err(Error::kvm("KVM_SET_XSAVE"))?,
        None => vcpu
            .set_fpu(&kvm_fpu::from(&s.fpu))
            .map_err(Error::kvm("KVM_SET_FPU"))?,
    }
    if let Some(x) = &s.xcrs {
        vcpu.set_xcrs(x).map_err(Error::kvm("KVM_SET_XCRS"))?;
    }
    vcpu.set_debug_regs(&s.debugregs)
        .map_err(Error::kvm("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&s.lapic)
        .map_err(Error::kvm("KVM_SET_LAPIC"))?;
    let mut refused = Vec::new();
    let mut rest = &s.msrs[..];
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let msrs =
            Msrs::from_entries(chunk).map_err(|e| Error::Snapshot(format!("MSRs: {e:?}")))?;
        let n = vcpu.set_msrs(&msrs).map_err(Error::kvm("KVM_SET_MSRS"))?;
        if n < chunk.len() {
            refused.push(chunk[n].index);
            rest = &rest[n + 1..];
        } else {
            rest = &rest[chunk.len()..];
        }
    }
    vcpu.set_vcpu_events(&s.events)
        .map_err(Error::kvm("KVM_SET_VCPU_EVENTS"))?;

    Ok(refused)
}
