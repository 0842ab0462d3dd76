//! Clade VMM library: build and run KVM virtual machines.
//!
//! Where things live:
//! - [`config`]: what a VM should be ([`VmConfig`]).
//! - [`builder`]: turns a config into a [`Vm`].
//! - [`vm`]: the [`Vm`] handle (start, pause, resume, wait, shutdown).
//! - [`vstate`]: KVM objects: the VM fd, guest memory, vCPU threads.
//! - [`arch`]: x86_64 layout, boot protocol, CPU state, ACPI tables.
//! - [`device_manager`]: which devices a VM has and where they sit.
//! - [`persist`]: snapshots ([`Vm::snapshot`]) and resuming them ([`Vm::resume`]).
//! - [`pool`]: pre-built VM shells that make a resume fast.

pub mod agent;
pub mod api;
pub mod arch;
pub mod builder;
pub mod config;
pub mod device_manager;
pub mod error;
pub mod fork;
pub mod persist;
pub mod pool;
pub mod vm;
pub mod vstate;

pub use config::{SerialOutput, VmConfig};
pub use error::{Error, Result};
pub use fork::{ForkOptions, ForkReport};
pub use persist::{MemoryBackend, ResumeOptions, SnapshotKind};
pub use vm::{ExitStatus, Vm};
