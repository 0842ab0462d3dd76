//! Prepares the parts of a [`Vm`] for each way one comes to exist, side by side, and hands
//! them to [`Vm::from_parts`]:
//!
//! - [`boot`]: from a [`VmConfig`]: fresh memory, devices, boot tables, kernel, boot
//!   registers.
//! - [`from_saved`]: from a [`SavedMachine`] and memory already in place (a snapshot
//!   restore, a fork child): devices recreated from their state, then the VM's and the
//!   vCPUs' KVM state, then a new VM generation ID for the guest.
//!
//! Both start from a VM shell ([`Shell`]: KVM VM, memory slots, irqchip, vCPUs) and end
//! with a VM whose vCPUs have not run ([`Vm::start`]).

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Instant;

use snapshot::page_server::{PageServer, PreparedUffd};

use crate::arch::boot::{self, BootSpec};
use crate::arch::layout::{PVM_VIF_BASE, PVM_VIF_MAX};
use crate::arch::{acpi, regs};
use crate::config::{BlockConfig, NetConfig, SerialOutput, VmConfig, VsockConfig};
use crate::device_manager::{DeviceManager, DeviceThreads};
use crate::error::{Error, Result};
use crate::exit::exit_notifier;
use crate::saved::{Lineage, SavedMachine, Steps};
use crate::seccomp::ThreadKind;
use crate::vm::{Vm, VmParts};
use crate::vstate::memory::{self, GuestRam};
use crate::vstate::shell::{Shell, ShellMemory, ShellSpec};
use crate::vstate::spare::{self, SpareThread};
use crate::vstate::state as kvm_state;
use crate::vstate::{kvm, vcpu};

/// Command-line key telling the test guest where its PVM VIF cell is.
pub const PVM_VIF_CMDLINE_KEY: &str = "clade.vif";

/// Builds the VM described by `config`, ready to [`Vm::start`]. Everything that can be
/// checked (config, memory size, readable kernel and initrd) is checked before any KVM
/// object exists.
pub fn boot(config: VmConfig) -> Result<Vm> {
    let created_at = Instant::now();
    config.validate()?;
    let host_mib = memory::host_mem_mib()?;
    if config.mem_mib > host_mib {
        return Err(Error::MemoryTooLarge {
            requested_mib: config.mem_mib,
            host_mib,
        });
    }
    // Fail on unreadable inputs before doing any KVM work.
    for (path, is_kernel) in
        std::iter::once((&config.kernel, true)).chain(config.initrd.iter().map(|p| (p, false)))
    {
        if let Err(source) = std::fs::metadata(path) {
            return Err(if is_kernel {
                Error::KernelOpen {
                    path: path.clone(),
                    source,
                }
            } else {
                Error::InitrdOpen {
                    path: path.clone(),
                    source,
                }
            });
        }
    }

    // The TAP too: a missing or unusable one fails before any KVM object exists.
    let tap = config
        .net
        .as_ref()
        .map(crate::device_manager::open_tap)
        .transpose()?;

    let mem_bytes = config.mem_mib << 20;
    // The same pre-built VM a restore uses: slots over reserved address space, irqchip,
    // vCPUs; then fresh memory over the reservation.
    let Shell {
        vcpus: vcpu_fds,
        vm_fd,
        memory,
        kvm,
        cpuids,
        spares,
        uffd,
        ..
    } = Shell::create(&ShellSpec {
        kvm_device: config.kvm_device.clone(),
        mem_bytes,
        vcpus: config.vcpus,
        // Booted VMs always log dirty pages, so that diff snapshots can be taken (one write
        // fault per page per snapshot interval).
        dirty_log: true,
    })?;
    let ram = GuestRam::memfd(memory.into_reservation()?)?;

    // On this project's PVM hypervisor, guests run natively only once each vCPU has a
    // virtual-interrupt-flag cell; elsewhere the probe finds no such MSR.
    let pvm_native = kvm::register_pvm_vif(&vcpu_fds[0], PVM_VIF_BASE)?;
    let mut cmdline = config.cmdline.clone();
    if pvm_native {
        if !boot::is_elf(&config.kernel)? {
            return Err(Error::UnsupportedHost(
                "this host's /dev/kvm is a software (PVM) hypervisor without VMX/SVM: it cannot \
                 boot ordinary Linux kernels; use a host with hardware virtualization, or the \
                 nested tier (scripts/demo.sh)"
                    .into(),
            ));
        }
        if u64::from(config.vcpus) > PVM_VIF_MAX {
            return Err(Error::TooManyVcpus {
                requested: config.vcpus,
                max: PVM_VIF_MAX as u32,
            });
        }
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(&format!("{PVM_VIF_CMDLINE_KEY}={PVM_VIF_BASE:#x}"));
        tracing::debug!(
            "PVM hypervisor: VIF cells registered for {} vCPUs",
            config.vcpus
        );
    }

    let (events_tx, events) = mpsc::channel();
    let exit = exit_notifier(&events_tx);
    // Devices come before the boot tables: the kernel command line and the DSDT announce
    // the virtio-mmio slots.
    let mut devices = DeviceManager::new(
        &vm_fd,
        &ram.mem,
        &config.serial,
        config.test_device,
        config.vsock.as_ref(),
        exit,
    )?;
    if let Some(d) = &config.disk {
        devices.add_block_device(&vm_fd, &ram.mem, d)?;
    }
    if let Some(tap) = tap {
        let mac = config.net.as_ref().and_then(|n| n.mac);
        devices.add_net_device(&vm_fd, &ram.mem, tap, mac)?;
    }
    if config.balloon {
        devices.add_balloon_device(&vm_fd, &ram.mem)?;
    }
    for slot in devices.virtio_slots() {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(&slot.cmdline_entry());
    }

    regs::write_boot_tables(&ram.mem)?;
    acpi::write_tables(
        &ram.mem,
        config.vcpus,
        devices.virtio_slots(),
        devices.vmgenid().as_ref(),
    )?;
    let boot_info = boot::load(
        &ram.mem,
        &BootSpec {
            kernel: &config.kernel,
            initrd: config.initrd.as_deref(),
            cmdline: &cmdline,
            mem_bytes,
            vif_cells: if pvm_native {
                u64::from(config.vcpus)
            } else {
                0
            },
        },
    )?;

    for (i, fd) in vcpu_fds.iter().enumerate() {
        vcpu::configure_for_boot(fd, boot_info.entry)?;
        // The cell is (re-)registered after the register state is set: setting sregs resets
        // the hypervisor's view of it.
        if pvm_native && !kvm::register_pvm_vif(fd, PVM_VIF_BASE + i as u64 * 0x1000)? {
            return Err(Error::Vcpu {
                index: i,
                reason: "PVM VIF cell registration failed".into(),
            });
        }
    }

    tracing::debug!(
        "built VM: {} vCPUs, {} MiB, entry {:#x}, in {:?}",
        config.vcpus,
        config.mem_mib,
        boot_info.entry,
        created_at.elapsed()
    );
    Ok(Vm::from_parts(VmParts {
        vcpu_fds,
        devices,
        events: (events_tx, events),
        page_server: None,
        vm_fd,
        ram,
        kvm,
        config,
        pvm_native,
        created_at,
        lineage: None,
        // Booted VMs always log dirty pages (see the shell above).
        dirty_tracking: true,
        spares,
        unused_uffd: uffd,
        cpuids,
        vcpu_cpus: Vec::new(),
    }))
}

/// Builds, starts and waits for the VM described by `config` to end.
pub fn run(config: VmConfig) -> Result<crate::VmExit> {
    let mut vm = boot(config)?;
    vm.start()?;
    vm.wait()
}

/// What a VM built from saved state has of its own (the rest comes from the state).
#[derive(Debug)]
pub(crate) struct Identity {
    /// Where its serial console goes.
    pub(crate) serial: SerialOutput,
    /// Its vsock device (needed exactly when the saved machine has one).
    pub(crate) vsock: Option<VsockConfig>,
    /// Its disk: the top layer it writes (an overlay on the saved disk layer), or the
    /// saved read-only layer itself (needed exactly when the saved machine has a disk).
    pub(crate) disk: Option<BlockConfig>,
    /// Its TAP (needed exactly when the saved machine has a virtio-net device).
    pub(crate) net: Option<NetConfig>,
    /// KVM device node.
    pub(crate) kvm_device: PathBuf,
    /// Log dirty pages.
    pub(crate) dirty_tracking: bool,
    /// vCPU pinning (see [`Vm::pin_vcpus`]).
    pub(crate) vcpu_cpus: Vec<usize>,
    /// The snapshot its memory matches (a restore).
    pub(crate) lineage: Option<Lineage>,
}

/// The parts of a shell memory goes into: its address range (reserved, or with a fork's
/// image mapped ahead), the threads kept for a page server, the shell's userfaultfd (taken
/// by a page server; one left there stays with the VM: see `Vm::unused_uffd`).
pub(crate) struct MemorySlot<'a> {
    pub(crate) memory: ShellMemory,
    pub(crate) spares: &'a mut Vec<SpareThread>,
    pub(crate) uffd: &'a mut Option<PreparedUffd>,
}

/// A shell for `spec`: `shell` if it fits (else it is dropped, with a warning) or a new one.
/// Returns whether the given one was used.
fn shell_for(spec: &ShellSpec, shell: Option<Shell>) -> Result<(Shell, bool)> {
    match shell {
        Some(s) if s.spec == *spec => Ok((s, true)),
        other => {
            if let Some(s) = other {
                tracing::warn!(
                    "the VM shell given does not fit ({:?} vs {spec:?}): building one",
                    s.spec
                );
            }
            Ok((Shell::create(spec)?, false))
        }
    }
}

/// A VM built from saved state ([`from_saved`]).
pub(crate) struct Built {
    pub(crate) vm: Vm,
    /// MSRs KVM refused to restore (logged).
    pub(crate) refused_msrs: Vec<u32>,
    /// The shell given was used (it fit).
    pub(crate) shell_reused: bool,
}

/// Builds a VM from `saved`: checks `identity` against it, takes `shell` if it fits (or
/// builds one), `memory` puts guest memory over the shell's reservation (and may start a
/// page server for it); then the devices are recreated from their state with
/// `identity`'s host ends, and the VM's and each vCPU's KVM state is set. The vCPUs have
/// not run.
pub(crate) fn from_saved(
    saved: &SavedMachine,
    shell: Option<Shell>,
    memory: impl FnOnce(MemorySlot<'_>) -> Result<(GuestRam, Option<PageServer>)>,
    identity: Identity,
    steps: &mut Steps,
) -> Result<Built> {
    let created_at = Instant::now();
    let m = &saved.machine;
    check_identity(saved, &identity)?;
    let spec = ShellSpec {
        kvm_device: identity.kvm_device.clone(),
        mem_bytes: m.mem_bytes,
        vcpus: m.vcpus,
        dirty_log: identity.dirty_tracking,
    };
    let (shell, shell_reused) = shell_for(&spec, shell)?;
    steps.done("shell");
    let Shell {
        vcpus: vcpu_fds,
        vm_fd,
        memory: shell_memory,
        kvm: kvm_sys,
        cpuids,
        mut spares,
        mut uffd,
        ..
    } = shell;
    let (ram, page_server) = memory(MemorySlot {
        memory: shell_memory,
        spares: &mut spares,
        uffd: &mut uffd,
    })?;
    ram.clear_vmm_dirty();
    steps.done("memory");

    let (events_tx, events) = mpsc::channel();
    let mut devices = DeviceManager::restore(
        &vm_fd,
        &ram.mem,
        &identity.serial,
        identity.vsock.as_ref(),
        identity.disk.as_ref(),
        identity.net.as_ref(),
        &saved.devices,
        exit_notifier(&events_tx),
        DeviceThreads {
            event_loop: spare::runner_for(&mut spares, ThreadKind::DeviceLoop),
            // The shell's helper spare goes to the test device only if there is one (a
            // Linux guest's agent sync takes it otherwise: `Vm::finish_from_saved`).
            test_irq: saved
                .devices
                .test_device
                .is_some()
                .then(|| spare::runner_for(&mut spares, ThreadKind::Helper)),
        },
    )?;
    steps.done("devices");
    kvm_state::restore_vm(&vm_fd, &saved.vm)?;
    steps.done("vm_state");
    let refused_msrs = kvm_state::restore_vcpus(&vcpu_fds, &saved.vcpus, &cpuids, m.pvm_vif_base)?;
    steps.done("vcpu_state");
    // A VM built from saved state may be one of many from the same instant: a new
    // generation ID makes the guest kernel reseed its CRNG as soon as it runs. After the
    // irqchip state (which would drop the interrupt), before the vCPUs run.
    if devices.new_vm_generation(&ram.mem)? {
        steps.done("vmgenid");
    }

    let config = VmConfig {
        vcpus: m.vcpus,
        mem_mib: m.mem_bytes >> 20,
        kernel: m.kernel.clone(),
        initrd: None,
        cmdline: m.cmdline.clone(),
        serial: identity.serial,
        test_device: saved.devices.test_device.is_some(),
        kvm_device: identity.kvm_device,
        vsock: identity.vsock,
        disk: identity.disk,
        net: identity.net,
        balloon: devices.discard_log().is_some(),
    };
    let vm = Vm::from_parts(VmParts {
        vcpu_fds,
        devices,
        events: (events_tx, events),
        page_server,
        vm_fd,
        ram,
        kvm: kvm_sys,
        config,
        pvm_native: m.pvm_vif_base.is_some(),
        created_at,
        lineage: identity.lineage,
        dirty_tracking: identity.dirty_tracking,
        spares,
        unused_uffd: uffd,
        cpuids: saved.vcpus.iter().map(|v| v.cpuid.clone()).collect(),
        vcpu_cpus: identity.vcpu_cpus,
    });
    Ok(Built {
        vm,
        refused_msrs,
        shell_reused,
    })
}

/// The host ends `identity` gives must match the devices `saved` has.
fn check_identity(saved: &SavedMachine, identity: &Identity) -> Result<()> {
    match (&saved.machine.vsock, &identity.vsock) {
        (Some(_), None) => {
            return Err(Error::Config(
                "the saved VM has a vsock device: the new VM needs a socket path".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(Error::Config(
                "a vsock socket was given, but the saved VM has no vsock device".into(),
            ))
        }
        _ => {}
    }
    match (&saved.disk, &identity.disk) {
        (Some(_), None) => {
            return Err(Error::Config(
                "the saved VM has a disk: the new VM needs an overlay on its layer".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(Error::Config(
                "a disk was given, but the saved VM has no disk".into(),
            ))
        }
        _ => {}
    }
    let saved_net = saved
        .devices
        .virtio
        .iter()
        .any(|t| matches!(t.device, devices::virtio::VirtioDeviceState::Net(_)));
    match (saved_net, &identity.net) {
        (true, None) => Err(Error::Config(
            "the saved VM has a network device: the new VM needs a TAP (--net)".into(),
        )),
        (false, Some(_)) => Err(Error::Config(
            "a TAP was given, but the saved VM has no network device".into(),
        )),
        _ => Ok(()),
    }
}
