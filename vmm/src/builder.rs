//! Assembles a [`Vm`] from a [`VmConfig`]: KVM VM, guest memory, vCPUs, boot state, devices.
//! Nothing runs until [`Vm::start`].

use std::sync::mpsc;
use std::time::Instant;

use crate::arch::boot::{self, BootSpec};
use crate::arch::layout::{PVM_VIF_BASE, PVM_VIF_MAX};
use crate::arch::{acpi, regs};
use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::error::{Error, Result};
use crate::vm::Vm;
use crate::vstate::memory::{self, GuestRam};
use crate::vstate::shell::{Shell, ShellSpec};
use crate::vstate::{kvm, vcpu};

/// Command-line key telling the test guest where its PVM VIF cell is.
pub const PVM_VIF_CMDLINE_KEY: &str = "clade.vif";

/// Builds the VM described by `config`.
pub fn build(config: VmConfig) -> Result<Vm> {
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

    let mem_bytes = config.mem_mib << 20;
    // The same pre-built VM a resume uses: slots over reserved address space, irqchip,
    // vCPUs; then fresh memory over the reservation.
    let Shell {
        vcpus: vcpu_fds,
        vm_fd,
        reservation,
        kvm,
        cpuids,
        spares,
        ..
    } = Shell::create(&ShellSpec {
        kvm_device: config.kvm_device.clone(),
        mem_bytes,
        vcpus: config.vcpus,
        // Booted VMs always log dirty pages, so that diff snapshots can be taken (one write
        // fault per page per snapshot interval).
        dirty_log: true,
    })?;
    let ram = GuestRam::memfd(reservation)?;

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
    let exit = crate::vm::exit_notifier(&events_tx);
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
    for slot in devices.virtio_slots() {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(&slot.cmdline_entry());
    }

    regs::write_boot_tables(&ram.mem)?;
    acpi::write_tables(&ram.mem, config.vcpus, devices.virtio_slots())?;
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
    Ok(Vm {
        vcpus: Vec::new(),
        pending_vcpus: vcpu_fds,
        devices,
        events,
        events_tx,
        page_server: None,
        vm_fd,
        ram,
        _kvm: kvm,
        config,
        pvm_native,
        created_at,
        state: Vm::initial_state(),
        exit: None,
        lineage: None,
        resume_report: None,
        working_set_saved: true,
        dirty_tracking: true,
        agent_sync: None,
        fork_carry: Vec::new(),
        vcpu_cpus: Vec::new(),
        cpuids,
        spares,
    })
}
