//! Assembles a [`Vm`] from a [`VmConfig`]: KVM VM, guest memory, vCPUs, boot state, devices.
//! Nothing runs until [`Vm::start`].

use std::sync::{mpsc, Arc};
use std::time::Instant;

use devices::{ExitNotifier, GuestExit};
use kvm_bindings::KVM_MAX_CPUID_ENTRIES;

use crate::arch::boot::{self, BootSpec};
use crate::arch::layout::{PVM_VIF_BASE, PVM_VIF_MAX};
use crate::arch::{acpi, cpuid, regs};
use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::error::{Error, Result};
use crate::vm::{ExitStatus, Vm, VmEvent};
use crate::vstate::{kvm, memory, vcpu};

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

    let kvm = kvm::open(&config.kvm_device)?;
    let max = kvm::max_vcpus(&kvm);
    if config.vcpus > max {
        return Err(Error::TooManyVcpus {
            requested: config.vcpus,
            max,
        });
    }
    let vm_fd = kvm::create_vm(&kvm)?;
    let mem_bytes = config.mem_mib << 20;
    let ram = memory::create(mem_bytes)?;
    kvm::set_memory_slots(&vm_fd, &ram.mem)?;
    kvm::create_irqchip(&vm_fd)?;

    let mut vcpu_fds = Vec::with_capacity(config.vcpus as usize);
    for i in 0..config.vcpus {
        vcpu_fds.push(
            vm_fd
                .create_vcpu(u64::from(i))
                .map_err(Error::kvm("KVM_CREATE_VCPU"))?,
        );
    }

    // On this project's PVM hypervisor, guests run natively only once each vCPU has a
    // virtual-interrupt-flag cell; elsewhere the probe finds no such MSR.
    let pvm_native = kvm::register_pvm_vif(&vcpu_fds[0], PVM_VIF_BASE)?;
    let mut cmdline = config.cmdline.clone();
    if pvm_native {
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
    let exit_tx = std::sync::Mutex::new(events_tx.clone());
    let exit: ExitNotifier = Arc::new(move |e: GuestExit| {
        let status = match e {
            GuestExit::PowerOff => ExitStatus::PowerOff,
            GuestExit::Reset => ExitStatus::Reset,
            GuestExit::TestExit(c) => ExitStatus::TestExit(c),
        };
        let tx = exit_tx.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(VmEvent::Exit(status));
    });
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

    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::kvm("KVM_GET_SUPPORTED_CPUID"))?;
    for (i, fd) in vcpu_fds.iter().enumerate() {
        let cpuid = cpuid::for_vcpu(&supported, i as u32, config.vcpus);
        vcpu::configure_for_boot(fd, &cpuid, boot_info.entry)?;
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
        vm_fd,
        ram,
        _kvm: kvm,
        config,
        pvm_native,
        created_at,
        state: Vm::initial_state(),
        exit: None,
    })
}
