//! [`Vm`]: one virtual machine, however it was made (booted, restored from a snapshot,
//! forked), and everything done to it while it exists: start, pause and unpause, wait,
//! shut down, save its state.
//!
//! A `Vm` is put together in one place, [`Vm::from_parts`], from the parts the builder
//! prepares for a boot, a restore or a fork child. Snapshot, restore and fork are modules
//! above this one: they call its methods ([`Vm::pause_guard`], [`Vm::save_machine`],
//! [`Vm::take_dirty`], ...) and never reach into it otherwise.
//!
//! Its methods are split by concern, one file each:
//! - `lifecycle.rs`: start, pin, pause and unpause, wait, shut down; the
//!   [`PauseGuard`](lifecycle::PauseGuard).
//! - `inspect.rs`: what it tells about itself (configuration, memory, counters).
//! - `save.rs`: its machine state and its disk, saved for a snapshot or a fork.
//! - `freeze.rs`: freezing its guest memory ([`FreezePlan`]) and the dirty log.
//! - `spare_shell.rs`: the pre-built shell it moves onto at a freeze, and shells made
//!   ready for a fork's children.
//! - `restored.rs`: finishing a restore; the page server's working set; its lineage.

mod discarded;
mod freeze;
mod inspect;
mod lifecycle;
mod restored;
mod save;
mod spare_shell;

use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use snapshot::page_server::PageServer;

use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::error::Error;
use crate::exit::{VmEvent, VmExit};
use crate::saved::{Lineage, RestoreReport};
use crate::vstate::memory::{FrozenImage, GuestRam};
use crate::vstate::spare::SpareThread;
use crate::vstate::vcpu::VcpuHandle;

pub(crate) use freeze::FreezePlan;
pub use spare_shell::{moved, MOVED_STEP};
use spare_shell::{RetiredVm, SpareShell};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunState {
    Built,
    Running,
    Paused,
    Ended,
}

impl RunState {
    fn name(self) -> &'static str {
        match self {
            RunState::Built => "not started",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Ended => "ended",
        }
    }
}

/// A virtual machine. Dropping it stops the vCPUs and frees everything.
pub struct Vm {
    // Field order is drop order: vCPU threads stop before devices and the VM fd go, and the VM
    // fd is closed before guest memory is unmapped.
    vcpus: Vec<VcpuHandle>,
    pending_vcpus: Vec<VcpuFd>,
    devices: DeviceManager,
    events: Receiver<VmEvent>,
    events_tx: Sender<VmEvent>,
    /// Serves guest memory on demand after a `uffd` restore (stops before memory goes).
    page_server: Option<PageServer>,
    vm_fd: VmFd,
    ram: GuestRam,
    kvm: Kvm,
    config: VmConfig,
    pvm_native: bool,
    created_at: Instant,
    state: RunState,
    exit: Option<VmExit>,
    /// The snapshot this VM's memory last matched (taken or restored from): the base of the
    /// next diff snapshot.
    lineage: Option<Lineage>,
    /// How the restore that made this VM went.
    restore_report: Option<RestoreReport>,
    /// False while a page server records a working set that was not yet written (or, in
    /// a run that prefetched one, still notes the pages it faults in beyond it).
    working_set_saved: bool,
    /// The memory slots log dirty pages (diff snapshots possible).
    dirty_tracking: bool,
    /// Threads started ahead of time (from a VM shell) for the vCPUs, the device loop, a
    /// page server, a helper. Those left unused stay parked here until the VM ends: a
    /// thread's end unmaps its stack, which interrupts every VM of the process (each
    /// one's KVM is told of the unmap, and the other CPUs flush their TLBs), so not while
    /// a fork's children start.
    spares: Vec<SpareThread>,
    /// The shell's userfaultfd when no page server took it; closed when the VM ends:
    /// closing one walks the process's whole address space under its lock, which in a
    /// process of many VMs (a fork's children) delays every vCPU's page faults.
    #[allow(dead_code)]
    unused_uffd: Option<snapshot::page_server::PreparedUffd>,
    /// The CPUID set on each vCPU (saved in snapshots).
    cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    /// Host CPUs the vCPU threads are pinned to (vCPU `i` on `vcpu_cpus[i % len]`).
    vcpu_cpus: Vec<usize>,
    /// The post-restore agent sync's outcome, once it arrives.
    agent_sync: Option<Receiver<std::result::Result<Duration, String>>>,
    /// Forked memory: the pages written since it was frozen that a snapshot already took
    /// out of the dirty log (the fork module's business).
    fork_carry: Vec<Vec<u64>>,
    /// A pre-built shell of this VM's shape that its next freeze moves it onto, made
    /// ready when it was given ([`Vm::give_shell`]).
    spare_shell: Option<SpareShell>,
    /// See [`Vm::image_ahead`].
    ahead_image: Option<Arc<FrozenImage>>,
    /// The KVM VM and memory mapping the last freeze moved away from, still to be torn
    /// down ([`Vm::unmap_retired_memory`]).
    retired_vm: Option<RetiredVm>,
}

/// Everything a [`Vm`] is made of, prepared by the builder for a boot, a restore or
/// a fork child. Devices are created and the KVM state (boot registers, or saved state)
/// is set; the vCPUs have not run.
pub(crate) struct VmParts {
    pub(crate) vcpu_fds: Vec<VcpuFd>,
    pub(crate) devices: DeviceManager,
    pub(crate) events: (Sender<VmEvent>, Receiver<VmEvent>),
    pub(crate) page_server: Option<PageServer>,
    pub(crate) vm_fd: VmFd,
    pub(crate) ram: GuestRam,
    pub(crate) kvm: Kvm,
    pub(crate) config: VmConfig,
    pub(crate) pvm_native: bool,
    pub(crate) created_at: Instant,
    pub(crate) lineage: Option<Lineage>,
    pub(crate) dirty_tracking: bool,
    pub(crate) spares: Vec<SpareThread>,
    pub(crate) unused_uffd: Option<snapshot::page_server::PreparedUffd>,
    pub(crate) cpuids: Vec<Vec<kvm_bindings::kvm_cpuid_entry2>>,
    pub(crate) vcpu_cpus: Vec<usize>,
}

impl Vm {
    /// The one place a `Vm` is put together (boot, restore and fork all come here).
    pub(crate) fn from_parts(p: VmParts) -> Vm {
        let served = p.page_server.is_some();
        Vm {
            vcpus: Vec::new(),
            pending_vcpus: p.vcpu_fds,
            devices: p.devices,
            events_tx: p.events.0,
            events: p.events.1,
            page_server: p.page_server,
            vm_fd: p.vm_fd,
            ram: p.ram,
            kvm: p.kvm,
            config: p.config,
            pvm_native: p.pvm_native,
            created_at: p.created_at,
            state: RunState::Built,
            exit: None,
            lineage: p.lineage,
            restore_report: None,
            working_set_saved: !served,
            dirty_tracking: p.dirty_tracking,
            spares: p.spares,
            unused_uffd: p.unused_uffd,
            cpuids: p.cpuids,
            vcpu_cpus: p.vcpu_cpus,
            agent_sync: None,
            fork_carry: Vec::new(),
            spare_shell: None,
            ahead_image: None,
            retired_vm: None,
        }
    }

    fn invalid(&self, op: &'static str) -> Error {
        Error::InvalidState {
            state: self.state.name(),
            op,
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.stop_vcpus();
        self.finish_working_set();
    }
}
