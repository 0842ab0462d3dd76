//! Clade VMM library: build, run, snapshot, restore and fork KVM virtual machines, and the
//! host layer that owns running ones.
//!
//! Where things live (data flows down this list, never back up):
//! - `config`: what a VM should be ([`VmConfig`]).
//! - `arch/`: x86_64 layout, boot protocol, CPU state, ACPI tables.
//! - `vstate/`: KVM objects: VM shells and their pool, guest memory, vCPU threads, saved
//!   KVM state, and the descriptor table they fill ([`reserve_fd_table`]).
//! - `device_manager`: which devices a VM has, where they sit, their saved state.
//! - `saved`: what a VM is saved as ([`SavedMachine`]) and where it came from.
//! - `vm`: the [`Vm`] itself: one constructor from parts, start, pause/unpause, wait,
//!   shut down, save its machine.
//! - `builder`: prepares those parts for a boot ([`boot`]) and for a VM built from saved
//!   state (restore, fork child).
//! - `persist/`: snapshots on disk: [`snapshot`] takes one, [`restore`] makes a VM from one.
//! - `fork`: [`fork`]: children sharing the parent's memory copy-on-write.
//! - [`host`]: the owner of a running VM: its loop, the control API dispatcher, the
//!   working-set policy and process-per-child fork.
//! - [`agent`]: the client of the in-guest agent; [`api`]: the control API's wire format.
//!
//! An embedding example: `vmm/examples/embed.rs`.

pub mod agent;
pub mod api;
mod arch;
mod builder;
mod config;
mod device_manager;
mod error;
mod exit;
mod fork;
pub mod host;
mod persist;
mod saved;
pub mod seccomp;
mod vm;
mod vstate;

pub use ::snapshot::page_server::{
    end_process_on_failure, PageServerStats, Prefetch, EXIT_MEMORY_UNSERVED,
};
pub use ::snapshot::{CpuCheck, SnapshotId, SnapshotKind};
pub use builder::{boot, run};
pub use config::{
    BlockConfig, NetConfig, SerialOutput, Tap, TapSource, VmConfig, VsockConfig, MIN_MEM_MIB,
};
pub use device_manager::{bind_vsock_ahead, open_tap, BoundAhead};
pub use error::{Error, Result};
pub use exit::VmExit;
pub use fork::{
    child_path, fork, fork_with_report, freeze, next_fork_seq, process_unique_cid, ChildSpec,
    ForkOptions, ForkReport, FreezeReport, Frozen, CANNOT_FORK_LIVE, MAX_FORK_CHILDREN,
};
#[cfg(feature = "test-hooks")]
pub use persist::downgrade_state_file_to_v1;
pub use persist::restore::{restore, PreparedSnapshot, RestoreOptions};
pub use persist::take::{snapshot, SnapshotInfo};
pub use persist::{MAX_DIFF_CHAIN, MEMORY_FILE, STATE_FILE, WORKING_SET_FILE};
pub use saved::{
    Lineage, MachineState, MemoryBackend, RestoreReport, SavedDisk, SavedMachine, SavedVsock,
};
pub use vm::{moved, Vm, MOVED_STEP};
/// Guest-physical address of the VM generation ID (16 bytes), in VMs that have one.
pub const VMGENID_ADDR: u64 = arch::layout::VMGENID_ADDR;
pub use vstate::fdtable::reserve_fd_table;
pub use vstate::memory::host_mem_mib;
pub use vstate::pool::ShellPool;
pub use vstate::shell::{Shell, ShellSpec};
pub use vstate::vcpu::{pin_current_thread, CpuPin};
