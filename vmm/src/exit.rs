//! How a VM ends ([`VmExit`]) and how its vCPU threads and devices tell its owner.
//!
//! This sits below everything that runs a VM (vCPU threads, devices, [`crate::Vm`]) so
//! that they all report through one channel without importing each other.

use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use devices::{ExitNotifier, GuestExit};

/// How a VM ended. (A guest *process*'s end is [`crate::agent::ExitStatus`].)
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmExit {
    /// The guest powered off (ACPI S5).
    PowerOff,
    /// The guest reset the machine (reboot, or a panic with `panic=N`); Clade does not reboot.
    Reset,
    /// The project's test guest reported this result code.
    TestExit(u32),
    /// The guest or KVM failed: triple fault, entry failure, internal error.
    Crashed(String),
    /// The host stopped the VM ([`crate::Vm::shutdown`]).
    Stopped,
}

impl VmExit {
    /// Process exit code for the `clade` binary: 0 for a power off, the guest's code for the
    /// test guest (255 if it does not fit), 2 for a reset, 1 for a crash, 0 when stopped.
    pub fn exit_code(&self) -> i32 {
        match self {
            VmExit::PowerOff | VmExit::Stopped => 0,
            VmExit::TestExit(c) => (*c).min(255) as i32,
            VmExit::Reset => 2,
            VmExit::Crashed(_) => 1,
        }
    }
}

impl std::fmt::Display for VmExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VmExit::PowerOff => write!(f, "guest powered off"),
            VmExit::Reset => write!(f, "guest reset the machine (reboot or panic)"),
            VmExit::TestExit(c) => write!(f, "test guest exited with code {c:#x}"),
            VmExit::Crashed(why) => write!(f, "guest crashed: {why}"),
            VmExit::Stopped => write!(f, "stopped by the host"),
        }
    }
}

/// Messages from vCPU threads and devices to the VM's owner.
#[derive(Debug)]
pub(crate) enum VmEvent {
    /// The VM must end this way.
    Exit(VmExit),
}

/// The callback devices use to end the VM: a [`VmEvent::Exit`] to the owner.
pub(crate) fn exit_notifier(events_tx: &Sender<VmEvent>) -> ExitNotifier {
    let exit_tx = Mutex::new(events_tx.clone());
    Arc::new(move |e: GuestExit| {
        let status = match e {
            GuestExit::PowerOff => VmExit::PowerOff,
            GuestExit::Reset => VmExit::Reset,
            GuestExit::TestExit(c) => VmExit::TestExit(c),
        };
        let tx = exit_tx.lock().unwrap_or_else(|p| p.into_inner());
        let _ = tx.send(VmEvent::Exit(status));
    })
}
