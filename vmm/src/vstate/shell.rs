//! VM shells: a KVM VM with its memory slots, in-kernel irqchip, PIT and vCPUs already
//! created, but no memory yet. Building one is most of the cost of a VM on this project's
//! hosts (measured, 1 GiB, dirty logging on: CREATE_VM ~0.15 ms, memory slot ~0.3 ms,
//! irqchip + PIT after the slot ~3 ms, a vCPU ~0.1 ms), and none of it depends on the
//! guest, so a restore takes a shell from a pool ([`super::pool::ShellPool`]) and only maps
//! memory over the shell's reserved address space ([`Reservation`]) and sets state.
//!
//! Order inside a shell: VM, memory slots over reserved (untouched) address space, then
//! irqchip and PIT, then vCPUs (KVM requires the irqchip before the vCPUs, and the slots
//! are cheapest first, see [`kvm::create_irqchip`]). Mapping memory over the reservation
//! later (`MAP_FIXED`) needs no KVM call: KVM resolves guest pages through the process's
//! page tables when the guest first touches them (the kernel still tells KVM of the new
//! mapping, which walks the slot: see [`Reservation`]). Each vCPU has made its first run
//! already ([`super::warmup`]), which costs KVM more than any later one.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_cpuid_entry2, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};

use crate::arch::cpuid;
use crate::seccomp::ThreadKind;

use crate::error::{Error, Result};
use crate::vstate::kvm;
use crate::vstate::memory::{FrozenImage, GuestRam, Reservation};
use crate::vstate::spare::SpareThread;
use snapshot::page_server::Prefilled;

/// What a shell must fit: a snapshot (or a boot config) of this size.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShellSpec {
    /// KVM device node.
    pub kvm_device: PathBuf,
    /// Guest RAM in bytes.
    pub mem_bytes: u64,
    /// Number of vCPUs.
    pub vcpus: u32,
    /// Memory slots log dirty pages (needed for diff snapshots).
    pub dirty_log: bool,
}

/// A pre-built VM without memory. See the [module documentation](self).
pub struct Shell {
    // Field order is drop order: vCPUs, then the VM, then the address space.
    pub(crate) vcpus: Vec<VcpuFd>,
    pub(crate) vm_fd: VmFd,
    pub(crate) memory: ShellMemory,
    pub(crate) kvm: Kvm,
    pub(crate) spec: ShellSpec,
    /// Threads waiting to run the vCPUs, the device event loop and the page server.
    pub(crate) spares: Vec<SpareThread>,
    /// A userfaultfd for a `uffd` restore (None where this process may not create one).
    pub(crate) uffd: Option<snapshot::page_server::PreparedUffd>,
    /// The CPUID set on each vCPU (what a VM booted on this host gets; a restore of a
    /// snapshot with the same CPUID need not set it again).
    pub(crate) cpuids: Vec<Vec<kvm_cpuid_entry2>>,
    pub(crate) build_time: Duration,
}

impl std::fmt::Debug for Shell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shell")
            .field("spec", &self.spec)
            .field("build_time", &self.build_time)
            .finish()
    }
}

impl Shell {
    /// Builds a shell for `spec`.
    pub fn create(spec: &ShellSpec) -> Result<Shell> {
        let t = Instant::now();
        if spec.vcpus == 0 {
            return Err(Error::Config("vcpus must be at least 1".into()));
        }
        let kvm = kvm::open(&spec.kvm_device)?;
        let max = kvm::max_vcpus(&kvm);
        if spec.vcpus > max {
            return Err(Error::TooManyVcpus {
                requested: spec.vcpus,
                max,
            });
        }
        let vm_fd = kvm::create_vm(&kvm)?;
        let reservation = Reservation::new(spec.mem_bytes)?;
        kvm::set_memory_slots(&vm_fd, reservation.ranges(), spec.dirty_log)?;
        kvm::create_irqchip(&vm_fd)?;
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(Error::kvm("KVM_GET_SUPPORTED_CPUID"))?;
        let mut vcpus = Vec::with_capacity(spec.vcpus as usize);
        let mut cpuids = Vec::with_capacity(spec.vcpus as usize);
        for i in 0..spec.vcpus {
            let fd = vm_fd
                .create_vcpu(u64::from(i))
                .map_err(Error::kvm("KVM_CREATE_VCPU"))?;
            let c = cpuid::for_vcpu(&supported, i, spec.vcpus);
            fd.set_cpuid2(&c).map_err(Error::kvm("KVM_SET_CPUID2"))?;
            cpuids.push(c.as_slice().to_vec());
            vcpus.push(fd);
        }
        // The vCPUs' first run, which KVM makes costly, off a restore's path.
        let warmed = crate::vstate::warmup::warm_up(&reservation, &mut vcpus)?;
        // One thread per vCPU, one for the device event loop, one for a page server, one
        // helper (the test device's interrupt thread, or a Linux guest's agent sync after
        // a restore), each confined to its kind already (installing a filter costs tens of
        // microseconds).
        let spares = (0..spec.vcpus)
            .map(|_| ThreadKind::Vcpu)
            .chain([
                ThreadKind::DeviceLoop,
                ThreadKind::PageServer,
                ThreadKind::Helper,
            ])
            .map(SpareThread::start)
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|source| Error::Io {
                context: "starting spare threads",
                source,
            })?;
        let uffd = match snapshot::page_server::PreparedUffd::create() {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::debug!("VM shell without a userfaultfd: {e}");
                None
            }
        };
        // The VM made from this shell will open more descriptors: room for them now.
        crate::vstate::fdtable::reserve_for_another_vm(&vm_fd);
        let build_time = t.elapsed();
        tracing::debug!(
            "VM shell: {} vCPUs ({warmed} warmed up), {} MiB, dirty log {}, built in {build_time:?}",
            spec.vcpus,
            spec.mem_bytes >> 20,
            spec.dirty_log
        );
        Ok(Shell {
            vcpus,
            vm_fd,
            memory: ShellMemory::Reserved(reservation),
            kvm,
            spec: spec.clone(),
            spares,
            uffd,
            cpuids,
            build_time,
        })
    }

    /// What this shell fits.
    pub fn spec(&self) -> &ShellSpec {
        &self.spec
    }

    /// How long building it took.
    pub fn build_time(&self) -> Duration {
        self.build_time
    }
}

/// A shell's guest address range: reserved, or with a fork's image already mapped over it.
pub(crate) enum ShellMemory {
    /// Address space reserved ([`Reservation`]): memory is mapped over it when the shell
    /// becomes a VM.
    Reserved(Reservation),
    /// An image mapped private over the reservation ahead of the fork that freezes it: a
    /// booted VM's memfd, which its next freeze takes as the image as it is
    /// (`Vm::map_into_shell`). Nothing touches this mapping before then, so it shows the
    /// memfd as it is at the freeze, and mapping it (with KVM walking the shell's memory
    /// slot, ~85 us per GiB here) is off the fork's path.
    Mapped(GuestRam, Arc<FrozenImage>),
    /// Anonymous memory registered with the shell's userfaultfd and the working set of
    /// one snapshot installed, ahead of its restore (`PreparedSnapshot::prefill_shell`:
    /// a standby waiting to restore the snapshot it opened ahead). A restore of that
    /// snapshot starts its page server on it; any other use maps fresh memory over it.
    Prefilled(GuestRam, Box<Prefilled>),
}

impl ShellMemory {
    /// The image mapped ahead, if any.
    pub(crate) fn mapped_image(&self) -> Option<&Arc<FrozenImage>> {
        match self {
            ShellMemory::Mapped(_, image) => Some(image),
            ShellMemory::Reserved(_) | ShellMemory::Prefilled(..) => None,
        }
    }

    /// The range as a reservation, for memory other than a fork's: one mapped ahead is
    /// dropped (fresh address space mapped over it).
    pub(crate) fn into_reservation(self) -> Result<Reservation> {
        self.into_reservation_and_uffd().map(|(r, _)| r)
    }

    /// [`ShellMemory::into_reservation`], with the userfaultfd of prefilled memory (free
    /// for other memory once that memory is replaced).
    pub(crate) fn into_reservation_and_uffd(
        self,
    ) -> Result<(Reservation, Option<snapshot::page_server::PreparedUffd>)> {
        match self {
            ShellMemory::Reserved(r) => Ok((r, None)),
            ShellMemory::Mapped(ram, _) => Ok((ram.into_reservation()?, None)),
            ShellMemory::Prefilled(ram, prefilled) => {
                // Fresh address space first: the registered mapping is replaced, so the
                // userfaultfd is free for other memory.
                let r = ram.into_reservation()?;
                Ok((r, prefilled.into_uffd()))
            }
        }
    }

    /// Memory on the frozen `image`: the mapping made ahead if it is of that very image,
    /// else a new one (a mapping of another image is dropped first).
    pub(crate) fn forked(self, image: &Arc<FrozenImage>) -> Result<GuestRam> {
        match self {
            ShellMemory::Mapped(ram, mapped) if Arc::ptr_eq(&mapped, image) => Ok(ram),
            other => GuestRam::forked(other.into_reservation()?, Arc::clone(image)),
        }
    }
}
